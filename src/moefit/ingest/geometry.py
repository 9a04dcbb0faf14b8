"""Model geometry: what the planner needs to know about a model, per layer.

A :class:`ModelGeometry` is built from a Hugging Face ``config.json`` (see
:mod:`moefit.ingest.families`) and never from weights. It lists, for every decoder layer, the
attention kind and its cache-relevant sizes, the MLP kind (dense or MoE) and the weight
tensors, with their exact shapes, that the reference implementation (transformers)
creates for that layer. Non-expert tensors are listed one by one; the tensors of one
routed expert are listed once per layer together with the expert count, so a 61-layer x
256-expert model stays a few hundred small objects.

Parameter counts and weight bytes are sums over these tensors, so the same listing
prices an unquantized checkpoint, an fp8 block-scaled one and an mxfp4 one
(:class:`Quantization`). When safetensors headers are present, :mod:`moefit.ingest.checkpoint`
replaces the analytic listing by the exact one.

This module imports no torch.
"""

from __future__ import annotations

import math
from functools import cached_property
from typing import Literal, NamedTuple

from moefit.records import field, record

#: How model cards count active parameters: convention -> the tensor roles left out. A
#: token reads one row of the input embedding table, so some cards leave it out:
#: ``all`` (Qwen3 / Qwen3.5, Mixtral, Llama 4: "3.3B activated" for Qwen3-30B-A3B is every
#: non-expert parameter plus 8 experts per layer), ``no_input_embedding`` (OpenAI's gpt-oss
#: card: 5.13B of 116.83B for gpt-oss-120b; DeepSeek-V2/V3 and Kimi K2: "37B activated"),
#: ``non_embedding`` (Qwen3-Next's card: "3B activated", the head left out too; GLM-4.5's:
#: "32B active" of GLM-4.5 and "12B" of GLM-4.5-Air are 32.08B and 12.18B without either
#: embedding, 32.86B and 12.80B with the head).
ACTIVE_CONVENTIONS: dict[str, frozenset[str]] = {
    "all": frozenset(),
    "no_input_embedding": frozenset({"embed"}),
    "non_embedding": frozenset({"embed", "lm_head"}),
}
#: What each convention but ``all`` leaves out, in words (``moefit models``' footer).
ACTIVE_LEFT_OUT: dict[str, str] = {"no_input_embedding": "the input embedding",
                                   "non_embedding": "both embeddings"}

AttentionKind = Literal["full", "sliding", "chunked", "linear", "mla"]
TensorRole = Literal[
    "embed", "lm_head", "norm", "attention", "linear_attention", "router",
    "shared_expert", "dense_mlp", "expert",
]

class Dtype(NamedTuple):
    """A floating dtype: ``bytes`` per element and ``torch``, the name of its ``torch.dtype``
    (``getattr(torch, torch_name)``; kept a string so the planner imports no torch)."""

    bytes: int
    torch: str


#: The floating dtypes that occur in configs (``dtype`` / ``torch_dtype``,
#: ``mamba_ssm_dtype``), by every name configs write: the one table of the planner (bytes)
#: and the runtime (torch dtype, ``moefit.runtime.arch.torch_dtype``).
DTYPES: dict[str, Dtype] = {
    "float32": Dtype(4, "float32"), "float": Dtype(4, "float32"), "fp32": Dtype(4, "float32"),
    "bfloat16": Dtype(2, "bfloat16"), "bf16": Dtype(2, "bfloat16"),
    "float16": Dtype(2, "float16"), "fp16": Dtype(2, "float16"), "half": Dtype(2, "float16"),
}

#: Bytes per element of each name of :data:`DTYPES`.
DTYPE_BYTES: dict[str, int] = {name: d.bytes for name, d in DTYPES.items()}


@record
class Tensor:
    """One weight tensor of the reference implementation.

    Attributes:
        name: the checkpoint name (``model.layers.3.self_attn.q_proj.weight``); for the
            per-expert listing, the name of expert 0.
        shape: the tensor shape, outermost first (``[out_features, in_features]`` for a
            linear weight, as ``torch.nn.Linear`` stores it).
        role: which budget component it belongs to (experts go to the expert cache, every
            other role to the ``weights`` line).
        quantizable: True for the 2-D linear weights that a checkpoint's
            ``quantization_config`` applies to (not embeddings, norms, biases, routers,
            nor modules the config excludes).
        slot: what the runtime fills from it: a field of
            ``moefit.runtime.weights.LayerWeights`` (``q``, ``router``, ``la_qkvz``, ...;
            tensors sharing a slot are stacked into it in listing order), a global
            (``embed``, ``norm``, ``lm_head``) or, for an expert's tensors, its part
            (``gate``, ``up``, ``down``, ...); the family's name table maps a slot to its
            checkpoint and GGUF names (``moefit.ingest.families.common.NameTable``). Both
            loaders read the listing by slot. ``""``: none (planning-only families).
    """

    name: str
    shape: tuple[int, ...]
    role: TensorRole
    quantizable: bool = False
    slot: str = ""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@record
class Quantization:
    """How a checkpoint stores its quantizable weights.

    ``method``:
      - ``"none"``: every tensor in the model dtype.
      - ``"fp8"``: block-scaled e4m3 (DeepSeek-V3 ``quantization_config``: ``quant_method:
        fp8``, ``weight_block_size: [128, 128]``): 1 byte per weight plus one fp32
        ``weight_scale_inv`` per 128x128 block (DeepSeek-V3 ``inference/fp8_cast_bf16.py``).
      - ``"mxfp4"``: OCP microscaling fp4 (gpt-oss ``quant_method: mxfp4``): 4 bits per
        weight plus one uint8 e8m0 scale per 32 weights, experts only (``*_blocks`` /
        ``*_scales`` tensors of the gpt-oss checkpoints; OCP MX spec v1.0).
    ``applies_to``: the roles the method covers (``"expert"`` only for mxfp4).
    """

    method: Literal["none", "fp8", "mxfp4"] = "none"
    block_size: tuple[int, int] = (128, 128)
    applies_to: frozenset[str] = frozenset()

    def dense_fp8(self, t: Tensor) -> bool:
        """Tensor ``t`` is held as block-scaled fp8 (method ``fp8``): a quantizable 2-D
        tensor of a role the method covers."""
        return self.method == "fp8" and t.quantizable and t.role in self.applies_to and len(t.shape) == 2

    def tensor_bytes(self, t: Tensor, dtype_bytes: int) -> int:
        """Bytes that tensor ``t`` occupies in a checkpoint/device buffer of this format.

        Errors: none; tensors the method does not cover are priced at ``dtype_bytes``.
        """
        if self.method == "none" or not t.quantizable or t.role not in self.applies_to:
            return t.numel * dtype_bytes
        if self.method == "fp8":
            if len(t.shape) < 2:
                return t.numel * dtype_bytes
            *lead, rows, cols = t.shape
            b0, b1 = self.block_size
            scales = math.prod(lead) * math.ceil(rows / b0) * math.ceil(cols / b1)
            return t.numel + 4 * scales
        if self.method == "mxfp4":
            # 32 fp4 values in 16 bytes + 1 scale byte; gpt-oss in-features are multiples of 32
            blocks = math.ceil(t.numel / 32)
            return blocks * 16 + blocks
        raise ValueError(f"unknown quantization method {self.method!r}")


@record
class AttentionSpec:
    """Cache-relevant sizes of one layer's token mixer.

    ``kind``:
      - ``full``: softmax attention over the whole context (GQA: ``num_kv_heads`` K/V heads).
      - ``sliding``: softmax attention over the last ``sliding_window`` tokens.
      - ``chunked``: softmax attention within fixed chunks of ``sliding_window`` tokens
        (Llama 4's ``attention_chunk_size``): a query at position p attends to the keys
        from ``(p // chunk) * chunk`` to p.
      - ``mla``: DeepSeek multi-head latent attention; the cache holds the compressed
        latent (``kv_lora_rank``) plus the decoupled RoPE key (``qk_rope_head_dim``) per
        token (DeepSeek-V2 paper, section 2.1.2).
      - ``linear``: Gated DeltaNet (Qwen3-Next / Qwen3.5): a fixed recurrent state of
        ``linear_num_value_heads x linear_key_head_dim x linear_value_head_dim`` plus a
        causal-conv state of ``conv_dim x (linear_conv_kernel - 1)`` per sequence.
    """

    kind: AttentionKind
    num_heads: int
    num_kv_heads: int = 0
    head_dim: int = 0            # K (and Q) head dim; for MLA: qk_nope + qk_rope
    v_head_dim: int = 0
    rotary_dim: int = 0          # partial rotary: rotary_dim < head_dim
    sliding_window: int | None = None   # the window (sliding) or the chunk (chunked), tokens
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    q_lora_rank: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0
    state_dtype: str = "float32"  # recurrent state dtype (``mamba_ssm_dtype``, a DTYPES name)
    output_gate: bool = False    # Qwen3-Next/3.5 gated attention (q_proj doubled)

    @property
    def state_dtype_bytes(self) -> int:
        """Bytes per element of the recurrent state (:data:`DTYPES` of ``state_dtype``)."""
        return DTYPES[self.state_dtype].bytes

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the causal conv in a Gated DeltaNet layer (q, k and v projections)."""
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)


@record
class Routing:
    """How a router chooses a token's experts, beyond softmax top-k.

    ``scoring``: ``softmax`` or ``sigmoid`` of the router logits. ``method``: ``greedy``
    (top-k of the scores), ``group_limited_greedy`` (DeepSeek-V2: the experts are split
    into ``n_group`` groups, the ``topk_group`` groups with the highest best score are
    kept, top-k within them) or ``noaux_tc`` (DeepSeek-V3 / Kimi-K2 / GLM-4.5: groups
    ranked by the sum of their two best scores plus the per-expert
    ``e_score_correction_bias``, which chooses but does not weigh). ``scale``:
    ``routed_scaling_factor``, multiplied into the chosen weights. ``bias``: the router has
    an ``e_score_correction_bias``. Sources: transformers 5.x ``DeepseekV2TopkRouter`` /
    ``DeepseekV3TopkRouter`` / ``Glm4MoeTopkRouter``. The default is plain softmax top-k.
    """

    scoring: Literal["softmax", "sigmoid"] = "softmax"
    method: Literal["greedy", "group_limited_greedy", "noaux_tc"] = "greedy"
    n_group: int = 1
    topk_group: int = 1
    scale: float = 1.0
    bias: bool = False

    @property
    def grouped(self) -> bool:
        """True when the router is not plain softmax top-k (it needs the grouped router)."""
        return self != Routing()


@record
class MoESpec:
    """Routed-expert block of one layer (``routing``: :class:`Routing`)."""

    num_experts: int
    experts_per_token: int
    expert_intermediate: int
    num_shared_experts: int = 0
    shared_intermediate: int = 0   # total width of the shared expert(s)
    routing: Routing = Routing()


@record
class LayerSpec:
    """One decoder layer.

    ``tensors``: every non-expert tensor of the layer (attention, norms, router, shared
    expert, dense MLP). ``expert_tensors``: the tensors of ONE routed expert (empty for a
    dense layer); the layer holds ``moe.num_experts`` copies of them.
    ``dense_intermediate``: width of the dense MLP (0 on MoE layers). ``buffers``: tensors
    a checkpoint stores that are buffers, not parameters, of the reference implementation
    (DeepSeek-V3's / GLM-4.5's ``e_score_correction_bias``): the loaders read them, the
    analytic counts and bytes leave them out (the exact header reading counts them).
    """

    index: int
    attention: AttentionSpec
    moe: MoESpec | None
    tensors: tuple[Tensor, ...]
    expert_tensors: tuple[Tensor, ...] = ()
    dense_intermediate: int = 0
    buffers: tuple[Tensor, ...] = ()


@record
class RopeSpec:
    """Rotary position embedding as the config declares it.

    ``trained_window``: the longest context the checkpoint supports as shipped
    (``max_position_embeddings``, which already includes any scaling in the config).
    ``original_window``: the pre-scaling window when the config itself scales RoPE
    (``rope_scaling.original_max_position_embeddings``), else ``trained_window``.
    """

    theta: float
    scaling_type: str | None
    factor: float
    trained_window: int
    original_window: int


@record
class ModelGeometry:
    """Everything the planner needs about a model, without weights.

    ``global_tensors``: embeddings, final norm, lm_head (absent when tied).
    ``dtype_bytes``: bytes per element of unquantized tensors (from ``torch_dtype`` /
    ``dtype``).
    """

    name: str
    model_type: str
    hidden_size: int
    vocab_size: int
    layers: tuple[LayerSpec, ...]
    global_tensors: tuple[Tensor, ...]
    dtype: str
    dtype_bytes: int
    quant: Quantization
    rope: RopeSpec
    source: str = ""               # where the config came from (preset name or path)
    exact: "ExactWeights | None" = None   # set when safetensors headers were read
    notes: tuple[str, ...] = field(default_factory=tuple)
    #: which embeddings :attr:`active_params` counts, as the model's card does
    #: (:data:`ACTIVE_CONVENTIONS`; ``Family.active_convention``)
    active_convention: str = "all"

    # ---- counts -------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def moe_layers(self) -> tuple[LayerSpec, ...]:
        return tuple(l for l in self.layers if l.moe is not None)

    @property
    def total_experts(self) -> int:
        """Routed experts summed over MoE layers (the expert cache's "all experts")."""
        return sum(l.moe.num_experts for l in self.moe_layers)

    def _expert_numel(self, layer: LayerSpec) -> int:
        return sum(t.numel for t in layer.expert_tensors)

    @property
    def total_params(self) -> int:
        """Parameters of the text model as the reference implementation builds it."""
        n = sum(t.numel for t in self.global_tensors)
        for l in self.layers:
            n += sum(t.numel for t in l.tensors)
            if l.moe is not None:
                n += l.moe.num_experts * self._expert_numel(l)
        return n

    @property
    def active_params(self) -> int:
        """Parameters used per token, as the model's card counts them: every non-expert
        parameter plus the top-k routed experts of each MoE layer, less the embeddings the
        card leaves out (:attr:`active_convention`, :data:`ACTIVE_CONVENTIONS`)."""
        left_out = ACTIVE_CONVENTIONS[self.active_convention]
        n = sum(t.numel for t in self.global_tensors if t.role not in left_out)
        for l in self.layers:
            n += sum(t.numel for t in l.tensors)
            if l.moe is not None:
                n += l.moe.experts_per_token * self._expert_numel(l)
        return n

    # ---- bytes --------------------------------------------------------------------
    def tensor_bytes(self, t: Tensor) -> int:
        return self.quant.tensor_bytes(t, self.dtype_bytes)

    def analytic_weight_bytes(self) -> int:
        """Bytes of every non-expert tensor (the ``weights`` budget line), analytic."""
        return self._analytic_weight_bytes

    def analytic_expert_blob_bytes(self) -> dict[int, int]:
        """Bytes of one packed expert blob per MoE layer index, analytic."""
        return dict(self._analytic_blobs)

    # The geometry is frozen, so these sums are computed once per instance (a solve asks
    # for them many times; DeepSeek-V3 lists ~1000 tensors).
    @cached_property
    def _analytic_weight_bytes(self) -> int:
        n = sum(self.tensor_bytes(t) for t in self.global_tensors)
        for l in self.layers:
            n += sum(self.tensor_bytes(t) for t in l.tensors)
        return n

    @cached_property
    def _analytic_blobs(self) -> dict[int, int]:
        return {l.index: sum(self.tensor_bytes(t) for t in l.expert_tensors)
                for l in self.moe_layers}

    def weight_bytes(self) -> int:
        """The ``weights`` line: exact from safetensors headers when read, else analytic."""
        return self.exact.weight_bytes if self.exact else self.analytic_weight_bytes()

    def expert_blob_bytes(self) -> dict[int, int]:
        """Bytes of one expert blob per MoE layer: exact when headers were read, else analytic."""
        return dict(self.exact.expert_blob_bytes) if self.exact else self.analytic_expert_blob_bytes()

    @property
    def experts_stored(self) -> bool:
        """The routed experts stay in a stored (quantized) format and are dequantized when
        they run: as the headers read say (:attr:`ExactWeights.experts_stored`: GGUF, fp8
        or mxfp4 safetensors), else, from a config alone, when its quantization covers the
        experts: mxfp4 (gpt-oss: the runtime keeps those blocks as stored) or block-scaled
        fp8."""
        if self.exact is not None:
            return self.exact.experts_stored
        return self.quant.method in ("mxfp4", "fp8") and "expert" in self.quant.applies_to

    @property
    def expert_types(self) -> dict[int, tuple[str, ...]]:
        """Per MoE layer, the (gate, up, down) ggml types of stored experts (empty when the
        types are not known): the headers', else MXFP4 for an mxfp4 config."""
        if self.exact is not None:
            return dict(self.exact.expert_types)
        if self.quant.method == "mxfp4":
            return {l.index: ("MXFP4",) * 3 for l in self.moe_layers}
        return {}

    def attention_layout(self) -> str:
        """Layer count per attention kind in a fixed kind order: ``10 full + 30 linear``."""
        counts = {k: 0 for k in ("full", "sliding", "chunked", "mla", "linear")}
        for l in self.layers:
            counts[l.attention.kind] = counts.get(l.attention.kind, 0) + 1
        return " + ".join(f"{n} {k}" for k, n in counts.items() if n)


@record
class ExactWeights:
    """Weight bytes read from safetensors headers (shapes and dtypes, never data).

    ``weight_bytes``: every tensor of the text model that is not a routed expert.
    ``expert_blob_bytes``: bytes of one routed expert per MoE layer index (all its
    tensors, scales included).
    ``skipped_bytes``: tensors not used by the text model (vision tower, MTP layers).
    ``files``: how many safetensors files were read.
    ``experts_stored``: the routed experts stay in a stored (quantized) format and are
    dequantized when they run; the staging this takes is priced on the ``prefill`` line
    (:func:`moefit.memory.staging.expert_dequant_bytes`). ``expert_types``: per MoE layer,
    the (gate, up, down) ggml types they are stored in (gpt-oss's mxfp4 experts: MXFP4).
    ``load_staging_bytes``: the most host memory the loader holds at once beside its
    destinations while reading the files (:func:`moefit.memory.host.load_staging_bytes`);
    0 when not known (the analytic bound is used).

    Other formats (GGUF: :class:`moefit.ingest.gguf_header.GGUFWeights`) subclass this and override
    :meth:`line_detail` / :meth:`describe`.
    """

    weight_bytes: int
    expert_blob_bytes: tuple[tuple[int, int], ...]
    skipped_bytes: int
    total_params: int
    files: int
    experts_stored: bool = False
    expert_types: tuple[tuple[int, tuple[str, ...]], ...] = ()
    load_staging_bytes: int = 0

    def line_detail(self) -> str:
        """Detail of the ``weights`` budget line."""
        return "exact, from safetensors headers"

    def describe(self, geom: "ModelGeometry", kept: tuple[int, int] | None = None) -> list[str] | None:
        """``--verbose`` lines of a format that has its own; None: the generic lines.
        ``kept``: (``weights`` line bytes, quantized matrices kept as stored) on the plan's
        device, for a format that keeps some (GGUF)."""
        return None
