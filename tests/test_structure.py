"""The package's shape: no import circles (imports inside functions included), ``core``'s rooms
importing one way, and small modules in small folders.

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
MAX_HOST_LINES = 250  # the host arrays and their budget only (issue 45)
MAX_FOLDER_MODULES = 15  # per folder of core, its __init__ included
CORE = "lightning_zero_offload.core"
# core's rooms, bottom first: a module imports only from its own room or one listed before it.
# "base" is core's own config.py and limits.py (options and constants every room reads); "top"
# is the rest of core's own modules, which wire the rooms (engine, setup, checks, optimizer,
# ranks) and the package's __init__.
ROOMS = ("base", "dist", "rules", "device", "buckets", "transfer", "step", "checkpoint", "top")
BASE = {"config", "limits"}


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
    host = len((PKG / "core" / "buckets" / "host.py").read_text().splitlines())
    assert host <= MAX_HOST_LINES, f"buckets/host.py: {host} lines (at most {MAX_HOST_LINES})"
    big = {str(p.relative_to(SRC)): n for p in _modules().values()
           if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines: {big}"


def test_core_folders_are_small() -> None:
    big = {str(d.relative_to(SRC)): n for d in [PKG / "core", *(PKG / "core").rglob("*/")]
           if d.is_dir() and (n := len(list(d.glob("*.py")))) > MAX_FOLDER_MODULES}
    assert not big, f"folders of core with over {MAX_FOLDER_MODULES} modules: {big}"


def room(module: str) -> str | None:
    """The room of ``core`` a module is in (None outside core)."""
    if module != CORE and not module.startswith(CORE + "."):
        return None
    parts = module[len(CORE) + 1:].split(".") if module != CORE else []
    if len(parts) > 1:
        return parts[0]
    return "base" if parts and parts[0] in BASE else "top"


def back_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports between core's rooms against ``ROOMS``'s order (and rooms it does not list)."""
    bad = []
    for name, deps in sorted(graph.items()):
        here = room(name)
        if here is None:
            continue
        if here not in ROOMS:
            bad.append(f"{name}: room {here!r} is not in ROOMS")
            continue
        for dep in sorted(deps):
            there = room(dep)
            if there is not None and there != here and (
                    there not in ROOMS or ROOMS.index(there) > ROOMS.index(here)):
                bad.append(f"{name} ({here}) imports {dep} ({there})")
    return bad


def test_core_rooms_import_one_way() -> None:
    """``core`` is rooms named for what they own; each imports only from the rooms below it."""
    rooms = {room(name) for name in import_graph()} - {None}
    assert rooms == set(ROOMS), f"rooms {sorted(rooms)} != ROOMS {ROOMS}"
    bad = back_imports(import_graph())
    assert not bad, "imports against the rooms' order:\n" + "\n".join(bad)


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


# -- buckets: one record per bucket owns its place, its sides and its state (issue 45) ----------
BUCKETS = PKG / "core" / "buckets" / "buckets.py"
_IN_PLACE = ("copy_", "zero_")  # methods that write the tensor they are called on


def _stage_and_shard_types() -> set[str]:
    """The classes of a bucket's sides and shards (``buckets.stage``, ``buckets.shard``)."""
    return {node.name for p in (BUCKETS.with_name("stage.py"), BUCKETS.with_name("shard.py"))
            for node in ast.walk(ast.parse(p.read_text())) if isinstance(node, ast.ClassDef)}


def _ours(tree: ast.AST, types: set[str]) -> set[str]:
    """Names of ``types`` as a module spells them: imported from ``buckets.stage``/``buckets.shard``
    (another ``Shard``, DTensor's placement, is not ours), or ``stage.X``/``shard.X``."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[-1] in (
                "stage", "shard"):
            out |= {a.asname or a.name for a in node.names if a.name in types}
    return out | {f"{m}.{t}" for m in ("stage", "shard") for t in types}


def placement_questions(tree: ast.AST, types: set[str]) -> list[tuple[int, str]]:
    """Where a module asks where a bucket lives, outside ``buckets.buckets``: an ``isinstance`` on a
    side or shard type, a ``.resident``, or ``len(...buckets) -`` (a suffix counted)."""
    found, ours = [], _ours(tree, types)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "isinstance" and len(node.args) == 2
                and ours & {ast.unparse(n) for n in ast.walk(node.args[1])}):
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Attribute) and node.attr == "resident":
            found.append((node.lineno, ast.unparse(node)))
        elif (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub)
              and isinstance(node.left, ast.Call) and isinstance(node.left.func, ast.Name)
              and node.left.func.id == "len" and node.left.args
              and ast.unparse(node.left.args[0]).endswith("buckets")):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_only_the_buckets_answer_where_a_bucket_lives() -> None:
    types = _stage_and_shard_types()
    bad = [f"{p.relative_to(SRC)}:{line}: {text}" for p in _modules().values() if p != BUCKETS
           for line, text in placement_questions(ast.parse(p.read_text()), types)]
    assert not bad, "\n".join(bad)


def _written(node: ast.AST) -> ast.AST | None:
    """The tensor expression an in-place write writes: ``x`` of ``x.copy_(..)``/``x.zero_()``
    or of ``x[...] = ..``; None for anything else."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in _IN_PLACE):
        return node.func.value
    if isinstance(node, ast.Assign):
        for target in node.targets:
            if isinstance(target, ast.Subscript):
                return target.value
    return None


def _owner_chain(expr: ast.AST) -> ast.Attribute | None:
    """The attribute a written expression is a view of: ``a.b`` of ``a.b[g][lo:hi]``."""
    while isinstance(expr, ast.Subscript):
        expr = expr.value
    return expr if isinstance(expr, ast.Attribute) else None


def foreign_writes(tree: ast.AST, own: set[str], owned: dict[str, list[str]]
                   ) -> list[tuple[int, str]]:
    """In-place writes (``.copy_``, ``.zero_()``, slice assignment) into an attribute that
    another module's classes own (assign on ``self``), on an object other than ``self``, and
    not one this module owns too; a local name bound to such an attribute counts as it."""
    found = []
    for func in [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]:
        alias: dict[str, ast.Attribute] = {}
        for node in ast.walk(func):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(
                    node.targets[0], ast.Name) and (chain := _owner_chain(node.value)):
                alias[node.targets[0].id] = chain
            written = _written(node)
            if written is None:
                continue
            base = written
            while isinstance(base, ast.Subscript):
                base = base.value
            chain = alias.get(base.id) if isinstance(base, ast.Name) else _owner_chain(base)
            if (chain is not None and ast.unparse(chain.value) not in ("self", "cls")
                    and chain.attr in owned and chain.attr not in own):
                found.append((getattr(node, "lineno", 0),
                              f"{ast.unparse(written)} ({owned[chain.attr]})"))
    return sorted(set(found))


def _owners() -> tuple[dict[Path, set[str]], dict[Path, dict[str, list[str]]]]:
    """Per core module, the names it assigns on ``self``, and the names the others own."""
    mods = {p: _attribute_writes(ast.parse(p.read_text()))[0]
            for p in sorted((PKG / "core").rglob("*.py"))}
    others = {p: {name: [q.name for q, theirs in mods.items() if q != p and name in theirs]
                  for q, theirs in mods.items() if q != p for name in theirs} for p in mods}
    return mods, others


def test_no_core_module_writes_another_owners_tensors_in_place() -> None:
    """A shard's tensors (and any owner's) are written by their owner only: checkpoint loads
    and the master fill go through ``shard.load``."""
    own, others = _owners()
    bad = [f"{p.relative_to(SRC)}:{line} writes {text}" for p in own
           for line, text in foreign_writes(ast.parse(p.read_text()), own[p], others[p])]
    assert not bad, "\n".join(bad)


def test_the_structure_checks_see_what_they_forbid() -> None:
    """Each check, on a planted violation."""
    types = {"HostShard", "DeviceGradSide"}
    for src in ("from lightning_zero_offload.core.buckets.shard import HostShard\n"
                "isinstance(s, HostShard)", "isinstance(s, (int, stage.DeviceGradSide))",
                "x = host.resident", "n = len(self.layout.buckets) - k"):
        assert placement_questions(ast.parse(src), types), src
    for src in ("n = len(shards) - k\nisinstance(x, int)",
                "from torch.distributed.tensor import Shard\nisinstance(p, Shard)"):
        assert not placement_questions(ast.parse(src), types | {"Shard"}), src
    bad = back_imports({f"{CORE}.rules.rule": {f"{CORE}.buckets.layout", f"{CORE}.config"},
                        f"{CORE}.dist.collectives": {f"{CORE}.engine"},
                        f"{CORE}.buckets.host": {f"{CORE}.buckets.layout", f"{CORE}.rules.rule"},
                        f"{CORE}.engine": {f"{CORE}.step.step"}, f"{CORE}.attic.old": set()})
    assert bad == [f"{CORE}.attic.old: room 'attic' is not in ROOMS",
                   f"{CORE}.dist.collectives (dist) imports {CORE}.engine (top)",
                   f"{CORE}.rules.rule (rules) imports {CORE}.buckets.layout (buckets)"], bad
    owned = {"master": ["shard.py"], "moments": ["host.py"]}
    for src in ("def f(host):\n    host.master[0].copy_(x)",
                "def f(b):\n    b.shard.master[2:4] = x",
                "def f(host):\n    m = host.moments[0]\n    m.zero_()"):
        assert foreign_writes(ast.parse(src), set(), owned), src
    for src in ("def f(self):\n    self.master[0].copy_(x)", "def f(t):\n    t[1:2] = x",
                "def f(b):\n    b.shard.load(x)"):
        assert not foreign_writes(ast.parse(src), set(), owned), src
