"""Conveniences a new user expects from `moefit plan` (issue 12, items 13, 15, 17).

13. "slots" meant both concurrent sequences (``--slots``) and expert-cache units: sequences
    are ``--parallel`` (llama.cpp's name; ``--slots`` stays as an alias) and read
    "sequences" in the table, the expert cache's units are always "expert slots".
15. llama.cpp's KV type names: ``--kv q8_0`` (= int8), ``q4_0`` (= int4), ``f16`` (= fp16).
17. ``--max-context max``: the largest context that fits, checked against a bisection over
    the solver (the reference: the plan is monotone in the context).
"""

from __future__ import annotations

import json
import re

import pytest

from moefit.cli import main
from moefit.devices import find_gpu
from moefit.ingest.resolve import load_model



def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def plan_json(capsys, *argv: str) -> tuple[int, dict]:
    code, out, err = run(capsys, "plan", *argv, "--json", "--no-calibration")
    return code, json.loads(out)


# ---- 13: sequences and expert slots ---------------------------------------------------------

def test_parallel_is_the_sequence_flag_and_slots_its_alias(capsys):
    base = ["Qwen3-30B-A3B", "--gpu", "RTX 4090", "--max-context", "16K"]
    _, a = plan_json(capsys, *base, "--parallel", "3")
    _, b = plan_json(capsys, *base, "--slots", "3")
    assert a == b and a["slots"] == 3


def test_the_table_says_sequences_and_expert_slots(capsys):
    code, out, _ = run(capsys, "plan", "Qwen3-30B-A3B", "--gpu", "RTX 4090", "--max-context",
                       "16K", "--parallel", "2", "-v")
    assert code == 0
    kv = next(l for l in out.splitlines() if l.strip().startswith("KV cache"))
    assert "16384 tokens x 2 sequences" in kv
    # every other "slot" in the output is an expert slot
    for m in re.finditer(r"\bslots?\b", out):
        assert out[max(0, m.start() - 7):m.start()] == "expert ", out[m.start() - 40:m.end() + 10]


def test_a_failing_plan_suggests_parallel(capsys):
    code, doc = plan_json(capsys, "Qwen3-30B-A3B", "--gpu", "RTX 4090", "--max-context", "32K",
                          "--parallel", "16")
    assert code == 3
    flags = [a["flag"] for a in doc["alternatives"]]
    assert "--parallel" in flags and "--slots" not in flags


def test_help_names_expert_slots_and_parallel(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = capsys.readouterr().out
    assert "--parallel" in out
    line = " ".join(out.split())
    assert re.search(r"--expert-cache EXPERT_CACHE\s+auto \(what remains\) or N expert slots", line)


def test_parallel_zero_names_the_flag(capsys):
    code, _, err = run(capsys, "plan", "Qwen3-30B-A3B", "--gpu", "RTX 4090", "--parallel", "0")
    assert code == 2 and "--parallel 0" in err


# ---- 15: llama.cpp KV names -----------------------------------------------------------------

@pytest.mark.parametrize("alias,name", [("q8_0", "int8"), ("q4_0", "int4"), ("f16", "fp16"),
                                        ("Q8_0", "int8")])
def test_llama_cpp_kv_names_are_aliases(capsys, alias, name):
    base = ["Qwen3-30B-A3B", "--gpu", "RTX 4090", "--max-context", "32K"]
    _, a = plan_json(capsys, *base, "--kv", alias)
    _, b = plan_json(capsys, *base, "--kv", name)
    assert a == b and a["kv"] == name


def test_unknown_kv_lists_the_aliases(capsys):
    code, _, err = run(capsys, "plan", "Qwen3-30B-A3B", "--gpu", "RTX 4090", "--kv", "q5_0")
    assert code == 2 and "q8_0" in err and "int8" in err


# ---- 17: --max-context max -------------------------------------------------------------------

def reference_largest(model: str, gpu: str, **req) -> int:
    """A bisection over the solver (the plan is monotone in the context), independent of
    the direct solution ``--max-context max`` uses."""
    from moefit.plan.request import Request, context_limit
    from moefit.plan.solver import solve

    geom, dev, r = load_model(model), find_gpu(gpu), Request(**req)
    lo, hi = 1, context_limit(geom, r)[0]
    assert solve(geom, dev, r.with_(max_context=lo), alternatives=False).fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if solve(geom, dev, r.with_(max_context=mid), alternatives=False).fits:
            lo = mid
        else:
            hi = mid - 1
    return lo


@pytest.mark.parametrize("model,gpu,flags,req", [
    ("Qwen3-30B-A3B", "RTX 4090", ["--kv", "int8"], dict(kv="int8")),
    ("Qwen3-30B-A3B", "RTX 5090", ["--rope-scaling", "yarn", "--rope-scale", "4", "--parallel", "2"],
     dict(rope_scaling="yarn", rope_scale=4.0, slots=2)),
    ("gpt-oss-20b", "RTX 4060 Ti 16GB", ["--prefill", "4096", "--strict"],
     dict(prefill_mode="fixed", prefill_tokens=4096, strict=True)),
    ("Qwen3.5-35B-A3B", "RTX 5060 Ti 16GB", ["--kv", "int4"], dict(kv="int4")),
])
@pytest.mark.parametrize("smallest", [False, True])
def test_max_context_max_is_the_largest_that_fits(capsys, model, gpu, flags, req, smallest):
    # max keeps the requested or default chunk (its context is priced at that chunk), unless
    # --prefill-min asks for the smallest
    from moefit.flags import max_context_chunk
    from moefit.plan.request import Request

    chunk = 256 if smallest else max_context_chunk(Request(**req))
    flags = [*flags, *(["--prefill-min", "256"] if smallest else [])]
    code, doc = plan_json(capsys, model, "--gpu", gpu, "--max-context", "max", *flags)
    assert code == 0 and doc["fits"]
    expected = reference_largest(model, gpu, **req, prefill_min=chunk, miss_policy="auto")   # CUDA's default
    assert doc["context"] == expected
    # one token more does not fit at that chunk, unless the model's limit stopped it (then one
    # more is beyond the limit: an input error)
    code2, out, err = run(capsys, "plan", model, "--gpu", gpu, "--max-context", str(expected + 1),
                          *flags, "--prefill-min", str(chunk), "--json", "--no-calibration")
    limit_hit = any("model's limit" in n for n in doc["notes"])
    assert code2 == (2 if limit_hit else 3), (code2, err)


def test_max_context_max_prints_the_trade_off_of_a_smaller_chunk(capsys):
    # Qwen3.5-35B-A3B, YaRN x4, int8 KV, a 16 GB card: 919,049 tokens at the default 4096-token
    # chunks (it used to shrink them to 256 for 958,353 without a word; both with auto's arena)
    base = ["Qwen3.5-35B-A3B", "--gpu", "RTX 5060 Ti 16GB", "--max-context", "max", "--rope-scaling", "yarn",
            "--rope-scale", "4", "--kv", "int8", "--no-calibration"]
    code, out, _ = run(capsys, "plan", *base)
    assert code == 0
    assert "max-context: max, the largest context that fits: 919049 tokens at 4096-token chunks" in out
    assert "256-token chunks (--prefill-min 256) would fit 958353 tokens (+4%)" in out
    code, out, _ = run(capsys, "plan", *base, "--prefill-min", "256")
    assert "the largest context that fits: 958353 tokens" in out and "would fit" not in out
    code, out, _ = run(capsys, "plan", *base, "--prefill", "8192")
    assert "at 8192-token chunks" in out


def test_max_context_max_says_how_it_was_chosen(capsys):
    code, out, _ = run(capsys, "plan", "Qwen3-30B-A3B", "--gpu", "RTX 4090", "--max-context", "max")
    assert code == 0
    assert re.search(r"max-context: max, the largest context that fits: \d+ tokens", out)


def test_max_context_max_capped_at_the_model_limit(capsys):
    code, doc = plan_json(capsys, "Qwen3-30B-A3B", "--gpu", "H200", "--max-context", "max")
    assert code == 0 and doc["context"] == 40960   # max_position_embeddings
    assert any("model's limit" in n for n in doc["notes"])


def test_max_context_max_when_nothing_fits_is_exit_3(capsys):
    code, out, _ = run(capsys, "plan", "Qwen3-235B-A22B", "--vram", "8GiB", "--max-context", "max")
    assert code == 3 and "does not fit" in out


def _glm_air(tmp_path) -> str:
    from test_active_params import GLM_45_AIR

    (tmp_path / "config.json").write_text(json.dumps(GLM_45_AIR))
    return str(tmp_path)


def test_max_context_max_when_nothing_fits_names_the_host_when_the_host_is_short(capsys, tmp_path):
    """The card holds GLM-4.5-Air's dense weights (alone, ``max`` gives a context); an
    8 GiB host cannot hold its 185 GiB of bf16 experts at any context. The failed plan is
    the one of the smallest context: short on the host, limited by its expert blobs, with
    the GGUF file that fits (the plan at 1 token shows the same), not the device's KV cache
    at the model's full 131072 tokens."""
    model = _glm_air(tmp_path)
    base = ["--gpu", "RTX 5060 Ti 16GB", "--no-calibration"]
    code, doc = plan_json(capsys, model, *base, "--max-context", "max")
    assert code == 0 and doc["context"] > 1                  # the device fits alone
    code, out, _ = run(capsys, "plan", model, *base, "--max-context", "max", "--host-ram", "8GiB")
    assert code == 3
    assert "max-context: max, no context fits: shown at the smallest, 1 token" in out
    assert "1 token x 1 sequence" in out and "131072 tokens" not in out
    assert re.search(r"short by [\d.]+ GiB on the host", out)
    assert "limiting: host expert blobs" in out and "limiting: KV cache" not in out
    code1, out1, _ = run(capsys, "plan", model, *base, "--max-context", "1", "--host-ram", "8GiB")
    assert code1 == 3
    assert out1.split("does not fit:")[1] == out.split("does not fit:")[1]   # same verdict
    assert "MODEL glm45air-Q8_0.gguf --host-experts mmap".replace("glm45air", tmp_path.name) in out


def test_max_context_max_when_nothing_fits_prices_the_smallest_context(capsys):
    """gpt-oss-20b's weights alone overflow a 4 GiB card: the shortfall is what one token
    lacks, not that plus 131072 tokens of KV cache (3 GiB more)."""
    base = ["gpt-oss-20b", "--vram", "4GiB", "--host-ram", "16GiB", "--no-calibration"]
    _, at_max = plan_json(capsys, *base, "--max-context", "max")
    _, at_one = plan_json(capsys, *base, "--max-context", "1")
    assert not at_max["fits"] and at_max["context"] == 1
    assert at_max["shortfall_bytes"] == at_one["shortfall_bytes"] < 1 << 30
    assert at_max["limiting"] == at_one["limiting"] and at_max["short_on"] == at_one["short_on"]
    assert any(n.startswith("max-context: max, no context fits") for n in at_max["notes"])


@pytest.mark.parametrize("bad", ["maximum", "MAXX", "-1"])
def test_bad_max_context_mentions_max(capsys, bad):
    code, _, err = run(capsys, "plan", "Qwen3-30B-A3B", "--gpu", "RTX 4090", "--max-context", bad)
    assert code == 2 and "or max (the largest context that fits)" in err


@pytest.mark.parametrize("model,gpu,req", [
    ("Qwen3-30B-A3B", "RTX 5090", dict(rope_scaling="yarn", rope_scale=4.0, slots=2)),
    ("Qwen3-235B-A22B", "RTX 5090", dict(kv="fp8", rope_scaling="yarn", rope_scale=4.0, slots=4)),
    ("Qwen3.5-35B-A3B", "RTX 3060 12GB", dict(rope_scaling="yarn", rope_scale=4.0, slots=4)),
    ("DeepSeek-V2-Lite", "RTX 4060", dict(slots=4)),                       # MLA
    ("gpt-oss-20b", "RTX 3070", dict(slots=16, prefill_mode="fixed", prefill_tokens=2048,
                                     strict=True)),                        # sliding windows
    ("Llama-4-Scout-17B-16E-Instruct", "H200", dict(slots=16)),             # chunked layers
])
def test_largest_context_is_solved_directly_not_searched(monkeypatch, model, gpu, req):
    """The affine form gives the answer; the solver only checks it (no bisection)."""
    from moefit.plan import alternatives
    from moefit.plan.request import Request, context_limit

    def no_search(*a, **k):
        raise AssertionError("searched")

    geom, r = load_model(model), Request(**req)
    expected = reference_largest(model, gpu, **req)
    assert expected < context_limit(geom, r)[0]        # a case the memory limits, not RoPE
    monkeypatch.setattr(alternatives, "largest_int", no_search)
    assert alternatives.largest_context(geom, find_gpu(gpu), r) == expected


def test_max_context_max_note_names_the_chunk_the_plan_prefills_in(capsys, tmp_path):
    """gpt-oss-20b's GGUF on an RTX 3060 12GB: the context is sized at 4096-token chunks,
    then ``--prefill auto``'s throughput choice takes another; the note named 4096 as if
    the plan used it. Every chunk size the note names must be the plan's or the sizing one."""
    gguf = tmp_path / "g.gguf"
    assert main(["gguf-header", "gpt-oss-20b", str(gguf)]) == 0
    capsys.readouterr()
    code, doc = plan_json(capsys, str(gguf), "--gpu", "RTX 3060 12GB", "--max-context", "max")
    note = next(n for n in doc["notes"] if n.startswith("max-context: max"))
    used = doc["prefill"]["selected"]
    named = [int(x) for x in re.findall(r"(\d+)-token chunks", note)]
    assert code == 0 and named, note
    if used != 4096:                  # the case of the report: both named, the used one as used
        assert f"prefills in {used}-token chunks" in note and not re.search(r"\) at 4096-token chunks", note)
    else:
        assert named == [used]


def test_verbose_weights_line_says_what_the_table_prices_when_matrices_stay_stored(capsys, tmp_path):
    """GLM-4.5-Air Q4_K_M on an RTX 5060 Ti 16GB: the table prices the dense matrices the
    Triton kernels read as stored (3.74 GiB); ``-v`` said "13.40 GiB resident (bfloat16,
    dequantized at load)". Its weights line must give the table's bytes and say how many
    matrices stay stored (the table's detail)."""
    cfg = tmp_path / "glm.json"
    from test_active_params import GLM_45_AIR

    cfg.write_text(json.dumps(GLM_45_AIR))
    gguf = tmp_path / "glm.gguf"
    assert main(["gguf-header", str(cfg), str(gguf), "--type", "Q4_K_M"]) == 0
    capsys.readouterr()
    code, out, _ = run(capsys, "plan", str(gguf), "--gpu", "RTX 5060 Ti 16GB", "--max-context", "32K", "-v",
                       "--no-calibration")
    assert code == 0
    table = re.search(r"^  weights +([\d.]+ GiB) +exact, from GGUF; (\d+) quantized matrices kept as stored",
                      out, re.M)
    verbose = re.search(r"^  weights +([\d.]+ GiB) resident \((.*)\)", out, re.M)
    assert table and verbose, out
    assert verbose.group(1) == table.group(1)
    assert verbose.group(2).startswith(f"{table.group(2)} quantized matrices kept as stored"), verbose.group(0)


@pytest.mark.parametrize("devices", [["--gpu", "RTX 3060 12GB"], ["--device", "cpu", "--vram", "12GiB"]],
                         ids=["cuda", "cpu"])
@pytest.mark.parametrize("gguf", [False, True], ids=["preset", "gguf"])
def test_a_bad_moefit_kernels_is_refused_on_every_device(capsys, tmp_path, monkeypatch, devices, gguf):
    """``MOEFIT_KERNELS=bogus`` was refused on a CPU plan and ignored on a CUDA one (where
    only ``triton``, its own kernels, exists): exit 2 naming the variable on both."""
    model = "Qwen3-30B-A3B"
    if gguf:
        model = str(tmp_path / "g.gguf")
        assert main(["gguf-header", "gpt-oss-20b", model]) == 0
    monkeypatch.setenv("MOEFIT_KERNELS", "bogus")
    code, _, err = run(capsys, "plan", model, *devices, "--max-context", "8K", "--no-calibration")
    assert code == 2 and "MOEFIT_KERNELS='bogus'" in err and "Traceback" not in err
    monkeypatch.setenv("MOEFIT_KERNELS", "auto")            # the documented value still plans
    code, _, err = run(capsys, "plan", model, *devices, "--max-context", "8K", "--no-calibration")
    assert code in (0, 3) and "MOEFIT_KERNELS" not in err      # 3: the CPU host is short
