"""What the planner plans for: the devices, how fast they compute, and how fast they talk.

A :class:`Cluster` is ``nodes`` machines of ``devices_per_node`` identical
:class:`Accelerator` each, joined by an ``intra_node`` :class:`Link` (NVLink) and an
``inter_node`` one (InfiniBand). :data:`PRESETS` describe common GPU servers with
their nominal dense figures; :func:`this_machine` describes the processes at hand
on this computer (CPU workers on gloo), either with nominal CPU rates or measured
in a few seconds. :func:`load_cluster` accepts any of these by name, a YAML/JSON
file, or the mapping of the Hydra ``cluster`` config group
(``cluster=h100-80 cluster.nodes=64``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import math
import operator
import os
import queue
import socket
import statistics
import tempfile
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

from merak.distributed.launch import default_start_method, free_port
from merak.shard.costs import NOMINAL_RATES, MachineRates, calibrate

logger = logging.getLogger(__name__)

THIS = "this"
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "tf32": "tfloat32", "bf16": "bfloat16",
                  "fp16": "float16", "half": "float16"}
_HALF_SIBLING = {"bfloat16": "float16", "float16": "bfloat16"}


def _number(owner: str, field: str, value: Any, *, minimum: float = 0.0, inclusive: bool = False) -> float:
    """``value`` as a float, with a ValueError naming ``owner.field`` when it is not a finite number above
    ``minimum`` (or at least ``minimum`` when ``inclusive``)."""
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
        """FLOP/s large matrix products reach in ``dtype`` (``"bfloat16"``, ``"bf16"``, ``torch.float16``...):
        peak times :attr:`matmul_efficiency`.

        A dtype without a figure takes its half-precision sibling (bfloat16 <-> float16), then float32, then
        the slowest figure known: a CPU described by its float32 rate computes bfloat16 no faster.
        """
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

    def compute_share(self, processes_per_node: float) -> float:
        """Fraction of an accelerator's rate each process gets: 1.0 on GPUs; on a CPU cluster, processes
        beyond the node's cores share them (``min(1, cores_per_node / processes_per_node)``). The count may
        be fractional: the processes busy on average (pipeline stages idle in their bubbles)."""
        _number(f"cluster {self.name!r}", "processes_per_node", processes_per_node)
        if self.cores_per_node is None:
            return 1.0
        return min(1.0, self.cores_per_node / processes_per_node)

    def with_size(self, nodes: int | None = None, devices_per_node: int | None = None) -> Cluster:
        """The same cluster with another node count and/or devices per node."""
        return dataclasses.replace(self, nodes=self.nodes if nodes is None else nodes,
                                   devices_per_node=self.devices_per_node if devices_per_node is None
                                   else devices_per_node)

    def to_json(self) -> dict:
        """A JSON-ready dict (:meth:`from_json` and :func:`load_cluster` read it back)."""
        return {"name": self.name, "nodes": self.nodes, "devices_per_node": self.devices_per_node,
                "accelerator": self.accelerator.to_json(), "intra_node": self.intra_node.to_json(),
                "inter_node": self.inter_node.to_json(), "cores_per_node": self.cores_per_node}

    @classmethod
    def from_json(cls, data: Mapping) -> Cluster:
        """The cluster of a :meth:`to_json` dict (``name`` and ``cores_per_node`` may be left out)."""
        _check_keys("cluster", data, {"nodes", "devices_per_node", "accelerator", "intra_node", "inter_node"},
                    {"name", "cores_per_node"})
        return cls(name=data.get("name", "custom"), nodes=data["nodes"], devices_per_node=data["devices_per_node"],
                   accelerator=Accelerator.from_json(data["accelerator"]),
                   intra_node=Link.from_json(data["intra_node"]), inter_node=Link.from_json(data["inter_node"]),
                   cores_per_node=data.get("cores_per_node"))


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


def _known_names() -> str:
    return ", ".join([*PRESETS, THIS])


def preset(name: str) -> Cluster:
    """The preset cluster ``name`` (one node of 8 devices); ValueError listing the known names otherwise."""
    if name == THIS:
        raise ValueError("the 'this' cluster depends on the processes at hand: "
                         "use load_cluster('this', processes=N) or this_machine(N)")
    if name not in PRESETS:
        raise ValueError(f"unknown cluster preset {name!r}; known: {_known_names()}")
    return PRESETS[name]


# --- this machine -------------------------------------------------------------------------------------------

NOMINAL_GLOO_LINK = Link(bandwidth_gbs=1.0, latency_us=50.0)
_CACHE_FILE = "this_machine.json"
_CACHE_MAX_AGE_S = 24 * 3600.0
_LATENCY_REPEATS = 30
_BANDWIDTH_BYTES = 4 << 20
_BANDWIDTH_REPEATS = 15
_WARMUP = 3


def _usable_cores() -> int:
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


def _worker_threads() -> int:
    # merak.distributed.launch gives each worker OMP_NUM_THREADS threads (1 by default): rates are per worker.
    return int(os.environ.get("OMP_NUM_THREADS", "1"))


def _one_way_seconds(rank: int, tensor: torch.Tensor, repeats: int) -> list[float]:
    """One-way times of ``tensor`` between ranks 0 and 1, half a ping-pong each (meaningful on rank 0)."""
    times = []
    for index in range(_WARMUP + repeats):
        started = time.perf_counter()
        if rank == 0:
            dist.send(tensor, 1)
            dist.recv(tensor, 1)
        else:
            dist.recv(tensor, 0)
            dist.send(tensor, 0)
        if index >= _WARMUP:
            times.append((time.perf_counter() - started) / 2)
    return times


def _ping_pong(rank: int, port: int, results, timeout_s: float) -> None:
    """Worker of :func:`measure_link`: reports ``(rank, "ok", (small, large))`` (lists of one-way seconds)
    or ``(rank, "error", text)``."""
    try:
        # A forked child inherits no OpenMP threads: a parallel region would hang (see merak.distributed.launch).
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=timeout_s))
        try:
            small = _one_way_seconds(rank, torch.zeros(1), _LATENCY_REPEATS)
            large = _one_way_seconds(rank, torch.zeros(_BANDWIDTH_BYTES // 4), _BANDWIDTH_REPEATS)
        finally:
            dist.destroy_process_group()
        results.put((rank, "ok", (small, large)))
    except Exception:  # any failure goes to the parent, which raises it with this traceback
        results.put((rank, "error", traceback.format_exc()))


def measure_link(*, timeout_s: float = 30.0) -> Link:
    """Measure the gloo link between two processes on this machine (about a second).

    Two processes ping-pong a 4-byte tensor (latency: the median one-way time) and a 4 MB one (bandwidth:
    its extra time over the small one, best round trips of each).

    Raises:
        RuntimeError: a process failed, died, or the measurement took longer than ``timeout_s``.
    """
    context = mp.get_context(default_start_method())
    results = context.Queue()
    port = free_port()
    workers = [context.Process(target=_ping_pong, args=(rank, port, results, timeout_s), daemon=True)
               for rank in range(2)]
    for worker in workers:
        worker.start()
    reports: dict[int, tuple] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(reports) < 2:
            try:
                rank, status, payload = results.get(timeout=0.2)
            except queue.Empty:
                dead = [w.exitcode for w in workers if w.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"link measurement: a process died (exit code {dead[0]})") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"link measurement took longer than {timeout_s:g} s") from None
                continue
            if status == "error":
                raise RuntimeError(f"link measurement failed on rank {rank}:\n{payload}")
            reports[rank] = payload
    finally:
        for worker in workers:
            worker.join(timeout=5.0)
            if worker.is_alive():
                worker.terminate()
                worker.join()
        results.close()
    small, large = reports[0]
    # On a loaded machine a waiting process often wakes a whole scheduler tick late (milliseconds): the
    # medians of both sizes then differ by that noise, not by the transfer. The latency is the typical
    # (median) one; the transfer rate, a capability that noise only slows, comes from the best round trips.
    extra = min(large) - min(small)
    bandwidth = _BANDWIDTH_BYTES / (extra if extra > 0 else min(large)) / 1e9
    latency = statistics.median(small)
    link = Link(bandwidth_gbs=bandwidth, latency_us=latency * 1e6)
    logger.info("gloo link on this machine: %.3g GB/s, %.3g us", link.bandwidth_gbs, link.latency_us)
    return link


def _measure_rates() -> MachineRates:
    previous = torch.get_num_threads()
    torch.set_num_threads(_worker_threads())
    try:
        return calibrate("cpu")
    finally:
        torch.set_num_threads(previous)


def _cache_key() -> str:
    return f"{socket.gethostname()}/cpus={os.cpu_count()}/threads={_worker_threads()}"


def _read_cache(path: Path) -> dict:
    try:
        with path.open() as handle:
            data = json.load(handle)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        logger.warning("ignoring unreadable %s: %s", path, error)
        return {}
    return data if isinstance(data, dict) else {}


def _cached_measurement(path: Path) -> tuple[MachineRates, Link] | None:
    entry = _read_cache(path).get(_cache_key())
    if not isinstance(entry, dict):
        return None
    try:
        age = time.time() - float(entry["measured_at"])
        if not 0 <= age <= _CACHE_MAX_AGE_S:
            return None
        return MachineRates(**entry["rates"]), Link.from_json(entry["link"])
    except (KeyError, TypeError, ValueError) as error:
        logger.warning("ignoring a malformed entry of %s: %s", path, error)
        return None


def _write_cache(path: Path, rates: MachineRates, link: Link) -> None:
    """Add this machine's entry to ``path``, atomically (other hosts sharing the directory keep theirs)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read_cache(path)
        data[_cache_key()] = {"measured_at": time.time(), "rates": dataclasses.asdict(rates), "link": link.to_json()}
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", suffix=".tmp",
                                         delete=False) as handle:
            json.dump(data, handle, indent=2)
        try:
            os.replace(handle.name, path)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(handle.name)
            raise
    except OSError as error:
        # The measurement stands without its cache; the next run measures again.
        logger.warning("could not write %s: %s", path, error)


def this_machine(processes: int, *, measure: bool = True, cache_dir: str | os.PathLike | None = None) -> Cluster:
    """This computer running ``processes`` CPU workers on gloo, as a one-node :class:`Cluster` named ``this``.

    The workers share the machine's usable cores (``cores_per_node``) and its memory. ``measure=True`` times
    the CPU (:func:`merak.shard.costs.calibrate` with the workers' thread count) and the gloo link
    (:func:`measure_link`), a few seconds; with ``cache_dir`` the result is kept in
    ``cache_dir/this_machine.json`` per host and reused for a day. ``measure=False`` uses nominal CPU rates
    and a nominal gloo link, starting nothing.
    """
    _count("this_machine", "processes", processes)
    if not measure:
        rates, link = NOMINAL_RATES["cpu"], NOMINAL_GLOO_LINK
    else:
        path = Path(cache_dir) / _CACHE_FILE if cache_dir is not None else None
        cached = _cached_measurement(path) if path is not None else None
        if cached is not None:
            logger.debug("reusing this machine's measurement from %s", path)
            rates, link = cached
        else:
            rates, link = _measure_rates(), measure_link()
            if path is not None:
                _write_cache(path, rates, link)
    accelerator = Accelerator(name="cpu", peak_tflops={"float32": rates.flops_per_s / 1e12},
                              memory_gib=_total_memory_bytes() / 2**30 / processes,
                              memory_bandwidth_gbs=rates.bytes_per_s / 1e9, seconds_per_op=rates.seconds_per_op,
                              matmul_efficiency=1.0)
    # One node: inter_node is never crossed, but a planner asked about more nodes gets the same link.
    return Cluster(name=THIS, nodes=1, devices_per_node=processes, accelerator=accelerator, intra_node=link,
                   inter_node=link, cores_per_node=_usable_cores())


# --- loading ------------------------------------------------------------------------------------------------

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


def _from_preset(data: dict, processes: int | None, measure: bool, cache_dir) -> Cluster:
    _check_keys("cluster", data, {"preset"}, _OVERRIDES)
    name = data["preset"]
    if name == THIS:
        # An explicit devices_per_node wins over the processes at hand; null means "the processes at hand".
        count = data["devices_per_node"] if data.get("devices_per_node") is not None else processes
        if count is None:
            raise ValueError("the 'this' cluster needs the number of processes: "
                             "load_cluster(..., processes=N) or devices_per_node: N")
        base = this_machine(count, measure=measure, cache_dir=cache_dir)
    elif isinstance(name, str):
        base = preset(name)
    else:
        raise ValueError(f"cluster preset must be a name ({_known_names()}), got {name!r}")
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


def load_cluster(spec: str | os.PathLike | Mapping | Cluster, *, processes: int | None = None,
                 measure: bool = True, cache_dir: str | os.PathLike | None = None) -> Cluster:
    """The :class:`Cluster` that ``spec`` describes.

    ``spec`` is a preset name (:data:`PRESETS`), ``"this"`` (:func:`this_machine` with ``processes``,
    ``measure`` and ``cache_dir``), a path to a ``.yaml``/``.yml``/``.json`` file, or a mapping (such as the
    Hydra ``cluster`` group's node): either a preset with overrides, ``{"preset": "h100-80", "nodes": 64,
    "inter_node": {"bandwidth_gbs": 25}}``, where null values keep the preset's, or a full description as
    :meth:`Cluster.to_json` writes it. A file holds either kind of mapping.

    Raises:
        ValueError: unknown preset (the known names listed), unknown or missing keys (named), values that
            are not positive, or a file that does not exist or cannot be parsed.
    """
    if isinstance(spec, Cluster):
        return spec
    if isinstance(spec, Mapping):
        data = _plain(spec)
        if "preset" in data:
            return _from_preset(data, processes, measure, cache_dir)
        return Cluster.from_json(data)
    if isinstance(spec, os.PathLike):
        return load_cluster(_read_file(Path(spec)), processes=processes, measure=measure, cache_dir=cache_dir)
    if not isinstance(spec, str):
        raise ValueError(f"a cluster is a name, a file or a mapping, got {type(spec).__name__}")
    name = spec.strip()
    if name in PRESETS:
        return PRESETS[name]
    if name == THIS:
        return _from_preset({"preset": THIS}, processes, measure, cache_dir)
    if name.endswith((".yaml", ".yml", ".json")) or os.sep in name or os.path.isfile(name):
        return load_cluster(Path(name), processes=processes, measure=measure, cache_dir=cache_dir)
    raise ValueError(f"unknown cluster {spec!r}: not a preset ({_known_names()}) nor a .yaml/.json file")
