"""What a measured CPU's time model needs that one big matmul does not say: measured at start-up, in < 1 s.

The time model (time_model.py) prices a step as FLOPs / (peak · e) + memory-bound bytes / bandwidth + α-β
collectives. On a CPU the peak is a 2048² matmul loop (mfu.py); a run's own block reaches far less of it: its
GEMMs are thin (a tiny block's are 512 × 64 × 192), and every op pays a fixed cost (Python, the dispatcher,
autograd's engine: tens of µs each, a block's forward and backward run ~100 of them) and the elementwise ops
with transcendentals (GELU's erf and its backward) are compute-, not memory-bound here. So the CPU's e is
measured on the run's own block shape, not assumed:

    e = F_block / (peak · (t_block − bytes_block / HBM))          (gemm_fraction; d½ = 0: one shape, measured)

t_block the best of two timed forward+backward passes of one fresh block shaped as this rank's (its B_μ·s/C
tokens, its T-sharded widths: QKV h → 3h/T, proj h/T → h, fc1 h → 4h/T, fc2 4h/T → h, in the run's autocast
dtype), F_block its hardware FLOPs (time_calibration.gemms' block and attention classes for one layer), bytes_block
its memory-bound bytes (time_calibration.memory_bytes_per_token_layer), so that the model prices that block at
exactly its measured time and every other block, the head and recompute at the same rate. The ranks measure at
once on a shared machine: e is their mean (one figure for the world, as train.shared_peak's peak).

The link: hardware.measure_cpu times a world all-reduce 40 times at 4 KiB and 9 times at 4 MiB; hardware.link_fit
fits α (the per-step latency, the calls' scheduler tail included: from the small calls' mean) and β (the wire's
bytes per second: from the slope between the two medians), t(M) = 2(N−1)·α + wire(M)/β. The overlap φ is the
median of five interleaved samples of each of its three times (a block, a transfer, both): one preempted sample
moves neither. Both are the world's averages, so every rank prices the step alike.

Accounting for this file: it holds nothing; calibration_of all-reduces one float64 over the world (collective).
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist
from torch import nn

import activations
import hardware
import memory
import model as model_lib
import time_calibration
from time_calibration import Calibration


def gemm_fraction(block_flops: float, seconds: float, memory_bytes: float, hbm_bytes_per_s: float,
                  peak: float) -> float:
    """e = F / (peak · (t − bytes/HBM)): the fraction of the peak that prices the measured block at its time
    (the memory-bound bytes' share taken out first; at least a tenth of t left to the GEMMs, so noise that
    makes t smaller than the bytes' time cannot give a negative or infinite rate)."""
    gemm_seconds = max(seconds - memory_bytes / hbm_bytes_per_s, 0.1 * seconds)
    return block_flops / (peak * gemm_seconds)


def overlap_fraction(compute: float, transfer: float, both: float) -> float:
    """φ = (t_c + t_m − t_both) / min(t_c, t_m), in [0, 1]: the share of the shorter of a compute pass and a
    transfer that hides when the transfer runs asynchronously beside it (1: fully; 0: they take turns, as two
    gloo ranks on two cores, whose communication threads compete with the compute for the same cores)."""
    return min(1.0, max(0.0, (compute + transfer - both) / max(min(compute, transfer), 1e-12)))


def shaped_block(config, t: int) -> nn.Module:
    """A fresh block of the run's config with the widths of a T-way tensor-parallel shard (its heads and MLP
    columns split T ways): the ops and GEMM shapes one rank runs per layer, without TP's collectives."""
    block = model_lib.Block(config)
    if t > 1:
        h, bias = config.n_embd, config.bias
        block.attn.c_attn = nn.Linear(h, 3 * h // t, bias=bias)
        block.attn.c_proj = nn.Linear(h // t, h, bias=bias)
        if isinstance(block.mlp, model_lib.MLP):
            block.mlp.c_fc = nn.Linear(h, 4 * h // t, bias=bias)
            block.mlp.c_proj = nn.Linear(4 * h // t, h, bias=bias)
    return block


def block_pass(block: nn.Module, x: torch.Tensor, autocast) -> float:
    """One forward+backward pass of `block` on x: its seconds."""
    start = time.perf_counter()
    with autocast:
        y = block(x)
    y.float().sum().backward()
    return time.perf_counter() - start


def block_seconds(block: nn.Module, x: torch.Tensor, autocast, repeats: int = 2) -> float:
    """The best of `repeats` timed forward+backward passes of `block` on x, after one untimed (allocations)."""
    block_pass(block, x, autocast)
    return min(block_pass(block, x, autocast) for _ in range(repeats))


def measured_overlap(block: nn.Module, x: torch.Tensor, autocast, nbytes: int = 1 << 20, repeats: int = 5) -> float:
    """overlap_fraction of this rank's block pass and a world all-reduce of nbytes started asynchronously
    before it: the three times (block alone, transfer alone, both) interleaved `repeats` times and each the
    median of its samples, so one preempted sample moves none of them. Collective: every rank calls it."""
    buffer = torch.zeros(nbytes // 4, dtype=torch.float32, device=x.device)
    compute, transfer, both = [], [], []
    for _ in range(repeats):
        compute.append(block_pass(block, x, autocast))
        start = time.perf_counter()
        dist.all_reduce(buffer)
        transfer.append(time.perf_counter() - start)
        start = time.perf_counter()
        work = dist.all_reduce(buffer, async_op=True)
        block_pass(block, x, autocast)
        work.wait()
        both.append(time.perf_counter() - start)
    return overlap_fraction(*(hardware.median(samples) for samples in (compute, transfer, both)))


def calibration_of(run, peak: float, hbm_bytes_per_s: float) -> tuple[Calibration, float]:
    """The measured CPU's calibration: e of this rank's block (the module docstring), links at their measured
    β (fraction 1), memory-bound ops at the stated bandwidth (fraction 1). Collective: every rank calls it."""
    settings, config = run.settings, run.config
    x_shape = activations.activation_shape(run)
    t = run.mesh.shape.tp
    torch.manual_seed(0)  # the probe's weights: not the run's generator's business, but reproducible
    block = shaped_block(config, t).to(run.device)
    x = torch.randn(x_shape.b, x_shape.s, config.n_embd, device=run.device, requires_grad=True)
    compute = block_seconds(block, x, run.autocast)
    seconds = torch.tensor([compute, 1.0], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        seconds[1] = measured_overlap(block, x, run.autocast)
        dist.all_reduce(seconds)
        seconds /= dist.get_world_size()
    tokens = x_shape.b * x_shape.s
    counts = memory.param_counts(config)
    classes = time_calibration.gemms(config, counts, tokens, x_shape.s, t, recompute=False)
    flops = sum(f for f, _ in classes[:5]) / config.n_layer * tokens  # the block's linears and attention
    nbytes = tokens * time_calibration.memory_bytes_per_token_layer(
        config, x_shape.s, t, settings.sequence_parallel, x_shape.kernel, x_shape.dropout, x_shape.e_c, False)
    e = gemm_fraction(flops, float(seconds[0]), nbytes, hbm_bytes_per_s, peak)
    return Calibration(gemm_fraction=e, gemm_half_dim=0.0, hbm_fraction=1.0, link_fraction=1.0), float(seconds[1])


def machine_model(run, args) -> hardware.Hardware:
    """This machine as the time model sees it: on CPU measured (the matmul peak train.py measured, a timed gloo
    all-reduce at two sizes, this rank's block: collective, every rank calls it); on a GPU the preset's
    datasheet row (--hw, --hw-*)."""
    if run.device.type != "cpu":
        return hardware.from_flags(args, run.settings.dtype)
    hw = hardware.measure_cpu(run.peak[0], run.settings.dtype, run.device)
    calibration, overlap = calibration_of(run, hw.peak(run.settings.dtype), hw.hbm_gbps * 1e9)
    return dataclasses.replace(hw, calibration=calibration, overlap=overlap)
