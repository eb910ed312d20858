"""Mixed precision: the compute dtype and fp16 loss scaling (static or dynamic).

Parameters and activations are held in fp16 or bf16, the optimizer updates
fp32 master weights (see merak.optim.distributed). fp16 needs the loss scaled
so small gradients do not flush to zero; the dynamic scaler halves the scale
on overflow and doubles it after ``loss_scale_window`` clean steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrecisionOptions:
    """Mixed-precision settings (names as in MerakArguments).

    Attributes:
        fp16: parameters and activations in float16, with loss scaling.
        bf16: parameters and activations in bfloat16 (no loss scaling needed).
        loss_scale: 0 = dynamic loss scaling, otherwise this fixed scale.
        initial_scale_power: the dynamic scale starts at 2**initial_scale_power.
        loss_scale_window: clean steps before the dynamic scale doubles.
        hysteresis: overflows tolerated before the dynamic scale halves.
        min_loss_scale: the dynamic scale never drops below this.
    """

    fp16: bool = False
    bf16: bool = False
    loss_scale: float = 0.0
    initial_scale_power: int = 32
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0

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


def precision_problems(options: PrecisionOptions, prefix: str = "") -> list[str]:
    """Why these settings cannot work (empty when they can)."""
    problems = []
    if options.fp16 and options.bf16:
        problems.append(f"{prefix}fp16 and {prefix}bf16 are both true; choose one")
    if options.loss_scale < 0:
        problems.append(f"{prefix}loss_scale={options.loss_scale} must be 0 (dynamic) or positive (static)")
    if not 0 <= options.initial_scale_power <= 64:
        problems.append(f"{prefix}initial_scale_power={options.initial_scale_power} must be within 0..64")
    if options.loss_scale_window < 1:
        problems.append(f"{prefix}loss_scale_window={options.loss_scale_window} must be at least 1")
    if options.hysteresis < 1:
        problems.append(f"{prefix}hysteresis={options.hysteresis} must be at least 1")
    if options.min_loss_scale <= 0:
        problems.append(f"{prefix}min_loss_scale={options.min_loss_scale} must be positive")
    return problems


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
