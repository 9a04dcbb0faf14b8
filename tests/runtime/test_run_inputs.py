"""The commands that run the model check their inputs and outputs before the work, and stop
cleanly (issue 12, items 3, 4, 6c and 11).

- ``bench --out`` naming a folder that cannot be created, and ``calibrate`` with a cache
  folder that cannot be written: exit 2 before anything is measured.
- Ctrl-C during ``bench`` or during ``serve`` / ``generate`` start-up: one line, exit 130,
  no traceback, and ``bench --out`` holds its previous files, never a half-written mix
  (the three files are written to temporary names and renamed).
- ``MOEFIT_FAIL_ALLOC`` keys that would do nothing on a simulated device: ``runtime`` and
  ``margin`` fail where the line is committed (exit 4, the line marked); ``weight_arena``
  with ``--miss-policy cpu`` (no arena) is refused (exit 2).
- ``--routing-profile``: read and checked (expert and layer ids in range) with the other
  inputs, before any weight is loaded.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moefit.cli import main
from serving import make_servable

DEVICE = ["--device", "cpu", "--vram", "64MiB"]
EXIT_INTERRUPTED = 130


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_servable(tmp_path_factory.mktemp("ckpt"), max_position_embeddings=4096)


@pytest.fixture
def no_runs(monkeypatch):
    """Record the measuring calls of bench and calibrate (none must happen)."""
    import moefit.bench.command as command
    import moefit.bench.ladder as ladder

    calls = []
    monkeypatch.setattr(ladder, "run_context", lambda *a, **k: calls.append(a) or pytest.fail("measured"))
    monkeypatch.setattr(command, "measure_point", lambda *a, **k: calls.append(a) or pytest.fail("measured"))
    return calls


def run(argv: list[str]) -> int:
    """``moefit ARGV`` in-process; a KeyboardInterrupt that escapes is a failure (the user
    would see its traceback), not the end of the test session."""
    try:
        return main(argv)
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped moefit.cli.main (a traceback for the user)")


def error_lines(err: str) -> list[str]:
    assert "Traceback" not in err, err
    return [l for l in err.splitlines() if l.startswith("moefit: error:")]


# ---- item 3: outputs that cannot be written are bad input, found before measuring ------------
def test_bench_out_that_cannot_be_created_is_refused_before_measuring(tiny, tmp_path, capsys, no_runs):
    afile = tmp_path / "afile"
    afile.write_text("x")
    code = main(["bench", str(tiny.path), *DEVICE, "--contexts", "1K", "--no-progress",
                 "--out", str(afile / "bench")])
    lines = error_lines(capsys.readouterr().err)
    assert code == 2 and no_runs == []
    assert len(lines) == 1 and "--out" in lines[0] and str(afile / "bench") in lines[0], lines


def test_calibrate_with_an_unwritable_cache_is_refused_before_measuring(tiny, tmp_path, capsys,
                                                                        monkeypatch, no_runs):
    afile = tmp_path / "afile"
    afile.write_text("x")
    monkeypatch.setenv("MOEFIT_CACHE_DIR", str(afile / "cache"))
    code = main(["calibrate", str(tiny.path), *DEVICE])
    lines = error_lines(capsys.readouterr().err)
    assert code == 2 and no_runs == []
    assert len(lines) == 1 and "MOEFIT_CACHE_DIR" in lines[0] and str(afile) in lines[0], lines


# ---- item 4 and 6c: Ctrl-C, and bench files written whole ------------------------------------
def _old_bench(out: Path) -> dict[str, bytes]:
    out.mkdir()
    old = {"bench.json": b'{"old": true}\n', "bench.md": b"old\n", "bench.png": b"old png"}
    for name, data in old.items():
        (out / name).write_bytes(data)
    return old


def test_ctrl_c_during_bench_exits_130_and_keeps_the_old_files(tiny, tmp_path, capsys, monkeypatch):
    import moefit.bench.ladder as ladder

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(ladder, "run_context", interrupted)
    out = tmp_path / "bench"
    old = _old_bench(out)
    code = run(["bench", str(tiny.path), *DEVICE, "--contexts", "1K", "--no-progress",
                 "--no-calibration", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == EXIT_INTERRUPTED
    assert "Traceback" not in err and len([l for l in err.splitlines() if "interrupted" in l]) == 1, err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == old


def test_ctrl_c_while_bench_writes_its_files_leaves_no_mix(tiny, tmp_path, capsys, monkeypatch):
    """Killed while the chart is drawn (after bench.json and bench.md were produced): the
    folder still holds the previous run's three files, and no temporary file."""
    import moefit.bench.report as report

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(report, "chart", interrupted)
    out = tmp_path / "bench"
    old = _old_bench(out)
    code = run(["bench", str(tiny.path), *DEVICE, "--contexts", "1K", "--prefill", "256",
                 "--decode-tokens", "2", "--no-progress", "--no-calibration", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == EXIT_INTERRUPTED and "Traceback" not in err, err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == old


def test_bench_replaces_its_files_whole(tiny, tmp_path, capsys):
    out = tmp_path / "bench"
    _old_bench(out)
    code = main(["bench", str(tiny.path), *DEVICE, "--contexts", "1K", "--prefill", "256",
                 "--decode-tokens", "2", "--no-progress", "--no-calibration", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["bench.json", "bench.md", "bench.png"]
    assert json.loads((out / "bench.json").read_text())["schema"] == "moefit.bench/1"
    assert (out / "bench.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_ctrl_c_during_startup_exits_130_in_one_line(tiny, capsys, monkeypatch, command):
    import moefit.ingest.resolve as resolve
    import moefit.serve.launch as launch

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(resolve, "load_model", interrupted)
    monkeypatch.setattr(launch, "prepare", interrupted)
    extra = ["--port", "0"] if command == "serve" else ["--prompt", "hi"]
    code = run([command, str(tiny.path), *DEVICE, *extra])
    err = capsys.readouterr().err
    assert code == EXIT_INTERRUPTED
    assert err.strip().count("\n") == 0 and "interrupted" in err and "Traceback" not in err, err


SLOW_COMMIT = """
import sys, time
import moefit.runtime.engine as engine
start = engine.Engine.start.__func__
def slow(cls, *a, **k):
    print("COMMITTING", file=sys.stderr, flush=True)
    time.sleep(60)
    return start(cls, *a, **k)
engine.Engine.start = classmethod(slow)
from moefit.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigint_while_serve_commits_the_plan_exits_130(tiny, tmp_path):
    """A real SIGINT to `moefit serve` while the weights load (the commit runs beside the
    server): exit 130 and one line, not 0 as after a graceful stop of a running server."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2] / "src"),
                                                        os.environ.get("PYTHONPATH", "")])}
    err_path = tmp_path / "err.txt"
    with err_path.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-c", SLOW_COMMIT, "serve", str(tiny.path), *DEVICE,
                                 "--port", "0"], stdout=subprocess.DEVNULL, stderr=err, env=env)
        try:
            deadline = time.monotonic() + 60
            while "COMMITTING" not in err_path.read_text() and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(0.5)
            proc.send_signal(signal.SIGINT)
            code = proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
    text = err_path.read_text()
    assert code == EXIT_INTERRUPTED, text
    assert "Traceback" not in text and len([l for l in text.splitlines() if "interrupted" in l]) == 1, text


SLOW_PREPARE = """
import sys, time
import moefit.serve.launch as launch
prepare = launch.prepare
def slow(*a, **k):
    out = prepare(*a, **k)
    print("PREPARED", file=sys.stderr, flush=True)
    time.sleep(60)
    return out
launch.prepare = slow
from moefit.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.process
def test_sigterm_before_serve_starts_its_server_is_one_line_and_143(tiny, tmp_path):
    """SIGTERM once the plan is printed, before the server (and its signal handlers) run:
    one line and 143 (128 + SIGTERM), as Ctrl-C there gives one line and 130; it was the
    signal's silent default death (143, nothing said)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2] / "src"),
                                                        os.environ.get("PYTHONPATH", "")])}
    err_path = tmp_path / "err.txt"
    with err_path.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-c", SLOW_PREPARE, "serve", str(tiny.path), *DEVICE,
                                 "--port", "0"], stdout=subprocess.DEVNULL, stderr=err, env=env)
        try:
            deadline = time.monotonic() + 60
            while "PREPARED" not in err_path.read_text() and time.monotonic() < deadline:
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
    text = err_path.read_text()
    assert code == 128 + signal.SIGTERM, text
    lines = [l for l in text.splitlines() if "interrupted" in l]
    assert "Traceback" not in text and lines == ["moefit: interrupted (SIGTERM)"], text


# ---- item 6c: MOEFIT_FAIL_ALLOC keys on a simulated device -----------------------------------
@pytest.mark.parametrize("key", ["runtime", "margin"])
def test_fail_alloc_of_a_line_without_tensors_fails_where_it_is_committed(tiny, capsys, monkeypatch, key):
    monkeypatch.setenv("MOEFIT_FAIL_ALLOC", key)
    code = main(["generate", str(tiny.path), *DEVICE, "--prompt", "hi", "--max-tokens", "1"])
    out = capsys.readouterr()
    assert code == 4, out.err
    marked = [l for l in (out.out + out.err).splitlines() if "allocation failed here" in l]
    label = {"runtime": "runtime", "margin": "safety margin"}[key]
    assert len(marked) == 1 and marked[0].strip().startswith(label), marked
    assert "MOEFIT_FAIL_ALLOC" in out.err and "Traceback" not in out.err


def test_fail_alloc_of_the_weight_arena_without_copied_misses_is_refused(tiny, capsys, monkeypatch):
    monkeypatch.setenv("MOEFIT_FAIL_ALLOC", "weight_arena")
    code = main(["generate", str(tiny.path), *DEVICE, "--prompt", "hi", "--max-tokens", "1",
                 "--miss-policy", "cpu"])
    lines = error_lines(capsys.readouterr().err)
    assert code == 2 and len(lines) == 1
    assert "weight_arena" in lines[0] and "--miss-policy" in lines[0], lines


# ---- item 11: --routing-profile checked before the weights load ------------------------------
@pytest.fixture
def no_commit(monkeypatch):
    import moefit.runtime.engine as engine

    calls = []

    def start(*a, **k):
        calls.append(a)
        pytest.fail("the engine started")

    monkeypatch.setattr(engine.Engine, "start", start)
    return calls


@pytest.mark.parametrize("profile,needle", [
    ({"0": {"99": 5}}, "expert 99"),            # 8 experts per layer
    ({"0": {"-1": 5}}, "expert -1"),
    ({"7": {"0": 5}}, "layer 7"),               # 2 layers
    ({"0": {"1": -3}}, "count"),
    ({"0": {"1": 1e400}}, "count"),
    ({"0": ["1", "2"]}, "layer 0"),
    ([1, 2], "routing profile"),
])
def test_routing_profile_is_checked_before_loading(tiny, tmp_path, capsys, no_commit, profile, needle):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile).replace("Infinity", "1e400"))
    code = main(["generate", str(tiny.path), *DEVICE, "--prompt", "hi",
                 "--routing-profile", str(path)])
    lines = error_lines(capsys.readouterr().err)
    assert code == 2 and no_commit == []
    assert len(lines) == 1 and str(path) in lines[0] and needle in lines[0], lines


def test_missing_routing_profile_is_refused_before_loading(tiny, tmp_path, capsys, no_commit):
    code = main(["serve", str(tiny.path), *DEVICE, "--port", "0",
                 "--routing-profile", str(tmp_path / "nope.json")])
    lines = error_lines(capsys.readouterr().err)
    assert code == 2 and no_commit == [] and "nope.json" in lines[0], lines


# ---- generate admits a request as the API does ----------------------------------------------
def test_generate_refuses_max_tokens_past_the_context_before_loading(tiny, capsys, no_commit):
    """The API answers 400 when prompt + max_tokens exceed the context; generate used to stop
    silently at the context's end (1022 of 2000 tokens): it refuses the same way (the one
    admission check, ``check_prompt``), naming the limit and the fix."""
    code = main(["generate", str(tiny.path), *DEVICE, "--prompt", "hi", "--max-tokens", "2000",
                 "--max-context", "1024"])
    lines = error_lines(capsys.readouterr().err)
    assert code == 2 and no_commit == [] and len(lines) == 1, lines
    assert "--max-tokens 2000" in lines[0] and "more than the planned context of 1024 tokens" in lines[0]
    assert "lower --max-tokens or plan a larger --max-context" in lines[0]


@pytest.mark.parametrize("stops", [[""], ["ok", ""]])
def test_generate_refuses_an_empty_stop_string(tiny, capsys, no_commit, stops):
    argv = [a for s in stops for a in ("--stop", s)]
    code = main(["generate", str(tiny.path), *DEVICE, "--prompt", "hi", "--max-tokens", "2", *argv])
    lines = error_lines(capsys.readouterr().err)
    assert code == 2 and no_commit == [] and len(lines) == 1, lines
    assert lines[0].startswith('moefit: error: --stop "": an empty stop string'), lines



#: The entry point with the signal sent from inside the command line's imports (an audit hook
#: on the import of moefit.flags, which moefit.cli imports): where a Ctrl-C in the first
#: ~0.25 s of `moefit serve` landed, deterministically.
SIGNAL_IN_IMPORTS = """
import os, runpy, signal, sys
sig = getattr(signal, sys.argv.pop(1))
def hook(event, args):
    if event == "import" and args[0] == "moefit.flags":
        os.kill(os.getpid(), sig)
sys.addaudithook(hook)
sys.argv[0] = "moefit"
runpy.run_module("moefit", run_name="__main__", alter_sys=True)
"""


@pytest.mark.process
@pytest.mark.parametrize("sig,code,line", [("SIGINT", 130, "moefit: interrupted"),
                                           ("SIGTERM", 143, "moefit: interrupted (SIGTERM)")])
def test_a_signal_inside_the_entry_points_imports_is_one_line(sig, code, line, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2] / "src"),
                                                        os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", SIGNAL_IN_IMPORTS, sig, "serve",
                           str(tmp_path / "none"), "--port", "0"], capture_output=True,
                          text=True, env=env, timeout=60)
    assert proc.returncode == code, proc.stderr
    assert proc.stderr.strip().splitlines() == [line], proc.stderr
