"""Qwen-Image and Qwen-Image-Edit (``model.adapter: qwen_image``).

==============  ====================================================================================================
module          contents
==============  ====================================================================================================
``spec``        ``FAMILY``: the family's :class:`~flowforge.models.family.Family` (registry, export facts, probe)
``adapter``     :class:`QwenImageAdapter`, :func:`load_qwen_image`
``text``        the Qwen2.5-VL prompt encoder (text, and text with condition images)
==============  ====================================================================================================
"""

from flowforge.models.qwen_image.adapter import QwenImageAdapter, load_qwen_image
from flowforge.models.qwen_image.spec import FAMILY

__all__ = ["FAMILY", "QwenImageAdapter", "load_qwen_image"]
