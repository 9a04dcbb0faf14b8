"""One completion on the engine, token by token.

``prefill`` the prompt (in the plan's chunks), then sample a token from the logits and
``decode`` it, until one of:

1. an EOS id (``generation_config.json``; the EOS token counts as a completion token but
   adds no text): ``finish_reason = "stop"``;
2. a stop string appears in the text (the text ends before it): ``"stop"``;
3. ``max_tokens`` tokens were generated: ``"length"``;
4. the sequence reached the plan's context (``--max-context``): ``"length"``. After a
   prompt of P tokens (at most ``context - 1``) at most ``context - P`` tokens are
   sampled, so prompt + completion never exceed the context;
5. ``cancelled()`` turned true (the client went away, or the server is shutting down):
   checked before the prefill and between tokens, the generation just ends (no more
   steps; :func:`complete` reports ``finish_reason = "abort"``);
6. the request's ``response_format`` grammar is complete (the JSON value is closed):
   ``"stop"`` (:mod:`moefit.serve.structured`).

Sampling (:func:`moefit.runtime.sampling.sample`, given the request's :class:`Params`):
temperature 0 is greedy; otherwise top-k, then top-p (nucleus, Holtzman et al. 2019,
arXiv:1904.09751) filtering and a draw from a ``torch.Generator`` seeded by the request's
``seed`` (a random seed without one).

:class:`Params` is the one sampling-parameter type: an API request body
(:mod:`moefit.serve.protocol`) and the ``moefit generate`` flags both become one through
:meth:`Params.resolve`, and both are checked against the same bounds
(:data:`moefit.serve.protocol.SAMPLING_BOUNDS`).
"""

from __future__ import annotations

import math

import operator
import secrets
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from moefit.errors import InputError
from moefit.runtime.sampling import sample
from moefit.serve.protocol import SAMPLING_BOUNDS
from moefit.serve.text import GenerationDefaults, TextStream, Tokenizer


#: The smallest temperature that samples (vLLM's ``_MAX_TEMP``, ``vllm/sampling_params.py``):
#: a temperature above 0 and below it is raised to it, as vLLM does, since dividing the
#: logits by less overflows fp32 to infinities (``"temperature": 1e-40`` made the sampler
#: raise); 0 stays greedy.
MIN_TEMPERATURE = 1e-2


@dataclass(frozen=True)
class Params:
    """What one completion may do.

    ``max_tokens``: new tokens at most (None: until the context is full). ``temperature``
    0 is greedy; ``top_k`` 0 and ``top_p`` 1 keep every token. ``stop``: stop strings.
    ``eos_ids``: token ids that end the completion (ignored with ``ignore_eos``);
    ``stop_ids``: more such ids (``stop_token_ids``; kept with ``ignore_eos``). ``min_p`` 0
    and ``repetition_penalty`` 1 are off. ``logprobs``: each token's log probability and
    that many most likely alternatives are returned (None: none). ``logit_bias``: ``(token,
    bias)`` added to the logits; ``presence_penalty`` / ``frequency_penalty``: OpenAI's
    (:func:`openai_penalties`), 0 off. ``grammar``: a
    :class:`moefit.serve.structured.Grammar` every sequence of the request follows (its
    ``response_format``; None: unconstrained).
    """

    max_tokens: int | None = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    eos_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    grammar: Any = None

    @classmethod
    def resolve(cls, defaults: GenerationDefaults, *, max_tokens: int | None = None,
                temperature: float | None = None, top_k: int | None = None,
                top_p: float | None = None, seed: int | None = None,
                stop: Sequence[str] | str | None = None, ignore_eos: bool = False,
                min_p: float | None = None, repetition_penalty: float | None = None,
                stop_token_ids: Sequence[int] | None = None,
                logprobs: int | None = None, logit_bias: Sequence[tuple[int, float]] = (),
                presence_penalty: float | None = None,
                frequency_penalty: float | None = None, grammar: Any = None) -> "Params":
        """Request values where given, else the checkpoint's defaults (greedy unless its
        ``generation_config.json`` sets ``do_sample``). ``top_k`` -1 means no top-k; a
        temperature between 0 and :data:`MIN_TEMPERATURE` is raised to it."""
        sampled = defaults.do_sample
        if temperature is None:
            temperature = defaults.temperature if sampled else 0.0
        if top_k is None:
            top_k = defaults.top_k if sampled else 0
        if top_p is None:
            top_p = defaults.top_p if sampled else 1.0
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if 0 < temperature < MIN_TEMPERATURE:
            temperature = MIN_TEMPERATURE
        return cls(max_tokens=max_tokens, temperature=float(temperature), top_k=max(0, int(top_k)),
                   top_p=float(top_p), seed=seed, stop=stops, eos_ids=defaults.eos_ids,
                   ignore_eos=ignore_eos, min_p=float(min_p or 0.0),
                   repetition_penalty=float(repetition_penalty or 1.0),
                   stop_ids=tuple(int(t) for t in stop_token_ids or ()), logprobs=logprobs,
                   logit_bias=tuple(logit_bias), presence_penalty=float(presence_penalty or 0.0),
                   frequency_penalty=float(frequency_penalty or 0.0), grammar=grammar)

    def generator(self, index: int = 0) -> torch.Generator:
        """The random stream of choice ``index`` of a request: seeded by ``seed`` (mixed
        with ``index``, so the ``n`` choices of a seeded request differ, and each is the
        same whichever sequences share its batch), else by the OS."""
        seed = self.seed if self.seed is not None else secrets.randbits(63)
        return torch.Generator().manual_seed((seed + index * 0x9E3779B97F4A7C15) % (1 << 63))


@dataclass
class Step:
    """One sampled token: the text that became final with it, and the finish reason
    (None while the completion goes on). With ``Params.logprobs``: ``logprob``, the token's
    log probability (natural log), and ``top``, the most likely tokens and theirs, most
    likely first."""

    token: int
    text: str
    finish_reason: str | None = None
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class Completion:
    """A finished completion: text, tokens (EOS included), finish reason, and with
    ``Params.logprobs`` each token's :class:`Step` (``steps``)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    steps: list[Step] = field(default_factory=list)


def log_probs(logits: torch.Tensor, token: int, top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """``token``'s log probability under ``logits`` ``[V]`` (fp32 log-softmax, the model's
    own distribution: before temperature and penalties, as vLLM's default ``raw_logprobs``)
    and the ``top`` most likely ``(token, log probability)``, most likely first (ties: the
    lower id, as :func:`torch.topk` orders them)."""
    lp = torch.log_softmax(logits.float(), -1)
    alts = ()
    if top:
        vals, ids = torch.topk(lp, min(top, lp.numel()))
        alts = tuple(zip(ids.tolist(), vals.tolist()))
    return float(lp[token]), alts


class PromptTooLong(InputError):
    """A prompt (plus the tokens asked for) that does not fit the plan's context (the
    message names the limit)."""


def check_prompt(prompt_ids: Sequence[int], context: int, vocab_size: int,
                 max_tokens: int | None = None, flags: bool = False) -> None:
    """The admission check of a request (the API's and ``moefit generate``'s): raise
    InputError for an empty prompt, a token id outside the vocabulary, or a prompt that
    leaves no room in the ``context`` (tokens) for at least one generated token, or
    ``max_tokens`` of them when given (:class:`PromptTooLong`, naming the limit and the
    fix). ``flags``: name ``max_tokens`` as the command-line flag (``--max-tokens``)."""
    if not prompt_ids:
        raise InputError("the prompt is empty (0 tokens)")
    need = len(prompt_ids) + (max_tokens or 1)
    if need > context:
        name = "--max-tokens" if flags else "max_tokens"
        n = len(prompt_ids)
        asked = (f"the prompt is {n} token{'s' if n != 1 else ''}" +
                 (f" and {name} {max_tokens}" if max_tokens else " plus one generated token"))
        raise PromptTooLong(f"{asked} make {need} tokens, more than the planned "
                            f"context of {context} tokens (--max-context {context}); shorten "
                            f"the prompt, lower {name} or plan a larger --max-context")
    bad = next((t for t in prompt_ids if not 0 <= int(t) < vocab_size), None)
    if bad is not None:
        raise InputError(f"token id {bad} is outside the vocabulary (0 .. {vocab_size - 1})")


_BOUND_TESTS = {"ge": operator.ge, "gt": operator.gt, "le": operator.le}
_BOUND_WORDS = {"ge": "at least", "gt": "greater than", "le": "at most"}


def check_sampling(temperature: float | None = None, top_p: float | None = None,
                   top_k: int | None = None, flags: bool = False,
                   max_tokens: int | None = None, min_p: float | None = None,
                   repetition_penalty: float | None = None) -> None:
    """Raise InputError for sampling settings outside the API's bounds
    (:data:`moefit.serve.protocol.SAMPLING_BOUNDS`: ``max_tokens >= 1``,
    ``temperature >= 0``, ``0 < top_p <= 1``, ``top_k >= -1``, ``0 <= min_p <= 1``,
    ``repetition_penalty >= 0.01``; NaN and infinities are outside), checked in that order; None is not
    checked. ``flags``: name them as command-line flags (``--top-p``)."""
    given = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
             "top_k": top_k, "min_p": min_p, "repetition_penalty": repetition_penalty}
    for field, (bounds, meaning) in SAMPLING_BOUNDS.items():
        value = given[field]
        if value is None:
            continue
        if math.isfinite(value) and all(_BOUND_TESTS[k](value, v) for k, v in bounds.items()):
            continue
        name = "--" + field.replace("_", "-") if flags else field
        rule = ("finite and " if not math.isfinite(value) else "") \
            + " and ".join(f"{_BOUND_WORDS[k]} {v}" for k, v in bounds.items())
        raise InputError(f"{name} {value}: must be {rule}" + (f" ({meaning})" if meaning else ""))


def check_stop(stop: Sequence[str] | str | None, flags: bool = False) -> None:
    """Raise InputError for an empty stop string (it would match before any text; vLLM
    refuses it too, ``SamplingParams._verify_args``). ``flags``: name it as the
    command-line flag (``--stop``)."""
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if any(s == "" for s in stops):
        name = '--stop ""' if flags else 'stop ""'
        raise InputError(f"{name}: an empty stop string would end the completion before any "
                         "text; give a non-empty string or leave it out")


def repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """transformers' ``RepetitionPenaltyLogitsProcessor`` (CTRL, Keskar et al. 2019): the
    logit of every token already in the prompt or the output (``seen`` ``[V]`` bool) is
    divided by ``penalty`` when positive and multiplied by it when negative. Returns fp32
    ``[V]``."""
    x = logits.float().clone()
    s = x[seen]
    x[seen] = torch.where(s < 0, s * penalty, s / penalty)
    return x


def openai_penalties(logits: torch.Tensor, counts: torch.Tensor, presence: float,
                     frequency: float) -> torch.Tensor:
    """OpenAI's presence and frequency penalties (API reference, "Parameter details"):
    ``logit[j] - counts[j] * frequency - (counts[j] > 0) * presence``, where ``counts``
    ``[V]`` counts each token in the completion so far (vLLM counts the output tokens too).
    Returns fp32 ``[V]``."""
    return logits.float() - counts * frequency - (counts > 0).float() * presence


class Decoding:
    """What one sequence samples, token after token, from the logits it is given: the
    finish rules of the module docstring (EOS, stop strings, ``max_tokens``, the context)
    and its own random stream. The serving scheduler keeps one per sequence of a batch
    (:mod:`moefit.serve.scheduler`); :func:`stream` runs one by itself.

    Args:
        prompt_ids: the prompt (checked by :func:`check_prompt` first).
        params: the request's settings. ``gen``: its random stream (default:
            ``params.generator()``). ``context``: the plan's context (tokens).
        vocab_size: the model's vocabulary (tokens), for the repetition penalty.
    """

    def __init__(self, prompt_ids: Sequence[int], params: Params, tokenizer: Tokenizer | None,
                 context: int, vocab_size: int, gen: torch.Generator | None = None):
        room = context - len(prompt_ids)
        self.params = params
        self.limit = room if params.max_tokens is None else min(params.max_tokens, room)
        self.gen = gen if gen is not None else params.generator()
        self.eos = (() if params.ignore_eos else params.eos_ids) + params.stop_ids
        self.text = TextStream(tokenizer, prompt_ids, params.stop)
        self.count = 0
        self.seen: torch.Tensor | None = None      # [V] bool, for the repetition penalty
        if params.repetition_penalty != 1.0:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool)
            self.seen[torch.as_tensor(list(prompt_ids), dtype=torch.long)] = True
        self.counts: torch.Tensor | None = None    # [V] fp32, tokens generated
        if params.presence_penalty or params.frequency_penalty:
            self.counts = torch.zeros(vocab_size, dtype=torch.float32)
        self.bias: tuple[torch.Tensor, torch.Tensor] | None = None
        if params.logit_bias:
            ids, values = zip(*params.logit_bias)
            self.bias = (torch.tensor(ids, dtype=torch.long), torch.tensor(values, dtype=torch.float32))
        # its own grammar state: the other sequences of a batch stay unconstrained
        self.constraint = params.grammar.start() if params.grammar is not None else None

    def step(self, logits: torch.Tensor) -> Step:
        """Sample the next token from ``logits`` ``[V]``; the Step has a finish reason
        when this token ends the sequence."""
        raw = logits
        if self.constraint is not None:    # the grammar's mask first: -inf stays -inf below
            logits = self.constraint.apply(logits)
        if self.bias is not None:          # vLLM's order: the bias, then the penalties
            logits = logits.float().index_add(0, self.bias[0], self.bias[1])
        if self.seen is not None:
            logits = repetition_penalty(logits, self.seen, self.params.repetition_penalty)
        if self.counts is not None:
            logits = openai_penalties(logits, self.counts, self.params.presence_penalty,
                                      self.params.frequency_penalty)
        tok = sample(logits, self.params, self.gen)
        if self.seen is not None:
            self.seen[tok] = True
        if self.counts is not None:
            self.counts[tok] += 1
        self.count += 1
        step = self._finish(tok)
        if self.constraint is not None and step.finish_reason is None and self.constraint.advance(tok):
            step = Step(tok, step.text + self.text.flush(), "stop")     # the JSON is complete
        if self.params.logprobs is not None:
            step.logprob, step.top = log_probs(raw, tok, self.params.logprobs)
        return step

    def _finish(self, tok: int) -> Step:
        if tok in self.eos:
            return Step(tok, self.text.flush(), "stop")
        delta = self.text.push(tok)
        if self.text.stopped:
            return Step(tok, delta, "stop")
        if self.count >= self.limit:
            return Step(tok, delta + self.text.flush(), "length")
        return Step(tok, delta)


def stream(engine, prompt_ids: Sequence[int], params: Params, tokenizer: Tokenizer | None,
           gen: torch.Generator | None = None, slot: int = 0,
           cancelled: Callable[[], bool] | None = None) -> Iterator[Step]:
    """Generate on ``engine`` (a started :class:`~moefit.runtime.engine.Engine`) one token
    at a time; the last :class:`Step` carries the finish reason (module docstring).
    ``cancelled``: checked before the prefill and between tokens; when it returns true
    the generator ends without a finish reason.

    The caller serialises calls (``moefit generate``); the server batches sequences with
    :mod:`moefit.serve.scheduler` instead.
    """
    context = engine.plan.context
    check_prompt(prompt_ids, context, engine.plan.geometry.vocab_size)
    dec = Decoding(prompt_ids, params, tokenizer, context, engine.plan.geometry.vocab_size, gen)
    if cancelled is not None and cancelled():
        return
    logits = engine.prefill(prompt_ids, slot)
    while True:
        if cancelled is not None and cancelled():
            return
        step = dec.step(logits)
        yield step
        if step.finish_reason is not None:
            return
        logits = engine.decode(step.token, slot)


def complete(engine, prompt_ids: Sequence[int], params: Params, tokenizer: Tokenizer | None,
             gen: torch.Generator | None = None, slot: int = 0,
             cancelled: Callable[[], bool] | None = None) -> Completion:
    """Run :func:`stream` to the end and collect it (``finish_reason`` ``"abort"`` when
    ``cancelled`` ended it)."""
    out = Completion()
    parts = []
    finished = False
    for step in stream(engine, prompt_ids, params, tokenizer, gen, slot, cancelled):
        out.token_ids.append(step.token)
        parts.append(step.text)
        if step.finish_reason:
            out.finish_reason = step.finish_reason
            finished = True
    if not finished:
        out.finish_reason = "abort"
    out.text = "".join(parts)
    return out
