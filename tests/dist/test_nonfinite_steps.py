"""A step whose loss or gradient is not finite on any rank is skipped on every rank, in every precision."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest
import torch

from merak.distributed import groups
from merak.distributed.launch import spawn_workers
from merak.optim.distributed import DistributedOptimizer
from merak.optim.schedule import make_optimizer
from merak.optim.settings import OptimizerSettings, PrecisionSettings, ZeroSettings

pytestmark = pytest.mark.dist

# (the rank whose loss is NaN, the rank whose gradient is NaN) for each step; None: finite everywhere.
STEPS = [(1, None), (None, 0), (None, None), (0, None)]


def _worker(out_dir: str, zero_stage: int, fp16: bool) -> None:
    state = groups.init(dp=2, timeout_s=60)
    rank = state.rank
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(4, 3))
    precision = PrecisionSettings(fp16=fp16, initial_scale_power=4, min_loss_scale=1.0)
    optimizer = DistributedOptimizer(
        [weight], dp_group=state.dp_group, dp_size=2, dp_rank=rank, norm_group=state.model_parallel_group,
        norm_group_size=1, counted=[True], precision=precision,
        zero=ZeroSettings(zero_optimization=zero_stage > 0, zero_stage=zero_stage or 1),
        make_optimizer=functools.partial(make_optimizer, settings=OptimizerSettings(learning_rate=0.1)))
    records = []
    for bad_loss, bad_grad in STEPS:
        optimizer.zero_grad()
        grad = torch.full((4, 3), float(rank + 1))
        if bad_grad == rank:
            grad[1, 2] = math.nan
        weight.grad = grad
        optimizer.reduce_gradients()
        loss = torch.tensor(math.nan if bad_loss == rank else 1.0)
        outcome = optimizer.step(max_grad_norm=1.0, loss=loss)
        records.append({"skipped": outcome.skipped, "loss_finite": outcome.loss_finite,
                        "scale_may_cure": outcome.scale_may_cure, "weight": weight.detach().tolist(),
                        "finite": bool(torch.isfinite(weight).all())})
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(records))
    groups.shutdown()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("zero_stage,fp16", [(0, False), (1, False), (0, True)], ids=["fp32", "zero1", "fp16"])
def test_nonfinite_steps_are_skipped_on_every_rank(tmp_path, zero_stage, fp16):
    spawn_workers(_worker, world_size=2, args=(str(tmp_path), zero_stage, fp16))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    torch.manual_seed(0)
    initial = torch.randn(4, 3)  # the workers' initial weight
    for index, (bad_loss, bad_grad) in enumerate(STEPS):
        expect_skip = bad_loss is not None or bad_grad is not None
        for records in ranks:
            record = records[index]
            assert record["skipped"] is expect_skip, (index, record)
            assert record["loss_finite"] is (bad_loss is None)
            assert record["finite"]
            # Only a gradient overflow in fp16 (finite loss, scale above its minimum) may be cured.
            assert record["scale_may_cure"] is (fp16 and bad_grad is not None and bad_loss is None)
        assert ranks[0][index]["weight"] == ranks[1][index]["weight"]  # replicas stay equal
    # Skipped steps change nothing; the one finite step (index 2) updates.
    assert torch.equal(torch.tensor(ranks[0][1]["weight"]), initial)
    assert not torch.equal(torch.tensor(ranks[0][2]["weight"]), initial)
    assert ranks[0][3]["weight"] == ranks[0][2]["weight"]
