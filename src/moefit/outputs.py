"""Writing output files: the folder checked before the work, each file replaced whole.

``bench --out DIR`` and the calibration cache write files that a later run reads. Both
check, before anything is measured, that their folder can be created and written
(:func:`writable_dir`), and replace their files atomically (:func:`replace_files`): each
file is written to a temporary name in the same folder, flushed, and renamed over the old
one only when every file of the set is complete, so an interrupted run (Ctrl-C, a kill, a
full disk) leaves the previous files, never a truncated file or a mix of old and new.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable

from moefit.errors import InputError


def writable_dir(path: str | Path, what: str) -> Path:
    """Create the folder ``path`` (and its parents) when missing and check that a file
    can be written in it; ``what`` names it in errors (``--out bench``).

    Errors: InputError naming ``what`` and the reason (a file in the way, no permission,
    a read-only file system).
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise InputError(f"{what}: {path} is a file; give a folder (it is created when missing)")
    import tempfile     # only a command that writes files (not a plan)

    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".moefit-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        where = f" ({e.filename})" if e.filename and str(e.filename) != str(path) else ""
        raise InputError(f"{what}: cannot create or write the folder {path}{where}: "
                         f"{e.strerror or e}; choose a folder you can write") from None
    return path


#: The mark in the name of every temporary file moefit writes, followed by the writer's
#: process id: ``.report.moefit-tmp-4242-x1y2.tmp.json``.
TEMP_MARK = "moefit-tmp-"
_TEMP_PID = re.compile(re.escape(TEMP_MARK) + r"(\d+)-")


def writable_file(path: str | Path, what: str) -> Path:
    """A file to write at the end of a run (``--record-routing FILE``): not a folder, and
    its folder created and writable now (:func:`writable_dir`). Returns the path (``~``
    expanded). Errors: InputError naming ``what``."""
    target = Path(path).expanduser()
    if target.is_dir():
        raise InputError(f"{what}: {target} is a folder; give the file to write")
    writable_dir(target.parent, what)
    return target


def temp_prefix(stem: str) -> str:
    """The name start of a temporary file of this process (:data:`TEMP_MARK`, the pid)."""
    return f"{stem}.{TEMP_MARK}{os.getpid()}-"


def remove_stale_temporaries(folder: Path) -> list[Path]:
    """Remove the temporary files in ``folder`` (names with :data:`TEMP_MARK`) whose writing
    process no longer runs: a writer killed with SIGKILL cannot remove its own, and nothing
    else would. A file of a running process (or one whose pid was reused) stays. Returns
    the removed paths; errors (a file gone meanwhile, no permission) are skipped."""
    removed = []
    try:
        names = [n for n in os.listdir(folder) if TEMP_MARK in n]
    except OSError:
        return removed
    for name in names:
        m = _TEMP_PID.search(name)
        if m is None or _running(int(m.group(1))):
            continue
        try:
            (folder / name).unlink()
            removed.append(folder / name)
        except OSError:
            pass
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True      # another user's process (or an absurd number): leave its file
    return True


def replace_files(folder: Path, writers: dict[str, Callable[[Path], None]]) -> list[Path]:
    """Write the files of ``writers`` (``{name: write(tmp_path)}``) into ``folder`` as one
    set: every writer writes its temporary file, then all are renamed into place.

    On any exception (KeyboardInterrupt included) the temporary files are removed and the
    previous files stay as they were; the exception propagates; those of an earlier writer
    killed outright are removed first (:func:`remove_stale_temporaries`). Returns the final
    paths.
    """
    import tempfile

    done: list[tuple[Path, Path]] = []
    remove_stale_temporaries(folder)         # left by a writer killed with SIGKILL
    try:
        for name, write in writers.items():
            final = folder / name
            # a hidden name that keeps the extension (matplotlib picks the format by it)
            fd, tmp = tempfile.mkstemp(prefix=temp_prefix(f".{final.stem}"),
                                       suffix=f".tmp{final.suffix}", dir=folder)
            os.close(fd)
            os.chmod(tmp, default_file_mode())   # as open() would create it, not mkstemp's 0600
            done.append((Path(tmp), final))
            write(Path(tmp))
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
    except BaseException:
        for tmp, _ in done:
            tmp.unlink(missing_ok=True)
        raise
    for tmp, final in done:
        os.replace(tmp, final)
    return [final for _, final in done]


def default_file_mode() -> int:
    """The mode ``open()`` gives a new file: ``0o666`` less the process's umask (a writer
    that goes through a private temporary file, as ``mkstemp`` and safetensors'
    ``save_file`` do, leaves ``0o600``)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def write_text_atomic(path: Path, text: str) -> Path:
    """Replace ``path`` with ``text`` (UTF-8) atomically (:func:`replace_files`)."""
    return replace_files(path.parent, {path.name: lambda tmp: tmp.write_text(text, encoding="utf-8")})[0]
