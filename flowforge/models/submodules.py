"""Exact submodules of a transformer as the unit of training (``lora.trainable: module``).

In module mode the policy bank (:class:`flowforge.policy.Policy`) trains exactly the named submodules in full and
keeps its other policies (old / ref / EMA) as copies of those submodules only; every other weight is one frozen
backbone shared by all policies. Evaluating another policy swaps its copies into the module tree for the duration
(:func:`swapped_submodules`): parameter names stay the same and nothing else moves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from torch import nn


def check_submodules(root: nn.Module, paths: Sequence[str]) -> tuple[str, ...]:
    """``paths`` as a tuple after checking that each names a submodule of ``root`` exactly (no pattern matching),
    none twice and none inside another (their parameters would be trained twice).

    Raises:
        ValueError: no paths; an unknown path (a few existing ones are named); a repeated or nested path.
    """
    paths = tuple(paths)
    names = dict(root.named_modules())
    unknown = [p for p in paths if not p or p not in names]
    if not paths or unknown:
        hint = [n for n in names if n.count(".") <= 1 and n][:8]
        raise ValueError(f"trainable submodules {list(unknown) or list(paths)} are not submodules of "
                         f"{type(root).__name__}; exact paths such as {hint}")
    nested = [(a, b) for a in paths for b in paths if a != b and b.startswith(a + ".")]
    if len(set(paths)) != len(paths) or nested:
        raise ValueError(f"trainable submodules {list(paths)} repeat or contain one another: {nested}")
    return paths


def _set_submodule(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, module)


@contextlib.contextmanager
def swapped_submodules(root: nn.Module, paths: Sequence[str], replacements: Sequence[nn.Module]) -> Iterator[None]:
    """Within the context ``root.get_submodule(paths[i])`` is ``replacements[i]``; the originals are put back on
    exit (also on an error).

    Raises:
        ValueError: ``paths`` and ``replacements`` differ in length.
    """
    if len(paths) != len(replacements):
        raise ValueError(f"{len(paths)} paths but {len(replacements)} replacement modules")
    originals = [root.get_submodule(p) for p in paths]
    try:
        for path, module in zip(paths, replacements):
            _set_submodule(root, path, module)
        yield
    finally:
        for path, module in zip(paths, originals):
            _set_submodule(root, path, module)
