"""The energy planner's predictions against simulated-GPU runs, per schedule, and straggler-aware plans.

    .venv/bin/python bench/energy_predictions.py [--out DIR] [--schedules 1f1b zb_h1 ...] [--repeats 2]
        [--skip-schedules] [--skip-straggler]

Per schedule (gpt toy, pp=2, microbatch 2, a simulated A100): profile the schedule's instructions
at every clock (the fewest microbatches it allows), plan a 40-point frontier for 8 microbatches
with ``merak-energy plan`` (the profile run's measured host overheads included), then train 6
steps at the frontier's fastest point and 6 at a point half way along it
(``trainer.frontier_deadline``), and compare the summary's measured step time and energy (after
the first step) with the point's prediction.

Straggler: dp=2 x pp=2 under 1f1b with pipeline 1's GPUs capped at 1005 MHz, the straggler alone
(``straggler_window=0``) and with straggler-aware plans (``straggler_window=3``), alternating
``--repeats`` times. It reports the step times side by side and pipeline 0's energy drop, measured
and predicted by the frontier for each run's measured step.

Writes ``DIR/energy_predictions.json`` and logs markdown tables.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "recipes/gpt/train.py"
TOY = ["model=toy", "trainer.per_device_train_batch_size=2", "trainer.disable_tqdm=true",
       "trainer.split_method=farthest_min_deps", "trainer.partition_method=uniform"]
SCHEDULES = ["1f1b", "ds_default", "gpipe", "pre_recompute_1f1b", "last_no_recompute_1f1b", "shifted_critical_path",
             "interleaved_1f1b", "zb_h1"]
PROFILE_MICROBATCHES = {"interleaved_1f1b": 2, "shifted_critical_path": 4}
MICROBATCHES = 8
SPEED: list[float] = []  # the --simulated-tflops value, when one is given (main sets it)

logger = logging.getLogger("energy_predictions")


def _run(command: list[str], log: Path) -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    with open(log, "w") as handle:
        result = subprocess.run(command, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed; see {log}")


def _train(args: list[str], run_dir: Path) -> dict:
    run_dir.mkdir(parents=True, exist_ok=True)
    speed = [f"trainer.simulated_tflops={SPEED[0]}"] if SPEED else []
    _run([sys.executable, str(TRAIN), *TOY, *speed, *args, f"hydra.run.dir={run_dir}"], run_dir / "stdout.log")
    return json.loads((run_dir / "summary.json").read_text())


def _plan(profile: Path, out: Path, schedule: str, stages: int, chunks: int) -> dict:
    _run([sys.executable, "-m", "merak.energy.cli", "plan", str(profile), "--num-stages", str(stages),
          "--num-microbatches", str(MICROBATCHES), "--schedule", schedule, "--num-chunks", str(chunks),
          "--p2p-power", "80", "--out", str(out), "--points", "40"], out.with_suffix(".log"))
    return json.loads((out / "frontier.json").read_text())


def _schedule_args(schedule: str) -> list[str]:
    extra = {"interleaved_1f1b": ["trainer.pipeline_chunks=2"],
             "shifted_critical_path": ["trainer.activation_checkpointing=true",
                                       "trainer.activation_checkpoint_ratio=0.5"]}
    return [f"trainer.train_schedule={schedule}", *extra.get(schedule, [])]


def measure_schedule(schedule: str, out: Path) -> list[dict]:
    """Profile, plan and run ``schedule``; one row per frontier point run."""
    base = out / schedule
    summary = _train(["parallel=pp2", *_schedule_args(schedule), "trainer.profile=true",
                      f"trainer.gradient_accumulation_steps={PROFILE_MICROBATCHES.get(schedule, 1)}",
                      "trainer.num_warmup_steps=1", "trainer.num_prof_steps=1"], base / "profile")
    frontier = _plan(Path(summary["profile"]), base / "plan", schedule, 2, 2 if schedule == "interleaved_1f1b" else 1)
    points = frontier["points"]
    middle = points[len(points) // 2]["iteration_time"]
    rows = []
    for name, extra in (("fastest", []), ("middle", [f"trainer.frontier_deadline={middle}"])):
        run = _train(["parallel=pp2", *_schedule_args(schedule), f"trainer.gradient_accumulation_steps={MICROBATCHES}",
                      "trainer.max_steps=6", f"trainer.frequency_frontier={base / 'plan' / 'frontier.json'}", *extra],
                     base / name)
        rows.append(point_row(schedule, name, run, len(points)))
        logger.info("%s %s: time %+.2f %%, energy %+.2f %%", schedule, name, 100 * rows[-1]["time_error"],
                    100 * rows[-1]["energy_error"])
    return rows


def point_row(schedule: str, name: str, run: dict, num_points: int) -> dict:
    """One table row from a frontier run's summary."""
    pipeline = run["energy"]["pipelines"][0]
    return {"schedule": schedule, "point": name, "index": pipeline["point"], "points": num_points,
            "measured_time_s": pipeline["step_time_s"], "predicted_time_s": pipeline["predicted_step_time_s"],
            "time_error": pipeline["time_error"], "measured_energy_j": pipeline["step_energy_j"],
            "predicted_energy_j": pipeline["predicted_step_energy_j"], "energy_error": pipeline["energy_error"],
            "overruns": sum(r["overruns"] for r in run["energy"]["ranks"])}


def measure_straggler(out: Path, repeats: int) -> dict:
    """The straggler alone vs straggler-aware plans at dp=2 x pp=2, alternating ``repeats`` times."""
    base = out / "straggler"
    summary = _train(["parallel=pp2", "trainer.profile=true", "trainer.gradient_accumulation_steps=1",
                      "trainer.num_warmup_steps=1", "trainer.num_prof_steps=1"], base / "profile")
    frontier = _plan(Path(summary["profile"]), base / "plan", "1f1b", 2, 1)
    common = ["parallel=dp2_pp2", f"trainer.gradient_accumulation_steps={MICROBATCHES}",
              f"trainer.frequency_frontier={base / 'plan' / 'frontier.json'}",
              "trainer.simulated_straggler_pipeline=1", "trainer.simulated_straggler_clock=1005"]
    stages, power = frontier["num_stages"], frontier["p2p_power"]

    def predicted(index: int, step: float) -> float:
        point = frontier["points"][index]
        return point["energy"] + stages * power * max(0.0, step - point["iteration_time"])

    pairs = []
    for repeat in range(repeats):
        alone = _train([*common, "trainer.max_steps=9", "trainer.straggler_window=0"], base / f"alone{repeat}")
        adapted = _train([*common, "trainer.max_steps=13", "trainer.straggler_window=3"], base / f"adapted{repeat}")
        a, b = alone["energy"], adapted["energy"]
        point = b["pipelines"][0]["point"]
        measured_drop = a["pipelines"][0]["step_energy_j"] - b["pipelines"][0]["step_energy_j"]
        predicted_drop = predicted(0, a["iteration_time_s"]) - predicted(point, b["iteration_time_s"])
        pairs.append({"alone_step_s": a["iteration_time_s"], "adapted_step_s": b["iteration_time_s"],
                      "step_ratio": b["iteration_time_s"] / a["iteration_time_s"], "point": point,
                      "switches": b["switches"], "alone_pipeline0_j": a["pipelines"][0]["step_energy_j"],
                      "adapted_pipeline0_j": b["pipelines"][0]["step_energy_j"], "measured_drop_j": measured_drop,
                      "predicted_drop_j": predicted_drop, "drop_error": measured_drop / predicted_drop - 1,
                      "job_energy_alone_j": a["iteration_energy_j"], "job_energy_adapted_j": b["iteration_energy_j"]})
        logger.info("straggler %d: step %.4f -> %.4f s (x%.4f), pipeline 0 point %d, drop %.1f J (predicted %.1f J)",
                    repeat, a["iteration_time_s"], b["iteration_time_s"], pairs[-1]["step_ratio"], point,
                    measured_drop, predicted_drop)
    return {"pairs": pairs, "median_step_ratio": statistics.median(p["step_ratio"] for p in pairs),
            "median_drop_error": statistics.median(p["drop_error"] for p in pairs)}


def tables(rows: list[dict], straggler: dict | None) -> str:
    lines = ["| schedule | point | measured s | predicted s | time error | measured J | predicted J | energy error |"
             " overruns |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['schedule']} | {r['point']} ({r['index']}/{r['points'] - 1}) | {r['measured_time_s']:.4f} "
                     f"| {r['predicted_time_s']:.4f} | {100 * r['time_error']:+.2f} % | {r['measured_energy_j']:.1f} "
                     f"| {r['predicted_energy_j']:.1f} | {100 * r['energy_error']:+.2f} % | {r['overruns']} |")
    if straggler:
        lines += ["", "| repeat | step, straggler alone (s) | step, adapted (s) | ratio | pipeline 0 point | "
                  "pipeline 0 J: alone -> adapted | drop measured / predicted (J) | drop error | job J: alone -> "
                  "adapted |", "|---|---|---|---|---|---|---|---|---|"]
        for i, p in enumerate(straggler["pairs"]):
            lines.append(f"| {i} | {p['alone_step_s']:.4f} | {p['adapted_step_s']:.4f} | {p['step_ratio']:.4f} | "
                         f"{p['point']} | {p['alone_pipeline0_j']:.1f} -> {p['adapted_pipeline0_j']:.1f} | "
                         f"{p['measured_drop_j']:.1f} / {p['predicted_drop_j']:.1f} | {100 * p['drop_error']:+.2f} % | "
                         f"{p['job_energy_alone_j']:.1f} -> {p['job_energy_adapted_j']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/merak-bench-energy-predictions"))
    parser.add_argument("--schedules", nargs="+", default=SCHEDULES, choices=SCHEDULES)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip-schedules", action="store_true")
    parser.add_argument("--skip-straggler", action="store_true")
    parser.add_argument("--simulated-tflops", type=float, default=None,
                        help="the simulated GPU's speed (default: the recipe's, 0.004)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MERAK_CACHE_DIR", str(args.out / "cache"))
    if args.simulated_tflops is not None:
        SPEED.append(args.simulated_tflops)
    rows = [] if args.skip_schedules else [row for s in args.schedules for row in measure_schedule(s, args.out)]
    straggler = None if args.skip_straggler else measure_straggler(args.out, args.repeats)
    (args.out / "energy_predictions.json").write_text(json.dumps({"schedules": rows, "straggler": straggler},
                                                                 indent=1))
    logger.info("results in %s\n%s", args.out / "energy_predictions.json", tables(rows, straggler))


if __name__ == "__main__":
    main()
