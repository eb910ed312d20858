"""Pipeline schedules and recomputation measured on CPU: step time and kept activations, pp=2 and pp=4.

One gloo world per pipeline depth (one thread per rank) trains the gpt
recipe's toy model, resized (see ``--help``), with every contender in turn: a
schedule plus a recomputation setting. The stages are captured and
partitioned once per world (``layer_split`` before every block, the project's
``autopipe`` partition by FLOPs; interleaving needs ``2 * pp`` pieces, captured
once more), and the weights are reset before each contender, so every
contender starts from the same weights, sees the same random batches and draws
the same dropout masks. The contenders alternate in rounds (the machine is
shared and noisy); in each round each contender runs the warm-up steps, then
the timed steps (a barrier before each); the median over all rounds of rank
0's ``train_step`` wall time is reported, with each stage's peak activation
bytes (``engine.memory_report()``). The last step of the last round is drawn,
measured, below the same schedule simulated with the measured
per-instruction costs. Like merak.run's workers, each worker keeps
freed memory in its heap (``merak.compat.allocator.keep_freed_memory``).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import common  # sets OMP_NUM_THREADS before torch starts
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from merak.compat.allocator import keep_freed_memory
from merak.distributed import groups
from merak.distributed.launch import spawn_workers
from merak.engine import PipelineEngine
from merak.optim.settings import OptimizerSettings
from merak.pipeline.schedules import build_schedule
from merak.pipeline.settings import ScheduleSettings
from merak.pipeline.simulate import simulate
from merak.pipeline.timeline import (
    MeasuredCosts,
    TimedInstruction,
    draw_comparison,
    events_from_simulation,
)
from merak.pipeline.wall_clock import measured_events
from merak.session.assemble import assemble
from merak.shard.settings import ShardingSettings
from recipes.gpt import model as gpt_model
from recipes.gpt import parallel as gpt_parallel

TOY_CONFIG = Path(__file__).resolve().parent.parent / "recipes/gpt/conf/model/toy.yaml"
MIB = 2**20


@dataclass(frozen=True)
class Contender:
    """A schedule with a recomputation setting (``chunks`` > 1: interleaved)."""

    name: str
    schedule: str
    recompute: ScheduleSettings
    chunks: int = 1


NONE = ScheduleSettings(activation_checkpointing=False)
FULL = ScheduleSettings(activation_checkpointing=True)
CONTENDERS = (
    Contender("1f1b none", "1f1b", NONE),
    Contender("1f1b full", "1f1b", FULL),
    Contender("pre_recompute_1f1b full", "pre_recompute_1f1b", FULL),
    Contender("last_no_recompute_1f1b full", "last_no_recompute_1f1b", FULL),
    Contender("shifted_critical_path r0=0.5", "shifted_critical_path",
              ScheduleSettings(activation_checkpointing=True, activation_checkpoint_ratio=0.5)),
    Contender("interleaved_1f1b V=2", "interleaved_1f1b", NONE, chunks=2),
    Contender("zb_h1 none", "zb_h1", NONE),
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_argument_group("model (recipes/gpt/conf/model/toy.yaml with these sizes)")
    group.add_argument("--vocab-size", type=int, default=8192)
    group.add_argument("--num-layers", type=int, default=8)
    group.add_argument("--hidden-size", type=int, default=256)
    group.add_argument("--seq-length", type=int, default=128)
    group.add_argument("--dropout", type=float, default=0.1)
    group.add_argument("--micro-batch-size", type=int, default=4)
    group.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--num-microbatches", type=int, default=8)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per contender and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--partition-method", default="autopipe", help="merak partition_method of the stages")
    parser.add_argument("--contenders", nargs="+", default=[c.name for c in CONTENDERS],
                        choices=[c.name for c in CONTENDERS])
    parser.add_argument("--pictures", default="bench/results", help="folder of the timeline PNGs ('' for none)")
    parser.add_argument("--json", default=None, help="write every per-step time here")
    return parser.parse_args(argv)


def model_config(args: argparse.Namespace):
    """The toy model config with the benchmark's sizes."""
    sizes = {name: getattr(args, name) for name in ("vocab_size", "num_layers", "hidden_size", "seq_length",
                                                    "dropout")}
    return OmegaConf.merge(OmegaConf.load(TOY_CONFIG), sizes)


def slug(name: str) -> str:
    """File-name form of a contender name."""
    return re.sub(r"[^A-Za-z0-9_.]+", "-", name).strip("-")


def assemble_pieces(args: argparse.Namespace, model_cfg, pieces: int, stage_id: int):
    """Capture the model and cut it into ``pieces`` stages (every rank gets all of them)."""
    options = ShardingSettings(split_method="layer_split", custom_split_points=list(gpt_parallel.SPLIT_POINTS),
                               partition_method=args.partition_method)
    return assemble(build=functools.partial(gpt_model.build_model, model_cfg), seed=args.seed, init_device="cpu",
                    sharding=options, num_stages=pieces, num_microbatches=args.num_microbatches,
                    stage_id=stage_id, device=torch.device("cpu"),
                    example_inputs=gpt_parallel.example_inputs(model_cfg, args.micro_batch_size))


def gather_timeline(engine, rank: int) -> list[TimedInstruction]:
    """The last step's instructions of every stage, times from the earliest (all ranks get them)."""
    everyone = groups.gather_from_all(measured_events(engine.executor, stage=engine.stage_id, rank=rank))
    events = sorted((e for part in everyone for e in part), key=lambda e: (e.stage, e.start))
    origin = min(e.start for e in events)
    return [TimedInstruction(e.stage, e.rank, e.kind, e.label, e.start - origin, e.end - origin) for e in events]


def simulate_measured(contender: Contender, events: list[TimedInstruction], pp: int, num_microbatches: int):
    """The contender's schedule simulated with the per-instruction costs measured in ``events``."""
    lists = [build_schedule(name=contender.schedule, stage_id=s, num_stages=pp, num_microbatches=num_microbatches,
                            num_chunks=contender.chunks) for s in range(pp)]
    return simulate(lists, MeasuredCosts.from_events(events))


def draw(path: Path, contender: Contender, pp: int, events: list[TimedInstruction], predicted) -> None:
    """The simulated-from-measured-costs timeline above the measured one."""
    measured_span = max(e.end for e in events)
    title = f"pp={pp} {contender.name}: simulated with the measured instruction costs, {predicted.makespan:.2f} s"
    panels = [(title, events_from_simulation(predicted)), (f"measured last step, {measured_span:.2f} s", events)]
    draw_comparison(panels, path)
    common.logger.info("wrote %s (%d bytes)", path, path.stat().st_size)


def run_contender(args: argparse.Namespace, state, built, contender: Contender, batches) -> dict:
    """Train one contender from the initial weights; the timings, losses and memory of this rank."""
    engine = PipelineEngine(model=built.model, stages=built.stages, loss_fn=gpt_model.causal_lm_loss, state=state,
                            schedule=contender.schedule, num_microbatches=args.num_microbatches,
                            total_steps=len(batches),
                            optimizer=OptimizerSettings(learning_rate=1e-4, weight_decay=0.01,
                                                        lr_scheduler_type="constant"),
                            recompute=contender.recompute, num_chunks=contender.chunks, dropout_seed=args.seed,
                            record_timeline=True)
    walls, losses = [], []
    for index, step in enumerate(batches):
        dist.barrier()
        with common.StepTimer() as timer:
            result = engine.train_step(step)
        losses.append(result.loss)
        if index >= args.warmup_steps:
            walls.append(timer.wall)
    return {"walls": walls, "losses": losses, "engine": engine,
            "peak_activation_bytes": engine.memory_report()["peak_activation_bytes"]}


def report_contender(args: argparse.Namespace, state, contender: Contender, mine: dict, record: dict,
                     last_round: bool) -> None:
    """Collect one contender's round on rank 0: step times, losses, peaks; its pictures after the last round."""
    pp = state.grid.pp
    events = gather_timeline(mine["engine"], state.rank)
    peaks = groups.gather_from_all(mine["peak_activation_bytes"])
    if state.rank != 0:
        return
    record["walls"] += mine["walls"]
    record["round_medians"].append(common.median(mine["walls"]))
    record["losses"], record["peak_activation_bytes"] = mine["losses"], peaks
    common.logger.info("pp=%d %s: median step %.3f s, peak activations %s MiB", pp, contender.name,
                       record["round_medians"][-1], " / ".join(f"{p / MIB:.1f}" for p in peaks))
    if not last_round:
        return
    predicted = simulate_measured(contender, events, pp, args.num_microbatches)
    record["measured_span"], record["simulated_span"] = max(e.end for e in events), predicted.makespan
    if args.pictures:
        draw(Path(args.pictures) / f"schedules_measured_pp{pp}_{slug(contender.name)}.png", contender, pp,
             events, predicted)


def _world(options: dict, out_path: str) -> None:
    """One worker of a pp-deep world: every contender in turn, in rounds; rank 0 saves the results."""
    args = argparse.Namespace(**options)
    common.single_thread()
    common.setup_logging()
    keep_freed_memory()  # as merak.run's workers do (benchmark 3)
    state = groups.init(pp=args.world_pp, timeout_s=600)
    try:
        model_cfg = model_config(args)
        contenders = [c for c in CONTENDERS if c.name in args.contenders]
        built = {chunks: assemble_pieces(args, model_cfg, state.grid.pp * chunks, state.coordinates.pp)
                 for chunks in sorted({c.chunks for c in contenders})}
        initial = {chunks: {k: v.clone() for k, v in b.model.state_dict().items()} for chunks, b in built.items()}
        batches = common.random_batches(model_cfg, micro_batch_size=args.micro_batch_size,
                                        num_microbatches=args.num_microbatches,
                                        count=args.warmup_steps + args.steps, seed=args.seed)
        records = {c.name: {"walls": [], "round_medians": []} for c in contenders}
        for round_index in range(args.rounds):
            for contender in contenders:
                built[contender.chunks].model.load_state_dict(initial[contender.chunks])
                mine = run_contender(args, state, built[contender.chunks], contender, batches)
                report_contender(args, state, contender, mine, records[contender.name],
                                 last_round=round_index == args.rounds - 1)
        if state.rank == 0:
            torch.save({"boundaries": {chunks: b.plan.boundaries for chunks, b in built.items()},
                        "contenders": records}, out_path)
    finally:
        groups.shutdown()


def stage_modules(boundaries: list[int], num_blocks: int) -> str:
    """Which blocks each piece holds, from shard boundaries (shard 0: embeddings, last: block + head)."""
    names = ["emb"] + [f"h{i}" for i in range(num_blocks)]
    names[-1] += "+head"
    pieces = []
    for first, last in itertools.pairwise(boundaries):
        held = names[first:last]
        pieces.append(held[0] if len(held) == 1 else f"{held[0]}..{held[-1]}")
    return " | ".join(pieces)


def table_rows(pp: int, results: dict) -> list[list[object]]:
    """One Markdown row per contender; ratios against the first contender of the world."""
    contenders = results["contenders"]
    base = common.median(next(iter(contenders.values()))["walls"])
    rows = []
    for name, measured in contenders.items():
        wall = common.median(measured["walls"])
        rows.append([pp, name, f"{wall:.3f}", f"{wall / base:.2f}",
                     f"{measured['measured_span']:.3f}", f"{measured['simulated_span']:.3f}",
                     " / ".join(f"{p / MIB:.1f}" for p in measured["peak_activation_bytes"]),
                     f"{measured['losses'][-1]:.4f}",
                     ", ".join(f"{m:.2f}" for m in measured["round_medians"])])
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    common.setup_logging()
    facts = common.machine_facts()
    common.logger.info("%s", common.format_facts(facts))
    if args.pictures:
        Path(args.pictures).mkdir(parents=True, exist_ok=True)
    everything, rows, layouts = {}, [], []
    with tempfile.TemporaryDirectory(prefix="merak-bench-schedules-") as out_dir:
        for pp in args.pp:
            path = Path(out_dir) / f"pp{pp}.pt"
            spawn_workers(_world, world_size=pp, args=({**vars(args), "world_pp": pp}, str(path)),
                          env={"OMP_NUM_THREADS": "1"})
            everything[pp] = torch.load(path)
            rows += table_rows(pp, everything[pp])
            for chunks, boundaries in everything[pp]["boundaries"].items():
                layouts.append(f"pp={pp}, {pp * chunks} pieces: {stage_modules(boundaries, args.num_layers)}")
    baseline = next(c.name for c in CONTENDERS if c.name in args.contenders)
    sys.stdout.write(common.format_facts(facts) + "\n")
    sys.stdout.write("pieces (shards: emb, one per block, the last block with ln_f + head; rank s runs pieces "
                     "s, s + pp): " + "; ".join(layouts) + "\n\n")
    header = ["pp", "contender", "median step (s)", f"vs {baseline}", "last step, measured (s)",
              "last step, simulated (s)", "peak activations per stage (MiB)", "last loss", "per-round medians (s)"]
    sys.stdout.write(common.format_table(header, rows) + "\n")
    common.write_json(args.json, {"facts": facts, "args": vars(args),
                                  "results": {pp: {"boundaries": r["boundaries"], "contenders": r["contenders"]}
                                              for pp, r in everything.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
