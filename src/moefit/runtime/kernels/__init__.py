"""Kernels of the runtime: the GPU kernels of stored (GGUF) formats in :mod:`.triton`."""
