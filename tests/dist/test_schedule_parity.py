"""Every schedule, with and without recomputation, trains to the single-process numbers, dropout on;
so does selective recomputation (saving matrix products, or all but the attention core).

Dropout masks come from per-part seeds (merak.pipeline.recompute), so a part
draws the same masks in every layout and when it is recomputed; the
reference is one process running the same parts in order, without
checkpointing. One gloo world per pipeline depth runs every case, reusing
the captured stages (weights are reset between cases).

The worlds run on the rendezvous transport (``MERAK_P2P_RENDEZVOUS=1``): gloo with NCCL's semantics, a
send completing only when its receive runs and messages matched by posting order. A schedule that
would hang on NCCL hangs here and fails at the process group's timeout. One case runs on gloo's own
buffered transport, what CPU runs use.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch
from gpt_reference import assert_steps_match
from omegaconf import OmegaConf

from merak.data.batching import BatchPlan, MicrobatchLoader
from merak.distributed import groups
from merak.distributed.launch import spawn_workers
from merak.distributed.transports import RENDEZVOUS_ENV, PostedTransport
from merak.engine import PipelineEngine
from merak.optim.settings import OptimizerSettings
from merak.pipeline.schedules import SCHEDULES, schedule_info
from merak.pipeline.settings import ScheduleSettings
from merak.session.assemble import assemble
from merak.shard.settings import ShardingSettings
from recipes.gpt import data, model, parallel

pytestmark = pytest.mark.dist

SEED = 4321
STEPS = 2
MICROBATCHES = 4
MICRO_BATCH = 2
OPTIONS = OptimizerSettings(learning_rate=1e-3, max_grad_norm=1.0, lr_scheduler_type="constant")
SHARDING = ShardingSettings(split_method="layer_split", custom_split_points=list(parallel.SPLIT_POINTS),
                            partition_method="uniform")
RECOMPUTE = {
    "none": ScheduleSettings(activation_checkpointing=False),
    "full": ScheduleSettings(activation_checkpointing=True),
    "ratio": ScheduleSettings(activation_checkpointing=True, activation_checkpoint_ratio=0.5),
}
# Selective recomputation (merak.pipeline.selective): matmuls saved with 1F1B; all but the attention core
# saved, composed with the stage-aware ratio, two parts per chunk and pre-checkpointed forwards.
SELECTIVE = {
    "1f1b-selective-matmuls": ("1f1b", ScheduleSettings(activation_checkpointing="selective")),
    "pre_recompute_1f1b-selective-attention": ("pre_recompute_1f1b", ScheduleSettings(
        activation_checkpointing="selective", selective_recompute="attention", activation_checkpoint_ratio=0.5,
        checkpoint_num_layers=2)),
}
MEASURED = ("1f1b-full", "1f1b-none", "1f1b-selective-matmuls")  # the cases whose activation peaks are compared
LOSS_RTOL = 1e-6
GRAD_RTOL = 2e-6


def _model_cfg(toy_model_cfg):
    # Eight blocks, so interleaving with four stages still has a block per piece; dropout on.
    return OmegaConf.merge(toy_model_cfg, {"num_layers": 8, "dropout": 0.1})


def _cases() -> list[tuple[str, str, str]]:
    return [(f"{name}-{mode}", name, mode) for name in SCHEDULES for mode in RECOMPUTE]


def _train(state, built, schedule: str, recompute: ScheduleSettings, chunks: int, model_cfg, tokens: str,
           dealloc: bool = False, buffered: bool = False, measure: bool = False) -> list[dict]:
    # measure: count every saved tensor (a Python hook each) for the exact activation peak
    engine = PipelineEngine(model=built.model, stages=built.stages, loss_fn=model.causal_lm_loss, state=state,
                            schedule=schedule, num_microbatches=MICROBATCHES, total_steps=STEPS, optimizer=OPTIONS,
                            recompute=recompute, num_chunks=chunks, dropout_seed=SEED, dealloc_pipeoutput=dealloc,
                            measure_activations=measure)
    if engine.executor.p2p is not None and buffered:
        engine.executor.p2p.transport = PostedTransport()  # gloo's sends, complete without the peer
    dataset = data.load(tokens, model_cfg)
    plan = BatchPlan(num_samples=len(dataset), micro_batch_size=MICRO_BATCH, num_microbatches=MICROBATCHES, seed=SEED)
    loader = MicrobatchLoader(dataset, plan)
    records = []
    for step in range(STEPS):
        result = engine.train_step(loader.load_step(step))
        grads = {name: p.grad.detach().clone() for name, p in engine.named_parameters()}
        records.append({"loss": result.loss, "grad_norm": result.grad_norm, "grads": grads,
                        "memory": engine.memory_report()})
    return records


def _assemble(model_cfg, pieces: int, stage_id: int):
    return assemble(build=functools.partial(model.build_model, model_cfg), seed=SEED, init_device="cpu",
                    sharding=SHARDING, num_stages=pieces, num_microbatches=MICROBATCHES, stage_id=stage_id,
                    device=torch.device("cpu"), example_inputs=parallel.example_inputs(model_cfg, MICRO_BATCH))


def _run_world(out_dir: str, pp: int, model_cfg, tokens: str) -> None:
    torch.set_num_threads(1)
    os.environ[RENDEZVOUS_ENV] = "1"
    state = groups.init(pp=pp, timeout_s=120)
    try:
        built = {chunks: _assemble(model_cfg, pp * chunks, state.coordinates.pp) for chunks in (1, 2)}
        initial = {chunks: {k: v.clone() for k, v in b.model.state_dict().items()} for chunks, b in built.items()}
        results = {}
        for case, name, mode in _cases():
            chunks = 2 if schedule_info(name).chunked else 1
            built[chunks].model.load_state_dict(initial[chunks])
            results[case] = _train(state, built[chunks], name, RECOMPUTE[mode], chunks, model_cfg, tokens,
                                   measure=case in MEASURED)
        for case, (name, recompute) in SELECTIVE.items():
            built[1].model.load_state_dict(initial[1])
            results[case] = _train(state, built[1], name, recompute, 1, model_cfg, tokens, measure=case in MEASURED)
        built[1].model.load_state_dict(initial[1])
        results["1f1b-full-dealloc"] = _train(state, built[1], "1f1b", RECOMPUTE["ratio"], 1, model_cfg, tokens,
                                              dealloc=True)
        built[1].model.load_state_dict(initial[1])
        results["zb_h1-buffered"] = _train(state, built[1], "zb_h1", RECOMPUTE["none"], 1, model_cfg, tokens,
                                           buffered=True)
        torch.save(results, Path(out_dir) / f"rank{state.rank}.pt")
    finally:
        groups.shutdown()


@pytest.fixture(scope="module")
def reference(toy_model_cfg, toy_tokens):
    """One process, the same parts in order, no checkpointing; and the same with other dropout seeds."""
    model_cfg = _model_cfg(toy_model_cfg)
    torch.set_num_threads(1)
    state = groups.init()
    try:
        built = _assemble(model_cfg, 1, 0)
        initial = {k: v.clone() for k, v in built.model.state_dict().items()}
        records = _train(state, built, "1f1b", RECOMPUTE["none"], 1, model_cfg, toy_tokens)
        built.model.load_state_dict(initial)
        no_dropout_cfg = OmegaConf.merge(model_cfg, {"dropout": 0.0})
        plain = _train(state, _assemble(no_dropout_cfg, 1, 0), "1f1b", RECOMPUTE["none"], 1, no_dropout_cfg,
                       toy_tokens)
    finally:
        groups.shutdown()
    # Dropout is really on: without it the loss differs well beyond the tolerance.
    assert abs(plain[0]["loss"] - records[0]["loss"]) > 100 * LOSS_RTOL * abs(records[0]["loss"])
    return records


@pytest.mark.timeout(600)
@pytest.mark.parametrize("pp", [2, 4])
def test_every_schedule_and_recompute_mode_matches_one_process(pp, tmp_path, reference, toy_model_cfg, toy_tokens):
    model_cfg = _model_cfg(toy_model_cfg)
    spawn_workers(_run_world, world_size=pp, args=(str(tmp_path), pp, model_cfg, toy_tokens))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(pp)]
    for case in [c for c, _, _ in _cases()] + list(SELECTIVE) + ["1f1b-full-dealloc", "zb_h1-buffered"]:
        seen = set()
        for rank, results in enumerate(ranks):
            seen |= assert_steps_match(results[case], reference, f"{case} pp={pp} rank {rank}",
                                       loss_rtol=LOSS_RTOL, grad_rtol=GRAD_RTOL)
        assert seen == set(reference[0]["grads"]), case
    # Checkpointing keeps fewer activations: on the first stage, full recompute holds less than selective
    # recomputation (which keeps the matrix products' outputs), and that less than none.
    peak = {case: ranks[0][case][-1]["memory"]["peak_activation_bytes"] for case in MEASURED}
    assert peak["1f1b-full"] < peak["1f1b-selective-matmuls"] < peak["1f1b-none"], peak
