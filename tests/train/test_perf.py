"""MFU accounting (:mod:`flowforge.train.perf`): FLOPs per row counted once by torch's counter, rows counted per
forward (also of a module swapped in as the target), a backward as twice its forward, the peak table and the measured
CPU peak."""

import math

import pytest
import torch
from torch import nn

from flowforge.train import perf


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 4, bias=False)

    def forward(self, hidden_states):
        return self.linear(hidden_states)


def test_flop_meter_counts_the_first_forward_once_then_rows_with_backward_as_twice_the_forward():
    a, b = Model(), Model()
    holder = {"model": a}
    meter = perf.FlopMeter(lambda: holder["model"])
    try:
        with torch.no_grad():
            a(hidden_states=torch.ones(2, 8))  # 2 rows x (8 x 4) multiply-adds = 2 x 2 x 32 FLOPs
        assert meter.flops_per_row == 64
        assert meter.take() == 2 * 64
        holder["model"] = b  # another module swapped in (a policy copy) counts; the old one no longer does
        b(hidden_states=torch.ones(3, 8)).sum().backward()
        a(hidden_states=torch.ones(5, 8))
        assert meter.take() == 3 * 3 * 64
    finally:
        meter.remove()
    a(hidden_states=torch.ones(2, 8))
    assert meter.take() == 0.0


def test_perf_meter_metrics_split_rollout_and_update_against_the_peak():
    model = Model()
    meter = perf.PerfMeter(lambda: model, torch.device("cpu"), torch.float32)
    assert meter.peak.flops > 0 and "measured" in meter.peak.source
    with meter.counting():
        meter.begin_step()
        with torch.no_grad():
            model(hidden_states=torch.ones(4, 8))
        meter.end_rollout()
        model(hidden_states=torch.ones(2, 8)).sum().backward()
        out = meter.metrics({"time/sample": 1.0, "time/optimize": 2.0, "time/prompts": 1.0})
    peak = meter.peak.flops
    assert out["perf/mfu_rollout"] == pytest.approx(4 * 64 / 1.0 / peak)
    assert out["perf/mfu_update"] == pytest.approx(3 * 2 * 64 / 2.0 / peak)
    assert out["perf/tflops"] == pytest.approx((4 * 64 + 3 * 2 * 64) / 4.0 / 1e12)
    assert out["perf/mfu"] == pytest.approx(out["perf/tflops"] * 1e12 / peak)
    assert out["perf/peak_tflops"] == pytest.approx(peak / 1e12)


def test_rollout_in_workers_is_nan_and_the_update_still_counts():
    model = Model()
    meter = perf.PerfMeter(lambda: model, torch.device("cpu"), torch.float32, rollout_elsewhere=True)
    with meter.counting():
        meter.begin_step()
        meter.end_rollout()
        model(hidden_states=torch.ones(1, 8)).sum().backward()
        out = meter.metrics({"time/sample": 1.0, "time/optimize": 1.0})
    assert math.isnan(out["perf/mfu_rollout"]) and out["perf/mfu_update"] > 0


def test_known_gpus_use_the_table_and_the_cpu_peak_is_measured_without_drawing_random_numbers(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    peak = perf.device_peak(torch.device("cuda"), torch.bfloat16)
    assert peak.flops == 989.4e12 and "datasheet" in peak.source
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert perf.device_peak(torch.device("cuda"), torch.float32).flops == 51.2e12
    state = torch.get_rng_state()
    assert perf.measured_peak(torch.device("cpu"), torch.float32) > 1e8
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("rates, current, auto, threads, warn, says", [
    ({2: 0.015e12, 1: 0.10e12}, 2, False, 2, True, "measured 0.1 TFLOP/s at 1 thread, 0.015 at 2"),  # issue 43
    ({2: 0.079e12, 1: 0.10e12}, 2, False, 2, True, "run.num_threads=1"),  # below 0.8x one thread's
    ({2: 0.081e12, 1: 0.10e12}, 2, False, 2, False, None),  # slower, but within 0.8x: nothing said
    ({4: 0.35e12, 1: 0.10e12}, 4, False, 4, False, None),  # an idle machine: threads scale
    ({2: 0.015e12, 1: 0.10e12}, 2, True, 1, False, "run.num_threads=auto: 1 CPU thread (measured 0.1"),
    ({4: 0.35e12, 1: 0.10e12}, 4, True, 4, False, "run.num_threads=auto: 4 CPU threads"),
    ({2: 0.10e12, 1: 0.10e12}, 2, True, 1, False, "auto: 1 CPU thread"),  # a tie keeps fewer threads
])
def test_choose_threads_warns_or_picks_from_the_measured_peaks(rates, current, auto, threads, warn, says):
    choice = perf.choose_threads(rates, current, auto=auto)
    assert (choice.threads, choice.warn) == (threads, warn)
    assert choice.message is None if says is None else says in choice.message
