"""Errors that the command line turns into exit codes, and the exit codes themselves.

``InputError`` (exit 2): a flag, a size, a model name or a config the user gave is not
usable; the message names the input and the fix.

Exit codes of every ``moefit`` command (one home: :mod:`moefit.cli`, :mod:`moefit.serve.launch`
and :mod:`moefit.bench.command` return these):

- :data:`EXIT_OK` 0: the plan fits, or the command succeeded (also after a graceful stop
  of ``serve`` on SIGINT / SIGTERM);
- :data:`EXIT_OTHER` 1: anything else (a bug; its traceback is printed), or the output
  could not be written;
- :data:`EXIT_INPUT` 2: bad input (:class:`InputError`);
- :data:`EXIT_NOFIT` 3: the plan does not fit (``bench``: at some context of the ladder);
- :data:`EXIT_ALLOC` 4: an allocation failed while ``serve`` / ``generate`` committed the
  plan (or a prefill chunk outgrew its staging workspace);
- :data:`EXIT_INTERRUPTED` 130 (128 + SIGINT, the shell's convention): Ctrl-C before the
  command finished (``serve``: before it was ready); one line, no traceback; 143 (128 +
  SIGTERM) for ``serve`` stopped by SIGTERM before it was ready (:class:`Terminated`).
"""

import os
import signal
import sys

EXIT_OK, EXIT_OTHER, EXIT_INPUT, EXIT_NOFIT, EXIT_ALLOC = 0, 1, 2, 3, 4
EXIT_INTERRUPTED = 130


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C raises KeyboardInterrupt (``serve`` before it is ready:
    :func:`moefit.serve.launch.serve`), so it ends the same way: one line, no traceback,
    exit ``128 + SIGTERM`` (143; :func:`exit_code`)."""

    signal = signal.SIGTERM


def exit_code(interrupt: KeyboardInterrupt) -> int:
    """The exit code of an interrupt: 128 + its signal (130 for Ctrl-C, 143 for
    :class:`Terminated`), the shell's convention."""
    return 128 + getattr(interrupt, "signal", signal.SIGINT)


def exit_at_once(sig, frame) -> None:
    """A SIGINT / SIGTERM handler: one line ("moefit: interrupted", "(SIGTERM)" added) and
    exit 130 / 143 at once (``os._exit``), installed by the entry point before its imports
    (:mod:`moefit.__main__`) and by ``serve`` until the server's own handlers take over.
    Raising an exception from the handler instead was lost when the signal came while a
    finalizer ran (``import torch`` runs many): Python prints "Exception ignored" and goes
    on; and a KeyboardInterrupt inside an import printed its traceback."""
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001 -- a write in progress: what it held is lost anyway
        pass
    line = "moefit: interrupted" + (" (SIGTERM)" if sig == signal.SIGTERM else "")
    os.write(2, (line + "\n").encode())
    os._exit(128 + sig)


class InputError(ValueError):
    """Bad user input; the message names the input and how to fix it (exit code 2)."""
