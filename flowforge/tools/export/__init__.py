"""Export a trained run as a model other tools load: a merged diffusers transformer, or a diffusers / peft LoRA.

:func:`~flowforge.tools.export.run.export_run` and the writers per family are :mod:`.run` (its docstring describes
the forms, the files and the verification); the pieces live beside it (:mod:`.source`, :mod:`.out`, :mod:`.verify`,
:mod:`.card`, one module per file format). This module re-exports the API.
"""

from __future__ import annotations

from flowforge.tools.export.diffusers import LORA_WEIGHT_NAME
from flowforge.tools.export.out import EXPORT_META, ExportError
from flowforge.tools.export.run import (DIFFUSERS_WRITER, FORMS, WAN_EXPERTS_WRITER, WEIGHT_GROUPS, WRITERS, Writer,
                                        export_run, read_export_meta)
from flowforge.tools.export.verify import TOLERANCES, ExportVerificationError, VerifyReport
from flowforge.tools.export.weights import PEFT_PREFIX, PEFT_WEIGHT_NAME

__all__ = ["DIFFUSERS_WRITER", "EXPORT_META", "ExportError", "ExportVerificationError", "FORMS", "LORA_WEIGHT_NAME",
           "PEFT_PREFIX", "PEFT_WEIGHT_NAME", "TOLERANCES", "VerifyReport", "WAN_EXPERTS_WRITER", "WEIGHT_GROUPS",
           "WRITERS", "Writer", "export_run", "read_export_meta"]
