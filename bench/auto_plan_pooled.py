"""The cost model's own error, told apart from the machine's noise, over several ``auto_plan.py`` sweeps.

One sweep measures each layout once and prices it on one calibration; on a machine whose processes share two
cores both are noisy, so a single row's error mixes the cost model's bias for that layout with the noise of
one measurement and one calibration. This pools sweeps taken hours apart:

- **Noise floor.** A sweep times every layout in two runs (same code, minutes apart): the spread of their
  ratio is the noise of one measured step. ``--recalibrate`` sweeps record a second calibration taken right
  before each layout's runs: the spread of the layout's predictions on the two (priced alike here) is the
  noise of one calibration.
  From both, the share of rows a cost model right on average for every layout would put within the
  tolerance (the measured step being the faster of two runs, such a model predicts a few percent long), and
  the chance that it puts every row of a sweep there.
- **Bias per layout.** Every row of every sweep is priced with the current cost model on the calibration
  its sweep recorded (deterministic: nothing is timed), and the rows of one layout are pooled across the
  sweeps: the geometric mean of predicted over measured is the cost model's bias for that layout, the
  spread around it the noise.

Only the planner may have changed since the sweeps: the training code must be the one that ran them.

    .venv/bin/python bench/auto_plan_pooled.py [--sweeps FILE ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # first: sets OMP_NUM_THREADS before torch starts threads
from auto_plan import STEP_TOLERANCE_PCT
from auto_plan_repriced import reprice, sweep_measurements

# The sweeps whose training code is today's (since a517f0f only the loader's epoch permutation changed, some
# 0.1 ms of a step) and which recorded the calibration they planned on.
DEFAULT_SWEEPS = ["bench/results/auto_plan_a517f0f.json", "bench/results/auto_plan_a4d2f52.json",
                  "bench/results/auto_plan.json", "bench/results/auto_plan_recalibrated.json",
                  "bench/results/auto_plan_lone_collectives.json", "bench/results/auto_plan_210eb90.json"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweeps", nargs="+", default=DEFAULT_SWEEPS, help="auto_plan.py results JSONs")
    parser.add_argument("--out", default="bench/results/auto_plan_pooled.json", help="results JSON ('' for none)")
    return parser.parse_args(argv)


def log_ratio_sigma(log_ratios: list[float]) -> float:
    """The standard deviation of one of two noisy values whose log ratios are given (each pair's difference
    holds the noise of both, so the root mean square over sqrt(2))."""
    return math.sqrt(sum(r * r for r in log_ratios) / len(log_ratios)) / math.sqrt(2) if log_ratios else 0.0


def run_pair_log_ratios(sweeps: list[dict]) -> list[float]:
    """log(second run's median step / first's) of every layout a sweep timed twice."""
    ratios = []
    for sweep in sweeps:
        for group in sweep["groups"]:
            for row in group.get("rows", ()):
                medians = [run.get("median_step_s") for run in (row.get("timing_run") or {}).get("runs", ())]
                if len(medians) == 2 and all(medians):
                    ratios.append(math.log(medians[1] / medians[0]))
    return ratios


def calibration_pair_log_ratios(rows: list[dict]) -> list[float]:
    """log(prediction on the calibration right before the layout's runs / on the plan's own) of the priced
    rows whose sweep recorded both (both priced alike here, where a sweep priced a layout predicted more
    than twice the best one's step in closed form on the plan's calibration)."""
    return [math.log(row["recalibrated_step_s"] / row["predicted_step_s"])
            for row in rows if row.get("recalibrated_step_s") and row.get("predicted_step_s")]


def share_within(sigma: float, tolerance_pct: float, mean: float = 0.0) -> float:
    """P(|exp(e) - 1| <= tolerance) for e ~ N(mean, sigma): the share of rows a model whose only error is
    that noise puts within the tolerance."""
    upper, lower = math.log1p(tolerance_pct / 100), math.log1p(-tolerance_pct / 100)
    if sigma == 0.0:
        return float(lower <= mean <= upper)
    scale = sigma * math.sqrt(2)
    return 0.5 * (math.erf((upper - mean) / scale) - math.erf((lower - mean) / scale))


def measured_value_sigma(run_sigma: float) -> float:
    """The noise of a sweep's measured step, the faster of two runs' medians: the minimum of two normal
    draws has the variance sigma^2 (1 - 1/pi)."""
    return run_sigma * math.sqrt(1 - 1 / math.pi)


def measured_value_shift(run_sigma: float) -> float:
    """How much a prediction of a typical run exceeds the faster of two runs on average (in log): the
    minimum of two normal draws lies sigma / sqrt(pi) below their mean."""
    return run_sigma / math.sqrt(math.pi)


def priced_rows(sweeps: list[tuple[str, dict]]) -> list[dict]:
    """Every measured row of every sweep priced by the current cost model on its sweep's recorded calibration."""
    rows = []
    for path, sweep in sweeps:
        global_batch = sweep["args"]["global_batch"]
        for group in sweep["groups"]:
            measured = sweep_measurements(group)
            if group.get("error") or not measured:
                continue
            priced, _ = reprice(group, global_batch, measured[0])
            for row in priced:
                if row["measured_step_s"]:
                    rows.append({"sweep": path, "recipe": group["recipe"], "model": group["model"],
                                 "world": group["world"], **row})
    return rows


def layout_biases(rows: list[dict]) -> list[dict]:
    """Per layout (recipe, model, world, key): its rows' log errors pooled over the sweeps."""
    pooled = defaultdict(list)
    for row in rows:
        pooled[(row["recipe"], row["model"], row["world"], row["key"])].append(
            math.log(row["predicted_step_s"] / row["measured_step_s"]))
    biases = []
    for (recipe, model, world, key), errors in sorted(pooled.items()):
        mean = statistics.fmean(errors)
        biases.append({"recipe": recipe, "model": model, "world": world, "key": key, "sweeps": len(errors),
                       "bias_pct": 100 * math.expm1(mean),
                       "errors_pct": [100 * math.expm1(e) for e in errors],
                       "spread_pct": 100 * math.expm1(statistics.pstdev(errors)) if len(errors) > 1 else None})
    return biases


def main(argv=None) -> int:
    args = parse_args(argv)
    common.setup_logging()
    sweeps = [(path, json.loads(Path(path).read_text(encoding="utf-8"))) for path in args.sweeps]
    tolerance = STEP_TOLERANCE_PCT

    rows = priced_rows(sweeps)
    run_pairs = run_pair_log_ratios([s for _, s in sweeps])
    calibration_pairs = calibration_pair_log_ratios(rows)
    run_sigma, calibration_sigma = log_ratio_sigma(run_pairs), log_ratio_sigma(calibration_pairs)
    apart = math.log1p(tolerance / 100)
    noise_sigma = math.hypot(measured_value_sigma(run_sigma), calibration_sigma)
    unbiased_share = share_within(noise_sigma, tolerance, measured_value_shift(run_sigma))
    hits = sum(abs(r["step_error_pct"]) <= tolerance for r in rows)
    per_sweep = {path: [sum(abs(r["step_error_pct"]) <= tolerance for r in rows if r["sweep"] == path),
                        sum(r["sweep"] == path for r in rows)] for path, _ in sweeps}
    full_sweep = max(count for _, count in per_sweep.values())  # the rows of a sweep of every recipe/world
    biases = layout_biases(rows)
    repeated = [b for b in biases if b["sweeps"] > 1]
    bias_hits = sum(abs(b["bias_pct"]) <= tolerance for b in repeated)
    residuals = [math.log1p(e / 100) - math.log1p(b["bias_pct"] / 100) for b in repeated for e in b["errors_pct"]]
    # Residuals about a mean of n values have n - 1 degrees of freedom per layout.
    freedom = sum(b["sweeps"] - 1 for b in repeated)
    residual_sigma = math.sqrt(sum(r * r for r in residuals) / freedom) if freedom else 0.0

    print(f"the same layout's two runs in a sweep: {sum(abs(r) > apart for r in run_pairs)} of {len(run_pairs)} "
          f"more than {tolerance:.0f} % apart; its predictions on two calibrations: "
          f"{sum(abs(r) > apart for r in calibration_pairs)} of {len(calibration_pairs)}")
    print(f"noise of one measured run: sigma {100 * run_sigma:.1f} % (the faster of two: "
          f"{100 * measured_value_sigma(run_sigma):.1f} %); of one calibration: {100 * calibration_sigma:.1f} %")
    print(f"a cost model right on average for every layout (predicting a typical run, which the faster of two "
          f"undercuts by {100 * math.expm1(measured_value_shift(run_sigma)):.1f} %) would put "
          f"{100 * unbiased_share:.0f} % of rows within {tolerance:.0f} %: "
          f"{full_sweep * unbiased_share:.1f} of a sweep's {full_sweep}, all {full_sweep} with probability "
          f"{unbiased_share ** full_sweep:.1e}")
    print(f"the current cost model: {hits} of {len(rows)} rows within {tolerance:.0f} % "
          f"({100 * hits / len(rows):.0f} %) over {len(sweeps)} sweeps: "
          f"{', '.join(f'{Path(path).stem} {a}/{b}' for path, (a, b) in per_sweep.items())}")
    print(f"bias per layout (pooled over 2-{max(b['sweeps'] for b in biases)} sweeps): {bias_hits} of "
          f"{len(repeated)} layouts within {tolerance:.0f} %; the rows scatter about their layout's bias by "
          f"sigma {100 * residual_sigma:.1f} %")
    for b in sorted(repeated, key=lambda b: -abs(b["bias_pct"])):
        if abs(b["bias_pct"]) > tolerance / 2:
            print(f"  {b['recipe']}:{b['model']} {b['world']} {b['key']}: bias {b['bias_pct']:+.1f} % "
                  f"(rows {', '.join(f'{e:+.0f}' for e in b['errors_pct'])})")
    common.write_json(args.out, {
        "benchmark": "auto_plan_pooled", "command": " ".join(sys.argv), "machine": common.machine_facts(),
        "sweeps": args.sweeps, "tolerance_pct": tolerance,
        "noise": {"run_pairs": len(run_pairs), "run_pairs_apart": sum(abs(r) > apart for r in run_pairs),
                  "calibration_pairs": len(calibration_pairs),
                  "calibration_pairs_apart": sum(abs(r) > apart for r in calibration_pairs),
                  "run_sigma": run_sigma, "measured_sigma": measured_value_sigma(run_sigma),
                  "measured_shift": measured_value_shift(run_sigma), "calibration_sigma": calibration_sigma,
                  "combined_sigma": noise_sigma, "unbiased_share_within": unbiased_share,
                  "full_sweep_rows": full_sweep, "unbiased_full_sweep_within": unbiased_share ** full_sweep},
        "rows_within": [hits, len(rows)], "rows_within_per_sweep": per_sweep,
        "layouts_bias_within": [bias_hits, len(repeated)],
        "residual_sigma": residual_sigma, "layouts": biases, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
