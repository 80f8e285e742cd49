"""The floor plan, read from the imports of every module (lazy imports inside functions included).

- no import cycle between the package's modules;
- the core (everything but ``integrations/`` and ``cli/``) never imports an adapter or the command line;
- the command line imports the library as a user would: ``chunked_entropy`` and its public modules;
- no module imports another module's underscore names (``from .x import _y``, or ``x._y``).
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "chunked_entropy"
NAME = "chunked_entropy"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _resolve(module: str, is_package: bool, level: int, target) -> str:
    if level == 0:
        return target or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _modules():
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        out[_module_name(path)] = (path, ast.parse(path.read_text(), filename=str(path)))
    return out


MODULES = _modules()


def _imports(name: str):
    """``(imported module, names taken from it or None, line)`` for every import of ``name``'s module."""
    path, tree = MODULES[name]
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(name, is_package, node.level, node.module)
            names = [a.name for a in node.names]
            # ``from . import x`` imports the module ``x`` when it is one
            submodules = [f"{base}.{n}" for n in names if f"{base}.{n}" in MODULES]
            if submodules:
                for sub in submodules:
                    yield sub, None, node.lineno
            else:
                yield base, names, node.lineno


def _internal_edges():
    edges = {m: set() for m in MODULES}
    for m in MODULES:
        for target, _, _ in _imports(m):
            if target in MODULES and target != m:
                edges[m].add(target)
    return edges


def _is_core(m: str) -> bool:
    """``python -m chunked_entropy`` (``__main__``) is the command line's entry point, not the core."""
    return not (m.startswith(f"{NAME}.integrations") or m.startswith(f"{NAME}.cli") or m == f"{NAME}.__main__")


def test_the_scan_sees_the_package():
    # a broken scan would make every check below pass vacuously
    assert {f"{NAME}.head", f"{NAME}.linear", f"{NAME}.policy", f"{NAME}.integrations.huggingface"} <= set(MODULES)
    assert f"{NAME}.linear" in _internal_edges()[f"{NAME}.head"]


def test_no_import_cycles():
    edges = _internal_edges()
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(edges[m]):
            # a package's __init__ is imported before any of its submodules: an edge *to* a package
            # from inside it is not a cycle of module execution order
            if m.startswith(n + "."):
                continue
            if state.get(n) == "open":
                cycle = stack[stack.index(n):] + [n]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m)


def test_the_core_never_imports_adapters_or_the_command_line():
    bad = []
    for m in MODULES:
        if not _is_core(m):
            continue
        for target, _, line in _imports(m):
            if target.startswith(f"{NAME}.integrations") or target.startswith(f"{NAME}.cli"):
                bad.append(f"{m}:{line} imports {target}")
    assert not bad, bad


def test_the_command_line_uses_the_public_api():
    public = {NAME, f"{NAME}.losses", f"{NAME}.config", f"{NAME}.integrations", f"{NAME}.testing"}
    bad = []
    for m in MODULES:
        if not m.startswith(f"{NAME}.cli"):
            continue
        for target, _, line in _imports(m):
            if target.startswith(NAME) and not target.startswith(f"{NAME}.cli") and target not in public:
                bad.append(f"{m}:{line} imports {target}")
    assert not bad, bad


def test_no_module_imports_another_modules_underscore_names():
    bad = []
    for m, (_, tree) in MODULES.items():
        aliases = {}
        for target, names, line in _imports(m):
            if not target.startswith(NAME):
                continue
            for n in names or ():
                if n.startswith("_") and not n.endswith("__"):
                    bad.append(f"{m}:{line} imports {n} from {target}")
        # ``import chunked_entropy.x as y`` / ``from . import x``: then ``y._name`` reaches inside
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = _resolve(m, MODULES[m][0].name == "__init__.py", node.level, node.module)
                for a in node.names:
                    if f"{base}.{a.name}" in MODULES:
                        aliases[a.asname or a.name] = f"{base}.{a.name}"
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.endswith("__")):
                bad.append(f"{m}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    assert not bad, bad


def test_every_module_says_what_floor_it_is_on():
    missing = [m for m, (_, tree) in MODULES.items() if not ast.get_docstring(tree)]
    assert not missing, missing


# ----------------------------------------------------------------------------- the figures to hold (issue 46)

#: The subpackages, each one room of the floor plan (their inner imports are their own affair).
PACKAGES = ("losses", "integrations", "cli")
#: The op modules: each reads its own walk and the one preparation (``_call``), little else.
OPS = ("logits", "linear", "policy", "divergence", "head")


def _room(m: str) -> str:
    parts = m.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 and parts[1] in PACKAGES else m


def _room_edges() -> dict:
    edges = {}
    for m, targets in _internal_edges().items():
        for t in targets:
            if _room(t) != _room(m):
                edges.setdefault(_room(m), set()).add(_room(t))
    return edges


def test_the_floor_plan_has_at_most_120_arrows_and_none_runs_back_up():
    """Issue 46 item 5: at most 120 edges between the package's rooms (a module, or a subpackage whole), and
    the rooms stack: no cycle between them, so no import from a lower floor up to a higher one. Before the one
    preparation: 155 edges, the op modules importing 12-14 rooms each."""
    edges = _room_edges()
    count = sum(len(v) for v in edges.values())
    assert count <= 120, f"{count} edges between the rooms: " + ", ".join(
        f"{a}: {len(b)}" for a, b in sorted(edges.items(), key=lambda kv: -len(kv[1])))
    floor = {}

    def height(m, path=()):
        if m in path:
            raise AssertionError("an import runs back up: " + " -> ".join(path[path.index(m):] + (m,)))
        if m not in floor:
            floor[m] = 1 + max((height(t, path + (m,)) for t in edges.get(m, ())), default=0)
        return floor[m]

    for m in sorted(edges):
        height(m)
    assert all(floor[m] > floor[t] for m, ts in edges.items() for t in ts)


def test_each_op_module_imports_at_most_six_rooms():
    """Issue 46 item 1: an op module imports what it needs of the layers below through the preparation."""
    edges = _room_edges()
    wide = {op: sorted(edges[f"{NAME}.{op}"]) for op in OPS if len(edges[f"{NAME}.{op}"]) > 6}
    assert not wide, wide
    assert all(f"{NAME}._call" in edges[f"{NAME}.{op}"] for op in OPS if op != "head")


def test_each_op_body_fits_on_a_screen():
    """Issue 46 item 1: an op's body, without its docstring, is its preparation and its run: at most 40 lines."""
    long = {}
    for op in OPS:
        for node in MODULES[f"{NAME}.{op}"][1].body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                body = node.body[1:] if ast.get_docstring(node) else node.body
                lines = body[-1].end_lineno - body[0].lineno + 1
                if lines > 40:
                    long[f"{op}.{node.name}"] = lines
    assert not long, long
