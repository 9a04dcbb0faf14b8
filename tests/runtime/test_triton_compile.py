"""The Triton kernels compile for a CUDA target, without a GPU.

The interpreter (``tests/runtime/test_triton_kernels.py``) runs the kernels as Python, so
it never sees what only Triton's compiler rejects: the compiler generates the code after a
``return`` taken in a ``constexpr`` branch, and a tail that does not type-check for one
type fails that type's compile on the first GPU. ``triton.compile`` with a ``GPUTarget``
needs no driver (Triton's wheel brings ``ptxas``), so every type's matrix-vector,
``tl.dot`` and dequantization kernels are compiled here for sm_90 (H100 / H200), in a
fresh process: the interpreter, once on in a process, replaces the kernels.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

pytestmark = [pytest.mark.triton, pytest.mark.slow]

_SCRIPT = r'''
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moefit.runtime.kernels.triton import gguf as g

target = GPUTarget("cuda", 90, 32)
failed = []
for q, (code, *_) in g.TYPES.items():
    wty = {"F32": "*fp32", "F16": "*fp16", "BF16": "*bf16"}.get(q, "*u8")
    for mode, bt, bn, bk in ((0, 1, *g.GPU_TILES[0]), (2, 64, *g.GPU_TILES[1])):
        sig = {"x": "*bf16", "w": wty, "out": "*bf16", "table": "*fp32", "T": "i32", "N": "i32", "K": "i32",
               "RB": "i32", "sx": "i32", "so": "i32", "Q": "constexpr", "BT": "constexpr", "BN": "constexpr",
               "BK": "constexpr", "MODE": "constexpr"}
        try:
            triton.compile(ASTSource(g._matmul_kernel, sig, {"Q": code, "BT": bt, "BN": bn, "BK": bk,
                                                             "MODE": mode}), target=target)
        except Exception as e:
            failed.append(f"{q} matmul mode {mode}: {type(e).__name__}: {str(e)[-300:]}")
    sig = {"w": wty, "out": "*bf16", "table": "*fp32", "N": "i32", "K": "i32", "RB": "i32",
           "Q": "constexpr", "BN": "constexpr", "BK": "constexpr"}
    try:
        triton.compile(ASTSource(g._dequant_kernel, sig, {"Q": code, "BN": 32, "BK": 256}), target=target)
    except Exception as e:
        failed.append(f"{q} dequantize: {type(e).__name__}: {str(e)[-300:]}")
print("\n".join(failed) or "ok")
sys.exit(1 if failed else 0)
'''


def test_every_type_compiles_for_sm_90():
    pytest.importorskip("triton.backends.nvidia")
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root / "src") + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    r = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
