"""FP8 training: the block linears compute their GEMMs in 8-bit floats, with per-tensor or blockwise scales.

An FP8 number has 8 bits: E4M3 (4 exponent bits, 3 mantissa bits, largest value 448) and E5M2 (largest
57344: more range, less precision). A tensor x is sent to FP8 with a scale s chosen so that its largest
magnitude lands near the top of the format:

    s = max_format / amax / 2^margin,       q = cast(clamp(x·s, -max_format, max_format)),       x ≈ q / s

The clamp matters: torch's E4M3 cast saturates at 448 in eager mode, but the E5M2 cast overflows to inf.
Following Micikevicius et al. 2022 ("FP8 formats for deep learning") and Transformer Engine, inputs and
weights use E4M3 and output gradients E5M2: the forward GEMM is e4m3×e4m3, the two backward GEMMs (dX = dY·W,
dW = dYᵀ·X) are e5m2×e4m3. How the scale is chosen is the recipe (`--fp8`):
  current    amax of this tensor now (reduced over the ranks that hold pieces of it);
  delayed    Transformer Engine's DelayedScaling: the scale of step s comes from the amax HISTORY of steps
             < s (`max` over the last L steps or the `most_recent`), so no reduction waits in the forward
             (the first step, with an empty history, scales like `current`, as torchao's did);
  blockwise  DeepSeek-V3 (2024, section 3.3): all E4M3, one scale per 1×128 tile of activations and output
             gradients and per 128×128 block of weights (current scaling, tile by tile).

Which layers: the block linears (attention's c_attn and c_proj, the MLP's c_fc and c_proj: ~2/3 of a GPT's
FLOPs). The embedding is a lookup; the head stays in the compute dtype (its logits feed the cross-entropy,
whose gradient lives in small differences; its weight is the tied embedding), the loss in fp32, MoE routers
(`router`, `gate`) precise, as in DeepSeek-V3 (a flipped top-k choice is not a small error), the experts'
linears in the compute dtype for now (an expert's row count is data-dependent, the FP8 GEMM needs multiples
of 16: padding them in the dispatch would lift this).

One logical tensor, one scale, on any mesh: ranks holding pieces of one logical tensor (TP shards of a
weight, an activation or its gradient; CP pieces of a sequence) MAX-reduce its amax before quantising, so
every element is quantised exactly as on one device (data-parallel ranks hold other data: current scaling
never reduces over them). The delayed history of step s is the max over its micro-batches and ranks (the
linear's gradient group, dp×cp or expert-dp, and TP): the same on every rank holding the linear. On GPUs
with FP8 tensor cores (compute capability ≥ 8.9) the per-tensor GEMMs run on `torch._scaled_mm`; elsewhere
(and for blockwise) they are emulated on the same quantised values, multiplied in fp32 (fp64 for float64
models) and rounded once, as tensor cores accumulate. `_scaled_mm`'s rules (K and N multiples of 16, a
column-major second operand, no e5m2×e5m2) are checked on every device.

Symbols: M = b·s/C tokens per micro-batch on a rank (b micro-batch, s sequence, C context parallel; with
--sp the column layers see the gathered b·s), h hidden, T tensor parallel, L history length, n = FP8 linears
this rank holds, m micro-batches per step, e_c bytes of a compute-dtype element (bf16: 2).

1. Replicated and split: nothing new is split. Each FP8 linear keeps its parameters (TP/EP shards as they
   were) and adds, per role (input, weight, grad_output), a scale and an L-long amax history, identical on
   every rank holding the linear.
2. Peak per device: the scaling state, n·(3L + 18)·4 bytes. Each FP8 linear saves its input for backward in
   FP8: Σ_j M·K_j·(e_c - 1) bytes less per micro-batch in flight (`saved_input_bytes`; K_j its local input
   width; per GPT layer M·h·(2 + 5/T)·(e_c - 1); blockwise adds a float32 scale per 128 values, +3%). The
   weight is quantised once per optimizer step (`weight_codes`) for every micro-batch in flight: Σ_j N_j·K_j
   bytes, twice on the per-tensor recipes (dX's column-major copy), instead of autocast's e_c-byte copy.
   Under --sp a column layer keeps its gathered input in FP8 (M·h bytes, not its 2·M·h/T bf16 shard) and
   does not re-gather it in backward (`convert` switches `regather` off). Temporaries: the fp32 scaled copy
   being quantised (≤ 4·M·4h/T bytes), FP8 transposes of dY and X in backward; under the pipeline's zb,
   dW's FP8 operands (M·(N_j + K_j) bytes) and db from I to W.
3. Messages (all_reduce MAX, float32, on the critical path, tiny and latency-bound; `predicted_messages`):
     current:   per linear and micro-batch: forward 8 bytes ([amax_x, amax_w]), backward 4 bytes (amax_dY),
                over cp and over tp (each when its size > 1); activation checkpointing repeats the forward's.
     delayed:   per optimizer step, in `end_step`: one 12·n-byte all_reduce over the linears' gradient group
                (dp_cp; expert_dp for experts) and one over tp (each when its size > 1); the first step
                (empty history) also sends the current recipe's messages.
     blockwise: none: the tiles are local (`config_from_flags` requires TP-split widths that are multiples of
                128; under CP dW's 128-token tiles are this rank's tokens, so blockwise equals the single
                device only when its sequence pieces hold whole tiles).
4. Restart state: per linear and role the amax history and scale (delayed; current and blockwise have
   none), keyed by the linear's global name (`state_pieces`): the same on every rank holding the linear, so
   a checkpoint writes them once and any mesh restores them; a restored run replays bitwise.

The axis (step.Axis): `config_from_flags` before any process group; `apply(model, run, recipe)` after PP,
before DDP/ZeRO; once per optimizer step `after_grad_sync` (`end_step`: roll the histories, drop the step's
FP8 weights, return this rank's count of linears with a non-finite amax, which the update's world finite
check adds: every rank skips that step); `state_pieces`; `predicted_messages`, `traced_prediction` (report.py
prints). Amaxes are recorded in training only (a forward with autograd, every backward).
ZeRO-3's FP8 all-gather (`ZeroWeightCodec`, at the end): `quantize_to_uint8` / `dequantize_from_uint8`
with a scale shared by the shards (`scale_from_amax` of the MAX-reduced shard amaxes, or under delayed
scaling the linear's own `scale[1]`); the linear reads the codes' amax from `gathered_weight_amax`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from comm import Messages
from model import ShardInfo, StatePiece, counts_here
from step import Axis

# --- Formats and casts ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Format:
    name: str
    dtype: torch.dtype
    max: float  # the largest finite magnitude


E4M3 = Format("e4m3", torch.float8_e4m3fn, 448.0)
E5M2 = Format("e5m2", torch.float8_e5m2, 57344.0)
ROLES = ("input", "weight", "grad_output")
FORMATS = (E4M3, E4M3, E5M2)  # per role; blockwise uses E4M3 for all three (DeepSeek-V3)
TILE_ACTIVATION, TILE_ACTIVATION_T, TILE_WEIGHT = (1, 128), (128, 1), (128, 128)
MODES = ("current", "delayed", "blockwise")
FORWARD, BACKWARD = slice(0, 2), slice(2, 3)  # the roles quantised in each pass (slices: no index tensors)
_SATURATED = 1 + 2**-20  # |x·s| beyond max by more than the rounding of the scale and product counts


def _wide(dtype: torch.dtype) -> torch.dtype:
    """Scaling and emulated GEMMs run in fp32 (fp64 for float64 models, so tests can be tight)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def amax_of(x: torch.Tensor) -> torch.Tensor:
    """max |x| as float32 (one pass, no |x| temporary). NaN stays NaN."""
    return torch.linalg.vector_norm(x, float("inf")).float()


def scale_from_amax(amax: torch.Tensor, fmt_max, margin: float = 0) -> torch.Tensor:
    """s = max/amax/2^margin (float32), elementwise; 1 where amax is 0 or not finite (nothing to scale by)."""
    if not torch.is_tensor(fmt_max):  # a fill, not a copy from the host (which would wait for the GPU)
        fmt_max = torch.full_like(amax, fmt_max)
    usable = torch.isfinite(amax) & (amax > 0)
    scale = fmt_max / torch.where(usable, amax, 1.0) / 2.0**margin
    return torch.where(usable, scale, 1.0).clamp(max=torch.finfo(torch.float32).max)


def quantize(x: torch.Tensor, fmt: Format, scale: torch.Tensor, count_saturated: bool = True):
    """q = cast(clamp(x·scale, ±max)): (q in fmt.dtype, number of elements the clamp cut, or None)."""
    scaled = x.to(_wide(x.dtype)) * scale.to(_wide(x.dtype))
    saturated = (scaled.abs() > fmt.max * _SATURATED).sum() if count_saturated else None
    return scaled.clamp_(-fmt.max, fmt.max).to(fmt.dtype).contiguous(), saturated  # row-major for _scaled_mm


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.to(_wide(dtype)) * scale.to(_wide(dtype)).reciprocal()).to(dtype)


def _tiles(x: torch.Tensor, tile) -> torch.Tensor:
    """[R, C] zero-padded to whole tiles, viewed as [R/r, r, C/c, c]."""
    (r, c), (rows, cols) = tile, x.shape
    padded = F.pad(x, (0, -cols % c, 0, -rows % r))
    return padded.view(padded.shape[0] // r, r, padded.shape[1] // c, c)


def quantize_tiles(x: torch.Tensor, tile, fmt: Format = E4M3):
    """One scale per tile of x [R, C] (edge tiles partial): (q [R, C], inverse scales [⌈R/r⌉, ⌈C/c⌉], amax)."""
    tiles = _tiles(x.to(_wide(x.dtype)), tile)
    amax = tiles.abs().amax(dim=(1, 3)).float()
    scale = scale_from_amax(amax, fmt.max)
    q = (tiles * scale[:, None, :, None].to(tiles.dtype)).clamp_(-fmt.max, fmt.max).to(fmt.dtype)
    rows, cols = x.shape
    return q.flatten(2).flatten(0, 1)[:rows, :cols].contiguous(), 1.0 / scale.to(tiles.dtype), amax.max()


def dequantize_tiles(q: torch.Tensor, inverse_scale: torch.Tensor, tile, dtype: torch.dtype) -> torch.Tensor:
    tiles = _tiles(q.to(dtype), tile) * inverse_scale[:, None, :, None].to(dtype)
    return tiles.flatten(2).flatten(0, 1)[:q.shape[0], :q.shape[1]]


def quantize_to_uint8(shard: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """For ZeRO-3's FP8 all-gather: a weight shard in E4M3 with the logical tensor's shared scale, as uint8
    (gloo cannot move float8). Quantising shards with one scale and concatenating them equals quantising the
    whole tensor, so the gathered weight is what the FP8 linear would compute from the full one."""
    return quantize(shard, E4M3, scale, count_saturated=False)[0].view(torch.uint8)


def dequantize_from_uint8(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse: uint8 bytes of E4M3 values → q/scale in `dtype`. The FP8 linear re-quantising this weight
    with the same scale (or one computed from its amax, which lands on the same values) gets q back exactly."""
    return dequantize(data.view(E4M3.dtype), scale, dtype)


# --- The scaling rule (Transformer Engine's DelayedScaling) --------------------------------------------------


@dataclass(frozen=True)
class Recipe:
    mode: str  # current | delayed | blockwise
    amax_history: int = 16  # L
    amax_algo: str = "max"  # max | most_recent
    margin: int = 0


def roll_history(history: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, fmt_max, recipe: Recipe):
    """One step of delayed scaling: (new history, new scale) for histories [..., L] (index 0 = latest). A
    finite amax enters the history (the oldest leaves); a non-finite one does not, and that role keeps its
    history and scale. s = max_format / (max over the history, or its latest entry) / 2^margin, kept when
    that amax is 0 (nothing seen yet)."""
    finite = torch.isfinite(amax)
    rolled = torch.cat([amax.unsqueeze(-1), history[..., :-1]], dim=-1)
    history = torch.where(finite.unsqueeze(-1), rolled, history)
    reference = history.amax(dim=-1) if recipe.amax_algo == "max" else history[..., 0]
    new = scale_from_amax(reference, fmt_max, recipe.margin)
    return history, torch.where(finite & (reference > 0), new, scale)


# --- The GEMMs: torch._scaled_mm on FP8 tensor cores, emulated elsewhere, the same rules everywhere ----------


def gemm_shape_errors(m: int, k: int, n: int, training: bool = True) -> list:
    """Why a linear of input width K, output width N, on M tokens cannot run on _scaled_mm (empty: it can).
    The GEMMs [M,K]·[K,N] (forward), [M,N]·[N,K] (dX), [N,M]·[M,K] (dW) need their inner dimension and output
    width to be multiples of 16: K and N always, M to train."""
    errors = [f"{name}={value} is not a multiple of 16" for name, value in (("K (in_features)", k),
              ("N (out_features)", n)) if value % 16]
    if training and m % 16:
        errors.append(f"M={m} tokens per micro-batch is not a multiple of 16 (the weight-gradient GEMM"
                      f" dW = dYᵀ·X contracts over tokens)")
    return errors


def check_operands(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """_scaled_mm's operand rules, on every device: a [M,K] row-major, b [K,N] column-major, FP8, not both
    e5m2, K and N multiples of 16. A ValueError here is what a GPU would have refused."""
    if a.dtype == b.dtype == E5M2.dtype:
        raise ValueError(f"FP8 {what}: e5m2 × e5m2 has no tensor-core GEMM (torch._scaled_mm); one operand"
                         f" must be e4m3")
    if not (a.dtype in (E4M3.dtype, E5M2.dtype) and b.dtype in (E4M3.dtype, E5M2.dtype)):
        raise ValueError(f"FP8 {what}: operands must be float8, got {a.dtype} and {b.dtype}")
    (k, n) = b.shape
    if a.shape[1] != k or k % 16 or n % 16:
        raise ValueError(f"FP8 {what}: torch._scaled_mm needs [M,K]·[K,N] with K and N multiples of 16,"
                         f" got [{a.shape[0]},{a.shape[1]}]·[{k},{n}]")
    if a.stride(1) != 1 or not (b.stride(0) == 1 and b.stride(1) >= k):
        raise ValueError(f"FP8 {what}: torch._scaled_mm needs a row-major first operand and a column-major"
                         f" second one, got strides {a.stride()} and {b.stride()}")


def scaled_matmul(a, a_inverse_scale, b, b_inverse_scale, out_dtype, use_scaled_mm: bool, what: str = "GEMM"):
    """(a·a_inv)·(b·b_inv) in out_dtype, a and b per-tensor-scaled FP8, accumulated in fp32 (fp64 emulated)."""
    check_operands(a, b, what)
    if use_scaled_mm:
        return torch._scaled_mm(a, b, scale_a=a_inverse_scale, scale_b=b_inverse_scale, out_dtype=out_dtype)
    wide = _wide(out_dtype)
    return ((a.to(wide) @ b.to(wide)) * (a_inverse_scale * b_inverse_scale).to(wide)).to(out_dtype)


def has_fp8_tensor_cores(device) -> bool:
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


# --- The FP8 linear ------------------------------------------------------------------------------------------


# Blockwise (DeepSeek-V3): every scale covers 128 consecutive values of the dimension its GEMM contracts, so it
# factors out of each 128-long partial sum; the weight's 128×128 blocks serve both of its GEMMs.
#   forward   Y  = X·Wᵀ   contracts K        X [M, K] in 1×128 tiles,   W [N, K] in 128×128 blocks
#   input     dX = dY·W   contracts N        dY [M, N] in 1×128 tiles,  W as above
#   weight    dW = dYᵀ·X  contracts M tokens dY [M, N] and X [M, K] in 128×1 tiles
# quantize_tiles gives (codes, inverse-scale grid [⌈rows/r⌉, ⌈cols/c⌉], amax): W's grid is [⌈N/128⌉, ⌈K/128⌉],
# the forward's X's [M, ⌈K/128⌉], dX's dY's [M, ⌈N/128⌉], dW's dY's and X's [⌈M/128⌉, N] and [⌈M/128⌉, K].


def blockwise_weight_grad_operands(dy: torch.Tensor, qx: torch.Tensor, ix: torch.Tensor, wide: torch.dtype):
    """dW's operands, both in 128×1 tiles along the tokens: (dY codes, grid [⌈M/128⌉, N], X codes, grid
    [⌈M/128⌉, K]). X is re-tiled from its forward codes (the only X kept)."""
    qdy_t, idy_t, _ = quantize_tiles(dy, TILE_ACTIVATION_T)
    qx_t, ix_t, _ = quantize_tiles(dequantize_tiles(qx, ix, TILE_ACTIVATION, wide), TILE_ACTIVATION_T)
    return qdy_t, idy_t, qx_t, ix_t


def weight_gradient(layer, operands: tuple, wide: torch.dtype) -> torch.Tensor:
    """dW = dYᵀ·X from the backward's FP8 operands (dY codes, their inverse scale(s), X codes, theirs), in the
    weight's dtype. Called by the backward, or later by the pipeline's W (zb)."""
    qdy, idy, qx, ix = operands
    if layer.recipe.mode == "blockwise":
        dy_t = dequantize_tiles(qdy, idy, TILE_ACTIVATION_T, wide)
        x_t = dequantize_tiles(qx, ix, TILE_ACTIVATION_T, wide)
        return (dy_t.t() @ x_t).to(layer.weight.dtype)
    return scaled_matmul(qdy.t().contiguous(), idy, qx.t().contiguous().t(), ix, layer.weight.dtype,
                         layer.use_scaled_mm, "weight gradient dW = dYᵀ·X")


def _deferred_weight_grads(layer, operands: tuple, wide: torch.dtype, db) -> list:
    """The pipeline's W for an FP8 linear: [(weight, dW), (bias, db)] (db was summed in I, from the exact dY)."""
    pairs = [(layer.weight, weight_gradient(layer, operands, wide))]
    return pairs + ([(layer.bias, db)] if db is not None else [])


class _Fp8LinearFunction(torch.autograd.Function):
    """Y = X·Wᵀ + b with X, W in E4M3 and dY in E5M2 (blockwise: all E4M3); saves X in FP8 and uses the step's
    FP8 weight (`Fp8Linear.weight_codes`) in both passes. store: the pipeline's WeightGradStore under zb (the
    weight and bias then arrive detached): backward computes dX now and hands the store a callable for dW and
    db, which keeps dW's FP8 operands (dY, X, their scales) and db until the W action."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer, training, store):
        x2 = x.reshape(-1, x.shape[-1])  # [M, K]
        layer.check_shapes(x2.shape[0], training)
        device = x.device.type  # the output in autocast's dtype, as nn.Linear's would be
        out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        with torch.autocast(device, enabled=False):
            codes = layer.cached_weight_codes(weight)  # None: the step's first micro-batch (or a new weight)
            if layer.recipe.mode == "blockwise":
                if codes is None:
                    qw, iw, amax_w = quantize_tiles(weight, TILE_WEIGHT)
                    codes = layer.cache_weight_codes(weight, qw, amax_w, inverse_scales=iw)
                qx, ix, amax_x = quantize_tiles(x2, TILE_ACTIVATION)
                smallest = torch.stack([ix.max(), codes.inverse_scales.max()]).reciprocal()  # largest-amax tiles
                layer.observe(FORWARD, torch.stack([amax_x, codes.amax]), smallest, record=training)
                wide = _wide(out_dtype)
                y = (dequantize_tiles(qx, ix, TILE_ACTIVATION, wide)
                     @ dequantize_tiles(codes.q, codes.inverse_scales, TILE_WEIGHT, wide).t()).to(out_dtype)
            else:
                if codes is not None:
                    amax_w = codes.amax
                elif layer.gathered_weight_amax is not None:  # ZeRO-3 gathered E4M3 codes scaled with this amax
                    amax_w = layer.gathered_weight_amax
                else:
                    amax_w = amax_of(weight)
                amax = torch.stack([amax_of(x2), amax_w])
                scale = layer.scales(FORWARD, amax)  # the weight's is the same for every micro-batch of a step
                qx, sat_x = quantize(x2, E4M3, scale[0], layer.counts_saturation)
                if codes is None:
                    qw, sat_w = quantize(weight, E4M3, scale[1], layer.counts_saturation)
                    codes = layer.cache_weight_codes(weight, qw, amax_w, scale=scale[1], saturated=sat_w)
                layer.observe(FORWARD, amax, scale, (sat_x, codes.saturated), (qx.numel(), codes.q.numel()),
                              training)
                wide = _wide(out_dtype)  # float32 inverse scales on the GPU path
                ix, iw = scale[0].to(wide).reciprocal(), codes.scale.to(wide).reciprocal()
                y = scaled_matmul(qx, ix, codes.q.t(), iw, out_dtype, layer.use_scaled_mm, "forward Y = X·Wᵀ")
            if bias is not None:
                y = y + bias.to(out_dtype)
        ctx.save_for_backward(qx, ix)  # the input kept in FP8: the activation-memory saving
        ctx.layer, ctx.codes, ctx.store, ctx.out_dtype, ctx.x_dtype = layer, codes, store, out_dtype, x.dtype
        ctx.has_bias = layer.bias is not None
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        qx, ix = ctx.saved_tensors
        layer, codes, store, wide = ctx.layer, ctx.codes, ctx.store, _wide(ctx.out_dtype)
        dy = grad.reshape(-1, grad.shape[-1])  # [M, N]
        wants_dw = ctx.needs_input_grad[1] or store is not None
        dx = operands = None
        with torch.autocast(grad.device.type, enabled=False):
            if layer.recipe.mode == "blockwise":
                amax = amax_of(dy)
                layer.observe(BACKWARD, amax.view(1), scale_from_amax(amax, E4M3.max).view(1))
                if ctx.needs_input_grad[0]:
                    qdy, idy, _ = quantize_tiles(dy, TILE_ACTIVATION)
                    dx = (dequantize_tiles(qdy, idy, TILE_ACTIVATION, wide)
                          @ dequantize_tiles(codes.q, codes.inverse_scales, TILE_WEIGHT, wide)).to(ctx.out_dtype)
                if wants_dw:
                    operands = blockwise_weight_grad_operands(dy, qx, ix, wide)
            else:
                amax = amax_of(dy).view(1)
                scale = layer.scales(BACKWARD, amax)
                qdy, sat = quantize(dy, E5M2, scale[0], layer.counts_saturation)
                layer.observe(BACKWARD, amax, scale, (sat,), (qdy.numel(),))
                idy = scale[0].to(wide).reciprocal()
                if ctx.needs_input_grad[0]:
                    dx = scaled_matmul(qdy, idy, codes.column_major(), codes.scale.to(wide).reciprocal(),
                                       ctx.out_dtype, layer.use_scaled_mm, "input gradient dX = dY·W")
                operands = (qdy, idy, qx, ix)
            wants_db = ctx.has_bias and (ctx.needs_input_grad[2] or store is not None)
            db = dy.sum(0, dtype=layer.bias.dtype) if wants_db else None
        dx = None if dx is None else dx.to(ctx.x_dtype).view(*grad.shape[:-1], qx.shape[1])
        if store is not None:  # zb's I: dW and db wait for the W action
            store.defer(functools.partial(_deferred_weight_grads, layer, operands, wide, db))
            return dx, None, None, None, None, None
        dw = weight_gradient(layer, operands, wide) if ctx.needs_input_grad[1] else None
        return dx, dw, db, None, None, None


@dataclass(eq=False)
class WeightCodes:
    """A weight in FP8 for one optimizer step: quantised by the step's first micro-batch, used by every forward
    and backward of the step (the weight does not change within it). The column-major copy dX needs is built
    by the first backward."""

    q: torch.Tensor  # [N, K] row-major
    scale: torch.Tensor | None  # per tensor: s
    inverse_scales: torch.Tensor | None  # blockwise: 1/s per 128×128 block
    amax: torch.Tensor
    saturated: torch.Tensor | None  # values the clamp cut (delayed)
    source: tuple  # what it was made from (Fp8Linear._weight_source): compared before every use
    gathered_amax: torch.Tensor | None  # ZeRO-3's, compared by identity
    _column_major: torch.Tensor | None = None

    def column_major(self) -> torch.Tensor:
        """W [N, K] with N contiguous: _scaled_mm's second operand of dX = dY·W."""
        if self._column_major is None:
            self._column_major = self.q.t().contiguous().t()
        return self._column_major


class Fp8Linear(nn.Linear):
    """A drop-in for a local nn.Linear (plain, a TP shard inside Column/RowParallelLinear, or an expert): the
    SAME parameter objects, its GEMMs in FP8, and its scaling state (per role: history, scale).
    amax_groups: the process groups over which pieces of this linear's tensors are spread (cp, tp): current
    scaling MAX-reduces amaxes over them. gemm: "auto" (_scaled_mm on FP8 tensor cores, else emulated),
    "emulated", or "scaled_mm" (forced: tests run it on CPU to check the GPU path's operands and scales).
    Under the pipeline's zb it defers its own weight gradient (`defers_weight_grad`: the store does not patch
    its forward): with `weight_grad_store` set, its backward leaves dW and db to the store's W."""

    defers_weight_grad = True

    def __init__(self, linear: nn.Linear, recipe: Recipe, name: str = "", amax_groups=(), gemm: str = "auto",
                 device=None):
        nn.Module.__init__(self)  # no new parameters: keep the wrapped linear's
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.register_parameter("bias", linear.bias)
        self.recipe, self.name, self.amax_groups = recipe, name, tuple(amax_groups)
        self.delayed_groups = ()  # names of the mesh groups the delayed roll reduces over (set by convert)
        device = torch.device(device) if device is not None else linear.weight.device  # a meta weight: pass the run's
        self.fmt_max = torch.tensor([f.max for f in FORMATS], device=device)
        self.amax_history = torch.zeros(3, recipe.amax_history, device=device)  # [role, L], column 0 latest
        self.scale = torch.ones(3, device=device)  # delayed: the scales this step quantises with
        self._history_ready, self._history_version = False, self.amax_history._version  # see history_ready
        self.step_amax = torch.zeros(3, device=device)  # max over this step's micro-batches (local)
        self.last_scale = torch.ones(3, device=device)  # the scale last used, for the table
        self.saturated = torch.zeros(3, dtype=torch.int64, device=device)  # since the last table
        self.quantized = [0, 0, 0]
        self.gathered_weight_amax = None  # set by ZeRO-3 while it holds this weight gathered from FP8 codes
        self.weight_codes = None  # this step's FP8 weight (WeightCodes), dropped when the step ends
        self.weight_grad_store = None  # the pipeline's WeightGradStore under zb (set by its install)
        self.counts_saturation = recipe.mode == "delayed"  # current and blockwise cannot saturate
        blockwise_or_double = recipe.mode == "blockwise" or linear.weight.dtype == torch.float64
        self.use_scaled_mm = (gemm == "scaled_mm" or (gemm == "auto" and has_fp8_tensor_cores(device))) \
            and not blockwise_or_double

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        training = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
        store = self.weight_grad_store if training and x.requires_grad else None
        weight, bias = self.weight, self.bias
        if store is not None:  # zb: autograd reaches the parameters only through the store's W
            weight, bias = weight.detach(), None if bias is None else bias.detach()
        return _Fp8LinearFunction.apply(x, weight, bias, self, training, store)

    def extra_repr(self) -> str:
        gemm = "_scaled_mm" if self.use_scaled_mm else "emulated"
        return f"{super().extra_repr()}, fp8={self.recipe.mode}, gemm={gemm}"

    def check_shapes(self, tokens: int, training: bool) -> None:
        errors = gemm_shape_errors(tokens, self.in_features, self.out_features, training)
        if errors:
            raise ValueError(f"FP8 linear {self.name or ''} [{self.out_features}×{self.in_features}]: "
                             + "; ".join(errors) + " (torch._scaled_mm's rules, checked on every device)")

    def _weight_source(self, weight: torch.Tensor) -> tuple:
        """What the FP8 weight depends on: the tensor (address, in-place version: a step, a checkpoint load)
        and the delayed scale (its version: a roll, a restored state; and whether the history is ready)."""
        return weight.data_ptr(), weight._version, self.scale._version, self.history_ready

    def cached_weight_codes(self, weight: torch.Tensor):
        """The WeightCodes made from this very weight and scale, else None (so no step, evaluation or checkpoint
        load can make it stale); ZeRO-3's gathered amax is compared by identity (a regather sets a new one)."""
        codes = self.weight_codes
        fresh = codes is not None and codes.source == self._weight_source(weight)
        return codes if fresh and codes.gathered_amax is self.gathered_weight_amax else None

    def cache_weight_codes(self, weight, q, amax, scale=None, inverse_scales=None, saturated=None):
        """Keep the weight's FP8 codes until the step ends (Fp8Handle.end_step) or the weight changes."""
        self.weight_codes = WeightCodes(q, scale, inverse_scales, amax, saturated, self._weight_source(weight),
                                        self.gathered_weight_amax)
        return self.weight_codes

    def scales(self, roles: slice, amax: torch.Tensor) -> torch.Tensor:
        """The scales to quantise `roles` with now: the delayed ones, or from the amaxes reduced over the
        ranks holding pieces of these tensors (current scaling, and delayed while the history is empty)."""
        if self.recipe.mode == "delayed" and self.history_ready:
            return self.scale[roles].clone()
        amax = torch.nan_to_num(amax, nan=float("inf"))  # MAX must not drop a NaN
        for group in self.amax_groups:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        return scale_from_amax(amax, self.fmt_max[roles], self.recipe.margin)

    def observe(self, roles: slice, amax, scale, saturated=(), counts=(), record: bool = True) -> None:
        """Record this quantisation's local amaxes (max over the step) and statistics: in training (a forward
        with autograd, every backward), not in evaluation."""
        if not record:
            return
        self.step_amax[roles] = torch.maximum(self.step_amax[roles], amax)  # NaN propagates
        self.last_scale[roles] = scale.detach().float()
        for role, count, numel in zip(range(roles.start, roles.stop), saturated, counts):
            if count is not None:
                self.saturated[role] += count
            self.quantized[role] += numel

    def roll(self, amax: torch.Tensor, finite: bool) -> None:
        """End of a step (delayed): the reduced amaxes [3] enter the history; in place (state is live)."""
        history, scale = roll_history(self.amax_history, self.scale, amax, self.fmt_max, self.recipe)
        ready = self.history_ready or finite
        self.amax_history.copy_(history)
        self.scale.copy_(scale)
        self._history_ready, self._history_version = ready, self.amax_history._version

    @property
    def history_ready(self) -> bool:
        """Delayed: whether a step's amaxes entered the history (until then the linear scales like `current`).
        After a write from elsewhere (a checkpoint restoring the history: its tensor version changed) it is
        read from the history itself: ready when some amax in it is > 0."""
        if self.amax_history._version != self._history_version:
            self._history_ready = bool((self.amax_history > 0).any())
            self._history_version = self.amax_history._version
        return self._history_ready

    def take_saturation(self) -> list:
        """Per role, the percentage of values the clamp cut since the last call (this rank's); restarts."""
        shares = [100 * c / max(1, n) for c, n in zip(self.saturated.tolist(), self.quantized)]
        self.saturated.zero_()
        self.quantized = [0, 0, 0]
        return shares


# --- Wiring into the trainer ---------------------------------------------------------------------------------


def config_from_flags(args, settings) -> Recipe | None:
    """The FP8 recipe of --fp8 and its flags (None without --fp8), checked once, before any process group:
    _scaled_mm's shape rules for every block linear's local shard on this mesh, and for blockwise under TP
    that the 128-wide tiles do not straddle TP shards. Raises ValueError naming the flags. (The choices and
    ranges of --fp8, --fp8-amax-history, --fp8-amax-algo and --fp8-margin are argparse's and flags.py's.)"""
    mode = args.fp8
    if mode is None:
        return None
    tp, cp, micro, h = settings.shape.tp, settings.shape.cp, settings.micro_batch_size, settings.model.n_embd
    shapes = {"attn.c_attn": (h, 3 * h // tp), "attn.c_proj": (h // tp, h), "mlp.c_fc": (h, 4 * h // tp),
              "mlp.c_proj": (4 * h // tp, h)}  # local (K, N) under --tp
    for name, (k, n) in shapes.items():
        errors = gemm_shape_errors(micro * settings.seq_len // cp, k, n)
        if errors:
            raise ValueError(f"--fp8 {mode} with --tp {tp}, --cp {cp}, --micro-batch {micro}, --n-embd {h}:"
                             f" {name} [{n}×{k}] per rank: " + "; ".join(errors))
    if mode == "blockwise" and tp > 1 and (h // tp) % 128:
        raise ValueError(f"--fp8 blockwise with --tp {tp}: the TP shards of width n_embd/T = {h // tp} must be"
                         f" multiples of 128, or the 128-wide tiles would straddle ranks")
    return Recipe(mode, args.fp8_amax_history, args.fp8_amax_algo, args.fp8_margin)


def convert(model: nn.Module, recipe: Recipe, mesh=None, gemm: str = "auto", micro_batches: int = 1,
            device=None) -> Fp8Handle:
    """Swap every nn.Linear inside the blocks (routers, gates and experts aside) for an Fp8Linear, in place.
    mesh: a mesh.Mesh (None: one process). The current-scaling groups are cp and tp, the delayed roll's the
    linear's gradient group (dp_cp, or expert_dp) and tp, each kept when it has more than one rank. Under
    sequence parallel a ColumnParallelLinear keeps its gathered input (now in FP8) instead of re-gathering it
    in backward: its `regather` is switched off. micro_batches: m, for the predicted messages. device: where the
    scaling state lives (default: the weights'; train.compose converts a meta model, materialised later)."""

    def groups(*names):
        return tuple(n for n in names if mesh is not None and mesh.size(n) > 1)

    linears, codec = {}, ZeroWeightCodec()  # how ZeRO-3 gathers these weights (the section at the end)
    for block in model.transformer.h:
        for path, module in list(block.named_modules()):
            leaf = path.rpartition(".")[2]
            if type(module) is not nn.Linear or leaf in ("router", "gate") or ".experts." in f".{path}":
                continue  # routers stay precise; experts see data-dependent row counts (module docstring)
            info = getattr(module.weight, "shard_info", None)
            name = info.global_name.removesuffix(".weight") if info else f"transformer.h.{block.layer_id}.{path}"
            amax_groups = tuple(mesh.group(g) for g in groups("cp", "tp"))
            fp8 = Fp8Linear(module, recipe, name, amax_groups, gemm, device)
            fp8.amax_group_names = groups("cp", "tp")
            fp8.delayed_groups = groups(info.grad_group if info else "dp_cp", "tp")
            codec.attach(fp8)
            parent = block.get_submodule(path.rpartition(".")[0])
            setattr(parent, leaf, fp8)
            if getattr(parent, "regather", False):
                parent.regather = False
            linears[name] = fp8
    return Fp8Handle(recipe, linears, mesh, micro_batches, model.config.activation_checkpointing)


def apply(model: nn.Module, run, recipe: Recipe) -> Fp8Handle:
    """The axis entry point: the handle (after PP, before DDP/ZeRO)."""
    return convert(model, recipe, run.mesh, micro_batches=run.micro_batches, device=run.device)


class Fp8Handle(Axis):
    """What the trainer talks to: the step's end (`after_grad_sync`), the scaling state for checkpoints, the
    predicted messages. linears: {global name: Fp8Linear}; micro_batches: m; recomputes: activation
    checkpointing (a block's forward, and its amax reductions, run twice)."""

    name = "fp8"

    def __init__(self, recipe: Recipe, linears: dict, mesh=None, micro_batches: int = 1, recomputes: bool = False):
        self.recipe, self.linears, self.mesh = recipe, linears, mesh
        self.micro_batches, self.recomputes = micro_batches, recomputes
        self.first_steps = 0  # delayed steps that scaled like `current` (empty history)
        self.nonfinite_steps = 0  # steps in which some FP8 tensor had a non-finite amax (skipped everywhere)
        buckets = {}
        for name, linear in linears.items():
            buckets.setdefault(linear.delayed_groups, []).append(name)
        self.buckets = sorted(buckets.items())  # the same order on every rank

    def after_grad_sync(self, layout) -> int:
        """Once per optimizer step, after the gradient reduction: `end_step`, whose count of linears with a
        non-finite amax the update adds to its world finite check (a non-finite amax skips the step everywhere)."""
        return self.end_step()

    @torch.no_grad()
    def end_step(self) -> int:
        """Close the step: drop its FP8 weights (the optimizer step comes next), reduce its amaxes (delayed: MAX
        over each linear's gradient group and tp), roll the finite ones into the histories. Returns how many
        linears had a non-finite amax on this rank. The roll does not wait for the update's verdict: a step
        skipped for another reason (an fp16 overflow) still records its tensors, as Transformer Engine does."""
        if not self.linears:
            return 0
        for linear in self.linears.values():
            linear.weight_codes = None
        names = list(self.linears)
        amax = torch.stack([self.linears[n].step_amax for n in names])  # [n, 3]
        amax = torch.nan_to_num(amax, nan=float("inf"), posinf=float("inf"))  # MAX must not drop a NaN
        delayed = self.recipe.mode == "delayed"
        if delayed:
            self.first_steps += not all(lin.history_ready for lin in self.linears.values())
            for group_names, members in self.buckets:
                index = [names.index(m) for m in members]
                part = amax[index].contiguous()
                for group_name in group_names:
                    dist.all_reduce(part, op=dist.ReduceOp.MAX, group=self.mesh.group(group_name))
                amax[index] = part
        finite = torch.isfinite(amax).all(dim=1).tolist()  # the one host sync of the step
        for row, name in enumerate(names):
            linear = self.linears[name]
            if delayed:
                linear.roll(amax[row], finite[row])
            linear.step_amax.zero_()
        nonfinite = len(finite) - sum(finite)
        self.nonfinite_steps += nonfinite > 0
        return nonfinite

    def state_pieces(self) -> list:
        """The delayed recipe's histories and scales as logical tensors ("fp8/<linear>.amax_history", ".scale"):
        identical on every rank holding the linear, written by the one at coordinate 0 of its gradient group
        and of tp (model.counts_here), so they reload on any mesh (`history_ready` follows the loaded history)."""
        if self.recipe.mode != "delayed":
            return []
        coords = self.mesh.coordinates() if self.mesh is not None else None
        pieces = []
        for name, linear in self.linears.items():
            grad_group = linear.weight.shard_info.grad_group if hasattr(linear.weight, "shard_info") else "dp_cp"
            for suffix, tensor in (("amax_history", linear.amax_history), ("scale", linear.scale)):
                info = ShardInfo(f"{name}.{suffix}", tuple(tensor.shape), replicated_over=("tp", "cp"))
                pieces.append(StatePiece(f"fp8/{name}.{suffix}", tensor, info,
                                         primary=counts_here(info, coords, (grad_group,))))
        return pieces

    # --- prediction formulas (docstring item 3) -------------------------------------------------------------

    def predicted_messages(self, layout=None, first_step: bool = False) -> Messages:
        """The amax MAX all-reduces of one optimizer step. first_step: the delayed recipe's first step (an empty
        history), which also sends the current recipe's."""
        out = Messages()
        if self.recipe.mode == "current" or (self.recipe.mode == "delayed" and first_step):
            calls = len(self.linears) * self.micro_batches
            forwards = calls * (2 if self.recomputes else 1)
            for group in [g for g in ("cp", "tp") if self.mesh is not None and self.mesh.size(g) > 1]:
                out.add("all_reduce", group, forwards, 8 * forwards)  # forward [amax_x, amax_w]
                out.add("all_reduce", group, calls, 4 * calls)  # backward amax_dY
        if self.recipe.mode == "delayed":
            for group_names, members in self.buckets:
                for group in group_names:
                    out.add("all_reduce", group, 1, 12 * len(members))  # end_step: [amax_x, amax_w, amax_dY]
        return out

    def traced_prediction(self, layout, steps: int) -> Messages:
        """Per step over `steps` traced steps: the delayed recipe's first steps also sent current's messages."""
        first = min(self.first_steps, steps) if self.recipe.mode == "delayed" else 0
        return (self.predicted_messages(layout).times((steps - first) / max(1, steps))
                + self.predicted_messages(layout, first_step=True).times(first / max(1, steps)))


def saved_input_bytes(linears, tokens: int, compute_bytes: int) -> dict:
    """Bytes of the FP8 linears' saved inputs per micro-batch of `tokens` (M): {"fp8": Σ M·K_j, "compute": in
    the compute dtype, "saved": Σ M·K_j·(e_c - 1)} (docstring item 2)."""
    elements = sum(tokens * linear.in_features for linear in linears)
    return {"fp8": elements, "compute": elements * compute_bytes, "saved": elements * (compute_bytes - 1)}


# ---------------------------------------------------------------------------------------------------------
# The ZeRO-3 weight codec
# ---------------------------------------------------------------------------------------------------------


class ZeroWeightCodec:
    """How ZeRO-3 gathers the FP8 linears' weights: as E4M3 bytes (one per element instead of b_w), each weight
    with ONE scale shared by every rank that holds a piece of it, so that the gathered weight is what its linear
    would quantise the whole tensor to. `convert` attaches one codec to every FP8 weight (`weight.gather_codec`,
    like `shard_info`); zero.py knows that attribute and the two methods, nothing of the recipe:

        encode(weights, segments, group) -> (codes, decoding)    this rank's shard segments → uint8 codes
        decode(weights, codes, into, decoding)                    the gathered codes → the working weights

    The scale: the amaxes of the weights' segments in ONE all-reduce (MAX, 4 bytes per weight) over the gathering
    group (the whole local weight), then over the linears' amax groups (their TP/CP pieces); or, under delayed
    scaling with a history, the linear's own scale[1]. decode hands each linear the amax its codes were scaled
    with (`gathered_weight_amax`), so it scales the decoded q/s with exactly s and re-quantises it to the same
    codes. Blockwise scales 128×128 tiles: no one scale to share, so its weights get no codec.
    """

    def __init__(self):
        self.linear_of = {}  # weight parameter → its Fp8Linear

    def attach(self, linear: Fp8Linear) -> None:
        if linear.recipe.mode != "blockwise":
            self.linear_of[linear.weight] = linear
            linear.weight.gather_codec = self

    @torch.no_grad()
    def encode(self, weights: list, segments: list, group) -> tuple:
        """(uint8 codes of each segment, the scales and amaxes decode needs). Collective over `group` and the
        linears' amax groups: every rank holding a piece of these weights calls it with the same weights."""
        linears = [self.linear_of[w] for w in weights]
        none = torch.zeros((), dtype=torch.float32, device=segments[0].device)  # a rank without a piece
        amax = torch.stack([amax_of(s) if s.numel() else none for s in segments])  # float32, as the linear's own
        if dist.get_world_size(group) > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        for amax_group in linears[0].amax_groups:  # the same groups for every block linear
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=amax_group)
        scales = [linear.scale[1] if linear.recipe.mode == "delayed" and linear.history_ready else  # as the linear
                  scale_from_amax(value, linear.fmt_max[1], linear.recipe.margin) for linear, value in zip(linears, amax)]
        return [quantize_to_uint8(s, scale) for s, scale in zip(segments, scales)], (scales, amax)

    @torch.no_grad()
    def decode(self, weights: list, codes: list | None, into: list, decoding) -> None:
        """Each weight's gathered codes → q/s in `into` (its working weight, flat), and its linear told the amax.
        codes None: `into` was gathered exactly (ZeRO's unshard): the linears scale from the weights again."""
        for i, (weight, target) in enumerate(zip(weights, into)):
            linear = self.linear_of[weight]
            if codes is None:
                linear.gathered_weight_amax = None
                continue
            scales, amax = decoding
            target.copy_(dequantize_from_uint8(codes[i], scales[i], target.dtype))
            linear.gathered_weight_amax = amax[i]

    def encode_messages(self, weights: list, group_name: str | None) -> Messages:
        """What one `encode` of `weights` sends (group_name None: a gathering group of one rank sends nothing)."""
        out = Messages()
        for name in ((group_name,) if group_name else ()) + tuple(self.linear_of[weights[0]].amax_group_names):
            out.add("all_reduce", name, 1, 4 * len(weights))
        return out
