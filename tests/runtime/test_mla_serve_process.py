"""The field scenario of MLA (issue 13) as a real ``moefit serve`` process on a simulated
device: DeepSeek-V2-Lite's geometry scaled down (no q LoRA, one dense layer then MoE layers
of 64 routed experts, top-6, 2 shared; YaRN x40 over a 4096-token window with mscale
0.707, so a 163840-token trained window), at a 32K context with the int8 latent cache.

The device is sized from the plan itself (``moefit plan --json`` on a large device): the
mandatory lines plus a third of the experts, so the expert cache is reduced. Criteria:
READY; every line allocated as planned (the ``kv`` line the hand-worked latent rows);
the answers are transformers' greedy tokens; then the same from the GGUF file of the
same model (``deepseek2``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("fastapi")
torch = pytest.importorskip("torch")

from mla_models import make_mla  # noqa: E402
from reference import prompt  # noqa: E402
from serving import Server, reference_tokens, write_tokenizer  # noqa: E402

pytestmark = pytest.mark.process   # every test starts `moefit` as a subprocess

V2_LITE = dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, intermediate_size=160,
               moe_intermediate_size=32, n_routed_experts=64, num_experts_per_tok=6,
               n_shared_experts=2, first_k_dense_replace=1, kv_lora_rank=48, qk_rope_head_dim=16,
               qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=163840,
               rope_parameters={"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                                "mscale_all_dim": 0.707, "rope_theta": 10000.0})
CONTEXT = 32768
BASE = ["--device", "cpu", "--max-context", "32K", "--kv", "int8", "--prefill", "1024",
        "--vram-reserve-mib", "1"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The scaled V2-Lite checkpoint with a tokenizer, and its Q8_0 GGUF beside."""
    from moefit.tools.gguf_write import write_gguf

    root = tmp_path_factory.mktemp("v2lite")
    tiny = make_mla("deepseek_v2_lite", root / "hf", **V2_LITE)
    write_tokenizer(tiny.path, 96)
    gguf_path = root / "gguf" / "v2lite-Q8_0.gguf"
    gguf_path.parent.mkdir()
    stored = write_gguf(tiny.ref.state_dict(), tiny.ref.config.to_dict(), gguf_path,
                        expert_types="Q8_0", return_stored=True)
    ref_gguf = type(tiny.ref)(tiny.ref.config).float().eval()
    ref_gguf.load_state_dict({k: torch.from_numpy(v) for k, v in stored.items()})
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (gguf_path.parent / name).write_bytes((tiny.path / name).read_bytes())
    return tiny, gguf_path, ref_gguf


def moefit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moefit", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})


def sized_device(path) -> tuple[int, dict]:
    """(device bytes: the mandatory lines + a third of the experts, the plan on it)."""
    r = moefit("plan", str(path), *BASE, "--vram", "4GiB", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    lines = {l["key"]: l["bytes"] for l in doc["devices"][0]["lines"]}
    need = sum(v for k, v in lines.items() if k != "experts")
    vram = need + doc["experts"]["total"] // 3 * doc["experts"]["slot_bytes"] + 4096
    r = moefit("plan", str(path), *BASE, "--vram", str(vram), "--json")
    assert r.returncode == 0, r.stderr
    return vram, json.loads(r.stdout)


def serve_and_check(path, ref, tmp_path) -> dict:
    vram, plan = sized_device(path)
    lines = {l["key"]: l["bytes"] for l in plan["devices"][0]["lines"]}
    # 4 MLA layers x 32768 tokens x one latent row of 48 + 16 = 64 values, int8: 2 x 34 B
    assert lines["kv"] == 4 * CONTEXT * 68
    assert 0 < plan["experts"]["slots"] < plan["experts"]["total"] == 3 * 64
    with Server(path, *BASE, "--parallel", "1", "--vram", str(vram), log=tmp_path / "stderr.txt") as srv:
        assert srv.url, srv.output
        ready = srv.lines[-1]
        assert ready.startswith("READY") and "context 32768 tokens" in ready
        status, budget = srv.get("/v1/budget")
        assert status == 200 and budget["plan"]["devices"] == plan["devices"]
        for line in budget["ledger"]["lines"]:
            if line["key"] != "margin":
                assert line["allocated"] == line["planned"], line
        ids = [t % 92 + 4 for t in prompt(96, n=40, seed=7)]       # no special tokens
        status, r = srv.post("/v1/completions", {"prompt": ids, "max_tokens": 8,
                                                 "return_token_ids": True})
        assert status == 200, r
        assert r["choices"][0]["token_ids"] == reference_tokens(ref, ids, 8)
        status, budget = srv.get("/v1/budget")
        staging = next(l for l in budget["ledger"]["lines"] if l["key"] == "prefill")
        assert 0 < staging["used_peak"] <= staging["planned"]
    assert "Traceback" not in srv.stderr
    return plan


def test_v2_lite_field_scenario_at_32k_with_int8_latent_cache(model, tmp_path):
    tiny, _, _ = model
    plan = serve_and_check(tiny.path, tiny.ref, tmp_path)
    assert plan["model"]["model_type"] == "deepseek_v2"


def test_the_same_scenario_from_its_gguf_file(model, tmp_path):
    _, path, ref = model
    plan = serve_and_check(path, ref, tmp_path)
    detail = next(l["detail"] for l in plan["devices"][0]["lines"] if l["key"] == "weights")
    assert detail.startswith("exact, from GGUF; dequantized to fp32 at load")
