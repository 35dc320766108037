"""Config loading: defaults < YAML < CLI, shape errors all at once, YAML round trip."""

import ast
import pathlib

import pytest
import yaml

from flowforge import config as C


def test_defaults_yaml_cli_precedence(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: 0.01\n  steps: 7\nsampler:\n  num_steps: 12\n")
    cfg = C.load_config(path, ["train.lr=1e-4", "sampler.trained_indices=[3, 1]"])
    assert cfg.train.lr == 1e-4  # CLI beats YAML
    assert cfg.train.steps == 7  # YAML beats default
    assert cfg.sampler.num_steps == 12
    assert cfg.sampler.trained_indices == (3, 1)
    assert cfg.train.micro_batch_size == C.TrainConfig().micro_batch_size  # default kept


def test_round_trip_dump_reload_equal(tmp_path):
    cfg = C.load_config(None, ["reward.weights={digit: 1.0, jpeg_compressibility: 0.25}",
                               "reward.options={digit: {device: cpu}}", "sampler.sde_pool=[1,2,3]",
                               "train.adam_betas=[0.9, 0.99]", "lora.targets=[attn.to_q]"])
    text = C.dump_config(cfg)
    again = C.from_dict(yaml.safe_load(text))
    assert again == cfg
    path = tmp_path / "resolved.yaml"
    path.write_text(text)
    assert C.load_config(path) == cfg
    assert C.fingerprint(again) == C.fingerprint(cfg)


def test_unknown_key_lists_allowed_keys():
    with pytest.raises(C.ConfigError) as err:
        C.load_config(None, ["train.learning_rate=1"])
    msg = str(err.value)
    assert "unknown key 'train.learning_rate'" in msg
    for name in ("lr", "steps", "num_updates_per_batch", "micro_batch_size"):
        assert name in msg


def test_unknown_section_and_wrong_types_all_reported():
    with pytest.raises(C.ConfigError) as err:
        C.load_config(None, ["trian.lr=1", "train.steps=1.5", "sampler.num_steps=ten", "lora.targets=[1]",
                             "run.seed=true"])
    assert len(err.value.problems) == 5, err.value.problems
    assert "unknown key 'trian' (did you mean 'train'?)" in str(err.value)


def test_a_mistyped_key_gets_a_did_you_mean():
    with pytest.raises(C.ConfigError) as err:
        C.load_config(None, ["train.lrr=1e-4", "sampler.num_stepz=4", "train.zzzz=1"])
    msg = str(err.value)
    assert "unknown key 'train.lrr' (did you mean 'train.lr'?)" in msg
    assert "unknown key 'sampler.num_stepz' (did you mean 'sampler.num_steps'?)" in msg
    assert "unknown key 'train.zzzz'; allowed:" in msg  # nothing close: no guess


def test_float_fields_accept_yaml_exponent_strings(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: 3e-4\n")  # YAML 1.1 reads this as a string
    assert C.load_config(path).train.lr == pytest.approx(3e-4)


def test_bad_override_syntax():
    with pytest.raises(C.ConfigError, match="expected section.key=value"):
        C.load_config(None, ["train.lr"])


def test_config_imports_no_torch():
    tree = ast.parse(pathlib.Path(C.__file__).read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert "torch" not in names


def test_sections_check_their_own_values_all_problems_at_once():
    """A bad value fails at load naming ``section.key``, the value and the allowed values; every section's
    problems (and every type problem) come in one error."""
    with pytest.raises(C.ConfigError) as err:
        C.load_config(None, ["train.lr_schedule=step", "forward.sampler=euler", "awm.weighting=cubic",
                             "data.group_size=0", "sampler.num_steps=1", "run.seed=x"])
    problems = err.value.problems
    assert len(problems) == 6, problems
    assert "train.lr_schedule='step' is not one of ['constant', 'linear', 'cosine']" in problems
    assert "forward.sampler='euler' is not one of ['sde', 'dance', 'cps', 'ode', 'dpm2']" in problems
    assert "awm.weighting='cubic' is not one of ['uniform', 't', 't**2', 'huber', 'ghuber']" in problems
    assert "data.group_size=0 must be > 0" in problems
    assert "sampler.num_steps=1 must be >= 2" in problems
    assert any(p.startswith("run.seed: expected int") for p in problems)


def test_a_section_built_directly_checks_itself():
    with pytest.raises(C.ConfigError) as err:
        C.LoraConfig(trainable="half", dropout=0.1)
    assert err.value.problems[0] == "lora.trainable='half' is not one of ['lora', 'full', 'module', 'module+lora']"
    assert "lora.dropout=0.1" in err.value.problems[1] and len(err.value.problems) == 2
    with pytest.raises(C.ConfigError, match=r"reward.weights is empty"):
        C.RewardConfig(weights={})
    with pytest.raises(C.ConfigError, match=r"grpo.clip_low=0.0 / grpo.clip_high=None must be > 0"):
        C.GRPOConfig(clip_low=0.0)
    assert C.NFTConfig(ema_decay=0.5).ema_decay == 0.5


def test_root_sections_in_dump_order():
    import dataclasses

    assert [f.name for f in dataclasses.fields(C.Config)] == [
        "run", "model", "lora", "data", "sampler", "reward", "advantage", "train", "rollout", "grpo", "grpo_guard",
        "forward",
        "nft", "awm", "dgpo", "dpo", "crd", "dppo", "draft", "dmd2", "anchor", "eval", "guard", "checkpoint",
        "distributed", "artifacts", "metrics", "sft"]
    assert list(yaml.safe_load(C.dump_config(C.Config()))) == [f.name for f in dataclasses.fields(C.Config)]


def test_settings_layer_imports_only_stdlib_and_yaml():
    import subprocess
    import sys

    settings = pathlib.Path(C.__file__).parent / "settings"
    for path in settings.glob("*.py"):
        tree = ast.parse(path.read_text())
        names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not names - set(sys.stdlib_module_names) - {"yaml", "flowforge", "__future__"}, path
        assert all(n.module.startswith("flowforge.settings") for n in ast.walk(tree)
                   if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("flowforge")), path
    code = "import sys, flowforge.settings; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_algorithm_sections_keep_their_old_import_path():
    from flowforge.config import AWMConfig, GRPOConfig, NFTConfig
    from flowforge.objectives import awm, grpo, nft

    assert (GRPOConfig, NFTConfig, AWMConfig) == (grpo.GRPOConfig, nft.NFTConfig, awm.AWMConfig)
    with pytest.raises(ImportError):
        from flowforge.config import NoSuchConfig  # noqa: F401


# ------------------------------------------------------------------------------------------------ issue 11
def _float_fields():
    """``(section.key, yaml for NaN, yaml for inf)`` of every float field of the root config, nested ones too."""
    import dataclasses
    import typing

    out = []
    for section in dataclasses.fields(C.Config):
        cls = section.type if isinstance(section.type, type) else section.default_factory
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            where, tp = f"{section.name}.{f.name}", hints[f.name]
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            allow_inf = bool(f.metadata.get("allow_inf"))
            if tp is float or args == [float]:
                out.append((where, ".nan", ".inf", allow_inf))
            elif typing.get_origin(tp) is tuple and float in typing.get_args(tp):  # adam_betas, sde_window
                n = len(typing.get_args(tp))
                out.append((where, "[" + ", ".join([".nan"] + ["0.5"] * (n - 1)) + "]",
                            "[" + ", ".join(["0.0"] * (n - 1) + [".inf"]) + "]", allow_inf))
            elif typing.get_origin(tp) is dict and typing.get_args(tp)[1] is float:  # reward.weights
                out.append((where, "{digit: .nan}", "{digit: .inf}", allow_inf))
    return out


def test_every_float_field_refuses_nan_and_inf():
    """NaN (and inf, outside the fields where it means "no limit") is refused by the schema for every float field,
    nested in lists and mappings too, with one problem naming the key; the section's own rules say nothing more
    about that key."""
    fields = _float_fields()
    assert len(fields) > 40 and ("dppo.delta", ".nan", ".inf", True) in fields
    assert {"train.adam_betas", "sampler.sde_window", "reward.weights", "grpo.clip_low"} <= {f[0] for f in fields}
    for where, nan, inf, allow_inf in fields:
        with pytest.raises(C.ConfigError) as err:
            C.load_config(None, [f"{where}={nan}"])
        assert len(err.value.problems) == 1 and err.value.problems[0].startswith(where), err.value.problems
        assert "nan is not a number" in err.value.problems[0]
        if allow_inf:
            C.load_config(None, [f"{where}={inf}"])
            continue
        with pytest.raises(C.ConfigError) as err:
            C.load_config(None, [f"{where}={inf}"])
        assert any(p.startswith(where) and "must be finite" in p for p in err.value.problems), err.value.problems
    # a section built directly checks the same way
    with pytest.raises(C.ConfigError, match=r"grpo.clip_low=nan is not a number"):
        C.GRPOConfig(clip_low=float("nan"))
    assert C.DPPOConfig(delta=float("inf")).delta == float("inf")


@pytest.mark.parametrize("name", ["../x", "a/b", "/abs", "", ".", "..", "a\\b"])
def test_run_name_is_one_path_component(name):
    with pytest.raises(C.ConfigError, match=r"run.name=.* must be one directory name"):
        C.load_config(None, [f"run.name={name!r}"])


def test_run_name_may_be_any_single_directory_name():
    for name in ("exp-1", "run.v2", "~me", "a b", "..x"):
        assert C.load_config(None, [f"run.name={name!r}"]).run.name == name


@pytest.mark.parametrize("override, key, text", [
    ("run.seed=-1", "run.seed", "must be in [0, 2**32)"), ("run.seed=4294967296", "run.seed", "[0, 2**32)"),
    ("advantage.clip=-1", "advantage.clip", "must be > 0"), ("advantage.clip=0", "advantage.clip", "must be > 0"),
    ("eval.max_prompts=0", "eval.max_prompts", "must be > 0"), ("eval.max_prompts=-1", "eval.max_prompts", "> 0"),
    ("train.adam_betas=[0.9, 1.0]", "train.adam_betas", "[0, 1)"), ("train.adam_eps=0", "train.adam_eps", "> 0"),
    ("train.weight_decay=-1", "train.weight_decay", ">= 0"), ("sampler.num_steps=100000", "sampler.num_steps",
                                                                  "<= 1000"),
    ("sampler.num_sde_steps=-1", "sampler.num_sde_steps", ">= 0"), ("model.frames=0", "model.frames", "> 0"),
    ("model.path=''", "model.path", "empty"), ("run.num_threads=-2", "run.num_threads", ">= 0"),
    ("lora.targets=['']", "lora.targets", "empty name"), ("awm.clip_high=-1", "awm.clip_high", "> 0"),
    ("awm.adv_max=0", "awm.adv_max", "> 0"), ("run.device=''", "run.device", "empty"),
])
def test_values_that_used_to_crash_after_check_are_refused_at_load(override, key, text):
    with pytest.raises(C.ConfigError) as err:
        C.load_config(None, [override])
    (problem,) = err.value.problems
    assert problem.startswith(key) and text in problem, problem


def test_config_diff_lists_changed_keys_old_to_new():
    from flowforge.settings import config_diff

    old = C.to_dict(C.load_config(None, []))
    new = C.to_dict(C.load_config(None, ["train.lr=1e-4", "sampler.trained_indices=[1, 2]", "run.name=other",
                                         "reward.weights={digit: 1.0, jpeg_compressibility: 0.5}"]))
    assert config_diff(old, new, ignore=("run.name",)) == [
        "reward.weights.jpeg_compressibility: (absent) -> 0.5", "sampler.trained_indices: null -> [1, 2]",
        "train.lr: 0.0003 -> 0.0001"]
    assert config_diff(old, new, ignore=("run", "reward", "sampler", "train")) == []
    assert config_diff(old, old) == []
    assert config_diff({"a": {"x": (1, 2)}}, {"a": {"x": [1, 2]}}) == []  # as loaded from JSON


def test_resume_fingerprint_covers_only_what_changes_the_computation():
    from flowforge.settings import RESUME_NEUTRAL_KEYS, resume_fingerprint, resume_neutral_keys

    base = resume_fingerprint(C.load_config(None, []))
    neutral = ["run.name=x", "run.output_dir=elsewhere", "run.num_threads=1", "train.resume=auto", "train.steps=999",
               "eval.every=1", "eval.max_prompts=3", "checkpoint.every=5", "checkpoint.keep=9", "artifacts.root=a",
               "data.cache_dir=c", "data.eval_prompts=e.jsonl", "reward.device=cuda", "sft.steps=3",
               "distributed.activation_checkpointing=true", "metrics.log_every=3"]
    for override in neutral:
        assert resume_fingerprint(C.load_config(None, [override])) == base, override
    for override in ["train.lr=1e-4", "run.seed=3", "sampler.noise_level=0.5", "grpo.clip_low=1e-3", "run.device=cuda",
                     "data.group_size=4", "lora.rank=4", "model.path=elsewhere", "reward.batch_size=3",
                     "train.lr_schedule=linear"]:
        assert resume_fingerprint(C.load_config(None, [override])) != base, override
    # with a decaying LR schedule the number of steps sets every step's LR: then it counts
    linear = C.load_config(None, ["train.lr_schedule=linear"])
    assert "train.steps" not in resume_neutral_keys(C.to_dict(linear))
    assert resume_fingerprint(linear) != resume_fingerprint(C.load_config(None, ["train.lr_schedule=linear",
                                                                                 "train.steps=999"]))
    assert "train.steps" not in RESUME_NEUTRAL_KEYS and "run.name" in RESUME_NEUTRAL_KEYS


def test_resume_warning_names_the_changed_keys(caplog):
    from flowforge.settings import resume_fingerprint
    from flowforge.train.checkpoint.manager import TrainerState

    def record(*overrides):
        cfg = C.load_config(None, list(overrides))
        return TrainerState(step=0, contract={}, config_fingerprint=resume_fingerprint(cfg), config=C.to_dict(cfg))

    saved = record("train.lr=3e-4", "run.name=a").state_dict()
    saved = yaml.safe_load(yaml.safe_dump(saved))  # as stored (tuples become lists)
    caplog.set_level("WARNING", logger="flowforge")
    record("train.lr=3e-4", "run.name=b", "train.resume=auto", "train.steps=99").load_state_dict({**saved, "step": 2})
    assert not caplog.records  # only resume-neutral keys changed: nothing to say
    resumed = record("train.lr=1e-4", "sampler.noise_level=0.5", "run.name=b", "train.resume=auto")
    resumed.load_state_dict({**saved, "step": 2})
    (message,) = [r.getMessage() for r in caplog.records]
    assert message.endswith("differs from the checkpoint's in what it computes: "
                            "sampler.noise_level: 0.7 -> 0.5; train.lr: 0.0003 -> 0.0001"), message
    assert resumed.step == 2
    caplog.clear()
    old = {k: v for k, v in saved.items() if k != "config"}  # a checkpoint of an older flowforge
    resumed.load_state_dict({**old, "config_fingerprint": "0" * 16, "step": 2})
    assert "does not record its config" in caplog.records[0].getMessage()


def test_expected_resume_changes_do_not_warn_others_still_do(caplog, tiny_model_dir, tmp_path, encode_cache_dir):
    """Stage C resumes stage A's checkpoint with the student as its reward (and its own overrides): that change is
    declared (:func:`flowforge.orchestrate.stages.stage_c_changes`) and not warned about (was: a warning at every
    stage C start); any other change still is."""
    from flowforge.orchestrate.config import load_pipeline
    from flowforge.orchestrate.stages import stage_c_changes
    from flowforge.settings import resume_fingerprint
    from flowforge.train.checkpoint.manager import TrainerState
    from tests.orchestrate.support import write_pipeline

    pcfg = load_pipeline(write_pipeline(tmp_path / "p.yaml", tiny_model_dir, tmp_path, encode_cache_dir,
                                        stages={"c_overrides": ["train.lr=1e-4"]}))
    expected = stage_c_changes(pcfg)
    assert {"reward", "train.steps", "train.lr"} <= set(expected)

    def record(*overrides, expected=()):
        cfg = C.load_config(None, list(overrides))
        return TrainerState(step=0, contract={}, config_fingerprint=resume_fingerprint(cfg), config=C.to_dict(cfg),
                            expected_changes=expected)

    teacher = ["reward.weights=!{vlm_judge: 1.0}", "reward.options={vlm_judge: {model: t, base_url: u}}"]
    saved = yaml.safe_load(yaml.safe_dump(record(*teacher, "train.lr_schedule=linear").state_dict()))
    caplog.set_level("WARNING", logger="flowforge")
    student = ["reward.weights=!{scalar_head: 1.0}", "train.lr_schedule=linear", "train.lr=1e-4", "train.steps=9"]
    record(*student, expected=expected).load_state_dict({**saved, "step": 2})
    assert not caplog.records
    record(*student, "run.seed=5", expected=expected).load_state_dict({**saved, "step": 2})
    (message,) = [r.getMessage() for r in caplog.records]
    assert message.endswith("differs from the checkpoint's in what it computes: run.seed: 0 -> 5"), message


def test_module_plus_lora_takes_the_module_and_the_lora_keys():
    lora = C.LoraConfig(trainable="module+lora", modules=("latent_state_rollout.transition",), rank=4, alpha=8.0,
                        targets=("coupling.q",))
    assert (lora.resolved_rank, lora.resolved_alpha) == (4, 8.0)
    assert C.LoraConfig(trainable="module+lora", modules=("b",)).resolved_rank == 8  # LoRA's default rank
    with pytest.raises(C.ConfigError) as err:
        C.LoraConfig(trainable="module+lora", rank=0)
    assert err.value.problems == [
        "lora.rank=0 must be >= 1 with lora.trainable='module+lora'",
        "lora.modules=[] goes with lora.trainable='module' or 'module+lora' (and only with them; lora.trainable="
        "'module+lora' here): exact submodule paths such as latent_state_rollout.transition"]
