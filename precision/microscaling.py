"""Microscaling formats: MXFP8, MXFP4 and NVFP4, emulated exactly (one scale per small block of the contraction dim).

A tensor is cut into blocks of b consecutive elements along its LAST dimension (the GEMM's contraction dimension),
or into b×b tiles of its last two (`two_d`, for weights: W and Wᵀ then quantise alike). Each block keeps one scale;
its elements are rounded to a narrow float:

    MXFP8 (OCP MX v1.0)  b = 32, E4M3 elements (max 448), E8M0 scale 2^e:   x ≈ q·2^e,   q = rne(clamp(x/2^e, ±448))
    MXFP4 (OCP MX v1.0)  b = 32, E2M1 elements {0, .5, 1, 1.5, 2, 3, 4, 6}, E8M0 scale, the same rule (max 6)
    NVFP4 (NVIDIA 2025)  b = 16, E2M1 elements, an E4M3 block scale d and an fp32 scale S_enc per tensor:
        S_enc = 448·6 / amax_tensor,   d = e4m3(amax_block·S_enc/6),   q = rne(clamp(x·S_enc/d, ±6)),   x ≈ q·d/S_enc

The E8M0 exponent e of a block with largest magnitude amax (`e8m0_exponent`), element format maximum max_elem:
    rceil (default; cuBLAS's and torchao's training default)   e = ⌈log2(amax/max_elem)⌉: the smallest power of two
          that puts the block's amax within the elements' range, so nothing saturates;
    floor (the OCP spec's rule)   e = ⌊log2 amax⌋ - emax_elem (emax_elem = ⌊log2 max_elem⌋: 8 for E4M3, 2 for E2M1):
          the block's amax lands in the elements' top binade and saturates (clamps to max_elem) above max_elem·2^e.
Both are computed exactly from the float's exponent and mantissa (no log2 of a rounded quotient), then clamped to
E8M0's range 2^-127..2^127. Edge cases: an all-zero block gets the smallest exponent (-127) and zero elements (no
NaN); a block holding a NaN or an infinity gets E8M0's NaN code (255) and dequantises to NaN in every element, and
NVFP4 does the same with an E4M3 NaN block scale (a non-finite tensor amax makes every block NaN): a non-finite
value is never clamped into a finite one, so the trainer's non-finite count still sees it. NVFP4's block scale is
rounded to E4M3 ONCE from amax_block·S_enc/6, and its elements from x·S_enc/d: both products are exact in float64
(two 24-bit significands), and the one float64 division lands exactly on a tie of the narrow format only when the
exact quotient is one (a 48-bit numerator sits at least 2^-49 relatively from any other tie), so each rounds once
(for inputs of float32 precision or less; float64 inputs get the same computation). A block whose d rounds to 0
dequantises to zeros.

Rounding: elements round to nearest, ties to even, after a clamp to ±max_elem (saturating), or stochastically
(`stochastic`, a torch.Generator): up with probability equal to the distance from the lower neighbour divided by
the gap between the two neighbouring representable values, so E[q] = x exactly (for E2M1 and E4M3 alike).
The random Hadamard transform (`random_hadamard`, `hadamard_blocks`) multiplies each 16-wide block of the last dim
by H/4, H = diag(random ±1)·Sylvester(16) (the signs first): orthonormal, so applied to both operands of a GEMM
along its contraction dim (the weight-gradient GEMM dW = dYᵀ·X contracts over tokens) it changes nothing in exact
arithmetic while it spreads outliers across the block before quantisation, differently for each draw of the signs.

Hardware: H100/H200 (sm_90) have no block-scaled GEMM; here and on them a recipe quantises, dequantises and runs the
GEMM in bf16 (`fake_quantize`), which equals the real block-scaled GEMM's operands exactly for MX formats (q·2^e is
exact in bf16) and to one bf16 rounding for NVFP4 (the product with 1/S_enc). Blackwell (sm_100) runs the real one.

Symbols: n elements of a tensor, b the block (32 MX, 16 NVFP4).

1. Replicated and split: nothing; pure functions of a tensor. A block never crosses the last dim's end, so a tensor
   split along any dim at multiples of b (of b×b tiles for two_d) quantises piece by piece exactly as whole, except
   NVFP4's S_enc, which needs the logical tensor's amax (`tensor_amax`, e.g. MAX-reduced over the ranks that hold
   pieces of it): the only reduction a microscaling recipe needs.
2. Peak per device: the codes, n·8 bits (E4M3) or n·4 bits (E2M1, two per byte), and the scales, n/b bytes, plus one
   fp32 per tensor (NVFP4): bits per element with scales 8.25 (MXFP8), 4.25 (MXFP4), 4.5 + 32/n (NVFP4)
   (`BlockFormat.bits_per_element`). Temporaries while quantising: a few float32 copies of the tensor (float64 for
   NVFP4's exact division and for float64 inputs), 4·n to 8·n bytes each.
3. Messages: none (pure).
4. Restart state: none; stochastic rounding draws from the generator it is given, so its caller decides the seed.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

E2M1_VALUES = (0, .5, 1, 1.5, 2, 3, 4, 6)
E8M0_MIN_EXPONENT, E8M0_MAX_EXPONENT, E8M0_NAN = -127, 127, 255  # 2^(code-127); code 255 is NaN
E4M3_MAX, E2M1_MAX = 448.0, 6.0
NVFP4_TENSOR_SCALE_NUMERATOR = E4M3_MAX * E2M1_MAX  # S_enc = 448·6/amax: the largest block lands on the top of both


@dataclass(frozen=True)
class Element:
    """A narrow float as a grid: binades [2^E, 2^(E+1)) of 2^m steps each from E = min_exponent up to max, and
    below 2^min_exponent the subnormals, in the smallest binade's step 2^(min_exponent - m)."""
    name: str
    mantissa_bits: int  # m
    min_exponent: int
    max: float  # the largest finite magnitude (saturation clamps here)
    code_bits: int  # the storage width of one element: sign + exponent + mantissa


ELEMENTS = {"e4m3": Element("e4m3", 3, -6, E4M3_MAX, 8), "e2m1": Element("e2m1", 1, 0, E2M1_MAX, 4)}


@dataclass(frozen=True)
class BlockFormat:
    name: str  # "mxfp8" | "mxfp4" | "nvfp4"
    element: str  # "e4m3" | "e2m1"
    block: int  # elements per scale along the contraction dim
    scale: str  # "e8m0" | "e4m3"
    bits_per_element: float  # code bits + scale bits / block (NVFP4: + 32 bits per tensor)

    @property
    def element_max(self) -> float:
        return ELEMENTS[self.element].max


FORMATS = {"mxfp8": BlockFormat("mxfp8", "e4m3", 32, "e8m0", 8.25),
           "mxfp4": BlockFormat("mxfp4", "e2m1", 32, "e8m0", 4.25),
           "nvfp4": BlockFormat("nvfp4", "e2m1", 16, "e4m3", 4.5)}
RULES = ("rceil", "floor")


@dataclass(frozen=True)
class Quantized:
    """A block-scaled tensor. codes: E4M3 as torch.float8_e4m3fn [..., K]; E2M1 as uint8 [..., K/2], two codes a
    byte (the even element in the low nibble; a code is sign<<3 | the index into `E2M1_VALUES`). block_scales:
    E8M0 as uint8 (biased exponent, 255 NaN) or E4M3 as torch.float8_e4m3fn, [..., K/b] ([..., R/b, K/b] two_d).
    tensor_scale: NVFP4's S_enc (fp32, 0-dim), None for MX. saturated: elements the clamp cut, if counted."""
    codes: torch.Tensor
    block_scales: torch.Tensor
    tensor_scale: torch.Tensor | None
    shape: torch.Size
    fmt: BlockFormat
    two_d: bool = False
    saturated: torch.Tensor | None = None

    def nbytes(self) -> int:
        """What it occupies (and what a gather of it moves): codes, scales, the tensor scale."""
        extra = 4 if self.tensor_scale is not None else 0
        return self.codes.numel() * self.codes.element_size() + self.block_scales.numel() + extra


# --- Quantise and dequantise -------------------------------------------------------------------------------------


@torch.no_grad()
def quantize(x: torch.Tensor, fmt, rule: str = "rceil", two_d: bool = False,
             stochastic: torch.Generator | None = None, tensor_amax: torch.Tensor | None = None,
             count_saturated: bool = False) -> Quantized:
    """x [..., K] (K a multiple of the block; two_d: [..., R, K] with R a multiple too) → `Quantized`.
    rule: E8M0 exponents (MX formats only). stochastic: round the elements stochastically with this generator, or
    with these U[0, 1) draws (a tensor of x's shape: precision/recipe.py's, keyed by logical coordinates).
    tensor_amax: NVFP4's amax of the whole logical tensor (default: of x)."""
    fmt = FORMATS[fmt] if isinstance(fmt, str) else fmt
    element = ELEMENTS[fmt.element]
    y, block_scales, tensor_scale = _to_block_units(x, fmt, rule, two_d, tensor_amax)
    y.nan_to_num_(0.0, 0.0, 0.0)  # only in a block whose scale is NaN: it keeps zero codes, its scale the NaN
    saturated = (y.abs() > element.max).sum() if count_saturated else None
    grid = _round_to_grid(y.clamp_(-element.max, element.max), element, stochastic)
    codes = _encode(grid, element).reshape(x.shape)
    if element.code_bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales_shape = (*x.shape[:-2], x.shape[-2] // fmt.block) if two_d else x.shape[:-1]
    return Quantized(codes, block_scales.reshape(*scales_shape, x.shape[-1] // fmt.block), tensor_scale, x.shape,
                     fmt, two_d, saturated)


@torch.no_grad()
def dequantize(q: Quantized, dtype: torch.dtype) -> torch.Tensor:
    """The values q stands for, in dtype: q·2^e (MX: exact), (q·d)/S_enc (NVFP4: q·d exact, the division rounded
    once in float32, or float64 for a float64 dtype, then to dtype)."""
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    if q.codes.dtype == torch.float8_e4m3fn:
        grid = q.codes.to(wide)
    else:
        byte_values = _e2m1_byte_table(wide, q.codes.device)  # [256, 2]: the two values a byte holds
        grid = byte_values.index_select(0, q.codes.reshape(-1).to(torch.int32))
    grid = _blocks(grid.reshape(q.shape), q.fmt.block, q.two_d)
    scales = q.block_scales.unsqueeze(-1).unsqueeze(-3) if q.two_d else q.block_scales.unsqueeze(-1)
    return _from_block_units(grid, scales, q.tensor_scale, q.fmt).reshape(q.shape).to(dtype)


@torch.no_grad()
def fake_quantize(x: torch.Tensor, fmt, rule: str = "rceil", two_d: bool = False,
                  stochastic: torch.Generator | None = None, tensor_amax: torch.Tensor | None = None,
                  count_saturated: bool = False):
    """dequantize(quantize(x, ...), x.dtype), bit for bit, without the codes: what the emulated GEMMs multiply.
    With count_saturated, (that tensor, the number of elements the clamp cut) as `quantize` counts them."""
    fmt = FORMATS[fmt] if isinstance(fmt, str) else fmt
    element = ELEMENTS[fmt.element]
    y, block_scales, tensor_scale = _to_block_units(x, fmt, rule, two_d, tensor_amax)
    saturated = (y.abs() > element.max).sum() if count_saturated else None
    grid = _round_to_grid(y.clamp_(-element.max, element.max), element, stochastic)
    if grid.dtype != x.dtype and x.dtype != torch.float64:
        grid = grid.float()  # NVFP4's grid values are exact in float32; dequantize multiplies there
    out = _from_block_units(grid, block_scales, tensor_scale, fmt).reshape(x.shape).to(x.dtype)
    return (out, saturated) if count_saturated else out


def _to_block_units(x, fmt: BlockFormat, rule: str, two_d: bool, tensor_amax):
    """x in units of its block's scale (blocked, a new tensor; NaN in the blocks with a NaN scale), the block scales
    (E8M0 codes or E4M3, keepdim-shaped) and NVFP4's S_enc."""
    _check(x, fmt, rule, two_d)
    element = ELEMENTS[fmt.element]
    wide = torch.float64 if x.dtype == torch.float64 or fmt.scale == "e4m3" else torch.float32
    blocks = _blocks(x, fmt.block, two_d)
    amax = blocks.abs().amax(dim=(-3, -1) if two_d else -1, keepdim=True).to(wide)  # exact in x's own dtype
    blocks = blocks.to(wide)
    if fmt.scale == "e8m0":
        block_scales = (e8m0_exponent(amax, element.max, rule) + 127).to(torch.uint8)
        y = blocks * _power_of_two_table(wide, x.device, negate=True)[block_scales.long()]
        return y, block_scales, None
    tensor_amax = amax.max() if tensor_amax is None else torch.as_tensor(tensor_amax, device=x.device)
    tensor_scale = nvfp4_tensor_scale(tensor_amax)
    decoded = nvfp4_block_scale(amax, tensor_scale)  # float64 on E4M3's grid, NaN where not finite
    usable = torch.isfinite(decoded) & (decoded > 0)  # else a zero block (finite x/inf = 0) or a NaN one
    y = torch.mul(blocks, tensor_scale.double()).div_(torch.where(usable, decoded, math.inf))  # (x·S_enc exact)/d
    return y, decoded.to(torch.float8_e4m3fn), tensor_scale


def _from_block_units(grid, block_scales, tensor_scale, fmt: BlockFormat):
    """grid values (blocked) times their block's scale: exact for E8M0; (q·d exact)/S_enc rounded once for NVFP4."""
    if fmt.scale == "e8m0":
        return grid * _power_of_two_table(grid.dtype, grid.device)[block_scales.long()]
    return grid * block_scales.to(grid.dtype) / tensor_scale.to(grid.dtype)


# --- The scale rules ---------------------------------------------------------------------------------------------


def e8m0_exponent(amax: torch.Tensor, element_max: float, rule: str = "rceil") -> torch.Tensor:
    """The E8M0 scale's exponent e (int32) for blocks of largest magnitude amax: rceil ⌈log2(amax/element_max)⌉,
    floor ⌊log2 amax⌋ - ⌊log2 element_max⌋; clamped to [-127, 127]; -127 for amax 0; 128 (NaN's code - 127) for a
    non-finite amax. Exact: amax = m·2^k with m in [0.5, 1), so ⌊log2 amax⌋ = k - 1 and
    amax/2^(k-1-emax) = m·2^(emax+1), which exceeds element_max (rceil then takes one power of two more) iff
    m > element_max/2^(emax+1)."""
    if rule not in RULES:
        raise ValueError(f"E8M0 scale rule {rule!r}: expected one of {', '.join(RULES)}")
    max_exponent = math.frexp(element_max)[1] - 1
    mantissa, exponent = torch.frexp(amax)
    e = exponent - 1 - max_exponent
    if rule == "rceil":
        e = e + (mantissa > element_max / 2.0 ** (max_exponent + 1)).to(e.dtype)
    e = e.clamp(E8M0_MIN_EXPONENT, E8M0_MAX_EXPONENT)
    e = torch.where(amax == 0, E8M0_MIN_EXPONENT, e)
    return torch.where(torch.isfinite(amax), e, E8M0_NAN - 127).to(torch.int32)


def nvfp4_tensor_scale(tensor_amax: torch.Tensor, numerator: float = NVFP4_TENSOR_SCALE_NUMERATOR) -> torch.Tensor:
    """S_enc = 448·6/amax in fp32, one true division (rounded once, as TransformerEngine's; torch computes a
    Python number over a tensor as a reciprocal times the number, two roundings, one ulp off for about a quarter of
    amaxes); 1 for an all-zero tensor, capped at fp32's max for a tiny amax, NaN for a non-finite amax.
    numerator: the block scales' ceiling times the element's top (precision/quartet.py's 256·6 and 256·v)."""
    tensor_amax = tensor_amax.float()
    scale = torch.div(torch.tensor(numerator, device=tensor_amax.device), tensor_amax)
    scale = scale.clamp(max=torch.finfo(torch.float32).max)
    scale = torch.where(tensor_amax == 0, 1.0, scale)
    return torch.where(torch.isfinite(tensor_amax), scale, float("nan"))


def nvfp4_block_scale(block_amax: torch.Tensor, tensor_scale: torch.Tensor, top: float = E2M1_MAX) -> torch.Tensor:
    """d = e4m3(amax_block·S_enc/6), saturating at 448, rounded once: the product of two fp32 numbers is exact in
    float64 and the quotient by 6 is rounded there too finely to reach an E4M3 tie it is not on (its 48-bit numerator
    is at least 2^-49 relatively away from any other). Float64 values on E4M3's grid; NaN where not finite.
    top: the value the block's amax maps to (6; Four Over Six's second candidate 4, precision/quartet.py)."""
    exact = block_amax.double() * tensor_scale.double() / top
    decoded = _round_to_grid(exact.clamp(max=E4M3_MAX), ELEMENTS["e4m3"], None)
    return torch.where(torch.isfinite(exact), decoded, float("nan"))


# --- Rounding to a narrow float's grid ---------------------------------------------------------------------------

_EXPONENT_BITS = {torch.float32: (torch.int32, 0x7F800000, 23), torch.float64: (torch.int64, 0x7FF << 52, 52)}


def _round_to_grid(y: torch.Tensor, element: Element, stochastic: torch.Generator | None) -> torch.Tensor:
    """y (float32/64, within ±element.max) rounded to the element's grid, its sign kept. The step between
    the neighbours of y is 2^(E - m), E = max(⌊log2|y|⌋, min_exponent), read exactly from y's exponent bits.
    To nearest, ties to even: adding and subtracting c = 1.5·2^(E + F - m) (F the float's fraction bits) makes the
    float's own rounding-to-nearest-even round y at that step (|y| < 2^(E+1) ≪ c/2, so y + c stays in c's binade,
    whose spacing is the step, and c/step is even). Stochastic: up with probability (y - lower)/step, from the
    generator (on y's device)."""
    int_dtype, exponent_mask, fraction_bits = _EXPONENT_BITS[y.dtype]
    binade = (y.view(int_dtype) & exponent_mask).view(y.dtype).clamp_(min=2.0 ** element.min_exponent)  # 2^E
    if stochastic is None:
        magic = binade.mul_(1.5 * 2.0 ** (fraction_bits - element.mantissa_bits))
        return (y + magic).sub_(magic).copysign_(y)  # the sign: -0.1 rounds to -0, as the hardware's cast does
    step = binade.mul_(2.0 ** -element.mantissa_bits)
    steps = y / step  # exact: a power of two
    lower = steps.floor()
    uniform = (stochastic.reshape(steps.shape).to(steps.dtype) if torch.is_tensor(stochastic) else  # given draws
               torch.rand(steps.shape, generator=stochastic, dtype=steps.dtype, device=steps.device))
    return lower.add_(uniform < steps.sub_(lower)).mul_(step).copysign_(y)


def _encode(grid: torch.Tensor, element: Element) -> torch.Tensor:
    """Grid values → codes: E4M3 as torch.float8_e4m3fn (exact: they are on its grid); E2M1 as uint8 sign<<3 | index,
    read off the same E4M3 byte (E2M1's values are E4M3 values): 0.5 is 0x30, 1..6 are 0x38..0x4C in steps of 4."""
    codes = grid.to(torch.float8_e4m3fn)
    if element.code_bits == 8:
        return codes
    byte = codes.view(torch.uint8)
    magnitude = byte & 0x7F
    index = torch.where(magnitude >= 0x38, (magnitude >> 2) - 12, magnitude >> 5)
    return index | ((byte & 0x80) >> 4)


@functools.lru_cache(maxsize=None)
def _e2m1_byte_table(dtype, device) -> torch.Tensor:
    nibble = torch.tensor(E2M1_VALUES, dtype=dtype)
    nibble = torch.cat([nibble, -nibble])  # sign<<3 | index
    byte = torch.arange(256)
    return torch.stack([nibble[byte & 15], nibble[byte >> 4]], dim=1).to(device)


# --- Blocks ------------------------------------------------------------------------------------------------------


def _blocked_shape(shape, block: int, two_d: bool):
    if two_d:
        *lead, rows, cols = shape
        return (*lead, rows // block, block, cols // block, block)
    *lead, cols = shape
    return (*lead, cols // block, block)


def _blocks(x: torch.Tensor, block: int, two_d: bool) -> torch.Tensor:
    """[..., K] → [..., K/b, b]; two_d: [..., R, K] → [..., R/b, b, K/b, b] (a view)."""
    return x.reshape(_blocked_shape(x.shape, block, two_d))


@functools.lru_cache(maxsize=None)
def _power_of_two_table(dtype, device, negate: bool = False) -> torch.Tensor:
    """2^(code - 127) for each E8M0 code (NaN at 255); negate: 2^(127 - code), what the quantiser multiplies by.
    Exact in float32 too: 2^-127 is a float32 subnormal, 2^127 below its max."""
    sign = -1 if negate else 1
    table = [math.ldexp(1.0, sign * (code - 127)) for code in range(E8M0_NAN)] + [math.nan]
    return torch.tensor(table, dtype=dtype, device=device)


def _check(x: torch.Tensor, fmt: BlockFormat, rule: str, two_d: bool):
    if rule not in RULES:
        raise ValueError(f"E8M0 scale rule {rule!r}: expected one of {', '.join(RULES)}")
    if not x.is_floating_point():
        raise ValueError(f"{fmt.name}: expected a floating-point tensor, got {x.dtype}")
    dims = x.shape[-2:] if two_d else x.shape[-1:]
    if len(dims) < (2 if two_d else 1) or any(d % fmt.block for d in dims):
        what = "its last two dims" if two_d else "its last dim"
        raise ValueError(f"{fmt.name}: blocks of {fmt.block} must divide {what}, got shape {tuple(x.shape)}")


# --- The random Hadamard transform and the error measure ---------------------------------------------------------


def sylvester(size: int, device="cpu", dtype=torch.float32) -> torch.Tensor:
    """Sylvester's Hadamard matrix of a power-of-two size: [[S, S], [S, -S]] from [1] (entries ±1, symmetric)."""
    if size < 1 or size & (size - 1):
        raise ValueError(f"Hadamard size {size}: expected a power of two")
    matrix = torch.ones(1, 1, device=device, dtype=dtype)
    while matrix.shape[0] < size:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)], 0)
    return matrix


def random_hadamard(size: int = 16, generator: torch.Generator | None = None) -> torch.Tensor:
    """H = diag(s)·Sylvester(size), s random ±1 from generator: H·Hᵀ = size·I (float32, entries ±1). A block
    (a row vector b) becomes b·H = (b·diag(s))·Sylvester: the signs flip elements BEFORE the mixing, as
    TransformerEngine's and torchao's random Hadamard transforms do. (After it, b·Sylvester·diag(s), a sign flip
    of each output commutes with any sign-symmetric quantiser and cancels between a GEMM's two operands: the
    quantised product would not depend on the draw at all.)"""
    device = generator.device if generator is not None else "cpu"
    signs = torch.randint(0, 2, (size,), generator=generator, device=device).float().mul_(2).sub_(1)
    return signs[:, None] * sylvester(size, device)


def hadamard_blocks(x: torch.Tensor, hadamard: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """x with each size-wide block of `dim` (a row vector b) multiplied by H/√size (orthonormal): both operands of
    a GEMM transformed along their contraction dim give the same product. H = diag(s)·Sylvester(size)
    (`random_hadamard`) is applied as b·diag(s) (exact), then the fast Walsh-Hadamard butterfly, log2(size) stages
    of (a + b, a - b) over halves, then /√size (exact for size 4^k: 16 gives 1/4): a fixed order of additions, so
    the result is the same bits in any memory layout (a GEMM's summation order is its library's), and
    n·log2(size) additions instead of n·size."""
    size = hadamard.shape[0]
    dim = dim % x.dim()
    if x.shape[dim] % size:
        raise ValueError(f"Hadamard transform of {size}: must divide dim {dim}, got shape {tuple(x.shape)}")
    signs = hadamard[:, 0].to(x.device, x.dtype)  # Sylvester's first column is all ones: H's is s
    if not torch.equal(hadamard.to(x.device, x.dtype), signs[:, None] * sylvester(size, x.device, x.dtype)):
        raise ValueError("hadamard_blocks: expected diag(±1)·Sylvester(size), as random_hadamard makes")
    trailing = [1] * (x.dim() - 1 - dim)
    blocks = x.unflatten(dim, (-1, size))  # the block's axis is dim + 1
    buffers = [torch.empty(blocks.shape, dtype=x.dtype, device=x.device) for _ in range(2)]  # contiguous
    v = torch.mul(blocks, signs.view(size, *trailing), out=buffers[0])
    half, stage = size // 2, 0
    while half:  # each stage reads the last one's result and writes the other buffer: no temporaries
        pairs = v.unflatten(dim + 1, (size // (2 * half), 2, half))
        v = buffers[(stage + 1) % 2]
        out = v.unflatten(dim + 1, (size // (2 * half), 2, half))
        a, b = pairs.select(dim + 2, 0), pairs.select(dim + 2, 1)
        torch.add(a, b, out=out.select(dim + 2, 0))
        torch.sub(a, b, out=out.select(dim + 2, 1))
        half, stage = half // 2, stage + 1
    return v.mul_(1 / math.sqrt(size)).flatten(dim, dim + 1)


def sqnr_db(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """Signal to quantisation-noise ratio, 10·log10(Σx² / Σ(x - x̂)²), in float64 (inf when equal)."""
    x, x_hat = x.double(), x_hat.double()
    noise = (x - x_hat).square().sum().item()
    return math.inf if noise == 0 else 10 * math.log10(x.square().sum().item() / noise)
