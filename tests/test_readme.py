"""The README and the docs/ pages print what they say they print.

- The README's main job (its set-up command) and its clamp and failure examples, run as a
  ``moefit`` process.
- Every fenced block of README.md or a docs/ page whose first line is ``$ moefit plan ...``:
  the command is run in-process and its output compared with the rest of the block. A line
  ``...`` elides output: the pieces between such lines must appear in that order, the first
  at the start of the output (unless the block begins with ``...``) and the last at its end
  (unless it ends with ``...``); a block without ``...`` is the whole output. A GGUF file the
  command names (``<preset>-<type>.gguf``) is written as a header-only stand-in by
  ``benchmarks/write_header_gguf.py``, as the page says.
- Every ``$ moefit generate ./demo-moe ...`` block: the same, as a process on the
  ``make-demo`` checkpoint the page names (``--family qwen3_moe``), its stderr compared (a
  slow test: it loads torch).
- Every other unlabelled fenced block (an output without its command) is one that a named
  test checks; a new one fails here until it is ``$ moefit plan`` or has its test.
- The ``json`` skeleton of ``moefit plan --json`` has the keys the document has.
- Every file of the repository a page names exists.
"""

import contextlib
import importlib.util
import io
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PAGES = {p.relative_to(ROOT).as_posix(): p.read_text()
         for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}
FENCE = re.compile(r"^```([a-z]*)\n(.*?)^```", re.S | re.M)

#: unlabelled blocks that are outputs checked elsewhere: (page, the block's first line) -> the test
CHECKED_ELSEWHERE = {
    ("README.md", "model  Qwen3.5-35B-A3B  34.66B total / 3.45B active  40 layers, 10 full + 30 linear"):
        "tests/test_readme.py::test_main_job_prints_the_readme_table",
    ("README.md", "prefill: requested 24576, clamped to 6656 due to VRAM budget (predicted prefill 510 -> 474 tokens/s)"):
        "tests/test_readme.py::test_readme_clamp_and_failure_examples",
    ("README.md", "does not fit: short by 5.14 GiB"):
        "tests/test_readme.py::test_readme_clamp_and_failure_examples",
    ("docs/layout.md", "src/moefit/"): "tests/test_imports.py::test_the_layout_names_every_module",
    ("docs/engines.md", "llama-server budget  cpu  planned against allocated (MiB, as llama-server prints them)"):
        "tests/test_serve_llamacpp.py::test_ready_planned_against_allocated_and_sigterm_passed_on",
}


def blocks_after(marker: str) -> str:
    """The first fenced block after ``marker`` in the README."""
    rest = README[README.index(marker):]
    return re.search(r"```[a-z]*\n(.*?)```", rest, re.S).group(1)


def run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moefit", *args], capture_output=True,
                          text=True, timeout=60)


def main_job_args() -> list[str]:
    setup = blocks_after("## Set-up")
    command = setup.split(".venv/bin/moefit ", 1)[1].strip()
    return shlex.split(command)


@pytest.mark.process
def test_main_job_prints_the_readme_table():
    r = run(main_job_args())
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == blocks_after("The first command prints:").strip()


@pytest.mark.process
def test_readme_clamp_and_failure_examples():
    args = main_job_args()
    gpu = args.index("--gpu")
    on_12gb = args[:gpu] + ["--gpu", "RTX 3060 12GB"] + args[gpu + 2:]
    r = run(on_12gb)
    assert r.returncode == 0
    assert blocks_after("request ends with").strip() in r.stdout
    on_6gib = args[:gpu] + ["--vram", "6GiB"] + args[gpu + 2:]
    r = run(on_6gib)
    assert r.returncode == 3
    assert blocks_after("it fails with exit code 3").strip() in r.stdout


# ---- every shown `$ moefit plan` block of the README and docs/ ------------------------------
SHOWN_KINDS = ("$ moefit plan ", "$ moefit generate ./demo-moe ")


def shown_commands(kind: str) -> list[tuple[str, str, str]]:
    """``(page, command line, shown output)`` of every block whose first line starts with ``kind``."""
    found = []
    for page, text in PAGES.items():
        for lang, body in FENCE.findall(text):
            first, _, rest = body.partition("\n")
            if first.startswith(kind):
                found.append((page, first[2:], rest))
    return found


SHOWN = shown_commands(SHOWN_KINDS[0])
SHOWN_RUNS = shown_commands(SHOWN_KINDS[1])


def matches(shown: str, out: str) -> str | None:
    """None when ``out`` is what ``shown`` shows (``...`` lines elide), else what is missing."""
    lines = shown.rstrip("\n").split("\n")
    if "..." not in lines:
        return None if out.rstrip("\n") == shown.rstrip("\n") else "the whole output differs"
    pieces, cur = [], []
    for line in lines:
        if line == "...":
            pieces.append(cur)
            cur = []
        else:
            cur.append(line)
    pieces.append(cur)
    out_lines = out.rstrip("\n").split("\n")
    at = 0
    for i, piece in enumerate(pieces):
        if not piece:
            continue
        n = len(piece)
        starts = [j for j in range(at, len(out_lines) - n + 1) if out_lines[j:j + n] == piece]
        if i == 0:
            starts = [j for j in starts if j == 0]
        if i == len(pieces) - 1:
            starts = [j for j in starts if j + n == len(out_lines)]
        if not starts:
            return "\n".join(piece)
        at = starts[0] + n
    return None


def header_gguf(path: Path) -> None:
    """``<preset>-<type>.gguf`` as the header-only stand-in the pages name."""
    m = re.fullmatch(r"(.+)-((?:I?Q\d\w*)|BF16|F16)\.gguf", path.name)
    assert m, f"{path.name}: a shown GGUF file is named <preset>-<type>.gguf"
    spec = importlib.util.spec_from_file_location("write_header_gguf", ROOT / "benchmarks" / "write_header_gguf.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.write_header_gguf(m.group(1), m.group(2), path)


def plan_in_process(args: list[str]) -> tuple[int, str]:
    from moefit import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli.main(args)
    return rc, out.getvalue()


def test_the_pages_show_plans():
    pages = {page for page, _, _ in SHOWN}
    assert {"README.md", "docs/engines.md", "docs/host-and-devices.md", "docs/gguf.md"} <= pages
    assert [page for page, _, _ in SHOWN_RUNS] == ["docs/serve.md"]


@pytest.mark.parametrize("page,command,shown", SHOWN, ids=[f"{p}:{c[12:60]}" for p, c, _ in SHOWN])
def test_a_shown_plan_is_what_moefit_prints(page, command, shown, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MOEFIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("MOEFIT_HOST_RAM", raising=False)
    args = shlex.split(command)[1:]
    for a in args:
        if a.endswith(".gguf"):
            header_gguf(tmp_path / a)
    rc, out = plan_in_process(args)
    assert rc == (3 if "does not fit" in out else 0), out
    missing = matches(shown, out)
    assert missing is None, f"{page}: `{command}` no longer prints\n{missing}\n---- it prints\n{out}"


@pytest.mark.slow
@pytest.mark.process
@pytest.mark.parametrize("page,command,shown", SHOWN_RUNS, ids=[p for p, _, _ in SHOWN_RUNS])
def test_a_shown_run_is_what_moefit_prints(page, command, shown, tmp_path):
    import os

    env = {**os.environ, "OMP_NUM_THREADS": "1", "MOEFIT_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("MOEFIT_HOST_RAM", None)
    moefit = [sys.executable, "-m", "moefit"]
    demo = subprocess.run([*moefit, "make-demo", "./demo-moe", "--family", "qwen3_moe"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert demo.returncode == 0, demo.stderr
    r = subprocess.run([*moefit, *shlex.split(command)[1:]], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    err = "\n".join(line.split("\r")[-1] for line in r.stderr.split("\n"))    # the progress bar's \r
    missing = matches(shown, err)
    assert missing is None, f"{page}: `{command}` no longer prints\n{missing}\n---- it prints\n{err}"


def test_the_elision_rule_can_fail():
    out = "a\nb\nc\nd\n"
    assert matches("a\n...\nd\n", out) is None and matches("...\nb\nc\n...\n", out) is None
    assert matches("b\n...\n", out) is not None        # not the start
    assert matches("...\nc\n", out) is not None        # not the end
    assert matches("...\nc\n...\nb\n...\n", out) is not None    # out of order
    assert matches("a\nb\nc\nd\n", out) is None and matches("a\nb\nc\n", out) is not None


def test_every_shown_output_has_a_check():
    unchecked = []
    for page, text in PAGES.items():
        for lang, body in FENCE.findall(text):
            first = body.split("\n", 1)[0]
            if lang or first.startswith(SHOWN_KINDS):
                continue
            if (page, first) not in CHECKED_ELSEWHERE:
                unchecked.append(f"{page}: {first}")
    assert unchecked == [], "an output block without its check: show it as `$ moefit plan ...` or add its test"


def test_the_json_skeleton_has_the_documents_keys():
    """docs/plan.md's ``moefit.plan/2`` skeleton: the keys of a plan that fits and of one that
    does not (the shortfall, the side, the limiting lines and alternatives), the device's and
    the host's keys."""
    text = PAGES["docs/plan.md"]
    skeleton = json.loads(next(body for lang, body in FENCE.findall(text) if lang == "json"))
    args = main_job_args()
    rc, fits = plan_in_process([*args, "--json"])
    gpu = args.index("--gpu")
    rc3, fails = plan_in_process(args[:gpu] + ["--vram", "6GiB"] + args[gpu + 2:] + ["--json"])
    assert (rc, rc3) == (0, 3)
    fits, fails = json.loads(fits), json.loads(fails)
    assert skeleton["schema"] == fits["schema"]
    assert set(skeleton) == set(fits) | set(fails)
    for key in ("model", "host", "prefill", "experts"):
        assert set(skeleton[key]) == set(fits[key]), key
    assert set(skeleton["devices"][0]) == set(fits["devices"][0])
    assert set(skeleton["devices"][0]["lines"][0]) == set(fits["devices"][0]["lines"][0])
    assert set(skeleton["alternatives"][0]) <= set().union(*map(set, fails["alternatives"]))


#: a file of the repository as the pages name it: from the root (src/, tests/, benchmarks/) or
#: inside the package (runtime/qmatmul.c is src/moefit/runtime/qmatmul.c)
FILE_NAMED = re.compile(r"(?<![\w/.-])((?:src/moefit/|runtime/|engines/|external/|memory/|plan/|ingest/|serve/|"
                        r"devices/|bench/|tools/|tests/|benchmarks/)[\w/.-]*\.(?:py|c|h|md|json|csv))")


def test_the_files_the_pages_name_exist():
    """A moved or renamed file fails here until the pages name it where it is (docs/layout.md
    is checked the other way round, by tests/test_imports.py)."""
    named, missing = 0, []
    for page, text in PAGES.items():
        if page == "docs/layout.md":
            continue
        for path in FILE_NAMED.findall(text):
            named += 1
            top = path.split("/", 1)[0]
            if not (ROOT / path if top in ("src", "tests", "benchmarks") else ROOT / "src" / "moefit" / path).exists():
                missing.append(f"{page}: {path}")
    assert named > 50 and missing == []
