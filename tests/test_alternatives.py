"""`fits with:` alternatives: each one, applied to the command line exactly as printed, fits.

No torch: `moefit plan` in-process, its text parsed as a user would read it.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from moefit.cli import main
from test_engine_llamacpp import header_writer  # the one writer of header-only GGUFs

FIELD = ["Qwen3.5-35B-A3B", "--max-context", "512K", "--rope-scaling", "yarn", "--rope-scale", "2",
         "--kv", "int8", "--prefill", "24576"]
#: flags that take no value
SWITCHES = {"--strict", "--json", "--no-calibration"}

SCENARIOS = {
    # one device: copied misses with a hand-set ring; --miss-policy cpu needs --arena-slots gone
    "copy-arena": ["Qwen3-30B-A3B", "--gpu", "RTX 4090", "--vram-free", "7GiB", "--max-context", "16K",
                   "--miss-policy", "copy", "--arena-slots", "200"],
    # the README's 6 GiB card
    "6gib": [*FIELD, "--vram", "6GiB"],
    # docs/host-and-devices.md's four cards with a host of 18 GiB: a smaller chunk leaves room on the host
    "four-cards-host": [*FIELD, "--gpu", "RTX 5060 Ti 16GB", "x4", "--host-ram", "18GiB"],
    # a host reserve set by hand
    "host-reserve": ["Qwen3-30B-A3B", "--gpu", "RTX 4090", "--max-context", "16K", "--host-ram", "56GiB",
                     "--host-reserve-mib", "20000"],
    # the host short of expert blobs: a smaller chunk or context leaves more slots on the card
    "host-chunk": ["Qwen3-30B-A3B", "--gpu", "RTX 4090", "--max-context", "16K", "--host-ram", "40GiB",
                   "--prefill", "16384"],
    # --strict: the chunk that fits
    "strict": [*FIELD, "--gpu", "RTX 3060 12GB", "--strict"],
    # four cards, the expert split forced where only the layer split fits
    "split": ["Qwen3-235B-A22B", "--gpu", "RTX 5060 Ti 16GB", "x4", "--max-context", "32K",
              "--split", "experts"],
}


def plan(argv: list[str]) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["plan", *argv, "--no-calibration"])
    assert "Traceback" not in err.getvalue()
    return code, out.getvalue()


def printed_alternatives(text: str) -> list[str]:
    lines = text.split("fits with:\n", 1)[1].splitlines() if "fits with:\n" in text else []
    return [l for l in lines if l.startswith("  --")]


def without(argv: list[str], flag: str) -> list[str]:
    """``argv`` with ``flag`` and its value removed (``--gpu NAME xN`` keeps its count)."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] == flag:
            i += 1 if flag in SWITCHES else 2
            continue
        out.append(argv[i])
        i += 1
    return out


def applied(argv: list[str], line: str) -> list[str]:
    """The command line with the printed change: ``FLAG VALUE[ without FLAG ...][   (note)]``."""
    change = line.strip().split("   (")[0]
    head, *drops = change.split(" without ")
    words = head.split(" ")     # FLAG VALUE, and the flags that change with it (--engine llama.cpp --kv q8_0)
    pairs = list(zip(words[::2], words[1::2]))
    for d in [*(f for f, _ in pairs), *drops]:
        argv = without(argv, d)
    return [*argv, *(w for pair in pairs for w in pair)]


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_printed_alternative_fits_with_exactly_the_printed_flags(name):
    argv = SCENARIOS[name]
    code, text = plan(argv)
    assert code == 3, text
    alts = printed_alternatives(text)
    assert alts, text
    for line in alts:
        again, out = plan(applied(argv, line))
        assert again == 0, (line, out[-600:])


def test_the_alternatives_the_findings_asked_for_are_offered():
    """--miss-policy cpu comes with --arena-slots dropped; a host that is short is offered a
    smaller --prefill and a smaller --host-reserve-mib; --split layers says it is planned,
    not run; the JSON carries the same."""
    alts = {name: printed_alternatives(plan(argv)[1]) for name, argv in SCENARIOS.items()}
    assert "  --miss-policy cpu without --arena-slots" in [a.split("   (")[0] for a in alts["copy-arena"]]
    assert any(a.startswith("  --prefill ") for a in alts["four-cards-host"])
    assert any(a.startswith("  --prefill ") for a in alts["host-chunk"])
    assert any(a.startswith("  --host-reserve-mib ") for a in alts["host-reserve"])
    assert any(a.startswith("  --split layers   (planned only") for a in alts["split"])
    doc = json.loads(plan([*SCENARIOS["copy-arena"], "--json"])[1])
    assert {"flag": "--miss-policy", "value": "cpu", "drop": ["--arena-slots"]} in [
        {k: v for k, v in a.items() if k != "speed"} for a in doc["alternatives"]]


def test_a_host_margin_left_at_its_default_is_not_limiting():
    """The default host margin is not a choice of the user's: the limiting lines name what
    a flag can shrink; a margin set by hand is named (and a smaller one offered)."""
    argv = ["Qwen3.5-35B-A3B", "--gpu", "RTX 5060 Ti 16GB", "--host-ram", "4GiB"]
    code, text = plan(argv)
    assert code == 3 and "limiting: host expert blobs\n" in text
    code, text = plan([*argv[:-2], "--host-ram", "8GiB", "--host-reserve-mib", "7000",
                       "--max-context", "4K"])
    assert code == 3 and "host safety margin" in text.split("limiting:")[1].splitlines()[0]


def test_a_host_short_of_its_default_margin_is_offered_a_smaller_one():
    """The default margin is not limiting, but when the host lacks less than it, a smaller
    --host-reserve-mib set by hand fits (and is printed so that it does, applied as is).
    The chunk is pinned: the alternatives are solved at the largest chunk that fits, where
    --prefill auto weighs smaller ones too (which may hold more experts on the device and
    so fit a larger margin)."""
    argv = ["Qwen3-30B-A3B", "--gpu", "RTX 3060 12GB", "--max-context", "32K", "--host-ram", "53GiB",
            "--prefill", "16384"]
    code, text = plan(argv)
    assert code == 3 and "short by" in text and "on the host" in text
    reserve = [a for a in printed_alternatives(text) if a.startswith("  --host-reserve-mib ")]
    assert len(reserve) == 1, text
    assert plan(applied(argv, reserve[0]))[0] == 0
    mib = int(reserve[0].split()[1])
    assert plan([*argv, "--host-reserve-mib", str(mib + 1)])[0] == 3      # the largest that fits


def test_a_float_checkpoint_whose_host_is_short_is_offered_the_gguf_file_that_fits(tmp_path):
    """No flag makes bf16 Qwen3-30B-A3B fit a 8 GiB host; the least lossy GGUF file that does
    is named (with the flags it needs), and the file llama-quantize's mix gives, written
    (headers only) and planned as any GGUF, fits with exactly those flags; where none does, the
    report says a larger host, naming what was tried, and the smallest file indeed fails."""
    argv = ["--gpu", "RTX 3060 12GB", "--max-context", "32K", "--host-ram", "8GiB"]
    code, text = plan(["Qwen3-30B-A3B", *argv])
    assert code == 3 and "nothing short" not in text
    line = text.split("fits with:\n", 1)[1].splitlines()[0]
    assert line.startswith("  MODEL Qwen3-30B-A3B-Q8_0.gguf --host-experts mmap   (the model as a GGUF file"), text
    doc = json.loads(plan(["Qwen3-30B-A3B", *argv, "--json"])[1])
    assert doc["alternatives"][0]["flag"] == "MODEL"
    assert doc["alternatives"][0]["with"] == [{"flag": "--host-experts", "value": "mmap"}]
    writer = header_writer()
    q8 = str(writer.write_header_gguf("Qwen3-30B-A3B", "Q8_0", tmp_path / "Qwen3-30B-A3B-Q8_0.gguf"))
    assert plan([q8, *argv, "--host-experts", "mmap"])[0] == 0
    assert plan([q8, *argv])[0] == 3                    # the flag printed with it is needed

    small = ["--gpu", "RTX 3060 12GB", "--max-context", "4K", "--host-ram", "2GiB"]
    code, text = plan(["Qwen3-30B-A3B", *small])
    assert code == 3
    assert text.rstrip().endswith("fits with: nothing short of a larger host (no single flag change, "
                                  "nor a GGUF file of the model down to Q4_K_M, makes it fit)"), text
    q4 = str(writer.write_header_gguf("Qwen3-30B-A3B", "Q4_K_M", tmp_path / "Qwen3-30B-A3B-Q4_K_M.gguf"))
    assert plan([q4, *small, "--host-experts", "mmap"])[0] == 3
