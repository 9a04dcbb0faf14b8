"""The runtime: commit a solved plan to a device and run the model inside it (torch).

One owner per resource (docs/design.md, ownership):

- :mod:`moefit.runtime.ledger`: every device byte, by budget line (``Ledger``).
- :mod:`moefit.runtime.loader`: checkpoint -> resident weights + packed host expert blobs.
- :mod:`moefit.runtime.kv_cache`: KV cells in the byte layouts of docs/design.md, KV formats (``KVCache``).
- :mod:`moefit.runtime.staging`: the prefill staging workspace, allocated once.
- :mod:`moefit.runtime.experts`: expert-cache slots, hits and misses (``ExpertCache``).
- :mod:`moefit.runtime.attention`, :mod:`~moefit.runtime.rope`,
  :mod:`~moefit.runtime.model`: the forward pass.
- :mod:`moefit.runtime.engine`: commit order, prefill, decode, generate (``Engine``).

The planning path (``moefit plan``) never imports this package.
"""
