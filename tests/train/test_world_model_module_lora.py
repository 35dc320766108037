"""``lora.trainable: module+lora`` on the world model (demo:world, the real training loop): the transition module B
in full and LoRA on the coupling attention's q / k / v / out of every block in the same run. One step of NFT and
GRPO changes exactly those tensors (GRPO's first ratio exactly 1), both anchors reach both kinds, the run resumes
bit-exactly, and the configs that would train a weight twice are refused in one line."""

import pytest
import torch

from flowforge.runtime.errors import UserError
from flowforge.train.preflight import PreflightError
from tests.cli.harness import assert_one_line_error, run_cli
from tests.train.test_world_model_train import EXAMPLE, _metrics, _trainer, straight_and_resumed

B = "latent_state_rollout.transition"
MODULE_LORA = ["lora.trainable=module+lora", f"lora.modules=[{B}]", "lora.rank=8", "lora.alpha=16"]
COUPLING = {f"blocks.{i}.coupling.{n}" for i in range(4) for n in ("q", "k", "v", "out")}


def _is_b(name):
    return name.startswith(B + ".")


def _lora_layer(name, adapter="default"):
    """The coupling layer of a LoRA tensor of ``adapter`` (``blocks.0.coupling.q.lora_A.default.weight``), else None."""
    for kind in ("lora_A", "lora_B"):
        marker = f".{kind}.{adapter}."
        if marker in name:
            return name.split(marker)[0]
    return None


@pytest.mark.parametrize("algorithm", ["nft", "grpo"])
def test_one_step_changes_exactly_b_and_the_coupling_lora(tmp_path, encode_cache_dir, algorithm):
    trainer = _trainer(tmp_path, encode_cache_dir, algorithm, *MODULE_LORA, "anchor.fm_weight=0.1",
                       "anchor.trans_weight=0.01")
    t = trainer.adapter.transformer
    trained = {n for n, p in t.named_parameters() if p.requires_grad}
    assert {n for n in trained if not _is_b(n)} == {n for n, _ in t.named_parameters() if _lora_layer(n)}
    assert {_lora_layer(n) for n in trained if not _is_b(n)} == COUPLING and any(_is_b(n) for n in trained)
    live = trainer.policy.named_weights("live")
    n_b = sum(1 for _ in t.get_submodule(B).state_dict())
    assert len(live) == n_b + 2 * len(COUPLING)  # B's state dict under full names + lora_A / lora_B of each layer
    assert trainer.objective.policy.has("old") == (algorithm == "nft")
    before = {n: p.detach().clone() for n, p in t.named_parameters()}
    trainer.train()
    row = _metrics(trainer)
    changed = {n for n, p in t.named_parameters() if not torch.equal(p, before[n])}
    # the old adapter of NFT follows live by its blend; nothing of the backbone moves
    allowed = {n for n in before if _is_b(n) or _lora_layer(n) or _lora_layer(n, "old")}
    assert changed <= allowed, sorted(changed - allowed)[:5]
    assert any(_is_b(n) for n in changed)
    assert {_lora_layer(n) for n in changed if ".lora_B.default." in n} == COUPLING  # B = 0 at init: moved now
    n_b_params = len(list(t.get_submodule(B).parameters()))
    anchor = trainer.objective.anchor
    assert anchor.paths["fm"] == n_b_params + 2 * len(COUPLING)  # the fm anchor has a path to both kinds ...
    assert row["train/anchor_fm_reach"] == n_b_params + len(COUPLING)  # ... and reaches both by size (lora_A's
    # gradient is 0 while lora_B is 0): demo:world's gates are open a little (0.019 at most)
    assert row["train/anchor_trans_reach"] == n_b_params  # the predictor reads the state: B only, by size too
    if algorithm == "grpo":
        assert row["train/first_update_ratio_dev"] == 0.0
    assert trainer.state.contract["lora"] == {"trainable": "module+lora", "dropout": 0.0, "rank": 8, "alpha": 16.0,
                                              "targets": sorted(COUPLING), "modules": [B]}


@pytest.mark.slow  # end-to-end runs (minutes of CPU together): CI runs them in the slow set
def test_module_lora_resume_equals_uninterrupted_run(tmp_path, encode_cache_dir):
    """NFT (live, old adapter + old B copy) with both anchors: 3 steps straight == 2 steps + resume, bit for bit."""
    from tests.train.test_resume import _assert_same, _rows, _state

    full, resumed = straight_and_resumed(tmp_path, encode_cache_dir, *MODULE_LORA, "anchor.fm_weight=0.1",
                                         "anchor.trans_weight=0.01", "train.lr=1e-2")
    a, b = _state(full), _state(resumed)
    assert set(a[0]) == {"live", "old"}
    assert any(_is_b(k) for k in a[0]["old"]) and any(".lora_A." in k for k in a[0]["old"])
    _assert_same(a, b)
    assert _rows(full.run_dir) == _rows(resumed.run_dir)
    rows = _rows(full.run_dir)  # the reach is logged once, in the first step's row (a resumed process measures again)
    assert "train/anchor_fm_reach" in rows[0] and not any("train/anchor_fm_reach" in r for r in rows[1:])
    # a module-mode run cannot resume it: the contract names the mode
    with pytest.raises(ValueError, match=r"resume refused[\s\S]*lora.trainable: checkpoint module\+lora"):
        _trainer(tmp_path / "p", encode_cache_dir, "nft", "lora.trainable=module", f"lora.modules=[{B}]",
                 "train.steps=3", "checkpoint.every=1", "train.resume=auto")


@pytest.mark.parametrize("overrides, mention", [
    (["lora.trainable=module+lora", "lora.modules=null"],
     ["lora.modules=[] goes with lora.trainable='module' or 'module+lora'"]),
    (["lora.trainable=module+lora"],  # the example's modules include the blocks, which hold the targets
     ["lora.modules entry 'blocks' contains the LoRA layer 'blocks.0.coupling.q'", "module+lora"]),
    (["lora.trainable=module+lora", "lora.modules=[blocks.1.coupling.v]"],
     ["lora.modules entry 'blocks.1.coupling.v' is the LoRA layer 'blocks.1.coupling.v'"]),
    (["lora.trainable=module+lora", f"lora.modules=[{B}]", "lora.targets=[latent_state_rollout.transition.delta]"],
     [f"lora.modules entry '{B}' contains the LoRA layer '{B}.delta'"]),
    (["lora.trainable=module", "lora.rank=4"], ["lora.rank / lora.alpha / lora.targets are set",
                                               "lora.trainable='lora' or 'module+lora'"]),
])
def test_bad_module_lora_configs_are_one_line_errors(tmp_path, overrides, mention):
    rc, _, err = run_cli(["check", EXAMPLE, *overrides], tmp_path, in_process=True)
    assert_one_line_error(rc, err, mention)


def test_a_lora_layer_inside_a_trained_module_is_refused_after_loading_too(tmp_path, encode_cache_dir, monkeypatch):
    """When the module tree is only known once the model loads, the same rule runs then, before the run directory
    is written; preflight itself names it before anything loads."""
    from flowforge.train import preflight as pf

    bad = ("lora.trainable=module+lora", f"lora.modules=[{B},blocks.2.coupling]")
    with pytest.raises(PreflightError, match="'blocks.2.coupling' contains the LoRA layer 'blocks.2.coupling.q'"):
        _trainer(tmp_path, encode_cache_dir, "nft", *bad)
    monkeypatch.setattr(pf.check, "module_path_problems", lambda cfg, problems: None)
    # the after-load preflight names it (a UserError), not the policy bank's own check further on (a ValueError)
    with pytest.raises(UserError, match="after loading model.path.*'blocks.2.coupling' contains the LoRA layer"):
        _trainer(tmp_path, encode_cache_dir, "nft", *bad)
    assert not (tmp_path / "nft").exists()
