"""The calibration's timing of what ends a step, among gloo processes: merak's gradient reduction in groups of
each size, every group at once, the clip and optimizer step with every process stepping, and merak's optimizer
ending a step without ZeRO and with ZeRO-1, and a small all-reduce in groups while the processes compute."""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from merak.autoplan import busy_collectives, calibrate
from merak.distributed.launch import spawn_workers

pytestmark = pytest.mark.dist

WORLD = 4


def _model(rank: int) -> nn.Module:
    """A small model whose gradients differ by rank (rank + 1 times one rank-free pattern)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 3))
    for index, param in enumerate(model.parameters()):
        param.grad = (rank + 1) * torch.arange(param.numel(), dtype=torch.float32).reshape(param.shape) + index
    return model


def _worker(out_dir: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    try:
        model = _model(rank)
        reductions = calibrate._gradient_all_reduces(model)
        weights_before = [p.detach().clone() for p in model.parameters()]
        steps = calibrate._optimizer_steps(model)
        grads = [p.grad.flatten().tolist() for p in model.parameters()]
        moved = all(not torch.equal(before, p) for before, p in zip(weights_before, model.parameters()))
        weights_before = [p.detach().clone() for p in model.parameters()]
        zero = calibrate._zero_step_ends(model)
        zero_moved = all(not torch.equal(before, p) for before, p in zip(weights_before, model.parameters()))
        weights = [p.detach().flatten().tolist() for p in model.parameters()]
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w", encoding="utf-8") as handle:
        json.dump({**reductions, "optimizer_s": steps, "moved": moved, "zero_step_ends_s": zero,
                   "zero_moved": zero_moved, "weights": weights, "grads": grads}, handle)


@pytest.mark.timeout(120)
def test_gradients_are_reduced_in_every_group_size_and_the_optimizer_steps(tmp_path):
    spawn_workers(_worker, world_size=WORLD, args=(str(tmp_path),), start_method="fork")
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert calibrate.group_sizes(WORLD) == [2, 4]
    for report in reports:
        assert sorted(report["gradient_all_reduces_s"]) == ["2", "4"]
        assert all(len(runs) == calibrate.GRADIENT_ALL_REDUCES and min(runs) > 0
                   for runs in report["gradient_all_reduces_s"].values())
        assert report["gradient_all_reduce_bytes"] == sum(p.numel() for p in _model(0).parameters()) * 4
        assert len(report["optimizer_s"]) == calibrate.CONCURRENT_OPTIMIZER_STEPS and min(report["optimizer_s"]) > 0
        assert report["moved"]
    # Each reduction averaged within its group: the pairs (0, 1) and (2, 3) first, then all four, so every
    # rank ends with the mean over all ranks (a mean of means of equal groups), (1+2+3+4)/4 = 2.5 times the
    # pattern, as a data-parallel group's reduction leaves it.
    expected = [(2.5 * torch.arange(p.numel(), dtype=torch.float32) + index).tolist()
                for index, p in enumerate(_model(0).parameters())]
    for report in reports:
        for got, want in zip(report["grads"], expected):
            assert got == pytest.approx(want, rel=1e-6)


def test_group_sizes_divide_the_processes():
    assert calibrate.group_sizes(1) == []
    assert calibrate.group_sizes(2) == [2]
    assert calibrate.group_sizes(6) == [2, 3, 6]
    assert calibrate.group_sizes(8) == [2, 4, 8]


@pytest.mark.timeout(120)
def test_zero_and_plain_step_ends_are_timed_in_turns_in_every_group_size(tmp_path):
    spawn_workers(_worker, world_size=WORLD, args=(str(tmp_path),), start_method="fork")
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    fewest, most = calibrate.ZERO_STEP_ENDS
    for report in reports:
        assert sorted(report["zero_step_ends_s"]) == ["2", "4"]
        for size, pairs in report["zero_step_ends_s"].items():
            # As many pairs on every process (each pair's collectives need all of them).
            assert fewest <= len(pairs) <= most and len(pairs) == len(reports[0]["zero_step_ends_s"][size])
            assert all(len(pair) == 2 and min(pair) > 0 for pair in pairs)
        assert report["zero_moved"]
    # Both optimizers updated the weights from gradients reduced over their groups (ZeRO-1 gathering each
    # process's share back): the ranks of a pair hold the same weights.
    for first, second in ((0, 1), (2, 3)):
        for mine, theirs in zip(reports[first]["weights"], reports[second]["weights"]):
            assert mine == pytest.approx(theirs, rel=1e-6)


def test_the_zero_difference_is_the_median_over_repetitions_of_the_slowest_processes():
    # Two ranks, three repetitions of (plain, ZeRO-1): the slowest rank decides each, then the median.
    rank0 = [[1.0, 3.0], [2.0, 2.5], [1.0, 1.5]]
    rank1 = [[1.5, 2.0], [1.0, 4.0], [1.0, 1.0]]
    # Repetitions: max(1, 1.5)=1.5 vs max(3, 2)=3 -> 1.5; 2 vs 4 -> 2; 1 vs 1.5 -> 0.5.
    assert calibrate._zero_difference([rank0, rank1]) == pytest.approx(1.5)


SIMULATED_WAIT_S = 0.004  # per process in the group: what each small all-reduce is made to take


def _busy_worker(out_dir: str) -> None:
    """Times the busy collectives with each small all-reduce made to sleep in proportion to its group, and
    notes which ranks each group held."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    real_all_reduce, groups_seen = dist.all_reduce, set()

    def slow_all_reduce(tensor, *args, group=None, **kwargs):
        if tensor.numel() == busy_collectives.MESSAGE_ELEMENTS:
            ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(WORLD))
            groups_seen.add(ranks)
            time.sleep(SIMULATED_WAIT_S * len(ranks))
        return real_all_reduce(tensor, *args, group=group, **kwargs)

    try:
        busy_collectives.dist.all_reduce = slow_all_reduce
        waits = busy_collectives.time_busy_collectives(calibrate.group_sizes(WORLD))
        busy_groups, groups_seen = sorted(groups_seen), set()
        lone = busy_collectives.time_lone_collectives(calibrate.group_sizes(WORLD))
    finally:
        busy_collectives.dist.all_reduce = real_all_reduce
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w", encoding="utf-8") as handle:
        json.dump({"waits": waits, "groups": busy_groups, "lone": lone, "lone_groups": sorted(groups_seen)}, handle)


@pytest.mark.timeout(120)
def test_busy_collectives_time_what_an_all_reduce_adds_in_each_group_size(tmp_path):
    spawn_workers(_busy_worker, world_size=WORLD, args=(str(tmp_path),), start_method="fork")
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    # Each rank all-reduced in its own pair of consecutive ranks, then among all four.
    assert reports[0]["groups"] == [[0, 1], [0, 1, 2, 3]]
    assert reports[3]["groups"] == [[0, 1, 2, 3], [2, 3]]
    for report in reports:
        assert sorted(report["waits"]) == ["2", "4"]
        for size, wait in report["waits"].items():
            # What a collective adds over the computing alone: at least its sleep (the difference of two
            # timings, each the slowest process's), not much more on an idle machine.
            assert SIMULATED_WAIT_S * int(size) * 0.8 < wait < SIMULATED_WAIT_S * int(size) + 0.05
        # Alone: only the first pair computes and all-reduces (a group of all four is never alone); every rank
        # reports the pair's time.
        assert list(report["lone"]) == ["2"]
        assert SIMULATED_WAIT_S * 2 * 0.8 < report["lone"]["2"] < SIMULATED_WAIT_S * 2 + 0.05
    assert reports[0]["lone_groups"] == reports[1]["lone_groups"] == [[0, 1]]  # the pairs' warm-up aside ...
    assert reports[2]["lone_groups"] == reports[3]["lone_groups"] == [[2, 3]]  # ... the others never all-reduce
