"""Compiled stages (trainer.torch_compile) train to the single-process eager numbers.

Each layout compiles its stages with inductor (on the CPU here) and is compared with the plain Hugging
Face model trained eagerly in one process, step by step: losses, gradient norms and every gradient
piece a rank applied. Inductor fuses and reorders fp32 sums, so the tolerance is 1e-5 relative
instead of the eager layouts' 2e-6. With dropout on, compiled graphs draw their own masks (from the
same per-part seeds), so that case is compared with one process running the same compiled parts.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from gpt_reference import PARITY_OPTIONS, relative_error, train_reference, vocab_padded
from omegaconf import OmegaConf

from merak.core.slices import parameter_slices
from merak.data.batching import BatchPlan, MicrobatchLoader
from merak.distributed import groups
from merak.distributed.launch import spawn_workers
from merak.engine import PipelineEngine
from merak.optim.settings import ZeroSettings
from merak.pipeline.settings import CompileSettings, ScheduleSettings
from merak.session.assemble import assemble
from merak.shard.settings import ShardingSettings
from merak.tensor_parallel.options import TensorParallelSplit
from merak.tensor_parallel.settings import TensorParallelSettings
from recipes.gpt import data, model, parallel

pytestmark = pytest.mark.dist

SEED = 1234
STEPS = 3
GLOBAL_BATCH = 8
MICROBATCHES = 4
OPTIONS = PARITY_OPTIONS
RTOL = 1e-5


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    schedule: str = "1f1b"
    recompute: ScheduleSettings = ScheduleSettings(activation_checkpointing=False)
    zero: ZeroSettings = ZeroSettings()
    dropout: float = 0.0
    chunks: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp


RATIO = ScheduleSettings(activation_checkpointing=True, activation_checkpoint_ratio=0.5)
LAYOUTS = {
    "pp2-1f1b": Layout(pp=2),
    "pp2-pre_recompute_1f1b": Layout(pp=2, schedule="pre_recompute_1f1b", recompute=RATIO),
    "pp2-zb_h1": Layout(pp=2, schedule="zb_h1"),
    "pp2-interleaved_1f1b": Layout(pp=2, schedule="interleaved_1f1b", chunks=2),
    "dp2-pp2-zero1": Layout(dp=2, pp=2, zero=ZeroSettings(zero_optimization=True, zero_stage=1)),
    "tp2-sequence-parallel": Layout(tp=2),
    # Dropout on, every part recomputed: the compiled recomputation redraws the first run's masks.
    "pp2-dropout-full-recompute": Layout(pp=2, recompute=ScheduleSettings(activation_checkpointing=True),
                                         dropout=0.1),
}


def _model_cfg(toy_model_cfg, layout: Layout):
    cfg = vocab_padded(toy_model_cfg) if layout.tp > 1 else toy_model_cfg
    # Interleaving cuts pp x chunks pieces: four blocks give each piece one.
    return OmegaConf.merge(cfg, {"num_layers": 4 if layout.chunks > 1 else 2, "dropout": layout.dropout})


def _train(state, layout: Layout, model_cfg, tokens: str) -> dict:
    """Three compiled steps of this rank; the gradient pieces it applied, under the full model's names."""
    micro_batch = GLOBAL_BATCH // (state.grid.dp * MICROBATCHES)
    built = assemble(
        build=functools.partial(model.build_model, model_cfg), seed=SEED, init_device="cpu",
        sharding=ShardingSettings(split_method="layer_split", custom_split_points=list(parallel.SPLIT_POINTS)),
        num_stages=state.grid.pp * layout.chunks, num_microbatches=MICROBATCHES,
        stage_id=tuple(state.coordinates.pp + c * state.grid.pp for c in range(layout.chunks)), device=state.device,
        example_inputs=parallel.example_inputs(model_cfg, micro_batch),
        tensor_parallel=TensorParallelSplit(plan=parallel.TP_PLAN, size=state.grid.tp, rank=state.coordinates.tp,
                                            settings=TensorParallelSettings(sequence_parallel=state.grid.tp > 1)))
    engine = PipelineEngine(model=built.model, stages=built.stages, loss_fn=model.causal_lm_loss, state=state,
                            schedule=layout.schedule, num_microbatches=MICROBATCHES, total_steps=STEPS,
                            optimizer=OPTIONS, recompute=layout.recompute, zero=layout.zero, num_chunks=layout.chunks,
                            dropout_seed=SEED if layout.dropout else None, compile=CompileSettings(torch_compile=True))
    loader = None
    if state.is_first_stage or state.is_last_stage:
        dataset = data.load(tokens, model_cfg)
        plan = BatchPlan(num_samples=len(dataset), micro_batch_size=micro_batch, num_microbatches=MICROBATCHES,
                         dp_size=state.grid.dp, dp_rank=state.coordinates.dp, seed=SEED)
        loader = MicrobatchLoader(dataset, plan)
    records = []
    for step in range(STEPS):
        result = engine.train_step(loader.load_step(step) if loader else None)
        pieces = {name: (start, stop, grad.clone()) for name, (start, stop, grad) in
                  engine.gradient_pieces().items() if grad is not None}
        records.append({"loss": result.loss, "grad_norm": result.grad_norm, "pieces": pieces})
    return {"records": records, "slices": parameter_slices(built.model), "compile": engine.compile_report()}


def _train_layouts(out_dir: str, names: list[str], model_cfgs: dict, tokens: str) -> None:
    """One world trains every layout of its grid in turn (a fresh model and engine each)."""
    first = LAYOUTS[names[0]]
    torch.set_num_threads(1)
    state = groups.init(dp=first.dp, tp=first.tp, pp=first.pp, timeout_s=300)
    try:
        for name in names:
            result = _train(state, LAYOUTS[name], model_cfgs[name], tokens)
            torch.save(result, Path(out_dir) / f"{name}-rank{state.rank}.pt")
    finally:
        groups.shutdown()


@pytest.fixture(scope="module")
def compiled_runs(tmp_path_factory, toy_model_cfg, toy_tokens) -> Path:
    """Every layout trained compiled: one gloo world per grid (dp, tp, pp), its layouts one after another."""
    out_dir = tmp_path_factory.mktemp("compiled")
    grids: dict[tuple[int, int, int], list[str]] = {}
    for name, layout in LAYOUTS.items():
        grids.setdefault((layout.dp, layout.tp, layout.pp), []).append(name)
    model_cfgs = {name: _model_cfg(toy_model_cfg, layout) for name, layout in LAYOUTS.items()}
    for names in grids.values():
        spawn_workers(_train_layouts, world_size=LAYOUTS[names[0]].world_size,
                      args=(str(out_dir), names, {n: model_cfgs[n] for n in names}, toy_tokens))
    return out_dir


def _compiled_single_process(layout: Layout, model_cfg, tokens: str) -> list[dict]:
    """The same compiled parts run in order in this process, as full-size gradients."""
    state = groups.init()
    try:
        result = _train(state, Layout(dropout=layout.dropout), model_cfg, tokens)
    finally:
        groups.shutdown()
    return [{"loss": r["loss"], "grad_norm": r["grad_norm"], "grads": {n: g for n, (_, _, g) in r["pieces"].items()}}
            for r in result["records"]]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_compiled_layout_matches_single_process(name, compiled_runs, toy_model_cfg, toy_tokens):
    layout = LAYOUTS[name]
    model_cfg = _model_cfg(toy_model_cfg, layout)
    if layout.dropout:
        reference = _compiled_single_process(layout, model_cfg, toy_tokens)
    else:
        reference = train_reference(model_cfg, toy_tokens, options=OPTIONS, steps=STEPS, global_batch=GLOBAL_BATCH,
                                    seed=SEED)
    seen = set()
    for rank in range(layout.world_size):
        saved = torch.load(compiled_runs / f"{name}-rank{rank}.pt", weights_only=False)
        # Every range of parts compiled: none fell back to eager execution.
        assert saved["compile"]["enabled"] and saved["compile"]["eager_ranges"] == {}, saved["compile"]
        assert saved["compile"]["compile_s"] > 0, saved["compile"]
        for step, (got, want) in enumerate(zip(saved["records"], reference, strict=True)):
            at = f"{name} rank {rank} step {step}"
            assert got["loss"] == pytest.approx(want["loss"], rel=RTOL), at
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=RTOL), at
            for param, (start, stop, grad) in got["pieces"].items():
                full = want["grads"][param]
                local = saved["slices"][param].take(full) if param in saved["slices"] else full
                error = relative_error(grad.reshape(-1), local.reshape(-1)[start:stop])
                assert error < RTOL, f"{at}: gradient of {param} off by {error:.2e}"
                seen.add(param)
    assert seen == set(reference[0]["grads"]), name


def _compile_fresh(out_dir: str) -> None:
    with torch._inductor.config.patch(force_disable_caches=True, compile_threads=2):
        value = torch.compile(lambda x: torch.sin(x) * 3 + 1)(torch.ones(4))
    torch.save(value, Path(out_dir) / "value.pt")


@pytest.mark.timeout(300)
def test_a_forked_worker_compiles_after_its_parent_did(tmp_path):
    """A parent that compiled with inductor's thread pool forks workers (merak's launcher on the CPU); the
    worker's own compilation must not wait on the pool threads it did not inherit."""
    with torch._inductor.config.patch(force_disable_caches=True, compile_threads=2):
        torch.compile(lambda x: torch.cos(x) - 1)(torch.ones(4))
    spawn_workers(_compile_fresh, world_size=1, args=(str(tmp_path),), start_method="fork")
    torch.testing.assert_close(torch.load(tmp_path / "value.pt"), torch.sin(torch.ones(4)) * 3 + 1)
