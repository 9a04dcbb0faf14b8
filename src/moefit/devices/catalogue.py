"""The built-in GPU catalogue: each card's name, framebuffer total and free memory at idle,
its throughput figures, and the ``moefit gpus`` table.

Sources: memory: ``gpus.md`` / ``gpus.csv`` in the project's shared data (driver-reported
totals gathered from public issues and ``nvidia-smi -q`` captures); each catalogue row cites
the line it comes from. Throughput (:data:`GPU_SPEEDS`): NVIDIA's spec sheets and
architecture whitepapers, cited per card. Imports no torch and no NVML.
"""

from __future__ import annotations

from moefit.devices.device import Device, GpuSpeed, cuda_runtime_estimate_bytes
from moefit.errors import InputError
from moefit.records import record
from moefit.units import MIB


@record
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

    @property
    def speed(self) -> GpuSpeed | None:
        """The card's throughput figures (:data:`GPU_SPEEDS`)."""
        return GPU_SPEEDS.get(self.name)

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
            speed=self.speed,
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
    GpuSpec("RTX 3060 Ti", 8, 8192, 8192 - 450, _GUESS,
            "gpus.md §5 'RTX 3060 Ti: 8192 (= 8 GiB, unattributed copy); CUDA not seen'"),
    GpuSpec("RTX 3070", 8, 8192, 8192 - 450, _GUESS,
            "gpus.md §5 'RTX 3070: 8192 (= 8 GiB, unattributed copy); CUDA not seen'"),
    GpuSpec("RTX 3080 10GB", 10, 10240, 10014, "PyTorch total 9.78 GiB",
            "gpus.md §5 'RTX 3080 10GB: 10240 (= 10 GiB, unattributed copy); PyTorch 9.78 GiB "
            "on Linux' (the only CUDA figure seen; 9.78 x 1024 rounded down)"),
    GpuSpec("RTX 3090", 24, 24576, 24115, _CUDA + " (recent driver)",
            "gpus.md §5 'RTX 3090: 24576 (= 24 GiB); CUDA 24115-24268 (24154 on driver 560)'"),
    GpuSpec("RTX 4060", 8, 8188, 8188 - 450, _GUESS,
            "gpus.md §5 'RTX 4060 8GB: 8188 (unattributed copy); CUDA not seen'"),
    GpuSpec("RTX 4060 Ti 8GB", 8, 8188, 8188 - 450, _GUESS,
            "gpus.md §5 'RTX 4060 Ti 8GB: 8188 (unattributed copy); CUDA not seen'"),
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


# Throughput figures, each checked against the document its source string names.
#
# Which bf16 rate: the speed model prices bf16 matmuls, and bf16 tensor-core math has only fp32
# accumulation (there is no bf16-accumulate mode; PyTorch's bf16 matmuls accumulate in fp32), so
# ``bf16_flops`` is the "FP16/BF16 Tensor TFLOPS with FP32 Accumulate" row, dense (without 2:4
# sparsity; NVIDIA's sparse figures are 2x). GeForce cards run that row at half their
# fp16-accumulate rate (the Ampere / Ada whitepapers list both rows: RTX 3090 71 vs 142 dense,
# RTX 4090 165.2 vs 330.3); professional and data-center cards run it at the full rate.
#
# Derived GeForce cards: dense bf16 (fp32 accumulate) = 128 FLOP and dense int8 = 512 OP per
# tensor core and clock, 4 tensor cores per SM, at the card's boost clock. The per-core rates
# are those of the whitepapers' flagship rows: RTX 3090 71 TFLOPS / 284 TOPS at 82 SMs x
# 1.695 GHz; RTX 4090 165.2 / 660.6 at 128 SMs x 2.52 GHz; RTX 5090 209.5 / 838 at 170 SMs x
# 2.407 GHz (tests/test_speed.py re-derives every whitepaper row from these rates). The int8
# rate is also checked against NVIDIA's "AI TOPS" of each card (:data:`PUBLISHED_AI_TOPS`):
# Ada's is fp8 with sparsity = 2 x dense int8, Blackwell's fp4 with sparsity = 4 x dense int8.
# Bandwidth = data rate x bus width / 8 as the spec page lists it. PCIe: the card's host link.
_AMPERE_WP = ("NVIDIA Ampere GA102 GPU Architecture whitepaper v2.0 (nvidia.com/content/PDF/"
              "nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.pdf; contents seen in the "
              "copy at docslib.org/doc/759549)")
_ADA_WP = ("NVIDIA Ada GPU Architecture whitepaper v2.01 (images.nvidia.com/aem-dam/Solutions/"
           "geforce/ada/nvidia-ada-gpu-architecture.pdf)")
_BW_WP = ("NVIDIA RTX Blackwell GPU Architecture whitepaper (images.nvidia.com/aem-dam/Solutions/"
          "geforce/blackwell/nvidia-rtx-blackwell-gpu-architecture.pdf)")

#: NVIDIA's published "AI TOPS" per derived GeForce card, with the factor to dense int8 (2: Ada,
#: fp8 with sparsity; 4: Blackwell, fp4 with sparsity) and where the figure was found. A cross-
#: check of the derivation (tests/test_speed.py), not an input of the speed model.
PUBLISHED_AI_TOPS: dict[str, tuple[float, int, str]] = {
    "RTX 4060": (242, 2, "NVIDIA's RTX 4060 launch table, as pangoly.com/en/blog/192 copies it"),
    "RTX 4060 Ti 8GB": (353, 2, "NVIDIA's RTX 4060 Ti launch table (pangoly.com/en/blog/192)"),
    "RTX 4060 Ti 16GB": (353, 2, "NVIDIA's RTX 4060 Ti launch table (pangoly.com/en/blog/192)"),
    "RTX 5070": (988, 4, "NVIDIA's CES 2025 RTX 50 spec table (tweaktown.com/news/102469)"),
    "RTX 5070 Ti": (1406, 4, "NVIDIA's CES 2025 RTX 50 spec table (tweaktown.com/news/102469)"),
    "RTX 5080": (1801, 4, "NVIDIA's CES 2025 RTX 50 spec table (tweaktown.com/news/102469)"),
    "RTX 5090": (3352, 4, "NVIDIA's CES 2025 RTX 50 spec table (tweaktown.com/news/102469)"),
}


def _derived(arch: str, sms: int, boost_ghz: float, page: str) -> str:
    return (f"derived: {sms} SMs x 4 tensor cores x {boost_ghz} GHz boost ({page}) x the per-core "
            f"rate of {arch} (128 bf16 FLOP fp32-accumulate, 512 int8 OP, dense)")


def _speed(gbs: float, bf16_tflops: float, int8_tops: float, gen: int, lanes: int,
           source: str) -> GpuSpeed:
    return GpuSpeed(gbs * 1e9, bf16_tflops * 1e12, int8_tops * 1e12, gen, lanes, source)


def _geforce(sms: int, boost_ghz: float, gbs: float, gen: int, lanes: int, arch: str,
             page: str) -> GpuSpeed:
    """A GeForce card from the per-tensor-core rate of its architecture (see above)."""
    cores = 4 * sms * boost_ghz * 1e9
    return GpuSpeed(gbs * 1e9, cores * 128, cores * 512, gen, lanes,
                    _derived(arch, sms, boost_ghz, page) + f"; {gbs:g} GB/s, PCIe {gen}.0 x{lanes}")


_GF30 = "nvidia.com/en-us/geforce/graphics-cards/30-series/"
_GF40 = "nvidia.com/en-us/geforce/graphics-cards/40-series/"
_GF50 = "nvidia.com/en-us/geforce/graphics-cards/50-series/"
# Cross-checks of SMs, boost clock, bandwidth and link found for the derived cards:
_UNSEEN = "SMs and boost not cross-checked in a found page"
_X3060 = "guru3d.com/story/geforce-rtx-4060-ti-gpu-pictured (NVIDIA's 30/40 table)"
_X40 = "club386.com (NVIDIA's Ada line-up table)"
_X50 = "tomshardware.com/pc-components/gpus/nvidia-rtx-5060-ti-final-specs-and-launch-day-allegedly-leaked"

#: Throughput figures per catalogue card (:class:`~moefit.devices.device.GpuSpeed`): peak
#: spec-sheet figures, dense, no efficiency factor (none was measured on a GPU here). Where one
#: catalogue row stands for several boards (A100 80GB PCIe / SXM, H100 PCIe / SXM) the lower
#: board's figures are taken.
GPU_SPEEDS: dict[str, GpuSpeed] = {
    "RTX 3060 12GB": _geforce(28, 1.777, 360, 4, 16, "Ampere",
                              _GF30 + "rtx-3060-3060ti; " + _X3060),
    "RTX 3060 Ti": _geforce(38, 1.665, 448, 4, 16, "Ampere",
                            _GF30 + "rtx-3060-3060ti; " + _X3060 + ": 4864 cores = 38 SMs"),
    "RTX 3070": _speed(448, 40.6, 162.6, 4, 16, _AMPERE_WP + ", appendix A 'GeForce RTX 3070' "
                       "(p. 46): FP32-accumulate 40.6 / 81.3 sparse, INT8 162.6 / 325.2 sparse"),
    "RTX 3080 10GB": _speed(760, 59.5, 238, 4, 16, _AMPERE_WP + ", the GeForce RTX 3080 spec "
                            "table in the body (table number not confirmed): FP32-accumulate 59.5 / 119 sparse, INT8 238 / 476 sparse"),
    "RTX 3090": _speed(936, 71, 284, 4, 16, _AMPERE_WP + ", appendix A 'GeForce RTX 3090' "
                       "(p. 44): FP32-accumulate 71 / 142 sparse, INT8 284 / 568 sparse"),
    "RTX 4060": _geforce(24, 2.46, 272, 4, 8, "Ada",
                         _GF40 + "rtx-4060-4060ti; 272 GB/s and 242 AI TOPS: NVIDIA's launch "
                         "table (pangoly.com/en/blog/192)"),
    "RTX 4060 Ti 8GB": _geforce(34, 2.535, 288, 4, 8, "Ada", _GF40 + "rtx-4060-4060ti; " + _X3060),
    "RTX 4060 Ti 16GB": _geforce(34, 2.535, 288, 4, 8, "Ada", _GF40 + "rtx-4060-4060ti; " + _X3060),
    "RTX 4070": _geforce(46, 2.475, 504, 4, 16, "Ada", _GF40 + "rtx-4070-family; " + _X40),
    "RTX 4070 Ti Super": _geforce(66, 2.61, 672, 4, 16, "Ada", _GF40 + "rtx-4070-family; " + _UNSEEN),
    "RTX 4080": _speed(716.8, 97.5, 389.9, 4, 16, _ADA_WP + ", GeForce RTX 4080 spec table "
                       "(table number not confirmed): FP32-accumulate 97.5 / 194.9 sparse, INT8 389.9 / 779.8 sparse"),
    "RTX 4080 Super": _geforce(80, 2.55, 736, 4, 16, "Ada", _GF40 + "rtx-4080-family; " + _UNSEEN),
    "RTX 4090": _speed(1008, 165.2, 660.6, 4, 16, _ADA_WP + ", GeForce RTX 4090 spec table "
                       "(table number not confirmed): FP32-accumulate 165.2 / 330.4 sparse, INT8 660.6 / 1321.2 "
                       "sparse"),
    "RTX 5060 Ti 16GB": _geforce(36, 2.572, 448, 5, 8, "Blackwell GeForce",
                                 _GF50 + "rtx-5060-family; " + _X50),
    "RTX 5070": _geforce(48, 2.512, 672, 5, 16, "Blackwell GeForce",
                         _GF50 + "rtx-5070-family; " + _X50),
    "RTX 5070 Ti": _geforce(70, 2.452, 896, 5, 16, "Blackwell GeForce",
                            _GF50 + "rtx-5070-family; " + _X50),
    "RTX 5080": _geforce(84, 2.617, 960, 5, 16, "Blackwell GeForce", _GF50 + "rtx-5080; " + _X50),
    "RTX 5090": _speed(1792, 209.5, 838, 5, 16,
                       "derived from published figures: Tom's Hardware's spec box (Linux Format "
                       "May 2025 reprint, pocketmags.com): 170 SMs, 2407 MHz, 1792 GB/s, 838 "
                       "FP16 TFLOPS (fp16 accumulate, sparse) = 419 dense, so 209.5 with fp32 "
                       "accumulate at GeForce's half rate; INT8 838 = NVIDIA's 3352 AI TOPS "
                       "(fp4, sparse) / 4 (tweaktown.com/news/102469); the row of the "
                       + _BW_WP + " was not seen"),
    "RTX A6000": _speed(768, 154.8, 309.7, 4, 16,
                        _AMPERE_WP + ", appendix C 'RTX A6000 GPU Performance' (p. 50): BF16 "
                        "with FP32 accumulate 154.8 / 309.7 sparse (full rate on a professional "
                        "card: 84 SMs x 1.8 GHz x 1024), INT8 309.7 / 619.4 sparse"),
    "L40S": _speed(864, 362.05, 733, 4, 16,
                   "NVIDIA L40S datasheet (resources.nvidia.com/en-us-l40s/l40s-datasheet-28413; "
                   "its table as mullet.se/product.html?product_id=355414 copies it): BF16 "
                   "362.05 / 733 sparse, FP8 733 / 1466 sparse (INT8 taken at the FP8 rate, as "
                   "Ada's whitepaper lists them equal), 864 GB/s, PCIe Gen4 x16"),
    "A100 40GB": _speed(1555, 312, 624, 4, 16,
                        "NVIDIA A100 Tensor Core GPU datasheet (nvidia.com/content/dam/en-zz/"
                        "Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-"
                        "r4-web.pdf), A100 40GB: BF16 312 / 624 sparse, INT8 624 / 1248 sparse, "
                        "1555 GB/s (as glennklockwood.com/garden/processors/A100 copies it)"),
    "A100 80GB": _speed(1935, 312, 624, 4, 16,
                        "NVIDIA A100 Tensor Core GPU datasheet (see A100 40GB), A100 80GB PCIe: "
                        "1935 GB/s (the SXM board: 2039 GB/s); BF16 312 / 624 sparse, INT8 624 / "
                        "1248 sparse"),
    "H100 80GB": _speed(2000, 756, 1513, 5, 16,
                        "NVIDIA H100 Tensor Core GPU datasheet, H100 PCIe column (as archive-lib."
                        "hpctech.co.jp/gpuproduct/nvidia-h100.html copies it): BF16 1513 and INT8 "
                        "3026 with sparsity, 1/2 without; 2000 GB/s (the SXM board: 3350 GB/s, "
                        "989 TFLOPS dense)"),
    "H200": _speed(4800, 989, 1979, 5, 16,
                   "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM (nvidia.com/en-us/data-center/"
                   "h200): 4.8 TB/s; BF16 1979 and INT8 3958 with sparsity, 1/2 without (the "
                   "H100 SXM's compute: glennklockwood.com/garden/processors/h100)"),
    "RTX PRO 6000 Blackwell": _speed(
        1792, 503.8, 1007.6, 5, 16,
        "derived: 188 SMs x 4 tensor cores x 2.617 GHz x 256 bf16 FLOP (a professional card "
        "runs fp32 accumulation at the full rate) and x 512 int8 OP; checked against NVIDIA's "
        "RTX PRO 6000 Blackwell Workstation Edition datasheet: 4000 AI TOPS = fp4 with "
        "sparsity, so 1000 dense int8 / fp8 and 500 dense bf16; 1792 GB/s (512-bit x 28 Gbps); "
        "188 SMs as NVIDIA's GTC 2025 figures list them (topcpu.net news coverage); "
        "the 2.617 GHz boost is not in the found pages (they say 'about "
        "2.6 GHz')"),
}


#: Without a figure for a card, the driver is assumed to reserve this much at idle
#: (gpus.md §1 sees 303-763 MiB reserved, 303-464 MiB on consumer cards).
GUESS_RESERVED_MIB = 450
#: Cards whose total lies within this fraction of a what-if capacity count as its size class.
SIZE_CLASS = 0.05


def idle_reserved(capacity_bytes: int) -> tuple[int, str]:
    """Bytes a CUDA driver keeps at idle on a card of ``capacity_bytes`` total, and how
    that was found, for a what-if card (``--vram SIZE`` without a device to read).

    The catalogue's measured cards (every row whose free figure is not a guess) whose
    total is within :data:`SIZE_CLASS` (5%) of ``capacity_bytes`` are its size class; the
    most any of them reserves (total - free at idle) is taken, since newer drivers
    reserve more (gpus.md §1). A 16 GiB card: the 16 GB cards reserve 305-463 MiB, so
    463 MiB (the RTX 5060 Ti 16GB: 16311 MiB total, 15848 MiB free). Without a measured
    card of that size: :data:`GUESS_RESERVED_MIB`, the catalogue's rule for unseen cards.
    Never more than 1/16 of the capacity (a small what-if device).

    Returns:
        (reserved bytes, a phrase naming the basis, for the plan's note).
    """
    near = [s for s in GPU_CATALOGUE if s.free_basis != _GUESS
            and abs(s.capacity_mib * MIB - capacity_bytes) <= SIZE_CLASS * capacity_bytes]
    cap = capacity_bytes // 16
    if near:
        worst = max(near, key=lambda s: (s.capacity_mib - s.free_mib, s.name))
        mib = worst.capacity_mib - worst.free_mib
        basis = (f"{mib} MiB the driver keeps, the most of the catalogue's cards of that size "
                 f"({worst.name})")
    else:
        mib = GUESS_RESERVED_MIB
        basis = f"{mib} MiB the driver keeps, the catalogue's rule for cards it has no figure for"
    if mib * MIB > cap:
        return cap, f"{cap // MIB} MiB the driver keeps: 1/16 of the total (a small what-if card)"
    return mib * MIB, basis


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
