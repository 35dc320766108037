"""World-model anchor losses on real clips, added to every optimizer step of any objective (section ``anchor``).

``L = L_RL + anchor.fm_weight * L_FM_real + anchor.trans_weight * L_trans_real [+ anchor.ref_weight * L_ref_real]``
(the math and its sources: :mod:`flowforge.algorithms.losses.anchors`). Active when the model is a world model
(``model.adapter: world_model``) and a weight is > 0; the digits job and every other family never build one.

Before each optimizer step :meth:`AnchorLosses.backward` draws ``anchor.batch_size`` real training clips (the train
split of :mod:`flowforge.data.atari`, split by episode from the held-out clips), their noise and their sigma from a
generator seeded by ``(run seed, optimizer steps so far)`` -- a resumed run draws the same ones -- and adds the
gradients of the weighted terms to the RL gradients already accumulated.

**Gradient reach.** Which trained parameters each term can change depends on the parameter mode: with LoRA on the
coupling attention only, the transition cross-entropy has no gradient path to any trained parameter (the predictor
reads the state, which no coupling layer touches); under ``module+lora`` (B in full and the coupling LoRA) the
flow-matching term reaches both kinds and the transition term B only. The reach is measured over every trained
tensor of the transformer (``requires_grad``: the trained submodules and the live LoRA adapter alike). On the first
call every term's reach is measured with autograd
(``torch.autograd.grad(..., allow_unused=True)``: the trained tensors with a gradient path); a weighted term that
reaches nothing is never computed or applied, a warning says so once, and ``anchor_<term>_reach`` (the number of
trained tensors reached, logged every step) is 0 -- it is not reported as training anything.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from flowforge.algorithms.losses import anchors as anchor_math
from flowforge.rollout import generated_index, with_condition
from flowforge.settings import Checks, Section

log = logging.getLogger(__name__)

ANCHOR_CLIPS = ("atari",)
"""``anchor.clips`` values: the real clips of :mod:`flowforge.data.atari` (Breakout, the demo world model's game)."""
TERMS = ("fm", "trans", "ref")


@dataclass(frozen=True)
class AnchorConfig(Section):
    """Anchor losses of a world-model run (module docstring); inactive for other model families."""

    section_name = "anchor"

    fm_weight: float = 0.1  # lambda_fm: flow-matching MSE on real clips
    trans_weight: float = 0.01  # lambda_trans: transition-code cross-entropy on real clips
    ref_weight: float = 0.0  # velocity MSE to the reference (SFT) policy on real clips
    batch_size: int = 4  # real clips per optimizer step
    train_timesteps: int = 1000  # the anchor's own training schedule: this many sigmas
    shift: float = 1.0  # static shift of that schedule
    clips: str = "atari"  # where the real clips come from
    episodes: int = 64  # real episodes recorded for the stream (the demo's recording; its train split is used)

    def problems(self) -> list[str]:
        c = Checks(self)
        c.positive("fm_weight", "trans_weight", "ref_weight", allow_zero=True)
        c.positive("batch_size", "train_timesteps", "shift")
        c.require(self.episodes >= 8, f"anchor.episodes={self.episodes} must be >= 8 (every 8th episode is held out)")
        c.choice("clips", ANCHOR_CLIPS)
        return c.problems

    @property
    def weights(self) -> dict[str, float]:
        return {"fm": self.fm_weight, "trans": self.trans_weight, "ref": self.ref_weight}


def anchor_policy_bank(section: AnchorConfig, bank: dict) -> dict:
    """``bank`` (an objective's :meth:`~flowforge.objectives.base.Objective.policy_bank` kwargs) plus the reference
    policy when the anchor's reference penalty is on."""
    return {**bank, "keep_ref": True} if section.ref_weight > 0 else bank


def _is_world_model(adapter) -> bool:
    from flowforge.models.world_model.adapter import WorldModelAdapter

    return isinstance(adapter, WorldModelAdapter)


def build_anchor(section: AnchorConfig, adapter, policy, *, seed: int, cache_dir: str) -> "AnchorLosses | None":
    """The anchor of a run, or None (not a world model, or every weight 0). Loads the real training clips
    (recorded once and cached under ``cache_dir``)."""
    if not _is_world_model(adapter) or not any(w > 0 for w in section.weights.values()):
        return None
    from flowforge.data.atari import AtariDataConfig, load_atari_clips

    clips = load_atari_clips(AtariDataConfig(episodes=section.episodes), cache_dir)
    video, actions = clips.clips(clips.split("train"))
    return AnchorLosses(section, adapter, policy, video, actions, seed=seed)


class AnchorLosses:
    """The anchor terms of one run (module docstring).

    Args:
        section: weights, batch size, training schedule.
        adapter: the world-model adapter (its ``transformer`` the live network of ``policy``).
        policy: the policy bank (its trained parameters, its reference policy for ``ref_weight``).
        video: ``[N, 1, F, H, W]`` float in [0, 1], the real clips. actions: ``[N, F]`` int64 action ids.
        seed: the run seed.

    Raises:
        ValueError: clips that do not fit the model; ``ref_weight > 0`` without a reference policy in the bank.
    """

    def __init__(self, section: AnchorConfig, adapter, policy, video: torch.Tensor, actions: torch.Tensor, *,
                 seed: int):
        if video.ndim != 5 or actions.shape != (video.shape[0], video.shape[2]) or video.shape[0] == 0:
            raise ValueError(f"anchor clips must be [N, C, F, H, W] with actions [N, F], got {tuple(video.shape)} and "
                             f"{tuple(actions.shape)}")
        if section.ref_weight > 0 and not policy.has("ref"):
            raise ValueError("anchor.ref_weight > 0 needs the reference policy in the bank (anchor_policy_bank)")
        self.section, self.adapter, self.policy, self.seed = section, adapter, policy, seed
        self.video, self.actions = video, actions
        self.schedule = anchor_math.training_sigmas(section.train_timesteps, section.shift)
        self.reach: dict[str, int] | None = None  # term -> trained tensors with a gradient path (first call)

    def clip_batch(self, step: int):
        """``(x0 [b, C, F, H, W] in [-1, 1], noise, sigma [b], cond)`` of optimizer step ``step``: clips, noise and
        sigma from a generator seeded by ``(seed, step)`` only."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + 7 * step + 11)
        rows = torch.randint(0, self.video.shape[0], (self.section.batch_size,), generator=gen)
        sigma = anchor_math.draw_training_sigmas(self.schedule, rows.numel(), gen)
        device = next(self.adapter.transformer.parameters()).device
        x0 = self.adapter.encode_video(self.video[rows]).to(device)
        noise = torch.randn(x0.shape, generator=gen).to(device)
        names = [" ".join(self.adapter.action_names[a] for a in row) for row in self.actions[rows].tolist()]
        cond = dataclasses.replace(self.adapter.encode(names).to(device), image=x0[self.adapter.condition_index])
        return x0, noise, sigma.to(device), cond

    def terms(self, step: int, skip: tuple[str, ...] = ()) -> tuple[dict[str, torch.Tensor | None], dict]:
        """Every weighted term of step ``step`` not in ``skip`` (``None`` for the others) and their metrics
        (term -> ``{name: 0-d}``)."""
        x0, noise, sigma, cond = self.clip_batch(step)
        w = self.section.weights
        gen = generated_index(self.adapter)
        x_sigma = with_condition(self.adapter, anchor_math.noised(x0, noise, sigma), cond)
        out: dict[str, torch.Tensor | None] = dict.fromkeys(TERMS)
        metrics: dict[str, dict[str, torch.Tensor]] = {}
        if w["ref"] > 0 and "ref" not in skip:
            with torch.no_grad(), self.policy.using("ref"):
                v_ref = self.adapter.velocity(x_sigma, sigma, cond, 1.0)[gen]
        if (w["fm"] > 0 and "fm" not in skip) or (w["ref"] > 0 and "ref" not in skip):
            v = self.adapter.velocity(x_sigma, sigma, cond, 1.0)[gen]
            if w["fm"] > 0 and "fm" not in skip:
                out["fm"], metrics["fm"] = anchor_math.anchor_fm_loss(v, x0[gen], noise[gen])
            if w["ref"] > 0 and "ref" not in skip:
                out["ref"] = (v - v_ref).pow(2).mean()
        if w["trans"] > 0 and "trans" not in skip:
            model = self.adapter.transformer
            logits = model.transition_logits(cond.image, cond.prompt_embeds, x0.shape[2])
            out["trans"], metrics["trans"] = anchor_math.transition_ce_loss(logits, model.transition_labels(x0))
        return out, metrics

    def measure_reach(self, terms: dict[str, torch.Tensor | None]) -> dict[str, int]:
        """Trained tensors each computed term has a gradient path to (``torch.autograd.grad``, ``allow_unused``)."""
        named = [(n, p) for n, p in self.adapter.transformer.named_parameters() if p.requires_grad]
        reach = {}
        for name, term in terms.items():
            reach[name] = 0
            if term is not None and term.requires_grad:  # no graph at all: no path to any trained parameter
                grads = torch.autograd.grad(term, [p for _, p in named], allow_unused=True, retain_graph=True)
                reach[name] = sum(g is not None for g in grads)
            if term is not None and reach[name] == 0:
                log.warning("anchor.%s_weight=%s but the %s term has no gradient path to any trained parameter in "
                            "this parameter mode: it is not applied", name, self.section.weights[name], name)
        return reach

    def backward(self) -> dict[str, torch.Tensor]:
        """Add the gradients of the weighted terms of the coming optimizer step; returns ``anchor_<term>`` values,
        ``anchor_loss`` (their weighted sum) and ``anchor_<term>_reach``."""
        step = self.policy.optimizer_steps
        skip = () if self.reach is None else tuple(k for k, n in self.reach.items() if n == 0)
        terms, metrics = self.terms(step, skip)
        if self.reach is None:
            self.reach = self.measure_reach(terms)
            terms = {k: (None if self.reach[k] == 0 else t) for k, t in terms.items()}
        loss, values = anchor_math.combine_anchor_terms(terms, self.section.weights)
        if loss.requires_grad:
            self.policy.backward(loss)
        out = {f"anchor_{k}": v for k, v in values.items()}
        out.update({f"anchor_{k}": v.detach() for term, m in metrics.items() if term in values for k, v in m.items()})
        out["anchor_loss"] = loss.detach()
        out.update({f"anchor_{k}_reach": torch.tensor(float(n)) for k, n in self.reach.items()
                    if self.section.weights[k] > 0})
        return out
