"""Library messages that say nothing to a flowforge user, silenced only while flowforge runs the code that triggers
them (the user's own process keeps its logging settings outside those blocks).

=============================================  ========================================================================
message                                        why it is noise
=============================================  ========================================================================
``[transformers] `SiglipImageProcessor`        transformers >= 5 warns once per image-processor class when a diffusers
requires torchvision (not installed); ...``    pipeline module is imported without torchvision and falls back to the
(logger ``transformers.utils.import_utils``)   PIL processor; flowforge never uses those processors (its text encoders
                                               and VAEs load without them), so nothing is degraded
``Loading weights``, ``Writing model shards``  transformers / diffusers / huggingface_hub progress bars while an
(progress bars of the three libraries)         export loads or copies a base: one bar per internal save or load of a
                                               command that logs its own progress in one line (a stderr full of
                                               bars also hid the one-line refusals a user must read)
=============================================  ========================================================================
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

TRANSFORMERS_IMPORT_LOGGER = "transformers.utils.import_utils"


@contextlib.contextmanager
def library_progress_bars_off() -> Iterator[None]:
    """Within the block, transformers', diffusers' and huggingface_hub's progress bars are off; each library's switch
    is put back as it was after (also on an exception), so a user's own setting survives. Used by export (its base
    copy's save bars) and by every command run with ``--no-progress`` (MiniLM's "Loading weights" bars)."""
    import diffusers.utils.logging as diffusers_logging
    import huggingface_hub.utils as hub_utils
    import transformers.utils.logging as transformers_logging

    bars = (transformers_logging.is_progress_bar_enabled(), diffusers_logging.is_progress_bar_enabled(),
            hub_utils.are_progress_bars_disabled())
    transformers_logging.disable_progress_bar()
    diffusers_logging.disable_progress_bar()
    hub_utils.disable_progress_bars()
    try:
        yield
    finally:
        if bars[0]:
            transformers_logging.enable_progress_bar()
        if bars[1]:
            diffusers_logging.enable_progress_bar()
        if not bars[2]:
            hub_utils.enable_progress_bars()


@contextlib.contextmanager
def quiet_library_fallbacks() -> Iterator[None]:
    """Within the block, the loggers of the module table log ERROR and above only and the libraries' progress bars
    are off; both are restored after (also on an exception). Thread-unsafe in the way ``logging`` levels are: meant
    for a command's main thread."""
    logger = logging.getLogger(TRANSFORMERS_IMPORT_LOGGER)
    before = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with library_progress_bars_off():
            yield
    finally:
        logger.setLevel(before)
