"""The device and host flags read: the devices to plan for (:func:`devices_from_args`; one:
:func:`device_from_args`), the devices that can run the model (:func:`runnable_devices`,
:func:`runnable_device`), the host (:func:`host_from_args`, ``--host-ram`` or
``$MOEFIT_HOST_RAM``) and ``--threads`` (:func:`apply_threads`); and the commands' warning
line (:func:`warn`).

Imports no torch, except :func:`runnable_devices` (to check that a CUDA device is usable)
and :func:`apply_threads` (to set torch's threads).
"""

from __future__ import annotations

import argparse
import os
import sys

from moefit.devices import Device, Host, resolve_devices, resolve_host
from moefit.errors import InputError


#: The default of ``--host-ram`` when set (a machine's memory to plan with, where this one
#: is shared and its free memory changes from one run to the next).
HOST_RAM_ENV = "MOEFIT_HOST_RAM"


def warn(message: str) -> None:
    """Print ``moefit: warning: MESSAGE`` on stderr."""
    print(f"moefit: warning: {message}", file=sys.stderr)


def devices_from_args(args: argparse.Namespace) -> tuple[Device, ...]:
    """The devices the flags describe, real or what-if, main device first
    (:func:`moefit.devices.resolve_devices`). Raises InputError."""
    return resolve_devices(args.device, args.gpu, args.vram, args.vram_free)


def device_from_args(args: argparse.Namespace) -> Device:
    """The one device of the commands that plan a single device (``--engine llama.cpp``,
    ``bench``, ``calibrate``; ``--engine vllm|sglang``: the card of each rank). Raises
    InputError for several."""
    devices = devices_from_args(args)
    if len(devices) > 1:
        engine = getattr(args, "engine", None)
        if engine in ("vllm", "sglang"):
            raise InputError(f"--engine {engine} plans --gpus N cards of one kind: give one "
                             f"--gpu NAME (or --vram SIZE) and --gpus {len(devices)}")
        command = getattr(args, "command", None) or "this command"
        what = "--engine llama.cpp" if engine == "llama.cpp" else command
        raise InputError(f"{what} plans one device; {len(devices)} were given "
                         f"({', '.join(d.label for d in devices)}): name one")
    return devices[0]


def host_from_args(args: argparse.Namespace, devices: tuple[Device, ...]) -> Host | None:
    """The host of the plan (:func:`moefit.devices.resolve_host`): ``--host-ram`` (or
    ``$MOEFIT_HOST_RAM``), else this machine when any device is on it (a probed GPU, a
    simulated device), else None (what-if cards: the host table is priced, not checked).
    Raises InputError."""
    here = any(d.kind == "cpu" or not d.simulated for d in devices)
    flag = getattr(args, "host_ram", None)
    if flag:
        return resolve_host(flag, here)
    return resolve_host(os.environ.get(HOST_RAM_ENV) or None, here, HOST_RAM_ENV)


def runnable_device(args: argparse.Namespace) -> Device:
    """The one device of ``bench`` and ``calibrate`` (:func:`runnable_devices`). Raises
    InputError for several."""
    devices = runnable_devices(args)
    if len(devices) > 1:
        raise InputError(f"{getattr(args, 'command', None) or 'this command'} runs on one "
                         f"device; {len(devices)} were given: name one")
    return devices[0]


def runnable_devices(args: argparse.Namespace) -> tuple[Device, ...]:
    """The devices of ``--device`` for the commands that run the model; a what-if card
    (``--gpu``, ``--vram`` alone) cannot run one. Applies ``--threads``
    (:func:`apply_threads`).

    Raises:
        InputError: ``--gpu`` or ``--vram`` without ``--device``; a CUDA device that this
            torch build cannot see; every error of
            :func:`devices_from_args`.
    """
    if args.device is None and (args.gpu is not None or args.vram is not None):
        command = getattr(args, "command", None) or "this command"
        raise InputError(f"{command} runs the model on a real device: use --device "
                         "cuda[:N] (optionally with --vram to cap it) or --device cpu --vram SIZE "
                         "(a simulated device); --gpu and --vram alone only plan (moefit plan)")
    apply_threads(args)
    devices = devices_from_args(args)
    if devices[0].kind == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise InputError(f"--device {args.device}: this torch build sees no CUDA device; "
                             "install a CUDA build of torch, or simulate the card with "
                             "--device cpu --vram SIZE")
        if torch.cuda.device_count() < len(devices):
            raise InputError(f"--device {args.device}: this torch build sees "
                             f"{torch.cuda.device_count()} CUDA device(s)")
    return devices


def apply_threads(args: argparse.Namespace) -> None:
    """Set the runtime's CPU threads from ``--threads`` (torch's intra-op threads, which
    moefit's C kernels use too); nothing without the flag. Raises InputError below 1; warns
    past the CPUs this process may run on (the threads then share them: 99 threads on 2
    CPUs decoded at 34 tokens/s where one thread gave 1500)."""
    threads = getattr(args, "threads", None)
    if threads is None:
        return
    if threads < 1:
        raise InputError(f"--threads {threads}: must be at least 1")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if cpus and threads > cpus:
        warn(f"--threads {threads} is more than the {cpus} CPUs this process may use; the "
             f"threads will share them and run slower (at most --threads {cpus})")
    import torch

    torch.set_num_threads(threads)
