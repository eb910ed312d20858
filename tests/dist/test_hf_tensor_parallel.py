"""Transformers models with no merak plan train on gloo tp=2 to the single-process losses and gradients.

The plan is the model's own transformers plan, translated by
``merak.tensor_parallel.plan_for`` (nothing hand-written), from a copy of the
model built on the meta device, as a trainer given ``model_init`` would. The
rest is the whole automatic path (split, capture, shard, partition) and the
pipeline engine; tests/tp_parity.py compares with one process.
"""

from __future__ import annotations

import pytest
import torch
from microbatch_reference import train_microbatches
from tp_parity import compare_workers, save_worker, step_record

import merak  # noqa: F401  (before transformers)
from merak.distributed import groups
from merak.distributed.launch import spawn_workers
from merak.engine import PipelineEngine
from merak.optim.settings import OptimizerSettings
from merak.session.assemble import assemble
from merak.shard.settings import ShardingSettings
from merak.tensor_parallel import plan_for
from merak.tensor_parallel.cross_entropy import cross_entropy
from merak.tensor_parallel.options import TensorParallelSplit
from merak.tensor_parallel.settings import TensorParallelSettings

pytestmark = pytest.mark.dist

SEED = 13
STEPS = 2
MICROBATCHES = 4
BATCH, SEQ, VOCAB = 2, 16, 64
TP = 2
OPTIONS = OptimizerSettings(learning_rate=1e-3, weight_decay=0.01, max_grad_norm=1.0, warmup_steps=0, lr_scheduler_type="constant")
SIZES = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": VOCAB, "intermediate_size": 64, "max_position_embeddings": 64, "tie_word_embeddings": False}


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SIZES)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def qwen3():
    """Qwen3's per-head query and key norms: kept whole, their gradients summed over the tp group."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**SIZES, head_dim=8)
    config._attn_implementation = "sdpa"
    return Qwen3ForCausalLM(config)


# case -> (model, pp, parallel_vocab)
CASES = {
    "llama": (llama, 1, False),
    "llama-pp2-vocab": (llama, 2, True),
    "qwen3": (qwen3, 1, False),
}


def causal_lm_loss(output, batch) -> torch.Tensor:
    """Next-token cross-entropy; vocabulary-parallel when the logits are split (parallel_vocab)."""
    logits = output["logits"]
    return cross_entropy(logits[:, :-1, :].reshape(-1, logits.size(-1)), batch["labels"][:, 1:].reshape(-1))


def _microbatches() -> list[dict]:
    generator = torch.Generator().manual_seed(1000)
    batches = []
    for _ in range(STEPS * MICROBATCHES):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
        batches.append({"input_ids": ids, "labels": ids})
    return batches


def _train(out_dir: str, case: str) -> None:
    build, pp, vocab = CASES[case]
    torch.set_num_threads(1)
    state = groups.init(tp=TP, pp=pp, timeout_s=120)
    try:
        with torch.device("meta"):
            plan = plan_for(build(), None, tp=TP)
        data = _microbatches()
        built = assemble(
            build=build, seed=SEED, init_device="cpu",
            sharding=ShardingSettings(split_method="layer_split", custom_split_points=["model.layers.*"]), num_stages=pp,
            num_microbatches=MICROBATCHES, stage_id=state.coordinates.pp, device=torch.device("cpu"),
            example_inputs={"input_ids": data[0]["input_ids"]},
            tensor_parallel=TensorParallelSplit(plan=plan, size=TP, rank=state.coordinates.tp, settings=TensorParallelSettings(parallel_vocab=vocab)))
        engine = PipelineEngine(model=built.model, stages=built.stages, loss_fn=causal_lm_loss, state=state,
                                schedule="1f1b", num_microbatches=MICROBATCHES, total_steps=STEPS, optimizer=OPTIONS)
        records = [step_record(engine, engine.train_step(data[step * MICROBATCHES:(step + 1) * MICROBATCHES]))
                   for step in range(STEPS)]
        save_worker(out_dir, state.rank, built.model, records, len(built.tp_plan.changes))
    finally:
        groups.shutdown()


def _reference(build) -> list[dict]:
    torch.manual_seed(SEED)
    return train_microbatches(build(), causal_lm_loss, _microbatches(), steps=STEPS, microbatches=MICROBATCHES,
                              options=OPTIONS)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(CASES))
def test_transformers_plan_tp2_matches_single_process(case, tmp_path):
    build, pp, vocab = CASES[case]
    spawn_workers(_train, world_size=TP * pp, args=(str(tmp_path), case))
    sliced = compare_workers(tmp_path, TP * pp, _reference(build), case)
    assert "model.layers.0.self_attn.k_proj.weight" in sliced, case
    assert "model.layers.1.mlp.down_proj.weight" in sliced, case
    if vocab:
        assert {"model.embed_tokens.weight", "lm_head.weight"} <= sliced, f"{case}: not split by vocabulary"
