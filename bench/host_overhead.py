"""Host overhead of merak against a plain PyTorch loop, on a model too small to hide it.

Every width of the model is 32-64 and the inputs are short, so each kernel takes microseconds and
a step's time is almost all host work: Python, dispatch, data. That is what a GPU sees when the host
cannot keep ahead of it, shown here without one. Both loops train the recipe's ``build_model`` on the
same samples in the same order (``recipe_loops.py``): merak through the recipe's real path at
``parallel=single``, the plain loop by hand. They alternate in rounds (the machine is shared); each
round times ``--steps`` whole loop iterations after ``--warmup`` untimed ones. Reported: the median
iteration of each, merak / plain, and the first losses (every loop starts from the same weights on
the same batch, so they must agree).

The plain loop does not recompute activations, so merak runs with
``trainer.activation_checkpointing=false`` (the same work).

    .venv/bin/python bench/host_overhead.py [--recipe vit] [--rounds 5 --warmup 3 --steps 20] [--compile]
                                            [--json out.json]

``--compile`` alternates four loops: both eager, and both compiled with inductor (merak:
``trainer.torch_compile=true``; plain: ``model.compile()``); compilation happens in the first
round's warm-up.
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
    parser.add_argument("--compile", action="store_true",
                        help="also alternate both loops compiled (merak trainer.torch_compile, plain model.compile())")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers to this JSON file")
    return parser.parse_args(argv)


def _loops(recipe: str, overrides: list[str], output_dir: str, compiled: bool) -> dict:
    """The loops to alternate: merak and plain, and with ``--compile`` both compiled too."""
    loops = {"merak": MerakLoop(recipe, overrides, f"{output_dir}/merak"), "plain": PlainLoop(recipe, overrides)}
    if compiled:
        loops["merak_compiled"] = MerakLoop(recipe, [*overrides, "trainer.torch_compile=true"],
                                            f"{output_dir}/merak_compiled")
        loops["plain_compiled"] = PlainLoop(recipe, overrides, compile=True)
    return loops


def measure(recipe: str, args: argparse.Namespace) -> dict:
    overrides = [*MODELS[recipe], *COMMON]
    with tempfile.TemporaryDirectory() as output_dir:
        loops = _loops(recipe, overrides, output_dir, args.compile)
        times = {who: [] for who in loops}
        try:
            for round_index in range(args.rounds):
                for who, loop in loops.items():
                    times[who] += loop.run(args.warmup + args.steps)[args.warmup:]
                logger.info("%s round %d: %s", recipe, round_index + 1,
                            ", ".join(f"{who} {1e3 * common.median(t):.2f} ms" for who, t in times.items()))
        finally:
            for loop in loops.values():
                if isinstance(loop, MerakLoop):
                    loop.close()
    result = {"recipe": recipe, "overrides": overrides, "timed_iterations_each": len(times["merak"])}
    for who, loop in loops.items():
        result[f"{who}_ms"] = 1e3 * common.median(times[who])
        result[f"first_loss_{who}"] = loop.losses[0]
    result["ratio"] = result["merak_ms"] / result["plain_ms"]
    if args.compile:
        result["compiled_ratio"] = result["merak_compiled_ms"] / result["plain_compiled_ms"]
    return result


def main(argv=None) -> None:
    args = parse_args(argv)
    common.setup_logging()
    common.single_thread()
    facts = common.machine_facts()
    results = [measure(recipe, args) for recipe in (args.recipe or ["vit"])]
    who = ["merak", "plain", *(["merak_compiled", "plain_compiled"] if args.compile else [])]
    header = ["recipe", *[f"{w} ms/step" for w in who], "merak / plain",
              *(["merak_c / plain_c"] if args.compile else []), "first loss " + " / ".join(who)]
    rows = [(r["recipe"], *[f"{r[f'{w}_ms']:.2f}" for w in who], f"{r['ratio']:.3f}",
             *([f"{r['compiled_ratio']:.3f}"] if args.compile else []),
             " / ".join(f"{r[f'first_loss_{w}']:.6f}" for w in who)) for r in results]
    print(common.format_facts(facts))
    print(common.format_table(header, rows))
    common.write_json(args.json, {"machine": facts, "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
