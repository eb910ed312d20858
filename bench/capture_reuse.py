"""What a run's start-up costs with every worker tracing the model against rebuilding the launcher's capture.

``merak.run`` plans the model in the launching process before any worker starts; workers forked
from it rebuild that capture around their own weights (merak.trace.reuse) instead of tracing the
model again. This runs the gpt recipe in this process (its workers forked), one optimizer step,
alternating the two ways, and reports the median wall time and the CPU seconds of the launcher and
its workers together (what shared cores pay)::

    .venv/bin/python bench/capture_reuse.py [--layout dp2_pp2 --layout dp2_tp2_pp2 ...] [--model toy] [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # first: one thread, before torch starts any

import merak
import merak.runner
from merak.recipe import load_spec

logger = logging.getLogger("bench.capture_reuse")
REPO = Path(__file__).resolve().parents[1]
LAYOUTS = ("dp2_pp2", "pp4", "dp2_tp2_pp2")


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@contextlib.contextmanager
def _every_worker_traces():
    """The launcher neither remembers its capture nor plans for the other tp ranks (as before reuse)."""
    forks = merak.runner._forks_workers
    merak.runner._forks_workers = lambda *args: False
    try:
        yield
    finally:
        merak.runner._forks_workers = forks


def _run_once(spec, layout: str, model: str, reused: bool) -> tuple[float, float]:
    import hydra

    overrides = [f"model={model}", f"parallel={layout}", "trainer.max_steps=1", "trainer.per_device_train_batch_size=2",
                 "trainer.gradient_accumulation_steps=4", "trainer.disable_tqdm=true",
                 f"trainer.output_dir={tempfile.mkdtemp(prefix='capture_reuse-')}"]
    with hydra.initialize_config_dir(config_dir=str(REPO / "recipes/gpt/conf"), version_base=None):
        cfg = hydra.compose("train", overrides=overrides)
    cpu, started = _cpu_seconds(), time.perf_counter()
    with contextlib.nullcontext() if reused else _every_worker_traces():
        merak.run(spec, cfg)
    return time.perf_counter() - started, _cpu_seconds() - cpu


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", action="append", help=f"default: {' '.join(LAYOUTS)}")
    parser.add_argument("--model", default="toy")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    common.setup_logging()
    logging.getLogger("merak").setLevel(logging.WARNING)
    facts = common.machine_facts()
    spec = load_spec(REPO / "recipes/gpt/train.py")
    _run_once(spec, "single", args.model, True)  # data prepared and imports done before anything is timed
    rows = []
    for layout in args.layout or LAYOUTS:
        wall: dict[bool, list[float]] = {True: [], False: []}
        cpu: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.repeats):
            for reused in (False, True):
                seconds, cpu_seconds = _run_once(spec, layout, args.model, reused)
                wall[reused].append(seconds)
                cpu[reused].append(cpu_seconds)
                logger.info("%s reused=%s: %.2f s, %.2f CPU s", layout, reused, seconds, cpu_seconds)
        before, after = statistics.median(wall[False]), statistics.median(wall[True])
        cpu_before, cpu_after = statistics.median(cpu[False]), statistics.median(cpu[True])
        rows.append([layout, f"{before:.2f}", f"{after:.2f}", f"{after / before:.2f}",
                     f"{cpu_before:.1f}", f"{cpu_after:.1f}", f"{cpu_after / cpu_before:.2f}"])
    print(common.format_facts(facts))
    print(common.format_table(["layout", "wall s, every worker traces", "wall s, rebuilt", "ratio",
                               "CPU s, every worker traces", "CPU s, rebuilt", "ratio"], rows))


if __name__ == "__main__":
    main()
