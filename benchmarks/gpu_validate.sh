#!/usr/bin/env bash
# The GPU validation run of issue 27 (benchmarks/gpu_validate.py; docs/validation-gpu.md).
#   benchmarks/gpu_validate.sh                 full run on cuda:0, record in ./validation-gpu
#   benchmarks/gpu_validate.sh --device cpu    CI's short mode on the simulated device
# Other flags go to gpu_validate.py (--out DIR, --budget-s S, --llama-bench PATH).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
py="${PYTHON:-$root/.venv/bin/python}"
[ -x "$py" ] || py="$(command -v python3)"
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}"
exec "$py" "$here/gpu_validate.py" "$@"
