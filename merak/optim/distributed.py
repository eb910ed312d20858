"""The optimizer of one rank: data-parallel gradient reduction, ZeRO sharding, fp32 master weights.

Every parameter is cut into ``dp`` equal flat pieces (the last padded); data-parallel
rank ``r`` owns piece ``r`` of every parameter. Cutting each parameter on its own
(rather than one flat buffer) keeps the pieces of a tied weight aligned on every
stage that holds it, and lets a checkpoint name each piece by parameter.

- ZeRO stage 0: gradients are all-reduced; every rank updates whole parameters.
- ZeRO stage 1: optimizer state (and fp32 master weights) only for the owned piece;
  gradients reduce-scattered once per step; updated pieces all-gathered.
- ZeRO stage 2: as 1, and gradients are reduce-scattered during the backward as
  soon as ``reduce_bucket_size`` elements are ready (and at the end of every backward
  instruction), so at most about one bucket of full-size gradients is held.
- ZeRO stage 3: as 2, and the model's parameters too are held as the owned pieces
  (``shards``, in the model's dtype); :mod:`merak.optim.sharded_params` gathers them
  where they are used. The step updates the pieces; nothing is all-gathered after it.

With fp16/bf16 the model holds half-precision parameters and gradients, and the
optimizer updates fp32 master weights (whole or the owned piece). Gradients are
reduced in fp32. With fp32 and no sharding the optimizer updates the model
parameters themselves.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from merak.distributed import collectives
from merak.optim.clip import global_grad_norm
from merak.optim.grad_sync import DEFAULT_BUCKET_BYTES, all_reduce_tensors, ensure_grads
from merak.optim.overlap import OverlappedReduction
from merak.optim.precision import LossScaler
from merak.optim.settings import ZERO_STAGES, PrecisionSettings, ZeroSettings


@dataclass(frozen=True)
class StepOutcome:
    """What the optimizer step did; identical on every rank.

    Attributes:
        grad_norm: the global gradient norm (unscaled; not finite when a gradient was not).
        skipped: no update: the loss or a gradient was not finite on some rank.
        loss_scale: the fp16 loss scale the step ran with.
        loss_finite: every rank's loss was finite.
        scale_may_cure: the step was skipped for an fp16 gradient overflow that a smaller loss
            scale may avoid (the loss was finite and the dynamic scale can still shrink).
    """

    grad_norm: float
    skipped: bool
    loss_scale: float
    loss_finite: bool = True
    scale_may_cure: bool = False


@dataclass(frozen=True)
class Piece:
    """The owned part ``[start, stop)`` of a parameter flattened, cut in ``parts`` pieces of ``size``."""

    numel: int
    size: int
    start: int
    stop: int

    @classmethod
    def of(cls, numel: int, parts: int, index: int) -> Piece:
        size = math.ceil(numel / parts) if numel else 0
        start = min(index * size, numel)
        return cls(numel=numel, size=size, start=start, stop=min(start + size, numel))

    @property
    def length(self) -> int:
        return self.stop - self.start


class DistributedOptimizer:
    """Reduces, unscales, clips and applies the gradients of this rank's parameters.

    Args:
        params: the trainable parameters of this rank, the same order on every
            data-parallel replica.
        dp_group / dp_size / dp_rank: the data-parallel group and this rank in it.
        norm_group / norm_group_size: the ranks over which the global gradient norm
            is summed besides the data-parallel ones (the model-parallel group).
        counted: per parameter, whether it counts in the global norm (a tied copy or a
            tensor-parallel replica counts on one rank only).
        make_optimizer: builds the torch optimizer from ``(tensor, decays)`` pairs.
        zero, precision: the settings.
        bucket_bytes: bucket size of the all-reduces without ZeRO (ZeRO's are ``zero``'s, in elements).
    """

    def __init__(self, params: Sequence[nn.Parameter], *, dp_group, dp_size: int, dp_rank: int,
                 norm_group, norm_group_size: int, counted: Sequence[bool],
                 make_optimizer: Callable[[list[tuple[torch.Tensor, bool]]], torch.optim.Optimizer],
                 zero: ZeroSettings = ZeroSettings(), precision: PrecisionSettings = PrecisionSettings(),
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        if zero.stage not in ZERO_STAGES:
            raise ValueError(f"zero_stage={zero.stage}; choose one of {ZERO_STAGES}")
        self.params = list(params)
        self.zero = zero
        self.precision = precision
        self.dp_group, self.dp_size, self.dp_rank = dp_group, dp_size, dp_rank
        self.bucket_bytes = bucket_bytes
        self.sharded = zero.stage >= 1 and dp_size > 1
        self.pieces = [Piece.of(p.numel(), dp_size if self.sharded else 1, dp_rank if self.sharded else 0)
                       for p in self.params]
        self.counted = list(counted)
        self.scaler = LossScaler(precision)
        # The norm sums over every rank: with ZeRO each replica holds different pieces; without,
        # replicas hold equal gradients (replica 0 counts them) but their losses differ, and every
        # rank must agree on skipping a step whose loss is not finite.
        self.norm_group = dist.group.WORLD if dp_size > 1 else norm_group
        self.norm_group_size = norm_group_size * dp_size
        self.counts_replica = self.sharded or dp_rank == 0
        self.copies = self.sharded or precision.needs_master_weights
        # ZeRO-3: the model's weights are these pieces (the parameters hold data only while gathered).
        self.shards_parameters = zero.stage >= 3 and self.sharded
        self.shards = [self._shard_of(p, piece) for p, piece in zip(self.params, self.pieces)] \
            if self.shards_parameters else []
        self.master = [self._master_of(i) for i in range(len(self.params))]
        owned = [(m, p.ndim >= 2) for m, p in zip(self.master, self.params) if m.numel() > 0]
        # A rank may own nothing to update (a stage without parameters, or ZeRO pieces of tensors smaller
        # than dp): its optimizer still exists, over an empty placeholder, for the learning-rate schedule.
        device = self.params[0].device if self.params else torch.device("cpu")
        self.owns_parameters = bool(owned)
        self.optimizer = make_optimizer(owned or [(nn.Parameter(torch.empty(0, device=device)), False)])
        self.peak_gradient_bytes = 0
        self.overlap: OverlappedReduction | None = None
        if zero.stage >= 2 and self.sharded:
            self._watch_gradients()

    def piece_range(self, i: int) -> tuple[int, int]:
        """The flat range ``[start, stop)`` of parameter ``i`` this rank owns."""
        return self.pieces[i].start, self.pieces[i].stop

    def overlap_reduction(self, chunk_of: Sequence[int], excluded: set[int]) -> OverlappedReduction | None:
        """Reduce over data parallelism during the backward (:mod:`merak.optim.overlap`), with ``chunk_of`` the
        model chunk of each parameter and ``excluded`` the indices reduced at the step's end as before. None
        (nothing overlapped) without data parallelism, with ZeRO-2 (which reduces during every backward) or
        with ``overlap_grad_reduce`` off."""
        if self.dp_size == 1 or self.zero.stage >= 2 or not self.zero.overlap_grad_reduce:
            return None
        self.overlap = OverlappedReduction(self.params, chunk_of, excluded, self.bucket_bytes, self._start_bucket)
        return self.overlap

    def _shard_of(self, param: nn.Parameter, piece: Piece) -> torch.Tensor:
        """This rank's piece of ``param`` in the model's dtype, padded to the piece size (all-gathers take
        equal pieces)."""
        own = param.detach().reshape(-1)[piece.start:piece.stop].to(self.precision.dtype)
        return torch.nn.functional.pad(own, (0, piece.size - piece.length)).clone()

    def _master_of(self, i: int) -> torch.Tensor:
        param, piece = self.params[i], self.pieces[i]
        if not self.copies:
            return param
        if self.shards_parameters and not self.precision.needs_master_weights:
            return nn.Parameter(self.shards[i][:piece.length])  # fp32: the step updates the piece in place
        own = param.detach().reshape(-1)[piece.start:piece.stop]
        if not self.precision.needs_master_weights:
            # An fp32 piece is a view of the parameter: the step updates the model in place.
            return nn.Parameter(own)
        return nn.Parameter(own.float().clone())

    def refresh_master_weights(self) -> None:
        """Copy the model's weights into the fp32 master weights (after the model was loaded)."""
        if not self.copies:
            return
        with torch.no_grad():
            if self.shards_parameters:
                for shard, master, piece in zip(self.shards, self.master, self.pieces):
                    master.copy_(shard[:piece.length].float())
                return
            for param, master, piece in zip(self.params, self.master, self.pieces):
                master.copy_(param.detach().reshape(-1)[piece.start:piece.stop].float())

    # -- gradients ---------------------------------------------------------------

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def zero_grad(self) -> None:
        for param in self.params:
            param.grad = None
        for master in self.master:
            master.grad = None

    def gradients(self, params: Sequence[nn.Parameter]) -> list[torch.Tensor]:
        """Where the gradients of ``params`` are now (zeros where there is none yet), for sums over
        other groups (tied copies, sequence-parallel replicas) that must happen before the step."""
        if self.zero.stage < 2 or not self.sharded:
            return ensure_grads(params)
        index = {id(p): i for i, p in enumerate(self.params)}
        return [self._master_grad(index[id(p)]) for p in params]

    def _master_grad(self, i: int) -> torch.Tensor:
        master = self.master[i]
        if master.grad is None:
            master.grad = torch.zeros_like(master, dtype=torch.float32)
        return master.grad

    def reduce_gradients(self) -> None:
        """Reduce every gradient over the data-parallel group into the optimizer's gradients
        (the end of the step's backward work): wait for the overlapped reductions, then reduce the rest."""
        self._note_gradient_bytes()
        rest = list(range(len(self.params)))
        if self.overlap is not None:
            self.overlap.finish()
            rest = self.overlap.excluded
        if not self.copies:
            grads = self.gradients([self.params[i] for i in rest])
            if self.dp_size > 1:
                pre, post = self._scales()
                all_reduce_tensors(grads, group=self.dp_group, scale=post, pre_scale=pre,
                                   bucket_bytes=self.bucket_bytes, reduce_dtype=self.zero.reduce_dtype)
        elif self.sharded:
            # ZeRO-2 reduced during the backward and only reduces what is still held (normally
            # nothing); a parameter without a gradient gets zeros, as in the other stages.
            every = self.zero.stage < 2
            self._reduce_scatter([i for i in rest if every or self.params[i].grad is not None])
            for i in range(len(self.params)):
                self._master_grad(i)
        else:
            self._all_reduce_into_master(rest)
        self._note_gradient_bytes()

    def _start_bucket(self, indices: list[int]) -> tuple[object, Callable[[], None]]:
        """Start the data-parallel reduction of parameters ``indices`` (their gradients final) without waiting:
        ``(handle, finish)``, ``finish`` writing the sums where :meth:`reduce_gradients` would."""
        pre, post = self._scales()
        if self.sharded:
            flat_in, out = self._scatter_input(indices, pre)
            handle = collectives.reduce_scatter_single(out, flat_in, group=self.dp_group, async_op=True)
            return handle, lambda: self._add_owned(indices, out, post)
        dtype = self.zero.reduce_dtype
        grads = [self.params[i].grad if self.params[i].grad is not None else torch.zeros_like(self.params[i])
                 for i in indices]
        flat = torch.cat([g.reshape(-1).to(dtype) for g in grads])
        if pre != 1.0:
            flat.mul_(pre)
        if self.copies:  # the fp32 master gradients hold the sums: the half-precision ones are freed
            for i in indices:
                self.params[i].grad = None
        handle = dist.all_reduce(flat, group=self.dp_group, async_op=True)

        def finish() -> None:
            if post != 1.0:
                flat.mul_(post)
            offset = 0
            for i, grad in zip(indices, grads):
                part = flat[offset:offset + grad.numel()]
                if self.copies:
                    self.master[i].grad = part.float()
                else:
                    self.params[i].grad = grad
                    grad.copy_(part.view_as(grad))
                offset += grad.numel()
        return handle, finish

    def _watch_gradients(self) -> None:
        """ZeRO-2: reduce-scatter gradients in buckets while the backward still runs."""
        self._pending: list[int] = []
        self._pending_size = 0
        for i, param in enumerate(self.params):
            param.register_post_accumulate_grad_hook(lambda _, i=i: self._gradient_ready(i))

    def _gradient_ready(self, i: int) -> None:
        # Autograd runs the same graph in the same order on every replica, so every rank of the
        # data-parallel group reaches the same bucket boundaries.
        if i not in self._pending:
            self._pending.append(i)
            self._pending_size += self.pieces[i].size
        if self._pending_size >= self.zero.reduce_bucket_elements:
            self._note_gradient_bytes()
            self._reduce_scatter(self._pending)
            self._pending, self._pending_size = [], 0

    def reduce_ready_gradients(self) -> None:
        """ZeRO-2: reduce-scatter the gradients the last backward instruction left and free them."""
        if self.zero.stage >= 2 and self.sharded:
            ready = [i for i, p in enumerate(self.params) if p.grad is not None]
            if ready:
                self._note_gradient_bytes()
                self._reduce_scatter(ready)
            self._pending, self._pending_size = [], 0

    def _scales(self) -> tuple[float, float]:
        """Factors applied before and after the data-parallel sum (DeepSpeed's prescale rules)."""
        if self.zero.prescale_gradients:
            return 1.0 / self.dp_size, 1.0
        factor = self.zero.gradient_predivide_factor
        return 1.0 / factor, factor / self.dp_size

    def _all_reduce_into_master(self, indices: Sequence[int]) -> None:
        pre, post = self._scales()
        for i in indices:
            param, master = self.params[i], self.master[i]
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            master.grad = grad.reshape(-1).float()
            param.grad = None  # freed as it is copied: the fp32 copies are the gradients from here
        if self.dp_size > 1:
            all_reduce_tensors([self.master[i].grad for i in indices], group=self.dp_group, scale=post,
                               pre_scale=pre, bucket_bytes=self.bucket_bytes, reduce_dtype=self.zero.reduce_dtype)

    def _buckets(self, indices: Sequence[int], limit: int) -> Iterator[list[int]]:
        """Runs of parameter indices whose pieces add up to about ``limit`` elements."""
        bucket, size = [], 0
        for i in indices:
            bucket.append(i)
            size += self.pieces[i].size
            if size >= limit:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket

    def _reduce_scatter(self, indices: Sequence[int]) -> None:
        """Reduce-scatter the gradients of ``indices`` in buckets (zeros for missing ones);
        accumulate the owned pieces and free the full gradients."""
        pre, post = self._scales()
        for bucket in self._buckets(indices, self.zero.reduce_bucket_elements):
            self._reduce_scatter_bucket(bucket, pre, post)

    def _reduce_scatter_bucket(self, bucket: list[int], pre: float, post: float) -> None:
        flat_in, out = self._scatter_input(bucket, pre)
        collectives.reduce_scatter_single(out, flat_in, group=self.dp_group)
        self._add_owned(bucket, out, post)

    def _scatter_input(self, bucket: Sequence[int], pre: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The reduce-scatter's input for ``bucket`` (the full gradients freed) and its output buffer.
        Input layout: [rank 0's pieces of every bucket parameter][rank 1's pieces]..., in the reduction dtype."""
        dtype = self.zero.reduce_dtype
        columns = []
        for i in bucket:
            param, piece = self.params[i], self.pieces[i]
            flat = param.grad.reshape(-1).to(dtype) if param.grad is not None \
                else torch.zeros(piece.numel, device=param.device, dtype=dtype)
            padded = torch.nn.functional.pad(flat, (0, piece.size * self.dp_size - piece.numel))
            columns.append(padded.view(self.dp_size, piece.size))
            param.grad = None
        flat_in = torch.cat(columns, dim=1).reshape(-1)
        if pre != 1.0:
            flat_in.mul_(pre)
        return flat_in, torch.empty(flat_in.numel() // self.dp_size, device=flat_in.device, dtype=dtype)

    def _add_owned(self, bucket: Sequence[int], out: torch.Tensor, post: float) -> None:
        """Add the reduce-scattered pieces ``out`` of ``bucket`` to the owned master gradients."""
        if post != 1.0:
            out.mul_(post)
        offset = 0
        for i in bucket:
            piece = self.pieces[i]
            self._master_grad(i).add_(out[offset:offset + piece.length].float())
            offset += piece.size

    def _note_gradient_bytes(self) -> None:
        held = [p.grad for p in self.params] + ([m.grad for m in self.master] if self.copies else [])
        self.peak_gradient_bytes = max(self.peak_gradient_bytes,
                                       sum(g.numel() * g.element_size() for g in held if g is not None))

    # -- step --------------------------------------------------------------------

    def step(self, *, max_grad_norm: float, loss: torch.Tensor | None = None) -> StepOutcome:
        """Unscale, clip over the whole model and update; skip every rank's update together when a
        gradient or ``loss`` (this rank's loss of the step, if any) was not finite anywhere."""
        grads = [self.master[i].grad if self.copies else self.params[i].grad for i in range(len(self.params))]
        counted = [g for g, c in zip(grads, self.counted) if c and self.counts_replica]
        norm, loss_finite = global_grad_norm(counted, group=self.norm_group, group_size=self.norm_group_size,
                                             loss=loss)
        scale = self.scaler.scale
        norm /= scale
        if not (loss_finite and math.isfinite(norm)):
            return self._skip(norm, scale, loss_finite)
        factor = 1.0 / scale
        if max_grad_norm > 0 and norm + 1e-6 > max_grad_norm:
            factor *= max_grad_norm / (norm + 1e-6)
        present = [g for g in grads if g is not None]
        if factor != 1.0 and present:
            torch._foreach_mul_(present, factor)
        if self.owns_parameters:
            self.optimizer.step()
        self.scaler.update(False)
        self._publish()
        return StepOutcome(grad_norm=norm, skipped=False, loss_scale=scale)

    def _skip(self, norm: float, scale: float, loss_finite: bool) -> StepOutcome:
        """Leave weights and optimizer state as they are; in fp16 let the loss scale shrink."""
        may_cure = self.scaler.dynamic and loss_finite and scale > self.scaler.min_scale
        if self.precision.fp16:
            self.scaler.update(True)
        return StepOutcome(grad_norm=norm, skipped=True, loss_scale=scale,
                           loss_finite=loss_finite, scale_may_cure=may_cure)

    def _publish(self) -> None:
        """Copy the updated master weights into the model (all-gathered when sharded, into the pieces with
        ZeRO-3)."""
        if not self.copies:
            return
        with torch.no_grad():
            if not self.sharded:
                torch._foreach_copy_(self.params, [m.view(p.shape) for m, p in zip(self.master, self.params)])
                return
            if self.shards_parameters:  # the next forward gathers the new pieces
                if self.precision.needs_master_weights:
                    for shard, master, piece in zip(self.shards, self.master, self.pieces):
                        shard[:piece.length].copy_(master.detach())
                return
            for bucket in self._buckets(range(len(self.params)), self.zero.allgather_bucket_elements):
                self._all_gather_bucket(bucket)

    def _all_gather_bucket(self, bucket: list[int]) -> None:
        dtype = self.params[bucket[0]].dtype
        own = torch.cat([torch.nn.functional.pad(self.master[i].detach().to(dtype),
                                                 (0, self.pieces[i].size - self.pieces[i].length))
                         for i in bucket])
        gathered = torch.empty(own.numel() * self.dp_size, dtype=dtype, device=own.device)
        collectives.all_gather_single(gathered, own, group=self.dp_group)
        rows = gathered.view(self.dp_size, -1)
        offset = 0
        for i in bucket:
            param, piece = self.params[i], self.pieces[i]
            whole = rows[:, offset:offset + piece.size].reshape(-1)[:piece.numel]
            param.detach().copy_(whole.view(param.shape))
            offset += piece.size

    # -- introspection -----------------------------------------------------------

    def gradient_pieces(self) -> list[tuple[int, int, torch.Tensor | None]]:
        """Per parameter: the owned flat range and the gradient the last step applied to it
        (reduced, unscaled and clipped)."""
        grads = [m.grad if self.copies else p.grad for m, p in zip(self.master, self.params)]
        return [(piece.start, piece.stop, None if g is None else g.reshape(-1))
                for piece, g in zip(self.pieces, grads)]

    def memory_report(self) -> dict[str, int]:
        """Bytes held by this rank: master weights and optimizer state; gradients: their peak, and those held now
        (after a step: what the optimizer keeps between steps, the whole gradients without ZeRO, the owned
        pieces with it)."""
        def nbytes(tensors):
            return sum(t.numel() * t.element_size() for t in tensors)
        copies = [m for m, p in zip(self.master, self.params) if self.copies and m.dtype != p.dtype]
        states = [v for s in self.optimizer.state.values() for v in s.values()
                  if isinstance(v, torch.Tensor) and v.dim() > 0]
        held = [g for g in [*(p.grad for p in self.params), *(m.grad for m in self.master if self.copies)]
                if g is not None]
        return {"gradient_bytes": self.peak_gradient_bytes, "gradient_bytes_now": nbytes(held),
                "master_weight_bytes": nbytes(copies), "optimizer_state_bytes": nbytes(states)}
