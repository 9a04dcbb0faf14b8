"""``moefit plan --engine llama.cpp --max-context max`` (issue 25): the largest ``-c`` that
fits, solved directly (KV cache and KQ mask affine in the cells) and confirmed by the solver."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

pytest.importorskip("gguf")

from moefit.cli import main  # noqa: E402
from moefit.devices import Device, Host, find_gpu  # noqa: E402
from moefit.external import llamacpp as lc  # noqa: E402
from moefit.ingest.resolve import load_model  # noqa: E402

GIB = 1 << 30
CARD = "RTX 5060 Ti 16GB"


def plan_json(capsys, *argv: str) -> dict:
    code = main(["plan", *argv, "--engine", "llama.cpp", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == (0 if doc["fits"] else 3)
    return doc


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


@pytest.mark.parametrize("model,flags", [
    ("Qwen3.5-35B-A3B", ["--gpu", CARD, "--kv", "q8_0", "--rope-scaling", "yarn", "--rope-scale", "4"]),
    ("Qwen3-30B-A3B", ["--gpu", CARD, "--rope-scaling", "yarn", "--rope-scale", "4", "--parallel", "3"]),
    ("gpt-oss-20b", ["--vram", "6GiB", "--prefill", "1024", "--parallel", "6"]),   # sliding windows
])
def test_the_printed_c_fits_and_one_cell_block_more_does_not(capsys, model, flags):
    doc = plan_json(capsys, model, "--max-context", "max", *flags)
    assert doc["fits"] and not any("(the model's limit)" in n for n in doc["notes"])
    cmd = doc["command"].split()
    slots, ub = int(_flag(cmd, "-np")), int(_flag(cmd, "-ub"))
    per_seq = int(_flag(cmd, "-c")) // slots
    assert any(n.startswith(f"max-context: max, the largest context that fits at -ub {ub}: {per_seq} tokens")
               for n in doc["notes"])
    geom = load_model(model)
    tensors, _ = lc.tensors_from_geometry(geom, lc_ftype(geom))
    d = doc["devices"][0]
    dev = Device(label=d["name"], description=d["description"], kind=d["kind"], capacity_bytes=d["capacity_bytes"],
                 free_bytes=d["free_bytes"], simulated=True)
    req = lc.LlamaRequest(context=per_seq, slots=slots, ubatch=ub, batch=max(2048, ub), type_k=_flag(cmd, "-ctk"),
                          type_v=_flag(cmd, "-ctv"), strict=True)
    assert lc.solve_llamacpp(geom, tensors, dev, req).fits
    assert not lc.solve_llamacpp(geom, tensors, dev, replace(req, context=per_seq + lc.CTX_PAD)).fits


def lc_ftype(geom):
    from moefit.ingest.gguf_mix import default_ftype

    return default_ftype(geom)


def test_the_direct_solution_needs_no_bisection(monkeypatch):
    geom = load_model("Qwen3.5-35B-A3B")
    tensors, _ = lc.tensors_from_geometry(geom, "Q4_K_M")
    calls = []
    from moefit.external.llamacpp import solver

    real = solver.solve_llamacpp
    monkeypatch.setattr(solver, "solve_llamacpp", lambda *a, **k: calls.append(a[3].context) or real(*a, **k))
    req = lc.LlamaRequest(context=1 << 20, type_k="q8_0", type_v="q8_0")
    best = lc.largest_llama_context(geom, tensors, find_gpu(CARD), req, limit=1 << 20)
    assert calls == [best, best + lc.CTX_PAD]       # the division, confirmed: it fits, one block more does not
    assert best % lc.CTX_PAD == 0 and 900_000 < best < 1 << 20


def test_a_short_host_is_found_by_bisection_and_fits():
    geom = load_model("Qwen3-30B-A3B")
    tensors, _ = lc.tensors_from_geometry(geom, "Q4_K_M")
    host = Host(18 * GIB, 18 * GIB, "--host-ram 18GiB")
    req = lc.LlamaRequest(context=163840)
    dev = find_gpu(CARD)
    free = lc.largest_llama_context(geom, tensors, dev, req, limit=163840)
    best = lc.largest_llama_context(geom, tensors, dev, req, limit=163840, host_mem=host)
    assert best < free
    assert lc.solve_llamacpp(geom, tensors, dev, replace(req, context=best, strict=True), host_mem=host).fits
    assert not lc.solve_llamacpp(geom, tensors, dev, replace(req, context=best + lc.CTX_PAD, strict=True),
                                 host_mem=host).fits


def test_max_is_capped_at_the_models_limit_and_shows_the_smaller_micro_batch(capsys):
    doc = plan_json(capsys, "Qwen3-30B-A3B", "--gpu", "H200", "--max-context", "max")
    assert doc["context"] == 40960 and any("(the model's limit)" in n for n in doc["notes"])
    doc = plan_json(capsys, "Qwen3.5-35B-A3B", "--gpu", CARD, "--max-context", "max", "--kv", "q8_0",
                    "--rope-scaling", "yarn", "--rope-scale", "4")
    assert any(re.match(r"max-context: at -ub 256 \(--prefill 256\) \d+ tokens fit \(\+\d+%\)", n)
               for n in doc["notes"])


def test_when_no_block_fits_the_failure_is_shown_at_one_block(capsys):
    doc = plan_json(capsys, "Qwen3-235B-A22B", "--vram", "4GiB", "--max-context", "max")
    assert not doc["fits"] and doc["context"] == lc.CTX_PAD
    assert doc["notes"][0].startswith("max-context: max, no context fits at -ub 512")


def test_a_priced_model_reads_its_layer_figures_once_and_prices_as_without_them():
    """The figures are kept on the PricedModel (read once, not part of its equality or repr),
    and a price from them is the price from the geometry (Llama-4-Scout: chunked and full
    layers; Qwen3.5: recurrent and full)."""
    for name in ("Llama-4-Scout-17B-16E-Instruct", "Qwen3.5-35B-A3B"):
        geom = load_model(name)
        m = lc.PricedModel(geom, geom.vocab_size, lc.ModelBuffers(0, (), (), 0))
        assert m.figures is m.figures
        assert m == lc.PricedModel(geom, geom.vocab_size, lc.ModelBuffers(0, (), (), 0))
        assert "figures" not in repr(m)
        for ctx, ub in ((4000, 512), (300000, 64)):
            kv = lc.kv_price(geom, ctx, ub, "q8_0", "q4_0", lc.CUDA, 2)
            assert lc.kv_price(geom, ctx, ub, "q8_0", "q4_0", lc.CUDA, 2, figures=m.figures) == kv
            assert (lc.compute_price(geom, m.n_vocab, ub, kv, "q8_0", "q4_0", lc.CUDA, 99, n_outputs=2,
                                     figures=m.figures)
                    == lc.compute_price(geom, m.n_vocab, ub, kv, "q8_0", "q4_0", lc.CUDA, 99, n_outputs=2))
