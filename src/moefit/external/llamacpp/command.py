"""The llama.cpp plan and its ``llama-server`` command line: what to plan (:class:`LlamaRequest`),
the solved budget (:class:`LlamaPlan`) and the flags that reproduce it (``-c``, ``-np``,
``-ub``, ``-b``, ``-ngl``, ``--n-cpu-moe`` / ``-ot``, ``-ctk`` / ``-ctv``, ``-nkvo``, ``-lm``,
``-fit off``), read from llama.cpp's ``common/arg.cpp`` and ``llama-context.cpp``."""

from __future__ import annotations

from moefit.devices import Device
from moefit.external.llamacpp.buffers import DEFAULT_BATCH, DEFAULT_UBATCH, ComputePrice, KVPrice, pad_cells
from moefit.ingest.geometry import ModelGeometry
from moefit.plan.types import Alternative, HostPlan, Line, LineTable
from moefit.records import field, record


LINES = (("runtime", "runtime"), ("weights", "model buffers"), ("kv", "KV cache"),
         ("state", "recurrent state"), ("compute", "compute buffer"), ("margin", "safety margin"),
         ("experts", "expert layers"))


@record
class LlamaRequest:
    """What to plan: ``context`` tokens per sequence, ``slots`` sequences (``-np``; ``-c`` is
    ``pad(context, 256) x slots``), ``ubatch`` requested (``-ub``; ``strict``: no
    clamp, ``ubatch_min``: the smallest clamp), ``batch`` (``-b``), cache types, ``margin``
    bytes (None: moefit's default), ``gguf`` path for the command, ``notes`` of the flags'
    mapping (carried into the plan), ``device`` (``-dev``, e.g. ``CUDA1``; empty: none);
    the host side: ``mmap`` (llama.cpp's default; False: ``--no-mmap``), ``mlock``
    (``--mlock``), ``kv_offload`` (False: ``-nkvo``, the KV cache and recurrent state in host
    memory), ``host_margin`` bytes left free on the host (None: moefit's default)."""

    context: int
    slots: int = 1
    ubatch: int = DEFAULT_UBATCH
    batch: int = DEFAULT_BATCH
    type_k: str = "f16"
    type_v: str = "f16"
    margin: int | None = None
    ubatch_min: int = 256
    strict: bool = False
    gguf: str = "model.gguf"
    extra_flags: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    device: str = ""
    mmap: bool = True
    mlock: bool = False
    kv_offload: bool = True
    host_margin: int | None = None


@record
class LlamaPlan(LineTable):
    """A solved llama.cpp budget on one device. ``n_cpu_moe``: the first layers whose experts
    stay on the CPU; ``lines`` in the order llama.cpp allocates them."""

    fits: bool
    geometry: ModelGeometry
    device: Device
    request: LlamaRequest
    ubatch: int
    n_cpu_moe: int
    lines: tuple[Line, ...]
    host: dict = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    kv: KVPrice | None = None
    compute: ComputePrice | None = None
    expert_bytes: tuple[tuple[int, int], ...] = ()      # (layer, device bytes)
    shortfall_bytes: int = 0
    alternatives: tuple[Alternative, ...] = ()
    limiting: tuple[str, ...] = ()
    cpu_layers: tuple[int, ...] | None = None   # layers whose experts stay on the CPU, when not a prefix
    host_table: HostPlan | None = None          # what llama-server keeps in host memory
    short_on: str = ""                          # on failure: the device's label, or "host"

    def line(self, key: str) -> Line:
        return next(l for l in self.lines if l.key == key)

    @property
    def override(self) -> str:
        """``-ot PATTERN=CPU`` for :attr:`cpu_layers` (``--override-tensor``: tensors whose name
        matches the regex go to that buffer type; the regex of ``--n-cpu-moe``'s
        ``llm_ffn_exps_block_regex``, one alternative per layer), or "" with ``--n-cpu-moe``."""
        if not self.cpu_layers:
            return ""
        layers = "|".join(str(i) for i in self.cpu_layers)
        return f"'blk\\.({layers})\\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU'"

    @property
    def batch(self) -> int:
        """``-b`` of the command (:func:`llama_batch`)."""
        return llama_batch(self.request, self.ubatch)

    @property
    def command(self) -> str:
        """The ``llama-server`` command line of this plan."""
        placement = ["-ot", self.override] if self.cpu_layers else (
            ["--n-cpu-moe", str(self.n_cpu_moe)] if self.n_cpu_moe else [])
        return server_command(self.request, self.ubatch, self.batch, placement)


def server_command(r: LlamaRequest, ubatch: int, batch: int, placement: list[str]) -> str:
    """The ``llama-server`` command of a plan of ``r`` at ``-ub ubatch -b batch``: ``placement``
    the flags that place layers and experts (``-ot`` / ``--n-cpu-moe``, and ``-sm layer -ts
    ...`` on several devices), ``-dev`` from ``r.device``."""
    # always -np: llama-server's default (-1, auto) is 4 slots sharing one cache
    # (tools/server/server.cpp), which would multiply the recurrent state and the SWA cache
    parts = ["llama-server", "-m", r.gguf, "-c", str(llama_ctx(r)), "-np", str(r.slots),
             "-ub", str(ubatch), "-b", str(batch), "-ngl", "999"]
    if r.device:
        parts += ["-dev", r.device]
    parts += [*placement, "-ctk", r.type_k, "-ctv", r.type_v, "-fa", "on"]
    if not r.kv_offload:
        parts.append("-nkvo")
    if load_mode(r) != "mmap":
        parts += ["-lm", load_mode(r)]
    # llama.cpp's --fit (on by default) changes unset flags to fit and gives up, with a
    # warning, once -ngl / -ot / --n-cpu-moe are set by hand (``llama_params_fit``): off, so the
    # planned placement is the one that runs
    parts += ["-fit", "off", *r.extra_flags]
    return " ".join(parts)


def llama_batch(req: LlamaRequest, ubatch: int) -> int:
    """``-b`` of a command running micro-batches of ``ubatch`` tokens: llama.cpp's 2048, or
    the micro-batch when larger, never above the requested ``-b``."""
    return min(req.batch, max(DEFAULT_BATCH, ubatch))


def llama_ctx(req: LlamaRequest) -> int:
    """llama.cpp's ``-c``: every slot's context, each padded to 256 cells (tokens)."""
    return pad_cells(req.context) * req.slots


def effective_ubatch(req: LlamaRequest) -> int:
    """The micro-batch llama.cpp runs for ``req`` (tokens): ``n_batch = min(n_ctx, -b)`` with
    causal attention, then ``n_ubatch = min(n_batch, -ub)`` (``llama-context.cpp``,
    ``llama_context::llama_context``; ``n_ctx`` is the command's ``-c``)."""
    return min(req.ubatch, max(req.batch, req.ubatch), llama_ctx(req))



#: ``-lm`` (``--load-mode``, ``common/arg.cpp``) modes: how the CPU tensors are held
LOAD_MODES = ("mmap", "none", "mlock", "mmap+mlock")


def load_mode(req: LlamaRequest) -> str:
    """llama.cpp's ``-lm`` of ``req``: ``mmap``, ``none``, ``mlock`` or ``mmap+mlock``."""
    return ("mmap" if req.mmap else "none") if not req.mlock else ("mmap+mlock" if req.mmap else "mlock")



def layer_ranges(layers: tuple[int, ...]) -> str:
    """``0-4, 7, 9-11`` of sorted layer indices."""
    out, start = [], None
    for i, layer in enumerate(layers):
        if start is None:
            start = layer
        if i + 1 == len(layers) or layers[i + 1] != layer + 1:
            out.append(f"{start}" if start == layer else f"{start}-{layer}")
            start = None
    return ", ".join(out)
