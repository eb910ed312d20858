"""How merak recognises a world that torchrun or srun already started."""

from __future__ import annotations

import os

import pytest

from merak.distributed import groups, launch

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID",
               "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_STEP_ID")


@pytest.fixture
def clean_env(monkeypatch):
    # setenv first, so monkeypatch records each variable's state and also undoes what
    # _adopt_slurm_environment writes to os.environ directly (delenv of an unset name records nothing,
    # and RANK/WORLD_SIZE left behind made later tests join a world that does not exist).
    for name in LAUNCH_VARS:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return monkeypatch


def test_no_launcher_means_no_world(clean_env):
    assert launch.existing_world_size() is None


def test_torchrun_world(clean_env):
    clean_env.setenv("RANK", "3")
    clean_env.setenv("WORLD_SIZE", "8")
    assert launch.existing_world_size() == 8


def test_srun_world_is_adopted(clean_env):
    for name, value in {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
                        "MASTER_ADDR": "node0"}.items():
        clean_env.setenv(name, value)
    assert launch.existing_world_size() == 8
    groups._adopt_slurm_environment()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("5", "8", "1")
    assert os.environ["MASTER_PORT"] == "29500"


def test_srun_without_master_addr_says_what_to_export(clean_env):
    for name, value in {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"}.items():
        clean_env.setenv(name, value)
    with pytest.raises(RuntimeError, match="MASTER_ADDR"):
        groups._adopt_slurm_environment()


def test_a_batch_script_alone_is_not_a_world(clean_env):
    clean_env.setenv("SLURM_PROCID", "0")
    clean_env.setenv("SLURM_NTASKS", "4")
    assert launch.existing_world_size() is None


def test_init_without_processes_explains_how_to_launch(clean_env):
    with pytest.raises(RuntimeError, match="torchrun --nproc_per_node 4"):
        groups.init(dp=2, pp=2)


def test_single_process_init_needs_no_process_group(clean_env):
    state = groups.init()
    try:
        assert state.grid.world_size == 1 and state.rank == 0
        assert state.is_first_stage and state.is_last_stage
        assert groups.get_dp_size() == groups.get_pp_size() == groups.get_tp_size() == 1
    finally:
        groups.shutdown()
    with pytest.raises(RuntimeError, match="merak.init"):
        groups.get_state()


def test_backend_choice(clean_env):
    assert groups.resolve_backend("gloo") == "gloo"
    expected = "nccl" if __import__("torch").cuda.is_available() else "gloo"
    assert groups.resolve_backend() == expected
    clean_env.setenv("MERAK_BACKEND", "gloo")
    assert groups.resolve_backend() == "gloo"
    with pytest.raises(ValueError, match="unknown backend"):
        groups.resolve_backend("carrier-pigeon")
