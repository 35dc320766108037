"""FLUX.2 [dev] and Klein (``model.adapter: flux2``).

==============  ====================================================================================================
module          contents
==============  ====================================================================================================
``spec``        ``FAMILY``: the family's :class:`~flowforge.models.family.Family` (registry, export facts, probe)
``adapter``     :class:`Flux2Adapter`, :func:`load_flux2`
==============  ====================================================================================================
"""

from flowforge.models.flux2.adapter import Flux2Adapter, load_flux2
from flowforge.models.flux2.spec import FAMILY

__all__ = ["FAMILY", "Flux2Adapter", "load_flux2"]
