"""The docs keep up with the code: docs/extending.md's map lists every module of the three packages, and every
citation of the design points at a file and a section that exist (docs/design.md, by heading)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("constraints", "trainers", "dcmdp")
MAP_HEADING = "## A map of the code"
DESIGN = ROOT / "docs" / "design.md"
# The design note's old name, which the repository never held; spelt in two parts so this file does not cite it.
OLD_NAME = "DESIGN" + ".md"
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".sh", ".txt", ".cfg", ".toml", ".json", ".ini", ""}
CITATION = re.compile(r"design\.md §\"([^\"]+)\"")
LINK = re.compile(r"\]\(([^)\s]*design\.md)#([^)\s]+)\)")


def package_modules(root: Path = ROOT) -> set[str]:
    """Dotted names of every module of the packages: each .py file, a package's ``__init__.py`` under the package's
    name when it holds code (an empty one holds nothing to describe)."""
    out = set()
    for pkg in PACKAGES:
        for path in (root / pkg).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                if not path.read_text().strip():
                    continue
                parts = parts[:-1]
            out.add(".".join(parts))
    return out


def mapped_modules(text: str) -> set[str]:
    """The modules named in the first cell of the table rows of the map section of docs/extending.md."""
    start = text.index(MAP_HEADING)
    end = text.find("\n## ", start + len(MAP_HEADING))
    section = text[start:end if end >= 0 else len(text)]
    return set(re.findall(r"^\| `([a-z_][a-z0-9_.]*)` \|", section, flags=re.M))


def test_mapped_modules_reads_the_first_cell_of_the_map_only():
    text = ("## Before\n| `dcmdp.not_here` | x |\n## A map of the code\n| `dcmdp` (the run) | what |\n"
            "| `dcmdp.loop` | the loop, see `dcmdp.dual` |\n## After\n| `dcmdp.later` | y |\n")
    assert mapped_modules(text) == {"dcmdp.loop"}


def test_the_module_map_lists_every_module():
    listed = mapped_modules((ROOT / "docs" / "extending.md").read_text())
    modules = package_modules()
    missing, stale = sorted(modules - listed), sorted(listed - modules)
    assert not missing, f"docs/extending.md's map of the code leaves out {missing}: add a row with what each holds"
    assert not stale, f"docs/extending.md's map of the code lists modules that do not exist: {stale}"


def repository_files() -> list[Path]:
    """The files of the repository: tracked and untracked-but-not-ignored ones when git is there, else the tree
    without the virtual environment and the git directory."""
    if (ROOT / ".git").exists():
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, check=True).stdout.decode()
        paths = [ROOT / p for p in dict.fromkeys(out.split("\0")) if p]
    else:
        skip = {".git", ".venv", "node_modules", "__pycache__"}
        paths = [p for p in ROOT.rglob("*") if not skip & set(p.relative_to(ROOT).parts)]
    return [p for p in paths if p.is_file() and p.suffix in TEXT_SUFFIXES]


def _texts() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text(errors="ignore") for p in repository_files()}


@pytest.fixture(scope="module")
def texts() -> dict[str, str]:
    return _texts()


def test_no_file_cites_a_design_note_the_repository_lacks(texts):
    """The design lives in docs/design.md; a reference to the old name points at nothing in a clone."""
    if (ROOT / OLD_NAME).is_file():
        pytest.skip(f"the repository holds {OLD_NAME}")
    citing = [f"{path}:{n}" for path, text in texts.items() if OLD_NAME in text
              for n, line in enumerate(text.splitlines(), 1) if OLD_NAME in line]
    assert not citing, f"these lines cite {OLD_NAME}, which is not in the repository; cite docs/design.md: {citing}"


def headings(text: str) -> list[str]:
    """The section headings of a markdown page, without the leading #'s."""
    return [m.group(1).strip() for m in re.finditer(r"^#{1,6} (.+)$", text, flags=re.M)]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def test_slug_matches_githubs_anchors():
    assert slug("Layering: dcmdp → trainers → constraints") == "layering-dcmdp--trainers--constraints"
    assert slug("Routing replay (R2, R3)") == "routing-replay-r2-r3"


def test_every_cited_design_section_exists(texts):
    """A citation of a section by its heading (design.md, a section sign, the heading in double quotes) and a link
    to design.md with an anchor name a section of docs/design.md: a renamed heading fails here until its citations
    follow it."""
    names = headings(DESIGN.read_text())
    anchors = {slug(h) for h in names}
    bad = []
    for path, text in texts.items():
        bad += [f"{path}: §\"{h}\"" for h in CITATION.findall(text) if h not in names]
        bad += [f"{path}: #{a}" for target, a in LINK.findall(text)
                if (ROOT / path).parent.joinpath(target).resolve() == DESIGN.resolve() and a not in anchors]
    assert not bad, f"citations of docs/design.md sections it does not have: {bad}"


def test_the_design_is_cited():
    """The code cites the design's sections by heading, so docs/design.md is the page the code leans on."""
    cited = {h for text in _texts().values() for h in CITATION.findall(text)}
    assert {"Dual rules", "Measures", "Penalty forms", "The primal learner"} <= cited
