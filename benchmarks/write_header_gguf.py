"""Write a header-only GGUF of a model in a llama-quantize type mix (metadata and tensor infos, no data).

The tensors are the ones ``moefit plan MODEL --engine llama.cpp --gguf-type FTYPE`` derives from
the config (``moefit.ingest.gguf_mix``: ``convert_hf_to_gguf.py``'s names and shapes,
``llama-quantize``'s type rules, checked against the real tool); the data region is a hole of
the right size (``truncate``), so a 20 GiB model takes a few MB of disk. moefit plans the file
as any GGUF (``moefit plan F.gguf --engine llama.cpp``); llama.cpp itself cannot run it (no
tokenizer, no weights). It reproduces the llama.cpp example of README.md and docs/engines.md without the real
download (``Qwen3.5-35B-A3B-Q4_K_M.gguf`` from Hugging Face plans the same way):

    .venv/bin/python benchmarks/write_header_gguf.py Qwen3.5-35B-A3B Q4_K_M Qwen3.5-35B-A3B-Q4_K_M.gguf

Architectures written: ``qwen35moe``, ``qwen3moe`` and ``glm4moe`` (the metadata keys moefit's
GGUF reader and llama.cpp's ``llama_model::load_hparams`` read for them; GLM's MTP layer is
not written, as llama.cpp does not run it). GLM-4.5-Air has no preset: give its config.json.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def metadata(geom) -> list[tuple[str, str, str]]:
    """``(key, GGUFValueType name, value)`` of ``geom``'s GGUF metadata (``qwen35moe`` or
    ``qwen3moe``, as ``convert_hf_to_gguf.py`` writes them). Raises ValueError for another
    architecture."""
    from moefit.ingest.families import registry

    family = registry.family_for(geom.model_type)
    arch = family.gguf_arch_of.get(geom.model_type) if family else None
    if arch not in ("qwen35moe", "qwen3moe", "glm4moe"):
        raise ValueError(f"{geom.name}: header-only GGUFs are written for qwen35moe, qwen3moe and "
                         f"glm4moe, not {arch}")
    full = next(l.attention for l in geom.layers if l.attention.kind != "linear")
    moe = geom.moe_layers[0].moe
    meta = [("general.architecture", "STRING", arch), ("general.name", "STRING", geom.name),
            ("general.file_type", "UINT32", "15")]
    keys = {"block_count": geom.num_layers, "context_length": geom.rope.trained_window,
            "embedding_length": geom.hidden_size, "attention.head_count": full.num_heads,
            "attention.head_count_kv": full.num_kv_heads, "attention.key_length": full.head_dim,
            "attention.value_length": full.v_head_dim or full.head_dim, "expert_count": moe.num_experts,
            "expert_used_count": moe.experts_per_token, "expert_feed_forward_length": moe.expert_intermediate}
    if arch == "qwen35moe":
        lin = next(l.attention for l in geom.layers if l.attention.kind == "linear")
        keys.update({"expert_shared_feed_forward_length": moe.shared_intermediate,
                     "ssm.conv_kernel": lin.linear_conv_kernel, "ssm.state_size": lin.linear_key_head_dim,
                     "ssm.group_count": lin.linear_num_key_heads, "ssm.time_step_rank": lin.linear_num_value_heads,
                     "ssm.inner_size": lin.linear_num_value_heads * lin.linear_value_head_dim,
                     "full_attention_interval": next(i for i, l in enumerate(geom.layers, 1)
                                                     if l.attention.kind != "linear"),
                     "rope.dimension_count": full.rotary_dim})
    if arch == "glm4moe":         # Glm4MoeModel.set_gguf_parameters (no MTP layer written)
        r = moe.routing
        keys.update({"feed_forward_length": next(l.dense_intermediate for l in geom.layers if l.moe is None),
                     "expert_shared_count": moe.num_shared_experts,
                     "leading_dense_block_count": next(l.index for l in geom.layers if l.moe is not None),
                     "rope.dimension_count": full.rotary_dim, "expert_gating_func": 2,
                     "expert_group_count": r.n_group or 1, "expert_group_used_count": r.topk_group or 1})
        meta += [(f"{arch}.expert_weights_scale", "FLOAT32", str(r.scale)),
                 (f"{arch}.expert_weights_norm", "BOOL", "True")]   # norm_topk_prob (GLM-4.5: true)
    meta += [(f"{arch}.{k}", "UINT32", str(v)) for k, v in keys.items()]
    meta += [(f"{arch}.rope.freq_base", "FLOAT32", str(geom.rope.theta)),
             (f"{arch}.attention.layer_norm_rms_epsilon", "FLOAT32", "1e-06")]
    return meta


def write_sparse(path: Path, meta, tensors) -> Path:
    """A GGUF with ``meta`` (``(key, type, value)``) and the infos of ``tensors`` (``(name,
    ggml type, ne)``, innermost first) whose data region is a hole (``truncate``)."""
    import gguf
    import numpy as np

    arch = next(v for k, _, v in meta if k == "general.architecture")
    w = gguf.GGUFWriter(str(path), arch)
    for key, kind, value in meta:
        if key == "general.architecture":
            continue
        t = gguf.GGUFValueType[kind]
        v = value if t == gguf.GGUFValueType.STRING else (
            float(value) if t in (gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.FLOAT64) else
            (value == "True" if t == gguf.GGUFValueType.BOOL else int(value)))
        w.add_key_value(key, v, t)
    total = 0
    for name, kind, ne in tensors:
        qt = gguf.GGMLQuantizationType[kind]
        bs, ts = gguf.GGML_QUANT_SIZES[qt]
        nbytes = int(np.prod(ne)) // bs * ts
        w.add_tensor_info(name, tuple(reversed(ne)), np.dtype(np.float32), nbytes, raw_dtype=qt)
        total += -(-nbytes // 32) * 32
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    os.truncate(path, -(-path.stat().st_size // 32) * 32 + total)
    return path


def write_header_gguf(model: str, ftype: str, out: Path) -> Path:
    """Write ``model``'s (a preset or a config) header-only GGUF in ``ftype`` to ``out``."""
    from moefit.ingest.gguf_mix import ftype_name, llamacpp_tensors
    from moefit.ingest.resolve import load_model

    geom = load_model(model)
    tensors, _ = llamacpp_tensors(geom, ftype_name(ftype))
    return write_sparse(out, metadata(geom), [(t.name, t.kind, t.ne) for t in tensors])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a preset name or a config.json (qwen35moe, qwen3moe or glm4moe)")
    ap.add_argument("ftype", help="llama-quantize's file type, e.g. Q4_K_M")
    ap.add_argument("out", type=Path, help="the .gguf file to write")
    args = ap.parse_args(argv)
    path = write_header_gguf(args.model, args.ftype, args.out)
    print(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB apparent, headers only)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
