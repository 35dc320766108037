"""Preflight: every violation collected into one error; warnings returned separately. Rules of one section are
checked when the config loads (every section's problems in one ConfigError); preflight checks the rest."""

import pytest

from flowforge.config import ConfigError, load_config
from flowforge.train.preflight import PreflightError, preflight


def _problems(*overrides):
    with pytest.raises(PreflightError) as err:
        preflight(load_config(None, list(overrides)), world_size=1)
    return err.value.problems


def _load_problems(*overrides):
    """Problems of rules that a section checks itself: reported by ``load_config``, before preflight."""
    with pytest.raises(ConfigError) as err:
        load_config(None, list(overrides))
    assert not isinstance(err.value, PreflightError)
    return err.value.problems


def test_default_config_passes():
    assert preflight(load_config(None, []), world_size=1).warnings == ()


def test_five_violations_reported_together():
    problems = _problems("train.algorithm=ppo", "sampler.sde_kind=langevin", "advantage.std_mode=mad",
                         "model.dtype=fp8", "distributed.strategy=zero")
    text = "\n".join(problems)
    assert len(problems) == 5, problems
    assert "train.algorithm='ppo'" in text and "'grpo'" in text
    assert "sampler.sde_kind='langevin'" in text and "'cps'" in text
    assert "advantage.std_mode='mad'" in text
    assert "model.dtype='fp8' is not one of ['float32', 'bfloat16', 'float16']" in text
    assert "distributed.strategy='zero' is not one of ['ddp', 'fsdp']" in text


def test_section_violations_reported_together_at_load():
    problems = _load_problems("lora.dropout=0.1", "reward.required=[digit, jpeg_compressibility]", "train.lr=-1",
                              "train.lr_schedule=step", "nft.ema_decay=1.0", "checkpoint.keep=0")
    text = "\n".join(problems)
    assert len(problems) == 6, problems
    assert "lora.dropout" in text
    assert "'jpeg_compressibility' but reward.weights has no weight" in text
    assert "train.lr=-1.0 must be > 0" in text
    assert "train.lr_schedule='step' is not one of ['constant', 'linear', 'cosine']" in text
    assert "nft.ema_decay=1.0 must be in [0, 1)" in text and "checkpoint.keep=0 must be >= 1" in text


@pytest.mark.parametrize("override", ["sampler.trained_indices=[9]", "sampler.sde_pool=[1, 9]"])
def test_last_step_is_never_trained(override):
    (p,) = _load_problems(override)
    assert "last step" in p and "allowed 0..8" in p


@pytest.mark.parametrize("override", ["sampler.trained_indices=[10]", "sampler.sde_pool=[-1, 2]"])
def test_index_outside_schedule(override):
    (p,) = _load_problems(override)
    assert "outside [0, 10)" in p


def test_step_zero_undefined_where_kernel_std_is_zero():
    # "cps" has std = sigma_next * sin(eta pi / 2): eta 0 makes every step degenerate, step 0 included.
    problems = _problems("sampler.sde_kind=cps", "sampler.noise_level=0.0", "sampler.trained_indices=[0]")
    assert len(problems) == 1 and "trained step 0" in problems[0]


def test_updates_must_divide_per_rank_batch():
    (p,) = _problems("train.num_updates_per_batch=3")
    assert "does not divide the per-rank batch 32" in p
    (p,) = _problems("data.group_size=6", "train.micro_batch_size=8")  # 24 / 2 = 12 not divisible by 8
    assert "micro_batch_size=8 does not divide the per-update batch 12" in p
    with pytest.raises(PreflightError, match="world size 3"):
        preflight(load_config(None, []), world_size=3)


def test_single_update_with_clipped_objective_needs_opt_in():
    (p,) = _problems("train.num_updates_per_batch=1", "train.micro_batch_size=8")
    assert "identically 1" in p and "allow_unit_ratio" in p
    preflight(load_config(None, ["train.num_updates_per_batch=1", "train.allow_unit_ratio=true"]), world_size=1)


def test_group_of_one_with_group_std_is_a_warning():
    cfg = load_config(None, ["data.group_size=1", "data.prompts_per_step=8", "train.micro_batch_size=4"])
    warnings = preflight(cfg, world_size=1).warnings
    assert len(warnings) == 1 and "every advantage is 0" in warnings[0]


@pytest.mark.parametrize("where", ["eval.scorers=[group_diversity]",
                                   "reward.weights={digit: 1.0, group_diversity: 0.5}"])
def test_diversity_with_one_eval_sample_a_prompt_is_a_warning(where):
    """Issue 27: group_diversity (in eval.scorers, or a reward component, which the eval scores too) with
    eval.samples_per_prompt=1 is NaN at every eval: preflight says so and names the fix; with 2 it is quiet."""
    (warning,) = preflight(load_config(None, [where, "eval.samples_per_prompt=1"]), world_size=1).warnings
    assert "group_diversity is evaluated with eval.samples_per_prompt=1" in warning
    assert "diversity needs eval.samples_per_prompt >= 2" in warning
    assert preflight(load_config(None, [where, "eval.samples_per_prompt=2"]), world_size=1).warnings == ()
    assert preflight(load_config(None, ["eval.samples_per_prompt=1"]), world_size=1).warnings == ()  # not asked for


@pytest.mark.parametrize("algorithm", ["grpo", "grpo_guard", "nft"])
def test_guidance_is_allowed_for_every_objective(algorithm):
    """Replay objectives replay the guided velocity (ratio 1 tested in test_trainer / test_families_loop)."""
    preflight(load_config(None, ["sampler.guidance_scale=4.5", f"train.algorithm={algorithm}"]), world_size=1)


def test_lora_mode_disagreement():
    (p,) = _load_problems("lora.trainable=full", "lora.rank=8")
    assert "lora.trainable='full'" in p
    (p,) = _load_problems("lora.rank=0")
    assert "lora.rank=0 must be >= 1" in p


def test_unknown_reward_component():
    problems = _problems("reward.weights={sharpness: 1.0}", "reward.required=[]")
    assert any("unknown component 'sharpness'" in p and "'digit'" in p for p in problems)


def test_multi_rank_limits_of_group_objectives():
    with pytest.raises(PreflightError) as err:
        preflight(load_config(None, ["train.algorithm=dgpo", "data.prompts_per_step=3", "train.micro_batch_size=4",
                                     "train.num_updates_per_batch=1", "data.group_size=4"]), world_size=2)
    assert "whole groups" in str(err.value)  # 12 candidates / 2 ranks = 6, not a multiple of 4
    preflight(load_config(None, ["train.algorithm=dpo"]), world_size=2)  # ranks that pair fewer rows pad
    preflight(load_config(None, ["train.algorithm=nft", "nft.guard=true"]), world_size=2)
    preflight(load_config(None, ["train.algorithm=dgpo"]), world_size=2)  # 32 / 2 = 16 = 2 groups of 8


def test_prompt_files_are_checked_before_any_model_loads(tmp_path):
    """Prompt files present on this machine are validated with the rest of the config (one error listing all);
    a file absent here is only a warning (a config written for another machine)."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a cat", "metadata": {"task": "t2i"}}\n')
    with pytest.raises(PreflightError) as err:
        preflight(load_config(None, [f"data.prompts={bad}", "model.task=i2v", "model.adapter=wan", "model.frames=5",
                                     "train.algorithm=ppo"]), world_size=1)
    problems = err.value.problems
    assert any(p.startswith("data.prompts: ") and "bad.jsonl:1: field 'metadata.sample_id'" in p for p in problems)
    assert any(p.startswith("data.eval_prompts: record 'demo-eval-t00-d0' has metadata.task='t2i' but "
                            "model.task='i2v' needs records with metadata.task in ['i2v']") for p in problems)
    assert any("train.algorithm" in p for p in problems)  # collected with every other violation
    with pytest.raises(PreflightError, match="is a directory with no train split; give a .txt .* or a dataset "
                                             "directory with train.jsonl .*flowforge data prepare"):
        preflight(load_config(None, [f"data.prompts={tmp_path}"]), world_size=1)
    report = preflight(load_config(None, [f"data.prompts={tmp_path / 'elsewhere.jsonl'}"]), world_size=1,
                       this_machine=False)
    assert any(w.startswith("data.prompts=") and "no such file on this machine" in w for w in report.warnings)


def test_reward_device_is_not_read_and_says_so():
    warnings = preflight(load_config(None, ["reward.device=cuda"]), world_size=1).warnings
    assert len(warnings) == 1 and "reward.device='cuda' is not read" in warnings[0]
    assert "reward.options.<name>.device" in warnings[0]


def test_algorithm_rules_come_from_the_objective_class():
    """Preflight reaches each algorithm's cross-section rules through the registry."""
    from flowforge.objectives import OBJECTIVES

    cfg = load_config(None, ["sampler.sde_kind=ode", "train.algorithm=grpo_guard"])
    expected = OBJECTIVES["grpo_guard"].preflight_problems(cfg, world_size=1)
    assert len(expected) == 1 and "a log-prob objective needs a stochastic kernel" in expected[0]
    assert _problems("sampler.sde_kind=ode", "train.algorithm=grpo_guard") == expected
    assert OBJECTIVES["nft"].preflight_problems(load_config(None, ["sampler.sde_kind=ode"]), world_size=1) == []


# ------------------------------------------------------------------------------------------------ issue 11
def _prompt_file(tmp_path, name, rows):
    import json

    path = tmp_path / name
    path.write_text("".join(json.dumps({"prompt": f"p{i}", "metadata": {"task": "t2i", "sample_id": f"s{i}"}})
                            + "\n" for i in range(rows)))
    return path


def test_unreadable_prompt_files_are_problems_not_absent(tmp_path):
    """Only a file that is not there is "absent" (a warning under this_machine=False): /dev/null, a FIFO, a symlink
    loop, a directory or a non-UTF-8 file is a problem naming the key and the file (the line, for a decoding error)."""
    import os

    loop = tmp_path / "loop.jsonl"
    loop.symlink_to(loop)
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    latin = tmp_path / "latin1.jsonl"
    latin.write_bytes(_prompt_file(tmp_path, "ok.jsonl", 2).read_bytes() + '{"prompt": "café"}\n'.encode("latin-1"))
    for source, text in [("/dev/null", "is not a regular file (a character device)"),
                         (fifo, "is not a regular file (a named pipe)"),
                         (loop, "cannot be read (Too many levels of symbolic links)"),
                         (tmp_path, "is a directory"),
                         (latin, "latin1.jsonl:3: not UTF-8 text (byte 16 of the line is 0xe9)")]:
        (problem,) = _problems(f"data.prompts={source}")
        assert problem.startswith("data.prompts: ") and str(source) in problem and text in problem, problem
    (problem,) = _problems("data.eval_prompts=/dev/null")
    assert problem.startswith("data.eval_prompts: /dev/null: is not a regular file")
    report = preflight(load_config(None, [f"data.prompts={tmp_path / 'absent.jsonl'}"]), world_size=1,
                       this_machine=False)
    assert [w for w in report.warnings if "no such file on this machine" in w]
    (tmp_path / "dangling.jsonl").symlink_to(tmp_path / "absent.jsonl")
    (problem,) = _problems(f"data.prompts={tmp_path / 'dangling.jsonl'}")
    assert problem.endswith(f"dangling.jsonl' is a symlink to '{tmp_path / 'absent.jsonl'}', which does not exist")


def test_prompts_per_step_must_fit_the_prompt_file(tmp_path):
    path = _prompt_file(tmp_path, "three.jsonl", 3)
    (problem,) = _problems(f"data.prompts={path}", "data.prompts_per_step=4", "data.group_size=8")
    assert problem.startswith("data.prompts_per_step=4 is more than the 3 prompts in data.prompts")
    preflight(load_config(None, [f"data.prompts={path}", "data.prompts_per_step=2", "train.micro_batch_size=8"]),
              world_size=1)


@pytest.mark.skipif("__import__('torch').cuda.is_available()", reason="this machine has CUDA")
def test_a_device_this_machine_lacks_is_refused():
    (problem,) = _problems("run.device=cuda")
    assert problem.startswith("run.device='cuda' but this machine has no CUDA device")
    (problem,) = _problems("run.device=gpu")
    assert problem.startswith("run.device='gpu' is not a device") and "cuda:N" in problem
    preflight(load_config(None, ["run.device=cuda"]), world_size=1, this_machine=False)  # a config for elsewhere


def test_sizes_that_would_exhaust_memory_are_refused_with_an_estimate():
    (problem,) = _problems("data.group_size=1000000000", "train.micro_batch_size=8")
    assert problem.startswith("data.prompts_per_step x data.group_size = 4000000000 samples per rank at 32x32")
    assert "GiB" in problem and "RAM" in problem and "lower data.group_size" in problem
    (problem,) = _problems("eval.samples_per_prompt=100000000")
    assert problem.startswith("eval: 6000000000 samples (60 prompts x eval.samples_per_prompt=100000000)")
    preflight(load_config(None, ["data.group_size=1000000000", "train.micro_batch_size=8"]), world_size=1,
              this_machine=False)


def test_model_path_missing_here_is_a_problem_and_an_uncached_hub_id_a_warning(tmp_path, monkeypatch):
    (problem,) = _problems(f"model.path={tmp_path / 'no_model'}")
    assert problem.startswith(f"model.path='{tmp_path / 'no_model'}' does not exist on this machine")
    assert "Hub id (org/name) or demo:base" in problem
    (problem,) = _problems(f"model.path={tmp_path}")
    assert problem.startswith(f"model.path='{tmp_path}' holds neither config.json nor transformer/config.json")
    (tmp_path / "f").write_text("x")
    (problem,) = _problems(f"model.path={tmp_path / 'f'}")
    assert problem.startswith(f"model.path='{tmp_path / 'f'}' is a file")
    (problem,) = _problems("model.path=demo:nope")
    assert problem.startswith("model.path: unknown demo name 'demo:nope'")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # online: training would download it
    warnings = preflight(load_config(None, ["model.path=some-org/some-model"]), world_size=1).warnings
    (warning,) = [w for w in warnings if w.startswith("model.path=")]
    assert "looks like a Hub id that is not in the local Hugging Face cache; training downloads it" in warning
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # offline: training here cannot get it
    (problem,) = _problems("model.path=some-org/some-model")
    assert "HF_HUB_OFFLINE is set" in problem and "hf download some-org/some-model --local-dir DIR" in problem
    # a config for another machine is not checked against this one
    preflight(load_config(None, [f"model.path={tmp_path / 'x'}"]), world_size=1, this_machine=False)


def _fake_hub_cache(root, repo_id):
    """The Hugging Face cache layout of one model snapshot: models--org--name/{refs/main, snapshots/<sha>/}."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    sha = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(sha)
    (repo / "snapshots" / sha).mkdir(parents=True)
    (repo / "snapshots" / sha / "config.json").write_text("{}")
    return repo / "snapshots" / sha


def test_hub_ids_resolve_from_the_cache_and_offline_misses_say_how_to_download(tmp_path, monkeypatch):
    from flowforge.models import build_adapter, looks_like_hub_id, resolve_model_path
    from flowforge.runtime.errors import UserError

    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshot = _fake_hub_cache(tmp_path / "hub", "org/model")
    assert resolve_model_path("org/model") == str(snapshot)
    assert preflight(load_config(None, ["model.path=org/model"]), world_size=1).warnings == ()
    with pytest.raises(UserError) as err:
        resolve_model_path("org/other")
    assert str(err.value) == ("model.path='org/other': a Hub id that is not in the local Hugging Face cache, and "
                              "HF_HUB_OFFLINE=1 forbids downloading it; download it with `hf download org/other "
                              "--local-dir DIR` (older huggingface_hub: `huggingface-cli download org/other "
                              "--local-dir DIR`), then set model.path=DIR")
    with pytest.raises(UserError, match="org/other"):  # what `train` reaches (through build_adapter)
        build_adapter("sd3", "org/other")
    assert [looks_like_hub_id(p) for p in ("org/name", "a.b/c-d_e", "/abs/x", "./a/b", "a/b/c", "demo:base",
                                           "a--b/c", "a/..b", str(tmp_path))] == [True, True] + [False] * 7
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)  # a path on disk is a path


def test_unknown_scorer_options_and_distributed_dtypes_name_the_key():
    problems = _problems("reward.options={digit: {foo: 1, bar: 2}}", "distributed.param_dtype=fp8")
    assert "reward.options.digit: unknown options ['bar', 'foo']; allowed: ['model', 'batch_size', 'cap']" in problems
    assert "distributed.param_dtype='fp8' is not one of ['float32', 'bfloat16', 'float16']" in problems


def test_directories_that_are_files_are_refused(tmp_path):
    a_file = tmp_path / "f"
    a_file.write_text("x")
    problems = _problems(f"run.output_dir={a_file}", f"data.cache_dir={a_file}")
    assert f"run.output_dir: {a_file} is a file, not a directory; choose another run.output_dir" in problems
    assert any(p.startswith("data.cache_dir: ") for p in problems)


# ------------------------------------------------------------------------------------------------ after loading
@pytest.fixture(scope="module")
def tiny_adapter(tiny_model_dir):
    from flowforge.models import build_adapter

    return build_adapter("sd3", str(tiny_model_dir))


def _loaded_problems(adapter, *overrides):
    from flowforge.runtime.errors import UserError
    from flowforge.train.preflight import check_loaded_model

    with pytest.raises(UserError) as err:
        check_loaded_model(load_config(None, list(overrides)), adapter, world_size=1)
    assert err.value.what == "after loading model.path='demo:base'"
    return err.value.why


def test_after_loading_targets_and_sizes_are_checked(tiny_adapter):
    from flowforge.train.preflight import check_loaded_model

    check_loaded_model(load_config(None, []), tiny_adapter)  # the defaults fit
    check_loaded_model(load_config(None, ["lora.targets=[attn.to_q, to_v]"]), tiny_adapter)
    why = _loaded_problems(tiny_adapter, "lora.targets=[attn.to_q, to_qq]")
    assert why.startswith("lora.targets entry 'to_qq' matches no module of SD3Transformer2DModel; the adapter's "
                          "default targets are [")
    why = _loaded_problems(tiny_adapter, "lora.targets=[attn]")
    assert "lora.targets entry 'attn' matches only ['Attention'] modules" in why and "Linear" in why
    why = _loaded_problems(tiny_adapter, "model.height=30", "model.width=32")
    assert why.startswith("model.height=30 / model.width=32 do not fit this model: height and width must be "
                          "positive multiples of 4")
    why = _loaded_problems(tiny_adapter, "lora.targets=[nope]", "model.width=31")  # every problem at once
    assert "model.width=31" in why and "'nope'" in why


def test_after_loading_memory_uses_the_real_latent_and_lora_sizes(tiny_adapter, monkeypatch):
    from flowforge.objectives import trained_steps_for
    from flowforge.train.preflight import loaded as pf

    cfg = load_config(None, ["lora.rank=4"])
    layers = pf._target_problems(cfg, tiny_adapter, [])
    assert layers and all(hasattr(m, "in_features") for m in layers)
    need = pf.loaded_memory_bytes(cfg, (1, 32, 32), layers, 1)
    stored = len(trained_steps_for(cfg.sampler, 0, 0))
    lora = sum(4 * (m.in_features + m.out_features) for m in layers) * 16
    assert need == 32 * 1024 * 4 * (1 + 2 * stored) + 32 * 1024 * 4 + lora
    monkeypatch.setattr(pf, "memory_limit", lambda device, available=False: (need - 1, "available RAM"))
    why = _loaded_problems(tiny_adapter, "lora.rank=4")
    assert why.startswith("one step needs at least") and "latents [1, 32, 32]" in why and "available RAM" in why


def test_an_explicit_resume_path_must_be_a_committed_checkpoint(tmp_path):
    (problem,) = _problems(f"train.resume={tmp_path / 'gone'}")
    assert problem.startswith(f"train.resume='{tmp_path / 'gone'}': {tmp_path / 'gone'} does not exist")
    (problem,) = _problems(f"train.resume={tmp_path}")
    assert "has no COMMITTED marker" in problem and "train.resume=auto" in problem
    (tmp_path / "COMMITTED").write_text("{}")  # the files' checksums are verified when training resumes
    preflight(load_config(None, [f"train.resume={tmp_path}"]), world_size=1)
    preflight(load_config(None, ["train.resume=auto"]), world_size=1)


WORLD_EXAMPLE = "examples/worldmodel/nft.yaml"


@pytest.mark.parametrize("modules, why", [
    ("[latent_state_rollout.transitionX]", "are not submodules of WorldModel"),
    ("[blocks.0,blocks.0.coupling]", "repeat or contain one another"),
])
def test_module_paths_checked_before_the_model_loads(modules, why, monkeypatch):
    import pathlib

    import flowforge.models.world_model.adapter as wm

    monkeypatch.setattr(wm, "load_world_model", lambda *a, **k: pytest.fail("preflight loaded the model"))
    example = pathlib.Path(__file__).resolve().parents[2] / WORLD_EXAMPLE
    with pytest.raises(PreflightError, match=f"lora.modules: .*{why}"):
        preflight(load_config(example, [f"lora.modules={modules}"]), world_size=1)
    preflight(load_config(example, []), world_size=1)  # the example's own paths pass


def test_module_paths_of_a_diffusers_base():
    with pytest.raises(PreflightError, match="lora.modules: .*not submodules of SD3Transformer2DModel"):
        preflight(load_config(None, ["lora.trainable=module", "lora.modules=[transformer_blocks.99]"]), world_size=1)
    preflight(load_config(None, ["lora.trainable=module", "lora.modules=[transformer_blocks.0]"]), world_size=1)


def test_module_mode_with_another_familys_tree_is_not_a_crash(tmp_path):
    """world_model adapter over a diffusers base: the meta-device tree has no world-model blocks; preflight must not
    crash on it (the load names the mismatch)."""
    preflight(load_config(None, ["model.adapter=world_model", "model.task=i2v", "model.frames=5",
                                 "lora.trainable=module", "lora.modules=[transformer_blocks.0]",
                                 "data.prompts=demo:world-train", "data.eval_prompts=demo:world-eval"]), world_size=1)


def test_an_eval_only_scorer_takes_its_options_and_options_must_name_a_scorer():
    """A held-out judge (the reward-hacking guard's, the multi-reward recipes') is an eval-only scorer that needs its
    own options (model paths); options naming neither a component nor an eval scorer are refused, naming both."""
    judge = ("eval.scorers=[jpeg_incompressibility]", "reward.options={jpeg_incompressibility: {quality: 80}}")
    preflight(load_config(None, list(judge)), world_size=1)  # raises PreflightError on a problem
    problems = _problems("eval.scorers=[jpeg_incompressibility]", "reward.options={jpeg_incompressibility: "
                         "{qualty: 80}, jpeg_compressibility: {quality: 80}}")
    text = "\n".join(problems)
    assert len(problems) == 2, problems
    assert "reward.options.jpeg_incompressibility: unknown option ['qualty']; allowed: ['quality']" in text
    assert ("reward.options.jpeg_compressibility: neither a weighted component nor an eval scorer; allowed: "
            "['digit', 'jpeg_incompressibility']") in text
