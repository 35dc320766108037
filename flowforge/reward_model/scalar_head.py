"""Student kind ``scalar_head``: a small CNN over each frame plus the prompt embedding -> one score per candidate.

Cheap enough to train and run on a CPU, and a plain flowforge reward scorer (:class:`ScalarHeadScorer`,
``needs_group = False``) usable in-process or behind ``flowforge serve judge --student PATH``.

Model, for a frame ``x`` (``[3, H, W]`` in [0, 1], resized to ``S x S``, scaled to [-1, 1]) and prompt embedding
``e`` (``[E]``; MiniLM's pooled sentence embedding, a given function's output, or none):

    z = W_i pool(CNN(x)),   u = W_t e,   l = MLP([z, u, z * u])   (just MLP(z) without a prompt embedding)
    frame score σ(l);   candidate score s = mean over its frames of σ(l)   (the trainer's rule for videos)

With ``clip_frames: N`` > 0 the input ``x`` is a candidate's whole clip instead: its ``N`` frames in order, stacked
along the channels (``[3 N, S, S]``), and ``s = σ(l)`` -- the net sees motion and order (a video judge's marks of
moves and their timing), where a per-frame mean is blind to both. With ``reference: true`` as well, the net also
sees the group's reference clip ``r`` (the real future a world-model teacher grades against, the same for every
candidate of the group): its input is ``[x, (x - r)^2]`` (``[6 N, S, S]``, the square per pixel), so it can learn
"how far from the real future, and where" -- what such a teacher's marks are made of -- which a student without the
reference must guess from the candidates alone. The square, not the signed difference: a paddle or ball where the
real future has none and one missing where it has one are both errors (5-fold cross-validation on a world
pipeline's stage-A groups: mean within-group Spearman with the teacher ~0.45 with the square, ~0.17 with the signed
difference, ~0 without the reference).

Loss over a batch of groups, with teacher scores ``t`` on [0, 1] and ``r = logit(s)``:

    L = w_pair * mean_{(i, j): t_i - t_j > margin} softplus(-(r_i - r_j))  +  w_reg * mean (s - t)^2

the first term is the Bradley-Terry negative log-likelihood of the teacher's within-group order (Bradley & Terry
1952; as in reward-model training from pairwise preferences, e.g. Ouyang et al. 2022), over every ordered pair of
each group; the second keeps the scale of the teacher's scores.

The network starts from random weights, or from pretrained ones (``student.scalar_head.init``: a ``.safetensors``
file of some or all of its tensors, :meth:`ScalarHeadStudent.load_init`), as a VLM student starts from a pretrained
model: ``demo:digit-tower`` is the whole network pretrained as a prompt-digit matcher on real digits
(:mod:`flowforge.reward_model.pretrain`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flowforge.reward_model.config import ScalarHeadOptions
from flowforge.reward_model.data import JudgedGroup, decode_frame, group_frames
from flowforge.rewards.base import check_inputs

KIND = "scalar_head"
META_FILE = "meta.json"
WEIGHTS_FILE = "model.safetensors"
EPS = 1e-6


class ScalarHeadNet(nn.Module):
    """The CNN + prompt-embedding head (module docstring): ``(images [N, 3, S, S], text [N, E] | None) -> [N]``
    logits (float32)."""

    def __init__(self, channels: Sequence[int], hidden: int, text_dim: int, in_channels: int = 3) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c_in = in_channels
        for c in channels:  # GroupNorm(1, c): per-sample normalisation, so a score never depends on its batch
            layers += [nn.Conv2d(c_in, c, 3, stride=2, padding=1), nn.GroupNorm(1, c), nn.SiLU()]
            c_in = c
        self.backbone = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.image_proj = nn.Linear(c_in, hidden)
        self.text_proj = nn.Linear(text_dim, hidden) if text_dim else None
        self.head = nn.Sequential(nn.SiLU(), nn.Linear(hidden * (3 if text_dim else 1), hidden), nn.SiLU(),
                                  nn.Linear(hidden, 1))

    def forward(self, images: Tensor, text: Tensor | None = None) -> Tensor:
        return self.combine(self.image_proj(self.backbone(images)),
                            None if self.text_proj is None else self.text_proj(text))

    def combine(self, z: Tensor, u: Tensor | None) -> Tensor:
        """Image features ``z`` ``[..., hidden]`` and projected prompt ``u`` (same leading shape, or None without a
        prompt embedding) -> logits ``[...]``."""
        if u is not None:
            z = torch.cat([z, u, z * u], dim=-1)
        return self.head(z).squeeze(-1)


def _import_function(spec: str):
    from flowforge.runtime.imports import import_object

    return import_object(spec, f"student.scalar_head {spec!r}")


class ScalarHeadStudent:
    """A ``scalar_head`` student (module docstring).

    Args:
        options: the ``student.scalar_head`` section.
        device: where it runs. seed: initialisation seed.
        text_dim: the prompt embedding's size (None: measured by embedding one prompt).
    """

    kind = KIND
    scores_candidates_alone = True  # one frame score per candidate: the group's shortcut probes are vacuous

    def __init__(self, options: ScalarHeadOptions, *, device: str = "cpu", seed: int = 0,
                 text_dim: int | None = None, pretrained: bool = True) -> None:
        if options.clip_frames < 0:
            raise ValueError(f"student.scalar_head.clip_frames={options.clip_frames} must be >= 0")
        if options.reference and not options.clip_frames:
            raise ValueError("student.scalar_head.reference=true needs clip_frames > 0")
        self.options, self.device = options, torch.device(device)
        self._encoder: Any = None
        self._text_cache: dict[str, Tensor] = {}
        self._frames: dict[str, list[Tensor]] = {}
        self._references: dict[str, Tensor] = {}
        self.needs_reference = bool(options.reference)  # the no_reference probe then blanks it (probes.py)
        if text_dim is None:
            probe = self.embed(["a prompt"])
            text_dim = 0 if probe is None else int(probe.shape[-1])
        self.text_dim = text_dim
        torch.manual_seed(seed)
        in_channels = 3 * max(1, options.clip_frames) * (2 if options.reference else 1)
        self.net = ScalarHeadNet(options.channels, options.hidden, text_dim, in_channels).to(self.device)
        if options.init and pretrained:
            self.load_init(options.init)

    def load_init(self, source: str | Path) -> list[str]:
        """Start from pretrained weights (``options.init``: a ``.safetensors`` file of some or all of the network's
        tensors, e.g. :mod:`flowforge.reward_model.pretrain`'s, or the ``demo:digit-tower`` name); tensors the file
        does not hold keep their random initialisation. Returns the loaded keys.

        Raises:
            FileNotFoundError: no such file. ValueError: the file holds a key the network does not have, a tensor
                of another shape, no tensor at all, or names another ``text_encoder`` in its metadata.
        """
        from safetensors import safe_open
        from safetensors.torch import load_file

        from flowforge.demo.paths import resolve_demo_path

        path = Path(resolve_demo_path(str(source)))
        if not path.is_file():
            raise FileNotFoundError(f"student.scalar_head.init: no file {path}")
        with safe_open(str(path), framework="pt") as handle:
            encoder = (handle.metadata() or {}).get("text_encoder")
        if encoder is not None and encoder != self.options.text_encoder:
            raise ValueError(f"student.scalar_head.init={source} was trained with text_encoder={encoder!r}, not "
                             f"{self.options.text_encoder!r}")
        tensors = load_file(str(path), device=str(self.device))
        own = self.net.state_dict()
        bad = [k for k, v in tensors.items() if k not in own or own[k].shape != v.shape]
        if not tensors:
            raise ValueError(f"student.scalar_head.init={source} holds no tensor")
        if bad:
            raise ValueError(f"student.scalar_head.init={source}: {len(bad)} tensors do not fit this scalar_head "
                             f"(channels={list(self.options.channels)}, hidden={self.options.hidden}), e.g. {bad[:3]}")
        self.net.load_state_dict(tensors, strict=False)
        return sorted(tensors)

    # ------------------------------------------------------------------------------------------------ inputs
    def embed(self, prompts: Sequence[str]) -> Tensor | None:
        """``[B, E]`` float32 prompt embeddings (cached per prompt), or None with ``text_encoder: none``.

        Each prompt is encoded alone (a batch of one), so its embedding depends on the prompt only: MiniLM pads a
        batch to its longest prompt, which moves the others' pooled embeddings in the last bits, and the cache would
        then keep whichever batch a prompt was first seen in -- a resumed training run (whose first batches are a
        later epoch's) or a server scoring other batches would see other inputs (issue 24).
        """
        kind = self.options.text_encoder
        if kind == "none":
            return None
        missing = sorted({p for p in prompts if p not in self._text_cache})
        if missing and self._encoder is None:
            if kind == "minilm":
                from flowforge.models.text import MiniLMEncoder

                self._encoder = MiniLMEncoder(device=self.device)
            else:
                self._encoder = _import_function(kind)
        for prompt in missing:
            if kind == "minilm":
                vector = self._encoder.encode([prompt])[2]  # [1, E] pooled
            else:
                vector = torch.as_tensor(self._encoder([prompt]))  # [1, E]
            self._text_cache[prompt] = vector[0].float().to(self.device)
        return torch.stack([self._text_cache[p] for p in prompts])

    def preprocess(self, images: Tensor) -> Tensor:
        """``[N, 3, H, W]`` in [0, 1] -> ``[N, 3, S, S]`` in [-1, 1] (bilinear, antialiased)."""
        size = self.options.image_size
        images = images.to(self.device, torch.float32)
        if images.shape[-2:] != (size, size):
            images = F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False, antialias=True)
        return images * 2.0 - 1.0

    def _group_frames(self, group: JudgedGroup) -> list[Tensor]:
        """Per presented candidate: its preprocessed frames ``[F, 3, S, S]`` (decoded once, cached)."""
        if group.key not in self._frames:
            _, candidates = group_frames(group)
            self._frames[group.key] = [self.preprocess(torch.stack([decode_frame(f) for f in frames]))
                                       for frames in candidates]
        return self._frames[group.key]

    def reference_clip(self, reference: Tensor, shape: tuple[int, int]) -> Tensor:
        """A reference clip in [0, 1] for candidates of frame size ``shape = (H, W)``: ``[3, F, H, W]`` or the strip
        ``[3, H, F W]`` (:func:`flowforge.media.reference_video`, ``F = clip_frames``) -> the net's ``[3 F, S, S]``
        reference input, preprocessed like a candidate.

        Raises:
            ValueError: a reference of neither shape.
        """
        from flowforge.media import reference_video

        n = self.options.clip_frames
        video = reference_video(reference, n, tuple(shape), field="metadata.reference_media")
        return self.preprocess(video.transpose(0, 1)).reshape(3 * n, *((self.options.image_size,) * 2))

    def _group_reference(self, group: JudgedGroup) -> Tensor:
        """The group's reference as the net's ``[3 F, S, S]`` input (decoded once, cached).

        Raises:
            ValueError: the group was judged without a reference.
        """
        if group.key not in self._references:
            reference, candidates = group_frames(group)
            if not reference:
                raise ValueError(f"student.scalar_head.reference=true, but judged group {group.key[:12]} has no "
                                 "reference (judge with the prompt rows' `reference`)")
            frames = [decode_frame(f) for f in reference]
            video = frames[0] if len(frames) == 1 else torch.stack(frames, 1)  # a strip, or [3, F, H, W]
            shape = decode_frame(candidates[0][0]).shape[-2:]  # the candidates' frame size
            self._references[group.key] = self.reference_clip(video, shape)
        return self._references[group.key]

    def with_reference(self, clips: Tensor, references: Tensor) -> Tensor:
        """Clips ``[B, 3 F, S, S]`` and their references ``[B, 3 F, S, S]`` -> ``[B, 6 F, S, S]`` = ``[x, (x - r)^2]``."""
        return torch.cat([clips, (clips - references) ** 2], dim=1)

    def augment(self, frames: Tensor, counts: Sequence[int]) -> Tensor:
        """Training-time random affine of preprocessed ``frames`` ``[N, 3, S, S]`` (one draw per candidate, its
        ``counts[i]`` frames alike, so a video stays one motion): rotation, scale and shift drawn uniformly within
        ``options.augment_*`` from torch's global generator (seeded per epoch by the trainer), bilinear with border
        padding. The identity when every ``augment_*`` is 0.

        Label-preserving only for a teacher whose marks are stable under such distortions; measure it before
        relying on it (``bench/augment_labels.py``: at rotate 10, scale 0.1, shift 0.06 the legibility teacher
        :class:`~flowforge.orchestrate.demo.LegibilityScorer`, although it averages its classifier over distortions
        of its own, moves a mark by ~0.05 and flips ~13 % of a group's ordered pairs;
        :class:`~flowforge.orchestrate.demo.FineStrokeScorer` ~20 %).
        """
        o = self.options
        if not (o.augment_rotate or o.augment_scale or o.augment_shift):
            return frames
        n = len(counts)
        u = torch.rand(n, 4) * 2 - 1  # [n, 4] in [-1, 1): angle, scale, shift x, shift y
        angle = torch.deg2rad(u[:, 0] * o.augment_rotate)
        scale = 1 + u[:, 1] * o.augment_scale
        cos, sin = torch.cos(angle) * scale, torch.sin(angle) * scale
        shift = u[:, 2:] * (2 * o.augment_shift)  # affine_grid's coordinates span 2 per side
        theta = torch.stack([torch.stack([cos, -sin, shift[:, 0]], 1), torch.stack([sin, cos, shift[:, 1]], 1)], 1)
        theta = theta.repeat_interleave(torch.tensor(list(counts)), dim=0).to(frames)
        grid = F.affine_grid(theta, list(frames.shape), align_corners=False)
        return F.grid_sample(frames, grid, mode="bilinear", padding_mode="border", align_corners=False)

    def clips(self, frames: Tensor, counts: Sequence[int]) -> Tensor:
        """Preprocessed frames ``[N, 3, S, S]`` of candidates with ``counts`` frames each -> the net's inputs: the
        frames as they are (``clip_frames`` 0), or one ``[3 F, S, S]`` clip per candidate, frames in order.

        Raises:
            ValueError: a candidate whose frame count is not ``clip_frames``.
        """
        n = self.options.clip_frames
        if not n:
            return frames
        if any(c != n for c in counts):
            raise ValueError(f"this scalar_head student scores clips of clip_frames={n} frames, got candidates of "
                             f"{sorted(set(counts))} frames (send every frame: the judge's frames option)")
        return frames.reshape(len(counts), n * 3, *frames.shape[-2:])

    def candidate_scores(self, groups: Sequence[JudgedGroup]) -> list[Tensor]:
        """One ``[K]`` float32 tensor of candidate scores in (0, 1) per group (presented order), with gradients."""
        frames = [self._group_frames(g) for g in groups]
        flat = torch.cat([f for per_group in frames for f in per_group])
        counts = [f.shape[0] for per_group in frames for f in per_group]
        if self.net.training:
            flat = self.augment(flat, counts)
        if self.options.clip_frames:
            flat, counts = self.clips(flat, counts), [1] * len(counts)
        if self.options.reference:
            refs = torch.stack([self._group_reference(g) for g, per_group in zip(groups, frames) for _ in per_group])
            flat = self.with_reference(flat, refs)
        text = None
        if self.text_dim:  # one prompt per input: per frame, or per clip (counts are then all 1)
            prompts = [g.prompt for g, per_group in zip(groups, frames) for _ in per_group]
            text = self.embed([p for p, c in zip(prompts, counts) for _ in range(c)])
        frame_scores = torch.sigmoid(self.net(flat, text))
        per_candidate = torch.stack([s.mean() for s in torch.split(frame_scores, counts)])
        sizes = [len(per_group) for per_group in frames]
        return list(torch.split(per_candidate, sizes))

    # ------------------------------------------------------------------------------------------------ training
    def loss(self, groups: Sequence[JudgedGroup]) -> tuple[Tensor, dict[str, float]]:
        """The module docstring's loss over ``groups`` and its parts (``pair_loss``, ``mse``, ``pairs``)."""
        o = self.options
        bt_terms, sq_terms = [], []
        for scores, group in zip(self.candidate_scores(groups), groups, strict=True):
            teacher = torch.tensor(group.scores, dtype=torch.float32, device=scores.device)
            r = torch.logit(scores.clamp(EPS, 1 - EPS))
            ordered = (teacher[:, None] - teacher[None, :]) > o.tie_margin  # [K, K]: i beats j
            bt_terms.append(F.softplus(-(r[:, None] - r[None, :]))[ordered])
            sq_terms.append((scores - teacher) ** 2)
        pairs = torch.cat(bt_terms)
        pair_loss = pairs.mean() if pairs.numel() else torch.zeros((), device=self.device)
        mse = torch.cat(sq_terms).mean()
        loss = o.pairwise_weight * pair_loss + o.regression_weight * mse
        return loss, {"loss": float(loss.detach()), "pair_loss": float(pair_loss.detach()),
                      "mse": float(mse.detach()), "pairs": float(pairs.numel())}

    def backward(self, groups: Sequence[JudgedGroup]) -> dict[str, float]:
        """Accumulate the gradient of :meth:`loss` over ``groups``; its metrics."""
        loss, metrics = self.loss(groups)
        loss.backward()
        return metrics

    def trainable_parameters(self) -> list[nn.Parameter]:
        return list(self.net.parameters())

    def trainable_state(self) -> dict[str, Tensor]:
        return {k: v.detach().clone() for k, v in self.net.state_dict().items()}

    def load_trainable_state(self, state: dict[str, Tensor]) -> None:
        self.net.load_state_dict(state)

    def train(self) -> None:
        self.net.train()

    def eval(self) -> None:
        self.net.eval()

    # ------------------------------------------------------------------------------------------------ inference
    @torch.no_grad()
    def predict(self, groups: Sequence[JudgedGroup]) -> list[Tensor]:
        """One ``[K]`` float32 CPU tensor of scores per group (presented order)."""
        return [s.detach().float().cpu() for s in self.candidate_scores(groups)]

    @torch.no_grad()
    def score_images(self, media: Tensor, prompts: Sequence[str],
                     references: Sequence[Tensor] | None = None) -> Tensor:
        """``[B, 3, H, W]`` in [0, 1] + ``B`` prompts -> ``[B]`` float32 frame scores in (0, 1); with
        ``clip_frames`` > 0, videos ``[B, 3, F, H, W]`` -> ``[B]`` clip scores; with ``reference`` also, each
        video's reference (``references[i]``: ``[3, F, H, W]`` or the strip ``[3, H, F W]``, :meth:`reference_clip`).

        Raises:
            ValueError: a video whose ``F`` is not ``clip_frames``; a reference student given no (or a mis-shaped)
                reference.
        """
        text = self.embed(prompts) if self.text_dim else None
        if self.options.clip_frames:
            b, _, f = media.shape[:3]
            frames = self.preprocess(media.transpose(1, 2).flatten(0, 1))  # [B F, 3, S, S]
            clips = self.clips(frames, [f] * b)
            if self.options.reference:
                if references is None or len(references) != b:
                    raise ValueError(f"this scalar_head student compares each video with its reference "
                                     f"(metadata.reference_media): {b} videos, "
                                     f"{'no' if references is None else len(references)} references")
                clips = self.with_reference(clips, torch.stack([self.reference_clip(r, media.shape[-2:])
                                                                for r in references]))
            return torch.sigmoid(self.net(clips, text)).float()
        return torch.sigmoid(self.net(self.preprocess(media), text)).float()

    # ------------------------------------------------------------------------------------------------ files
    def save(self, path: str | Path) -> None:
        """Write ``meta.json`` + ``model.safetensors`` into the directory ``path`` (created)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous().cpu() for k, v in self.net.state_dict().items()}, str(path / WEIGHTS_FILE))
        meta = {"kind": KIND, "version": 1, "options": dataclasses.asdict(self.options), "text_dim": self.text_dim}
        (path / META_FILE).write_text(json.dumps(meta, indent=1))

    @classmethod
    def load(cls, path: str | Path, *, device: str = "cpu") -> ScalarHeadStudent:
        """The student saved at ``path``.

        Raises:
            ValueError: the directory holds another kind of student.
        """
        from safetensors.torch import load_file

        path = Path(path)
        meta = json.loads((path / META_FILE).read_text())
        if meta.get("kind") != KIND:
            raise ValueError(f"{path} holds a {meta.get('kind')!r} student, not {KIND!r}")
        options = meta["options"]
        options = ScalarHeadOptions(**{**options, "channels": tuple(options["channels"])})
        student = cls(options, device=device, text_dim=meta["text_dim"], pretrained=False)
        student.net.load_state_dict(load_file(str(path / WEIGHTS_FILE), device=str(student.device)))
        student.eval()
        return student


class ScalarHeadScorer:
    """A saved ``scalar_head`` student as a flowforge reward scorer: ``[B, 3, H, W]`` in [0, 1] -> ``[B]`` float32
    scores in (0, 1), higher is better, one image at a time (``needs_group = False``); a clip student
    (``clip_frames`` > 0) takes whole videos ``[B, 3, F, H, W]`` (``takes_video``).

    In a training config: ``reward.weights: {"flowforge.reward_model.scalar_head:ScalarHeadScorer": 1.0}`` with
    ``reward.options: {"flowforge.reward_model.scalar_head:ScalarHeadScorer": {path: STUDENT_DIR}}``.

    Args:
        path: the student directory. device: where it runs. batch_size: images per forward.
    """

    name = "scalar_head"
    needs_group: ClassVar[bool] = False

    def __init__(self, path: str | Path, device: str = "cpu", batch_size: int = 64) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        self.student = ScalarHeadStudent.load(path, device=device)
        self.batch_size = batch_size
        # a clip student scores whole videos [B, 3, F, H, W] (the trainer and the judge server then send them whole)
        self.takes_video = bool(self.student.options.clip_frames)
        # a reference student compares with the real future: `flowforge serve judge` requests carry it
        self.metadata_keys = ("reference_media",) if self.student.options.reference else ()

    def __call__(self, media: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> Tensor:
        if self.takes_video:
            if media.dim() != 5:
                raise ValueError(f"this scalar_head student scores videos [B, 3, F, H, W], got {tuple(media.shape)}")
            check_inputs(media[:, :, 0], prompts, metadata)
        else:
            check_inputs(media, prompts, metadata)
        references = None
        if self.metadata_keys:
            missing = [i for i, m in enumerate(metadata) if m.get("reference_media") is None]
            if missing:
                raise ValueError(f"metadata.reference_media (the real future) is required by this scalar_head "
                                 f"student; rows {missing[:4]} have none")
            references = [m["reference_media"].to(media.device) for m in metadata]
        chunks = [self.student.score_images(media[i:i + self.batch_size], prompts[i:i + self.batch_size],
                                            None if references is None else references[i:i + self.batch_size])
                  for i in range(0, media.shape[0], self.batch_size)]
        return torch.cat(chunks).to(media.device)
