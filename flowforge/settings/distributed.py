"""The ``distributed`` config section: data parallelism (DDP / FSDP2) under torchrun, and context parallelism.

==========================================  =========================================================================
key                                         meaning
==========================================  =========================================================================
``strategy``                                ``ddp`` | ``fsdp``: how gradients are averaged over the ranks
``param_dtype`` / ``reduce_dtype``          FSDP2 ``MixedPrecisionPolicy`` dtypes
``activation_checkpointing``                recompute block activations in the backward pass
``context_parallel.ulysses``                Ulysses degree: ranks that split one sample's sequence by all-to-all
                                            around attention (1 = off)
``context_parallel.ring``                   ring-attention degree (1 = off; on CUDA needs an attention backend that
                                            returns the log-sum-exp, ``context_parallel.attention_backend``; on
                                            CPU PyTorch's CPU flash kernel, set by flowforge)
``context_parallel.attention_backend``      diffusers attention backend set on the transformer before context
                                            parallelism is enabled (None: the model's own, ``native`` SDPA)
==========================================  =========================================================================

Context parallelism runs through diffusers' own hooks (:mod:`flowforge.runtime.context_parallel`,
docs/guides/context-parallel.md); which families support it and whether the sizes split evenly is checked by preflight.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flowforge.settings.schema import Checks, Section


@dataclass(frozen=True)
class ContextParallelSettings(Section):
    """``distributed.context_parallel``: degrees of the sequence split (both 1 = off, the default)."""

    section_name = "distributed.context_parallel"

    ulysses: int = 1
    ring: int = 1
    attention_backend: str | None = None  # e.g. "flash" or "_native_cudnn" for ring attention on CUDA

    @property
    def degree(self) -> int:
        """Ranks sharing one sample's sequence: ``ulysses * ring`` (1 = context parallelism off)."""
        return self.ulysses * self.ring

    def problems(self) -> list[str]:
        c = Checks(self)
        for key in ("ulysses", "ring"):
            value = getattr(self, key)
            c.require(value >= 1, f"{c.where(key)}={value!r} must be an integer >= 1 (1 = off)")
        return c.problems


@dataclass(frozen=True)
class DistributedConfig(Section):
    section_name = "distributed"

    strategy: str = "ddp"  # "ddp" | "fsdp"; used when launched by torchrun with WORLD_SIZE > 1
    param_dtype: str = "float32"  # FSDP2 MixedPrecisionPolicy param dtype ("bfloat16" on GPUs)
    reduce_dtype: str = "float32"
    activation_checkpointing: bool = False
    context_parallel: ContextParallelSettings = field(default_factory=ContextParallelSettings)
