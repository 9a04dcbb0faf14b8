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

from moefit.memory.host import device_expert_path
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
#: average (the (token, expert) pairs over the layer's experts), by the ggml type of the
#: expert's matrices (the smallest over gate, up and down); larger chunks (prefill) run
#: expert by expert, each matrix dequantized (C, :func:`moefit.runtime.kernels.qmatmul.dequantize`)
#: and multiplied by ``torch.mm`` (oneDNN's bf16 kernels). Measured on the CI machine
#: (AMD EPYC, one thread) with the 1.37B Qwen3-MoE-shaped files of
#: ``benchmarks/vs_llamacpp.py`` (hidden 1024, 64 experts of width 512, 8 active), one
#: chunk of 16 .. 256 tokens both ways: the batched kernel is as fast or faster up to
#: 4-6 tokens per expert for the K-quants (Q4_K_M: 84 against 124 ms at 2 per expert,
#: 193 / 191 ms at 6, 274 / 218 ms at 9), 20 for Q8_0 (434 / 492 ms at 20, 541 / 494 ms at
#: 24) and 32 or more for Q4_0 (570 / 650 ms at 32) and BF16 (639 / 644 ms at 32). Q5_K
#: takes the K-quants' figure and F16 / F32 BF16's (the same kernels, not measured apart);
#: the other types the kernels read keep the 8 of the first measurement. The low-bit
#: types, since their super-blocks are unpacked once per 8 tokens of an expert
#: (``benchmarks``-style interleaved pairs of one layer, hidden 1024, 64 experts of 512, 8
#: active, one thread, a loaded machine; time ratio batched / expert by expert): Q3_K 0.68
#: at 32 tokens per expert, 1.07 at 64; Q2_K 0.68 / 1.02; IQ4_XS 0.59 / 0.83 (hidden 2048,
#: 32 experts of 768: 0.90 at 64); IQ2_XXS 0.72 / 1.17; IQ3_XXS 0.67 at 16, 1.09 at 32;
#: IQ1_M 0.68 / 1.18 (the other IQ types, not measured, keep 8). Whole model again
#: (``benchmarks/vs_llamacpp.py``'s 1.37B ``--mixes`` files, one thread, a loaded machine,
#: 5 interleaved pairs of one prefill chunk, time ratio at threshold B / at threshold A):
#: Q4_K_M (Q4_K / Q6_K experts) batched against expert by expert 0.72 at 8 tokens per
#: expert, 1.20 at 16, 1.22 at 24 (both ways 1.02 at 32: the noise), hence 8 for the
#: K-quants (Q5_K with them).
TOKENS_PER_EXPERT = {"Q4_K": 8, "Q5_K": 8, "Q6_K": 8, "Q8_0": 20, "Q4_0": 32,
                     "BF16": 32, "F16": 32, "F32": 32, "Q2_K": 48, "Q3_K": 48, "IQ4_XS": 64,
                     "IQ2_XXS": 48, "IQ3_XXS": 24, "IQ1_M": 24}
DEFAULT_TOKENS_PER_EXPERT = 8


def max_tokens_per_expert(fmt: StoredExpert) -> int:
    """Average tokens per expert up to which :func:`run_layer` runs a layer whose experts
    are stored as ``fmt``: the harmonic mean (rounded down) of its three matrices'
    :data:`TOKENS_PER_EXPERT` (gate, up and down have the same number of values), so a layer
    of one type takes that type's figure. Not the smallest: a Q3_K_M layer (Q3_K gate / up,
    48; Q4_K down, 8) is faster batched up to 16-24 tokens per expert (whole model, as for
    the table: time ratio batched / expert by expert 0.60 at 8, 0.76 at 16, 1.02 at 24, 1.26
    at 32); the harmonic mean gives it 18, the smallest 8."""
    inv = sum(1 / TOKENS_PER_EXPERT.get(p.qtype, DEFAULT_TOKENS_PER_EXPERT) for p in (fmt.gate, fmt.up, fmt.down))
    return int(3 / inv + 1e-9)


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
    return x.shape[0] * experts_per_token <= max_tokens_per_expert(fmt) * cache.host.experts[layer]


def scratch_bytes(tokens: int, hidden: int, inter: int, act: torch.dtype) -> int:
    """Workspace bytes :func:`run_layer` takes for a chunk of ``tokens``: the bytes of the
    one-by-one path's buffers for the chunk (``[T, H]`` input rows, ``[T, 2I]`` gate/up,
    ``[T, H]`` output, and its ``[T, H]`` fp32 copy unless ``act`` is fp32), and at least
    the kernel's token rows and one pair (:func:`moefit.runtime.kernels.qmatmul.moe_scratch_bytes`)."""
    e = act.itemsize
    old = tokens * (2 * hidden * e + 2 * inter * e + (0 if act == torch.float32 else 4 * hidden))
    return max(old, qmatmul.moe_scratch_bytes(tokens, hidden, inter, 1))


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
