"""Every relative link in the README, docs/ and the benchmark results pages points to a file in the tree."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
         *sorted((ROOT / "benchmarks" / "results").rglob("*.md"))]
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


def _doc_yaml(page: Path, first_line: str) -> dict:
    """The YAML code block of ``page`` whose first line is ``first_line``."""
    import yaml

    blocks = re.findall(r"```yaml\n(.*?)```", page.read_text(), flags=re.S)
    (block,) = [b for b in blocks if b.startswith(first_line)]
    return yaml.safe_load(block)


def test_the_custom_task_recipe_is_the_default_recipe_dual_included():
    """docs/custom_tasks.md calls its sums.yaml the default recipe: every key configs/default.yaml sets has the same
    value there (the dual block above all: without it a run gets a fixed c that D-hat never reaches), but for the
    run's own output folder, thread count, length and task."""
    import yaml

    from dcmdp.config import flatten, load_config

    default = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())
    doc = _doc_yaml(ROOT / "docs" / "custom_tasks.md", "# sums.yaml")
    assert doc["dual"] == default["dual"]
    own = ("output_dir", "threads", "steps", "task.", "rollout.max_new_tokens")
    # compared as composed configs, so a key left to its dataclass default counts as the same value
    a = flatten(load_config(None, [f"{k}={v}" for k, v in _leaves(default) if not k.startswith(own)]))
    b = flatten(load_config(None, [f"{k}={v}" for k, v in _leaves(doc) if not k.startswith(own)]))
    assert a == b


def _leaves(node, prefix=""):
    """(dotted key, value) of every leaf; a list is one leaf in flow style."""
    import json

    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, f"{prefix}{k}.")
    else:
        yield prefix[:-1], json.dumps(node) if isinstance(node, list) else node


COMMAND = re.compile(r"^\s*(?:\$\s*)?dcmdp\s+(?:train|eval|calibrate|tune|report|sync)\b", re.M)


@pytest.mark.parametrize("page", [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_command_lines_in_the_docs_run_the_virtual_environments_dcmdp(page):
    """The command lives in .venv/bin: a line (fenced or indented code) that starts with a bare `dcmdp ...` fails on
    a fresh clone, unless the page has told the reader to activate the environment before it."""
    lines = page.read_text().splitlines()
    activated = next((i for i, line in enumerate(lines) if ".venv/bin/activate" in line), len(lines))
    bare = [line for line in lines[:activated] if COMMAND.match(line)]
    assert not bare, f"{page.relative_to(ROOT)}: use .venv/bin/dcmdp in {bare}"
