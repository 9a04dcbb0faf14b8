"""The device a plan is solved for, in bytes: a real GPU, a catalogue card, or a stand-in.

Two memory figures describe a device, both in bytes:

- ``capacity_bytes``: the framebuffer total that ``nvidia-smi`` / NVML report
  (``memory.total``), e.g. 24564 MiB on an RTX 4090.
- ``free_bytes``: what CUDA can hand out to this process now. On headless Linux at idle
  that is the CUDA total, i.e. the framebuffer total minus the driver's reserved memory
  (300-770 MiB depending on card and driver; gpus.md §1), minus whatever other processes
  or a desktop hold (gpus.md §2).

Where the figures come from: :mod:`moefit.devices.catalogue` (built-in cards),
:mod:`moefit.devices.probe` (NVML, and the ``--device`` / ``--gpu`` / ``--vram`` flags).
"""

from __future__ import annotations

from typing import Literal

from moefit.records import record
from moefit.units import MIB

DeviceKind = Literal["cuda", "cpu"]

#: Usable bytes per second of one PCIe lane in one direction, by generation: the transfer
#: rate times the line code (PCI-SIG, PCI Express Base Specification: 1.0 2.5 GT/s and 2.0
#: 5 GT/s with 8b/10b; 3.0 8 GT/s, 4.0 16 GT/s and 5.0 32 GT/s with 128b/130b), i.e. 0.25,
#: 0.5, 0.985, 1.969 and 3.938 GB/s per lane, 15.75 / 31.5 / 63.0 GB/s at x16 (the table of
#: hpc-notes.pages.dev/reference/pcie, which quotes the same figures). Packet overheads (TLP
#: headers) come on top and are not priced: the speed model takes the link's peak.
PCIE_LANE_BYTES_PER_S: dict[int, float] = {
    1: 2.5e9 * 8 / 10 / 8, 2: 5e9 * 8 / 10 / 8,
    3: 8e9 * 128 / 130 / 8, 4: 16e9 * 128 / 130 / 8, 5: 32e9 * 128 / 130 / 8,
}


@record
class GpuSpeed:
    """A GPU's throughput figures for the speed model (:mod:`moefit.plan.speed`).

    Attributes:
        memory_bytes_per_s: device memory bandwidth (the spec sheet's GB/s x 1e9).
        bf16_flops: dense bf16 tensor-core throughput with fp32 accumulation, FLOP/s.
        int8_ops: dense int8 tensor-core throughput, OP/s.
        pcie_gen, pcie_lanes: the host link (generation, lanes).
        source: where the figures come from (a spec sheet; NVML for a probed link).
    """

    memory_bytes_per_s: float
    bf16_flops: float
    int8_ops: float
    pcie_gen: int
    pcie_lanes: int
    source: str

    @property
    def pcie_bytes_per_s(self) -> float:
        """The link's peak in one direction (:data:`PCIE_LANE_BYTES_PER_S` x lanes)."""
        return PCIE_LANE_BYTES_PER_S.get(self.pcie_gen, PCIE_LANE_BYTES_PER_S[5]) * self.pcie_lanes


@record
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
        note: what was assumed about the device, printed as a note of the plan (a
            what-if card's free memory at idle); empty when nothing was.
        speed: its throughput figures (:class:`GpuSpeed`: a catalogue card's spec sheet, a
            probed card's PCIe link from NVML); None when not known (a ``--vram`` card, the
            simulated device: the speed model then uses the host's figures).

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
    note: str = ""
    speed: GpuSpeed | None = None

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
