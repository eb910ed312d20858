"""Which model a checkpoint holds, and how another model differs from it.

A model's identity is every tensor a checkpoint stores (parameters and persistent buffers, by
name, with their full shapes) and, for a Hugging Face model, its architecture config: the config
without the settings that change neither the tensors nor the function the weights compute once
trained (dropout rates, initialization range, output flags, bookkeeping). ``num_heads`` is why
the config counts: it changes the function, not one shape.

Both halves are read from what every checkpoint already records (each weights file's tensor
listing and ``model_info``), so checkpoints written before this module are compared as well.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

# Config keys that do not define the model a checkpoint's weights belong to.
_NOT_ARCHITECTURE = re.compile(
    r"dropout|pdrop|^_|^(architectures|transformers_version|dtype|torch_dtype|use_cache|return_dict|"
    r"output_attentions|output_hidden_states|initializer_range|initializer_factor|id2label|label2id|"
    r"problem_type|chunk_size_feed_forward)$")
_SHOWN = 4  # names listed per kind of difference (the rest are counted)


def model_info(model: nn.Module) -> dict | None:
    """What a Hugging Face export needs to rebuild the model: its class and full config (None for
    other models)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "save_pretrained") or not hasattr(config, "to_dict"):
        return None
    return {"class": type(model).__name__, "module": type(model).__module__,
            "config": json.loads(config.to_json_string(use_diff=False))}


def architecture(config: dict | None) -> dict | None:
    """The keys of a model config that define its architecture (None stays None)."""
    if config is None:
        return None
    return {key: value for key, value in sorted(config.items()) if not _NOT_ARCHITECTURE.search(key)}


@dataclass(frozen=True)
class ModelIdentity:
    """The tensors (name -> full shape) and the architecture config (None: not a Hugging Face model)."""

    tensors: dict[str, tuple[int, ...]]
    config: dict | None

    @classmethod
    def of_model(cls, model: nn.Module) -> ModelIdentity:
        """The identity of a built model (meta parameters are fine: only names and shapes are read)."""
        tensors = {name: tuple(p.shape) for name, p in model.named_parameters()}
        for prefix, module in model.named_modules():
            for name, buffer in module.named_buffers(recurse=False):
                if name not in module._non_persistent_buffers_set:  # only persistent buffers are saved
                    tensors[f"{prefix}.{name}" if prefix else name] = tuple(buffer.shape)
        info = model_info(model)
        return cls(tensors, architecture(info["config"]) if info else None)

    @classmethod
    def of_manifest(cls, manifest: dict) -> ModelIdentity:
        """The identity of the model a checkpoint holds, from its manifest alone."""
        tensors = {}
        for relative, record in manifest.get("files", {}).items():
            if relative.startswith("model/"):
                for name, meta in (record.get("merak") or {}).items():
                    tensors[name] = tuple(meta["full_shape"])
        info = manifest.get("model_info")
        return cls(tensors, architecture(info["config"]) if info else None)

    @property
    def digest(self) -> str:
        """A short hash: equal for equal identities."""
        text = json.dumps([sorted((name, list(shape)) for name, shape in self.tensors.items()), self.config],
                          sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def differences(self, other: ModelIdentity) -> list[str]:
        """How ``other`` differs from this one, one line per kind of difference (empty: the same model).
        Config keys are compared only when both are known."""
        lines = []
        if self.config is not None and other.config is not None:
            changed = [f"{key} {self.config.get(key)!r} -> {other.config.get(key)!r}"
                       for key in sorted(set(self.config) | set(other.config))
                       if self.config.get(key) != other.config.get(key)]
            if changed:
                lines.append(f"config: {_listed(changed)}")
        only_here = sorted(set(self.tensors) - set(other.tensors))
        only_there = sorted(set(other.tensors) - set(self.tensors))
        reshaped = [f"{name} {list(self.tensors[name])} -> {list(other.tensors[name])}"
                    for name in sorted(set(self.tensors) & set(other.tensors))
                    if self.tensors[name] != other.tensors[name]]
        if only_here:
            lines.append(f"tensors only in the checkpoint: {_listed(only_here)}")
        if only_there:
            lines.append(f"tensors only in this model: {_listed(only_there)}")
        if reshaped:
            lines.append(f"other shapes: {_listed(reshaped)}")
        return lines


def _listed(items: list[str]) -> str:
    more = f" (and {len(items) - _SHOWN} more)" if len(items) > _SHOWN else ""
    return ", ".join(items[:_SHOWN]) + more


def checkpoints_that_conflict(model: Callable[[], nn.Module], *, resume: str | None, output_dir: str,
                              options) -> list[str]:
    """Why a run of ``model()`` may not start with these checkpoints (empty: it may). ``model`` is called
    only when there is something to compare; ``options`` is the checkpoint section.

    - The checkpoint to resume must hold the same model, unless ``partial_load`` (with finetune)
      asks for the tensors both share.
    - A run that saves must not write into a directory holding another model's checkpoints: a save
      of the same step would replace one, and rotation would remove them.
    """
    from merak.checkpoint.files import CheckpointError, list_checkpoints, read_manifest

    saves = options.save and bool(list_checkpoints(output_dir))
    if resume is None and not saves:
        return []
    identity = ModelIdentity.of_model(model())
    problems = []
    if resume is not None:
        differences = ModelIdentity.of_manifest(read_manifest(resume)).differences(identity)
        if differences and not options.partial_load:
            problems.append(
                f"trainer.resume_from_checkpoint: {resume} holds another model than this run builds "
                f"({'; '.join(differences)}). Resume with the model it was saved with; or start this model "
                f"from the tensors both share (same name and shape): trainer.finetune=true trainer.partial_load=true")
    if saves:
        for _, path in reversed(list_checkpoints(output_dir)):
            try:
                differences = ModelIdentity.of_manifest(read_manifest(path)).differences(identity)
            except CheckpointError:
                continue  # damaged: resuming reports it; rotation leaves what it cannot read
            if differences:
                problems.append(
                    f"trainer.save: {output_dir} holds checkpoints of another model ({path}: {differences[0]}); "
                    f"this run's checkpoints would replace or rotate them away. Choose another directory "
                    f"(hydra.run.dir=... or trainer.output_dir=...) or move them")
                break
    return problems
