"""Student reward models distilled from the teacher judge's groups (stage B of the three-stage pipeline).

:mod:`.data` (judged groups from the judge's request ledger, the cluster split), :mod:`.vlm_json` (a VLM LoRA-tuned
to answer the judge's JSON), :mod:`.scalar_head` (a small CNN + prompt embedding, a plain reward scorer),
:mod:`.evaluate` (held-out agreement with the teacher, the quality gate), :mod:`.train` (resumable training),
:mod:`.students` (build / load by kind), :mod:`.config` (the ``student`` section). Imports nothing at package
import.
"""
