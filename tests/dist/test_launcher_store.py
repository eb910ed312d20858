"""The launcher: the workers' rendezvous store listens on the loopback interface only, and workers
end with their launcher however it ends (the run directory's lock with them)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from merak.distributed import groups
from merak.distributed.launch import spawn_workers
from merak.session.run_directory import RunDirectoryLock

pytestmark = pytest.mark.dist

LISTEN = "0A"  # TCP state LISTEN in /proc/net/tcp*


def _listening_addresses(port: int) -> list[str]:
    """Local addresses (hex, as the kernel lists them) of sockets listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as handle:
            for line in handle.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.rsplit(":", 1)
                if state == LISTEN and int(hex_port, 16) == port:
                    found.append(address)
    return found


def _worker(out_dir: str) -> None:
    state = groups.init(dp=2, timeout_s=60)
    port = int(os.environ["MASTER_PORT"])
    Path(out_dir, f"rank{state.rank}.json").write_text(json.dumps(_listening_addresses(port)))
    groups.shutdown()


@pytest.mark.timeout(120)
def test_store_listens_on_loopback_only(tmp_path):
    spawn_workers(_worker, world_size=2, args=(str(tmp_path),))
    for rank in range(2):
        addresses = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert addresses == ["0100007F"], addresses  # 127.0.0.1, not 0.0.0.0 or ::


# A launcher holding a run directory's lock, with two workers that report their pid and wait forever.
_LAUNCHER = textwrap.dedent("""
    import os, sys, time
    from merak.distributed.launch import RunInterrupted, spawn_workers
    from merak.session.run_directory import RunDirectoryLock

    def wait_forever(out_dir):
        with open(os.path.join(out_dir, f"worker{os.environ['RANK']}.pid"), "w") as handle:
            handle.write(str(os.getpid()))
        while True:
            time.sleep(1)

    try:
        with RunDirectoryLock(sys.argv[1]):
            spawn_workers(wait_forever, world_size=2, args=(sys.argv[1],), start_method=sys.argv[2])
    except RunInterrupted as interrupt:
        sys.exit(interrupt.exit_code)
""")


def _alive(pid: int) -> bool:
    """Running, and not a zombie (a zombie holds no lock and runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGHUP], ids=["kill-9", "kill-HUP"])
def test_workers_end_with_their_launcher(tmp_path, how):
    """kill -9 gives the launcher no chance to stop its workers: they must notice on their own. SIGHUP (a
    closed terminal) is an interrupt like SIGTERM. Within 10 s no worker is left and the lock is free."""
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(tmp_path), "fork"], start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        pids = []
        while len(pids) < 2 and time.monotonic() < deadline and launcher.poll() is None:
            pids = [int(p.read_text()) for p in tmp_path.glob("worker*.pid") if p.read_text()]
            time.sleep(0.1)
        assert len(pids) == 2, "the workers did not start"
        os.kill(launcher.pid, how)
        assert launcher.wait(timeout=30) == (-how if how == signal.SIGKILL else 128 + how)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [pid for pid in pids if _alive(pid)] == [], "workers outlived their launcher"
        RunDirectoryLock(str(tmp_path)).acquire().release()  # not refused: nobody holds it any more
    finally:
        for pid in [launcher.pid, *pids]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _report_inherited_state(out_dir: str) -> None:
    Path(out_dir, f"rank{os.environ['RANK']}.state").write_text(str(groups.is_initialized()))


@pytest.mark.timeout(120)
def test_forked_workers_do_not_inherit_the_parallel_state(tmp_path):
    """A one-rank run (or a trainer) in this process keeps its state; workers forked afterwards join their
    own world rather than reusing it."""
    groups.init(dp=1)
    try:
        spawn_workers(_report_inherited_state, world_size=2, args=(str(tmp_path),), start_method="fork")
    finally:
        groups.shutdown()
    assert [(tmp_path / f"rank{r}.state").read_text() for r in range(2)] == ["False", "False"]
