"""``moefit make-demo``: a small random checkpoint that serve / generate run offline.

Each family's demo is checked three ways: transformers (the reference) loads it with no
missing or unexpected tensor, moefit plans and runs it, and its tokenizer encodes any text
and renders the chat template as transformers does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import sim_device  # noqa: E402
from moefit.errors import InputError  # noqa: E402
from moefit.ingest.resolve import PRESETS_DIR, load_model  # noqa: E402
from moefit.plan.request import Request  # noqa: E402
from moefit.plan.solver import solve  # noqa: E402
from moefit.runtime.engine import Engine, EngineOptions  # noqa: E402
from moefit.serve.text import Tokenizer  # noqa: E402
from moefit.tools.demo import FAMILIES, write_demo  # noqa: E402

MIB = 1 << 20


@pytest.fixture(scope="module")
def demos(tmp_path_factory):
    return {f: write_demo(tmp_path_factory.mktemp(f"demo_{f}") / "m", f) for f in FAMILIES}


def test_the_demo_families_are_the_runtime_families():
    from moefit.runtime.arch import runtime_model_types

    # Kimi-K2 is DeepSeek-V3 under a model type transformers does not register
    assert set(FAMILIES) == set(runtime_model_types()) - {"qwen3_5_moe_text", "kimi_k2"}


def test_make_demo_help_lists_the_families(capsys):
    from moefit.cli import main

    with pytest.raises(SystemExit):
        main(["make-demo", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert all(f in help_text for f in FAMILIES)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_transformers_loads_every_tensor_of_the_demo(demos, family):
    transformers.logging.set_verbosity_error()
    auto = (transformers.AutoModelForImageTextToText if family == "qwen3_5_moe"
            else transformers.AutoModelForCausalLM)
    model, info = auto.from_pretrained(str(demos[family]), output_loading_info=True)
    # the multimodal Qwen3.5 demo is text only: its vision tower is not written
    missing = [k for k in info["missing_keys"] if ".visual." not in f".{k}"]
    assert missing == [] and list(info["unexpected_keys"]) == []
    assert list(info.get("mismatched_keys", [])) == []
    assert model.config.model_type == family


@pytest.mark.parametrize("family", list(FAMILIES))
def test_moefit_plans_and_runs_the_demo(demos, family):
    geom = load_model(str(demos[family]))
    assert geom.model_type == family and geom.exact is not None
    plan = solve(geom, sim_device(256 * MIB), Request(max_context=512, prefill_mode="fixed",
                                                      prefill_tokens=256, reserve_bytes=MIB))
    assert plan.fits
    engine = Engine.start(demos[family], plan, EngineOptions(progress=False))
    tok = Tokenizer.from_dir(demos[family])
    ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    logits = engine.prefill(ids)
    assert logits.shape == (geom.vocab_size,) and torch.isfinite(logits.float()).all()


def test_plan_refuses_the_checkpoint_the_loader_refuses(tmp_path, capsys):
    """A DeepSeek-V3 demo whose config.json lost ``q_lora_rank`` (DeepseekV3Config's default,
    1536, then applies): the loader refuses the checkpoint (``q_a_proj`` is ``[96, 256]``),
    and the planner refuses it with the same message (the same check,
    ``moefit.ingest.checkpoint.HeaderIndex.check``), exit 2, instead of a plan priced from
    the headers that ``serve`` could not commit."""
    from moefit.cli import main
    from moefit.ingest.families import geometry_from_config
    from moefit.runtime.arch import arch_from_config
    from moefit.runtime.load.safetensors import load_checkpoint

    d = write_demo(tmp_path / "m", "deepseek_v3")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["q_lora_rank"]
    (d / "config.json").write_text(json.dumps(cfg))
    geom = geometry_from_config(cfg, "m")      # the config alone, headers unread
    with pytest.raises(InputError) as loading:
        load_checkpoint(d, geom, arch_from_config(cfg, geom),
                        lambda shape, dtype: torch.empty(shape, dtype=dtype), progress=False)
    assert "q_a_proj" in str(loading.value) and "[96, 256]" in str(loading.value)
    with pytest.raises(InputError) as planning:
        load_model(str(d))
    assert str(planning.value) == str(loading.value)
    code = main(["plan", str(d), "--device", "cpu", "--vram", "1GiB", "--max-context", "1024"])
    assert code == 2 and str(loading.value) in capsys.readouterr().err


def test_tokenizer_encodes_any_text_and_matches_transformers(demos):
    d = demos["qwen3_moe"]
    ours, ref = Tokenizer.from_dir(d), transformers.AutoTokenizer.from_pretrained(str(d))
    for text in ["Hello! How are you today?", "unseen wörds, emoji 😀 and tabs\t\n", ""]:
        ids = ours.encode(text)
        assert ids == ref(text).input_ids
        assert ours.tok.decode(ids) == text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert ours.render_chat(messages) == ref.apply_chat_template(messages, tokenize=False,
                                                                 add_generation_prompt=True)
    gen = json.loads((d / "generation_config.json").read_text())
    assert ours.tok.token_to_id("<|im_end|>") in gen["eos_token_id"]


def test_the_same_seed_writes_the_same_bytes_and_another_seed_does_not(tmp_path):
    a, b, c = (write_demo(tmp_path / n, "olmoe", seed=s) for n, s in (("a", 0), ("b", 0), ("c", 1)))
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_every_demo_file_gets_the_mode_open_gives_a_new_file(demos):
    """safetensors' save_file leaves its file 0600; the demo's files all read like the rest."""
    import stat

    from moefit.outputs import default_file_mode

    d = next(iter(demos.values()))
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in d.iterdir()}
    assert modes["model.safetensors"] == default_file_mode(), modes
    assert set(modes.values()) == {default_file_mode()}, modes


def test_bad_family_and_non_empty_directory_are_input_errors(tmp_path):
    with pytest.raises(InputError, match="--family 'llama4'.*qwen3_moe"):
        write_demo(tmp_path / "x", "llama4")
    # Kimi-K2 runs, as DeepSeek-V3's architecture: the error names the demo to write
    with pytest.raises(InputError, match="--family 'kimi_k2'.*DeepseekV3ForCausalLM.*--family deepseek_v3$"):
        write_demo(tmp_path / "x", "kimi_k2")
    assert not (tmp_path / "x").exists()
    kimi = json.loads((PRESETS_DIR / "Kimi-K2-Instruct" / "config.json").read_text())
    assert kimi["architectures"] == ["DeepseekV3ForCausalLM"] and kimi["model_type"] == "kimi_k2"
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(InputError, match="not empty"):
        write_demo(tmp_path / "full", "qwen3_moe")
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    (tmp_path / "file").write_text("")
    with pytest.raises(InputError, match="not a directory"):
        write_demo(tmp_path / "file", "qwen3_moe")


def _moefit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moefit", *args], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)


def test_make_demo_command_then_generate_as_the_readme_shows(tmp_path):
    out = tmp_path / "demo"
    r = _moefit("make-demo", str(out), "--family", "qwen3_5_moe")
    assert r.returncode == 0, r.stderr
    assert str(out) in r.stdout
    r = _moefit("generate", str(out), "--device", "cpu", "--vram", "1GiB", "--max-context", "4096",
                "--chat", "--prompt", "Hello", "--max-tokens", "4")
    assert r.returncode == 0, r.stderr
    assert "READY" in r.stderr
    r = _moefit("make-demo", str(out), "--family", "qwen3_moe")
    assert r.returncode == 2 and "not empty" in r.stderr and "Traceback" not in r.stderr
    r = _moefit("make-demo", str(tmp_path / "x"), "--family", "llama4")
    assert r.returncode == 2 and "qwen3_moe" in r.stderr
