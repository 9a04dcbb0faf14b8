"""The expert slots spread by a routing profile (issue 23, item 5;
:func:`moefit.memory.weights.routed_order`): the most expected hits for the slots, checked
against an exhaustive optimum; the even spread for uniform routing; the same bytes the
budget priced; and the predicted hit rate the plan prints, against the profile's counts.
The runtime side (recorded routing, measured hit rates) is tests/runtime/test_routing_spread.py."""

import copy
import json

import numpy as np
import pytest

from moefit.cli import main
from moefit.devices import find_gpu
from moefit.ingest.resolve import load_model
from moefit.memory.weights import (expert_cache_bytes, most_slots, place_slots, routed_order,
                                   spread_slots)
from moefit.plan.request import Request
from moefit.plan.solver import solve
from moefit.plan.speed import routing_chances


def _profile(geom, seed: int, tokens: int = 2000) -> dict[int, dict[int, int]]:
    """The counts of ``tokens`` tokens routed at random: each picks ``k`` distinct experts
    of a layer (Gumbel top-k) with weights falling off as a power of the expert's rank, a
    different exponent (0: flat, 3: a few experts take most) and order per layer."""
    rng = np.random.default_rng(seed)
    out = {}
    for l in geom.moe_layers:
        n, k = l.moe.num_experts, l.moe.experts_per_token
        s = rng.choice((0.0, 0.5, 1.0, 2.0, 3.0))
        logw = -s * np.log(1 + rng.permutation(n))
        keys = logw + rng.gumbel(size=(tokens, n))
        picked = np.argpartition(-keys, k - 1, axis=1)[:, :k]
        out[l.index] = {e: int(c) for e, c in enumerate(np.bincount(picked.ravel(), minlength=n))}
    return out


def _share(profile, layer) -> list[float]:
    """A layer's counts as shares of its routed pairs, most counted first (a profile
    recorded on a run has the same pairs in every layer: tokens x k)."""
    total = sum(profile[layer].values())
    return sorted((c / total for c in profile[layer].values()), reverse=True)


def _hits(profile, per_layer) -> float:
    """Expected resident pairs per routed pair of a layer, summed over the layers: the
    ``n`` most counted experts of each layer resident."""
    return sum(sum(_share(profile, l)[:n]) for l, n in per_layer)


def _best(profile, layers, slots) -> float:
    """The most routed pairs ``slots`` slots can hold, by dynamic programming over the
    layers (every split of the slots between layers is tried)."""
    best = {0: 0.0}
    for l in layers:
        top = _share(profile, l)
        prefix = [0.0]
        for c in top:
            prefix.append(prefix[-1] + c)
        nxt: dict[int, float] = {}
        for used, value in best.items():
            for n in range(len(prefix)):
                if used + n <= slots:
                    nxt[used + n] = max(nxt.get(used + n, -1.0), value + prefix[n])
        best = nxt
    return best[slots]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_spread_holds_the_most_routed_pairs_any_split_could(seed):
    geom = load_model("Mixtral-8x7B-v0.1")           # 32 layers x 8 experts, one blob size
    profile = _profile(geom, seed)
    route = routing_chances(geom, profile)
    layers = [l.index for l in geom.moe_layers]
    # equal token counts per layer: pairs per layer are proportional to the chances
    for slots in (1, 7, 32, 45, 100, 200, 255):
        spread = spread_slots(geom, slots, routing=route)
        assert sum(n for _, n in spread) == slots
        assert _hits(profile, spread) == pytest.approx(_best(profile, layers, slots), rel=1e-9)
        assert _hits(profile, spread) >= _hits(profile, spread_slots(geom, slots))


def test_uniform_routing_spreads_evenly():
    geom = load_model("Qwen3-30B-A3B")
    flat = {l.index: {e: 5 for e in range(l.moe.num_experts)} for l in geom.moe_layers}
    route = routing_chances(geom, flat)
    for slots in (0, 1, 47, 48, 49, 1000, geom.total_experts):
        assert spread_slots(geom, slots, routing=route) == spread_slots(geom, slots)


def test_several_devices_continue_the_same_order():
    """Each device takes the next slots of the order: the devices together hold the spread
    of all their slots, and no expert twice."""
    geom = load_model("Qwen3-30B-A3B")
    route = routing_chances(geom, _profile(geom, 4))
    blob = geom.expert_blob_bytes()[geom.moe_layers[0].index]
    parts = place_slots(geom, [300 * blob, 500 * blob, 10 ** 15], 2000, route)
    assert [sum(n for _, n in p) for p in parts] == [300, 500, 1200]
    total = {l: sum(dict(p)[l] for p in parts) for l in dict(parts[0])}
    assert tuple(total.items()) == spread_slots(geom, 2000, routing=route)


def test_mixed_blob_sizes_price_the_spread_they_plan():
    """GGUF type mixes: a layer's slot is its own blob; the bytes priced are the spread's,
    and the most slots that fit a budget are the most whose spread fits."""
    geom = copy.copy(load_model("Mixtral-8x7B-v0.1"))
    sizes = {l.index: (1 << 20) * (3 if l.index % 3 else 5) for l in geom.moe_layers}
    object.__setattr__(geom, "expert_blob_bytes", lambda: dict(sizes))
    route = routing_chances(geom, _profile(geom, 1))
    for slots in (0, 5, 40, 129, 256):
        spread = spread_slots(geom, slots, routing=route)
        assert expert_cache_bytes(geom, slots, routing=route) == sum(n * sizes[l] for l, n in spread)
    budget = 300 << 20
    n = most_slots(geom, budget, 0, geom.total_experts, route)
    assert expert_cache_bytes(geom, n, routing=route) <= budget < expert_cache_bytes(geom, n + 1, routing=route)
    assert routed_order(route, tuple(sizes.items()))[1][n] <= budget


def test_plan_prints_the_predicted_hit_rate_of_its_spread(capsys, tmp_path):
    geom = load_model("Qwen3-30B-A3B")
    profile = _profile(geom, 7)
    path = tmp_path / "routing.json"
    path.write_text(json.dumps({str(l): {str(e): c for e, c in per.items()} for l, per in profile.items()}))
    args = ["plan", "Qwen3-30B-A3B", "--gpu", "RTX 4090", "--max-context", "32K", "--prefill", "4096",
            "--routing-profile", str(path)]
    assert main([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    per_layer = [(d["layer"], d["slots"]) for d in doc["experts"]["per_layer"]]
    assert len({n for _, n in per_layer}) > 1             # not an even spread
    layers = len(profile)
    # a decode step of one token: the resident share of the routed pairs, from the counts
    assert doc["experts"]["predicted_hit_rate"] == pytest.approx(_hits(profile, per_layer) / layers)
    even = spread_slots(geom, doc["experts"]["slots"])
    assert doc["experts"]["even_hit_rate"] == pytest.approx(_hits(profile, even) / layers)
    assert doc["experts"]["predicted_hit_rate"] > doc["experts"]["even_hit_rate"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"predicted hit rate {100 * doc['experts']['predicted_hit_rate']:.1f}%" in out


def test_without_a_profile_the_plan_is_unchanged():
    geom = load_model("Qwen3-30B-A3B")
    req = Request(max_context=32768)
    plan = solve(geom, find_gpu("RTX 4090"), req)
    assert plan.request.routing is None and len({n for _, n in plan.experts_per_layer}) <= 2
