"""llama.cpp's memory model: what ``llama-server`` allocates for a GGUF model, line by line.

Read from llama.cpp's source at commit 0c1e570 (the CPU tools of the benchmarks; the llama.cpp
vendored in the ``llama-cpp-python`` 0.3.36 sdist), file and function named at each formula:

- **model buffers** (``llama-model.cpp``, ``load_tensors``): each buffer type gets one
  buffer from ``ggml_backend_alloc_ctx_tensors_from_buft`` (``ggml-alloc.c``), the sum of
  ``GGML_PAD(get_alloc_size(t), alignment)`` over its tensors. Alignment: 32 B on the CPU
  (``TENSOR_ALIGNMENT``, ``ggml-impl.h``), 128 B on CUDA
  (``ggml_backend_cuda_buffer_type_get_alignment``); CUDA also pads every quantized tensor's
  last row to a multiple of 512 elements (``ggml_backend_cuda_buffer_type_get_alloc_size``,
  ``MATRIX_ROW_PADDING``). The token embeddings always stay on the CPU ("there is very little
  benefit to offloading the input layer", ``llama_model::load_tensors``); ``--n-cpu-moe K``
  keeps the tensors matching ``blk.<i>.ffn_(up|down|gate|gate_up)_(ch|)exps`` of layers
  ``i < K`` on the CPU (``common/arg.cpp``, ``llm_add_n_cpu_ffn_overrides`` with
  ``LLM_FFN_EXPS_REGEX``). Everything else is offloaded with ``-ngl 999``.
- **KV cache** (``llama-context.cpp``, ``llama_context::llama_context``: ``n_ctx`` is padded to
  256; ``llama-kv-cache.cpp``, ``llama_kv_cache::llama_kv_cache``): per attention layer one K
  tensor ``[n_embd_k_gqa, kv_size]`` and one V tensor ``[n_embd_v_gqa, kv_size]`` of the cache
  types (``ggml_row_size``), no V for MLA (``has_v = !is_mla``). Sliding-window layers get
  their own cache of ``GGML_PAD(min(kv_size, n_swa + n_ubatch), 256)`` cells
  (``llama-kv-cache-iswa.cpp``, ``llama_kv_cache_iswa::llama_kv_cache_iswa``).
- **recurrent state** (``llama-memory-recurrent.cpp``; sizes ``llama_hparams::n_embd_r`` /
  ``n_embd_s``): per linear-attention layer and sequence, f32 conv state
  ``(d_conv - 1) x (d_inner + 2 n_group d_state)`` and SSM state ``d_state x d_inner``.
- **compute buffer** (``llama-context.cpp``, ``llama_context::sched_reserve`` /
  ``graph_reserve``): the graph of one full micro-batch (``-ub`` tokens, of which
  ``n_outputs_max`` are output: llama-server's ``server_output_limits``
  (``tools/server/server-context.cpp``) gives ``common_speculative_get_output_limits``'s
  ``min(n_batch, n_parallel x (1 + n_draft))``, ``-np`` outputs without a draft model, and
  llama-server prints ``n_outputs_max = 1`` with ``-np 1``; ``llama-completion`` outputs all
  ``-ub``) with the memory full (``init_full``: the KQ mask is
  ``[n_kv, n_ubatch]`` f16 with ``n_kv`` the whole cache). ggml's allocator reuses memory, so
  the buffer is the larger of two phases: the end of the graph, where the logits
  ``n_vocab x n_outputs x 4`` B are live with the last hidden states, and a layer, where the
  KQ masks, the attention and MoE activations are live (an upper bound per token, checked
  against the recorded runs). On CUDA a flash-attention node with a K/V cache that is not
  F16 also holds K and V converted to F16: the tile and MMA kernels a micro-batch uses need
  F16 (``ggml_cuda_flash_attn_ext_get_alloc_size``, ``fattn.cu``), and the copies are part
  of the node's alloc size (``ggml_cuda_flash_attn_ext_get_f16_extra_data``,
  ``fattn-common.cuh``): ``2 x n_kv x n_embd_{k,v}_gqa`` bytes each, inside the printed
  ``CUDA0 compute buffer`` since ggml-org/llama.cpp#23907 (May 2026; before it they came from
  the CUDA pool at the first prefill, ``ggml_cuda_pool_alloc<half> K_f16(pool)``, on top of the
  printed buffer, which this model does not price). And with experts kept on
  the CPU (``--n-cpu-moe K > 0``) a micro-batch of 32 tokens or more runs their matrix
  products on the GPU anyway (``op_offload``; ``ggml_backend_cuda_device_offload_op``,
  ``GGML_OP_OFFLOAD_MIN_BATCH`` = 32): the scheduler copies each such weight into the
  compute buffer, one split per weight so the copies reuse one region
  (``ggml_backend_sched_split_graph``, ``ggml-backend.cpp``): the largest expert tensor.
- **host**: the CPU model buffer (token embeddings, experts kept on the CPU), the output buffer
  ``n_vocab x n_seq x 4`` B (``llama_context::output_reserve``) and the embedding lookup's
  compute buffer are host memory, shown below the table, not on the device.

Validated on the CPU backend against recorded llama.cpp runs (``tests/data/llamacpp``,
``benchmarks/record_llamacpp.py``): model and KV buffers to the printed precision, compute
buffer within 5%. On CUDA, checked against published field logs
(``tests/test_llamacpp_cuda_logs.py``, ``tests/data/llamacpp_cuda``): the KV cache (full and
sliding-window, one and two streams) and the recurrent state to the printed precision, one
compute buffer of a newer build within 6%; the CUDA model-buffer rules above (row padding,
alignment) and the expert-tensor copy come from the source and are not measured.
"""

from __future__ import annotations

import re
from functools import cached_property

from moefit.devices import Device
from moefit.errors import InputError
from moefit.ingest.geometry import ModelGeometry
from moefit.ingest.ggml_types import BLOCKS
from moefit.ingest.gguf_mix import llamacpp_tensors
from moefit.memory.layer_kinds import Latent, Recurrent, kind_of
from moefit.records import record
from moefit.units import format_bytes


#: ``-ub`` grid when the micro-batch is clamped (tokens)
UB_GRID = 64
#: llama.cpp's defaults (``common/common.h``): ``n_batch`` 2048, ``n_ubatch`` 512, K and V
#: caches ``f16`` (``cache_type_k`` / ``cache_type_v``)
DEFAULT_UBATCH = 512
DEFAULT_BATCH = 2048
DEFAULT_KV = "f16"
#: ``LLAMA_MAX_SEQ`` (``llama-cparams.h``): a context refuses more sequences ("n_seq_max must
#: be <= 256", ``llama_init_from_model``)
MAX_SEQ = 256
#: ``-c`` is read as an ``int`` (``common/arg.cpp``, ``std::stoi``): at most 2^31 - 1 tokens
MAX_CTX = 2**31 - 1
#: ``n_ctx`` and SWA cache padding (``llama-context.cpp``, ``llama-kv-cache-iswa.cpp``)
CTX_PAD = 256
#: the padding of builds before the 256 cells became unconditional, without flash attention
#: (``llama_kv_cache_unified::get_padding``: ``flash_attn ? 256u : 32u``); moefit's commands
#: run ``-fa on``, so plans use :data:`CTX_PAD`; older logs are read with this one
CTX_PAD_NO_FA = 32
MATRIX_ROW_PADDING = 512
_EXPS = re.compile(r"^blk\.(\d+)\.ffn_(up|down|gate|gate_up)_(ch|)exps")

#: ggml block size and bytes per block of the KV cache types llama.cpp accepts (``-ctk``;
#: :data:`moefit.ingest.ggml_types.BLOCKS`)
KV_TYPE_SIZES = {t: BLOCKS[t.upper()] for t in ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl",
                                                "q5_0", "q5_1")}
#: moefit's ``--kv`` formats as llama.cpp cache types (K, V); fp8 has no llama.cpp type: q8_0
KV_FROM_MOEFIT = {"bf16": ("bf16", "bf16"), "fp16": ("f16", "f16"), "fp32": ("f32", "f32"),
                  "fp8": ("q8_0", "q8_0"), "int8": ("q8_0", "q8_0"), "k8v4": ("q8_0", "q4_0"),
                  "int4": ("q4_0", "q4_0")}
#: largest first: the ``--kv`` alternative is the closest smaller pair of types that fits
KV_ORDER = ("f32", "bf16", "q8_0", "k8v4", "q5_1", "q5_0", "q4_1", "q4_0")


def kv_types(name: str) -> tuple[str, str]:
    """``--kv`` (moefit's names or llama.cpp's ``-ctk`` names) -> (K type, V type).

    Raises InputError naming ``--kv`` and the accepted names."""
    n = name.strip().lower()
    if n in KV_FROM_MOEFIT:
        return KV_FROM_MOEFIT[n]
    if n in KV_TYPE_SIZES:
        return n, n
    raise InputError(f"--kv {name!r} with --engine llama.cpp: use one of "
                     f"{', '.join(KV_FROM_MOEFIT)} or llama.cpp's {', '.join(KV_TYPE_SIZES)}")


def kv_row_bytes(kind: str, n: int) -> int:
    """``ggml_row_size`` of ``n`` elements of cache type ``kind`` (bytes)."""
    bs, ts = KV_TYPE_SIZES[kind]
    return ts * n // bs


def pad_to(n: int, to: int) -> int:
    """``GGML_PAD(n, to)``: ``n`` rounded up to a multiple of ``to``."""
    return -(-n // to) * to


def pad_cells(context: int) -> int:
    """A sequence's cells: ``context`` padded to llama.cpp's 256 (``llama-context.cpp``)."""
    return pad_to(context, CTX_PAD)


@record
class Backend:
    """Allocation rules of a ggml backend's buffers: ``alignment`` (bytes), quantized rows
    padded to ``row_padding`` elements (0: none), flash attention converting a non-F16 K/V to
    F16 inside its node (``fa_f16``), products with weights in host memory run here with a
    copy of the weight (``op_offload``)."""

    name: str
    alignment: int
    row_padding: int = 0
    fa_f16: bool = False
    op_offload: bool = False


CPU = Backend("CPU", 32)
CUDA = Backend("CUDA0", 128, MATRIX_ROW_PADDING, fa_f16=True, op_offload=True)


@record
class Tensor:
    """A GGUF tensor: ``name``, ggml ``kind`` (``Q4_K``...), ``ne`` (innermost first), ``nbytes``."""

    name: str
    kind: str
    ne: tuple[int, ...]
    nbytes: int

    def alloc_bytes(self, backend: Backend) -> int:
        """Bytes this tensor takes in a ``backend`` buffer: ``get_alloc_size`` padded to the
        alignment (see the module docstring)."""
        size = self.nbytes
        if backend.row_padding and self.kind not in ("F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64"):
            rest = self.ne[0] % backend.row_padding
            if rest:   # + ggml_row_size(type, MATRIX_ROW_PADDING - ne0 % MATRIX_ROW_PADDING)
                size += ggml_row_bytes(self.kind, backend.row_padding - rest)
        return pad_to(size, backend.alignment)


def ggml_row_bytes(kind: str, n: int) -> int:
    """``ggml_row_size``: bytes of ``n`` elements of ggml type ``kind`` (``Q4_K``...), from
    ggml's block sizes (:data:`moefit.ingest.ggml_types.BLOCKS`; a failing plan's llama.cpp
    alternative prices its buffers by this without importing the ``gguf`` package and numpy,
    a third of a second). Raises KeyError for a type ggml does not have."""
    bs, ts = BLOCKS[kind]
    return ts * n // bs


def tensors_from_header(path: str) -> list[Tensor]:
    """The tensor infos of a GGUF file (every shard), from its header only."""
    from moefit.ingest.gguf_header import read_header     # only a GGUF file's plan reads a header

    h = read_header(path)
    return [Tensor(t.name, t.ggml_type, tuple(t.ne), t.nbytes) for t in h.tensors.values()]


def tensors_from_geometry(geom: ModelGeometry, ftype: str) -> tuple[list[Tensor], str]:
    """The tensors of the GGUF ``llama-quantize FTYPE`` would write for the Hugging Face model
    ``geom`` (:func:`moefit.ingest.gguf_mix.llamacpp_tensors`), and a note saying so."""
    infos, unknown = llamacpp_tensors(geom, ftype)
    tensors = [Tensor(t.name, t.kind, t.ne, t.nbytes) for t in infos]     # each priced once
    note = (f"model: the GGUF of convert_hf_to_gguf.py + llama-quantize {ftype} (--gguf-type), derived from "
            f"the config, {format_bytes(sum(t.nbytes for t in tensors))}")
    if unknown:
        note += f"; {unknown} tensors without a llama.cpp name priced at the mix's default type"
    return tensors, note


def expert_layer(name: str) -> int | None:
    """The layer of an expert tensor ``--n-cpu-moe`` moves (its regex), or None."""
    m = _EXPS.match(name)
    return int(m.group(1)) if m else None


@record
class ModelBuffers:
    """Model bytes with ``-ngl 999 --n-cpu-moe 0``: ``device`` (non-expert tensors but the
    token embeddings), ``experts`` per layer (on the device unless ``--n-cpu-moe``), ``host``
    (token embeddings), each in its backend's allocation."""

    device: int
    experts: tuple[tuple[int, int], ...]          # (layer, device bytes), layer order
    experts_host: tuple[tuple[int, int], ...]     # (layer, CPU bytes)
    host: int
    largest_expert_tensor: int = 0                # device bytes of the largest expert tensor
    repack: int = 0                               # CPU_REPACK bytes of a CPU-only load (repack_bytes)


def model_buffers(tensors: list[Tensor], backend: Backend) -> ModelBuffers:
    """Price ``tensors`` on ``backend`` (llama-model.cpp ``load_tensors``, see module docstring)."""
    dev = host = 0
    experts: dict[int, int] = {}
    experts_host: dict[int, int] = {}
    largest = 0
    for t in tensors:
        layer = expert_layer(t.name)
        if t.name.startswith("token_embd."):
            host += t.alloc_bytes(CPU)
        elif layer is not None:
            experts[layer] = experts.get(layer, 0) + t.alloc_bytes(backend)
            largest = max(largest, t.alloc_bytes(backend))
            experts_host[layer] = experts_host.get(layer, 0) + t.alloc_bytes(CPU)
        else:
            dev += t.alloc_bytes(backend)
    emb = next((t for t in tensors if t.name == "token_embd.weight"), None)
    if emb is not None and not any(t.name == "output.weight" for t in tensors):
        # tied embeddings: the output layer loads token_embd again, on its own device
        # (llama_model::load_tensors, TENSOR_DUPLICATED)
        dev += emb.alloc_bytes(backend)
    return ModelBuffers(dev, tuple(sorted(experts.items())), tuple(sorted(experts_host.items())), host, largest,
                        repack_bytes(tensors))


#: ggml types the CPU backend repacks on x86-64 (``ggml_repack_get_optimal_repack_type``,
#: ``ggml-cpu/repack.cpp``): with AVX2 ``Q4_0`` / ``Q4_K`` / ``IQ4_NL`` / ``MXFP4`` into 8x8
#: interleaved blocks, when the tensor's rows ``ne[1]`` are a multiple of 8 (``Q2_K`` too with
#: AVX-512, and ARM repacks other types: not priced). Every x86-64 machine the CPU build is
#: measured on has AVX2 (``REPACK = 1`` in its ``system_info``).
REPACK_TYPES = frozenset({"Q4_0", "Q4_K", "IQ4_NL", "MXFP4"})


def repack_bytes(tensors: list[Tensor]) -> int:
    """The ``CPU_REPACK model buffer`` of a CPU-only load (bytes; 0 with ``--no-repack``, not
    priced here).

    ``make_cpu_buft_list`` (``llama-model.cpp``) puts the CPU's extra buffer types before the
    plain CPU type, and ``select_weight_buft`` gives a weight the first type whose backend
    supports the weight's op: the repack type's ``extra_buffer_type::supports_op`` accepts a
    ``MUL_MAT`` with a 2-D weight or a ``MUL_MAT_ID`` with a 3-D one of a type
    :data:`REPACK_TYPES` repacks (the token embeddings are read by ``GET_ROWS`` and stay mapped).
    The buffer is a plain host allocation (``ggml_backend_cpu_repack_buffer_type_alloc_buffer``
    over the CPU type) of ``ggml_nbytes`` per tensor (its ``get_alloc_size`` is the default),
    aligned to ``TENSOR_ALIGNMENT`` (32 B), beside the mapped file, whose range still covers
    these tensors (the recorded ``CPU_Mapped`` buffer is the whole file)."""
    return sum(t.alloc_bytes(CPU) for t in tensors
               if t.kind in REPACK_TYPES and len(t.ne) in (2, 3) and t.ne[1] % 8 == 0
               and not t.name.startswith("token_embd."))


def cpu_model_buffer(tensors: list[Tensor]) -> int:
    """The one ``CPU model buffer`` of a CPU-only load without mmap (``-lm none``) and without
    repacking (``-nr``): every tensor in the 32-byte-aligned CPU buffer (bytes)."""
    return sum(t.alloc_bytes(CPU) for t in tensors)


# ---- KV cache, recurrent state ---------------------------------------------------------------
@record
class KVPrice:
    """KV cache and recurrent state of one context (bytes; cells in tokens)."""

    n_ctx: int                  # all streams
    cells: int                  # full-attention cells per stream (kv_size)
    swa_cells: int              # sliding-window cells per stream (0: no SWA layers)
    full_layers: int
    swa_layers: int
    bytes_full: int
    bytes_swa: int
    recurrent_layers: int
    recurrent_bytes: int
    k_dims: tuple[int, ...] = ()      # n_embd_k_gqa of each attention layer
    v_dims: tuple[int, ...] = ()
    n_seq: int = 1                    # streams (-np)

    @property
    def kv_bytes(self) -> int:
        return self.bytes_full + self.bytes_swa


def _layer_kv_dims(spec) -> tuple[int, int]:
    """(n_embd_k_gqa, n_embd_v_gqa) of an attention layer (V 0 for MLA)."""
    if isinstance(kind_of(spec), Latent):
        return spec.kv_lora_rank + spec.qk_rope_head_dim, 0
    return spec.num_kv_heads * spec.head_dim, spec.num_kv_heads * (spec.v_head_dim or spec.head_dim)


@record
class LayerFigures:
    """The per-layer figures of a model that :func:`kv_price` and :func:`compute_price` sum
    or take the largest of, independent of the context, micro-batch and cache types (read
    once per model: a failing plan's alternatives and the largest-context search price one
    model some 30 times). Layers with the same figures are grouped, in layer order of first
    appearance; a sum over a group is its count times one layer's term, the same integers.

    ``attention``: ((n_embd_k_gqa, n_embd_v_gqa, sliding window or 0), layers) of the attention
    layers (V 0 for MLA); ``last_window``: the window of the last sliding layer (0: none);
    ``k_dims`` / ``v_dims``: each attention layer's, in order; ``recurrent``: ((conv state
    elements ``r``, delta-rule state elements ``s``) per sequence, layers); ``activation``:
    the largest per-token activation of a layer (elements; :func:`compute_price`'s ``4 ub`` x
    the larger of the token mixer and the FFN)."""

    attention: tuple[tuple[tuple[int, int, int], int], ...]
    last_window: int
    k_dims: tuple[int, ...]
    v_dims: tuple[int, ...]
    recurrent: tuple[tuple[tuple[int, int], int], ...]
    activation: int


def _count(items: list) -> tuple:
    counts: dict = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    return tuple(counts.items())


def layer_figures(geom: ModelGeometry, only: frozenset[int] | None = None) -> LayerFigures:
    """The :class:`LayerFigures` of ``geom``'s layers (``only``: those indices; None: every
    layer). The formulas are :func:`kv_price`'s and :func:`compute_price`'s (their docstrings
    give the sources)."""
    h = geom.hidden_size
    att, rec, kd, vd = [], [], [], []
    last_window = act = 0
    for il, layer in enumerate(geom.layers):
        if only is not None and il not in only:
            continue
        a = layer.attention
        kind = kind_of(a)
        qkv = 0                     # the attention's Q, K, V rows (the MoE term below)
        if isinstance(kind, Recurrent):      # conv in/out, q/k/v, gate, the delta rule's 64-token blocks
            d_inner = a.linear_num_value_heads * a.linear_value_head_dim
            rec.append(((a.linear_conv_kernel - 1) * (d_inner + 2 * a.linear_num_key_heads * a.linear_key_head_dim),
                        a.linear_key_head_dim * d_inner))
            mix = 2 * h + 2 * a.linear_conv_dim + 3 * d_inner + 4 * 64 * a.linear_num_value_heads
        else:                       # Q (twice: projected, roped), K, V (twice), the output
            k, v = _layer_kv_dims(a)
            kd.append(k)
            vd.append(v)
            window = kind.masked_window(a) or 0    # a sliding window (chunked layers: priced full)
            if window:
                last_window = window
            att.append((k, v, window))
            mix = 2 * h + 3 * a.num_heads * (a.head_dim or 0) + 2 * k + 2 * (v or k)
            qkv = a.num_heads * (a.head_dim or 0) + k + (v or k)
        if layer.moe is not None:   # the GLU of the top-k experts (see compute_price), the shared expert
            m = layer.moe
            top = m.experts_per_token
            ffn = max(3 * top * m.expert_intermediate + 2 * h + qkv + 2 * top, 2 * h + 3 * m.shared_intermediate)
        else:
            ffn = h + 3 * (layer.dense_intermediate or 0)
        act = max(act, mix, ffn)
    return LayerFigures(_count(att), last_window, tuple(kd), tuple(vd), _count(rec), act)


def kv_price(geom: ModelGeometry, context: int, ubatch: int, type_k: str, type_v: str,
             backend: Backend, n_seq: int = 1, only: frozenset[int] | None = None,
             pad: int = CTX_PAD, figures: LayerFigures | None = None) -> KVPrice:
    """KV cache and recurrent state of ``geom`` for llama.cpp's ``-c context -ub ubatch -np
    n_seq`` with cache types ``type_k`` / ``type_v`` (see module docstring for the sources).

    ``-c`` is the total: ``n_ctx = pad(context, 256)``, and with ``n_seq`` slots each gets its
    own stream (``kv_unified`` is off when ``-np`` is given) of ``n_ctx_seq = pad(n_ctx /
    n_seq, 256)`` cells (``llama_context::llama_context``); a sliding-window stream holds
    ``pad(min(n_ctx_seq, n_swa + ub), 256)`` cells; the recurrent state has one row per
    sequence. Each K / V / state tensor is padded to the backend's alignment. ``cells`` and
    ``swa_cells`` are per stream, as llama.cpp prints them. ``only``: the layers (indices) of
    one device of a layer split, each layer's cache being on its layer's device
    (``llama_kv_cache``: ``model.dev_layer(il)``); None: every layer. ``pad``: the cell
    padding (:data:`CTX_PAD`; :data:`CTX_PAD_NO_FA` for an older build without flash
    attention). ``figures``: ``layer_figures(geom, only)`` when the caller has them
    (a :class:`PricedModel`'s ``figures``)."""
    if n_seq < 1:
        raise InputError(f"-np {n_seq}: need at least one sequence")
    f = figures if figures is not None else layer_figures(geom, only)
    n_ctx_seq = pad_to(pad_to(context, pad) // n_seq, pad) if n_seq > 1 else pad_to(context, pad)
    full = swa = rec = 0
    nf = ns = nr = 0
    al = backend.alignment
    for (r, st), n in f.recurrent:
        rec += n * (pad_to(4 * r * n_seq, al) + pad_to(4 * st * n_seq, al))
        nr += n
    for (k, v, window), n in f.attention:
        if window:
            cells = pad_to(min(n_ctx_seq, window + ubatch), CTX_PAD)
            swa += n * (pad_to(kv_row_bytes(type_k, k * cells) * n_seq, al) + (
                pad_to(kv_row_bytes(type_v, v * cells) * n_seq, al) if v else 0))
            ns += n
        else:
            full += n * (pad_to(kv_row_bytes(type_k, k * n_ctx_seq) * n_seq, al) + (
                pad_to(kv_row_bytes(type_v, v * n_ctx_seq) * n_seq, al) if v else 0))
            nf += n
    swa_cells = pad_to(min(n_ctx_seq, f.last_window + ubatch), CTX_PAD) if f.last_window else 0
    return KVPrice(n_ctx_seq * n_seq, n_ctx_seq if nf else 0, swa_cells, nf, ns, full, swa, nr, rec,
                   f.k_dims, f.v_dims, n_seq)


# ---- compute buffer ------------------------------------------------------------------------------
@record
class ComputePrice:
    """The device compute buffer of one micro-batch (bytes) and its two phases."""

    bytes: int
    logits: int
    end_phase: int
    layer_phase: int
    mask: int
    fa_f16: int
    weight_copy: int = 0


#: ``GGML_OP_OFFLOAD_MIN_BATCH``: the smallest micro-batch whose products with weights in host
#: memory run on the GPU (``ggml-cuda.cu``)
OP_OFFLOAD_MIN_BATCH = 32


def compute_price(geom: ModelGeometry, n_vocab: int, ubatch: int, kv: KVPrice, type_k: str,
                  type_v: str, backend: Backend, host_weight: int = 0,
                  n_outputs: int | None = None, only: frozenset[int] | None = None,
                  output: bool = True, figures: LayerFigures | None = None) -> ComputePrice:
    """Compute buffer of a ``ubatch``-token micro-batch (``graph_reserve`` with ``n_outputs``
    tokens output, None: all of them, as ``llama-completion``; llama-server: ``-np``; see the
    module docstring). Bytes:

    - end of the graph: ``4 (n_out n_vocab + ub (3 n_embd + 1))`` (logits of the ``n_out =
      min(n_outputs, ub)`` outputs, the last hidden states and their norm, ``out_ids``);
    - a layer: the KQ masks ``2 ub n_kv`` (f16; one per cache, alive through every layer) +
      ``4 ub`` x the larger of the token mixer (attention: ``2 n_embd + 3 q + 2 k + 2 v``;
      Gated DeltaNet: ``2 n_embd + 2 conv + 3 d_inner + 256 n_v_heads``) and the FFN (MoE:
      ``3 top_k n_ff_exp + 2 n_embd + (q + k + v) + 2 top_k``; shared expert ``2 n_embd + 3 n_ff_shexp``)
      + on CUDA the F16
      copies of a non-F16 K and V (``2 n_kv n_embd_{k,v}_gqa``) + on CUDA, when
      ``ubatch >= 32``, the copy of the largest weight kept in host memory (``host_weight``
      bytes: an expert tensor under ``--n-cpu-moe``). The per-token terms were matched to the
      recorded runs (a 259-token vocabulary model isolates them).

    The MoE term, from ``llm_graph_context::build_moe_ffn`` (``llama-graph.cpp``) and
    ``ggml_gallocr_alloc_graph_impl`` (``ggml-alloc.c``): the up and gate products
    (``MUL_MAT_ID``, ``[n_ff_exp, top_k]`` per token each) are live when their GLU
    (``ggml_swiglu_split`` / ``ggml_swiglu_oai``, ``GGML_OP_GLU``) is allocated, and a GLU is
    not an op ``ggml_op_can_inplace`` lets reuse its input: ``3 top_k n_ff_exp``; the routing
    weights and the selected experts (``top_k`` each) live to the weighting; the hidden rows:
    the residual ``ffn_inp`` (kept for the closing add) and the normed input (freed after the
    gate product, a hole of one row the GLU's ``top_k`` rows do not fit): ``2 n_embd``; and
    the rows of the attention's Q, K and V (``q + k + v``, freed after the flash-attention
    node) below them, which the best-fit allocator (``ggml_dyn_tallocr_alloc``) leaves
    unused (on a recurrent layer none: its attention term is 0). That last term is
    placement, a bound checked on the recorded buffers (llama-server:
    ``tests/data/llama_server``, n_ff_exp 256 / 512, top_k 2 / 4, f16 and q8_0 caches;
    llama-completion: ``qwen3moe-wide``, Q twice the hidden size), not derived node by node;
    with a quantized cache llama.cpp rotates Q and K (``attn_rot_k``, ``llama_kv_cache``) and
    the allocator lands about one row lower (+2% there).

    On one device of a layer split (``only``: its layers; ``kv`` priced for them), the layer
    phase is that of its own layers and the end of the graph is only on the device of the
    output layer (``output``). The per-layer terms are :func:`layer_figures`' (``figures``:
    those of ``geom`` and ``only``, when the caller has them).
    """
    h = geom.hidden_size
    logits = 4 * (ubatch if n_outputs is None else min(n_outputs, ubatch)) * n_vocab
    end = logits + 4 * ubatch * (3 * h + 1)
    mask = 2 * ubatch * (kv.cells + kv.swa_cells)
    act = 4 * ubatch * (figures if figures is not None else layer_figures(geom, only)).activation
    fa = 0
    if backend.fa_f16 and kv.k_dims:
        cells = max(kv.cells, kv.swa_cells)
        fk = 0 if type_k == "f16" else max(kv.k_dims) * cells * kv.n_seq * 2
        fv = 0 if type_v == "f16" else max(kv.v_dims or (0,)) * cells * kv.n_seq * 2
        fa = pad_to(fk, 128) + pad_to(fv, 128)
    copy = host_weight if backend.op_offload and ubatch >= OP_OFFLOAD_MIN_BATCH else 0
    layer_phase = mask + act + fa + copy
    if not output:
        logits = end = 0
    return ComputePrice(max(end, layer_phase), logits, end, layer_phase, mask, fa, copy)


@record
class PricedModel:
    """Everything of a model the plan needs, priced once per backend."""

    geom: ModelGeometry
    n_vocab: int
    buffers: ModelBuffers

    @cached_property
    def figures(self) -> LayerFigures:
        """:func:`layer_figures` of every layer, read on first use and kept on this object."""
        return layer_figures(self.geom)


def vocab_size(tensors: list[Tensor]) -> int:
    """Tokens of the vocabulary: the rows of ``token_embd.weight``. Raises InputError when the
    GGUF has no 2-D token embeddings (not a text model)."""
    emb = next((t for t in tensors if t.name == "token_embd.weight"), None)
    if emb is None or len(emb.ne) != 2:
        raise InputError("the GGUF has no 2-D token_embd.weight; not a text model llama.cpp can load")
    return emb.ne[1]


def backend_of(device: Device) -> Backend:
    """The ggml backend whose buffers ``device`` holds: :data:`CPU` for a simulated device,
    else :data:`CUDA`."""
    return CPU if device.kind == "cpu" else CUDA
