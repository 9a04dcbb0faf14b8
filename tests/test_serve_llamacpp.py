"""``moefit serve F.gguf --engine llama.cpp`` without llama.cpp.

``tests/data/llama_server/*.log`` are llama-server's whole logs from the llama.cpp CPU build
(commit 0c1e570), recorded by ``benchmarks/serve_llamacpp.py --record`` on the random models
of ``benchmarks/record_llamacpp.py`` (their headers: ``tests/data/llamacpp/<model>.txt``).
The tests parse them (:mod:`moefit.external.llama_server`), check the plan of the same flags
against what llama-server printed, and run ``moefit serve`` against a fake ``llama-server``
on ``PATH`` that replays a recorded log, answers ``/health`` (503 while "loading", then 200),
records the signals it gets, and dies on demand.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("gguf")

from test_engine_llamacpp import DATA as RECORDS, parse_record, sparse_gguf  # noqa: E402

from moefit.cli import build_parser, main  # noqa: E402
from moefit.errors import InputError  # noqa: E402
from moefit.external import llama_server as ls  # noqa: E402

LOGS = Path(__file__).parent / "data" / "llama_server"
MIB = 1 << 20


def _flags(log: Path) -> list[str]:
    return re.search(r"^# moefit serve flags: (.*)$", log.read_text(), re.M).group(1).split()


def _model(log: Path) -> str:
    return re.search(r"^# model: benchmarks/record_llamacpp.py (\S+)", log.read_text(), re.M).group(1)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """model name -> a header-only GGUF of the recorded model (its data a hole)."""
    d = tmp_path_factory.mktemp("gguf")
    out = {}
    for name in {_model(p) for p in LOGS.glob("*.log")}:
        rec = parse_record(RECORDS / f"{name}.txt")
        out[name] = sparse_gguf(d / f"{name}.gguf", rec["meta"], rec["tensors"])
    return out


# ---- the log's buffer lines --------------------------------------------------------------------
def test_the_buffer_lines_of_a_recorded_log():
    text = (LOGS / "qwen35moe-hybrid-0.log").read_text()
    got = [(b.function, b.buft, b.kind, round(b.bytes / MIB, 2)) for b in ls.parse_buffer_lines(text)]
    assert got == [("load_tensors", "CPU_Mapped", "model", 94.66), ("llama_context", "CPU", "output", 0.58),
                   ("llama_kv_cache", "CPU", "KV", 4.00), ("llama_memory_recurrent", "CPU", "RS", 0.11),
                   ("sched_reserve", "CPU", "compute", 9.05)]
    assert ls.parse_buffer_line("~llama_context:        CPU compute buffer size is  74.8208 MiB") is None
    assert ls.parse_buffer_line("llama_kv_cache: size =    4.00 MiB (  4096 cells,   2 layers)") is None
    cuda = ls.parse_buffer_line("load_tensors:        CUDA0 model buffer size = 11536.18 MiB")
    assert cuda.buft == "CUDA0" and not cuda.host and ls.parse_buffer_line(
        "sched_reserve:  CUDA_Host compute buffer size =   528.30 MiB").host


def _plan(path: Path, flags: list[str]):
    from moefit import cli

    args = build_parser().parse_args(["serve", str(path), "--engine", "llama.cpp", *flags])
    return cli._llamacpp_plan(args)


@pytest.mark.parametrize("log", sorted(p.name for p in LOGS.glob("*.log")))
def test_the_plan_of_the_same_flags_is_what_llama_server_allocated(models, log):
    path = LOGS / log
    ledger = ls.LoadLedger(_plan(models[_model(path)], _flags(path)))
    for b in ls.parse_buffer_lines(path.read_text()):
        ledger.add(b)
    rows = {r.key: r for r in ledger.shown()}
    # the KV caches (a full and a sliding-window one for gpt-oss: summed), the recurrent
    # state and the output buffer at the printed precision
    for key in ("kv", "state", "output"):
        if key in rows:
            assert rows[key].seen and round(rows[key].allocated / MIB, 2) == round(rows[key].planned / MIB, 2), key
    assert len(rows["kv"].seen) == (2 if "gptoss" in log else 1)
    # the mapped file and, in their own row, the repacked weights (gpt-oss's MXFP4 experts: 3.19
    # MiB of CPU_REPACK, counted in the model row before it was priced) at the printed precision
    for key in ("model", "repack"):
        assert key not in rows or round(rows[key].allocated / MIB, 2) == round(rows[key].planned / MIB, 2), key
    assert ("repack" in rows) == ("gptoss" in log) and rows["model"].seen == ["CPU_Mapped"]
    if "qwen35moe" in log:
        assert rows["state"].planned > 0
    # the compute buffer within 5% (qwen3moe-q8 16384 q8_0 was +5.5%, gpt-oss +18.4% before the
    # MoE term was the GLU's three [n_ff, top_k] rows: buffers.compute_price)
    assert abs(rows["compute"].ratio - 1) < 0.05, (rows["compute"].planned, rows["compute"].allocated)
    # before llama-server's -np outputs were priced, the plan had the logits of every -ub token:
    # 298 MiB for a compute buffer of 9.05
    assert rows["compute"].ratio > 0.8


# ---- finding llama-server ----------------------------------------------------------------------
def _exe(d: Path, name: str = "llama-server") -> Path:
    d.mkdir(parents=True, exist_ok=True)
    p = d / name
    p.write_text("#!/bin/sh\nexit 0\n")
    p.chmod(0o755)
    return p


def test_llama_server_is_found_by_flag_then_environment_then_path(tmp_path):
    a, b, c = _exe(tmp_path / "a"), _exe(tmp_path / "b"), _exe(tmp_path / "c")
    env = {"LLAMA_CPP_BIN": str(b.parent), "PATH": str(c.parent)}
    assert ls.find_llama_server(str(a.parent), env) == a
    assert ls.find_llama_server(None, env) == b
    assert ls.find_llama_server(None, {"PATH": str(c.parent)}) == c
    with pytest.raises(InputError, match=r"--llama-bin .*no executable llama-server"):
        ls.find_llama_server(str(tmp_path), env)
    with pytest.raises(InputError, match=r"\$LLAMA_CPP_BIN .*no executable"):
        ls.find_llama_server(None, {"LLAMA_CPP_BIN": str(tmp_path), "PATH": str(c.parent)})
    with pytest.raises(InputError, match=r"llama-server not found; pass --llama-bin DIR .*set \$LLAMA_CPP_BIN=DIR"
                                         r".*on PATH"):
        ls.find_llama_server(None, {"PATH": str(tmp_path)})


def test_no_llama_server_is_exit_2_naming_the_three_ways(models, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("LLAMA_CPP_BIN", raising=False)
    code = main(["serve", str(models["qwen35moe-hybrid"]), "--engine", "llama.cpp", "--device", "cpu",
                 "--vram", "2GiB", "--max-context", "4096"])
    err = capsys.readouterr().err
    assert code == 2 and "--llama-bin DIR" in err and "$LLAMA_CPP_BIN" in err and "PATH" in err
    assert "Traceback" not in err


def test_serve_refuses_what_it_cannot_run(models, tmp_path, capsys):
    f = str(models["qwen35moe-hybrid"])
    assert main(["serve", "Qwen3-30B-A3B", "--engine", "llama.cpp", "--device", "cpu", "--vram", "2GiB"]) == 2
    assert "runs a GGUF file" in capsys.readouterr().err
    assert main(["serve", f, "--engine", "llama.cpp", "--gpu", "RTX 5060 Ti 16GB"]) == 2
    assert "real device" in capsys.readouterr().err
    assert main(["serve", f, "--engine", "vllm", "--device", "cpu", "--vram", "2GiB"]) == 2
    assert "moefit plan --engine vllm" in capsys.readouterr().err
    assert main(["serve", f, "--llama-bin", str(tmp_path), "--device", "cpu", "--vram", "2GiB"]) == 2
    assert "add --engine llama.cpp" in capsys.readouterr().err


# ---- a fake llama-server -----------------------------------------------------------------------
FAKE = '''\
#!{python}
"""A stand-in for llama-server: replays $FAKE_LOG's load on stderr, /health 503 then 200."""
import http.server, os, signal, sys, threading, time
argv = sys.argv[1:]
with open(os.environ["FAKE_ARGV"], "w") as f:
    f.write("\\n".join(argv))
host, port = argv[argv.index("--host") + 1], int(argv[argv.index("--port") + 1])
mode = os.environ.get("FAKE_MODE", "ok")
ready = threading.Event()

class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        code = 200 if ready.is_set() else 503
        self.send_response(code)
        self.end_headers()
        self.wfile.write(b'{{"status":"ok"}}' if code == 200 else b'{{"error":"Loading model"}}')
    def log_message(self, *a):
        pass

def stop(signum, frame):
    with open(os.environ["FAKE_SIGNALS"], "a") as f:
        f.write(signal.Signals(signum).name + "\\n")
    if mode == "stubborn":          # a server that does not stop on a signal
        return
    print("srv    operator(): cleaning up before exit...", file=sys.stderr, flush=True)
    os._exit(0)

signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
srv = http.server.ThreadingHTTPServer((host, port), H)
threading.Thread(target=srv.serve_forever, daemon=True).start()
lines = [l for l in open(os.environ["FAKE_LOG"]).read().splitlines() if not l.startswith("#")]
end = next(i for i, l in enumerate(lines) if "listening on" in l) + 1
for i, line in enumerate(lines[:end]):
    if mode == "die" and "sched_reserve" in line:
        print("ggml_backend_cpu_buffer_type_alloc_buffer: failed to allocate buffer of size 9490432",
              file=sys.stderr, flush=True)
        print("srv    load_model: failed to load model", file=sys.stderr, flush=True)
        sys.exit(1)
    print(line, file=sys.stderr, flush=True)
    time.sleep(0.002)
if mode == "slow":
    time.sleep(60)
ready.set()
if mode == "die-ready":
    time.sleep(1.0)
    print("GGML_ASSERT(n_outputs_max <= cparams.n_outputs_max) failed", file=sys.stderr, flush=True)
    os._exit(134)
while True:
    time.sleep(1)
'''


@pytest.fixture()
def fake(tmp_path):
    """(environment with the fake llama-server first on PATH, files it writes)."""
    d = tmp_path / "fakebin"
    d.mkdir()
    exe = d / "llama-server"
    exe.write_text(FAKE.format(python=sys.executable))
    exe.chmod(0o755)
    files = {"argv": tmp_path / "argv", "signals": tmp_path / "signals"}
    env = {**os.environ, "PATH": f"{d}{os.pathsep}{os.environ.get('PATH', '')}",
           "FAKE_ARGV": str(files["argv"]), "FAKE_SIGNALS": str(files["signals"]),
           "FAKE_LOG": str(LOGS / "qwen35moe-hybrid-0.log"), "PYTHONUNBUFFERED": "1"}
    env.pop("LLAMA_CPP_BIN", None)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    return env, files


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(models, env, *extra, port=None):
    port = port or _free_port()
    cmd = [sys.executable, "-m", "moefit", "serve", str(models["qwen35moe-hybrid"]), "--engine", "llama.cpp",
           "--device", "cpu", "--vram", "2GiB", "--max-context", "4096", "--host", "127.0.0.1",
           "--port", str(port), "--threads", "1", *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), port


def _until(proc, pattern: str, timeout: float = 60) -> list[str]:
    seen = []
    t0 = time.monotonic()
    for line in proc.stdout:
        seen.append(line.rstrip("\n"))
        if re.search(pattern, line) or time.monotonic() - t0 > timeout:
            break
    return seen


@pytest.mark.process
def test_ready_planned_against_allocated_and_sigterm_passed_on(models, fake):
    env, files = fake
    proc, port = _serve(models, env)
    try:
        out = _until(proc, r"^READY")
        assert out[-1].startswith(f"READY  llama-server on http://127.0.0.1:{port}")
        text = "\n".join(out)
        # each buffer as llama-server reports it, beside its line of the plan
        assert "llama-server  CPU RS buffer 0.11 MiB  (recurrent state: planned 0.11 MiB" in text
        assert re.search(r"^  model buffers +94\.66 +94\.66 +exact +CPU_Mapped$", text, re.M)
        assert re.search(r"^  KV cache +4\.00 +4\.00 +exact", text, re.M)
        assert re.search(r"^  compute buffer +9\.01 +9\.05 +\+0\.5%", text, re.M)
        # docs/engines.md shows this table (its READY line with the benchmark's port)
        doc = (Path(__file__).parents[1] / "docs" / "engines.md").read_text()
        shown = doc[doc.index("llama-server budget  cpu"):].split("```")[0].strip().split("\n")
        table = text[text.index("llama-server budget"):].split("\n")
        assert table[:len(shown) - 1] == shown[:-1]
        assert re.sub(r":\d+", ":P", table[len(shown) - 1]) == re.sub(r":\d+", ":P", shown[-1])
        argv = files["argv"].read_text().split("\n")
        assert argv[:4] == ["-m", str(models["qwen35moe-hybrid"]), "-c", "4096"]
        assert ["--host", "127.0.0.1", "--port", str(port)] == argv[argv.index("--host"):argv.index("--host") + 4]
        assert "-fit" in argv and argv[argv.index("-t") + 1] == "1"
        proc.send_signal(signal.SIGTERM)
        rest, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert files["signals"].read_text() == "SIGTERM\n"
    assert "llama-server stopped on SIGTERM (exit 0)" in err


@pytest.mark.process
def test_a_second_signal_kills_llama_server_and_is_not_a_clean_exit(models, fake):
    env, files = fake
    proc, _ = _serve(models, {**env, "FAKE_MODE": "stubborn"}, "--api-key", "sekrit")
    try:
        out = _until(proc, r"^READY")
        assert [l for l in out if "sekrit" in l] == []
        assert any("--api-key '***'" in l for l in out)     # the key is not printed
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while not files["signals"].exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert "sekrit" in files["argv"].read_text()        # llama-server still gets it
    assert proc.returncode == 143, err
    assert "llama-server stopped on SIGTERM (exit -9)" in err


def test_the_ready_summary_counts_rows_equal_to_the_printed_mib_as_exact():
    """An output buffer of 0.00 MiB planned and 0.00 MiB allocated (a few KiB apart) is exact,
    not 100% off: the summary is the worst row the table shows off."""
    led = ls.LoadLedger.__new__(ls.LoadLedger)
    led.rows = {"output": ls.LoadRow("output", "output buffer", 1000, 2000, ["CPU"]),
                "model": ls.LoadRow("model", "model buffers", 100 * MIB, 110 * MIB, ["CPU_Mapped"])}
    assert led.worst() == pytest.approx(0.10)


@pytest.mark.process
def test_sigint_before_ready_is_passed_on(models, fake):
    env, files = fake
    proc, _ = _serve(models, {**env, "FAKE_MODE": "slow"})
    try:
        _until(proc, r"^llama-server  CPU compute buffer")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130 and files["signals"].read_text() == "SIGINT\n"
    assert "READY" not in out


@pytest.mark.process
@pytest.mark.parametrize("mode", ["die", "die-ready"])
def test_llama_server_dying_is_exit_4_with_its_last_lines_and_the_table(models, fake, mode):
    env, _ = fake
    proc, _ = _serve(models, {**env, "FAKE_MODE": mode})
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 4
    when = "before" if mode == "die" else "after"
    assert f"llama-server exited with code {1 if mode == 'die' else 134} {when} READY; its last lines:" in err
    assert ("failed to allocate buffer" if mode == "die" else "GGML_ASSERT") in err
    table = out[out.rindex("llama-server budget"):]
    assert re.search(r"^  recurrent state +0\.11 +0\.11 +exact", table, re.M)
    if mode == "die":       # the compute buffer was never allocated
        assert re.search(r"^  compute buffer +9\.01 +- *$", table, re.M)
    assert "Traceback" not in err


def test_the_command_gets_host_port_threads_and_the_log_level():
    argv = ls.server_argv("llama-server -m 'a b.gguf' -c 4096 -ot 'blk\\.(0|1)\\.ffn_(up|down)_exps=CPU' -fit off",
                          Path("/opt/llama/llama-server"), "0.0.0.0", 8080, 2)
    assert argv == ["/opt/llama/llama-server", "-m", "a b.gguf", "-c", "4096", "-ot",
                    "blk\\.(0|1)\\.ffn_(up|down)_exps=CPU", "-fit", "off", "--host", "0.0.0.0", "--port", "8080",
                    "-lv", "4", "-t", "2"]
    assert textwrap.dedent(ls.__doc__).count("-lv 4") == 1
