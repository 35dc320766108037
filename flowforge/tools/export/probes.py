"""The fixed inputs ``flowforge export --verify`` runs a diffusers family's transformer on: each family's spec
carries its own (:attr:`flowforge.models.family.Family.probe`, defined in ``flowforge/models/<family>/spec.py``).

:data:`PROBES` maps every registered diffusers family (``model.adapter``) to its
:class:`~flowforge.models.family.Probe`: how to shape seeded fp32 inputs ``(x [2, *latent], seeded conditioning)`` from
the transformer's config, and how to drive a bare transformer (no text encoder, no VAE) through the family's own
adapter, so packing and timestep units are the family's. ``sigma = [0.3, 0.8]`` and guidance 1 for all. A registered
family without its own file format needs a probe in its spec (a test checks).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from flowforge.models.base import Conditioning, FlowModel
from flowforge.models.family import Probe
from flowforge.models.registry import FAMILIES

SEED = 20240601
SIGMA = (0.3, 0.8)

PROBES: dict[str, Probe] = {name: spec.probe for name, spec in FAMILIES.items() if spec.probe is not None}
"""Registered diffusers family -> its verification probe (its spec's); the keys are the families export writes
diffusers files for (:data:`flowforge.tools.export.source.SUPPORTED_ADAPTERS`)."""


def probe_inputs(family: str, config) -> tuple[str, Tensor, Tensor, Conditioning]:
    """``(family, x [2, *latent], sigma [2], cond)``: seeded fp32 inputs shaped from transformer ``config``.

    Raises:
        KeyError: ``family`` has no probe (callers check :data:`PROBES` first).
    """
    gen = torch.Generator().manual_seed(SEED)
    x, cond = PROBES[family].inputs(config, lambda *shape: torch.randn(*shape, generator=gen))
    return family, x, torch.tensor(SIGMA), cond


def family_adapter(family: str, transformer: nn.Module) -> FlowModel:
    """The family's adapter around a bare ``transformer`` (no text encoder, no VAE)."""
    cls, make = FAMILIES[family].adapter_class(), PROBES[family].adapter
    return cls(transformer) if make is None else make(cls, transformer)
