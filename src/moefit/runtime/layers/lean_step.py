"""The lean decode step: a step of one token per sequence on the CPU, in a few C calls per layer.

A decode step moves little data through many small operations; run as torch operations
(:func:`moefit.runtime.model.forward_batch`), each layer costs a few hundred Python and
torch dispatches (norms, projections, RoPE, the KV write, attention tiles, routing), a
fifth to a third of the step on the 2-core CI machine, none of it multithreaded. Here the
same layer is, for the ``T`` tokens of the step (one per sequence, ``T`` = the busy slots):

1. RMSNorm, with the residual add of the previous sublayer folded in (``mf_rmsnorm``);
2. the q / k / v projections (``mf_gemm_ex``: stored GGUF blocks or bf16 / fp16 / fp32
   weights, fp32 sums rounded once into the compute dtype, bias added as torch adds it);
3. q/k norm (``mf_rmsnorm`` per head or over all heads), then RoPE of q and k (cos / sin of
   the step's positions computed once for all layers, ``mf_rope_table``) and the K/V write
   into the cache cells of each token's slot, encoded in the plan's KV format
   (``mf_rope_kv``);
4. attention of each token over its own slot's cells (``mf_attn_decode``, threads over
   tokens x KV heads), the output projection;
5. RMSNorm (+ residual), the router, top-k routing grouped by expert (``mf_route``), and
   the routed experts in one call (``mf_moe``: each expert's rows read once for all the
   step's tokens routed to it);

then the final norm and the fp32 logits (``mf_gemm_ex``). Consecutive layers whose every
operation is one of these (attention without an output gate, routed experts without shared
ones: Qwen3-MoE, Mixtral, OLMoE) run as one call, ``mf_lean_layers``, which makes the same C
calls in the same order (bit-identical to the loop; tests/runtime/test_decode_step.py): a
foreign call converts its arguments in Python and releases and re-takes the interpreter
lock, and at a dozen calls a layer that was a third of a tiny model's step (0.52 -> 0.32 ms
for one sequence of the serve_load benchmark's model) and, while a server thread held the
lock, a wait after each call. The C code (``decode_step.c``)
rounds where the torch code rounds (every tensor the torch path stores in the compute dtype
is rounded there), so the two paths differ by fp32 summation order only;
tests/runtime/test_decode_step.py compares them on every family the runtime runs.

What the step does not cover stays in torch, layer by layer: Gated DeltaNet layers
(:func:`moefit.runtime.layers.deltanet.gated_deltanet`), shared experts and dense MLPs
(:func:`moefit.runtime.kernels.linear.linear`), the output gate, ``clip_qkv``. :func:`applies` says
when the whole step runs here: the C kernels are built, the device is the CPU, every
segment of the step is one token, the KV format has a C codec (plain, int8 / int4 blocks;
not fp8), the experts run on the CPU (:func:`moefit.runtime.moe.batch.applies`), and the
model sets no switch or spec field away from its default, and holds no layer kind or
weight, that this module does not know
(:data:`KNOWN_SWITCHES`, :data:`KNOWN_WEIGHTS`), so a family added later runs through
the torch path until it is taught here.

Buffers: every per-step tensor comes from the staging workspace (taken once per step, not
per layer, and for a step size already seen replayed: same offsets, no new views); the
attention keeps its scores on the C stack (blocks of 32 positions).
"""

from __future__ import annotations

import ctypes
import itertools
from dataclasses import MISSING, dataclass, fields

import torch
import torch.nn.functional as F

from moefit.ingest.families.common import Switches
from moefit.ingest.geometry import AttentionSpec, MoESpec
from moefit.memory.layer_kinds import Latent, Recurrent, kind_of
from moefit.runtime.moe import batch as moe_batch
from moefit.runtime.kernels import qmatmul
from moefit.runtime.kernels.lean_abi import CLayer, CMat, CStep, pchunk
from moefit.runtime.kernels.linear import FLOAT_TYPES
from moefit.runtime.layers.deltanet import gated_deltanet
from moefit.runtime.kernels.quant import StoredMatrix
from moefit.runtime.buffers.workspace import ALIGN

#: Most tokens (sequences) one lean step runs; larger steps take the torch path.
MAX_TOKENS = 64
#: Switches (:class:`~moefit.ingest.families.common.Switches`) this module implements,
#: and the values it implements them for.
KNOWN_SWITCHES = frozenset({"model_type", "dtype", "rms_eps", "qk_norm", "q_bias", "o_bias", "clip_qkv",
                            "renormalize", "tie_embeddings", "config", "prefix", "norm_offset"})
#: :class:`~moefit.runtime.weights.LayerWeights` fields this module reads (or hands to
#: :func:`~moefit.runtime.layers.deltanet.gated_deltanet`); a layer holding any other weight
#: takes the torch path.
KNOWN_WEIGHTS = frozenset({
    "input_norm", "post_norm", "q", "k", "v", "o", "q_bias", "k_bias", "v_bias", "o_bias", "q_norm", "k_norm",
    "router", "shared_gate", "shared_up", "shared_down", "shared_expert_gate", "dense_gate", "dense_up",
    "dense_down", "la_qkvz", "la_ba", "la_conv", "la_dt_bias", "la_a_log", "la_norm", "la_out"})
#: :class:`~moefit.ingest.geometry.AttentionSpec` and :class:`~moefit.ingest.geometry.MoESpec`
#: fields this module implements; a layer with another one set takes the torch path.
KNOWN_SPEC_FIELDS = frozenset({
    "kind", "num_heads", "num_kv_heads", "head_dim", "v_head_dim", "rotary_dim", "sliding_window",
    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
    "linear_conv_kernel", "state_dtype", "output_gate",
    "num_experts", "experts_per_token", "expert_intermediate", "num_shared_experts", "shared_intermediate"})
_KV_CODECS = {"plain": None, "q8": 8, "q4": 9}
_PLAIN = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _default(f):
    """The default of dataclass field ``f`` (None when it has none: a value is then always
    something this module does not implement)."""
    if f.default is not MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not MISSING else None


@dataclass
class _Mat:
    """A weight as the C products read it: address, ggml type, rows x cols (and the tensor,
    kept alive)."""

    ptr: int
    qtype: int
    rows: int
    cols: int
    keep: object


def _mat(w) -> _Mat | None:
    """``w`` (a contiguous bf16 / fp16 / fp32 tensor on the CPU, or a
    :class:`~moefit.runtime.kernels.quant.StoredMatrix`) as a :class:`_Mat`; None when the kernels
    cannot read it."""
    if isinstance(w, StoredMatrix):
        return _Mat(w.raw.data_ptr(), qmatmul.CTYPES[w.qtype], w.rows, w.cols, w) if qmatmul.supports(w.qtype, w.cols) \
            else None
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.device.type != "cpu" or not w.is_contiguous():
        return None
    name = FLOAT_TYPES.get(w.dtype)
    return _Mat(w.data_ptr(), qmatmul.CTYPES[name], w.shape[0], w.shape[1], w) if name else None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _view(ptr: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The ``n`` values of ``dtype`` at address ``ptr`` (a workspace buffer) as a tensor."""
    return torch.frombuffer((ctypes.c_char * (n * dtype.itemsize)).from_address(ptr), dtype=dtype)


def _cmat(m: _Mat) -> CMat:
    return CMat(m.ptr, m.qtype, m.rows, m.cols, 0)


class _Buffers:
    """One step size's workspace buffers, their addresses and C step structure
    (:meth:`LeanStep._buffers`)."""


class _Layer:
    """What one layer's step reads, resolved once: weight addresses, cache views, flags."""

    def __init__(self, mdl, l, lw):
        a, arch = l.attention, mdl.arch
        self.l, self.lw = l, lw
        #: Gated DeltaNet (its kind's class is Recurrent); else softmax attention over cells
        self.recurrent = isinstance(kind_of(a), Recurrent)
        self.moe = l.moe
        if not self.recurrent:
            heads, d, dv = a.num_heads, a.head_dim, a.v_head_dim
            self.heads, self.kvh, self.d, self.dv = heads, a.num_kv_heads, d, dv
            self.q = _mat(lw.q[:heads * d])
            self.gate = _mat(lw.q[heads * d:]) if a.output_gate else None
            self.k, self.v, self.o = _mat(lw.k), _mat(lw.v), _mat(lw.o)
            self.q_bias = None if lw.q_bias is None else lw.q_bias[:heads * d]
            self.gate_bias = None if lw.q_bias is None or not a.output_gate else lw.q_bias[heads * d:]
            lc = mdl.kv.layers[l.index]
            self.lc = lc
            self.cells, self.window = lc.cells, lc.window or 0
            kc, vc = lc.k_codec, lc.v_codec
            if kc.kind in _KV_CODECS and vc.kind in _KV_CODECS:
                self.kcode = _PLAIN[kc.dtype] if kc.kind == "plain" else _KV_CODECS[kc.kind]
                self.vcode = _PLAIN[vc.dtype] if vc.kind == "plain" else _KV_CODECS[vc.kind]
            self.knb, self.vnb = kc.nbytes, vc.nbytes
            self.kptr, self.vptr = lc.k.data_ptr(), lc.v.data_ptr()
            # a pooled layer: its cells through the shared pool's cell table [slots, context]
            pool = mdl.kv.pool if lc.pooled else None
            self.cells_of = pool.table.data_ptr() if pool is not None else None
            self.ctx = pool.context if pool is not None else 0
            self.qn, self.kn = _ptr(lw.q_norm), _ptr(lw.k_norm)
            self.biases = tuple(_ptr(b) for b in (self.q_bias, self.gate_bias, lw.k_bias, lw.v_bias, lw.o_bias))
            self.scale = d ** -0.5
        self.norms = (lw.input_norm.data_ptr(), lw.post_norm.data_ptr())
        self.router = _mat(lw.router) if l.moe is not None else None
        self.shared = tuple(_mat(x) for x in (lw.shared_gate, lw.shared_up, lw.shared_down, lw.shared_expert_gate)) \
            if lw.shared_gate is not None else None
        self.dense = tuple(_mat(x) for x in (lw.dense_gate, lw.dense_up, lw.dense_down)) \
            if l.moe is None else None
        #: the layer runs inside ``mf_lean_layers``: attention without an output gate,
        #: routed experts without shared ones (the rest stays in this loop)
        self.fused = not self.recurrent and not a.output_gate and l.moe is not None and self.shared is None \
            and (arch.clip_qkv is None or arch.clip_qkv > 0)

    def c_layer(self) -> CLayer:
        """The :class:`CLayer` of a fused layer (the expert table: :meth:`LeanStep._tables_c`)."""
        c = CLayer()
        c.in_norm, c.post_norm = self.norms
        c.q, c.k, c.v, c.o, c.router = (_cmat(m) for m in (self.q, self.k, self.v, self.o, self.router))
        c.qb, _, c.kb, c.vb, c.ob = self.biases
        c.qn, c.kn, c.kc, c.vc = self.qn, self.kn, self.kptr, self.vptr
        c.heads, c.kvh, c.d, c.dv, c.cells, c.window = self.heads, self.kvh, self.d, self.dv, self.cells, self.window
        c.kcode, c.vcode, c.knb, c.vnb, c.scale = self.kcode, self.vcode, self.knb, self.vnb, self.scale
        c.cells_of, c.ctx = self.cells_of, self.ctx
        c.e, c.topk = self.moe.num_experts, self.moe.experts_per_token
        return c


class LeanStep:
    """The prepared lean step of a :class:`~moefit.runtime.model.Model` (see the module
    docstring); ``why`` says what keeps it from running (None when it runs)."""

    def __init__(self, mdl):
        self.mdl = mdl
        self.why = self._check(mdl)
        if self.why is not None:
            return
        self.lib = qmatmul.library()
        self.layers = [_Layer(mdl, l, lw) for l, lw in zip(mdl.geom.layers, mdl.weights.layers)]
        for L in self.layers:
            mats = [L.q, L.k, L.v, L.o] + ([L.gate] if L.l.attention.output_gate else []) if not L.recurrent else []
            if L.moe is not None:
                mats.append(L.router)
            mats += list(L.shared or ()) + list(L.dense or ())
            if any(m is None for m in mats):
                self.why = f"layer {L.l.index}: a weight the C kernels do not read"
                return
        self.lm_head = _mat(mdl.weights.lm_head)
        if self.lm_head is None:
            self.why = "the output matrix is not one the C kernels read"
            return
        self.act = _PLAIN[mdl.arch.dtype]
        self.rot = mdl.rotary.params.dim
        self.inv_freq = mdl.rotary.inv_freq.float().contiguous()
        self.scaling = float(mdl.rotary.scaling)
        self._tables = {}
        self._version = None
        self._applies: dict = {}
        # what a step takes, whatever its size
        h, att = mdl.geom.hidden_size, [L for L in self.layers if not L.recurrent]
        self.att, self.moes = att, [L for L in self.layers if L.moe is not None]
        self.widest = max([h] + [L.heads * L.dv for L in att]
                          + [m.cols for L in self.layers for m in (L.shared or ()) + (L.dense or ())])
        self.qw = max([L.heads * L.d for L in att], default=1)
        self.kw = max([L.kvh * max(L.d, L.dv) for L in att], default=1)
        self.ow = max([L.heads * L.dv for L in att], default=1)
        self.gated = any(L.gate is not None for L in att)
        if self.moes:
            self.e_max = max(L.moe.num_experts for L in self.moes)
            self.k_max = max(L.moe.experts_per_token for L in self.moes)
        # the layer loop: runs of fused layers (one mf_lean_layers call each: the address of
        # the run's first CLayer, its layer indices) and the others
        self.fused = [i for i, L in enumerate(self.layers) if L.fused]
        self.clayers = (CLayer * len(self.layers))()
        for i in self.fused:
            self.clayers[i] = self.layers[i].c_layer()
        self.items: list = []
        for fused, group in itertools.groupby(range(len(self.layers)), key=lambda i: self.layers[i].fused):
            run = list(group)
            if fused:
                self.items.append((ctypes.addressof(self.clayers) + run[0] * ctypes.sizeof(CLayer), run))
            else:
                self.items += [self.layers[i] for i in run]
        self._cversion = None
        self._pchunk_for = None      # the _Buffers the fused layers' pchunk was set for
        self._bufs: dict = {}

    # ---- when --------------------------------------------------------------------------------
    @staticmethod
    def _check(mdl) -> str | None:
        arch, g = mdl.arch, mdl.geom
        if not qmatmul.available():
            return "no C kernels"
        if mdl.kv.buffer.device.type != "cpu":
            return "not a CPU device"
        if arch.dtype not in _PLAIN or not qmatmul.reads(torch.empty(0, dtype=arch.dtype)):
            return f"compute dtype {arch.dtype} (its activations stay on the torch path, qmatmul.reads)"
        unknown = {f.name for f in fields(Switches) if f.name not in KNOWN_SWITCHES
                   and getattr(arch, f.name) != _default(f)}
        if unknown:
            return f"switches {sorted(unknown)} are not implemented here"
        if arch.qk_norm not in ("", "head", "full"):
            return f"qk_norm {arch.qk_norm!r}"
        codecs = set()
        for l, lw in zip(g.layers, mdl.weights.layers):
            a = l.attention
            kind = kind_of(a)
            # softmax attention over its own cells (not MLA's latent rows, not a window it
            # keeps but does not mask: chunked), or Gated DeltaNet
            if isinstance(kind, Latent) or kind.masked_window(a) != kind.window(a):
                return f"layer {l.index}: {a.kind} attention"
            if not isinstance(kind, Recurrent):
                if max(a.head_dim, a.v_head_dim) > 512 or a.num_heads % max(1, a.num_kv_heads):
                    return f"layer {l.index}: head dims"
                lc = mdl.kv.layers[l.index]
                codecs |= {lc.k_codec.kind, lc.v_codec.kind}
                if (lc.window or None) != kind.masked_window(a):
                    return f"layer {l.index}: the window"
            extra = {f.name for f in fields(lw) if getattr(lw, f.name) is not None} - KNOWN_WEIGHTS
            for spec in (a, l.moe):
                if spec is not None:
                    extra |= {f.name for f in fields(spec)
                              if f.name not in KNOWN_SPEC_FIELDS and getattr(spec, f.name) != _default(f)}
            if extra:
                return f"layer {l.index}: {sorted(extra)} are not implemented here"
            if l.moe is not None and (l.moe.num_experts > 1024 or l.moe.experts_per_token > 16):
                return f"layer {l.index}: routing of this size"
        if not codecs <= set(_KV_CODECS):
            return f"KV codecs {sorted(codecs)}"
        if mdl.rotary.params.dim > 1024:
            return "rotary dim"
        return None

    def applies(self, segs) -> bool:
        """Whether this step of segments ``segs`` runs here: one token per segment, at most
        :data:`MAX_TOKENS`, not recording the routing, and every MoE layer's experts on the CPU
        (:func:`moefit.runtime.moe.batch.applies`, asked once per token count and residency)."""
        if self.why is not None or len(segs) > MAX_TOKENS or any(sg.length != 1 for sg in segs):
            return False
        t, ec = len(segs), self.mdl.experts
        if ec is not None and ec.routed is not None:    # recording routes in Python (moe/layer.py)
            return False
        key = (t, ec.version if ec is not None else 0)
        ok = self._applies.get(key)
        if ok is None:
            x = torch.empty((t, 1), dtype=self.mdl.arch.dtype).expand(t, self.mdl.geom.hidden_size)
            ok = all(moe_batch.applies(ec, L.l.index, x, L.moe.experts_per_token)
                     for L in self.layers if L.moe is not None)
            self._applies[key] = ok
        return ok

    # ---- expert tables -----------------------------------------------------------------------
    def _table(self, layer: int):
        """(blob address per expert int64 [E], resident mask uint8 [E]) of ``layer``: the
        resident slot, else the host blob (misses computed on the CPU). Rebuilt when the
        cache's residency changed."""
        ec = self.mdl.experts
        if self._version != ec.version:
            self._tables, self._version = {}, ec.version
        tab = self._tables.get(layer)
        if tab is None:
            count, slots, res = ec.host.experts[layer], ec.slots.get(layer, []), ec.resident[layer]
            ptrs = [slots[res[e]].data_ptr() if e in res else ec.host.blob(layer, e).data_ptr() for e in range(count)]
            mask = [1 if e in res else 0 for e in range(count)]
            fmt = moe_batch.layer_format(ec, layer)
            tab = (torch.tensor(ptrs, dtype=torch.int64), torch.tensor(mask, dtype=torch.uint8), fmt,
                   tuple(qmatmul.CTYPES[p.qtype] for p in (fmt.gate, fmt.up, fmt.down)))
            self._tables[layer] = tab
        return tab

    def _tables_c(self) -> None:
        """Point the fused layers' :class:`CLayer` at their expert tables (:meth:`_table`),
        when the cache's residency changed since the last step."""
        if self._cversion == self.mdl.experts.version:
            return
        for i in self.fused:
            table, mask, fmt, codes = self._table(self.layers[i].l.index)
            c = self.clayers[i]
            c.table, c.mask = table.data_ptr(), mask.data_ptr()
            c.inter, (c.gt, c.ut, c.dt) = fmt.gate.rows, codes
            c.up_off, c.down_off = fmt.up.offset, fmt.down.offset
        self._cversion = self.mdl.experts.version

    # ---- the step ----------------------------------------------------------------------------
    def run(self, ids: torch.Tensor, segs) -> torch.Tensor:
        """The step (``ids`` ``[T]``, one token per segment); returns the logits ``[T, V]``
        fp32, a view into the workspace's fixed region (as
        :func:`moefit.runtime.model.forward_batch`)."""
        mdl, lib = self.mdl, self.lib
        g, arch, w, ws = mdl.geom, mdl.arch, mdl.weights, mdl.ws
        t, h, act, f32 = ids.numel(), g.hidden_size, arch.dtype, torch.float32
        ad, eps, off = self.act, float(arch.rms_eps), float(arch.norm_offset)
        threads = torch.get_num_threads()
        auto = int(mdl.experts is not None and mdl.experts.miss_policy == "auto")
        for sg in segs:
            mdl.kv.check_room(sg.slot, sg.start, 1)
        ws.begin_chunk(mdl.fixed_bytes)
        b = self._buffers(t)
        b.pos_a[:] = [sg.start for sg in segs]
        b.slot_a[:] = [sg.slot for sg in segs]
        hidden, normed, delta, acc = b.hidden, b.normed, b.delta, b.acc
        if hasattr(w.embed, "lookup"):   # a GGUF table kept on the host (gguf_loader.HostEmbedding)
            w.embed.lookup(ids, hidden)
        else:
            torch.index_select(w.embed, 0, ids, out=hidden)
        gemm, norm, gp = lib.mf_gemm_ex, lib.mf_rmsnorm, b.gp

        def mm(m: _Mat, x: int, out: int, bias: int | None = None):
            gemm(m.qtype, m.ptr, m.rows, m.cols, x, ad, t, out, ad, bias, gp, threads)

        hp, np_, dp, ap, bufs = b.hp, b.np_, b.dp, b.ap, b.bufs
        lib.mf_rope_table(t, self.rot // 2, self.inv_freq.data_ptr(), self.scaling, bufs[5], ad, bufs[7], bufs[8])
        if self.moes:
            rp, bp, bnp, tp, wp, sp, msp = b.moe
            counts, mbytes = b.counts, b.mscratch.numel()
        if self.fused:
            c = b.cstep
            c.threads = threads
            self._tables_c()
            if self._pchunk_for is not b:    # the chunk of pairs each fused layer runs
                for i in self.fused:
                    self.clayers[i].pchunk = pchunk(t, h, self.clayers[i].inter, mbytes)
                self._pchunk_for = b
        pending, pdt = None, ad        # the last sublayer's output (address), not yet added to hidden
        for item in self.items:
            if not isinstance(item, _Layer):      # a run of fused layers, in one call
                addr, run = item
                c.pending, c.pdt = pending, pdt
                lib.mf_lean_layers(len(run), addr, ctypes.addressof(c))
                pending, pdt = c.pending, c.pdt
                for i in run:
                    cl, st = self.clayers[i], mdl.experts.stats[self.layers[i].l.index]
                    st.hits += cl.hits
                    st.misses += cl.misses
                    st.host_steps += auto         # auto: a step this small keeps its misses on the host
                    cl.hits = cl.misses = 0
                continue
            L = item
            l, lw = L.l, L.lw
            norm(t, h, hp, pending, pdt, L.norms[0], ad, eps, off, np_)
            if L.recurrent:
                for sg in segs:
                    with ws.scope():
                        gated_deltanet(l.attention, lw, normed[sg.offset:sg.offset + 1],
                                       mdl.kv.linear.layers[l.index], sg.slot, arch.rms_eps, ws,
                                       delta[sg.offset:sg.offset + 1])
            else:
                self._attention(L, t, np_, dp, bufs, mm, threads)
            norm(t, h, hp, dp, ad, L.norms[1], ad, eps, off, np_)
            if L.moe is not None:
                m = L.moe
                e, k = m.num_experts, m.experts_per_token
                mm(L.router, np_, rp)
                table, mask, fmt, codes = self._table(l.index)
                lib.mf_route(t, e, k, rp, ad, int(arch.renormalize), table.data_ptr(), mask.data_ptr(),
                             bp, bnp, tp, wp, sp)
                st = mdl.experts.stats[l.index]
                st.hits += counts[1]
                st.misses += counts[2]
                st.host_steps += auto
                acc.zero_()
                inter = fmt.gate.rows
                lib.mf_moe(counts[0], bp, bnp, tp, wp, np_, ad, ap, t, h, inter, *codes, fmt.up.offset,
                           fmt.down.offset, msp, pchunk(t, h, inter, mbytes), threads)
                if L.shared is not None:      # Qwen2-MoE: + sigmoid(gate(x)) * shared(x)
                    delta.copy_(acc)
                    with ws.scope():
                        sh = self._mlp(L.shared[:3], normed, ws.take((t, h), act), mm)
                        gate = ws.take((t, 1), act)
                        mm(L.shared[3], np_, gate.data_ptr())
                        delta.add_(sh.mul_(gate.sigmoid_()))
                    pending, pdt = dp, ad
                else:
                    pending, pdt = ap, 0
            else:
                self._mlp(L.dense, normed, delta, mm)
                pending, pdt = dp, ad
        norm(t, h, hp, pending, pdt, w.norm.data_ptr(), ad, eps, off, np_)
        logits = ws.fixed.take((t, g.vocab_size), f32)
        hm = self.lm_head
        gemm(hm.qtype, hm.ptr, hm.rows, hm.cols, np_, ad, t, logits.data_ptr(), 0, None, gp, threads)
        for sg in segs:
            mdl.kv.lengths[sg.slot] = sg.start + 1
        return logits

    def _buffers(self, t: int) -> "_Buffers":
        """The step's buffers for ``t`` tokens, taken from the workspace just after
        ``begin_chunk``. The takes of a step of ``t`` tokens are the same every step (same
        sizes from the same offset), so they are made once and replayed: the workspace's
        offset is moved past them (its peak already counts them) and the tensors, addresses
        and the C step structure are reused. Not replayed while the workspace is measured
        (``ws.mirror``: every take is recorded) or after it changed."""
        ws = self.mdl.ws
        key = (t, ws.buffer.data_ptr(), ws.capacity, ws.offset)
        b = self._bufs.get(key) if ws.mirror is None else None
        if b is not None:
            ws.offset = b.end
            ws.chunk_peak = max(ws.chunk_peak, b.end)
            return b
        b = _Buffers()
        mdl, f32, i64 = self.mdl, torch.float32, torch.int64
        h, act, arch = mdl.geom.hidden_size, mdl.arch.dtype, mdl.arch
        b.hidden = ws.take((t, h), act)
        b.normed, b.delta = ws.take((t, h), act), ws.take((t, h), act)
        b.acc = ws.take((t, h), f32)
        b.gscratch = ws.take((qmatmul.gemm_scratch_bytes(t, self.widest),), torch.uint8)
        q, k, v = ws.take((t, self.qw), act), ws.take((t, self.kw), act), ws.take((t, self.kw), act)
        o = ws.take((t, self.ow), act)
        gate = ws.take((t, self.ow), act) if self.gated else None
        if self.moes:
            pairs = t * self.k_max
            rlog = ws.take((t, self.e_max), act)
            bptr, bounds = ws.take((pairs,), i64), ws.take((pairs + 1,), i64)
            tok, wsel = ws.take((pairs,), i64), ws.take((pairs,), f32)
            stats = ws.take((3,), i64)
            b.mscratch = ws.take((self._moe_scratch(t, self.moes, ws),), torch.uint8)
            b.keep = (rlog, bptr, bounds, tok, wsel, stats)
            b.moe = tuple(x.data_ptr() for x in (*b.keep, b.mscratch))
            b.counts = (ctypes.c_int64 * 3).from_address(stats.data_ptr())
        half = self.rot // 2
        cs, sn = ws.take((t, half), f32), ws.take((t, half), f32)     # RoPE of the step's positions
        b.pos, b.slot = torch.zeros(t, dtype=i64), torch.zeros(t, dtype=i64)
        b.pos_a = (ctypes.c_int64 * t).from_address(b.pos.data_ptr())
        b.slot_a = (ctypes.c_int64 * t).from_address(b.slot.data_ptr())
        b.tensors = (q, k, v, o, gate, cs, sn)
        b.hp, b.np_, b.dp, b.ap, b.gp = (x.data_ptr() for x in (b.hidden, b.normed, b.delta, b.acc, b.gscratch))
        b.bufs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), None if gate is None else gate.data_ptr(),
                  b.pos.data_ptr(), b.slot.data_ptr(), cs.data_ptr(), sn.data_ptr())
        if self.fused:
            c = b.cstep = CStep()
            c.t, c.h, c.ad, c.renorm, c.rot = t, h, self.act, int(arch.renormalize), self.rot
            c.qk_norm, c.eps, c.off = {"": 0, "head": 1, "full": 2}[arch.qk_norm], arch.rms_eps, arch.norm_offset
            c.clip = arch.clip_qkv or 0.0
            (c.hidden, c.normed, c.delta, c.acc, c.gscratch, c.q, c.k, c.v, c.o, c.pos, c.slot, c.cs, c.sn) = (
                b.hp, b.np_, b.dp, b.ap, b.gp, *b.bufs[:4], *b.bufs[5:])
            c.rlog, c.bptr, c.bounds, c.tok, c.wsel, c.stats, c.mscratch = b.moe
        b.end = ws.offset
        if ws.mirror is None:
            if len(self._bufs) >= 2 * MAX_TOKENS:
                self._bufs.clear()
            self._bufs[key] = b
        return b

    def _moe_scratch(self, t: int, moes, ws) -> int:
        """Bytes of the step's MoE kernel scratch: room for every (token, expert) pair of the
        step at once when the workspace has it above what the layer loop takes later (so
        ``mf_moe`` runs a layer as one chunk of pairs: four barriers, not four per expert),
        else :func:`moefit.runtime.moe.batch.scratch_bytes` (a pair at a time at least).
        Either way within the ``prefill`` line the plan priced for a whole chunk: the step's
        other buffers are those of ``t`` tokens, and the workspace raises past its end."""
        act = self.mdl.arch.dtype
        h = self.mdl.geom.hidden_size
        base = max(moe_batch.scratch_bytes(t, h, L.moe.expert_intermediate, act) for L in moes)
        if any(L.recurrent for L in self.layers):     # the delta rule takes its own blocks
            return base
        want = max(qmatmul.moe_scratch_bytes(t, h, L.moe.expert_intermediate, t * L.moe.experts_per_token)
                   for L in moes)
        # later, inside a layer's scope: a shared expert's or dense MLP's gate / up / output rows
        later = max([t * (m[0].rows + m[1].rows + h + 1) * act.itemsize
                     for L in self.layers for m in (L.shared, L.dense) if m is not None], default=0)
        room = ws.capacity - (-(-ws.offset // ALIGN) * ALIGN) - later - 8 * ALIGN
        return max(base, min(want, room))

    def _mlp(self, mats, x: torch.Tensor, out: torch.Tensor, mm) -> torch.Tensor:
        """``down(silu(gate(x)) * up(x))`` into ``out`` (:func:`moefit.runtime.moe.layer.swiglu_mlp`)."""
        ws, t, act = self.mdl.ws, x.shape[0], x.dtype
        gm, um, dm = mats
        with ws.scope():
            g, u = ws.take((t, gm.rows), act), ws.take((t, um.rows), act)
            mm(gm, x.data_ptr(), g.data_ptr())
            mm(um, x.data_ptr(), u.data_ptr())
            mm(dm, F.silu(g, inplace=True).mul_(u).data_ptr(), out.data_ptr())
        return out

    def _attention(self, L: _Layer, t: int, x: int, out: int, bufs, mm, threads) -> None:
        """Self-attention of layer ``L`` on the normed rows at ``x`` (``[T, H]``) into ``out``
        (as :func:`moefit.runtime.model._attention` for one token per sequence); ``bufs``:
        the addresses of the step's q, k, v, attention-output and gate buffers, positions
        and slots."""
        lib, arch, ad = self.lib, self.mdl.arch, self.act
        heads, kvh, d, dv = L.heads, L.kvh, L.d, L.dv
        q, k, v, o, gate, pos, slot, cs, sn = bufs
        qb, gb, kb, vb, ob = L.biases
        mm(L.q, x, q, qb)
        if L.gate is not None:
            mm(L.gate, x, gate, gb)
        mm(L.k, x, k, kb)
        mm(L.v, x, v, vb)
        eps = float(arch.rms_eps)
        if arch.qk_norm == "full":            # OLMoE: over all heads at once, no offset
            lib.mf_rmsnorm(t, heads * d, q, None, ad, L.qn, ad, eps, 0.0, q)
            lib.mf_rmsnorm(t, kvh * d, k, None, ad, L.kn, ad, eps, 0.0, k)
        if arch.clip_qkv is not None:
            ws, act = self.mdl.ws, self.mdl.arch.dtype
            for ptr, n in ((q, heads * d), (k, kvh * d), (v, kvh * dv)):
                _view(ptr, t * n, act).clamp_(-arch.clip_qkv, arch.clip_qkv)
        if arch.qk_norm == "head":            # Qwen3: per head
            off = float(arch.norm_offset)
            lib.mf_rmsnorm(t * heads, d, q, None, ad, L.qn, ad, eps, off, q)
            lib.mf_rmsnorm(t * kvh, d, k, None, ad, L.kn, ad, eps, off, k)
        lib.mf_rope_kv(t, q, heads, k, kvh, v, d, dv, self.rot, cs, sn, pos, slot, ad,
                       L.kptr, L.vptr, L.cells, L.kcode, L.vcode, L.knb, L.vnb, L.cells_of, L.ctx)
        lib.mf_attn_decode(t, q, heads, kvh, d, dv, L.scale, L.kptr, L.vptr, L.kcode, L.vcode, L.knb, L.vnb,
                           pos, slot, L.cells, L.window, ad, o, threads, L.cells_of, L.ctx)
        if L.gate is not None:
            act = self.mdl.arch.dtype
            _view(o, t * heads * dv, act).mul_(_view(gate, t * heads * dv, act).sigmoid_())
        mm(L.o, o, out, ob)


def lean(mdl) -> LeanStep:
    """The model's :class:`LeanStep` (made on first use and kept on the model)."""
    step = getattr(mdl, "lean", None)
    if step is None or step.mdl is not mdl:
        step = LeanStep(mdl)
        mdl.lean = step
    return step


def applies(mdl, segs) -> bool:
    """Whether the step of segments ``segs`` runs as a lean step (module docstring)."""
    return lean(mdl).applies(segs)


def forward(mdl, ids: torch.Tensor, segs) -> torch.Tensor:
    """Run the lean step; the logits ``[S, V]`` fp32 (a view into the workspace's fixed
    region), as :func:`moefit.runtime.model.forward_batch` returns them."""
    return lean(mdl).run(ids, segs)

