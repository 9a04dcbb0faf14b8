"""Device and host memory the runtime owns: the ledger (:mod:`.ledger`), the staging workspace
(:mod:`.workspace`), the KV cache and its codecs (:mod:`.kv_cache`, :mod:`.kv_codec`), the
linear-attention state (:mod:`.linear_state`)."""
