"""Run one experiment of ``benchmarks/experiments/``: a matrix of training runs (level x method x N x seed), and write
its page under ``benchmarks/results/<experiment>/``.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/run.py EXPERIMENT --profile PROFILE --workers 2
    .venv/bin/python benchmarks/run.py EXPERIMENT --profile PROFILE --figures   # redraw the page's figures

The runner itself is the package ``benchmarks/runner/`` (``benchmarks/runner/cli.py`` says what a run, a page and its
record are); this file is the command.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.runner import main, welch_p  # noqa: E402,F401  (welch_p: benchmarks/gpu_check.py reads it here)

if __name__ == "__main__":
    main()
