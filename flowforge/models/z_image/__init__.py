"""Z-Image (``model.adapter: z_image``).

==============  ====================================================================================================
module          contents
==============  ====================================================================================================
``spec``        ``FAMILY``: the family's :class:`~flowforge.models.family.Family` (registry, export facts, probe)
``adapter``     :class:`ZImageAdapter`, :func:`load_z_image`
==============  ====================================================================================================
"""

from flowforge.models.z_image.adapter import ZImageAdapter, load_z_image
from flowforge.models.z_image.spec import FAMILY

__all__ = ["FAMILY", "ZImageAdapter", "load_z_image"]
