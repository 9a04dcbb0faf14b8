"""The speed model of a ``llama-server`` command (``moefit plan --engine llama.cpp``).

:func:`moefit.plan.speed.predict` with llama.cpp's rules: every matrix read as stored, whole
expert tensors copied for large micro-batches, the graph's splits in turn. Imports no torch.
"""

from __future__ import annotations

from moefit.devices import Device
from moefit.devices.host import HostSpeed
from moefit.ingest.geometry import ModelGeometry
from moefit.memory.kv import kv_format
from moefit.plan.speed import LLAMACPP_OFFLOAD_MIN_BATCH, Speed, predict, rates_for
from moefit.records import replace

#: llama.cpp's cache types (K, V) as moefit's KV formats of the same bytes per value
_LLAMA_KV = {("f16", "f16"): "fp16", ("bf16", "bf16"): "bf16", ("f32", "f32"): "fp32",
             ("q8_0", "q8_0"): "int8", ("q8_0", "q4_0"): "k8v4", ("q4_0", "q4_0"): "int4"}


def predict_llamacpp(geom: ModelGeometry, device: Device, host: HostSpeed, *, context: int,
                     ubatch: int, seqs: int, cpu_layers, type_k: str, type_v: str,
                     prompt_tokens: int | None = None,
                     profile: dict[int, dict[int, int]] | None = None) -> Speed | None:
    """The predicted speed of a ``llama-server`` command (``moefit plan --engine llama.cpp``)
    for ``geom`` as the GGUF file it runs: the experts of ``cpu_layers`` stay in host memory,
    every other layer's on the device; prompts are processed in micro-batches of ``ubatch``
    tokens. For a micro-batch of :data:`LLAMACPP_OFFLOAD_MIN_BATCH` tokens or more the
    CPU-resident expert tensors are copied whole to the device and multiplied there, below
    it they are multiplied on the CPU (a decode step of fewer sequences); the graph's
    splits run one after another (``serial``). KV types without a moefit format of the
    same size are priced as f16. None when the device has no figures."""
    rates = rates_for(device, host)
    if rates is None:
        return None
    rates = replace(rates, stored="file")       # llama.cpp reads every matrix as stored
    cpu = set(cpu_layers)
    resident = {l.index: 0 if l.index in cpu else l.moe.num_experts for l in geom.moe_layers}
    fmt = kv_format(_LLAMA_KV.get((type_k, type_v), "fp16"))
    big = lambda n: "copy" if n >= LLAMACPP_OFFLOAD_MIN_BATCH else "cpu"  # noqa: E731
    speed = predict(geom, rates, fmt, resident, context=context, chunk=ubatch, seqs=seqs,
                    policy=big(ubatch), decode_policy=big(seqs), prompt_tokens=prompt_tokens,
                    profile=profile, copy_whole=True, serial=True)
    return replace(speed, policy=f"llama.cpp copies the CPU's expert tensors for micro-batches "
                                 f"of {LLAMACPP_OFFLOAD_MIN_BATCH} tokens or more")
