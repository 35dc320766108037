"""module_skeleton: a model directory's module tree on the meta device, the same names as the loaded model."""

from flowforge.demo.paths import resolve_demo_path
from flowforge.models import build_adapter
from flowforge.models.skeleton import module_skeleton


def test_world_and_sd3_skeletons_match_the_loaded_trees():
    for adapter, name in (("world_model", "demo:world"), ("sd3", "demo:base")):
        path = resolve_demo_path(name)
        skeleton = module_skeleton(path)
        loaded = build_adapter(adapter, path).transformer
        assert [n for n, _ in skeleton.named_modules()] == [n for n, _ in loaded.named_modules()]
        assert all(p.device.type == "meta" for p in skeleton.parameters())


def test_no_config_or_unknown_class_gives_none(tmp_path):
    assert module_skeleton(tmp_path) is None
    (tmp_path / "config.json").write_text('{"_class_name": "NotAModel"}')
    assert module_skeleton(tmp_path) is None
    (tmp_path / "config.json").write_text("not json")
    assert module_skeleton(tmp_path) is None
