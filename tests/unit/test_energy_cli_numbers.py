"""``merak-energy plan`` checks its numbers before it writes anything: a bad value exits with status 2,
names the option, and leaves no ``--out`` directory (today's crash wrote an invalid plan.py first)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from merak.energy import cli
from merak.energy.profile_csv import ProfileRow, write_profile

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def profile(tmp_path_factory) -> Path:
    """A two-stage profile of forward and backward at three clocks (slower clocks use less energy)."""
    rows = []
    for stage in range(2):
        for name, base in (("forward", 0.010), ("backward", 0.021)):
            for clock, slow, power in ((1410, 1.0, 300.0), (1005, 1.3, 200.0), (705, 1.7, 150.0)):
                seconds = base * slow * (1 + stage)
                rows.append(ProfileRow(rank=stage, dp_rank=0, pp_rank=stage, tp_rank=0, instruction=name,
                                       frequency=clock, time=seconds, energy=seconds * power))
    path = tmp_path_factory.mktemp("profile") / "profile.csv"
    write_profile(str(path), rows)
    return path


def _argv(profile: Path, out: Path, **changes) -> list[str]:
    options = {"--num-stages": "2", "--num-microbatches": "4", "--schedule": "1f1b", "--p2p-power": "80",
               "--out": str(out), "--points": "5"}
    options.update(changes)
    argv = ["plan", str(profile)]
    for option, value in options.items():
        if value is not None:
            argv += [option, value]
    return argv


def _plan(argv: list[str]) -> int:
    """main's exit status, whether it returns it or exits the way argparse does."""
    try:
        return cli.main(argv)
    except SystemExit as stop:
        return stop.code


BAD = [
    ({"--num-stages": "0"}, "--num-stages", "must be >= 1, got 0"),
    ({"--num-stages": "-3"}, "--num-stages", "must be >= 1, got -3"),
    ({"--num-microbatches": "0"}, "--num-microbatches", "must be >= 1, got 0"),
    ({"--num-chunks": "0"}, "--num-chunks", "must be >= 1, got 0"),
    ({"--points": "1"}, "--points", "must be >= 2, got 1"),
    ({"--p2p-power": "-1"}, "--p2p-power", "must be a finite number >= 0, got -1.0"),
    ({"--p2p-power": "nan"}, "--p2p-power", "got nan"),
    ({"--p2p-power": "inf"}, "--p2p-power", "got inf"),
    ({"--deadline": "0"}, "--deadline", "must be a finite number > 0, got 0.0"),
    ({"--deadline": "-0.5"}, "--deadline", "got -0.5"),
    ({"--deadline": "nan"}, "--deadline", "got nan"),
    ({"--deadline": "1e-9"}, "--deadline", "shorter than the fastest possible step"),
    # What only the schedule knows: its builder's limits, named with the options.
    ({"--schedule": "interleaved_1f1b", "--num-chunks": "2", "--num-microbatches": "3"}, "--num-microbatches",
     "multiple of num_stages"),
    ({"--num-chunks": "2"}, "--num-chunks", "runs one model chunk per stage"),
    ({"--schedule": "shifted_critical_path", "--num-microbatches": "2"}, "--num-microbatches",
     "needs num_microbatches >= max(4, num_stages)"),
    ({"--schedule": "no_such_schedule"}, "--schedule", "unknown pipeline schedule 'no_such_schedule'"),
]


@pytest.mark.parametrize("changes,option,why", BAD, ids=[f"{o}={list(c.values())[-1]}" for c, o, _ in BAD])
def test_bad_number_exits_2_names_the_option_and_writes_nothing(profile, tmp_path, capsys, changes, option, why):
    out = tmp_path / "plan"
    assert _plan(_argv(profile, out, **changes)) == 2
    error = capsys.readouterr().err
    last = error.strip().splitlines()[-1]
    assert last.startswith("merak-energy plan: error: argument ") and option in last and why in last, error
    assert not out.exists()


def test_profile_without_the_stages_writes_nothing(profile, tmp_path, caplog):
    out = tmp_path / "plan"
    assert _plan(_argv(profile, out, **{"--num-stages": "3"})) == 2
    assert "has no rows for stage 2 backward" in caplog.text
    assert not out.exists()


def test_out_that_is_a_file_is_refused(profile, tmp_path, capsys):
    out = tmp_path / "plan"
    out.write_text("not a directory")
    assert _plan(_argv(profile, out)) == 2
    assert "argument --out: " in capsys.readouterr().err
    assert out.read_text() == "not a directory"


def test_good_numbers_write_the_plans(profile, tmp_path):
    out = tmp_path / "plan"
    assert _plan(_argv(profile, out)) == 0
    report = json.loads((out / "plan.json").read_text())
    assert report["num_stages"] == 2 and report["frontier_points"] >= 1
    assert (out / "plan.py").read_text().startswith("[\n")
    rows = (out / "frontier.csv").read_text().splitlines()
    assert rows[0] == "index,iteration_time,energy,plan" and len(rows) == report["frontier_points"] + 1
    assert not [p.name for p in out.rglob("*") if ".tmp." in p.name]  # atomic writes leave no temporaries


def test_command_line_num_stages_0(profile, tmp_path):
    """The reported crash, end to end: exit status 2, one error line, no plan directory."""
    out = tmp_path / "plan"
    command = [sys.executable, "-m", "merak.energy.cli", *_argv(profile, out, **{"--num-stages": "0"})]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines()[-1] == \
        "merak-energy plan: error: argument --num-stages: must be >= 1, got 0"
    assert "Traceback" not in result.stderr and not out.exists()
