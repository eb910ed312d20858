"""Compiled stages in one process: settings, ranges, recomputation, fallback and the config fields.

Layouts across processes are in tests/dist/test_compiled_parity.py.
"""

from __future__ import annotations

import logging
from pathlib import Path

import hydra
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import merak
from merak.config import ConfigError, resolve_settings
from merak.distributed import groups
from merak.engine import PipelineEngine
from merak.hf.arguments import trainer_settings
from merak.optim.settings import OptimizerSettings, PrecisionSettings
from merak.pipeline.compiled import CompiledParts, eager_execution, range_module
from merak.pipeline.settings import CompileSettings, ScheduleSettings
from merak.pipeline.stage import StageModule
from recipes.gpt.spec import SPEC as GPT

CONF_DIR = str(Path(__file__).resolve().parents[2] / "recipes" / "gpt" / "conf")

COMPILED = CompileSettings(torch_compile=True)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return x + torch.tanh(self.norm(self.linear(x)))


class Head(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, 3)

    def forward(self, x):
        return self.linear(torch.relu(x))


def compose_gpt(*overrides: str):
    with hydra.initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return hydra.compose("train", overrides=list(overrides))


def _parts(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [Block(8), Block(8), Block(8), Head(8)]


def _loss(output, batch):
    return F.mse_loss(output, batch["y"])


class Input(nn.Module):
    def __init__(self, block: Block) -> None:
        super().__init__()
        self.block = block

    def forward(self, batch):
        return self.block(batch["x"])


@pytest.fixture
def single_process():
    state = groups.init()
    yield state
    groups.shutdown()


def test_contradicting_compile_settings_are_named():
    def contradiction(**values) -> str:
        (problem,) = CompileSettings(**values).contradictions()
        return problem

    assert contradiction(torch_compile=True, torch_compile_mode="fastest").startswith("torch_compile_mode='fastest'")
    assert "needs torch_compile=true" in contradiction(cuda_graphs=True)
    assert "applies to the inductor backend" in contradiction(torch_compile=True, torch_compile_backend="aot_eager",
                                                              torch_compile_mode="max-autotune")
    assert "contradicts" in contradiction(torch_compile=True, torch_compile_mode="max-autotune-no-cudagraphs",
                                          cuda_graphs=True)
    assert CompileSettings(torch_compile=True, cuda_graphs=True).contradictions() == []
    assert CompileSettings(torch_compile=True, cuda_graphs=True).effective_mode == "reduce-overhead"
    assert CompileSettings(torch_compile=True, torch_compile_mode="max-autotune",
                           cuda_graphs=True).effective_mode == "max-autotune"
    assert CompileSettings(torch_compile=True, torch_compile_mode="reduce-overhead").uses_cuda_graphs
    assert not CompileSettings(torch_compile=True).uses_cuda_graphs
    assert CompileSettings(torch_compile_backend="aot_eager").enabled  # naming a backend turns compiling on


def test_a_range_module_calls_its_parts_in_order_and_shares_them():
    parts = _parts()
    module = range_module(parts, 1, 3)
    x = torch.randn(2, 8)
    torch.testing.assert_close(module(x), parts[2](parts[1](x)), rtol=0, atol=0)
    assert {id(p) for p in module.parameters()} == {id(p) for part in parts[1:3] for p in part.parameters()}


def test_each_range_compiles_once_into_its_own_graph():
    parts = _parts()
    compiled = CompiledParts(parts, CompileSettings(torch_compile=True, torch_compile_backend="aot_eager"), "stage 0")
    x = torch.randn(2, 8)
    expected = parts[3](parts[2](parts[1](parts[0](x))))
    torch._dynamo.reset()
    torch.testing.assert_close(compiled.run(2, 4, compiled.run(0, 2, x)), expected)
    for _ in range(3):
        compiled.run(0, 4, x)
    assert sorted(compiled._ranges) == [(0, 2), (0, 4), (2, 4)]
    assert compiled.eager_ranges == []


def test_a_range_that_cannot_compile_warns_and_runs_eagerly(caplog):
    parts = _parts()
    # A backend torch ships for testing: it fails on any graph with a relu (the head has one).
    compiled = CompiledParts(parts, CompileSettings(torch_compile=True,
                                                    torch_compile_backend="relu_compile_error_TESTING_ONLY"),
                             "stage 1")
    x = torch.randn(2, 8)
    with caplog.at_level(logging.WARNING, logger="merak.pipeline.compiled"):
        got = compiled.run(0, 4, x)
        again = compiled.run(0, 4, x)
    expected = parts[3](parts[2](parts[1](parts[0](x))))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    torch.testing.assert_close(again, expected, rtol=0, atol=0)
    assert compiled.eager_ranges == [(0, 4)]
    assert "stage 1: parts 0-3 cannot be compiled and run eagerly" in caplog.text
    assert caplog.text.count("cannot be compiled") == 1  # decided once


def _train(state, *, compile: CompileSettings, recompute: ScheduleSettings, dropout_seed=None,
           precision: PrecisionSettings = PrecisionSettings(), measure_activations: bool = False) -> list:
    parts = _parts()
    net = nn.ModuleList(parts)
    stage = StageModule([Input(parts[0]), *parts[1:]])
    engine = PipelineEngine(model=net, stages=[stage], loss_fn=_loss, state=state, schedule="1f1b",
                            num_microbatches=2, total_steps=3, recompute=recompute, dropout_seed=dropout_seed,
                            optimizer=OptimizerSettings(learning_rate=0.05), compile=compile, precision=precision,
                            measure_activations=measure_activations)
    generator = torch.Generator().manual_seed(1)
    records = []
    for _ in range(3):
        x, y = torch.randn(4, 8, generator=generator), torch.randn(4, 3, generator=generator)
        result = engine.train_step([{"x": x[:2], "y": y[:2]}, {"x": x[2:], "y": y[2:]}])
        records.append((result.loss, {n: p.grad.clone() for n, p in engine.named_parameters() if p.grad is not None}))
    return records, engine


@pytest.mark.parametrize("recompute", [ScheduleSettings(activation_checkpointing=False),
                                       ScheduleSettings(activation_checkpointing=True, checkpoint_num_layers=2)],
                         ids=["no-recompute", "recompute-pairs"])
def test_a_compiled_engine_trains_to_the_eager_numbers(single_process, recompute):
    eager, _ = _train(single_process, compile=CompileSettings(), recompute=recompute)
    compiled, engine = _train(single_process, compile=COMPILED, recompute=recompute)
    for (loss, grads), (want_loss, want_grads) in zip(compiled, eager, strict=True):
        assert loss == pytest.approx(want_loss, rel=1e-5)
        for name, grad in grads.items():
            assert float((grad - want_grads[name]).norm() / want_grads[name].norm()) < 1e-5, name
    report = engine.compile_report()
    assert report["enabled"] and report["backend"] == "inductor" and report["eager_ranges"] == {}
    assert report["compile_s"] > 0
    stage = engine.chunks[0]
    expected = {(0, 2), (2, 4)} if recompute.activation_checkpointing else {(0, 4)}
    assert set(stage.compiled._ranges) == expected


@pytest.mark.parametrize("precision", [PrecisionSettings(bf16=True), PrecisionSettings(fp16=True, loss_scale=1024.0)],
                         ids=["bf16", "fp16"])
def test_half_precision_compiled_stages_track_eager(single_process, precision):
    """Half-precision weights and activations compile (fp32 master weights and loss scaling unchanged);
    losses agree within half-precision rounding."""
    eager, _ = _train(single_process, compile=CompileSettings(),
                      recompute=ScheduleSettings(activation_checkpointing=False), precision=precision)
    compiled, engine = _train(single_process, compile=COMPILED,
                              recompute=ScheduleSettings(activation_checkpointing=False), precision=precision)
    assert engine.chunks[0].parts[1].linear.weight.dtype == precision.dtype
    for (loss, _), (want, _) in zip(compiled, eager, strict=True):
        assert loss == pytest.approx(want, rel=2e-2)
    assert engine.compile_report()["eager_ranges"] == {}


def test_compiled_stages_under_the_activation_meter(single_process):
    """The exact activation meter (a saved-tensor hook) sees what compiled graphs save for backward."""
    eager, eager_engine = _train(single_process, compile=CompileSettings(),
                                 recompute=ScheduleSettings(activation_checkpointing=False), measure_activations=True)
    compiled, engine = _train(single_process, compile=COMPILED,
                              recompute=ScheduleSettings(activation_checkpointing=False), measure_activations=True)
    for (loss, _), (want, _) in zip(compiled, eager, strict=True):
        assert loss == pytest.approx(want, rel=1e-5)
    assert engine.memory_report()["peak_activation_bytes"] > 0
    assert eager_engine.memory_report()["peak_activation_bytes"] > 0


def test_the_flop_count_runs_eagerly_and_its_recomputation_too(single_process):
    """The first forward is counted under FlopCounterMode, which dynamo cannot trace: it runs eagerly,
    and the checkpointed parts of that microbatch recompute eagerly too (the same saved tensors)."""
    records, engine = _train(single_process, compile=COMPILED,
                             recompute=ScheduleSettings(activation_checkpointing=True))
    assert engine.executor.forward_flops > 0
    assert len(records) == 3


def test_eager_execution_leaves_later_calls_compiled():
    parts = _parts()
    compiled = CompiledParts(parts, CompileSettings(torch_compile=True, torch_compile_backend="aot_eager"), "stage 0")
    x = torch.randn(2, 8)
    torch._dynamo.reset()
    with eager_execution():
        compiled.run(0, 4, x)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled.run(0, 4, x)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == before + 1


def test_stage_compile_switches_off_again():
    stage = StageModule(_parts())
    stage.compile_parts(COMPILED)
    assert stage.compiled is not None
    stage.compile_parts(CompileSettings())
    assert stage.compiled is None


def test_config_fields_follow_hugging_face():
    settings = resolve_settings(GPT, compose_gpt("trainer.torch_compile_mode=max-autotune-no-cudagraphs"))
    options = settings.trainer.compile
    assert options.enabled and options.backend == "inductor"
    assert options.effective_mode == "max-autotune-no-cudagraphs"
    values = trainer_settings(merak.MerakArguments(output_dir="/tmp/merak-args-test", torch_compile=True))
    assert values["torch_compile"] is True and values["torch_compile_backend"] == "inductor"
    assert values["cuda_graphs"] is False


@pytest.mark.parametrize(("override", "fragment"), [
    ("trainer.torch_compile_backend=no_such_backend", "is not a torch.compile backend"),
    ("trainer.torch_compile_mode=fastest", "torch_compile_mode='fastest'"),
    ("trainer.cuda_graphs=true", "needs torch_compile=true"),
])
def test_bad_compile_settings_are_named(override, fragment):
    with pytest.raises(ConfigError, match=fragment):
        resolve_settings(GPT, compose_gpt(override))


def test_cuda_graphs_need_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="needs CUDA devices"):
        resolve_settings(GPT, compose_gpt("trainer.torch_compile=true", "trainer.cuda_graphs=true",
                                          "trainer.activation_checkpointing=false"))


@pytest.mark.parametrize("flags", [["trainer.cuda_graphs=true"], ["trainer.torch_compile_mode=reduce-overhead"]])
def test_cuda_graphs_refuse_recomputation_before_launch(monkeypatch, flags):
    """On an H200 CUDA graphs with recomputation failed in the backward (docs/gpu.md): refused up front."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError, match="with recomputation failed on a GPU.*activation_checkpointing=false"):
        resolve_settings(GPT, compose_gpt("trainer.torch_compile=true", *flags))
