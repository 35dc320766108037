"""Prompt records (the unified JSONL schema) and the K-repeat prompt sampler.

**Schema.** A prompt file is JSON Lines, one object per line (blank lines are skipped)::

    {"prompt": "a handwritten seven", "metadata": {"task": "t2i", "sample_id": "demo-train-t00-d7", "digit": 7}}

``prompt`` is a non-empty string; ``metadata`` is an object with ``task`` in ``TASKS`` and ``sample_id`` a non-empty
string unique within the file. Any other metadata keys are free-form and reach the reward scorers untouched (the demo
digit scorer reads ``metadata["digit"]``). Other top-level keys are rejected, so a typo cannot be silently ignored.
``"demo:train"`` and ``"demo:eval"`` name the packaged prompt files of the embedded default.

Image-conditioned tasks (``i2v``, ``i2i``) also need ``metadata.image``: the path of the condition image (the first
frame for i2v), relative to the prompt file's directory or absolute; :func:`load_prompts` checks that it exists and
stores it resolved to an absolute path::

    {"prompt": "the cat walks away", "metadata": {"task": "i2v", "sample_id": "v1", "image": "frames/cat.png"}}

Multi-image edits list several reference images instead, in order (``metadata.images``, a non-empty list; ``image``
and ``images`` are not both allowed; :func:`condition_images` gives either as a list), checked and resolved the same
way; how many a family takes is checked when training starts (:func:`check_condition_images`)::

    {"prompt": "the cat from picture 1 on the sofa of picture 2", "metadata": {"task": "i2i", "sample_id": "e1",
     "images": ["refs/cat.png", "refs/sofa.png"]}}

**K-repeat sampling** (GRPO-style group sampling, as in flow_grpo's ``DistributedKRepeatSampler``). Every step draws
``M`` distinct prompts and repeats each ``K`` times, giving ``B = M * K`` candidates whose rewards are compared within
their group. Every rank builds the same batch from the seed alone, with no communication, and keeps a contiguous,
equal share of the candidates.

===========  ==================================================================================================
symbol       meaning
===========  ==================================================================================================
``N``        number of prompts in the dataset (``num_prompts``)
``M``        prompts per step (``prompts_per_step``), distinct within a step, ``M <= N``
``K``        candidates per prompt (``group_size``)
epoch ``e``  one pass over the permutation ``pi_e`` of ``0..N-1`` seeded by ``seed + e``
cursor       position in ``pi_e``; a step takes ``pi_e[cursor : cursor + M]``
===========  ==================================================================================================

A step never straddles epochs: when fewer than ``M`` prompts remain in ``pi_e`` the last ``N mod M`` are skipped for
this epoch and the next step starts epoch ``e + 1`` at cursor 0 (so an epoch is ``N // M`` steps).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import stat
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from PIL import Image

from flowforge.data import peer_prompts as peer
from flowforge.runtime.durable import incomplete_set
from flowforge.runtime.errors import UserError, file_error

TASKS = ("t2i", "i2i", "t2v", "i2v")
"""Allowed values of ``metadata.task``."""

IMAGE_TASKS = ("i2i", "i2v")
"""Tasks conditioned on an image (``metadata.image``)."""

DEMO_PROMPT_SETS = ("demo:train", "demo:eval", "demo:world-train", "demo:world-eval")
"""Names that resolve to the embedded default's packaged prompt files."""

PACKAGED_PROMPTS_DIR = pathlib.Path(__file__).resolve().parents[1] / "demo" / "prompts"
"""Where the packaged prompt files live (package data of ``flowforge/demo``; the data layer names the files by path
and imports no demo code, so :mod:`flowforge.demo.paths` resolves its prompt names through here)."""

_TOP_LEVEL_KEYS = ("prompt", "metadata")


@dataclasses.dataclass(frozen=True)
class PromptRecord:
    """One prompt and its metadata (``task``, ``sample_id`` and any task-specific keys such as ``digit``).

    ``metadata`` is a plain dict so it serialises with ``json``; treat it as read-only.
    """

    prompt: str
    metadata: dict[str, Any]

    @property
    def task(self) -> str:
        return self.metadata["task"]

    @property
    def sample_id(self) -> str:
        return self.metadata["sample_id"]

    def to_dict(self) -> dict[str, Any]:
        """The record as a JSON-ready row of the unified schema (a deep copy)."""
        return json.loads(json.dumps({"prompt": self.prompt, "metadata": self.metadata}))


def resolve_prompt_path(source: str | pathlib.Path) -> pathlib.Path:
    """Turn a prompt source into a file path: ``"demo:train"`` / ``"demo:eval"`` give the packaged demo files,
    anything else is taken as a filesystem path (not checked for existence here).

    Raises:
        ValueError: ``source`` starts with ``"demo:"`` but is not one of ``DEMO_PROMPT_SETS``.
    """
    text = str(source)
    if text.startswith("demo:"):
        if text not in DEMO_PROMPT_SETS:
            raise ValueError(f"prompt source {text!r}: demo prompt sets are {list(DEMO_PROMPT_SETS)}")
        return PACKAGED_PROMPTS_DIR / f"{text[len('demo:'):]}.jsonl"
    return pathlib.Path(source)


def prompt_file(source: str | pathlib.Path) -> pathlib.Path:
    """The file a prompt source reads: :func:`resolve_prompt_path`, and a dataset directory's train split
    (:data:`flowforge.data.peer_prompts.TRAIN_FILES`) for a directory holding one (not checked for existence).

    Raises:
        ValueError: as :func:`resolve_prompt_path`.
    """
    path = resolve_prompt_path(source)
    if path.is_dir() and (train := peer.dataset_file(path)) is not None:
        return train
    return path


_PREPARE = "flowforge data prepare SOURCE OUT.jsonl converts other formats"


def _row_error(path: pathlib.Path, line: int, field: str, problem: str) -> ValueError:
    return ValueError(f"{path}:{line}: field {field!r} {problem}; {_PREPARE}")


def _lone_surrogate(value: Any, field: str = "") -> tuple[str, str] | None:
    """``(field, "\\ud800 at character 5")`` for the first string in ``value`` (a JSON row: keys and values,
    nested) holding a lone surrogate code point, which JSON's ``\\ud800`` escape can give and UTF-8 cannot
    encode; None when there is none."""
    if isinstance(value, str):
        for i, char in enumerate(value):
            if "\ud800" <= char <= "\udfff":
                return field or "prompt", f"{char.encode('unicode_escape').decode()} at character {i + 1}"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        name = f"{field}.{key}" if field else str(key)
        found = _lone_surrogate(key, name) if isinstance(key, str) else None
        found = found or _lone_surrogate(item, name)
        if found is not None:
            return found
    return None


def _parse_row(path: pathlib.Path, line: int, text: str, index: int) -> PromptRecord:
    try:
        row = peer.unified_row(path, index, text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{line}: not valid JSON ({err.msg} at column {err.colno}); {_PREPARE}") from None
    if not isinstance(row, dict):
        raise ValueError(f"{path}:{line}: each line must be a JSON object, got {type(row).__name__}; {_PREPARE}")
    surrogate = _lone_surrogate(row)
    if surrogate is not None:
        field, where = surrogate
        raise _row_error(path, line, field, f"holds a lone surrogate escape ({where}): half of a UTF-16 pair, no "
                                            "character, which cannot be encoded as UTF-8; write the character "
                                            "itself or its complete \\uD8xx\\uDCxx pair")
    unknown = sorted(set(row) - set(_TOP_LEVEL_KEYS))
    if unknown:
        raise _row_error(path, line, unknown[0], f"is not allowed; top-level keys are {list(_TOP_LEVEL_KEYS)}")
    prompt = row.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise _row_error(path, line, "prompt", f"must be a non-empty string, got {prompt!r}")
    metadata = row.get("metadata")
    if not isinstance(metadata, dict):
        raise _row_error(path, line, "metadata", f"must be an object with 'task' and 'sample_id', got {metadata!r}")
    task = metadata.get("task")
    if task not in TASKS:
        raise _row_error(path, line, "metadata.task", f"must be one of {list(TASKS)}, got {task!r}")
    sample_id = metadata.get("sample_id")
    if not isinstance(sample_id, str) or not sample_id:
        raise _row_error(path, line, "metadata.sample_id", f"must be a non-empty string, got {sample_id!r}")
    if task in IMAGE_TASKS:
        metadata = _resolve_condition_images(path, line, task, metadata)
    return PromptRecord(prompt=prompt, metadata=metadata)


def condition_images(metadata: Mapping[str, Any]) -> list[str]:
    """The condition image paths of an image-task record, in order: ``metadata.images`` (a list) or
    ``[metadata.image]`` (one image is a one-element list); ``[]`` when it names none."""
    images = metadata.get("images")
    if images is not None:
        return list(images)
    return [metadata["image"]] if metadata.get("image") else []


def _resolve_condition_images(path: pathlib.Path, line: int, task: str, metadata: dict[str, Any]) -> dict[str, Any]:
    """``metadata`` with its condition image path(s) (``image``: one, or ``images``: a non-empty list) checked to be
    readable images and made absolute (relative paths start at the prompt file's folder)."""
    if "image" in metadata and "images" in metadata:
        raise _row_error(path, line, "metadata.images", "and 'metadata.image' are both given; give one: 'image' "
                                                        "(one path) or 'images' (a list of paths)")
    key = "images" if "images" in metadata else "image"
    value = metadata.get(key)
    paths = value if key == "images" else [value]
    if (key == "images" and (not isinstance(value, list) or not value)) or not all(
            isinstance(p, str) and p for p in paths):
        want = "a non-empty list of condition image paths" if key == "images" else "the condition image's path"
        raise _row_error(path, line, f"metadata.{key}", f"must be {want} for task {task!r}, got {value!r}")
    resolved = []
    for image in paths:
        full = (path.parent / image).resolve()
        if not full.is_file():
            raise _row_error(path, line, f"metadata.{key}", f"names {image!r}, which is not a file ({full})")
        try:
            with Image.open(full) as opened:
                opened.verify()
        except Exception as exc:  # PIL raises several types for unreadable / truncated files
            raise _row_error(path, line, f"metadata.{key}", f"names {image!r}, which is not a readable image "
                                                            f"({type(exc).__name__}: {exc})") from None
        resolved.append(str(full))
    return {**metadata, key: resolved if key == "images" else resolved[0]}


_FIX = ("give a .txt (one prompt a line) or JSONL prompt file, or a dataset directory with "
        f"{' / '.join(peer.TRAIN_FILES)}; {_PREPARE}")
_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a named pipe"),
          (stat.S_ISSOCK, "a socket"))


def missing_file_message(path: pathlib.Path, what: str) -> str:
    """``"<what> PATH does not exist"``, plus the absolute path tried and where a relative path starts (the working
    directory, not the config file's folder) when ``path`` is relative."""
    if path.is_absolute():
        return f"{what} {path} does not exist"
    return (f"{what} {path} does not exist (tried {path.absolute()}: relative paths are resolved against the working "
            "directory)")


def check_prompt_file(path: pathlib.Path) -> None:
    """``path`` (symlinks followed) is a regular file that can be opened.

    Raises:
        FileNotFoundError: nothing is there (or a symlink points at nothing).
        UserError: a directory, something that is not a regular file (``/dev/null``, a FIFO, whose reading would
            give nothing or block), or a path that cannot be reached or read (a symlink loop, no permission).
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise FileNotFoundError(missing_file_message(path, "prompt file")) from None
    except OSError as exc:
        raise file_error(path, exc, _FIX) from None
    if stat.S_ISDIR(mode):
        raise UserError(path, "is a directory with no train split", _FIX)
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "a special file")
        raise UserError(path, f"is not a regular file ({kind})", _FIX)
    if not os.access(path, os.R_OK):
        raise UserError(path, "cannot be read (Permission denied)", _FIX)


def load_prompts(source: str | pathlib.Path) -> list[PromptRecord]:
    """Load and validate a prompt file (see the module docstring for the schema); peer sources are read as they
    are (:mod:`flowforge.data.peer_prompts`: a ``.txt`` file, ``{"prompt": ..., "image": ...}`` JSONL, a dataset
    directory's train split), with derived ids.

    Args:
        source: a path (file or dataset directory), or ``"demo:train"`` / ``"demo:eval"`` for the demo prompts.

    Returns:
        The records in file order.

    Raises:
        FileNotFoundError: the file does not exist.
        UserError: (a ``ValueError``) the path is a directory, not a regular file (``/dev/null``, a FIFO), or
            cannot be read (a symlink loop, no permission), naming it and the cause.
        ValueError: a row is invalid or not UTF-8 text (the message names the file, the 1-based line number and
            the field), a ``sample_id`` repeats (naming both lines), or the file holds no rows.
    """
    path = prompt_file(source)
    check_prompt_file(path)
    if (marker := incomplete_set(path)) is not None:
        raise UserError(path, f"belongs to a file set whose writing was interrupted ({marker.name} is still there), "
                        "so it may mix old and new rows", "rerun the command that wrote it (e.g. flowforge data "
                        "curate ... --overwrite)")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise file_error(path, exc, _FIX) from None
    records: list[PromptRecord] = []
    first_line: dict[str, int] = {}
    index = 0
    for line, raw in enumerate(data.splitlines(), start=1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}:{line}: not UTF-8 text (byte {exc.start + 1} of the line is "
                             f"0x{raw[exc.start]:02x}); save the file as UTF-8") from None
        if not text.strip():
            continue
        record = _parse_row(path, line, text, index)
        index += 1
        if record.sample_id in first_line:
            raise _row_error(
                path, line, "metadata.sample_id",
                f"{record.sample_id!r} repeats the one on line {first_line[record.sample_id]}; ids must be unique",
            )
        first_line[record.sample_id] = line
        records.append(record)
    if not records:
        raise ValueError(f"{path}: holds no prompt rows")
    return records


_MASK63 = (1 << 63) - 1


def _mix63(value: int) -> int:
    """A bijection of ``[0, 2**63)``: add a constant (so 0 does not map to 0), then xor-shift / odd-multiply rounds
    (splitmix64-style, reduced to 63 bits). Every step is invertible modulo ``2**63``."""
    x = (value + 0x2545F4914F6CDD1D) & _MASK63
    x ^= x >> 31
    x = (x * 0x3F2A8C5B1D4E6F97) & _MASK63
    x ^= x >> 29
    x = (x * 0x1CE4E5B9A6B3D2F1) & _MASK63
    x ^= x >> 32
    return x


def _permutation(num_prompts: int, seed: int, epoch: int) -> np.ndarray:
    """``pi_e``: ``argsort`` of per-index hash keys derived from ``seed + epoch``; pure integer arithmetic, so the
    order is the same on every machine and library version. int64 ``[N]``."""
    base = np.uint64(_mix63(seed + epoch))
    keys = np.arange(num_prompts, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) + base
    keys ^= keys >> np.uint64(30)
    keys *= np.uint64(0xBF58476D1CE4E5B9)
    keys ^= keys >> np.uint64(27)
    keys *= np.uint64(0x94D049BB133111EB)
    keys ^= keys >> np.uint64(31)
    return np.argsort(keys, kind="stable").astype(np.int64)


@dataclasses.dataclass(frozen=True)
class KRepeatBatch:
    """One step of K-repeat sampling; identical on every rank except ``rank_slice``.

    Candidates are ordered group-major: candidate ``j`` belongs to group ``j // K`` (``[g0]*K + [g1]*K + ...``).
    """

    step: int  # global step index of this batch (0 for the first batch ever drawn)
    epoch: int  # epoch the prompts were drawn from
    prompt_indices: torch.Tensor  # [M] int64, distinct indices into the prompt list
    group_ids: torch.Tensor  # [M*K] int64, 0..M-1, group-major
    candidate_ids: torch.Tensor  # [M*K] int64 >= 0, unique over every candidate this sampler ever draws
    rank_slice: slice  # this rank's contiguous share of the M*K candidates

    @property
    def candidate_prompt_indices(self) -> torch.Tensor:
        """``[M*K]`` int64: the prompt index of every candidate (``prompt_indices[group_ids]``)."""
        return self.prompt_indices[self.group_ids]

    @property
    def local_prompt_indices(self) -> torch.Tensor:
        """``[M*K / num_replicas]`` int64: prompt index of each candidate this rank owns."""
        return self.candidate_prompt_indices[self.rank_slice]

    @property
    def local_group_ids(self) -> torch.Tensor:
        """``[M*K / num_replicas]`` int64: group id of each candidate this rank owns."""
        return self.group_ids[self.rank_slice]

    @property
    def local_candidate_ids(self) -> torch.Tensor:
        """``[M*K / num_replicas]`` int64: candidate id (noise seed) of each candidate this rank owns."""
        return self.candidate_ids[self.rank_slice]


class KRepeatSampler:
    """Draws ``M`` distinct prompts per step, each repeated ``K`` times, identically on every rank.

    Args:
        num_prompts: ``N``, size of the prompt list, >= 1.
        prompts_per_step: ``M``, 1 <= M <= N.
        group_size: ``K``, >= 1.
        seed: int >= 0; epoch ``e`` uses the permutation seeded by ``seed + e``.
        num_replicas: number of ranks, >= 1, must divide ``M * K``.
        rank: this rank, ``0 <= rank < num_replicas``.

    ``candidate_ids`` (for seeding each candidate's noise) are ``mix63(c + mix63(seed))`` where
    ``c = steps_before * M * K + j`` counts every candidate drawn so far, ``mix63`` a bijection of ``[0, 2**63)``.
    The counter fixes (epoch, position in the epoch, prompt index, k) and the map is one-to-one, so ids never repeat
    within a run (exactly, not just with high probability) and change with the seed.

    Stateful (``torch.distributed.checkpoint.stateful.Stateful``): :meth:`state_dict` / :meth:`load_state_dict`
    carry the position, so a resumed run draws exactly the batches the interrupted one would have.

    Raises:
        ValueError: any argument outside the ranges above (the message names it).
    """

    def __init__(
        self,
        num_prompts: int,
        prompts_per_step: int,
        group_size: int,
        seed: int,
        *,
        num_replicas: int = 1,
        rank: int = 0,
    ) -> None:
        for field, value, low in (
            ("num_prompts", num_prompts, 1), ("prompts_per_step", prompts_per_step, 1),
            ("group_size", group_size, 1), ("seed", seed, 0), ("num_replicas", num_replicas, 1), ("rank", rank, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{field} must be an int >= {low}, got {value!r}")
        if prompts_per_step > num_prompts:
            raise ValueError(
                f"prompts_per_step ({prompts_per_step}) must be <= num_prompts ({num_prompts}): "
                "the prompts of one step are distinct"
            )
        if rank >= num_replicas:
            raise ValueError(f"rank must be in 0..{num_replicas - 1} (num_replicas={num_replicas}), got {rank}")
        batch = prompts_per_step * group_size
        if batch % num_replicas:
            raise ValueError(
                f"prompts_per_step * group_size ({prompts_per_step} * {group_size} = {batch}) must be divisible by "
                f"num_replicas ({num_replicas})"
            )
        self.num_prompts = num_prompts
        self.prompts_per_step = prompts_per_step
        self.group_size = group_size
        self.seed = seed
        self.num_replicas = num_replicas
        self.rank = rank
        per_rank = batch // num_replicas
        self._rank_slice = slice(rank * per_rank, (rank + 1) * per_rank)
        self._seed_offset = _mix63(seed)
        self.epoch = 0
        self.cursor = 0
        self.steps = 0
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    @property
    def steps_per_epoch(self) -> int:
        """``N // M``: steps drawn from each permutation before the next epoch starts."""
        return self.num_prompts // self.prompts_per_step

    def _permutation_for(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch:
            self._perm = _permutation(self.num_prompts, self.seed, epoch)
            self._perm_epoch = epoch
        return self._perm

    def next_batch(self) -> KRepeatBatch:
        """Draw the next step's prompts and candidates and advance the sampler (see :class:`KRepeatBatch`)."""
        m, k = self.prompts_per_step, self.group_size
        if self.cursor + m > self.num_prompts:
            self.epoch += 1
            self.cursor = 0
        prompts = self._permutation_for(self.epoch)[self.cursor : self.cursor + m]
        first = self.steps * m * k
        ids = [_mix63(first + j + self._seed_offset) for j in range(m * k)]
        batch = KRepeatBatch(
            step=self.steps,
            epoch=self.epoch,
            prompt_indices=torch.from_numpy(prompts.copy()),
            group_ids=torch.arange(m).repeat_interleave(k),
            candidate_ids=torch.tensor(ids, dtype=torch.int64),
            rank_slice=self._rank_slice,
        )
        self.cursor += m
        self.steps += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        """Position and identity of the sampler: ``epoch``, ``cursor``, ``steps`` plus ``num_prompts``,
        ``prompts_per_step``, ``group_size`` and ``seed`` (checked on load). JSON-serialisable ints."""
        return {
            "epoch": self.epoch, "cursor": self.cursor, "steps": self.steps, "num_prompts": self.num_prompts,
            "prompts_per_step": self.prompts_per_step, "group_size": self.group_size, "seed": self.seed,
        }

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continue exactly where the sampler that produced ``state`` stopped. ``num_replicas``/``rank`` may differ.

        Raises:
            ValueError: a key is missing, or ``num_prompts`` / ``prompts_per_step`` / ``group_size`` / ``seed``
                differ from this sampler's (resuming would not reproduce the run), or the position is invalid.
        """
        missing = [key for key in self.state_dict() if key not in state]
        if missing:
            raise ValueError(f"sampler state is missing keys {missing}")
        for key in ("num_prompts", "prompts_per_step", "group_size", "seed"):
            if int(state[key]) != getattr(self, key):
                raise ValueError(f"sampler state has {key}={state[key]}, this sampler has {getattr(self, key)}")
        epoch, cursor, steps = int(state["epoch"]), int(state["cursor"]), int(state["steps"])
        if epoch < 0 or steps < 0 or not 0 <= cursor <= self.num_prompts:
            raise ValueError(f"sampler state position is invalid: epoch={epoch}, cursor={cursor}, steps={steps}")
        self.epoch, self.cursor, self.steps = epoch, cursor, steps


def check_task(records: list[PromptRecord], task: str, source: str) -> None:
    """Every record of ``source`` must fit ``model.task``: an image task (i2v / i2i) needs records of exactly that
    task (each with its image); a text task takes t2i / t2v records (an image would be silently ignored).

    Raises:
        ValueError: naming the first disagreeing record and the allowed tasks.
    """
    allowed = [task] if task in IMAGE_TASKS else [t for t in TASKS if t not in IMAGE_TASKS]
    for record in records:
        if record.task not in allowed:
            raise ValueError(f"{source}: record {record.sample_id!r} has metadata.task={record.task!r} but "
                             f"model.task={task!r} needs records with metadata.task in {allowed}")



def check_condition_images(records: list[PromptRecord], limit: int | None, source: str) -> None:
    """Every image-task record of ``source`` names at most ``limit`` condition images (the adapter's
    ``max_condition_images``; ``None``: no limit, as the multi-image pipelines have none).

    Raises:
        ValueError: naming the first record over the limit, its count and the limit.
    """
    if limit is None:
        return
    for record in records:
        if record.task in IMAGE_TASKS and (n := len(condition_images(record.metadata))) > limit:
            raise ValueError(f"{source}: record {record.sample_id!r} lists {n} condition images in metadata.images but "
                             f"this model takes at most {limit} (model.adapter's max_condition_images)")
