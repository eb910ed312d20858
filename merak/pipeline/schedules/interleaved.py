"""Interleaved 1F1B (Megatron-LM): several model chunks per stage shorten the pipeline fill."""

from __future__ import annotations

from merak.pipeline.instructions import Backward, Forward, Instruction
from merak.pipeline.schedules.common import check_pipeline_args
from merak.pipeline.schedules.placement import place_communication

DEFAULT_CHUNKS = 2


def _position(k: int, num_stages: int, num_chunks: int, backward: bool) -> tuple[int, int]:
    """(microbatch, chunk) of the k-th forward (or backward) of a stage: groups of S microbatches
    go through chunk 0, then chunk 1, ...; backwards visit the chunks in reverse."""
    group, within = divmod(k, num_stages * num_chunks)
    chunk = within // num_stages
    if backward:
        chunk = num_chunks - 1 - chunk
    return group * num_stages + within % num_stages, chunk


def interleaved_1f1b_schedule(stage_id: int, num_stages: int, num_microbatches: int,
                              num_chunks: int = DEFAULT_CHUNKS) -> list[Instruction]:
    """Build one stage's interleaved 1F1B step with ``num_chunks`` virtual stages per rank.

    Rank ``s`` holds chunks ``s, s + S, s + 2S, ...`` of the model's ``V*S``
    pieces. Forwards take microbatches in groups of S through chunk 0, then
    the same group through chunk 1, and so on; backwards mirror that order.
    Warm-up is ``2(S - s - 1) + (V - 1) S`` forwards, then one forward one
    backward. The fill and drain bubble shrinks by V compared with 1F1B.

    Args:
        stage_id: This stage, ``0 <= stage_id < num_stages``.
        num_stages: Number of pipeline stages S (at least 2).
        num_microbatches: Number of microbatches M, a multiple of S.
        num_chunks: Model chunks per stage V (at least 2).

    Returns:
        The stage's instructions, ending with the gradient reductions and the optimizer step.

    Raises:
        ValueError: If the numbers are out of range, S < 2, V < 2 or M is not a multiple of S.
    """
    check_pipeline_args(stage_id, num_stages, num_microbatches)
    if num_stages < 2 or not isinstance(num_chunks, int) or num_chunks < 2:
        raise ValueError(f"interleaved_1f1b needs num_stages >= 2 and num_chunks >= 2, got "
                         f"num_stages={num_stages}, num_chunks={num_chunks!r}")
    if num_microbatches % num_stages:
        raise ValueError(f"interleaved_1f1b needs num_microbatches to be a multiple of num_stages: "
                         f"{num_microbatches} % {num_stages} != 0")
    total = num_microbatches * num_chunks
    warmup = min((num_stages - stage_id - 1) * 2 + (num_chunks - 1) * num_stages, total)

    def forward(k: int) -> Forward:
        return Forward(*_position(k, num_stages, num_chunks, backward=False))

    def backward(k: int) -> Backward:
        return Backward(*_position(k, num_stages, num_chunks, backward=True))

    order: list[Instruction] = [forward(k) for k in range(warmup)]
    for i in range(total - warmup):
        order += [forward(warmup + i), backward(i)]
    order += [backward(k) for k in range(total - warmup, total)]
    return place_communication(stage_id, num_stages, order, num_chunks=num_chunks)
