"""Every algorithm by its ``train.algorithm`` name: one line per objective class.

The order fixes the order of the algorithm sections in the root config (each class's ``sections`` in turn, a
section shared by several classes at its first declaration), so a dumped config keeps its layout when an algorithm
is added at the end.
"""

from __future__ import annotations

from flowforge.objectives.anchors import AnchorConfig
from flowforge.objectives.awm import AWM
from flowforge.objectives.base import Objective
from flowforge.objectives.crd import CRD
from flowforge.objectives.dgpo import DGPO
from flowforge.objectives.dmd2 import DMD2
from flowforge.objectives.dpo import DPO
from flowforge.objectives.dppo import DPPO
from flowforge.objectives.draft import Draft
from flowforge.objectives.grpo import GRPO
from flowforge.objectives.grpo_guard import GRPOGuard
from flowforge.objectives.nft import NFT

OBJECTIVES: dict[str, type[Objective]] = {
    "grpo": GRPO,
    "grpo_guard": GRPOGuard,
    "nft": NFT,
    "awm": AWM,
    "dgpo": DGPO,
    "dpo": DPO,
    "crd": CRD,
    "dppo": DPPO,
    "draft": Draft,
    "dmd2": DMD2,
}
"""Every algorithm, by its ``train.algorithm`` name (each key equals its class's ``name``)."""

SHARED_SECTIONS: tuple[type, ...] = (AnchorConfig,)
"""Sections read by every objective through the base class's hooks (the world-model anchors of
:meth:`~flowforge.objectives.base.Objective.optimizer_step`), placed after the algorithm sections."""


def objective_sections(objectives: dict[str, type[Objective]] | None = None) -> tuple[type, ...]:
    """The config section classes declared by ``objectives`` (default :data:`OBJECTIVES`), in registry order,
    each once, then :data:`SHARED_SECTIONS`.

    Raises:
        ValueError: a key differs from its class's ``name``, or two classes declare different sections of one name.
    """
    found: dict[str, type] = {}
    for key, cls in (OBJECTIVES if objectives is None else objectives).items():
        if key != cls.name:
            raise ValueError(f"objective registered as {key!r} is named {cls.name!r}")
        for section in cls.sections:
            other = found.setdefault(section.section_name, section)
            if other is not section:
                raise ValueError(f"section {section.section_name!r} is declared as {other.__qualname__} and as "
                                 f"{section.__qualname__} (by {cls.__qualname__})")
    for section in SHARED_SECTIONS:
        found.setdefault(section.section_name, section)
    return tuple(found.values())
