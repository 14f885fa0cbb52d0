"""The tracked tree stays small enough to travel: a GPU lease takes the working tree with the wheels a check carries
in at most 64 MiB, and every clone downloads it. Result pages keep tables, records and one headline figure per
experiment; per-step records are gzipped (benchmarks/runner/records.py), the other figures are drawn again from the
records and not tracked (benchmarks/run.py --figures), and figures are palette PNGs (benchmarks/_page.save_figure)."""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIMIT_BYTES = 10 * 10**6


def tracked_bytes(root: Path) -> tuple[int, list[tuple[int, str]]]:
    """(total bytes of the files git tracks under ``root`` as they are on disk, the ten largest as (bytes, path))."""
    out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    sizes = [((root / p).stat().st_size, p) for p in out.decode().split("\0") if p and (root / p).is_file()]
    return sum(s for s, _ in sizes), sorted(sizes, reverse=True)[:10]


def test_tracked_bytes_counts_tracked_files_only(tmp_path):
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "kept.bin").write_bytes(b"x" * 1000)
    (tmp_path / "untracked.bin").write_bytes(b"y" * 5000)
    subprocess.run(["git", "add", "kept.bin"], cwd=tmp_path, check=True)
    assert tracked_bytes(tmp_path) == (1000, [(1000, "kept.bin")])


def test_the_tracked_tree_stays_under_10_mb():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    total, largest = tracked_bytes(ROOT)
    assert total > 10**5  # the walk saw the tree
    assert total <= LIMIT_BYTES, (f"the tracked tree is {total / 1e6:.1f} MB, above {LIMIT_BYTES / 1e6:.0f} MB; "
                                  f"largest: {[(f'{s / 1e6:.2f} MB', p) for s, p in largest]}")
