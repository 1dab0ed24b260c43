"""ZeRO stages 1, 2 and 3 from raw collectives: shard optimizer state, then gradients, then parameters.

Plain data parallel (stage 0) keeps D identical copies of everything. ZeRO (Rajbhandari et al. 2020) keeps
the same arithmetic but gives each of the D ranks of the data group (dp×cp) one 1/D slice of the state:

    stage 1: the optimizer state (master weights + both Adam moments) is sharded;
    stage 2: + the gradients (reduce-scattered in buckets during backward; full gradients freed at once);
    stage 3: + the working parameters (all-gathered per block just before use, freed after).

The flat layout. Parameters are packed into UNITS (`Unit`), flat buffers: stage 1/2 units are gradient
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
axis, such as TP's LayerNorms, counts on coordinate 0 of that axis: shard.counts_here) → clip → all step or all skip.
A matrix optimizer (`ZeroConfig.matrices`: Muon, optimizers/zero_muon.py) puts the blocks' 2-D weights in units of
its own and steps them in that order; their bytes and messages are its docstring's, added to the formulas below.

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

Stage 3 (parallel/zero3.py, `Zero3Layout`: this layout plus module hooks) gathers each block's weights just before use
and frees them after, prefetching the next block behind the current one's compute; FP8 weights travel as one byte
per element through their gather codec. Stages 1 and 2 are this file alone. Under a pipeline, stages 2 and 3
are parallel/zero_pipeline.py's subclasses: units per chunk, each chunk's step sum reduce-scattered once at its last
backward, stage 3's gathers driven by the schedule's actions.

Accounting (Ψ parameters (Ψ' padded), D = size of the dp×cp group, b_w/b_g/b_o bytes per parameter for working
weights / persistent gradients / optimizer state, m micro-batches per step, U the largest unit):
1. Replicated vs split. Stage 1: weights and gradients replicated, optimizer state split in D. Stage 2:
   weights replicated; gradients and optimizer state split. Stage 3: everything split. The batch is split.
2. Persistent bytes per rank (`predicted_persistent()`; `held_bytes()` measures it; memory.persistent_bytes):
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
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from ddp import OrderedReductions, assert_same_across_groups, grad_group, reverse_order_buckets
from optim import StepResult, update
from shard import StatePiece, counts_here, describe, set_value
from step import Messages


# ---------------------------------------------------------------------------------------------------------
# What each rank keeps of b_w + b_g + b_o bytes per parameter (docstring item 2; accounting/memory.py's formula)
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BytesPerParam:
    weights: int  # b_w
    grads: int  # b_g
    optimizer: int  # b_o: everything Adam keeps per parameter (moments, and any fp32 master copy)


@dataclass(frozen=True)
class ZeroConfig:
    """Everything a ZeroLayout is built with besides the model, its groups and this rank's coordinates."""

    stage: int  # 1: optimizer state sharded, 2: + gradients, 3: + weights (zero3.Zero3Layout)
    lr: float
    weight_decay: float = 0.1
    betas: tuple = (0.9, 0.95)
    eps: float = 1e-8
    param_dtype: torch.dtype = torch.float32  # working weights and each backward's gradients (b_w)
    master_dtype: torch.dtype = torch.float32  # master weights and Adam's moments
    bucket_mb: float = 25.0  # stages 1/2: the size of a unit (a gradient bucket), in the working dtype
    micro_batches: int = 1  # m, the micro-batches each step accumulates
    accumulate_dtype: torch.dtype | None = None  # the sum over them; None: master_dtype when m > 1, else param_dtype
    matrices: object = None  # a matrix optimizer over ZeRO (optimizers/zero_muon.py's ZeroMuon); None: AdamW only

    def __post_init__(self):
        if self.stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {self.stage} (stage 0 is ddp.py + DDPLayout)")


@dataclass(frozen=True)
class ZeroFacts:
    """What the accounting reads of a ZeRO layout (`ZeroLayout.facts`): report/axes.py's zero section and
    planner/time_model.py. Ψ, Ψ', b and D as in the docstring."""

    stage: int
    dp_size: int  # D, the ranks of the dense parameters' group (dp×cp)
    group_sizes: dict  # {data-parallel group name: D_g}, the groups that hold units
    units: int  # the flat units (stages 1/2: gradient buckets; stage 3: the root's and each block's)
    numel: int  # Ψ
    padded_numel: int  # Ψ', every unit padded to a multiple of its D_g
    bytes_per_param: BytesPerParam  # b_w, b_g, b_o
    dtypes: dict  # {"param" | "accumulate" | "reduce" | "master": torch.dtype}
    peak_lower_bound: float  # persistent + the transient buffers (bytes, activations apart)
    last_reduce_numel: int  # the elements reduce-scattered after backward: the last unit (stage 3: the root's)
    first_gather_numel: int  # stage 3: the root's and block 0's, gathered before the first compute; else 0
    peak_gathered_units: int = 0  # stage 3: the most blocks gathered at once so far
    gathered_bound: int = 2  # stage 3: the most the schedule may hold (in use + prefetched)
    pipeline_note: str = ""  # under a pipeline (zero_pipeline.py): how its gradients are reduced, what that holds
    step_transient_predicted: float = 0.0  # under a pipeline: gathered chunks + accumulating gradients (bytes)
    step_transient_measured: float = 0.0  # the same, the most the layout's buffers held at once so far
    muon: object = None  # a matrix optimizer's figures (optimizers/muon.py's MuonFacts), or None


class Unit:
    """One flat, padded buffer of parameters: what is gathered, reduce-scattered and stepped together. The record
    and each buffer mean the same at every stage, a buffer None where a stage has none (ZeroLayout._build_unit).
    Its collectives are its methods: a matrix optimizer's units (optimizers/zero_muon.py) send otherwise."""

    optimizer = "adamw"  # what steps its shard: ZeroLayout._adamw (a matrix unit's: the layout's `matrices`)

    def __init__(self, params: list, groups: dict, codec=None):
        self.params, self.group_name = params, grad_group(params[0])  # "dp_cp" or "expert_dp"
        self.group = groups[self.group_name]
        self.codec = codec  # stage 3: the weights' gather codec (their `gather_codec`), or None
        self.dp_size, self.dp_rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        sizes = [p.numel() for p in params]
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]  # flat offset of each parameter
        self.numel = sum(sizes)  # n
        self.bounds = self.shard_bounds()  # rank r's slice of the [n'] buffer: [r·S, (r+1)·S), S = ⌈n/D⌉
        self.padded_numel = self.bounds[-1][1]  # n' = S·D
        self.shard_start, end = self.bounds[self.dp_rank]  # this rank owns [start, start + S)
        self.shard_numel = end - self.shard_start  # S
        self.mine = slice(self.shard_start, end)  # its [S] of an [n'] buffer
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
        self.exp_avg = self.exp_avg_sq = None  # [S] master: Adam's moments (init_state)
        self.grad_sum = None  # [n'] accumulate, stage 1: this rank's gradient, summed over the step
        self.bucket = None  # [n'] working, stages 2/3: one backward's gradients, until reduce-scattered
        self.grad_shard = None  # [S] accumulate: this slice's reduced gradient, AdamW's input (stage 1: grad_sum's)
        self.pending = len(params)  # gradients still to arrive in this backward
        self.state = "freed"  # stage 3: "freed" (0 bytes) | "gathering" (all-gather launched) | "gathered"
        self.gather_work = self.codes = self.decoding = None  # the all-gather, a codec's codes [n'] and decoding

    def packed(self, dtype: torch.dtype) -> torch.Tensor:
        """The parameters' current values in one flat [n'] buffer of `dtype` (the padding zero)."""
        flat = torch.zeros(self.padded_numel, dtype=dtype, device=self.params[0].device)
        for p, offset in zip(self.params, self.offsets):
            flat[offset:offset + p.numel()] = p.detach().reshape(-1)
        return flat

    def shard_bounds(self) -> list:
        """[(start, end)] of each rank's slice of the [n'] buffer: equal slices of S = ⌈n/D⌉."""
        size = -(-self.numel // self.dp_size)
        return [(r * size, (r + 1) * size) for r in range(self.dp_size)]

    def init_state(self, dtype: torch.dtype) -> None:
        """AdamW's moments of this shard, zero (in the master dtype)."""
        self.exp_avg, self.exp_avg_sq = torch.zeros(2, self.shard_numel, dtype=dtype, device=self.master.device)

    def optimizer_state(self) -> list:
        """[(kind, [S] buffer)] of what AdamW keeps for this shard."""
        return [("master", self.master), ("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)]

    def reduce_scatter(self, full: torch.Tensor):
        """(this rank's [S] slice of Σ_ranks full, the async work): one reduce_scatter_single of the [n'] buffer."""
        out = torch.empty(self.shard_numel, dtype=full.dtype, device=full.device)
        return out, dist.reduce_scatter_single(out, full, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

    def all_gather(self, target: torch.Tensor, source: torch.Tensor):
        """Every rank's [S] `source` into the [n'] `target` (async; the two may not overlap)."""
        return dist.all_gather_single(target, source, group=self.group, async_op=True)

    def messages(self, kind: str, itemsize: int, times: int = 1) -> Messages:
        """`times` "gather"s (all_gather_single) or "reduce"s (reduce_scatter_single) of the [n'] buffer."""
        op = {"gather": "all_gather_single", "reduce": "reduce_scatter_single"}[kind]
        return Messages({(op, self.group_name): (times, times * itemsize * self.padded_numel)})

    def flat_pieces(self, i: int, kinds: list, primary: bool) -> list:
        """Parameter i's part of this rank's [S] buffers `kinds` [(kind, tensor)] as StatePieces of flat ranges of
        the logical tensor (none where the shard misses it)."""
        (lo, hi), p, offset = self.spans[i], self.params[i], self.offsets[i]
        flat_range = (self.shard_start + lo - offset, self.shard_start + hi - offset)
        return [StatePiece(f"{kind}/{p.shard_info.global_name}", tensor[lo:hi], p.shard_info, flat_range,
                           primary=primary) for kind, tensor in kinds if hi > lo]


class ZeroLayout(OrderedReductions):
    """ZeRO stage 1 or 2 (`config.stage`; stage 3 is the subclass zero3.Zero3Layout) over each parameter's
    data-parallel group: `groups` {"dp_cp": ..., "expert_dp": ...} (default: the world for dp_cp). step.train_step
    drives it (optim.Layout's protocol). `module` must hold the same initial values on every rank (checked).
    Parameters may be TP-local shards (with `shard_info`), flattened as the local tensors they are. `coords`
    (Mesh.coordinates()): this rank's index along the model axes (which replicated copies count: TP rank 0's
    LayerNorms, ...)."""

    name = "zero"  # its lines are report/axes.py's section of that name
    stages = (1, 2)  # the stages this class runs

    def __init__(self, module: nn.Module, config: ZeroConfig, groups: dict | None = None, coords: dict | None = None,
                 update_group=None):
        if config.stage not in self.stages:
            raise ValueError(f"{type(self).__name__} runs ZeRO stage {' or '.join(map(str, self.stages))}, got"
                             f" {config.stage} (stages 1/2: zero.ZeroLayout, stage 3: zero3.Zero3Layout)")
        self.module, self.config, self.stage = module, config, config.stage
        self.update_group = update_group  # the norm's all-reduce: the world (None) or a DiLoCo replica
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

    def _check_records(self, module: nn.Module, params: list):
        describe(module)  # a plain module's parameters: whole tensors, named as the module names them
        for p in params:
            if p.shard_info.grad_group not in self.groups:
                raise ValueError(f"{p.shard_info.global_name} reduces over {p.shard_info.grad_group!r}, which was"
                                 f" not given to ZeroLayout")
            missing = set(p.shard_info.replicated_over) - set(self.coords)
            if missing:
                raise ValueError(f"{p.shard_info.global_name} is replicated over {sorted(missing)}: pass coords")

    def _build_units(self, module: nn.Module, params: list) -> list:
        """The units in launch order: reverse-order buckets of about bucket_mb in the working dtype."""
        # A tensor with a copy on another pipeline stage (the tied embedding) gets a unit of its own: both
        # stages then shard it alike, and its gradient pieces can be summed across them.
        alone = [p for p in params if "pp" in p.shard_info.replicated_over]
        rest = [p for p in params if id(p) not in {id(q) for q in alone}]
        buckets = reverse_order_buckets(rest, int(self.config.bucket_mb * 2**20), self.param_dtype.itemsize)
        return [unit for members in buckets + [[p] for p in alone] if members for unit in self._units(members)]

    def _units(self, params: list, codec=None) -> list:
        """The unit of `params`; with a matrix optimizer (`config.matrices`), its AdamW unit and its matrices'."""
        matrices = self.config.matrices
        return [Unit(params, self.groups, codec)] if matrices is None else matrices.units(params, self.groups, codec)

    def _build_unit(self, unit: Unit):
        """Fill the unit's buffers: weights and master (`_pack_weights`), moments, gradients; point the parameters
        at their views and record which segments of the shard decay and which the norm counts."""
        self._pack_weights(unit)
        device = unit.master.device
        unit.init_state(self.master_dtype)
        if self.stage == 1:
            unit.grad_sum = torch.zeros(unit.padded_numel, dtype=self.accumulate_dtype, device=device)
            unit.grad_shard = unit.grad_sum[unit.mine]
        else:
            unit.grad_shard = torch.zeros(unit.shard_numel, dtype=self.accumulate_dtype, device=device)
        for p, offset, (lo, hi) in zip(unit.params, unit.offsets, unit.spans):
            set_value(p, unit.weights[offset:offset + p.numel()].view(p.shape))
            if self.stage == 1 and not self._folds_grads:
                p.grad = unit.grad_sum[offset:offset + p.numel()].view(p.shape)  # autograd accumulates in place
            if hi > lo and p.dim() >= 2:
                unit.decay_segments.append((lo, hi))
        unit.decay_segments = _merge(unit.decay_segments)
        self._count(unit)

    def _count(self, unit: Unit):
        """Which segments of the unit's shard the norm counts (shard.counts_here) and which it skips."""
        unit.counted_segments, unit.uncounted_segments = [], []
        for p, (lo, hi) in zip(unit.params, unit.spans):
            if hi > lo:
                segments = unit.counted_segments if counts_here(p.shard_info, self.coords) else unit.uncounted_segments
                segments.append((lo, hi))
        unit.counted_segments = _merge(unit.counted_segments)

    def recount(self) -> None:
        """Count again after an axis moved copies between parameters (experts/eplb.py's re-plan renames them)."""
        for unit in self.units:
            self._count(unit)

    def _pack_weights(self, unit: Unit):
        """The parameters' initial values packed: the [n'] working weights, this rank's working slice (a view of
        them) and its master slice (the master dtype, from the full-precision init)."""
        flat = unit.packed(self.master_dtype)
        unit.weights = flat.to(self.param_dtype, copy=True)
        unit.weight_shard = unit.weights[unit.mine]
        unit.master = unit.weight_shard if self.param_dtype == self.master_dtype else flat[unit.mine].clone()

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
        self.arrived(unit, self.units, "at stage 1 run the backward of accumulation micro-steps inside no_sync(),"
                                       " and call finish_grad_sync() each step")

    def _launch(self, unit: Unit):
        """Reduce-scatter the unit's gradients (async), in unit order: the same order on every rank."""
        full = unit.grad_sum if self.stage == 1 else unit.bucket
        if full is None:  # its parameters took no part in this backward: reduce zeros
            full = torch.zeros(unit.padded_numel, dtype=self.reduce_dtype, device=unit.grad_shard.device)
        if unit.dp_size == 1:  # a group of one (experts held whole, D = 1): the full gradient is the sum
            out, work = full, None
        else:
            out, work = unit.reduce_scatter(full)
        self._in_flight.append((unit, work, out))
        unit.bucket = None  # freed once the collective no longer needs it
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

    # --- The update: AdamW on this rank's shard, then the updated shard all-gathered

    @torch.no_grad()
    def step(self, scaler, clip: float, extra_nonfinite=None) -> StepResult:
        """optim.update on the master-dtype gradient shards, then AdamW on every shard and publish."""
        grads = [u.grad_shard.to(self.master_dtype) for u in self.units]  # the same tensors if dtypes agree
        # A shard counts whole unless it holds replicas another rank counts (TP's LayerNorms on tp rank > 0):
        # then only its other parameters' segments count (the padding is zero).
        counted = [not u.uncounted_segments for u in self.units]
        pieces = [g[lo:hi] for u, g in zip(self.units, grads) if u.uncounted_segments for lo, hi in u.counted_segments]

        def adamw_and_publish():  # unit by unit: the all-gather of unit k overlaps unit k+1's update
            self.optimizer_step_count += 1
            gathers = []
            for unit, grad in zip(self.units, grads):  # a matrix unit: its optimizer's (optimizers/zero_muon.py)
                self._adamw(unit, grad) if unit.optimizer == "adamw" else self.config.matrices.update(self, unit, grad)
                gathers.append(self._publish(unit))
            for work in (work for work in gathers if work is not None):
                work.wait()

        return update(grads, counted, scaler, clip, adamw_and_publish, grads[0].device, counted_pieces=pieces,
                      extra_nonfinite=extra_nonfinite, group=self.update_group)

    def _adamw(self, unit: Unit, grad: torch.Tensor, master: torch.Tensor | None = None):
        """torch.optim.AdamW (amsgrad off) on one shard: decoupled decay, moments, bias-corrected update. master:
        where the master weights are updated (default the unit's; parallel/offload.py: a host copy)."""
        beta1, beta2 = self.config.betas
        master = unit.master if master is None else master
        for lo, hi in unit.decay_segments if self.config.weight_decay else ():
            master[lo:hi].mul_(1 - self.lr * self.config.weight_decay)
        unit.exp_avg.lerp_(grad, 1 - beta1)
        unit.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        t = self.optimizer_step_count
        step_size = self.lr / (1 - beta1 ** t)
        denom = (unit.exp_avg_sq.sqrt() / math.sqrt(1 - beta2 ** t)).add_(self.config.eps)
        master.addcdiv_(unit.exp_avg, denom, value=-step_size)

    def _publish(self, unit: Unit):
        """The updated master → the working weights: all-gathered into every rank's full weights (async); a group
        of one refreshes its working slice, no message."""
        if unit.dp_size > 1:
            # The input may not overlap the output: send a copy (the cast, or a clone of the aliased view).
            return unit.all_gather(unit.weights, unit.master.to(self.param_dtype, copy=True))
        if unit.master is not unit.weight_shard:
            unit.weight_shard.copy_(unit.master)
        return None

    # --- The rest of the layout protocol (optim.Layout)

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

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
        """One StatePiece per logical tensor and kind; tensors are live views (loading copies into them): the whole
        working weight (written by dp rank 0), then this rank's flat ranges of the optimizer's."""
        pieces = []
        for unit in self.units:
            for i, p in enumerate(unit.params):
                written_here = counts_here(p.shard_info, self.coords)  # a TP-replicated tensor: TP rank 0's copy only
                pieces.append(StatePiece(f"param/{p.shard_info.global_name}", p.data, p.shard_info, None,
                                         primary=unit.dp_rank == 0 and written_here))
                pieces += unit.flat_pieces(i, unit.optimizer_state(), written_here)
        return pieces

    @torch.no_grad()
    def full_parameters(self) -> dict:
        """{global name: a copy of the full local working tensor}, between steps (for tests)."""
        return {p.shard_info.global_name: p.detach().clone() for unit in self.units for p in unit.params}

    # --- Accounting: the docstring's formulas (report/run.py prints them next to what was measured)

    @property
    def padded_numel(self) -> int:
        """Ψ': the parameter count with every unit padded to a multiple of D."""
        return sum(u.padded_numel for u in self.units)

    @property
    def numel(self) -> int:
        return sum(u.numel for u in self.units)

    def units_of(self, group_name: str) -> list:
        return [u for u in self.units if u.group_name == group_name]

    def bytes_per_param(self) -> BytesPerParam:
        """b_w, b_g, b_o of this layout (b_g: the persistent gradient, in accumulate_dtype; b_o: two moments,
        plus the master unless it aliases the weights)."""
        b_w, b_g, b_m = (dtype.itemsize for dtype in (self.param_dtype, self.accumulate_dtype, self.master_dtype))
        return BytesPerParam(weights=b_w, grads=b_g,
                                 optimizer=2 * b_m + (0 if self.param_dtype == self.master_dtype else b_m))

    def predicted_persistent(self, padded: bool = True) -> dict:
        """The partition formula of each data-parallel group's units (Ψ'_g over D_g), added up; a matrix optimizer's
        units add their own (optimizers/zero_muon.py)."""
        out = {"weights": 0.0, "grads": 0.0, "optimizer": 0.0, "total": 0.0}
        if self.config.matrices is not None:
            out = self.config.matrices.persistent(self, padded)
        for name, group in self.groups.items():
            units = [u for u in self.units_of(name) if u.optimizer == "adamw"]
            if units:
                psi = sum(u.padded_numel if padded else u.numel for u in units)
                b, d = self.bytes_per_param(), dist.get_world_size(group)  # docstring, 2: split from stage 3, 2, 1
                part = {kind: getattr(b, kind) * psi / (d if self.stage >= first else 1)
                        for kind, first in (("weights", 3), ("grads", 2), ("optimizer", 1))}
                part["total"] = part["weights"] + part["grads"] + part["optimizer"]
                out = {kind: out[kind] + part[kind] for kind in out}
        return out

    def held_bytes(self) -> dict:
        """What this rank actually holds for the whole run (buckets are transient)."""
        weights = sum(u.weights.nbytes for u in self.units)
        grads = sum((u.grad_sum if self.stage == 1 else u.grad_shard).nbytes for u in self.units)
        optimizer = sum(t.nbytes for u in self.units for _, t in u.optimizer_state() if t is not u.weight_shard)
        return {"weights": weights, "grads": grads, "optimizer": optimizer, "total": weights + grads + optimizer}

    def peak_lower_bound(self) -> float:
        """Persistent bytes + the transient buffers the schedule cannot avoid (activations apart; docstring, 2).
        U: the largest unit; Ψ'/D: this rank's shards, Σ S."""
        b = self.bytes_per_param()
        b_bucket = self.reduce_dtype.itemsize  # stage 1: b_g; stage 2: b_w
        shards = sum(u.shard_numel for u in self.units)
        persistent = self.predicted_persistent()["total"]
        largest = max(u.padded_numel for u in self.units)
        if self.stage == 2:
            return persistent + max(2 * b_bucket * largest, b.weights * shards)
        return persistent + max(b_bucket, b.weights) * shards

    def facts(self) -> ZeroFacts:
        dtypes = {"param": self.param_dtype, "accumulate": self.accumulate_dtype, "reduce": self.reduce_dtype,
                  "master": self.master_dtype}
        sizes = {name: dist.get_world_size(group) for name, group in self.groups.items() if self.units_of(name)}
        return ZeroFacts(self.stage, self.dp_size, sizes, len(self.units), self.numel, self.padded_numel,
                         self.bytes_per_param(), dtypes, self.peak_lower_bound(), self.units[-1].padded_numel, 0,
                         muon=self.config.matrices.facts(self) if self.config.matrices is not None else None)

    def predicted_messages(self, micro_batches: int) -> Messages:
        """Per step over each data-parallel group of size > 1 (docstring item 3): each unit's reduce-scatter (m
        times at stage 2, once at stage 1) and the all-gather of its updated shard."""
        m, b_w, b_r, out = micro_batches, self.param_dtype.itemsize, self.reduce_dtype.itemsize, Messages()
        reduces = m if self.stage == 2 else 1
        for name, group in self.groups.items():
            if dist.get_world_size(group) == 1:  # one rank: its shard is the unit, nothing to send
                continue
            for unit in self.units_of(name):
                out = out + unit.messages("gather", b_w) + unit.messages("reduce", b_r, reduces)
        return out + (self.config.matrices.messages(self) if self.config.matrices is not None else Messages())


def _merge(segments: list) -> list:
    """Join touching [lo, hi) segments: fewer, longer in-place ops."""
    out = []
    for lo, hi in sorted(segments):
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out
