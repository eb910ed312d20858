"""Shared helpers of the benchmarks in bench/: model, data, timing, machine facts, output.

The benchmarks run one thread per process (the project's machines have 2 shared
cores); import this module before torch is used so that OMP_NUM_THREADS is set
before any thread pool starts.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

import merak  # noqa: F401  (makes torchvision importable before transformers is)

logger = logging.getLogger("bench")

# A GPT-2 of ~8.4 M parameters (2.1 M of them the tied 8192 x 256 embedding).
MODEL_DEFAULTS = {"vocab_size": 8192, "seq_length": 128, "hidden_size": 256, "num_layers": 8, "num_heads": 8}


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr, force=True)
    # The recipe keeps GPT-2's bos/eos id 50256, which a smaller vocabulary warns about.
    import transformers
    transformers.logging.set_verbosity_error()


def single_thread() -> None:
    """One intra-op and one inter-op thread (two threads per rank on 2 cores thrash)."""
    torch.set_num_threads(1)
    with contextlib.suppress(RuntimeError):  # already set, or parallel work already started
        torch.set_num_interop_threads(1)


def add_model_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model (recipes.gpt.model.build_model)")
    for name, default in MODEL_DEFAULTS.items():
        group.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    group.add_argument("--micro-batch-size", type=int, default=4)
    group.add_argument("--seed", type=int, default=1234)


def model_config(args: argparse.Namespace):
    """The OmegaConf model config the gpt recipe's build_model reads (dropout off)."""
    from omegaconf import OmegaConf
    return OmegaConf.create({"name": "bench", "dropout": 0.0,
                             **{name: getattr(args, name) for name in MODEL_DEFAULTS}})


def build_model(model_cfg, seed: int, *, untie: bool = False):
    """The recipe's GPT2LMHeadModel from a fixed seed.

    With ``untie`` the LM head gets its own copy of the embedding matrix (same
    values, separate Parameter), so no weight is shared between the first and
    the last pipeline stage.
    """
    from recipes.gpt.model import build_model as recipe_build_model
    torch.manual_seed(seed)
    model = recipe_build_model(model_cfg)
    if untie:
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
        model.config.tie_word_embeddings = False
        assert model.lm_head.weight is not model.transformer.wte.weight
    return model


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (a tied weight counts once)."""
    return sum(p.numel() for p in model.parameters())


def random_batches(model_cfg, *, micro_batch_size: int, num_microbatches: int, count: int,
                   seed: int) -> list[list[dict[str, torch.Tensor]]]:
    """``count`` steps of random token ids, each a list of microbatch dicts {input_ids, labels}."""
    generator = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(count):
        step = []
        for _ in range(num_microbatches):
            ids = torch.randint(0, model_cfg.vocab_size, (micro_batch_size, model_cfg.seq_length),
                                generator=generator)
            step.append({"input_ids": ids, "labels": ids})
        steps.append(step)
    return steps


class StepTimer:
    """Wall-clock (perf_counter) and CPU (process_time, all threads of the process) of one step."""

    def __enter__(self):
        self._wall = time.perf_counter()
        self._cpu = time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall = time.perf_counter() - self._wall
        self.cpu = time.process_time() - self._cpu


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def machine_facts() -> dict:
    import transformers
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "cpus_usable": affinity,
        "cpu_model": _cpu_model(),
        "load_average_at_start": list(os.getloadavg()),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch_threads": torch.get_num_threads(),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def format_facts(facts: dict) -> str:
    return (f"date {facts['date']} | {facts['cpu_count']} CPUs ({facts['cpu_model']}), "
            f"load avg {facts['load_average_at_start'][0]:.2f} at start | torch {facts['torch']}, "
            f"transformers {facts['transformers']}, python {facts['python']}")


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-flavoured Markdown table."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def write_json(path: str | None, payload: dict) -> None:
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2) + "\n")
    logger.info("wrote %s", path)


def single_stage_engine(args: argparse.Namespace, state, *, num_microbatches: int, total_steps: int,
                        dtype: torch.dtype = torch.float32, **engine_options):
    """A PipelineEngine over the whole benchmark GPT as one stage (no capture), on ``state``'s grid."""
    import functools

    from merak.engine import PipelineEngine
    from merak.session.assemble import assemble
    from merak.shard.plan import ShardingSettings
    from recipes.gpt.model import causal_lm_loss

    built = assemble(build=functools.partial(build_model, model_config(args), args.seed), seed=args.seed,
                     init_device="cpu", sharding=ShardingSettings(trace_method=None), input_names=("input_ids",),
                     num_stages=1, num_microbatches=num_microbatches, stage_id=0, device=state.device,
                     example_inputs={}, dtype=dtype)
    return PipelineEngine(model=built.model, stages=built.stages, loss_fn=causal_lm_loss, state=state,
                          schedule="1f1b", num_microbatches=num_microbatches, total_steps=total_steps,
                          **engine_options)


GPT_TRAIN = Path(__file__).resolve().parents[1] / "recipes/gpt/train.py"


def train_recipe(overrides: Sequence[str], run_dir: Path, script: Path = GPT_TRAIN) -> dict:
    """One recipe run (``script``, the gpt recipe's train.py by default) in its own process, offline, into
    ``run_dir``: its summary.json. Its output goes to ``run_dir/stdout.log``, named when it fails."""
    run_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    command = [sys.executable, str(script), *overrides, f"hydra.run.dir={run_dir}"]
    with open(run_dir / "stdout.log", "w") as log:
        result = subprocess.run(command, cwd=script.parents[2], env=env, stdout=log, stderr=subprocess.STDOUT,
                                timeout=1800, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed; see {run_dir / 'stdout.log'}")
    return json.loads((run_dir / "summary.json").read_text())

