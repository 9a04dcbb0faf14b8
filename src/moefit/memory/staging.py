"""The ``prefill`` budget line: staging buffers of one prefill chunk.

The model is affine in the chunk ``c`` (tokens) and independent of the context length::

    staging(c) = const_bytes + per_token_bytes * c

It prices exactly what moefit's forward pass takes from the line's one workspace
(:mod:`moefit.runtime.buffers.workspace`), which has two parts:

1. a *fixed region*, reserved at the bottom for the whole chunk and shared by the layers
   one after another: whatever does not grow with the chunk. Its size is the largest of
   one layer's token-mixer needs, the last-token logits (fp32, and in the compute dtype
   first unless fp32), and one dequantized expert matrix of a stored (GGUF) format
   (none on a CUDA device whose Triton kernels read them as stored: :func:`experts_fused`).
   Attention runs over tiles of ``ATTN_Q_BLOCK`` queries x ``ATTN_KV_BLOCK`` cached
   tokens with an online softmax (Milakov & Gimelshein 2018; FlashAttention, Dao et al.
   2022), so its part is one tile whatever the context: the query tile, fp32 running
   output / max / sum, the K/V block as stored and dequantized, fp32 scores (and in the
   compute dtype), masks, row vectors, and a block read's codec scratch. The chunked
   delta rule of Gated DeltaNet runs one block of ``DELTA_CHUNK`` (64) tokens at a time
   (Yang et al. 2024, "Gated Delta Networks", chunkwise form; transformers
   ``torch_chunk_gated_delta_rule`` holds every block at once, moefit one block), so its
   part is the block buffers, one state-sized product, and an fp32 copy of the state when
   it is kept in another dtype. Tiles are sized in full even for a chunk at position 0.
2. a *stack* of ``[c, ...]`` tensors above it: the residual stream (hidden state, normed
   input, layer output) and the chunk's RoPE cos / sin, always; on top, at each step of a
   layer, what that step takes (:class:`~moefit.memory.takes.Step`): the RMSNorm's fp32 scratch; attention's
   q / k / v, then the largest of the q/k-norm scratch, ``rotate_half``, the KV codec's
   encoding scratch, the attention output; Gated DeltaNet's projections, fp32 conv input
   and output, gates and gated norm; the MoE routing (fp32 softmax, top-k) and dispatch
   (the pairs sorted by expert; the expert input, gate/up and output buffers taken for all
   ``c`` rows, since one expert may get every token, and the fp32 combine); the dense MLP.

So the bytes in use are always region + stack: ``const_bytes`` is the region plus the
stack's few constants, view alignment and an allowance for torch's scalars
(:data:`OP_SCRATCH`); ``per_token_bytes`` is the residual stream plus the largest step's
bytes per token, the maximum over all steps of all layers (steps never overlap).

Each layer's token mixer is priced by its kind (:mod:`moefit.memory.layer_kinds`:
``LayerKind.region_bytes``, its fixed-region part, and ``LayerKind.step``, its stack), the
region's layouts the runtime takes by are :func:`moefit.memory.takes.attention_tile_takes`
and :func:`~moefit.memory.takes.delta_block_takes`, and the region's size
:func:`fixed_region_bytes` is what the engine reserves for every chunk. MLA layers
(DeepSeek-V2 §2.1) run in the absorbed form, as one KV head over the cached latent rows
(``Latent.attention_dims``). The measured peak of a chunk, every tensor counted, is at
most the model and within 2.5% of it from 256 tokens up, 0.2% at 16384
(tests/runtime/test_staging_bound.py, docs/validation.md).

A calibration measured on the device (``moefit calibrate``,
:mod:`moefit.memory.calibration`) replaces the two numbers when there is one.
"""

from __future__ import annotations

import functools
import math

from moefit.ingest.geometry import LayerSpec, ModelGeometry, Routing
from moefit.memory import cpu_kernels, gpu_kernels
from moefit.memory.kv import KVFormat
from moefit.memory.layer_kinds import is_kv_b, kind_of
from moefit.memory.takes import (
    ATTN_KV_BLOCK, ATTN_Q_BLOCK, FP32, INT64, WORKSPACE_ALIGN, Step, Take, span, take_bytes,
)
from moefit.records import record

ALIGN_SLACK = 32 * WORKSPACE_ALIGN   #: alignment of the stack's views (at most ~25 live)
#: torch's own scalars and small results outside the workspace, and on CUDA the caching
#: allocator's 512-byte rounding of what the measurement mirrors
OP_SCRATCH = 64 << 10
#: Elements dequantized per kernel call when a stored (GGUF) expert runs
#: (``moefit.runtime.kernels.quant``).
DEQUANT_TILE_ELEMS = 1 << 20
#: Block-scaled fp8 weights of Hugging Face checkpoints (``quant_method: fp8``), held as
#: stored (``moefit.runtime.kernels.quant.FP8``): e4m3 values with an fp32 scale per block,
#: dequantized a tile at a time (:func:`fp8_tile_elems`, its scratch :func:`fp8_scratch_bytes`).
FP8_TYPE = "F8_E4M3"
#: Scratch bytes per element of one tile that each kernel of ``moefit.runtime.kernels.quant``
#: allocates beside its output (fp32 values, unpacked integers, scales), by ggml type.
#: Measured with the PyTorch profiler on a full tile (F16 / BF16 4.00, Q8_0 4.13, Q4_0 4.63,
#: Q4_1 8.25, Q5_0 9.13, Q5_1 9.25, IQ4_NL 12.13, Q4_K 13.33, Q5_K 14.33, Q6_K 11.50,
#: MXFP4 14.25) and rounded up to a quarter byte; tests/runtime/test_staging_bound_gguf.py
#: re-measures every kernel against this table. One figure for all types (12) over-priced
#: Q8_0 staging by 17% at 512-token chunks and under-priced the K-quants and MXFP4. The C
#: kernels of a CPU device (:mod:`moefit.memory.cpu_kernels`) allocate no scratch at all.
DEQUANT_SCRATCH_BYTES_PER_ELEM: dict[str, float] = {
    "F32": 0.0, "F16": 4.0, "BF16": 4.0, "Q8_0": 4.25, "Q4_0": 4.75, "Q4_1": 8.25,
    "Q5_0": 9.25, "Q5_1": 9.25, "IQ4_NL": 12.25, "Q4_K": 13.5, "Q5_K": 14.5, "Q6_K": 11.5,
    "MXFP4": 14.5,
    # dequantized through gguf's numpy reference (``quant._gguf_reference``): its arrays,
    # measured with tracemalloc (8.13-8.19 per element, every type)
    **{t: 8.25 for t in ("Q2_K", "Q3_K", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
                         "IQ1_S", "IQ1_M")},
}
@record
class StagingModel:
    """``bytes(c) = const_bytes + per_token_bytes * c`` for a chunk of ``c`` tokens.

    ``terms``: (name, const_bytes, per_token_bytes) of each component, for ``--verbose``.
    ``fixed_bytes``: the part of ``const_bytes`` that is the runtime's fixed region.
    ``calibrated``: the two numbers were fitted to peaks measured on the device
    (``moefit calibrate``, :mod:`moefit.memory.calibration`), not derived.
    """

    const_bytes: int
    per_token_bytes: int
    terms: tuple[tuple[str, int, int], ...]
    fixed_bytes: int = 0
    calibrated: bool = False

    def bytes(self, chunk: int) -> int:
        """Staging bytes for a chunk of ``chunk`` tokens."""
        return self.const_bytes + self.per_token_bytes * chunk


def compute_bytes(geom: ModelGeometry) -> int:
    """Bytes per element of the compute dtype: the model's 16/32-bit dtype, else 2 (bf16)."""
    return geom.dtype_bytes if geom.dtype_bytes in (2, 4) else 2


def fp8_dense_tensors(geom: ModelGeometry) -> list:
    """The non-expert weights held as block-scaled fp8 (:data:`FP8_TYPE`): the 2-D
    quantizable tensors of the roles an fp8 ``quantization_config`` covers
    (:class:`moefit.ingest.geometry.Quantization`); none for another method. A dense one
    is dequantized whole into the fixed region when used (``moefit.runtime.kernels.quant.Fp8Matrix``),
    MLA's ``kv_b_proj`` into the attention step's stack (it is read before and after the
    attention tiles)."""
    if geom.quant.method != "fp8":
        return []
    ts = list(geom.global_tensors) + [t for l in geom.layers for t in l.tensors]
    return [t for t in ts if geom.quant.dense_fp8(t)]


def fp8_tile_elems(rows: int, cols: int, block: tuple[int, int]) -> int:
    """Elements of one dequantization tile of a ``[rows, cols]`` fp8 matrix
    (``moefit.runtime.kernels.quant.dequantize_fp8``): a row block by at most
    ``DEQUANT_TILE_ELEMS / b0`` columns, a multiple of ``b1``."""
    b0, b1 = block
    width = max(b1, DEQUANT_TILE_ELEMS // b0 // b1 * b1)
    return min(b0, rows) * min(width, cols)


def fp8_scratch_bytes(rows: int, cols: int, block: tuple[int, int]) -> int:
    """The scratch ``moefit.runtime.kernels.quant.dequantize_fp8`` allocates beside its output for
    a ``[rows, cols]`` matrix: the fp32 copy of one tile (:func:`fp8_tile_elems`) and the
    tile's row of scales, repeated over its blocks' columns (fp32). Measured with the
    PyTorch profiler to the byte (tests/runtime/test_mla_and_glm.py)."""
    b0, b1 = block
    tile = fp8_tile_elems(rows, cols, block)
    width = tile // min(b0, rows)
    return FP32 * tile + FP32 * -(-width // b1) * b1


def fp8_dense_scratch(geom: ModelGeometry) -> int:
    """The dequantization scratch of the largest dense fp8 matrix (allocated beside the
    workspace while a matrix is dequantized): 0 without fp8 weights."""
    shapes = {t.shape for t in fp8_dense_tensors(geom)}     # each distinct shape priced once
    return max((fp8_scratch_bytes(*shape, geom.quant.block_size) for shape in shapes), default=0)


def grouped_route_takes(t: int, e: int, k: int, r: Routing, act_fp32: bool) -> list[Take]:
    """The stack takes of the grouped router for ``t`` tokens of ``e`` experts, top-``k``,
    routing ``r`` (``moefit.runtime.moe.routing.route_grouped`` takes its buffers by this list,
    in order): the fp32 copy of the logits (unless ``act_fp32``), the fp32 scores; unless
    ``greedy``, the choice scores, and when groups are dropped the group scores (with the
    top-2 values and indices of ``noaux_tc``), the kept groups' indices and scores and the
    dropped-group mask; the top-k values of the choice (``noaux_tc``); the renormalising
    sum."""
    g, tg = r.n_group, r.topk_group
    takes: list[Take] = [] if act_fp32 else [(t * e, "f32")]
    takes.append((t * e, "f32"))
    if r.method != "greedy":
        takes.append((t * e, "f32"))
        if tg < g:
            takes.append((t * g, "f32"))
            if r.method == "noaux_tc":
                takes += [(t * g * 2, "f32"), (t * g * 2, "i64")]
            takes += [(t * tg, "i64"), (t * tg, "f32"), (t * g, "bool")]
        if r.method == "noaux_tc":
            takes.append((t * k, "f32"))
    return takes + [(t, "f32")]


def _mixer_terms(layer: LayerSpec, geom: ModelGeometry, fmt: KVFormat,
                 act: int) -> tuple[int, int]:
    """(const, per_token) bytes of one layer's token mixer (fixed region + stack), from
    its kind (:meth:`moefit.memory.layer_kinds.LayerKind.region_bytes`, ``.step``)."""
    kind = kind_of(layer.attention)
    s = kind.step(layer, fmt, act, geom)
    return kind.region_bytes(layer.attention, fmt, act) + s.const, s.per_token


def expert_dequant_bytes(geom: ModelGeometry, act: int, c_kernels: bool = False) -> int:
    """Staging bytes running one stored (quantized, GGUF) expert takes: its largest matrix
    (``expert_intermediate x hidden``) dequantized into the compute dtype of ``act``
    bytes, plus its kernel's scratch for one tile of at most :data:`DEQUANT_TILE_ELEMS`
    elements (``moefit.runtime.kernels.quant``), by the layer's expert types
    (:data:`DEQUANT_SCRATCH_BYTES_PER_ELEM`; the largest entry for a type without one, or
    when the types are not known). With ``c_kernels`` (a CPU device where
    :func:`moefit.memory.cpu_kernels.expected`), a type the C kernels read dequantizes
    straight into that matrix and adds no scratch (fp32 / bf16 compute dtype; an fp16
    one still goes through torch). Block-scaled fp8 experts: the matrix plus
    :func:`fp8_scratch_bytes`. 0 for a model without MoE layers."""
    if geom.quant.method == "fp8" and geom.experts_stored:    # fp8 safetensors experts
        i_h = lambda l: (l.moe.expert_intermediate, geom.hidden_size)  # noqa: E731
        return max((l.moe.expert_intermediate * geom.hidden_size * act
                    + max(fp8_scratch_bytes(*i_h(l), geom.quant.block_size),
                          fp8_scratch_bytes(*reversed(i_h(l)), geom.quant.block_size))
                    for l in geom.moe_layers), default=0)
    types = geom.expert_types
    worst = max(DEQUANT_SCRATCH_BYTES_PER_ELEM.values())
    direct = c_kernels and geom.dtype in ("float32", "bfloat16")

    def scratch(t: str) -> float:
        if direct and t in cpu_kernels.CTYPES:
            return 0.0
        return DEQUANT_SCRATCH_BYTES_PER_ELEM.get(t, worst)

    dequant = 0
    for l in geom.moe_layers:
        mat = l.moe.expert_intermediate * geom.hidden_size
        per_elem = max((scratch(t) for t in types.get(l.index, ())), default=worst)
        dequant = max(dequant, mat * act + math.ceil(min(mat, DEQUANT_TILE_ELEMS) * per_elem))
    return dequant


def experts_fused(geom: ModelGeometry, device_kind: str) -> bool:
    """Whether every MoE layer's stored experts run on a device of ``device_kind`` as fused
    products on their stored blocks, nothing dequantized: a CUDA device where the Triton
    kernels are expected (:func:`moefit.memory.gpu_kernels.expected`) and read each layer's
    gate / up (rows of ``hidden`` values) and down (rows of ``expert_intermediate``) types
    (``moefit.runtime.kernels.quant.StoredExpert.fused``; gpt-oss's biased experts too,
    their biases added after: ``moefit.runtime.moe.gpt_oss``). Not block-scaled fp8 (no
    kernel: dequantized a tile at a time), nor a layer whose types are not known."""
    if not (geom.experts_stored and geom.moe_layers and gpu_kernels.expected(device_kind)):
        return False
    if geom.quant.method == "fp8":
        return False
    types, h = geom.expert_types, geom.hidden_size
    return all(len(types.get(l.index, ())) == 3
               and all(gpu_kernels.supports(t, c) for t, c in zip(types[l.index], (h, h, l.moe.expert_intermediate)))
               for l in geom.moe_layers)


def fixed_region_bytes(geom: ModelGeometry, fmt: KVFormat, q_block: int = ATTN_Q_BLOCK,
                       kv_block: int = ATTN_KV_BLOCK, slots: int = 1, fused: bool = False) -> int:
    """Bytes of the fixed region every chunk reserves at the bottom of the workspace (the
    engine reserves exactly this, ``moefit.runtime.model.Model.fixed_bytes``): the largest
    of one layer's token-mixer region (its kind's ``region_bytes``: attention tiles of
    ``q_block`` x ``kv_block`` tokens, MLA's over its latent head, a delta-rule block),
    the last-token logits of each of the ``slots`` sequences a
    batched step may hold (``[slots, V]`` fp32, and in the compute dtype first unless
    fp32: ``moefit.runtime.model.forward_batch``) and, for stored (GGUF, fp8) experts, one
    dequantized expert matrix (none when they are ``fused``: :func:`experts_fused`), and with
    block-scaled fp8 weights the largest of them
    dequantized (:func:`fp8_dense_tensors`). The layers use it one after another. ``q_block`` /
    ``kv_block`` below the defaults give the smaller region of smaller tiles (the engine's
    ``EngineOptions``)."""
    act = compute_bytes(geom)
    rows = max(1, slots) * geom.vocab_size
    fixed = span([rows * FP32] + ([rows * act] if act != FP32 else []))
    seen: dict = {}
    for layer in geom.layers:
        a = layer.attention
        if a not in seen:
            seen[a] = kind_of(a).region_bytes(a, fmt, act, q_block, kv_block)
        fixed = max(fixed, seen[a])
    if geom.experts_stored and not fused:
        fixed = max(fixed, span([_expert_matrix_bytes(geom, act)]))
    dense = [t.numel for t in fp8_dense_tensors(geom) if not is_kv_b(t)]
    if dense:       # the largest block-scaled fp8 matrix, dequantized when used
        fixed = max(fixed, span([max(dense) * act]))
    return fixed


def _expert_matrix_bytes(geom: ModelGeometry, act: int) -> int:
    return max((l.moe.expert_intermediate * geom.hidden_size for l in geom.moe_layers), default=0) * act


def _mlp_step(layer: LayerSpec, geom: ModelGeometry, act: int) -> Step:
    """The MLP (``moefit.runtime.moe.layer.moe_layer`` / ``swiglu_mlp``), stack per token.

    MoE: fp32 top-k weights and int64 ids, then the larger of the routing (router logits,
    their fp32 copy unless fp32, fp32 probabilities and the renormalising sum; a grouped
    router's takes, :func:`grouped_route_takes`) and the
    dispatch: the pairs' order (int64) and weights, then the larger of the sort's int64
    keys and the expert buffers, taken for all ``T`` rows since one expert may get every
    token: the fp32 combine accumulator, the input rows, the gate/up output, the output
    and its fp32 copy unless fp32 (the shared expert runs after, in the same room).
    Dense: gate and up outputs.
    """
    h, up = geom.hidden_size, 0 if act == FP32 else 1
    if layer.moe is None:
        return Step("dense MLP", 0, 2 * layer.dense_intermediate * act)
    m = layer.moe
    k, e = m.experts_per_token, m.num_experts
    if m.routing.grouped:   # the router logits, then the grouped router's takes
        route = e * act + sum(take_bytes(grouped_route_takes(1, e, k, m.routing, act == FP32), act))
    else:
        route = e * act + up * e * FP32 + e * FP32 + FP32
    buffers = h * FP32 + h * act + 2 * m.expert_intermediate * act + h * act + up * h * FP32
    dispatch = up * k * act + k * INT64 + k * act + max(k * INT64, buffers)
    shared = h * act + max(2 * m.shared_intermediate * act, act) if m.shared_intermediate else 0
    return Step("MoE dispatch", 2 * (e + 1) * INT64,
                 max(k * (FP32 + INT64) + max(route, dispatch), shared))


def staging_model(geom: ModelGeometry, fmt: KVFormat, slots: int = 1,
                  device_kind: str = "cuda") -> StagingModel:
    """Affine staging model of one prefill chunk for ``geom`` (see module docstring).

    Args:
        geom: model geometry.
        fmt: KV format (the codecs' scratch and the encoded rows depend on it).
        slots: concurrent sequences. A batched step (``moefit.runtime.model.forward_batch``)
            stacks the decode tokens of up to ``slots`` sequences and a prefill chunk, at
            most ``c`` tokens in all (the scheduler's token budget), so the per-token terms
            are those of one chunk; the per-sequence term is the last-token logits of
            every sequence, in the fixed region (:func:`fixed_region_bytes`).
        device_kind: ``cuda`` or ``cpu``: on a CPU device stored experts dequantize
            through the C kernels when they are expected (:mod:`moefit.memory.cpu_kernels`),
            without the torch kernels' scratch; on a CUDA device where they run as fused
            Triton products (:func:`experts_fused`) neither the dequantized matrix nor a
            kernel scratch is priced.

    Kept for the last few arguments (with what the environment decides: the C kernels
    expected, the experts fused): a failing plan re-solves one model a dozen times for its
    alternatives, and the per-layer steps were a quarter of that.
    """
    fused = experts_fused(geom, device_kind)
    c_kernels = bool(geom.experts_stored and not fused and cpu_kernels.expected(device_kind))
    try:
        hash(geom)
    except TypeError:       # a geometry with an unhashable field (a plug-in's): not kept
        return _staging_model.__wrapped__(geom, fmt, slots, device_kind, fused, c_kernels)
    return _staging_model(geom, fmt, slots, device_kind, fused, c_kernels)


@functools.lru_cache(maxsize=16)
def _staging_model(geom: ModelGeometry, fmt: KVFormat, slots: int, device_kind: str, fused: bool,
                   c_kernels: bool) -> StagingModel:
    """:func:`staging_model` with the environment's choices given (``fused``, ``c_kernels``)."""
    act = compute_bytes(geom)
    up = 0 if act == FP32 else 1
    h = geom.hidden_size
    att = next((l.attention for l in geom.layers if kind_of(l.attention).cells),
               geom.layers[0].attention)
    rot = att.rotary_dim or att.head_dim
    # residual stream (hidden, normed, layer output) and the RoPE cos / sin of the chunk
    residual = 3 * h * act + 2 * rot * act
    steps = [Step("RMSNorm", h * FP32, up * h * FP32 + h * FP32 + FP32),
             Step("RoPE tables", 0, FP32 + rot * FP32 + up * rot * FP32)]
    for layer in geom.layers:
        steps += [kind_of(layer.attention).step(layer, fmt, act, geom), _mlp_step(layer, geom, act)]
    fixed = fixed_region_bytes(geom, fmt, slots=slots, fused=fused)
    terms_extra: tuple = ()
    scratch = fp8_dense_scratch(geom)
    if geom.experts_stored and not fused:
        # quantized experts (GGUF, fp8, gpt-oss's mxfp4): one matrix dequantized at a time into
        # the fixed region; the kernels' fp32 scratch (bounded tiles) is allocated outside the workspace
        scratch = max(scratch, expert_dequant_bytes(geom, act, c_kernels) - _expert_matrix_bytes(geom, act))
        terms_extra = (("expert dequantization kernel scratch", scratch, 0),)
    elif scratch:    # fp8 dense weights only
        terms_extra = (("fp8 dequantization kernel scratch", scratch, 0),)
    top = max(steps, key=lambda s: s.per_token)
    terms = (
        ("residual stream and RoPE tables", 0, residual),
        ("fixed region: attention tiles / delta-rule blocks / logits", fixed, 0),
        (f"largest step: {top.name}", max(s.const for s in steps), top.per_token),
        ("view alignment and torch's own scratch", ALIGN_SLACK + OP_SCRATCH, 0),
    ) + terms_extra
    return StagingModel(sum(t[1] for t in terms), sum(t[2] for t in terms), terms,
                        fixed_bytes=fixed)


def expert_staging_model(geom: ModelGeometry, device_kind: str = "cuda") -> StagingModel:
    """The ``prefill`` line of a device that holds expert slots only (a secondary device
    of an expert split): the buffers its experts run in for one chunk, affine in the chunk.

    An expert it holds runs there on the tokens routed to it (up to every token of the
    chunk): their input rows copied from the main device, the gate/up output and the
    output (``(2 H + 2 I) x chunk`` in the compute dtype; ``moefit.runtime.moe.cache.ExpertCache``),
    and for a stored (GGUF) format one dequantized matrix in a fixed region, with its
    kernel's scratch (:func:`expert_dequant_bytes`). Plus the view alignment and torch's
    scratch, as on the main device. 0 for a model without MoE layers."""
    if not geom.moe_layers:
        return StagingModel(0, 0, ())
    act = compute_bytes(geom)
    inter = max(l.moe.expert_intermediate for l in geom.moe_layers)
    fixed = expert_fixed_region_bytes(geom)
    terms = [("expert input, gate/up and output rows", 0,
              (2 * geom.hidden_size + 2 * inter) * act),
             ("fixed region: one dequantized expert matrix", fixed, 0),
             ("view alignment and torch's own scratch", ALIGN_SLACK + OP_SCRATCH, 0)]
    if fixed:
        c_kernels = cpu_kernels.expected(device_kind)
        scratch = max(0, expert_dequant_bytes(geom, act, c_kernels) - _expert_matrix_bytes(geom, act))
        terms.append(("expert dequantization kernel scratch", scratch, 0))
    return StagingModel(sum(t[1] for t in terms), sum(t[2] for t in terms), tuple(terms),
                        fixed_bytes=fixed)


def expert_fixed_region_bytes(geom: ModelGeometry) -> int:
    """The fixed region of an expert-only device's workspace: one dequantized expert
    matrix for a stored (GGUF, fp8, mxfp4) format, else 0 (bytes)."""
    if geom.experts_stored and geom.moe_layers:
        return span([_expert_matrix_bytes(geom, compute_bytes(geom))])
    return 0
