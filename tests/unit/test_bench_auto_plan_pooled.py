"""bench/auto_plan_pooled.py's statistics: the noise floor it reports is what sampling that noise gives."""

from __future__ import annotations

import math
import random
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from auto_plan_pooled import (  # bench/ is not a package: found through sys.path
    layout_biases,
    log_ratio_sigma,
    measured_value_shift,
    measured_value_sigma,
    share_within,
)

SAMPLES = 200_000


def test_the_faster_of_two_runs_is_as_far_below_and_as_spread_as_sampling_says():
    rng = random.Random(7)
    sigma = 0.09
    faster = [min(rng.gauss(0.0, sigma), rng.gauss(0.0, sigma)) for _ in range(SAMPLES)]
    assert -statistics.fmean(faster) == pytest.approx(measured_value_shift(sigma), rel=0.02)
    assert statistics.pstdev(faster) == pytest.approx(measured_value_sigma(sigma), rel=0.02)


def test_one_values_noise_from_the_log_ratios_of_pairs():
    rng = random.Random(11)
    sigma = 0.12
    ratios = [rng.gauss(0.0, sigma) - rng.gauss(0.0, sigma) for _ in range(SAMPLES)]
    assert log_ratio_sigma(ratios) == pytest.approx(sigma, rel=0.02)
    assert log_ratio_sigma([]) == 0.0


def test_the_share_within_the_tolerance_is_what_sampling_the_noise_puts_there():
    rng = random.Random(3)
    for sigma, mean in ((0.11, 0.0), (0.11, 0.05), (0.3, -0.1)):
        draws = (rng.gauss(mean, sigma) for _ in range(SAMPLES))
        sampled = sum(abs(math.expm1(e)) <= 0.15 for e in draws) / SAMPLES
        assert share_within(sigma, 15.0, mean) == pytest.approx(sampled, abs=0.005)
    assert share_within(0.0, 15.0) == 1.0
    assert share_within(0.0, 15.0, mean=math.log(1.2)) == 0.0


def test_a_layouts_bias_is_the_geometric_mean_of_its_rows_over_the_sweeps():
    rows = [{"recipe": "gpt", "model": "toy", "world": 4, "key": "dp4", "predicted_step_s": p, "measured_step_s": 1.0}
            for p in (1.21, 1.0)] + [{"recipe": "gpt", "model": "toy", "world": 8, "key": "dp4",
                                       "predicted_step_s": 0.5, "measured_step_s": 1.0}]
    biases = {b["world"]: b for b in layout_biases(rows)}
    assert biases[4]["bias_pct"] == pytest.approx(10.0)
    assert biases[4]["sweeps"] == 2 and biases[4]["errors_pct"] == [pytest.approx(21.0), pytest.approx(0.0)]
    assert biases[8]["sweeps"] == 1 and biases[8]["spread_pct"] is None
