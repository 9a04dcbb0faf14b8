"""The runtime: commit a solved plan to a device and run the model inside it (torch).

One owner per resource (docs/design.md, ownership):

- :mod:`moefit.runtime.buffers.ledger`: every device byte, by budget line (``Ledger``).
- :mod:`moefit.runtime.load` (safetensors, GGUF): checkpoint -> resident weights + packed host
  expert blobs (the containers: :mod:`moefit.runtime.weights`).
- :mod:`moefit.runtime.buffers.kv_cache`: KV cells in the byte layouts of docs/design.md, KV formats (``KVCache``).
- :mod:`moefit.runtime.buffers.workspace`: the prefill staging workspace, allocated once.
- :mod:`moefit.runtime.moe.cache`: expert-cache slots, hits and misses (``ExpertCache``).
- :mod:`moefit.runtime.layers.attention`, :mod:`~moefit.runtime.layers.rope`,
  :mod:`~moefit.runtime.model`: the forward pass.
- :mod:`moefit.runtime.engine`: commit order, prefill, decode, generate (``Engine``).

Rooms, lowest first (a room imports only lower ones; tests/test_imports.py): ``kernels``
(with ``arch``), ``buffers`` (with ``weights``), ``moe``, ``layers`` and ``load``, then the
top modules (model, engine, sampling, measure, calibrate).

The planning path (``moefit plan``) never imports this package.
"""
