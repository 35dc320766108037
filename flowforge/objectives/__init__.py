"""One module per algorithm: its objective class and its own config section(s); :data:`OBJECTIVES` lists them.

Two families share machinery: **replay** (:mod:`~flowforge.objectives.replay`: ``grpo``, ``grpo_guard``) re-scores
stored SDE steps; **forward process** (:mod:`~flowforge.objectives.forward`: ``nft``, ``awm``, ``dgpo``, ``dpo``,
``crd``) trains on noised final samples; ``draft`` (:mod:`~flowforge.objectives.draft`) backpropagates a
differentiable reward through the sampler's last steps; ``dmd2`` (:mod:`~flowforge.objectives.dmd2`) distils the
starting model into a few-step generator. :mod:`~flowforge.objectives.base` holds the batch record,
the settings an objective reads (:class:`ObjectiveContext`) and the metric accumulator.

Adding an algorithm: a module defining its section(s) and its :class:`Objective` subclass, plus one line in
:mod:`flowforge.objectives.registry`; the root config and preflight pick both up from there.
"""

from flowforge.objectives.awm import AWM, AWMConfig
from flowforge.objectives.base import MetricAccumulator, Objective, ObjectiveContext, TrainBatch, global_sum
from flowforge.objectives.crd import CRD, CRDConfig
from flowforge.objectives.dgpo import DGPO, DGPOConfig
from flowforge.objectives.dmd2 import DMD2, DMD2Config
from flowforge.objectives.dpo import DPO, DPOConfig
from flowforge.objectives.draft import Draft, DraftConfig
from flowforge.objectives.forward import ForwardConfig, ForwardProcessObjective, Visit
from flowforge.objectives.grpo import GRPO, GRPOConfig
from flowforge.objectives.grpo_guard import GRPOGuard, GuardConfig
from flowforge.objectives.nft import NFT, NFTConfig
from flowforge.objectives.registry import OBJECTIVES, objective_sections
from flowforge.objectives.replay import ReplayObjective, trained_steps_for

__all__ = [
    "OBJECTIVES", "objective_sections", "Objective", "ObjectiveContext", "TrainBatch", "MetricAccumulator",
    "global_sum", "ReplayObjective", "trained_steps_for", "ForwardProcessObjective", "Visit",
    "GRPO", "GRPOGuard", "NFT", "AWM", "DGPO", "DPO", "CRD", "Draft", "DMD2",
    "GRPOConfig", "GuardConfig", "ForwardConfig", "NFTConfig", "AWMConfig", "DGPOConfig", "DPOConfig", "CRDConfig",
    "DraftConfig", "DMD2Config",
]
