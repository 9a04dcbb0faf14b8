"""One request's jobs in the scheduler (:class:`Run`) and the way their events come back
from the engine thread to the event loop (:class:`Mailbox`)."""

from __future__ import annotations

import asyncio
import threading

from fastapi import Request

from moefit.errors import InputError
from moefit.serve.generation import Completion, Decoding, Params, Step
from moefit.serve.guard import APIError
from moefit.serve.scheduler import EngineFailed, Ended, Job, QueueFull, Stopping

from moefit.serve.state import ServerState

#: Seconds a full queue asks a client to wait (``Retry-After``).
RETRY_AFTER_S = 1

#: Seconds between two ``Request.is_disconnected`` polls while a request waits.
DISCONNECT_POLL_S = 0.05


class Mailbox:
    """Events from the engine thread to the event loop. The engine thread appends under a
    lock and never blocks; the first event after a delivery wakes the loop once
    (``loop.call_soon_threadsafe``), so the tokens of every busy slot of one step cost one
    wake-up, not one each (each wake-up is a write to the loop's self-pipe and a GIL
    hand-over between the two threads: a third of the engine thread's time went there
    with one wake-up per token). The loop then hands each :class:`Run` its events
    (:meth:`Run.put`)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.items: list = []
        self.lock = threading.Lock()
        self.armed = False

    def post(self, run: "Run", item) -> None:
        """Queue ``item`` for ``run`` (engine thread)."""
        with self.lock:
            self.items.append((run, item))
            if self.armed:
                return
            self.armed = True
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:     # the loop is closed: nobody is listening
            pass

    def _deliver(self) -> None:
        with self.lock:
            items, self.items, self.armed = self.items, [], False
        for run, item in items:
            run.put(item)


_MAILBOXES: "dict[asyncio.AbstractEventLoop, Mailbox]" = {}


def _mailbox(loop: asyncio.AbstractEventLoop) -> Mailbox:
    box = _MAILBOXES.get(loop)
    if box is None:
        for old in [k for k in _MAILBOXES if k.is_closed()]:
            del _MAILBOXES[old]
        box = _MAILBOXES[loop] = Mailbox(loop)
    return box


class Run:
    """The jobs of one request in the scheduler, and the inbox their events come back to:
    ``(index, Step | Ended | Exception)``, through the loop's :class:`Mailbox` (a list and
    one future to wake the reader, not an ``asyncio.Queue``: no put / get per event).
    Submitting raises APIError 503 when the wait queue is full or the server is
    stopping."""

    def __init__(self, state: ServerState, jobs, params: Params, reuse: bool = True):
        self.loop = asyncio.get_running_loop()
        box = _mailbox(self.loop)
        self.inbox: list = []       # events delivered, not yet taken
        self.waiter: asyncio.Future | None = None    # set while a reader waits for one
        self.scheduler = state.scheduler()
        context, vocab = state.plan.context, state.plan.geometry.vocab_size

        def emitter(index: int):
            def emit(event) -> None:     # engine thread: never blocks
                box.post(self, (index, event))
            return emit

        self.jobs = [Job(list(ids), Decoding(ids, params, state.tokenizer, context, vocab,
                                             params.generator(index)), emitter(index),
                         reuse=reuse)
                     for index, ids in jobs]
        self.indices = [index for index, _ in jobs]
        self.pending = len(self.jobs)
        try:
            self.scheduler.submit(self.jobs)
        except QueueFull as e:
            state.metrics.refused()
            raise APIError(503, f"the server is busy: {e}; retry later", "service_unavailable",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except (Stopping, EngineFailed) as e:
            raise APIError(503, str(e), "service_unavailable") from None

    def cached_tokens(self, n: int) -> int:
        """Prompt tokens reused from a slot's cells (``usage.prompt_tokens_details``), once
        per prompt: the most any of its ``n`` choices' jobs reused (jobs are indexed
        ``prompt x n + choice``). Read once the jobs were admitted."""
        best: dict[int, int] = {}
        for index, job in zip(self.indices, self.jobs):
            best[index // n] = max(best.get(index // n, 0), job.cached)
        return sum(best.values())

    def cancel(self) -> None:
        self.scheduler.cancel(self.jobs)

    def put(self, item) -> None:
        """Deliver ``(index, event)`` (event loop; :class:`Mailbox`), waking the reader."""
        self.inbox.append(item)
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def _wait(self) -> None:
        while not self.inbox:
            self.waiter = self.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None

    async def next(self):
        """The next event; ``pending`` counts the jobs not yet ended."""
        if not self.inbox:
            await self._wait()
        return self._count(self.inbox.pop(0))

    async def batch(self) -> list:
        """The next event and every one already delivered behind it, up to the last job's
        end (a stream writes them in one go)."""
        if not self.inbox:
            await self._wait()
        out, take = [], 0
        for item in self.inbox:
            out.append(self._count(item))
            take += 1
            if not self.pending:
                break
        del self.inbox[:take]
        return out

    def _count(self, item):
        index, ev = item
        if not isinstance(ev, Step) or ev.finish_reason is not None:
            self.pending -= 1
        return index, ev

    async def collect(self, request: Request) -> list[Completion]:
        """Every job's completion, in job order; cancels them when the client goes away.
        Engine errors become APIError 500 (400 for an InputError)."""
        out = {i: Completion() for i in range(len(self.jobs))}
        order = {index: i for i, index in enumerate(self.indices)}
        parts: dict[int, list[str]] = {i: [] for i in out}
        async def watch():      # a client gone: its jobs end (Ended) and free their slots
            while not await request.is_disconnected():
                await asyncio.sleep(DISCONNECT_POLL_S)
            self.cancel()

        watcher = asyncio.create_task(watch())
        try:
            while self.pending:
                index, ev = await self.next()
                res, i = out[order[index]], order[index]
                if isinstance(ev, Exception):
                    if isinstance(ev, InputError):
                        raise APIError(400, str(ev)) from None
                    raise APIError(500, f"generation failed: {type(ev).__name__}: {ev}",
                                   "server_error") from None
                if isinstance(ev, Ended):
                    res.finish_reason = ev.finish_reason
                    continue
                res.token_ids.append(ev.token)
                res.steps.append(ev)
                parts[i].append(ev.text)
                if ev.finish_reason is not None:
                    res.finish_reason = ev.finish_reason
        finally:
            watcher.cancel()
            self.cancel()
        for i, res in out.items():
            res.text = "".join(parts[i])
        return [out[i] for i in range(len(self.jobs))]

def usage_counts(prompts: list[list[int]], completion_tokens: int, cached_tokens: int) -> dict:
    """A response's ``usage``: OpenAI's counts, with ``prompt_tokens_details.cached_tokens``
    the prompt tokens whose KV cells a slot already held (prompt reuse: not run)."""
    p = sum(len(ids) for ids in prompts)
    return {"prompt_tokens": p, "completion_tokens": completion_tokens,
            "total_tokens": p + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def usage(prompts: list[list[int]], results: list[Completion], cached_tokens: int) -> dict:
    """:func:`usage_counts` of a finished request's ``results``."""
    return usage_counts(prompts, sum(len(r.token_ids) for r in results), cached_tokens)
