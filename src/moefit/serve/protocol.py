"""OpenAI-compatible request bodies (``/v1/completions``, ``/v1/chat/completions``).

Field names and meanings are OpenAI's (https://platform.openai.com/docs/api-reference).
A field moefit does not know is a 400 naming it. Every field OpenAI defines for these two
endpoints is known, and its neutral value accepted (``store: false``, ``tool_choice:
"none"``, ``parallel_tool_calls``, ``metadata``, ``user``, ``service_tier``, ``n: 1``,
``best_of`` equal to ``n``, ...); a value is refused with a 400 only when moefit cannot honour
it (``echo`` with ``logprobs``, ``suffix`` without FIM tokens, ``store: true``, audio output). ``tools`` / ``tool_choice``:
:mod:`moefit.serve.tools`. ``response_format``
``json_object`` / ``json_schema`` constrains the output (:mod:`moefit.serve.structured`). ``logit_bias`` (-100..100 added
to a token's logit), ``presence_penalty`` and ``frequency_penalty`` (-2..2, OpenAI's formula
over the tokens generated so far: :func:`moefit.serve.generation.openai_penalties`) are
honoured. Fields that change nothing served
here are accepted as they are: ``metadata``, ``service_tier``, ``user``,
``safety_identifier``, ``prompt_cache_key``, ``prediction``, ``parallel_tool_calls``.
``reasoning_effort`` is handed to the chat template (gpt-oss's reads it). A chat
message's ``role`` is one of :data:`CHAT_ROLES`.

``logprobs`` (completions: the number of alternatives, 0-20) and ``logprobs: true`` with
``top_logprobs`` (chat, 0-20) return each sampled token's log probability in OpenAI's
shape, from the fp32 logits of the step before the sampling settings (temperature,
penalties) act, as vLLM returns them by default.

Numbers and flags are strict (OpenAI's types): ``"max_tokens": "8"`` or ``true`` is a
400, not 8 or 1; a number where a float is expected may be written as an integer.

Extensions (vLLM's names and meanings): ``top_k`` (0 or -1: off), ``min_p`` (0..1: drop
tokens less likely than ``min_p`` x the most likely one), ``repetition_penalty`` (>= 0.01, 1:
off; transformers' ``RepetitionPenaltyLogitsProcessor`` over the prompt and the output),
``stop_token_ids`` (token ids that end the completion, like the EOS ids), ``ignore_eos``,
``return_token_ids`` (the prompt and completion token ids in each choice),
``chat_template_kwargs``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from moefit.errors import InputError

#: ``stop_token_ids`` a request may give (``stop`` strings: 16)
MAX_STOP_TOKEN_IDS = 256
#: ``logit_bias`` entries a request may give (OpenAI's limit is the vocabulary; tokens are
#: biased one by one on every step, so a bound keeps the step's cost small)
MAX_LOGIT_BIAS = 1024


#: The bounds of the sampling settings, one home for the request body's fields (below)
#: and the ``moefit generate`` flags (:func:`moefit.serve.generation.check_sampling`):
#: field -> (pydantic's ``ge`` / ``gt`` / ``le`` constraints, what the edge value means).
#: ``repetition_penalty`` divides the logits of the tokens seen: below
#: :data:`MIN_REPETITION_PENALTY` the quotient overflows fp32 (1e-40 made the sampler
#: raise), so it is refused (vLLM refuses only 0 and below, and overflows the same way).
MIN_REPETITION_PENALTY = 0.01
SAMPLING_BOUNDS: dict[str, tuple[dict[str, float], str | None]] = {
    "max_tokens": ({"ge": 1}, None),
    "temperature": ({"ge": 0}, "0: greedy"),
    "top_p": ({"gt": 0, "le": 1}, None),
    "top_k": ({"ge": -1}, "0 or -1: off"),
    "min_p": ({"ge": 0, "le": 1}, "0: off"),
    "repetition_penalty": ({"ge": MIN_REPETITION_PENALTY}, "1: off"),
}


def _bounded(name: str):
    """The optional, strictly typed field ``name`` with its :data:`SAMPLING_BOUNDS`."""
    return Field(None, **SAMPLING_BOUNDS[name][0], strict=True)


class _Body(BaseModel):
    # allow_inf_nan: JSON's Infinity / NaN (which Python's json reads) are not settings
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


#: Chat roles the API knows (OpenAI's; ``developer`` is its newer name for ``system``).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


#: Alternatives per token ``logprobs`` (completions) and ``top_logprobs`` (chat) may ask
#: for (OpenAI's chat bound, and vLLM's default ``--max-logprobs``).
MAX_LOGPROBS = 20


class StreamOptions(_Body):
    include_usage: bool = Field(False, strict=True)
    include_obfuscation: bool | None = Field(None, strict=True)

    def refuse_unsupported(self) -> None:
        if self.include_obfuscation:
            raise InputError("stream_options.include_obfuscation true is not supported by moefit "
                             "(its streams carry no padding field); leave it out or false")


class _Sampling(_Body):
    """Fields both endpoints share."""

    model: str | None = None
    max_tokens: int | None = _bounded("max_tokens")
    temperature: float | None = _bounded("temperature")
    top_p: float | None = _bounded("top_p")
    top_k: int | None = _bounded("top_k")
    min_p: float | None = _bounded("min_p")
    repetition_penalty: float | None = _bounded("repetition_penalty")
    stop_token_ids: list[int] | None = Field(None, strict=True, max_length=MAX_STOP_TOKEN_IDS)
    response_format: dict[str, Any] | None = None
    seed: int | None = Field(None, strict=True)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=16, strict=True)
    stream: bool = Field(False, strict=True)
    stream_options: StreamOptions | None = None
    # llama-server's: false runs the whole prompt (no cells of a slot's earlier prompt kept)
    cache_prompt: bool = Field(True, strict=True)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, max_length=MAX_LOGIT_BIAS)
    user: str | None = None
    ignore_eos: bool = Field(False, strict=True)
    return_token_ids: bool = Field(False, strict=True)
    # OpenAI's fields whose every value is served alike here (tags, caching hints, billing
    # tiers): accepted and not acted on
    metadata: dict[str, Any] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    def refuse_unsupported(self) -> None:
        """InputError for a feature moefit does not have (see module docstring)."""
        if self.stream_options is not None:
            self.stream_options.refuse_unsupported()
        if isinstance(self.stop, list) and len(self.stop) > 16:
            raise InputError("stop: at most 16 stop strings")

    def bias(self, vocab_size: int) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as ``(token id, bias)`` pairs. Raises InputError for a key that
        is not a token id of the vocabulary (OpenAI's keys are token ids as strings)."""
        out = []
        for key, value in (self.logit_bias or {}).items():
            if not key.isdigit() or not int(key) < vocab_size:
                raise InputError(f"logit_bias: {key[:40]!r} is not a token id of this model's "
                                 f"vocabulary (0 .. {vocab_size - 1}, written as a string)")
            out.append((int(key), float(value)))
        return tuple(out)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


#: strict ids: ``[true, false]`` is not a prompt of token ids 1 and 0
Prompt = Union[str, list[str], list[StrictInt], list[list[StrictInt]]]


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, a list of token
    ids, or a list of token-id lists; each prompt gets ``n`` choices."""

    prompt: Prompt
    echo: bool = Field(False, strict=True)
    best_of: int | None = Field(None, ge=1, strict=True)
    suffix: str | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, strict=True)

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo and self.logprobs is not None:
            raise InputError("echo with logprobs: moefit does not return the prompt's logprobs "
                             "(only the completion's); send echo or logprobs, not both")
        if self.best_of not in (None, 1, self.n):
            raise InputError(f"best_of {self.best_of} is not supported by moefit (it returns every "
                             "sequence it runs: use n, or best_of equal to n)")


    @property
    def top_logprobs_count(self) -> int | None:
        """Alternatives per token to return (None: no logprobs)."""
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per entry: text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InputError("prompt: empty list")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message: OpenAI's fields (``name``, ``tool_calls``, ``tool_call_id``,
    ``refusal``, the legacy ``function_call``; ``audio`` is refused) and the reasoning the
    chat templates read (``reasoning_content``: Qwen3's, DeepSeek's and vLLM's;
    ``reasoning``: vLLM's newer name; ``thinking``: gpt-oss's), all kept for the chat
    template; any other key is a 400 naming it, as an unknown key of the request is.
    ``content`` is required; it may be null only for an ``assistant`` message (one that
    made tool calls)."""

    model_config = ConfigDict(extra="forbid")
    role: str
    content: str | list[TextPart | dict[str, Any]] | None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    function_call: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    thinking: str | None = None

    def for_template(self) -> dict:
        """The message as the template sees it: text parts joined by newlines. Raises
        InputError for a role not in :data:`CHAT_ROLES` or missing content."""
        if self.role not in CHAT_ROLES:
            raise InputError(f"messages: role {self.role!r} is not a chat role; use one of "
                             f"{', '.join(CHAT_ROLES)}")
        if self.audio is not None:
            raise InputError("messages: an assistant message's audio (a reference to an "
                             "earlier audio reply) is not supported: moefit has no audio")
        if self.content is None and self.role != "assistant":
            raise InputError(f"messages: a {self.role!r} message needs content (null only "
                             "for an assistant message)")
        msg = self.model_dump(exclude_none=True)
        msg["content"] = content = self.content      # null kept: templates read message.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, TextPart):
                    kind = part.get("type", "?") if isinstance(part, dict) else "?"
                    if kind == "text":
                        # a text part that is not exactly {"type", "text": str}
                        extra = sorted(set(part) - {"type", "text"})
                        why = (f"has unknown keys {', '.join(map(repr, extra))}" if extra
                               else "needs \"text\" as a string")
                        raise InputError(f"messages: a content part of type 'text' {why}; "
                                         "send {\"type\": \"text\", \"text\": ...}")
                    raise InputError(f"messages: content part of type {kind!r} is not "
                                     "supported (text only)")
                texts.append(part.text)
            msg["content"] = "\n".join(texts)
        return msg


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, strict=True)
    logprobs: bool | None = Field(None, strict=True)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, strict=True)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = Field(None, strict=True)
    functions: list[dict[str, Any]] | None = None               # deprecated names of tools
    function_call: Literal["none", "auto"] | dict[str, Any] | None = None
    store: bool | None = Field(None, strict=True)
    modalities: list[Literal["text", "audio"]] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None      # a hint for speed only: the output is the same
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    web_search_options: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's variables: ``chat_template_kwargs`` (vLLM's), with
        ``add_generation_prompt`` (the field, or the same name in ``chat_template_kwargs``,
        which wins as in vLLM). Raises InputError for ``messages`` among them (the
        conversation is the ``messages`` field) or a non-boolean ``add_generation_prompt``."""
        kwargs = dict(self.chat_template_kwargs or {})
        if "messages" in kwargs:
            raise InputError("chat_template_kwargs: 'messages' is the conversation itself; send "
                             "it as the request's messages field")
        agp = kwargs.pop("add_generation_prompt", self.add_generation_prompt)
        if not isinstance(agp, bool):
            raise InputError(f"chat_template_kwargs.add_generation_prompt: {agp!r} is not a "
                             "boolean (true or false)")
        if self.reasoning_effort is not None:      # gpt-oss's template reads it
            kwargs.setdefault("reasoning_effort", self.reasoning_effort)
        return {**kwargs, "add_generation_prompt": agp}

    def refuse_unsupported(self) -> None:
        """InputError for a value moefit cannot honour (the neutral values of every field
        are accepted: ``tool_choice: "none"``, ``store: false``, ``modalities: ["text"]``,
        ...)."""
        super().refuse_unsupported()
        if self.top_logprobs and not self.logprobs:
            raise InputError("top_logprobs needs logprobs: true")
        if self.store:
            raise InputError("store: true is not supported: moefit keeps no completions (leave "
                             "it out or false)")
        if (self.modalities and "audio" in self.modalities) or self.audio is not None:
            raise InputError("audio output is not supported by moefit (modalities: [\"text\"])")
        if self.web_search_options is not None:
            raise InputError("web_search_options: moefit does not search the web")
        if self.verbosity not in (None, "medium"):
            raise InputError(f"verbosity {self.verbosity!r} is not supported by moefit (the "
                             "model answers as it does: leave it out or \"medium\")")

    @property
    def top_logprobs_count(self) -> int | None:
        """Alternatives per token to return (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
