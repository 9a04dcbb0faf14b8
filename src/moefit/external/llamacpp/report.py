"""A llama.cpp plan as text (the budget table, the host table, the command or the shortfall
and ``fits with:``) and as the ``moefit.llamacpp-plan/1`` JSON document."""

from __future__ import annotations

from moefit.external.llamacpp.buffers import CTX_PAD, pad_to
from moefit.external.llamacpp.command import LINES, LlamaPlan
from moefit.external.llamacpp.host import HOST_LINES
from moefit.external.llamacpp.split import LlamaSplitPlan
from moefit.ingest.resolve import format_params
from moefit.plan.report import host_document
from moefit.plan.types import HostPlan, format_fits_with
from moefit.units import format_bytes, size_format


def format_plan(plan: LlamaPlan) -> str:
    """The budget table in moefit's form, the host memory, the notes and the command."""
    return _format(plan, [(plan.device, plan.lines)])


def format_split_plan(plan: LlamaSplitPlan) -> str:
    """A plan over several devices: one budget table per device (layers, their KV, its
    compute buffer), the host memory, the notes and the command (or the device that is
    short and ``fits with:``)."""
    return _format(plan, [(s.device, s.lines) for s in plan.shares])


def _format(plan, tables) -> str:
    """The text of a one-device or a split plan: ``tables`` (device, lines) in device order."""
    g = plan.geometry
    fmt = size_format(max(dev.capacity_bytes for dev, _ in tables))
    labels = dict(LINES)
    out = [f"model  {g.name}  {format_params(g.total_params)} total / {format_params(g.active_params)} active  "
           f"{g.num_layers} layers, {g.attention_layout()}",
           "engine  llama.cpp (llama-server; memory model of commit 0c1e570, validated on the CPU backend)"]
    for dev, lines in tables:
        out.append(f"VRAM budget  {dev.label}  {dev.description}  {fmt(dev.free_bytes)} free of "
                   f"{fmt(dev.capacity_bytes)}")
        for line in lines:
            out.append(f"  {labels[line.key]:<18} {fmt(line.bytes):>10}   {line.detail}".rstrip())
        unassigned = dev.free_bytes - sum(l.bytes for l in lines)
        if unassigned >= 0:
            out.append(f"  {'unassigned':<18} {fmt(unassigned):>10}")
    if plan.host_table is not None:
        out += _format_host(plan.host_table)
    out += list(plan.notes)
    if plan.fits:
        out.append("command  " + plan.command)
        return "\n".join(out)
    out += short_lines(plan, fmt)
    labels = {**dict(LINES), **{k: "host " + v for k, v in HOST_LINES}}
    out.append("limiting: " + ", ".join(labels[k] for k in plan.limiting))
    larger = "a larger host" if plan.short_on == "host" else "a larger device"
    out += format_fits_with(plan.alternatives, f"{larger} (no single flag change makes it fit)")
    return "\n".join(out)


def short_lines(plan: LlamaPlan, fmt) -> list[str]:
    """``does not fit: short by ...`` naming every side that is short: the device (the plan's
    shortfall) and the host when its table is checked and over (it is priced for the plan as
    shown, so a device that is short does not hide a host that is short too)."""
    hp = plan.host_table
    host_short = -hp.unassigned_bytes if hp is not None and not hp.fits else 0
    hfmt = size_format(hp.host.capacity_bytes) if host_short else fmt
    if plan.short_on == "host":
        return [f"does not fit: short by {hfmt(host_short)} on the host"]
    line = f"does not fit: short by {fmt(plan.shortfall_bytes)} on {plan.short_on}"
    if host_short:
        line += f", and by {hfmt(host_short)} on the host"
    return [line]


def _format_host(hp: HostPlan) -> list[str]:
    """The host table: its budget line, one line per :data:`HOST_LINES`, unassigned."""
    fmt = size_format(sum(l.bytes for l in hp.lines if l.key not in ("host_runtime", "host_margin")))
    h = hp.host
    head = (f"host budget  {h.source}  {fmt(h.free_bytes)} free of {fmt(h.capacity_bytes)}" if h else
            f"host budget  not checked (a what-if card; --host-ram SIZE checks a machine)  "
            f"needs {fmt(hp.planned_bytes)}")
    labels = dict(HOST_LINES)
    out = [head] + [f"  {labels[l.key]:<18} {fmt(l.bytes):>10}   {l.detail}".rstrip() for l in hp.lines]
    if h is not None and hp.unassigned_bytes >= 0:
        out.append(f"  {'unassigned':<18} {fmt(hp.unassigned_bytes):>10}")
    return out


def format_verbose(plan: LlamaPlan) -> str:
    """``-v``: the compute buffer's two phases, the KV caches per kind, the device bytes of
    each MoE layer's experts (what one step of ``--n-cpu-moe`` moves)."""
    c, kv = plan.compute, plan.kv
    out = [f"compute  end of graph {format_bytes(c.end_phase)} (logits {format_bytes(c.logits)}); "
           f"a layer {format_bytes(c.layer_phase)} (KQ mask {format_bytes(c.mask)}, F16 K/V "
           f"{format_bytes(c.fa_f16)}, expert copy {format_bytes(c.weight_copy)})",
           f"KV       full {format_bytes(kv.bytes_full)} ({kv.cells} cells x {kv.full_layers} layers x "
           f"{kv.n_seq} streams), SWA {format_bytes(kv.bytes_swa)} ({kv.swa_cells} cells x {kv.swa_layers} "
           f"layers), recurrent {format_bytes(kv.recurrent_bytes)} ({kv.recurrent_layers} layers)"]
    if plan.expert_bytes:
        out.append("experts  device bytes per MoE layer: "
                   + ", ".join(f"{layer}:{format_bytes(b)}" for layer, b in plan.expert_bytes))
    return "\n".join(out)


def format_split_verbose(plan: LlamaSplitPlan) -> str:
    """``-v`` on several devices: each device's layers, its compute buffer's two phases and
    its KV caches."""
    out = []
    for s in plan.shares:
        c, kv = s.compute, s.kv
        out.append(f"{s.device.label}  layers {s.layers.start}-{s.layers.stop - 1}"
                   + (" + output" if s.output else "")
                   + f"; compute: end of graph {format_bytes(c.end_phase)}, a layer {format_bytes(c.layer_phase)} "
                   f"(KQ mask {format_bytes(c.mask)}, F16 K/V {format_bytes(c.fa_f16)}, expert copy "
                   f"{format_bytes(c.weight_copy)}); KV full {format_bytes(kv.bytes_full)} x {kv.full_layers} layers, "
                   f"SWA {format_bytes(kv.bytes_swa)} x {kv.swa_layers}, recurrent {format_bytes(kv.recurrent_bytes)}")
    return "\n".join(out)


#: the JSON document of a llama.cpp plan (docs/plan.md, "JSON (`moefit plan --json`)")
SCHEMA = "moefit.llamacpp-plan/1"


def plan_document(plan: LlamaPlan) -> dict:
    """The plan as the JSON-ready ``moefit.llamacpp-plan/1`` dict: ``moefit.plan/1``'s model,
    devices (the lines of :data:`LINES`), notes, and on failure ``shortfall_bytes``,
    ``limiting``, ``alternatives`` (``value`` an int for a count); its own ``engine``,
    ``context`` (cells per sequence), ``slots`` (``-np``), ``kv`` ``{"k", "v"}`` (llama.cpp's
    cache types), ``ubatch``, ``batch``, ``n_cpu_moe``, ``host`` (bytes by part:
    :func:`host_bytes`), ``host_budget`` (the host table in ``moefit.plan/2``'s ``host`` form),
    ``short_on`` on failure (the device's label or ``host``) and ``command``.
    Sizes in bytes."""
    cpu = (list(plan.cpu_layers) if plan.cpu_layers else
           [layer for layer, _ in plan.expert_bytes if layer < plan.n_cpu_moe])
    return _document(plan, [(plan.device, plan.lines)], 0 if plan.cpu_layers else plan.n_cpu_moe, cpu)


def split_document(plan: LlamaSplitPlan) -> dict:
    """A plan over several devices as :func:`plan_document`'s dict, one entry of ``devices``
    per device (each with its ``layers`` ``[first, last]`` and ``output``), ``split_mode``
    ``layer`` and ``tensor_split`` (the ``-ts`` counts)."""
    doc = _document(plan, [(s.device, s.lines) for s in plan.shares], plan.n_cpu_moe,
                    [i for i in range(plan.n_cpu_moe)])
    for d, s in zip(doc["devices"], plan.shares):
        d["layers"] = [s.layers.start, s.layers.stop - 1]
        d["output"] = s.output
    doc.update(split_mode="layer", tensor_split=list(plan.ts))
    return doc


def _document(plan, tables, n_cpu_moe: int, cpu_layers: list[int]) -> dict:
    g = plan.geometry
    doc = {"schema": SCHEMA, "engine": "llama.cpp", "fits": plan.fits,
           "model": {"name": g.name, "model_type": g.model_type, "total_params": g.total_params,
                     "active_params": g.active_params, "source": g.source},
           "context": pad_to(plan.request.context, CTX_PAD), "slots": plan.request.slots,
           "kv": {"k": plan.request.type_k, "v": plan.request.type_v},
           "ubatch": plan.ubatch, "batch": plan.batch, "n_cpu_moe": n_cpu_moe, "cpu_layers": cpu_layers,
           "devices": [{"name": dev.label, "description": dev.description, "kind": dev.kind,
                        "capacity_bytes": dev.capacity_bytes, "free_bytes": dev.free_bytes,
                        "lines": [{"key": l.key, "bytes": l.bytes, "detail": l.detail} for l in lines],
                        "unassigned_bytes": dev.free_bytes - sum(l.bytes for l in lines)}
                       for dev, lines in tables],
           "host": dict(plan.host), "notes": list(plan.notes)}
    if plan.host_table is not None:
        doc["host_budget"] = host_document(plan.host_table)
    if plan.fits:
        doc["command"] = plan.command
    else:
        doc["shortfall_bytes"] = plan.shortfall_bytes
        doc["short_on"] = plan.short_on
        doc["limiting"] = list(plan.limiting)
        doc["alternatives"] = [{"flag": a.flag, "value": a.value} for a in plan.alternatives]
    return doc
