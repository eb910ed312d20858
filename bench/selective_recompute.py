"""Selective recomputation against none and full: activation bytes per stage and step time (gpt recipe).

Four runs of ``recipes/gpt/train.py`` per measurement, one per recomputation setting: none
(``activation_checkpointing=false``), full (``true``), and ``selective`` saving ``matmuls`` or all but
the ``attention`` core. Each setting is run twice: once with ``trainer.measure_activation_memory=true``
for the exact peak of saved activations per stage (summary.json's ``stages[].peak_activation_bytes``;
the meter's Python hook per saved tensor slows the step, so these runs are not timed), and once without
the meter for the median step time (summary.json's ``median_step_time_s``, the first step excluded).
Dropout is on (the recipe's toy model has none by default).

    .venv/bin/python bench/selective_recompute.py [--steps 8] [--out /tmp/selective_recompute]
                                                  [--json bench/results/selective_recompute.json]
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # first: sets OMP_NUM_THREADS before torch starts threads

logger = logging.getLogger("bench.selective_recompute")

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "recipes/gpt/train.py"
MODEL = ["model=toy", "model.dropout=0.1", "parallel=pp2", "trainer.per_device_train_batch_size=4",
         "trainer.gradient_accumulation_steps=4"]
SETTINGS = {
    "none": ["trainer.activation_checkpointing=false"],
    "full": ["trainer.activation_checkpointing=true"],
    "selective (matmuls)": ["trainer.activation_checkpointing=selective", "trainer.selective_recompute=matmuls"],
    "selective (attention)": ["trainer.activation_checkpointing=selective",
                              "trainer.selective_recompute=attention"],
}
MEMORY_STEPS = 2


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="steps of each timed run")
    parser.add_argument("--out", default="/tmp/selective_recompute", help="the runs' output directories")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers to this JSON file")
    return parser.parse_args(argv)


def train(overrides: list[str], run_dir: Path) -> dict:
    """One recipe run in its own process: its summary.json."""
    return common.train_recipe(overrides, run_dir, TRAIN)


def measure(name: str, overrides: list[str], args: argparse.Namespace) -> dict:
    """Peak activation bytes per stage (metered run) and median step time (unmetered run) of one setting."""
    slug = name.replace(" ", "_").replace("(", "").replace(")", "")
    metered = train([*MODEL, *overrides, "trainer.measure_activation_memory=true",
                     f"trainer.max_steps={MEMORY_STEPS}"], Path(args.out) / f"{slug}_memory")
    timed = train([*MODEL, *overrides, f"trainer.max_steps={args.steps}"], Path(args.out) / f"{slug}_time")
    result = {"setting": name, "overrides": overrides,
              "peak_activation_bytes": [stage["peak_activation_bytes"] for stage in metered["stages"]],
              "median_step_time_s": timed["median_step_time_s"], "final_loss": timed["final_loss"]}
    logger.info("%s: %s", name, result)
    return result


def table(results: list[dict]) -> str:
    """The markdown table: bytes per stage (and against none) and step time (and against none)."""
    none = results[0]
    header = ["setting", *[f"stage {i} peak activations" for i in range(len(none["peak_activation_bytes"]))],
              "stage 0 vs none", "median step", "step vs none"]
    rows = []
    for result in results:
        peaks = result["peak_activation_bytes"]
        rows.append((result["setting"], *[f"{peak / 2**20:.3f} MiB" for peak in peaks],
                     f"{peaks[0] / none['peak_activation_bytes'][0]:.2f}",
                     f"{1e3 * result['median_step_time_s']:.0f} ms",
                     f"{result['median_step_time_s'] / none['median_step_time_s']:.2f}"))
    return common.format_table(header, rows)


def main(argv=None) -> None:
    args = parse_args(argv)
    common.setup_logging()
    facts = common.machine_facts()
    results = [measure(name, overrides, args) for name, overrides in SETTINGS.items()]
    print(common.format_facts(facts))
    print(table(results))
    common.write_json(args.json, {"machine": facts, "args": vars(args), "model": MODEL, "results": results})


if __name__ == "__main__":
    main()
