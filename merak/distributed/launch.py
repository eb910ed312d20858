"""Starting worker processes on this machine, or joining a world that exists.

merak.run either joins the processes torchrun / srun started (one Hydra per
process) or, from the single Hydra process, starts ``dp*tp*pp`` workers here.
A worker that fails makes :func:`spawn_workers` stop the others and raise with
that worker's traceback: no run is left hanging.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
from collections.abc import Callable

import torch
import torch.multiprocessing as mp


class WorkerFailed(RuntimeError):
    """A worker process raised or died; the message holds its traceback or exit status."""


# Errors a worker hits only because another worker went away first.
_SECONDARY_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                      "connection refused", "Socket Timeout", "ECONNRESET")


def _worker_tracebacks(context) -> dict[int, str]:
    """Tracebacks of every worker that raised (torch writes them to per-worker files)."""
    found = {}
    for index, path in enumerate(context.error_files):
        if os.path.exists(path) and os.path.getsize(path) > 0:
            with open(path, "rb") as handle:
                # Written by our own child process a moment ago, not user data.
                found[index] = pickle.load(handle)
    return found


def _root_cause(tracebacks: dict[int, str], reported: int) -> int:
    """The worker whose error caused the others: prefer one that is not a lost connection."""
    primary = [i for i, text in sorted(tracebacks.items())
               if not any(marker in text for marker in _SECONDARY_MARKERS)]
    return primary[0] if primary else reported


def existing_world_size() -> int | None:
    """World size of a launcher that already started our processes (torchrun, srun), else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if "SLURM_STEP_ID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return int(os.environ["SLURM_NTASKS"])
    return None


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def default_start_method() -> str:
    # fork is several times faster to start (imports are inherited), but CUDA
    # cannot be used in a forked child once the parent touched it.
    return "spawn" if torch.cuda.is_available() else "fork"


def _entry(local_rank: int, fn: Callable, world_size: int, port: int, args: tuple, env: dict) -> None:
    os.environ.update(env)
    os.environ.update({
        "RANK": str(local_rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    })
    # Workers share the machine's cores (one thread each unless OMP_NUM_THREADS says otherwise). This also
    # keeps a forked worker out of the parent's OpenMP thread pool, which does not survive fork: a parent
    # that had computed with several threads left children that hang in their first parallel region.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    _forget_inherited_compile_threads()
    fn(*args)


def _forget_inherited_compile_threads() -> None:
    """A forked worker inherits inductor's cached compile thread pool but none of its threads: its first
    compilation would queue work that never runs. Drop the cached pool so the worker makes its own
    (torch resets the process pool at fork, not this one)."""
    async_compile = sys.modules.get("torch._inductor.async_compile")
    pool = getattr(getattr(async_compile, "AsyncCompile", None), "pool", None)
    if hasattr(pool, "cache_clear"):  # a private cache: absent in other torch versions, nothing to do then
        pool.cache_clear()


def spawn_workers(fn: Callable, *, world_size: int, args: tuple = (), start_method: str = "auto",
                  env: dict[str, str] | None = None) -> None:
    """Run ``fn(*args)`` in ``world_size`` new processes with torch.distributed's env variables set.

    Raises:
        WorkerFailed: when any worker raises or exits non-zero (the others are stopped).
    """
    method = default_start_method() if start_method == "auto" else start_method
    context = mp.start_processes(
        _entry, args=(fn, world_size, free_port(), args, dict(env or {})), nprocs=world_size,
        join=False, start_method=method)
    try:
        while not context.join():
            pass
    except mp.ProcessRaisedException as error:
        tracebacks = _worker_tracebacks(context) or {error.error_index: str(error)}
        cause = _root_cause(tracebacks, error.error_index)
        others = sorted(set(tracebacks) - {cause})
        note = f"\n(workers {others} failed afterwards)" if others else ""
        raise WorkerFailed(f"worker {cause} failed:\n{tracebacks.get(cause, error)}{note}") from None
    except mp.ProcessExitedException as error:
        raise WorkerFailed(f"worker {error.error_index} died with exit code {error.exit_code}"
                           f"{' (signal ' + error.signal_name + ')' if error.signal_name else ''}") from None
