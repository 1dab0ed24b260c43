"""FP8 training: the block linears compute their GEMMs in 8-bit floats, with per-tensor or blockwise scales.

E4M3 (4 exponent bits, 3 mantissa bits) reaches 448, E5M2 57344 (more range, less precision). A tensor x goes to
FP8 with a scale s that puts its largest magnitude near the top of the format:

    s = max_format / amax / 2^margin,       q = cast(clamp(x·s, -max_format, max_format)),       x ≈ q / s

The clamp matters: torch's E4M3 cast saturates at 448 in eager mode, the E5M2 cast overflows to inf. As in
Micikevicius et al. 2022 and Transformer Engine, inputs and weights are E4M3, output gradients E5M2: the forward
GEMM is e4m3×e4m3, the backward ones (dX = dY·W, dW = dYᵀ·X) e5m2×e4m3. The recipe (`--fp8`) chooses the scale:
  current    amax of this tensor now (reduced over the ranks that hold pieces of it);
  delayed    Transformer Engine's DelayedScaling: the scale of step s comes from the amax HISTORY of steps < s
             (`max` over the last L steps or the `most_recent`), so no reduction waits in the forward (the first
             step, with an empty history, scales like `current`, as torchao's did);
  blockwise  DeepSeek-V3 (2024, section 3.3): all E4M3, one scale per 1×128 tile of activations and output
             gradients and per 128×128 block of weights (current scaling, tile by tile).

Which layers: the block linears (c_attn, attention's and the MLP's c_proj, c_fc: ~2/3 of a GPT's FLOPs; a MoE
block's shared and routed experts'). The head stays in the compute dtype (the cross-entropy's gradient lives in
small differences), the loss in fp32, MoE routers precise as in DeepSeek-V3 (a flipped top-k choice is not a
small error).
Experts: a routed expert's rows depend on the data, and _scaled_mm needs every GEMM dimension a multiple of 16
(fp8_scaling.ROW_ALIGNMENT, the rule on Hopper): its linears append zero rows up to the next multiple (the
outputs of those rows dropped, their dY zero, so amaxes, Y, dX and dW are the unpadded ones). One logical
tensor of an expert is the rows it gets from ONE source rank's micro-batch (piece): moe.py runs each
[source][expert] chunk as its own GEMM, so the expert's current scale is the amax of those rows, with no
reduction (the expert is whole on its EP rank), and E = 2 quantises exactly as E = 1 and one device. Under CP
or SP a micro-batch's rows of an expert lie on several ranks: each piece is scaled alone there (a reduction
would wait on ranks that may not call that expert at all), so those meshes follow one device within FP8's
tolerance, not exactly. Delayed: a history per expert linear, its MAX over expert-dp and tp; blockwise: the
chunk's own 128-tiles. With --moe-replicas (experts/eplb.py) each physical slot is its own FP8 linear, named by its
slot's path (two slots on a rank may hold one logical expert), E·k/R of the rows; an expert's chunk is split
over its replicas, each part scaled alone (FP8's tolerance, as under CP); delayed keeps one history per LOGICAL
expert on every rank, its amax the MAX over all the expert's slots, in the dense linears' dp×cp all-reduce
(precision/fp8_replicas.py: a slot reads its expert's history, so a re-plan or a resume moves nothing).
Padding costs Σ_chunks (−m mod 16) rows, each 5h FP8 bytes of saved inputs (c_fc's h, c_proj's 4h) and 5h more
of dY codes in backward (`padding_bytes`; measured per MoE layer at the end).

One logical tensor, one scale, on any mesh: the ranks holding pieces of a tensor (TP shards of a weight, an
activation or its gradient; CP pieces of a sequence) MAX-reduce its amax before quantising, so every element is
quantised as on one device (data-parallel ranks hold other data: current scaling never reduces over them); the
delayed history of step s is the max over its micro-batches and ranks (the linear's gradient group, dp×cp or
expert-dp, and TP). With FP8 tensor cores (compute capability ≥ 8.9) the per-tensor GEMMs run on
`torch._scaled_mm`, elsewhere (and for blockwise) emulated on the same quantised values in fp32 (fp64 for
float64 models), rounded once as tensor cores accumulate; `_scaled_mm`'s rules are checked on every device.

Symbols: M = b·s/C tokens per micro-batch on a rank (with --sp the column layers see the gathered b·s), h hidden,
T tensor parallel, L history length, n FP8 linears on this rank, e_c bytes of a compute-dtype element (bf16: 2).

1. Replicated and split: nothing new is split. Each FP8 linear keeps its parameters (TP shards as they were) and
   adds, per role (input, weight, grad_output), a scale and an L-long amax history, replicated.
2. Peak per device: the scaling state, n·(3L + 12)·4 bytes. Each FP8 linear saves its input for backward in FP8:
   Σ_j M·K_j·(e_c - 1) bytes less per micro-batch in flight (`saved_input_bytes`; K_j its local input width; per
   GPT layer M·h·(2 + 5/T)·(e_c - 1); blockwise adds a float32 scale per 128 values, +3%). The weight is
   quantised once per optimizer step (`WeightCodes`) for every micro-batch in flight: Σ_j N_j·K_j bytes, twice
   on the per-tensor recipes (dX's column-major copy), instead of autocast's e_c-byte copy. Under --sp a column
   layer keeps its gathered input in FP8 (M·h bytes, not its 2·M·h/T bf16 shard) and does not re-gather it in
   backward (`convert` switches `regather` off). Temporaries: the fp32 scaled copy being quantised
   (≤ 4·M·4h/T bytes), FP8 transposes of dY and X in backward; under the pipeline's zb, dW's FP8 operands
   (M·(N_j + K_j) bytes) and db from I to W.
3. Messages (all_reduce MAX, float32, on the critical path, tiny and latency-bound; `predicted_messages`):
     current:   per linear and micro-batch: forward 8 bytes ([amax_x, amax_w]), backward 4 bytes (amax_dY), over
                cp and over tp (each when its size > 1); activation checkpointing repeats the forward's;
                selective recompute does not (the amax MAX an operator its policy keeps: parallel/recompute.py).
     delayed:   per optimizer step, in `after_grad_sync`: one 12·n-byte all_reduce over the linears' gradient
                group (dp_cp; expert_dp for experts, dp_cp for replicas' logical ones) and one over tp (each
                when its size > 1); the first step (empty history) also sends the current recipe's messages.
     blockwise: none: the tiles are local (`config_from_flags` requires TP-split widths that are multiples of
                128; under CP dW's 128-token tiles are this rank's tokens, so blockwise equals the single device
                only when its sequence pieces hold whole tiles).
   ZeRO-3 gathers these weights as E4M3 bytes, each gather adding a MAX all_reduce of 4 bytes per weight over
   the gathering group and the amax groups (`ZeroWeightCodec`, the last section).
4. Restart state: per linear and role the amax history and scale (delayed; current and blockwise have none),
   keyed by the linear's global name (`state_pieces`; a replicated expert's logical one): the same on every rank
   holding the linear, so a checkpoint writes them once and any mesh restores them; a restored run replays bitwise.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from parallel import collectives
from precision.fp8_replicas import ReplicaHistories
from precision.fp8_scaling import (E4M3, E5M2, FORMATS, ROW_ALIGNMENT, TILE_ACTIVATION, TILE_ACTIVATION_T, TILE_WEIGHT,
                                   DelayedHistory, amax_of, dequantize, dequantize_tiles, gemm_shape_errors,
                                   has_fp8_tensor_cores, pad_rows, quantize, quantize_tiles, scale_from_amax,
                                   scaled_matmul, wide_dtype)
from shard import ShardInfo, StatePiece, counts_here
from step import Messages
from step import in_backward
from step import Axis

# --- The scaling rule (Transformer Engine's DelayedScaling) --------------------------------------------------

MODES = ("current", "delayed", "blockwise")


@dataclass(frozen=True)
class Recipe:
    mode: str  # current | delayed | blockwise
    amax_history: int = 16  # L
    amax_algo: str = "max"  # max | most_recent
    margin: int = 0


# --- The FP8 linear ------------------------------------------------------------------------------------------
# Blockwise (DeepSeek-V3): every scale covers 128 consecutive values of the dimension its GEMM contracts, so it
# factors out of each 128-long partial sum; the weight's 128×128 blocks serve both of its GEMMs.
#   forward   Y  = X·Wᵀ   contracts K        X [M, K] in 1×128 tiles,   W [N, K] in 128×128 blocks
#   input     dX = dY·W   contracts N        dY [M, N] in 1×128 tiles,  W as above
#   weight    dW = dYᵀ·X  contracts M tokens dY [M, N] and X [M, K] in 128×1 tiles
# The inverse-scale grids (quantize_tiles): W [⌈N/128⌉, ⌈K/128⌉], X [M, ⌈K/128⌉], dX's dY [M, ⌈N/128⌉].

FORWARD, BACKWARD = slice(0, 2), slice(2, 3)  # the roles quantised in each pass (slices: no index tensors)


class QuantizationObserver:
    """Who watches the casts: told, per role of each training quantisation (a forward with autograd, every
    backward), the values cast and how many the clamp cut (an int64 tensor on the device; None where the recipe
    scales from the amax now and cannot saturate: current, blockwise). Nobody by default; the accounting
    subscribes its counter (`Fp8Handle.observe`, observers.SaturationCount), which the scale table reads."""

    def quantized(self, linear: Fp8Linear, role: int, values: int, saturated: torch.Tensor | None) -> None:
        pass

    def padded(self, linear: Fp8Linear, rows: int) -> None:
        """An expert's linear appended `rows` zero rows to a training forward's input (ROW_ALIGNMENT)."""


def blockwise_weight_grad_operands(dy: torch.Tensor, qx: torch.Tensor, ix: torch.Tensor, wide: torch.dtype):
    """dW's operands in 128×1 tiles: (dY codes, grid [⌈M/128⌉, N], X codes, grid [⌈M/128⌉, K]); X re-tiled
    from its forward codes (the only X kept)."""
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


class _Fp8LinearFunction(torch.autograd.Function):
    """Y = X·Wᵀ + b; saves X in FP8 and uses the step's FP8 weight (`Fp8Linear.weight_codes`) in both passes.
    store: the pipeline's WeightGradStore under zb (weight and bias then arrive detached): backward computes dX
    now and hands the store a callable that keeps dW's FP8 operands and db until the W action."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer, training, store):
        x2 = x.reshape(-1, x.shape[-1])  # [M, K]
        rows, x2 = x2.shape[0], pad_rows(x2, layer.row_alignment)  # an expert's rows: zero rows up to 16k
        # A selective recompute (inside a backward) runs this forward again on the kept GEMM output and amaxes:
        # it records nothing (the amaxes and casts are the forward's) and sends nothing (collective_ops).
        recording = training and not (layer.operators and in_backward())
        if recording and x2.shape[0] > rows:
            layer.observer.padded(layer, x2.shape[0] - rows)
        errors = gemm_shape_errors(x2.shape[0], layer.in_features, layer.out_features, training)
        if errors:
            raise ValueError(f"FP8 linear {layer.name} [{layer.out_features}×{layer.in_features}]: "
                             + "; ".join(errors) + " (torch._scaled_mm's rules, checked on every device)")
        device = x.device.type  # the output in autocast's dtype, as nn.Linear's would be
        out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        wide = wide_dtype(out_dtype)  # float32 inverse scales on the GPU path
        with torch.autocast(device, enabled=False):
            codes = layer.cached_weight_codes(weight)  # None: the step's first micro-batch (or a new weight)
            if layer.recipe.mode == "blockwise":
                if codes is None:
                    qw, iw, amax_w = quantize_tiles(weight, TILE_WEIGHT)
                    codes = layer.cache_weight_codes(weight, qw, amax_w, inverse_scales=iw)
                qx, ix, amax_x = quantize_tiles(x2, TILE_ACTIVATION)
                smallest = torch.stack([ix.max(), codes.inverse_scales.max()]).reciprocal()  # largest-amax tiles
                layer.record(FORWARD, torch.stack([amax_x, codes.amax]), smallest, (None, None),
                             (qx.numel(), codes.q.numel()), recording)  # cast from the amax now: no clamp cuts
                y = (dequantize_tiles(qx, ix, TILE_ACTIVATION, wide)
                     @ dequantize_tiles(codes.q, codes.inverse_scales, TILE_WEIGHT, wide).t()).to(out_dtype)
            else:
                # the weight's amax: its step codes', else ZeRO-3's (whose gathered codes were scaled with it)
                amax_w = codes.amax if codes is not None else layer.gathered_weight_amax
                if amax_w is None:
                    amax_w = amax_of(weight)
                amax = torch.stack([amax_of(x2), amax_w])
                scale = layer.scales(FORWARD, amax)  # the weight's is the same for every micro-batch of a step
                qx, sat_x = quantize(x2, E4M3, scale[0], layer.counts_saturation)
                if codes is None:
                    qw, sat_w = quantize(weight, E4M3, scale[1], layer.counts_saturation)
                    codes = layer.cache_weight_codes(weight, qw, amax_w, scale=scale[1], saturated=sat_w)
                layer.record(FORWARD, amax, scale, (sat_x, codes.saturated), (qx.numel(), codes.q.numel()),
                              recording)
                ix, iw = scale[0].to(wide).reciprocal(), codes.scale.to(wide).reciprocal()
                y = scaled_matmul(qx, ix, codes.q.t(), iw, out_dtype, layer.use_scaled_mm, "forward Y = X·Wᵀ")
            if bias is not None:
                y = y + bias.to(out_dtype)
        ctx.save_for_backward(qx, ix)  # the input kept in FP8: the activation-memory saving
        ctx.layer, ctx.codes, ctx.store, ctx.out_dtype, ctx.x_dtype = layer, codes, store, out_dtype, x.dtype
        ctx.has_bias = layer.bias is not None
        return y[:rows].view(*x.shape[:-1], y.shape[-1])  # the padding rows' outputs dropped

    @staticmethod
    def backward(ctx, grad):
        qx, ix = ctx.saved_tensors
        layer, codes, store, wide = ctx.layer, ctx.codes, ctx.store, wide_dtype(ctx.out_dtype)
        dy = pad_rows(grad.reshape(-1, grad.shape[-1]), layer.row_alignment)  # [M, N]; padding rows get zero
        wants_dw = ctx.needs_input_grad[1] or store is not None
        dx = operands = None
        with torch.autocast(grad.device.type, enabled=False):
            if layer.recipe.mode == "blockwise":
                amax = amax_of(dy)
                layer.record(BACKWARD, amax.view(1), scale_from_amax(amax, E4M3.max).view(1), (None,), (dy.numel(),))
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
                layer.record(BACKWARD, amax, scale, (sat,), (qdy.numel(),))
                idy = scale[0].to(wide).reciprocal()
                if ctx.needs_input_grad[0]:
                    dx = scaled_matmul(qdy, idy, codes.column_major, codes.scale.to(wide).reciprocal(),
                                       ctx.out_dtype, layer.use_scaled_mm, "input gradient dX = dY·W")
                operands = (qdy, idy, qx, ix)
            wants_db = ctx.has_bias and (ctx.needs_input_grad[2] or store is not None)
            db = dy.sum(0, dtype=layer.bias.dtype) if wants_db else None
        dx = None if dx is None else dx[:grad.numel() // grad.shape[-1]].to(ctx.x_dtype).view(*grad.shape[:-1],
                                                                                           qx.shape[1])
        if store is not None:  # zb's I: dW (and db, summed now from the exact dY) wait for the W action
            store.defer(lambda: [(layer.weight, weight_gradient(layer, operands, wide))]
                        + ([(layer.bias, db)] if db is not None else []))
            return dx, None, None, None, None, None
        dw = weight_gradient(layer, operands, wide) if ctx.needs_input_grad[1] else None
        return dx, dw, db, None, None, None


@dataclass(eq=False)
class WeightCodes:
    """A weight in FP8 for one optimizer step (it does not change within it): quantised by the step's first
    micro-batch, used by all its forwards and backwards; dX's column-major copy is built by the first backward."""

    q: torch.Tensor  # [N, K] row-major
    scale: torch.Tensor | None  # per tensor: s
    inverse_scales: torch.Tensor | None  # blockwise: 1/s per 128×128 block
    amax: torch.Tensor
    saturated: torch.Tensor | None  # values the clamp cut (delayed)
    source: tuple  # what it was made from (Fp8Linear._weight_source): compared before every use
    gathered_amax: torch.Tensor | None  # ZeRO-3's, compared by identity

    @functools.cached_property
    def column_major(self) -> torch.Tensor:
        """W [N, K] with N contiguous: _scaled_mm's second operand of dX = dY·W."""
        return self.q.t().contiguous().t()


def forward_operands(layer, x: torch.Tensor) -> tuple:
    """(training, store, weight, bias) of a quantising linear's forward (this file's and precision/recipe.py's):
    whether autograd will run its backward, the pipeline's WeightGradStore under zb (autograd then reaches the
    parameters only through the store's W, so the GEMM sees them detached), and the weight and bias to use."""
    training = torch.is_grad_enabled() and (x.requires_grad or layer.weight.requires_grad)
    store = layer.weight_grad_store if training and x.requires_grad else None
    weight, bias = layer.weight, layer.bias
    if store is not None:
        weight, bias = weight.detach(), None if bias is None else bias.detach()
    return training, store, weight, bias


class Fp8Linear(DelayedHistory, nn.Linear):
    """A drop-in for a local nn.Linear (plain or a TP shard inside Column/RowParallelLinear): the SAME parameter
    objects, its GEMMs in FP8, and its scaling state (per role: history, scale). amax_groups: {mesh group name:
    process group} over which pieces of its tensors are spread (cp, tp), for current scaling; delayed_groups:
    the mesh groups the delayed roll reduces over; gemm: "auto", "emulated" or "scaled_mm" (forced, for tests).
    Under the pipeline's zb it defers its own weight gradient (`defers_weight_grad`, `weight_grad_store`)."""

    defers_weight_grad = True

    def __init__(self, linear: nn.Linear, recipe: Recipe, name: str = "", amax_groups=(), delayed_groups=(),
                 gemm: str = "auto", device=None, row_alignment: int = 1, operators: bool = False):
        nn.Module.__init__(self)  # no new parameters: keep the wrapped linear's
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.register_parameter("bias", linear.bias)
        self.recipe, self.name, self.amax_groups = recipe, name, dict(amax_groups)
        self.delayed_groups = tuple(delayed_groups)
        self.row_alignment = row_alignment  # an expert's: its input zero-padded to a multiple of 16 rows
        self.row_share = 1.0  # a routed expert's: E·k/N of a micro-batch's rows (uniform routing; convert sets it)
        self.operators = operators  # selective recompute: the amax MAX through collective_ops (kept, not resent)
        device = torch.device(device) if device is not None else linear.weight.device  # a meta weight: pass the run's
        self.fmt_max = torch.tensor([f.max for f in FORMATS], device=device)
        self.amax_history = torch.zeros(3, recipe.amax_history, device=device)  # [role, L], column 0 latest
        self.scale = torch.ones(3, device=device)  # delayed: the scales this step quantises with
        self._history_ready, self._history_version = False, self.amax_history._version  # see history_ready
        self.step_amax = torch.zeros(3, device=device)  # max over this step's micro-batches (local)
        self.last_scale = torch.ones(3, device=device)  # the scale last used, for the table
        self.observer = QuantizationObserver()  # told what each training quantisation cast (Fp8Handle.observe)
        self.gathered_weight_amax = None  # set by ZeRO-3 while it holds this weight gathered from FP8 codes
        self.weight_codes = None  # this step's FP8 weight (WeightCodes), dropped when the step ends
        self.weight_grad_store = None  # the pipeline's WeightGradStore under zb (set by its install)
        self.counts_saturation = recipe.mode == "delayed"  # current and blockwise cannot saturate
        blockwise_or_double = recipe.mode == "blockwise" or linear.weight.dtype == torch.float64
        self.use_scaled_mm = (gemm == "scaled_mm" or (gemm == "auto" and has_fp8_tensor_cores(device))) \
            and not blockwise_or_double

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        training, store, weight, bias = forward_operands(self, x)
        if x.numel() == 0:  # an expert no row reached: nothing to quantise (its gradients are zero)
            return F.linear(x, weight, bias)
        return _Fp8LinearFunction.apply(x, weight, bias, self, training, store)

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
        """Keep the weight's FP8 codes until the step ends (Fp8Handle.after_grad_sync) or the weight changes."""
        self.weight_codes = WeightCodes(q, scale, inverse_scales, amax, saturated, self._weight_source(weight),
                                        self.gathered_weight_amax)
        return self.weight_codes

    def scales(self, roles: slice, amax: torch.Tensor, reduced: bool = False) -> torch.Tensor:
        """The scales to quantise `roles` with now: the delayed ones, or from the amaxes MAX-reduced over the
        ranks holding pieces of these tensors (current scaling, and delayed while the history is empty).
        reduced: the caller has reduced them (ZeRO-3's codec, all weights of a unit in one all-reduce)."""
        if self.recipe.mode == "delayed" and self.history_ready:
            return self.scale[roles].clone()
        amax = collectives.reduce_amax(amax, () if reduced else self.amax_groups.values(), self.operators)
        return scale_from_amax(amax, self.fmt_max[roles], self.recipe.margin)

    def record(self, roles: slice, amax, scale, saturated=(), values=(), training: bool = True) -> None:
        """Record this quantisation's local amaxes (max over the step) and the scale it used, and tell the
        observer, per role, the values cast and those the clamp cut: in training (a forward with autograd,
        every backward), not in evaluation."""
        if not training:
            return
        self.step_amax[roles] = torch.maximum(self.step_amax[roles], amax)  # NaN propagates
        self.last_scale[roles] = scale.detach().float()
        for role, count, n in zip(range(roles.start, roles.stop), saturated, values):
            self.observer.quantized(self, role, n, count)


# --- Wiring into the trainer ---------------------------------------------------------------------------------


def config_from_flags(args, settings) -> Recipe | None:
    """The recipe of --fp8 (None without it), checked once before any process group: _scaled_mm's shape rules
    for every block linear's local shard, and under blockwise TP no 128-wide tile straddling shards."""
    mode = args.fp8
    if mode is None:
        return None
    tp, cp, micro, h = settings.shape.tp, settings.shape.cp, settings.micro_batch_size, settings.model.n_embd
    shapes = {"attn.c_attn": (h, 3 * h // tp), "attn.c_proj": (h // tp, h), "mlp.c_fc": (h, 4 * h // tp),
              "mlp.c_proj": (4 * h // tp, h)}  # local (K, N) under --tp
    experts = settings.model.moe  # moe.ExpertsConfig, None when dense
    shared = experts.shared_experts * 4 * h if experts else 0  # a MoE block's shared experts: FP8 too
    if shared:
        shapes.update({"mlp.shared_experts.c_fc": (h, shared // tp), "mlp.shared_experts.c_proj": (shared // tp, h)})
    for name, (k, n) in shapes.items():
        errors = gemm_shape_errors(micro * settings.seq_len // cp, k, n)
        if errors:
            raise ValueError(f"--fp8 {mode} with --tp {tp}, --cp {cp}, --micro-batch {micro}, --n-embd {h}:"
                             f" {name} [{n}×{k}] per rank: " + "; ".join(errors))
    if mode == "blockwise" and tp > 1 and (h // tp) % 128:
        raise ValueError(f"--fp8 blockwise with --tp {tp}: the TP shards of width n_embd/T = {h // tp} must be"
                         f" multiples of 128, or the 128-wide tiles would straddle ranks")
    return Recipe(mode, args.fp8_amax_history, args.fp8_amax_algo, args.fp8_margin)


def convert(model: nn.Module, recipe: Recipe, mesh=None, micro_batches: int = 1, device=None) -> Fp8Handle:
    """Swap every nn.Linear of the blocks (routers and gates aside) for an Fp8Linear, in place: a routed expert's
    pads its rows and scales each call's rows alone (no amax groups; docstring, "Experts"); a
    ColumnParallelLinear stops re-gathering its input (docstring item 2). mesh None: one process; else the amax
    groups are cp and tp, the delayed roll's the gradient group and tp, each when larger than one rank. device:
    where the scaling state lives (default: the weights'; train.compose converts a meta model)."""

    def groups(*names):
        return tuple(n for n in names if mesh is not None and mesh.size(n) > 1)

    amax_groups = {name: mesh.group(name) for name in groups("cp", "tp")}
    linears, codec, replica_slots = {}, ZeroWeightCodec(), []  # codec: how ZeRO-3 gathers these weights (the end)
    for block in model.transformer.h:
        for path, module in list(block.named_modules()):
            leaf = path.rpartition(".")[2]
            if type(module) is not nn.Linear or leaf in ("router", "gate"):
                continue  # routers stay precise (module docstring)
            expert = ".experts." in f".{path}"  # routed: data-dependent row counts, whole on their EP rank
            info = getattr(module.weight, "shard_info", None)
            name = info.global_name.removesuffix(".weight") if info else f"transformer.h.{block.layer_id}.{path}"
            slots = getattr(block.mlp, "replicas", None)  # eplb.Replicas: two slots may hold one logical expert
            if expert and slots is not None:
                name = f"transformer.h.{block.layer_id}.{path}"  # its physical slot's path (experts.<slot>)
            fp8 = Fp8Linear(module, recipe, name, {} if expert else amax_groups,
                            groups(info.grad_group if info else "dp_cp", "tp"), device=device,
                            row_alignment=ROW_ALIGNMENT if expert else 1,
                            operators=model.config.selective_recompute)
            codec.attach(fp8)
            parent = block.get_submodule(path.rpartition(".")[0])
            setattr(parent, leaf, fp8)
            if expert:
                ep = mesh.size("ep") if mesh is not None else 1
                fp8.row_share = ep * model.config.moe.topk / (slots.slots if slots else model.config.moe.experts)
                if slots is not None and recipe.mode == "delayed":  # one history per logical expert: fp8_replicas
                    replica_slots.append((fp8, slots, int(path.split(".")[-2]), block.layer_id, leaf))
            if getattr(parent, "regather", False):
                parent.regather = False
            linears[name] = fp8
    histories = replica_slots and ReplicaHistories(replica_slots, model.config.moe.experts, recipe,
                                                   groups("dp_cp", "tp"), device or replica_slots[0][0].fmt_max.device)
    return Fp8Handle(recipe, linears, mesh, micro_batches, model.config.activation_checkpointing, histories or None)


def apply(model: nn.Module, run, recipe: Recipe) -> Fp8Handle:
    """The axis entry point: the handle (after PP, before DDP/ZeRO)."""
    return convert(model, recipe, run.mesh, micro_batches=run.micro_batches, device=run.device)


@dataclass(frozen=True)
class Fp8Facts:
    """What the accounting reads of the FP8 axis (`Fp8Handle.facts`): report/axes.py's fp8 section."""

    recipe: Recipe
    scaled_mm: bool  # the per-tensor GEMMs run on torch._scaled_mm (else emulated on the same codes)
    in_features: dict  # {linear's global name: K_j, its local input width, × a routed expert's row share E·k/N
    # (uniform routing: of the M tokens a rank routes, its held expert gets E·M·k/N rows; a replica slot E·M·k/R,
    # keyed by its slot's path)} (saved_input_bytes)
    weights: int  # Σ N_j·K_j: the elements of the step's FP8 weight copies
    scales: dict  # {linear's global name: its [3] scales in use (delayed: the step's; else the last used)}
    first_steps: int  # delayed steps that scaled like `current` (empty history)
    nonfinite_steps: int  # steps in which some FP8 tensor had a non-finite amax (skipped everywhere)


class Fp8Handle(Axis):
    """The axis handle. linears: {global name: Fp8Linear}; micro_batches: m; recomputes: activation
    checkpointing (a block's forward, and its amax reductions, run twice); `observe` subscribes the accounting
    to every linear's casts; histories: delayed with redundant experts, the logical experts'
    (precision/fp8_replicas.py), rolled in place of their slots'."""

    name = "fp8"

    def __init__(self, recipe: Recipe, linears: dict, mesh=None, micro_batches: int = 1, recomputes: bool = False,
                 histories: ReplicaHistories | None = None):
        self.recipe, self.linears, self.mesh, self.histories = recipe, linears, mesh, histories
        self.micro_batches, self.recomputes = micro_batches, recomputes
        self.first_steps = 0  # delayed steps that scaled like `current` (empty history)
        self.nonfinite_steps = 0  # steps in which some FP8 tensor had a non-finite amax (skipped everywhere)
        slots = {id(slot[0]) for slot in histories.slots} if histories else set()
        self.rolled = {name: linear for name, linear in linears.items() if id(linear) not in slots}  # and by name:
        self.rolled.update(histories.histories if histories else {})  # the logical experts' histories
        buckets = {}  # delayed_groups → the rows of those linears in after_grad_sync's [n, 3] amaxes
        for row, linear in enumerate(self.rolled.values()):
            buckets.setdefault(linear.delayed_groups, []).append(row)
        self.buckets = sorted(buckets.items())  # the same order on every rank

    @torch.no_grad()
    def after_grad_sync(self, layout=None) -> int:
        """Close the step: drop its FP8 weights (the update comes next), reduce its amaxes (docstring item 3),
        roll the finite ones into the histories; return the count of linears with a non-finite amax (the update
        then skips everywhere). A step skipped for another reason (fp16 overflow) still records, as in TE."""
        if not self.linears:
            return 0
        if self.histories:
            self.histories.gather()  # each logical expert's amax: the MAX of this rank's slots holding it
        linears = list(self.rolled.values())
        amax = torch.stack([linear.step_amax for linear in linears])  # [n, 3]
        amax = torch.nan_to_num(amax, nan=float("inf"), posinf=float("inf"))  # MAX must not drop a NaN
        delayed = self.recipe.mode == "delayed"
        if delayed:
            self.first_steps += not all(linear.history_ready for linear in linears)
            for group_names, rows in self.buckets:
                part = amax[rows]  # a copy: reduced, then written back
                for group_name in group_names:
                    dist.all_reduce(part, op=dist.ReduceOp.MAX, group=self.mesh.group(group_name))
                amax[rows] = part
        finite = torch.isfinite(amax).all(dim=1).tolist()  # the one host sync of the step
        for linear, row_amax, row_finite in zip(linears, amax, finite):
            if delayed:
                linear.roll(row_amax, row_finite)
        for linear in self.linears.values():
            linear.step_amax.zero_()
            linear.weight_codes = None
        if self.histories:  # after a re-plan (moe's after_grad_sync ran first): the slots' experts' histories
            self.histories.point()
        nonfinite = len(finite) - sum(finite)
        self.nonfinite_steps += nonfinite > 0
        return nonfinite

    def after_load(self, layout, step) -> None:
        """Redundant experts under delayed: each slot reads its expert's history (moe's after_load placed them)."""
        if self.histories:
            self.histories.point()

    def observe(self, observer: QuantizationObserver) -> None:
        """Every linear tells `observer` (the accounting's observers.SaturationCount) what its casts cut."""
        self.observer = observer
        for linear in self.linears.values():
            linear.observer = observer

    def facts(self) -> Fp8Facts:
        linears = self.linears.values()
        return Fp8Facts(self.recipe, any(linear.use_scaled_mm for linear in linears),
                        {name: linear.in_features * linear.row_share for name, linear in self.linears.items()},
                        sum(linear.weight.numel() for linear in linears),
                        {name: linear.scale if self.recipe.mode == "delayed" else linear.last_scale
                         for name, linear in self.linears.items()}, self.first_steps, self.nonfinite_steps)

    def state_pieces(self) -> list:
        """The delayed recipe's histories and scales as logical tensors ("fp8/<linear>.amax_history", ".scale";
        docstring item 4), written by the rank at coordinate 0 of the linear's gradient group and of tp."""
        if self.recipe.mode != "delayed":
            return []
        coords = self.mesh.coordinates() if self.mesh is not None else None
        pieces = []
        for name, linear in self.rolled.items():  # a logical expert's history: every rank of dp_cp holds it
            grad_group = linear.weight.shard_info.grad_group if hasattr(linear, "weight") and hasattr(
                linear.weight, "shard_info") else "dp_cp"
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
            calls = sum(bool(linear.amax_groups) for linear in self.linears.values()) * self.micro_batches
            forwards = calls * (2 if self.recomputes else 1)
            for group in [g for g in ("cp", "tp") if self.mesh is not None and self.mesh.size(g) > 1]:
                out.add("all_reduce", group, forwards, 8 * forwards)  # forward [amax_x, amax_w]
                out.add("all_reduce", group, calls, 4 * calls)  # backward amax_dY
        if self.recipe.mode == "delayed":
            for group_names, rows in self.buckets:
                for group in group_names:
                    out.add("all_reduce", group, 1, 12 * len(rows))  # after_grad_sync: [amax_x, amax_w, amax_dY]
        return out

    def traced_prediction(self, layout, steps: int) -> Messages:
        """Per step over `steps` traced steps: the delayed recipe's first steps also sent current's messages."""
        first = min(self.first_steps, steps) if self.recipe.mode == "delayed" else 0
        return (self.predicted_messages(layout).times((steps - first) / max(1, steps))
                + self.predicted_messages(layout, first_step=True).times(first / max(1, steps)))


def saved_input_bytes(in_features, tokens: int, compute_bytes: int) -> dict:
    """The saved inputs' bytes per micro-batch of M `tokens` through linears of input widths `in_features` (K_j):
    fp8 Σ M·K_j, compute, saved Σ M·K_j·(e_c - 1)."""
    elements = sum(tokens * k for k in in_features)
    return {"fp8": elements, "compute": elements * compute_bytes, "saved": elements * (compute_bytes - 1)}


# --- The ZeRO-3 weight codec ---------------------------------------------------------------------------------


def quantize_to_uint8(shard: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A weight shard in E4M3 with the logical tensor's shared scale, as uint8 (gloo cannot move float8).
    Quantising shards with one scale and concatenating them equals quantising the whole tensor."""
    return quantize(shard, E4M3, scale, count_saturated=False)[0].view(torch.uint8)


def dequantize_from_uint8(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse, q/scale in `dtype`: re-quantising it with the same scale gives q back exactly."""
    return dequantize(data.view(E4M3.dtype), scale, dtype)


class ZeroWeightCodec:
    """How ZeRO-3 gathers FP8 weights (zero.py knows only `weight.gather_codec` and these methods; blockwise,
    with no one scale to share, has none): E4M3 bytes, each weight with ONE scale from its amax MAX-reduced over
    its pieces, so decode's q/s re-quantises (`gathered_weight_amax`) to the codes of the whole tensor."""

    def __init__(self):
        self.linear_of = {}  # weight parameter → its Fp8Linear

    def attach(self, linear: Fp8Linear) -> None:
        if linear.recipe.mode != "blockwise":
            self.linear_of[linear.weight] = linear
            linear.weight.gather_codec = self

    @torch.no_grad()
    def encode(self, weights: list, segments: list, group, starts=None) -> tuple:
        """(uint8 codes of each segment, the scales and amaxes decode needs). Collective over `group` and the
        linears' amax groups: every rank holding a piece of these weights calls it with the same weights.
        starts (each segment's flat offset in its weight): not needed, one scale serves the whole tensor."""
        linears = [self.linear_of[w] for w in weights]
        none = torch.zeros((), dtype=torch.float32, device=segments[0].device)  # a rank without a piece
        amax = torch.stack([amax_of(s) if s.numel() else none for s in segments])  # float32, as the linear's own
        if dist.get_world_size(group) > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        for amax_group in linears[0].amax_groups.values():  # the same groups for every block linear
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=amax_group)
        scales = [linear.scales(slice(1, 2), value.view(1), reduced=True)[0] for linear, value in zip(linears, amax)]
        return [quantize_to_uint8(s, scale) for s, scale in zip(segments, scales)], (scales, amax)

    @torch.no_grad()
    def decode(self, weights: list, codes: list | None, into: list, decoding) -> None:
        """Each weight's gathered codes → q/s in `into` (its working weight, flat), and its linear told the amax.
        codes None: `into` was gathered exactly (ZeRO-3's full_parameters): the linears scale from the weights again."""
        for i, (weight, target) in enumerate(zip(weights, into)):
            gathered_amax = None
            if codes is not None:
                scales, amax = decoding
                target.copy_(dequantize_from_uint8(codes[i], scales[i], target.dtype))
                gathered_amax = amax[i]
            self.linear_of[weight].gathered_weight_amax = gathered_amax

    def encode_messages(self, weights: list, group_name: str | None) -> Messages:
        """What one `encode` of `weights` sends (group_name None: a gathering group of one rank sends nothing)."""
        out = Messages()
        for name in ((group_name,) if group_name else ()) + tuple(self.linear_of[weights[0]].amax_groups):
            out.add("all_reduce", name, 1, 4 * len(weights))
        return out
