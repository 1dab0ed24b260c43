"""precision/microscaling_fast.py: the recipe's float32 fake quantiser equals microscaling.fake_quantize bit for bit.

Every format, scale rule, 1-D and 2-D blocks, round-to-nearest and stochastic rounding, with and without a given
tensor amax, on random values over many binades, on values built to land on rounding ties, and on the edge cases
(a zero block, NaN and infinity, values far below and above the scale). Then the cases the float32 shortcut
decides wrongly by itself: NVFP4 elements within a float32 rounding of an E2M1 tie (and draws within one of the
fraction), where fl32(fl32(x·S)/d) is not v = x·S/d rounded once; the naive float32 answer is shown to differ
there, and the fast path, which redoes those elements in float64, not to. Bitwise: NaN where the reference has NaN,
every other element's bits equal; the saturated counts equal.
"""

import pytest
import torch

from precision import microscaling as ms
from precision import microscaling_fast as fast
from test_microscaling import _tie_rich_input


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


def _inputs():
    generator = torch.Generator().manual_seed(0)
    spread = torch.randn(32, 64, generator=generator) * 2.0 ** torch.randint(-20, 20, (32, 1), generator=generator)
    edges = torch.randn(32, 64, generator=generator)
    edges[0, :32] = 0.0  # zero blocks
    edges[1, 3], edges[2, 40], edges[3, 7] = float("nan"), float("inf"), -float("inf")
    edges[4, :16] = 2.0 ** -140  # subnormal amax
    edges[5, :] *= 2.0 ** 100
    edges[6, 0] = -0.0
    return {"spread": spread, "ties": _tie_rich_input(32, 64, torch.float32, seed=3), "edges": edges}


INPUTS = _inputs()


@pytest.mark.parametrize("name", INPUTS)
@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("stochastic", [False, True])
def test_fast_equals_the_reference_bitwise(name, fmt, stochastic):
    x = INPUTS[name]
    draws = torch.rand(x.shape, generator=torch.Generator().manual_seed(1)) if stochastic else None
    amaxes = [None, torch.tensor(42.0), torch.tensor(3.3)] if fmt == "nvfp4" else [None]
    for rule in ("rceil",) if fmt == "nvfp4" else ("rceil", "floor"):  # NVFP4 has no E8M0 rule
        for two_d in (False, True):
            for tensor_amax in amaxes:
                expected, saturated = ms.fake_quantize(x, fmt, rule, two_d, draws, tensor_amax, True)
                out, count = fast.fake_quantize(x, fmt, rule, two_d, draws, tensor_amax, True)
                assert _same_bits(out, expected), (rule, two_d, tensor_amax)
                assert count.item() == saturated.item(), (rule, two_d, tensor_amax)


def _near_ties(tensor_amax: float, block_amax: float):
    """NVFP4 blocks whose first element fixes d and whose others sit a few float32 ulps either side of t·d/S for
    every E2M1 tie t and for 6: where the two float32 roundings may land on the tie itself."""
    scale = ms.nvfp4_tensor_scale(torch.tensor(tensor_amax))
    d = ms.nvfp4_block_scale(torch.tensor(block_amax).double(), scale).float()
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    centre = ties * d / scale
    nudged = [centre]
    for _ in range(4):
        nudged = [torch.nextafter(nudged[0], torch.tensor(0.0))] + nudged + [torch.nextafter(nudged[-1],
                                                                                             torch.tensor(9e9))]
    values = torch.cat(nudged)
    values = torch.cat([values, -values])
    x = torch.zeros(values.numel(), 16)
    x[:, 0], x[:, 1] = block_amax, values
    return x, scale, d


def _naive(x, scale, d, draws=None):
    """The float32 shortcut alone: rne or SR of fl32(fl32(x·S)/d), no redo."""
    y = (x * scale / d).clamp(-6, 6)
    return ms._round_to_grid(y, ms.ELEMENTS["e2m1"], draws) * d / scale


NEAR_TIE_CASES = [(3.3, 3.3), (3.3, 1.7), (0.37, 0.2), (1e-3, 7e-4)]  # (tensor amax, the block's amax)


def _near_tie_results(tensor_amax, block_amax):
    """(naive float32, reference) to nearest, then (naive float32, reference) with draws on the float32 fraction;
    asserts the fast path equals the reference in both."""
    x, scale, d = _near_ties(tensor_amax, block_amax)
    expected, saturated = ms.fake_quantize(x, "nvfp4", tensor_amax=torch.tensor(tensor_amax), count_saturated=True)
    out, count = fast.fake_quantize(x, "nvfp4", tensor_amax=torch.tensor(tensor_amax), count_saturated=True)
    assert _same_bits(out, expected) and count.item() == saturated.item()
    # draws on the float32 fraction itself: u < f decided by float32 alone where float64 sees f just above or below
    steps = (x * scale / d).clamp(-6, 6)
    step = (steps.abs().view(torch.int32) & 0x7F800000).view(torch.float32).clamp(min=1.0) / 2
    draws = (steps / step - (steps / step).floor()).clamp(max=1 - 2.0 ** -24)
    expected_sr = ms.fake_quantize(x, "nvfp4", tensor_amax=torch.tensor(tensor_amax), stochastic=draws)
    assert _same_bits(fast.fake_quantize(x, "nvfp4", tensor_amax=torch.tensor(tensor_amax), draws=draws),
                      expected_sr)
    return _naive(x, scale, d), expected, _naive(x, scale, d, draws), expected_sr


def test_nvfp4_near_a_tie_is_redone_exactly_where_float32_alone_differs():
    """The fast path equals the reference on every near-tie case; the float32 shortcut alone (no redo) does not:
    it rounds some of these elements to the other neighbour, so the redo is what keeps the fast path exact."""
    wrong = wrong_sr = 0
    for tensor_amax, block_amax in NEAR_TIE_CASES:
        naive, expected, naive_sr, expected_sr = _near_tie_results(tensor_amax, block_amax)
        wrong += int((naive != expected).sum())
        wrong_sr += int((naive_sr != expected_sr).sum())
    assert wrong > 0 and wrong_sr > 0, (wrong, wrong_sr)


def test_other_dtypes_take_the_reference():
    x = INPUTS["spread"][:16, :32]
    for dtype in (torch.float64, torch.bfloat16):
        assert torch.equal(fast.fake_quantize(x.to(dtype), "nvfp4"), ms.fake_quantize(x.to(dtype), "nvfp4"))
