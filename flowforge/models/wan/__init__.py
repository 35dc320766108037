"""Wan 2.1 / 2.2 (``model.adapter: wan``).

==============  ====================================================================================================
module          contents
==============  ====================================================================================================
``spec``        ``FAMILY``: the family's :class:`~flowforge.models.family.Family` (registry, export facts, probe)
``adapter``     :class:`WanAdapter`, :func:`load_wan`
``experts``     Wan 2.2 A14B's two experts as one module
==============  ====================================================================================================
"""

from flowforge.models.wan.adapter import WanAdapter, load_wan
from flowforge.models.wan.spec import FAMILY

__all__ = ["FAMILY", "WanAdapter", "load_wan"]
