"""Prompt JSONL schema validation and the K-repeat sampler (determinism, ranks, uniqueness, epochs, resume)."""

import json

import pytest
import torch

from flowforge.data.prompts import KRepeatSampler, PromptRecord, load_prompts, resolve_prompt_path


def _write(tmp_path, rows, name="p.jsonl"):
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _row(i, task="t2i", **extra):
    return {"prompt": f"prompt {i}", "metadata": {"task": task, "sample_id": f"id{i}", **extra}}


def test_load_prompts_reads_records_in_order(tmp_path):
    from PIL import Image

    Image.new("RGB", (4, 4)).save(tmp_path / "frame.png")  # checked to exist and to be a readable image
    path = _write(tmp_path, [_row(0, digit=3), "", _row(1, task="i2v", image="frame.png")])
    records = load_prompts(path)
    assert records == [
        PromptRecord("prompt 0", {"task": "t2i", "sample_id": "id0", "digit": 3}),
        PromptRecord("prompt 1", {"task": "i2v", "sample_id": "id1", "image": str(tmp_path / "frame.png")}),
    ]
    assert records[1].task == "i2v" and records[0].sample_id == "id0"
    assert records[0].to_dict() == _row(0, digit=3)
    with pytest.raises(AttributeError):
        records[0].prompt = "changed"


@pytest.mark.parametrize(
    "bad_row, line, field",
    [
        ({"metadata": {"task": "t2i", "sample_id": "x"}}, 2, "'prompt'"),
        ({"prompt": "   ", "metadata": {"task": "t2i", "sample_id": "x"}}, 2, "'prompt'"),
        ({"prompt": "a", "metadata": {"task": "t2x", "sample_id": "x"}}, 2, "'metadata.task'.*t2i.*i2i.*t2v.*i2v"),
        ({"prompt": "a", "metadata": {"task": "t2i"}}, 2, "'metadata.sample_id'"),
        ({"prompt": "a", "metadata": "t2i"}, 2, "'metadata'"),
        ({"text": "a"}, 2, "'prompt'.*flowforge data prepare"),  # a peer row (no metadata) still needs its prompt
        ({"prompt": "a", "metadata": {"task": "t2i", "sample_id": "y"}, "extra": 1}, 2, "'extra'"),
        ({"prompt": "a", "metadata": {"task": "t2i", "sample_id": "id0"}}, 2, "'metadata.sample_id'.*line 1"),
        ("{not json", 2, "not valid JSON"),
        ("[1, 2]", 2, "JSON object"),
    ],
)
def test_load_prompts_errors_name_file_line_and_field(tmp_path, bad_row, line, field):
    path = _write(tmp_path, [_row(0), bad_row])
    with pytest.raises(ValueError, match=rf"p\.jsonl:{line}: .*{field}"):
        load_prompts(path)


def test_load_prompts_missing_and_empty_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_prompts(tmp_path / "absent.jsonl")
    with pytest.raises(ValueError, match="no prompt rows"):
        load_prompts(_write(tmp_path, [""]))


def test_demo_resolver():
    assert resolve_prompt_path("demo:train").name == "train.jsonl"
    assert resolve_prompt_path("demo:eval").is_file()
    assert len(load_prompts("demo:eval")) == 60
    with pytest.raises(ValueError, match="demo:train.*demo:eval"):
        resolve_prompt_path("demo:test")


def _draw(sampler, steps):
    return [sampler.next_batch() for _ in range(steps)]


def test_batch_layout_group_major():
    batch = KRepeatSampler(10, prompts_per_step=3, group_size=4, seed=5).next_batch()
    assert batch.prompt_indices.shape == (3,) and batch.prompt_indices.dtype == torch.int64
    assert len(set(batch.prompt_indices.tolist())) == 3
    assert batch.group_ids.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert batch.candidate_prompt_indices.tolist() == [p for p in batch.prompt_indices.tolist() for _ in range(4)]
    assert batch.candidate_ids.shape == (12,) and batch.candidate_ids.dtype == torch.int64
    assert bool((batch.candidate_ids >= 0).all())
    assert batch.rank_slice == slice(0, 12)


def test_deterministic_and_seed_dependent():
    a = _draw(KRepeatSampler(50, 4, 3, seed=7), 20)
    b = _draw(KRepeatSampler(50, 4, 3, seed=7), 20)
    c = _draw(KRepeatSampler(50, 4, 3, seed=8), 20)
    for x, y in zip(a, b):
        assert torch.equal(x.prompt_indices, y.prompt_indices) and torch.equal(x.candidate_ids, y.candidate_ids)
    assert any(not torch.equal(x.prompt_indices, z.prompt_indices) for x, z in zip(a, c))
    ids_a = set(torch.cat([x.candidate_ids for x in a]).tolist())
    assert not ids_a & set(torch.cat([z.candidate_ids for z in c]).tolist())


def test_two_ranks_agree_and_split_candidates_evenly():
    ranks = [KRepeatSampler(30, 4, 6, seed=1, num_replicas=2, rank=r) for r in range(2)]
    for _ in range(12):
        b0, b1 = ranks[0].next_batch(), ranks[1].next_batch()
        assert torch.equal(b0.prompt_indices, b1.prompt_indices)
        assert torch.equal(b0.candidate_ids, b1.candidate_ids)
        assert b0.rank_slice == slice(0, 12) and b1.rank_slice == slice(12, 24)
        owned = torch.cat([b0.local_candidate_ids, b1.local_candidate_ids])
        assert torch.equal(owned, b0.candidate_ids)
        assert b1.local_group_ids.tolist() == [2] * 6 + [3] * 6
        assert torch.equal(b1.local_prompt_indices, b1.prompt_indices[[2] * 6 + [3] * 6])


def test_candidate_ids_unique_within_and_across_steps_and_epochs():
    sampler = KRepeatSampler(7, 3, 5, seed=0)
    batches = _draw(sampler, 40)
    ids = torch.cat([b.candidate_ids for b in batches]).tolist()
    assert len(ids) == len(set(ids)) == 40 * 15
    assert {b.epoch for b in batches} == set(range(20))


def test_epoch_rollover_skips_tail_and_reshuffles():
    sampler = KRepeatSampler(10, 3, 2, seed=3)
    assert sampler.steps_per_epoch == 3
    batches = _draw(sampler, 9)
    assert [b.epoch for b in batches] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [b.step for b in batches] == list(range(9))
    orders = []
    for epoch in range(3):
        seen = torch.cat([b.prompt_indices for b in batches[3 * epoch : 3 * epoch + 3]]).tolist()
        assert len(set(seen)) == 9  # no repeats inside an epoch, one prompt skipped
        orders.append(seen)
    assert orders[0] != orders[1] != orders[2]


def test_every_prompt_is_visited_within_an_epoch_when_m_divides_n():
    batches = _draw(KRepeatSampler(12, 4, 1, seed=9), 3)
    assert sorted(torch.cat([b.prompt_indices for b in batches]).tolist()) == list(range(12))


def test_resume_continues_exactly():
    reference = _draw(KRepeatSampler(11, 4, 2, seed=4, num_replicas=2, rank=1), 10)
    first = KRepeatSampler(11, 4, 2, seed=4, num_replicas=2, rank=1)
    _draw(first, 6)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = KRepeatSampler(11, 4, 2, seed=4, num_replicas=2, rank=1)
    resumed.load_state_dict(state)
    for expected, got in zip(reference[6:], _draw(resumed, 4)):
        assert got.step == expected.step and got.epoch == expected.epoch
        assert torch.equal(got.prompt_indices, expected.prompt_indices)
        assert torch.equal(got.candidate_ids, expected.candidate_ids)
        assert got.rank_slice == expected.rank_slice


def test_load_state_dict_rejects_other_configuration():
    state = KRepeatSampler(11, 4, 2, seed=4).state_dict()
    with pytest.raises(ValueError, match="seed"):
        KRepeatSampler(11, 4, 2, seed=5).load_state_dict(state)
    with pytest.raises(ValueError, match="num_prompts"):
        KRepeatSampler(12, 4, 2, seed=4).load_state_dict(state)
    with pytest.raises(ValueError, match="missing keys.*cursor"):
        KRepeatSampler(11, 4, 2, seed=4).load_state_dict({k: v for k, v in state.items() if k != "cursor"})


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_prompts=0, prompts_per_step=1, group_size=1, seed=0), "num_prompts"),
        (dict(num_prompts=3, prompts_per_step=4, group_size=1, seed=0), "prompts_per_step"),
        (dict(num_prompts=3, prompts_per_step=1, group_size=0, seed=0), "group_size"),
        (dict(num_prompts=3, prompts_per_step=1, group_size=1, seed=-1), "seed"),
        (dict(num_prompts=9, prompts_per_step=3, group_size=3, seed=0, num_replicas=2), "divisible by num_replicas"),
        (dict(num_prompts=9, prompts_per_step=2, group_size=2, seed=0, num_replicas=2, rank=2), "rank"),
    ],
)
def test_sampler_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KRepeatSampler(**kwargs)
