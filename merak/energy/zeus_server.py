"""A zeus pipeline-frequency server that serves a merak plan file.

zeus's server looks its scheduler up by name in its own scheduler module, so
:func:`serve` registers :class:`MerakPlan` (wrapped by zeus's ``make_3d_parallel``, which
copies each stage's plan to all its data- and tensor-parallel ranks) there, configures zeus's
settings through its ``ZEUS_PFO_*`` environment variables, and runs zeus's FastAPI app with
uvicorn. Unlike zeus's ``PointSolution``, the plan is parsed with ``ast.literal_eval``.
Profiling results that ranks report to ``/result`` are written by zeus to
``{dump_dir}/{job_id}/{n}.prof.json``. A frontier file (``frontier.json``) serves one of its points
to every pipeline: zeus's client fetches one schedule per job, so moving a running job along the
frontier (straggler-aware plans) happens in the workers, with ``trainer.frequency_frontier``.

Two limits keep the server's memory bounded whatever reaches its port (zeus itself keeps every
request and every job, for a week):

- a request body over ``max_request_bytes`` (default :data:`DEFAULT_MAX_REQUEST_BYTES`, 16 MiB) is
  refused with HTTP 413 and a JSON ``detail`` before the app reads it. The largest real request is
  a rank's profiling result: a step time and energy per compute instruction of each measured step,
  about 20 bytes each in JSON, so 4 steps of 1024 microbatches take under 1 MiB;
- at most ``max_jobs`` jobs (default :data:`DEFAULT_MAX_JOBS`) with at most ``max_ranks`` ranks
  among them (default :data:`DEFAULT_MAX_RANKS`; zeus keeps a queue and the clock list of each) are
  kept: registering one more drops the jobs idle longest (a failed one first) until it fits. Their
  ranks still waiting for a schedule get an error instead of waiting forever, and their later
  requests get HTTP 404. A job of more than ``max_ranks`` ranks, job metadata over
  :data:`MAX_METADATA_CHARS` characters or a rank with more than :data:`MAX_CLOCKS` clocks is
  refused with HTTP 400.

The server listens on a socket bound before it starts, so ``port`` 0 picks a free port and the log
names the real one.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import socket

from merak.energy.frontier import read_frontier
from merak.energy.plans import PlanError, read_plan, write_plan

logger = logging.getLogger(__name__)

SCHEDULER_NAME = "MerakPlan3D"
DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20
DEFAULT_MAX_JOBS = 64
DEFAULT_MAX_RANKS = 4096
MAX_METADATA_CHARS = 1024  # merak sends "merak"; zeus puts it in the job id and the dump directory's name
MAX_CLOCKS = 1024  # a GPU lists its graphics clocks: about 100 on an A100 or H100
LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")  # what both zeus and uvicorn accept


class ServeError(ValueError):
    """The server cannot start: its address or dump directory cannot be used."""


def _scheduler_class():
    from zeus.optimizer.pipeline_frequency.common import FrequencySchedule
    from zeus.optimizer.pipeline_frequency.server.scheduler import (
        FrequencyScheduler,
        make_3d_parallel,
    )

    class MerakPlan(FrequencyScheduler):
        """Serves the per-stage plans of a merak (or lowtime) plan file, every iteration the same."""

        def __init__(self, job_info, rank_infos, pfo_settings, plan_path: str) -> None:
            super().__init__(job_info, rank_infos, pfo_settings)
            plans = read_plan(plan_path)
            if len(plans) != job_info.pp_degree:
                raise PlanError(f"plan {plan_path!r} has {len(plans)} stage plans but the job has "
                                f"pp={job_info.pp_degree} stages")
            available = {info.pp_rank: set(info.available_frequencies) for info in rank_infos}
            for stage, plan in enumerate(plans):
                missing = sorted({mhz for _, mhz in plan} - available.get(stage, set()))
                if missing:
                    raise PlanError(f"plan {plan_path!r}: stage {stage} uses clocks {missing} MHz its GPUs do not "
                                    "support")
            self.schedules = [FrequencySchedule(rank=stage, frequencies=plan) for stage, plan in enumerate(plans)]

        def _run(self):
            while True:
                results = yield self.schedules
                for result in results or []:
                    logger.info("stage %d measured: iteration time %s s, energy %s J", result.rank,
                                [round(t, 4) for t in result.iter_time], [round(e, 2) for e in result.iter_energy])

    return make_3d_parallel(MerakPlan, name=SCHEDULER_NAME)


def _job_manager_class():
    from fastapi import HTTPException
    from zeus.optimizer.pipeline_frequency.server.job_manager import JobManager

    class BoundedJobManager(JobManager):
        """zeus's job manager, keeping at most ``max_jobs`` jobs of ``max_ranks`` ranks in all, and
        answering 404 for jobs it does not keep."""

        def __init__(self, pfo_settings, max_jobs: int, max_ranks: int) -> None:
            super().__init__(pfo_settings)
            self.max_jobs, self.max_ranks = max_jobs, max_ranks
            # Ids of the last dropped jobs, not to be given again while their ranks may still ask.
            self._dropped: collections.deque[str] = collections.deque(maxlen=max_jobs)

        def register_job(self, job_info) -> None:
            if job_info.world_size > self.max_ranks:
                raise HTTPException(status_code=400, detail=f"a job of {job_info.world_size} ranks: this server "
                                                            f"keeps at most {self.max_ranks} (--max-ranks)")
            if len(job_info.job_metadata or "") > MAX_METADATA_CHARS:
                raise HTTPException(status_code=400, detail=f"job_metadata over {MAX_METADATA_CHARS} characters")
            # zeus's job id is the registration's second and layout: two runs starting together would
            # share it, the second overwriting the first's state and orphaning its task for good.
            # The router returns job_info.job_id after this call, so the second gets its own id.
            base, copy = job_info.job_id, 1
            while job_info.job_id in self._job_infos or job_info.job_id in self._dropped:
                copy += 1
                job_info.job_id = f"{base}+{copy}"
            while self._job_infos and (len(self._job_infos) >= self.max_jobs or job_info.world_size + sum(
                    info.world_size for info in self._job_infos.values()) > self.max_ranks):
                self.drop_job(min(self._job_infos, key=self._eviction_order),
                              f"the server keeps at most {self.max_jobs} jobs of {self.max_ranks} ranks in all, "
                              "and a newer job registered")
            super().register_job(job_info)

        def _eviction_order(self, job_id: str) -> tuple[bool, float]:
            # A job whose task ended (its scheduler failed) goes first, then the one idle longest.
            return not self._job_tasks[job_id].done(), self._job_last_active_time[job_id]

        def drop_job(self, job_id: str, reason: str) -> None:
            """Forget ``job_id``; its ranks waiting for a schedule get ``reason`` as an error."""
            logger.info("dropping zeus job %s: %s", job_id, reason)
            self._dropped.append(job_id)
            self._job_tasks.pop(job_id).cancel()
            for channel in self._job_sched_response_channels.pop(job_id):
                # merak's client waits for its schedule without a time limit (the schedule comes once
                # every rank registered): without this error it would wait forever.
                with contextlib.suppress(asyncio.QueueFull):
                    channel.put_nowait(RuntimeError(f"zeus job {job_id} was dropped: {reason}"))
            for table in (self._job_infos, self._job_rank_infos, self._job_result_channels,
                          self._job_sched_request_channels, self._job_last_active_time):
                table.pop(job_id, None)

        def _known(self, job_id: str):
            if job_id not in self._job_infos:
                raise HTTPException(status_code=404, detail=f"no job {job_id!r} on this server (it keeps the "
                                                            f"{self.max_jobs} most recently active jobs, "
                                                            f"{self.max_ranks} ranks in all)")
            return self._job_infos[job_id]

        def register_rank(self, job_id: str, rank_info) -> None:
            job_info = self._known(job_id)
            if len(rank_info.available_frequencies) > MAX_CLOCKS:
                raise HTTPException(status_code=400, detail=f"more than {MAX_CLOCKS} available_frequencies")
            if len(self._job_rank_infos[job_id]) >= job_info.world_size:
                raise HTTPException(status_code=400, detail=f"job {job_id!r} already has all its "
                                                            f"{job_info.world_size} ranks")
            super().register_rank(job_id, rank_info)

        async def get_frequency_schedule(self, job_id: str, rank: int):
            self._known(job_id)
            schedule = await super().get_frequency_schedule(job_id, rank)
            if job_id not in self._job_infos:  # dropped while this rank waited: zeus marked it active again
                self._job_last_active_time.pop(job_id, None)
            return schedule

        def report_profiling_result(self, job_id: str, result) -> None:
            self._known(job_id)
            super().report_profiling_result(job_id, result)

    return BoundedJobManager


class BodyLimit:
    """ASGI middleware: answer a request whose body exceeds ``limit`` bytes with HTTP 413, unread.

    A body with a larger ``Content-Length`` is refused before any of it is read; one without
    (chunked) is read up to the limit. The app gets the body in one message, as FastAPI reads it
    anyway, so no request ever holds more than ``limit`` bytes.

    Args:
        app: the ASGI app to protect.
        limit: the largest body accepted, in bytes.
    """

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":  # lifespan: zeus's startup hook
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._refuse(send)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.limit:
                await self._refuse(send)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # the disconnect, when the app waits for one
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, send) -> None:
        detail = (f"request body over this server's limit of {self.limit} bytes "
                  "(merak-energy serve --max-request-bytes)")
        payload = json.dumps({"detail": detail}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode()), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload})


def frontier_plan(frontier_path: str, dump_dir: str, deadline: float | None = None) -> str:
    """Write the plan of a frontier's point (the fastest, or the least energy within ``deadline``) as
    a plan file in ``dump_dir``; returns its path.

    Raises:
        FrontierError: the frontier file cannot be read.
        ServeError: ``dump_dir`` cannot be created.
    """
    frontier = read_frontier(frontier_path)
    index = 0 if deadline is None else frontier.index_within(deadline)
    path = os.path.join(dump_dir, "served_plan.py")
    _make_dump_dir(dump_dir)
    write_plan(path, frontier.points[index].plans)
    logger.info("serving point %d of %s (%.4f s, %.1f J predicted per step)", index, frontier_path,
                frontier.points[index].iteration_time, frontier.points[index].energy)
    return path


def _make_dump_dir(dump_dir: str) -> None:
    try:
        os.makedirs(dump_dir, exist_ok=True)
    except OSError as error:
        raise ServeError(f"dump directory {dump_dir!r} cannot be created: {error.strerror or error}") from None


def build_app(plan_path: str, *, dump_dir: str = "./zeus-dump", log_level: str = "INFO",
              deadline: float | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              max_jobs: int = DEFAULT_MAX_JOBS, max_ranks: int = DEFAULT_MAX_RANKS):
    """zeus's FastAPI app with :class:`MerakPlan` serving ``plan_path``: a plan file, or a frontier
    file (``frontier.json``) whose fastest point, or least-energy point within ``deadline``, it serves;
    behind :class:`BodyLimit` (``max_request_bytes``) and keeping at most ``max_jobs`` jobs of
    ``max_ranks`` ranks in all.

    Raises:
        PlanError: the plan file cannot be read.
        FrontierError: the frontier file cannot be read.
        ServeError: ``dump_dir`` cannot be created.
        ImportError: zeus is not installed (``pip install 'merak[energy]'``).
    """
    if plan_path.endswith(".json"):
        plan_path = frontier_plan(plan_path, dump_dir, deadline)
    read_plan(plan_path)  # fail here, not when the first job registers
    _make_dump_dir(dump_dir)  # here too: zeus writes the ranks' results there
    from zeus.optimizer.pipeline_frequency.common import PFOServerSettings
    from zeus.optimizer.pipeline_frequency.server import scheduler as zeus_scheduler
    from zeus.optimizer.pipeline_frequency.server.job_manager import get_global_job_manager

    setattr(zeus_scheduler, SCHEDULER_NAME, _scheduler_class())
    os.environ.update({"ZEUS_PFO_SCHEDULER": SCHEDULER_NAME,
                       "ZEUS_PFO_SCHEDULER_ARGS": json.dumps({"plan_path": os.path.abspath(plan_path)}),
                       "ZEUS_PFO_DUMP_DIR": dump_dir, "ZEUS_PFO_LOG_LEVEL": log_level})
    # Only now: the router reads zeus's settings from the environment when it is first imported.
    from zeus.optimizer.pipeline_frequency.server import router

    # It reads them only then: read them again, so that
    # another app built in this process serves its own plan.
    settings = router.settings = PFOServerSettings()
    manager_class, managers = _job_manager_class(), []

    async def job_manager():
        # Created on the first request, in the server's event loop, where zeus's manager starts its
        # cleanup task. It replaces zeus's own (unbounded) manager in every endpoint.
        if not managers:
            managers.append(manager_class(settings, max_jobs, max_ranks))
        return managers[0]

    router.app.dependency_overrides[get_global_job_manager] = job_manager
    return BodyLimit(router.app, max_request_bytes)


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` (``port`` 0: a free port the system picks).

    Raises:
        ServeError: the address cannot be used (in use, not this machine's, or not resolvable).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn decides
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen()
    except OSError as error:
        sock.close()
        raise ServeError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    return sock


def socket_url(sock: socket.socket) -> str:
    """``http://HOST:PORT`` of a listening socket, with the port it really got."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if sock.family == socket.AF_INET6 else f"http://{host}:{port}"


def prepare_server(plan_path: str, *, host: str = "127.0.0.1", port: int = 7787, dump_dir: str = "./zeus-dump",
                   log_level: str = "INFO", deadline: float | None = None,
                   max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, max_jobs: int = DEFAULT_MAX_JOBS,
                   max_ranks: int = DEFAULT_MAX_RANKS):
    """The uvicorn server of :func:`build_app`'s app and the socket it serves on, already listening
    (so that the logged address has the real port); ``server.run(sockets=[sock])`` serves.

    Raises:
        PlanError, FrontierError, ServeError, ImportError: as :func:`build_app` and :func:`listen`.
    """
    import uvicorn

    app = build_app(plan_path, dump_dir=dump_dir, log_level=log_level, deadline=deadline,
                    max_request_bytes=max_request_bytes, max_jobs=max_jobs, max_ranks=max_ranks)
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level.lower()))
    sock = listen(host, port)
    logger.info("serving %s at %s (results in %s; request bodies up to %d bytes, at most %d jobs of %d ranks "
                "kept)", plan_path, socket_url(sock), dump_dir, max_request_bytes, max_jobs, max_ranks)
    return server, sock


def serve(plan_path: str, *, host: str = "127.0.0.1", port: int = 7787, dump_dir: str = "./zeus-dump",
          log_level: str = "INFO", deadline: float | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
          max_jobs: int = DEFAULT_MAX_JOBS, max_ranks: int = DEFAULT_MAX_RANKS) -> None:
    """Run the server until interrupted (see :func:`prepare_server`)."""
    server, sock = prepare_server(plan_path, host=host, port=port, dump_dir=dump_dir, log_level=log_level,
                                  deadline=deadline, max_request_bytes=max_request_bytes, max_jobs=max_jobs,
                                  max_ranks=max_ranks)
    with sock:
        server.run(sockets=[sock])
