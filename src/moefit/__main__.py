"""The ``moefit`` command's entry point (``python -m moefit`` and the ``moefit`` script).

SIGINT and SIGTERM get :func:`moefit.errors.exit_at_once` (one line, exit 130 / 143)
before the command line's imports run (about 0.5 s: every command's modules), so a signal
then gives no KeyboardInterrupt traceback from inside an import; :func:`moefit.cli.main`
puts the previous handlers back once it has read the arguments (it turns Ctrl-C into the
same line and code, and lets the commands clean up), except for ``serve``, which keeps
exiting at once until its server is up."""

import signal
import sys

from moefit.errors import exit_at_once

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    """Run the command line (:func:`moefit.cli.main`); returns its exit code."""
    previous = {sig: signal.signal(sig, exit_at_once) for sig in SIGNALS}
    # after the handlers, by design: this import is the 0.5 s a signal must not interrupt
    from moefit.cli import main as cli_main

    return cli_main(argv, signal_handlers=previous)


if __name__ == "__main__":
    sys.exit(main())
