"""A Hugging Face Trainer script with only the class names changed runs on merak: it trains to one
process's numbers (label smoothing included), evaluates and saves on its strategies, ends with the best
model, returns a TrainOutput on every rank, writes TensorBoard logs, and save_model() writes a model
from_pretrained loads, gathered from every pipeline stage and tensor-parallel slice."""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch

import merak
from merak.data.batching import BatchPlan, stack_samples
from merak.distributed.launch import spawn_workers
from merak.energy import cli as energy_cli

pytestmark = pytest.mark.dist

SEED, STEPS, MICRO, MICROBATCHES, LR, SMOOTHING = 11, 4, 2, 2, 3e-3, 0.1
VOCAB, SEQ = 80, 10


def build_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def samples(count: int, seed: int) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    return [{"input_ids": (ids := torch.randint(0, VOCAB, (SEQ,), generator=generator)), "labels": ids.clone()}
            for _ in range(count)]


def smoothed_loss(model, batch) -> torch.Tensor:
    """Hugging Face's label-smoothed causal-LM loss (its LabelSmoother on shifted labels)."""
    logits = model(input_ids=batch["input_ids"]).logits[:, :-1].reshape(-1, VOCAB)
    return torch.nn.functional.cross_entropy(logits.float(), batch["labels"][:, 1:].reshape(-1),
                                             label_smoothing=SMOOTHING)


def _script(output_dir: str) -> None:
    """What a Hugging Face user writes, with TrainingArguments/Trainer renamed (no merak.init: the
    trainer takes the launcher's processes as data parallelism)."""
    from merak import MerakArguments, MerakTrainer

    args = MerakArguments(
        output_dir=output_dir, max_steps=STEPS, per_device_train_batch_size=MICRO, per_device_eval_batch_size=MICRO,
        gradient_accumulation_steps=MICROBATCHES, learning_rate=LR, lr_scheduler_type="constant", seed=SEED,
        label_smoothing_factor=SMOOTHING, eval_strategy="steps", eval_steps=2, save_strategy="steps",
        save_steps=2, save_total_limit=1, load_best_model_at_end=True, logging_steps=1, report_to=["tensorboard"],
        do_eval=True, disable_tqdm=True, timeout_s=120)
    trainer = MerakTrainer(model=build_model(), args=args, train_dataset=samples(48, 1),
                           eval_dataset=samples(8, 2))
    output = trainer.train()
    metrics = trainer.evaluate()
    trainer.save_model()
    rank = torch.distributed.get_rank()
    with open(os.path.join(output_dir, f"rank{rank}.json"), "w", encoding="utf-8") as handle:
        json.dump({"global_step": output.global_step, "training_loss": output.training_loss,
                   "metrics": output.metrics, "eval": metrics, "best_metric": trainer.state.best_metric,
                   "best_checkpoint": trainer.state.best_model_checkpoint,
                   "history": trainer.state.log_history}, handle)


def _reference(train, evaluation):
    """One process, the same global batches: AdamW, clipping, constant rate, label smoothing; the
    evaluation loss after every second step."""
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    plan = BatchPlan(num_samples=len(train), micro_batch_size=MICRO * MICROBATCHES * 2, num_microbatches=1,
                     seed=SEED)
    losses, evaluations = [], {}
    for step in range(STEPS):
        batch = stack_samples([train[i] for i in plan.global_batch(step).tolist()])
        optimizer.zero_grad()
        loss = smoothed_loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if (step + 1) % 2 == 0:
            with torch.no_grad():
                evaluations[step + 1] = smoothed_loss(model.eval(), stack_samples(evaluation)).item()
            model.train()
    return losses, evaluations


def test_hugging_face_script_with_renamed_classes(tmp_path):
    output_dir = str(tmp_path / "run")
    spawn_workers(_script, world_size=2, args=(output_dir,))
    ranks = []
    for rank in range(2):
        with open(os.path.join(output_dir, f"rank{rank}.json"), encoding="utf-8") as handle:
            ranks.append(json.load(handle))
    first = ranks[0]
    # TrainOutput on every rank, the same numbers.
    assert [r["global_step"] for r in ranks] == [STEPS, STEPS]
    assert ranks[1]["training_loss"] == first["training_loss"] and ranks[1]["metrics"] == first["metrics"]
    assert {"train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos", "train_loss",
            "epoch"} <= set(first["metrics"])
    assert first["metrics"]["total_flos"] > 0

    losses, evaluations = _reference(samples(48, 1), samples(8, 2))
    logged = [entry for entry in first["history"] if "loss" in entry]
    assert [entry["step"] for entry in logged] == [1, 2, 3, 4]
    assert [entry["loss"] for entry in logged] == pytest.approx(losses, rel=1e-5)
    assert all({"learning_rate", "grad_norm", "epoch"} <= set(entry) for entry in logged)
    assert first["training_loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-5)
    # Evaluated at steps 2 and 4 (eval_steps), then by the script's evaluate(): do_eval's evaluation at the
    # end is not a repeat of step 4's.
    evaluated = [entry for entry in first["history"] if "eval_loss" in entry]
    assert [entry["step"] for entry in evaluated] == [2, 4, 4]
    assert [entry["eval_loss"] for entry in evaluated][:2] == pytest.approx([evaluations[2], evaluations[4]],
                                                                         rel=1e-5)
    assert {"eval_runtime", "eval_samples_per_second", "eval_steps_per_second"} <= set(evaluated[0])
    # load_best_model_at_end: the weights after train() are the best evaluation's.
    best_step = min(evaluations, key=evaluations.get)
    assert first["best_metric"] == pytest.approx(evaluations[best_step], rel=1e-5)
    assert first["best_checkpoint"].endswith(f"checkpoint-{best_step}")
    assert os.path.isdir(first["best_checkpoint"])  # save_total_limit=1 never removes the best
    assert first["eval"]["eval_loss"] == pytest.approx(evaluations[best_step], rel=1e-5)
    # save_model(): a directory from_pretrained loads, holding the best weights.
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(output_dir).eval()
    with torch.no_grad():
        assert smoothed_loss(loaded, stack_samples(samples(8, 2))).item() == pytest.approx(
            evaluations[best_step], rel=1e-5)
    assert os.path.isfile(os.path.join(output_dir, "training_args.bin"))
    # report_to=["tensorboard"]: transformers' own callback wrote event files.
    assert glob.glob(os.path.join(output_dir, "**", "events.out.tfevents.*"), recursive=True)


def _pipeline_save(output_dir: str) -> None:
    merak.init(dp=1, tp=2, pp=2)  # no tp_plan: transformers' own plan for Llama
    args = merak.MerakArguments(output_dir=output_dir, max_steps=2, per_device_train_batch_size=MICRO,
                                per_device_eval_batch_size=MICRO, gradient_accumulation_steps=MICROBATCHES,
                                learning_rate=LR, seed=SEED, save=False, disable_tqdm=True, timeout_s=120)
    trainer = merak.MerakTrainer(model=build_model(), args=args, train_data=samples(32, 1),
                                 eval_data=samples(8, 2))
    trainer.train()
    metrics = trainer.evaluate()
    refused = ""
    try:
        trainer.model.save_pretrained(os.path.join(output_dir, "partial"))
    except RuntimeError as error:
        refused = str(error)
    trainer.save_model(os.path.join(output_dir, "model"))
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(output_dir, "result.json"), "w", encoding="utf-8") as handle:
            json.dump({"eval_loss": metrics["eval_loss"], "refused": refused}, handle)


def test_save_model_gathers_every_stage_and_tensor_parallel_slice(tmp_path):
    output_dir = str(tmp_path / "run")
    spawn_workers(_pipeline_save, world_size=4, args=(output_dir,))
    with open(os.path.join(output_dir, "result.json"), encoding="utf-8") as handle:
        result = json.load(handle)
    # The model object holds one stage: saving it is refused, never written half-trained.
    assert "save_model" in result["refused"] and not os.path.exists(os.path.join(output_dir, "partial"))
    assert not glob.glob(os.path.join(output_dir, "checkpoint-*"))  # save=False: no checkpoints
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(os.path.join(output_dir, "model")).eval()
    batch = stack_samples(samples(8, 2))
    with torch.no_grad():
        loss = loaded(input_ids=batch["input_ids"], labels=batch["labels"]).loss.item()
    assert loss == pytest.approx(result["eval_loss"], rel=1e-5)  # every tensor is the trained one
    untrained = build_model()
    changed = [name for name, p in loaded.named_parameters() if not torch.equal(p, untrained.get_parameter(name))]
    assert len(changed) == len(list(untrained.parameters()))


def _energy_and_generation(output_dir: str) -> None:
    merak.init(dp=1, tp=1, pp=2)
    common = {"per_device_train_batch_size": MICRO, "per_device_eval_batch_size": MICRO,
              "gradient_accumulation_steps": MICROBATCHES, "learning_rate": LR, "seed": SEED, "save": False,
              "disable_tqdm": True, "timeout_s": 120, "split_method": "layer_split",
              "custom_split_points": ["model.layers.*"]}
    profiler = merak.MerakTrainer(
        model=build_model(), train_data=samples(32, 1),
        args=merak.MerakArguments(output_dir=os.path.join(output_dir, "profile"), max_steps=2, profile=True,
                                  num_warmup_steps=1, num_prof_steps=1,
                                  **{**common, "gradient_accumulation_steps": 1}))  # one microbatch per step
    summary = profiler.profile()
    # The energy planner on the trainer's profile, then the frontier's fastest point from the trainer.
    frontier_dir = os.path.join(output_dir, "plan")
    if torch.distributed.get_rank() == 0:  # the profile summary is rank 0's
        assert energy_cli.main(["plan", summary["profile"], "--num-stages", "2", "--num-microbatches",
                                str(MICROBATCHES), "--p2p-power", "80", "--out", frontier_dir, "--points", "8"]) == 0
    torch.distributed.barrier()
    planned = merak.MerakTrainer(
        model=build_model(), train_data=samples(32, 1),
        args=merak.MerakArguments(output_dir=os.path.join(output_dir, "planned"), max_steps=3,
                                  frequency_frontier=os.path.join(frontier_dir, "frontier.json"), **common))
    planned.train()
    writer = merak.MerakTrainer(
        model=build_model(), train_data=samples(32, 1), eval_data=samples(4, 2),
        args=merak.MerakArguments(output_dir=os.path.join(output_dir, "generate"), max_steps=1,
                                  text_generation=True, out_seq_length=SEQ + 3, temperature=0, **common))
    writer.train()
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(output_dir, "result.json"), "w", encoding="utf-8") as handle:
            json.dump({"profile": summary, "planned": planned.summary["energy"]}, handle)


def test_energy_profile_and_text_generation_from_the_trainer(tmp_path):
    output_dir = str(tmp_path / "run")
    spawn_workers(_energy_and_generation, world_size=2, args=(output_dir,))
    with open(os.path.join(output_dir, "result.json"), encoding="utf-8") as handle:
        result = json.load(handle)
    summary = result["profile"]
    # The trainer ran the frontier's fastest point and reports its prediction beside the measurement
    # (how close they are depends on the host here: this model's instructions take their CPU time).
    (pipeline,) = result["planned"]["pipelines"]
    with open(os.path.join(output_dir, "plan", "frontier.json"), encoding="utf-8") as handle:
        fastest = json.load(handle)["points"][0]
    assert pipeline["point"] == 0 and result["planned"]["switches"] == []
    assert pipeline["predicted_step_time_s"] == fastest["iteration_time"]
    assert pipeline["predicted_step_energy_j"] == fastest["energy"]
    assert pipeline["step_energy_j"] > 0 and pipeline["step_time_s"] > 0
    # Every instruction of both stages at each profiled clock of the simulated GPU.
    assert summary["layout"] == {"dp": 1, "tp": 1, "pp": 2} and summary["clocks_profiled"] >= 2
    import csv

    with open(summary["profile"], encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == summary["rows"] > 0
    assert {row["pp_rank"] for row in rows} == {"0", "1"}
    assert {"forward", "backward"} <= {row["instruction"] for row in rows}
    with open(os.path.join(output_dir, "generate", "generated.jsonl"), encoding="utf-8") as handle:
        generated = [json.loads(line) for line in handle]
    prompts = [sample["input_ids"].tolist() for sample in samples(4, 2)]
    assert [g["prompt"] for g in generated] == prompts
    assert all(len(g["generated"]) == 3 for g in generated)


@pytest.fixture
def in_this_process():
    """A trainer run in the test's own process (one rank) keeps its parallel state, as a notebook's
    does; the next test starts without it."""
    from merak.distributed import groups

    yield
    groups.shutdown()


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(SEED)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


@pytest.mark.parametrize(("build", "ratio"), [(build_model, 1.0), (_tiny_gpt2, SEQ / (SEQ - 1))],
                         ids=["llama-counted-shifted", "gpt2-counted-unshifted"])
def test_logged_loss_relates_to_hugging_faces_by_the_labels_it_counts(tmp_path, build, ratio, in_this_process):
    """docs/trainer_api.md, "Differences from Hugging Face Trainer": its Trainer divides the summed token losses
    by the labels it counts (num_items_in_batch). For a model it knows as a causal LM (loss_type ForCausalLM:
    LlamaForCausalLM) it counts the SEQ - 1 predicted ones, as merak averages; for others (GPT2LMHeadModel) all
    SEQ, so merak's loss is its loss x SEQ / (SEQ - 1). One global batch (the same samples in any order)."""
    from transformers import Trainer, TrainingArguments

    data = samples(MICRO * MICROBATCHES, 5)
    common = {"per_device_train_batch_size": MICRO, "gradient_accumulation_steps": MICROBATCHES, "max_steps": 1,
              "learning_rate": LR, "seed": SEED, "logging_steps": 1, "report_to": [], "disable_tqdm": True,
              "save_strategy": "no"}
    hugging_face = Trainer(model=build(), args=TrainingArguments(output_dir=str(tmp_path / "hf"), use_cpu=True,
                                                                 **common), train_dataset=data)
    hugging_face.train()
    theirs = next(entry["loss"] for entry in hugging_face.state.log_history if "loss" in entry)
    ours = merak.MerakTrainer(model=build(), args=merak.MerakArguments(output_dir=str(tmp_path / "merak"), **common),
                              train_dataset=data)
    ours.train()
    mine = next(entry["loss"] for entry in ours.state.log_history if "loss" in entry)
    assert mine == pytest.approx(theirs * ratio, rel=1e-5)


def test_trainer_resumes_only_the_model_it_saved(tmp_path, in_this_process):
    """MerakTrainer checks a checkpoint's model as merak.run does, before training."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from merak.checkpoint import CheckpointError

    common = {"per_device_train_batch_size": MICRO, "gradient_accumulation_steps": MICROBATCHES, "learning_rate": LR,
              "seed": SEED, "report_to": [], "disable_tqdm": True, "output_dir": str(tmp_path / "run")}
    merak.MerakTrainer(model=build_model(), args=merak.MerakArguments(max_steps=1, save_strategy="steps",
                                                                      save_steps=1, **common),
                       train_dataset=samples(8, 1)).train()
    smaller = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                           tie_word_embeddings=False))
    trainer = merak.MerakTrainer(model=smaller, args=merak.MerakArguments(max_steps=2, **common),
                                 train_dataset=samples(8, 1))
    with pytest.raises(CheckpointError, match=r"holds another model .*num_hidden_layers 2 -> 1"):
        trainer.train(resume_from_checkpoint=True)
