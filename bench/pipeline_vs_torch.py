"""merak's 1F1B pipeline against torch.distributed.pipelining's Schedule1F1B (pp ranks, gloo).

pp ranks x one thread train the gpt recipe's GPT2LMHeadModel, M microbatches
per step, AdamW step included, no gradient clipping:

* merak: ``PipelineEngine(schedule="1f1b")`` on ``groups.init(1, 1, pp)``, with
  the stages merak's default automatic plan makes (``--merak-plan auto``: graph
  capture, ``min_bytes`` cuts, ``autopipe`` on estimated costs; ``--costs
  calibrated`` weighs them with rates measured on rank 0), or the hand split
  below (``--merak-plan hand``).
* torch: ``PipelineStage`` around the hand split
  (``bench/gpt_stages.hand_stages(model, pp)``: the blocks spread evenly,
  embeddings with the first stage, ln_f + lm_head with the last; stage 0
  wrapped to take an ``input_ids`` tensor instead of a dict) and ``Schedule1F1B``.

torch pipelining cannot tie a weight across stages, so both build the model
with the LM head *untied* from the token embedding (the head gets its own copy
of the initial matrix). Both models start from the same weights and see the
same random token ids, so their losses must agree.

The 2 ranks are spawned once; inside them the methods alternate, R rounds of
(W warm-up + N timed steps of merak, then of torch, then of a single-process
plain loop on rank 0 with the same global batch while rank 1 waits), so the
noise of the shared machine hits all three alike. Rank 0 reports median step
times, merak / torch, CPU-seconds per step summed over the ranks against the
single-process CPU time, and merak's step against the ideal 1F1B step
(single-process time x (M + S - 1) / (M * S)).

    .venv/bin/python bench/pipeline_vs_torch.py [--pp 2] [--merak-plan auto|hand] [--rounds 5 --warmup 1 --steps 4]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # first: sets OMP_NUM_THREADS before torch starts threads)
import torch
import torch.distributed as dist
from gpt_stages import hand_stages
from torch import nn

from merak.distributed import groups
from merak.distributed.launch import spawn_workers
from merak.engine import PipelineEngine
from merak.optim.settings import OptimizerSettings
from merak.session.assemble import shared_machine_rates
from merak.shard.plan import plan_pipeline
from merak.shard.settings import ShardingSettings
from recipes.gpt.model import causal_lm_loss

logger = logging.getLogger("bench.pipeline_vs_torch")

LEARNING_RATE = 1e-4
WEIGHT_DECAY = 0.01
METHODS = ("merak", "torch", "single")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (R)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per method per round (W)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per method per round (N)")
    parser.add_argument("--num-microbatches", type=int, default=8, help="microbatches per step (M)")
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages, one rank each (S)")
    parser.add_argument("--merak-plan", choices=("auto", "hand"), default="auto",
                        help="merak's stages: its default automatic plan, or the hand split torch uses")
    parser.add_argument("--costs", default="estimate", choices=("estimate", "calibrated"),
                        help="autopipe_costs of merak's automatic plan (calibrated: rates measured on rank 0)")
    parser.add_argument("--no-single", action="store_true",
                        help="skip the single-process reference (no CPU ratio then)")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers to this JSON file")
    common.add_model_args(parser)
    return parser.parse_args(argv)


def adamw(module: nn.Module) -> torch.optim.AdamW:
    """AdamW with merak's parameter groups (weight decay on matrices only)."""
    params = [p for p in module.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        [{"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
         {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
        lr=LEARNING_RATE, betas=(0.9, 0.999), eps=1e-8)


class InputIdsStage(nn.Module):
    """The first stage for torch pipelining: takes the ``input_ids`` tensor, not the batch dict."""

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.stage({"input_ids": input_ids})


def pipelining_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return causal_lm_loss(logits, {"labels": labels})


class MerakMethod:
    def __init__(self, model_cfg, args, state, total_steps: int) -> None:
        model = common.build_model(model_cfg, args.seed, untie=True)
        options = OptimizerSettings(learning_rate=LEARNING_RATE, weight_decay=WEIGHT_DECAY, max_grad_norm=0.0,
                                    lr_scheduler_type="constant")
        if args.merak_plan == "auto":
            example = {"input_ids": torch.zeros(args.micro_batch_size, args.seq_length, dtype=torch.long)}
            self.plan = plan_pipeline(model, example, num_stages=args.pp, num_microbatches=args.num_microbatches,
                                      sharding=ShardingSettings(autopipe_costs=args.costs), machine_rates=_rates(args))
            stages = self.plan.stages()
        else:
            self.plan, stages = None, hand_stages(model, args.pp)
        self.engine = PipelineEngine(model=model, stages=stages,
                                     loss_fn=causal_lm_loss, state=state, schedule="1f1b",
                                     num_microbatches=args.num_microbatches, total_steps=total_steps,
                                     optimizer=options)
        assert not self.engine.tied, "the benchmark model must have no weights shared between stages"

    def step(self, microbatches, full_batch) -> float | None:
        return self.engine.train_step(microbatches).loss


class TorchMethod:
    def __init__(self, model_cfg, args, rank: int) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        model = common.build_model(model_cfg, args.seed, untie=True)
        stage_module = hand_stages(model, args.pp)[rank]
        if rank == 0:
            submodule = InputIdsStage(stage_module)
            example = torch.zeros(args.micro_batch_size, args.seq_length, dtype=torch.long)
        else:
            submodule = stage_module
            example = torch.zeros(args.micro_batch_size, args.seq_length, args.hidden_size)
        self.rank = rank
        self.stage = PipelineStage(submodule, rank, args.pp, torch.device("cpu"), input_args=example)
        self.schedule = Schedule1F1B(self.stage, args.num_microbatches, loss_fn=pipelining_loss)
        self.optimizer = adamw(submodule)
        self.submodule = submodule

    def step(self, microbatches, full_batch) -> float | None:
        self.submodule.train()
        if self.rank == 0:
            self.schedule.step(full_batch)
            loss = None
        elif not self.stage.is_last:
            self.schedule.step()
            loss = None
        else:
            losses: list[torch.Tensor] = []
            self.schedule.step(target=full_batch, losses=losses)
            loss = float(torch.stack([x.detach() for x in losses]).mean())
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss


class SingleMethod:
    """The plain loop in one process (rank 0) on the same global batch, no clipping."""

    def __init__(self, model_cfg, args) -> None:
        self.model = common.build_model(model_cfg, args.seed, untie=True)
        self.optimizer = adamw(self.model)

    def step(self, microbatches, full_batch) -> float:
        self.model.train()
        total = torch.zeros(())
        for batch in microbatches:
            loss = causal_lm_loss(self.model(batch["input_ids"]).logits, batch) / len(microbatches)
            loss.backward()
            total += loss.detach()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(total)


def _rates(args: argparse.Namespace):
    """Rank 0's measured rates for every rank with ``--costs calibrated`` (so all ranks cut alike)."""
    return shared_machine_rates(torch.device("cpu"), torch.float32) if args.costs == "calibrated" else None


def _worker(options: dict, result_path: str) -> None:
    common.setup_logging()
    logging.getLogger("torch.distributed.pipelining").setLevel(logging.WARNING)
    common.single_thread()
    args = argparse.Namespace(**options)
    state = groups.init(1, 1, args.pp, timeout_s=600)
    rank = state.rank
    try:
        model_cfg = common.model_config(args)
        steps_per_method = args.rounds * (args.warmup + args.steps)
        data = common.random_batches(model_cfg, micro_batch_size=args.micro_batch_size,
                                     num_microbatches=args.num_microbatches, count=steps_per_method,
                                     seed=args.seed)
        # torch pipelining takes the whole batch and splits it: inputs on the first rank, targets on the last.
        field = "input_ids" if rank == 0 else "labels"
        full = [torch.cat([mb[field] for mb in step]) for step in data]
        methods = {"merak": MerakMethod(model_cfg, args, state, steps_per_method),
                   "torch": TorchMethod(model_cfg, args, rank)}
        if not args.no_single:
            methods["single"] = SingleMethod(model_cfg, args) if rank == 0 else None
        wall = {name: [] for name in methods}
        cpu = {name: [] for name in methods}
        block = {name: [] for name in methods}
        losses = {name: [] for name in methods}
        for round_index in range(args.rounds):
            for name, method in methods.items():
                position = round_index * (args.warmup + args.steps)
                dist.barrier()
                if method is not None:  # the single-process reference runs on rank 0 only
                    for step in range(args.warmup):
                        losses[name].append(method.step(data[position + step], full[position + step]))
                dist.barrier()
                start = time.perf_counter()
                round_wall = []
                if method is not None:
                    for step in range(args.warmup, args.warmup + args.steps):
                        with common.StepTimer() as timer:
                            loss = method.step(data[position + step], full[position + step])
                        losses[name].append(loss)
                        round_wall.append(timer.wall)
                        wall[name].append(timer.wall)
                        cpu[name].append(timer.cpu)
                dist.barrier()
                block[name].append((time.perf_counter() - start) / args.steps)
                if rank == 0:
                    logger.info("round %d/%d %-6s median %.3f s/step on rank 0", round_index + 1, args.rounds,
                                name, common.median(round_wall))
        gathered = [None] * args.pp
        merak_plan = methods["merak"].plan
        plan = None if merak_plan is None else {
            "boundaries": merak_plan.boundaries,
            "stages": [merak_plan.stage_summary(s)["modules"] for s in range(args.pp)],
            "sends": [merak_plan.stage_summary(s)["sends"] for s in range(args.pp - 1)]}
        dist.all_gather_object(gathered, {"wall": wall, "cpu": cpu, "block": block, "losses": losses,
                                          "plan": plan})
        if rank == 0:
            Path(result_path).write_text(json.dumps(gathered))
    finally:
        groups.shutdown()


def summarize(per_rank: list[dict], args: argparse.Namespace) -> dict:
    methods = [m for m in METHODS if m in per_rank[0]["wall"]]
    summary = {"median_step_s_rank0": {}, "mean_step_s_barrier_to_barrier": {}, "median_cpu_s_per_step": {},
               "median_cpu_s_per_step_by_rank": {}}
    for name in methods:
        summary["median_step_s_rank0"][name] = common.median(per_rank[0]["wall"][name])
        summary["mean_step_s_barrier_to_barrier"][name] = common.median(per_rank[0]["block"][name])
        by_rank = [r["cpu"][name] for r in per_rank if r["cpu"][name]]
        summed = [sum(values) for values in zip(*by_rank)]  # same step on every rank
        summary["median_cpu_s_per_step"][name] = common.median(summed)
        summary["median_cpu_s_per_step_by_rank"][name] = [common.median(r["cpu"][name]) if r["cpu"][name] else 0.0
                                                          for r in per_rank]
    wall = summary["median_step_s_rank0"]
    cpu = summary["median_cpu_s_per_step"]
    summary["ratio_merak_over_torch_wall"] = wall["merak"] / wall["torch"]
    summary["ratio_merak_over_torch_cpu"] = cpu["merak"] / cpu["torch"]
    if "single" in methods:
        stages, microbatches = args.pp, args.num_microbatches
        summary["ideal_1f1b_step_s"] = wall["single"] * (microbatches + stages - 1) / (microbatches * stages)
        summary["fraction_of_ideal_1f1b"] = {name: summary["ideal_1f1b_step_s"] / wall[name]
                                             for name in ("merak", "torch")}
        summary["ratio_cpu_over_single"] = {name: cpu[name] / cpu["single"] for name in ("merak", "torch")}
        summary["speedup_over_single_wall"] = {name: wall["single"] / wall[name] for name in ("merak", "torch")}
        # Each microbatch crosses every boundary twice (activation, gradient): the host work a pipeline adds
        # over the single process, per transfer (the whole of it on a host-bound model).
        transfers = 2 * microbatches * (stages - 1)
        summary["transfers_per_step"] = transfers
        summary["extra_cpu_s_per_transfer"] = {name: (cpu[name] - cpu["single"]) / transfers
                                               for name in ("merak", "torch")}
    # Loss check: merak's loss is known on every rank, torch's on the last rank, single's on rank 0.
    loss_lists = {"merak": per_rank[0]["losses"]["merak"], "torch": per_rank[-1]["losses"]["torch"]}
    if "single" in methods:
        loss_lists["single"] = per_rank[0]["losses"]["single"]
    # The loss lists hold warm-up and timed steps of every round in data order.
    summary["max_loss_difference_vs_merak"] = {
        name: max(abs(a - b) for a, b in zip(values, loss_lists["merak"]))
        for name, values in loss_lists.items() if name != "merak"}
    summary["final_loss"] = {name: values[-1] for name, values in loss_lists.items()}
    return summary


def main(argv=None) -> int:
    args = parse_args(argv)
    common.setup_logging()
    common.single_thread()
    facts = common.machine_facts()
    logger.info("%s", common.format_facts(facts))
    model_cfg = common.model_config(args)
    num_params = common.count_parameters(common.build_model(model_cfg, args.seed, untie=True))
    logger.info("GPT-2 (LM head untied): %.2f M parameters, pp=%d, %d microbatches x %d x %d tokens per step",
                num_params / 1e6, args.pp, args.num_microbatches, args.micro_batch_size, args.seq_length)
    with tempfile.TemporaryDirectory() as folder:
        result_path = str(Path(folder) / "result.json")
        started = time.perf_counter()
        spawn_workers(_worker, world_size=args.pp, args=(vars(args), result_path),
                      env={"OMP_NUM_THREADS": "1"})
        logger.info("workers finished in %.0f s", time.perf_counter() - started)
        per_rank = json.loads(Path(result_path).read_text())
    summary = summarize(per_rank, args)

    plan_name = "default automatic plan" if args.merak_plan == "auto" else "hand split"
    labels = {"merak": f"merak 1f1b (pp={args.pp}, {plan_name})",
              "torch": f"torch Schedule1F1B (pp={args.pp}, hand split)",
              "single": "single process (1 rank)"}
    rows = []
    for name in summary["median_step_s_rank0"]:
        by_rank = summary["median_cpu_s_per_step_by_rank"][name]
        cpu_ratio = (f"{summary['ratio_cpu_over_single'][name]:.2f}" if "ratio_cpu_over_single" in summary
                     and name in summary["ratio_cpu_over_single"] else "1.00" if name == "single" else "-")
        rows.append([labels[name], f"{summary['median_step_s_rank0'][name]:.3f}",
                     f"{summary['mean_step_s_barrier_to_barrier'][name]:.3f}",
                     f"{summary['median_cpu_s_per_step'][name]:.3f}",
                     " / ".join(f"{v:.3f}" for v in by_rank), cpu_ratio])
    table = common.format_table(["method", "median step (s)", "mean step, barrier to barrier (s)",
                                 "CPU-s/step (sum of ranks)", "CPU-s/step rank 0 / rank 1",
                                 "CPU-s / single-process CPU-s"], rows)
    print(f"merak vs torch.distributed.pipelining, pp={args.pp} x 1 thread on gloo, "
          f"{args.num_microbatches} microbatches x {args.micro_batch_size} x {args.seq_length} tokens, "
          f"GPT-2 {num_params / 1e6:.2f} M params (LM head untied), AdamW, no clipping; "
          f"{args.rounds} rounds x {args.steps} timed steps")
    print(common.format_facts(facts))
    print(table)
    ratio = summary["ratio_merak_over_torch_wall"]
    goal = "0.95" if args.merak_plan == "auto" else "1.0"
    print(f"merak / torch (median step time): {ratio:.3f}  ({(ratio - 1) * 100:+.1f} %; goal: <= {goal})")
    print(f"merak / torch (CPU-s per step):   {summary['ratio_merak_over_torch_cpu']:.3f}")
    if "extra_cpu_s_per_transfer" in summary:
        extra = summary["extra_cpu_s_per_transfer"]
        print(f"CPU-s over the single process per transfer ({summary['transfers_per_step']} per step): "
              f"merak {extra['merak'] * 1e6:.0f} us, torch {extra['torch'] * 1e6:.0f} us")
    if "fraction_of_ideal_1f1b" in summary:
        print(f"ideal 1F1B step (single-process step x (M+S-1)/(M*S)): {summary['ideal_1f1b_step_s']:.3f} s; "
              + ", ".join(f"{name} reaches {value * 100:.0f} %"
                          for name, value in summary["fraction_of_ideal_1f1b"].items()) + " of it (goal: >= 90 %)")
    if per_rank[0]["plan"] is not None:
        plan = per_rank[0]["plan"]
        print(f"merak's plan: shard boundaries {plan['boundaries']}, stages "
              + "; ".join(f"{m[0]} .. {m[-1]}" for m in plan["stages"]) + f"; sends {plan['sends']}")
    print("largest loss difference from merak over all steps: "
          + ", ".join(f"{k} {v:.2e}" for k, v in summary["max_loss_difference_vs_merak"].items()))
    common.write_json(args.json, {"benchmark": "pipeline_vs_torch", "args": vars(args), "machine": facts,
                                  "parameters": num_params, **summary, "per_rank": per_rank})
    return 0


if __name__ == "__main__":
    sys.exit(main())
