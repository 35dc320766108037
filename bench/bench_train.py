"""Optimize overhead: flowforge's FlowGRPO update vs a bare loop making the same forward/backward calls.

    python bench/bench_train.py [--repeats 5]

Both arms replay the same stored steps in the same micro-batches (forward with grad, backward, one AdamW step per
update) on the same LoRA-injected transformer; the bare loop inlines the log-prob and clipped surrogate with no
metrics or bookkeeping. Weights are restored before every measurement so both arms do identical work.
"""

import argparse

import torch

from common import build, interleave, report
from flowforge.objectives import TrainBatch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    tr = build()
    sb = tr.next_prompts()
    traj, cond = tr.sample(sb, 0)
    adv = torch.randn(len(sb.candidate_ids))
    batch = TrainBatch(traj=traj, cond=cond, advantages=adv, group_ids=sb.group_ids, rewards=adv,
                       candidate_ids=sb.candidate_ids)
    policy, model = tr.policy, tr.adapter.transformer
    start = [p.detach().clone() for p in policy.params]
    opt_state = policy.optimizer.state_dict()
    cfg = tr.cfg
    clip = cfg.grpo.clip_low
    eta = cfg.sampler.noise_level
    sig = traj.sigmas

    def restore():
        with torch.no_grad():
            for p, s in zip(policy.params, start):
                p.copy_(s)
        policy.optimizer.load_state_dict(opt_state)

    def ours():
        restore()
        tr.objective.optimize(batch)

    def bare():
        restore()
        n_upd, mb = cfg.train.num_updates_per_batch, cfg.train.micro_batch_size
        per = len(batch) // n_upd
        S = len(traj.trained_steps)
        for u in range(n_upd):
            for m0 in range(u * per, (u + 1) * per, mb):
                rows = torch.arange(m0, m0 + mb)
                c = cond.index(rows)
                for j, i in enumerate(traj.trained_steps):
                    s, sn = sig[i], sig[i + 1]
                    x, xn = traj.latents[rows, j], traj.next_latents[rows, j]
                    v = model(hidden_states=x, timestep=(1000 * s).expand(mb), encoder_hidden_states=c.prompt_embeds,
                              pooled_projections=c.pooled, return_dict=False)[0].float()
                    dt = sn - s
                    g = eta * torch.sqrt(s / (1 - (sig[1] if s == 1 else s)))
                    mean = x * (1 + g**2 / (2 * s) * dt) + v * (1 + g**2 * (1 - s) / (2 * s)) * dt
                    std = g * torch.sqrt(-dt)
                    lp = (-((xn - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.9189385).mean((1, 2, 3))
                    ratio = torch.exp(lp - traj.log_probs[rows, j])
                    a = adv[rows]
                    loss = torch.maximum(-a * ratio, -a * ratio.clamp(1 - clip, 1 + clip)).mean()
                    (loss * mb / per / S).backward()
            torch.nn.utils.clip_grad_norm_(policy.params, cfg.train.grad_clip)
            policy.optimizer.step()
            policy.optimizer.zero_grad(set_to_none=True)

    report(f"optimize ({len(batch)} samples x {len(traj.trained_steps)} trained steps, "
           f"{cfg.train.num_updates_per_batch} updates)", *interleave(ours, bare, args.repeats))


if __name__ == "__main__":
    main()
