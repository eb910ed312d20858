"""The energy figures a run reports: joules per step over all devices, per token (text) or per sample,
the mean power per device, and model FLOP per joule.

Pure arithmetic on what the meters measured (merak.energy.runtime gathers it), so that the per-step
lines of metrics.jsonl and the run summary compute their figures alike.
"""

from __future__ import annotations


def per_work(joules: float, samples: int, tokens_per_sample: int) -> dict[str, float]:
    """``joules`` per token where a sample is a sequence (``tokens_per_sample > 1``), else per sample
    (an image, a label): ``{"joules_per_token": ...}`` or ``{"joules_per_sample": ...}``."""
    if tokens_per_sample > 1:
        return {"joules_per_token": joules / (samples * tokens_per_sample)}
    return {"joules_per_sample": joules / samples}


def mean_power(joules: float, device_seconds: float) -> dict[str, float]:
    """``{"power_w": ...}``: the devices' energy over their summed measured time, i.e. the mean power of
    one device (equal to joules / step time / devices when the devices' steps take equally long);
    empty when no time was measured."""
    return {"power_w": joules / device_seconds} if device_seconds > 0 else {}


def step_figures(joules: float, device_seconds: float, *, samples: int, tokens_per_sample: int) -> dict[str, float]:
    """One step's figures: ``energy_j`` (all devices), ``joules_per_token`` or ``joules_per_sample`` and
    ``power_w`` (per device), from the step's energy and time summed over the devices."""
    return {"energy_j": joules, **per_work(joules, samples, tokens_per_sample), **mean_power(joules, device_seconds)}


def run_figures(joules_per_step: float, device_seconds_per_step: float, *, devices: int, samples: int,
                tokens_per_sample: int, model_flops_per_step: float | None) -> dict:
    """The run summary's figures from the mean step: ``joules_per_step`` (all devices), ``joules_per_token``
    or ``joules_per_sample``, ``power_w_per_device``, ``devices`` and ``flop_per_joule`` (model FLOPs
    of a step over its joules; None where the model's FLOPs are not known)."""
    power = mean_power(joules_per_step, device_seconds_per_step)
    return {"joules_per_step": joules_per_step, **per_work(joules_per_step, samples, tokens_per_sample),
            "power_w_per_device": power.get("power_w"), "devices": devices,
            "flop_per_joule": model_flops_per_step / joules_per_step
            if model_flops_per_step and joules_per_step > 0 else None}


__all__ = ["mean_power", "per_work", "run_figures", "step_figures"]
