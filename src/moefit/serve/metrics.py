"""``GET /metrics``: the server's state in Prometheus text format (prometheus_client).

Every metric is named ``moefit_*``:

- ``moefit_requests_total{outcome}``: sequences by how they ended (``stop``, ``length``:
  their finish reason; ``abort``: cancelled, by a client gone, a stalled stream or the
  server stopping; ``error``: the engine failed) and requests refused with 503
  (``refused``);
- ``moefit_prompt_tokens_total``, ``moefit_generation_tokens_total``: tokens run;
- ``moefit_prompt_tokens_cached_total``: prompt tokens a slot's cells already held (prompt
  reuse), not run (nor counted in ``moefit_prompt_tokens_total``);
- ``moefit_queue_length``, ``moefit_slots_busy``, ``moefit_slots``: the scheduler;
- ``moefit_kv_cells_in_use{slot}``: tokens held in each slot's KV cache;
- ``moefit_kv_pool_cells``, ``moefit_kv_pool_used_cells``, ``moefit_kv_pool_reserved_cells``:
  the shared KV pool (``--kv-pool``; only with one): its cells, those a slot holds, those
  running jobs reserved;
- ``moefit_expert_hit_rate``: expert-cache hits / lookups since start;
- ``moefit_miss_layer_steps_total{path}``: with ``--miss-policy auto``, the MoE layer steps
  whose misses ran on the host (``host``) or were copied through the weight arena (``copy``);
- ``moefit_budget_bytes{line, kind}``: each budget line's planned / allocated / peak bytes
  (the main device's ledger, :mod:`moefit.runtime.buffers.ledger`);
- ``moefit_ledger_bytes{ledger, line, kind}``: the same for every device's ledger
  (``cuda:1``, ``cpu:1``) and the host ledger (``host``);
- ``moefit_time_to_first_token_seconds``, ``moefit_inter_token_latency_seconds``:
  histograms, observed by the scheduler's engine thread.

The gauges are read from the server state at scrape time, so they cost nothing between
scrapes. Each server state has its own registry (no process-global metrics).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.responses import Response

from moefit.serve.budget import kv_pool_figures

#: The finish reasons ``moefit_requests_total`` shows from the start (0 until one happens):
#: a sequence's own (``stop``, ``length``) and ``abort`` (cancelled: the client went away,
#: its stream stalled, or the server stopped).
OUTCOMES = ("stop", "length", "abort")

#: Histogram buckets (seconds) of the time to first token and the inter-token latency.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class Metrics:
    """The registry of one server state (``moefit.serve.state.ServerState``)."""

    def __init__(self, state):
        self.state = state
        self.registry = CollectorRegistry(auto_describe=True)
        self.ttft = Histogram("moefit_time_to_first_token_seconds",
                              "Seconds from a sequence's submission to its first token",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("moefit_inter_token_latency_seconds",
                             "Seconds between two tokens of one sequence",
                             buckets=ITL_BUCKETS, registry=self.registry)
        self.refused_requests = 0       # answered 503: the wait queue was full
        self.registry.register(_StateCollector(self))

    def observe(self, what: str, job, seconds: float) -> None:
        """The scheduler's callback (engine thread): ``"ttft"`` or ``"itl"``."""
        (self.ttft if what == "ttft" else self.itl).observe(seconds)

    def refused(self) -> None:
        """Count a request answered 503 (event loop)."""
        self.refused_requests += 1

    def text(self) -> bytes:
        return generate_latest(self.registry)

    def response(self) -> Response:
        return Response(self.text(), media_type=CONTENT_TYPE_LATEST)


class _StateCollector:
    """The gauges and counters read from the server state at scrape time."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        state = self.metrics.state
        sch = state._scheduler
        stats = sch.stats if sch is not None else None
        req = CounterMetricFamily("moefit_requests", "Sequences by outcome, and refused requests",
                                  labels=["outcome"])
        finished = {**dict.fromkeys(OUTCOMES, 0), **(stats.finished if stats else {})}
        for reason, n in sorted(finished.items()):      # every outcome from the start
            req.add_metric([reason], n)
        req.add_metric(["error"], stats.errors if stats else 0)
        req.add_metric(["refused"], self.metrics.refused_requests)
        yield req
        yield CounterMetricFamily("moefit_prompt_tokens", "Prompt tokens run",
                                  value=stats.prompt_tokens if stats else 0)
        yield CounterMetricFamily("moefit_prompt_tokens_cached", "Prompt tokens whose KV cells "
                                  "a slot already held (reused, not run)",
                                  value=stats.cached_prompt_tokens if stats else 0)
        yield CounterMetricFamily("moefit_generation_tokens", "Tokens generated",
                                  value=stats.generated_tokens if stats else 0)
        slots = state.plan.request.slots
        yield GaugeMetricFamily("moefit_slots", "Sequences the KV cache holds (--slots)",
                                value=slots)
        yield GaugeMetricFamily("moefit_slots_busy", "Slots holding a sequence",
                                value=sch.busy_slots() if sch else 0)
        yield GaugeMetricFamily("moefit_queue_length", "Sequences waiting for a slot",
                                value=sch.queue_length() if sch else 0)
        cells = GaugeMetricFamily("moefit_kv_cells_in_use", "Tokens held in a slot's KV cache",
                                  labels=["slot"])
        for s, n in enumerate(sch.cells_in_use() if sch else [0] * slots):
            cells.add_metric([str(s)], n)
        yield cells
        pool = kv_pool_figures(state)
        if pool is not None:
            yield GaugeMetricFamily("moefit_kv_pool_cells", "Cells of the KV pool the slots "
                                    "share (--kv-pool)", value=pool["cells"])
            yield GaugeMetricFamily("moefit_kv_pool_used_cells", "KV pool cells a slot holds "
                                    "(running or kept for prompt reuse)", value=pool["used"])
            yield GaugeMetricFamily("moefit_kv_pool_reserved_cells", "KV pool cells reserved "
                                    "by running requests", value=pool["reserved"])
        eng = state.engine
        if eng is None:
            return
        experts = eng.expert_stats()
        yield GaugeMetricFamily("moefit_expert_hit_rate", "Expert-cache hits / lookups",
                                value=experts["hit_rate"])
        paths = CounterMetricFamily("moefit_miss_layer_steps", "MoE layer steps by where "
                                    "their misses ran (--miss-policy auto)", labels=["path"])
        paths.add_metric(["host"], experts.get("host_steps", 0))
        paths.add_metric(["copy"], experts.get("copied_steps", 0))
        yield paths
        lines = GaugeMetricFamily("moefit_budget_bytes", "Budget line bytes (the ledger)",
                                  labels=["line", "kind"])
        for r in eng.ledger.rows():
            for kind in ("planned", "allocated", "peak"):
                lines.add_metric([r["key"], kind], r[kind])
        yield lines
        every = GaugeMetricFamily("moefit_ledger_bytes", "Budget line bytes of every device's "
                                  "ledger and of the host ledger", labels=["ledger", "line", "kind"])
        ledgers = list(getattr(eng, "ledgers", [eng.ledger]))
        if getattr(eng, "host", None) is not None:
            ledgers.append(eng.host)
        for lg in ledgers:
            for r in lg.rows():
                for kind in ("planned", "allocated", "peak"):
                    every.add_metric([lg.label, r["key"], kind], r[kind])
        yield every
