#!/usr/bin/env bash
# Every GPU-only check (benchmarks/gpu_check.py, its steps in benchmarks/gpu_check.yaml; --part N for one device call
# of at most 280 s): uses $PYTHON, else this checkout's .venv, else the machine's python3; results under --out DIR,
# $OUT, or benchmarks/results/gpu (a dry run without --out: a new temporary folder).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -n "${PYTHON:-}" ]]; then
  py="$PYTHON"
elif [[ -x .venv/bin/python ]] && .venv/bin/python -c "import torch" 2>/dev/null; then
  py=.venv/bin/python
else
  py=python3
fi
exec "$py" benchmarks/gpu_check.py "$@"
