"""``moefit plan --engine llama.cpp`` against what the real llama.cpp allocated.

``tests/data/llamacpp/*.txt`` were recorded once by ``benchmarks/record_llamacpp.py`` with the
llama.cpp CPU tools (commit 0c1e570): per model the GGUF metadata (``.meta``) and tensor infos
(``.tensors``), then per run (``.run`` + the command) the buffer sizes llama.cpp printed. The
tests rebuild each model's header as a sparse GGUF (no tensor data), plan it with the
llama.cpp memory model on the CPU backend, and compare: the model buffer and every KV buffer
at the printed precision (MiB, 2 decimals), the recurrent-state buffer at the printed precision, the KV cells exactly, the compute buffer (printed
with 4 decimals in the verbose log) within 5%. llama.cpp itself is not needed.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf")

from moefit.devices import Device, find_gpu  # noqa: E402
from moefit.external import llamacpp as lc  # noqa: E402
from moefit.errors import InputError  # noqa: E402
from moefit.ingest.resolve import load_model  # noqa: E402
from moefit.memory.runtime import default_reserve_bytes, runtime_bytes  # noqa: E402

DATA = Path(__file__).parent / "data" / "llamacpp"
RECORDS = sorted(DATA.glob("*.txt"))
MIB = 1 << 20
GIB = 1 << 30


# ---- recorded runs ------------------------------------------------------------------------------
def parse_record(path: Path) -> dict:
    """{"meta": [(key, type, value)], "tensors": [(name, type, ne)], "runs": [(argv, [lines])]}"""
    out = {"meta": [], "tensors": [], "runs": []}
    section = None
    for line in path.read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        if line in (".meta", ".tensors"):
            section = line[1:]
        elif line.startswith(".run "):
            section = "runs"
            out["runs"].append((shlex.split(line[5:]), []))
        elif section == "meta":
            key, kind, value = line.split(" ", 2)
            out["meta"].append((key, kind, value))
        elif section == "tensors":
            name, kind, ne = line.split(" ")
            out["tensors"].append((name, kind, tuple(int(n) for n in ne.split(","))))
        elif section == "runs":
            out["runs"][-1][1].append(line)
    return out


def header_writer():
    """``benchmarks/write_header_gguf.py`` (the one writer of header-only GGUFs)."""
    import importlib.util

    path = Path(__file__).parent.parent / "benchmarks" / "write_header_gguf.py"
    spec = importlib.util.spec_from_file_location("write_header_gguf", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def sparse_gguf(path: Path, meta, tensors) -> Path:
    """A GGUF with ``meta`` and the infos of ``tensors`` whose data is a hole (``truncate``):
    ``benchmarks/write_header_gguf.py``'s writer."""
    return header_writer().write_sparse(path, meta, tensors)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """name -> (record, geometry, tensors) for every recorded model."""
    out = {}
    for path in RECORDS:
        rec = parse_record(path)
        f = sparse_gguf(tmp_path_factory.mktemp("gguf") / f"{path.stem}.gguf", rec["meta"], rec["tensors"])
        out[path.stem] = (rec, load_model(str(f)), lc.tensors_from_header(str(f)))
    return out


def _flag(argv, name, default=None):
    return argv[argv.index(name) + 1] if name in argv or default is None else default


def _mib(line: str) -> str:
    return re.search(r"=\s*([0-9.]+) MiB", line).group(1)


def _runs():
    for path in RECORDS:
        for i, (argv, _) in enumerate(parse_record(path)["runs"]):
            yield pytest.param(path.stem, i, id=f"{path.stem}-c{_flag(argv, '-c')}-ub{_flag(argv, '-ub')}"
                                               f"-{_flag(argv, '-ctk')}-np{_flag(argv, '-np', '1')}")


def test_the_records_cover_three_families_and_several_settings():
    recs = {p.stem: parse_record(p) for p in RECORDS}
    archs = {next(v for k, _, v in r["meta"] if k == "general.architecture") for r in recs.values()}
    assert {"qwen3moe", "gpt-oss", "qwen35moe"} <= archs      # dense attention, SWA, hybrid recurrent
    kinds = {k for r in recs.values() for _, k, _ in r["tensors"]}
    assert {"Q8_0", "MXFP4", "Q4_K", "Q6_K"} <= kinds          # quantized experts, llama-quantize's mix
    for r in recs.values():
        settings = {(_flag(a, "-c"), _flag(a, "-ub"), _flag(a, "-ctk")) for a, _ in r["runs"]}
        assert len({c for c, _, _ in settings}) >= 3 and len({u for _, u, _ in settings}) >= 3
        assert len({t for _, _, t in settings}) >= 3


@pytest.mark.parametrize("name,index", list(_runs()))
def test_plan_equals_what_llamacpp_allocated(recorded, name, index):
    rec, geom, tensors = recorded[name]
    argv, lines = rec["runs"][index]
    ctx, ub, b = int(_flag(argv, "-c")), int(_flag(argv, "-ub")), int(_flag(argv, "-b"))
    tk, tv = _flag(argv, "-ctk"), _flag(argv, "-ctv")
    n_seq = int(_flag(argv, "-np", "1"))
    kv = lc.kv_price(geom, ctx, min(ub, b), tk, tv, lc.CPU, n_seq)
    ub = min(ub, b, kv.n_ctx)                   # llama.cpp: n_batch = min(n_ctx, n_batch)

    model = next(l for l in lines if "CPU model buffer size" in l)
    assert f"{lc.cpu_model_buffer(tensors) / MIB:.2f}" == _mib(model)

    kv = lc.kv_price(geom, ctx, ub, tk, tv, lc.CPU, n_seq)
    assert int(next(m for l in lines if (m := re.search(r"n_ctx\s+= (\d+)", l))).group(1)) == kv.n_ctx
    printed = [_mib(l) for l in lines if "CPU KV buffer size" in l]
    cells = [int(re.search(r"\(\s*(\d+) cells", l).group(1)) for l in lines if "llama_kv_cache: size" in l]
    want = [(kv.bytes_full, kv.cells)] if not kv.swa_layers else [(kv.bytes_full, kv.cells), (kv.bytes_swa, kv.swa_cells)]
    assert printed == [f"{b / MIB:.2f}" for b, _ in want]
    assert cells == [c for _, c in want]
    output = next(l for l in lines if "output buffer size" in l)
    assert _mib(output) == f"{4 * geom.vocab_size * n_seq / MIB:.2f}"       # logits of one token per sequence
    rs = [_mib(l) for l in lines if "CPU RS buffer size" in l]
    assert rs == ([f"{kv.recurrent_bytes / MIB:.2f}"] if kv.recurrent_layers else [])

    measured = float(re.search(r"size is\s+([0-9.]+) MiB", next(l for l in lines if "compute buffer size is" in l)).group(1)) * MIB
    planned = lc.compute_price(geom, tensors[0].ne[1] if tensors[0].name == "token_embd.weight" else
                               next(t.ne[1] for t in tensors if t.name == "token_embd.weight"),
                               ub, kv, tk, tv, lc.CPU).bytes
    assert abs(planned / measured - 1) <= 0.05, (planned, measured)


def test_the_wide_model_measures_the_activations_not_the_logits(recorded):
    """qwen3moe-wide has a 259-token vocabulary: its compute buffer is the layer phase (KQ mask
    and activations) in every run, so the per-token activation terms are what is compared."""
    rec, geom, tensors = recorded["qwen3moe-wide"]
    assert geom.vocab_size < 300
    for argv, _ in rec["runs"]:
        ub = int(_flag(argv, "-ub"))
        kv = lc.kv_price(geom, int(_flag(argv, "-c")), ub, _flag(argv, "-ctk"), _flag(argv, "-ctv"), lc.CPU)
        c = lc.compute_price(geom, geom.vocab_size, ub, kv, _flag(argv, "-ctk"), _flag(argv, "-ctv"), lc.CPU)
        assert c.layer_phase > c.end_phase and c.logits < 0.05 * c.bytes


def test_the_long_context_run_is_priced_by_the_layer_phase(recorded):
    """At 327680 cells and -ub 64 the f16 KQ mask (40 MiB) outgrows the logits (37 MiB): the
    recorded compute buffer follows the mask, and so does the plan."""
    rec, geom, tensors = recorded["qwen3moe-q8"]
    kv = lc.kv_price(geom, 327680, 64, "q4_0", "q4_0", lc.CPU)
    c = lc.compute_price(geom, 151936, 64, kv, "q4_0", "q4_0", lc.CPU)
    assert c.layer_phase > c.end_phase and c.mask == 2 * 64 * 327680


# ---- CUDA allocation rules (from the source; not measured here) ------------------------------------
def test_cuda_pads_quantized_rows_to_512_elements_and_aligns_to_128_bytes():
    # gpt-oss: ne0 = 2880 is not a multiple of 512: + 192 elements of Q8_0 = 6 blocks x 34 B
    t = lc.Tensor("blk.0.attn_q.weight", "Q8_0", (2880, 4096), 2880 * 4096 // 32 * 34)
    assert t.alloc_bytes(lc.CUDA) == -(-(t.nbytes + 6 * 34) // 128) * 128
    assert t.alloc_bytes(lc.CPU) == t.nbytes                  # already 32-aligned, no row padding
    f = lc.Tensor("blk.0.attn_norm.weight", "F32", (2880,), 2880 * 4)
    assert f.alloc_bytes(lc.CUDA) == -(-2880 * 4 // 128) * 128   # floats: alignment only


def test_cuda_flash_attention_holds_f16_copies_of_a_quantized_cache():
    g = load_model("Qwen3-30B-A3B")
    kv = lc.kv_price(g, 32768, 512, "q8_0", "q8_0", lc.CUDA)
    cuda = lc.compute_price(g, g.vocab_size, 512, kv, "q8_0", "q8_0", lc.CUDA)
    cpu = lc.compute_price(g, g.vocab_size, 512, kv, "q8_0", "q8_0", lc.CPU)
    k_dim = 4 * 128                                          # 4 KV heads x 128
    assert cuda.fa_f16 == 2 * (32768 * k_dim * 2) and cpu.fa_f16 == 0
    f16 = lc.compute_price(g, g.vocab_size, 512, kv, "f16", "f16", lc.CUDA)
    assert f16.fa_f16 == 0


def test_cuda_copies_a_host_expert_tensor_for_a_large_enough_micro_batch():
    g = load_model("Qwen3-30B-A3B")
    kv = lc.kv_price(g, 8192, 512, "f16", "f16", lc.CUDA)
    big = 64 << 20
    with_copy = lc.compute_price(g, g.vocab_size, 512, kv, "f16", "f16", lc.CUDA, big)
    without = lc.compute_price(g, g.vocab_size, 512, kv, "f16", "f16", lc.CUDA)
    assert with_copy.layer_phase - without.layer_phase == big
    small = lc.kv_price(g, 8192, 16, "f16", "f16", lc.CUDA)      # below GGML_OP_OFFLOAD_MIN_BATCH
    assert lc.compute_price(g, g.vocab_size, 16, small, "f16", "f16", lc.CUDA, big).weight_copy == 0
    assert lc.compute_price(g, g.vocab_size, 512, kv, "f16", "f16", lc.CPU, big).weight_copy == 0


def test_mla_caches_the_latent_and_the_rope_key_only():
    g = load_model("DeepSeek-V2-Lite")
    kv = lc.kv_price(g, 4000, 512, "f16", "f16", lc.CPU)
    assert kv.n_ctx == 4096 and kv.full_layers == g.num_layers and set(kv.v_dims) == {0}
    assert kv.bytes_full == g.num_layers * 4096 * (512 + 64) * 2      # kv_lora_rank + qk_rope_head_dim, f16


def test_kv_names_map_to_llamacpp_cache_types():
    assert lc.kv_types("int8") == ("q8_0", "q8_0")
    assert lc.kv_types("int4") == ("q4_0", "q4_0")
    assert lc.kv_types("k8v4") == ("q8_0", "q4_0")
    assert lc.kv_types("bf16") == ("bf16", "bf16") and lc.kv_types("fp16") == ("f16", "f16")
    assert lc.kv_types("Q5_1") == ("q5_1", "q5_1")
    with pytest.raises(InputError, match="--kv"):
        lc.kv_types("int3")


# ---- the Qwen3.5-35B-A3B field case (headers only) ------------------------------------------------
def qwen35_q4km(path: Path) -> Path:
    """A header-only GGUF with Qwen3.5-35B-A3B's tensor shapes and llama-quantize's Q4_K_M
    type mix (``benchmarks/write_header_gguf.py``; the mix is checked against the real
    llama-quantize below)."""
    return header_writer().write_header_gguf("Qwen3.5-35B-A3B", "Q4_K_M", path)


def moefit(*args):
    return subprocess.run([sys.executable, "-m", "moefit", *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent / "src")})


@pytest.mark.parametrize("rope", [["--rope-scaling", "yarn", "--rope-scale", "2"], []])
def test_qwen35_on_a_16gb_card_at_512k_prints_a_command_that_leaves_the_margin_free(tmp_path, rope):
    f = qwen35_q4km(tmp_path / "Qwen3.5-35B-A3B-Q4_K_M.gguf")
    # 512K is twice the trained window: YaRN x2, as in the README's field scenario; or, the
    # issue's command, without it: llama.cpp runs it with a warning, and so does the plan
    r = moefit("plan", str(f), "--engine", "llama.cpp", "--gpu", "RTX 5060 Ti 16GB", "--max-context", "512K",
               "--kv", "int8", *rope)
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip().endswith(" ".join(rope) or "-fa on -fit off")
    assert ("possible training context overflow" in r.stdout) == (not rope)
    cmd = next(l for l in r.stdout.splitlines() if l.startswith("command  ")).split()[1:]
    assert cmd[0] == "llama-server" and _flag(cmd, "-m") == str(f)
    assert (_flag(cmd, "-c"), _flag(cmd, "-np"), _flag(cmd, "-ctk"), _flag(cmd, "-ctv"), _flag(cmd, "-fa"), _flag(cmd, "-ngl")) == \
        ("524288", "1", "q8_0", "q8_0", "on", "999")
    ub = int(_flag(cmd, "-ub"))
    # the experts kept on the CPU: --n-cpu-moe K (layers 0..K-1) or an -ot pattern of layers
    geom, tensors = load_model(str(f)), lc.tensors_from_header(str(f))
    buffers = lc.model_buffers(tensors, lc.CUDA)
    if "-ot" in cmd:
        pattern, buft = _flag(cmd, "-ot").strip("'").rsplit("=", 1)
        assert buft == "CPU"
        on_cpu = {layer for layer, _ in buffers.experts
                  if any(re.search(pattern, t.name) for t in tensors if lc.expert_layer(t.name) == layer)}
    else:
        on_cpu = set(range(int(_flag(cmd, "--n-cpu-moe"))))
    # re-price the command's settings line by line: everything but the margin fits
    device = find_gpu("RTX 5060 Ti 16GB")
    kv = lc.kv_price(geom, 524288, ub, "q8_0", "q8_0", lc.CUDA)
    # experts on the host: a micro-batch copies the largest expert tensor into the compute buffer
    comp = lc.compute_price(geom, geom.vocab_size, ub, kv, "q8_0", "q8_0", lc.CUDA, buffers.largest_expert_tensor)
    assert comp.weight_copy == buffers.largest_expert_tensor > 0
    experts = sum(b for layer, b in buffers.experts if layer not in on_cpu)
    margin = default_reserve_bytes(device)
    used = runtime_bytes(device) + buffers.device + kv.kv_bytes + kv.recurrent_bytes + comp.bytes + experts
    assert used + margin <= device.free_bytes
    # and no layer of experts kept on the CPU would fit on the GPU as well (the smallest eats the margin)
    smallest = min(b for layer, b in buffers.experts if layer in on_cpu)
    assert used + smallest + margin > device.free_bytes
    assert kv.full_layers == 10 and kv.recurrent_layers == 30 and kv.cells == 524288
    assert 0 < len(on_cpu) < geom.num_layers


def test_the_json_document_carries_the_command_and_the_lines(tmp_path):
    f = qwen35_q4km(tmp_path / "q.gguf")
    r = moefit("plan", str(f), "--engine", "llama.cpp", "--vram", "24GiB", "--device", "cuda:0",
               "--max-context", "64K", "--kv", "q4_0", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["engine"] == "llama.cpp" and doc["command"].startswith("llama-server ")
    lines = doc["devices"][0]["lines"]
    assert [l["key"] for l in lines] == [k for k, _ in lc.LINES]
    assert sum(l["bytes"] for l in lines) + doc["devices"][0]["unassigned_bytes"] == doc["devices"][0]["free_bytes"]


def _solve(geom, tensors, vram, **kw):
    dev = Device(label="cuda:0", description="what-if", kind="cuda", capacity_bytes=vram, free_bytes=vram,
                 simulated=True)
    return lc.solve_llamacpp(geom, tensors, dev, lc.LlamaRequest(**kw))


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    f = qwen35_q4km(tmp_path_factory.mktemp("q35") / "q.gguf")
    return load_model(str(f)), lc.tensors_from_header(str(f))


def test_more_vram_keeps_fewer_layers_of_experts_on_the_cpu(qwen35):
    geom, tensors = qwen35
    ks = [_solve(geom, tensors, v * GIB, context=65536).n_cpu_moe for v in (12, 16, 24, 32, 48)]
    assert ks == sorted(ks, reverse=True) and ks[0] > ks[-1]
    assert _solve(geom, tensors, 48 * GIB, context=65536).n_cpu_moe == 0


def test_ubatch_is_clamped_on_the_grid_when_the_mandatory_lines_do_not_fit(qwen35):
    geom, tensors = qwen35
    kw = dict(context=65536, ubatch=4096, margin=512 * MIB)
    base = _solve(geom, tensors, 64 * GIB, **kw)
    need = sum(l.bytes for l in base.lines if l.key != "experts")
    small = _solve(geom, tensors, need - 256 * MIB, **kw)
    assert small.fits and small.ubatch < 4096 and small.ubatch % lc.UB_GRID == 0
    assert small.n_cpu_moe == max(l for l, _ in lc.model_buffers(tensors, lc.CUDA).experts) + 1
    assert any("clamped" in n for n in small.notes)
    strict = _solve(geom, tensors, need - 256 * MIB, **kw, strict=True)
    assert not strict.fits


def test_a_plan_that_does_not_fit_offers_checked_alternatives(qwen35, tmp_path):
    geom, tensors = qwen35
    plan = _solve(geom, tensors, 4 * GIB, context=524288, type_k="f16", type_v="f16")
    assert not plan.fits and plan.shortfall_bytes > 0
    flags = {a.flag: a.value for a in plan.alternatives}
    assert "--max-context" in flags and plan.limiting
    assert _solve(geom, tensors, 4 * GIB, context=int(flags["--max-context"]), type_k="f16", type_v="f16").fits
    assert not _solve(geom, tensors, 4 * GIB, context=int(flags["--max-context"]) + 256,
                      type_k="f16", type_v="f16").fits


def test_engine_flag_plans_a_hugging_face_model_and_needs_a_known_kv_type(tmp_path):
    # a preset is planned in llama-quantize's Q4_K_M mix unless --gguf-type names another
    r = moefit("plan", "Qwen3-30B-A3B", "--engine", "llama.cpp", "--vram", "16GiB")
    assert r.returncode == 0 and "-m Qwen3-30B-A3B-Q4_K_M.gguf" in r.stdout, r.stderr
    f = qwen35_q4km(tmp_path / "q.gguf")
    r = moefit("plan", str(f), "--engine", "llama.cpp", "--vram", "16GiB", "--kv", "int3")
    assert r.returncode == 2 and "--kv" in r.stderr and "Traceback" not in r.stderr


def test_slots_become_streams_of_the_cache_and_the_command_names_them(qwen35):
    geom, tensors = qwen35
    one = _solve(geom, tensors, 80 * GIB, context=65536)
    two = _solve(geom, tensors, 80 * GIB, context=65536, slots=2)
    assert two.line("kv").bytes == 2 * one.line("kv").bytes
    assert two.line("state").bytes == 2 * one.line("state").bytes
    assert "-c 131072 -np 2 " in two.command and "-c 65536 -np 1 " in one.command
    assert two.host["output"] == 2 * one.host["output"]


@pytest.mark.parametrize("flags", [["--parallel", "0"], ["--expert-cache", "8"], ["--miss-policy", "copy"],
                                   ["--vram-reserve-mib", "-1"], ["--max-context", "4096M"],
                                   ["--arena-slots", "4"]])
def test_flags_without_a_llamacpp_meaning_exit_2(tmp_path, flags):
    f = qwen35_q4km(tmp_path / "q.gguf")
    r = moefit("plan", str(f), "--engine", "llama.cpp", "--vram", "16GiB", *flags)
    assert r.returncode == 2 and flags[0] in r.stderr and "Traceback" not in r.stderr


def test_default_engine_is_moefit_and_its_plan_is_unchanged():
    a = moefit("plan", "Qwen3-30B-A3B", "--vram", "16GiB", "--max-context", "32K")
    b = moefit("plan", "Qwen3-30B-A3B", "--vram", "16GiB", "--max-context", "32K", "--engine", "moefit")
    assert a.returncode == b.returncode == 0 and a.stdout == b.stdout and "expert cache" in a.stdout


def test_verbose_shows_both_phases_and_every_moe_layer(qwen35):
    geom, tensors = qwen35
    plan = _solve(geom, tensors, 16 * GIB, context=131072)
    assert plan.line("compute").bytes == max(plan.compute.end_phase, plan.compute.layer_phase)
    text = lc.format_verbose(plan)
    assert "end of graph" in text and "a layer" in text and "recurrent" in text
    assert text.splitlines()[-1].count(":") - 1 == len(geom.moe_layers)     # "layer:bytes" per MoE layer


def _recorded_run(rec, ctx: int, ub: int, n_seq: int):
    return next(lines for argv, lines in rec["runs"] if int(_flag(argv, "-c")) == ctx and
                int(_flag(argv, "-ub")) == ub and int(_flag(argv, "-np", "1")) == n_seq)


@pytest.mark.parametrize("name", [p.stem for p in RECORDS])
@pytest.mark.parametrize("ctx,ub,n_seq", [(1024, 8192, 1), (3072, 4096, 3)])
def test_a_micro_batch_above_the_context_is_planned_as_llamacpp_runs_it(recorded, name, ctx, ub, n_seq):
    # llama.cpp: n_batch = min(n_ctx, -b), n_ubatch = min(n_batch, -ub) (llama-context.cpp): the
    # recorded runs print n_ubatch = -c, and the compute buffer of that micro-batch
    rec, geom, tensors = recorded[name]
    lines = _recorded_run(rec, ctx, ub, n_seq)
    printed_ub = int(next(m for l in lines if (m := re.search(r"n_ubatch\s+= (\d+)", l))).group(1))
    cpu = Device("cpu", "simulated", "cpu", 64 * GIB, 64 * GIB, True)
    plan = lc.solve_llamacpp(geom, tensors, cpu, lc.LlamaRequest(context=ctx // n_seq, slots=n_seq, ubatch=ub,
                                                                   batch=ub))
    assert plan.ubatch == printed_ub == ctx
    measured = float(re.search(r"size is\s+([0-9.]+) MiB",
                               next(l for l in lines if "compute buffer size is" in l)).group(1)) * MIB
    # llama-completion outputs every token of the micro-batch (the plan prices llama-server's -np)
    comp = lc.compute_price(geom, geom.vocab_size,
                            plan.ubatch, plan.kv, "f16", "f16", lc.CPU)
    assert abs(comp.bytes / measured - 1) <= 0.05
    assert plan.line("compute").bytes <= comp.bytes
    assert f"-ub {ctx} " in plan.command and any("as llama.cpp runs it" in n for n in plan.notes)


def test_huge_micro_batches_are_answered_at_once(qwen35, monkeypatch):
    # the clamp is a bisection on the 64-token grid, bounded by -c: a few dozen pricings, no
    # loop over 10^12 tokens
    calls = []
    from moefit.external.llamacpp import solver

    mandatory = solver.mandatory_bytes
    monkeypatch.setattr(solver, "mandatory_bytes", lambda *a, **k: calls.append(1) or mandatory(*a, **k))
    geom, tensors = qwen35
    plan = lc.solve_llamacpp(geom, tensors, Device("cuda:0", "what-if", "cuda", 12 * GIB, 12 * GIB, True),
                             lc.LlamaRequest(context=65536, ubatch=99_999_999_999_999, batch=99_999_999_999_999),
                             alternatives=False)
    assert len(calls) < 64
    assert plan.ubatch <= 65536 and plan.batch <= 65536 and plan.ubatch % lc.UB_GRID == 0


@pytest.mark.parametrize("flags,needle", [(["--prefill", "64"], "-ub 64 "),
                                          (["--prefill", "100", "--prefill-min", "64"], "-ub 100 ")])
def test_micro_batches_below_256_are_llamacpp_micro_batches(tmp_path, flags, needle):
    # llama.cpp runs any -ub >= 1 (the recorded runs include -ub 64); the clamp's grid is 64
    f = qwen35_q4km(tmp_path / "q.gguf")
    r = moefit("plan", str(f), "--engine", "llama.cpp", "--vram", "24GiB", "--device", "cuda:0",
               "--max-context", "32K", *flags)
    assert r.returncode == 0, r.stderr
    assert needle in r.stdout


def test_more_than_256_sequences_is_refused_as_llamacpp_does(tmp_path):
    f = qwen35_q4km(tmp_path / "q.gguf")
    r = moefit("plan", str(f), "--engine", "llama.cpp", "--vram", "24GiB", "--parallel", "300")
    assert r.returncode == 2 and "--parallel 300" in r.stderr and "256" in r.stderr


def test_llamacpp_defaults_and_device_selection(tmp_path):
    # without --kv the cache is llama.cpp's own default, f16; --device cuda:1 selects CUDA1 (-dev);
    # a context past the trained window runs with llama.cpp's warning, as a note
    f = qwen35_q4km(tmp_path / "q.gguf")
    r = moefit("plan", str(f), "--engine", "llama.cpp", "--vram", "24GiB", "--device", "cuda:1",
               "--max-context", "512K")
    assert r.returncode == 0, r.stderr
    cmd = next(l for l in r.stdout.splitlines() if l.startswith("command  ")).split()
    assert (_flag(cmd, "-ctk"), _flag(cmd, "-ctv"), _flag(cmd, "-dev"), _flag(cmd, "-c")) == ("f16", "f16", "CUDA1", "524288")
    assert "possible training context overflow" in r.stdout and "--rope-scaling" not in " ".join(cmd)


def test_llamacpp_json_is_its_own_schema_and_a_failure_names_the_limiting_lines(tmp_path):
    f = qwen35_q4km(tmp_path / "q.gguf")
    r = moefit("plan", str(f), "--engine", "llama.cpp", "--vram", "4GiB", "--device", "cuda:0",
               "--max-context", "512K", "--json")
    doc = json.loads(r.stdout)
    assert r.returncode == 3 and doc["schema"] == "moefit.llamacpp-plan/1"
    assert doc["kv"] == {"k": "f16", "v": "f16"} and doc["limiting"]
    assert all(isinstance(a["value"], int) for a in doc["alternatives"] if a["flag"] == "--max-context")
    text = moefit("plan", str(f), "--engine", "llama.cpp", "--vram", "4GiB", "--device", "cuda:0",
                  "--max-context", "512K")
    assert text.returncode == 3 and "\nlimiting: " in text.stdout


QUANT_RECORDS = sorted((DATA / "quant").glob("*.txt"))


@pytest.mark.parametrize("path", QUANT_RECORDS, ids=lambda p: p.stem)
def test_the_derived_type_mix_is_llama_quantizes(path, tmp_path):
    # benchmarks/record_llamacpp.py ran the real llama-quantize (0c1e570) on four source models
    # for 3-5 file types each; the tensors derived from the model's geometry alone (names,
    # shapes, types) are exactly the ones it wrote
    from moefit.ingest.gguf_mix import llamacpp_tensors

    rec = parse_record(path)
    ftype = path.stem.rsplit("-", 1)[1]
    geom = load_model(str(sparse_gguf(tmp_path / "m.gguf", rec["meta"], rec["tensors"])))
    derived, unknown = llamacpp_tensors(geom, ftype)
    assert unknown == 0
    assert sorted((t.name, t.kind, t.ne) for t in derived) == sorted(rec["tensors"])


def test_the_records_cover_the_common_mixes():
    stems = {p.stem.rsplit("-", 1)[1] for p in QUANT_RECORDS}
    assert {"Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q4_0", "Q4_K_S", "Q3_K_M", "Q2_K", "IQ4_NL"} <= stems
    assert len(QUANT_RECORDS) >= 12


def test_a_hugging_face_model_plans_as_the_gguf_llama_quantize_would_write(tmp_path):
    # moefit plan PRESET --engine llama.cpp --gguf-type Q4_K_M == the plan of its header-only GGUF
    f = qwen35_q4km(tmp_path / "Qwen3.5-35B-A3B-Q4_K_M.gguf")
    common = ["--engine", "llama.cpp", "--gpu", "RTX 5060 Ti 16GB", "--max-context", "128K", "--json"]
    a = json.loads(moefit("plan", str(f), *common).stdout)
    r = moefit("plan", "Qwen3.5-35B-A3B", "--gguf-type", "q4_k_m", *common)
    assert r.returncode == 0, r.stderr
    b = json.loads(r.stdout)
    assert a["devices"][0]["lines"] == b["devices"][0]["lines"] and a["host"] == b["host"]
    assert b["command"].startswith("llama-server -m Qwen3.5-35B-A3B-Q4_K_M.gguf ")
    assert any("llama-quantize Q4_K_M" in n for n in b["notes"])
    # the flag names a mix of a Hugging Face model only
    for flags in (["Qwen3.5-35B-A3B", "--gguf-type", "Q3_K_XL"], [str(f), "--gguf-type", "Q8_0"],
                  ["Qwen3.5-35B-A3B", "--gguf-type", "Q8_0", "--engine", "vllm"]):
        r = moefit("plan", *flags, *(["--engine", "llama.cpp"] if "--engine" not in flags else []), "--vram", "16GiB")
        assert r.returncode == 2 and "--gguf-type" in r.stderr and "Traceback" not in r.stderr


def test_a_per_layer_choice_keeps_more_experts_on_the_device_than_the_prefix(qwen35):
    # Q4_K_M keeps ffn_down_exps in Q6_K on use_more_bits' layers: two sizes of expert layers;
    # a per-layer choice (-ot) can hold more expert bytes than --n-cpu-moe's layers >= K
    geom, tensors = qwen35
    sizes = dict(lc.model_buffers(tensors, lc.CUDA).experts)
    assert len(set(sizes.values())) == 2
    better = 0
    for vram in range(12, 24):
        plan = _solve(geom, tensors, vram * GIB, context=131072, type_k="q8_0", type_v="q8_0")
        assert plan.fits
        prefix = sum(b for layer, b in sizes.items() if layer >= plan.n_cpu_moe)
        on_dev = plan.line("experts").bytes
        assert on_dev >= prefix
        if plan.cpu_layers:
            better += 1
            assert on_dev > prefix and "-ot 'blk" in plan.command and "--n-cpu-moe" not in plan.command
            assert on_dev == sum(b for layer, b in sizes.items() if layer not in plan.cpu_layers)
            # the choice is the best subset: no CPU layer fits in what is left
            assert plan.unassigned_bytes < min(sizes[l] for l in plan.cpu_layers)
        else:
            assert "--n-cpu-moe" in plan.command or plan.n_cpu_moe == 0
    assert better >= 1


def test_a_tied_output_is_a_device_copy_of_the_token_embeddings():
    # llama_model::load_tensors: no output.weight -> token_embd again, TENSOR_DUPLICATED, on the
    # output layer's device; the GGUF of a tied Hugging Face model has no output.weight
    emb = lc.Tensor("token_embd.weight", "Q4_K", (2048, 151936), 2048 * 151936 // 256 * 144)
    norm = lc.Tensor("output_norm.weight", "F32", (2048,), 2048 * 4)
    tied = lc.model_buffers([emb, norm], lc.CUDA)
    untied = lc.model_buffers([emb, norm, lc.Tensor("output.weight", "Q6_K", (2048, 151936),
                                                    2048 * 151936 // 256 * 210)], lc.CUDA)
    assert tied.host == untied.host == emb.alloc_bytes(lc.CPU)
    assert tied.device == norm.alloc_bytes(lc.CUDA) + emb.alloc_bytes(lc.CUDA)
