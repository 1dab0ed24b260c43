"""Measurements that run torch work for the printouts: a block forward and backward, the ring's transfers alone.

The accounting prints each prediction next to a measurement of the same thing. Most measurements observe the
training itself (the tracer in accounting/tracer.py, the clocks in mfu.py, accounting/memory.py's saved-tensor hooks and
memory timeline); the three here run work of their own at start-up, and leave the run as they found it:

    measure_block(run)      one held block, forward and backward, under a CommTracer and memory.SavedActivations:
                            its messages by (phase, op, group) and the bytes it saves for backward, as the run runs
                            it (a deep copy under a forked RNG); the tp and cp sections print it (report/axes.py)
    measure_moe_blocks(run) each held MoE block forward once (a copy, likewise) under memory.LiveTensors: its MoE
                            layer's and its attention's peak, beside accounting/moe_memory.py's prediction for the rows
                            it routed; every rank's, gathered (the moe section prints them)
    time_ring_alone(cp, …)  the ring's transfers of one layer with no compute between them, into its observer's clock,
                            so the end can say how much of them compute hid (context_parallel.py's item 3)

All are collective: every rank of the groups they talk on calls them, in the same order.
"""

from __future__ import annotations

from copy import deepcopy
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from accounting import activations, fp8_experts, memory, moe_memory
import context_parallel
from experts import dispatch
import moe
from accounting.tracer import CommTracer
from shard import materialize
from step import Count


@dataclass(frozen=True)
class BlockMeasurement:
    """One held block run forward and backward once, as the run will run it: what it sent and what it saved."""

    messages: dict  # {(phase, op, group as the tracer reports it): Count}, phase "forward" or "backward"
    saved_bytes: int  # the distinct storages autograd saved in the forward, parameters aside
    sizes: dict  # {(phase, op, group): {message bytes: calls}}: the same calls by size (TP's apart from FP8's amaxes)

    def on(self, group: str) -> dict:
        """{(phase, op): Count} on one mesh group, found by any of its names ("dp_cp" in "dp_cp=expert_dp")."""
        return {(phase, op): count for (phase, op, name), count in self.messages.items() if group in name.split("=")}

    def sizes_on(self, group: str) -> dict:
        """{(phase, op): {message bytes: calls}} on one mesh group, found by any of its names."""
        return {(phase, op): sizes for (phase, op, name), sizes in self.sizes.items() if group in name.split("=")}


def measure_block(run, block_index: int = 0) -> BlockMeasurement:
    """Run held block `block_index` forward and backward once under a CommTracer on random input of one
    micro-batch as a rank holds it between regions, [B_μ, s/C (÷T under SP), h], in the working dtype the
    layout will train in (run.param_dtype: ZeRO's bf16 weights) and the run's autocast.

    It runs a deep copy of the block (sharing only the process groups) under a forked RNG, so the run is left
    as it was: no gradient, no FP8 amax, no expert load, no ring time, the same dropout draws next. Every
    rank of the groups the block talks on calls it (each pipeline stage measures its own first block).
    """
    groups = {name: group for name, group in run.mesh.groups.items() if group is not None}
    block = _copy_block(run, block_index)
    params = list(block.parameters())
    device = params[0].device
    tracer = CommTracer(by_size=True)
    for name, group in groups.items():
        tracer.name_group(group, name)
    seen, sizes, cuda = {}, {}, device.type == "cuda"
    with torch.random.fork_rng(devices=[device.index if device.index is not None else torch.cuda.current_device()]
                               if cuda else []):
        x = torch.randn(run.micro_batch_size, run.settings.local_seq_len, run.config.n_embd, device=device,
                        dtype=run.param_dtype, generator=torch.Generator(device).manual_seed(0), requires_grad=True)
        with tracer, memory.SavedActivations(exclude=params) as saved, run.autocast:
            out = block(x)
        seen["forward"], sizes["forward"] = tracer.records, tracer.sizes_of()
        tracer.reset()
        with tracer:
            out.float().sum().backward()
        seen["backward"], sizes["backward"] = tracer.records, tracer.sizes_of()
    return BlockMeasurement({(phase, op, group): Count(stat.calls, stat.payload_bytes) for phase, records in
                             seen.items() for (op, group), stat in records.items()}, saved.bytes,
                            {(phase, op, group): by_size for phase, found in sizes.items()
                             for (op, group), by_size in found.items()})


def _copy_block(run, block_index: int):
    """A deep copy of held block `block_index` (sharing only the process groups), its values materialised (a meta
    block: ZeRO-3 fills its shards later) in the working dtype the layout will train in (run.param_dtype)."""
    groups = [group for group in run.mesh.groups.values() if group is not None]
    shared = {id(group): group for group in [*groups, dist.group.WORLD]}  # not copied: the same groups
    original = list(run.model.transformer.h)[block_index]
    block = deepcopy(original, memo=dict(shared))
    for source, copy in zip(original.parameters(), block.parameters()):
        copy.shard_info = source.shard_info  # a meta Parameter's deepcopy drops its attributes
    materialize(block, run.device, run.model.initial_value)
    for p in block.parameters():
        p.data = p.data.to(run.param_dtype)
    return block


@dataclass(frozen=True)
class MoEPeak:
    """One held MoE block's forward on one rank, measured (memory.LiveTensors) and predicted (accounting/moe_memory.py)
    for the rows it routed."""

    layer_id: int
    rank: int
    sent: int  # S
    received: int  # R
    measured: memory.ModulePeak  # its MoE layer's
    predicted: moe_memory.BlockPeak
    attention: memory.ModulePeak  # its attention's, measured
    attention_predicted: int  # moe_memory.attention_above_saved
    backward_rise: int  # its MoE layer's backward above its saved tensors (memory.BackwardRise)
    backward_predicted: tuple  # (moment, bytes): moe_memory.backward_rise for the rows the backward's pass routed


class _Rows(moe.RoutingObserver):
    def routed(self, layer, load, keep, sent: int, received: int) -> None:
        self.rows = (sent, received, layer.exchanged.expert_rows if layer.ep_size > 1 else 0)  # E > 1: R_e
        chunks = layer.local_rows  # the rows of each expert GEMM (after capacity drops; E > 1 per source too)
        self.fp8 = None if chunks is None else (fp8_experts.padded_rows(chunks), sum(map(bool, chunks)))  # (P, c)


def measure_moe_blocks(run) -> list:
    """Every held MoE block (a copy, as measure_block runs it: random input of one micro-batch as a rank holds it,
    the run's dtypes and autocast, a forked RNG), forward once under memory.LiveTensors: its MoE layer's and its
    attention's peak, next to moe_memory's prediction for the rows it routed. Collective over the world (the
    blocks' groups, then one object all-gather): [MoEPeak] of every rank, in rank order."""
    x_shape = activations.activation_shape(run)
    mine = []
    for index, original in enumerate(run.model.transformer.h):
        if not isinstance(original.mlp, moe.MoE):
            continue
        block = _copy_block(run, index)
        block.mlp.observer = rows = _Rows()
        device = next(block.parameters()).device
        with torch.random.fork_rng(devices=[device.index if device.index is not None else torch.cuda.current_device()]
                                   if device.type == "cuda" else []):
            x = torch.randn(run.micro_batch_size, run.settings.local_seq_len, run.config.n_embd, device=device,
                            dtype=run.param_dtype, generator=torch.Generator(device).manual_seed(0), requires_grad=True)
            with memory.LiveTensors({"attn": block.attn, "mlp": block.mlp}) as live, run.autocast:
                block(x)
            routed, routed_fp8 = rows.rows, rows.fp8  # the block's pass's (S, R); the backward's own pass routes again
            backward_rise = _moe_backward_rise(run, block.mlp, x.shape, device)
        traffic = replace(run_traffic(run), moe_layers=1)
        shape = replace(moe_memory.shape_of(traffic, x_shape), sent=routed[0], received=routed[1],
                        expert_rows=routed[2])
        if shape.fp8 is not None:  # the padding of the chunks this forward ran
            shape = replace(shape, fp8=(*routed_fp8, shape.fp8[2]))
        backward_shape = replace(shape, sent=rows.rows[0], received=rows.rows[1], expert_rows=rows.rows[2])
        mine.append(MoEPeak(original.layer_id, dist.get_rank(), *routed[:2], live.peaks["mlp"],
                            moe_memory.block_peak(shape), live.peaks["attn"],
                            moe_memory.attention_above_saved(x_shape, run.config.bias), backward_rise,
                            moe_memory.backward_rise(backward_shape)))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return [peak for peaks in every for peak in peaks]


def _moe_backward_rise(run, layer, shape, device) -> int:
    """The MoE layer's forward and backward on random input (its own pass, after the block's): how far its
    backward rises above the forward's saved tensors, the parameters' gradients aside (memory.BackwardRise)."""
    generator = torch.Generator(device).manual_seed(1)
    x = torch.randn(shape, device=device, dtype=run.param_dtype, generator=generator, requires_grad=True)
    with memory.LiveTensors({"mlp": layer}) as live, run.autocast:
        y = layer(x)
    rise = memory.BackwardRise(live.kept["mlp"])
    grad = torch.randn(y.shape, device=device, dtype=y.dtype, generator=generator)
    with rise:
        y.backward(grad)
    return rise.rise(p.grad.untyped_storage()._cdata for p in layer.parameters() if p.grad is not None)


def run_traffic(run) -> dispatch.Traffic:
    """The MoE axis's Traffic (what one micro-batch routes on this rank)."""
    return next(axis.facts().traffic for axis in run.axes if axis.name == "moe")


def time_ring_alone(cp, clock, device) -> dict:
    """Seconds per layer of one micro-batch's ring transfers with no compute between them, into `clock` (the
    observers.WaitClock observing the ring), on `device` (collective over cp; cp: context_parallel.CPFacts): forward
    (C−1) hops of [K; V]; backward (C−1) of [K; V] and C of [dK; dV]."""
    ring, shape = cp.ring, cp.shape
    dtypes = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}
    size = (2, shape.micro * shape.seq_len // ring.size, shape.width)
    kv = torch.zeros(size, dtype=dtypes[shape.compute_bytes], device=device)
    dkv = torch.zeros(size, dtype=dtypes[context_parallel.accumulator_bytes(shape.compute_bytes)], device=device)

    def hops(tensors):
        def transfers():
            for tensor in tensors:
                ring.wait(ring.post(tensor))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        return transfers

    return {"forward": clock.time_alone("forward", hops([kv] * (ring.size - 1))),
            "backward": clock.time_alone("backward", hops([kv] * (ring.size - 1) + [dkv] * ring.size))}
