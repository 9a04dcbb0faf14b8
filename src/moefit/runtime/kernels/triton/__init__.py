"""Triton kernels that multiply GGUF blocks as stored, on a CUDA device.

:mod:`.gguf` holds the kernels and their entry points (:func:`~.gguf.matmul`,
:func:`~.gguf.dequantize`); this module says where the runtime uses them without importing
Triton's compiler (:func:`used_on`), by the rules the planner prices
(:mod:`moefit.memory.gpu_kernels`): on a CUDA device when ``triton`` is installed (torch's
CUDA wheels on Linux depend on it; ``pip install 'moefit[cuda]'``), and on a CPU device
only when asked (``MOEFIT_KERNELS=triton`` with ``TRITON_INTERPRET=1``: Triton's
interpreter on CPU tensors, the tests' way of running the CUDA path without a GPU).
"""

from __future__ import annotations

from moefit.memory import gpu_kernels
from moefit.memory.gpu_kernels import installed, interpreting  # noqa: F401  (re-exported)


def unavailable_reason(device_type: str) -> str | None:
    """Why the kernels cannot run on a device of ``device_type`` (None when they can): they
    need ``triton``, and a CUDA device or the interpreter (CPU tensors)."""
    if not installed():
        return "the triton package is not installed (pip install 'moefit[cuda]')"
    if device_type == "cuda" or (device_type == "cpu" and interpreting()):
        return None
    return (f"Triton's kernels run on CUDA devices (or on the CPU with {gpu_kernels.INTERPRET_ENV}=1), "
            f"not {device_type}")


def available(device_type: str) -> bool:
    """Whether :mod:`.gguf`'s kernels can run on a device of ``device_type``."""
    return unavailable_reason(device_type) is None


def used_on(device_type: str) -> bool:
    """Whether the runtime multiplies stored matrices and experts on a device of
    ``device_type`` with these kernels: a CUDA device where the plan expects them
    (:func:`moefit.memory.gpu_kernels.expected`), or a CPU device forced onto them
    (:func:`moefit.memory.gpu_kernels.forced_on_cpu`)."""
    if device_type == "cpu":
        return gpu_kernels.forced_on_cpu()
    return gpu_kernels.expected(device_type)
