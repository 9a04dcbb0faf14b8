"""Tokenizer, chat template and EOS ids of a GGUF file, from its metadata.

A GGUF has no ``tokenizer.json``: llama.cpp keeps the vocabulary (``tokenizer.ggml.tokens``),
the merges, the token types, the special token ids and the chat template
(``tokenizer.chat_template``) as metadata. transformers' GGUF tokenizer converter
(``transformers.integrations.gguf.gguf_tokenizer_mapping``: ``get_gguf_tokenizer`` reads
only those keys in full, ``convert_gguf_tokenizer`` builds the ``tokenizers`` object with
the normalizer / pre-tokenizer of ``tokenizer.ggml.pre``) does the conversion; this module
wraps the result in :class:`moefit.serve.text.Tokenizer`. ``--tokenizer DIR`` (a directory
with ``tokenizer.json``) replaces it when the converter does not know the file's tokenizer.
"""

from __future__ import annotations

from pathlib import Path

from moefit.errors import InputError
from moefit.ingest.gguf_header import read_header, shard_paths
from moefit.serve.text import GenerationDefaults, Tokenizer

_SPECIAL = ("bos_token", "eos_token", "pad_token", "unk_token")


def tokenizer_from_gguf(path: str | Path) -> Tokenizer:
    """The tokenizer and chat template in the metadata of the GGUF model at ``path`` (the
    first shard of a split file holds them).

    Raises InputError when the file has no vocabulary or the converter cannot build it
    (the message names ``--tokenizer DIR``).
    """
    first = shard_paths(path)[0]
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            convert_gguf_tokenizer, get_gguf_tokenizer)
    except ImportError as e:
        raise InputError(f"{first}: reading a GGUF tokenizer needs transformers>=5.20 "
                         f"({e}); or pass --tokenizer DIR with a tokenizer.json") from e
    try:
        arch, tokenizer, config = get_gguf_tokenizer(str(first))
        if not tokenizer.get("tokens"):
            raise ValueError("no tokenizer.ggml.tokens")
        backend, _ = convert_gguf_tokenizer(arch, tokenizer)
    except (KeyError, ValueError, IndexError, TypeError) as e:
        raise InputError(f"{first}: cannot build the tokenizer from the GGUF metadata ({e}); "
                         "pass --tokenizer DIR with the model's tokenizer.json") from e
    special = {k: config[k] for k in _SPECIAL if config.get(k)}
    template = config.get("chat_template")
    return Tokenizer(backend, template if isinstance(template, str) else None, special)


def generation_defaults_from_gguf(path: str | Path, tokenizer: Tokenizer | None) -> GenerationDefaults:
    """Greedy defaults; EOS ids from ``tokenizer.ggml.eos_token_id`` and ``eot_token_id``
    (llama.cpp stops at both) and the tokenizer's ``eos_token``."""
    meta = read_header(path).meta
    ids = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
           if isinstance(meta.get(k), int)]
    if tokenizer is not None:
        tid = tokenizer.token_id(tokenizer.special.get("eos_token"))
        if tid is not None:
            ids.append(tid)
    return GenerationDefaults(eos_ids=tuple(dict.fromkeys(ids)))


def text_from_gguf(path: str | Path) -> tuple[Tokenizer | None, GenerationDefaults]:
    """(tokenizer, generation defaults) of a GGUF model; the tokenizer is None when the file
    has no vocabulary (token-id requests only). Raises InputError when it has one that the
    converter cannot build."""
    if "tokenizer.ggml.tokens" not in read_header(path).array_lengths:
        return None, generation_defaults_from_gguf(path, None)
    tokenizer = tokenizer_from_gguf(path)
    return tokenizer, generation_defaults_from_gguf(path, tokenizer)
