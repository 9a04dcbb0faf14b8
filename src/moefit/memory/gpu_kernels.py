"""What the planner knows of the runtime's Triton kernels without importing them.

On a CUDA device the runtime keeps a GGUF file's dense quantized matrices in their stored
type and multiplies them with the Triton kernels of ``moefit.runtime.kernels.triton.gguf``,
which read ggml's blocks as stored (:data:`TYPES`). The plan prices those matrices at their
stored size, so it must know beforehand whether the kernels will run (:func:`expected`):
when the ``triton`` package is importable (torch's CUDA wheels for Linux depend on it;
``pip install 'moefit[cuda]'`` names it) and :data:`DISABLE_ENV` does not turn them off.
Without them the matrices are dequantized to the compute dtype at load and priced so.
The runtime asks the same question (``moefit.runtime.kernels.triton.used_on``), so
planned = allocated either way.

A CPU device never plans with them (its C kernels, :mod:`moefit.memory.cpu_kernels`);
``MOEFIT_KERNELS=triton`` with ``TRITON_INTERPRET=1`` runs the Triton kernels in Triton's
interpreter on a CPU device's expert path (``MOEFIT_EXPERT_PATH=device``): the tests'
way of running the CUDA path's products end to end without a GPU.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping

from moefit.errors import InputError
from moefit.ingest.ggml_types import BLOCKS
from moefit.memory.cpu_kernels import switched_off

#: ggml type -> (values per block, bytes per block) of the types the kernels read
#: (:data:`moefit.ingest.ggml_types.BLOCKS`)
TYPES: dict[str, tuple[int, int]] = {k: BLOCKS[k] for k in (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "Q4_K", "Q5_K", "Q6_K",
    "MXFP4", "Q2_K", "Q3_K", "IQ4_XS")}
DISABLE_ENV = "MOEFIT_NO_TRITON"
#: ``triton``: run the Triton kernels on a CPU device too (needs ``TRITON_INTERPRET=1``)
KERNELS_ENV = "MOEFIT_KERNELS"
INTERPRET_ENV = "TRITON_INTERPRET"


def installed() -> bool:
    """Whether the ``triton`` package is importable (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def disabled(env: Mapping[str, str] = os.environ) -> bool:
    """Whether :data:`DISABLE_ENV` turns the kernels off (``1`` / ``true`` / ``yes`` / ``on``).
    Raises InputError for a value that is not a yes or a no (:func:`~moefit.memory.cpu_kernels.switched_off`)."""
    return switched_off(env, DISABLE_ENV, "the Triton kernels")


def interpreting(env: Mapping[str, str] = os.environ) -> bool:
    """Whether Triton runs its kernels in the interpreter (``TRITON_INTERPRET=1``)."""
    return env.get(INTERPRET_ENV, "").strip() not in ("", "0")


def kernels_choice(env: Mapping[str, str] = os.environ) -> str:
    """:data:`KERNELS_ENV`'s value: ``""`` (unset or ``auto``: the device's own kernels) or
    ``"triton"``. Raises InputError for another value, on any device (a typo must not
    pass silently where the value changes nothing, as on CUDA)."""
    value = env.get(KERNELS_ENV, "").strip().lower()
    if value in ("", "auto"):
        return ""
    if value != "triton":
        raise InputError(f"{KERNELS_ENV}={env.get(KERNELS_ENV)!r}: the one choice is 'triton' "
                         "(or unset for the device's own kernels)")
    return value


def forced_on_cpu(env: Mapping[str, str] = os.environ) -> bool:
    """Whether ``MOEFIT_KERNELS=triton`` asks for the Triton kernels on a CPU device. Raises
    InputError for another value (:func:`kernels_choice`), or without ``TRITON_INTERPRET=1``
    (no CPU backend)."""
    if not kernels_choice(env):
        return False
    if not interpreting(env):
        raise InputError(f"{KERNELS_ENV}=triton on a CPU device runs Triton's interpreter: "
                         f"set {INTERPRET_ENV}=1 too")
    return installed()


def expected(device_kind: str, env: Mapping[str, str] = os.environ) -> bool:
    """Whether a device of ``device_kind`` keeps GGUF matrices stored for the Triton
    kernels: a CUDA device with ``triton`` installed and :data:`DISABLE_ENV` unset.
    Raises InputError for a bad :data:`KERNELS_ENV` (:func:`kernels_choice`; ``triton`` is a
    CUDA device's own choice)."""
    if device_kind == "cuda":
        kernels_choice(env)
    return device_kind == "cuda" and installed() and not disabled(env)


def supports(qtype: str, cols: int) -> bool:
    """Whether the kernels read rows of ``cols`` values of ggml type ``qtype``."""
    return qtype in TYPES and cols % TYPES[qtype][0] == 0


def keeps_stored(qtype: str, cols: int) -> bool:
    """Whether a dense GGUF matrix of ``qtype`` stays stored on a device where the kernels
    run: a quantized type they read (float matrices become the compute dtype, at the same
    size or smaller)."""
    return qtype not in ("F32", "F16", "BF16") and supports(qtype, cols)
