"""Stable Diffusion 3 / 3.5 (``model.adapter: sd3``).

==============  ====================================================================================================
module          contents
==============  ====================================================================================================
``spec``        ``FAMILY``: the family's :class:`~flowforge.models.family.Family` (registry, export facts, probe)
``adapter``     :class:`SD3Adapter`, :func:`load_sd3`
==============  ====================================================================================================
"""

from flowforge.models.sd3.adapter import SD3Adapter, load_sd3
from flowforge.models.sd3.spec import FAMILY

__all__ = ["FAMILY", "SD3Adapter", "load_sd3"]
