"""The weight arena's ring in the speed model and in the plan (moefit.plan.arena; issue 23,
item 3): the ring's pipeline formula against a step-by-step simulation of two engines and a
bounded buffer, a larger ring never predicting a slower prefill at the same expert slots,
and the plan's ring equal to a brute force over the candidates."""

from __future__ import annotations

import pytest

from moefit.devices import find_gpu
from moefit.devices.host import default_host_speed
from moefit.ingest.resolve import load_model
from moefit.memory.kv import kv_format
from moefit.memory.weights import default_arena_slots, expert_slot_bytes
from moefit.plan import throughput
from moefit.plan.arena import arena_candidates, arena_moe_seconds
from moefit.plan.request import Request
from moefit.plan.solver import solve
from moefit.plan.speed import predict, predict_plan, rates_for


def simulate(n: int, copy: float, compute: float, lead: float, ring: int) -> float:
    """Copies of ``n`` experts (``copy`` s each, one after another on the link) into a ring
    of ``ring`` slots, each expert's product (``compute`` s, one after another on the
    device) once its copy landed; a copy needs a free slot (the product of the expert
    ``ring`` copies before it done) and may start ``lead`` s before the products may.
    Returns when the last product ends, from the moment the products may start."""
    copy_end, comp_end = [], []
    for i in range(n):
        start = max(copy_end[-1] if copy_end else -lead,
                    comp_end[i - ring] if i >= ring else -lead)
        copy_end.append(start + copy)
        comp_end.append(max(copy_end[-1], comp_end[-1] if comp_end else 0.0) + compute)
    return comp_end[-1] if n else 0.0


@pytest.mark.parametrize("copy,compute,lead", [(1.0, 0.2, 30.0), (0.2, 1.0, 30.0), (1.0, 1.0, 5.0),
                                               (1.0, 0.5, 0.0), (0.3, 0.1, 200.0)])
@pytest.mark.parametrize("ring", [1, 2, 4, 16, 64, 256])
def test_the_ring_formula_follows_a_step_by_step_pipeline(copy, compute, lead, ring):
    """The formula is the fluid limit of the pipeline: within one expert's copy or product
    of the simulation (the pipeline's fill and drain)."""
    n = 250
    sim = simulate(n, copy, compute, lead, ring)
    model = arena_moe_seconds(n * copy, n * compute, copy, lead, ring)
    assert abs(model - sim) <= copy + compute + 1e-9


def test_a_larger_ring_is_never_slower_in_the_formula_or_the_simulation():
    for copy, compute, lead in [(1.0, 0.2, 30.0), (0.2, 1.0, 30.0), (1.0, 0.6, 40.0)]:
        prev_m = prev_s = float("inf")
        for ring in (1, 2, 3, 8, 16, 32, 100, 250, 400):
            m = arena_moe_seconds(250 * copy, 250 * compute, copy, lead, ring)
            s = simulate(250, copy, compute, lead, ring)
            assert m <= prev_m + 1e-12 and s <= prev_s + 1e-9, ring
            prev_m, prev_s = m, s


def test_a_bad_ring_is_refused():
    with pytest.raises(ValueError, match="ring"):
        arena_moe_seconds(1.0, 1.0, 0.1, 0.0, 0)


def _prefill(geom, ring, resident=16, chunk=8192):
    rates = rates_for(find_gpu("RTX 4090"), default_host_speed())
    res = {l.index: resident for l in geom.moe_layers}
    return predict(geom, rates, kv_format("bf16"), res, context=32768, chunk=chunk, seqs=1,
                   policy="copy", prompt_tokens=16384, arena=ring).prefill.tokens_per_s


@pytest.mark.parametrize("model", ["Qwen3-30B-A3B", "Qwen3.5-35B-A3B"])
def test_a_larger_arena_never_predicts_slower_prefill_at_the_same_expert_slots(model):
    geom = load_model(model)
    speeds = [_prefill(geom, r) for r in (1, 2, 8, 16, 32, 64, 128)]
    assert all(b >= a for a, b in zip(speeds, speeds[1:])), speeds
    # the default ring is the model without a ring (copies overlap the experts only) or faster
    assert _prefill(geom, default_arena_slots(geom)) >= _prefill(geom, None)


def test_the_candidates_are_the_default_twice_it_and_one_layers_experts():
    geom = load_model("Qwen3-30B-A3B")           # 128 experts, 8 per token
    assert arena_candidates(geom) == (16, 32, 128)
    assert arena_candidates(load_model("Qwen3-8B")) == ()


WORKLOAD = throughput.Workload(default_host_speed())


@pytest.mark.parametrize("model,gpu,context,prefill", [
    ("Qwen3.5-35B-A3B", "RTX 5060 Ti 16GB", 131072, 24576),
    ("Qwen3-30B-A3B", "RTX 4090", 32768, 8192),
    ("Qwen3-30B-A3B", "RTX 3060 12GB", 16384, 2048),
])
def test_the_plans_ring_is_a_brute_force_over_the_candidates(model, gpu, context, prefill):
    """Each candidate solved with ``--arena-slots R`` at the same chunk and scored for the
    workload; the plan takes the smallest ring within the tie of the best."""
    geom = load_model(model)
    device = find_gpu(gpu)
    req = Request(max_context=context, prefill_mode="fixed", prefill_tokens=prefill,
                  miss_policy="auto")
    plan = solve(geom, device, req, workload=WORKLOAD)
    assert plan.fits
    slot = expert_slot_bytes(geom)
    chosen = plan.devices[0].line("weight_arena").bytes // slot
    scores = {}
    for ring in arena_candidates(geom):
        fixed = solve(geom, device, req.with_(arena_slots=ring), workload=WORKLOAD)
        if not fixed.fits or fixed.prefill_selected != plan.prefill_selected:
            continue
        (p, d), = throughput.throughputs(geom, device, req, plan.context, WORKLOAD,
                                         [(fixed.prefill_selected, fixed.expert_slots)], arena=ring)
        scores[ring] = (WORKLOAD.score(p, d, fixed.prefill_selected), fixed.expert_slots)
    best = max(s for s, _ in scores.values())
    want = min(r for r, (s, _) in scores.items() if s >= best * (1 - throughput.TIE))
    assert chosen == want, scores
    assert plan.expert_slots == scores[want][1]
    # the plan's speed line prices the ring it commits
    speed = predict_plan(plan, WORKLOAD.host)
    p, d = throughput.throughputs(geom, device, req, plan.context, WORKLOAD,
                                  [(plan.prefill_selected, plan.expert_slots)], arena=chosen)[0]
    assert speed.decode.tokens_per_s == pytest.approx(d)


def test_a_given_ring_and_the_cpu_policy_are_kept():
    geom = load_model("Qwen3.5-35B-A3B")
    device = find_gpu("RTX 5060 Ti 16GB")
    req = Request(max_context=131072, prefill_mode="fixed", prefill_tokens=24576, miss_policy="auto")
    given = solve(geom, device, req.with_(arena_slots=24), workload=WORKLOAD)
    assert given.devices[0].line("weight_arena").bytes == 24 * expert_slot_bytes(geom)
    cpu = solve(geom, device, req.with_(miss_policy="cpu"), workload=WORKLOAD)
    assert cpu.devices[0].line("weight_arena").bytes == 0
    # without a workload (no speed figures asked) the default ring stays
    plain = solve(geom, device, req)
    assert plain.devices[0].line("weight_arena").bytes == \
        default_arena_slots(geom) * expert_slot_bytes(geom)
