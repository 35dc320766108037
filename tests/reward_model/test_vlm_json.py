"""The ``vlm_json`` student on a tiny random Qwen2-VL: LoRA on the language model only, the answer-only loss with
logits for the answer suffix only, an overfit, save / reload with identical logits, and the student behind the real
``flowforge serve judge --student`` server answering the openai client and the ``vlm_judge`` scorer."""

from __future__ import annotations

import pytest
import torch

from flowforge.reward_model.config import LANGUAGE_PROJECTIONS, VLMJsonOptions, student_config
from flowforge.reward_model.data import group_message, read_judged_groups, score_answer
from flowforge.reward_model.students import create_student, load_student
from flowforge.reward_model.vlm_json import VLMJsonStudent, resolve_lora_targets
from flowforge.rewards.judge import protocol as P
from flowforge.rewards.judge.client import VLMJudge
from tests.reward_model import support
from tests.serve import judge_support as S

TOKEN = "student-test-token"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    torch.set_num_threads(1)
    return support.save_tiny_json_qwen2_vl(tmp_path_factory.mktemp("tiny-json-qwen2-vl"))


@pytest.fixture(scope="module")
def judged(tmp_path_factory):
    """``(run dir, groups)``: three brightness groups judged by the teacher through the real ``vlm_judge``."""
    run = tmp_path_factory.mktemp("stage-a")
    return run, read_judged_groups(support.judged_ledger(run, 3))


def _student(base, **options) -> VLMJsonStudent:
    options = {"base": str(base), "lora_rank": 8, "lora_alpha": 16.0, "lora_dropout": 0.0, **options}
    return create_student(student_config({"kind": "vlm_json", "vlm_json": options}))


def test_lora_goes_on_the_language_projections_only(base):
    student = _student(base, lora_dropout=0.1)
    targets = student.meta["targets"]
    assert targets == [f"model.language_model.layers.0.{part}.{name}" for part, name in
                       [("self_attn", n) for n in LANGUAGE_PROJECTIONS[:4]] + [("mlp", n) for n in
                                                                               LANGUAGE_PROJECTIONS[4:]]]
    assert student.meta["vision"] == ["model.visual"]
    trainable = [n for n, p in student.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n and ".language_model." in n for n in trainable)
    assert all(not p.requires_grad for n, p in student.model.named_parameters() if ".visual." in n)
    lora = student.vlm.get_submodule(targets[0])
    assert lora.lora_dropout["default"].p == 0.1  # dropout as configured
    student.train()
    assert lora.training and not student.vlm.get_submodule("model.visual").training  # vision tower frozen, eval
    with pytest.raises(ValueError, match="match no linear layer of the language model"):
        resolve_lora_targets(student.vlm, ["q_proj", "qkv"])  # qkv is the vision tower's, not the LM's


def test_targets_skip_a_vision_tower_with_the_same_projection_names():
    from tests.models.tiny_families import qwen_components

    vlm = qwen_components(edit=True)["text_encoder"]  # Qwen2.5-VL: its vision MLP also has gate/up/down_proj
    vision_mlp = [n for n, _ in vlm.named_modules() if n.startswith("model.visual") and n.endswith("up_proj")]
    assert vision_mlp
    targets = resolve_lora_targets(vlm, LANGUAGE_PROJECTIONS)
    assert len(targets) == 7 and all(t.startswith("model.language_model.") for t in targets)


def test_the_loss_mask_covers_only_the_answer_and_the_head_sees_only_the_suffix(base, judged):
    _, groups = judged
    student = _student(base)
    example = student.build_example(groups[0])
    labels, seq = example.labels(), example.sequence()
    p, t = example.prefix_len, example.target_ids.numel()
    assert example.inputs["input_ids"].shape == (1, p + t - 1) and seq.shape == labels.shape == (p + t,)
    assert (labels[:p] == -100).all() and (labels[p:] != -100).all()
    assert student.tokenizer.decode(labels[p:]) == score_answer(groups[0]) + "<|im_end|>"
    image_id = student.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert (seq[:p] == image_id).sum() == 4 * 16 and not (seq[p:] == image_id).any()  # 4 16x16 frames, patch 4
    seen = []
    hook = student.lm_head.register_forward_hook(lambda mod, args, out: seen.append(tuple(args[0].shape)))
    student.backward(groups[:1])
    hook.remove()
    assert seen == [(1, t, 16)] and t < p / 5  # the head never saw the prompt / image positions
    with torch.no_grad():  # the suffix logits are the full forward's logits at the answer positions
        full = student.model(**example.inputs).logits[0, p - 1:].float()
        torch.testing.assert_close(student.answer_logits(example), full)


def _overfit(student: VLMJsonStudent, groups, steps: int = 60, lr: float = 0.02) -> list[float]:
    optimizer = torch.optim.AdamW(student.trainable_parameters(), lr=lr, weight_decay=0.0)
    torch.manual_seed(0)
    losses = []
    for _ in range(steps):
        student.train()
        optimizer.zero_grad()
        losses.append(student.backward(groups)["loss"])
        torch.nn.utils.clip_grad_norm_(student.trainable_parameters(), 1.0)
        optimizer.step()
    student.eval()
    return losses


def test_sft_overfits_saves_reloads_and_serves(base, judged, tmp_path, monkeypatch):
    import openai

    _, groups = judged
    student = _student(base)
    losses = _overfit(student, groups[:1])
    assert losses[-1] < 0.2 * losses[0]
    expected = P.parse_scores(score_answer(groups[0]), groups[0].labels)
    text, _, _ = student.reply(group_message(groups[0]))
    assert P.parse_scores(text, groups[0].labels) == expected  # the strict judge parser reads the student
    assert torch.equal(student.predict(groups[:1])[0], torch.tensor(expected, dtype=torch.float32))

    student.save(tmp_path / "student")
    assert sorted(p.name for p in (tmp_path / "student").iterdir()) == ["adapter", "meta.json", "processor"]
    again = load_student(tmp_path / "student")
    example = student.build_example(groups[0])
    with torch.no_grad():
        assert torch.equal(again.answer_logits(example), student.answer_logits(example))

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    log = tmp_path / "requests.log"
    proc, url = S.start(["-m", "flowforge.cli", "serve", "judge", "--student", str(tmp_path / "student"), "--port",
                         "0", "--token-file", str(token_file), "--num-threads", "1", "--request-log", str(log)])
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key=TOKEN, max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["student"]
        reply = client.chat.completions.create(model="student", messages=group_message(groups[0]), max_tokens=64,
                                               temperature=0, seed=0)
        assert reply.choices[0].message.content == text and reply.usage.completion_tokens >= 1
        # the teacher's client, pointed at the student: same media -> same message -> the teacher's scores
        monkeypatch.setenv("FF_TEST_STUDENT_TOKEN", TOKEN)
        student_judge = VLMJudge(model="student", base_url=url + "/v1", api_key_env="FF_TEST_STUDENT_TOKEN",
                                 frames=1, max_side=16, max_concurrency=1, seed=0, ledger=tmp_path / "c.sqlite")
        media, _, _ = S.group(2000, k=4, size=16)
        scores = student_judge(media, ["prompt 0"] * 4, [{"sample_id": "cond-0"}] * 4)
        teacher_order = [0.0] * 4
        for position, candidate in enumerate(groups[0].permutation):
            teacher_order[candidate] = expected[position]
        assert scores.tolist() == pytest.approx(teacher_order)
        assert len(log.read_text().split()) == 2
    finally:
        S.stop(proc)


def test_train_student_trains_and_saves_a_vlm_json_student(base, judged, tmp_path):
    from flowforge.reward_model.train import train_student

    _, groups = judged
    cfg = {"kind": "vlm_json", "epochs": 2, "lr": 0.02, "batch_size": 2, "split": [1.0, 0.0, 0.0],
           "vlm_json": {"base": str(base), "lora_rank": 4, "lora_alpha": 8.0, "lora_dropout": 0.1}}
    result = train_student(cfg, groups, tmp_path / "b")
    assert result.split_sizes == {"train": 3, "val": 0, "test": 0} and len(result.history) == 2
    assert result.history[1]["train"]["loss"] < result.history[0]["train"]["loss"]
    assert sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    assert isinstance(load_student(result.student_dir), VLMJsonStudent)


def test_options_are_checked():
    from flowforge.settings.schema import ConfigError

    with pytest.raises(ConfigError, match="vlm_json.base"):
        student_config({"kind": "vlm_json"})
    with pytest.raises(ConfigError, match="lora_dropout"):
        student_config({"kind": "vlm_json", "vlm_json": {"base": "x", "lora_dropout": 1.5}})
    assert VLMJsonOptions().lora_targets == LANGUAGE_PROJECTIONS
