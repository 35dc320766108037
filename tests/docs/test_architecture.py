"""docs/architecture.md's "What exists" lists exactly what the registries hold: every model family (with the tasks
its adapter declares), every reward scorer, every algorithm and every command -- nothing missing, nothing stale; its
"Package layers" table is the layering ``tests/test_layers.py`` enforces, layer by layer and room by room."""

import pathlib
import re

import pytest

from flowforge.cli import VERBS
from flowforge.models import ADAPTERS, adapter_tasks
from flowforge.objectives import OBJECTIVES
from flowforge.rewards.registry import SCORERS
from tests.test_layers import LAYERS

ARCHITECTURE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def listed(heading: str) -> dict[str, list[str]]:
    """``{name: [other cells]}`` of the table under ``### heading`` in "## What exists"."""
    text = ARCHITECTURE.read_text()
    section = text.split("\n## What exists\n", 1)[1].split("\n## ", 1)[0]
    body = section.split(f"\n### {heading}\n", 1)[1].split("\n### ", 1)[0]
    rows = {}
    for line in body.splitlines():
        match = re.match(r"^\| `([^`]+)` \|(.*)\|$", line)
        if match:
            assert match.group(1) not in rows, f"{match.group(1)} listed twice under {heading}"
            rows[match.group(1)] = [c.strip() for c in match.group(2).split("|")]
    return rows


@pytest.mark.parametrize("heading, registry", [("Model families", ADAPTERS), ("Reward scorers", SCORERS),
                                               ("Algorithms", OBJECTIVES), ("Commands", VERBS)])
def test_each_registry_is_listed_both_ways(heading, registry):
    names = set(listed(heading))
    assert not set(registry) - names, f"registered but not in docs/architecture.md: {sorted(set(registry) - names)}"
    assert not names - set(registry), f"in docs/architecture.md but not registered: {sorted(names - set(registry))}"


def test_family_tasks_are_the_adapters():
    for name, cells in listed("Model families").items():
        tasks = tuple(t.split("(")[0].strip() for t in cells[-1].split(","))
        assert tasks == tuple(adapter_tasks(name)), name


def test_the_layer_table_is_the_enforced_layering():
    """Each row ``| N | `flowforge/pkg/` | ...`` of "Package layers", in order, is an entry of ``LAYERS[N]`` in its
    room order: a package added to the checker's table but not to the page (or the other way round, or moved to
    another layer) fails here."""
    text = ARCHITECTURE.read_text()
    section = text.split("\n## Package layers\n", 1)[1].split("\n## ", 1)[0]
    rows = [(int(m.group(1)), m.group(2).rstrip("/").removesuffix(".py").replace("/", "."))
            for m in re.finditer(r"^\| (\d+) \| `([^`]+)`", section, re.M)]
    assert rows == [(layer, entry) for layer, entries in enumerate(LAYERS) for entry in entries]
