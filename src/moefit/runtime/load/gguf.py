"""Load a GGUF model: dense weights dequantized onto the device, experts kept as stored.

Input: a ``.gguf`` file (or the first shard of a split one) of the families the runtime
runs: ``qwen3moe``, ``qwen2moe``, ``olmoe``, ``llama`` with experts (Mixtral), the hybrids
``qwen3next`` / ``qwen35moe``, ``gpt-oss``, ``deepseek2`` (MLA: ``attn_kv_b`` or the split
``attn_k_b`` / ``attn_v_b``) and ``glm4moe``. The file
is memory-mapped (``gguf.GGUFReader``); every tensor is read once, straight from the map
into its destination, and the maps are closed at the end, so host memory holds the
expert blobs once (not the file and a copy). The tensors read are the planner's listing of
the model (:mod:`moefit.runtime.load.listing`), under the GGUF names of their slots.

- Dense tensors (attention, norms, routers, shared experts, dense MLPs, embeddings, output)
  are dequantized tile by tile (:func:`moefit.runtime.kernels.quant.dequantize`) into tensors of
  the compute dtype from ``alloc`` (the ledger's ``weights`` line; the plan priced them at
  that dtype), except the quantized matrices the plan kept stored (on a CPU device with
  the C kernels, or on a CUDA device with the Triton kernels:
  :func:`moefit.memory.weights.stored_matrices`): those are copied as
  stored into buffers of their stored size (:class:`~moefit.runtime.kernels.quant.StoredMatrix`).
  ``llama`` files hold q/k rows permuted for llama.cpp's interleaved RoPE
  (``convert_hf_to_gguf.py`` ``LlamaModel.permute``); they are permuted back to the
  rotate-half order the forward pass uses.
- Hybrids: the Gated DeltaNet tensors as llama.cpp's converter writes them, brought back
  to the checkpoint's layout (:func:`moefit.runtime.load.hybrid_layout.gguf_linear_attention_entries`);
  the gated ``attn_q`` regrouped as ``q_proj``; the ``(1 + w)`` norms stored as ``w + 1``
  read back as ``w`` (:data:`OFFSET_NORM_SLOTS`).
- Experts: per MoE layer, ``ffn_{gate,up,down}_exps`` (``[E, I, H]``, ``[E, I, H]``,
  ``[E, H, I]``; or ``ffn_gate_up_exps`` ``[E, 2I, H]``) become one uint8 blob per expert,
  ``[gate | up | down]`` bytes in the file's types (:class:`~moefit.runtime.kernels.quant.StoredExpert`;
  gpt-oss's with their ``ffn_*_exps.bias`` first,
  :class:`~moefit.runtime.moe.gpt_oss.BiasedExpert`), read by the engine from the
  returned :class:`GGUFExperts` once it knows where each expert lives. With
  ``--host-experts mmap`` the file stays mapped and a non-resident expert's parts are
  gathered from its pages each time it runs.
- The token embedding of a file with its own output matrix stays on the host as stored
  when the plan says so (:class:`HostEmbedding`; llama.cpp does the same): a token's row is
  dequantized when it is looked up.

Errors (:class:`~moefit.errors.InputError`): a missing tensor, a tensor whose dims differ
from the metadata's, a ggml type without a kernel (each named with the file), an
architecture the runtime does not run.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from pathlib import Path

import torch

from moefit.errors import InputError
from moefit.ingest.families import registry
from moefit.ingest.families.qwen_hybrid import V_TILED_ARCHS
from moefit.ingest.geometry import LayerSpec, ModelGeometry
from moefit.ingest.gguf_header import (GGUFHeader, GGUFTensor, close_reader, config_from_gguf, open_reader,
                                      packed_staging_bytes, read_header)
from moefit.runtime.arch import Arch
from moefit.runtime.moe.gpt_oss import BiasedExpert
from moefit.runtime.load.hybrid_layout import LINEAR_SLOTS, Packed, gguf_linear_attention_entries, sources
from moefit.runtime.load.listing import global_entries, layer_entries
from moefit.runtime.load.safetensors import progress_bar, resident_dtype
from moefit.runtime.weights import ExpertSource, Weights, assemble_weights
from moefit.runtime.kernels.quant import FLOAT_DTYPES, StoredExpert, StoredMatrix, dequantize, kernel_for


def gguf_config(path: str | Path) -> dict:
    """The Hugging Face config dict of the GGUF model at ``path`` (from its header)."""
    return config_from_gguf(read_header(path))


class _Tensors:
    """GGUF tensor name -> data (a numpy view of the memory map), with checks."""

    def __init__(self, h: GGUFHeader):
        self.h = h
        self.readers = [open_reader(p) for p in h.paths]
        self.data = {t.name: t.data for r in self.readers for t in r.tensors}

    def info(self, name: str) -> GGUFTensor:
        t = self.h.tensors.get(name)
        if t is None:
            raise InputError(f"{self.h.paths[0]}: tensor {name!r} is missing from the GGUF file; "
                             "is the file complete and of a supported architecture?")
        return t

    def check(self, name: str, shape: tuple[int, ...]) -> GGUFTensor:
        """The tensor's info after checking its dims against ``shape`` (torch order; a
        ``[1, H]`` weight may be stored 1-D) and that its type has a kernel."""
        t = self.info(name)
        squeeze = lambda s: tuple(d for d in s if d != 1)  # noqa: E731
        if t.shape != tuple(shape) and squeeze(t.shape) != squeeze(shape):
            raise InputError(f"{self.h.paths[t.shard]}: tensor {name!r} has dims {list(t.ne)}, "
                             f"but the metadata implies {list(reversed(shape))}")
        kernel_for(t.ggml_type, f"{self.h.paths[t.shard].name}: {name}")
        return t

    def raw(self, name: str) -> torch.Tensor:
        """The tensor's bytes as a flat uint8 tensor sharing the memory map (read-only:
        only ever copied from)."""
        import numpy as np

        a = self.data[name].reshape(-1).view(np.uint8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)   # "non-writable array": never written
            return torch.from_numpy(a)

    def close(self) -> None:
        self.data.clear()
        for r in self.readers:
            close_reader(r)




#: the RMSNorm weights a GGUF holds as applied, ``w + norm_offset`` (llama.cpp multiplies by
#: the stored weight; its converter adds 1 to Qwen3-Next's ``(1 + w)`` norms), by slot
OFFSET_NORM_SLOTS = ("input_norm", "post_norm", "q_norm", "k_norm")


def _minus(name: str, shape: tuple, offset: float) -> Packed:
    """A norm weight stored as ``w + offset`` (see :data:`OFFSET_NORM_SLOTS`), read as ``w``."""
    return Packed(((name, shape),), lambda ts: ts[0] - offset)


def _layer_plan(l: LayerSpec, geom: ModelGeometry, arch: Arch, header: GGUFHeader,
                tiled: bool = False) -> list[tuple[str, object, tuple]]:
    """(slot, GGUF name or :class:`~moefit.runtime.load.hybrid_layout.Packed`, torch shape)
    of every resident tensor of layer ``l``: its listing
    (:func:`moefit.runtime.load.listing.layer_entries`), each tensor under the GGUF name of
    its slot (the family's table, ``arch.names``), with what llama.cpp's converter writes
    differently: MLA's ``kv_b`` as ``attn_k_b`` ``[A, L, nope]`` + ``attn_v_b`` ``[A, Dv,
    L]`` when the file splits it; the Gated DeltaNet tensors per
    :func:`gguf_linear_attention_entries` (``tiled``: the file's value heads are tiled); the
    norms stored with the family's ``norm_offset`` added read back without it."""
    a, h = l.attention, geom.hidden_size
    out = layer_entries(l, lambda t: arch.names.gguf(t.slot, l.index),
                        keep=lambda t: t.slot not in LINEAR_SLOTS)
    if any(t.slot in LINEAR_SLOTS for t in l.tensors):
        out += gguf_linear_attention_entries(l.index, a, h, lambda name: name in header.tensors, tiled)
    if arch.names.layer.get("k_b") and arch.names.gguf("k_b", l.index) in header.tensors:
        lora, nope = a.kv_lora_rank, a.head_dim - a.qk_rope_head_dim
        split = [("k_b", arch.names.gguf("k_b", l.index), (a.num_heads, lora, nope)),
                 ("v_b", arch.names.gguf("v_b", l.index), (a.num_heads, a.v_head_dim, lora))]
        out = [e for entry in out for e in (split if entry[0] == "kv_b" else [entry])]
    return _offset_norms(out, arch)


def _offset_norms(plan: list, arch: Arch) -> list:
    """``plan`` with the norms of :data:`OFFSET_NORM_SLOTS` read back without the family's
    ``norm_offset`` (unchanged when it is 0)."""
    if not arch.norm_offset:
        return plan
    return [(attr, _minus(name, shape, arch.norm_offset) if attr in OFFSET_NORM_SLOTS else name, shape)
            for attr, name, shape in plan]


def _expert_parts(l: LayerSpec, geom: ModelGeometry, arch: Arch, ts: _Tensors) -> tuple[list[str], StoredExpert]:
    """The GGUF expert tensors of layer ``l`` in blob order (gate, up, down; or gate_up,
    down; gpt-oss: the three biases first) and the layer's :class:`StoredExpert` (gpt-oss:
    :class:`~moefit.runtime.moe.gpt_oss.BiasedExpert`) layout."""
    m, h = l.moe, geom.hidden_size
    e, i = m.num_experts, m.expert_intermediate
    n = lambda part: arch.names.gguf_expert(part, l.index)  # noqa: E731
    if arch.clamped_swiglu is not None:
        biases = [ts.check(n("gate_bias"), (e, i)), ts.check(n("up_bias"), (e, i)),
                  ts.check(n("down_bias"), (e, h))]
        if len({b.ggml_type for b in biases}) != 1:
            raise InputError(f"{ts.h.paths[0]}: the expert biases of layer {l.index} have types "
                             f"{[b.ggml_type for b in biases]}; the runtime reads one type per layer")
        g, u, d = ts.check(n("gate"), (e, i, h)), ts.check(n("up"), (e, i, h)), ts.check(n("down"), (e, h, i))
        fmt = BiasedExpert.pack(i, h, biases[0].ggml_type, g.ggml_type, u.ggml_type, d.ggml_type,
                                *arch.clamped_swiglu)
        return [b.name for b in biases] + [g.name, u.name, d.name], fmt
    fused = n("gate_up")
    if fused in ts.h.tensors:
        t = ts.check(fused, (e, 2 * i, h))
        d = ts.check(n("down"), (e, h, i))
        fmt = StoredExpert.pack(i, h, t.ggml_type, t.ggml_type, d.ggml_type)
        return [fused, d.name], fmt
    g = ts.check(n("gate"), (e, i, h))
    u = ts.check(n("up"), (e, i, h))
    d = ts.check(n("down"), (e, h, i))
    return [g.name, u.name, d.name], StoredExpert.pack(i, h, g.ggml_type, u.ggml_type, d.ggml_type)


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp interleaved q/k rows -> rotate-half rows (inverse of ``LlamaModel.permute``)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class HostEmbedding:
    """A token embedding table ``[V, H]`` kept on the host in its stored ggml type.

    ``raw``: uint8 ``[V, row bytes]`` (the host ledger's ``host_weights`` line). A lookup
    gathers the rows of the ids into ``rows`` (uint8 ``[chunk, row bytes]``, the host's
    staging) and dequantizes them into the output (:func:`moefit.runtime.kernels.quant.dequantize`,
    bit for bit what dequantizing the whole table would give), through ``tmp`` (``[chunk,
    H]`` of the compute dtype on the host) when the output is on a GPU. A float table
    whose type is the output's (a BF16 table, bf16 compute) is gathered straight into the
    output: the same bits, without the dequantize call (~16 us of a decode step's Python
    and C on the 120 MB serving benchmark's model, against ~2 us)."""

    def __init__(self, raw: torch.Tensor, qtype: str, hidden: int):
        self.raw, self.qtype, self.hidden = raw, qtype, hidden
        self.rows: torch.Tensor | None = None
        self.tmp: torch.Tensor | None = None
        dtype = FLOAT_DTYPES.get(qtype)
        #: the table as ``[V, H]`` of its own float dtype (None: a quantized type)
        self.floats = raw.view(dtype) if dtype is not None else None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.raw.shape[0], self.hidden)

    def lookup(self, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out[t] = table[ids[t]]``: ``ids`` int64 ``[T]``, ``out`` ``[T, H]``."""
        t = ids.numel()
        host_ids = ids if ids.device.type == "cpu" else ids.to("cpu")
        if self.floats is not None and out.device.type == "cpu" and out.dtype == self.floats.dtype:
            return torch.index_select(self.floats, 0, host_ids, out=out)
        rows = (self.rows[:t] if self.rows is not None and self.rows.shape[0] >= t
                else torch.empty((t, self.raw.shape[1]), dtype=torch.uint8))
        torch.index_select(self.raw, 0, host_ids, out=rows)
        if out.device.type == "cpu":
            return dequantize(rows.view(-1), self.qtype, (t, self.hidden), out=out)
        tmp = (self.tmp[:t] if self.tmp is not None and self.tmp.shape[0] >= t
               else torch.empty((t, self.hidden), dtype=out.dtype))
        dequantize(rows.view(-1), self.qtype, (t, self.hidden), out=tmp)
        return out.copy_(tmp)


class GGUFExperts(ExpertSource):
    """The experts of a GGUF file, read from its memory map (module docstring)."""

    def __init__(self, ts: _Tensors, plans: dict, geom: ModelGeometry, bar, mapped: bool):
        self.ts, self.plans, self.bar, self.mapped = ts, plans, bar, mapped
        self.hidden, self.dtype = geom.hidden_size, torch.uint8
        self.experts = {l.index: l.moe.num_experts for l in geom.moe_layers}
        self.inter = {l.index: l.moe.expert_intermediate for l in geom.moe_layers}
        self.formats = {l: fmt for l, (_, fmt) in plans.items()}
        self.elems = {l: fmt.nbytes for l, fmt in self.formats.items()}

    def read(self, layer: int, targets: dict[int, torch.Tensor]) -> None:
        """Copy each expert ``e`` of ``targets`` (``{e: uint8 blob}``) from the map: its
        gate, up and down bytes back to back."""
        parts, fmt = self.plans[layer]
        e_count = self.experts[layer]
        off = 0
        for name in parts:
            src = self.ts.raw(name).view(e_count, -1)                          # [E, bytes/E]
            n = src.shape[1]
            for e, dst in targets.items():
                dst[off:off + n].copy_(src[e])
            off += n
            if not self.bar_done:
                self.bar.update(n * len(targets))
        assert off == fmt.nbytes, (off, fmt)

    bar_done = False

    def close(self) -> None:
        """End the load: the progress bar, and the file's maps unless the experts run
        from them (``mapped``; :meth:`release` closes them then)."""
        self.bar.close()
        self.bar_done = True
        if not self.mapped:
            self.ts.close()

    def release(self) -> None:
        self.ts.close()


def load_gguf(path: str | Path, geom: ModelGeometry, arch: Arch, alloc, *, pin: bool = False,
              progress: bool = True, host_alloc=None, mapped: bool = False,
              transient=None, stored: frozenset[str] = frozenset()) -> tuple[Weights, GGUFExperts]:
    """Read the GGUF model at ``path``: dense weights into tensors from ``alloc`` (compute
    dtype ``arch.dtype``); the experts are read later from the returned
    :class:`GGUFExperts`. Every name, dims and type is checked before any data is read.

    ``host_alloc(shape, dtype)``: where the token embedding goes when it stays on the host
    (the host ledger's ``host_weights`` line; None: on the device with the others).
    ``mapped``: the experts run from the file's pages (the map stays open).
    ``transient(nbytes)``: a context in which the loader holds ``nbytes`` on the host.
    ``stored``: the GGUF names of the matrices kept in their stored type, in buffers of
    their stored bytes from ``alloc`` (:func:`moefit.memory.weights.stored_matrices` of the
    plan's device), as :class:`~moefit.runtime.kernels.quant.StoredMatrix`.
    Raises InputError (see module docstring)."""
    h = read_header(path)
    if h.arch not in registry.runtime_gguf_archs():
        raise InputError(f"{h.paths[0]}: GGUF architecture {h.arch!r}: the runtime runs "
                         f"{', '.join(registry.runtime_gguf_archs())} (`moefit plan` plans it)")
    ts = _Tensors(h)
    try:
        return _load(h, ts, geom, arch, alloc, progress, host_alloc, mapped, transient, stored)
    except BaseException:
        ts.close()
        raise


def _load(h, ts: _Tensors, geom, arch, alloc, progress, host_alloc, mapped, transient, stored=frozenset()):
    dtype = arch.dtype
    transient = transient or (lambda n: contextlib.nullcontext())
    g = arch.names.globals
    glob = [(slot, _minus(name, shape, arch.norm_offset) if slot == "norm" and arch.norm_offset else name, shape)
            for slot, name, shape in global_entries(geom, lambda t: g[t.slot][1])]
    embed = g["embed"][1]      # looked up by row: always dequantized
    family = registry.family_for_gguf(h.arch)
    layer_plans = [_layer_plan(l, geom, arch, h, h.arch in V_TILED_ARCHS) for l in geom.layers]
    for _, name, shape in glob + [t for lp in layer_plans for t in lp]:
        for part, part_shape in sources(name, shape):
            ts.check(part, part_shape)
    expert_plans = {l.index: _expert_parts(l, geom, arch, ts) for l in geom.moe_layers}
    names = [p for _, n, s in glob for p, _ in sources(n, s)]
    names += [p for lp in layer_plans for _, n, s in lp for p, _ in sources(n, s)]
    names += [n for parts, _ in expert_plans.values() for n in parts]
    bar = progress_bar(sum(h.tensors[n].nbytes for n in names), progress, h.paths[0].name,
                       unit="B", unit_divisor=1024)
    heads = geom.layers[0].attention.num_heads
    kv_heads = geom.layers[0].attention.num_kv_heads
    permute = family is not None and family.gguf_permute_qk
    qk = {name: heads if attr == "q" else kv_heads for lp in layer_plans for attr, name, _ in lp
          if attr in ("q", "k", "q_bias", "k_bias")}
    # MLA's kv_b is viewed per head (W_UK / W_UV), so it is never kept in a stored format
    unstored = {name for lp in layer_plans for attr, name, _ in lp if attr == "kv_b"}

    def resident(name, shape: tuple) -> torch.Tensor:
        if isinstance(name, Packed):     # read in fp32, rebuilt, then cast once
            with transient(packed_staging_bytes(sum(math.prod(s) for _, s in name.parts))):
                parts = []
                for part, part_shape in name.parts:
                    t = h.tensors[part]
                    parts.append(dequantize(ts.raw(part), t.ggml_type, part_shape))
                    bar.update(t.nbytes)
                return alloc(shape, dtype).copy_(name.build(parts).reshape(shape))
        t = h.tensors[name]
        raw = ts.raw(name)
        if name == embed and host_alloc is not None:
            # kept on the host as stored: a lookup dequantizes the rows it reads
            table = host_alloc((shape[0], t.nbytes // shape[0]), torch.uint8)
            table.view(-1).copy_(raw)
            bar.update(t.nbytes)
            return HostEmbedding(table, t.ggml_type, shape[1])
        if permute and name in qk:
            # whole quantized rows move: un-permute the bytes on the host, then dequantize
            with transient(t.nbytes):
                raw = _unpermute(raw.view(shape[0], -1), qk[name]).reshape(-1)
                return _fill(name, t, raw, shape)
        return _fill(name, t, raw, shape)

    def _fill(name, t, raw, shape):
        if name in stored and name != embed and name not in unstored:
            # kept as stored, at the size the plan priced it: decode reads the stored bytes
            m = StoredMatrix(alloc((t.nbytes,), torch.uint8), t.ggml_type, shape[0], shape[1])
            m.raw.copy_(raw.reshape(-1))
            bar.update(t.nbytes)
            return m
        dst = alloc(shape, resident_dtype(name, dtype))
        dequantize(raw, t.ggml_type, shape, out=dst)
        bar.update(t.nbytes)
        return dst

    weights = assemble_weights(glob, layer_plans, resident)
    return weights, GGUFExperts(ts, expert_plans, geom, bar, mapped)
