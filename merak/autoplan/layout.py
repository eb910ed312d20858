"""One candidate way to run a model: the parallel degrees and the settings the planner chooses."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    """Data x tensor x pipeline degrees, microbatching, schedule, recomputation, ZeRO and sequence
    parallelism: everything ``parallel=auto`` decides (the global batch is the user's)."""

    dp: int
    tp: int
    pp: int
    micro_batch_size: int
    num_microbatches: int
    schedule: str = "1f1b"
    chunks: int = 1
    recompute: bool = False
    zero_stage: int = 0
    sequence_parallel: bool = False

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def global_batch_size(self) -> int:
        return self.dp * self.micro_batch_size * self.num_microbatches

    @property
    def grid(self) -> tuple[int, int, int]:
        return self.dp, self.tp, self.pp

    def key(self) -> str:
        """A short name, e.g. ``dp2 tp1 pp2 mb4 M2 1f1b rc0 z0 sp0``."""
        schedule = self.schedule if self.chunks == 1 else f"{self.schedule}x{self.chunks}"
        return (f"dp{self.dp} tp{self.tp} pp{self.pp} mb{self.micro_batch_size} M{self.num_microbatches} "
                f"{schedule} rc{int(self.recompute)} z{self.zero_stage} sp{int(self.sequence_parallel)}")

    def overrides(self) -> list[str]:
        """The Hydra overrides that run exactly this layout."""
        values = [f"parallel.dp={self.dp}", f"parallel.tp={self.tp}", f"parallel.pp={self.pp}",
                  f"trainer.per_device_train_batch_size={self.micro_batch_size}",
                  f"trainer.gradient_accumulation_steps={self.num_microbatches}",
                  f"trainer.global_batch_size={self.global_batch_size}",
                  f"trainer.train_schedule={self.schedule}",
                  f"trainer.pipeline_chunks={self.chunks if self.chunks > 1 else 'null'}",
                  f"trainer.activation_checkpointing={str(self.recompute).lower()}",
                  "trainer.activation_checkpoint_ratio=null",
                  f"trainer.zero_optimization={str(self.zero_stage > 0).lower()}",
                  f"trainer.zero_stage={max(self.zero_stage, 1)}",
                  f"trainer.sequence_parallel={str(self.sequence_parallel).lower()}"]
        return values

    def to_json(self) -> dict:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "micro_batch_size": self.micro_batch_size,
                "num_microbatches": self.num_microbatches, "schedule": self.schedule, "chunks": self.chunks,
                "recompute": self.recompute, "zero_stage": self.zero_stage,
                "sequence_parallel": self.sequence_parallel}
