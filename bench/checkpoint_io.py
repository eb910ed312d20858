"""Checkpoint save and load throughput against torch.save / torch.load of the same state, side by side.

One process trains the gpt recipe's GPT-2 for one step (so AdamW has its moments),
then, alternating in rounds (the machine is shared and noisy):

* ``merak save`` / ``merak load``: merak.checkpoint.save_checkpoint and load_checkpoint
  (weights and optimizer pieces in safetensors, RNG and trainer state in JSON, every
  file fsynced and CRC32-checked, committed by rename; the load checks every CRC);
* ``torch.save`` / ``torch.load``: the model and optimizer state dicts in one file
  (``torch.load(weights_only=True)``), fsynced, no checksum.

Throughput is checkpoint bytes over wall time; medians are reported.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import common  # first: sets OMP_NUM_THREADS before torch starts
import torch

from merak.checkpoint import load_checkpoint, save_checkpoint
from merak.distributed import groups
from merak.optim.settings import OptimizerSettings


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_model_args(parser)
    parser.set_defaults(vocab_size=50257, hidden_size=768, num_heads=12, num_layers=12, seq_length=64,
                        micro_batch_size=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--json", default=None)
    return parser.parse_args(argv)


def _engine(args, state):
    engine = common.single_stage_engine(args, state, num_microbatches=1, total_steps=10,
                                        optimizer=OptimizerSettings(learning_rate=1e-4))
    batch = common.random_batches(common.model_config(args), micro_batch_size=1, num_microbatches=1, count=1,
                                  seed=args.seed)[0]
    engine.train_step(batch)
    return engine


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, names in os.walk(path) for f in names)


def _torch_save(engine, path: str) -> None:
    state = {"model": {n: p.detach() for n, p in engine.named_parameters()},
             "optimizer": engine.optimizer.optimizer.state_dict()}
    torch.save(state, path)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def _torch_load(engine, path: str) -> None:
    state = torch.load(path, weights_only=True)
    with torch.no_grad():
        for name, param in engine.named_parameters():
            param.copy_(state["model"][name])
    engine.optimizer.optimizer.load_state_dict(state["optimizer"])


def main(argv=None) -> int:
    args = parse_args(argv)
    common.setup_logging()
    common.single_thread()
    facts = common.machine_facts()
    state = groups.init(timeout_s=600)
    root = args.dir or tempfile.mkdtemp(prefix="merak-ckpt-bench-")
    times = {"merak save": [], "merak load": [], "torch.save": [], "torch.load": []}
    sizes = {}
    try:
        engine = _engine(args, state)
        for round_index in range(args.rounds):
            started = time.perf_counter()
            path = save_checkpoint(engine, root, step=round_index + 1, trainer_state={}, run_info={})
            times["merak save"].append(time.perf_counter() - started)
            sizes["merak"] = _dir_bytes(path)
            started = time.perf_counter()
            load_checkpoint(engine, path)
            times["merak load"].append(time.perf_counter() - started)
            single = os.path.join(root, "torch.pt")
            started = time.perf_counter()
            _torch_save(engine, single)
            times["torch.save"].append(time.perf_counter() - started)
            sizes["torch"] = os.path.getsize(single)
            started = time.perf_counter()
            _torch_load(engine, single)
            times["torch.load"].append(time.perf_counter() - started)
            shutil.rmtree(path)  # outside the timed regions: every save writes a new directory
            os.remove(single)
    finally:
        groups.shutdown()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    params = sum(p.numel() for _, p in engine.named_parameters())
    rows = []
    for name, values in times.items():
        size = sizes["merak" if name.startswith("merak") else "torch"]
        median = common.median(values)
        rows.append([name, f"{size / 1e6:,.0f}", f"{median:.2f}", f"{size / 1e6 / median:,.0f}"])
    print(f"GPT-2 {params / 1e6:.1f} M parameters, fp32 weights + AdamW moments, {args.rounds} rounds, one process")
    print(common.format_facts(facts))
    print(common.format_table(["operation", "MB", "seconds (median)", "MB/s"], rows))
    save_ratio = common.median(times["merak save"]) / common.median(times["torch.save"])
    load_ratio = common.median(times["merak load"]) / common.median(times["torch.load"])
    print(f"time merak / torch: save {save_ratio:.2f}, load {load_ratio:.2f}")
    common.write_json(args.json, {"facts": facts, "args": vars(args), "times": times, "sizes": sizes})
    return 0


if __name__ == "__main__":
    sys.exit(main())
