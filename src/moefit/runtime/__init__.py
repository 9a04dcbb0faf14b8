"""The runtime: commit a solved plan to a device and run the model inside it (torch).

One owner per resource (docs/design.md, ownership):

- :mod:`moefit.runtime.buffers.ledger`: every device byte, by budget line (``Ledger``).
- :mod:`moefit.runtime.load.safetensors`: checkpoint -> resident weights + packed host expert blobs.
- :mod:`moefit.runtime.buffers.kv_cache`: KV cells in the byte layouts of docs/design.md, KV formats (``KVCache``).
- :mod:`moefit.runtime.buffers.workspace`: the prefill staging workspace, allocated once.
- :mod:`moefit.runtime.moe.cache`: expert-cache slots, hits and misses (``ExpertCache``).
- :mod:`moefit.runtime.layers.attention`, :mod:`~moefit.runtime.layers.rope`,
  :mod:`~moefit.runtime.model`: the forward pass.
- :mod:`moefit.runtime.engine`: commit order, prefill, decode, generate (``Engine``).

The planning path (``moefit plan``) never imports this package.
"""
