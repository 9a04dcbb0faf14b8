"""The runtime issue's field scenarios on a GGUF model (Q8_0 experts), as real
``moefit serve`` processes on a simulated device.

The device sizes are derived from the plan itself (``moefit plan --json`` on a large
device), so the scenarios stay exact whatever the GGUF prices:

(a) budget ordering: mandatory lines at the requested 512-token chunk + half the experts;
    READY with the requested chunk and a reduced expert cache, answers = reference.
(b) prefill fallback: mandatory lines at a 512-token chunk only; a 1024 request is
    clamped to 512, with the clamp line, and a two-chunk prompt = reference.
(c) hard failure: less than the mandatory lines at a 256-token chunk; exit 3, nothing read.
(d) fault injection: MOEFIT_FAIL_ALLOC=kv; exit 4 naming the line.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("gguf")
torch = pytest.importorskip("torch")

from reference import prompt  # noqa: E402
from serving import Server, make_servable, reference_tokens  # noqa: E402

pytestmark = pytest.mark.process   # every test starts `moefit` as a subprocess

BASE = ["--device", "cpu", "--max-context", "1024", "--kv", "fp32"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny Qwen3-MoE written as GGUF with Q8_0 experts, its tokenizer beside it; the
    reference model holds the stored (dequantized) weights."""
    from moefit.tools.gguf_write import write_gguf

    root = tmp_path_factory.mktemp("gguf")
    tiny = make_servable(root / "hf", max_position_embeddings=1024)
    path = root / "gguf" / "tiny-Q8_0.gguf"
    path.parent.mkdir()
    stored = write_gguf(tiny.ref.state_dict(), tiny.ref.config.to_dict(), path, expert_types="Q8_0",
                        return_stored=True)
    tiny.ref.load_state_dict({k: torch.from_numpy(v) for k, v in stored.items()})
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (tiny.path / name).exists():
            shutil.copy(tiny.path / name, path.parent / name)
    return path, tiny.ref


def moefit(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moefit", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def mandatory_bytes(path, chunk: int) -> tuple[int, int, int]:
    """(mandatory bytes at ``chunk`` with the default margin of a big device, slot bytes,
    total experts), from the plan itself."""
    r = moefit("plan", str(path), *BASE, "--vram", "1GiB", "--prefill", str(chunk),
               "--vram-reserve-mib", "0", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    lines = {l["key"]: l["bytes"] for l in doc["devices"][0]["lines"]}
    need = sum(v for k, v in lines.items() if k not in ("experts", "margin"))
    return need, doc["experts"]["slot_bytes"], doc["experts"]["total"]


def serve(path, tmp_path, *args, env=None) -> Server:
    return Server(path, *BASE, "--vram-reserve-mib", "0", "--parallel", "1", *args, env=env,
                  log=tmp_path / "stderr.txt")


def ready_line(srv: Server) -> str:
    ready = [l for l in srv.lines if l.startswith("READY")]
    assert len(ready) == 1, srv.output
    return ready[0]


def test_gguf_budget_ordering_keeps_the_chunk_and_shrinks_the_expert_cache(model, tmp_path):
    path, ref = model
    need, slot, total = mandatory_bytes(path, 512)
    vram = need + slot * (total // 2) + slot // 2
    with serve(path, tmp_path, "--vram", str(vram), "--prefill", "512") as srv:
        assert srv.url, srv.output
        line = ready_line(srv)
        assert "chunk 512 tokens" in line
        assert f"expert slots {total // 2} of {total}" in line
        ids = [4, 5, 6, 7, 8, 9]
        status, r = srv.post("/v1/completions", {"prompt": ids, "max_tokens": 6,
                                                 "return_token_ids": True})
        assert status == 200 and r["choices"][0]["token_ids"] == reference_tokens(ref, ids, 6)
        status, budget = srv.get("/v1/budget")
        for l in budget["ledger"]["lines"]:
            if l["key"] != "margin":
                assert l["allocated"] == l["planned"], l


def test_gguf_prefill_fallback_clamps_the_chunk_and_answers_like_the_reference(model, tmp_path):
    path, ref = model
    need, _, _ = mandatory_bytes(path, 512)
    with serve(path, tmp_path, "--vram", str(need), "--prefill", "1024") as srv:
        assert srv.url, srv.output
        assert "prefill: requested 1024, clamped to 512 due to VRAM budget" in srv.stdout
        assert "chunk 512 tokens" in ready_line(srv)
        ids = [t % 92 + 4 for t in prompt(96, n=700, seed=3)]     # two chunks
        status, r = srv.post("/v1/completions", {"prompt": ids, "max_tokens": 8,
                                                 "return_token_ids": True})
        assert status == 200, r
        assert r["choices"][0]["token_ids"] == reference_tokens(ref, ids, 8)


def test_gguf_hard_failure_exits_3_before_reading_the_file(model, tmp_path):
    path, _ = model
    need, _, _ = mandatory_bytes(path, 256)
    srv = serve(path, tmp_path, "--vram", str(need - 1), "--prefill", "1024")
    try:
        srv.start()
        assert srv.wait() == 3
    finally:
        srv.stop()
    assert re.search(r"does not fit: short by 1 B", srv.stdout), srv.stdout
    assert "fits with:" in srv.stdout
    assert "READY" not in srv.stdout and "Traceback" not in srv.output


def test_gguf_fault_injection_exits_4_naming_the_kv_line(model, tmp_path):
    path, _ = model
    need, _, _ = mandatory_bytes(path, 512)
    srv = serve(path, tmp_path, "--vram", str(need), "--prefill", "512",
                env={"MOEFIT_FAIL_ALLOC": "kv"})
    try:
        srv.start()
        assert srv.wait() == 4
    finally:
        srv.stop()
    rows = [l for l in srv.output.splitlines() if "allocation failed here" in l]
    assert len(rows) == 1 and rows[0].strip().startswith("KV cache")
    assert "READY" not in srv.stdout and "Traceback" not in srv.output
