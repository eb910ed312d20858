"""``merak-energy``: plan per-instruction clocks from a profile, and serve plans to zeus.

    merak-energy plan PROFILE.csv --num-stages S --num-microbatches M --schedule 1f1b \\
        --p2p-power 80 --out DIR [--deadline SECONDS] [--points 60]
    merak-energy serve PLAN.py [--host 127.0.0.1] [--port 7787] [--dump-dir DIR]

``plan`` writes ``DIR/plan.py`` (the chosen point: the fastest step with the least energy, or
the least energy within ``--deadline``), ``DIR/frontier/plan_NNN.py`` for every frontier point,
``DIR/frontier.csv`` (``index,iteration_time,energy,plan``) and ``DIR/frontier.png``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from merak.energy.dag import step_graph
from merak.energy.planner import FrequencyPlanner, PlanPoint
from merak.energy.plans import PlanError, write_plan
from merak.energy.profile_csv import ProfileError, check_coverage, read_profile
from merak.report import write_json_atomic, write_text_atomic

logger = logging.getLogger("merak.energy")


def _plot(points: list[PlanPoint], chosen: PlanPoint, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no %s", path)
        return
    figure, axes = plt.subplots(figsize=(6, 4))
    axes.plot([p.iteration_time for p in points], [p.energy for p in points], marker=".", label="frontier")
    axes.scatter([chosen.iteration_time], [chosen.energy], color="red", zorder=3, label="plan.py")
    axes.set_xlabel("iteration time (s)")
    axes.set_ylabel("iteration energy (J)")
    axes.set_title("time-energy frontier")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plan_command(args) -> int:
    """Solve the frontier and write the plans; returns the exit code."""
    started = time.perf_counter()
    graph = step_graph(args.schedule, args.num_stages, args.num_microbatches, args.num_chunks)
    options = read_profile(args.profile)
    check_coverage(options, {(n.stage, n.name) for n in graph.nodes}, args.profile)
    planner = FrequencyPlanner(graph, options, args.p2p_power)
    points = planner.frontier(args.points)
    chosen = planner.fastest() if args.deadline is None else planner.solve(args.deadline)
    os.makedirs(os.path.join(args.out, "frontier"), exist_ok=True)
    rows = ["index,iteration_time,energy,plan"]
    for index, point in enumerate(points):
        name = os.path.join("frontier", f"plan_{index:03d}.py")
        write_plan(os.path.join(args.out, name), point.stage_plans(graph))
        rows.append(f"{index},{point.iteration_time!r},{point.energy!r},{name}")
    write_text_atomic(os.path.join(args.out, "frontier.csv"), "\n".join(rows) + "\n")
    write_plan(os.path.join(args.out, "plan.py"), chosen.stage_plans(graph))
    all_max = planner.point([0] * len(graph.nodes), planner.fastest_time())
    report = {"profile": os.path.abspath(args.profile), "schedule": args.schedule, "num_stages": args.num_stages,
              "num_microbatches": args.num_microbatches, "num_chunks": args.num_chunks, "p2p_power": args.p2p_power,
              "target": "fastest" if args.deadline is None else f"deadline {args.deadline}",
              "plan": {"iteration_time": chosen.iteration_time, "energy": chosen.energy},
              "all_highest_clock": {"iteration_time": all_max.iteration_time, "energy": all_max.energy},
              "frontier_points": len(points), "solve_seconds": time.perf_counter() - started}
    write_json_atomic(os.path.join(args.out, "plan.json"), report)
    _plot(points, chosen, os.path.join(args.out, "frontier.png"))
    saving = 1 - chosen.energy / all_max.energy
    logger.info("plan.py: %.4f s/step, %.1f J (%.1f %% less than every instruction at its highest clock: "
                "%.4f s, %.1f J); %d frontier points in %s (%.1f s)", chosen.iteration_time, chosen.energy,
                100 * saving, all_max.iteration_time, all_max.energy, len(points), args.out, report["solve_seconds"])
    return 0


def serve_command(args) -> int:
    from merak.energy.zeus_server import serve

    serve(args.plan, host=args.host, port=args.port, dump_dir=args.dump_dir, log_level=args.log_level)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="merak-energy", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    plan = commands.add_parser("plan", help="time-energy frontier and frequency plans from a profile")
    plan.add_argument("profile", help="instruction profile CSV (trainer.profile=true writes it)")
    plan.add_argument("--num-stages", type=int, required=True)
    plan.add_argument("--num-microbatches", type=int, required=True)
    plan.add_argument("--schedule", default="1f1b", help="the train_schedule the plan runs with")
    plan.add_argument("--num-chunks", type=int, default=1, help="model chunks per stage (interleaved_1f1b)")
    plan.add_argument("--p2p-power", type=float, required=True, help="watts a GPU draws while blocked")
    plan.add_argument("--out", required=True, help="output directory")
    plan.add_argument("--deadline", type=float, default=None,
                      help="step time to meet (e.g. a straggler's); default: the fastest step")
    plan.add_argument("--points", type=int, default=60, help="deadlines solved along the frontier")
    serve = commands.add_parser("serve", help="a zeus pipeline-frequency server that serves a plan file")
    serve.add_argument("plan", help="plan file (merak-energy plan's plan.py)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=7787)
    serve.add_argument("--dump-dir", default="./zeus-dump", help="where zeus writes reported profiling results")
    serve.add_argument("--log-level", default="INFO")
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = _parser().parse_args(argv)
    try:
        return plan_command(args) if args.command == "plan" else serve_command(args)
    except (ProfileError, PlanError, ValueError, ImportError) as error:
        logger.error("%s", error)
        return 2


if __name__ == "__main__":
    sys.exit(main())
