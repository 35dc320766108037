"""HunyuanVideo 1.5 (``model.adapter: hunyuan_video15``).

==============  ====================================================================================================
module          contents
==============  ====================================================================================================
``spec``        ``FAMILY``: the family's :class:`~flowforge.models.family.Family` (registry, export facts, probe)
``adapter``     :class:`HunyuanVideo15Adapter`, :func:`load_hunyuan_video15`
``text``        the Qwen2.5-VL + ByT5 (glyph) prompt encoder
==============  ====================================================================================================
"""

from flowforge.models.hunyuan_video15.adapter import HunyuanVideo15Adapter, load_hunyuan_video15
from flowforge.models.hunyuan_video15.spec import FAMILY

__all__ = ["FAMILY", "HunyuanVideo15Adapter", "load_hunyuan_video15"]
