"""What a family's GGUF mapping and GGUF writing share: ``{arch}.key`` access to a header
(:class:`GGUFMeta`), the facts read alike for every architecture (:class:`GGUFFacts`), the
MoE keys written by default (:func:`gguf_moe_metadata`) and a family's own tensor
conversions (:class:`GGUFConversion`, :class:`GGUFTensorOut`).

Part of what every family shares (:mod:`moefit.ingest.families.common`). Imports no torch.
"""

from __future__ import annotations

from typing import Any, Callable

from moefit.errors import InputError
from moefit.ingest.inputs import bounded_int
from moefit.records import record


class GGUFMeta:
    """``{arch}.key`` access to a GGUF header (``moefit.ingest.gguf_header.GGUFHeader``:
    ``meta``, ``arch``, ``paths``, ``tensors``) with errors naming the key and the file."""

    def __init__(self, h: Any):
        self.h, self.arch, self.source = h, h.arch, str(h.paths[0])

    def get(self, key: str, default: Any = None) -> Any:
        v = self.h.meta.get(f"{self.arch}.{key}")
        return default if v is None else v

    def req(self, key: str) -> Any:
        v = self.get(key)
        if v is None:
            raise InputError(f"{self.source}: GGUF metadata key '{self.arch}.{key}' is missing "
                             f"(architecture {self.arch!r})")
        return v

    def int(self, key: str, default: int | None = None) -> int:
        """A whole number within what a real model has for ``key``
        (:func:`moefit.ingest.inputs.bounded_int`, by the key's last component)."""
        v = self.req(key) if default is None else self.get(key, default)
        if isinstance(v, list):   # per-layer arrays (head counts of hybrids): the largest
            v = max(v) if all(isinstance(x, (int, float)) for x in v) and v else 0
        return bounded_int(v, f"{self.arch}.{key}", self.source, minimum=0)

    def has(self, name: str) -> bool:
        return name in self.h.tensors

    def ne(self, name: str) -> tuple[int, ...] | None:
        t = self.h.tensors.get(name)
        return t.ne if t else None


@record
class GGUFFacts:
    """What ``config_from_gguf`` reads the same way for every architecture, handed to a
    family's GGUF mapping: ``experts`` (``expert_count``), ``top_k`` (``expert_used_count``),
    ``width`` (expert width from the first MoE layer's ``ffn_*_exps``, or None),
    ``dense_ff`` (``feed_forward_length``), ``head_dim``, ``bias`` (``blk.0.attn_q.bias``
    present), ``norm`` (``expert_weights_norm`` or None), ``moe_layers`` / ``dense_layers``
    (layer indices with / without a router ``ffn_gate_inp``)."""

    experts: int
    top_k: int
    width: int | None
    dense_ff: int
    head_dim: int
    bias: bool
    norm: Any
    moe_layers: list[int]
    dense_layers: list[int]


def gguf_moe_metadata(w: Any, config: dict) -> None:
    """The MoE metadata keys ``moefit.tools.gguf_write`` writes by default, on a
    ``gguf.GGUFWriter`` ``w`` (llama.cpp ``convert_hf_to_gguf.py``, e.g. ``Qwen3MoeModel``):
    ``expert_feed_forward_length`` (``moe_intermediate_size``, else ``intermediate_size``),
    ``feed_forward_length`` (``intermediate_size``, 0 when absent), ``expert_weights_norm``
    (``norm_topk_prob``). A family writing other keys sets ``Family.gguf_write_meta``."""
    w.add_expert_feed_forward_length(config.get("moe_intermediate_size") or config["intermediate_size"])
    w.add_feed_forward_length(config.get("intermediate_size") or 0)
    w.add_expert_weights_norm(bool(config.get("norm_topk_prob", False)))


@record
class GGUFTensorOut:
    """One tensor a family's GGUF conversion writes (:class:`GGUFConversion`).

    ``name``: the GGUF name; ``shape``: its shape in torch order; ``make()``: its values as
    a float32 array of that shape, or, with ``stored``, the bytes already in that ggml type
    (uint8 ``[..., row bytes]``: written as they are, not quantized again). ``kind``:
    ``dense`` (the writer's dense type, F32 when 1-D), ``f32``, or the expert part
    ``gate`` / ``up`` / ``down`` (the layer's expert type).
    """

    name: str
    shape: tuple[int, ...]
    make: Callable[[], Any]
    kind: str = "dense"
    stored: str | None = None


@record
class GGUFConversion:
    """How ``moefit.tools.gguf_write`` writes some Hugging Face tensors of a family that
    llama.cpp's converter transforms (``convert_hf_to_gguf.py``): the state keys
    ``sources`` become ``outputs``. ``hf_name``: the tensor of the transformers model the
    outputs hold (default: the only source); ``back(arrays)``: the outputs as the file
    stores them (float32, torch order, in ``outputs`` order) -> that tensor, for a reference
    model on the stored weights (default: the only output, reshaped)."""

    sources: tuple[str, ...]
    outputs: tuple[GGUFTensorOut, ...]
    hf_name: str | None = None
    back: Callable[[list], Any] | None = None
