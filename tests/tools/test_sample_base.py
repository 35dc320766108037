"""``flowforge sample`` from a base model before any training (issue 27 item 9): the shipped ``demo:base`` and
``demo:world``, and a model directory with ``--config``; ``sampler.negative_prompt`` / ``--negative-prompt`` in CFG's
unconditional branch; one-line errors for what does not apply."""

from __future__ import annotations

import json
import logging

import torch
import yaml

from flowforge.cli import main
from flowforge.config import dump_config, load_config
from flowforge.demo.paths import resolve_demo_path
from flowforge.models import build_adapter
from flowforge.rollout import candidate_noise, decode_media, generate, sigmas_for
from flowforge.tools.sample import run_sample


def _expected(adapter, cfg, prompts, num, seed, guidance):
    """The images ``sample`` must give: the ODE sampler from candidate noise ``p * num + j``, written out here."""
    m = cfg.model
    shape = tuple(adapter.latent_shape(m.height, m.width, m.frames))
    cond = adapter.encode([p for p in prompts for _ in range(num)])
    x_T = candidate_noise(list(range(len(prompts) * num)), shape, seed, -1)
    with torch.no_grad():
        return decode_media(adapter, generate(adapter, cond, x_T, sigmas_for(cfg.sampler, shape), guidance), 8)


def test_demo_base_samples_the_untrained_base(tmp_path):
    prompts = ["a handwritten seven", "the number 3"]
    assert main(["sample", "demo:base", "--prompt", prompts[0], "--prompt", prompts[1], "--num", "2", "--seed", "4",
                 "--out", str(tmp_path / "g.png")]) == 0
    info = json.loads((tmp_path / "g.json").read_text())
    assert info["source"] == "base model demo:base" and info["num_steps"] == 10 and info["guidance_scale"] == 1.0
    got = run_sample("demo:base", tmp_path / "h.png", prompts=prompts, num=2, seed=4).media
    assert all((tmp_path / f"g_{i}.png").read_bytes() == (tmp_path / f"h_{i}.png").read_bytes() for i in range(4))
    cfg = load_config(None)  # the defaults are the digits examples' model and sampler
    adapter = build_adapter("sd3", resolve_demo_path("demo:base"), task="t2i", dtype=torch.float32,
                            device=torch.device("cpu"))
    assert (got - _expected(adapter, cfg, prompts, 2, 4, 1.0)).abs().max() <= 1e-6
    # the base draws the prompted digit (its own classifier agrees on most): the pictures are the base's, not noise
    from flowforge.demo.classifiers import digit_eval_accuracy

    assert digit_eval_accuracy(got, [7, 7, 3, 3]) >= 0.75


def test_demo_world_samples_video_strips_from_its_first_frames(tmp_path, capsys):
    rows = [json.loads(line) for line in resolve_demo_path("demo:world-eval").read_text().splitlines()[:2]]
    root = resolve_demo_path("demo:world-eval").parent
    for row in rows:  # a prompt file elsewhere: the images named by absolute path
        row["metadata"]["image"] = str(root / row["metadata"]["image"])
    prompt_file = tmp_path / "two.jsonl"
    prompt_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = run_sample("demo:world", tmp_path / "w.png", prompt_file=prompt_file, num=1, seed=0)
    assert result.media.shape == (2, 3, 8, 32, 32)
    again = run_sample("demo:world", tmp_path / "v.png", prompt_file=prompt_file, num=1, seed=0)
    assert torch.equal(result.media, again.media)
    assert json.loads((tmp_path / "w.json").read_text())["source"] == "base model demo:world"
    # without images the world model's prompts are refused before it loads, naming its eval set
    assert main(["sample", "demo:world", "--prompt", "LEFT LEFT", "--out", str(tmp_path / "x.png")]) == 2
    assert "--prompt-file demo:world-eval" in capsys.readouterr().err


def test_a_model_directory_with_a_config_and_the_negative_prompt(tiny_model_dir, tmp_path, caplog):
    """A model directory samples with --config's settings; under CFG the negative prompt (the config's
    sampler.negative_prompt or --negative-prompt) is what the unconditional branch encodes."""
    cfg = load_config(None, [f"model.path={tmp_path / 'elsewhere'}", "sampler.num_steps=4",
                             "sampler.guidance_scale=3.0", "sampler.negative_prompt=blurry, low quality"])
    config = tmp_path / "cfg.yaml"
    config.write_text(dump_config(cfg))
    plain = tmp_path / "plain.yaml"
    plain.write_text(yaml.safe_dump({"sampler": {"num_steps": 4, "guidance_scale": 3.0}}))
    prompts = ["a handwritten seven"]

    def images(name, *args, config_file=config, **kw):
        return run_sample(str(tiny_model_dir), tmp_path / f"{name}.png", prompts=prompts, num=2, seed=1,
                          config=config_file, **kw).media

    from_config = images("a")
    from_flag = images("b", config_file=plain, negative_prompt="blurry, low quality")
    default = images("c", config_file=plain)
    assert torch.equal(from_config, from_flag)
    assert (from_config - default).abs().max() > 1e-3  # another unconditional branch, other images
    assert json.loads((tmp_path / "a.json").read_text())["negative_prompt"] == "blurry, low quality"

    adapter = build_adapter("sd3", str(tiny_model_dir), task="t2i", dtype=torch.float32, device=torch.device("cpu"))
    adapter.negative_prompt = "blurry, low quality"
    assert (from_config - _expected(adapter, cfg, prompts, 2, 1, 3.0)).abs().max() <= 1e-6

    with caplog.at_level(logging.WARNING, logger="flowforge"):  # no CFG at guidance 1: unused, and said so
        unguided = images("d", guidance=1.0)
    assert torch.equal(unguided, images("e", config_file=plain, guidance=1.0))
    assert any("negative prompt 'blurry, low quality' is not used" in r.getMessage() for r in caplog.records)


def test_what_does_not_apply_is_one_line(tiny_model_dir, tmp_path, capsys):
    out = str(tmp_path / "x.png")
    assert main(["sample", str(tiny_model_dir), "--prompt", "a 7", "--out", out]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a base model" in err[0] and "pass --config FILE" in err[0], err
    assert main(["sample", "demo:base", "--base", str(tiny_model_dir), "--prompt", "a 7", "--out", out]) == 2
    assert "--base: applies to a run or an export" in capsys.readouterr().err
    assert main(["sample", "demo:eval", "--prompt", "a 7", "--out", out]) == 2  # a prompt set is no model
    assert "neither a run directory" in capsys.readouterr().err
    assert not list(tmp_path.glob("x*"))
