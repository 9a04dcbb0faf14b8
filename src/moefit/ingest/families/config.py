"""Reading a family's ``config.json``: the :class:`Cfg` access with errors naming the key
and the file, the dtype, ``quantization_config``, RoPE (the one reading of the planner and
the runtime), the sizes every softmax-attention family reads alike, and layer schedules.

Part of what every family shares (:mod:`moefit.ingest.families.common`). Imports no torch.
"""

from __future__ import annotations

from typing import Any, Callable

from moefit.errors import InputError
from moefit.ingest.geometry import DTYPE_BYTES, Quantization, RopeSpec
from moefit.ingest.inputs import bounded_float, bounded_int
from moefit.records import record

#: Roles that a block-scaled fp8 checkpoint quantizes (every linear role but router, embed, head).
FP8_ROLES = frozenset({"attention", "linear_attention", "shared_expert", "dense_mlp", "expert"})


class Cfg:
    """A config dict plus where it came from, for error messages naming key and file."""

    def __init__(self, data: dict, source: str, parent: "Cfg | None" = None, path: str = ""):
        self.data = data
        self.source = source or "<config>"
        self.parent = parent
        self.path = path   # "text_config." for a nested block

    def req(self, key: str) -> Any:
        """Required key; InputError naming the key and the file when absent or null."""
        value = self.data.get(key)
        if value is None:
            raise InputError(
                f"{self.source}: required key '{self.path}{key}' is missing "
                f"(model_type {self.top.data.get('model_type', '?')!r})")
        return value

    def get(self, key: str, default: Any = None) -> Any:
        value = self.data.get(key)
        return default if value is None else value

    def get_any(self, key: str, default: Any = None) -> Any:
        """The key here, else in the enclosing config (multimodal top level), else default."""
        if self.data.get(key) is not None:
            return self.data[key]
        if self.parent is not None:
            return self.parent.get_any(key, default)
        return default

    @property
    def top(self) -> "Cfg":
        return self.parent.top if self.parent is not None else self

    def int(self, key: str, default: int | None = None) -> int:
        """A whole number within what a real model has for ``key``
        (:func:`moefit.ingest.inputs.bounded_int`: no bool, NaN, infinity or absurd size)."""
        value = self.req(key) if default is None else self.get(key, default)
        return bounded_int(value, f"{self.path}{key}", self.source)

    def num_experts(self) -> int:
        """Routed experts: ``num_experts``, or ``num_local_experts``, the name transformers
        5.x writes for it on ``save_pretrained`` (its configs' ``attribute_map``)."""
        key = "num_experts" if self.data.get("num_experts") is not None else "num_local_experts"
        if self.data.get(key) is None:
            raise InputError(f"{self.source}: required key '{self.path}num_experts' is missing "
                             f"(model_type {self.top.data.get('model_type', '?')!r})")
        return self.int(key)

    def text_config(self) -> "Cfg":
        sub = self.req("text_config")
        if not isinstance(sub, dict):
            raise InputError(f"{self.source}: 'text_config' must be an object, got {type(sub).__name__}")
        return Cfg(sub, self.source, parent=self, path="text_config.")


def dtype_name(cfg: dict, text: dict | None = None) -> str:
    """The checkpoint dtype named by a config: ``dtype`` or the older ``torch_dtype`` of the
    text config ``text`` first, then of ``cfg``; default ``bfloat16`` (gpt-oss has none);
    a ``torch.`` prefix dropped. ``dtype`` wins over ``torch_dtype`` in one scope, as in
    transformers 5 (``PreTrainedConfig.__init__``). The one reading of the planner
    (:func:`read_dtype`) and the runtime (:mod:`moefit.runtime.arch`). Unchecked."""
    for scope in (text, cfg):
        raw = (scope or {}).get("dtype") or (scope or {}).get("torch_dtype")
        if raw:
            return str(raw).removeprefix("torch.")
    return "bfloat16"


def read_dtype(c: Cfg) -> tuple[str, int]:
    """(dtype name, bytes per element) of ``c`` (:func:`dtype_name`: text config first,
    then the enclosing config). Errors: InputError for a dtype with no byte size."""
    top = c.top
    name = dtype_name(top.data, c.data if c is not top else None)
    if name not in DTYPE_BYTES:
        raise InputError(f"{c.source}: unsupported dtype {name!r}; expected one of "
                         f"{', '.join(sorted(DTYPE_BYTES))}")
    return name, DTYPE_BYTES[name]


def read_quantization(c: Cfg) -> tuple[Quantization, tuple[str, ...]]:
    """``quantization_config`` -> (Quantization, modules_to_not_convert patterns).

    fp8 with ``weight_block_size`` [128, 128] (DeepSeek-V3, Kimi-K2, Qwen *-FP8): every linear
    role but router/embed/lm_head. fp8 without a block size (per-tensor scale) is priced as one
    block per tensor. mxfp4 (gpt-oss): routed experts only. Errors: InputError for any other
    ``quant_method`` (the byte layout would be a guess).
    """
    q = c.get_any("quantization_config")
    if not q:
        return Quantization(), ()
    if not isinstance(q, dict):
        raise InputError(f"{c.source}: 'quantization_config' must be an object")
    method = str(q.get("quant_method", "")).lower()
    skip = tuple(q.get("modules_to_not_convert") or q.get("ignored_layers") or ())
    if method == "fp8":
        block = q.get("weight_block_size")
        size = (1 << 30, 1 << 30)
        if block:
            if not isinstance(block, list) or len(block) != 2:
                raise InputError(f"{c.source}: quantization_config.weight_block_size must be "
                                 f"[rows, columns], got {block!r}")
            size = tuple(bounded_int(b, "quantization_config.weight_block_size", c.source, minimum=1)
                         for b in block)
        return Quantization("fp8", size, FP8_ROLES), skip
    if method == "mxfp4":
        return Quantization("mxfp4", applies_to=frozenset({"expert"})), skip
    raise InputError(f"{c.source}: quantization_config.quant_method {method!r} is not supported; "
                     "supported: fp8 (block-scaled), mxfp4 (gpt-oss experts); "
                     "use the unquantized config to plan")


@record
class RopeConfig:
    """RoPE as a config declares it, read by the one rule of :func:`rope_config`.

    ``block``: the scaling dict (keys ``rope_type`` / ``type``, ``factor``,
    ``original_max_position_embeddings``, ``beta_fast``, ...), ``{}`` when none;
    ``theta``: the base; ``rope_type``: ``default`` when the config does not scale RoPE;
    ``max_position_embeddings``: tokens (0 when absent).
    """

    block: dict
    theta: float
    rope_type: str
    max_position_embeddings: int


def rope_block(cfg: dict) -> dict:
    """The RoPE dict of a config: ``rope_scaling`` when it is a non-empty dict, else
    ``rope_parameters``, else ``{}``.

    The rule of transformers 5.x (``RotaryEmbeddingConfigMixin.convert_rope_params_to_dict``
    in ``modeling_rope_utils.py``: ``self.rope_parameters = rope_scaling or
    self.rope_parameters``): a legacy ``rope_scaling`` found in ``config.json`` replaces
    ``rope_parameters`` whole, so a config carrying both keys runs ``rope_scaling``.
    """
    scaling = cfg.get("rope_scaling")
    if isinstance(scaling, dict) and scaling:
        return scaling
    params = cfg.get("rope_parameters")
    return params if isinstance(params, dict) else {}


def rope_config(cfg: dict) -> RopeConfig:
    """The RoPE of a (text) config dict, torch-free: the one reading of the planner
    (:func:`read_rope`) and the runtime (``moefit.runtime.layers.rope.rope_from_config``).

    ``block`` per :func:`rope_block`; ``theta``: the block's ``rope_theta``, else the
    top-level ``rope_theta``, else 10000 (transformers' ``convert_rope_params_to_dict``:
    ``rope_parameters.setdefault("rope_theta", rope_theta)``, ``default_theta`` 10000);
    ``rope_type``: ``rope_type`` or the older ``type`` (``standardize_rope_params``).
    Errors: ValueError/TypeError from a non-numeric value (callers name the file).
    """
    block = rope_block(cfg)
    theta = block.get("rope_theta")
    if theta is None:
        theta = cfg.get("rope_theta")
    kind = block.get("rope_type") or block.get("type") or "default"
    return RopeConfig(block=block, theta=float(theta if theta is not None else 10000.0),
                      rope_type=str(kind), max_position_embeddings=int(cfg.get("max_position_embeddings") or 0))


def rope_factor_and_window(r: RopeConfig, max_pos: int) -> tuple[float, int]:
    """(factor, original window in tokens) of RoPE ``r`` in a model trained to ``max_pos``
    tokens: the one interpretation of the planner (:func:`read_rope`) and the runtime
    (``moefit.runtime.layers.rope.rope_from_config``).

    Unscaled RoPE (``default``): (1, ``max_pos``). Scaled: the original window is
    ``original_max_position_embeddings``, else ``max_pos`` (transformers 5.x
    ``convert_rope_params_to_dict``: ``rope_parameters.setdefault(
    "original_max_position_embeddings", self.max_position_embeddings)`` for llama3 / yarn /
    longrope); the factor is ``factor``, else for yarn and longrope ``max_pos / original``
    (``_compute_yarn_parameters`` / ``_compute_longrope_parameters`` in
    ``modeling_rope_utils.py``: ``if factor is None: factor = config.max_position_embeddings
    / original_max_position_embeddings``), else 1.
    """
    if r.rope_type == "default":
        return 1.0, max_pos
    original = int(r.block.get("original_max_position_embeddings") or max_pos)
    factor = r.block.get("factor")
    if factor is None:
        factor = max_pos / original if r.rope_type in ("yarn", "longrope") else 1.0
    return float(factor), original


def read_rope(c: Cfg, max_pos: int) -> RopeSpec:
    """RoPE as the planner prices it (:func:`rope_config`): the scaling type (``default``
    means none), factor and original window per :func:`rope_factor_and_window`; ``trained_window`` =
    ``max_position_embeddings``.
    """
    r = rope_config(c.data)
    kind = None if r.rope_type == "default" else r.rope_type
    if kind and r.block.get("factor") is not None:   # name the key before any arithmetic
        bounded_float(r.block["factor"], "rope_scaling.factor", c.source, low=1e-3, high=1e6)
    if kind and r.block.get("original_max_position_embeddings") is not None:
        bounded_int(r.block["original_max_position_embeddings"], "original_max_position_embeddings",
                    c.source, minimum=1)
    factor, original = rope_factor_and_window(r, max_pos)
    if kind:
        factor = bounded_float(factor, "rope_scaling.factor", c.source, low=1e-3, high=1e6)
        original = bounded_int(original, "original_max_position_embeddings", c.source, minimum=1)
    theta = bounded_float(r.theta, "rope_theta", c.source, low=1e-3, high=1e30)
    return RopeSpec(theta=theta, scaling_type=kind, factor=factor,
                    trained_window=max_pos, original_window=original)


def partial_rotary(c: Cfg, default: float = 1.0) -> float:
    """``partial_rotary_factor``: inside the RoPE dict (:func:`rope_block`), else at top
    level, else 1. The rule of :func:`rope_config` for ``rope_theta``: transformers'
    ``convert_rope_params_to_dict`` sets the top-level value as the dict's default, and the
    models read the dict (``modeling_qwen3_next.py``: ``config.rope_parameters.get(
    "partial_rotary_factor", 1.0)``). A fraction of the head dimension: 0 to 1; ``default``
    when the config has none (the config class's: GLM-4.5's ``Glm4MoeConfig`` sets 0.5)."""
    value = rope_block(c.data).get("partial_rotary_factor")
    return bounded_float(value if value is not None else c.get("partial_rotary_factor", default),
                         "partial_rotary_factor", c.source, low=0.0, high=1.0)


@record
class Sizes:
    """Sizes every softmax-attention family reads the same way."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_pos: int


def read_sizes(c: Cfg, head_dim_default: int | None = None) -> Sizes:
    hidden = c.int("hidden_size")
    heads = c.int("num_attention_heads")
    head_dim = c.get("head_dim") or head_dim_default or hidden // heads
    return Sizes(hidden=hidden, layers=c.int("num_hidden_layers"), heads=heads,
                   kv_heads=c.int("num_key_value_heads", heads), head_dim=int(head_dim),
                   vocab=c.int("vocab_size"), max_pos=c.int("max_position_embeddings"))


def layer_types(c: Cfg, n: int, default: Callable[[int], str]) -> list[str]:
    """``layer_types`` when the config lists them (checked for length), else ``default(i)``."""
    types = c.get("layer_types")
    if types is None:
        return [default(i) for i in range(n)]
    if len(types) != n:
        raise InputError(f"{c.source}: {c.path}layer_types has {len(types)} entries for "
                         f"num_hidden_layers {n}")
    return list(types)


def softmax_kind(c: Cfg, layer_type: str, window: int | None) -> str:
    if layer_type == "sliding_attention" and window:
        return "sliding"
    if layer_type in ("full_attention", "sliding_attention", "chunked_attention"):
        return "full"
    raise InputError(f"{c.source}: unknown layer type {layer_type!r} in {c.path}layer_types")
