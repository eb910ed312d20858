"""A pytest plugin for ``bench/gpu_check.py``: one JSON line per finished test case, written as it finishes.

A run stopped at its time limit writes no JUnit report; these lines keep every case that finished (with
pytest-xdist they are written by the controlling process). ``-p gpu_case_log`` with ``bench/`` on the
path and ``$MERAK_GPU_CASES`` naming the file.
"""

from __future__ import annotations

import json
import os

_IN_WORKER = False


def pytest_configure(config) -> None:
    global _IN_WORKER
    _IN_WORKER = hasattr(config, "workerinput")  # an xdist worker: the controller writes its reports


def pytest_runtest_logreport(report) -> None:
    path = os.environ.get("MERAK_GPU_CASES")
    if not path or _IN_WORKER or not (report.when == "call" or report.failed or report.skipped):
        return
    outcome = "error" if report.failed and report.when != "call" else report.outcome
    message = str(report.longrepr)[-1500:] if report.longrepr else ""
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps({"name": report.nodeid.split("::")[-1], "outcome": outcome,
                                 "seconds": round(report.duration, 1), "message": message}) + "\n")
