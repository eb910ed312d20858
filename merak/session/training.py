"""One worker's training session: its engine, its data and its reports.

Both front ends drive this class: ``merak.run`` (recipes, one session per spawned
or torchrun worker) and :class:`merak.MerakTrainer` (the seed API, in the user's
own processes). It assembles this rank's stage, restores a checkpoint, runs the
training loop with checkpoints and listeners, evaluates, and writes
``metrics.jsonl`` and ``summary.json``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable, Sequence

import torch
from torch.utils.data import Subset

from merak.checkpoint import load_checkpoint, load_pretrained, save_checkpoint
from merak.checkpoint.rng import seed_all
from merak.config import RunSettings
from merak.core.files import write_json_atomic
from merak.data.batching import BatchPlan, MicrobatchLoader
from merak.distributed import groups
from merak.distributed.groups import ParallelState
from merak.engine import PipelineEngine, StepResult
from merak.pipeline.hooks import PipelineHook
from merak.pipeline.wall_clock import write_timelines
from merak.report.metrics import (
    MetricsWriter,
    StepRecord,
    peak_rss_bytes,
    peak_tflops,
)
from merak.report.trackers import Trackers, tracker_names
from merak.session.assemble import assemble
from merak.shard.costs import calibrate
from merak.shard.plan import needs_calibration
from merak.shard.settings import ShardingSettings
from merak.tensor_parallel.options import TensorParallelSplit

logger = logging.getLogger(__name__)


class TrainingDiverged(RuntimeError):
    """Too many steps in a row had a loss or gradient norm that is not finite; the run stops."""


# Called after every optimizer step with (step counted from 1, the step's result, its record);
# returning True stops training after this step.
StepListener = Callable[[int, StepResult, StepRecord], bool]


def example_inputs(spec, settings: RunSettings, prepared) -> dict[str, torch.Tensor]:
    """One microbatch-shaped input: from the recipe's config shapes, else the first samples of the data."""
    size = settings.trainer.batch.per_device_train_batch_size
    if spec.example_inputs is not None:
        return dict(spec.example_inputs(settings.model_cfg, size))
    dataset = spec.load_dataset(prepared, settings.model_cfg)
    return spec.collate([dataset[i] for i in range(min(size, len(dataset)))])


def _calibrate_as_a_worker(settings: RunSettings, device, dtype):
    """Machine rates measured with the workers' thread count (the planning process has more threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(settings.launcher.threads_per_rank)
    try:
        return calibrate(device, dtype)
    finally:
        torch.set_num_threads(threads)


def _sharding_for(spec, settings: RunSettings) -> ShardingSettings:
    """The run's sharding section with the recipe's defaults. ZeRO-3 gathers one stage part at a time, and
    ``min_bytes`` (the default) cuts one part per stage: with the recipe's split points the stages are cut
    at them instead (``layer_split``), so a part is about one layer, as FSDP wraps one block per unit."""
    sharding = spec.sharding(settings.trainer.sharding)
    zero3 = settings.trainer.zero.stage == 3 and settings.grid.dp > 1
    if zero3 and sharding.split_method == "min_bytes" and sharding.custom_split_points \
            and sharding.trace_method is not None:
        logger.info("zero_stage=3: stages cut at the split points %s (split_method=layer_split), so each part "
                    "is gathered on its own", ", ".join(sharding.custom_split_points))
        return dataclasses.replace(sharding, split_method="layer_split")
    return sharding


def assemble_worker(spec, settings: RunSettings, prepared, *, stage_id: int, device, tp_rank: int = 0,
                    planning: bool = False):
    """This worker's model and stages; ``planning``: nothing materialized on meta (the model is built
    as the workers build it, so the plan is theirs: export graphs can differ between meta and real).
    With interleaved schedules the model is cut into pp x chunks pieces and the worker keeps
    pieces ``stage_id, stage_id + pp, ...``."""
    trainer = settings.trainer
    chunks, pp = trainer.schedule.chunks, settings.grid.pp
    sharding = _sharding_for(spec, settings)
    dtype = trainer.precision.dtype
    device_type = machine_rates = None
    if planning:  # plan for the workers' device (a process planning on the CPU for GPU workers)
        device_type = "cuda" if torch.cuda.is_available() and settings.launcher.backend != "gloo" else "cpu"
        if sharding.trace_method is not None and pp * chunks > 1 and needs_calibration(sharding):
            machine_rates = _calibrate_as_a_worker(settings, device, dtype)
    return assemble(
        build=functools.partial(spec.build_model, settings.model_cfg), seed=trainer.batch.seed,
        init_device=trainer.sharding.init_device, sharding=sharding,
        num_stages=pp * chunks, num_microbatches=settings.num_microbatches,
        stage_id=tuple(stage_id + c * pp for c in range(chunks)),
        device=device, example_inputs=example_inputs(spec, settings, prepared), build_stages=spec.build_stages,
        materialize_stage=not planning, dtype=dtype, input_names=trainer.batch.input_names or spec.input_names,
        machine_rates=machine_rates, device_type=device_type,
        tensor_parallel=TensorParallelSplit(plan=spec.tensor_parallel_plan(settings.model_cfg),
                                            size=settings.grid.tp, rank=tp_rank, settings=trainer.tensor_parallel))


class SizeOnly:
    """The held-out set's size on ranks that read no data (they only count evaluation steps)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        raise RuntimeError("this rank reads no data: only the first and last pipeline stages load samples")


class TrainingSession:
    """This worker's stage, optimizer and data, ready to train, evaluate and report.

    Args:
        spec: the RecipeSpec (a recipe's, or the one MerakTrainer makes for the user's model).
        settings: validated run settings.
        prepared: what ``spec.prepare_data`` returned.
        steps: optimizer steps of the whole run.
        state: this rank's parallel state (``merak.init``).
        resume: the checkpoint to start from, if any.
        hooks: extra pipeline listeners (called around every compute instruction).
    """

    def __init__(self, spec, settings: RunSettings, prepared, *, steps: int, state: ParallelState,
                 resume: str | None = None, hooks: Sequence[PipelineHook] = ()) -> None:
        self.spec, self.settings, self.prepared = spec, settings, prepared
        self.steps, self.state, self.resume = steps, state, resume
        self.started = time.perf_counter()
        trainer = settings.trainer
        built = assemble_worker(spec, settings, prepared, stage_id=state.coordinates.pp, device=state.device,
                                tp_rank=state.coordinates.tp)
        self.model = built.model  # the full model object: this rank's stage modules are its modules
        self.plan = built.plan
        self.forward_flops = built.forward_flops  # per microbatch, the whole model
        convolutional_on_gpu = spec.channels_last and state.device.type == "cuda"
        self.engine = PipelineEngine(
            model=built.model, stages=built.stages, loss_fn=spec.loss_fn, state=state,
            schedule=trainer.schedule.train_schedule, num_microbatches=settings.num_microbatches, total_steps=steps,
            optimizer=trainer.optimizer, recompute=trainer.schedule, num_chunks=trainer.schedule.chunks,
            dropout_seed=trainer.batch.seed, hooks=hooks, dealloc_pipeoutput=trainer.schedule.dealloc_pipeoutput,
            record_timeline=trainer.schedule.wall_clock_breakdown, zero=trainer.zero, precision=trainer.precision,
            measure_activations=trainer.schedule.measure_activation_memory, channels_last=convolutional_on_gpu,
            compile=trainer.compile)
        if convolutional_on_gpu:
            torch.backends.cudnn.benchmark = True  # fixed shapes: pick the fastest convolution once
        del built  # the engine keeps this rank's stage only
        grid = settings.grid
        # Dropout masks differ between replicas and stages, but not within a tensor-parallel group,
        # whose ranks hold the same replicated activations.
        seed_all(trainer.batch.seed + grid.rank_of(pp=state.coordinates.pp, dp=state.coordinates.dp, tp=0))
        self.first_step = self._start()  # after seeding: a checkpoint's RNG states win
        self.step = self.first_step
        self.loader = None
        self.eval_dataset = None  # samples held out of training for trainer.eval_steps
        self.last_eval: dict | None = None
        if self.feeds_data:
            dataset, self.eval_dataset = self._hold_out(spec.load_dataset(prepared, settings.model_cfg))
            plan = BatchPlan(num_samples=len(dataset), micro_batch_size=trainer.batch.per_device_train_batch_size,
                             num_microbatches=settings.num_microbatches, dp_size=grid.dp,
                             dp_rank=state.coordinates.dp, seed=trainer.batch.seed)
            self.loader = self._loader(dataset, plan)
        if trainer.report.eval_steps:  # evaluation steps are collective: every rank needs the held-out size
            size = groups.broadcast_object(len(self.eval_dataset) if self.eval_dataset is not None else None)
            self.eval_dataset = self.eval_dataset if self.eval_dataset is not None else SizeOnly(size)
        self.metrics: MetricsWriter | None = None
        self.saved: list[str] = []
        self.protected: set[str] = set()  # checkpoints save_total_limit never removes (the best one)
        self._saved_at: dict[int, str] = {}
        self.skipped_in_a_row = 0
        # Collective callables whose dicts (rank 0's) join the run summary, e.g. the energy report.
        self.summary_sections: list[Callable[[], dict]] = []
        # Collective callables every rank calls after each logged training step (trainer.logging_steps),
        # in order; their dicts (rank 0's) join the step's record, e.g. the step's energy.
        self.step_sections: list[Callable[[], dict]] = []

    def _hold_out(self, dataset):
        """``(training samples, held-out samples)``: with ``trainer.eval_steps``, the last
        ``eval_holdout`` of the dataset (at least one evaluation step) is kept out of training."""
        trainer, settings = self.settings.trainer, self.settings
        if not trainer.report.eval_steps:
            return dataset, None
        total = len(dataset)
        one_step = settings.global_batch_size
        held = max(round(total * trainer.report.eval_holdout), one_step)
        if total - held < one_step:
            raise ValueError(f"trainer.eval_steps: the dataset has {total} samples, too few to hold out {held} "
                             f"for evaluation and still train one global batch of {one_step}; lower "
                             f"trainer.eval_holdout or the batch size, or use more data")
        return Subset(dataset, range(total - held)), Subset(dataset, range(total - held, total))

    def _loader(self, dataset, plan: BatchPlan) -> MicrobatchLoader:
        trainer = self.settings.trainer
        return MicrobatchLoader(dataset, plan, collate=self.spec.collate, device=self.state.device,
                                num_workers=loader_workers(trainer.batch.dataloader_num_workers, self.state.device),
                                pin_memory=trainer.batch.dataloader_pin_memory, channels_last=self.engine.channels_last)

    @property
    def tokens_per_sample(self) -> int:
        """Tokens in one sample (1 for images and other non-text samples)."""
        return self.spec.tokens_per_sample(self.settings.model_cfg)

    @property
    def feeds_data(self) -> bool:
        """Whether this rank reads data (the first stage its inputs, the last stage its labels)."""
        return self.state.is_first_stage or self.state.is_last_stage

    @property
    def is_reporting_rank(self) -> bool:
        return self.state.rank == 0

    def _start(self) -> int:
        """Load the checkpoint or pretrained weights this run starts from; return the first step."""
        trainer = self.settings.trainer
        if self.resume is not None:
            state = load_checkpoint(self.engine, self.resume, options=trainer.checkpoint)
            return int(state["step"])
        if trainer.checkpoint.pretrained_weights:
            count = load_pretrained(self.engine, trainer.checkpoint.pretrained_weights)
            logger.info("loaded %d tensors from %s", count, trainer.checkpoint.pretrained_weights)
        return 0

    # -- training ------------------------------------------------------------------

    def _run_info(self) -> dict:
        from omegaconf import OmegaConf

        model_cfg = self.settings.model_cfg
        model = OmegaConf.to_container(model_cfg, resolve=True) if OmegaConf.is_config(model_cfg) else model_cfg
        return {"recipe": self.spec.name, "model": model, "seed": self.settings.trainer.batch.seed,
                "global_batch_size": self.settings.global_batch_size}

    def save(self) -> str:
        """Write a checkpoint of the current step (collective: every rank calls it); a step already
        saved is not written again."""
        if self.saved and self.saved[-1] == self._saved_at.get(self.step):
            return self.saved[-1]
        trainer = self.settings.trainer
        path = save_checkpoint(
            self.engine, self.settings.output_dir, step=self.step, run_info=self._run_info(),
            trainer_state={"consumed_samples": self.step * self.settings.global_batch_size},
            options=trainer.checkpoint, keep=self.protected)
        self.saved.append(path)
        self._saved_at[self.step] = path
        return path

    def train(self, on_step: StepListener | None = None,
              before_step: Callable[[int], None] | None = None) -> dict | None:
        """Train from the current step to ``steps``; checkpoints every ``save_steps`` and at the end.

        ``before_step(step)`` runs before each step (counted from 0) and ``on_step`` after it.

        Returns:
            The run summary on rank 0, None on the other ranks.
        """
        settings = self.settings
        report, checkpoint, schedule = settings.trainer.report, settings.trainer.checkpoint, settings.trainer.schedule
        trackers = Trackers(tracker_names(report.report_to), settings.output_dir, run_name=report.run_name,
                            config=self._run_info()) if self.is_reporting_rank else None
        self.metrics = MetricsWriter(output_dir=settings.output_dir, total_steps=self.steps,
                                     samples_per_step=settings.global_batch_size,
                                     tokens_per_sample=self.tokens_per_sample,
                                     enabled=self.is_reporting_rank, logging_steps=report.logging_steps,
                                     start_step=self.first_step, progress_bar=not report.disable_tqdm,
                                     trackers=trackers)
        stop = False
        try:
            while self.step < self.steps and not stop:
                if before_step is not None:
                    before_step(self.step)
                step_start = time.perf_counter()
                microbatches = self.loader.load_step(self.step) if self.loader else None
                result = self.engine.train_step(microbatches)
                step_time_s = time.perf_counter() - step_start
                self.step += 1
                record = self.metrics.log_step(step=self.step, loss=result.loss, lr=result.learning_rate,
                                               grad_norm=result.grad_norm, step_time_s=step_time_s,
                                               skipped=result.skipped, loss_scale=result.loss_scale,
                                               measured=self._step_sections(self.step))
                self._check_finite(result)
                if on_step is not None:
                    stop = bool(on_step(self.step, result, record))
                last = self.step == self.steps or stop
                if report.eval_steps and (self.step % report.eval_steps == 0 or last):
                    self.evaluate_held_out()
                if checkpoint.save and (self.step % checkpoint.save_steps == 0 or last):
                    self.save()
        finally:
            # Also when a step fails or the run is interrupted: the steps done so far get their loss.png.
            self.metrics.close()
        if self.loader is not None:
            self.loader.close()
        timeline = write_timelines(self.engine, schedule=schedule.train_schedule, output_dir=settings.output_dir,
                                   rank=self.state.rank) if schedule.wall_clock_breakdown else None
        return self.write_summary(timeline, extra={"eval": self.last_eval} if self.last_eval else None)

    def _step_sections(self, step: int) -> dict:
        """The step sections' dicts merged, on a logged step (every rank alike: they are collectives)."""
        measured: dict = {}
        if self.metrics.logs(step):
            for section in self.step_sections:
                measured.update(section())
        return measured

    def evaluate_held_out(self) -> dict:
        """Evaluate the held-out samples (``trainer.eval_steps``); rank 0 logs the metrics and writes them
        to metrics.jsonl and the trackers. Collective."""
        trainer = self.settings.trainer
        metrics, _ = self.evaluate(self.eval_dataset, micro_batch_size=trainer.batch.per_device_train_batch_size,
                                   eval_iters=trainer.report.eval_iters)
        self.last_eval = {"step": self.step, **metrics}
        if self.is_reporting_rank:
            self.metrics.log_event(self.last_eval)
            with self.metrics.above_the_bar():
                logger.info("step %d: eval_loss %.4f on %d held-out samples", self.step, metrics["eval_loss"],
                            metrics["eval_samples"])
        return metrics

    def _check_finite(self, result: StepResult) -> None:
        """Count skipped steps in a row (fp16 overflows a smaller loss scale may cure do not count);
        stop the run at ``max_consecutive_skipped_steps``. Every rank decides alike: the skip was
        agreed on by all of them."""
        if not result.skipped:
            self.skipped_in_a_row = 0
            return
        if result.scale_may_cure:
            return
        self.skipped_in_a_row += 1
        limit = self.settings.trainer.optimizer.max_consecutive_skipped_steps
        if self.is_reporting_rank:
            logger.warning("step %d skipped: loss %s, gradient norm %s, learning rate %.3g (%d in a row; the run "
                           "stops at %d)", self.step, _number(result.loss), _number(result.grad_norm),
                           result.learning_rate, self.skipped_in_a_row, limit)
        if self.skipped_in_a_row >= limit:
            last = self.saved[-1] if self.saved else self.resume
            raise TrainingDiverged(
                f"steps {self.step - limit + 1}-{self.step}: the loss or gradient norm was not finite "
                f"{limit} steps in a row (loss {_number(result.loss)}, gradient norm {_number(result.grad_norm)}, "
                f"learning rate {result.learning_rate:.3g}); the weights were not updated by these steps"
                f"{'; the last checkpoint is ' + last if last else ''}. Lower trainer.learning_rate, check the "
                f"data, or raise trainer.max_consecutive_skipped_steps")

    # -- evaluation ----------------------------------------------------------------

    def eval_batches(self, dataset, *, micro_batch_size: int, eval_iters: int | None = None):
        """This rank's evaluation steps over ``dataset``: lists of microbatches (None on ranks that
        read no data). The dataset is split across dp replicas in order, without shuffling; samples
        past the last whole step are not evaluated (``eval_iters`` limits the steps)."""
        settings = self.settings
        plan = BatchPlan(num_samples=len(dataset), micro_batch_size=micro_batch_size,
                         num_microbatches=settings.num_microbatches, dp_size=settings.grid.dp,
                         dp_rank=self.state.coordinates.dp, shuffle=False)
        steps = plan.steps_per_epoch if eval_iters is None else min(eval_iters, plan.steps_per_epoch)
        loader = self._loader(dataset, plan) if self.feeds_data else None
        for step in range(steps):
            yield plan, (loader.load_step(step) if loader else None)

    def evaluate(self, dataset, *, micro_batch_size: int, eval_iters: int | None = None,
                 keep_outputs: bool = False) -> tuple[dict, list]:
        """Mean loss over ``dataset`` sharded across dp (see :meth:`eval_batches`).

        Returns:
            ``({"eval_loss", "eval_samples", "eval_steps", "eval_runtime", "eval_samples_per_second",
            "eval_steps_per_second"}, outputs)`` (Hugging Face's names): the metrics on
            every rank; with ``keep_outputs``, on the last stage, ``(microbatch, outputs)`` pairs in
            order (else empty).
        """
        started = time.perf_counter()
        losses, kept, plan = [], [], None
        for step_plan, microbatches in self.eval_batches(dataset, micro_batch_size=micro_batch_size,
                                                         eval_iters=eval_iters):
            plan = step_plan  # the last step's plan is read after the loop
            loss, outputs = self.engine.evaluate_step(microbatches, keep_outputs=keep_outputs)
            losses.append(loss)
            if keep_outputs and outputs:
                kept += [(microbatches[m], outputs[m]) for m in sorted(outputs)]
        if not losses:
            raise ValueError(f"the evaluation set has {len(dataset)} samples, fewer than one evaluation step "
                             f"({plan.global_batch_size if plan else '?'} samples: micro batch x "
                             f"gradient_accumulation_steps x dp)")
        runtime = time.perf_counter() - started
        samples = len(losses) * plan.global_batch_size
        metrics = {"eval_loss": sum(losses) / len(losses), "eval_samples": samples, "eval_steps": len(losses),
                   "eval_runtime": runtime, "eval_samples_per_second": samples / runtime,
                   "eval_steps_per_second": len(losses) / runtime}
        return metrics, kept

    # -- reporting -----------------------------------------------------------------

    def model_flops_per_step(self) -> float | None:
        """Model FLOPs of one optimizer step: 3 x the forward FLOPs of the whole model (counted before
        tensor-parallel slicing, so every layout reports the same number). Where they could not be
        counted so, what the ranks counted while running. Collective."""
        if self.forward_flops:
            return 3.0 * self.forward_flops * self.settings.num_microbatches * self.settings.grid.dp
        return self.engine.model_flops_per_step()

    def write_summary(self, timeline: dict | None = None, extra: dict | None = None) -> dict | None:
        """Gather every rank's memory figures; rank 0 writes summary.json (per stage: the most any of
        its ranks holds; per rank: everything) and returns the summary. Collective."""
        engine, settings, metrics = self.engine, self.settings, self.metrics
        local = {"stage": engine.stage_id, "rank": self.state.rank,
                 "num_parameters": sum(p.numel() for _, p in engine.named_parameters()),
                 "peak_rss_bytes": peak_rss_bytes(), **engine.memory_report()}
        everyone = groups.gather_from_all(local)
        compile_reports = groups.gather_from_all(engine.compile_report())
        flops_per_step = self.model_flops_per_step()
        sections = [section() for section in self.summary_sections]
        if self.state.rank != 0:
            return None
        stages = []
        for stage_id in range(settings.grid.pp):
            rows = [r for r in everyone if r["stage"] == stage_id]
            merged = {key: max(r[key] for r in rows) for key in rows[0] if key not in ("stage", "rank")}
            stages.append({"stage": stage_id, "ranks": sorted(r["rank"] for r in rows), **merged})
        grid, records = settings.grid, metrics.records if metrics else []
        throughput = metrics.throughput() if records else {}
        summary = {
            "recipe": self.spec.name, "model": _model_name(settings.model_cfg),
            "layout": {"dp": grid.dp, "tp": grid.tp, "pp": grid.pp},
            "schedule": settings.trainer.schedule.train_schedule, "steps": self.steps,
            "global_batch_size": settings.global_batch_size, "num_microbatches": settings.num_microbatches,
            "first_loss": records[0].loss if records else None,
            "final_loss": records[-1].loss if records else None,
            "final_learning_rate": records[-1].learning_rate if records else None,
            **throughput, "wall_time_s": time.perf_counter() - self.started, "stages": stages,
            "flops": _flops_report(flops_per_step, throughput.get("median_step_time_s"), grid.world_size,
                                   settings.trainer.report.peak_tflops, engine.optimizer.precision.dtype),
            "recompute": {"activation_checkpointing": settings.trainer.schedule.activation_checkpointing,
                          "selective_recompute": settings.trainer.schedule.selective_mode,
                          "activation_checkpoint_ratio": settings.trainer.schedule.activation_checkpoint_ratio,
                          "pipeline_chunks": engine.num_chunks},
            "compile": _merged_compile_report(compile_reports),
            "ranks": sorted(everyone, key=lambda r: r["rank"]),
            "checkpoints": {"resumed_from": self.resume, "saved": list(self.saved)},
            "precision": {"dtype": str(engine.optimizer.precision.dtype).removeprefix("torch."),
                          "zero_stage": engine.optimizer.zero.stage, "loss_scale": engine.optimizer.loss_scale,
                          "skipped_steps": sum(r.skipped for r in records)},
            **(extra or {}),
        }
        for section in sections:
            summary.update(section)
        if timeline is not None:
            summary["timeline"] = timeline
        write_json_atomic(os.path.join(settings.output_dir, "summary.json"), summary)
        return summary


def _number(value: float) -> str:
    return f"{value:.4g}"


def loader_workers(setting: int | None, device: torch.device) -> int:
    """Data-loader worker processes: the setting, else 2 on CUDA (batches made while the GPU computes)
    and 0 on the CPU (where workers would take cores from the training processes)."""
    if setting is not None:
        return setting
    return 2 if device.type == "cuda" else 0


def _merged_compile_report(reports: list[dict]) -> dict:
    """Every rank's compile report as one: the slowest rank's compile time, every rank's eager ranges."""
    eager = {}
    for report in reports:
        eager.update(report["eager_ranges"])
    return reports[0] | {"compile_s": max(r["compile_s"] for r in reports), "eager_ranges": eager}


def _model_name(model_cfg) -> str:
    getter = getattr(model_cfg, "get", None)
    return str(getter("name", "?")) if getter else "?"


def _flops_report(flops_per_step: float | None, step_time_s: float | None, world_size: int,
                  peak_setting: float | None, dtype: torch.dtype) -> dict | None:
    """Achieved model FLOP/s and MFU (against the devices' peak, when known)."""
    if not flops_per_step or not step_time_s:
        return None
    achieved = flops_per_step / step_time_s / world_size / 1e12
    peak = peak_setting if peak_setting else peak_tflops(dtype)
    return {"formula": "3 x forward FLOPs measured by torch.utils.flop_counter (backward = 2 x forward; "
                       "recomputation not counted)",
            "model_flops_per_step": flops_per_step, "tflops_per_s_per_device": achieved,
            "peak_tflops_per_device": peak, "mfu": achieved / peak if peak else None}


__all__ = ["TrainingDiverged", "TrainingSession", "assemble_worker", "example_inputs"]
