"""Fixtures of the pipeline tests."""

from __future__ import annotations

import pytest

from flowforge.orchestrate.config import check_pipeline, load_pipeline
from tests.orchestrate.support import write_pipeline


@pytest.fixture
def pipeline(tiny_model_dir, tmp_path, encode_cache_dir):
    """``make(**sections) -> (yaml path, checked pipeline config, pipeline directory)``: the tiny pipeline of
    :mod:`tests.orchestrate.support` with ``sections`` merged over it, under ``tmp_path / "runs" / "p"``."""
    def make(**sections):
        path = write_pipeline(tmp_path / "pipeline.yaml", tiny_model_dir, tmp_path / "runs", encode_cache_dir,
                              **sections)
        pcfg = load_pipeline(path)
        check_pipeline(pcfg)
        return path, pcfg, tmp_path / "runs" / "p"
    return make
