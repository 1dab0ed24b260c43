"""Data parallel from raw collectives: bucketed gradient all-reduce, overlapped with backward.

Every data-parallel rank holds the whole model and optimizer, runs forward and backward on its own slice of
the global batch, and the ranks then sum their gradients so that each applies the same update.

How the sum overlaps backward. Parameters are packed, in reverse registration order (roughly the order in
which backward produces their gradients), into buckets of about `bucket_mb` MiB. Each bucket owns one flat
gradient buffer and every `param.grad` is a view into it, so autograd accumulates straight into the buffer
and no copy is needed before sending. A post-accumulate-grad hook on each parameter counts down its bucket;
when a bucket's last gradient has arrived, its all-reduce is launched asynchronously while backward goes on
computing earlier layers' gradients. Buckets are launched strictly in index order: collectives on a group
must be issued in the same order on every rank, and index order is the same everywhere even if readiness
order were not. `finish_grad_sync()` launches what is left (unused parameters) and waits for all.

Loss normalisation: each micro-batch backpropagates loss_sum / tokens_in_global_batch, so the all-reduce is
a SUM and its result is the gradient of the global mean loss, whatever the per-rank token counts.
On accumulation micro-steps (`no_sync()`), gradients just accumulate locally: no communication.

Accounting (Ψ parameters, D data ranks, b_g bytes per gradient element, bucket size K bytes):
1. Replicated: parameters, gradients, optimizer state. Split: the batch.
2. Peak per device: the model's persistent state (b_w + b_g + b_o)·Ψ; the buckets ARE the gradients (views),
   so the only extra is gloo/NCCL's internal staging of at most one in-flight bucket per stream, ~K bytes.
3. Critical path: one all-reduce of b_g·Ψ bytes over the dp×cp group per step (ring: 2(D-1)/D·b_g·Ψ sent per
   rank), in ⌈b_g·Ψ/K⌉ pieces; all but the last bucket (the first layers' gradients) overlap with backward.
   Plus a start-up check that every rank holds the same initial weights.
4. Restart state: nothing of its own (buckets are rebuilt from the parameters).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn


class _Bucket:
    def __init__(self, index: int, params: list, device, dtype):
        self.index = index
        self.params = params
        self.buffer = torch.zeros(sum(p.numel() for p in params), device=device, dtype=dtype)
        self.pending = len(params)  # gradients still to arrive this backward
        self.work = None  # the in-flight all-reduce

    def reset(self):
        self.pending = len(self.params)
        self.work = None


class DistributedDataParallel(nn.Module):
    """Wraps a module; `forward` is the module's. Call `finish_grad_sync()` after the last backward of a step."""

    def __init__(self, module: nn.Module, group=None, bucket_mb: float = 25.0, check_same_init: bool = True):
        super().__init__()
        self.module = module
        self.group = group
        self.group_size = dist.get_world_size(group)
        self.require_grad_sync = True
        params = [p for p in module.parameters() if p.requires_grad]
        if check_same_init:
            assert_same_across_ranks(params, group)
        self.buckets = self._build_buckets(params, int(bucket_mb * 2**20))
        self._next_to_launch = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]

    def _build_buckets(self, params: list, bucket_bytes: int) -> list:
        """Group the parameters into buckets (reverse_order_buckets) and make their grads buffer views."""
        self._bucket_of = {}
        result = []
        for index, bucket_params in enumerate(reverse_order_buckets(params, bucket_bytes)):
            bucket = _Bucket(index, bucket_params, bucket_params[0].device, bucket_params[0].dtype)
            offset = 0
            for param in bucket_params:
                param.grad = bucket.buffer[offset:offset + param.numel()].view_as(param)
                offset += param.numel()
                self._bucket_of[param] = bucket
            result.append(bucket)
        return result

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        """Accumulation micro-steps: gradients add up locally, nothing is sent."""
        previous, self.require_grad_sync = self.require_grad_sync, False
        try:
            yield
        finally:
            self.require_grad_sync = previous

    def _on_grad_ready(self, param: torch.Tensor):
        if not self.require_grad_sync:
            return
        bucket = self._bucket_of[param]
        bucket.pending -= 1
        if bucket.pending < 0:
            raise RuntimeError("a gradient arrived twice in one synchronised backward: run the backward of "
                               "accumulation micro-steps inside no_sync(), and call finish_grad_sync() each step")
        # Launch every bucket that is complete and whose predecessors are launched: same order on all ranks.
        while self._next_to_launch < len(self.buckets) and self.buckets[self._next_to_launch].pending == 0:
            self._launch(self.buckets[self._next_to_launch])

    def _launch(self, bucket: _Bucket):
        if self.group_size > 1:  # a group of one has nothing to sum
            bucket.work = dist.all_reduce(bucket.buffer, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self._next_to_launch += 1

    def finish_grad_sync(self):
        """Launch buckets whose gradients never arrived (unused parameters), then wait for every all-reduce."""
        while self._next_to_launch < len(self.buckets):
            self._launch(self.buckets[self._next_to_launch])
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            bucket.reset()
        self._next_to_launch = 0

    def zero_grad(self):
        """Zero the bucket buffers in place: the .grad views must stay views."""
        for bucket in self.buckets:
            bucket.buffer.zero_()

    def bucket_sizes_bytes(self) -> list:
        return [b.buffer.numel() * b.buffer.element_size() for b in self.buckets]


def reverse_order_buckets(params: list, bucket_bytes: int) -> list:
    """Parameters in reverse registration order (≈ the order backward produces their gradients), cut into
    buckets of about `bucket_bytes` (a bucket closes once it reaches the size) and of one dtype each."""
    buckets, current, current_bytes = [], [], 0
    for param in reversed(params):
        if current and (param.dtype != current[0].dtype or current_bytes >= bucket_bytes):
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(param)
        current_bytes += param.numel() * param.element_size()
    return buckets + [current] if current else buckets


@torch.no_grad()
def assert_same_across_ranks(params: list, group=None):
    """Fail loudly if ranks start from different weights (a silent source of divergence).

    Each rank fingerprints every parameter with two float64 numbers (sum and sum of |x|·position weights);
    an all-gather of the fingerprints lets every rank name the first parameter that differs.
    """
    if dist.get_world_size(group) == 1:
        return
    fingerprints = []
    for p in params:
        flat = p.detach().reshape(-1).double()
        weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device) / flat.numel()
        fingerprints.append(torch.stack([flat.sum(), (flat.abs() * weights).sum()]))
    local = torch.stack(fingerprints)
    world = dist.get_world_size(group)
    gathered = torch.empty((world * local.shape[0], local.shape[1]), dtype=local.dtype, device=local.device)
    dist.all_gather_single(gathered, local, group=group)
    mismatch = (gathered.view(world, *local.shape) != local).any(dim=(0, 2))
    if mismatch.any():
        first = int(mismatch.nonzero()[0])
        name = getattr(params[first], "shard_info", None)
        raise RuntimeError(
            f"data-parallel ranks hold different initial values for parameter #{first}"
            f" ({name.global_name if name else 'unnamed'}); build the model from the same --seed on every rank"
        )
