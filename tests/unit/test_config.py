"""merak.config.resolve_settings on the real gpt recipe config, composed with Hydra."""

from __future__ import annotations

import re
from pathlib import Path

import hydra
import pytest
from hydra.errors import ConfigCompositionException

from merak.config import ConfigError, resolve_settings
from merak.distributed.topology import RankGrid
from merak.runner import plan_before_launch
from recipes.gpt.spec import SPEC

CONF_DIR = str(Path(__file__).resolve().parents[2] / "recipes" / "gpt" / "conf")


def compose(*overrides: str):
    with hydra.initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return hydra.compose("train", overrides=list(overrides))


def problems_of(*overrides: str, world_size: int | None = None) -> list[str]:
    cfg = compose(*overrides)
    with pytest.raises(ConfigError) as info:
        resolve_settings(SPEC, cfg, world_size=world_size)
    message = str(info.value)
    assert message.startswith("invalid configuration:\n  - ")
    return message.split("\n  - ")[1:]


def test_defaults_resolve():
    settings = resolve_settings(SPEC, compose())
    assert settings.grid == RankGrid(dp=2, tp=2, pp=2)
    assert settings.trainer.tensor_parallel.sequence_parallel and not settings.trainer.tensor_parallel.parallel_vocab
    assert settings.num_microbatches == 4
    assert settings.trainer.batch.per_device_train_batch_size == 4
    assert settings.global_batch_size == 4 * 4 * 2
    assert settings.trainer.optimizer.learning_rate == pytest.approx(1e-3)
    assert settings.trainer.optimizer.lr_scheduler_type == "cosine"
    assert settings.trainer.schedule.train_schedule == "1f1b"
    assert settings.trainer.batch.max_steps == 80
    assert settings.launcher.backend == "auto"
    assert settings.launcher.timeout_s == 600
    assert settings.model_cfg.name == "demo"
    assert settings.data_cfg.source == "python_docs"


def test_defaults_match_world_size_eight():
    assert resolve_settings(SPEC, compose(), world_size=8).grid.world_size == 8


def test_output_dir_passed_through(tmp_path):
    settings = resolve_settings(SPEC, compose(f"trainer.output_dir={tmp_path}"))
    assert settings.output_dir == str(tmp_path)


def test_overrides_and_parallel_groups():
    settings = resolve_settings(SPEC, compose("model=toy", "parallel=pp4", "trainer.train_schedule=gpipe"))
    assert settings.grid == RankGrid(dp=1, tp=1, pp=4)
    assert settings.model_cfg.name == "toy"
    assert settings.trainer.schedule.train_schedule == "gpipe"


def test_dp_zero():
    problems = problems_of("parallel.dp=0")
    assert problems == ["parallel.dp=0 must be a positive integer"]


def test_tensor_parallel_settings_are_checked():
    problems = problems_of("trainer.tp_overlapping_level=3", "trainer.sequence_dim=-1")
    # Ranges checked with the types come first; sequence_dim is checked whatever tp is.
    assert problems == ["trainer.sequence_dim=-1 must be a non-negative integer",
                        "trainer.tp_overlapping_level=3; supported levels are 0, 1 and 2"]
    # With tp=1 there is nothing to split: the tensor-parallel switches are simply unused.
    settings = resolve_settings(SPEC, compose("parallel=dp2_pp2", "trainer.parallel_vocab=true"))
    assert settings.grid.tp == 1


def test_tp_plan_checked_on_the_model_before_launch():
    settings = resolve_settings(SPEC, compose("model=toy", "parallel=tp2", "trainer.parallel_vocab=true"))
    with pytest.raises(ConfigError, match="vocabulary size = 50257 is not divisible by tp=2"):
        plan_before_launch(SPEC, settings, prepared="")


def test_more_stages_than_shards_fails_before_launch():
    settings = resolve_settings(SPEC, compose("model=toy", "parallel=pp4", "parallel.pp=8",
                                              "trainer.split_method=layer_split"))
    with pytest.raises(ConfigError, match=r"only 5 shards for pp=8 stages: raise shard_count"):
        plan_before_launch(SPEC, settings, prepared="")


def test_custom_partition_checked_against_shards_before_launch():
    settings = resolve_settings(SPEC, compose("model=toy", "parallel=pp2", "trainer.split_method=layer_split",
                                              "trainer.partition_method=custom",
                                              "trainer.custom_partition=[0,3,9]"))
    with pytest.raises(ConfigError, match="must end at the number of shards 5, got 9"):
        plan_before_launch(SPEC, settings, prepared="")


def test_sharding_settings_are_checked():
    problems = problems_of("trainer.trace_method=jit", "trainer.split_method=halves",
                           "trainer.partition_method=custom", "trainer.shard_count=0")
    assert any("trainer.trace_method='jit'" in p for p in problems)
    assert any("trainer.split_method='halves'" in p for p in problems)
    assert any("partition_method=custom needs trainer.custom_partition" in p for p in problems)
    assert any("trainer.shard_count=0" in p for p in problems)
    problems = problems_of("trainer.partition_method=custom", "trainer.custom_partition=[0,4,4]")
    assert problems == ["trainer.custom_partition is not increasing at position 2: 4 then 4"]
    problems = problems_of("trainer.trace_method=null")
    assert problems == ["trainer.trace_method=null with parallel.pp=2: without tracing the recipe must supply "
                        "stages (RecipeSpec.build_stages); use trace_method=fx",
                        "tensor parallelism with pp > 1 needs a captured graph: use trace_method=fx or dynamo"]


def test_heads_not_dividing_hidden_size():
    problems = problems_of("model.num_heads=3")
    assert problems == ["model.hidden_size=128 is not divisible by model.num_heads=3",
                        "model.num_heads=3 is not divisible by parallel.tp=2"]


def test_unknown_train_schedule_lists_valid_names():
    problems = problems_of("trainer.train_schedule=zigzag")
    assert len(problems) == 1
    assert "trainer.train_schedule='zigzag' is unknown" in problems[0]
    for name in ("1f1b", "ds_default", "gpipe"):
        assert name in problems[0]


def test_unknown_lr_scheduler():
    problems = problems_of("trainer.lr_scheduler_type=wobbly")
    assert len(problems) == 1
    assert "trainer.lr_scheduler_type='wobbly'" in problems[0]
    assert "cosine" in problems[0]


def test_global_batch_size_not_divisible():
    problems = problems_of("trainer.global_batch_size=30")
    assert len(problems) == 1
    assert "trainer.global_batch_size=30" in problems[0]
    assert "per_device_train_batch_size*dp = 4*2" in problems[0]


def test_unknown_trainer_key():
    problems = problems_of("+trainer.lerning_rate=0.1")
    assert len(problems) == 1
    assert problems[0].startswith("trainer.lerning_rate is not a known setting")
    assert "learning_rate" in problems[0].split("known:")[1]


def test_unknown_key_without_plus_fails_at_compose():
    with pytest.raises(ConfigCompositionException, match="lerning_rate"):
        compose("trainer.lerning_rate=0.1")


def test_missing_data_file(tmp_path):
    missing = tmp_path / "nope.txt"
    present = tmp_path / "there.txt"
    present.write_text("hello\n")
    problems = problems_of("data=files", f"data.files=[{present},{missing}]")
    assert problems == [f"data file not found: {missing} (data.files)"]


def test_files_source_without_files():
    problems = problems_of("data=files")
    assert problems == ["data.source=files needs data.files=[path, ...]"]


def test_existing_data_file_is_fine(tmp_path):
    present = tmp_path / "there.txt"
    present.write_text("hello\n")
    settings = resolve_settings(SPEC, compose("data=files", f"data.files=[{present}]"))
    assert list(settings.data_cfg.files) == [str(present)]


def test_world_size_mismatch():
    problems = problems_of(world_size=3)
    assert len(problems) == 1
    assert "parallel.dp*tp*pp = 2*2*2 = 8" in problems[0]
    assert "started 3 processes" in problems[0]


def test_several_problems_all_listed(tmp_path):
    missing = tmp_path / "absent.csv"
    problems = problems_of("model.num_heads=3", "trainer.train_schedule=zigzag", "trainer.tp_overlapping_level=5",
                           "+trainer.lerning_rate=1", "trainer.global_batch_size=30",
                           "data=files", f"data.files=[{missing}]", world_size=3)
    joined = "\n".join(problems)
    assert len(problems) == 8, joined
    for needle in ("trainer.lerning_rate", "parallel.dp*tp*pp = 2*2*2 = 8", "trainer.tp_overlapping_level=5",
                   "trainer.train_schedule='zigzag'", "trainer.global_batch_size=30",
                   "model.hidden_size=128 is not divisible by model.num_heads=3",
                   "model.num_heads=3 is not divisible by parallel.tp=2", f"data file not found: {missing}"):
        assert sum(needle in p for p in problems) == 1, needle


@pytest.mark.parametrize("overrides,dp,micro,expected", [
    (("trainer.global_batch_size=64",), 2, 4, 8),
    (("trainer.global_batch_size=8",), 2, 4, 1),
    (("parallel=pp2", "trainer.global_batch_size=12"), 1, 4, 3),
    (("parallel=dp4", "trainer.per_device_train_batch_size=2", "trainer.global_batch_size=24"), 4, 2, 3),
])
def test_global_batch_size_derives_microbatches(overrides, dp, micro, expected):
    settings = resolve_settings(SPEC, compose(*overrides))
    assert settings.grid.dp == dp
    assert settings.trainer.batch.per_device_train_batch_size == micro
    assert settings.num_microbatches == expected
    assert settings.global_batch_size == micro * expected * dp
    # gradient_accumulation_steps from train.yaml (4) is superseded
    assert settings.trainer.batch.gradient_accumulation_steps == 4


def test_unknown_model_option_fails_at_compose():
    with pytest.raises(ConfigCompositionException) as info:
        compose("model=nope")
    message = str(info.value)
    assert "model/nope" in message
    assert re.search(r"Available options in 'model':\s+demo\s+gpt2\s", message) and "gpt3-175b" in message


def test_zero_global_batch_size_rejected():
    problems = problems_of("trainer.global_batch_size=0")
    assert any("trainer.global_batch_size" in p for p in problems)


def test_zero_micro_batch_with_global_batch_size_is_a_config_error():
    problems = problems_of("trainer.per_device_train_batch_size=0", "trainer.global_batch_size=16")
    assert any("trainer.per_device_train_batch_size=0" in p for p in problems)


def test_zero_heads_is_a_config_error():
    problems = problems_of("model.num_heads=0")
    assert any("model.num_heads=0" in p for p in problems)


def test_invalid_degree_does_not_hide_model_problems():
    problems = problems_of("parallel.dp=0", "model.num_heads=3")
    assert "model.hidden_size=128 is not divisible by model.num_heads=3" in problems


def test_spec_and_settings_survive_pickling_for_spawned_workers():
    """With the spawn start method (the default with CUDA) both cross a process boundary."""
    import pickle

    settings = resolve_settings(SPEC, compose())
    spec_copy, settings_copy = pickle.loads(pickle.dumps((SPEC, settings)))
    assert spec_copy.tokens_per_sample(settings_copy.model_cfg) == 128
    assert settings_copy.grid == settings.grid and settings_copy.num_microbatches == 4


def test_recompute_and_schedule_settings_resolve():
    settings = resolve_settings(SPEC, compose(
        "model=toy", "parallel=pp2", "trainer.train_schedule=shifted_critical_path",
        "trainer.activation_checkpoint_ratio=0.5", "trainer.gradient_accumulation_steps=4"))
    assert settings.trainer.schedule.activation_checkpointing  # the documented default
    assert settings.trainer.schedule.activation_checkpoint_ratio == 0.5
    interleaved = resolve_settings(SPEC, compose("model=toy", "parallel=pp2", "trainer.train_schedule=interleaved_1f1b",
                                                 "trainer.gradient_accumulation_steps=4"))
    assert interleaved.trainer.schedule.chunks == 2
    alias = resolve_settings(SPEC, compose("model=toy", "parallel=pp2", "trainer.train_schedule=early_recompute_1f1b"))
    assert alias.trainer.schedule.train_schedule == "early_recompute_1f1b"


@pytest.mark.parametrize("overrides,message", [
    (["trainer.train_schedule=shifted_critical_path", "trainer.gradient_accumulation_steps=4"],
     "needs trainer.activation_checkpointing=true and trainer.activation_checkpoint_ratio"),
    (["trainer.train_schedule=shifted_critical_path", "trainer.activation_checkpoint_ratio=0.5",
      "trainer.gradient_accumulation_steps=3"], "num_microbatches >= max(4, num_stages)"),
    (["trainer.train_schedule=interleaved_1f1b", "trainer.gradient_accumulation_steps=3"],
     "multiple of num_stages"),
    (["trainer.pipeline_chunks=2"], "pipeline_chunks=2 needs an interleaved schedule"),
    (["trainer.pipeline_chunks=0"], "pipeline_chunks=0 must be a positive integer"),
    (["trainer.activation_checkpoint_ratio=1.5"], "activation_checkpoint_ratio=1.5 must be in [0, 1]"),
    (["trainer.activation_checkpoint_ratio=[0.5,0.2,0.1]"], "must hold 2 values in [0, 1]"),
    (["trainer.checkpoint_num_layers=0"], "checkpoint_num_layers=0 must be a positive integer"),
    (["trainer.activation_checkpointing=selective", "trainer.torch_compile=true"],
     "trainer.activation_checkpointing=selective saves outputs operator by operator, but trainer.torch_compile"),
])
def test_bad_schedule_and_recompute_settings(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve_settings(SPEC, compose("model=toy", "parallel=pp2", *overrides))


def test_selective_recomputation_composes_with_the_ratio_and_pre_checkpointing_schedules():
    settings = resolve_settings(SPEC, compose(
        "model=toy", "parallel=pp2", "trainer.train_schedule=shifted_critical_path",
        "trainer.activation_checkpointing=selective", "trainer.selective_recompute=attention",
        "trainer.activation_checkpoint_ratio=0.5", "trainer.gradient_accumulation_steps=4"))
    assert settings.trainer.schedule.selective_mode == "attention"
    plain = resolve_settings(SPEC, compose("model=toy", "parallel=pp2", "trainer.selective_recompute=attention"))
    assert plain.trainer.schedule.selective_mode is None  # read only with activation_checkpointing=selective


def test_overlap_level_two_refuses_recompute():
    with pytest.raises(ConfigError, match="cannot recompute"):
        resolve_settings(SPEC, compose("model=toy", "parallel=tp2", "trainer.tp_overlapping_level=2"))


@pytest.mark.parametrize(("overrides", "message"), [
    (["parallel=dp2", "trainer.torch_compile=true"], "trainer.zero_stage=3 gathers each stage part's parameters"),
    (["parallel=dp2_tp2_pp2", "trainer.tp_overlapping_level=2", "trainer.activation_checkpointing=false"],
     "trainer.zero_stage=3 reduces gradients as autograd produces them"),
])
def test_zero3_refuses_what_skips_its_hooks(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve_settings(SPEC, compose("model=toy", "trainer.zero_optimization=true", "trainer.zero_stage=3",
                                       *overrides))
    settings = resolve_settings(SPEC, compose("model=toy", "parallel=dp2", "trainer.zero_optimization=true",
                                              "trainer.zero_stage=3"))
    assert settings.trainer.zero.stage == 3
