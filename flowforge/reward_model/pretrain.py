"""A pretrained ``scalar_head`` student for the digits demo: the analogue, at digits scale, of a VLM student that
starts from a pretrained image-text model rather than from random weights.

:func:`pretrain_digit_matcher` trains a whole :class:`~flowforge.reward_model.scalar_head.ScalarHeadNet` (CNN image
tower, MiniLM prompt projection and head) as a prompt-image matcher on real digits: for an image ``x`` of digit
``y`` and one phrasing ``e_d`` of each digit ``d`` (drawn from :data:`PRETRAIN_TEMPLATES`), each logit
``l(x, e_d)`` is trained with binary cross-entropy towards "``x`` shows ``d``" (target ``1 - eps`` for ``d = y``,
``eps`` otherwise, ``eps`` = :data:`SMOOTHING`): the sigmoid image-text matching loss of SigLIP (Zhai et al. 2023)
over ten prompts per image. Non-digit images (:func:`flowforge.demo.classifiers.outlier_images`) match no prompt
(outlier exposure; Hendrycks et al. 2019). Each logit is calibrated on its own, so ``sigmoid(l(x, e))`` is already a
score of ``x`` for the one prompt ``e`` -- the student's score before it has seen any teacher mark.

What it shares with the demo's teacher and evaluator: nothing but the task. Images are the demo's ``sft`` split
(:mod:`flowforge.demo.data`: 3,000 real MNIST digits; the teacher's ``RewardNet`` learnt from ``reward``, DigitEval's
``EvalNet`` from ``eval_clf``), seed 2 (theirs: 0 and 1), another architecture, and phrasings that are none of the
demo's train or eval prompts (:data:`PRETRAIN_TEMPLATES`; a test checks they are disjoint). Frames are prepared as the
student prepares them (grey replicated to RGB, ``[-1, 1]``), with the demo classifiers' augmentation
(:func:`flowforge.demo.classifiers.augment`).

The file holds every tensor of the network and, in its metadata, the options it fits (``channels``, ``hidden``,
``image_size``, ``text_encoder``) and its provenance; a student starts from it with ``student.scalar_head.init``
(:meth:`~flowforge.reward_model.scalar_head.ScalarHeadStudent.load_init`). The shipped one is
``demo:digit-tower``::

    python -m flowforge.reward_model.pretrain --channels 32 64 128 --hidden 128 \
        --out flowforge/demo/weights/student_digit_tower.safetensors

(the shape ``examples/stages/digits.yaml`` sets; held-out zero-shot accuracy 0.945 on ``reward``, 0.956 on
``eval_clf``; the default ``16 32 64`` / ``64`` reaches lower student-teacher agreement on the demo).

Deterministic on CPU for a fixed thread count (the command sets 1 thread). The held-out zero-shot accuracy (argmax
over the ten prompts) is printed.
"""

from __future__ import annotations

import argparse
import math
import pathlib
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from flowforge.reward_model.config import ScalarHeadOptions
from flowforge.reward_model.scalar_head import ScalarHeadNet

PRETRAIN_TEMPLATES = (
    "the number {word}",
    "a {numeral}",
    "an image of {word}",
    "digit {numeral}",
    "this is a {word}",
    "a written {numeral}",
    "the symbol {numeral}",
    "{word} in white ink",
    "a small {word}",
    "the figure {numeral}",
)
"""Pretraining phrasings (``{word}``: "zero".."nine", ``{numeral}``: "0".."9"), none of the demo's prompts."""

SPLIT, SEED = "sft", 2
SMOOTHING = 0.02


def _student_input(gray: Tensor) -> Tensor:
    """Grey ``[B, 1, 32, 32]`` in [0, 1] -> the student's frame input ``[B, 3, 32, 32]`` in [-1, 1]."""
    return gray.expand(-1, 3, -1, -1) * 2.0 - 1.0


def prompt_table() -> list[list[str]]:
    """``[template][digit]`` pretraining prompts (:data:`PRETRAIN_TEMPLATES` rendered for 0..9)."""
    from flowforge.demo.prompts import DIGIT_WORDS

    return [[t.format(word=DIGIT_WORDS[d], numeral=str(d)) for d in range(10)] for t in PRETRAIN_TEMPLATES]


def digit_logits(net: ScalarHeadNet, images: Tensor, text: Tensor) -> Tensor:
    """``[B, 3, S, S]`` frames and one prompt embedding per digit ``[B, 10, E]`` -> ``[B, 10]`` matching logits."""
    z = net.image_proj(net.backbone(images))[:, None, :].expand(-1, text.shape[1], -1)
    return net.combine(z, net.text_proj(text))


def _embeddings(encoder: str) -> Tensor:
    """``[T, 10, E]`` float32 embeddings of :func:`prompt_table` with the student's text encoder."""
    from flowforge.reward_model.scalar_head import ScalarHeadStudent

    table = prompt_table()
    student = ScalarHeadStudent(ScalarHeadOptions(text_encoder=encoder))
    flat = student.embed([p for row in table for p in row])
    return flat.view(len(table), 10, -1)


def pretrain_digit_matcher(options: ScalarHeadOptions | None = None, *, epochs: int = 30, batch_size: int = 64,
                           lr: float = 3e-3) -> tuple[ScalarHeadNet, Tensor]:
    """Train a ``scalar_head`` network of ``options`` (default :class:`ScalarHeadOptions`) as a prompt-image
    matcher (module docstring): AdamW, one-cycle learning rate, ``batch_size`` digits + ``batch_size // 4``
    outliers per step.

    Returns:
        ``(network in eval mode, prompt embeddings [T, 10, E])``.

    Raises:
        ValueError: ``options.image_size`` is not 32 (the demo digits' size) or ``text_encoder`` is ``none``;
            epochs or batch_size < 1.
    """
    from flowforge.demo import classifiers, data

    o = options or ScalarHeadOptions()
    if o.image_size != data.IMAGE_SIZE or o.text_encoder == "none":
        raise ValueError(f"scalar_head image_size={o.image_size}, text_encoder={o.text_encoder!r}: the digit matcher "
                         f"needs image_size {data.IMAGE_SIZE} and a prompt embedding")
    if epochs < 1 or batch_size < 1:
        raise ValueError(f"epochs and batch_size must be >= 1, got {epochs}, {batch_size}")
    text = _embeddings(o.text_encoder)
    torch.manual_seed(SEED)
    generator = torch.Generator().manual_seed(SEED)
    images, labels = data.load_split(SPLIT)
    net = ScalarHeadNet(o.channels, o.hidden, text.shape[-1])
    optimizer = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=1e-4)
    steps = math.ceil(len(images) / batch_size)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=epochs * steps)
    outliers = max(4, batch_size // 4)
    digits = torch.arange(10)
    net.train()
    for _ in range(epochs):
        order = torch.randperm(len(images), generator=generator)
        for start in range(0, len(images), batch_size):
            index = order[start:start + batch_size]
            x = torch.cat([classifiers.augment(images[index], generator),
                           classifiers.outlier_images(outliers, generator)])
            phrasing = torch.randint(len(text), (x.shape[0], 10), generator=generator)  # one phrasing per digit
            logits = digit_logits(net, _student_input(x), text[phrasing, digits])
            target = torch.zeros_like(logits)
            target[torch.arange(len(index)), labels[index]] = 1.0  # outlier rows (after the digits) match nothing
            n = len(index)
            loss = F.binary_cross_entropy_with_logits(logits, target * (1 - 2 * SMOOTHING) + SMOOTHING)
            loss = loss + F.cross_entropy(logits[:n], labels[index], label_smoothing=0.05)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
    return net.eval(), text


@torch.no_grad()
def zero_shot_accuracy(net: ScalarHeadNet, text: Tensor, split: str) -> float:
    """Top-1 accuracy on the demo split ``split`` of the argmax over ten prompts (the first phrasing of each
    digit), a float in [0, 1]."""
    from flowforge.demo import data

    images, labels = data.load_split(split)
    logits = digit_logits(net, _student_input(images), text[0][None].expand(len(images), -1, -1))
    return float((logits.argmax(1) == labels).float().mean())


def save_matcher(net: ScalarHeadNet, options: ScalarHeadOptions, path: str | pathlib.Path) -> None:
    """Write every tensor of ``net`` (float32) and the options / provenance metadata to a ``.safetensors`` file."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().float().contiguous() for k, v in net.state_dict().items()}
    meta = {"kind": "scalar_head_init", "channels": ",".join(map(str, options.channels)),
            "hidden": str(options.hidden), "image_size": str(options.image_size),
            "text_encoder": options.text_encoder, "train_split": SPLIT, "seed": str(SEED),
            "task": "prompt-image matching over ten digit prompts (flowforge.reward_model.pretrain)"}
    save_file(tensors, str(path), metadata=meta)


def main(argv: Sequence[str] | None = None) -> None:
    """CLI: pretrain the default ``scalar_head`` network on the demo digits and write it to ``--out``."""
    parser = argparse.ArgumentParser(prog="python -m flowforge.reward_model.pretrain", description=main.__doc__)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--channels", type=int, nargs="+", default=list(ScalarHeadOptions.channels),
                        help="conv stages (student.scalar_head.channels)")
    parser.add_argument("--hidden", type=int, default=ScalarHeadOptions.hidden, help="student.scalar_head.hidden")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    options = ScalarHeadOptions(channels=tuple(args.channels), hidden=args.hidden)
    net, text = pretrain_digit_matcher(options, epochs=args.epochs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_matcher(net, options, args.out)
    args.out.chmod(0o644)
    print(f"wrote {args.out} (trained on {SPLIT!r}, seed {SEED}); zero-shot accuracy on held-out splits: "
          + ", ".join(f"{s} {zero_shot_accuracy(net, text, s):.4f}" for s in ("reward", "eval_clf")))


if __name__ == "__main__":
    main()
