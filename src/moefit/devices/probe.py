"""Real GPUs through NVML, and the device the command-line flags describe.

:func:`probe_cuda` reads a card's name, total and free memory through NVML (the optional
``nvidia-ml-py`` package, module ``pynvml``, imported only when a real GPU is probed; no
CUDA context is created). :func:`resolve_device` turns ``--device``, ``--gpu``,
``--vram`` and ``--vram-free`` into a :class:`~moefit.devices.device.Device`: a probed
card, a catalogue card (:mod:`moefit.devices.catalogue`) or a what-if / simulated one.
Imports no torch.
"""

from __future__ import annotations

import os
import re

from moefit.devices.catalogue import find_gpu, idle_reserved
from moefit.devices.device import Device, DeviceKind
from moefit.errors import InputError
from moefit.records import replace
from moefit.units import MIB, format_gib, parse_size, size_format

_NO_GPU_FIX = (
    "plan for a card you do not have with --gpu NAME (see `moefit gpus`) or --vram SIZE, "
    "or simulate one on the CPU with --device cpu --vram SIZE"
)


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
    ``nvmlDeviceGetName``; the card's throughput figures come from the catalogue when it
    knows the name (:func:`_probed_speed`), with the PCIe link NVML reads. NVML's ``total`` is the ``nvidia-smi`` total and its ``free``
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
        link = _pcie_link(pynvml, handle, nvml_error)
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
        speed=_probed_speed(name, link),
    )


def _pcie_link(pynvml, handle, nvml_error) -> tuple[int, int] | None:
    """(generation, lanes) of the card's PCIe link: ``nvmlDeviceGetMaxPcieLinkGeneration`` /
    ``...Width``, the most the card and the system's slot allow (the current link drops to
    a lower generation at idle to save power, so it is not read); None when NVML cannot
    say (an SXM board, an old driver)."""
    try:
        return (int(pynvml.nvmlDeviceGetMaxPcieLinkGeneration(handle)),
                int(pynvml.nvmlDeviceGetMaxPcieLinkWidth(handle)))
    except (nvml_error, AttributeError):
        return None


def _probed_speed(name: str, link: tuple[int, int] | None):
    """A probed card's throughput figures: the catalogue card of that name (its spec sheet)
    with the PCIe link NVML read; None when the catalogue does not know the card."""
    try:
        spec = find_gpu(name).speed
    except InputError:
        return None
    if spec is None or link is None or link[0] <= 0 or link[1] <= 0:
        return spec
    return replace(spec, pcie_gen=link[0], pcie_lanes=link[1],
                   source=spec.source + f"; PCIe {link[0]}.0 x{link[1]} read from NVML")


# --- command-line resolution ----------------------------------------------------------

def _parse_device_flag(device: str) -> tuple[DeviceKind, int]:
    """``cpu``, ``cpu:N`` (a simulated device, as tables name them), ``cuda`` or
    ``cuda:N`` -> (kind, N). Raises InputError for anything else."""
    text = device.strip().lower()
    if text == "cpu":
        return "cpu", 0
    if text == "cuda":
        return "cuda", 0
    for kind in ("cuda", "cpu"):
        if text.startswith(f"{kind}:") and text[len(kind) + 1:].isdigit():
            return kind, int(text[len(kind) + 1:])
    raise InputError(f"--device: {device!r} is not a device; use cuda, cuda:N (N = 0, 1, ...) "
                     f"or cpu (a simulated device, with --vram SIZE; several: cpu:0,cpu:1)")


def what_if_card(label: str, vram: str, capacity: int, vram_free: str | None,
                 free_bytes: int | None, source: str) -> Device:
    """A what-if CUDA card of ``capacity`` bytes total (``--vram SIZE`` with no card to
    read). Its free memory is ``--vram-free`` when given; else what a real card of that
    size has free at idle: the capacity less the driver's reserved memory
    (:func:`moefit.devices.catalogue.idle_reserved`), and the plan says so in a note.
    Sizes are printed in the unit of the card's tables (:func:`moefit.units.size_format`)."""
    fmt = size_format(capacity)
    if free_bytes is not None:
        return Device(label, f"what-if {fmt(capacity)} CUDA card", "cuda", capacity,
                      free_bytes, simulated=True, source=f"{source} --vram-free")
    reserved, basis = idle_reserved(capacity)
    note = (f"{label}: --vram {vram.strip()} is the card's total; free at idle assumed "
            f"{fmt(capacity - reserved)} = total - {basis}; --vram-free SIZE sets it")
    return Device(label, f"what-if {fmt(capacity)} CUDA card", "cuda", capacity,
                  capacity - reserved, simulated=True,
                  source=f"{source} (free = total - {reserved // MIB} MiB reserved at idle)",
                  note=note)


def resolve_device(device: str | None, gpu: str | None, vram: str | None,
                   vram_free: str | None, label: str | None = None) -> Device:
    """The :class:`Device` the flags ``--device``, ``--gpu``, ``--vram``, ``--vram-free`` describe.

    1. ``--device cuda[:N]``: the real GPU via NVML; ``--vram`` lowers its capacity and
       ``--vram-free`` its free memory (a what-if on a real card; neither may exceed what
       the card has).
    2. ``--device cpu --vram SIZE``: a simulated device on the CPU with that capacity;
       free = ``--vram-free`` or ``--vram``; runtime 0.
    3. ``--gpu NAME``: a what-if catalogue card (:func:`find_gpu`); ``--vram-free`` replaces
       its free memory.
    4. ``--vram SIZE`` alone: a what-if CUDA card of that total; free = ``--vram-free``, or
       the total less what the driver reserves at idle on cards of that size
       (:func:`what_if_card`).
    5. none of these: the real ``cuda:0`` via NVML (``--vram-free`` lowers its free memory).

    ``label``: the device's name in the errors when it is one of several (``cpu:1``).

    Raises:
        InputError: a bad size or device string; ``--device cpu`` without ``--vram``;
            ``--gpu`` with ``--device`` or ``--vram``; ``--vram-free`` above the capacity;
            a cap above what a real card has; and every error of :func:`probe_cuda` and
            :func:`find_gpu`.
    """
    # a bare number below 1 MiB is nvidia-smi's MiB habit, not a device of a few KiB
    vram_bytes = parse_size(vram, "--vram", min_bare=MIB) if vram is not None else None
    free_bytes = parse_size(vram_free, "--vram-free", min_bare=MIB) if vram_free is not None else None
    kind, index = _parse_device_flag(device) if device is not None else (None, 0)

    on = f" ({label})" if label else ""

    def check_free(capacity: int, what: str) -> None:
        if free_bytes is not None and free_bytes > capacity:
            raise InputError(f"--vram-free {vram_free}{on} is more than {what} "
                             f"({size_format(capacity)(capacity)}); lower --vram-free")

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
                      simulated=True, source=card.source + f"; free set by --vram-free {vram_free}",
                      speed=card.speed)

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
        return what_if_card("cuda:0", vram, vram_bytes, vram_free, free_bytes, "--vram")

    try:
        real = probe_cuda(index)
    except InputError:
        if vram_bytes is None:
            raise
        # no GPU here: --device cuda:N --vram SIZE is a what-if card with that index
        check_free(vram_bytes, "--vram")
        return what_if_card(f"cuda:{index}", vram, vram_bytes, vram_free, free_bytes,
                            "--device --vram (no GPU readable here)")
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
                  source=real.source + "; capped by --vram/--vram-free", speed=real.speed)


# --- several devices ---------------------------------------------------------------------

MAX_DEVICES = 16


def _list(text: str | None, flag: str) -> list[str] | None:
    """A comma-separated flag value as its entries (None stays None)."""
    if text is None:
        return None
    items = [t.strip() for t in text.split(",")]
    if not all(items):
        raise InputError(f"{flag} {text!r}: an empty entry; separate the values with commas, "
                         "e.g. 16GiB,12GiB")
    return items


#: a card's name and a count after it, spaced or glued on (``RTX 4090 x2``, ``RTX 4090x2``); no
#: catalogue name ends in a count (tested)
_COUNTED = re.compile(r"^(.*?\S)\s*[x×](-?\d+)$", re.IGNORECASE)


def expand_gpus(names: list[str]) -> list[str]:
    """``--gpu`` values, each a catalogue name optionally followed by ``xN`` (N cards of
    that kind: ``"RTX 5060 Ti 16GB x4"``, or ``"RTX 4090x2"``), as one name per card.

    Raises InputError for a count below 1 or more than :data:`MAX_DEVICES` cards."""
    out: list[str] = []
    for name in names:
        counted = _COUNTED.match(name.strip())
        if counted:
            n = int(counted[2])
            if not 1 <= n <= MAX_DEVICES:
                raise InputError(f"--gpu {name!r}: {n} cards; give 1 to {MAX_DEVICES}")
            out += [counted[1]] * n
        else:
            out.append(name.strip())
    return out


def resolve_devices(device: str | None, gpus: list[str] | str | None, vram: str | None,
                    vram_free: str | None) -> tuple[Device, ...]:
    """The devices the flags describe, main device first (the commit order).

    Several devices come from comma-separated lists or repeated cards:
    ``--device cuda:0,cuda:1`` (each probed; ``--vram`` / ``--vram-free`` lists cap them one
    by one, a single value caps all), ``--gpu NAME`` repeated or ``--gpu "NAME x4"``
    (catalogue cards ``cuda:0`` .. ``cuda:N-1``), ``--device cpu --vram 16GiB,12GiB``
    (simulated devices ``cpu:0``, ``cpu:1``), ``--vram 16GiB,16GiB`` alone (what-if cards).
    One device is exactly :func:`resolve_device`.

    Raises:
        InputError: lists of different lengths, a device named twice, a mix of simulated
            and CUDA devices, more than :data:`MAX_DEVICES`, and every error of
            :func:`resolve_device`.
    """
    names = expand_gpus([gpus] if isinstance(gpus, str) else list(gpus or []))
    devs = _list(device, "--device")
    vrams = _list(vram, "--vram")
    frees = _list(vram_free, "--vram-free")
    n = max(len(names), len(devs or []), len(vrams or []), len(frees or []), 1)
    if n > MAX_DEVICES:
        raise InputError(f"{n} devices: moefit plans at most {MAX_DEVICES}")
    for i, entry in enumerate(devs or []):
        kind, index = _parse_device_flag(entry)
        if kind == "cpu" and ":" in entry and index != i:
            want = ",".join(f"cpu:{k}" for k in range(max(len(devs), n)))
            raise InputError(f"--device {device}: simulated devices are numbered in order, "
                             f"from cpu:0; use --device {want} (or --device cpu with one "
                             "--vram value per device)")
    given = [(flag, len(items)) for flag, items in (("--device", devs), ("--gpu", names or None),
                                                    ("--vram", vrams), ("--vram-free", frees))
             if items is not None and len(items) > 1]
    if len({k for _, k in given}) > 1:
        listed = " and ".join(f"{flag} lists {k}" for flag, k in given)
        raise InputError(f"{listed} devices; give one value for all devices or one per device")
    if n == 1:
        return (resolve_device(device, names[0] if names else None, vram, vram_free),)
    pick = lambda items, i: None if items is None else items[i if len(items) > 1 else 0]  # noqa: E731
    if names and devs is not None:
        raise InputError(f"--gpu {names[0]} plans for catalogue cards and --device {device} "
                         f"for real or simulated ones; drop one of them")
    if devs is not None and len(devs) == 1 and n > 1:
        if _parse_device_flag(devs[0])[0] != "cpu":
            listed = next(f"{flag} lists {k} values" for flag, k in
                          (("--gpu", len(names)), ("--vram", len(vrams or [])),
                           ("--vram-free", len(frees or []))) if k > 1)
            raise InputError(f"--device {device} names one device and {listed}; name one "
                             f"device per value (--device "
                             f"{','.join(f'cuda:{k}' for k in range(n))}) or give one value")
        devs = devs * n                  # --device cpu --vram 16GiB,12GiB
    kinds = {_parse_device_flag(d)[0] for d in devs} if devs else set()
    if len(kinds) > 1:
        raise InputError(f"--device {device}: mixes simulated (cpu) and CUDA devices; plan "
                         "either real / what-if CUDA devices or simulated ones")
    out = []
    for i in range(n):
        kind, index = _parse_device_flag(pick(devs, i)) if devs else ("cuda", i)
        d = resolve_device(pick(devs, i), names[i] if len(names) > 1 else (names[0] if names else None),
                           pick(vrams, i), pick(frees, i),
                           label=f"cpu:{i}" if kind == "cpu" else f"cuda:{index}")
        if d.kind == "cpu" or names or devs is None:
            label = f"cpu:{i}" if d.kind == "cpu" else f"cuda:{i}"
            note = d.note.replace(f"{d.label}:", f"{label}:", 1) if d.note else ""
            d = replace(d, label=label, note=note)
        out.append(d)
    labels = [d.label for d in out]
    twice = sorted({l for l in labels if labels.count(l) > 1})
    if twice:
        raise InputError(f"--device {device}: {', '.join(twice)} named twice; give each "
                         "device once")
    return tuple(out)
