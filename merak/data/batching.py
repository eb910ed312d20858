"""Which samples each data-parallel rank loads for each step.

The global batch of step ``k`` is the same set of samples whatever the
layout: one seeded permutation per epoch is cut into global batches, a global
batch into one contiguous slice per dp rank, and a slice into microbatches.
So a dp=2 x 4-microbatch run and a single process with one big batch see the
same data, and runs can be compared number for number. A new epoch draws a
new permutation (seed + epoch).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BatchPlan:
    """Sample indices for every step of a run, for one dp rank.

    Args:
        num_samples: dataset length.
        micro_batch_size: samples per microbatch on one rank.
        num_microbatches: microbatches per step (gradient accumulation steps).
        dp_size: data-parallel degree.
        dp_rank: this rank's data-parallel index.
        seed: base seed of the epoch permutations.
        shuffle: draw a new permutation each epoch (else keep dataset order).
    """

    num_samples: int
    micro_batch_size: int
    num_microbatches: int
    dp_size: int = 1
    dp_rank: int = 0
    seed: int = 0
    shuffle: bool = True

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.num_microbatches * self.dp_size

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch_size

    def __post_init__(self) -> None:
        for field in ("micro_batch_size", "num_microbatches", "dp_size"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field}={getattr(self, field)} must be at least 1")
        if not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"dp_rank={self.dp_rank} outside 0..{self.dp_size - 1}")
        if self.steps_per_epoch < 1:
            raise ValueError(
                f"the dataset has {self.num_samples} samples, fewer than one global batch of "
                f"{self.global_batch_size} (micro batch {self.micro_batch_size} x "
                f"{self.num_microbatches} microbatches x dp {self.dp_size}); use more data or a smaller batch"
            )

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The sample order of one epoch (shared between calls: not to be modified)."""
        return _epoch_order(self.num_samples, self.seed + epoch if self.shuffle else None)

    def global_batch(self, step: int) -> torch.Tensor:
        """Indices of the whole global batch of ``step`` (all dp ranks)."""
        epoch, position = divmod(step, self.steps_per_epoch)
        start = position * self.global_batch_size
        return self.epoch_order(epoch)[start:start + self.global_batch_size]

    def microbatch_indices(self, step: int) -> list[list[int]]:
        """This rank's microbatches of ``step``, as lists of sample indices."""
        share = self.micro_batch_size * self.num_microbatches
        mine = self.global_batch(step)[self.dp_rank * share:(self.dp_rank + 1) * share].tolist()
        return [mine[m * self.micro_batch_size:(m + 1) * self.micro_batch_size]
                for m in range(self.num_microbatches)]


@functools.lru_cache(maxsize=2)
def _epoch_order(num_samples: int, seed: int | None) -> torch.Tensor:
    """The permutation drawn with ``seed`` (None: the dataset's order), kept: every step's load asks for its
    epoch's, and drawing a permutation of a million samples takes some 50 ms of a CPU core (two are kept,
    for the steps on either side of an epoch's end)."""
    if seed is None:
        return torch.arange(num_samples)
    return torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed))


def stack_samples(samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Default collate: stack each field of dict samples."""
    return {key: torch.stack([torch.as_tensor(s[key]) for s in samples]) for key in samples[0]}


class _StepMicrobatches(torch.utils.data.Sampler):
    """The microbatch index lists of a plan, step after step from ``first_step`` (endless)."""

    def __init__(self, plan: BatchPlan, first_step: int) -> None:
        self.plan, self.first_step = plan, first_step

    def __iter__(self):
        step = self.first_step
        while True:
            yield from self.plan.microbatch_indices(step)
            step += 1


class MicrobatchLoader:
    """Loads a step's microbatches for this rank from an indexable dataset.

    With ``num_workers`` > 0, a ``torch.utils.data.DataLoader`` prepares the microbatches of the
    next steps in worker processes while the current one trains, in the plan's order. On CUDA
    batches are pinned and copied with ``non_blocking=True``, so the host queues the copy and
    goes on; the copy runs on the device's stream before the step's kernels that read it.

    Args:
        dataset: anything with ``__getitem__(int) -> dict of tensors``.
        plan: the :class:`BatchPlan` of this rank.
        collate: turns a list of samples into one batch dict.
        device: where batches are placed.
        num_workers: worker processes preparing batches ahead (0: made when asked, in this process).
        pin_memory: page-locked host batches for asynchronous copies (only used with CUDA).
        prefetch_steps: steps each worker prepares ahead.
        channels_last: 4-D floating-point fields (images) in the channels-last layout.
    """

    def __init__(self, dataset, plan: BatchPlan,
                 collate: Callable[[Sequence], dict[str, torch.Tensor]] = stack_samples,
                 device: torch.device | str = "cpu", *, num_workers: int = 0, pin_memory: bool = True,
                 prefetch_steps: int = 2, channels_last: bool = False) -> None:
        if num_workers < 0:
            raise ValueError(f"num_workers={num_workers} must be >= 0")
        self.dataset = dataset
        self.plan = plan
        self.collate = collate
        self.device = torch.device(device)
        self.num_workers = num_workers
        self.pin_memory = pin_memory and self.device.type == "cuda"
        self.prefetch_steps = prefetch_steps
        self.channels_last = channels_last
        self._iterator = None
        self._next_step: int | None = None

    def _batches_from(self, step: int):
        loader = torch.utils.data.DataLoader(
            self.dataset, batch_sampler=_StepMicrobatches(self.plan, step), collate_fn=self.collate,
            num_workers=self.num_workers, pin_memory=self.pin_memory,
            prefetch_factor=self.prefetch_steps * self.plan.num_microbatches if self.num_workers else None)
        return iter(loader)

    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        moved = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        if self.channels_last:
            moved = {k: v.contiguous(memory_format=torch.channels_last) if v.dim() == 4 and v.is_floating_point()
                     else v for k, v in moved.items()}
        return moved

    def load_step(self, step: int) -> list[dict[str, torch.Tensor]]:
        """The microbatches of ``step`` (0-based over the whole run)."""
        if self.num_workers == 0:
            batches = []
            for indices in self.plan.microbatch_indices(step):
                batch = self.collate([self.dataset[i] for i in indices])
                if self.pin_memory:
                    batch = {k: v.pin_memory() for k, v in batch.items()}
                batches.append(self._to_device(batch))
            return batches
        if step != self._next_step:  # first call, or a jump (resume): restart the workers at ``step``
            self.close()
            self._iterator = self._batches_from(step)
        self._next_step = step + 1
        return [self._to_device(next(self._iterator)) for _ in range(self.plan.num_microbatches)]

    def close(self) -> None:
        """Stop the worker processes (a later load_step starts new ones)."""
        self._iterator = None
        self._next_step = None
