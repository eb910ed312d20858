"""The summary of a Hydra sweep (``-m``): one row per job, printed and written to the sweep directory.

Every recipe's train.yaml registers :class:`SweepSummary` as a Hydra callback::

    hydra:
      callbacks:
        sweep_summary:
          _target_: merak.report.sweep.SweepSummary

Each job, in its own process (a subprocess or SLURM task with hydra-submitit-launcher), writes
``sweep_job.json`` next to its ``summary.json``: number, overrides, status (ok / failed) and the
error of a failed job. After the sweep the launching process reads those files and the
``summary.json`` of each job, prints the table and writes ``sweep_summary.json``,
``sweep_summary.md`` and ``loss.png`` (every job's training and evaluation loss, from its
``metrics.jsonl``: :mod:`merak.report.curves`) in the sweep directory.

Hydra's basic sweeper runs every job of the sweep and only then raises the first failed job's
exception, so Hydra never calls ``on_multirun_end`` when a job failed; the summary is then written
when the process exits (the command still exits with status 1).

``python -m merak.report.sweep SWEEP_DIR`` writes the summary again from the files (e.g. after SLURM jobs
that were still running when the launching process stopped waiting have finished).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import yaml
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from merak.report.curves import write_sweep_curves

logger = logging.getLogger(__name__)

JOB_FILE = "sweep_job.json"
COLUMNS = ("job", "overrides", "dp/tp/pp", "schedule", "final loss", "eval loss", "final lr", "step time (ms)",
           "samples/s", "tokens/s", "status")
NUMERIC = frozenset(range(4, 10))  # right-aligned columns
# Figures of a job's summary.json the table shows (the evaluation loss and learning rate are read apart).
SUMMARY_FIGURES = ("final_loss", "median_step_time_s", "samples_per_s", "tokens_per_s")


def _rank() -> int:
    """This process's rank when a launcher started one process per rank (torchrun, srun), else 0."""
    return int(os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or 0)


def _select(config: DictConfig, key: str) -> Any:
    try:
        return OmegaConf.select(config, key, default=None)
    except OmegaConfBaseException:  # an interpolation that cannot resolve in a failed job's config
        return None


def _short_error(error: BaseException) -> str:
    """The error in one line: its first line, and its last line when there are more."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = " ".join(lines) if len(lines) <= 4 else f"{lines[0]} ... {lines[-1]}"
    return f"{type(error).__name__}: {text}"


def _write_json(path: Path, payload: dict) -> None:
    temporary = path.with_name(f"{path.name}.tmp.{os.getpid()}")
    temporary.write_text(json.dumps(payload, indent=2), encoding="utf-8")
    os.replace(temporary, path)


def job_record(config: DictConfig, job_return: JobReturn) -> dict:
    """What a finished job reports about itself (the layout and schedule of its config: a failed
    job has no summary.json to read them from)."""
    failed = job_return.status != JobStatus.COMPLETED
    parallel = {axis: _select(config, f"parallel.{axis}") for axis in ("dp", "tp", "pp")}
    return {
        "job": _select(config, "hydra.job.num"),
        "overrides": list(_select(config, "hydra.overrides.task") or []),
        "output_dir": _select(config, "hydra.runtime.output_dir"),
        "status": "failed" if failed else "ok",
        "error": _short_error(job_return._return_value) if failed else None,
        "layout": parallel if all(isinstance(v, int) for v in parallel.values()) else None,
        "schedule": _select(config, "trainer.train_schedule"),
    }


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _job_files(sweep_dir: Path) -> dict[Path, int]:
    """Every job file (and Hydra's per-job overrides.yaml) under the sweep directory, with its mtime."""
    found = {}
    if sweep_dir.is_dir():
        for pattern in (JOB_FILE, "overrides.yaml"):
            for path in sweep_dir.rglob(pattern):
                if ".submitit" not in path.parts:
                    found[path] = path.stat().st_mtime_ns
    return found


def _unreported_job(overrides_file: Path) -> dict | None:
    """A job that started (Hydra wrote .hydra/) but never reported: killed, timed out, node lost."""
    hydra_cfg = overrides_file.parent / "hydra.yaml"
    try:
        hydra = OmegaConf.load(hydra_cfg).hydra
        number = OmegaConf.select(hydra, "job.num", default=None)
        overrides = list(OmegaConf.load(overrides_file))
    except (OSError, ValueError, yaml.YAMLError, OmegaConfBaseException):
        return None
    return {"job": number, "overrides": overrides, "output_dir": str(overrides_file.parent.parent),
            "status": "failed", "layout": None, "schedule": None,
            "error": "no report from the job (still running, killed, timed out or lost: see its log)"}


def collect(sweep_dir: Path, records: list[dict], before: dict[Path, int] | None = None) -> list[dict]:
    """The rows of the sweep: each job's record (from ``records``, else its job file) with the
    figures of its summary.json. Files that existed unchanged in ``before`` belong to an
    earlier sweep into the same directory and are left out."""
    before = before or {}
    new_files = [path for path, mtime in sorted(_job_files(sweep_dir).items()) if before.get(path) != mtime]
    by_dir: dict[str, dict] = {}
    for path in new_files:
        record = _read_json(path) if path.name == JOB_FILE else None
        if record is not None:
            by_dir[str(Path(record.get("output_dir") or path.parent).resolve())] = record
    for path in new_files:
        job_dir = str(path.parent.parent.resolve())
        if path.name == "overrides.yaml" and path.parent.name == ".hydra" and job_dir not in by_dir:
            record = _unreported_job(path)
            if record is not None:
                by_dir[job_dir] = record
    for record in records:  # jobs that ran in this process (their job file may be missing)
        by_dir[str(Path(record["output_dir"]).resolve())] = record
    rows = [_row(record) for record in by_dir.values()]
    return sorted(rows, key=lambda r: (r["job"] is None, r["job"] if isinstance(r["job"], int) else 0,
                                       str(r["output_dir"])))


def _row(record: dict) -> dict:
    """A job's record with the figures of its summary.json (None where the job failed or wrote none)."""
    row = {**record, **dict.fromkeys(SUMMARY_FIGURES), "eval_loss": None, "final_learning_rate": None}
    summary = _read_json(Path(record["output_dir"]) / "summary.json") if record.get("output_dir") else None
    if summary is None or record["status"] != "ok":
        return row
    row.update({key: summary.get(key) for key in SUMMARY_FIGURES})
    row["eval_loss"] = (summary.get("eval") or {}).get("eval_loss")  # the last evaluation: at the run's end
    row["final_learning_rate"] = summary.get("final_learning_rate")
    row["layout"] = summary.get("layout", row["layout"])
    row["schedule"] = summary.get("schedule", row["schedule"])
    return row


def _number(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def format_table(rows: list[dict]) -> str:
    """The sweep as a Markdown table (padded, so it reads in a terminal too), the overrides that
    every job shares above it and the errors of failed jobs below it."""
    shared = _shared_overrides(rows)
    cells = []
    for row in rows:
        layout = row.get("layout")
        step_time = row.get("median_step_time_s")
        cells.append((
            str(row["job"]), _own_overrides(row, shared).replace("|", "\\|") or "(none)",
            f"{layout['dp']}/{layout['tp']}/{layout['pp']}" if layout else "", row.get("schedule") or "",
            _number(row.get("final_loss"), ".4f"), _number(row.get("eval_loss"), ".4f"),
            _number(row.get("final_learning_rate"), ".2e"),
            _number(None if step_time is None else step_time * 1000, ",.1f"),
            _number(row.get("samples_per_s"), ",.1f"), _number(row.get("tokens_per_s"), ",.0f"), row["status"]))
    widths = [max(len(c[i]) for c in [COLUMNS, *cells]) for i in range(len(COLUMNS))]

    def line(values) -> str:
        return "| " + " | ".join(v.rjust(w) if i in NUMERIC else v.ljust(w)
                                 for i, (v, w) in enumerate(zip(values, widths))) + " |"

    rule = "|" + "|".join("-" * (w + 1) + ":" if i in NUMERIC else "-" * (w + 2) for i, w in enumerate(widths)) + "|"
    ok = sum(r["status"] == "ok" for r in rows)
    out = [f"sweep summary: {len(rows)} jobs, {ok} ok, {len(rows) - ok} failed"]
    if shared:
        out.append("shared overrides: " + " ".join(o for o in rows[0]["overrides"] if o in shared))
    out += ["", line(COLUMNS), rule, *(line(c) for c in cells)]
    failures = [r for r in rows if r["status"] != "ok"]
    if failures:
        out += ["", *(f"- job {r['job']} failed: {r['error']}" for r in failures)]
    return "\n".join(out)


def _shared_overrides(rows: list[dict]) -> set[str]:
    """The overrides every job of the sweep has (shown once, above the table)."""
    return set(rows[0]["overrides"]).intersection(*(r["overrides"] for r in rows[1:])) if rows else set()


def _own_overrides(row: dict, shared: set[str]) -> str:
    return " ".join(o for o in row["overrides"] if o not in shared)


def _curve_label(row: dict, shared: set[str]) -> str:
    """A job's name in the loss picture's legend: its number and what sets it apart."""
    own = _own_overrides(row, shared)
    label = f"job {row['job']}" + (f" {own}" if own else "")
    label = label if len(label) <= 48 else label[:45] + "..."  # the legend must leave room for the curves
    return label + (" (failed)" if row["status"] != "ok" else "")


def write_curves(sweep_dir: Path, rows: list[dict]) -> dict | None:
    """Write the sweep's ``loss.png``: the jobs that logged steps (a failed job's up to its failure)."""
    shared = _shared_overrides(rows)
    jobs = [(_curve_label(row, shared), row["output_dir"]) for row in rows if row.get("output_dir")]
    return write_sweep_curves(sweep_dir, jobs, title="loss per step, by job")


def write_summary(sweep_dir: Path, rows: list[dict]) -> str:
    """Write sweep_summary.json, sweep_summary.md and loss.png in ``sweep_dir``; return the table."""
    table = format_table(rows)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    _write_json(sweep_dir / "sweep_summary.json", {
        "sweep_dir": str(sweep_dir), "num_jobs": len(rows), "num_ok": sum(r["status"] == "ok" for r in rows),
        "num_failed": sum(r["status"] != "ok" for r in rows), "jobs": rows})
    (sweep_dir / "sweep_summary.md").write_text(table + "\n", encoding="utf-8")
    write_curves(sweep_dir, rows)
    return table


def _warn_if_slurm_tasks_cannot_follow(config: DictConfig) -> None:
    """hydra-submitit-launcher gives every job of a sweep the resources of the sweep's own config:
    the tasks of hydra/launcher=merak_slurm follow the layout the sweep starts from, not swept
    ``parallel`` values."""
    if not str(_select(config, "hydra.launcher._target_") or "").endswith(".SlurmLauncher"):
        return
    from hydra.core.override_parser.overrides_parser import OverridesParser

    task = [str(o) for o in config.hydra.overrides.task]
    swept = [o.input_line for o in OverridesParser.create().parse_overrides(task)
             if o.is_sweep_override() and o.key_or_group.split(".")[0] == "parallel"]
    if swept and not any(str(o).startswith("hydra.launcher.tasks_per_node=") for o in config.hydra.overrides.hydra):
        logger.warning("%s: every SLURM job of a sweep gets the same tasks, from the layout in the config "
                       "(not the swept values); jobs of another dp*tp*pp will fail. Sweep layouts of one size per "
                       "submission and set hydra.launcher.tasks_per_node = dp*tp*pp / nodes.",
                       " ".join(swept))


class SweepSummary(Callback):
    """Hydra callback: the table of a sweep's jobs (see the module docstring)."""

    def __init__(self) -> None:
        self._records: list[dict] = []
        self._sweep_dir: Path | None = None
        self._before: dict[Path, int] = {}
        self._pid: int | None = None
        self._done = True

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if _rank() != 0:
            return
        self._sweep_dir = Path(str(config.hydra.sweep.dir)).absolute()
        self._before = _job_files(self._sweep_dir)
        self._records, self._done, self._pid = [], False, os.getpid()
        _warn_if_slurm_tasks_cannot_follow(config)
        # When a job failed, Hydra raises before on_multirun_end: the summary is written at exit.
        atexit.register(self._finish)

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if _select(config, "hydra.mode") != RunMode.MULTIRUN or _rank() != 0:
            return
        record = job_record(config, job_return)
        self._records.append(record)
        try:
            if record["output_dir"]:
                _write_json(Path(record["output_dir"]) / JOB_FILE, record)
        except OSError as error:
            logger.warning("could not write %s in %s: %s", JOB_FILE, record["output_dir"], error)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._finish()

    def _finish(self) -> None:
        if self._done or self._pid != os.getpid() or self._sweep_dir is None:
            return
        self._done = True
        rows = collect(self._sweep_dir, self._records, self._before)
        if not rows:
            return
        table = write_summary(self._sweep_dir, rows)
        print(f"\n{table}\n(written to {self._sweep_dir}/sweep_summary.md and sweep_summary.json)", flush=True)


def main(argv: list[str] | None = None, *, prog: str = "merak sweep-summary") -> int:
    """merak sweep-summary SWEEP_DIR: (re)write and print the summary of a finished sweep; returns 0."""
    import argparse

    parser = argparse.ArgumentParser(prog=prog, description=main.__doc__)
    parser.add_argument("sweep_dir", type=Path)
    sweep_dir = parser.parse_args(argv).sweep_dir.absolute()
    rows = collect(sweep_dir, [])
    if not rows:
        parser.error(f"no job of a sweep under {sweep_dir}")
    print(write_summary(sweep_dir, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(prog="python -m merak.report.sweep"))
