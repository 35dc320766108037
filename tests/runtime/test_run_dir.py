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


def test_a_resume_path_continues_only_in_its_own_run_or_the_run_it_started(tmp_path):
    """:func:`refuse_foreign_resume`: a checkpoint of run ``A`` may continue in ``A``, in a new directory, or in the
    run directory that this same resume started and that was killed before its first save (a pipeline's stage C,
    also after the pipeline directory moved); never over another run."""
    import shutil

    from flowforge.runtime.errors import UserError
    from flowforge.runtime.run_dir import refuse_foreign_resume

    pipe = tmp_path / "p"
    ckpt = pipe / "A" / "checkpoints" / "step_000004"
    ckpt.mkdir(parents=True)
    (ckpt / "COMMITTED").write_text("{}")
    (pipe / "A" / "config.yaml").write_text("run: {}\n")
    c = pipe / "C"
    c.mkdir()
    (c / "metrics.jsonl").write_text('{"step": 5}\n')
    (c / "config.yaml").write_text(f"run: {{output_dir: {pipe}}}\ntrain: {{resume: {ckpt}}}\n")
    refuse_foreign_resume(pipe / "A", str(ckpt), str(pipe))  # its own run
    refuse_foreign_resume(pipe / "new", str(ckpt), str(pipe))  # a new run
    refuse_foreign_resume(c, str(ckpt), str(pipe))  # the same command again
    refuse_foreign_resume(c, "auto", str(pipe))
    moved = tmp_path / "moved"
    shutil.move(pipe, moved)
    refuse_foreign_resume(moved / "C", str(moved / "A" / "checkpoints" / "step_000004"), str(moved))
    other = moved / "other"
    shutil.copytree(moved / "A", other)  # an existing run that is not the checkpoint's
    with pytest.raises(UserError, match=f"belongs to the run {moved / 'A'}.*names the existing run {other}"):
        refuse_foreign_resume(other, str(moved / "A" / "checkpoints" / "step_000004"), str(moved))
    saved = moved / "C" / "checkpoints" / "step_000006"  # C saved: it is a run of its own now
    saved.mkdir(parents=True)
    (saved / "COMMITTED").write_text("{}")
    with pytest.raises(UserError, match="choose a fresh run.name"):
        refuse_foreign_resume(moved / "C", str(moved / "A" / "checkpoints" / "step_000004"), str(moved))
