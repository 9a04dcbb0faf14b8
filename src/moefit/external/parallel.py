"""Parallelism arithmetic shared by the vLLM and SGLang memory models: what one GPU (rank)
holds when a model is split by tensor, pipeline, data and expert parallelism.

Both engines shard a Hugging Face model the same way (SGLang's parallel layers come from
vLLM's), so one module owns the rules; :mod:`moefit.external.vllm` and
:mod:`moefit.external.sglang` add what is their own (the memory profile, the pool sizing,
the command line). Sources, per rule:

- **tensor parallelism** (``tp``): Megatron-LM's split (Shoeybi et al. 2019,
  arXiv:1909.08053) as vLLM's ``vllm/model_executor/layers/linear.py`` implements it:
  ``ColumnParallelLinear`` / ``QKVParallelLinear`` / ``MergedColumnParallelLinear`` split the
  output dimension, ``RowParallelLinear`` the input dimension (its bias is kept whole on
  every rank); ``QKVParallelLinear`` keeps ``max(1, num_kv_heads // tp)`` K/V heads per rank,
  so with fewer K/V heads than ranks each K/V head is replicated; it requires ``num_heads %
  tp == 0`` and ``num_kv_heads % tp == 0`` or ``tp % num_kv_heads == 0``. Norms, routers and
  ``ReplicatedLinear`` layers are whole on every rank.
- **vocabulary**: ``VocabParallelEmbedding`` / ``ParallelLMHead``
  (``vocab_parallel_embedding.py``) pad the vocabulary to a multiple of 64
  (``DEFAULT_VOCAB_PADDING_SIZE``) and give each rank ``padded / tp`` rows.
- **MLA** (DeepSeek-V2/V3, Kimi-K2; ``models/deepseek_v2.py``): ``q_a_proj`` and
  ``kv_a_proj_with_mqa`` are replicated (they produce the shared latent), ``q_b_proj``,
  ``kv_b_proj`` (column) and ``o_proj`` (row) are split by heads. The KV cache holds the
  latent ``kv_lora_rank + qk_rope_head_dim`` per token and layer on **every** TP rank
  (one latent "head", replicated), so tensor parallelism does not divide it.
- **Gated DeltaNet** (Qwen3-Next / Qwen3.5, ``models/qwen3_next.py``): the projections,
  the causal conv and the recurrent state are split by heads; the state per sequence per
  rank is ``(conv_kernel - 1) x conv_dim / tp`` in the model dtype plus ``value_heads / tp
  x key_dim x value_dim`` in ``mamba_ssm_dtype``.
- **experts** (``layers/fused_moe/layer.py``, ``determine_expert_map``): the MoE layers of
  ``tp x dp`` ranks form one group. Without expert parallelism every rank holds every
  expert with its intermediate dimension split by the group; with expert parallelism
  (``--enable-expert-parallel`` in vLLM, ``--ep-size`` in SGLang) each rank holds
  ``ceil(num_experts / group)`` whole experts. Shared experts and dense MLPs follow ``tp``.
- **data-parallel attention** (``dp > 1``): each DP rank has its own attention (TP over
  ``tp`` ranks) and its own KV cache and scheduler; the experts are shared by the group.
- **pipeline parallelism** (``pp``): ``vllm/distributed/utils.py`` ``get_pp_indices``
  (SGLang keeps the same function): ``num_layers // pp`` layers per stage, the remainder
  going one each to the stages before the last; the token embedding lives on the first
  stage, the final norm and ``lm_head`` on the last. Each engine sizes the KV cache of
  every stage and keeps the smallest (vLLM ``unify_kv_cache_configs``, SGLang an
  ``all_reduce(MIN)`` in ``init_memory_pool``).

Nothing here imports torch or an engine.
"""

from __future__ import annotations

import math

from moefit.errors import InputError
from moefit.ingest.geometry import DTYPES, LayerSpec, ModelGeometry, Tensor
from moefit.memory.layer_kinds import Latent, Recurrent, kind_of
from moefit.records import record

#: ``DEFAULT_VOCAB_PADDING_SIZE`` of ``vocab_parallel_embedding.py`` (rows)
VOCAB_PADDING = 64


@record
class Layout:
    """How a model is spread over ``tp x pp x dp`` GPUs on ``nodes`` nodes.

    ``tp``: tensor-parallel ranks of the attention (and of dense MLPs, shared experts, the
    vocabulary); ``pp``: pipeline stages; ``dp``: data-parallel attention replicas, each
    with its own KV cache; ``ep``: experts placed whole on the ``tp x dp`` ranks of an MoE
    group (expert parallelism) instead of split by their intermediate dimension.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: bool = False
    nodes: int = 1

    @property
    def world(self) -> int:
        """GPUs in all."""
        return self.tp * self.pp * self.dp

    @property
    def moe_group(self) -> int:
        """Ranks that share one MoE layer's experts: ``tp x dp``."""
        return self.tp * self.dp

    @property
    def gpus_per_node(self) -> int:
        return self.world // self.nodes

    def describe(self) -> str:
        """``TP 8 x PP 2`` (``, DP 8 attention``, ``, EP 8``), ``on 2 nodes``."""
        parts = [f"TP {self.tp}"]
        if self.pp > 1:
            parts.append(f"PP {self.pp}")
        if self.dp > 1:
            parts.append(f"DP {self.dp} (attention)")
        text = " x ".join(parts)
        if self.ep:
            text += f", EP {self.moe_group} (experts whole)"
        gpus = f"{self.world} GPU{'s' if self.world > 1 else ''}"
        where = f" on {self.nodes} nodes of {self.gpus_per_node}" if self.nodes > 1 else ""
        return f"{text}: {gpus}{where}"


def stage_layers(num_layers: int, pp: int) -> tuple[range, ...]:
    """The decoder layers of each pipeline stage (vLLM ``get_pp_indices``, see module doc).

    Raises InputError (``--pp``) when there are more stages than layers."""
    if pp < 1 or pp > num_layers:
        raise InputError(f"--pp {pp}: a pipeline needs 1 to {num_layers} stages for a model of "
                         f"{num_layers} layers")
    sizes = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        sizes[-i] += 1
    out, start = [], 0
    for s in sizes:
        out.append(range(start, start + s))
        start += s
    return tuple(out)


# ---- validation -------------------------------------------------------------------------------
def check_layout(geom: ModelGeometry, layout: Layout, *, fp8_block: int | None = None) -> None:
    """Reject a layout the engines refuse to load, naming the flag and a fix (exit 2).

    Checks (vLLM ``QKVParallelLinear``, ``fused_moe/layer.py``; SGLang the same layers):
    ``tp`` divides the attention heads (and the Gated DeltaNet key heads), the K/V heads
    divide ``tp`` or ``tp`` divides them, ``--ep`` only on MoE models, ``pp`` at most the
    layers, and, with block-fp8 weights (``fp8_block``, 128) and experts split by the group,
    ``moe_intermediate / group`` a multiple of the block (vLLM's ``Fp8MoEMethod``: "not
    divisible by weight quantization block_n").

    Raises:
        InputError: the first violation, naming ``--tp``/``--dp``/``--ep``/``--pp``.
    """
    for v, flag in ((layout.tp, "--tp"), (layout.pp, "--pp"), (layout.dp, "--dp"),
                    (layout.nodes, "--nodes")):
        if v < 1:
            raise InputError(f"{flag} {v}: must be at least 1")
    stage_layers(geom.num_layers, layout.pp)
    heads = sorted({l.attention.num_heads for l in geom.layers if kind_of(l.attention).cells})
    for h in heads:
        if h % layout.tp:
            ok = [t for t in (1, 2, 4, 8, 16, 32) if h % t == 0 and layout.world % t == 0]
            raise InputError(f"--tp {layout.tp} does not divide {geom.name}'s {h} attention heads; "
                             f"use --tp {' or '.join(map(str, ok[-3:]))} (and --pp or --dp for the "
                             "other GPUs)")
    for kv in sorted({l.attention.num_kv_heads for l in geom.layers
                      if kind_of(l.attention).cells and not isinstance(kind_of(l.attention), Latent)
                      and l.attention.num_kv_heads}):
        if kv % layout.tp and layout.tp % kv:
            raise InputError(f"--tp {layout.tp} and {geom.name}'s {kv} K/V heads: one must divide "
                             "the other (vLLM/SGLang QKVParallelLinear); use a power of two "
                             "--tp")
    for l in geom.layers:
        a = l.attention
        if isinstance(kind_of(a), Recurrent) and (a.linear_num_key_heads % layout.tp or a.linear_num_value_heads % layout.tp):
            raise InputError(f"--tp {layout.tp} does not divide the {a.linear_num_key_heads} key heads of "
                             f"{geom.name}'s linear-attention layers; use a --tp that divides "
                             f"{a.linear_num_key_heads}")
    if layout.ep and not geom.moe_layers:
        raise InputError(f"--ep: {geom.name} is a dense model (no experts to place); drop --ep")
    experts = min((l.moe.num_experts for l in geom.moe_layers), default=0)
    if layout.ep and layout.moe_group > experts:
        raise InputError(f"--ep {layout.moe_group}: expert parallelism over more ranks than "
                         f"{geom.name}'s {experts} experts leaves ranks without one "
                         f"(determine_expert_map); use at most {experts} GPUs per MoE group "
                         f"(--tp x --dp), or --pp for the others")
    if geom.moe_layers and not layout.ep:
        inter = min(l.moe.expert_intermediate for l in geom.moe_layers)
        if layout.moe_group > inter:
            raise InputError(f"--tp {layout.tp} x --dp {layout.dp}: {geom.name}'s experts are "
                             f"{inter} wide, too narrow to split over {layout.moe_group} ranks; "
                             "use fewer GPUs per MoE group")
    if fp8_block and geom.moe_layers and not layout.ep:
        inter = geom.moe_layers[0].moe.expert_intermediate
        if (inter // layout.moe_group) % fp8_block or inter % layout.moe_group:
            raise InputError(
                f"{geom.name}'s experts ({inter} wide, fp8 in {fp8_block}-wide blocks) cannot be "
                f"split over {layout.moe_group} ranks ({inter // max(1, layout.moe_group)} each is "
                f"not a multiple of {fp8_block}); add --ep {layout.moe_group} (experts whole on "
                "each rank)")


def fp8_block_of(geom: ModelGeometry) -> int | None:
    """The N block of a block-scaled fp8 checkpoint (``weight_block_size[0]``), else None."""
    return geom.quant.block_size[0] if geom.quant.method == "fp8" else None


# ---- one rank's weights ------------------------------------------------------------------------
def _vocab_rows(rows: int, tp: int) -> int:
    """Rows of a vocabulary-parallel tensor on one rank: ``pad(rows, 64) / tp`` (ceil)."""
    padded = -(-rows // VOCAB_PADDING) * VOCAB_PADDING
    return -(-padded // tp)


def tensor_rank_bytes(geom: ModelGeometry, t: Tensor, layer: LayerSpec | None, tp: int) -> int:
    """Bytes of non-expert tensor ``t`` on one of ``tp`` ranks (the rules of the module
    docstring; quantized bytes, scales included, split in the same proportion)."""
    b = geom.tensor_bytes(t)
    if tp == 1 or t.role in ("norm", "router"):
        return b
    if t.role in ("embed", "lm_head"):
        rows = t.shape[0]
        return b * _vocab_rows(rows, tp) // rows
    name = t.name
    if t.role == "attention" and layer is not None:
        a = layer.attention
        if isinstance(kind_of(a), Latent):
            if ".q_a_proj." in name or ".kv_a_proj_with_mqa." in name:
                return b
            return -(-b // tp)
        if ".k_proj." in name or ".v_proj." in name:
            kv = a.num_kv_heads
            return b * max(1, kv // tp) // kv
        if name.endswith("o_proj.bias"):
            return b
        return -(-b // tp)
    if "shared_expert_gate" in name or name.endswith("down_proj.bias"):
        return b
    return -(-b // tp)


def expert_rank_bytes(geom: ModelGeometry, layer: LayerSpec, layout: Layout,
                      blob_bytes: int | None = None) -> int:
    """Bytes of ``layer``'s routed experts on one rank: ``ceil(E / group)`` whole blobs with
    expert parallelism, else ``ceil(E x blob / group)`` (each expert split). ``blob_bytes``:
    one expert as the engine holds it (default: as the checkpoint stores it)."""
    if layer.moe is None:
        return 0
    blob = geom.expert_blob_bytes()[layer.index] if blob_bytes is None else blob_bytes
    e, g = layer.moe.num_experts, layout.moe_group
    if layout.ep:
        return -(-e // g) * blob
    return -(-(e * blob) // g)


@record
class StageShard:
    """What one rank of pipeline stage ``stage`` holds (bytes; tokens; sequences).

    ``weights``: every tensor of the rank; ``parts``: the same by kind (``attention``,
    ``mlp`` (dense MLPs, shared experts), ``experts``, ``embeddings`` (token embedding,
    ``lm_head``), ``other`` (norms, routers)); ``kv_layer_bytes``: K+V (or latent) bytes per
    token of each attention layer of the stage, on this rank, at ``kv_bytes`` per element;
    ``kv_kinds``: ``(kind, window)`` of each of those layers, the kind as vLLM's spec type
    (``full``, MLA too, with window None; ``sliding`` / ``chunked`` with their window);
    ``state_bytes``: recurrent state per sequence of the stage's linear-attention layers.
    """

    stage: int
    layers: range
    weights: int
    parts: dict
    kv_layer_bytes: tuple[int, ...]
    kv_kinds: tuple[tuple[str, int | None], ...]
    state_bytes: int
    linear_layers: int
    first: bool
    last: bool

    @property
    def kv_token_bytes(self) -> int:
        """KV bytes per token of context on this rank (all its attention layers)."""
        return sum(self.kv_layer_bytes)


def layer_kv_bytes(layer: LayerSpec, tp: int, kv_bytes: int) -> int:
    """K+V bytes per token of one attention layer on one of ``tp`` ranks: MLA the latent
    ``kv_lora_rank + qk_rope_head_dim`` (replicated); GQA ``max(1, kv_heads // tp) x
    (head_dim + v_head_dim)``. 0 for a linear-attention layer."""
    a = layer.attention
    kind = kind_of(a)
    if isinstance(kind, Recurrent):
        return 0
    if isinstance(kind, Latent):
        return (a.kv_lora_rank + a.qk_rope_head_dim) * kv_bytes
    return max(1, a.num_kv_heads // tp) * (a.head_dim + (a.v_head_dim or a.head_dim)) * kv_bytes


def layer_state_bytes(geom: ModelGeometry, layer: LayerSpec, tp: int) -> int:
    """Recurrent state of one Gated DeltaNet layer per sequence on one of ``tp`` ranks:
    conv ``(kernel - 1) x conv_dim / tp`` in the model dtype + SSM ``value_heads / tp x
    key_dim x value_dim`` in ``state_dtype``. 0 for other layers."""
    a = layer.attention
    if not isinstance(kind_of(a), Recurrent):
        return 0
    conv = (a.linear_conv_kernel - 1) * (a.linear_conv_dim // tp) * geom.dtype_bytes
    ssm = (a.linear_num_value_heads // tp) * a.linear_key_head_dim * a.linear_value_head_dim * a.state_dtype_bytes
    return conv + ssm


def stage_shards(geom: ModelGeometry, layout: Layout, kv_bytes: int,
                 expert_blob=None) -> tuple[StageShard, ...]:
    """One :class:`StageShard` per pipeline stage (the rank of the stage; all its ranks
    hold the same bytes up to vocabulary rounding). ``expert_blob(layer) -> bytes``: one
    expert as the engine holds it (default: as stored)."""
    stages = stage_layers(geom.num_layers, layout.pp)
    out = []
    for s, rng in enumerate(stages):
        first, last = s == 0, s == len(stages) - 1
        parts = {"attention": 0, "mlp": 0, "experts": 0, "embeddings": 0, "other": 0}
        for t in geom.global_tensors:
            keep = (t.role == "embed" and first) or (t.role == "lm_head" and last) or (t.role == "norm" and last)
            if keep:
                parts["embeddings" if t.role != "norm" else "other"] += tensor_rank_bytes(geom, t, None, layout.tp)
        kv, win, state, lin = [], [], 0, 0
        for i in rng:
            layer = geom.layers[i]
            for t in layer.tensors:
                kind = ("attention" if t.role in ("attention", "linear_attention") else
                        "mlp" if t.role in ("shared_expert", "dense_mlp") else "other")
                parts[kind] += tensor_rank_bytes(geom, t, layer, layout.tp)
            blob = None if expert_blob is None or layer.moe is None else expert_blob(layer)
            parts["experts"] += expert_rank_bytes(geom, layer, layout, blob)
            a = layer.attention
            kind = kind_of(a)
            if isinstance(kind, Recurrent):
                state += layer_state_bytes(geom, layer, layout.tp)
                lin += 1
            else:
                kv.append(layer_kv_bytes(layer, layout.tp, kv_bytes))
                w = kind.window(a)      # vLLM's spec type: a masked window slides, else chunks
                win.append((("sliding" if kind.masked_window(a) else "chunked"), w) if w else ("full", None))
        out.append(StageShard(s, rng, sum(parts.values()), parts, tuple(kv), tuple(win), state, lin,
                              first, last))
    return tuple(out)


# ---- activations of one forward pass -----------------------------------------------------------
def token_activation_bytes(geom: ModelGeometry, layers: range, tp: int) -> int:
    """Bytes per token live at the peak of one forward pass on one rank, outside the routed
    experts, for ``layers``: six hidden-sized tensors (the residual stream, the layer input,
    its norm, the attention / MLP outputs and their reduced copies) plus the largest
    transient of a layer, in the model dtype:

    - attention: Q, K, V out of the fused projection and the attention output
      (``2 q / tp + 2 kv + hidden``); MLA (prefill runs it as MHA): the ``kv_b_proj`` output
      (``heads / tp x (nope + v)``), Q and the assembled K (``2 heads / tp x qk_head``), the
      output;
    - dense MLP / shared expert: ``gate_up`` (``2 i / tp``) and the activation (``i / tp``);
    - Gated DeltaNet: the ``in_proj`` outputs, the convolved q/k/v and the gated output
      (``(2 conv_dim + 3 d_inner) / tp``).

    The six hidden-sized tensors are matched to vLLM's profile run of Llama-3.1-8B on one
    stage of a 2- and 4-stage pipeline (1.10 / 1.05 GiB for 8192 tokens, no sampler on that
    stage; ``tests/data/serving``); the routed experts' buffers are
    :func:`moe_workspace_bytes`."""
    h = geom.hidden_size
    worst = 0
    for i in layers:
        layer = geom.layers[i]
        a = layer.attention
        kind = kind_of(a)
        if isinstance(kind, Recurrent):
            d_inner = a.linear_num_value_heads * a.linear_value_head_dim
            mix = (2 * a.linear_conv_dim + 3 * d_inner) // tp + h
        elif isinstance(kind, Latent):
            heads = a.num_heads // tp
            nope = a.head_dim - a.qk_rope_head_dim
            v = a.v_head_dim or nope
            mix = heads * (nope + v) + 2 * heads * a.head_dim + heads * v + h
        else:
            q = a.num_heads * a.head_dim // tp
            kvh = max(1, a.num_kv_heads // tp) * a.head_dim
            mix = 2 * q + 2 * kvh + h
        ffn = 0
        if layer.moe is not None and layer.moe.shared_intermediate:
            ffn = 3 * layer.moe.shared_intermediate // tp
        elif layer.moe is None and layer.dense_intermediate:
            ffn = 3 * layer.dense_intermediate // tp
        worst = max(worst, mix, ffn)
    return geom.dtype_bytes * (6 * h + worst)


def moe_workspace_bytes(geom: ModelGeometry, layers: range, moe_group: int, ep: bool) -> int:
    """Bytes per token of the fused-MoE kernel's workspaces (vLLM
    ``layers/fused_moe/fused_moe.py`` ``TritonExperts.workspace_shapes``: ``workspace13``
    ``[tokens, top_k, max(2 i', hidden)]`` and ``workspace2`` ``[tokens, top_k, i']`` in the
    model dtype, ``i'`` the per-rank width: ``i / group``, or ``i`` with expert parallelism).
    The workspace manager keeps them allocated after the first forward pass, so they add
    to the sampler's peak too. 0 for a dense model."""
    worst = 0
    for i in layers:
        m = geom.layers[i].moe
        if m is None:
            continue
        inter = m.expert_intermediate if ep else -(-m.expert_intermediate // moe_group)
        worst = max(worst, m.experts_per_token * (max(2 * inter, geom.hidden_size) + inter))
    return geom.dtype_bytes * worst


def logits_bytes(geom: ModelGeometry, rows: int, per_logit: int) -> int:
    """The sampler's peak for ``rows`` sequences: ``rows x vocab x per_logit`` bytes (the
    gathered fp32 logits and the sampler's copies of them; ``per_logit`` is the engine's)."""
    return rows * geom.vocab_size * per_logit


def dtype_bytes(name: str) -> int:
    """Bytes per element of a floating dtype name (:data:`moefit.ingest.geometry.DTYPES`)."""
    return DTYPES[name].bytes


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def floor_to(x: float, step: float) -> float:
    """``x`` rounded down to a multiple of ``step`` (kept exact for printing)."""
    return math.floor(x / step + 1e-9) * step
