"""Print a plan: the table of docs/design.md, output, the decisions, and the ``moefit.plan/2`` JSON.

JSON document (sizes are integer bytes, lengths integer tokens)::

    {
      "schema": "moefit.plan/2",
      "fits": true,
      "model": {"name", "model_type", "total_params", "active_params", "source"},
      "context": 524288, "slots": 1, "kv": "int8",
      "kv_pool": {"cells", "slots", "context"},   # only with --kv-pool
      "split": "single",                          # or "experts", "layers" (several devices)
      "devices": [{"name", "description", "kind", "role", "layers",   # commit order
                   "capacity_bytes", "free_bytes",
                   "lines": [{"key", "bytes", "detail"}, ...],   # commit order
                   "unassigned_bytes", "expert_slots", "experts_per_layer"}],
      "host": {"checked", "source", "capacity_bytes", "free_bytes", "experts",
               "mapped_bytes", "embed_on_host",
               "lines": [{"key", "bytes", "detail"}, ...], "planned_bytes", "unassigned_bytes"},
      "prefill": {"requested", "selected", "clamped", "mode", "strict"},
      "experts": {"slots", "total", "slot_bytes", "per_layer": [{"layer", "slots"}],
                  # with --routing-profile: a decode step's predicted hit rate, the plan's
                  # spread (by the profile) and the same slots spread evenly
                  "predicted_hit_rate", "even_hit_rate"},
      "notes": [...],
      "speed": {"policy", "sources": [...],          # null: no figures for the device
                "miss_crossover": [{"tokens", "layers": [...]}],   # tokens per missing expert
                                   # from which copying beats the host there (null: never)
                "prefill": {"tokens_per_s", "bound", "tokens", "position", "chunk",
                            "copied_layers", "by_kind": [{"kind", "layers", "seconds", "bound"}]},
                "decode": {... the same}},
      # only when fits is false:
      "shortfall_bytes", "short_on", "limiting": [...],
      "alternatives": [{"flag", "value", "speed": {"prefill_tokens_per_s",
                        "decode_tokens_per_s"} | null[, "drop": [flag, ...]][, "note"]}]
    }

Version 2 added ``split``, each device's ``role``, ``layers``,
``expert_slots`` and ``experts_per_layer``, the ``host`` table, and ``short_on``; the
fields of version 1 keep their meaning. ``speed`` (and each alternative's) was added to
version 2 later: a reader of the older fields is not affected.
"""

from __future__ import annotations

import json
import math

from moefit.memory.weights import expert_slot_bytes
from moefit.ingest.resolve import format_params
from moefit.plan.alternatives import GGUF_REMEDY_FTYPES, gguf_remedy_applies
from moefit.plan.types import HOST_LINE_ORDER, LINE_ORDER, DevicePlan, HostPlan, Plan, format_fits_with
from moefit.units import size_format

SCHEMA = "moefit.plan/2"
LABELS = dict(LINE_ORDER)
HOST_LABELS = dict(HOST_LINE_ORDER)


def _role(d: DevicePlan, plan: Plan) -> str:
    if plan.split == "single":
        return ""
    if d.role == "experts":
        return "  left out" if d.left_out else "  expert slots only"
    if d.role == "layers":
        a, b = d.layers or (0, 0)
        span = "no layers" if a >= b else (f"layer {a}" if b - a == 1 else f"layers {a}-{b - 1}")
        return f"  {span}"
    return "  main: dense weights, KV cache, staging"


def _device_table(d: DevicePlan, plan: Plan) -> list[str]:
    dev = d.device
    format_gib = size_format(dev.capacity_bytes)
    out = [f"VRAM budget  {dev.label}  {dev.description}  "
           f"{format_gib(dev.free_bytes)} free of {format_gib(dev.capacity_bytes)}{_role(d, plan)}"]
    for line in d.lines:
        out.append(f"  {LABELS[line.key]:<18} {format_gib(line.bytes):>10}   {line.detail}".rstrip())
    unassigned = d.unassigned_bytes
    if unassigned >= 0:
        out.append(f"  {'unassigned':<18} {format_gib(unassigned):>10}")
    return out


#: The host lines the process and the machine set, whatever the model.
HOST_FIXED_LINES = ("host_runtime", "host_margin")


def host_size_format(lines):
    """The host table's formatter for ``lines`` (``(key, bytes)`` pairs): GiB (two
    decimals) when what the model puts on the host, every line but the runtime and the
    margin, is 1 GiB or more, else the largest fitting unit
    (:func:`moefit.units.format_bytes`), so a small model's lines do not all read 0.00 GiB
    (the device tables do the same by the device's size)."""
    return size_format(sum(n for k, n in lines if k not in HOST_FIXED_LINES))


def format_host_table(hp: HostPlan) -> list[str]:
    """The host table (docs/design.md, host budget)."""
    h = hp.host
    format_gib = host_size_format((l.key, l.bytes) for l in hp.lines)
    if h is None:
        out = [f"host budget  not checked (what-if devices; --host-ram SIZE checks a machine)  "
               f"needs {format_gib(hp.planned_bytes)}"]
    else:
        out = [f"host budget  {h.source}  {format_gib(h.free_bytes)} free of "
               f"{format_gib(h.capacity_bytes)}"]
    for line in hp.lines:
        out.append(f"  {HOST_LABELS[line.key]:<18} {format_gib(line.bytes):>10}   {line.detail}".rstrip())
    if h is not None and hp.unassigned_bytes >= 0:
        out.append(f"  {'unassigned':<18} {format_gib(hp.unassigned_bytes):>10}")
    return out


def _label(key: str) -> str:
    return LABELS[key] if key in LABELS else "host " + HOST_LABELS[key]


def format_rate(tokens_per_s: float) -> str:
    """Tokens per second as printed: three significant figures, no exponent."""
    x = tokens_per_s
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def format_speed(speed, context_word: str = "chunk") -> str:
    """The ``speed`` line of a plan (:class:`~moefit.plan.speed.Speed`, None: no figures)."""
    if speed is None:
        return ("speed  not predicted: no throughput figures for this device (--gpu NAME "
                "plans a catalogue card, `moefit gpus` lists them)")
    p, d = speed.prefill, speed.decode
    where = (f"{p.tokens}-token prompt in {p.chunk}-token {context_word}s" if p.position == 0 else
             f"a {p.chunk}-token {context_word} at position {p.position}")
    seq = f"{d.tokens} sequences" if d.tokens > 1 else "1 sequence"
    return (f"speed  prefill {format_rate(p.tokens_per_s)} tokens/s ({where}; bound: {p.bound}), "
            f"decode {format_rate(d.tokens_per_s)} tokens/s ({seq} at fill {d.position}; bound: "
            f"{d.bound})")


def _alt_speed(speed) -> str:
    if speed is None:
        return ""
    return (f"prefill {format_rate(speed.prefill.tokens_per_s)}, decode "
            f"{format_rate(speed.decode.tokens_per_s)} tokens/s")


def format_speed_verbose(speed, context_word: str = "chunk") -> list[str]:
    """``-v``'s speed lines: seconds per step and bound per layer kind, and the figures."""
    if speed is None:
        return []
    policy = f"--miss-policy {speed.policy}" if speed.policy in ("cpu", "copy", "auto") else speed.policy
    out = [f"speed by layer kind (seconds per step, bound; misses: {policy}):"]
    for what, pred in ((f"prefill ({pred_chunk(speed.prefill, context_word)})", speed.prefill),
                       (f"decode ({speed.decode.tokens} x 1 token)", speed.decode)):
        out.append(f"  {what}" + (f", misses copied in {pred.copied} MoE layers"
                                  if pred.copied else ""))
        for kind, n, secs, bound in pred.by_kind:
            shown = f"{secs:.2f} s" if secs >= 1 else f"{secs * 1e3:.2f} ms"
            out.append(f"    {kind:<16} {n:>3} layers {shown:>11}   {bound}")
    out += format_crossover(speed.crossover)
    out += [f"  figures: {s}" for s in speed.sources]
    return out


def format_crossover(crossover) -> list[str]:
    """``-v``'s miss-policy crossover: per value, the tokens per missing expert from which
    copying it to the device beats computing it on the host, and the MoE layers it holds
    for (:func:`moefit.plan.speed.crossover`); nothing for another engine's plan."""
    if not crossover:
        return []
    out = ["  miss crossover (copy a missing expert rather than compute it on the host from):"]
    for tokens, layers in crossover_groups(crossover):
        what = ("never: host and device are one memory" if math.isinf(tokens) else
                f"{tokens:.1f} tokens per missing expert")
        out.append(f"    {what}   ({len(layers)} MoE layer{'s' if len(layers) != 1 else ''})")
    return out


def pred_chunk(pred, context_word: str = "chunk") -> str:
    return f"{pred.chunk}-token {context_word}"


def speed_document(speed) -> dict | None:
    """The ``speed`` object of a plan document (None: no figures for the device)."""
    if speed is None:
        return None

    def one(p) -> dict:
        return {"tokens_per_s": p.tokens_per_s, "bound": p.bound, "tokens": p.tokens,
                "position": p.position, "chunk": p.chunk, "copied_layers": p.copied,
                "by_kind": [{"kind": k, "layers": n, "seconds": s, "bound": b}
                            for k, n, s, b in p.by_kind]}

    doc = {"policy": speed.policy, "prefill": one(speed.prefill), "decode": one(speed.decode),
           "sources": list(speed.sources)}
    if speed.crossover:      # moefit's plans: the layers of each value; null: copying never pays
        doc["miss_crossover"] = [{"tokens": None if math.isinf(t) else t, "layers": layers}
                                 for t, layers in crossover_groups(speed.crossover)]
    return doc


def crossover_groups(crossover) -> list[tuple[float, list[int]]]:
    """:attr:`~moefit.plan.speed.Speed.crossover` grouped: (tokens, [MoE layers]), the
    smallest crossover first."""
    groups: dict[float, list[int]] = {}
    for layer, tokens in crossover:
        groups.setdefault(tokens, []).append(layer)
    return sorted(groups.items())


def format_table(plan: Plan, speed=None, alt_speeds=()) -> str:
    """The human report: model line, one budget table per device, the host table, decisions,
    and the predicted ``speed`` (:func:`format_speed`; each alternative's beside it)."""
    g = plan.geometry
    out = [f"model  {g.name}  {format_params(g.total_params)} total / "
           f"{format_params(g.active_params)} active  {g.num_layers} layers, "
           f"{g.attention_layout()}"]
    for d in plan.devices:
        out += _device_table(d, plan)
    if plan.host is not None:
        out += format_host_table(plan.host)
    if plan.fits:
        if plan.request.prefill_mode == "auto" and not plan.prefill_clamped:
            out.append(f"prefill: auto, {plan.prefill_selected}-token chunks")
        for n in plan.notes:
            out.append(n)
        out.append(format_speed(speed))
        return "\n".join(out)
    for n in plan.notes:
        out.append(n)
    if plan.short_on == "host":
        short = size_format(plan.host.host.capacity_bytes)(plan.shortfall_bytes)
        out.append(f"does not fit: short by {short} on the host")
    else:
        dev = next((d.device for d in plan.devices if d.device.label == plan.short_on),
                   plan.devices[0].device)
        where = f" on {dev.label}" if len(plan.devices) > 1 else ""
        hp = plan.host
        # the host table is priced for the plan as shown: a device that is short does not hide
        # a host that is short too
        also = (f", and by {size_format(hp.host.capacity_bytes)(-hp.unassigned_bytes)} on the host"
                if hp is not None and not hp.fits else "")
        out.append(f"does not fit: short by {size_format(dev.capacity_bytes)(plan.shortfall_bytes)}"
                   f"{where or (' on the device' if also else '')}{also}")
    out.append("limiting: " + ", ".join(_label(k) for k in plan.limiting))
    larger = "a larger host" if plan.short_on == "host" else "a larger device"
    if plan.short_on != "host" and plan.host is not None and not plan.host.fits:
        larger = "a larger device and a larger host"
    files = (f", nor a GGUF file of the model down to {GGUF_REMEDY_FTYPES[-1]},"
             if gguf_remedy_applies(plan.geometry) else "")
    out += format_fits_with(plan.alternatives, f"{larger} (no single flag change{files} makes it fit)",
                            [_alt_speed(s) for s in alt_speeds])
    return "\n".join(out)


def _alternative(a, speed=None) -> dict:
    doc = {"flag": a.flag, "value": a.value,
           "speed": None if speed is None else {
               "prefill_tokens_per_s": speed.prefill.tokens_per_s,
               "decode_tokens_per_s": speed.decode.tokens_per_s}}
    if a.also:
        doc["with"] = [{"flag": f, "value": v} for f, v in a.also]
    if a.drop:
        doc["drop"] = list(a.drop)
    if a.note:
        doc["note"] = a.note
    return doc


def _lines(lines) -> list[dict]:
    return [{"key": l.key, "bytes": l.bytes, "detail": l.detail} for l in lines]


def host_document(hp: HostPlan) -> dict:
    """The ``host`` object of the plan document."""
    h = hp.host
    return {"checked": h is not None, "source": h.source if h else None,
            "capacity_bytes": h.capacity_bytes if h else None,
            "free_bytes": h.free_bytes if h else None,
            "experts": hp.experts, "mapped_bytes": hp.mapped_bytes,
            "embed_on_host": hp.embed_on_host, "lines": _lines(hp.lines),
            "planned_bytes": hp.planned_bytes, "unassigned_bytes": hp.unassigned_bytes}


def plan_document(plan: Plan, speed=None, alt_speeds=()) -> dict:
    """The plan as a ``moefit.plan/2`` JSON-ready dict, with its predicted ``speed``
    (:func:`speed_document`) and each alternative's (``alt_speeds``, in their order)."""
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
        "split": plan.split,
        "devices": [{
            "name": d.device.label,
            "description": d.device.description,
            "kind": d.device.kind,
            "role": d.role,
            "layers": list(d.layers) if d.layers is not None else None,
            "capacity_bytes": d.device.capacity_bytes,
            "free_bytes": d.device.free_bytes,
            "lines": _lines(d.lines),
            "unassigned_bytes": d.unassigned_bytes,
            "expert_slots": d.expert_slots,
            "experts_per_layer": ([{"layer": i, "slots": n} for i, n in d.experts_per_layer]
                                  if len(plan.devices) > 1 else None),
        } for d in plan.devices],
        "host": host_document(plan.host) if plan.host is not None else None,
        "prefill": {"requested": plan.prefill_requested, "selected": plan.prefill_selected,
                    "clamped": plan.prefill_clamped, "mode": r.prefill_mode,
                    "strict": r.strict},
        "experts": {"slots": plan.expert_slots, "total": plan.total_experts,
                    "slot_bytes": expert_slot_bytes(g),
                    "per_layer": [{"layer": i, "slots": n} for i, n in plan.experts_per_layer]},
        "notes": list(plan.notes),
        "speed": speed_document(speed),
    }
    if plan.pool_cells is not None:       # --kv-pool: cells shared by the slots
        doc["kv_pool"] = {"cells": plan.pool_cells, "slots": r.slots, "context": plan.context}
    if plan.hit_rate is not None:       # a routing profile: the spread's predicted hits
        doc["experts"]["predicted_hit_rate"] = plan.hit_rate
        doc["experts"]["even_hit_rate"] = plan.even_hit_rate
    if not plan.fits:
        doc["shortfall_bytes"] = plan.shortfall_bytes
        doc["short_on"] = plan.short_on
        doc["limiting"] = list(plan.limiting)
        speeds = list(alt_speeds) + [None] * (len(plan.alternatives) - len(alt_speeds))
        doc["alternatives"] = [_alternative(a, s) for a, s in zip(plan.alternatives, speeds)]
    return doc


def format_json(plan: Plan, speed=None, alt_speeds=()) -> str:
    return json.dumps(plan_document(plan, speed, alt_speeds), indent=2)
