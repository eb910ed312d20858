"""The planner's calibration: fitting the rate-based estimate to timings, and processes sharing cores."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from merak.autoplan.calibrate import Calibration, fit_scales
from merak.shard.costs import MachineRates

RATES = MachineRates(flops_per_s=1e9, bytes_per_s=1e9, seconds_per_op=1e-3)


def test_two_sizes_fit_work_and_launch_scales_exactly():
    # True costs: work 2x its estimate, launches 0.5x. Estimates (work, launches) at microbatch 1 and 8.
    small, large = (1.0, 4.0), (8.0, 4.0)
    measured = [2 * work + 0.5 * launches for work, launches in (small, large)]
    work_scale, launch_scale = fit_scales((*small, measured[0]), (*large, measured[1]))
    assert work_scale == pytest.approx(2.0) and launch_scale == pytest.approx(0.5)


def test_one_size_or_an_impossible_line_falls_back_to_one_scale():
    assert fit_scales((1.0, 1.0, 4.0), None) == (pytest.approx(2.0), pytest.approx(2.0))
    # A larger microbatch measured faster (noise): no line with positive scales, one scale from the first.
    assert fit_scales((1.0, 1.0, 4.0), (2.0, 1.0, 3.0)) == (pytest.approx(2.0), pytest.approx(2.0))


def test_a_step_growing_faster_than_its_work_gets_no_launch_scale():
    # Work 1 -> 4 (x4) but time 1 -> 5 (x5): the line would need a negative launch scale.
    work_scale, launch_scale = fit_scales((1.0, 1.0, 1.0), (4.0, 1.0, 5.0))
    assert launch_scale == 0.0
    assert work_scale == pytest.approx((1 * 1 + 4 * 5) / (1 + 16))


def test_calibrated_seconds_scale_each_part():
    calibration = Calibration(work_scale=2.0, launch_scale=3.0)
    # 1e9 FLOPs (1 s) + 1e9 bytes (1 s) of work, 10 operations (10 ms) of launches.
    assert calibration.seconds(RATES, 1e9, 1e9, 10) == pytest.approx(2 * 2.0 + 3 * 0.01)
    assert Calibration().seconds(RATES, 1e9, 0, 0) == pytest.approx(1.0)


def test_slowdown_is_the_cores_share_times_what_sharing_adds():
    assert Calibration().slowdown(4, cores=2) is None
    # 4 processes on 2 cores measured 2.5x: 2x from the cores' share, 1.25x from sharing memory and caches.
    measured = Calibration(processes=4, concurrent_slowdown=2.5)
    assert measured.slowdown(1, cores=2) == pytest.approx(1.0)
    assert measured.slowdown(4, cores=2) == pytest.approx(2.5)
    assert measured.slowdown(2, cores=2) == pytest.approx(1 + 0.25 / 3)  # cores enough, a third of the sharing
    assert measured.slowdown(3, cores=2) == pytest.approx(1.5 * (1 + 0.25 * 2 / 3))
    assert measured.slowdown(0.5, cores=2) == 1.0  # never faster than alone


def test_loading_is_linear_in_the_microbatch_between_and_beyond_the_timed_sizes():
    calibration = Calibration(microbatch_load_seconds=((1, 0.001), (4, 0.002), (16, 0.006)))
    assert calibration.load_seconds(4) == pytest.approx(0.002)
    assert calibration.load_seconds(2) == pytest.approx(0.001 + 0.001 / 3)
    assert calibration.load_seconds(8) == pytest.approx(0.002 + 0.004 / 3)
    assert calibration.load_seconds(32) == pytest.approx(0.006 + 0.004 * 16 / 12)  # along the last two
    assert Calibration(microbatch_load_seconds=((4, 0.002),)).load_seconds(8) == pytest.approx(0.004)
    assert Calibration().load_seconds(8) == 0.0
    # Never below nothing, however steep the first two.
    assert Calibration(microbatch_load_seconds=((2, 0.001), (4, 0.01))).load_seconds(1) == 0.0


def test_a_busy_groups_ring_step_is_its_all_reduce_over_its_steps():
    calibration = Calibration(processes=8, busy_collectives=((2, 0.004), (4, 0.012), (8, 0.028)))
    assert calibration.hop_seconds(2) == pytest.approx(0.002)  # two ring steps
    assert calibration.hop_seconds(4) == pytest.approx(0.002)  # six
    assert calibration.hop_seconds(8) == pytest.approx(0.002)  # fourteen
    assert calibration.hop_seconds(1) is None and calibration.hop_seconds(16) is None
    assert Calibration().hop_seconds(2) is None


def test_size_factors_interpolate_in_log_size_and_hold_beyond():
    calibration = Calibration(size_factors=((1, 1.0), (4, 1.0), (16, 0.6)))
    assert calibration.size_factor(1) == pytest.approx(1.0)
    assert calibration.size_factor(4) == pytest.approx(1.0)
    assert calibration.size_factor(8) == pytest.approx(0.8)  # halfway between 4 and 16 in log2
    assert calibration.size_factor(64) == pytest.approx(0.6)
    assert Calibration().size_factor(8) == 1.0


def test_a_timing_is_the_median_of_its_runs_not_the_fastest(monkeypatch):
    import merak.autoplan.calibrate as calibrate

    clock = {"now": 0.0}
    durations = iter([9.0, 1.0, 5.0, 2.0])  # a warm-up, then three runs

    def run() -> None:
        clock["now"] += next(durations)

    monkeypatch.setattr(calibrate.time, "perf_counter", lambda: clock["now"])
    assert calibrate._typical_of(run, repeats=3, seconds=0.0) == 2.0


class _TinyLM(torch.nn.Module):
    """An embedding, a layer and a head: a later pipeline stage starts after the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 8)
        self.layer = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 11)

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.embed

    def forward(self, input_ids):
        return self.head(torch.tanh(self.layer(self.embed(input_ids))))


def _tiny_recipe():
    """A spec and settings that build :class:`_TinyLM` on a fixed batch (what ``_model_steps`` reads)."""
    samples = [{"input_ids": torch.tensor([i % 11, (i + 3) % 11, (i + 5) % 11])} for i in range(8)]
    spec = SimpleNamespace(
        name="tiny", input_names=("input_ids",), build_model=lambda cfg: _TinyLM(),
        prepare_data=lambda data_cfg, model_cfg: None, load_dataset=lambda prepared, model_cfg: samples,
        collate=lambda rows: {"input_ids": torch.stack([row["input_ids"] for row in rows])},
        loss_fn=lambda logits, batch: torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                                                        batch["input_ids"].flatten()))
    settings = SimpleNamespace(model_cfg={}, data_cfg={}, trainer=SimpleNamespace(seed=0, input_names=None))
    return spec, settings


def _gradients(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}


def test_the_split_backward_computes_what_a_later_stage_computes_whole():
    import merak.autoplan.calibrate as calibrate

    spec, settings = _tiny_recipe()
    built = calibrate._model_steps(spec, settings, micro_batch_size=4)
    built.step()
    whole = _gradients(built.model)
    assert whole["embed.weight"] is not None  # outside a stage's run the model runs whole
    built.stage_step()
    stage = _gradients(built.model)
    assert stage["embed.weight"] is None  # a later stage starts after the embedding
    built.split_step()
    split = _gradients(built.model)
    assert split["embed.weight"] is None
    for name in ("layer.weight", "layer.bias", "head.weight", "head.bias"):
        torch.testing.assert_close(split[name], stage[name])
        torch.testing.assert_close(stage[name], whole[name])


def test_the_split_factor_compares_backwards_without_their_forward(monkeypatch):
    import merak.autoplan.calibrate as calibrate

    def stage() -> None: ...
    def split() -> None: ...
    def forward() -> None: ...

    built = calibrate._ModelSteps(model=torch.nn.Linear(1, 1), step=object(), stage_step=stage, split_step=split,
                                  forward=forward, load=object())
    times = {"stage": 0.010, "split": 0.014, "forward": 0.002}
    # Every run of a step takes its time: the three are timed in turns, each keeps its median.
    monkeypatch.setattr(calibrate, "_timed", lambda function: times[function.__name__])
    assert calibrate._split_factor(built) == pytest.approx((0.014 - 0.002) / (0.010 - 0.002))
    times["split"] = 0.009  # faster than whole: noise, not a gain
    assert calibrate._split_factor(built) == 1.0


def test_a_model_without_input_embeddings_or_floating_inputs_is_not_split():
    import merak.autoplan.calibrate as calibrate

    spec, settings = _tiny_recipe()
    spec.build_model = lambda cfg: torch.nn.Sequential(torch.nn.Embedding(11, 11))
    built = calibrate._model_steps(spec, settings, micro_batch_size=2)
    assert built.stage_step is None and built.split_step is None


def test_the_sizes_are_timed_in_turns_and_each_keeps_its_median(monkeypatch):
    import merak.autoplan.calibrate as calibrate

    # The machine is twice as slow in the first turn as in the others: timed in turns, both sizes see it.
    calls = _turns_of({"small": [2.0, 1.0, 1.0, 1.0], "large": [8.0, 4.0, 4.0, 4.0]}, monkeypatch)
    steps = [lambda: calls.append("small"), lambda: calls.append("large")]
    assert calibrate._in_turns(steps, rounds=3) == [1.0, 4.0]
    # A warm-up each, then one run each per turn: a fourth turn because the first did not agree with the
    # next two, and the medians are those of the last three.
    assert calls == ["small", "large"] + ["small", "large"] * 4


def _turns_of(speeds: dict[str, list[float]], monkeypatch) -> list[str]:
    """``_timed`` returning each named step's next time from ``speeds``; the calls made, in order."""
    import merak.autoplan.calibrate as calibrate

    calls: list[str] = []
    counts = dict.fromkeys(speeds, 0)

    def timed(step) -> float:
        step()
        name = calls[-1]
        counts[name] += 1
        return speeds[name][counts[name] - 1]

    monkeypatch.setattr(calibrate, "_timed", timed)
    monkeypatch.setattr(calibrate, "ALONE_MOST", 3)
    return calls


def test_a_slow_moment_on_one_size_is_timed_again_until_three_turns_agree(monkeypatch):
    import merak.autoplan.calibrate as calibrate

    # The large size is slow in the first two turns (the slow moment fell on it, not on the small one).
    calls = _turns_of({"small": [1.0] * 6, "large": [7.0, 7.5, 4.0, 4.1, 3.9, 4.0]}, monkeypatch)
    steps = [lambda: calls.append("small"), lambda: calls.append("large")]
    assert calibrate._in_turns(steps, rounds=3, most_rounds=6) == [1.0, 4.0]
    assert calls.count("large") == 1 + 5  # a warm-up, three turns, then two more until the last three agreed


def test_turns_that_never_agree_stop_at_the_most_and_keep_every_run(monkeypatch):
    import merak.autoplan.calibrate as calibrate

    calls = _turns_of({"small": [1.0, 2.0] * 3, "large": [4.0] * 6}, monkeypatch)
    steps = [lambda: calls.append("small"), lambda: calls.append("large")]
    assert calibrate._in_turns(steps, rounds=3, most_rounds=6) == [1.5, 4.0]
    assert calls.count("small") == 1 + 6  # a warm-up and the most turns
