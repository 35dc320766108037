"""World-model anchor losses on real clips, added to every optimizer step of any objective (section ``anchor``).

``L = L_RL + anchor.fm_weight * L_FM_real + anchor.trans_weight * L_trans_real [+ anchor.ref_weight * L_ref_real]``
(the math and its sources: :mod:`flowforge.algorithms.losses.anchors`). Active when the model is a world model
(``model.adapter: world_model``) and a weight is > 0; the digits job and every other family never build one.

Before each optimizer step :meth:`AnchorLosses.backward` draws ``anchor.batch_size`` real training clips (the train
split of :mod:`flowforge.data.atari`, split by episode from the held-out clips), their noise and their sigma from a
generator seeded by ``(run seed, optimizer steps so far)`` -- a resumed run draws the same ones -- and adds the
gradients of the weighted terms to the RL gradients already accumulated.

**Gradient reach, by size.** Which trained parameters each term can change depends on the parameter mode (with LoRA
on the coupling attention only, the transition cross-entropy has no gradient path to any trained parameter: the
predictor reads the state, which no coupling layer touches), and a path can exist yet carry almost nothing: with the
coupling gates near 0, the flow-matching term's gradient on B is ~1e-4 of what it is with open gates (exactly 0 at
gate 0), yet not ``None``. On the first call every term's gradient is measured over *every* parameter of the network
(frozen ones included, for that one measurement). A group of trained tensors (:func:`trained_group`) is **reached**
by a term when the term's gradient norm on the group is at least :data:`REACH_FLOOR` of its gradient norm on the
whole network (:attr:`AnchorLosses.shares`); :attr:`AnchorLosses.reach` counts the trained tensors of reached groups
with a non-zero gradient (``anchor_<term>_reach``, in the run's first row), :attr:`AnchorLosses.paths` those with
any gradient path, :attr:`AnchorLosses.leverage` the share on all trained tensors together (not defined while the
term's gradient is exactly 0 everywhere, as the reference penalty's is at the start). A weighted term with no
gradient path to any trained tensor is never computed or applied; one that reaches no group is applied with a
warning that it can barely change the trained parameters. With every coupling gate at 0 the flow-matching term
reaches neither B nor the coupling LoRA; demo:world's gates (0.019 at most) let it reach both, by gradient norms
~300x smaller than with every gate at 0.5; the transition term reaches B whatever the gates. The check runs on the
weights of the process's first optimizer step (a resumed run measures again on the weights it resumes from, to
decide which terms run); ``anchor_<term>_reach`` is logged in the run's first step only, so a resumed run's rows
equal the uninterrupted run's. The per-step size is ``grad_norm_<term>_<group>`` below.

**Leverage, every step** (world models, even with every anchor weight 0): ``coupling_gate_<i>`` (the gate of block
``i``'s coupling attention) and ``grad_norm_<term>_<group>``, the gradient norm each loss term puts on each group
of trained tensors (``rl`` = the objective's loss, measured before the anchors add theirs; ``fm`` / ``trans`` /
``ref`` = the weighted anchor terms; groups: ``transition`` = B, ``coupling`` = the coupling attention's own
weights, ``coupling_lora`` = LoRA on it, else the top-level module's name).

**Sigmas as the SFT drew them.** The flow-matching and reference terms draw ``sigma`` with
:func:`flowforge.algorithms.schedules.sample_sigmas` (``anchor.sigma_sampling``: ``logit_normal`` with mean 0 and
std 1, as the world SFT draws them by default, or ``uniform``) from the anchor's own generator, and weigh every clip
1, as the SFT's loss does; the rollout's ``T``-step sampling schedule is not involved. The FM term weighs pixel rows
as the SFT did when ``anchor.paddle_rows`` / ``paddle_weight`` are set to the SFT's values
(:func:`flowforge.algorithms.losses.anchors.row_weights`; default weight 1: unweighted, as the SFT's default;
``demo:world`` was made with 2 / 10, ``examples/worldmodel/sft.yaml``, and the world RL examples set the same).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from flowforge.algorithms.losses import anchors as anchor_math
from flowforge.algorithms.schedules import sample_sigmas
from flowforge.rollout import generated_index, with_condition
from flowforge.settings import Checks, Section
from flowforge.settings.sections import SIGMA_SAMPLINGS

log = logging.getLogger(__name__)

ANCHOR_CLIPS = ("atari",)
"""``anchor.clips`` values: the real clips of :mod:`flowforge.data.atari` (Breakout, the demo world model's game)."""
TERMS = ("fm", "trans", "ref")
REACH_FLOOR = 1e-3
"""A group of trained tensors is reached by a term when the term's gradient norm on the group is at least this share
of its gradient norm on the whole network (module docstring): with gates of ~1e-4 (the world base made before
demo:world) the flow-matching term's share on B was 6e-5, at open gates (0.5) 0.50."""


@dataclass(frozen=True)
class AnchorConfig(Section):
    """Anchor losses of a world-model run (module docstring); inactive for other model families."""

    section_name = "anchor"

    fm_weight: float = 0.1  # lambda_fm: flow-matching MSE on real clips
    trans_weight: float = 0.01  # lambda_trans: transition-code cross-entropy on real clips
    ref_weight: float = 0.0  # velocity MSE to the reference (SFT) policy on real clips
    batch_size: int = 4  # real clips per optimizer step
    sigma_sampling: str = "logit_normal"  # how the FM / ref terms draw sigma: as the world SFT (sft.sigma_sampling)
    paddle_rows: int = 2  # the FM term weighs the last paddle_rows pixel rows by paddle_weight: as the world SFT
    paddle_weight: float = 1.0  # (sft.paddle_rows / sft.paddle_weight; demo:world was made with 2 / 10)
    clips: str = "atari"  # where the real clips come from
    episodes: int = 64  # real episodes recorded for the stream (the demo's recording; its train split is used)

    def problems(self) -> list[str]:
        c = Checks(self)
        c.positive("fm_weight", "trans_weight", "ref_weight", allow_zero=True)
        c.positive("batch_size", "paddle_weight")
        c.positive("paddle_rows", allow_zero=True)
        c.choice("sigma_sampling", SIGMA_SAMPLINGS)
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
    """The anchor of a run, or None (not a world model). Loads the real training clips (recorded once and cached
    under ``cache_dir``) when a weight is > 0; with every weight 0 it only logs the leverage metrics."""
    if not _is_world_model(adapter):
        return None
    if not any(w > 0 for w in section.weights.values()):
        return AnchorLosses(section, adapter, policy, None, None, seed=seed)
    from flowforge.data.atari import AtariDataConfig, load_atari_clips

    clips = load_atari_clips(AtariDataConfig(episodes=section.episodes), cache_dir)
    video, actions = clips.clips(clips.split("train"))
    return AnchorLosses(section, adapter, policy, video, actions, seed=seed)


class AnchorLosses:
    """The anchor terms of one run (module docstring).

    Args:
        section: weights, batch size, sigma sampling.
        adapter: the world-model adapter (its ``transformer`` the live network of ``policy``).
        policy: the policy bank (its trained parameters, its reference policy for ``ref_weight``).
        video: ``[N, 1, F, H, W]`` float in [0, 1], the real clips. actions: ``[N, F]`` int64 action ids. Both None
            when every weight is 0 (then only the leverage metrics are logged).
        seed: the run seed.

    Raises:
        ValueError: clips that do not fit the model; ``ref_weight > 0`` without a reference policy in the bank.
    """

    def __init__(self, section: AnchorConfig, adapter, policy, video: torch.Tensor, actions: torch.Tensor, *,
                 seed: int):
        active = any(w > 0 for w in section.weights.values())
        if active and (video is None or video.ndim != 5 or actions.shape != (video.shape[0], video.shape[2])
                       or video.shape[0] == 0):
            raise ValueError(f"anchor clips must be [N, C, F, H, W] with actions [N, F], got "
                             f"{None if video is None else tuple(video.shape)} and "
                             f"{None if actions is None else tuple(actions.shape)}")
        if section.ref_weight > 0 and not policy.has("ref"):
            raise ValueError("anchor.ref_weight > 0 needs the reference policy in the bank (anchor_policy_bank)")
        self.section, self.adapter, self.policy, self.seed = section, adapter, policy, seed
        self.video, self.actions = video, actions
        # the FM term's per-row weights [1, 1, 1, H, 1] (all 1 by default: multiplying by 1 is exact); no clips, no term
        self.fm_rows = None if video is None else anchor_math.row_weights(
            video.shape[-1], section.paddle_rows, section.paddle_weight).view(1, 1, 1, -1, 1)
        self.reach: dict[str, int] | None = None  # term -> non-zero trained tensors of reached groups (first call)
        self.paths: dict[str, int] = {}  # term -> trained tensors with a gradient path (first call)
        self.leverage: dict[str, float] = {}  # term -> share of its gradient on the trained tensors (first call)
        self.shares: dict[str, dict[str, float]] = {}  # term -> group -> share of its gradient (first call)
        names = [n for n, p in adapter.transformer.named_parameters() if p.requires_grad]
        self.groups = {n: trained_group(n) for n in names}

    def clip_batch(self, step: int):
        """``(x0 [b, C, F, H, W] in [-1, 1], noise, sigma [b], cond)`` of optimizer step ``step``: clips, noise and
        sigma from a generator seeded by ``(seed, step)`` only."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + 7 * step + 11)
        rows = torch.randint(0, self.video.shape[0], (self.section.batch_size,), generator=gen)
        sigma = sample_sigmas(rows.numel(), gen, kind=self.section.sigma_sampling)
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
                out["fm"], metrics["fm"] = anchor_math.anchor_fm_loss(v, x0[gen], noise[gen], self.fm_rows)
            if w["ref"] > 0 and "ref" not in skip:
                out["ref"] = (v - v_ref).pow(2).mean()
        if w["trans"] > 0 and "trans" not in skip:
            model = self.adapter.transformer
            logits = model.transition_logits(cond.image, cond.prompt_embeds, x0.shape[2])
            out["trans"], metrics["trans"] = anchor_math.transition_ce_loss(logits, model.transition_labels(x0))
        return out, metrics

    def measure_reach(self, step: int) -> dict[str, int]:
        """On the terms of step ``step`` computed with every parameter of the network requiring a gradient (for this
        measurement only): per term the trained tensors it reaches by size (returned; module docstring),
        :attr:`paths`, :attr:`shares` (group -> share of the term's gradient norm) and :attr:`leverage`."""
        model = self.adapter.transformer
        frozen = [p for p in model.parameters() if not p.requires_grad and p.is_floating_point()]
        for p in frozen:
            p.requires_grad_(True)
        try:
            terms, _ = self.terms(step)
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            reach = {}
            for name, term in terms.items():
                reach[name] = self.paths[name] = 0
                if term is None or not term.requires_grad:  # no graph at all: no path to any parameter
                    continue
                grads = torch.autograd.grad(term, [p for _, p in named], allow_unused=True, retain_graph=True)
                sq = {n: float(g.detach().float().pow(2).sum()) for (n, _), g in zip(named, grads) if g is not None}
                trained = {n: v for n, v in sq.items() if n in self.groups}
                self.paths[name] = len(trained)
                total = sum(sq.values())
                if total <= 0:  # exactly 0 everywhere (the reference penalty at the start): nothing to measure
                    continue
                self.leverage[name] = (sum(trained.values()) / total) ** 0.5
                by_group: dict[str, float] = {}
                for n, v in trained.items():
                    by_group[self.groups[n]] = by_group.get(self.groups[n], 0.0) + v
                self.shares[name] = {g: (v / total) ** 0.5 for g, v in sorted(by_group.items())}
                reached = {g for g, share in self.shares[name].items() if share >= REACH_FLOOR}
                reach[name] = sum(v > 0 and self.groups[n] in reached for n, v in trained.items())
        finally:
            for p in frozen:
                p.requires_grad_(False)
        for name, term in terms.items():
            weight = self.section.weights[name]
            if term is not None:
                shares = ", ".join(f"{g} {v:.1e}" for g, v in self.shares.get(name, {}).items()) or "none"
                log.info("anchor %s: reaches %d of %d trained tensors (a group is reached when its share of the "
                         "term's gradient norm is >= %.0e; shares: %s), a gradient path to %d, leverage %s",
                         name, reach[name], len(self.groups), REACH_FLOOR, shares, self.paths[name],
                         f"{self.leverage[name]:.2e}" if name in self.leverage else "undefined (zero gradient)")
            if term is not None and self.paths[name] == 0:
                log.warning("anchor.%s_weight=%s but the %s term has no gradient path to any trained parameter in "
                            "this parameter mode: it is not applied", name, weight, name)
            elif term is not None and name in self.leverage and reach[name] == 0:
                log.warning("anchor.%s_weight=%s: the %s term reaches no trained group (leverage %.1e, under the "
                            "floor %.0e; the coupling gates may be ~0): it can barely change them", name, weight,
                            name, self.leverage[name], REACH_FLOOR)
        return reach

    def group_norms(self, grads: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
        """``{group: 0-d}`` gradient norms of ``{trained name: gradient}`` per :func:`trained_group`."""
        sq: dict[str, torch.Tensor] = {}
        for name, g in grads.items():
            value = torch.zeros(()) if g is None else g.detach().float().pow(2).sum().cpu()
            sq[self.groups[name]] = sq.get(self.groups[name], torch.zeros(())) + value
        return {k: v.sqrt() for k, v in sq.items()}

    def leverage_metrics(self, terms: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
        """``coupling_gate_<i>`` and ``grad_norm_<term>_<group>`` (module docstring) of this optimizer step: the RL
        gradients already accumulated, and each present weighted anchor term's (``retain_graph``: the terms are
        applied afterwards)."""
        model = self.adapter.transformer
        out = {f"coupling_gate_{i}": b.coupling.gate.detach().float().reshape(()).cpu()
               for i, b in enumerate(model.blocks)}
        named = [(n, p) for n, p in model.named_parameters() if n in self.groups]
        out.update({f"grad_norm_rl_{k}": v for k, v in self.group_norms({n: p.grad for n, p in named}).items()})
        for name, term in terms.items():
            if term is None or not term.requires_grad or self.section.weights[name] <= 0:
                continue
            grads = torch.autograd.grad(self.section.weights[name] * term, [p for _, p in named], allow_unused=True,
                                        retain_graph=True)
            norms = self.group_norms({n: g for (n, _), g in zip(named, grads)})
            out.update({f"grad_norm_{name}_{k}": v for k, v in norms.items()})
        return out

    def backward(self) -> dict[str, torch.Tensor]:
        """Add the gradients of the weighted terms of the coming optimizer step; returns ``anchor_<term>`` values,
        ``anchor_loss`` (their weighted sum), ``anchor_<term>_reach`` and the leverage metrics."""
        step = self.policy.optimizer_steps
        if not any(w > 0 for w in self.section.weights.values()):
            return self.leverage_metrics(dict.fromkeys(TERMS))
        if self.reach is None:
            self.reach = self.measure_reach(step)
        skip = tuple(k for k, n in self.paths.items() if n == 0)
        terms, metrics = self.terms(step, skip)
        out = self.leverage_metrics(terms)
        loss, values = anchor_math.combine_anchor_terms(terms, self.section.weights)
        if loss.requires_grad:
            self.policy.backward(loss)
        out.update({f"anchor_{k}": v for k, v in values.items()})
        out.update({f"anchor_{k}": v.detach() for term, m in metrics.items() if term in values for k, v in m.items()})
        if any(w > 0 for w in self.section.weights.values()):
            out["anchor_loss"] = loss.detach()
        # Only the run's first optimizer step logs the reach: a resumed process measures again (paths decide which
        # terms run) on weights that have moved, and a row that differed from the uninterrupted run's would break
        # resume's bit-for-bit metrics.
        for k, n in self.reach.items():
            if self.section.weights[k] > 0 and step == 0:
                out[f"anchor_{k}_reach"] = torch.tensor(float(n))
        return out


def trained_group(name: str) -> str:
    """The group a trained tensor of a world model is reported under: ``transition`` (B), ``coupling_lora`` (LoRA on
    the coupling attention), ``coupling`` (its own weights and gate), ``lora`` (other LoRA), else the top-level
    module's name."""
    if ".lora_" in name:
        return "coupling_lora" if ".coupling." in name else "lora"
    if name.startswith("latent_state_rollout.transition."):
        return "transition"
    if ".coupling." in name:
        return "coupling"
    return name.split(".")[0]
