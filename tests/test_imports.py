"""Layering and import cycles: constraints <- trainers <- dcmdp, nothing imports upward, no cycle among the
modules' top-level imports, and the math packages load neither vllm nor mlflow."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("constraints", "trainers", "dcmdp")
LAYER = {"constraints": 0, "trainers": 1, "dcmdp": 2}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _every_import(path: Path) -> set[str]:
    """Project modules ``path`` names in any import statement: module level, inside functions and under
    ``if TYPE_CHECKING:`` alike (a circle through a type-only or deferred import is still a circle to read)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def _top_level_imports(path: Path) -> set[str]:
    """Project modules imported when the module is imported: module-level statements only (not inside functions
    or ``if TYPE_CHECKING:``), resolved to module names."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()

    def visit(nodes):
        for node in nodes:
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.If) and not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                visit(node.body), visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)

    visit(tree.body)
    return found


def _graph(imports=_top_level_imports) -> dict[str, set[str]]:
    files = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    return {name: {m for m in imports(path) if m in files and m != name} for name, path in files.items()}


def test_nothing_imports_upward():
    bad = [(a, b) for a, deps in _graph().items() for b in deps if LAYER[b.split(".")[0]] > LAYER[a.split(".")[0]]]
    assert not bad, f"upward imports (constraints <- trainers <- dcmdp): {bad}"


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` as [a, b, ..., a], or [] if it is acyclic (depth-first search)."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done

    def dfs(node: str, path: list[str]) -> list[str]:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state:
                found = dfs(dep, path + [dep])
                if found:
                    return found
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            found = dfs(node, [node])
            if found:
                return found
    return []


def test_no_import_cycle():
    graph = _graph()
    assert len(graph) > 30  # the walk saw the whole tree
    assert find_cycle(graph) == []


# The circles still open, each as the set of its modules (none: the reward loader and its errors live in
# trainers.reward_fn, below both trainers.tasks and trainers.reward_worker).
OPEN_CIRCLES: list[set[str]] = []


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The module sets that import each other, directly or through others (cycles of ``graph``, merged)."""
    found: list[set[str]] = []
    graph = {k: set(v) for k, v in graph.items()}
    while cycle := find_cycle(graph):
        members = set(cycle)
        merged = [c for c in found if c & members]
        found = [c for c in found if not c & members] + [members.union(*merged)]
        graph[cycle[-2]].discard(cycle[-1])  # cut the closing edge and look again
    return found


def test_no_two_modules_import_each_other_through_any_import():
    graph = _graph(_every_import)
    assert len(graph) > 30
    assert sorted(map(sorted, circles(graph))) == sorted(map(sorted, OPEN_CIRCLES))


def test_circles_merges_the_cycles_through_a_module():
    assert circles({"a": {"b"}, "b": {"a", "c"}, "c": {"b"}, "d": {"e"}, "e": set()}) == [{"a", "b", "c"}]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_every_import_counts_deferred_and_type_only_imports(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("from typing import TYPE_CHECKING\nimport dcmdp.config\nif TYPE_CHECKING:\n    import dcmdp.loop\n"
                    "def f():\n    from dcmdp import tune\n")
    assert {"dcmdp.config", "dcmdp.loop", "dcmdp.tune"} <= _every_import(path)


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_type_checking_and_function_level_imports_are_not_edges(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("from typing import TYPE_CHECKING\nimport dcmdp.config\nif TYPE_CHECKING:\n    import dcmdp.loop\n"
                    "def f():\n    import dcmdp.tune\n")
    assert {"dcmdp.config", "dcmdp.loop", "dcmdp.tune"} & _top_level_imports(path) == {"dcmdp.config"}


@pytest.mark.parametrize("package", ["constraints", "trainers"])
def test_math_packages_load_alone_without_vllm_mlflow_or_upper_layers(package):
    code = (f"import sys, pkgutil, importlib, {package}\n"
            f"for m in pkgutil.walk_packages({package}.__path__, '{package}.'):\n"
            "    if 'vllm' not in m.name:  # the vLLM engine modules import vllm by design, and only they\n"
            "        importlib.import_module(m.name)\n"
            "bad = sorted(k for k in sys.modules if k.split('.')[0] in ('vllm', 'mlflow', 'dcmdp'"
            + (", 'trainers'" if package == "constraints" else "") + "))\n"
            "print(bad)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout[:500]


def test_the_engine_registry_loads_without_torch():
    """The config checks read engine capabilities from ``trainers.engines.ENGINES``: no torch or vllm behind them."""
    code = ("import sys, trainers.engines as e\n"
            "assert e.capabilities('vllm').tensor_parallel\n"
            "print(sorted(k for k in sys.modules if k.split('.')[0] in ('torch', 'vllm')))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout[:500]
