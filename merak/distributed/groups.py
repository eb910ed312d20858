"""Process groups for the rank grid, and the getters the rest of merak uses.

``init`` is the public entry point (``merak.init(dp, tp, pp)``). It joins a
process group that already exists (torchrun, SLURM, or one merak's launcher
started) or creates one from the environment, then builds one group per axis.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import re
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from merak.core import group_registry
from merak.core.group_registry import OVERLAP_GROUP, TP_GROUP
from merak.distributed.topology import Coordinates, RankGrid

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0


@dataclass
class ParallelState:
    """Everything a worker knows about its place in the grid."""

    grid: RankGrid
    rank: int
    coordinates: Coordinates
    backend: str
    device: torch.device
    pp_group: object = None
    dp_group: object = None
    tp_group: object = None
    model_parallel_group: object = None
    stage_set_groups: dict = field(default_factory=dict)  # see stage_set_group

    @property
    def is_first_stage(self) -> bool:
        return self.coordinates.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coordinates.pp == self.grid.pp - 1


_STATE: ParallelState | None = None


def resolve_backend(backend: str | None = None) -> str:
    """'gloo' on CPU, 'nccl' with CUDA; ``backend`` or $MERAK_BACKEND override it."""
    choice = backend or os.environ.get("MERAK_BACKEND") or "auto"
    if choice == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if choice not in ("gloo", "nccl", "mpi", "xccl"):
        raise ValueError(f"unknown backend {choice!r}; use 'auto', 'gloo' or 'nccl'")
    return choice


def first_slurm_host(nodelist: str) -> str:
    """The first hostname of a SLURM node list, as ``scontrol show hostnames`` lists it first:
    ``node[01-02,05],gpu7`` -> ``node01``, ``rack[1-2]-n[3-4]`` -> ``rack1-n3``."""
    first = re.match(r"[^,\[]*(?:\[[^\]]*\][^,\[]*)*", nodelist.strip()).group(0)
    return re.sub(r"\[([^\]\-,]*)[^\]]*\]", r"\1", first)


def slurm_master_port(job_id: str | None) -> str:
    """A port every task of a SLURM job derives alike (20000-59999 from the job id), so that two
    jobs sharing a node do not collide; 29500 without a job id."""
    return str(20000 + int(job_id) % 40000) if job_id and job_id.isdigit() else "29500"


def _adopt_slurm_environment() -> None:
    """Translate SLURM's task variables (one task per rank, started by srun) into the ones
    torch.distributed reads. MASTER_ADDR, unless exported, is the first node of the step (srun
    puts task 0 there); MASTER_PORT, unless exported, comes from the job id."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ or "SLURM_STEP_ID" not in os.environ:
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ.setdefault("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
    if "MASTER_ADDR" not in os.environ:
        nodes = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST")
        if not nodes:
            raise RuntimeError(
                "running under SLURM but neither MASTER_ADDR nor SLURM_STEP_NODELIST/SLURM_JOB_NODELIST "
                "is set: export MASTER_ADDR to the first node's hostname (e.g. "
                "$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1)) and MASTER_PORT to a free port")
        os.environ["MASTER_ADDR"] = first_slurm_host(nodes)
    os.environ.setdefault("MASTER_PORT", slurm_master_port(os.environ.get("SLURM_JOB_ID")))


def _start_process_group(grid: RankGrid, backend: str, timeout_s: float) -> None:
    _adopt_slurm_environment()
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeError(
            f"merak.init(dp={grid.dp}, tp={grid.tp}, pp={grid.pp}) needs {grid.world_size} processes "
            "but none were launched: start the script with "
            f"`torchrun --nproc_per_node {grid.world_size} ...`, under srun, or train through merak.run"
        )
    world_size = int(os.environ["WORLD_SIZE"])
    if world_size != grid.world_size:
        raise RuntimeError(
            f"dp*tp*pp = {grid.dp}*{grid.tp}*{grid.pp} = {grid.world_size} but {world_size} processes "
            "were launched; change the parallel degrees or the number of processes"
        )
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # Small bookkeeping collectives (the step's loss, gradient-norm scalars, gathered reports) run on
        # CPU tensors; gloo carries those, NCCL everything on the GPU.
        backend = NCCL_WITH_CPU
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))


NCCL_WITH_CPU = "cpu:gloo,cuda:nccl"


def _new_groups(rank_lists: list[list[int]], rank: int):
    """Create a group for each list (every rank calls this in the same order); return ours."""
    mine = None
    for ranks in rank_lists:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


def init(dp: int = 1, tp: int = 1, pp: int = 1, *, backend: str | None = None,
         timeout_s: float = DEFAULT_TIMEOUT_S) -> ParallelState:
    """Initialize data, tensor and pipeline parallel groups.

    Args:
        dp: data-parallel degree.
        tp: tensor-parallel degree.
        pp: pipeline-parallel degree.
        backend: 'auto' (default: nccl with CUDA, else gloo), 'gloo' or 'nccl'.
        timeout_s: timeout of every collective, so a lost peer fails instead of hanging.

    Returns:
        The :class:`ParallelState` of this process (also kept for the getters).
    """
    global _STATE
    grid = RankGrid(dp=dp, tp=tp, pp=pp)
    chosen = resolve_backend(backend)
    if not dist.is_initialized() and grid.world_size > 1:
        _start_process_group(grid, chosen, timeout_s)
        atexit.register(_shutdown_at_exit)
    if dist.is_initialized():
        chosen = dist.get_backend()
        if dist.get_world_size() != grid.world_size:
            raise RuntimeError(
                f"dp*tp*pp = {grid.world_size} but the process group has {dist.get_world_size()} ranks"
            )
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = (torch.device("cuda", torch.cuda.current_device()) if "nccl" in chosen
              else torch.device("cpu"))
    state = ParallelState(grid=grid, rank=rank, coordinates=grid.coordinates(rank),
                          backend=chosen, device=device)
    if dist.is_initialized():
        state.pp_group = _new_groups(grid.axis_groups("pp"), rank)
        state.dp_group = _new_groups(grid.axis_groups("dp"), rank)
        state.tp_group = _new_groups(grid.axis_groups("tp"), rank)
        state.model_parallel_group = _new_groups(grid.model_parallel_groups(), rank)
    group_registry.register_group(TP_GROUP, state.tp_group, rank=state.coordinates.tp, size=grid.tp)
    if dist.is_initialized() and grid.tp > 1:  # a second copy for tp_overlapping_level=2
        group_registry.register_group(OVERLAP_GROUP, _new_groups(grid.axis_groups("tp"), rank),
                            rank=state.coordinates.tp, size=grid.tp)
    _STATE = state
    logger.debug("rank %d at %s (backend %s)", rank, state.coordinates, chosen)
    return state


def stage_set_group(state: ParallelState, stages: tuple[int, ...]):
    """The group of this rank's (dp, tp) slice on pipeline stages ``stages`` (e.g. to sum tied gradients).

    Collective: every rank must call it for the same stage sets in the same
    order, including ranks outside ``stages`` (they get None). Groups are cached.
    """
    if stages not in state.stage_set_groups:
        if len(set(stages)) < 2 or not dist.is_initialized():
            raise ValueError(f"a stage-set group needs two or more stages in a process group, got {stages}")
        rank_lists = [[group[s] for s in stages] for group in state.grid.axis_groups("pp")]
        state.stage_set_groups[stages] = _new_groups(rank_lists, state.rank)
    return state.stage_set_groups[stages]


def get_state() -> ParallelState:
    """The state built by :func:`init`; raises if merak was not initialized."""
    if _STATE is None:
        raise RuntimeError("merak is not initialized: call merak.init(dp, tp, pp) first")
    return _STATE


def is_initialized() -> bool:
    return _STATE is not None


def shutdown(*, synchronize: bool = False) -> None:
    """Forget the parallel state and destroy the default process group.

    Args:
        synchronize: Wait at a barrier first, so no rank tears its connections down while a peer
            still talks to it (a gloo rank whose peer had already destroyed its group was seen to
            abort). Only for ranks that all finished: after a failure the peers never arrive, and
            the barrier would wait for the whole collective timeout.
    """
    global _STATE
    _STATE = None
    group_registry.unregister_groups()
    if not dist.is_initialized():
        return
    if synchronize and dist.get_world_size() > 1:
        dist.barrier()
    dist.destroy_process_group()


def forget_inherited_state() -> None:
    """In a forked worker: drop the parallel state the parent process held (a single-process run, a
    trainer in a notebook), so the worker joins its own world instead of reusing the parent's."""
    global _STATE
    _STATE = None
    group_registry.unregister_groups()


def _shutdown_at_exit() -> None:
    """A script that started the group with :func:`init` and ends without :func:`shutdown` (the seed API's
    usage) tears it down together with its peers: ranks that destroyed their group at different moments
    of interpreter exit were seen to abort. After an unhandled error the peers may never arrive, so the
    group is then destroyed without waiting."""
    if dist.is_initialized():
        shutdown(synchronize=not hasattr(sys, "last_value"))


def get_rank_grid() -> RankGrid:
    return get_state().grid


def get_dp_rank() -> int:
    return get_state().coordinates.dp


def get_tp_rank() -> int:
    return get_state().coordinates.tp


def get_pp_rank() -> int:
    return get_state().coordinates.pp


def get_dp_size() -> int:
    return get_state().grid.dp


def get_tp_size() -> int:
    return get_state().grid.tp


def get_pp_size() -> int:
    return get_state().grid.pp


def get_dp_group():
    return get_state().dp_group


def get_tp_group():
    return get_state().tp_group


def get_pp_group():
    return get_state().pp_group


def gather_from_all(value) -> list:
    """Every rank's ``value`` (any picklable object), in rank order; ``[value]`` without a process group."""
    if not dist.is_initialized():
        return [value]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


def gather_to_first(value) -> list | None:
    """Every rank's ``value`` (any picklable object) on rank 0, in rank order; None on the other ranks;
    ``[value]`` without a process group."""
    if not dist.is_initialized():
        return [value]
    everyone = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(value, everyone, dst=0)
    return everyone


def sum_over_all(values: list[float]) -> list[float]:
    """The element-wise sum of every rank's ``values`` (floats, the same count on every rank), on every
    rank; ``values`` without a process group. One small all-reduce (collective: every rank calls it)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [float(v) for v in values]
    # A group started outside merak may be NCCL alone, which carries only device tensors; with merak's
    # own "cpu:gloo,cuda:nccl" a device tensor goes through NCCL just as well.
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in dist.get_backend() \
        else torch.device("cpu")
    total = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return total.tolist()


def barrier() -> None:
    """Wait for every rank (nothing without a process group)."""
    if dist.is_initialized():
        dist.barrier()


def broadcast_object(value, src: int = 0):
    """Rank ``src``'s ``value`` (any picklable object) on every rank; ``value`` without a process group."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=src)
    return box[0]
