"""ZeRO stage 3: zero.py's layout with the working parameters sharded too, gathered per block just before use.

`Zero3Layout` is `zero.ZeroLayout` (the flat units, the gradient reduce-scatter, AdamW on the shard, the
checkpoint pieces) plus what stage 3 adds: units per transformer block, module hooks that gather and free them,
and the accounting of what that holds and sends. The model stays untouched.

Units. Each transformer block is one unit per data-parallel group and gather codec (`block_units[i]`), plus the
"root" (embeddings, tied head, final LayerNorm: everything else); launch order is the last block first, the root
last. Each unit's full [n'] buffer is allocated once and every parameter's `.data` is a view into it; "free"
shrinks its storage to 0 bytes, "gather" grows it back and all-gathers this rank's [S] working slice into it, so the
views (and the tensors autograd saved) stay valid. A meta model (train.compose) is filled shard by shard from the
per-parameter init (shard.initial_local): no rank ever holds a whole logical model.

The schedule (module hooks). Forward: the model's pre-hook gathers the root (embeddings) and prefetches block 0;
block i's pre-hook waits for block i, frees the root after the embedding (i = 0) and launches block i+1's gather
(after the last block: the root, for the tied head) while block i computes; its post-hook frees it, except the last
block, which backward needs first. Backward: a hook on block i's output (fired before block i's backward) waits for
block i, launches block i-1's gather, and (i = L-1) frees the root, whose readers (head, ln_f) are done. Once all of
a unit's gradients are in its bucket (post-accumulate-grad hooks), it is reduce-scattered (async) and the unit
freed: every node reading a weight has run before autograd accumulates its gradient. Autograd runs a ready
AccumulateGrad before any other ready node, so block i+1 is freed before block i's backward hook prefetches block
i-1: at most two units are gathered at once (`peak_gathered_units`; tested, with the order of gathers). Under
activation checkpointing (full or selective) backward reruns block i's forward, hooks included, after block i's
backward hook gathered it: those hooks see that they run inside a backward (`_recomputing`) and neither free nor
prefetch, so the recompute reads the unit gathered for block i's backward, and the peak stays two gathered units
(between its forward and its recompute a checkpointed block holds no weights: freed as without recompute). Under
--compile the hooks stay eager (model.compile_blocks compiles each block's forward, not its call). Under a pipeline
the interpreter calls the stage's pieces itself, in its schedule's order: zero_pipeline.PipelineZero3Layout replaces
these hooks (`_register_schedule_hooks`) with gathers per chunk around each action.

FP8 weights. A parameter with a `gather_codec` (fp8.convert gives one to each FP8 weight, precision.recipe.convert
to each NVFP4 weight with 16×16 tiles) shares a unit with its codec's other weights and is gathered as uint8 codes,
one byte per element: `codec.encode` (given each segment and its flat offset in its parameter) before the all-gather,
`codec.decode` after (`_start_gather` / `_finish_gather`, the only two places that know of codecs besides the
accounting).

Accounting (zero.py's symbols; its docstring gives all three stages side by side):
1. Replicated vs split: weights, gradients and optimizer state are all split in D; the batch is split.
2. Persistent bytes per rank: (b_w + b_g + b_o)·Ψ'/D. Transient: b_w·2U (in use + prefetched) + b_w·(U_root + 2U)
   (the root's bucket fills all backward). Start-up (a meta model): the largest of one logical tensor G (its fp32
   sample, cast and piece: G·(4 + b_o) + L·b_o at most) and one unit's working buffer b_w·n' (shrunk at once).
3. Messages per step over dp×cp: m × [all_gather b_w·(2Ψ' - U_last) + reduce_scatter b_w·Ψ'] = the paper's 3Ψ,
   less the root and the last block in backward (`_gathers`), plus the root's second gather in forward (the tied
   head). Exposed: the root's and block 0's gathers at the start of forward, the root's reduce-scatter at the end
   of backward. A unit with a codec gathers 1 byte per element instead of b_w, plus per gather the codec's
   messages (FP8's scale agreement: a MAX all_reduce of 4 bytes per weight over the unit's group and TP/CP).
4. Restart state: as zero.py's, with `param/` this rank's flat range of each working weight.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn as nn

from ddp import grad_group
from shard import counts_here, initial_local
from step import Messages
from zero import Unit, ZeroConfig, ZeroFacts, ZeroLayout


class Zero3Layout(ZeroLayout):
    """ZeRO stage 3 (`config.stage` must be 3) over a model.GPT: its `transformer.h` blocks are gathered one at a
    time. `module` holds the same initial values on every rank (checked), or is a meta model.GPT given a `device`
    to fill this rank's shards on (train.compose; `_fill_shard`). The rest as ZeroLayout."""

    stages = (3,)

    def __init__(self, module: nn.Module, config: ZeroConfig, groups: dict | None = None, coords: dict | None = None,
                 device=None):
        self.device = device  # a meta module (train.compose): where its shards are filled from the init
        self.peak_gathered_units = 0  # the most units gathered at once by the forward/backward schedule
        super().__init__(module, config, groups, coords)  # builds the units (below) and the gradient hooks
        self._register_schedule_hooks()

    def _register_schedule_hooks(self):
        """The schedule of gathers and frees as module hooks (below). Under a pipeline the interpreter drives it
        instead (parallel/zero_pipeline.py)."""
        self.module.register_forward_pre_hook(self._forward_start)
        self.module.register_forward_hook(self._forward_end)
        for i, block in enumerate(self.blocks):
            block.register_forward_pre_hook(lambda mod, args, i=i: self._before_block(i))
            block.register_forward_hook(lambda mod, args, out, i=i: self._after_block(i, out))
        for head in (self.module.transformer.ln_f, getattr(self.module, "lm_head", None)):
            if head is not None:
                head.register_forward_pre_hook(lambda mod, args: self._wait(self.root))

    def _build_units(self, module: nn.Module, params: list) -> list:
        """Per block, one unit per data-parallel group and codec (`block_units[i]`), last block first, then the
        root's (the rest)."""
        def units(members: list) -> list:
            return [u for (_, codec), ps in by_group_and_codec(members).items() for u in self._units(ps, codec)]

        self.blocks = list(module.transformer.h)
        if not self.blocks:
            raise ValueError("ZeRO-3 gathers one transformer block at a time: the model needs n_layer ≥ 1")
        in_block = {id(p) for b in self.blocks for p in b.parameters()}
        self.block_units = [units([p for p in b.parameters() if p.requires_grad]) for b in self.blocks]
        self.root = units([p for p in params if id(p) not in in_block])
        return [u for units_ in reversed(self.block_units) for u in units_] + self.root

    def _pack_weights(self, unit: Unit):
        """This rank's working slice is kept alone (the full buffer is freed once the views point into it). A meta
        module with a `device` packs nothing: _fill_shard builds this rank's master slice alone."""
        if unit.params[0].device.type == "meta" and self.device is not None:
            device = torch.device(self.device)
            unit.master = self._fill_shard(unit, device)
            unit.weight_shard = unit.master.to(self.param_dtype)  # the same tensor when the dtypes agree
            unit.weights = torch.empty(unit.padded_numel, dtype=self.param_dtype, device=device)  # for the views
            return
        flat = unit.packed(self.master_dtype)
        unit.weights = flat.to(self.param_dtype, copy=True)
        unit.weight_shard = unit.weights[unit.mine].clone()
        unit.master = unit.weight_shard if self.param_dtype == self.master_dtype else flat[unit.mine].clone()

    def _build_unit(self, unit: Unit):
        super()._build_unit(unit)
        unit.weights.untyped_storage().resize_(0)  # the views stay; their storage has 0 bytes until gathered

    def _fill_shard(self, unit: Unit, device) -> torch.Tensor:
        """This rank's [S] master slice of a unit whose parameters are still meta, from each one's initial value
        (shard.initial_local, cut by its ShardInfo): the transient is one logical tensor; the padding is zero."""
        shard = torch.zeros(unit.shard_numel, dtype=self.master_dtype, device=device)
        for p, offset, (lo, hi) in zip(unit.params, unit.offsets, unit.spans):
            if hi > lo:
                start = unit.shard_start + lo - offset  # the slice's first element, within p
                value = initial_local(p.shard_info, self.module.initial_value, p.dtype).reshape(-1)
                shard[lo:hi] = value[start:start + hi - lo]
        return shard

    # --- The schedule: gather before use, free after, prefetch the next (the module hooks above)

    def _forward_start(self, module, args):
        self._wait(self.root)  # embeddings: nothing to overlap with yet
        self._gather(self.block_units[0])

    def _before_block(self, i: int):
        self._wait(self.block_units[i])
        if _recomputing():  # activation checkpointing reruns the forward in backward: block i is gathered
            return  # already (its backward hook waited for it, and prefetched block i-1); nothing else moves
        if i == 0:
            self._free(self.root)  # the embedding lookups are done; the head regathers it
        self._gather(self.block_units[i + 1] if i + 1 < len(self.blocks) else self.root)  # prefetch

    def _after_block(self, i: int, out):
        if _recomputing():  # its backward, about to run, reads the weights: _launch frees them after
            return
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

    def _launch(self, unit: Unit):
        """ZeroLayout's reduce-scatter, then a block's unit is freed: every node reading its weights has run (their
        gradients are all here). The root stays: the hook of block L-1's backward frees it."""
        super()._launch(unit)
        if unit not in self.root:
            self._free([unit])

    # --- Gather, wait, free: each takes block i's units or the root's

    def _gather(self, units: list):
        """Launch the all-gathers of the units not gathered yet (async); count the schedule's peak."""
        for unit in (u for u in units if u.state == "freed"):
            self._start_gather(unit)
        alive = sum(any(u.state != "freed" for u in units_) for units_ in (*self.block_units, self.root))
        self.peak_gathered_units = max(self.peak_gathered_units, alive)

    def _wait(self, units: list):
        """Gather the units where needed and wait until their working weights are there (decoded)."""
        self._gather(units)
        for unit in (u for u in units if u.state == "gathering"):
            self._finish_gather(unit)

    def _free(self, units: list):
        for unit in (u for u in units if u.state != "freed"):
            if unit.gather_work is not None:  # gathered but never used (evaluation's last prefetch)
                unit.gather_work.wait()
                unit.gather_work = None
            unit.codes = unit.decoding = None
            unit.weights.untyped_storage().resize_(0)
            unit.state = "freed"

    def _start_gather(self, unit: Unit, exact: bool = False):
        """Grow the unit's full buffer back and launch the all-gather of every rank's working slice into it. A unit
        with a codec sends its slice's codes instead (uint8, one byte per element; decoded in _finish_gather),
        unless `exact` (full_parameters: the working weights themselves)."""
        unit.weights.untyped_storage().resize_(unit.padded_numel * unit.weights.element_size())
        source, target = unit.weight_shard, unit.weights
        if unit.codec is not None and not exact:
            starts = [unit.shard_start + lo - offset for (lo, _), offset in zip(unit.spans, unit.offsets)]
            codes, unit.decoding = unit.codec.encode(unit.params, [source[lo:hi] for lo, hi in unit.spans], unit.group,
                                                     starts)  # each segment's flat offset in its parameter
            source = torch.zeros(unit.shard_numel, dtype=torch.uint8, device=source.device)  # padding: 0
            for (lo, hi), piece in zip(unit.spans, codes):
                source[lo:hi] = piece
            target = unit.codes = torch.empty(unit.padded_numel, dtype=torch.uint8, device=source.device)
        if unit.dp_size == 1:  # a group of one: the shard is the whole unit, no message
            target.copy_(source)
        else:
            unit.gather_work = unit.all_gather(target, source)
        unit.state = "gathering"

    def _finish_gather(self, unit: Unit):
        """Wait for the unit's all-gather; a codec decodes its codes into the working weights (codes None: they were
        gathered exactly, and the codec's linears scale from them again)."""
        if unit.gather_work is not None:
            unit.gather_work.wait()
            unit.gather_work = None
        if unit.codec is not None:
            unit.codec.decode(unit.params, None if unit.codes is None else _views(unit, unit.codes),
                              _views(unit, unit.weights), unit.decoding)
        unit.codes = unit.decoding = None
        unit.state = "gathered"

    # --- The layout protocol where stage 3 differs: no published weights, flat `param/` pieces, exact gathers

    def _publish(self, unit: Unit):
        """The updated master → this rank's working slice; no message: the weights are gathered where used."""
        if unit.master is not unit.weight_shard:
            unit.weight_shard.copy_(unit.master)

    def state_pieces(self) -> list:
        """As ZeroLayout's, but stage 3 holds no whole weight: `param/` is this rank's flat range of it too."""
        return [piece for unit in self.units for i, p in enumerate(unit.params)
                for piece in unit.flat_pieces(i, [("param", unit.weight_shard), *unit.optimizer_state()],
                                              counts_here(p.shard_info, self.coords))]

    @torch.no_grad()
    def full_parameters(self) -> dict:
        """{global name: a copy of the full local working tensor}, between steps. A collective: each unit gathered
        exactly (a unit with a codec too), copied and freed again, outside the schedule's peak (for tests)."""
        out = {}
        for unit in self.units:
            with self.gathered([unit]):
                out.update({p.shard_info.global_name: p.detach().clone() for p in unit.params})
        return out

    @contextmanager
    def gathered(self, units: list | None = None):
        """Between steps, the parameters of `units` (all: None) readable in place, gathered exactly, then freed
        (a collective; outside the schedule's peak: for tests, which read replicas sharing a global name)."""
        units = self.units if units is None else units
        self._free(units)
        with torch.no_grad():
            for unit in units:
                self._start_gather(unit, exact=True)
                self._finish_gather(unit)
        try:
            yield
        finally:
            self._free(units)

    # --- Accounting (zero3's docstring, answers 2 and 3)

    def held_bytes(self) -> dict:
        """As ZeroLayout's, with the working weights this rank's slices (the full buffers exist only while gathered)."""
        held = super().held_bytes()
        weights = sum(u.weight_shard.nbytes for u in self.units)
        return {**held, "weights": weights, "total": held["total"] - held["weights"] + weights}

    def peak_lower_bound(self) -> float:
        """Persistent bytes + two gathered blocks (in use + prefetched) + the root's bucket and two blocks' in
        backward; U: a block's units together."""
        b_w, b_bucket = self.param_dtype.itemsize, self.reduce_dtype.itemsize
        largest = max(sum(u.padded_numel for u in units) for units in self.block_units)
        root = sum(u.padded_numel for u in self.root)
        return self.predicted_persistent()["total"] + 2 * b_w * largest + b_bucket * (root + 2 * largest)

    def facts(self) -> ZeroFacts:
        """ZeroLayout's, with the root's reduce-scatter last, the root and block 0 gathered first, and the
        most blocks the schedule held gathered at once."""
        first = sum(u.padded_numel for u in [*self.root, *self.block_units[0]])
        return replace(super().facts(), last_reduce_numel=sum(u.padded_numel for u in self.root),
                       first_gather_numel=first, peak_gathered_units=self.peak_gathered_units)

    def _gathers(self, unit: Unit) -> int:
        """Gathers of a unit per micro-batch: the root twice in forward (embedding, tied head), a block once in
        forward and once in backward, except the last block (kept from its forward into backward)."""
        return 2 if unit in self.root or unit not in self.block_units[-1] else 1

    def predicted_messages(self, micro_batches: int) -> Messages:
        """Per step over each data-parallel group of size > 1: per micro-batch each unit's `_gathers` and one
        reduce-scatter; plus each gather's codec messages (also over the linears' TP/CP groups when D = 1)."""
        m, b_w, b_r, out = micro_batches, self.param_dtype.itemsize, self.reduce_dtype.itemsize, Messages()
        for name, group in self.groups.items():
            alone = dist.get_world_size(group) == 1  # one rank: its shard is the unit, nothing to send
            for unit in self.units_of(name):
                gathers = m * self._gathers(unit)
                if unit.codec is not None:
                    out = out + unit.codec.encode_messages(unit.params, None if alone else name).times(gathers)
                if not alone:
                    out = out + unit.messages("gather", b_w if unit.codec is None else 1, gathers)
                    out = out + unit.messages("reduce", b_r, m)
        return out + (self.config.matrices.messages(self) if self.config.matrices is not None else Messages())


def _recomputing() -> bool:
    """Whether a block's forward runs inside a backward: activation checkpointing's recompute (full or
    selective), which autograd runs from a node of the backward graph."""
    return torch._C._current_autograd_node() is not None


def by_group_and_codec(params: list) -> dict:
    """{(data-parallel group, gather codec): parameters}, in first-seen order (a MoE block with FP8 linears:
    dense, FP8 weights, experts)."""
    out = {}
    for p in params:
        out.setdefault((grad_group(p), getattr(p, "gather_codec", None)), []).append(p)
    return out


def _views(unit: Unit, flat: torch.Tensor) -> list:
    """Each parameter's 1-D range of a flat [n'] buffer of the unit."""
    return [flat[offset:offset + p.numel()] for p, offset in zip(unit.params, unit.offsets)]
