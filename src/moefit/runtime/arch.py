"""What the forward pass needs beyond the geometry: per-family switches from ``config.json``.

The geometry (:mod:`moefit.families`) already fixes the layer structure the plan priced:
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
==========  =========================================  ==========================================

Checkpoint names (``moe_prefix``): ``mlp`` for the Qwen families and OLMoE,
``block_sparse_moe`` for Mixtral (``w1`` gate, ``w3`` up, ``w2`` down).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from moefit.errors import InputError
from moefit.geometry import ModelGeometry

SUPPORTED = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
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
    config: dict


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
