"""DMD2 few-step distillation (section ``dmd2``): the policy becomes a 1-4 step generator of its teacher's
distribution.

The teacher (the *real* score) is the run's starting model, frozen: the bank's ``ref`` policy. The *fake* score is a
second copy of it that this objective owns and trains online, with its own AdamW, on the generator's samples. The
generator is the live policy sampling with the run's own sampler at ``sampler.num_steps`` (1-4): what it learns is
exactly what :func:`flowforge.rollout.denoise` samples afterwards, ODE or SDE, so RL runs on the result unchanged.

One training step (the math: :mod:`flowforge.algorithms.losses.dmd2`):

1. **Rollout, backward simulation** (DMD2 Sec. 4.5): the live generator samples from noise with the deterministic
   sampler, storing its input ``x_k`` at every one of its ``N`` steps (no gradient). A generator training input is
   then what the generator itself meets at step ``k``, not a noised real image.
2. For each of ``train.num_updates_per_batch`` generator updates, on its rows: each row draws a step ``k`` (uniform
   over the ``N`` steps) and the generator predicts ``x = x_k - sigma_k v_G(x_k, sigma_k)``.
3. **TTUR** (Sec. 4.1): ``dmd2.fake_updates`` optimizer steps of the fake score on those samples (detached),
   ``L_fake`` at ``u ~ U[0, 1]`` with fresh noise each time.
4. **Distribution matching**: ``s ~ U[dmd2.sigma_range]``, the teacher (guidance ``dmd2.real_guidance_scale``) and the
   fake score (no guidance) denoise the same ``x_s``; ``g`` is their normalised difference and the generator descends
   ``L_DM`` (one optimizer step of the policy; ``train.lr``, ``train.grad_clip``). No regression loss.

The advantages and rewards are not used (``uses_advantages = False``): the reward components are still scored and
logged (and evaluated on held-out prompts), so a distillation run reports e.g. DigitEval as it goes. Noise and step
draws come from a generator seeded by (run seed, step, update): a run is reproducible.

Not yet: the GAN term (DMD2 Sec. 4.2: a discriminator head on the fake score's features, trained on real images;
the losses exist in :mod:`flowforge.algorithms.losses.dmd2`), LoRA / module training (``lora.trainable: full``
only) and data parallelism (one process). Checkpoints hold the fake score and its optimizer beside the policy's
(:meth:`DMD2.checkpoint_state`), so ``train.resume`` continues a run bit for bit; the export is the usual one.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch

from flowforge.algorithms import losses
from flowforge.algorithms.reward_grad import predict_x0
from flowforge.objectives.base import MetricAccumulator, Objective, TrainBatch
from flowforge.rollout import RolloutSpec
from flowforge.settings import Checks, Section


@dataclass(frozen=True)
class DMD2Config(Section):
    """DMD2 distillation settings (see the module docstring)."""

    section_name = "dmd2"

    fake_updates: int = 5  # TTUR: fake-score optimizer steps per generator step (DMD2: dfake_gen_update_ratio 5)
    fake_lr: float = 1.0e-4  # the fake score's AdamW learning rate (DMD2 uses the generator's: set both equal)
    fake_grad_clip: float = 1.0  # the fake score's gradient-norm clip
    sigma_range: tuple[float, float] = (0.02, 0.98)  # s of the distribution-matching term (DMD2: 2 % .. 98 %)
    real_guidance_scale: float = 1.0  # the teacher's CFG scale in L_DM (DMD2 SDXL: 8); the fake score: none

    def problems(self) -> list[str]:
        c = Checks(self)
        c.positive("fake_updates", "fake_lr", "fake_grad_clip", "real_guidance_scale")
        lo, hi = self.sigma_range
        c.require(0 < lo < hi < 1, f"dmd2.sigma_range={list(self.sigma_range)} must be [lo, hi] with "
                                   "0 < lo < hi < 1 (noise levels of the distribution-matching term)")
        return c.problems


class DMD2(Objective):
    """DMD2 distillation of the run's starting model into a few-step generator (see the module docstring)."""

    name = "dmd2"
    sections = (DMD2Config,)
    uses_advantages = False
    dmd2: DMD2Config

    def __init__(self, ctx, adapter, policy):
        super().__init__(ctx, adapter, policy)
        # the fake score starts as the teacher (DMD2 initialises it from the real score); fp32, trainable, no dropout.
        # Without a model (an objective built to read its declarations) there is nothing to copy and nothing trains.
        self.fake = None if adapter is None else copy.deepcopy(adapter.transformer).float().requires_grad_(True).eval()
        self.fake_params = [] if self.fake is None else [p for p in self.fake.parameters() if p.requires_grad]
        self.fake_optimizer = torch.optim.AdamW(self.fake_params, lr=self.dmd2.fake_lr) if self.fake_params else None

    @classmethod
    def policy_bank(cls, ctx) -> dict:
        return {"keep_ref": True}  # the teacher: the frozen starting weights

    @classmethod
    def preflight_problems(cls, cfg, *, world_size: int) -> list[str]:
        problems = super().preflight_problems(cfg, world_size=world_size)
        if cfg.lora.trainable != "full":
            problems.append(f"lora.trainable={cfg.lora.trainable!r} with train.algorithm='dmd2': the generator and "
                            "its fake score are whole copies of the transformer; allowed: 'full'")
        if world_size > 1:
            problems.append(f"train.algorithm='dmd2' runs on one process (the fake score is not data-parallel "
                            f"yet); got {world_size} ranks")
        return problems

    # ------------------------------------------------------------------------------------------------ its state
    def checkpoint_state(self) -> dict:
        """The fake score's weights (group ``fake``, fp32) and its AdamW state: a resumed run continues the fake
        score where it stopped instead of restarting it from the teacher."""
        if self.fake is None:
            return {}
        return {"tensors": {"fake": self.fake.state_dict()}, "optimizer": self.fake_optimizer.state_dict()}

    def load_checkpoint_state(self, state: dict) -> None:
        """Restore :meth:`checkpoint_state`.

        Raises:
            ValueError: a checkpoint without the fake score (one written before dmd2 saved it): resuming from it
                would silently restart the fake score from the teacher.
        """
        if self.fake is None:
            return
        if "fake" not in (state.get("tensors") or {}) or state.get("optimizer") is None:
            raise ValueError("this checkpoint holds no DMD2 fake score (written before dmd2 saved it); start the run "
                             "again (train.resume unset)")
        self.fake.load_state_dict(state["tensors"]["fake"])
        self.fake_optimizer.load_state_dict(state["optimizer"])
        for group in self.fake_optimizer.param_groups:  # the saved state carries the checkpoint's: the config's wins
            group["lr"] = self.dmd2.fake_lr

    # ------------------------------------------------------------------------------------------------ rollout
    def rollout_spec(self, step: int) -> RolloutSpec:
        """The deterministic sampler, storing the input of every step (backward simulation)."""
        s = self.ctx.sampler
        return RolloutSpec(kind="ode", noise_level=0.0, trained_steps=tuple(range(s.num_steps)),
                           guidance_scale=s.guidance_scale, store_steps=True, log_probs=False)

    # ------------------------------------------------------------------------------------------------ models
    @contextlib.contextmanager
    def _fake_score(self):
        """Within the context ``adapter.velocity`` evaluates the fake score (swapped in as the transformer)."""
        live = self.adapter.transformer
        self.adapter.transformer = self.fake
        try:
            yield
        finally:
            self.adapter.transformer = live

    def _predict(self, sub: TrainBatch, x_k: torch.Tensor, sigma_k: torch.Tensor) -> torch.Tensor:
        """The live generator's data prediction ``x_k - sigma_k v(x_k, sigma_k)``: ``[b, *latent]`` fp32, with
        gradient when enabled."""
        g = self.ctx.sampler.guidance_scale
        return predict_x0(lambda x, s: self.adapter.velocity(x, s, sub.cond, g), x_k, sigma_k)

    def _x0(self, sub: TrainBatch, x_s: torch.Tensor, s: torch.Tensor, guidance: float) -> torch.Tensor:
        """The data prediction of whichever model is in use at noise levels ``s [b]``, no gradient."""
        with torch.no_grad():
            return predict_x0(lambda x, sig: self.adapter.velocity(x, sig, sub.cond, guidance), x_s, s)

    # ------------------------------------------------------------------------------------------------ update
    def fake_step(self, batch: TrainBatch, x: torch.Tensor, gen: torch.Generator) -> dict[str, torch.Tensor]:
        """One optimizer step of the fake score on the generator's samples ``x [B, *latent]`` (detached), over the
        micro-batches of ``batch``'s rows; returns ``loss_fake`` and ``fake_grad_norm``."""
        n = len(batch)
        u = torch.rand(n, generator=gen).to(x.device)
        noise = torch.randn(x.shape, generator=gen).to(x.device)
        acc = MetricAccumulator()
        with self._fake_score():
            for rows in self.micro_batches(torch.arange(n)):
                sub = batch.select(rows)
                v = self.adapter.velocity(renoise_rows(x[rows], noise[rows], u[rows]), u[rows], sub.cond, 1.0)
                loss, m = losses.fake_score_loss(v, x[rows], noise[rows])
                (loss * (rows.numel() / n)).backward()
                acc.add(m, weight=rows.numel())
        norm = torch.nn.utils.clip_grad_norm_(self.fake_params, self.dmd2.fake_grad_clip)
        self.fake_optimizer.step()
        self.fake_optimizer.zero_grad(set_to_none=True)
        return {**_means(acc), "fake_grad_norm": norm.detach()}

    def optimize(self, batch: TrainBatch) -> dict[str, torch.Tensor]:
        batch = batch.kept()
        d, traj = self.dmd2, batch.traj
        n_updates = self.ctx.num_updates_per_batch
        per_update = len(batch) // n_updates
        gen = torch.Generator().manual_seed(self.ctx.seed * 1_000_003 + batch.step)
        sigmas = traj.sigmas[list(traj.trained_steps)].to(traj.final.device)  # [N] the generator's input levels
        acc = MetricAccumulator()
        for u in range(n_updates):
            sub = batch.select(torch.arange(u * per_update, (u + 1) * per_update))
            b = len(sub)
            k = torch.randint(len(traj.trained_steps), (b,), generator=gen).to(traj.final.device)  # [b]
            x_k, sigma_k = sub.traj.latents[torch.arange(b, device=k.device), k], sigmas[k]
            with torch.no_grad():
                x = torch.cat([self._predict(sub.select(r), x_k[r], sigma_k[r]) for r in self.micro_batches(
                    torch.arange(b))])
            for _ in range(d.fake_updates):
                acc.add(self.fake_step(sub, x, gen), weight=b)
            lo, hi = d.sigma_range
            s = (lo + (hi - lo) * torch.rand(b, generator=gen)).to(x.device)
            x_s = renoise_rows(x, torch.randn(x.shape, generator=gen).to(x.device), s)
            real, fake = [], []
            for r in self.micro_batches(torch.arange(b)):
                with self.policy.using("ref"):
                    real.append(self._x0(sub.select(r), x_s[r], s[r], d.real_guidance_scale))
                with self._fake_score():
                    fake.append(self._x0(sub.select(r), x_s[r], s[r], 1.0))
            grad = losses.dmd_gradient(x, torch.cat(real), torch.cat(fake))
            for r in self.micro_batches(torch.arange(b)):
                x_pred = self._predict(sub.select(r), x_k[r], sigma_k[r])  # the same values as x[r], with gradient
                loss, m = losses.dmd_loss(x_pred, grad[r])
                self.policy.backward(loss * (r.numel() / b))  # the mean over the update's rows
                acc.add(m, weight=r.numel())
            acc.add(self.optimizer_step())
        return acc.reduce()


def renoise_rows(x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """``(1 - sigma_b) x0_b + sigma_b noise_b`` with one noise level per row: ``x0, noise [B, *latent]``,
    ``sigma [B]``; fp32."""
    s = sigma.float().reshape(-1, *([1] * (x0.ndim - 1)))
    return (1 - s) * x0.float() + s * noise.float()


def _means(acc: MetricAccumulator) -> dict[str, torch.Tensor]:
    """The weighted means of a local accumulator (no collective: the fake score trains on one process)."""
    return {k: (v / acc.weights[k]).float() for k, v in acc.sums.items() if acc.weights.get(k)}
