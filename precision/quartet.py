"""Quartet II's NVFP4 quantisers: Four Over Six for the forward, MS-EDEN for the backward (emulated exactly).

Four Over Six (4/6; Cook et al., arXiv 2512.02010). E2M1's grid {0, .5, 1, 1.5, 2, 3, 4, 6} is coarsest at its top
(4 → 6 is a step of 2), where NVFP4 puts each block's largest element. 4/6 quantises each 16-element block twice
and keeps the better of the two:

    S = 6·256/amax_tensor (fp32, one division: block scales stay ≤ 256 so that the second candidate's fit E4M3)
    six:   d₆ = e4m3(amax_block·S/6),  q₆ = rne(clamp(x·S/d₆, ±6))      (plain NVFP4's rule, block max → 6)
    four:  d₄ = e4m3(amax_block·S/4),  q₄ = rne(clamp(x·S/d₄, ±6))      (block max → 4: a finer step near it)
    keep four iff Σ(q₄·d₄ - x·S)² < Σ(q₆·d₆ - x·S)² over the block     (MSE in S·x's units; a tie keeps six)
    x ≈ q·d/S

The metric is the mean squared error (the default rule, "mse", of the reference implementation,
mit-han-lab/fouroversix). Computed in float64, where x·S and q·d are exact and x·S/d rounds once
(precision/microscaling.py's argument).

MS-EDEN (Panferov et al., "Quartet II", arXiv 2601.22813; IST-DASLab/Quartet-II). An unbiased quantiser that
keeps round-to-nearest's small error for the elements and moves the randomness to the block scales. Along the
GEMM's contraction dim, in groups of G (128 in the paper):

    r = x·diag(s)·H_G/√G                      a random rotation (random signs s, then Sylvester's Hadamard)
    S = 256·v/amax(r),  v = 6/(17/16·0.93)   (Quartet II's constants: block scales ≤ 256 leave room above for
    d = e4m3(amax_block(r)·S/v)               the correction; the block max lands at v ≈ 6.07 and is clamped to 6)
    q = rne(clamp(r·S/d, ±6))                 round to nearest: the error of plain NVFP4, not SR's
    c = ⟨r, r⟩ / ⟨r, q·d/S⟩ per group        EDEN's correction: ⟨r, c·q·d/S⟩ = ‖r‖², the projection on r exact
    d' = SR_e4m3(c·d)                         the corrected scale rounded stochastically to E4M3: E[d'] = c·d
    r ≈ q·d'/S                                (in the rotated basis: the GEMM multiplies two operands rotated alike)

so E[q·d'/S | s] = c·Q(r), EDEN's estimate, and over the random rotation Rᵀ·c·Q(R·x) is unbiased for x (EDEN,
Vargaftik et al. 2022, exactly for uniform rotations; for random-sign Hadamards, measured: the mean of n estimates
of a 64×256 tensor with G = 128 had n·‖mean − x‖²/MSE₁ = 1.02 at n = 4096, 1 being unbiased;
tests/precision/test_quartet.py checks n ≤ 256). The correction is taken in the rotated tensor's own units, the
exact form of ⟨x, x⟩/⟨x, x̂⟩; Quartet II's kernel sums r·S/d (each block in its own units), which equals it when
the group's block scales are equal and drifts from unbiased otherwise (the same measurement gave it 1.12 at
n = 4096, rows spread over 2^3).

Symbols: n elements of a tensor, b = 16 the block, G the rotation group (a multiple of b).

1. Replicated and split: nothing; pure functions. A block (and a rotation group) never crosses the last dim's end, so
   a tensor split at multiples of b (of G) quantises piece by piece as whole given the tensor amax (MAX-reduced over
   the ranks holding pieces, as NVFP4's) and, for MS-EDEN, the same signs and scale draws per logical block.
2. Peak per device: as NVFP4, 4.5 bits per element with the scales; temporaries a few float64 copies (8·n bytes
   each: 4/6 holds both candidates).
3. Messages: none (pure).
4. Restart state: none; MS-EDEN's signs and draws are given by the caller.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from precision import microscaling as ms

FOUR_OVER_SIX_BLOCK_SCALE_MAX = 256.0  # the six-candidate's block scales stay ≤ 256, the four's ≤ 384 < 448
EDEN_GROUP = 128  # the paper's rotation group (its Hadamard's size)
EDEN_SCALE_OVERRIDE = 17 / 16 * 0.93  # Quartet II's backward constant: the block max lands at 6/0.988 ≈ 6.07
EDEN_BLOCK_SCALE_MAX = 256.0  # room above for the correction c (≤ 448/256 = 1.75)
BLOCK = 16
_E2M1, _E4M3 = ms.ELEMENTS["e2m1"], ms.ELEMENTS["e4m3"]


@dataclass(frozen=True)
class Quantized46:
    """4/6's result: the dequantised values (x's shape and dtype), which blocks kept four ([..., K/16] bool) and the
    elements the clamp at 6 cut in the kept candidates."""
    values: torch.Tensor
    fours: torch.Tensor
    saturated: torch.Tensor


@dataclass(frozen=True)
class QuantizedEden:
    """MS-EDEN's result, in the rotated basis: the dequantised values q·d'/S (x's shape, `dtype`), the corrections c
    ([..., K/G]) and the elements the clamp cut beyond the override's v (those the design did not mean to clamp: a
    block scale rounded down; the block maxima at v, clamped to 6 by design, are not counted)."""
    values: torch.Tensor
    corrections: torch.Tensor
    saturated: torch.Tensor


@torch.no_grad()
def four_over_six(x: torch.Tensor, tensor_amax: torch.Tensor | None = None) -> Quantized46:
    """x [..., K] (K a multiple of 16) quantised in 1×16 NVFP4 blocks along its last dim with each block's better
    of max → 6 and max → 4 (module docstring); tensor_amax: the logical tensor's (default: x's)."""
    _check(x, BLOCK)
    blocks = x.reshape(*x.shape[:-1], -1, BLOCK).double()
    amax = blocks.abs().amax(-1, keepdim=True)
    tensor_amax = amax.max() if tensor_amax is None else torch.as_tensor(tensor_amax, device=x.device)
    scale = ms.nvfp4_tensor_scale(tensor_amax, ms.E2M1_MAX * FOUR_OVER_SIX_BLOCK_SCALE_MAX).double()
    target = blocks * scale  # x·S, exact
    best = None
    for top in (ms.E2M1_MAX, 4.0):
        d = ms.nvfp4_block_scale(amax, scale, top)  # float64 on E4M3's grid, NaN where not finite
        usable = torch.isfinite(d) & (d > 0)
        y = target / torch.where(usable, d, math.inf)
        saturated = y.abs() > ms.E2M1_MAX
        grid_times_d = ms._round_to_grid(y.clamp_(-ms.E2M1_MAX, ms.E2M1_MAX), _E2M1, None).mul_(d)  # q·d, exact
        error = (grid_times_d - target).square_().sum(-1, keepdim=True)
        if best is None:
            best = (grid_times_d, error, saturated)
            continue
        four = error < best[1]  # strictly: a tie keeps six, as the reference
        values = torch.where(four, grid_times_d, best[0])
        clamped = torch.where(four, saturated, best[2]).sum()
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    out = (values.to(wide) / scale.to(wide)).reshape(x.shape).to(x.dtype)  # q·d exact, then /S rounded once
    return Quantized46(out, four.squeeze(-1), clamped)


@torch.no_grad()
def ms_eden(x: torch.Tensor, hadamard: torch.Tensor, draws: torch.Tensor, tensor_amax: torch.Tensor | None = None,
            dtype: torch.dtype | None = None) -> QuantizedEden:
    """x [..., K] rotated in groups of G = hadamard's size along its last dim (microscaling.hadamard_blocks, the signs
    first), then `eden_rotated`. draws: U[0, 1) per block scale ([..., K/16]); tensor_amax: of the ROTATED logical
    tensor (default: of this one's rotation)."""
    return eden_rotated(ms.hadamard_blocks(x, hadamard), hadamard.shape[0], draws, tensor_amax, dtype)


@torch.no_grad()
def eden_rotated(r: torch.Tensor, group: int, draws: torch.Tensor, tensor_amax: torch.Tensor | None = None,
                 dtype: torch.dtype | None = None) -> QuantizedEden:
    """MS-EDEN of an already rotated r [..., K] (K a multiple of group, group of 16): NVFP4 to nearest with
    Quartet II's scales, each group's EDEN correction folded into its block scales, which are then rounded
    stochastically to E4M3 with `draws` (module docstring). Values in `dtype` (default r's), in the rotated basis."""
    _check(r, group)
    if group % BLOCK:
        raise ValueError(f"MS-EDEN: the rotation group {group} must be a multiple of the {BLOCK}-element block")
    shape, dtype = r.shape, dtype or r.dtype
    blocks = r.reshape(*shape[:-1], -1, BLOCK).to(torch.float64, copy=True)
    amax = blocks.abs().amax(-1, keepdim=True)
    tensor_amax = amax.max() if tensor_amax is None else torch.as_tensor(tensor_amax, device=r.device)
    top = ms.E2M1_MAX / EDEN_SCALE_OVERRIDE
    scale = ms.nvfp4_tensor_scale(tensor_amax, EDEN_BLOCK_SCALE_MAX * top).double()
    d = ms.nvfp4_block_scale(amax, scale, top)
    usable = torch.isfinite(d) & (d > 0)
    target = blocks.mul_(scale)  # r·S, exact (blocks is a float64 copy)
    y = target / torch.where(usable, d, math.inf)
    saturated = (y.abs() > top).sum()
    q = ms._round_to_grid(y.clamp_(-ms.E2M1_MAX, ms.E2M1_MAX), _E2M1, None)
    # c = ⟨r, r⟩/⟨r, q·d/S⟩ per group of G/16 blocks: in S·r's units, Σ(r·S)² / Σ(r·S)(q·d)
    per_group = (-1, group // BLOCK)
    grid_times_d = (q * d).unflatten(-2, per_group)
    numerator = torch.linalg.vector_norm(target.unflatten(-2, per_group), dim=(-2, -1), keepdim=True).square_()
    denominator = (target.unflatten(-2, per_group) * grid_times_d).sum((-2, -1), keepdim=True)
    correction = torch.where(denominator > 0, numerator / denominator, 1.0)
    corrected = (d.unflatten(-2, per_group) * correction).flatten(-3, -2).clamp_(max=ms.E4M3_MAX)
    d_sr = ms._round_to_grid(corrected, _E4M3, draws.reshape(corrected.shape))
    d_sr = torch.where(usable, d_sr, d)  # a zero block stays zero, a NaN one NaN
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    out = (q.mul_(d_sr).to(wide) / scale.to(wide)).reshape(shape).to(dtype)
    return QuantizedEden(out, correction.reshape(*shape[:-1], -1), saturated)


def _check(x: torch.Tensor, group: int) -> None:
    if not x.is_floating_point():
        raise ValueError(f"Quartet II's NVFP4: expected a floating-point tensor, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] % group:
        raise ValueError(f"Quartet II's NVFP4: groups of {group} must divide the last dim, got shape {tuple(x.shape)}")
