"""The engine in one process (no process group): accumulation parity and hook calls."""

from __future__ import annotations

import pytest
import torch
from tiny_engine import Input, Net, loss_fn, single_process  # noqa: F401  (a fixture)

from merak.engine import PipelineEngine
from merak.optim.settings import OptimizerSettings
from merak.pipeline.hooks import InstructionEvent, PipelineHook
from merak.pipeline.stage import StageModule


class Recorder(PipelineHook):
    def __init__(self) -> None:
        self.events: list[str] = []

    def on_step_begin(self) -> None:
        self.events.append("step_begin")

    def on_step_end(self) -> None:
        self.events.append("step_end")

    def on_instruction_begin(self, event: InstructionEvent) -> None:
        self.events.append(f"{event.name}_begin")

    def on_instruction_end(self, event: InstructionEvent) -> None:
        self.events.append(f"{event.name}_end")


def test_microbatches_accumulate_to_the_full_batch_step(single_process):
    torch.manual_seed(0)
    net = Net()
    reference = Net()
    reference.load_state_dict(net.state_dict())
    recorder = Recorder()
    options = OptimizerSettings(learning_rate=0.1, max_grad_norm=0.5, lr_scheduler_type="linear", warmup_steps=1)
    engine = PipelineEngine(model=net, stages=[StageModule([Input(net), net.second])], loss_fn=loss_fn,
                            state=single_process, schedule="1f1b", num_microbatches=4, total_steps=3,
                            optimizer=options, hooks=[recorder])
    optimizer = torch.optim.AdamW(reference.parameters(), lr=0.1, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(step, 1) * (1 - (step - 1) / 2))
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(8, 6, generator=generator), torch.randn(8, 3, generator=generator)
        microbatches = [{"x": x[i:i + 2], "y": y[i:i + 2]} for i in range(0, 8, 2)]
        result = engine.train_step(microbatches)
        optimizer.zero_grad()
        loss = loss_fn(reference(x), {"y": y})
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        optimizer.step()
        scheduler.step()
        assert result.loss == pytest.approx(loss.item(), rel=1e-6)
        assert result.grad_norm == pytest.approx(norm.item(), rel=1e-5)
    for (name, got), want in zip(net.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
    per_step = ["step_begin"] + ["forward_begin", "forward_end", "backward_begin", "backward_end"] * 4 + ["step_end"]
    assert recorder.events == per_step * 3


def test_listeners_see_training_steps_only(single_process):
    """An evaluation step runs no listener (a frequency plan lists the training instructions only)."""
    net, recorder = Net(), Recorder()
    engine = PipelineEngine(model=net, stages=[StageModule([Input(net), net.second])], loss_fn=loss_fn,
                            state=single_process, schedule="1f1b", num_microbatches=2, total_steps=2,
                            hooks=[recorder])
    x, y = torch.randn(4, 6), torch.randn(4, 3)
    microbatches = [{"x": x[:2], "y": y[:2]}, {"x": x[2:], "y": y[2:]}]
    engine.evaluate_step(microbatches)
    assert recorder.events == []
    engine.train_step(microbatches)
    trained = list(recorder.events)
    assert trained == ["step_begin", *["forward_begin", "forward_end", "backward_begin", "backward_end"] * 2,
                       "step_end"]  # one stage's 1F1B
    engine.evaluate_step(microbatches)
    assert recorder.events == trained


def test_stage_count_must_match_pp(single_process):
    net = Net()
    with pytest.raises(ValueError, match="got 2 stages for pp=1"):
        PipelineEngine(model=net, stages=[Input(net), net.second], loss_fn=loss_fn, state=single_process,
                       schedule="1f1b", num_microbatches=1, total_steps=1)


def _engine(state, net: Net, total_steps: int = 6) -> PipelineEngine:
    options = OptimizerSettings(learning_rate=0.1, max_grad_norm=1.0, lr_scheduler_type="linear", warmup_steps=2)
    return PipelineEngine(model=net, stages=[StageModule([Input(net), net.second])], loss_fn=loss_fn,
                          state=state, schedule="1f1b", num_microbatches=2, total_steps=total_steps,
                          optimizer=options)


def test_a_nonfinite_loss_skips_the_step_in_fp32(single_process):
    torch.manual_seed(0)
    net = Net()
    engine = _engine(single_process, net)
    before = {name: p.detach().clone() for name, p in net.named_parameters()}
    x, y = torch.randn(4, 6), torch.randn(4, 3)
    y[3, 0] = float("inf")  # the loss of the second microbatch is inf, its gradients NaN
    result = engine.train_step([{"x": x[:2], "y": y[:2]}, {"x": x[2:], "y": y[2:]}])
    assert result.skipped and not result.scale_may_cure
    assert all(torch.equal(p, before[name]) for name, p in net.named_parameters())
    assert engine.lr_scheduler.last_epoch == 0  # the schedule did not move
    y[3, 0] = 0.0
    result = engine.train_step([{"x": x[:2], "y": y[:2]}, {"x": x[2:], "y": y[2:]}])
    assert not result.skipped and engine.lr_scheduler.last_epoch == 1


def test_resuming_replays_the_schedule_without_warnings(single_process, recwarn):
    engine = _engine(single_process, Net())
    engine.resume_at(3, lr_scheduler_steps=3)
    assert engine.lr_scheduler.last_epoch == 3
    assert engine.optimizer.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * (1 - 1 / 4))
    assert [str(w.message) for w in recwarn] == []


class FlopRecorder(PipelineHook):
    def __init__(self) -> None:
        self.flops: dict[str, int] = {}

    def on_instruction_end(self, event: InstructionEvent) -> None:
        self.flops[event.name] = event.flops


@pytest.mark.parametrize("ratio, recomputed", [(None, 288 + 144), (0.5, 288), (0.0, 0)])
def test_a_checkpointing_backward_carries_the_forward_it_runs_again(single_process, ratio, recomputed):
    """A simulated GPU charges each instruction its FLOPs: the backward of a stage checkpointing parts of its
    forward runs those parts again. Microbatch 2: the first part 2 x 2 x 6 x 12 FLOPs, the second 2 x 2 x 12 x 3."""
    from merak.pipeline.settings import ScheduleSettings

    net, recorder = Net(), FlopRecorder()
    schedule = ScheduleSettings(activation_checkpointing=ratio != 0.0, activation_checkpoint_ratio=ratio)
    engine = PipelineEngine(model=net, stages=[StageModule([Input(net), net.second])], loss_fn=loss_fn,
                            state=single_process, schedule="1f1b", num_microbatches=2, total_steps=1,
                            hooks=[recorder], recompute=schedule)
    x, y = torch.randn(4, 6), torch.randn(4, 3)
    engine.train_step([{"x": x[:2], "y": y[:2]}, {"x": x[2:], "y": y[2:]}])
    forward = 288 + 144
    assert recorder.flops == {"forward": forward, "backward": 2 * forward + recomputed}
