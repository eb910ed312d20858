"""One command that checks merak on a GPU, within a few minutes, and writes what BENCHMARKS.md needs.

Three phases, each bounded in time, each writing its results even when a later one fails:

1. **tests/gpu** in parallel pytest workers (pytest-xdist where installed), each case under
   pytest-timeout: every recipe 3 bf16 steps at its toy and its default model against the plain loop's
   first loss, toy losses on CUDA equal the CPU's, compiled and CUDA-graph toys equal eager.
2. **bench/gpu_single.py**, eager and compiled, for gpt2, gpt3-xl, vit-base and wide-resnet50_2 (merak
   and the plain bf16 loop side by side: step time, MFU, peak memory, NVML joules per step). It runs in
   a subprocess that writes its JSON after every model, so a time limit keeps the models it finished.
3. **The report**: ``gpu_check.json`` (everything) and ``gpu_check.md`` (the tables and the goals:
   no crash; merak / plain eager <= 1.00; merak compiled <= plain compiled; gpt3-xl MFU >= 40 % by
   6N + 12LHS over the device's dense bf16 peak).

On the GPU machine (Python 3.12, torch 2.11; the wheels docs/gpu.md lists, carried in ``.whl/``)::

    python3 bench/gpu_check.py --out $OUT

``--smoke`` runs the same code on the CPU: the test phase only collects tests/gpu (every case skips
without CUDA), the benchmark phase runs gpu_single.py's ``--smoke`` on one toy model. CI runs it.
Nothing here changes a clock, a power limit or any other setting of the GPU: NVML is only read.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # first: sets OMP_NUM_THREADS before torch starts threads
import torch

logger = logging.getLogger("bench.gpu_check")

REPO = Path(__file__).resolve().parents[1]
BENCH_MODELS = ("gpt2", "gpt3-xl", "vit-base", "wide-resnet50_2")
# Goals (issue "Ready for a GPU cluster"): merak's step against the plain loop's, and gpt3-xl's MFU.
EAGER_RATIO_GOAL = 1.00
COMPILED_RATIO_GOAL = 1.00
GPT3_XL_MFU_GOAL = 0.40


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="outputs/gpu_check", help="folder for gpu_check.{json,md} and the logs")
    parser.add_argument("--smoke", action="store_true", help="CPU: collect tests/gpu, smoke-run gpu_single.py")
    parser.add_argument("--workers", type=int, default=None,
                        help="pytest-xdist workers for tests/gpu (default: half the CPUs, at most 8)")
    parser.add_argument("--tests-s", type=float, default=210.0, help="time limit of the test phase")
    parser.add_argument("--case-s", type=float, default=200.0, help="pytest-timeout of one test case")
    parser.add_argument("--bench-s", type=float, default=230.0, help="time limit of the benchmark phase")
    parser.add_argument("--model", action="append", help=f"benchmark models (default: {', '.join(BENCH_MODELS)})")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("-k", dest="keyword", help="pytest -k expression for tests/gpu")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-bench", action="store_true")
    return parser.parse_args(argv)


def _environment() -> dict:
    """Where the python running this finds carried wheels (PYTHONPATH) and the checkout, for subprocesses."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(REPO) not in paths:
        paths.append(str(REPO))
    # The data caches stay out of ``out``, which holds only the report and its logs.
    cache = os.environ.get("MERAK_CACHE_DIR") or tempfile.mkdtemp(prefix="merak-gpu-check-")
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths), PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
                HF_DATASETS_OFFLINE="1", MERAK_CACHE_DIR=cache)


def _run(command: list[str], log: Path, env: dict, limit_s: float) -> tuple[int | None, float]:
    """Run ``command`` with its output in ``log``; the exit status (None: stopped at ``limit_s``) and seconds."""
    started = time.monotonic()
    with log.open("w") as handle:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            status = process.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)  # pytest's workers and the training subprocesses with it
            process.wait()
            status = None
    return status, time.monotonic() - started


def _cases(path: Path) -> list[dict]:
    """Every finished test case (``gpu_case_log.py``'s lines): name, outcome, seconds, the failure's end."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_tests(args, out: Path, env: dict) -> dict:
    """Phase 1: tests/gpu (only collected with ``--smoke``)."""
    cases_file = out / "gpu_cases.jsonl"
    cases_file.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pytest", "-q", "-rfE", "-m", "gpu", "tests/gpu", "-p", "no:cacheprovider",
               "-p", "gpu_case_log", "-o", "addopts="]
    if args.keyword:
        command += ["-k", args.keyword]
    if args.smoke:
        command.append("--collect-only")
    else:
        workers = args.workers or max(1, min(8, (os.cpu_count() or 2) // 2))
        if importlib.util.find_spec("xdist") is not None and workers > 1:
            command += ["-n", str(workers)]
        if importlib.util.find_spec("pytest_timeout") is not None:
            command += ["--timeout", str(int(args.case_s))]
    env = dict(env, MERAK_GPU_CASES=str(cases_file),
               PYTHONPATH=os.pathsep.join([str(REPO / "bench"), env["PYTHONPATH"]]))
    status, seconds = _run(command, out / "gpu_tests.log", env, args.tests_s)
    log = (out / "gpu_tests.log").read_text()
    cases = _cases(cases_file)
    result = {"command": " ".join(command[1:]), "exit_status": status, "seconds": round(seconds, 1),
              "stopped_at_limit": status is None, "cases": cases,
              "counts": {kind: sum(c["outcome"] == kind for c in cases)
                         for kind in ("passed", "failed", "error", "skipped")}}
    if args.smoke:
        result["collected"] = sum(1 for line in log.splitlines() if "::" in line)
    result["log_tail"] = log[-3000:]
    return result


def run_bench(args, out: Path, env: dict) -> dict:
    """Phase 2: gpu_single.py, eager and compiled, in a subprocess bounded by ``--bench-s``."""
    target = out / "gpu_single.json"
    target.unlink(missing_ok=True)
    models = args.model or (["gpt2"] if args.smoke else list(BENCH_MODELS))
    command = [sys.executable, str(REPO / "bench" / "gpu_single.py"), "--compile", "--json", str(target),
               "--warmup", str(args.warmup), "--steps", str(args.steps)]
    command += [flag for name in models for flag in ("--model", name)]
    if args.smoke:
        command += ["--smoke", "--workers", "0"]
    status, seconds = _run(command, out / "gpu_single.log", env, args.bench_s)
    payload = json.loads(target.read_text()) if target.exists() else {"results": []}
    done = {row["model"] for row in payload["results"]}
    return {"command": " ".join(command[1:]), "exit_status": status, "seconds": round(seconds, 1),
            "stopped_at_limit": status is None, "not_measured": [m for m in models if m not in done],
            "machine": payload.get("machine"), "results": payload["results"],
            "log_tail": (out / "gpu_single.log").read_text()[-3000:]}


def goals(tests: dict | None, bench: dict | None) -> list[dict]:
    """Each goal with the measured value and whether it is met (None: not measured)."""
    rows = []
    if tests is not None and "collected" not in tests:
        crashed = tests["counts"]["failed"] + tests["counts"]["error"]
        rows.append({"goal": "tests/gpu: every case passes", "value": f"{tests['counts']['passed']} passed, "
                     f"{crashed} failed", "met": crashed == 0 and not tests["stopped_at_limit"]
                     and tests["counts"]["passed"] > 0})
    for row in (bench or {}).get("results", []):
        errors = [key for key in row if key.endswith("_error")]
        rows.append({"goal": f"{row['model']}: no crash", "value": ", ".join(errors) or "none", "met": not errors})
        for key, goal, label in (("ratio", EAGER_RATIO_GOAL, "merak / plain eager"),
                                 ("compiled_ratio", COMPILED_RATIO_GOAL, "merak / plain compiled")):
            value = row.get(key)
            rows.append({"goal": f"{row['model']}: {label} <= {goal:.2f}",
                         "value": None if value is None else round(value, 3),
                         "met": None if value is None else value <= goal})
        if row["model"] == "gpt3-xl":
            best = max((row.get(f"{w}_mfu_6n") or 0 for w in ("merak", "merak_compiled")), default=0)
            rows.append({"goal": f"gpt3-xl: merak MFU (6N + 12LHS) >= {GPT3_XL_MFU_GOAL:.0%}",
                         "value": round(best, 3) if best else None, "met": best >= GPT3_XL_MFU_GOAL if best else None})
    return rows


def _why(message: str) -> str:
    """The line of a pytest failure that says what went wrong (its last ``E`` line), shortened."""
    lines = [line for line in message.splitlines() if line.strip()]
    errors = [line[1:].strip() for line in lines if line.startswith("E ")]
    return ((errors or lines or [""])[-1])[:160].replace("|", "/")


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(report: dict) -> str:
    """The tables for BENCHMARKS.md."""
    facts = report["facts"]
    lines = [f"`python3 bench/gpu_check.py` at {facts.get('commit') or 'an unknown commit'}, "
             f"{facts['date']}, {facts['gpu']} (torch {facts['torch']}, CUDA {facts.get('cuda')}, "
             f"driver {facts.get('driver')})", ""]
    tests = report.get("tests")
    if tests and "collected" in tests:
        lines += [f"tests/gpu: {tests['collected']} cases collected (not run: no CUDA device)", ""]
    elif tests:
        counts = tests["counts"]
        lines += [f"tests/gpu: {counts['passed']} passed, {counts['failed']} failed, {counts['error']} errors, "
                  f"{counts['skipped']} skipped in {tests['seconds']:.0f} s"
                  + (" (stopped at the phase's time limit)" if tests["stopped_at_limit"] else ""), ""]
        failed = [c for c in tests["cases"] if c["outcome"] in ("failed", "error")]
        if failed:
            lines.append(common.format_table(["failed case", "why"], [(c["name"], _why(c["message"])) for c in failed]))
            lines.append("")
    bench = report.get("bench")
    if bench and bench["results"]:
        header = ["model", "plain s", "merak s", "merak / plain", "plain compiled s", "merak compiled s",
                  "merak_c / plain_c", "MFU merak / merak_c", "peak GiB plain / merak", "J/step plain / merak",
                  "error"]
        rows = []
        for r in bench["results"]:
            mfu = "mfu_6n" if r.get("lm_flops_per_step") else "mfu"
            error = next((r[k] for k in r if k.endswith("_error")), "")
            rows.append((r["model"], _fmt(r.get("plain_s"), ".4f"), _fmt(r.get("merak_s"), ".4f"),
                         _fmt(r.get("ratio"), ".3f"), _fmt(r.get("plain_compiled_s"), ".4f"),
                         _fmt(r.get("merak_compiled_s"), ".4f"), _fmt(r.get("compiled_ratio"), ".3f"),
                         f"{_fmt(r.get(f'merak_{mfu}'), '.1%')} / {_fmt(r.get(f'merak_compiled_{mfu}'), '.1%')}",
                         f"{_fmt(r.get('plain_peak_bytes', 0) / 2**30, '.1f')} / "
                         f"{_fmt(r.get('merak_peak_bytes', 0) / 2**30, '.1f')}",
                         f"{_fmt(r.get('plain_joules'), '.0f')} / {_fmt(r.get('merak_joules'), '.0f')}",
                         error[:100]))
        lines += [common.format_table(header, rows), ""]
        if bench["not_measured"]:
            lines += [f"Not measured (time limit): {', '.join(bench['not_measured'])}", ""]
    lines += [common.format_table(["goal", "value", "met"],
                                  [(g["goal"], g["value"], {True: "yes", False: "NO", None: "-"}[g["met"]])
                                   for g in report["goals"]])]
    return "\n".join(lines) + "\n"


def _git_commit() -> str | None:
    """The checkout's commit; None in a copy without ``.git`` (set ``$MERAK_COMMIT`` there)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _facts(smoke: bool) -> dict:
    facts = {**common.machine_facts(), "gpu": "CPU (smoke)" if smoke else torch.cuda.get_device_name(),
             "cuda": torch.version.cuda}
    facts["commit"] = os.environ.get("MERAK_COMMIT") or _git_commit()
    if not smoke:
        try:
            import pynvml

            pynvml.nvmlInit()
            facts["driver"] = pynvml.nvmlSystemGetDriverVersion()
        except Exception as error:  # ImportError or pynvml.NVMLError: the report says so, nothing else needs it
            facts["driver"] = f"unknown ({type(error).__name__})"
    return facts


def main(argv=None) -> dict:
    args = parse_args(argv)
    common.setup_logging()
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("gpu_check.py needs a CUDA device (--smoke runs it on the CPU)")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = _environment()
    report = {"facts": _facts(args.smoke), "args": vars(args)}

    def save() -> None:
        report["goals"] = goals(report.get("tests"), report.get("bench"))
        (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
        (out / "gpu_check.md").write_text(markdown(report))

    if not args.skip_tests:
        logger.info("phase 1: tests/gpu (at most %.0f s)", args.tests_s)
        report["tests"] = run_tests(args, out, env)
        save()
    if not args.skip_bench:
        logger.info("phase 2: gpu_single.py eager and compiled (at most %.0f s)", args.bench_s)
        report["bench"] = run_bench(args, out, env)
    save()
    sys.stdout.write((out / "gpu_check.md").read_text())
    return report


if __name__ == "__main__":
    main()
