"""The package's import graph: layers import only downward and no two modules import each other in a circle.

Every ``import`` statement counts, including those inside functions (a lazy import is still a dependency).
``from tetriinfer.pkg import name`` is an edge to ``tetriinfer.pkg.name`` when that is a module, else to
``tetriinfer.pkg``. Importing a submodule also runs its package's ``__init__``, but that implicit edge is not
counted: a package that re-exports its submodules would otherwise be a circle with each of them.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import tetriinfer

PKG_DIR = Path(tetriinfer.__file__).parent
# Layer rules: modules under the key import nothing under any of the listed packages.
FORBIDDEN_BELOW: dict[str, tuple[str, ...]] = {
    "tetriinfer.core": ("tetriinfer.",),  # core imports no other part of the package
    "tetriinfer.sim": ("tetriinfer.engine",),  # the simulator prices steps; it never runs a model
    "tetriinfer.model_config": ("tetriinfer.",),
}


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG_DIR.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG_DIR.rglob("*.py"))}


def imports_of(name: str, path: Path, modules: set[str]) -> set[str]:
    """The package modules that ``name`` (at ``path``) imports anywhere in its source."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base if is_pkg else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:  # ``import a.b.c`` of a non-module attribute: its module
                t = t.rpartition(".")[0]
            if t.startswith("tetriinfer") and t != name:
                out.add(t)
    return out


@functools.lru_cache(maxsize=1)
def import_graph() -> dict[str, frozenset[str]]:
    """Each package module -> the package modules it imports (parsed once per test session)."""
    mods = all_modules()
    names = set(mods)
    return {n: frozenset(imports_of(n, p, names)) for n, p in mods.items()}


def circles(graph: dict[str, set[str]] | dict[str, frozenset[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_circle_finder_sees_a_circle_and_a_clean_chain() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_graph_resolves_lazy_and_from_imports() -> None:
    graph = import_graph()
    assert len(graph) > 100
    # A function-level import and a ``from pkg import module`` both count.
    assert "tetriinfer.sim.cost_model" in graph["tetriinfer.sim.cli"]
    assert "tetriinfer.engine.fast_checkpoint" in graph["tetriinfer.engine.loader"]


def test_no_import_circles_between_modules() -> None:
    found = circles(import_graph())
    assert not found, f"import circles: {found}"


def test_layers_import_only_downward() -> None:
    bad = []
    for mod, deps in import_graph().items():
        for layer, forbidden in FORBIDDEN_BELOW.items():
            if mod == layer or mod.startswith(layer + "."):
                bad += [(mod, d) for d in deps if d.startswith(forbidden) and not d.startswith(layer)]
    assert not bad, f"upward imports: {bad}"
