"""What the planner plans for: the devices, how fast they compute, and how fast they talk.

A :class:`Cluster` is ``nodes`` machines of ``devices_per_node`` identical :class:`Accelerator` each,
joined by an ``intra_node`` :class:`Link` (NVLink) and an ``inter_node`` one (InfiniBand).
:data:`PRESETS` describe common GPU servers with their nominal dense figures; :func:`this_machine`
describes the processes at hand on this computer (CPU workers on gloo). :func:`load_cluster` accepts
any of these by name, a YAML/JSON file, or the mapping of the Hydra ``cluster`` config group
(``cluster=h100-80 cluster.nodes=64``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import operator
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from merak.shard.costs import NOMINAL_RATES

logger = logging.getLogger(__name__)

THIS = "this"
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "tf32": "tfloat32", "bf16": "bfloat16",
                  "fp16": "float16", "half": "float16"}
_HALF_SIBLING = {"bfloat16": "float16", "float16": "bfloat16"}


def _number(owner: str, field: str, value: Any, *, minimum: float = 0.0, inclusive: bool = False) -> float:
    """``value`` as a float; ValueError naming ``owner.field`` unless finite and above (or ``inclusive``: at
    least) ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{owner}.{field} must be a number, got {value!r}")
    if value < minimum or (value == minimum and not inclusive):
        bound = f">= {minimum:g}" if inclusive else f"> {minimum:g}"
        raise ValueError(f"{owner}.{field} must be {bound}, got {value!r}")
    return float(value)


def _count(owner: str, field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{owner}.{field} must be a positive integer, got {value!r}")
    if value <= 0:
        raise ValueError(f"{owner}.{field} must be positive, got {value!r}")
    return value


def _check_keys(owner: str, data: Mapping, required: set[str], optional: set[str] = frozenset()) -> None:
    if not isinstance(data, Mapping):
        raise ValueError(f"{owner} must be a mapping, got {type(data).__name__}")
    unknown = sorted(set(data) - required - optional)
    if unknown:
        raise ValueError(f"{owner}: unknown key(s) {', '.join(map(str, unknown))}; "
                         f"known: {', '.join(sorted(required | optional))}")
    missing = sorted(required - set(data))
    if missing:
        raise ValueError(f"{owner}: missing key(s) {', '.join(missing)}")


def _dtype_name(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    return _DTYPE_ALIASES.get(name, name)


@dataclass(frozen=True)
class Accelerator:
    """One device: dense peak rates per dtype (TFLOP/s), memory (GiB, GB/s) and per-kernel overhead."""

    name: str
    peak_tflops: dict[str, float]
    memory_gib: float
    memory_bandwidth_gbs: float
    seconds_per_op: float
    matmul_efficiency: float

    def __post_init__(self) -> None:
        owner = f"accelerator {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"accelerator name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.peak_tflops, Mapping) or not self.peak_tflops:
            raise ValueError(f"{owner}.peak_tflops must be a non-empty mapping of dtype to TFLOP/s")
        peaks = {_dtype_name(k): _number(owner, f"peak_tflops[{k}]", v) for k, v in self.peak_tflops.items()}
        # Frozen: the checked copies replace what was given (ints from YAML become floats, aliases canonical).
        object.__setattr__(self, "peak_tflops", peaks)
        object.__setattr__(self, "memory_gib", _number(owner, "memory_gib", self.memory_gib))
        object.__setattr__(self, "memory_bandwidth_gbs",
                           _number(owner, "memory_bandwidth_gbs", self.memory_bandwidth_gbs))
        object.__setattr__(self, "seconds_per_op",
                           _number(owner, "seconds_per_op", self.seconds_per_op, inclusive=True))
        efficiency = _number(owner, "matmul_efficiency", self.matmul_efficiency)
        if efficiency > 1:
            raise ValueError(f"{owner}.matmul_efficiency is a fraction of peak (0, 1], got {efficiency}")
        object.__setattr__(self, "matmul_efficiency", efficiency)

    def __hash__(self) -> int:
        # The dict field is not hashable; clusters serve as cache keys for plans.
        return hash((self.name, tuple(sorted(self.peak_tflops.items())), self.memory_gib,
                     self.memory_bandwidth_gbs, self.seconds_per_op, self.matmul_efficiency))

    def flops_per_s(self, dtype: Any) -> float:
        """FLOP/s large matrix products reach in ``dtype`` (``"bf16"``, ``torch.float16``...): peak times
        :attr:`matmul_efficiency`. A dtype without a figure takes its half-precision sibling, then float32, then the
        slowest figure known."""
        name = _dtype_name(dtype)
        for candidate in (name, _HALF_SIBLING.get(name), "float32"):
            if candidate in self.peak_tflops:
                return self.peak_tflops[candidate] * 1e12 * self.matmul_efficiency
        return min(self.peak_tflops.values()) * 1e12 * self.matmul_efficiency

    def to_json(self) -> dict:
        """A JSON-ready dict (:meth:`from_json` reads it back)."""
        return {**dataclasses.asdict(self), "peak_tflops": dict(self.peak_tflops)}

    @classmethod
    def from_json(cls, data: Mapping) -> Accelerator:
        """The accelerator of a :meth:`to_json` dict; ValueError names unknown or missing keys."""
        _check_keys("accelerator", data, {f.name for f in dataclasses.fields(cls)})
        return cls(**data)


@dataclass(frozen=True)
class Link:
    """A connection between two devices: bandwidth per device per direction (GB/s) and latency."""

    bandwidth_gbs: float
    latency_us: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "bandwidth_gbs", _number("link", "bandwidth_gbs", self.bandwidth_gbs))
        object.__setattr__(self, "latency_us", _number("link", "latency_us", self.latency_us, inclusive=True))

    def seconds(self, nbytes: float) -> float:
        """Time to send ``nbytes`` one way: latency plus size over bandwidth."""
        return self.latency_us * 1e-6 + nbytes / (self.bandwidth_gbs * 1e9)

    def to_json(self) -> dict:
        """A JSON-ready dict (:meth:`from_json` reads it back)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping) -> Link:
        """The link of a :meth:`to_json` dict; ValueError names unknown or missing keys."""
        _check_keys("link", data, {"bandwidth_gbs", "latency_us"})
        return cls(**data)


@dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``devices_per_node`` identical accelerators; rank ``r`` sits on node ``r // devices_per_node``."""

    name: str
    nodes: int
    devices_per_node: int
    accelerator: Accelerator
    intra_node: Link
    inter_node: Link
    cores_per_node: int | None = None  # CPU clusters: the processes of one node share these cores
    # CPU processes timing their compute as this simulated GPU (merak.energy.simulated.SPECS) does:
    # trainer.energy_device=simulated. Their compute is sleeping out the GPU's time, not sharing the cores.
    simulated_gpu: str | None = None

    def __post_init__(self) -> None:
        owner = f"cluster {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"cluster name must be a non-empty string, got {self.name!r}")
        _count(owner, "nodes", self.nodes)
        _count(owner, "devices_per_node", self.devices_per_node)
        if self.cores_per_node is not None:
            _count(owner, "cores_per_node", self.cores_per_node)
        if not isinstance(self.accelerator, Accelerator):
            raise ValueError(f"{owner}.accelerator must be an Accelerator, got {type(self.accelerator).__name__}")
        for field in ("intra_node", "inter_node"):
            if not isinstance(getattr(self, field), Link):
                raise ValueError(f"{owner}.{field} must be a Link, got {type(getattr(self, field)).__name__}")

    @property
    def device_type(self) -> str:
        """The torch device type its processes train on: "cpu" for a CPU cluster, else "cuda"."""
        return "cpu" if self.cores_per_node is not None else "cuda"

    @property
    def world_size(self) -> int:
        """Devices in all: ``nodes * devices_per_node``."""
        return self.nodes * self.devices_per_node

    def node_of(self, rank: int) -> int:
        """The node holding ``rank``."""
        index = operator.index(rank)  # numpy and tensor integers too
        if not 0 <= index < self.world_size:
            raise ValueError(f"rank {rank!r} is outside the cluster's {self.world_size} devices")
        return index // self.devices_per_node

    def link_for(self, ranks: Sequence[int]) -> Link:
        """The slowest link a group of ``ranks`` crosses: ``intra_node`` when all share one node."""
        nodes = {self.node_of(rank) for rank in ranks}
        return self.intra_node if len(nodes) <= 1 else self.inter_node

    def with_size(self, nodes: int | None = None, devices_per_node: int | None = None) -> Cluster:
        """The same cluster with another node count and/or devices per node."""
        return dataclasses.replace(self, nodes=self.nodes if nodes is None else nodes,
                                   devices_per_node=self.devices_per_node if devices_per_node is None
                                   else devices_per_node)

    def to_json(self) -> dict:
        """A JSON-ready dict (:meth:`from_json` and :func:`load_cluster` read it back)."""
        data = {"name": self.name, "nodes": self.nodes, "devices_per_node": self.devices_per_node,
                "accelerator": self.accelerator.to_json(), "intra_node": self.intra_node.to_json(),
                "inter_node": self.inter_node.to_json(), "cores_per_node": self.cores_per_node}
        return data | ({"simulated_gpu": self.simulated_gpu} if self.simulated_gpu else {})

    @classmethod
    def from_json(cls, data: Mapping) -> Cluster:
        """The cluster of a :meth:`to_json` dict (``name``, ``cores_per_node`` and ``simulated_gpu`` may be left
        out)."""
        _check_keys("cluster", data, {"nodes", "devices_per_node", "accelerator", "intra_node", "inter_node"},
                    {"name", "cores_per_node", "simulated_gpu"})
        return cls(name=data.get("name", "custom"), nodes=data["nodes"], devices_per_node=data["devices_per_node"],
                   accelerator=Accelerator.from_json(data["accelerator"]),
                   intra_node=Link.from_json(data["intra_node"]), inter_node=Link.from_json(data["inter_node"]),
                   cores_per_node=data.get("cores_per_node"), simulated_gpu=data.get("simulated_gpu"))


# Nominal dense figures of SXM parts (no sparsity). float32 is the plain rate: tfloat32 needs torch's
# allow_tf32, off by default for matmuls. seconds_per_op is merak.shard.costs.NOMINAL_RATES["cuda"]'s.
_GPU_OP_S = NOMINAL_RATES["cuda"].seconds_per_op
_GEMM_EFFICIENCY = 0.7
_NVLINK3, _NVLINK4 = Link(300.0, 5.0), Link(450.0, 5.0)
_HDR_IB, _NDR_IB = Link(25.0, 10.0), Link(50.0, 10.0)  # 8 x 200 / 400 Gb/s per node, one per GPU
_A100 = {"float32": 19.5, "tfloat32": 156.0, "bfloat16": 312.0, "float16": 312.0}
_H100 = {"float32": 67.0, "tfloat32": 494.0, "bfloat16": 989.0, "float16": 989.0}


def _server(name: str, accelerator: Accelerator, intra: Link, inter: Link) -> Cluster:
    return Cluster(name, nodes=1, devices_per_node=8, accelerator=accelerator, intra_node=intra, inter_node=inter)


PRESETS: dict[str, Cluster] = {
    "a100-40": _server("a100-40", Accelerator("A100-40GB", _A100, 40.0, 1555.0, _GPU_OP_S, _GEMM_EFFICIENCY),
                       _NVLINK3, _HDR_IB),
    "a100-80": _server("a100-80", Accelerator("A100-80GB", _A100, 80.0, 2039.0, _GPU_OP_S, _GEMM_EFFICIENCY),
                       _NVLINK3, _HDR_IB),
    "h100-80": _server("h100-80", Accelerator("H100-80GB", _H100, 80.0, 3350.0, _GPU_OP_S, _GEMM_EFFICIENCY),
                       _NVLINK4, _NDR_IB),
    "h200": _server("h200", Accelerator("H200-141GB", _H100, 141.0, 4800.0, _GPU_OP_S, _GEMM_EFFICIENCY),
                    _NVLINK4, _NDR_IB),
}


def preset(name: str) -> Cluster:
    """The preset cluster ``name`` (one node of 8 devices); ValueError listing the known names otherwise."""
    if name == THIS:
        raise ValueError("the 'this' cluster depends on the processes at hand: "
                         "use load_cluster('this', processes=N) or this_machine(N)")
    if name not in PRESETS:
        raise ValueError(f"unknown cluster preset {name!r}; known: {', '.join([*PRESETS, THIS])}")
    return PRESETS[name]


# Nominal: among processes sharing the cores a message's cost is its receiver's scheduling (trials decide).
NOMINAL_GLOO_LINK = Link(bandwidth_gbs=1.0, latency_us=50.0)


def usable_cores() -> int:
    """This machine's cores this process may run on: the processes planned for when nothing says."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _total_memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        # Platforms without these sysconf names: a modest guess keeps plans conservative.
        logger.warning("cannot read this machine's memory size; assuming 16 GiB")
        return 16.0 * 2**30


def this_machine(processes: int) -> Cluster:
    """This computer running ``processes`` CPU workers on gloo: one node named ``this``, its usable cores and memory
    shared, nominal CPU rates and :data:`NOMINAL_GLOO_LINK`. The cost model ranks; trials decide (:mod:`.trials`)."""
    _count("this_machine", "processes", processes)
    rates, link = NOMINAL_RATES["cpu"], NOMINAL_GLOO_LINK
    accelerator = Accelerator(name="cpu", peak_tflops={"float32": rates.flops_per_s / 1e12},
                              memory_gib=_total_memory_bytes() / 2**30 / processes,
                              memory_bandwidth_gbs=rates.bytes_per_s / 1e9, seconds_per_op=rates.seconds_per_op,
                              matmul_efficiency=1.0)
    # One node: inter_node is never crossed, but a planner asked about more nodes gets the same link.
    return Cluster(name=THIS, nodes=1, devices_per_node=processes, accelerator=accelerator, intra_node=link,
                   inter_node=link, cores_per_node=usable_cores())


def with_simulated_gpus(cluster: Cluster, gpu: str, tflops: float) -> Cluster:
    """``cluster`` (this machine's CPU processes) with every process timing its compute as a simulated ``gpu``
    (``A100``, ``H100``) of ``tflops`` at its highest clock does: ``trainer.energy_device=simulated``. Its
    instructions cost their FLOPs only (merak.autoplan.cost.device_rates); the memory bandwidth stays the CPU's,
    which runs the optimizer step."""
    from merak.energy.simulated import gpu_spec

    spec = gpu_spec(gpu)
    accelerator = Accelerator(name=f"simulated {spec.name}",
                              peak_tflops={"float32": tflops, "bfloat16": tflops, "float16": tflops},
                              memory_gib=cluster.accelerator.memory_gib,
                              memory_bandwidth_gbs=cluster.accelerator.memory_bandwidth_gbs,
                              seconds_per_op=0.0, matmul_efficiency=1.0)
    return dataclasses.replace(cluster, accelerator=accelerator, simulated_gpu=spec.name)


_OVERRIDES = {"name", "nodes", "devices_per_node", "cores_per_node", "accelerator", "intra_node", "inter_node"}


def _plain(value: Any) -> Any:
    """Nested mappings (an OmegaConf node included) as plain dicts."""
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return value


def _merged(owner: str, base: Mapping, override: Any) -> dict:
    if not isinstance(override, Mapping):
        raise ValueError(f"cluster override {owner} must be a mapping, got {override!r}")
    unknown = sorted(set(override) - set(base))
    if unknown:
        raise ValueError(f"cluster override {owner}: unknown key(s) {', '.join(unknown)}; "
                         f"known: {', '.join(sorted(base))}")
    merged = {**base, **{k: v for k, v in override.items() if v is not None}}
    if isinstance(override.get("peak_tflops"), Mapping):
        merged["peak_tflops"] = {**base["peak_tflops"], **override["peak_tflops"]}
    return merged


def _from_preset(data: dict, processes: int | None) -> Cluster:
    _check_keys("cluster", data, {"preset"}, _OVERRIDES)
    name = data["preset"]
    if name == THIS:
        # An explicit devices_per_node wins over the processes at hand; null means "the processes at hand".
        count = data["devices_per_node"] if data.get("devices_per_node") is not None else processes
        if count is None:
            raise ValueError("the 'this' cluster needs the number of processes: "
                             "load_cluster(..., processes=N) or devices_per_node: N")
        base = this_machine(count)
    elif isinstance(name, str):
        base = preset(name)
    else:
        raise ValueError(f"cluster preset must be a name ({', '.join([*PRESETS, THIS])}), got {name!r}")
    changes: dict[str, Any] = {}
    for key in ("name", "nodes", "devices_per_node", "cores_per_node"):
        if data.get(key) is not None:
            changes[key] = data[key]
    if data.get("accelerator") is not None:
        changes["accelerator"] = Accelerator.from_json(
            _merged("accelerator", base.accelerator.to_json(), data["accelerator"]))
    for key in ("intra_node", "inter_node"):
        if data.get(key) is not None:
            changes[key] = Link.from_json(_merged(key, getattr(base, key).to_json(), data[key]))
    return dataclasses.replace(base, **changes)


def _read_file(path: Path) -> dict:
    if not path.is_file():
        raise ValueError(f"cluster file {path} does not exist")
    try:
        text = path.read_text()
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as error:
        raise ValueError(f"cannot read cluster file {path}: {error}") from error
    if not isinstance(data, Mapping):
        raise ValueError(f"cluster file {path} must hold a mapping, got {type(data).__name__}")
    return data


def load_cluster(spec: str | os.PathLike | Mapping | Cluster, *, processes: int | None = None) -> Cluster:
    """The :class:`Cluster` that ``spec`` describes: a preset name, ``"this"`` (:func:`this_machine` of
    ``processes``), a ``.yaml``/``.json`` file, or a mapping (the Hydra ``cluster`` node): a preset with
    overrides (``{"preset": "h100-80", "nodes": 64}``; nulls keep the preset's) or :meth:`Cluster.to_json`'s form.

    Raises:
        ValueError: unknown preset or keys (named), values that are not positive, a file that cannot be read.
    """
    if isinstance(spec, Cluster):
        return spec
    if isinstance(spec, Mapping):
        data = _plain(spec)
        if "preset" in data:
            return _from_preset(data, processes)
        return Cluster.from_json(data)
    if isinstance(spec, os.PathLike):
        return load_cluster(_read_file(Path(spec)), processes=processes)
    if not isinstance(spec, str):
        raise ValueError(f"a cluster is a name, a file or a mapping, got {type(spec).__name__}")
    name = spec.strip()
    if name in PRESETS:
        return PRESETS[name]
    if name == THIS:
        return _from_preset({"preset": THIS}, processes)
    if name.endswith((".yaml", ".yml", ".json")) or os.sep in name or os.path.isfile(name):
        return load_cluster(Path(name), processes=processes)
    raise ValueError(f"unknown cluster {spec!r}: not a preset ({', '.join([*PRESETS, THIS])}) nor a .yaml/.json file")
