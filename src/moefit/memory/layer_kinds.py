"""Layer kinds as spec classes: what one kind of token mixer keeps per sequence.

Each :class:`LayerKind` owns, for the layers of its kind (``AttentionSpec.kind``), the
shape of one token's cache cell, how many cells a sequence keeps and the fixed state it
holds instead; :func:`moefit.memory.kv.kv_bytes` and :func:`~moefit.memory.kv.kv_layout` (and so the
runtime's KV cache, which views that layout) price and carve every layer through it, with
no branch on the kind's name (vLLM v1's ``kv_cache_interface.py`` does the same: one frozen
spec class per attention type owns its page bytes). A new kind is a subclass registered
with :func:`register`.

The shipped kinds (:data:`KINDS`):

- ``full``: softmax attention over the whole context: ``num_kv_heads`` K rows of
  ``head_dim`` and V rows of ``v_head_dim`` per token (GQA).
- ``sliding``: the same cells over the last ``sliding_window`` tokens; a prefill chunk of
  ``c`` tokens needs ``window + c`` cells (the chunk's queries see the window before each).
- ``chunked``: Llama 4's attention within fixed chunks of ``sliding_window`` tokens,
  priced as ``sliding`` (the planner's bound; the runtime does not run it).
- ``mla``: DeepSeek's latent cache, one row of ``kv_lora_rank + qk_rope_head_dim`` per
  token and no V (the latent is read as V too; DeepSeek-V2 paper, section 2.1.2).
- ``linear``: Gated DeltaNet (Qwen3-Next / Qwen3.5): no cells, a recurrent state of
  ``Nv x Dk x Dv`` elements of ``state_dtype`` and a conv state of ``conv_dim x (K - 1)``
  model-dtype elements per sequence (``Qwen3NextGatedDeltaNet``).

This module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from moefit.ingest.geometry import AttentionSpec


@dataclass(frozen=True)
class LayerKind:
    """A softmax-attention layer over the whole context (``full``); the base of the others.

    ``name``: the ``AttentionSpec.kind`` it serves. ``cells``: True when its layers keep
    per-token cells; ``state``: True when they keep a fixed per-sequence state.
    """

    name: str
    cells: bool = True
    state: bool = False

    def cell_dims(self, att: AttentionSpec) -> tuple[int, int, int]:
        """(heads, K dim, V dim) of one token's cell (elements); V dim 0: no V cells."""
        return att.num_kv_heads, att.head_dim, att.v_head_dim

    def cell_count(self, att: AttentionSpec, context: int, chunk: int) -> int:
        """Cells (tokens) one sequence keeps for ``context`` tokens and a prefill chunk of
        ``chunk`` tokens."""
        return context

    def window(self, att: AttentionSpec) -> int | None:
        """The window (tokens) that bounds the cells, or None: the cells grow with the
        context (and never with the chunk)."""
        return None

    def masked_window(self, att: AttentionSpec) -> int | None:
        """The window the forward pass masks attention to (tokens), or None."""
        return None

    def state_split(self, att: AttentionSpec, dtype_bytes: int) -> tuple[int, int]:
        """(recurrent, conv) bytes of one sequence's fixed state (``dtype_bytes``: the model
        dtype's element size)."""
        return 0, 0


@dataclass(frozen=True)
class Windowed(LayerKind):
    """``sliding`` (``masks``: the forward pass masks to the window) and ``chunked``
    layers: at most ``sliding_window + chunk`` cells per sequence."""

    masks: bool = True

    def cell_count(self, att: AttentionSpec, context: int, chunk: int) -> int:
        w = self.window(att)
        return context if w is None else min(context, w + chunk)

    def window(self, att: AttentionSpec) -> int | None:
        return att.sliding_window or None

    def masked_window(self, att: AttentionSpec) -> int | None:
        return att.sliding_window if self.masks else None


@dataclass(frozen=True)
class Latent(LayerKind):
    """``mla``: one latent row per token, no V."""

    def cell_dims(self, att: AttentionSpec) -> tuple[int, int, int]:
        return 1, att.kv_lora_rank + att.qk_rope_head_dim, 0


@dataclass(frozen=True)
class Recurrent(LayerKind):
    """``linear``: Gated DeltaNet's recurrent and conv state, no cells."""

    cells: bool = False
    state: bool = True

    def cell_dims(self, att: AttentionSpec) -> tuple[int, int, int]:
        return 0, 0, 0

    def cell_count(self, att: AttentionSpec, context: int, chunk: int) -> int:
        return 0

    def state_split(self, att: AttentionSpec, dtype_bytes: int) -> tuple[int, int]:
        recurrent = (att.linear_num_value_heads * att.linear_key_head_dim
                     * att.linear_value_head_dim * att.state_dtype_bytes)
        conv = att.linear_conv_dim * max(att.linear_conv_kernel - 1, 0) * dtype_bytes
        return recurrent, conv


#: The layer kinds by ``AttentionSpec.kind``.
KINDS: dict[str, LayerKind] = {k.name: k for k in (
    LayerKind("full"), Windowed("sliding"), Windowed("chunked", masks=False), Latent("mla"),
    Recurrent("linear"))}


def kind_of(att: AttentionSpec) -> LayerKind:
    """The :class:`LayerKind` of a layer's token mixer. Raises ValueError for a kind no
    class is registered for."""
    try:
        return KINDS[att.kind]
    except KeyError:
        raise ValueError(f"unknown attention kind {att.kind!r}; registered: {', '.join(KINDS)}") from None


def register(kind: LayerKind) -> None:
    """Add (or replace) the layer kind ``kind.name``."""
    KINDS[kind.name] = kind


def unregister(name: str) -> None:
    """Remove a kind :func:`register` added."""
    KINDS.pop(name, None)
