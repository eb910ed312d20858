"""Every layout and schedule trains to the single-process losses and gradients.

One gloo world per layout runs all schedules (dp2 x pp2 on the rendezvous transport, NCCL's semantics:
merak.distributed.transports); the reference is the plain
Hugging Face model trained in this process on the same global batches with
the same optimizer, schedule and clipping.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch
from gpt_reference import PARITY_OPTIONS, assert_steps_match, train_reference

from merak.data.batching import BatchPlan, MicrobatchLoader
from merak.distributed import groups
from merak.distributed.launch import spawn_workers
from merak.distributed.transports import RENDEZVOUS_ENV
from merak.engine import PipelineEngine
from merak.optim.settings import ZeroSettings
from merak.session.assemble import assemble
from merak.shard.settings import ShardingSettings
from recipes.gpt import data, model, parallel

pytestmark = pytest.mark.dist

SEED = 1234
STEPS = 3
GLOBAL_BATCH = 16
SCHEDULES = ("1f1b", "ds_default", "gpipe")
OPTIONS = PARITY_OPTIONS
# Each layout also exercises a different split and partition method.
SHARDING = {
    (1, 2): ShardingSettings(split_method="farthest_min_deps", partition_method="uniform"),
    (2, 1): ShardingSettings(split_method="nearest_min_deps", partition_method="parameters"),
    (2, 2): ShardingSettings(split_method="layer_split", custom_split_points=list(parallel.SPLIT_POINTS), partition_method="autopipe"),
}
# fp32 sums in a different order: ~1e-7 relative; anything wrong is orders larger.
LOSS_RTOL = 1e-6
GRAD_RTOL = 2e-6


def _train_layout(out_dir: str, dp: int, pp: int, num_microbatches: int, model_cfg, tokens: str) -> None:
    torch.set_num_threads(1)
    if dp > 1 and pp > 1:  # NCCL's send semantics (merak.distributed.transports) with data parallelism too
        os.environ[RENDEZVOUS_ENV] = "1"
    state = groups.init(dp=dp, pp=pp, timeout_s=120)
    micro_batch = GLOBAL_BATCH // (dp * num_microbatches)
    try:
        for schedule in SCHEDULES:
            # Stages come from the automatic path: captured, sharded, partitioned.
            built = assemble(build=functools.partial(model.build_model, model_cfg), seed=SEED, init_device="cpu",
                             sharding=SHARDING[(dp, pp)], num_stages=pp, num_microbatches=num_microbatches,
                             stage_id=state.coordinates.pp, device=state.device,
                             example_inputs=parallel.example_inputs(model_cfg, micro_batch))
            # Buckets of about 2 KiB: the data-parallel reductions are many and start during the last
            # backward (merak.optim.overlap).
            engine = PipelineEngine(model=built.model, stages=built.stages, loss_fn=model.causal_lm_loss,
                                    state=state, schedule=schedule, num_microbatches=num_microbatches,
                                    total_steps=STEPS, optimizer=OPTIONS, zero=ZeroSettings(grad_bucket_mb=0.002))
            loader = None
            if state.is_first_stage or state.is_last_stage:
                dataset = data.load(tokens, model_cfg)
                plan = BatchPlan(num_samples=len(dataset), micro_batch_size=micro_batch,
                                 num_microbatches=num_microbatches, dp_size=dp, dp_rank=state.coordinates.dp,
                                 seed=SEED)
                loader = MicrobatchLoader(dataset, plan)
            records = []
            for step in range(STEPS):
                result = engine.train_step(loader.load_step(step) if loader else None)
                grads = {name: p.grad.detach().clone() for name, p in engine.named_parameters()}
                records.append({"loss": result.loss, "grad_norm": result.grad_norm, "grads": grads})
            torch.save(records, Path(out_dir) / f"{schedule}-rank{state.rank}.pt")
    finally:
        groups.shutdown()


@pytest.fixture(scope="module")
def reference(toy_model_cfg, toy_tokens):
    return train_reference(toy_model_cfg, toy_tokens, options=OPTIONS, steps=STEPS, global_batch=GLOBAL_BATCH,
                           seed=SEED)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dp,pp", [(1, 2), (2, 1), (2, 2)])
def test_layout_matches_single_process(dp, pp, tmp_path, reference, toy_model_cfg, toy_tokens):
    num_microbatches = 4
    spawn_workers(_train_layout, world_size=dp * pp,
                  args=(str(tmp_path), dp, pp, num_microbatches, toy_model_cfg, toy_tokens))
    # The clipped regime is exercised: the first step's norm exceeds max_grad_norm.
    assert reference[0]["grad_norm"] > OPTIONS.max_grad_norm
    for schedule in SCHEDULES:
        seen = set()
        for rank in range(dp * pp):
            records = torch.load(tmp_path / f"{schedule}-rank{rank}.pt")
            assert len(records) == STEPS
            seen |= assert_steps_match(records, reference, f"{schedule} dp={dp} pp={pp} rank {rank}",
                                       loss_rtol=LOSS_RTOL, grad_rtol=GRAD_RTOL)
        # Between them, the ranks hold every parameter of the model.
        assert seen == set(reference[0]["grads"]), schedule
