"""Trajectory sidecars: each rollout's trajectories and decoded media on disk, one file per prompt group.

What and why
------------
Debugging an RL run means looking at what the policy actually sampled: the images of a group next to their prompt,
the stored latents and per-step log-probs of a candidate whose ratio exploded. :class:`SidecarWriter` writes that
after every rollout, keeps only the newest ``keep`` rollouts, and never leaves a file that looks complete but is not.

Layout::

    <root>/
      step_000041/
        group_3.safetensors      rows of prompt group 3: final, latents, next_latents, log_probs, (means), sigmas,
                                 trained_steps, group_ids, rows, (candidate_ids), (extras); prompt + step in metadata
        group_3_0.png ...        decoded media of the group's candidates, k = 0 .. K-1 in row order
        DONE                     written last: JSON {step, groups, files}; only directories holding it are complete
      step_000042/ ...

Tensor shapes in a group file (``k`` = the group's candidates, ``S`` trained steps, ``T`` sampling steps)::

    final          [k, *latent]      fp32 clean latent x_0
    latents        [k, S, *latent]   fp32 input x of each trained step          (absent if not stored)
    next_latents   [k, S, *latent]   fp32 sampled x_next of each trained step   (absent if not stored)
    log_probs      [k, S]            fp32 rollout log-prob, mean over elements   (absent if not recorded)
    means          [k, S, *generated] fp32 transition means (generated elements)  (only when stored)
    sigmas         [T+1]             fp32 schedule of the rollout
    trained_steps  [S]               int64 step indices into sigmas
    group_ids      [k]               int64 (all equal to the group id)
    rows           [k]               int64 row of each candidate in the rollout batch
    candidate_ids  [k]               int64 stable candidate ids (when given)
    extra.<name>   [k, ...]          caller extras, e.g. rewards / advantages (when given)

safetensors metadata (strings): ``format`` (``flowforge-trajectory-1``), ``step``, ``group_id``, ``prompt``,
``trained_steps`` (JSON list), ``num_candidates``.

Durability
----------
Every file is written to ``.<name>.tmp-<pid>``, fsynced, renamed with ``os.replace`` and its directory fsynced, so a
process killed at any instant leaves either the complete file under its final name or a hidden tmp file that readers
never list (:func:`group_files` matches ``group_*.safetensors`` only). ``DONE`` is written the same way after every
other file of the step; :func:`complete_steps` lists only directories holding it.

Ownership
---------
``root`` must be empty (or missing) or flowforge's own: the writer puts a ``.flowforge-artifacts`` marker in it when
it takes it, and refuses a non-empty root without one (:class:`~flowforge.runtime.errors.UserError`). Inside it,
only step directories whose every file has a name of the layout above (``group_*``, ``DONE`` and their temporaries)
are ever deleted; anything else (a user's ``step_000001/notes.txt``, a ``.x.tmp-1`` at the top) is left alone.

Retention
---------
:meth:`SidecarWriter.reap` deletes every incomplete step directory (debris of a crash) and all but
the newest ``keep`` complete ones; a directory is deleted by unlinking ``DONE`` first, so a crash mid-delete leaves an
incomplete directory, never a half-deleted complete one. :meth:`SidecarWriter.write` reaps at its start leaving room
for the step it writes, so after each write exactly ``min(keep, writes)`` complete step directories exist. A write of
step ``n`` also removes directories of steps ``>= n``: after a resume from an earlier checkpoint they belong to an
abandoned future of the run and would otherwise outrank the new ones in retention.

One writer per ``root``: under several ranks, write from one rank (after gathering) or give each rank its own root.

Test-only knob: ``_test_hook`` (module attribute, ``None`` in library use) is called as ``_test_hook(stage, relpath)``
with ``stage`` ``"tmp"`` (file fully written under its tmp name, not yet renamed) or ``"renamed"``.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from flowforge.media import to_uint8
from flowforge.rollout import Trajectory
from flowforge.runtime.durable import (atomic_write, fsync_path, is_tmp, only_layout_files, remove_marked_dir,
                                       step_dir_name, step_dirs)
from flowforge.runtime.errors import UserError

log = logging.getLogger("flowforge")

FORMAT = "flowforge-trajectory-1"
DONE = "DONE"
_GROUP_RE = re.compile(r"^group_(-?\d+)\.safetensors$")
_TRAJ_FIELDS = ("final", "latents", "next_latents", "log_probs", "means")
ROOT_MARKER = ".flowforge-artifacts"
_LAYOUT = re.compile(r"group_-?\d+(_\d+\.png|\.safetensors)|DONE")

_test_hook: Callable[[str, str], None] | None = None


def _write(path: Path, write: Callable[[Path], None], relpath: str) -> None:
    """:func:`atomic_write` reporting to the test hook (read at call time: tests set it after import)."""
    atomic_write(path, write, _test_hook, relpath)


# ------------------------------------------------------------------------------------------------ reading
def is_complete(step_dir: str | Path) -> bool:
    """True if ``step_dir`` holds its ``DONE`` marker (every file of the step is in place)."""
    return (Path(step_dir) / DONE).is_file()


def complete_steps(root: str | Path) -> list[Path]:
    """Complete ``<root>/step_*`` directories, oldest first."""
    return [p for _, p in step_dirs(Path(root)) if is_complete(p)]


def group_files(step_dir: str | Path) -> list[Path]:
    """The group files of a step directory under their final names (tmp files are never listed), by group id."""
    found = [(int(m.group(1)), p) for p in Path(step_dir).iterdir() if (m := _GROUP_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def read_group(path: str | Path) -> dict:
    """Load one group file written by :meth:`SidecarWriter.write`.

    Returns:
        ``{tensor name: tensor}`` (see the module docstring for names and shapes; extras as ``extra.<name>``) plus
        ``"prompt"`` (str), ``"step"`` (int), ``"group_id"`` (int), ``"images"`` (list of the PNG paths of the
        group's candidates, in row order) and ``"metadata"`` (the raw safetensors metadata).

    Raises:
        ValueError: ``path`` is a temporary (incomplete) file, or not a flowforge trajectory file.
    """
    path = Path(path)
    if is_tmp(path.name) or not _GROUP_RE.match(path.name):
        raise ValueError(f"{path} is not a group file (expected group_<g>.safetensors; hidden .tmp files are "
                         "incomplete writes)")
    with safe_open(str(path), framework="pt", device="cpu") as f:
        meta = dict(f.metadata() or {})
        out: dict = {k: f.get_tensor(k) for k in f.keys()}
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    group = int(meta["group_id"])
    out.update(prompt=meta["prompt"], step=int(meta["step"]), group_id=group, metadata=meta,
               images=[path.with_name(f"group_{group}_{k}.png") for k in range(int(meta["num_candidates"]))])
    return out


# ------------------------------------------------------------------------------------------------ writing
def _to_png(image: Tensor) -> Image.Image:
    """``[3, H, W]`` (or ``[1, H, W]``) in [0, 1] → an 8-bit PIL image."""
    pixels = to_uint8(image).cpu()
    arr = np.ascontiguousarray(pixels.permute(1, 2, 0).numpy())
    return Image.fromarray(arr[:, :, 0], mode="L") if arr.shape[2] == 1 else Image.fromarray(arr, mode="RGB")


class SidecarWriter:
    """Writes each rollout's trajectories and media under ``root`` and keeps the newest ``keep`` rollouts.

    Args:
        root: directory of the sidecars (created on the first write).
        keep: complete step directories kept (``>= 1``).

    Raises:
        ValueError: ``keep < 1``.
    """

    def __init__(self, root: str | Path, keep: int):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.root = Path(root)
        self.keep = int(keep)
        if self.root.is_dir() and any(self.root.iterdir()) and not (self.root / ROOT_MARKER).is_file():
            raise UserError(self.root, "is not empty and was not created by flowforge (no "
                            f"{ROOT_MARKER} marker); its files could be deleted as old rollouts",
                            "point artifacts.root at an empty or new directory")

    def reap(self, *, reserve: int = 0) -> list[Path]:
        """Delete incomplete step directories, stray tmp files in ``root``, and all but the newest
        ``keep - reserve`` complete step directories. Call it at the start of a rollout. Returns what was deleted.

        ``reserve`` makes room for directories about to be written (:meth:`write` passes 1). Directories holding
        anything flowforge did not write are neither deleted nor counted.
        """
        if not self.root.is_dir():
            return []
        removed: list[Path] = []
        dirs = [(s, p) for s, p in step_dirs(self.root) if _ours(p)]
        complete = [p for _, p in dirs if is_complete(p)]
        keep_n = max(self.keep - reserve, 0)
        doomed = [p for _, p in dirs if not is_complete(p)] + complete[: max(len(complete) - keep_n, 0)]
        for p in doomed:
            remove_marked_dir(p, DONE)
            removed.append(p)
        if removed:
            fsync_path(self.root)
        return removed

    def write(self, step: int, traj: Trajectory, group_ids: Tensor, prompts: Sequence[str], images: Tensor, *,
              candidate_ids: Tensor | None = None, extras: Mapping[str, Tensor] | None = None) -> Path:
        """Write rollout ``step``: one safetensors file and ``k`` PNGs per prompt group, then ``DONE``.

        Args:
            step: the training step of the rollout (the directory name).
            traj: the rollout's :class:`~flowforge.rollout.Trajectory`, ``B`` rows.
            group_ids: ``[B]`` int prompt-group id of each row.
            prompts: ``B`` prompts, one per row; rows of a group must share their prompt.
            images: ``[B, 3, H, W]`` decoded media in [0, 1] (``[B, 1, H, W]`` is written as grayscale).
            candidate_ids: optional ``[B]`` stable candidate ids, stored per group.
            extras: optional ``{name: [B, ...] tensor}`` (rewards, advantages, ...), stored as ``extra.<name>``.

        Returns:
            The complete step directory.

        Raises:
            ValueError: ``step < 0``, row counts that disagree, or a group whose rows have different prompts.
        """
        group_rows = _group_rows(step, traj, group_ids, prompts, images, candidate_ids, extras)
        step_dir = self._start_step(step)
        shared = {"sigmas": traj.sigmas.detach().float().cpu().contiguous(),
                  "trained_steps": torch.tensor(list(traj.trained_steps), dtype=torch.long)}
        group_ids = torch.as_tensor(group_ids).detach().cpu().long()
        files: dict[str, int] = {}
        for g, rows in group_rows.items():
            tensors = dict(shared)
            for name in _TRAJ_FIELDS:
                t = getattr(traj, name)
                if t is not None:
                    tensors[name] = t.detach()[rows.to(t.device)].cpu().contiguous()
            tensors["group_ids"] = group_ids[rows].contiguous()
            tensors["rows"] = rows.clone()
            if candidate_ids is not None:
                tensors["candidate_ids"] = torch.as_tensor(candidate_ids).detach().cpu().long()[rows].contiguous()
            for name, t in (extras or {}).items():
                tensors[f"extra.{name}"] = t.detach()[rows.to(t.device)].cpu().contiguous()
            meta = {"format": FORMAT, "step": str(step), "group_id": str(g), "prompt": prompts[int(rows[0])],
                    "trained_steps": json.dumps(list(traj.trained_steps)), "num_candidates": str(len(rows))}
            files.update(_write_group(step_dir, g, rows, tensors, meta, images))
        done = json.dumps({"format": FORMAT, "step": step, "groups": list(group_rows), "files": files},
                          indent=1) + "\n"
        fsync_path(step_dir)
        _write(step_dir / DONE, lambda tmp: tmp.write_text(done), f"{step_dir.name}/{DONE}")
        return step_dir

    def _start_step(self, step: int) -> Path:
        """Remove directories of steps ``>= step`` (an abandoned future after a resume), reap, create the step's
        directory durably."""
        self.root.mkdir(parents=True, exist_ok=True)
        marker = self.root / ROOT_MARKER
        if not marker.exists():
            atomic_write(marker, lambda tmp: tmp.write_text("flowforge rollout sidecars (safe to delete)\n"))
        for s, p in step_dirs(self.root):
            if s >= step and _ours(p):
                if s > step and is_complete(p):
                    log.warning("removing sidecars %s: step %d is past the step being written (%d), left by a run "
                                "that resumed from an earlier checkpoint", p, s, step)
                remove_marked_dir(p, DONE)
        self.reap(reserve=1)
        step_dir = self.root / step_dir_name(step)
        if step_dir.exists():
            raise UserError(step_dir, "holds files flowforge did not write, and step %d's rollout goes there" % step,
                            "move them out of artifacts.root")
        step_dir.mkdir()
        fsync_path(self.root)
        return step_dir


def _ours(step_dir: Path) -> bool:
    """Whether ``step_dir`` holds only files of the sidecar layout (deletable); says so in the log when not."""
    if only_layout_files(step_dir, _LAYOUT):
        return True
    log.warning("%s holds files flowforge did not write: not deleted", step_dir)
    return False


def _group_rows(step: int, traj: Trajectory, group_ids: Tensor, prompts: Sequence[str], images: Tensor,
                candidate_ids: Tensor | None, extras: Mapping[str, Tensor] | None) -> dict[int, Tensor]:
    """Check :meth:`SidecarWriter.write`'s arguments; returns ``{group id: [k] int64 rows}`` by group id."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    b = traj.final.shape[0]
    group_ids = torch.as_tensor(group_ids).detach().cpu().long()
    sizes = {"group_ids": group_ids.shape[0], "prompts": len(prompts), "images": images.shape[0]}
    if candidate_ids is not None:
        sizes["candidate_ids"] = len(candidate_ids)
    sizes.update({f"extras[{k}]": v.shape[0] for k, v in (extras or {}).items()})
    bad = {k: n for k, n in sizes.items() if n != b}
    if bad or group_ids.dim() != 1:
        raise ValueError(f"the trajectory has B={b} rows but {bad or {'group_ids.dim()': group_ids.dim()}}")
    if images.dim() != 4 or images.shape[1] not in (1, 3):
        raise ValueError(f"images must be [B, 3, H, W] (or [B, 1, H, W]), got {tuple(images.shape)}")
    group_rows = {g: torch.nonzero(group_ids == g).squeeze(1) for g in sorted(set(group_ids.tolist()))}
    for g, rows in group_rows.items():
        distinct = sorted({prompts[r] for r in rows.tolist()})
        if len(distinct) > 1:
            raise ValueError(f"group {g} has rows with different prompts {distinct[:3]}; a group is one prompt")
    return group_rows


def _write_group(step_dir: Path, g: int, rows: Tensor, tensors: dict[str, Tensor], meta: dict[str, str],
                 images: Tensor) -> dict[str, int]:
    """Group ``g``'s safetensors file, then one PNG per candidate in row order; returns ``{file: bytes}``."""
    files: dict[str, int] = {}
    name = f"group_{g}.safetensors"
    _write(step_dir / name, lambda tmp: save_file(tensors, str(tmp), metadata=meta), f"{step_dir.name}/{name}")
    files[name] = (step_dir / name).stat().st_size
    for k, r in enumerate(rows.tolist()):
        png = f"group_{g}_{k}.png"
        image = _to_png(images[r])
        _write(step_dir / png, lambda tmp, im=image: im.save(tmp, format="PNG"), f"{step_dir.name}/{png}")
        files[png] = (step_dir / png).stat().st_size
    return files
