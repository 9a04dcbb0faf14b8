"""Text around the engine: tokenizer, chat template, sampling defaults, stop strings.

Read from a Hugging Face checkpoint directory, as transformers reads them:

- ``tokenizer.json``: the fast tokenizer (``tokenizers.Tokenizer.from_file``); prompts are
  encoded with the special tokens its post-processor adds (a BOS where the model has one)
  and outputs decoded without special tokens.
- ``tokenizer_config.json``: ``chat_template`` (a string, or a list of named templates of
  which ``default`` is used), and ``bos_token`` / ``eos_token`` / ``pad_token`` /
  ``unk_token`` (a string or an ``{"content": ...}`` object) that templates refer to. A
  ``chat_template.jinja`` file (transformers >= 4.43 writes the template there) or
  ``chat_template.json`` takes precedence.
- ``generation_config.json``: ``eos_token_id`` (int or list) and the sampling defaults
  ``do_sample``, ``temperature``, ``top_k``, ``top_p``.

Chat templates are rendered as transformers' ``apply_chat_template`` renders them
(``transformers/utils/chat_template_utils.py``): a sandboxed Jinja2 environment with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter
that keeps non-ASCII characters, ``raise_exception(message)`` and ``strftime_now(format)``;
the rendered text is then encoded without adding special tokens (the template writes them).

Incremental detokenization (:class:`TextStream`) follows vLLM's
``detokenize_incrementally``: decode a short window before and after the new token and emit
the difference, holding it back while it ends in an incomplete UTF-8 sequence (U+FFFD);
the window starts in the prompt so that a first token's leading space survives.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Sequence

from moefit.errors import InputError
from moefit.ingest.inputs import decode_utf8, read_bytes, read_json


def _read_json(path: Path) -> dict:
    data = read_json(path, "tokenizer config")      # a regular file, bounded, UTF-8
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a JSON object")
    return data


def _token_text(value) -> str | None:
    """``"<s>"`` or ``{"content": "<s>", ...}`` (an AddedToken as transformers saves it)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _pick_template(value) -> str | None:
    """A ``chat_template`` entry: a string, or ``[{"name", "template"}]`` (use ``default``)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return None


class Tokenizer:
    """The checkpoint's tokenizer and chat template. Build with :meth:`from_dir`.

    Args:
        tok: a ``tokenizers.Tokenizer``.
        chat_template: Jinja2 source, or None when the checkpoint has none.
        special: ``{"bos_token": "<s>", "eos_token": ..., ...}`` as the templates see them.
    """

    def __init__(self, tok, chat_template: str | None, special: dict[str, str]):
        self.tok, self.chat_template, self.special = tok, chat_template, special
        self._template = None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "Tokenizer | None":
        """The tokenizer of ``model_dir``, or None when it has no ``tokenizer.json``.

        Raises InputError naming the file when a file exists but cannot be read.
        """
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            return None
        from tokenizers import Tokenizer as _Fast

        try:
            tok = _Fast.from_file(str(path))
        except Exception as e:  # the Rust side raises plain Exception subclasses
            raise InputError(f"{path}: not a tokenizers file ({e})") from e
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = _read_json(cfg_path) if cfg_path.is_file() else {}
        template = _pick_template(cfg.get("chat_template"))
        if (model_dir / "chat_template.json").is_file():
            template = _pick_template(_read_json(model_dir / "chat_template.json").get("chat_template")) or template
        if (model_dir / "chat_template.jinja").is_file():
            jinja = model_dir / "chat_template.jinja"
            template = decode_utf8(read_bytes(jinja, "chat template"), jinja, "chat template")
        special = {k: t for k in ("bos_token", "eos_token", "pad_token", "unk_token")
                   if (t := _token_text(cfg.get(k))) is not None}
        return cls(tok, template, special)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` without special tokens."""
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` stands for (part of a UTF-8 character, for some):
        through GPT-2's byte-to-character table for a byte-level BPE vocabulary (Qwen,
        Llama 3, gpt-oss), the byte of a ``<0xNN>`` byte-fallback piece (SentencePiece),
        else the UTF-8 of the token's text (special tokens included). Cached per id."""
        cache = self.__dict__.setdefault("_bytes_of", {})
        out = cache.get(token_id)
        if out is None:
            out = cache[token_id] = self._token_bytes(token_id)
        return out

    def _token_bytes(self, token_id: int) -> bytes:
        piece = self.tok.id_to_token(int(token_id))
        if piece is None:
            return b""
        if type(self.tok.decoder).__name__ == "ByteLevel" and int(token_id) not in self._added:
            table = _byte_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
        if m:
            return bytes([int(m.group(1), 16)])
        text = self.tok.decode([int(token_id)], skip_special_tokens=False)
        return (text or piece).encode("utf-8", "surrogatepass")

    @property
    def _added(self) -> set[int]:
        added = self.__dict__.get("_added_ids")
        if added is None:
            added = self.__dict__["_added_ids"] = set(self.tok.get_added_tokens_decoder())
        return added

    def token_id(self, text: str | None) -> int | None:
        return None if text is None else self.tok.token_to_id(text)

    def render_chat(self, messages: list[dict], /, *, add_generation_prompt: bool = True,
                    **kwargs) -> str:
        """The chat template applied to ``messages`` (``[{"role", "content"}, ...]``).

        Raises InputError when the checkpoint has no template, or the template rejects the
        conversation (``raise_exception``) or fails to render. ``kwargs`` are the template's
        variables (any names, ``self`` too); ``messages`` and ``add_generation_prompt`` are
        the arguments'.
        """
        if self.chat_template is None:
            raise InputError("this model has no chat template (no chat_template in "
                             "tokenizer_config.json); use /v1/completions with a plain prompt")
        import jinja2

        try:
            if self._template is None:
                self._template = _jinja_env().from_string(self.chat_template)
            return self._template.render({**self.special, **kwargs, "messages": messages,
                                          "add_generation_prompt": add_generation_prompt})
        except jinja2.TemplateError as e:
            raise InputError(f"the chat template rejected the conversation: {e}") from e
        except Exception as e:  # noqa: BLE001 -- the template's own code failed on this input
            raise InputError(f"the chat template failed on this conversation "
                             f"({type(e).__name__}: {e})") from e

    def encode_chat(self, messages: list[dict], /, **kwargs) -> list[int]:
        """Token ids of the rendered conversation (no special tokens added on top)."""
        return self.encode(self.render_chat(messages, **kwargs), add_special_tokens=False)


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's table from the characters of a byte-level BPE vocabulary to the bytes they
    stand for (``bytes_to_unicode`` of openai/gpt-2 ``encoder.py``, which the ``tokenizers``
    ByteLevel pre-tokenizer uses): printable Latin-1 bytes stand for themselves, the other
    68 bytes for the characters from U+0100 on, in order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, n = {}, 0
    for b in range(256):
        if b in keep:
            table[chr(b)] = b
        else:
            table[chr(256 + n)] = b
            n += 1
    return table


def _jinja_env():
    """The environment transformers renders chat templates in (see module docstring)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@dataclass(frozen=True)
class GenerationDefaults:
    """Sampling defaults and end-of-sequence ids of a checkpoint.

    ``do_sample`` False (transformers' default, also when there is no
    ``generation_config.json``) makes greedy decoding the default; with True, requests
    that do not set them sample with ``temperature`` / ``top_k`` / ``top_p`` (transformers'
    defaults 1.0 / 50 / 1.0 where the file is silent). ``eos_ids``: the union of
    ``generation_config.json``'s ``eos_token_id`` (``config.json``'s when absent) and the
    tokenizer's ``eos_token``.
    """

    eos_ids: tuple[int, ...] = ()
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0

    @classmethod
    def from_dir(cls, model_dir: str | Path, tokenizer: Tokenizer | None = None) -> "GenerationDefaults":
        """Read ``generation_config.json`` (and ``config.json`` for the EOS ids). Raises
        InputError naming the file when it is not JSON."""
        model_dir = Path(model_dir)
        gen_path = model_dir / "generation_config.json"
        gen = _read_json(gen_path) if gen_path.is_file() else {}
        eos = gen.get("eos_token_id")
        if eos is None and (model_dir / "config.json").is_file():
            eos = _read_json(model_dir / "config.json").get("eos_token_id")
        ids = [eos] if isinstance(eos, int) else [i for i in (eos or []) if isinstance(i, int)]
        if tokenizer is not None:
            tid = tokenizer.token_id(tokenizer.special.get("eos_token"))
            if tid is not None:
                ids.append(tid)
        return cls(
            eos_ids=tuple(dict.fromkeys(ids)),
            do_sample=bool(gen.get("do_sample", False)),
            temperature=float(gen.get("temperature") if gen.get("temperature") is not None else 1.0),
            top_k=int(gen.get("top_k") if gen.get("top_k") is not None else 50),
            top_p=float(gen.get("top_p") if gen.get("top_p") is not None else 1.0),
        )


class TextStream:
    """Generated tokens -> text deltas, cut at the first stop string.

    Args:
        tokenizer: the checkpoint's tokenizer; None gives no text (token ids only).
        prompt_ids: the prompt, whose last tokens give the first token its context.
        stop: stop strings; the text ends before the first one (it is not included).

    :meth:`push` returns the text that is final after one more token; text that could be
    the start of a stop string is held back until it is not (or :meth:`flush`).
    """

    CONTEXT = 6   #: prompt tokens decoded with the first output token (vLLM uses 5)

    def __init__(self, tokenizer: Tokenizer | None, prompt_ids: Sequence[int],
                 stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-self.CONTEXT:])
        self.prefix, self.read = 0, len(self.ids)
        self.stop = tuple(s for s in stop if s)
        self.text = ""          # the output so far (cut at a stop string)
        self.sent = 0           # characters of ``text`` already returned
        self.stopped = False    # a stop string was found

    def push(self, token: int) -> str:
        """Add one generated token; return the text that became final."""
        if self.tokenizer is None or self.stopped:
            return ""
        self.ids.append(int(token))
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        after = self.tokenizer.decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
            self._cut_at_stop()
        return self._take(hold=self._held())

    def flush(self) -> str:
        """The rest of the text at the end of generation (held-back and undecoded parts)."""
        if self.tokenizer is not None and not self.stopped and self.read < len(self.ids):
            before = self.tokenizer.decode(self.ids[self.prefix:self.read])
            self.text += self.tokenizer.decode(self.ids[self.prefix:])[len(before):]
            self.read = len(self.ids)
            self._cut_at_stop()
        return self._take(hold=0)

    def _cut_at_stop(self) -> None:
        # an occurrence cannot start before ``sent``: a possible start was held back
        hits = [i for s in self.stop if (i := self.text.find(s, self.sent)) >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True

    def _held(self) -> int:
        """Length of the longest tail of ``text`` that begins some stop string."""
        if self.stopped:
            return 0
        tail = self.text[self.sent:]
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(tail)), best, -1):
                if s.startswith(tail[-k:]):
                    best = k
                    break
        return best

    def _take(self, hold: int) -> str:
        end = len(self.text) - hold
        out = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out
