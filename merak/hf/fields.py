"""Which ``TrainingArguments`` fields merak honours, and a warning naming every one it does not.

A Hugging Face script moved to ``MerakTrainer`` keeps its arguments. Most of them
mean what they meant (:data:`HONOURED`); a few need nothing from merak because
merak already behaves that way (:data:`SATISFIED`). Any other field set away from
its Hugging Face default would silently do nothing: :func:`ignored_fields` names
them, and the trainer logs one warning listing each, with what to use instead
where merak has a counterpart (:data:`HINTS`).
"""

from __future__ import annotations

import dataclasses

from transformers import TrainingArguments

# Read by merak: the trainer settings of the same name (merak.config.SECTION_OF) or MerakTrainer.
HONOURED = frozenset({
    "output_dir", "per_device_train_batch_size", "num_train_epochs", "max_steps", "learning_rate",
    "lr_scheduler_type", "warmup_steps", "optim", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon",
    "gradient_accumulation_steps", "max_grad_norm", "label_smoothing_factor", "bf16", "fp16", "tf32",
    "activation_checkpointing", "gradient_checkpointing", "torch_compile", "torch_compile_backend",
    "torch_compile_mode", "logging_strategy", "logging_steps", "logging_first_step",
    "disable_tqdm", "report_to", "run_name", "project", "eval_strategy", "eval_steps", "eval_delay",
    "per_device_eval_batch_size", "prediction_loss_only", "eval_on_start", "save_only_model", "save_strategy",
    "save_steps", "save_total_limit", "load_best_model_at_end", "metric_for_best_model", "greater_is_better",
    "seed", "use_cpu", "dataloader_num_workers", "dataloader_pin_memory", "label_names", "do_train", "do_eval",
    "do_predict", "resume_from_checkpoint", "ddp_backend", "local_rank",
})
# Nothing to do: merak behaves so already, or the field only concerns machinery merak does not use.
SATISFIED = frozenset({
    "remove_unused_columns",  # each stage receives only the fields its graph reads
    "dataloader_drop_last",  # merak never trains a partial global batch
    "log_on_each_node", "log_level", "log_level_replica", "logging_nan_inf_filter", "skip_memory_metrics",
    "eval_do_concat_batches", "eval_use_gather_object", "include_for_metrics", "save_on_each_node",
    "dataloader_in_order", "ddp_find_unused_parameters", "ddp_bucket_cap_mb", "ddp_broadcast_buffers",
    "ddp_static_graph", "accelerator_config", "hub_token", "hub_private_repo", "hub_model_id", "hub_strategy",
    "hub_always_push", "hub_revision", "trackio_space_id", "trackio_bucket_id", "trackio_static_space_id",
    "debug", "ignore_data_skip", "restore_callback_states_from_checkpoint", "length_column_name",
    "average_tokens_across_devices", "use_cache",
})
HINTS = {
    "ddp_timeout": "merak's collectives time out after timeout_s",
    "fsdp": "merak shards optimizer state and gradients with zero_optimization/zero_stage",
    "fsdp_config": "merak shards optimizer state and gradients with zero_optimization/zero_stage",
    "deepspeed": "merak has ZeRO itself: zero_optimization, zero_stage and the fp16 loss-scale fields",
    "gradient_checkpointing_kwargs": "merak recomputes whole pipeline parts: checkpoint_num_layers, "
                                     "activation_checkpoint_ratio",
    "activation_checkpointing_kwargs": "merak recomputes whole pipeline parts: checkpoint_num_layers, "
                                       "activation_checkpoint_ratio",
    "data_seed": "merak orders the data with seed",
    "parallelism_config": "merak's layout comes from merak.init(dp=..., tp=..., pp=...)",
    "push_to_hub": "save_model() writes a directory that huggingface_hub can upload",
    "auto_find_batch_size": "set per_device_train_batch_size",
}


# Fields of the original Merak API that have no effect here, with their defaults and why.
MERAK_UNUSED = {
    "init_method_std": (0.02, "tensor-parallel shards are slices of the model's own initialized weights"),
}


def _default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def _plain(value):
    return getattr(value, "value", value)


def ignored_fields(args) -> list[str]:
    """``name=value`` for each Hugging Face field set away from its default that merak does not honour."""
    ignored = []
    for field in dataclasses.fields(TrainingArguments):
        name = field.name
        if not field.init or name in HONOURED or name in SATISFIED or name.startswith("_"):
            continue
        value, default = getattr(args, name, None), _default(field)
        if default is dataclasses.MISSING or _plain(value) == _plain(default) or (not value and not default):
            continue
        hint = HINTS.get(name)
        ignored.append(f"{name}={_plain(value)!r}" + (f" ({hint})" if hint else ""))
    for name, (default, why) in MERAK_UNUSED.items():
        if getattr(args, name, default) != default:
            ignored.append(f"{name}={getattr(args, name)!r} ({why})")
    return ignored


__all__ = ["HINTS", "HONOURED", "MERAK_UNUSED", "SATISFIED", "ignored_fields"]
