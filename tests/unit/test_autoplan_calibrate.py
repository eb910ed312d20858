"""The planner's calibration: fitting the rate-based estimate to timings, and processes sharing cores."""

from __future__ import annotations

import pytest

from merak.autoplan.calibrate import Calibration, fit_scales
from merak.shard.costs import MachineRates

RATES = MachineRates(flops_per_s=1e9, bytes_per_s=1e9, seconds_per_op=1e-3)


def test_two_sizes_fit_work_and_launch_scales_exactly():
    # True costs: work 2x its estimate, launches 0.5x. Estimates (work, launches) at microbatch 1 and 8.
    small, large = (1.0, 4.0), (8.0, 4.0)
    measured = [2 * work + 0.5 * launches for work, launches in (small, large)]
    work_scale, launch_scale = fit_scales((*small, measured[0]), (*large, measured[1]))
    assert work_scale == pytest.approx(2.0) and launch_scale == pytest.approx(0.5)


def test_one_size_or_an_impossible_line_falls_back_to_one_scale():
    assert fit_scales((1.0, 1.0, 4.0), None) == (pytest.approx(2.0), pytest.approx(2.0))
    # A larger microbatch measured faster (noise): no line with positive scales, one scale from the first.
    assert fit_scales((1.0, 1.0, 4.0), (2.0, 1.0, 3.0)) == (pytest.approx(2.0), pytest.approx(2.0))


def test_a_step_growing_faster_than_its_work_gets_no_launch_scale():
    # Work 1 -> 4 (x4) but time 1 -> 5 (x5): the line would need a negative launch scale.
    work_scale, launch_scale = fit_scales((1.0, 1.0, 1.0), (4.0, 1.0, 5.0))
    assert launch_scale == 0.0
    assert work_scale == pytest.approx((1 * 1 + 4 * 5) / (1 + 16))


def test_calibrated_seconds_scale_each_part():
    calibration = Calibration(work_scale=2.0, launch_scale=3.0)
    # 1e9 FLOPs (1 s) + 1e9 bytes (1 s) of work, 10 operations (10 ms) of launches.
    assert calibration.seconds(RATES, 1e9, 1e9, 10) == pytest.approx(2 * 2.0 + 3 * 0.01)
    assert Calibration().seconds(RATES, 1e9, 0, 0) == pytest.approx(1.0)


def test_slowdown_is_the_cores_share_times_what_sharing_adds():
    assert Calibration().slowdown(4, cores=2) is None
    # 4 processes on 2 cores measured 2.5x: 2x from the cores' share, 1.25x from sharing memory and caches.
    measured = Calibration(processes=4, concurrent_slowdown=2.5)
    assert measured.slowdown(1, cores=2) == pytest.approx(1.0)
    assert measured.slowdown(4, cores=2) == pytest.approx(2.5)
    assert measured.slowdown(2, cores=2) == pytest.approx(1 + 0.25 / 3)  # cores enough, a third of the sharing
    assert measured.slowdown(3, cores=2) == pytest.approx(1.5 * (1 + 0.25 * 2 / 3))
    assert measured.slowdown(0.5, cores=2) == 1.0  # never faster than alone


def test_size_factors_interpolate_in_log_size_and_hold_beyond():
    calibration = Calibration(size_factors=((1, 1.0), (4, 1.0), (16, 0.6)))
    assert calibration.size_factor(1) == pytest.approx(1.0)
    assert calibration.size_factor(4) == pytest.approx(1.0)
    assert calibration.size_factor(8) == pytest.approx(0.8)  # halfway between 4 and 16 in log2
    assert calibration.size_factor(64) == pytest.approx(0.6)
    assert Calibration().size_factor(8) == 1.0


def test_a_timing_is_the_median_of_its_runs_not_the_fastest(monkeypatch):
    import merak.autoplan.calibrate as calibrate

    clock = {"now": 0.0}
    durations = iter([9.0, 1.0, 5.0, 2.0])  # a warm-up, then three runs

    def run() -> None:
        clock["now"] += next(durations)

    monkeypatch.setattr(calibrate.time, "perf_counter", lambda: clock["now"])
    assert calibrate._typical_of(run, repeats=3, seconds=0.0) == 2.0
