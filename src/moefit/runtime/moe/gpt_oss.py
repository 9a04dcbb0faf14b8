"""gpt-oss experts: their blob, how the loaders fill it, and the clamped SwiGLU that runs it.

An expert of gpt-oss (transformers ``GptOssExperts``) has biases and a clamped SwiGLU::

    g, u = x @ Wg^T + bg, x @ Wu^T + bu           # [n, I] each
    g = min(g, limit);  u = clamp(u, -limit, limit)
    y = ((u + 1) * g * sigmoid(alpha * g)) @ Wd^T + bd

(``GptOssExperts._apply_gate``: ``alpha`` 1.702, ``limit`` 7.0; the reference computes
``glu = g * sigmoid(g * alpha)`` first, this file ``(u + 1) * g`` first, in place: one
rounding apart). The checkpoint holds ``gate_up_proj`` with the gate and up columns
interleaved (``gate_up[..., ::2]``, ``gate_up[..., 1::2]``); the blob holds them split.

One blob per expert (docs/design.md, runtime contract), :class:`BiasedExpert`::

    [ bg (I) | bu (I) | bd (H) | gate [I, H] | up [I, H] | down [H, I] ]

the biases first (in their own type: the compute dtype from safetensors, the file's type
from GGUF), then the three matrices each in its own ggml type, back to back
(:class:`~moefit.runtime.kernels.quant.StoredExpert` parts). The blob is exactly the bytes the
checkpoint holds for that expert, which is what the planner prices
(:func:`moefit.ingest.checkpoint.exact_weights`: the fused tensors' bytes divided by the
expert count; :func:`moefit.ingest.gguf_header.exact_from_gguf` likewise).

Sources of the three layouts a loader reads:

- bf16 / fp32 safetensors (``save_pretrained`` of ``GptOssForCausalLM``):
  ``mlp.experts.gate_up_proj`` ``[E, H, 2I]``, ``gate_up_proj_bias`` ``[E, 2I]``,
  ``down_proj`` ``[E, I, H]``, ``down_proj_bias`` ``[E, H]``; the matrices are transposed
  into ``[out, in]`` rows.
- the mxfp4 checkpoint (``quantization_config.quant_method`` ``mxfp4``; transformers
  ``integrations/mxfp4.py`` ``convert_moe_packed_tensors``): ``{w}_blocks``
  ``[E, out, in/32, 16]`` (two e2m1 values per byte, element ``2j`` in the low nibble) and
  ``{w}_scales`` ``[E, out, in/32]`` (e8m0, value ``2^(s - 127)``). They are kept as stored:
  each block of 32 becomes a GGUF MXFP4 block (the scale byte, then 16 bytes whose byte
  ``j`` holds elements ``j`` and ``j + 16``: llama.cpp ``convert_hf_to_gguf.py``
  ``GptOssModel.repack_mxfp4`` / ``transform_nibble_layout``), a permutation of the same
  17 bytes, no dequantization.
- GGUF ``gpt-oss`` (``MODEL_TENSORS[GPT_OSS]``): ``ffn_{gate,up}_exps`` ``[E, I, H]``,
  ``ffn_down_exps`` ``[E, H, I]`` in any type, ``ffn_{gate,up,down}_exps.bias``.

Running it: a quantized matrix is multiplied from the stored blocks by the Triton kernels
where they run and read its type (a CUDA device:
:func:`~moefit.runtime.kernels.quant.stored_kernels_on`; mxfp4 and the GGUF types of
:data:`moefit.memory.gpu_kernels.TYPES`), the biases added after, nothing dequantized
(:func:`moefit.memory.staging.experts_fused` then prices no matrix); by the C kernels for
a few rows (decode, :data:`~moefit.runtime.kernels.quant.StoredMatrix.SMALL_ROWS`), else
dequantized into one ``[I, H]`` buffer of the staging workspace's fixed region (priced by
:func:`moefit.memory.staging.fixed_region_bytes` when ``experts_stored``); a float matrix is
a view of the blob. The activations use the caller's ``scratch`` (``2 n I``) and ``out``
(``n H``) as the plain SwiGLU does, so the MoE step's staging is the same.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from moefit.errors import InputError
from moefit.ingest.families.gpt_oss import NAMES, checkpoint_experts, mxfp4_to_gguf
from moefit.runtime.kernels import qmatmul
from moefit.runtime.kernels.linear import FLOAT_TYPES as TYPE_OF    # torch dtype -> ggml float type
from moefit.memory import gpu_kernels
from moefit.runtime.kernels.quant import FLOAT_DTYPES, Part, StoredMatrix, row_bytes, stored_kernels_on


@dataclass(frozen=True)
class BiasedExpert:
    """The blob layout of one gpt-oss MoE layer's experts (module docstring): biases of
    ``bias_type`` (a float ggml type) at offset 0, then ``gate`` / ``up`` / ``down``
    (:class:`~moefit.runtime.kernels.quant.Part`); ``alpha`` / ``limit`` of the clamped SwiGLU."""

    inter: int
    hidden: int
    bias_type: str
    gate: Part
    up: Part
    down: Part
    alpha: float
    limit: float

    @classmethod
    def pack(cls, inter: int, hidden: int, bias_type: str, gate: str, up: str, down: str,
             alpha: float, limit: float) -> "BiasedExpert":
        """The layout for these types (parts back to back after the biases, no padding).
        Raises InputError for a bias type that is not F32 / F16 / BF16."""
        if bias_type not in FLOAT_DTYPES:
            raise InputError(f"gpt-oss expert biases stored as {bias_type}: the runtime reads "
                             f"them as {', '.join(FLOAT_DTYPES)}")
        off = (2 * inter + hidden) * FLOAT_DTYPES[bias_type].itemsize
        g = Part(gate, inter, hidden, off, inter * row_bytes(gate, hidden))
        u = Part(up, inter, hidden, g.offset + g.nbytes, inter * row_bytes(up, hidden))
        d = Part(down, hidden, inter, u.offset + u.nbytes, hidden * row_bytes(down, inter))
        return cls(inter, hidden, bias_type, g, u, d, alpha, limit)

    @property
    def bias_bytes(self) -> int:
        return self.gate.offset

    @property
    def nbytes(self) -> int:
        return self.down.offset + self.down.nbytes

    def biases(self, blob: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of ``bg`` ``[I]``, ``bu`` ``[I]``, ``bd`` ``[H]`` in ``blob`` (uint8)."""
        b = blob[:self.bias_bytes].view(FLOAT_DTYPES[self.bias_type])
        i = self.inter
        return b[:i], b[i:2 * i], b[2 * i:]

    def swiglu(self, x: torch.Tensor, blob: torch.Tensor, ws=None, scratch=None,
               out=None) -> torch.Tensor:
        """The expert in ``blob`` (uint8 ``[nbytes]`` on ``x``'s device) on ``x`` ``[n, H]``
        -> ``[n, H]`` in ``x``'s dtype (module docstring). ``scratch`` (at least ``2 n I``
        elements of ``x``'s dtype) and ``out`` ``[n, H]`` come from the staging workspace
        (allocated when None); ``ws``: the workspace, whose fixed region holds a
        dequantized matrix or the C kernels' fp32 outputs (allocated when None)."""
        n, i, act = x.shape[0], self.inter, x.dtype
        if scratch is None:
            scratch = torch.empty(2 * n * i, dtype=act, device=x.device)
        if out is None:
            out = torch.empty((n, self.hidden), dtype=act, device=x.device)
        bg, bu, bd = self.biases(blob)
        g = scratch[:n * i].view(n, i)
        u = scratch[n * i:2 * n * i].view(n, i)
        region = ws.fixed if ws is not None else None
        self._matmul(self.gate, x, blob, g, region).add_(bg)
        self._matmul(self.up, x, blob, u, region).add_(bu)
        g.clamp_(max=self.limit)
        u.clamp_(-self.limit, self.limit).add_(1.0).mul_(g)     # (u + 1) * g
        u.mul_(g.mul_(self.alpha).sigmoid_())                   # * sigmoid(alpha g)
        self._matmul(self.down, u, blob, out, region)
        return out.add_(bd)

    @staticmethod
    def _matmul(p: Part, x: torch.Tensor, blob: torch.Tensor, out: torch.Tensor, region) -> torch.Tensor:
        """``out = x @ W^T`` for the part ``p`` of ``blob``: a float part viewed in place, a
        few rows against a quantized part through the C kernels, else the part dequantized
        into the fixed region (or a new buffer) and ``torch.mm``."""
        with (region.scope() if region is not None else contextlib.nullcontext()):
            return BiasedExpert._matmul_in(p, x, blob, out, region)

    @staticmethod
    def _matmul_in(p: Part, x: torch.Tensor, blob: torch.Tensor, out: torch.Tensor, region) -> torch.Tensor:
        raw = blob[p.offset:p.offset + p.nbytes]
        n = x.shape[0]
        if p.qtype in FLOAT_DTYPES:
            w = raw.view(FLOAT_DTYPES[p.qtype]).view(p.rows, p.cols)
            if w.dtype != x.dtype:
                w = w.to(x.dtype)
            return torch.mm(x, w.t(), out=out)
        if stored_kernels_on(x.device) and gpu_kernels.supports(p.qtype, p.cols):
            # the Triton kernels on the stored blocks (a CUDA device): nothing dequantized
            return p.matmul(blob, x if x.stride(-1) == 1 else x.contiguous(), out)
        if (n <= StoredMatrix.SMALL_ROWS and x.device.type == "cpu" and qmatmul.reads(x) and qmatmul.available()
                and qmatmul.supports(p.qtype, p.cols)):
            xc = x.contiguous()
            if out.dtype == torch.float32 and out.is_contiguous():
                return qmatmul.gemm(xc, raw, p.qtype, p.rows, p.cols, out=out)
            f32 = (region.take((n, p.rows), torch.float32) if region is not None
                   else torch.empty((n, p.rows), dtype=torch.float32))
            return out.copy_(qmatmul.gemm(xc, raw, p.qtype, p.rows, p.cols, out=f32))
        buf = (region.take((p.rows * p.cols,), x.dtype) if region is not None
               else torch.empty(p.rows * p.cols, dtype=x.dtype, device=x.device))
        w = p.dequantize_into(blob, buf.view(p.rows, p.cols))
        return torch.mm(x, w.t(), out=out)


# ---- the mxfp4 checkpoint's blocks -> GGUF MXFP4 blocks ------------------------------------------
def mxfp4_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """HF mxfp4 ``blocks`` ``[..., nb, 16]`` and ``scales`` ``[..., nb]`` (uint8, CPU) ->
    GGUF MXFP4 rows ``[..., nb * 17]`` (uint8), the same bytes with the nibbles permuted
    (:func:`moefit.ingest.families.gpt_oss.mxfp4_to_gguf`, the one home of the layout), so
    :func:`moefit.runtime.kernels.quant.dequantize` of the result equals transformers'
    ``convert_moe_packed_tensors``."""
    return torch.from_numpy(mxfp4_to_gguf(blocks.contiguous().numpy(), scales.contiguous().numpy()))


# ---- loading ---------------------------------------------------------------------------------
def hf_expert_names(prefix: str, mxfp4: bool) -> dict[str, str]:
    """The checkpoint names of one layer's fused experts under ``prefix``
    (``model.layers.N.mlp.experts.``) by role: ``gate_up_bias``, ``down_bias``, and
    ``gate_up`` / ``down``, or for mxfp4 ``gate_up_blocks``, ``gate_up_scales``,
    ``down_blocks``, ``down_scales`` (the names of
    :func:`moefit.ingest.families.gpt_oss.checkpoint_experts`)."""
    gu, gub, dn, dnb = NAMES.fused_experts
    roles = {"gate_up_bias": gub, "down_bias": dnb}
    if mxfp4:
        roles.update(gate_up_blocks=f"{gu}_blocks", gate_up_scales=f"{gu}_scales",
                     down_blocks=f"{dn}_blocks", down_scales=f"{dn}_scales")
    else:
        roles.update(gate_up=gu, down=dn)
    return {role: prefix + name for role, name in roles.items()}


def hf_layout(names: dict[str, str], i: int, h: int, dtype: torch.dtype, alpha: float,
              limit: float) -> BiasedExpert:
    """The blob layout of one layer's experts read from the safetensors tensors of
    :func:`hf_expert_names`: biases and float matrices in ``dtype`` (the config's; the
    loader converts), mxfp4 matrices as stored (MXFP4)."""
    wtype = "MXFP4" if "gate_up_blocks" in names else TYPE_OF[dtype]
    return BiasedExpert.pack(i, h, TYPE_OF[dtype], wtype, wtype, wtype, alpha, limit)


def hf_expert_into(get, names: dict[str, str], fmt: BiasedExpert, dst: torch.Tensor) -> None:
    """One expert's blob into ``dst`` (uint8 ``[fmt.nbytes]``, its device slot or host row)
    from ``get(name)``: that expert's slice of the layer's tensor ``name`` (the leading
    expert dim dropped: ``gate_up_proj`` ``[H, 2I]``, ``gate_up_proj_bias`` ``[2I]``, ...).
    Biases and float matrices are converted to ``fmt.bias_type``; mxfp4 matrices are
    repacked as stored (:func:`mxfp4_blocks`). The host bytes this holds at once:
    :func:`moefit.ingest.families.gpt_oss.expert_read_bytes`."""
    i, dtype = fmt.inter, FLOAT_DTYPES[fmt.bias_type]
    bias = dst[:fmt.bias_bytes].view(dtype)                            # [2I + H]
    gub = get(names["gate_up_bias"])                                   # [2I] interleaved
    bias[:i].copy_(gub[0::2])
    bias[i:2 * i].copy_(gub[1::2])
    bias[2 * i:].copy_(get(names["down_bias"]))
    parts = (fmt.gate, fmt.up, fmt.down)
    if "gate_up_blocks" in names:
        gu = mxfp4_blocks(get(names["gate_up_blocks"]), get(names["gate_up_scales"]))   # [2I, H/32*17]
        dn = mxfp4_blocks(get(names["down_blocks"]), get(names["down_scales"]))          # [H, I/32*17]
        for p, m in zip(parts, (gu[0::2], gu[1::2], dn)):
            dst[p.offset:p.offset + p.nbytes].view(p.rows, -1).copy_(m)
        return
    gu = get(names["gate_up"]).t()                                     # [2I, H]
    for p, m in zip(parts, (gu[0::2], gu[1::2], get(names["down"]).t())):
        dst[p.offset:p.offset + p.nbytes].view(dtype).view(p.rows, p.cols).copy_(m)
