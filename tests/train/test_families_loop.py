"""Every model family on the real training loop (``flowforge.train.trainer.Trainer``), exported, and preflight's task
check.

Each family's tiny random pipeline (tests/models/tiny_families.py; SD3 is the conftest's tiny pixel-space model) is
saved with ``save_pretrained`` and loaded by the trainer through ``model.adapter=<family>``, ``model.path=<dir>``.
The word-level test tokenizers are widened past 1000 tokens so the loaders' placeholder-tokenizer guard
(``DEFAULT_MIN_TOKENIZER_SIZE``) runs unchanged: the trainer passes no loader options.
"""
from __future__ import annotations

import json

import pytest
import torch

from flowforge.config import load_config
from tests.models import tiny_families as tiny

FAMILIES = ["sd3", "flux", "qwen_image", "wan"]
PIPELINES = {"flux": "FluxPipeline", "qwen_image": "QwenImagePipeline", "wan": "WanPipeline"}
# (height, width, frames) the tiny VAEs support; FLUX / Qwen-Image VAEs downsample 2x, Wan 8x spatially, 4x in time
SIZES = {"sd3": (32, 32, None), "flux": (16, 16, None), "qwen_image": (16, 16, None), "wan": (16, 16, 5)}
EXTRA_WORDS = [f"w{i}" for i in range(1000)]


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _components(family: str, seed: int = 0, **kw) -> dict:
    mp = pytest.MonkeyPatch()
    mp.setattr(tiny, "WORDS", list(tiny.WORDS) + EXTRA_WORDS)  # > 1000 tokens: passes the loaders' guard
    try:
        return {"flux": tiny.flux_components, "qwen_image": tiny.qwen_components,
                "wan": tiny.wan_components}[family](seed, **kw)
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, tiny_model_dir):
    """``family -> saved pipeline directory`` (SD3: the conftest's tiny transformer directory)."""
    import diffusers

    dirs = {"sd3": tiny_model_dir}
    for family, cls in PIPELINES.items():
        path = tmp_path_factory.mktemp(f"tiny_{family}")
        getattr(diffusers, cls)(**_components(family)).save_pretrained(str(path))
        dirs[family] = path
    return dirs


@pytest.fixture(scope="module")
def prompt_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("prompts")
    words = ["a red cat", "two dogs under a tree", "a blue car on a road", "a small boat on the sea",
             "a white bird in the sky", "an old house"]
    files = {}
    for task in ("t2i", "t2v"):
        for split, chosen in (("train", words[:4]), ("eval", words[4:])):
            f = root / f"{task}_{split}.jsonl"
            f.write_text("".join(json.dumps({"prompt": p, "metadata": {"task": task, "sample_id": f"{split}{i}"}})
                                 + "\n" for i, p in enumerate(chosen)))
            files[task, split] = f
    return files


def family_cfg(family, model_dir, out_dir, cache_dir, prompts, *extra, task=None):
    h, w, frames = SIZES[family]
    task = task or ("t2v" if family == "wan" else "t2i")
    schedule = {"flux": "dynamic", "qwen_image": "dynamic", "wan": "wan"}.get(family, "static")
    return load_config(None, [
        f"model.adapter={family}", f"model.path={model_dir}", f"model.height={h}", f"model.width={w}",
        f"model.frames={'null' if frames is None else frames}", f"model.task={task}",
        f"run.output_dir={out_dir}", f"data.cache_dir={cache_dir}",
        f"data.prompts={prompts[task, 'train']}", f"data.eval_prompts={prompts[task, 'eval']}",
        "data.prompts_per_step=2", "data.group_size=4", "sampler.num_steps=4", "sampler.num_sde_steps=2",
        f"sampler.schedule={schedule}", "train.micro_batch_size=2", "train.num_updates_per_batch=2",
        "train.steps=2", "train.lr=1e-2", "grpo.clip_low=1e-3", "eval.max_prompts=2", "eval.every=0",
        "reward.weights={jpeg_compressibility: 1.0}", *extra])


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


GUIDANCE = {"sd3": 4.5, "flux": 3.5, "qwen_image": 4.0, "wan": 5.0}
"""GRPO runs sample with guidance: true CFG (two forwards, replayed as such) for SD3 / Qwen-Image / Wan, the
distilled guidance embedding (one forward) for FLUX.1-dev; the first ratio must still be exactly 1."""


@pytest.mark.parametrize("algorithm", ["grpo", "nft"])
@pytest.mark.parametrize("family", FAMILIES)
def test_family_trains_on_the_real_loop(family, algorithm, family_dirs, prompt_files, tmp_path):
    run_loop(family, algorithm, family_dirs, prompt_files, tmp_path)


def run_loop(family, algorithm, family_dirs, prompt_files, tmp_path):
    from flowforge.train.trainer import Trainer

    guidance = GUIDANCE[family] if algorithm == "grpo" else 1.0
    cfg = family_cfg(family, family_dirs[family], tmp_path / "runs", tmp_path / "cache", prompt_files,
                     f"run.name={family}-{algorithm}", f"train.algorithm={algorithm}",
                     f"sampler.guidance_scale={guidance}")
    trainer = Trainer(cfg, progress=False)
    assert type(trainer.adapter).__module__ == f"flowforge.models.{family}.adapter"
    if family in ("flux", "qwen_image"):  # dynamic schedule: the family pipeline's own sigmas
        torch.testing.assert_close(trainer.sigmas, trainer.adapter.pipeline_sigmas(4, *SIZES[family][:2]))
    train_and_check(trainer, algorithm)


def train_and_check(trainer, algorithm):
    """Run the trainer's 2 steps and check the run: metrics present and finite, the first ratio exactly 1 (GRPO),
    the LoRA moved, evals at steps 0 and 2, a sample grid and the report. Returns the run directory."""
    before = {k: v.detach().clone() for k, v in trainer.adapter.transformer.named_parameters() if v.requires_grad}
    assert before and all("lora" in k for k in before)
    run_dir = trainer.train()
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        for key in ("train/loss", "train/grad_norm", "reward/jpeg_compressibility_mean", "reward/total_mean",
                    "train/diversity"):
            assert key in row and row[key] == row[key], (key, row.get(key))  # present and not NaN
    if algorithm == "grpo":
        assert rows[0]["train/first_update_ratio_dev"] == 0.0
    after = dict(trainer.adapter.transformer.named_parameters())
    assert max(float((after[k].detach() - v).abs().max()) for k, v in before.items()) > 0  # the LoRA moved
    evals = read_jsonl(run_dir / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 2]
    assert (run_dir / "samples" / "step_000002.png").is_file() and (run_dir / "report.html").is_file()
    return run_dir


def image_prompt_files(root, task, seed=0):
    """``{(task, split): prompt file}`` under ``root`` for an image task: every record names its own random
    16x16 condition image by a path relative to the prompt file."""
    import numpy as np
    from PIL import Image

    (root / "images").mkdir()
    rng = np.random.default_rng(seed)
    files = {}
    splits = (("train", ["a red cat", "two dogs", "a blue car", "a boat"]), ("eval", ["a bird", "a house"]))
    for split, prompts in splits:
        rows = []
        for i, prompt in enumerate(prompts):
            name = f"images/{split}{i}.png"
            Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(root / name)
            rows.append({"prompt": prompt, "metadata": {"task": task, "sample_id": f"{split}{i}", "image": name}})
        files[task, split] = root / f"{split}.jsonl"
        files[task, split].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return files


# ------------------------------------------------------------------------------------------------ export
RANK, ALPHA = 4, 8


def probe(trainer, adapter=None):
    """Velocities of ``adapter`` (default: the trainer's policy as it stands) on seeded latents, two training
    prompts' conditioning and ``sigma = [0.2, 0.7]``."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, *trainer.latent_shape, generator=g)
    with torch.no_grad():
        return (adapter or trainer.adapter).velocity(x, torch.tensor([0.2, 0.7]), trainer.train_cond.index([0, 1]),
                                                     1.0)


@pytest.fixture(scope="module", params=FAMILIES)
def lora_run(request, family_dirs, prompt_files, tmp_path_factory):
    """A 2-step GRPO LoRA run (rank 4, alpha 8, checkpoint every step) of each family; the trained and base policies'
    probe velocities from the trainer's in-memory model."""
    from flowforge.train.trainer import Trainer

    family = request.param
    out = tmp_path_factory.mktemp(f"export_{family}")
    cfg = family_cfg(family, family_dirs[family], out / "runs", out / "cache", prompt_files, "run.name=lora",
                     f"lora.rank={RANK}", f"lora.alpha={ALPHA}", "checkpoint.every=1")
    trainer = Trainer(cfg, progress=False)
    run_dir = trainer.train()
    with trainer.policy.using("live"):
        trained = probe(trainer)
    with trainer.policy.using("ref"):
        base = probe(trainer)
    assert (trained - base).abs().max() > 1e-4  # training moved the model: the comparisons below are not vacuous
    return family, run_dir, trainer, trained, base


def _pipeline(family, path):
    import diffusers

    if family == "sd3":  # the tiny SD3 is a bare pixel-space transformer: a pipeline around it, no VAE / encoders
        # a merged export of a MiniLM demo-style base is a pipeline directory with the transformer in transformer/
        sub = path / "transformer" if (path / "transformer").is_dir() else path
        t = diffusers.SD3Transformer2DModel.from_pretrained(str(sub), local_files_only=True)
        return diffusers.StableDiffusion3Pipeline(
            transformer=t.eval(), scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=None, text_encoder=None,
            tokenizer=None, text_encoder_2=None, tokenizer_2=None, text_encoder_3=None, tokenizer_3=None)
    return getattr(diffusers, PIPELINES[family]).from_pretrained(str(path), local_files_only=True)


def _generate(family, pipe):
    """The diffusers pipeline's own output (fixed generator) as float32; ``None`` for the bare SD3 transformer."""
    if family == "sd3":
        return None
    h, w, frames = SIZES[family]
    kw = dict(num_frames=frames) if family == "wan" else {}
    with torch.no_grad():
        out = pipe(prompt=["a red cat"], height=h, width=w, num_inference_steps=2, output_type="pt",
                   generator=torch.Generator().manual_seed(0), max_sequence_length=16, **kw)
    return (out.frames if family == "wan" else out.images).float()


def test_adapter_export_loads_into_the_family_pipeline(lora_run, family_dirs, tmp_path):
    from flowforge.tools.export import export_run, read_export_meta

    family, run_dir, trainer, trained, base = lora_run
    out = export_run(run_dir, tmp_path / "lora", form="adapter", verify=True)
    report = read_export_meta(out)["verify"]
    assert report["passed"] and report["max_abs_diff"] <= 1e-5 and report["base_diff"] > 1e-4

    pipe = _pipeline(family, family_dirs[family])
    before = _generate(family, pipe)
    pipe.load_lora_weights(str(out))
    (config,) = pipe.transformer.peft_config.values()
    assert (config.r, config.lora_alpha) == (RANK, ALPHA)
    v = probe(trainer, type(trainer.adapter)(pipe.transformer.eval()))
    assert (v - trained).abs().max() <= 1e-5  # the pipeline's LoRA is the trained policy (alpha honoured) ...
    assert (v - base).abs().max() > 1e-4  # ... and not the base
    if before is not None:
        after = _generate(family, pipe)
        assert after.shape == before.shape and (after - before).abs().max() > 1e-6


def test_merged_export_loads_with_from_pretrained(lora_run, family_dirs, tmp_path):
    from flowforge.tools.export import export_run, read_export_meta

    family, run_dir, trainer, trained, base = lora_run
    out = export_run(run_dir, tmp_path / "merged", form="merged", verify=True)
    assert read_export_meta(out)["verify"]["passed"]
    pipe = _pipeline(family, out)
    assert not any("lora" in k for k in pipe.transformer.state_dict())
    v = probe(trainer, type(trainer.adapter)(pipe.transformer.eval()))
    tol = 1e-4 * max(1.0, float(trained.abs().max()))
    assert (v - trained).abs().max() <= tol and (v - base).abs().max() > 1e-4


# ------------------------------------------------------------------------------------------------ preflight tasks
class _AdapterMethods:
    """The required methods of a FlowModel adapter class (preflight refuses a class without them); never called."""

    def blocks(self): ...
    def encode(self, prompts): ...
    def latent_shape(self, height, width, frames=None): ...
    def velocity(self, x, sigma, cond, guidance_scale): ...
    def decode(self, latents): ...


class VideoOnlyAdapter(_AdapterMethods):
    """A bring-your-own adapter class that declares the tasks it runs (never instantiated here)."""

    tasks = ("t2v",)


class UndeclaredAdapter(_AdapterMethods):
    """A bring-your-own adapter class without a ``tasks`` declaration."""


class OldStyleLoader:
    """A bring-your-own factory written before loaders received ``task`` (never a real adapter)."""

    def __init__(self, path, *, dtype=None, device=None):
        self.args = (path, dtype, device)


class NewStyleLoader(OldStyleLoader):
    def __init__(self, path, *, task="t2i", **kw):
        super().__init__(path, **kw)
        self.task = task


def test_bring_your_own_factory_gets_task_only_if_it_takes_it(monkeypatch):
    import flowforge.models.registry as models  # build_adapter's module: the FlowModel it checks against

    monkeypatch.setattr(models, "FlowModel", object)  # these stand-ins are not FlowModels; only the call matters
    old = models.build_adapter("tests.train.test_families_loop:OldStyleLoader", "p", task="i2v", dtype="d", device="c")
    assert old.args == ("p", "d", "c")
    new = models.build_adapter("tests.train.test_families_loop:NewStyleLoader", "p", task="i2v", dtype="d", device="c")
    assert new.task == "i2v" and new.args == ("p", "d", "c")


class ImageTaskWithoutEncoder(_AdapterMethods):
    """Declares i2v but has no ``condition_on_images``."""

    tasks = ("i2v",)


ELSEWHERE = ("data.prompts=/elsewhere/train.jsonl", "data.eval_prompts=/elsewhere/eval.jsonl")
"""Prompt files of another machine: a portable preflight only warns (the demo prompts are t2i records, refused for
i2i / i2v)."""


def _preflight(*overrides):
    from flowforge.train.preflight import preflight

    return preflight(load_config(None, [*ELSEWHERE, *overrides]), world_size=1, this_machine=False)


def _task_problems(*overrides):
    from flowforge.train.preflight import PreflightError

    with pytest.raises(PreflightError) as err:
        _preflight(*overrides)
    return err.value.problems


def test_adapter_class_registry_declares_tasks_without_loading_weights():
    from flowforge.models import ADAPTER_CLASSES, ADAPTERS, adapter_class, adapter_tasks

    assert sorted(ADAPTER_CLASSES) == sorted(ADAPTERS)
    for name in ADAPTER_CLASSES:
        assert adapter_class(name).__module__.startswith(f"flowforge.models.{name}")
    tasks = {n: adapter_tasks(n) for n in ADAPTER_CLASSES}
    expected = {"sd3": ("t2i",), "flux": ("t2i", "i2i"), "qwen_image": ("t2i", "i2i"), "wan": ("t2v", "i2v"),
                "world_model": ("i2v",), "z_image": ("t2i",), "flux2": ("t2i", "i2i")}
    assert {n: tasks[n] for n in expected} == expected
    assert all(isinstance(t, tuple) and t for t in tasks.values())  # families added later declare theirs too
    assert adapter_tasks("tests.train.test_families_loop:VideoOnlyAdapter") == ("t2v",)
    assert adapter_tasks("tests.train.test_families_loop:UndeclaredAdapter") is None
    with pytest.raises(ValueError, match="allowed"):
        adapter_class("nope")


@pytest.mark.parametrize("adapter,task,frames", [("flux", "t2v", 5), ("qwen_image", "t2v", 5), ("sd3", "t2v", 5),
                                                 ("wan", "t2i", None),
                                                 ("tests.train.test_families_loop:VideoOnlyAdapter", "t2i", None)])
def test_preflight_rejects_a_task_the_adapter_cannot_run(adapter, task, frames):
    from flowforge.models import adapter_tasks

    problems = _task_problems(f"model.adapter={adapter}", f"model.task={task}",
                              f"model.frames={'null' if frames is None else frames}")
    assert problems == [f"model.task={task!r}: model.adapter={adapter!r} runs only "
                        f"{list(adapter_tasks(adapter))}"]


@pytest.mark.parametrize("adapter,task,frames", [("sd3", "t2i", None), ("flux", "t2i", None), ("flux", "i2i", None),
                                                 ("qwen_image", "i2i", None), ("wan", "t2v", 5),
                                                 ("tests.train.test_families_loop:VideoOnlyAdapter", "t2v", 5)])
def test_preflight_accepts_a_task_the_adapter_runs(adapter, task, frames):
    report = _preflight(f"model.adapter={adapter}", f"model.task={task}",
                        f"model.frames={'null' if frames is None else frames}")
    assert not any("model.task" in w for w in report.warnings)


def test_preflight_task_check_edges():
    # i2v: Wan runs it; a class that declares i2v but cannot encode condition images is refused
    _preflight("model.adapter=wan", "model.task=i2v", "model.frames=5")
    assert "the first frame is the condition image" in _task_problems("model.adapter=wan", "model.task=i2v",
                                                                       "model.frames=1")[0]
    (problem,) = _task_problems("model.adapter=tests.train.test_families_loop:ImageTaskWithoutEncoder",
                                "model.task=i2v", "model.frames=5")
    assert "has no condition_on_images" in problem
    # frames must match the task
    assert _task_problems("model.adapter=wan", "model.task=t2v") == [
        "model.task='t2v' needs model.frames (e.g. 81 for Wan)"]
    assert _task_problems("model.adapter=sd3", "model.task=t2i", "model.frames=5")[0].startswith("model.frames=5")
    # unknown / unimportable adapters are reported, a class without `tasks` only warned about
    assert "unknown model adapter 'nope'" in _task_problems("model.adapter=nope")[0]
    assert "adapter 'no_such_pkg.mod:Cls': no module 'no_such_pkg.mod' in the working directory" in \
        _task_problems("model.adapter=no_such_pkg.mod:Cls")[0]
    report = _preflight("model.adapter=tests.train.test_families_loop:UndeclaredAdapter")
    assert any("declares no class-level `tasks`" in w for w in report.warnings)
