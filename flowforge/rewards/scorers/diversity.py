"""Group diversity: a reward for being unlike the other candidates of the same prompt.

RL against a single-mode reward collapses each prompt's samples onto a few prototypes (on the embedded default
within-prompt diversity falls from 0.245 to ~0.15 while DigitEval rises). This component pays each candidate its
share of the group's diversity, so a weighted sum with the task reward trades accuracy against collapse explicitly:

    d_ij  = ||P(x_i) - P(x_j)||_2 / sqrt(D)        (RMS distance, pixels in [0, 1])
    r_i   = mean_{j != i, j in group} d_ij

``P`` is ``pool x pool`` average pooling (``pool = 1``: none). Pooling is why this is not the eval metric itself:
with ``pool = 1`` the group mean of ``r_i`` equals :func:`flowforge.train.metrics.within_group_diversity` of the
group, which a policy can inflate with high-frequency speckle that changes no shape; averaging 2x2 or 4x4 blocks
leaves shape and stroke variation and damps per-pixel texture. Within a group the advantage of ``r_i`` rewards the
members that sit apart from the rest (the leave-one-out pairwise-distance bonus of diversity-regularised policy
optimisation); its scale is ~0.1-0.3, so its reward weight sets the trade (the demo uses 1.0 next to ``digit``).

A group scorer (``needs_group = True``): the reward processor calls it once per prompt group, with every candidate.
Videos are scored frame by frame like any image scorer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from flowforge.rewards.base import check_inputs


class GroupDiversity:
    """``r_i`` = mean pooled RMS distance of candidate ``i`` to the other candidates of its group (module docstring).

    Args:
        pool: average-pooling factor ``>= 1`` applied before the distance (must divide H and W of the media).

    Raises:
        ValueError: ``pool`` is not an int >= 1.
    """

    name = "group_diversity"
    needs_group: ClassVar[bool] = True

    def __init__(self, pool: int = 2) -> None:
        if isinstance(pool, bool) or not isinstance(pool, int) or pool < 1:
            raise ValueError(f"group_diversity pool must be an int >= 1, got {pool!r}")
        self.pool = pool

    @torch.no_grad()
    def __call__(self, media: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> Tensor:
        """``media [K, 3, H, W]`` in [0, 1], one group -> ``[K]`` float32 on ``media``'s device, in pixel units
        (0 = identical to every other member); NaN for a group of one (nothing to differ from).

        Raises:
            ValueError: bad shapes or lengths; ``pool`` does not divide H and W; prompts of more than one group.
        """
        k = check_inputs(media, prompts, metadata)
        if len(set(prompts)) > 1:
            raise ValueError(f"group_diversity scores one group at a time, got prompts {sorted(set(prompts))}")
        h, w = media.shape[-2:]
        if h % self.pool or w % self.pool:
            raise ValueError(f"group_diversity pool={self.pool} must divide the image size {h}x{w}")
        if k < 2:
            return torch.full((k,), float("nan"), device=media.device)
        x = torch.nn.functional.avg_pool2d(media.float(), self.pool) if self.pool > 1 else media.float()
        flat = x.reshape(k, -1)
        dist = torch.cdist(flat[None], flat[None])[0] / flat.shape[1] ** 0.5  # [K, K], zero diagonal
        return dist.sum(1) / (k - 1)
