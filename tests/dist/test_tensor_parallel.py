"""Tensor parallelism trains GPT-2 to the single-process losses and gradients, in every 3D layout.

Each layout runs in one gloo world; a worker's gradients are its slices of the
reference gradients (merak.core.slices records which slice).
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from gpt_reference import PARITY_OPTIONS, relative_error, train_reference, vocab_padded

from merak.core.slices import parameter_slices
from merak.data.batching import BatchPlan, MicrobatchLoader
from merak.distributed import groups
from merak.distributed.launch import spawn_workers
from merak.engine import PipelineEngine
from merak.optim.settings import ZeroSettings
from merak.pipeline.settings import ScheduleSettings
from merak.session.assemble import assemble
from merak.shard.settings import ShardingSettings
from merak.tensor_parallel.options import TensorParallelSplit
from merak.tensor_parallel.settings import TensorParallelSettings
from recipes.gpt import data, model, parallel

pytestmark = pytest.mark.dist

SEED = 1234
STEPS = 3
GLOBAL_BATCH = 16
MICROBATCHES = 4
OPTIONS = PARITY_OPTIONS
LOSS_RTOL = 1e-6
GRAD_RTOL = 2e-6
# name -> (dp, tp, pp, parallel_vocab, sequence_parallel, overlap level)
LAYOUTS = {
    "tp2": (1, 2, 1, False, False, 0),
    "tp2-vocab-sequence": (1, 2, 1, True, True, 0),
    "tp2-overlap1": (1, 2, 1, False, False, 1),
    "tp2-pp2-vocab": (1, 2, 2, True, False, 0),
    "tp2-pp2-overlap2": (1, 2, 2, False, True, 2),
    "dp2-tp2-pp2": (2, 2, 2, True, True, 1),
}
# Layouts run with selective recomputation: the matmuls policy keeps the outputs of merak's tensor-parallel
# linear operators, so their collectives do not run again in the backward (on every rank alike).
SELECTIVE = {"tp2-vocab-sequence": ScheduleSettings(activation_checkpointing="selective",
                                                    selective_recompute="matmuls")}


def _train(out_dir: str, layout: str, model_cfg, tokens: str) -> None:
    dp, tp, pp, vocab, sequence, overlap = LAYOUTS[layout]
    torch.set_num_threads(1)
    state = groups.init(dp=dp, tp=tp, pp=pp, timeout_s=120)
    micro_batch = GLOBAL_BATCH // (dp * MICROBATCHES)
    try:
        built = assemble(
            build=functools.partial(model.build_model, model_cfg), seed=SEED, init_device="cpu",
            sharding=ShardingSettings(split_method="layer_split", custom_split_points=list(parallel.SPLIT_POINTS)),
            num_stages=pp, num_microbatches=MICROBATCHES, stage_id=state.coordinates.pp, device=state.device,
            example_inputs=parallel.example_inputs(model_cfg, micro_batch),
            tensor_parallel=TensorParallelSplit(plan=parallel.TP_PLAN, size=tp, rank=state.coordinates.tp, settings=TensorParallelSettings(parallel_vocab=vocab, sequence_parallel=sequence, tp_overlapping_level=overlap)))
        slices = parameter_slices(built.model)
        # Small buckets: with dp, many overlapped reductions beside the sequence-parallel sums (merak.optim.overlap).
        engine = PipelineEngine(model=built.model, stages=built.stages, loss_fn=model.causal_lm_loss, state=state,
                                schedule="1f1b", num_microbatches=MICROBATCHES, total_steps=STEPS, optimizer=OPTIONS,
                                zero=ZeroSettings(grad_bucket_mb=0.002), recompute=SELECTIVE.get(layout))
        loader = None
        if state.is_first_stage or state.is_last_stage:
            dataset = data.load(tokens, model_cfg)
            plan = BatchPlan(num_samples=len(dataset), micro_batch_size=micro_batch, num_microbatches=MICROBATCHES,
                             dp_size=dp, dp_rank=state.coordinates.dp, seed=SEED)
            loader = MicrobatchLoader(dataset, plan)
        records = []
        for step in range(STEPS):
            result = engine.train_step(loader.load_step(step) if loader else None)
            grads = {name: p.grad.detach().clone() for name, p in engine.named_parameters()}
            records.append({"loss": result.loss, "grad_norm": result.grad_norm, "grads": grads})
        torch.save({"records": records, "slices": slices, "stage": type(engine.stage).__name__},
                   Path(out_dir) / f"rank{state.rank}.pt")
    finally:
        groups.shutdown()


@pytest.fixture(scope="module")
def padded_cfg(toy_model_cfg):
    return vocab_padded(toy_model_cfg)


@pytest.fixture(scope="module")
def reference(padded_cfg, toy_tokens):
    return train_reference(padded_cfg, toy_tokens, options=OPTIONS, steps=STEPS, global_batch=GLOBAL_BATCH,
                           seed=SEED)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_matches_single_process(layout, tmp_path, reference, padded_cfg, toy_tokens):
    dp, tp, pp, *_ = LAYOUTS[layout]
    spawn_workers(_train, world_size=dp * tp * pp, args=(str(tmp_path), layout, padded_cfg, toy_tokens))
    seen = set()
    for rank in range(dp * tp * pp):
        saved = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        # Level 2 runs the two halves of each microbatch through the sub-pipelined stage.
        assert (saved["stage"] == "SubPipelinedStage") == (LAYOUTS[layout][5] == 2)
        for step, (got, want) in enumerate(zip(saved["records"], reference, strict=True)):
            where = f"{layout} rank {rank} step {step}"
            assert got["loss"] == pytest.approx(want["loss"], rel=LOSS_RTOL), where
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=LOSS_RTOL), where
            for name, grad in got["grads"].items():
                expected = want["grads"][name]
                if name in saved["slices"]:
                    expected = saved["slices"][name].take(expected)
                error = relative_error(grad, expected)
                assert error < GRAD_RTOL, f"{where}: gradient of {name} off by {error:.2e}"
                seen.add(name)
    assert seen == set(reference[0]["grads"]), layout
