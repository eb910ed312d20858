"""Learning-rate schedules from the optimizer section: warmup, decay, and the floor ``min_lr_rate`` puts
under linear and cosine decay (Hugging Face's name)."""

from __future__ import annotations

import math

import pytest
import torch

from merak.config import TrainerSettings
from merak.optim.schedule import build_lr_scheduler, lr_factor
from merak.optim.settings import OptimizerSettings


@pytest.mark.parametrize("kind,middle", [("linear", 0.5), ("cosine", 0.5 * (1 + math.cos(math.pi / 2)))])
def test_decay_ends_at_the_floor(kind, middle):
    plain = OptimizerSettings(lr_scheduler_type=kind, warmup_steps=2)
    floored = OptimizerSettings(lr_scheduler_type=kind, warmup_steps=2, min_lr_rate=0.1)
    total = 12
    assert lr_factor(1, floored, total) == lr_factor(1, plain, total) == 0.5  # warmup is not floored
    assert lr_factor(2, floored, total) == lr_factor(2, plain, total) == 1.0
    assert lr_factor(7, plain, total) == pytest.approx(middle)
    assert lr_factor(7, floored, total) == pytest.approx(0.1 + 0.9 * middle)
    assert lr_factor(total, plain, total) == 0.0
    assert lr_factor(total, floored, total) == pytest.approx(0.1)


def test_the_scheduler_follows_the_section():
    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    settings = OptimizerSettings(lr_scheduler_type="linear", min_lr_rate=0.25)
    scheduler = build_lr_scheduler(optimizer, settings, total_steps=4)
    rates = []
    for _ in range(4):
        optimizer.step()
        scheduler.step()
        rates.append(optimizer.param_groups[0]["lr"])
    assert rates == pytest.approx([0.8125, 0.625, 0.4375, 0.25])


def test_the_floor_is_a_checked_trainer_setting():
    problems: list[str] = []
    assert TrainerSettings.from_flat({"min_lr_rate": 0.1}, problems).optimizer.min_lr_rate == 0.1
    assert problems == []
    TrainerSettings.from_flat({"min_lr_rate": 1.5}, problems)
    assert problems == ["trainer.min_lr_rate=1.5 must be within [0, 1]"]
