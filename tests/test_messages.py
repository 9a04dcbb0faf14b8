"""Messages that misled a new user (issue 12, item 10): each names the real problem.

The commands run in-process through ``moefit.cli.main`` (exit code and stderr as a user
sees them); the runtime commands use a demo checkpoint (``moefit.tools.demo``).
"""

from __future__ import annotations

import json

import pytest

from moefit.cli import main



def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("tokenizers")
    from moefit.tools.demo import write_demo

    return write_demo(tmp_path_factory.mktemp("demo") / "m", "qwen3_moe")


@pytest.mark.parametrize("command", ["bench", "calibrate"])
def test_bench_and_calibrate_with_gpu_name_their_own_command(capsys, demo, command):
    code, _, err = run(capsys, command, str(demo), "--gpu", "RTX 4090")
    assert code == 2
    assert f"{command} runs the model" in err
    assert "serve and generate" not in err
    assert "--device" in err


def test_generate_with_a_long_prompt_does_not_talk_about_a_server(capsys, demo):
    code, _, err = run(capsys, "generate", str(demo), "--device", "cpu", "--vram", "1GiB",
                       "--host-ram", "64GiB", "--max-context", "16", "--prompt", "the quick brown fox " * 10)
    assert code == 2
    assert "server" not in err
    assert "--max-context 16" in err and "tokens" in err


def test_plan_of_a_tokenizer_json_says_it_is_not_a_model_config(capsys, tmp_path):
    tok = tmp_path / "tokenizer.json"
    tok.write_text(json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {}}}))
    code, _, err = run(capsys, "plan", str(tok), "--vram", "16GiB")
    assert code == 2
    assert "not a model config" in err
    assert "model_type None" not in err
    # a config.json whose model_type is a string but unknown keeps the list of supported types
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    code, _, err = run(capsys, "plan", str(cfg), "--vram", "16GiB")
    assert code == 2 and "'bert'" in err and "qwen3_moe" in err


@pytest.mark.parametrize("model", ["DeepSeek-V3", "Kimi-K2-Instruct"])
def test_deepseek_plans_speak_no_internal_tensor_names(capsys, model):
    code, out, err = run(capsys, "plan", model, "--vram", "80GiB")
    assert "e_score_correction_bias" not in out + err
    assert "analytic listing" not in out + err


def test_negative_expert_cache_names_expert_cache(capsys):
    code, _, err = run(capsys, "plan", "Qwen3-30B-A3B", "--vram", "24GiB", "--expert-cache", "-1")
    assert code == 2
    assert "--expert-cache" in err and "-1" in err
    assert "--min-expert-cache" not in err
