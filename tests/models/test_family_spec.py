"""A model family is one folder and one spec: every registered family's package ``flowforge/models/<name>/`` exports
``FAMILY`` (:class:`flowforge.models.family.Family`), the registry's tables are views of those specs, the spec's
facts agree with the adapter class and diffusers, and the task is checked by the spec before anything loads."""

from __future__ import annotations

import importlib

import pytest

from flowforge import models
from flowforge.models import registry
from flowforge.models.family import Family


def test_every_registered_family_is_a_package_exporting_its_spec():
    assert registry.FAMILY_PACKAGES == tuple(registry.FAMILIES)
    for name in registry.FAMILY_PACKAGES:
        spec = importlib.import_module(f"flowforge.models.{name}").FAMILY
        assert isinstance(spec, Family) and spec.name == name
        assert spec is registry.FAMILIES[name]
        assert spec.adapter.startswith(f"flowforge.models.{name}.")
        assert spec.loader.startswith(f"flowforge.models.{name}.")


def test_registry_tables_are_views_of_the_specs():
    specs = registry.FAMILIES
    assert sorted(models.ADAPTERS) == sorted(specs)
    assert models.ADAPTER_CLASSES == {n: s.adapter for n, s in specs.items()}
    assert models.FAMILY_TASKS == {n: s.tasks for n, s in specs.items()}
    assert models.OWN_FORMAT_FAMILIES == ("world_model",)
    assert models.CONTEXT_PARALLEL_FAMILIES == ("flux", "flux2", "ltx2", "qwen_image", "wan")
    assert set(models.TRANSFORMER_CLASSES) == set(specs) - {"world_model"}
    assert "declares no _cp_plan" in models.context_parallel_problem("sd3")
    assert models.context_parallel_problem("ltx2") is None  # ring, with flowforge's plan (runtime.cp_plans)
    assert "SD3Transformer2DModel declares no _cp_plan" in models.context_parallel_problem("sd3")
    assert models.context_parallel_problem("wan") is None


@pytest.mark.parametrize("name", sorted(registry.FAMILIES))
def test_spec_agrees_with_the_adapter_class_and_diffusers(name):
    import diffusers

    spec = registry.FAMILIES[name]
    cls = models.adapter_class(name)
    assert cls is spec.adapter_class()
    assert callable(importlib.import_module(spec.loader.partition(":")[0]).__dict__[spec.loader.partition(":")[2]])
    class_tasks = getattr(cls, "tasks", None)
    if isinstance(class_tasks, tuple):  # WanAdapter's is per checkpoint (a property)
        assert class_tasks == spec.tasks
    assert models.adapter_tasks(name) == spec.tasks
    assert spec.default_task is None or spec.default_task in spec.tasks
    if spec.own_format:
        assert spec.transformer is None and spec.probe is None
    else:  # a diffusers family: its transformer class exists and export can verify it
        assert hasattr(diffusers, spec.transformer) and spec.probe is not None
    assert not hasattr(cls, "export_pipeline")  # an export fact lives in the spec only


def test_the_task_is_checked_by_the_spec_before_anything_loads(tmp_path):
    with pytest.raises(ValueError, match=r"model.task='t2v': the sd3 adapter runs only \['t2i'\]"):
        models.build_adapter("sd3", str(tmp_path), task="t2v")  # an empty directory: nothing is read
    with pytest.raises(ValueError, match=r"model.task='t2i': the wan adapter runs only \['t2v', 'i2v'\]"):
        models.build_adapter("wan", str(tmp_path), task="t2i")
    registry.FAMILIES["flux"].check_task("i2i")


def test_adapters_inherit_from_pretrained_and_the_vae_guard_from_the_base():
    from flowforge.demo.paths import demo_base_dir
    from flowforge.models.base import AdapterMixin
    from flowforge.models.family import FamilyAdapter
    from flowforge.models.sd3 import SD3Adapter

    for name, spec in registry.FAMILIES.items():
        cls = spec.adapter_class()
        assert issubclass(cls, FamilyAdapter) and cls.family_spec is spec, name
        assert "from_pretrained" not in vars(cls) and "require_vae" not in vars(cls), name
    adapter = SD3Adapter.from_pretrained(demo_base_dir())  # the spec's loader: load_sd3
    assert isinstance(adapter, SD3Adapter) and adapter.vae is None  # pixel space

    class Bare(AdapterMixin):
        vae = None

    with pytest.raises(RuntimeError, match=r"^this Bare has no VAE; decode is unavailable$"):
        Bare().require_vae("decode")
    with pytest.raises(RuntimeError, match=r"^this Bare has no VAE$"):
        Bare().require_vae()
    assert not hasattr(Bare, "from_pretrained")  # a bring-your-own class is still built as Class(path, **kw)


def test_components_load_with_the_class_model_index_names(tmp_path):
    import json

    import diffusers
    import torch
    from diffusers.pipelines.ltx2 import LTX2Vocoder

    from flowforge.models.load import component_class, load_component

    assert component_class("diffusers", "AutoencoderKL") is diffusers.AutoencoderKL
    assert component_class("ltx2", "LTX2Vocoder") is LTX2Vocoder  # a diffusers.pipelines module, as diffusers does
    with pytest.raises(ValueError, match="has no class 'Nope'"):
        component_class("diffusers", "Nope")
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(block_out_channels=(8,), norm_num_groups=8, latent_channels=4, sample_size=16)
    vae.save_pretrained(tmp_path / "vae")
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "X", "vae": ["diffusers", "AutoencoderKL"],
                                                           "text_encoder": [None, None]}))
    loaded = load_component(tmp_path, "vae", dtype=torch.float32, device="cpu")
    assert type(loaded) is diffusers.AutoencoderKL
    assert all(torch.equal(a, b) for a, b in zip(vae.state_dict().values(), loaded.state_dict().values()))
    assert load_component(tmp_path, "text_encoder", dtype=torch.float32, device="cpu") is None  # listed as null
    assert load_component(tmp_path, "scheduler", dtype=torch.float32, device="cpu") is None  # not listed
