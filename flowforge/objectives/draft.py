"""Reward-gradient fine-tuning: DRaFT-K, DRaFT-LV and ReFL (section ``draft``).

The rollout is the deterministic ODE sampler without gradient; it stores the latent where the differentiable part
starts. The update re-runs that part with gradient under the live weights (:mod:`flowforge.algorithms.reward_grad`),
decodes it (``adapter.decode``, differentiable: the VAE or the pixel-space identity), scores the images with the
differentiable reward (:attr:`~flowforge.objectives.base.Objective.reward_fn`: the ``reward.weights``-weighted sum of
scorers that declare ``differentiable = True``) and descends ``loss = -mean_b r_b``:

=====================  ===========================================================================================
``variant: draft``     DRaFT-K (Clark et al. 2023): the last ``draft.k`` Euler steps from the stored ``x_{T-K}``,
                       each activation-checkpointed (``draft.checkpoint``); ``k = T`` is full DRaFT
``draft.lv_samples``   DRaFT-LV (same paper, ``k = 1``): ``n`` re-noisings of the finished sample to the last step's
                       noise level, each denoised in one step with gradient; ``-r`` averaged over the ``n``
``variant: refl``      ReFL (Xu et al. 2023, ImageReward): a stop step ``t`` counted from the end, drawn uniformly in
                       ``draft.refl_range = [t1, t2]`` once per training step (the same on every rank); the one-step
                       prediction ``x0_hat = x_t - sigma_t v(x_t)`` from there
=====================  ===========================================================================================

The advantages are not used (the reward's gradient replaces them), so a step is trained even when every group
ties. ``train.num_updates_per_batch`` splits the batch into that many optimizer steps, each re-running its rows'
differentiable part under the weights of that moment (the no-grad prefix stays the rollout's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowforge.algorithms import reward_grad
from flowforge.objectives.base import MetricAccumulator, Objective, TrainBatch
from flowforge.rollout import RolloutSpec, candidate_noise
from flowforge.settings import Checks, Section

DRAFT_VARIANTS = ("draft", "refl")


def _decodes(adapter: str) -> bool:
    """Whether the registered family ``adapter`` declares ``differentiable_decode = True`` (False if it does not
    import here)."""
    from flowforge.models import adapter_class

    try:
        return getattr(adapter_class(adapter), "differentiable_decode", False) is True
    except Exception:  # noqa: BLE001 - a family whose optional dependency is missing cannot be the one in use
        return False


@dataclass(frozen=True)
class DraftConfig(Section):
    """DRaFT-K / DRaFT-LV / ReFL settings (see the module docstring)."""

    section_name = "draft"

    variant: str = "draft"  # "draft" (DRaFT-K, DRaFT-LV) | "refl"
    k: int = 1  # draft: the last K sampler steps are differentiated (1 <= K <= sampler.num_steps)
    lv_samples: int = 0  # draft with k=1: DRaFT-LV's n re-noised copies (0: plain DRaFT-K)
    refl_range: tuple[int, int] = (1, 3)  # refl: the stop step counted from the end (1 = the last step), [t1, t2]
    checkpoint: bool = True  # activation checkpointing of each differentiated step (DRaFT-K)

    def problems(self) -> list[str]:
        c = Checks(self)
        c.choice("variant", DRAFT_VARIANTS)
        c.positive("k")
        c.positive("lv_samples", allow_zero=True)
        t1, t2 = self.refl_range
        c.require(1 <= t1 <= t2, f"draft.refl_range={list(self.refl_range)} must be [t1, t2] with 1 <= t1 <= t2 "
                                 "(steps counted from the end, 1 = the last step)")
        c.require(self.lv_samples == 0 or (self.variant == "draft" and self.k == 1),
                  f"draft.lv_samples={self.lv_samples} (DRaFT-LV) needs draft.variant='draft' and draft.k=1, got "
                  f"variant={self.variant!r}, k={self.k}")
        return c.problems


class Draft(Objective):
    """Reward-gradient fine-tuning (see the module docstring). Needs :attr:`reward_fn` (the trainer sets it).

    Raises:
        ValueError: an image-conditioned adapter (a ``condition_index`` slot: not supported yet).
    """

    name = "draft"
    sections = (DraftConfig,)
    uses_advantages = False
    needs_reward_fn = True
    draft: DraftConfig

    def __init__(self, ctx, adapter, policy):
        super().__init__(ctx, adapter, policy)
        if getattr(adapter, "condition_index", None) is not None:
            raise ValueError("train.algorithm='draft' does not support image-conditioned latents (a condition slot) "
                             "yet; allowed: text-to-image / text-to-video models")

    @classmethod
    def preflight_problems(cls, cfg, *, world_size: int) -> list[str]:
        from flowforge.models import ADAPTER_CLASSES
        from flowforge.rewards.differentiable import declares_differentiable, non_differentiable
        from flowforge.rewards.registry import SCORERS

        problems = super().preflight_problems(cfg, world_size=world_size)
        d, n = cfg.draft, cfg.sampler.num_steps
        if cfg.sampler.sde_kind != "ode":
            problems.append(f"sampler.sde_kind={cfg.sampler.sde_kind!r} with train.algorithm='draft': DRaFT / ReFL "
                            "differentiate the deterministic sampler; allowed: 'ode'")
        if d.variant == "draft" and d.k > n:
            problems.append(f"draft.k={d.k} is more than sampler.num_steps={n}; allowed: 1..{n}")
        if d.variant == "refl" and d.refl_range[1] > n:
            problems.append(f"draft.refl_range={list(d.refl_range)} reaches past sampler.num_steps={n}; allowed: "
                            f"1 <= t1 <= t2 <= {n}")
        known = cfg.model.adapter in ADAPTER_CLASSES or ":" in cfg.model.adapter  # else named by the model checks
        if known and not _decodes(cfg.model.adapter):
            problems.append(f"model.adapter={cfg.model.adapter!r}: its decode is not differentiable (no "
                            "differentiable_decode = True); train.algorithm='draft' backpropagates through it; "
                            f"allowed: {sorted(a for a in ADAPTER_CLASSES if _decodes(a))}")
        bad = non_differentiable(cfg.reward.weights)
        if bad or not any(cfg.reward.weights.values()):
            problems.append(f"reward.weights: train.algorithm='draft' backpropagates through the reward, but "
                            f"{bad or 'no component has a non-zero weight'}"
                            f"{' are not differentiable' if bad else ''}; differentiable scorers: "
                            f"{sorted(s for s in SCORERS if declares_differentiable(s))} (or an import path whose "
                            "factory declares differentiable = True)")
        return problems

    # ------------------------------------------------------------------------------------------------ rollout
    def stop_step(self, step: int) -> int:
        """The schedule index where the differentiable part of training step ``step``'s rollout starts (DRaFT-K:
        ``T - k``; ReFL: ``T - t``, ``t`` uniform in ``refl_range`` from a generator seeded by (run seed, step))."""
        d, n = self.draft, self.ctx.sampler.num_steps
        if d.variant == "draft":
            return n - d.k
        t1, t2 = d.refl_range
        gen = torch.Generator().manual_seed(self.ctx.seed * 1_000_003 + step)
        return n - int(torch.randint(t1, t2 + 1, (1,), generator=gen))

    def rollout_spec(self, step: int) -> RolloutSpec:
        lv = self.draft.lv_samples > 0  # DRaFT-LV starts from the finished sample: nothing to store
        return RolloutSpec(kind="ode", noise_level=0.0, trained_steps=() if lv else (self.stop_step(step),),
                           guidance_scale=self.ctx.sampler.guidance_scale, store_steps=not lv, log_probs=False)

    # ------------------------------------------------------------------------------------------------ update
    def predictions(self, sub: TrainBatch) -> list[torch.Tensor]:
        """The differentiable clean latents of a micro-batch: ``[b, *latent]`` fp32 each, one (DRaFT-K, ReFL) or
        ``lv_samples`` (DRaFT-LV), with gradient to the live weights."""
        d, traj = self.draft, sub.traj
        g = self.ctx.sampler.guidance_scale

        def velocity(x, sigma):
            return self.adapter.velocity(x, sigma, sub.cond, g)

        sig = traj.sigmas
        if d.lv_samples:
            x0, s = traj.final, sig[-2]  # re-noised to the last step's level (DRaFT-LV)
            ids = sub.candidate_ids.tolist()
            # slots -2, -3, ...: never a rollout slot (-1 is x_T, 0.. the step noise), a function of the candidate
            return [reward_grad.predict_x0(velocity, reward_grad.renoise(
                x0, candidate_noise(ids, x0.shape[1:], self.ctx.seed, -2 - j).to(x0.device), s), s)
                for j in range(d.lv_samples)]
        start, x = traj.trained_steps[0], traj.latents[:, 0]
        if d.variant == "refl":
            return [reward_grad.predict_x0(velocity, x, sig[start])]
        return [reward_grad.ode_tail(velocity, x, sig[start:], use_checkpoint=d.checkpoint)]

    def micro_loss(self, sub: TrainBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``-mean r`` of a micro-batch (averaged over DRaFT-LV's copies) and its metrics.

        Raises:
            RuntimeError: no ``reward_fn`` was set (the objective was built outside the trainer).
        """
        if self.reward_fn is None:
            raise RuntimeError("draft needs reward_fn (the trainer sets it: a differentiable weighted reward)")
        if sub.records is None:
            raise RuntimeError("draft needs the rows' prompt records in the TrainBatch")
        prompts, metadata = [r.prompt for r in sub.records], [r.metadata for r in sub.records]
        rewards = []
        for x0 in self.predictions(sub):
            images = self.adapter.decode(x0)
            if x0.requires_grad and not images.requires_grad:
                raise ValueError(f"model.adapter: {type(self.adapter).__name__}.decode returned no gradient; "
                                 "train.algorithm='draft' needs a differentiable decode (differentiable_decode)")
            rewards.append(self.reward_fn(images, prompts, metadata))
        r = torch.stack(rewards).mean(0)  # [b]
        loss = -r.mean()
        return loss, {"loss": loss.detach(), "reward_grad_mean": r.detach().mean()}

    def optimize(self, batch: TrainBatch) -> dict[str, torch.Tensor]:
        batch = batch.kept()  # a failed group's rows (flowforge.train.seams) carry no weight here either
        n_updates = self.ctx.num_updates_per_batch
        per_update = len(batch) // n_updates
        acc = MetricAccumulator()
        for u in range(n_updates):
            for rows in self.micro_batches(torch.arange(u * per_update, (u + 1) * per_update)):
                loss, m = self.micro_loss(batch.select(rows))
                self.policy.backward(loss * (rows.numel() / per_update))  # the update's mean over its rows
                acc.add(m, weight=rows.numel())
            acc.add(self.optimizer_step())
        out = acc.reduce()
        out["start_step"] = torch.tensor(float(batch.traj.trained_steps[0] if batch.traj.trained_steps
                                               else len(batch.traj.sigmas) - 2))
        return out
