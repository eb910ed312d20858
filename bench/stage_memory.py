"""The planner's memory per pipeline stage against a measured run, for layouts you name.

No calibration and no trials (memory does not depend on timing): the recipe is planned for
``--world`` processes of this machine, each ``--layout`` is priced by the same cost model, then trained
for 2 steps with ``trainer.measure_activation_memory=true`` (bench/auto_plan.py's memory run).

    .venv/bin/python bench/stage_memory.py --recipe gpt --model demo --world 8 --layout 1,1,8,2,8,zb_h1
"""

from __future__ import annotations

import argparse
import logging
import sys

import common
from auto_plan import memory_run

from merak.autoplan.cluster import load_cluster
from merak.autoplan.layout import Layout
from merak.autoplan.planner import compose_recipe, plan_for_settings, single_process_settings

logger = logging.getLogger("bench.stage_memory")


def parse_layout(text: str) -> Layout:
    """``dp,tp,pp,microbatch,microbatches,schedule``."""
    dp, tp, pp, micro, microbatches, schedule = text.split(",")
    return Layout(dp=int(dp), tp=int(tp), pp=int(pp), micro_batch_size=int(micro),
                  num_microbatches=int(microbatches), schedule=schedule)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="gpt")
    parser.add_argument("--model", default="demo")
    parser.add_argument("--world", type=int, default=8, help="processes")
    parser.add_argument("--layout", action="append", type=parse_layout, required=True,
                        help="dp,tp,pp,microbatch,microbatches,schedule (repeatable)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per training run")
    args = parser.parse_args(argv)
    common.setup_logging()
    global_batch = args.layout[0].global_batch_size
    spec, cfg = compose_recipe(args.recipe, [f"model={args.model}", f"trainer.global_batch_size={global_batch}"])
    report = plan_for_settings(spec, single_process_settings(spec, cfg), world_size=args.world,
                               cluster=load_cluster("this", processes=args.world), global_batch_size=global_batch)
    failed = 0
    for layout in args.layout:
        candidate = report.price(layout)
        record = memory_run(args.recipe, args.model, candidate,
                            argparse.Namespace(global_batch=global_batch, timeout=args.timeout))
        if record.get("error"):
            logger.error("%s: %s", layout.key(), record["error"])
            failed += 1
            continue
        predicted, measured = candidate.prediction.stage_memory, record["stage_memory"]
        logger.info("%s\n  predicted MiB %s\n  measured  MiB %s\n  error %%      %s", layout.key(),
                    [round(p / 2**20, 1) for p in predicted], [round(m / 2**20, 1) for m in measured],
                    [round((p - m) / m * 100, 1) for p, m in zip(predicted, measured)])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
