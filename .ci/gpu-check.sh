#!/usr/bin/env bash
# The GPU check, run by hand on a machine with an NVIDIA GPU (CI machines have none):
#   bash .ci/gpu-check.sh      (reports land in $OUT, default /tmp/cudaenv-gpu-out)
#
# It verifies the machine's own python3 (torch with CUDA, pyyaml, jinja2, packaging, pytest,
# hypothesis) with the machine's own toolkit (CUDA_HOME, default /usr/local/cuda), and needs no
# package index: our top-k/top-p kernel compiled for each GPU's arch and run against the
# reference, FlashInfer's sampling module JIT-built and run, the cubins of both checked, the
# doctor's view, and the gpu tests.
#
# FlashInfer: where python3 has none, the slice made on another machine by
#   python3 .ci/flashinfer-slice.py --python .envs/NAME/bin/python --arch 9.0a \
#       --out .gpu-carry/flashinfer-slice.tar.gz
# (FlashInfer's Python code and the ~1000 files its sampling module compiles, plus
# apache-tvm-ffi, ~20 MiB packed) is unpacked and put on PYTHONPATH. Without either, the
# FlashInfer half of `sampling` reports skipped ("not installed") and says so.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/cudaenv-gpu-out}"
mkdir -p "$OUT"
PY="${PYTHON:-$(command -v python3)}"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export CUDAENV_GPU_PYTHON="$PY"
pythonpath="$PWD"
slice="${FLASHINFER_SLICE:-.gpu-carry/flashinfer-slice.tar.gz}"
if ! "$PY" -c "import flashinfer" >/dev/null 2>&1 && [ -f "$slice" ]; then
    site="${TMPDIR:-/tmp}/cudaenv-flashinfer-slice"
    rm -rf "$site" && mkdir -p "$site" && tar -xzf "$slice" -C "$site"
    pythonpath="$pythonpath:$site"
fi
export PYTHONPATH="$pythonpath${PYTHONPATH:+:$PYTHONPATH}"
nvcc_release="$("$CUDA_HOME/bin/nvcc" --version | sed -n 's/.*release \([0-9][0-9.]*\),.*/\1/p')"
# Each visible GPU's arch in FlashInfer's spelling (9.0a on an H200), as the product names it.
ARCHS="${ARCHS:-$("$PY" -c "from builder import archs; import sys
print(','.join(str(a) for a in archs.env_archs((), sys.argv[1])))" "$nvcc_release")}"
{
    echo "== date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "== nvidia-smi"
    nvidia-smi --query-gpu=index,name,compute_cap,driver_version,memory.total --format=csv
    echo "== versions"
    echo "python: $("$PY" -c 'import sys; print(sys.version.split()[0])')  nvcc: $nvcc_release  archs: ${ARCHS:-none}"
    "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
    "$PY" -c "import flashinfer, tvm_ffi; print('flashinfer', flashinfer.__version__, 'from', flashinfer.__file__); print('tvm_ffi', tvm_ffi.__version__)" \
        || echo "flashinfer: not importable (its half of sampling reports why)"
    echo "== cudaenv doctor --deep"
    "$PY" -m builder.cli doctor --python "$PY" --deep
    echo "== cudaenv verify for $ARCHS"
    "$PY" -m builder.cli verify --python "$PY" \
        --checks toolchain,kernel-compile,flashinfer-jit,cubin,binaries,sampling ${ARCHS:+--archs "$ARCHS"} \
        --report "$OUT/verify.json" --markdown "$OUT/verify.md"
    echo "verify exit: $?"
    echo "== cudaenv audit of the machine's own env for its GPUs (the driver bounds PTX)"
    "$PY" -m builder.cli audit --python "$PY" ${ARCHS:+--archs "$ARCHS"} \
        --json > "$OUT/audit.json"
    echo "audit exit: $?"
    echo "== pytest -m gpu"
    "$PY" -m pytest -q -rs -m gpu tests/test_gpu.py -p no:cacheprovider
    echo "pytest exit: $?"
} 2>&1 | tee "$OUT/gpu-check.log"
