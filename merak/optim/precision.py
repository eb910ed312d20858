"""Mixed precision: the compute dtype and fp16 loss scaling (static or dynamic).

Parameters and activations are held in fp16 or bf16, the optimizer updates
fp32 master weights (see merak.optim.distributed). fp16 needs the loss scaled
so small gradients do not flush to zero; the dynamic scaler halves the scale
on overflow and doubles it after ``loss_scale_window`` clean steps.
"""

from __future__ import annotations

from merak.optim.settings import PrecisionSettings


class LossScaler:
    """The loss scale of one run: fixed, or dynamic as DeepSpeed's (same fields, same updates).

    ``update(overflow)`` is called once per step with the overflow flag every rank
    agreed on, so every rank keeps the same scale.
    """

    def __init__(self, options: PrecisionSettings) -> None:
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
