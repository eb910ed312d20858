"""MerakTrainer on a transformers model no recipe ships (a small Llama): dp x pp parity with one
plain process, sharded evaluation, prediction order, generation through the pipeline, and LoRA."""

from __future__ import annotations

import json
import os

import pytest
import torch

import merak
from merak.data.batching import BatchPlan, stack_samples
from merak.distributed.launch import spawn_workers
from merak.report.curves import drawn_steps

pytestmark = pytest.mark.dist

SEED, STEPS, MICRO, MICROBATCHES, LR = 7, 3, 2, 2, 2e-3
VOCAB, SEQ = 96, 12


def build_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def samples(count: int, seed: int) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=generator)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def arguments(output_dir: str, **overrides):
    fields = {"output_dir": output_dir, "max_steps": STEPS, "per_device_train_batch_size": MICRO,
              "per_device_eval_batch_size": MICRO, "gradient_accumulation_steps": MICROBATCHES, "learning_rate": LR,
              "seed": SEED, "weight_decay": 0.01, "lr_scheduler_type": "linear", "disable_tqdm": True,
              "split_method": "layer_split", "custom_split_points": ["model.layers.*"], "timeout_s": 120,
              "activation_checkpointing": True}
    fields.update(overrides)
    return merak.MerakArguments(**fields)


def reference(train, evaluation, global_batch: int):
    """One plain process: Hugging Face's own causal-LM loss, AdamW, clipping, linear schedule."""
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: (STEPS - step) / STEPS)
    plan = BatchPlan(num_samples=len(train), micro_batch_size=global_batch, num_microbatches=1, seed=SEED)
    losses = []
    for step in range(STEPS):
        batch = stack_samples([train[i] for i in plan.global_batch(step).tolist()])
        optimizer.zero_grad()
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        batch = stack_samples(evaluation)
        eval_loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss.item()
        logits = model(input_ids=batch["input_ids"]).logits
        greedy = model.generate(torch.tensor([[5, 17, 3]]), do_sample=False, max_length=9, min_length=9).tolist()
    return model, losses, eval_loss, logits, greedy


def _dp2_pp2_worker(output_dir: str) -> None:
    merak.init(dp=2, tp=1, pp=2)
    train, evaluation = samples(64, 1), samples(16, 2)
    losses = []

    from transformers import TrainerCallback

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if "loss" in logs:
                losses.append(logs["loss"])

    # ZeRO-3: training, evaluation, prediction and generation each gather the parameters where they run.
    trainer = merak.MerakTrainer(model=build_model(), args=arguments(output_dir, zero_optimization=True, zero_stage=3),
                                 train_data=train, eval_data=evaluation, callbacks=[Record()])
    trainer.train()
    metrics = trainer.evaluate()
    predicted = trainer.predict(evaluation)
    generated = trainer.generate([[5, 17, 3]], max_length=9, temperature=0)
    sampled = trainer.generate([[5, 17, 3], [8, 1]], max_length=8, temperature=0.8, top_k=20, top_p=0.9)
    if merak.get_rank_grid() is not None and torch.distributed.get_rank() == 0:
        with open(os.path.join(output_dir, "result.json"), "w", encoding="utf-8") as handle:
            json.dump({"losses": losses, "eval": metrics, "generated": generated, "sampled": sampled,
                       "predictions": predicted.predictions.tolist(), "labels": predicted.label_ids.tolist(),
                       "test_loss": predicted.metrics["test_loss"]}, handle)


def test_trainer_dp2_pp2_matches_one_process(tmp_path):
    output_dir = str(tmp_path / "run")
    spawn_workers(_dp2_pp2_worker, world_size=4, args=(output_dir,))
    with open(os.path.join(output_dir, "result.json"), encoding="utf-8") as handle:
        result = json.load(handle)
    train, evaluation = samples(64, 1), samples(16, 2)
    _, losses, eval_loss, logits, greedy = reference(train, evaluation, MICRO * MICROBATCHES * 2)
    assert result["losses"] == pytest.approx(losses, rel=1e-6)
    # The 16 evaluation samples are exactly 2 steps of 2 replicas x 2 microbatches x 2 samples.
    assert result["eval"]["eval_samples"] == 16
    assert result["eval"]["eval_loss"] == pytest.approx(eval_loss, rel=1e-6)
    assert result["test_loss"] == pytest.approx(eval_loss, rel=1e-6)
    predictions = torch.tensor(result["predictions"])
    assert predictions.shape == logits.shape
    # The captured graph and eager attention round differently (~5e-5 on logits of ~0.1); each sample's
    # nearest reference sample must be itself (dataset order).
    error = float((predictions - logits).norm() / logits.norm())
    assert error < 1e-3, f"predictions differ from the reference by {error:.1e}"
    distances = torch.cdist(predictions.flatten(1), logits.flatten(1))
    assert torch.equal(distances.argmin(dim=1), torch.arange(len(evaluation))), "predictions out of order"
    assert torch.equal(torch.tensor(result["labels"]), stack_samples(evaluation)["labels"])
    assert result["generated"] == greedy
    sampled = result["sampled"]
    assert [len(s) for s in sampled] == [8, 8] and sampled[0][:3] == [5, 17, 3] and sampled[1][:2] == [8, 1]
    with open(os.path.join(output_dir, "summary.json"), encoding="utf-8") as handle:
        summary = json.load(handle)
    assert summary["layout"] == {"dp": 2, "tp": 1, "pp": 2}
    assert summary["precision"]["zero_stage"] == 3
    # Each rank holds its pieces of the weights between uses (generation gathered them all).
    for rank in summary["ranks"]:
        assert rank["parameter_bytes"] <= 4 * rank["num_parameters"] / 2 + 4 * 64, rank
        assert rank["peak_gathered_parameter_bytes"] == 4 * rank["num_parameters"], rank
    assert summary["flops"]["model_flops_per_step"] > 0
    with open(os.path.join(output_dir, "metrics.jsonl"), encoding="utf-8") as handle:
        lines = [json.loads(line) for line in handle]
    assert [line["step"] for line in lines if "loss" in line] == [1, 2, 3]
    # Drawn when training stopped, and again for the evaluation trainer.evaluate() logged afterwards.
    drawn = drawn_steps(os.path.join(output_dir, "loss.png"))
    assert drawn["train loss"] == [1, 2, 3] and drawn["eval loss"][-1] == 3


def _lora_worker(output_dir: str, config_path: str) -> None:
    merak.init(dp=1, tp=1, pp=2)
    model = build_model()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer = merak.MerakTrainer(model=model, args=arguments(output_dir, lora_config=config_path,
                                                             split_method="farthest_min_deps"),
                                 train_data=samples(64, 1), eval_data=samples(8, 2))
    trainer.train()
    metrics = trainer.evaluate()
    engine = trainer.session.engine
    # peft renames the wrapped layers: base_model.model.<name>, and <layer>.base_layer.weight.
    frozen_changed = [name for name, p in engine.named_parameters() if "lora_" not in name and not torch.equal(
        p.detach(), before[name.removeprefix("base_model.model.").replace(".base_layer", "")])]
    trainable = sorted({name for name, p in engine.named_parameters() if p.requires_grad})
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(output_dir, "lora.json"), "w", encoding="utf-8") as handle:
            json.dump({"eval_loss": metrics["eval_loss"], "frozen_changed": frozen_changed,
                       "trainable": trainable}, handle)


def test_lora_trains_only_adapters_and_round_trips(tmp_path):
    config_path = tmp_path / "lora.json"
    config_path.write_text(json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
                                       "lora_dropout": 0.0, "task_type": "CAUSAL_LM"}))
    output_dir = str(tmp_path / "run")
    spawn_workers(_lora_worker, world_size=2, args=(output_dir, str(config_path)))
    with open(os.path.join(output_dir, "lora.json"), encoding="utf-8") as handle:
        result = json.load(handle)
    assert result["frozen_changed"] == []
    assert result["trainable"] and all("lora_" in name for name in result["trainable"])
    adapter = os.path.join(output_dir, "adapter")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(adapter))
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    assert tensors and all("lora_" in name for name in tensors)
    # Both stages' adapters (4 layers x q_proj, v_proj x A, B), named as peft names them on disk.
    assert len(tensors) == 4 * 2 * 2
    assert {name.replace(".default", "") for name in result["trainable"]} <= set(tensors)  # stage 0's
    # peft loads the saved adapter onto the base model: its loss is the trained pipeline's.
    from peft import PeftModel

    loaded = PeftModel.from_pretrained(build_model(), adapter).eval()
    batch = stack_samples(samples(8, 2))
    with torch.no_grad():
        loss = loaded(input_ids=batch["input_ids"], labels=batch["labels"]).loss.item()
    assert loss == pytest.approx(result["eval_loss"], rel=1e-6)
