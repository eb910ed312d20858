"""Checkpoints through the real runner: exact resume, resharding, crashes, corruption, export.

Each run is ``merak.run`` on the gpt recipe's composed config (workers forked
by the runner, as ``train.py`` does).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import merak
from merak.checkpoint import save as checkpoint_save
from merak.config import ConfigError
from merak.distributed.launch import WorkerFailed
from recipes.gpt.spec import SPEC

# cache_dir: prepared data goes to the session's private cache, whichever test runs first.
pytestmark = [pytest.mark.dist, pytest.mark.usefixtures("cache_dir")]

REPO = Path(__file__).resolve().parents[2]
TOY = ["model=toy", "trainer.per_device_train_batch_size=2", "trainer.global_batch_size=16",
       "trainer.learning_rate=1e-3", "trainer.warmup_steps=1", "trainer.lr_scheduler_type=cosine",
       "launcher.timeout_s=120"]


def _compose(overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "recipes/gpt/conf"), version_base=None):
        return compose(config_name="train", overrides=list(overrides))


def _run(run_dir: Path, *overrides) -> dict:
    return merak.run(SPEC, _compose([*TOY, f"trainer.output_dir={run_dir}", *overrides]))


def _metrics(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {row["step"]: row for row in map(json.loads, lines)}


def _files(checkpoint: Path, folder: str) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((checkpoint / folder).glob("*"))}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", [
    ["parallel=dp2_pp2", "trainer.zero_optimization=true", "trainer.zero_stage=3", "trainer.fp16=true",
     "trainer.initial_scale_power=12", "model.dropout=0.1"],
    ["parallel=dp2", "trainer.zero_optimization=true", "trainer.train_schedule=1f1b"],
], ids=["dp2-pp2-zero3-fp16-dropout", "dp2-zero1"])
def test_resume_is_bit_exact(layout, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _run(straight, *layout, "trainer.max_steps=4", "trainer.save=true", "trainer.save_steps=2")
    resumed.mkdir()
    shutil.copytree(straight / "checkpoint-2", resumed / "checkpoint-2")
    summary = _run(resumed, *layout, "trainer.max_steps=4", "trainer.save=true", "trainer.save_steps=2",
                   "trainer.resume_from_checkpoint=true")
    assert summary["checkpoints"]["resumed_from"] == str(resumed / "checkpoint-2")
    assert summary["checkpoints"]["saved"] == [str(resumed / "checkpoint-4")]
    # Per-rank memory: ZeRO keeps a different (about half) share of optimizer state on each dp rank.
    world = summary["layout"]["dp"] * summary["layout"]["pp"]
    assert [r["rank"] for r in summary["ranks"]] == list(range(world))
    assert all(0 < r["optimizer_state_bytes"] < 8 * r["num_parameters"] for r in summary["ranks"])
    want, got = _metrics(straight), _metrics(resumed)
    assert sorted(got) == [3, 4]
    for step in (3, 4):
        for key in ("loss", "grad_norm", "learning_rate", "loss_scale", "skipped"):
            assert got[step][key] == want[step][key], (step, key)
    # Weights, optimizer pieces and RNG states after the last step: the same bytes.
    for folder in ("model", "optimizer", "rng"):
        assert _files(resumed / "checkpoint-4", folder) == _files(straight / "checkpoint-4", folder), folder


@pytest.fixture(scope="module")
def tp_source(tmp_path_factory):
    """4 steps at dp2 x tp2 x pp2 with ZeRO-1 and sequence parallelism, saved after step 2 and 4."""
    run_dir = tmp_path_factory.mktemp("source")
    _run(run_dir, "parallel=dp2_tp2_pp2", "model.vocab_size=50304", "trainer.zero_optimization=true",
         "trainer.max_steps=4", "trainer.save=true", "trainer.save_steps=2")
    return run_dir


@pytest.mark.timeout(400)
@pytest.mark.parametrize("target", [
    ["parallel=single"],
    ["parallel=pp4", "trainer.zero_optimization=false"],
    ["parallel=dp4", "trainer.zero_optimization=true", "trainer.zero_stage=3"],
    ["parallel=tp2", "trainer.sequence_parallel=false"],
], ids=["single", "pp4", "dp4-zero3", "tp2"])
def test_checkpoint_loads_into_other_layouts(target, tmp_path, tp_source):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copytree(tp_source / "checkpoint-2", run_dir / "checkpoint-2")
    _run(run_dir, "model.vocab_size=50304", *target, "trainer.max_steps=4", "trainer.resume_from_checkpoint=true")
    want, got = _metrics(tp_source), _metrics(run_dir)
    assert sorted(got) == [3, 4]
    for step in (3, 4):  # step 3: the weights; step 4: also the optimizer state and lr schedule
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=1e-6), step
        assert got[step]["grad_norm"] == pytest.approx(want[step]["grad_norm"], rel=1e-5), step
        assert got[step]["learning_rate"] == pytest.approx(want[step]["learning_rate"], rel=1e-12), step


def _crash_rank1_at_step4(original):
    def rank_files(engine, staging, *, rank, options):
        if rank == 1 and staging.endswith(".checkpoint-4.partial"):
            (Path(staging) / "model" / "half-written.safetensors").write_bytes(b"\0" * 100)
            os._exit(17)  # the worker dies in the middle of the save
        return original(engine, staging, rank=rank, options=options)
    return rank_files


@pytest.mark.timeout(300)
def test_crash_during_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    args = ["parallel=dp2_pp2", "trainer.max_steps=6", "trainer.save=true", "trainer.save_steps=2",
            "trainer.resume_from_checkpoint=true"]
    monkeypatch.setattr(checkpoint_save, "rank_files", _crash_rank1_at_step4(checkpoint_save.rank_files))
    started = time.monotonic()
    with pytest.raises(WorkerFailed, match="exit code 17|exitcode 17|17"):
        _run(run_dir, *args)
    assert time.monotonic() - started < 90, "the run did not stop promptly after a worker died"
    assert (run_dir / "checkpoint-2" / "manifest.json").is_file()
    assert not (run_dir / "checkpoint-4").exists() and (run_dir / ".checkpoint-4.partial").exists()
    uninterrupted = _metrics(run_dir)  # steps 1-4 ran straight through (the crash came in step 4's save)
    assert sorted(uninterrupted) == [1, 2, 3, 4]
    monkeypatch.undo()
    # Restarted with the same command it continues from step 2, replacing the half-written save, and
    # computes steps 3 and 4 exactly as the run that had not stopped did.
    _run(run_dir, *args)
    assert sorted(_metrics(run_dir)) == [1, 2, 3, 4, 5, 6]
    assert (run_dir / "checkpoint-6" / "manifest.json").is_file()
    assert not (run_dir / ".checkpoint-4.partial").exists()
    resumed = _metrics(run_dir)
    for step in (3, 4):
        for key in ("loss", "grad_norm", "learning_rate"):
            assert resumed[step][key] == uninterrupted[step][key], (step, key)


@pytest.mark.timeout(300)
def test_bad_checkpoints_get_clear_errors(tmp_path):
    run_dir = tmp_path / "run"
    _run(run_dir, "parallel=pp2", "trainer.max_steps=2", "trainer.save=true", "trainer.save_steps=1",
         "trainer.save_total_limit=1", "trainer.no_save_rng=true")
    assert sorted(p.name for p in run_dir.glob("checkpoint-*")) == ["checkpoint-2"]  # the limit rotated 1 out
    assert not list((run_dir / "checkpoint-2" / "rng").iterdir())
    with pytest.raises(ConfigError, match="no such directory"):
        _run(tmp_path / "other", "trainer.max_steps=3", f"trainer.resume_from_checkpoint={tmp_path}/nowhere")
    partial = tmp_path / "partial"
    shutil.copytree(run_dir / "checkpoint-2", partial)
    (partial / "manifest.json").unlink()
    with pytest.raises(ConfigError, match="not a complete merak checkpoint"):
        _run(tmp_path / "other", "trainer.max_steps=3", f"trainer.resume_from_checkpoint={partial}")
    with pytest.raises(ConfigError, match="finetune"):
        _run(tmp_path / "other", "trainer.max_steps=3", "trainer.finetune=true")
    # A flipped byte in a weights file: found before any worker starts, the file named.
    corrupt = tmp_path / "corrupt"
    shutil.copytree(run_dir / "checkpoint-2", corrupt)
    weights = sorted((corrupt / "model").glob("*.safetensors"))[-1]  # the stage holding only tied weights writes none
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=rf"corrupt: model/{weights.name} is damaged \(CRC32"):
        _run(tmp_path / "other", "parallel=pp2", "trainer.max_steps=3", f"trainer.resume_from_checkpoint={corrupt}")


@pytest.mark.timeout(300)
def test_a_checkpoint_resumes_only_its_own_model(tmp_path):
    """Two identical runs save identical generator states; a checkpoint is resumed only into the model
    it holds (refused before any worker starts, naming what differs) and never saved over by another
    model; a partial load into another model is asked for by name."""
    first, second = tmp_path / "first", tmp_path / "second"
    for run_dir, unrelated in ((first, 1), (second, 2)):
        random.seed(unrelated)  # whatever drew from the global generators before (another process start)
        np.random.seed(unrelated)
        _run(run_dir, "parallel=pp2", "trainer.max_steps=2", "trainer.save=true", "trainer.save_steps=2")
    assert _files(first / "checkpoint-2", "rng") == _files(second / "checkpoint-2", "rng")

    resume = ["parallel=pp2", "trainer.max_steps=3", "trainer.save=true", "trainer.save_steps=1",
              "trainer.save_total_limit=1", "trainer.resume_from_checkpoint=true"]
    with pytest.raises(ConfigError, match=r"holds another model .*n_layer 4 -> 2.*tensors only in the checkpoint: "
                                          r"transformer\.h\.2\."):
        _run(first, *resume, "model.num_layers=2")
    with pytest.raises(ConfigError, match=r"holds another model .*config: n_head 4 -> 2\)"):  # the same shapes
        _run(first, *resume, "model.num_heads=2")
    with pytest.raises(ConfigError, match="holds checkpoints of another model"):  # not resuming, but saving there
        _run(first, "parallel=pp2", "model.num_layers=2", "trainer.max_steps=1", "trainer.save=true")
    assert sorted(p.name for p in first.glob("checkpoint-*")) == ["checkpoint-2"]

    partial = _run(tmp_path / "partial", "parallel=pp2", "model.num_layers=2", "trainer.max_steps=1",
                   "trainer.finetune=true", "trainer.partial_load=true",
                   f"trainer.resume_from_checkpoint={first / 'checkpoint-2'}")
    fresh = _run(tmp_path / "fresh", "parallel=pp2", "model.num_layers=2", "trainer.max_steps=1")
    assert partial["first_loss"] < fresh["first_loss"] - 1e-3  # the shared embeddings and blocks were trained


@pytest.mark.timeout(300)
def test_finetune_and_no_optimizer_state(tmp_path):
    source = tmp_path / "source"
    _run(source, "parallel=dp2", "trainer.max_steps=2", "trainer.save=true", "trainer.no_save_optim=true")
    assert not list((source / "checkpoint-2" / "optimizer").iterdir())
    fresh, finetuned, resumed = tmp_path / "fresh", tmp_path / "finetuned", tmp_path / "resumed"
    _run(fresh, "parallel=dp2", "trainer.max_steps=2")
    _run(finetuned, "parallel=dp2", "trainer.max_steps=2", "trainer.finetune=true",
         f"trainer.resume_from_checkpoint={source / 'checkpoint-2'}")
    # Finetuning restarts the step and schedule (same lr as a fresh run) from the trained weights.
    f, t = _metrics(fresh), _metrics(finetuned)
    assert sorted(t) == [1, 2] and [t[s]["learning_rate"] for s in (1, 2)] == [f[s]["learning_rate"] for s in (1, 2)]
    assert t[1]["loss"] < f[1]["loss"] - 1e-3
    # Resuming a checkpoint without optimizer state continues the step with a fresh optimizer.
    _run(resumed, "parallel=dp2", "trainer.max_steps=3", f"trainer.resume_from_checkpoint={source / 'checkpoint-2'}")
    assert sorted(_metrics(resumed)) == [3]


@pytest.mark.timeout(300)
def test_export_to_hugging_face_and_back(tmp_path, toy_model_cfg, tp_source):
    """tp_source's checkpoint-2 (tp=2 x pp=2 with sequence parallelism, dp=2 with ZeRO-1) exported. Its step 3
    ran from the saved weights; each layout resumed from that checkpoint computes that step's loss again
    (test_checkpoint_loads_into_other_layouts)."""
    from transformers import GPT2LMHeadModel

    from merak.checkpoint.export import main as export_main
    from merak.data.batching import BatchPlan, stack_samples
    from recipes.gpt import data, model

    summary = json.loads((tp_source / "summary.json").read_text())
    out = tmp_path / "hf"
    (tmp_path / "a-file").write_text("")
    assert export_main([str(tp_source / "checkpoint-2"), str(tmp_path / "a-file")]) == 2  # one line, no traceback
    assert export_main([str(tp_source / "checkpoint-2"), str(out)]) == 0
    exported = GPT2LMHeadModel.from_pretrained(out).eval()
    assert exported.lm_head.weight is exported.transformer.wte.weight or torch.equal(
        exported.lm_head.weight, exported.transformer.wte.weight)
    # The parallel run from the checkpoint's weights computes the same loss on step 3's batch as
    # the exported model (the whole vocabulary's logits enter it).
    prepared = SPEC.prepare_data(_compose(TOY).data, _compose([*TOY, "model.vocab_size=50304"]).model)
    dataset = data.load(prepared, _compose([*TOY, "model.vocab_size=50304"]).model)
    plan = BatchPlan(num_samples=len(dataset), micro_batch_size=summary["global_batch_size"], num_microbatches=1,
                     seed=42)
    batch = stack_samples([dataset[i] for i in plan.global_batch(2).tolist()])
    with torch.no_grad():
        logits = exported(input_ids=batch["input_ids"]).logits
        loss = model.causal_lm_loss(logits, batch).item()
    assert _metrics(tp_source)[3]["loss"] == pytest.approx(loss, rel=1e-5)
    # And those weights start a parallel run in another layout (pretrained_weights).
    imported = tmp_path / "imported"
    _run(imported, "parallel=dp2_pp2", "model.vocab_size=50304", "trainer.max_steps=1",
         f"trainer.pretrained_weights={out}")
    batch = stack_samples([dataset[i] for i in plan.global_batch(0).tolist()])
    with torch.no_grad():
        loss = model.causal_lm_loss(exported(input_ids=batch["input_ids"]).logits, batch).item()
    assert _metrics(imported)[1]["loss"] == pytest.approx(loss, rel=1e-5)
