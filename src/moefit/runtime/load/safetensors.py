"""Load a Hugging Face checkpoint: resident weights onto the device, experts into host blobs.

Input: a model directory with ``config.json`` and ``*.safetensors`` (sharded with
``model.safetensors.index.json`` or not; :func:`moefit.ingest.checkpoint.checkpoint_files`), of
the families in :mod:`moefit.runtime.arch`, stored in bf16, fp16 or fp32 (converted to the
config's dtype on load). The tensors read are the planner's listing of the model
(:mod:`moefit.runtime.load.listing`), under their listed names.

Routed experts come in two layouts, both accepted:

1. one tensor per expert, as transformers 5.x ``save_pretrained`` writes them (its
   conversion mapping splits the in-memory fused tensors back) and as the published
   checkpoints hold them: ``{p}.mlp.experts.{j}.gate_proj.weight`` ``[I, H]``,
   ``up_proj`` ``[I, H]``, ``down_proj`` ``[H, I]``; Mixtral
   ``{p}.block_sparse_moe.experts.{j}.w1`` / ``w3`` / ``w2``;
2. fused per layer, as transformers 5.x holds them in memory (``Qwen3MoeExperts``,
   ``MixtralExperts``, ...): ``{p}.mlp.experts.gate_up_proj`` ``[E, 2I, H]`` (gate rows
   first, then up) and ``{p}.mlp.experts.down_proj`` ``[E, H, I]``.

Every expert becomes ONE contiguous blob (docs/design.md, runtime contract; mixtral-offloading's packed
expert storage): ``[gate (I*H) | up (I*H) | down (H*I)]`` in the model dtype, so gate and
up together are the ``[2I, H]`` matrix of the fused layout and a cache miss is one copy.
The loader reads the dense weights at once and returns an :class:`ExpertSource`; the
engine reads the experts from it once it knows where each one lives (docs/design.md,
host budget): a resident expert straight into its device slot, the others into host rows
(pinned when the device is CUDA: asynchronous host-to-device copies), so the host never
holds a resident expert. gpt-oss's fused experts (with biases; bf16 or mxfp4 kept as
stored) are read one expert's slice at a time into a uint8 blob of their own layout
(:mod:`moefit.runtime.moe.gpt_oss`).

Block-scaled fp8 checkpoints (``quant_method: fp8``: DeepSeek-V3 / R1, Kimi-K2): each F8_E4M3
weight with its ``weight_scale_inv`` stays as stored, as priced: a dense one as a
:class:`~moefit.runtime.kernels.quant.Fp8Matrix` (dequantized into the staging workspace when used),
the experts as stored blobs of e4m3 bytes and fp32 scales
(:meth:`~moefit.runtime.kernels.quant.StoredExpert.pack_fp8`), dequantized when they run.

Errors (:class:`~moefit.errors.InputError`): a missing tensor (named, with the file the
index points to or the files searched), a tensor of the wrong shape (named, with its file,
the shape found and the shape the config implies), no safetensors files.

Hybrids (Qwen3-Next / Qwen3.5): the text model's tensors sit under ``Arch.prefix``
(``model.language_model.`` in a multimodal checkpoint, whose vision tower is not read); a
few projections are regrouped at load (:mod:`moefit.runtime.load.hybrid_layout`).
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Callable

import torch

from moefit.ingest.checkpoint import HeaderIndex
from moefit.errors import InputError
from moefit.ingest.families import gpt_oss
from moefit.ingest.families.common import FP32_TENSORS
from moefit.ingest.geometry import LayerSpec, ModelGeometry
from moefit.runtime.moe import gpt_oss as gpt_oss_experts
from moefit.runtime.arch import Arch
from moefit.runtime.load.hybrid_layout import Packed, sources
from moefit.runtime.load.listing import global_entries, layer_entries
from moefit.runtime.kernels.quant import FP8, Fp8Matrix, StoredExpert, fp8_scale_shape
from moefit.runtime.weights import ExpertSource, Weights, assemble_weights

Alloc = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


class _Index(HeaderIndex):
    """The checkpoint's tensors by name (:class:`~moefit.ingest.checkpoint.HeaderIndex`:
    its headers, and the one name and shape check), and their data, read through
    ``safetensors``."""

    def __init__(self, model_dir: Path):
        super().__init__(model_dir)
        if not self.files:
            raise InputError(f"{model_dir}: no *.safetensors files; the runtime needs the "
                             "weights (`moefit plan` works from config.json alone)")
        self._handles: dict[Path, object] = {}

    def fp8(self, name: str) -> bool:
        """Whether ``name`` is stored as block-scaled fp8 (an F8_E4M3 weight)."""
        return self.dtypes.get(name) == FP8

    def check_fp8_scales(self, name: str, shape: tuple[int, ...], block: tuple[int, int]) -> str:
        """The ``weight_scale_inv`` of fp8 weight ``name`` ``[rows, cols]``, checked for its
        shape (one fp32 per ``block``); InputError naming it when absent or misshapen, or
        when the checkpoint's ``quantization_config`` does not make it block-scaled fp8."""
        scale = name.removesuffix("weight") + "weight_scale_inv"
        if len(shape) != 2:
            raise InputError(f"{self.where[name][0]}: tensor {name!r} is {FP8} with shape "
                             f"{list(shape)}; the runtime runs 2-D block-scaled fp8 weights")
        self.check(scale, fp8_scale_shape(shape[0], shape[1], block))
        return scale

    def _handle(self, name: str):
        from safetensors import safe_open

        path, _ = self.where[name]
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt", device="cpu")
        return self._handles[path]

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def get_slice(self, name: str, index: int) -> torch.Tensor:
        """``tensor[index]`` of ``name`` (its first dim dropped), reading only those bytes
        (safetensors ``get_slice``)."""
        return self._handle(name).get_slice(name)[index:index + 1][0]


def _first(index: _Index, names: list[str]) -> str:
    for n in names:
        if index.has(n):
            return n
    raise index.missing(names[0])


def _layer_plan(l: LayerSpec, geom: ModelGeometry, arch: Arch, index: _Index) -> list[tuple[str, object, tuple]]:
    """(slot, checkpoint name or :class:`~moefit.runtime.load.hybrid_layout.Packed`, shape)
    of every resident tensor of layer ``l``: its listing
    (:func:`moefit.runtime.load.listing.layer_entries`), each tensor under its listed name or,
    where the checkpoint uses another name of its slot (``NameTable.aliases``: Mixtral's
    router saved as ``mlp.gate``), the one it holds."""
    p = f"{arch.prefix}layers.{l.index}."

    def name(t) -> str:
        aliases = arch.names.hf_aliases(t.slot, p)
        return _first(index, [t.name, *aliases]) if aliases else t.name
    return layer_entries(l, name)


def _expert_plan(l: LayerSpec, geom: ModelGeometry, arch: Arch, index: _Index):
    """``("fused", gate_up name, down name)``, ``("per_expert", [(g, u, d) per expert])``
    or, for experts with biases (gpt-oss), ``("biased", {part: name}, layout)``
    (:func:`moefit.runtime.moe.gpt_oss.hf_expert_names`, :func:`~moefit.runtime.moe.gpt_oss.hf_layout`)."""
    m, h, p = l.moe, geom.hidden_size, f"{arch.prefix}layers.{l.index}."
    i = m.expert_intermediate
    if arch.clamped_swiglu is not None:
        prefix = arch.names.hf_experts(p)
        packed = gpt_oss_experts.checkpoint_experts(m.num_experts, i, h, mxfp4=True)
        mxfp4 = any(index.has(prefix + n) for n in packed if n.endswith("_blocks"))
        for name, shape in gpt_oss_experts.checkpoint_experts(m.num_experts, i, h, mxfp4).items():
            index.check(prefix + name, shape)
        names = gpt_oss_experts.hf_expert_names(prefix, mxfp4)
        return "biased", names, gpt_oss_experts.hf_layout(names, i, h, arch.dtype, *arch.clamped_swiglu)
    for prefix in arch.names.moe_blocks:
        gu, dn = f"{p}{prefix}.experts.gate_up_proj", f"{p}{prefix}.experts.down_proj"
        if index.has(gu) or index.has(dn):
            index.check(gu, (m.num_experts, 2 * i, h))
            index.check(dn, (m.num_experts, h, i))
            return "fused", gu, dn
    head = arch.names.hf_experts(p)     # expert j's parts: {head}{j}.{part}; the listing names expert 0's
    names = []
    for j in range(m.num_experts):
        trio = tuple(f"{head}{j}.{t.name.removeprefix(f'{head}0.')}" for t in l.expert_tensors)
        for n, t in zip(trio, l.expert_tensors):
            index.check(n, t.shape)
            if index.fp8(n):
                index.check_fp8_scales(n, t.shape, _fp8_block(geom, index, n))
        names.append(trio)
    return "per_expert", names


def _fp8_block(geom: ModelGeometry, index: _Index, name: str) -> tuple[int, int]:
    """The block of the checkpoint's fp8 scales (``quantization_config.weight_block_size``).
    Raises InputError when an fp8 tensor comes without a block-scaled fp8 config."""
    if geom.quant.method != "fp8":
        raise InputError(f"{index.where[name][0]}: tensor {name!r} is {FP8}, but config.json has "
                         "no block-scaled fp8 quantization_config; the checkpoint and its "
                         "config disagree")
    return tuple(geom.quant.block_size)


def resident_dtype(name, dtype: torch.dtype) -> torch.dtype:
    """The dtype a resident tensor is held in: ``dtype`` (the compute dtype), or fp32 for
    the tensors :data:`moefit.ingest.families.common.FP32_TENSORS` names (the weight
    pricing reads the same table)."""
    return torch.float32 if isinstance(name, str) and name.endswith(FP32_TENSORS) else dtype


def _no_transient(nbytes: int):
    return contextlib.nullcontext()


class _SafetensorsExperts(ExpertSource):
    """Experts of a safetensors checkpoint (module docstring: both layouts)."""

    def __init__(self, index: "_Index", geom: ModelGeometry, plans: dict, dtype: torch.dtype,
                 bar, transient):
        self.index, self.plans, self.bar, self.transient = index, plans, bar, transient
        self.hidden, self.dtype = geom.hidden_size, dtype
        self.experts = {l.index: l.moe.num_experts for l in geom.moe_layers}
        self.inter = {l.index: l.moe.expert_intermediate for l in geom.moe_layers}
        self.elems = {l: 3 * i * self.hidden for l, i in self.inter.items()}
        self.formats = {}
        # block-scaled fp8 experts stay as stored: uint8 blobs of e4m3 bytes and fp32 scales
        fp8 = {l: plan[0] == "per_expert" and index.fp8(plan[1][0][0]) for l, plan in plans.items()}
        for l, plan in plans.items():
            if plan[0] == "fused" and (index.fp8(plan[1]) or index.fp8(plan[2])):
                raise InputError(f"{index.model_dir}: {plan[1]!r} is {FP8}: fp8 experts are read one "
                                 "tensor per expert, as the published checkpoints store them")
        if any(fp8.values()):
            if not all(fp8.values()):
                raise InputError(f"{index.model_dir}: some MoE layers' experts are {FP8} and some "
                                 "are not; the runtime holds one expert format per checkpoint")
            block = _fp8_block(geom, index, next(iter(plans.values()))[1][0][0])
            self.dtype = torch.uint8
            self.formats = {l: StoredExpert.pack_fp8(i, self.hidden, block) for l, i in self.inter.items()}
            self.elems = {l: fmt.nbytes for l, fmt in self.formats.items()}
        biased = {l: p[2] for l, p in plans.items() if p[0] == "biased"}
        if biased:       # gpt-oss: every MoE layer's blob is uint8 bytes of its layout
            assert len(biased) == len(plans), "gpt-oss checkpoints have biased experts on every MoE layer"
            self.dtype, self.formats = torch.uint8, biased
            self.elems = {l: fmt.nbytes for l, fmt in biased.items()}

    def read(self, layer: int, targets: dict[int, torch.Tensor]) -> None:
        """Copy each expert ``e`` of ``targets`` (``{e: blob [3 I H]}``; gpt-oss: ``{e:
        uint8 blob}``) from the files. A fused tensor is read whole, one at a time; gpt-oss's
        fused tensors one expert's slice at a time (their mxfp4 blocks are repacked per
        expert: :func:`moefit.ingest.families.gpt_oss.expert_read_bytes` bounds what that holds)."""
        i, h, plan = self.inter[layer], self.hidden, self.plans[layer]
        if plan[0] == "biased":
            names, fmt, n = plan[1], plan[2], self.experts[layer]
            stored = sum(self.index.nbytes[name] for name in names.values())
            blocks = sum(self.index.nbytes[name] for role, name in names.items() if role.endswith("_blocks"))
            for e, dst in targets.items():
                with self.transient(gpt_oss.expert_read_bytes(stored, blocks, n)):
                    def get(name, e=e):
                        t = self.index.get_slice(name, e)
                        self.bar.update(t.numel())
                        return t
                    gpt_oss_experts.hf_expert_into(get, names, fmt, dst)
            return
        if plan[0] == "fused":
            for name, lo, hi in ((plan[1], 0, 2 * i * h), (plan[2], 2 * i * h, 3 * i * h)):
                with self.transient(self.index.nbytes[name]):
                    t = self.index.get(name)                           # [E, 2I, H] / [E, H, I]
                    for e, dst in targets.items():
                        dst[lo:hi].copy_(t[e].reshape(-1))
                    self.bar.update(t.numel() * len(targets) // t.shape[0])
            return
        fmt = self.formats.get(layer)
        for e, dst in targets.items():
            for part, name in enumerate(plan[1][e]):
                if fmt is not None:     # fp8: the e4m3 bytes, then the fp32 block scales
                    p = (fmt.gate, fmt.up, fmt.down)[part]
                    n, scale = p.rows * p.cols, name.removesuffix("weight") + "weight_scale_inv"
                    with self.transient(self.index.nbytes[name] + self.index.nbytes[scale]):
                        row = dst[p.offset:p.offset + p.nbytes]
                        row[:n].copy_(self.index.get(name).view(torch.uint8).reshape(-1))
                        row[n:].copy_(self.index.get(scale).reshape(-1).view(torch.uint8))
                        self.bar.update(n)
                    continue
                with self.transient(self.index.nbytes[name]):
                    t = self.index.get(name)
                    dst[part * i * h:(part + 1) * i * h].copy_(t.reshape(-1))
                    self.bar.update(t.numel())

    def close(self) -> None:
        self.bar.close()


def load_checkpoint(model_dir: str | Path, geom: ModelGeometry, arch: Arch, alloc: Alloc, *,
                    pin: bool = False, progress: bool = True,
                    transient=None) -> tuple[Weights, ExpertSource]:
    """Read the checkpoint in ``model_dir``: resident weights into tensors from ``alloc``
    (the ledger's ``weights`` line); the experts are read later, from the returned
    :class:`ExpertSource`.

    Every name and shape is checked against the geometry before any data is read.

    Args:
        alloc: ``alloc(shape, dtype) -> tensor`` on the device.
        pin: unused here (the engine pins the host rows it allocates); kept for callers.
        progress: show a progress bar (tqdm, on stderr).
        transient: ``transient(nbytes)`` -> a context in which a tensor of ``nbytes`` read
            from the files is held on the host (the host ledger's ``host_staging`` line).

    Raises InputError (see module docstring).
    """
    model_dir = Path(model_dir)
    index = _Index(model_dir)
    transient = transient or _no_transient
    dtype = arch.dtype
    # ---- resolve every name first: errors before any byte is read ------------------------
    glob = global_entries(geom, lambda t: t.name)
    layer_plans = [_layer_plan(l, geom, arch, index) for l in geom.layers]
    expert_plans = {l.index: _expert_plan(l, geom, arch, index) for l in geom.moe_layers}
    for attr, name, shape in glob + [t for lp in layer_plans for t in lp]:
        for part, part_shape in sources(name, shape):
            index.check(part, part_shape)

    total = sum(index.numel(n) for _, name, shape in glob + [t for lp in layer_plans for t in lp]
                for n, _ in sources(name, shape))
    for plan in expert_plans.values():
        names = ([plan[1], plan[2]] if plan[0] == "fused" else list(plan[1].values()) if plan[0] == "biased"
                 else [n for trio in plan[1] for n in trio])
        total += sum(index.numel(n) for n in names)
    bar = progress_bar(total, progress, model_dir.name)

    def resident(name: str | Packed, shape: tuple) -> torch.Tensor:
        if isinstance(name, Packed):
            if any(index.fp8(n) for n, _ in name.parts):
                raise InputError(f"{model_dir}: {name.parts[0][0]!r} is {FP8}: the runtime runs "
                                 "fp8 attention and MLP weights, not fp8 linear-attention ones")
            held = 2 * sum(index.nbytes[n] for n, _ in name.parts)     # the parts and the result
            with transient(held):
                src = name.build([index.get(n) for n, _ in name.parts])
                dst = alloc(shape, dtype)
                dst.copy_(src)
        elif index.fp8(name):     # held as stored: the e4m3 bytes and the block scales
            block = _fp8_block(geom, index, name)
            scale = index.check_fp8_scales(name, shape, block)
            m = Fp8Matrix(alloc((shape[0] * shape[1],), torch.uint8),
                          alloc(fp8_scale_shape(shape[0], shape[1], block), torch.float32),
                          shape[0], shape[1], block)
            with transient(index.nbytes[name] + index.nbytes[scale]):
                m.w.copy_(index.get(name).view(torch.uint8).reshape(-1))
                m.scale.copy_(index.get(scale))
            bar.update(index.numel(name))
            return m
        else:
            with transient(index.nbytes[name]):
                src = index.get(name)
                dst = alloc(shape, resident_dtype(name, dtype))
                dst.copy_(src)
        bar.update(src.numel())
        return dst

    weights = assemble_weights(glob, layer_plans, resident)
    return weights, _SafetensorsExperts(index, geom, expert_plans, dtype, bar, transient)


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, show: bool, name: str, unit: str = " params", **tqdm_args):
    """A tqdm bar on stderr over ``total`` units of loading ``name``; a no-op bar when not
    ``show`` or without tqdm. Both loaders use it (params for safetensors, bytes for GGUF)."""
    if not show:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc=f"loading {name}", unit=unit, unit_scale=True, leave=False,
                **tqdm_args)
