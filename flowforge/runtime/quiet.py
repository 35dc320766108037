"""Library messages that say nothing to a flowforge user, silenced only while flowforge runs the code that triggers
them (the user's own process keeps its logging settings outside those blocks).

=============================================  ========================================================================
message                                        why it is noise
=============================================  ========================================================================
``[transformers] `SiglipImageProcessor`        transformers >= 5 warns once per image-processor class when a diffusers
requires torchvision (not installed); ...``    pipeline module is imported without torchvision and falls back to the
(logger ``transformers.utils.import_utils``)   PIL processor; flowforge never uses those processors (its text encoders
                                               and VAEs load without them), so nothing is degraded
=============================================  ========================================================================
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

TRANSFORMERS_IMPORT_LOGGER = "transformers.utils.import_utils"


@contextlib.contextmanager
def quiet_library_fallbacks() -> Iterator[None]:
    """Within the block, the loggers of the module table log ERROR and above only; their levels are restored after
    (also on an exception). Thread-unsafe in the way ``logging`` levels are: meant for a command's main thread."""
    logger = logging.getLogger(TRANSFORMERS_IMPORT_LOGGER)
    before = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(before)
