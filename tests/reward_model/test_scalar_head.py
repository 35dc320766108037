"""The ``scalar_head`` student: its loss by hand, training on a separable set, the scorer it saves as, the judge
server's scorer backend in front of it, and resumable training (kill after an epoch, rerun, same weights)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from flowforge.reward_model.config import ScalarHeadOptions, student_config
from flowforge.reward_model.data import group_message
from flowforge.reward_model.evaluate import evaluate, gate
from flowforge.reward_model.scalar_head import ScalarHeadScorer, ScalarHeadStudent
from flowforge.reward_model.students import load_student
from flowforge.reward_model.train import train_student
from flowforge.rewards.judge import protocol as P
from tests.reward_model import support

FAST = {"kind": "scalar_head", "epochs": 12, "lr": 3e-3, "batch_size": 8,
        "scalar_head": {"image_size": 16, "channels": [8, 16], "hidden": 16, "text_encoder": "none"}}


def hash_embedding(prompts):
    """A given prompt embedding (``text_encoder: "tests.reward_model.test_scalar_head:hash_embedding"``)."""
    return torch.stack([torch.tensor([float(len(p)), float(sum(map(ord, p)) % 7), 1.0]) for p in prompts])


def test_the_loss_is_bradley_terry_plus_regression(tmp_path):
    group = support.synthetic_groups(tmp_path, 1, k=3)[0]
    student = ScalarHeadStudent(ScalarHeadOptions(image_size=16, channels=(4,), hidden=4, text_encoder="none",
                                                  pairwise_weight=0.7, regression_weight=0.3))
    loss, parts = student.loss([group])
    s = student.candidate_scores([group])[0].detach().double()
    teacher = torch.tensor(group.scores, dtype=torch.float64)
    r = torch.log(s / (1 - s))
    pairs = [F.softplus(-(r[i] - r[j])) for i in range(3) for j in range(3) if teacher[i] > teacher[j]]
    assert parts["pairs"] == 3 == len(pairs)
    expected = 0.7 * torch.stack(pairs).mean() + 0.3 * ((s - teacher) ** 2).mean()
    assert float(loss.detach()) == pytest.approx(float(expected), rel=1e-5)


def test_training_separates_a_separable_set_and_serves_as_a_scorer(tmp_path):
    torch.set_num_threads(1)
    train = support.synthetic_groups(tmp_path / "train", 48, seed=0)
    held_out = support.synthetic_groups(tmp_path / "held", 16, seed=1)
    result = train_student(student_config(FAST), train, tmp_path / "run")
    student = load_student(result.student_dir)
    metrics = evaluate(student, held_out)
    assert metrics["pairwise_accuracy"] > 0.9 and metrics["spearman"] > 0.8
    assert gate(metrics, {"min_spearman": 0.8, "min_pairwise_accuracy": 0.9, "max_mae": 0.5,
                          "max_failure_rate": 0.0, "min_groups": 16}) == (True, [])
    assert result.history[-1]["train"]["loss"] < result.history[0]["train"]["loss"]
    assert result.split_sizes["train"] + result.split_sizes["val"] + result.split_sizes["test"] == 48

    from flowforge.rewards.registry import build_scorer

    scorer = build_scorer("flowforge.reward_model.scalar_head:ScalarHeadScorer", path=str(result.student_dir))
    assert scorer.needs_group is False and isinstance(scorer, ScalarHeadScorer)
    media = torch.stack([torch.full((3, 24, 24), v) for v in (0.2, 0.5, 0.8)])
    scores = scorer(media, ["p"] * 3, [{}] * 3)
    assert scores.dtype == torch.float32 and scores.shape == (3,) and scores[0] < scores[1] < scores[2]

    from flowforge.serve.judge_backends import ScorerBackend, student_backend

    backend = student_backend(result.student_dir)
    assert isinstance(backend, ScorerBackend) and backend.model_id == "student"
    group = held_out[0]
    served = P.parse_scores(backend.complete(group_message(group)).text, group.labels)
    assert served == pytest.approx(student.predict([group])[0].tolist(), abs=1e-5)


def test_a_given_prompt_embedding_is_saved_and_used(tmp_path):
    groups = support.synthetic_groups(tmp_path / "g", 4)
    options = ScalarHeadOptions(image_size=16, channels=(4,), hidden=4,
                                text_encoder="tests.reward_model.test_scalar_head:hash_embedding")
    student = ScalarHeadStudent(options, seed=3)
    assert student.text_dim == 3 and student.net.text_proj is not None
    student.save(tmp_path / "s")
    again = ScalarHeadStudent.load(tmp_path / "s")
    assert [torch.equal(a, b) for a, b in zip(again.predict(groups), student.predict(groups))] == [True] * 4


def test_the_default_prompt_embedding_is_minilm(tmp_path):
    groups = support.synthetic_groups(tmp_path / "g", 2)
    student = ScalarHeadStudent(ScalarHeadOptions(image_size=16, channels=(4,), hidden=4))
    assert student.text_dim == 384
    scores = student.predict(groups)
    assert [s.shape for s in scores] == [(4,), (4,)] and all(((s > 0) & (s < 1)).all() for s in scores)


def test_training_resumes_after_a_kill_with_the_same_weights(tmp_path):
    groups = support.synthetic_groups(tmp_path / "g", 24, seed=2)
    cfg = {**FAST, "epochs": 3, "keep_checkpoints": 2}
    straight = train_student(cfg, groups, tmp_path / "straight")

    class Killed(Exception):
        pass

    def kill_after_two(epoch, record):
        if epoch == 2:
            raise Killed

    with pytest.raises(Killed):
        train_student(cfg, groups, tmp_path / "resumed", on_epoch=kill_after_two)
    (tmp_path / "resumed" / "checkpoints" / "step_000003").mkdir()  # a half-written epoch-3 checkpoint
    epochs = []
    resumed = train_student(cfg, groups, tmp_path / "resumed", on_epoch=lambda e, r: epochs.append(e))
    assert epochs == [3] and not (tmp_path / "resumed" / "checkpoints" / "step_000001").exists()  # keep=2
    a, b = load_student(straight.student_dir), load_student(resumed.student_dir)
    assert all(torch.equal(x, y) for x, y in zip(a.net.state_dict().values(), b.net.state_dict().values()))
    assert resumed.history == json.loads(json.dumps(straight.history)) and resumed.test == straight.test
    again = train_student(cfg, groups, tmp_path / "resumed", on_epoch=lambda e, r: epochs.append(e))
    assert epochs == [3] and again.history == resumed.history  # finished: nothing retrained
    more = train_student({**cfg, "epochs": 4}, groups, tmp_path / "resumed", on_epoch=lambda e, r: epochs.append(e))
    assert epochs == [3, 4] and len(more.history) == 4  # more epochs continue the run
    with pytest.raises(ValueError, match="another config"):
        train_student({**cfg, "lr": 1e-2}, groups, tmp_path / "resumed")
    with pytest.raises(ValueError, match="another splits"):
        train_student(cfg, groups[:-1], tmp_path / "resumed")


def test_a_prompt_embedding_does_not_depend_on_the_prompts_encoded_with_it(tmp_path):
    """MiniLM pads a batch to its longest prompt, which moves a shorter prompt's pooled embedding in the last bits;
    the student's cache then held whatever batch a prompt was first seen in, so a resumed run (first batches of a
    later epoch) trained on other inputs than an uninterrupted one (issue 24 item 4). One prompt at a time: a
    prompt's embedding is a function of the prompt alone."""
    options = ScalarHeadOptions(image_size=16, channels=(4,), hidden=4)
    short, long = "a seven", "a very long prompt about a handwritten digit seven drawn in thick black ink"
    alone = ScalarHeadStudent(options).embed([short])
    together = ScalarHeadStudent(options).embed([long, short])
    assert torch.equal(together[1], alone[0])


def test_a_minilm_student_resumes_bit_for_bit(tmp_path):
    """A student with the MiniLM prompt embedding, killed after epoch 1 and rerun, ends with the weights, history
    and test metrics of an uninterrupted run (prompts of different lengths, so batches pad differently)."""
    import dataclasses

    words = ["digit", "a handwritten digit", "the number written in thick strokes on paper",
             "one digit, centred, white on black, slightly rotated to the left"]
    groups = [dataclasses.replace(g, prompt=f"{words[i % 4]} {i}")
              for i, g in enumerate(support.synthetic_groups(tmp_path / "g", 12, seed=4))]
    cfg = {**FAST, "epochs": 3, "batch_size": 2, "split": [0.5, 0.25, 0.25],
           "scalar_head": {**FAST["scalar_head"], "text_encoder": "minilm"}}
    straight = train_student(cfg, groups, tmp_path / "straight")

    class Killed(Exception):
        pass

    def kill_after_one(epoch, record):
        if epoch == 1:
            raise Killed

    with pytest.raises(Killed):
        train_student(cfg, groups, tmp_path / "resumed", on_epoch=kill_after_one)
    best = torch.load(tmp_path / "resumed" / "checkpoints" / "step_000001" / "best.pt", weights_only=True)
    assert best["epoch"] == 1  # the checkpoint carries the best epoch's weights (validation's state) itself
    resumed = train_student(cfg, groups, tmp_path / "resumed")
    a, b = load_student(straight.student_dir), load_student(resumed.student_dir)
    assert [torch.equal(x, y) for x, y in zip(a.net.state_dict().values(), b.net.state_dict().values())] == \
        [True] * len(a.net.state_dict())
    assert resumed.history == json.loads(json.dumps(straight.history))
    assert (resumed.best_epoch, resumed.val, resumed.test) == (straight.best_epoch, straight.val, straight.test)


def test_a_checkpoint_of_the_older_layout_resumes_with_the_run_directory_best_file(tmp_path):
    """Checkpoints written before they carried ``best.pt`` kept it beside them, in the run directory: a rerun of
    such a directory uses that file when it holds the epoch the history selects, and ends as an uninterrupted run."""
    groups = support.synthetic_groups(tmp_path / "g", 24, seed=2)
    cfg = {**FAST, "epochs": 3}
    straight = train_student(cfg, groups, tmp_path / "straight")

    class Killed(Exception):
        pass

    def kill_after_two(epoch, record):
        if epoch == 2:
            raise Killed

    with pytest.raises(Killed):
        train_student(cfg, groups, tmp_path / "old", on_epoch=kill_after_two)
    for step in ("step_000001", "step_000002"):  # the older layout: one best.pt beside the checkpoints
        (tmp_path / "old" / "checkpoints" / step / "best.pt").replace(tmp_path / "old" / "best.pt")
    resumed = train_student(cfg, groups, tmp_path / "old")
    a, b = load_student(straight.student_dir), load_student(resumed.student_dir)
    assert all(torch.equal(x, y) for x, y in zip(a.net.state_dict().values(), b.net.state_dict().values()))
    assert (resumed.best_epoch, resumed.history) == (straight.best_epoch, json.loads(json.dumps(straight.history)))


def test_training_augmentation_moves_each_candidate_alike_and_never_touches_inference(tmp_path):
    groups = support.synthetic_groups(tmp_path, 2, k=3)
    off = ScalarHeadStudent(ScalarHeadOptions(image_size=16, channels=(4,), hidden=4, text_encoder="none"))
    frames = torch.rand(5, 3, 16, 16) * 2 - 1
    assert off.augment(frames, [2, 3]) is frames  # every augment_* 0: the identity
    on = ScalarHeadStudent(ScalarHeadOptions(image_size=16, channels=(4,), hidden=4, text_encoder="none",
                                             augment_rotate=10, augment_scale=0.1, augment_shift=0.06))
    torch.manual_seed(3)
    first = on.augment(frames, [2, 3])
    torch.manual_seed(3)
    assert torch.equal(on.augment(frames, [2, 3]), first)  # drawn from the (per-epoch seeded) global generator
    assert not torch.allclose(first, frames, atol=1e-3)
    # the two frames of candidate 0 (and the three of candidate 1) share one draw: a frame copied within a
    # candidate comes out equal, across candidates not
    same = frames[[0, 0, 2, 2, 2]]
    moved = on.augment(same, [2, 3])
    assert torch.equal(moved[0], moved[1]) and torch.equal(moved[2], moved[4])
    assert not torch.allclose(moved[1], on.augment(frames[[0, 0, 0, 0, 0]], [1, 4])[1], atol=1e-3)
    on.net.load_state_dict(off.net.state_dict())
    on.eval()  # inference: the same scores as the unaugmented student, every call
    assert torch.equal(on.predict(groups)[0], off.predict(groups)[0])
    on.train()  # training: other inputs, so other scores
    assert not torch.allclose(on.candidate_scores(groups)[0].detach(), off.predict(groups)[0], atol=1e-6)
    with pytest.raises(ValueError, match="augment_rotate"):
        student_config({"scalar_head": {"augment_shift": 0.7}})


def _order_groups(root, n, *, frames=4, size=16, seed=0):
    """Judged video groups whose teacher marks depend on frame order only: every candidate shows the same frames (a
    bright square at positions 0..F-1 along the diagonal), played forwards (mark 0.9) or backwards (0.1)."""
    from flowforge.reward_model.data import JudgedGroup

    root.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    base = torch.zeros(frames, 3, size, size)
    for f in range(frames):
        base[f, :, 3 * f:3 * f + 4, 3 * f:3 * f + 4] = 1.0
    groups = []
    for g in range(n):
        forwards = (torch.randperm(4, generator=gen) < 2).tolist()
        paths, hashes = [], []
        for fwd in forwards:
            clip = base if fwd else base.flip(0)
            clip = (clip + 0.03 * torch.randn(clip.shape, generator=gen)).clamp(0, 1)
            data = [P.jpeg_bytes(frame, size, 95) for frame in clip]
            digests = [P.sha256_hex(d) for d in data]
            for d, h in zip(data, digests):
                (root / f"{h}.jpg").write_bytes(d)
            paths.append(tuple(str(root / f"{h}.jpg") for h in digests))
            hashes.append(tuple(digests))
        groups.append(JudgedGroup(
            key=f"o{seed}-{g}", condition_id=f"c{g}", cluster=f"cl-{g}", prompt="p", instructions="Score.",
            labels=tuple(P.candidate_labels(4)), permutation=(0, 1, 2, 3), candidates=tuple(paths),
            scores=tuple(0.9 if fwd else 0.1 for fwd in forwards), hashes=tuple(hashes)))
    return groups


def test_a_clip_student_sees_frame_order_and_serves_whole_videos(tmp_path):
    """Candidates that differ only in frame order: a per-frame student scores them alike (up to the noise), a
    ``clip_frames`` student separates them; saved, it scores whole videos as a scorer and behind the judge server's
    scorer backend with the scores it predicts."""
    torch.set_num_threads(1)
    train = _order_groups(tmp_path / "train", 24, seed=0)
    held = _order_groups(tmp_path / "held", 8, seed=1)
    split = [1.0, 0.0, 0.0]
    per_frame = train_student(student_config({**FAST, "split": split}), train, tmp_path / "frames")
    assert evaluate(load_student(per_frame.student_dir), held)["pairwise_accuracy"] < 0.7  # noise only
    # with a prompt embedding: one per clip (the per-frame student has one per frame)
    clip_cfg = {**FAST, "split": split, "scalar_head": {
        **FAST["scalar_head"], "clip_frames": 4, "text_encoder": "tests.reward_model.test_scalar_head:hash_embedding"}}
    result = train_student(student_config(clip_cfg), train, tmp_path / "clips")
    student = load_student(result.student_dir)
    assert evaluate(student, held)["pairwise_accuracy"] > 0.9

    from flowforge.reward_model.data import decode_frame, group_frames
    from flowforge.serve.judge_backends import student_backend

    scorer = ScalarHeadScorer(result.student_dir)
    assert scorer.takes_video
    _, frames = group_frames(held[0])
    video = torch.stack([torch.stack([decode_frame(f) for f in c], 1) for c in frames])  # [K, 3, F, H, W]
    torch.testing.assert_close(scorer(video, ["p"] * 4, [{}] * 4), student.predict([held[0]])[0], atol=1e-5, rtol=0)
    served = P.parse_scores(student_backend(result.student_dir).complete(group_message(held[0])).text, held[0].labels)
    assert served == pytest.approx(student.predict([held[0]])[0].tolist(), abs=1e-5)
    with pytest.raises(ValueError, match="clip_frames=4"):
        scorer(video[:, :, :3], ["p"] * 4, [{}] * 4)


def _reference_groups(root, n, *, frames=4, size=16, seed=0):
    """Judged video groups whose marks need the reference: each group has its own real future (a bright square at
    a random place per frame, stored as one strip ``[3, size, frames * size]`` like world-stages' ``reference``);
    a candidate copies each of its frames from the reference or draws the square elsewhere, and its mark is the
    share of frames it copied. Without the reference every candidate is a clip of random squares."""
    from flowforge.reward_model.data import JudgedGroup

    root.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)

    def clip():
        out = torch.zeros(frames, 3, size, size)
        for f in range(frames):
            y, x = torch.randint(0, size - 4, (2,), generator=gen).tolist()
            out[f, :, y:y + 4, x:x + 4] = 1.0
        return out

    def store(image):
        data = P.jpeg_bytes(image, max(image.shape[-2:]), 95)
        digest = P.sha256_hex(data)
        (root / f"{digest}.jpg").write_bytes(data)
        return str(root / f"{digest}.jpg"), digest

    groups = []
    for g in range(n):
        real = clip()
        ref_path, ref_hash = store(torch.cat(list(real), dim=-1))  # the strip, frames side by side
        paths, hashes, marks = [], [], []
        for _ in range(4):
            copied = torch.rand(frames, generator=gen) < 0.5
            candidate = torch.where(copied[:, None, None, None], real, clip())
            stored = [store(frame) for frame in candidate]
            paths.append(tuple(p for p, _ in stored))
            hashes.append(tuple(h for _, h in stored))
            marks.append(float(copied.float().mean()))
        groups.append(JudgedGroup(
            key=f"r{seed}-{g}", condition_id=f"c{g}", cluster=f"cl-{g}", prompt="p", instructions="Score.",
            labels=tuple(P.candidate_labels(4)), permutation=(0, 1, 2, 3), candidates=tuple(paths),
            scores=tuple(marks), reference=(ref_path,), hashes=tuple(hashes), reference_hashes=(ref_hash,)))
    return groups


def test_a_reference_student_learns_what_only_the_reference_shows_and_serves_with_it(tmp_path):
    """Marks that are a candidate's closeness to its group's real future: a clip student without the reference
    cannot learn them; with ``reference: true`` it does, and saved it scores whole videos against the
    ``reference_media`` a judge request carries (as a scorer and behind the judge server's scorer backend), and
    refuses a video without one."""
    torch.set_num_threads(1)
    train = _reference_groups(tmp_path / "train", 32, seed=0)
    held = _reference_groups(tmp_path / "held", 12, seed=1)
    split = [1.0, 0.0, 0.0]
    clip = {**FAST, "epochs": 16, "split": split, "scalar_head": {**FAST["scalar_head"], "clip_frames": 4}}
    blind = train_student(student_config(clip), train, tmp_path / "blind")
    blind_agreement = evaluate(load_student(blind.student_dir), held)["spearman"]
    ref_cfg = {**clip, "scalar_head": {**clip["scalar_head"], "reference": True}}
    result = train_student(student_config(ref_cfg), train, tmp_path / "ref")
    student = load_student(result.student_dir)
    seeing = evaluate(student, held)["spearman"]
    assert seeing > 0.7 and seeing > blind_agreement + 0.4, (seeing, blind_agreement)
    from flowforge.reward_model.probes import shortcut_probes

    # the no_reference probe shows it a black reference (it cannot score without one): its agreement goes
    probes, reasons = shortcut_probes(student, held, student_config(ref_cfg).gate)
    assert probes["no_reference"]["groups"] == 12 and probes["no_reference"]["spearman"] < seeing - 0.4, probes
    assert reasons == []

    from flowforge.reward_model.data import decode_frame, group_frames
    from flowforge.serve.judge_backends import ScorerBackend, student_backend

    scorer = ScalarHeadScorer(result.student_dir)
    assert scorer.takes_video and scorer.metadata_keys == ("reference_media",)
    reference, frames = group_frames(held[0])
    video = torch.stack([torch.stack([decode_frame(f) for f in c], 1) for c in frames])  # [K, 3, F, H, W]
    strip = decode_frame(reference[0])  # [3, H, F W]
    expected = student.predict([held[0]])[0]
    torch.testing.assert_close(scorer(video, ["p"] * 4, [{"reference_media": strip}] * 4), expected, atol=1e-5,
                               rtol=0)
    as_video = strip.reshape(3, 16, 4, 16).permute(0, 2, 1, 3)  # the same reference as [3, F, H, W]
    torch.testing.assert_close(scorer(video, ["p"] * 4, [{"reference_media": as_video}] * 4), expected, atol=1e-5,
                               rtol=0)
    backend = student_backend(result.student_dir)
    assert isinstance(backend, ScorerBackend)
    served = P.parse_scores(backend.complete(group_message(held[0])).text, held[0].labels)
    assert served == pytest.approx(expected.tolist(), abs=1e-5)
    with pytest.raises(ValueError, match="reference_media"):
        scorer(video, ["p"] * 4, [{}] * 4)
    with pytest.raises(ValueError, match="strip"):
        scorer(video, ["p"] * 4, [{"reference_media": strip[:, :, :32]}] * 4)


def test_a_reference_student_is_refused_without_clips_or_with_augmentation():
    with pytest.raises(ValueError, match="clip_frames > 0"):
        student_config({"scalar_head": {"reference": True}})
    with pytest.raises(ValueError, match="augment"):
        student_config({"scalar_head": {"reference": True, "clip_frames": 4, "augment_shift": 0.1}})
