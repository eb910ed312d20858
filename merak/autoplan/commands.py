"""The command lines that run a planned layout on its cluster: torchrun on one node, srun, or SLURM
through ``hydra/launcher=merak_slurm`` (docs/launching.md). Printed by ``merak-plan`` and by a
``parallel=auto`` dry run for a GPU cluster, so a plan ends in something to run."""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from merak.autoplan.cluster import Cluster
from merak.autoplan.layout import Layout

# What a plan request says that a run of the chosen layout must not repeat.
_PLANNING_ONLY = ("parallel=", "parallel.", "cluster=", "cluster.", "dry_run=", "hydra.run.dir=")


def run_overrides(overrides: Sequence[str], layout: Layout) -> list[str]:
    """The user's overrides without the planning ones and those the layout sets, then the layout's own."""
    chosen = layout.overrides()
    set_by_layout = tuple(o.split("=", 1)[0] + "=" for o in chosen)
    kept = [o for o in overrides if not o.lstrip("+~").startswith(_PLANNING_ONLY + set_by_layout)]
    return [*kept, *chosen]


def launch_commands(script: str, overrides: Sequence[str], layout: Layout, cluster: Cluster, *,
                    run_dir: str = "runs/planned") -> list[tuple[str, str]]:
    """(how, command) pairs that run ``layout`` with ``script`` (a recipe's train.py) on ``cluster``:
    torchrun when one node holds the layout, then srun and SLURM through hydra-submitit-launcher."""
    per_node = min(layout.world_size, cluster.devices_per_node)
    nodes = -(-layout.world_size // per_node)
    args = " ".join(shlex.quote(o) for o in run_overrides(overrides, layout))
    found = []
    if nodes == 1:
        found.append(("one node, torchrun",
                      f"torchrun --standalone --nproc_per_node {per_node} {script} {args} hydra.run.dir={run_dir}"))
    gpus = f" --gpus-per-node {per_node}" if cluster.device_type == "cuda" else ""
    found.append((f"{nodes} node(s), srun (inside an allocation)",
                  f"srun --nodes {nodes} --ntasks-per-node {per_node}{gpus} python {script} {args} "
                  f"hydra.run.dir={run_dir}"))
    slurm_gpus = f" hydra.launcher.gpus_per_node={per_node}" if cluster.device_type == "cuda" else ""
    found.append((f"{nodes} node(s), SLURM job",
                  f"python {script} -m hydra/launcher=merak_slurm hydra.launcher.nodes={nodes}{slurm_gpus} "
                  f"hydra.launcher.timeout_min=240 {args}"))
    return found


def format_commands(commands: Sequence[tuple[str, str]]) -> str:
    """The commands as lines to copy, each under its label."""
    return "\n".join(f"  # {how}\n  {command}" for how, command in commands)
