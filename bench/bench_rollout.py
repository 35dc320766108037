"""Rollout overhead: flowforge's rollout vs a bare loop making the same transformer calls.

    python bench/bench_rollout.py [--repeats 10]

Both arms run the same chunks (micro-batch size) of the same candidates through the same number of transformer
forwards at the same sigmas; the bare loop calls the diffusers transformer directly and does the FlowGRPO SDE update
inline with no bookkeeping. The printed ratio is flowforge / bare, measured alternately in one process.
"""

import argparse

import torch

from common import build, interleave, report
from flowforge.rollout import rollout_chunked


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    tr = build()
    sb = tr.next_prompts()
    spec = tr.objective.rollout_spec(0)
    cond = tr.train_cond.index(sb.prompt_indices)
    ids = sb.candidate_ids.tolist()
    mb = tr.cfg.train.micro_batch_size
    sig = tr.sigmas
    model = tr.adapter.transformer
    eta = spec.noise_level
    noise = torch.randn(len(ids), len(sig), *tr.latent_shape)

    def ours():
        rollout_chunked(tr.adapter, cond, ids, sig, spec, latent_shape=tr.latent_shape, seed=0, batch_size=mb)

    @torch.no_grad()
    def bare():
        for start in range(0, len(ids), mb):
            c = cond.index(torch.arange(start, start + mb))
            x = noise[start:start + mb, 0]
            for i in range(len(sig) - 1):
                s, sn = sig[i], sig[i + 1]
                v = model(hidden_states=x, timestep=(1000 * s).expand(mb), encoder_hidden_states=c.prompt_embeds,
                          pooled_projections=c.pooled, return_dict=False)[0].float()
                dt = sn - s
                if i in spec.trained_steps:
                    g = eta * torch.sqrt(s / (1 - (sig[1] if s == 1 else s)))
                    mean = x * (1 + g**2 / (2 * s) * dt) + v * (1 + g**2 * (1 - s) / (2 * s)) * dt
                    x_next = mean + g * torch.sqrt(-dt) * noise[start:start + mb, i + 1]
                    -((x_next - mean) ** 2).mean()  # the log-prob's work, roughly
                    x = x_next
                else:
                    x = x + v * dt

    report(f"rollout ({len(ids)} candidates, {len(sig) - 1} steps, {len(spec.trained_steps)} SDE)",
           *interleave(ours, bare, args.repeats))


if __name__ == "__main__":
    main()
