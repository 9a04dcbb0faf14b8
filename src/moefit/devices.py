"""The device a plan is solved for: a real GPU (via NVML), a catalogue card, or a stand-in.

Two memory figures describe a device, both in bytes:

- ``capacity_bytes``: the framebuffer total that ``nvidia-smi`` / NVML report
  (``memory.total``), e.g. 24564 MiB on an RTX 4090.
- ``free_bytes``: what CUDA can hand out to this process now. On headless Linux at idle
  that is the CUDA total, i.e. the framebuffer total minus the driver's reserved memory
  (300-770 MiB depending on card and driver; gpus.md §1), minus whatever other processes
  or a desktop hold (gpus.md §2).

Sources: ``gpus.md`` / ``gpus.csv`` in the project's shared data (driver-reported totals
gathered from public issues and ``nvidia-smi -q`` captures); each catalogue row cites the
line it comes from.

This module imports no torch. NVML (the optional ``nvidia-ml-py`` package, module
``pynvml``) is imported only when a real GPU is probed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from moefit.errors import InputError
from moefit.units import MIB, format_gib, parse_size, size_format

DeviceKind = Literal["cuda", "cpu"]

_NO_GPU_FIX = (
    "plan for a card you do not have with --gpu NAME (see `moefit gpus`) or --vram SIZE, "
    "or simulate one on the CPU with --device cpu --vram SIZE"
)


@dataclass(frozen=True)
class Device:
    """One device of the inventory a plan is solved against.

    Attributes:
        label: ``cuda:N`` or ``cpu``; the name tables and logs show.
        description: what the device is (``NVIDIA GeForce RTX 4090``, ``RTX 4090``,
            ``simulated 2.00 GiB device on the CPU``).
        kind: ``"cuda"`` for a CUDA card, real or what-if; ``"cpu"`` for the simulated
            device of ``--device cpu --vram SIZE`` (tensors live on the CPU, the declared
            capacity is enforced, no CUDA runtime is charged).
        capacity_bytes: framebuffer total in bytes (``nvidia-smi`` ``memory.total``).
        free_bytes: bytes the plan may use, in bytes; never above ``capacity_bytes``.
        simulated: False for a real GPU probed through NVML (possibly capped by
            ``--vram``/``--vram-free``); True for the CPU stand-in and for what-if CUDA
            cards (``--gpu NAME``, ``--vram SIZE`` without a real GPU), for which the
            planner still charges :func:`cuda_runtime_estimate_bytes`.
        runtime_bytes: runtime overhead in bytes when known (0 on the CPU stand-in);
            None means "not measured", and the planner charges an estimate on CUDA.
        source: where the numbers come from, for the printed table and ``--json``.

    Raises:
        ValueError: on an inconsistent device (a programming error; user input is
            checked by :func:`resolve_device` and reported as InputError).
    """

    label: str
    description: str
    kind: DeviceKind
    capacity_bytes: int
    free_bytes: int
    simulated: bool
    runtime_bytes: int | None = None
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ("cuda", "cpu"):
            raise ValueError(f"Device.kind must be 'cuda' or 'cpu', got {self.kind!r}")
        if not 0 <= self.free_bytes <= self.capacity_bytes:
            raise ValueError(
                f"Device {self.label}: need 0 <= free_bytes ({self.free_bytes}) "
                f"<= capacity_bytes ({self.capacity_bytes})"
            )
        if self.runtime_bytes is not None and self.runtime_bytes < 0:
            raise ValueError(f"Device {self.label}: runtime_bytes must be >= 0")


def cuda_runtime_estimate_bytes() -> int:
    """The ``runtime`` line charged on a CUDA device when it was not measured: 512 MiB.

    Derivation (gpus.md §3, "CUDA context overhead"):

    1. The CUDA context of a PyTorch process with lazy module loading (CUDA >= 11.7, the
       PyTorch default since 1.13) takes about 250-450 MiB: 256 MiB on an RTX 3090
       (invoke-ai/InvokeAI#9413), ~274 MiB with ``CUDA_MODULE_LOADING=LAZY``
       (pytorch/pytorch#86509), 426 MiB on an RTX 6000 Ada with torch 2.10
       (unslothai/unsloth-zoo#1053); maintainers quote "~300 MB" and "around 400MB"
       (pytorch/pytorch#107667, #109888). We take the largest measurement, 426 MiB.
    2. cuBLAS and cuBLASLt workspaces, one each per handle and stream: PyTorch sizes each
       at up to 32 MiB on sm90+ (cuBLAS's recommended Hopper workspace; pytorch/pytorch#120925),
       4 MiB or less on older cards: at most 64 MiB.
    3. 426 + 64 = 490 MiB, rounded up to 512 MiB; the rest covers kernels that lazy
       loading brings in on first use.

    This is an estimate for a single-GPU engine without NCCL; vLLM's "non_torch_memory"
    (context + cuBLAS + NCCL) reaches 1.79 GiB at TP=1 (vllm-project/vllm#10511), and
    llama.cpp / Ollama plan 1024 MiB, which is why ``--vram-reserve-mib`` exists as well.

    Returns:
        The estimate in bytes.
    """
    return 512 * MIB


# --- catalogue -------------------------------------------------------------------------

@dataclass(frozen=True)
class GpuSpec:
    """One catalogue card, as the driver reports it on Linux.

    Attributes:
        name: catalogue name (``RTX 4090``).
        nominal_gb: the marketed size in GB (24).
        capacity_mib: framebuffer total in MiB as ``nvidia-smi`` / NVML report it.
        free_mib: MiB that CUDA can hand out at idle on headless Linux (see
            :data:`GPU_CATALOGUE` for the rule).
        free_basis: which figure ``free_mib`` is, in a few words.
        source: the gpus.md line the numbers come from.
        aliases: extra names :func:`find_gpu` accepts besides those derived from ``name``.
    """

    name: str
    nominal_gb: int
    capacity_mib: int
    free_mib: int
    free_basis: str
    source: str
    aliases: tuple[str, ...] = ()

    def device(self, label: str = "cuda:0") -> Device:
        """This card as a what-if CUDA :class:`Device` (``simulated=True``)."""
        return Device(
            label=label,
            description=self.name,
            kind="cuda",
            capacity_bytes=self.capacity_mib * MIB,
            free_bytes=self.free_mib * MIB,
            simulated=True,
            runtime_bytes=None,
            source=(f"catalogue (what-if): nvidia-smi total {self.capacity_mib} MiB, free at "
                    f"idle {self.free_mib} MiB = {self.free_basis}; {self.source}"),
        )


_CUDA = "CUDA total"
_RESERVED = "total - reserved"
_IDLE = "headless idle free"
_GUESS = "total - 450 MiB (guess)"

#: The built-in cards. ``capacity_mib`` is the ``nvidia-smi`` total (gpus.md §4/§5).
#: ``free_mib`` is the lowest Linux figure gpus.md gives for what CUDA can allocate at idle:
#: a CUDA total (deviceQuery, cudaMemGetInfo; PyTorch's "total capacity" as a last resort),
#: ``Total - Reserved`` or the free memory of a headless idle card (both ``nvidia-smi -q``).
#: Newer drivers reserve more (gpus.md §1), so the lowest figure is the safe one to plan
#: with. Where none was seen: total - 450 MiB (gpus.md §1 sees 303-763 MiB reserved,
#: 303-464 MiB on consumer cards). Windows/WDDM figures (close to the full total) are not used.
GPU_CATALOGUE: tuple[GpuSpec, ...] = (
    GpuSpec("RTX 3060 12GB", 12, 12288, 11902, _CUDA + " (llama.cpp)",
            "gpus.md §5 'RTX 3060 12GB: 12288 (= 12 GiB); CUDA ~11902-12042'"),
    GpuSpec("RTX 3080 10GB", 10, 10240, 10014, "PyTorch total 9.78 GiB",
            "gpus.md §5 'RTX 3080 10GB: 10240 (= 10 GiB, unattributed copy); PyTorch 9.78 GiB "
            "on Linux' (the only CUDA figure seen; 9.78 x 1024 rounded down)"),
    GpuSpec("RTX 3090", 24, 24576, 24115, _CUDA + " (recent driver)",
            "gpus.md §5 'RTX 3090: 24576 (= 24 GiB); CUDA 24115-24268 (24154 on driver 560)'"),
    GpuSpec("RTX 4060 Ti 16GB", 16, 16380, 16075, _IDLE,
            "gpus.md §2 '4060 Ti 16GB: free 16075'; §5 'RTX 4060 Ti 16GB: 16380; CUDA 16076'"),
    GpuSpec("RTX 4070", 12, 12282, 12282 - 450, _GUESS,
            "gpus.md §5 'RTX 4070 12GB: 12282; CUDA not seen'"),
    GpuSpec("RTX 4070 Ti Super", 16, 16376, 15942, _CUDA + " (llama.cpp); total assumed",
            "gpus.md §5 'RTX 4070 Ti Super 16GB: nvidia-smi not seen; llama.cpp 15942 "
            "(unattributed copy)'; §4 'equals the 4080 Super's 16376 - 434' (the total is "
            "assumed to be the 4080 Super's: same AD103 memory layout)"),
    GpuSpec("RTX 4080", 16, 16376, 16376 - 434, _RESERVED + " (4080 Super's 434)",
            "gpus.md §5 'RTX 4080 / 4080 Super: 16376; CUDA ~15942 (16376 - 434 reserved)' "
            "(reserved seen on the 4080 Super, driver 595)"),
    GpuSpec("RTX 4080 Super", 16, 16376, 16376 - 434, _RESERVED + " (434)",
            "gpus.md §5 'RTX 4080 / 4080 Super: 16376; CUDA ~15942 (16376 - 434 reserved)'"),
    GpuSpec("RTX 4090", 24, 24564, 24080, _CUDA + " (llama.cpp)",
            "gpus.md §5 'RTX 4090: 24564; CUDA 24080-24210 on Linux'"),
    GpuSpec("RTX 5060 Ti 16GB", 16, 16311, 15848, _CUDA,
            "gpus.md §5 'RTX 5060 Ti 16GB: 16311; CUDA 15848'"),
    GpuSpec("RTX 5070", 12, 12227, 12227 - 464, _RESERVED + " (464)",
            "gpus.md §5 'RTX 5070 12GB: 12227; reserved 464'"),
    GpuSpec("RTX 5070 Ti", 16, 16303, 16303 - 450, _GUESS,
            "gpus.md §5 'RTX 5070 Ti 16GB: 16303 (unattributed copy)'"),
    GpuSpec("RTX 5080", 16, 16303, 16303 - 450, _GUESS,
            "gpus.md §5 'RTX 5080: 16303 (unattributed copy)'"),
    GpuSpec("RTX 5090", 32, 32607, 32101, _CUDA,
            "gpus.md §5 'RTX 5090: 32607; CUDA 32101-32117 on Linux, 32606 on Windows'"),
    GpuSpec("RTX A6000", 48, 49140, 49140 - 454, _RESERVED + " (454), ECC off",
            "gpus.md §5 'RTX A6000: 49140 with ECC off (46068 with ECC on); CUDA 48790'; "
            "§4 'Reserved is 454'. With ECC on, use --vram 46068MiB"),
    GpuSpec("L40S", 48, 46068, 46068 - 609, _RESERVED + " (609), ECC on",
            "gpus.md §5 'L40S: 46068 (ECC on); CUDA 45589'; §4 'On driver 595 the free "
            "memory at idle is 45460 (reserved 609)'"),
    GpuSpec("A100 40GB", 40, 40960, 40339, _CUDA,
            "gpus.md §5 'A100 40GB SXM4: 40960; CUDA 40339'",
            aliases=("A100 40GB SXM4", "A100 SXM4 40GB")),
    GpuSpec("A100 80GB", 80, 81920, 81920 - 763, _RESERVED + " (763)",
            "gpus.md §5 'A100 80GB: 81920; CUDA 81158'; §4 'Reserved is 763'",
            aliases=("A100 80GB PCIe", "A100 SXM4 80GB", "A100 SXM 80GB")),
    GpuSpec("H100 80GB", 80, 81559, 81559 - 479, _RESERVED + " (479)",
            "gpus.md §5 'H100 80GB SXM / PCIe: 81559; CUDA 81080-81106'; §4 '81559 - 479 "
            "reserved' on driver 590",
            aliases=("H100 SXM", "H100 PCIe", "H100 80GB HBM3")),
    GpuSpec("H200", 141, 143771, 143771 - 614, _RESERVED + " (614)",
            "gpus.md §5 'H200: 143771; about 143158 free at idle'; §4 'Reserved is 614'"),
    GpuSpec("RTX PRO 6000 Blackwell", 96, 97887, 97249, "cudaMemGetInfo total 94.97 GiB",
            "gpus.md §5 'RTX PRO 6000 Blackwell: 97887; CUDA figures disagree (97886 vs "
            "94.97 GiB)'; 94.97 x 1024 rounded down; 97886 looks like a Windows full-size "
            "figure and is not used",
            aliases=("RTX PRO 6000", "PRO 6000", "RTX PRO 6000 Blackwell Workstation Edition")),
)


def _normalize(name: str) -> str:
    """Lower-case, keep letters and digits only, drop a leading ``nvidia`` / ``geforce``."""
    key = "".join(ch for ch in name.lower() if ch.isalnum())
    for prefix in ("nvidia", "geforce"):
        key = key.removeprefix(prefix)
    return key


def _keys(spec: GpuSpec) -> set[str]:
    """Every normalized name that selects ``spec``: with or without ``RTX`` and the size."""
    base = _normalize(spec.name).removesuffix(f"{spec.nominal_gb}gb")
    keys = set()
    for stem in (base, base.removeprefix("rtx")):
        keys |= {stem, f"{stem}{spec.nominal_gb}gb"}
    keys |= {_normalize(alias) for alias in spec.aliases}
    return keys


def _index() -> dict[str, list[GpuSpec]]:
    index: dict[str, list[GpuSpec]] = {}
    for spec in GPU_CATALOGUE:
        for key in _keys(spec):
            index.setdefault(key, []).append(spec)
    return index


_INDEX = _index()


def find_gpu(name: str) -> Device:
    """The catalogue card called ``name``, as a what-if CUDA :class:`Device` on ``cuda:0``.

    Matching ignores case, spaces, dashes and a leading ``NVIDIA`` / ``GeForce``; ``RTX`` and
    the memory size are optional: ``"5060ti"``, ``"rtx 4090"``, ``"4090"``, ``"h100"``,
    ``"NVIDIA GeForce RTX 4090"`` all match. Only whole names match, so ``"4070 Ti"`` does
    not silently become the 4070 Ti Super.

    Raises:
        InputError: empty name; an ambiguous name (``"a100"``), listing the candidates;
            an unknown name, listing the catalogue and pointing to ``moefit gpus`` and
            ``--vram``.
    """
    key = _normalize(name or "")
    if not key:
        raise InputError("--gpu: empty GPU name; give one such as 'RTX 4090' (see `moefit gpus`)")
    matches = _INDEX.get(key, [])
    if len(matches) == 1:
        return matches[0].device()
    if matches:
        names = ", ".join(spec.name for spec in matches)
        raise InputError(f"--gpu: {name!r} is ambiguous: it matches {names}; give the full name")
    near = [spec.name for spec in GPU_CATALOGUE if any(key in k for k in _keys(spec))]
    hint = f" Did you mean {' or '.join(near)}?" if 0 < len(near) <= 3 else ""
    known = ", ".join(spec.name for spec in GPU_CATALOGUE)
    raise InputError(
        f"--gpu: unknown GPU {name!r}.{hint} Known cards: {known} (`moefit gpus` lists their "
        f"memory). For another card give its memory instead: --vram SIZE [--vram-free SIZE]"
    )


def format_gpu_table() -> str:
    """The catalogue as the text table ``moefit gpus`` prints (sizes in MiB)."""
    header = ("GPU", "nominal", "total MiB", "free MiB", "free at idle is")
    rows = [header] + [
        (s.name, f"{s.nominal_gb} GB", str(s.capacity_mib), str(s.free_mib), s.free_basis)
        for s in GPU_CATALOGUE
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = []
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:4], widths[1:])]
        lines.append("  ".join(cells + [row[4]]).rstrip())
    lines.append("")
    lines.append("total MiB: the framebuffer total nvidia-smi reports. free MiB: what CUDA can "
                 "allocate on an idle headless Linux box;")
    lines.append("a desktop on the card takes 200-600 MiB more, and the CUDA runtime of "
                 f"moefit itself ~{cuda_runtime_estimate_bytes() // MIB} MiB. Other cards: "
                 "--vram SIZE [--vram-free SIZE].")
    return "\n".join(lines)


# --- real GPUs (NVML) -----------------------------------------------------------------

def _visible_entries() -> list[str] | None:
    """``CUDA_VISIBLE_DEVICES`` as CUDA reads it: entries up to the first invalid one."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    entries = []
    for entry in (e.strip() for e in value.split(",")):
        if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
            break
        entries.append(entry)
    return entries


def _handle(pynvml, index: int):
    """The NVML handle of CUDA device ``index`` and a note on how it was found.

    CUDA numbers the devices listed in ``CUDA_VISIBLE_DEVICES`` from 0, NVML ignores that
    variable, so ``cuda:N`` is mapped through it. Without it, ``cuda:N`` is NVML index N,
    which is the PCI bus order; CUDA agrees when ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or when
    all cards are the same model.
    """
    count = pynvml.nvmlDeviceGetCount()
    visible = _visible_entries()
    if visible is None:
        if index >= count:
            raise InputError(f"--device cuda:{index}: NVML sees {count} GPU(s) "
                             f"(cuda:0..cuda:{count - 1}); pick one of those or {_NO_GPU_FIX}")
        return pynvml.nvmlDeviceGetHandleByIndex(index), f"NVML index {index}"
    if index >= len(visible):
        raise InputError(
            f"--device cuda:{index}: CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r} "
            f"makes {len(visible)} GPU(s) visible; pick a lower index, change the variable, "
            f"or {_NO_GPU_FIX}")
    entry = visible[index]
    if entry.isdigit():
        if int(entry) >= count:
            raise InputError(f"--device cuda:{index}: CUDA_VISIBLE_DEVICES names GPU {entry} "
                             f"but NVML sees {count} GPU(s); fix the variable or {_NO_GPU_FIX}")
        return pynvml.nvmlDeviceGetHandleByIndex(int(entry)), f"NVML index {entry}"
    return pynvml.nvmlDeviceGetHandleByUUID(entry), f"NVML UUID {entry}"


def probe_cuda(index: int = 0) -> Device:
    """Read name, total and free memory of GPU ``cuda:index`` through NVML.

    Uses ``nvmlInit``, ``nvmlDeviceGetHandleByIndex`` (or ``...ByUUID`` when
    ``CUDA_VISIBLE_DEVICES`` lists UUIDs), ``nvmlDeviceGetMemoryInfo`` and
    ``nvmlDeviceGetName``. NVML's ``total`` is the ``nvidia-smi`` total and its ``free``
    excludes the driver's reserved memory and other processes (gpus.md §1), which is what
    this process can allocate. No CUDA context is created.

    Returns:
        A real (``simulated=False``) CUDA :class:`Device`, sizes in bytes,
        ``runtime_bytes=None`` (the runtime is estimated until measured).

    Raises:
        InputError: ``pynvml`` (package ``nvidia-ml-py``) is not installed, no driver or GPU
            is found, or ``index`` names no visible GPU; the message suggests ``--gpu NAME``
            and ``--vram SIZE``.
    """
    label = f"cuda:{index}"
    try:
        import pynvml
    except ImportError:
        raise InputError(
            f"--device {label}: cannot read the GPU's memory: NVML bindings are not installed "
            f"(pip install 'moefit[nvml]', i.e. nvidia-ml-py); or {_NO_GPU_FIX}"
        ) from None
    nvml_error = getattr(pynvml, "NVMLError", Exception)
    try:
        pynvml.nvmlInit()
    except nvml_error as exc:
        raise InputError(f"--device {label}: no NVIDIA driver or GPU found (NVML: {exc}); "
                         f"{_NO_GPU_FIX}") from None
    try:
        handle, how = _handle(pynvml, index)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        name = pynvml.nvmlDeviceGetName(handle)
    except nvml_error as exc:
        raise InputError(f"--device {label}: NVML could not read this GPU ({exc}); "
                         f"{_NO_GPU_FIX}") from None
    finally:
        pynvml.nvmlShutdown()
    if isinstance(name, bytes):  # nvidia-ml-py < 11.515 returns bytes
        name = name.decode()
    return Device(
        label=label,
        description=name,
        kind="cuda",
        capacity_bytes=int(memory.total),
        free_bytes=min(int(memory.free), int(memory.total)),
        simulated=False,
        runtime_bytes=None,
        source=f"NVML ({how}), free memory at probe time",
    )


# --- command-line resolution ----------------------------------------------------------

def _parse_device_flag(device: str) -> tuple[DeviceKind, int]:
    text = device.strip().lower()
    if text == "cpu":
        return "cpu", 0
    if text == "cuda":
        return "cuda", 0
    if text.startswith("cuda:") and text[5:].isdigit():
        return "cuda", int(text[5:])
    raise InputError(f"--device: {device!r} is not a device; use cuda, cuda:N (N = 0, 1, ...) "
                     f"or cpu (a simulated device, with --vram SIZE)")


def resolve_device(device: str | None, gpu: str | None, vram: str | None,
                   vram_free: str | None) -> Device:
    """The :class:`Device` the flags ``--device``, ``--gpu``, ``--vram``, ``--vram-free`` describe.

    1. ``--device cuda[:N]``: the real GPU via NVML; ``--vram`` lowers its capacity and
       ``--vram-free`` its free memory (a what-if on a real card; neither may exceed what
       the card has).
    2. ``--device cpu --vram SIZE``: a simulated device on the CPU with that capacity;
       free = ``--vram-free`` or ``--vram``; runtime 0.
    3. ``--gpu NAME``: a what-if catalogue card (:func:`find_gpu`); ``--vram-free`` replaces
       its free memory.
    4. ``--vram SIZE`` alone: a what-if CUDA card of that capacity; free = ``--vram-free``
       or the whole capacity.
    5. none of these: the real ``cuda:0`` via NVML (``--vram-free`` lowers its free memory).

    Raises:
        InputError: a bad size or device string; ``--device cpu`` without ``--vram``;
            ``--gpu`` with ``--device`` or ``--vram``; ``--vram-free`` above the capacity;
            a cap above what a real card has; and every error of :func:`probe_cuda` and
            :func:`find_gpu`.
    """
    vram_bytes = parse_size(vram, "--vram") if vram is not None else None
    free_bytes = parse_size(vram_free, "--vram-free") if vram_free is not None else None
    kind, index = _parse_device_flag(device) if device is not None else (None, 0)

    def check_free(capacity: int, what: str) -> None:
        if free_bytes is not None and free_bytes > capacity:
            raise InputError(f"--vram-free {vram_free} is more than {what} "
                             f"({format_gib(capacity)}); lower --vram-free")

    if gpu is not None:
        if device is not None:
            what = "a simulated one on the CPU" if kind == "cpu" else "a real one"
            raise InputError(f"--gpu {gpu} plans for a catalogue card and --device {device} for "
                             f"{what}; drop one of them")
        if vram is not None:
            raise InputError(f"--gpu {gpu} already fixes the card's memory; drop --vram, or drop "
                             f"--gpu and describe the card with --vram SIZE [--vram-free SIZE]")
        card = find_gpu(gpu)
        check_free(card.capacity_bytes, f"the {card.description}'s total")
        if free_bytes is None:
            return card
        return Device(card.label, card.description, "cuda", card.capacity_bytes, free_bytes,
                      simulated=True, source=card.source + f"; free set by --vram-free {vram_free}")

    if kind == "cpu":
        if vram_bytes is None:
            raise InputError("--device cpu simulates a GPU on the CPU and needs its size: "
                             "add --vram SIZE (e.g. --vram 2GiB)")
        check_free(vram_bytes, "--vram")
        size = size_format(vram_bytes)(vram_bytes)
        return Device("cpu", f"simulated {size} device on the CPU", "cpu",
                      vram_bytes, free_bytes if free_bytes is not None else vram_bytes,
                      simulated=True, runtime_bytes=0,
                      source="--device cpu --vram" + (" --vram-free" if vram_free is not None else ""))

    if kind is None and vram_bytes is not None:
        check_free(vram_bytes, "--vram")
        return Device("cuda:0", f"what-if {format_gib(vram_bytes)} CUDA card", "cuda",
                      vram_bytes, free_bytes if free_bytes is not None else vram_bytes,
                      simulated=True,
                      source="--vram" + (" --vram-free" if vram_free is not None else " (free = capacity)"))

    try:
        real = probe_cuda(index)
    except InputError:
        if vram_bytes is None:
            raise
        # no GPU here: --device cuda:N --vram SIZE is a what-if card with that index
        check_free(vram_bytes, "--vram")
        return Device(f"cuda:{index}", f"what-if {format_gib(vram_bytes)} CUDA card", "cuda",
                      vram_bytes, free_bytes if free_bytes is not None else vram_bytes,
                      simulated=True, source="--device --vram (no GPU readable here)")
    capacity, free = real.capacity_bytes, real.free_bytes
    if vram_bytes is not None:
        if vram_bytes > capacity:
            raise InputError(f"--vram {vram} is more than {real.label} has "
                             f"({format_gib(capacity)}); --vram can only lower a real card's size")
        capacity, free = vram_bytes, min(free, vram_bytes)
    if free_bytes is not None:
        check_free(capacity, "--vram" if vram_bytes is not None else f"{real.label}'s total")
        if free_bytes > real.free_bytes:
            raise InputError(f"--vram-free {vram_free} is more than {real.label} has free now "
                             f"({format_gib(real.free_bytes)}); lower --vram-free")
        free = free_bytes
    if (capacity, free) == (real.capacity_bytes, real.free_bytes):
        return real
    return Device(real.label, real.description, "cuda", capacity, free, simulated=False,
                  source=real.source + "; capped by --vram/--vram-free")
