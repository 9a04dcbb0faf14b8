"""moefit's CPU prefill taken apart: measured CPU time per component against the speed model's.

    PYTHONPATH=src python benchmarks/prefill_components.py FILE.gguf [--tokens 512]

Loads ``FILE`` as ``speed_model.py``'s worker does (``vs_llamacpp.worker_plan``: a simulated
CPU device, all experts resident, one thread), warms up with two prefills of the prompt, then
times one more with ``time.thread_time`` (CPU time of this thread: what the other jobs of a
shared machine change far less than wall time) around each runtime function that makes up a
layer: ``torch.mm`` (by the activation's rows: the dense products at the prompt's rows, the
experts' at fewer; an expert that every token picks counts with the dense products), ``kernels.quant.dequantize`` (by matrix shape), ``attend``, ``moe_layer``'s
own work (routing, gather, SwiGLU's elementwise, scatter), ``rms_norm``, RoPE, the KV write and
``linear``'s own Python. Each figure is exclusive (a wrapped call's time less the wrapped calls
inside it). Then the model's per-layer terms (``moefit.plan.host_paths.dense_products``,
``expert_products``, ``speed._attention`` at the device rate, the head) from the host figures of
``--host-from`` (a ``speed_model.py --out`` file's first moefit prefill row) for comparison.
Diagnostic only: prints, writes nothing; the wrappers are this script's, the runtime unchanged.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", type=Path)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--host-from", type=Path, help="a speed_model.py --out JSON whose moefit "
                    "prefill row's host_figures price the model's terms")
    a = ap.parse_args()
    if not a.file.is_file():
        sys.exit(f"error: {a.file} is not a file: name a GGUF file")
    import torch

    import moefit.runtime.kernels.quant as Q
    import moefit.runtime.model as M
    import vs_llamacpp as V
    from moefit.runtime.engine import Engine, EngineOptions

    torch.set_num_threads(1)
    geom, plan = V.worker_plan(a.file, "all", a.tokens, 64)
    eng = Engine.start(a.file, plan, EngineOptions(progress=False))
    ids = torch.randint(0, geom.vocab_size, (a.tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    acc, cnt, stack = collections.defaultdict(float), collections.Counter(), []

    def timed(f, key):
        def g(*args, **kw):
            t0 = time.thread_time()
            stack.append(0.0)
            try:
                return f(*args, **kw)
            finally:
                dt, inner = time.thread_time() - t0, stack.pop()
                k = key(*args) if callable(key) else key
                acc[k] += dt - inner
                cnt[k] += 1
                if stack:
                    stack[-1] += dt
        return g

    for name, key in (("rms_norm", "norms (rms_norm)"), ("attend", "attention (attend)"),
                      ("moe_layer", "MoE layer's own work"), ("linear", "linear's own Python")):
        setattr(M, name, timed(getattr(M, name), key))
    Q.dequantize = timed(Q.dequantize, lambda raw, qt, shape, *r: f"dequantize {qt} {tuple(shape)}")
    eng.prefill(ids)
    eng.prefill(ids)
    mdl = next(v for v in vars(eng).values() if hasattr(v, "rotary"))
    rot, kv = mdl.rotary, mdl.kv
    rot_apply, rot_cs, kv_write = rot.apply, rot.cos_sin, kv.write
    rot.apply, rot.cos_sin = timed(rot_apply, "RoPE"), timed(rot_cs, "RoPE")
    kv.write = timed(kv_write, "KV write")
    mm = torch.mm
    torch.mm = timed(mm, lambda x, w, *r, **k: f"mm {x.shape[0]} rows x {tuple(w.shape)}"
                     if x.shape[0] == a.tokens else "mm experts")
    acc.clear()
    cnt.clear()
    try:
        t0 = time.thread_time()
        eng.prefill(ids)
        total = time.thread_time() - t0
    finally:
        torch.mm = mm
    layers = len(geom.layers)
    print(f"{a.file.name}: one warm {a.tokens}-token prefill, {total * 1e3:.0f} ms CPU, "
          f"{layers} layers; per layer (ms):")
    for k, v in sorted(acc.items(), key=lambda kv_: -kv_[1]):
        print(f"  {k:40s} {v * 1e3 / layers:7.2f}  ({cnt[k]} calls)")
    print(f"  {'rest (forward, residual adds, embedding)':40s} "
          f"{(total - sum(acc.values())) * 1e3 / layers:7.2f}")
    if a.host_from:
        model_terms(a.host_from, geom, plan, a.tokens)


def model_terms(path: Path, geom, plan, tokens: int) -> None:
    """Print the speed model's per-layer terms of the first layer for a ``tokens``-token
    prefill chunk, from the host figures of ``path``'s first moefit prefill row."""
    import speed_model as SM
    from moefit.memory import cpu_kernels
    from moefit.plan import host_paths as HP
    from moefit.plan import speed as S

    rows = json.loads(path.read_text())
    row = next(r for r in rows if r["engine"] == "moefit" and r["phase"].startswith("pp"))
    host = SM.host_of(row["host_figures"])
    rates = S.rates_for(plan.devices[0].device, host)
    lay = S.cached_layers(geom, rates.stored)[0]
    moe = lay.spec.moe
    batched = cpu_kernels.batched_experts(tokens, moe.experts_per_token, moe.num_experts, lay.expert_types)
    _, a_flops = S._attention(lay.spec, S.kv_format(plan.request.kv), 2, tokens, 1, 0, True)
    print(f"model (host figures of {path}), per layer (ms): dense products "
          f"{HP.dense_products(lay, rates, tokens) * 1e3:.2f}, experts "
          f"{HP.expert_products(lay, host, moe.num_experts, tokens * moe.experts_per_token, batched) * 1e3:.2f}, "
          f"attention {a_flops / rates.device_flops * 1e3:.2f}; head {S.head_seconds(geom, rates, 1) * 1e3:.2f} per step")


if __name__ == "__main__":
    main()
