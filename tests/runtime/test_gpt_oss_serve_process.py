"""gpt-oss's field scenario, as the real ``moefit serve`` process on a simulated device.

gpt-oss-20b's geometry scaled down (``src/moefit/presets/gpt-oss-20b/config.json`` with
every width divided: hidden 2880 -> 64, head_dim 64 -> 16, 8 query heads per KV head kept,
32 experts top-4 of width 64, 4 layers alternating sliding-window 128 and full attention,
its YaRN x32 over 4096, its mxfp4 experts and clamp 7.0), served at a 128K context
(``--max-context 128K --kv int8``) asking for 8192-token prefill chunks on a device that
only fits 256: the chunk is clamped (and says so), the sliding layers keep a ring of
128 + 256 cells, every line is allocated as planned, a 450-token prompt (which wraps the
ring) gets transformers' greedy tokens, and a chat request goes through the checkpoint's
harmony-format chat template (``chat_template.jinja``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

from conftest import MIB, sim_device  # noqa: E402
from gpt_oss import make_gpt_oss  # noqa: E402
from reference import prompt  # noqa: E402
from serving import Server, reference_tokens  # noqa: E402

pytestmark = pytest.mark.process

PRESET = Path(__file__).parents[2] / "src/moefit/presets/gpt-oss-20b/config.json"
#: harmony's special tokens first, then words (a WordLevel tokenizer of the model's 96 ids)
SPECIALS = ["<|endoftext|>", "<|start|>", "<|message|>", "<|end|>", "<|return|>", "<|channel|>",
            "system", "developer", "user", "assistant", "final"]
#: The harmony format (OpenAI's gpt-oss model card; the checkpoints' ``chat_template``) in
#: the Jinja constructs the real template uses: a macro, ``namespace``, ``strftime_now``,
#: ``raise_exception``, a system / developer message taken off the front, channels.
HARMONY = """{%- macro system_message() -%}
{{- "You are a tiny model.\\nCurrent date: " + strftime_now("%Y-%m-%d") + "\\n\\nReasoning: " + (reasoning_effort or "medium") -}}
{%- endmacro -%}
<|start|>system<|message|>{{ system_message() }}<|end|>
{%- if messages[0].role in ("system", "developer") %}
{%- set loop_messages = messages[1:] %}<|start|>developer<|message|># Instructions {{ messages[0].content }}<|end|>
{%- else %}{%- set loop_messages = messages %}{%- endif %}
{%- set seen = namespace(users=0) %}
{%- for message in loop_messages -%}
{%- if message.role == "user" -%}{%- set seen.users = seen.users + 1 -%}<|start|>user<|message|>{{ message.content }}<|end|>
{%- elif message.role == "assistant" -%}<|start|>assistant<|channel|>final<|message|>{{ message.content }}<|end|>
{%- else -%}{{ raise_exception("harmony: no role " + message.role) }}{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|start|>assistant{% endif -%}"""
SCALED = dict(hidden_size=64, head_dim=16, num_attention_heads=8, num_key_value_heads=1,
              intermediate_size=64, num_hidden_layers=4, vocab_size=96, max_position_embeddings=131072,
              rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                               "beta_slow": 1.0, "truncate": False,
                               "original_max_position_embeddings": 4096, "rope_theta": 150000.0})
FLAGS = ["--device", "cpu", "--max-context", "128K", "--kv", "int8", "--prefill", "8192",
         "--vram-reserve-mib", "1"]


def _scaled_config() -> dict:
    cfg = json.loads(PRESET.read_text())
    keep = {k: cfg[k] for k in ("sliding_window", "swiglu_limit", "num_local_experts", "num_experts_per_tok",
                                "rms_norm_eps", "attention_bias")}
    assert keep["sliding_window"] == 128 and keep["num_local_experts"] == 32
    assert cfg["num_attention_heads"] // cfg["num_key_value_heads"] == 8
    return dict(keep, **SCALED, layer_types=["sliding_attention", "full_attention"] * 2)


def _tokenizer(path: Path, vocab: int) -> int:
    from tokenizers import Tokenizer, models, pre_tokenizers

    from serving import words

    table = {t: i for i, t in enumerate(SPECIALS + [w for w in words(200) if w not in SPECIALS][:vocab - len(SPECIALS)])}
    assert len(table) == vocab
    tok = Tokenizer(models.WordLevel(vocab=table, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIALS[:6])
    tok.save(str(path / "tokenizer.json"))
    (path / "chat_template.jinja").write_text(HARMONY)
    (path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|return|>", "pad_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast"}))
    eos = table["<|return|>"]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos], "do_sample": False}))
    return eos


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt-oss-20b-scaled")
    cfg = _scaled_config()
    tiny = make_gpt_oss(path, mxfp4=True, **cfg)
    return tiny, _tokenizer(path, cfg["vocab_size"])


def _moefit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moefit", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_gpt_oss_20b_scaled_down_serves_128k_with_a_clamped_chunk(model, tmp_path):
    from moefit.ingest.resolve import load_model
    from moefit.memory.kv import kv_format
    from moefit.memory.staging import staging_model
    from moefit.plan.request import Request
    from moefit.plan.solver import solve

    tiny, eos = model
    geom = load_model(str(tiny.path))
    assert geom.attention_layout() == "2 full + 2 sliding" and geom.exact.experts_stored
    # the device: what a 256-token chunk needs, plus half of another 256 tokens of staging
    req = Request(max_context=131072, kv="int8", prefill_mode="fixed", prefill_tokens=256,
                  reserve_bytes=MIB)
    roomy = solve(geom, sim_device(1 << 30), req.with_(expert_cache=0))
    per_256 = 256 * staging_model(geom, kv_format("int8"), device_kind="cpu").per_token_bytes
    vram = str(roomy.devices[0].planned_bytes + per_256 // 2)
    planned = _moefit("plan", str(tiny.path), *FLAGS, "--vram", vram, "--json")
    assert planned.returncode == 0, planned.stderr
    plan = json.loads(planned.stdout)
    assert plan["context"] == 131072 and plan["prefill"] == {
        "requested": 8192, "selected": 256, "clamped": True, "mode": "fixed", "strict": False}
    kv = next(l for l in plan["devices"][0]["lines"] if l["key"] == "kv")
    assert "131072 tokens" in kv["detail"]

    with Server(tiny.path, *FLAGS, "--vram", vram, log=tmp_path / "stderr.txt") as srv:
        assert srv.url, srv.output
        assert "prefill: requested 8192, clamped to 256 due to VRAM budget" in srv.stdout
        assert "chunk 256 tokens" in srv.lines[-1] and "context 131072 tokens" in srv.lines[-1]
        status, budget = srv.get("/v1/budget")
        assert budget["plan"]["devices"] == plan["devices"]
        for line in budget["ledger"]["lines"]:
            if line["key"] != "margin":
                assert line["allocated"] == line["planned"], line
        ids = [t % 80 + 11 for t in prompt(96, n=450, seed=7)]     # words, no special tokens
        ref = reference_tokens(tiny.ref, ids, 10, eos=eos)
        status, r = srv.post("/v1/completions", {"prompt": ids, "max_tokens": 10, "return_token_ids": True})
        assert status == 200, r
        assert r["choices"][0]["token_ids"] == ref
        status, chat = srv.post("/v1/chat/completions", {
            "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
            "max_tokens": 4, "return_token_ids": True})
        assert status == 200, chat
        # <|start|>system<|message|> ... <|end|><|start|>developer ... <|start|>user<|message|>hello<|end|><|start|>assistant
        from moefit.serve.text import Tokenizer

        tok = Tokenizer.from_dir(tiny.path)
        rendered = tok.render_chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}])
        assert rendered.startswith("<|start|>system<|message|>You are a tiny model.")
        assert rendered.endswith("<|start|>user<|message|>hello<|end|><|start|>assistant")
        assert chat["usage"]["prompt_tokens"] == len(tok.encode_chat(
            [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]))
        status, err = srv.post("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]})
        assert status == 400 and "harmony: no role tool" in err["error"]["message"]
    assert "Traceback" not in srv.stderr
