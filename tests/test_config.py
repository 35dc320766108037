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
    from flowforge.train.preflight import preflight

    for path in sorted(pathlib.Path(__file__).resolve().parents[1].glob("examples/**/*.yaml")):
        if path.name == "compare.yaml":
            continue
        preflight(C.load_config(path))
