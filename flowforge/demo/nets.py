"""Training and storage shared by the world demo's small networks -- the inverse-dynamics judge
(:mod:`flowforge.demo.world`), the inverse-dynamics reward (:mod:`flowforge.demo.world_reward`) and the ball locator
(:mod:`flowforge.demo.world_ball`): one seeded construction, one cross-entropy loop, one weights file format."""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor, nn

Net = TypeVar("Net", bound=nn.Module)


def seeded(factory: Callable[[], Net], seed: int) -> Net:
    """``factory()`` under ``torch.manual_seed(seed)`` in a forked RNG: the same initial weights for a seed, and the
    caller's random stream untouched. A factory that materialises lazy layers does it inside, seeded too."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return factory()


def train_classifier(model: Net, x: Tensor, y: Tensor, *, steps: int, batch_size: int, lr: float,
                     gen: torch.Generator, augment: Callable[[Tensor, torch.Generator], Tensor] | None = None) -> Net:
    """Minimise the cross-entropy of ``model(x[rows])`` against class ids ``y[rows]`` (``x [N, ...]`` float, ``y [N]``
    int64) with AdamW: ``steps`` batches of ``batch_size`` rows drawn from ``gen``, each passed through
    ``augment(batch, gen)`` when given (drawing after the rows). Returns ``model`` in eval mode."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        rows = torch.randint(0, x.shape[0], (batch_size,), generator=gen)
        batch = x[rows] if augment is None else augment(x[rows], gen)
        loss = nn.functional.cross_entropy(model(batch), y[rows])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return model.eval()


def save_weights(model: nn.Module, path: str | pathlib.Path, metadata: dict[str, str]) -> None:
    """``model``'s state dict as safetensors at ``path``, with ``metadata`` (string values; one key keeps the bytes
    fixed, as safetensors writes a map in arbitrary order)."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path), metadata=metadata)


def require_weights(path: str | pathlib.Path, *, what: str, module: str) -> None:
    """Refuse a missing weights file.

    Raises:
        FileNotFoundError: no file at ``path``; the message names ``what`` and ``python -m <module>``, which writes it.
    """
    if not pathlib.Path(path).is_file():
        raise FileNotFoundError(f"{path}: {what} weights missing; run `python -m {module}`")


def load_weights(model: Net, path: str | pathlib.Path, *, what: str, module: str) -> Net:
    """``model`` (built, lazy layers materialised, or on the meta device) with the weights at ``path``, in eval mode.

    Raises:
        FileNotFoundError: as :func:`require_weights`.
    """
    from safetensors.torch import load_file

    require_weights(path, what=what, module=module)
    model.load_state_dict(load_file(str(path)), assign=True)
    return model.eval()
