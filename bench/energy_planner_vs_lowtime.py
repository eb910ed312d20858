"""merak's frequency planner vs lowtime's Perseus solver on the same 1F1B instruction profiles.

Command (2 cores are enough; one process, lowtime runs in a child process)::

    cd /work/main && .venv/bin/python bench/energy_planner_vs_lowtime.py
    # defaults: --out /tmp/merak-bench-energy --sizes 4x8,8x16,8x32

For every (S, M) in ``--sizes``:

1. A profile CSV (``write_profile``) from the simulated A100 (``merak.energy.simulated.SPECS``),
   every supported clock (210-1410 MHz in 15 MHz steps, as Perseus profiles go down past the
   energy minimum): per stage a forward taking 20-30 ms at 1410 MHz (uniform, seeded by S; the
   last stage 1.3x heavier for the LM head), backward = 2x forward; per (stage, instruction,
   clock) a seeded multiplicative noise of 0.5 % (std) on the time, made non-increasing in the
   clock with a running max so the highest clock stays the fastest (``lowtime_frontier.py``
   asserts its fastest point is the all-max-clock step), and 1 % on the energy.
2. ``bench/lowtime_frontier.py`` (lowtime 0.3.0 PhillipsDessouky over the whole frontier,
   ``--unit-time 0.001``, ``--p2p-power`` = the A100's blocked power) in a subprocess.
3. merak: ``FrequencyPlanner(step_graph("1f1b", S, M), read_profile(csv), p2p).frontier(60)``
   timed from construction, then ``planner.solve(T)`` at every lowtime point's iteration time T
   (at most 150 evenly spaced points, the fastest included), with the relative energy
   difference (merak - lowtime) / lowtime (negative: merak uses less).

Both energies are sum(e_i) + p2p * (S * T - sum(t_i)). Writes the profiles, lowtime's CSV/JSON
and ``results.json`` to ``--out`` and logs a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

from merak.energy.dag import step_graph
from merak.energy.planner import FrequencyPlanner
from merak.energy.profile_csv import ProfileRow, read_profile, write_profile
from merak.energy.simulated import SPECS

logger = logging.getLogger("energy_planner_vs_lowtime")
SPEC = SPECS["A100"]
LOWTIME = Path(__file__).with_name("lowtime_frontier.py")
MAX_COMPARED = 150


def build_profile(path: Path, num_stages: int) -> None:
    """Write a seeded, imbalanced, slightly noisy A100 profile for ``num_stages`` stages."""
    rng = np.random.default_rng(num_stages)
    forward = rng.uniform(0.020, 0.030, num_stages)
    forward[-1] *= 1.3
    clocks = SPEC.clocks()  # highest first
    rows = []
    for stage in range(num_stages):
        for name, seconds_at_max in (("forward", forward[stage]), ("backward", 2 * forward[stage])):
            times = np.array([SPEC.time(seconds_at_max, c) for c in clocks]) * (1 + rng.normal(0, 0.005, len(clocks)))
            times = np.maximum.accumulate(times)  # a lower clock is never faster
            energies = np.array([SPEC.busy_power(c) for c in clocks]) * times * (1 + rng.normal(0, 0.01, len(clocks)))
            rows += [ProfileRow(stage, 0, stage, 0, name, c, float(t), float(e))
                     for c, t, e in zip(clocks, times, energies)]
    write_profile(str(path), rows)


def run_lowtime(profile: Path, out: Path, S: int, M: int) -> tuple[pd.DataFrame, dict, float]:
    cmd = [sys.executable, str(LOWTIME), str(profile), "--num-stages", str(S), "--num-microbatches", str(M),
           "--p2p-power", str(SPEC.blocked_power), "--unit-time", "0.001", "--out", str(out)]
    started = time.perf_counter()
    done = subprocess.run(cmd, check=False, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        logger.error("lowtime failed:\n%s", done.stderr[-4000:])
        raise SystemExit(done.returncode)
    return pd.read_csv(out), json.loads(out.with_suffix(".json").read_text()), wall


def compare(profile: Path, out_dir: Path, S: int, M: int) -> dict:
    lt_csv = out_dir / f"lowtime_s{S}_m{M}.csv"
    lt, lt_json, lt_wall = run_lowtime(profile, lt_csv, S, M)
    logger.info("%dx%d lowtime: %d points, solve %.1f s (wall %.1f s)", S, M, len(lt),
                lt_json["solve_seconds"], lt_wall)

    options = read_profile(str(profile))
    graph = step_graph("1f1b", S, M)
    started = time.perf_counter()
    planner = FrequencyPlanner(graph, options, SPEC.blocked_power)
    frontier = planner.frontier(60)
    merak_s = time.perf_counter() - started

    fastest_lt = int(lt.iteration_time.idxmin())
    picked = sorted(set(np.linspace(0, len(lt) - 1, min(len(lt), MAX_COMPARED)).round().astype(int)) | {fastest_lt})
    if len(picked) > MAX_COMPARED:  # the fastest was not among the evenly spaced ones
        picked.remove(min((i for i in picked if i != fastest_lt), key=lambda i: abs(i - fastest_lt)))
    t_fast = planner.fastest_time()
    points, started = [], time.perf_counter()
    for i in picked:
        row = lt.iloc[i]
        mine = planner.solve(max(float(row.iteration_time), t_fast))
        points.append({"lowtime_index": int(i), "deadline": float(row.iteration_time),
                       "lowtime_energy": float(row.energy), "merak_energy": mine.energy,
                       "merak_time": mine.iteration_time, "rel_diff": (mine.energy - row.energy) / row.energy})
    solves_s = time.perf_counter() - started

    max_times = [options[(n.stage, n.name)][0].time for n in graph.nodes]  # highest clock first
    max_energy = sum(options[(n.stage, n.name)][0].energy for n in graph.nodes)
    t_max_clock = planner.critical_path(max_times)
    all_max_energy = max_energy + SPEC.blocked_power * (S * t_max_clock - sum(max_times))
    rel = [p["rel_diff"] for p in points]
    worse = sorted((p for p in points if p["rel_diff"] > 0.01), key=lambda p: -p["rel_diff"])
    for p in worse[:10]:
        logger.warning("%dx%d: merak %.2f %% worse at T = %.4f s (lowtime %.2f J, merak %.2f J)", S, M,
                       100 * p["rel_diff"], p["deadline"], p["lowtime_energy"], p["merak_energy"])
    result = {
        "S": S, "M": M, "lowtime_points": len(lt), "compared": len(points),
        "max_rel_diff": max(rel), "median_rel_diff": statistics.median(rel), "min_rel_diff": min(rel),
        "merak_worse_1pct": len(worse), "t_all_max_clock": t_max_clock, "all_max_clock_energy": all_max_energy,
        "lowtime_all_max_clock_energy": lt_json["all_max_freq_energy"],
        "lowtime_fastest_time": float(lt.iteration_time.iloc[fastest_lt]),
        "lowtime_fastest_energy": float(lt.energy.iloc[fastest_lt]),
        "merak_fastest_time": t_fast, "merak_fastest_energy": planner.fastest().energy,
        "lowtime_solve_s": lt_json["solve_seconds"], "lowtime_wall_s": lt_wall,
        "merak_frontier60_s": merak_s, "merak_frontier_points": len(frontier),
        "merak_compare_solves_s": solves_s, "lowtime_min_energy": float(lt.energy.min()),
        "merak_min_energy": min(p.energy for p in frontier), "points": points,
    }
    logger.info("%dx%d: max rel %.3f %%, median %.3f %%, merak >1 %% worse at %d of %d; frontier(60) %.1f s",
                S, M, 100 * max(rel), 100 * result["median_rel_diff"], len(worse), len(points), merak_s)
    return result


def table(results: list[dict]) -> str:
    lines = [("| S x M | lowtime points | compared | max (merak-lt)/lt | median | merak >1 % worse | "
              "T all-max (s) | E all-max clocks (J) | E at T all-max: lowtime / merak (J) | "
              "lowtime solve (s) | merak frontier(60) (s) |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['S']} x {r['M']} | {r['lowtime_points']} | {r['compared']} | "
                     f"{100 * r['max_rel_diff']:+.2f} % | {100 * r['median_rel_diff']:+.2f} % | "
                     f"{r['merak_worse_1pct']} | {r['t_all_max_clock']:.4f} | {r['all_max_clock_energy']:,.1f} | "
                     f"{r['lowtime_fastest_energy']:,.1f} / {r['merak_fastest_energy']:,.1f} | "
                     f"{r['lowtime_solve_s']:.1f} | {r['merak_frontier60_s']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/merak-bench-energy"))
    parser.add_argument("--sizes", default="4x8,8x16,8x32", help="comma-separated SxM")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr, force=True)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for size in args.sizes.split(","):
        S, M = (int(x) for x in size.lower().split("x"))
        profile = args.out / f"profile_a100_s{S}.csv"
        build_profile(profile, S)
        results.append(compare(profile, args.out, S, M))
        (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    logger.info("\n%s", table(results))


if __name__ == "__main__":
    main()
