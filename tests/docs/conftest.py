"""Fixtures of the documentation tests: the docs hooks imported from ``docs/hooks/`` (not a package)."""

import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load_hook(name: str):
    """The module ``docs/hooks/<name>.py``."""
    spec = importlib.util.spec_from_file_location(f"docs_hook_{name}", ROOT / "docs" / "hooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def config_reference_page() -> str:
    """The generated config reference page, built once per module."""
    return load_hook("config_reference").reference_markdown()
