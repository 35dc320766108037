"""Global RNG state of this process (python, numpy, torch CPU, CUDA): capture and restore, for exact resume.

Checkpoints store it per rank (:mod:`flowforge.train.checkpoint`); kept here because any job that must resume
bit-identically needs the same four generators.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

log = logging.getLogger("flowforge")


def capture_rng() -> dict:
    """This process's global RNG states: ``python`` and ``numpy`` (JSON-able), ``torch`` (uint8 tensor) and
    ``cuda`` (list of uint8 tensors, one per visible device; empty without CUDA)."""
    version, internal, gauss_next = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
        "numpy": {"name": name, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state().clone(),
        "cuda": [s.clone() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
    }


def restore_rng(rng: Mapping[str, Any]) -> None:
    """Restore what :func:`capture_rng` returned (python, numpy, torch CPU, and CUDA when saved and available).

    Raises:
        ValueError: a required key (``python``, ``numpy``, ``torch``) is missing or malformed.
    """
    missing = [k for k in ("python", "numpy", "torch") if k not in rng]
    if missing:
        raise ValueError(f"RNG state is missing {missing}; expected keys ['python', 'numpy', 'torch', 'cuda']")
    try:
        py = rng["python"]
        random.setstate((int(py["version"]), tuple(int(v) for v in py["state"]), py["gauss_next"]))
        npy = rng["numpy"]
        np.random.set_state((npy["name"], np.asarray(npy["keys"], dtype=np.uint32), int(npy["pos"]),
                             int(npy["has_gauss"]), float(npy["cached_gaussian"])))
        torch.set_rng_state(rng["torch"].to(torch.uint8).cpu())
    except (KeyError, TypeError) as e:
        raise ValueError(f"RNG state is malformed: {e!r}") from e
    cuda = list(rng.get("cuda") or [])
    if cuda:
        if not torch.cuda.is_available():
            log.warning("checkpoint has CUDA RNG states for %d devices but CUDA is unavailable: not restored",
                        len(cuda))
        elif len(cuda) != torch.cuda.device_count():
            log.warning("checkpoint has CUDA RNG states for %d devices, %d are visible: not restored", len(cuda),
                        torch.cuda.device_count())
        else:
            torch.cuda.set_rng_state_all([s.to(torch.uint8).cpu() for s in cuda])
