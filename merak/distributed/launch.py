"""Starting worker processes on this machine, or joining a world that exists.

merak.run either joins the processes torchrun / srun started (one Hydra per
process) or, from the single Hydra process, starts ``dp*tp*pp`` workers here.
A worker that fails makes :func:`spawn_workers` stop the others and raise with
that worker's traceback: no run is left hanging. SIGINT or SIGTERM sent to the
launcher stops every worker and raises :class:`RunInterrupted`; SIGHUP (a closed
terminal, a dropped SSH session) is handled the same way. Workers ignore SIGINT
and SIGHUP themselves, so Ctrl-C in a terminal (which signals the whole process
group) is handled once, by the launcher. A launcher that dies without stopping
its workers (SIGKILL, a crash) takes them with it: each worker asks the kernel
for SIGKILL when its parent dies (Linux), or watches its parent elsewhere. The
launcher also hosts the rendezvous store, listening on the loopback interface
only.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator

import torch
import torch.multiprocessing as mp

from merak.distributed import groups


class WorkerFailed(RuntimeError):
    """A worker process raised or died; the message holds its traceback or exit status."""


class RunInterrupted(BaseException):
    """The launcher received SIGINT, SIGTERM or SIGHUP (its workers, if any, were stopped).

    A BaseException, as KeyboardInterrupt is: code that catches ``Exception`` to report its own
    failures (a graph capture, a library's fallback) must not turn an interrupt into an error.

    Attributes:
        signal_number: the signal received.
        exit_code: what a shell reports for a process ended by it (128 + the signal number).
    """

    def __init__(self, signal_number: int, detail: str = "") -> None:
        self.signal_number = signal_number
        self.exit_code = 128 + signal_number
        name = signal.Signals(signal_number).name
        super().__init__(f"interrupted by {name}{': ' + detail if detail else ''}")


_STOP_GRACE_S = 5.0
# The signals an interrupted launcher answers: stop the workers, exit 128 + the signal number.
INTERRUPTS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PARENT_POLL_S = 1.0


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


def _die_with_parent(parent: int) -> None:
    """End this process as soon as ``parent`` (the launcher) is gone, however it ended.

    torch asks for SIGINT at the parent's death, which a worker ignores (see :func:`_entry`): ask for
    SIGKILL instead. Where prctl is missing (not Linux), a daemon thread polls the parent.
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        armed = libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):  # no libc symbol prctl: not Linux
        armed = False
    if os.getppid() != parent:  # the launcher died before the request took effect
        os._exit(128 + signal.SIGKILL)
    if armed:
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_PARENT_POLL_S)
        os._exit(128 + signal.SIGKILL)

    threading.Thread(target=watch, name="merak-parent-watch", daemon=True).start()


def _entry(local_rank: int, fn: Callable, world_size: int, port: int, args: tuple, env: dict,
           launcher: int) -> None:
    # The launcher alone answers interrupts (it stops every worker); a forked worker would otherwise
    # run the launcher's handlers. SIGTERM from the launcher ends a worker at once, silently.
    for number in INTERRUPTS:
        signal.signal(number, signal.SIG_DFL if number == signal.SIGTERM else signal.SIG_IGN)
    _die_with_parent(launcher)
    os.environ.update(env)
    os.environ.update({
        "RANK": str(local_rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        # This process serves the rendezvous store (as torchrun's agent does): torch.distributed's env://
        # rendezvous then makes rank 0 a client too, instead of opening a store on every interface.
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    })
    # Workers share the machine's cores (one thread each unless OMP_NUM_THREADS says otherwise). This also
    # keeps a forked worker out of the parent's OpenMP thread pool, which does not survive fork: a parent
    # that had computed with several threads left children that hang in their first parallel region.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    _forget_inherited_compile_threads()
    groups.forget_inherited_state()
    fn(*args)


def _forget_inherited_compile_threads() -> None:
    """A forked worker inherits inductor's cached compile thread pool but none of its threads: its first
    compilation would queue work that never runs. Drop the cached pool so the worker makes its own
    (torch resets the process pool at fork, not this one)."""
    async_compile = sys.modules.get("torch._inductor.async_compile")
    pool = getattr(getattr(async_compile, "AsyncCompile", None), "pool", None)
    if hasattr(pool, "cache_clear"):  # a private cache: absent in other torch versions, nothing to do then
        pool.cache_clear()


@contextlib.contextmanager
def interrupts_raise() -> Iterator[None]:
    """Within the block, SIGINT, SIGTERM and SIGHUP raise :class:`RunInterrupted` in the main thread
    (a no-op in other threads, where Python cannot install handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(number, _frame):
        raise RunInterrupted(number)

    previous = {number: signal.signal(number, handler) for number in INTERRUPTS}
    try:
        yield
    finally:
        for number, old in previous.items():
            signal.signal(number, old)


def _loopback_listener() -> socket.socket:
    """A listening TCP socket on 127.0.0.1 at a free port (held, so no other process can take it)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1024)
    return listener


def _host_store(listener: socket.socket, world_size: int, timeout_s: float):
    """The rendezvous store of the workers, served by this process on ``listener`` (loopback only:
    a store bound by rank 0 would listen on every interface of the machine)."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", listener.getsockname()[1], world_size, True,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
                         master_listen_fd=listener.fileno())


def stop_workers(processes) -> None:
    """SIGTERM every live process, then SIGKILL those still alive after a grace period."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + _STOP_GRACE_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()


def spawn_workers(fn: Callable, *, world_size: int, args: tuple = (), start_method: str = "auto",
                  env: dict[str, str] | None = None, store_timeout_s: float = 600.0) -> None:
    """Run ``fn(*args)`` in ``world_size`` new processes with torch.distributed's env variables set.

    Raises:
        WorkerFailed: when any worker raises or exits non-zero (the others are stopped).
        RunInterrupted: when this process receives SIGINT, SIGTERM or SIGHUP (every worker is stopped).
    """
    method = default_start_method() if start_method == "auto" else start_method
    listener = _loopback_listener()
    store = None
    with interrupts_raise():
        context = mp.start_processes(
            _entry, args=(fn, world_size, listener.getsockname()[1], args, dict(env or {}), os.getpid()),
            nprocs=world_size,
            join=False, start_method=method)
        try:
            # Served from here once the workers exist: forking a process that runs the store's threads
            # would copy their locks mid-use. Workers connecting earlier wait in the listen queue.
            store = _host_store(listener, world_size, store_timeout_s)
            listener.detach()  # the store owns the socket now and closes it
            while not context.join(timeout=0.5):
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
        except (RunInterrupted, KeyboardInterrupt) as error:
            number = error.signal_number if isinstance(error, RunInterrupted) else signal.SIGINT
            raise RunInterrupted(number, f"stopped {world_size} workers") from None  # stopped just below
        finally:
            # Workers still running after an interrupt or another worker's failure; a second Ctrl-C
            # must not cut the stopping short.
            with _interrupts_ignored():
                stop_workers(context.processes)
            if store is None:
                listener.close()
            del store


@contextlib.contextmanager
def _interrupts_ignored() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {number: signal.signal(number, signal.SIG_IGN) for number in INTERRUPTS}
    try:
        yield
    finally:
        for number, old in previous.items():
            signal.signal(number, old)
