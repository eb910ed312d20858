"""merak-simulate: check a pipeline schedule and show its timeline without running a model.

    merak-simulate --schedule 1f1b --stages 4 --microbatches 8 [--backward 2] [--checkpoint-ratio 0.5]
"""

from __future__ import annotations

import argparse
import sys

from merak.pipeline.recompute import stage_checkpoint_ratios
from merak.pipeline.schedules import (
    DEFAULT_CHUNKS,
    build_schedule,
    schedule_info,
    schedule_names,
)
from merak.pipeline.simulate import Costs, ScheduleError, render_text_timeline, simulate


def main(argv: list[str] | None = None, *, prog: str = "merak-simulate") -> int:
    """Simulate every stage of a schedule together and print makespan, bubble and timeline."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b", choices=schedule_names())
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--forward", type=float, default=1.0, help="cost of one forward")
    parser.add_argument("--backward", type=float, default=2.0, help="cost of one backward")
    parser.add_argument("--p2p", type=float, default=0.0, help="cost of one transfer")
    parser.add_argument("--recompute", type=float, default=None, help="cost of recomputing a stage (default: forward)")
    parser.add_argument("--checkpoint-ratio", type=float, default=None,
                        help="first stage's activation_checkpoint_ratio (stage-aware); default: no checkpointing")
    parser.add_argument("--chunks", type=int, default=None, help="model chunks per stage (interleaved_1f1b: 2)")
    args = parser.parse_args(argv)
    try:
        info = schedule_info(args.schedule)
        chunks = args.chunks if args.chunks is not None else (DEFAULT_CHUNKS if info.chunked else 1)
        ratios = () if args.checkpoint_ratio is None else tuple(stage_checkpoint_ratios(
            args.checkpoint_ratio, args.stages, last_stage_checkpoints=info.last_stage_checkpoints))
        lists = [build_schedule(name=args.schedule, stage_id=s, num_stages=args.stages,
                                num_microbatches=args.microbatches, num_chunks=chunks) for s in range(args.stages)]
        result = simulate(lists, Costs(forward=args.forward, backward=args.backward, p2p=args.p2p,
                                       recompute=args.recompute, checkpoint_ratios=ratios))
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
