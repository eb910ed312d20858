"""The checkpoint section of the ``trainer`` config: ``<output_dir>/checkpoint-<step>/``
(docs/checkpoints.md). merak.checkpoint.save_checkpoint and load_checkpoint receive it."""

from __future__ import annotations

from dataclasses import dataclass

from merak.core.fields import positive_int_problem, setting


@dataclass(frozen=True)
class CheckpointSettings:
    """When checkpoints are written, what they hold, and where a run starts from."""

    save: bool = setting(False, "write checkpoints")
    save_steps: int = setting(500, "every n steps (and at the end of the run)")
    save_total_limit: int | None = setting(-1, "keep the newest n checkpoints (-1 or null: all)")
    resume_from_checkpoint: str | bool | None = setting(
        None, "a checkpoint directory, or true: the newest in output_dir (none yet: start fresh)")
    finetune: bool = setting(False, "load weights only; step, optimizer and lr schedule start at 0")
    partial_load: bool = setting(False, "with finetune: a different model takes the tensors it shares with the "
                                 "checkpoint (same name and shape); the rest start as initialized")
    no_save_rng: bool = setting(False, "do not save RNG states")
    no_save_optim: bool = setting(False, "do not save the optimizer state")
    no_load_rng: bool = setting(False, "do not load RNG states")
    no_load_optim: bool = setting(False, "do not load the optimizer state")
    pretrained_weights: str | None = setting(None, "a Hugging Face model directory (safetensors) to start from")

    def problems(self) -> list[str]:
        problems = []
        if self.save:
            positive_int_problem("trainer.save_steps", self.save_steps, problems)
        limit = self.save_total_limit
        if limit is not None and limit != -1 and not (isinstance(limit, int) and limit >= 1):
            problems.append(f"trainer.save_total_limit={limit!r}: use -1 or null (keep all) or a positive number")
        resume = self.resume_from_checkpoint
        if self.finetune and resume in (None, False, ""):
            problems.append("trainer.finetune=true loads weights from a checkpoint: set "
                            "trainer.resume_from_checkpoint to its directory")
        if self.partial_load and not self.finetune:
            problems.append("trainer.partial_load=true loads part of another model's checkpoint: it needs "
                            "trainer.finetune=true (the step, optimizer and schedule start at 0)")
        if self.pretrained_weights and resume not in (None, False, ""):
            problems.append("trainer.pretrained_weights and trainer.resume_from_checkpoint both set: a run starts "
                            "from one of them")
        return problems
