"""The weight arena's copies on a copy stream (moefit.runtime.moe.streams), on the simulated
device: the order the host enqueues copies, waits and frees (the schedule a CUDA device
runs with streams and events), the bytes each expert computes on, and the same tokens with
and without copies issued ahead. Nothing here measures a GPU: a CUDA run's overlap is in
the profile trace benchmarks/gpu_validate.py writes (docs/validation-gpu.md)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

pytest.importorskip("transformers")

from conftest import plan_for  # noqa: E402
from moefit.runtime.engine import Engine, EngineOptions  # noqa: E402
from moefit.runtime.moe.streams import ArenaRing  # noqa: E402
from reference import prompt  # noqa: E402

OPTS = dict(progress=False, chunk=32, q_block=16, kv_block=32)


def blobs(layers=3, experts=8, n=16):
    """Distinct host blobs per (layer, expert)."""
    return {(l, e): torch.full((n,), float(100 * l + e)) for l in range(layers) for e in range(experts)}


def check_schedule(schedule, ring_size):
    """The invariants a stream schedule must keep, checked by replaying it: a wait finds its
    expert's copy in that buffer (nothing copied over it since), and no copy lands in a
    buffer between the wait of the expert it holds and that expert's free."""
    held = [None] * ring_size
    busy = [False] * ring_size
    for what, layer, expert, b in schedule:
        if what == "copy":
            assert not busy[b], f"copy of {(layer, expert)} over buffer {b} still in use"
            held[b] = (layer, expert)
        elif what == "wait":
            assert held[b] == (layer, expert), f"wait for {(layer, expert)} finds {held[b]} in buffer {b}"
            busy[b] = True
        else:
            assert busy[b] and held[b] == (layer, expert)
            busy[b] = False


def run_step(ring, host, layer, misses, after=None):
    """What the expert-by-expert layer does: plan, then fetch / compute / release in order;
    returns the bytes each expert computed on."""
    ring.plan(layer, misses, after)
    seen = []
    for e in misses:
        b, buf = ring.fetch(layer, e)
        seen.append(buf[:host[(layer, e)].numel()].clone())
        ring.release(b)
    return seen


def test_next_layers_copies_are_issued_before_this_layers_last_compute():
    host = blobs()
    ring = ArenaRing([torch.empty(16) for _ in range(2)], lambda l, e: host[(l, e)])
    ring.schedule = []
    seen = run_step(ring, host, 0, [1, 3, 5], after=(1, [2, 4]))
    assert all(torch.equal(s, host[(0, e)]) for s, e in zip(seen, [1, 3, 5]))
    sched = ring.schedule
    # ahead: both buffers filled before the first compute waits
    assert sched[:3] == [("copy", 0, 1, 0), ("copy", 0, 3, 1), ("wait", 0, 1, 0)]
    last_wait = sched.index(("wait", 0, 5, 0))
    first_next = next(i for i, s in enumerate(sched) if s[0] == "copy" and s[1] == 1)
    assert first_next < last_wait                 # layer 1's copy overlaps layer 0's last expert
    check_schedule(sched, 2)
    # layer 1 uses 2 (copied ahead) and 6 (not predicted); 4 was predicted and is dropped
    mark = len(sched)
    seen = run_step(ring, host, 1, [2, 6])
    assert all(torch.equal(s, host[(1, e)]) for s, e in zip(seen, [2, 6]))
    step = sched[mark:]
    assert ("copy", 1, 2) not in [s[:3] for s in step]        # no second copy of 2
    assert [s[:3] for s in step if s[0] == "copy"] == [("copy", 1, 6)]
    check_schedule(sched, 2)


def test_without_prefetch_each_miss_is_copied_when_it_runs():
    host = blobs()
    ring = ArenaRing([torch.empty(16) for _ in range(2)], lambda l, e: host[(l, e)], prefetch=False)
    ring.schedule = []
    run_step(ring, host, 0, [1, 3, 5], after=(1, [2, 4]))
    assert [s[:3] for s in ring.schedule] == [(w, 0, e) for e in (1, 3, 5) for w in ("copy", "wait", "free")]
    check_schedule(ring.schedule, 2)


def test_an_expert_not_queued_takes_the_buffer_of_the_one_that_runs_last():
    """Every buffer holds a later expert (a mispredicted order): the miss takes the last
    one's buffer, which is copied again when its turn comes."""
    host = blobs()
    ring = ArenaRing([torch.empty(16) for _ in range(2)], lambda l, e: host[(l, e)])
    ring.schedule = []
    run_step(ring, host, 0, [1], after=(1, [4, 5]))
    seen = run_step(ring, host, 1, [3, 4, 5])
    assert all(torch.equal(s, host[(1, e)]) for s, e in zip(seen, [3, 4, 5]))
    check_schedule(ring.schedule, 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_each_expert_reads_its_own_bytes_through_the_events():
    """The same steps with real streams: 4 MiB blobs from pinned memory, copied on the copy
    stream while the compute stream reads the buffer before; each read (a clone after the
    wait) holds its expert's bytes."""
    host = {k: v.pin_memory() for k, v in blobs(n=1 << 20).items()}
    ring = ArenaRing([torch.empty(1 << 20, device="cuda") for _ in range(2)], lambda l, e: host[(l, e)])
    seen = run_step(ring, host, 0, [1, 3, 5, 7], after=(1, [2, 4]))
    seen += run_step(ring, host, 1, [2, 4, 6])
    torch.cuda.synchronize()
    want = [host[(0, e)] for e in (1, 3, 5, 7)] + [host[(1, e)] for e in (2, 4, 6)]
    assert all(torch.equal(s.cpu(), w) for s, w in zip(seen, want))


def copy_engine(tiny, policy):
    if policy == "auto":       # every step copies (crossover 0): residency never changes
        plan = plan_for(tiny, expert_cache=2, miss_policy="auto")
        plan = replace(plan, miss_crossover=tuple((l.index, 0.0) for l in tiny.geom.moe_layers))
    else:
        plan = plan_for(tiny, expert_cache=2, miss_policy="copy")
    return Engine.start(tiny.path, plan, EngineOptions(**OPTS))


@pytest.mark.parametrize("policy", ["copy", "auto"])
def test_the_same_tokens_with_and_without_copies_ahead(tiny_models, policy):
    tiny = tiny_models[("qwen3_moe", "per_expert")]
    ids = prompt(tiny.ref.config.vocab_size, 128, seed=3)
    out = {}
    for ahead in (True, False):
        engine = copy_engine(tiny, policy)
        ring = engine.model.experts.ring
        ring.prefetch, ring.schedule = ahead, []
        logits = [engine.prefill(ids)]             # 4 chunks of 32
        for _ in range(3):
            logits.append(engine.decode(int(logits[-1].argmax())))
        out[ahead] = (logits, engine.expert_stats(), ring.schedule)
        check_schedule(ring.schedule, len(ring.buffers))
    (a, sa, sched), (b, sb, plain) = out[True], out[False]
    assert all(torch.equal(x, y) for x, y in zip(a, b))        # bit for bit
    assert (sa["hits"], sa["misses"]) == (sb["hits"], sb["misses"])
    assert sum(s[0] == "copy" for s in sched) >= sum(s[0] == "wait" for s in plain)
    # from the second chunk on, copies of the next MoE layer are issued while this layer
    # still has experts to compute: the next wait after them is this layer's
    first, second = (l.index for l in tiny.geom.moe_layers[:2])
    ahead = [i for i, s in enumerate(sched) if s[0] == "copy" and s[1] == second
             and next(w for w in sched[i:] if w[0] == "wait")[1] == first]
    assert ahead, "no copy of the next layer issued before this layer's compute ended"
    assert not [i for i, s in enumerate(plain) if s[0] == "copy" and s[1] == second
                and next(w for w in plain[i:] if w[0] == "wait")[1] == first]


def test_the_arena_the_ring_fills_is_the_planned_one(tiny_models):
    tiny = tiny_models[("qwen3_moe", "per_expert")]
    engine = copy_engine(tiny, "auto")
    line = engine.ledger.lines["weight_arena"]
    ring = engine.model.experts.ring
    assert line.allocated == line.planned == sum(b.numel() * b.element_size() for b in ring.buffers)
    assert len(ring.buffers) == 2 * tiny.geom.moe_layers[0].moe.experts_per_token
    assert not math.isinf(min(engine.model.experts.crossover.values()))
