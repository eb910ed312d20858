"""The optimizer, mixed-precision and ZeRO sections of the ``trainer`` config (Hugging Face /
DeepSpeed names). Each is the object its consumer receives: the engine takes the optimizer section,
merak.optim.precision and merak.optim.distributed the precision and ZeRO sections."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from merak.core.fields import finite, non_negative, non_negative_finite, positive, positive_finite, setting

LR_SCHEDULES = ("linear", "cosine", "constant", "constant_with_warmup")
OPTIMIZERS = ("adamw_torch", "sgd", "adafactor")
# Elementwise optimizers update a flat shard of a tensor exactly as they update the whole tensor,
# so ZeRO may cut parameters anywhere; the others need zero_allow_untested_optimizer.
ZERO_TESTED_OPTIMIZERS = ("adamw_torch", "sgd")
NOT_ELEMENTWISE_WARNING = "is not elementwise, so ZeRO's flat pieces change its updates"
ZERO_STAGES = (0, 1, 2, 3)  # off, optimizer state sharded, gradients too, parameters too
GRAD_REDUCE_DTYPES = ("float32", "bfloat16")
ZERO3_WITH_COMPILE = ("trainer.zero_stage=3 gathers each stage part's parameters in module hooks around the part, "
                      "which trainer.torch_compile's compiled graphs do not run: compile without ZeRO-3 "
                      "(zero_stage 1 or 2) or run eagerly")


@dataclass(frozen=True)
class OptimizerSettings:
    """The optimizer, its learning-rate schedule, clipping and the non-finite-step guard."""

    optim: str = setting("adamw_torch", "adamw_torch | sgd | adafactor")
    learning_rate: float = setting(5e-5, "peak learning rate", check=non_negative_finite,
                                   requirement="must be a finite number >= 0")
    weight_decay: float = setting(0.0, "decoupled weight decay", check=non_negative_finite,
                                  requirement="must be a finite number >= 0")
    adam_beta1: float = setting(0.9, "Adam's first-moment decay", check=lambda v: 0 <= v < 1,
                                requirement="must be within [0, 1)")
    adam_beta2: float = setting(0.999, "Adam's second-moment decay", check=lambda v: 0 <= v < 1,
                                requirement="must be within [0, 1)")
    # Adam divides by sqrt(v) + epsilon: 0 turns a parameter with no gradient yet into NaN.
    adam_epsilon: float = setting(1e-8, "Adam's epsilon", check=positive_finite,
                                  requirement="must be a finite number > 0")
    max_grad_norm: float = setting(1.0, "clip the global gradient norm to this",
                                   check=non_negative_finite,
                                   requirement="must be a finite number >= 0 (0: no clipping)")
    lr_scheduler_type: str = setting("linear", "linear | cosine | constant | constant_with_warmup")
    warmup_steps: int = setting(0, "steps of linear warmup (0: warmup_ratio decides)", check=non_negative,
                                requirement="must be an integer >= 0")
    warmup_ratio: float = setting(0.0, "warmup as a fraction of the run, when warmup_steps is 0",
                                  check=lambda v: 0 <= v <= 1, requirement="must be within [0, 1]")
    min_lr_rate: float = setting(0.0, "linear and cosine decay end at this fraction of learning_rate "
                                      "(Hugging Face's min_lr_rate)",
                                 check=lambda v: 0 <= v <= 1, requirement="must be within [0, 1]")
    max_consecutive_skipped_steps: int = setting(
        3, "a step whose loss or gradient norm is not finite is skipped on every rank; after this many in a "
           "row the run stops (fp16 overflows a smaller loss scale may cure do not count)",
        check=positive, requirement="must be a positive integer")

    def problems(self) -> list[str]:
        """Unknown optimizer or schedule names."""
        problems = []
        if self.lr_scheduler_type not in LR_SCHEDULES:
            problems.append(f"trainer.lr_scheduler_type={self.lr_scheduler_type!r} is unknown; choose one of "
                            f"{', '.join(LR_SCHEDULES)}")
        if self.optim not in OPTIMIZERS:
            problems.append(f"trainer.optim={self.optim!r}; choose one of {', '.join(OPTIMIZERS)}")
        return problems

    def warmup_steps_for(self, steps: int) -> int:
        """warmup_steps if set, else warmup_ratio x steps (as the Hugging Face Trainer)."""
        if self.warmup_steps > 0:
            return self.warmup_steps
        return math.ceil(self.warmup_ratio * steps)


@dataclass(frozen=True)
class PrecisionSettings:
    """Mixed precision and fp16 loss scaling (DeepSpeed's names)."""

    fp16: bool = setting(False, "float16 parameters and activations, fp32 master weights, loss scaling")
    bf16: bool = setting(False, "bfloat16 parameters and activations, fp32 master weights")
    loss_scale: float = setting(0.0, "fp16: 0 = dynamic, otherwise this static scale", check=finite,
                                requirement="must be a finite number")
    initial_scale_power: int = setting(32, "the dynamic scale starts at 2**initial_scale_power")
    loss_scale_window: int = setting(1000, "clean steps before the dynamic scale doubles")
    hysteresis: int = setting(2, "overflows tolerated before the dynamic scale halves")
    min_loss_scale: float = setting(1.0, "the dynamic scale never drops below this", check=finite,
                                    requirement="must be a finite number")

    @property
    def dtype(self):
        """The torch dtype of parameters, activations and gradients."""
        import torch

        if self.fp16:
            return torch.float16
        if self.bf16:
            return torch.bfloat16
        return torch.float32

    @property
    def needs_master_weights(self) -> bool:
        """Whether the optimizer updates fp32 copies of low-precision parameters."""
        return self.fp16 or self.bf16

    def problems(self) -> list[str]:
        """Why these values cannot work together (empty when they can)."""
        problems = []
        if self.fp16 and self.bf16:
            problems.append("trainer.fp16 and trainer.bf16 are both true; choose one")
        if self.loss_scale < 0:
            problems.append(f"trainer.loss_scale={self.loss_scale} must be 0 (dynamic) or positive (static)")
        if not 0 <= self.initial_scale_power <= 64:
            problems.append(f"trainer.initial_scale_power={self.initial_scale_power} must be within 0..64")
        if self.loss_scale_window < 1:
            problems.append(f"trainer.loss_scale_window={self.loss_scale_window} must be at least 1")
        if self.hysteresis < 1:
            problems.append(f"trainer.hysteresis={self.hysteresis} must be at least 1")
        if self.min_loss_scale <= 0:
            problems.append(f"trainer.min_loss_scale={self.min_loss_scale} must be positive")
        return problems


@dataclass(frozen=True)
class ZeroSettings:
    """ZeRO sharding and the data-parallel gradient reduction (DeepSpeed's names; sizes in elements)."""

    zero_optimization: bool = setting(False, "shard optimizer state (stage 1), gradients (stage 2) and parameters "
                                             "(stage 3) over dp")
    zero_stage: int = setting(1, "1 | 2 | 3")
    # DeepSpeed configs write 5e8, hence int | float.
    zero_reduce_bucket_size: int | float = setting(500_000_000, "elements per gradient reduce-scatter")
    zero_allgather_bucket_size: int | float = setting(500_000_000,
                                                      "elements per parameter all-gather after the step")
    prescale_gradients: bool = setting(False, "divide gradients by dp before the sum (else after)")
    gradient_predivide_factor: float = setting(
        1.0, "without prescaling: divide by this before the sum, by dp/this after", check=positive_finite,
        requirement="must be positive and finite")
    zero_allow_untested_optimizer: bool = setting(False, "allow ZeRO with a non-elementwise optimizer "
                                                         "(adafactor)")
    overlap_grad_reduce: bool = setting(True, "start each bucket's data-parallel reduction during the stage's last "
                                              "backward, as soon as its gradients are final (ZeRO 0 and 1; "
                                              "ZeRO-2 reduces during every backward)")
    grad_bucket_mb: float = setting(25.0, "MiB of gradients per data-parallel all-reduce bucket (ZeRO 0) and per "
                                          "overlapped bucket (ZeRO 0 and 1); tied weights' sums too",
                                    check=positive_finite, requirement="must be positive and finite")
    grad_reduce_dtype: str = setting("float32", "float32 | bfloat16: the dtype gradients are summed over dp in "
                                                "(bfloat16 halves the traffic; the sums round to 8 bits of "
                                                "mantissa)", check=lambda value: value in GRAD_REDUCE_DTYPES,
                                     requirement="must be float32 or bfloat16")

    @property
    def stage(self) -> int:
        """The ZeRO stage in effect: 0 when zero_optimization is off."""
        return self.zero_stage if self.zero_optimization else 0

    @property
    def bucket_bytes(self) -> int:
        """Bytes per gradient bucket (``grad_bucket_mb``)."""
        return max(1, int(self.grad_bucket_mb * 2**20))

    @property
    def reduce_dtype(self) -> torch.dtype:
        """The dtype of the data-parallel sums."""
        return getattr(torch, self.grad_reduce_dtype)

    @property
    def reduce_bucket_elements(self) -> int:
        """Elements per gradient reduction (the setting, as a whole number)."""
        return int(self.zero_reduce_bucket_size)

    @property
    def allgather_bucket_elements(self) -> int:
        """Elements per parameter all-gather after the step (the setting, as a whole number)."""
        return int(self.zero_allgather_bucket_size)

    def problems(self, optim: str) -> list[str]:
        """What is wrong with these values for optimizer ``optim``."""
        problems = []
        if self.zero_optimization:  # zero_stage is unused (and unchecked) with ZeRO off
            if self.zero_stage not in ZERO_STAGES[1:]:
                problems.append(f"trainer.zero_stage={self.zero_stage!r}: stages 1 (optimizer state), 2 "
                                f"(gradients too) and 3 (parameters too) are supported")
            if optim in OPTIMIZERS and optim not in ZERO_TESTED_OPTIMIZERS and not self.zero_allow_untested_optimizer:
                problems.append(f"trainer.optim={optim} {NOT_ELEMENTWISE_WARNING}; use "
                                f"{' or '.join(ZERO_TESTED_OPTIMIZERS)}, or set "
                                f"trainer.zero_allow_untested_optimizer=true to accept that")
        for name in ("zero_reduce_bucket_size", "zero_allgather_bucket_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
                    or value < 1 or value != int(value):
                problems.append(f"trainer.{name}={value!r} must be a positive whole number of elements")
        if self.prescale_gradients and self.gradient_predivide_factor != 1.0:
            problems.append("trainer.gradient_predivide_factor applies only without prescaling: set "
                            "trainer.prescale_gradients=false or gradient_predivide_factor=1.0")
        return problems
