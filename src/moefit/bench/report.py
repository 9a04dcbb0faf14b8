"""Write a bench: ``bench.json``, ``bench.md`` (also printed) and ``bench.png``.

``bench.json``::

    {"schema": "moefit.bench/1", "model": {...}, "device": {...}, "request": {...},
     "runs": [record, ...]}            # one record per context (moefit.bench.ladder)

The chart (matplotlib, Agg backend, no display needed) has two panels: per context, the
budget lines as committed, stacked in commit order, beside the device's capacity (the
prefill line's measured peak marked on its segment); and prefill / decode throughput.
"""

from __future__ import annotations

import json
from importlib.util import find_spec
from pathlib import Path

from moefit.outputs import replace_files
from moefit.plan.types import LINE_ORDER
from moefit.units import GIB, MIB, format_bytes

SCHEMA = "moefit.bench/1"
LABELS = dict(LINE_ORDER)
COLORS = {"runtime": "#9e9e9e", "weights": "#5470c6", "weight_arena": "#91cc75",
          "kv": "#fac858", "prefill": "#ee6666", "margin": "#d0d0d0", "experts": "#73c0de"}


def tokens_label(n: int) -> str:
    """``524288`` -> ``512K``; ``1536`` -> ``1.5K``; under 1K as is."""
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20}M"
    if n >= 1024:
        k = n / 1024
        return f"{k:g}K" if k == int(k) or n % 512 == 0 else f"{n}"
    return str(n)


def _size(n: int, unit: int) -> str:
    return f"{n / unit:.2f}"


def document(model: dict, device: dict, request: dict, runs: list[dict]) -> dict:
    return {"schema": SCHEMA, "model": model, "device": device, "request": request, "runs": runs}


def markdown(doc: dict) -> str:
    """The runs as two Markdown tables: the record per context, then every budget line
    planned / allocated / peak (GiB, or MiB on a device under 1 GiB)."""
    cap = doc["device"]["capacity_bytes"]
    unit, uname = (GIB, "GiB") if cap >= GIB else (MIB, "MiB")
    vs = any("vs_transformers" in r for r in doc["runs"])
    head = ["context", "chunk", "KV", "expert slots", "weight arena", "free before READY",
            "staging planned / measured", "prefill tok/s", "decode tok/s", "expert hit rate"]
    if vs:
        head += ["vs transformers (prefill, decode: generate; greedy tokens: full forward, no cache)"]
    out = [f"| {' | '.join(head)} |", "|" + "---|" * len(head)]
    for r in doc["runs"]:
        ctx = tokens_label(r["context"])
        if not r["fits"]:
            cells = [ctx, "does not fit", r["kv"], f"short by {format_bytes(r['shortfall_bytes'])}"]
            out.append("| " + " | ".join(cells + [""] * (len(head) - len(cells))) + " |")
            continue
        chunk = str(r["prefill_chunk"]) + (f" (clamped from {r['prefill_requested']})"
                                           if r["clamped"] else "")
        st = r["staging"]
        cal = " (calibrated)" if r.get("staging_calibrated") else ""
        cells = [ctx, chunk, r["kv"],
                 f"{r['expert_slots']} of {r['total_experts']} ({r['expert_slots_pct']:.0f}%)",
                 format_bytes(r["weight_arena_bytes"]),
                 format_bytes(r["free_before_ready_bytes"]),
                 f"{format_bytes(st['planned_bytes'])} / {format_bytes(st['measured_bytes'])} "
                 f"({st['model_over_measured']:.3f}x){cal}",
                 f"{r['prefill_tps']:.1f}", f"{r['decode_tps']:.2f}",
                 f"{100 * r['expert_hit_rate']:.0f}%"]
        if vs:
            v = r.get("vs_transformers") or {}
            if "error" in v:
                cells.append(f"unavailable: {v['error']}")
            elif v:
                agree = "agree" if v["greedy_agree"] else f"differ at token {v['first_divergence']}"
                cells.append(f"{v['prefill_tps_ratio']:.2f}x, {v['decode_tps_ratio']:.2f}x; {agree}")
            else:
                cells.append("")
        out.append("| " + " | ".join(cells) + " |")
    out += ["", f"Budget lines, {uname}: planned / allocated / peak (prefill staging: the "
                "measured peak of a chunk, every tensor counted)", ""]
    keys = [k for k, _ in LINE_ORDER]
    out.append("| context | " + " | ".join(LABELS[k] for k in keys) + " |")
    out.append("|" + "---|" * (len(keys) + 1))
    for r in doc["runs"]:
        if not r["fits"]:
            continue
        cells = []
        for line in r["lines"]:
            if line["key"] == "margin":
                cells.append(f"{_size(line['planned_bytes'], unit)} (kept free)")
            else:
                cells.append(" / ".join(_size(line[f], unit) for f in
                                        ("planned_bytes", "allocated_bytes", "peak_bytes")))
        out.append(f"| {tokens_label(r['context'])} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def write_files(doc: dict, out: Path, title: str = "") -> tuple[str, list[Path]]:
    """Write ``bench.json``, ``bench.md`` (``title`` as its heading) and, when matplotlib
    is installed, ``bench.png`` into ``out`` as one set (:func:`moefit.outputs.replace_files`:
    an interrupted write leaves the previous files). Without matplotlib an older
    ``bench.png`` is removed, so the folder never mixes two runs.

    Returns (the Markdown tables, the files written).
    """
    text = markdown(doc)
    head = f"# {title}\n\n" if title else ""
    writers = {
        "bench.json": lambda p: p.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8"),
        "bench.md": lambda p: p.write_text(head + text + "\n", encoding="utf-8"),
    }
    if find_spec("matplotlib") is not None:
        writers["bench.png"] = lambda p: chart(doc, p)
    written = replace_files(out, writers)
    if "bench.png" not in writers:
        (out / "bench.png").unlink(missing_ok=True)
    return text, written


def chart(doc: dict, path: Path) -> Path:
    """Draw ``bench.png`` (see module docstring). Needs matplotlib (the ``bench`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in doc["runs"] if r["fits"]]
    cap = doc["device"]["capacity_bytes"]
    unit, uname = (GIB, "GiB") if cap >= GIB else (MIB, "MiB")
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.2), gridspec_kw={"width_ratios": [3, 2]})
    xs = list(range(len(runs)))
    names = [tokens_label(r["context"]) for r in runs]
    bottoms = [0.0] * len(runs)
    for key, label in LINE_ORDER:
        vals = []
        for r in runs:
            line = next(l for l in r["lines"] if l["key"] == key)
            vals.append((line["planned_bytes"] if key == "margin" else line["allocated_bytes"]) / unit)
        left.bar(xs, vals, 0.6, bottom=bottoms, color=COLORS[key], edgecolor="white",
                 linewidth=0.5, label=label + (" (kept free)" if key == "margin" else ""),
                 hatch="//" if key == "margin" else None)
        if key == "prefill":   # the measured peak inside the planned segment
            for x, r, b in zip(xs, runs, bottoms):
                m = r["staging"]["measured_bytes"] / unit
                left.plot([x - 0.3, x + 0.3], [b + m, b + m], color="black", linewidth=1.2)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    left.axhline(cap / unit, color="black", linestyle="--", linewidth=1)
    left.text(-0.45, cap / unit, f"device capacity {cap / unit:.2f} {uname}",
              va="bottom", ha="left", fontsize=9)
    for x, r, top in zip(xs, runs, bottoms):   # the chunk, in the middle of every bar
        staging = format_bytes(r["staging"]["planned_bytes"])
        chunk = (f"chunk {r['prefill_chunk']}" + (" (clamped)" if r["clamped"] else "")
                 + f"\nstaging {staging}\nexperts {r['expert_slots_pct']:.0f}%")
        left.text(x, top * 0.5, chunk, ha="center", va="center", fontsize=7.5,
                  bbox=dict(boxstyle="round,pad=0.25", facecolor="white", alpha=0.85, linewidth=0))
    left.set_xticks(xs, names)
    left.set_xlabel("context (tokens)")
    left.set_ylabel(uname)
    left.set_ylim(0, cap / unit * 1.12)
    left.set_title("budget lines as committed (black tick: measured staging peak)", fontsize=10)
    left.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False,
                reverse=True)

    pre = [r["prefill_tps"] for r in runs]
    dec = [r["decode_tps"] for r in runs]
    right.bar([x - 0.2 for x in xs], pre, 0.4, color="#5470c6", label="prefill")
    right.set_ylabel("prefill tokens/s", color="#5470c6")
    right.set_ylim(0, max(pre + [1e-9]) * 1.3)
    twin = right.twinx()
    twin.bar([x + 0.2 for x in xs], dec, 0.4, color="#ee6666", label="decode")
    twin.set_ylabel("decode tokens/s", color="#ee6666")
    twin.set_ylim(0, max(dec + [1e-9]) * 1.3)
    right.set_xticks(xs, names)
    right.set_xlabel("context (tokens)")
    right.set_title("throughput", fontsize=10)
    handles = right.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    right.legend(handles, ["prefill (longest prompt)", "decode"], loc="upper left", ncol=2,
                 fontsize=8, frameon=False)
    model, dev = doc["model"]["name"], doc["device"]["description"]
    fig.suptitle(f"moefit bench  {model}  on {dev}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
    return path
