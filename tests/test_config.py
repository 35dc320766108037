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
    assert "unknown key 'trian'" in str(err.value)


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


def test_examples_load_and_pass_preflight():
    """Every example is a valid config; the GPU examples name devices, models and data of a GPU machine, so they
    are checked as configs (``this_machine=False``), the CPU ones against this machine too."""
    from flowforge.train.preflight import preflight

    for path in sorted(pathlib.Path(__file__).resolve().parents[1].glob("examples/**/*.yaml")):
        if path.name == "compare.yaml":
            continue
        preflight(C.load_config(path), this_machine=path.parent.name != "gpu")


def test_sections_check_their_own_values_all_problems_at_once():
    """A bad value fails at load naming ``section.key``, the value and the allowed values; every section's
    problems (and every type problem) come in one error."""
    with pytest.raises(C.ConfigError) as err:
        C.load_config(None, ["train.lr_schedule=step", "forward.sampler=euler", "awm.weighting=cubic",
                             "data.group_size=0", "sampler.num_steps=1", "run.seed=x"])
    problems = err.value.problems
    assert len(problems) == 6, problems
    assert "train.lr_schedule='step' is not one of ['constant', 'linear', 'cosine']" in problems
    assert "forward.sampler='euler' is not one of ['sde', 'dance', 'cps', 'ode']" in problems
    assert "awm.weighting='cubic' is not one of ['uniform', 't', 't**2', 'huber', 'ghuber']" in problems
    assert "data.group_size=0 must be > 0" in problems
    assert "sampler.num_steps=1 must be >= 2" in problems
    assert any(p.startswith("run.seed: expected int") for p in problems)


def test_a_section_built_directly_checks_itself():
    with pytest.raises(C.ConfigError) as err:
        C.LoraConfig(trainable="half", dropout=0.1)
    assert err.value.problems[0] == "lora.trainable='half' is not one of ['lora', 'full']"
    assert "lora.dropout=0.1" in err.value.problems[1] and len(err.value.problems) == 2
    with pytest.raises(C.ConfigError, match=r"reward.weights is empty"):
        C.RewardConfig(weights={})
    with pytest.raises(C.ConfigError, match=r"grpo.clip_low=0.0 / grpo.clip_high=None must be > 0"):
        C.GRPOConfig(clip_low=0.0)
    assert C.NFTConfig(ema_decay=0.5).ema_decay == 0.5


def test_root_sections_in_dump_order():
    import dataclasses

    assert [f.name for f in dataclasses.fields(C.Config)] == [
        "run", "model", "lora", "data", "sampler", "reward", "advantage", "train", "grpo", "grpo_guard", "forward",
        "nft", "awm", "dgpo", "dpo", "crd", "dppo", "eval", "checkpoint", "distributed", "artifacts", "metrics",
        "sft"]
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
