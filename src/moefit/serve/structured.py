"""Structured output: ``response_format`` ``json_object`` / ``json_schema`` as a token mask
per sequence, through llguidance (https://github.com/guidance-ai/llguidance).

A request's ``response_format`` becomes one :class:`Grammar` (compiled on a worker thread,
never on the event loop nor the engine thread: :func:`compile_response_format`); each of its
sequences gets a :class:`Constraint` of its own (``Grammar.start``), so the other sequences
of a batch stay unconstrained. Each step the constraint sets the logits of the tokens the
grammar does not allow to -inf before the sampler sees them (``Constraint.apply``), then
consumes the sampled token (``Constraint.advance``); the grammar's end (the JSON value is
complete) ends the sequence with ``finish_reason: "stop"``.

Not stalling the batch: the mask of a sequence's next token is computed on a small thread
pool (:data:`GRAMMAR_THREADS`; llguidance drops the GIL) as soon as its token is consumed, so
it runs while the engine thread runs the next forward pass; the step only waits for it
where it is not ready yet. Its cost was measured with ``benchmarks/structured_mask.py``
(docs/serve.md, "Structured output"; why llguidance and not xgrammar or outlines-core).

Formats (OpenAI's, https://platform.openai.com/docs/guides/structured-outputs):
``{"type": "json_object"}``: any JSON object; ``{"type": "json_schema", "json_schema":
{"name", "schema", "strict"}}``: a value valid under ``schema`` (JSON Schema as llguidance
compiles it: types, ``properties`` / ``required`` / ``additionalProperties``, ``enum``,
``const``, ``minLength`` / ``maxLength``, ``minimum`` / ``maximum``, ``items``,
``minItems`` / ``maxItems``, ``anyOf`` / ``oneOf``, ``$ref`` / ``$defs``, ``pattern``,
``format``). The JSON is written compactly (no whitespace between tokens:
llguidance's ``whitespace_flexible`` false), so that a model cannot run on in blanks.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Sequence

import torch

from moefit.errors import InputError

try:            # the serve extra's; a server without it refuses JSON formats with a 400
    import llguidance
except ImportError as e:          # pragma: no cover - the extras install it
    llguidance = None
    _MISSING = str(e)

#: Threads computing the masks of the next tokens (shared by every sequence).
GRAMMAR_THREADS = 2
#: llguidance's JSON options: compact JSON, no whitespace between tokens.
JSON_OPTIONS = {"whitespace_flexible": False}

#: byte value -> its 8 bits, least significant first (llguidance's mask: bit ``i`` of
#: 32-bit little-endian word ``j`` allows token ``32 j + i``, so bit ``b`` of byte ``k``
#: allows token ``8 k + b``).
_BITS = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool()

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_tokenizers: dict = {}
_tokenizers_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(GRAMMAR_THREADS, thread_name_prefix="moefit-grammar")
        return _pool


def _llguidance():
    if llguidance is None:
        raise InputError(f"response_format json_object / json_schema needs the llguidance "
                         f"package ({_MISSING}); install moefit's serve extra: pip install "
                         "'moefit[serve]'")
    return llguidance


class _Vocabulary:
    """What ``llguidance.TokenizerWrapper`` reads of a tokenizer: every token's bytes
    (:meth:`moefit.serve.text.Tokenizer.token_bytes`: byte-level BPE, byte fallback and
    plain vocabularies alike), the special (added) token ids, the EOS id, and an encoder."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: Sequence[int]):
        size = min(vocab_size, tokenizer.tok.get_vocab_size(with_added_tokens=True))
        self.tokens = [tokenizer.token_bytes(i) for i in range(size)]
        self.special_token_ids = sorted(i for i in tokenizer.tok.get_added_tokens_decoder()
                                        if i < size)
        self.eos_token_id = eos_ids[0] if eos_ids else None
        self.bos_token_id = None
        self._encode = tokenizer.encode

    def __call__(self, text: str) -> list[int]:
        return self._encode(text, add_special_tokens=False)


def llg_tokenizer(tokenizer, vocab_size: int, eos_ids: Sequence[int]):
    """llguidance's tokenizer for ``tokenizer`` (:class:`moefit.serve.text.Tokenizer`) over the
    model's ``vocab_size`` logits (ids the tokenizer lacks are never allowed), ending at
    ``eos_ids``. Built once per (tokenizer, vocabulary, EOS ids) and kept: it reads every
    token (seconds for Qwen's 151,936). Raises InputError when llguidance cannot take the
    vocabulary."""
    key = (id(tokenizer), vocab_size, tuple(eos_ids))
    with _tokenizers_lock:
        hit = _tokenizers.get(key)
        if hit is not None and hit[0] is tokenizer:
            return hit[1]
        llg = _llguidance()
        try:
            lt = llg.LLTokenizer(llg.TokenizerWrapper(_Vocabulary(tokenizer, vocab_size, eos_ids)),
                                 n_vocab=vocab_size, eos_token=list(eos_ids) or None)
        except (ValueError, RuntimeError, TypeError) as e:
            raise InputError(f"response_format: llguidance cannot read this model's tokenizer "
                             f"({e}); leave response_format out") from None
        _tokenizers[key] = (tokenizer, lt)
        return lt


def schema_of(response_format: dict[str, Any]) -> dict | None:
    """The JSON Schema a ``response_format`` asks for: None for ``text``, ``{"type":
    "object"}`` for ``json_object``, ``json_schema.schema`` for ``json_schema``. Raises
    InputError naming the field that is wrong (``response_format.type``,
    ``response_format.json_schema``, ``response_format.json_schema.schema``)."""
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise InputError(f"response_format.type {kind!r} is not a response format; use "
                         '"text", "json_object" or "json_schema"')
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise InputError('response_format.json_schema: required with "type": "json_schema", '
                         'as {"name": ..., "schema": {...}}')
    schema = spec.get("schema")
    if schema is True:          # JSON Schema's boolean "anything" (draft 6 on): any JSON value
        return {}
    if schema is False:
        raise InputError("response_format.json_schema.schema: false accepts no output at all; "
                         "send a schema some JSON follows (true: any JSON)")
    if not isinstance(schema, dict):
        raise InputError("response_format.json_schema.schema: must be a JSON Schema object "
                         f"(got {type(schema).__name__ if schema is not None else 'nothing'})")
    return schema


class Grammar:
    """One request's compiled ``response_format``: a matcher at the start of the output, from
    which each sequence starts its own :class:`Constraint`."""

    def __init__(self, matcher, vocab_size: int, mask_tokens: int):
        self.matcher, self.vocab_size, self.mask_tokens = matcher, vocab_size, mask_tokens

    def start(self) -> "Constraint":
        """A fresh constraint for one sequence (its first mask starts computing now)."""
        return Constraint(self.matcher.deep_copy(), self.vocab_size, self.mask_tokens)


def compile_response_format(response_format: dict[str, Any] | None, tokenizer, vocab_size: int,
                            eos_ids: Sequence[int]) -> Grammar | None:
    """The :class:`Grammar` of a request's ``response_format`` (None: unconstrained). Slow
    for the first request of a tokenizer (:func:`llg_tokenizer`) and for large schemas: call
    it on a worker thread. Raises InputError for a malformed format or a schema llguidance
    refuses (the message names ``response_format.json_schema.schema`` and says why), and
    when the model has no tokenizer."""
    if response_format is None:
        return None
    schema = schema_of(response_format)
    if schema is None:
        return None
    field = ("response_format.json_schema.schema" if response_format.get("type") == "json_schema"
             else "response_format")
    return compile_schema(schema, field, tokenizer, vocab_size, eos_ids)


def compile_schema(schema: dict, field: str, tokenizer, vocab_size: int,
                   eos_ids: Sequence[int]) -> Grammar:
    """The :class:`Grammar` of output valid under the JSON Schema ``schema``; ``field`` names
    where it came from in InputError messages (``response_format.json_schema.schema``,
    ``tools[0].function.parameters``). Raises as :func:`compile_response_format` does."""
    if tokenizer is None:
        raise InputError("response_format: constrained output needs the model's tokenizer "
                         "(this model directory has no tokenizer.json)")
    llg = _llguidance()
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except (ValueError, RuntimeError, TypeError) as e:
        raise InputError(f"{field}: not a JSON Schema llguidance can compile ({e})") from None
    lt = llg_tokenizer(tokenizer, vocab_size, eos_ids)
    matcher = llg.LLMatcher(lt, grammar, log_level=0)
    if matcher.is_error():
        raise InputError(f"{field}: not a JSON Schema llguidance can compile "
                         f"({matcher.get_error()[:300]})")
    mask = matcher.compute_bitmask()
    allowed = {8 * k + b for k, byte in enumerate(mask) if byte for b in range(8) if byte >> b & 1}
    # llguidance allows token 0 where no token can go on (a vocabulary without "{")
    if not allowed - set(tokenizer.tok.get_added_tokens_decoder()):
        raise InputError(f"{field}: no output of this model's vocabulary satisfies this schema "
                         "(a schema no value can match, such as one whose only definition is "
                         "itself, or a tokenizer that cannot write JSON); check the schema")
    return Grammar(matcher, vocab_size, lt.vocab_size)


class Constraint:
    """The grammar state of one sequence: :meth:`apply` masks a step's logits, :meth:`advance`
    consumes the sampled token and starts the next mask on the pool (module docstring)."""

    def __init__(self, matcher, vocab_size: int, mask_tokens: int):
        # mask_tokens: llguidance's vocabulary (it adds an EOS token where none is given)
        self.matcher, self.vocab_size = matcher, vocab_size
        self.words = torch.zeros(((max(vocab_size, mask_tokens) + 31) // 32) * 4, dtype=torch.uint8)
        self.pending: Future = _executor().submit(self._mask)

    def _mask(self) -> torch.Tensor:
        """``[V]`` bool: the tokens the grammar allows next (pool thread)."""
        self.matcher.unsafe_compute_mask_ptr(self.words.data_ptr(), self.words.numel())
        return _BITS.index_select(0, self.words.long()).flatten()[:self.vocab_size]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` ``[V]`` with every token the grammar does not allow at -inf (fp32, a new
        tensor). Raises RuntimeError when the grammar allows no token of the vocabulary
        (the job ends with that error; the others go on)."""
        allowed = self.pending.result()
        if self.matcher.is_error() or not bool(allowed.any()):
            raise RuntimeError("response_format: the grammar allows no token of this model's "
                               f"vocabulary here ({self.matcher.get_error() or 'empty mask'})")
        return logits.float().masked_fill(~allowed, float("-inf"))

    def advance(self, token: int) -> bool:
        """Consume the sampled ``token``; True when the grammar is complete (the sequence
        ends), else the next mask starts computing. Raises RuntimeError when the grammar
        refuses the token (the sampler drew a masked one: a bug)."""
        if not self.matcher.consume_token(int(token)):
            raise RuntimeError(f"response_format: the grammar refused token {token} "
                               f"({(self.matcher.get_error() or '')[:300]})")
        if self.matcher.is_stopped():
            return True
        self.pending = _executor().submit(self._mask)
        return False
