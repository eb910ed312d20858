"""The demo recipe with and without merak's glibc malloc thresholds (launcher.keep_freed_memory).

Runs recipes/gpt/train.py (the demo model at dp=2 x pp=2, 4 processes) alternately with the
setting on and off, and reports the median step time and the process CPU time split
into user and kernel (sys) time of each run.
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
logger = logging.getLogger("bench.keep_freed_memory")


def run_once(keep: bool, steps: int, extra: list[str]) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with tempfile.TemporaryDirectory() as run_dir:
        subprocess.run([sys.executable, str(REPO / "recipes/gpt/train.py"), "parallel=dp2_pp2",
                        f"trainer.max_steps={steps}", f"launcher.keep_freed_memory={str(keep).lower()}",
                        f"hydra.run.dir={run_dir}", *extra],
                       check=True, capture_output=True, text=True)
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"median_step_time_s": summary["median_step_time_s"],
            "user_s": after.ru_utime - before.ru_utime, "sys_s": after.ru_stime - before.ru_stime}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for train.py")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    results = {True: [], False: []}
    for round_index in range(args.rounds):
        for keep in (True, False):
            results[keep].append(run_once(keep, args.steps, args.overrides))
            logger.info("round %d keep_freed_memory=%s: %s", round_index, keep, results[keep][-1])
    rows = []
    for keep in (True, False):
        runs = results[keep]
        rows.append((keep, statistics.median(r["median_step_time_s"] for r in runs),
                     statistics.median(r["user_s"] for r in runs), statistics.median(r["sys_s"] for r in runs)))
    print("| keep_freed_memory | median step (s) | user CPU-s per run | sys CPU-s per run |")
    print("|---|---|---|---|")
    for keep, step, user, system in rows:
        print(f"| {str(keep).lower()} | {step:.3f} | {user:.1f} | {system:.1f} |")
    print(f"\nstep time off / on: {rows[1][1] / rows[0][1]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
