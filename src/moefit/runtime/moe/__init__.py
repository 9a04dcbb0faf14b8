"""The routed experts: the MoE layer of the forward pass (:mod:`.layer`), the expert cache
(:mod:`.cache`), the CPU batched layer (:mod:`.batch`), the device path (:mod:`.device`),
gpt-oss's experts (:mod:`.gpt_oss`), routing (:mod:`.routing`)."""
