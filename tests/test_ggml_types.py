"""ggml's type sizes (moefit.ingest.ggml_types) against the gguf package, and the planner's
GGUF pricing without that package (a plan from `pip install moefit`, no extras)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from moefit.errors import InputError
from moefit.ingest import ggml_types

SRC = Path(__file__).resolve().parents[1] / "src"


def test_block_sizes_are_the_gguf_packages():
    gguf = pytest.importorskip("gguf")
    theirs = {t.name: tuple(v) for t, v in gguf.GGML_QUANT_SIZES.items()}
    for name in set(theirs) & set(ggml_types.BLOCKS):
        assert ggml_types.BLOCKS[name] == theirs[name], name
    # every type the package knows is here (a newer gguf with a new type fails this: add it)
    assert set(theirs) <= set(ggml_types.BLOCKS)


def test_tensor_bytes_and_bad_names():
    assert ggml_types.tensor_bytes("Q4_K", (2048, 768)) == 2048 // 256 * 144 * 768
    assert ggml_types.tensor_bytes("F16", (7, 3, 2)) == 7 * 3 * 2 * 2
    with pytest.raises(InputError, match="Q4_K row of 100"):
        ggml_types.tensor_bytes("Q4_K", (100, 4))
    with pytest.raises(InputError, match="unknown ggml type 'Q9_9'"):
        ggml_types.block_values("Q9_9")


@pytest.mark.process
@pytest.mark.parametrize("flags", [
    ["--vram", "6GiB"],                                       # the README's failing plan
    ["--gpu", "RTX 4090", "--host-ram", "32GiB", "--max-context", "32K"],  # the GGUF remedy
])
def test_failing_plans_price_their_gguf_remedies_without_the_gguf_package(tmp_path, flags):
    """A failing plan's llama.cpp and GGUF-file alternatives are priced from ggml_types alone:
    with `gguf` unimportable the output is the same as with it (and no traceback)."""
    (tmp_path / "gguf.py").write_text("raise ImportError('no gguf here')\n")
    cmd = [sys.executable, "-m", "moefit", "plan", "Qwen3.5-35B-A3B", "--max-context", "512K",
           "--rope-scaling", "yarn", "--rope-scale", "2", "--kv", "int8", "--prefill", "24576",
           *flags]
    runs = []
    for path in (f"{tmp_path}{os.pathsep}{SRC}", str(SRC)):
        env = {**os.environ, "PYTHONPATH": path}
        runs.append(subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120))
    hidden, normal = runs
    assert "Traceback" not in hidden.stderr, hidden.stderr
    assert hidden.returncode == normal.returncode == 3
    assert hidden.stdout == normal.stdout
    assert "--engine llama.cpp" in hidden.stdout
