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
``packed_latents``  its latents are packed 2x2 into the channel axis before the transformer (``in_channels`` counts
                    2x2 cells)
``own_format``      saved in a file format of its own rather than as a diffusers transformer (the world model)
``transformer``     the diffusers class of its transformer (``None``: its own network)
``export_pipeline`` the diffusers pipeline whose ``save_lora_weights`` / ``load_lora_weights`` write and load the LoRA
``probe``           the fixed inputs ``flowforge export --verify`` runs the transformer on (:class:`Probe`)
==================  ==================================================================================================
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor, nn

from flowforge.models.base import AdapterMixin, Conditioning, FlowModel

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
    packed_latents: bool = False
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
        return _resolve(self.adapter)

    def loader_function(self) -> Callable[..., FlowModel]:
        """The loader, imported."""
        return _resolve(self.loader)

    def load(self, path: str, task: str | None = None, **kw: Any) -> FlowModel:
        """Load the family's model at local ``path``: ``task`` checked (:meth:`check_task`; ``None``: the
        family's :attr:`default_task`), then the loader called with it and ``kw`` (``dtype``, ``device``, ...).

        Raises:
            ValueError: a task the family does not run.
        """
        task = self.default_task if task is None else task
        if task is not None:
            self.check_task(task)
        return self.loader_function()(path, task=task, **kw)


def _resolve(ref: str) -> Any:
    """The object a spec's ``"module:attr"`` names (flowforge's own modules: imported as they are)."""
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


class FamilyAdapter(AdapterMixin):
    """The base of a registered family's adapter class: :class:`~flowforge.models.base.AdapterMixin`'s hooks and the
    classmethod every family's adapter had, :meth:`from_pretrained`, read from the class's :attr:`family_spec` (its
    :class:`Family`; ``family``, where an adapter has it, is the family's display name in messages). Bring-your-own
    adapters inherit :class:`AdapterMixin` instead (a class without ``from_pretrained`` is built as ``Class(path,
    **kw)`` by :func:`flowforge.models.build_adapter`)."""

    family_spec: ClassVar[Family]

    @classmethod
    def from_pretrained(cls, path: Any, **kwargs: Any) -> FlowModel:
        """Same as the family's loader (``load_<family>(path, **kwargs)``, :attr:`Family.loader`)."""
        return cls.family_spec.loader_function()(path, **kwargs)
