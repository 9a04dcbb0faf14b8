"""Bytes of the host budget's lines (docs/design.md, host budget).

The host table sits beside the device tables. Its lines, in commit order:

- ``host_runtime``: the process before any weight: Python, torch and the server stack,
  and on CUDA the host side of the CUDA context and libraries (:func:`host_runtime_bytes`).
- ``host_weights``: dense weights kept on the host: a GGUF file's token embedding table
  when the file has its own output matrix (:func:`embed_on_host`). llama.cpp keeps it on
  the CPU ("there is very little benefit to offloading the input layer",
  ``llama_model::load_tensors``; :mod:`moefit.external.llamacpp`): a token's embedding is
  one row lookup, so the device needs no copy of the table. With tied embeddings the
  table is the output matrix too and stays on the device.
- ``host_staging``: the larger of what loading holds at once beside its destinations
  (:func:`load_staging_bytes`) and what serving holds on the host per step
  (:func:`serving_staging_bytes`).
- ``host_experts``: the packed blobs of the experts that are not resident on a device
  (with ``--miss-policy copy`` every expert's, since the cache swaps them), in pinned
  memory on CUDA (page-locked: the kernel can neither swap nor reclaim it, and
  host-to-device copies run asynchronously), plain memory on a simulated device; 0 with
  ``--host-experts mmap``, where they are read from the GGUF file's pages each time they
  run (:func:`host_expert_bytes`).
- ``host_devices``: on a simulated device (``--device cpu``) the device's tensors are
  host memory too: every line of its table but the margin.
- ``host_margin``: left free for the rest of the machine (:func:`default_host_reserve_bytes`).

Imports no torch.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping

from moefit.errors import InputError
from moefit.ingest import checkpoint
from moefit.ingest.geometry import ModelGeometry
from moefit.memory import cpu_kernels
from moefit.memory.staging import (DEQUANT_SCRATCH_BYTES_PER_ELEM, DEQUANT_TILE_ELEMS, FP8_TYPE,
                                   compute_bytes, expert_dequant_bytes)
from moefit.memory.takes import FP32, Take, span, take_bytes

MIB = 1 << 20
GIB = 1 << 30

#: ``host_runtime`` with no CUDA device: 512 MiB. Measured: 246 MiB resident after
#: importing torch 2.x, FastAPI, uvicorn, tokenizers and moefit's runtime on the CI
#: machine (``/proc/self/status`` VmRSS), and the ``moefit serve`` process of a 120 MB
#: model at 516 MiB once its allocator had warmed up (docs/benchmarks.md, the load test), i.e. about
#: 400 MiB beside the model; rounded up.
CPU_RUNTIME_BYTES = 512 * MIB
#: ``host_runtime`` with a CUDA device: 2 GiB. pytorch/pytorch#113326 measures a peak
#: RSS of 2,056,600 kB after the first CUDA tensor (torch 2.2, CUDA 11.8, RTX 3090) against
#: 322,040 kB without CUDA; pytorch/pytorch#19397 sees "+2 GB in RAM" when a small model
#: moves to the GPU. One context; each further CUDA device adds its own host side, which
#: is not measured here.
CUDA_RUNTIME_BYTES = 2 * GIB
#: ``host_margin`` default: 1 GiB, or 1/32 of the host when that is smaller.
DEFAULT_HOST_RESERVE = GIB


def host_runtime_bytes(device_kinds) -> tuple[int, str]:
    """The ``host_runtime`` line for devices of ``device_kinds`` (bytes, detail)."""
    if "cuda" in set(device_kinds):
        return CUDA_RUNTIME_BYTES, "process with the CUDA runtime (estimate)"
    return CPU_RUNTIME_BYTES, "process: Python and torch (estimate)"


def default_host_reserve_bytes(capacity: int | None) -> int:
    """Default ``host_margin``: ``min(1 GiB, capacity / 32)`` bytes (1 GiB when the host
    is not known)."""
    return DEFAULT_HOST_RESERVE if capacity is None else min(DEFAULT_HOST_RESERVE, capacity // 32)


def embed_on_host(geom: ModelGeometry) -> tuple[int, int]:
    """``(device bytes, host bytes)`` of a token embedding table the plan keeps on the
    host: the bytes the ``weights`` line counts for it (taken off the device) and its
    bytes as the file stores it (held on the host, rows dequantized when looked up).
    ``(0, 0)`` when it stays on the device: not a GGUF file, or a tied output."""
    exact = geom.exact
    stored = getattr(exact, "embed_stored_bytes", 0)
    if not stored or getattr(exact, "tied", True):
        return 0, 0
    return exact.embed_resident_bytes, stored


def load_staging_bytes(geom: ModelGeometry) -> int:
    """The most host memory the loaders hold at once beside their destinations (bytes).

    Safetensors (``moefit.runtime.load.safetensors``): one tensor is read at a time into host
    memory and copied to where it lives (a fused ``[E, 2I, H]`` expert tensor whole, an fp8
    tensor with its scales; gpt-oss's fused experts one expert's slice at a time,
    ``moefit.ingest.families.gpt_oss.expert_read_bytes``); a projection the loader packs
    from a layer's tensors (Qwen3-Next / Qwen3.5, ``moefit.runtime.load.hybrid_layout``) holds
    its parts and the result at once (:func:`moefit.ingest.checkpoint.load_staging`). GGUF
    (``moefit.runtime.load.gguf``): tensors are read through the file's memory map (page
    cache, not counted here), except llama's q/k rows, un-permuted in a copy, and a
    hybrid's regrouped projections, rebuilt in fp32
    (``moefit.ingest.gguf_header.packed_staging_bytes``). From the headers when read
    (``ExactWeights.load_staging_bytes``), else from the tensor listing, priced the same
    way as a safetensors checkpoint."""
    if geom.exact is not None:
        return geom.exact.load_staging_bytes
    return _listed_load_staging(geom)


@functools.lru_cache(maxsize=4)
def _listed_load_staging(geom: ModelGeometry) -> int:
    """:func:`load_staging_bytes` of a geometry without headers, from its tensor listing;
    kept for the last few geometries: a plan that does not fit solves the same geometry
    again for each alternative it tries (Llama-4-Scout on an RTX 5090: 11 solves)."""
    listing = {t.name: geom.tensor_bytes(t) for t in geom.global_tensors}
    for l in geom.layers:
        listing.update({t.name: geom.tensor_bytes(t) for t in (*l.tensors, *l.expert_tensors)})
    return checkpoint.load_staging(geom, listing)


#: ``MOEFIT_EXPERT_PATH=device``: a CPU (simulated) device runs its MoE layers through the
#: device expert path a CUDA device runs (``moefit.runtime.moe.device``: batched products in
#: torch, misses computed on the host while the device works), so tests exercise that code
#: without a GPU; the plan then prices its host buffer as on CUDA. Unset (or ``auto``): only
#: CUDA devices take it.
EXPERT_PATH_ENV = "MOEFIT_EXPERT_PATH"
#: (token, expert) pairs the C kernels run at once for the misses of one device step
#: (``qmatmul.moe``'s pair chunk: their scratch is this many pairs, not a pair per token)
HOST_MISS_PAIRS = 64
#: torch dtype names of the compute dtypes the C kernels are given (``qmatmul.ACT_DTYPES``;
#: tests/runtime/test_moe_batch.py checks the two agree)
C_ACT_DTYPES = ("float32", "float16", "bfloat16")
_PLAIN = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def device_expert_path(main_kind: str, env: Mapping[str, str] = os.environ) -> bool:
    """Whether the MoE layers of a main device of ``main_kind`` run the device expert path:
    always on CUDA, on a CPU device when :data:`EXPERT_PATH_ENV` is ``device``.

    Raises InputError for another value of the variable."""
    value = env.get(EXPERT_PATH_ENV, "")
    if value not in ("", "auto", "device"):
        raise InputError(f"{EXPERT_PATH_ENV}={value!r}: use device (the CUDA expert path on a CPU "
                         "device too), or auto / unset")
    return main_kind == "cuda" or value == "device"


def miss_host_buffer(geom: ModelGeometry, main_kind: str, miss_policy: str, mapped: bool,
                     env: Mapping[str, str] = os.environ) -> bool:
    """Whether serving holds the host buffer of the device expert path's misses
    (:func:`miss_host_bytes`): the MoE layers take that path (:func:`device_expert_path`),
    misses are computed on the host (``--miss-policy cpu``) and the experts are not mapped
    from a GGUF file (mapped misses go expert by expert); ``auto`` runs some steps' misses
    on the host too. Raises InputError as
    :func:`device_expert_path` does."""
    return (bool(geom.moe_layers) and miss_policy in ("cpu", "auto") and not mapped
            and device_expert_path(main_kind, env))


def miss_host_c_kernels(types: tuple[str, str, str], hidden: int, inter: int, dtype: str,
                        env: Mapping[str, str] = os.environ) -> bool:
    """Whether the misses of a device step run on the host through the C kernels
    (``qmatmul.moe``) for experts of (gate, up, down) ggml ``types`` ``[I, H]``, ``[I, H]``,
    ``[H, I]`` in a model computing in ``dtype``: the kernels are expected on the CPU, read
    that dtype's activations and those types at those widths (``moefit.runtime.moe.device``
    asks the same of the built kernels); else they run in torch, expert by expert."""
    cols = (hidden, hidden, inter)
    return (cpu_kernels.expected("cpu", env) and dtype in C_ACT_DTYPES
            and all(cpu_kernels.supports(t, c) for t, c in zip(types, cols)))


def miss_host_takes(hidden: int, inter: int, top_k: int, chunk: int, c_kernels: bool,
                    stored: bool) -> list[Take]:
    """The host buffer of a device step's misses (``moefit.runtime.moe.device`` takes it by
    this list, in order) for a chunk of ``chunk`` tokens of ``top_k`` experts each: the
    step's rows copied from the device ``[T, H]``, the fp32 result copied back ``[T, H]``,
    the sorted pairs' tokens (int64) and routing weights (fp32) ``[T k]`` and those of the
    misses gathered ``[T k]``; then the compute: the C kernels' scratch for the ``T`` rows
    and :data:`HOST_MISS_PAIRS` pairs at a time (``qmatmul.moe_scratch_bytes``), or the
    torch path's buffers for one expert on up to every token (input rows, gate/up output,
    output and its fp32 copy, and for a ``stored`` format one dequantized matrix)."""
    t, p = chunk, chunk * top_k
    takes: list[Take] = [(t * hidden, "act"), (t * hidden, "f32"), (p, "i64"), (p, "f32"),
                         (p, "i64"), (p, "f32")]
    if c_kernels:
        return takes + [(cpu_kernels.moe_scratch_bytes(t, hidden, inter, HOST_MISS_PAIRS), "u8")]
    takes += [(t * hidden, "act"), (t * 2 * inter, "act"), (t * hidden, "act"), (t * hidden, "f32")]
    return takes + ([(inter * hidden, "act")] if stored else [])


def _layer_types(geom: ModelGeometry, layer) -> tuple[str, str, str]:
    """The (gate, up, down) types of ``layer``'s experts: the stored ones, block-scaled fp8
    for an fp8 checkpoint's, else the plain dtype's."""
    types = geom.expert_types.get(layer.index)
    if types:
        return tuple(types)
    if geom.experts_stored and geom.quant.method == "fp8":
        return (FP8_TYPE,) * 3
    return (_PLAIN.get(geom.dtype, geom.dtype),) * 3


def miss_host_bytes(geom: ModelGeometry, chunk: int,
                    env: Mapping[str, str] = os.environ) -> tuple[int, int]:
    """``(buffer, scratch)`` bytes of the misses of a device step on the host: the buffer of
    :func:`miss_host_takes` (the largest over the MoE layers and over the two ways a step's
    misses run: the C kernels for a step of few tokens per expert where they read the
    layer, dequantize-then-multiply expert by expert otherwise, as a CPU device chooses,
    ``moefit.runtime.moe.batch.max_tokens_per_expert``; pinned on CUDA, allocated once on
    ``host_staging``) and, for stored experts, the torch kernels' fp32 scratch beside one
    tile (:data:`moefit.memory.staging.DEQUANT_SCRATCH_BYTES_PER_ELEM`; none for a type the
    C kernels dequantize)."""
    act = compute_bytes(geom)
    buf = scratch = 0
    seen = set()        # layers of one shape and types give the same bytes: priced once
    for l in geom.moe_layers:
        m = l.moe
        types = _layer_types(geom, l)
        if (shape := (types, m.expert_intermediate, m.experts_per_token)) in seen:
            continue
        seen.add(shape)
        c = miss_host_c_kernels(types, geom.hidden_size, m.expert_intermediate, geom.dtype, env)
        for kernels in ((True, False) if c else (False,)):
            takes = miss_host_takes(geom.hidden_size, m.expert_intermediate, m.experts_per_token, chunk,
                                    kernels, geom.experts_stored)
            buf = max(buf, span(take_bytes(takes, act)))
        if geom.experts_stored:
            direct = cpu_kernels.expected("cpu", env) and geom.dtype in C_ACT_DTYPES
            tile = min(m.expert_intermediate * geom.hidden_size, DEQUANT_TILE_ELEMS)
            worst = max(DEQUANT_SCRATCH_BYTES_PER_ELEM.values())
            per = max(0.0 if direct and cpu_kernels.supports(t, cpu_kernels.row_block(t))
                      else DEQUANT_SCRATCH_BYTES_PER_ELEM.get(t, worst) for t in types)
            scratch = max(scratch, math.ceil(tile * per))
    return buf, scratch


def serving_staging_bytes(geom: ModelGeometry, chunk: int, slots: int, main_kind: str,
                          miss_policy: str, mapped: bool, slot_bytes: int) -> int:
    """Host bytes one step holds beside the lines, for a chunk of ``chunk`` tokens.

    - the logits of the step's sequences copied to the host: ``slots x V`` fp32
      (``moefit.runtime.engine.Engine.step``);
    - a GGUF token embedding kept on the host (:func:`embed_on_host`): the chunk's rows
      as stored, and on CUDA their dequantized values before the copy to the device;
    - on CUDA with ``--miss-policy cpu`` (and on a CPU device forced onto the device expert
      path, :func:`device_expert_path`): the host buffer of the misses of a step
      (:func:`miss_host_bytes`); with ``--host-experts mmap`` (which the device path does not
      run: its misses go expert by expert) a miss computed on the host for up to every
      token of the chunk: its input, gate/up output, activation and output
      (``(2 H + 4 I) x chunk`` in the compute dtype) and, for a stored format, one
      dequantized matrix and its kernel's scratch (:func:`moefit.memory.staging.expert_dequant_bytes`);
    - with ``--host-experts mmap``: the buffer one expert is gathered into from the
      file's pages (``slot_bytes``).
    """
    act = compute_bytes(geom)
    out = slots * geom.vocab_size * FP32
    _, host_embed = embed_on_host(geom)
    if host_embed:
        out += chunk * geom.exact.embed_row_bytes
        if main_kind == "cuda":
            out += chunk * geom.hidden_size * act
    if miss_host_buffer(geom, main_kind, miss_policy, mapped):
        out += sum(miss_host_bytes(geom, chunk))
    elif main_kind == "cuda" and miss_policy in ("cpu", "auto") and geom.moe_layers:
        inter = max(l.moe.expert_intermediate for l in geom.moe_layers)
        out += chunk * (2 * geom.hidden_size + 4 * inter) * act
        if geom.experts_stored:
            out += expert_dequant_bytes(geom, act, cpu_kernels.expected("cpu"))
    if mapped:
        out += slot_bytes
    return out


def host_expert_bytes(geom: ModelGeometry, resident: dict[int, int], miss_policy: str,
                      mapped: bool) -> tuple[int, int]:
    """``(bytes, experts)`` the host holds as blobs: every expert not in ``resident``
    (``{layer: slots on the devices}``), or every expert with ``--miss-policy copy``;
    ``(0, 0)`` when ``mapped`` (read from the file's pages)."""
    if mapped:
        return 0, 0
    blobs = geom.expert_blob_bytes()
    n = size = 0
    for l in geom.moe_layers:
        held = l.moe.num_experts - (0 if miss_policy == "copy" else resident.get(l.index, 0))
        n += held
        size += held * blobs[l.index]
    return size, n


def mapped_expert_bytes(geom: ModelGeometry, resident: dict[int, int]) -> int:
    """Bytes of the non-resident experts a ``--host-experts mmap`` run reads from the
    file's pages (they stay in the page cache while memory allows)."""
    blobs = geom.expert_blob_bytes()
    return sum((l.moe.num_experts - resident.get(l.index, 0)) * blobs[l.index]
               for l in geom.moe_layers)
