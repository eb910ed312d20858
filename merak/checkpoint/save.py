"""Save a checkpoint from every rank, committed atomically by rank 0."""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass

import torch.distributed as dist
from safetensors.torch import save_file

from merak.checkpoint import files
from merak.checkpoint.rng import capture_rng
from merak.checkpoint.tensors import optimizer_file, weight_entries, weights_file
from merak.distributed import groups

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SaveOptions:
    """What to write (names as in MerakArguments)."""

    save_total_limit: int | None = -1
    no_save_rng: bool = False
    no_save_optim: bool = False


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def rank_files(engine, staging: str, *, rank: int, options: SaveOptions) -> list[str]:
    """Write this rank's share into ``staging``; return the paths written."""
    state = engine.state
    pp, tp, dp = state.coordinates.pp, state.coordinates.tp, state.coordinates.dp
    written = []
    entries = weight_entries(engine)
    if dp == 0 and entries:
        path = os.path.join(staging, "model", f"pp{pp:03d}-tp{tp:03d}.safetensors")
        tensors, meta = weights_file(entries)
        save_file(tensors, path, metadata=meta)
        written.append(path)
    if not options.no_save_optim:
        tensors, meta = optimizer_file(engine)
        if tensors:
            path = os.path.join(staging, "optimizer", f"pp{pp:03d}-tp{tp:03d}-dp{dp:03d}.safetensors")
            save_file(tensors, path, metadata=meta)
            written.append(path)
    if not options.no_save_rng:
        path = os.path.join(staging, "rng", f"rank{rank:05d}.json")
        files.write_json(path, capture_rng())
        written.append(path)
    return written


def save_checkpoint(engine, output_dir: str, *, step: int, trainer_state: dict, run_info: dict,
                    options: SaveOptions = SaveOptions()) -> str:
    """Write ``<output_dir>/checkpoint-<step>`` from every rank (a collective call).

    Args:
        engine: this rank's PipelineEngine.
        step: optimizer steps done.
        trainer_state: JSON-able state of the loop (data position, ...), stored as given.
        run_info: JSON-able description of the run (recipe, model config, layout, precision).

    Returns the committed directory. A crash before the commit leaves only a
    ``.checkpoint-<step>.partial`` directory, which loading ignores.
    """
    started = time.perf_counter()
    rank = dist.get_rank() if dist.is_initialized() else 0
    staging = os.path.join(output_dir, files.staging_name(step))
    final = os.path.join(output_dir, files.checkpoint_name(step))
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)  # left by a crashed save
        for sub in ("model", "optimizer", "rng"):
            os.makedirs(os.path.join(staging, sub))
    _barrier()
    records = [files.file_record(staging, p) for p in rank_files(engine, staging, rank=rank, options=options)]
    everyone = groups.gather_from_all(records)
    if rank == 0:
        listing = {r["path"]: {"bytes": r["bytes"], "crc32": r["crc32"]} for rs in everyone for r in rs}
        state_path = os.path.join(staging, "trainer_state.json")
        files.write_json(state_path, {**trainer_state, "step": step,
                                      "lr_scheduler_steps": engine.lr_scheduler.last_epoch,
                                      "loss_scaler": engine.optimizer.scaler.state_dict()})
        record = files.file_record(staging, state_path)
        listing[record["path"]] = {"bytes": record["bytes"], "crc32": record["crc32"]}
        grid = engine.state.grid
        manifest = {"format": files.FORMAT, "version": files.VERSION, "step": step,
                    "layout": {"dp": grid.dp, "tp": grid.tp, "pp": grid.pp, "chunks": engine.num_chunks},
                    "has_optimizer": not options.no_save_optim, "has_rng": not options.no_save_rng,
                    "zero_stage": engine.optimizer.zero.stage, "dtype": str(engine.optimizer.precision.dtype),
                    "model_info": engine.model_info, "run": run_info, "files": listing}
        files.commit(staging, final, manifest)
        files.rotate(output_dir, options.save_total_limit, protect=final)
        total = sum(r["bytes"] for r in listing.values())
        logger.info("saved %s (%.1f MB in %.2f s)", final, total / 1e6, time.perf_counter() - started)
    _barrier()
    return final
