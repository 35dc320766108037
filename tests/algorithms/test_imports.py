"""Import rule: flowforge/algorithms/* imports only torch and the standard library."""
import ast
import pathlib
import sys

import flowforge.algorithms as pkg

ALLOWED_THIRD_PARTY = {"torch"}


def _imported_roots(path):
    roots = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots += [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                roots.append(node.module.split(".")[0])
            elif node.module is not None and node.level > 1:
                roots.append(f"..{node.module}")  # reaching outside the package
    return roots


def test_algorithms_import_only_torch_and_stdlib():
    files = sorted(pathlib.Path(pkg.__file__).parent.glob("*.py"))
    assert len(files) >= 5
    bad = {}
    for f in files:
        offending = [m for m in _imported_roots(f)
                     if m not in ALLOWED_THIRD_PARTY and m not in sys.stdlib_module_names]
        if offending:
            bad[f.name] = offending
    assert not bad, f"non-stdlib imports in flowforge/algorithms: {bad}"


def test_checker_catches_a_forbidden_import(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import numpy as np\nfrom diffusers import X\nimport math\nfrom ..models import y\n")
    roots = _imported_roots(f)
    assert [m for m in roots if m not in ALLOWED_THIRD_PARTY and m not in sys.stdlib_module_names] == [
        "numpy", "diffusers", "..models"]
