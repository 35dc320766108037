"""Reward scorers behind one protocol, a name -> factory registry, and the multi-component reward processor.

See :mod:`flowforge.rewards.base` for the scorer contract, :mod:`flowforge.rewards.registry` for the built-in names
and :mod:`flowforge.rewards.processor` for scoring a batch with several weighted / required components.
"""

from flowforge.rewards.base import RewardScorer
from flowforge.rewards.processor import RewardProcessor
from flowforge.rewards.registry import SCORERS, build_scorer

__all__ = ["SCORERS", "RewardProcessor", "RewardScorer", "build_scorer"]
