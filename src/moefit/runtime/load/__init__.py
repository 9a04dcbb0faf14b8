"""Checkpoint readers: safetensors (:mod:`.safetensors`), GGUF (:mod:`.gguf`), and the hybrids'
regrouped projections (:mod:`.hybrid_layout`)."""
