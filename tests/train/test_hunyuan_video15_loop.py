"""HunyuanVideo 1.5 on the real training loop (``flowforge.train.trainer.Trainer``): the tiny random t2v and i2v
pipelines (tests/models/tiny_hunyuan_video15.py) saved with ``save_pretrained`` and loaded through
``model.adapter=hunyuan_video15`` with the loader's defaults (the pipeline's 1000 Qwen tokens, 256 ByT5 tokens);
a 2-step LoRA run per algorithm checks GRPO's first ratio is exactly 1 (true CFG: two forwards, replayed as such)
and NFT's forward process runs, on the pipeline's own schedule (``sampler.schedule=dynamic``)."""
from __future__ import annotations

import pytest
import torch

from tests.models import tiny_families as tiny
from tests.models import tiny_hunyuan_video15 as tiny_hv
from tests.train.test_families_loop import (  # noqa: F401 (fixture)
    EXTRA_WORDS,
    image_prompt_files,
    prompt_files,
    train_and_check,
)

SIZE, FRAMES = (16, 16), 5


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def hv_dirs(tmp_path_factory):
    import diffusers

    dirs = {}
    for task, cls in (("t2v", "HunyuanVideo15Pipeline"), ("i2v", "HunyuanVideo15ImageToVideoPipeline")):
        mp = pytest.MonkeyPatch()
        mp.setattr(tiny, "WORDS", list(tiny.WORDS) + EXTRA_WORDS)  # > 1000 tokens: passes the loaders' guard
        try:
            parts = tiny_hv.components(0, i2v=task == "i2v")
        finally:
            mp.undo()
        path = tmp_path_factory.mktemp(f"tiny_hv15_{task}")
        getattr(diffusers, cls)(**parts).save_pretrained(str(path))
        dirs[task] = path
    return dirs


@pytest.mark.slow  # 15-30 s of training on 2 cores: CI runs it in the slow set (the default run stays near 10 min)
@pytest.mark.parametrize("task,algorithm", [("t2v", "grpo"), ("t2v", "nft"), ("i2v", "grpo")])
def test_hunyuan_video15_trains_on_the_real_loop(task, algorithm, hv_dirs, prompt_files, tmp_path):
    from flowforge.config import load_config
    from flowforge.train.trainer import Trainer

    prompts = prompt_files if task == "t2v" else image_prompt_files(tmp_path, "i2v", seed=4)
    guidance = 5.0 if algorithm == "grpo" else 1.0
    cfg = load_config(None, [
        "model.adapter=hunyuan_video15", f"model.path={hv_dirs[task]}", f"model.height={SIZE[0]}",
        f"model.width={SIZE[1]}", f"model.frames={FRAMES}", f"model.task={task}",
        f"run.output_dir={tmp_path / 'runs'}", f"data.cache_dir={tmp_path / 'cache'}",
        f"data.prompts={prompts[task, 'train']}", f"data.eval_prompts={prompts[task, 'eval']}",
        "data.prompts_per_step=2", "data.group_size=4", "sampler.num_steps=4", "sampler.num_sde_steps=2",
        "sampler.schedule=dynamic", "train.micro_batch_size=2", "train.num_updates_per_batch=2", "train.steps=2",
        "train.lr=1e-2", "grpo.clip_low=1e-3", "eval.max_prompts=2", "eval.every=0",
        "reward.weights={jpeg_compressibility: 1.0}", f"run.name=hv15-{task}-{algorithm}",
        f"train.algorithm={algorithm}", f"sampler.guidance_scale={guidance}", "forward.sigma_mode=uniform_schedule"])
    trainer = Trainer(cfg, progress=False)
    assert type(trainer.adapter).__name__ == "HunyuanVideo15Adapter" and trainer.adapter.task == task
    assert torch.equal(trainer.sigmas, trainer.adapter.pipeline_sigmas(4, *SIZE))  # the pipeline's own grid
    assert trainer.train_cond.prompt_embeds.shape[1] == 1000 + 256  # Qwen tokens after the template + ByT5
    if task == "i2v":
        sb = trainer.next_prompts()
        cond = trainer._conditioning(trainer.train_cond, trainer.train_prompts, sb.prompt_indices)
        assert cond.image.shape == (len(sb.prompt_indices), 5, 3, 4, 4) and cond.pooled.shape[1] == 16 * 12
    train_and_check(trainer, algorithm)
