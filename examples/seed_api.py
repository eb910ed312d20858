"""The original Merak example scripts' command lines, run through the seed API.

``python examples/run_gpt.py --model-name gpt2 --data-files train_context.csv --output_dir out
--per_device_train_batch_size 4 --gradient_accumulation_steps 4`` (under torchrun, or as one
process) builds the recipe's model option, reads and tokenizes the data with the recipe's data
code, and trains it with ``merak.init`` + ``MerakTrainer``: the path a user's own script takes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import merak


@dataclass
class ExampleArguments:
    """The example scripts' own arguments (the rest are MerakArguments)."""

    model_name: str = field(default="toy", metadata={"aliases": ["--model-name"],
                                                     "help": "A model option of the recipe (conf/model/*.yaml)."})
    data_files: list[str] | None = field(default=None, metadata={
        "aliases": ["--data-files"], "help": "Local .txt/.csv/.jsonl files (default: the recipe's offline text)."})
    text_column: str = field(default="text", metadata={"aliases": ["--text-column"]})
    cache_dir: str | None = field(default=None, metadata={"aliases": ["--cache-dir"],
                                                          "help": "Where tokenized data is cached."})
    dp: int | None = field(default=None, metadata={"help": "Data-parallel degree (default: world / (tp * pp))."})
    tp: int = 1
    pp: int = 1


def _recipe_config(recipe: str, example: ExampleArguments):
    """The recipe's model and data config for these arguments (Hydra's compose API, no run directory)."""
    from hydra import compose, initialize_config_dir

    overrides = [f"model={example.model_name}"]
    if example.data_files:
        overrides += ["data=files", f"data.files=[{','.join(os.path.abspath(f) for f in example.data_files)}]",
                      f"data.text_column={example.text_column}"]
    if example.cache_dir:
        overrides.append(f"data.cache_dir={os.path.abspath(example.cache_dir)}")
    conf = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes", recipe, "conf")
    with initialize_config_dir(config_dir=conf, version_base=None):
        return compose(config_name="train", overrides=overrides)


def main(recipe: str) -> None:
    """Parse the seeds' command line and train ``recipe``'s model with MerakTrainer."""
    import importlib

    import torch
    from transformers import HfArgumentParser

    example, args = HfArgumentParser((ExampleArguments, merak.MerakArguments)).parse_args_into_dataclasses()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dp = example.dp or max(1, world // (example.tp * example.pp))
    merak.init(dp=dp, tp=example.tp, pp=example.pp)
    spec = importlib.import_module(f"recipes.{recipe}.spec").SPEC
    cfg = _recipe_config(recipe, example)
    prepared = spec.prepare_data(cfg.data, cfg.model)  # every process tokenizes; the cache is written atomically
    dataset = spec.load_dataset(prepared, cfg.model)
    torch.manual_seed(args.seed)  # the same initial weights in every process
    trainer = merak.MerakTrainer(model=spec.build_model(cfg.model), args=args, train_data=dataset,
                                 compute_loss=spec.loss_fn, tp_plan=spec.tensor_parallel_plan(cfg.model),
                                 leaf_modules=spec.leaf_modules)
    trainer.train()
