"""What the forward pass needs beyond the geometry: per-family switches from ``config.json``.

The geometry (:mod:`moefit.ingest.families`) already fixes the layer structure the plan priced:
attention kind and window per layer, which layers are MoE, expert widths. This module
adds the numbers and rules that only the forward pass uses, read the way the reference
implementations read them (transformers 5.x):

==========  =========================================  ==========================================
family      q/k norm                                   routing weights
==========  =========================================  ==========================================
qwen3_moe   RMSNorm per head ``[head_dim]``            softmax, top-k, renormalise if
            (``modeling_qwen3_moe.py``)                ``norm_topk_prob`` (config class default
                                                       False; Qwen3 checkpoints set True)
qwen2_moe   none; q/k/v bias (``qkv_bias``)            as qwen3_moe; plus the shared expert
            (``modeling_qwen2_moe.py``)                times ``sigmoid(shared_expert_gate(x))``
mixtral     none (``modeling_mixtral.py``)             softmax, top-k, always renormalised
olmoe       RMSNorm over all heads ``[heads*hd]``      as qwen3_moe (``norm_topk_prob``, default
            then ``clip_qkv`` (``modeling_olmoe.py``)  False)
qwen3_next  per head, ``(1 + w)`` RMSNorm (every norm   softmax, top-k, renormalise if
            but the gated one; ``Qwen3NextRMSNorm``)   ``norm_topk_prob`` (default True); plus
                                                       the sigmoid-gated shared expert
qwen3_5_moe as qwen3_next (``modeling_qwen3_5_moe.py``) always renormalised; shared expert
==========  =========================================  ==========================================

The hybrids (``qwen3_next``, ``qwen3_5_moe`` and its text-only ``qwen3_5_moe_text``) mix
Gated DeltaNet layers (:mod:`moefit.runtime.deltanet`) with gated full attention; a
multimodal ``qwen3_5_moe`` checkpoint keeps the text model's settings in ``text_config``
(the dtype at the top level) and its weights under ``model.language_model.`` (``prefix``);
the vision tower is not read.

Checkpoint names (``moe_prefix``): ``mlp`` for the Qwen families and OLMoE,
``block_sparse_moe`` for Mixtral (``w1`` gate, ``w3`` up, ``w2`` down).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from moefit.errors import InputError
from moefit.ingest.geometry import ModelGeometry

SUPPORTED = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "qwen3_next", "qwen3_5_moe",
             "qwen3_5_moe_text")
HYBRID = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: Default of ``norm_topk_prob`` in each family's config class (transformers 5.x).
_NORM_TOPK_DEFAULT = {"qwen3_moe": False, "qwen2_moe": False, "olmoe": False}


@dataclass(frozen=True)
class Arch:
    """Per-family switches of the forward pass (see module docstring).

    ``dtype``: compute and storage dtype of resident weights and activations.
    ``qk_norm``: ``"head"``, ``"full"`` or ``""``. ``renormalize``: divide the top-k
    routing weights by their sum. ``expert_names``: (gate, up, down) per-expert names.
    """

    model_type: str
    dtype: torch.dtype
    rms_eps: float
    qk_norm: str
    q_bias: bool
    o_bias: bool
    clip_qkv: float | None
    renormalize: bool
    moe_prefix: str
    expert_names: tuple[str, str, str]
    tie_embeddings: bool
    config: dict             # the text model's config (``text_config`` of a multimodal one)
    prefix: str = "model."   # checkpoint prefix of the text model
    norm_offset: float = 0.0  # 1.0: ``(1 + w)`` RMSNorm weights (Qwen3-Next / Qwen3.5)


def read_config(model_dir: str | Path) -> dict:
    """``config.json`` of a model directory. Raises InputError naming the file."""
    path = Path(model_dir) / "config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise InputError(f"{path}: cannot read the model config ({e})") from e


def arch_from_config(cfg: dict, geom: ModelGeometry) -> Arch:
    """Switches for ``cfg`` (a ``config.json`` dict) of a model with geometry ``geom``.

    Raises InputError for a model type the runtime does not run yet, or a config that is
    not the one the plan was solved for.
    """
    mt = cfg.get("model_type")
    if mt != geom.model_type:
        raise InputError(f"config.json declares model_type {mt!r} but the plan was solved for "
                         f"{geom.model_type!r} ({geom.source}); plan the same model you run")
    if mt not in SUPPORTED:
        raise InputError(f"model_type {mt!r}: the runtime runs {', '.join(SUPPORTED)} "
                         "(the planner knows more families: `moefit plan` works for it)")
    if mt in HYBRID:
        return _hybrid_arch(cfg)
    dtype_name = str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16").removeprefix("torch.")
    if dtype_name not in TORCH_DTYPES:
        raise InputError(f"config dtype {dtype_name!r} is not supported by the runtime "
                         f"(use one of {', '.join(TORCH_DTYPES)})")
    qkv_bias = bool(cfg.get("qkv_bias", True)) if mt == "qwen2_moe" else bool(cfg.get("attention_bias", False))
    o_bias = qkv_bias and mt in ("qwen3_moe", "olmoe")
    if mt == "mixtral":
        renorm = True
    else:
        value = cfg.get("norm_topk_prob")
        renorm = _NORM_TOPK_DEFAULT[mt] if value is None else bool(value)
    mixtral = mt == "mixtral"
    return Arch(
        model_type=mt, dtype=TORCH_DTYPES[dtype_name],
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        qk_norm={"qwen3_moe": "head", "olmoe": "full"}.get(mt, ""),
        q_bias=qkv_bias, o_bias=o_bias,
        clip_qkv=cfg.get("clip_qkv") if mt == "olmoe" else None,
        renormalize=renorm,
        moe_prefix="block_sparse_moe" if mixtral else "mlp",
        expert_names=("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj"),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        config=cfg,
    )


def _hybrid_arch(cfg: dict) -> Arch:
    """Switches of Qwen3-Next / Qwen3.5 (``modeling_qwen3_next.py``, ``modeling_qwen3_5_moe.py``).

    Raises InputError for an unsupported dtype or activation.
    """
    mt = cfg["model_type"]
    multimodal = mt == "qwen3_5_moe" and isinstance(cfg.get("text_config"), dict)
    text = dict(cfg["text_config"]) if multimodal else cfg
    raw = (text.get("dtype") or text.get("torch_dtype") or cfg.get("dtype")
           or cfg.get("torch_dtype") or "bfloat16")
    dtype_name = str(raw).removeprefix("torch.")
    if dtype_name not in TORCH_DTYPES:
        raise InputError(f"config dtype {dtype_name!r} is not supported by the runtime "
                         f"(use one of {', '.join(TORCH_DTYPES)})")
    act = text.get("hidden_act", "silu")
    if act != "silu":
        raise InputError(f"hidden_act {act!r}: the runtime runs SiLU hybrids only")
    bias = bool(text.get("attention_bias", False))
    norm_topk = text.get("norm_topk_prob")
    tied = text.get("tie_word_embeddings")
    if tied is None:
        tied = cfg.get("tie_word_embeddings", False)
    return Arch(
        model_type=mt, dtype=TORCH_DTYPES[dtype_name],
        rms_eps=float(text.get("rms_norm_eps", 1e-6)),
        qk_norm="head", q_bias=bias, o_bias=bias, clip_qkv=None,
        # Qwen3_5MoeTopKRouter always renormalises; Qwen3NextTopKRouter if norm_topk_prob
        renormalize=True if mt != "qwen3_next" or norm_topk is None else bool(norm_topk),
        moe_prefix="mlp", expert_names=("gate_proj", "up_proj", "down_proj"),
        tie_embeddings=bool(tied), config=text,
        prefix="model.language_model." if multimodal else "model.", norm_offset=1.0,
    )
