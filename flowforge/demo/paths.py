"""The ``demo:`` names of the embedded default and the packaged files they stand for.

A config may name the embedded default's files instead of giving paths (``model.path: demo:base``,
``data.prompts: demo:train``, ``data.eval_prompts: demo:eval``). Those names are resolved here, in the demo
package, by the layers that read configs (:mod:`flowforge.train`, :mod:`flowforge.tools`): the model adapters only
ever see real paths.

==============  =========================================================================================
name            file
==============  =========================================================================================
``demo:base``   ``flowforge/demo/weights/base/``: the SFT base policy (``config.json``,
                ``diffusion_pytorch_model.safetensors``, ``flowforge.json`` naming its MiniLM text encoder)
``demo:train``  ``flowforge/demo/prompts/train.jsonl``: 22 phrasings x 10 digits (:mod:`flowforge.demo.prompts`)
``demo:eval``   ``flowforge/demo/prompts/eval.jsonl``: 6 held-out phrasings x 10 digits
``demo:world``  ``flowforge/demo/weights/world/``: the Atari world model (:mod:`flowforge.demo.world`)
``demo:world-train`` / ``demo:world-eval``: Breakout start frames + actions (train / held-out episodes)
``demo:digit-tower``  ``flowforge/demo/weights/student_digit_tower.safetensors``: a whole ``scalar_head`` student
                (channels 32/64/128, hidden 128) pretrained as a prompt-digit matcher on the ``sft`` split
                (:mod:`flowforge.reward_model.pretrain`)
==============  =========================================================================================
"""

from __future__ import annotations

from pathlib import Path

from flowforge.data.prompts import DEMO_PROMPT_SETS, resolve_prompt_path

DEMO_PREFIX = "demo:"
"""What every demo name starts with."""

DEMO_BASE = "demo:base"
"""The shipped base policy (``model.path``)."""


DEMO_WORLD = "demo:world"
"""The shipped action-conditioned world model (``model.path`` with ``model.adapter: world_model``)."""

DEMO_DIGIT_TOWER = "demo:digit-tower"
"""The pretrained image tower of the digits demo's student (``student.scalar_head.init``)."""

DEMO_NAMES = (DEMO_BASE, DEMO_WORLD, DEMO_DIGIT_TOWER, *DEMO_PROMPT_SETS)
"""Every name :func:`resolve_demo_path` accepts."""

DEMO_DIR = Path(__file__).resolve().parent
"""The installed ``flowforge/demo`` package directory."""


def demo_base_dir() -> Path:
    """Directory of the shipped demo base policy (``config.json`` + ``diffusion_pytorch_model.safetensors`` +
    ``flowforge.json``), loadable by :func:`flowforge.models.sd3.adapter.load_sd3`."""
    return DEMO_DIR / "weights" / "base"


def demo_world_dir() -> Path:
    """Directory of the shipped world model (``config.json`` + ``diffusion_pytorch_model.safetensors`` +
    ``flowforge.json``), loadable by :func:`flowforge.models.world_model.load_world_model`."""
    return DEMO_DIR / "weights" / "world"


def demo_prompts_path(name: str) -> Path:
    """The packaged JSONL file of prompt set ``name`` (``"demo:train"`` or ``"demo:eval"``), resolved by the data
    layer's :func:`flowforge.data.prompts.resolve_prompt_path` (one source of truth for the file names).

    Raises:
        ValueError: ``name`` is not one of :data:`DEMO_PROMPT_SETS`.
    """
    if name not in DEMO_PROMPT_SETS:
        raise ValueError(f"prompt source {name!r}: demo prompt sets are {list(DEMO_PROMPT_SETS)}")
    return resolve_prompt_path(name)


def is_demo_name(source: str | Path) -> bool:
    """Whether ``source`` is spelled as a demo name (starts with ``"demo:"``; a ``Path`` never is)."""
    return isinstance(source, str) and source.startswith(DEMO_PREFIX)


def resolve_demo_path(source: str | Path) -> str | Path:
    """``source`` with a demo name replaced by its packaged path (:data:`DEMO_NAMES`, see the module table);
    anything else (a local path, a hub id) is returned unchanged, so callers pass it on exactly as before.

    Raises:
        ValueError: ``source`` starts with ``"demo:"`` but is not one of :data:`DEMO_NAMES` (they are listed).
    """
    if not is_demo_name(source):
        return source
    if source == DEMO_BASE:
        return demo_base_dir()
    if source == DEMO_WORLD:
        return demo_world_dir()
    if source == DEMO_DIGIT_TOWER:
        return DEMO_DIR / "weights" / "student_digit_tower.safetensors"
    if source in DEMO_PROMPT_SETS:
        return demo_prompts_path(source)
    raise ValueError(f"unknown demo name {source!r}; allowed: {list(DEMO_NAMES)}")
