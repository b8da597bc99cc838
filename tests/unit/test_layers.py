"""The house's layer rules (docs/architecture.md), read from the code's own imports: no import cycle, the wings
never reach up into the faces, the shared machinery never imports a wing, no module imports another's private
name, and no module passes the size cap."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "mbtune"
WINGS = ("probing", "sweeping", "serving", "checking", "planning", "qualifying")
FACES = ("cli", "report", "api")  # what people and programs touch: nothing below imports them
MACHINERY = ("pipeline", "workloads", "device")  # what the wings share: it imports no wing
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _type_checking_only(tree: ast.AST) -> set[int]:
    """The nodes under `if TYPE_CHECKING:` (annotations only: never imported at run time)."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(inner) for inner in ast.walk(node))
    return skipped


def _imports(module: str) -> list[tuple[str, tuple[str, ...]]]:
    """What `module` imports at run time, at its top or inside a function: (module imported, names taken)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    skipped = _type_checking_only(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            for alias in node.names:
                # `from mbtune.cli import support` imports the module mbtune.cli.support.
                target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                found.append((target, () if target != base else (alias.name,)))
    return [(target, names) for target, names in found if target.split(".")[0] == "mbtune"]


def _owner(target: str) -> str | None:
    """The project's module that an import names (a package's __init__ where it names a package)."""
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


EDGES = {module: {owner for target, _ in _imports(module) if (owner := _owner(target)) and owner != module
                  and not module.startswith(owner + ".")} for module in MODULES}


def _area(module: str) -> str:
    """The folder (wing, face or machinery) a module sits in, or its own name at the top level."""
    return module.split(".")[1] if module.count(".") >= 1 else module


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in edges.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_import_graph_reads_the_package() -> None:
    assert len(MODULES) > 100
    assert "mbtune.settings" in EDGES["mbtune.cli.support"]  # a lazy import inside a function counts
    assert "mbtune.cli.support" in EDGES["mbtune.cli.train"]  # `from mbtune.cli.support import ...`


def test_no_import_cycle() -> None:
    assert cycles(EDGES) == []


@pytest.mark.parametrize("wing", WINGS)
def test_a_wing_never_imports_a_face(wing: str) -> None:
    reached = sorted(f"{module} -> {other}" for module, others in EDGES.items() if _area(module) == wing
                     for other in others if _area(other) in FACES)
    assert reached == []


@pytest.mark.parametrize("area", MACHINERY)
def test_the_shared_machinery_imports_no_wing_or_face(area: str) -> None:
    reached = sorted(f"{module} -> {other}" for module, others in EDGES.items() if _area(module) == area
                     for other in others if _area(other) in WINGS + FACES + ("saving",))
    assert reached == []


def test_the_floor_imports_nothing_above_it() -> None:
    """The top-level modules other than the API (errors, records, units, settings, ...) are the floor: they
    import one another and nothing in a folder."""
    floor = [m for m, path in MODULES.items() if path.parent == PACKAGE and path.name != "__init__.py"
             and m not in ("mbtune.api", "mbtune.__main__")]
    assert "mbtune.settings" in floor and "mbtune.records" in floor
    reached = sorted(f"{module} -> {other}" for module in floor for other in EDGES[module]
                     if other.count(".") > 1)
    assert reached == []


def test_no_module_imports_another_modules_private_name() -> None:
    private = sorted(f"{module}: {target}.{name}" for module in MODULES for target, names in _imports(module)
                     for name in names if name.startswith("_") and not name.startswith("__"))
    assert private == []


def test_no_module_over_the_size_cap() -> None:
    over = {module: lines for module, path in MODULES.items()
            if (lines := len(path.read_text().splitlines())) > MAX_LINES}
    assert over == {}
