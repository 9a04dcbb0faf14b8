"""llama.cpp on several GPUs (``--engine llama.cpp --gpu A --gpu B``): ``-sm layer -ts``.

The layer assignment is read from llama.cpp's ``llama_model::load_tensors`` (module docstring
of :mod:`moefit.external.llamacpp.split`); it is checked against a published four-GPU log
(``tests/data/llamacpp_cuda/qwen3-30b-a3b-q8_0-4xk80.log``, ggml-org/llama.cpp issue #13661):
the KV buffer of each device and the device buffers that hold its layers' experts, to the
printed precision (0.01 MiB, as the single-device CUDA log tests check the KV cache).
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("gguf")

from moefit.cli import main  # noqa: E402
from moefit.devices import find_gpu  # noqa: E402
from moefit.errors import InputError  # noqa: E402
from moefit.external import llamacpp as lc  # noqa: E402
from moefit.ingest.resolve import load_model  # noqa: E402
from moefit.units import MIB  # noqa: E402

LOG = Path(__file__).parent / "data" / "llamacpp_cuda" / "qwen3-30b-a3b-q8_0-4xk80.log"


def printed(n_bytes: int) -> float:
    """Bytes as llama.cpp prints them: MiB, two decimals."""
    return round(n_bytes / MIB, 2)


def buffers(text: str, what: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2))
            for m in re.finditer(rf"\s(CUDA\d) {what} buffer size =\s+([\d.]+) MiB", text)}


@pytest.fixture(scope="module")
def qwen30():
    geom = load_model("Qwen3-30B-A3B")
    tensors, _ = lc.tensors_from_geometry(geom, "Q8_0")
    return geom, tensors


def test_ts_counts_give_contiguous_layers_and_the_output_to_the_last_device():
    # -ts c_0,c_1,... summing to n_layer + 1: device i gets the next c_i layers, the output
    # layer (index n_layer) the last device; float32 split points as llama.cpp computes them
    for counts in [(25, 24), (13, 12, 12, 12), (1, 48), (48, 1), (7, 30, 12)]:
        owner = lc.layer_devices(48, tuple(float(c) for c in counts))
        assert owner[-1] == len(counts) - 1
        got = [owner.count(i) for i in range(len(counts))]
        assert got == list(counts)
        assert list(owner) == sorted(owner)
    # llama.cpp's default (no -ts: shares by free memory) on four equal cards
    assert [lc.layer_devices(48, (1.0,) * 4)[:48].count(i) for i in range(4)] == [13, 12, 12, 11]
    with pytest.raises(InputError, match="-ts"):
        lc.layer_devices(48, (0.0, 0.0))


def test_four_gpu_log_kv_per_device(qwen30):
    # Qwen3-30B-A3B on four equal K80 GPUs, no -ts (shares by free memory): layers 13 / 12 /
    # 12 / 11 + output; the build pads n_ctx to 32 without flash attention (30016 cells)
    geom, _ = qwen30
    text = LOG.read_text()
    assert re.search(r"# Source: \S+ issue #13661 \(https://github.com/", text)
    cells = int(re.search(r"n_ctx_slot = (\d+)", text).group(1))
    owner = lc.layer_devices(geom.num_layers, (1.0,) * 4)
    kv = {f"CUDA{d}": lc.kv_price(geom, cells, 512, "f16", "f16", lc.CUDA,
                                  only=frozenset(i for i in range(geom.num_layers) if owner[i] == d),
                                  pad=lc.CTX_PAD_NO_FA) for d in range(4)}
    assert all(k.cells == cells == 30016 for k in kv.values())
    logged = buffers(text, "KV")
    assert logged == {"CUDA2": 703.50, "CUDA3": 644.88}
    assert {d: printed(kv[d].kv_bytes) for d in logged} == logged
    total = float(re.search(r"KV self size\s+=\s+([\d.]+) MiB", text).group(1))
    assert printed(sum(k.kv_bytes for k in kv.values())) == total == 2814.00


def test_four_gpu_log_model_buffers_hold_their_layers_experts(qwen30):
    # -sm row: the 2-D matrices go to the CUDAn_Split buffers, each layer's expert tensors
    # (3-D, no row split) and its f32 tensors stay in its device's buffer, so "CUDAn model
    # buffer" is the experts + norms + router of the layers that device holds (13 / 12 / 12).
    # CUDA1's 12 routers (ffn_gate_inp, 1 MiB each) were placed in its split buffer in this
    # log; row split itself is not planned, so that placement is not modelled
    geom, tensors = qwen30
    m = lc.split_model(geom, tensors)
    owner = lc.layer_devices(m.n_layer, (1.0,) * 4)
    logged = buffers(LOG.read_text(), "model")

    def on(d: int, keep) -> int:
        layers = {i for i in range(m.n_layer) if owner[i] == d}
        small = sum(t.alloc_bytes(lc.CUDA) for t in tensors if t.kind == "F32" and keep(t.name)
                    and t.name.startswith("blk.") and int(t.name.split(".")[1]) in layers)
        return sum(m.experts[i] for i in layers) + small

    assert printed(on(0, lambda n: True)) == logged["CUDA0"] == 7969.22
    assert printed(on(2, lambda n: True)) == logged["CUDA2"] == 7356.20
    assert printed(on(1, lambda n: "ffn_gate_inp" not in n)) == logged["CUDA1"] == 7344.20


def test_per_device_kv_adds_up_to_the_one_device_cache(qwen30):
    geom, tensors = qwen30
    plan = lc.solve_split(geom, tensors, (find_gpu("RTX 4090"), find_gpu("RTX 3090")),
                          lc.LlamaRequest(context=32768, type_k="q8_0", type_v="q8_0"))
    whole = lc.kv_price(geom, 32768, 512, "q8_0", "q8_0", lc.CUDA)
    assert sum(s.kv.kv_bytes for s in plan.shares) == whole.kv_bytes
    assert sum(len(s.layers) for s in plan.shares) == geom.num_layers
    assert [s.output for s in plan.shares] == [False, True]


def test_the_printed_command_places_the_planned_layers(qwen30):
    geom, tensors = qwen30
    devices = (find_gpu("RTX 5060 Ti 16GB"), find_gpu("RTX 5060 Ti 16GB"))
    for context in (8192, 131072):
        plan = lc.solve_split(geom, tensors, devices, lc.LlamaRequest(context=context))
        assert plan.fits
        argv = shlex.split(plan.command)
        assert argv[0] == "llama-server" and argv[argv.index("-sm") + 1] == "layer"
        ts = tuple(float(x) for x in argv[argv.index("-ts") + 1].split(","))
        owner = lc.layer_devices(geom.num_layers, ts)
        assert [range(owner.index(i), len(owner) - owner[::-1].index(i) - (1 if i == 1 else 0))
                for i in range(2)] == [s.layers for s in plan.shares]
        assert "-fit off" in plan.command and "-ngl 999" in plan.command


def test_pipeline_copies_only_without_experts_on_the_cpu(qwen30):
    # llama_context enables pipeline parallelism only without tensor overrides (--n-cpu-moe is
    # one): 3 more copies of each device's inputs (KQ mask, hidden state, positions)
    geom, tensors = qwen30
    m = lc.split_model(geom, tensors)
    dev = find_gpu("RTX 4090")
    req = lc.LlamaRequest(context=32768)
    a = lc.split.price_share(m, dev, range(0, 24), False, True, req, 512, 0, 2)
    b = lc.split.price_share(m, dev, range(0, 24), False, True, req, 512, 1, 2)
    extra = 3 * (2 * 512 * 32768 + 4 * 512 * geom.hidden_size + 4 * 512)
    assert a.compute.bytes - (b.compute.bytes - b.compute.weight_copy) == extra
    assert b.compute.weight_copy == m.largest_expert


def test_cli_plans_two_cards_and_prints_a_table_each(capsys):
    rc = main(["plan", "Qwen3-30B-A3B", "--engine", "llama.cpp", "--gpu", "RTX 4090", "--gpu", "RTX 3090",
               "--max-context", "32K"])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.count("VRAM budget") == 2 and "RTX 4090" in out and "RTX 3090" in out
    cmd = out.strip().splitlines()[-1]
    assert cmd.startswith("command  llama-server ") and " -sm layer -ts " in cmd
    rc = main(["plan", "Qwen3-30B-A3B", "--engine", "llama.cpp", "--gpu", "RTX 5060 Ti 16GB x2",
               "--max-context", "32K", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["split_mode"] == "layer" and len(doc["devices"]) == 2
    assert sum(doc["tensor_split"]) == 49 and doc["devices"][1]["output"] is True


def test_a_device_that_is_short_is_named_exit_3_with_fits_with(capsys):
    rc = main(["plan", "Qwen3-235B-A22B", "--engine", "llama.cpp", "--gpu", "RTX 5060 Ti 16GB x2",
               "--max-context", "256K", "--host-ram", "1TiB"])
    out = capsys.readouterr().out
    assert rc == 3
    short = re.search(r"does not fit: short by ([\d.]+) GiB on (cuda:\d)", out)
    assert short, out
    assert "fits with:" in out and "--max-context" in out
    ctx = int(re.search(r"--max-context (\d+)", out).group(1))
    geom = load_model("Qwen3-235B-A22B")
    tensors, _ = lc.tensors_from_geometry(geom, "Q4_K_M")
    devices = (find_gpu("RTX 5060 Ti 16GB"),) * 2
    req = lc.LlamaRequest(context=262144, gguf="Qwen3-235B-A22B-Q4_K_M.gguf")
    assert lc.solve_split(geom, tensors, devices, replace(req, context=ctx), alternatives=False).fits
    assert not lc.solve_split(geom, tensors, devices, replace(req, context=ctx + 1), alternatives=False).fits


def test_simulated_devices_are_refused(capsys):
    rc = main(["plan", "Qwen3-30B-A3B", "--engine", "llama.cpp", "--device", "cpu", "--vram", "8GiB,8GiB"])
    assert rc == 2
    assert "CUDA cards" in capsys.readouterr().err


def test_max_context_max_on_two_cards(capsys):
    # YaRN x8 lifts the window to 327680 tokens, past what two 16 GB cards hold: the answer
    # fits and one 256-cell block more does not
    flags = ["plan", "Qwen3-30B-A3B", "--engine", "llama.cpp", "--gpu", "RTX 5060 Ti 16GB x2",
             "--rope-scaling", "yarn", "--rope-scale", "8"]
    assert main([*flags, "--max-context", "max"]) == 0
    out = capsys.readouterr().out
    best = int(re.search(r"largest context that fits at -ub 512: (\d+) tokens", out).group(1))
    assert best % lc.CTX_PAD == 0 and 32768 < best < 327680
    assert main([*flags, "--max-context", str(best)]) == 0
    assert main([*flags, "--max-context", str(best + lc.CTX_PAD)]) == 3
    capsys.readouterr()
