"""The instruction profile CSV: its name, its columns, reading it back, and its errors."""

from __future__ import annotations

import pytest

from merak.energy.profile_csv import (
    COLUMNS,
    Option,
    ProfileError,
    ProfileRow,
    check_coverage,
    profile_file_name,
    read_profile,
    write_profile,
)

HEADER = "rank,dp_rank,pp_rank,tp_rank,stage,instruction,frequency,time,energy"


def _rows():
    """Two stages, two dp ranks each (rank = pp * 2 + dp), forward and backward at three clocks."""
    rows = []
    for pp in range(2):
        for dp in range(2):
            for name, base in (("forward", 0.010), ("backward", 0.021)):
                for clock, slow in ((1005, 1.3), (1410, 1.0), (705, 1.7)):
                    seconds = base * slow * (1 + pp) + dp * 0.002
                    rows.append(ProfileRow(rank=pp * 2 + dp, dp_rank=dp, pp_rank=pp, tp_rank=0, instruction=name,
                                           frequency=clock, time=seconds, energy=seconds * clock / 5.0))
    return rows


def test_profile_file_name():
    name = profile_file_name(model="gpt3-xl", partition_method="uniform", dp=2, pp=4, tp=1, micro_batch_size=4)
    assert name == "merak+gpt3-xl+uniform+dp2+pp4+tp1+mbs4.csv"


def test_write_then_read_round_trip(tmp_path):
    path = tmp_path / "profile.csv"
    rows = _rows()
    write_profile(str(path), rows)
    lines = path.read_text().splitlines()
    assert lines[0] == HEADER
    assert ",".join(COLUMNS) == HEADER
    assert len(lines) == 1 + len(rows) == 25
    # rank 0 first, forward before backward, clocks highest first
    assert lines[1].split(",")[:7] == ["0", "0", "0", "0", "0", "forward", "1410"]
    assert [line.split(",")[6] for line in lines[1:4]] == ["1410", "1005", "705"]

    options = read_profile(str(path))
    assert list(options) == [(0, "backward"), (0, "forward"), (1, "backward"), (1, "forward")]
    for (stage, name), opts in options.items():
        assert [o.frequency for o in opts] == [1410, 1005, 705]
        base = 0.010 if name == "forward" else 0.021
        for o, slow in zip(opts, (1.0, 1.3, 1.7)):
            # dp ranks 0 and 1 differ by 2 ms: the average sits 1 ms above dp rank 0
            expected = base * slow * (1 + stage) + 0.001
            assert o.time == pytest.approx(expected, rel=1e-12)
            assert o.energy == pytest.approx(expected * o.frequency / 5.0, rel=1e-12)


def test_single_rank_values_round_trip_exactly(tmp_path):
    path = tmp_path / "one.csv"
    rows = [ProfileRow(0, 0, 0, 0, "forward", 1410, 0.1234567890123, 45.678901234567),
            ProfileRow(0, 0, 0, 0, "forward", 600, 0.3 + 1e-15, 33.3)]
    write_profile(str(path), rows)
    assert read_profile(str(path)) == {(0, "forward"): [Option(1410, 0.1234567890123, 45.678901234567),
                                                        Option(600, 0.3 + 1e-15, 33.3)]}


def test_rows_of_two_dp_ranks_are_averaged(tmp_path):
    path = tmp_path / "avg.csv"
    write_profile(str(path), [ProfileRow(4, 0, 2, 0, "backward", 1200, 0.020, 8.0),
                              ProfileRow(5, 1, 2, 0, "backward", 1200, 0.030, 12.0),
                              ProfileRow(5, 1, 2, 0, "backward", 1410, 0.016, 10.0)])
    options = read_profile(str(path))
    assert options == {(2, "backward"): [Option(1410, 0.016, 10.0), Option(1200, pytest.approx(0.025),
                                                                          pytest.approx(10.0))]}


def test_options_sorted_highest_clock_first(tmp_path):
    path = tmp_path / "order.csv"
    path.write_text(HEADER + "\n"
                    + "0,0,0,0,0,forward,900,0.2,20\n0,0,0,0,0,forward,1410,0.1,30\n0,0,0,0,0,forward,1200,0.15,25\n")
    assert [o.frequency for o in read_profile(str(path))[(0, "forward")]] == [1410, 1200, 900]


def test_readable_by_pandas(tmp_path):
    import pandas as pd
    path = tmp_path / "pd.csv"
    rows = _rows()
    write_profile(str(path), rows)
    frame = pd.read_csv(path)
    assert list(frame.columns) == COLUMNS
    assert len(frame) == 24
    assert sorted(frame["stage"].unique().tolist()) == [0, 1]
    assert (frame["stage"] == frame["pp_rank"]).all()
    mean = frame[(frame.stage == 1) & (frame.instruction == "backward") & (frame.frequency == 705)]["time"].mean()
    assert mean == pytest.approx(read_profile(str(path))[(1, "backward")][2].time, rel=1e-12)
    assert mean == pytest.approx(0.021 * 1.7 * 2 + 0.001, rel=1e-12)


# -- errors ----------------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    with pytest.raises(ProfileError, match="does not exist"):
        read_profile(str(tmp_path / "nope.csv"))


def test_missing_column(tmp_path):
    path = tmp_path / "cols.csv"
    path.write_text("rank,dp_rank,pp_rank,tp_rank,stage,instruction,frequency,time\n0,0,0,0,0,forward,1410,0.1\n")
    with pytest.raises(ProfileError, match=r"lacks the column\(s\) energy;"):
        read_profile(str(path))


def test_non_numeric_time(tmp_path):
    path = tmp_path / "nan.csv"
    path.write_text(HEADER + "\n0,0,0,0,0,forward,1410,0.1,30\n0,0,0,0,0,forward,1200,slow,25\n")
    with pytest.raises(ProfileError, match=r"nan\.csv:3: stage, frequency, time and energy must be numbers"):
        read_profile(str(path))


def test_negative_energy(tmp_path):
    path = tmp_path / "neg.csv"
    path.write_text(HEADER + "\n0,0,0,0,0,forward,1410,0.1,-30\n")
    with pytest.raises(ProfileError, match=r"neg\.csv:2: .*frequency, time and energy positive"):
        read_profile(str(path))


def test_header_only(tmp_path):
    path = tmp_path / "empty.csv"
    path.write_text(HEADER + "\n")
    with pytest.raises(ProfileError, match="has no rows"):
        read_profile(str(path))


def test_check_coverage_names_what_is_missing(tmp_path):
    path = tmp_path / "cov.csv"
    write_profile(str(path), [row for row in _rows() if not (row.pp_rank == 1 and row.instruction == "backward")])
    options = read_profile(str(path))
    check_coverage(options, {(0, "forward"), (0, "backward"), (1, "forward")}, str(path))
    with pytest.raises(ProfileError, match=r"no rows for stage 1 backward \(it covers stages \[0, 1\]\)"):
        check_coverage(options, {(0, "forward"), (1, "backward"), (1, "forward")}, str(path))
    with pytest.raises(ProfileError, match=r"no rows for stage 0 recompute, stage 2 forward \("):
        check_coverage(options, {(0, "recompute"), (2, "forward")}, str(path))
