"""``merak-energy serve`` and the files and servers a run is given: one-line errors and bounded resources.

The server runs in this process, in a thread, on a free port; a tiny ``http.server`` plays a web
server that is not zeus.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import logging
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from merak.energy import cli, zeus_server
from merak.energy.dag import step_graph
from merak.energy.frontier import FrontierError, read_frontier
from merak.energy.plans import PlanError, read_plan, write_plan
from merak.energy.settings import EnergySettings, energy_problems

GRAPH = step_graph("1f1b", 2, 4)
CLOCKS = [1410, 1005, 705]
BINARY = bytes(range(256)) * 4  # not UTF-8 from its 0x80 on


def _plans(mhz: int) -> list[list[tuple[str, int]]]:
    return [[(name, mhz) for name in GRAPH.stage_names(stage)] for stage in range(GRAPH.num_stages)]


@pytest.fixture
def plan(tmp_path) -> Path:
    path = tmp_path / "plan.py"
    write_plan(str(path), _plans(1005))
    return path


def _frontier_data() -> dict:
    return {"format": 1, "schedule": "1f1b", "num_stages": 2, "num_microbatches": 4, "num_chunks": 1,
            "p2p_power": 80.0, "step_overhead_s": 0.0,
            "points": [{"iteration_time": t, "energy": e, "plans": [[list(x) for x in s] for s in _plans(mhz)]}
                       for t, e, mhz in ((1.0, 10.0, 1410), (1.5, 8.0, 1005))]}


@pytest.fixture
def frontier(tmp_path) -> Path:
    path = tmp_path / "frontier.json"
    path.write_text(json.dumps(_frontier_data()))
    return path


def _main(argv: list[str]) -> int:
    """main's exit status, whether it returns it or exits the way argparse does."""
    try:
        return cli.main(argv)
    except SystemExit as stop:
        return stop.code


# -- 1. serve's options are checked before anything is served ------------------------------------------

BAD_SERVE = [
    (["--port", "99999"], "argument --port: must be in 0..65535, got 99999"),
    (["--port", "-1"], "argument --port: must be in 0..65535, got -1"),
    (["--deadline", "-1"], "argument --deadline: must be a finite number > 0, got -1.0"),
    (["--deadline", "0"], "argument --deadline: must be a finite number > 0, got 0.0"),
    (["--deadline", "nan"], "argument --deadline: must be a finite number > 0, got nan"),
    (["--host", ""], "argument --host: must not be empty"),
    (["--host", "  "], "argument --host: must not be empty"),
    (["--dump-dir", ""], "argument --dump-dir: must not be empty"),
    (["--log-level", "loud"], "argument --log-level: must be one of CRITICAL, ERROR, WARNING, INFO, DEBUG, got 'loud'"),
    (["--max-request-bytes", "10"], "argument --max-request-bytes: must be >= 1024, got 10"),
    (["--max-jobs", "0"], "argument --max-jobs: must be >= 1, got 0"),
    (["--max-ranks", "0"], "argument --max-ranks: must be >= 1, got 0"),
]


@pytest.fixture
def served(monkeypatch) -> list[dict]:
    """What serve() was called with, instead of serving."""
    calls: list[dict] = []
    monkeypatch.setattr(zeus_server, "serve", lambda plan, **options: calls.append({"plan": plan, **options}))
    return calls


@pytest.mark.parametrize("options,error", BAD_SERVE, ids=[" ".join(o) for o, _ in BAD_SERVE])
def test_bad_serve_option_exits_2_in_one_line(frontier, tmp_path, capsys, served, options, error):
    assert _main(["serve", str(frontier), "--dump-dir", str(tmp_path / "dump"), *options]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == f"merak-energy serve: error: {error}", err
    assert served == []


def test_serve_files_and_deadline_checked_before_serving(plan, tmp_path, capsys, served):
    (tmp_path / "file").write_text("")
    cases = [([str(tmp_path / "missing.py")], f"argument plan: {tmp_path / 'missing.py'} does not exist"),
             ([str(tmp_path)], f"argument plan: {tmp_path} is not a file"),
             ([str(plan), "--deadline", "2"], f"argument --deadline: only a frontier file (.json) has points to "
                                              f"choose from, not {plan}"),
             ([str(plan), "--dump-dir", str(tmp_path / "file")],
              f"argument --dump-dir: {tmp_path / 'file'} exists and is not a directory")]
    for argv, error in cases:
        assert _main(["serve", *argv]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == f"merak-energy serve: error: {error}"
    assert served == []


def test_good_serve_options_reach_the_server(frontier, tmp_path, served):
    assert _main(["serve", str(frontier), "--port", "0", "--deadline", "1.2", "--log-level", "debug",
                  "--max-jobs", "3", "--max-ranks", "8", "--max-request-bytes", "4096",
                  "--dump-dir", str(tmp_path / "d")]) == 0
    assert served == [{"plan": str(frontier), "host": "127.0.0.1", "port": 0, "dump_dir": str(tmp_path / "d"),
                       "log_level": "DEBUG", "deadline": 1.2, "max_request_bytes": 4096, "max_jobs": 3,
                       "max_ranks": 8}]


def test_serve_help_documents_the_limits(capsys):
    assert _main(["serve", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for needed in ("--max-request-bytes", "HTTP 413", "--max-jobs", "--max-ranks", "0..65535", "0: a free port"):
        assert needed in text


@contextlib.contextmanager
def _running(plan_path: Path, tmp_path: Path, **options):
    """The zeus server on a free port in a thread; yields its URL."""
    pytest.importorskip("zeus")
    server, sock = zeus_server.prepare_server(str(plan_path), port=0, dump_dir=str(tmp_path / "dump"),
                                              log_level="WARNING", **options)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        started = time.monotonic()
        while not server.started:
            assert thread.is_alive() and time.monotonic() - started < 30, "the server did not start"
            time.sleep(0.02)
        yield zeus_server.socket_url(sock)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def test_port_0_serves_on_a_free_port_named_in_the_log(plan, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="merak.energy"), _running(plan, tmp_path) as url:
        port = int(url.rsplit(":", 1)[1])
        assert port > 0
        assert f"serving {plan} at http://127.0.0.1:{port} " in caplog.text
        assert httpx.get(url + "/openapi.json", timeout=10).status_code == 200


def test_an_address_in_use_is_one_line():
    with zeus_server.listen("127.0.0.1", 0) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(zeus_server.ServeError, match=f"^cannot listen on 127.0.0.1:{port}: .+$"):
            zeus_server.listen("127.0.0.1", port)


# -- 2. request bodies and jobs are bounded ---------------------------------------------------------------


def _job(world_size: int = 2, metadata: str = "test") -> dict:
    return {"pp_degree": world_size, "dp_degree": 1, "tp_degree": 1, "world_size": world_size,
            "job_metadata": metadata}


def _rank(rank: int) -> dict:
    return {"rank": rank, "dp_rank": 0, "pp_rank": rank, "tp_rank": 0, "available_frequencies": CLOCKS}


def test_a_request_body_over_the_limit_gets_413(plan, tmp_path):
    with _running(plan, tmp_path, max_request_bytes=2048) as url, httpx.Client(base_url=url, timeout=30) as http:
        declared = http.post("/register_job", json=_job(metadata="x" * 5000))
        assert declared.status_code == 413
        assert "over this server's limit of 2048 bytes" in declared.json()["detail"]

        def chunks():  # no Content-Length: read up to the limit only
            yield b'{"job_metadata": "'
            for _ in range(4):
                yield b"x" * 1000

        chunked = http.post("/register_job", content=chunks(), headers={"content-type": "application/json"})
        assert chunked.status_code == 413 and "2048 bytes" in chunked.json()["detail"]
        assert http.post("/register_job", json=_job()).status_code == 200  # a real one still fits


def test_a_job_runs_through_the_limits(plan, tmp_path):
    """Registration, schedules and results of a two-stage job, every body passing through the limit."""
    with _running(plan, tmp_path, max_request_bytes=4096, max_jobs=1) as url, \
            httpx.Client(base_url=url, timeout=30) as http:
        job = http.post("/register_job", json=_job()).json()
        for rank in (0, 1):
            assert http.post(f"/register_rank/{job}", json=_rank(rank)).status_code == 200
        refused = http.post(f"/register_rank/{job}", json=_rank(1))
        assert refused.status_code == 400 and "already has all its 2 ranks" in refused.text
        with ThreadPoolExecutor(2) as pool:  # each rank's request waits for the other's
            answers = list(pool.map(lambda r: http.get(f"/schedule/{job}", params={"rank": r}), (0, 1)))
        assert [a.status_code for a in answers] == [200, 200]
        assert [[tuple(f) for f in a.json()["frequencies"]] for a in answers] == _plans(1005)
        for rank in (0, 1):
            result = {"rank": rank, "iter_time": [0.5], "iter_energy": [40.0]}
            assert http.post(f"/result/{job}", json=result).status_code == 200
        dumped = tmp_path / "dump" / job / "0.prof.json"
        assert sorted(r["rank"] for r in _written_json(dumped, within_s=10)) == [0, 1]


def _written_json(path, within_s: float):
    """The JSON zeus writes at ``path``, once whole: it writes in place, so the file can exist empty or half
    written for a moment."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return json.loads(path.read_text())
        except (FileNotFoundError, ValueError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_the_server_keeps_at_most_max_jobs(plan, tmp_path):
    with _running(plan, tmp_path, max_jobs=2) as url, httpx.Client(base_url=url, timeout=30) as http, \
            ThreadPoolExecutor(1) as pool:
        first = http.post("/register_job", json=_job()).json()
        assert http.post(f"/register_rank/{first}", json=_rank(0)).status_code == 200
        # Rank 0 waits for its schedule until rank 1 registers, which never happens here.
        waiting = pool.submit(http.get, f"/schedule/{first}", params={"rank": 0})
        time.sleep(0.3)
        ids = [http.post("/register_job", json=_job()).json() for _ in range(3)]
        assert len({first, *ids}) == 4  # registered within a second, the same layout: still four jobs
        # The first job was dropped for the second newer one: its waiting rank is told, not left waiting.
        dropped = waiting.result(timeout=10)
        assert dropped.status_code in (404, 500) and ("was dropped" in dropped.text or "no job" in dropped.text)
        for job in (first, ids[0]):
            gone = http.post(f"/register_rank/{job}", json=_rank(0))
            assert gone.status_code == 404 and "keeps the 2 most recently active jobs" in gone.json()["detail"]
        for job in ids[1:]:
            assert http.post(f"/register_rank/{job}", json=_rank(0)).status_code == 200


def test_the_server_keeps_at_most_max_ranks(plan, tmp_path):
    """A job's ranks each cost a queue and a clock list: their number over all jobs is bounded too."""
    with _running(plan, tmp_path, max_ranks=4) as url, httpx.Client(base_url=url, timeout=30) as http:
        huge = http.post("/register_job", json=_job(world_size=1_000_000))
        assert huge.status_code == 400 and "keeps at most 4" in huge.json()["detail"]
        assert http.post("/register_job", json=_job(metadata="x" * 2000)).status_code == 400
        first, second = (http.post("/register_job", json=_job()).json() for _ in range(2))
        clocks = http.post(f"/register_rank/{second}", json={**_rank(0), "available_frequencies": [1] * 2000})
        assert clocks.status_code == 400 and "available_frequencies" in clocks.text
        third = http.post("/register_job", json=_job()).json()  # 2 + 2 + 2 ranks > 4: the first goes
        assert http.post(f"/register_rank/{first}", json=_rank(0)).status_code == 404
        for job in (second, third):
            assert http.post(f"/register_rank/{job}", json=_rank(0)).status_code == 200


# -- 3. an unreadable plan or frontier file is one line naming it ---------------------------------------

CORRUPT_FRONTIERS = [
    (BINARY, r"is not UTF-8 text \(byte 0x80 at offset 128\)"),
    (b"[" * 100_000, "is not readable JSON"),
    (json.dumps({**_frontier_data(), "num_stages": 2.5}).encode(), "num_stages is 2.5, not an integer >= 1"),
    (json.dumps({**_frontier_data(), "num_chunks": "1"}).encode(), "num_chunks is '1', not an integer >= 1"),
    (json.dumps(_frontier_data()).replace('"num_stages": 2', '"num_stages": Infinity').encode(),
     "num_stages is inf, not an integer >= 1"),
    (json.dumps({**_frontier_data(), "p2p_power": float("nan")}).encode(), "p2p_power is nan, not a number >= 0"),
    (json.dumps({**_frontier_data(), "schedule": None}).encode(), "schedule is None, not a name"),
    (json.dumps({k: v for k, v in _frontier_data().items() if k != "points"}).encode(), "lacks points"),
]


@pytest.mark.parametrize("content,why", CORRUPT_FRONTIERS, ids=[w.split(",")[0][:30] for _, w in CORRUPT_FRONTIERS])
def test_a_corrupt_frontier_is_one_line(tmp_path, content, why):
    path = tmp_path / "frontier.json"
    path.write_bytes(content)
    with pytest.raises(FrontierError) as error:
        read_frontier(str(path))
    message = str(error.value)
    assert message.startswith(f"frontier file {str(path)!r}") and "\n" not in message, message
    assert re.search(why, message), message


@pytest.mark.parametrize("content,why", [(BINARY, "is not UTF-8 text (byte 0x80 at offset 128)"),
                                         (b"[" * 100_000, "is not a Python literal list"),
                                         (b"[[('forward',\n 1410),\n", "is not a Python literal list")])
def test_a_corrupt_plan_is_one_line(tmp_path, content, why):
    path = tmp_path / "plan.py"
    path.write_bytes(content)
    with pytest.raises(PlanError) as error:
        read_plan(str(path))
    message = str(error.value)
    assert message.startswith(f"plan file {str(path)!r} ") and why in message and "\n" not in message, message


def test_the_trainer_reports_a_binary_frontier_or_plan_before_workers_start(tmp_path):
    (tmp_path / "frontier.json").write_bytes(BINARY)
    (tmp_path / "plan.py").write_bytes(BINARY)
    for field in ("frequency_frontier", "frequency_plan"):
        path = str(tmp_path / ("frontier.json" if field == "frequency_frontier" else "plan.py"))
        problems = energy_problems(EnergySettings(**{field: path}), "1f1b", 2, 4, 1)
        assert len(problems) == 1 and path in problems[0] and "is not UTF-8 text" in problems[0], problems
        assert "\n" not in problems[0]


def test_serve_reports_a_binary_frontier_in_one_line(tmp_path, caplog):
    path = tmp_path / "frontier.json"
    path.write_bytes(BINARY)
    with caplog.at_level(logging.ERROR, logger="merak.energy"):
        assert _main(["serve", str(path), "--dump-dir", str(tmp_path / "dump")]) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and str(path) in errors[0] and "is not UTF-8 text" in errors[0], errors


# -- 4. the pre-check asks the server something only zeus answers ----------------------------------------


class _NotZeus(http.server.BaseHTTPRequestHandler):
    """Answers ``/openapi.json`` with another API's description, everything else with an HTML 404."""

    def do_GET(self) -> None:  # http.server calls do_<METHOD>
        if self.path == "/api/openapi.json":
            body, status, kind = json.dumps({"openapi": "3.1.0", "paths": {"/items": {}}}).encode(), 200, "json"
        else:
            body, status, kind = b"<html><body><h1>Not Found</h1></body></html>", 404, "html"
        self.send_response(status)
        self.send_header("content-type", f"text/{kind}" if kind == "html" else "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:  # quiet: the test reads the answers, not the log
        pass


@pytest.fixture
def not_zeus():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotZeus)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


@pytest.mark.parametrize("suffix,answer", [("", "answered 404 Not Found (BaseHTTP/"),
                                           ("/api", "answered an API without /register_job, /register_rank/")])
def test_a_web_server_that_is_not_zeus_is_a_problem(not_zeus, suffix, answer):
    pytest.importorskip("zeus")
    url = not_zeus + suffix
    problems = energy_problems(EnergySettings(pfo_server_url=url), "1f1b", 2, 4, 1)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"trainer.pfo_server_url={url!r} is not a zeus pipeline-frequency server: "
                                  f"GET {url}/openapi.json ") and answer in problems[0], problems
    assert "\n" not in problems[0]


def test_the_zeus_server_passes_the_pre_check(plan, tmp_path):
    with _running(plan, tmp_path) as url:
        assert energy_problems(EnergySettings(pfo_server_url=url + "/"), "1f1b", 2, 4, 1) == []
