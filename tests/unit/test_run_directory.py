"""The output directory's lock: one run at a time, a dead run's lock taken over with a message."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time

import pytest

from merak.session.run_directory import LOCK_NAME, RunDirectoryBusy, RunDirectoryLock

HOLD = """
import sys, time
from merak.session.run_directory import RunDirectoryLock
lock = RunDirectoryLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(60)
"""


def _holder(directory) -> subprocess.Popen:
    """Another process holding the lock of ``directory`` (returns once it holds it)."""
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(directory)], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "held"
    return process


def test_lock_is_exclusive_and_released(tmp_path):
    run_dir = tmp_path / "run"
    with RunDirectoryLock(str(run_dir)) as lock:
        assert lock.held and (run_dir / LOCK_NAME).exists()
        holder = json.loads((run_dir / LOCK_NAME).read_text())
        assert holder["pid"] > 0 and holder["host"]
        with pytest.raises(RunDirectoryBusy):  # a second lock in the same process is refused too
            RunDirectoryLock(str(run_dir)).acquire()
    assert not (run_dir / LOCK_NAME).exists()
    with RunDirectoryLock(str(run_dir)):  # free again
        pass


def test_second_run_gets_a_clear_error(tmp_path):
    holder = _holder(tmp_path)
    try:
        with pytest.raises(RunDirectoryBusy) as error:
            RunDirectoryLock(str(tmp_path)).acquire()
        message = str(error.value)
        assert str(tmp_path) in message and f"pid {holder.pid}" in message and "another directory" in message
    finally:
        holder.kill()
        holder.wait()


def test_lock_of_a_killed_run_is_taken_over_with_a_message(tmp_path, caplog):
    holder = _holder(tmp_path)
    holder.kill()  # no release: the file stays, the kernel drops the lock
    holder.wait()
    assert (tmp_path / LOCK_NAME).exists()
    with caplog.at_level(logging.WARNING, logger="merak.session.run_directory"):
        lock = RunDirectoryLock(str(tmp_path)).acquire()
    try:
        assert f"pid {holder.pid}" in caplog.text and "ended without releasing" in caplog.text
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] != holder.pid
    finally:
        lock.release()


def test_a_lock_file_removed_by_hand_lets_one_new_run_in(tmp_path):
    """A lock file removed under a holder (by hand) does not let two runs in."""
    first = RunDirectoryLock(str(tmp_path)).acquire()
    (tmp_path / LOCK_NAME).unlink()
    started = time.monotonic()
    second = RunDirectoryLock(str(tmp_path)).acquire()  # a new file: this one is free
    assert time.monotonic() - started < 1.0
    first.release()  # must not remove the second run's file
    assert (tmp_path / LOCK_NAME).exists()
    with pytest.raises(RunDirectoryBusy):
        RunDirectoryLock(str(tmp_path)).acquire()
    second.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_run_directory_that_cannot_be_written_is_one_line_before_anything_starts(tmp_path):
    from merak.config import ConfigError
    from merak.runner import _check_output_dir

    (tmp_path / "a-file").write_text("")
    for where in (tmp_path / "a-file", tmp_path / "a-file" / "run"):
        with pytest.raises(ConfigError, match=rf"the run directory {where} cannot be written \(.*\); choose another"):
            _check_output_dir(str(where))
    _check_output_dir(str(tmp_path / "new" / "run"))  # made when missing
    assert (tmp_path / "new" / "run").is_dir()
