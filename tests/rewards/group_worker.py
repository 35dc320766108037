"""One rank of the cross-rank group-scoring test (run under ``python -m torch.distributed.run``, gloo).

Usage: python tests/rewards/group_worker.py OUT_FILE. For each layout in :data:`LAYOUTS` this rank scores its share
of the candidates (shuffled) with a group scorer and a per-sample scorer, and saves the scores, the metrics and the
groups its scorer was called with to ``OUT_FILE.rank<R>``; then again with a ``single_client`` group scorer
(every group scored on rank 0), and with one that raises (every rank must raise it).
"""

import sys

import torch

from flowforge.rewards import RewardProcessor
from flowforge.rewards.registry import build_scorer
from flowforge.runtime import distributed as dist_lib

LAYOUTS = {
    # canonical group ids and each rank's contiguous share of them
    "unequal": ([0, 0, 0, 1, 1, 1, 1, 2, 2, 2], [slice(0, 4), slice(4, 10)]),  # group 1: 1 member on rank 0, 3 on 1
    "trainer": ([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2], [slice(0, 6), slice(6, 12)]),  # M=3 x K=4: group 1 split 2 / 2
}


class Spent:
    """A single-client group scorer whose every call fails as a judge with a spent budget does."""

    name = "spent"
    needs_group = True
    single_client = True

    def __call__(self, media, prompts, metadata):
        from flowforge.rewards.judge.ledger import BudgetExhausted

        raise BudgetExhausted("teacher budget spent")


def canonical_batch(group_ids):
    """Media, prompts and metadata of every candidate in canonical order (the same on every rank)."""
    sizes = torch.bincount(torch.tensor(group_ids)).tolist()
    members = [sum(1 for h in group_ids[:i] if h == g) for i, g in enumerate(group_ids)]
    meta = [{"group": g, "member": k, "size": sizes[g]} for g, k in zip(group_ids, members)]
    media = torch.rand(len(group_ids), 3, 8, 8, generator=torch.Generator().manual_seed(11))
    return media, [f"prompt {g}" for g in group_ids], meta


def main() -> None:
    out = sys.argv[1]
    info = dist_lib.init("cpu")
    record = {}
    for name, (group_ids, shares) in LAYOUTS.items():
        media, prompts, meta = canonical_batch(group_ids)
        share = torch.arange(len(group_ids))[shares[info.rank]]
        share = share[torch.randperm(len(share), generator=torch.Generator().manual_seed(info.rank))]  # local order
        scorer = build_scorer("tests.rewards.byo_scorers:GroupRank")
        brightness = build_scorer("tests.rewards.byo_scorers:Brightness")
        processor = RewardProcessor({"rank": scorer, "brightness": brightness}, {"rank": 1.0}, batch_size=2)
        rows = share.tolist()
        components, metrics = processor(media[share], [prompts[i] for i in rows], [meta[i] for i in rows],
                                        torch.tensor(group_ids)[share], dist=info)
        record[name] = {"share": share, "components": components, "calls": scorer.calls,
                        "groups_scored": metrics["reward/rank_groups_scored"],
                        "first_fraction": metrics["reward/rank_first_fraction"]}
        single = build_scorer("tests.rewards.byo_scorers:GroupRank")
        single.single_client = True  # as the vlm_judge declares: rank 0 alone calls it
        components, _ = RewardProcessor({"rank": single}, {"rank": 1.0})(
            media[share], [prompts[i] for i in rows], [meta[i] for i in rows], torch.tensor(group_ids)[share],
            dist=info)
        record[name]["single"] = {"components": components, "calls": single.calls}
        try:  # rank 0's scorer fails (a spent judge budget): every rank raises it, none waits for the scores
            RewardProcessor({"spent": Spent()}, {"spent": 1.0})(
                media[share], [prompts[i] for i in rows], [meta[i] for i in rows], torch.tensor(group_ids)[share],
                dist=info)
            record[name]["raised"] = None
        except Exception as exc:
            record[name]["raised"] = f"{type(exc).__name__}: {exc}"
    torch.save(record, f"{out}.rank{info.rank}")
    dist_lib.shutdown()  # a group left to interpreter teardown can abort the rank after its work is done
    dist_lib.exit_now(0)


if __name__ == "__main__":
    main()
