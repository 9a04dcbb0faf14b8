"""`moefit generate --prompt-file PATH` and `--prompt -` (stdin) (issue 12, item 16).

The same prompt given three ways (text, file, stdin) gives the same greedy completion;
bad prompt sources are exit 2 with a message naming the flag.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("tokenizers")

from moefit.tools.demo import write_demo  # noqa: E402




PROMPT = "What is the capital of France?\nAnswer in one word, please.\n"
RUN = ["--device", "cpu", "--vram", "1GiB", "--max-context", "512", "--max-tokens", "6",
       "--ignore-eos"]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return write_demo(tmp_path_factory.mktemp("demo") / "m", "olmoe")


def generate(demo, *args: str, stdin: str | bytes | None = None) -> subprocess.CompletedProcess:
    data = stdin.encode() if isinstance(stdin, str) else stdin
    return subprocess.run([sys.executable, "-m", "moefit", "generate", str(demo), *RUN, *args],
                          input=data, capture_output=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_text_file_and_stdin_give_the_same_completion(demo, tmp_path):
    f = tmp_path / "prompt.txt"
    f.write_text(PROMPT, encoding="utf-8")
    by_text = generate(demo, "--prompt", PROMPT)
    by_file = generate(demo, "--prompt-file", str(f))
    by_stdin = generate(demo, "--prompt", "-", stdin=PROMPT)
    for r in (by_text, by_file, by_stdin):
        assert r.returncode == 0, r.stderr.decode()
    assert by_text.stdout == by_file.stdout == by_stdin.stdout
    # the prompt token count in the tokens/s line is the same: the text was read verbatim
    counts = {next(l for l in r.stderr.decode().splitlines() if l.startswith("prompt "))
              .split(" tokens")[0] for r in (by_text, by_file, by_stdin)}
    assert len(counts) == 1


@pytest.mark.parametrize("args,needle", [
    (["--prompt-file", "/no/such/prompt.txt"], "--prompt-file /no/such/prompt.txt"),
    (["--prompt", "hi", "--prompt-file", "x.txt"], "--prompt-file"),
    ([], "--prompt"),
])
def test_bad_prompt_sources_are_exit_2(demo, args, needle):
    r = generate(demo, *args)
    err = r.stderr.decode()
    assert r.returncode == 2 and needle in err and "Traceback" not in err


def test_a_prompt_file_that_is_not_utf8_or_empty_is_exit_2(demo, tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9".encode("latin-1"))
    r = generate(demo, "--prompt-file", str(bad))
    assert r.returncode == 2 and "UTF-8" in r.stderr.decode()
    r = generate(demo, "--prompt", "-", stdin=b"")
    assert r.returncode == 2 and "empty" in r.stderr.decode()
    r = generate(demo, "--prompt-file", str(tmp_path))        # a directory
    assert r.returncode == 2 and "--prompt-file" in r.stderr.decode()
