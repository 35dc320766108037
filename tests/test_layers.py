"""The package layering of docs/architecture.md ("Package layers"), enforced on the source with ``ast``.

Every module under ``flowforge/`` is parsed; every import counts -- module level, inside functions and classes,
relative imports, and ``importlib.import_module("flowforge...")`` / ``importlib.resources.files("flowforge...")``
with a constant name -- except those in the body of an ``if TYPE_CHECKING:`` block (never executed). Rules:

1. every module belongs to a layer of :data:`LAYERS` (a new package must be added to the table);
2. a module imports only its own layer or lower ones (no upward import); within a layer, the entries are rooms
   listed from the lowest up, and a module imports only its own room or lower ones of its layer (``rollout`` may not
   import ``rewards``, nor ``models`` ``data``);
3. no ``_private`` name (module, function, class, constant) is imported from outside the package that holds it;
4. the packages of :data:`PURE` import only the standard library and the listed third-party roots (and themselves);
5. no import circle: the graph of module-to-module imports has no cycle (a module importing its own parent package is
   not an edge: Python imports the parent first in any case).

The checker runs on a tree root, so the tests below also run it on a small fake ``flowforge`` tree written into
``tmp_path`` to show that each rule really reports what it should.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "flowforge"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("flowforge", "flowforge.algorithms", "flowforge.settings", "flowforge.runtime", "flowforge.media"),
    ("flowforge.models", "flowforge.data"),
    ("flowforge.policy", "flowforge.rollout", "flowforge.demo", "flowforge.rewards"),
    ("flowforge.objectives",),
    ("flowforge.config", "flowforge.report"),
    ("flowforge.train",),
    ("flowforge.tools", "flowforge.reward_model"),
    ("flowforge.orchestrate",),
    ("flowforge.serve",),
    ("flowforge.cli",),
)
"""Layer ``i`` may import layers ``0..i``; within layer ``i``, the entry (room) at position ``j`` may import the
entries ``0..j`` of that layer. An entry names a package (and everything below it) or a module; the bare
``"flowforge"`` entry is the root ``__init__`` only (it must stay import-free: everything may import it)."""

PURE: dict[str, frozenset[str]] = {"flowforge.algorithms": frozenset({"torch"})}
"""Packages that may import only the standard library, these third-party top-level names and themselves."""

DYNAMIC_IMPORTS = frozenset({"import_module", "__import__", "files"})
"""Calls whose constant first argument names a module (``importlib.import_module``, ``__import__``,
``importlib.resources.files``); only names of our own package (or, in :data:`PURE` packages, any name) count."""


@dataclasses.dataclass(frozen=True)
class Module:
    name: str  # dotted module name, "flowforge.models.sd3"
    path: pathlib.Path
    is_package: bool  # an __init__.py

    @property
    def package(self) -> str:
        """The package this module belongs to (itself for an ``__init__``)."""
        return self.name if self.is_package else self.name.rpartition(".")[0]


@dataclasses.dataclass(frozen=True)
class Import:
    line: int
    target: str  # the module imported ("flowforge.models" for ``from flowforge.models import sd3``)
    full: str  # target plus the imported name ("flowforge.models.sd3")


def find_modules(root: pathlib.Path, package: str = PACKAGE) -> dict[str, Module]:
    """Every ``.py`` file under ``root / package`` by dotted name."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        modules[".".join(parts)] = Module(".".join(parts), path, is_package)
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _nodes(node: ast.AST):
    """Every node below ``node``, skipping the bodies of ``if TYPE_CHECKING:`` (their ``else`` still counts)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield other
                yield from _nodes(other)
            continue
        yield child
        yield from _nodes(child)


def _call_name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def imports_of(module: Module, package: str = PACKAGE) -> list[Import]:
    """The imports of ``module`` (see the module docstring for what counts), relative ones resolved."""
    tree = ast.parse(module.path.read_text(), filename=str(module.path))
    found = []
    for node in _nodes(tree):
        if isinstance(node, ast.Import):
            found += [Import(node.lineno, a.name, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            found += [Import(node.lineno, base, f"{base}.{a.name}") for a in node.names if a.name != "*"]
        elif isinstance(node, ast.Call) and _call_name(node.func) in DYNAMIC_IMPORTS and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                name = arg.value
                if name == package or name.startswith(package + ".") or _call_name(node.func) != "files":
                    found.append(Import(node.lineno, name, name))
    return found


def place_of(name: str, layers=LAYERS) -> tuple[int, int] | None:
    """``(layer, room)`` of dotted module ``name`` (its longest matching entry and that entry's position in its
    layer), ``None`` when no entry covers it."""
    best, best_len = None, -1
    for i, entries in enumerate(layers):
        for j, entry in enumerate(entries):
            covers = name == entry or (entry != PACKAGE and name.startswith(entry + "."))
            if covers and len(entry) > best_len:
                best, best_len = (i, j), len(entry)
    return best


def layer_of(name: str, layers=LAYERS) -> int | None:
    """The layer of dotted module ``name`` (longest matching entry), ``None`` when no entry covers it."""
    place = place_of(name, layers)
    return None if place is None else place[0]


def _private_owner(full: str) -> str | None:
    """The dotted path holding the first ``_private`` component of ``full`` (dunders are not private)."""
    parts = full.split(".")
    for k, part in enumerate(parts):
        if part.startswith("_") and not (part.startswith("__") and part.endswith("__")):
            return ".".join(parts[:k])
    return None


def _own(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def check_tree(root: pathlib.Path, package: str = PACKAGE, layers=LAYERS, pure=PURE) -> list[str]:
    """Every violation of the four rules in ``root / package``, as ``"path:line: message"`` strings."""
    modules = find_modules(root, package)
    problems = []
    for module in modules.values():
        where = module.path.relative_to(root).as_posix()
        own_place = place_of(module.name, layers)
        own = None if own_place is None else own_place[0]
        if own is None:
            problems.append(f"{where}:1: {module.name} is in no layer (add its package to LAYERS)")
            continue
        pure_allowed = next((allowed for p, allowed in pure.items() if _own(module.name, p)), None)
        pure_pkg = next((p for p in pure if _own(module.name, p)), None)
        for imp in imports_of(module, package):
            at = f"{where}:{imp.line}"
            if pure_pkg is not None and not _own(imp.target, pure_pkg):
                root_name = imp.target.split(".")[0]
                if _own(imp.target, package) or (root_name not in pure_allowed
                                                  and root_name not in sys.stdlib_module_names):
                    problems.append(f"{at}: {module.name} may import only the standard library, "
                                    f"{sorted(pure_allowed)} and {pure_pkg}; imports {imp.target}")
            if not _own(imp.target, package):
                continue
            target_place = place_of(imp.target, layers)
            target_layer = None if target_place is None else target_place[0]
            if target_layer is None:
                problems.append(f"{at}: {module.name} imports {imp.target}, which is in no layer")
            elif target_layer > own:
                problems.append(f"{at}: {module.name} (layer {own}) imports {imp.target} (layer {target_layer}): "
                                "an upward import")
            elif target_layer == own and target_place[1] > own_place[1]:
                rooms = layers[own]
                problems.append(f"{at}: {module.name} (layer {own}, room {rooms[own_place[1]]}) imports {imp.target} "
                                f"(room {rooms[target_place[1]]}): an upward import within the layer")
            owner = _private_owner(imp.full)
            if owner is not None:
                owner_pkg = owner if owner not in modules or modules[owner].is_package else modules[owner].package
                if not _own(module.package, owner_pkg):
                    problems.append(f"{at}: {module.name} imports the private {imp.full} from outside {owner_pkg}")
    return sorted(set(problems))  # one line per (place, rule), however many names the import lists


def import_graph(root: pathlib.Path, package: str = PACKAGE) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports (an import names the longest module it reaches: ``from a.b
    import c`` is ``a.b.c`` when that is a module, else ``a.b``); imports of an enclosing package are left out."""
    modules = find_modules(root, package)
    graph: dict[str, set[str]] = {}
    for name, module in modules.items():
        edges = set()
        for imp in imports_of(module, package):
            target = imp.full if imp.full in modules else imp.target
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                edges.add(target)
        graph[name] = edges
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []

    def visit(v: str) -> None:  # recursion depth is bounded by the number of modules (~250)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(circles)


# ------------------------------------------------------------------------------------------------ the real tree
@pytest.fixture(scope="module")
def problems() -> list[str]:
    return check_tree(ROOT)


def _kind(problems: list[str], text: str) -> list[str]:
    return [p for p in problems if text in p]


def test_every_module_is_in_a_layer(problems):
    assert len(find_modules(ROOT)) > 40
    assert not _kind(problems, "in no layer"), "\n".join(_kind(problems, "in no layer"))


def test_no_upward_imports(problems):
    upward = _kind(problems, "an upward import")
    assert not upward, "\n".join(upward)


def test_no_private_names_across_packages(problems):
    private = _kind(problems, "the private")
    assert not private, "\n".join(private)


def test_algorithms_import_only_torch_and_stdlib(problems):
    assert len(list((ROOT / "flowforge" / "algorithms").rglob("*.py"))) >= 5
    impure = _kind(problems, "may import only")
    assert not impure, "\n".join(impure)


def test_no_import_circles():
    graph = import_graph(ROOT)
    assert sum(map(len, graph.values())) > 200  # the graph really holds the package's imports
    circles = import_circles(graph)
    assert not circles, "\n".join(" <-> ".join(c) for c in circles)


def test_layer_table_names_each_package_once():
    entries = [e for layer in LAYERS for e in layer]
    assert len(entries) == len(set(entries))
    assert layer_of("flowforge.algorithms.sde") == 0 and layer_of("flowforge.cli.__main__") == 9
    assert layer_of("flowforge") == 0 and layer_of("flowforge.unknown") is None
    assert place_of("flowforge.rewards.processor") == (2, 3) and place_of("flowforge.rollout.media") == (2, 1)


# ------------------------------------------------------------------------------------------------ the checker itself
def _fake_tree(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for rel, text in files.items():
        path = root / "flowforge" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_checker_reports_an_inverted_import(tmp_path):
    root = _fake_tree(tmp_path, {
        "__init__.py": "",
        "algorithms/__init__.py": "from . import x\n",
        "algorithms/x.py": "import math\nimport torch\n\n\ndef f():\n    import flowforge.train\n",
        "train/__init__.py": "from flowforge.algorithms import x\n",
    })
    assert check_tree(root) == [
        "flowforge/algorithms/x.py:6: flowforge.algorithms.x (layer 0) imports flowforge.train (layer 5): "
        "an upward import",
        "flowforge/algorithms/x.py:6: flowforge.algorithms.x may import only the standard library, ['torch'] and "
        "flowforge.algorithms; imports flowforge.train",
    ]
    (root / "flowforge" / "algorithms" / "x.py").write_text("import math\nimport torch\n")
    assert check_tree(root) == []  # the same tree with the import removed is clean


def test_checker_rules_on_a_fake_tree(tmp_path):
    root = _fake_tree(tmp_path, {
        "__init__.py": "",
        "algorithms/__init__.py": "",
        "algorithms/_private.py": "X = 1\n",
        "algorithms/m.py": ("import numpy as np\nfrom diffusers import X\nimport math\nfrom ..models import y\n"
                            "from . import _private\n"),
        "models/__init__.py": "",
        "models/a.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from flowforge.train import T\n"
                        "else:\n    import importlib\n    importlib.import_module('flowforge.rollout')\n"),
        "models/b.py": "from flowforge.algorithms._private import X\nfrom flowforge.algorithms import _private\n",
        "rollout/__init__.py": "import importlib.resources\nP = importlib.resources.files('flowforge.train')\n",
        "nowhere/__init__.py": "",
    })
    assert check_tree(root) == [
        "flowforge/algorithms/m.py:1: flowforge.algorithms.m may import only the standard library, ['torch'] and "
        "flowforge.algorithms; imports numpy",
        "flowforge/algorithms/m.py:2: flowforge.algorithms.m may import only the standard library, ['torch'] and "
        "flowforge.algorithms; imports diffusers",
        "flowforge/algorithms/m.py:4: flowforge.algorithms.m (layer 0) imports flowforge.models (layer 1): "
        "an upward import",
        "flowforge/algorithms/m.py:4: flowforge.algorithms.m may import only the standard library, ['torch'] and "
        "flowforge.algorithms; imports flowforge.models",
        "flowforge/models/a.py:6: flowforge.models.a (layer 1) imports flowforge.rollout (layer 2): an upward import",
        "flowforge/models/b.py:1: flowforge.models.b imports the private flowforge.algorithms._private.X from "
        "outside flowforge.algorithms",
        "flowforge/models/b.py:2: flowforge.models.b imports the private flowforge.algorithms._private from "
        "outside flowforge.algorithms",
        "flowforge/nowhere/__init__.py:1: flowforge.nowhere is in no layer (add its package to LAYERS)",
        "flowforge/rollout/__init__.py:2: flowforge.rollout (layer 2) imports flowforge.train (layer 5): "
        "an upward import",
    ]


def test_checker_finds_an_import_circle(tmp_path):
    root = _fake_tree(tmp_path, {
        "__init__.py": "",
        "train/__init__.py": "",
        "train/a.py": "from flowforge.train.b import X\n",
        "train/b.py": "X = 1\n\n\ndef f():\n    from flowforge.train import c\n",
        "train/c.py": "import flowforge.train.a\n",
        "train/d.py": "from flowforge.train import a\n",  # imports into the circle, not part of it
        "tools/__init__.py": "from flowforge.tools import sub\n",
        "tools/sub.py": "import flowforge.tools\n",  # a module importing its own package is no edge
    })
    graph = import_graph(root)
    assert graph["flowforge.train.b"] == {"flowforge.train.c"} and graph["flowforge.tools.sub"] == set()
    assert import_circles(graph) == [["flowforge.train.a", "flowforge.train.b", "flowforge.train.c"]]
    (root / "flowforge" / "train" / "c.py").write_text("X = 2\n")
    assert import_circles(import_graph(root)) == []


def test_checker_reports_an_upward_import_within_a_layer(tmp_path):
    """Rooms: in layer 2, rollout (room 1) may not import rewards (room 3), at module level or inside a function;
    rewards may import rollout, and both may import the media module below them."""
    root = _fake_tree(tmp_path, {
        "__init__.py": "",
        "media.py": "import torch\n",
        "rollout/__init__.py": "from flowforge.media import torch\n",
        "rollout/a.py": "from flowforge.rewards import base\n\n\ndef f():\n    import flowforge.rewards.base\n",
        "rewards/__init__.py": "",
        "rewards/base.py": "from flowforge import media\nfrom flowforge.rollout import a\n",
    })
    assert check_tree(root) == [
        "flowforge/rollout/a.py:1: flowforge.rollout.a (layer 2, room flowforge.rollout) imports flowforge.rewards "
        "(room flowforge.rewards): an upward import within the layer",
        "flowforge/rollout/a.py:5: flowforge.rollout.a (layer 2, room flowforge.rollout) imports "
        "flowforge.rewards.base (room flowforge.rewards): an upward import within the layer",
    ]
