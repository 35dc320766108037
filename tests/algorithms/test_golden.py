"""Parity with the reference implementations' golden vectors (../shared/golden/*.json): every case of every file."""
import json

import pytest
import torch

from flowforge.algorithms import (
    flow_match_sigmas,
    group_advantages,
    grpo_clip_loss,
    nft_loss,
    nft_optimality,
    sde_diffusion_coefficient,
    transition,
)

F64 = torch.float64


def _load(golden_dir, name):
    return json.loads((golden_dir / name).read_text())


def _f64(a):
    return torch.tensor(a, dtype=F64)


def _f32(a):
    return torch.tensor(a, dtype=torch.float32)


def _assert_rel(actual, expected, rtol, what):
    expected = expected.to(actual.dtype)
    err = ((actual - expected).abs() / expected.abs().clamp_min(1e-6)).max().item()
    assert err <= rtol, f"{what}: max relative error {err:.3g} > {rtol}"


def _cases(golden_dir, name):
    return _load(golden_dir, name)["cases"]


def test_golden_files_present(golden_dir):
    names = {p.name for p in golden_dir.glob("*.json")}
    expected = {"flow_sde_step.json", "dance_sde_step.json", "cps_step.json", "group_advantages.json",
                "grpo_clip_loss.json", "nft_loss.json"}
    assert expected <= names, f"missing golden files: {expected - names}"


def test_flow_sde_step_all_cases(golden_dir):
    cases = _cases(golden_dir, "flow_sde_step.json")
    assert any(c["step_index"] == 0 for c in cases)
    for c in cases:
        sig = flow_match_sigmas(c["num_steps"], c["shift"])
        assert torch.equal(sig, _f32(c["sigmas"])), f"schedule differs for {c['num_steps']} steps shift {c['shift']}"
        i = c["step_index"]
        tr = transition("sde", _f32(c["x"]), _f32(c["velocity"]), sig[i], sig[i + 1], c["noise_level"],
                        x_next=_f32(c["x_next"]), sigma_max=sig[1])
        assert tr.mean.dtype == torch.float32 and tr.log_prob.shape == (2,)
        what = f"steps={c['num_steps']} shift={c['shift']} i={i}"
        _assert_rel(tr.mean, _f32(c["mean"]), 1e-5, "mean " + what)
        _assert_rel(tr.log_prob, _f32(c["log_prob"]), 1e-5, "log_prob " + what)
        g = sde_diffusion_coefficient(sig[i].expand(2), c["noise_level"], sigma_max=sig[1])
        _assert_rel(g, _f32(c["std_dev_t"]), 1e-5, "std_dev_t " + what)
        # the transition std is the coefficient times sqrt(-dt)
        _assert_rel(tr.std, g * torch.sqrt(sig[i] - sig[i + 1]), 1e-6, "std " + what)


def test_flow_sde_step_default_sigma_max_is_sigma_next_at_step_0(golden_dir):
    c = next(c for c in _cases(golden_dir, "flow_sde_step.json") if c["step_index"] == 0)
    sig = flow_match_sigmas(c["num_steps"], c["shift"])
    tr = transition("sde", _f32(c["x"]), _f32(c["velocity"]), sig[0], sig[1], c["noise_level"],
                    x_next=_f32(c["x_next"]))
    _assert_rel(tr.log_prob, _f32(c["log_prob"]), 1e-5, "step-0 log_prob without sigma_max")


@pytest.mark.parametrize("name,kind,eta_key", [("dance_sde_step.json", "dance", "eta"),
                                               ("cps_step.json", "cps", "noise_level")])
def test_dance_and_cps_all_cases(golden_dir, name, kind, eta_key):
    for c in _cases(golden_dir, name):
        tr = transition(kind, _f64(c["x"]), _f64(c["velocity"]), c["sigma"], c["sigma_next"], c[eta_key],
                        x_next=_f64(c["x_next"]))
        assert tr.mean.dtype == F64
        torch.testing.assert_close(tr.mean, _f64(c["mean"]), rtol=0, atol=1e-9)
        torch.testing.assert_close(tr.std, _f64([c["std"]] * 2), rtol=0, atol=1e-9)
        torch.testing.assert_close(tr.log_prob, _f64(c["log_prob"]), rtol=0, atol=1e-9)


def test_group_advantages_all_cases(golden_dir):
    for c in _cases(golden_dir, "group_advantages.json"):
        mode = "batch" if c["global_std"] else "group"
        adv = group_advantages(_f64(c["rewards"]), c["prompts"], std_mode=mode)
        torch.testing.assert_close(adv, _f64(c["advantages"]), rtol=0, atol=1e-9)


def test_grpo_clip_loss_all_cases(golden_dir):
    for c in _cases(golden_dir, "grpo_clip_loss.json"):
        loss, m = grpo_clip_loss(_f64(c["log_prob"]), _f64(c["old_log_prob"]), _f64(c["advantages"]),
                                 c["clip_range"], adv_clip=c["adv_clip_max"])
        assert abs(loss.item() - c["loss"]) <= 1e-9
        assert abs(m["clip_fraction"].item() - c["clip_fraction"]) <= 1e-9


def test_nft_loss_all_cases(golden_dir):
    for c in _cases(golden_dir, "nft_loss.json"):
        r = nft_optimality(_f64(c["advantages"]), c["adv_clip_max"])
        torch.testing.assert_close(r, _f64(c["r"]), rtol=0, atol=1e-12)
        x0, noise, sigma = _f64(c["x0"]), _f64(c["noise"]), _f64(c["sigma"])
        s = sigma.view(-1, 1, 1, 1)
        torch.testing.assert_close((1 - s) * x0 + s * noise, _f64(c["x_sigma"]), rtol=0, atol=1e-12)
        loss, m = nft_loss(_f64(c["v_live"]), _f64(c["v_old"]), _f64(c["x_sigma"]), x0, sigma, r,
                           beta=c["beta"], adv_clip=c["adv_clip_max"])
        assert abs(loss.item() - c["loss"]) <= 1e-9
        torch.testing.assert_close(m["positive_loss"], _f64(c["positive_loss"]), rtol=0, atol=1e-9)
        torch.testing.assert_close(m["negative_loss"], _f64(c["negative_loss"]), rtol=0, atol=1e-9)
