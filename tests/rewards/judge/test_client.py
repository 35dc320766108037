"""``vlm_judge`` without a server: options, the registry's ``run_dir``, ledger hits (by key and by slot), the
condition frame, and the processor's metrics. The HTTP paths (un-permutation, frames per candidate, parser repairs,
retries, billing, SIGKILL between send and record) are in ``tests/serve/test_judge_server.py``.
"""

import math
from pathlib import Path

import pytest
import torch

from flowforge.rewards import RewardProcessor
from flowforge.rewards.judge import protocol as P
from flowforge.rewards.judge.client import LEDGER_FILE, VLMJudge, load_reference
from flowforge.rewards.judge.ledger import LedgerEntry, Slot
from flowforge.rewards.registry import SCORERS, build_scorer

UNREACHABLE = "http://127.0.0.1:9/v1"  # the discard port: nothing answers; these tests never send


def _judge(**kw):
    return VLMJudge(model="m", base_url=UNREACHABLE, api_key_env=None, **kw)


def test_registered_with_run_dir_from_the_registry(tmp_path):
    assert SCORERS["vlm_judge"] is VLMJudge and VLMJudge.needs_group is True and VLMJudge.takes_video is True
    judge = build_scorer("vlm_judge", run_dir=tmp_path, model="m", base_url=UNREACHABLE, api_key_env=None)
    assert not (tmp_path / LEDGER_FILE).exists()  # opened on first use: a rank that never judges never opens it
    assert judge.ledger.path == str(tmp_path / LEDGER_FILE) and (tmp_path / LEDGER_FILE).exists()
    assert build_scorer("jpeg_compressibility", run_dir=tmp_path).name == "jpeg_compressibility"  # dropped there
    defaults = judge.settings
    assert (defaults["frames"], defaults["max_side"]) == (24, 832)  # the source protocol's defaults


@pytest.mark.parametrize("bad", [dict(frames=0), dict(max_side=0), dict(max_attempts=0), dict(max_concurrency=0),
                                 dict(timeout_s=0), dict(temperature=-1.0), dict(max_tokens=True),
                                 dict(max_billed=-1)])
def test_bad_options(bad):
    with pytest.raises(ValueError, match="vlm_judge"):
        _judge(**bad)


def test_missing_api_key_variable(monkeypatch):
    monkeypatch.delenv("FF_NO_SUCH_KEY", raising=False)
    with pytest.raises(ValueError, match="FF_NO_SUCH_KEY"):
        VLMJudge(model="m", base_url=UNREACHABLE, api_key_env="FF_NO_SUCH_KEY")


def test_ledger_hit_is_served_unpermuted_without_sending(tmp_path):
    """A stored answer for the group's key is used as is: presented label j -> candidate perm[j]."""
    judge = _judge(run_dir=tmp_path, frames=1, max_side=16, seed=3)
    media = torch.stack([torch.full((3, 8, 8), v) for v in (0.1, 0.4, 0.7, 0.9)])
    group = judge._prepare(media, ["p"] * 4, [{}] * 4)
    presented = [0.11, 0.22, 0.33, 0.44]
    judge.ledger.record(LedgerEntry(key=group.key, model="m", template_sha256=judge.template.sha256, status="ok",
                                    scores=dict(zip(group.labels, presented, strict=True)), request=group.request,
                                    response=[], prompt_tokens=0, completion_tokens=0, latency_s=0.0, attempts=1))
    out = judge(media, ["p"] * 4, [{}] * 4)
    expected = torch.empty(4)
    expected[torch.tensor(group.perm)] = torch.tensor(presented)
    assert torch.equal(out, expected)
    metrics = judge.pop_metrics()
    assert metrics["served_from_ledger"] == 1 and metrics["requests_sent"] == 0 and math.isnan(metrics["latency_s"])
    # the request kept in the ledger names each frame by hash and file, never base64
    cands = group.request["candidates"]
    assert all(f["path"].endswith(f["sha256"] + ".jpg") for c in cands for f in c)
    assert "base64" not in str(group.request)


def test_a_resumed_step_reuses_its_slot_answer_for_regenerated_media(tmp_path):
    """Bound to a step, a group is found by (stage, purpose, step, condition): media re-generated after a resume --
    other bits, another permutation, another key -- get the recorded answer, through its own permutation."""
    judge = _judge(run_dir=tmp_path, frames=1, max_side=16, seed=3)
    judge.bind(stage="A", purpose="train", step=4, policy_version=8)
    meta = [{"sample_id": "c9"}] * 4
    media = torch.stack([torch.full((3, 8, 8), v) for v in (0.1, 0.4, 0.7, 0.9)])
    group = judge._prepare(media, ["p"] * 4, meta)
    assert group.slot == Slot("A", "train", 4, 8, "c9") and group.request["slot"]["condition"] == "c9"
    presented = [0.11, 0.22, 0.33, 0.44]
    judge.ledger.record(LedgerEntry(key=group.key, model="m", template_sha256=judge.template.sha256, status="ok",
                                    scores=dict(zip(group.labels, presented, strict=True)), request=group.request,
                                    response=[], prompt_tokens=0, completion_tokens=0, latency_s=0.0, attempts=1,
                                    slot=group.slot))
    expected = torch.empty(4)
    expected[torch.tensor(group.perm)] = torch.tensor(presented)
    regenerated = (media + 0.02).clamp(0, 1)
    assert judge._prepare(regenerated, ["p"] * 4, meta).key != group.key
    assert torch.equal(judge(regenerated, ["p"] * 4, meta), expected)
    metrics = judge.pop_metrics()
    assert (metrics["served_from_ledger"], metrics["media_changed"], metrics["requests_sent"]) == (1, 1, 0)
    judge.bind(stage="A", purpose="eval", step=4, policy_version=8)  # another purpose is another slot
    assert judge._prepare(regenerated, ["p"] * 4, meta).slot.purpose == "eval"


def test_the_condition_frame_is_sent_first_and_keyed(tmp_path):
    from PIL import Image

    Image.new("RGB", (8, 8), (10, 200, 30)).save(tmp_path / "first.png")
    judge = _judge(frames=3, max_side=16, reference_root=tmp_path)
    video = torch.rand(2, 3, 5, 8, 8)
    with_condition = judge._prepare(video, ["a", "a"], [{"image": "first.png"}] * 2)
    without = judge._prepare(video, ["a", "a"], [{}, {}])
    assert with_condition.key != without.key and len(with_condition.request["condition"]) == 1
    sent = P.read_group_request(with_condition.content)
    assert len(sent.condition) == 1 and sent.reference == [] and [len(f) for f in sent.candidates.values()] == [3, 3]
    assert "Condition:" in with_condition.request["instructions"] and without.request["condition"] is None


def test_static_example_images_have_their_own_slot_and_key(tmp_path):
    """Example images (``metadata["examples"]``: paths, one image each) are sent after ``Examples:``, kept in the
    ledger's request and part of the key; a group without them keeps the key and body it had before the slot
    existed; a template that never mentions examples is refused for a group that has them."""
    from PIL import Image

    for i, colour in enumerate([(250, 10, 10), (10, 10, 250)]):
        Image.new("RGB", (8, 8), colour).save(tmp_path / f"sprite{i}.png")
    judge = _judge(frames=2, max_side=16, reference_root=tmp_path, template="group_v3")  # a shipped one, by name
    assert judge.template.sha256 == P.JudgeTemplate.load(Path(P.DEFAULT_TEMPLATE).with_name("group_v3.txt")).sha256
    video = torch.rand(2, 3, 4, 8, 8)
    meta = [{"image": "sprite0.png", "examples": ["sprite0.png", "sprite1.png"]}] * 2
    with_examples = judge._prepare(video, ["a", "a"], meta)
    without = judge._prepare(video, ["a", "a"], [{"image": "sprite0.png"}] * 2)
    one_changed = judge._prepare(video, ["a", "a"], [{**meta[0], "examples": ["sprite1.png", "sprite1.png"]}] * 2)
    assert len({with_examples.key, without.key, one_changed.key}) == 3
    sent = P.read_group_request(with_examples.content)
    assert len(sent.examples) == 2 and len(sent.condition) == 1 and sent.examples[0] != sent.examples[1]
    assert [e["sha256"] for e in with_examples.request["examples"]] == [P.sha256_hex(b) for b in sent.examples]
    assert "Examples:" in with_examples.request["instructions"] and "examples" not in without.request
    assert "Examples:" not in without.request["instructions"]
    # group_v2 (the default): a group without examples keeps the key the code before the slot gave it (recorded
    # from that code: a drift would make every recorded group look new and be paid for again)
    old = _judge(frames=2, max_side=16, reference_root=tmp_path)
    fixed = (torch.arange(2 * 3 * 4 * 8 * 8, dtype=torch.float32).view(2, 3, 4, 8, 8) % 17) / 16
    assert old._prepare(fixed, ["a", "a"], [{"image": "sprite0.png"}] * 2).key == \
        "ef53d9022b42ef67959518bbe06a3e32f4d11fb59ed28b1010d3d2880121b0e1"
    assert old._prepare(fixed, ["a", "a"], [{}] * 2).key == \
        "a134000b9021f0c16f1fcde8eaefe0cdbc819e3ac55b7a183240ab82bd1903f9"
    with pytest.raises(ValueError, match="group_v3"):
        old._prepare(video, ["a", "a"], meta)


def test_processor_logs_the_judge_metrics_and_a_malformed_answer_is_nan(tmp_path):
    judge = _judge(run_dir=tmp_path, frames=1, max_side=16)
    media = torch.rand(4, 3, 8, 8)
    group = judge._prepare(media, ["p"] * 4, [{}] * 4)
    judge.ledger.record(LedgerEntry(key=group.key, model="m", template_sha256=judge.template.sha256,
                                    status="malformed", scores=None, request=group.request, response=[],
                                    prompt_tokens=0, completion_tokens=0, latency_s=0.0, attempts=3))
    processor = RewardProcessor({"vlm_judge": judge}, {"vlm_judge": 1.0})  # paid: called only as a weighted component
    components, metrics = processor(media, ["p"] * 4, [{}] * 4, torch.zeros(4, dtype=torch.long))
    assert torch.isnan(components["vlm_judge"]).all()
    assert metrics["reward/vlm_judge_failures"] == 1 and metrics["reward/vlm_judge_served_from_ledger"] == 1
    assert metrics["reward/vlm_judge_requests_sent"] == 0 and metrics["reward/vlm_judge_nan_fraction"] == 1


def test_group_checks_and_reference(tmp_path):
    from PIL import Image

    judge = _judge(frames=2, max_side=16, reference_root=tmp_path)
    with pytest.raises(ValueError, match="one prompt"):
        judge._prepare(torch.rand(2, 3, 8, 8), ["a", "b"], [{}, {}])
    with pytest.raises(ValueError, match=r"\[K, 3, H, W\]"):
        judge._prepare(torch.rand(2, 8, 8), ["a", "a"], [{}, {}])
    Image.new("RGB", (12, 10), (255, 0, 0)).save(tmp_path / "ref.png")
    (tmp_path / "clip").mkdir()
    for i in range(3):
        Image.new("RGB", (12, 10), (0, 80 * i, 0)).save(tmp_path / "clip" / f"{i:03d}.png")
    assert load_reference(tmp_path / "ref.png").shape == (3, 10, 12)
    assert load_reference(tmp_path / "clip").shape == (3, 3, 10, 12)
    with pytest.raises(ValueError, match="does not exist"):
        load_reference(tmp_path / "missing.png")
    video = torch.rand(2, 3, 5, 8, 8)
    with_ref = judge._prepare(video, ["a", "a"], [{"reference": "clip"}, {"reference": "clip"}])
    without = judge._prepare(video, ["a", "a"], [{}, {}])
    assert len(with_ref.request["reference"]) == 2 and without.request["reference"] is None
    assert with_ref.key != without.key
    assert [len(c) for c in with_ref.request["candidates"]] == [2, 2]
    assert sum(p["type"] == "image_url" for p in with_ref.content) == 6
    assert P.read_group_request(with_ref.content).prompt == "a"

