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

import itertools
import math
import re
from dataclasses import dataclass, field, replace

from moefit.devices import Device, Host
from moefit.ingest.gguf_mix import llamacpp_tensors
from moefit.errors import InputError
from moefit.ingest.geometry import ModelGeometry
from moefit.ingest.gguf_header import read_header
from moefit.ingest.resolve import format_params
from moefit.memory.host import default_host_reserve_bytes
from moefit.memory.runtime import default_reserve_bytes, runtime_bytes
from moefit.plan.report import host_document
from moefit.plan.types import Alternative, HostPlan, Line, LineTable, format_fits_with, limiting_lines
from moefit.units import format_bytes, size_format

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
MATRIX_ROW_PADDING = 512
_EXPS = re.compile(r"^blk\.(\d+)\.ffn_(up|down|gate|gate_up)_(ch|)exps")

#: ggml block size and bytes per block of the KV cache types llama.cpp accepts (``-ctk``)
KV_TYPE_SIZES = {"f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18),
                 "q4_1": (32, 20), "iq4_nl": (32, 18), "q5_0": (32, 22), "q5_1": (32, 24)}
#: moefit's ``--kv`` formats as llama.cpp cache types (K, V); fp8 has no llama.cpp type: q8_0
KV_FROM_MOEFIT = {"bf16": ("bf16", "bf16"), "fp16": ("f16", "f16"), "fp32": ("f32", "f32"),
                  "fp8": ("q8_0", "q8_0"), "int8": ("q8_0", "q8_0"), "k8v4": ("q8_0", "q4_0"),
                  "int4": ("q4_0", "q4_0")}
#: largest first: the ``--kv`` alternative is the closest smaller pair of types that fits
_KV_ORDER = ("f32", "bf16", "q8_0", "k8v4", "q5_1", "q5_0", "q4_1", "q4_0")


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


def _row(kind: str, n: int) -> int:
    """``ggml_row_size`` of ``n`` elements of cache type ``kind`` (bytes)."""
    bs, ts = KV_TYPE_SIZES[kind]
    return ts * n // bs


def _pad(n: int, to: int) -> int:
    return -(-n // to) * to


def pad_cells(context: int) -> int:
    """A sequence's cells: ``context`` padded to llama.cpp's 256 (``llama-context.cpp``)."""
    return _pad(context, CTX_PAD)


@dataclass(frozen=True)
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


@dataclass(frozen=True)
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
        return _pad(size, backend.alignment)


def ggml_row_bytes(kind: str, n: int) -> int:
    """``ggml_row_size``: bytes of ``n`` elements of ggml type ``kind`` (``Q4_K``...), from the
    ``gguf`` package's block sizes (``ggml-common.h``)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    bs, ts = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    return ts * n // bs


def tensors_from_header(path: str) -> list[Tensor]:
    """The tensor infos of a GGUF file (every shard), from its header only."""
    h = read_header(path)
    return [Tensor(t.name, t.ggml_type, tuple(t.ne), t.nbytes) for t in h.tensors.values()]


def tensors_from_geometry(geom: ModelGeometry, ftype: str) -> tuple[list[Tensor], str]:
    """The tensors of the GGUF ``llama-quantize FTYPE`` would write for the Hugging Face model
    ``geom`` (:func:`moefit.ingest.gguf_mix.llamacpp_tensors`), and a note saying so."""
    infos, unknown = llamacpp_tensors(geom, ftype)
    note = (f"model: the GGUF of convert_hf_to_gguf.py + llama-quantize {ftype} (--gguf-type), derived from "
            f"the config, {format_bytes(sum(t.nbytes for t in infos))}")
    if unknown:
        note += f"; {unknown} tensors without a llama.cpp name priced at the mix's default type"
    return [Tensor(t.name, t.kind, t.ne, t.nbytes) for t in infos], note


def expert_layer(name: str) -> int | None:
    """The layer of an expert tensor ``--n-cpu-moe`` moves (its regex), or None."""
    m = _EXPS.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class ModelBuffers:
    """Model bytes with ``-ngl 999 --n-cpu-moe 0``: ``device`` (non-expert tensors but the
    token embeddings), ``experts`` per layer (on the device unless ``--n-cpu-moe``), ``host``
    (token embeddings), each in its backend's allocation."""

    device: int
    experts: tuple[tuple[int, int], ...]          # (layer, device bytes), layer order
    experts_host: tuple[tuple[int, int], ...]     # (layer, CPU bytes)
    host: int
    largest_expert_tensor: int = 0                # device bytes of the largest expert tensor


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
    return ModelBuffers(dev, tuple(sorted(experts.items())), tuple(sorted(experts_host.items())), host, largest)


def cpu_model_buffer(tensors: list[Tensor]) -> int:
    """The one ``CPU model buffer`` of a CPU-only load without mmap (``-lm none``) and without
    repacking (``-nr``): every tensor in the 32-byte-aligned CPU buffer (bytes)."""
    return sum(t.alloc_bytes(CPU) for t in tensors)


# ---- KV cache, recurrent state ---------------------------------------------------------------
@dataclass(frozen=True)
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
    if spec.kind == "mla":
        return spec.kv_lora_rank + spec.qk_rope_head_dim, 0
    return spec.num_kv_heads * spec.head_dim, spec.num_kv_heads * (spec.v_head_dim or spec.head_dim)


def kv_price(geom: ModelGeometry, context: int, ubatch: int, type_k: str, type_v: str,
             backend: Backend, n_seq: int = 1) -> KVPrice:
    """KV cache and recurrent state of ``geom`` for llama.cpp's ``-c context -ub ubatch -np
    n_seq`` with cache types ``type_k`` / ``type_v`` (see module docstring for the sources).

    ``-c`` is the total: ``n_ctx = pad(context, 256)``, and with ``n_seq`` slots each gets its
    own stream (``kv_unified`` is off when ``-np`` is given) of ``n_ctx_seq = pad(n_ctx /
    n_seq, 256)`` cells (``llama_context::llama_context``); a sliding-window stream holds
    ``pad(min(n_ctx_seq, n_swa + ub), 256)`` cells; the recurrent state has one row per
    sequence. Each K / V / state tensor is padded to the backend's alignment. ``cells`` and
    ``swa_cells`` are per stream, as llama.cpp prints them."""
    if n_seq < 1:
        raise InputError(f"-np {n_seq}: need at least one sequence")
    n_ctx_seq = _pad(_pad(context, CTX_PAD) // n_seq, CTX_PAD) if n_seq > 1 else _pad(context, CTX_PAD)
    full = swa = rec = 0
    nf = ns = nr = 0
    swa_cells = 0
    kd, vd = [], []
    for layer in geom.layers:
        a = layer.attention
        if a.kind == "linear":
            d_inner = a.linear_num_value_heads * a.linear_value_head_dim
            r = (a.linear_conv_kernel - 1) * (d_inner + 2 * a.linear_num_key_heads * a.linear_key_head_dim)
            s = a.linear_key_head_dim * d_inner
            rec += _pad(4 * r * n_seq, backend.alignment) + _pad(4 * s * n_seq, backend.alignment)
            nr += 1
            continue
        k, v = _layer_kv_dims(a)
        kd.append(k)
        vd.append(v)
        if a.kind == "sliding" and a.sliding_window:
            cells = _pad(min(n_ctx_seq, a.sliding_window + ubatch), CTX_PAD)
            swa_cells = cells
            swa += _pad(_row(type_k, k * cells) * n_seq, backend.alignment) + (
                _pad(_row(type_v, v * cells) * n_seq, backend.alignment) if v else 0)
            ns += 1
        else:
            full += _pad(_row(type_k, k * n_ctx_seq) * n_seq, backend.alignment) + (
                _pad(_row(type_v, v * n_ctx_seq) * n_seq, backend.alignment) if v else 0)
            nf += 1
    return KVPrice(n_ctx_seq * n_seq, n_ctx_seq if nf else 0, swa_cells, nf, ns, full, swa, nr, rec,
                   tuple(kd), tuple(vd), n_seq)


# ---- compute buffer ------------------------------------------------------------------------------
@dataclass(frozen=True)
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
                  n_outputs: int | None = None) -> ComputePrice:
    """Compute buffer of a ``ubatch``-token micro-batch (``graph_reserve`` with ``n_outputs``
    tokens output, None: all of them, as ``llama-completion``; llama-server: ``-np``; see the
    module docstring). Bytes:

    - end of the graph: ``4 (n_out n_vocab + ub (3 n_embd + 1))`` (logits of the ``n_out =
      min(n_outputs, ub)`` outputs, the last hidden states and their norm, ``out_ids``);
    - a layer: the KQ masks ``2 ub n_kv`` (f16; one per cache, alive through every layer) +
      ``4 ub`` x the larger of the token mixer (attention: ``2 n_embd + 3 q + 2 k + 2 v``;
      Gated DeltaNet: ``2 n_embd + 2 conv + 3 d_inner + 256 n_v_heads``) and the FFN (MoE:
      ``n_embd + 2 top_k n_embd + n_expert``, the top-k down-projections and their weighted
      copy, ``build_moe_ffn``; shared expert ``2 n_embd + 3 n_ff_shexp``) + on CUDA the F16
      copies of a non-F16 K and V (``2 n_kv n_embd_{k,v}_gqa``) + on CUDA, when
      ``ubatch >= 32``, the copy of the largest weight kept in host memory (``host_weight``
      bytes: an expert tensor under ``--n-cpu-moe``). The per-token terms were matched to the
      recorded runs (a 259-token vocabulary model isolates them).
    """
    h = geom.hidden_size
    logits = 4 * (ubatch if n_outputs is None else min(n_outputs, ubatch)) * n_vocab
    end = logits + 4 * ubatch * (3 * h + 1)
    mask = 2 * ubatch * (kv.cells + kv.swa_cells)
    act = 0
    for layer in geom.layers:
        a = layer.attention
        if a.kind == "linear":      # conv in/out, q/k/v, gate, the delta rule's 64-token blocks
            d_inner = a.linear_num_value_heads * a.linear_value_head_dim
            mix = 2 * h + 2 * a.linear_conv_dim + 3 * d_inner + 4 * 64 * a.linear_num_value_heads
        else:                       # Q (twice: projected, roped), K, V (twice), the output
            k, v = _layer_kv_dims(a)
            mix = 2 * h + 3 * a.num_heads * (a.head_dim or 0) + 2 * k + 2 * (v or k)
        if layer.moe is not None:   # the top-k down outputs, weighted, + the residual, the router
            m = layer.moe
            ffn = max(h + 2 * m.experts_per_token * h + m.num_experts, 2 * h + 3 * m.shared_intermediate)
        else:
            ffn = h + 3 * (layer.dense_intermediate or 0)
        act = max(act, 4 * ubatch * max(mix, ffn))
    fa = 0
    if backend.fa_f16 and kv.k_dims:
        cells = max(kv.cells, kv.swa_cells)
        fk = 0 if type_k == "f16" else max(kv.k_dims) * cells * kv.n_seq * 2
        fv = 0 if type_v == "f16" else max(kv.v_dims or (0,)) * cells * kv.n_seq * 2
        fa = _pad(fk, 128) + _pad(fv, 128)
    copy = host_weight if backend.op_offload and ubatch >= OP_OFFLOAD_MIN_BATCH else 0
    layer_phase = mask + act + fa + copy
    return ComputePrice(max(end, layer_phase), logits, end, layer_phase, mask, fa, copy)


# ---- the plan ------------------------------------------------------------------------------------
LINES = (("runtime", "runtime"), ("weights", "model buffers"), ("kv", "KV cache"),
         ("state", "recurrent state"), ("compute", "compute buffer"), ("margin", "safety margin"),
         ("experts", "expert layers"))


@dataclass(frozen=True)
class LlamaRequest:
    """What to plan: ``context`` tokens per sequence, ``slots`` sequences (``-np``; ``-c`` is
    ``pad(context, 256) x slots``), ``ubatch`` requested (``-ub``; ``strict``: no
    clamp, ``ubatch_min``: the smallest clamp), ``batch`` (``-b``), cache types, ``margin``
    bytes (None: moefit's default), ``gguf`` path for the command, ``notes`` of the flags'
    mapping (carried into the plan), ``device`` (``-dev``, e.g. ``CUDA1``; empty: none);
    the host side: ``mmap`` (llama.cpp's default; False: ``--no-mmap``), ``mlock``
    (``--mlock``), ``kv_offload`` (False: ``-nkvo``, the KV cache and recurrent state in host
    memory), ``host_margin`` bytes left free on the host (None: moefit's default)."""

    context: int
    slots: int = 1
    ubatch: int = DEFAULT_UBATCH
    batch: int = DEFAULT_BATCH
    type_k: str = "f16"
    type_v: str = "f16"
    margin: int | None = None
    ubatch_min: int = 256
    strict: bool = False
    gguf: str = "model.gguf"
    extra_flags: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    device: str = ""
    mmap: bool = True
    mlock: bool = False
    kv_offload: bool = True
    host_margin: int | None = None


@dataclass(frozen=True)
class LlamaPlan(LineTable):
    """A solved llama.cpp budget on one device. ``n_cpu_moe``: the first layers whose experts
    stay on the CPU; ``lines`` in the order llama.cpp allocates them."""

    fits: bool
    geometry: ModelGeometry
    device: Device
    request: LlamaRequest
    ubatch: int
    n_cpu_moe: int
    lines: tuple[Line, ...]
    host: dict = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    kv: KVPrice | None = None
    compute: ComputePrice | None = None
    expert_bytes: tuple[tuple[int, int], ...] = ()      # (layer, device bytes)
    shortfall_bytes: int = 0
    alternatives: tuple[Alternative, ...] = ()
    limiting: tuple[str, ...] = ()
    cpu_layers: tuple[int, ...] | None = None   # layers whose experts stay on the CPU, when not a prefix
    host_table: HostPlan | None = None          # what llama-server keeps in host memory
    short_on: str = ""                          # on failure: the device's label, or "host"

    def line(self, key: str) -> Line:
        return next(l for l in self.lines if l.key == key)

    @property
    def override(self) -> str:
        """``-ot PATTERN=CPU`` for :attr:`cpu_layers` (``--override-tensor``: tensors whose name
        matches the regex go to that buffer type; the regex of ``--n-cpu-moe``'s
        ``llm_ffn_exps_block_regex``, one alternative per layer), or "" with ``--n-cpu-moe``."""
        if not self.cpu_layers:
            return ""
        layers = "|".join(str(i) for i in self.cpu_layers)
        return f"'blk\\.({layers})\\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU'"

    @property
    def batch(self) -> int:
        """``-b`` of the command: llama.cpp's 2048, or the micro-batch when larger."""
        return min(self.request.batch, max(DEFAULT_BATCH, self.ubatch))

    @property
    def command(self) -> str:
        """The ``llama-server`` command line of this plan."""
        r = self.request
        # always -np: llama-server's default (-1, auto) is 4 slots sharing one cache
        # (tools/server/server.cpp), which would multiply the recurrent state and the SWA cache
        parts = ["llama-server", "-m", r.gguf, "-c", str(llama_ctx(r)), "-np", str(r.slots),
                 "-ub", str(self.ubatch), "-b", str(self.batch), "-ngl", "999"]
        if r.device:
            parts += ["-dev", r.device]
        if self.cpu_layers:
            parts += ["-ot", self.override]
        elif self.n_cpu_moe:
            parts += ["--n-cpu-moe", str(self.n_cpu_moe)]
        parts += ["-ctk", r.type_k, "-ctv", r.type_v, "-fa", "on"]
        if not r.kv_offload:
            parts.append("-nkvo")
        if load_mode(r) != "mmap":
            parts += ["-lm", load_mode(r)]
        # llama.cpp's --fit (on by default) changes unset flags to fit and gives up, with a
        # warning, once -ngl / -ot / --n-cpu-moe are set by hand (``llama_params_fit``): off, so the
        # planned placement is the one that runs
        parts += ["-fit", "off", *r.extra_flags]
        return " ".join(parts)


def llama_ctx(req: LlamaRequest) -> int:
    """llama.cpp's ``-c``: every slot's context, each padded to 256 cells (tokens)."""
    return pad_cells(req.context) * req.slots


def effective_ubatch(req: LlamaRequest) -> int:
    """The micro-batch llama.cpp runs for ``req`` (tokens): ``n_batch = min(n_ctx, -b)`` with
    causal attention, then ``n_ubatch = min(n_batch, -ub)`` (``llama-context.cpp``,
    ``llama_context::llama_context``; ``n_ctx`` is the command's ``-c``)."""
    return min(req.ubatch, max(req.batch, req.ubatch), llama_ctx(req))


@dataclass(frozen=True)
class _Model:
    """Everything of a model the plan needs, priced once per backend."""

    geom: ModelGeometry
    n_vocab: int
    buffers: ModelBuffers


def _n_vocab(tensors: list[Tensor]) -> int:
    emb = next((t for t in tensors if t.name == "token_embd.weight"), None)
    if emb is None or len(emb.ne) != 2:
        raise InputError("the GGUF has no 2-D token_embd.weight; not a text model llama.cpp can load")
    return emb.ne[1]


def _backend(device: Device) -> Backend:
    return CPU if device.kind == "cpu" else CUDA


def _mandatory(m: _Model, device: Device, req: LlamaRequest, ub: int,
               experts_on_host: bool) -> tuple[int, KVPrice, ComputePrice]:
    be = _backend(device)
    kv = kv_price(m.geom, llama_ctx(req), ub, req.type_k, req.type_v, be, req.slots)
    # llama-server reserves the graph of -np outputs (module docstring, compute buffer)
    comp = compute_price(m.geom, m.n_vocab, ub, kv, req.type_k, req.type_v, be,
                         m.buffers.largest_expert_tensor if experts_on_host else 0, n_outputs=req.slots)
    margin = default_reserve_bytes(device) if req.margin is None else req.margin
    cache = kv.kv_bytes + kv.recurrent_bytes if req.kv_offload else 0     # -nkvo: in host memory
    total = runtime_bytes(device) + m.buffers.device + cache + comp.bytes + margin
    return total, kv, comp


def _experts_from(m: _Model, k: int) -> int:
    """Device bytes of the experts of layers ``>= k``."""
    return sum(b for layer, b in m.buffers.experts if layer >= k)


def solve_llamacpp(geom: ModelGeometry, tensors: list[Tensor], device: Device, req: LlamaRequest, *,
                   alternatives: bool = True, host_mem: Host | None = None) -> LlamaPlan:
    """Solve llama.cpp's budget with moefit's rules (docs/plan.md, How the plan is solved):

    1. price the mandatory lines at the requested ``-ub`` (runtime, model buffers without the
       routed experts, KV cache, recurrent state, compute buffer, margin);
    2. if they fit, the elastic part is the routed experts: the smallest ``--n-cpu-moe K``
       whose experts of layers ``>= K`` fit in what remains;
    3. otherwise (all experts on the CPU) the largest ``-ub`` on the 64-token grid, not below
       ``ubatch_min``, that fits (unless ``strict``);
    4. otherwise the plan fails with the shortfall and single-flag alternatives
       (``--max-context``, ``--kv``), each checked by re-solving;
    5. the host table (:func:`host_table`) is checked against ``host_mem`` (``--host-ram`` or
       this machine; None: priced, not checked): a plan whose device fits but whose host
       does not fails with the host's shortfall (``short_on`` ``host``), and its
       alternatives fit both.

    Pure: no I/O. Raises InputError for a bad request (``-ub`` below 1).
    """
    if req.ubatch < 1:
        raise InputError(f"--prefill {req.ubatch}: the micro-batch (-ub) needs at least 1 token")
    if not 1 <= req.slots <= MAX_SEQ:
        raise InputError(f"--parallel {req.slots}: llama.cpp runs 1 to {MAX_SEQ} sequences")
    m = _Model(geom, _n_vocab(tensors), model_buffers(tensors, _backend(device)))
    free = device.free_bytes
    n_layers = geom.num_layers
    moe_layers = [layer for layer, _ in m.buffers.experts]
    all_cpu = (max(moe_layers) + 1) if moe_layers else 0
    notes: list[str] = list(req.notes)
    ub = effective_ubatch(req)
    if ub < req.ubatch:
        notes.append(f"-ub: requested {req.ubatch}, {ub} as llama.cpp runs it (n_ubatch = min(-ub, -b, -c))")
    # all experts on the device (no host weight to copy), else the smallest K >= 1 that fits
    total, kv, comp = _mandatory(m, device, req, ub, False)
    fits = True
    if total + _experts_from(m, 0) <= free:
        k = 0
    else:
        total, kv, comp = _mandatory(m, device, req, ub, bool(moe_layers))
        k = next((k for k in range(1, all_cpu + 1) if total + _experts_from(m, k) <= free), None)
    if k is None or total > free:
        k = all_cpu
        lowest = max(1, min(req.ubatch_min, ub))
        # the grid below ub: multiples of UB_GRID down to the floor (the floor itself when it is
        # off the grid); the mandatory lines grow with -ub, so the largest that fits is bisected
        grid = sorted({u for u in (lowest, *range(-(-lowest // UB_GRID) * UB_GRID, ub + 1, UB_GRID)) if u <= ub})

        def fits_at(u: int) -> bool:
            return _mandatory(m, device, req, u, bool(moe_layers))[0] <= free

        best = None
        if not req.strict and grid and fits_at(grid[0]):
            lo, hi = 0, len(grid) - 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if fits_at(grid[mid]) else (lo, mid - 1)
            best = grid[lo]
        if best is not None:
            notes.append(f"-ub: requested {req.ubatch}, clamped to {best} due to VRAM budget")
            ub = best
        else:
            fits = False
            ub = ub if req.strict else (grid[0] if grid else ub)
        total, kv, comp = _mandatory(m, device, req, ub, bool(moe_layers))
    on_cpu = frozenset(layer for layer in moe_layers if layer < k)
    per_layer = None
    # a clamped -ub took everything: the experts stay on the CPU (as moefit's clamped chunk keeps
    # the expert cache at its floor), so more memory never places fewer expert layers
    if fits and ub >= effective_ubatch(req) and 0 < k < all_cpu + 1 and on_cpu:
        chosen = _best_layers(dict(m.buffers.experts), free - total)
        if sum(b for layer, b in m.buffers.experts if layer in chosen) > _experts_from(m, k):
            on_cpu = frozenset(moe_layers) - chosen
            per_layer = tuple(sorted(on_cpu))
    lines = _lines(m, device, req, ub, on_cpu, kv, comp)
    host = host_bytes(m, device, req, ub, on_cpu, kv, comp)
    if per_layer:
        notes.append(f"experts of layers {_ranges(per_layer)} stay on the CPU (-ot, a per-layer choice: "
                     f"{format_bytes(lines[-1].bytes - _experts_from(m, k))} more experts on the device than "
                     f"--n-cpu-moe {k}); {len(moe_layers) - len(per_layer)} of {len(moe_layers)} MoE layers on "
                     "the device")
    elif k and n_layers:
        notes.append(f"experts of layers 0-{k - 1} stay on the CPU (--n-cpu-moe {k}); "
                     f"{len([l for l in moe_layers if l >= k])} of {len(moe_layers)} MoE layers on the device")
    plan = LlamaPlan(fits, geom, device, req, ub, k, lines, host, tuple(notes), kv, comp, m.buffers.experts,
                     cpu_layers=per_layer)
    plan = replace(plan, host_table=host_table(plan, host_mem))
    if fits and plan.host_table.fits:
        return plan
    if fits:        # the device fits, the host does not
        short = -plan.host_table.unassigned_bytes
        plan = replace(plan, fits=False, short_on="host", shortfall_bytes=short,
                       limiting=_host_limiting(plan.host_table, short, req.host_margin is not None))
    else:
        shortfall = plan.planned_bytes - free
        plan = replace(plan, short_on=device.label, shortfall_bytes=shortfall,
                       limiting=limiting_lines(plan.lines, shortfall))
    alts = _alternatives(geom, tensors, device, req, host_mem) if alternatives else ()
    return replace(plan, alternatives=tuple(alts))


# ---- the host ---------------------------------------------------------------------------------
#: llama-server's host lines (key, label), in the order it allocates them
HOST_LINES = (("host_runtime", "runtime"), ("host_weights", "model buffers"), ("host_kv", "KV cache"),
              ("host_compute", "compute buffer"), ("host_devices", "simulated device"),
              ("host_margin", "safety margin"))
#: the host side of llama-server's process before any buffer (bytes): not measured, estimates;
#: with CUDA the host side of the CUDA context and of ggml-cuda's and cuBLAS's kernels
HOST_RUNTIME_CPU = 256 << 20
HOST_RUNTIME_CUDA = 1 << 30
#: ``-lm`` (``--load-mode``, ``common/arg.cpp``) modes: how the CPU tensors are held
LOAD_MODES = ("mmap", "none", "mlock", "mmap+mlock")


def host_bytes(m: _Model, device: Device, req: LlamaRequest, ub: int, on_cpu: frozenset[int],
               kv: KVPrice, comp: ComputePrice) -> dict[str, int]:
    """What llama-server keeps in host memory beside the device (bytes), by part:

    - ``model``: the CPU tensors, the token embeddings and the experts of the ``on_cpu`` layers
      (``llama_model::load_tensors``). With mmap (``-lm mmap``, the default) they are the
      file's pages (``CPU_Mapped model buffer``): the buffer type chosen for a CPU tensor on a
      GPU build is the GPU's host type (``make_cpu_buft_list``: ACCEL, GPU host, CPU extra,
      CPU), which ``create_tensor`` replaces by the plain CPU type under mmap ("avoid using a
      host buffer when using mmap"), and only a default CPU buffer is mapped
      (``is_default_buft``); without mmap they are read into a ``CUDA_Host`` (pinned) or
      ``CPU`` buffer, with ``mlock`` locked there;
    - ``output``: the logits and embeddings buffer ``n_vocab x n_seq x 4``
      (``llama_context::output_reserve``, in the GPU's host buffer type);
    - ``compute``: the CPU backend's compute buffer (``CUDA_Host compute buffer``): graph
      inputs go to the last backend, the CPU (``ggml_backend_sched_backend_id_from_cur``,
      ``GGML_TENSOR_FLAG_INPUT``), so on a GPU it holds the KQ mask as the graph builds it
      (``[n_kv, n_ubatch]`` f16 with flash attention, one per cache) and the embedding
      lookup's rows twice (``4 ub n_embd``: the f32 rows and their copy); 528.30 MiB
      printed against 528.00 planned in one published log (tests/test_llamacpp_cuda_logs.py);
      on the CPU backend the embedding lookup only (``4 ub (n_embd + 1)``), the rest being
      the device's compute buffer;
    - ``kv``: with ``-nkvo`` the KV cache and the recurrent state (``CPU KV buffer``,
      ``CPU RS buffer``), else 0.
    """
    g = m.geom
    model = m.buffers.host + sum(b for layer, b in m.buffers.experts_host if layer in on_cpu)
    if device.kind == "cpu":
        compute = 4 * ub * (g.hidden_size + 1)
    else:
        compute = comp.mask + 2 * 4 * ub * g.hidden_size
    return {"model": model, "output": 4 * m.n_vocab * req.slots, "compute": compute,
            "kv": 0 if req.kv_offload else kv.kv_bytes + kv.recurrent_bytes}


def load_mode(req: LlamaRequest) -> str:
    """llama.cpp's ``-lm`` of ``req``: ``mmap``, ``none``, ``mlock`` or ``mmap+mlock``."""
    return ("mmap" if req.mmap else "none") if not req.mlock else ("mmap+mlock" if req.mmap else "mlock")


def host_table(plan: LlamaPlan, host_mem: Host | None) -> HostPlan:
    """The host table of ``plan`` (:data:`HOST_LINES`; bytes of :func:`host_bytes`) against
    ``host_mem`` (None: priced, not checked). Mapped model pages count as resident: the CPU
    layers read every expert they route to, and a page the kernel drops is read from the
    disk again at the next token that needs it (``-lm mmap+mlock`` locks them, ``-lm none``
    copies them); the pages of the tensors uploaded to the device are read once at load and
    stay reclaimable page cache (not counted). On a simulated device (``--device cpu``) the
    device's buffers are host memory too (every line but the margin)."""
    r, h, dev = plan.request, plan.host, plan.device
    mode = load_mode(r)
    where = ("mapped file pages, counted as resident" if mode == "mmap" else
             "mapped and locked (mlock)" if mode == "mmap+mlock" else
             ("a pinned CUDA_Host copy" if dev.kind != "cpu" else "a copy in host memory")
             + (", locked (mlock)" if mode == "mlock" else ""))
    what = "token embeddings" + (f", experts of layers {_ranges(plan.cpu_layers)}" if plan.cpu_layers else
                                 f", experts of layers 0-{plan.n_cpu_moe - 1}" if plan.n_cpu_moe else "")
    sim = dev.kind == "cpu"
    margin = r.host_margin if r.host_margin is not None else default_host_reserve_bytes(
        host_mem.capacity_bytes if host_mem else None)
    lines = (
        Line("host_runtime", HOST_RUNTIME_CPU if sim else HOST_RUNTIME_CUDA,
             "llama-server" + ("" if sim else " with the CUDA runtime") + " (estimate)"),
        Line("host_weights", h["model"], f"{what}: {where} (-lm {mode})"),
        Line("host_kv", h["kv"], "-nkvo: KV cache and recurrent state" if h["kv"] else "on the device"),
        Line("host_compute", h["output"] + h["compute"],
             f"output {format_bytes(h['output'])} + "
             + ("embedding rows" if sim else "KQ mask and embedding rows (CUDA_Host)")
             + f" {format_bytes(h['compute'])}"),
        Line("host_devices", sum(l.bytes for l in plan.lines if l.key != "margin") if sim else 0,
             "the simulated device's buffers" if sim else ""),
        Line("host_margin", margin, ""),
    )
    return HostPlan(host_mem, lines, "mmap" if mode.startswith("mmap") else
                    ("memory" if sim else "pinned"), h["model"] if mode.startswith("mmap") else 0, True)


#: host lines the process and the machine set (never limiting, as the device's runtime)
_HOST_FIXED = ("host_runtime",)


def _host_limiting(hp: HostPlan, short: int, margin_by_hand: bool) -> tuple[str, ...]:
    """The host lines that make a host ``short`` bytes short (largest first), the runtime and
    the default margin never."""
    fixed = _HOST_FIXED + (() if margin_by_hand else ("host_margin",))
    return limiting_lines([l for l in hp.lines if l.key not in fixed], short)


#: combinations of per-size layer counts :func:`_best_layers` enumerates before it settles
#: for the largest-first fill
_SUBSET_COMBOS = 200_000


def _best_layers(experts: dict[int, int], budget: int) -> frozenset[int]:
    """The MoE layers whose experts to keep on the device: the most expert bytes within
    ``budget`` (a subset-sum over the layers' device bytes). Layers of one size are
    interchangeable, so this enumerates how many of each size (all but the smallest size, whose
    count then follows) and keeps the last layers of each size on the device; with too many
    sizes it fills largest first. Ties: more layers on the device."""
    by_size: dict[int, list[int]] = {}
    for layer, b in experts.items():
        by_size.setdefault(b, []).append(layer)
    sizes = sorted(by_size, reverse=True)
    if budget <= 0 or not sizes:
        return frozenset()
    combos = math.prod(len(by_size[s]) + 1 for s in sizes[:-1])
    if combos > _SUBSET_COMBOS:
        chosen, left = [], budget
        for s in sizes:
            n = min(len(by_size[s]), left // s)
            chosen += sorted(by_size[s])[len(by_size[s]) - n:]
            left -= n * s
        return frozenset(chosen)
    best = (0, 0, ())
    last = sizes[-1]
    for counts in itertools.product(*(range(len(by_size[s]) + 1) for s in sizes[:-1])):
        used = sum(c * s for c, s in zip(counts, sizes))
        if used > budget:
            continue
        n_last = min(len(by_size[last]), (budget - used) // last)
        key = (used + n_last * last, sum(counts) + n_last, (*counts, n_last))
        best = max(best, key)
    chosen = []
    for s, n in zip(sizes, best[2]):
        chosen += sorted(by_size[s])[len(by_size[s]) - n:] if n else []
    return frozenset(chosen)


def _ranges(layers: tuple[int, ...]) -> str:
    """``0-4, 7, 9-11`` of sorted layer indices."""
    out, start = [], None
    for i, layer in enumerate(layers):
        if start is None:
            start = layer
        if i + 1 == len(layers) or layers[i + 1] != layer + 1:
            out.append(f"{start}" if start == layer else f"{start}-{layer}")
            start = None
    return ", ".join(out)


def _lines(m: _Model, device: Device, req: LlamaRequest, ub: int, on_cpu: frozenset[int], kv: KVPrice,
           comp: ComputePrice) -> tuple[Line, ...]:
    be = _backend(device)
    g = m.geom
    streams = f" x {req.slots} slots" if req.slots > 1 else ""
    kv_detail = f"{kv.cells} cells{streams} x {kv.full_layers} layers" if kv.full_layers else ""
    if kv.swa_layers:
        kv_detail += (", " if kv_detail else "") + f"SWA {kv.swa_cells} cells{streams} x {kv.swa_layers} layers"
    kv_detail += f", K {req.type_k} / V {req.type_v}"
    moe = len(m.buffers.experts)
    on_dev = len([1 for layer, _ in m.buffers.experts if layer not in on_cpu])
    k = max(on_cpu) + 1 if on_cpu else 0
    margin = default_reserve_bytes(device) if req.margin is None else req.margin
    values = {
        "runtime": (runtime_bytes(device), "simulated device" if device.kind == "cpu" else
                    ("measured" if device.runtime_bytes is not None else "CUDA context estimate")),
        "weights": (m.buffers.device, f"{be.name}: all but the routed experts and the token embeddings"),
        "kv": (kv.kv_bytes, kv_detail) if req.kv_offload else (0, "-nkvo: in host memory, " + kv_detail),
        "state": (kv.recurrent_bytes if req.kv_offload else 0,
                  (f"{kv.recurrent_layers} layers x {req.slots} sequence{'s' if req.slots > 1 else ''}, f32"
                   + ("" if req.kv_offload else ", -nkvo: in host memory"))
                  if kv.recurrent_layers else "no recurrent layers"),
        "compute": (comp.bytes, _compute_detail(ub, m.n_vocab, comp)),
        "margin": (margin, ""),
        "experts": (sum(b for layer, b in m.buffers.experts if layer not in on_cpu),
                    (f"{on_dev} of {moe} MoE layers (--n-cpu-moe {k})" if len(on_cpu) == k else
                     f"{on_dev} of {moe} MoE layers (-ot: layers {_ranges(tuple(sorted(on_cpu)))} on the CPU)")
                    if moe else "dense model: no experts"),
    }
    return tuple(Line(key, *values[key]) for key, _ in LINES)


def _compute_detail(ub: int, n_vocab: int, comp: ComputePrice) -> str:
    if comp.end_phase >= comp.layer_phase:
        return (f"-ub {ub}; peak: logits {n_vocab} x {comp.logits // (4 * n_vocab)} x 4 B = "
                f"{format_bytes(comp.logits)}")
    fa = f" + F16 K/V {format_bytes(comp.fa_f16)}" if comp.fa_f16 else ""
    copy = f" + expert copy {format_bytes(comp.weight_copy)}" if comp.weight_copy else ""
    return f"-ub {ub}; peak in a layer: KQ mask {format_bytes(comp.mask)}{fa}{copy} + activations"


def _alternatives(geom, tensors, device, req, host_mem: Host | None = None) -> list[Alternative]:
    def fits(r: LlamaRequest) -> bool:
        return solve_llamacpp(geom, tensors, device, r, alternatives=False, host_mem=host_mem).fits

    out = []
    lo, hi = 1, req.context - 1
    if hi >= lo and fits(replace(req, context=lo)):
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(replace(req, context=mid)):
                lo = mid
            else:
                hi = mid - 1
        out.append(Alternative("--max-context", lo))
    cur = _row(req.type_k, 256) + _row(req.type_v, 256)
    for name in _KV_ORDER:
        tk, tv = kv_types(name)
        if _row(tk, 256) + _row(tv, 256) < cur and fits(replace(req, type_k=tk, type_v=tv)):
            out.append(Alternative("--kv", name))
            break
    if req.host_margin and host_mem is not None:
        top = (req.host_margin >> 20) - 1
        lo, hi = 0, top
        if top >= 0 and fits(replace(req, host_margin=0)):
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if fits(replace(req, host_margin=mid << 20)) else (lo, mid - 1)
            out.append(Alternative("--host-reserve-mib", lo))
    return out


# ---- the largest context ---------------------------------------------------------------------------
def largest_llama_context(geom: ModelGeometry, tensors: list[Tensor], device: Device, req: LlamaRequest,
                          limit: int, host_mem: Host | None = None) -> int | None:
    """The largest context per sequence (tokens, a multiple of the 256-cell block unless it is
    ``limit``) at which ``req`` fits ``device`` (and ``host_mem``) at its own ``-ub`` (no
    clamp), or None when not one block does.

    Solved directly: with every expert on the CPU the mandatory lines are affine in the cells
    once a stream holds more than every sliding window plus ``-ub`` (the sliding caches stop
    growing): the full-attention K/V rows (``kv_price``), the KQ mask ``2 ub n_kv`` and the
    F16 copies of a quantized K/V (``compute_price``) grow by a fixed number of bytes per
    256-cell block, so the answer is one division. It is confirmed with
    :func:`solve_llamacpp` (it fits, one block more does not, unless it is ``limit``); when
    it is not (a host that is short, a context below that affine range) a bisection over the
    blocks with :func:`solve_llamacpp` finds it (the plan is monotone in the context)."""
    strict = replace(req, strict=True, notes=())

    def fits(context: int) -> bool:
        return solve_llamacpp(geom, tensors, device, replace(strict, context=context), alternatives=False,
                              host_mem=host_mem).fits

    top = -(-limit // CTX_PAD)            # blocks of the model's limit
    m = _Model(geom, _n_vocab(tensors), model_buffers(tensors, _backend(device)))
    windows = [l.attention.sliding_window or 0 for l in geom.layers]
    b0 = max(1, -(-(max(windows, default=0) + req.ubatch) // CTX_PAD), -(-req.ubatch // CTX_PAD))
    ub, free = req.ubatch, device.free_bytes

    def total(b: int) -> int:
        return _mandatory(m, device, replace(strict, context=b * CTX_PAD), ub, bool(m.buffers.experts))[0]

    # the compute buffer is the larger of two phases, each affine: the lines are a convex
    # piecewise-affine function of the blocks, so Newton's steps from the limit down reach the
    # last block that fits in as many steps as there are pieces
    guess = top if total(top) <= free else None
    b = top
    for _ in range(4 if guess is None else 0):
        slope = total(b + 1) - total(b)
        if slope <= 0:
            break
        nxt = b - -(-(total(b) - free) // slope)
        if nxt < b0:
            break
        b = nxt
        if total(b) <= free:
            guess = b
            break
    ctx = lambda b: min(b * CTX_PAD, limit)   # noqa: E731
    if guess is not None and fits(ctx(guess)) and (guess == top or not fits(ctx(guess + 1))):
        return ctx(guess)
    if not fits(ctx(1)):
        return None
    lo, hi = 1, top
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(ctx(mid)) else (lo, mid - 1)
    return ctx(lo)


def plan_max_context(geom: ModelGeometry, tensors: list[Tensor], device: Device, req: LlamaRequest,
                     limit: int, host_mem: Host | None = None) -> LlamaPlan:
    """``--max-context max``: the plan at :func:`largest_llama_context` (``-ub`` as requested),
    with a note giving the context and ``-c``, and the trade-off when the smallest micro-batch
    a clamp may take (``--prefill-min``) would fit a longer one; when no block fits, the
    failed plan at one block (256 cells) with a note saying so."""
    best = largest_llama_context(geom, tensors, device, req, limit, host_mem)
    if best is None:
        plan = solve_llamacpp(geom, tensors, device, replace(req, context=CTX_PAD), host_mem=host_mem)
        note = f"max-context: max, no context fits at -ub {req.ubatch}: shown at one block, {CTX_PAD} cells"
        return replace(plan, notes=(note, *plan.notes))
    r = replace(req, context=best, strict=True)
    plan = solve_llamacpp(geom, tensors, device, r, host_mem=host_mem)
    capped = " (the model's limit)" if best == limit else ""
    note = (f"max-context: max, the largest context that fits at -ub {req.ubatch}: {best} tokens per sequence "
            f"(-c {llama_ctx(r)}){capped}")
    notes = [note]
    small = max(1, min(req.ubatch_min, req.ubatch))
    if small < req.ubatch and best < limit:
        more = largest_llama_context(geom, tensors, device, replace(req, ubatch=small), limit, host_mem)
        if more and more > best:
            notes.append(f"max-context: at -ub {small} (--prefill {small}) {more} tokens fit "
                         f"(+{100 * (more - best) / best:.0f}%), with a slower prompt step")
    return replace(plan, notes=(*notes, *plan.notes))


# ---- output ----------------------------------------------------------------------------------------
def format_plan(plan: LlamaPlan) -> str:
    """The budget table in moefit's form, the host memory, the notes and the command."""

    g, dev = plan.geometry, plan.device
    fmt = size_format(dev.capacity_bytes)
    labels = dict(LINES)
    out = [f"model  {g.name}  {format_params(g.total_params)} total / {format_params(g.active_params)} active  "
           f"{g.num_layers} layers, {g.attention_layout()}",
           "engine  llama.cpp (llama-server; memory model of commit 0c1e570, validated on the CPU backend)",
           f"VRAM budget  {dev.label}  {dev.description}  {fmt(dev.free_bytes)} free of {fmt(dev.capacity_bytes)}"]
    for line in plan.lines:
        out.append(f"  {labels[line.key]:<18} {fmt(line.bytes):>10}   {line.detail}".rstrip())
    if plan.unassigned_bytes >= 0:
        out.append(f"  {'unassigned':<18} {fmt(plan.unassigned_bytes):>10}")
    if plan.host_table is not None:
        out += _format_host(plan.host_table)
    out += list(plan.notes)
    if plan.fits:
        out.append("command  " + plan.command)
        return "\n".join(out)
    out += short_lines(plan, fmt)
    labels = {**dict(LINES), **{k: "host " + v for k, v in HOST_LINES}}
    out.append("limiting: " + ", ".join(labels[k] for k in plan.limiting))
    larger = "a larger host" if plan.short_on == "host" else "a larger device"
    out += format_fits_with(plan.alternatives, f"{larger} (no single flag change makes it fit)")
    return "\n".join(out)


def short_lines(plan: LlamaPlan, fmt) -> list[str]:
    """``does not fit: short by ...`` naming every side that is short: the device (the plan's
    shortfall) and the host when its table is checked and over (it is priced for the plan as
    shown, so a device that is short does not hide a host that is short too)."""
    hp = plan.host_table
    host_short = -hp.unassigned_bytes if hp is not None and not hp.fits else 0
    hfmt = size_format(hp.host.capacity_bytes) if host_short else fmt
    if plan.short_on == "host":
        return [f"does not fit: short by {hfmt(host_short)} on the host"]
    line = f"does not fit: short by {fmt(plan.shortfall_bytes)} on {plan.device.label}"
    if host_short:
        line += f", and by {hfmt(host_short)} on the host"
    return [line]


def _format_host(hp: HostPlan) -> list[str]:
    """The host table: its budget line, one line per :data:`HOST_LINES`, unassigned."""
    fmt = size_format(sum(l.bytes for l in hp.lines if l.key not in ("host_runtime", "host_margin")))
    h = hp.host
    head = (f"host budget  {h.source}  {fmt(h.free_bytes)} free of {fmt(h.capacity_bytes)}" if h else
            f"host budget  not checked (a what-if card; --host-ram SIZE checks a machine)  "
            f"needs {fmt(hp.planned_bytes)}")
    labels = dict(HOST_LINES)
    out = [head] + [f"  {labels[l.key]:<18} {fmt(l.bytes):>10}   {l.detail}".rstrip() for l in hp.lines]
    if h is not None and hp.unassigned_bytes >= 0:
        out.append(f"  {'unassigned':<18} {fmt(hp.unassigned_bytes):>10}")
    return out


def format_verbose(plan: LlamaPlan) -> str:
    """``-v``: the compute buffer's two phases, the KV caches per kind, the device bytes of
    each MoE layer's experts (what one step of ``--n-cpu-moe`` moves)."""
    c, kv = plan.compute, plan.kv
    out = [f"compute  end of graph {format_bytes(c.end_phase)} (logits {format_bytes(c.logits)}); "
           f"a layer {format_bytes(c.layer_phase)} (KQ mask {format_bytes(c.mask)}, F16 K/V "
           f"{format_bytes(c.fa_f16)}, expert copy {format_bytes(c.weight_copy)})",
           f"KV       full {format_bytes(kv.bytes_full)} ({kv.cells} cells x {kv.full_layers} layers x "
           f"{kv.n_seq} streams), SWA {format_bytes(kv.bytes_swa)} ({kv.swa_cells} cells x {kv.swa_layers} "
           f"layers), recurrent {format_bytes(kv.recurrent_bytes)} ({kv.recurrent_layers} layers)"]
    if plan.expert_bytes:
        out.append("experts  device bytes per MoE layer: "
                   + ", ".join(f"{layer}:{format_bytes(b)}" for layer, b in plan.expert_bytes))
    return "\n".join(out)


#: the JSON document of a llama.cpp plan (docs/plan.md, "JSON (`moefit plan --json`)")
SCHEMA = "moefit.llamacpp-plan/1"


def plan_document(plan: LlamaPlan) -> dict:
    """The plan as the JSON-ready ``moefit.llamacpp-plan/1`` dict: ``moefit.plan/1``'s model,
    devices (the lines of :data:`LINES`), notes, and on failure ``shortfall_bytes``,
    ``limiting``, ``alternatives`` (``value`` an int for a count); its own ``engine``,
    ``context`` (cells per sequence), ``slots`` (``-np``), ``kv`` ``{"k", "v"}`` (llama.cpp's
    cache types), ``ubatch``, ``batch``, ``n_cpu_moe``, ``host`` (bytes by part:
    :func:`host_bytes`), ``host_budget`` (the host table in ``moefit.plan/2``'s ``host`` form),
    ``short_on`` on failure (the device's label or ``host``) and ``command``.
    Sizes in bytes."""
    g, dev = plan.geometry, plan.device
    doc = {"schema": SCHEMA, "engine": "llama.cpp", "fits": plan.fits,
           "model": {"name": g.name, "model_type": g.model_type, "total_params": g.total_params,
                     "active_params": g.active_params, "source": g.source},
           "context": _pad(plan.request.context, CTX_PAD), "slots": plan.request.slots,
           "kv": {"k": plan.request.type_k, "v": plan.request.type_v},
           "ubatch": plan.ubatch, "batch": plan.batch, "n_cpu_moe": 0 if plan.cpu_layers else plan.n_cpu_moe,
           "cpu_layers": list(plan.cpu_layers) if plan.cpu_layers else
           [layer for layer, _ in plan.expert_bytes if layer < plan.n_cpu_moe],
           "devices": [{"name": dev.label, "description": dev.description, "kind": dev.kind,
                        "capacity_bytes": dev.capacity_bytes, "free_bytes": dev.free_bytes,
                        "lines": [{"key": l.key, "bytes": l.bytes, "detail": l.detail} for l in plan.lines],
                        "unassigned_bytes": plan.unassigned_bytes}],
           "host": dict(plan.host), "notes": list(plan.notes)}
    if plan.host_table is not None:
        doc["host_budget"] = host_document(plan.host_table)
    if plan.fits:
        doc["command"] = plan.command
    else:
        doc["shortfall_bytes"] = plan.shortfall_bytes
        doc["short_on"] = plan.short_on
        doc["limiting"] = list(plan.limiting)
        doc["alternatives"] = [{"flag": a.flag, "value": a.value} for a in plan.alternatives]
    return doc
