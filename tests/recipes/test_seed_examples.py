"""The original Merak example command line (run_gpt.py under torchrun) works through the seed API."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.recipe

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_run_gpt_seed_command_under_torchrun(tmp_path):
    data = tmp_path / "train_context.csv"
    with open(data, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["text"])
        for i in range(300):
            writer.writerow([f"Sentence {i} tells of the quick brown fox and the lazy dog, who met on day {i % 7}."])
    out = tmp_path / "output"
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    command = [torchrun, "--standalone", "--nproc_per_node=2", "examples/run_gpt.py", "--model-name", "toy",
               "--data-files", str(data), "--cache-dir", str(tmp_path / "cache"), "--output_dir", str(out),
               "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "4", "--max_steps", "2",
               "--pp", "2", "--disable_tqdm", "true"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    # Its own session, so a timeout stops torchrun's workers too, not only torchrun.
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        _, stderr = process.communicate(timeout=240)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 0, stderr[-3000:]
    with open(out / "summary.json", encoding="utf-8") as handle:
        summary = json.load(handle)
    assert summary["layout"] == {"dp": 1, "tp": 1, "pp": 2}
    assert summary["steps"] == 2 and summary["global_batch_size"] == 16
    with open(out / "metrics.jsonl", encoding="utf-8") as handle:
        steps = [json.loads(line)["step"] for line in handle]
    assert steps == [1, 2]
    assert "run summary" in stderr
