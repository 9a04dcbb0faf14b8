"""The native kernels: the C library (built at first use, loaded through ctypes), its bindings
(:mod:`.qmatmul`), and the stored (quantized) formats it and torch read (:mod:`.quant`)."""
