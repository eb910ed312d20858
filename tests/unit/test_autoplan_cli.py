"""merak-plan (merak.autoplan.cli): the table, plan.json, --compare, and the exit status of bad requests."""

from __future__ import annotations

import contextlib
import io
import json
import logging

import pytest

from merak.autoplan.cli import main, parse_layout
from merak.autoplan.layout import Layout

TOY = ["gpt", "model=toy", "trainer.global_batch_size=16", "--world", "4"]


def test_parse_layout_fills_in_data_parallel_and_microbatches():
    name, layout = parse_layout("megatron:tp=2,pp=2,mb=2,schedule=interleaved_1f1b,chunks=2,recompute=1,zero=1,sp=1",
                                world_size=8, global_batch_size=16)
    assert name == "megatron"
    assert layout == Layout(dp=2, tp=2, pp=2, micro_batch_size=2, num_microbatches=4, schedule="interleaved_1f1b",
                            chunks=2, recompute="full", zero_stage=1, sequence_parallel=True)
    unnamed, plain = parse_layout("pp=4", world_size=4, global_batch_size=16)
    assert unnamed == "compare"
    assert plain == Layout(dp=1, tp=1, pp=4, micro_batch_size=1, num_microbatches=16)


def test_parse_layout_takes_selective_recomputation_and_zero_3():
    text = "megatron-core:tp=4,pp=8,mb=2,schedule=interleaved_1f1b,chunks=6,sp=1,recompute=selective,zero=3"
    name, layout = parse_layout(text, world_size=512, global_batch_size=2048)
    assert name == "megatron-core"
    assert (layout.dp, layout.num_microbatches, layout.recompute, layout.zero_stage) == (16, 64, "selective", 3)
    for value, mode in (("0", "off"), ("off", "off"), ("1", "full"), ("full", "full")):
        assert parse_layout(f"x:recompute={value}", world_size=4, global_batch_size=16)[1].recompute == mode


@pytest.mark.parametrize(("text", "problem"), [
    ("x:pipeline=4", "unknown key 'pipeline'"),
    ("x:dp=2,tp=4", "dp\\*tp\\*pp = 8, the world is 4"),
    ("x:dp=4,mb=3", "does not divide"),
    ("x:tp=two", "invalid literal"),
    ("x:recompute=some", "use 0, 1 or selective"),
    ("x:dp=4,zero=4", "zero_stage=4: choose one of 0, 1, 2, 3"),
])
def test_parse_layout_rejects_bad_layouts(text, problem):
    with pytest.raises(ValueError, match=problem):
        parse_layout(text, world_size=4, global_batch_size=16)


@pytest.fixture(scope="module")
def toy_run(cache_dir, tmp_path_factory):
    """``merak-plan`` on the toy GPT with a compared layout: (exit status, plan.json, printed table)."""
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = main([*TOY, "--out", str(out), "--top", "5", "--compare", "mine:pp=4,mb=2"])
    return status, json.loads(out.read_text()) if out.exists() else None, printed.getvalue()


def test_cli_writes_the_plan(toy_run):
    status, payload, _ = toy_run
    assert status == 0
    assert {"best", "candidates", "compared"} <= set(payload)
    assert payload["best"]["fits"] is True
    assert payload["best"]["key"] == payload["candidates"][0]["key"]
    assert payload["world_size"] == 4 and payload["global_batch_size"] == 16
    assert len(payload["candidates"]) == min(50, payload["num_candidates"])
    compared = payload["compared"]
    assert [c["name"] for c in compared] == ["mine"]
    assert compared[0]["key"] == "dp1 tp1 pp4 mb2 M8 1f1b rc0 z0 sp0"
    assert compared[0]["simulated"] is True
    assert compared[0]["predicted_step_s"] > payload["best"]["predicted_step_s"]


def test_cli_prints_the_table(toy_run):
    _, payload, table = toy_run
    lines = table.splitlines()
    header = next(line for line in lines if line.startswith("#"))
    assert "step (ms)" in header and "why not first" in header
    rows = lines[lines.index(header) + 1:]
    assert [row.split()[0] for row in rows] == ["1", "2", "3", "4", "5", "mine"]
    assert "(chosen)" in rows[0]
    assert lines[0].startswith("gpt/toy on 4 x cpu")


def test_cli_bad_compare_key_exits_2(cache_dir, tmp_path, caplog):
    out = tmp_path / "plan.json"
    with caplog.at_level(logging.ERROR, logger="merak.plan"):
        assert main([*TOY, "--out", str(out), "--compare", "mine:pipeline=4"]) == 2
    assert "unknown key 'pipeline'" in caplog.text
    assert not out.exists()


def test_cli_compare_of_another_world_exits_2(cache_dir, tmp_path, caplog):
    with caplog.at_level(logging.ERROR, logger="merak.plan"):
        assert main([*TOY, "--out", str(tmp_path / "plan.json"), "--compare", "mine:dp=2,pp=4"]) == 2
    assert "the world is 4" in caplog.text


def test_cli_compare_that_cannot_run_exits_2(cache_dir, tmp_path):
    assert main([*TOY, "--out", str(tmp_path / "plan.json"), "--compare", "mine:pp=4,schedule=no_such_schedule"]) == 2


def test_cli_attention_kernel_changes_what_a_gpt_keeps(cache_dir, tmp_path):
    """The toy GPT on one H100: the math kernel keeps each layer's attention scores, the fused kernel none."""
    memory = {}
    for kernel in ("fused", "math"):
        out = tmp_path / f"{kernel}.json"
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(["gpt", "model=toy", "trainer.global_batch_size=16", "--cluster", "h100-80", "--world", "1",
                         "--attention", kernel, "--out", str(out), "--compare", "mine:mb=1"]) == 0
        memory[kernel] = json.loads(out.read_text())["compared"][0]["predicted_stage_memory_bytes"][0]
    # One microbatch of one sample in flight: 4 layers x 4 heads x 32 x 32 float32 probabilities, at least (the
    # math path keeps more).
    assert memory["math"] - memory["fused"] >= 4 * 4 * 32 * 32 * 4


# merak-plan for gpt2 on two GPU servers: tests/recipes/test_auto_parallel.py (it shares gpt2's profiles).


def test_a_gpu_plan_ends_in_commands_that_run_it():
    """Two nodes of 8 GPUs: srun and a SLURM job (no torchrun: it needs one node), with the user's model and
    the chosen layout, without the planning-only overrides."""
    from merak.autoplan.cluster import preset
    from merak.autoplan.commands import launch_commands

    asked = ["model=gpt3-xl", "parallel=auto", "cluster=h100-80", "cluster.nodes=2", "dry_run=true"]
    layout = Layout(dp=2, tp=4, pp=2, micro_batch_size=1, num_microbatches=8, schedule="zb_h1", zero_stage=1)
    commands = dict(launch_commands("recipes/gpt/train.py", asked, layout, preset("h100-80").with_size(nodes=2)))
    assert list(commands) == ["2 node(s), srun (inside an allocation)", "2 node(s), SLURM job"]
    slurm = commands["2 node(s), SLURM job"]
    assert slurm.startswith("python recipes/gpt/train.py -m hydra/launcher=merak_slurm hydra.launcher.nodes=2 "
                            "hydra.launcher.gpus_per_node=8 ")
    assert commands["2 node(s), srun (inside an allocation)"].startswith(
        "srun --nodes 2 --ntasks-per-node 8 --gpus-per-node 8 python recipes/gpt/train.py model=gpt3-xl ")
    for command in commands.values():
        assert "model=gpt3-xl" in command and all(o in command for o in layout.overrides())
        assert not any(word in command for word in ("parallel=auto", "cluster", "dry_run"))
    one_node = dict(launch_commands("recipes/gpt/train.py", [], Layout(dp=8, tp=1, pp=1, micro_batch_size=1,
                                                                       num_microbatches=1), preset("h100-80")))
    assert one_node["one node, torchrun"].startswith("torchrun --standalone --nproc_per_node 8 recipes/gpt/train.py ")


def test_cli_energy_objective_writes_the_frontier_and_the_command_that_runs_it(cache_dir, tmp_path):
    from merak.energy.frontier import read_frontier

    out = tmp_path / "plan.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = main([*TOY, "trainer.energy_device=simulated", "--objective", "energy@1.2x", "--top", "3",
                       "--out", str(out)])
    assert status == 0
    payload = json.loads(out.read_text())
    assert payload["objective"] == "energy@1.2x" and payload["best"]["energy"]["meets_bound"]
    clock_plan = payload["run_clock_plan"]
    assert clock_plan["trainer.frequency_frontier"] == str(tmp_path / "plan.frontier.json")
    layout = payload["best"]["layout"]
    read_frontier(clock_plan["trainer.frequency_frontier"]).check(
        layout["schedule"], layout["pp"], layout["num_microbatches"], layout["chunks"])
    table = printed.getvalue()
    header = next(line for line in table.splitlines() if line.startswith("#"))
    assert "energy (J/step)" in header and "clocks (MHz)" in header
    command = table.split("to run the first layout with its clock plan:")[1]
    assert f"trainer.frequency_frontier={tmp_path / 'plan.frontier.json'}" in command
    assert "trainer.frontier_deadline=" in command and "trainer.energy_device=simulated" in command


def test_cli_energy_objective_without_a_power_model_exits_2(cache_dir, tmp_path, caplog):
    with caplog.at_level(logging.ERROR, logger="merak.plan"):
        assert main([*TOY, "--objective", "energy", "--out", str(tmp_path / "plan.json")]) == 2
    assert "CPU processes have none" in caplog.text
