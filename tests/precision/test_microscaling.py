"""precision/microscaling.py: the MXFP8, MXFP4 and NVFP4 scale rules and roundings, checked bit for bit by hand.

Hand-computed blocks for each rule (E8M0 exponents at block amaxes on and off powers of two, zero blocks, tiny and
huge amaxes, saturation, NaN and infinity; NVFP4's block scale rounded once, on a case where rounding twice in
float32 gives the other neighbour, which the test shows). Round trips on randn(4096, 4096) at or above torchao's
SQNR thresholds (MXFP8 ≥ 18 dB, MXFP4 ≥ 13 dB, NVFP4 ≥ 8 dB; the NVFP4 GEMM with both operands quantised ≥ 16 dB
against fp32). Stochastic rounding is unbiased: over n draws the mean error stays within 5 standard errors,
5·σ/√n (σ the per-draw deviation, known exactly from the two neighbours), for n from 10² to 10⁶, a bound that
round-to-nearest breaks (asserted too). The Hadamard matrix is orthogonal and leaves the weight-gradient GEMM
unchanged in float64 (1e-12); 2-D scaling quantises W and Wᵀ alike; fake_quantize is dequantize∘quantize bitwise.
Beyond the hand cases, every format is compared element by element with a reference written from the published
rules in exact rational arithmetic (fractions.Fraction), on inputs built to land on many rounding ties.
"""

import math
from fractions import Fraction

import pytest
import torch

from precision import microscaling as ms
from precision.microscaling import dequantize, e8m0_exponent, fake_quantize, quantize

# --- E8M0 exponents -----------------------------------------------------------------------------------------------

TINY, HUGE, HUGER = 2.0 ** -140, 1.5 * 2.0 ** 127, 1.9 * 2.0 ** 127
EXPONENT_CASES = [  # (amax, element max, rceil ⌈log2(amax/max)⌉, floor ⌊log2 amax⌋ - emax), worked by hand
    (448.0, 448.0, 0, 0),  # at the format's max
    (449.0, 448.0, 1, 0),  # just above: floor saturates 449 → 448, rceil takes the next power of two
    (256.0, 448.0, 0, 0),  # a power of two: 256/448 = 2^-0.81
    (512.0, 448.0, 1, 1),  # a power of two above the max: 512/448 = 2^0.19
    (1.0, 448.0, -8, -8),  # 1/448 = 2^-8.81
    (3.5, 448.0, -7, -7),  # 3.5/448 = 2^-7 exactly: mantissa 0.875 = 448/512, the rceil boundary
    (3.6, 448.0, -6, -7),  # 3.6/448 = 2^-6.96
    (6.0, 6.0, 0, 0), (7.0, 6.0, 1, 0), (4.0, 6.0, 0, 0), (8.0, 6.0, 1, 1),
    (0.75, 6.0, -3, -3),  # 0.75/6 = 2^-3 exactly
    (0.8, 6.0, -2, -3),  # 0.8/6 = 2^-2.91
    (0.0, 448.0, -127, -127),  # a zero block: the smallest exponent, no NaN
    (TINY, 448.0, -127, -127),  # ⌊log2⌋ - 8 = -148: clamped to E8M0's smallest
    (HUGE, 448.0, 119, 119),  # 1.5·2^127/448 = 2^118.78
    (HUGE, 6.0, 125, 125),  # 1.5·2^127/6 = 2^125 exactly
    (HUGER, 6.0, 126, 125),  # 1.9·2^127/6 = 2^125.34; ⌊log2⌋ = 127, - 2
    (HUGE, 0.25, 127, 127),  # floor 127 + 2 = 129, rceil ⌈129.58⌉ = 130: both clamped to E8M0's largest
    (float("nan"), 448.0, 128, 128), (float("inf"), 6.0, 128, 128),  # 128 + 127 = 255, E8M0's NaN code
]


@pytest.mark.parametrize("amax, element_max, rceil, floor", EXPONENT_CASES)
def test_e8m0_exponent_by_hand(amax, element_max, rceil, floor):
    amax = torch.tensor([amax])
    assert e8m0_exponent(amax, element_max, "rceil").item() == rceil
    assert e8m0_exponent(amax, element_max, "floor").item() == floor
    assert e8m0_exponent(amax.double(), element_max, "rceil").item() == rceil  # float64 amaxes read the same


# --- Hand-computed blocks -----------------------------------------------------------------------------------------


def _block(values, block):
    x = torch.zeros(1, block)
    x[0, :len(values)] = torch.tensor(values)
    return x


@pytest.mark.parametrize("rule, scale_code, expected, saturated", [
    # 449 → floor: 2^0, clamped to 448 | rceil: 2^1, 224.5 rounds in [128, 256) by 16 to 224 → 448.
    # 3.3 → floor: [2, 4) by 1/4: 13.2 steps → 3.25 | rceil: 1.65 in [1, 2) by 1/8 → 1.625 → 3.25.
    # 0.001 → floor: subnormal step 2^-9, 0.512 steps → 2^-9 | rceil: 0.0005 is 0.256 steps → 0.
    # -17 → floor: [16, 32) by 2, 8.5 steps, a tie → 8 (even) → -16 | rceil: -8.5 in [8, 16) by 1, a tie → -8 → -16.
    ("floor", 127, [448.0, 3.25, 2.0 ** -9, -16.0], 1),
    ("rceil", 128, [448.0, 3.25, 0.0, -16.0], 0),
])
def test_mxfp8_block_by_hand(rule, scale_code, expected, saturated):
    x = _block([449.0, 3.3, 0.001, -17.0], 32)
    q = quantize(x, "mxfp8", rule=rule, count_saturated=True)
    assert q.block_scales.tolist() == [[scale_code]]
    assert dequantize(q, torch.float32)[0, :4].tolist() == expected
    grid = torch.tensor(expected) / 2.0 ** (scale_code - 127)
    assert torch.equal(q.codes[0, :4].view(torch.uint8), grid.to(torch.float8_e4m3fn).view(torch.uint8))
    assert q.saturated.item() == saturated


@pytest.mark.parametrize("rule, scale_code, expected, first_bytes, saturated", [
    # 7 → floor: 2^0, clamped to 6 | rceil: 2^1, 3.5 is a tie of 3 and 4 → 4 (even mantissa) → 8.
    # 1.25 → floor: a tie of 1 and 1.5 → 1 | rceil: 0.625 in steps of 0.5 → 0.5 → 1.
    # -0.3 → floor: 0.6 steps of 0.5 → -0.5 | rceil: -0.15 → -0.
    # 2.5 → floor: a tie of 2 and 3 → 2 | rceil: 1.25, a tie → 1 → 2.
    # 5 → floor: a tie of 4 and 6 → 4 | rceil: 2.5, a tie → 2 → 4.
    # Bytes: the even element in the low nibble, a code is sign<<3 | index into (0, .5, 1, 1.5, 2, 3, 4, 6).
    ("floor", 127, [6.0, 1.0, -0.5, 2.0, 4.0], [7 | 2 << 4, (8 | 1) | 4 << 4], 1),
    ("rceil", 128, [8.0, 1.0, -0.0, 2.0, 4.0], [6 | 1 << 4, (8 | 0) | 2 << 4], 0),
])
def test_mxfp4_block_by_hand(rule, scale_code, expected, first_bytes, saturated):
    x = _block([7.0, 1.25, -0.3, 2.5, 5.0], 32)
    q = quantize(x, "mxfp4", rule=rule, count_saturated=True)
    assert q.block_scales.tolist() == [[scale_code]]
    values = dequantize(q, torch.float32)[0, :5]
    assert values.tolist() == expected and torch.signbit(values).tolist() == [v < 0 or str(v) == "-0.0"
                                                                              for v in expected]
    assert q.codes[0, :2].tolist() == first_bytes and q.codes.shape == (1, 16)
    assert q.saturated.item() == saturated


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4"])
def test_zero_blocks_and_tiny_amax(fmt):
    """A zero block: smallest E8M0 exponent (code 0) or a zero E4M3 scale, zero codes, zeros back, no NaN.
    A block of amax 2^-125 (E8M0 exponent clamped to -127) still round-trips exactly: 2^-125 = 4·2^-127."""
    block = ms.FORMATS[fmt].block
    x = torch.zeros(2, 2 * block)
    x[1, 0] = 2.0 ** -125
    q = quantize(x, fmt)
    back = dequantize(q, torch.float32)
    assert not torch.isnan(back).any()
    assert back[0].eq(0).all() and q.codes[0].view(torch.uint8).eq(0).all()
    if fmt == "nvfp4":
        assert q.block_scales[0].float().tolist() == [0.0, 0.0]
    else:
        assert q.block_scales.tolist() == [[0, 0], [0, 0]]
        assert back[1, 0].item() == 2.0 ** -125


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_value_makes_its_block_nan(fmt, bad):
    """The stated policy: a block holding NaN or ±inf gets a NaN scale (E8M0 code 255, E4M3 NaN) and zero codes,
    so it dequantises to NaN everywhere; other blocks are untouched (NVFP4 given a finite tensor amax)."""
    block = ms.FORMATS[fmt].block
    x = torch.ones(1, 2 * block)
    x[0, block + 3] = bad
    tensor_amax = torch.tensor(1.0) if fmt == "nvfp4" else None
    q = quantize(x, fmt, tensor_amax=tensor_amax)
    back = dequantize(q, torch.float32)
    assert back[0, :block].eq(1).all() and back[0, block:].isnan().all()
    assert torch.isnan(q.block_scales.float()[0, 1]) if fmt == "nvfp4" else q.block_scales[0, 1].item() == 255
    assert fake_quantize(x, fmt, tensor_amax=tensor_amax)[0, block:].isnan().all()
    if fmt == "nvfp4":  # its own amax is not finite: S_enc is NaN, and so is every block
        assert dequantize(quantize(x, fmt), torch.float32).isnan().all()


def test_nvfp4_by_hand():
    """tensor amax 1: S_enc = 2688. Block 1 (amax 1): d = e4m3(2688/6 = 448) = 448, so q = rne(6x):
    1 → 6, 0.3 → 1.8 → 2 (steps of 0.5 in [1, 2)), -0.05 → -0.3 → -0.5. Block 2 (amax 0.01): 4.48 rounds in
    [4, 8) by 0.5 to 4.5, q = rne(x·2688/4.5): 0.01 → 5.97 → 6 (steps of 2 in [4, 6]), 0.004 → 2.39 → 2.
    Back: q·d/2688 in float32 (q·d exact, one rounding)."""
    x = torch.zeros(1, 32)
    x[0, :3] = torch.tensor([1.0, 0.3, -0.05])
    x[0, 16:18] = torch.tensor([0.01, 0.004])
    q = quantize(x, "nvfp4")
    assert q.tensor_scale.item() == 2688.0 and q.block_scales.float().tolist() == [[448.0, 4.5]]
    back = dequantize(q, torch.float32)[0]
    expected = torch.tensor([6 * 448, 2 * 448, -0.5 * 448, 6 * 4.5, 2 * 4.5]) / torch.tensor(2688.0)
    assert torch.equal(torch.cat([back[:3], back[16:18]]), expected)


def test_nvfp4_saturation_and_a_scale_that_rounds_to_zero():
    """Given tensor amax 0.5 (e.g. a stale one) for a block of amax 1: d = e4m3(5376/6 = 896) saturates at 448, and
    1·5376/448 = 12 saturates at 6, back 6·448/5376 = 0.5. A block of amax 1e-7: 1e-7·448 is below E4M3's
    smallest subnormal 2^-9's half, so d = 0 and the block comes back as zeros (no NaN)."""
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 16] = 1.0, 1e-7
    q = quantize(x, "nvfp4", tensor_amax=torch.tensor(0.5), count_saturated=True)
    assert q.block_scales.float().tolist() == [[448.0, 0.0]] and q.saturated.item() == 1
    assert fake_quantize(x, "nvfp4", tensor_amax=torch.tensor(0.5), count_saturated=True)[1].item() == 1
    back = dequantize(q, torch.float32)
    assert back[0, 0].item() == 0.5 and back[0, 16].item() == 0 and not back.isnan().any()


def test_nvfp4_block_scale_is_rounded_once():
    """block amax a = 5.0136019e-05 (float32), tensor amax 1: a·2688/6 = 0.02246093656... lies just below the
    midpoint 0.0224609375 of the E4M3 neighbours 0.021484375 (mantissa 3) and 0.0234375 (mantissa 4), so one
    rounding gives 0.021484375. Rounding twice, a/6 then ·S_enc in float32, lands exactly on the midpoint, and its
    tie goes to the even mantissa, 0.0234375: the case tells the two apart."""
    a = torch.tensor([5.013601912651211e-05])
    exact = Fraction(a.item()) * 2688 / 6
    below, above = Fraction(0.021484375), Fraction(0.0234375)
    assert below < exact < (below + above) / 2
    twice = ((a / 6) * torch.tensor(2688.0)).to(torch.float8_e4m3fn).float().item()
    assert twice == float(above)
    x = torch.zeros(1, 16)
    x[0, 0] = a
    q = quantize(x, "nvfp4", tensor_amax=torch.tensor(1.0))
    assert q.block_scales.float().item() == float(below)


def _e2m1_codes(q) -> list:
    """The 4-bit codes of a Quantized's first row, unpacked (the even element in the low nibble)."""
    packed = q.codes[0]
    return torch.stack([packed & 15, packed >> 4], dim=1).reshape(-1).tolist()


def test_nvfp4_tensor_scale_is_one_true_division():
    """S_enc = 2688/amax rounded ONCE: amax 112 gives exactly 24 (2688 = 24·112). Then the block [3, 0.125, 0.625,
    1.25, 2.5] (amax 3: d = e4m3(3·24/6 = 12) = 12) scales by 24/12 = 2 onto E2M1's ties [6, 0.25, 1.25, 2.5, 5],
    which round to even: codes [7, 0, 2, 4, 6] (torchao's and TransformerEngine's). A reciprocal times 2688
    (`2688.0 / amax` in torch) gives 24.000001907 and pushes every tie up: [7, 1, 3, 5, 7]."""
    assert ms.nvfp4_tensor_scale(torch.tensor(112.0)).item() == 24.0
    x = torch.zeros(1, 32)
    x[0, :5] = torch.tensor([3, 0.125, 0.625, 1.25, 2.5])
    x[0, 16] = 112.0
    q = quantize(x, "nvfp4")
    assert q.tensor_scale.item() == 24.0 and q.block_scales.float().tolist() == [[12.0, 448.0]]
    assert _e2m1_codes(q)[:5] == [7, 0, 2, 4, 6]
    assert fake_quantize(x, "nvfp4")[0, :5].tolist() == [3.0, 0.0, 0.5, 1.0, 2.0]
    amaxes = torch.rand(10_000, generator=torch.Generator().manual_seed(3)) * 100  # one rounding, every one
    assert torch.equal(ms.nvfp4_tensor_scale(amaxes), torch.tensor(2688.0).div(amaxes))


def test_e4m3_grid_rounding_matches_torch_cast():
    """The element rounding (exponent bits, then the float's own round-to-nearest-even) against torch's float8 cast,
    on random magnitudes across E4M3's range, every representable value and every midpoint (ties)."""
    generator = torch.Generator().manual_seed(0)
    random = torch.randn(200_000, generator=generator) * 2.0 ** torch.randint(-14, 9, (200_000,), generator=generator)
    values = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    y = torch.cat([random.clamp(-448, 448), values, (values[1:] + values[:-1]) / 2])
    y = torch.cat([y, -y])
    expected = y.to(torch.float8_e4m3fn).float()
    assert torch.equal(ms._round_to_grid(y.clone(), ms.ELEMENTS["e4m3"], None), expected)
    assert torch.equal(ms._round_to_grid(y.double(), ms.ELEMENTS["e4m3"], None), expected.double())


# --- Against an exact reference written from the published rules (rational arithmetic) ----------------------------

E4M3_MAGNITUDES = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).tolist()  # 0 .. 448, by code
GRIDS = {"e4m3": [Fraction(v) for v in E4M3_MAGNITUDES], "e2m1": [Fraction(v) for v in ms.E2M1_VALUES]}


def _reference_round(value: Fraction, grid) -> Fraction:
    """Saturate, then round |value| to the nearest grid magnitude, a tie to the even code (codes count up the grid)."""
    magnitude = min(abs(value), grid[-1])
    upper = next(i for i, g in enumerate(grid) if g >= magnitude)
    lower = upper if grid[upper] == magnitude else upper - 1
    below, above = magnitude - grid[lower], grid[upper] - magnitude
    index = lower if below < above or (below == above and lower % 2 == 0) else upper
    return grid[index] if value >= 0 else -grid[index]


def _reference_e8m0(amax: Fraction, element_max: float, rule: str) -> int:
    if amax == 0:
        return -127
    floor_log2 = math.floor(math.log2(amax))  # then corrected, so it is exact
    floor_log2 += (Fraction(2) ** (floor_log2 + 1) <= amax) - (Fraction(2) ** floor_log2 > amax)
    if rule == "floor":
        exponent = floor_log2 - (math.frexp(element_max)[1] - 1)
    else:
        exponent = floor_log2 - 20
        while amax > Fraction(element_max) * Fraction(2) ** exponent:
            exponent += 1
    return max(-127, min(127, exponent))


def _decoded_grid(q):
    """The element values of q (before the block scales), from its codes."""
    if q.codes.dtype == torch.float8_e4m3fn:
        return q.codes.float()
    nibbles = torch.stack([q.codes & 15, q.codes >> 4], dim=-1).flatten(-2)
    values = torch.tensor(ms.E2M1_VALUES)[(nibbles & 7).long()]
    return torch.where(nibbles >= 8, -values, values)


def _tie_rich_input(rows, cols, dtype, seed):
    """Values on a coarse grid (multiples of 1/16 times a power of two per row), so that many land on ties."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(-96, 97, (rows, cols), generator=generator).float() / 16
    return (x * 2.0 ** torch.randint(-6, 7, (rows, 1), generator=generator)).to(dtype)


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4"])
@pytest.mark.parametrize("rule", ["rceil", "floor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mx_against_an_exact_reference(fmt, rule, dtype):
    x = _tie_rich_input(8, 64, dtype, seed=11)
    x[1] = torch.randn(64, generator=torch.Generator().manual_seed(12)).to(dtype)  # and arbitrary values
    fmt_ = ms.FORMATS[fmt]
    q = quantize(x, fmt, rule=rule)
    back = dequantize(q, torch.float32)
    for row in range(x.shape[0]):
        for start in range(0, x.shape[1], fmt_.block):
            block = [Fraction(v) for v in x[row, start:start + fmt_.block].float().tolist()]
            exponent = _reference_e8m0(max(abs(v) for v in block), fmt_.element_max, rule)
            assert q.block_scales[row, start // fmt_.block].item() == exponent + 127
            expected = [_reference_round(v / Fraction(2) ** exponent, GRIDS[fmt_.element]) * Fraction(2) ** exponent
                        for v in block]
            assert back[row, start:start + fmt_.block].tolist() == [float(v) for v in expected]


@pytest.mark.parametrize("tensor_amax", [None, 42.0, 3.3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nvfp4_against_an_exact_reference(tensor_amax, dtype):
    """S_enc is an fp32 number by definition (448·6/amax rounded once); from it on everything is exact rationals.
    A tensor amax of 42 makes S_enc = 64, a power of two, so many elements land exactly on E2M1 ties."""
    x = _tie_rich_input(8, 64, dtype, seed=13)
    x[1] = torch.randn(64, generator=torch.Generator().manual_seed(14)).to(dtype)
    amax = x.float().abs().max() if tensor_amax is None else torch.tensor(tensor_amax)
    q = quantize(x, "nvfp4", tensor_amax=None if tensor_amax is None else amax)
    tensor_scale = Fraction((torch.tensor(2688.0) / amax).item())
    assert Fraction(q.tensor_scale.item()) == tensor_scale
    grid = _decoded_grid(q)
    for row in range(x.shape[0]):
        for start in range(0, x.shape[1], 16):
            block = [Fraction(v) for v in x[row, start:start + 16].float().tolist()]
            decoded = _reference_round(max(abs(v) for v in block) * tensor_scale / 6, GRIDS["e4m3"])
            assert Fraction(q.block_scales[row, start // 16].float().item()) == decoded
            expected = [_reference_round(v * tensor_scale / decoded, GRIDS["e2m1"]) if decoded else 0 for v in block]
            assert grid[row, start:start + 16].tolist() == [float(v) for v in expected]


# --- Shapes, 2-D scaling, pieces, storage -------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4"])
def test_two_d_scaling_quantises_w_and_wt_alike(fmt):
    generator = torch.Generator().manual_seed(1)
    w = torch.randn(64, 128, generator=generator) * torch.rand(64, 1, generator=generator) * 10
    q, qt = quantize(w, fmt, two_d=True), quantize(w.t().contiguous(), fmt, two_d=True)
    assert torch.equal(dequantize(q, torch.float32).t(), dequantize(qt, torch.float32))
    assert torch.equal(q.block_scales.t().view(torch.uint8), qt.block_scales.view(torch.uint8))
    one_d = dequantize(quantize(w, fmt), torch.float32).t()  # 1-D blocks: W and Wᵀ quantise differently
    assert not torch.equal(one_d, dequantize(quantize(w.t().contiguous(), fmt), torch.float32))


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("two_d", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("stochastic", [False, True])
def test_fake_quantize_is_dequantize_of_quantize(fmt, two_d, dtype, stochastic):
    generator = torch.Generator().manual_seed(2)
    x = (torch.randn(2, 32, 64, generator=generator) * 3).to(dtype)
    x[0, :16, :32] = 0  # a zero tile
    x[1, 16, 40] = float("nan")
    seeded = (lambda: torch.Generator().manual_seed(3)) if stochastic else (lambda: None)
    expected = dequantize(quantize(x, fmt, two_d=two_d, stochastic=seeded()), dtype)
    assert expected.dtype == dtype and expected.shape == x.shape
    torch.testing.assert_close(fake_quantize(x, fmt, two_d=two_d, stochastic=seeded()), expected,
                               rtol=0, atol=0, equal_nan=True)


def test_a_parameter_quantises_outside_autograd():
    """The quantisers are not differentiable (a recipe's backward is its own): a parameter goes in, a plain tensor
    comes out, as bitwise as its data's."""
    weight = torch.nn.Parameter(torch.randn(32, 64))
    for fmt in ms.FORMATS:
        out = fake_quantize(weight, fmt)
        assert not out.requires_grad and torch.equal(out, fake_quantize(weight.detach(), fmt))


def test_pieces_with_the_tensor_amax_quantise_as_the_whole():
    """Blocks are local, NVFP4's S_enc is not: pieces cut at block boundaries (rows, or columns at multiples of 16),
    each given the whole tensor's amax, quantise exactly as the whole (what a TP or CP rank does after a MAX)."""
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(4))
    whole = fake_quantize(x, "nvfp4")
    amax = x.abs().max()
    rows = torch.cat([fake_quantize(piece, "nvfp4", tensor_amax=amax) for piece in x.chunk(2, dim=0)], dim=0)
    cols = torch.cat([fake_quantize(piece, "nvfp4", tensor_amax=amax) for piece in x.split(16, dim=1)], dim=1)
    assert torch.equal(rows, whole) and torch.equal(cols, whole)
    smaller = min(x.chunk(2, dim=0), key=lambda piece: piece.abs().max())  # its own amax is not the tensor's
    assert not torch.equal(fake_quantize(smaller, "nvfp4"), fake_quantize(smaller, "nvfp4", tensor_amax=amax))


@pytest.mark.parametrize("fmt, bits", [("mxfp8", 8.25), ("mxfp4", 4.25), ("nvfp4", 4.5)])
def test_bits_per_element_include_the_scales(fmt, bits):
    n = 64 * 128
    q = quantize(torch.randn(64, 128), fmt)
    tensor_bits = 32 if fmt == "nvfp4" else 0
    assert ms.FORMATS[fmt].bits_per_element == bits and q.nbytes() * 8 == bits * n + tensor_bits


def test_bad_input_names_the_problem():
    with pytest.raises(ValueError, match="blocks of 32 must divide its last dim"):
        quantize(torch.zeros(4, 48), "mxfp8")
    with pytest.raises(ValueError, match="blocks of 16 must divide its last two dims"):
        quantize(torch.zeros(24, 32), "nvfp4", two_d=True)
    with pytest.raises(ValueError, match="expected one of rceil, floor"):
        quantize(torch.zeros(4, 32), "mxfp4", rule="nearest")


# --- Round trips on randn(4096, 4096), and the NVFP4 GEMM ---------------------------------------------------------

SQNR_THRESHOLDS = {"mxfp8": 18.0, "mxfp4": 13.0, "nvfp4": 8.0}  # torchao's tests
GEMM_THRESHOLD = 16.0


@pytest.fixture(scope="module")
def randn_4096():
    return torch.randn(4096, 4096, generator=torch.Generator().manual_seed(5)).bfloat16()


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4"])
def test_round_trip_sqnr_on_randn(randn_4096, fmt):
    sqnr = ms.sqnr_db(randn_4096, fake_quantize(randn_4096, fmt))
    print(f"{fmt} round trip on randn(4096, 4096) bf16: SQNR {sqnr:.2f} dB (threshold {SQNR_THRESHOLDS[fmt]})")
    assert sqnr >= SQNR_THRESHOLDS[fmt]


def test_nvfp4_gemm_sqnr_against_fp32():
    """Both operands quantised along the contraction dim K (X [M, K] by rows, W [N, K] by rows), the GEMM in bf16
    as the emulation runs it, against the fp32 GEMM of the unquantised operands."""
    generator = torch.Generator().manual_seed(6)
    x, w = torch.randn(256, 1024, generator=generator), torch.randn(512, 1024, generator=generator)
    out = fake_quantize(x.bfloat16(), "nvfp4") @ fake_quantize(w.bfloat16(), "nvfp4").t()
    sqnr = ms.sqnr_db(x @ w.t(), out)
    print(f"nvfp4 GEMM [256, 1024]·[1024, 512] vs fp32: SQNR {sqnr:.2f} dB (threshold {GEMM_THRESHOLD})")
    assert sqnr >= GEMM_THRESHOLD


# --- Stochastic rounding is unbiased -------------------------------------------------------------------------------

Z_BOUND = 5.0  # |mean error| ≤ 5·σ/√n: a correct SR fails it with probability ~6e-7 per check


def _mean_error_z_scores(fmt, value, lower, upper, anchor, stochastic, draws=(100, 10_000, 1_000_000)):
    """Quantise `value` n times (in blocks whose anchor element fixes the scale so that value's neighbours are
    lower and upper) and return |mean error|/(σ/√n) per n, σ = (upper - lower)·√(p(1-p)), p = (value - lower)/gap."""
    block = ms.FORMATS[fmt].block
    p = (value - lower) / (upper - lower)
    sigma = (upper - lower) * math.sqrt(p * (1 - p))
    generator = torch.Generator().manual_seed(7) if stochastic else None
    scores = []
    for n in draws:
        x = torch.full((-(-n // (block - 1)), block), value)
        x[:, 0] = anchor
        values = fake_quantize(x, fmt, stochastic=generator, tensor_amax=torch.tensor(1.0) if fmt == "nvfp4" else None)
        drawn = values[:, 1:].flatten()[:n].double()
        if stochastic:  # only ever the two neighbours, and both
            assert drawn.unique().tolist() == pytest.approx([lower, upper], rel=1e-6)
        scores.append(abs(drawn.mean().item() - value) / (sigma / math.sqrt(n)))
    return scores


SR_CASES = [  # (fmt, value, its neighbours, the anchor that fixes the block scale at 1)
    ("mxfp4", 2.4, 2.0, 3.0, 6.0),  # E2M1 with E8M0 2^0 (rceil 6/6)
    ("mxfp8", 1.03, 1.0, 1.125, 448.0),  # E4M3 with E8M0 2^0
    ("nvfp4", 0.4, 2.0 / 6, 3.0 / 6, 1.0),  # tensor and block amax 1: q = rne(6x), 2.4 between 2 and 3
]


@pytest.mark.parametrize("fmt, value, lower, upper, anchor", SR_CASES)
def test_stochastic_rounding_is_unbiased(fmt, value, lower, upper, anchor):
    scores = _mean_error_z_scores(fmt, value, lower, upper, anchor, stochastic=True)
    nearest = _mean_error_z_scores(fmt, value, lower, upper, anchor, stochastic=False)
    print(f"{fmt} {value}: |mean error|/(σ/√n) at n = 1e2, 1e4, 1e6: stochastic"
          f" {', '.join(f'{z:.2f}' for z in scores)}; nearest {', '.join(f'{z:.0f}' for z in nearest)}")
    assert max(scores) <= Z_BOUND, scores
    assert max(nearest) > Z_BOUND, nearest  # the bound tells the two apart: round-to-nearest's bias stays


# --- The random Hadamard transform -------------------------------------------------------------------------------


def test_random_hadamard_is_orthogonal_with_random_signs():
    h = ms.random_hadamard(16, torch.Generator().manual_seed(8))
    assert torch.equal(h @ h.t(), 16 * torch.eye(16)) and h.abs().eq(1).all()
    assert not torch.equal(h, ms.random_hadamard(16, torch.Generator().manual_seed(9)))


def test_hadamard_on_both_wgrad_operands_leaves_the_gemm_unchanged():
    """dW = dYᵀ·X contracts over the M tokens: each 16-token block of dYᵀ [N, M] and Xᵀ [K, M] times H/4 gives
    (dYᵀQ)(XᵀQ)ᵀ = dYᵀ·Q·Qᵀ·X = dYᵀ·X, Q block-diagonal orthonormal; in float64 to 1e-12."""
    generator = torch.Generator().manual_seed(10)
    grad_output = torch.randn(64, 48, generator=generator, dtype=torch.float64)
    x = torch.randn(64, 32, generator=generator, dtype=torch.float64)
    h = ms.random_hadamard(16, generator)
    grad_output_t, x_t = ms.hadamard_blocks(grad_output.t(), h), ms.hadamard_blocks(x.t(), h)
    assert not torch.allclose(x_t, x.t())
    assert (grad_output_t @ x_t.t() - grad_output.t() @ x).abs().max().item() <= 1e-12


def test_the_random_signs_change_the_quantised_wgrad_and_never_the_exact_one():
    """diag(s) goes BEFORE H: x·diag(s)·H/4. After H the signs commute with a sign-symmetric quantiser (a block's
    amax and each |element| unchanged) and cancel in dYᵀ·X, so every draw gave the same quantised weight gradient
    bit for bit. Before H they change what is quantised: four draws, four different NVFP4 wgrads (both operands
    to nearest), while each draw's exact product stays dYᵀ·X in float64 (1e-12)."""
    generator = torch.Generator().manual_seed(11)
    grad_output = torch.randn(64, 48, generator=generator, dtype=torch.float64)
    x = torch.randn(64, 32, generator=generator, dtype=torch.float64)
    exact = grad_output.t() @ x
    quantised = []
    for seed in range(4):
        h = ms.random_hadamard(16, torch.Generator().manual_seed(100 + seed))
        grad_output_t, x_t = ms.hadamard_blocks(grad_output.t(), h), ms.hadamard_blocks(x.t(), h)
        assert (grad_output_t @ x_t.t() - exact).abs().max().item() <= 1e-12
        quantised.append(fake_quantize(grad_output_t, "nvfp4") @ fake_quantize(x_t, "nvfp4").t())
    assert all(not torch.equal(quantised[i], quantised[j]) for i in range(4) for j in range(i))


def test_hadamard_blocks_is_the_block_times_the_matrix():
    """hadamard_blocks(x, H) multiplies each 16-wide block (a row vector) by H/4, H = diag(s)·Sylvester(16): the
    butterfly equals the GEMM with the matrix (float64, 1e-14), along any dim."""
    generator = torch.Generator().manual_seed(12)
    h = ms.random_hadamard(16, generator).double()
    assert torch.equal(h, torch.diag(h[:, 0]) @ ms.sylvester(16, dtype=torch.float64))
    x = torch.randn(3, 64, 5, generator=generator, dtype=torch.float64)
    by_gemm = (x.movedim(1, -1).reshape(3, 5, 4, 16) @ (h / 4)).reshape(3, 5, 64).movedim(-1, 1)
    assert (ms.hadamard_blocks(x, h, dim=1) - by_gemm).abs().max().item() <= 1e-14
