"""Profile mode: time and energy of every compute instruction at every supported clock.

With one microbatch per step, each step runs every stage's forward and backward (and the
recompute instructions of the Merak schedules) once; schedules that need more microbatches
(interleaved_1f1b, shifted_critical_path) run each several times, and each instruction's time
and energy is the mean over its runs. For each supported clock, highest first (or those
``trainer.profile_clock_step`` MHz apart: :func:`clocks_to_profile`), every rank locks its GPU
to it, runs ``num_warmup_steps`` steps, then measures ``num_prof_steps`` steps, and averages each
instruction's time and energy. Past half of the clock list, once every rank has seen its
forward+backward energy rise for 5 clocks in a row (the energy minimum is behind), profiling
stops early. Rank 0 writes the CSV
(:mod:`merak.energy.profile_csv`) in the run directory, and beside it what the steps took
besides their instructions (:class:`~merak.energy.profile_csv.Overheads`),
which the planner adds to its predictions.
"""

from __future__ import annotations

import logging
import os
import statistics
import time

from merak.core.files import write_json_atomic
from merak.distributed import groups
from merak.energy.dag import step_graph
from merak.energy.paths import LevelledGraph
from merak.energy.profile_csv import Overheads, ProfileRow, profile_file_name, write_overheads, write_profile

logger = logging.getLogger(__name__)

RISES_TO_STOP = 5


def _step_averages(steps) -> dict[str, tuple[float, float]]:
    """{name: (mean seconds, mean joules)} over all instances of each instruction in ``steps``."""
    times: dict[str, list[float]] = {}
    energies: dict[str, list[float]] = {}
    for step in steps:
        step_times, step_energies = step.breakdown()
        for name in step_times:
            times.setdefault(name, []).extend(step_times[name])
            energies.setdefault(name, []).extend(step_energies[name])
    return {name: (statistics.fmean(times[name]), statistics.fmean(energies[name])) for name in times}


def measure_overheads(rows: list[ProfileRow], spans: list[tuple[int, float, float]], schedule: str,
                      num_stages: int, num_chunks: int, num_microbatches: int = 1) -> Overheads:
    """The host's share of the profiled steps.

    ``spans`` holds every rank's mean ``(clock, step time, compute span)`` at each profiled clock.
    At each clock, the longest compute span less the critical path of the profiled instruction
    times, spread over the instructions on that path, is the per-instruction overhead, and the
    longest step less the longest span is the step's tail. The host's work does not depend on
    the GPU's clock: the median over the clocks discards a cold first step.
    """
    times: dict[tuple[int, int, str], list[float]] = {}
    for row in rows:
        times.setdefault((row.frequency, row.stage, row.instruction), []).append(row.time)
    graph = step_graph(schedule, num_stages, num_microbatches, num_chunks)
    paths = LevelledGraph(graph)
    per_instruction, per_step = [], []
    for clock in sorted({clock for clock, _, _ in spans}):
        at_clock = [(step, span) for c, step, span in spans if c == clock]
        durations = [statistics.fmean(times[(clock, node.stage, node.name)]) for node in graph.nodes]
        span = max(s for _, s in at_clock)
        per_instruction.append(max(0.0, (span - paths.step_time(durations)) / len(paths.levels)))
        per_step.append(max(0.0, max(t for t, _ in at_clock) - span))
    return Overheads(instruction=statistics.median(per_instruction), step=statistics.median(per_step))


def clocks_to_profile(supported: list[int], step_mhz: int | None) -> list[int]:
    """The clocks to profile, highest first: all of ``supported`` (highest first), or with ``step_mhz``
    each one at least that far below the last one kept (the device's clocks need not be evenly
    spaced, nor ``step_mhz`` a multiple of their spacing)."""
    if not step_mhz:
        return list(supported)
    kept: list[int] = []
    for clock in supported:
        if not kept or kept[-1] - clock >= step_mhz:
            kept.append(clock)
    return kept


def run_profile(session, runtime) -> dict | None:
    """Profile ``session``'s stages on ``runtime.device``; returns the profile summary on rank 0."""
    settings, state, trainer = session.settings, session.state, session.settings.trainer
    device, meter = runtime.device, runtime.meter
    supported = device.supported_clocks()
    clocks = clocks_to_profile(supported, trainer.energy.profile_clock_step)
    per_clock = trainer.energy.num_warmup_steps + trainer.energy.num_prof_steps
    coords = state.coordinates
    rows: list[ProfileRow] = []
    spans: list[tuple[int, float, float]] = []  # this rank's (clock, step time, compute span) per clock
    started, step, rises, last_energy, profiled = time.perf_counter(), 0, 0, None, 0
    try:
        for position, clock in enumerate(clocks):
            device.set_clock(clock)
            for _ in range(per_clock):
                microbatches = session.loader.load_step(step) if session.loader else None
                session.engine.train_step(microbatches)
                step += 1
            measured = meter.steps[-trainer.energy.num_prof_steps:]
            averages = _step_averages(measured)
            spans.append((clock, statistics.fmean(s.time for s in measured),
                          statistics.fmean(s.compute_span for s in measured)))
            rows += [ProfileRow(state.rank, coords.dp, coords.pp, coords.tp, name, clock, seconds, joules)
                     for name, (seconds, joules) in averages.items()]
            profiled += 1
            energy = sum(joules for _, joules in averages.values())
            rises = rises + 1 if last_energy is not None and energy > last_energy else 0
            last_energy = energy
            done = position + 1 >= len(clocks) / 2 and rises >= RISES_TO_STOP
            if all(groups.gather_from_all(done)):
                logger.info("energy rose for %d clocks in a row on every rank: stopping at %d MHz", rises, clock)
                break
    finally:
        device.reset_clock()
    everyone = groups.gather_from_all(rows)
    all_spans = [span for part in groups.gather_from_all(spans) for span in part]
    if state.rank != 0:
        return None
    grid = settings.grid
    name = profile_file_name(model=str(settings.model_cfg.get("name", "model")),
                             partition_method=trainer.sharding.partition_method, dp=grid.dp, pp=grid.pp, tp=grid.tp,
                             micro_batch_size=trainer.batch.per_device_train_batch_size)
    path = os.path.join(settings.output_dir, name)
    all_rows = [row for part in everyone for row in part]
    write_profile(path, all_rows)
    overheads = measure_overheads(all_rows, all_spans, trainer.schedule.train_schedule, grid.pp,
                                  trainer.schedule.chunks, session.engine.num_microbatches)
    write_overheads(path, overheads)
    summary = {"profile": path, "device": device.name, "clocks_profiled": profiled, "clocks_supported": len(supported),
               "highest_clock": clocks[0], "lowest_clock_profiled": clocks[profiled - 1],
               "steps": step, "rows": sum(len(part) for part in everyone),
               "layout": {"dp": grid.dp, "tp": grid.tp, "pp": grid.pp}, "schedule": trainer.schedule.train_schedule,
               "seconds": time.perf_counter() - started}
    write_json_atomic(os.path.join(settings.output_dir, "summary.json"), summary)
    logger.info("wrote the instruction profile %s (%d clocks from %d MHz down to %d MHz)", path, profiled,
                clocks[0], clocks[profiled - 1])
    return summary
