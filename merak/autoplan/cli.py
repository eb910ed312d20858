"""``merak-plan``: rank every parallel layout of a recipe's model on a cluster, without training.

    merak-plan gpt model=toy trainer.global_batch_size=16 --world 4
    merak-plan gpt model=gpt3-175b model.seq_length=2048 trainer.bf16=true trainer.global_batch_size=2048 \\
        --cluster h100-80 --nodes 64 \\
        --compare megatron-core:tp=4,pp=8,mb=2,schedule=interleaved_1f1b,chunks=6,sp=1,recompute=selective,zero=1

Prints the ranked table (predicted step time, MFU, memory per device, why each runner-up lost), for a
GPU cluster the commands that run the first layout there (torchrun, srun, SLURM), and writes the plan
as JSON (``--out``; default ``outputs/merak-plan/RECIPE-CLUSTER-Nn.json``). ``--compare NAME:KEY=VALUE,...``
prices a layout of your own beside them (keys: dp, tp, pp, mb, schedule, chunks, recompute (0, 1 or
selective), zero (0-3), sp; dp defaults to what the world leaves, mb to 1, schedule to 1f1b, the rest to off;
NAME only labels the row). ``--attention fused|math`` prices the activations of that attention kernel
rather than the cluster's device's.
``--objective energy`` (or ``energy@1.1x``, ``energy@250ms``) ranks by predicted energy per step, each
layout with its own GPU clock plan, and writes the first layout's frontier beside the JSON
(``...frontier.json``) with the settings that run it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from merak.autoplan.attention import KERNELS
from merak.autoplan.cluster import load_cluster, usable_cores
from merak.autoplan.commands import format_commands, launch_commands, run_overrides
from merak.autoplan.energy import frontier_for_run
from merak.autoplan.layout import RECOMPUTE_FULL, RECOMPUTE_MODES, RECOMPUTE_OFF, Layout
from merak.autoplan.planner import (
    PlanError,
    compose_recipe,
    plan_for_settings,
    requested_global_batch,
    single_process_settings,
)
from merak.autoplan.table import format_table

logger = logging.getLogger("merak.plan")


def _recompute(value: str) -> str:
    """``recompute=``: 0 or off, 1 or full, selective."""
    mode = {"0": RECOMPUTE_OFF, "1": RECOMPUTE_FULL}.get(value, value)
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute={value!r}: use 0, 1 or selective")
    return mode


_COMPARE_KEYS = {"dp": int, "tp": int, "pp": int, "mb": int, "schedule": str, "chunks": int, "recompute": _recompute,
                 "zero": int, "sp": int}


def parse_layout(text: str, world_size: int, global_batch_size: int) -> tuple[str, Layout]:
    """``NAME:tp=4,pp=8,...`` as a named :class:`Layout` of ``world_size`` devices (ValueError if invalid)."""
    name, _, body = text.rpartition(":")
    values: dict[str, object] = {}
    for item in filter(None, body.split(",")):
        key, _, value = item.partition("=")
        if key not in _COMPARE_KEYS:
            raise ValueError(f"--compare: unknown key {key!r}; use {', '.join(_COMPARE_KEYS)}")
        values[key] = _COMPARE_KEYS[key](value)
    tp, pp = int(values.get("tp", 1)), int(values.get("pp", 1))
    dp = int(values.get("dp", world_size // (tp * pp)))
    if dp * tp * pp != world_size:
        raise ValueError(f"--compare {text}: dp*tp*pp = {dp * tp * pp}, the world is {world_size}")
    micro = int(values.get("mb", 1))
    if global_batch_size % (dp * micro):
        raise ValueError(f"--compare {text}: the global batch {global_batch_size} does not divide by dp x mb")
    layout = Layout(dp=dp, tp=tp, pp=pp, micro_batch_size=micro,
                    num_microbatches=global_batch_size // (dp * micro), schedule=str(values.get("schedule", "1f1b")),
                    chunks=int(values.get("chunks", 1)), recompute=str(values.get("recompute", RECOMPUTE_OFF)),
                    zero_stage=int(values.get("zero", 0)), sequence_parallel=bool(values.get("sp", 0)))
    return name or "compare", layout


def _parser(prog: str = "merak-plan") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("recipe", help="a recipe under recipes/ (gpt, bert, t5, llama, vit, swin, wide_resnet)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the recipe (model=..., trainer.*=...)")
    parser.add_argument("--cluster", default="this",
                        help="a preset (a100-40, a100-80, h100-80, h200), 'this' (this machine's processes) or a "
                             "YAML/JSON file (default: this)")
    parser.add_argument("--nodes", type=int, help="nodes of the cluster (a preset has 1)")
    parser.add_argument("--devices-per-node", type=int, help="devices per node (a GPU preset has 8)")
    parser.add_argument("--world", type=int,
                        help="devices to plan for (default: the whole cluster; with --cluster this, one per core)")
    parser.add_argument("--top", type=int, default=10, help="rows of the table (default: 10)")
    parser.add_argument("--compare", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                        help="price this layout beside the ranked ones (repeatable)")
    parser.add_argument("--objective", default="time",
                        help="time (the fastest step) | energy (the least energy per step, with each layout's own "
                             "GPU clock plan) | energy@1.1x (within 10%% of the fastest step) | energy@250ms "
                             "(within a step time); energy objectives write the first layout's frontier beside the "
                             "JSON and print the settings that run its clock plan (default: time)")
    parser.add_argument("--attention", choices=KERNELS, default="auto",
                        help="the attention kernel whose saved tensors are priced: the cluster's device's (auto), "
                             "fused (no scores kept) or math (scores kept) (default: auto)")
    parser.add_argument("--out", default=None,
                        help="where to write the plan (default: outputs/merak-plan/RECIPE-CLUSTER-Nn.json)")
    return parser


def main(argv: list[str] | None = None, *, prog: str = "merak-plan") -> int:
    """Run ``merak-plan`` with ``argv``; returns the exit status (2: the request cannot be planned)."""
    args = _parser(prog).parse_intermixed_args(argv)  # overrides may follow the options too
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        processes = args.world or (usable_cores() if args.cluster == "this" else None)
        cluster = load_cluster(args.cluster, processes=processes)
        cluster = cluster.with_size(nodes=args.nodes, devices_per_node=args.devices_per_node)
        world = args.world or cluster.world_size
        spec, cfg = compose_recipe(args.recipe, args.overrides)
        batch = requested_global_batch(cfg)
        compared = [parse_layout(text, world, batch) for text in args.compare]
        report = plan_for_settings(spec, single_process_settings(spec, cfg), world_size=world, cluster=cluster,
                                   global_batch_size=batch, objective=args.objective, attention=args.attention)
        extra = [(name, report.price(layout)) for name, layout in compared]
    except (PlanError, ValueError) as error:
        logger.error("%s", error)
        return 2
    out = args.out or os.path.join("outputs", "merak-plan", f"{args.recipe}-{cluster.name}-{cluster.nodes}n.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    clock_plan = {}
    if report.objective.wants_energy:
        frontier = os.path.abspath(os.path.splitext(out)[0] + ".frontier.json")
        deadline = frontier_for_run(report, report.best, report.objective, frontier)
        clock_plan = {"trainer.frequency_frontier": frontier, "trainer.frontier_deadline": f"{deadline:.9g}"}
    print(format_table(report, top=args.top, extra=extra))
    settings = [f"{key}={value}" for key, value in clock_plan.items()]
    if cluster.device_type == "cuda":
        commands = launch_commands(f"recipes/{args.recipe}/train.py", [*args.overrides, *settings],
                                   report.best.layout, cluster)
        print(f"to run the first layout on {cluster.name}:\n{format_commands(commands)}")
    elif clock_plan:
        print("to run the first layout with its clock plan:\n  " + " ".join(
            [f"python recipes/{args.recipe}/train.py", *run_overrides(args.overrides, report.best.layout), *settings]))
    payload = report.to_json(top=max(args.top, 50))
    payload["compared"] = [{"name": name, **c.to_json(), "mfu": report.mfu(c)} for name, c in extra]
    payload["run_clock_plan"] = clock_plan or None
    with open(out, "w", encoding="utf-8") as handle:
        json.dump(payload, handle, indent=1)
    logger.info("wrote %s", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
