"""The ``student`` config section: which student reward model to train on the judged groups, how, and the quality
gate it must pass before it may replace the teacher.

::

    student:
      kind: vlm_json            # or scalar_head
      epochs: 3
      lr: 1.0e-4
      batch_size: 4             # groups per optimizer step
      split: [0.8, 0.1, 0.1]    # train / val / test by condition cluster (flowforge.reward_model.data)
      vlm_json: {base: /models/Qwen2.5-VL-3B-Instruct, lora_rank: 16, lora_alpha: 32, lora_dropout: 0.05,
                 chat_template_kwargs: {enable_thinking: false}}   # e.g. a Qwen3 / Qwen3.5 template, non-thinking
      scalar_head: {image_size: 32, text_encoder: minilm, pairwise_weight: 1.0, regression_weight: 1.0,
                    init: demo:digit-tower}   # pretrained start (flowforge.reward_model.pretrain); default random
      gate: {min_spearman: 0.6, min_pairwise_accuracy: 0.75, max_mae: 0.15, max_null_pass: 0.01}
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from flowforge.runtime.dtypes import DTYPE_NAMES as DTYPES
from flowforge.settings.schema import Checks, Section

KINDS = ("vlm_json", "scalar_head")
LANGUAGE_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Default LoRA targets of ``vlm_json``: the attention and MLP projections of the language model's decoder layers
(module-name suffixes, resolved to exact names under the language model only)."""
GATED_DELTA_NET_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
"""The linear projections of a Qwen3.5 language model's linear-attention (gated DeltaNet) layers, as transformers
names them (``Qwen3_5GatedDeltaNet``): three of every four decoder layers have these in place of ``q/k/v/o_proj``.
A LoRA on such a model lists them beside :data:`LANGUAGE_PROJECTIONS`
(``examples/gpu/wan21_t2v_qwen35_9b_student_stages.yaml``);
the default targets would leave those layers' token mixing frozen."""


@dataclass(frozen=True)
class VLMJsonOptions:
    """``student.vlm_json``: an image-text-to-text VLM fine-tuned with LoRA to answer the teacher's JSON."""

    base: str = ""  # local Hugging Face model directory (AutoModelForImageTextToText + AutoProcessor)
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.05
    lora_targets: tuple[str, ...] = LANGUAGE_PROJECTIONS
    dtype: str = "float32"  # weights of the frozen base; LoRA weights train in float32
    score_decimals: int = 0  # decimals of the 0-100 scores in the answer
    max_new_tokens: int = 128  # generation cap when the student answers
    # extra arguments of the processor's chat template, for training and serving alike: {enable_thinking: false}
    # puts a Qwen3 / Qwen3.5 template in its non-thinking mode (the answer follows an empty think block)
    chat_template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    # answer a judge request by guided decoding: only tokens that keep the reply a prefix of the strict answer
    # {"A":<0-100>,...} for the request's labels (vLLM's guided_json / OpenAI structured outputs do the same); the
    # gate, audits and stage C then read the student's ranking, never a malformed reply. false: free generation
    guided: bool = True


@dataclass(frozen=True)
class ScalarHeadOptions:
    """``student.scalar_head``: a small CNN + prompt embedding -> one score per candidate image."""

    image_size: int = 32  # frames are resized to image_size x image_size
    channels: tuple[int, ...] = (16, 32, 64)  # conv stages (stride 2 each)
    hidden: int = 64
    text_encoder: str = "minilm"  # "minilm" | "none" | "pkg.module:function" (prompts -> [B, E] float tensor)
    pairwise_weight: float = 1.0  # Bradley-Terry term
    regression_weight: float = 1.0  # squared error to the teacher score
    tie_margin: float = 0.0  # teacher pairs closer than this are not compared
    # training-time random affine of each frame, for a teacher whose marks do not change under small distortions
    # (0 = off): rotation up to +-augment_rotate degrees, scale by 1 +- augment_scale, shift up to +-augment_shift of
    # the side; never at inference
    augment_rotate: float = 0.0
    augment_scale: float = 0.0
    augment_shift: float = 0.0
    init: str = ""  # pretrained weights (.safetensors of the net's tensors, or demo:digit-tower); "": random init
    # > 0: a candidate is one clip of exactly clip_frames frames, stacked in order along the channels (3 x clip_frames
    # input channels), so the net sees the motion and its order; 0: each frame scored alone, the scores averaged
    clip_frames: int = 0
    # with clip_frames > 0: the net also sees the group's reference clip (the real future the teacher compares with,
    # e.g. world-stages' `reference`): its input is [candidate clip, (candidate clip - reference clip)^2] (6 x clip_frames
    # channels); the saved scorer then needs metadata["reference_media"], which `flowforge serve judge` requests carry
    reference: bool = False


@dataclass(frozen=True)
class GateThresholds:
    """``student.gate``: agreement with the teacher the student must reach on the **test** split
    (:func:`flowforge.reward_model.gate.gate_on_test`); the thresholds must be ones a random student fails
    (``max_null_pass``, :mod:`flowforge.reward_model.null`)."""

    min_spearman: float = 0.5  # mean within-group Spearman vs the teacher
    min_pairwise_accuracy: float = 0.7  # fraction of teacher-ordered pairs the student orders the same way
    max_mae: float = 0.25  # mean |student - teacher| on [0, 1]
    # true: the student's test MAE must also be below a constant predictor's, the training split's median mark on
    # every candidate (flowforge.reward_model.baselines.constant_mark), so a fixed max_mae cannot pass a constant
    mae_below_constant: bool = False
    max_failure_rate: float = 0.05  # groups the student could not score (unparseable answers)
    min_groups: int = 1  # test groups needed to judge at all
    max_null_pass: float = 0.01  # a random student may pass these thresholds on the test groups with p < this (1: off)
    null_trials: int = 2000  # random students drawn for that probability (flowforge.reward_model.null)
    fail_on_shortcuts: bool = True  # a student that does not beat its shortcut probes fails (false: reported only)
    # teacher marks this close are a tie in every agreement measure (epoch selection on val, gate, probes, null):
    # the teacher's own retest noise (flowforge.reward_model.evaluate.tie_blocks); 0: exact ties only
    tie_margin: float = 0.0
    # reward scorers without a teacher (registry names or pkg.module:Factory, e.g. action_idm) whose agreement with
    # the teacher on the test groups is recorded beside the student's, with its initialisation's and a constant's
    # (flowforge.reward_model.baselines)
    baselines: tuple[str, ...] = ()
    # a number in [0, 1]: the student's test Spearman must also reach each baseline's (its initialisation's, every
    # scorer's of `baselines`; the constant's is 0) plus this -- a student no better than what a user has without a
    # teacher fails (flowforge.reward_model.baselines.baseline_reasons); null: the baselines are recorded only
    min_spearman_above_baselines: float | None = None


@dataclass(frozen=True)
class StudentConfig(Section):
    section_name = "student"

    kind: str = "scalar_head"
    seed: int = 0
    epochs: int = 5
    lr: float = 1e-3
    weight_decay: float = 0.0
    batch_size: int = 8  # groups per optimizer step
    grad_clip: float = 1.0  # max grad norm; 0 = off
    device: str = "cpu"
    split_seed: int = 0
    split: tuple[float, float, float] = (0.8, 0.1, 0.1)
    keep_checkpoints: int = 2  # epoch checkpoints kept
    vlm_json: VLMJsonOptions = dataclasses.field(default_factory=VLMJsonOptions)
    scalar_head: ScalarHeadOptions = dataclasses.field(default_factory=ScalarHeadOptions)
    gate: GateThresholds = dataclasses.field(default_factory=GateThresholds)

    def problems(self) -> list[str]:
        c = Checks(self)
        c.choice("kind", KINDS)
        c.positive("epochs", "lr", "batch_size", "keep_checkpoints")
        c.positive("weight_decay", "grad_clip", allow_zero=True)
        c.require(len(self.split) == 3 and min(self.split) >= 0 and abs(sum(self.split) - 1) < 1e-9,
                  f"student.split={self.split} must be three numbers >= 0 summing to 1")
        v, s = self.vlm_json, self.scalar_head
        if self.kind == "vlm_json":
            c.require(bool(v.base), "student.vlm_json.base must name a local image-text-to-text model directory")
        c.require(v.lora_rank >= 1 and v.lora_alpha > 0, f"student.vlm_json.lora_rank={v.lora_rank} must be >= 1 "
                                                         f"and lora_alpha={v.lora_alpha} > 0")
        c.require(0 <= v.lora_dropout < 1, f"student.vlm_json.lora_dropout={v.lora_dropout} must be in [0, 1)")
        c.require(len(v.lora_targets) > 0, "student.vlm_json.lora_targets must name at least one module")
        c.require(v.dtype in DTYPES, f"student.vlm_json.dtype={v.dtype!r} is not one of {list(DTYPES)}")
        c.require(not ({"tokenize", "add_generation_prompt", "messages", "conversation"} & set(v.chat_template_kwargs)),
                  f"student.vlm_json.chat_template_kwargs={dict(v.chat_template_kwargs)} may not set tokenize, "
                  "add_generation_prompt, messages or conversation (the student sets them)")
        c.require(0 <= v.score_decimals <= 3 and v.max_new_tokens >= 1,
                  "student.vlm_json.score_decimals must be in [0, 3] and max_new_tokens >= 1")
        c.require(s.image_size >= 8 and len(s.channels) >= 1 and min(s.channels) >= 1 and s.hidden >= 1,
                  "student.scalar_head needs image_size >= 8, at least one channel count >= 1 and hidden >= 1")
        c.require(s.text_encoder in ("minilm", "none") or ":" in s.text_encoder,
                  f"student.scalar_head.text_encoder={s.text_encoder!r} is not 'minilm', 'none' or "
                  "'pkg.module:function'")
        c.require(s.pairwise_weight >= 0 and s.regression_weight >= 0 and s.pairwise_weight + s.regression_weight > 0,
                  "student.scalar_head.pairwise_weight and regression_weight must be >= 0, not both 0")
        c.require(s.tie_margin >= 0, f"student.scalar_head.tie_margin={s.tie_margin} must be >= 0")
        c.require(s.clip_frames >= 0, f"student.scalar_head.clip_frames={s.clip_frames} must be >= 0 (0: per frame)")
        c.require(not s.reference or s.clip_frames > 0,
                  "student.scalar_head.reference=true needs clip_frames > 0 (the reference is compared clip to clip)")
        c.require(not s.reference or not (s.augment_rotate or s.augment_scale or s.augment_shift),
                  "student.scalar_head.reference=true takes no augment_* (a distorted candidate no longer lines up "
                  "with its reference)")
        c.require(0 <= s.augment_rotate <= 180 and 0 <= s.augment_scale < 1 and 0 <= s.augment_shift <= 0.5,
                  f"student.scalar_head.augment_rotate={s.augment_rotate} / augment_scale={s.augment_scale} / "
                  f"augment_shift={s.augment_shift} must be in [0, 180] / [0, 1) / [0, 0.5]")
        g = self.gate
        if g.baselines:
            from flowforge.rewards.registry import check_scorer_spec

            c.problems += [f"student.gate.baselines: {p}" for name in g.baselines for p in check_scorer_spec(name, {})]
        c.require(g.min_groups >= 1 and 0 <= g.max_failure_rate <= 1 and g.max_mae >= 0,
                  "student.gate needs min_groups >= 1, max_failure_rate in [0, 1] and max_mae >= 0")
        c.require(0 <= g.tie_margin < 1, f"student.gate.tie_margin={g.tie_margin} must be in [0, 1)")
        c.require(g.min_spearman_above_baselines is None or 0 <= g.min_spearman_above_baselines <= 1,
                  f"student.gate.min_spearman_above_baselines={g.min_spearman_above_baselines} must be null or in "
                  "[0, 1] (the constant's Spearman is 0, a student's at most 1)")
        c.require(0 < g.max_null_pass <= 1 and g.null_trials >= 100,
                  f"student.gate.max_null_pass={g.max_null_pass} must be in (0, 1] and null_trials={g.null_trials} "
                  ">= 100")
        return c.problems


def student_config(data: StudentConfig | dict | None = None) -> StudentConfig:
    """A :class:`StudentConfig` from itself, a mapping (YAML's ``student:`` section) or None (the defaults).

    Raises:
        flowforge.settings.schema.ConfigError: unknown keys (the allowed ones listed), wrong types, bad values.
    """
    from flowforge.settings.schema import build

    if isinstance(data, StudentConfig):
        return data
    return build(StudentConfig, dict(data or {}))
