"""Memory models of inference engines other than moefit's own runtime.

``moefit plan MODEL --engine llama.cpp`` prices what llama.cpp allocates
(:mod:`moefit.external.llamacpp`) under the same rules as moefit's own plans: mandatory
lines first, then the elastic part, a clamp of the batch on a grid when the mandatory
lines do not fit. No torch, no engine imported.
"""
