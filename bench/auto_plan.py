"""Does the automatic layout planner predict and pick well? Its layouts measured on real recipe runs.

For each recipe:model pair and world size the recipe is planned at a fixed
global batch (``--global-batch``, the same for every layout) as
``parallel=auto`` plans it: ``plan_for_settings`` ranks every layout (cluster
``this``, its rates and link measured in this process), then ``run_trials`` trains the leading
layouts (``--trials``, ``--trial-steps``) and the fastest is the first choice.
The layouts measured are the first choice, the best prediction and the
best-predicted fitting candidate of every (dp, tp, pp) grid. Each trains the
recipe a few times more, each time in a fresh ``recipes/<recipe>/train.py``
subprocess (one thread per process):

* timing runs of ``--steps`` steps, one per pass over the layouts (``--timing-runs``,
  the second pass in the opposite order): the fastest run's median step time past
  the warm-up (the first ``TRIAL_WARMUP`` steps), as a trial times it;
* a memory run of 2 steps with ``trainer.measure_activation_memory=true`` (which
  slows the step, hence its own run): per pipeline stage, parameters +
  gradients + master weights + optimizer state + peak activations (bytes, the
  maximum over the stage's ranks), the quantity the planner predicts.

Each layout's row compares the predicted step time and stage memory with the
measured ones (error = (predicted - measured) / measured), the prediction also
times the trials' scale (their measured over predicted steps, the geometric
mean); each recipe/world says whether the first choice was the measured fastest
(else how much slower it was), the same of the best prediction alone, and the
rank correlation of predicted and measured step times. A run that fails or
times out is recorded with the tail of its output and the benchmark goes on.
The results JSON is rewritten after every recipe/world.

    .venv/bin/python bench/auto_plan.py
    .venv/bin/python bench/auto_plan.py --recipes gpt:toy --worlds 4 --limit 2 --steps 3 --out /tmp/auto_plan.json
    .venv/bin/python bench/auto_plan.py --reprice bench/results/auto_plan_210eb90.json   # the current planner on it
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # first: sets OMP_NUM_THREADS before torch starts threads

from merak.autoplan.cluster import load_cluster
from merak.autoplan.layout import Layout
from merak.autoplan.planner import compose_recipe, plan_for_settings, single_process_settings
from merak.autoplan.trials import TRIAL_STEPS, TRIAL_WARMUP, TRIALS, run_trials, trial_candidates
from merak.runner import run

logger = logging.getLogger("bench.auto_plan")
tables = logging.getLogger("bench.auto_plan.tables")  # the Markdown tables, alone on stdout

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20
MEMORY_FIELDS = ("parameter_bytes", "gradient_bytes", "master_weight_bytes", "optimizer_state_bytes",
                 "peak_activation_bytes")
STEP_TOLERANCE_PCT = 15.0
MEMORY_TOLERANCE_PCT = 10.0
MEMORY_RUN_STEPS = 2
ERROR_TAIL_CHARS = 3000
NOT_MEASURED = "not measured"  # a memory run skipped (--no-memory)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", nargs="+", default=["gpt:toy", "gpt:demo", "bert:toy"], metavar="RECIPE:MODEL",
                        help="recipe:model pairs (recipes/<recipe>/train.py model=<model>)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[4, 8], help="world sizes (processes)")
    parser.add_argument("--steps", type=int, default=10,
                        help="steps of each timing run (the median is over those past the warm-up)")
    parser.add_argument("--timing-runs", type=int, choices=(1, 2), default=2,
                        help="timing runs per layout (2: a second pass in the opposite order; the faster counts)")
    parser.add_argument("--no-memory", dest="memory", action="store_false", help="skip the memory runs")
    parser.add_argument("--global-batch", type=int, default=16, help="trainer.global_batch_size of every layout")
    parser.add_argument("--cluster", default="this", help="plan_recipe's cluster")
    parser.add_argument("--trials", type=int, default=TRIALS,
                        help="layouts the planner tries before choosing (parallel.trials; 0: the best prediction)")
    parser.add_argument("--trial-steps", type=int, default=TRIAL_STEPS, help="steps of each trial")
    parser.add_argument("--limit", type=int, default=None,
                        help="at most this many layouts per recipe/world (the first choice always among them)")
    parser.add_argument("--zero", action="store_true",
                        help="also every grid's best with dp > 1 again with ZeRO-1 (checks ZeRO's pricing: the "
                             "grids' bests seldom shard on CPU)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per training run")
    parser.add_argument("--out", default="bench/results/auto_plan.json", help="results JSON ('' for none)")
    parser.add_argument("--report", metavar="RESULTS_JSON", default=None,
                        help="only print the tables and summary of an earlier run's results JSON")
    parser.add_argument("--reprice", metavar="RESULTS_JSON", default=None,
                        help="price an earlier run's measured layouts with the current planner (nothing trains): "
                             "per recipe/world, the rank correlation with the measured steps and whether the "
                             "measured fastest grid is among those the trials would try")
    args = parser.parse_args(argv)
    args.pairs = [parse_pair(text, parser) for text in args.recipes]
    return args


def parse_pair(text: str, parser: argparse.ArgumentParser) -> tuple[str, str]:
    """``"gpt:toy"`` -> ``("gpt", "toy")``; a recipe without a train.py is a usage error."""
    recipe, sep, model = text.partition(":")
    if not sep or not recipe or not model:
        parser.error(f"--recipes wants recipe:model pairs, got {text!r}")
    if not (REPO / "recipes" / recipe / "train.py").is_file():
        parser.error(f"no recipes/{recipe}/train.py")
    return recipe, model


def setup_output() -> None:
    """Progress on stderr (bench/common.py's format); the Markdown tables as plain lines on stdout."""
    common.setup_logging()
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    tables.addHandler(handler)
    tables.propagate = False


# -- the layouts -----------------------------------------------------------------------------------------------


def layouts_to_measure(report, chosen, limit: int | None, zero: bool = False) -> list:
    """The first choice (the trials' choice), then every grid's best candidate by predicted step time, each
    layout once; with ``zero``, then each of those with dp > 1 and without ZeRO again with ZeRO-1."""
    picked, keys = [], set()
    grid_bests = sorted(report.best_per_grid().values(), key=lambda c: c.predicted_step_s)
    sharded = [report.price(dataclasses.replace(c.layout, zero_stage=1)) for c in grid_bests
               if zero and c.layout.dp > 1 and c.layout.zero_stage == 0]
    for candidate in [chosen, report.best, *grid_bests, *sharded]:
        key = candidate.layout.key()
        if key not in keys:
            keys.add(key)
            picked.append(candidate)
    return picked[:limit] if limit else picked


def describe_candidate(candidate) -> dict:
    """What the planner said about one layout (with its own JSON, breakdown included, where it has one)."""
    layout = candidate.layout
    described = {"key": layout.key(), "overrides": list(layout.overrides()), "fits": bool(candidate.fits),
                 "grid": [layout.dp, layout.tp, layout.pp], "predicted_step_s": float(candidate.predicted_step_s),
                 "predicted_stage_memory": [int(b) for b in candidate.predicted_stage_memory]}
    if callable(getattr(candidate, "to_json", None)):
        described["planner"] = candidate.to_json()
    return described


# -- the training runs -----------------------------------------------------------------------------------------


def override_key(override: str) -> str:
    """The config key an override sets (``+a.b=1`` -> ``a.b``)."""
    return override.split("=", 1)[0].lstrip("+~")


def merge_overrides(*groups: list[str]) -> list[str]:
    """The overrides in order, a later value of the same key replacing the earlier one in place."""
    merged: dict[str, str] = {}
    for group in groups:
        for override in group:
            merged[override_key(override)] = override
    return list(merged.values())


def run_overrides(layout, model: str, global_batch: int, steps: int, run_dir: str, *, memory: bool) -> list[str]:
    """Hydra overrides that train ``layout`` for ``steps`` steps into ``run_dir``."""
    ours = [f"model={model}", f"trainer.global_batch_size={global_batch}", f"trainer.max_steps={steps}",
            "trainer.save=false", "trainer.disable_tqdm=true", "trainer.logging_steps=1",
            f"trainer.measure_activation_memory={str(memory).lower()}", f"hydra.run.dir={run_dir}"]
    return merge_overrides(list(layout.overrides()), ours)


def text_of(output: str | bytes | None) -> str:
    """Captured output as text (a timed-out run's is bytes)."""
    if output is None:
        return ""
    return output.decode(errors="replace") if isinstance(output, bytes) else output


def run_recipe(recipe: str, overrides: list[str], timeout: int) -> dict:
    """One ``train.py`` run in its own process group: its summary.json, or the error and its output's tail."""
    command = [sys.executable, str(REPO / "recipes" / recipe / "train.py"), *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    started = time.perf_counter()
    with subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, start_new_session=True) as process:
        try:
            output, _ = process.communicate(timeout=timeout)
            error = None if process.returncode == 0 else f"exit status {process.returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the run's workers too
            output, _ = process.communicate()
            error = f"timed out after {timeout} s"
    record = {"command": shlex.join(["recipes/" + recipe + "/train.py", *overrides]),
              "wall_s": time.perf_counter() - started, "error": error}
    summary_path = Path(override_value(overrides, "hydra.run.dir")) / "summary.json"
    if error is None and not summary_path.is_file():
        record["error"] = "no summary.json"
    if record["error"] is not None:
        record["output_tail"] = text_of(output)[-ERROR_TAIL_CHARS:]
        logger.warning("%s: %s\n%s", record["command"], record["error"], record["output_tail"][-1000:])
        return record
    record["summary"] = json.loads(summary_path.read_text())
    return record


def override_value(overrides: list[str], key: str) -> str:
    """The value ``overrides`` give ``key``."""
    return next(o.split("=", 1)[1] for o in overrides if override_key(o) == key)


def timing_run(recipe: str, model: str, candidate, args: argparse.Namespace) -> dict:
    """The layout's step times (``step_times_s``) and their median past the first ``TRIAL_WARMUP`` steps
    (``median_step_s``, as a trial times it), or the error."""
    with tempfile.TemporaryDirectory(prefix="auto_plan_") as run_dir:
        overrides = run_overrides(candidate.layout, model, args.global_batch, args.steps, run_dir, memory=False)
        record = run_recipe(recipe, overrides, args.timeout)
        summary = record.pop("summary", None)
        if summary is not None:
            times = [json.loads(line)["step_time_s"] for line in
                     (Path(run_dir) / "metrics.jsonl").read_text(encoding="utf-8").splitlines() if line.strip()]
            record["step_times_s"] = times
            record["median_step_s"] = statistics.median(times[TRIAL_WARMUP:] or times)
            record["num_microbatches"] = summary.get("num_microbatches")
    return record


def fastest_run(records: list[dict]) -> dict:
    """The timing runs of one layout as one record: ``median_step_s`` of the fastest run (a run's level varies
    by several percent from run to run, and the machine's noise only ever adds time), every run kept."""
    timed = [r for r in records if r.get("median_step_s") is not None]
    if not timed:
        return {**records[0], "runs": records}
    return {**min(timed, key=lambda r: r["median_step_s"]), "runs": records}


def stage_memory(stage: dict) -> int | None:
    """Parameters + gradients + master weights + optimizer state + peak activations of one stage (bytes)."""
    values = [stage.get(field) for field in MEMORY_FIELDS]
    return None if any(v is None for v in values) else int(sum(values))


def memory_run(recipe: str, model: str, candidate, args: argparse.Namespace) -> dict:
    """The layout's measured memory per stage (``stage_memory``) and peak RSS, or the error."""
    with tempfile.TemporaryDirectory(prefix="auto_plan_") as run_dir:
        overrides = run_overrides(candidate.layout, model, args.global_batch, MEMORY_RUN_STEPS, run_dir,
                                  memory=True)
        record = run_recipe(recipe, overrides, args.timeout)
    summary = record.pop("summary", None)
    if summary is None:
        return record
    stages = summary["stages"]
    record["stage_memory"] = [stage_memory(s) for s in stages]
    record["stage_parts"] = [{field: s.get(field) for field in MEMORY_FIELDS} for s in stages]
    record["peak_rss_bytes"] = [s.get("peak_rss_bytes") for s in stages]
    if any(m is None for m in record["stage_memory"]):
        record["error"] = "a stage without every memory field (peak_activation_bytes not measured?)"
    return record


# -- comparison ------------------------------------------------------------------------------------------------


def error_pct(predicted: float | None, measured: float | None) -> float | None:
    """(predicted - measured) / measured in percent; None without both, or with nothing measured."""
    if predicted is None or not measured:
        return None
    return 100.0 * (predicted - measured) / measured


def stage_errors(predicted: list[int], measured: list[int] | None) -> list[float] | None:
    """Per-stage memory errors (%), None when the stage counts differ or a stage is missing."""
    if not measured or len(predicted) != len(measured) or any(m is None for m in measured):
        return None
    return [error_pct(p, m) for p, m in zip(predicted, measured)]


def compare(recipe: str, model: str, world: int, candidate, timing: dict, memory: dict) -> dict:
    """One layout's row: predicted against measured step time and stage memory."""
    planned = describe_candidate(candidate)
    measured_step = timing.get("median_step_s")
    measured_memory = memory.get("stage_memory") if memory.get("error") is None else None
    predicted_max = max(planned["predicted_stage_memory"], default=None)
    measured_max = max(measured_memory) if measured_memory else None
    per_stage = stage_errors(planned["predicted_stage_memory"], measured_memory)
    return {"recipe": recipe, "model": model, "world": world, **planned,
            "measured_step_s": measured_step,
            "step_error_pct": error_pct(planned["predicted_step_s"], measured_step),
            "predicted_max_stage_bytes": predicted_max, "measured_max_stage_bytes": measured_max,
            "memory_error_pct": error_pct(predicted_max, measured_max),
            "stage_memory_errors_pct": per_stage,
            "max_abs_stage_memory_error_pct": max((abs(e) for e in per_stage or () if e is not None), default=None),
            "timing_run": timing, "memory_run": memory}


def ranks(values: list[float]) -> list[float]:
    """Ranks from 1, ties sharing their average rank."""
    order = sorted(range(len(values)), key=values.__getitem__)
    result = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for position in range(start, end + 1):
            result[order[position]] = (start + end) / 2 + 1
        start = end + 1
    return result


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rank correlation; None with fewer than 3 pairs or a constant side."""
    if len(xs) < 3:
        return None
    rx, ry = ranks(xs), ranks(ys)
    mean = (len(xs) + 1) / 2
    cov = sum((a - mean) * (b - mean) for a, b in zip(rx, ry))
    var = (sum((a - mean) ** 2 for a in rx) * sum((b - mean) ** 2 for b in ry)) ** 0.5
    return cov / var if var else None


def first_choice_check(rows: list[dict], best_key: str) -> dict:
    """Whether the first choice was the measured fastest of the layouts measured, else how much slower."""
    timed = [r for r in rows if r["measured_step_s"] is not None]
    check = {"first_choice": best_key, "layouts_timed": len(timed), "measured_fastest": None,
             "first_choice_is_fastest": None, "first_choice_slower_pct": None,
             "rank_correlation": spearman([r["predicted_step_s"] for r in timed],
                                          [r["measured_step_s"] for r in timed])}
    if not timed:
        return check
    fastest = min(timed, key=lambda r: r["measured_step_s"])
    check["measured_fastest"] = fastest["key"]
    best = next((r for r in timed if r["key"] == best_key), None)
    if best is not None:
        check["first_choice_is_fastest"] = best["key"] == fastest["key"]
        check["first_choice_slower_pct"] = error_pct(best["measured_step_s"], fastest["measured_step_s"])
    return check


# -- one recipe/world ------------------------------------------------------------------------------------------


def plan(recipe: str, model: str, world: int, args: argparse.Namespace):
    """The planner's report for the recipe at this world size and global batch, and its trials (as
    ``parallel=auto`` runs them: the leading layouts trained in this process's workers)."""
    started = time.perf_counter()
    spec, cfg = compose_recipe(recipe, [f"model={model}", f"trainer.global_batch_size={args.global_batch}"])
    cluster = load_cluster(args.cluster, processes=world)
    report = plan_for_settings(spec, single_process_settings(spec, cfg), world_size=world, cluster=cluster,
                               global_batch_size=args.global_batch)
    planned = time.perf_counter()
    outcome = run_trials(report.candidates, cfg, lambda trial: run(spec, trial), count=args.trials,
                         steps=args.trial_steps)
    logger.info("%s:%s world %d: planned in %.1f s, %d candidates (%d fit), %d grids, best predicted %s; "
                "%d trials in %.1f s chose %s", recipe, model, world, planned - started, len(report.candidates),
                sum(bool(c.fits) for c in report.candidates), len(report.best_per_grid()), report.best.layout.key(),
                len(outcome.trials), time.perf_counter() - planned, outcome.chosen.layout.key())
    return report, outcome, cluster


def measure_group(recipe: str, model: str, world: int, args: argparse.Namespace) -> dict:
    """Plan one recipe/world, run its layouts, compare."""
    try:
        report, outcome, cluster = plan(recipe, model, world, args)
    except Exception as error:  # a planner failure is a result: the other recipes/worlds go on
        logger.exception("%s:%s world %d: planning failed", recipe, model, world)
        return {"recipe": recipe, "model": model, "world": world, "error": f"planning failed: {error!r}",
                "rows": []}
    layouts = layouts_to_measure(report, outcome.chosen, args.limit, args.zero)
    scale = outcome.step_scale
    trialled = {t.candidate.layout.key(): t.measured_step_s for t in outcome.trials}
    timings = {}
    memories = {}
    for index, candidate in enumerate(layouts, 1):
        logger.info("%s:%s world %d: layout %d/%d %s", recipe, model, world, index, len(layouts),
                    candidate.layout.key())
        timings[index] = [timing_run(recipe, model, candidate, args)]
        memories[index] = memory_run(recipe, model, candidate, args) if args.memory else {"error": NOT_MEASURED}
    for index in reversed(range(1, len(layouts) + 1 if args.timing_runs > 1 else 1)):
        logger.info("%s:%s world %d: layout %d/%d %s again", recipe, model, world, index, len(layouts),
                    layouts[index - 1].layout.key())
        timings[index].append(timing_run(recipe, model, layouts[index - 1], args))
    rows = []
    for index, candidate in enumerate(layouts, 1):
        row = compare(recipe, model, world, candidate, fastest_run(timings[index]), memories[index])
        row["trial_step_s"] = trialled.get(row["key"])
        row["scaled_step_error_pct"] = (None if scale is None
                                        else error_pct(scale * row["predicted_step_s"], row["measured_step_s"]))
        rows.append(row)
        log_row(rows[-1])
    predicted_best = first_choice_check(rows, report.best.layout.key())
    return {"recipe": recipe, "model": model, "world": world, "error": None,
            "candidates": len(report.candidates), "fitting": sum(bool(c.fits) for c in report.candidates),
            "grids": len(report.best_per_grid()), "trials": outcome.to_json(), "step_scale": scale,
            "best_predicted": report.best.layout.key(),
            "best_predicted_is_fastest": predicted_best["first_choice_is_fastest"],
            "best_predicted_slower_pct": predicted_best["first_choice_slower_pct"],
            "rows": rows, **first_choice_check(rows, outcome.chosen.layout.key()),
            "measured_on": {"cluster": cluster.to_json()}}  # the rates and link the planner measured


def log_row(row: dict) -> None:
    """One layout's numbers, as soon as they are measured."""
    logger.info("  %s: step predicted %s ms, measured %s ms (%s %%; recalibrated %s ms, %s %%); max stage memory "
                "predicted %s MiB, measured %s MiB (%s %%)", row["key"], ms(row["predicted_step_s"]),
                ms(row["measured_step_s"]), pct(row["step_error_pct"]), ms(row.get("recalibrated_step_s")),
                pct(row.get("recalibrated_step_error_pct")), mib(row["predicted_max_stage_bytes"]),
                mib(row["measured_max_stage_bytes"]), pct(row["memory_error_pct"]))


# -- output ----------------------------------------------------------------------------------------------------


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.1f}"


def mib(count: float | None) -> str:
    return "-" if count is None else f"{count / MIB:.1f}"


def pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1f}"


def row_note(row: dict, group: dict) -> str:
    """First choice / measured fastest marks, or the failed runs' errors."""
    notes = []
    if row["key"] == group.get("first_choice"):
        notes.append("first choice")
    if row["key"] == group.get("best_predicted") and row["key"] != group.get("first_choice"):
        notes.append("best predicted")
    if row["key"] == group.get("measured_fastest"):
        notes.append("fastest")
    if not row["fits"]:
        notes.append("predicted not to fit")
    for name in ("timing_run", "memory_run"):
        if row[name].get("error") and row[name]["error"] != NOT_MEASURED:
            notes.append(f"{name.split('_')[0]} run: {row[name]['error']}")
    return ", ".join(notes)


def group_table(group: dict) -> str:
    """The Markdown table of one recipe/world, with its first-choice line."""
    title = f"### {group['recipe']}:{group['model']}, world {group['world']}"
    if group.get("error"):
        return f"{title}\n\n{group['error']}"
    header = ["layout", "pred step (ms)", "meas step (ms)", "err %", "err % x trial scale", "trial (ms)",
              "pred step recalibrated (ms)", "err %", "pred max stage (MiB)", "meas max stage (MiB)", "err %",
              "stage max |err| %", "note"]
    rows = [[r["key"], ms(r["predicted_step_s"]), ms(r["measured_step_s"]), pct(r["step_error_pct"]),
             pct(r.get("scaled_step_error_pct")), ms(r.get("trial_step_s")),
             ms(r.get("recalibrated_step_s")), pct(r.get("recalibrated_step_error_pct")),
             mib(r["predicted_max_stage_bytes"]), mib(r["measured_max_stage_bytes"]), pct(r["memory_error_pct"]),
             "-" if r["max_abs_stage_memory_error_pct"] is None else f"{r['max_abs_stage_memory_error_pct']:.1f}",
             row_note(r, group)] for r in group["rows"]]
    return f"{title}\n\n{common.format_table(header, rows)}\n\n{first_choice_line(group)}"


def first_choice_line(group: dict) -> str:
    """Whether the first choice was the measured fastest, and the rank correlation."""
    rho = group["rank_correlation"]
    corr = "-" if rho is None else f"{rho:.2f}"
    if group["first_choice_is_fastest"] is None:
        verdict = "first choice not timed"
    elif group["first_choice_is_fastest"]:
        verdict = "first choice is the measured fastest"
    else:
        verdict = (f"first choice is {group['first_choice_slower_pct']:.1f} % slower than the measured fastest "
                   f"({group['measured_fastest']})")
    predicted = group.get("best_predicted_is_fastest")
    if predicted is not None and group.get("best_predicted") != group["first_choice"]:
        verdict += (" (the best prediction alone would have been the fastest)" if predicted else
                    f" (the best prediction alone: {group['best_predicted_slower_pct']:.1f} % slower)")
    scale = group.get("step_scale")
    verdict += "" if scale is None else f"; trial scale {scale:.2f}"
    return f"{verdict}; {group['candidates']} candidates, {group['fitting']} fit, {group['grids']} grids, " \
           f"{len(group['rows'])} layouts measured; rank correlation predicted/measured step: {corr}"


def share(values: list[float | None], tolerance: float) -> dict:
    """How many of the known values are within ``tolerance`` in absolute value."""
    known = [abs(v) for v in values if v is not None]
    within = sum(v <= tolerance for v in known)
    return {"within": within, "of": len(known), "share": within / len(known) if known else None,
            "tolerance_pct": tolerance}


def summarize(groups: list[dict]) -> dict:
    """Over every layout and every recipe/world: error shares and the first-choice check."""
    rows = [r for g in groups for r in g["rows"]]
    checked = [g for g in groups if g.get("first_choice_is_fastest") is not None]
    slower = [g["first_choice_slower_pct"] for g in checked if not g["first_choice_is_fastest"]]
    predicted = [g for g in groups if g.get("best_predicted_is_fastest") is not None]
    predicted_slower = [g["best_predicted_slower_pct"] for g in predicted if not g["best_predicted_is_fastest"]]
    return {"step_time": share([r["step_error_pct"] for r in rows], STEP_TOLERANCE_PCT),
            "step_time_recalibrated": share([r.get("recalibrated_step_error_pct") for r in rows],
                                            STEP_TOLERANCE_PCT),
            "step_time_trial_scaled": share([r.get("scaled_step_error_pct") for r in rows], STEP_TOLERANCE_PCT),
            "step_time_trial_scaled_untried": share([r.get("scaled_step_error_pct") for r in rows
                                                     if r.get("trial_step_s") is None], STEP_TOLERANCE_PCT),
            "first_choice_within_5pct": sum(bool(g["first_choice_is_fastest"]) or (g["first_choice_slower_pct"] or 0)
                                            <= 5.0 for g in checked),
            "best_predicted_fastest": sum(bool(g["best_predicted_is_fastest"]) for g in predicted),
            "best_predicted_worst_slower_pct": max(predicted_slower, default=None),
            "max_stage_memory": share([r["memory_error_pct"] for r in rows], MEMORY_TOLERANCE_PCT),
            "every_stage_memory": share([r["max_abs_stage_memory_error_pct"] for r in rows], MEMORY_TOLERANCE_PCT),
            "first_choice_fastest": sum(bool(g["first_choice_is_fastest"]) for g in checked),
            "first_choice_checked": len(checked), "first_choice_worst_slower_pct": max(slower, default=None),
            "groups_failed": sum(bool(g.get("error")) for g in groups)}


def summary_text(summary: dict) -> str:
    """The summary as a few Markdown lines."""
    def line(name: str, part: dict) -> str:
        ratio = "-" if part["share"] is None else f"{100 * part['share']:.0f} %"
        return f"- {name} within {part['tolerance_pct']:.0f} %: {part['within']}/{part['of']} ({ratio})"

    worst = summary["first_choice_worst_slower_pct"]
    return "\n".join([
        "### Summary", "",
        line("step time", summary["step_time"]),
        line("step time x the trials' scale", summary["step_time_trial_scaled"]),
        line("the same, layouts not tried", summary["step_time_trial_scaled_untried"]),
        line("step time priced on a calibration timed right before the layout's runs",
             summary.get("step_time_recalibrated") or share([], STEP_TOLERANCE_PCT)),
        line("max stage memory", summary["max_stage_memory"]),
        line("every stage's memory", summary["every_stage_memory"]),
        f"- first choice the measured fastest: {summary['first_choice_fastest']}/{summary['first_choice_checked']}"
        + ("" if worst is None else f" (worst: {worst:.1f} % slower)")
        + f"; within 5 % of it: {summary['first_choice_within_5pct']}/{summary['first_choice_checked']}",
        f"- the best prediction alone the measured fastest: {summary['best_predicted_fastest']}/"
        f"{summary['first_choice_checked']}" + ("" if summary["best_predicted_worst_slower_pct"] is None
                                                else f" (worst: {summary['best_predicted_worst_slower_pct']:.1f} % "
                                                     "slower)"),
        f"- recipe/worlds whose planning failed: {summary['groups_failed']}"])


def payload(args: argparse.Namespace, command: list[str], facts: dict, groups: list[dict]) -> dict:
    """The results JSON."""
    options = {k: v for k, v in vars(args).items() if k != "pairs"}
    return {"benchmark": "auto_plan", "command": shlex.join(command), "args": options, "machine": facts,
            "groups": groups, "summary": summarize(groups)}


def main(argv=None) -> int:
    args = parse_args(argv)
    command = ["bench/auto_plan.py", *(sys.argv[1:] if argv is None else argv)]
    setup_output()
    if args.report:
        results = json.loads(Path(args.report).read_text(encoding="utf-8"))
        print_tables(results["groups"], results["args"], results["machine"])
        return 0
    if args.reprice:
        reprice(json.loads(Path(args.reprice).read_text(encoding="utf-8")), args)
        return 0
    facts = common.machine_facts()
    logger.info("%s", common.format_facts(facts))
    groups = []
    for recipe, model in args.pairs:
        for world in args.worlds:
            groups.append(measure_group(recipe, model, world, args))
            common.write_json(args.out, payload(args, command, facts, groups))
    print_tables(groups, vars(args), facts)
    return 0


def reprice(results: dict, args: argparse.Namespace) -> None:
    """Each recipe/world of ``results`` planned again now, its measured layouts priced by the current planner."""
    tables.info("| recipe | world | rank correlation, then | now | measured fastest grid | grids the trials "
                "would try now | among them |\n|---|---|---|---|---|---|---|")
    for group in (g for g in results["groups"] if not g.get("error")):
        rows = [r for r in group["rows"] if r.get("measured_step_s") is not None]
        spec, cfg = compose_recipe(group["recipe"], [f"model={group['model']}",
                                                     f"trainer.global_batch_size={results['args']['global_batch']}"])
        report = plan_for_settings(spec, single_process_settings(spec, cfg), world_size=group["world"],
                                   cluster=load_cluster(args.cluster, processes=group["world"]),
                                   global_batch_size=results["args"]["global_batch"])
        now = [report.price(Layout.from_json(r["planner"]["layout"])).predicted_step_s for r in rows]
        fastest = tuple(min(rows, key=lambda r: r["measured_step_s"])["grid"])
        tried = [c.layout.grid for c in trial_candidates(report.candidates, args.trials)]
        measured = [r["measured_step_s"] for r in rows]
        tables.info("| %s:%s | %d | %.2f | %.2f | %s | %s | %s |", group["recipe"], group["model"], group["world"],
                    spearman([r["predicted_step_s"] for r in rows], measured), spearman(now, measured),
                    "x".join(map(str, fastest)), ", ".join("x".join(map(str, g)) for g in tried),
                    "yes" if fastest in tried else "no")


def print_tables(groups: list[dict], options: dict, facts: dict) -> None:
    """Every recipe/world's Markdown table and the summary, on stdout."""
    tables.info("planner check, global batch %d, %d timed steps per layout, cluster %s", options["global_batch"],
                options["steps"], options["cluster"])
    tables.info("%s\n", common.format_facts(facts))
    for group in groups:
        tables.info("%s\n", group_table(group))
    tables.info("%s", summary_text(summarize(groups)))


if __name__ == "__main__":
    sys.exit(main())
