"""Collectives as torch operators: what selective recompute's policy sees of a layout's messages, and saves.

Selective recompute (parallel/recompute.py) decides op by op, below autograd (torch.utils.checkpoint's
TorchDispatchMode), what a block keeps: an op it does not keep runs again in the block's recompute. A raw
`dist.all_reduce` is seen there as an in-place c10d op on a buffer allocated just before it (its result is that buffer,
which the cache cannot give back), so a policy could neither keep it nor leave it to the recompute without running the
collective again inside backward: messages the accounting does not predict, and on an uneven schedule a hang.
Wrapped as one out-of-place operator each (`collectives::all_reduce`, ...), a collective is a single op to
the policy: it runs once in the forward, its output is kept (`SAVED`), and the recompute reads the kept tensor
instead of sending anything. The layouts' autograd Functions call these in their forward where the model
recomputes selectively (tensor_parallel.TensorParallelContext.operators, context_parallel's Ulysses
exchange, the amax MAX over tp and cp of fp8.Fp8Linear and precision.recipe.RecipeLinear: `reduce_amax`); their
backward collectives are no recompute and stay raw calls (`sum_raw`, `gather_raw`, `scatter_raw`: tensor_parallel's;
they and `max_raw` are what the operators run).

Accounting (accounting/memory.py's symbols):
1. Nothing split: each operator is the raw collective on a fresh buffer, the same bytes, the same call.
2. Memory: the outputs kept, one per collective of a block (memory.selective_block_terms counts them).
3. Messages: those of the raw call, once per forward (tracer.CommTracer sees the dist call inside the operator).
4. No state. A process group travels by its name (`group.group_name`, resolved by c10d's registry), as
   torch's functional collectives pass it: an operator takes no Python objects.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group


def sum_raw(x: torch.Tensor, group) -> torch.Tensor:
    """Σ over `group` of x by dist.all_reduce, into a fresh buffer (never mutate autograd's tensors)."""
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


def max_raw(x: torch.Tensor, group) -> torch.Tensor:
    """MAX over `group` of x by dist.all_reduce, into a fresh buffer (what `collectives::all_reduce_max` runs)."""
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return out


def gather_raw(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The group's pieces along `dim` by all_gather_single (which works on dim 0: `dim` moves to the front)."""
    local = x.movedim(dim, 0).contiguous()
    out = local.new_empty((local.shape[0] * dist.get_world_size(group), *local.shape[1:]))
    dist.all_gather_single(out, local, group=group)
    return out.movedim(0, dim)


def scatter_raw(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Σ over `group`, this rank's 1/N along `dim`, by reduce_scatter_single (on dim 0, as gather_raw)."""
    size = dist.get_world_size(group)
    full = x.movedim(dim, 0).contiguous()
    out = full.new_empty((full.shape[0] // size, *full.shape[1:]))
    dist.reduce_scatter_single(out, full, op=dist.ReduceOp.SUM, group=group)
    return out.movedim(0, dim)


@torch.library.custom_op("collectives::all_reduce", mutates_args=())
def _all_reduce_op(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return sum_raw(x, _resolve_process_group(group_name))


@torch.library.custom_op("collectives::all_reduce_max", mutates_args=())
def _all_reduce_max_op(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return max_raw(x, _resolve_process_group(group_name))


@torch.library.custom_op("collectives::all_gather", mutates_args=())
def _all_gather_op(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    return gather_raw(x, dim, _resolve_process_group(group_name)).contiguous()


@torch.library.custom_op("collectives::reduce_scatter", mutates_args=())
def _reduce_scatter_op(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    return scatter_raw(x, dim, _resolve_process_group(group_name)).contiguous()


@torch.library.custom_op("collectives::all_to_all", mutates_args=())
def _all_to_all_op(send: torch.Tensor, group_name: str) -> torch.Tensor:
    received = torch.empty_like(send, memory_format=torch.contiguous_format)
    dist.all_to_all_single(received, send.contiguous(), group=_resolve_process_group(group_name))
    return received


@_all_reduce_op.register_fake
def _(x, group_name):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@_all_reduce_max_op.register_fake
def _(x, group_name):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@_all_gather_op.register_fake
def _(x, dim, group_name):
    shape = list(x.shape)
    shape[dim] *= dist.get_world_size(_resolve_process_group(group_name))
    return x.new_empty(shape)


@_reduce_scatter_op.register_fake
def _(x, dim, group_name):
    shape = list(x.shape)
    shape[dim] //= dist.get_world_size(_resolve_process_group(group_name))
    return x.new_empty(shape)


@_all_to_all_op.register_fake
def _(send, group_name):
    return torch.empty_like(send, memory_format=torch.contiguous_format)


SAVED = frozenset({torch.ops.collectives.all_reduce.default, torch.ops.collectives.all_reduce_max.default,
                   torch.ops.collectives.all_gather.default,
                   torch.ops.collectives.reduce_scatter.default, torch.ops.collectives.all_to_all.default})


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Σ over `group` of x, a new tensor (tensor_parallel's g)."""
    return torch.ops.collectives.all_reduce(x, group.group_name)


def all_reduce_max(x: torch.Tensor, group) -> torch.Tensor:
    """MAX over `group` of x, a new tensor (an amax reduction under selective recompute: `reduce_amax`)."""
    return torch.ops.collectives.all_reduce_max(x, group.group_name)


def reduce_amax(amax: torch.Tensor, groups, operator: bool) -> torch.Tensor:
    """The amaxes of logical tensors whose pieces lie on several ranks: NaN made inf (a MAX must not drop it), then
    MAX over each of `groups` in turn (fp8.Fp8Linear.scales, precision.recipe.RecipeLinear's NVFP4 amaxes). Where
    `operator` (the block is recomputed selectively) by `all_reduce_max`, an op the policy keeps, so the recompute
    sends nothing; else in place by dist.all_reduce: the same calls and bytes."""
    amax = torch.nan_to_num(amax, nan=float("inf"))
    for group in groups:
        if operator:
            amax = all_reduce_max(amax, group)
        else:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


def all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The group's pieces of x concatenated along `dim` (contiguous), in rank order."""
    return torch.ops.collectives.all_gather(x, dim, group.group_name)


def reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Σ over `group` of x, this rank's 1/N along `dim` (contiguous)."""
    return torch.ops.collectives.reduce_scatter(x, dim, group.group_name)


def all_to_all(send: torch.Tensor, group) -> torch.Tensor:
    """all_to_all_single of `send` (split evenly along dim 0) into a new tensor of its shape."""
    return torch.ops.collectives.all_to_all(send, group.group_name)
