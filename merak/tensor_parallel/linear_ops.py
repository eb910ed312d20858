"""Column- and row-parallel linear products as fused custom operators.

One operator per layer (rather than a collective operator around the layer's
own product) lets the backward pass overlap communication with computation,
as Megatron-LM does: a column-parallel layer starts the all-reduce (or, with
sequence parallelism, the reduce-scatter) of the input gradient and computes
the weight gradient while it travels. With ``overlap`` (``tp_overlapping_level``
1), a row-parallel layer also splits its forward product in two along the
batch and reduces the first half while computing the second.

``weight_in_out`` selects the weight layout: False for ``nn.Linear``
(out x in), True for Hugging Face's GPT-2 ``Conv1D`` (in x out).

A column layer's ``input_comm`` says how its input arrives:

- ``"copy"``: replicated on every rank; the input gradient is all-reduced;
- ``"gather"``: sharded along ``sequence_dim`` (sequence parallelism); it is
  all-gathered here and the input gradient reduce-scattered;
- ``"none"``: the caller already gathered it (the sequence-parallel region
  hook of a whole attention or MLP block, which also reduces the gradient).

A row layer with ``sequence_dim`` >= 0 reduce-scatters its output along it
instead of all-reducing it.
"""


import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from merak.core import group_registry
from merak.distributed import collectives
from merak.tensor_parallel import comm


def _product(x: Tensor, weight: Tensor, bias: Tensor | None, weight_in_out: bool) -> Tensor:
    if weight_in_out:  # Conv1D: the exact call of the Hugging Face Conv1D.forward
        flat = x.reshape(-1, x.shape[-1])
        out = torch.addmm(bias, flat, weight) if bias is not None else flat @ weight
        return out.view(*x.shape[:-1], weight.shape[1])
    return torch.nn.functional.linear(x, weight, bias)


def _out_features(weight: Tensor, weight_in_out: bool) -> int:
    return weight.shape[1] if weight_in_out else weight.shape[0]


def _input_grad(grad: Tensor, weight: Tensor, weight_in_out: bool) -> Tensor:
    return grad @ weight.t() if weight_in_out else grad @ weight


def _weight_grad(grad: Tensor, x: Tensor, weight_in_out: bool) -> Tensor:
    flat_grad = grad.reshape(-1, grad.shape[-1])
    flat_x = x.reshape(-1, x.shape[-1])
    return flat_x.t() @ flat_grad if weight_in_out else flat_grad.t() @ flat_x


def _bias_grad(grad: Tensor) -> Tensor:
    return grad.reshape(-1, grad.shape[-1]).sum(0)


def _start(kind: str, tensor: Tensor, name: str, dim: int, overlap: bool):
    """Start an all-reduce or a reduce-scatter along ``dim`` of ``tensor`` (asynchronously with
    ``overlap``); returns a function that waits and gives the result."""
    entry = group_registry.get_group(name)
    if entry.size == 1 or entry.simulated:
        result = comm.all_reduce(tensor, name) if kind == "all_reduce" else comm.reduce_scatter(tensor, name, dim)
        return lambda: result
    if kind == "all_reduce":
        out = tensor.contiguous()
        work = dist.all_reduce(out, group=entry.group, async_op=overlap)
    else:
        moved = tensor.movedim(dim, 0).contiguous()
        out = moved.new_empty((moved.shape[0] // entry.size, *moved.shape[1:]))
        work = collectives.reduce_scatter_single(out, moved, group=entry.group, async_op=overlap)

    def wait() -> Tensor:
        if overlap:
            work.wait()
        return out if kind == "all_reduce" else out.movedim(0, dim).contiguous()
    return wait


# -- column-parallel ---------------------------------------------------------------------------------

@torch.library.custom_op("merak::column_linear", mutates_args=())
def column_linear(x: Tensor, weight: Tensor, bias: Tensor | None, name: str, weight_in_out: bool,
                  input_comm: str, sequence_dim: int, overlap: bool) -> Tensor:
    """``x`` replicated (or sequence-sharded) in, this rank's slice of the output features out."""
    full = comm.all_gather(x, name, sequence_dim) if input_comm == "gather" else x
    return _product(full, weight, bias, weight_in_out)


@column_linear.register_fake
def _(x, weight, bias, name, weight_in_out, input_comm, sequence_dim, overlap):
    shape = list(x.shape)
    if input_comm == "gather":
        shape[sequence_dim] *= group_registry.group_size(name)
    return x.new_empty((*shape[:-1], _out_features(weight, weight_in_out)))


def _column_setup(ctx, inputs, output):
    x, weight, bias, name, weight_in_out, input_comm, sequence_dim, overlap = inputs
    # A gathered input is kept as the local chunk only and gathered again in backward.
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None
    ctx.name, ctx.weight_in_out, ctx.input_comm = group_registry.resolve_name(name), weight_in_out, input_comm
    ctx.sequence_dim, ctx.overlap = sequence_dim, overlap


@torch.library.custom_op("merak::column_linear_backward", mutates_args=())
def column_linear_backward(grad: Tensor, x: Tensor, weight: Tensor, has_bias: bool, name: str, weight_in_out: bool,
                           input_comm: str, sequence_dim: int, overlap: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of :func:`column_linear`: input (reduced), weight, bias (empty without a bias).

    An operator of its own, so a compiled backward keeps the overlap of the input gradient's
    reduction with the weight gradient, and holds no process group."""
    gathered = input_comm == "gather"
    full = comm.all_gather(x, name, sequence_dim) if gathered else x
    grad_x = _input_grad(grad, weight, weight_in_out)
    wait = None
    if input_comm != "none":
        wait = _start("reduce_scatter" if gathered else "all_reduce", grad_x, name, sequence_dim, overlap)
    grad_weight = _weight_grad(grad, full, weight_in_out)  # overlaps the reduction when async
    grad_bias = _bias_grad(grad) if has_bias else grad.new_empty(0)
    return (grad_x if wait is None else wait()).contiguous(), grad_weight, grad_bias


@column_linear_backward.register_fake
def _(grad, x, weight, has_bias, name, weight_in_out, input_comm, sequence_dim, overlap):
    return (torch.empty_like(x, memory_format=torch.contiguous_format), weight.new_empty(weight.shape),
            grad.new_empty(grad.shape[-1] if has_bias else 0))


def _column_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    grad_x, grad_weight, grad_bias = column_linear_backward(
        grad, x, weight, ctx.has_bias, ctx.name, ctx.weight_in_out, ctx.input_comm, ctx.sequence_dim, ctx.overlap)
    return grad_x, grad_weight, grad_bias if ctx.has_bias else None, None, None, None, None, None


column_linear.register_autograd(_column_backward, setup_context=_column_setup)


# -- row-parallel --------------------------------------------------------------------------------------

@torch.library.custom_op("merak::row_linear", mutates_args=())
def row_linear(x: Tensor, weight: Tensor, bias: Tensor | None, name: str, weight_in_out: bool,
               sequence_dim: int, overlap: bool) -> Tensor:
    """This rank's slice of the input features in; the summed (or sequence-scattered) output out.

    The bias is added once, after the reduction, as in the single-device layer.
    """
    kind = "reduce_scatter" if sequence_dim >= 0 else "all_reduce"
    if overlap and x.dim() > 1 and x.shape[0] > 1 and sequence_dim != 0:
        # Sub-pipelined: reduce the first half of the batch while the second is computed.
        halves = x.chunk(2, dim=0)
        pending = []
        for half in halves:
            pending.append(_start(kind, _product(half, weight, None, weight_in_out), name, sequence_dim, True))
        out = torch.cat([wait() for wait in pending], dim=0)
    else:
        out = _start(kind, _product(x, weight, None, weight_in_out), name, sequence_dim, False)()
    return out + bias if bias is not None else out


@row_linear.register_fake
def _(x, weight, bias, name, weight_in_out, sequence_dim, overlap):
    shape = list(x.shape[:-1])
    if sequence_dim >= 0:
        shape[sequence_dim] //= group_registry.group_size(name)
    return x.new_empty((*shape, _out_features(weight, weight_in_out)))


def _row_setup(ctx, inputs, output):
    x, weight, bias, name, weight_in_out, sequence_dim, overlap = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None
    ctx.name, ctx.weight_in_out, ctx.sequence_dim = group_registry.resolve_name(name), weight_in_out, sequence_dim


@torch.library.custom_op("merak::row_linear_backward", mutates_args=())
def row_linear_backward(grad: Tensor, x: Tensor, weight: Tensor, has_bias: bool, name: str, weight_in_out: bool,
                        sequence_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of :func:`row_linear`: input, weight, bias (empty without a bias)."""
    # The bias saw the reduced (with sequence parallelism: this rank's chunk of the) output.
    grad_bias = _bias_grad(grad) if has_bias else grad.new_empty(0)
    if sequence_dim >= 0:
        grad = comm.all_gather(grad, name, sequence_dim)
    return (_input_grad(grad, weight, weight_in_out).contiguous(), _weight_grad(grad, x, weight_in_out),
            grad_bias)


@row_linear_backward.register_fake
def _(grad, x, weight, has_bias, name, weight_in_out, sequence_dim):
    return (torch.empty_like(x, memory_format=torch.contiguous_format), weight.new_empty(weight.shape),
            grad.new_empty(grad.shape[-1] if has_bias else 0))


def _row_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    grad_x, grad_weight, grad_bias = row_linear_backward(grad, x, weight, ctx.has_bias, ctx.name,
                                                         ctx.weight_in_out, ctx.sequence_dim)
    return grad_x, grad_weight, grad_bias if ctx.has_bias else None, None, None, None, None


row_linear.register_autograd(_row_backward, setup_context=_row_setup)


# -- FLOP counts (torch.utils.flop_counter), so that autopipe weighs tensor-parallel shards right --

def _linear_flops(x_shape, w_shape, *_args, weight_in_out: bool, out_shape, **_kwargs) -> int:
    in_features = w_shape[0] if weight_in_out else w_shape[1]
    tokens = 1
    for size in out_shape[:-1]:
        tokens *= size
    return 2 * tokens * in_features * out_shape[-1]


@register_flop_formula(torch.ops.merak.column_linear)
def _column_flops(x_shape, w_shape, bias_shape, name, weight_in_out, *args, out_shape=None, **kwargs) -> int:
    return _linear_flops(x_shape, w_shape, weight_in_out=weight_in_out, out_shape=out_shape)


@register_flop_formula(torch.ops.merak.row_linear)
def _row_flops(x_shape, w_shape, bias_shape, name, weight_in_out, *args, out_shape=None, **kwargs) -> int:
    # The product covers every token of the input (with sequence parallelism the output keeps 1/tp).
    out_features = w_shape[1] if weight_in_out else w_shape[0]
    return _linear_flops(x_shape, w_shape, weight_in_out=weight_in_out, out_shape=(*x_shape[:-1], out_features))
