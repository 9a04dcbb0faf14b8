"""Model ingestion: from a MODEL argument (preset, directory, config.json, GGUF) to a geometry.

- ``geometry``: ModelGeometry, the per-layer attention / MoE specs and the weight tensor listing;
- ``families``: config.json -> ModelGeometry, one module per model family (its config keys,
  GGUF mapping, tensor names and forward-pass switches), a shared module and a registry;
- ``checkpoint``: safetensors headers -> exact weight and expert-blob bytes;
- ``gguf_reader``: GGUF headers read (metadata, tensor infos, every shard);
- ``gguf_header``: GGUF headers -> the same geometry, exact bytes per ggml type;
- ``resolve``: presets and paths -> ModelGeometry, and the ``moefit models`` table.

Nothing here imports torch.
"""
