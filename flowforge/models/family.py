"""One model family as one spec: :class:`Family`, what the registry, preflight, ``sample`` and ``flowforge export``
know about a family, all in one frozen record that the family's package exports as ``FAMILY``
(``flowforge/models/<family>/spec.py``, listed once in :data:`flowforge.models.registry.FAMILY_PACKAGES`).

==================  ==================================================================================================
field               meaning
==================  ==================================================================================================
``name``            ``model.adapter`` of a config (``"sd3"``, ``"wan"``, ...)
``adapter``         the adapter class as ``"module:Class"``, imported on demand (no weights loaded)
``loader``          the loader ``(path, *, task?, dtype, device, ...) -> FlowModel`` as ``"module:function"``
``tasks``           the ``model.task`` values the family runs (checked once, by :meth:`Family.check_task`)
``context_parallel`` whether ``distributed.context_parallel`` splits its sequence (measured equal to one rank's)
``own_format``      saved in a file format of its own rather than as a diffusers transformer (the world model)
``transformer``     the diffusers class of its transformer (``None``: its own network)
``export_pipeline`` the diffusers pipeline whose ``save_lora_weights`` / ``load_lora_weights`` write and load the LoRA
``probe``           the fixed inputs ``flowforge export --verify`` runs the transformer on (:class:`Probe`)
==================  ==================================================================================================
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from flowforge.models.base import Conditioning, FlowModel
from flowforge.runtime.imports import import_object

Randn = Callable[..., Tensor]
"""``randn(*shape) -> Tensor`` fp32 from the probe's seeded generator."""


@dataclass(frozen=True)
class Probe:
    """One family's verification inputs for ``flowforge export --verify``: ``inputs(config, randn) -> (x [2, *latent],
    cond)`` shaped from the transformer's config, and, when the adapter class is not simply ``Class(transformer)``
    around a bare transformer (no text encoder, no VAE), ``adapter(family_class, transformer)``."""

    inputs: Callable[[Any, Randn], tuple[Tensor, Conditioning]]
    adapter: Callable[[type, nn.Module], FlowModel] | None = None


@dataclass(frozen=True)
class Family:
    """A registered model family (the table of the module docstring gives each field's meaning).

    ``export_pipeline``: the diffusers pipeline class (a name in ``diffusers``) whose ``save_lora_weights`` writes
    the family's LoRA for ``flowforge export --form adapter`` and whose ``load_lora_weights`` loads it, when the base
    directory names no pipeline with a LoRA loader of its own; ``None``: none of the family's pipelines has a LoRA
    loader, so the export writes the same diffusers file without one and it loads on the transformer
    (``load_lora_adapter``, or peft's ``PeftModel.from_pretrained``).
    """

    name: str
    adapter: str  # "module:Class"
    loader: str  # "module:function"
    tasks: tuple[str, ...]
    default_task: str | None = None  # passed to the loader when no task is given (None: the loader decides)
    context_parallel: bool = False
    no_context_parallel_why: str = ""  # "": "<transformer> declares no _cp_plan"
    own_format: bool = False
    transformer: str | None = None  # diffusers class name
    export_pipeline: str | None = None
    probe: Probe | None = None

    def check_task(self, task: str) -> None:
        """The one check of ``model.task`` against the family.

        Raises:
            ValueError: ``task`` is not one of :attr:`tasks` (they are listed).
        """
        if task not in self.tasks:
            raise ValueError(f"model.task={task!r}: the {self.name} adapter runs only {list(self.tasks)}")

    def context_parallel_problem(self) -> str | None:
        """Why ``distributed.context_parallel`` cannot split this family's sequence (``None``: it can)."""
        if self.context_parallel:
            return None
        return self.no_context_parallel_why or f"{self.transformer or 'its transformer'} declares no _cp_plan"

    def adapter_class(self) -> type:
        """The adapter class, imported (no weights loaded)."""
        return import_object(self.adapter, f"model.adapter={self.name!r}")

    def load(self, path: str, task: str | None = None, **kw: Any) -> FlowModel:
        """Load the family's model at local ``path``: ``task`` checked (:meth:`check_task`; ``None``: the
        family's :attr:`default_task`), then the loader called with it and ``kw`` (``dtype``, ``device``, ...).

        Raises:
            ValueError: a task the family does not run.
        """
        task = self.default_task if task is None else task
        if task is not None:
            self.check_task(task)
        loader = import_object(self.loader, f"model.adapter={self.name!r}")
        return loader(path, task=task, **kw)
