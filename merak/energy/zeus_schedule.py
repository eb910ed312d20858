"""Joining a zeus pipeline-frequency job for a GPU that zeus cannot drive itself.

zeus's ``PipelineFrequencyOptimizer`` finds its GPU on its own (NVML or ROCm), selects it with
``torch.cuda.set_device`` and synchronizes through ``torch.cuda``; it takes no GPU object. For
any other :class:`~merak.energy.device.GPUDevice` (the simulated GPU) merak speaks the server's
protocol itself, with zeus's published request and response models and URLs
(``zeus.optimizer.pipeline_frequency.common``): rank 0 registers the job, every rank registers
with its GPU's clocks, then fetches its schedule. A :class:`~merak.energy.hooks.FrequencyPlanHook`
runs that schedule on the device.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from merak.distributed import groups

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ZeusJob:
    """This rank's part of a zeus job.

    Attributes:
        job_id: the job's id on the server (the same on every rank).
        schedule: ``[(instruction, MHz), ...]`` for one step of this rank, in execution order.
    """

    job_id: str
    schedule: list[tuple[str, int]]


def _checked(response: httpx.Response, action: str) -> httpx.Response:
    if response.status_code != 200:
        raise RuntimeError(f"the zeus server refused to {action} ({response.status_code}): {response.text}")
    return response


def _register_job(http: httpx.Client, server_url: str, state, job_metadata: str | None) -> str:
    from zeus.optimizer.pipeline_frequency.common import REGISTER_JOB_URL, JobInfo

    grid = state.grid
    info = JobInfo(pp_degree=grid.pp, dp_degree=grid.dp, tp_degree=grid.tp, world_size=grid.world_size,
                   job_metadata=job_metadata)
    job_id = _checked(http.post(server_url + REGISTER_JOB_URL, json=info.dict()), "register the job").json()
    if isinstance(job_id, str) and job_id:
        return job_id
    raise RuntimeError(f"the zeus server answered the job registration with {job_id!r}, not a job id")


def _shared_job_id(http: httpx.Client, server_url: str, state, job_metadata: str | None) -> str:
    """Rank 0 registers the job; every rank gets its id, or rank 0's error (instead of waiting forever)."""
    job_id, error = None, None
    if state.rank == 0:
        try:
            job_id = _register_job(http, server_url, state, job_metadata)
        except (httpx.HTTPError, RuntimeError) as exc:
            error = f"{type(exc).__name__}: {exc}"
    job_id, error = groups.broadcast_object((job_id, error))
    if error is not None:
        raise RuntimeError(f"rank 0 could not register the job with the zeus server at {server_url}: {error}")
    return job_id


def join_zeus_job(server_url: str, state, clocks: Sequence[int], *, job_metadata: str | None = "merak",
                  http: httpx.Client | None = None) -> ZeusJob:
    """Register this rank (and, on rank 0, the job) with a zeus server and fetch this rank's schedule.

    Collective: every rank of the job calls it.

    Args:
        server_url: the server's base URL (no trailing slash).
        state: the worker's parallel state (rank, grid, coordinates).
        clocks: the graphics clocks this rank's GPU supports.
        job_metadata: appended to the job id by the server.
        http: the HTTP client to use (default: a new one, closed before returning).

    Raises:
        RuntimeError: the server refused a request or answered for another rank.
    """
    from zeus.optimizer.pipeline_frequency.common import (
        GET_FREQUENCY_SCHEDULE_URL,
        REGISTER_RANK_URL,
        FrequencySchedule,
        RankInfo,
    )

    client = http if http is not None else httpx.Client(timeout=REQUEST_TIMEOUT_S)
    try:
        job_id = _shared_job_id(client, server_url, state, job_metadata)
        coords = state.coordinates
        rank_info = RankInfo(rank=state.rank, dp_rank=coords.dp, pp_rank=coords.pp, tp_rank=coords.tp,
                             available_frequencies=sorted(clocks, reverse=True))
        _checked(client.post(server_url + REGISTER_RANK_URL.format(job_id=job_id), json=rank_info.dict()),
                 f"register rank {state.rank}")
        # The server answers once every rank of the job has registered: no time limit here.
        response = _checked(client.get(server_url + GET_FREQUENCY_SCHEDULE_URL.format(job_id=job_id),
                                       params={"rank": state.rank}, timeout=None),
                            f"give rank {state.rank} its schedule")
    finally:
        if http is None:
            client.close()
    schedule = FrequencySchedule.parse_raw(response.text)
    if schedule.rank != state.rank:
        raise RuntimeError(f"the zeus server sent rank {state.rank} the schedule of rank {schedule.rank}")
    return ZeusJob(job_id=job_id, schedule=[(name, int(mhz)) for name, mhz in schedule.frequencies])


__all__ = ["ZeusJob", "join_zeus_job"]
