"""Layouts chosen for energy: ``merak-plan --objective energy`` against simulated-GPU runs of the layouts it ranks.

    .venv/bin/python bench/energy_layouts.py [--world 4] [--global-batch 16] [--objective energy]
        [--simulated-tflops 0.001] [--steps 8] [--out DIR]

The gpt toy is planned for ``--world`` simulated A100s on this machine's CPU processes
(``trainer.energy_device=simulated``) with the objective, as ``merak-plan`` plans it. The layouts
measured: the first choice, and the first-ranked layout of every other (dp, tp, pp) grid and of
recomputation on/off among the layouts priced for energy. Each trains ``--steps`` steps in a fresh
``recipes/gpt/train.py`` run with its own clock plan (its frontier written as ``merak-plan`` writes
the first layout's, selected by ``trainer.frontier_deadline``; ``straggler_window=0``, so the plan
runs as planned), and its summary's energy per step over all GPUs and median step time (after the
first step) are compared with the prediction. ``--simulated-tflops`` is low enough that the
simulated GPU, not the shared CPU cores, decides each instruction's time.

It reports, per layout, predicted and measured J/step and step time with their errors, and whether
the first choice measured the least energy (within 2 %) among the layouts measured. Writes
``DIR/energy_layouts.json`` and logs a markdown table.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import common  # noqa: E402  (first of merak's: one thread, before torch starts any)

from merak.autoplan.commands import run_overrides  # noqa: E402
from merak.autoplan.energy import frontier_for_run  # noqa: E402
from merak.autoplan.planner import plan_recipe  # noqa: E402

logger = logging.getLogger("energy_layouts")

TRAIN = REPO / "recipes/gpt/train.py"
TIE = 0.02  # the first choice counts as the least energy within this fraction


def _measured_layouts(report) -> list:
    """The first choice, then the first-ranked priced layout of every other (grid, recomputation)."""
    seen, chosen = set(), []
    for candidate in report.candidates:
        if candidate.energy is None:
            continue
        kind = (candidate.layout.grid, candidate.layout.recompute)
        if kind not in seen:
            seen.add(kind)
            chosen.append(candidate)
    return chosen


def _train(overrides: list[str], run_dir: Path) -> dict:
    return common.train_recipe(overrides, run_dir, TRAIN)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--objective", default="energy")
    parser.add_argument("--simulated-tflops", type=float, default=0.001)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default="/tmp/energy_layouts")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name in ("merak", "merak.energy.planner"):
        logging.getLogger(name).setLevel(logging.WARNING)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    user = ["model=toy", f"trainer.global_batch_size={args.global_batch}", "trainer.energy_device=simulated",
            f"trainer.simulated_tflops={args.simulated_tflops}"]
    started = time.perf_counter()
    report = plan_recipe("gpt", user, world_size=args.world, objective=args.objective)
    planning_s = time.perf_counter() - started
    rows = []
    for index, candidate in enumerate(_measured_layouts(report)):
        frontier = out / f"layout{index}.frontier.json"
        deadline = frontier_for_run(report, candidate, report.objective, str(frontier))
        overrides = [*run_overrides(user, candidate.layout), f"trainer.frequency_frontier={frontier}",
                     f"trainer.frontier_deadline={deadline:.9g}", "trainer.straggler_window=0",
                     f"trainer.max_steps={args.steps}", "trainer.disable_tqdm=true", "trainer.save_steps=0"]
        summary = _train(overrides, out / f"layout{index}")
        energy = summary["energy"]
        price = candidate.energy
        row = {"rank": report.candidates.index(candidate) + 1, "layout": candidate.layout.key(),
               "predicted_j": price.energy_j, "measured_j": energy["iteration_energy_j"],
               "predicted_step_s": price.step_s, "measured_step_s": energy["iteration_time_s"],
               "clocks": price.clocks()}
        row["energy_error"] = row["predicted_j"] / row["measured_j"] - 1
        row["step_error"] = row["predicted_step_s"] / row["measured_step_s"] - 1
        rows.append(row)
        logger.info("%s", row)
    least = min(r["measured_j"] for r in rows)
    first = rows[0]
    result = {"objective": str(report.objective), "world": args.world, "global_batch": args.global_batch,
              "simulated_tflops": args.simulated_tflops, "steps": args.steps, "planning_s": planning_s,
              "layouts": rows, "first_is_least": first["measured_j"] <= least * (1 + TIE),
              "first_over_least": first["measured_j"] / least - 1}
    (out / "energy_layouts.json").write_text(json.dumps(result, indent=1))
    lines = ["| rank | layout | clocks (MHz) | predicted J/step | measured J/step | error | predicted step | "
             "measured step | error |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['rank']} | {r['layout']} | {r['clocks']} | {r['predicted_j']:.1f} | {r['measured_j']:.1f} "
                     f"| {r['energy_error']:+.1%} | {r['predicted_step_s'] * 1e3:.0f} ms | "
                     f"{r['measured_step_s'] * 1e3:.0f} ms | {r['step_error']:+.1%} |")
    logger.info("\n".join(lines))
    logger.info("first choice measured %+.1f%% over the least measured energy (%s); planning %.1f s",
                result["first_over_least"] * 100, "least within 2 %" if result["first_is_least"] else "NOT least",
                planning_s)
    return 0 if result["first_is_least"] else 1


if __name__ == "__main__":
    sys.exit(main())
