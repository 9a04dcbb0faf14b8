"""What the server's routes read: :class:`ServerState` (the plan, the tokenizer, the
engine once READY, the limits, the scheduler of the current engine)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from moefit.serve.scheduler import Scheduler
from moefit.serve.text import GenerationDefaults, Tokenizer

#: Default ``--max-body`` (bytes): far above any real prompt within a context.
MAX_BODY = 4 << 20
#: Default ``--max-queue`` per slot: jobs that may wait, ``QUEUE_PER_SLOT x slots``.
QUEUE_PER_SLOT = 4
#: Default ``--write-timeout`` (seconds) a stream waits for its reader to take a chunk.
WRITE_TIMEOUT_S = 30.0


@dataclass
class ServerState:
    """What the routes read. ``engine`` is None until READY."""

    plan: Any
    model_name: str
    tokenizer: Tokenizer | None
    defaults: GenerationDefaults
    engine: Any = None
    stopping: threading.Event = field(default_factory=threading.Event)   # set on shutdown
    created: int = field(default_factory=lambda: int(time.time()))
    max_queue: int | None = None           # None: QUEUE_PER_SLOT x slots
    max_body: int = MAX_BODY
    write_timeout: float = WRITE_TIMEOUT_S
    api_key: str | None = None
    loopback_only: bool = False            # Host and Content-Type checks (Guard)
    cors_origins: tuple[str, ...] = ()     # --cors-origin: pages that may call the API
    metrics: Any = None                    # moefit.serve.metrics.Metrics, made by create_app
    _scheduler: Scheduler | None = None
    _tokenize: Any = None                  # anyio.CapacityLimiter, made on first use

    def scheduler(self) -> Scheduler:
        """The scheduler of the current engine (started on first use, and again when
        the engine was replaced)."""
        sch = self._scheduler
        if sch is not None and sch.failed is not None:
            return sch              # dead: it refuses every job (EngineFailed), /health is 503
        if sch is None or sch.engine is not self.engine or not sch.alive:
            if sch is not None:
                sch.stop()
            slots = self.plan.request.slots
            sch = Scheduler(self.engine, self.max_queue or QUEUE_PER_SLOT * slots,
                            observe=self.metrics.observe if self.metrics else None,
                            stopping=self.stopping)
            self._scheduler = sch
        return sch
