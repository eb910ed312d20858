"""Pipeline schedules and recomputation side by side in the simulator (no training, a few seconds).

Every contender is a schedule plus a recomputation setting, run through
:func:`merak.pipeline.simulate.simulate` with GPU-like uniform costs: forward
F = 1, backward B = 2, recomputing a whole stage forward R = 1 (a plain
Forward on a stage with checkpoint ratio r adds r * R to its Backward). With
interleaving each of the V = 2 chunks costs half a stage; ZB-H1 splits the
backward into BI = W = 1.

For each contender the script reports the simulated makespan, the bubble
fraction, the closed form where one is known, and a memory proxy: the peak
over the step, on the worst stage, of the activations kept for backward, in
units of one microbatch's full stage activations. It follows each stage's
instruction list in order (no timing): a plain Forward keeps 1 - r of a
microbatch (the checkpoint inputs are ignored), a PreCheckpointForward keeps
nothing until its RecomputeForward, which keeps 1 until the Backward, a
chunk of an interleaved stage counts 1/V, and ZB-H1 keeps a microbatch until
its BackwardWeight. The recomputation inside a backward (one checkpointed
layer at a time) is transient and not counted.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import common

from merak.pipeline.instructions import (
    Backward,
    BackwardWeight,
    Forward,
    Instruction,
    PreCheckpointForward,
    RecomputeForward,
)
from merak.pipeline.recompute import stage_checkpoint_ratios
from merak.pipeline.schedules import build_schedule
from merak.pipeline.simulate import Costs, SimulationResult, simulate

FORWARD, BACKWARD, RECOMPUTE = 1.0, 2.0, 1.0
CHUNKS = 2
PICTURE_CONTENDERS = ("1f1b full", "pre_recompute_1f1b full", "shifted_critical_path r0=0.5", "zb_h1 none")


def _none(num_stages: int) -> list[float]:
    return [0.0] * num_stages


def _full(num_stages: int) -> list[float]:
    return [1.0] * num_stages


def _full_but_last(num_stages: int) -> list[float]:
    return stage_checkpoint_ratios(None, num_stages, last_stage_checkpoints=False)


def _stage_aware(first: float, *, last_stage_checkpoints: bool = True) -> Callable[[int], list[float]]:
    """Ratios derived from the first stage's ``first`` (merak's stage-aware recomputation)."""
    def ratios(num_stages: int) -> list[float]:
        return stage_checkpoint_ratios(first, num_stages, last_stage_checkpoints=last_stage_checkpoints)
    return ratios


@dataclass(frozen=True)
class Contender:
    """A schedule with a recomputation setting.

    Attributes:
        name: Row label.
        schedule: Registered schedule name.
        ratios: Per-stage checkpoint ratios of plain Forwards, from the number of stages.
        chunks: Model chunks per stage (interleaved only).
        split_backward: True for schedules that run BackwardInput and BackwardWeight.
    """

    name: str
    schedule: str
    ratios: Callable[[int], list[float]]
    chunks: int = 1
    split_backward: bool = False


CONTENDERS = (
    Contender("1f1b none", "1f1b", _none),
    Contender("1f1b full", "1f1b", _full),
    Contender("1f1b stage-aware r0=0.5", "1f1b", _stage_aware(0.5)),
    Contender("pre_recompute_1f1b full", "pre_recompute_1f1b", _full),
    Contender("last_no_recompute_1f1b full", "last_no_recompute_1f1b", _full_but_last),
    Contender("shifted_critical_path r0=0.5", "shifted_critical_path",
              _stage_aware(0.5, last_stage_checkpoints=False)),
    Contender("shifted_critical_path r0=1.0", "shifted_critical_path",
              _stage_aware(1.0, last_stage_checkpoints=False)),
    Contender("gpipe none", "gpipe", _none),
    Contender(f"interleaved_1f1b V={CHUNKS}", "interleaved_1f1b", _none, chunks=CHUNKS),
    Contender("zb_h1 none", "zb_h1", _none, split_backward=True),
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--picture", default="bench/results/schedules_simulated_s4_m8.png",
                        help="comparison PNG of the S=4, M=8 timelines ('' for none)")
    parser.add_argument("--json", default=None, help="write every result here")
    return parser.parse_args(argv)


def stage_lists(contender: Contender, num_stages: int, num_microbatches: int) -> list[list[Instruction]]:
    """The instruction list of every stage."""
    return [build_schedule(name=contender.schedule, stage_id=s, num_stages=num_stages,
                           num_microbatches=num_microbatches, num_chunks=contender.chunks)
            for s in range(num_stages)]


def costs_of(contender: Contender, num_stages: int) -> Costs:
    """Uniform costs of one contender; a chunk of an interleaved stage costs 1/V of the stage."""
    scale = 1.0 / contender.chunks
    return Costs(forward=FORWARD * scale, backward=BACKWARD * scale, recompute=RECOMPUTE * scale,
                 backward_input=BACKWARD / 2 if contender.split_backward else None,
                 checkpoint_ratios=tuple(contender.ratios(num_stages)))


def closed_form(contender: Contender, num_stages: int, num_microbatches: int) -> float | None:
    """The known makespan formula of the contender, or None where there is none."""
    steps = num_microbatches + num_stages - 1
    if contender.schedule in ("1f1b", "gpipe"):
        ratios = contender.ratios(num_stages)
        if all(r == 0.0 for r in ratios):
            return steps * (FORWARD + BACKWARD)
        if all(r == 1.0 for r in ratios):
            return steps * (FORWARD + BACKWARD + RECOMPUTE)
        return None
    if contender.schedule == "interleaved_1f1b":
        return num_microbatches * (FORWARD + BACKWARD) + (num_stages - 1) * (FORWARD + BACKWARD) / contender.chunks
    if contender.schedule == "zb_h1":
        return 3 * num_microbatches + (num_stages - 1)  # F = BI = W = 1
    return None


def stage_memory(instructions: Sequence[Instruction], ratios: Sequence[float], stage_id: int, num_stages: int,
                 chunks: int) -> tuple[float, int]:
    """(peak kept activations, peak microbatches in flight) of one stage, walking its list in order.

    Args:
        instructions: The stage's list.
        ratios: Checkpoint ratio of each virtual stage (plain Forwards only).
        stage_id: The stage.
        num_stages: Number of stages S (virtual stage of chunk c: c * S + stage_id).
        chunks: Chunks per stage; one chunk's microbatch counts 1/chunks.
    """
    unit = 1.0 / chunks
    kept: dict[tuple[int, int], float] = {}
    peak, in_flight = 0.0, 0
    for instruction in instructions:
        key = (getattr(instruction, "chunk", 0), getattr(instruction, "microbatch", -1))
        if isinstance(instruction, Forward):
            ratio = ratios[key[0] * num_stages + stage_id] if ratios else 0.0
            kept[key] = (1.0 - ratio) * unit
        elif isinstance(instruction, PreCheckpointForward):
            kept[key] = 0.0
        elif isinstance(instruction, RecomputeForward):
            kept[key] = unit
        elif isinstance(instruction, (Backward, BackwardWeight)):
            kept.pop(key, None)
        peak = max(peak, sum(kept.values()))
        in_flight = max(in_flight, len(kept))
    return peak, in_flight


def memory_proxy(contender: Contender, lists: Sequence[Sequence[Instruction]]) -> list[tuple[float, int]]:
    """:func:`stage_memory` of every stage."""
    num_stages = len(lists)
    ratios = contender.ratios(num_stages * contender.chunks) if contender.chunks > 1 else contender.ratios(num_stages)
    return [stage_memory(lists[s], ratios, s, num_stages, contender.chunks) for s in range(num_stages)]


def run_contender(contender: Contender, num_stages: int, num_microbatches: int) -> tuple[SimulationResult, dict]:
    """Simulate one contender; return the simulation and its table row as a dict."""
    lists = stage_lists(contender, num_stages, num_microbatches)
    result = simulate(lists, costs_of(contender, num_stages))
    memory = memory_proxy(contender, lists)
    row = {"S": num_stages, "M": num_microbatches, "contender": contender.name, "makespan": result.makespan,
           "bubble": result.bubble_fraction, "closed_form": closed_form(contender, num_stages, num_microbatches),
           "memory": max(kept for kept, _ in memory), "memory_per_stage": [kept for kept, _ in memory],
           "in_flight": max(n for _, n in memory)}
    return result, row


def number(value: float) -> str:
    """At most two decimals, trailing zeros dropped (33, 35.5, 47.18)."""
    return f"{value:.2f}".rstrip("0").rstrip(".")


def format_row(row: dict, baseline: float) -> list[object]:
    """One Markdown table row; ``baseline`` is the makespan of 1f1b none at the same S and M."""
    closed = "—" if row["closed_form"] is None else number(row["closed_form"])
    per_stage = " / ".join(number(kept) for kept in row["memory_per_stage"])
    return [row["S"], row["M"], row["contender"], number(row["makespan"]), closed,
            f"{row['makespan'] / baseline:.3f}", f"{100 * row['bubble']:.1f} %", number(row["memory"]),
            per_stage, row["in_flight"]]


def fastest_within(rows: Sequence[dict], memory: float) -> dict:
    """The fastest of ``rows`` whose memory proxy is at most ``memory``."""
    return min((r for r in rows if r["memory"] <= memory + 1e-9), key=lambda r: r["makespan"])


def verdict(rows: Sequence[dict]) -> list[str]:
    """Per (S, M): does shifted_critical_path beat 1f1b full, and is it the fastest at its memory?"""
    lines = []
    for num_stages, num_microbatches in sorted({(r["S"], r["M"]) for r in rows}):
        here = [r for r in rows if (r["S"], r["M"]) == (num_stages, num_microbatches)]
        by_name = {r["contender"]: r for r in here}
        full = by_name["1f1b full"]
        for first in ("0.5", "1.0"):
            shifted = by_name[f"shifted_critical_path r0={first}"]
            faster = shifted["makespan"] < full["makespan"]
            leaner = shifted["memory"] <= full["memory"]
            answer = "yes" if faster and leaner else ("faster, but keeps more" if faster else "no")
            best = fastest_within(here, shifted["memory"])
            lines.append(f"S={num_stages} M={num_microbatches} r0={first}: time {number(shifted['makespan'])} vs "
                         f"{number(full['makespan'])} ({shifted['makespan'] / full['makespan']:.3f}x), memory "
                         f"{number(shifted['memory'])} vs {number(full['memory'])} -> {answer}; fastest at memory "
                         f"<= {number(shifted['memory'])}: {best['contender']} ({number(best['makespan'])})")
    return lines


def draw_picture(path: str, results: dict[str, SimulationResult]) -> None:
    """The S=4, M=8 timelines of :data:`PICTURE_CONTENDERS`, stacked in one PNG."""
    from merak.pipeline.timeline import draw_comparison, events_from_simulation
    panels = [(f"{name}: makespan {results[name].makespan:g}", events_from_simulation(results[name]))
              for name in PICTURE_CONTENDERS]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    draw_comparison(panels, path, time_label="model units (F=1, B=2, R=1)")
    common.logger.info("wrote %s (%d bytes)", path, Path(path).stat().st_size)


def main(argv=None) -> int:
    args = parse_args(argv)
    common.setup_logging()
    rows, pictured = [], {}
    table = []
    for num_stages in args.stages:
        for num_microbatches in args.microbatches:
            baseline = None
            for contender in CONTENDERS:
                result, row = run_contender(contender, num_stages, num_microbatches)
                baseline = row["makespan"] if baseline is None else baseline
                rows.append(row)
                table.append(format_row(row, baseline))
                if (num_stages, num_microbatches) == (4, 8):
                    pictured[contender.name] = result
    header = ["S", "M", "contender", "makespan", "closed form", "vs 1f1b none", "bubble", "memory (max)",
              "memory per stage", "in flight (max)"]
    sys.stdout.write(common.format_table(header, table) + "\n\n")
    sys.stdout.write("Does shifted_critical_path beat 1f1b with full recompute at equal or lower memory?\n")
    sys.stdout.write("\n".join(verdict(rows)) + "\n")
    if args.picture and pictured:
        draw_picture(args.picture, pictured)
    common.write_json(args.json, {"costs": {"forward": FORWARD, "backward": BACKWARD, "recompute": RECOMPUTE,
                                            "chunks": CHUNKS}, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
