"""Objectives receive what they read (an ObjectiveContext and their own sections), never the whole Config."""

import ast
import inspect
import pathlib

import pytest

import flowforge.objectives as objectives_pkg
from flowforge.config import Config, load_config
from flowforge.objectives import OBJECTIVES, NFTConfig, Objective, ObjectiveContext


def test_no_objective_module_imports_the_root_config():
    for path in pathlib.Path(objectives_pkg.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        modules |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not any(m == "flowforge.config" or m.startswith("flowforge.train") for m in modules), path


@pytest.mark.parametrize("algorithm", sorted(OBJECTIVES))
def test_context_holds_only_what_the_objective_reads(algorithm):
    cls = OBJECTIVES[algorithm]
    cfg = load_config(None, ["run.seed=7", "train.micro_batch_size=4", "advantage.clip=3.0",
                             f"train.algorithm={algorithm}"])
    ctx = cls.context(cfg)
    assert isinstance(ctx, ObjectiveContext)
    assert (ctx.seed, ctx.micro_batch_size, ctx.num_updates_per_batch, ctx.advantage_clip) == (7, 4, 2, 3.0)
    assert ctx.sampler is cfg.sampler
    assert sorted(ctx.sections) == sorted(s.section_name for s in cls.sections)
    assert all(not isinstance(v, Config) for v in (*vars(ctx).values(), *ctx.sections.values()))
    obj = cls(ctx, adapter=None, policy=None)
    assert not any(isinstance(v, Config) for v in vars(obj).values())
    for section in cls.sections:
        assert getattr(obj, section.section_name) is getattr(cfg, section.section_name)
    params = list(inspect.signature(cls.__init__).parameters)
    assert params == ["self", "ctx", "adapter", "policy"]


def test_declarations_read_the_context():
    cfg = load_config(None, ["train.algorithm=nft", "nft.ema_decay=0.9", "nft.ref_weight=0.1",
                             "forward.inner_epochs=3"])
    nft = OBJECTIVES["nft"]
    ctx = nft.context(cfg)
    assert nft.policy_bank(ctx) == {"keep_old": True, "keep_ref": True, "ema_decay": 0.9, "ema_schedule": "constant"}
    assert nft.optimizer_steps_per_batch(ctx) == 2 * 3
    assert nft(ctx, None, None).eval_policy == "ema"
    grpo = OBJECTIVES["grpo"]
    assert grpo.policy_bank(grpo.context(load_config(None, ["grpo.kl_weight=0.1"]))) == {
        "keep_ref": True, "ema_decay": 0.0, "ema_schedule": "constant"}
    assert grpo.policy_bank(grpo.context(load_config(None, ["grpo.ema_decay=0.9", "grpo.ema_schedule=warmup"]))) \
        == {"keep_ref": False, "ema_decay": 0.9, "ema_schedule": "warmup"}


def test_a_context_missing_a_section_is_refused():
    ctx = OBJECTIVES["grpo"].context(load_config(None, []))
    with pytest.raises(ValueError, match=r"needs the config sections \['forward', 'nft'\]"):
        OBJECTIVES["nft"](ctx, None, None)
    assert issubclass(OBJECTIVES["nft"], Objective) and NFTConfig.section_name == "nft"
