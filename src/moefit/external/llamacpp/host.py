"""What ``llama-server`` keeps in host memory beside the device (mapped or copied CPU tensors,
the output and CPU compute buffers, the KV cache with ``-nkvo``), as moefit's host table."""

from __future__ import annotations

from moefit.devices import Device, Host
from moefit.external.llamacpp.buffers import ComputePrice, KVPrice, PricedModel
from moefit.external.llamacpp.command import LlamaPlan, LlamaRequest, layer_ranges, load_mode
from moefit.memory.host import default_host_reserve_bytes
from moefit.plan.types import HostPlan, Line, limiting_lines
from moefit.units import format_bytes


#: llama-server's host lines (key, label), in the order it allocates them
HOST_LINES = (("host_runtime", "runtime"), ("host_weights", "model buffers"), ("host_repack", "CPU_REPACK"),
              ("host_kv", "KV cache"),
              ("host_compute", "compute buffer"), ("host_devices", "simulated device"),
              ("host_margin", "safety margin"))
#: the host side of llama-server's process before any buffer (bytes): not measured, estimates;
#: with CUDA the host side of the CUDA context and of ggml-cuda's and cuBLAS's kernels
HOST_RUNTIME_CPU = 256 << 20
HOST_RUNTIME_CUDA = 1 << 30


def host_bytes(m: PricedModel, device: Device, req: LlamaRequest, ub: int, on_cpu: frozenset[int],
               kv: KVPrice, comp: ComputePrice) -> dict[str, int]:
    """What llama-server keeps in host memory beside the device (bytes), by part:

    - ``model``: the CPU tensors, the token embeddings and the experts of the ``on_cpu`` layers
      (``llama_model::load_tensors``). With mmap (``-lm mmap``, the default) they are the
      file's pages (``CPU_Mapped model buffer``): the buffer type chosen for a CPU tensor on a
      GPU build is the GPU's host type (``make_cpu_buft_list``: ACCEL, GPU host, CPU extra,
      CPU), which ``create_tensor`` replaces by the plain CPU type under mmap ("avoid using a
      host buffer when using mmap"), and only a default CPU buffer is mapped
      (``is_default_buft``); without mmap they are read into a ``CUDA_Host`` (pinned) or
      ``CPU`` buffer, with ``mlock`` locked there;
    - ``output``: the logits and embeddings buffer ``n_vocab x n_seq x 4``
      (``llama_context::output_reserve``, in the GPU's host buffer type);
    - ``compute``: the CPU backend's compute buffer (``CUDA_Host compute buffer``): graph
      inputs go to the last backend, the CPU (``ggml_backend_sched_backend_id_from_cur``,
      ``GGML_TENSOR_FLAG_INPUT``), so on a GPU it holds the KQ mask as the graph builds it
      (``[n_kv, n_ubatch]`` f16 with flash attention, one per cache) and the embedding
      lookup's rows twice (``4 ub n_embd``: the f32 rows and their copy); 528.30 MiB
      printed against 528.00 planned in one published log (tests/test_llamacpp_cuda_logs.py);
      on the CPU backend the embedding lookup only (``4 ub (n_embd + 1)``), the rest being
      the device's compute buffer;
    - ``repack``: on the CPU backend alone (a simulated device) the ``CPU_REPACK`` copies of
      the weights the CPU repacks (:func:`~moefit.external.llamacpp.buffers.repack_bytes`),
      host memory beside the mapped file; beside a GPU not priced (not measured);
    - ``kv``: with ``-nkvo`` the KV cache and the recurrent state (``CPU KV buffer``,
      ``CPU RS buffer``), else 0.
    """
    g = m.geom
    model = m.buffers.host + sum(b for layer, b in m.buffers.experts_host if layer in on_cpu)
    if device.kind == "cpu":
        compute = 4 * ub * (g.hidden_size + 1)
    else:
        compute = comp.mask + 2 * 4 * ub * g.hidden_size
    return {"model": model, "repack": m.buffers.repack if device.kind == "cpu" else 0,
            "output": 4 * m.n_vocab * req.slots, "compute": compute,
            "kv": 0 if req.kv_offload else kv.kv_bytes + kv.recurrent_bytes}


def host_table(plan: LlamaPlan, host_mem: Host | None) -> HostPlan:
    """The host table of ``plan`` (:data:`HOST_LINES`; bytes of :func:`host_bytes`) against
    ``host_mem`` (None: priced, not checked). Mapped model pages count as resident: the CPU
    layers read every expert they route to, and a page the kernel drops is read from the
    disk again at the next token that needs it (``-lm mmap+mlock`` locks them, ``-lm none``
    copies them); the pages of the tensors uploaded to the device are read once at load and
    stay reclaimable page cache (not counted). On a simulated device (``--device cpu``) the
    device's buffers are host memory too (every line but the margin)."""
    r, h, dev = plan.request, plan.host, plan.device
    mode = load_mode(r)
    where = ("mapped file pages, counted as resident" if mode == "mmap" else
             "mapped and locked (mlock)" if mode == "mmap+mlock" else
             ("a pinned CUDA_Host copy" if dev.kind != "cpu" else "a copy in host memory")
             + (", locked (mlock)" if mode == "mlock" else ""))
    what = "token embeddings" + (f", experts of layers {layer_ranges(plan.cpu_layers)}" if plan.cpu_layers else
                                 f", experts of layers 0-{plan.n_cpu_moe - 1}" if plan.n_cpu_moe else "")
    sim = dev.kind == "cpu"
    margin = r.host_margin if r.host_margin is not None else default_host_reserve_bytes(
        host_mem.capacity_bytes if host_mem else None)
    lines = (
        Line("host_runtime", HOST_RUNTIME_CPU if sim else HOST_RUNTIME_CUDA,
             "llama-server" + ("" if sim else " with the CUDA runtime") + " (estimate)"),
        Line("host_weights", h["model"], f"{what}: {where} (-lm {mode})"),
    ) + ((Line("host_repack", h["repack"], "repacked weights, a host copy beside the mapped file "
               "(ggml-cpu repack.cpp)"),) if h.get("repack") else ()) + (   # shown only when some are
        Line("host_kv", h["kv"], "-nkvo: KV cache and recurrent state" if h["kv"] else "on the device"),
        Line("host_compute", h["output"] + h["compute"],
             f"output {format_bytes(h['output'])} + "
             + ("embedding rows" if sim else "KQ mask and embedding rows (CUDA_Host)")
             + f" {format_bytes(h['compute'])}"),
        Line("host_devices", sum(l.bytes for l in plan.lines if l.key != "margin") if sim else 0,
             "the simulated device's buffers" if sim else ""),
        Line("host_margin", margin, ""),
    )
    return HostPlan(host_mem, lines, "mmap" if mode.startswith("mmap") else
                    ("memory" if sim else "pinned"), h["model"] if mode.startswith("mmap") else 0, True)


#: host lines the process and the machine set (never limiting, as the device's runtime)
_HOST_FIXED = ("host_runtime",)


def host_limiting(hp: HostPlan, short: int, margin_by_hand: bool) -> tuple[str, ...]:
    """The host lines that make a host ``short`` bytes short (largest first), the runtime and
    the default margin never."""
    fixed = _HOST_FIXED + (() if margin_by_hand else ("host_margin",))
    return limiting_lines([l for l in hp.lines if l.key not in fixed], short)
