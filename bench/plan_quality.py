"""How good is merak's default pipeline plan? Every block-boundary plan measured, in one run.

The gpt recipe's GPT2LMHeadModel (``--model demo``: the recipe's default model,
50257 x 128 LM head; otherwise the benchmark GPT of bench/common.py) is cut at
every block boundary: before each transformer block and before the LM head
(``layer_split`` on ``transformer.h.*`` and ``lm_head``). Every way of placing
the pp - 1 stage boundaries on those cuts is one *block-boundary plan*; the
*default plan* is what merak picks with its default settings
(``split_method=min_bytes``, ``partition_method=autopipe``,
``autopipe_costs=estimate``: nominal CPU rates; ``--costs calibrated`` measures
them on rank 0).

pp ranks x one thread train each plan with 1F1B (M microbatches, AdamW, no
clipping, no recomputation, freed memory kept as merak's workers keep it) on
the same random batches. Plans are measured in rounds, each round every plan
in turn in a shuffled order (W warm-up + N timed steps), so the machine's noise
and the cost of switching plans hit all of them alike; rank 0 reports each
plan's median step time, the CPU time of its busiest rank, and the default
plan's time over the fastest block-boundary plan's.

    .venv/bin/python bench/plan_quality.py --model demo --pp 2
    .venv/bin/python bench/plan_quality.py --pp 2
    .venv/bin/python bench/plan_quality.py --pp 4 --rounds 1
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # first: sets OMP_NUM_THREADS before torch starts threads
import torch
import torch.distributed as dist

from merak.compat.allocator import keep_freed_memory
from merak.distributed import groups
from merak.distributed.launch import spawn_workers
from merak.engine import PipelineEngine
from merak.optim.settings import OptimizerSettings
from merak.session.assemble import shared_machine_rates
from merak.shard.plan import plan_pipeline
from merak.shard.settings import ShardingSettings
from recipes.gpt.model import causal_lm_loss

logger = logging.getLogger("bench.plan_quality")

BLOCK_CUTS = ("transformer.h.*", "lm_head")
MAX_KEPT_ENGINES = 16  # more plans than this (pp=4: 85) are rebuilt each round instead of kept


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("bench", "demo"), default="bench",
                        help="demo: the gpt recipe's default model (recipes/gpt/conf/model/demo.yaml)")
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages (one rank each)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds over all plans (R)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per plan per round (W)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per plan per round (N)")
    parser.add_argument("--num-microbatches", type=int, default=8, help="microbatches per step (M)")
    parser.add_argument("--costs", default="estimate", choices=("estimate", "calibrated"),
                        help="autopipe_costs of the default plan (calibrated: rates measured on rank 0)")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers to this JSON file")
    common.add_model_args(parser)
    return parser.parse_args(argv)


def model_config(args: argparse.Namespace):
    if args.model == "demo":
        from omegaconf import OmegaConf

        cfg = OmegaConf.load(Path(__file__).resolve().parents[1] / "recipes/gpt/conf/model/demo.yaml")
        cfg.dropout = 0.0
        args.seq_length = cfg.seq_length
        return cfg
    return common.model_config(args)


def block_plans(num_shards: int, pp: int) -> list[list[int]]:
    """Every choice of pp - 1 stage boundaries among the shard cuts (shard 0 holds the embeddings)."""
    return [[0, *cuts, num_shards] for cuts in itertools.combinations(range(1, num_shards), pp - 1)]


def _engine(model, plan, args, state, steps: int) -> PipelineEngine:
    options = OptimizerSettings(learning_rate=1e-4, weight_decay=0.01, max_grad_norm=0.0, lr_scheduler_type="constant")
    return PipelineEngine(model=model, stages=plan.stages(), loss_fn=causal_lm_loss, state=state,
                          schedule="1f1b", num_microbatches=args.num_microbatches, total_steps=steps,
                          optimizer=options)


def _rates(args: argparse.Namespace):
    """Rank 0's measured rates for every rank with ``--costs calibrated`` (so all ranks cut alike)."""
    return shared_machine_rates(torch.device("cpu"), torch.float32) if args.costs == "calibrated" else None


def _worker(options: dict, result_path: str) -> None:
    common.setup_logging()
    common.single_thread()
    keep_freed_memory()  # as merak's workers do by default (launcher.keep_freed_memory)
    args = argparse.Namespace(**options)
    state = groups.init(1, 1, args.pp, timeout_s=1200)
    try:
        model_cfg = model_config(args)
        model = common.build_model(model_cfg, args.seed).train()
        example = {"input_ids": torch.zeros(args.micro_batch_size, model_cfg.seq_length, dtype=torch.long)}
        blocks = plan_pipeline(model, example, num_stages=args.pp, num_microbatches=args.num_microbatches,
                               sharding=ShardingSettings(split_method="layer_split",
                                                         custom_split_points=list(BLOCK_CUTS),
                                                         partition_method="uniform"))
        default = plan_pipeline(model, example, num_stages=args.pp, num_microbatches=args.num_microbatches,
                                sharding=ShardingSettings(autopipe_costs=args.costs), machine_rates=_rates(args))
        plans = {"default": default}
        for bounds in block_plans(len(blocks.shards), args.pp):
            cuts = ", ".join(blocks.reports[b].modules[0] for b in bounds[1:-1])
            plans[f"cut before {cuts}"] = dataclasses.replace(blocks, boundaries=bounds)
        per_round = args.warmup + args.steps
        data = common.random_batches(model_cfg, micro_batch_size=args.micro_batch_size,
                                     num_microbatches=args.num_microbatches, count=per_round, seed=args.seed)
        engines = {}
        times: dict[str, list[float]] = {name: [] for name in plans}
        cpu: dict[str, list[float]] = {name: [] for name in plans}
        for round_index in range(args.rounds):
            order = list(plans)
            random.Random(round_index).shuffle(order)  # the same order on every rank
            for name in order:
                plan = plans[name]
                if name not in engines:
                    engines[name] = _engine(model, plan, args, state, args.rounds * per_round)
                engine = engines[name]
                dist.barrier()
                for step in range(args.warmup):
                    engine.train_step(data[step])
                for step in range(args.warmup, per_round):
                    dist.barrier()
                    started, started_cpu = time.perf_counter(), time.process_time()
                    engine.train_step(data[step])
                    times[name].append(time.perf_counter() - started)
                    cpu[name].append(time.process_time() - started_cpu)
                if args.rounds == 1 or len(plans) > MAX_KEPT_ENGINES:  # bounded memory: rebuild next round
                    del engines[name]
            if state.rank == 0:
                logger.info("round %d/%d done", round_index + 1, args.rounds)
        busy = [None] * args.pp
        dist.all_gather_object(busy, {name: common.median(values) for name, values in cpu.items()})
        if state.rank == 0:
            described = {name: {"boundaries": plan.boundaries, "shards": len(plan.shards),
                                "predicted_step_s": plan.predicted_step_seconds(),
                                "sends": [plan.stage_summary(s)["sends"] for s in range(args.pp - 1)],
                                "median_step_s": common.median(times[name]), "step_s": times[name],
                                "cpu_s_by_rank": [rank_cpu[name] for rank_cpu in busy]}
                         for name, plan in plans.items()}
            Path(result_path).write_text(json.dumps({"plans": described,
                                                     "default_split": [plan_modules(default, s)
                                                                       for s in range(args.pp)]}))
    finally:
        groups.shutdown()


def plan_modules(plan, stage: int) -> str:
    modules = plan.stage_summary(stage)["modules"]
    return f"{modules[0]} .. {modules[-1]}" if len(modules) > 1 else modules[0]


def main(argv=None) -> int:
    args = parse_args(argv)
    common.setup_logging()
    facts = common.machine_facts()
    logger.info("%s", common.format_facts(facts))
    with tempfile.TemporaryDirectory() as folder:
        result_path = str(Path(folder) / "result.json")
        started = time.perf_counter()
        spawn_workers(_worker, world_size=args.pp, args=(vars(args), result_path), env={"OMP_NUM_THREADS": "1"})
        logger.info("workers finished in %.0f s", time.perf_counter() - started)
        result = json.loads(Path(result_path).read_text())
    plans = result["plans"]
    block_times = {name: p["median_step_s"] for name, p in plans.items() if name != "default"}
    fastest = min(block_times, key=block_times.get)
    ratio = plans["default"]["median_step_s"] / block_times[fastest]
    rows = [[name, " ".join(map(str, p["boundaries"])), f"{p['median_step_s']:.3f}",
             f"{p['median_step_s'] / block_times[fastest]:.3f}",
             " / ".join(f"{c:.2f}" for c in p["cpu_s_by_rank"]),
             "-" if p["predicted_step_s"] is None else f"{p['predicted_step_s']:.3f}"]
            for name, p in sorted(plans.items(), key=lambda item: item[1]["median_step_s"])]
    print(f"pipeline plans for GPT-2 ({args.model}), pp={args.pp} x 1 thread, {args.num_microbatches} microbatches "
          f"x {args.micro_batch_size} x {args.seq_length} tokens, 1F1B, AdamW; {args.rounds} rounds x "
          f"{args.steps} timed steps per plan")
    print(common.format_facts(facts))
    print(common.format_table(["plan", "shard boundaries", "median step (s)", "/ fastest block plan",
                               "CPU s/step by rank", "predicted (s)"], rows))
    print(f"default plan: stages {result['default_split']}, sends {plans['default']['sends']}")
    print(f"default / fastest block-boundary plan ({fastest}): {ratio:.3f}  (goal: <= 1.05)")
    common.write_json(args.json, {"benchmark": "plan_quality", "args": vars(args), "machine": facts,
                                  "default_over_fastest_block_plan": ratio, "fastest_block_plan": fastest,
                                  **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
