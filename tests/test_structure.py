"""The package's shape: no import circles (imports inside functions included) and small modules.

Every module under ``src/lightning_zero_offload`` is parsed with ``ast``; an import at any depth
counts except inside ``if TYPE_CHECKING:``. A package's ``__init__`` importing its own modules is
not a circle (Python runs it first whichever submodule is imported).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "lightning_zero_offload"
MAX_LINES, MAX_ENGINE_LINES = 400, 300  # the engine wires the owners and holds the public API


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imported(tree: ast.AST, name: str, is_pkg: bool, modules: set[str]) -> set[str]:
    """The package's modules ``name`` imports anywhere but under ``if TYPE_CHECKING:``."""
    found: set[str] = set()

    def resolve(target: str) -> None:
        while target and target not in modules:  # a name inside a module: the module
            target = target.rpartition(".")[0]
        if target:
            found.add(target)

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                resolve(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for alias in node.names:  # `from pkg import module` imports that module
                full = f"{mod}.{alias.name}"
                resolve(full if full in modules else mod)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    names = set(modules)
    graph = {}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        deps = _imported(ast.parse(path.read_text(), str(path)), name, is_pkg, names)
        if is_pkg:  # a package re-exporting its own modules is not a circle
            deps = {d for d in deps if not d.startswith(name + ".")}
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def dfs(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for d in sorted(graph.get(n, ())):
            if state.get(d) == 1:
                return path[path.index(d):] + [d]
            if d not in state:
                found = dfs(d)
                if found:
                    return found
        path.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = dfs(n)
            if found:
                return found
    return None


def test_the_graph_sees_lazy_and_relative_imports() -> None:
    """The parser itself: an import inside a function counts, one under TYPE_CHECKING does not."""
    src = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import p.b\n"
           "def f():\n    from . import c\n    from .d import x\n")
    got = _imported(ast.parse(src), "p.a", False, {"p", "p.a", "p.b", "p.c", "p.d"})
    assert got == {"p.c", "p.d"}
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circles() -> None:
    graph = import_graph()
    assert "lightning_zero_offload.core.engine" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_modules_are_small() -> None:
    engine = len((PKG / "core" / "engine.py").read_text().splitlines())
    assert engine <= MAX_ENGINE_LINES, f"engine.py: {engine} lines (at most {MAX_ENGINE_LINES})"
    big = {str(p.relative_to(SRC)): n for p in _modules().values()
           if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines: {big}"


def _attribute_writes(tree: ast.AST) -> tuple[set[str], list[tuple[int, str, str]]]:
    """(names a module assigns on ``self``, [(line, base, name)] it assigns on other objects)."""
    own: set[str] = set()
    other: list[tuple[int, str, str]] = []
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for target in targets:
            for el in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(el, ast.Subscript):  # x.attr[i] = ... writes x.attr too
                    el = el.value
                if not isinstance(el, ast.Attribute):
                    continue
                base = ast.unparse(el.value)
                if base in ("self", "cls"):
                    own.add(el.attr)
                else:
                    other.append((node.lineno, base, el.attr))
    return own, other


def test_no_core_module_writes_another_owners_attribute() -> None:
    """Each kind of state has one owner: no module of ``core`` assigns (or item-assigns) an
    attribute that another module's classes own, i.e. assign on ``self``. Torch's own fields
    (``param.grad``) are not ours and not counted."""
    modules = {p: _attribute_writes(ast.parse(p.read_text()))
               for p in sorted((PKG / "core").rglob("*.py"))}
    bad = []
    for path, (own, other) in modules.items():
        for line, base, name in other:
            owners = [q.name for q, (theirs, _) in modules.items() if q != path and name in theirs]
            if owners and name not in own:
                bad.append(f"{path.relative_to(SRC)}:{line} writes {base}.{name} ({owners})")
    assert not bad, "\n".join(bad)
