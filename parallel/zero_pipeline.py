"""ZeRO-2 and ZeRO-3 under a pipeline: units per chunk, gradients reduced once a step, weights gathered by the schedule.

Without a pipeline, zero.py's stage 2 reduce-scatters each backward's gradient buckets and parallel/zero3.py gathers a
block in module hooks around the model's forward. A pipeline breaks both: a rank's backward brings one chunk's gradients
of one micro-batch at a time, interleaved with other micro-batches' forwards (and, under zb, split into I and W),
and the interpreter calls the stage's pieces (embed, forward_blocks, head_loss) itself, in the schedule's order.
So here the layout follows the schedule (`parallel/schedules.py`'s action list of this rank):

Units. One unit per local chunk (a virtual stage under interleaving: its blocks, plus the embeddings on chunk 0 and
ln_f and the head on the last chunk), per data-parallel group and gather codec, last local chunk first (the order
the chunks finish their backward); the tied embedding is a unit of its own, so that the first and the last stage
shard it alike and pipeline.after_grad_sync sums the same elements over pp_tied.

Gradients (stages 2 and 3): accumulated locally over the step's micro-batches, in one full [n'] buffer per unit in
the accumulate dtype (fp32 under bf16, as Megatron's main_grad), allocated at the chunk's first backward (B or I)
and reduce-scattered once, at the chunk's last backward (its last B; zb: its last I and last W), the same
`no_sync` contract as ZeRO-1 and DDP. The price, said in the start-up lines: during the step a rank holds the full
gradients of each chunk from its first backward to its last, b_a·n'_c (so ZeRO-2's peak under a pipeline is
ZeRO-1's; its saving is between steps). The alternative, reduce-scattering every micro-batch's chunk gradients
into the fp32 shard, holds one chunk's bucket at a time but sends m times the bytes over dp: under a pipeline
m ≥ P, and the dp group is the slow, inter-node one. torch.distributed.pipelining does as here with FSDP2: every
backward but the last runs with set_requires_gradient_sync(False) (unsharded gradients accumulate), and one
reduce-scatter follows the last (its REDUCE_GRAD action); DeepSpeed's pipeline engine refuses ZeRO-2/3.

Weights (stage 3). `chunk_weights(chunk, following)`, a context the interpreter enters around each action: the
action's chunk gathered (waited), the next action's chunk prefetched (its all-gather launched before this one
computes), and after the action the chunk freed unless the next action is on the same chunk. The rule: a chunk
stays gathered over a run of consecutive actions on it (freeing it between two would only regather it at once,
and prefetching already holds the next one), so at most 2 chunks are gathered at once (1 at v = 1, where every
action is on the one chunk: the stage is gathered once per step and sharded between steps). A chunk is thus
gathered once per run of its actions (`gathers_per_step`): with v ≥ 2 a forward and its backward regather it.
Evaluation and sampling run outside the schedule: a pre-hook on each of the chunk's modules gathers it, and the
chunk is freed after its last module when no gradient is recorded.

Accounting (zero.py's symbols; n'_c: chunk c's units, padded; b_a the accumulate dtype's bytes):
1. Replicated vs split: as ZeRO-2/3 (zero.py), over the stage's parameters only; the stages split the layers.
2. Persistent: zero.py's stage formulas over the stage's Ψ' (exact: held_bytes). Transient during the step, from
   the action list (`step_transient`): max over actions j of Σ_{c gathered during j} b_w·n'_c (stage 3: the
   action's chunk and the prefetched one) + Σ_{c: first backward ≤ j ≤ last backward} b_a·n'_c (the
   gradients accumulating); measured by the layout's own buffers (`peak_transient_bytes`). Stage 2 adds the
   update's all-gather inputs b_w·Ψ'/D after the gradients are reduced (the larger counts).
3. Messages per step over dp×cp: per unit one reduce_scatter of b_a·n' (at its chunk's last backward, overlapping
   the rest of the cool-down); stage 2 one all_gather of b_w·n' (the update, as zero.py); stage 3 one all_gather
   of b_w·n' per run of the chunk's actions (the first one exposed, the rest prefetched behind the previous
   action), plus a codec's messages per gather.
4. Restart state: zero.py's and parallel/zero3.py's pieces (flat ranges of logical tensors): a checkpoint reloads on any
   P and D, with or without a pipeline.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

import torch
import torch.nn as nn

from parallel.schedules import build_programs, rank_chunks, stage_layers
from parallel.zero3 import Zero3Layout, by_group_and_codec
from step import Messages
from zero import Unit, ZeroConfig, ZeroFacts, ZeroLayout

NOTE = ("under the pipeline: units per chunk; gradients summed over the step's micro-batches in full buffers "
        "({acc}, held from a chunk's first backward to its last: {grads}), one reduce_scatter per unit at the "
        "chunk's last backward")


def pipeline_layout(module: nn.Module, config: ZeroConfig, groups: dict, coords: dict, device, pp_config, n_layer: int,
                    pp_rank: int, micro_batches: int):
    """The ZeRO-2 or ZeRO-3 layout of this pipeline rank's stage (train.build_layout): its chunks' layers and its
    action list for m = micro_batches (`schedules.build_programs`)."""
    P, v, n_chunks = pp_config.size, pp_config.virtual, pp_config.size * pp_config.virtual
    chunk_layers = {c: stage_layers(n_layer, P, v, c) for c in rank_chunks(pp_rank, P, v)}
    program = build_programs(pp_config.schedule, P, micro_batches, v)[pp_rank]
    if config.stage == 2:
        return PipelineZero2Layout(module, config, groups, coords, chunk_layers=chunk_layers, n_chunks=n_chunks,
                                   program=program)
    return PipelineZero3Layout(module, config, groups, coords, device, chunk_layers=chunk_layers, n_chunks=n_chunks,
                               program=program)


def gather_runs(program: list, chunk: int) -> int:
    """Runs of consecutive actions on `chunk` in a rank's action list: stage 3 gathers the chunk once per run."""
    chunks = [a.chunk for a in program]
    return sum(c == chunk and (j == 0 or chunks[j - 1] != c) for j, c in enumerate(chunks))


def alive_chunks(program: list, stage: int) -> set:
    """{(chunks gathered, chunks accumulating gradients)} over the actions j of a rank's list: gathered (stage 3)
    j's chunk and the next action's (prefetched); accumulating, each chunk from its first backward to its last.
    Docstring item 2's transient is the most bytes of one of these pairs; a plan reads the pairs by local chunk
    index (stages of one shape with the same pairs have the same transient)."""
    chunks = [a.chunk for a in program]
    first, last = {}, {}  # each chunk's first and last backward
    for j, action in enumerate(program):
        if action.kind != "F":
            first.setdefault(action.chunk, j)
            last[action.chunk] = j
    # Between two changes of the accumulating set, the distinct (this chunk, next chunk) of its actions (a list is
    # 2·v·m long; its few distinct pairs are what the transient needs).
    bounds = sorted({0, len(chunks), *first.values(), *(j + 1 for j in last.values())})
    out = set()
    for a, b in zip(bounds, bounds[1:]):
        accumulating = frozenset(c for c in first if first[c] <= a <= last[c])
        held = set(zip(chunks[a:b], chunks[a + 1:b + 1])) if stage == 3 else {()}
        held |= {(chunks[-1],)} if stage == 3 and b == len(chunks) else set()  # the last action: no next one
        out |= {(frozenset(pair), accumulating) for pair in held}
    return out


def step_transient_bytes(program: list, stage: int, gathered: dict, accumulating: dict) -> float:
    """max over actions of Σ gathered[c] over the chunks gathered + Σ accumulating[c] over those accumulating
    (alive_chunks): b_w·n'_c and b_a·n'_c per chunk c."""
    return transient_of(alive_chunks(program, stage), gathered, accumulating)


def transient_of(alive: set, gathered: dict, accumulating: dict) -> float:
    """step_transient_bytes of a list's alive_chunks (the plan's search computes those once per action list)."""
    return max((sum(gathered[c] for c in held) + sum(accumulating[c] for c in grads) for held, grads in alive),
               default=0)


class _ChunkGradients:
    """What stages 2 and 3 share under a pipeline (the first base of both layouts below): units per chunk, and
    gradients accumulated over the step and reduce-scattered once at the chunk's last backward."""

    def _setup(self, chunk_layers: dict, n_chunks: int, program: list):
        self.chunk_layers, self.n_chunks, self.program = chunk_layers, n_chunks, program
        self.peak_transient_bytes = 0  # the most bytes of gathered chunks and gradient buffers alive at once

    def _build_units(self, module: nn.Module, params: list) -> list:
        """Per local chunk, its units by data-parallel group (stage 3: and codec), then the tied copy alone;
        last chunk first. `chunk_units[c]`: chunk c's."""
        owner = {}  # id(parameter) → its chunk: the blocks' by layer; the embeddings the first, the rest the last
        for chunk, layers in self.chunk_layers.items():
            for layer in layers:
                owner.update((id(p), chunk) for p in module.transformer.h[layer].parameters())
        embedding = {id(p) for name in ("wte", "wpe") if name in module.transformer
                     for p in module.transformer[name].parameters()}
        first, last = min(self.chunk_layers), max(self.chunk_layers)
        self.chunk_units = {}
        for chunk in self.chunk_layers:
            members = [p for p in params if owner.get(id(p), first if id(p) in embedding else last) == chunk]
            tied = [p for p in members if "pp" in p.shard_info.replicated_over]
            rest = [p for p in members if "pp" not in p.shard_info.replicated_over]
            self.chunk_units[chunk] = [u for (_, codec), ps in by_group_and_codec(rest).items()
                                       for u in self._units(ps, codec if self.stage == 3 else None)]
            self.chunk_units[chunk] += [Unit([p], self.groups) for p in tied]
        self._same_chunk = {id(u): units for units in self.chunk_units.values() for u in units}
        return [u for chunk in sorted(self.chunk_units, reverse=True) for u in self.chunk_units[chunk]]

    def _on_grad_ready(self, param: torch.Tensor):
        """Add the gradient into its unit's full buffer (the chunk's buffers allocated at its first gradient of the
        step); in a synchronised backward (the chunk's last) count it, and launch the units complete, in order."""
        unit = self._unit_of[param]
        if unit.bucket is None:
            for other in (u for u in self._same_chunk[id(unit)] if u.bucket is None):
                other.bucket = torch.zeros(other.padded_numel, dtype=self.accumulate_dtype, device=param.device)
            self._note_transient()
        offset = self._offset_of[param]
        unit.bucket[offset:offset + param.numel()].add_(param.grad.reshape(-1))
        param.grad = None
        if not self.require_grad_sync:
            return
        self.arrived(unit, self.units, "only each chunk's last backward (zb: last I and last W) may run outside"
                                       " no_sync()")

    def _launch(self, unit: Unit):
        """zero.py's reduce-scatter of the unit's full buffer (its step's sum); the weights stay (the schedule
        frees them)."""
        ZeroLayout._launch(self, unit)

    def _note_transient(self):
        """The most bytes the gathered chunks' working buffers (stage 3; a codec's codes aside) and the gradient
        buffers held at once: called after every gather and allocation, where the total rises."""
        gathered = sum(u.weights.untyped_storage().nbytes() for u in self.units if self.stage == 3)
        buckets = sum(u.bucket.nbytes for u in self.units if u.bucket is not None)
        self.peak_transient_bytes = max(self.peak_transient_bytes, gathered + buckets)

    # --- Accounting: the action list's figures

    def _chunk_numel(self, chunk: int) -> int:
        return sum(u.padded_numel for u in self.chunk_units[chunk])

    def gathers_per_step(self, chunk: int) -> int:
        """Runs of consecutive actions on `chunk` in this rank's list: stage 3 gathers it once per run."""
        return gather_runs(self.program, chunk)

    def step_transient(self) -> float:
        """Docstring item 2: the most bytes of gathered chunks (stage 3) and accumulating gradients at once."""
        b_w, b_a = self.param_dtype.itemsize, self.accumulate_dtype.itemsize
        numel = {c: self._chunk_numel(c) for c in self.chunk_units}
        return step_transient_bytes(self.program, self.stage, {c: b_w * n for c, n in numel.items()},
                                    {c: b_a * n for c, n in numel.items()})

    def pipeline_facts(self, facts: ZeroFacts) -> ZeroFacts:
        b_a = self.accumulate_dtype.itemsize
        note = NOTE.format(acc=f"{b_a} bytes per element", grads=f"{b_a * self.padded_numel:,} bytes for the stage")
        last_chunk = min(self.chunk_units)  # the first local chunk finishes its backward last
        return replace(facts, last_reduce_numel=self._chunk_numel(last_chunk), pipeline_note=note,
                       step_transient_predicted=self.step_transient(),
                       step_transient_measured=self.peak_transient_bytes)

    def _update_messages(self) -> Messages:
        """A matrix optimizer's own messages of its update (optimizers/zero_muon.py), or none."""
        return self.config.matrices.messages(self) if self.config.matrices is not None else Messages()


class PipelineZero2Layout(_ChunkGradients, ZeroLayout):
    """ZeRO-2 under a pipeline: zero.ZeroLayout with units per chunk and the step's gradients reduced once."""

    stages = (2,)

    def __init__(self, module: nn.Module, config: ZeroConfig, groups: dict | None = None, coords: dict | None = None,
                 *, chunk_layers: dict, n_chunks: int, program: list):
        self._setup(chunk_layers, n_chunks, program)
        super().__init__(module, config, groups, coords)
        self.reduce_dtype = self.accumulate_dtype  # the step's sum is sent, once

    def peak_lower_bound(self) -> float:
        """Persistent + the larger of the step's accumulating gradients and the update's all-gather inputs."""
        shards = sum(u.shard_numel for u in self.units)
        return self.predicted_persistent()["total"] + max(self.step_transient(), self.param_dtype.itemsize * shards)

    def facts(self) -> ZeroFacts:
        return self.pipeline_facts(super().facts())

    def predicted_messages(self, micro_batches: int) -> Messages:
        """Per step, per unit over its group (size > 1): one reduce_scatter of the step's sum, one all_gather of
        the updated shard."""
        out = Messages()
        for name, group in self.groups.items():
            for unit in self.units_of(name):
                if unit.dp_size > 1:
                    out = out + unit.messages("reduce", self.reduce_dtype.itemsize)
                    out = out + unit.messages("gather", self.param_dtype.itemsize)
        return out + self._update_messages()


class PipelineZero3Layout(_ChunkGradients, Zero3Layout):
    """ZeRO-3 under a pipeline: zero3.Zero3Layout's shards, gathers and codecs, with the gathers and frees
    driven by the interpreter (`chunk_weights`) instead of the forward's module hooks."""

    stages = (3,)

    def __init__(self, module: nn.Module, config: ZeroConfig, groups: dict | None = None, coords: dict | None = None,
                 device=None, *, chunk_layers: dict, n_chunks: int, program: list):
        self._setup(chunk_layers, n_chunks, program)
        self._scheduled = False  # inside an action of the interpreter's step
        super().__init__(module, config, groups, coords, device)
        self.reduce_dtype = self.accumulate_dtype

    def _build_units(self, module: nn.Module, params: list) -> list:
        units = super()._build_units(module, params)
        # parallel/zero3.py's names for what its _gather counts: every chunk's units (the most alive at once), no root.
        self.block_units, self.root = [self.chunk_units[c] for c in sorted(self.chunk_units)], []
        return units

    def _register_schedule_hooks(self):
        """Outside the interpreter's step (evaluation, sampling): each module of a chunk gathers it before its
        forward, and the chunk's last module frees it after, when no gradient is recorded."""
        transformer, head = self.module.transformer, getattr(self.module, "lm_head", None)
        for chunk, layers in self.chunk_layers.items():
            modules = [transformer[name] for name in ("wte", "wpe") if chunk == 0 and name in transformer]
            modules += [transformer.h[layer] for layer in layers]
            if chunk == self.n_chunks - 1:
                modules += [m for m in (transformer["ln_f"], head) if m is not None]
            for module in modules:
                module.register_forward_pre_hook(lambda mod, args, c=chunk: self._unscheduled(c, gather=True))
            modules[-1].register_forward_hook(lambda mod, args, out, c=chunk: self._unscheduled(c, gather=False))

    def _unscheduled(self, chunk: int, gather: bool):
        if self._scheduled:
            return
        if gather:
            self._wait(self.chunk_units[chunk])
        elif not torch.is_grad_enabled():
            self._free(self.chunk_units[chunk])

    @contextmanager
    def chunk_weights(self, chunk: int, following: int | None):
        """Around one action on `chunk` (pipeline.py's interpreter): its weights gathered, the next action's
        chunk (`following`, None after the last) prefetched during it, and freed after it unless the next action
        is on it too."""
        self._scheduled = True
        try:
            self._wait(self.chunk_units[chunk])
            if following is not None and following != chunk:
                self._gather(self.chunk_units[following])
            self._note_transient()
            yield
        finally:
            if following != chunk:
                self._free(self.chunk_units[chunk])
            self._scheduled = following is not None

    def peak_lower_bound(self) -> float:
        """Persistent + the step's gathered chunks and accumulating gradients (docstring item 2)."""
        return self.predicted_persistent()["total"] + self.step_transient()

    def facts(self) -> ZeroFacts:
        first = self._chunk_numel(self.program[0].chunk)
        return replace(self.pipeline_facts(super().facts()), first_gather_numel=first,
                       gathered_bound=2 if len(self.chunk_units) > 1 else 1)

    def predicted_messages(self, micro_batches: int) -> Messages:
        """Per step, per unit: all_gather of b_w·n' (1 byte per element with a codec) once per run of its chunk's
        actions and each gather's codec messages; one reduce_scatter of the step's sum."""
        out, b_w = Messages(), self.param_dtype.itemsize
        for name, group in self.groups.items():
            for chunk, units in self.chunk_units.items():
                gathers = self.gathers_per_step(chunk)
                for unit in (u for u in units if u.group_name == name):
                    alone = unit.dp_size == 1
                    if unit.codec is not None:
                        out = out + unit.codec.encode_messages(unit.params, None if alone else name).times(gathers)
                    if not alone:
                        out = out + unit.messages("gather", b_w if unit.codec is None else 1, gathers)
                        out = out + unit.messages("reduce", self.reduce_dtype.itemsize)
        return out + self._update_messages()
