"""The current cost model against the step times and stage memory ``auto_plan.py`` measured earlier.

Measuring every layout of every recipe/world takes most of an hour; pricing them again takes a
minute or two per recipe/world (profiles are cached, the calibration runs afresh). For each
recipe/world of a results file (``auto_plan.py --out``) this plans the recipe as that run did
(cluster ``this``, calibrated here and now, ``--repeats`` times: each calibration is a fresh
measurement on a shared machine) and prices the file's layouts with
``PlanReport.price``: the prediction of each against the step and the stage memory measured then.
Only the planner may have changed since the measurements: the training code must be the one that
ran them.

A group whose sweep recorded what its planner measured (``measured_on``) is priced first on that, unless
``--calibrations`` holds its own or ``--fresh`` asks for a new measurement (what the sweep recorded lacks
what the calibration measures since). ``--calibrations FILE`` keeps the measurements (the calibration, and
the cluster's rates and link, also timed each time): the first run writes them, later runs price with
the same ones, so that two versions of the cost model are compared on the same measurements (a fresh
calibration moves a prediction by up to tens of percent on a shared machine).

Rows a sweep priced again on a calibration timed right before their runs (``auto_plan.py --recalibrate``:
``recalibrated_on``) are priced on that one too (``recalibrated_step_s``).

Reported per recipe/world and overall: how many predicted steps lie within 15 % of the measured,
how many fullest stages within 10 % (and layouts with every stage within 10 %), and how far apart the
repeats put each layout (the spread due to the calibration alone).

    .venv/bin/python bench/auto_plan_repriced.py [--against bench/results/auto_plan.json ...] [--repeats 2]
                                                 [--recipes gpt:toy] [--worlds 4] [--out FILE]
                                                 [--calibrations FILE] [--fresh] [--without FIELD ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # first: sets OMP_NUM_THREADS before torch starts threads
from auto_plan import MEMORY_TOLERANCE_PCT, STEP_TOLERANCE_PCT, error_pct, measurement_json, stage_errors

from merak.autoplan.calibrate import Calibration
from merak.autoplan.cluster import Cluster, load_cluster
from merak.autoplan.layout import Layout
from merak.autoplan.planner import compose_recipe, plan_for_settings, single_process_settings

logger = logging.getLogger("bench.auto_plan_repriced")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", nargs="+", default=["bench/results/auto_plan.json"],
                        help="auto_plan.py results JSONs (a later file's recipe/world replaces an earlier's)")
    parser.add_argument("--repeats", type=int, default=2, help="plans (calibrations) per recipe/world")
    parser.add_argument("--recipes", nargs="+", default=None, metavar="RECIPE:MODEL", help="only these pairs")
    parser.add_argument("--worlds", type=int, nargs="+", default=None, help="only these world sizes")
    parser.add_argument("--out", default="bench/results/auto_plan_repriced.json", help="results JSON ('' for none)")
    parser.add_argument("--calibrations", default=None,
                        help="a JSON of calibrations: used when it exists, else written with this run's")
    parser.add_argument("--fresh", action="store_true",
                        help="calibrate afresh rather than on what the sweep recorded (--calibrations still wins)")
    parser.add_argument("--without", nargs="+", default=[], metavar="FIELD",
                        help="price as if the recorded calibrations lacked these fields (e.g. lone_collectives: "
                             "the cost model's fallback, as before the field was timed)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    unknown = set(args.without) - {field.name for field in dataclasses.fields(Calibration)}
    if unknown:
        parser.error(f"--without: not fields of a calibration: {', '.join(sorted(unknown))}")
    return args


def selected(group: dict, args: argparse.Namespace) -> bool:
    pair = f"{group['recipe']}:{group['model']}"
    return (not group.get("error") and (args.recipes is None or pair in args.recipes)
            and (args.worlds is None or group["world"] in args.worlds))


def reprice(group: dict, global_batch: int, measured: tuple[Cluster, Calibration] | None, without=()
            ) -> tuple[list[dict], tuple[Cluster, Calibration]]:
    """One plan of the group's recipe/world (measured afresh, or on ``measured``: a cluster and a calibration);
    each measured layout priced by it; and what it was measured on."""
    overrides = [f"model={group['model']}", f"trainer.global_batch_size={global_batch}"]
    spec, cfg = compose_recipe(group["recipe"], overrides)
    cluster, calibration = measured or (load_cluster("this", processes=group["world"]), True)
    report = plan_for_settings(spec, single_process_settings(spec, cfg), world_size=group["world"],
                               cluster=cluster, global_batch_size=global_batch, calibrate=calibration)
    priced = []
    for row in group["rows"]:
        candidate = report.price(Layout(**row["planner"]["layout"]))
        stage_memory = list(candidate.prediction.stage_memory)
        measured_memory = (row.get("memory_run") or {}).get("stage_memory")
        again = None
        if row.get("recalibrated_on"):  # priced again on the calibration timed before the layout's runs
            again = report.on_calibration(_measurement(row["recalibrated_on"], without)[1]).price(
                candidate.layout).predicted_step_s
        priced.append({"key": row["key"], "predicted_step_s": candidate.predicted_step_s,
                       "measured_step_s": row["measured_step_s"],
                       "step_error_pct": error_pct(candidate.predicted_step_s, row["measured_step_s"]),
                       "recalibrated_step_s": again,
                       "recalibrated_step_error_pct": error_pct(again, row["measured_step_s"]),
                       "breakdown": candidate.prediction.breakdown,
                       "predicted_max_stage_bytes": max(stage_memory),
                       "measured_max_stage_bytes": max(measured_memory) if measured_memory else None,
                       "memory_error_pct": error_pct(max(stage_memory),
                                                     max(measured_memory) if measured_memory else None),
                       "max_abs_stage_memory_error_pct": max(
                           (abs(e) for e in stage_errors(stage_memory, measured_memory) or () if e is not None),
                           default=None)})
    return priced, (cluster, report.cost_model.calibration)


def load_measurements(path: str | None) -> dict[str, list[tuple[Cluster, Calibration]]]:
    """(cluster, calibration) by ``recipe:model:world``, one per repeat, from ``path`` if it exists."""
    if path is None or not Path(path).exists():
        return {}
    saved = json.loads(Path(path).read_text(encoding="utf-8"))
    return {key: [_measurement(entry) for entry in repeats] for key, repeats in saved.items()}


def sweep_measurements(group: dict, without=()) -> list[tuple[Cluster, Calibration]]:
    """The cluster and calibration the sweep planned this group with, if it recorded them."""
    return [_measurement(group["measured_on"], without)] if group.get("measured_on") else []


def _measurement(saved: dict, without=()) -> tuple[Cluster, Calibration]:
    """A saved cluster and calibration (:func:`auto_plan.measurement_json`). A calibration saved before these
    were kept: the split backward's microbatch was the second of its sizes, and the gradients' reduction
    was timed among all its processes only (``gradient_all_reduce_s``)."""
    calibration = {name: value for name, value in saved["calibration"].items() if name not in without}
    sizes = [size for size, _ in calibration["size_factors"]]
    calibration.setdefault("split_backward_micro_batch", sizes[min(1, len(sizes) - 1)] if sizes else 1)
    whole = calibration.pop("gradient_all_reduce_s", None)
    if whole is not None:
        calibration.setdefault("gradient_all_reduces", [(calibration["processes"], whole)])
    return Cluster.from_json(saved["cluster"]), Calibration(**{
        **calibration, "size_factors": tuple(map(tuple, calibration["size_factors"])),
        "gradient_all_reduces": tuple(map(tuple, calibration.get("gradient_all_reduces", ()))),
        "zero_step_differences": tuple(map(tuple, calibration.get("zero_step_differences", ()))),
        "microbatch_load_seconds": tuple(map(tuple, calibration.get("microbatch_load_seconds", ()))),
        "busy_collectives": tuple(map(tuple, calibration.get("busy_collectives", ()))),
        "lone_collectives": tuple(map(tuple, calibration.get("lone_collectives", ())))})


def measured_groups(paths: list[str]) -> dict:
    """The sweeps' results as one: their groups by recipe/model/world, a later file's replacing an earlier's
    in its place (a recipe measured again); every file must share the first's global batch."""
    args, groups = None, {}
    for path in paths:
        results = json.loads(Path(path).read_text(encoding="utf-8"))
        if args is not None and results["args"]["global_batch"] != args["global_batch"]:
            raise SystemExit(f"{path}: global batch {results['args']['global_batch']}, the first file's is "
                             f"{args['global_batch']}")
        args = args or results["args"]
        groups.update({(g["recipe"], g["model"], g["world"]): g for g in results["groups"]})
    return {"args": args, "groups": list(groups.values())}


def within(errors: list[float | None], tolerance: float) -> tuple[int, int]:
    known = [e for e in errors if e is not None]
    return sum(abs(e) <= tolerance for e in known), len(known)


def group_summary(repeats: list[list[dict]]) -> dict:
    """Per repeat the shares within tolerance; per layout the spread of its predictions over the repeats."""
    spreads = [max(r["predicted_step_s"] for r in rows) / min(r["predicted_step_s"] for r in rows) - 1
               for rows in zip(*repeats)]
    return {"step_within": [within([r["step_error_pct"] for r in rows], STEP_TOLERANCE_PCT) for rows in repeats],
            "recalibrated_step_within": within([r["recalibrated_step_error_pct"] for r in repeats[0]],
                                               STEP_TOLERANCE_PCT),
            "memory_within": within([r["memory_error_pct"] for r in repeats[0]], MEMORY_TOLERANCE_PCT),
            "every_stage_memory_within": within([r["max_abs_stage_memory_error_pct"] for r in repeats[0]],
                                                MEMORY_TOLERANCE_PCT),
            "median_abs_step_error_pct": [statistics.median(abs(r["step_error_pct"]) for r in rows)
                                          for rows in repeats],
            "largest_spread_pct": 100 * max(spreads, default=0.0)}


def main(argv=None) -> int:
    args = parse_args(argv)
    common.setup_logging()
    earlier = measured_groups(args.against)
    global_batch = earlier["args"]["global_batch"]
    saved = load_measurements(args.calibrations)
    used: dict[str, list[tuple[Cluster, Calibration]]] = {}
    groups = []
    for group in (g for g in earlier["groups"] if selected(g, args)):
        name = f"{group['recipe']}:{group['model']} world {group['world']}"
        repeats = []
        key = f"{group['recipe']}:{group['model']}:{group['world']}"
        given = saved.get(key) or ([] if args.fresh else sweep_measurements(group, args.without))
        for repeat in range(args.repeats):
            started = time.perf_counter()
            priced, measured = reprice(group, global_batch, given[repeat] if repeat < len(given) else None,
                                       args.without)
            repeats.append(priced)
            used.setdefault(key, []).append(measured)
            hits, count = within([r["step_error_pct"] for r in repeats[-1]], STEP_TOLERANCE_PCT)
            logger.info("%s, repeat %d: %d of %d steps within %.0f %% (%.0f s)", name, repeat + 1, hits, count,
                        STEP_TOLERANCE_PCT, time.perf_counter() - started)
        groups.append({"recipe": group["recipe"], "model": group["model"], "world": group["world"],
                       "repeats": repeats, **group_summary(repeats)})
    totals = {"step_within": [tuple(map(sum, zip(*(g["step_within"][k] for g in groups))))
                              for k in range(args.repeats)],
              "recalibrated_step_within": tuple(map(sum, zip(*(g["recalibrated_step_within"] for g in groups)))),
              "memory_within": tuple(map(sum, zip(*(g["memory_within"] for g in groups)))),
              "every_stage_memory_within": tuple(map(sum, zip(*(g["every_stage_memory_within"] for g in groups))))}
    for g in groups:
        print(f"{g['recipe']}:{g['model']} world {g['world']}: steps within {STEP_TOLERANCE_PCT:.0f} % "
              f"{', '.join(f'{a}/{b}' for a, b in g['step_within'])} (median |error| "
              f"{', '.join(f'{e:.1f}' for e in g['median_abs_step_error_pct'])} %), the repeats up to "
              f"{g['largest_spread_pct']:.1f} % apart; recalibrated "
              f"{g['recalibrated_step_within'][0]}/{g['recalibrated_step_within'][1]}; "
              f"fullest stage within {MEMORY_TOLERANCE_PCT:.0f} % "
              f"{g['memory_within'][0]}/{g['memory_within'][1]}, every stage "
              f"{g['every_stage_memory_within'][0]}/{g['every_stage_memory_within'][1]}")
    if args.calibrations and not saved:
        common.write_json(args.calibrations, {
            key: [measurement_json(cluster, calibration) for cluster, calibration in measured]
            for key, measured in used.items()})
    hits, count = totals["memory_within"]
    again_hits, again_count = totals["recalibrated_step_within"]
    print(f"all: steps within {STEP_TOLERANCE_PCT:.0f} % {', '.join(f'{a}/{b}' for a, b in totals['step_within'])} "
          f"(recalibrated: {again_hits}/{again_count}); "
          f"fullest stage within {MEMORY_TOLERANCE_PCT:.0f} % {hits}/{count}, every stage "
          f"{'/'.join(map(str, totals['every_stage_memory_within']))}")
    common.write_json(args.out, {"benchmark": "auto_plan_repriced", "against": args.against,
                                 "command": " ".join(sys.argv), "machine": common.machine_facts(),
                                 "groups": groups, "totals": totals})
    return 0


if __name__ == "__main__":
    sys.exit(main())
