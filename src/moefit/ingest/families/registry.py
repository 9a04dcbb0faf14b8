"""The family registry: ``config.json`` ``model_type`` and GGUF ``general.architecture`` -> :class:`Family`.

The built-in families are registered at import (:data:`BUILTIN`); a new family is one module
exporting a :class:`~moefit.ingest.families.common.Family` plus one entry in
:data:`BUILTIN` (or a :func:`register` call, as the tests do). This module imports no torch.
"""

from __future__ import annotations

from moefit.ingest.families import (
    deepseek, dense, glm4_moe, gpt_oss, llama4, mixtral, olmoe, qwen_hybrid, qwen_moe,
)
from moefit.ingest.families.common import Family

#: The families moefit ships, in registration order.
BUILTIN: tuple[Family, ...] = (
    qwen_moe.FAMILY, mixtral.FAMILY, olmoe.FAMILY, qwen_hybrid.FAMILY, gpt_oss.FAMILY,
    deepseek.FAMILY, glm4_moe.FAMILY, llama4.FAMILY, dense.FAMILY,
)

_BY_TYPE: dict[str, Family] = {}
_BY_GGUF: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add ``family`` under each of its model types and GGUF architectures; returns it.

    Errors: ValueError when a model type or architecture already belongs to another family.
    """
    for mt in family.model_types:
        if mt in _BY_TYPE and _BY_TYPE[mt] is not family:
            raise ValueError(f"model_type {mt!r} already belongs to family {_BY_TYPE[mt].name!r}")
    for arch in family.gguf_archs:
        if arch in _BY_GGUF and _BY_GGUF[arch] is not family:
            raise ValueError(f"GGUF architecture {arch!r} already belongs to family {_BY_GGUF[arch].name!r}")
    _BY_TYPE.update({mt: family for mt in family.model_types})
    _BY_GGUF.update({arch: family for arch in family.gguf_archs})
    return family


def unregister(family: Family) -> None:
    """Remove ``family`` (tests that register a toy family clean up with this)."""
    for table in (_BY_TYPE, _BY_GGUF):
        for key in [k for k, f in table.items() if f is family]:
            del table[key]


def family_for(model_type: object) -> Family | None:
    """The family parsing ``model_type``, or None."""
    return _BY_TYPE.get(model_type) if isinstance(model_type, str) else None


def family_for_gguf(arch: str) -> Family | None:
    """The family owning GGUF architecture ``arch``, or None."""
    return _BY_GGUF.get(arch)


def model_types() -> tuple[str, ...]:
    """Every registered model type, sorted."""
    return tuple(sorted(_BY_TYPE))


def runtime_gguf_archs() -> tuple[str, ...]:
    """GGUF architectures the runtime's GGUF loader runs (families' ``runtime_gguf_archs``)."""
    return tuple(sorted({a for f in set(_BY_TYPE.values()) for a in f.runtime_gguf_archs}))


def gguf_archs() -> tuple[str, ...]:
    """Every registered GGUF architecture, sorted."""
    return tuple(sorted(_BY_GGUF))


for _family in BUILTIN:
    register(_family)
