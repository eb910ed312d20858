"""How long every rank spends building its schedule's transfer groups at start-up.

``build_schedule`` groups each point's transfers so that they cannot deadlock on NCCL
(merak.pipeline.transfers); deadlocks are repaired one at a time. This times, per shape, the
grouping as it runs (the simulation goes on from where each repair left it) against the
reference that simulates the whole step again after every repair (``_repair_from_scratch``,
kept as the fallback), and checks that both give the same lists::

    .venv/bin/python bench/schedule_build.py [--shape interleaved_1f1b:8:64:2 ...] [--no-reference]

A shape is ``schedule:stages:microbatches[:chunks]``. Pure Python: no torch work is timed.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # first: one thread, before torch starts any

from merak.pipeline import transfers
from merak.pipeline.schedules import schedule_info

logger = logging.getLogger("bench.schedule_build")

SHAPES = ("1f1b:8:64", "gpipe:16:64", "zb_h1:8:64", "interleaved_1f1b:8:32:2", "interleaved_1f1b:8:64:2",
          "interleaved_1f1b:16:64:2", "interleaved_1f1b:8:128:2")


def _lists(shape: str) -> list[list]:
    name, stages, microbatches, *chunks = shape.split(":")
    info = schedule_info(name)
    extra = (int(chunks[0]) if chunks else 2,) if info.chunked else ()
    return [info.build(s, int(stages), int(microbatches), *extra) for s in range(int(stages))]


def _reference(lists: list[list]) -> list[list]:
    """The grouping with the whole step simulated again after every repair."""
    return transfers._repair_from_scratch(*transfers._first_groups(lists))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", action="append", help=f"default: {' '.join(SHAPES)}")
    parser.add_argument("--no-reference", action="store_true", help="time only the grouping as it runs")
    args = parser.parse_args(argv)
    common.setup_logging()
    facts = common.machine_facts()
    rows = []
    for shape in args.shape or SHAPES:
        lists = _lists(shape)
        started = time.perf_counter()
        grouped = transfers.group_transfers(lists)
        fast = time.perf_counter() - started
        if args.no_reference:
            rows.append([shape, f"{fast:.2f}", "-", "-", "-"])
            continue
        started = time.perf_counter()
        reference = _reference(lists)
        slow = time.perf_counter() - started
        same = "yes" if grouped == reference else "NO"
        rows.append([shape, f"{fast:.2f}", f"{slow:.2f}", f"{slow / fast:.0f}", same])
        logger.info("%s: %.2f s, reference %.2f s", shape, fast, slow)
    print(common.format_facts(facts))
    print(common.format_table(["shape", "grouping s", "reference s", "reference / grouping", "same lists"], rows))


if __name__ == "__main__":
    main()
