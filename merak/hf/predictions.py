"""Collecting predictions from the last pipeline stages into one array, in dataset order."""

from __future__ import annotations

import numpy as np
import torch

from merak.distributed import groups
from merak.hf.loss import output_logits


def gather_predictions(session, kept: list, *, label_name: str, parallel_vocab: bool):
    """``(predictions, labels)`` as numpy arrays on every rank, in dataset order.

    ``kept`` is this rank's ``(microbatch, outputs)`` list from ``TrainingSession.evaluate``
    (step-major, microbatch-minor; empty off the last stage). The global order of evaluation
    steps is step, then dp replica, then microbatch. With vocabulary-parallel logits the tp
    slices are joined along the last dimension.
    """
    state = session.state
    grid, coords = state.grid, state.coordinates
    last = coords.pp == grid.pp - 1
    sends = last and (coords.tp == 0 or (parallel_vocab and grid.tp > 1))
    mine = []
    if sends:
        for batch, outputs in kept:
            labels = batch.get(label_name)
            mine.append((output_logits(outputs).detach().float().cpu(),
                         labels.cpu() if labels is not None and coords.tp == 0 else None))
    everyone = groups.gather_from_all({"coords": (coords.dp, coords.tp), "items": mine} if sends else None)
    by_replica: dict[int, dict[int, list]] = {}
    for entry in everyone:
        if entry is not None:
            dp_rank, tp_rank = entry["coords"]
            by_replica.setdefault(dp_rank, {})[tp_rank] = entry["items"]
    num_microbatches = session.settings.num_microbatches
    count = len(by_replica[0][0]) if by_replica else 0
    logits, labels = [], []
    for step in range(count // num_microbatches):
        for dp_rank in range(grid.dp):
            slices = by_replica[dp_rank]
            for m in range(num_microbatches):
                index = step * num_microbatches + m
                parts = [slices[t][index][0] for t in sorted(slices)]
                logits.append(torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0])
                labels.append(slices[0][index][1])
    if not logits:
        return np.zeros((0,)), None
    predictions = torch.cat(logits).numpy()
    label_array = torch.cat(labels).numpy() if all(x is not None for x in labels) else None
    return predictions, label_array
