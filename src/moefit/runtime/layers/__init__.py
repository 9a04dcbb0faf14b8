"""The token mixers and their parts: attention (:mod:`.attention`), Gated DeltaNet
(:mod:`.deltanet`), RoPE (:mod:`.rope`), and the lean decode step in C (:mod:`.lean_step`)."""
