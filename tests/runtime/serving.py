"""A servable tiny checkpoint (weights + tokenizer + chat template), and the real server.

:func:`make_servable` writes a tiny transformers model (see ``conftest.make_tiny``) plus
what ``moefit serve`` reads besides the weights, all made here without downloads:

- ``tokenizer.json``: a WordLevel tokenizer over whitespace-split words, whose 96
  entries are exactly the model's vocabulary (4 special tokens, then words);
- ``tokenizer_config.json``: a ChatML chat template (as Qwen's) and ``eos_token``;
- ``generation_config.json``: ``eos_token_id`` = ``<|im_end|>``, greedy (``do_sample``
  false).

:class:`Server` runs ``python -m moefit serve ... --port 0`` as a real process, waits for
the ``READY`` line (which carries the URL), and always kills the process.
"""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch

SPECIALS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS = 3   # <|im_end|>
TEXT = """the quick brown fox jumps over a lazy dog while seven small birds sing in
old green trees near river bank and children play with red ball under warm summer sun
system user assistant hello world how are you today i am fine thank very much what is
your name my moe model runs on one device expert cache prefill chunk budget memory
plan tokens fast slow good bad yes no maybe please tell me story about cat dog"""

CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                 "{{ message['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def words(vocab: int = 96) -> list[str]:
    """The tokenizer's words: the distinct words of TEXT, then filler, to fill ``vocab``."""
    out = list(dict.fromkeys(TEXT.split()))
    out += [f"w{i}" for i in range(vocab)]
    return out[:vocab - len(SPECIALS)]


def write_tokenizer(path: Path, vocab: int = 96) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    table = {t: i for i, t in enumerate(SPECIALS + words(vocab))}
    tok = Tokenizer(models.WordLevel(vocab=table, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "unk_token": "<unk>",
        "bos_token": None, "tokenizer_class": "PreTrainedTokenizerFast"}))
    (path / "generation_config.json").write_text(json.dumps({
        "eos_token_id": EOS, "do_sample": False}))


def _byte_table() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the ByteLevel pre-tokenizer's)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
          *range(ord("\u00ae"), ord("\u00ff") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


#: The byte-level vocabulary: the 4 special tokens, then one token per byte (no merges).
BYTE_VOCAB = len(SPECIALS) + 256


def write_byte_tokenizer(path: Path) -> None:
    """A byte-level BPE tokenizer (as Qwen's, without merges: one token per byte), which can
    write any text (JSON included: the words of :func:`write_tokenizer` cannot), with the
    same specials, chat template and greedy generation config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    table = {t: i for i, t in enumerate(SPECIALS)}
    for _, ch in sorted(_byte_table().items()):
        table[ch] = len(table)
    tok = Tokenizer(models.BPE(vocab=table, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    write_tokenizer(path)                  # the config files; tokenizer.json replaced below
    tok.save(str(path / "tokenizer.json"))


def make_servable(path: Path, family: str = "qwen3_moe", byte_level: bool = False, **over):
    """A tiny checkpoint of ``family`` with tokenizer files (``byte_level``: the
    :func:`write_byte_tokenizer` vocabulary of :data:`BYTE_VOCAB` tokens); returns conftest's
    Tiny."""
    from conftest import make_tiny

    if byte_level:
        tiny = make_tiny(family, path, vocab_size=BYTE_VOCAB, **over)
        write_byte_tokenizer(path)
        return tiny
    tiny = make_tiny(family, path, **over)
    write_tokenizer(path, tiny.ref.config.vocab_size)
    return tiny


@torch.no_grad()
def reference_tokens(model, ids: list[int], steps: int, eos: int | None = EOS) -> list[int]:
    """transformers' greedy continuation of ``ids`` (full forward per token), ending at
    (and including) the EOS id, as the server does."""
    seq, out = list(ids), []
    for _ in range(steps):
        tok = int(model(torch.tensor([seq])).logits[0, -1].argmax())
        out.append(tok)
        if tok == eos:
            break
        seq.append(tok)
    return out


# ---- the real process ------------------------------------------------------------------------

READY = re.compile(r"^READY .*serving (http://\S+)$")


class Server:
    """``moefit serve MODEL ARGS --host 127.0.0.1 --port 0`` in a child process.

    ``start()`` waits (bounded) for READY or for the process to end; ``stop()`` always
    ends it. ``lines`` holds stdout, ``stderr`` what was written there.
    """

    def __init__(self, model: Path, *args: str, env: dict | None = None, log: Path):
        self.cmd = [sys.executable, "-m", "moefit", "serve", str(model), *args,
                    "--host", "127.0.0.1", "--port", "0", "--log-level", "warning"]
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        self.log = log
        self.lines: list[str] = []
        self.url: str | None = None
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120.0) -> "Server":
        self._err = open(self.log, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=self._err,
                                     stdin=subprocess.DEVNULL, text=True, env=self.env)
        q: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, args=(q,), daemon=True).start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = q.get(timeout=0.2)
            except queue.Empty:
                continue
            if line is None:          # stdout closed: the process ended
                self.proc.wait(timeout=10)
                return self
            m = READY.match(line)
            if m:
                self.url = m.group(1)
                return self
        raise TimeoutError(f"no READY within {timeout} s:\n" + self.output)

    def _pump(self, q: queue.Queue) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            q.put(self.lines[-1])
        q.put(None)

    @property
    def stdout(self) -> str:
        return "\n".join(self.lines)

    @property
    def stderr(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    @property
    def output(self) -> str:
        return self.stdout + "\n" + self.stderr

    def wait(self, timeout: float = 60.0) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if getattr(self, "_err", None):
            self._err.close()

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- HTTP ------------------------------------------------------------------------------
    def request(self, method: str, path: str, body: dict | None = None,
                timeout: float = 60.0) -> tuple[int, dict | str]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                status, raw, ctype = r.status, r.read().decode(), r.headers.get("content-type", "")
        except urllib.error.HTTPError as e:
            status, raw, ctype = e.code, e.read().decode(), e.headers.get("content-type", "")
        return status, (json.loads(raw) if "json" in ctype else raw)

    def post(self, path: str, body: dict, timeout: float = 60.0):
        return self.request("POST", path, body, timeout)

    def get(self, path: str, timeout: float = 30.0):
        return self.request("GET", path, None, timeout)


# ---- the server in-process ------------------------------------------------------------------

def served_parts(d: Path, max_context: int, chunk: int | None = None, byte_level: bool = False,
                 **plan_kw):
    """``(d, plan, tokenizer, engine)``: a servable checkpoint written into ``d`` (``byte_level``:
    :func:`make_servable`'s), its plan (``plan_kw``: the plan's request, e.g. ``slots``) and a
    started engine (``chunk``: its prefill chunk); :func:`state_of` makes server states of it."""
    from conftest import plan_for
    from moefit.runtime.engine import Engine, EngineOptions
    from moefit.serve.text import Tokenizer

    tiny = make_servable(d, byte_level=byte_level, max_position_embeddings=1024)
    plan = plan_for(tiny, max_context=max_context, **plan_kw)
    engine = Engine.start(d, plan, EngineOptions(progress=False, chunk=chunk))
    return d, plan, Tokenizer.from_dir(d), engine


def state_of(parts, engine=None, **kw):
    """A :class:`~moefit.serve.app.ServerState` over :func:`served_parts`' ``parts``
    (``engine``: another engine, e.g. a :class:`Slow` one; ``kw``: the state's fields)."""
    from moefit.serve.app import ServerState
    from moefit.serve.text import GenerationDefaults

    d, plan, tok, eng = parts
    st = ServerState(plan=plan, model_name="tiny", tokenizer=tok,
                     defaults=GenerationDefaults.from_dir(d, tok), **kw)
    st.engine = engine or eng
    return st


def served_state(d: Path, max_context: int, **plan_kw):
    """A :class:`~moefit.serve.app.ServerState` with a started engine for a servable
    checkpoint written into ``d`` (``plan_kw``: the plan's request, e.g. ``slots``;
    ``chunk``: the engine's prefill chunk)."""
    return state_of(served_parts(d, max_context, **plan_kw))


class Running:
    """``make_server(state)`` (as ``moefit serve`` runs it) on a thread, on a free loopback
    port; leaving it stops the server and sets ``state.stopping``."""

    def __init__(self, state):
        from moefit.serve.launch import _bind, make_server

        self.state = state
        self.server = make_server(state, log_level="warning")
        self.sock = _bind("127.0.0.1", 0)            # the listening socket moefit serve makes
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.state.stopping.set()


class Slow:
    """The engine with a delay per batched step, counting the steps (``decodes``) and
    recording their sizes (``steps``: ``[(slot, tokens), ...]`` per step)."""

    def __init__(self, engine, delay: float):
        self.engine, self.delay, self.steps, self.decodes = engine, delay, [], 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def step(self, parts):
        self.decodes += 1
        self.steps.append([(slot, len(ids)) for slot, ids in parts])
        time.sleep(self.delay)
        return self.engine.step(parts)
