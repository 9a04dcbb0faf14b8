"""Errors that the command line turns into exit codes.

``InputError`` (exit 2): a flag, a size, a model name or a config the user gave is not
usable; the message names the input and the fix.
"""


class InputError(ValueError):
    """Bad user input; the message names the input and how to fix it (exit code 2)."""
