"""What both loaders read from the planner's tensor listing: each resident tensor by slot.

The listing (:class:`moefit.ingest.geometry.LayerSpec` ``tensors`` and ``buffers``,
``ModelGeometry.global_tensors``) names every tensor a family's model holds, with its shape
and the slot it fills (:attr:`moefit.ingest.geometry.Tensor.slot`: a field of
:class:`moefit.runtime.weights.LayerWeights`, or ``embed`` / ``norm`` / ``lm_head``). It is
the one list the planner prices and the loaders load: a loader only says what a listed
tensor is called in its file (``name(tensor)``: the checkpoint name, or the GGUF name from
the family's name table) and how its file lays it out beside what the forward pass wants
(:mod:`moefit.runtime.load.hybrid_layout`).
"""

from __future__ import annotations

from typing import Callable

from moefit.ingest.geometry import LayerSpec, ModelGeometry, Tensor
from moefit.runtime.load.hybrid_layout import checkpoint_layout

#: ``(slot, name or Packed, resident shape)``: one loader entry (``assemble_weights``).
Entry = tuple[str, object, tuple]


def by_slot(tensors) -> dict[str, list[Tensor]]:
    """The listed ``tensors`` grouped by slot, in listing order (several tensors of one
    slot are stacked into it in that order: Qwen3.5's ``in_proj_qkv`` + ``in_proj_z``)."""
    groups: dict[str, list[Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.slot, []).append(t)
    return groups


def layer_entries(layer: LayerSpec, name: Callable[[Tensor], object],
                  keep: Callable[[Tensor], bool] = lambda t: True) -> list[Entry]:
    """The loader entries of every resident tensor of ``layer`` (its ``tensors`` and
    ``buffers`` that ``keep``), one per slot: the part(s) as ``name`` calls them in the file,
    laid out as the forward pass holds them
    (:func:`moefit.runtime.load.hybrid_layout.checkpoint_layout`). Raises ValueError for a
    listed tensor without a slot (a family's listing the runtime cannot load)."""
    out = []
    for slot, ts in by_slot(t for t in (*layer.tensors, *layer.buffers) if keep(t)).items():
        if not slot:
            raise ValueError(f"layer {layer.index}: {ts[0].name} is listed without a slot; "
                             "the family's listing must say which LayerWeights field it fills")
        out.append((slot, *checkpoint_layout(slot, [(name(t), t.shape) for t in ts], layer.attention)))
    return out


def global_entries(geom: ModelGeometry, name: Callable[[Tensor], object]) -> list[Entry]:
    """``(slot, name, shape)`` of the embeddings, final norm and (untied) output head."""
    return [(t.slot, name(t), t.shape) for t in geom.global_tensors]

