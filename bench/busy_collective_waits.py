"""How long a tensor-parallel collective waits, by the compute between collectives.

The calibration times a small all-reduce in groups of each size while every process computes a little
between its collectives (merak.autoplan.busy_collectives, 12 products of a 96-wide matrix). This runs the
same timing with other amounts of compute between the collectives (``--products``; one product is timed
alone first), for 4 and 8 processes on this machine, beside the small all-reduce among all of them with
nothing computing (what tensor-parallel waits were priced from before): whether the wait depends on the
compute between collectives.

    .venv/bin/python bench/busy_collective_waits.py [--worlds 4 8] [--products 12 48 192] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # first: sets OMP_NUM_THREADS before torch starts threads
import torch
import torch.distributed as dist

from merak.autoplan import busy_collectives
from merak.autoplan.calibrate import ALL_REDUCE_ELEMENTS, ALL_REDUCES, group_sizes
from merak.distributed.launch import spawn_workers

logger = logging.getLogger("bench.busy_collective_waits")


def _worker(products: list[int], out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        message = torch.zeros(ALL_REDUCE_ELEMENTS)
        dist.all_reduce(message)
        started = time.perf_counter()
        for _ in range(ALL_REDUCES):
            dist.all_reduce(message)
        idle = (time.perf_counter() - started) / ALL_REDUCES
        waits = {}
        for count in products:
            busy_collectives.FILLER_PRODUCTS = count
            waits[count] = busy_collectives.time_busy_collectives(group_sizes(dist.get_world_size()))
    finally:
        dist.destroy_process_group()
    if int(os.environ["RANK"]) == 0:
        Path(out_dir, "rank0.json").write_text(json.dumps({"idle_all_reduce_s": idle, "waits_s": waits}))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--products", type=int, nargs="+", default=[12, 48, 192])
    parser.add_argument("--out", default="bench/results/busy_collective_waits.json", help="results JSON ('' for none)")
    args = parser.parse_args(argv)
    common.setup_logging()
    filler = torch.randn(busy_collectives.FILLER_SIDE, busy_collectives.FILLER_SIDE)
    started = time.perf_counter()
    for _ in range(1000):
        filler @ filler
    product_s = (time.perf_counter() - started) / 1000
    results, rows = [], []
    sizes = group_sizes(max(args.worlds))
    for world in args.worlds:
        with tempfile.TemporaryDirectory(prefix="busy-waits-") as out_dir:
            spawn_workers(_worker, world_size=world, args=(args.products, out_dir), env={"OMP_NUM_THREADS": "1"})
            report = json.loads(Path(out_dir, "rank0.json").read_text())
        hop = report["idle_all_reduce_s"] / (2 * (world - 1))
        results.append({"world": world, **report})
        for count, waits in report["waits_s"].items():
            rows.append([world, int(count), f"{int(count) * product_s * 1e3:.2f}",
                         *(f"{waits[str(size)] * 1e3:.2f} ({2 * (size - 1) * hop * 1e3:.2f})"
                           if str(size) in waits else "-" for size in sizes)])
    print(common.format_table(["processes", "products", "compute alone (ms)",
                               *(f"group of {size}: busy (idle) ms" for size in sizes)], rows))
    common.write_json(args.out, {"benchmark": "busy_collective_waits", "command": " ".join(sys.argv),
                                 "machine": common.machine_facts(), "product_s": product_s, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
