"""Every TrainingArguments field is honoured, needs nothing, or is named in a warning; the strategy
fields resolve to the steps Hugging Face would act on."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from tiny_models import TinyClassifier
from transformers import TrainingArguments

import merak
from merak.config import ConfigError
from merak.hf.cadence import cadence_problems, resolve_cadence
from merak.hf.fields import HINTS, HONOURED, SATISFIED, ignored_fields


def _args(tmp_path, **fields) -> merak.MerakArguments:
    return merak.MerakArguments(output_dir=str(tmp_path), **fields)


def test_the_field_lists_name_real_fields_once():
    names = {f.name for f in dataclasses.fields(merak.MerakArguments)}
    for listed in (HONOURED, SATISFIED, set(HINTS)):
        assert listed <= names, sorted(listed - names)
    assert not HONOURED & SATISFIED and not set(HINTS) & (HONOURED | SATISFIED)


def test_defaults_and_honoured_fields_are_not_reported(tmp_path):
    assert ignored_fields(_args(tmp_path)) == []
    assert ignored_fields(_args(tmp_path, label_smoothing_factor=0.1, save_strategy="epoch",
                                logging_strategy="epoch", eval_strategy="steps", eval_steps=3,
                                dataloader_num_workers=2, run_name="x", remove_unused_columns=False)) == []


def test_every_unimplemented_field_set_is_named_with_its_counterpart(tmp_path):
    ignored = ignored_fields(_args(tmp_path, neftune_noise_alpha=5.0, ddp_timeout=100, torch_empty_cache_steps=3))
    assert len(ignored) == 3
    assert ignored[0].startswith("neftune_noise_alpha=5.0")
    assert any(item.startswith("ddp_timeout=100 (merak's collectives time out after timeout_s)") for item in ignored)
    assert any(item.startswith("torch_empty_cache_steps=3") for item in ignored)
    # Whatever is not listed as honoured or needless is reported when set: no field is silently dropped.
    unlisted = {f.name for f in dataclasses.fields(TrainingArguments) if f.init} - HONOURED - SATISFIED
    assert "neftune_noise_alpha" in unlisted and "lr_scheduler_kwargs" in unlisted


def _data(count: int) -> list[dict]:
    return [{"features": torch.randn(4), "labels": torch.tensor(i % 3)} for i in range(count)]


def test_trainer_warns_once_naming_the_ignored_fields(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="merak.hf.trainer"):
        merak.MerakTrainer(model=TinyClassifier(), args=_args(tmp_path, neftune_noise_alpha=5.0, max_steps=2,
                                                     per_device_train_batch_size=2),
                           train_data=_data(8))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "neftune_noise_alpha=5.0" in warnings[0]


def test_strategies_resolve_to_steps(tmp_path):
    args = _args(tmp_path, logging_strategy="epoch", eval_strategy="epoch", save_strategy="epoch", eval_delay=2)
    cadence = resolve_cadence(args, steps_per_epoch=5, total_steps=20, has_eval_data=True)
    assert (cadence.log_every, cadence.eval_every, cadence.save_every, cadence.eval_delay) == (5, 5, 5, 10)
    assert not cadence.evaluates_at(5) and cadence.evaluates_at(10)  # from the second epoch's end, as HF
    fractions = _args(tmp_path, eval_strategy="steps", eval_steps=0.25, save_steps=0.5, logging_steps=0.1)
    cadence = resolve_cadence(fractions, steps_per_epoch=100, total_steps=40, has_eval_data=True)
    assert (cadence.log_every, cadence.eval_every, cadence.save_every) == (4, 10, 20)
    assert resolve_cadence(fractions, steps_per_epoch=100, total_steps=40, has_eval_data=False).eval_every is None
    off = resolve_cadence(_args(tmp_path, save=False), steps_per_epoch=5, total_steps=20, has_eval_data=False)
    assert off.save_every is None and off.log_every == 1 and off.logs_at(3)
    first = resolve_cadence(_args(tmp_path, logging_strategy="no", logging_first_step=True), steps_per_epoch=5,
                            total_steps=20, has_eval_data=False)
    assert first.logs_at(1) and not first.logs_at(2)


def test_best_model_metric_and_direction(tmp_path):
    loss = resolve_cadence(_args(tmp_path, eval_strategy="steps", load_best_model_at_end=True),
                           steps_per_epoch=5, total_steps=20, has_eval_data=True)
    assert loss.best_metric == "eval_loss" and not loss.greater_is_better
    assert loss.is_better(1.0, None) and loss.is_better(0.5, 1.0) and not loss.is_better(2.0, 1.0)
    accuracy = resolve_cadence(_args(tmp_path, eval_strategy="steps", save_strategy="best",
                                     metric_for_best_model="accuracy"),
                               steps_per_epoch=5, total_steps=20, has_eval_data=True)
    assert accuracy.best_metric == "eval_accuracy" and accuracy.greater_is_better and accuracy.save_best
    assert accuracy.save_every is None  # saved when the metric improves, not on a schedule


@pytest.mark.parametrize("fields,message", [
    ({"save": True, "save_strategy": "no"}, "save=True but save_strategy='no'"),
    ({"load_best_model_at_end": True, "save": False, "eval_strategy": "steps"},
     "load_best_model_at_end=True needs checkpoints"),
    ({"save_strategy": "best"}, "save_strategy='best' needs an eval_strategy"),
])
def test_contradictory_strategies_are_named(tmp_path, fields, message):
    assert any(message in problem for problem in cadence_problems(_args(tmp_path, **fields)))
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("'", ".")):
        merak.MerakTrainer(model=TinyClassifier(), args=_args(tmp_path, max_steps=1, **fields), train_data=_data(8))


def test_seed_size_fields_are_checked_against_the_model_and_data(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16))
    sample = {"input_ids": torch.zeros(12, dtype=torch.long)}
    args = _args(tmp_path, num_heads=4, seq_length=12, trace_model="GPT2LMHeadModel")
    assert args.model_problems(model, sample) == []
    problems = _args(tmp_path, num_heads=8, seq_length=16, trace_model="Qwen2ForCausalLM").model_problems(model, sample)
    assert problems == ["num_heads=8 but the model has 4 attention heads",
                        "seq_length=16 but the training samples hold 12 tokens",
                        "trace_model='Qwen2ForCausalLM' but the model is a GPT2LMHeadModel (merak captures any "
                        "class: leave trace_model empty)"]


def test_num_layers_sets_the_original_shard_count_and_custom_partition_needs_custom(tmp_path):
    from merak.hf.arguments import trainer_settings

    assert trainer_settings(_args(tmp_path, num_layers=6))["shard_count"] == 12
    assert trainer_settings(_args(tmp_path, num_layers=6, shard_count=5))["shard_count"] == 5
    assert trainer_settings(_args(tmp_path))["shard_count"] is None
    problems = _args(tmp_path, custom_partition=[0, 3, 6]).problems()
    assert any("only read with partition_method='custom'" in p for p in problems)
    assert not _args(tmp_path, custom_partition=[0, 3, 6], partition_method="custom").problems()


def test_unused_seed_field_is_named(tmp_path):
    assert ignored_fields(_args(tmp_path, init_method_std=0.01)) == [
        "init_method_std=0.01 (tensor-parallel shards are slices of the model's own initialized weights)"]
