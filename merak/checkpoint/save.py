"""Save a checkpoint from every rank, committed atomically by rank 0."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Collection, Iterator

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from merak.checkpoint import files
from merak.checkpoint.identity import ModelIdentity
from merak.checkpoint.rng import capture_rng
from merak.checkpoint.settings import CheckpointSettings
from merak.checkpoint.tensors import optimizer_file, weight_entries, weights_file
from merak.distributed import groups

logger = logging.getLogger(__name__)

_NAMED = 3  # non-finite tensors named per rank in the error (the rest are counted)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _safetensors(staging: str, path: str, tensors: dict, meta: dict[str, str]) -> dict:
    """Write one safetensors file; its manifest record carries the merak metadata of its header too."""
    save_file(tensors, path, metadata=meta)
    return files.file_record(staging, path, merak=json.loads(meta["merak"]))


def rank_files(engine, staging: str, *, rank: int, options: CheckpointSettings) -> list[dict]:
    """Write this rank's share into ``staging``; return the manifest records of the files written."""
    state = engine.state
    pp, tp, dp = state.coordinates.pp, state.coordinates.tp, state.coordinates.dp
    written = []
    entries = weight_entries(engine)
    if dp == 0 and entries:
        path = os.path.join(staging, "model", f"pp{pp:03d}-tp{tp:03d}.safetensors")
        written.append(_safetensors(staging, path, *weights_file(entries)))
    if not options.no_save_optim:
        tensors, meta = optimizer_file(engine)
        if tensors:
            path = os.path.join(staging, "optimizer", f"pp{pp:03d}-tp{tp:03d}-dp{dp:03d}.safetensors")
            written.append(_safetensors(staging, path, tensors, meta))
    if not options.no_save_rng:
        path = os.path.join(staging, "rng", f"rank{rank:05d}.json")
        files.write_json(path, capture_rng())
        written.append(files.file_record(staging, path))
    return written


def _tensors_to_write(engine, options: CheckpointSettings) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors :func:`rank_files` writes on this rank, named as in its files."""
    if engine.state.coordinates.dp == 0:
        for entry in weight_entries(engine):
            yield entry.name, entry.tensor
    if not options.no_save_optim:
        yield from optimizer_file(engine)[0].items()


def nonfinite_tensors(named: Iterator[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of the floating-point tensors that hold an inf or NaN.

    One pass over each tensor and no copy of it: ``aminmax`` propagates NaN, and an inf is the
    minimum or maximum. The per-tensor answers are fetched with one transfer per device.
    """
    flags: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in named:
        if tensor.is_floating_point() and tensor.numel():
            bounds = torch.stack(torch.aminmax(tensor.detach()))
            flags.setdefault(tensor.device, []).append((name, torch.isfinite(bounds).all()))
    bad = []
    for entries in flags.values():
        finite = torch.stack([flag for _, flag in entries]).tolist()
        bad += [name for (name, _), ok in zip(entries, finite, strict=True) if not ok]
    return bad


def _problem(engine, options: CheckpointSettings) -> str | None:
    """What keeps this rank's share out of a checkpoint (None: nothing)."""
    bad = nonfinite_tensors(_tensors_to_write(engine, options))
    if not bad:
        return None
    more = f" (and {len(bad) - _NAMED} more)" if len(bad) > _NAMED else ""
    return f"{', '.join(bad[:_NAMED])}{more}"


def _abandon(staging: str, step: int, problems: list[str], rank: int) -> files.CheckpointError:
    """Drop the staging directory (rank 0, once every rank stopped writing) and describe why."""
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
    _barrier()  # every rank raises only once the staging directory is gone
    return files.CheckpointError(
        f"step {step}: checkpoint-{step} was not saved: inf or NaN in {'; '.join(problems)}. Nothing was "
        f"committed; the earlier checkpoints are unchanged")


def save_checkpoint(engine, output_dir: str, *, step: int, trainer_state: dict, run_info: dict,
                    options: CheckpointSettings = CheckpointSettings(), keep: Collection[str] = ()) -> str:
    """Write ``<output_dir>/checkpoint-<step>`` from every rank (a collective call).

    Args:
        engine: this rank's PipelineEngine.
        step: optimizer steps done.
        trainer_state: JSON-able state of the loop (data position, ...), stored as given.
        run_info: JSON-able description of the run (recipe, model config, layout, precision).
        options: the checkpoint section: what to leave out (no_save_optim, no_save_rng) and how many
            checkpoints to keep (save_total_limit).
        keep: checkpoint directories the rotation never removes (the best model's).

    Returns the committed directory. A crash before the commit leaves only a
    ``.checkpoint-<step>.partial`` directory, which loading ignores.

    Raises:
        CheckpointError: on every rank alike, when any rank's weights or optimizer state hold an
            inf or NaN; nothing is committed and the staging directory is removed.
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
    with engine.whole_parameters():  # ZeRO-3: every replica gathers; replica 0 writes the weights
        problem = _problem(engine, options)
        # A rank with bad values writes nothing: the checkpoint will not be committed anyway.
        records = [] if problem else rank_files(engine, staging, rank=rank, options=options)
    # One exchange tells every rank of every problem, so all of them raise together (no rank waits
    # in a later collective for one that gave up).
    everyone = groups.gather_from_all({"records": records, "problem": problem})
    problems = [f"rank {r}: {share['problem']}" for r, share in enumerate(everyone) if share["problem"]]
    if problems:
        raise _abandon(staging, step, problems, rank)
    if rank == 0:
        listing = {r["path"]: {k: v for k, v in r.items() if k != "path"}
                   for share in everyone for r in share["records"]}
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
        model = ModelIdentity.of_manifest(manifest).digest
        files.rotate(output_dir, options.save_total_limit, protect={final, *keep},
                     same_model=lambda other: ModelIdentity.of_manifest(other).digest == model)
        total = sum(r["bytes"] for r in listing.values())
        logger.info("saved %s (%.1f MB in %.2f s)", final, total / 1e6, time.perf_counter() - started)
    _barrier()
    return final
