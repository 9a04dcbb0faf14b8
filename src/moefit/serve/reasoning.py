"""A thinking model's reasoning kept out of the answer: ``<think>...</think>`` before the
content (Qwen3, Qwen3.5, DeepSeek-R1, GLM-4.5) goes to the message's ``reasoning_content``
(vLLM's ``qwen3`` / ``deepseek_r1`` reasoning parsers and llama-server's default
``--reasoning-format deepseek`` return it there), so neither the client's content nor the
tool-call parser (:mod:`moefit.serve.tools`) sees it.

It applies to a chat whose template is a thinking one (:func:`thinks`: it writes
``</think>``). The reasoning is the text up to the first ``</think>``, without a leading
``<think>`` (a template whose generation prompt already opened the block, as Qwen3-2507's
thinking models do, makes the model start inside it: :class:`ReasoningSplit` ``inside``); an
output that does not begin with ``<think>`` and was not begun inside one is all content
(``enable_thinking: false``), and a block cut by ``max_tokens`` is all reasoning. The same
splitter serves a stream (deltas as they come) and a whole output, so both give the same
``reasoning_content`` and ``content``.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def thinks(template: str | None) -> bool:
    """The chat template writes reasoning blocks (``</think>``)."""
    return bool(template) and CLOSE in template


def begins_inside(prompt_text: str) -> bool:
    """The prompt (decoded) ends inside an open ``<think>`` block: the generation prompt
    opened it, and the output starts with reasoning."""
    tail = prompt_text.rstrip()
    return tail.endswith(OPEN)


def _held(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` may be the start of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ReasoningSplit:
    """Text deltas -> ``(reasoning, content)`` deltas (module docstring); :meth:`finish`
    gives what was held back (a possible start of a tag)."""

    def __init__(self, inside: bool = False):
        self.state = "inside" if inside else "start"
        self.buf = ""

    def push(self, delta: str) -> tuple[str, str]:
        self.buf += delta
        reasoning = content = ""
        while True:
            if self.state == "start":
                head = self.buf.lstrip()
                if head.startswith(OPEN):
                    self.buf, self.state = head[len(OPEN):], "inside"
                    continue
                if OPEN.startswith(head):              # blanks or a part of <think>: wait
                    return reasoning, content
                self.state = "content"
                continue
            if self.state == "inside":
                end = self.buf.find(CLOSE)
                if end < 0:
                    keep = _held(self.buf, CLOSE)
                    reasoning += self.buf[:len(self.buf) - keep]
                    self.buf = self.buf[len(self.buf) - keep:]
                    return reasoning, content
                reasoning += self.buf[:end]
                self.buf, self.state = self.buf[end + len(CLOSE):], "after"
                continue
            if self.state == "after":                  # the blank lines after </think>
                stripped = self.buf.lstrip()
                if not stripped:
                    return reasoning, content
                self.buf, self.state = stripped, "content"
                continue
            content += self.buf
            self.buf = ""
            return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is held at the end: inside a block it is reasoning, else content."""
        rest, self.buf = self.buf, ""
        if self.state == "inside":
            return rest, ""
        return ("", rest) if self.state in ("start", "content") else ("", "")


def split(text: str, inside: bool = False) -> tuple[str | None, str]:
    """``(reasoning_content or None, content)`` of a whole output ``text``."""
    s = ReasoningSplit(inside)
    r1, c1 = s.push(text)
    r2, c2 = s.finish()
    reasoning = (r1 + r2).strip()
    return (reasoning or None), c1 + c2
