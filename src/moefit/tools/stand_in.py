"""Header-only GGUF stand-ins: ``moefit gguf-header MODEL --type FTYPE OUT``.

A stand-in is the GGUF file ``convert_hf_to_gguf.py`` + ``llama-quantize FTYPE`` would write
for a Hugging Face model, without its weights: the metadata (:func:`moefit.tools.gguf_write.
add_model_metadata`, the keys llama.cpp's ``llama_model::load_hparams`` reads for the
family's architecture), a tokenizer, and the tensor infos of the quantizer's per-tensor mix
(:func:`moefit.ingest.gguf_mix.llamacpp_tensors`); the data region is a hole of the
right size (``truncate``: a 20 GiB model takes a few MB of disk, and reads as zeros). moefit
plans it as any GGUF file (``moefit plan OUT --engine llama.cpp``), and llama.cpp loads it
far enough to print its buffers (model, KV cache, compute), so a printed command can be
tried on a machine that has no model (its output is the zeros' output).

The tokenizer: by default a stand-in byte-level BPE vocabulary (``tokenizer.ggml.model``
``gpt2``: the 256 byte tokens of GPT-2's byte-to-unicode table, one merge, an end-of-text
control token, ``[PAD{id}]`` unused tokens up to the config's ``vocab_size``, as
``convert_hf_to_gguf.py`` pads the ids a tokenizer lacks); with ``vocab``, the ``tokenizer.*``
keys of a vocabulary-only GGUF (llama.cpp's ``models/ggml-vocab-*.gguf``), cut or padded to
``vocab_size`` (``llama_model::load_tensors`` checks ``token_embd`` against the vocabulary's
size) and without the special ids past it.
"""

from __future__ import annotations

import os
from pathlib import Path

from moefit.ingest.gguf_mix import default_ftype, ftype_name, llamacpp_tensors
from moefit.errors import InputError
from moefit.ingest.families import registry
from moefit.ingest.resolve import config_of, load_model
from moefit.tools.gguf_write import add_model_metadata

#: ``llama_token_type`` (``llama.h``): the token types a stand-in vocabulary uses
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_UNUSED, TOKEN_BYTE = 1, 3, 5, 6
#: GGUF's default alignment of the tensor data (``general.alignment`` absent: 32 bytes)
ALIGNMENT = 32


def byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode table: the 256 token strings of a byte-level BPE vocabulary,
    byte order (``bytes_to_unicode`` of OpenAI's ``encoder.py``; llama.cpp's
    ``unicode_byte_to_utf8``)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def add_stand_in_vocab(w, n_vocab: int) -> None:
    """A stand-in byte-level BPE vocabulary of ``n_vocab`` tokens on the writer ``w``
    (module docstring): bytes, ``<|endoftext|>`` (end of text and padding), unused pads."""
    if n_vocab < 257:
        raise InputError(f"vocab_size {n_vocab}: a byte-level vocabulary needs at least 257 tokens")
    tokens = byte_tokens() + ["<|endoftext|>"] + [f"[PAD{i}]" for i in range(257, n_vocab)]
    types = [TOKEN_NORMAL] * 256 + [TOKEN_CONTROL] + [TOKEN_UNUSED] * (n_vocab - 257)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["Ġ t"])        # llama.cpp's BPE loader needs the key; one merge of two bytes
    w.add_eos_token_id(256)
    w.add_pad_token_id(256)


def copy_vocab(w, path: str | Path, n_vocab: int) -> None:
    """The ``tokenizer.*`` keys of the GGUF at ``path`` on the writer ``w``: the per-token
    arrays cut or padded (``[PAD{id}]``, unused) to ``n_vocab``, special ids past it left out.
    Raises InputError when the file has no ``tokenizer.ggml.tokens``."""
    import gguf

    try:
        r = gguf.GGUFReader(str(path))
    except (OSError, ValueError) as e:
        raise InputError(f"--vocab {path}: not a readable GGUF file ({e})") from None
    if "tokenizer.ggml.tokens" not in r.fields:
        raise InputError(f"--vocab {path}: no tokenizer.ggml.tokens; give a vocabulary GGUF such as "
                         "llama.cpp's models/ggml-vocab-qwen2.gguf")
    T = gguf.GGUFValueType
    per_token = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")
    for key, f in r.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = f.types[0]
        if kind == T.ARRAY:
            sub = f.types[1]
            vals = [bytes(f.parts[i]).decode("utf-8") if sub == T.STRING else f.parts[i].tolist()[0]
                    for i in f.data]
            if key in per_token:
                pad = {"tokenizer.ggml.tokens": lambda i: f"[PAD{i}]",
                       "tokenizer.ggml.token_type": lambda i: TOKEN_UNUSED,
                       "tokenizer.ggml.scores": lambda i: -1000.0}[key]
                vals = vals[:n_vocab] + [pad(i) for i in range(len(vals), n_vocab)]
            w.add_key_value(key, vals, T.ARRAY, sub_type=sub)
        elif kind == T.STRING:
            w.add_key_value(key, bytes(f.parts[f.data[0]]).decode("utf-8"), kind)
        else:
            value = f.parts[f.data[0]].tolist()[0]
            if key.endswith("_token_id") and value >= n_vocab:
                continue
            w.add_key_value(key, value, kind)


def write_stand_in(model: str, ftype: str | None, out: str | Path, vocab: str | Path | None = None) -> Path:
    """Write the stand-in of ``model`` (a preset, a model directory or its config.json) in the
    ``llama-quantize`` mix ``ftype`` (None: the family's released mix,
    :func:`moefit.ingest.gguf_mix.default_ftype`) to ``out``; ``vocab``: a vocabulary
    GGUF to copy the tokenizer from (module docstring). Returns ``out``.

    Raises InputError for a GGUF ``model``, a family without a GGUF architecture, an unknown
    ``ftype``, an existing ``out`` that is not a file or a bad ``vocab``."""
    import gguf

    config = config_of(model)
    geom = load_model(model)
    kind = ftype_name(ftype, "--type") if ftype is not None else default_ftype(geom)
    family = registry.family_for(geom.model_type)
    arch = family.gguf_arch_of.get(geom.model_type) if family else None
    if arch is None:
        raise InputError(f"{model}: model_type {geom.model_type!r} has no GGUF architecture llama.cpp "
                         "loads; no stand-in is written for it")
    tensors, _ = llamacpp_tensors(geom, kind)
    out = Path(out)
    if out.exists() and not out.is_file():
        raise InputError(f"{out}: exists and is not a file; give the path of the .gguf to write")
    import numpy as np

    tmp = out.with_name(out.name + ".part")     # whole or not at all
    try:
        w = gguf.GGUFWriter(str(tmp), arch)
        text = add_model_metadata(w, config, geom.name, _file_type(kind))
        if vocab is None:
            add_stand_in_vocab(w, text["vocab_size"])
        else:
            copy_vocab(w, vocab, text["vocab_size"])
        total = 0
        for t in tensors:
            qt = gguf.GGMLQuantizationType[t.kind]
            w.add_tensor_info(t.name, tuple(reversed(t.ne)), np.dtype(np.float32), t.nbytes, raw_dtype=qt)
            total += -(-t.nbytes // ALIGNMENT) * ALIGNMENT
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        w.close()
        os.truncate(tmp, -(-tmp.stat().st_size // ALIGNMENT) * ALIGNMENT + total)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    return out


#: ``llama_ftype`` (``llama.h``) of the ``llama-quantize`` mixes (``general.file_type``)
FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10,
              "Q3_K_S": 11, "Q3_K_M": 12, "Q3_K_L": 13, "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_S": 16,
              "Q5_K_M": 17, "Q6_K": 18, "IQ4_NL": 25, "IQ4_XS": 30, "BF16": 32, "MXFP4_MOE": 38}


def _file_type(ftype: str) -> int:
    return FILE_TYPES[ftype]
