"""The gpt recipe started the ways docs/launching.md describes: merak's own spawn, torchrun on two
"nodes" of this machine, srun-style tasks (SLURM variables, no MASTER_ADDR), hydra/launcher=merak_slurm
through stand-in sbatch/srun commands, and a sweep with a failing job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from train_py import run_in_process

from merak.distributed.launch import free_port
from merak.report.curves import drawn_steps

pytestmark = pytest.mark.recipe

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "recipes/gpt/train.py"
TOY = ["model=toy", "trainer.per_device_train_batch_size=2", "trainer.gradient_accumulation_steps=4",
       "parallel=pp2", "trainer.max_steps=3"]
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

# Stand-ins for SLURM's commands on this machine: sbatch runs the script at once in the background
# with the job's variables; srun starts nodes x ntasks-per-node tasks with the task variables.
FAKE_SBATCH = """#!PYTHON
import os, re, subprocess, sys
script = sys.argv[-1]
options = dict(re.findall(r"#SBATCH --([\\w-]+)=(\\S+)", open(script).read()))
assert "array" not in options, "one sweep point: a plain job"
job = os.environ["FAKE_SLURM_JOB_ID"]
env = dict(os.environ, SLURM_JOB_ID=job, SLURM_JOB_NUM_NODES=options.get("nodes", "1"),
           SLURM_NTASKS_PER_NODE=options.get("ntasks-per-node", "1"), SLURM_JOB_NODELIST="localhost")
log = open(os.path.join(os.path.dirname(script), "batch.log"), "w")
subprocess.Popen(["bash", script], env=env, stdout=log, stderr=subprocess.STDOUT)
print("Submitted batch job", job)
"""
FAKE_SRUN = """#!PYTHON
import os, subprocess, sys
args, output = sys.argv[1:], "/dev/null"
while args[0].startswith("--"):
    output, args = (args[1], args[2:]) if args[0] == "--output" else (output, args[1:])
nodes, per_node = int(os.environ["SLURM_JOB_NUM_NODES"]), int(os.environ["SLURM_NTASKS_PER_NODE"])
tasks = []
for task in range(nodes * per_node):
    env = dict(os.environ, SLURM_PROCID=str(task), SLURM_LOCALID=str(task % per_node), SLURM_STEP_ID="0",
               SLURM_NODEID=str(task // per_node), SLURM_NTASKS=str(nodes * per_node))
    path = output.replace("%t", str(task)).replace("%j", env["SLURM_JOB_ID"])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tasks.append(subprocess.Popen(args, env=env, stdout=open(path, "a"), stderr=subprocess.STDOUT))
sys.exit(max(t.wait() for t in tasks))
"""


def _env(cache_dir, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("SLURM_")}
    return {**env, "MERAK_CACHE_DIR": str(cache_dir), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", **extra}


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _run_together(commands: list[list[str]], envs: list[dict], timeout: int) -> list[str]:
    """Start every command at once (the "nodes" or tasks of one world); return their outputs."""
    procs = [subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for command, env in zip(commands, envs)]
    try:
        outputs = [proc.communicate(timeout=timeout)[0] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    assert all(proc.returncode == 0 for proc in procs), "\n\n".join(o[-3000:] for o in outputs)
    return outputs


@pytest.fixture(scope="module")
def spawn_losses(tmp_path_factory, cache_dir) -> list[float]:
    """pp2 with merak's own launcher: merak.run as train.py calls it, in this process, starting two workers
    (train.py's own run of it, as a process: test_console.py)."""
    run_dir = tmp_path_factory.mktemp("spawn")
    run_in_process("gpt", TOY, run_dir)
    return _losses(run_dir)


@pytest.mark.timeout(300)
def test_torchrun_two_nodes_of_one_process_train_like_spawn(tmp_path, cache_dir, spawn_losses):
    """torchrun --nnodes 2 --node_rank {0,1} --nproc_per_node 1, both on 127.0.0.1: one pp2 world."""
    run_dir = tmp_path / "run"
    port = free_port()
    commands = [[sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(rank),
                 "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port), str(TRAIN),
                 *TOY, f"hydra.run.dir={run_dir}"] for rank in (0, 1)]
    _run_together(commands, [_env(cache_dir)] * 2, timeout=240)
    assert _losses(run_dir) == pytest.approx(spawn_losses, rel=1e-6)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["layout"] == {"dp": 1, "tp": 1, "pp": 2} and [r["rank"] for r in summary["ranks"]] == [0, 1]


@pytest.mark.timeout(300)
def test_srun_tasks_find_their_master_and_agree_on_the_run_dir(tmp_path, cache_dir, spawn_losses):
    """Two processes with the variables srun gives its tasks and no MASTER_ADDR/MASTER_PORT (as
    hydra-submitit-launcher starts them): they derive the master from SLURM_JOB_NODELIST and the port
    from SLURM_JOB_ID. Each has its own default run dir, as tasks started in different seconds
    would: checkpoints and metrics all go to rank 0's."""
    port = free_port()
    assert port >= 20000, "an ephemeral port the job id can map to"
    slurm = {"SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": str(port - 20000),
             "SLURM_JOB_NODELIST": "127.0.0.1"}
    dirs = [tmp_path / "task0", tmp_path / "task1"]
    commands = [[sys.executable, str(TRAIN), *TOY, "trainer.save=true", "trainer.save_steps=3",
                 f"hydra.run.dir={run_dir}"] for run_dir in dirs]
    envs = [_env(cache_dir, **slurm, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank)) for rank in (0, 1)]
    outputs = _run_together(commands, envs, timeout=240)
    assert _losses(dirs[0]) == pytest.approx(spawn_losses, rel=1e-6)
    assert "all use rank 0's" in outputs[0]
    assert not (dirs[1] / "metrics.jsonl").exists() and not (dirs[1] / "checkpoint-3").exists()
    manifest = json.loads((dirs[0] / "checkpoint-3" / "manifest.json").read_text())
    # Both tasks' stages were written into one checkpoint, in rank 0's run dir: every file the manifest
    # lists is there (a stage holding only the tied LM head writes no weights file of its own).
    written = {str(p.relative_to(dirs[0] / "checkpoint-3")) for p in (dirs[0] / "checkpoint-3").rglob("*")
               if p.is_file()}
    assert set(manifest["files"]) <= written
    assert "model/pp000-tp000.safetensors" in manifest["files"]


@pytest.mark.timeout(300)
def test_merak_slurm_preset_runs_one_task_per_rank(tmp_path, cache_dir, spawn_losses):
    """hydra/launcher=merak_slurm with nodes=2 on pp2: submitit's sbatch script asks for 2 nodes x 1
    task; each task runs the Hydra job, and the two join one world from srun's variables alone."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("sbatch", FAKE_SBATCH), ("srun", FAKE_SRUN)):
        (bin_dir / name).write_text(text.replace("PYTHON", sys.executable))
        (bin_dir / name).chmod(0o755)
    sweep = tmp_path / "sweep"
    env = _env(cache_dir, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
               FAKE_SLURM_JOB_ID=str(free_port() - 20000))  # MASTER_PORT = 20000 + job id
    result = subprocess.run(
        [sys.executable, str(TRAIN), "-m", "hydra/launcher=merak_slurm", "hydra.launcher.nodes=2", *TOY,
         f"hydra.sweep.dir={sweep}"], cwd=REPO, env=env, check=False, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    script = next((sweep / ".submitit").glob("*/*_submission.sh")).read_text()
    assert "#SBATCH --nodes=2" in script and "#SBATCH --ntasks-per-node=1" in script
    task_logs = sorted((sweep / ".submitit").glob("*/*_log.out"))
    assert len(task_logs) == 2 and "global_rank=1(2)" in task_logs[1].read_text()
    assert _losses(sweep / "0") == pytest.approx(spawn_losses, rel=1e-6)
    assert json.loads((sweep / "sweep_summary.json").read_text())["num_ok"] == 1


@pytest.mark.timeout(300)
def test_sweep_with_a_failing_job_still_writes_its_summary(tmp_path, cache_dir):
    """Hydra's basic launcher runs every job (each launching its own workers), then raises the first
    failure (exit status 1): the sweep summary is written anyway, with the failed job marked."""
    sweep = tmp_path / "sweep"
    result = subprocess.run(
        [sys.executable, str(TRAIN), "-m", *TOY[:3], "parallel=pp2", "trainer.max_steps=2",
         "trainer.train_schedule=zigzag,1f1b", f"hydra.sweep.dir={sweep}"],
        cwd=REPO, env=_env(cache_dir), check=False, capture_output=True, text=True, timeout=240)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "sweep summary: 2 jobs, 1 ok, 1 failed" in result.stdout
    summary = json.loads((sweep / "sweep_summary.json").read_text())
    failed, ok = summary["jobs"]
    assert (failed["job"], failed["status"], ok["job"], ok["status"]) == (0, "failed", 1, "ok")
    assert "trainer.train_schedule='zigzag' is unknown" in failed["error"]
    ok_summary = json.loads((sweep / "1" / "summary.json").read_text())
    assert ok["final_loss"] == pytest.approx(ok_summary["final_loss"])
    assert ok_summary["layout"] == {"dp": 1, "tp": 1, "pp": 2}  # a job launches its own workers
    table = (sweep / "sweep_summary.md").read_text()
    rows = [line.split("|") for line in table.splitlines() if line.startswith("| 1 ")]
    assert [(cells[2].strip(), cells[-2].strip()) for cells in rows] == [("trainer.train_schedule=1f1b", "ok")]
    # Each job that trained drew its loss.png, and the sweep one picture of them all.
    assert drawn_steps(sweep / "1" / "loss.png")["train loss"] == [1, 2]
    assert drawn_steps(sweep / "loss.png") == {"job 1 trainer.train_schedule=1f1b: train": [1, 2]}
