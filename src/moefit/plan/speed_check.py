"""Published runs predicted by the speed model (:mod:`moefit.plan.speed`).

Each run of ``tests/data/published_runs.json`` names an engine, a model preset and its GGUF
type, a catalogue GPU, the host's memory configuration (channels x MT/s x 8 bytes: the peak
bandwidth of DDR4 / DDR5 DIMM channels, JEDEC JESD79-4 / JESD79-5) and threads, where the
experts live, and the measured prefill / decode tokens/s. :func:`predict_run` prices it as
a user's plan would be priced:

- ``llama.cpp`` (``--n-cpu-moe N`` / ``-ot exps=CPU``): :func:`~moefit.plan.llamacpp_speed.predict_llamacpp`
  with the experts of the first N MoE layers (or all) in host memory, the file's geometry from
  :func:`~moefit.ingest.gguf_mix.gguf_geometry`;
- ``ktransformers`` (routed experts on the CPU, attention and shared experts on the GPU):
  :func:`~moefit.plan.speed.predict` with no resident expert and misses computed on the host
  (``--miss-policy cpu``), the engine's own placement, and its f16 KV cache; the GPU's dense
  matrices read in their stored types as on a CUDA device (:attr:`~moefit.plan.speed.Rates.stored`:
  ktransformers' optimize rules run its linear layers in 4-bit Marlin kernels,
  ``generate_op: KLinearMarlin``, about Q4_K's bytes).

The host is moefit's what-if host (:func:`~moefit.devices.host.default_host_speed`) at the
run's achieved bandwidth (:func:`achieved_bandwidth`: the channels' peak times the measured /
peak fraction of an independent published measurement on the same class of host (a read
benchmark, or llama.cpp's CPU-only decode: bytes read per token x tokens/s), the
file's ``host_memory_efficiency``) and threads: the C kernels' per-core rates measured on the
CI machine, not the engine's kernels. Imports no torch; reads only the data file.

A ktransformers run may name a ``handover`` (a key of the file's ``decode_handover``): a fixed
time per MoE layer and decoded token that the engine spends outside the reads the model prices
(the CPU-GPU hand-over of each layer's experts: synchronisation, copies, launches), derived by
:func:`derive_handover` from a published pair of runs on another machine that differ only in
their sockets; it is added to the decode's step (:data:`HANDOVER` names it as the bound when it
is the larger part). llama.cpp runs name none: no published or measured figure for its
hand-over was found (the CPU side's fixed cost, measured here by
``benchmarks/llamacpp_layer_cost.py``, is a few microseconds per layer).

A run may carry an ``outlier``: a measurement the model cannot reproduce, with the reason found
(or that none was) and the ``phases`` it concerns (default: all); it stays in the median (:func:`summary`) and its :class:`Case` names it.
:func:`host_expert_bytes` is what a decoded token reads from host memory by the model's
geometry, so a decode's measured tokens/s gives the host read rate it implies
(:meth:`Case.implied_host_bytes_per_s`), the check behind such a reason.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from moefit.devices.catalogue import find_gpu
from moefit.devices.host import default_host_speed
from moefit.ingest.gguf_mix import gguf_geometry
from moefit.ingest.resolve import load_model
from moefit.memory.kv import kv_format
from moefit.plan.llamacpp_speed import predict_llamacpp
from moefit.plan.speed import predict, rates_for
from moefit.records import record

#: the engines a run may name
ENGINES = ("llama.cpp", "ktransformers")
#: the bound named when a run's decode hand-over (:func:`derive_handover`) takes longer than
#: the rest of its step
HANDOVER = "hand-over"
#: bytes a memory channel moves per transfer (64 data bits: a DDR4 channel, or a DDR5 DIMM's
#: two 32-bit subchannels)
CHANNEL_BYTES = 8


@record
class Case:
    """One measured figure of a run against its prediction: ``phase`` is ``prefill`` or
    ``decode``; tokens/s both; ``bound`` the resource the model names; ``host_bytes``: the
    bytes of routed experts one decoded token reads from host memory
    (:func:`host_expert_bytes`; 0.0 for prefill); ``outlier``: the run's outlier reason, ""
    for none."""

    run: str
    engine: str
    phase: str
    measured: float
    predicted: float
    bound: str
    host_bytes: float = 0.0
    outlier: str = ""

    @property
    def implied_host_bytes_per_s(self) -> float:
        """The host read rate a decode's measured tokens/s implies (bytes/s): ``host_bytes x
        measured``, a lower bound on the achieved bandwidth when every other part of the step
        took no time; 0.0 for prefill."""
        return self.host_bytes * self.measured

    @property
    def ratio(self) -> float:
        """predicted / measured"""
        return self.predicted / self.measured

    @property
    def error(self) -> float:
        """|predicted / measured - 1|"""
        return abs(self.ratio - 1)


def load_runs(path: str | Path) -> list[dict]:
    """The ``runs`` of a published-runs JSON file (the schema is checked by
    tests/test_speed_published.py), each host's ``efficiency`` (a key of the file's
    ``host_memory_efficiency``) replaced by that entry. Raises OSError / ValueError for an
    unreadable file, KeyError for a host naming an efficiency the file does not hold."""
    doc = json.loads(Path(path).read_text())
    table = doc.get("host_memory_efficiency", {})
    handovers = doc.get("decode_handover", {})
    runs = doc["runs"]
    for run in runs:
        key = run["host"].get("efficiency")
        if isinstance(key, str):
            run["host"] = run["host"] | {"efficiency": {"id": key, **table[key]}}
        key = run.get("handover")
        if isinstance(key, str):
            run["handover"] = {"id": key, **handovers[key]}
    return runs


def host_bandwidth(host: dict) -> float:
    """Peak host bandwidth in bytes/s: ``channels x mts x`` :data:`CHANNEL_BYTES`."""
    return host["channels"] * host["mts"] * 1e6 * CHANNEL_BYTES


def memory_efficiency(host: dict) -> float:
    """The achieved / peak fraction of the measurement the run's host names (its
    ``efficiency``: ``measured_bytes_per_s / peak_bytes_per_s``, each cited in the data
    file); 1.0 for a host naming none (priced at the peak)."""
    e = host.get("efficiency")
    return e["measured_bytes_per_s"] / e["peak_bytes_per_s"] if e else 1.0


def achieved_bandwidth(host: dict) -> float:
    """The host bandwidth a run is priced at (bytes/s): :func:`host_bandwidth` x
    :func:`memory_efficiency`."""
    return host_bandwidth(host) * memory_efficiency(host)


def host_layers(run: dict, geom) -> list[int]:
    """The MoE layer indices whose experts ``run`` keeps in host memory: the first
    ``cpu_moe_layers`` (or all) for llama.cpp, all for ktransformers."""
    moe = [layer.index for layer in geom.moe_layers]
    if run["engine"] == "llama.cpp":
        n = run["placement"]["cpu_moe_layers"]
        return moe if n == "all" else moe[:n]
    return moe


def host_expert_bytes(run: dict) -> float:
    """Bytes of routed experts one decoded token of one sequence reads from host memory in
    ``run``: per host-resident MoE layer (:func:`host_layers`), ``experts_per_token`` expert
    blobs in the run's GGUF type (:meth:`~moefit.ingest.geometry.ModelGeometry.expert_blob_bytes`,
    the stored bytes of gate, up and down), the same bytes :func:`predict_run` prices. Raises
    as :func:`predict_run` for an unknown model."""
    geom = gguf_geometry(load_model(run["model"]), run["gguf_type"])
    blobs = geom.expert_blob_bytes()
    k = {layer.index: layer.moe.experts_per_token for layer in geom.moe_layers}
    return float(sum(k[i] * blobs[i] for i in host_layers(run, geom)))


def derive_handover(one: dict, two: dict) -> float:
    """Seconds per MoE layer and decoded token that ktransformers spends beyond what the model
    prices, from two runs of one machine, ``one`` on one socket and ``two`` on two (its
    channels doubled, a copy of the experts per NUMA node), each with a measured decode:
    with ``t1``, ``t2`` their seconds per token and the host reads halved on two sockets,
    the host-read time of one socket is ``X = 2 (t1 - t2)`` and the rest of its step
    ``t1 - X``; less the model's own time outside the host reads (its predicted step less
    :func:`host_expert_bytes` over :func:`achieved_bandwidth`), over the MoE layers. Raises
    ValueError when the two are not such a pair."""
    if (two["host"]["channels"] != 2 * one["host"]["channels"] or one["model"] != two["model"]
            or one["gguf_type"] != two["gguf_type"] or one["engine"] != "ktransformers"):
        raise ValueError(f"derive_handover: {one['id']} and {two['id']} are not one run on one "
                         f"and two sockets")
    t1 = 1 / one["measured"]["decode"]["tokens_per_s"]
    t2 = 1 / two["measured"]["decode"]["tokens_per_s"]
    rest = t1 - 2 * (t1 - t2)
    base = next(c for c in predict_run({**one, "handover": None}) if c.phase == "decode")
    priced_rest = 1 / base.predicted - base.host_bytes / achieved_bandwidth(one["host"])
    geom = gguf_geometry(load_model(one["model"]), one["gguf_type"])
    return (rest - priced_rest) / len(geom.moe_layers)


def predict_run(run: dict) -> list[Case]:
    """The :class:`Case` of each measured phase of ``run`` (module docstring). Prefill is
    priced for the run's ``prompt_tokens`` from position 0, decode one token after them;
    a run's ``handover`` adds its ``per_moe_layer_s`` x the MoE layers to each decoded
    token (bound :data:`HANDOVER` when that is longer than the rest of the step).
    Raises KeyError / InputError for a run that names an unknown field, model or GPU."""
    geom = gguf_geometry(load_model(run["model"]), run["gguf_type"])
    device = find_gpu(run["gpu"])
    host = default_host_speed(achieved_bandwidth(run["host"]), run["host"]["threads"])
    moe = [layer.index for layer in geom.moe_layers]
    cpu = host_layers(run, geom)
    outlier = run.get("outlier") or {}
    outlier_phases = outlier.get("phases", list(run["measured"]))
    per_token = host_expert_bytes(run)
    out = []
    for phase, m in run["measured"].items():
        prompt = m["prompt_tokens"]
        if run["engine"] == "llama.cpp":
            speed = predict_llamacpp(geom, device, host, context=run["context"],
                                     ubatch=run["ubatch"], seqs=1, cpu_layers=cpu,
                                     type_k=run["type_k"], type_v=run["type_v"],
                                     prompt_tokens=prompt)
        elif run["engine"] == "ktransformers":
            if (run["type_k"], run["type_v"]) != ("f16", "f16"):
                raise ValueError(f"run {run['id']}: ktransformers runs keep an f16 KV cache")
            fmt = kv_format("fp16")
            speed = predict(geom, rates_for(device, host), fmt, {i: 0 for i in moe},
                            context=run["context"], chunk=run["ubatch"], seqs=1,
                            policy="cpu", prompt_tokens=prompt)
        else:
            raise ValueError(f"run {run['id']}: engine {run['engine']!r} is not one of {ENGINES}")
        p = speed.prefill if phase == "prefill" else speed.decode
        tps, bound = p.tokens_per_s, p.bound
        handover = run.get("handover")
        if handover and phase == "decode":
            extra = handover["per_moe_layer_s"] * len(moe)
            tps, bound = 1 / (1 / tps + extra), HANDOVER if extra > 1 / tps else bound
        out.append(Case(run["id"], run["engine"], phase, m["tokens_per_s"], tps, bound,
                        per_token if phase == "decode" else 0.0,
                        outlier.get("reason", "") if phase in outlier_phases else ""))
    return out


def summary(cases: list[Case]) -> tuple[float, Case]:
    """The median |predicted / measured - 1| over ``cases`` (outliers kept) and the case of
    the largest."""
    return statistics.median(c.error for c in cases), max(cases, key=lambda c: c.error)
