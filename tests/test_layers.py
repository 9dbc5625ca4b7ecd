"""The layout: layer folders that import only downwards, no import cycle, checks behind their protocol.

The import graph is computed from the sources, every import counted (at module level and inside
functions; an ``if TYPE_CHECKING:`` block runs for type checkers only, and the start-up module's
import of the package it activates is its job). The layers and their order are read from the map
in ``docs/architecture.md``, which must name every module there is.
"""

from __future__ import annotations

import ast
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REPO_ROOT, run_python

PACKAGE = "pallas_guard"
AUTOLOAD = "pallas_guard_autoload"
TOP_LEVEL = (f"{AUTOLOAD}.py", "pallas_guard_pytest.py")
MAP = REPO_ROOT / "docs" / "architecture.md"


def _module_files() -> dict[str, Path]:
    found = {}
    for path in sorted((REPO_ROOT / PACKAGE).rglob("*.py")):
        parts = path.relative_to(REPO_ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    for file in TOP_LEVEL:
        found[file.removesuffix(".py")] = REPO_ROOT / file
    return found


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(n.lineno for n in ast.walk(child) if hasattr(n, "lineno"))
    return lines


def _imported(name: str, path: Path) -> Iterator[str]:
    """Every module name ``name``'s source imports (a ``from m import x`` imports m, and m.x where
    that is a module), relative imports resolved."""
    tree = ast.parse(path.read_text(), str(path))
    skipped = _type_checking_lines(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skipped:
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if node.module else anchor
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def import_graph() -> dict[str, set[str]]:
    modules = _module_files()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for target in _imported(name, path):
            if target in modules and target != name and not (name == AUTOLOAD and target.startswith(PACKAGE)):
                graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def layers_in_the_map() -> list[tuple[str, list[str]]]:
    """(layer, its modules as importable names) for each row of the map's table, lowest first."""
    rows = []
    for line in MAP.read_text().splitlines():
        match = re.match(r"\| `([^`]+)` \| (`[^|]+`) \|", line)
        if match is None:
            continue
        layer, cell = match.groups()
        names = re.findall(r"`([^`]+)`", cell)
        folder = f"{PACKAGE}.{layer.rstrip('/')}." if layer.startswith("_") else ""
        rows.append((layer, [folder + name for name in names]))
    return rows


def layer_of() -> dict[str, int]:
    """Each module's layer, lowest 0; a layer's folder (its empty package) is in its layer."""
    rank = {}
    for position, (layer, modules) in enumerate(layers_in_the_map()):
        rank.update(dict.fromkeys(modules, position))
        if layer.startswith("_"):
            rank[f"{PACKAGE}.{layer.rstrip('/')}"] = position
    return rank


def test_there_is_no_import_cycle() -> None:
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_the_map_names_every_module_and_every_folder_once() -> None:
    modules = {name for name in _module_files() if not name.endswith("__init__")}
    folders = {name for name, path in _module_files().items() if path.name == "__init__.py" and name != PACKAGE}
    named = [module for _, names in layers_in_the_map() for module in names]
    assert len(named) == len(set(named)), "a module is in two layers"
    assert set(named) == modules - folders
    mapped_folders = {f"{PACKAGE}.{layer.rstrip('/')}" for layer, _ in layers_in_the_map() if layer.startswith("_")}
    assert mapped_folders == folders
    for folder in folders:  # a layer's package is a folder, nothing more: importing it costs nothing
        assert (REPO_ROOT / folder.replace(".", "/") / "__init__.py").read_text() == ""


def upward_imports(graph: dict[str, set[str]], rank: dict[str, int]) -> list[str]:
    return sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        for target in targets
        if rank[target] > rank[module]
    )


def test_each_layer_imports_only_its_own_and_the_layers_below() -> None:
    assert upward_imports(import_graph(), layer_of()) == []


def test_an_import_of_a_higher_layer_is_found() -> None:
    graph = import_graph()
    low, high = f"{PACKAGE}._vocabulary.enums", f"{PACKAGE}._guard.engine"
    graph[low] = graph[low] | {high}
    assert upward_imports(graph, layer_of()) == [f"{low} -> {high}"]


def test_no_module_outside_the_checks_names_a_check() -> None:
    """The engine, the lowering net and the front door reach the checks through the protocol and the
    checked plain interpretation; those two name no check (a check is found by name)."""
    sys.path.insert(0, str(REPO_ROOT))
    from pallas_guard_autoload import CHECKS

    checks = set(CHECKS.values())
    shared = {f"{PACKAGE}._checks.protocol", f"{PACKAGE}._checks.checked_plain"}
    named = [
        f"{module} -> {target}"
        for module, targets in import_graph().items()
        for target in targets & checks
        if not module.startswith(f"{PACKAGE}._checks.") or module in shared
    ]
    assert named == []


TOY_CHECK = '''
from pallas_guard._checks import protocol
from pallas_guard._vocabulary.errors import PallasGuardError


class Toy(protocol.Check):
    """Refuses a kernel called with a negative first element; otherwise notes that it looked."""

    name = "toy"
    order = 2
    at_front_door = True

    def before(self, run, args, kwargs):
        if float(args[0][0]) < 0:
            error = PallasGuardError(f"pallas_guard: toy: {run.kernel.info.name} got a negative input")
            raise protocol.found(self.name, error, kernel=run.kernel.info, call_site=run.call_site)
        return protocol.Prepared("toy: looked")


CHECK = Toy()
'''

TOY_RUN = """
import json, sys
import pallas_guard_autoload
pallas_guard_autoload.CHECKS["toy"] = "toy_check"  # the check's line in the settings table
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl
import pallas_guard

def add_one(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1

def call(x):
    return pl.pallas_call(add_one, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

pallas_guard.install("interpret", checks="toy,bounds")
out = call(jnp.arange(8.0)).tolist()
try:
    call(-jnp.ones(16))  # other shapes: the check runs again (once per kernel and shapes)
    refused = None
except pallas_guard.PallasGuardError as error:
    refused = str(error)
print(json.dumps({
    "out": out,
    "refused": refused,
    "decisions": [(d.action, d.check, " ".join(d.notes)) for d in pallas_guard.decisions()],
}))
"""


def test_a_check_is_its_module_and_a_line_in_the_settings_table(tmp_path: Path) -> None:
    """A toy check, written outside the package, joins the engine's checks through the settings
    table alone: it runs before the kernel, its note reaches the decision, its finding is raised and
    recorded as any check's."""
    (tmp_path / "toy_check.py").write_text(TOY_CHECK)
    result = run_python(TOY_RUN, env={"JAX_PLATFORMS": "cpu"}, cwd=tmp_path)  # the toy module: in cwd
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["out"] == [float(i + 1) for i in range(8)]
    assert report["refused"] == "pallas_guard: toy: add_one got a negative input"
    first, found = report["decisions"]
    assert first[0] == "interpreted" and "toy: looked" in first[2]
    assert found[:2] == ["found", "toy"]


@pytest.mark.parametrize("layer", [row[0] for row in layers_in_the_map()])
def test_each_layer_of_the_map_exists(layer: str) -> None:
    path = REPO_ROOT / (layer if not layer.startswith("_") else f"{PACKAGE}/{layer}")
    assert path.exists()
