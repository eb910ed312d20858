"""One candidate way to run a model: the parallel degrees and the settings the planner chooses."""

from __future__ import annotations

from dataclasses import dataclass

# Activation recomputation of a layout: none; every checkpointed layer keeps only its input and the backward
# recomputes it whole (trainer.activation_checkpointing=true); or selective: the layers also keep what the
# "matmuls" policy saves, the outputs of matrix products and fused attention (merak.pipeline.selective), and
# the backward recomputes only the rest.
RECOMPUTE_OFF, RECOMPUTE_FULL, RECOMPUTE_SELECTIVE = "off", "full", "selective"
RECOMPUTE_MODES = (RECOMPUTE_OFF, RECOMPUTE_FULL, RECOMPUTE_SELECTIVE)
SELECTIVE_POLICY = "matmuls"  # trainer.selective_recompute of a selective layout: what the planner prices
ZERO_STAGES = (0, 1, 2, 3)
_KEY_RECOMPUTE = {RECOMPUTE_OFF: "rc0", RECOMPUTE_FULL: "rc1", RECOMPUTE_SELECTIVE: "rcsel"}


@dataclass(frozen=True)
class Layout:
    """Data x tensor x pipeline degrees, microbatching, schedule, recomputation, ZeRO and sequence
    parallelism: everything ``parallel=auto`` decides (the global batch is the user's).

    ``recompute`` is one of :data:`RECOMPUTE_MODES` (``"off"``, ``"full"``, ``"selective"``).

    Raises:
        ValueError: an unknown recomputation mode or ZeRO stage.
    """

    dp: int
    tp: int
    pp: int
    micro_batch_size: int
    num_microbatches: int
    schedule: str = "1f1b"
    chunks: int = 1
    recompute: str = RECOMPUTE_OFF
    zero_stage: int = 0
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        # A bool here would be the old on/off field: "off" is truthy, so it must never pass silently.
        if not isinstance(self.recompute, str) or self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute={self.recompute!r}: choose one of {', '.join(RECOMPUTE_MODES)}")
        if self.zero_stage not in ZERO_STAGES:
            raise ValueError(f"zero_stage={self.zero_stage!r}: choose one of {', '.join(map(str, ZERO_STAGES))}")

    @property
    def recomputes(self) -> bool:
        """Whether the backward recomputes anything (full or selective recomputation)."""
        return self.recompute != RECOMPUTE_OFF

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
        """A short name, e.g. ``dp2 tp1 pp2 mb4 M2 1f1b rc0 z0 sp0`` (``rc1``: full recomputation, ``rcsel``:
        selective)."""
        schedule = self.schedule if self.chunks == 1 else f"{self.schedule}x{self.chunks}"
        return (f"dp{self.dp} tp{self.tp} pp{self.pp} mb{self.micro_batch_size} M{self.num_microbatches} "
                f"{schedule} {_KEY_RECOMPUTE[self.recompute]} z{self.zero_stage} sp{int(self.sequence_parallel)}")

    def overrides(self) -> list[str]:
        """The Hydra overrides that run exactly this layout."""
        checkpointing = {RECOMPUTE_OFF: "false", RECOMPUTE_FULL: "true", RECOMPUTE_SELECTIVE: "selective"}
        values = [f"parallel.dp={self.dp}", f"parallel.tp={self.tp}", f"parallel.pp={self.pp}",
                  f"trainer.per_device_train_batch_size={self.micro_batch_size}",
                  f"trainer.gradient_accumulation_steps={self.num_microbatches}",
                  f"trainer.global_batch_size={self.global_batch_size}",
                  f"trainer.train_schedule={self.schedule}",
                  f"trainer.pipeline_chunks={self.chunks if self.chunks > 1 else 'null'}",
                  f"trainer.activation_checkpointing={checkpointing[self.recompute]}",
                  "trainer.activation_checkpoint_ratio=null",
                  f"trainer.zero_optimization={str(self.zero_stage > 0).lower()}",
                  f"trainer.zero_stage={max(self.zero_stage, 1)}",
                  f"trainer.sequence_parallel={str(self.sequence_parallel).lower()}"]
        if self.recompute == RECOMPUTE_SELECTIVE:
            values.insert(9, f"trainer.selective_recompute={SELECTIVE_POLICY}")
        return values

    def to_json(self) -> dict:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "micro_batch_size": self.micro_batch_size,
                "num_microbatches": self.num_microbatches, "schedule": self.schedule, "chunks": self.chunks,
                "recompute": self.recompute, "zero_stage": self.zero_stage,
                "sequence_parallel": self.sequence_parallel}

    @classmethod
    def from_json(cls, data: dict) -> Layout:
        """The layout :meth:`to_json` wrote; plans written when recomputation was on or off (a bool) read as
        ``"full"`` or ``"off"``."""
        values = dict(data)
        if isinstance(values.get("recompute"), bool):
            values["recompute"] = RECOMPUTE_FULL if values["recompute"] else RECOMPUTE_OFF
        return cls(**values)
