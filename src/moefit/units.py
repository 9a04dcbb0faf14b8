"""Sizes and token counts as users write them on the command line, and back.

Size syntax (:func:`parse_size`), one rule per suffix family:

1. ``<number><suffix>``, with optional spaces between them: ``16GiB``, ``16 GiB``, ``15.5G``.
   The number is decimal digits with an optional fraction (no sign, no exponent). The result
   is rounded down to a whole byte.
2. Binary suffixes ``KiB MiB GiB TiB`` mean 2^10, 2^20, 2^30, 2^40 bytes.
3. The short forms ``K M G T`` also mean binary, as in llama.cpp (``--override-tensor``,
   ``-ctk`` sizes), ``nvidia-smi`` and most GPU tools: ``16G`` == ``16GiB``.
4. Decimal suffixes ``KB MB GB TB`` mean 10^3, 10^6, 10^9, 10^12 bytes (SI), so
   ``16GB`` is 16,000,000,000 bytes, 0.93 GiB less than ``16GiB``.
5. ``B`` or no suffix means bytes.
6. The prefix letters (``K M G T`` and the ``i``) are case-insensitive (``16g``, ``16kB``,
   ``16giB``), but the byte marker must be an upper-case ``B``: a lower-case ``b`` is the
   SI/IEC symbol for *bit*, so ``16Gb``, ``16gb``, ``16Gib`` and ``512b`` are rejected as
   ambiguous rather than guessed.

Token counts (:func:`parse_count`): a whole number with an optional ``K`` (x1024) or ``M``
(x1024^2) suffix, as context lengths are written in the field (``128K`` = 131072 tokens,
``512K`` = 524288 tokens).

Every bad input raises :class:`moefit.errors.InputError` naming the flag and the fix.
"""

from __future__ import annotations

import re

from moefit.errors import InputError

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
TIB = 1 << 40

#: Byte multiplier per suffix, keyed by the upper-cased suffix (a lower-case byte marker
#: ``b`` is rejected before the lookup, see rule 6 of the module docstring).
SIZE_SUFFIXES: dict[str, int] = {
    "": 1, "B": 1,
    "K": KIB, "M": MIB, "G": GIB, "T": TIB,
    "KIB": KIB, "MIB": MIB, "GIB": GIB, "TIB": TIB,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
}

#: Token multiplier per count suffix (upper-cased).
COUNT_SUFFIXES: dict[str, int] = {"": 1, "K": 1024, "M": 1024 * 1024}

_BIT_PREFIXES = {"", "K", "M", "G", "T", "KI", "MI", "GI", "TI"}
_NUMBER_RE = re.compile(r"^(?P<num>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(?P<suffix>[A-Za-z]*)$")
#: Sizes above this are typos, not devices (1 EiB; also keeps JSON within int64).
MAX_SIZE = 1 << 60
#: A suffix-less size below this is almost surely a forgotten unit (``--vram 16``).
MIN_BARE_SIZE = 1024
_SIZE_EXAMPLES = "e.g. 16GiB, 16G (binary), 16GB (decimal, 10^9), 15.5GiB, 512MiB or a byte count"


def _split(text: object, flag: str, what: str, examples: str) -> tuple[int, int, str]:
    """Split ``text`` into (numerator, denominator, suffix), the number exactly as
    ``numerator / denominator`` (a power of ten: ``15.5`` -> 155, 10); InputError on
    anything that is not one."""
    if not isinstance(text, str):
        raise InputError(f"{flag}: expected {what} as text, got {text!r}; {examples}")
    stripped = text.strip()
    if not stripped:
        raise InputError(f"{flag}: is empty; give {what}, {examples}")
    if stripped.startswith("-"):
        raise InputError(f"{flag}: {what} must not be negative, got {text!r}; {examples}")
    match = _NUMBER_RE.match(stripped)
    if match is None:
        raise InputError(f"{flag}: cannot read {text!r} as {what}; {examples}")
    if len(match["num"]) > 40:       # more digits than any size or count (and than int() takes)
        raise InputError(f"{flag}: {stripped[:20]}... has {len(match['num'])} digits, too many "
                         f"for {what}; {examples}")
    whole, _, decimals = match["num"].partition(".")
    return int(whole + decimals), 10 ** len(decimals), match["suffix"]


def parse_size(text: str, flag: str, *, allow_zero: bool = False,
               min_bare: int = MIN_BARE_SIZE) -> int:
    """Parse a memory size such as ``16GiB``, ``16G``, ``16GB`` or ``15.5GiB`` into bytes.

    The rules are those of the module docstring: binary ``KiB``/``K``..., decimal ``KB``...,
    bytes without suffix; fractions are rounded down to a byte.

    Args:
        text: what the user typed.
        flag: the flag or input name used in error messages (``--vram``).
        allow_zero: accept a size of 0 bytes (e.g. a reserve); otherwise 0 is an error.
        min_bare: a suffix-less size below this many bytes is an error that asks for a
            unit (device sizes pass 1 MiB: ``--vram 24576`` is nvidia-smi's MiB habit, not
            a 24 KiB card).

    Returns:
        The size in bytes.

    Raises:
        InputError: empty, negative, unreadable, unknown suffix, a lower-case ``b`` (bits),
            or zero (also after rounding down) when ``allow_zero`` is False. The message
            names ``flag``.
    """
    numerator, denominator, suffix = _split(text, flag, "a size", _SIZE_EXAMPLES)
    if suffix.endswith("b") and suffix[:-1].upper() in _BIT_PREFIXES:
        prefix = suffix[:-1].upper().rstrip("I")
        fix = (f"{prefix}iB or {prefix} (binary) or {prefix}B (decimal)" if prefix
               else "B or no suffix (bytes)")
        raise InputError(
            f"{flag}: {text!r} ends in a lower-case 'b', which means bits; "
            f"write bytes with an upper-case B: {fix}"
        )
    key = suffix.upper()
    if key not in SIZE_SUFFIXES:
        raise InputError(
            f"{flag}: unknown size suffix {suffix!r} in {text!r}; use KiB/MiB/GiB/TiB or "
            f"K/M/G/T (binary), KB/MB/GB/TB (decimal) or none (bytes)"
        )
    size = numerator * SIZE_SUFFIXES[key] // denominator  # rounds down
    if size > MAX_SIZE:
        raise InputError(f"{flag}: {text!r} is more than 1 EiB; {_SIZE_EXAMPLES}")
    if key == "" and 0 < size < min_bare:
        n = text.strip()
        if min_bare > MIN_BARE_SIZE:
            hint = f"write {n}MiB if it is nvidia-smi's figure (nvidia-smi counts MiB)"
            hint += f" or {n}GiB" if size <= 1024 else ""
        else:
            hint = f"add a unit (e.g. {n}GiB)"
        raise InputError(f"{flag}: {text!r} reads as {size} bytes; {hint}, or write bytes "
                         "explicitly with a B suffix")
    if size == 0 and not allow_zero:
        raise InputError(f"{flag}: size must be more than 0 bytes, got {text!r}; {_SIZE_EXAMPLES}")
    return size


def parse_count(text: str, flag: str, *, allow_zero: bool = False) -> int:
    """Parse a token count such as ``131072``, ``128K`` or ``1M`` (K = 1024, M = 1024^2).

    A fraction is accepted only when the result is a whole number (``1.5K`` = 1536).

    Args:
        text: what the user typed.
        flag: the flag name used in error messages (``--max-context``).
        allow_zero: accept 0 tokens; otherwise 0 is an error.

    Returns:
        The count in tokens.

    Raises:
        InputError: empty, negative, unreadable, a suffix other than K/M (sizes such as
            ``KiB`` or ``GB`` are not counts), a non-whole result, or zero when not allowed.
            The message names ``flag``.
    """
    examples = "e.g. 32768, 128K (= 131072) or 1M (= 1048576)"
    numerator, denominator, suffix = _split(text, flag, "a token count", examples)
    key = suffix.upper()
    if key not in COUNT_SUFFIXES:
        raise InputError(
            f"{flag}: {text!r} is not a token count; the only suffixes are K (x1024) and "
            f"M (x1048576), {examples}"
        )
    count, rest = divmod(numerator * COUNT_SUFFIXES[key], denominator)
    if rest:
        raise InputError(f"{flag}: {text!r} is not a whole number of tokens; {examples}")
    if count == 0 and not allow_zero:
        raise InputError(f"{flag}: token count must be more than 0, got {text!r}; {examples}")
    return count


def format_gib(n: int) -> str:
    """Bytes as GiB with two decimals: ``format_gib(16_617_897_984) == '15.48 GiB'``."""
    return f"{n / GIB:.2f} GiB"


def size_format(capacity: int):
    """The formatter for sizes on a device of ``capacity`` bytes: :func:`format_gib`, or
    on a device below 1 GiB (a small simulated one) :func:`format_bytes`, so its lines do
    not all read 0.00 GiB."""
    return format_gib if capacity >= GIB else format_bytes


def format_bytes(n: int) -> str:
    """Bytes in the largest binary unit not above them: ``'15.48 GiB'``, ``'512.00 MiB'``,
    ``'4.00 KiB'``, ``'17 B'``. Negative values (shortfalls) keep their sign.

    The output is accepted by :func:`parse_size` (to within the two-decimal rounding).
    """
    magnitude = abs(n)
    for unit, name in ((TIB, "TiB"), (GIB, "GiB"), (MIB, "MiB"), (KIB, "KiB")):
        if magnitude >= unit:
            return f"{n / unit:.2f} {name}"
    return f"{n} B"
