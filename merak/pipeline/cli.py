"""merak-simulate: check a pipeline schedule and show its timeline without running a model.

    merak-simulate --schedule 1f1b --stages 4 --microbatches 8 [--backward 2]
"""

from __future__ import annotations

import argparse
import sys

from merak.pipeline.schedules import build_schedule, schedule_names
from merak.pipeline.simulate import Costs, ScheduleError, render_text_timeline, simulate


def main(argv: list[str] | None = None) -> int:
    """Simulate every stage of a schedule together and print makespan, bubble and timeline."""
    parser = argparse.ArgumentParser(prog="merak-simulate", description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b", choices=schedule_names())
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--forward", type=float, default=1.0, help="cost of one forward")
    parser.add_argument("--backward", type=float, default=2.0, help="cost of one backward")
    parser.add_argument("--p2p", type=float, default=0.0, help="cost of one transfer")
    args = parser.parse_args(argv)
    try:
        lists = [build_schedule(name=args.schedule, stage_id=s, num_stages=args.stages,
                                num_microbatches=args.microbatches) for s in range(args.stages)]
        result = simulate(lists, Costs(forward=args.forward, backward=args.backward, p2p=args.p2p))
    except (ScheduleError, ValueError) as error:
        sys.stderr.write(f"merak-simulate: {error}\n")
        return 2
    sys.stdout.write(
        f"{args.schedule}: {args.stages} stages x {args.microbatches} microbatches, "
        f"makespan {result.makespan:g}, bubble {result.bubble_fraction:.1%}\n"
        f"{render_text_timeline(result, args.stages)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
