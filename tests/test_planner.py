"""The solver: the field scenarios (docs/design.md, solving) and its invariants.

Field scenario: Qwen3.5-35B-A3B (hybrid, 10 of 40 layers full attention), YaRN x2 to
524288 tokens, int8 KV, ``--prefill 24576`` on a 16 GB card.
"""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moefit.devices import Device, find_gpu
from moefit.errors import InputError
from moefit.memory.kv import KV_FORMATS, kv_bytes
from moefit.memory.runtime import default_reserve_bytes, runtime_bytes
from moefit.memory import layer_kinds, staging
from moefit.memory.staging import staging_model
from moefit.memory.weights import expert_slot_bytes, weight_arena_bytes
from moefit.ingest.resolve import load_model
from moefit.plan.request import Request
from moefit.plan.solver import solve
from moefit.plan.types import MANDATORY

MIB, GIB = 1 << 20, 1 << 30
FIELD = Request(max_context=524288, kv="int8", prefill_mode="fixed", prefill_tokens=24576,
                rope_scaling="yarn", rope_scale=2.0, reserve_bytes=512 * MIB)


def cuda(free: int, capacity: int | None = None) -> Device:
    cap = capacity if capacity is not None else free
    return Device(label="cuda:0", description="test card", kind="cuda",
                  capacity_bytes=cap, free_bytes=free, simulated=True)


def mandatory_cost(geom, device, req, chunk, context):
    """Mandatory lines + expert floor, priced line by line from the memory models."""
    fmt = KV_FORMATS[req.kv]
    floor = req.expert_cache if req.expert_cache is not None else req.min_expert_cache
    reserve = default_reserve_bytes(device) if req.reserve_bytes is None else req.reserve_bytes
    return (runtime_bytes(device) + geom.weight_bytes()
            + weight_arena_bytes(geom, req.miss_policy, req.arena_slots)
            + kv_bytes(geom, fmt, context, req.slots, chunk).bytes
            + staging_model(geom, fmt, req.slots).bytes(chunk)
            + reserve + floor * expert_slot_bytes(geom))


@pytest.fixture(scope="module")
def qwen35():
    return load_model("Qwen3.5-35B-A3B")


def test_field_budget_ordering_on_16gb_card_keeps_chunk_and_shrinks_residency(qwen35):
    """On the field's 16 GB card every mandatory line, with the full 24576-token chunk, is
    priced first; the expert cache gets what remains instead of starving the staging."""
    dev = find_gpu("RTX 5060 Ti 16GB")
    plan = solve(qwen35, dev, FIELD)
    assert plan.fits and not plan.prefill_clamped
    assert plan.prefill_selected == 24576
    assert 0 < plan.expert_slots < qwen35.total_experts
    need = mandatory_cost(qwen35, dev, FIELD, 24576, 524288)
    assert plan.expert_slots == (dev.free_bytes - need) // expert_slot_bytes(qwen35)
    assert plan.devices[0].unassigned_bytes < expert_slot_bytes(qwen35)
    bigger = solve(qwen35, find_gpu("RTX 4090"), FIELD)
    assert bigger.prefill_selected == 24576 and bigger.expert_slots > plan.expert_slots


def test_field_prefill_fallback_on_12gb_card_clamps_on_256_grid(qwen35):
    """On a 12 GB card the 24576 chunk does not fit: it is clamped, and the clamp is noted."""
    dev = find_gpu("RTX 3060 12GB")
    plan = solve(qwen35, dev, FIELD)
    assert plan.fits and plan.prefill_clamped
    c = plan.prefill_selected
    assert c % 256 == 0 and 256 <= c < 24576
    assert mandatory_cost(qwen35, dev, FIELD, c, 524288) <= dev.free_bytes
    assert mandatory_cost(qwen35, dev, FIELD, c + 256, 524288) > dev.free_bytes
    assert f"prefill: requested 24576, clamped to {c} due to VRAM budget" in plan.notes
    assert plan.expert_slots == 0   # a clamped chunk leaves the cache at its floor


def test_field_strict_turns_the_clamp_into_a_failure(qwen35):
    dev = find_gpu("RTX 3060 12GB")
    plan = solve(qwen35, dev, FIELD.with_(strict=True))
    assert not plan.fits
    flags = {a.flag: a.value for a in plan.alternatives}
    assert "--prefill" in flags
    again = solve(qwen35, dev, FIELD.with_(prefill_tokens=flags["--prefill"]))
    assert again.fits and not again.prefill_clamped


def test_field_hard_failure_gives_shortfall_and_alternatives_that_fit(qwen35):
    dev = cuda(free=6 * GIB, capacity=6 * GIB)
    plan = solve(qwen35, dev, FIELD)
    assert not plan.fits
    minimum = mandatory_cost(qwen35, dev, FIELD, 256, 524288)
    assert plan.shortfall_bytes == minimum - dev.free_bytes
    assert "kv" in plan.limiting
    assert plan.alternatives, "a failing plan must offer alternatives"
    for alt in plan.alternatives:
        field = {"--max-context": "max_context", "--kv": "kv", "--prefill": "prefill_tokens",
                 "--parallel": "slots", "--min-expert-cache": "min_expert_cache"}[alt.flag]
        assert solve(qwen35, dev, FIELD.with_(**{field: alt.value})).fits, alt
    ctx = {a.flag: a.value for a in plan.alternatives}["--max-context"]
    # the largest: 256 tokens more does not fit
    assert not solve(qwen35, dev, FIELD.with_(max_context=ctx + 256)).fits


def test_context_beyond_trained_window_names_rope_scaling(qwen35):
    with pytest.raises(InputError, match="--rope-scaling"):
        solve(qwen35, cuda(100 * GIB), Request(max_context=524288))
    with pytest.raises(InputError, match="--rope-scale"):
        solve(qwen35, cuda(100 * GIB),
              Request(max_context=524289, rope_scaling="yarn", rope_scale=2.0))
    # with YaRN the limit is original window x scale
    assert solve(qwen35, cuda(100 * GIB), FIELD).context == 262144 * 2


def test_auto_prefill_takes_largest_chunk_up_to_ceiling(qwen35):
    req = FIELD.with_(prefill_mode="auto", prefill_tokens=16384)
    assert solve(qwen35, cuda(80 * GIB), req).prefill_selected == 16384
    small = solve(qwen35, find_gpu("RTX 3060 12GB"), req)
    assert small.fits and small.prefill_selected < 16384 and small.prefill_selected % 256 == 0


def test_pinned_expert_cache_and_floor(qwen35):
    dev = cuda(40 * GIB)
    pinned = solve(qwen35, dev, FIELD.with_(expert_cache=100))
    assert pinned.expert_slots == 100
    assert sum(n for _, n in pinned.experts_per_layer) == 100
    everything = FIELD.with_(min_expert_cache=qwen35.total_experts)
    assert solve(qwen35, cuda(80 * GIB), everything).expert_slots == qwen35.total_experts
    with pytest.raises(InputError, match="10241.*10240 routed experts"):
        solve(qwen35, dev, FIELD.with_(min_expert_cache=10241))
    with pytest.raises(InputError, match="--min-expert-cache 200 is above --expert-cache 100"):
        solve(qwen35, dev, FIELD.with_(expert_cache=100, min_expert_cache=200))


def test_expert_flags_on_a_dense_model_are_errors():
    with pytest.raises(InputError, match="dense model"):
        solve(load_model("Qwen3-8B"), cuda(24 * GIB), Request(max_context=4096, expert_cache=5))


def test_dense_model_has_no_expert_lines():
    g = load_model("Qwen3-8B")
    plan = solve(g, cuda(24 * GIB), Request(max_context=32768))
    assert plan.fits and plan.expert_slots == 0
    assert plan.devices[0].line("experts").bytes == 0
    assert plan.devices[0].line("weight_arena").bytes == 0


def test_copy_miss_policy_prices_the_weight_arena(qwen35):
    plan = solve(qwen35, cuda(40 * GIB), FIELD.with_(miss_policy="copy"))
    # default ring: 2 x 8 experts per token, one 3 x 2048 x 512 x 2 B blob each
    assert plan.devices[0].line("weight_arena").bytes == 16 * 3 * 2048 * 512 * 2


# ---- properties ---------------------------------------------------------------------

PRESETS = ["Qwen3.5-35B-A3B", "Qwen3-30B-A3B", "gpt-oss-20b", "DeepSeek-V2-Lite",
           "Mixtral-8x7B-v0.1", "Qwen3-Next-80B-A3B-Instruct"]


@st.composite
def requests(draw):
    # contexts every preset supports as trained, or YaRN x4 (within every preset's limit)
    ctx, scaling, scale = draw(st.sampled_from(
        [(4096, None, None), (32768, None, None), (131072, "yarn", 4.0)]))
    return Request(
        max_context=ctx, rope_scaling=scaling, rope_scale=scale,
        yarn_orig_ctx=32768 if scaling else None,
        slots=draw(st.integers(1, 4)),
        kv=draw(st.sampled_from(sorted(KV_FORMATS))),
        prefill_mode=draw(st.sampled_from(["auto", "fixed"])),
        prefill_tokens=draw(st.integers(256, 32768)),
        strict=draw(st.booleans()),
        reserve_bytes=draw(st.integers(0, 2 * GIB)),
        min_expert_cache=draw(st.integers(0, 256)),   # Mixtral-8x7B has 256 in all
        miss_policy=draw(st.sampled_from(["cpu", "copy"])),
    )


frees = st.integers(1 * GIB, 200 * GIB)
PROP = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROP
@given(name=st.sampled_from(PRESETS), req=requests(), free=frees)
def test_plan_never_exceeds_the_device(name, req, free):
    g = load_model(name)
    plan = solve(g, cuda(free), req, alternatives=False)
    if plan.fits:
        assert plan.devices[0].planned_bytes <= free
        assert plan.devices[0].unassigned_bytes >= 0


@PROP
@given(name=st.sampled_from(PRESETS), req=requests(), free=frees)
def test_failure_exactly_when_minimum_configuration_does_not_fit(name, req, free):
    g = load_model(name)
    plan = solve(g, cuda(free), req, alternatives=False)
    target = min(req.prefill_tokens, -(-plan.context // 256) * 256)
    lowest = target if (req.prefill_mode == "fixed" and req.strict) else min(req.prefill_min, target)
    assert plan.fits == (mandatory_cost(g, cuda(free), req, lowest, plan.context) <= free)


@PROP
@given(name=st.sampled_from(PRESETS), req=requests(), free=frees)
def test_mandatory_lines_never_shrink_to_feed_the_expert_cache(name, req, free):
    g = load_model(name)
    plan = solve(g, cuda(free), req, alternatives=False)
    if not plan.fits:
        return
    lines = {l.key: l.bytes for l in plan.devices[0].lines}
    c = plan.prefill_selected
    fmt = KV_FORMATS[req.kv]
    assert lines["kv"] == kv_bytes(g, fmt, plan.context, req.slots, c).bytes
    assert lines["prefill"] == staging_model(g, fmt, req.slots).bytes(c)
    assert lines["weights"] == g.weight_bytes()
    assert lines["margin"] == req.reserve_bytes
    assert set(MANDATORY) <= set(lines)
    floor = min(req.min_expert_cache, g.total_experts)
    if plan.expert_slots > floor:
        # residency above the floor only once the requested chunk is kept
        assert not plan.prefill_clamped


@PROP
@given(name=st.sampled_from(PRESETS), req=requests(), free=frees,
       extra=st.integers(0, 64 * GIB))
def test_more_vram_never_gives_a_smaller_chunk_or_fewer_slots(name, req, free, extra):
    g = load_model(name)
    a = solve(g, cuda(free), req, alternatives=False)
    b = solve(g, cuda(free + extra), req, alternatives=False)
    if a.fits:
        assert b.fits
        assert b.prefill_selected >= a.prefill_selected
        assert b.expert_slots >= a.expert_slots


@PROP
@given(name=st.sampled_from(PRESETS), req=requests())
def test_slots_spread_evenly_and_capped_per_layer(name, req):
    g = load_model(name)
    plan = solve(g, cuda(200 * GIB), req, alternatives=False)
    per = dict(plan.experts_per_layer)
    assert sum(per.values()) == plan.expert_slots
    if per:
        counts = [n for n in per.values()]
        full = {l.index: l.moe.num_experts for l in g.moe_layers}
        assert all(per[i] <= full[i] for i in per)
        unfilled = [per[i] for i in per if per[i] < full[i]]
        if unfilled:
            assert max(unfilled) - min(counts) <= 1


def test_expert_slots_are_priced_per_layer_when_blobs_differ():
    """GGUF files mix quant types by layer: each slot costs its own layer's blob."""
    import dataclasses

    from moefit.ingest.geometry import ExactWeights
    from moefit.memory.weights import spread_slots

    base = load_model("Qwen3-30B-A3B")
    blobs = tuple((l.index, 1_000_000 if l.index % 2 else 3_000_000) for l in base.moe_layers)
    g = dataclasses.replace(base, exact=ExactWeights(
        weight_bytes=base.analytic_weight_bytes(), expert_blob_bytes=blobs, skipped_bytes=0,
        total_params=base.total_params, files=1))
    req = Request(max_context=4096, prefill_tokens=1024, reserve_bytes=0)
    need = mandatory_cost(g, cuda(0), req, 1024, 4096)
    plan = solve(g, cuda(need + 150_000_000), req)
    per = dict(plan.experts_per_layer)
    size = dict(blobs)
    cache = sum(n * size[i] for i, n in per.items())
    assert plan.devices[0].line("experts").bytes == cache <= 150_000_000
    # one more slot (it lands on the layer spread_slots gives it to) would not fit
    more = dict(spread_slots(g, plan.expert_slots + 1))
    assert sum(n * size[i] for i, n in more.items()) > 150_000_000
    assert plan.expert_slots > 150_000_000 // 3_000_000   # more than max-blob pricing gives


@pytest.mark.parametrize("slots", [1, 64])
def test_a_calibration_is_priced_with_the_logits_of_every_slot(slots):
    """A calibration is measured with one sequence; with --slots N the prefill line adds
    the other sequences' logits rows wherever they enlarge the fixed region."""
    from dataclasses import replace

    from moefit.memory.staging import fixed_region_bytes

    g = load_model("Qwen3-30B-A3B")
    fmt = KV_FORMATS["int8"]
    calibrated = replace(staging_model(g, fmt), const_bytes=123 * MIB, per_token_bytes=4096,
                         calibrated=True)
    req = Request(max_context=8192, slots=slots, kv="int8", prefill_mode="fixed",
                  prefill_tokens=1024)
    plan = solve(g, cuda(80 * GIB), req, staging=calibrated)
    extra = fixed_region_bytes(g, fmt, slots=slots) - fixed_region_bytes(g, fmt)
    assert (extra > 0) == (slots > 1)
    assert plan.devices[0].line("prefill").bytes == calibrated.bytes(1024) + extra


# ---- MLA staging: priced from each layer's own tensors ------------------------------------

def _kv_b_bytes_by_scan(layer, geom, act):
    """The fp8 ``kv_b_proj`` bytes of an MLA layer as they were priced before the closed
    form: a scan of every fp8 dense tensor of the model for the layer's own (per layer)."""
    found = [t for t in staging.fp8_dense_tensors(geom)
             if t in layer.tensors and t.name.endswith("kv_b_proj.weight")]
    return found[0].numel * act if found else 0


MLA_PRESETS = ("DeepSeek-R1", "DeepSeek-V2-Lite", "DeepSeek-V3", "DeepSeek-V3.1", "Kimi-K2-Instruct")


def test_the_mla_presets_are_every_preset_with_mla_layers():
    from moefit.ingest.resolve import list_presets
    assert MLA_PRESETS == tuple(n for n in list_presets() if any(
        l.attention.kind == "mla" for l in load_model(n).layers))


@pytest.mark.parametrize("name", MLA_PRESETS)
def test_mla_staging_in_closed_form_equals_the_per_layer_scan(name, monkeypatch):
    """Each MLA layer's step is ``const + per_token x chunk`` from its own tensors
    (:func:`moefit.memory.layer_kinds.mla_kv_b_bytes`); the staging model equals the one
    priced by scanning the model's fp8 tensors for every layer, at every KV format and
    several chunks (fp8 checkpoints: a kv_b_proj is dequantized, so the term is not 0)."""
    geom = load_model(name)
    act = staging.compute_bytes(geom)
    mla = [l for l in geom.layers if l.attention.kind == "mla"]
    per_layer = [layer_kinds.mla_kv_b_bytes(l, geom, act) for l in mla]
    assert per_layer == [_kv_b_bytes_by_scan(l, geom, act) for l in mla]
    assert all(per_layer) if geom.quant.method == "fp8" else not any(per_layer)
    chunks = (1, 256, 4096, 16384, 65536)
    closed = [staging_model(geom, f, slots).bytes(c) for f in KV_FORMATS.values()
              for slots in (1, 4) for c in chunks]
    monkeypatch.setattr(layer_kinds, "mla_kv_b_bytes", _kv_b_bytes_by_scan)
    scanned = [staging_model(geom, f, slots).bytes(c) for f in KV_FORMATS.values()
               for slots in (1, 4) for c in chunks]
    assert closed == scanned
