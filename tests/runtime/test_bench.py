"""``moefit bench``: the ladder on the simulated device, every field of its record.

A two-point ladder (1K and 2K tokens) of a tiny Qwen3-MoE checkpoint on a simulated
64 MiB device, 256-token chunks, fp32 KV (so transformers' greedy tokens must agree), with
``--vs transformers``; then a ladder whose top does not fit; then the pieces (contexts,
the default ladder, prompt lengths).
"""

from __future__ import annotations

import json

import pytest

from conftest import make_tiny
from moefit.bench.ladder import BenchOptions, default_ladder, parse_contexts, prompt_lengths
from moefit.cli import main
from moefit.errors import InputError
from moefit.ingest.resolve import load_model

pytest.importorskip("matplotlib")

KEYS = ["runtime", "weights", "weight_arena", "kv", "prefill", "margin", "experts"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny("qwen3_moe", tmp_path_factory.mktemp("ckpt"), max_position_embeddings=4096)


def test_two_point_ladder_records_every_field(tiny, tmp_path, capsys):
    out = tmp_path / "bench"
    code = main(["bench", str(tiny.path), "--device", "cpu", "--vram", "64MiB", "--kv", "fp32",
                 "--prefill", "256", "--contexts", "1K,2K", "--decode-tokens", "6",
                 "--out", str(out), "--vs", "transformers", "--no-progress", "--no-calibration"])
    printed = capsys.readouterr().out
    assert code == 0
    doc = json.loads((out / "bench.json").read_text())
    assert doc["schema"] == "moefit.bench/1"
    assert doc["device"]["kind"] == "cpu" and doc["device"]["capacity_bytes"] == 64 << 20
    assert doc["model"]["total_experts"] == 16 and doc["request"]["kv"] == "fp32"
    runs = doc["runs"]
    assert [r["context"] for r in runs] == [1024, 2048]
    for r in runs:
        assert r["fits"] is True
        assert r["prefill_chunk"] == 256 and r["clamped"] is False
        assert [l["key"] for l in r["lines"]] == KEYS
        for l in r["lines"]:
            assert set(l) == {"key", "planned_bytes", "allocated_bytes", "peak_bytes"}
            assert all(isinstance(l[f], int) and l[f] >= 0 for f in l if f != "key")
            if l["key"] in ("weights", "kv", "prefill", "experts"):
                assert l["allocated_bytes"] == l["planned_bytes"] > 0, l
        lines = {l["key"]: l for l in r["lines"]}
        st = r["staging"]
        # the staging model is an upper bound of the measured peak, and within 15%
        assert lines["prefill"]["peak_bytes"] == st["measured_bytes"]
        assert st["measured_bytes"] <= st["planned_bytes"] <= 1.15 * st["measured_bytes"]
        assert len(st["chunks"]) == 3 and st["fixed_region_bytes"] > 0   # 3 chunks: 768 tokens
        assert r["expert_slots"] == 16 and r["expert_slots_pct"] == 100.0
        assert r["weight_arena_bytes"] == lines["weight_arena"]["allocated_bytes"] == 0
        assert lines["margin"]["planned_bytes"] <= r["free_before_ready_bytes"] < 64 << 20
        assert [p["tokens"] for p in r["prompts"]] == [256, 768]
        assert r["prefill_tps"] > 0 and r["decode_tps"] > 0 and r["decode_tokens"] == 6
        assert 0.0 <= r["expert_hit_rate"] <= 1.0
        vs = r["vs_transformers"]
        assert vs["reference"] == "transformers full forward without a cache"
        assert vs["greedy_agree"] is True and vs["first_divergence"] is None
        assert vs["prompt_tokens"] == 768 and vs["decode_tokens"] == 6
        assert vs["prefill_tps_ratio"] > 0 and vs["decode_tps_ratio"] > 0
    # the KV line grows with the context, the staging does not
    kv = [next(l for l in r["lines"] if l["key"] == "kv")["allocated_bytes"] for r in runs]
    assert kv[1] == 2 * kv[0]
    assert runs[0]["staging"]["planned_bytes"] == runs[1]["staging"]["planned_bytes"]
    md = (out / "bench.md").read_text()
    assert "| 1K | 256 | fp32 | 16 of 16 (100%) |" in md and "| 2K |" in md
    assert "| 1K | 256 | fp32 |" in printed
    png = (out / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000


def test_context_that_does_not_fit_is_recorded_and_exits_3(tiny, tmp_path, capsys):
    out = tmp_path / "bench"
    code = main(["bench", str(tiny.path), "--device", "cpu", "--vram", "6MiB", "--kv", "fp32",
                 "--contexts", "1K,4K", "--decode-tokens", "2", "--prompt-tokens", "300",
                 "--out", str(out), "--no-progress", "--no-calibration"])
    assert code == 3
    runs = json.loads((out / "bench.json").read_text())["runs"]
    assert runs[0]["fits"] and runs[0]["clamped"] and runs[0]["prefill_chunk"] == 256
    assert [p["tokens"] for p in runs[0]["prompts"]] == [300]
    assert runs[1]["fits"] is False and runs[1]["shortfall_bytes"] > 0
    assert "| 4K | does not fit |" in capsys.readouterr().out


def test_contexts_take_k_and_m_suffixes():
    assert parse_contexts("384K,512K,524K") == [393216, 524288, 536576]
    assert parse_contexts("1M, 1536") == [1 << 20, 1536]
    assert parse_contexts("256,1K,256,1024") == [256, 1024]   # a repeat runs once
    with pytest.raises(InputError, match="--contexts"):
        parse_contexts("384KiB")


def test_default_ladder_is_quarters_of_the_largest_context():
    assert default_ladder(524288) == [131072, 262144, 393216, 524288]
    assert default_ladder(100_000) == [24832, 49920, 74752, 100_000]   # floored to 256
    assert default_ladder(300) == [256, 300]


def test_prompts_are_one_and_three_chunks_and_leave_room_to_decode():
    assert prompt_lengths(BenchOptions(decode_tokens=64), 4096, 65536) == [4096, 12288]
    assert prompt_lengths(BenchOptions(decode_tokens=64), 4096, 8192) == [4096, 8128]
    assert prompt_lengths(BenchOptions(prompt_tokens=(100, 50)), 256, 1024) == [50, 100]


def test_context_beyond_the_rope_limit_is_refused_before_any_run(tiny, tmp_path, capsys):
    code = main(["bench", str(tiny.path), "--device", "cpu", "--vram", "64MiB", "--contexts",
                 "1K,64K", "--out", str(tmp_path / "bench"), "--no-progress"])
    assert code == 2
    assert "--contexts value 65536 exceeds" in capsys.readouterr().err
    assert not (tmp_path / "bench" / "bench.json").exists()


def test_out_that_is_a_file_is_bad_input(tiny, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    code = main(["bench", str(tiny.path), "--device", "cpu", "--vram", "64MiB", "--contexts",
                 "1K", "--out", str(afile), "--no-progress"])
    assert code == 2 and "--out" in capsys.readouterr().err


def test_calibrate_refuses_chunks_beyond_the_context_before_measuring(tmp_path, capsys):
    small = make_tiny("qwen3_moe", tmp_path / "small", max_position_embeddings=1024)
    code = main(["calibrate", str(small.path), "--device", "cpu", "--vram", "64MiB"])
    err = capsys.readouterr()
    assert code == 2 and "--chunks" in err.err and "context limit of 1024" in err.err
    assert "measured" not in err.out     # nothing was run


@pytest.mark.parametrize("preset,method", [("gpt-oss-20b", "mxfp4"), ("DeepSeek-V3", "fp8")])
def test_vs_transformers_without_accelerate_says_to_install_it(tmp_path, capsys, monkeypatch, preset, method):
    """transformers loads an mxfp4 / fp8 checkpoint only with accelerate: without it, --vs
    transformers exits 2 before anything runs, naming the package and the fix; a bf16
    checkpoint, or the same one without --vs, is not refused."""
    import shutil

    from moefit.bench import versus
    from moefit.ingest.resolve import PRESETS_DIR

    ckpt = tmp_path / preset
    ckpt.mkdir()
    shutil.copy(PRESETS_DIR / preset / "config.json", ckpt / "config.json")
    monkeypatch.setattr(versus, "accelerate_installed", lambda: False)
    out = tmp_path / "bench"
    code = main(["bench", str(ckpt), "--device", "cpu", "--vram", "1GiB", "--vs", "transformers",
                 "--out", str(out), "--no-progress", "--no-calibration"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert f"this {method} checkpoint" in err and "pip install accelerate" in err and "drop --vs" in err
    assert not out.exists()
    versus.check_reference(load_model("Qwen3-30B-A3B"))          # bf16: transformers needs nothing more
    monkeypatch.setattr(versus, "accelerate_installed", lambda: True)
    versus.check_reference(load_model(str(ckpt)))


def test_vs_transformers_on_a_gguf_file_exits_2_before_running(tiny, tmp_path, capsys):
    """transformers' comparison loads a checkpoint directory: a GGUF file is refused at
    once (it used to run the whole ladder and report the comparison 'unavailable')."""
    from test_gguf_runtime import GGUFModel

    m = GGUFModel(tiny, tmp_path / "q8.gguf", expert_types="Q8_0")
    out = tmp_path / "bench"
    code = main(["bench", str(m.path), "--device", "cpu", "--vram", "64MiB", "--vs", "transformers",
                 "--out", str(out), "--no-progress", "--no-calibration"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "GGUF file" in err and "drop --vs" in err
    assert not out.exists()
