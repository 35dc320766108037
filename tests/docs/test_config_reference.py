"""The generated config reference (``docs/hooks/config_reference.py``, written at every docs build) lists every key
of the schema with its type, default and allowed values. The schema is walked here on its own, not through the
generator, so a key the generator skipped (a new section, a nested mapping, a scorer's option section) fails this
test; the option tables in the guides are compared with the generator's."""

import dataclasses
import pathlib
import re
import typing

import pytest

from flowforge.objectives import OBJECTIVES
from flowforge.orchestrate.config import PipelineConfig
from flowforge.rewards.judge.options import JudgeOptions
from flowforge.rewards.judge.transport import RETRY_KINDS
from flowforge.rewards.registry import SCORERS, option_sections
from flowforge.settings.schema import ConfigError, recorded_choices
from flowforge.settings.sections import LR_SCHEDULES, TRAINABLE_MODES, LoraConfig


def schema_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of the dataclass ``cls``, nested dataclasses included."""
    hints = typing.get_type_hints(cls)
    keys = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        if prefix:
            keys.append(key)
        if dataclasses.is_dataclass(hints[f.name]):
            keys.extend(schema_keys(hints[f.name], key))
    return keys


def table_rows(page: str) -> dict[str, list[str]]:
    """``{key: [type, default, allowed, note]}`` of every table row whose first cell is a code span."""
    rows = {}
    for line in page.splitlines():
        match = re.match(r"^\| `([^`]+)` \|(.*)\|$", line)
        if match:
            rows[match.group(1)] = [c.strip() for c in match.group(2).split(" | ")]
    return rows


def scorer_option_keys() -> list[str]:
    """``reward.options.<scorer>.<option>`` of every built-in scorer that declares an option section."""
    return [f"reward.options.{name}.{f.name}" for name, factory in SCORERS.items()
            if getattr(factory, "options_class", None) for f in dataclasses.fields(factory.options_class)]


def test_every_schema_key_is_on_the_page(config_reference_page):
    keys = schema_keys(PipelineConfig) + scorer_option_keys()
    assert len(keys) > 200 and "metrics.wandb.project" in keys and "student.gate.min_spearman" in keys
    assert "reward.options.vlm_judge.retry_on" in keys and "reward.options.vlm_judge.paid" in keys
    rows = table_rows(config_reference_page)
    missing = [k for k in keys if k not in rows]
    assert not missing, f"keys missing from the config reference: {missing}"
    assert not set(rows) - set(keys), "the page lists keys the schema does not have"
    for section in [f.name for f in dataclasses.fields(PipelineConfig)] + [n for n, _ in option_sections()]:
        assert f"## `{section}`" in config_reference_page


def test_the_judge_options_on_the_page(config_reference_page):
    """Every ``vlm_judge`` option with its type, default, allowed values and its comment."""
    rows = table_rows(config_reference_page)
    judge = {k.removeprefix("reward.options.vlm_judge."): v for k, v in rows.items()
             if k.startswith("reward.options.vlm_judge.")}
    assert list(judge) == JudgeOptions.names() and all(cells[3] for cells in judge.values())
    assert judge["frames"][:3] == ["int", "`24`", "an int >= 1"]
    assert judge["retry_on"][1:3] == ["`[refused, '429']`", "refused, '429', timeout, connection, '408', '409', 5xx"]
    assert len(RETRY_KINDS) == 7
    assert judge["jpeg_quality"][2] == "an int from 1 to 100" and judge["api_key_env"][0] == "str or null"


@pytest.fixture(scope="module")
def hook():
    from tests.docs.conftest import load_hook

    return load_hook("config_reference")


def test_the_guides_option_tables_are_generated(hook):
    """Each guide's marked option table is what the generator writes from the schema now (rewrite them with
    ``python docs/hooks/config_reference.py --write-guides``), and lists every option."""
    choices = hook.collect_choices()
    root = pathlib.Path(hook.ROOT)
    for page, names in hook.GUIDE_TABLES.items():
        text = (root / page).read_text()
        for section in names:
            block = hook.guide_block(section, hook.guide_table(section, choices))
            assert block in text, f"{page}: the {section} table is stale; run python docs/hooks/config_reference.py " \
                                  f"--write-guides\n{block}"
            options = [m.group(1) for m in re.finditer(r"^\| `([^`]+)` \|", block, re.M)]
            assert options == [f.name for f in dataclasses.fields(dict(hook.sections())[section])]


def test_types_defaults_and_allowed_values(config_reference_page):
    rows = table_rows(config_reference_page)
    assert rows["train.lr"][:2] == ["float", "`0.0003`"]
    assert rows["lora.rank"][:2] == ["int or null", "`null`"]
    assert rows["reward.weights"][1] == "`{digit: 1.0}`"
    assert rows["lora.trainable"][2] == ", ".join(TRAINABLE_MODES)
    assert rows["train.lr_schedule"][2] == ", ".join(LR_SCHEDULES)
    # owned by the objective registry and checked by preflight, not by the section
    assert rows["train.algorithm"][2] == ", ".join(sorted(OBJECTIVES))
    assert rows["sampler.sde_kind"][2] == "sde, dance, cps, ode"


def test_recorded_choices_sees_what_a_section_checks():
    with recorded_choices() as seen:
        LoraConfig()
    assert seen == {"lora.trainable": TRAINABLE_MODES}
    with recorded_choices() as seen:  # refused values still record the check
        try:
            LoraConfig(trainable="nope")
        except ConfigError:
            pass
    assert seen["lora.trainable"] == TRAINABLE_MODES
    LoraConfig()  # outside the context nothing is recorded (and nothing fails)
