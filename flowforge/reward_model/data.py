"""Student training data: the teacher's judged groups, read from the judge's request ledger, and the cluster split.

A judged group is one answered ``requests`` row of the ``vlm_judge`` request ledger
(:mod:`flowforge.rewards.judge.ledger`) with ``status = 'ok'``. Its ``request_json`` holds what was sent -- the
prompt, the rendered instructions, the presented labels, the permutation, each candidate's frames as
``{"sha256", "path"}`` in presented order, the reference's frames (or null), the condition frame and the
static example images when the request carried them (a world model's first frame; ``Examples:``), and the
candidates' ``sample_ids`` -- and ``scores_json`` holds ``presented label -> teacher score in [0, 1]``. Frames are
read from their stored path, or found by hash under ``<ledger dir>/media/<sha[:2]>/<sha>.jpg`` (the judge's layout)
when the path is relative to another working directory; their bytes must hash to the recorded sha256.

The **condition** of a group is the candidates' common ``sample_id`` (the trainer repeats one prompt record ``K``
times); its **cluster** comes from the condition ledger's map (:meth:`ConditionLedger.clusters
<flowforge.orchestrate.ledger.ConditionLedger.clusters>`) or, for a condition it does not know, from the prompt
text (:func:`flowforge.data.clusters.text_cluster`).

**Split** (:func:`split_clusters`): the known cluster ids (the condition ledger's, i.e. every condition the
pipeline may ever judge) are sorted by ``sha256("<seed>:<cluster>")``; the first ``round(n f_train)`` are ``train``,
up to ``round(n (f_train + f_val))`` ``val``, the rest ``test`` -- an exact 80/10/10 of the clusters, not of a
coin flip per cluster. Every group of a cluster lands in the same split (no near-duplicate of a held-out condition
is trained on), and a group keeps its split when more groups are judged. A cluster outside the known set (or every
cluster, when none is given) falls back to :func:`split_of`: ``u = int(sha256("<seed>:<cluster>")[:16], 16) /
2**64``; ``train`` when ``u < f_train``, ``val`` when ``u < f_train + f_val``, else ``test``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from torch import Tensor

from flowforge.data.clusters import text_cluster
from flowforge.rewards.judge import protocol as P
from flowforge.rewards.judge.ledger import RequestLedger

log = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")
SIDE_MEDIA = ("reference", "condition", "examples")  # a request's images besides the candidates' (JudgedGroup)
DEFAULT_FRACTIONS = (0.8, 0.1, 0.1)


@dataclasses.dataclass(frozen=True)
class JudgedGroup:
    """One teacher-judged group, candidates in **presented** order (as the judge showed them).

    ``candidates[j]`` are the frame files of presented candidate ``j`` (label ``labels[j]``, original index
    ``permutation[j]``); ``scores[j]`` is the teacher's score of it in ``[0, 1]``; ``reference``, ``condition`` and
    ``examples`` the frame files of the request's reference, condition frame and static example images (None: the
    request had none), so :func:`group_message` rebuilds exactly the message the teacher was sent.
    """

    key: str  # the judge request key (sha256 hex)
    condition_id: str
    cluster: str
    prompt: str
    instructions: str
    labels: tuple[str, ...]
    permutation: tuple[int, ...]
    candidates: tuple[tuple[str, ...], ...]
    scores: tuple[float, ...]
    reference: tuple[str, ...] | None = None
    model: str = ""
    template_sha256: str = ""
    hashes: tuple[tuple[str, ...], ...] = ()  # sha256 of each candidate frame, as ``candidates``
    reference_hashes: tuple[str, ...] = ()
    condition: tuple[str, ...] | None = None
    condition_hashes: tuple[str, ...] = ()
    examples: tuple[str, ...] | None = None
    examples_hashes: tuple[str, ...] = ()


def _frame_path(frame: Mapping[str, str], media_root: Path) -> str | None:
    path = frame.get("path")
    if path and Path(path).is_file():
        return str(path)
    digest = frame.get("sha256", "")
    fallback = media_root / digest[:2] / f"{digest}.jpg"
    return str(fallback) if digest and fallback.is_file() else None


def _condition(request: Mapping, prompt: str) -> str:
    ids = {i for i in request.get("sample_ids") or [] if i is not None}
    return ids.pop() if len(ids) == 1 else text_cluster(prompt)


def group_from_entry(entry, media_root: Path, clusters: Mapping[str, str] | None = None) -> JudgedGroup | None:
    """One ledger entry (:class:`flowforge.rewards.judge.ledger.LedgerEntry`) as a :class:`JudgedGroup`; None when
    it is not usable (malformed, or a frame file is missing); the reason is logged."""
    if entry.status != "ok" or entry.scores is None:
        return None
    req = entry.request
    labels = tuple(req["labels"])
    candidates, hashes = [], []
    for frames in req["candidates"]:
        paths = [_frame_path(f, media_root) for f in frames]
        if any(p is None for p in paths):
            log.warning("judged group %s skipped: a frame file is missing (sha256 %s)", entry.key[:12],
                        [f["sha256"] for f, p in zip(frames, paths) if p is None][:2])
            return None
        candidates.append(tuple(paths))
        hashes.append(tuple(f["sha256"] for f in frames))
    side = {}
    for name in SIDE_MEDIA:  # the request's other images: all of each present, or the group is not usable
        if req.get(name) is None:
            side[name], side[f"{name}_hashes"] = None, ()
            continue
        paths = tuple(_frame_path(f, media_root) for f in req[name])
        if any(p is None for p in paths):
            log.warning("judged group %s skipped: a frame file of its %s is missing", entry.key[:12], name)
            return None
        side[name], side[f"{name}_hashes"] = paths, tuple(f["sha256"] for f in req[name])
    prompt = req["prompt"]
    condition = _condition(req, prompt)
    return JudgedGroup(
        key=entry.key, condition_id=condition, cluster=(clusters or {}).get(condition) or text_cluster(prompt),
        prompt=prompt, instructions=req["instructions"], labels=labels, permutation=tuple(req["permutation"]),
        candidates=tuple(candidates), scores=tuple(float(entry.scores[label]) for label in labels),
        model=entry.model, template_sha256=entry.template_sha256, hashes=tuple(hashes), **side)


def read_judged_groups(ledger_path: str | Path, clusters: Mapping[str, str] | None = None,
                       media_root: str | Path | None = None) -> list[JudgedGroup]:
    """Every usable judged group of the request ledger at ``ledger_path``, in the order they were answered.

    Args:
        clusters: ``condition id -> cluster id`` (the condition ledger's); conditions not in it are clustered by
            their prompt text.
        media_root: where frames are found by hash (default: ``<ledger dir>/media``).

    Raises:
        FileNotFoundError: no ledger at ``ledger_path``.
    """
    path = Path(ledger_path)
    if not path.is_file():
        raise FileNotFoundError(f"no judge request ledger at {path}")
    root = Path(media_root) if media_root is not None else path.parent / "media"
    ledger = RequestLedger(path)
    try:
        entries = [ledger.get(key) for key in ledger.keys()]
    finally:
        ledger.close()
    groups = [g for g in (group_from_entry(e, root, clusters) for e in entries) if g is not None]
    skipped = len(entries) - len(groups)
    if skipped:
        log.info("read %d judged groups from %s (%d rows skipped: malformed or missing frames)", len(groups), path,
                 skipped)
    return groups


def read_frame(path: str, sha256: str | None = None) -> bytes:
    """The bytes of one stored frame, checked against its recorded sha256 when given.

    Raises:
        ValueError: the bytes do not hash to ``sha256`` (the media store was changed).
    """
    data = Path(path).read_bytes()
    if sha256 and hashlib.sha256(data).hexdigest() != sha256:
        raise ValueError(f"frame {path} does not match its recorded sha256 {sha256[:12]}...")
    return data


def decode_frame(data: bytes) -> Tensor:
    """Image bytes (JPEG / PNG) -> ``[3, H, W]`` float32 RGB in [0, 1] (:func:`P.decode_image_bytes`).

    Raises:
        ValueError: not a readable image.
    """
    return P.decode_image_bytes(data, "frame")


def _side_frames(group: JudgedGroup, name: str) -> list[bytes] | None:
    """The bytes of ``group``'s ``name`` frames (one of :data:`SIDE_MEDIA`), None when the request had none."""
    paths = getattr(group, name)
    if paths is None:
        return None
    digests = getattr(group, f"{name}_hashes") or (None,) * len(paths)
    return [read_frame(p, h) for p, h in zip(paths, digests, strict=True)]


def group_frames(group: JudgedGroup) -> tuple[list[bytes] | None, list[list[bytes]]]:
    """``(reference frames or None, candidate frames)`` of ``group`` as image bytes, presented order."""
    hashes = group.hashes or tuple(tuple([None] * len(c)) for c in group.candidates)
    candidates = [[read_frame(p, h) for p, h in zip(paths, digests, strict=True)]
                  for paths, digests in zip(group.candidates, hashes, strict=True)]
    return _side_frames(group, "reference"), candidates


def group_message(group: JudgedGroup) -> list[dict]:
    """The chat messages the teacher was sent for ``group`` (the first attempt: one user message laid out by
    :func:`flowforge.rewards.judge.protocol.build_content`, frames as data URLs, the condition frame and static
    examples in their slots when the request had them) -- the same content, byte for byte, so a student trained on it
    sees what a judge server is sent in stage C."""
    reference, candidates = group_frames(group)

    def urls(name: str, frames: list[bytes] | None = None) -> list[str] | None:
        frames = _side_frames(group, name) if frames is None else frames
        return [P.data_url(f) for f in frames] if frames else None  # as the client: no images, no header

    content = P.build_content(group.instructions, group.prompt, urls("reference", reference),
                              [[P.data_url(f) for f in frames] for frames in candidates], group.labels,
                              condition=urls("condition"), examples=urls("examples"))
    return [{"role": "user", "content": content}]


def score_answer(group: JudgedGroup, decimals: int = 0) -> str:
    """The teacher's scores as the strict reply the judge parser accepts: compact JSON ``{label: 100 s}`` rounded
    to ``decimals`` places (integers for 0), labels in presented order."""
    values = [round(100.0 * s, decimals) for s in group.scores]
    return json.dumps({label: (int(v) if decimals == 0 else v) for label, v in zip(group.labels, values)},
                      separators=(",", ":"))


def split_of(cluster: str, seed: int = 0, fractions: Sequence[float] = DEFAULT_FRACTIONS) -> str:
    """The split (``"train"``, ``"val"`` or ``"test"``) of a cluster (module docstring).

    Raises:
        ValueError: ``fractions`` are not three non-negative numbers summing to 1.
    """
    if len(fractions) != 3 or min(fractions) < 0 or abs(sum(fractions) - 1.0) > 1e-9:
        raise ValueError(f"split fractions must be three numbers >= 0 summing to 1, got {tuple(fractions)}")
    u = int(hashlib.sha256(f"{seed}:{cluster}".encode("utf-8")).hexdigest()[:16], 16) / 2.0**64
    if u < fractions[0]:
        return "train"
    return "val" if u < fractions[0] + fractions[1] else "test"


def split_clusters(clusters: Iterable[str], seed: int = 0,
                   fractions: Sequence[float] = DEFAULT_FRACTIONS) -> dict[str, str]:
    """``cluster -> split`` for the distinct ``clusters``: an exact split of the clusters by the module docstring's
    rule.

    Raises:
        ValueError: ``fractions`` are not three non-negative numbers summing to 1.
    """
    split_of("", seed, fractions)  # validates the fractions
    ordered = sorted(set(clusters), key=lambda c: hashlib.sha256(f"{seed}:{c}".encode("utf-8")).hexdigest())
    n = len(ordered)
    first, second = round(n * fractions[0]), round(n * (fractions[0] + fractions[1]))
    return {c: "train" if i < first else "val" if i < second else "test" for i, c in enumerate(ordered)}


def split_groups(groups: Sequence[JudgedGroup], seed: int = 0, fractions: Sequence[float] = DEFAULT_FRACTIONS,
                 clusters: Iterable[str] | None = None) -> dict[str, list[JudgedGroup]]:
    """``{"train", "val", "test"} -> groups`` by their cluster's split, order kept: :func:`split_clusters` of
    ``clusters`` (every cluster that may ever be judged, e.g. the condition ledger's), with :func:`split_of` for a
    cluster outside it; every group by :func:`split_of` when ``clusters`` is None."""
    assigned = split_clusters(clusters, seed, fractions) if clusters is not None else {}
    out: dict[str, list[JudgedGroup]] = {s: [] for s in SPLITS}
    for group in groups:
        out[assigned.get(group.cluster) or split_of(group.cluster, seed, fractions)].append(group)
    return out


def group_to_dict(group: JudgedGroup) -> dict:
    """A JSON-ready dict of ``group`` (:func:`group_from_dict` reverses it)."""
    return dataclasses.asdict(group)


def group_from_dict(data: Mapping) -> JudgedGroup:
    """The :class:`JudgedGroup` of a :func:`group_to_dict` dict (lists back to tuples)."""
    def tup(value):
        return tuple(tup(v) for v in value) if isinstance(value, list) else value

    return JudgedGroup(**{k: tup(v) for k, v in data.items()})
