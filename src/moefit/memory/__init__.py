"""Memory models: bytes of each budget line as pure functions of geometry and request.

- :mod:`moefit.memory.kv`: the ``kv`` line (KV cells, latent cells, recurrent state).
- :mod:`moefit.memory.staging`: the ``prefill`` line (affine in the chunk).
- :mod:`moefit.memory.weights`: the ``weights`` and ``weight_arena`` lines, expert blobs.
- :mod:`moefit.memory.runtime`: the ``runtime`` line and the default safety margin.

No torch here: the runtime imports these same functions to size what it allocates.
"""
