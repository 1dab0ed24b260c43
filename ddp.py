"""Data parallel from raw collectives: bucketed gradient all-reduce, overlapped with backward.

Every data-parallel rank holds the whole model and optimizer, runs forward and backward on its own slice of
the global batch, and the ranks then sum their gradients so that each applies the same update.

How the sum overlaps backward. Parameters are packed, in reverse registration order (roughly the order in
which backward produces their gradients), into buckets of at most `bucket_mb` MiB, the last ones tapered
(1, 2, 4, ... MiB towards the end of backward, `reverse_order_buckets`): the last bucket's all-reduce can
overlap nothing, so what is left to send once backward ends is ~1 MiB, not a whole bucket. Each bucket owns one flat
gradient buffer and every `param.grad` is a view into it, so autograd accumulates straight into the buffer
and no copy is needed before sending. A post-accumulate-grad hook on each parameter counts down its bucket;
when a bucket's last gradient has arrived, its all-reduce is launched asynchronously while backward goes on
computing earlier layers' gradients. Buckets are launched strictly in index order: collectives on a group
must be issued in the same order on every rank, and index order is the same everywhere even if readiness
order were not. `finish_grad_sync()` launches what is left (unused parameters) and waits for all.

Loss normalisation: each micro-batch backpropagates loss_sum / tokens_in_global_batch, so the all-reduce is
a SUM and its result is the gradient of the global mean loss, whatever the per-rank token counts.
On accumulation micro-steps (`no_sync()`), gradients just accumulate locally: no communication.
With `reduction` (--dp-comm-bits 4: parallel/lowbit.py's GradientReduction, handed in by train.py, not imported) each
bucket is summed by it instead, synchronously as the bucket fills (no overlap), and keeps its error feedback with the
bucket (`_Bucket.feedback`: 4 bytes a gradient element, held and checkpointed; lowbit.py's docstring).

Accounting (Ψ parameters, D data ranks, b_g bytes per gradient element, bucket size K bytes):
1. Replicated: parameters, gradients, optimizer state. Split: the batch.
2. Peak per device: the model's persistent state (b_w + b_g + b_o)·Ψ; the buckets ARE the gradients (views),
   so the only extra is gloo/NCCL's internal staging of at most one in-flight bucket per stream, ~K bytes.
3. Critical path: one all-reduce of b_g·Ψ bytes over the dp×cp group per step (ring: 2(D-1)/D·b_g·Ψ sent per
   rank), in about ⌈b_g·Ψ/K⌉ + log2(K / 1 MiB) pieces; all but the last bucket overlap with backward, and the
   last (the first-registered parameters': embeddings, block 0's first) is ≤ 1 MiB unless one parameter is
   larger (a tied embedding, whose gradient completes only when backward ends).
   Plus a start-up check that every rank holds the same initial weights.
4. Restart state: nothing of its own (buckets are rebuilt from the parameters).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from optim import ensure_adam_state, update
from shard import StatePiece, counts_here, describe
from step import Messages

TAPER_BYTES = 2**20  # the size the last buckets start from (reverse_order_buckets' taper), torch DDP's first bucket


class _Bucket:
    def __init__(self, index: int, params: list, device, dtype, group, reduction=None):
        self.index = index
        self.params = params
        self.group = group  # the parameters' data-parallel group (one per bucket)
        self.group_name = grad_group(params[0])  # "dp_cp" or "expert_dp": names may share one group (mesh.py)
        self.buffer = torch.zeros(sum(p.numel() for p in params), device=device, dtype=dtype)
        self.pending = len(params)  # gradients still to arrive this backward
        self.work = None  # the in-flight all-reduce
        reduced = reduction is not None and dist.get_world_size(group) > 1
        self.feedback = reduction.feedback_like(self.buffer, group) if reduced else None  # the reduction's state

    def reset(self):
        self.pending = len(self.params)
        self.work = None


class OrderedReductions:
    """What DDP's buckets and ZeRO's units share: accumulation micro-steps that launch nothing (`no_sync`), and
    reductions launched strictly in index order as their gradients arrive (`arrived`): collectives on a group must
    be issued in the same order on every rank, and index order is the same everywhere even where readiness order
    is not. A user sets `require_grad_sync` and `_next_to_launch`, and has a `_launch(item)` that advances it."""

    @contextmanager
    def no_sync(self):
        """Accumulation micro-steps: gradients add up locally, nothing is sent (ZeRO-2/3 hold no full gradient:
        they reduce anyway, ZeroLayout._on_grad_ready)."""
        previous, self.require_grad_sync = self.require_grad_sync, False
        try:
            yield
        finally:
            self.require_grad_sync = previous

    def arrived(self, item, items: list, hint: str) -> None:
        """One more gradient of reduction `item` (of `items`, in launch order) is in: launch every complete one
        whose predecessors are launched. `hint`: what to do when a gradient arrives twice."""
        item.pending -= 1
        if item.pending < 0:
            raise RuntimeError(f"a gradient arrived twice in one synchronised backward: {hint}")
        while self._next_to_launch < len(items) and items[self._next_to_launch].pending == 0:
            self._launch(items[self._next_to_launch])


class DistributedDataParallel(nn.Module, OrderedReductions):
    """Wraps a module; `forward` is the module's. Call `finish_grad_sync()` after the last backward of a step."""

    def __init__(self, module: nn.Module, group=None, bucket_mb: float = 25.0, check_same_init: bool = True,
                 groups: dict | None = None, reduction=None):
        """group: the dense parameters' data-parallel group (dp×cp); groups: {grad_group name: ProcessGroup}
        when parameters name other groups in their record (experts: "expert_dp"); reduction: the buckets' sum
        when not dist.all_reduce, `reduction(buffer, group, feedback)` in place (module docstring)."""
        super().__init__()
        self.reduction = reduction
        self.module = describe(module)  # the parameters' records (shard.py), whole tensors unless an axis cut them
        self.groups = dict(groups or {})
        self.groups.setdefault("dp_cp", group)
        self.group = self.groups["dp_cp"]
        self.require_grad_sync = True
        params = [p for p in module.parameters() if p.requires_grad]
        for name in {grad_group(p) for p in params} - set(self.groups):
            raise ValueError(f"parameters reduce over the {name!r} group, which was not given to"
                             f" DistributedDataParallel")
        if check_same_init:
            assert_same_across_groups(params, self.groups)
        self.buckets = self._build_buckets(params, int(bucket_mb * 2**20))
        self._next_to_launch = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]

    def _build_buckets(self, params: list, bucket_bytes: int) -> list:
        """Group the parameters into buckets (reverse_order_buckets) and make their grads buffer views."""
        self._bucket_of = {}
        result = []
        cuts = reverse_order_buckets(params, bucket_bytes, taper=True, by_copies=self.reduction is not None)
        for index, bucket_params in enumerate(cuts):
            bucket = _Bucket(index, bucket_params, bucket_params[0].device, bucket_params[0].dtype,
                             self.groups[grad_group(bucket_params[0])], self.reduction)
            offset = 0
            for param in bucket_params:
                param.grad = bucket.buffer[offset:offset + param.numel()].view_as(param)
                offset += param.numel()
                self._bucket_of[param] = bucket
            result.append(bucket)
        return result

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _on_grad_ready(self, param: torch.Tensor):
        if self.require_grad_sync:
            self.arrived(self._bucket_of[param], self.buckets, "run the backward of accumulation micro-steps inside"
                                                               " no_sync(), and call finish_grad_sync() each step")

    def _launch(self, bucket: _Bucket):
        if dist.get_world_size(bucket.group) > 1 and self.reduction is not None:  # quantised: now, in place
            self.reduction(bucket.buffer, bucket.group, bucket.feedback)
        elif dist.get_world_size(bucket.group) > 1:  # a group of one has nothing to sum
            bucket.work = dist.all_reduce(bucket.buffer, op=dist.ReduceOp.SUM, group=bucket.group, async_op=True)
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


def grad_group(param) -> str:
    """The data-parallel group a parameter's gradient is summed over (its record's; dense: "dp_cp")."""
    info = getattr(param, "shard_info", None)
    return info.grad_group if info is not None else "dp_cp"


def reverse_order_buckets(params: list, bucket_bytes: int, element_size: int | None = None,
                          taper: bool = False, by_copies: bool = False) -> list:
    """Parameters in reverse registration order (≈ the order backward produces their gradients), cut into
    buckets of about `bucket_bytes` (a bucket closes once it reaches the size), of one dtype and one
    data-parallel group each. element_size: the bytes of an element in the buckets, when they will hold
    another dtype than the parameters have now (ZeRO's bf16 working copy of fp32-built parameters).

    taper (DDP): the buckets that launch LAST are cut small. Their gradients (the embeddings', the first
    blocks') complete only as backward ends, so the last bucket's all-reduce overlaps nothing: cut from that
    end, the first-registered parameters first, with caps of 1, 2, 4, ... MiB (TAPER_BYTES · 2^i) up to
    bucket_bytes, closing a bucket before a parameter would overflow it. What is left to send after backward
    is then ~1 MiB (or the one parameter that is larger), not up to bucket_bytes, for ~log2(bucket_bytes/1 MiB)
    more all-reduces; the buckets before it are each launched while the layers below still compute.

    by_copies (a quantised reduction, --dp-comm-bits 4): a bucket also closes where the axes a parameter is replicated
    over change, so a bucket of TP-replicated parameters (LayerNorms, row biases) holds the same values on every TP
    rank, its codes are the same, and the copies stay equal (a block scale shared with split tensors would differ).
    """
    def size(param):
        return param.numel() * (element_size or param.element_size())

    def other_kind(param, bucket):
        copies = by_copies and param.shard_info.replicated_over != bucket[0].shard_info.replicated_over
        return copies or param.dtype != bucket[0].dtype or grad_group(param) != grad_group(bucket[0])

    buckets, current, current_bytes = [], [], 0
    if taper:
        for param in params:  # registration order: the bucket that launches last is cut first
            cap = min(bucket_bytes, TAPER_BYTES << len(buckets))
            if current and (other_kind(param, current) or current_bytes + size(param) > cap):
                buckets.append(current)
                current, current_bytes = [], 0
            current.append(param)
            current_bytes += size(param)
        buckets += [current] if current else []
        return [bucket[::-1] for bucket in reversed(buckets)]  # launch order, each in reverse registration order
    for param in reversed(params):
        if current and (other_kind(param, current) or current_bytes >= bucket_bytes):
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(param)
        current_bytes += size(param)
    return buckets + [current] if current else buckets


def assert_same_across_groups(params: list, groups: dict):
    """assert_same_across_ranks for each data-parallel group over the parameters that reduce over it."""
    for name, group in groups.items():
        members = [p for p in params if grad_group(p) == name]
        if members:
            assert_same_across_ranks(members, group)


@torch.no_grad()
def assert_same_across_ranks(params: list, group=None):
    """Fail loudly if ranks start from different weights (a silent source of divergence).

    Each rank fingerprints every parameter with two float64 numbers (sum and sum of |x|·position weights);
    an all-gather of the fingerprints lets every rank name the first parameter that differs.
    """
    if dist.get_world_size(group) == 1 or any(p.is_meta for p in params):  # meta (--plan): no values yet
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


@dataclass(frozen=True)
class DDPFacts:
    """What the accounting reads of a DDP layout (`DDPLayout.facts`): report/axes.py's ddp section,
    planner/time_model.py."""

    bucket_bytes: tuple  # each bucket's bytes, in launch order (the last one is sent after backward)
    group_sizes: dict  # {data-parallel group name: its ranks N}
    dp_size: int  # the ranks of the dense parameters' group (dp×cp)
    buckets: tuple = ()  # each bucket's (group name, elements, element bytes, its group's ranks N), in launch order
    quantized: bool = False  # each bucket is summed by a given reduction (--dp-comm-bits 4), not an all-reduce
    muon: object = None  # Muon's figures (optimizers/muon.py's MuonFacts), or None


class DDPLayout:
    """ZeRO stage 0, the optim.Layout protocol: ddp.py sums the gradients, then every rank runs the same
    torch AdamW on the whole model (its parameters are the fp32 masters: b_w = b_g = 4, b_o = 8). Its
    start-up lines are report/axes.py's (`ddp_startup_lines`, under its name).

    coords: this rank's index along every mesh axis (`Mesh.coordinates()`), for shard.counts_here: a tensor
    replicated over TP or PP is counted in the norm and written once. Without a mesh (tests on one group),
    the axes a parameter says it is replicated over must be given here.
    """

    name = "ddp"  # its lines: report.axes.AXIS_LINES["ddp"]

    def __init__(self, ddp: DistributedDataParallel, optimizer, coords: dict | None = None, update_group=None):
        self.ddp, self.optimizer, self.module = ddp, optimizer, ddp.module
        self.update_group = update_group  # the norm's all-reduce: the world (None) or a DiLoCo replica
        self.params = [p for p in ddp.parameters() if p.requires_grad]
        coords = dict(coords or {})
        for name, group in ddp.groups.items():  # data-parallel replicas: their rank 0's copy counts
            coords[name] = dist.get_rank(group)
        for p in self.params:
            missing = set(getattr(p, "shard_info", None).replicated_over) - set(coords)
            if missing:
                raise ValueError(f"{p.shard_info.global_name} is replicated over {sorted(missing)}: pass coords")
        self.coords = coords
        self.recount()

    def recount(self) -> None:
        """Which copy counts in the norm (shard.counts_here, with each parameter's data-parallel group): decided
        at construction, and again when an axis moves copies between parameters (experts/eplb.py's re-plan)."""
        self.counted = torch.tensor([counts_here(p.shard_info, self.coords, (grad_group(p),)) for p in self.params],
                                    dtype=torch.bool, device=self.params[0].device)

    def __call__(self, *args, **kwargs):
        return self.ddp(*args, **kwargs)

    def no_sync(self):
        return self.ddp.no_sync()

    def finish_grad_sync(self):
        self.ddp.finish_grad_sync()

    def grad_pieces(self, params) -> list:
        return [p.grad for p in params if p.grad is not None]

    def step(self, scaler, clip: float, extra_nonfinite=None):
        grads = [p.grad for p in self.params]
        return update(grads, self.counted, scaler, clip, self.optimizer.step, grads[0].device,
                      extra_nonfinite=extra_nonfinite, group=self.update_group)

    def zero_grad(self):
        self.ddp.zero_grad()

    def set_lr(self, lr: float):
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def state_pieces(self) -> list:
        """The checkpoint's view: params (= the fp32 masters) and Adam moments, each logical piece written once."""
        sizes = {name: dist.get_world_size(group) for name, group in self.ddp.groups.items()}
        pieces = replicated_state_pieces(self.params, self.optimizer, self.coords, sizes)
        reduction = self.ddp.reduction  # --dp-comm-bits 4: each bucket's error feedback, this rank's own
        return pieces + (reduction.state_pieces([b.feedback for b in self.ddp.buckets]) if reduction else [])

    @property
    def optimizer_step_count(self) -> int:
        return adam_step(self.optimizer)

    @optimizer_step_count.setter
    def optimizer_step_count(self, value: int):
        set_adam_step(self.optimizer, value)

    def held_bytes(self) -> dict:
        weights = sum(p.numel() * p.element_size() for p in self.params)
        grads = sum(b.buffer.numel() * b.buffer.element_size() for b in self.ddp.buckets)
        optimizer = sum(t.numel() * t.element_size() for s in self.optimizer.state.values() for t in s.values()
                        if torch.is_tensor(t) and t.dim() > 0)  # the moments; the 0-d step counters aside
        held = {"weights": weights, "grads": grads, "optimizer": optimizer, "total": weights + grads + optimizer}
        feedback = [b.feedback.numel() * b.feedback.element_size() for b in self.ddp.buckets if b.feedback is not None]
        return dict(held, feedback=sum(feedback), total=held["total"] + sum(feedback)) if feedback else held

    def predicted_persistent(self) -> dict:
        """(b_w + b_g + b_o)·Ψ with b_w = b_g = b (the fp32 master weights and their gradients) and b_o = 2b (the
        two moments): everything replicated, ZeRO's formula at stage 0 (memory.persistent_bytes)."""
        psi, b = sum(p.numel() for p in self.params), self.params[0].element_size()
        out = {"weights": b * psi, "grads": b * psi, "optimizer": 2 * b * psi, "total": 4 * b * psi}
        reduction = self.ddp.reduction  # --dp-comm-bits 4: each bucket's error, padded to N chunks of 16·k elements
        if reduction is None or not reduction.feedback:
            return out
        feedback = sum(reduction.feedback_bytes(b.buffer.numel(), b.buffer.element_size(), dist.get_world_size(b.group))
                       for b in self.ddp.buckets if dist.get_world_size(b.group) > 1)
        return dict(out, feedback=feedback, total=out["total"] + feedback)

    def facts(self) -> DDPFacts:
        buckets = tuple((b.group_name, b.buffer.numel(), b.buffer.element_size(), dist.get_world_size(b.group))
                        for b in self.ddp.buckets)
        return DDPFacts(tuple(self.ddp.bucket_sizes_bytes()),
                        {name: dist.get_world_size(group) for name, group in self.ddp.groups.items()},
                        dist.get_world_size(self.ddp.group), buckets, self.ddp.reduction is not None)

    def predicted_messages(self, micro_batches: int = 1) -> Messages:
        """One all-reduce per bucket over its group (or what the reduction sends for it), plus nothing else (the
        step's scalars are step.py's)."""
        out = Messages()
        for bucket, size in zip(self.ddp.buckets, self.ddp.bucket_sizes_bytes()):
            n = dist.get_world_size(bucket.group)
            if n > 1 and self.ddp.reduction is not None:
                out = out + self.ddp.reduction.messages(bucket.buffer.numel(), bucket.buffer.element_size(),
                                                        bucket.group_name, n)
            elif n > 1:
                out.add("all_reduce", bucket.group_name, 1, size)
        return out


# ---------------------------------------------------------------------------------------------------------
# The checkpoint's view of the parameters and torch AdamW's state (DDPLayout.state_pieces, ckpt.py)
# ---------------------------------------------------------------------------------------------------------


def replicated_state_pieces(params, optimizer, coords: dict, group_sizes: dict | None = None,
                            other_state: dict | None = None) -> list:
    """StatePieces of a layout where data-parallel ranks hold the same parameters and torch AdamW state (DDP).

    The parameters are the fp32 master weights here, so there are no `master/` pieces. Each logical piece is
    written once: only copies that shard.counts_here picks over the model axes (`coords`: a TP-replicated
    LayerNorm on TP rank 0, the tied embedding on the first pipeline stage), and of the identical replicas in
    a parameter's data-parallel group (`coords[grad_group]` is this rank's index in it, `group_sizes` its
    size), by one member chosen so that each writes about 1/D of the bytes (greedy: the largest tensors
    first, each to the least-loaded member; the same on every rank as it only reads shapes). other_state:
    {parameter: [(kind, tensor)]} of the parameters another optimizer steps (Muon's momentum,
    optimizers/muon.py), listed instead of AdamW's moments.
    """
    ensure_adam_state(optimizer)
    params = [p for p in params if p.requires_grad]
    group_sizes = group_sizes or {}
    writer, load = {}, {}
    for index in sorted(range(len(params)), key=lambda i: -params[i].numel()):
        group = params[index].shard_info.grad_group
        loads = load.setdefault(group, [0] * group_sizes.get(group, 1))
        chosen = min(range(len(loads)), key=lambda d: loads[d])
        writer[index], loads[chosen] = chosen, loads[chosen] + params[index].numel()
    pieces = []
    for index, p in enumerate(params):
        info = p.shard_info
        primary = writer[index] == coords.get(info.grad_group, 0) and counts_here(info, coords)
        state = (other_state or {}).get(p) or [(kind, optimizer.state[p][kind]) for kind in ("exp_avg", "exp_avg_sq")]
        for kind, tensor in (("param", p.detach()), *state):
            pieces.append(StatePiece(f"{kind}/{info.global_name}", tensor, info, primary=primary))
    return pieces


def adam_step(optimizer) -> int:
    """The step count torch's Adam/AdamW uses for bias correction (all parameters share it).

    One step tensor is read: fused AdamW keeps them on the parameters' device, so this costs one host sync
    (per checkpoint), not one per parameter."""
    for state in optimizer.state.values():
        if "step" in state:
            return int(state["step"])
    return 0


def set_adam_step(optimizer, step: int) -> None:
    ensure_adam_state(optimizer)  # a state created later would start again from 0
    for state in optimizer.state.values():
        if "step" in state:
            state["step"].fill_(step)  # in place: keeps the dtype and device torch chose (see ensure_adam_state)
