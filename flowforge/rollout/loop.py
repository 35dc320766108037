"""The one denoising loop: rollout of trajectories, replay of stored steps, and plain generation.

Every sampler in flowforge is this loop. An objective *declares* what it needs (:class:`RolloutSpec`: which steps
are stochastic and stored, whether per-step log-probs are recorded); nothing copies the loop.

For each step ``i`` of the schedule ``sigmas [T+1]`` (``sigmas[T] == 0``)::

    v      = adapter.velocity(x, sigmas[i], cond, guidance_scale)
    x      = transition(kind, x, v, sigmas[i], sigmas[i+1], eta, noise=eps_i)   if i is a trained step
    x      = euler_step(x, v, sigmas[i], sigmas[i+1])                           otherwise (ODE; with
                                                         spec.solver "dpm2" the DPM-Solver++(2M) step instead)

Trained steps store ``x`` (the step's input), the sampled ``x_next`` and the step's log-prob (mean over the generated
elements, fp32). :func:`replay_log_prob` re-scores a stored step under the current weights with the *same* kernel
call, so the first update's importance ratio is exactly 1 when the weights have not moved.

Image-conditioned latents (Wan i2v, :class:`~flowforge.models.base.ImageConditioned`): ``cond.image`` is written into
``x[adapter.condition_index]`` before the first step and every transition acts on ``x[adapter.generated_index]``
only, so the condition slot is re-pinned after every step by construction and never enters a log-prob.

Candidate noise (``x_T`` and each stochastic step's ``eps_i``) is a function of the candidate's stable sample id,
the run seed and the step index only — never of the rank, batch position or chunking — so two candidates never share
noise and a rerun reproduces them (:func:`candidate_noise`).

Notation: ``B`` candidates in the batch, ``S`` trained steps, ``T`` sampling steps, latent ``[C, H, W]``
(``[C, F, H, W]`` video).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch

from flowforge.algorithms import schedules
from flowforge.algorithms.sde import euler_step, transition
from flowforge.algorithms.solvers import dpm_solver_2_update
from flowforge.models.base import Conditioning, FlowModel, check_condition_slot
from flowforge.rollout.noise import candidate_noise


@dataclass(frozen=True)
class RolloutSpec:
    """What an objective needs recorded from a rollout."""

    kind: str  # transition kernel on trained steps: "sde" | "dance" | "cps" | "ode"
    noise_level: float  # eta
    trained_steps: tuple[int, ...]  # S step indices, sorted, never the last step
    guidance_scale: float = 1.0
    store_steps: bool = True  # keep x / x_next of trained steps (replay objectives)
    log_probs: bool = True  # record per-step log-probs (ratio objectives)
    store_means: bool = False  # record each trained step's transition mean (GRPO-Guard's old mean)
    solver: str = "euler"  # deterministic steps: "euler" | "dpm2" (DPM-Solver++(2M), algorithms.solvers)


@dataclass(frozen=True)
class Trajectory:
    """A batch of rollouts. Rows are candidates; ``select`` keeps rows."""

    sigmas: torch.Tensor  # [T+1] fp32 schedule the rollout used (stored, never recomputed)
    trained_steps: tuple[int, ...]  # S step indices into sigmas
    final: torch.Tensor  # [B, *latent] fp32 clean latent x_0
    latents: torch.Tensor | None  # [B, S, *latent] fp32 input x of each trained step
    next_latents: torch.Tensor | None  # [B, S, *latent] fp32 sampled x_next of each trained step
    log_probs: torch.Tensor | None  # [B, S] fp32 rollout log-prob of each trained step, mean over elements
    means: torch.Tensor | None = None  # [B, S, *generated] fp32 transition mean of each trained step (if stored)
    policy_version: int | None = None  # the policy version that sampled it (optimizer rounds; None: not tagged)

    def select(self, rows: torch.Tensor) -> "Trajectory":
        def pick(t):
            return None if t is None else t[rows]

        return replace(self, final=self.final[rows], latents=pick(self.latents),
                       next_latents=pick(self.next_latents), log_probs=pick(self.log_probs), means=pick(self.means))

    @staticmethod
    def cat(parts: Sequence["Trajectory"]) -> "Trajectory":
        def cat(name):
            vals = [getattr(p, name) for p in parts]
            return None if vals[0] is None else torch.cat(vals)

        return replace(parts[0], final=cat("final"), latents=cat("latents"), next_latents=cat("next_latents"),
                       log_probs=cat("log_probs"), means=cat("means"))


def sigmas_for(sampler_cfg, latent_shape: Sequence[int] | None = None) -> torch.Tensor:
    """The ``[T+1]`` fp32 schedule for a ``SamplerConfig`` (static / dynamic-mu / Wan).

    For ``schedule == "dynamic"`` without an explicit ``mu``, ``mu`` is FLUX's resolution-dependent shift of the
    image token count ``H*W/4`` of ``latent_shape`` (2x2 patches).
    """
    mu = sampler_cfg.mu
    if sampler_cfg.schedule == "dynamic" and mu is None:
        if latent_shape is None:
            raise ValueError("sampler.schedule='dynamic' without sampler.mu needs the latent shape to compute mu")
        mu = schedules.calculate_shift(int(latent_shape[-1] * latent_shape[-2] // 4))
    return schedules.flow_match_sigmas(sampler_cfg.num_steps, sampler_cfg.shift, mu=mu, kind=sampler_cfg.schedule)


ALL = (slice(None),)
"""The index of a whole batched latent."""


def generated_index(adapter: FlowModel) -> tuple[slice, ...]:
    """``adapter.generated_index``: the latent elements the rollout generates (the whole latent by default).

    Raises:
        TypeError: the adapter declares a ``condition_index`` but no ``generated_index`` (its slot would be stepped
            and trained as if generated).
    """
    check_condition_slot(adapter)
    return adapter.generated_index


def with_condition(adapter: FlowModel, x: torch.Tensor, cond: Conditioning) -> torch.Tensor:
    """``x [B, *latent]`` with ``cond.image`` written into ``x[adapter.condition_index]`` (a copy); ``x`` itself when
    ``cond`` has no image or the adapter consumes the image inside its velocity (no ``condition_index``)."""
    index = adapter.condition_index
    if cond.image is None or index is None:
        return x
    out = x.clone()
    out[index] = cond.image.to(device=out.device, dtype=out.dtype)
    return out


def _assemble(x: torch.Tensor, index: tuple[slice, ...], part: torch.Tensor) -> torch.Tensor:
    """``x`` with ``x[index]`` replaced by ``part`` (``part`` itself for the whole latent)."""
    if index == ALL:
        return part
    out = x.clone()
    out[index] = part
    return out


@torch.no_grad()
def denoise(
    adapter: FlowModel,
    cond: Conditioning,
    x_T: torch.Tensor,
    sigmas: torch.Tensor,
    spec: RolloutSpec,
    step_noise: Callable[[int], torch.Tensor] | None = None,
) -> Trajectory:
    """The denoising loop from ``x_T [B, *latent]`` over ``sigmas [T+1]`` (fp32, ending in 0).

    ``spec.trained_steps`` get ``spec.kind`` transitions with noise ``step_noise(i)`` (``[B, *latent]``; fresh
    normal noise when None), every other step is an Euler (ODE) step. ``cond.image`` (i2v) is pinned into the
    condition slot first; steps act on the generated elements only (see the module docstring).

    Returns:
        :class:`Trajectory` with ``latents / next_latents`` ``[B, S, *latent]`` and ``log_probs`` ``[B, S]`` per spec.
    Raises:
        ValueError: a trained step outside ``[0, T)``.
    """
    num_steps = sigmas.shape[0] - 1
    trained = set(spec.trained_steps)
    if any(not 0 <= i < num_steps for i in trained):
        raise ValueError(f"trained steps {sorted(trained)} outside [0, {num_steps})")
    b = x_T.shape[0]
    gen = generated_index(adapter)
    x = with_condition(adapter, x_T.float(), cond)
    sig = sigmas.to(x.device)
    xs, xns, lps, mus = [], [], [], []
    x0_prev = None  # the last deterministic step's data prediction (dpm2's multistep history)
    for i in range(num_steps):
        v = adapter.velocity(x, sig[i].expand(b), cond, spec.guidance_scale)
        if i in trained and spec.kind != "ode":
            eps = None if step_noise is None else step_noise(i)[gen]
            tr = transition(spec.kind, x[gen], v[gen], sig[i], sig[i + 1], spec.noise_level, noise=eps,
                            sigma_max=sig[1], compute_log_prob=spec.log_probs)
            x_next, x0_prev = _assemble(x, gen, tr.x_next), None  # a stochastic step ends dpm2's history
            if spec.log_probs:
                lps.append(tr.log_prob)
            if spec.store_means:
                mus.append(tr.mean)
        elif spec.solver == "dpm2":
            x_gen, x0_prev = dpm_solver_2_update(x[gen], v[gen], sigmas.cpu(), i, x0_prev)
            x_next = _assemble(x, gen, x_gen)
        else:
            x_next = _assemble(x, gen, euler_step(x[gen], v[gen], sig[i], sig[i + 1]))
        if i in trained and spec.store_steps:
            xs.append(x)
            xns.append(x_next)
        x = x_next
    stack = (lambda ts: torch.stack(ts, dim=1) if ts else None)
    return Trajectory(sigmas=sigmas, trained_steps=tuple(sorted(trained)), final=x,
                      latents=stack(xs), next_latents=stack(xns), log_probs=stack(lps), means=stack(mus))


def rollout(
    adapter: FlowModel,
    cond: Conditioning,
    candidate_ids: Sequence[int],
    sigmas: torch.Tensor,
    spec: RolloutSpec,
    *,
    latent_shape: Sequence[int],
    seed: int,
    device: torch.device | str = "cpu",
) -> Trajectory:
    """:func:`denoise` ``B = len(candidate_ids)`` candidates with their own noise (:func:`candidate_noise`).

    Args:
        cond: conditioning rows aligned with ``candidate_ids`` (``[B, ...]``).
        latent_shape: ``adapter.latent_shape(h, w[, f])``.
        seed: the run seed; noise is a function of (seed, candidate id, step index) only.
    """
    x_T = candidate_noise(candidate_ids, latent_shape, seed, -1).to(device)
    return denoise(adapter, cond, x_T, sigmas, spec,
                   lambda i: candidate_noise(candidate_ids, latent_shape, seed, i).to(device))


def rollout_chunked(adapter, cond, candidate_ids, sigmas, spec, *, latent_shape, seed, batch_size, device="cpu"):
    """:func:`rollout` over consecutive chunks of ``batch_size`` candidates, concatenated in order."""
    parts = []
    for start in range(0, len(candidate_ids), batch_size):
        rows = slice(start, start + batch_size)
        parts.append(rollout(adapter, cond.index(torch.arange(len(candidate_ids))[rows]), candidate_ids[rows],
                             sigmas, spec, latent_shape=latent_shape, seed=seed, device=device))
    return Trajectory.cat(parts)


def rollout_grouped(adapter, cond, candidate_ids, group_ids, sigmas, spec, *, latent_shape, seed, batch_size,
                    on_chunk, device="cpu"):
    """:func:`rollout_chunked` with the rows taken group after group, so that groups finish one by one.

    The rows are stably sorted by ``group_ids`` (``[B]`` int64) and rolled out in consecutive chunks of
    ``batch_size`` of that order -- chunks of the same sizes as :func:`rollout_chunked`'s, each candidate with its own
    noise -- and ``on_chunk(rows, part)`` is called after each chunk (``rows``: the chunk's ``[n]`` int64 indices
    into ``0..B-1``, ``part``: its :class:`Trajectory`), e.g. to decode and score the groups it completes while the
    next chunks roll out (``reward.overlap``). Returns the whole :class:`Trajectory` in the input row order.
    """
    order = torch.argsort(group_ids, stable=True)
    parts = []
    for start in range(0, len(candidate_ids), batch_size):
        rows = order[start:start + batch_size]
        part = rollout(adapter, cond.index(rows), [candidate_ids[i] for i in rows.tolist()], sigmas, spec,
                       latent_shape=latent_shape, seed=seed, device=device)
        on_chunk(rows, part)
        parts.append(part)
    return Trajectory.cat(parts).select(torch.argsort(order))


def replay_log_prob(
    adapter: FlowModel,
    traj: Trajectory,
    slot: int,
    cond: Conditioning,
    spec: RolloutSpec,
):
    """Re-score stored trained step ``traj.trained_steps[slot]`` under the adapter's current weights.

    The same :func:`~flowforge.algorithms.sde.transition` call as in :func:`rollout` with ``x_next`` given, so
    unchanged weights reproduce the rollout log-prob bit for bit. Gradients flow through the velocity of the
    generated elements only (an i2v condition slot has no gradient path).

    Returns:
        the :class:`~flowforge.algorithms.sde.Transition` over ``x[generated_index]`` (``log_prob`` ``[B]`` fp32,
        mean over the generated elements).
    """
    i = traj.trained_steps[slot]
    gen = generated_index(adapter)
    sig = traj.sigmas.to(traj.latents.device)
    x = traj.latents[:, slot]
    v = adapter.velocity(x, sig[i].expand(x.shape[0]), cond, spec.guidance_scale)
    return transition(spec.kind, x[gen], v[gen], sig[i], sig[i + 1], spec.noise_level,
                      x_next=traj.next_latents[:, slot][gen], sigma_max=sig[1])


def generate(adapter: FlowModel, cond: Conditioning, x_T: torch.Tensor, sigmas: torch.Tensor,
             guidance_scale: float = 1.0) -> torch.Tensor:
    """Deterministic ODE (Euler) generation from given noise ``x_T [B, *latent]``; returns ``x_0 [B, *latent]`` fp32."""
    spec = RolloutSpec(kind="ode", noise_level=0.0, trained_steps=(), guidance_scale=guidance_scale,
                       store_steps=False, log_probs=False)
    return denoise(adapter, cond, x_T, sigmas, spec).final
