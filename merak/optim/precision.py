"""Mixed precision: the compute dtype and fp16 loss scaling (static or dynamic).

Parameters and activations are held in fp16 or bf16, the optimizer updates
fp32 master weights (see merak.optim.distributed). fp16 needs the loss scaled
so small gradients do not flush to zero; the dynamic scaler halves the scale
on overflow and doubles it after ``loss_scale_window`` clean steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from merak.optim.settings import PrecisionSettings


@dataclass(frozen=True)
class PrecisionOptions:
    """Mixed-precision options of the optimizer (names and defaults as in the config's PrecisionSettings).

    Attributes:
        fp16: parameters and activations in float16, with loss scaling.
        bf16: parameters and activations in bfloat16 (no loss scaling needed).
        loss_scale: 0 = dynamic loss scaling, otherwise this fixed scale.
        initial_scale_power: the dynamic scale starts at 2**initial_scale_power.
        loss_scale_window: clean steps before the dynamic scale doubles.
        hysteresis: overflows tolerated before the dynamic scale halves.
        min_loss_scale: the dynamic scale never drops below this.
    """

    fp16: bool = PrecisionSettings.fp16
    bf16: bool = PrecisionSettings.bf16
    loss_scale: float = PrecisionSettings.loss_scale
    initial_scale_power: int = PrecisionSettings.initial_scale_power
    loss_scale_window: int = PrecisionSettings.loss_scale_window
    hysteresis: int = PrecisionSettings.hysteresis
    min_loss_scale: float = PrecisionSettings.min_loss_scale

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of parameters, activations and gradients."""
        if self.fp16:
            return torch.float16
        if self.bf16:
            return torch.bfloat16
        return torch.float32

    @property
    def needs_master_weights(self) -> bool:
        return self.fp16 or self.bf16


class LossScaler:
    """The loss scale of one run: fixed, or dynamic as DeepSpeed's (same fields, same updates).

    ``update(overflow)`` is called once per step with the overflow flag every rank
    agreed on, so every rank keeps the same scale.
    """

    def __init__(self, options: PrecisionOptions) -> None:
        self.dynamic = options.fp16 and options.loss_scale == 0
        if not options.fp16:
            self.scale = 1.0
        elif self.dynamic:
            self.scale = float(2 ** options.initial_scale_power)
        else:
            self.scale = float(options.loss_scale)
        self.window = options.loss_scale_window
        self.hysteresis = options.hysteresis
        self.min_scale = float(options.min_loss_scale)
        self.steps = 0
        self.last_overflow_step = -1
        self.hysteresis_left = options.hysteresis

    def update(self, overflow: bool) -> None:
        """Advance one step: shrink after overflows (past the hysteresis), grow after a clean window."""
        if self.dynamic:
            if overflow:
                if self.hysteresis == 1 or self.hysteresis_left == 1:
                    self.scale = max(self.scale / 2.0, self.min_scale)
                else:
                    self.hysteresis_left -= 1
                self.last_overflow_step = self.steps
            elif (self.steps - self.last_overflow_step) % self.window == 0:
                self.hysteresis_left = self.hysteresis
                self.scale *= 2.0
        self.steps += 1

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "steps": self.steps, "last_overflow_step": self.last_overflow_step,
                "hysteresis_left": self.hysteresis_left}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self.steps = int(state["steps"])
        self.last_overflow_step = int(state["last_overflow_step"])
        self.hysteresis_left = int(state["hysteresis_left"])
