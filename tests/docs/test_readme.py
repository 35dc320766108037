"""README.md stays a short front page: at most 300 lines, the two copy-paste commands (install + the main job, install
+ the tests CI runs) are its first code blocks, and every link in it leads to a file of the repository, among them
every guide page."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
MAIN_JOB = "pip install -e . && flowforge train examples/digits/nft.yaml"
TESTS = 'pip install -e ".[test]" && HF_HUB_OFFLINE=1 python -m pytest -q'


def code_blocks(text: str) -> list[str]:
    return [m.group(1).strip() for m in re.finditer(r"^```[a-z]*\n(.*?)^```", text, flags=re.M | re.S)]


def test_readme_is_short():
    assert len(README.splitlines()) <= 300


def test_the_two_commands_come_first():
    assert code_blocks(README)[:2] == [MAIN_JOB, TESTS]
    assert README.index(MAIN_JOB) < README.index(TESTS) < README.index("\n## ", README.index("## Quick start") + 1)


def test_the_test_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'python -m pip install -e ".[test]"' in ci
    assert re.search(r"^python -m pytest -q( |$)", ci, flags=re.M), "CI no longer runs README's test command"


def test_links_lead_to_files_and_cover_every_guide():
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    assert targets
    missing = [t for t in targets if not t.startswith("http") and not (ROOT / t).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"
    guides = {f"docs/guides/{p.name}" for p in (ROOT / "docs" / "guides").glob("*.md")}
    assert guides - set(targets) == set(), f"guide pages README does not link: {sorted(guides - set(targets))}"


def test_the_gpu_plan_table_is_the_guides_and_covers_every_gpu_example():
    """README's memory-plan table is the one bench/plan_table.py writes into the memory-plan guide (the same rows),
    one row per examples/gpu run config."""
    start, end = "<!-- plan-table:start -->", "<!-- plan-table:end -->"

    def table(path: pathlib.Path) -> str:
        text = path.read_text()
        return text[text.index(start):text.index(end)]

    readme = table(ROOT / "README.md")
    assert readme == table(ROOT / "docs" / "guides" / "memory_plan.md")
    for config in sorted((ROOT / "examples" / "gpu").glob("*.yaml")):
        if "stages:" in config.read_text():  # a pipeline config: planned per stage, not in this table
            continue
        assert f"| {config.name} |" in readme, config.name
