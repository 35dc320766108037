"""Run a tiny training job (under torchrun or alone) and save what the distributed tests compare.

Usage: python tests/dist_worker.py OUT_FILE STOP_AT override [override ...]
Each rank writes OUT_FILE with its rank appended: the advantages it trained on (keyed by candidate id), the final
latents of its candidates, and the live weights after the run.
"""

import sys

import torch

from flowforge.config import load_config
from flowforge.runtime.distributed import exit_now, shutdown
from flowforge.train.trainer import Trainer


def main() -> None:
    out, stop_at, overrides = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    trainer = Trainer(load_config(None, overrides), progress=False)
    seen = {"candidate_ids": [], "advantages": [], "finals": []}
    advantages, sample = trainer.advantages, trainer.sample

    def spy_advantages(components, batch):
        adv, total, metrics = advantages(components, batch)
        seen["candidate_ids"].append(batch.candidate_ids.clone())
        seen["advantages"].append(adv.clone())
        return adv, total, metrics

    def spy_sample(batch, step):
        traj, cond = sample(batch, step)
        seen["finals"].append(traj.final.clone())
        return traj, cond

    trainer.advantages, trainer.sample = spy_advantages, spy_sample
    trainer.train(stop_at=stop_at if stop_at > 0 else None)
    live = trainer.policy.named_weights("live")  # a collective under FSDP
    record = {k: torch.cat(v) if v else torch.empty(0) for k, v in seen.items()}
    record["live"] = live
    torch.save(record, f"{out}.rank{trainer.dist.rank}")
    shutdown()
    exit_now(0)  # a finished rank must not abort in C++ teardown (see exit_now)


if __name__ == "__main__":
    main()
