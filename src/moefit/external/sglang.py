"""SGLang's memory model: what ``sglang.launch_server`` allocates on one GPU, and the flags
that fit.

Modelled version: SGLang 0.5 (``python/sglang/srt/model_executor/model_runner_kv_cache_mixin.py``
at ``sgl-project/sglang`` commit 001ccef, the mixin of PR #15821, 2025-12-25, whose
``profile_max_num_token`` keeps the formula of ``model_runner.py`` since 0.4; the
memory defaults of ``server_args.py`` ``ServerArgs._handle_gpu_memory_settings`` of the
same series).

How SGLang sizes the KV pool of one rank (``ModelRunnerKVCacheMixin``):

- ``total_gpu_memory``: the free memory (GiB) after the CUDA context and the NCCL
  communicators, the smallest over the ranks, measured before the weights load;
- after the weights load, ``profile_max_num_token``: ``rest_memory = available_gpu_memory -
  total_gpu_memory x (1 - mem_fraction_static)``, so the weights and the KV pool share
  ``mem_fraction_static x total_gpu_memory`` and everything else (activations of a
  chunked-prefill step, CUDA graphs, workspaces) lives in the remaining fraction;
- ``max_total_num_tokens = rest_memory x 2^30 // cell_size``, floored to ``page_size``
  (1 by default), with ``cell_size`` per token over the rank's attention layers: MLA
  ``(kv_lora_rank + qk_rope_head_dim) x layers x dtype``, else ``kv_heads_per_rank x
  (head_dim + v_head_dim) x layers x dtype`` (``get_cell_size_per_token``); it is printed
  as "KV Cache is allocated. #tokens: N" and ``max_total_num_tokens=N``;
- hybrid sliding-window models (gpt-oss) split the pool so that sliding layers get
  ``swa_full_tokens_ratio`` (0.8) of the full layers' tokens (``set_num_tokens_hybrid_swa``);
  Gated DeltaNet models first give ``mamba_full_memory_ratio / (1 + ratio)`` (0.9) of
  ``rest_memory`` to whole recurrent-state slots (``handle_max_mamba_cache``: "Mamba Cache is
  allocated. max_mamba_cache_size: N") and the rest to the full-attention layers;
- with several pipeline stages every stage takes the smallest ``max_total_num_tokens``.

Defaults (``_handle_gpu_memory_settings``, ``gpu_mem`` the ``nvidia-smi`` total in MiB):
``chunked_prefill_size`` 2048 below 35 GB, 4096 below 60 GB, 8192 up to 160 GB, else
16384; ``cuda_graph_max_bs`` 8 below 20 GB, 24/80 below 35 GB, 32/160 below 60 GB, else
256 / 512 (TP below 4 / 4 or more), captured at ``[1, 2, 4, 8, 12] + 16..256 by 8 +
272..496 by 16 + 512..max by 32``; ``mem_fraction_static = (gpu_mem - reserved) / gpu_mem``
with ``reserved = 512 + 1.5 x max(chunk, 2048) + 2 x cuda_graph_max_bs + tp x pp / 8 x 1024``
MiB (at least 10 GiB above 60 GB). moefit prints that default beside the fraction it
solves from its own lines.
"""

from __future__ import annotations

from moefit.devices import Device
from moefit.external.parallel import (Layout, StageShard, floor_to, logits_bytes,
                                     moe_workspace_bytes, token_activation_bytes)
from moefit.external.multi_gpu import (RankBudget, ServePlan, ServeRequest, command_line, kv_cache_dtype,
                                     non_torch_bytes, runtime_with_comm, weight_detail)
from moefit.external.vllm import GRAPH_FIRST_BYTES, GRAPH_PER_SIZE_BYTES, SAMPLER_BYTES_PER_LOGIT
from moefit.ingest.geometry import ModelGeometry
from moefit.memory.runtime import default_reserve_bytes
from moefit.plan.types import Line
from moefit.units import MIB

VERSION = "SGLang 0.5; memory model of sgl-project/sglang 001ccef (model_runner_kv_cache_mixin.py)"
#: ``--mem-fraction-static`` grid (SGLang rounds its own default to 3 decimals)
FRACTION_STEP = 0.001
SWA_FULL_TOKENS_RATIO = 0.8
MAMBA_FULL_MEMORY_RATIO = 0.9
#: ``MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO``: recurrent slots per running request
MAMBA_SLOTS_PER_REQUEST = 3
KV_DTYPES = {"bf16": ("auto", 2), "fp16": ("auto", 2), "fp8": ("fp8_e4m3", 1)}


def memory_defaults(device: Device, tp_total: int) -> tuple[int, int]:
    """(``chunked_prefill_size``, ``cuda_graph_max_bs``) SGLang picks for ``device``
    (module docstring; ``gpu_mem`` is the capacity in MiB)."""
    mib = device.capacity_bytes / MIB
    small = tp_total < 4
    if mib < 20 * 1024:
        return 2048, 8
    if mib < 35 * 1024:
        return 2048, 24 if small else 80
    if mib < 60 * 1024:
        return 4096, 32 if small else 160
    if mib < 160 * 1024:
        return 8192, 256 if small else 512
    return 16384, 512


def capture_sizes(max_bs: int) -> list[int]:
    """SGLang's CUDA graph batch sizes up to ``max_bs`` (``_generate_cuda_graph_batch_sizes``)."""
    sizes = [1, 2, 4, 8, 12] + list(range(16, 257, 8)) + list(range(272, 512, 16)) + list(range(512, max_bs + 1, 32))
    return [s for s in sizes if s <= max_bs]


def default_fraction(device: Device, layout: Layout, chunk: int, max_bs: int) -> float:
    """The ``mem_fraction_static`` SGLang would choose (module docstring)."""
    gpu_mem = device.capacity_bytes / MIB
    tp_total = layout.tp * layout.dp
    reserved = 512 + max(chunk, 2048) * 1.5 + max_bs * 2 + tp_total * layout.pp / 8 * 1024
    if layout.dp > 1:
        reserved += max_bs * layout.dp * 3 + (max_bs * layout.dp * 1.5 if max_bs > 300 else 0)
    if gpu_mem > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    return round((gpu_mem - reserved) / gpu_mem, 3)


def pool_tokens(geom: ModelGeometry, shard: StageShard, rest: int) -> tuple[int, int, int, int]:
    """(``max_total_num_tokens`` of the full-attention layers, tokens of the sliding-window /
    chunked layers, recurrent slots, bytes of the slots) for ``rest`` bytes of pool on one
    rank of ``shard`` (module docstring).

    Hybrid sliding-window models (``set_num_tokens_hybrid_swa``): the profile's
    ``rest // (F + S)`` tokens (``F``, ``S``: the full and sliding layers' bytes per token)
    are re-split so that ``full x F + swa x S`` is the same memory with ``swa = full x
    swa_full_tokens_ratio``: ``full = tokens x (F + S) / (F + 0.8 S)``; the SWA pool
    (``SWAKVPool``) holds ``swa`` tokens of every sliding layer. Without sliding layers the
    second number is 0."""
    if rest <= 0 or not shard.kv_layer_bytes:
        return 0, 0, 0, 0
    slots = slot_bytes = 0
    if shard.linear_layers:
        mamba = rest * MAMBA_FULL_MEMORY_RATIO / (1 + MAMBA_FULL_MEMORY_RATIO)
        slots = int(mamba // shard.state_bytes)
        slot_bytes = slots * shard.state_bytes
        rest -= slot_bytes
    full = sum(b for b, (kind, w) in zip(shard.kv_layer_bytes, shard.kv_kinds) if not w)
    swa = sum(b for b, (kind, w) in zip(shard.kv_layer_bytes, shard.kv_kinds) if w)
    tokens = int(rest) // (full + swa)
    if not swa:
        return tokens, 0, slots, slot_bytes
    if not full:                      # every layer sliding: one pool
        return tokens, tokens, slots, slot_bytes
    full_tokens = int(tokens * (full + swa) / (full + SWA_FULL_TOKENS_RATIO * swa))
    return full_tokens, int(full_tokens * SWA_FULL_TOKENS_RATIO), slots, slot_bytes


def pool_bytes(shard: StageShard, full_tokens: int, swa_tokens: int) -> int:
    """Bytes of the KV pools: ``full_tokens`` cells of every full-attention layer and
    ``swa_tokens`` of every sliding / chunked layer of the rank (``SWAKVPool``,
    ``MHATokenToKVPool``)."""
    full = sum(b for b, (_, w) in zip(shard.kv_layer_bytes, shard.kv_kinds) if not w)
    swa = sum(b for b, (_, w) in zip(shard.kv_layer_bytes, shard.kv_kinds) if w)
    return full_tokens * full + swa_tokens * swa


def request_tokens(shard: StageShard, context: int, chunk: int) -> tuple[int, int]:
    """(full-pool, SWA-pool) tokens one request of ``context`` tokens holds at its peak:
    every token in the full pool; in the SWA pool the window plus one chunked-prefill step
    (older tokens are evicted, ``SWATokenToKVPoolAllocator``), at most the context."""
    windows = [w for _, w in shard.kv_kinds if w]
    swa = min(context, max(windows) + chunk) if windows else 0
    has_full = any(not w for _, w in shard.kv_kinds)
    return (context if has_full else 0), swa


class SGLangEngine:
    """SGLang as a :class:`moefit.external.multi_gpu.EngineModel` (module docstring)."""

    name = "sglang"
    label = "SGLang"
    version = VERSION

    def kv_dtype(self, kv: str) -> tuple[str, int]:
        """``--kv`` -> ``--kv-cache-dtype``: bf16/fp16 -> ``auto``, fp8 -> ``fp8_e4m3``.
        Raises InputError for the block formats SGLang has no cache for."""
        return kv_cache_dtype(self, KV_DTYPES, kv)

    def default_batched(self, device: Device) -> int:
        return memory_defaults(device, 1)[0]

    def default_seqs(self, device: Device, layout: Layout) -> int:
        return memory_defaults(device, layout.tp * layout.dp)[1]

    def expert_blob(self, geom: ModelGeometry):
        return None

    def price(self, geom: ModelGeometry, shards: tuple[StageShard, ...], layout: Layout,
              device: Device, req: ServeRequest, batched: int, seqs: int) -> RankBudget:
        runtime = runtime_with_comm(device, layout)
        total = device.free_bytes - runtime          # total_gpu_memory, measured after init
        margin = default_reserve_bytes(device) if req.margin is None else req.margin
        _, max_bs = memory_defaults(device, layout.tp * layout.dp)
        max_bs = min(max_bs, seqs) if req.seqs else max_bs
        workspace = non_torch_bytes(layout)
        graphs = GRAPH_FIRST_BYTES + len(capture_sizes(max_bs)) * GRAPH_PER_SIZE_BYTES
        rows = []
        for s in shards:
            act = batched * (token_activation_bytes(geom, s.layers, layout.tp) +
                             moe_workspace_bytes(geom, s.layers, layout.moe_group, layout.ep))
            if s.last:
                act = max(act, logits_bytes(geom, min(max_bs, batched), SAMPLER_BYTES_PER_LOGIT))
            rows.append((s, act))
        outside = max(act for _, act in rows) + graphs + workspace + margin
        frac = req.fraction or (floor_to((total - outside) / total, FRACTION_STEP) if total > 0 else 0.0)
        best = None
        for s, act in rows:
            rest = int(total * frac) - s.weights
            tokens, swa_tokens, slots, slot_bytes = pool_tokens(geom, s, rest)
            if best is None or tokens < best[1]:
                best = (s, tokens, swa_tokens, slots, slot_bytes, act, rest)
        s, tokens, swa_tokens, slots, slot_bytes, act, rest = best
        kv_bytes = pool_bytes(s, tokens, swa_tokens)
        need_full, need_swa = request_tokens(s, req.context, batched)
        fits_in = [tokens / need_full] if need_full else []
        if need_swa:
            fits_in.append(swa_tokens / need_swa)
        conc = min(fits_in) if fits_in else 0.0
        if s.linear_layers:
            conc = min(conc, slots / MAMBA_SLOTS_PER_REQUEST)
        default = default_fraction(device, layout, batched, max_bs)
        kv_detail = (f"{tokens:,} tokens" + (f" + {swa_tokens:,} in the sliding-window pool" if swa_tokens and
                                             tokens != swa_tokens else "") + f", {self.kv_dtype(req.kv)[0]}")
        lines = [Line("runtime", runtime, "CUDA context + NCCL" if layout.world > 1 else "CUDA context estimate"),
                 Line("weights", s.weights, weight_detail(s)),
                 Line("kv", max(kv_bytes, 0), kv_detail)]
        if s.linear_layers:
            lines.append(Line("state", slot_bytes, f"{slots} recurrent-state slots x {s.linear_layers} layers"))
        lines += [Line("activations", act, f"chunked prefill of {batched} tokens (estimate)"),
                  Line("workspace", workspace, "collectives and attention workspaces"),
                  Line("graphs", graphs, f"{len(capture_sizes(max_bs))} batch sizes up to {max_bs} (estimate)"),
                  Line("margin", margin, "")]
        return RankBudget(tuple(lines), tokens, frac, s.stage, batched, seqs, conc,
                          {"mem_fraction_static": frac, "sglang_default_fraction": default,
                           "total_gpu_memory": total, "rest_memory": rest, "cuda_graph_max_bs": max_bs,
                           "max_mamba_cache_size": slots, "swa_max_total_num_tokens": swa_tokens,
                           "request_bytes": pool_bytes(s, need_full, need_swa)})

    def check_layout(self, layout: Layout) -> None:
        """SGLang starts every layout :func:`moefit.external.multi_gpu.candidate_layouts` gives
        (its TP group, data-parallel attention included, spans nodes with ``--nnodes``)."""

    # ---- the command line -----------------------------------------------------------------
    def flags(self, plan: ServePlan) -> list[tuple[str, str | None]]:
        lay, b, r = plan.layout, plan.budget, plan.request
        out: list[tuple[str, str | None]] = [("--tp", str(lay.tp * lay.dp))]
        if lay.pp > 1:
            out.append(("--pp-size", str(lay.pp)))
        if lay.dp > 1:
            out += [("--dp", str(lay.dp)), ("--enable-dp-attention", None)]
        if lay.ep:
            out.append(("--ep-size", str(lay.moe_group)))
        out += [("--context-length", str(r.context)),
                ("--mem-fraction-static", f"{b.knob:.3f}"),
                ("--chunked-prefill-size", str(b.batched)),
                ("--kv-cache-dtype", self.kv_dtype(r.kv)[0])]
        if r.seqs:
            out.append(("--max-running-requests", str(b.seqs)))
        out += [(f, v) for f, v in r.extra_flags if f == "--json-model-override-args"]
        if r.trust_remote_code:
            out.append(("--trust-remote-code", None))
        return out

    def commands(self, plan: ServePlan) -> list[str]:
        """``python -m sglang.launch_server``, one per node; multi-node as SGLang documents it
        (``--nnodes N --node-rank i --dist-init-addr HEAD_IP:5000``, ``docs/references/multi_node.md``)."""
        lay = plan.layout
        base = f"python -m sglang.launch_server --model-path {plan.request.model_ref} " + command_line(self.flags(plan))
        if lay.nodes == 1:
            return [base]
        return [f"{base} --nnodes {lay.nodes} --node-rank {i} --dist-init-addr HEAD_IP:5000"
                for i in range(lay.nodes)]


ENGINE = SGLangEngine()
