#!/usr/bin/env bash
# The GPU check, on a machine with an NVIDIA GPU (CI machines have none):
#   bash .ci/gpu-check.sh [--dry-run] [--steps doctor,verify,audit,pytest] [--budget SECONDS]
# Reports land in $OUT (default a new temporary directory, named at the start):
# gpu-check.log, summary.json (every step's verdict; the exit status is 0 only when all
# passed), verify.json/.md, audit.json, pytest.xml. docs/development/gpu-check.md says what
# to carry next to the tree and how to read the summary.
#
# It verifies the machine's own python3 (torch with CUDA, pyyaml, jinja2, packaging, pytest)
# with the machine's own toolkit (CUDA_HOME, default /usr/local/cuda), and needs no package
# index. Where that python3 has no FlashInfer, the slice made on another machine by
#   python3 .ci/flashinfer-slice.py --python .envs/NAME/bin/python --arch 9.0a \
#       --out .gpu-carry/flashinfer-slice.tar.gz
# is unpacked and put on PYTHONPATH; without either the pre-flight fails, naming it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$(command -v python3 || true)}"
if [ -z "$PY" ] || ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
    # No interpreter to write the summary with: say so there too, then fail.
    if [ -n "${OUT:-}" ]; then
        mkdir -p "$OUT"
        printf '{"status": "failed", "exit": 1, "checks": [{"name": "python", "status": "failed", "reason": "no python3 >= 3.10 (PYTHON=%s)"}]}\n' \
            "${PY:-unset}" > "$OUT/summary.json"
    fi
    echo "gpu-check: no python3 >= 3.10 to run the check with (PYTHON=${PY:-unset})" >&2
    exit 1
fi
exec "$PY" .ci/gpu-check.py --python "$PY" "$@"
