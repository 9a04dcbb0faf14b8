"""A small random checkpoint that ``moefit serve`` can run offline (``moefit make-demo``).

:func:`write_demo` writes, for one family the runtime runs, a Hugging Face checkpoint
directory made here without any download:

- ``config.json``: the family's real keys (as its transformers config class writes them)
  at toy sizes: 4 layers, hidden size 256, 16 routed experts (8 for Mixtral), bf16; the
  vocabulary is the tokenizer's, ``bos_token_id`` / ``eos_token_id`` as Qwen's configs set
  them (``<|endoftext|>`` / ``<|im_end|>``);
- ``model.safetensors``: random weights (seeded), one tensor per expert as the published
  checkpoints store them (gpt-oss: fused over the layer, as ``save_pretrained`` writes it). The tensor names and shapes are the planner's own listing of the
  family (:func:`moefit.ingest.families.geometry_from_config`, the same listing the
  loader checks a checkpoint against), so a demo can never disagree with what
  ``moefit plan`` prices and ``moefit serve`` loads;
- ``tokenizer.json``: a byte-level BPE (GPT-2 / Qwen style, ``tokenizers`` library)
  trained at write time on :data:`TEXT`, with Qwen's ChatML special tokens; every string
  encodes (byte fallback through the 256-symbol byte alphabet);
- ``tokenizer_config.json``: the ChatML chat template (with Qwen3's tool calls) and the special tokens;
- ``generation_config.json``: ``eos_token_id`` (``<|im_end|>``, ``<|endoftext|>``), greedy.

The weights are random: the model answers with fluent-looking nonsense. The demo is for
trying the commands (``plan``, ``serve``, ``generate``, ``bench``) end to end on any
machine, not for reading the answers.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from moefit.errors import InputError
from moefit.ingest.families import geometry_from_config
from moefit.ingest.families.registry import family_for
from moefit.outputs import default_file_mode

#: Families ``make-demo`` writes (the runtime runs all of them): name -> config.json.
#: Sizes are toy sizes; keys and structure are those of the real checkpoints
#: (``Qwen/Qwen3-30B-A3B``, ``Qwen/Qwen1.5-MoE-A2.7B``, ``mistralai/Mixtral-8x7B-v0.1``,
#: ``allenai/OLMoE-1B-7B-0924``, ``Qwen/Qwen3-Next-80B-A3B-Instruct``, ``Qwen/Qwen3.5-35B-A3B``,
#: ``openai/gpt-oss-20b``, DeepSeek and GLM below). Kimi-K2 is DeepSeek-V3's architecture under
#: its own model type, which transformers does not register: its demo is ``deepseek_v3``.
_BASE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
             max_position_embeddings=8192, rms_norm_eps=1e-6, hidden_act="silu",
             tie_word_embeddings=False, initializer_range=0.02, attention_dropout=0.0,
             use_cache=True)
_HYBRID_TEXT = dict(_BASE, head_dim=64, full_attention_interval=4, linear_conv_kernel_dim=4,
                    linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=4,
                    linear_num_value_heads=8, num_experts=16, num_experts_per_tok=4,
                    moe_intermediate_size=128, shared_expert_intermediate_size=128,
                    partial_rotary_factor=0.25, rope_theta=10000000.0, attention_bias=False)
#: DeepSeek-V2-Lite / DeepSeek-V3's MLA and MoE keys (``deepseek-ai/DeepSeek-V2-Lite``,
#: ``deepseek-ai/DeepSeek-V3``); GLM-4.5-Air's (``zai-org/GLM-4.5-Air``).
_MLA = dict(_BASE, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
            n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=128,
            intermediate_size=512, first_k_dense_replace=1, moe_layer_freq=1, rope_theta=10000.0,
            attention_bias=False)
FAMILIES: dict[str, dict] = {
    "qwen3_moe": dict(_BASE, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                      head_dim=32, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128,
                      intermediate_size=512, decoder_sparse_step=1, mlp_only_layers=[],
                      norm_topk_prob=True, rope_theta=1000000.0, attention_bias=False),
    "qwen2_moe": dict(_BASE, architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe",
                      num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128,
                      shared_expert_intermediate_size=256, intermediate_size=512,
                      decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=False,
                      qkv_bias=True, rope_theta=1000000.0),
    "mixtral": dict(_BASE, architectures=["MixtralForCausalLM"], model_type="mixtral",
                    num_local_experts=8, num_experts_per_tok=2, intermediate_size=256,
                    rope_theta=1000000.0, sliding_window=None, router_aux_loss_coef=0.02),
    "olmoe": dict(_BASE, architectures=["OlmoeForCausalLM"], model_type="olmoe",
                  num_experts=16, num_experts_per_tok=4, intermediate_size=128,
                  norm_topk_prob=False, clip_qkv=None, rope_theta=10000.0, attention_bias=False),
    "qwen3_next": dict(_HYBRID_TEXT, architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next",
                       intermediate_size=512, decoder_sparse_step=1, mlp_only_layers=[],
                       norm_topk_prob=True),
    "qwen3_5_moe": dict(architectures=["Qwen3_5MoeForConditionalGeneration"], model_type="qwen3_5_moe",
                        tie_word_embeddings=False,
                        text_config=dict(_HYBRID_TEXT, model_type="qwen3_5_moe_text",
                                         layer_types=["linear_attention"] * 3 + ["full_attention"])),
    # openai/gpt-oss-20b's keys: alternating sliding (128) / full layers, sinks, biases,
    # YaRN x32 over 4096 (not truncated); bf16 experts here, not mxfp4
    "gpt_oss": dict(_BASE, architectures=["GptOssForCausalLM"], model_type="gpt_oss", head_dim=32,
                    num_local_experts=16, num_experts_per_tok=4, experts_per_token=4,
                    intermediate_size=128, sliding_window=128, attention_bias=True,
                    layer_types=["sliding_attention", "full_attention"] * 2, rms_norm_eps=1e-5,
                    max_position_embeddings=131072, initial_context_length=4096,
                    rope_theta=150000.0, swiglu_limit=7.0, router_aux_loss_coef=0.9,
                    output_router_logits=False,
                    rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                                      truncate=False, original_max_position_embeddings=4096)),
    "deepseek_v2": dict(_MLA, architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2",
                        num_key_value_heads=8, q_lora_rank=None, n_shared_experts=2,
                        routed_scaling_factor=1.0, topk_method="greedy", n_group=1, topk_group=1,
                        scoring_func="softmax", norm_topk_prob=False),
    "deepseek_v3": dict(_MLA, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
                        num_key_value_heads=8, q_lora_rank=96, n_shared_experts=1,
                        routed_scaling_factor=2.5, topk_method="noaux_tc", n_group=4, topk_group=2,
                        scoring_func="sigmoid", norm_topk_prob=True, rope_interleave=True),
    "glm4_moe": dict(_BASE, architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe",
                     head_dim=32, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4,
                     moe_intermediate_size=128, intermediate_size=512, first_k_dense_replace=1,
                     n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True,
                     partial_rotary_factor=0.5, use_qk_norm=False, attention_bias=True,
                     rope_theta=1000000.0),
}

#: The text the tokenizer is trained on (any text encodes; these words become single tokens).
TEXT = """\
Mixture-of-Experts language models route every token to a few experts out of many. The
expert cache keeps the most used experts on the GPU, and the others run on the CPU or are
copied in when a token needs them. The KV cache grows with the context, one cell per token
and sequence; sliding layers keep a window, and linear-attention layers keep a fixed state.
A prefill chunk is a slice of the prompt processed at once: larger chunks are faster but
need more staging memory. Hello! How are you today? I am a small demo model with random
weights, so my answers are nonsense, but the tokenizer, the chat template, the budget and
the server are real. The quick brown fox jumps over the lazy dog. 0 1 2 3 4 5 6 7 8 9 10.
What is the capital of France? Paris is the capital of France. Name three colours: red,
green and blue. Write a short poem about the sea, the sky and the wind.
"""

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
#: ChatML with function calling, as Qwen3's chat template writes it (Qwen/Qwen3-30B-A3B
#: tokenizer_config.json, its thinking parts left out): with ``tools``, a system message
#: listing them in a hermes ``<tools>`` block (after the request's own system text); an
#: assistant's ``tool_calls`` as ``<tool_call>`` blocks after its content (which may be null);
#: consecutive ``tool`` messages as ``<tool_response>`` blocks in one user turn.
CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- set content = message.content if message.content is string else '' %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + content }}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- if (loop.first and content) or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{%- set call = tool_call.function if tool_call.function else tool_call %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' }}"
    "{{- call.arguments if call.arguments is string else call.arguments | tojson }}"
    "{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
TOKENIZER_VOCAB = 1024


def build_tokenizer(vocab_size: int = TOKENIZER_VOCAB):
    """A byte-level BPE (``tokenizers``: ``ByteLevel`` pre-tokenizer, decoder and
    post-processor, as GPT-2 and Qwen use) trained on :data:`TEXT` with
    :data:`SPECIAL_TOKENS` first (ids 0, 1, 2), then the 256 byte symbols, then merges up to
    ``vocab_size`` entries (fewer when the text has no more pairs to merge).

    Returns a ``tokenizers.Tokenizer``. Raises ImportError without ``tokenizers``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(TEXT.splitlines() * 4, trainer)
    return tok


#: model types moefit runs whose architecture is another demo family's: (that family, the
#: architecture their config.json names)
SAME_LAYERS = {"kimi_k2": ("deepseek_v3", "DeepseekV3ForCausalLM")}


def unknown_family(family: str) -> InputError:
    """The error for a ``--family`` make-demo does not write, naming the fix: the demo with
    the same layers for a model type that has one (Kimi-K2 is DeepSeek-V3's architecture,
    ``DeepseekV3ForCausalLM``; its config only names its own ``model_type``), else the
    families it writes."""
    known = ", ".join(FAMILIES)
    if family in SAME_LAYERS:
        other, arch = SAME_LAYERS[family]
        return InputError(f"--family {family!r}: {family} is {other}'s architecture (its config.json "
                          f"names {arch}); write that demo: --family {other}")
    if family_for(family) is not None:
        return InputError(f"--family {family!r}: moefit plans {family}, but make-demo writes no demo "
                          f"of it; use one of {known}")
    return InputError(f"--family {family!r}: not a family make-demo writes; use one of {known}")


def _text_config(cfg: dict) -> dict:
    return cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg


def demo_config(family: str, vocab_size: int) -> dict:
    """The ``config.json`` dict of a ``family`` demo with ``vocab_size`` tokens, in bf16.

    Raises InputError for a family not in :data:`FAMILIES`.
    """
    if family not in FAMILIES:
        raise unknown_family(family)
    cfg = json.loads(json.dumps(FAMILIES[family]))   # a deep copy
    _text_config(cfg)["vocab_size"] = vocab_size
    cfg["dtype"] = "bfloat16"
    if "text_config" in cfg:
        cfg["text_config"]["dtype"] = "bfloat16"
    return cfg


def _init(name: str, shape: tuple[int, ...], gen, *, one_plus_norms: bool):
    """A random tensor for checkpoint tensor ``name`` of ``shape`` (float32).

    Linear weights: normal with std ``1/sqrt(in_features)`` (activations keep their scale
    through the layers); RMSNorm weights: 1 (0 where the family stores ``w`` of a
    ``(1 + w)`` norm: Qwen3-Next / Qwen3.5, except the plain gated norm of Gated DeltaNet),
    plus noise; ``A_log``: ``log(U(1, 16))`` and ``dt_bias``: 1, as the reference initialises
    them (``Qwen3NextGatedDeltaNet``).
    """
    import torch

    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(1, 16, generator=gen).log()
    if name.endswith("dt_bias"):
        return torch.ones(shape)
    if name.endswith("norm.weight"):
        base = 1.0 if (not one_plus_norms or name.endswith("linear_attn.norm.weight")) else 0.0
        return base + 0.05 * torch.randn(shape, generator=gen)
    if name.endswith((".bias", "_bias")):
        return 0.02 * torch.randn(shape, generator=gen)
    fan_in = math.prod(shape[1:]) if len(shape) > 1 else shape[0]
    return torch.randn(shape, generator=gen) / math.sqrt(fan_in)


def write_demo(out: str | Path, family: str = "qwen3_moe", *, seed: int = 0,
               overwrite: bool = False) -> Path:
    """Write a demo checkpoint of ``family`` (see the module docstring) into ``out``.

    Size: about 13 MiB of bf16 weights (``qwen3_moe``: 7.1M parameters).

    Args:
        out: the directory to create (its parents too).
        family: one of :data:`FAMILIES`.
        seed: seed of the random weights (the same seed writes the same bytes).
        overwrite: allow a non-empty ``out`` (files of the same name are replaced).

    Returns the directory written.

    Raises InputError for an unknown family, a non-empty ``out`` without ``overwrite``, or
    a directory that cannot be written (naming it); ImportError when the runtime extra
    (torch, safetensors, tokenizers) is missing.
    """
    import torch
    from safetensors.torch import save_file

    out = Path(out).expanduser()
    if family not in FAMILIES:
        raise unknown_family(family)
    if out.exists() and not out.is_dir():
        raise InputError(f"{out}: exists and is not a directory; give a new directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise InputError(f"{out}: directory is not empty; give a new directory (or --force "
                         "to write the demo files into it)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"{out}: cannot create the directory ({e.strerror or e})") from None

    tok = build_tokenizer()
    vocab = tok.get_vocab_size()
    im_end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    cfg = demo_config(family, vocab)
    # as Qwen's configs: bos <|endoftext|>, eos <|im_end|> (llama.cpp's converter reads them)
    _text_config(cfg).update(bos_token_id=eot, eos_token_id=im_end)
    geom = geometry_from_config(cfg, out.name, str(out / "config.json"))
    gen = torch.Generator().manual_seed(seed)
    hybrid = family in ("qwen3_next", "qwen3_5_moe")
    fused = bool(family_for(cfg["model_type"]).names.fused_experts)
    state: dict[str, torch.Tensor] = {}

    def add(name: str, shape: tuple[int, ...]) -> None:
        state[name] = _init(name, shape, gen, one_plus_norms=hybrid).to(torch.bfloat16).contiguous()

    for t in geom.global_tensors:
        add(t.name, t.shape)
    for layer in geom.layers:
        for t in layer.tensors:
            add(t.name, t.shape)
        if layer.moe is not None and layer.moe.routing.bias:
            # the router's e_score_correction_bias: a buffer the listing leaves out, fp32 as
            # the published checkpoints store it
            router = next(t.name for t in layer.tensors if t.role == "router")
            state[router.replace(".weight", ".e_score_correction_bias")] = (
                0.01 * torch.rand(layer.moe.num_experts, generator=gen))
        if layer.moe is not None and fused:
            # fused over the layer (gpt-oss): each expert drawn as its [out, in] matrix,
            # stored as the checkpoint holds it ([E, in, out]: ``checkpoint_experts``)
            for t in layer.expert_tensors:
                one = [_init(t.name, t.shape, gen, one_plus_norms=False) for _ in range(layer.moe.num_experts)]
                state[t.name] = torch.stack(one).transpose(1, 2) if len(t.shape) == 2 else torch.stack(one)
                state[t.name] = state[t.name].to(torch.bfloat16).contiguous()
        elif layer.moe is not None:
            for j in range(layer.moe.num_experts):
                for t in layer.expert_tensors:
                    # the listing names expert 0 (``...experts.0.gate_proj.weight``)
                    add(t.name.replace(".experts.0.", f".experts.{j}.", 1), t.shape)

    files = {
        "config.json": json.dumps(cfg, indent=2) + "\n",
        "generation_config.json": json.dumps({"eos_token_id": [im_end, eot], "do_sample": False},
                                             indent=2) + "\n",
        "tokenizer_config.json": json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
            "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
            "unk_token": None, "model_max_length": _text_config(cfg)["max_position_embeddings"],
            "clean_up_tokenization_spaces": False}, indent=2) + "\n",
    }
    try:
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        os.chmod(out / "model.safetensors", default_file_mode())   # save_file leaves 0600
        tok.save(str(out / "tokenizer.json"))
        for name, text in files.items():
            (out / name).write_text(text, encoding="utf-8")
    except OSError as e:
        raise InputError(f"{out}: cannot write the demo checkpoint ({e.strerror or e})") from None
    return out
