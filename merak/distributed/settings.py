"""The ``launcher`` config section: how worker processes start and talk. Consumed by
merak.distributed.launch."""

from __future__ import annotations

from dataclasses import dataclass

from merak.core.fields import positive, positive_finite, setting

START_METHODS = ("auto", "fork", "spawn", "forkserver")
BACKENDS = ("auto", "gloo", "nccl")


@dataclass(frozen=True)
class LauncherSettings:
    """The ``launcher`` config group (for torchrun/srun only backend and timeout_s apply)."""

    start_method: str = setting("auto", "auto (fork on CPU, spawn with CUDA) | fork | spawn | forkserver")
    backend: str = setting("auto", "auto (nccl with CUDA, else gloo) | gloo | nccl")
    threads_per_rank: int = setting(1, "torch intra-op threads per worker", check=positive,
                                    requirement="must be a positive integer")
    timeout_s: float = setting(600.0, "a collective waiting longer than this fails the run",
                               check=positive_finite, requirement="must be a positive number of seconds")
    keep_freed_memory: bool = setting(True, "keep large freed buffers in the heap (glibc): "
                                            "far less time in the kernel on CPU")
    quiet_workers: bool = setting(False, "workers log only warnings and errors (rank 0's progress too)")

    def problems(self) -> list[str]:
        problems = []
        if self.start_method not in START_METHODS:
            problems.append(f"launcher.start_method={self.start_method!r}; use auto, fork, spawn or forkserver")
        if self.backend not in BACKENDS:
            problems.append(f"launcher.backend={self.backend!r}; use auto, gloo or nccl")
        return problems
