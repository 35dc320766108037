"""Action-conditioned video world models (``model.adapter: world_model``).

==================  ==============================================================================================
module              contents
==================  ==============================================================================================
``config``          :class:`WorldModelConfig` (reference sizes documented there)
``layers``          attention, FFN, timestep embedding, patches, FSQ
``dit``             the Wan-style video block with its coupling attention to the latent state
``state``           state initializer, transition module B, their rollout over latent frames
``tokenizer``       transition tokenizer (FSQ codes of adjacent frames) and transition predictor
``network``         :class:`WorldModel`, the whole network
``adapter``         :class:`WorldModelAdapter` (FlowModel + ImageConditioned, parameter modes), load / save
``provenance``      provenance rows of a load, source-checkpoint protection
``tiny``            the demo's tiny config and builder
``spec``            ``FAMILY``: the family's :class:`~flowforge.models.family.Family`
==================  ==============================================================================================
"""

from flowforge.models.world_model.adapter import (PARAMETER_MODES, WorldModelAdapter, load_world_model)
from flowforge.models.world_model.config import WorldModelConfig
from flowforge.models.world_model.network import WorldModel
from flowforge.models.world_model.spec import FAMILY

__all__ = ["FAMILY", "PARAMETER_MODES", "WorldModel", "WorldModelAdapter", "WorldModelConfig", "load_world_model"]
