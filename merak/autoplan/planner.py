"""Planning a recipe's layout: profile its model, price every layout, rank them (:func:`plan_for_settings`,
what ``parallel=auto`` and ``merak-plan`` run; :func:`plan_recipe` composes the recipe's config first)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from merak.autoplan.attention import KERNELS
from merak.autoplan.cluster import Cluster, load_cluster, with_simulated_gpus
from merak.autoplan.cost import BACKWARD_FLOPS_FACTOR, CostModel, LayoutError
from merak.autoplan.energy import Objective, rank_for_energy
from merak.autoplan.layout import RECOMPUTE_SELECTIVE, Layout
from merak.autoplan.profile import GraphProfile, profile_recipe
from merak.autoplan.search import MEMORY_HEADROOM, Candidate, SearchSpace, explain, search
from merak.core.files import write_json_atomic
from merak.pipeline.simulate import ScheduleError
from merak.report.console import only_errors

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]


class PlanError(ValueError):
    """No layout can run the request; the message names what would work."""


@dataclass
class PlanReport:
    """The ranked candidates of one request, best first."""

    recipe: str
    model: str
    cluster: Cluster
    world_size: int
    global_batch_size: int
    candidates: list[Candidate]
    profile_seconds: float
    search_seconds: float
    flops_per_sample: float = 0.0  # forward + backward matrix FLOPs of one sample (recomputation not counted)
    peak_flops: float | None = None  # per device, of the run's dtype
    cost_model: CostModel | None = None
    capacity_bytes: float = 0.0
    objective: Objective = dataclasses.field(default_factory=Objective)  # what the ranking minimizes

    def price(self, layout: Layout) -> Candidate:
        """Any layout of this request priced by the same cost model (e.g. a published one, to compare)."""
        try:
            prediction = self.cost_model.predict(layout, simulate_schedule=True)
        except (LayoutError, ScheduleError, ValueError) as error:
            raise PlanError(f"{layout.key()} cannot run: {error}") from None
        usable = self.capacity_bytes * MEMORY_HEADROOM
        candidate = Candidate(layout, prediction, prediction.max_memory <= usable)
        candidate.why_not = explain(candidate, self.best) if candidate.fits else (
            f"does not fit: {prediction.max_memory / 2**30:.3g} GiB, {usable / 2**30:.3g} GiB usable")
        return candidate

    def mfu(self, candidate: Candidate, step_s: float | None = None) -> float | None:
        """Model FLOPs utilization the prediction means: model FLOPs per step over peak FLOPs of the step
        (of ``step_s`` when given: the step with a clock plan)."""
        if not self.peak_flops or not self.flops_per_sample:
            return None
        achieved = self.flops_per_sample * self.global_batch_size / (step_s or candidate.predicted_step_s)
        return achieved / (self.peak_flops * self.world_size)

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    def best_per_grid(self) -> dict[tuple[int, int, int], Candidate]:
        """The best fitting candidate of every (dp, tp, pp) (simulated unless far behind the best)."""
        found: dict[tuple[int, int, int], Candidate] = {}
        for candidate in self.candidates:
            if candidate.fits:
                found.setdefault(candidate.layout.grid, candidate)
        return found

    def to_json(self, top: int | None = None) -> dict:
        shown = self.candidates if top is None else self.candidates[:top]
        return {"recipe": self.recipe, "model": self.model, "cluster": self.cluster.to_json(),
                "world_size": self.world_size, "global_batch_size": self.global_batch_size,
                "objective": str(self.objective),
                "flops_per_sample": self.flops_per_sample, "peak_flops_per_device": self.peak_flops,
                "best": {**self.best.to_json(), "mfu": self.mfu(self.best)},
                "candidates": [{**c.to_json(), "mfu": self.mfu(c)} for c in shown],
                "num_candidates": len(self.candidates), "profile_seconds": round(self.profile_seconds, 3),
                "search_seconds": round(self.search_seconds, 3)}


def _dtype_name(trainer) -> str:
    precision = trainer.precision
    return "bfloat16" if precision.bf16 else "float16" if precision.fp16 else "float32"


PROFILE_FORMAT = 7  # bump when GraphProfile or what it measures changes: cached profiles are then taken again


@functools.cache
def _selective_policy_digest() -> str:
    """A digest of the selective recomputation policy's source: the profiles measure what it keeps, so a
    change to it takes them again."""
    import inspect

    from merak.pipeline import selective

    return hashlib.sha256(inspect.getsource(selective).encode()).hexdigest()[:12]


def cache_directory() -> Path:
    """Where profiles are kept between runs (``$MERAK_CACHE_DIR/profiles``, default ~/.cache/merak)."""
    return Path(os.path.expanduser(os.environ.get("MERAK_CACHE_DIR", "~/.cache/merak"))) / "profiles"


class ProfileCache:
    """Profiles of one model per (tp, sequence_parallel), taken once and kept on disk keyed by what shapes them;
    attention saves what ``device_type``'s kernel saves, or what the ``attention`` kernel named saves
    (:data:`merak.autoplan.attention.KERNELS`)."""

    def __init__(self, spec, settings, directory: Path | None = None, device_type: str = "cpu",
                 attention: str = "auto") -> None:
        self.spec, self.settings, self.device_type, self.attention = spec, settings, device_type, attention
        self.directory = cache_directory() if directory is None else directory
        self.seconds = 0.0

    def _path(self, tp: int, sequence_parallel: bool) -> Path:
        trainer = self.settings.trainer
        identity = json.dumps({"format": PROFILE_FORMAT, "recipe": self.spec.name,
                               "model": OmegaConf.to_container(self.settings.model_cfg, resolve=True)
                               if isinstance(self.settings.model_cfg, DictConfig) else self.settings.model_cfg,
                               "tp": tp, "sp": sequence_parallel, "trace": trainer.sharding.trace_method,
                               "dtype": _dtype_name(trainer), "vocab": trainer.tensor_parallel.parallel_vocab,
                               "leaf": trainer.sharding.leaf_modules, "inputs": trainer.batch.input_names,
                               "device": self.device_type, "attention": self.attention,
                               "selective": _selective_policy_digest(),
                               "torch": torch.__version__}, sort_keys=True,
                              default=str)
        return self.directory / f"{self.spec.name}-{hashlib.sha256(identity.encode()).hexdigest()[:20]}.json"

    @functools.cache  # noqa: B019 (one cache per planning request, freed with it)
    def __call__(self, tp: int, sequence_parallel: bool) -> GraphProfile:
        path = self._path(tp, sequence_parallel)
        if path.is_file():
            try:
                return GraphProfile.from_json(json.loads(path.read_text(encoding="utf-8")))
            except (ValueError, TypeError, OSError) as error:
                logger.warning("ignoring the cached profile %s: %s", path, error)
        started = time.perf_counter()
        # Each profile builds and captures the model twice: their lines would repeat per tp degree.
        with only_errors("merak.session", "merak.trace", "merak.tensor_parallel"):
            profile = profile_recipe(self.spec, self.settings, tp=tp, sequence_parallel=sequence_parallel,
                                     device_type=self.device_type, attention=self.attention)
        self.seconds += time.perf_counter() - started
        logger.debug("profiled %s at tp=%d%s: %d units (%.1f s)", self.spec.name, tp,
                    ", sequence parallel" if sequence_parallel else "", len(profile), time.perf_counter() - started)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(str(path), profile.to_json())
        except OSError as error:  # a read-only home: planning still works, only slower next time
            logger.warning("could not keep the profile in %s: %s", path, error)
        return profile


def _supports_sequence_parallel(profiles: ProfileCache, tp: int) -> bool:
    try:
        profiles(tp, True)
    except (ValueError, RuntimeError, TypeError) as error:  # a plan without sequence-parallel regions
        logger.info("no sequence parallelism for this model: %s", error)
        return False
    return True


def plan_for_settings(spec, settings, *, world_size: int, cluster: Cluster, global_batch_size: int,
                      space_overrides: dict | None = None, objective: str | Objective = "time",
                      attention: str = "auto") -> PlanReport:
    """Rank every layout of ``world_size`` devices of ``cluster`` for the recipe's model, from ``settings``
    (a single-process run's) at the fixed ``global_batch_size``; ``space_overrides`` narrow :class:`SearchSpace`.
    ``objective``: ``time``, ``energy`` or ``energy@BOUND`` (:mod:`merak.autoplan.energy`). ``attention``: the
    attention kernel whose saved tensors are priced, ``auto`` (the cluster's device's), ``fused`` or ``math``.
    On this machine with ``trainer.energy_device=simulated`` the processes are priced as the simulated GPUs they
    time themselves as.

    Raises:
        PlanError: no layout fits, the global batch does not divide, or the objective cannot be priced; the
            message says what would.
    """
    try:
        goal = objective if isinstance(objective, Objective) else Objective.parse(objective)
    except ValueError as error:
        raise PlanError(str(error)) from None
    if attention not in KERNELS:
        raise PlanError(f"attention kernel {attention!r}: choose one of {', '.join(KERNELS)}")
    energy = settings.trainer.energy
    if cluster.cores_per_node is not None and cluster.simulated_gpu is None and energy.energy_device == "simulated":
        cluster = with_simulated_gpus(cluster, energy.simulated_gpu, energy.simulated_tflops)
    if world_size > cluster.world_size:
        raise PlanError(f"{world_size} devices asked for, but the cluster {cluster.name!r} has "
                        f"{cluster.nodes} node(s) x {cluster.devices_per_node} = {cluster.world_size}: give it more "
                        "nodes (cluster.nodes=..., merak-plan --nodes)")
    started = time.perf_counter()
    profiles = ProfileCache(spec, settings, device_type=cluster.device_type, attention=attention)
    model_cfg = settings.model_cfg
    space = SearchSpace(world_size=world_size, global_batch_size=global_batch_size,
                        layout_problems=lambda dp, tp, pp: spec.check_layout(model_cfg, dp, tp, pp),
                        **(space_overrides or {}))
    if settings.trainer.compile.enabled:
        # A compiled part is one opaque graph: selective recomputation cannot save operators inside it, nor can
        # ZeRO-3 gather parameters around it, and the run refuses either with compilation.
        space = dataclasses.replace(space, recompute=tuple(r for r in space.recompute if r != RECOMPUTE_SELECTIVE),
                                    zero_stages=tuple(z for z in space.zero_stages if z != 3))
    if space.sequence_parallel != (False,) and world_size > 1:
        tp_values = [tp for tp in range(2, world_size + 1) if world_size % tp == 0
                     and tp <= cluster.devices_per_node and not spec.check_layout(model_cfg, 1, tp, 1)]
        if tp_values and not _supports_sequence_parallel(profiles, tp_values[0]):
            space = dataclasses.replace(space, sequence_parallel=(False,))
    sharding = spec.sharding(settings.trainer.sharding)
    model = CostModel(profiles, cluster, _dtype_name(settings.trainer), sharding=sharding,
                      overlap_grad_reduce=settings.trainer.zero.overlap_grad_reduce,
                      zero_bucket_elements=settings.trainer.zero.reduce_bucket_elements)
    capacity = cluster.accelerator.memory_gib * 2**30
    candidates = search(model, space, capacity)
    elapsed = time.perf_counter() - started
    report = PlanReport(recipe=spec.name, model=str(model_cfg.get("name", "?")), cluster=cluster,
                        world_size=world_size, global_batch_size=global_batch_size, candidates=candidates,
                        profile_seconds=profiles.seconds, search_seconds=elapsed - profiles.seconds,
                        flops_per_sample=_flops_per_sample(profiles(1, False)),
                        peak_flops=_peak_flops(cluster, _dtype_name(settings.trainer)), cost_model=model,
                        capacity_bytes=capacity, objective=goal)
    if not candidates:
        raise PlanError(_no_layout_message(space, world_size))
    if not candidates[0].fits:
        raise PlanError(_too_big_message(report, capacity))
    if goal.wants_energy:
        try:
            rank_for_energy(report, goal)
        except ValueError as error:
            raise PlanError(str(error)) from None
        report.search_seconds = time.perf_counter() - started - profiles.seconds
    return report


def _flops_per_sample(profile: GraphProfile) -> float:
    return sum(profile.flops) * (1 + BACKWARD_FLOPS_FACTOR) / profile.micro_batch_size


def _peak_flops(cluster: Cluster, dtype: str) -> float | None:
    peak = cluster.accelerator.peak_tflops.get(dtype) or cluster.accelerator.peak_tflops.get("float32")
    return peak * 1e12 if peak else None


def _no_layout_message(space: SearchSpace, world_size: int) -> str:
    batch = space.global_batch_size
    return (f"no layout of {world_size} devices can train a global batch of {batch}: every data-parallel "
            f"degree must divide it and the model must accept the tensor and pipeline degrees; a global batch "
            f"of {batch * world_size // math.gcd(batch, world_size)} divides by every degree")


def _too_big_message(report: PlanReport, capacity: float) -> str:
    smallest = min(report.candidates, key=lambda c: c.prediction.max_memory)
    need = smallest.prediction.max_memory / MEMORY_HEADROOM
    factor = need / capacity
    # Pipeline stages and ZeRO divide the model state about linearly: the next power of two giving each its share.
    devices = 1 << max(0, math.ceil(math.log2(report.world_size * factor)))
    return (f"{report.model} does not fit on {report.world_size} x {report.cluster.accelerator.name}: the "
            f"smallest layout ({smallest.layout.key()}) needs {need / 2**30:.3g} GiB per device, "
            f"{capacity / 2**30:.3g} GiB available ({factor:.2g}x): try at least {devices} devices (pipeline "
            f"stages and ZeRO divide the model state), or a smaller microbatch")


def compose_recipe(recipe: str, overrides: list[str]):
    """The recipe's composed Hydra config (``recipes/<recipe>/conf/train.yaml``) and its spec."""
    import hydra

    from merak.recipe import load_spec

    directory = REPO / "recipes" / recipe
    spec = load_spec(str(directory / "train.py"))
    with hydra.initialize_config_dir(config_dir=str(directory / "conf"), version_base=None):
        cfg = hydra.compose("train", overrides=list(overrides))
    return spec, cfg


def single_process_settings(spec, cfg):
    """The run's settings with the layout set to one process (the planner chooses it)."""
    from omegaconf import OmegaConf, open_dict

    from merak.config import resolve_settings

    cfg = cfg.copy()
    with open_dict(cfg):
        OmegaConf.update(cfg, "parallel", {"dp": 1, "tp": 1, "pp": 1}, merge=False)
        OmegaConf.update(cfg, "trainer.global_batch_size", None)
        OmegaConf.update(cfg, "trainer.gradient_accumulation_steps", 1)
        OmegaConf.update(cfg, "trainer.per_device_train_batch_size", 1)
    return resolve_settings(spec, cfg)


def requested_global_batch(cfg) -> int:
    """The global batch the config asks for: ``trainer.global_batch_size``, else microbatch x accumulation x
    the configured dp."""
    trainer = cfg.get("trainer") or {}
    if trainer.get("global_batch_size"):
        return int(trainer.global_batch_size)
    dp = int((cfg.get("parallel") or {}).get("dp", 1) or 1)
    return int(trainer.get("per_device_train_batch_size", 8)) * int(trainer.get("gradient_accumulation_steps", 1)) * dp


def plan_recipe(recipe: str, overrides: list[str], *, world_size: int, cluster: str | dict | Cluster = "this",
                space_overrides: dict | None = None, objective: str = "time", attention: str = "auto") -> PlanReport:
    """Plan ``recipe`` (a directory name under recipes/) with Hydra ``overrides`` on ``world_size`` devices."""
    spec, cfg = compose_recipe(recipe, overrides)
    if not isinstance(cluster, Cluster):
        cluster = load_cluster(cluster, processes=world_size)
    return plan_for_settings(spec, single_process_settings(spec, cfg), world_size=world_size, cluster=cluster,
                             global_batch_size=requested_global_batch(cfg), space_overrides=space_overrides,
                             objective=objective, attention=attention)


__all__ = ["Layout", "PlanError", "PlanReport", "compose_recipe", "plan_for_settings", "plan_recipe"]
