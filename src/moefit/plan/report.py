"""Print a plan: the table of docs/design.md, output, the decisions, and the ``moefit.plan/1`` JSON.

JSON document (sizes are integer bytes, lengths integer tokens)::

    {
      "schema": "moefit.plan/1",
      "fits": true,
      "model": {"name", "model_type", "total_params", "active_params", "source"},
      "context": 524288, "slots": 1, "kv": "int8",
      "devices": [{"name", "kind", "capacity_bytes", "free_bytes",
                   "lines": [{"key", "bytes", "detail"}, ...],   # commit order
                   "unassigned_bytes"}],
      "prefill": {"requested", "selected", "clamped", "mode", "strict"},
      "experts": {"slots", "total", "slot_bytes", "per_layer": [{"layer", "slots"}]},
      "notes": [...],
      # only when fits is false:
      "shortfall_bytes", "limiting": [...], "alternatives": [{"flag", "value"}]
    }
"""

from __future__ import annotations

import json

from moefit.memory.weights import expert_slot_bytes
from moefit.ingest.resolve import format_params
from moefit.plan.solver import LINE_ORDER, Plan
from moefit.units import size_format

SCHEMA = "moefit.plan/1"
LABELS = dict(LINE_ORDER)


def format_table(plan: Plan) -> str:
    """The human report: model line, one budget table per device, decisions."""
    g = plan.geometry
    out = [f"model  {g.name}  {format_params(g.total_params)} total / "
           f"{format_params(g.active_params)} active  {g.num_layers} layers, "
           f"{g.attention_layout()}"]
    for d in plan.devices:
        dev = d.device
        format_gib = size_format(dev.capacity_bytes)
        out.append(f"VRAM budget  {dev.label}  {dev.description}  "
                   f"{format_gib(dev.free_bytes)} free of {format_gib(dev.capacity_bytes)}")
        for line in d.lines:
            out.append(f"  {LABELS[line.key]:<18} {format_gib(line.bytes):>10}   {line.detail}".rstrip())
        unassigned = d.unassigned_bytes
        if unassigned >= 0:
            out.append(f"  {'unassigned':<18} {format_gib(unassigned):>10}")
    if plan.fits:
        if plan.request.prefill_mode == "auto" and not plan.prefill_clamped:
            out.append(f"prefill: auto, {plan.prefill_selected}-token chunks")
        for n in plan.notes:
            out.append(n)
        return "\n".join(out)
    for n in plan.notes:
        out.append(n)
    short = size_format(plan.devices[0].device.capacity_bytes)(plan.shortfall_bytes)
    out.append(f"does not fit: short by {short}")
    out.append("limiting: " + ", ".join(LABELS[k] for k in plan.limiting))
    if plan.alternatives:
        out.append("fits with:")
        for a in plan.alternatives:
            out.append(f"  {a.flag} {a.value}")
    else:
        out.append("fits with: nothing short of a larger device "
                   "(no single flag change makes it fit)")
    return "\n".join(out)


def plan_document(plan: Plan) -> dict:
    """The plan as a ``moefit.plan/1`` JSON-ready dict."""
    g, r = plan.geometry, plan.request
    doc = {
        "schema": SCHEMA,
        "fits": plan.fits,
        "model": {"name": g.name, "model_type": g.model_type,
                  "total_params": g.total_params, "active_params": g.active_params,
                  "source": g.source},
        "context": plan.context,
        "slots": r.slots,
        "kv": r.kv.lower(),
        "devices": [{
            "name": d.device.label,
            "description": d.device.description,
            "kind": d.device.kind,
            "capacity_bytes": d.device.capacity_bytes,
            "free_bytes": d.device.free_bytes,
            "lines": [{"key": l.key, "bytes": l.bytes, "detail": l.detail} for l in d.lines],
            "unassigned_bytes": d.unassigned_bytes,
        } for d in plan.devices],
        "prefill": {"requested": plan.prefill_requested, "selected": plan.prefill_selected,
                    "clamped": plan.prefill_clamped, "mode": r.prefill_mode,
                    "strict": r.strict},
        "experts": {"slots": plan.expert_slots, "total": plan.total_experts,
                    "slot_bytes": expert_slot_bytes(g),
                    "per_layer": [{"layer": i, "slots": n} for i, n in plan.experts_per_layer]},
        "notes": list(plan.notes),
    }
    if not plan.fits:
        doc["shortfall_bytes"] = plan.shortfall_bytes
        doc["limiting"] = list(plan.limiting)
        doc["alternatives"] = [{"flag": a.flag, "value": a.value} for a in plan.alternatives]
    return doc


def format_json(plan: Plan) -> str:
    return json.dumps(plan_document(plan), indent=2)
