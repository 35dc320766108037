"""Issue 11 through the real command line: a checkpoint that does not match its run, or a damaged checkpoint file,
is one line naming the key or file (exit 2) and changes nothing; ``--overwrite`` replaces a previous export only."""

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from tests.cli.harness import assert_one_line_error, run_cli
from tests.tools.test_export import _refresh_manifest, tree_digest


@pytest.fixture
def run_copy(cli_run, tmp_path):
    """A private copy of the module's LoRA run, free to damage."""
    return shutil.copytree(cli_run, tmp_path / "run")



def test_renamed_tensor_key_is_refused(run_copy, tmp_path):
    step_dir = run_copy / "checkpoints" / "step_000001"
    weights = step_dir / "weights" / "live.safetensors"
    tensors = load_file(str(weights))
    key = "transformer_blocks.0.attn.to_v.lora_B.weight"
    tensors[key.replace("to_v", "to_out.0")] = tensors.pop(key)
    save_file(tensors, str(weights))
    _refresh_manifest(step_dir)
    before = tree_digest(run_copy)
    for form in ("adapter", "merged"):
        rc, stdout, stderr = run_cli(["export", run_copy, tmp_path / "out", "--form", form], tmp_path,
                                     in_process=True)
        assert_one_line_error(rc, stderr, ["live.safetensors", repr(key.replace("to_v", "to_out.0"))])
        assert stdout == "" and not (tmp_path / "out").exists()
    assert tree_digest(run_copy) == before


@pytest.mark.parametrize(("name", "damage", "why"), [
    ("weights/live.safetensors", "header", "SafetensorError"),
    ("optimizer.pt", "zeros", "not a torch.save archive"),
    ("trainer_state.json", "garbage", "not valid JSON"),
])
def test_damaged_checkpoint_file_is_named(run_copy, tmp_path, name, damage, why):
    f = run_copy / "checkpoints" / "step_000001" / name
    data = bytearray(f.read_bytes())
    if damage == "header":
        data[8:24] = b"#" * 16
    else:
        data[:] = (b"\0" if damage == "zeros" else b"@") * len(data)
    f.write_bytes(bytes(data))  # same size: the manifest's size check cannot see it
    _refresh_manifest(f.parent if "/" not in name else f.parent.parent)  # and checksums that agree: the reader names it
    before = tree_digest(run_copy)
    rc, _, stderr = run_cli(["export", run_copy, tmp_path / "out", "--form", "adapter"], tmp_path, in_process=True)
    assert_one_line_error(rc, stderr, [name.split("/")[-1], why, "--step"])
    assert "meta tensor" not in stderr and "legacy" not in stderr
    assert tree_digest(run_copy) == before and not (tmp_path / "out").exists()


def test_overwrite_replaces_a_previous_export_and_refuses_a_foreign_file(cli_run, tmp_path):
    out = tmp_path / "exports" / "digits"
    rc, stdout, stderr = run_cli(["export", cli_run, out, "--form", "merged"], tmp_path, in_process=True)
    assert rc == 0 and stdout.strip() == f"exported merged to {out}", stderr
    rc, _, stderr = run_cli(["export", cli_run, out, "--form", "adapter"], tmp_path, in_process=True)
    assert_one_line_error(rc, stderr, ["digits", "--overwrite"])
    rc, stdout, stderr = run_cli(["export", cli_run, out, "--form", "adapter", "--overwrite"], tmp_path,
                                 in_process=True)
    assert rc == 0, stderr
    owned = json.loads((out / "flowforge_export.json").read_text())["files"]
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == owned
    assert "pytorch_lora_weights.safetensors" in owned
    (out / "my_notes.txt").write_text("mine")
    before = tree_digest(tmp_path)
    rc, _, stderr = run_cli(["export", cli_run, out, "--form", "adapter", "--overwrite"], tmp_path, in_process=True)
    assert_one_line_error(rc, stderr, ["my_notes.txt"])
    assert tree_digest(tmp_path) == before
