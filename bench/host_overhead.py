"""Host overhead of merak against a plain PyTorch loop, on a model too small to hide it.

Every width of the model is 32-64 and the inputs are short, so each kernel takes microseconds and
a step's time is almost all host work: Python, dispatch, data. That is what a GPU sees when the host
cannot keep ahead of it, shown here without one. Both loops train the recipe's ``build_model`` on the
same samples in the same order (``recipe_loops.py``): merak through the recipe's real path at
``parallel=single``, the plain loop by hand. They alternate in rounds (the machine is shared); each
round times ``--steps`` whole loop iterations after ``--warmup`` untimed ones. Reported: the median
iteration of each, merak / plain, and the first losses of both (they start from the same weights on
the same batch, so they must agree).

The plain loop does not recompute activations, so merak runs with
``trainer.activation_checkpointing=false`` (the same work).

    .venv/bin/python bench/host_overhead.py [--recipe vit] [--rounds 5 --warmup 3 --steps 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # first: sets OMP_NUM_THREADS before torch starts threads
from recipe_loops import MerakLoop, PlainLoop

logger = logging.getLogger("bench.host_overhead")

# Host-bound sizes: every width 32-64, 17 tokens (16 patches + [CLS]) per image.
MODELS = {
    "vit": ["model=toy", "model.hidden_size=64", "model.intermediate_size=64", "model.num_heads=4",
            "model.num_layers=4", "model.image_size=32", "model.patch_size=8"],
    "swin": ["model=toy"],
    "wide_resnet": ["model=toy"],
}
COMMON = ["trainer.per_device_train_batch_size=4", "trainer.gradient_accumulation_steps=4",
          "trainer.activation_checkpointing=false", "trainer.max_steps=100000", "data.num_samples=4096"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", action="append", choices=sorted(MODELS),
                        help="recipe to measure (repeatable; default: vit)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations per loop per round")
    parser.add_argument("--steps", type=int, default=20, help="timed iterations per loop per round")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers to this JSON file")
    return parser.parse_args(argv)


def measure(recipe: str, args: argparse.Namespace) -> dict:
    overrides = [*MODELS[recipe], *COMMON]
    with tempfile.TemporaryDirectory() as output_dir:
        merak_loop = MerakLoop(recipe, overrides, output_dir)
        plain_loop = PlainLoop(recipe, overrides)
        merak_times, plain_times = [], []
        try:
            for round_index in range(args.rounds):
                merak_times += merak_loop.run(args.warmup + args.steps)[args.warmup:]
                plain_times += plain_loop.run(args.warmup + args.steps)[args.warmup:]
                logger.info("%s round %d: merak %.2f ms, plain %.2f ms", recipe, round_index + 1,
                            1e3 * common.median(merak_times), 1e3 * common.median(plain_times))
        finally:
            merak_loop.close()
    merak_s, plain_s = common.median(merak_times), common.median(plain_times)
    first = (merak_loop.losses[0], plain_loop.losses[0])
    return {"recipe": recipe, "overrides": overrides, "merak_ms": 1e3 * merak_s, "plain_ms": 1e3 * plain_s,
            "ratio": merak_s / plain_s, "first_loss_merak": first[0], "first_loss_plain": first[1],
            "first_loss_rel_diff": abs(first[0] - first[1]) / abs(first[1]),
            "timed_iterations_each": len(merak_times)}


def main(argv=None) -> None:
    args = parse_args(argv)
    common.setup_logging()
    common.single_thread()
    facts = common.machine_facts()
    results = [measure(recipe, args) for recipe in (args.recipe or ["vit"])]
    rows = [(r["recipe"], f"{r['merak_ms']:.2f}", f"{r['plain_ms']:.2f}", f"{r['ratio']:.3f}",
             f"{r['first_loss_merak']:.6f} / {r['first_loss_plain']:.6f}") for r in results]
    print(common.format_facts(facts))
    print(common.format_table(["recipe", "merak ms/step", "plain ms/step", "merak / plain",
                               "first loss merak / plain"], rows))
    common.write_json(args.json, {"machine": facts, "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
