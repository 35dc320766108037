"""Small helpers shared by the loss tests (float64 random tensors, one SGD step, per-sample flow-matching error)."""
import torch

F64 = torch.float64


def randn(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def sgd(v, grad, lr):
    return (v - lr * grad).detach()


def fm_err(v, target):
    return ((v - target) ** 2).mean(dim=tuple(range(1, v.ndim)))
