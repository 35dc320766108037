"""The rollout section: its own values at load, its rules across sections in preflight, the default untouched."""

import importlib.util
import subprocess
import sys

import pytest

from flowforge.config import ConfigError, dump_config, load_config
from flowforge.settings.rollout import RolloutConfig
from flowforge.train.preflight import PreflightError, preflight


def test_default_is_the_local_engine_and_is_dumped():
    cfg = load_config(None, [])
    assert cfg.rollout == RolloutConfig() and cfg.rollout.engine == "local"
    assert "rollout:\n  engine: local\n" in dump_config(cfg)


def test_bad_values_are_refused_at_load_together():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["rollout.engine=server", "rollout.num_workers=0", "rollout.backend=dask",
                           "rollout.weight_sync=merged", "rollout.sync_bucket_mb=0", "rollout.threads=-1"])
    assert err.value.problems == [
        "rollout.engine='server' is not one of ['local', 'workers']",
        "rollout.backend='dask' is not one of ['process', 'ray']",
        "rollout.weight_sync='merged' is not one of ['auto', 'adapter', 'full']",
        "rollout.num_workers=0 must be > 0", "rollout.sync_bucket_mb=0.0 must be > 0", "rollout.threads=-1 must be > 0"]


@pytest.mark.parametrize("overrides,mode", [([], "adapter"), (["lora.trainable=full"], "full")])
def test_sync_mode_follows_lora_trainable(overrides, mode):
    cfg = load_config(None, ["rollout.engine=workers", *overrides])
    assert cfg.rollout.sync_mode(cfg.lora.trainable) == mode
    assert preflight(cfg, world_size=1, this_machine=False).warnings == ()


@pytest.mark.parametrize("overrides,message", [
    (["rollout.weight_sync=full"], "rollout.weight_sync='full' contradicts lora.trainable='lora' (the workers hold "
                                   "LoRA layers"),
    (["rollout.weight_sync=adapter", "lora.trainable=full"], "rollout.weight_sync='adapter' contradicts "
                                                             "lora.trainable='full'"),
])
def test_a_sync_mode_that_contradicts_lora_trainable_is_a_preflight_error(overrides, message):
    cfg = load_config(None, ["rollout.engine=workers", *overrides])
    with pytest.raises(PreflightError, match=message.replace("(", r"\(")):
        preflight(cfg, world_size=1, this_machine=False)
    # under the local engine nothing is synced: nothing to contradict
    preflight(load_config(None, [*overrides]), world_size=1, this_machine=False)


@pytest.mark.skipif(importlib.util.find_spec("ray") is not None, reason="Ray is installed here")
def test_ray_backend_without_ray_is_refused_by_flowforge_check():
    out = subprocess.run([sys.executable, "-m", "flowforge.cli", "check", "examples/digits/grpo.yaml",
                          "rollout.engine=workers", "rollout.backend=ray"], capture_output=True, text=True)
    assert out.returncode == 2, out.stderr
    assert "rollout.backend='ray' but Ray is not installed; pip install 'flowforge[ray]'" in out.stderr
    assert "Traceback" not in out.stderr
