"""Random weights under a config's checkpoint names, for tests that write files of them.

One home for the tests that need such a state dict (GGUF planning, the GGUF writer, the
random GGUF files of the runtime tests): standard normals x ``scale`` (numpy, ``seed``),
drawn in the order of the config path's tensor listing, one tensor per expert.
"""

from __future__ import annotations

import numpy as np

from moefit.ingest.families import geometry_from_config


def random_state(cfg: dict, seed: int = 0, scale: float = 0.1) -> dict[str, np.ndarray]:
    """Random fp32 weights ``name -> array`` for every tensor of ``cfg``'s geometry (global
    tensors, then per layer its tensors and each expert's), standard normals x ``scale``."""
    rng = np.random.default_rng(seed)
    geom = geometry_from_config(cfg, "tiny")
    state = {t.name: rng.standard_normal(t.shape, dtype=np.float32) * scale for t in geom.global_tensors}
    for l in geom.layers:
        state.update({t.name: rng.standard_normal(t.shape, dtype=np.float32) * scale for t in l.tensors})
        for j in range(l.moe.num_experts if l.moe else 0):
            for t in l.expert_tensors:
                state[t.name.replace(".experts.0.", f".experts.{j}.")] = \
                    rng.standard_normal(t.shape, dtype=np.float32) * scale
    return state
