"""Choices by throughput (moefit.plan.throughput): ``--prefill auto`` by the predicted
objective among the chunks that fit, the clamp's predicted cost, the alternatives ranked."""

import re
from dataclasses import replace

import pytest

from moefit.cli import main
from moefit.devices import find_gpu
from moefit.devices.host import default_host_speed
from moefit.ingest.resolve import load_model
from moefit.plan.request import CHUNK_GRID, Request
from moefit.plan.solver import solve
from moefit.plan.speed import predict_plan, rates_for
from moefit.plan.throughput import TIE, Workload, candidate_chunks, throughputs

HOST = default_host_speed()
FIELD = dict(max_context=262144)


def score(plan, work: Workload, prompt: int) -> float:
    s = predict_plan(plan, work.host, prompt_tokens=work.prompt_tokens)
    return work.score(s.prefill.tokens_per_s, s.decode.tokens_per_s, prompt)


def brute_force(geom, device, req: Request, work: Workload, top: int) -> dict[int, float]:
    """Every chunk of the grid up to ``top``, solved as ``--prefill N --strict`` (the
    plain solver, without a workload) and predicted (predict_plan): the objective's
    score of each that fits."""
    out = {}
    for c in range(CHUNK_GRID, top + 1, CHUNK_GRID):
        p = solve(geom, device, req.with_(prefill_mode="fixed", prefill_tokens=c, strict=True),
                  alternatives=False)
        if p.fits:
            out[c] = score(p, work, top)
    return out


@pytest.mark.parametrize("policy,objective,gpu", [
    ("cpu", "balanced", "RTX 5060 Ti 16GB"), ("auto", "balanced", "RTX 5060 Ti 16GB"),
    ("cpu", "decode", "RTX 4090"), ("auto", "prefill", "RTX 3060 12GB"),
    ("cpu", "balanced", "RTX 3060 12GB")])
def test_the_chosen_chunk_is_the_brute_force_best(policy, objective, gpu):
    geom, device = load_model("Qwen3.5-35B-A3B"), find_gpu(gpu)
    req = Request(**FIELD, miss_policy=policy, prefill_tokens=8192)
    work = Workload(HOST, objective)
    plan = solve(geom, device, req, workload=work)
    old = solve(geom, device, req)                    # no workload: the largest that fits
    assert plan.fits and old.fits
    scores = brute_force(geom, device, req, work, 8192)
    assert max(scores) == old.prefill_selected       # the grid's largest that fits
    top = max(scores.values())
    best = max(c for c, x in scores.items() if x >= top * (1 - TIE))   # ties: the larger chunk
    # 32 candidates at most over 32 grid chunks: every chunk is weighed, so the choice is exact
    assert plan.prefill_selected == best, (plan.notes, sorted(scores.items(), key=lambda x: -x[1])[:3])
    # the weight arena's ring is chosen at that chunk afterwards (plan/arena.py, tests/test_arena.py):
    # the default ring is one of its candidates, so it can only raise the score
    assert score(plan, work, 8192) >= scores[best] * (1 - 1e-9)
    if best != old.prefill_selected:
        assert any(n.startswith(f"prefill: auto, {best} of the chunks that fit up to "
                                f"{old.prefill_selected}: predicted {objective}") for n in plan.notes)
        assert plan.expert_slots > old.expert_slots  # what the smaller chunk bought


def test_a_wide_range_is_strided_and_stays_near_the_best():
    geom, device = load_model("Qwen3.5-35B-A3B"), find_gpu("RTX 5060 Ti 16GB")
    req = Request(**FIELD, miss_policy="cpu")         # auto ceiling 16384: 64 grid chunks
    work = Workload(HOST)
    plan = solve(geom, device, req, workload=work)
    scores = brute_force(geom, device, req, work, 16384)
    assert len(candidate_chunks(256, 16384, CHUNK_GRID)) <= 32 < len(scores)
    assert score(plan, work, 16384) >= 0.99 * max(scores.values())


def test_budget_rules_stay_mandatory_lines_first_and_the_cache_takes_the_rest():
    geom, device = load_model("Qwen3.5-35B-A3B"), find_gpu("RTX 5060 Ti 16GB")
    req = Request(**FIELD, miss_policy="cpu")
    plan = solve(geom, device, req, workload=Workload(HOST, "decode"))
    fixed = solve(geom, device, req.with_(prefill_mode="fixed", prefill_tokens=plan.prefill_selected))
    assert plan.prefill_selected < 16384
    lines = lambda p: {l.key: l.bytes for l in p.devices[0].lines}   # noqa: E731
    assert lines(plan) == lines(fixed)                 # every line as if that chunk were asked
    assert plan.devices[0].unassigned_bytes < geom.expert_blob_bytes()[geom.moe_layers[0].index]


def test_more_vram_never_predicts_a_worse_objective():
    geom = load_model("Qwen3.5-35B-A3B")
    req = Request(max_context=131072, miss_policy="cpu")
    for objective in ("balanced", "decode", "prefill"):
        work = Workload(HOST, objective)
        last = 0.0
        for gib in (11, 12, 14, 16, 20, 24):
            device = replace(find_gpu("RTX 5060 Ti 16GB"), free_bytes=gib << 30, capacity_bytes=gib << 30)
            plan = solve(geom, device, req, workload=work)
            assert plan.fits
            s = score(plan, work, 16384)
            assert s >= last * (1 - 1e-9), (objective, gib)
            last = s


def test_the_fast_prediction_is_the_plans_prediction():
    """throughputs (layers of one shape priced once) against predict_plan of the same plan."""
    geom, device = load_model("Qwen3.5-35B-A3B"), find_gpu("RTX 5060 Ti 16GB")
    for policy in ("cpu", "auto"):
        plan = solve(geom, device, Request(**FIELD, miss_policy=policy))
        for prompt in (None, 20000):
            work = Workload(HOST, prompt_tokens=prompt)
            (pf, dc), = throughputs(geom, device, plan.request, plan.context, work,
                                    [(plan.prefill_selected, plan.expert_slots)])
            s = predict_plan(plan, HOST, prompt_tokens=prompt)
            assert pf == pytest.approx(s.prefill.tokens_per_s, rel=1e-9)
            assert dc == pytest.approx(s.decode.tokens_per_s, rel=1e-9)
    assert rates_for(find_gpu("RTX 4090"), HOST) is not None


def run(capsys, *args):
    code = main(list(args))
    return code, capsys.readouterr().out


def test_a_clamp_logs_its_predicted_cost(capsys):
    args = ["plan", "Qwen3.5-35B-A3B", "--gpu", "RTX 3060 12GB", "--max-context", "512K",
            "--rope-scaling", "yarn", "--rope-scale", "2", "--kv", "int8", "--prefill", "24576",
            "--no-calibration"]
    code, out = run(capsys, *args)
    m = re.search(r"prefill: requested 24576, clamped to (\d+) due to VRAM budget "
                  r"\(predicted prefill (\d+) -> (\d+) tokens/s\)", out)
    assert code == 0 and m, out
    geom, device = load_model("Qwen3.5-35B-A3B"), find_gpu("RTX 3060 12GB")
    req = Request(max_context=524288, rope_scaling="yarn", rope_scale=2.0, kv="int8",
                  prefill_mode="fixed", prefill_tokens=24576, miss_policy="auto")
    plan = solve(geom, device, req)
    assert plan.prefill_selected == int(m[1])
    at = lambda c: predict_plan(replace(plan, prefill_selected=c), HOST).prefill.tokens_per_s  # noqa: E731
    assert (int(m[2]), int(m[3])) == (round(at(24576)), round(at(plan.prefill_selected)))


def test_alternatives_are_ranked_by_predicted_throughput(capsys):
    """A plan that does not fit: its alternatives in the order of the objective's
    prediction (here the decode order and the prefill order differ)."""
    import json

    orders = {}
    for objective in ("decode", "prefill"):
        code, out = run(capsys, "plan", "Qwen3.5-35B-A3B", "--gpu", "RTX 4060 8GB", "--max-context", "256K",
                        "--json", "--no-calibration", "--objective", objective)
        doc = json.loads(out)
        assert code == 3 and len(doc["alternatives"]) >= 3
        key = f"{objective}_tokens_per_s"
        rates = [a["speed"][key] if a.get("speed") else -1 for a in doc["alternatives"]]
        assert rates == sorted(rates, reverse=True), doc["alternatives"]
        assert rates[-1] == -1                       # llama.cpp's remedy: not predicted, last
        orders[objective] = [(a["flag"], a["value"]) for a in doc["alternatives"]]
    assert orders["decode"] != orders["prefill"]


# ---- several devices and --max-context max (issue 23, item 4) ---------------------------------

@pytest.mark.parametrize("policy", ["cpu", "auto"])
def test_the_expert_split_chooses_its_chunk_by_throughput_too(policy):
    """Two cards, the expert split: the chosen chunk against every grid chunk solved as
    ``--prefill N --strict`` and predicted (predict_plan: every device's slots resident)."""
    geom = load_model("Qwen3.5-35B-A3B")
    devices = (find_gpu("RTX 5060 Ti 16GB"), find_gpu("RTX 3060 12GB"))
    req = Request(**FIELD, miss_policy=policy, split="experts", prefill_tokens=8192)
    work = Workload(HOST)
    plan = solve(geom, devices, req, workload=work)
    old = solve(geom, devices, req)
    assert plan.fits and old.fits and old.prefill_selected == 8192
    scores = brute_force(geom, devices, req, work, 8192)
    top = max(scores.values())
    # the choice weighs the slots of every device as the plan places them; ties: the larger
    assert scores[plan.prefill_selected] >= top * (1 - TIE) - 1e-9
    assert plan.prefill_selected == max(c for c, x in scores.items() if x >= top * (1 - TIE))
    if plan.prefill_selected < 8192:
        assert plan.expert_slots > old.expert_slots
        assert any(n.startswith(f"prefill: auto, {plan.prefill_selected} of the chunks") for n in plan.notes)
    for d in plan.devices:
        assert d.unassigned_bytes >= 0


def test_max_context_max_chooses_its_chunk_by_throughput_at_the_context_it_fits(capsys):
    import json

    args = ["plan", "Qwen3.5-35B-A3B", "--gpu", "RTX 5060 Ti 16GB", "--kv", "k8v4",
            "--rope-scaling", "yarn", "--rope-scale", "4", "--miss-policy", "cpu",
            "--max-context", "max", "--no-calibration", "--json"]
    code, out = run(capsys, *args)
    doc = json.loads(out)
    assert code == 0
    geom, device = load_model("Qwen3.5-35B-A3B"), find_gpu("RTX 5060 Ti 16GB")
    req = Request(max_context=doc["context"], kv="k8v4", rope_scaling="yarn", rope_scale=4.0,
                  miss_policy="cpu")
    work = Workload(HOST)
    scores = brute_force(geom, device, req, work, 16384)
    chosen = doc["prefill"]["selected"]
    assert chosen < max(scores)                       # not the largest chunk that fits
    assert scores[chosen] >= 0.99 * max(scores.values())
    assert any(n.startswith(f"prefill: auto, {chosen} of the chunks that fit") for n in doc["notes"])
