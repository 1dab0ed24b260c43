"""ZeRO stages 1, 2 and 3 from raw collectives: shard optimizer state, then gradients, then parameters.

Plain data parallel (stage 0) keeps D identical copies of everything. ZeRO (Rajbhandari et al. 2020) keeps
the same arithmetic but gives each of the D ranks of the data group (dp×cp) one 1/D slice of the state:

    stage 1: the optimizer state (master weights + both Adam moments) is sharded;
    stage 2: + the gradients (reduce-scattered in buckets during backward; full gradients freed at once);
    stage 3: + the working parameters (all-gathered per block just before use, freed after).

The flat layout. Parameters are packed into UNITS (`_Unit`), flat buffers: stage 1/2 units are gradient
buckets of about `bucket_mb` MiB, in reverse registration order (roughly the order backward produces them);
stage 3 units are the transformer blocks plus one "root" unit holding the rest (embeddings, tied head, final
LayerNorm). A unit of n elements is padded to n' = ⌈n/D⌉·D and rank r owns the contiguous slice [r·S, (r+1)·S),
S = n'/D; the padding is zero and stays zero (its gradient is zero: Adam never moves it). Ψ' = Σ n' ≤ Ψ +
units·(D-1) is the padded parameter count: every formula below holds exactly with Ψ' (within that padding with
Ψ). Each unit is sharded over its parameters' data-parallel group (grad_group: dp×cp, or expert_dp).

The update on a shard is torch.optim.AdamW's, element for element: decoupled decay p ← p·(1 - lr·wd) on the tensors of
dim ≥ 2 (kept as [start, end) segments of the shard), then m ← β1·m + (1-β1)·g, v ← β2·v + (1-β2)·g²,
p ← p - lr/(1-β1^t) · m / (√v/√(1-β2^t) + ε). The rest follows DESIGN.md's order, through optim.update: reduce →
unscale → all ranks finite? → global norm = √(Σ_world Σ_shard g²) (the padding is zero; a tensor replicated over a model
axis, such as TP's LayerNorms, counts on coordinate 0 of that axis: model.counts_here) → clip → all step or all skip.

Mixed precision. Working parameters and each backward's gradients are `param_dtype` (bf16 under --dtype bf16:
b_w = 2), the optimizer keeps `master_dtype` master weights and moments (fp32: b_o = 4 + 4 + 4 = 12): at m = 1
(b_g = 2) the paper's 2 + 2 + 12 = 16 bytes per parameter, at m > 1 (b_g = 4, below) 2 + 4 + 12. Equal dtypes
(fp32 runs, the float64 tests): the master IS the working shard (no third copy), b_o = 8 with fp32.

Gradient accumulation. Stage 1 sums full gradients locally under `no_sync()` and reduces once per step, like DDP;
stages 2/3 hold no full gradient, so every micro-batch's backward reduce-scatters its buckets into the gradient shard
(m times per step, as in FSDP). With m > 1 the sum is kept in the master dtype (`accumulate_dtype`, as Megatron's
main_grad): a bf16 sum of m terms rounds m times and its error grows with m (bench/bench_zero_accum.py); at m = 1
nothing is summed. On the wire (`reduce_dtype`): stage 1 sends its fp32 sum once per step; stages 2/3 each
micro-batch's bf16 bucket, added into the fp32 shard (as DeepSpeed: one rounding per term, none on the running sum).

How stage 3 overlaps (module hooks: the model stays untouched). Each unit's full buffer is allocated once and every
parameter's `.data` is a view into it; "free" shrinks its storage to 0 bytes, "gather" grows it back and all-gathers
into it, so the views (and the tensors autograd saved) stay valid. Forward: the model's pre-hook gathers the root
(embeddings) and prefetches block 0; block i's pre-hook waits for block i, frees the root after the embedding (i = 0)
and launches block i+1's gather (after the last block: the root, for the tied head) while block i computes; its
post-hook frees it, except the last block, which backward needs first. Backward: a hook on block i's output (fired
before block i's backward) waits for block i, launches block i-1's gather, and (i = L-1) frees the root, whose readers
(head, ln_f) are done. Once all of a unit's gradients are in its bucket (post-accumulate-grad hooks), it is
reduce-scattered (async) and the unit freed: every node reading a weight has run before autograd accumulates its
gradient. Autograd runs a ready AccumulateGrad before any other ready node, so block i+1 is freed before block i's
backward hook prefetches block i-1: at most two units are gathered at once (`peak_gathered_units`; tested, with the
order of gathers). Under --compile the hooks stay eager (model.compile_blocks compiles each block's forward, not its
call). A parameter with a `gather_codec` (fp8.convert gives one to each FP8 weight) shares a unit with its codec's
other weights, gathered as uint8 codes: `codec.encode` before the all-gather, `codec.decode` after.

Accounting (Ψ parameters (Ψ' padded), D = size of the dp×cp group, b_w/b_g/b_o bytes per parameter for working
weights / persistent gradients / optimizer state, m micro-batches per step, U the largest unit):
1. Replicated vs split. Stage 1: weights and gradients replicated, optimizer state split in D. Stage 2:
   weights replicated; gradients and optimizer state split. Stage 3: everything split. The batch is split.
2. Persistent bytes per rank (memory.persistent_bytes, `predicted_persistent()`; `held_bytes()` measures it):
     stage 1: (b_w + b_g)·Ψ' + b_o·Ψ'/D;  stage 2: b_w·Ψ' + (b_g + b_o)·Ψ'/D;  stage 3: (b_w + b_g + b_o)·Ψ'/D.
   Transient on top (`peak_lower_bound()`, activations apart): stage 1 max(b_g, b_w)·Ψ'/D (the reduce-scatter
   outputs, then the all-gather inputs); stage 2 max(b_w·2U, b_w·Ψ'/D) (2 buckets in flight, or the all-gather
   inputs); stage 3 b_w·2U (in use + prefetched) + b_w·(U_root + 2U) (the root's bucket fills all backward).
   Start-up at stage 3 (a meta model): the largest of one logical tensor G (its fp32 sample, cast, and piece:
   G·(4 + b_o) + L·b_o at most) and one unit's working buffer b_w·n' (allocated for its views, shrunk at once).
3. Messages on the critical path per step over dp×cp (`predicted_messages(m)`; M = payload, wire = (D-1)/D·M):
       stage 1: reduce_scatter b_g·Ψ' (overlapping backward) + all_gather b_w·Ψ' = 2Ψ (unit k's all-gather is
       launched once unit k is updated: it overlaps the update of unit k+1);
       stage 2: m × reduce_scatter b_w·Ψ' (overlapped) + all_gather b_w·Ψ' = 2Ψ for m = 1;
       stage 3: m × [all_gather b_w·(2Ψ' - U_last) + reduce_scatter b_w·Ψ'] = the paper's 3Ψ, less the root
       and the last block in backward (`_gathers`), plus the root's second gather in forward (the tied head).
       Exposed: the root's and block 0's gathers at the start of forward, the root's reduce-scatter at the end of
       backward. A unit with a codec gathers 1 byte per element instead of b_w, plus per gather the codec's messages
       (FP8's scale agreement: a MAX all_reduce of 4 bytes per weight over the unit's group and TP/CP).
   Plus the update's 16-byte all-reduce over the world (optim.update: squared norm, non-finite count) and, with SP,
   one all-reduce over TP of this shard's part of the SP-replicated gradients (TensorParallel.after_grad_sync).
4. Restart state (`state_pieces()`): per logical tensor the working weights (`param/`: stages 1/2 the full tensor,
   written by dp rank 0; stage 3 this rank's flat range), this rank's flat range of `master/`, `exp_avg/`,
   `exp_avg_sq/`, and `optimizer_step_count` (Adam's t). Flat ranges exclude the padding: they reload on any D.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

import memory
from comm import Messages
from ddp import assert_same_across_groups, grad_group, reverse_order_buckets
from model import ShardInfo, StatePiece, counts_here, initial_local, set_value
from optim import StepResult, update


class _Unit:
    """One flat, padded buffer of parameters: what is gathered, reduce-scattered and stepped together. The record
    and each buffer mean the same at every stage, a buffer None where a stage has none (ZeroLayout._build_unit)."""

    def __init__(self, params: list, group, group_name: str, codec):
        self.params, self.group, self.group_name = params, group, group_name  # "dp_cp" or "expert_dp"
        self.codec = codec  # stage 3: the weights' gather codec (their `gather_codec`), or None
        self.dp_size, self.dp_rank = dist.get_world_size(group), dist.get_rank(group)
        sizes = [p.numel() for p in params]
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]  # flat offset of each parameter
        self.numel = sum(sizes)  # n
        self.shard_numel = -(-self.numel // self.dp_size)  # S = ⌈n/D⌉
        self.padded_numel = self.shard_numel * self.dp_size  # n' = S·D
        self.shard_start = self.dp_rank * self.shard_numel  # this rank owns [start, start + S)
        # Parameter i's part of the shard as [lo, hi) offsets into it (lo == hi: the shard misses it).
        self.spans = [(min(max(o - self.shard_start, 0), self.shard_numel),
                       min(max(o + n - self.shard_start, 0), self.shard_numel)) for o, n in zip(self.offsets, sizes)]
        self.decay_segments = []  # [(lo, hi)] of the shard that get weight decay (dim ≥ 2), merged
        self.uncounted_segments = []  # [(lo, hi)] of the shard the global norm skips (replicas counted elsewhere)
        self.counted_segments = []  # [(lo, hi)] of the other parameters (what the norm counts when some are not)
        # The buffers ([n'] or [S] elements, in the working, master or accumulate dtype):
        self.weights = None  # [n'] working: the full weights the parameters view (stage 3: allocated while gathered)
        self.weight_shard = None  # [S] working: this rank's slice (stages 1/2: a view of `weights`; 3: kept alone)
        self.master = None  # [S] master: AdamW's weights (the working slice itself when the dtypes agree)
        self.exp_avg = self.exp_avg_sq = None  # [S] master: Adam's moments
        self.grad_sum = None  # [n'] accumulate, stage 1: this rank's gradient, summed over the step
        self.bucket = None  # [n'] working, stages 2/3: one backward's gradients, until reduce-scattered
        self.grad_shard = None  # [S] accumulate: this slice's reduced gradient, AdamW's input (stage 1: grad_sum's)
        self.pending = len(params)  # gradients still to arrive in this backward
        self.state = "freed"  # stage 3: "freed" (0 bytes) | "gathering" (all-gather launched) | "gathered"
        self.gather_work = self.codes = self.decoding = None  # the all-gather, a codec's codes [n'] and decoding


class ZeroLayout:
    """ZeRO stage `config.stage` over each parameter's data-parallel group: `groups` {"dp_cp": ..., "expert_dp": ...}
    (default: the world for dp_cp). step.train_step drives it (optim.Layout's protocol). `module` must hold the same
    initial values on every rank (checked), or at stage 3 be a meta model.GPT with a `device` (train.compose;
    `_fill_shard`); at stage 3 a model.GPT (its `transformer.h` blocks are gathered one at a time). Parameters may be
    TP-local shards (with `shard_info`), flattened as the local tensors they are. `coords` (Mesh.coordinates()): this
    rank's index along the model axes (which replicated copies count: TP rank 0's LayerNorms, ...)."""

    name = "zero"  # its lines are report.py's section of that name

    # --- Gradients: each unit's bucket is reduce-scattered (async, in unit order) into this rank's shard

    def _on_grad_ready(self, param: torch.Tensor):
        unit = self._unit_of[param]
        offset, n = self._offset_of[param], param.numel()
        if self._folds_grads:  # every micro-batch, synchronised or not
            unit.grad_sum[offset:offset + n].add_(param.grad.reshape(-1))
            param.grad = None
        if not (self.require_grad_sync or self.stage >= 2):
            return
        if self.stage >= 2:  # move the gradient into the unit's flat bucket and drop autograd's tensor right away
            if unit.bucket is None:
                unit.bucket = torch.zeros(unit.padded_numel, dtype=self.param_dtype, device=param.device)
            unit.bucket[offset:offset + n].copy_(param.grad.reshape(-1))
            param.grad = None
        unit.pending -= 1
        if unit.pending < 0:
            raise RuntimeError("a gradient arrived twice in one synchronised backward: at stage 1 run the backward "
                               "of accumulation micro-steps inside no_sync(), and call finish_grad_sync() each step")
        while self._next_to_launch < len(self.units) and self.units[self._next_to_launch].pending == 0:
            self._launch(self.units[self._next_to_launch])

    def _launch(self, unit: _Unit):
        """Reduce-scatter the unit's gradients (async), in unit order: the same order on every rank."""
        full = unit.grad_sum if self.stage == 1 else unit.bucket
        if full is None:  # its parameters took no part in this backward: reduce zeros
            full = torch.zeros(unit.padded_numel, dtype=self.param_dtype, device=unit.grad_shard.device)
        if unit.dp_size == 1:  # a group of one (experts held whole, D = 1): the full gradient is the sum
            out, work = full, None
        else:
            out = torch.empty(unit.shard_numel, dtype=full.dtype, device=full.device)
            work = dist.reduce_scatter_single(out, full, op=dist.ReduceOp.SUM, group=unit.group, async_op=True)
        self._in_flight.append((unit, work, out))
        unit.bucket = None  # freed once the collective no longer needs it
        if self.stage == 3 and unit not in self.root:
            self._free([unit])  # every node reading these weights has run (their gradients are all here)
        unit.pending = len(unit.params)
        self._launched_this_step = True
        self._next_to_launch = (self._next_to_launch + 1) % len(self.units)
        while self.stage >= 2 and len(self._in_flight) > 2:  # bound the buckets held by in-flight collectives
            self._complete_oldest()

    def _complete_oldest(self):
        unit, work, out = self._in_flight.pop(0)
        if work is not None:
            work.wait()
        if self.stage == 1:
            unit.grad_shard.copy_(out)  # grad_sum holds the local sum; its own slice now the global one
        else:
            unit.grad_shard.add_(out)  # summed over the micro-batches (in accumulate_dtype)

    def finish_grad_sync(self):
        """Launch the buckets whose gradients never arrived, then wait for every reduce-scatter."""
        # A backward left part-way (unused parameters), or at stage 1 none synchronised at all: finish the round.
        while self._next_to_launch != 0 or (self.stage == 1 and not self._launched_this_step):
            self._launch(self.units[self._next_to_launch])
        while self._in_flight:
            self._complete_oldest()
        self._launched_this_step = False

    # --- The update: AdamW on this rank's shard, then the updated shard all-gathered (stages 1/2)

    @torch.no_grad()
    def step(self, scaler, clip: float, extra_nonfinite=None) -> StepResult:
        """optim.update on the master-dtype gradient shards, then AdamW on every shard and publish."""
        grads = [u.grad_shard.to(self.master_dtype) for u in self.units]  # the same tensors if dtypes agree
        # A shard counts whole unless it holds replicas another rank counts (TP's LayerNorms on tp rank > 0):
        # then only its other parameters' segments count (the padding is zero).
        counted = [not u.uncounted_segments for u in self.units]
        pieces = [g[lo:hi] for u, g in zip(self.units, grads) if u.uncounted_segments for lo, hi in u.counted_segments]

        def adamw_and_publish():  # unit by unit: the all-gather of unit k (stages 1/2) overlaps unit k+1's update
            self.optimizer_step_count += 1
            gathers = []
            for unit, grad in zip(self.units, grads):
                self._adamw(unit, grad)
                gathers.append(self._publish(unit))
            for work in (work for work in gathers if work is not None):
                work.wait()

        return update(grads, counted, scaler, clip, adamw_and_publish, grads[0].device, counted_pieces=pieces,
                      extra_nonfinite=extra_nonfinite)

    def _adamw(self, unit: _Unit, grad: torch.Tensor):
        """torch.optim.AdamW (amsgrad off) on one shard: decoupled decay, moments, bias-corrected update."""
        beta1, beta2 = self.config.betas
        for lo, hi in unit.decay_segments if self.config.weight_decay else ():
            unit.master[lo:hi].mul_(1 - self.lr * self.config.weight_decay)
        unit.exp_avg.lerp_(grad, 1 - beta1)
        unit.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        t = self.optimizer_step_count
        step_size = self.lr / (1 - beta1 ** t)
        denom = (unit.exp_avg_sq.sqrt() / math.sqrt(1 - beta2 ** t)).add_(self.config.eps)
        unit.master.addcdiv_(unit.exp_avg, denom, value=-step_size)

    def _publish(self, unit: _Unit):
        """The updated master → the working weights. Stages 1/2: all-gather it into every rank's full weights
        (async). Stage 3 (or a group of one): refresh the working slice, no message (weights gather at use)."""
        if self.stage < 3 and unit.dp_size > 1:
            # The input may not overlap the output: send a copy (the cast, or a clone of the aliased view).
            return dist.all_gather_single(unit.weights, unit.master.to(self.param_dtype, copy=True),
                                          group=unit.group, async_op=True)
        if unit.master is not unit.weight_shard:
            unit.weight_shard.copy_(unit.master)
        return None

    # --- Stage 3: gather before use, free after, prefetch the next; each takes block i's units or the root's

    def _gather(self, units: list, exact: bool = False):
        """Allocate the units' full buffers and launch their all-gathers (async); no-op where already there. A
        unit with a codec sends its shard's codes (uint8, one byte per element; decoded in _wait), unless
        `exact` (full_parameters: the working weights themselves)."""
        for unit in units:
            if unit.state != "freed":
                continue
            unit.weights.untyped_storage().resize_(unit.padded_numel * unit.weights.element_size())
            source, target = unit.weight_shard, unit.weights
            if unit.codec is not None and not exact:
                codes, unit.decoding = unit.codec.encode(unit.params, [source[lo:hi] for lo, hi in unit.spans],
                                                         unit.group)
                source = torch.zeros(unit.shard_numel, dtype=torch.uint8, device=source.device)  # padding: 0
                for (lo, hi), piece in zip(unit.spans, codes):
                    source[lo:hi] = piece
                target = unit.codes = torch.empty(unit.padded_numel, dtype=torch.uint8, device=source.device)
            if unit.dp_size == 1:  # a group of one: the shard is the whole unit, no message
                target.copy_(source)
            else:
                unit.gather_work = dist.all_gather_single(target, source, group=unit.group, async_op=True)
            unit.state = "gathering"
        if not exact:  # the schedule's peak (full_parameters gathers every unit)
            alive = sum(any(u.state != "freed" for u in units_) for units_ in (*self.block_units, self.root))
            self.peak_gathered_units = max(self.peak_gathered_units, alive)

    def _wait(self, units: list, exact: bool = False):
        """Gather the units where needed and wait until their working weights are there (decoded)."""
        self._gather(units, exact)
        for unit in (u for u in units if u.state == "gathering"):
            if unit.gather_work is not None:
                unit.gather_work.wait()
                unit.gather_work = None
            if unit.codec is not None:  # codes None: the working weights themselves were gathered (exactly)
                unit.codec.decode(unit.params, None if unit.codes is None else _views(unit, unit.codes),
                                  _views(unit, unit.weights), unit.decoding)
            unit.codes = unit.decoding = None
            unit.state = "gathered"

    def _free(self, units: list):
        for unit in units:
            if unit.state == "freed":
                continue
            if unit.gather_work is not None:  # gathered but never used (evaluation's last prefetch)
                unit.gather_work.wait()
                unit.gather_work = None
            unit.codes = unit.decoding = None
            unit.weights.untyped_storage().resize_(0)
            unit.state = "freed"

    def _forward_start(self, module, args):
        self._wait(self.root)  # embeddings: nothing to overlap with yet
        self._gather(self.block_units[0])

    def _before_block(self, i: int):
        self._wait(self.block_units[i])
        if i == 0:
            self._free(self.root)  # the embedding lookups are done; the head regathers it
        self._gather(self.block_units[i + 1] if i + 1 < len(self.blocks) else self.root)  # prefetch

    def _after_block(self, i: int, out):
        if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad, i=i: self._before_block_backward(i))
            if i == len(self.blocks) - 1:
                return  # backward starts with this block: keep it
        self._free(self.block_units[i])

    def _forward_end(self, module, args, out):
        if not torch.is_grad_enabled():  # evaluation: no backward will free what is still gathered
            self._free(self.block_units[-1] + self.root)

    def _before_block_backward(self, i: int):
        if i == len(self.blocks) - 1:
            self._free(self.root)  # the head's and ln_f's backward (the only readers of its weights) are done
        self._wait(self.block_units[i])
        if i > 0:
            self._gather(self.block_units[i - 1])  # prefetch: overlaps block i's backward

    @torch.no_grad()
    def full_parameters(self) -> dict:
        """{global name: a copy of the full local working tensor}, between steps. At stage 3 a collective: each
        unit gathered exactly (a unit with a codec too), copied and freed again (for tests)."""
        out = {}
        for unit in self.units:
            if self.stage == 3:
                self._free([unit])
                self._wait([unit], exact=True)
            out.update({p.shard_info.global_name: p.detach().clone() for p in unit.params})
            if self.stage == 3:
                self._free([unit])
        return out

    # --- Construction

    def __init__(self, module: nn.Module, config: ZeroConfig, groups: dict | None = None, coords: dict | None = None,
                 device=None):
        self.module, self.config, self.stage = module, config, config.stage
        self.device = device  # stage 3 of a meta module (train.compose): where its shards are filled from the init
        self.groups = {"dp_cp": None, **(groups or {})}  # name → process group (None: the world)
        self.dp_size = dist.get_world_size(self.groups["dp_cp"])
        self.coords = dict(coords or {})
        self.lr = config.lr  # set_lr changes it every step
        self.param_dtype, self.master_dtype = config.param_dtype, config.master_dtype
        self.accumulate_dtype = config.accumulate_dtype or (
            config.master_dtype if config.micro_batches > 1 else config.param_dtype)
        # What a gradient reduce-scatter sends: stage 1 its sum, once per step; stages 2/3 each micro-batch's bucket.
        self.reduce_dtype = self.accumulate_dtype if self.stage == 1 else self.param_dtype
        # Stage 1 with a wider sum than the working dtype: autograd cannot accumulate into it (a .grad has its
        # parameter's dtype), so _on_grad_ready adds every micro-batch's gradient into it.
        self._folds_grads = self.stage == 1 and self.accumulate_dtype != self.param_dtype
        self.optimizer_step_count = 0  # Adam's t (a checkpoint restores it)
        self.require_grad_sync = True
        self.peak_gathered_units = 0
        self._in_flight = []  # [(unit, work, output)] reduce-scatters launched, not yet added to grad shards
        self._next_to_launch, self._launched_this_step = 0, False

        params = [p for p in module.parameters() if p.requires_grad]
        self._check_records(module, params)
        assert_same_across_groups(params, self.groups)
        self.units = self._build_units(module, params)
        self._unit_of = {p: u for u in self.units for p in u.params}  # tensors hash by identity
        self._offset_of = {p: o for u in self.units for p, o in zip(u.params, u.offsets)}
        with torch.no_grad():
            for unit in self.units:
                self._build_unit(unit)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]
        if self.stage == 3:
            self._install_stage3_hooks()

    def _check_records(self, module: nn.Module, params: list):
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

    def _build_units(self, module: nn.Module, params: list) -> list:
        """The units in launch order. Stages 1/2: reverse-order buckets of about bucket_mb in the working dtype.
        Stage 3: per block, one unit per data-parallel group and codec (`block_units[i]`), last block first, then
        the root's (the rest)."""
        def unit(members):
            codec = getattr(members[0], "gather_codec", None) if self.stage == 3 else None
            return _Unit(members, self.groups[grad_group(members[0])], grad_group(members[0]), codec)

        if self.stage < 3:
            # A tensor with a copy on another pipeline stage (the tied embedding) gets a unit of its own: both
            # stages then shard it alike, and its gradient pieces can be summed across them.
            alone = [p for p in params if "pp" in p.shard_info.replicated_over]
            rest = [p for p in params if id(p) not in {id(q) for q in alone}]
            buckets = reverse_order_buckets(rest, int(self.config.bucket_mb * 2**20), self.param_dtype.itemsize)
            return [unit(members) for members in buckets + [[p] for p in alone] if members]
        self.blocks = list(module.transformer.h)
        if not self.blocks:
            raise ValueError("ZeRO-3 gathers one transformer block at a time: the model needs n_layer ≥ 1")
        in_block = {id(p) for b in self.blocks for p in b.parameters()}
        self.block_units = [[unit(m) for m in _by_group_and_codec([p for p in b.parameters() if p.requires_grad])]
                            for b in self.blocks]
        self.root = [unit(m) for m in _by_group_and_codec([p for p in params if id(p) not in in_block])]
        return [u for units in reversed(self.block_units) for u in units] + self.root

    def _build_unit(self, unit: _Unit):
        """Pack the unit's initial values, keep this rank's master shard, point the parameters at the buffers.
        Stage 3 of a meta module with a `device` packs nothing: _fill_shard builds this rank's slice alone."""
        device = unit.params[0].device
        mine = slice(unit.shard_start, unit.shard_start + unit.shard_numel)
        if self.stage == 3 and device.type == "meta" and self.device is not None:
            device = torch.device(self.device)
            unit.master = self._fill_shard(unit, device)
            unit.weight_shard = unit.master.to(self.param_dtype)  # the same tensor when the dtypes agree
            unit.weights = torch.empty(unit.padded_numel, dtype=self.param_dtype, device=device)  # shrunk below
        else:
            flat = torch.zeros(unit.padded_numel, dtype=self.master_dtype, device=device)
            for p, offset in zip(unit.params, unit.offsets):
                flat[offset:offset + p.numel()] = p.detach().reshape(-1)  # master from the full-precision init
            unit.weights = flat.to(self.param_dtype, copy=True)
            unit.weight_shard = unit.weights[mine].clone() if self.stage == 3 else unit.weights[mine]
            unit.master = unit.weight_shard if self.param_dtype == self.master_dtype else flat[mine].clone()
        unit.exp_avg, unit.exp_avg_sq = (torch.zeros(unit.shard_numel, dtype=self.master_dtype, device=device)
                                         for _ in range(2))
        if self.stage == 1:
            unit.grad_sum = torch.zeros(unit.padded_numel, dtype=self.accumulate_dtype, device=device)
            unit.grad_shard = unit.grad_sum[mine]
        else:
            unit.grad_shard = torch.zeros(unit.shard_numel, dtype=self.accumulate_dtype, device=device)
        for p, offset, (lo, hi) in zip(unit.params, unit.offsets, unit.spans):
            set_value(p, unit.weights[offset:offset + p.numel()].view(p.shape))
            if self.stage == 1 and not self._folds_grads:
                p.grad = unit.grad_sum[offset:offset + p.numel()].view(p.shape)  # autograd accumulates in place
            if hi > lo and p.dim() >= 2:
                unit.decay_segments.append((lo, hi))
            if hi > lo:
                segments = unit.counted_segments if counts_here(p.shard_info, self.coords) else unit.uncounted_segments
                segments.append((lo, hi))
        unit.decay_segments, unit.counted_segments = _merge(unit.decay_segments), _merge(unit.counted_segments)
        if self.stage == 3:
            unit.weights.untyped_storage().resize_(0)  # the views stay; their storage has 0 bytes until gathered

    def _fill_shard(self, unit: _Unit, device) -> torch.Tensor:
        """This rank's [S] master slice of a unit whose parameters are still meta, from each one's initial value
        (model.initial_local, cut by its ShardInfo): the transient is one logical tensor; the padding is zero."""
        shard = torch.zeros(unit.shard_numel, dtype=self.master_dtype, device=device)
        for p, offset, (lo, hi) in zip(unit.params, unit.offsets, unit.spans):
            if hi > lo:
                start = unit.shard_start + lo - offset  # the slice's first element, within p
                value = initial_local(p.shard_info, self.module.config, self.module.seed, p.dtype).reshape(-1)
                shard[lo:hi] = value[start:start + hi - lo]
        return shard

    def _install_stage3_hooks(self):
        self.module.register_forward_pre_hook(self._forward_start)
        self.module.register_forward_hook(self._forward_end)
        for i, block in enumerate(self.blocks):
            block.register_forward_pre_hook(lambda mod, args, i=i: self._before_block(i))
            block.register_forward_hook(lambda mod, args, out, i=i: self._after_block(i, out))
        for head in (self.module.transformer.ln_f, getattr(self.module, "lm_head", None)):
            if head is not None:
                head.register_forward_pre_hook(lambda mod, args: self._wait(self.root))

    # --- The rest of the layout protocol (optim.Layout)

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

    def grad_pieces(self, params) -> list:
        """The segments of this rank's gradient shards that belong to `params` (views, in unit order), alike on every
        TP rank (same parameters, shapes and dp rank): an axis can sum them over TP in place (SP)."""
        wanted = set(params)
        return [unit.grad_shard[lo:hi] for unit in self.units for p, (lo, hi) in zip(unit.params, unit.spans)
                if p in wanted and hi > lo]

    def zero_grad(self):
        for unit in self.units:
            (unit.grad_sum if self.stage == 1 else unit.grad_shard).zero_()

    def set_lr(self, lr: float):
        self.lr = lr

    def state_pieces(self) -> list:
        """One StatePiece per logical tensor and kind; tensors are live views (loading copies into them)."""
        pieces = []
        for unit in self.units:
            for p, offset, (lo, hi) in zip(unit.params, unit.offsets, unit.spans):
                name, info = p.shard_info.global_name, p.shard_info
                written_here = counts_here(info, self.coords)  # a TP-replicated tensor: TP rank 0's copy only
                if self.stage < 3:
                    pieces.append(StatePiece(f"param/{name}", p.data, info, None,
                                             primary=unit.dp_rank == 0 and written_here))
                if hi == lo:
                    continue
                flat_range = (unit.shard_start + lo - offset, unit.shard_start + hi - offset)
                kinds = [("master", unit.master), ("exp_avg", unit.exp_avg), ("exp_avg_sq", unit.exp_avg_sq)]
                for kind, tensor in [("param", unit.weight_shard)] * (self.stage == 3) + kinds:
                    pieces.append(StatePiece(f"{kind}/{name}", tensor[lo:hi], info, flat_range, primary=written_here))
        return pieces

    # --- Accounting: the docstring's formulas (report.py prints them next to what was measured)

    @property
    def padded_numel(self) -> int:
        """Ψ': the parameter count with every unit padded to a multiple of D."""
        return sum(u.padded_numel for u in self.units)

    @property
    def numel(self) -> int:
        return sum(u.numel for u in self.units)

    def units_of(self, group_name: str) -> list:
        return [u for u in self.units if u.group_name == group_name]

    def bytes_per_param(self) -> memory.BytesPerParam:
        """b_w, b_g, b_o of this layout (b_g: the persistent gradient, in accumulate_dtype; b_o: two moments,
        plus the master unless it aliases the weights)."""
        b_w, b_g, b_m = (dtype.itemsize for dtype in (self.param_dtype, self.accumulate_dtype, self.master_dtype))
        return memory.BytesPerParam(weights=b_w, grads=b_g,
                                 optimizer=2 * b_m + (0 if self.param_dtype == self.master_dtype else b_m))

    def predicted_persistent(self, padded: bool = True) -> dict:
        """memory.persistent_bytes of each data-parallel group's units (Ψ'_g over D_g), added up."""
        out = {"weights": 0.0, "grads": 0.0, "optimizer": 0.0, "total": 0.0}
        for name, group in self.groups.items():
            units = self.units_of(name)
            if units:
                psi = sum(u.padded_numel if padded else u.numel for u in units)
                part = memory.persistent_bytes(psi, self.bytes_per_param(), self.stage, dist.get_world_size(group))
                out = {kind: out[kind] + part[kind] for kind in out}
        return out

    def held_bytes(self) -> dict:
        """What this rank actually holds for the whole run (gathered stage-3 units and buckets are transient)."""
        weights = sum((u.weight_shard if self.stage == 3 else u.weights).nbytes for u in self.units)
        grads = sum((u.grad_sum if self.stage == 1 else u.grad_shard).nbytes for u in self.units)
        optimizer = sum(u.exp_avg.nbytes + u.exp_avg_sq.nbytes for u in self.units)
        optimizer += sum(u.master.nbytes for u in self.units if u.master is not u.weight_shard)
        return {"weights": weights, "grads": grads, "optimizer": optimizer, "total": weights + grads + optimizer}

    def peak_lower_bound(self) -> float:
        """Persistent bytes + the transient buffers the schedule cannot avoid (activations apart; docstring, 2).
        U: the largest unit (stage 3: a block's units together); Ψ'/D: this rank's shards, Σ S."""
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

    def predicted_messages(self, micro_batches: int) -> Messages:
        """Per step over each data-parallel group of size > 1 (docstring item 3; stage 3: a unit's `_gathers` per
        micro-batch), plus each stage-3 gather's codec messages (also over the linears' TP/CP groups when D = 1)."""
        m, b_w, b_r, out = micro_batches, self.param_dtype.itemsize, self.reduce_dtype.itemsize, Messages()
        reduces = m if self.stage >= 2 else 1
        for name, group in self.groups.items():
            alone = dist.get_world_size(group) == 1  # one rank: its shard is the unit, nothing to send
            for unit in self.units_of(name):
                gathers = m * self._gathers(unit) if self.stage == 3 else 1
                if unit.codec is not None:
                    out = out + unit.codec.encode_messages(unit.params, None if alone else name).times(gathers)
                if not alone:
                    b_gather = b_w if unit.codec is None else 1
                    out.add("all_gather_single", name, gathers, gathers * b_gather * unit.padded_numel)
                    out.add("reduce_scatter_single", name, reduces, reduces * b_r * unit.padded_numel)
        return out


@dataclass(frozen=True)
class ZeroConfig:
    """Everything a ZeroLayout is built with besides the model, its groups and this rank's coordinates."""

    stage: int  # 1: optimizer state sharded, 2: + gradients, 3: + weights
    lr: float
    weight_decay: float = 0.1
    betas: tuple = (0.9, 0.95)
    eps: float = 1e-8
    param_dtype: torch.dtype = torch.float32  # working weights and each backward's gradients (b_w)
    master_dtype: torch.dtype = torch.float32  # master weights and Adam's moments
    bucket_mb: float = 25.0  # stages 1/2: the size of a unit (a gradient bucket), in the working dtype
    micro_batches: int = 1  # m, the micro-batches each step accumulates
    accumulate_dtype: torch.dtype | None = None  # the sum over them; None: master_dtype when m > 1, else param_dtype

    def __post_init__(self):
        if self.stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {self.stage} (stage 0 is ddp.py + DDPLayout)")


def _views(unit: _Unit, flat: torch.Tensor) -> list:
    """Each parameter's 1-D range of a flat [n'] buffer of the unit."""
    return [flat[offset:offset + p.numel()] for p, offset in zip(unit.params, unit.offsets)]


def _merge(segments: list) -> list:
    """Join touching [lo, hi) segments: fewer, longer in-place ops."""
    out = []
    for lo, hi in sorted(segments):
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def _by_group_and_codec(params: list) -> list:
    """The parameters split by data-parallel group and by gather codec, in first-seen order (a MoE block with
    FP8 linears: [[dense...], [FP8 weights...], [experts...]])."""
    out = {}
    for p in params:
        out.setdefault((grad_group(p), getattr(p, "gather_codec", None)), []).append(p)
    return list(out.values())
