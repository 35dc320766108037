"""The pretrained ``scalar_head`` start (``student.scalar_head.init``): the shipped ``demo:digit-tower`` file loads
into the demo's student (channels 32/64/128, hidden 128) and already matches real held-out digits to their
prompts; a file that does not fit the configured network is refused in one line; the pretraining phrasings are none
of the demo's prompts."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from flowforge.data.clusters import normalise_text
from flowforge.demo import data
from flowforge.demo.paths import resolve_demo_path
from flowforge.demo.prompts import EVAL_TEMPLATES, TRAIN_TEMPLATES, render
from flowforge.reward_model.config import ScalarHeadOptions, student_config
from flowforge.reward_model.pretrain import prompt_table
from flowforge.reward_model.scalar_head import ScalarHeadStudent


def test_pretraining_phrasings_are_none_of_the_demo_prompts():
    demo = {normalise_text(render(t, d)) for t in (*TRAIN_TEMPLATES, *EVAL_TEMPLATES) for d in range(10)}
    pretraining = {normalise_text(p) for row in prompt_table() for p in row}
    assert len(pretraining) == 10 * len(prompt_table()) and not pretraining & demo


def test_the_shipped_init_loads_and_matches_held_out_digits_to_their_prompts():
    """Before any teacher mark, the pretrained student scores a real digit (``eval_clf``: never seen in
    pretraining) higher for a prompt naming its digit than for one naming another digit, for most images; a
    randomly initialised student does not."""
    images, labels = data.load_split("eval_clf")
    images, labels = images[::5], labels[::5]  # 200 digits, 20 per class
    media = images.expand(-1, 3, -1, -1)
    right = [f"the digit {int(d)}" for d in labels]
    wrong = [f"the digit {(int(d) + 1 + i % 9) % 10}" for i, d in enumerate(labels)]

    def margin_wins(student):
        return float((student.score_images(media, right) > student.score_images(media, wrong)).float().mean())

    options = student_config({"scalar_head": {"init": "demo:digit-tower", "channels": [32, 64, 128],
                                              "hidden": 128}}).scalar_head  # the shape the file was trained in
    pretrained = ScalarHeadStudent(options)
    assert margin_wins(pretrained) > 0.85
    assert margin_wins(ScalarHeadStudent(ScalarHeadOptions())) < 0.75
    loaded = pretrained.load_init("demo:digit-tower")
    assert loaded == sorted(pretrained.net.state_dict())  # the shipped file holds the whole network


def test_a_file_that_does_not_fit_is_refused(tmp_path):
    small = ScalarHeadOptions(channels=(8, 16), hidden=16, text_encoder="none")
    with pytest.raises(ValueError, match=r"do not fit this scalar_head \(channels=\[8, 16\], hidden=16\)"):
        ScalarHeadStudent(ScalarHeadOptions(channels=(8, 16), hidden=16, init="demo:digit-tower"))
    with pytest.raises(ValueError, match="trained with text_encoder='minilm', not 'none'"):
        ScalarHeadStudent(ScalarHeadOptions(init="demo:digit-tower", text_encoder="none"))
    with pytest.raises(FileNotFoundError, match="student.scalar_head.init: no file"):
        ScalarHeadStudent(ScalarHeadOptions(init=str(tmp_path / "missing.safetensors"), text_encoder="none"))
    partial = tmp_path / "tower.safetensors"
    donor = ScalarHeadStudent(small, seed=5)
    save_file({k: v for k, v in donor.net.state_dict().items() if k.startswith("backbone.")}, str(partial))
    student = ScalarHeadStudent(ScalarHeadOptions(**{**small.__dict__, "init": str(partial)}), seed=0)
    fresh = ScalarHeadStudent(small, seed=0)
    for key, value in student.net.state_dict().items():  # the tower from the file, the rest as initialised
        source = donor if key.startswith("backbone.") else fresh
        assert torch.equal(value, source.net.state_dict()[key]), key


def test_a_saved_student_does_not_need_its_init_file(tmp_path):
    partial = tmp_path / "tower.safetensors"
    options = ScalarHeadOptions(channels=(8, 16), hidden=16, text_encoder="none")
    save_file({k: v for k, v in ScalarHeadStudent(options, seed=3).net.state_dict().items()}, str(partial))
    student = ScalarHeadStudent(ScalarHeadOptions(**{**options.__dict__, "init": str(partial)}))
    student.save(tmp_path / "student")
    partial.unlink()
    again = ScalarHeadStudent.load(tmp_path / "student")
    assert all(torch.equal(a, b) for a, b in zip(student.net.state_dict().values(),
                                                 again.net.state_dict().values(), strict=True))
    assert resolve_demo_path("demo:digit-tower").is_file()
