"""Every relative link in the README, docs/ and the benchmark results pages points to a file in the tree."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "benchmarks" / "results").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def relative_links(text: str) -> list[str]:
    """The targets of the markdown links and images in text that are paths (no scheme, not an anchor alone)."""
    return [t.split("#")[0] for t in LINK.findall(text) if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def test_relative_links_finds_paths_only():
    text = "[a](docs/x.md) ![p](../y.png) [w](https://e.org/z) [s](#sec) [b](results.md#part)"
    assert relative_links(text) == ["docs/x.md", "../y.png", "results.md"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    missing = [t for t in relative_links(page.read_text()) if not (page.parent / t).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to files that do not exist: {missing}"
