"""LTX-2, video with its audio (``model.adapter: ltx2``).

==============  ====================================================================================================
module          contents
==============  ====================================================================================================
``spec``        ``FAMILY``: the family's :class:`~flowforge.models.family.Family` (registry, export facts, probe)
``adapter``     :class:`LTX2Adapter`, :func:`load_ltx2`
==============  ====================================================================================================
"""

from flowforge.models.ltx2.adapter import LTX2Adapter, load_ltx2
from flowforge.models.ltx2.spec import FAMILY

__all__ = ["FAMILY", "LTX2Adapter", "load_ltx2"]
