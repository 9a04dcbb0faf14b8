"""One MoE layer on a device that is not CPU memory (CUDA): every routed expert of a step
batched, the misses computed on the host while the device works.

:func:`run_layer` is :func:`moefit.runtime.moe.batch.run_layer`'s design in torch, for a
device the C kernels cannot read (docs/design.md, runtime contract):

1. **One sort, one host read.** The step's ``T x k`` (token, expert) pairs are sorted by
   expert on the device (a stable sort: each expert sees its tokens in order) and the
   boundaries of every expert's pairs are found there (``searchsorted``, a fixed-size
   result: no data-dependent shape, so no hidden synchronisation); ``bounds.tolist()`` is
   the layer's one host read. Hits and misses are counted from it as
   :meth:`~moefit.runtime.moe.cache.ExpertCache.run` counts them (once per expert per call,
   the LRU order refreshed: :meth:`~moefit.runtime.moe.cache.ExpertCache.lookup`).
2. **Misses first to the host.** When any used expert is not resident, the step's rows
   ``[T, H]`` and the sorted pairs' tokens and weights are copied to the host buffer the
   planner prices (:func:`moefit.memory.host.miss_host_bytes`, pinned on CUDA, so the copies
   are asynchronous) and an event is recorded after them.
3. **Hits enqueued.** The resident experts run in groups of consecutive experts (in the
   sorted order). Where the Triton kernels run and read the layer's types (a CUDA device:
   :meth:`~moefit.runtime.kernels.quant.StoredExpert.fused`), each expert's gate, up and
   down are three fused products on its slot's stored blocks, on its own contiguous rows,
   and nothing is dequantized. Otherwise a stored (GGUF, fp8) format is dequantized ``G`` experts at a time into
   the staging workspace's fixed region (free while the experts run: attention tiles, the
   logits and the dense matrices use it at other times): each part's quantized bytes of
   the group are gathered into one buffer and dequantized by one call of
   :func:`moefit.runtime.kernels.quant.dequantize` (its kernels take any number of blocks: a
   leading batch of experts is just more blocks; its tiles stay at most one matrix, the
   kernels' scratch the plan prices, so the torch kernels still run once per matrix and
   what the group saves is the calls, the gathers and the products), or, when the region holds the matrices
   but not also their bytes (or for block-scaled fp8, whose scales are per matrix), each
   expert's part straight from its blob. ``G`` is what the region holds
   (:func:`group_size`), so the plan needs no new term. Then, when no expert of the layer
   gets more than :data:`PAD_MAX_TOKENS` tokens (decode; small prefill pieces), the group's
   rows are padded to its busiest expert's count and gate, up and down are three
   ``torch.bmm`` (the padding rows repeat a real pair of the same expert with weight 0);
   otherwise (prefill) each expert multiplies its own contiguous rows (``torch.mm`` on the
   same dequantized buffer). Plain float blobs (bf16 / fp32 checkpoints) are multiplied
   where they lie, expert by expert on views of their slots: copying them to batch them
   would read and write every weight once more in a step that is bound by reading them.
   SwiGLU and the routing weight are applied over the whole group, and its outputs are
   combined into the fp32 accumulator by one ``index_add_``. Every launch is
   asynchronous; nothing waits on the device per expert.
4. **Misses on the host while the device works.** After the hit work is enqueued, the host
   waits for the event of step 2 only (the copies, not the hit products), runs the misses
   as a CPU device runs its experts: a decode-sized step with the C kernels (``qmatmul.moe``
   on the host blobs, as :mod:`moefit.runtime.moe.batch` does), a prefill chunk (or where the
   kernels do not apply) dequantized and multiplied expert by expert
   (:meth:`~moefit.runtime.moe.cache.ExpertCache.apply`), then copies the fp32 result back
   (asynchronous from pinned memory) and adds it. The host buffer is reused by the next
   layer only after that layer's host read, which the stream orders after this copy.

Rows budget: a group's buffers (input rows, gate/up output, output and its fp32 copy, as
the expert-by-expert path takes for ``T`` rows; the planner's MoE dispatch step) are taken
for at most ``rows`` pair rows, the plan's prefill chunk: the workspace holds that many for
every step, so a decode step batches ``k`` experts x its tokens, and a full chunk takes
what the expert-by-expert path takes. The padded mode's index tables (an int64 position and
a weight mask per padded row) come out of the same budget.

On a CPU device with ``MOEFIT_EXPERT_PATH=device`` (:data:`moefit.memory.host.EXPERT_PATH_ENV`)
the same code runs on CPU tensors ("host" and "device" are one memory, the copies are
memory copies and the event a no-op), so the tests exercise it; nothing of it is measured
on a GPU. Not run here (:func:`applies`): ``--miss-policy copy`` (the weight arena's
swaps stay expert by expert), ``--host-experts mmap`` (misses gathered from the file one
expert at a time) and gpt-oss's clamped SwiGLU with biases
(:mod:`moefit.runtime.moe.gpt_oss`).

CUDA graphs / ``torch.compile``: not built. The host read of step 1 decides what runs
(which slots, how many groups, whether the host works), so a whole decode step cannot be
captured; the parts between two reads (a layer's attention and router) take their
buffers from the workspace by host-side offsets and attend over per-sequence lengths that
change every step, so a graph per part would need a capture per batch shape and length
bucket. That is worth building only against a measurement on a GPU, which this project
has not made.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moefit.memory import cpu_kernels
from moefit.memory.host import device_expert_path, miss_host_takes
from moefit.memory.staging import DEQUANT_TILE_ELEMS, span
from moefit.runtime.kernels import qmatmul
from moefit.runtime.weights import split_blob
from moefit.runtime.moe.batch import layer_format
from moefit.runtime.kernels.quant import FP8, StoredExpert, dequantize

#: a layer's hit groups run as padded ``torch.bmm`` when no expert gets more tokens than
#: this (decode: one per sequence), else expert by expert on contiguous rows (prefill);
#: the first bound of the CPU's batched layer, not measured on a GPU
PAD_MAX_TOKENS = 8


def applies(cache, layer: int, x: torch.Tensor, clamped: bool = False) -> bool:
    """Whether :func:`run_layer` runs ``layer`` for activations ``x``: an expert cache with
    misses computed on the host (``--miss-policy cpu``, or ``auto`` in a step that keeps them
    there: :meth:`~moefit.runtime.moe.cache.ExpertCache.on_host`; blobs in host memory, not mapped),
    a plain SwiGLU (``clamped``: gpt-oss's is not), and ``x`` on a device that is not CPU
    memory, or a CPU device forced onto this path (:func:`moefit.memory.host.device_expert_path`).
    Every blob layout runs (stored formats dequantize in torch, plain blobs of any float
    dtype multiply as they are), so ``layer`` (as the other paths' ``applies`` take it) does
    not decide."""
    if cache is None or clamped or not cache.on_host(layer, x.shape[0]) or cache.host.mapped:
        return False
    return device_expert_path(x.device.type)


def group_size(room: int, fmt: StoredExpert, act: torch.dtype) -> tuple[int, bool]:
    """``(G, gather)``: how many experts of layout ``fmt`` are dequantized at once into
    ``room`` bytes of the fixed region, and whether each part's quantized bytes are gathered
    there too (one dequantization call per part for the group). Gathering when the region
    holds at least one matrix and its bytes; else (or for fp8) each expert's part
    dequantized straight from its blob, as many matrices as the region holds (at least one:
    the planner sizes the region for one, :func:`moefit.memory.staging.fixed_region_bytes`)."""
    mat = fmt.gate.rows * fmt.gate.cols * act.itemsize
    parts = (fmt.gate, fmt.up, fmt.down)
    raw = max(p.nbytes for p in parts)
    g = 0
    if all(p.qtype != FP8 for p in parts):
        while span([(g + 1) * mat, (g + 1) * raw]) <= room:
            g += 1
    if g:
        return g, True
    return max(1, room // mat), False


def _dequant_group(fmt_part, blobs: list[torch.Tensor], buf: torch.Tensor, raw: torch.Tensor | None) -> torch.Tensor:
    """The part ``fmt_part`` of each blob in ``blobs`` dequantized into ``buf`` (flat, of
    the compute dtype) -> ``[g, rows, cols]``; one call over the gathered bytes in ``raw``
    when given, else one per expert."""
    g, rows, cols = len(blobs), fmt_part.rows, fmt_part.cols
    out = buf[:g * rows * cols].view(g, rows, cols)
    if raw is None:
        for j, b in enumerate(blobs):
            fmt_part.dequantize_into(b, out[j])
        return out
    n, off = fmt_part.nbytes, fmt_part.offset
    # one multi-tensor copy (a single launch on CUDA) gathers the group's bytes of this part
    torch._foreach_copy_([raw[j * n:(j + 1) * n] for j in range(g)], [b[off:off + n] for b in blobs],
                         non_blocking=True)
    return dequantize(raw[:g * n], fmt_part.qtype, (g, rows, cols), out=out,
                      tile_elems=min(rows * cols, DEQUANT_TILE_ELEMS))


def _groups(hits: list[tuple[int, int, int, int]], g_max: int, padded: bool,
            budget: int, row_bytes: int) -> list[list[tuple[int, int, int, int]]]:
    """Runs of consecutive hits (``(expert, slot, start, count)`` in sorted order; a miss
    between two ends a run, so each run's pairs are contiguous) cut into groups of at most
    ``g_max`` experts whose rows fit ``budget`` bytes of ``row_bytes`` per row (padded: each
    expert's rows are the group's busiest count)."""
    out: list[list] = []
    cur: list = []
    end = None
    for h in hits:
        _, _, s0, n = h
        trial = cur + [h]
        rows = len(trial) * max(c for *_, c in trial) if padded else sum(c for *_, c in trial)
        if cur and (s0 != end or len(trial) > g_max or rows * row_bytes > budget):
            out.append(cur)
            trial = [h]
        cur, end = trial, s0 + n
    if cur:
        out.append(cur)
    return out


class _Fence:
    """A point in the device's stream the host can wait for (a CUDA event); on a CPU device
    every operation has finished when it returns, so waiting is nothing."""

    def __init__(self, device: torch.device):
        self.event = torch.cuda.Event() if device.type == "cuda" else None
        if self.event is not None:      # the stream of ``device`` (cuda:1 need not be current)
            self.event.record(torch.cuda.current_stream(device))

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


def run_layer(cache, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              acc: torch.Tensor, ws, rows: int, host_ws=None) -> torch.Tensor:
    """``acc[t] += sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`` for ``layer`` (module
    docstring).

    Args:
        cache: the :class:`~moefit.runtime.moe.cache.ExpertCache` (hits / misses counted).
        x: ``[T, H]`` in the compute dtype, on the device.
        ids: int64 ``[T, k]``; weights: ``[T, k]`` in the compute dtype (rounded as the
            expert-by-expert path combines them).
        acc: fp32 ``[T, H]``, added to.
        ws: the staging workspace (the pairs, the group buffers; the fixed region holds the
            dequantized experts).
        rows: the pair rows the group buffers may take (the plan's prefill chunk, >= ``T``).
        host_ws: the workspace over the host buffer of the misses
            (:func:`moefit.memory.host.miss_host_takes`); needed when the layer has experts
            that are not resident.

    Returns ``acc``. Raises BudgetError (from the workspaces) when a buffer exceeds what the
    plan priced, ValueError when a miss has no host buffer.
    """
    t, k = ids.shape
    act, i64 = x.dtype, torch.int64
    p = t * k
    n_exp = cache.host.experts[layer]
    with ws.scope():
        order = ws.take((p,), i64)                                       # pairs by expert
        wsel = ws.take((p,), act)                                        # their weights
        bounds = ws.take((n_exp + 1,), i64)                              # expert e: [b[e], b[e+1])
        with ws.scope():
            keys = ws.take((p,), i64)
            torch.sort(ids.reshape(-1), stable=True, out=(keys, order))
            torch.searchsorted(keys, torch.arange(n_exp + 1, out=ws.take((n_exp + 1,), i64)), out=bounds)
        torch.index_select(weights.reshape(-1), 0, order, out=wsel)
        tok = order.div_(k, rounding_mode="floor")                       # token of each pair
        edges = bounds.tolist()                                          # the one host read
        used = [e for e in range(n_exp) if edges[e + 1] > edges[e]]
        where_is = cache.lookup(layer, used)
        hits = [(e, s, edges[e], edges[e + 1] - edges[e]) for e, s in zip(used, where_is) if s is not None]
        misses = [e for e, s in zip(used, where_is) if s is None]
        if misses and host_ws is None:
            raise ValueError(f"layer {layer}: experts {misses[:4]} are not resident and no host "
                             "buffer was given for the misses")
        _Hits(cache, layer, x, tok, wsel, acc, ws, rows, hits).run(
            lambda: _to_host(host_ws, cache, layer, x, tok, wsel, k) if misses else None,
            lambda host: _run_misses(host, cache, layer, misses, edges, acc, ws))
    return acc


class _Hits:
    """The resident experts of one layer call (module docstring, step 3)."""

    def __init__(self, cache, layer, x, tok, wsel, acc, ws, rows, hits):
        self.cache, self.layer, self.x, self.tok, self.wsel, self.acc, self.ws = cache, layer, x, tok, wsel, acc, ws
        self.h, self.act = x.shape[1], x.dtype
        self.inter = cache.host.inter[layer]
        self.fmt = cache.host.formats.get(layer)
        self.slots = cache.slots.get(layer, [])
        where = cache.slot_device.get(layer, [])
        self.where = where
        self.remote = [hh for hh in hits if where and where[hh[1]]]      # slots on another device
        self.local = [hh for hh in hits if not (where and where[hh[1]])]
        self.up = self.act != torch.float32
        # bytes of one pair row of the group buffers: input, gate/up output, output, fp32 copy
        self.row_bytes = (2 * self.h + 2 * self.inter) * self.act.itemsize + (4 * self.h if self.up else 0)
        self.budget = rows * self.row_bytes

    def run(self, to_host, misses) -> None:
        """Plan the groups and copy the padded mode's index tables (the stream is idle: just
        after the host read), start the misses' copies to the host (``to_host``), enqueue
        the hit groups, then run the misses (``misses``) while the device works."""
        ws, region, fmt, act = self.ws, self.ws.fixed, self.fmt, self.act
        with region.scope():
            buf = raw = None
            padded = False
            g_max = max(1, len(self.local))
            if fmt is not None and fmt.fused(self.x.device):
                fmt = None        # three fused products per expert on its slot's stored blocks
            if fmt is not None:
                g_max, gather = group_size(region.capacity - region.offset, fmt, act)
                buf = region.take((g_max * fmt.gate.rows * fmt.gate.cols,), act)
                if gather:
                    raw = region.take((g_max * max(fmt.gate.nbytes, fmt.up.nbytes, fmt.down.nbytes),), torch.uint8)
                padded = bool(self.local) and max(c for *_, c in self.local) <= PAD_MAX_TOKENS
            table_row = 2 * (8 + act.itemsize)       # position, mask, token, weight per padded row
            worst = len(self.local) * PAD_MAX_TOKENS * table_row
            padded = padded and worst < self.budget // 2
            budget = self.budget - (worst if padded else 0)
            groups = _groups(self.local, g_max, padded, budget, self.row_bytes)
            tables = self._tables(groups) if padded else None
            host = to_host()
            off = 0
            for grp in groups:
                with ws.scope():
                    if padded:
                        n = len(grp) * max(c for *_, c in grp)
                        self._padded(grp, buf, raw, tables[0][off:off + n], tables[1][off:off + n])
                        off += n
                    else:
                        self._contiguous(grp, buf, raw)
        with ws.scope():
            for e, s, s0, n in self.remote:   # an expert in a slot of another device runs there
                with ws.scope():
                    xg = torch.index_select(self.x, 0, self.tok[s0:s0 + n], out=ws.take((n, self.h), act))
                    ye = self.cache.run_on(self.where[s], self.layer, xg, self.slots[s],
                                           ws.take((n, self.h), act))
                    self._combine(ye, self.wsel[s0:s0 + n], self.tok[s0:s0 + n])
        if host is not None:
            misses(host)

    def _tables(self, groups) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens int64, weights) of every padded row of ``groups``, on the device: built
        from one host -> device copy of the rows' pair positions and masks (a padding row
        repeats its expert's first pair, weight 0)."""
        pos, keep = [], []
        for grp in groups:
            m = max(c for *_, c in grp)
            for _, _, s0, c in grp:
                pos += [s0 + min(r, c - 1) for r in range(m)]
                keep += [1.0] * c + [0.0] * (m - c)
        ws, n, act = self.ws, len(pos), self.act
        pos_d = ws.take((n,), torch.int64).copy_(torch.tensor(pos, dtype=torch.int64))
        keep_d = ws.take((n,), act).copy_(torch.tensor(keep, dtype=act))
        tg = torch.index_select(self.tok, 0, pos_d, out=ws.take((n,), torch.int64))
        wg = torch.index_select(self.wsel, 0, pos_d, out=ws.take((n,), act)).mul_(keep_d)
        return tg, wg

    def _combine(self, ye, w, tok) -> None:
        """``acc[tok] += w * ye``: the weight in the compute dtype, the add in fp32 (as the
        expert-by-expert path combines)."""
        ye.mul_(w[:, None])
        self.acc.index_add_(0, tok, self.ws.take(ye.shape, torch.float32).copy_(ye) if self.up else ye)

    def _contiguous(self, grp, buf, raw) -> None:
        """A group whose experts each multiply their own rows (contiguous in the sorted pairs)."""
        ws, h, act, inter, fmt = self.ws, self.h, self.act, self.inter, self.fmt
        s0 = grp[0][2]
        n = sum(c for *_, c in grp)
        tg = self.tok[s0:s0 + n]
        xg = torch.index_select(self.x, 0, tg, out=ws.take((n, h), act))              # [n, H]
        gu = ws.take((n * 2 * inter,), act)
        ye = ws.take((n, h), act)
        spans = [(a - s0, a - s0 + c) for _, _, a, c in grp]
        blobs = [self.slots[s] for _, s, _, _ in grp]
        if fmt is not None and fmt.fused(self.x.device):
            g, u = gu[:n * inter].view(n, inter), gu[n * inter:].view(n, inter)
            for part, src, dst in ((fmt.gate, xg, g), (fmt.up, xg, u)):
                for (a, b), blob in zip(spans, blobs):
                    part.matmul(blob, src[a:b], dst[a:b])
            F.silu(g, inplace=True).mul_(u)
            for (a, b), blob in zip(spans, blobs):
                fmt.down.matmul(blob, g[a:b], ye[a:b])
        elif fmt is None:                   # plain float: the slots' own matrices
            gu2 = gu.view(n, 2 * inter)
            mats = [split_blob(b, inter, h) for b in blobs]
            for (a, b), (gate_up, _) in zip(spans, mats):
                torch.mm(xg[a:b], gate_up.t(), out=gu2[a:b])
            g, u = gu2[:, :inter], gu2[:, inter:]
            F.silu(g, inplace=True).mul_(u)
            for (a, b), (_, down) in zip(spans, mats):
                torch.mm(g[a:b], down.t(), out=ye[a:b])
        else:
            g, u = gu[:n * inter].view(n, inter), gu[n * inter:].view(n, inter)
            for part, src, dst in ((fmt.gate, xg, g), (fmt.up, xg, u)):
                w = _dequant_group(part, blobs, buf, raw)
                for j, (a, b) in enumerate(spans):
                    torch.mm(src[a:b], w[j].t(), out=dst[a:b])
            F.silu(g, inplace=True).mul_(u)
            w = _dequant_group(fmt.down, blobs, buf, raw)
            for j, (a, b) in enumerate(spans):
                torch.mm(g[a:b], w[j].t(), out=ye[a:b])
        self._combine(ye, self.wsel[s0:s0 + n], tg)

    def _padded(self, grp, buf, raw, tg, wg) -> None:
        """A group of a stored format as three ``torch.bmm``, each expert's rows padded to
        the group's busiest count ``M`` (``tg`` / ``wg``: the padded rows' tokens and weights)."""
        ws, h, act, inter, fmt = self.ws, self.h, self.act, self.inter, self.fmt
        g, m = len(grp), max(c for *_, c in grp)
        n = g * m
        xg = torch.index_select(self.x, 0, tg, out=ws.take((n, h), act)).view(g, m, h)
        gu = ws.take((2 * n * inter,), act)
        gg, uu = gu[:n * inter].view(g, m, inter), gu[n * inter:].view(g, m, inter)
        ye = ws.take((n, h), act)
        blobs = [self.slots[s] for _, s, _, _ in grp]
        torch.bmm(xg, _dequant_group(fmt.gate, blobs, buf, raw).transpose(1, 2), out=gg)
        torch.bmm(xg, _dequant_group(fmt.up, blobs, buf, raw).transpose(1, 2), out=uu)
        F.silu(gg, inplace=True).mul_(uu)
        torch.bmm(gg, _dequant_group(fmt.down, blobs, buf, raw).transpose(1, 2), out=ye.view(g, m, h))
        self._combine(ye, wg, tg)


def _to_host(host_ws, cache, layer, x, tok, wsel, k) -> dict:
    """Start copying the step's rows ``[T, H]`` and its sorted pairs' tokens and weights
    into the host buffer (asynchronous from pinned memory on CUDA) and mark the stream
    after them. The misses run through the C kernels when they read the layer's blobs and
    ``x``'s dtype and the step gives the experts at most
    :func:`moefit.memory.cpu_kernels.tokens_per_expert` tokens each on average (a CPU
    device's choice, measured there), else dequantized and multiplied expert by expert
    (:func:`moefit.memory.host.miss_host_bytes` prices both).
    Returns what :func:`_run_misses` needs."""
    t, h = x.shape
    p = tok.numel()
    inter = cache.host.inter[layer]
    lay = layer_format(cache, layer)
    c_kernels = (lay is not None
                 and cpu_kernels.batched_pairs(p, cache.host.experts[layer],
                                               (q.qtype for q in (lay.gate, lay.up, lay.down)))
                 and qmatmul.available() and qmatmul.reads(x)
                 and all(qmatmul.supports(q.qtype, q.cols) for q in (lay.gate, lay.up, lay.down)))
    stored = cache.host.formats.get(layer) is not None
    host_ws.begin_chunk()
    takes = miss_host_takes(h, inter, k, t, c_kernels, stored)
    if stored and not c_kernels:
        takes = takes[:-1]       # the dequantized matrix: StoredExpert.swiglu takes it, last
    bufs = host_ws.take_layout(takes, x.dtype)
    xh = bufs[0].view(t, h).copy_(x, non_blocking=True)
    tokh = bufs[2].copy_(tok, non_blocking=True)
    wh = bufs[3].copy_(wsel, non_blocking=True)
    return dict(xh=xh, res=bufs[1].view(t, h), tokh=tokh, wh=wh, tok_m=bufs[4], w_m=bufs[5],
                rest=bufs[6:], c=c_kernels, fmt=lay, fence=_Fence(x.device), ws=host_ws)


def _run_misses(host, cache, layer, misses, edges, acc, ws) -> None:
    """The misses on the host once their rows are there (module docstring, step 4): the
    fp32 result copied back and added to ``acc``."""
    host["fence"].wait()
    xh, res, tokh, wh = host["xh"], host["res"], host["tokh"], host["wh"]
    t, h = xh.shape
    res.zero_()
    spans = [(edges[e], edges[e + 1]) for e in misses]
    if host["c"]:
        n = sum(b - a for a, b in spans)
        tok_m, w_m = host["tok_m"][:n], host["w_m"][:n]
        torch.cat([tokh[a:b] for a, b in spans], out=tok_m)
        torch.cat([wh[a:b] for a, b in spans], out=w_m)
        bounds = torch.zeros(len(spans) + 1, dtype=torch.int64)
        torch.cumsum(torch.tensor([b - a for a, b in spans], dtype=torch.int64), 0, out=bounds[1:])
        ptrs = torch.tensor([cache.host.blob(layer, e).data_ptr() for e in misses], dtype=torch.int64)
        qmatmul.moe(xh, ptrs, bounds, tok_m, w_m, res, host["fmt"], host["rest"][0])
    else:
        xe_all, gu, ye_all, yf_all = host["rest"]
        up = xh.dtype != torch.float32
        for e, (a, b) in zip(misses, spans):
            n, te = b - a, tokh[a:b]
            xe = torch.index_select(xh, 0, te, out=xe_all[:n * h].view(n, h))
            with host["ws"].scope():      # a stored format's matrix, after the buffers
                y = cache.apply(layer, xe, cache.host.blob(layer, e), host["ws"], gu, ye_all[:n * h].view(n, h))
            y.mul_(wh[a:b, None])         # an fp32 copy of the compute dtype's weight: the same product
            res.index_add_(0, te, yf_all[:n * h].view(n, h).copy_(y) if up else y)
    acc.add_(ws.take((t, h), torch.float32).copy_(res, non_blocking=True))
