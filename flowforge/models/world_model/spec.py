"""The world model's spec (:class:`flowforge.models.family.Family`): flowforge's own action-conditioned video
network, saved in its own format (``flowforge export`` writes it with :mod:`flowforge.tools.export.world`)."""

from __future__ import annotations

from flowforge.models.family import Family

FAMILY = Family(
    name="world_model", adapter="flowforge.models.world_model.adapter:WorldModelAdapter",
    loader="flowforge.models.world_model.adapter:load_world_model", tasks=("i2v",), default_task="i2v", own_format=True)
