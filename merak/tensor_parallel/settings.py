"""The tensor-parallel section of the ``trainer`` config (used when ``parallel.tp > 1``; the model's
TP plan says which layers split how). Consumed by merak.tensor_parallel.options."""

from __future__ import annotations

from dataclasses import dataclass

from merak.core.fields import non_negative, setting


@dataclass(frozen=True)
class TensorParallelSettings:
    """How tensor-parallel ranks split the vocabulary, the activations and their communication."""

    parallel_vocab: bool = setting(False, "split the embedding and output layer by vocabulary "
                                          "(vocab-parallel loss)")
    sequence_parallel: bool = setting(False, "split activations between the blocks along sequence_dim")
    sequence_dim: int = setting(1, "the sequence dimension of hidden states ([batch, seq, hidden])",
                                check=non_negative, requirement="must be a non-negative integer")
    tp_overlapping_level: int = setting(0, "0 none | 1 overlap all-reduces with the matmuls of each linear "
                                           "pair | 2 sub-pipelined blocks")

    def options(self, *, plan, size: int, rank: int = 0):
        """The options a worker splits its model with."""
        from merak.tensor_parallel.options import TensorParallelOptions

        return TensorParallelOptions(plan=plan, size=size, rank=rank, parallel_vocab=self.parallel_vocab,
                                     sequence_parallel=self.sequence_parallel, sequence_dim=self.sequence_dim,
                                     overlap_level=self.tp_overlapping_level)

    def problems(self, *, plan, tp: int) -> list[str]:
        """What is wrong with these values for the recipe's ``plan`` at degree ``tp``, before any model
        exists (the plan is checked on the model before launch, see merak.runner.plan_before_launch)."""
        from merak.tensor_parallel.options import option_problems

        return option_problems(self.options(plan=plan, size=tp), prefix="trainer.")
