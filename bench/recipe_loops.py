"""Two ways to train a recipe's model in this process, step by step, for side-by-side timing.

* :class:`MerakLoop`: the recipe's real path at ``parallel=single`` (Hydra config, capture, the
  engine, the data loader, metrics), driven through :class:`merak.session.training.TrainingSession`.
* :class:`PlainLoop`: the loop one writes without merak over the same ``build_model``, the same
  samples in the same order, the same loss, AdamW and gradient clipping.

Both report the wall time of every whole loop iteration (data, forward, backward, step, logging),
not just the compute call. Used by ``host_overhead.py`` (CPU) and ``gpu_single.py`` (one GPU).
"""

from __future__ import annotations

import contextlib
import importlib
import time
from collections.abc import Sequence
from pathlib import Path

import torch

import merak  # noqa: F401  (makes torchvision importable before transformers is)

REPO = Path(__file__).resolve().parents[1]


def compose_recipe(recipe: str, overrides: Sequence[str]):
    """The recipe's composed Hydra config with ``overrides``."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "recipes" / recipe / "conf"), version_base=None):
        return compose(config_name="train", overrides=list(overrides))


def recipe_spec(recipe: str):
    return importlib.import_module(f"recipes.{recipe}.spec").SPEC


class MerakLoop:
    """merak at dp = tp = pp = 1 through the recipe's own path (what ``train.py parallel=single`` runs)."""

    def __init__(self, recipe: str, overrides: Sequence[str], output_dir: str) -> None:
        from merak.config import resolve_settings, total_steps
        from merak.distributed import groups
        from merak.session.training import TrainingSession

        self.spec = recipe_spec(recipe)
        cfg = compose_recipe(recipe, ["parallel=single", f"trainer.output_dir={output_dir}",
                                      "trainer.disable_tqdm=true", *overrides])
        self.settings = resolve_settings(self.spec, cfg, world_size=None)
        self.prepared = self.spec.prepare_data(self.settings.data_cfg, self.settings.model_cfg)
        self.state = groups.init(1, 1, 1, backend=self.settings.launcher.backend)
        steps = total_steps(self.settings, 10**9)
        self.session = TrainingSession(self.spec, self.settings, self.prepared, steps=steps, state=self.state)
        self.losses: list[float] = []

    def run(self, count: int) -> list[float]:
        """Train ``count`` more steps; the wall time of each whole loop iteration."""
        marks = [time.perf_counter()]

        def on_step(step, result, record) -> bool:
            self.losses.append(result.loss)
            marks.append(time.perf_counter())
            return len(marks) > count

        self.session.train(on_step=on_step)
        return [b - a for a, b in zip(marks, marks[1:])]

    def close(self) -> None:
        from merak.distributed import groups

        groups.shutdown()


class _StepBatches(torch.utils.data.Sampler):
    """Yields the microbatch index lists of merak's BatchPlan in order, so both loops see the same samples."""

    def __init__(self, plan, first_step: int, num_steps: int) -> None:
        self.plan, self.first_step, self.num_steps = plan, first_step, num_steps

    def __iter__(self):
        for step in range(self.first_step, self.first_step + self.num_steps):
            yield from self.plan.microbatch_indices(step)

    def __len__(self) -> int:
        return self.num_steps * self.plan.num_microbatches


class PlainLoop:
    """The plain PyTorch loop over the same model and samples.

    Args:
        recipe: recipe name; ``overrides`` the same Hydra overrides merak gets (model, batch, lr, ...).
        device: where to train; on CUDA with ``dtype=bfloat16`` it runs under autocast with fused AdamW
            (the usual mixed-precision loop), elsewhere in fp32 with the default AdamW.
        num_workers: DataLoader workers (0: batches are made in the loop).
        channels_last: convert the model and images to channels-last (convolutional recipes on CUDA).
        compile: ``torch.compile`` the whole model (``model.compile()``, inductor's default mode).
    """

    def __init__(self, recipe: str, overrides: Sequence[str], *, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, num_workers: int = 0, channels_last: bool = False,
                 compile: bool = False) -> None:
        from merak.config import resolve_settings
        from merak.data.batching import BatchPlan

        self.spec = recipe_spec(recipe)
        cfg = compose_recipe(recipe, ["parallel=single", *overrides])
        settings = resolve_settings(self.spec, cfg, world_size=None)
        trainer = settings.trainer
        self.device = torch.device(device)
        self.dtype = dtype
        self.channels_last = channels_last
        self.model_cfg = settings.model_cfg
        torch.manual_seed(trainer.batch.seed)
        self.model = self.spec.build_model(self.model_cfg).to(self.device)
        if channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)
        self.model.train()
        if compile:
            self.model.compile()
        params = [p for p in self.model.parameters() if p.requires_grad]
        fused = {"fused": True} if self.device.type == "cuda" else {}
        self.optimizer = torch.optim.AdamW(
            [{"params": [p for p in params if p.ndim >= 2], "weight_decay": trainer.optimizer.weight_decay},
             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
            lr=trainer.optimizer.learning_rate, betas=(trainer.optimizer.adam_beta1, trainer.optimizer.adam_beta2),
            eps=trainer.optimizer.adam_epsilon,
            **fused)
        self.max_grad_norm = trainer.optimizer.max_grad_norm
        prepared = self.spec.prepare_data(settings.data_cfg, self.model_cfg)
        self.dataset = self.spec.load_dataset(prepared, self.model_cfg)
        self.plan = BatchPlan(num_samples=len(self.dataset), micro_batch_size=trainer.batch.per_device_train_batch_size,
                              num_microbatches=settings.num_microbatches, seed=trainer.batch.seed)
        self.num_workers = num_workers
        self.step = 0
        self.losses: list[float] = []

    def _batches(self, count: int):
        loader = torch.utils.data.DataLoader(
            self.dataset, batch_sampler=_StepBatches(self.plan, self.step, count), collate_fn=self.spec.collate,
            num_workers=self.num_workers, pin_memory=self.device.type == "cuda",
            persistent_workers=False)
        return iter(loader)

    def _to_device(self, batch):
        moved = {}
        for key, value in batch.items():
            value = value.to(self.device, non_blocking=True)
            if self.channels_last and value.dim() == 4:
                value = value.contiguous(memory_format=torch.channels_last)
            moved[key] = value
        return moved

    def run(self, count: int) -> list[float]:
        """Train ``count`` more steps; the wall time of each whole loop iteration."""
        batches = self._batches(count)
        autocast = torch.autocast(self.device.type, dtype=self.dtype) if self.dtype != torch.float32 \
            else contextlib.nullcontext()
        num_microbatches = self.plan.num_microbatches
        times = []
        for _ in range(count):
            started = time.perf_counter()
            total = torch.zeros((), device=self.device)
            for _ in range(num_microbatches):
                batch = self._to_device(next(batches))
                inputs = {name: batch[name] for name in self._input_names(batch)}
                with autocast:
                    output = self.model(**inputs)
                loss = self.spec.loss_fn(output, batch) / num_microbatches
                loss.backward()
                total += loss.detach()
            if self.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.losses.append(float(total))  # the one synchronisation a logging loop makes
            self.step += 1
            times.append(time.perf_counter() - started)
        return times

    def _input_names(self, batch) -> list[str]:
        from merak.session.assemble import default_input_names

        if not hasattr(self, "_names"):
            self._names = list(self.spec.input_names or default_input_names(self.model, batch))
        return self._names
