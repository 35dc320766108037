"""The GPU example of a ~9B VLM student (``examples/gpu/wan21_t2v_qwen35_9b_student_stages.yaml``) against the real
architecture: its LoRA targets resolved on transformers' Qwen3.5 at the class's default (9B) sizes, built on the meta
device (no weights), cover every language-model projection -- the linear-attention layers' included -- and nothing
of the vision tower; its template runs non-thinking; its gate and audit thresholds are ones a random student fails
at the group counts its header states."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowforge.orchestrate.config import check_pipeline, load_pipeline
from flowforge.orchestrate.thresholds import threshold_problems
from flowforge.reward_model.config import GATED_DELTA_NET_PROJECTIONS, LANGUAGE_PROJECTIONS
from flowforge.reward_model.null import null_draws, pass_probability, untied_groups
from flowforge.reward_model.vlm_json import resolve_lora_targets, vision_prefixes

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gpu" / "wan21_t2v_qwen35_9b_student_stages.yaml"
STATED_TEST_GROUPS = 40
"""The header's lower bound on the test groups at stages.n_a = 512."""


@pytest.fixture(scope="module")
def pcfg():
    return load_pipeline(EXAMPLE)


def test_the_example_passes_the_portable_check_and_says_what_it_could_not_check(pcfg):
    warnings = check_pipeline(pcfg, this_machine=False)
    assert any("is not on this machine: the budgets and the gate's permutation null" in w for w in warnings)
    with pytest.raises(Exception, match="data.prompts='/data/video/train.jsonl'"):
        check_pipeline(pcfg, this_machine=True)  # on this machine the missing prompt file is an error


def test_lora_targets_cover_qwen35_9b_language_layers_linear_attention_included(pcfg):
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    v = pcfg.student.vlm_json
    assert pcfg.student.kind == "vlm_json" and v.chat_template_kwargs == {"enable_thinking": False}
    assert set(v.lora_targets) == set(LANGUAGE_PROJECTIONS) | set(GATED_DELTA_NET_PROJECTIONS)
    config = Qwen3_5Config()
    with torch.device("meta"):
        vlm = Qwen3_5ForConditionalGeneration(config)
    assert 9e9 < sum(p.numel() for p in vlm.parameters()) < 10e9  # the class's defaults are the 9B model
    targets = resolve_lora_targets(vlm, v.lora_targets)
    assert vision_prefixes(vlm) == ["model.visual"] and not any(t.startswith("model.visual") for t in targets)
    types = config.text_config.layer_types
    assert types.count("linear_attention") == 24 and types.count("full_attention") == 8
    expected = []
    for i, kind in enumerate(types):  # every projection of every decoder layer, in module order
        mixer = [f"linear_attn.{n}" for n in ("out_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")] \
            if kind == "linear_attention" else [f"self_attn.{n}" for n in LANGUAGE_PROJECTIONS[:4]]
        expected += [f"model.language_model.layers.{i}.{n}" for n in mixer + [f"mlp.{n}" for n in
                                                                                LANGUAGE_PROJECTIONS[4:]]]
    assert targets == expected and len(targets) == 248
    default = resolve_lora_targets(vlm, LANGUAGE_PROJECTIONS)  # without the DeltaNet names: its mixing stays frozen
    assert not any(".linear_attn." in t for t in default)


def test_gate_and_audit_thresholds_are_ones_a_random_student_fails(pcfg):
    from flowforge.orchestrate.thresholds import audit_design

    problems, warnings = threshold_problems(pcfg, test_groups=STATED_TEST_GROUPS)
    assert problems == [] and warnings == []  # null p < max_null_pass, and not below the floors
    g, a, k = pcfg.student.gate, pcfg.audit, pcfg.data.group_size
    gate_p = pass_probability(null_draws(untied_groups(k, STATED_TEST_GROUPS), trials=20000, seed=0),
                              g.min_spearman, g.min_pairwise_accuracy)
    audit_p = pass_probability(null_draws(untied_groups(k, pcfg.data.prompts_per_step), trials=20000, seed=0),
                               a.min_spearman, a.min_pairwise_accuracy)
    assert gate_p == 0.0  # the header: no random student of 20,000 passes
    assert audit_p == 0.0  # one verdict of 8 groups of 8 at 0.55 / 0.74
    design = audit_design(pcfg)  # the audit section's comment: before A ran, from the default mark model
    assert design["size"] == 0.0 and design["power"] == pytest.approx(0.832, abs=0.001), design
