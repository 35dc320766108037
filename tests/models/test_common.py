"""Shared adapter helpers of flowforge/models/common.py: pipeline schedule, CFG batch, flowforge.json metadata."""
import json

import pytest
import torch

from flowforge.models.common import (DYNAMIC_SHIFT_DEFAULTS, FLOWFORGE_META, dynamic_shift_mu,
                                     flow_match_pipeline_sigmas, read_flowforge_meta)


def test_dynamic_shift_mu_uses_the_config_then_the_pipeline_fallbacks():
    assert dynamic_shift_mu({}, 256) == pytest.approx(DYNAMIC_SHIFT_DEFAULTS["base_shift"])
    assert dynamic_shift_mu({}, 4096) == pytest.approx(DYNAMIC_SHIFT_DEFAULTS["max_shift"])
    assert dynamic_shift_mu({"max_shift": 0.9, "max_image_seq_len": 8192}, 8192) == pytest.approx(0.9)


def test_pipeline_sigmas_match_the_diffusers_scheduler():
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler

    sig = flow_match_pipeline_sigmas({"shift_terminal": None, "_class_name": "x"}, 4, 0.8)
    ref = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)
    ref.set_timesteps(sigmas=np.linspace(1.0, 0.25, 4), mu=0.8)
    assert sig.dtype == torch.float32 and sig.shape == (5,) and float(sig[-1]) == 0.0
    torch.testing.assert_close(sig, ref.sigmas.float())
    with pytest.raises(ValueError, match="num_steps"):
        flow_match_pipeline_sigmas({}, 0, 0.8)


def test_read_flowforge_meta(tmp_path):
    assert read_flowforge_meta(tmp_path) == {}
    (tmp_path / FLOWFORGE_META).write_text(json.dumps({"text_encoder": "minilm", "max_length": 16}))
    assert read_flowforge_meta(tmp_path) == {"text_encoder": "minilm", "max_length": 16}
