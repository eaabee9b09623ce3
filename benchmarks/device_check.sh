#!/usr/bin/env bash
# The accelerator check (benchmarks/device_check.py): one table of decode, prefill,
# transformers generate, train-step MFU and the tiny main job on this machine's device.
# Needs JAX for the device (jax[cuda12] on a GPU machine), plus torch and transformers for
# the generate row; the project itself runs from this checkout (no install).
#   bash benchmarks/device_check.sh [--tiny] [--out DIR] [--skip_hf] [--skip_job]
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # torch shares the GPU in the generate row
"${PYTHON:-python3}" -c "import jax; print('jax', jax.__version__, jax.devices())"
exec timeout "${DEVICE_CHECK_SECONDS:-540}" "${PYTHON:-python3}" benchmarks/device_check.py "$@"
