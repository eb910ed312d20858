"""MerakTrainer: the seed API's trainer for the user's own model, with 3D parallelism.

Every process runs the same script (torchrun, srun, or one process)::

    merak.init(dp=2, tp=1, pp=2)
    trainer = MerakTrainer(model=model, args=MerakArguments(...), train_data=ds, eval_data=ds_eval)
    trainer.train()

The trainer turns the model, data and arguments into the same run settings a
recipe has, and drives the same :class:`merak.session.training.TrainingSession`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
from omegaconf import OmegaConf
from torch import nn
from transformers.trainer_callback import (
    CallbackHandler,
    DefaultFlowCallback,
    PrinterCallback,
    TrainerControl,
    TrainerState,
)
from transformers.trainer_utils import EvalPrediction, PredictionOutput, TrainOutput

from merak.config import ConfigError, resolve_settings, total_steps
from merak.data.batching import BatchPlan
from merak.distributed import groups
from merak.energy.runtime import start_energy
from merak.hf.arguments import MerakArguments, trainer_settings
from merak.hf.cadence import Cadence, cadence_problems, resolve_cadence
from merak.hf.fields import ignored_fields
from merak.hf.loss import LabelLoss, is_causal_lm
from merak.hf.outputs import TrainerOutputs
from merak.hf.predictions import gather_predictions
from merak.hf.samples import Samples, default_collate
from merak.recipe import RecipeSpec
from merak.report.console import DATE_FORMAT, log_format
from merak.report.metrics import format_summary
from merak.session.run_directory import RunDirectoryBusy, RunDirectoryLock
from merak.session.training import TrainingSession
from merak.tensor_parallel import MissingTPPlanError, plan_for
from merak.tensor_parallel.seed_api import user_plan

logger = logging.getLogger(__name__)


class MerakTrainer(TrainerOutputs):
    """Train, evaluate, predict and generate with the model split over ``merak.init``'s grid.

    Args:
        model: the unmodified single-device model (built identically, with the same seed, in
            every process). Or give ``model_init``.
        args: the training arguments.
        train_data: training samples (``__len__`` and ``__getitem__`` -> dict of fields), e.g. a
            ``datasets.Dataset`` or a torch ``Dataset``.
        eval_data: evaluation samples (same form).
        leaf_modules: module classes or names kept whole when tracing.
        loss_fn: ``loss_fn(logits, labels)`` on flattened logits and labels, as ``nn.CrossEntropyLoss()``
            (the default; causal language models are shifted first). To see the whole output and
            batch, pass ``compute_loss(output, batch)`` instead.
        compute_loss: ``(model output, microbatch dict) -> mean loss``; replaces ``loss_fn``.
        data_collator: ``(list of samples) -> dict of tensors`` (default: stack each field).
        callbacks: ``transformers.TrainerCallback`` instances (progress, logging, early stopping...).
        model_init: ``() -> nn.Module``, called by merak after seeding; with ``args.init_device``
            ``meta`` or ``auto`` a giant model is built without memory and each rank materializes
            only its own stage.
        tp_plan: for ``tp > 1``, a merak TPPlan or a transformers-style dict (``{"model.layers.*.self_attn.q_proj":
            "colwise", ...}``); default: the plan from ``merak.set_tp_layer_lists``, else the model family's
            plan merak holds, else the model's own transformers plan (:func:`merak.tensor_parallel.plan_for`).
        train_dataset, eval_dataset: Hugging Face names for ``train_data`` and ``eval_data``.
    """

    def __init__(self, model: nn.Module | None = None, args: MerakArguments | None = None, train_data=None,
                 eval_data=None, leaf_modules: Sequence = (), loss_fn: Callable | None = None, *,
                 compute_loss: Callable | None = None, data_collator: Callable | None = None,
                 callbacks: Sequence = (), model_init: Callable[[], nn.Module] | None = None, tp_plan=None,
                 train_dataset=None, eval_dataset=None, processing_class=None,
                 compute_metrics: Callable | None = None, do_train: bool | None = None,
                 optimizers=(None, None)) -> None:
        if (model is None) == (model_init is None):
            raise ValueError("give the model or model_init (not both)")
        if any(part is not None for part in optimizers):
            raise ValueError("optimizers=(optimizer, scheduler) is not supported: merak builds the optimizer "
                             "of each rank's stage from the arguments (optim, learning_rate, lr_scheduler_type...)")
        self.args = args if args is not None else MerakArguments(output_dir="merak-output")
        if not isinstance(self.args, MerakArguments):
            raise TypeError(f"args must be MerakArguments, got {type(self.args).__name__}")
        if do_train is not None:  # the seed API passes it to the trainer
            self.args.do_train = do_train
        self.train_data = train_data if train_data is not None else train_dataset
        self.eval_data = eval_data if eval_data is not None else eval_dataset
        self.processing_class = processing_class
        self.compute_metrics = compute_metrics
        self.state_grid = groups.get_state() if groups.is_initialized() else self._init_from_environment()
        if not logging.getLogger().handlers:  # a plain script: show merak's progress and summary on rank 0
            rank = self.state_grid.rank
            logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                                format=log_format(f"rank {rank}"), datefmt=DATE_FORMAT)
        if self.args.tf32 is not None and torch.cuda.is_available():
            torch.backends.cuda.matmul.allow_tf32 = bool(self.args.tf32)
            torch.backends.cudnn.allow_tf32 = bool(self.args.tf32)
        if model is not None and self.args.lora_config:
            from merak.hf.lora import apply_lora

            model = apply_lora(model, self.args.lora_config, adapter_name=self.args.adapter_name)
        self.model = model
        self._from_init = model_init is not None
        label_name = (self.args.label_names or ["labels"])[0]
        self.loss = compute_loss or LabelLoss(loss_fn, label_name=label_name,
                                              shift=model is not None and is_causal_lm(model),
                                              label_smoothing=self.args.label_smoothing_factor)
        self.collate = data_collator or default_collate
        # The user's plan, else the model family's or transformers' own (merak.hf.tp_plans);
        # LoRA with tp > 1 is refused in _settings with its own reason.
        try:
            plan = None if self.args.lora_config else plan_for(
                model if model is not None else model_init, tp_plan if tp_plan is not None else user_plan(),
                tp=self.state_grid.grid.tp)
        except MissingTPPlanError as error:
            raise ConfigError(str(error)) from None
        self.spec = RecipeSpec(
            name=type(model).__name__ if model is not None else "model_init",
            build_model=(lambda _cfg: self.model) if model is not None else (lambda _cfg: model_init()),
            loss_fn=self.loss, prepare_data=lambda _data, _model: None,
            load_dataset=lambda _prepared, _model: self._require_train_data(), collate=self.collate,
            leaf_modules=tuple(leaf_modules), tp_plan=plan,
            tokens_per_sample=lambda _cfg: self._tokens_per_sample())
        self.settings, self.cadence = self._settings()
        ignored = ignored_fields(self.args)
        if ignored and self.is_world_process_zero():
            logger.warning("MerakArguments: merak does not implement %s; %s no effect",
                           "; ".join(ignored), "it has" if len(ignored) == 1 else "they have")
        # DefaultFlowCallback keeps the control flags the built-in callbacks read; merak decides logging,
        # evaluation and saving itself (MerakTrainer.cadence) and stops at max_steps.
        handlers = [DefaultFlowCallback, *([PrinterCallback] if self.args.disable_tqdm else [])]
        from transformers.integrations import get_reporting_integration_callbacks

        handlers += get_reporting_integration_callbacks(self.args.report_to)
        self.callback_handler = CallbackHandler([*handlers, *callbacks], model, processing_class, None, None)
        self.state = TrainerState(is_local_process_zero=self.is_world_process_zero(),
                                  is_world_process_zero=self.is_world_process_zero())
        self.control = TrainerControl()
        self.session: TrainingSession | None = None
        self.summary: dict | None = None
        self._evaluated_at: int | None = None
        # merak.energy.runtime.EnergyRuntime where the run measures energy, else an EnergyOff saying why
        self.energy = None

    def _init_from_environment(self):
        """Without ``merak.init``: one process, or data parallelism over a launcher's processes
        (torchrun or srun set WORLD_SIZE), as a Hugging Face script expects."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        backend = "gloo" if self.args.use_cpu else (self.args.ddp_backend or self.args.backend)
        if world > 1:
            logger.info("merak.init was not called: data parallelism over the %d processes (dp=%d)", world, world)
        return groups.init(dp=world, tp=1, pp=1, backend=backend, timeout_s=self.args.timeout_s)

    # -- set-up ----------------------------------------------------------------

    def _require_train_data(self):
        if self.train_data is None:
            raise ValueError("MerakTrainer needs train_data (it also shapes the graph merak captures)")
        return Samples(self.train_data)

    def _tokens_per_sample(self) -> int:
        sample = self._require_train_data()[0]
        ids = sample.get("input_ids")
        return int(ids.numel()) if ids is not None else 1

    def _settings(self) -> tuple:
        """The run settings and the cadence (when to log, evaluate and save) of these arguments."""
        args, grid = self.args, self.state_grid.grid
        problems = args.problems() + cadence_problems(args)
        problems += args.model_problems(self.model, self._require_train_data()[0] if self.train_data else None)
        if args.parallel_vocab and grid.tp > 1 and isinstance(self.loss, LabelLoss) and self.loss.loss_fn:
            problems.append("parallel_vocab with tp > 1 gives the loss vocabulary slices of the logits: leave "
                            "loss_fn unset (merak's vocabulary-parallel cross entropy)")
        if args.parallel_vocab and grid.tp > 1 and args.label_smoothing_factor:
            problems.append("label_smoothing_factor with parallel_vocab and tp > 1 is not supported: the "
                            "smoothing term needs the whole vocabulary's log-probabilities; set parallel_vocab=False")
        if args.lora_config and grid.tp > 1:
            problems.append("lora_config with tp > 1 is not supported (peft's adapter layers have no "
                            "tensor-parallel plan): use dp and pp")
        if args.use_cpu and self.state_grid.device.type != "cpu":
            problems.append(f"use_cpu=True but merak.init chose {self.state_grid.device}: call "
                            f"merak.init(..., backend='gloo')")
        if problems:
            raise ConfigError("invalid MerakArguments:\n  - " + "\n  - ".join(problems))
        settings = self._resolve(trainer_settings(args))
        steps_per_epoch = self._train_plan(settings).steps_per_epoch
        steps = total_steps(settings, steps_per_epoch)
        cadence = resolve_cadence(args, steps_per_epoch=steps_per_epoch, total_steps=steps,
                                  has_eval_data=self.eval_data is not None)
        return self._resolve(trainer_settings(args, total_steps_hint=steps, cadence=cadence)), cadence

    def _resolve(self, trainer: dict):
        """Run settings from a trainer section, validated like a recipe's."""
        grid = self.state_grid.grid
        if not self._from_init:
            trainer["init_device"] = "cpu"  # the model exists already
        cfg = OmegaConf.create({
            "trainer": trainer, "parallel": {"dp": grid.dp, "tp": grid.tp, "pp": grid.pp},
            "launcher": {"backend": self.args.backend, "timeout_s": self.args.timeout_s},
            "model": {"name": self.spec.name}, "data": {}})
        return resolve_settings(self.spec, cfg, world_size=grid.world_size)

    def is_world_process_zero(self) -> bool:
        return self.state_grid.rank == 0

    def _train_plan(self, settings=None) -> BatchPlan:
        """How the training data is cut into global batches (the whole dataset, every rank alike)."""
        settings = settings or self.settings
        return BatchPlan(num_samples=len(self._require_train_data()),
                         micro_batch_size=settings.trainer.batch.per_device_train_batch_size,
                         num_microbatches=settings.num_microbatches, dp_size=settings.grid.dp)

    def _steps(self) -> int:
        return total_steps(self.settings, self._train_plan().steps_per_epoch)

    def _check_checkpoints_fit(self, resume: str | None) -> None:
        """Resume only the model that was saved, and never save over another model's checkpoints (as
        merak.run checks before its workers start)."""
        from merak.checkpoint import CheckpointError
        from merak.checkpoint.identity import checkpoints_that_conflict

        problems = checkpoints_that_conflict(lambda: self.model, resume=resume, output_dir=self.settings.output_dir,
                                             options=self.settings.trainer.checkpoint)
        if problems:
            raise CheckpointError("; ".join(problems))

    def _session(self) -> TrainingSession:
        if self.session is None:
            from merak.checkpoint import find_checkpoint

            steps = self._steps()
            self.state.max_steps = steps
            resume = find_checkpoint(self.settings.trainer.checkpoint.resume_from_checkpoint, self.settings.output_dir)
            self._check_checkpoints_fit(resume)
            self.energy = start_energy(self.settings.trainer.energy, self.state_grid)
            self.session = TrainingSession(self.spec, self.settings, None, steps=steps, state=self.state_grid,
                                           resume=resume, hooks=self.energy.hooks)
            if not self.args.profile:
                self.energy.attach(self.session)  # each logged step's energy, and the run's (or why not)
            self.model = self.session.model
            grid = self.state_grid.grid
            zero3 = self.settings.trainer.zero.stage == 3 and grid.dp > 1
            if (grid.pp > 1 or grid.tp > 1 or zero3) and not self.args.lora_config:  # save_adapter gathers
                # The model object holds this rank's stage (sliced with tp): its other tensors are never
                # trained, so saving it would write a wrong model without a word.
                self.model.save_pretrained = self._refuse_partial_save
            self.callback_handler.model = self.model
            self.callback_handler.optimizer = self.session.engine.optimizer.optimizer
            self.callback_handler.lr_scheduler = self.session.engine.lr_scheduler
        return self.session

    def _refuse_partial_save(self, *args, **kwargs):
        grid = self.state_grid.grid
        split = f"split over {grid.pp} pipeline stages x {grid.tp} tensor-parallel ranks" \
            if grid.pp > 1 or grid.tp > 1 else f"sharded over {grid.dp} data-parallel ranks (ZeRO-3)"
        raise RuntimeError(
            f"trainer.model is {split}: this process holds only its own part. Call trainer.save_model(directory) "
            f"on every rank; it gathers the whole trained model and writes it where from_pretrained loads it")

    # -- training --------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs) -> TrainOutput:
        """Train for ``max_steps`` (or the epochs); returns a ``TrainOutput`` on every rank.

        Logs, evaluates and saves as the ``*_strategy`` fields say (:mod:`merak.hf.cadence`),
        evaluates once more at the end with ``do_eval`` (unless the last step was just evaluated),
        and with ``load_best_model_at_end`` ends with the best evaluated checkpoint's weights. The
        run summary (throughput, memory, the plan) is ``self.summary`` on rank 0.
        """
        if kwargs:
            raise TypeError(f"train() got arguments merak does not take: {', '.join(sorted(kwargs))} "
                            f"(hyperparameter search is not supported)")
        if resume_from_checkpoint is not None:
            if self.session is not None:
                raise ValueError("resume_from_checkpoint must be given to the first train()/evaluate() call: "
                                 "this trainer's model is built already")
            self.args.resume_from_checkpoint = resume_from_checkpoint
            self.settings, self.cadence = self._settings()
        if self.args.profile:
            profile = self.profile()
            return TrainOutput(self.session.step, float("nan"), {"profile": profile})
        session = self._session()
        cadence = self.cadence
        self.state.global_step = first_step = session.step
        steps_per_epoch = self._train_plan().steps_per_epoch
        self.state.num_train_epochs = -(-session.steps // steps_per_epoch)
        losses: list[float] = []
        started = time.perf_counter()
        self.control = self.callback_handler.on_train_begin(self.args, self.state, self.control)
        if cadence.eval_on_start and first_step == 0:
            self._evaluate_and_keep_best(session)

        def before(step: int) -> None:
            self.control = self.callback_handler.on_step_begin(self.args, self.state, self.control)

        def after(step: int, result, record) -> bool:
            self.state.global_step = step
            self.state.epoch = step / steps_per_epoch
            losses.append(result.loss)
            self.control = self.callback_handler.on_step_end(self.args, self.state, self.control)
            if cadence.logs_at(step):
                self.log({"loss": result.loss, "grad_norm": result.grad_norm, "learning_rate": result.learning_rate,
                          **record.measured()})
            if cadence.evaluates_at(step):
                self._evaluate_and_keep_best(session)
            # Callbacks may decide differently on different ranks: rank 0's decision holds.
            wants = groups.broadcast_object([self.control.should_training_stop, self.control.should_save])
            if wants[1] and self.settings.trainer.checkpoint.save:
                session.save()  # a callback asked for a checkpoint (a step is never saved twice)
            self.control.should_save = False
            return bool(wants[0])

        with self._run_directory_locked():
            self.summary = session.train(on_step=after, before_step=before)
        if self.args.do_eval and self.eval_data is not None and self._evaluated_at != session.step:
            self._evaluate_and_keep_best(session)
        if cadence.load_best and self.state.best_model_checkpoint:
            from merak.checkpoint.load import load_weights

            load_weights(session.engine, self.state.best_model_checkpoint)
            if self.is_world_process_zero():
                logger.info("loaded the best model (%s %.4g) from %s", cadence.best_metric,
                            self.state.best_metric, self.state.best_model_checkpoint)
        if self.args.lora_config:
            from merak.hf.lora import save_adapter

            save_adapter(self, os.path.join(self.settings.output_dir, "adapter"))
        if self.args.text_generation and self.eval_data is not None:
            self._generate_from_eval_prompts()
        if self.energy is not None:
            self.energy.close()  # the clocks go back to the driver
        metrics = self._train_metrics(losses, session.step - first_step, time.perf_counter() - started)
        self.log(metrics)
        self.control = self.callback_handler.on_train_end(self.args, self.state, self.control)
        if self.summary is not None:
            logger.info("\n%s", format_summary(self.summary))
        return TrainOutput(session.step, metrics["train_loss"], metrics)

    def _train_metrics(self, losses: list[float], steps: int, runtime: float) -> dict:
        """Hugging Face's end-of-training metrics, rank 0's numbers on every rank (collective)."""
        samples = steps * self.settings.global_batch_size
        flops = (self.summary or {}).get("flops") or {}
        metrics = {"train_runtime": round(runtime, 4),
                   "train_samples_per_second": round(samples / runtime, 3) if runtime else 0.0,
                   "train_steps_per_second": round(steps / runtime, 3) if runtime else 0.0,
                   "total_flos": float(flops.get("model_flops_per_step") or 0.0) * steps,
                   "train_loss": sum(losses) / len(losses) if losses else float("nan"),
                   "epoch": self.state.epoch}
        return groups.broadcast_object(metrics)

    def _evaluate_and_keep_best(self, session: TrainingSession) -> dict:
        """Evaluate; with ``save_strategy='best'`` or ``load_best_model_at_end``, checkpoint a new best."""
        metrics = self.evaluate()
        cadence: Cadence = self.cadence
        if not (cadence.save_best or cadence.load_best):
            return metrics
        if cadence.best_metric not in metrics:
            raise ConfigError(f"metric_for_best_model={self.args.metric_for_best_model!r}: the evaluation "
                              f"gives {', '.join(sorted(metrics))}")
        value = float(metrics[cadence.best_metric])
        if cadence.is_better(value, self.state.best_metric):  # the same numbers on every rank
            session.protected.discard(self.state.best_model_checkpoint)  # no longer the best: rotation may go on
            path = session.save()
            session.protected.add(path)
            self.state.best_metric, self.state.best_model_checkpoint = value, path
        return metrics

    @contextlib.contextmanager
    def _run_directory_locked(self) -> Iterator[None]:
        """Rank 0 holds the output directory's lock while training; every rank learns if it is busy
        (so none starts a collective the others never join)."""
        lock, problem = None, None
        if self.is_world_process_zero():
            try:
                lock = RunDirectoryLock(self.settings.output_dir).acquire()
            except RunDirectoryBusy as busy:
                problem = str(busy)
        problem = groups.broadcast_object(problem)
        if problem is not None:
            raise RunDirectoryBusy(problem)
        try:
            yield
        finally:
            if lock is not None:
                lock.release()

    def log(self, logs: dict) -> None:
        """Record ``logs`` in the state's history and hand them to the callbacks (TensorBoard...)."""
        if self.state.epoch is not None:
            logs = {**logs, "epoch": self.state.epoch}
        entry = {**logs, "step": self.state.global_step}
        self.state.log_history.append(entry)
        self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs)

    # -- evaluation and prediction ---------------------------------------------

    def _eval_micro_batch(self) -> int:
        size = self.args.per_device_eval_batch_size
        plan = self._session().plan
        if plan is not None and plan.trace_method == "export" and size != self.args.per_device_train_batch_size:
            raise ConfigError(
                f"per_device_eval_batch_size={size} but the model was captured with torch.export, whose graphs "
                f"are specialized to the training microbatch ({self.args.per_device_train_batch_size} samples): "
                f"make them equal")
        return size

    def evaluate(self, eval_dataset=None, eval_iters: int | None = None, metric_key_prefix: str = "eval") -> dict:
        """Mean loss over the evaluation set, sharded across dp replicas (every rank returns it).

        ``eval_iters`` (default ``args.eval_iters``; None: the whole set) limits the evaluation steps;
        each step is ``gradient_accumulation_steps`` microbatches of ``per_device_eval_batch_size``
        on each replica. Samples after the last whole step are not evaluated.
        """
        dataset = eval_dataset if eval_dataset is not None else self.eval_data
        if dataset is None:
            raise ValueError("evaluate() needs eval_data (or an eval_dataset argument)")
        session = self._session()
        metrics, _ = session.evaluate(Samples(dataset), micro_batch_size=self._eval_micro_batch(),
                                      eval_iters=eval_iters if eval_iters is not None else self.args.eval_iters)
        metrics = {f"{metric_key_prefix}_{k.removeprefix('eval_')}": v for k, v in metrics.items()}
        self._evaluated_at = session.step
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        if session.metrics is not None:
            session.metrics.log_event({"step": self.state.global_step, **metrics})
        return metrics

    def predict(self, test_dataset, metric_key_prefix: str = "test") -> PredictionOutput:
        """Logits and labels for every sample of whole evaluation steps, in dataset order, on every
        rank; with ``args.text_generation`` the generated token ids instead (see :meth:`generate`)."""
        if self.args.text_generation:
            samples = Samples(test_dataset)
            prompts = [samples[i]["input_ids"].tolist() for i in range(len(samples))]
            generated = self.generate(prompts)
            width = max(len(g) for g in generated)
            padded = np.full((len(generated), width), -100, dtype=np.int64)
            for row, tokens in enumerate(generated):
                padded[row, :len(tokens)] = tokens
            return PredictionOutput(predictions=padded, label_ids=None, metrics={})
        session = self._session()
        metrics, kept = session.evaluate(Samples(test_dataset), micro_batch_size=self._eval_micro_batch(),
                                         keep_outputs=True)
        predictions, labels = gather_predictions(session, kept, label_name=self._label_name(),
                                                 parallel_vocab=self.settings.trainer.tensor_parallel.parallel_vocab)
        metrics = {f"{metric_key_prefix}_{k.removeprefix('eval_')}": v for k, v in metrics.items()}
        if self.args.prediction_loss_only:
            return PredictionOutput(predictions=None, label_ids=None, metrics=metrics)
        compute = getattr(self, "compute_metrics", None)
        if compute is not None and labels is not None:
            metrics.update({f"{metric_key_prefix}_{k}": v
                            for k, v in compute(EvalPrediction(predictions=predictions, label_ids=labels)).items()})
        return PredictionOutput(predictions=predictions, label_ids=labels, metrics=metrics)

    def _label_name(self) -> str:
        return (self.args.label_names or ["labels"])[0]
