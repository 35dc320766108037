"""``demo:`` names resolve to the packaged files in flowforge/demo; other sources pass through unchanged."""
import json
from pathlib import Path

import pytest

from flowforge.demo.paths import (DEMO_BASE, DEMO_NAMES, demo_base_dir, demo_prompts_path, is_demo_name,
                                  resolve_demo_path)


def test_demo_base_resolves_to_the_shipped_weights():
    d = resolve_demo_path(DEMO_BASE)
    assert d == demo_base_dir() and d.is_dir()
    assert (d / "config.json").is_file() and (d / "diffusion_pytorch_model.safetensors").is_file()
    assert json.loads((d / "flowforge.json").read_text())["text_encoder"] == "minilm"
    assert d == Path(__file__).resolve().parents[2] / "flowforge" / "demo" / "weights" / "base"


def test_prompt_sets_resolve_to_the_packaged_jsonl():
    for name in ("demo:train", "demo:eval"):
        path = resolve_demo_path(name)
        assert path == demo_prompts_path(name) and path.name == f"{name[5:]}.jsonl" and path.is_file()


def test_prompt_paths_agree_with_the_data_layer():
    from flowforge.data.prompts import resolve_prompt_path

    for name in ("demo:train", "demo:eval"):
        assert resolve_prompt_path(name).resolve() == resolve_demo_path(name).resolve()


def test_other_sources_pass_through_unchanged():
    for source in ("runs/x/model", "org/hub-id", "/abs/path", Path("demo:base")):
        assert resolve_demo_path(source) is source
    assert not is_demo_name(Path("demo:base")) and is_demo_name("demo:anything")


def test_unknown_demo_name_lists_the_allowed_ones():
    with pytest.raises(ValueError, match="demo:base.*demo:train.*demo:eval"):
        resolve_demo_path("demo:nope")
    with pytest.raises(ValueError, match="demo:train.*demo:eval"):
        demo_prompts_path("demo:base")
    assert DEMO_NAMES == ("demo:base", "demo:world", "demo:digit-tower", "demo:train", "demo:eval",
                          "demo:world-train", "demo:world-eval")
    assert resolve_demo_path("demo:digit-tower").name == "student_digit_tower.safetensors"
