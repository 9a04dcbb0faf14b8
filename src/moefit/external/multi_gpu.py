"""One solver for the multi-GPU serving engines (vLLM, SGLang): the plan of one rank under a
parallel layout, the engine's flags, and one launch command per node.

The rules are moefit's (docs/plan.md, "How the plan is solved"), with the KV cache as the elastic
line where moefit's runtime has its expert cache:

1. price every mandatory line of one rank at the requested settings (the runtime, the
   weight shard, the activations of one ``--max-num-batched-tokens`` / chunked-prefill step,
   the workspaces, the CUDA graphs, the margin) with the engine's memory model
   (:class:`EngineModel`);
2. the KV cache gets the rest, as the engine itself sizes it (``--gpu-memory-utilization``
   for vLLM, ``--mem-fraction-static`` for SGLang, chosen so that the lines outside the
   engine's fraction fit), and must hold ``--max-context`` tokens for each of
   ``--parallel`` sequences;
3. if not, the batched-token budget is clamped on a 256-token grid (not below
   ``--prefill-min``, unless ``--strict``);
4. otherwise the plan fails with the shortfall and single-flag alternatives, each checked
   by solving again (``--max-context``, ``--kv fp8``, ``--nodes``).

Without ``--tp/--pp/--dp/--ep`` every layout the engine accepts for ``--gpus`` on
``--nodes`` is tried (:func:`candidate_layouts`) and the one that fits with the most KV
tokens in all wins. Pure: no I/O, no torch.
"""

from __future__ import annotations

from typing import Protocol

from moefit.devices import Device
from moefit.external.parallel import (Layout, StageShard, check_layout, fp8_block_of, stage_layers,
                                     stage_shards)
from moefit.errors import InputError
from moefit.ingest.geometry import ModelGeometry
from moefit.ingest.resolve import format_params
from moefit.plan.types import Alternative, Line, LineTable, format_fits_with, largest_int, limiting_lines
from moefit.memory.layer_kinds import Latent, kind_of
from moefit.memory.runtime import runtime_bytes
from moefit.records import field, record, replace
from moefit.units import GIB, MIB, format_bytes, size_format

#: ``--max-num-batched-tokens`` / ``--chunked-prefill-size`` grid of a clamp (tokens)
BATCH_GRID = 256
#: Measured in vLLM 0.19.0 startup logs on H100 80GB (llm-d-incubation/llm-d-planner PR #205,
#: ``accuracy/results/v0.19.0/logs``; excerpts in ``tests/data/serving``), and used for SGLang
#: too (the same NCCL and torch.distributed underneath):
#: the NCCL communicators and custom all-reduce buffers before the memory snapshot, on top
#: of the CUDA context ("worker init memory snapshot: ... non_torch_memory=0.51GiB" on one
#: GPU, 1.43-2.05 GiB with 2 or 4 ranks)
COMM_BYTES = 1536 * MIB
#: what grows outside torch's allocator during the profile run ("non-torch forward increase
#: memory" of Llama-3.1-8B): 0.25 GiB on one GPU, 0.07 GiB on a stage of a 2- or 4-stage
#: pipeline, 2.07 and 2.13 GiB with tensor parallelism 2 and 4 (the collectives' buffers)
NON_TORCH_ONE_GPU = 256 * MIB
NON_TORCH_PIPELINE = 72 * MIB
NON_TORCH_COLLECTIVES = 2150 * MIB


@record
class ServeRequest:
    """What to plan. ``context``: tokens per sequence (``--max-model-len`` /
    ``--context-length``); ``seqs``: ``--parallel`` (None: the engine's default
    concurrency, and one sequence of ``context`` must fit); ``batched``: tokens of one
    scheduler step (None: the engine's default); ``kv``: moefit's ``--kv`` name;
    ``margin``: bytes left free per GPU (None: moefit's default); ``gpus``/``nodes`` and the
    layout flags (None: chosen); ``model_ref``: the model as the command names it (a
    preset's Hugging Face id); ``trust_remote_code``: the command adds
    ``--trust-remote-code`` (the config maps to the repository's own code)."""

    context: int
    gpus: int = 1
    nodes: int = 1
    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    ep: int | None = None
    seqs: int | None = None
    batched: int | None = None
    batched_min: int = BATCH_GRID
    strict: bool = False
    kv: str = "bf16"
    margin: int | None = None
    model_ref: str = "MODEL"
    trust_remote_code: bool = False
    extra_flags: tuple[tuple[str, str], ...] = ()
    fraction: float | None = None


@record
class RankBudget:
    """One rank's budget as an engine prices it: ``lines`` (bytes, in allocation order, the
    KV cache among them), ``kv_tokens`` (the engine's pool in tokens per DP rank, the
    smallest over pipeline stages), ``concurrency`` (sequences of ``context`` tokens the
    pool holds, as the engine counts them), ``knob`` (the engine's memory fraction), ``stage`` (the
    pipeline stage shown: the one with the fewest KV tokens), ``details`` (engine extras
    for the notes and the JSON)."""

    lines: tuple[Line, ...]
    kv_tokens: int
    knob: float
    stage: int
    batched: int
    seqs: int
    concurrency: float = 0.0
    details: dict = field(default_factory=dict)


def runtime_with_comm(device: Device, layout: Layout) -> int:
    """The CUDA context (:func:`moefit.memory.runtime.runtime_bytes`) plus, on more than one
    GPU, the communicators (:data:`COMM_BYTES`): what a rank holds before the weights."""
    return runtime_bytes(device) + (COMM_BYTES if layout.world > 1 else 0)


def non_torch_bytes(layout: Layout) -> int:
    """What a forward pass adds outside torch's allocator on one rank: the collectives'
    buffers with tensor / data parallelism, little on a pipeline stage or one GPU."""
    if layout.tp == 1 and layout.dp == 1:
        return NON_TORCH_ONE_GPU if layout.pp == 1 else NON_TORCH_PIPELINE
    return NON_TORCH_COLLECTIVES


class EngineModel(Protocol):
    """A serving engine's memory model (:mod:`moefit.external.vllm`, :mod:`moefit.external.sglang`)."""

    name: str            #: ``vllm`` / ``sglang``
    label: str           #: printed name
    version: str         #: the version modelled and the source read, one line

    def kv_dtype(self, kv: str) -> tuple[str, int]:
        """moefit ``--kv`` -> (the engine's KV dtype flag value, bytes per element)."""

    def default_batched(self, device: Device) -> int:
        """The engine's default tokens per scheduler step on ``device``."""

    def default_seqs(self, device: Device, layout: Layout) -> int:
        """The engine's default concurrent sequences."""

    def expert_blob(self, geom: ModelGeometry):
        """``layer -> bytes`` of one expert as the engine holds it, or None (as stored)."""

    def price(self, geom: ModelGeometry, shards: tuple[StageShard, ...], layout: Layout,
              device: Device, req: ServeRequest, batched: int, seqs: int) -> RankBudget:
        """Price one rank of every stage; the KV line is what the engine would allocate."""

    def flags(self, plan: "ServePlan") -> list[tuple[str, str | None]]:
        """The engine's flags for ``plan`` (name, value or None for a switch)."""

    def commands(self, plan: "ServePlan") -> list[str]:
        """One launch command per node."""

    def check_layout(self, layout: Layout) -> None:
        """Raise InputError (naming the flag) for a layout this engine cannot start."""


@record
class ServePlan(LineTable):
    """A solved serving plan: one rank's lines, the layout, the engine's numbers."""

    fits: bool
    engine: EngineModel
    geometry: ModelGeometry
    device: Device
    request: ServeRequest
    layout: Layout
    budget: RankBudget
    required_tokens: int
    notes: tuple[str, ...] = ()
    shortfall_bytes: int = 0
    alternatives: tuple[Alternative, ...] = ()
    limiting: tuple[str, ...] = ()

    @property
    def lines(self) -> tuple[Line, ...]:
        return self.budget.lines

    @property
    def total_kv_tokens(self) -> int:
        """KV tokens of all DP replicas together."""
        return self.budget.kv_tokens * self.layout.dp

    def line(self, key: str) -> Line:
        return next(l for l in self.lines if l.key == key)

    @property
    def commands(self) -> list[str]:
        return self.engine.commands(self)


# ---- layouts -----------------------------------------------------------------------------------
def candidate_layouts(geom: ModelGeometry, req: ServeRequest) -> list[Layout]:
    """The layouts to try for ``req``: the flags given, the rest chosen.

    Without flags: tensor parallelism over the GPUs of a node and pipeline parallelism over
    the nodes (vLLM's and SGLang's documented multi-node default), tensor parallelism over
    all GPUs, and for MoE models the same with experts whole on each rank (``--ep``); for
    MLA models also data-parallel attention (one KV cache per GPU instead of one latent
    cache replicated on every TP rank) with expert parallelism. Layouts the engine would
    refuse (:func:`moefit.external.parallel.check_layout`) are dropped.

    Raises InputError when the flags describe no valid layout (naming the flag)."""
    g, m = req.gpus, req.nodes
    if g < 1:
        raise InputError(f"--gpus {g}: need at least 1 GPU")
    if m < 1 or g % m:
        raise InputError(f"--nodes {m}: --gpus {g} must be a multiple of --nodes (the same number "
                         "of GPUs on every node)")
    per_node = g // m
    moe = bool(geom.moe_layers)
    mla = any(isinstance(kind_of(l.attention), Latent) for l in geom.layers)
    if req.ep is not None and not moe:
        raise InputError(f"--ep {req.ep}: {geom.name} is a dense model (no experts to place); drop --ep")
    given = [x is not None for x in (req.tp, req.pp, req.dp)]
    if any(given) or req.ep is not None:
        tp = req.tp if req.tp is not None else None
        pp = req.pp if req.pp is not None else None
        dp = req.dp if req.dp is not None else 1
        if tp is None and pp is None:
            pp = m
        if tp is None:
            if g % (pp * dp):
                raise InputError(f"--gpus {g} is not a multiple of --pp {pp} x --dp {dp}")
            tp = g // (pp * dp)
        if pp is None:
            if g % (tp * dp):
                raise InputError(f"--gpus {g} is not a multiple of --tp {tp} x --dp {dp}; use a "
                                 f"--tp that divides {g // dp}")
            pp = g // (tp * dp)
        if tp * pp * dp != g:
            raise InputError(f"--tp {tp} x --pp {pp} x --dp {dp} = {tp * pp * dp} GPUs, but --gpus "
                             f"is {g}; make the product equal --gpus")
        ep = req.ep is not None and req.ep > 1
        if ep and req.ep != tp * dp:
            raise InputError(f"--ep {req.ep}: expert parallelism spans the --tp x --dp = {tp * dp} "
                             f"ranks of an MoE layer; use --ep {tp * dp} (or --ep 1: experts "
                             "split, not placed)")
        layout = Layout(tp, pp, dp, ep, m)
        check_layout(geom, layout, fp8_block=fp8_block_of(geom))
        return [layout]
    out: list[Layout] = []
    shapes = [(per_node, m, 1)]
    if m > 1:
        shapes.append((g, 1, 1))
    if mla and moe and g > 1:
        shapes += [(1, 1, g)]
    for tp, pp, dp in shapes:
        for ep in ((False, True) if moe else (False,)):
            if dp > 1 and not ep:
                continue
            lay = Layout(tp, pp, dp, ep, m)
            try:
                check_layout(geom, lay, fp8_block=fp8_block_of(geom))
            except InputError:
                continue
            if lay not in out:
                out.append(lay)
    if not out:
        try:
            check_layout(geom, Layout(per_node, m, 1, False, m), fp8_block=fp8_block_of(geom))
        except InputError as e:
            raise InputError(f"--gpus {g}: no layout moefit tries ({', '.join(f'TP {t} x PP {p} x DP {d}' for t, p, d in shapes)}) "
                             f"splits {geom.name} over {g} GPUs: {e}; use fewer GPUs or give --tp/--pp/--dp") from None
    return out


# ---- solving ----------------------------------------------------------------------------------
def _solve_layout(geom, engine: EngineModel, device: Device, req: ServeRequest,
                  layout: Layout) -> ServePlan:
    """Solve one layout: the requested batch, else the largest one on the grid that fits."""
    _, kv_el = engine.kv_dtype(req.kv)
    shards = stage_shards(geom, layout, kv_el, engine.expert_blob(geom))
    seqs = req.seqs or engine.default_seqs(device, layout)
    batched = req.batched or engine.default_batched(device)
    need = req.seqs or 1
    notes: list[str] = []
    b = engine.price(geom, shards, layout, device, req, batched, seqs)
    fits = b.concurrency >= need and _outside_fit(b, device)
    if not fits and not req.strict:
        # the largest grid step below the request that fits: every line grows with the batch
        # (activations, SGLang's lines outside the fraction), so the grid is bisected
        lowest = max(BATCH_GRID, min(req.batched_min, batched))
        lo, hi = -(-lowest // BATCH_GRID), (batched - 1) // BATCH_GRID

        def at(step: int) -> RankBudget:
            cand = step * BATCH_GRID
            return engine.price(geom, shards, layout, device, req, cand, min(seqs, cand))

        def ok(c: RankBudget) -> bool:
            return c.concurrency >= need and _outside_fit(c, device)

        step = largest_int(lambda n: ok(at(n)), lo, hi)
        if step is not None:
            b, fits = at(step), True
            notes.append(f"batched tokens: requested {batched}, clamped to {b.batched} due to VRAM budget")
    return ServePlan(fits, engine, geom, device, req, layout, b, need * req.context, tuple(notes))


def _outside_fit(b: RankBudget, device: Device) -> bool:
    return sum(l.bytes for l in b.lines) <= device.free_bytes and b.knob > 0


def solve_serving(geom: ModelGeometry, engine: EngineModel, device: Device, req: ServeRequest, *,
                  alternatives: bool = True) -> ServePlan:
    """Solve ``req`` for ``engine`` on ``req.gpus`` copies of ``device`` (module docstring).

    Returns the plan that fits with the most KV tokens over all DP replicas (ties: the
    earlier layout of :func:`candidate_layouts`), else the failed plan of the first layout
    with its shortfall and alternatives. Raises InputError for a bad request."""
    engine.kv_dtype(req.kv)
    if req.context < 1:
        raise InputError(f"--max-context {req.context}: must be a positive token count")
    layouts, refused = [], None
    for lay in candidate_layouts(geom, req):
        try:
            engine.check_layout(lay)
            layouts.append(lay)
        except InputError as e:
            refused = refused or e
    if not layouts:
        raise refused
    plans = [_solve_layout(geom, engine, device, req, lay) for lay in layouts]
    fitting = [p for p in plans if p.fits]
    if fitting:
        best = max(fitting, key=lambda p: (p.total_kv_tokens, -plans.index(p)))
        chosen = "" if len(layouts) == 1 else f"layout: {best.layout.describe()} (the most KV tokens of {len(layouts)} layouts tried)"
        return replace(best, notes=((chosen,) if chosen else ()) + best.notes)
    plan = plans[0]
    short = max(plan.planned_bytes - device.free_bytes, 0)
    b = plan.budget
    per_seq = b.details.get("request_bytes", 0)
    if b.concurrency < (req.seqs or 1):
        short = max(short, int(((req.seqs or 1) - max(b.concurrency, 0.0)) * per_seq))
    alts = _alternatives(geom, engine, device, req) if alternatives else []
    limiting = limiting_lines([l for l in plan.lines if l.key != "kv"], short) if short else ()
    return replace(plan, shortfall_bytes=short, alternatives=tuple(alts), limiting=limiting)


#: GPUs of one node the alternatives grow to before they add nodes
NODE_GPUS = 8


def _alternatives(geom, engine, device, req: ServeRequest) -> list[Alternative]:
    """Changes that make a failing plan fit, each checked by solving the request that exactly
    the printed flags give: the largest ``--max-context`` (bisection, to the token), ``--kv
    fp8``, and more GPUs: ``--gpus`` on the same nodes up to :data:`NODE_GPUS` each, else
    ``--nodes`` (x2, x4) with its ``--gpus``; when the layout flags were given, the layout
    that fits is printed with them (``--tp/--pp/--dp/--ep``), so nothing typed contradicts it."""
    out: list[Alternative] = []

    def solved(r: ServeRequest) -> ServePlan | None:
        try:
            return solve_serving(geom, engine, device, r, alternatives=False)
        except InputError:
            return None

    def fits(r: ServeRequest) -> bool:
        p = solved(r)
        return p is not None and p.fits

    ctx = largest_int(lambda n: fits(replace(req, context=n)), 1, req.context - 1)
    if ctx is not None:
        out.append(Alternative("--max-context", ctx))
    if req.kv not in ("fp8",) and fits(replace(req, kv="fp8")):
        out.append(Alternative("--kv", "fp8"))
    per_node = req.gpus // req.nodes
    sizes = []
    g = per_node
    while g < NODE_GPUS:
        g *= 2
        sizes.append((g * req.nodes, req.nodes))
    sizes += [(max(per_node, NODE_GPUS if per_node < NODE_GPUS else per_node) * req.nodes * k, req.nodes * k)
              for k in (2, 4)]
    given = any(x is not None for x in (req.tp, req.pp, req.dp, req.ep))
    for gpus, nodes in sizes:
        p = solved(replace(req, gpus=gpus, nodes=nodes, tp=None, pp=None, dp=None, ep=None))
        if p is None or not p.fits:
            continue
        also: list[tuple[str, int]] = [("--gpus", gpus)] if nodes != req.nodes else []
        exact = replace(req, gpus=gpus, nodes=nodes)
        if given:
            lay = p.layout
            also += [("--tp", lay.tp), ("--pp", lay.pp), ("--dp", lay.dp)]
            ep = lay.moe_group if lay.ep else 1
            if geom.moe_layers:
                also.append(("--ep", ep))
            exact = replace(exact, tp=lay.tp, pp=lay.pp, dp=lay.dp, ep=ep if geom.moe_layers else None)
        if not fits(exact):
            continue
        main = ("--nodes", nodes) if nodes != req.nodes else ("--gpus", gpus)
        out.append(Alternative(*main, also=tuple(also)))
        break
    return out


# ---- output -----------------------------------------------------------------------------------
LABELS = {"runtime": "runtime", "weights": "weights", "activations": "activations",
          "workspace": "workspaces", "kv": "KV cache", "state": "recurrent state",
          "graphs": "CUDA graphs", "margin": "safety margin"}


def format_serve_plan(plan: ServePlan) -> str:
    """The rank's budget table in moefit's form, the engine's numbers, the notes and one
    command per node (or the shortfall and the alternatives)."""
    g, dev, lay, b = plan.geometry, plan.device, plan.layout, plan.budget
    fmt = size_format(dev.capacity_bytes)
    stage = f", stage {b.stage + 1} of {lay.pp} (layers {_rng(plan)})" if lay.pp > 1 else ""
    out = [f"model  {g.name}  {format_params(g.total_params)} total / {format_params(g.active_params)} active  "
           f"{g.num_layers} layers, {g.attention_layout()}",
           f"engine  {plan.engine.label} ({plan.engine.version})",
           f"layout  {lay.describe()}",
           f"VRAM budget per GPU{stage}  {dev.description}  {fmt(dev.free_bytes)} free of {fmt(dev.capacity_bytes)}"]
    for line in plan.lines:
        out.append(f"  {LABELS[line.key]:<18} {fmt(line.bytes):>10}   {line.detail}".rstrip())
    if plan.unassigned_bytes >= 0:
        out.append(f"  {'unassigned':<18} {fmt(plan.unassigned_bytes):>10}")
    groups = b.details.get("kv_groups", 1)
    how = (f" (\"GPU KV cache size\": {b.details['num_blocks']:,} blocks / {groups} groups x "
           f"{b.details['block_size']})" if groups > 1 else "")
    each = (f" ({b.details['blocks_per_request']} blocks each)" if groups > 1 else "")
    pool = (f"KV cache  {b.kv_tokens:,} tokens" + (" per DP replica" if lay.dp > 1 else "") +
            (f" x {lay.dp} = {plan.total_kv_tokens:,}" if lay.dp > 1 else "") + how +
            f"; {b.concurrency:.2f} sequences of {plan.request.context:,} tokens{each}" +
            (f" per replica ({b.concurrency * lay.dp:.2f} in all)" if lay.dp > 1 else ""))
    out.append(pool)
    out += [n for n in plan.notes if n]
    if plan.fits:
        cmds = plan.commands
        for i, c in enumerate(cmds):
            head = ("command" if len(cmds) == 1 else f"node {i}" if i < plan.layout.nodes else
                    "then node 0")
            out.append(f"{head}  {c}")
        return "\n".join(out)
    asked = plan.request.seqs or 1
    if b.concurrency >= asked:
        why = (f"the KV cache holds {b.concurrency:.2f} of the {asked} sequence(s) of "
               f"{plan.request.context:,} tokens asked, but the lines outside it exceed the free memory")
    else:
        why = (f"{asked} sequence(s) of {plan.request.context:,} tokens asked, "
               f"{max(b.concurrency, 0):.2f} fit in the KV cache")
    out.append(f"does not fit: short by {fmt(plan.shortfall_bytes)} per GPU ({why})")
    out.append("limiting: " + ", ".join(LABELS[k] for k in plan.limiting))
    out += format_fits_with(plan.alternatives, "more GPUs (no single flag change makes it fit)")
    return "\n".join(out)


def _rng(plan: ServePlan) -> str:
    r = stage_layers(plan.geometry.num_layers, plan.layout.pp)[plan.budget.stage]
    return f"{r.start}-{r.stop - 1}"


#: the JSON document of a vLLM / SGLang plan (docs/plan.md, "JSON (`moefit plan --json`)")
SCHEMA = "moefit.serve-plan/1"


def serve_plan_document(plan: ServePlan) -> dict:
    """The plan as the JSON-ready ``moefit.serve-plan/1`` dict: ``moefit.plan/1``'s model,
    devices (one: a rank of the stage shown), notes, and on failure ``shortfall_bytes`` (per
    GPU), ``limiting``, ``alternatives`` (``{"flag", "value", "with"}``, counts as ints);
    its own ``engine``, ``engine_version``, ``context``, ``slots`` (``--max-num-seqs``), ``kv``
    (the engine's KV dtype), ``layout``, ``kv_tokens`` (per replica) and ``kv_tokens_total``,
    ``concurrency`` (sequences of ``context`` tokens per replica), ``batched_tokens``,
    ``memory_fraction``, ``details`` (the engine's numbers), ``flags``, ``commands``."""
    g, dev, lay, b = plan.geometry, plan.device, plan.layout, plan.budget
    doc = {"schema": SCHEMA, "engine": plan.engine.name, "engine_version": plan.engine.version,
           "fits": plan.fits,
           "model": {"name": g.name, "model_type": g.model_type, "total_params": g.total_params,
                     "active_params": g.active_params, "source": g.source},
           "context": plan.request.context, "slots": b.seqs, "kv": plan.engine.kv_dtype(plan.request.kv)[0],
           "layout": {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "ep": lay.ep, "nodes": lay.nodes,
                      "gpus": lay.world},
           "devices": [{"name": f"rank (stage {b.stage})", "description": dev.description, "kind": dev.kind,
                        "capacity_bytes": dev.capacity_bytes, "free_bytes": dev.free_bytes,
                        "lines": [{"key": l.key, "bytes": l.bytes, "detail": l.detail} for l in plan.lines],
                        "unassigned_bytes": plan.unassigned_bytes}],
           "kv_tokens": b.kv_tokens, "kv_tokens_total": plan.total_kv_tokens, "concurrency": b.concurrency,
           "batched_tokens": b.batched, "memory_fraction": b.knob,
           "details": dict(b.details), "notes": [n for n in plan.notes if n]}
    if plan.fits:
        doc["flags"] = [{"flag": f, "value": v} for f, v in plan.engine.flags(plan)]
        doc["commands"] = plan.commands
    else:
        doc["shortfall_bytes"] = plan.shortfall_bytes
        doc["limiting"] = list(plan.limiting)
        doc["alternatives"] = [alternative_document(a) for a in plan.alternatives]
    return doc


def alternative_document(a: Alternative) -> dict:
    """An alternative in an engine plan's JSON: ``{"flag", "value"}`` (an int for a count), and
    ``"with"``: the flags that change with it, in the same form."""
    doc = {"flag": a.flag, "value": a.value}
    if a.also:
        doc["with"] = [{"flag": f, "value": v} for f, v in a.also]
    return doc


def weight_detail(s: StageShard) -> str:
    """``shard: experts 76.14, attention 2.08, ... GiB`` of a rank."""
    p = s.parts
    bits = [f"experts {p['experts'] / GIB:.2f}"] if p["experts"] else []
    bits += [f"attention {p['attention'] / GIB:.2f}"]
    if p["mlp"]:
        bits.append(f"MLP {p['mlp'] / GIB:.2f}")
    if p["embeddings"]:
        bits.append(f"embeddings {p['embeddings'] / GIB:.2f}")
    return "shard: " + ", ".join(bits) + " GiB"


def kv_cache_dtype(engine: "Engine", table: dict[str, tuple[str, int]], kv: str) -> tuple[str, int]:
    """``--kv`` -> the engine's ``--kv-cache-dtype`` value and bytes per element, from its
    ``table`` (bf16 / fp16 / fp8). Raises InputError naming the engine for the block formats
    (int8 / int4) it has no cache for."""
    k = kv.strip().lower()
    if k not in table:
        raise InputError(f"--kv {kv!r} with --engine {engine.name}: {engine.label}'s KV cache is bf16 / fp16 "
                         "(--kv bf16) or fp8 (--kv fp8); int8/int4 blocks are llama.cpp's "
                         "and moefit's")
    return table[k]


def command_line(parts: list[tuple[str, str | None]]) -> str:
    """``--flag value --switch`` from (flag, value or None) pairs."""
    return " ".join(f if v is None else f"{f} {v}" for f, v in parts)


def format_serve_verbose(plan: ServePlan) -> str:
    """``-v``: every pipeline stage's weights and KV bytes per token, and the engine's
    numbers (the available KV bytes, blocks, the default fraction)."""
    _, kv_el = plan.engine.kv_dtype(plan.request.kv)
    shards = stage_shards(plan.geometry, plan.layout, kv_el, plan.engine.expert_blob(plan.geometry))
    out = []
    for s in shards:
        out.append(f"stage {s.stage}  layers {s.layers.start}-{s.layers.stop - 1}  weights "
                   f"{format_bytes(s.weights)} ({weight_detail(s)})  KV {s.kv_token_bytes} B/token over "
                   f"{len(s.kv_layer_bytes)} layers" + (f", recurrent state {format_bytes(s.state_bytes)} "
                                                        f"per sequence" if s.state_bytes else ""))
    out.append("engine  " + ", ".join(
        f"{k} {format_bytes(v)}" if k.endswith(("_bytes", "_memory")) else
        f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in plan.budget.details.items()))
    return "\n".join(out)
