"""The tensor-parallel section of the ``trainer`` config (used when ``parallel.tp > 1``; the model's
TP plan says which layers split how). Each worker splits its model with it
(merak.tensor_parallel.options.TensorParallelSplit)."""

from __future__ import annotations

from dataclasses import dataclass

from merak.core.fields import non_negative, setting

OVERLAP_LEVELS = (0, 1, 2)  # the original's level 3 (across blocks) rewrote the model; not offered


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

    def problems(self, *, plan, tp: int, prefix: str = "trainer.") -> list[str]:
        """What is wrong with these values for the recipe's ``plan`` at degree ``tp``, before any model
        exists (the plan is checked on the model before launch, see merak.runner.plan_before_launch)."""
        problems = []
        level = self.tp_overlapping_level
        if level not in OVERLAP_LEVELS:
            problems.append(f"{prefix}tp_overlapping_level={level}; supported levels are "
                            f"{', '.join(map(str, OVERLAP_LEVELS[:-1]))} and {OVERLAP_LEVELS[-1]}")
        if tp == 1:
            return problems
        if plan is None:
            problems.append(f"tp={tp} needs a TP plan: this model has none (pass one, or describe it "
                            "with merak.set_tp_layer_lists)")
        if level == 2 and plan is not None and not plan.blocks:
            problems.append(f"{prefix}tp_overlapping_level=2 overlaps inside whole transformer blocks and this "
                            "model's TP plan names none; use level 1")
        return problems
