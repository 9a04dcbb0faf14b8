"""The shared readers and writers of files: :mod:`moefit.ingest.inputs` and :mod:`moefit.outputs`."""
from __future__ import annotations

import os
import stat
import threading

import pytest

from moefit.errors import InputError
from moefit.ingest.inputs import LIMITS, bounded_int, parse_json, read_bytes, read_json, sniff
from moefit.outputs import replace_files, writable_dir


@pytest.mark.parametrize("value,ok", [
    (64, 64), (64.0, 64), (LIMITS["layers"], LIMITS["layers"]), (LIMITS["layers"] + 1, None),
    (1e9, None), (True, None), ("64", None), (float("inf"), None), (float("nan"), None),
    (64.5, None), (None, None),
])
def test_bounded_int_takes_whole_numbers_within_what_a_model_has(value, ok):
    if ok is None:
        with pytest.raises(InputError, match="num_hidden_layers") as e:
            bounded_int(value, "num_hidden_layers", "cfg.json")
        assert "cfg.json" in str(e.value)
    else:
        assert bounded_int(value, "num_hidden_layers", "cfg.json") == ok


def test_numbers_beyond_a_float_keep_their_text_for_the_message():
    doc = parse_json('{"a": 1e400, "b": ' + "9" * 5000 + ', "c": 1.5}', "x.json", "model config")
    assert doc["c"] == 1.5
    with pytest.raises(InputError, match=r"key 'a' must be a whole number, got 1e400"):
        bounded_int(doc["a"], "a", "x.json")
    with pytest.raises(InputError, match=r"got 999999999999\.\.\.\(5000 characters\)"):
        bounded_int(doc["b"], "b", "x.json")


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    done = []
    t = threading.Thread(target=lambda: done.append(pytest.raises(InputError, read_json, fifo, "model config")))
    t.start()
    t.join(5)
    assert done and "FIFO" in str(done[0].value)


def test_read_bytes_reads_only_the_head_asked_for(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(bytes(range(100)))
    assert read_bytes(path, "file", head=4, offset=10) == bytes(range(10, 14))
    with pytest.raises(InputError, match="more than the 50"):
        read_bytes(path, "file", max_bytes=50)


@pytest.mark.parametrize("data,kind", [
    (b"GGUF\x03\x00\x00\x00", "gguf"), ((5).to_bytes(8, "little") + b'{"a":1}', "safetensors"),
    (b'\xef\xbb\xbf  {"a": 1}', "json"), (b"\x89PNG\r\n\x1a\n", "binary"), (b"hello\n", "text"),
])
def test_sniff_tells_model_files_apart_by_their_first_bytes(tmp_path, data, kind):
    path = tmp_path / "blob"
    path.write_bytes(data)
    assert sniff(path) == kind


def test_replace_files_leaves_the_old_set_when_a_writer_fails(tmp_path):
    (tmp_path / "a.json").write_text("old a")
    (tmp_path / "b.md").write_text("old b")

    def boom(p):
        p.write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        replace_files(tmp_path, {"a.json": lambda p: p.write_text("new a"), "b.md": boom})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.md"]
    assert (tmp_path / "a.json").read_text() == "old a" and (tmp_path / "b.md").read_text() == "old b"
    replace_files(tmp_path, {"a.json": lambda p: p.write_text("new a")})
    assert (tmp_path / "a.json").read_text() == "new a"
    mode = stat.S_IMODE((tmp_path / "a.json").stat().st_mode)
    umask = os.umask(0o022)
    os.umask(umask)
    assert mode == 0o666 & ~umask          # as open() creates files, not mkstemp's 0600


def test_temporaries_of_a_killed_writer_are_removed_by_the_next(tmp_path):
    """``kill -9`` during ``bench --out`` (or a kernel build) left hidden temporary files
    that nothing removed; the next write into the folder removes those whose process is
    gone, and keeps those of a running one."""
    import subprocess
    import sys

    from moefit.outputs import TEMP_MARK, remove_stale_temporaries

    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)
    dead = tmp_path / f".report.{TEMP_MARK}{int(child.stdout)}-x1.tmp.json"
    live = tmp_path / f".report.{TEMP_MARK}{os.getpid()}-x2.tmp.json"
    other = tmp_path / ".notes.tmp.json"          # not ours: never touched
    for f in (dead, live, other):
        f.write_text("half")
    replace_files(tmp_path, {"report.json": lambda p: p.write_text("{}")})
    assert not dead.exists() and live.exists() and other.exists()
    assert (tmp_path / "report.json").read_text() == "{}"
    assert remove_stale_temporaries(tmp_path / "missing") == []


def test_writable_dir_creates_the_folder_or_names_why_not(tmp_path):
    assert writable_dir(tmp_path / "x" / "y", "--out x/y").is_dir()
    (tmp_path / "file").write_text("")
    with pytest.raises(InputError, match=r"--out f: .*file") as e:
        writable_dir(tmp_path / "file" / "sub", "--out f")
    assert str(tmp_path / "file") in str(e.value)
    with pytest.raises(InputError, match="is a file"):
        writable_dir(tmp_path / "file", "--out f")
