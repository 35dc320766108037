"""A rollout worker under ``lora.trainable: module+lora`` (in this process, demo:world): it holds the trained
submodule in fp32 and the coupling LoRA, takes a ``full`` sync of exactly the policy bank's live tensors (both
kinds), and then computes the trainer's velocity bit for bit; an ``adapter`` sync is refused by preflight."""

import pytest
import torch

from flowforge.config import load_config
from flowforge.demo.paths import resolve_demo_path
from flowforge.models import build_adapter
from flowforge.policy import OptimizerSettings, Policy, TrainableWeights
from flowforge.rollout.engine.weight_sync import WeightSyncError, iter_buckets, make_manifest
from flowforge.rollout.engine.worker import RolloutWorker
from flowforge.train.preflight import PreflightError, preflight
from flowforge.train.rollout_workers import worker_recipe
from tests.train.test_world_model_module_lora import MODULE_LORA
from tests.train.test_world_model_train import EXAMPLE


def _velocity(adapter):
    g = torch.Generator().manual_seed(3)
    prompts = ["LEFT LEFT RIGHT NOOP NOOP LEFT RIGHT RIGHT", "NOOP RIGHT RIGHT RIGHT LEFT LEFT NOOP NOOP"]
    shape = adapter.latent_shape(32, 32, 8)
    cond = adapter.condition_on_images(adapter.encode(prompts), prompts, torch.rand(2, 3, 32, 32, generator=g), shape)
    with torch.no_grad():
        return adapter.velocity(torch.randn(2, *shape, generator=g), torch.tensor([0.3, 0.8]), cond, 1.0)


def test_module_lora_worker_takes_both_kinds_and_matches_the_trainer():
    cfg = load_config(EXAMPLE, [*MODULE_LORA, "rollout.engine=workers"])
    assert cfg.rollout.sync_mode(cfg.lora.trainable) == "full"
    adapter = build_adapter("world_model", resolve_demo_path(cfg.model.path))
    policy = Policy(adapter, TrainableWeights.from_section(cfg.lora), OptimizerSettings.from_section(cfg.train), 10)
    with torch.no_grad():  # move live away from the base: both kinds
        for p in policy.params:
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    recipe = worker_recipe(cfg, policy, "cpu")
    assert recipe.trainable == "module+lora" and recipe.lora_targets and recipe.modules
    worker = RolloutWorker(recipe)
    weights = policy.named_weights("live")
    assert set(worker.targets()) == set(weights)  # the submodule's entries and the LoRA tensors
    assert any(".lora_B." in k for k in weights) and any(k.startswith(recipe.modules[0] + ".") for k in weights)
    with pytest.raises(WeightSyncError, match="takes only 'full' syncs"):
        worker.sync_begin(make_manifest(weights, version=0, mode="adapter", bucket_bytes=1 << 16))
    manifest = make_manifest(weights, version=0, mode="full", bucket_bytes=1 << 16)
    worker.sync_begin(manifest)
    for i, data in enumerate(iter_buckets(weights, manifest)):
        worker.sync_bucket(i, data)
    worker.sync_verify()
    assert worker.sync_commit() == 0
    assert torch.equal(_velocity(worker.adapter), _velocity(adapter))


def test_an_adapter_sync_contradicts_module_lora():
    cfg = load_config(EXAMPLE, [*MODULE_LORA, "rollout.engine=workers", "rollout.weight_sync=adapter"])
    with pytest.raises(PreflightError, match="contradicts lora.trainable='module\\+lora' \\(the workers receive every "
                                             "trained tensor"):
        preflight(cfg, world_size=1, this_machine=False)
