"""Continuous batching: the one owner of the server's sequences.

Requests become :class:`Job` s (one per prompt x choice). A job waits in a bounded queue
(``max_queue`` jobs; :class:`QueueFull` past it), is admitted to a free KV slot of the
plan (``--slots``) and keeps that slot until it finishes, is cancelled or the server
stops; then the slot is free at once for the next job.

One engine thread runs steps (:meth:`moefit.runtime.engine.Engine.step`). Each step
holds at most the plan's prefill chunk of tokens (the per-step token budget, like vLLM's
``max_num_batched_tokens``), taken in this order:

A job takes the free slot whose cells already hold the longest prefix of its prompt,
and runs only the rest (prompt reuse; :meth:`Scheduler._admit`).

With a shared KV pool (``--kv-pool``, ``KVCache.pool``) a job is admitted only when the
pool can hold its prompt plus every token it may generate (``max_tokens``, at most the
context): those blocks are reserved at admission, so a running sequence never runs out of
cells. A free slot keeps the blocks of what it holds (for prompt reuse) until a job needs
them: the idle slots holding the fewest tokens give theirs back first. A job the pool
cannot take yet waits at the head of the queue (first come, first served) until running
jobs end; a pool is at least one context (``memory.kv.pool_cells``), so every job fits once
the others are done, and the wait queue's bound (``--max-queue``: 503) is the refusal.

1. one decode token of every active sequence that has one (all of them in the same
   forward pass, so the tokens routed to one expert share one read of its weights);
2. the next piece of the prompts still being read, in admission order, with what is left
   of the budget, so a long prompt advances chunk by chunk without stalling the others.

After the step every sequence whose prompt is complete samples its next token with its
own settings and random stream (:class:`moefit.serve.generation.Decoding`).

The engine thread never waits on a client: each job's events go to its ``emit`` callable,
which must not block (the server posts them to the request's inbox on the event loop:
:class:`moefit.serve.runs.Mailbox`). Events: a :class:`~moefit.serve.generation.Step` per
token (the last one has a finish reason); :class:`Ended` when the job ends without one
(cancelled, server stopping: ``"abort"``); an ``Exception`` when the engine failed on its
step, or sampling failed on the job's logits (that job ends, its slot is reset; the
others go on, the server stays up).

Should the engine thread itself ever fail (a bug outside those two), it records why
(:attr:`Scheduler.failed`), every job it held or queued ends with an :class:`EngineFailed`
event, and :meth:`Scheduler.submit` refuses new jobs with it: the server's ``/health``
answers 503 instead of leaving every client waiting for good.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from moefit.serve.generation import Decoding, Step

#: Seconds an idle engine thread sleeps between looks at the ``stopping`` event.
IDLE_POLL_S = 0.1


class QueueFull(RuntimeError):
    """The wait queue holds ``max_queue`` jobs (the server answers 503)."""


class Stopping(RuntimeError):
    """The scheduler is shutting down and takes no more jobs."""


class EngineFailed(RuntimeError):
    """The engine thread died (a bug): the event of every job it held, and the error of
    every later :meth:`Scheduler.submit`."""


@dataclass(frozen=True)
class Ended:
    """A job ended without a finish reason of its own (``"abort"``: cancelled or the
    server stopped)."""

    finish_reason: str = "abort"


@dataclass(eq=False)
class Job:
    """One sequence: a prompt, how it samples, where its events go.

    ``emit``: called from the engine thread with each event (module docstring); must not
    block. ``slot``: its KV slot once admitted. ``fed``: prompt tokens in the KV cache.
    ``reuse``: it may keep a slot's cells of its prompt's prefix (llama-server's
    ``cache_prompt``); ``cached``: the prompt tokens it kept so.
    """

    prompt: list[int]
    decoding: Decoding
    emit: Callable[[object], None]
    slot: int | None = None
    fed: int = 0
    next_token: int | None = None
    cancelled: bool = False
    done: bool = False
    submitted: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    reuse: bool = True
    cached: int = 0


@dataclass
class Stats:
    """Counters of the scheduler (read by ``/metrics`` and ``/v1/budget``)."""

    steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    finished: Counter = field(default_factory=Counter)    # finish reason -> jobs
    errors: int = 0
    cached_prompt_tokens: int = 0      # prompt tokens whose cells were reused, not run


class Scheduler:
    """Runs ``engine``'s slots as a continuous batch (module docstring).

    Args:
        engine: a started :class:`~moefit.runtime.engine.Engine` (``step``, ``reset``,
            ``chunk``, ``plan``).
        max_queue: jobs that may wait for a slot (at least 1).
        observe: optional callable(event name, job, value) for metrics: ``"ttft"``
            (seconds to the first token), ``"itl"`` (seconds between tokens).
        stopping: an Event that stops the scheduler as :meth:`stop` does once set (the
            server's shutdown flag), seen within :data:`IDLE_POLL_S`.
        reuse: a job admitted to a slot keeps the cells of the prefix its prompt shares
            with what the slot holds (:meth:`_admit`; only where the KV cache can be cut
            back, ``KVCache.truncatable``).
    """

    def __init__(self, engine, max_queue: int, observe: Callable | None = None,
                 stopping: threading.Event | None = None, reuse: bool = True):
        self.engine = engine
        self.stopping = stopping or threading.Event()
        self.slots = engine.plan.request.slots
        self.max_queue = max(1, int(max_queue))
        self.observe = observe or (lambda *a: None)
        self.active: list[Job | None] = [None] * self.slots
        # the tokens whose KV each slot holds, for prompt reuse (when the cache can be cut
        # back: kv.truncatable)
        self.reuse = reuse and engine.model.kv.truncatable
        self.held: list[list[int]] = [[] for _ in range(self.slots)]
        self.peak_cells = [0] * self.slots     # most KV cells each slot has held
        self.waiting: deque[Job] = deque()
        self.stats = Stats()
        self._cv = threading.Condition()
        self._stopping = False
        self.failed: EngineFailed | None = None     # set when the engine thread died
        self._thread = threading.Thread(target=self._run, name="moefit-engine", daemon=True)
        self._thread.start()

    # ---- client side (event loop) ------------------------------------------------------------
    def submit(self, jobs: Sequence[Job]) -> None:
        """Queue ``jobs`` (all or none). Raises QueueFull when more than ``max_queue``
        jobs would wait beyond the free slots (an empty queue takes any request, so one
        with more choices than ``max_queue`` is not refused forever), Stopping once
        :meth:`stop` was called."""
        with self._cv:
            if self.failed is not None:
                raise self.failed
            if self.is_stopping():
                raise Stopping("the server is shutting down")
            free = self.active.count(None)
            if self.waiting and len(self.waiting) + len(jobs) > self.max_queue + free:
                raise QueueFull(f"{len(self.waiting)} sequences wait for one of {self.slots} "
                                f"slots (--max-queue {self.max_queue})")
            self.waiting.extend(jobs)
            self._cv.notify()

    def cancel(self, jobs: Sequence[Job]) -> None:
        """Drop ``jobs``: a waiting job leaves the queue (it cost nothing), an active one
        frees its slot before the next step."""
        with self._cv:
            for job in jobs:
                if job.done:
                    continue
                job.cancelled = True
                if job.slot is None:      # still waiting: it cost nothing
                    try:
                        self.waiting.remove(job)
                    except ValueError:
                        pass
                    job.done = True
                    self._ended(job)
            self._cv.notify()

    def stop(self, timeout: float | None = None) -> None:
        """End every job (``Ended("abort")``) after the step in flight, take no more, and
        stop the engine thread; waits up to ``timeout`` seconds for it when given."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if timeout is not None and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def is_stopping(self) -> bool:
        return self._stopping or self.stopping.is_set()

    @property
    def alive(self) -> bool:
        """The engine thread runs (not stopped)."""
        return self._thread.is_alive() and not self.is_stopping()

    # ---- reports --------------------------------------------------------------------------
    def queue_length(self) -> int:
        return len(self.waiting)

    def busy_slots(self) -> int:
        return sum(j is not None for j in self.active)

    def pool_figures(self) -> dict | None:
        """The shared KV pool (None without one): ``cells`` in all, ``used`` (held by a
        slot: reserved by a running job or kept by an idle one for prompt reuse),
        ``reserved`` (held by running jobs), ``tokens`` (positions written in them),
        ``slots``, ``context`` (most tokens of one sequence), ``block`` (cells per block),
        ``waiting`` (jobs queued behind the pool, not behind a slot)."""
        pool = self.engine.model.kv.pool
        if pool is None:
            return None
        lengths = self.engine.model.kv.lengths
        running = [s for s in range(self.slots) if self.active[s] is not None]
        return {"cells": pool.cells, "used": pool.used_cells(),
                "reserved": sum(len(pool.owned[s]) for s in running) * pool.block,
                "tokens": sum(lengths[s] for s in running), "slots": self.slots,
                "context": pool.context, "block": pool.block,
                "waiting": len(self.waiting) if None in self.active else 0}

    def cells_in_use(self) -> list[int]:
        """KV cells in use per slot (tokens held; 0 for a free slot)."""
        lengths = self.engine.model.kv.lengths
        return [lengths[s] if self.active[s] is not None else 0 for s in range(self.slots)]

    # ---- engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            # once for the thread, not per step (Engine.step enters it unless in it already)
            with torch.inference_mode():
                self._loop()
        except BaseException as e:     # a bug: end every job rather than leave it waiting
            failed = EngineFailed(f"the engine thread failed ({type(e).__name__}: {e}); "
                                  "restart the server")
            with self._cv:
                self.failed = failed
                for job in [*self.active, *self.waiting]:
                    if job is not None and not job.done:
                        self._free(job)
                        self.stats.errors += 1
                        job.emit(failed)
                self.waiting.clear()
            logging.getLogger("uvicorn.error").exception("moefit: %s", failed)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self.is_stopping() and not self.waiting and not any(self.active):
                    self._cv.wait(IDLE_POLL_S)
                if self.is_stopping():
                    self._end_all()
                    return
                self._retire_cancelled()
                self._admit()
                parts, jobs = self._plan_step()
            if parts:
                self._step(parts, jobs)

    def _admit(self) -> None:
        """Give waiting jobs free slots, first come first served; each takes the free slot
        whose cached tokens share the longest prefix with its prompt, and keeps those
        cells (prompt reuse: llama-server's ``cache_prompt``), all but the prompt's last
        token, whose logits the first step needs; without one, the free slot that holds
        the fewest tokens."""
        while self.waiting and None in self.active:
            job = self.waiting[0]
            free = [s for s in range(self.slots) if self.active[s] is None]
            # without a shared prefix: the slot holding least (an empty one), so that the
            # cells worth reusing stay
            best, keep = min(free, key=lambda s: len(self.held[s])), 0
            if self.reuse and job.reuse:
                for s in free:
                    n = _shared(self.held[s], job.prompt, len(job.prompt) - 1)
                    if n > keep:
                        best, keep = s, n
            if not self._reserve(job, best, keep, free):
                return                  # the pool cannot take it yet: it waits, first in line
            self.waiting.popleft()
            job.slot = best
            if keep:
                self.engine.model.kv.truncate(best, keep)
                del self.held[best][keep:]
                job.fed = job.cached = keep
                self.stats.cached_prompt_tokens += keep
            else:
                if self.engine.model.kv.pool is None:     # (_reserve reset a pooled one)
                    self.engine.reset(best)
                self.held[best] = []
            self.active[best] = job

    def _reserve(self, job: Job, slot: int, keep: int, free: list[int]) -> bool:
        """With a shared pool: give ``slot`` the blocks of ``job``'s prompt plus what it may
        generate (``Decoding.limit``; the context without one), taking the blocks idle slots
        keep for reuse, fewest tokens first, where the free ones do not suffice; ``keep``
        0 (no prefix reused): the slot is reset first. False, changing nothing, when even
        that is short (running jobs hold the rest)."""
        kv = self.engine.model.kv
        pool = kv.pool
        if pool is None:
            return True
        limit = getattr(job.decoding, "limit", None)
        need = pool.context if limit is None else len(job.prompt) + limit
        want = pool.blocks_for(need)
        others = sorted((s for s in free if s != slot), key=lambda s: len(self.held[s]))
        if want > len(pool.free) + len(pool.owned[slot]) + sum(len(pool.owned[s]) for s in others):
            return False
        if not keep:
            self.engine.reset(slot)
        for s in others:
            if pool.fit(slot, need):
                break
            self.engine.reset(s)        # its cells go to the pool: nothing left to reuse
            self.held[s] = []
        return pool.fit(slot, need)

    def _free(self, job: Job) -> None:
        if job.slot is not None and self.active[job.slot] is job:
            self.active[job.slot] = None
            pool = self.engine.model.kv.pool
            if pool is not None:        # keep only the blocks of what the slot holds (reuse)
                pool.fit(job.slot, len(self.held[job.slot]) if self.reuse else 0)
        job.done = True

    def _ended(self, job: Job) -> None:
        """``job`` ends without a finish reason of its own: counted as ``abort`` (with the
        finish reasons: ``/metrics``' requests by outcome), told with :class:`Ended`."""
        self.stats.finished["abort"] += 1
        job.emit(Ended())

    def _retire_cancelled(self) -> None:
        for job in self.active:
            if job is not None and job.cancelled:
                self._free(job)
                self._ended(job)

    def _end_all(self) -> None:
        for job in [*self.active, *self.waiting]:
            if job is not None and not job.done:
                self._free(job)
                self._ended(job)
        self.waiting.clear()

    def _plan_step(self) -> tuple[list, list[tuple[Job, bool]]]:
        """The step's ``(slot, ids)`` parts and their ``(job, is a decode token)``, within
        the chunk budget."""
        budget = self.engine.chunk
        parts, jobs = [], []
        live = [j for j in self.active if j is not None]
        for job in live:                       # 1. decode tokens
            if job.next_token is not None and budget > 0:
                parts.append((job.slot, [job.next_token]))
                jobs.append((job, True))
                budget -= 1
        for job in sorted(live, key=lambda j: j.submitted):    # 2. prompt pieces
            if job.fed < len(job.prompt) and budget > 0:
                piece = job.prompt[job.fed:job.fed + budget]
                parts.append((job.slot, piece))
                jobs.append((job, False))
                budget -= len(piece)
        return parts, jobs

    def _step(self, parts, jobs: list[tuple[Job, bool]]) -> None:
        try:
            logits = self.engine.step(parts)
        except Exception as e:   # the engine failed: these jobs end with the error
            with self._cv:
                self.stats.errors += 1
                for job, _ in jobs:
                    self._free(job)
                    self.held[job.slot] = []       # what its cells hold is unknown now
                    job.emit(e)
            return
        now = time.monotonic()
        lengths = self.engine.model.kv.lengths
        with self._cv:
            self.stats.steps += 1
            for slot, ids in parts:
                self.peak_cells[slot] = max(self.peak_cells[slot], lengths[slot])
                self.held[slot].extend(ids)
            for row, ((job, decode), (_, ids)) in enumerate(zip(jobs, parts)):
                if decode:
                    job.next_token = None          # the decode token is in the cache
                else:
                    job.fed += len(ids)
                    self.stats.prompt_tokens += len(ids)
                    if job.fed < len(job.prompt):
                        continue                   # the prompt is not in yet
                if job.done or job.cancelled:
                    continue
                try:
                    step: Step = job.decoding.step(logits[row])
                except Exception as e:     # this job's sampling failed: it ends, not the batch
                    self.stats.errors += 1
                    self._free(job)
                    job.emit(e)
                    continue
                self.stats.generated_tokens += 1
                if job.first_token is None:
                    job.first_token = now
                    self.observe("ttft", job, now - job.submitted)
                else:
                    self.observe("itl", job, now - job.last_token)
                job.last_token = now
                if step.finish_reason is None:
                    job.next_token = step.token
                else:
                    self.stats.finished[step.finish_reason] += 1
                    self._free(job)
                job.emit(step)


def _shared(held: list[int], prompt: list[int], most: int) -> int:
    """Length of the common prefix of ``held`` and ``prompt``, at most ``most``."""
    n = min(len(held), most)
    for i in range(n):
        if held[i] != prompt[i]:
            return i
    return n
