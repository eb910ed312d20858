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
"""

from __future__ import annotations

import json
import logging
import os

from merak.energy.frontier import read_frontier
from merak.energy.plans import PlanError, read_plan, write_plan

logger = logging.getLogger(__name__)

SCHEDULER_NAME = "MerakPlan3D"


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


def frontier_plan(frontier_path: str, dump_dir: str, deadline: float | None = None) -> str:
    """Write the plan of a frontier's point (the fastest, or the least energy within ``deadline``) as
    a plan file in ``dump_dir``; returns its path.

    Raises:
        FrontierError: the frontier file cannot be read.
    """
    frontier = read_frontier(frontier_path)
    index = 0 if deadline is None else frontier.index_within(deadline)
    path = os.path.join(dump_dir, "served_plan.py")
    os.makedirs(dump_dir, exist_ok=True)
    write_plan(path, frontier.points[index].plans)
    logger.info("serving point %d of %s (%.4f s, %.1f J predicted per step)", index, frontier_path,
                frontier.points[index].iteration_time, frontier.points[index].energy)
    return path


def build_app(plan_path: str, *, dump_dir: str = "./zeus-dump", log_level: str = "INFO",
              deadline: float | None = None):
    """zeus's FastAPI app with :class:`MerakPlan` serving ``plan_path``: a plan file, or a frontier
    file (``frontier.json``) whose fastest point, or least-energy point within ``deadline``, it serves.

    Raises:
        PlanError: the plan file cannot be read.
        FrontierError: the frontier file cannot be read.
        ImportError: zeus is not installed (``pip install 'merak[energy]'``).
    """
    if plan_path.endswith(".json"):
        plan_path = frontier_plan(plan_path, dump_dir, deadline)
    read_plan(plan_path)  # fail here, not when the first job registers
    from zeus.optimizer.pipeline_frequency.server import scheduler as zeus_scheduler

    setattr(zeus_scheduler, SCHEDULER_NAME, _scheduler_class())
    os.environ.update({"ZEUS_PFO_SCHEDULER": SCHEDULER_NAME,
                       "ZEUS_PFO_SCHEDULER_ARGS": json.dumps({"plan_path": os.path.abspath(plan_path)}),
                       "ZEUS_PFO_DUMP_DIR": dump_dir, "ZEUS_PFO_LOG_LEVEL": log_level})
    from zeus.optimizer.pipeline_frequency.server.router import app

    return app


def serve(plan_path: str, *, host: str = "127.0.0.1", port: int = 7787, dump_dir: str = "./zeus-dump",
          log_level: str = "INFO", deadline: float | None = None) -> None:
    """Run the server until interrupted."""
    import uvicorn

    app = build_app(plan_path, dump_dir=dump_dir, log_level=log_level, deadline=deadline)
    logger.info("serving %s at http://%s:%d (results in %s)", plan_path, host, port, dump_dir)
    uvicorn.run(app, host=host, port=port, log_level=log_level.lower())
