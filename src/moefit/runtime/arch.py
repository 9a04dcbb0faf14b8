"""The forward pass's per-family switches, with the torch dtype.

The geometry (:mod:`moefit.ingest.families`) already fixes the layer structure the plan priced:
attention kind and window per layer, which layers are MoE, expert widths. The numbers and
rules that only the forward pass uses (q/k norm kind, biases, routing renormalisation, MoE
block and expert names, checkpoint prefix, ``(1 + w)`` norms) belong to each family module
(``switches`` of its :class:`~moefit.ingest.families.common.Family`, read the way
transformers 5.x reads them: see each module). This module adds the torch dtype and the
checks that the config is the one the plan was solved for.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from moefit.errors import InputError
from moefit.ingest.families import registry
from moefit.ingest.families.common import NameTable, name_table
from moefit.ingest.geometry import ModelGeometry
from moefit.ingest.inputs import read_json

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Arch:
    """Per-family switches of the forward pass: the fields of
    :class:`~moefit.ingest.families.common.Switches` with ``dtype`` the torch dtype of
    resident weights and activations.
    """

    model_type: str
    dtype: torch.dtype
    rms_eps: float
    qk_norm: str
    q_bias: bool
    o_bias: bool
    clip_qkv: float | None
    renormalize: bool
    moe_prefix: str
    expert_names: tuple[str, str, str]
    tie_embeddings: bool
    config: dict             # the text model's config (``text_config`` of a multimodal one)
    prefix: str = "model."   # checkpoint prefix of the text model
    norm_offset: float = 0.0  # 1.0: ``(1 + w)`` RMSNorm weights (Qwen3-Next / Qwen3.5)
    names: NameTable = field(default_factory=name_table)  # the family's tensor names


def read_config(model_dir: str | Path) -> dict:
    """``config.json`` of a model directory. Raises InputError naming the file."""
    return read_json(Path(model_dir) / "config.json", "model config")


def runtime_model_types() -> tuple[str, ...]:
    """The model types the runtime runs (every registered family's ``runtime_types``)."""
    return tuple(mt for mt in registry.model_types()
                 if (f := registry.family_for(mt)).switches is not None and mt in f.runtime_types)


def arch_from_config(cfg: dict, geom: ModelGeometry) -> Arch:
    """Switches for ``cfg`` (a ``config.json`` dict) of a model with geometry ``geom``, from
    its family (:func:`moefit.ingest.families.registry.family_for`).

    Raises InputError for a model type the runtime does not run yet, a config that is not
    the one the plan was solved for, or a dtype the runtime has no kernels for.
    """
    mt = cfg.get("model_type")
    if mt != geom.model_type:
        raise InputError(f"config.json declares model_type {mt!r} but the plan was solved for "
                         f"{geom.model_type!r} ({geom.source}); plan the same model you run")
    family = registry.family_for(mt)
    if family is None or family.switches is None or mt not in family.runtime_types:
        raise InputError(f"model_type {mt!r}: the runtime runs {', '.join(runtime_model_types())} "
                         "(the planner knows more families: `moefit plan` works for it)")
    sw = family.switches(cfg)
    if sw.dtype not in TORCH_DTYPES:
        raise InputError(f"config dtype {sw.dtype!r} is not supported by the runtime "
                         f"(use one of {', '.join(TORCH_DTYPES)})")
    values = {f.name: getattr(sw, f.name) for f in fields(sw)}
    return Arch(**values | {"dtype": TORCH_DTYPES[sw.dtype], "names": family.names})
