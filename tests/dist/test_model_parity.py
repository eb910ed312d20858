"""Automatically split models train on gloo pp=2 to the single-process losses and gradients.

Each model family goes through the whole automatic path (capture, shard,
partition, and for ``gpt2-meta`` meta-device construction with per-stage
materialization); the reference trains the same model in one process on the
same microbatches with the same optimizer.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import tiny_models
import torch
from microbatch_reference import train_microbatches

from merak.distributed import groups
from merak.distributed.launch import spawn_workers
from merak.engine import PipelineEngine
from merak.optim.settings import OptimizerSettings
from merak.session.assemble import assemble
from merak.shard.settings import ShardingSettings

pytestmark = pytest.mark.dist

SEED = 7
STEPS = 2
MICROBATCHES = 4
OPTIONS = OptimizerSettings(learning_rate=1e-3, weight_decay=0.01, max_grad_norm=1.0, warmup_steps=0, lr_scheduler_type="constant")
LOSS_RTOL = 1e-6
GRAD_RTOL = 5e-6
# (tiny model, init device, split method, partition method)
CASES = {
    "bert": ("bert", "cpu", "farthest_min_deps", "uniform"),
    "t5": ("t5", "cpu", "nearest_min_deps", "parameters"),
    "vit": ("vit", "cpu", "layer_split", "uniform"),
    "wide_resnet": ("wide_resnet", "cpu", "farthest_min_deps", "autopipe"),
    "gpt2-meta": ("gpt2", "meta", "layer_split", "uniform"),
    # The default plan: cuts where the fewest bytes cross, stages balanced on rank 0's machine rates.
    "gpt2-default": ("gpt2", "cpu", "min_bytes", "autopipe"),
    "t5-default": ("t5", "cpu", "min_bytes", "autopipe"),
    "swin-default": ("swin", "cpu", "min_bytes", "autopipe"),
}
SPLIT_POINTS = {"vit": ("vit.layers.*",), "gpt2": ("transformer.h.*",)}


def _build(name: str):
    return tiny_models.ALL[name]()[0]


def _microbatches(name: str) -> list[dict]:
    batches = []
    for index in range(STEPS * MICROBATCHES):
        torch.manual_seed(1000 + index)
        batches.append(tiny_models.ALL[name]()[1])
    return batches


def _assemble(case: str, num_stages: int, stage_id: int):
    name, init_device, split, partition = CASES[case]
    example = {k: v for k, v in _microbatches(name)[0].items() if k != "labels"}
    options = ShardingSettings(split_method=split, partition_method=partition, shard_count=6, custom_split_points=list(SPLIT_POINTS.get(name, ())))
    return assemble(build=functools.partial(_build, name), seed=SEED, init_device=init_device, sharding=options,
                    num_stages=num_stages, num_microbatches=MICROBATCHES, stage_id=stage_id,
                    device=torch.device("cpu"), example_inputs=example)


def _train_pipeline(out_dir: str, case: str) -> None:
    torch.set_num_threads(1)
    state = groups.init(pp=2, timeout_s=120)
    try:
        name = CASES[case][0]
        built = _assemble(case, 2, state.coordinates.pp)
        loss_fn = tiny_models.ALL[name]()[2]
        engine = PipelineEngine(model=built.model, stages=built.stages, loss_fn=loss_fn, state=state,
                                schedule="1f1b", num_microbatches=MICROBATCHES, total_steps=STEPS, optimizer=OPTIONS)
        data = _microbatches(name)
        records = []
        for step in range(STEPS):
            result = engine.train_step(data[step * MICROBATCHES:(step + 1) * MICROBATCHES])
            grads = {n: p.grad.detach().clone() for n, p in engine.named_parameters() if p.grad is not None}
            records.append({"loss": result.loss, "grads": grads, "boundaries": built.plan.boundaries})
        torch.save(records, Path(out_dir) / f"rank{state.rank}.pt")
    finally:
        groups.shutdown()


def _reference(case: str) -> list[dict]:
    name = CASES[case][0]
    built = _assemble(case, 1, 0)  # same construction path (meta + materialize for gpt2-meta), one stage
    return train_microbatches(built.model, tiny_models.ALL[name]()[2], _microbatches(name), steps=STEPS,
                              microbatches=MICROBATCHES, options=OPTIONS)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(CASES))
def test_pp2_matches_single_process(case, tmp_path):
    spawn_workers(_train_pipeline, world_size=2, args=(str(tmp_path), case))
    reference = _reference(case)
    seen = set()
    plans = {rank: torch.load(tmp_path / f"rank{rank}.pt")[0]["boundaries"] for rank in range(2)}
    assert plans[0] == plans[1], f"the ranks cut the model differently: {plans}"
    for rank in range(2):
        records = torch.load(tmp_path / f"rank{rank}.pt")
        for step, (got, want) in enumerate(zip(records, reference, strict=True)):
            where = f"{case} rank {rank} step {step} (stage boundaries {got['boundaries']})"
            assert got["loss"] == pytest.approx(want["loss"], rel=LOSS_RTOL), where
            for param_name, grad in got["grads"].items():
                expected = want["grads"][param_name]
                # Relative to the gradient, with a floor: attention key biases get ~1e-11 gradients.
                error = float((grad - expected).norm() / expected.norm().clamp_min(1e-4))
                assert error < GRAD_RTOL, f"{where}: gradient of {param_name} off by {error:.2e}"
                seen.add(param_name)
    assert seen == set(reference[0]["grads"]), case
