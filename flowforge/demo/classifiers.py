"""Digit classifiers of the embedded default: the reward model and the independent DigitEval judge
(docs/architecture.md, "The embedded default").

Two small classifiers read 32x32 grey digits and are trained on *different*, disjoint splits of the demo data
(:mod:`flowforge.demo.data`) with different architectures and seeds, so that optimising the policy against one
(reward hacking included) is measured by another that shares neither its weights, its data nor its inductive bias:

=============  ===================================================  ============  ====  ==============================
classifier     architecture                                         trained on    seed  weights file
=============  ===================================================  ============  ====  ==============================
``RewardNet``  3 x (conv 3x3, ReLU, max-pool), dense 1024-64-10     ``reward``    0     ``digit_reward.safetensors``
``EvalNet``    2 x (conv 5x5, ReLU, max-pool), conv 3x3, global     ``eval_clf``  1     ``digit_eval.safetensors``
               average pool, linear 80-10
=============  ===================================================  ============  ====  ==============================

``DigitEval`` (GenEval's role at small scale) is the fraction of generated images whose ``EvalNet`` argmax is the
digit the prompt asked for. The reward of :class:`flowforge.rewards.digit.DigitScorer` is ``RewardNet``'s softmax
probability of that digit.

Inputs to both networks are images ``[B, 3, H, W]`` or ``[B, 1, H, W]``, float in [0, 1], white digit on black
(as MNIST and as the demo generator produces). RGB is averaged to grey; other sizes are resized to 32x32 (bilinear,
antialiased). Networks return logits ``[B, 10]`` float32.

Training (``python -m flowforge.demo.classifiers train --which reward|eval``) uses light augmentation written in
plain torch (``torchvision`` is not a dependency): a random affine map (rotation within +-12 degrees, scale
0.88..1.12, shear +-0.15, shift +-3 px), random stroke thickening / thinning, a random 3x3 blur, a random contrast
factor, a random grey background lift (half the images, up to 0.2) and additive Gaussian noise (std up to 0.1).
This makes the classifiers tolerate the blur, noise and off-centre strokes of a tiny generator rather than only
clean MNIST. Each batch also holds non-digit images (noise, flat grey) trained towards a uniform prediction
(outlier exposure), so a policy cannot collect reward, or pass DigitEval reliably, by emitting noise. The command
is deterministic on CPU for a fixed thread count.

Held-out accuracy of the packaged weights (``python -m flowforge.demo.classifiers evaluate``): RewardNet 0.982 on
``eval_clf`` and 0.978 on ``sft``; EvalNet 0.966 on ``reward`` and 0.965 on ``sft``. Label smoothing keeps the
softmax of a clean digit near 0.95 rather than 1.0, which bounds the digit reward below 1.
"""

from __future__ import annotations

import argparse
import functools
import math
import pathlib
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flowforge.demo import data

WEIGHTS_DIR = pathlib.Path(__file__).resolve().parent / "weights"
REWARD_WEIGHTS = WEIGHTS_DIR / "digit_reward.safetensors"
EVAL_WEIGHTS = WEIGHTS_DIR / "digit_eval.safetensors"

NUM_CLASSES = data.NUM_CLASSES
IMAGE_SIZE = data.IMAGE_SIZE
OUTLIER_WEIGHT = 0.5
"""Weight of the outlier-exposure term (uniform-target cross-entropy on non-digit images) in training."""


def check_images(images: Tensor) -> int:
    """Validate a classifier input and return ``B``.

    Raises:
        ValueError: ``images`` is not a floating-point ``[B, 3, H, W]`` or ``[B, 1, H, W]`` tensor.
    """
    if not isinstance(images, Tensor) or images.dim() != 4 or images.shape[1] not in (1, 3):
        shape = tuple(images.shape) if isinstance(images, Tensor) else type(images).__name__
        raise ValueError(f"images must be a [B, 3, H, W] or [B, 1, H, W] tensor, got {shape}")
    if not images.is_floating_point():
        raise ValueError(f"images must be floating point in [0, 1], got dtype {images.dtype}")
    return images.shape[0]


def to_gray32(images: Tensor) -> Tensor:
    """Convert media to the classifiers' input: grey ``[B, 1, 32, 32]`` float32 in [0, 1].

    Args:
        images: ``[B, 3, H, W]`` or ``[B, 1, H, W]``, floating point, values in [0, 1] (not checked per pixel;
            values are clamped to [0, 1]). RGB is averaged with equal weights.

    Raises:
        ValueError: ``images`` is not a 4-d floating tensor with 1 or 3 channels.
    """
    check_images(images)
    gray = images.float().mean(dim=1, keepdim=True).clamp(0.0, 1.0)
    if gray.shape[-2:] != (IMAGE_SIZE, IMAGE_SIZE):
        gray = F.interpolate(gray, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear", antialias=True, align_corners=False)
    return gray


class RewardNet(nn.Module):
    """Reward classifier: three conv 3x3 / ReLU / 2x2 max-pool stages (16, 32, 64 channels), then 1024-64-10.

    ``forward(images [B, 1|3, H, W] in [0, 1]) -> logits [B, 10] float32``. About 89k parameters.
    """

    architecture = "reward_cnn3_v1"

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(64 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, NUM_CLASSES))

    def forward(self, images: Tensor) -> Tensor:
        x = (to_gray32(images) - 0.5) / 0.5
        return self.head(self.features(x))


class EvalNet(nn.Module):
    """DigitEval classifier: conv 5x5 (20) / pool, conv 5x5 (40) / pool, conv 3x3 (80), global average pool, 80-10.

    ``forward(images [B, 1|3, H, W] in [0, 1]) -> logits [B, 10] float32``. About 50k parameters. Deliberately a
    different design from :class:`RewardNet` (larger kernels, no dense hidden layer, global pooling).
    """

    architecture = "eval_cnn_gap_v1"

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 20, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(20, 40, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(40, 80, 3, padding=1), nn.ReLU(),
        )
        self.head = nn.Linear(80, NUM_CLASSES)

    def forward(self, images: Tensor) -> Tensor:
        x = (to_gray32(images) - 0.5) / 0.5
        return self.head(self.features(x).mean(dim=(2, 3)))


_SPECS: dict[str, tuple[type[nn.Module], str, int, pathlib.Path]] = {
    "reward": (RewardNet, "reward", 0, REWARD_WEIGHTS),
    "eval": (EvalNet, "eval_clf", 1, EVAL_WEIGHTS),
}
"""which -> (architecture, training split, seed, packaged weights path)."""


WHICH = ("reward", "eval")
"""Allowed classifier names for :func:`train_classifier` and the CLI."""


def _check_which(which: str) -> None:
    if which not in WHICH:
        raise ValueError(f"which must be one of {list(WHICH)}, got {which!r}")


def augment(images: Tensor, generator: torch.Generator) -> Tensor:
    """Randomly distort a batch of grey digits (training only).

    Args:
        images: ``[B, 1, 32, 32]`` float32 in [0, 1].
        generator: CPU generator that drives every random choice (reproducibility).

    Returns:
        ``[B, 1, 32, 32]`` float32 in [0, 1].
    """
    b = images.shape[0]

    def uniform(low: float, high: float) -> Tensor:
        return low + (high - low) * torch.rand(b, generator=generator)

    angle = uniform(-12.0, 12.0) * math.pi / 180.0
    scale = uniform(0.88, 1.12)
    shear = uniform(-0.15, 0.15)
    shift = 3.0 / (IMAGE_SIZE / 2)  # 3 px in affine_grid's [-1, 1] coordinates
    tx, ty = uniform(-shift, shift), uniform(-shift, shift)
    cos, sin = torch.cos(angle) / scale, torch.sin(angle) / scale
    theta = torch.stack(
        [torch.stack([cos, -sin + shear, tx], dim=1), torch.stack([sin, cos, ty], dim=1)], dim=1
    )
    grid = F.affine_grid(theta, list(images.shape), align_corners=False)
    x = F.grid_sample(images, grid, mode="bilinear", padding_mode="zeros", align_corners=False)

    thickness = torch.rand(b, generator=generator)
    dilated = F.max_pool2d(x, 3, stride=1, padding=1)
    eroded = -F.max_pool2d(-x, 3, stride=1, padding=1)
    x = torch.where((thickness < 0.2).view(b, 1, 1, 1), 0.5 * (x + dilated), x)
    x = torch.where((thickness > 0.85).view(b, 1, 1, 1), 0.5 * (x + eroded), x)

    blur_kernel = torch.tensor([[1.0, 2.0, 1.0], [2.0, 4.0, 2.0], [1.0, 2.0, 1.0]]).div(16.0).view(1, 1, 3, 3)
    blurred = F.conv2d(x, blur_kernel, padding=1)
    x = torch.where((torch.rand(b, generator=generator) < 0.3).view(b, 1, 1, 1), blurred, x)

    lift = uniform(0.0, 0.2) * (torch.rand(b, generator=generator) < 0.5)
    x = lift.view(b, 1, 1, 1) + x * uniform(0.7, 1.0).view(b, 1, 1, 1)
    noise_std = uniform(0.0, 0.1).view(b, 1, 1, 1)
    x = x + noise_std * torch.randn(x.shape, generator=generator)
    return x.clamp(0.0, 1.0)


def outlier_images(count: int, generator: torch.Generator) -> Tensor:
    """Non-digit images for outlier exposure: uniform noise, Gaussian noise around a random grey level, blurred
    noise and flat grey images, in equal shares. ``[count, 1, 32, 32]`` float32 in [0, 1]."""
    shape = (count, 1, IMAGE_SIZE, IMAGE_SIZE)
    level = torch.rand(count, 1, 1, 1, generator=generator)
    uniform = torch.rand(shape, generator=generator)
    gaussian = (level + 0.3 * torch.randn(shape, generator=generator)).clamp(0.0, 1.0)
    blurred = F.avg_pool2d(torch.rand(shape, generator=generator), 5, stride=1, padding=2, count_include_pad=False)
    flat = level.expand(shape)
    kind = torch.arange(count) % 4
    out = torch.where((kind == 0).view(-1, 1, 1, 1), uniform, gaussian)
    out = torch.where((kind == 2).view(-1, 1, 1, 1), blurred, out)
    return torch.where((kind == 3).view(-1, 1, 1, 1), flat, out)


def train_classifier(which: str, *, epochs: int = 60, batch_size: int = 64, lr: float = 3e-3) -> nn.Module:
    """Train ``RewardNet`` (``which="reward"``, split ``"reward"``, seed 0) or ``EvalNet`` (``"eval"``, split
    ``"eval_clf"``, seed 1) from scratch on CPU with :func:`augment`; AdamW, one-cycle learning rate.

    Loss per batch: cross-entropy on the augmented digits (label smoothing 0.05) plus ``OUTLIER_WEIGHT`` times the
    cross-entropy between a uniform distribution and the prediction on ``batch_size // 4`` :func:`outlier_images`
    (outlier exposure, Hendrycks et al. 2019), so noise is not scored as a confident digit.

    Returns:
        The trained module in eval mode.

    Raises:
        ValueError: ``which`` is not ``"reward"`` or ``"eval"``; ``epochs``/``batch_size`` not positive.
    """
    _check_which(which)
    if epochs <= 0 or batch_size <= 0:
        raise ValueError(f"epochs and batch_size must be positive, got epochs={epochs}, batch_size={batch_size}")
    cls, split, seed, _ = _SPECS[which]
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    images, labels = data.load_split(split)
    model = cls()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    steps_per_epoch = math.ceil(len(images) / batch_size)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=epochs * steps_per_epoch)
    outlier_count = max(4, batch_size // 4)
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(images), generator=generator)
        for start in range(0, len(images), batch_size):
            index = order[start : start + batch_size]
            logits = model(augment(images[index], generator))
            loss = F.cross_entropy(logits, labels[index], label_smoothing=0.05)
            outlier_logits = model(outlier_images(outlier_count, generator))
            loss = loss - OUTLIER_WEIGHT * F.log_softmax(outlier_logits, dim=1).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
    return model.eval()


def save_classifier(model: nn.Module, path: str | pathlib.Path, *, train_split: str, seed: int) -> None:
    """Write ``model``'s weights (float32) and provenance metadata to a ``.safetensors`` file (no pickle)."""
    from safetensors.torch import save_file

    tensors = {name: value.detach().float().contiguous() for name, value in model.state_dict().items()}
    metadata = {"architecture": model.architecture, "train_split": train_split, "seed": str(seed)}
    save_file(tensors, str(path), metadata=metadata)


def _load(cls: type[nn.Module], path: pathlib.Path) -> nn.Module:
    from safetensors import safe_open
    from safetensors.torch import load_file

    if not path.is_file():
        raise FileNotFoundError(
            f"classifier weights {path} are missing; rebuild them with "
            f"`python -m flowforge.demo.classifiers train --which {'reward' if cls is RewardNet else 'eval'}`"
        )
    with safe_open(str(path), framework="pt") as handle:
        architecture = (handle.metadata() or {}).get("architecture")
    if architecture != cls.architecture:
        raise ValueError(f"{path} holds architecture {architecture!r}, expected {cls.architecture!r}")
    model = cls()
    model.load_state_dict(load_file(str(path)))
    model.eval()
    model.requires_grad_(False)
    return model


@functools.lru_cache(maxsize=1)
def load_reward_classifier() -> RewardNet:
    """The packaged reward classifier (CPU, eval mode, ``requires_grad=False``). Cached: do not modify it in place;
    ``copy.deepcopy`` it before moving it to another device.

    Raises:
        FileNotFoundError: the weights file is missing. ValueError: it holds another architecture.
    """
    return _load(RewardNet, REWARD_WEIGHTS)


@functools.lru_cache(maxsize=1)
def load_eval_classifier() -> EvalNet:
    """The packaged DigitEval classifier (CPU, eval mode, ``requires_grad=False``). Cached: do not modify it in
    place; ``copy.deepcopy`` it before moving it to another device.

    Raises:
        FileNotFoundError: the weights file is missing. ValueError: it holds another architecture.
    """
    return _load(EvalNet, EVAL_WEIGHTS)


def _as_digits(digits: Tensor | Sequence[int], batch: int) -> Tensor:
    target = torch.as_tensor(digits)
    if target.dim() != 1 or target.numel() != batch:
        raise ValueError(f"digits must have one entry per image ({batch}), got shape {tuple(target.shape)}")
    if target.is_floating_point() or target.dtype == torch.bool:
        raise ValueError(f"digits must be integers 0..9, got dtype {target.dtype}")
    if batch and (int(target.min()) < 0 or int(target.max()) > 9):
        raise ValueError(f"digits must be integers 0..9, got values in [{int(target.min())}, {int(target.max())}]")
    return target.long()


@torch.no_grad()
def predict_logits(model: nn.Module, images: Tensor, *, batch_size: int = 256) -> Tensor:
    """Run a digit classifier over ``images`` ``[B, 1|3, H, W]`` in [0, 1] in chunks; returns logits
    ``[B, 10]`` float32 on the images' device (the model must already be on that device)."""
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    chunks = [model(images[start : start + batch_size]) for start in range(0, images.shape[0], batch_size)]
    return torch.cat(chunks) if chunks else torch.empty(0, NUM_CLASSES, device=images.device)


def digit_eval(images: Tensor, digits: Tensor | Sequence[int], *, model: nn.Module | None = None) -> Tensor:
    """DigitEval per image: whether ``EvalNet``'s argmax equals the requested digit.

    Args:
        images: ``[B, 3, H, W]`` or ``[B, 1, H, W]`` float in [0, 1].
        digits: ``[B]`` requested digits, integers 0..9 (tensor or sequence).
        model: classifier to use; defaults to :func:`load_eval_classifier` (CPU, so ``images`` are moved to CPU).

    Returns:
        ``[B]`` bool tensor on the images' device.

    Raises:
        ValueError: bad image shape or dtype; ``digits`` of the wrong length, type or range.
    """
    target = _as_digits(digits, check_images(images))
    classifier = load_eval_classifier() if model is None else model
    device = next(classifier.parameters()).device
    predicted = predict_logits(classifier, images.to(device)).argmax(dim=1)
    return (predicted == target.to(device)).to(images.device)


def digit_eval_accuracy(images: Tensor, digits: Tensor | Sequence[int], *, model: nn.Module | None = None) -> float:
    """Mean of :func:`digit_eval` over the batch, a float in [0, 1]. Raises ValueError on an empty batch."""
    if check_images(images) == 0:
        raise ValueError("digit_eval_accuracy needs at least one image, got an empty batch")
    return digit_eval(images, digits, model=model).float().mean().item()


def held_out_accuracies() -> dict[str, float]:
    """Accuracy of the packaged classifiers on splits they never saw: RewardNet on ``eval_clf`` and ``sft``,
    EvalNet on ``reward`` and ``sft``. Keys look like ``"reward_on_eval_clf"``."""
    results = {}
    for which, model in (("reward", load_reward_classifier()), ("eval", load_eval_classifier())):
        own_split = _SPECS[which][1]
        for split in data.SPLIT_NAMES:
            if split == own_split:
                continue
            images, labels = data.load_split(split)
            results[f"{which}_on_{split}"] = digit_eval_accuracy(images, labels, model=model)
    return results


def main(argv: Sequence[str] | None = None) -> None:
    """CLI: ``train --which reward|eval [--epochs N]`` rewrites the packaged weights; ``evaluate`` prints the
    held-out accuracies of the packaged weights."""
    parser = argparse.ArgumentParser(prog="python -m flowforge.demo.classifiers", description=main.__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train one classifier and write its packaged weights")
    train.add_argument("--which", choices=WHICH, required=True)
    train.add_argument("--epochs", type=int, default=60)
    train.add_argument("--out", type=pathlib.Path, default=None, help="output path (default: the packaged file)")
    commands.add_parser("evaluate", help="print held-out accuracies of the packaged weights")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.command == "train":
        cls, split, seed, default_path = _SPECS[args.which]
        model = train_classifier(args.which, epochs=args.epochs)
        out = args.out or default_path
        out.parent.mkdir(parents=True, exist_ok=True)
        save_classifier(model, out, train_split=split, seed=seed)
        params = sum(p.numel() for p in model.parameters())
        print(f"wrote {out} ({cls.__name__}, {params} parameters, trained on {split!r} with seed {seed})")
        for other in data.SPLIT_NAMES:
            if other != split:
                images, labels = data.load_split(other)
                print(f"  accuracy on held-out split {other!r}: {digit_eval_accuracy(images, labels, model=model):.4f}")
    else:
        for key, value in held_out_accuracies().items():
            print(f"{key}: {value:.4f}")


if __name__ == "__main__":
    main()
