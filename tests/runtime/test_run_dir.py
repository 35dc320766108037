"""The run directory's layout and safety rules (flowforge.runtime.run_dir): the base model's identity, the run
directory kept apart from the source model."""

import hashlib
import os

import pytest

from flowforge.runtime.run_dir import check_run_dir_outside_source, sha256_of_path


def test_sha256_of_path(tmp_path):
    model = tmp_path / "model"
    (model / "transformer").mkdir(parents=True)
    (model / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"weights" * 1000)
    (model / "transformer" / "config.json").write_text('{"a": 1}')
    (model / "text_encoder.bin").write_bytes(b"enc")
    h = sha256_of_path(model)
    assert len(h) == 64
    (model / "README.md").write_text("docs do not change the identity")
    (model / ".cache").mkdir()
    (model / ".cache" / "x.json").write_text("{}")
    assert sha256_of_path(model) == h
    (model / "transformer" / "config.json").write_text('{"a": 2}')
    assert sha256_of_path(model) != h
    (model / "transformer" / "config.json").write_text('{"a": 1}')
    assert sha256_of_path(model) == h
    os.rename(model / "text_encoder.bin", model / "text_encoder2.bin")
    assert sha256_of_path(model) != h
    single = model / "transformer" / "diffusion_pytorch_model.safetensors"
    assert sha256_of_path(single) == hashlib.sha256(single.read_bytes()).hexdigest()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no"):
        sha256_of_path(tmp_path / "empty")
    with pytest.raises(ValueError, match="does not exist"):
        sha256_of_path(tmp_path / "nope")


def test_run_dir_must_lie_outside_the_source_model(tmp_path):
    src = tmp_path / "models" / "sd3"
    src.mkdir(parents=True)
    check_run_dir_outside_source(tmp_path / "runs" / "a", src)
    check_run_dir_outside_source(tmp_path / "models" / "sd3-run", src)  # a sibling with a common prefix
    with pytest.raises(ValueError, match="lies inside the source model"):
        check_run_dir_outside_source(src / "runs" / "a", src)
    with pytest.raises(ValueError, match="is the source model directory"):
        check_run_dir_outside_source(src, src)
    with pytest.raises(ValueError, match="contains the source model directory"):
        check_run_dir_outside_source(tmp_path / "models", src)
    link = tmp_path / "link"
    link.symlink_to(src)
    with pytest.raises(ValueError, match="lies inside the source model"):
        check_run_dir_outside_source(link / "run", src)


def test_a_run_directory_inside_another_run_or_a_checkpoint_is_refused(tmp_path):
    from flowforge.runtime.errors import UserError

    src = tmp_path / "models" / "base"
    src.mkdir(parents=True)
    other = tmp_path / "runs" / "base"
    (other / "checkpoints" / "step_000006").mkdir(parents=True)
    (other / "checkpoints" / "step_000006" / "COMMITTED").write_text("")
    (other / "config.yaml").write_text("run: {}\n")
    for run_dir in (other / "nested", other / "checkpoints" / "step_000006" / "x"):
        with pytest.raises(UserError, match="(is|lies inside) the (run directory|checkpoint)"):
            check_run_dir_outside_source(run_dir, src)
    check_run_dir_outside_source(other, src)  # the run itself (resume) is its own area
