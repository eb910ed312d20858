"""The gpt recipe end to end: one run through its real train.py, the rest through merak.run in this process
(layouts, compiled stages, config errors, plans). Launchers and sweeps: test_launch_modes.py."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import hydra.errors
import pytest
from train_py import run_in_process

from merak.config import ConfigError

pytestmark = pytest.mark.recipe

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "recipes/gpt/train.py"
TOY = ["model=toy", "trainer.per_device_train_batch_size=2", "trainer.gradient_accumulation_steps=4"]


def _env(cache_dir) -> dict:
    env = dict(os.environ, MERAK_CACHE_DIR=str(cache_dir), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def _train(args, cache_dir, cwd=REPO, timeout=240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TRAIN), *args], cwd=cwd, env=_env(cache_dir),
                          capture_output=True, text=True, timeout=timeout)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(300)
def test_train_writes_metrics_and_summary(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    # Started from another directory: the shared conf/ must still be found.
    result = _train([*TOY, "parallel=dp2_pp2", "trainer.max_steps=4", f"hydra.run.dir={run_dir}"],
                    cache_dir, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = _metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    for record in metrics:
        assert {"loss", "learning_rate", "grad_norm", "tokens_per_s", "samples_per_s", "step_time_s"} <= set(record)
        assert record["tokens_per_s"] > 0
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["layout"] == {"dp": 2, "tp": 1, "pp": 2}
    assert summary["steps"] == 4 and summary["global_batch_size"] == 16
    assert [s["stage"] for s in summary["stages"]] == [0, 1]
    assert all(s["parameter_bytes"] > 0 and s["peak_rss_bytes"] > 0 for s in summary["stages"])
    assert summary["final_loss"] == pytest.approx(metrics[-1]["loss"])
    printed = result.stdout + result.stderr
    assert "run summary" in printed and "tokens/s" in printed and "peak RSS" in printed


@pytest.mark.timeout(300)
def test_same_losses_single_process_and_3d(tmp_path, cache_dir):
    """The recipe's wiring of every axis at once: one process and dp2 x tp2 x pp2 (sequence parallel,
    overlap level 1) print the same loss curve and count the same model FLOPs. (Each layout against a
    plain PyTorch loop: tests/dist/test_parity.py, test_model_tensor_parallel.py.)"""
    runs, flops = {}, {}
    for name, layout in (("single", ["parallel=single", "trainer.gradient_accumulation_steps=8",
                                     "trainer.per_device_train_batch_size=2"]),
                         ("dp2_tp2_pp2", ["parallel=dp2_tp2_pp2", "trainer.sequence_parallel=true",
                                          "trainer.tp_overlapping_level=1"])):
        summary = run_in_process("gpt", [*TOY, *layout, "trainer.max_steps=3"], tmp_path / name)
        runs[name] = [m["loss"] for m in _metrics(tmp_path / name)]
        flops[name] = summary["flops"]["model_flops_per_step"]
    assert len(runs["single"]) == 3
    assert runs["single"] == pytest.approx(runs["dp2_tp2_pp2"], rel=1e-6)
    # The model's FLOPs do not depend on the layout (tp ranks do not each count the replicated layers).
    assert flops["single"] > 0 and flops["dp2_tp2_pp2"] == flops["single"], flops


@pytest.mark.timeout(300)
def test_torch_compile_through_the_recipe(tmp_path, cache_dir, capfd, caplog):
    """trainer.torch_compile=true at pp=2 (aot_eager here; inductor's numbers: tests/dist/test_compiled_parity.py):
    the eager loss curve, every range compiled, the compile time reported and printed."""
    caplog.set_level(logging.INFO)
    losses, summaries = {}, {}
    for name, flags in (("eager", []), ("compiled", ["trainer.torch_compile=true",
                                                      "trainer.torch_compile_backend=aot_eager"])):
        summaries[name] = run_in_process("gpt", [*TOY, "parallel=pp2", "trainer.max_steps=3", *flags], tmp_path / name)
        losses[name] = [m["loss"] for m in _metrics(tmp_path / name)]
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=1e-6)
    report = summaries["compiled"]["compile"]
    assert report["enabled"] and report["backend"] == "aot_eager" and report["eager_ranges"] == {}
    assert report["compile_s"] > 0 and not summaries["eager"]["compile"]["enabled"]
    printed = "".join(capfd.readouterr()) + caplog.text  # the workers' output and the launcher's log
    assert "compiled stages    aot_eager" in printed and "s compiling (slowest rank)" in printed


@pytest.mark.timeout(60)
@pytest.mark.parametrize("overrides,expected", [
    (["parallel.pp=8", "trainer.split_method=layer_split"], "only 5 shards for pp=8 stages"),
    (["trainer.train_schedule=zigzag"], "trainer.train_schedule='zigzag' is unknown"),
    (["model.num_heads=3"], "not divisible by model.num_heads=3"),
    (["data=files", "data.files=[/nonexistent/train_context.csv]"], "/nonexistent/train_context.csv"),
    (["model=gpt-unknown"], "Could not find 'model/gpt-unknown'"),
    (["parallel=tp2", "trainer.parallel_vocab=true"],
     "transformer.wte vocabulary size = 50257 is not divisible by tp=2 (pad the vocabulary, e.g. to 50432"),
    (["parallel=tp2", "parallel.tp=3"], "model.num_heads=4 is not divisible by parallel.tp=3"),
    (["parallel=tp2", "trainer.tp_overlapping_level=3"], "trainer.tp_overlapping_level=3; supported levels"),
    (["parallel=tp2", "trainer.sequence_dim=-1"], "trainer.sequence_dim=-1 must be a non-negative integer"),
])
def test_bad_config_fails_before_workers_start(overrides, expected, tmp_path, cache_dir):
    """In this process: composing fails, or merak.run raises ConfigError before any worker exists
    (train.py's exit status and one-line message for such an error: tests/recipes/test_console.py)."""
    with pytest.raises((ConfigError, hydra.errors.HydraException)) as error:
        run_in_process("gpt", [*TOY, *overrides], tmp_path)
    assert expected in str(error.value)
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.timeout(300)
def test_dry_run_prints_and_writes_the_plan(tmp_path, cache_dir, capfd, caplog):
    caplog.set_level(logging.INFO)
    run_dir = tmp_path / "plan"
    # A global batch larger than the whole text: a dry run plans, it does not need the data to hold a batch.
    text = tmp_path / "small.txt"
    text.write_text("".join(f"line {i} of a text far smaller than one global batch\n" for i in range(30)))
    run_in_process("gpt", ["model=toy", "trainer.per_device_train_batch_size=2", "trainer.global_batch_size=64",
                           "data=files", f"data.files=[{text}]", "parallel=pp4", "parallel.tp=2", "dry_run=true",
                           "trainer.partition_method=autopipe"], run_dir)
    report = json.loads((run_dir / "partition.json").read_text())
    assert not (run_dir / "metrics.jsonl").exists()  # nothing trained
    assert report["trace_method"] == "export" and report["partition_method"] == "autopipe"
    assert report["built_on_meta"]  # only planned: even a small model's weights are never made
    # The plan is made for tp rank 0's shard: every change of the TP plan is listed.
    assert "transformer.h.3.attn.c_attn: column (3 fused blocks)" in report["tensor_parallel"]["changes"]
    bounds = report["boundaries"]
    assert len(bounds) == 5 and bounds[0] == 0 and bounds[-1] == report["num_shards"]
    assert all(a < b for a, b in zip(bounds, bounds[1:]))
    stages = report["stages"]
    assert [s["stage"] for s in stages] == [0, 1, 2, 3]
    assert all(s["num_parameters"] > 0 and s["estimated_memory_bytes"] > 0 for s in stages)
    # autopipe balances compute: the LM head's matmul makes the last stage the heaviest and shortest.
    flops = [s["forward_flops"] for s in stages]
    assert flops[-1] == max(flops) and bounds[-1] - bounds[-2] == 1
    # Every boundary but the last sends the hidden states among its values: [micro batch, seq, hidden],
    # or [micro batch, seq / tp, hidden] inside the sequence-parallel region (train.yaml turns it on).
    full, chunk = "float32[2, 32, 32]", "float32[2, 16, 32]"
    for stage in stages[:-1]:
        assert {full, chunk} & set(stage["sends"].values()), stage["sends"]
    assert any(chunk in stage["sends"].values() for stage in stages[:-1])
    printed = "".join(capfd.readouterr()) + caplog.text  # the workers' output and the launcher's log
    assert "pipeline plan (gpt / toy, pp=4)" in printed and "fwd FLOPs" in printed
    # The per-module tensor-parallel plan goes to a file: a large model's would be hundreds of lines.
    assert "transformer.h.3.attn.c_attn" in (run_dir / "tp_plan.txt").read_text()
    assert "transformer.h.3.attn.c_attn" not in printed and "listed in" in printed


@pytest.mark.timeout(420)
def test_gpt3_175b_is_planned_on_one_cpu_process(tmp_path, cache_dir):
    run_dir = tmp_path / "giant"
    result = _train(["model=gpt3-175b", "parallel=pp4", "parallel.pp=8", "dry_run=true",
                     "trainer.per_device_train_batch_size=1", f"hydra.run.dir={run_dir}"], cache_dir, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((run_dir / "partition.json").read_text())
    assert report["built_on_meta"]
    total = sum(s["num_parameters"] for s in report["stages"])
    tied = 50257 * 12288  # the embedding is counted on the first and the last stage
    assert total - tied == pytest.approx(174.604e9, rel=1e-4)
    assert len(report["stages"]) == 8
    assert report["peak_rss_bytes"] < 2 * 1024**3  # weights are never allocated
    # The default plan cuts where only the hidden state crosses: no mask, no MLP activation.
    assert report["split_method"] == "min_bytes"
    for stage in report["stages"][:-1]:
        assert list(stage["sends"].values()) == ["float32[1, 1024, 12288]"], stage["sends"]
    assert any("repeated" in note for note in report["notes"])  # 3 of the 96 blocks exported


@pytest.mark.timeout(240)
def test_data_parallel_buckets_start_during_the_last_backward(tmp_path, cache_dir):
    """dp2 x pp2 with small buckets: the timeline of the last step has every bucket of a stage with
    overlapped parameters started before that stage's last backward ended (the wait for them comes at the
    step's end), and timeline.json carries them on their own rows. The toy is widened so that its blocks,
    not only the tied embedding (reduced at the step's end, after its sum between the stages), have
    gradients to reduce."""
    summary = run_in_process("gpt", [*TOY, "model.hidden_size=128", "parallel=dp2_pp2", "trainer.max_steps=2",
                                     "trainer.grad_bucket_mb=0.25", "trainer.wall_clock_breakdown=true",
                                     "trainer.activation_checkpointing=false", "trainer.disable_tqdm=true"], tmp_path)
    stages = summary["timeline"]["dp_reductions"]
    assert stages, summary["timeline"]
    for stage in stages:
        buckets = stage["buckets"]
        assert len(buckets) >= 2, stage
        assert stage["started_before_last_backward_end"] >= len(buckets) - 1, stage
        assert all(b["start"] <= b["end"] for b in buckets)
    trace = json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
    assert sum(event.get("cat") == "dp_reduction" for event in trace) == sum(len(s["buckets"]) for s in stages)
