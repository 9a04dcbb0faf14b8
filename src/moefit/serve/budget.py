"""``GET /v1/budget``: the plan and, once READY, every ledger's lines, the KV cells in use
per slot, the shared KV pool (``kv_pool``) and the expert cache's hit rates."""

from __future__ import annotations

from typing import Any

from moefit.memory.kv import POOL_BLOCK
from moefit.plan.report import plan_document

from moefit.serve.state import ServerState


def ledger_doc(ledger) -> dict:
    """One ledger as ``/v1/budget`` shows it: the capacity the plan states (a card's total,
    the host's ``MemTotal``: the plan document's ``capacity_bytes``), the free bytes the plan
    was solved with, which the ledger enforces (``limit_bytes``: the plan's ``free_bytes``),
    free now, the margin, and per line its planned / allocated / peak bytes."""
    return {
        "device": ledger.label, "capacity_bytes": getattr(ledger, "total", ledger.capacity),
        "limit_bytes": ledger.capacity,
        "free_bytes": ledger.free_bytes() if ledger.capacity is not None else None,
        "margin_bytes": ledger.margin,
        "lines": [{"key": r["key"], "label": r["label"], "planned": r["planned"],
                   "allocated": r["allocated"], "peak": r["peak"], "used_peak": r["used_peak"]}
                  for r in ledger.rows()],
    }


def kv_pool_figures(state: ServerState) -> dict | None:
    """The shared KV pool as ``/v1/budget``'s ``kv_pool`` and ``/metrics`` show it
    (:meth:`moefit.serve.scheduler.Scheduler.pool_figures`; before the scheduler runs, the
    plan's pool with nothing used); None without ``--kv-pool``."""
    cells = state.plan.pool_cells
    if cells is None:
        return None
    sch = state._scheduler
    if sch is not None:
        return sch.pool_figures()
    return {"cells": cells, "used": 0, "reserved": 0, "tokens": 0,
            "slots": state.plan.request.slots, "context": state.plan.context,
            "block": POOL_BLOCK, "waiting": 0}


def budget_document(state: ServerState, private: bool = False) -> dict:
    """The plan, and once READY the ledger per line of every device (``ledger``: the main
    one, ``ledgers``: all, in the plan's order), the host ledger (``host_ledger``), the KV
    cells in use per slot, the shared KV pool (``kv_pool``: :func:`kv_pool_figures`, null
    without one) and the expert cache's hit rates. ``private`` false (a server
    without ``--api-key``): the model's local path (``plan.model.source``) is left out."""
    plan = plan_document(state.plan)
    if not private and isinstance(plan.get("model"), dict) and "source" in plan["model"]:
        plan["model"] = {k: v for k, v in plan["model"].items() if k != "source"}
    doc: dict[str, Any] = {"ready": state.engine is not None, "plan": plan}
    eng = state.engine
    if eng is None:
        return doc
    ledgers = [ledger_doc(lg) for lg in getattr(eng, "ledgers", [eng.ledger])]
    doc["ledger"] = ledgers[0]
    doc["ledgers"] = ledgers
    host = getattr(eng, "host", None)
    doc["host_ledger"] = ledger_doc(host) if host is not None else None
    doc["chunk"] = eng.chunk
    sch = state._scheduler
    cells = sch.cells_in_use() if sch is not None else [0] * state.plan.request.slots
    doc["slots"] = {"total": len(cells), "busy": sum(c > 0 for c in cells),
                    "queued": sch.queue_length() if sch is not None else 0,
                    "kv_cells_per_slot": state.plan.context, "kv_cells_in_use": cells,
                    "kv_cells_peak": list(sch.peak_cells) if sch is not None else [0] * len(cells)}
    doc["kv_pool"] = kv_pool_figures(state)
    doc["notes"] = [n for n in eng.notes if n != "READY"]
    stats = eng.expert_stats()
    layers = []
    for layer, s in sorted(stats["layers"].items()):
        seen = s["hits"] + s["misses"]
        layers.append({"layer": int(layer), "slots": s["slots"], "resident": s["resident"],
                       "hits": s["hits"], "misses": s["misses"],
                       "hit_rate": s["hits"] / seen if seen else 0.0})
    doc["experts"] = {"slots": sum(l["slots"] for l in layers),
                      "total": state.plan.total_experts, "hits": stats["hits"],
                      "misses": stats["misses"], "hit_rate": stats["hit_rate"], "layers": layers}
    return doc
