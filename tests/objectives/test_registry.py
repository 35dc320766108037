"""The registry: every algorithm runs on the loop, declares the config sections it owns, and a new objective class
adds its section to the root config by one registry entry."""

import dataclasses
import json

import pytest

from flowforge import config as C
from flowforge.objectives import OBJECTIVES, ForwardConfig, ForwardProcessObjective, GRPOConfig, objective_sections
from flowforge.settings import Checks, ConfigError, Section


@pytest.mark.parametrize("algorithm", ["grpo_guard", "awm", "dgpo", "dpo", "crd"])
def test_every_objective_two_step_smoke(make, algorithm):
    extra = ["crd.kl_beta=0.1"] if algorithm == "crd" else []
    run_dir = make(f"train.algorithm={algorithm}", *extra, name=algorithm).train()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["train/skipped"] == 0.0 for r in rows)
    assert all(r["train/loss"] == r["train/loss"] for r in rows)  # finite, not NaN


def test_registry_keys_are_names_and_sections_are_config_fields():
    fields = {f.name: f.type for f in dataclasses.fields(C.Config)}
    for key, cls in OBJECTIVES.items():
        assert cls.name == key
        for section in cls.sections:
            assert fields[section.section_name] is section, (key, section)
    assert [s.section_name for s in objective_sections()] == [
        "grpo", "grpo_guard", "forward", "nft", "awm", "dgpo", "dpo", "crd", "dppo", "draft", "dmd2", "anchor"]


@dataclasses.dataclass(frozen=True)
class DummyConfig(Section):
    section_name = "dummy"

    alpha: float = 1.0
    mode: str = "a"

    def problems(self) -> list[str]:
        c = Checks(self)
        c.positive("alpha")
        c.choice("mode", ("a", "b"))
        return c.problems


class Dummy(ForwardProcessObjective):
    name = "dummy"
    sections = (ForwardConfig, DummyConfig)


def test_a_registered_objective_adds_its_section_to_the_root_config():
    root = C.config_class({**OBJECTIVES, "dummy": Dummy})
    names = [f.name for f in dataclasses.fields(root)]
    assert names[names.index("anchor") - 1] == "dummy" and names[-7:] == ["eval", "guard", "checkpoint",
                                                                          "distributed", "artifacts", "metrics", "sft"]
    from flowforge.settings import build

    cfg = build(root, {"dummy": {"alpha": 2.5}, "train": {"algorithm": "dummy"}})
    assert cfg.dummy == DummyConfig(alpha=2.5)
    ctx = Dummy.context(cfg)
    assert dict(ctx.sections) == {"forward": ForwardConfig(), "dummy": DummyConfig(alpha=2.5)}
    obj = Dummy(ctx, adapter=None, policy=None)
    assert obj.dummy.alpha == 2.5 and obj.sampling_policy == "old"
    with pytest.raises(ConfigError) as err:
        build(root, {"dummy": {"alpha": -1.0, "mode": "c"}, "grpo": {"clip_low": 0.0}})
    assert err.value.problems == ["grpo.clip_low=0.0 / grpo.clip_high=None must be > 0",
                                  "dummy.alpha=-1.0 must be > 0", "dummy.mode='c' is not one of ['a', 'b']"]
    assert not hasattr(C.Config(), "dummy")  # the module's own root is untouched


def test_two_classes_for_one_section_name_are_refused():
    @dataclasses.dataclass(frozen=True)
    class OtherGRPO(Section):
        section_name = "grpo"

    class Clash(Dummy):
        name = "clash"
        sections = (OtherGRPO,)

    with pytest.raises(ValueError, match="section 'grpo' is declared as GRPOConfig and as"):
        C.config_class({**OBJECTIVES, "clash": Clash})
    with pytest.raises(ValueError, match="registered as 'x' is named 'dummy'"):
        C.config_class({"x": Dummy})
    assert GRPOConfig.section_name == "grpo"
