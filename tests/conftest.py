"""Shared test setup: offline, CPU, deterministic thread count, a tiny SD3 model directory."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# child processes (the CLI run as a user runs it) on one thread like this one: on a busy machine a run on more threads
# warns that they measured slower than one (flowforge.train.perf.set_cpu_threads), which depends on the load
os.environ.setdefault("OMP_NUM_THREADS", "1")
# the two xdist workers share the cores on purpose: no start-up thread-count warning in every run (tested on its own)
os.environ.setdefault("FLOWFORGE_THREAD_CHECK", "0")

import json
import pathlib

import pytest

GOLDEN_DIR = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "golden"


@pytest.fixture(scope="session")
def golden_dir() -> pathlib.Path:
    if not GOLDEN_DIR.is_dir():
        pytest.fail(f"golden vectors not found at {GOLDEN_DIR} (expected ../shared/golden beside the checkout)")
    return GOLDEN_DIR


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> pathlib.Path:
    """A random-init tiny pixel-space SD3 transformer saved with diffusers' save_pretrained (+ MiniLM metadata)."""
    from flowforge.demo.model import build_tiny_sd3, test_sd3_config
    from flowforge.models.sd3.adapter import FLOWFORGE_META

    path = tmp_path_factory.mktemp("tiny_sd3")
    build_tiny_sd3(test_sd3_config(), seed=0).save_pretrained(str(path), safe_serialization=True)
    (path / FLOWFORGE_META).write_text(json.dumps({"text_encoder": "minilm", "max_length": 16}))
    return path


@pytest.fixture(scope="session")
def encode_cache_dir(tmp_path_factory) -> pathlib.Path:
    """One prompt-encoding cache for the whole session (MiniLM runs once per prompt set)."""
    return tmp_path_factory.mktemp("encode_cache")


@pytest.fixture(autouse=True)
def _report_figures_drawn_only_in_report_tests(request, monkeypatch):
    """Every training run writes report.html at its end; outside ``tests/report/`` the page is built in full (every
    panel plotted from the run's metrics, every section, every table) but its figures are not rasterised: matplotlib's
    drawing of the PNGs (:func:`flowforge.report.plots.render_png`) took about 330 s of the default run's 1150 s of
    test time, in 126 reports of runs whose tests read the page's text, not its pixels. The tests under
    ``tests/report/`` draw every figure."""
    if pathlib.Path(request.node.path).is_relative_to(pathlib.Path(__file__).parent / "report"):
        return
    from flowforge.report import plots

    monkeypatch.setattr(plots, "render_png", lambda fig: b"")


def pytest_configure(config):
    import torch

    torch.set_num_threads(1)
