"""Triton kernels that multiply GGUF blocks as stored, on a CUDA device.

:mod:`.gguf` holds the kernels and their entry points (:func:`~.gguf.matmul`,
:func:`~.gguf.dequantize`); this module says whether they can run without importing
Triton's compiler (:func:`available`). Triton ships with the CUDA builds of torch on
Linux (``pip install torch``), and installs alone as ``pip install 'moefit[cuda]'``;
with ``TRITON_INTERPRET=1`` the same kernels run in Triton's interpreter on CPU tensors,
which is how the tests check them on a machine without a GPU.
"""

from __future__ import annotations

import importlib.util
import os

#: Triton's own switch: kernels run in its numpy interpreter, on CPU tensors
INTERPRET_ENV = "TRITON_INTERPRET"


def installed() -> bool:
    """Whether the ``triton`` package is importable (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton runs its kernels in the interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get(INTERPRET_ENV, "").strip() not in ("", "0")


def unavailable_reason(device_type: str) -> str | None:
    """Why the kernels cannot run on a device of ``device_type`` (None when they can): they
    need ``triton``, and a CUDA device or the interpreter (CPU tensors)."""
    if not installed():
        return "the triton package is not installed (pip install 'moefit[cuda]')"
    if device_type == "cuda" or (device_type == "cpu" and interpreting()):
        return None
    return f"Triton's kernels run on CUDA devices (or on the CPU with {INTERPRET_ENV}=1), not {device_type}"


def available(device_type: str) -> bool:
    """Whether :mod:`.gguf`'s kernels run on a device of ``device_type``."""
    return unavailable_reason(device_type) is None
