"""``flowforge plan``: a per-rank GPU memory plan of a training config, from the config's real model.

Sizes are exact (the diffusers transformer built on the ``meta`` device from the model's ``config.json`` or the
published table, LoRA counted by peft on that model: :mod:`.sizes`); activations are measured on the CPU at the
model's real width and reduced depth, then scaled in depth and tokens (:mod:`.activations`); the budget adds them
up per rank and phase (:mod:`.budget`). :func:`plan_config` returns a :class:`~.budget.Plan` with the change that
would make it fit when it does not.
"""

from flowforge.tools.plan.budget import GPUS, Plan, check_gpu, render
from flowforge.tools.plan.plan import MEASURE_VERSION, cache_dir, plan_config, setting_of
from flowforge.tools.plan.sizes import ModelSpec, published, spec_for

__all__ = ["GPUS", "MEASURE_VERSION", "ModelSpec", "Plan", "cache_dir", "check_gpu", "plan_config", "published",
           "render", "setting_of", "spec_for"]
