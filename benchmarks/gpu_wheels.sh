#!/usr/bin/env bash
# Downloads, on a machine with the package registry, the pure-Python wheels the GPU check needs beyond the device
# image (torch, transformers, numpy, scipy, matplotlib, tqdm and pyyaml are there; omegaconf is not), into .whl/
# (git-ignored), for `bash benchmarks/gpu_check.sh --wheels .whl`. Versions: those of this checkout's .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo '/.whl/' >> .git/info/exclude; }
py=python3
[[ -x .venv/bin/python ]] && py=.venv/bin/python
version() { "$py" -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null || echo "$2"; }
mkdir -p .whl
for spec in "omegaconf==$(version omegaconf 2.4.0)" "antlr4-python3-runtime==$(version antlr4-python3-runtime 4.13.2)"; do
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform any \
    -d .whl "$spec"
done
ls -1 .whl
