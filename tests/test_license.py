"""Issue 43 item 8: the repository carries its licence (Apache-2.0, the full text) and declares it in pyproject.toml;
the README says how to install the CUDA build of the pinned torch."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_apache_license_file_and_pyproject_declaration():
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text) > 10_000  # the full text, not a pointer
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]


def test_readme_has_a_cuda_install_line_for_the_pinned_torch():
    readme = (ROOT / "README.md").read_text()
    pinned = next(d for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
                  if d.startswith("torch=="))
    quick_start = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert re.search(rf"pip install {re.escape(pinned)} --index-url https://download\.pytorch\.org/whl/cu\d+",
                     quick_start)
