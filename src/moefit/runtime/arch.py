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
from moefit.ingest.families.common import NameTable, Switches, name_table
from moefit.ingest.geometry import DTYPES, ModelGeometry
from moefit.ingest.inputs import read_json


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a dtype name of :data:`moefit.ingest.geometry.DTYPES` (``bf16``
    -> ``torch.bfloat16``). Raises InputError naming the dtype for any other name."""
    d = DTYPES.get(name)
    if d is None:
        raise InputError(f"dtype {name!r} is not supported by the runtime "
                         f"(use one of {', '.join(sorted({d.torch for d in DTYPES.values()}))})")
    return getattr(torch, d.torch)


@dataclass(frozen=True)
class Arch(Switches):
    """Per-family switches of the forward pass: the family's
    :class:`~moefit.ingest.families.common.Switches` (every field, declared once there) with
    ``dtype`` the torch dtype of resident weights and activations (there its name), plus
    the family's tensor ``names``.
    """

    dtype: torch.dtype
    names: NameTable = field(default_factory=name_table)

    @property
    def moe_prefix(self) -> str:
        """The MoE block's checkpoint name (:attr:`NameTable.moe_prefix`)."""
        return self.names.moe_prefix


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
    values = {f.name: getattr(sw, f.name) for f in fields(Switches)}
    return Arch(**values | {"dtype": torch_dtype(sw.dtype), "names": family.names})
