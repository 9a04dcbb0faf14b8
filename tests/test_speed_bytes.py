"""What the speed model reads per decoded token of a GGUF file, against the file's own tensor
sizes (gguf's reader of a header-only stand-in of llama-quantize's mix): the dense matrices
and the output matrix in their stored types where the engine keeps them stored (llama.cpp:
every matrix; moefit's C kernels on a CPU device: every quantized one), the experts a token
picks at their stored size."""

from __future__ import annotations

import pytest

gguf = pytest.importorskip("gguf")

from moefit.ingest.resolve import load_model  # noqa: E402
from moefit.memory.weights import stored_bytes, stored_change  # noqa: E402
from moefit.plan import speed  # noqa: E402
from moefit.tools.stand_in import write_stand_in  # noqa: E402


def _file_bytes(path) -> tuple[int, int, int]:
    """(dense bytes without the token embedding, output matrix, expert tensors) of the file."""
    dense = out = experts = 0
    for t in gguf.GGUFReader(str(path)).tensors:
        n = int(t.n_bytes)
        if "_exps" in t.name:
            experts += n
        elif t.name == "output.weight":
            out = n
        elif t.name != "token_embd.weight":
            dense += n
    return dense, out, experts


@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q8_0", "Q6_K"])
@pytest.mark.parametrize("stored", ["file", "cpu"])
def test_a_decoded_token_reads_the_files_bytes(tmp_path, ftype, stored):
    path = write_stand_in("Qwen3-30B-A3B", ftype, tmp_path / f"q-{ftype}.gguf")
    geom = load_model(str(path))
    dense, out, experts = _file_bytes(path)
    layers = speed._layers(geom, stored)
    model_dense = sum(l.dense_bytes for l in layers)
    head = [t for t in geom.global_tensors if t.role == "lm_head"]
    model_head = sum(geom.tensor_bytes(t) for t in head) + \
        stored_change(geom, stored_bytes(geom, stored), "output.weight")
    model_experts = sum(l.blob_bytes * l.spec.moe.num_experts for l in layers if l.spec.moe)
    assert model_head == out
    assert model_experts == pytest.approx(experts, rel=0.001)
    # the norms: F32 in the file, priced in the compute dtype (a few hundred KB)
    assert model_dense == pytest.approx(dense, rel=0.01 if stored == "file" else 0.05)
    if stored == "cpu":       # a kept matrix is one the C kernels read: quantized
        assert all(not name.startswith("token_embd") for name in stored_bytes(geom, "cpu"))
