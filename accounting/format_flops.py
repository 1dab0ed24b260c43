"""A step's FLOPs by number format, and the peak they run at: the MFU of a precision recipe (--fp8, microscaling).

A recipe moves the block linears' GEMMs into narrow formats and leaves the rest in the compute dtype, so a step's
FLOPs (mfu.flops_per_token's model count, 6N + 12·L·H·Q·T per token) split by format f:

    F_fwd   = 2·N_q        the forward GEMM Y = X·Wᵀ of the quantised linears, in the forward format
    F_bwd   = 4·N_q        dX = dY·W and dW = dYᵀ·X, in the backward format
    F_c     = F − 6·N_q    the rest in the compute dtype: the head (6·V·h), attention's 12·L·H·Q·T, the routers,
                           and the blocks a recipe keeps out (NVFP4's tail: the last ⌈F_tail·L⌉ blocks)

with N_q the linear weights of the blocks the recipe quantises (memory.param_counts' dense_linears of those
blocks: the attention's and the dense MLP's nn.Linear weights, 12·h² per dense block; a MoE block's shared
experts and the k·8h² of the routed experts a token visits: memory.param_counts' fp8_matmul). Each format runs at its
own peak P_f, so the ideal time of a token's FLOPs is Σ_f F_f / P_f, and

    MFU = (tokens/s / n_devices) · Σ_f F_f / P_f  =  tokens/s · F / (n_devices · P_w),
    P_w = F / Σ_f (F_f / P_f)            the format-weighted peak: the FLOP-weighted harmonic mean of the P_f

(one format: P_w = P_f and this is mfu.mfu). P_f is the datasheet's dense peak of the format (mfu.PEAK_TFLOPS:
MXFP8 at the FP8 rate, MXFP4 and NVFP4 at the FP4 rate, on Blackwell only); a part with no figure for a format
(no block-scaled GEMM: A100, H100, H200; no FP4 before Blackwell) runs the format emulated, quantise →
dequantise → a GEMM in the compute dtype, so there P_f is the compute dtype's peak, and the line says so.

Accounting for this file (it is accounting): 1. it holds nothing; 2. no memory; 3. no messages; 4. no state.
"""

from __future__ import annotations

import torch

from accounting import memory
import mfu
from planner import hardware

NARROW = ("fp8", "mxfp8", "mxfp4", "nvfp4")  # formats with a GEMM of their own; any other part (bf16) is the compute


def flops_by_format(config, seq_len: int, forward: str, backward: str, compute: str, tail_layers: int = 0,
                    routed_experts: bool = False) -> dict:
    """Model FLOPs per token by format, {format: FLOPs}, summing to mfu.flops_per_token(...).model: the block
    linears of the first L − tail_layers blocks forward (2·N_q) in `forward`, backward (4·N_q) in `backward`,
    the rest in `compute`. A part that names no narrow format (the spec's bf16: not quantised) is the compute
    dtype. --fp8 is forward = backward = "fp8", no tail (E4M3/E5M2 at the FP8 rate alike). routed_experts: N_q
    counts the k routed experts a token visits too (--fp8 and a precision recipe quantise them)."""
    if not 0 <= tail_layers <= config.n_layer:
        raise ValueError(f"tail_layers must be in 0..{config.n_layer}, got {tail_layers}")
    total = mfu.flops_per_token(memory.param_counts(config), config, seq_len).model
    quantised = memory.param_counts(config, layers=range(config.n_layer - tail_layers), embedding=False,
                                    head=False)["fp8_matmul" if routed_experts else "dense_linears"]
    flops = {}
    for fmt, share in ((forward, 2 * quantised), (backward, 4 * quantised), (compute, total - 6 * quantised)):
        fmt = fmt if fmt in NARROW else compute
        flops[fmt] = flops.get(fmt, 0.0) + float(share)
    return flops


def format_peaks(hw: hardware.Hardware, formats, compute: str) -> tuple[dict, list]:
    """({format: FLOP/s}, [the formats emulated]): each format's dense peak on `hw`, or, where `hw` has none (no
    block-scaled GEMM, no FP4), the compute dtype's, the rate of the emulation's GEMM."""
    peaks, emulated = {}, []
    for fmt in formats:
        try:
            peaks[fmt] = hw.peak(fmt)
        except hardware.NoPeakKnown:
            peaks[fmt], emulated = hw.peak(compute), emulated + [fmt]
    return peaks, emulated


def format_weighted_peak(flops: dict, peaks: dict) -> float:
    """P_w = Σ_f F_f / Σ_f (F_f / P_f): the one peak that, dividing all the FLOPs, gives each format's FLOPs its
    own peak's time (the docstring's formula; with two formats 1 / (s/P_fast + (1 − s)/P_base), s the share)."""
    ideal_seconds = sum(f / peaks[fmt] for fmt, f in flops.items() if f)
    return sum(flops.values()) / ideal_seconds


def format_mfu(flops: dict, tokens_per_second: float, peaks: dict, n_devices: int) -> float:
    """MFU against the format-weighted peak: (tokens/s / n_devices) · Σ_f F_f / P_f (the docstring's formula)."""
    return mfu.mfu(sum(flops.values()), tokens_per_second, format_weighted_peak(flops, peaks), n_devices)


def weighted_peak_line(flops: dict, hw: hardware.Hardware, compute: str) -> str:
    """P_w on `hw` for printouts: 'P_w = ΣF / Σ F_f/P_f = 2,917 TFLOP/s on h100 (dense TFLOP/s: fp8 1978.9, bf16
    989.4)', naming the formats `hw` has no GEMM for (emulated: at the compute dtype's rate)."""
    peaks, emulated = format_peaks(hw, flops, compute)
    at = ", ".join(f"{fmt} {peaks[fmt] / 1e12:g}" for fmt in flops)
    note = f"; {', '.join(emulated)}: no such GEMM on {hw.name}, emulated at the {compute} rate" if emulated else ""
    return (f"P_w = ΣF / Σ F_f/P_f = {format_weighted_peak(flops, peaks) / 1e12:,.0f} TFLOP/s on {hw.name}"
            f" (dense TFLOP/s: {at}{note})")


def device_peaks(device, formats, compute: str, compute_peak: float) -> tuple[dict, list]:
    """({format: FLOP/s}, [the formats emulated]) on this run's device: a GPU's PEAK_TFLOPS row in each format's
    column (mfu.gpu_row); the compute dtype's peak as the run measured or was told it (`compute_peak`) for the
    compute dtype and for every format the device has no GEMM for (a CPU, a GPU before Blackwell, no row)."""
    row = None
    if torch.device(device).type == "cuda":
        row = mfu.gpu_row(torch.cuda.get_device_name(device), torch.cuda.get_device_properties(device)
                          .multi_processor_count)
    peaks, emulated = {}, []
    for fmt in formats:
        tflops = mfu.PEAK_TFLOPS[row].get(fmt) if row and fmt != compute else None
        peaks[fmt] = tflops * 1e12 if tflops else compute_peak
        emulated += [fmt] if fmt != compute and not tflops else []
    return peaks, emulated


def recipe_peak(flops: dict, peaks: dict, emulated: list, compute: str, peak: tuple) -> tuple[float, str]:
    """The step line's MFU peak under a precision recipe: (P_w, how), P_w the format-weighted peak of this
    step's FLOPs by format (the docstring's formula) on `peaks`, with peak = (the compute dtype's FLOP/s, how it
    was found). Where every narrow format is emulated P_w is the compute dtype's peak itself, and it says so."""
    weighted = format_weighted_peak(flops, peaks)
    shares = ", ".join(f"{fmt} {f / sum(flops.values()):.1%}" for fmt, f in flops.items())
    native = [f"{fmt} at {peaks[fmt] / 1e12:g} TFLOP/s" for fmt in flops if fmt not in emulated and fmt != compute]
    at = "; ".join(native + ([f"{', '.join(emulated)} emulated at the {compute} rate"] if emulated else []))
    return weighted, (f"format-weighted P_w = ΣF / Σ F_f/P_f over the model FLOPs by format ({shares}): {at};"
                      f" the step line's MFU divides by it; {compute}: {peak[1]}")


def run_peak(run, peak: tuple) -> tuple[float, str]:
    """run.peak under --precision-recipe: `recipe_peak` of its FLOPs by format on the run's device; `peak`
    (the compute dtype's) unchanged without one."""
    handle = next((axis for axis in run.axes if axis.name == "precision"), None)
    if handle is None:
        return peak
    recipe, compute = handle.recipe, mfu.format_dtype(run.compute_dtype)
    flops = flops_by_format(run.config, run.seq_len, recipe.fwd, recipe.bwd, compute,
                            recipe.tail_layers(run.config.n_layer), routed_experts=True)
    peaks, emulated = device_peaks(run.device, flops, compute, peak[0])
    return recipe_peak(flops, peaks, emulated, compute, peak)
