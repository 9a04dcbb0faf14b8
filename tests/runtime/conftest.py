"""Tiny random checkpoints of every family the runtime runs, made with transformers.

Each checkpoint is built by the reference implementation (``XxxForCausalLM(XxxConfig(...))``
in fp32, seeded) and written with ``save_pretrained`` (one tensor per expert, as
transformers 5.x writes them), or, for the ``fused`` layout, with the in-memory state dict
(``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``) written by
``safetensors``. The reference model object is kept to compare logits against.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moefit.devices import Device  # noqa: E402
from moefit.ingest.resolve import load_model  # noqa: E402
from moefit.plan.request import Request  # noqa: E402
from moefit.plan.solver import solve  # noqa: E402

MIB = 1 << 20

# tiny models: threads only add overhead on the 2-core CI machine
torch.set_num_threads(1)
# without a GPU, Triton's kernels run in its interpreter (tests/runtime/test_triton_kernels.py,
# test_moe_device.py): it reads this at its first import, which any test may trigger
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

COMMON = dict(vocab_size=96, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)


def _config(family: str, **over):
    t = transformers
    if family == "qwen3_moe":
        kw = dict(COMMON, num_hidden_layers=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=32, intermediate_size=64, norm_topk_prob=True)
        return t.Qwen3MoeConfig(**{**kw, **over})
    if family == "qwen2_moe":
        # layer 1 dense (mlp_only_layers) to run the dense MLP path too
        kw = dict(COMMON, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=32, shared_expert_intermediate_size=48,
                  intermediate_size=80, mlp_only_layers=[1], norm_topk_prob=False)
        return t.Qwen2MoeConfig(**{**kw, **over})
    if family == "mixtral":
        kw = dict(COMMON, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2,
                  intermediate_size=32)
        return t.MixtralConfig(**{**kw, **over})
    if family == "olmoe":
        kw = dict(COMMON, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
                  intermediate_size=32, norm_topk_prob=False, clip_qkv=4.0)
        return t.OlmoeConfig(**{**kw, **over})
    raise ValueError(family)


_MODELS = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
           "mixtral": "MixtralForCausalLM", "olmoe": "OlmoeForCausalLM"}


@dataclass
class Tiny:
    """A tiny checkpoint on disk and the transformers model it was saved from."""

    family: str
    path: Path
    ref: torch.nn.Module

    @property
    def geom(self):
        return load_model(str(self.path))


def make_tiny(family: str, path: Path, layout: str = "per_expert", seed: int = 0, **over) -> Tiny:
    """Build, save and return a tiny ``family`` model (fp32) at ``path``."""
    torch.manual_seed(seed)
    cfg = _config(family, **over)
    model = getattr(transformers, _MODELS[family])(cfg).float().eval()
    model.save_pretrained(path)
    if layout == "fused":
        from safetensors.torch import save_file

        (path / "model.safetensors").unlink()
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(path / "model.safetensors"))
    return Tiny(family, path, model)


def sim_device(free: int = 64 * MIB) -> Device:
    """A simulated device on the CPU with ``free`` bytes."""
    return Device(label="cpu", description=f"simulated {free} B device on the CPU", kind="cpu",
                  capacity_bytes=free, free_bytes=free, simulated=True)


def half_tiny(tiny: Tiny, path: Path, dtype: torch.dtype) -> Tiny:
    """``tiny`` saved in ``dtype`` (bf16 / fp16; its config says so, and the runtime computes
    in it), with the fp32 reference on the weights the file holds (``tiny.ref`` rounded to
    ``dtype``, run in fp32). Copies are cast: casting the session's reference model and back
    would round its fp32 weights for every later test that writes files from it."""
    copy.deepcopy(tiny.ref).to(dtype).save_pretrained(path)
    return Tiny(tiny.family, path, copy.deepcopy(tiny.ref).to(dtype).float())


def plan_for(tiny: Tiny, free: int = 64 * MIB, **req):
    """Solve a plan for ``tiny`` on a simulated device (fp32 KV and a 256-token chunk by
    default, 1 MiB margin)."""
    kw = dict(kv="fp32", prefill_mode="fixed", prefill_tokens=256, reserve_bytes=MIB)
    kw.update(req)
    plan = solve(tiny.geom, sim_device(free), Request(**kw))
    assert plan.fits, plan
    return plan


@pytest.fixture(scope="module", autouse=True)
def declared_host():
    """A declared host for every plan and `moefit` process of these tests (module scope:
    before the modules' servers start; restored after, so the planner tests keep their
    own): the CI machine is shared and its free memory, the default host, changes from
    run to run (tests/test_host_budget.py checks this machine's own figures)."""
    before = os.environ.get("MOEFIT_HOST_RAM")
    os.environ["MOEFIT_HOST_RAM"] = before or "64GiB"
    yield
    if before is None:
        del os.environ["MOEFIT_HOST_RAM"]
    else:
        os.environ["MOEFIT_HOST_RAM"] = before


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[tuple[str, str], Tiny]:
    """One tiny checkpoint per (family, layout)."""
    out = {}
    for fam in _MODELS:
        for layout in ("per_expert", "fused"):
            d = tmp_path_factory.mktemp(f"{fam}_{layout}")
            out[(fam, layout)] = make_tiny(fam, d, layout)
    return out
