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


def test_sft_overfits_saves_reloads_and_serves(base, judged, tmp_path, monkeypatch):
    import openai

    _, groups = judged
    student = _student(base)
    losses = support.overfit(student, groups[:1])
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


THINK_BLOCK = "<think>\n\n</think>\n\n"


def test_chat_template_kwargs_train_and_serve_the_non_thinking_template(judged, tmp_path):
    """A Qwen3-style template (:data:`support.THINKING_CHAT_TEMPLATE`): with ``enable_thinking: false`` every prompt
    the student renders -- training, generation, the saved student a server loads -- ends in the empty think block,
    the answer + end of turn follow it, and a student overfit that way answers in the judge's format after it."""
    _, groups = judged
    base = support.save_tiny_json_qwen2_vl(tmp_path / "thinking-base", support.THINKING_CHAT_TEMPLATE)
    thinking = _student(base)  # template default: thinking mode, the generation prompt stops at "assistant\n"
    plain = _student(base, chat_template_kwargs={"enable_thinking": False})
    block = plain.tokenizer(THINK_BLOCK, add_special_tokens=False)["input_ids"]
    message = group_message(groups[0])
    with_block = plain.encode_prompt(message)["input_ids"][0].tolist()
    without = thinking.encode_prompt(message)["input_ids"][0].tolist()
    assert with_block == without + block  # the kwargs reached the template
    # the end of turn is read after the answer, whichever way the template writes a past answer's think block
    assert plain.meta["end_of_turn"] == thinking.meta["end_of_turn"] == "<|im_end|>\n"
    example = plain.build_example(groups[0])
    assert example.sequence()[:example.prefix_len].tolist() == with_block
    assert plain.tokenizer.decode(example.target_ids) == score_answer(groups[0]) + "<|im_end|>"

    losses = support.overfit(plain, groups[:1], steps=120)
    text, prompt_tokens, _ = plain.reply(message)
    assert losses[-1] < 0.05 * losses[0], (losses[-1], text)
    assert prompt_tokens == len(with_block)
    assert P.parse_scores(text, groups[0].labels) == P.parse_scores(score_answer(groups[0]), groups[0].labels)
    plain.save(tmp_path / "student")
    again = load_student(tmp_path / "student")  # what `serve judge --student` loads: the same kwargs, same prompt
    assert again.meta["options"]["chat_template_kwargs"] == {"enable_thinking": False}
    assert again.encode_prompt(message)["input_ids"][0].tolist() == with_block
    assert again.reply(message)[0] == text


def test_lora_reaches_the_linear_attention_layers_of_a_qwen35_language_model():
    """A tiny random Qwen3.5 (3 gated-DeltaNet layers + 1 full-attention layer): with
    :data:`GATED_DELTA_NET_PROJECTIONS` beside the default targets, LoRA lands on every projection of every
    language layer and nothing of the vision tower, and the answer loss's gradient reaches each LoRA, the
    linear-attention ones included."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from flowforge.reward_model.config import GATED_DELTA_NET_PROJECTIONS

    torch.manual_seed(0)
    config = Qwen3_5Config(
        text_config=dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, linear_key_head_dim=4,
                         linear_value_head_dim=4, linear_num_key_heads=2, linear_num_value_heads=2),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4,
                           spatial_merge_size=1, temporal_patch_size=1, out_hidden_size=16))
    vlm = Qwen3_5ForConditionalGeneration(config)
    assert config.text_config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    with pytest.raises(ValueError, match="match no linear layer of the language model"):
        resolve_lora_targets(vlm, ["in_proj_qkvz"])  # Qwen3-Next's fused name is not Qwen3.5's
    targets = resolve_lora_targets(vlm, LANGUAGE_PROJECTIONS + GATED_DELTA_NET_PROJECTIONS)
    assert len(targets) == 3 * (5 + 3) + (4 + 3) and not any(".visual." in t for t in targets)
    assert {t.rsplit(".", 1)[-1] for t in targets if ".layers.0." in t} == set(GATED_DELTA_NET_PROJECTIONS) | set(
        LANGUAGE_PROJECTIONS[4:])
    model = get_peft_model(vlm, LoraConfig(r=2, lora_alpha=4, target_modules=targets))
    ids = torch.randint(0, 60, (1, 12))
    hidden = model.get_base_model().model(input_ids=ids, use_cache=False).last_hidden_state  # [1, 12, 16]
    logits = model.get_base_model().lm_head(hidden[:, -4:])  # the answer suffix only, as the student's loss
    torch.nn.functional.cross_entropy(logits[0], ids[0, -4:]).backward()
    lora_b = {n: p.grad for n, p in model.named_parameters() if p.requires_grad and "lora_B" in n}
    assert len(lora_b) == len(targets) and all(g is not None and g.abs().sum() > 0 for g in lora_b.values())
    assert all(not p.requires_grad for n, p in model.named_parameters() if ".visual." in n)


def test_guided_decoding_answers_every_group_with_a_strict_reply(base, judged):
    """An untrained student (random LoRA-free tiny VLM) answers by guided decoding: every reply matches the strict
    answer for the group's own labels and parses; unguided, the same model writes no such reply."""
    from flowforge.reward_model.vlm_json import answer_pattern
    from flowforge.rewards.judge.protocol import parse_scores

    _, groups = judged
    guided, free = _student(base), _student(base, guided=False)
    for group in groups:
        text, _, _ = guided.reply(group_message(group))
        assert answer_pattern(group.labels, 0).fullmatch(text), text
        assert len(parse_scores(text, group.labels)) == len(group.labels)
        loose, _, _ = free.reply(group_message(group))
        assert not answer_pattern(group.labels, 0).fullmatch(loose), loose  # the guidance is what makes it parse
    with pytest.raises(P.MalformedReply):
        parse_scores('{"A":10,"B":1110}', ["A", "B"])
    assert not answer_pattern(["A", "B"], 0).fullmatch('{"A":10,"B":1110}')
    assert answer_pattern(["A", "B"], 1).fullmatch('{"A":10.5,"B":100.0}')
    assert not answer_pattern(["A", "B"], 1).fullmatch('{"A":100.5,"B":1}')
