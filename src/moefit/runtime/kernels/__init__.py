"""The native kernels: the C library (a variant built into the wheel, else built at first use;
loaded and ABI-checked by :mod:`.native`), its bindings (:mod:`.qmatmul`), the stored
(quantized) formats it and torch read (:mod:`.quant`), the one linear product over them
(:mod:`.linear`), and the Triton kernels of those formats on a CUDA device (:mod:`.triton`)."""
