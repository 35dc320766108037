"""The generated config reference (``docs/hooks/config_reference.py``, written at every docs build) lists every key
of the schema with its type, default and allowed values. The schema is walked here on its own, not through the
generator, so a key the generator skipped (a new section, a nested mapping) fails this test."""

import dataclasses
import re
import typing

from flowforge.objectives import OBJECTIVES
from flowforge.orchestrate.config import PipelineConfig
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


def test_every_schema_key_is_on_the_page(config_reference_page):
    keys = schema_keys(PipelineConfig)
    assert len(keys) > 200 and "metrics.wandb.project" in keys and "student.gate.min_spearman" in keys
    rows = table_rows(config_reference_page)
    missing = [k for k in keys if k not in rows]
    assert not missing, f"keys missing from the config reference: {missing}"
    assert not set(rows) - set(keys), "the page lists keys the schema does not have"
    for section in (f.name for f in dataclasses.fields(PipelineConfig)):
        assert f"## `{section}`" in config_reference_page


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
