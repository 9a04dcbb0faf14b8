"""Command-line flags shared by the commands, and what they turn into, in five modules:

- :mod:`moefit.flags.groups`: one argparse group per function (:func:`add_model_argument`,
  :func:`add_device_flags`, :func:`add_request_flags`, :func:`add_engine_flags`,
  :func:`add_speed_flags`, :func:`add_model_files_flags`, :func:`add_serve_flags`,
  :func:`add_sampling_flags`), so a command takes the groups it needs and a new flag has one
  home;
- :mod:`moefit.flags.request`: the request flags read as values, and the
  :class:`~moefit.plan.request.Request` of moefit's plans (:func:`request_from_args`);
- :mod:`moefit.flags.devices`: the :class:`~moefit.devices.Device` s: any devices for
  planning (:func:`devices_from_args`; one: :func:`device_from_args`), devices that can run
  the model for ``serve`` and ``generate`` (:func:`runnable_devices`; ``bench`` and
  ``calibrate`` run one: :func:`runnable_device`), the host (:func:`host_from_args`) and
  ``--threads`` (:func:`apply_threads`);
- :mod:`moefit.flags.solve`: a solved :class:`~moefit.plan.types.Plan`
  (:func:`plan_from_args`), with the staging this device measured
  (:func:`calibrated_staging`), and its predicted speed (:func:`speed_from_args`);
- :mod:`moefit.flags.external`: llama.cpp's
  :class:`~moefit.external.llamacpp.LlamaRequest` for ``plan --engine llama.cpp``
  (:func:`llama_request_from_args`) and a vLLM / SGLang
  :class:`~moefit.external.multi_gpu.ServeRequest` for ``plan --engine vllm|sglang``
  (:func:`serve_request_from_args`).

The public names of all five are importable from here. This package sits below
:mod:`moefit.cli`, :mod:`moefit.serve.launch` and :mod:`moefit.bench.command`, which all
import it; it imports no torch (only :func:`runnable_devices` and :func:`apply_threads` do,
to check that a CUDA device is usable and to set torch's threads).
"""

from moefit.flags.devices import (HOST_RAM_ENV, apply_threads, device_from_args, devices_from_args,
                                  host_from_args, runnable_device, runnable_devices, warn)
from moefit.flags.external import (check_engine_flags, llama_device, llama_ftype,
                                   llama_request_from_args, llama_ubatch, llamacpp_speed_from_args,
                                   serve_request_from_args)
from moefit.flags.groups import (ENGINES, PARALLEL_FLAGS, add_device_flags, add_engine_flags,
                                 add_model_argument, add_model_files_flags, add_plan_flags,
                                 add_record_routing_flag,
                                 add_request_flags, add_sampling_flags, add_serve_flags,
                                 add_speed_flags, normalize_argv)
from moefit.flags.request import (max_context_of, mib_bytes, prefill_min_of, request_from_args,
                                  reserve_bytes_of, slots_of, wants_max_context, yarn_orig_ctx_of)
from moefit.flags.solve import (MAX_CONTEXT_CHUNK, calibrated_staging, host_speed_from_args,
                                max_context_chunk, plan_from_args, serve_default_plan,
                                speed_from_args)

__all__ = ["ENGINES", "HOST_RAM_ENV", "MAX_CONTEXT_CHUNK", "PARALLEL_FLAGS", "add_device_flags",
           "add_engine_flags", "add_model_argument", "add_model_files_flags", "add_plan_flags",
           "add_record_routing_flag",
           "add_request_flags", "add_sampling_flags", "add_serve_flags", "add_speed_flags",
           "apply_threads", "calibrated_staging", "check_engine_flags", "device_from_args",
           "devices_from_args", "host_from_args", "host_speed_from_args", "llama_device",
           "llama_ftype", "llama_request_from_args", "llama_ubatch", "llamacpp_speed_from_args",
           "max_context_chunk", "max_context_of", "mib_bytes", "normalize_argv", "plan_from_args",
           "prefill_min_of", "request_from_args", "reserve_bytes_of", "runnable_device",
           "runnable_devices", "serve_default_plan", "serve_request_from_args", "slots_of", "speed_from_args",
           "wants_max_context", "warn", "yarn_orig_ctx_of"]
