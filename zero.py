"""ZeRO stages 1, 2 and 3 from raw collectives: shard optimizer state, then gradients, then parameters.

Plain data parallel (stage 0) keeps D identical copies of everything. ZeRO (Rajbhandari et al. 2020) keeps
the same arithmetic but gives each of the D ranks of the data group (dp×cp) one 1/D slice of the state:

    stage 1: the optimizer state (fp32 master weights + both Adam moments) is sharded;
    stage 2: + the gradients (reduce-scattered in buckets during backward; full gradients freed at once);
    stage 3: + the working parameters (all-gathered per block just before use, freed after).

The flat layout. Parameters are packed into UNITS, each one flat buffer padded to a multiple of D elements:
stage 1/2 units are gradient buckets of about `bucket_mb` MiB, in reverse registration order (roughly the
order backward produces them); stage 3 units are the transformer blocks plus one "root" unit holding the rest
(embeddings, tied head, final LayerNorm). A unit of n elements is padded to n' = ⌈n/D⌉·D and rank r owns the
contiguous slice [r·S, (r+1)·S), S = n'/D. The padding is zero in every buffer and stays zero (its gradient is
zero, so Adam never moves it). Ψ' = Σ n' ≤ Ψ + units·(D-1) is the padded parameter count; every formula
below holds exactly with Ψ' (and within that padding with Ψ).

The update on a shard is torch.optim.AdamW's, element for element: decoupled decay p ← p·(1 - lr·wd) on the
tensors of dim ≥ 2 (kept as [start, end) segments of the shard, no per-element mask), then m ← β1·m + (1-β1)·g,
v ← β2·v + (1-β2)·g², p ← p - lr/(1-β1^t) · m / (√v/√(1-β2^t) + ε). Everything else follows DESIGN.md's
order, through optim.update: reduce → unscale → all ranks finite? → global norm = √(Σ_world Σ_shard g²)
(padding is zero; a tensor replicated over a model axis, such as TP's LayerNorms, is counted on coordinate 0
of that axis only: model.counts_here) → clip → all step or all skip.

Mixed precision. Working parameters and each backward's gradients are `param_dtype` (bf16 in train.py:
b_w = 2), the optimizer keeps `master_dtype` master weights and moments (fp32: b_o = 4 + 4 + 4 = 12): with
one micro-batch per step (b_g = 2) the 2 + 2 + 12 = 16 bytes per parameter of the paper, with m > 1 the
gradient is accumulated in fp32 (b_g = 4, "Gradient accumulation"): 2 + 4 + 12. When the two dtypes are
equal (fp32 runs, the float64 tests) the master IS the working shard (no third copy): b_o = 8 with fp32.

Gradient accumulation. Stage 1 accumulates full gradients locally under `no_sync()` and reduces once per
step, like DDP. Stages 2 and 3 cannot hold a full gradient, so every micro-batch's backward reduce-scatters
its buckets and adds the result to the gradient shard: no_sync() changes nothing there, and the reduce-scatter
volume is paid m times per step (FSDP does the same; its no_sync trades this back for full gradients).
With m > 1 the sum over micro-batches is kept in the master dtype (`accumulate_dtype`, fp32 under bf16, as
Megatron's main_grad and DeepSpeed's grad_accum_dtype): adding m terms into a bf16 sum rounds the whole sum
m times, and its error grows with m (bench/bench_zero_accum.py measures it). Stage 1's accumulator is fp32
(autograd's bf16 .grad of each micro-batch is added into it and dropped), stages 2/3's gradient shard is fp32.
What goes on the wire (`reduce_dtype`):
    stage 1 reduce-scatters its fp32 accumulator as it is, once per step: no rounding between the sum and the
    optimizer and no bf16 copy of the full gradient to hold while it is sent; the price is b_g = 4 instead of
    2 bytes once per step, spread over m ≥ 2 micro-batches (per micro-batch, no more than stage 2 sends);
    stages 2/3 reduce-scatter each micro-batch's bucket in bf16 and add the result into the fp32 shard
    (DeepSpeed's choice): the bucket is sent while backward runs, m times a step, and fp32 would double that
    traffic and the buckets; its one rounding falls on that micro-batch's own term, not on the running sum,
    so the error does not grow with m.
At m = 1 nothing is summed: the gradient stays in the working dtype (no extra buffer, the same bytes).

How stage 3 overlaps (module hooks, chosen over autograd Functions because the model stays untouched).
Each unit's gathered buffer is allocated once and every parameter's `.data` is a view into it; "free" shrinks
the buffer's storage to 0 bytes and "gather" grows it back and all-gathers into it, so the views (and the
tensors autograd saved) stay valid. Forward: a pre-hook on the model gathers the root (embeddings) and
prefetches block 0; block i's pre-hook waits for block i, frees the root after the embedding (i = 0) and
launches the async gather of block i+1 (after the last block: the root again, for the tied head) while block i
computes; block i's post-hook frees it, except the last block, which backward needs first. Backward: a hook
on block i's output (it fires when the gradient reaches block i, before its backward) waits for block i,
launches block i-1's gather, and (i = L-1) frees the root once the head's backward is done. A unit's
parameter gradients are copied into a flat bucket as they arrive (post-accumulate-grad hooks) and, once all
are there, the bucket is reduce-scattered asynchronously and the unit is freed: every node that reads a
weight has run before autograd accumulates that weight's gradient. Autograd runs a ready AccumulateGrad before
any other ready node, so block i+1 is freed before block i's backward hook prefetches block i-1: at most two
units are gathered at once (`peak_gathered_units`, tested, with the order of gathers in both passes).
Under --compile the hooks stay eager: model.compile_blocks compiles each block's forward, not its call, and the
compiled graph reads the parameters as inputs, whatever storage the hooks give them (tested: same order, same
gradients).

Accounting (Ψ parameters (Ψ' padded), D = size of the dp×cp group, b_w/b_g/b_o bytes per parameter for
working weights / persistent gradients / optimizer state, m micro-batches per step, U the largest unit's
elements; b_g = b_w at m = 1, the master's 4 bytes for m > 1 under bf16 or fp16: "Gradient accumulation"):
1. Replicated vs split. Stage 1: weights and gradients replicated, optimizer state split in D. Stage 2:
   weights replicated; gradients and optimizer state split. Stage 3: everything split. The batch is split.
2. Persistent bytes per rank (mfu.persistent_bytes, `held_bytes()` measures it):
       stage 1: (b_w + b_g)·Ψ' + b_o·Ψ'/D;   stage 2: b_w·Ψ' + (b_g + b_o)·Ψ'/D;   stage 3: (b_w + b_g + b_o)·Ψ'/D.
   Temporary on top (`peak_lower_bound()`, printed by train.py; activations apart): stage 1: the reduce-scatter
   outputs, later the all-gather inputs, of every unit: max(b_g, b_w)·Ψ'/D; stage 2: at most 2 full gradient
   buckets in flight, b_w·2U (U: largest unit; buckets are working dtype), or the all-gather inputs b_w·Ψ'/D;
   stage 3: two gathered units, b_w·2U (the one in use and the prefetched one), plus gradient buckets
   b_w·(U_root + 2U) (the root's fills during the whole backward: its tied head and its embeddings are its
   first and last gradients).
3. Messages on the critical path, per step, over the dp×cp group (M = payload; ring: wire = (D-1)/D·M):
       stage 1: reduce_scatter b_g·Ψ' (overlapped with backward) + all_gather b_w·Ψ' = 2Ψ; the all-gather of
       unit k is launched as soon as unit k is updated, so it overlaps the update of unit k+1;
       stage 2: m × reduce_scatter b_w·Ψ' (overlapped) + all_gather b_w·Ψ' = 2Ψ for m = 1;
       stage 3: m × [all_gather b_w·(2Ψ' - U_last) + reduce_scatter b_w·Ψ']: forward gathers every unit once
       (the root twice: embedding, then the tied head), backward every unit again except the root (its
       weights were last read by the head's backward, before it is freed) and the last block (kept gathered
       from its forward into its backward) = the paper's 3Ψ less what is not regathered. Exposed (not hidden
       behind compute): the gathers of the root and block 0 at the start of forward, and the root's
       reduce-scatter at the end of backward (its last gradient, the embeddings', comes last).
       With --fp8 (`codecs`), the block linears' weights are units of their own gathered as E4M3 bytes:
       1 byte instead of b_w per element, plus, per such gather, an all_reduce (MAX) of 4 bytes per weight
       over the unit's group and the linear's TP/CP groups, so every rank quantises a weight with one scale.
   Plus the update's 16-byte all-reduce over the world (optim.update: squared norm and non-finite count),
   and with sequence parallel one all-reduce over the TP group of this shard's part of the SP replicated
   parameters' gradients (tensor_parallel's after_grad_sync, on `grad_pieces`).
4. Restart state: `state_pieces()` lists, per logical tensor, the working weights (`param/`: the full tensor
   at stages 1/2, written by dp rank 0 only; this rank's flat range at stage 3), and this rank's flat range of
   `master/`, `exp_avg/`, `exp_avg_sq/`, plus `optimizer_step_count` (Adam's t). The flat ranges exclude the
   padding, so a checkpoint reloads on any D.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn

import mfu
from ddp import assert_same_across_groups, grad_group, reverse_order_buckets
from model import ShardInfo, StatePiece
from model import counts_here
from optim import StepResult, update


class _Unit:
    """One flat, padded buffer of parameters: what is gathered, reduce-scattered and stepped together."""

    def __init__(self, index: int, params: list, group):
        self.index = index
        self.params = params
        self.group = group  # the parameters' data-parallel group (dp×cp, or expert_dp for experts)
        self.group_name = grad_group(params[0])  # "dp_cp" or "expert_dp": two names may share one group (mesh.py)
        dp_size, dp_rank = dist.get_world_size(group), dist.get_rank(group)
        self.dp_size, self.dp_rank = dp_size, dp_rank
        self.offsets = []  # flat offset of each parameter in the unit
        offset = 0
        for p in params:
            self.offsets.append(offset)
            offset += p.numel()
        self.numel = offset  # n: real elements
        self.shard_numel = -(-offset // dp_size)  # S = ⌈n/D⌉
        self.padded_numel = self.shard_numel * dp_size  # n' = S·D
        self.shard_start = dp_rank * self.shard_numel  # this rank owns [start, start + S) of the flat unit
        self.pending = len(params)  # gradients still to arrive in this backward
        # Filled by the layout:
        self.full_param = None  # n' working elements (stage 1/2: persistent; stage 3: storage freed between uses)
        self.param_shard = None  # S working elements (stage 3; at stage 1/2 a view of full_param)
        self.full_grad = None  # n' (stage 1: the persistent accumulator; stage 2/3: one backward's bucket)
        self.grad_shard = None  # S reduced gradient, accumulate_dtype (stage 1: a view of full_grad)
        self.master = None  # S master-dtype weights (may alias param_shard)
        self.exp_avg = None
        self.exp_avg_sq = None
        self.decay_segments = []  # [(lo, hi)] of the shard that get weight decay (dim ≥ 2)
        self.uncounted_segments = []  # [(lo, hi)] of the shard that the global norm skips (TP replicas)
        self.gather_work = None  # stage 3 in-flight all-gather
        self.gathered = False  # stage 3: the full buffer's storage is allocated
        self.fp8 = []  # stage 3 with FP8 weights: [(linear, lo, hi)] shard segments gathered as E4M3 bytes
        self.codes = None  # the in-flight gather's uint8 buffer [n'], and the scales to decode it with
        self.code_scales = None

    def shard_range_of(self, i: int):
        """(lo, hi) of parameter i, as offsets into this rank's shard, or None when the shard misses it."""
        lo = max(self.offsets[i], self.shard_start)
        hi = min(self.offsets[i] + self.params[i].numel(), self.shard_start + self.shard_numel)
        return (lo - self.shard_start, hi - self.shard_start) if lo < hi else None


class ZeroLayout:
    """ZeRO stage 1, 2 or 3 over the dp×cp `group`; train.train_step drives it (ReplicatedUpdate's protocol).

    `module` must hold the same initial values on every rank (checked). At stage 3 it must be a model.GPT (its
    `transformer.h` blocks are the units gathered one at a time). Parameters may be TP-local shards carrying
    `param.shard_info`; each is flattened as the local tensor it is. `micro_batches`: the m that each step
    accumulates (train.py passes it); with m > 1 gradients are summed in `master_dtype` unless `accumulate_dtype`
    says otherwise.
    """

    def __init__(self, module: nn.Module, group, stage: int, *, lr: float, weight_decay: float = 0.1,
                 betas=(0.9, 0.95), eps: float = 1e-8, param_dtype=torch.float32, master_dtype=torch.float32,
                 bucket_mb: float = 25.0, coords: dict | None = None, check_same_init: bool = True,
                 groups: dict | None = None, codecs: dict | None = None, micro_batches: int = 1,
                 accumulate_dtype=None):
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage} (stage 0 is ddp.py + DDPLayout)")
        self.module, self.group, self.stage = module, group, stage
        # Each parameter is sharded over its own data-parallel group (its record's grad_group): the dense
        # ones over dp×cp (`group`), experts over expert_dp (`groups`), each unit over one of them.
        self.groups = dict(groups or {})
        self.groups.setdefault("dp_cp", group)
        # Stage 3: weights gathered in FP8 (fp8.Fp8Linear's, {param: linear}): one byte per element on the wire.
        self.codecs = dict(codecs or {}) if stage == 3 else {}
        self.lr, self.weight_decay, self.betas, self.eps = lr, weight_decay, betas, eps
        self.param_dtype, self.master_dtype = param_dtype, master_dtype
        # The gradient summed over the m micro-batches of a step is kept in the master dtype (docstring,
        # "Gradient accumulation"); with one micro-batch there is nothing to sum: the working dtype, no new buffer.
        # accumulate_dtype=param_dtype forces the working dtype (bench/bench_zero_accum.py's "before").
        if accumulate_dtype is None:
            accumulate_dtype = master_dtype if micro_batches > 1 else param_dtype
        self.accumulate_dtype = accumulate_dtype
        # What a gradient reduce-scatter sends: stage 1 its accumulator, once per step; stages 2/3 each
        # micro-batch's bucket as backward produced it.
        self.reduce_dtype = self.accumulate_dtype if stage == 1 else param_dtype
        self.dp_size, self.dp_rank = dist.get_world_size(group), dist.get_rank(group)
        # This rank's index along the model axes (Mesh.coordinates()): which replicated copies count (TP rank 0's
        # LayerNorms, ...). The dp×cp group holds disjoint shards, so every shard element counts somewhere.
        self.coords = dict(coords or {})
        self.step_count = 0  # Adam's t
        self.require_grad_sync = True
        self.peak_gathered_units = 0
        self._in_flight = []  # [(unit, work, output)] reduce-scatters launched, not yet added to grad shards
        self._next_to_launch = 0
        self._launched_this_step = False
        self._unsharded = False
        self._exact_gathers = False  # unshard() gathers the working weights themselves, not their FP8 codes

        params = [p for p in module.parameters() if p.requires_grad]
        names = {id(p): n for n, p in module.named_parameters()}
        for p in params:
            if not hasattr(p, "shard_info"):
                p.shard_info = ShardInfo(global_name=names[id(p)], global_shape=tuple(p.shape))
            if p.shard_info.grad_group not in self.groups:
                raise ValueError(f"{p.shard_info.global_name} reduces over {p.shard_info.grad_group!r}, which was"
                                 f" not given to ZeroLayout")
            missing = set(p.shard_info.replicated_over) - set(self.coords)
            if missing:
                raise ValueError(f"{p.shard_info.global_name} is replicated over {sorted(missing)}: pass coords")
        if check_same_init:
            assert_same_across_groups(params, self.groups)
        device = params[0].device
        if stage == 3:
            self.blocks = list(module.transformer.h)
            if not self.blocks:
                raise ValueError("ZeRO-3 gathers one transformer block at a time: the model needs n_layer ≥ 1")
            in_block = {id(p) for b in self.blocks for p in b.parameters()}
            # A block's parameters, one unit per data-parallel group (a MoE block: dense, then experts).
            # FP8 weights form units of their own: those are gathered as E4M3 bytes.
            units = [_by_group([p for p in b.parameters() if p.requires_grad], self.codecs) for b in reversed(self.blocks)]
            units.append(_by_group([p for p in params if id(p) not in in_block], self.codecs))  # the root: last
            sets = [len(u) for u in units]
            units = [u for block in units for u in block]
        else:
            # A tensor with a copy on another pipeline stage (the tied embedding) gets a unit of its own: both
            # stages then shard it alike, and its gradient pieces can be summed across them.
            alone = [p for p in params if "pp" in p.shard_info.replicated_over]
            units = reverse_order_buckets([p for p in params if p not in set(alone)], int(bucket_mb * 2**20),
                                          element_size=torch.empty((), dtype=param_dtype).element_size())
            units += [[p] for p in alone]
        self.units = [_Unit(i, u, self.groups[grad_group(u[0])]) for i, u in enumerate(u for u in units if u)]
        self._unit_of = {p: u for u in self.units for p in u.params}  # tensors hash by identity
        self._offset_of = {p: o for u in self.units for p, o in zip(u.params, u.offsets)}
        with torch.no_grad():
            for unit in self.units:
                self._build_unit(unit, device)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]
        for unit in self.units:
            for i, p in enumerate(unit.params):
                span = unit.shard_range_of(i)
                if p in self.codecs:
                    unit.fp8.append((self.codecs[p], *(span or (0, 0))))
        if stage == 3:  # what is gathered together: block i's units, the root's
            bounds = [sum(sets[:k]) for k in range(len(sets) + 1)]
            gathered_sets = [self.units[lo:hi] for lo, hi in zip(bounds, bounds[1:])]
            self.block_units = gathered_sets[-2::-1]  # block i's units
            self.root = gathered_sets[-1]
            self._install_stage3_hooks()

    # ----------------------------------------------------------------------------------------------------
    # Construction
    # ----------------------------------------------------------------------------------------------------

    def _build_unit(self, unit: _Unit, device):
        """Pack the unit's initial values, keep this rank's master shard, point the parameters at the buffers."""
        flat = torch.zeros(unit.padded_numel, dtype=self.master_dtype, device=device)
        for p, offset in zip(unit.params, unit.offsets):
            flat[offset:offset + p.numel()] = p.detach().reshape(-1)  # master from the full-precision init
        mine = slice(unit.shard_start, unit.shard_start + unit.shard_numel)
        unit.full_param = flat.to(self.param_dtype, copy=True)
        if self.stage == 3:
            unit.param_shard = unit.full_param[mine].clone()
        else:
            unit.param_shard = unit.full_param[mine]  # a view: the step's result is gathered around it
        aliased = self.param_dtype == self.master_dtype
        unit.master = unit.param_shard if aliased else flat[mine].clone()
        unit.exp_avg = torch.zeros(unit.shard_numel, dtype=self.master_dtype, device=device)
        unit.exp_avg_sq = torch.zeros(unit.shard_numel, dtype=self.master_dtype, device=device)
        if self.stage == 1:
            unit.full_grad = torch.zeros(unit.padded_numel, dtype=self.accumulate_dtype, device=device)
            unit.grad_shard = unit.full_grad[mine]
        else:
            unit.grad_shard = torch.zeros(unit.shard_numel, dtype=self.accumulate_dtype, device=device)
        for i, (p, offset) in enumerate(zip(unit.params, unit.offsets)):
            p.data = unit.full_param[offset:offset + p.numel()].view(p.shape)
            if self.stage == 1 and not self._folds_grads():
                p.grad = unit.full_grad[offset:offset + p.numel()].view(p.shape)  # autograd accumulates in place
            span = unit.shard_range_of(i)
            if span is not None:
                if p.dim() >= 2:
                    unit.decay_segments.append(span)
                if not counts_here(p.shard_info, self.coords):
                    unit.uncounted_segments.append(span)
        unit.decay_segments = _merge(unit.decay_segments)
        if self.stage == 3:
            _free_storage(unit.full_param)  # the views stay; their storage has 0 bytes until gathered

    # ----------------------------------------------------------------------------------------------------
    # The layout protocol (train.ReplicatedUpdate's)
    # ----------------------------------------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        """Stage 1: accumulate full gradients locally. Stages 2/3 hold no full gradient: they reduce anyway."""
        previous, self.require_grad_sync = self.require_grad_sync, False
        try:
            yield
        finally:
            self.require_grad_sync = previous

    def _syncs_now(self) -> bool:
        return self.require_grad_sync or self.stage >= 2

    def _folds_grads(self) -> bool:
        """Stage 1 with a wider accumulator than the working dtype: autograd cannot accumulate into it (a .grad
        has its parameter's dtype), so every micro-batch's gradient is added into it here."""
        return self.stage == 1 and self.accumulate_dtype != self.param_dtype

    def _on_grad_ready(self, param: torch.Tensor):
        unit = self._unit_of[param]
        if self._folds_grads():  # every micro-batch, synchronised or not
            offset = self._offset_of[param]
            unit.full_grad[offset:offset + param.numel()].add_(param.grad.reshape(-1))
            param.grad = None
        if not self._syncs_now():
            return
        if self.stage >= 2:
            # Move the gradient into the unit's flat bucket and drop autograd's tensor right away.
            if unit.full_grad is None:
                unit.full_grad = torch.zeros(unit.padded_numel, dtype=self.param_dtype, device=param.device)
            offset = self._offset_of[param]
            unit.full_grad[offset:offset + param.numel()].copy_(param.grad.reshape(-1))
            param.grad = None
        unit.pending -= 1
        if unit.pending < 0:
            raise RuntimeError("a gradient arrived twice in one synchronised backward: at stage 1 run the backward "
                               "of accumulation micro-steps inside no_sync(), and call finish_grad_sync() each step")
        while self._next_to_launch < len(self.units) and self.units[self._next_to_launch].pending == 0:
            self._launch(self.units[self._next_to_launch])

    def _launch(self, unit: _Unit):
        """Reduce-scatter the unit's gradient bucket (async), in unit order: the same order on every rank."""
        if unit.full_grad is None:  # its parameters took no part in this backward: reduce zeros
            unit.full_grad = torch.zeros(unit.padded_numel, dtype=self.param_dtype, device=unit.grad_shard.device)
        if unit.dp_size == 1:  # a group of one (experts held whole, D = 1): the bucket is already the sum
            out, work = unit.full_grad, None
        else:
            out = torch.empty(unit.shard_numel, dtype=unit.full_grad.dtype, device=unit.full_grad.device)
            work = dist.reduce_scatter_single(out, unit.full_grad, op=dist.ReduceOp.SUM, group=unit.group,
                                              async_op=True)
        self._in_flight.append((unit, work, out))
        if self.stage >= 2:
            unit.full_grad = None  # the bucket is freed once the collective no longer needs it
        if self.stage == 3 and unit not in self.root:
            self._free([unit])  # every node reading these weights has run (their gradients are all here)
        unit.pending = len(unit.params)
        self._launched_this_step = True
        self._next_to_launch += 1
        if self._next_to_launch == len(self.units):
            self._next_to_launch = 0
        while self.stage >= 2 and len(self._in_flight) > 2:  # bound the buckets held by in-flight collectives
            self._complete_oldest()

    def _complete_oldest(self):
        unit, work, out = self._in_flight.pop(0)
        if work is not None:
            work.wait()
        if self.stage == 1:
            unit.grad_shard.copy_(out)  # full_grad holds the local sum; its own slice now the global one
        else:
            unit.grad_shard.add_(out)  # accumulate over micro-batches (in accumulate_dtype)

    def finish_grad_sync(self):
        """Launch the buckets whose gradients never arrived, then wait for every reduce-scatter."""
        # A backward left part-way (unused parameters), or at stage 1 none synchronised at all: finish the round.
        while self._next_to_launch != 0 or (self.stage == 1 and not self._launched_this_step):
            self._launch(self.units[self._next_to_launch])
        while self._in_flight:
            self._complete_oldest()
        self._launched_this_step = False

    def grad_pieces(self, params) -> list:
        """The segments of this rank's gradient shards that belong to `params` (views, in unit order).

        Ranks that hold the same parameters with the same shapes and the same dp rank (the members of a TP
        group) get the same segments, so an axis can sum them over its group in place: sequence parallel's
        replicated parameters see only their piece of the sequence, and their gradient is the sum over TP.
        """
        wanted = set(params)
        return [unit.grad_shard[lo:hi] for unit in self.units for i, p in enumerate(unit.params)
                if p in wanted and (span := unit.shard_range_of(i)) is not None for lo, hi in (span,)]

    def zero_grad(self):
        for unit in self.units:
            (unit.full_grad if self.stage == 1 else unit.grad_shard).zero_()

    def set_lr(self, lr: float):
        self.lr = lr

    @property
    def optimizer_step_count(self) -> int:
        return self.step_count

    @optimizer_step_count.setter
    def optimizer_step_count(self, value: int):
        self.step_count = int(value)

    @torch.no_grad()
    def step(self, scaler, clip: float, extra_nonfinite=None) -> StepResult:
        """optim.update on the master-dtype gradient shards, then AdamW on every shard and publish."""
        grads = [u.grad_shard.to(self.master_dtype) for u in self.units]  # the same tensors if dtypes agree
        # A shard counts whole unless it holds replicas another rank counts (TP's LayerNorms on tp rank > 0):
        # then only its other segments count.
        counted = [not u.uncounted_segments for u in self.units]
        pieces = [g[lo:hi] for u, g in zip(self.units, grads) if u.uncounted_segments
                  for lo, hi in _complement(u.uncounted_segments, u.shard_numel)]

        def adamw_and_publish():  # unit by unit: the all-gather of unit k (stages 1/2) overlaps unit k+1's update
            self.step_count += 1
            gathers = []
            for unit, grad in zip(self.units, grads):
                self._adamw(unit, grad)
                gathers.append(self._publish(unit))
            for work in gathers:
                if work is not None:
                    work.wait()

        return update(grads, counted, scaler, clip, adamw_and_publish, grads[0].device, counted_pieces=pieces,
                      extra_nonfinite=extra_nonfinite)

    def _adamw(self, unit: _Unit, grad: torch.Tensor):
        """torch.optim.AdamW (amsgrad off) on one shard: decoupled decay, moments, bias-corrected update."""
        beta1, beta2 = self.betas
        for lo, hi in unit.decay_segments if self.weight_decay else ():
            unit.master[lo:hi].mul_(1 - self.lr * self.weight_decay)
        unit.exp_avg.lerp_(grad, 1 - beta1)
        unit.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step_size = self.lr / (1 - beta1 ** self.step_count)
        denom = (unit.exp_avg_sq.sqrt() / math.sqrt(1 - beta2 ** self.step_count)).add_(self.eps)
        unit.master.addcdiv_(unit.exp_avg, denom, value=-step_size)

    def _publish(self, unit: _Unit):
        """Stage 1/2: launch the all-gather of the updated shard into every rank's full weights (async).
        Stage 3: refresh the working shard from the master (no message: weights are gathered at use)."""
        if self.stage == 3:
            if unit.master is not unit.param_shard:
                unit.param_shard.copy_(unit.master)
            return None
        if unit.dp_size == 1:  # the shard is the whole unit: no message
            if unit.master is not unit.param_shard:
                unit.param_shard.copy_(unit.master)
            return None
        # The input may not overlap the output: send a copy (the cast, or a clone of the aliased view).
        mine = unit.master.to(self.param_dtype, copy=True)
        return dist.all_gather_single(unit.full_param, mine, group=unit.group, async_op=True)

    # ----------------------------------------------------------------------------------------------------
    # Stage 3: gather before use, free after, prefetch the next unit
    # ----------------------------------------------------------------------------------------------------

    def _install_stage3_hooks(self):
        tf = self.module.transformer
        self.module.register_forward_pre_hook(self._forward_start)
        self.module.register_forward_hook(self._forward_end)
        for i, block in enumerate(self.blocks):
            block.register_forward_pre_hook(lambda mod, args, i=i: self._before_block(i))
            block.register_forward_hook(lambda mod, args, out, i=i: self._after_block(i, out))
        for head in (tf.ln_f, getattr(self.module, "lm_head", None)):
            if head is not None:
                head.register_forward_pre_hook(lambda mod, args: self._wait(self.root))

    # Each takes the units gathered together: block i's (`block_units[i]`: one per data-parallel group of its
    # parameters, dense and experts) or the root's.

    def _gather(self, units: list):
        """Allocate the units' full buffers and launch their all-gathers (async); no-op where already there."""
        for unit in units:
            if self._unsharded or unit.gathered:
                continue
            unit.full_param.untyped_storage().resize_(unit.padded_numel * unit.full_param.element_size())
            if unit.fp8 and not self._exact_gathers:  # E4M3 bytes, decoded into full_param in _wait
                shard_codes, unit.code_scales, unit.code_amax = self._encode(unit)
                if unit.dp_size == 1:  # a group of one: this rank's codes are the unit's
                    unit.codes = shard_codes
                else:
                    unit.codes = torch.empty(unit.padded_numel, dtype=torch.uint8, device=shard_codes.device)
                    unit.gather_work = dist.all_gather_single(unit.codes, shard_codes, group=unit.group,
                                                              async_op=True)
            elif unit.dp_size == 1:  # a group of one: the shard is the whole unit, no message
                unit.full_param.copy_(unit.param_shard)
            else:
                unit.gather_work = dist.all_gather_single(unit.full_param, unit.param_shard, group=unit.group,
                                                          async_op=True)
            unit.gathered = True
        alive = sum(any(u.gathered for u in units_) for units_ in (*self.block_units, self.root))
        self.peak_gathered_units = max(self.peak_gathered_units, alive)

    def _wait(self, units: list):
        self._gather(units)
        for unit in units:
            if unit.gather_work is not None:
                unit.gather_work.wait()
                unit.gather_work = None
            if unit.codes is not None:
                self._decode(unit)

    @torch.no_grad()
    def _encode(self, unit: _Unit):
        """This rank's shard of an FP8 unit as E4M3 bytes, each weight with ONE scale shared by every rank that
        holds a piece of it: the amax of its shard segments MAX-reduced over the unit's group (the whole
        weight), then over the linear's own amax groups (its TP/CP pieces); or, under delayed scaling with a
        history, the linear's scale. The Fp8Linear re-quantises the decoded weight to the same codes."""
        import fp8

        none = torch.zeros((), dtype=torch.float32, device=unit.param_shard.device)  # a rank without a piece
        amax = torch.stack([fp8.amax_of(unit.param_shard[lo:hi]) if hi > lo else none
                            for _, lo, hi in unit.fp8])  # float32, as the linear's own amax
        if unit.dp_size > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=unit.group)
        for group in unit.fp8[0][0].amax_groups:  # the same groups for every block linear
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        scales = []
        for (linear, _, _), value in zip(unit.fp8, amax):
            delayed = linear.recipe.mode == "delayed" and linear.history_ready
            scales.append(linear.scale[1] if delayed else  # exactly as the linear computes it
                          fp8.scale_from_amax(value, linear.fmt_max[1], linear.recipe.margin))
        codes = torch.zeros(unit.shard_numel, dtype=torch.uint8, device=unit.param_shard.device)
        for (_, lo, hi), scale in zip(unit.fp8, scales):
            if hi > lo:
                codes[lo:hi] = fp8.quantize_to_uint8(unit.param_shard[lo:hi], scale)
        return codes, scales, amax

    @torch.no_grad()
    def _decode(self, unit: _Unit):
        """The gathered E4M3 bytes → the working weights (q/scale), weight by weight; padding stays zero."""
        import fp8

        for p, offset, scale, (linear, _, _), amax in zip(unit.params, unit.offsets, unit.code_scales, unit.fp8,
                                                          unit.code_amax):  # an FP8 unit holds weights only
            unit.full_param[offset:offset + p.numel()] = fp8.dequantize_from_uint8(
                unit.codes[offset:offset + p.numel()], scale, unit.full_param.dtype)
            # The linear scales with this amax, not the decoded weight's (q/s, within a rounding of it): the
            # same scale as the codes', so re-quantising gives the codes back and the GEMM uses exactly s.
            linear.gathered_weight_amax = amax
        unit.codes, unit.code_scales = None, None

    def _free(self, units: list):
        for unit in units:
            if self._unsharded or not unit.gathered:
                continue
            if unit.gather_work is not None:
                unit.gather_work.wait()
                unit.gather_work = None
            unit.codes, unit.code_scales = None, None  # gathered but never used (evaluation's last block)
            for linear, _, _ in unit.fp8:
                linear.gathered_weight_amax = None
            _free_storage(unit.full_param)
            unit.gathered = False

    def _forward_start(self, module, args):
        self._wait(self.root)  # embeddings: nothing to overlap with yet
        self._gather(self.block_units[0])

    def _before_block(self, i: int):
        self._wait(self.block_units[i])
        if i == 0:
            self._free(self.root)  # the embedding lookups are done; the head regathers it
        self._gather(self.block_units[i + 1] if i + 1 < len(self.blocks) else self.root)  # prefetch

    def _after_block(self, i: int, out):
        last = i == len(self.blocks) - 1
        if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad, i=i: self._before_block_backward(i))
            if last:
                return  # backward starts with this block: keep it
        self._free(self.block_units[i])

    def _forward_end(self, module, args, out):
        if not torch.is_grad_enabled():  # evaluation: no backward will free what is still gathered
            self._free(self.block_units[-1])
            self._free(self.root)

    def _before_block_backward(self, i: int):
        if i == len(self.blocks) - 1:
            self._free(self.root)  # the head's and ln_f's backward (the only readers of its weights) are done
        self._wait(self.block_units[i])
        if i > 0:
            self._gather(self.block_units[i - 1])  # prefetch: overlaps block i's backward

    def unshard(self):
        """Gather every unit for good (e.g. to sample after training): collective, every rank calls it."""
        if self.stage == 3:
            self._free(self.units)  # an FP8-gathered unit is regathered exactly
            self._exact_gathers = True
            self._wait(self.units)
            self._unsharded = True

    # ----------------------------------------------------------------------------------------------------
    # Accounting
    # ----------------------------------------------------------------------------------------------------

    @property
    def padded_numel(self) -> int:
        """Ψ': the parameter count with every unit padded to a multiple of D."""
        return sum(u.padded_numel for u in self.units)

    @property
    def numel(self) -> int:
        return sum(u.numel for u in self.units)

    def bytes_per_param(self) -> mfu.BytesPerParam:
        """b_w, b_g, b_o of this layout (b_g: the persistent gradient, in accumulate_dtype; b_o: two moments,
        plus the master unless it aliases the weights)."""
        b_w, b_g, b_m = (dtype.itemsize for dtype in (self.param_dtype, self.accumulate_dtype, self.master_dtype))
        return mfu.BytesPerParam(weights=b_w, grads=b_g, optimizer=2 * b_m + (0 if self.param_dtype ==
                                                                              self.master_dtype else b_m))

    def _units_of(self, group_name: str) -> list:
        return [u for u in self.units if u.group_name == group_name]

    def predicted_persistent(self, padded: bool = True) -> dict:
        """mfu.persistent_bytes of each data-parallel group's units (Ψ'_g over D_g), added up."""
        out = {"weights": 0.0, "grads": 0.0, "optimizer": 0.0, "total": 0.0}
        for name, group in self.groups.items():
            units = self._units_of(name)
            if units:
                psi = sum(u.padded_numel if padded else u.numel for u in units)
                part = mfu.persistent_bytes(psi, self.bytes_per_param(), self.stage, dist.get_world_size(group))
                out = {kind: out[kind] + part[kind] for kind in out}
        return out

    def held_bytes(self) -> dict:
        """What this rank actually holds for the whole run (gathered stage-3 units and buckets are transient)."""
        def nbytes(t):
            return t.numel() * t.element_size()

        weights = sum(nbytes(u.param_shard if self.stage == 3 else u.full_param) for u in self.units)
        grads = sum(nbytes(u.full_grad if self.stage == 1 else u.grad_shard) for u in self.units)
        optimizer = sum(nbytes(u.exp_avg) + nbytes(u.exp_avg_sq) for u in self.units)
        optimizer += sum(nbytes(u.master) for u in self.units if u.master is not u.param_shard)
        return {"weights": weights, "grads": grads, "optimizer": optimizer, "total": weights + grads + optimizer}

    def peak_lower_bound(self) -> float:
        """Persistent bytes + the transient buffers the schedule cannot avoid (activations apart; docstring, 2).

        stage 1: + max(b_g, b_w)·Ψ'/D: the reduce-scatter outputs, then the all-gather inputs, of every unit;
        stage 2: + max(b_w·2U, b_w·Ψ'/D): two full gradient buckets in flight, then the all-gather inputs;
        stage 3: + b_w·2U (the unit in use and the prefetched one) + b_w·(U_root + 2U) (the root's gradient
                 bucket fills during the whole backward, and two block buckets are in flight).
        (U: the largest unit, or block's units together at stage 3; Ψ'/D: this rank's shards, Σ S. The
        buckets of stages 2/3 hold one backward's gradients: working dtype, b_w, whatever b_g is.)
        """
        b = self.bytes_per_param()
        b_bucket = self.reduce_dtype.itemsize  # stage 1: b_g; stages 2/3: b_w
        shards = sum(u.shard_numel for u in self.units)
        persistent = self.predicted_persistent()["total"]
        if self.stage == 3:
            largest = max(sum(u.padded_numel for u in units) for units in self.block_units)
            root = sum(u.padded_numel for u in self.root)
            return persistent + 2 * b.weights * largest + b_bucket * (root + 2 * largest)
        largest = max(u.padded_numel for u in self.units)
        if self.stage == 2:
            return persistent + max(2 * b_bucket * largest, b.weights * shards)
        return persistent + max(b_bucket, b.weights) * shards

    def _gathers(self, unit: _Unit) -> int:
        """Stage 3 gathers of a unit per micro-batch: the root twice in forward (embedding, tied head), a block
        once in forward and once in backward, except the last block (kept from its forward into backward)."""
        return 2 if unit in self.root or unit not in self.block_units[-1] else 1

    def predicted_comm(self, micro_batches: int, group_name: str = "dp_cp") -> dict:
        """Payload bytes M per step per collective over one data-parallel group (docstring, 3). Stage 3 gathers
        FP8 weights as one byte per element. Gradients travel in reduce_dtype: stage 1's accumulator (b_g),
        stages 2/3's per-micro-batch buckets (b_w)."""
        b_w, b_r = self.param_dtype.itemsize, self.reduce_dtype.itemsize
        units = self._units_of(group_name)
        psi = sum(u.padded_numel for u in units)
        if self.stage == 3:
            gathered = sum(self._gathers(u) * u.padded_numel * (1 if u.fp8 else b_w) for u in units)
            return {"all_gather_single": micro_batches * gathered,
                    "reduce_scatter_single": micro_batches * b_r * psi}
        reduces = micro_batches if self.stage == 2 else 1
        return {"all_gather_single": b_w * psi, "reduce_scatter_single": reduces * b_r * psi}

    def predicted_messages(self, micro_batches: int) -> dict:
        """{(op, group): (calls, payload)} per step: predicted_comm with its calls, for every group of size > 1."""
        out = {}
        for name, group in self.groups.items():
            units = self._units_of(name)
            alone = dist.get_world_size(group) == 1  # a group of one sends nothing (its shard is the unit)
            if self.stage == 3:  # each FP8 gather first agrees on the weights' scales (over TP/CP even when alone)
                for unit in (u for u in units if u.fp8):
                    for group_name in (() if alone else (name,)) + tuple(unit.fp8[0][0].amax_group_names):
                        c, p = out.get(("all_reduce", group_name), (0, 0))
                        n = micro_batches * self._gathers(unit)
                        out[("all_reduce", group_name)] = (c + n, p + n * 4 * len(unit.fp8))
            if not units or alone:
                continue
            if self.stage == 3:
                calls = {"all_gather_single": micro_batches * sum(self._gathers(u) for u in units),
                         "reduce_scatter_single": micro_batches * len(units)}
            else:
                calls = {"all_gather_single": len(units),
                         "reduce_scatter_single": len(units) * (micro_batches if self.stage == 2 else 1)}
            for op, payload in self.predicted_comm(micro_batches, name).items():
                out[(op, name)] = (calls[op], payload)
        return out

    def startup_lines(self, micro_batches: int) -> list:
        return self.accounting_lines(micro_batches, self.numel)

    def end_lines(self, tracer, steps: int) -> list:
        return [f"  ZeRO-{self.stage} peak lower bound {mfu.format_bytes(self.peak_lower_bound())}"
                + (f"; gathered blocks alive at once: {self.peak_gathered_units} (bound: 2, in use + prefetched)"
                   if self.stage == 3 else "")]

    def accounting_lines(self, micro_batches: int, psi: int) -> list:
        """The start-up printout: predicted persistent bytes next to held, peak bound, predicted comm."""
        b, D = self.bytes_per_param(), self.dp_size
        formula = {1: "(b_w+b_g)Ψ + b_oΨ/D", 2: "b_wΨ + (b_g+b_o)Ψ/D", 3: "(b_w+b_g+b_o)Ψ/D"}[self.stage]
        exact = mfu.persistent_bytes(psi, b, self.stage, D)
        padded, held = self.predicted_persistent(), self.held_bytes()
        sizes = ", ".join(f"{name} D={dist.get_world_size(g)}" for name, g in self.groups.items() if self._units_of(name))
        name = mfu.format_dtype
        lines = [f"ZeRO stage {self.stage} over {sizes}: {name(self.param_dtype)} working weights and micro-batch"
                 f" grads, {name(self.accumulate_dtype)} accumulated grads, {name(self.reduce_dtype)} reduce-scatter,"
                 f" {name(self.master_dtype)} optimizer (b_w={b.weights}, b_g={b.grads}, b_o={b.optimizer});"
                 f" {len(self.units)} units, Ψ={psi:,}, padded Ψ'={self.padded_numel:,}",
                 f"persistent bytes per rank, {formula}:  predicted(Ψ, D={D}) / predicted(Ψ'_g, D_g) / held"]
        for kind in ("weights", "grads", "optimizer", "total"):
            lines.append(f"  {kind:<9} {mfu.format_bytes(exact[kind]):>12} {mfu.format_bytes(padded[kind]):>12}"
                         f" {mfu.format_bytes(held[kind]):>12}")
        lines.append(f"peak lower bound per rank (persistent + transient buffers, activations apart):"
                     f" {mfu.format_bytes(self.peak_lower_bound())}")
        lines.append("messages: reduce_scatter of the gradients overlaps backward; the all_gather of unit k"
                     " overlaps the update of unit k+1" if self.stage < 3 else
                     "messages: each block's all_gather is prefetched behind the previous block's compute;"
                     " exposed: the root and block 0 at the start of forward, the root's reduce_scatter at the end")
        return lines

    # ----------------------------------------------------------------------------------------------------
    # Checkpoint state
    # ----------------------------------------------------------------------------------------------------

    def state_pieces(self) -> list:
        """One StatePiece per logical tensor and kind; tensors are live views (loading copies into them)."""
        pieces = []
        for unit in self.units:
            for i, p in enumerate(unit.params):
                name, info = p.shard_info.global_name, p.shard_info
                # A TP-replicated tensor (LayerNorm, row-parallel bias) is identical on every TP rank:
                # only TP rank 0's copy is written.
                written_here = counts_here(info, self.coords)
                span = unit.shard_range_of(i)
                if self.stage < 3:
                    pieces.append(StatePiece(f"param/{name}", p.data, info, None,
                                             primary=unit.dp_rank == 0 and written_here))
                if span is None:
                    continue
                lo, hi = span
                flat_range = (unit.shard_start + lo - unit.offsets[i], unit.shard_start + hi - unit.offsets[i])
                if self.stage == 3:
                    pieces.append(StatePiece(f"param/{name}", unit.param_shard[lo:hi], info, flat_range,
                                             primary=written_here))
                for kind, tensor in (("master", unit.master), ("exp_avg", unit.exp_avg),
                                     ("exp_avg_sq", unit.exp_avg_sq)):
                    pieces.append(StatePiece(f"{kind}/{name}", tensor[lo:hi], info, flat_range, primary=written_here))
        return pieces

    @torch.no_grad()
    def full_parameters(self) -> dict:
        """{global name: full local tensor} of the working weights (collective at stage 3; for tests, sampling)."""
        out = {}
        for unit in self.units:
            if self.stage == 3:
                was_gathered = unit.gathered
                self._wait([unit])
            for p in unit.params:
                out[p.shard_info.global_name] = p.detach().clone()
            if self.stage == 3 and not was_gathered:
                self._free([unit])
        return out


def _complement(segments: list, n: int) -> list:
    """[lo, hi) ranges of [0, n) not covered by the sorted, disjoint `segments`."""
    out, start = [], 0
    for lo, hi in sorted(segments):
        if lo > start:
            out.append((start, lo))
        start = max(start, hi)
    return out + [(start, n)] if start < n else out


def _free_storage(t: torch.Tensor):
    t.untyped_storage().resize_(0)


def _merge(segments: list) -> list:
    """Join touching [lo, hi) segments: fewer, longer in-place ops."""
    out = []
    for lo, hi in sorted(segments):
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def _by_group(params: list, codecs: dict) -> list:
    """The parameters split by data-parallel group and by whether they are gathered in FP8, in first-seen
    order: [[dense...], [dense FP8 weights...], [experts...]]."""
    out = {}
    for p in params:
        out.setdefault((grad_group(p), p in codecs), []).append(p)
    return list(out.values())
