"""Data-parallel gradient reduction overlapping the backward (``trainer.overlap_grad_reduce``) against after it.

    .venv/bin/python bench/overlap_grad_reduce.py [--hidden 512] [--layers 4] [--steps 12] [--repeats 2] [--out DIR]

A GPT of large gradients for its compute (the toy's vocabulary and sequence of 32, ``--hidden``
wide, ``--layers`` blocks) trains on dp=2 CPU processes (gloo), one microbatch per step, with the
reduction overlapped (the default) and after the backward (``overlap_grad_reduce=false``),
alternating ``--repeats`` times, each a fresh ``recipes/gpt/train.py`` run with
``wall_clock_breakdown`` on. Per run: the median step time (the first step left out) and, from
the timeline of its last step, the time the stage spent in ``reduce_grads`` (the whole reduction
without overlap; the wait for the last buckets with it) and how many buckets started before the
last backward ended. Logs a markdown table and writes ``DIR/overlap_grad_reduce.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "recipes/gpt/train.py"

logger = logging.getLogger("overlap_grad_reduce")


def _run(overlap: bool, args, run_dir: Path) -> dict:
    overrides = ["model=toy", f"model.hidden_size={args.hidden}", f"model.num_layers={args.layers}", "parallel=dp2",
                 "trainer.per_device_train_batch_size=2", "trainer.gradient_accumulation_steps=1",
                 "trainer.global_batch_size=4", f"trainer.max_steps={args.steps}", "trainer.wall_clock_breakdown=true",
                 "trainer.activation_checkpointing=false", "trainer.disable_tqdm=true", "trainer.save_steps=0",
                 f"trainer.overlap_grad_reduce={str(overlap).lower()}", f"hydra.run.dir={run_dir}"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    with open(run_dir.with_suffix(".log"), "w") as log:
        subprocess.run([sys.executable, str(TRAIN), *overrides], cwd=REPO, env=env, stdout=log,
                       stderr=subprocess.STDOUT, check=True, timeout=1800)
    summary = json.loads((run_dir / "summary.json").read_text())
    timeline = summary["timeline"]
    stage = timeline["stages"][0]
    reductions = (timeline.get("dp_reductions") or [{}])[0]
    return {"overlap": overlap, "median_step_s": summary["median_step_time_s"],
            "reduce_grads_s": stage["busy"].get("reduce_grads", 0.0), "span_s": timeline["span"],
            "buckets": len(reductions.get("buckets", [])),
            "buckets_started_before_last_backward_end": reductions.get("started_before_last_backward_end", 0)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="/tmp/overlap_grad_reduce")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for repeat in range(args.repeats):
        for overlap in (False, True) if repeat % 2 == 0 else (True, False):
            run = _run(overlap, args, out / f"{'on' if overlap else 'off'}{repeat}")
            runs.append(run)
            logger.info("%s", run)
    by_mode = {mode: [r for r in runs if r["overlap"] == mode] for mode in (False, True)}
    off = statistics.median(r["median_step_s"] for r in by_mode[False])
    on = statistics.median(r["median_step_s"] for r in by_mode[True])
    share = statistics.median(r["reduce_grads_s"] / r["median_step_s"] for r in by_mode[False])
    result = {"args": vars(args), "runs": runs, "step_off_s": off, "step_on_s": on, "on_over_off": on / off,
              "reduction_share_without_overlap": share}
    (out / "overlap_grad_reduce.json").write_text(json.dumps(result, indent=1))
    lines = ["| run | overlap | median step | reduce_grads (last step) | buckets started in the last backward |",
             "|---|---|---|---|---|"]
    for index, r in enumerate(runs):
        lines.append(f"| {index + 1} | {'on' if r['overlap'] else 'off'} | {r['median_step_s'] * 1e3:.1f} ms | "
                     f"{r['reduce_grads_s'] * 1e3:.1f} ms | "
                     f"{r['buckets_started_before_last_backward_end']} of {r['buckets']} |")
    logger.info("\n".join(lines))
    logger.info("median step: overlapped %.1f ms, after the backward %.1f ms (x%.3f); the reduction is %.0f%% of "
                "the step without overlap", on * 1e3, off * 1e3, on / off, 100 * share)
    return 0


if __name__ == "__main__":
    sys.exit(main())
