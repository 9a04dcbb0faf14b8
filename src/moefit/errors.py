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
  command finished (``serve``: before it was ready); one line, no traceback.
"""

EXIT_OK, EXIT_OTHER, EXIT_INPUT, EXIT_NOFIT, EXIT_ALLOC = 0, 1, 2, 3, 4
EXIT_INTERRUPTED = 130


class InputError(ValueError):
    """Bad user input; the message names the input and how to fix it (exit code 2)."""
