#!/usr/bin/env bash
# The GPU check, run by hand on a machine with an NVIDIA GPU (CI machines have none):
#   bash .ci/gpu-check.sh      (reports land in $OUT, default /tmp/cudaenv-gpu-out)
# It was written for a box with one H200 (SM 9.0), driver 580, python3 3.12 with torch 2.11+cu130 (and pyyaml, jinja2,
# packaging, pytest, hypothesis), nvcc 13.0 in /usr/local/cuda, and no package index. So this
# verifies that interpreter (`--python`) with the machine's toolkit: our kernel compiled for the
# GPU's arch and run against the reference, the doctor's view, and the gpu tests. FlashInfer is
# not installed there (its wheels and deps exceed what travels), so its half reports skipped.
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/cudaenv-gpu-out}"
mkdir -p "$OUT"
PY="$(command -v python3)"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export CUDAENV_GPU_PYTHON="$PY"
{
    echo "== nvidia-smi"
    nvidia-smi --query-gpu=index,name,compute_cap,driver_version --format=csv
    echo "== cudaenv doctor --deep"
    "$PY" -m builder.cli doctor --python "$PY" --deep
    echo "== cudaenv verify (toolchain, kernel-compile, sampling) for 9.0a"
    "$PY" -m builder.cli verify --python "$PY" --checks toolchain,kernel-compile,sampling \
        --archs "9.0a" --report "$OUT/verify.json"
    echo "== pytest -m gpu"
    "$PY" -m pytest -q -rs -m gpu tests/test_gpu.py -p no:cacheprovider
} 2>&1 | tee "$OUT/gpu-check.log"
