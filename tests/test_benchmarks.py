"""The benchmark harnesses' bookkeeping: slopes and the merging of rounds (the timed runs themselves are not tests)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import benchmark_long_context as long_context  # noqa: E402
import benchmark_swin  # noqa: E402


def cells(times: dict[int, float]) -> dict:
    return {long_context.key("hfx", length, "forward"): {"status": "ok", "time_s": t} for length, t in times.items()}


def test_loglog_slope_is_the_growth_exponent():
    linear = cells({2048: 0.1, 16384: 0.8})
    quadratic = cells({2048: 0.1, 16384: 6.4})
    assert long_context.loglog_slope(linear, "hfx", "forward", 2048, 16384) == pytest.approx(1.0)
    assert long_context.loglog_slope(quadratic, "hfx", "forward", 2048, 16384) == pytest.approx(2.0)
    assert long_context.loglog_slope(linear, "ref", "forward", 2048, 16384) is None  # no reference cells
    failed = {**linear, long_context.key("hfx", 16384, "forward"): {"status": "OOM"}}
    assert long_context.loglog_slope(failed, "hfx", "forward", 2048, 16384) is None
    line = long_context.slope_line(quadratic, [1024, 2048, 16384], "forward")
    assert "from 2048 to 16384" in line and "hfx 2.00" in line and "ref -" in line


def test_swin_rounds_are_merged_by_the_median_of_all_calls():
    rounds = [
        {"status": "ok", "time_s": 1.0, "times_s": [1.0, 1.1, 0.9], "background_cpu": [0.01], "peak_mib": 100.0},
        {"status": "error", "error": "killed"},
        {"status": "ok", "time_s": 2.0, "times_s": [2.0, 2.1, 1.9], "background_cpu": [0.02], "peak_mib": 140.0},
    ]
    merged = benchmark_swin.combine(rounds)
    assert merged["rounds"] == 2 and len(merged["times_s"]) == 6
    assert merged["time_s"] == pytest.approx(1.5)  # median of the six calls
    assert merged["peak_mib"] == pytest.approx(120.0)
    assert benchmark_swin.combine([{"status": "error", "error": "x"}])["status"] == "error"
