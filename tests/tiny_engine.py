"""A two-layer model cut into one stage of two parts, for single-process engine tests."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from merak.distributed import groups


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 12)
        self.second = nn.Linear(12, 3)

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))


class Input(nn.Module):
    """The first part of the stage: reads the microbatch."""

    def __init__(self, net: Net) -> None:
        super().__init__()
        self.first = net.first

    def forward(self, batch):
        return torch.tanh(self.first(batch["x"]))


def loss_fn(output, batch):
    return F.mse_loss(output, batch["y"])


@pytest.fixture
def single_process():
    """merak's groups in this process alone (no process group)."""
    state = groups.init()
    yield state
    groups.shutdown()
