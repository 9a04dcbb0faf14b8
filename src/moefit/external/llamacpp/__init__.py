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

The names callers use are re-exported here (``from moefit.external import llamacpp``).
"""

from moefit.external.llamacpp.buffers import (
    CPU, CTX_PAD, CTX_PAD_NO_FA, CUDA, DEFAULT_BATCH, DEFAULT_KV, DEFAULT_UBATCH, KV_TYPE_SIZES, MAX_CTX, MAX_SEQ, UB_GRID,
    Backend, ComputePrice, KVPrice, ModelBuffers, PricedModel, Tensor, compute_price, cpu_model_buffer,
    expert_layer, ggml_row_bytes, kv_price, kv_types, model_buffers, pad_cells, tensors_from_geometry,
    tensors_from_header)
from moefit.external.llamacpp.command import (
    LINES, LOAD_MODES, LlamaPlan, LlamaRequest, effective_ubatch, llama_ctx, load_mode)
from moefit.external.llamacpp.host import HOST_LINES, host_bytes, host_table
from moefit.external.llamacpp.report import (
    SCHEMA, format_plan, format_split_plan, format_split_verbose, format_verbose, plan_document, short_lines, split_document)
from moefit.external.llamacpp.solver import (
    largest_llama_context, mandatory_bytes, plan_max_context, solve_llamacpp)
from moefit.external.llamacpp.split import (
    PIPELINE_COPIES, LlamaSplitPlan, largest_split_context, layer_devices, solve_split, split_model)

__all__ = [
    "CPU", "CTX_PAD", "CTX_PAD_NO_FA", "CUDA", "DEFAULT_BATCH", "DEFAULT_KV", "DEFAULT_UBATCH", "KV_TYPE_SIZES", "MAX_CTX",
    "MAX_SEQ", "UB_GRID", "Backend", "ComputePrice", "KVPrice", "ModelBuffers", "PricedModel", "Tensor",
    "compute_price", "cpu_model_buffer", "expert_layer", "ggml_row_bytes", "kv_price", "kv_types",
    "model_buffers", "pad_cells", "tensors_from_geometry", "tensors_from_header",
    "LINES", "LOAD_MODES", "LlamaPlan", "LlamaRequest", "effective_ubatch", "llama_ctx", "load_mode",
    "HOST_LINES", "host_bytes", "host_table",
    "SCHEMA", "format_plan", "format_split_plan", "format_split_verbose", "format_verbose", "plan_document", "short_lines",
    "split_document",
    "largest_llama_context", "mandatory_bytes", "plan_max_context", "solve_llamacpp",
    "PIPELINE_COPIES", "LlamaSplitPlan", "largest_split_context", "layer_devices", "solve_split", "split_model",
]
