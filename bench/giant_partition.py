"""Plan GPT-3 175B on one CPU process: merak's capture + shard + partition vs torch's pipeline().

Each measurement runs in a fresh subprocess (so peak RSS is its own): the
model is built on the meta device from recipes/gpt/conf/model/gpt3-175b.yaml,
then either

- merak: ``plan_pipeline`` with the default settings (torch.export capture of
  three blocks repeated to 96, ``min_bytes`` cuts, ``autopipe`` on estimated
  costs with machine rates measured in the process),
- merak-whole: the same, but the whole 96-block stack exported (no repeat), or
- torch: ``torch.distributed.pipelining.pipeline()`` split evenly at block
  boundaries (``SplitPoint.BEGINNING``),

for 8 and 64 stages. Prints a table of wall time (build included) and peak RSS.

    python bench/giant_partition.py [--stages 8 64] [--micro-batch 1]
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
logger = logging.getLogger("bench.giant_partition")


def _build():
    from omegaconf import OmegaConf

    from merak.trace.meta import parameters_on_meta
    from recipes.gpt.model import build_model

    cfg = OmegaConf.load(REPO / "recipes/gpt/conf/model/gpt3-175b.yaml")
    with parameters_on_meta():
        model = build_model(cfg)
    return model.train(), cfg


def _measure(tool: str, stages: int, micro_batch: int) -> dict:
    started = time.perf_counter()
    import torch

    import merak  # noqa: F401

    torch.set_num_threads(1)  # nothing is computed on meta; spare both tools thread-pool overheads
    model, cfg = _build()
    inputs = {"input_ids": torch.zeros(micro_batch, cfg.seq_length, dtype=torch.long, device="meta")}
    if tool.startswith("merak"):
        from merak.shard.plan import ShardingSettings, plan_pipeline
        from merak.trace import repeat

        if tool == "merak-whole":
            repeat.MIN_BLOCKS = 10 ** 9  # no stack is long enough: export all 96 blocks
        plan = plan_pipeline(model, inputs, num_stages=stages, num_microbatches=2 * stages,
                             sharding=ShardingSettings(trace_method="dynamo"))
        sends = {value for s in range(stages - 1) for value in plan.stage_summary(s)["sends"].values()}
        result = {"shards": len(plan.shards), "boundaries": plan.boundaries, "sends": sorted(sends),
                  "notes": plan.notes}
    else:
        from torch.distributed.pipelining import SplitPoint, pipeline

        from merak.core.partition import uniform_boundaries

        # Blocks cut evenly, the first stage also embeds.
        shard_bounds = uniform_boundaries(cfg.num_layers + 1, stages)
        split_spec = {f"transformer.h.{b - 1}": SplitPoint.BEGINNING for b in shard_bounds[1:-1]}
        model.config.use_cache = False  # a KV cache is no graph output (merak's capture does the same)
        pipe = pipeline(model, mb_args=(), mb_kwargs=inputs, split_spec=split_spec)
        result = {"stages": pipe.num_stages}
    result.update(tool=tool, num_stages=stages, seconds=time.perf_counter() - started,
                  peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  parameters_b=sum(p.numel() for p in model.parameters()) / 1e9)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--tools", nargs="+", default=["merak", "merak-whole", "torch"])
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # internal: tool stages
    args = parser.parse_args()
    if args.one:
        print(json.dumps(_measure(args.one[0], int(args.one[1]), args.micro_batch)))
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = []
    for stages in args.stages:
        for tool in args.tools:
            out = subprocess.run([sys.executable, __file__, "--one", tool, str(stages),
                                  "--micro-batch", str(args.micro_batch)],
                                 capture_output=True, text=True, check=True, cwd=REPO)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            logger.info("%s", rows[-1])
    logger.info("\n%-6s %-12s %10s %12s  %s", "stages", "tool", "seconds", "peak RSS MB", "sends")
    for row in rows:
        logger.info("%-6d %-12s %10.1f %12.0f  %s", row["num_stages"], row["tool"], row["seconds"], row["peak_rss_mb"],
                    ", ".join(row.get("sends", [])))


if __name__ == "__main__":
    main()
