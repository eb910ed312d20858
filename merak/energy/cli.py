"""``merak-energy``: plan per-instruction clocks from a profile, and serve plans to zeus.

    merak-energy plan PROFILE.csv --num-stages S --num-microbatches M --schedule 1f1b \\
        --p2p-power 80 --out DIR [--deadline SECONDS] [--points 60]
    merak-energy serve PLAN.py|FRONTIER.json [--deadline SECONDS] [--host 127.0.0.1] [--port 7787]
        [--dump-dir DIR] [--log-level INFO] [--max-request-bytes 16777216] [--max-jobs 64]
        [--max-ranks 4096]

``plan`` writes ``DIR/plan.py`` (the chosen point: the fastest step with the least energy, or
the least energy within ``--deadline``), ``DIR/frontier/plan_NNN.py`` for every frontier point,
``DIR/frontier.csv`` (``index,iteration_time,energy,plan``), ``DIR/frontier.json`` (every point's
plans and predictions in one file: ``trainer.frequency_frontier`` runs it, moving along it when
a data-parallel pipeline straggles) and ``DIR/frontier.png``. It checks
its options, the profile and every solve before it creates ``DIR``: a bad value exits with
status 2 and an argparse-style message naming the option, and writes nothing.

``serve`` checks its options the same way before it reads the plan (``--port`` 0..65535, 0 for a
free port that the log names; ``--deadline`` > 0 and only with a frontier; a non-empty ``--host``;
the limits >= their minimums), and reports a plan or frontier file it cannot use, or an address
it cannot listen on, in one line with exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import sys
import time
from dataclasses import dataclass

from merak.core.files import write_json_atomic, write_text_atomic
from merak.energy.dag import StepGraph, step_graph
from merak.energy.frontier import FrontierError, write_frontier
from merak.energy.planner import DEFAULT_TIME_BUDGET_S, FrequencyPlanner, PlanPoint
from merak.energy.plans import PlanError, write_plan
from merak.energy.profile_csv import Overheads, ProfileError, check_coverage, read_overheads, read_profile
from merak.energy.zeus_server import DEFAULT_MAX_JOBS, DEFAULT_MAX_RANKS, DEFAULT_MAX_REQUEST_BYTES, LOG_LEVELS

logger = logging.getLogger("merak.energy")


class UsageError(ValueError):
    """An option value a command cannot use; :func:`main` reports it as argparse does (exit status 2)."""


@dataclass(frozen=True)
class Solution:
    """What ``plan`` writes: the frontier, the chosen point and the all-highest-clock reference."""

    points: list[PlanPoint]
    chosen: PlanPoint
    all_max: PlanPoint


def _check_count(option: str, value: int, minimum: int, maximum: int | None = None) -> None:
    if value < minimum or (maximum is not None and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
        raise UsageError(f"argument {option}: must be {bounds}, got {value}")


def _check_number(option: str, value: float, minimum: float, *, inclusive: bool) -> None:
    # NaN compares false with everything, so test finiteness first: a NaN power or deadline would
    # otherwise pass and turn every energy into NaN.
    if not math.isfinite(value) or value < minimum or (value == minimum and not inclusive):
        bound = ">=" if inclusive else ">"
        raise UsageError(f"argument {option}: must be a finite number {bound} {minimum:g}, got {value!r}")


def check_plan_args(args) -> None:
    """Reject out-of-range ``plan`` options, before anything is read or written.

    Raises:
        UsageError: naming the first bad option and its value.
    """
    _check_count("--num-stages", args.num_stages, 1)
    _check_count("--num-microbatches", args.num_microbatches, 1)
    _check_count("--num-chunks", args.num_chunks, 1)
    _check_count("--points", args.points, 2)  # the frontier needs its two ends
    _check_number("--p2p-power", args.p2p_power, 0.0, inclusive=True)
    _check_number("--time-budget", args.time_budget, 0.0, inclusive=False)
    if args.deadline is not None:
        _check_number("--deadline", args.deadline, 0.0, inclusive=False)
    for option, value in (("--instruction-overhead", args.instruction_overhead),
                          ("--step-overhead", args.step_overhead)):
        if value is not None:
            _check_number(option, value, 0.0, inclusive=True)
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise UsageError(f"argument --out: {args.out} exists and is not a directory")


MIN_REQUEST_BYTES = 1024  # below this even a rank's registration (its GPU's clocks) would be refused


def check_serve_args(args) -> None:
    """Reject unusable ``serve`` options, before the plan is read or a port is opened.

    Raises:
        UsageError: naming the first bad option and its value.
    """
    if not os.path.isfile(args.plan):
        why = "is not a file" if os.path.exists(args.plan) else "does not exist"
        raise UsageError(f"argument plan: {args.plan} {why}")
    if args.deadline is not None:
        _check_number("--deadline", args.deadline, 0.0, inclusive=False)
        if not args.plan.endswith(".json"):
            # A plan file has one point: a deadline would be ignored without a word.
            raise UsageError(f"argument --deadline: only a frontier file (.json) has points to choose from, "
                             f"not {args.plan}")
    if not args.host.strip():
        raise UsageError("argument --host: must not be empty")
    _check_count("--port", args.port, 0, 65535)
    if not args.dump_dir.strip():
        raise UsageError("argument --dump-dir: must not be empty")
    if os.path.exists(args.dump_dir) and not os.path.isdir(args.dump_dir):
        raise UsageError(f"argument --dump-dir: {args.dump_dir} exists and is not a directory")
    if args.log_level.upper() not in LOG_LEVELS:
        raise UsageError(f"argument --log-level: must be one of {', '.join(LOG_LEVELS)}, got {args.log_level!r}")
    _check_count("--max-request-bytes", args.max_request_bytes, MIN_REQUEST_BYTES)
    _check_count("--max-jobs", args.max_jobs, 1)
    _check_count("--max-ranks", args.max_ranks, 1)


def profile_overheads(args) -> Overheads:
    """The host's overheads: the options' values, else those measured with the profile, else none."""
    measured = read_overheads(args.profile)
    known = measured or Overheads(0.0, 0.0)
    overheads = Overheads(known.instruction if args.instruction_overhead is None else args.instruction_overhead,
                          known.step if args.step_overhead is None else args.step_overhead)
    logger.info("host overheads: %.2f ms per instruction, %.2f ms per step (%s)", 1e3 * overheads.instruction,
                1e3 * overheads.step, "measured with the profile" if measured else "none measured")
    return overheads


def schedule_graph(args) -> StepGraph:
    """The step graph of ``--schedule`` with these numbers; UsageError when the schedule cannot
    run them (each schedule knows its own limits, e.g. interleaved_1f1b's multiple of stages)."""
    try:
        return step_graph(args.schedule, args.num_stages, args.num_microbatches, args.num_chunks)
    except ValueError as error:
        raise UsageError(f"argument --schedule {args.schedule} with --num-stages {args.num_stages}, "
                         f"--num-microbatches {args.num_microbatches} and --num-chunks {args.num_chunks}: "
                         f"{error}") from None


def with_step_overhead(point: PlanPoint, overhead: float, graph: StepGraph, p2p_power: float) -> PlanPoint:
    """``point`` with the step's tail added: every GPU waits it out at blocked power."""
    return dataclasses.replace(point, iteration_time=point.iteration_time + overhead,
                               energy=point.energy + graph.num_stages * p2p_power * overhead)


def solve(planner: FrequencyPlanner, graph: StepGraph, args, step_overhead: float = 0.0) -> Solution:
    """The frontier and the chosen plan (the fastest, or the least energy within ``--deadline``), each
    point's step time and energy including the step's tail ``step_overhead``."""
    if args.deadline is None:
        chosen = planner.fastest()
    else:
        try:  # before the frontier's many solves: a deadline that cannot be met fails at once
            chosen = planner.solve(args.deadline - step_overhead)
        except ValueError as error:  # shorter than the fastest possible step
            raise UsageError(f"argument --deadline: {error} (with a step overhead of {step_overhead:.6f} s)") \
                from None
    points = planner.frontier(args.points)
    all_max = planner.point([0] * len(graph.nodes), planner.fastest_time())

    def whole_step(point: PlanPoint) -> PlanPoint:
        return with_step_overhead(point, step_overhead, graph, planner.p2p_power)

    return Solution([whole_step(p) for p in points], whole_step(chosen), whole_step(all_max))


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
    temporary = f"{path}.tmp.{os.getpid()}"  # like the other outputs: the old picture or the new one
    figure.savefig(temporary, dpi=120, format="png")
    plt.close(figure)
    os.replace(temporary, path)


def write_outputs(out: str, graph: StepGraph, solution: Solution, report: dict) -> None:
    """Write the plans, ``frontier.csv``, ``frontier.json``, ``plan.json`` and ``frontier.png`` under ``out``,
    each atomically."""
    os.makedirs(os.path.join(out, "frontier"), exist_ok=True)
    rows = ["index,iteration_time,energy,plan"]
    for index, point in enumerate(solution.points):
        name = os.path.join("frontier", f"plan_{index:03d}.py")
        write_plan(os.path.join(out, name), point.stage_plans(graph))
        rows.append(f"{index},{point.iteration_time!r},{point.energy!r},{name}")
    write_text_atomic(os.path.join(out, "frontier.csv"), "\n".join(rows) + "\n")
    write_frontier(os.path.join(out, "frontier.json"), graph, solution.points, schedule=report["schedule"],
                   num_chunks=report["num_chunks"], p2p_power=report["p2p_power"],
                   num_microbatches=report["num_microbatches"], step_overhead=report["step_overhead_s"])
    write_plan(os.path.join(out, "plan.py"), solution.chosen.stage_plans(graph))
    write_json_atomic(os.path.join(out, "plan.json"), report)
    _plot(solution.points, solution.chosen, os.path.join(out, "frontier.png"))


def plan_command(args) -> int:
    """Check the options, solve the frontier, then write the plans; returns the exit code.

    Nothing is written (``--out`` is not even created) unless the options are valid, the profile
    covers the schedule and every solve succeeded.

    Raises:
        UsageError: an option is out of range or does not fit the schedule.
        ProfileError: the profile is missing, malformed or lacks rows the schedule needs.
    """
    started = time.perf_counter()
    check_plan_args(args)
    graph = schedule_graph(args)
    options = read_profile(args.profile)
    check_coverage(options, {(n.stage, n.name) for n in graph.nodes}, args.profile)
    overheads = profile_overheads(args)
    planner = FrequencyPlanner(graph, options, args.p2p_power, instruction_overhead=overheads.instruction,
                               time_budget_s=args.time_budget)
    solution = solve(planner, graph, args, overheads.step)
    chosen, all_max = solution.chosen, solution.all_max
    report = {"profile": os.path.abspath(args.profile), "schedule": args.schedule, "num_stages": args.num_stages,
              "num_microbatches": args.num_microbatches, "num_chunks": args.num_chunks, "p2p_power": args.p2p_power,
              "target": "fastest" if args.deadline is None else f"deadline {args.deadline}",
              "instruction_overhead_s": overheads.instruction, "step_overhead_s": overheads.step,
              "plan": {"iteration_time": chosen.iteration_time, "energy": chosen.energy},
              "all_highest_clock": {"iteration_time": all_max.iteration_time, "energy": all_max.energy},
              "frontier_points": len(solution.points), "solve_seconds": time.perf_counter() - started}
    write_outputs(args.out, graph, solution, report)
    saving = 1 - chosen.energy / all_max.energy
    logger.info("plan.py: %.4f s/step, %.1f J (%.1f %% less than every instruction at its highest clock: "
                "%.4f s, %.1f J); %d frontier points in %s (%.1f s)", chosen.iteration_time, chosen.energy,
                100 * saving, all_max.iteration_time, all_max.energy, len(solution.points), args.out,
                report["solve_seconds"])
    return 0


def serve_command(args) -> int:
    """Check the options, then serve the plan until interrupted; returns the exit code.

    Raises:
        UsageError: an option is out of range.
        PlanError, FrontierError: the plan or frontier file cannot be used.
        ServeError: the address or the dump directory cannot be used.
    """
    check_serve_args(args)
    from merak.energy.zeus_server import serve

    serve(args.plan, host=args.host, port=args.port, dump_dir=args.dump_dir, log_level=args.log_level.upper(),
          deadline=args.deadline, max_request_bytes=args.max_request_bytes, max_jobs=args.max_jobs,
          max_ranks=args.max_ranks)
    return 0


def _parser(prog: str = "merak-energy") -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The command-line parser and its subcommands' parsers (which report their own usage errors)."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    plan = commands.add_parser("plan", help="time-energy frontier and frequency plans from a profile")
    plan.add_argument("profile", help="instruction profile CSV (trainer.profile=true writes it)")
    plan.add_argument("--num-stages", type=int, required=True, help="pipeline stages (>= 1)")
    plan.add_argument("--num-microbatches", type=int, required=True,
                      help="microbatches per step (>= 1, and what the schedule needs)")
    plan.add_argument("--schedule", default="1f1b", help="the train_schedule the plan runs with")
    plan.add_argument("--num-chunks", type=int, default=1, help="model chunks per stage (interleaved_1f1b; >= 1)")
    plan.add_argument("--p2p-power", type=float, required=True, help="watts a GPU draws while blocked (>= 0)")
    plan.add_argument("--out", required=True, help="output directory")
    plan.add_argument("--deadline", type=float, default=None,
                      help="step time in seconds to meet (> 0, e.g. a straggler's); default: the fastest step")
    plan.add_argument("--points", type=int, default=60, help="deadlines solved along the frontier (>= 2)")
    plan.add_argument("--time-budget", type=float, default=DEFAULT_TIME_BUDGET_S, metavar="SECONDS",
                      help="seconds of planning after which the remaining deadlines keep the best plan found so "
                           f"far, with a warning (> 0; default: {DEFAULT_TIME_BUDGET_S:g})")
    plan.add_argument("--instruction-overhead", type=float, default=None,
                      help="seconds the host adds around each instruction (default: measured with the profile, "
                           "PROFILE.overheads.json, else 0)")
    plan.add_argument("--step-overhead", type=float, default=None,
                      help="seconds from the last instruction to the end of a step (default: as above)")
    serve = commands.add_parser(
        "serve", help="a zeus pipeline-frequency server that serves a plan file",
        description="A zeus pipeline-frequency server that serves a plan file. Its memory is bounded: a request "
                    "body over --max-request-bytes is refused with HTTP 413, and registering a job beyond "
                    "--max-jobs or --max-ranks drops the jobs idle longest (their later requests get HTTP 404).")
    serve.add_argument("plan", help="plan file (merak-energy plan's plan.py), or frontier.json to serve its "
                                    "fastest point (or --deadline's)")
    serve.add_argument("--deadline", type=float, default=None,
                       help="with frontier.json: serve the least-energy point within this step time (seconds, > 0)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=7787,
                       help="TCP port, 0..65535 (0: a free port, named in the log; default: 7787)")
    serve.add_argument("--dump-dir", default="./zeus-dump", help="where zeus writes reported profiling results")
    serve.add_argument("--log-level", default="INFO", help=f"one of {', '.join(LOG_LEVELS)} (default: INFO)")
    serve.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                       help=f"refuse a larger request body with HTTP 413 (>= {MIN_REQUEST_BYTES}; default: "
                            f"{DEFAULT_MAX_REQUEST_BYTES} = {DEFAULT_MAX_REQUEST_BYTES // 2**20} MiB, where a rank's "
                            "profiling result of 4 steps of 1024 microbatches takes under 1 MiB)")
    serve.add_argument("--max-jobs", type=int, default=DEFAULT_MAX_JOBS,
                       help=f"jobs kept at once (>= 1; default: {DEFAULT_MAX_JOBS}): registering one more drops "
                            "the job idle longest")
    serve.add_argument("--max-ranks", type=int, default=DEFAULT_MAX_RANKS,
                       help=f"ranks kept over all jobs (>= 1; default: {DEFAULT_MAX_RANKS}): a larger job is refused "
                            "with HTTP 400, and registering a job drops the jobs idle longest until it fits")
    return parser, {"plan": plan, "serve": serve}


def main(argv: list[str] | None = None, *, prog: str = "merak-energy") -> int:
    """Run ``merak-energy``; returns the exit code (bad options exit with status 2, as argparse does)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser, commands = _parser(prog)
    args = parser.parse_args(argv)
    try:
        return plan_command(args) if args.command == "plan" else serve_command(args)
    except UsageError as error:
        commands[args.command].error(str(error))  # usage and "error: argument ...", then exit status 2
    except (ProfileError, PlanError, FrontierError, ValueError, ImportError) as error:
        logger.error("%s", error)
        return 2


if __name__ == "__main__":
    sys.exit(main())
