"""merak at dp=tp=pp=1 against a plain PyTorch training loop, same model and global batch.

Both train the gpt recipe's GPT2LMHeadModel (random init, random token ids) in
this one process on one thread:

* plain: for each of M microbatches ``model(input_ids).logits`` -> causal_lm_loss
  -> (loss / M).backward(); then clip_grad_norm_(1.0), AdamW step, zero_grad.
* merak: ``PipelineEngine(schedule="1f1b", num_microbatches=M)`` on
  ``groups.init(1, 1, 1)`` with the whole model as its one stage (``merak.session.assemble.CallModel``),
  ``train_step(microbatches)`` (clipping at 1.0, the same AdamW, a constant learning rate).

The machine is shared and noisy, so the two alternate: R rounds of
(W warm-up + N timed steps of plain, then the same of merak); each keeps
training its own model across rounds. Reported: median step time of each and
merak / plain.

    .venv/bin/python bench/plain_vs_merak.py [--rounds 5 --warmup 1 --steps 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # first: sets OMP_NUM_THREADS before torch starts threads)
import torch

from merak.distributed import groups
from merak.engine import PipelineEngine
from merak.optim.settings import OptimizerSettings
from merak.pipeline.stage import StageModule
from merak.session.assemble import CallModel
from recipes.gpt.model import causal_lm_loss

logger = logging.getLogger("bench.plain_vs_merak")

LEARNING_RATE = 1e-4
WEIGHT_DECAY = 0.01
MAX_GRAD_NORM = 1.0


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (R)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per method per round (W)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per method per round (N)")
    parser.add_argument("--num-microbatches", type=int, default=4, help="microbatches per step (M)")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers to this JSON file")
    common.add_model_args(parser)
    return parser.parse_args(argv)


def adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    """AdamW with merak's parameter groups (weight decay on matrices only)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        [{"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
         {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
        lr=LEARNING_RATE, betas=(0.9, 0.999), eps=1e-8)


class PlainLoop:
    """The training loop one would write without merak."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.optimizer = adamw(model)

    def train_step(self, microbatches) -> float:
        self.model.train()
        count = len(microbatches)
        total = torch.zeros(())
        for batch in microbatches:
            loss = causal_lm_loss(self.model(batch["input_ids"]).logits, batch) / count
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), MAX_GRAD_NORM)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(total)


class MerakLoop:
    """merak's engine on a 1x1x1 grid."""

    def __init__(self, model: torch.nn.Module, num_microbatches: int, total_steps: int) -> None:
        state = groups.init(1, 1, 1)
        options = OptimizerSettings(learning_rate=LEARNING_RATE, weight_decay=WEIGHT_DECAY, max_grad_norm=MAX_GRAD_NORM,
                                    lr_scheduler_type="constant")
        self.engine = PipelineEngine(model=model, stages=[StageModule([CallModel(model, ["input_ids"])])],
                                     loss_fn=causal_lm_loss, state=state, schedule="1f1b",
                                     num_microbatches=num_microbatches, total_steps=total_steps, optimizer=options)

    def train_step(self, microbatches) -> float:
        return self.engine.train_step(microbatches).loss


def main(argv=None) -> int:
    args = parse_args(argv)
    common.setup_logging()
    common.single_thread()
    facts = common.machine_facts()
    logger.info("%s", common.format_facts(facts))
    model_cfg = common.model_config(args)
    steps_per_method = args.rounds * (args.warmup + args.steps)
    data = common.random_batches(model_cfg, micro_batch_size=args.micro_batch_size,
                                 num_microbatches=args.num_microbatches, count=steps_per_method, seed=args.seed)

    plain_model = common.build_model(model_cfg, args.seed)
    merak_model = common.build_model(model_cfg, args.seed)
    num_params = common.count_parameters(plain_model)
    logger.info("GPT-2: %.2f M parameters, %d microbatches x %d x %d tokens per step", num_params / 1e6,
                args.num_microbatches, args.micro_batch_size, args.seq_length)
    loops = {"plain": PlainLoop(plain_model),
             "merak": MerakLoop(merak_model, args.num_microbatches, total_steps=steps_per_method)}
    position = dict.fromkeys(loops, 0)
    times = {name: [] for name in loops}
    cpu = {name: [] for name in loops}
    losses = {name: [] for name in loops}
    try:
        for round_index in range(args.rounds):
            for name, loop in loops.items():
                round_times = []
                for step in range(args.warmup + args.steps):
                    batch = data[position[name]]
                    position[name] += 1
                    with common.StepTimer() as timer:
                        loss = loop.train_step(batch)
                    losses[name].append(loss)
                    if step >= args.warmup:
                        round_times.append(timer.wall)
                        times[name].append(timer.wall)
                        cpu[name].append(timer.cpu)
                logger.info("round %d/%d %-5s median %.3f s (loss %.4f)", round_index + 1, args.rounds, name,
                            common.median(round_times), loss)
    finally:
        groups.shutdown()

    medians = {name: common.median(values) for name, values in times.items()}
    cpu_medians = {name: common.median(values) for name, values in cpu.items()}
    ratio = medians["merak"] / medians["plain"]
    # Same weights, same data, same optimizer: the losses must agree (a check that both do the same work).
    loss_gap = max(abs(a - b) for a, b in zip(losses["plain"], losses["merak"]))
    rows = [[name, f"{medians[name]:.3f}", f"{min(times[name]):.3f}", f"{max(times[name]):.3f}",
             f"{cpu_medians[name]:.3f}", len(times[name])] for name in loops]
    table = common.format_table(["loop", "median step (s)", "min (s)", "max (s)", "median CPU-s/step", "steps"], rows)
    print(f"plain PyTorch vs merak (dp=tp=pp=1, 1f1b), {args.num_microbatches} microbatches x "
          f"{args.micro_batch_size} x {args.seq_length} tokens, GPT-2 {num_params / 1e6:.2f} M params")
    print(common.format_facts(facts))
    print(table)
    print(f"merak / plain (median step time): {ratio:.3f}  ({(ratio - 1) * 100:+.1f} %; goal: <= +3 %)")
    print(f"largest loss difference between the two over {len(losses['plain'])} steps: {loss_gap:.2e}")
    common.write_json(args.json, {
        "benchmark": "plain_vs_merak", "args": vars(args), "machine": facts, "parameters": num_params,
        "median_step_s": medians, "median_cpu_s": cpu_medians, "ratio_merak_over_plain": ratio,
        "step_times_s": times, "cpu_times_s": cpu, "losses": losses, "max_loss_difference": loss_gap,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
