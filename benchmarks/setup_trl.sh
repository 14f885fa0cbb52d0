#!/usr/bin/env bash
# Create the TRL environment that benchmarks/trl_throughput.py drives as a subprocess.
#
#   bash benchmarks/setup_trl.sh [VENV]        (default: .venv-trl in the repository root)
#
# TRL lives in its own virtual environment so that its dependency tree (accelerate, datasets, pyarrow,
# pandas) never touches the project's .venv. Pins, and why:
# - torch==2.13.0 first and alone: pip resolves it to the CPU build on local disk (the same build as
#   .venv), never to a CUDA download; the script fails if the installed torch is a CUDA build.
# - trl==1.16.0: the newest release when this benchmark was written (requires transformers>=4.56.2).
# - transformers==5.19.0: the version .venv runs, so both sides execute the same Qwen3-MoE modelling
#   code and the same MoE expert kernel; a throughput gap then comes from the trainers, not the model.
# Idempotent: an environment that already holds these pins is left as it is.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-$ROOT/.venv-trl}"
PYTHON="${PYTHON:-python3.11}"
TORCH_PIN="torch==2.13.0"
TRL_PIN="trl==1.16.0"
TRANSFORMERS_PIN="transformers==5.19.0"

test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/pip"
PY="$VENV/bin/python"

pinned() {
    "$PY" - "$TORCH_PIN" "$TRL_PIN" "$TRANSFORMERS_PIN" <<'PYCHECK'
import sys
from importlib.metadata import PackageNotFoundError, version

for pin in sys.argv[1:]:
    name, want = pin.split("==")
    try:
        if version(name).split("+")[0] != want:
            sys.exit(1)
    except PackageNotFoundError:
        sys.exit(1)
PYCHECK
}

if ! pinned 2>/dev/null; then
    "$PIP" install --quiet --upgrade pip
    "$PIP" install --quiet "$TORCH_PIN"
    "$PIP" install --quiet "$TRL_PIN" "$TRANSFORMERS_PIN" "$TORCH_PIN"
fi

"$PY" - <<'PYCHECK'
import torch
import transformers
import trl

if torch.version.cuda is not None or "+cpu" not in torch.__version__:
    raise SystemExit(f"setup_trl.sh: expected the CPU build of torch, got {torch.__version__} "
                     f"(CUDA {torch.version.cuda})")
print(f"TRL environment ready: torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}")
PYCHECK
