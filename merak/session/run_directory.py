"""One run per output directory: an exclusive lock held for the life of a run.

Two runs writing one directory would interleave their ``metrics.jsonl`` lines and
replace each other's checkpoints. The lock is ``<output_dir>/.merak-run.lock``, an
advisory ``flock`` on that file: the kernel drops it when its holder dies, so the lock
of a crashed run is never stuck. The file also records who holds it (host, pid, start
time, command), for the error a second run gets and for the message of a run that
takes over a file left by one that died.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import sys
import time

logger = logging.getLogger(__name__)

LOCK_NAME = ".merak-run.lock"


class RunDirectoryBusy(RuntimeError):
    """Another live run holds the output directory."""


class RunDirectoryLock:
    """An exclusive lock on a run directory (a context manager; also :meth:`acquire`/:meth:`release`).

    Args:
        output_dir: the run directory (created if needed).
    """

    def __init__(self, output_dir: str) -> None:
        self.output_dir = os.path.abspath(output_dir)
        self.path = os.path.join(self.output_dir, LOCK_NAME)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> RunDirectoryLock:
        """Take the lock, or raise RunDirectoryBusy naming the run that holds it."""
        os.makedirs(self.output_dir, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                os.close(fd)
                if error.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                    raise
                raise RunDirectoryBusy(self._busy_message()) from None
            # The holder before us may have removed the file between our open and our lock: then we
            # locked a file nobody else will see. Try again on the current one.
            if self._same_file(fd):
                break
            os.close(fd)
        self._fd = fd
        previous = _read_holder(fd)
        if previous:
            logger.warning("%s: taking over the lock of a run that ended without releasing it (%s)",
                           self.output_dir, _describe(previous))
        _write_holder(fd)
        return self

    def release(self) -> None:
        """Give the lock back and remove the file (the file goes first, while the lock is still held)."""
        if self._fd is None:
            return
        try:
            if self._same_file(self._fd):
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunDirectoryLock:
        return self.acquire()

    def __exit__(self, *_exc) -> None:
        self.release()

    def _same_file(self, fd: int) -> bool:
        try:
            here = os.stat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (here.st_dev, here.st_ino) == (mine.st_dev, mine.st_ino)

    def _busy_message(self) -> str:
        try:
            with open(self.path, encoding="utf-8") as handle:
                holder = json.loads(handle.read() or "{}")
        except (OSError, ValueError):
            holder = {}
        who = _describe(holder) if holder else "another process"
        return (f"{self.output_dir} is in use by a run that is still going ({who}); wait for it to end, or "
                f"choose another directory (hydra.run.dir=... or trainer.output_dir=...)")


def _read_holder(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = os.read(fd, 65536)
    try:
        holder = json.loads(raw or b"{}")
    except ValueError:
        return {"content": raw[:80].decode("utf-8", "replace")}
    return holder if isinstance(holder, dict) else {}


def _write_holder(fd: int) -> None:
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "command": " ".join(sys.argv)[:500]}
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, json.dumps(holder).encode())


def _describe(holder: dict) -> str:
    parts = [f"{key} {holder[key]}" for key in ("host", "pid", "started", "command", "content") if key in holder]
    return ", ".join(parts) or "unknown"
