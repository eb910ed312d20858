"""What gloo's collectives cost among CPU processes on this machine: the facts the planner's cost model
prices (merak.autoplan.cost).

For 4 and 8 processes (one thread each), each timing the median of back-to-back repetitions on rank 0,
every measurement taken in three rounds:

- an all-reduce by element count (1 and 2 float64, as a step's loss and gradient norm; 64 to 4096
  float32): gloo reduces one or two elements by another algorithm than longer messages;
- an all-reduce, a reduce-scatter and an all-gather of a model's gradients (``--elements`` float32):
  gloo's reduce-scatter costs a whole all-reduce, its all-gather half of one;
- the processor time a process spends blocked in a receive and in a barrier for 2 s (gloo waits
  without spinning: a stage waiting for its input leaves the cores to the others);
- a pair's small all-reduce (1024 float32, as a tensor-parallel pair's) between about a millisecond of
  compute each, while 0, 2, 4 or 6 other processes compute all along (the mean of 300): a collective
  waits for each process to be scheduled, longer the more processes run beside it.

    .venv/bin/python bench/gloo_collectives.py [--worlds 4 8] [--elements 205480] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # first: sets OMP_NUM_THREADS before torch starts threads
import torch
import torch.distributed as dist

from merak.distributed import collectives
from merak.distributed.launch import spawn_workers

logger = logging.getLogger("bench.gloo_collectives")

ROUNDS = 3
REPEATS = 20
MESSAGES = ((1, torch.float64), (2, torch.float64), (64, torch.float32), (1024, torch.float32),
            (4096, torch.float32))
BLOCKED_SECONDS = 2.0
PAIR_ROUNDS = 300  # all-reduces of the pair per count of computing neighbours
PAIR_COMPUTE_S = 1e-3
ALL_REDUCE_PAIR_ELEMENTS = 1024


def _median_time(function, repeats: int = REPEATS, barrier: bool = False) -> float:
    function()  # warm-up: gloo's buffers for this size
    times = []
    for _ in range(repeats):
        if barrier:
            dist.barrier()
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _blocked_cpu(rank: int) -> dict:
    """Processor seconds rank 1 spends in a receive, then in a barrier, each waiting ``BLOCKED_SECONDS`` for
    rank 0."""
    out = {}
    message = torch.zeros(16)
    dist.barrier()
    if rank == 0:
        time.sleep(BLOCKED_SECONDS)
        dist.send(message, 1)
    elif rank == 1:
        cpu = time.process_time()
        dist.recv(message, 0)
        out["recv"] = time.process_time() - cpu
    dist.barrier()
    if rank == 0:
        time.sleep(BLOCKED_SECONDS)
    cpu = time.process_time()
    dist.barrier()
    if rank == 1:
        out["barrier"] = time.process_time() - cpu
    return out


def _compute_for(seconds: float, matrix: torch.Tensor) -> None:
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        matrix @ matrix


def _pair_beside_computing(rank: int, size: int) -> dict[str, float]:
    """Ranks 0 and 1 alternate about a millisecond of compute with an all-reduce among them while ``others``
    further ranks compute all along (the rest wait at a barrier): the all-reduce's mean time per count."""
    pair = dist.new_group([0, 1])
    matrix, message = torch.randn(64, 64), torch.zeros(ALL_REDUCE_PAIR_ELEMENTS)
    out = {}
    for others in range(0, size - 1, 2):
        dist.barrier()
        if rank < 2:
            dist.all_reduce(message, group=pair)  # warm-up
            spent = 0.0
            for _ in range(PAIR_ROUNDS):
                _compute_for(PAIR_COMPUTE_S, matrix)
                started = time.perf_counter()
                dist.all_reduce(message, group=pair)
                spent += time.perf_counter() - started
            out[str(others)] = spent / PAIR_ROUNDS
            dist.barrier()
        elif rank < 2 + others:
            # Compute until the pair is done: the barrier's completion is polled between slices.
            done = dist.barrier(async_op=True)
            while not done.is_completed():
                _compute_for(PAIR_COMPUTE_S, matrix)
        else:
            dist.barrier()
    return out


def _worker(elements: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, size = dist.get_rank(), dist.get_world_size()
    result: dict[str, list[float]] = {}
    count = elements // size * size
    full, part = torch.zeros(count), torch.zeros(count // size)
    for _ in range(ROUNDS):
        for length, dtype in MESSAGES:
            message = torch.zeros(length, dtype=dtype)
            dist.barrier()
            result.setdefault(f"all_reduce {length} x {str(dtype).removeprefix('torch.')}", []).append(
                _median_time(lambda m=message: dist.all_reduce(m)))
        for name, function in (("gradients all_reduce", lambda: dist.all_reduce(full)),
                               ("gradients reduce_scatter", lambda: collectives.reduce_scatter_single(part, full)),
                               ("gradients all_gather", lambda: collectives.all_gather_single(full, part))):
            result.setdefault(name, []).append(_median_time(function, repeats=10, barrier=True))
    blocked = _blocked_cpu(rank)
    pair = _pair_beside_computing(rank, size)
    dist.destroy_process_group()
    if rank == 0:
        result["pair all_reduce beside computing"] = pair
        Path(out_dir, "times.json").write_text(json.dumps(result), encoding="utf-8")
    if rank == 1:
        Path(out_dir, "blocked.json").write_text(json.dumps(blocked), encoding="utf-8")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--elements", type=int, default=205_480, help="float32 gradients (default: the BERT toy's)")
    parser.add_argument("--out", default="", help="results JSON ('' for none)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    common.setup_logging()
    results = {}
    for world in args.worlds:
        with tempfile.TemporaryDirectory(prefix="gloo-collectives-") as out_dir:
            spawn_workers(_worker, world_size=world, args=(args.elements, out_dir), env={"OMP_NUM_THREADS": "1"})
            times = json.loads(Path(out_dir, "times.json").read_text(encoding="utf-8"))
            blocked = json.loads(Path(out_dir, "blocked.json").read_text(encoding="utf-8"))
        pair = times.pop("pair all_reduce beside computing")
        results[world] = {"ms": {k: [round(v * 1e3, 3) for v in vs] for k, vs in times.items()},
                          "blocked_cpu_s": blocked,
                          "pair_all_reduce_ms_by_processes_computing_beside": {k: round(v * 1e3, 3)
                                                                              for k, v in pair.items()}}
        print(f"{world} processes (ms, per round):")
        for name, values in results[world]["ms"].items():
            print(f"  {name:34s} {' '.join(f'{v:7.2f}' for v in values)}")
        print(f"  processor time blocked {BLOCKED_SECONDS:.0f} s: " +
              ", ".join(f"{k} {v:.3f} s" for k, v in blocked.items()))
        print("  a pair's all-reduce between 1 ms of compute, by processes computing beside it: " +
              ", ".join(f"{k}: {v * 1e3:.2f} ms" for k, v in pair.items()))
    common.write_json(args.out, {"benchmark": "gloo_collectives", "command": " ".join(sys.argv),
                                 "machine": common.machine_facts(), "results": results})
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
