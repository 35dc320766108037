"""Experiment trackers beside the JSONL files: TensorBoard and Weights & Biases.

``metrics.trackers`` (:class:`~flowforge.settings.sections.MetricsConfig`) names the sinks of a run. ``jsonl``
(``metrics.jsonl`` / ``eval.jsonl``, written by :class:`~flowforge.train.metrics.MetricsLogger` itself) is always on,
listed or not: the report, ``flowforge compare`` and resume read it. The others are built here:

=================  ==================================================================================================
``tensorboard``    ``<run>/tb/``: every scalar (``add_scalar``), each eval grid as an image ``eval/samples``
                   (``add_image``, HWC uint8) with its captions as a text ``eval/samples_captions``, and the resolved
                   config as the text ``config`` (YAML)
``wandb``          the ``wandb`` library (``pip install flowforge[wandb]``): every scalar (``run.log``), each eval grid
                   as one ``wandb.Image`` per cell under ``eval/samples``, captioned with its prompt and scores, and the
                   resolved config as ``run.config``. Project, entity, name, group, tags and notes come from
                   ``metrics.wandb`` (:class:`~flowforge.settings.sections.WandbSettings`), each unset key from W&B's
                   environment variable (``WANDB_PROJECT`` -- default ``flowforge`` --, ``WANDB_NAME`` -- default
                   ``run.name`` --, ``WANDB_TAGS``, ...); ``WANDB_MODE=offline`` and ``WANDB_DIR`` -- default the
                   run directory -- apply. The run id is kept in ``<run>/wandb_run_id.txt`` so a resumed run
                   continues the same W&B run.
=================  ==================================================================================================

Only the rank-0 process builds trackers (the trainer gives other ranks no logger).

Console logging of a run: :func:`run_logging` keeps log lines from breaking the progress bar and copies them to
``<run>/train.log``; :func:`progress_line` is the line logged every ``metrics.log_every`` steps under
``--no-progress``.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from tqdm.contrib.logging import logging_redirect_tqdm

from flowforge.settings.sections import TRACKERS, WandbSettings
from flowforge.runtime.run_dir import TB_DIR

WANDB_ID_FILE = "wandb_run_id.txt"
TRAIN_LOG = "train.log"
"""The run's log file in the run directory (rank 0, INFO and above of the ``flowforge`` loggers)."""
PROGRESS_KEYS = ("reward/total_mean", "reward/group_std_mean", "train/loss", "train/kl", "train/diversity",
                 "perf/samples_per_s")
"""The key metrics of a ``--no-progress`` log line (:func:`progress_line`), those a step has."""
GRID_TAG = "eval/samples"
"""Tag (TensorBoard) / key (W&B) of the eval sample grids."""


def cell_caption(cell: Mapping[str, Any]) -> str:
    """``"<prompt> | digit_eval=1.000, digit=0.870"``: one grid cell's caption from its sidecar entry
    (:func:`flowforge.report.grids.read_grid_cells`; ``None`` scores read as ``nan``)."""
    scores = ", ".join(f"{k}={math.nan if v is None else v:.3f}" for k, v in cell["scores"].items())
    return f"{cell['prompt']} | {scores}" if scores else str(cell["prompt"])


class TensorBoardTracker:
    """TensorBoard event files under ``log_dir`` (``torch.utils.tensorboard.SummaryWriter``), flushed per call.
    ``purge_step`` (a resumed run): TensorBoard hides the earlier files' events of steps ``>= purge_step``, which
    this run logs again, so no step shows twice."""

    def __init__(self, log_dir: Path, purge_step: int | None = None):
        # Imported here: TensorBoard takes seconds to import and many users of this module never log.
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        for key, value in scalars.items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def log_grid(self, step: int, png: Path, cells: Sequence[Mapping[str, Any]] | None) -> None:
        pixels = np.asarray(Image.open(png).convert("RGB"))  # [H, W, 3] uint8
        self._writer.add_image(GRID_TAG, pixels, global_step=step, dataformats="HWC")
        if cells:
            # markdown list in grid order (left to right, top to bottom), read beside the image in the TEXT tab
            self._writer.add_text(f"{GRID_TAG}_captions",
                                  "\n".join(f"{i + 1}. {cell_caption(c)}" for i, c in enumerate(cells)), step)
        self._writer.flush()

    def log_config(self, config: Mapping[str, Any], yaml_text: str) -> None:
        # four-space indent: a preformatted block in TensorBoard's markdown, so the YAML keeps its layout
        self._writer.add_text("config", "\n".join("    " + line for line in yaml_text.splitlines()), 0)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    """A W&B run through the ``wandb`` library (see the module docstring for the environment it reads).

    Raises:
        ImportError: ``wandb`` is not installed (with the install command).
    """

    def __init__(self, run_dir: Path, name: str, settings: WandbSettings | None = None):
        try:
            import wandb
        except ImportError as exc:
            raise ImportError("metrics.trackers lists wandb but the wandb package is not installed: "
                              "pip install 'flowforge[wandb]'") from exc
        self._wandb = wandb
        id_file = Path(run_dir) / WANDB_ID_FILE
        if id_file.exists():
            run_id = id_file.read_text(encoding="utf-8").strip()
        else:
            run_id = secrets.token_hex(4)  # 8 hex characters, the length W&B's own ids have
            id_file.write_text(run_id + "\n", encoding="utf-8")
        s = settings or WandbSettings()
        # project and name have flowforge defaults after the environment; the other keys left None are read from
        # W&B's own environment variables by wandb.init itself
        self._run = wandb.init(project=s.project or os.environ.get("WANDB_PROJECT") or "flowforge",
                               name=s.name or os.environ.get("WANDB_NAME") or name, entity=s.entity, group=s.group,
                               tags=list(s.tags) or None, notes=s.notes, id=run_id, resume="allow",
                               dir=os.environ.get("WANDB_DIR") or str(run_dir))

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        self._run.log(dict(scalars), step=step)

    def log_grid(self, step: int, png: Path, cells: Sequence[Mapping[str, Any]] | None) -> None:
        grid = Image.open(png).convert("RGB")
        if cells:
            images = [self._wandb.Image(grid.crop(tuple(c["box"])), caption=cell_caption(c)) for c in cells]
        else:  # a grid without its caption sidecar: the whole grid
            images = [self._wandb.Image(grid, caption=f"step {step}")]
        self._run.log({GRID_TAG: images}, step=step)

    def log_config(self, config: Mapping[str, Any], yaml_text: str) -> None:
        self._run.config.update(dict(config), allow_val_change=True)

    def close(self) -> None:
        self._run.finish()


def build_trackers(names: Sequence[str], run_dir: Path, *, run_name: str, wandb: WandbSettings | None = None,
                   purge_step: int | None = None) -> list[Any]:
    """The trackers named in ``names`` (``metrics.trackers`` values; ``jsonl`` is written by the caller and skipped
    here), each at most once, in order; ``wandb`` is ``metrics.wandb`` (None: every key from the environment);
    ``purge_step`` as :class:`TensorBoardTracker`'s.

    Raises:
        ValueError: a name outside :data:`~flowforge.settings.sections.TRACKERS`.
        ImportError: ``wandb`` is named but not installed.
    """
    out: list[Any] = []
    for name in dict.fromkeys(names):
        if name not in TRACKERS:
            raise ValueError(f"unknown tracker {name!r}; allowed: {list(TRACKERS)}")
        if name == "tensorboard":
            out.append(TensorBoardTracker(Path(run_dir) / TB_DIR, purge_step))
        elif name == "wandb":
            out.append(WandbTracker(Path(run_dir), run_name, wandb))
    return out


def log_progress(step: int, total: int, scalars: Mapping[str, float], every: int) -> None:
    """Log :func:`progress_line` every ``every`` steps (``metrics.log_every``; 0: never) and after the last."""
    if every and (step % every == 0 or step == total):
        logging.getLogger("flowforge").info("%s", progress_line(step, total, scalars))


def progress_line(step: int, total: int, scalars: Mapping[str, float]) -> str:
    """``"step 10/60: reward/total_mean=0.412, ..."``: the :data:`PROGRESS_KEYS` that ``scalars`` has, 4 significant
    digits."""
    return f"step {step}/{total}: " + ", ".join(f"{k}={scalars[k]:.4g}" for k in PROGRESS_KEYS if k in scalars)


@contextmanager
def run_logging(log_file: Path | None) -> Iterator[None]:
    """For the duration of a run: console log lines go through ``tqdm.write`` (``logging_redirect_tqdm`` on the root
    logger), so they never break a progress bar, and, with ``log_file`` (rank 0 passes ``<run>/train.log``, other
    ranks ``None``), the ``flowforge`` loggers' records at INFO and above are appended to it (a resumed run continues
    the file). The ``flowforge`` logger is lowered to INFO while the file is open when it would drop INFO (a caller
    that configured no logging), so the file always holds the eval lines. Everything is undone on exit."""
    if log_file is None:
        with logging_redirect_tqdm():
            yield
        return
    flowforge_log = logging.getLogger("flowforge")
    handler = logging.FileHandler(log_file, mode="a", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.setLevel(logging.INFO)
    level = flowforge_log.level
    if flowforge_log.getEffectiveLevel() > logging.INFO:
        flowforge_log.setLevel(logging.INFO)
    flowforge_log.addHandler(handler)
    try:
        with logging_redirect_tqdm():
            yield
    finally:
        flowforge_log.removeHandler(handler)
        flowforge_log.setLevel(level)
        handler.close()
