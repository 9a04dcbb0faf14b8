"""``moefit bench MODEL [plan flags] --contexts 384K,512K,524K --out DIR``.

Resolves the device as ``serve`` does (``--device cuda[:N]``, or ``--device cpu --vram
SIZE`` for the simulated device), reads the device's calibration when there is one
(:mod:`moefit.memory.calibration`, unless ``--no-calibration``), runs the ladder
(:mod:`moefit.bench.ladder`) with a progress bar, optionally runs transformers on the same
prompts (``--vs transformers``), and writes ``bench.json``, ``bench.md`` (printed) and
``bench.png`` into ``--out``.

Without ``--contexts`` the ladder is 1/4, 1/2, 3/4 and all of the largest context the
device allows with the other flags (found by re-solving the plan).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from moefit.bench import ladder, report, versus
from moefit.errors import EXIT_NOFIT, EXIT_OK, InputError
from moefit.flags import apply_threads, calibrated_staging, request_from_args, runnable_device, warn
from moefit.ingest.inputs import is_gguf_file, routing_profile_text
from moefit.ingest.resolve import load_model
from moefit.memory import calibration
from moefit.outputs import writable_dir, writable_file, write_text_atomic
from moefit.plan.request import context_limit, resolve_context
from moefit.plan.alternatives import largest_context
from moefit.runtime.calibrate import measure_host, measure_point
from moefit.units import format_bytes, parse_count


def bench(args: argparse.Namespace) -> int:
    model = Path(args.model)
    if not (model.is_dir() or is_gguf_file(model)):
        raise InputError(f"{args.model}: not a checkpoint; bench runs the model and needs a "
                         "directory with config.json and *.safetensors, or a GGUF file")
    if args.decode_tokens < 1:
        raise InputError(f"--decode-tokens {args.decode_tokens}: must be at least 1")
    apply_threads(args)
    geom = load_model(str(model))
    if args.vs:
        versus.check_reference(geom, gguf=is_gguf_file(str(model)))
    device = runnable_device(args)
    req = request_from_args(args, device)
    staging = calibrated_staging(geom, device, req.kv, args)
    if args.contexts:
        contexts = ladder.parse_contexts(args.contexts)
        for ctx in contexts:      # a context beyond the RoPE limit is bad input: say so now
            try:
                resolve_context(geom, req.with_(max_context=ctx))
            except InputError as e:
                # the request's limit message names --max-context; here the value came
                # from --contexts
                raise InputError(str(e).replace(f"--max-context {ctx}",
                                                f"--contexts value {ctx}")) from None
    else:
        largest = largest_context(geom, device, req, staging)
        if largest is None:
            raise InputError("no context fits this device with these flags; see `moefit plan`")
        contexts = ladder.default_ladder(largest)
    record = getattr(args, "record_routing", None)
    opts = ladder.BenchOptions(prompt_tokens=ladder.parse_prompt_tokens(args.prompt_tokens),
                               decode_tokens=args.decode_tokens, seed=args.seed,
                               record_routing=bool(record))
    out = writable_dir(args.out, f"--out {args.out}")     # before anything is measured
    if record:
        writable_file(record, f"--record-routing {record}")
    runs = []
    bar = tqdm(contexts, desc="bench", unit="context", file=sys.stderr,
               disable=not args.progress)
    for ctx in bar:
        bar.set_postfix_str(f"context {report.tokens_label(ctx)}")
        runs.append(ladder.run_context(model, geom, device, req, ctx, opts, staging))
    bar.close()
    if record:        # the runs' routing summed: one --routing-profile file
        routed: dict[int, dict[int, int]] = {}
        for r in runs:
            for layer, per in r.pop("routing_counts", {}).items():
                into = routed.setdefault(layer, {})
                for e, c in per.items():
                    into[e] = into.get(e, 0) + c
        write_text_atomic(Path(record).expanduser(), routing_profile_text(routed))
        print(f"wrote the routing of {len(runs)} runs to {record} (--routing-profile {record})",
              file=sys.stderr)
    if args.vs:
        ref = versus.Reference(model, "cpu" if device.kind == "cpu" else device.label,
                               versus.rope_parameters(geom, req))
        for r in tqdm(runs, desc="transformers", unit="context", file=sys.stderr,
                      disable=not args.progress):
            if r["fits"]:
                ids = ladder.prompt_ids(geom, r["prompts"][-1]["tokens"], args.seed)
                r["vs_transformers"] = versus.compare(r, ref.generate(ids, len(r["greedy_tokens"])))
        ref.close()
    doc = report.document(
        model={"name": geom.name, "model_type": geom.model_type, "source": geom.source,
               "dtype": geom.dtype, "total_params": geom.total_params,
               "active_params": geom.active_params, "layers": geom.num_layers,
               "total_experts": geom.total_experts},
        device={"label": device.label, "kind": device.kind, "description": device.description,
                "capacity_bytes": device.capacity_bytes, "free_bytes": device.free_bytes},
        request={"kv": req.kv, "slots": req.slots, "prefill_mode": req.prefill_mode,
                 "prefill_tokens": req.prefill_tokens, "miss_policy": req.miss_policy,
                 "rope_scaling": req.rope_scaling, "rope_scale": req.rope_scale,
                 "expert_cache": req.expert_cache, "reserve_bytes": req.reserve_bytes,
                 "prompt_tokens": list(opts.prompt_tokens) or "one chunk and three chunks",
                 "decode_tokens": opts.decode_tokens, "seed": opts.seed,
                 "threads": torch.get_num_threads(),
                 "staging": "calibrated" if staging is not None else "analytic"},
        runs=runs)
    text, written = report.write_files(doc, out, f"moefit bench: {geom.name} on {device.description}")
    print(text)
    if len(written) < 3:
        warn("no chart (bench.png): pip install 'moefit[bench]' adds matplotlib")
    print(f"wrote {', '.join(str(p) for p in written)}", file=sys.stderr)
    return EXIT_OK if all(r["fits"] for r in runs) else EXIT_NOFIT


def calibrate(args: argparse.Namespace) -> int:
    """``moefit calibrate MODEL --device ...``: measure, fit, store, print; ``moefit
    calibrate --host``: the host's memory bandwidth and kernel rates (the speed model's
    figures, :func:`moefit.memory.calibration.save_host`)."""
    if args.host:
        return _calibrate_host(args)
    if args.model is None:
        raise InputError("calibrate: give MODEL (the staging of a checkpoint on --device), or "
                         "--host (this machine's memory bandwidth and kernel rates)")
    model = Path(args.model)
    if not (model.is_dir() or is_gguf_file(model)):
        raise InputError(f"{args.model}: not a checkpoint; calibrate runs the model")
    geom = load_model(str(model))
    device = runnable_device(args)
    req = request_from_args(args, device)
    chunks = sorted({parse_count(c.strip(), "--chunks") for c in args.chunks.split(",") if c.strip()})
    if len(chunks) != 2 or chunks[0] < 256:
        raise InputError(f"--chunks {args.chunks}: expected two different chunk sizes of at "
                         "least 256 tokens, e.g. 512,2048")
    limit, _ = context_limit(geom, req)
    if chunks[1] > limit:
        # say so before measuring anything (each point runs the model)
        hint = f"e.g. --chunks 256,{max(512, limit - limit % 256)}" if limit >= 512 else ""
        raise InputError(f"--chunks {args.chunks}: chunk {chunks[1]} is longer than "
                         f"{geom.name}'s context limit of {limit} tokens; choose smaller "
                         f"--chunks {hint}".rstrip())
    calibration.writable_cache()     # a cache that cannot be written: say so before measuring
    points = []
    for c in chunks:
        p = measure_point(model, geom, device, req, c, args.seed)
        print(f"chunk {c:>6}: measured {format_bytes(p.measured_bytes):>11}, analytic model "
              f"{format_bytes(p.analytic_bytes):>11} ({p.analytic_bytes / p.measured_bytes:.3f}x)")
        points.append((c, p.measured_bytes))
    path, fitted = calibration.save(geom, device, req.kv, points)
    print(f"prefill staging = {fitted.const_bytes} B + {fitted.per_token_bytes} B/token x chunk "
          f"(calibrated on {calibration.device_key(device)}, {geom.dtype}, KV {req.kv})")
    print(f"stored in {path}")
    return EXIT_OK


def _calibrate_host(args: argparse.Namespace) -> int:
    """Measure the host at 1, 2, 4, ... threads up to the CPUs this process may use."""
    cpus = calibration.host_key()["cpus"]
    threads = sorted({min(2 ** i, cpus) for i in range(cpus.bit_length() + 1)})
    calibration.writable_cache()
    path = calibration.save_host(measure_host(threads))
    print(f"stored in {path}")
    return EXIT_OK
