"""The runtime's weight containers: what the loaders fill and the forward pass reads.

:class:`LayerWeights` / :class:`Weights`: the resident (device) weights, one field per
tensor of a layer; :class:`HostExperts`: the packed expert blobs held in host memory;
:class:`ExpertSource`: a checkpoint's experts, read once the engine knows where each one
lives (the safetensors and GGUF loaders, :mod:`moefit.runtime.load`, subclass it). Every
expert is ONE contiguous blob ``[gate (I*H) | up (I*H) | down (H*I)]`` in the model dtype
(:func:`split_blob`), or uint8 bytes of a stored layout
(:class:`moefit.runtime.kernels.quant.StoredExpert`; docs/design.md, runtime contract).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moefit.runtime.kernels.quant import Fp8Matrix


@dataclass
class LayerWeights:
    """Resident (device) weights of one decoder layer; ``None`` where the family has none.

    Linear weights are ``[out_features, in_features]`` as ``torch.nn.Linear`` stores them.
    """

    input_norm: torch.Tensor = None          # [H]
    post_norm: torch.Tensor = None           # [H]
    q: torch.Tensor = None                   # [A*D, H]
    k: torch.Tensor = None                   # [K*D, H]
    v: torch.Tensor = None                   # [K*Dv, H]
    o: torch.Tensor = None                   # [H, A*Dv]
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    sinks: torch.Tensor | None = None        # [A] gpt-oss attention sinks
    q_norm: torch.Tensor | None = None       # [D] (per head) or [A*D] (all heads)
    k_norm: torch.Tensor | None = None
    router: torch.Tensor | None = None       # [E, H]
    router_bias: torch.Tensor | None = None  # [E] gpt-oss: added to the logits; DeepSeek / GLM: fp32 e_score_correction_bias
    shared_gate: torch.Tensor | None = None  # [Is, H]
    shared_up: torch.Tensor | None = None    # [Is, H]
    shared_down: torch.Tensor | None = None  # [H, Is]
    shared_expert_gate: torch.Tensor | None = None  # [1, H]
    dense_gate: torch.Tensor | None = None   # [Id, H]
    dense_up: torch.Tensor | None = None
    dense_down: torch.Tensor | None = None   # [H, Id]
    # Gated DeltaNet (linear-attention layers; see moefit.runtime.load.hybrid_layout)
    la_qkvz: torch.Tensor | None = None      # [C + Nv*Dv, H]
    la_ba: torch.Tensor | None = None        # [2*Nv, H]
    la_conv: torch.Tensor | None = None      # [C, 1, K]
    la_dt_bias: torch.Tensor | None = None   # [Nv]
    la_a_log: torch.Tensor | None = None     # [Nv]
    la_norm: torch.Tensor | None = None      # [Dv]
    la_out: torch.Tensor | None = None       # [H, Nv*Dv]
    # MLA (DeepSeek; the listing of moefit.ingest.families.deepseek): L kv_lora_rank, R qk_rope_head_dim, Q q_lora_rank
    q_a: torch.Tensor | None = None          # [Q, H]
    q_a_bias: torch.Tensor | None = None     # [Q]
    q_a_norm: torch.Tensor | None = None     # [Q]
    q_b: torch.Tensor | None = None          # [A*(nope+R), Q]
    kv_a: torch.Tensor | None = None         # [L+R, H]
    kv_a_bias: torch.Tensor | None = None    # [L+R]
    kv_a_norm: torch.Tensor | None = None    # [L]
    kv_b: torch.Tensor | None = None         # [A*(nope+Dv), L]  (or k_b and v_b:)
    k_b: torch.Tensor | None = None          # [A, L, nope]
    v_b: torch.Tensor | None = None          # [A, Dv, L]


@dataclass
class Weights:
    """Resident weights: embeddings ``[V, H]``, final norm ``[H]``, lm_head ``[V, H]``
    (the embedding itself when tied), and the layers."""

    embed: torch.Tensor
    norm: torch.Tensor
    lm_head: torch.Tensor
    layers: list[LayerWeights]


@dataclass
class HostExperts:
    """Packed expert blobs in host memory, per MoE layer: the experts that are not
    resident on a device (every expert with ``--miss-policy copy``).

    ``blobs[layer]``: ``[rows, 3 * I * H]`` in the model dtype, one row per expert held
    (``rows[layer]``: expert -> row); ``experts[layer]``: the layer's expert count E;
    ``elems[layer]``: elements of one blob; ``inter[layer]``: the expert width I;
    ``hidden``: H. ``formats[layer]``: for experts kept in a stored (quantized) format, the
    blob layout (:class:`moefit.runtime.kernels.quant.StoredExpert`); their blobs are uint8.
    ``mapped``: the experts without a row are read from the file's pages when they run
    (``--host-experts mmap``), gathered into ``gather_buf`` by ``source``.
    """

    hidden: int
    dtype: torch.dtype
    blobs: dict[int, torch.Tensor] = field(default_factory=dict)
    inter: dict[int, int] = field(default_factory=dict)
    formats: dict[int, object] = field(default_factory=dict)
    rows: dict[int, dict[int, int]] = field(default_factory=dict)
    experts: dict[int, int] = field(default_factory=dict)
    elems: dict[int, int] = field(default_factory=dict)
    mapped: bool = False
    source: "ExpertSource | None" = None
    gather_buf: torch.Tensor | None = None
    #: rows added after the commit for experts a shrinking cache gave up (:meth:`keep`),
    #: and where they are allocated (``spill(elems, dtype)``: the host ledger)
    extra: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)
    spill: object = None

    def keep(self, layer: int, expert: int, src: torch.Tensor) -> None:
        """Give ``expert`` a host copy of ``src`` (its slot, about to be released) unless
        the host holds or maps it already."""
        if self.mapped or expert in self.rows.get(layer, {}) or expert in self.extra.get(layer, {}):
            return
        alloc = self.spill or (lambda n, dt: torch.empty(n, dtype=dt))
        t = alloc(self.elems[layer], self.dtype)
        t.copy_(src)
        self.extra.setdefault(layer, {})[expert] = t

    def blob_elems(self, layer: int) -> int:
        return self.elems[layer]

    def blob_bytes(self, layer: int) -> int:
        return self.elems[layer] * self.dtype.itemsize

    def blob(self, layer: int, expert: int) -> torch.Tensor:
        """Expert ``expert``'s blob ``[elems]`` in host memory: its row, or (mapped) its
        bytes gathered from the file into ``gather_buf`` (valid until the next call).
        Raises KeyError for an expert the host does not hold (a resident one)."""
        row = self.rows[layer].get(expert)
        if row is not None:
            return self.blobs[layer][row]
        kept = self.extra.get(layer, {}).get(expert)
        if kept is not None:
            return kept
        if not self.mapped:
            raise KeyError(f"layer {layer} expert {expert} is resident; the host holds no copy")
        out = self.gather_buf[:self.elems[layer]]
        self.source.read(layer, {expert: out})
        return out


def split_blob(blob: torch.Tensor, inter: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a packed blob ``[3 I H]``: gate+up ``[2I, H]`` and down ``[H, I]``."""
    gu = blob[:2 * inter * hidden].view(2 * inter, hidden)
    down = blob[2 * inter * hidden:].view(hidden, inter)
    return gu, down


def fp8_matrices(weights: Weights) -> list[Fp8Matrix]:
    """Every block-scaled fp8 matrix of the resident weights (the engine hands them the
    staging workspace they dequantize into)."""
    out = [w for w in (weights.embed, weights.norm, weights.lm_head) if isinstance(w, Fp8Matrix)]
    for lw in weights.layers:
        out += [v for v in vars(lw).values() if isinstance(v, Fp8Matrix)]
    return out


def assemble_weights(glob, layer_plans, resident) -> Weights:
    """The resident (non-expert) weights: ``resident(name, shape)`` allocates and fills
    each tensor of the global plan ``glob`` ``[(attr, name, shape)]`` and of every layer's
    plan; a tied model reuses the embeddings as ``lm_head``. Shared by the safetensors
    and GGUF loaders."""
    g = {attr: resident(name, shape) for attr, name, shape in glob}
    layers = []
    for lp in layer_plans:
        lw = LayerWeights()
        for attr, name, shape in lp:
            setattr(lw, attr, resident(name, shape))
        layers.append(lw)
    return Weights(g["embed"], g["norm"], g.get("lm_head", g["embed"]), layers)


class ExpertSource:
    """The experts of a checkpoint, read when the engine knows where each one goes.

    ``layers``: the MoE layer indices; ``experts[layer]``, ``elems[layer]``,
    ``inter[layer]``, ``formats[layer]`` and ``dtype`` describe the blobs (as in
    :class:`HostExperts`). :meth:`read` copies experts into given blob tensors, :meth:`close`
    ends the reading (the files' handles or maps, the progress bar).
    """

    hidden: int
    dtype: torch.dtype
    experts: dict[int, int]
    elems: dict[int, int]
    inter: dict[int, int]
    formats: dict[int, object]

    @property
    def layers(self) -> list[int]:
        return list(self.experts)

    def read(self, layer: int, targets: dict[int, torch.Tensor]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def host_experts(self) -> HostExperts:
        """An empty :class:`HostExperts` of this source's layout (rows added by the engine)."""
        return HostExperts(self.hidden, self.dtype, inter=dict(self.inter), formats=dict(self.formats),
                           experts=dict(self.experts), elems=dict(self.elems))
