"""Tensor parallelism on CPU: tp=2 against tp=1, and the overlap levels side by side.

Every contender trains the same GPT-2 (the gpt recipe's model, TP plan and loss)
from the same weights on the same random batches, one thread per process:

* ``tp1``: one process;
* ``tp2-l0``, ``tp2-l1``, ``tp2-l2``: two processes, tp_overlapping_level 0, 1, 2.

Contenders alternate in rounds (the machine is shared and noisy) and the
medians are reported. For level 0 every collective blocks, so the time spent
inside torch.distributed calls is the communication time and the rest of the
step is computation; with overlap the collectives run asynchronously and only
the step time is comparable.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import common
import torch
import torch.distributed as dist

from merak.distributed import collectives, groups
from merak.distributed.launch import spawn_workers
from merak.engine import PipelineEngine
from merak.optim.settings import OptimizerSettings
from merak.session.assemble import assemble
from merak.shard.settings import ShardingSettings
from merak.tensor_parallel.options import TensorParallelSplit
from merak.tensor_parallel.settings import TensorParallelSettings
from recipes.gpt import model as gpt_model
from recipes.gpt import parallel as gpt_parallel

CONTENDERS = {"tp1": (1, 0), "tp2-l0": (2, 0), "tp2-l1": (2, 1), "tp2-l2": (2, 2)}
# The names tensor parallelism calls: merak.distributed.collectives picks the ones this torch prefers; the
# older names stay listed for code that still calls them (on torch 2.13 they do not call the new ones
# through torch.distributed, so nothing is counted twice).
_TIMED_CALLS = tuple(dict.fromkeys(("all_reduce", collectives.ALL_GATHER, collectives.REDUCE_SCATTER,
                                    "all_gather_into_tensor", "reduce_scatter_tensor")))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_model_args(parser)
    parser.set_defaults(hidden_size=768, num_heads=12, num_layers=2, seq_length=128)
    parser.add_argument("--num-microbatches", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup-steps", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=list(CONTENDERS))
    parser.add_argument("--json", default=None, help="write every per-step time here")
    return parser.parse_args(argv)


def _time_collectives(totals: dict) -> None:
    """Accumulate the wall time of blocking collectives (async calls only count their launch)."""
    for name in _TIMED_CALLS:
        original = getattr(dist, name)

        def timed(*args, _original=original, **kwargs):
            started = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                totals["comm"] += time.perf_counter() - started
        setattr(dist, name, timed)


def _worker(options: dict, contender: str, out_path: str) -> None:
    args = argparse.Namespace(**options)
    common.single_thread()
    common.setup_logging()
    tp, level = CONTENDERS[contender]
    state = groups.init(tp=tp, timeout_s=300)
    try:
        model_cfg = common.model_config(args)
        batches = common.random_batches(model_cfg, micro_batch_size=args.micro_batch_size,
                                        num_microbatches=args.num_microbatches,
                                        count=args.warmup_steps + args.steps, seed=args.seed)
        built = assemble(
            build=functools.partial(common.build_model, model_cfg, args.seed), seed=args.seed, init_device="cpu",
            sharding=ShardingSettings(), num_stages=1, num_microbatches=args.num_microbatches, stage_id=0,
            device=state.device, example_inputs={"input_ids": batches[0][0]["input_ids"]},
            tensor_parallel=TensorParallelSplit(plan=gpt_parallel.TP_PLAN, size=tp, rank=state.coordinates.tp,
                                                settings=TensorParallelSettings(tp_overlapping_level=level)))
        engine = PipelineEngine(model=built.model, stages=built.stages, loss_fn=gpt_model.causal_lm_loss,
                                state=state, schedule="1f1b", num_microbatches=args.num_microbatches,
                                total_steps=len(batches),
                                optimizer=OptimizerSettings(learning_rate=1e-4, weight_decay=0.01,
                                                            lr_scheduler_type="constant"))
        totals = {"comm": 0.0}
        _time_collectives(totals)
        steps = []
        for index, step in enumerate(batches):
            totals["comm"] = 0.0
            with common.StepTimer() as timer:
                result = engine.train_step(step)
            if index >= args.warmup_steps:
                steps.append({"wall": timer.wall, "comm": totals["comm"], "loss": result.loss})
        if state.rank == 0:
            torch.save(steps, out_path)
    finally:
        groups.shutdown()


def main(argv=None) -> int:
    args = parse_args(argv)
    common.setup_logging()
    facts = common.machine_facts()
    common.logger.info("%s", common.format_facts(facts))
    results: dict[str, list[dict]] = {name: [] for name in args.contenders}
    out_dir = Path("/tmp/merak-bench-tp")
    out_dir.mkdir(parents=True, exist_ok=True)
    for round_index in range(args.rounds):
        for name in args.contenders:
            path = out_dir / f"{name}-{round_index}.pt"
            spawn_workers(_worker, world_size=CONTENDERS[name][0], args=(vars(args), name, str(path)),
                          env={"OMP_NUM_THREADS": "1"})
            results[name].extend(torch.load(path))
            common.logger.info("round %d %s: median step %.3f s", round_index, name,
                               common.median([s["wall"] for s in results[name]]))
    base = common.median([s["wall"] for s in results[args.contenders[0]]])
    rows = []
    for name, steps in results.items():
        wall = common.median([s["wall"] for s in steps])
        comm = common.median([s["comm"] for s in steps])
        rows.append([name, f"{wall:.3f}", f"{comm:.3f}", f"{wall - comm:.3f}", f"{base / wall:.2f}",
                     f"{steps[-1]['loss']:.4f}", len(steps)])
    print(common.format_facts(facts))
    print(common.format_table(["contender", "median step (s)", "in collectives (s)", "rest (s)",
                               f"speed vs {args.contenders[0]}", "last loss", "steps"], rows))
    common.write_json(args.json, {"facts": facts, "args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
