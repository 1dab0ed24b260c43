"""The recipe's fake quantiser, fast: microscaling.fake_quantize's result bit for bit, in float32 and in place.

precision/microscaling.py states each format by its rules and computes NVFP4 in float64, where the two products it needs
(x·S_enc, and the block scale) are exact and one division rounds once; every step there allocates a new tensor.
On a CPU a step of the recipe then spends most of its time paging in temporaries. Here one float32 buffer takes
the tensor through scale → clamp → round → dequantise in place; only the per-block quantities (n/b of them) are
computed by precision/microscaling.py's own functions. The result is the same bits:

  MX (E8M0 scales)  the same float32 operations in the same order on the same values (a product by a power of
        two is exact), so the same result; rceil never saturates (amax·2^-e ≤ max by its definition, and a
        float32 amax < 2^128 keeps e ≤ 127 unclamped), so its count is 0 without a pass;
  NVFP4  v' = fl32(fl32(x·S_enc)/d) instead of v = x·S_enc/d rounded once in float64. Both roundings are monotone,
        so v' lies on the same side as v of every value a float32 holds exactly: of every E2M1 tie t (t·d has at
        most 7 significant bits) and of 6 (saturation). Round-to-nearest-even of v' therefore equals that of v,
        and |v'| > 6 iff |v| > 6, unless v' lands ON one of them ({.25, .75, 1.25, 1.75, 2.5, 3.5, 5, 6}); those
        (a superset: |v'| a nonzero multiple of 1/4, rare outside hand-made inputs) are redone in float64 exactly
        as precision/microscaling.py does. Stochastic rounding compares a draw u with the fraction f of v/step: v' is
        within 2^-22 of v relatively (two float32 roundings; ≤ 12 steps), so f' within 2^-19 of f; where f' is
        within 2^-16 of u, of 0 or of 1 (the floor or the step's binade may differ) the element is redone in
        float64, elsewhere the decision and the neighbours are v's.
Inputs other than float32 (float64 models, a float8 weight) go to microscaling.fake_quantize itself.

Symbols: n elements, b the block. 1. Replicated and split: as precision/microscaling.py (pure). 2. Peak: one float32
copy of the tensor (4n bytes) plus one int32 or bool temporary at a time (≤ 4n), and the redone elements in float64.
3. Messages: none. 4. Restart state: none.
"""

from __future__ import annotations

import torch

from precision import microscaling as ms

_EXPONENT_MASK = 0x7F800000  # float32's exponent bits
_FRACTION_BITS = 23
_TIES_AND_MAX_QUARTER = 0.25  # the E2M1 ties and 6 are multiples of 1/4: the superset redone in float64
_SR_WINDOW = 2.0 ** -20  # |f' - u| or 1 - |f' - u| below this: redone in float64 (v'/step is within 2^-21 of v/step)


@torch.no_grad()
def fake_quantize(x: torch.Tensor, fmt, rule: str = "rceil", two_d: bool = False, draws: torch.Tensor | None = None,
                  tensor_amax: torch.Tensor | None = None, count_saturated: bool = False):
    """microscaling.fake_quantize(x, fmt, rule, two_d, draws, tensor_amax, count_saturated), bit for bit; draws:
    U[0, 1) of x's shape for stochastic rounding (None: to nearest). x float32 (else the reference runs)."""
    fmt = ms.FORMATS[fmt] if isinstance(fmt, str) else fmt
    if x.dtype != torch.float32 or (draws is not None and not torch.is_tensor(draws)):
        return ms.fake_quantize(x, fmt, rule, two_d, draws, tensor_amax if fmt.scale == "e4m3" else None,
                                count_saturated)
    ms._check(x, fmt, rule, two_d)
    element = ms.ELEMENTS[fmt.element]
    x = x.contiguous()
    shape = ms._blocked_shape(x.shape, fmt.block, two_d)
    blocks = x.view(shape)
    y = torch.abs(x)  # the one working buffer: |x| for the amaxes, then x in block units, then the result
    amax = y.view(shape).amax(dim=(-3, -1) if two_d else -1, keepdim=True)  # exact
    if fmt.scale == "e8m0":
        codes = (ms.e8m0_exponent(amax, element.max, rule) + 127).long()
        torch.mul(blocks, ms._power_of_two_table(torch.float32, x.device, negate=True)[codes], out=y.view(shape))
        saturated = (_count_beyond(y, element.max) if rule != "rceil" else torch.zeros((), dtype=torch.long)
                     ) if count_saturated else None
        _round_in_place(y.clamp_(-element.max, element.max), element, draws)
        y.copysign_(x).view(shape).mul_(ms._power_of_two_table(torch.float32, x.device)[codes])
        return (y, saturated) if count_saturated else y
    return _nvfp4(x, y, shape, amax, two_d, draws, tensor_amax, count_saturated)


def _nvfp4(x, y, shape, amax, two_d: bool, draws, tensor_amax, count_saturated: bool):
    """NVFP4 in float32 with the float64 redo of the elements where float32 might decide otherwise (docstring)."""
    element = ms.ELEMENTS["e2m1"]
    amax = amax.double()
    tensor_amax = amax.max() if tensor_amax is None else torch.as_tensor(tensor_amax, device=x.device)
    tensor_scale = ms.nvfp4_tensor_scale(tensor_amax)
    decoded = ms.nvfp4_block_scale(amax, tensor_scale)  # float64 on E4M3's grid (exact in float32), NaN if not finite
    divisor = torch.where(torch.isfinite(decoded) & (decoded > 0), decoded, torch.inf).float()
    torch.mul(x, tensor_scale, out=y).view(shape).div_(divisor)  # v' = fl(fl(x·S)/d)
    quarters = y.abs().mul_(4)
    if draws is None:  # v' on a tie or on 6: |v'|·4 an integer ≥ 1
        redo = (quarters == quarters.round()) & (quarters >= 1)
    else:  # v' on 6: its saturation is v's to tell
        redo = quarters == 4 * element.max
    saturated = (quarters > 4 * element.max).sum() if count_saturated else None
    del quarters
    y.clamp_(-element.max, element.max)
    if draws is None:
        _round_in_place(y, element)
    else:
        draws = draws.reshape(x.shape).to(torch.float32)
        redo |= _round_stochastic_in_place(y, element, draws)
    y.copysign_(x)
    index = redo.view(-1).nonzero().squeeze(1)
    if index.numel():  # precision/microscaling.py's own float64 computation for these elements
        block = _block_index(index, x.shape, ms.FORMATS["nvfp4"].block, two_d)
        x_redone, divisor_redone = x.view(-1)[index], divisor.reshape(-1)[block]
        exact = x_redone.double() * tensor_scale.double() / divisor_redone.double()
        if count_saturated:  # float64's verdict for these instead of float32's (v' recomputed: the same bits)
            saturated += (exact.abs() > element.max).sum()
            saturated -= ((x_redone * tensor_scale / divisor_redone).abs() > element.max).sum()
        grid = ms._round_to_grid(exact.clamp_(-element.max, element.max), element,
                                 None if draws is None else draws.view(-1)[index])
        y.view(-1)[index] = grid.float()
    y.view(shape).mul_(decoded.float()).div_(tensor_scale)  # q·d exact, then /S_enc rounded once (as dequantize)
    return (y, saturated) if count_saturated else y


def _block_index(flat: torch.Tensor, shape, block: int, two_d: bool) -> torch.Tensor:
    """The block (in the blocked scales' row-major order) of each flat element index of a [..., R, K] tensor."""
    k = shape[-1]
    if not two_d:
        return flat // block
    rows = shape[-2]
    matrix, within = flat // (rows * k), flat % (rows * k)
    return (matrix * (rows // block) + within // k // block) * (k // block) + (within % k) // block


def _count_beyond(y: torch.Tensor, limit: float) -> torch.Tensor:
    return (y.abs() > limit).sum()


def _binade(y: torch.Tensor, element) -> torch.Tensor:
    """2^E per element, E = max(⌊log2|y|⌋, min_exponent): read from y's exponent bits (a new float32 tensor)."""
    return (y.view(torch.int32) & _EXPONENT_MASK).view(torch.float32).clamp_(min=2.0 ** element.min_exponent)


def _round_in_place(y: torch.Tensor, element, draws=None) -> None:
    """microscaling._round_to_grid's arithmetic in place (the sign restored by the caller from x: the same as y's)."""
    if draws is not None:
        _round_stochastic_in_place(y, element, draws.reshape(y.shape).to(torch.float32))
        return
    magic = _binade(y, element).mul_(1.5 * 2.0 ** (_FRACTION_BITS - element.mantissa_bits))
    y.add_(magic).sub_(magic)


def _round_stochastic_in_place(y: torch.Tensor, element, draws: torch.Tensor) -> torch.Tensor:
    """microscaling._round_to_grid's stochastic rounding in place: up iff u < f, f the fraction of a step y lies
    above its lower neighbour, i.e. the result is ⌈y/step - u⌉·step, a step function of y/step that jumps where
    y/step - u is an integer. Returns where y/step - u is within _SR_WINDOW of an integer (|f - u| near 0 or 1):
    NVFP4 redoes those, the only ones a 2^-21 error in y/step can move across a jump (the step's binade too:
    where v' and v straddle a power of two, v' is that power, on both grids)."""
    step = _binade(y, element).mul_(2.0 ** -element.mantissa_bits)
    y.div_(step)  # exact: a power of two
    lower = y.floor()
    fraction = y.sub_(lower)
    distance = (fraction - draws).abs_()
    redo = (distance < _SR_WINDOW) | (distance > 1 - _SR_WINDOW)
    torch.mul(lower.add_(draws < fraction), step, out=y)
    return redo
