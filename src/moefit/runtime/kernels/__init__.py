"""The native kernels: the C library (built at first use, loaded through ctypes), its bindings
(:mod:`.qmatmul`), the stored (quantized) formats it and torch read (:mod:`.quant`), and the
Triton kernels of those formats on a CUDA device (:mod:`.triton`)."""
