"""House rules on the source tree's shape: a package's ``__init__.py`` re-exports its modules' API and holds no logic of
its own (at most :data:`INIT_LINES` lines that are not blank or comments, docstrings counted), and no ``.py`` file of
``flowforge/`` or ``tests/`` is longer than :data:`FILE_LINES` lines (split it into named modules). The checkers run
on a tree root, so the tests also run them on a small fake tree in ``tmp_path`` to show that each reports what it
should.
"""

from __future__ import annotations

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
INIT_LINES = 60
FILE_LINES = 500


def logic_lines(path: pathlib.Path) -> int:
    """The lines of ``path`` that are neither blank nor a comment (docstrings and import lists count)."""
    return sum(1 for line in path.read_text().splitlines() if line.strip() and not line.lstrip().startswith("#"))


def heavy_inits(root: pathlib.Path, limit: int = INIT_LINES) -> list[str]:
    """``"path: n lines"`` for every ``__init__.py`` under ``root / "flowforge"`` with more than ``limit`` lines of
    logic (:func:`logic_lines`)."""
    found = []
    for path in sorted((root / "flowforge").rglob("__init__.py")):
        n = logic_lines(path)
        if n > limit:
            found.append(f"{path.relative_to(root).as_posix()}: {n} lines")
    return found


def long_files(root: pathlib.Path, limit: int = FILE_LINES) -> list[str]:
    """``"path: n lines"`` for every ``.py`` file under ``root / "flowforge"`` and ``root / "tests"`` longer than
    ``limit`` lines (every line counts)."""
    found = []
    for folder in ("flowforge", "tests"):
        for path in sorted((root / folder).rglob("*.py")):
            n = len(path.read_text().splitlines())
            if n > limit:
                found.append(f"{path.relative_to(root).as_posix()}: {n} lines")
    return found


def test_no_init_holds_logic():
    assert len(list((ROOT / "flowforge").rglob("__init__.py"))) > 20
    heavy = heavy_inits(ROOT)
    assert not heavy, f"move the logic into a named module of the package, re-export it: {heavy}"


def test_no_file_is_over_the_line_limit():
    assert len(list((ROOT / "tests").rglob("*.py"))) > 100
    too_long = long_files(ROOT)
    assert not too_long, f"split into named modules: {too_long}"


def test_checkers_on_a_fake_tree(tmp_path):
    body = "".join(f"X{i} = {i}\n" for i in range(INIT_LINES))
    files = {
        "flowforge/__init__.py": '"""Doc."""\n' + body,  # 61 lines of logic
        "flowforge/ok/__init__.py": "# a comment\n\n" * (FILE_LINES // 2) + body,  # comments, blanks: not logic
        "flowforge/ok/long.py": "x = 1\n" * FILE_LINES,
        "tests/test_long.py": "\n" * (FILE_LINES + 1),  # every line counts for the length
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert heavy_inits(tmp_path) == [f"flowforge/__init__.py: {INIT_LINES + 1} lines"]
    assert long_files(tmp_path) == [f"flowforge/ok/__init__.py: {FILE_LINES + INIT_LINES} lines",
                                    f"tests/test_long.py: {FILE_LINES + 1} lines"]
