"""Load a checkpoint (or Hugging Face weights) into this rank's engine, whatever layout wrote it."""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Callable
from typing import TypeVar

import torch
from safetensors import SafetensorError, safe_open

from merak.checkpoint import files
from merak.checkpoint.rng import restore_rng
from merak.checkpoint.settings import CheckpointSettings
from merak.checkpoint.tensors import MASTER, join_slices, slice_from_json

logger = logging.getLogger(__name__)
T = TypeVar("T")


def _read(checkpoint: str, relative: str, read: Callable[[], T]) -> T:
    """``read()``, with a parse error of the (already verified) file turned into a CheckpointError
    naming it: a file that matches its manifest can still be unreadable (a manifest written for
    bad bytes, another safetensors version)."""
    try:
        return read()
    except (SafetensorError, OSError, ValueError) as error:
        raise files.CheckpointError(f"{checkpoint}: {relative} cannot be read ({error})") from None


class _Files:
    """The safetensors files of one checkpoint folder: which tensors each holds, and their contents.

    Which tensors a file holds comes from the manifest; checkpoints saved before the manifest
    carried it have it read from each file's (verified) header. A file is verified against the
    manifest before it is first opened, so a rank opens and checks only the files it reads.
    """

    def __init__(self, checkpoint: str, manifest: dict, folder: str) -> None:
        self.checkpoint, self.manifest = checkpoint, manifest
        self.paths = sorted(p for p in manifest["files"] if p.startswith(folder + "/"))
        self._open: dict[str, object] = {}

    @functools.cached_property
    def index(self) -> dict[str, list[tuple[str, dict]]]:
        """Tensor name -> [(file, merak metadata of the tensor)], in file order. Computed on first
        use: loading weights only (export, finetune) never touches the optimizer files."""
        index: dict[str, list[tuple[str, dict]]] = {}
        for relative in self.paths:
            for name, info in self._meta(relative).items():
                index.setdefault(name, []).append((relative, info))
        return index

    def _meta(self, relative: str) -> dict:
        record = self.manifest["files"][relative]
        if "merak" in record:
            return record["merak"]
        path = files.verify_file(self.checkpoint, self.manifest, relative)

        def header() -> dict:
            with safe_open(path, framework="pt") as handle:  # the header only: small
                return json.loads((handle.metadata() or {}).get("merak", "{}"))

        meta = _read(self.checkpoint, relative, header)
        if not isinstance(meta, dict):
            raise files.CheckpointError(f"{self.checkpoint}: {relative} cannot be read (its merak metadata is "
                                        f"not an object)")
        return meta

    def tensor(self, relative: str, key: str) -> torch.Tensor:
        if relative not in self._open:
            path = files.verify_file(self.checkpoint, self.manifest, relative)
            self._open[relative] = _read(self.checkpoint, relative, lambda: safe_open(path, framework="pt"))
        handle = self._open[relative]
        return _read(self.checkpoint, relative, lambda: handle.get_tensor(key))


class CheckpointSource:
    """Full tensors of the model and its optimizer state, reassembled from any layout's pieces."""

    def __init__(self, checkpoint: str) -> None:
        self.path = checkpoint
        self.manifest = files.read_manifest(checkpoint)
        self.weights = _Files(checkpoint, self.manifest, "model")
        self.optimizer = _Files(checkpoint, self.manifest, "optimizer")

    def weight_names(self) -> list[str]:
        return sorted(self.weights.index)

    def has(self, name: str) -> bool:
        return name in self.weights.index

    def weight(self, name: str) -> torch.Tensor:
        """The full (unsliced) tensor ``name``."""
        entries = self.weights.index.get(name)
        if not entries:
            raise files.CheckpointError(f"{self.path} has no tensor {name!r}")
        info = entries[0][1]
        spec = slice_from_json(info["slice"], info["full_shape"])
        if spec is None:
            return self.weights.tensor(entries[0][0], name)
        pieces = {slice_from_json(i["slice"], i["full_shape"]).rank: (r, name) for r, i in entries}
        return self._join({rank: self.weights.tensor(*where) for rank, where in pieces.items()}, spec, name)

    def has_state(self, name: str) -> bool:
        return name in self.optimizer.index

    def state_keys(self, name: str) -> tuple[list[str], list[str]]:
        """(tensor states, scalar states) saved for parameter ``name``."""
        info = next(i for _, i in self.optimizer.index[name] if i["stop"] > i["start"])
        return info["states"], info["scalars"]

    def state(self, name: str, key: str) -> torch.Tensor:
        """Optimizer state ``key`` of parameter ``name`` at full (unsliced) shape; scalars as saved."""
        entries = self.optimizer.index[name]
        owned = [(r, i) for r, i in entries if i["stop"] > i["start"]]
        if key in owned[0][1]["scalars"]:
            return self.optimizer.tensor(owned[0][0], f"{name}/{key}").reshape(())
        by_tp: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for relative, info in owned:
            spec = slice_from_json(info["slice"], info["full_shape"])
            by_tp.setdefault(spec.rank if spec else 0, []).append(
                (info["start"], self.optimizer.tensor(relative, f"{name}/{key}")))
        info = owned[0][1]
        locals_ = {}
        for tp_rank, pieces in by_tp.items():
            flat = torch.cat([t for _, t in sorted(pieces, key=lambda item: item[0])])
            local_shape = info["local_shape"]
            if flat.numel() != torch.Size(local_shape).numel():
                raise files.CheckpointError(f"{self.path}: optimizer pieces of {name} cover {flat.numel()} of "
                                            f"{torch.Size(local_shape).numel()} elements")
            locals_[tp_rank] = flat.view(local_shape)
        spec = slice_from_json(info["slice"], info["full_shape"])
        return locals_[0] if spec is None else self._join(locals_, spec, name)

    def _join(self, pieces: dict[int, torch.Tensor], spec, name: str) -> torch.Tensor:
        try:
            return join_slices(pieces, spec)
        except KeyError as error:
            raise files.CheckpointError(f"{self.path}: {name}: {error}") from None


class PretrainedSource:
    """Full tensors from a Hugging Face model directory (model.safetensors, or an index of shards)."""

    def __init__(self, directory: str) -> None:
        self.path = directory
        if os.path.isfile(os.path.join(directory, "model.safetensors.index.json")):
            weight_map = _read(directory, "model.safetensors.index.json", self._index)
        elif os.path.isfile(os.path.join(directory, "model.safetensors")):
            weight_map = _read(directory, "model.safetensors", self._single)
        else:
            raise files.CheckpointError(f"pretrained_weights={directory}: no model.safetensors or "
                                        f"model.safetensors.index.json there (only safetensors weights are read)")
        self._where = weight_map
        self._open: dict[str, object] = {}

    def _index(self) -> dict[str, str]:
        with open(os.path.join(self.path, "model.safetensors.index.json"), encoding="utf-8") as handle:
            weight_map = json.load(handle).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError("no weight_map object")
        return weight_map

    def _single(self) -> dict[str, str]:
        with safe_open(os.path.join(self.path, "model.safetensors"), framework="pt") as handle:
            return dict.fromkeys(handle.keys(), "model.safetensors")

    def has(self, name: str) -> bool:
        return name in self._where

    def weight(self, name: str) -> torch.Tensor:
        shard = self._where[name]
        if shard not in self._open:
            path = os.path.join(self.path, shard)
            self._open[shard] = _read(self.path, shard, lambda: safe_open(path, framework="pt"))
        handle = self._open[shard]
        return _read(self.path, shard, lambda: handle.get_tensor(name))


def _load_weights(engine, source, *, strict: bool, skip_other_shapes: bool = False) -> int:
    """Copy every local parameter and persistent buffer from ``source`` (sliced for this rank).
    ``strict``: a tensor the source lacks is an error (else it stays as initialized);
    ``skip_other_shapes``: so is one of another shape (else an error)."""
    count = 0
    missing, reshaped = [], []
    for name, tensor in [*engine.named_parameters(), *engine.named_buffers()]:
        found = next((alias for alias in engine.aliases.get(name, (name,)) if source.has(alias)), None)
        if found is None:
            missing.append(name)
            continue
        full = source.weight(found)
        spec = engine.slices.get(name)
        wanted = tuple(spec.full_shape) if spec is not None else tuple(tensor.shape)
        if skip_other_shapes and tuple(full.shape) != wanted:
            reshaped.append(name)
            continue
        local = spec.take(full) if spec is not None else full
        if tuple(local.shape) != tuple(tensor.shape):
            raise files.CheckpointError(f"{source.path}: {found} has shape {tuple(full.shape)}, which does not fit "
                                        f"this model's {name} (local shape {tuple(tensor.shape)})")
        with torch.no_grad():
            tensor.copy_(local)
        count += 1
    if missing and strict:
        raise files.CheckpointError(f"{source.path} lacks {len(missing)} tensors of this model, e.g. "
                                    f"{', '.join(missing[:5])}")
    if missing:
        logger.warning("%s lacks %d tensors of this model (left as initialized): %s", source.path, len(missing),
                       ", ".join(missing[:5]))
    if reshaped:
        logger.warning("%s holds %d tensors of this model with other shapes (left as initialized): %s", source.path,
                       len(reshaped), ", ".join(reshaped[:5]))
    return count


def _load_optimizer(engine, source: CheckpointSource) -> None:
    """Master weights and optimizer state of every owned piece, resharded to this layout."""
    optimizer = engine.optimizer
    for i, name in enumerate(engine.trainable_names):
        master, piece = optimizer.master[i], optimizer.pieces[i]
        if not source.has_state(name):
            raise files.CheckpointError(f"{source.path} has no optimizer state for {name}")
        spec = engine.slices.get(name)

        def owned(full: torch.Tensor, spec=spec, piece=piece) -> torch.Tensor:
            local = spec.take(full) if spec is not None else full
            return local.reshape(-1)[piece.start:piece.stop]

        states, scalars = source.state_keys(name)
        with torch.no_grad():
            if optimizer.copies:
                if MASTER in states:
                    master.copy_(owned(source.state(name, MASTER)).view(master.shape))
                else:  # saved by a run without master copies: its fp32 weights are the masters
                    master.copy_(owned(source.weight(name)).float().view(master.shape))
        if master.numel() == 0:
            continue
        restored = {key: owned(source.state(name, key)).view(master.shape).clone()
                    for key in states if key != MASTER}
        restored.update({key: source.state(name, key).clone() for key in scalars})
        if restored:
            optimizer.optimizer.state[master] = restored


def load_checkpoint(engine, checkpoint: str, *, options: CheckpointSettings = CheckpointSettings()) -> dict:
    """Load ``checkpoint`` into this rank's engine (any saving layout) and return its trainer state
    (``step`` 0 when finetuning).

    Every file is verified (size, then CRC32, against the manifest) before it is parsed, and
    only the files this rank reads are opened.

    Raises:
        CheckpointError: naming the file that is missing, truncated, damaged or unreadable, or the
            tensor that does not fit.
    """
    source = CheckpointSource(checkpoint)
    manifest = source.manifest
    partial = options.finetune and options.partial_load
    with engine.whole_parameters(write_back=True):
        _load_weights(engine, source, strict=not partial, skip_other_shapes=partial)
    trainer_state = files.read_json(checkpoint, manifest, "trainer_state.json")
    if options.finetune:
        logger.info("finetune: weights from %s; step, optimizer and schedule start at 0", checkpoint)
        engine.optimizer.refresh_master_weights()
        return {**trainer_state, "step": 0}
    if options.no_load_optim or not manifest["has_optimizer"]:
        if not options.no_load_optim:
            logger.warning("%s has no optimizer state (saved with no_save_optim): the optimizer starts fresh",
                           checkpoint)
        engine.optimizer.refresh_master_weights()
    else:
        _load_optimizer(engine, source)
    engine.optimizer.scaler.load_state_dict(trainer_state["loss_scaler"])
    engine.resume_at(int(trainer_state["step"]), lr_scheduler_steps=int(trainer_state["lr_scheduler_steps"]))
    grid = engine.state.grid
    same_layout = manifest["layout"] == {"dp": grid.dp, "tp": grid.tp, "pp": grid.pp, "chunks": engine.num_chunks}
    rank = engine.state.rank
    if manifest["has_rng"] and not options.no_load_rng:
        if same_layout:
            restore_rng(files.read_json(checkpoint, manifest, f"rng/rank{rank:05d}.json"))
        elif rank == 0:
            logger.info("%s was saved with another layout: random generator states are not restored "
                        "(dropout masks do not depend on them)", checkpoint)
    return trainer_state


def load_weights(engine, checkpoint: str) -> int:
    """Load only the weights of ``checkpoint`` into this rank's stage (any saving layout); the step, the
    optimizer state and the schedule stay as they are. Returns tensors loaded."""
    with engine.whole_parameters(write_back=True):
        count = _load_weights(engine, CheckpointSource(checkpoint), strict=True)
    engine.optimizer.refresh_master_weights()
    return count


def load_pretrained(engine, directory: str) -> int:
    """Load Hugging Face weights (safetensors) into this rank's stage; returns tensors loaded."""
    with engine.whole_parameters(write_back=True):
        count = _load_weights(engine, PretrainedSource(directory), strict=False)
    engine.optimizer.refresh_master_weights()
    return count
