"""Bring-your-own scorers imported by path in tests (``tests.rewards.byo_scorers:Name``)."""

from __future__ import annotations

import torch


class Brightness:
    """``scale *`` mean pixel value: a class that declares ``name`` / ``needs_group``."""

    name = "brightness"
    needs_group = False

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale

    def __call__(self, media, prompts, metadata):
        return self.scale * media.float().mean(dim=(1, 2, 3))


def make_brightness(scale: float = 1.0) -> Brightness:
    """A plain function factory."""
    return Brightness(scale)


class GroupRank:
    """A group scorer: each candidate's rank (0 = darkest) among the candidates it is called with, which must be one
    whole group (``metadata["group"]`` equal, ``metadata["size"]`` members); records every call's groups."""

    name = "group_rank"
    needs_group = True

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def __call__(self, media, prompts, metadata):
        groups = sorted({m["group"] for m in metadata})
        if len(groups) != 1 or len(metadata) != metadata[0]["size"]:
            raise ValueError(f"not one whole group: groups {groups}, {len(metadata)} members")
        self.calls.append([m["member"] for m in metadata])
        self.sample_flags = {"first": torch.tensor([m["member"] == 0 for m in metadata])}
        return media.float().mean(dim=(1, 2, 3)).argsort().argsort().float()


class NoGroupFlag:
    name = "no_group_flag"

    def __call__(self, media, prompts, metadata):
        return torch.zeros(media.shape[0])


def not_a_scorer():
    return 42


def failing_factory():
    raise RuntimeError("cannot load my model")


NOT_CALLABLE = 3


class PromptGroupRank:
    """A group scorer for training runs: every call must hold exactly ``group_size`` candidates of one prompt (one
    whole group); scores each candidate's brightness rank within it."""

    name = "prompt_group_rank"
    needs_group = True

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    def __call__(self, media, prompts, metadata):
        if len(set(prompts)) != 1 or len(prompts) != self.group_size:
            raise ValueError(f"not one whole group: {len(prompts)} candidates of prompts {sorted(set(prompts))}")
        return media.float().mean(dim=(1, 2, 3)).argsort().argsort().float()


def mean_above(media, prompts, metadata, threshold=0.5):
    """A scoring function (TRL style): the fraction of pixel values above ``threshold`` per image, as a list."""
    return [float((m > threshold).float().mean()) for m in media]


def make_from_three(scale, offset, power):
    """A factory whose three required arguments come from the options."""
    assert offset == 0.0 and power == 1.0
    return Brightness(scale)


def two_args(media, prompts):
    return [0.0] * len(prompts)


def wrong_shape(media, prompts, metadata):
    return torch.zeros(media.shape[0], 1)


def explodes_when_called(media, prompts, metadata):
    raise RuntimeError("preflight must not call a scoring function")


def latent_energy(latents, prompts, metadata, scale=1.0):
    """A latent scoring function (first parameter named ``latents``): ``-scale *`` the mean squared latent."""
    return -scale * latents.float().pow(2).flatten(1).mean(dim=1)
