"""A user model whose stage boundary carries a tuple/dict with non-tensor and variable-shape values.

The payload mixes a differentiable tensor, a skip connection inside a dict, an
int, a string, None, a bool mask and an integer tensor whose length changes
from microbatch to microbatch (so its shape is renegotiated), and training
still matches one process.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from merak.data.batching import BatchPlan, MicrobatchLoader, stack_samples
from merak.distributed import groups
from merak.distributed.launch import spawn_workers
from merak.engine import PipelineEngine
from merak.optim.schedule import build_lr_scheduler, build_optimizer
from merak.optim.settings import OptimizerSettings

pytestmark = pytest.mark.dist

STEPS = 3
GLOBAL_BATCH = 8
OPTIONS = OptimizerSettings(learning_rate=1e-2, max_grad_norm=0.0, lr_scheduler_type="constant")


class SkipNet(nn.Module):
    """A plain model with a long skip connection."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.mid = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = torch.relu(self.inp(x))
        return self.out(torch.relu(self.mid(skip)) + skip)


class Front(nn.Module):
    def __init__(self, net: SkipNet) -> None:
        super().__init__()
        self.inp = net.inp

    def forward(self, batch):
        skip = torch.relu(self.inp(batch["x"]))
        positive = (batch["x"][:, 0] > 0).nonzero().flatten()  # length varies per microbatch
        return skip, {"skip": skip, "scale": 2, "note": "front", "none": None,
                      "mask": batch["x"] > 0, "positive": positive}


class Back(nn.Module):
    def __init__(self, net: SkipNet) -> None:
        super().__init__()
        self.mid = net.mid
        self.out = net.out

    def forward(self, payload):
        hidden, extras = payload
        assert extras["scale"] == 2 and extras["note"] == "front" and extras["none"] is None
        assert extras["mask"].dtype == torch.bool and extras["positive"].dtype == torch.int64
        assert not extras["positive"].requires_grad
        return self.out(torch.relu(self.mid(hidden)) + extras["skip"])


class DataFront(nn.Module):
    """A stage without parameters that passes the data on: the next stage's inputs need no gradient."""

    def forward(self, batch):
        return batch["x"]


class WholeBack(nn.Module):
    def __init__(self, net: SkipNet) -> None:
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(x)


STAGES = {"front/back": lambda net: [Front(net), Back(net)], "data/whole": lambda net: [DataFront(), WholeBack(net)]}


def mse_loss(output, batch):
    return F.mse_loss(output, batch["target"])


def build_dataset():
    generator = torch.Generator().manual_seed(7)
    return [{"x": torch.randn(8, generator=generator), "target": torch.randn(4, generator=generator)}
            for _ in range(64)]


def _train(out_dir: str, schedule: str, stages: str = "front/back") -> None:
    torch.set_num_threads(1)
    state = groups.init(pp=2, timeout_s=120)
    try:
        torch.manual_seed(0)
        net = SkipNet()
        engine = PipelineEngine(model=net, stages=STAGES[stages](net), loss_fn=mse_loss, state=state,
                                schedule=schedule, num_microbatches=4, total_steps=STEPS, optimizer=OPTIONS)
        plan = BatchPlan(num_samples=64, micro_batch_size=2, num_microbatches=4, seed=3)
        loader = MicrobatchLoader(build_dataset(), plan)
        records = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(STEPS):
                result = engine.train_step(loader.load_step(step))
                records.append({"loss": result.loss,
                                "grads": {n: p.grad.clone() for n, p in engine.named_parameters()}})
        torch.save(records, Path(out_dir) / f"rank{state.rank}.pt")
        Path(out_dir, f"warnings{state.rank}.txt").write_text("\n".join(str(w.message) for w in caught))
    finally:
        groups.shutdown()


def _reference() -> list[dict]:
    torch.manual_seed(0)
    net = SkipNet()
    constant = OptimizerSettings(learning_rate=OPTIONS.learning_rate, lr_scheduler_type="constant")
    optimizer = build_optimizer(net.named_parameters(), constant)
    scheduler = build_lr_scheduler(optimizer, constant, total_steps=STEPS)
    dataset = build_dataset()
    plan = BatchPlan(num_samples=64, micro_batch_size=GLOBAL_BATCH, num_microbatches=1, seed=3)
    records = []
    for step in range(STEPS):
        batch = stack_samples([dataset[i] for i in plan.global_batch(step).tolist()])
        optimizer.zero_grad()
        loss = mse_loss(net(batch["x"]), batch)
        loss.backward()
        records.append({"loss": loss.item(), "grads": {n: p.grad.clone() for n, p in net.named_parameters()}})
        optimizer.step()
        scheduler.step()
    return records


def _check_against_reference(tmp_path) -> None:
    reference = _reference()
    names = set()
    for rank in range(2):
        for got, want in zip(torch.load(tmp_path / f"rank{rank}.pt"), reference, strict=True):
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
            for name, grad in got["grads"].items():
                torch.testing.assert_close(grad, want["grads"][name], rtol=1e-5, atol=1e-7)
                names.add(name)
    assert names == {n for n, _ in SkipNet().named_parameters()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_mixed_payload_pipeline_matches_single_process(schedule, tmp_path):
    spawn_workers(_train, world_size=2, args=(str(tmp_path), schedule))
    _check_against_reference(tmp_path)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_a_stage_receiving_only_data_gets_its_weight_gradients(schedule, tmp_path):
    """The second stage's inputs need no gradient (the first passes the data on): a zero-bubble schedule
    must still compute its weights' gradients (torch's split backward alone computes none at all)."""
    spawn_workers(_train, world_size=2, args=(str(tmp_path), schedule, "data/whole"))
    _check_against_reference(tmp_path)
    # The first stage has no parameters: its schedule advances without torch's warning about the optimizer.
    assert "lr_scheduler.step()" not in (tmp_path / "warnings0.txt").read_text()
