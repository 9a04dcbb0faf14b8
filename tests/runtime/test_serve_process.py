"""The field scenarios end to end: the real ``moefit serve`` process on a generated
checkpoint, on a simulated device (``--device cpu --vram SIZE``: tensors really allocated,
the capacity really enforced).

The tiny Qwen3-MoE checkpoint (2 MoE layers x 8 experts of 24 KiB, fp32) at a context of
1024 tokens with fp32 KV needs 245.75 KiB of weights, 1 MiB of KV cache and
3.10 MiB + 3 KiB/token of prefill staging; the margin is 1/32 of the device.

(a) budget ordering: on 6445.3125 KiB a 512-token chunk fits but not with all 16 experts;
    READY with the requested chunk and a reduced expert cache.
(b) prefill fallback: on 5800000 bytes a 1024-token chunk does not fit; READY with the
    chunk clamped to 256 and the clamp line, and a 300-token prompt (two chunks) gets the
    reference's greedy tokens.
(c) hard failure: on 5300000 bytes nothing fits; exit 3 before any weight is read, with
    the shortfall and the alternatives.
(d) fault injection: MOEFIT_FAIL_ALLOC=prefill; exit 4 with the budget table naming the
    line, no traceback.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from reference import prompt  # noqa: E402
from serving import EOS, Server, make_servable, reference_tokens  # noqa: E402

pytestmark = pytest.mark.process   # every test starts `moefit` as a subprocess

BASE = ["--device", "cpu", "--max-context", "1024", "--kv", "fp32"]
FITS_512 = ["--vram", "6445.3125KiB", "--prefill", "512"]         # = 6600000 bytes
CLAMPS = ["--vram", "5800000", "--prefill", "1024"]
NO_FIT = ["--vram", "5300000", "--prefill", "1024"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_servable(tmp_path_factory.mktemp("ckpt"), max_position_embeddings=1024)


def serve(tiny, tmp_path, *args, env=None) -> Server:
    return Server(tiny.path, *BASE, *args, env=env, log=tmp_path / "stderr.txt")


def ready_fields(line: str) -> dict:
    m = re.search(r"context (\d+) tokens.*chunk (\d+) tokens, expert slots (\d+) of (\d+), "
                  r"free (.+?) of", line)
    assert m, line
    return {"context": int(m[1]), "chunk": int(m[2]), "slots": int(m[3]), "total": int(m[4]),
            "free": m[5]}


def moefit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moefit", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_budget_ordering_gives_the_chunk_and_shrinks_the_expert_cache(tiny, tmp_path):
    # serve's default: 4 slots over a KV pool of one context (docs/serve.md)
    planned = moefit("plan", str(tiny.path), *BASE, "--vram", "6600000", "--prefill", "512",
                     "--parallel", "4", "--kv-pool", "1024", "--json")
    assert planned.returncode == 0, planned.stderr
    plan = json.loads(planned.stdout)
    with serve(tiny, tmp_path, *FITS_512) as srv:
        assert srv.url, srv.output
        out = srv.stdout
        table = out[:out.index("VRAM ledger")]
        assert "VRAM budget  cpu" in table and "expert cache" in table
        ready = [l for l in srv.lines if l.startswith("READY")]
        assert len(ready) == 1 and srv.lines[-1] == ready[0]
        f = ready_fields(ready[0])
        assert f["chunk"] == 512 and f["context"] == 1024       # the requested chunk
        assert 0 < f["slots"] < f["total"] == 16                # a reduced expert cache
        assert f["slots"] == plan["experts"]["slots"]
        assert srv.get("/health")[0] == 200
        # `moefit plan` with the same flags planned exactly what serve committed
        status, budget = srv.get("/v1/budget")
        assert budget["plan"]["devices"] == plan["devices"]
        assert budget["plan"]["prefill"] == plan["prefill"]
        for line in budget["ledger"]["lines"]:
            if line["key"] != "margin":
                assert line["allocated"] == line["planned"], line
        # and it answers like the reference
        ids = [4, 5, 6, 7, 8, 9]
        status, r = srv.post("/v1/completions", {"prompt": ids, "max_tokens": 6,
                                                 "return_token_ids": True})
        assert status == 200 and r["choices"][0]["token_ids"] == reference_tokens(tiny.ref, ids, 6)
        status, raw = srv.post("/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "stream": True})
        assert status == 200 and raw.rstrip().endswith("data: [DONE]")
        status, err = srv.post("/v1/completions", {"prompt": [5] * 1025})
        assert status == 400 and "context of 1024 tokens" in err["error"]["message"]
        assert srv.get("/health")[0] == 200
        srv.stop()      # SIGTERM: uvicorn shuts down, then re-raises the signal
        assert srv.proc.returncode in (0, -signal.SIGTERM)
    assert "Traceback" not in srv.stderr


def test_prefill_fallback_clamps_the_chunk_and_answers_long_prompts(tiny, tmp_path):
    with serve(tiny, tmp_path, *CLAMPS) as srv:
        assert srv.url, srv.output
        before_ready = srv.stdout
        assert "prefill: requested 1024, clamped to 256 due to VRAM budget" in before_ready
        f = ready_fields(srv.lines[-1])
        assert f["chunk"] == 256
        ids = [t % 92 + 4 for t in prompt(96, n=300, seed=5)]     # no special tokens
        ref = reference_tokens(tiny.ref, ids, 10)
        status, r = srv.post("/v1/completions", {"prompt": ids, "max_tokens": 10,
                                                 "return_token_ids": True})
        assert status == 200, r
        assert r["choices"][0]["token_ids"] == ref
        assert r["usage"]["prompt_tokens"] == 300
        assert r["choices"][0]["finish_reason"] == ("stop" if ref[-1] == EOS else "length")
        status, budget = srv.get("/v1/budget")
        staging = next(l for l in budget["ledger"]["lines"] if l["key"] == "prefill")
        assert 0 < staging["used_peak"] <= staging["planned"]


def test_hard_failure_exits_3_before_loading_weights(tiny, tmp_path):
    srv = serve(tiny, tmp_path, *NO_FIT)
    try:
        srv.start()
        assert srv.wait() == 3
    finally:
        srv.stop()
    out = srv.stdout
    assert "does not fit: short by" in out
    assert "limiting: prefill staging" in out
    assert "fits with:" in out and "--max-context" in out and "--kv bf16" in out
    # nothing was committed: no loading bar, no ledger, no READY
    assert "loading" not in srv.stderr and "VRAM ledger" not in out and "READY" not in out
    assert "Traceback" not in srv.output


def test_fault_injection_exits_4_naming_the_failing_line(tiny, tmp_path):
    srv = serve(tiny, tmp_path, *FITS_512, env={"MOEFIT_FAIL_ALLOC": "prefill"})
    try:
        srv.start()
        assert srv.wait() == 4
    finally:
        srv.stop()
    rows = [l for l in srv.output.splitlines() if "allocation failed here" in l]
    assert len(rows) == 1 and rows[0].strip().startswith("prefill staging")
    assert "VRAM ledger" in srv.stdout
    assert "MOEFIT_FAIL_ALLOC" in srv.stderr
    assert "READY" not in srv.stdout and "Traceback" not in srv.output


def test_generate_runs_the_same_engine_once(tiny):
    text = "the quick brown fox"
    r = moefit("generate", str(tiny.path), *BASE, *FITS_512, "--prompt", text, "--max-tokens", "6")
    assert r.returncode == 0, r.stderr
    from moefit.serve.text import Tokenizer

    tok = Tokenizer.from_dir(tiny.path)
    ref = reference_tokens(tiny.ref, tok.encode(text), 6)
    assert r.stdout.split() == [w for w in (tok.decode([t]) for t in ref) if w]
    assert re.search(r"^READY .*chunk 512 tokens", r.stderr, re.M)
    assert "VRAM budget" in r.stderr


@pytest.mark.parametrize("args,needle", [
    (["--gpu", "4090"], "real device"),
    (["--device", "cpu"], "--vram"),
    (["--device", "cpu", "--vram", "1G", "--max-context", "4096"], "--rope-scaling"),
])
def test_serve_bad_input_exits_2(tiny, args, needle):
    r = moefit("serve", str(tiny.path), *args)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr


def test_sigint_while_streaming_stops_cleanly_with_exit_0(tiny, tmp_path):
    import threading
    import urllib.request

    with serve(tiny, tmp_path, *FITS_512) as srv:
        assert srv.url, srv.output
        req = urllib.request.Request(srv.url + "/v1/completions", method="POST",
                                     headers={"Content-Type": "application/json"},
                                     data=json.dumps({"prompt": [4, 5, 6], "max_tokens": 1000,
                                                      "ignore_eos": True, "stream": True}).encode())
        got: list[bytes] = []
        started = threading.Event()

        def read():
            with urllib.request.urlopen(req, timeout=30) as r:
                for line in r:
                    got.append(line)
                    started.set()
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert started.wait(30)
        srv.proc.send_signal(signal.SIGINT)
        assert srv.wait(timeout=30) == 0
        reader.join(timeout=10)
    assert b"data: [DONE]\n" in got
    assert "Traceback" not in srv.stderr and "CancelledError" not in srv.stderr


@pytest.mark.parametrize("args,env,needle", [
    (["serve", "--port", "99999"], {}, "--port 99999: must be 0-65535"),
    (["serve", "--port", "0", "--host", "203.0.113.7"], {}, "--host 203.0.113.7"),
    (["serve", "--port", "0"], {"MOEFIT_FAIL_ALLOC": "bogus"}, "valid keys: runtime"),
    (["generate", "--prompt", "hello", "--temperature", "-1"], {}, "--temperature -1"),
    (["generate", "--prompt", "hello", "--top-p", "0"], {}, "--top-p 0"),
])
def test_bad_flags_and_fault_keys_exit_2(tiny, args, env, needle):
    r = subprocess.run([sys.executable, "-m", "moefit", args[0], str(tiny.path), *BASE, *FITS_512,
                        *args[1:]], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr
    if "--host" in args:
        assert "choose another --port" not in r.stderr
