"""merak's frequency planner against the planner of commit d613715 on noise-free, tie-heavy profiles.

Command (2 cores are enough; one process, the old planner runs in a child process)::

    git worktree add /tmp/planner-old d613715   # once, from the checkout
    .venv/bin/python bench/energy_planner_family.py
    # defaults: --old /tmp/planner-old --sizes 4x8,8x32,8x64 --old-sizes 4x8,8x32 --deadlines 60

The family (:func:`family_options`): analytic clock curves without noise, so that many
candidate moves of the planner's greedy tie exactly:

* ``h100``: 81 clocks, 780-1980 MHz in 15 MHz steps; time ``t_max * (0.85 f_max / f + 0.15)``,
  power ``120 W + 580 W (f / f_max) ** 2.6``; blocked power 130 W.
* ``a100``: 81 clocks, 210-1410 MHz in 15 MHz steps, the simulated A100's curves
  (``merak.energy.simulated.SPECS``) with energies rounded to 0.01 J (flat energy regions);
  blocked power 80 W.

Every stage runs a forward of 20 ms and a backward of 40 ms at the highest clock; the middle
stages are identical, the first is 5 % heavier and the last 15 % (embedding, LM head). Each
profile is planned with ``FrequencyPlanner(step_graph("1f1b", S, M), options, p2p).frontier(N)``
timed from construction, by this checkout and by the checkout at ``--old`` (in a child
process, ``PYTHONPATH`` pointing at it); the table gives both times and the energy of the new
plan over the old one at the fastest, middle and slowest deadline and summed over the
deadlines. Times are wall seconds of one process from construction to the last plan, and in
brackets the part spent in the linear relaxation (HiGHS).
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

logger = logging.getLogger("energy_planner_family")

FAMILY = ("h100", "a100")
FORWARD_AT_MAX = 0.020  # seconds; the backward takes twice as long
STAGE_WEIGHT_FIRST, STAGE_WEIGHT_LAST = 1.05, 1.15


def _h100_curves(seconds_at_max: float) -> tuple[list[int], np.ndarray, np.ndarray]:
    clocks = list(range(1980, 779, -15))
    f = np.array(clocks, dtype=float) / 1980.0
    times = seconds_at_max * (0.85 / f + 0.15)
    power = 120.0 + 580.0 * f ** 2.6
    return clocks, times, power * times


def _a100_curves(seconds_at_max: float) -> tuple[list[int], np.ndarray, np.ndarray]:
    from merak.energy.simulated import SPECS

    spec = SPECS["A100"]
    clocks = list(range(1410, 209, -15))
    times = np.array([spec.time(seconds_at_max, c) for c in clocks])
    energies = np.round(np.array([spec.energy(seconds_at_max, c) for c in clocks]), 2)
    return clocks, times, energies


P2P_POWER = {"h100": 130.0, "a100": 80.0}


def family_options(kind: str, num_stages: int) -> tuple[dict, float]:
    """``({(stage, instruction): [Option, ...]}, p2p_power)`` of one family member.

    The options are sorted by clock, highest first, as :func:`merak.energy.profile_csv.read_profile`
    returns them, so either planner takes them as they are.
    """
    from merak.energy.profile_csv import Option

    curves = {"h100": _h100_curves, "a100": _a100_curves}[kind]
    options = {}
    for stage in range(num_stages):
        weight = STAGE_WEIGHT_FIRST if stage == 0 else STAGE_WEIGHT_LAST if stage == num_stages - 1 else 1.0
        for name, factor in (("forward", 1.0), ("backward", 2.0)):
            clocks, times, energies = curves(FORWARD_AT_MAX * factor * weight)
            options[(stage, name)] = [Option(c, float(t), float(e)) for c, t, e in zip(clocks, times, energies)]
    return options, P2P_POWER[kind]


def plan_one(kind: str, num_stages: int, num_microbatches: int, deadlines: int) -> dict:
    """Plan one member's frontier with the ``merak`` on ``sys.path``: seconds and per-deadline energies."""
    from merak.energy.dag import step_graph
    from merak.energy.planner import FrequencyPlanner

    options, p2p = family_options(kind, num_stages)
    graph = step_graph("1f1b", num_stages, num_microbatches)
    started = time.perf_counter()
    planner = FrequencyPlanner(graph, options, p2p)
    relaxation = [0.0]  # seconds in the linear relaxation (HiGHS), the rest being the greedy and paths
    relaxed = planner._relaxed

    def timed_relaxed(deadline: float):
        """``planner._relaxed``, timed."""
        begun = time.perf_counter()
        try:
            return relaxed(deadline)
        finally:
            relaxation[0] += time.perf_counter() - begun

    planner._relaxed = timed_relaxed
    if hasattr(planner, "_solved"):
        # frontier() itself; it remembers every deadline it solved, Pareto-optimal or not.
        planner.frontier(deadlines)
        grid = sorted(planner._solved)
        points = [planner._solved[t] for t in grid]
    else:
        # The old planner remembers nothing: these are its frontier's solves, in its order.
        fastest, slowest = planner.fastest_time(), planner.slowest_useful_time()
        end = min(slowest, planner._relaxed(slowest)[1] * 1.02)
        grid = np.linspace(fastest, end, deadlines)
        points = [planner.solve(float(t)) for t in grid]
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "relaxation_seconds": relaxation[0], "deadlines": [float(t) for t in grid],
            "energies": [p.energy for p in points],
            "times": [p.iteration_time for p in points]}


def run_old(old: Path, kind: str, S: int, M: int, deadlines: int, timeout: float) -> dict | None:
    """:func:`plan_one` in a child process that imports ``merak`` from the checkout at ``old``."""
    code = (f"import json, sys; sys.path.insert(0, {str(old)!r}); sys.path.insert(1, {str(Path(__file__).parent)!r});"
            f"import energy_planner_family as b; print(json.dumps(b.plan_one({kind!r}, {S}, {M}, {deadlines})))")
    try:
        done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                              timeout=timeout, cwd="/")
    except subprocess.TimeoutExpired:
        logger.warning("old planner: %s %dx%d did not finish in %.0f s", kind, S, M, timeout)
        return None
    if done.returncode != 0:
        logger.error("old planner failed:\n%s", done.stderr[-4000:])
        raise SystemExit(done.returncode)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=Path, default=Path("/tmp/planner-old"))
    parser.add_argument("--sizes", default="4x8,8x32,8x64")
    parser.add_argument("--old-sizes", default="4x8,8x32", help="sizes also planned by the old planner")
    parser.add_argument("--kinds", default=",".join(FAMILY))
    parser.add_argument("--deadlines", type=int, default=60)
    parser.add_argument("--old-timeout", type=float, default=300.0)
    parser.add_argument("--out", type=Path, default=Path("/tmp/merak-bench-energy-family.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not (args.old / "merak" / "energy" / "planner.py").is_file():
        raise SystemExit(f"no old checkout at {args.old}: git worktree add {args.old} d613715")
    old_sizes = set(args.old_sizes.split(",")) if args.old_sizes else set()
    rows, results = [], []
    for size in args.sizes.split(","):
        S, M = (int(x) for x in size.split("x"))
        for kind in args.kinds.split(","):
            new = plan_one(kind, S, M, args.deadlines)
            old = run_old(args.old, kind, S, M, args.deadlines, args.old_timeout) if size in old_sizes else None
            result = {"kind": kind, "S": S, "M": M, "new": new, "old": old}
            results.append(result)
            cells = [f"{kind} {size}", f"{new['seconds']:.2f} ({new['relaxation_seconds']:.2f})"]
            if old is None:
                cells += ["not run" if size not in old_sizes else f"> {args.old_timeout:.0f}", "", "", "", ""]
            else:
                ratio = np.array(new["energies"]) / np.array(old["energies"])
                mid = len(ratio) // 2
                cells += [f"{old['seconds']:.2f} ({old['relaxation_seconds']:.2f})",
                          f"{ratio[0]:.5f}", f"{ratio[mid]:.5f}", f"{ratio[-1]:.5f}",
                          f"{sum(new['energies']) / sum(old['energies']):.5f} (max {ratio.max():.5f})"]
            rows.append("| " + " | ".join(cells) + " |")
            logger.info("%s", rows[-1])
    args.out.write_text(json.dumps(results))
    header = ["| profile | new s (LP s) | old s (LP s) | E new/old fastest | middle | slowest | sum over deadlines |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    logger.info("%d deadlines per profile, 1F1B\n%s", args.deadlines, "\n".join(header + rows))


if __name__ == "__main__":
    main()
