"""Model-state bytes per rank with ZeRO-3 against ZeRO off, at dp 2 and 4.

    cd bench && ../.venv/bin/python zero3_memory.py [--hidden 256] [--layers 8] [--steps 2] [--out DIR]

A GPT (the toy's vocabulary and sequence, ``--hidden`` wide, ``--layers`` blocks, fp32, AdamW) trains
``--steps`` steps through ``recipes/gpt/train.py`` on dp CPU processes, with ZeRO off and with
``zero_stage=3`` (whose stages are cut at the recipe's split points, so a unit is one block, or the embedding
with the positions, or the head). From each run's
``summary.json`` (rank 0): the model state a rank keeps between steps (parameters, the gradients the
optimizer keeps, master weights and optimizer state) and, on top of it during the step, the most it
held transiently: whole gradients waiting for their reduce-scatter (the peak minus what is kept) and,
with ZeRO-3, the parameters gathered whole (one unit). Logs a markdown table and writes
``DIR/zero3_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import common

STATE_KEYS = ("parameter_bytes", "gradient_bytes_now", "master_weight_bytes", "optimizer_state_bytes")

logger = logging.getLogger("zero3_memory")


def _run(dp: int, zero3: bool, args, run_dir: Path) -> dict:
    zero = ["trainer.zero_optimization=true", "trainer.zero_stage=3",
            # Small reduce buckets: at most about one bucket of whole gradients waits for its reduce-scatter.
            "trainer.zero_reduce_bucket_size=100000"] if zero3 else ["trainer.zero_optimization=false"]
    overrides = ["model=toy", f"model.hidden_size={args.hidden}", f"model.num_layers={args.layers}",
                 f"parallel=dp{dp}",
                 "trainer.per_device_train_batch_size=1", "trainer.gradient_accumulation_steps=1",
                 f"trainer.global_batch_size={dp}", f"trainer.max_steps={args.steps}",
                 "trainer.activation_checkpointing=false", "trainer.disable_tqdm=true", "trainer.save_steps=0",
                 *zero]
    rank0 = common.train_recipe(overrides, run_dir)["ranks"][0]
    row = {"dp": dp, "zero3": zero3, **{key: rank0[key] for key in STATE_KEYS}}
    row["model_state_bytes"] = sum(rank0[key] for key in STATE_KEYS)
    row["waiting_gradient_bytes"] = rank0["gradient_bytes"] - rank0["gradient_bytes_now"]
    row["gathered_parameter_bytes"] = rank0.get("peak_gathered_parameter_bytes", 0)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", default="/tmp/zero3_memory")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for dp in (2, 4):
        for zero3 in (False, True):
            rows.append(_run(dp, zero3, args, out / f"dp{dp}-{'zero3' if zero3 else 'zero0'}"))
            logger.info("%s", rows[-1])
    (out / "zero3_memory.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    mib = 2 ** 20
    lines = ["| dp | ZeRO | parameters | gradients kept | optimizer state | model state | x (ZeRO off / dp) "
             "| + whole gradients waiting | + parameters gathered |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        base = next(r for r in rows if r["dp"] == row["dp"] and not r["zero3"])
        ratio = row["model_state_bytes"] / (base["model_state_bytes"] / row["dp"])
        lines.append(f"| {row['dp']} | {'3' if row['zero3'] else 'off'} | {row['parameter_bytes'] / mib:.2f} MiB | "
                     f"{row['gradient_bytes_now'] / mib:.2f} MiB | {row['optimizer_state_bytes'] / mib:.2f} MiB | "
                     f"{row['model_state_bytes'] / mib:.2f} MiB | {ratio:.3f} | "
                     f"{row['waiting_gradient_bytes'] / mib:.2f} MiB | "
                     f"{row['gathered_parameter_bytes'] / mib:.2f} MiB |")
    logger.info("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
