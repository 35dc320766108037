"""The trained policy: which weights train (LoRA via peft, or all), the optimizer and LR schedule, the reference.

* **live** — the weights being optimized (LoRA adapter ``"default"``, or the full transformer), kept in fp32.
* **ref** — the immutable starting point: "adapters off" under LoRA, a frozen copy under full fine-tuning.
  Used for KL terms only; built lazily so runs without KL carry no copy.

The LR schedule is counted in optimizer steps: linear warmup over ``warmup_steps`` then constant, linear decay to 0
or cosine decay to 0 at ``total_steps``.
"""

from __future__ import annotations

import contextlib
import copy
import math
from typing import Iterator

import torch
from torch import nn

from flowforge.config import LoraConfig, TrainConfig
from flowforge.models import lora as lora_lib


def lr_lambda(schedule: str, warmup_steps: int, total_steps: int):
    """Multiplier of the base LR after ``n`` optimizer steps (warmup, then constant / linear / cosine to 0)."""

    def f(n: int) -> float:
        if warmup_steps > 0 and n < warmup_steps:
            return (n + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (n - warmup_steps) / max(1, total_steps - warmup_steps))
        if schedule == "linear":
            return 1.0 - progress
        if schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        raise ValueError(f"train.lr_schedule={schedule!r} is not one of ['constant', 'linear', 'cosine']")

    return f


class Policy:
    """Trainable weights of ``adapter.transformer`` with their optimizer.

    Args:
        adapter: a FlowModel; its ``transformer`` is modified in place (LoRA injected, grads enabled).
        lora_cfg: ``lora`` section (mode, rank, alpha, targets).
        train_cfg: ``train`` section (optimizer, LR schedule).
        total_optimizer_steps: length of the LR schedule.
    """

    def __init__(self, adapter, lora_cfg: LoraConfig, train_cfg: TrainConfig, total_optimizer_steps: int):
        self.adapter = adapter
        self.lora_cfg = lora_cfg
        transformer: nn.Module = adapter.transformer
        transformer.requires_grad_(False)
        if lora_cfg.trainable == "lora":
            targets = list(lora_cfg.targets or adapter.lora_targets)
            lora_lib.inject_lora(transformer, lora_cfg.resolved_rank, lora_cfg.resolved_alpha, targets)
            self.params = [p for p in transformer.parameters() if p.requires_grad]
        else:
            transformer.float().requires_grad_(True)
            self.params = list(transformer.parameters())
        transformer.eval()  # no dropout anywhere: rollout and replay must be the same function
        self._ref_copy: nn.Module | None = None
        self.optimizer = torch.optim.AdamW(self.params, lr=train_cfg.lr, betas=train_cfg.adam_betas,
                                           eps=train_cfg.adam_eps, weight_decay=train_cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(train_cfg.lr_schedule, train_cfg.warmup_steps, total_optimizer_steps))
        self.grad_clip = train_cfg.grad_clip
        self.optimizer_steps = 0

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def num_trainable(self) -> int:
        return sum(p.numel() for p in self.params)

    def step(self) -> torch.Tensor:
        """Clip gradients, take one optimizer + LR-schedule step, zero the gradients. Returns the pre-clip norm."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        return grad_norm.detach()

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        """Within this context ``adapter.velocity`` evaluates the reference (starting) policy, without gradients."""
        if self.lora_cfg.trainable == "lora":
            with torch.no_grad(), lora_lib.adapters_disabled(self.adapter.transformer):
                yield
            return
        if self._ref_copy is None:
            raise RuntimeError("the full fine-tune reference copy was not kept: call keep_reference() before training")
        live = self.adapter.transformer
        self.adapter.transformer = self._ref_copy
        try:
            with torch.no_grad():
                yield
        finally:
            self.adapter.transformer = live

    def keep_reference(self) -> None:
        """Keep a frozen copy of the starting weights (full fine-tune only; LoRA's reference is adapters-off)."""
        if self.lora_cfg.trainable == "full" and self._ref_copy is None:
            self._ref_copy = copy.deepcopy(self.adapter.transformer).requires_grad_(False).eval()
