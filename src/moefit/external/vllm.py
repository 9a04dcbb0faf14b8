"""vLLM's memory model: what ``vllm serve`` allocates on one GPU, and the flags that fit.

Modelled version: vLLM 0.11 - 0.20 (the V1 engine), from its source at
``vllm-project/vllm`` commit 35d5cda (``vllm/v1/worker/gpu_worker.py``) and
``vllm/utils/mem_utils.py`` / ``vllm/v1/core/kv_cache_utils.py`` as stored beside it.
From 0.21.0 vLLM also profiles the CUDA graphs inside ``--gpu-memory-utilization``
(``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS``, "default since v0.21.0" as its startup log
says); that version is not modelled.

How vLLM sizes the KV cache of one rank (``Worker.init_device`` /
``Worker.determine_available_memory``):

- after the CUDA context and the NCCL communicators exist it takes a memory snapshot and
  sets ``requested_memory = total_memory x gpu_memory_utilization`` (``total_memory``: the
  CUDA total of ``torch.cuda.mem_get_info``; startup fails unless that much is free);
- it runs one forward pass of ``max_num_batched_tokens`` dummy tokens and a sampler step
  (``GPUModelRunner.profile_run``) inside ``memory_profiling`` (``mem_utils.py``):
  ``non_kv_cache_memory = weights + torch_peak_increase + non_torch_increase``;
- ``available_kv_cache_memory = requested_memory - non_kv_cache_memory`` ("Available KV
  cache memory: X GiB");
- ``kv_cache_utils.py``: one page is ``block_size`` tokens of one layer; with one layer
  type ``num_blocks = available // page // num_layers`` (``_get_kv_cache_config_uniform_type``),
  with several (sliding window, Gated DeltaNet) the layers form groups of the smallest
  type's count and ``num_blocks = available // page // group_size``
  (``_get_kv_cache_config_uniform_page_size``); every rank then takes the smallest
  ``num_blocks`` (``unify_kv_cache_configs``) and the log says "GPU KV cache size:
  ``num_blocks // num_groups x block_size`` tokens" and "Maximum concurrency for
  ``max_model_len`` tokens per request: ``num_blocks / blocks of one request``";
- the CUDA graphs are captured afterwards (``compile_or_warm_up_model``), outside
  ``requested_memory``, as are the CUDA context and the NCCL buffers.

So moefit prices, per rank: the runtime (CUDA context + communicators, outside the
fraction), the weight shard (:mod:`moefit.external.parallel`), the profile run's activations
and the workspaces (inside), the KV cache (what the fraction leaves), the CUDA graphs and
the margin (outside), and chooses the largest ``--gpu-memory-utilization`` on a 0.01 grid
that leaves the outside lines room. Block sizes: 16 tokens, also for MLA (the
FLASH_ATTN_MLA backend that 0.19.0 picks on Hopper; the FlashMLA backend would force 64:
``vllm/platforms/cuda.py``, "Forcing kv cache block size to 64 for FlashMLA backend", which
changes the tokens by less than one block per rank); with Gated DeltaNet layers the attention block grows to a multiple of
16 whose page holds one layer's recurrent state ("Setting attention block size to N
tokens to ensure that attention page size is >= mamba page size").

Defaults (``vllm/engine/arg_utils.py`` ``EngineArgs.get_batch_defaults``, API server): on
GPUs of 70 GiB or more other than an A100, ``--max-num-batched-tokens 8192`` and
``--max-num-seqs 1024``, else 2048 and 256; CUDA graphs for the batch sizes ``[1, 2, 4] +
8..248 by 8 + 256..max by 16`` with ``max = min(2 x max_num_seqs, 512)``
(``vllm/config/compilation.py``).

Checked against published startup logs in ``tests/test_engine_serving.py`` (the sources
are cited there and in docs/engines.md). Not priced: with data-parallel attention every MoE layer
gathers the tokens of all DP ranks (``FusedMoE`` with ``dp_size > 1``: the all-gather of
the naive / allgather-reducescatter all2all backends), so the profile run's MoE buffers
grow with the DP size; one published log (vllm-project/recipes#12, DP 8 + EP) has 4.2 GiB
per rank less KV memory than this model predicts.
"""

from __future__ import annotations


from moefit.devices import Device
from moefit.external.parallel import (Layout, StageShard, ceil_div, floor_to, logits_bytes,
                                     moe_workspace_bytes, token_activation_bytes)
from moefit.external.multi_gpu import (RankBudget, ServePlan, ServeRequest, command_line, kv_cache_dtype,
                                     non_torch_bytes, runtime_with_comm, weight_detail)
from moefit.errors import InputError
from moefit.ingest.geometry import ModelGeometry
from moefit.memory.runtime import default_reserve_bytes
from moefit.plan.types import Line
from moefit.records import record
from moefit.units import GIB, MIB

VERSION = "vLLM 0.11-0.20, V1 engine; memory model of vllm-project/vllm 35d5cda"
#: ``--gpu-memory-utilization`` grid (the plan floors to it)
UTIL_STEP = 0.01
#: KV block (tokens): 16, also for MLA (the FLASH_ATTN_MLA backend on Hopper; a 0.19.0 log
#: of DeepSeek-V2-Lite prints 1,505,552 tokens in 94,097 blocks)
BLOCK = 16
#: Constants measured in vLLM 0.19.0 startup logs on H100 80GB (llm-d-incubation/llm-d-planner
#: PR #205, ``accuracy/results/v0.19.0/logs``; excerpts in ``tests/data/serving``); the
#: communicators' and the profile run's non-torch memory are in :mod:`moefit.external.multi_gpu`.
#: bytes per vocabulary entry and sampled row of the profile run's sampler step: the fp32
#: logits and the sampler's copies (Llama-3.1-8B: a 1.89 GiB peak for 1024 rows of 128256,
#: less its 64 MiB of hidden states: 14.95 B)
SAMPLER_BYTES_PER_LOGIT = 15
#: CUDA graphs (captured after the KV cache, outside the fraction): "Estimated PIECEWISE /
#: FULL CUDA graph memory: 84-522 MiB first-capture + (51-1) x 2-26 MiB per-graph", 0.65-1.57
#: GiB taken in all; priced as a first capture plus a cost per batch size (an estimate)
GRAPH_FIRST_BYTES = 384 * MIB
GRAPH_PER_SIZE_BYTES = 12 * MIB
KV_DTYPES = {"bf16": ("auto", 2), "fp16": ("auto", 2), "fp8": ("fp8", 1)}


def capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's default CUDA graph batch sizes for ``max_num_seqs`` (module docstring)."""
    top = min(2 * max_num_seqs, 512)
    sizes = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, top + 1, 16))
    return [s for s in sizes if s <= top]


def _big_gpu(device: Device) -> bool:
    return device.capacity_bytes >= 70 * GIB and "a100" not in device.description.lower()


@record
class KVGroups:
    """The KV cache of one rank as ``kv_cache_utils.py`` lays it out: ``page`` bytes (one
    block of one layer), ``block`` tokens, ``group_size`` layers per group, ``groups`` (one
    ``(kind, window)`` per group: ``full``, ``sliding``, ``chunked``, ``state``)."""

    page: int
    block: int
    group_size: int
    groups: tuple[tuple[str, int | None], ...]

    def tokens(self, available: int) -> tuple[int, int]:
        """(``num_blocks``, "GPU KV cache size" tokens) for ``available`` bytes."""
        if available <= 0 or not self.page:
            return 0, 0
        blocks = available // self.page // self.group_size
        return blocks, blocks // len(self.groups) * self.block

    def blocks_per_request(self, context: int, batched: int) -> int:
        """Blocks one request of ``context`` tokens holds, summed over the groups
        (``kv_cache_interface.py`` ``max_memory_usage_bytes``): full attention
        ``ceil(context / block)``; a sliding window ``ceil(min(window - 1 + batched,
        context) / block) + 1``; chunked local attention ``ceil(min(chunk + batched,
        context) / block)``; a recurrent-state group one block."""
        n = 0
        for kind, window in self.groups:
            if kind == "state":
                n += 1
            elif kind == "sliding":
                n += ceil_div(min(window - 1 + batched, context), self.block) + 1
            elif kind == "chunked":
                n += ceil_div(min(window + batched, context), self.block)
            else:
                n += ceil_div(context, self.block)
        return n


def kv_groups(shard: StageShard) -> KVGroups:
    """The KV layout of one stage (module docstring, ``kv_cache_utils.py``): layers of one
    kind (full and MLA alike, sliding per window, chunked per chunk, recurrent) form groups
    of the smallest kind's count; with recurrent layers the attention block grows to a
    multiple of 16 whose page holds one layer's state."""
    per_token = max(shard.kv_layer_bytes) if shard.kv_layer_bytes else 0
    kinds: dict[tuple[str, int | None], int] = {}
    for kind, window in shard.kv_kinds:
        kinds[(kind, window)] = kinds.get((kind, window), 0) + 1
    block = BLOCK
    page = per_token * block
    if shard.linear_layers:
        state = shard.state_bytes // shard.linear_layers
        if per_token:
            block = BLOCK * ceil_div(state, BLOCK * per_token)
            page = per_token * block
        else:
            page = state
        kinds[("state", None)] = shard.linear_layers
    size = min(kinds.values())
    groups: list[tuple[str, int | None]] = []
    for key, n in kinds.items():
        groups += [key] * ceil_div(n, size)
    return KVGroups(page, block, size, tuple(groups))


class VLLMEngine:
    """vLLM as a :class:`moefit.external.multi_gpu.EngineModel` (module docstring)."""

    name = "vllm"
    label = "vLLM"
    version = VERSION

    def kv_dtype(self, kv: str) -> tuple[str, int]:
        """``--kv`` -> ``--kv-cache-dtype``: bf16/fp16 -> ``auto`` (the model dtype), fp8 ->
        ``fp8`` (e4m3). Raises InputError for the block formats vLLM has no cache for."""
        return kv_cache_dtype(self, KV_DTYPES, kv)

    def default_batched(self, device: Device) -> int:
        return 8192 if _big_gpu(device) else 2048

    def default_seqs(self, device: Device, layout: Layout) -> int:
        return 1024 if _big_gpu(device) else 256

    def expert_blob(self, geom: ModelGeometry):
        return None

    def activations(self, geom: ModelGeometry, shard: StageShard, layout: Layout, batched: int,
                    seqs: int) -> int:
        """Torch's peak increase in the profile run (``GPUModelRunner.profile_run``): the
        larger of the forward pass of ``batched`` tokens and the sampler step of
        ``min(max_num_seqs, batched)`` rows (last stage only), both over the fused-MoE
        workspaces; a later pipeline stage also holds the received hidden states and residual."""
        ws = batched * moe_workspace_bytes(geom, shard.layers, layout.moe_group, layout.ep)
        fwd = batched * token_activation_bytes(geom, shard.layers, layout.tp)
        peak = fwd
        if shard.last:
            rows = min(seqs, batched)
            peak = max(peak, logits_bytes(geom, rows, SAMPLER_BYTES_PER_LOGIT) +
                       batched * geom.hidden_size * geom.dtype_bytes)
        if not shard.first:
            peak += 2 * batched * geom.hidden_size * geom.dtype_bytes
        return ws + peak

    def outside(self, shard: StageShard, layout: Layout, device: Device, req: ServeRequest,
                seqs: int) -> tuple[int, int, int]:
        """(runtime, CUDA graphs, margin) bytes: the lines outside the fraction."""
        runtime = runtime_with_comm(device, layout)
        graphs = GRAPH_FIRST_BYTES + len(capture_sizes(seqs)) * GRAPH_PER_SIZE_BYTES
        margin = default_reserve_bytes(device) if req.margin is None else req.margin
        return runtime, graphs, margin

    def price(self, geom: ModelGeometry, shards: tuple[StageShard, ...], layout: Layout,
              device: Device, req: ServeRequest, batched: int, seqs: int) -> RankBudget:
        total = device.free_bytes      # the CUDA total of an idle GPU (moefit.devices)
        outs = [self.outside(s, layout, device, req, seqs) for s in shards]
        util = req.fraction or floor_to(min((total - sum(o)) / total for o in outs), UTIL_STEP)
        requested = int(total * util)
        non_torch = non_torch_bytes(layout)
        best = None
        for s, (runtime, graphs, margin) in zip(shards, outs):
            act = self.activations(geom, s, layout, batched, seqs)
            available = requested - s.weights - act - non_torch
            g = kv_groups(s)
            blocks, tokens = g.tokens(available)
            row = (blocks, tokens, s, g, act, available, runtime, graphs, margin)
            if best is None or blocks < best[0]:
                best = row
        blocks, tokens, s, g, act, available, runtime, graphs, margin = best
        kv_alloc = blocks * g.page * g.group_size
        per_req = g.blocks_per_request(req.context, batched)
        conc = blocks / per_req if per_req else 0.0
        kinds = [f"{k} attention" for k in sorted({k for k, _ in g.groups if k != "state"})]
        if any(k == "state" for k, _ in g.groups):
            kinds.append("Gated DeltaNet state")
        kv_detail = (f"{blocks:,} blocks of {g.block} tokens, {' + '.join(kinds)}, {self.kv_dtype(req.kv)[0]}")
        lines = (
            Line("runtime", runtime, "CUDA context + NCCL" if layout.world > 1 else "CUDA context estimate"),
            Line("weights", s.weights, weight_detail(s)),
            Line("activations", act, f"profile run: {batched} tokens, sampler of {min(seqs, batched)}"),
            Line("workspace", non_torch, "non-torch growth of the profile run"),
            Line("kv", max(kv_alloc, 0), kv_detail),
            Line("graphs", graphs, f"{len(capture_sizes(seqs))} batch sizes, outside the fraction (estimate)"),
            Line("margin", margin, ""),
        )
        return RankBudget(lines, tokens, util, s.stage, batched, seqs, conc,
                          {"gpu_memory_utilization": util, "available_kv_bytes": available,
                           "num_blocks": blocks, "block_size": g.block, "kv_groups": len(g.groups),
                           "blocks_per_request": per_req, "request_bytes": per_req * g.page * g.group_size})

    # ---- the command line -----------------------------------------------------------------
    def flags(self, plan: ServePlan) -> list[tuple[str, str | None]]:
        lay, b, r = plan.layout, plan.budget, plan.request
        out: list[tuple[str, str | None]] = [("--tensor-parallel-size", str(lay.tp))]
        if lay.pp > 1:
            out.append(("--pipeline-parallel-size", str(lay.pp)))
        if lay.dp > 1:
            out.append(("--data-parallel-size", str(lay.dp)))
        if lay.ep:
            out.append(("--enable-expert-parallel", None))
        out += [("--max-model-len", str(r.context)), ("--max-num-seqs", str(b.seqs)),
                ("--max-num-batched-tokens", str(b.batched)),
                ("--gpu-memory-utilization", f"{b.knob:.2f}"),
                ("--kv-cache-dtype", self.kv_dtype(r.kv)[0])]
        out += [(f, v) for f, v in r.extra_flags if f == "--hf-overrides"]
        if r.trust_remote_code:
            out.append(("--trust-remote-code", None))
        return out

    def check_layout(self, layout: Layout) -> None:
        """Reject a layout vLLM cannot start over ``layout.nodes`` nodes. With data parallelism
        a rank's ``tp x pp`` GPUs either fill whole nodes (a rank spans nodes: only the Ray
        launcher places it, ``VLLM_RAY_DP_PACK_STRATEGY=span``, vllm-project/vllm#26367) or
        several ranks fit in one node (``--data-parallel-size-local`` ranks per node,
        ``docs/serving/data_parallel_deployment.md``). Raises InputError naming ``--tp`` and
        ``--nodes``."""
        rank, per_node = layout.tp * layout.pp, layout.gpus_per_node
        if layout.dp > 1 and layout.nodes > 1 and per_node % rank and rank % per_node:
            raise InputError(
                f"--tp {layout.tp} x --pp {layout.pp} = {rank} GPUs per data-parallel rank on nodes of "
                f"{per_node} GPUs (--gpus {layout.world} over --nodes {layout.nodes}): vLLM needs whole ranks "
                f"on a node or ranks of whole nodes; use a --tp that divides {per_node}, or a multiple of it")

    def commands(self, plan: ServePlan) -> list[str]:
        """``vllm serve``, one per node: multi-node runs as ``docs/serving/parallelism_scaling.md``
        documents it with the multiprocessing backend (``--nnodes N --node-rank i
        --master-addr HEAD``, ``--headless`` on the workers); data parallelism across nodes
        as ``docs/serving/data_parallel_deployment.md`` (``--data-parallel-size-local``,
        ``--data-parallel-address``, ``--headless --data-parallel-start-rank``); a
        data-parallel rank larger than a node through a Ray cluster (``ray start`` on every
        node, then one ``vllm serve --data-parallel-backend ray`` with
        ``VLLM_RAY_DP_PACK_STRATEGY=span`` on the first: vllm-project/vllm#26367): then one
        entry per node and, last, the first node's ``vllm serve``."""
        lay = plan.layout
        base = f"vllm serve {plan.request.model_ref} " + command_line(self.flags(plan))
        if lay.nodes == 1:
            return [base]
        if lay.dp > 1 and lay.tp * lay.pp > lay.gpus_per_node:
            return (["ray start --head --port 6379"] +
                    ["ray start --address HEAD_IP:6379" for _ in range(1, lay.nodes)] +
                    [f"VLLM_RAY_DP_PACK_STRATEGY=span {base} --data-parallel-backend ray"])
        if lay.dp > 1:
            local = lay.dp // lay.nodes
            head = (f"{base} --data-parallel-size-local {local} --data-parallel-address HEAD_IP "
                    "--data-parallel-rpc-port 13345")
            return [head] + [f"{head} --headless --data-parallel-start-rank {i * local}"
                             for i in range(1, lay.nodes)]
        return [f"{base} --nnodes {lay.nodes} --node-rank {i} --master-addr HEAD_IP"
                + (" --headless" if i else "") for i in range(lay.nodes)]


ENGINE = VLLMEngine()
