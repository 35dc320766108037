"""The student kinds behind one interface: build one from the ``student`` config, load a saved one by its kind.

Every student (:class:`~flowforge.reward_model.vlm_json.VLMJsonStudent`,
:class:`~flowforge.reward_model.scalar_head.ScalarHeadStudent`) has ``kind``, ``backward(groups) -> metrics``
(accumulates the gradient of its loss over judged groups), ``trainable_parameters()``, ``trainable_state()`` /
``load_trainable_state(state)``, ``train()`` / ``eval()``, ``predict(groups) -> [K] scores per group`` (presented
order, on [0, 1], NaN where it could not score), ``save(path)`` and ``load(path, device=...)``. A saved student is a
directory whose ``meta.json`` names its ``kind``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flowforge.reward_model.config import KINDS, StudentConfig

META_FILE = "meta.json"


def create_student(cfg: StudentConfig) -> Any:
    """A fresh student of ``cfg.kind`` (``vlm_json``: the base model + a new LoRA; ``scalar_head``: a new net)."""
    if cfg.kind == "vlm_json":
        from flowforge.reward_model.vlm_json import VLMJsonStudent

        return VLMJsonStudent.create(cfg.vlm_json, device=cfg.device, seed=cfg.seed)
    from flowforge.reward_model.scalar_head import ScalarHeadStudent

    return ScalarHeadStudent(cfg.scalar_head, device=cfg.device, seed=cfg.seed)


def student_kind(path: str | Path) -> str:
    """The ``kind`` recorded in a saved student's ``meta.json``.

    Raises:
        ValueError: no ``meta.json`` or an unknown kind.
    """
    meta = Path(path) / META_FILE
    if not meta.is_file():
        raise ValueError(f"{path} is not a saved student (no {META_FILE})")
    kind = json.loads(meta.read_text()).get("kind")
    if kind not in KINDS:
        raise ValueError(f"{meta} names kind {kind!r}; known kinds: {list(KINDS)}")
    return kind


def load_student(path: str | Path, *, device: str = "cpu") -> Any:
    """The student saved at ``path``, in eval mode."""
    if student_kind(path) == "vlm_json":
        from flowforge.reward_model.vlm_json import VLMJsonStudent

        return VLMJsonStudent.load(path, device=device)
    from flowforge.reward_model.scalar_head import ScalarHeadStudent

    return ScalarHeadStudent.load(path, device=device)
