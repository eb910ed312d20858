"""The training engine of one worker: its stage, optimizer, executor and step.

It takes the config sections it consumes (optimizer, precision, ZeRO, compile, the schedule's
recomputation: their defaults are the config's) and plain values for the rest, so recipes, the
trainer API and tests drive the same code.
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from merak.checkpoint.identity import model_info
from merak.core.slices import sequence_partial, sliced_parameter_ids, tensor_slices
from merak.distributed.groups import ParallelState, stage_set_group
from merak.distributed.p2p import PointToPoint
from merak.optim.distributed import DistributedOptimizer
from merak.optim.grad_sync import all_reduce_tensors
from merak.optim.overlap import last_weight_passes
from merak.optim.schedule import build_lr_scheduler, make_optimizer
from merak.optim.settings import ZERO3_WITH_COMPILE, OptimizerSettings, PrecisionSettings, ZeroSettings
from merak.optim.sharded_params import ShardedParameters, stage_units
from merak.pipeline import instructions as ins
from merak.pipeline.compiled import CompileClock
from merak.pipeline.executor import PipelineExecutor
from merak.pipeline.hooks import HookList, InstructionEvent, PipelineHook
from merak.pipeline.recompute import (
    StageRecomputation,
    checkpointed_parts,
    part_seed,
    stage_checkpoint_ratios,
)
from merak.pipeline.schedules import (
    build_forward_only_schedule,
    build_schedule,
    schedule_info,
)
from merak.pipeline.settings import SELECTIVE_WITH_COMPILE, CompileSettings, ScheduleSettings
from merak.pipeline.stage import (
    TiedParameter,
    find_tied_parameters,
    parameter_aliases,
    parameter_names,
    persistent_buffer_names,
)

logger = logging.getLogger(__name__)

# The start of the warning torch's LR schedulers give when the optimizer did not step before them.
LR_SCHEDULER_BEFORE_OPTIMIZER = "Detected call of `lr_scheduler.step()` before `optimizer.step()`"


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step reports; identical on every rank."""

    loss: float
    grad_norm: float
    learning_rate: float
    skipped: bool = False
    loss_scale: float = 1.0
    # A skipped fp16 step that a smaller loss scale may avoid next time (see StepOutcome).
    scale_may_cure: bool = False


class PipelineEngine:
    """Trains this rank's pipeline stage.

    Args:
        model: the full single-device model the stages were cut from (only used to
            name parameters and find tied weights; stages hold its modules).
        stages: one module per pipeline stage (see merak.pipeline.stage).
        loss_fn: ``loss_fn(last_stage_output, microbatch) -> mean loss of the microbatch``.
        state: this rank's parallel state from ``merak.init``.
        schedule: pipeline schedule name.
        num_microbatches: microbatches per optimizer step.
        total_steps: steps of the run (for the learning-rate schedule).
        optimizer: the optimizer section (its warmup_ratio is resolved against ``total_steps``).
        hooks: pipeline listeners (timers, profiler, energy plans).
        bucket_bytes: size of the all-reduce buckets (data-parallel without ZeRO, overlapped ones, tied
            weights, sequence-parallel replicas; None: ``zero.grad_bucket_mb``); ZeRO-2's buckets follow
            ``zero``.
        recompute: the schedule section whose activation-checkpointing fields apply (None: no
            recomputation).
        num_chunks: model chunks per rank (interleaved schedules); ``stages`` then holds
            ``pp * num_chunks`` pieces and rank ``s`` runs pieces ``s, s + pp, ...``.
        dropout_seed: when set, dropout masks are drawn from seeds of (this seed, dp rank,
            step, microbatch, part), identical in every layout and in recomputation.
        dealloc_pipeoutput: release sent activations (keeping what backward reads).
        record_timeline: record every instruction's start and end (``wall_clock_breakdown``).
        zero: the ZeRO section: stage, buckets and gradient pre/post scaling.
        precision: the precision section: fp16/bf16 and loss scaling.
        measure_activations: count every tensor saved for backward to report the exact peak of saved
            activations (a Python hook per saved tensor: for diagnosis, not for speed). On CUDA the
            allocator's own peak is reported either way.
        channels_last: keep 4-D weights channels-last (convolutional models on a GPU). Not with
            fp32 ZeRO, whose optimizer updates flat views of the parameters.
        compile: the compile section: every stage's parts through ``torch.compile`` (merak.pipeline.compiled).
    """

    def __init__(self, *, model: nn.Module, stages: Sequence[nn.Module],
                 loss_fn: Callable[[object, Mapping[str, torch.Tensor]], torch.Tensor],
                 state: ParallelState, schedule: str, num_microbatches: int, total_steps: int,
                 optimizer: OptimizerSettings = OptimizerSettings(), hooks: Sequence[PipelineHook] = (),
                 bucket_bytes: int | None = None, recompute: ScheduleSettings | None = None,
                 num_chunks: int = 1, dropout_seed: int | None = None, dealloc_pipeoutput: bool = False,
                 record_timeline: bool = False, zero: ZeroSettings = ZeroSettings(),
                 precision: PrecisionSettings = PrecisionSettings(), measure_activations: bool = False,
                 channels_last: bool = False, compile: CompileSettings = CompileSettings()) -> None:
        grid, coords = state.grid, state.coordinates
        if len(stages) != grid.pp * num_chunks:
            raise ValueError(f"got {len(stages)} stages for pp={grid.pp} x {num_chunks} chunks")
        self.state = state
        self.stage_id = coords.pp
        self.num_stages = grid.pp
        self.num_chunks = num_chunks
        self.chunks = {c: stages[c * grid.pp + self.stage_id].to(state.device) for c in range(num_chunks)}
        # fp32 ZeRO updates flat views of the parameters, and ZeRO-3 gathers flat pieces into them.
        flat_views = zero.stage >= 1 and grid.dp > 1 and (precision.dtype == torch.float32 or zero.stage >= 3)
        self.channels_last = channels_last and not flat_views
        if self.channels_last:
            for chunk in self.chunks.values():
                chunk.to(memory_format=torch.channels_last)
        self.stage = self.chunks[0]
        self.options = optimizer
        bucket_bytes = bucket_bytes if bucket_bytes is not None else zero.bucket_bytes
        self.bucket_bytes = bucket_bytes
        names = parameter_names(model)
        local = {id(p): p for chunk in self.chunks.values() for p in chunk.parameters()}
        self._param_names = [(names[key], p) for key, p in local.items()]
        all_tied = self._tied_across_ranks(find_tied_parameters(model, stages))
        # Every rank creates every tie's group, in the same order (group creation is collective).
        self._tied_groups = {t.stages: stage_set_group(state, t.stages) for t in all_tied}
        self.tied = [t for t in all_tied if self.stage_id in t.stages]
        by_name = dict(self._param_names)
        self.tied_params = [by_name[t.name] for t in self.tied]
        # Each parameter counts once in the global norm: tied copies only on their first owner,
        # parameters replicated over the tensor-parallel group only on its first rank.
        secondary = {t.name for t in self.tied if t.stages[0] != self.stage_id}
        sliced = sliced_parameter_ids(model)
        norm_ids = {id(p) for n, p in self._param_names if n not in secondary and (coords.tp == 0 or id(p) in sliced)}
        # Checkpoints name tensors by the full model: its slices, aliases and persistent buffers.
        self.slices = tensor_slices(model)
        self.aliases = parameter_aliases(model)
        buffer_names = persistent_buffer_names(model)
        self._buffer_names = list({id(b): (buffer_names[id(b)], b) for chunk in self.chunks.values()
                                   for b in chunk.buffers() if id(b) in buffer_names}.values())
        # The holder that writes each tensor: tied copies on their first stage, replicas on tp rank 0.
        self.primary_names = {n for n, p in self._param_names if id(p) in norm_ids} | {
            n for n, _ in self._buffer_names if coords.tp == 0 or n in self.slices}
        self.model_info = model_info(model)
        # With sequence parallelism, replicated parameters between the blocks saw only this
        # rank's part of the sequence: their gradients are summed over the tp group.
        self.sequence_partial = [p for _, p in self._param_names if p.requires_grad and sequence_partial(p)]
        self.trainable = [p for _, p in self._param_names if p.requires_grad]
        self.trainable_names = [n for n, p in self._param_names if p.requires_grad]
        self._synchronize_initial_weights()
        self.optimizer = DistributedOptimizer(
            self.trainable, dp_group=state.dp_group, dp_size=grid.dp, dp_rank=coords.dp,
            norm_group=state.model_parallel_group, norm_group_size=grid.pp * grid.tp,
            counted=[id(p) in norm_ids for p in self.trainable], zero=zero, precision=precision,
            bucket_bytes=bucket_bytes,
            make_optimizer=lambda pairs: make_optimizer(pairs, optimizer))
        if precision.dtype != torch.float32:
            # Stages assembled with the dtype are cast already; hand-made ones are cast here, after
            # the master weights were taken from their fp32 values.
            for chunk in self.chunks.values():
                chunk.to(precision.dtype)
        self.sharded_parameters = self._shard_parameters(compile)
        self._overlap_reduction()
        self._total_steps = total_steps
        self.lr_scheduler = self._build_lr_scheduler()
        self.instructions = build_schedule(name=schedule, stage_id=self.stage_id, num_stages=self.num_stages,
                                           num_microbatches=num_microbatches, num_chunks=num_chunks)
        self.num_microbatches = num_microbatches
        self._configure_checkpointing(recompute, schedule_info(schedule).last_stage_checkpoints)
        self.compile_options = compile
        self.compile_clock = CompileClock()
        self._compile_stages(compile)
        wraps = num_chunks > 1  # the chain runs around the ranks: the last rank's next is the first
        prev_rank = grid.stage_rank(state.rank, (self.stage_id - 1) % grid.pp) \
            if self.stage_id > 0 or wraps else None
        next_rank = grid.stage_rank(state.rank, (self.stage_id + 1) % grid.pp) \
            if self.stage_id < grid.pp - 1 or wraps else None
        dp_rank = coords.dp
        seed_of = (lambda step, microbatch: part_seed(dropout_seed, dp_rank, step, microbatch)) \
            if dropout_seed is not None else None
        self.executor = PipelineExecutor(
            stages=self.chunks, stage_id=self.stage_id, num_stages=self.num_stages, num_chunks=num_chunks,
            prev_rank=prev_rank, next_rank=next_rank,
            p2p=PointToPoint(state.device) if grid.pp > 1 else None, loss_fn=loss_fn,
            step_handlers={ins.ReduceTiedGrads: self._reduce_tied_grads,
                           ins.ReduceGrads: self._reduce_grads,
                           ins.OptimizerStep: self._optimizer_step},
            hooks=[*hooks, _GradientsReady(self.optimizer, last_weight_passes(self.instructions, num_chunks)),
                   *([self.sharded_parameters] if self.sharded_parameters is not None else [])],
            dropout_seed=seed_of,
            free_sent_outputs=dealloc_pipeoutput, record_timeline=record_timeline,
            compute_dtype=precision.dtype, loss_scale=lambda: self.optimizer.loss_scale,
            measure_activations=measure_activations)
        self._last_outcome = None
        self._eval_instructions = None

    def _build_lr_scheduler(self):
        options = self.options
        return build_lr_scheduler(self.optimizer.optimizer, options, total_steps=self._total_steps)

    def resume_at(self, step: int, *, lr_scheduler_steps: int) -> None:
        """Continue at optimizer step ``step`` (dropout seeds follow it) with the learning-rate
        schedule ``lr_scheduler_steps`` steps in (fewer than ``step`` when fp16 skipped some)."""
        self.executor.step_index = step
        for group in self.optimizer.optimizer.param_groups:
            group["lr"] = group["initial_lr"]
        self.lr_scheduler = self._build_lr_scheduler()
        with warnings.catch_warnings():
            # Replaying the schedule steps no optimizer step: torch would warn that the order is wrong.
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
            for _ in range(lr_scheduler_steps):
                self.lr_scheduler.step()

    def _shard_parameters(self, compile: CompileSettings) -> ShardedParameters | None:
        """ZeRO-3: keep only this rank's pieces of the trainable parameters; each stage part gathers its own
        where it runs (merak.optim.sharded_params)."""
        if not self.optimizer.shards_parameters:
            return None
        if compile.enabled:
            raise ValueError(ZERO3_WITH_COMPILE)
        index_of = {id(p): i for i, p in enumerate(self.trainable)}
        return ShardedParameters(self.trainable, self.optimizer.shards, stage_units(self.chunks, index_of),
                                 dp_group=self.state.dp_group, dp_size=self.state.grid.dp)

    def whole_parameters(self, *, write_back: bool = False) -> contextlib.AbstractContextManager:
        """Every local parameter whole inside the block, for code outside the schedule that reads (or, with
        ``write_back``, writes) them: checkpoints, generation. With ZeRO-3 it all-gathers over data parallelism,
        so every replica must enter it; otherwise it does nothing."""
        if self.sharded_parameters is None:
            return contextlib.nullcontext()
        return self.sharded_parameters.whole(write_back=write_back, piece_range=self.optimizer.piece_range)

    def _overlap_reduction(self) -> None:
        """Let the optimizer reduce each chunk's gradients during its last backward (merak.optim.overlap).
        Tied copies and sequence-parallel replicas are summed over their groups at the step's end first, and
        a parameter two chunks share is final only after both: those are reduced at the end as before."""
        chunks_of: dict[int, set[int]] = {}
        for c, chunk in self.chunks.items():
            for param in chunk.parameters():
                chunks_of.setdefault(id(param), set()).add(c)
        summed_first = {id(p) for p in [*self.tied_params, *self.sequence_partial]}
        excluded = {i for i, p in enumerate(self.trainable) if id(p) in summed_first or len(chunks_of[id(p)]) > 1}
        self.optimizer.overlap_reduction([min(chunks_of[id(p)]) for p in self.trainable], excluded)

    def reduction_timeline(self) -> list[dict]:
        """The last step's overlapped data-parallel reductions: per bucket its stage, rank, chunk, bytes, and
        the (``time.perf_counter``) times it started and was waited for (empty without overlap)."""
        overlap = self.optimizer.overlap
        if overlap is None:
            return []
        return [{"stage": self.stage_id, "rank": self.state.rank, "bucket": r.bucket.index, "chunk": r.bucket.chunk,
                 "bytes": r.bucket.nbytes, "start": r.started, "end": r.finished or r.started}
                for r in overlap.last_step]

    def _tied_across_ranks(self, tied: Sequence[TiedParameter]) -> list[TiedParameter]:
        """Ties between pieces, as ties between ranks (pieces on one rank share the object)."""
        ranks = [TiedParameter(name=t.name, stages=tuple(sorted({v % self.num_stages for v in t.stages})))
                 for t in tied]
        return [t for t in ranks if len(t.stages) > 1]

    def _configure_checkpointing(self, options: ScheduleSettings | None, last_stage_checkpoints: bool) -> None:
        """Give each local chunk its share of checkpointed parts (stage-aware ratios) and, with selective
        recomputation, what those parts save."""
        self._selective_mode = options.selective_mode if options is not None else None
        if options is None or not options.activation_checkpointing:
            for module in self.chunks.values():
                if hasattr(module, "configure_checkpointing"):
                    module.configure_checkpointing(StageRecomputation())
            return
        pieces = self.num_stages * self.num_chunks
        ratios = stage_checkpoint_ratios(options.activation_checkpoint_ratio, pieces,
                                         last_stage_checkpoints=last_stage_checkpoints)
        for chunk, module in self.chunks.items():
            if not hasattr(module, "configure_checkpointing"):
                raise ValueError(f"activation checkpointing needs stages made of parts (StageModule); "
                                 f"stage {self.stage_id} is a {type(module).__name__}")
            ratio = ratios[chunk * self.num_stages + self.stage_id]
            module.configure_checkpointing(StageRecomputation(
                parts=checkpointed_parts(ratio, len(module.parts)), num_layers=options.checkpoint_num_layers,
                saves=options.selective_mode))

    def _compile_stages(self, options: CompileSettings) -> None:
        """Hand each local chunk's parts to torch.compile (after the move and the cast: compiled graphs
        are specialised to their tensors' device and dtype)."""
        contradictions = options.contradictions()
        if contradictions:
            raise ValueError("; ".join(contradictions))
        if options.enabled and self._selective_mode is not None:
            raise ValueError(SELECTIVE_WITH_COMPILE)
        if options.uses_cuda_graphs and self.state.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; this stage runs on {self.state.device}")
        splits_backward = any(isinstance(i, ins.BackwardInput) for i in self.instructions)
        for chunk, module in self.chunks.items():
            if hasattr(module, "compile_parts"):
                module.compile_parts(options, where=f"stage {chunk * self.num_stages + self.stage_id}",
                                     retains_graph=splits_backward)
            elif options.enabled:
                logger.warning("stage %d is a %s, not a StageModule: it runs eagerly", self.stage_id,
                               type(module).__name__)

    def compile_report(self) -> dict:
        """Whether stages were compiled, the seconds this engine's process spent compiling them, and
        the ranges of parts that fell back to eager execution."""
        options = self.compile_options
        eager = {}
        for chunk, module in self.chunks.items():
            compiled = getattr(module, "compiled", None)
            if compiled is not None and compiled.eager_ranges:
                eager[f"stage {chunk * self.num_stages + self.stage_id}"] = [list(r) for r in compiled.eager_ranges]
        return {"enabled": options.enabled, "backend": options.backend if options.enabled else None,
                "mode": options.effective_mode, "cuda_graphs": options.uses_cuda_graphs,
                "compile_s": self.compile_clock.seconds() if options.enabled else 0.0, "eager_ranges": eager}

    # -- set-up ------------------------------------------------------------------

    def _synchronize_initial_weights(self) -> None:
        """Start every replica and every tied copy from identical values."""
        state = self.state
        with torch.no_grad():
            if state.grid.dp > 1:
                src = state.grid.rank_of(pp=state.coordinates.pp, dp=0, tp=state.coordinates.tp)
                for _, param in self._param_names:
                    dist.broadcast(param.data, src=src, group=state.dp_group)
            for tied, param in zip(self.tied, self.tied_params):
                src = state.grid.stage_rank(state.rank, tied.stages[0])
                dist.broadcast(param.data, src=src, group=self._tied_groups[tied.stages])

    # -- step --------------------------------------------------------------------

    def train_step(self, microbatches: Sequence[Mapping[str, torch.Tensor]] | None) -> StepResult:
        """Run one optimizer step over ``num_microbatches`` microbatches.

        Args:
            microbatches: this rank's microbatches on the first and last stage; None elsewhere.
        """
        for chunk in self.chunks.values():
            if not chunk.training:  # train() walks every submodule: only when something switched it off
                chunk.train()
        if self.compile_options.uses_cuda_graphs:
            # A new step: outputs of the last step's graph replays may be overwritten now.
            torch.compiler.cudagraph_mark_step_begin()
        self.optimizer.zero_grad()
        learning_rate = self.optimizer.optimizer.param_groups[0]["lr"]
        local_loss = self.executor.run(self.instructions, microbatches)
        outcome = self._last_outcome
        return StepResult(loss=self._global_loss(local_loss), grad_norm=outcome.grad_norm,
                          learning_rate=learning_rate, skipped=outcome.skipped, loss_scale=outcome.loss_scale,
                          scale_may_cure=outcome.scale_may_cure)

    def evaluate_step(self, microbatches: Sequence[Mapping[str, torch.Tensor]] | None, *,
                      keep_outputs: bool = False) -> tuple[float, dict[int, object]]:
        """Forward ``num_microbatches`` microbatches without gradients, in eval mode.

        Returns:
            The mean loss of this step over the dp replicas (on every rank), and on the last
            stage the outputs by microbatch when ``keep_outputs`` (an empty dict elsewhere).
            Training continues exactly as without this call (dropout seeds follow training steps), and
            the engine's listeners do not see the evaluation step.
        """
        if self.num_chunks > 1:
            raise NotImplementedError("evaluation with interleaved schedules (pipeline_chunks > 1) is not supported")
        if self._eval_instructions is None:
            self._eval_instructions = build_forward_only_schedule(
                stage_id=self.stage_id, num_stages=self.num_stages, num_microbatches=self.num_microbatches)
        step_index, listeners, timeline = self.executor.step_index, self.executor.hooks, self.executor.timeline
        # The listeners (timers, energy meters, frequency plans) follow training steps: a forward-only
        # evaluation step is none of theirs (a frequency plan would not find its instructions in it). Nor is
        # the recorded timeline (wall_clock_breakdown) theirs: it keeps the last training step, whose
        # backwards the end-of-run pictures price the training schedule with.
        # ZeRO-3's gathering is no listener: it frees what each instruction gathered.
        self.executor.hooks = HookList([self.sharded_parameters] if self.sharded_parameters is not None else [])
        for chunk in self.chunks.values():
            chunk.eval()
        try:
            with torch.no_grad():
                local_loss = self.executor.run(self._eval_instructions, microbatches, keep_outputs=keep_outputs)
        finally:
            self.executor.step_index, self.executor.hooks, self.executor.timeline = step_index, listeners, timeline
            for chunk in self.chunks.values():
                chunk.train()
        return self._global_loss(local_loss), self.executor.outputs

    def model_flops_per_step(self) -> float | None:
        """Model FLOPs of one optimizer step over every rank: 3 x the measured forward FLOPs (backward
        = 2 x forward; recomputation not counted, as MFU defines it). None before the first step."""
        flops = self.executor.forward_flops or 0
        total = torch.tensor([float(flops) if self.state.coordinates.dp == 0 else 0.0], dtype=torch.float64)
        if self.state.grid.world_size > 1:  # collective: every rank calls this
            dist.all_reduce(total)
        return 3.0 * float(total) * self.num_microbatches * self.state.grid.dp or None

    def _global_loss(self, local_loss: float | None) -> float:
        """Mean loss over the global batch, known to every rank."""
        if self.state.grid.world_size == 1:
            return float(local_loss)
        # One contribution per data-parallel replica: the last stage's first tensor-parallel rank.
        counts = local_loss is not None and self.state.coordinates.tp == 0
        value = torch.tensor([local_loss if counts else 0.0], dtype=torch.float64)
        dist.all_reduce(value)
        return float(value) / self.state.grid.dp

    def _reduce_tied_grads(self) -> None:
        by_stages: dict[tuple[int, ...], list[nn.Parameter]] = {}
        for tied, param in zip(self.tied, self.tied_params):
            by_stages.setdefault(tied.stages, []).append(param)
        for stages, params in by_stages.items():  # same order on every rank: self.tied is sorted by name
            all_reduce_tensors(self.optimizer.gradients(params), group=self._tied_groups[stages],
                               bucket_bytes=self.bucket_bytes)

    def _reduce_grads(self) -> None:
        if self.sequence_partial and self.state.grid.tp > 1:
            all_reduce_tensors(self.optimizer.gradients(self.sequence_partial), group=self.state.tp_group,
                               bucket_bytes=self.bucket_bytes)
        self.optimizer.reduce_gradients()

    def _optimizer_step(self) -> None:
        if self.sharded_parameters is not None:
            self.sharded_parameters.check_freed()
        self._last_outcome = self.optimizer.step(max_grad_norm=self.options.max_grad_norm,
                                                 loss=self.executor.step_loss())
        if self._last_outcome.skipped:  # a skipped step leaves the schedule where it was
            return
        if self.optimizer.owns_parameters:
            self.lr_scheduler.step()
            return
        # A rank owning no parameters (a pipeline stage left empty) steps no optimizer; its schedule still
        # advances with everyone's, without torch's warning that the optimizer did not step.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=re.escape(LR_SCHEDULER_BEFORE_OPTIMIZER))
            self.lr_scheduler.step()

    # -- introspection -----------------------------------------------------------

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This stage's parameters under the full model's names."""
        return list(self._param_names)

    def named_buffers(self) -> list[tuple[str, torch.Tensor]]:
        """This stage's persistent buffers under the full model's names."""
        return list(self._buffer_names)

    def gradient_pieces(self) -> dict[str, tuple[int, int, torch.Tensor | None]]:
        """Trainable parameter name -> (start, stop, gradient): the flat range of the (tensor-parallel
        local) parameter this rank updated in the last step, and the gradient it applied there."""
        names = [n for n, p in self._param_names if p.requires_grad]
        return dict(zip(names, self.optimizer.gradient_pieces(), strict=True))

    def memory_report(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state held by this rank; the peak of saved
        activations when they were measured, and on CUDA the allocator's peak."""
        def nbytes(tensors):
            return sum(t.numel() * t.element_size() for t in tensors)
        params = [p for _, p in self._param_names]
        report = {"parameter_bytes": nbytes(params), **self.optimizer.memory_report()}
        if self.sharded_parameters is not None:  # ZeRO-3: the pieces, and the peak of whole parameters
            sharded = {id(p) for p in self.trainable}
            report["parameter_bytes"] = nbytes([p for p in params if id(p) not in sharded]) + \
                self.sharded_parameters.shard_bytes()
            report["peak_gathered_parameter_bytes"] = self.sharded_parameters.peak_gathered_bytes
        if self.executor.meter.peak_bytes is not None:
            report["peak_activation_bytes"] = self.executor.meter.peak_bytes
        if self.state.device.type == "cuda":
            report["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(self.state.device)
        return report


class _GradientsReady(PipelineHook):
    """Data-parallel reductions during the backward: with overlap (merak.optim.overlap), arm each chunk for its
    last weight-gradient pass and start what is left of it after; with ZeRO-2, reduce-scatter the gradients
    each backward instruction produced, right after it."""

    _BACKWARDS = ("backward", "backward_input", "backward_weight")

    def __init__(self, optimizer: DistributedOptimizer, last_passes: dict[int, object]) -> None:
        self.optimizer, self.last_passes = optimizer, last_passes

    def _last_pass(self, event: InstructionEvent) -> bool:
        return self.optimizer.overlap is not None and self.last_passes.get(event.chunk) == event.instruction

    def on_instruction_begin(self, event: InstructionEvent) -> None:
        if self._last_pass(event):
            self.optimizer.overlap.arm(event.chunk)

    def on_instruction_end(self, event: InstructionEvent) -> None:
        if event.name in self._BACKWARDS:
            self.optimizer.reduce_ready_gradients()
        if self._last_pass(event):
            self.optimizer.overlap.flush(event.chunk)
