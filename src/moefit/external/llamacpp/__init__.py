"""llama.cpp's memory model and the plans of ``moefit plan --engine llama.cpp``.

The package, one module a job:

- :mod:`~moefit.external.llamacpp.buffers`: what ``llama-server`` allocates for a GGUF model,
  line by line (model buffers, KV cache, recurrent state, compute buffer), with the sources
  in llama.cpp of every formula and what they were validated against;
- :mod:`~moefit.external.llamacpp.command`: the request, the solved plan and its
  ``llama-server`` command line;
- :mod:`~moefit.external.llamacpp.host`: what the process keeps in host memory;
- :mod:`~moefit.external.llamacpp.solver`: ``--n-cpu-moe`` / ``-ot``, the clamped ``-ub``, the
  alternatives of a failing plan, the largest ``-c``;
- :mod:`~moefit.external.llamacpp.split`: several GPUs, ``-sm layer -ts``, one table each;
- :mod:`~moefit.external.llamacpp.report`: the plan as text and as JSON.

The names callers use are re-exported here (``from moefit.external import llamacpp``), each
module imported when one of its names is first read (:func:`__getattr__`): a moefit plan
that fails prices llama.cpp's alternative with the buffers and the solver alone, not the
several-GPU split, the report, nor the GGUF header reader (issue 24: a failing preset's
process under 0.1 s).
"""

#: the module of each re-exported name
_HOMES = {
    "buffers": ("CPU", "CTX_PAD", "CTX_PAD_NO_FA", "CUDA", "DEFAULT_BATCH", "DEFAULT_KV", "DEFAULT_UBATCH",
                "KV_TYPE_SIZES", "MAX_CTX", "MAX_SEQ", "UB_GRID", "Backend", "ComputePrice", "KVPrice",
                "ModelBuffers", "PricedModel", "Tensor", "compute_price", "cpu_model_buffer", "expert_layer",
                "ggml_row_bytes", "kv_price", "kv_types", "model_buffers", "pad_cells", "tensors_from_geometry",
                "tensors_from_header"),
    "command": ("LINES", "LOAD_MODES", "LlamaPlan", "LlamaRequest", "effective_ubatch", "llama_ctx", "load_mode"),
    "host": ("HOST_LINES", "host_bytes", "host_table"),
    "report": ("SCHEMA", "format_plan", "format_split_plan", "format_split_verbose", "format_verbose",
               "plan_document", "short_lines", "split_document"),
    "solver": ("largest_llama_context", "mandatory_bytes", "plan_max_context", "solve_llamacpp"),
    "split": ("PIPELINE_COPIES", "LlamaSplitPlan", "largest_split_context", "layer_devices", "solve_split",
              "split_model"),
}
_HOME = {name: module for module, names in _HOMES.items() for name in names}

__all__ = [name for names in _HOMES.values() for name in names]


def __getattr__(name: str):
    """A re-exported name, its module imported on first use (PEP 562)."""
    home = _HOME.get(name)
    if home == "buffers":
        from moefit.external.llamacpp import buffers as module
    elif home == "command":
        from moefit.external.llamacpp import command as module
    elif home == "host":
        from moefit.external.llamacpp import host as module
    elif home == "report":
        from moefit.external.llamacpp import report as module
    elif home == "solver":
        from moefit.external.llamacpp import solver as module
    elif home == "split":
        from moefit.external.llamacpp import split as module
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(module, name)
    globals()[name] = value
    return value
