"""Scorers the test servers host by import path (``tests.serve.scorers:Name``), to exercise failures over HTTP."""

from __future__ import annotations

import time

import torch


class Flaky:
    """Fails (an internal error, HTTP 500) on its first ``failures`` calls, then scores the mean pixel value."""

    name = "flaky"
    needs_group = False

    def __init__(self, failures: int = 2) -> None:
        self.failures = failures
        self.calls = 0

    def __call__(self, media, prompts, metadata):
        self.calls += 1
        if self.calls <= self.failures:
            raise RuntimeError(f"transient failure {self.calls}")
        return media.float().mean(dim=(1, 2, 3))


class Slow:
    """Sleeps ``metadata[0]["sleep"]`` seconds, then scores 1.0."""

    name = "slow"
    needs_group = False

    def __call__(self, media, prompts, metadata):
        time.sleep(float(metadata[0].get("sleep", 0.0)))
        return torch.ones(media.shape[0])


class Broken:
    """Always fails."""

    name = "broken"
    needs_group = False

    def __call__(self, media, prompts, metadata):
        raise RuntimeError("this scorer is broken")


class NotApplicable:
    """NaN for samples without ``metadata["score"]``, else that score."""

    name = "not_applicable"
    needs_group = False

    def __call__(self, media, prompts, metadata):
        return torch.tensor([float(m.get("score", float("nan"))) for m in metadata])
