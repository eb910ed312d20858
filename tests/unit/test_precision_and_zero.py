"""Pure unit tests of mixed precision, ZeRO pieces, optimizer construction and their config checks.

Covers merak.optim.precision (dtype, problems, the loss scaler), Piece from
merak.optim.distributed, merak.optim.schedule.make_optimizer (including the
elementwise property ZeRO relies on) and the optimizer, precision and
checkpoint checks of merak.config.resolve_settings. No process groups.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import hydra
import pytest
import torch
from torch import nn

from merak.config import ConfigError, resolve_settings
from merak.optim.distributed import Piece
from merak.optim.precision import LossScaler
from merak.optim.schedule import build_optimizer, make_optimizer
from merak.optim.settings import OptimizerSettings, PrecisionSettings
from recipes.gpt.spec import SPEC

CONF_DIR = str(Path(__file__).resolve().parents[2] / "recipes" / "gpt" / "conf")


# -- PrecisionSettings ------------------------------------------------------------


@pytest.mark.parametrize("options,dtype,master", [
    (PrecisionSettings(), torch.float32, False),
    (PrecisionSettings(fp16=True), torch.float16, True),
    (PrecisionSettings(bf16=True), torch.bfloat16, True),
])
def test_dtype_and_master_weights(options, dtype, master):
    assert options.dtype is dtype
    assert options.needs_master_weights is master


def test_valid_precision_settings_have_no_problems():
    assert PrecisionSettings().problems() == []
    assert PrecisionSettings(fp16=True, loss_scale=128.0, initial_scale_power=0, loss_scale_window=1, hysteresis=1,
                             min_loss_scale=0.5).problems() == []
    assert PrecisionSettings(bf16=True, initial_scale_power=64).problems() == []


@pytest.mark.parametrize("fields,needle", [
    ({"fp16": True, "bf16": True}, "trainer.fp16 and trainer.bf16 are both true"),
    ({"loss_scale": -1.0}, "trainer.loss_scale=-1.0"),
    ({"initial_scale_power": -1}, "trainer.initial_scale_power=-1"),
    ({"initial_scale_power": 65}, "trainer.initial_scale_power=65"),
    ({"loss_scale_window": 0}, "trainer.loss_scale_window=0"),
    ({"hysteresis": 0}, "trainer.hysteresis=0"),
    ({"min_loss_scale": 0.0}, "trainer.min_loss_scale=0.0"),
    ({"min_loss_scale": -2.0}, "trainer.min_loss_scale=-2.0"),
])
def test_each_invalid_precision_field_is_named(fields, needle):
    problems = PrecisionSettings(**fields).problems()
    assert len(problems) == 1, problems
    assert problems[0].startswith(needle), problems[0]


def test_precision_problems_are_all_listed():
    options = PrecisionSettings(fp16=True, bf16=True, loss_scale=-1.0, initial_scale_power=70, loss_scale_window=0,
                                hysteresis=0, min_loss_scale=0.0)
    problems = options.problems()
    assert len(problems) == 6
    for field in ("fp16", "loss_scale=", "initial_scale_power", "loss_scale_window", "hysteresis",
                  "min_loss_scale"):
        assert sum(p.startswith(f"trainer.{field}") for p in problems) == 1, field


# -- LossScaler ------------------------------------------------------------------


def scales_after(scaler: LossScaler, overflows) -> list[float]:
    """The scale after each update."""
    out = []
    for overflow in overflows:
        scaler.update(overflow)
        out.append(scaler.scale)
    return out


def test_static_fp16_scale_never_changes():
    scaler = LossScaler(PrecisionSettings(fp16=True, loss_scale=128.0))
    assert not scaler.dynamic
    assert scaler.scale == 128.0
    assert scales_after(scaler, [True] * 5) == [128.0] * 5
    assert set(scales_after(scaler, [False] * 2500)) == {128.0}
    assert scaler.steps == 2505


@pytest.mark.parametrize("options", [PrecisionSettings(), PrecisionSettings(bf16=True),
                                     PrecisionSettings(bf16=True, loss_scale=64.0)])
def test_scale_without_fp16_is_one(options):
    scaler = LossScaler(options)
    assert not scaler.dynamic
    assert scaler.scale == 1.0
    assert scales_after(scaler, [True, True, True, False, False]) == [1.0] * 5


def test_dynamic_scale_starts_at_two_to_the_initial_power():
    assert LossScaler(PrecisionSettings(fp16=True)).scale == 2.0 ** 32
    scaler = LossScaler(PrecisionSettings(fp16=True, initial_scale_power=16))
    assert scaler.dynamic
    assert scaler.scale == 65536.0


def test_hysteresis_two_shrinks_on_the_second_overflow():
    scaler = LossScaler(PrecisionSettings(fp16=True, initial_scale_power=10, hysteresis=2))
    scaler.update(True)
    assert scaler.scale == 1024.0  # the first overflow is tolerated
    assert scaler.hysteresis_left == 1
    scaler.update(True)
    assert scaler.scale == 512.0
    # Until a clean window refills it, every further overflow halves.
    assert scales_after(scaler, [True, True]) == [256.0, 128.0]


def test_hysteresis_one_shrinks_on_every_overflow():
    scaler = LossScaler(PrecisionSettings(fp16=True, initial_scale_power=10, hysteresis=1))
    assert scales_after(scaler, [True, True, True]) == [512.0, 256.0, 128.0]


@pytest.mark.parametrize("min_scale,expected", [(2.0, [4.0, 2.0, 2.0, 2.0]), (3.0, [4.0, 3.0, 3.0, 3.0])])
def test_min_loss_scale_is_a_floor(min_scale, expected):
    scaler = LossScaler(PrecisionSettings(fp16=True, initial_scale_power=3, hysteresis=1, min_loss_scale=min_scale))
    assert scales_after(scaler, [True] * 4) == expected


def test_scale_doubles_after_each_clean_window():
    scaler = LossScaler(PrecisionSettings(fp16=True, initial_scale_power=4, loss_scale_window=3))
    assert scales_after(scaler, [False] * 6) == [16.0, 16.0, 32.0, 32.0, 32.0, 64.0]


def test_window_counts_from_the_last_overflow_and_refills_hysteresis():
    scaler = LossScaler(PrecisionSettings(fp16=True, initial_scale_power=4, loss_scale_window=3, hysteresis=2))
    # overflow (tolerated), overflow (halves), three clean steps (doubles, refills), overflow
    # (tolerated again thanks to the refill), overflow (halves).
    assert scales_after(scaler, [True, True, False, False]) == [16.0, 8.0, 8.0, 8.0]
    assert scaler.hysteresis_left == 1
    scaler.update(False)
    assert scaler.scale == 16.0
    assert scaler.hysteresis_left == 2
    assert scales_after(scaler, [True, True]) == [16.0, 8.0]
    assert scaler.last_overflow_step == 6
    assert scaler.steps == 7


def test_state_dict_round_trip_reproduces_future_scales():
    options = PrecisionSettings(fp16=True, initial_scale_power=5, loss_scale_window=2, hysteresis=2)
    original = LossScaler(options)
    assert scales_after(original, [True, False, False, True, True, False]) == [32.0, 32.0, 64.0, 64.0, 32.0, 32.0]
    state = json.loads(json.dumps(original.state_dict()))
    assert state == {"scale": 32.0, "steps": 6, "last_overflow_step": 4, "hysteresis_left": 1}

    restored = LossScaler(options)
    restored.load_state_dict(state)
    assert restored.state_dict() == original.state_dict()
    future = [False, False, True, False, False, False, True, True, True, False, False]
    expected = [64.0, 64.0, 64.0, 64.0, 128.0, 128.0, 128.0, 64.0, 32.0, 32.0, 64.0]
    assert scales_after(original, future) == expected
    assert scales_after(restored, future) == expected
    # A scaler that did not load the state takes a different path.
    assert scales_after(LossScaler(options), future) != expected


# -- Piece -----------------------------------------------------------------------


def test_piece_example_five_in_four():
    pieces = [Piece.of(5, 4, i) for i in range(4)]
    assert [p.size for p in pieces] == [2, 2, 2, 2]
    assert [(p.start, p.stop) for p in pieces] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    assert [p.length for p in pieces] == [2, 2, 1, 0]
    assert all(p.numel == 5 for p in pieces)


def test_piece_of_nothing():
    for index in range(3):
        piece = Piece.of(0, 3, index)
        assert (piece.numel, piece.size, piece.start, piece.stop, piece.length) == (0, 0, 0, 0, 0)


@pytest.mark.parametrize("numel", [1, 2, 5, 7, 9, 10, 12, 35, 100])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 8])
def test_pieces_partition_the_range(numel, parts):
    pieces = [Piece.of(numel, parts, i) for i in range(parts)]
    size = -(-numel // parts)
    assert all(p.size == size for p in pieces)
    covered = [i for p in pieces for i in range(p.start, p.stop)]
    assert covered == list(range(numel))  # disjoint, in order, complete
    lengths = [p.length for p in pieces]
    assert all(0 <= n <= size for n in lengths)
    # Only trailing pieces may be short: the lengths never increase.
    assert lengths == sorted(lengths, reverse=True)
    assert all(n == size for n in lengths[:numel // size])


# -- make_optimizer --------------------------------------------------------------


def optimizer_of(params, kind, weight_decay=0.1):
    return make_optimizer(params, OptimizerSettings(optim=kind, learning_rate=0.01, weight_decay=weight_decay,
                                                    adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-7))


@pytest.mark.parametrize("kind,cls", [("adamw_torch", torch.optim.AdamW), ("sgd", torch.optim.SGD),
                                      ("adafactor", torch.optim.Adafactor)])
def test_make_optimizer_kinds(kind, cls):
    weight = nn.Parameter(torch.zeros(3, 4))
    optimizer = optimizer_of([(weight, True)], kind)
    assert type(optimizer) is cls
    assert optimizer.param_groups[0]["lr"] == 0.01
    if kind == "adamw_torch":
        assert optimizer.param_groups[0]["betas"] == (0.8, 0.95)
        assert optimizer.param_groups[0]["eps"] == 1e-7


def test_weight_decay_only_for_decaying_tensors():
    a, b, c = (nn.Parameter(torch.zeros(n)) for n in (2, 3, 4))
    optimizer = optimizer_of([(a, True), (b, False), (c, True)], "adamw_torch")
    assert len(optimizer.param_groups) == 2
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert [id(p) for p in decay["params"]] == [id(a), id(c)]
    assert [id(p) for p in no_decay["params"]] == [id(b)]


def test_no_empty_parameter_groups():
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3))
    only_plain = optimizer_of([(a, False), (b, False)], "sgd")
    assert [(len(g["params"]), g["weight_decay"]) for g in only_plain.param_groups] == [(2, 0.0)]
    only_decay = optimizer_of([(a, True)], "sgd")
    assert [(len(g["params"]), g["weight_decay"]) for g in only_decay.param_groups] == [(1, 0.1)]


def test_build_optimizer_decays_matrices_only_and_skips_frozen():
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    model[2].bias.requires_grad_(False)
    optimizer = build_optimizer(model.named_parameters(), OptimizerSettings(learning_rate=0.1, weight_decay=0.5))
    decay, no_decay = optimizer.param_groups
    assert [id(p) for p in decay["params"]] == [id(model[0].weight), id(model[2].weight)]
    assert [id(p) for p in no_decay["params"]] == [id(model[0].bias), id(model[1].weight), id(model[1].bias)]
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.5, 0.0)


def test_unknown_optimizer_names_the_choices():
    with pytest.raises(ValueError, match=re.escape("unknown optim 'lion'; choose one of adamw_torch, sgd, "
                                                   "adafactor")):
        optimizer_of([(nn.Parameter(torch.zeros(2)), True)], "lion")


def step_whole_and_pieces(kind: str, shape=(5, 7), parts=3, steps=3):
    """Step one 2-D parameter as a whole and as flat ZeRO pieces with the same gradients."""
    generator = torch.Generator().manual_seed(0)
    full = torch.randn(*shape, generator=generator)
    whole = nn.Parameter(full.clone())
    cuts = [Piece.of(full.numel(), parts, i) for i in range(parts)]
    pieces = [nn.Parameter(full.reshape(-1)[c.start:c.stop].clone()) for c in cuts]
    whole_opt = optimizer_of([(whole, True)], kind)
    piece_opt = optimizer_of([(p, True) for p in pieces], kind)
    for _ in range(steps):
        grad = torch.randn(*shape, generator=generator)
        whole.grad = grad.clone()
        for piece, cut in zip(pieces, cuts, strict=True):
            piece.grad = grad.reshape(-1)[cut.start:cut.stop].clone()
        whole_opt.step()
        piece_opt.step()
    return full, whole.detach(), torch.cat([p.detach() for p in pieces]).reshape(shape)


@pytest.mark.parametrize("kind", ["adamw_torch", "sgd"])
def test_elementwise_optimizers_step_pieces_exactly_as_the_whole(kind):
    full, whole, joined = step_whole_and_pieces(kind)
    assert [c.length for c in (Piece.of(35, 3, i) for i in range(3))] == [12, 12, 11]
    assert not torch.equal(whole, full)  # the steps did something
    assert torch.equal(joined, whole)


def test_adafactor_is_not_elementwise():
    """Why adafactor needs zero_allow_untested_optimizer: a 2-D tensor gets factored statistics."""
    _, whole, joined = step_whole_and_pieces("adafactor")
    assert not torch.allclose(joined, whole)


# -- config checks ---------------------------------------------------------------


def compose(*overrides: str):
    with hydra.initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return hydra.compose("train", overrides=list(overrides))


def problems_of(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        resolve_settings(SPEC, compose(*overrides))
    message = str(info.value)
    assert message.startswith("invalid configuration:\n  - ")
    return message.split("\n  - ")[1:]


def test_optimizer_settings_that_resolve():
    settings = resolve_settings(SPEC, compose("trainer.zero_optimization=true", "trainer.zero_stage=2",
                                              "trainer.fp16=true", "trainer.loss_scale=128",
                                              "trainer.prescale_gradients=true", "trainer.optim=sgd"))
    assert settings.trainer.zero.zero_stage == 2
    assert settings.trainer.precision.fp16 and settings.trainer.precision.loss_scale == 128
    untested = resolve_settings(SPEC, compose("trainer.optim=adafactor", "trainer.zero_optimization=true",
                                              "trainer.zero_allow_untested_optimizer=true"))
    assert untested.trainer.optimizer.optim == "adafactor"
    # Without ZeRO adafactor needs no permission.
    assert resolve_settings(SPEC, compose("trainer.optim=adafactor")).trainer.optimizer.optim == "adafactor"


@pytest.mark.parametrize("overrides,needle", [
    (["trainer.fp16=true", "trainer.bf16=true"], "trainer.fp16 and trainer.bf16 are both true"),
    (["trainer.zero_optimization=true", "trainer.zero_stage=4"], "trainer.zero_stage=4: stages 1 (optimizer state), 2"),
    (["trainer.optim=adafactor", "trainer.zero_optimization=true"], "trainer.optim=adafactor is not elementwise"),
    (["trainer.zero_reduce_bucket_size=0"], "trainer.zero_reduce_bucket_size=0 must be a positive whole number"),
    (["trainer.zero_allgather_bucket_size=2.5"], "trainer.zero_allgather_bucket_size=2.5"),
    (["trainer.zero_reduce_bucket_size=inf"], "trainer.zero_reduce_bucket_size=inf must be a positive whole number"),
    (["trainer.prescale_gradients=true", "trainer.gradient_predivide_factor=2.0"],
     "trainer.gradient_predivide_factor applies only without prescaling"),
    (["trainer.gradient_predivide_factor=0"], "trainer.gradient_predivide_factor=0.0 must be positive"),
    (["trainer.save=true", "trainer.save_steps=0"], "trainer.save_steps=0 must be a positive integer"),
    (["trainer.save_total_limit=0"], "trainer.save_total_limit=0"),
    (["parallel=tp2", "model.vocab_size=50304", "trainer.tp_overlapping_level=2",
      "trainer.activation_checkpointing=false", "trainer.zero_optimization=true", "trainer.zero_stage=2"],
     "trainer.zero_stage=2 reduces gradients as autograd"),
    (["trainer.finetune=true"], "trainer.finetune=true loads weights from a checkpoint"),
    (["trainer.pretrained_weights=/models/gpt2", "trainer.resume_from_checkpoint=/runs/a/checkpoint-5"],
     "trainer.pretrained_weights and trainer.resume_from_checkpoint both set"),
    (["trainer.optim=unknown"], "trainer.optim='unknown'; choose one of adamw_torch, sgd, adafactor"),
])
def test_invalid_optimizer_and_checkpoint_settings(overrides, needle):
    problems = problems_of(*overrides)
    assert len(problems) == 1, problems
    assert problems[0].startswith(needle), problems[0]


def test_zero_settings_unused_without_zero():
    # zero_stage is only checked when ZeRO is on, and save_steps only when saving.
    settings = resolve_settings(SPEC, compose("trainer.zero_stage=4", "trainer.save_steps=0"))
    assert settings.trainer.zero.zero_stage == 4 and not settings.trainer.zero.zero_optimization
