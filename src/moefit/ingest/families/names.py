"""The tensor name tables: Hugging Face name <-> GGUF name <-> runtime slot, per layer
(:data:`LAYER_NAMES`, the families' own modules: :data:`GGUF_LAYER_EXTRA`), model-wide
(:data:`GLOBAL_NAMES`) and per routed expert (:data:`GGUF_EXPERT_NAMES`,
:data:`GGUF_EXPERT_PARTS`), resolved for one family by :func:`name_table`
(:class:`NameTable`); and the tensors held in fp32 (:data:`FP32_TENSORS`).

Part of what every family shares (:mod:`moefit.ingest.families.common`). Imports no torch.
"""

from __future__ import annotations

from moefit.records import field, record

#: Per-layer tensors the runtime holds resident: slot (a ``LayerWeights`` field) ->
#: (Hugging Face name under ``{prefix}layers.N.``, GGUF name under ``blk.N.``). ``{moe}`` is
#: the family's MoE block name (:attr:`NameTable.moe_prefix`). GGUF names: llama.cpp
#: ``gguf-py/gguf/constants.py`` ``TENSOR_NAMES`` (``MODEL_TENSOR.ATTN_NORM`` ->
#: ``blk.{bid}.attn_norm`` ...) and the HF -> GGUF map of ``gguf-py/gguf/tensor_mapping.py``
#: used by ``convert_hf_to_gguf.py``.
LAYER_NAMES: dict[str, tuple[str, str]] = {
    "input_norm": ("input_layernorm.weight", "attn_norm.weight"),
    "post_norm": ("post_attention_layernorm.weight", "ffn_norm.weight"),
    "q": ("self_attn.q_proj.weight", "attn_q.weight"),
    "k": ("self_attn.k_proj.weight", "attn_k.weight"),
    "v": ("self_attn.v_proj.weight", "attn_v.weight"),
    "o": ("self_attn.o_proj.weight", "attn_output.weight"),
    "q_bias": ("self_attn.q_proj.bias", "attn_q.bias"),
    "k_bias": ("self_attn.k_proj.bias", "attn_k.bias"),
    "v_bias": ("self_attn.v_proj.bias", "attn_v.bias"),
    "o_bias": ("self_attn.o_proj.bias", "attn_output.bias"),
    "q_norm": ("self_attn.q_norm.weight", "attn_q_norm.weight"),
    "k_norm": ("self_attn.k_norm.weight", "attn_k_norm.weight"),
    "router": ("{moe}.gate.weight", "ffn_gate_inp.weight"),
    "shared_gate": ("mlp.shared_expert.gate_proj.weight", "ffn_gate_shexp.weight"),
    "shared_up": ("mlp.shared_expert.up_proj.weight", "ffn_up_shexp.weight"),
    "shared_down": ("mlp.shared_expert.down_proj.weight", "ffn_down_shexp.weight"),
    "shared_expert_gate": ("mlp.shared_expert_gate.weight", "ffn_gate_inp_shexp.weight"),
    "dense_gate": ("mlp.gate_proj.weight", "ffn_gate.weight"),
    "dense_up": ("mlp.up_proj.weight", "ffn_up.weight"),
    "dense_down": ("mlp.down_proj.weight", "ffn_down.weight"),
}

#: Name suffixes (Hugging Face, GGUF) of tensors held in fp32 whatever the compute dtype:
#: the router's ``e_score_correction_bias`` of DeepSeek-V3 / Kimi-K2 / GLM-4.5 (slot
#: ``router_bias``; GGUF ``exp_probs_b.bias``), which transformers keeps in fp32
#: (``_keep_in_fp32_modules_strict`` of ``DeepseekV3PreTrainedModel``) and vLLM too: it
#: decides which experts run, and bf16 would round it. The weight pricing
#: (``moefit.ingest.checkpoint.held_bytes``, ``moefit.ingest.gguf_header``) and both loaders
#: read this.
FP32_TENSORS: tuple[str, ...] = ("e_score_correction_bias", "exp_probs_b.bias")

#: Model-wide tensors: slot -> (Hugging Face name, under the text model's prefix except
#: ``lm_head``, GGUF name) (``TENSOR_NAMES``: ``token_embd``, ``output_norm``, ``output``).
GLOBAL_NAMES: dict[str, tuple[str, str]] = {
    "embed": ("embed_tokens.weight", "token_embd.weight"),
    "norm": ("norm.weight", "output_norm.weight"),
    "lm_head": ("lm_head.weight", "output.weight"),
}

#: Routed-expert parts (gate, up, down) in GGUF: one tensor per layer stacking every expert
#: ``[E, out, in]`` (``MODEL_TENSOR.FFN_{GATE,UP,DOWN}_EXP``), or gate and up fused
#: (``ffn_gate_up_exps``, ``[E, 2I, H]``).
GGUF_EXPERT_NAMES: dict[str, str] = {
    "gate": "ffn_gate_exps.weight", "up": "ffn_up_exps.weight", "down": "ffn_down_exps.weight",
    "gate_up": "ffn_gate_up_exps.weight",
}


#: Per-layer Hugging Face tensors outside :data:`LAYER_NAMES` (the families' own attention and
#: MoE modules) -> their GGUF names, as llama.cpp's ``convert_hf_to_gguf.py`` writes them
#: (``gguf-py/gguf/tensor_mapping.py``): MLA (DeepSeek-V2/V3, Kimi-K2), Gated DeltaNet (Qwen3.5,
#: Qwen3-Next), gpt-oss's sinks and router bias, Llama 4's ``feed_forward``, the DeepSeek /
#: GLM-4.5 ``shared_experts`` and routing bias. Keys are the name under ``layers.N.``.
GGUF_LAYER_EXTRA: dict[str, str] = {
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.kv_b_proj.weight": "attn_kv_b.weight",
    "self_attn.sinks": "attn_sinks.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.in_proj_qkvz.weight": "ssm_in.weight",
    "linear_attn.in_proj_ba.weight": "ssm_ba.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "mlp.router.weight": "ffn_gate_inp.weight",
    "mlp.router.bias": "ffn_gate_inp.bias",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
    "feed_forward.router.weight": "ffn_gate_inp.weight",
    "feed_forward.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "feed_forward.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "feed_forward.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "feed_forward.gate_proj.weight": "ffn_gate.weight",
    "feed_forward.up_proj.weight": "ffn_up.weight",
    "feed_forward.down_proj.weight": "ffn_down.weight",
}

#: One routed expert's Hugging Face tensor (the name after ``experts.[j.]``) -> the GGUF
#: tensors stacking every expert (:data:`GGUF_EXPERT_NAMES`; a fused ``gate_up`` is written as
#: gate and up, each half of the rows, as ``convert_hf_to_gguf.py`` does for gpt-oss and Llama 4).
GGUF_EXPERT_PARTS: dict[str, tuple[str, ...]] = {
    "gate_proj.weight": ("ffn_gate_exps.weight",), "w1.weight": ("ffn_gate_exps.weight",),
    "up_proj.weight": ("ffn_up_exps.weight",), "w3.weight": ("ffn_up_exps.weight",),
    "down_proj.weight": ("ffn_down_exps.weight",), "w2.weight": ("ffn_down_exps.weight",),
    "down_proj": ("ffn_down_exps.weight",), "down_proj_bias": ("ffn_down_exps.bias",),
    "gate_up_proj": ("ffn_gate_exps.weight", "ffn_up_exps.weight"),
    "gate_up_proj_bias": ("ffn_gate_exps.bias", "ffn_up_exps.bias"),
}


@record
class NameTable:
    """One family's tensor names (see :data:`LAYER_NAMES`), resolved for its MoE block name.

    ``aliases``: other Hugging Face names (under the layer prefix) of a slot, that a
    checkpoint may use instead (transformers 5.x saves every MoE block as ``mlp``).
    ``moe_blocks``: the MoE block names a checkpoint may use, the family's first.
    ``expert_parts``: the (gate, up, down) module names of one routed expert under
    ``{moe}.experts.{j}.``; ``fused_experts``: for a family whose checkpoints hold its
    experts only fused over the layer (gpt-oss), those tensors' names under
    ``{moe}.experts.``. ``shared_gate``: the shared expert is scaled by a 1-row sigmoid
    gate (``shared_expert_gate``: Qwen2-MoE, Qwen3-Next); DeepSeek's and GLM-4.5's
    ``shared_experts`` are added ungated. The one home of a family's names: its parser lists
    them (:meth:`hf`, :meth:`router_module`, :meth:`hf_experts`), the loaders read that
    listing by slot (``moefit.runtime.load.listing``), the GGUF one through :meth:`gguf`.
    """

    layer: dict[str, tuple[str, str]]
    globals: dict[str, tuple[str, str]]
    experts: dict[str, str]
    aliases: dict[str, str] = field(default_factory=dict)
    moe_blocks: tuple[str, ...] = ("mlp",)
    expert_parts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    shared_gate: bool = True
    fused_experts: tuple[str, ...] = ()

    @property
    def moe_prefix(self) -> str:
        """The family's MoE block name (``mlp``, Mixtral's ``block_sparse_moe``)."""
        return self.moe_blocks[0]

    def router_module(self, layer_prefix: str) -> str:
        """The router's module under ``layer_prefix`` (``model.layers.3.mlp.gate``)."""
        return self.hf("router", layer_prefix).removesuffix(".weight")

    def hf_experts(self, layer_prefix: str) -> str:
        """The prefix of the routed experts under ``layer_prefix``
        (``model.layers.3.mlp.experts.``; expert ``j`` is ``{this}{j}.{part}.weight``)."""
        return f"{layer_prefix}{self.moe_prefix}.experts."

    def hf_aliases(self, slot: str, layer_prefix: str) -> list[str]:
        """The other checkpoint names ``slot`` may have under ``layer_prefix`` (:attr:`aliases`)."""
        return [f"{layer_prefix}{a}" for a, s in self.aliases.items() if s == slot]

    def hf(self, slot: str, layer_prefix: str) -> str:
        """Checkpoint name of ``slot`` under ``layer_prefix`` (``model.layers.3.``)."""
        return f"{layer_prefix}{self.layer[slot][0]}"

    def gguf(self, slot: str, layer: int) -> str:
        """GGUF name of ``slot`` in layer ``layer`` (``blk.3.attn_q.weight``)."""
        return f"blk.{layer}.{self.layer[slot][1]}"

    def gguf_expert(self, part: str, layer: int) -> str:
        """GGUF name of expert part ``part`` (gate, up, down, gate_up) of layer ``layer``."""
        return f"blk.{layer}.{self.experts[part]}"

    def gguf_from_hf(self, hf_name: str, text_prefix: str = "model.") -> str:
        """GGUF name of a non-expert Hugging Face tensor name. Raises KeyError for a name
        the table does not hold."""
        for hf, g in self.globals.values():
            if hf_name == (hf if hf == "lm_head.weight" else f"{text_prefix}{hf}"):
                return g
        head = f"{text_prefix}layers."
        if hf_name.startswith(head):
            idx, _, rest = hf_name[len(head):].partition(".")
            slot = self.aliases.get(rest) or next((k for k, (hf, _) in self.layer.items() if hf == rest), None)
            if idx.isdigit() and slot is not None:
                return f"blk.{idx}.{self.layer[slot][1]}"
        raise KeyError(hf_name)


def name_table(moe_prefix: str = "mlp", layer: dict[str, tuple[str, str]] | None = None,
               expert_parts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
               shared_gate: bool = True) -> NameTable:
    """The :class:`NameTable` of a family whose MoE block is ``{prefix}layers.N.{moe_prefix}``
    with experts' (gate, up, down) modules ``expert_parts``, and ``layer`` overriding or
    adding per-layer entries. A block not named ``mlp`` (Mixtral's
    ``block_sparse_moe``) keeps ``mlp.gate`` as an alias of its router: transformers 5.x
    names the block ``mlp`` (``MixtralDecoderLayer.mlp``) and saves it so."""
    table = {slot: (hf.replace("{moe}", moe_prefix), g) for slot, (hf, g) in {**LAYER_NAMES, **(layer or {})}.items()}
    aliases = {} if moe_prefix == "mlp" else {LAYER_NAMES["router"][0].replace("{moe}", "mlp"): "router"}
    return NameTable(table, dict(GLOBAL_NAMES), dict(GGUF_EXPERT_NAMES), aliases,
                     tuple(dict.fromkeys((moe_prefix, "mlp"))), tuple(expert_parts), shared_gate=shared_gate)


#: The name table of :data:`LAYER_NAMES` as they stand (MoE block ``mlp``): the builders'
#: default (:func:`~moefit.ingest.families.tensors.gqa`,
#: :func:`~moefit.ingest.families.tensors.layer_norms`).
STANDARD_NAMES = name_table()
