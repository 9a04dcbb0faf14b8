"""Sizes and token counts as the command line takes them (moefit.units)."""

from decimal import Decimal
import math

import pytest
from hypothesis import given, strategies as st

from moefit.errors import InputError
from moefit.units import format_bytes, format_gib, parse_count, parse_size

# The meaning of each suffix, written out here independently of the module's table.
BINARY = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
          "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
DECIMAL = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
BYTES = {"": 1, "B": 1}
ALL_SUFFIXES = {**BINARY, **DECIMAL, **BYTES}


@pytest.mark.parametrize("text, expected", [
    ("16GiB", 16 * 2**30),
    ("16384MiB", 16 * 2**30),
    ("512KiB", 512 * 1024),
    ("16G", 16 * 2**30),          # short forms are binary, as in llama.cpp and nvidia-smi
    ("16GB", 16 * 10**9),         # decimal suffixes are SI
    ("16 GiB", 16 * 2**30),
    ("  2GiB ", 2 * 2**30),
    ("15.5GiB", 31 * 2**29),
    ("1.5K", 1536),
    ("4096", 4096),
    ("4096B", 4096),
    ("16g", 16 * 2**30),          # prefix letters are case-insensitive
    ("16giB", 16 * 2**30),
    ("16kB", 16 * 1000),
    ("1T", 2**40),
])
def test_parse_size_accepts_the_documented_forms(text, expected):
    assert parse_size(text, "--vram") == expected


@given(n=st.integers(min_value=1, max_value=10**6), suffix=st.sampled_from(sorted(ALL_SUFFIXES)))
def test_parse_size_round_trips_every_suffix(n, suffix):
    if suffix == "" and n < 1024:
        return   # a bare small number is a forgotten unit (next test)
    assert parse_size(f"{n}{suffix}", "--vram") == n * ALL_SUFFIXES[suffix]


@pytest.mark.parametrize("text", ["16", "24", "1023"])
def test_bare_small_number_is_a_forgotten_unit(text):
    with pytest.raises(InputError, match=f"--vram.*{text}GiB"):
        parse_size(text, "--vram")
    assert parse_size(text + "B", "--vram") == int(text)   # explicit bytes are fine


@pytest.mark.parametrize("text", ["\u0661\u0666G", "2EiB", "99999999999999999999999999TiB"])
def test_non_ascii_digits_and_absurd_sizes_are_errors(text):
    with pytest.raises(InputError, match="--vram"):
        parse_size(text, "--vram")


@given(n=st.integers(min_value=1, max_value=4096),
       prefix=st.sampled_from("KMGT"), upper=st.lists(st.booleans(), min_size=2, max_size=2))
def test_prefix_letters_ignore_case_but_the_byte_marker_does_not(n, prefix, upper):
    p = prefix if upper[0] else prefix.lower()
    i = "I" if upper[1] else "i"
    assert parse_size(f"{n}{p}{i}B", "--vram") == n * BINARY[prefix + "iB"]
    assert parse_size(f"{n}{p}B", "--vram") == n * DECIMAL[prefix + "B"]
    for bits in (f"{n}{p}b", f"{n}{p}{i}b"):
        with pytest.raises(InputError, match="--vram.*bits"):
            parse_size(bits, "--vram")


@given(units=st.integers(min_value=1, max_value=10**5), frac=st.integers(min_value=0, max_value=999),
       suffix=st.sampled_from(sorted(BINARY) + sorted(DECIMAL)))
def test_fractions_round_down_to_a_byte(units, frac, suffix):
    text = f"{units}.{frac:03d}{suffix}"
    expected = math.floor(Decimal(f"{units}.{frac:03d}") * ALL_SUFFIXES[suffix])
    assert parse_size(text, "--vram") == expected


@pytest.mark.parametrize("text", [
    "", "   ", "-1G", "-0", "0", "0GiB", "0.1",   # empty, negative, zero (also after rounding)
    "abc", "G", "1e9", "1.2.3G", "16 G B", "0x10", "16 XB", "16PiB", "16GiBs",
    "16Gb", "16gb", "16Gib", "512b",            # lower-case b = bits
])
def test_bad_sizes_are_input_errors_naming_the_flag(text):
    with pytest.raises(InputError) as err:
        parse_size(text, "--vram-free")
    assert "--vram-free" in str(err.value)


def test_non_text_size_is_an_input_error():
    with pytest.raises(InputError, match="--vram"):
        parse_size(16, "--vram")  # type: ignore[arg-type]


def test_zero_is_accepted_only_when_allowed():
    assert parse_size("0", "--reserve", allow_zero=True) == 0
    assert parse_size("0MiB", "--reserve", allow_zero=True) == 0
    with pytest.raises(InputError, match="--reserve"):
        parse_size("0", "--reserve")


def test_format_gib_matches_the_design_example():
    # docs/design.md, output, shows an RTX 5060 Ti: 15.48 GiB free of 15.93 GiB; gpus.csv gives its
    # CUDA total as 16617897984 B and its nvidia-smi total as 16311 MiB.
    assert format_gib(16_617_897_984) == "15.48 GiB"
    assert format_gib(16311 * 2**20) == "15.93 GiB"


@pytest.mark.parametrize("n, unit", [
    (0, " B"), (1023, " B"), (1024, " KiB"), (2**20 - 1, " KiB"), (2**20, " MiB"),
    (2**30 - 1, " MiB"), (2**30, " GiB"), (2**40, " TiB"), (-3 * 2**30, " GiB"),
])
def test_format_bytes_picks_the_largest_unit_not_above_the_size(n, unit):
    assert format_bytes(n).endswith(unit)


@given(st.integers(min_value=1, max_value=2**45))
def test_format_bytes_reads_back_within_its_rounding(n):
    back = parse_size(format_bytes(n), "--vram", allow_zero=True)
    assert abs(back - n) <= 0.005 * n + 1


def test_format_bytes_keeps_the_sign_of_a_shortfall():
    assert format_bytes(-(2**30 + 2**29)) == "-1.50 GiB"


@pytest.mark.parametrize("text, expected", [
    ("131072", 131072), ("128K", 131072), ("128k", 131072), ("512K", 524288),
    ("1M", 2**20), ("1.5K", 1536), (" 32768 ", 32768),
])
def test_parse_count_reads_contexts_as_written_in_the_field(text, expected):
    assert parse_count(text, "--max-context") == expected


@given(n=st.integers(min_value=1, max_value=10**6), suffix=st.sampled_from(["", "K", "k", "M", "m"]))
def test_parse_count_round_trips(n, suffix):
    factor = {"": 1, "k": 1024, "m": 2**20}[suffix.lower()]
    assert parse_count(f"{n}{suffix}", "--max-context") == n * factor


@pytest.mark.parametrize("text", [
    "", "-5", "0", "0K", "abc", "1.3K", "0.5", "16KiB", "16KB", "1G", "1e6", "12 tokens",
])
def test_bad_counts_are_input_errors_naming_the_flag(text):
    with pytest.raises(InputError) as err:
        parse_count(text, "--max-context")
    assert "--max-context" in str(err.value)


def test_zero_count_only_when_allowed():
    assert parse_count("0", "--slots", allow_zero=True) == 0
