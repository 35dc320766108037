"""FLUX.1 and FLUX.1 Kontext (``model.adapter: flux``).

==============  ====================================================================================================
module          contents
==============  ====================================================================================================
``spec``        ``FAMILY``: the family's :class:`~flowforge.models.family.Family` (registry, export facts, probe)
``adapter``     :class:`FluxAdapter`, :func:`load_flux`
==============  ====================================================================================================
"""

from flowforge.models.flux.adapter import FluxAdapter, load_flux
from flowforge.models.flux.spec import FAMILY

__all__ = ["FAMILY", "FluxAdapter", "load_flux"]
