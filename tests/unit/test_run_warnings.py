"""Runs that work but not as the user may think get a warning before they start."""

from __future__ import annotations

import logging

from test_config import compose

from merak.config import resolve_settings
from merak.runner import _warn_if_batch_changed, warn_about_idle_stages
from recipes.gpt.spec import SPEC


def test_fewer_microbatches_than_stages_is_warned(caplog):
    settings = resolve_settings(SPEC, compose("parallel=pp4", "trainer.gradient_accumulation_steps=2",
                                              "trainer.global_batch_size=null"))
    with caplog.at_level(logging.WARNING, logger="merak.runner"):
        warn_about_idle_stages(settings)
    assert "pp=4 stages but 2 microbatches per step" in caplog.text
    assert "gradient_accumulation_steps (or global_batch_size) to at least 4" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="merak.runner"):
        warn_about_idle_stages(resolve_settings(SPEC, compose("parallel=pp4", "trainer.gradient_accumulation_steps=4",
                                                              "trainer.global_batch_size=null")))
    assert caplog.text == ""


def test_resuming_with_another_global_batch_is_warned(caplog):
    manifest = {"run": {"global_batch_size": 32}}
    with caplog.at_level(logging.WARNING, logger="merak.runner"):
        _warn_if_batch_changed("runs/a/checkpoint-8", manifest, 16)
    assert "runs/a/checkpoint-8 was trained with a global batch of 32 samples, this run uses 16" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="merak.runner"):
        _warn_if_batch_changed("runs/a/checkpoint-8", manifest, 32)
    assert caplog.text == ""
