"""One call per MoE layer on the CPU: every routed expert of a step, batched, in its stored format.

:func:`run_layer` takes the router's top-k choice of a chunk (``ids``, ``weights``
``[T, k]``), groups the (token, expert) pairs by expert with one stable sort, reads the
used experts back once (one host read per layer, none per expert), counts hits and misses
as :meth:`~moefit.runtime.moe.cache.ExpertCache.run` does (once per expert per call, the LRU
order refreshed), and hands the addresses of the experts' blobs -- the resident slot, or
the host blob for a miss -- to :func:`moefit.runtime.kernels.qmatmul.moe`, which runs gate, up,
SwiGLU, down and the weighted combine for all of them in C. It applies where the expert
blobs and the activations are CPU memory (a simulated device, misses computed on the
host): :func:`applies` says when.

Plain float blobs (bf16 / fp16 / fp32 checkpoints, ``[gate | up | down]`` rows) are
described by a :class:`~moefit.runtime.kernels.quant.StoredExpert` of that float type, so one
kernel serves both.

Scratch: the kernel's buffers (:func:`moefit.runtime.kernels.qmatmul.moe_scratch_bytes` per token)
come from the staging workspace, in place of the per-expert buffers of the one-by-one path
(its input rows ``[T, H]``, gate/up output ``[T, 2I]``, output ``[T, H]`` and fp32 copy),
so the staging the planner prices for a chunk covers it: :func:`scratch_bytes`.
"""

from __future__ import annotations

import functools

import torch

from moefit.memory import cpu_kernels
from moefit.memory.host import device_expert_path
from moefit.runtime.buffers.workspace import ALIGN
from moefit.runtime.kernels import qmatmul
from moefit.runtime.kernels.linear import FLOAT_TYPES
from moefit.runtime.kernels.quant import StoredExpert


@functools.lru_cache(maxsize=None)
def _plain_format(inter: int, hidden: int, qtype: str) -> StoredExpert:
    return StoredExpert.pack(inter, hidden, qtype, qtype, qtype)


def layer_format(cache, layer: int) -> StoredExpert | None:
    """The blob layout of ``layer``'s experts: its stored format, or the float layout of a
    plain blob; None for a blob dtype the kernels do not read."""
    fmt = cache.host.formats.get(layer)
    if fmt is not None:
        return fmt
    qtype = FLOAT_TYPES.get(cache.host.dtype)
    return _plain_format(cache.host.inter[layer], cache.host.hidden, qtype) if qtype else None


#: :func:`run_layer` runs a chunk whose experts get at most this many tokens each on
#: average (the figures and their measurement: :data:`moefit.memory.cpu_kernels.
#: TOKENS_PER_EXPERT`, shared with the speed model); larger chunks run expert by expert.
TOKENS_PER_EXPERT = cpu_kernels.TOKENS_PER_EXPERT
DEFAULT_TOKENS_PER_EXPERT = cpu_kernels.DEFAULT_TOKENS_PER_EXPERT


def max_tokens_per_expert(fmt: StoredExpert) -> int:
    """Average tokens per expert up to which :func:`run_layer` runs a layer whose experts
    are stored as ``fmt`` (:func:`moefit.memory.cpu_kernels.tokens_per_expert` of its three
    matrices' types)."""
    return cpu_kernels.tokens_per_expert(p.qtype for p in (fmt.gate, fmt.up, fmt.down))


def applies(cache, layer: int, x: torch.Tensor, experts_per_token: int) -> bool:
    """Whether :func:`run_layer` runs ``layer`` for activations ``x`` ``[T, H]``: the C
    kernels are built and read ``x``'s dtype (fp32 / fp16 / bf16:
    :func:`moefit.runtime.kernels.qmatmul.reads`), the device expert path is not forced
    (:data:`moefit.memory.host.EXPERT_PATH_ENV`), ``x`` and every blob the layer may read are CPU memory (misses
    computed on the host: ``--miss-policy cpu``, or ``auto`` in a step that keeps them
    there: :meth:`~moefit.runtime.moe.cache.ExpertCache.on_host`), the kernels read the layer's types and
    widths, and ``T x experts_per_token`` is at most :func:`max_tokens_per_expert` per
    expert of the layer."""
    if (cache is None or x.device.type != "cpu" or not cache.on_host(layer, x.shape[0]) or not qmatmul.reads(x)
            or device_expert_path(x.device.type) or not qmatmul.available()):
        return False
    if cache.host.mapped:       # misses gather from the file's pages: expert by expert
        return False
    if any(s.device.type != "cpu" for s in cache.slots.get(layer, [])[:1]):
        return False
    fmt = layer_format(cache, layer)
    if fmt is None or not all(qmatmul.supports(p.qtype, p.cols) for p in (fmt.gate, fmt.up, fmt.down)):
        return False
    return cpu_kernels.batched_experts(x.shape[0], experts_per_token, cache.host.experts[layer],
                                       (p.qtype for p in (fmt.gate, fmt.up, fmt.down)))


def scratch_bytes(tokens: int, hidden: int, inter: int, act: torch.dtype) -> int:
    """Workspace bytes :func:`run_layer` takes for a chunk of ``tokens``: the bytes of the
    one-by-one path's buffers for the chunk (``[T, H]`` input rows, ``[T, 2I]`` gate/up,
    ``[T, H]`` output, and its ``[T, H]`` fp32 copy unless ``act`` is fp32), and at least
    the kernel's token rows and one pair (:func:`moefit.runtime.kernels.qmatmul.moe_scratch_bytes`)."""
    e = act.itemsize
    old = tokens * (2 * hidden * e + 2 * inter * e + (0 if act == torch.float32 else 4 * hidden))
    return max(old, qmatmul.moe_scratch_bytes(tokens, hidden, inter, 1))


#: torch's own temporaries of :func:`run_layer`, allocated outside the workspace while the
#: layer's scratch is taken: ``torch.sort``'s values and indices (16 bytes a (token, expert)
#: pair), ``tok`` (8), ``wsel`` (4) and the stable sort's own buffers; measured 44 bytes a
#: pair (22664 bytes for 512 pairs of an 8-expert layer, torch's profiler in
#: tests/runtime/test_staging_bound_gguf.py), so 64 a pair and 4 KiB for the per-expert
#: arrays (``used``, ``counts``, ``bounds``, the blob pointers) are left free of the scratch.
RUN_LAYER_TEMP_BYTES_PER_PAIR = 64
RUN_LAYER_TEMP_BYTES = 4096


def layer_scratch_bytes(ws, tokens: int, hidden: int, inter: int, pairs: int, act: torch.dtype) -> int:
    """Workspace bytes a layer's :func:`run_layer` takes from ``ws`` for a chunk of ``tokens``
    (``pairs`` (token, expert) pairs): :func:`scratch_bytes` at least, and up to every pair
    at once (:func:`moefit.runtime.kernels.qmatmul.moe_scratch_bytes`) where the workspace
    has that room free beyond torch's own temporaries of the layer
    (:data:`RUN_LAYER_TEMP_BYTES_PER_PAIR`), so that a prefill chunk's experts run whole
    (a chunk of pairs cuts an expert's tokens in two, and each piece unpacks its rows
    again)."""
    base = scratch_bytes(tokens, hidden, inter, act)
    want = qmatmul.moe_scratch_bytes(tokens, hidden, inter, pairs)
    room = (ws.capacity - (-(-ws.offset // ALIGN) * ALIGN) - 8 * ALIGN
            - pairs * RUN_LAYER_TEMP_BYTES_PER_PAIR - RUN_LAYER_TEMP_BYTES)
    return max(base, min(want, room))


def run_layer(cache, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              acc: torch.Tensor, scratch: torch.Tensor, threads: int | None = None) -> torch.Tensor:
    """``acc[t] += sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`` for ``layer``.

    Args:
        cache: the :class:`~moefit.runtime.moe.cache.ExpertCache` (hits / misses counted).
        x: ``[T, H]`` fp32, fp16 or bf16 (contiguous, CPU).
        ids: int64 ``[T, k]``; weights: fp32 ``[T, k]``.
        acc: fp32 ``[T, H]``, added to.
        scratch: uint8, at least :func:`moefit.runtime.kernels.qmatmul.moe_scratch_bytes` ``(T, H, I, 1)``.

    Returns ``acc``.
    """
    k = ids.shape[1]
    flat = ids.reshape(-1)
    by_expert, order = torch.sort(flat, stable=True)
    used, counts = torch.unique_consecutive(by_expert, return_counts=True)
    used_l = used.tolist()                                       # the one host read
    slots = cache.slots.get(layer, [])
    ptrs = [slots[s].data_ptr() if s is not None else cache.host.blob(layer, e).data_ptr()
            for e, s in zip(used_l, cache.lookup(layer, used_l))]
    bounds = torch.zeros(len(used_l) + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=bounds[1:])
    tok = torch.div(order, k, rounding_mode="floor")
    wsel = weights.reshape(-1).index_select(0, order)
    if wsel.dtype != torch.float32:
        wsel = wsel.float()
    return qmatmul.moe(x.contiguous(), torch.tensor(ptrs, dtype=torch.int64), bounds, tok, wsel, acc,
                       layer_format(cache, layer), scratch, threads)
