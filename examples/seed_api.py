"""The original Merak example scripts' command lines, run through the seed API.

``python examples/run_gpt.py --model-name gpt2 --data-files train_context.csv --output_dir out
--per_device_train_batch_size 4 --gradient_accumulation_steps 4 --data_path /ssd/datasets/imagenet/pytorch``
(under torchrun or ``python -m torch.distributed.launch``, or as one process) builds the recipe's
model option, reads the data with the recipe's data code (see examples/seed_data.py for which data),
and trains it with ``merak.init`` + ``MerakTrainer``: the path a user's own script takes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import merak
from examples.seed_data import IMAGE_RECIPES, image_overrides, text_overrides
from merak.distributed import groups


@dataclass
class ExampleArguments:
    """The example scripts' own arguments (the rest are MerakArguments)."""

    model_name: str = field(default="toy", metadata={"aliases": ["--model-name"],
                                                     "help": "A model option of the recipe (conf/model/*.yaml)."})
    data_files: list[str] | None = field(default=None, metadata={
        "aliases": ["--data-files"], "help": "Text models: local .txt/.csv/.jsonl files (default: the recipe's "
                                             "offline text)."})
    data_path: str | None = field(default=None, metadata={
        "help": "Image models: an ImageFolder-layout folder, or one holding train/ (and val/) in that layout "
                "(default, or when it is missing: the recipe's synthetic images). Text models ignore it."})
    text_column: str = field(default="text", metadata={"aliases": ["--text-column"]})
    cache_dir: str | None = field(default=None, metadata={"aliases": ["--cache-dir"],
                                                          "help": "Where tokenized data is cached."})
    dp: int | None = field(default=None, metadata={"help": "Data-parallel degree (default: world / (tp * pp))."})
    tp: int = 1
    pp: int = 1


def _compose(recipe: str, overrides: list[str]):
    """The recipe's config with ``overrides`` (Hydra's compose API, no run directory)."""
    from hydra import compose, initialize_config_dir

    conf = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes", recipe, "conf")
    with initialize_config_dir(config_dir=conf, version_base=None):
        return compose(config_name="train", overrides=overrides)


def _datasets(recipe: str, example: ExampleArguments, args):
    """The training data (and the evaluation data, when there is some and ``do_eval``) and the
    model config they were made for."""
    import importlib

    spec = importlib.import_module(f"recipes.{recipe}.spec").SPEC
    model = [f"model={example.model_name}"]
    if recipe in IMAGE_RECIPES:
        overrides, folders = image_overrides(example.data_path)
    else:
        overrides, folders = text_overrides(example.data_files, example.text_column, example.cache_dir,
                                            example.data_path), None
    cfg = _compose(recipe, model + overrides)
    prepared = spec.prepare_data(cfg.data, cfg.model)  # every process tokenizes; the cache is written atomically
    train = spec.load_dataset(prepared, cfg.model)
    evaluation = None
    if folders is not None and folders.eval is not None and args.do_eval:
        eval_cfg = _compose(recipe, model + overrides + [f"data.path={folders.eval}"])
        evaluation = spec.load_dataset(spec.prepare_data(eval_cfg.data, cfg.model), cfg.model)
    return spec, cfg, train, evaluation


def main(recipe: str) -> None:
    """Parse the seeds' command line and train ``recipe``'s model with MerakTrainer."""
    import torch
    from transformers import HfArgumentParser

    parser = HfArgumentParser((ExampleArguments, merak.MerakArguments))
    example, args = parser.parse_args_into_dataclasses()
    if recipe in IMAGE_RECIPES and example.data_files:
        parser.error("--data-files is for text models; image models read --data_path")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dp = example.dp or max(1, world // (example.tp * example.pp))
    merak.init(dp=dp, tp=example.tp, pp=example.pp)
    finished = False
    try:
        spec, cfg, train, evaluation = _datasets(recipe, example, args)
        torch.manual_seed(args.seed)  # the same initial weights in every process
        trainer = merak.MerakTrainer(model=spec.build_model(cfg.model), args=args, train_data=train,
                                     eval_data=evaluation, compute_loss=spec.loss_fn,
                                     tp_plan=spec.tensor_parallel_plan(cfg.model), leaf_modules=spec.leaf_modules)
        trainer.train()
        finished = True
    finally:
        # Destroy the process groups before the interpreter exits: left to the interpreter's teardown,
        # a process group's threads may be destroyed while still running, which aborts the process.
        groups.shutdown(synchronize=finished)
