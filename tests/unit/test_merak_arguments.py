"""MerakArguments: the seed fields and defaults, the mapping onto run settings, and rejected values."""

from __future__ import annotations

import dataclasses

import pytest

import merak
from merak.config import SECTION_OF
from merak.hf.arguments import trainer_settings


def make(**fields):
    return merak.MerakArguments(output_dir="/tmp/merak-args-test", **fields)


def test_seed_fields_have_the_documented_defaults():
    args = make()
    # The split and partition defaults are merak's best plan (min_bytes, autopipe), not the seed's
    # (farthest_min_deps, uniform), which cuts transformer blocks in the middle.
    expected = {"train_schedule": "1f1b", "partition_method": "autopipe", "split_method": "min_bytes",
                "trace_method": "fx", "activation_checkpointing": True, "checkpoint_num_layers": 1,
                "zero_stage": 1, "zero_allgather_bucket_size": 500000000, "save_total_limit": -1,
                "initial_scale_power": 32, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1,
                "out_seq_length": 1024, "temperature": 0.9, "adapter_name": "default", "sequence_dim": 1,
                "init_method_std": 0.02, "eval_iters": None, "text_generation": False, "lora_config": None}
    assert {name: getattr(args, name) for name in expected} == expected
    assert args.problems() == []


def test_settings_map_hugging_face_names_onto_merak_ones():
    values = trainer_settings(make(optim="adamw_torch_fused", train_schedule="early_recompute_1f1b",
                                   save_steps=20, logging_steps=0.25), total_steps_hint=40)
    assert values["optim"] == "adamw_torch"
    assert values["train_schedule"] == "pre_recompute_1f1b"
    assert values["lr_scheduler_type"] == "linear"
    assert (values["save_steps"], values["logging_steps"]) == (20, 10)  # below 1: a fraction of the run
    assert set(values) <= set(SECTION_OF)


def test_building_the_arguments_starts_no_process_group(monkeypatch):
    """Under torchrun's variables TrainingArguments would start accelerate's process group and wait for
    peers; merak.init owns the group, so building MerakArguments must return at once."""
    import torch.distributed as dist

    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    args = make()
    assert args.device.type in ("cpu", "cuda") and not dist.is_initialized()


@pytest.mark.parametrize(("fields", "fragment"), [
    ({"split_inputs": True}, "split_inputs=True is not supported"),
    ({"no_tie_modules": True}, "no_tie_modules=True is not supported"),
    ({"tp_overlapping_level": 3}, "tp_overlapping_level=3"),
    ({"optim": "adamw_bnb_8bit"}, "optim='adamw_bnb_8bit'"),
    ({"eval_iters": 0}, "eval_iters=0"),
    ({"top_p": 0.0}, "top_p=0.0"),
    ({"lora_config": "/nonexistent/lora.json"}, "no such file"),
])
def test_values_that_cannot_work_are_named(fields, fragment):
    problems = make(**fields).problems()
    assert any(fragment in problem for problem in problems), problems


def test_every_trainer_setting_is_an_argument_and_a_fractional_warmup_is_a_ratio():
    from merak.hf.arguments import _NOT_ARGUMENTS

    fields = {field.name for field in dataclasses.fields(merak.MerakArguments)}
    assert set(SECTION_OF) - fields == _NOT_ARGUMENTS  # a new setting needs no edit of MerakArguments
    values = trainer_settings(make(warmup_steps=0.25))
    assert (values["warmup_steps"], values["warmup_ratio"]) == (0, 0.25)  # Hugging Face: below 1, a ratio
    assert trainer_settings(make(warmup_steps=3))["warmup_steps"] == 3
