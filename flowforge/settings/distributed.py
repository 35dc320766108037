"""The ``distributed`` config section: data parallelism (DDP / FSDP2) under torchrun, and context parallelism.

==========================================  =========================================================================
key                                         meaning
==========================================  =========================================================================
``strategy``                                ``ddp`` | ``fsdp``: how gradients are averaged over the ranks
``param_dtype`` / ``reduce_dtype``          FSDP2 ``MixedPrecisionPolicy`` dtypes
``activation_checkpointing``                recompute block activations in the backward pass
``offload``                                 ``none`` | ``optimizer`` | ``params``: what FSDP keeps in host (CPU)
                                            memory instead of the GPU (below); needs ``strategy: fsdp`` on >= 2 ranks
``context_parallel.ulysses``                Ulysses degree: ranks that split one sample's sequence by all-to-all
                                            around attention (1 = off)
``context_parallel.ring``                   ring-attention degree (1 = off; on CUDA needs an attention backend that
                                            returns the log-sum-exp, ``context_parallel.attention_backend``; on
                                            CPU PyTorch's CPU flash kernel, set by flowforge)
``context_parallel.attention_backend``      diffusers attention backend set on the transformer before context
                                            parallelism is enabled (None: the model's own, ``native`` SDPA)
==========================================  =========================================================================

``offload`` (per rank, FSDP2 on ``N`` ranks; "host" = CPU RAM of the rank's machine):

* ``none``: everything on the compute device.
* ``optimizer``: the AdamW states (``exp_avg``, ``exp_avg_sq``, fp32) live on the host, with a host fp32 copy of
  each trained shard and its gradient; the optimizer step runs on the CPU (copy gradients and weights down, step,
  copy the weights back up: :class:`flowforge.runtime.offload.HostOffloadAdamW`). The sharded weights and the
  gradients of the backward pass stay on the GPU. Saves ``8`` bytes per trained parameter / ``N`` of GPU memory.
* ``params``: FSDP2's own ``CPUOffloadPolicy``: every sharded parameter (frozen base and trained), its gradient and
  the AdamW states live on the host; each block's shard is copied up before its all-gather, gradients are copied
  down after the reduce-scatter, the optimizer step runs on the CPU. The GPU holds only the gathered blocks in use
  (``collective buffers``) and activations. Saves all weights / gradients / states of the transformer.

Under either mode the frozen policy copies of full / module training (``old``, ``ref``, ``ema``: whole copies of
what trains, :mod:`flowforge.policy`) live on the host and are copied to the GPU only while they are evaluated; LoRA's
``old`` / ``ema`` adapters sit inside the transformer and follow its weights (host under ``params``). Results equal
``none`` (the same AdamW arithmetic, on the CPU). ``flowforge plan`` moves the offloaded items to host lines.
Offload without FSDP (one process, or ``strategy: ddp``) is a preflight error, not a silent no-op: the memory would
stay on the GPU that the setting was chosen to relieve.

Context parallelism runs through diffusers' own hooks (:mod:`flowforge.runtime.context_parallel`,
docs/guides/context-parallel.md); which families support it and whether the sizes split evenly is checked by preflight.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flowforge.settings.schema import Checks, Section

OFFLOAD_MODES = ("none", "optimizer", "params")


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
    """Data parallelism under torchrun (``strategy``: DDP or FSDP2), FSDP2's mixed precision, activation
    checkpointing, offload to host memory and context parallelism. ``offload`` needs ``strategy: fsdp`` on >= 2 ranks
    (otherwise a preflight error, not a silent no-op): ``none`` keeps everything on the GPU; ``optimizer`` keeps the
    AdamW states, plus an fp32 host copy of each trained shard and of its gradient, in host (CPU) memory and runs the
    optimizer step there (the sharded weights and the backward's gradients stay on the GPU); ``params`` applies
    FSDP2's ``CPUOffloadPolicy``: every sharded parameter (frozen and trained), its gradient and the AdamW states live
    in host memory and each block's shard is copied to the GPU for its all-gather. Under either mode the whole frozen
    policy copies of full / module training (old, ref, EMA) live in host memory and are on the GPU only while
    evaluated; LoRA's old / EMA adapters follow the transformer's weights. Results equal ``none``
    (docs/guides/scaling.md); ``flowforge plan`` shows the offloaded items as host lines."""

    section_name = "distributed"

    strategy: str = "ddp"  # "ddp" | "fsdp"; used when launched by torchrun with WORLD_SIZE > 1
    param_dtype: str = "float32"  # FSDP2 MixedPrecisionPolicy param dtype ("bfloat16" on GPUs)
    reduce_dtype: str = "float32"
    activation_checkpointing: bool = False
    offload: str = "none"  # "none" | "optimizer" (AdamW on the CPU) | "params" (FSDP2 CPUOffloadPolicy): see above
    context_parallel: ContextParallelSettings = field(default_factory=ContextParallelSettings)

    def problems(self) -> list[str]:
        c = Checks(self)
        c.choice("offload", OFFLOAD_MODES)
        return c.problems
