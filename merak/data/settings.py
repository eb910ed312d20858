"""The batch and run-length section of the ``trainer`` config: how many samples a step takes and how
many steps a run makes. Consumed by merak.data.batching and the run loop (merak.session.training)."""

from __future__ import annotations

from dataclasses import dataclass

from merak.core.fields import finite, positive_int_problem, setting


@dataclass(frozen=True)
class BatchSettings:
    """Batches, run length, seed and data loading."""

    seed: int = setting(42, "seed of weights, data order and dropout",
                        check=lambda v: 0 <= v < 2 ** 32, requirement="must be within 0 .. 2**32-1")
    # 0 passes the range check: resolve_settings reports it as "nothing to train".
    max_steps: int = setting(-1, "optimizer steps of the run; > 0 overrides num_train_epochs",
                             check=lambda v: v >= -1,
                             requirement="must be -1 (train num_train_epochs) or a positive integer")
    num_train_epochs: float = setting(1.0, "passes over the data when max_steps is -1",
                                      check=finite,
                                      requirement="must be a finite number")
    per_device_train_batch_size: int = setting(8, "samples per microbatch on one rank")
    gradient_accumulation_steps: int = setting(1, "microbatches per optimizer step (the pipeline's M)")
    global_batch_size: int | None = setting(
        None, "if set, gradient_accumulation_steps = global_batch_size / (per_device_train_batch_size x dp)")
    dataloader_num_workers: int | None = setting(
        None, "processes preparing the next batches (null: 2 on CUDA, 0 on CPU)")
    dataloader_pin_memory: bool = setting(True, "CUDA: page-locked batches, copied without blocking the host")
    input_names: list[str] | None = setting(
        None, "forward arguments fed from the data (null: the recipe's, else the data fields)")

    def problems(self) -> list[str]:
        """What is wrong with these values alone (the layout is checked with them in merak.config)."""
        problems = []
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps"):
            positive_int_problem(f"trainer.{name}", getattr(self, name), problems)
        if self.global_batch_size is not None:
            positive_int_problem("trainer.global_batch_size", self.global_batch_size, problems)
        if self.max_steps == 0 or (self.max_steps < 0 and self.num_train_epochs <= 0):
            problems.append("nothing to train: set trainer.max_steps > 0 or trainer.num_train_epochs > 0")
        workers = self.dataloader_num_workers
        if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool) or workers < 0):
            problems.append(f"trainer.dataloader_num_workers={workers!r} must be null (automatic) or an "
                            "integer >= 0")
        return problems

