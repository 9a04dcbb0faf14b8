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

import signal

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


class InputError(ValueError):
    """Bad user input; the message names the input and how to fix it (exit code 2)."""
