"""Microscaling recipes (`--precision-recipe`): the block linears' GEMMs on MXFP8, MXFP4 or NVFP4 operands.

A recipe names the format of each pass's GEMM operands and the NVFP4 recipe's parts (precision/microscaling.py has the
formats). With fq = quantise → dequantise in the part's format, blocks along each GEMM's contraction dimension:

    forward   Y  = fq(X)·fq(W)ᵀ          X [M, K] and W [N, K] in blocks along K          (fwd=)
    input     dX = fq(dY)·fq(W)          dY [M, N] and W in blocks along N                 (bwd=)
    weight    dW = fq(H·dY)ᵀ·fq(H·X)     dYᵀ [N, M] and Xᵀ [K, M] in blocks along the M tokens (bwd=)

  w2d   NVFP4 weights in 16×16 blocks, so W and Wᵀ quantise alike: one quantisation serves both GEMMs;
  rht   H: each 16 tokens of both dW operands times a 16×16 random-sign Hadamard /4 (orthonormal, so dW is
        unchanged in exact arithmetic; the signs are drawn per step and layer, the same on every rank);
  sr    dY (in both backward GEMMs) rounded stochastically: unbiased, its draws a hash of (run seed, optimizer
        step, micro-batch, layer, the element's place in the LOGICAL tensor), so every mesh draws what one
        device draws, a resumed run replays them, and no generator state is saved;
  tail  the last ⌈F·n_layer⌉ blocks stay in the compute dtype (NVIDIA's NVFP4 recipe keeps ~15%);
  4over6  Four Over Six (precision/quartet.py) on the forward's 1×16 NVFP4 operands: each block keeps the better
        (lower MSE) of its max scaled to 6 and to 4;
  eden  Quartet II's backward (precision/quartet.py): the operands the forward multiplied, fq(X) and fq(W), and dY,
        each rotated along its GEMM's contraction dim by a G×G random-sign Hadamard R (rotation=G, 128 by
        default; one R per micro-batch and layer, from the logical keys), then quantised by MS-EDEN (round to
        nearest, EDEN's correction folded into the block scales, which round stochastically with draws keyed by
        each block's logical coordinates): dX = E(dY·R)·E(fq(W)ᵀ·R)ᵀ, dW = E(dYᵀ·R)·E(fq(X)ᵀ·R)ᵀ, an unbiased
        estimate of the gradient of the forward the model ran. The preset quartet2 is fwd=nvfp4,bwd=nvfp4,4over6,eden.
The embedding, the head and the loss stay in the compute dtype. A MoE block: its router stays in high precision
(no nn.Linear; DeepSeek-V3 keeps its gate precise: a flipped top-k choice is not a small error), its shared
experts are dense layers here (TP shards, amax over tp), and a routed expert's logical tensor is the chunk of
rows one source rank's micro-batch sends it (dispatch.exchange runs one GEMM per source): quantised alone,
no amax reduction, SR keyed by (the source's global micro-batch, the expert, the row in the chunk), its dW
operands zero-padded to the token block (accounting/recipe_experts.py), so E = 2 equals E = 1 and one device. --cp, --sp
and --moe-replicas would split a chunk over ranks or slots: refused with MoE (`config_from_flags`). This is an
emulation: the GEMMs run in the compute dtype (float64 models: float64) on the dequantised values. Only
Blackwell (B200) has block-scaled MX/NVFP4 tensor cores; an H100/H200 has none, so there too it is emulated.

One logical tensor, one quantisation, on any mesh: block scales are local, so `config_from_flags` refuses a
mesh on which a block would straddle two ranks' pieces (TP widths, CP sequence pieces, the tokens of a
micro-batch). NVFP4's fp32 per-tensor scale (448·6/amax) needs the amax of the whole logical tensor: the ranks
holding pieces of it (tp, cp) MAX-reduce it, as fp8.py's current scaling does. DP ranks hold other data.

Symbols: M = B_μ·s/C tokens a linear sees per micro-batch (SP gathers them), K_j, N_j a linear's local input and
output widths, n the recipe's linears on this rank, β_f bits per element of format f including its block scales
(MXFP8 8.25, MXFP4 4.25, NVFP4 4.5 plus a 32-bit tensor scale; the compute dtype 8·e_c).

1. Replicated and split: nothing new. Each recipe linear keeps its parameters (TP shards as they were).
2. Peak per device: this emulation saves each linear's input X in the compute dtype (M·K_j·e_c, as autocast's
   linear would) and quantises in backward; a block-scaled kernel would save X's backward codes instead,
   M·K_j·β_bwd/8 bytes (`saved_input_bytes`, what the start-up prints). Temporaries: one fp32 copy of the
   operand being quantised and its dequantised twin (≤ 2·4·M·4h/T bytes).
3. Messages (all_reduce MAX, float32, latency-bound, NVFP4 parts only; `predicted_messages`): per linear and
   micro-batch over tp and over cp (each when its size > 1): forward 8 bytes [amax X, amax W] when fwd=nvfp4
   (twice under activation checkpointing), backward 16 bytes [amax dY, amax dW's dY operand, amax dW's X
   operand, amax W] when bwd=nvfp4 (under eden the four rotated operands' amaxes; its re-quantisation of X and W
   reuses the forward's). MX formats and routed experts send nothing. ZeRO-3: under the nvfp4 preset (w2d, fwd
   = bwd = nvfp4) one 16×16 quantisation of W serves both GEMMs, so it gathers W's E2M1 codes (1 byte per element here,
   4 bits packed) after an all_reduce MAX of the tiles' amaxes (4 bytes per 256 elements) and the tensor amax
   (`ZeroWeightCodec`, precision/recipe_codec.py); otherwise W is quantised along K for Y and along N for dX (two
   copies, 2·β ≥ b_w bits), so it is gathered in the working dtype (b_w bytes per element) and quantised after the
   gather.
4. Restart state: the optimizer step the draws and Hadamard signs are keyed by ("precision/step", one float64,
   the same on every rank and mesh; precision/randomness.py); nothing else: no amax history, no generator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

import context_parallel
from parallel import collectives
from precision import microscaling, microscaling_fast, quartet, randomness
from fp8 import QuantizationObserver, forward_operands
from precision.fp8_scaling import pad_rows
from precision.randomness import DrawState, hadamard_signs, uniform_draws
from precision.recipe_codec import ZeroWeightCodec
from shard import ShardInfo, StatePiece, counts_here
from step import Messages
from step import in_backward
from step import Axis

# --- The recipe: its parts, presets and checks ---------------------------------------------------------------

FORMAT_NAMES = ("bf16", "mxfp8", "mxfp4", "nvfp4")  # bf16: the compute dtype (no quantisation)
RULES = ("rceil", "floor")
PRESETS = {"mxfp8": "fwd=mxfp8,bwd=mxfp8", "mxfp4": "fwd=mxfp4,bwd=mxfp4",
           "nvfp4": "fwd=nvfp4,bwd=nvfp4,sr,rht,w2d,tail=0.15", "quartet2": "fwd=nvfp4,bwd=nvfp4,4over6,eden"}
ACCEPTED = ("comma-separated parts, each a preset (mxfp8 | mxfp4 | nvfp4 | quartet2) or one of"
            " fwd=bf16|mxfp8|mxfp4|nvfp4, bwd=bf16|mxfp8|mxfp4|nvfp4, sr, rht, w2d, 4over6, eden, rotation=G"
            " (16|32|64|128|256), tail=F (0 ≤ F < 1), rule=rceil|floor")
FLAGS = ("sr", "rht", "w2d", "4over6", "eden")  # parts without a value
HADAMARD = 16  # rht's block (tokens)
TWO_D = 16  # w2d's block (NVFP4's)
ROTATIONS = (16, 32, 64, 128, 256)  # MS-EDEN's rotation group: a power of two, whole NVFP4 blocks


@dataclass(frozen=True)
class PrecisionRecipe:
    """What --precision-recipe asks for (parse_recipe), validated."""

    spec: str  # as given
    fwd: str = "bf16"
    bwd: str = "bf16"
    sr: bool = False
    rht: bool = False
    w2d: bool = False
    four_over_six: bool = False  # "4over6": the forward's NVFP4 blocks each the better of max → 6 and → 4
    eden: bool = False  # the backward's NVFP4 operands by MS-EDEN (precision/quartet.py)
    rotation: int = quartet.EDEN_GROUP  # MS-EDEN's rotation group G (along each backward GEMM's contraction)
    tail: float = 0.0
    rule: str = "rceil"

    def tail_layers(self, n_layer: int) -> int:
        """How many of the last blocks stay in the compute dtype: ⌈F·n_layer⌉."""
        return math.ceil(self.tail * n_layer - 1e-9)

    @property
    def gathers_codes(self) -> bool:
        """Whether ZeRO-3 gathers its weights as E2M1 codes (precision/recipe_codec.py): fwd = bwd = nvfp4 under w2d,
        one 16×16 quantisation of W serving both GEMMs (not under eden, which re-quantises the forward's W)."""
        return self.fwd == self.bwd == "nvfp4" and self.w2d and not self.eden

    @property
    def token_block(self) -> int:
        """The block along the tokens (dW's contraction): the backward format's, rht's 16, eden's rotation."""
        return max(block_of(self.bwd), HADAMARD if self.rht else 1, self.rotation if self.eden else 1)

    def describe(self) -> str:
        parts = [f"fwd={self.fwd}", f"bwd={self.bwd}"] + [p for p in ("sr", "rht", "w2d") if getattr(self, p)]
        parts += (["4over6"] if self.four_over_six else []) + ([f"eden,rotation={self.rotation}"] if self.eden else [])
        return ",".join(parts + ([f"tail={self.tail:g}"] if self.tail else []) + [f"rule={self.rule}"])


def parse_recipe(spec: str) -> PrecisionRecipe:
    """SPEC → PrecisionRecipe, or a ValueError naming --precision-recipe and the accepted parts."""
    values: dict = {}  # a preset among the parts stands for its own parts; a later part overrides an earlier
    for part in (q.strip() for p in spec.split(",") for q in PRESETS.get(p.strip(), p).split(",")):
        key, _, value = part.partition("=")
        bad = f"--precision-recipe {spec!r}: {part!r} is not a part; expected {ACCEPTED}"
        if key in ("fwd", "bwd") and value in FORMAT_NAMES:
            values[key] = value
        elif key in FLAGS and not value and "=" not in part:
            values[{"4over6": "four_over_six"}.get(key, key)] = True
        elif key == "rotation" and value in map(str, ROTATIONS):
            values[key] = int(value)
        elif key == "rule" and value in RULES:
            values[key] = value
        elif key == "tail" and value:
            try:
                fraction = float(value)
            except ValueError:
                raise ValueError(bad) from None
            if not 0.0 <= fraction < 1.0:
                raise ValueError(f"--precision-recipe {spec!r}: tail={value} must be in [0, 1) (the share of the"
                                 f" last blocks kept in the compute dtype)")
            values[key] = fraction
        else:
            raise ValueError(bad)
    recipe = PrecisionRecipe(spec, **values)
    if (recipe.sr or recipe.rht) and recipe.bwd == "bf16":
        raise ValueError(f"--precision-recipe {spec!r}: sr and rht act on the backward's quantised operands;"
                         f" give bwd=mxfp8|mxfp4|nvfp4")
    if recipe.w2d and "nvfp4" not in (recipe.fwd, recipe.bwd):
        raise ValueError(f"--precision-recipe {spec!r}: w2d is NVFP4's 16×16 weight scaling; give fwd=nvfp4 or"
                         f" bwd=nvfp4")
    if recipe.four_over_six and (recipe.fwd != "nvfp4" or recipe.w2d):
        raise ValueError(f"--precision-recipe {spec!r}: 4over6 chooses the scale of the forward's 1×16 NVFP4 blocks;"
                         f" give fwd=nvfp4, without w2d")
    if recipe.eden and (recipe.bwd != "nvfp4" or recipe.sr or recipe.rht):
        raise ValueError(f"--precision-recipe {spec!r}: eden is the backward's NVFP4 quantiser with its own rotation"
                         f" and randomness; give bwd=nvfp4, without sr and rht")
    if "rotation" in values and not recipe.eden:
        raise ValueError(f"--precision-recipe {spec!r}: rotation=G is MS-EDEN's rotation group; give eden")
    return recipe


def block_of(name: str, two_d: bool = False) -> int:
    """The block a format scales along its contraction dimension (1: the compute dtype, unblocked)."""
    if name == "bf16":
        return 1
    return TWO_D if two_d else microscaling.FORMATS[name].block


def config_from_flags(args, settings) -> PrecisionRecipe | None:
    """--precision-recipe's recipe (None without it), checked once before any process group: not with --fp8,
    and every block of every GEMM inside one rank's piece (the module docstring's rule)."""
    spec = getattr(args, "precision_recipe", None)
    if spec is None:
        return None
    recipe = parse_recipe(spec)
    if args.fp8 is not None:
        raise ValueError(f"--precision-recipe {spec} with --fp8 {args.fp8}: choose one recipe for the block linears")
    moe = settings.model.moe and settings.model.moe.experts
    if moe and (settings.shape.cp > 1 or settings.sequence_parallel or args.moe_replicas):
        what = "--cp" if settings.shape.cp > 1 else "--sp" if settings.sequence_parallel else "--moe-replicas"
        raise ValueError(f"--precision-recipe {spec} with --moe-experts {moe} and {what}: a routed expert's rows of"
                         f" one micro-batch would be split over pieces or slots, each quantised alone (not the single"
                         f" device's quantisation); without {what}")
    tp, cp, h = settings.shape.tp, settings.shape.cp, settings.model.n_embd
    tokens = settings.micro_batch_size * settings.seq_len // cp
    piece = settings.seq_len // cp // (2 if cp > 1 and args.cp_balance == "zigzag" else 1)
    # local (K, N segment) under --tp: c_attn's N is three segments (q, k, v) of h/T each
    widths = {"attn.c_attn": (h, h // tp), "attn.c_proj": (h // tp, h), "mlp.c_fc": (h, 4 * h // tp),
              "mlp.c_proj": (4 * h // tp, h)}
    w2d = TWO_D if recipe.w2d else 1
    fwd_w2d, bwd_w2d = (w2d if recipe.fwd == "nvfp4" else 1), (w2d if recipe.bwd == "nvfp4" else 1)
    needs = []  # (what, size, block)
    for name, (k, n) in widths.items():
        needs += [(f"{name}'s input width K={k}", k, max(block_of(recipe.fwd), bwd_w2d)),
                  (f"{name}'s output width N={n}" + (" per q/k/v segment" if name == "attn.c_attn" else ""), n,
                   max(block_of(recipe.bwd), fwd_w2d, recipe.rotation if recipe.eden else 1))]
    token_block = recipe.token_block
    needs.append((f"the tokens a linear sees per micro-batch, M = B_μ·s/C = {tokens}", tokens, token_block))
    if cp > 1:
        needs.append((f"each rank's sequence piece under --cp {cp} ({args.cp_balance}), {piece} tokens", piece,
                      token_block))
    for what, size, block in needs:
        if block > 1 and size % block:
            raise ValueError(f"--precision-recipe {spec} with --tp {tp}, --cp {cp}, --micro-batch"
                             f" {settings.micro_batch_size}, --n-embd {h}: {what} is not a multiple of the"
                             f" {block}-wide block (a block must lie inside one rank's piece)")
    return recipe


# --- The recipe linear ---------------------------------------------------------------------------------------


def amax_of(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(x, float("inf")).float() if x.numel() else torch.zeros((), device=x.device)


class _RecipeLinearFunction(torch.autograd.Function):
    """Y = fq(X)·fq(W)ᵀ + b (module docstring); saves X and W as given and quantises the backward's operands
    from them. store: the pipeline's WeightGradStore under zb (weight and bias then arrive detached)."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer, training, store, micro_batch):
        device = x.device.type
        out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        x2 = x.reshape(-1, x.shape[-1]).to(out_dtype)  # [M, K] as autocast's linear would take it (TP's SP
        # input arrives cast already: then x2 is a view of x, which TP's regathering hook recognises when saved)
        with torch.autocast(device, enabled=False):
            y, amax = layer.forward_gemm(x2, weight, out_dtype, training)
            if bias is not None:
                y = y + bias.to(out_dtype)
        ctx.save_for_backward(x2, weight)
        ctx.layer, ctx.store, ctx.out_dtype, ctx.x_dtype = layer, store, out_dtype, x.dtype
        ctx.token_shape = tuple(x.shape[:-1])  # (B, L): the tokens' logical rows (SR's coordinates)
        ctx.micro_batch = micro_batch  # j of this step's training forwards (SR's draws)
        ctx.forward_amax = amax  # the forward's reduced tensor amaxes: eden re-quantises X and W as it did
        ctx.has_bias = bias is not None or (store is not None and layer.bias is not None)
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        x2, weight = ctx.saved_tensors
        layer, store = ctx.layer, ctx.store
        dy = grad.reshape(-1, grad.shape[-1])  # [M, N]
        wants_dw = ctx.needs_input_grad[1] or store is not None
        with torch.autocast(grad.device.type, enabled=False):
            dx, dw_operands = layer.backward_operands(dy, x2, weight, ctx.out_dtype, ctx.token_shape,
                                                      ctx.micro_batch, ctx.needs_input_grad[0], wants_dw,
                                                      ctx.forward_amax)
            db = dy.sum(0, dtype=layer.bias.dtype) if ctx.has_bias and layer.bias is not None else None
        dx = None if dx is None else dx.to(ctx.x_dtype).view(*grad.shape[:-1], x2.shape[1])
        if store is not None:  # zb's I: dW (and db) wait for the W action; the operands are already quantised
            store.defer(lambda: [(layer.weight, dw_operands[0] @ dw_operands[1].t())]
                        + ([(layer.bias, db)] if db is not None else []))
            return dx, None, None, None, None, None, None
        dw = (dw_operands[0] @ dw_operands[1].t()).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, (db if ctx.needs_input_grad[2] else None), None, None, None, None


class RecipeLinear(nn.Linear):
    """A drop-in for a local nn.Linear (plain or a TP shard inside Column/RowParallelLinear): the SAME parameter
    objects, its GEMMs on quantised operands. What places it in the logical tensors (SR's draws): the rank's
    `DrawState`, the global output-feature index of each local row of W (`out_index`) and its layer and role
    (`layer_key`); amax_groups: {name: process group} of the ranks holding pieces of its tensors (tp, cp), for
    NVFP4's tensor amax."""

    defers_weight_grad = True  # under zb it hands its dW to the pipeline's store itself

    def __init__(self, linear: nn.Linear, recipe: PrecisionRecipe, handle_state, name: str, layer_key: int,
                 out_index: torch.Tensor, amax_groups: dict, sources: list | None = None, token_block: int = 1,
                 in_index: torch.Tensor | None = None):
        nn.Module.__init__(self)  # no new parameters: keep the wrapped linear's
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.register_parameter("bias", linear.bias)
        self.recipe, self.state, self.name, self.layer_key = recipe, handle_state, name, layer_key
        self.out_index, self.amax_groups = out_index, dict(amax_groups)
        self.in_index = torch.arange(self.in_features) if in_index is None else in_index  # eden's draws: W's columns
        self.forwards = 0  # training forwards since the step began: the micro-batch index j of SR's draws
        self.weight_grad_store = None  # the pipeline's WeightGradStore under zb (set by its install)
        self.observer = QuantizationObserver()  # told what each training quantisation cut (PrecisionHandle.observe)
        self.gathered_weight_amax = None  # set by ZeRO-3 while it holds this weight gathered from NVFP4 codes
        # A routed expert's: the first global micro-batch of each EP source rank (dispatch.exchange runs one
        # GEMM per source's rows, every source in order, so call c is source c mod E's micro-batch c // E), and
        # the token block its dW operands' rows are zero-padded to (accounting/recipe_experts.py); None, 1 for the
        # others.
        self.sources, self.token_block = sources, token_block
        self.row_share = 1.0  # a routed expert's: E·k/N of a micro-batch's M rows (convert sets it; accounting)
        self.operators = False  # selective recompute: the amax MAX through collective_ops, a recompute unrecorded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        training, store, weight, bias = forward_operands(self, x)
        calls, counted = self.forwards, training and torch._C._current_autograd_node() is None
        if counted:  # not activation checkpointing's recompute (whose backward reads the first forward's index;
            self.forwards += 1  # evaluation counts none)
        if self.sources is None:  # the global micro-batch index of SR's draws
            return _RecipeLinearFunction.apply(x, weight, bias, self, training, store,
                                               self.state.first_micro_batch + calls)
        rows = x.numel() // x.shape[-1]  # a routed expert's chunk: one source's rows
        if counted and rows:
            self.observer.padded(self, -rows % self.token_block)
        if rows == 0:  # no row reached it from this source: nothing to quantise (its gradients are zero)
            return nn.functional.linear(x, weight, bias)
        index = self.sources[calls % len(self.sources)] + calls // len(self.sources)
        return _RecipeLinearFunction.apply(x, weight, bias, self, training, store, index)

    def weight_amax(self, weight: torch.Tensor) -> torch.Tensor:
        """The weight's amax: ZeRO-3's, while it holds this weight gathered from NVFP4 codes (their values'
        own amax is not the tensor's: `ZeroWeightCodec`), else its own."""
        return self.gathered_weight_amax if self.gathered_weight_amax is not None else amax_of(weight)

    def _reduced_amax(self, values: list) -> torch.Tensor:
        """The amaxes of the logical tensors: MAX over the ranks holding pieces of them (NaN kept: inf)."""
        return collectives.reduce_amax(torch.stack(values), self.amax_groups.values(), self.operators)

    def _fq(self, x: torch.Tensor, fmt: str, dtype, role: int | None, two_d: bool = False, tensor_amax=None,
            draws=None, four_over_six: bool = False):
        """x [R, C] quantised in blocks along C and dequantised, in `dtype`; fmt bf16: x in `dtype`. role (0 an
        input, 1 the weight, 2 the output gradient; None: evaluation): the observer hears what the clamp cut.
        four_over_six: NVFP4 blocks each the better of max → 6 and max → 4 (precision/quartet.py)."""
        if fmt == "bf16":
            return x.to(dtype)
        wide = torch.float64 if x.dtype == torch.float64 else torch.float32
        if four_over_six:
            result = quartet.four_over_six(x.to(wide), tensor_amax)
            out, saturated = result.values, result.saturated
        else:
            out = microscaling_fast.fake_quantize(x.to(wide), microscaling.FORMATS[fmt], rule=self.recipe.rule,
                                                  two_d=two_d, tensor_amax=tensor_amax, draws=draws,
                                                  count_saturated=role is not None)
            out, saturated = out if role is not None else (out, None)
        if role is not None:
            self.observer.quantized(self, role, x.numel(), saturated)
        return out.to(dtype)

    def forward_operands(self, x2, weight, out_dtype, roles=(None, None), amax=None):
        """(fq(X), fq(W), NVFP4's reduced tensor amaxes [X, W] or None) of Y = fq(X)·fq(W)ᵀ, blocks along K, in
        out_dtype; amax given: the forward's (eden re-quantises its operands in the backward as it did)."""
        recipe, fmt = self.recipe, self.recipe.fwd
        if fmt == "bf16":
            return x2.to(out_dtype), weight.to(out_dtype), None
        if amax is None and fmt == "nvfp4":
            amax = self._reduced_amax([amax_of(x2), self.weight_amax(weight)])
        tensor_amax = (None, None) if amax is None else amax
        xq = self._fq(x2, fmt, out_dtype, roles[0], tensor_amax=tensor_amax[0], four_over_six=recipe.four_over_six)
        wq = self._fq(weight, fmt, out_dtype, roles[1], two_d=recipe.w2d and fmt == "nvfp4",
                      tensor_amax=tensor_amax[1], four_over_six=recipe.four_over_six)
        return xq, wq, amax

    def forward_gemm(self, x2, weight, out_dtype, training: bool):
        """(Y = fq(X)·fq(W)ᵀ in out_dtype, NVFP4's reduced amaxes for the backward)."""
        recomputing = self.operators and in_backward()  # selective: the observer heard it
        xq, wq, amax = self.forward_operands(x2, weight, out_dtype,
                                             (0, 1) if training and not recomputing else (None, None))
        return xq @ wq.t(), amax

    def _sr_draws(self, dy: torch.Tensor, token_shape: tuple, micro_batch: int, role: int, transposed: bool):
        """SR's U[0,1) for dY (or dYᵀ) from the logical coordinates (token row, output feature)."""
        if not self.recipe.sr:
            return None
        rows = (self.state.token_rows(token_shape, dy.device) if self.sources is None  # a routed expert's chunk:
                else torch.arange(dy.shape[0 if not transposed else 1], device=dy.device))  # its rows, padded
        key = self.state.key(micro_batch, self.layer_key, role)
        cols = self.out_index.to(dy.device)
        return uniform_draws(key, cols, rows) if transposed else uniform_draws(key, rows, cols)

    def backward_operands(self, dy, x2, weight, out_dtype, token_shape: tuple, micro_batch: int, wants_dx: bool,
                          wants_dw: bool, forward_amax=None):
        """(dX = fq(dY)·fq(W) in out_dtype or None, dW's two quantised operands (fq(H·dY)ᵀ [N, M],
        fq(H·X)ᵀ [K, M]) in the compute dtype, or None)."""
        recipe, fmt = self.recipe, self.recipe.bwd
        if recipe.eden:
            return self._eden_operands(dy, x2, weight, out_dtype, token_shape, micro_batch, wants_dx, wants_dw,
                                       forward_amax)
        two_d = recipe.w2d and fmt == "nvfp4"
        # dW's operands: a routed expert's chunk gets zero rows up to the token block (blocks along the tokens;
        # a zero row changes no block's amax, so the padding is exact)
        dy_w, x_w = (pad_rows(dy, self.token_block), pad_rows(x2, self.token_block)) if wants_dw else (dy, x2)
        dy_t, x_t = dy_w.t(), x_w.t()
        if recipe.rht:
            signs = hadamard_signs(self.state.key(-1, self.layer_key, 2), dy.device)
            wide = torch.float64 if dy.dtype == torch.float64 else torch.float32  # along the tokens, dim 0 of dY, X
            dy_t = microscaling.hadamard_blocks(dy_w.to(wide), signs, dim=0).t().contiguous()
            x_t = microscaling.hadamard_blocks(x_w.to(wide), signs, dim=0).t().contiguous()
        amax = [None] * 4
        if fmt == "nvfp4":
            amax = self._reduced_amax([amax_of(dy), amax_of(dy_t), amax_of(x_t), self.weight_amax(weight)])
        dx = dw = None
        if wants_dx:
            draws = self._sr_draws(dy, token_shape, micro_batch, 0, transposed=False)
            dyq = self._fq(dy, fmt, out_dtype, 2, tensor_amax=amax[0], draws=draws)
            if two_d:
                wq = self._fq(weight, fmt, out_dtype, 1, two_d=True, tensor_amax=amax[3])
            else:
                wq = self._fq(weight.t(), fmt, out_dtype, 1, tensor_amax=amax[3]).t()
            dx = dyq @ wq
        if wants_dw:
            draws = self._sr_draws(dy_t, token_shape, micro_batch, 1, transposed=True)
            dw = (self._fq(dy_t, fmt, out_dtype, 2, tensor_amax=amax[1], draws=draws),
                  self._fq(x_t, fmt, out_dtype, 0, tensor_amax=amax[2]))
        return dx, dw

    def _eden_operands(self, dy, x2, weight, out_dtype, token_shape: tuple, micro_batch: int, wants_dx: bool,
                       wants_dw: bool, forward_amax):
        """Quartet II's backward: the forward's operands as it multiplied them (fq(X), fq(W)) and dY, each rotated
        along its GEMM's contraction dim by this micro-batch's G×G random-sign Hadamard R (one for all four), then
        MS-EDEN (precision/quartet.py), the scale draws keyed by each block's logical coordinates:
        dX = E(dY·R)·E(Wᵀ·R)ᵀ, dW's operands (E(dYᵀ·R) [N, M], E(Xᵀ·R) [K, M]); R cancels in both products."""
        xq, wq, _ = self.forward_operands(x2, weight, out_dtype, amax=forward_amax)
        wide = torch.float64 if dy.dtype == torch.float64 else torch.float32
        size, device = self.recipe.rotation, dy.device
        hadamard = hadamard_signs(self.state.key(micro_batch, self.layer_key, 3), device, size)
        dy_w, x_w = (pad_rows(dy, self.token_block), pad_rows(xq, self.token_block)) if wants_dw else (dy, xq)
        tokens = (self.state.token_rows(token_shape, device) if self.sources is None  # a routed chunk: its rows
                  else torch.arange(dy_w.shape[0], device=device))
        out_index, in_index = self.out_index.to(device), self.in_index.to(device)
        operands = [  # (rotated [R, C] along C, R's logical index, C's logical index, observer role) or None
            (microscaling.hadamard_blocks(dy.to(wide), hadamard), tokens[:dy.shape[0]], out_index, 2) if wants_dx
            else None,
            (microscaling.hadamard_blocks(wq.to(wide), hadamard, dim=0).t(), in_index, out_index, 1) if wants_dx
            else None,
            (microscaling.hadamard_blocks(dy_w.to(wide), hadamard, dim=0).t(), out_index, tokens, 2) if wants_dw
            else None,
            (microscaling.hadamard_blocks(x_w.to(wide), hadamard, dim=0).t(), in_index, tokens, 0) if wants_dw
            else None]
        amax = self._reduced_amax([amax_of(o[0]) if o else torch.zeros((), device=device) for o in operands])
        quantised = []
        for i, operand in enumerate(operands):
            if operand is None:
                quantised.append(None)
                continue
            rotated, rows, cols, role = operand
            draws = uniform_draws(self.state.key(micro_batch, self.layer_key, 4 + i), rows, cols[::quartet.BLOCK])
            result = quartet.eden_rotated(rotated, size, draws, amax[i], out_dtype)
            self.observer.quantized(self, role, rotated.numel(), result.saturated)
            quantised.append(result.values)
        dx = quantised[0] @ quantised[1].t() if wants_dx else None
        return dx, (quantised[2], quantised[3]) if wants_dw else None


# --- Wiring into the trainer ---------------------------------------------------------------------------------

ROLES = {"attn.c_attn": 0, "attn.c_proj": 1, "mlp.c_fc": 2, "mlp.c_proj": 3, "shared_experts.c_fc": 4,
         "shared_experts.c_proj": 5, "c_fc": 6, "c_proj": 7}  # the last two: a routed expert's (the first match)


def convert(model: nn.Module, recipe: PrecisionRecipe, mesh=None, micro_batches: int = 1, seed: int = 0,
            seq_len: int | None = None, cp_balance: str = "zigzag") -> PrecisionHandle:
    """Swap every nn.Linear of the blocks outside the tail for a RecipeLinear, in place: the dense ones and the
    shared experts' with NVFP4's amax groups cp and tp (each when larger than one rank; mesh None: one process),
    a routed expert's with none (its logical tensor is one source's chunk, whole here: accounting/recipe_experts.py),
    its sources' first micro-batches and the token block. The router is no nn.Linear: it stays in high precision,
    as DeepSeek-V3 keeps its gate (a flipped top-k choice is not a small error)."""
    groups = {n: mesh.group(n) for n in ("cp", "tp") if mesh is not None and mesh.size(n) > 1}
    cp = mesh.size("cp") if mesh is not None else 1
    seq_len = seq_len or model.config.block_size
    positions = context_parallel.positions(seq_len, cp, mesh.index("cp"), cp_balance) if cp > 1 else None
    first = mesh.index("dp") * micro_batches if mesh is not None else 0
    ep = mesh.size("ep") if mesh is not None else 1  # the EP group: consecutive data ranks (C = 1: flags)
    first_source = mesh.index("dp") - mesh.index("ep") if mesh is not None else 0
    sources = [(first_source + s) * micro_batches for s in range(ep)]
    token_block = recipe.token_block
    state = DrawState(seed, first, seq_len, positions)
    n_layer, tail = model.config.n_layer, recipe.tail_layers(model.config.n_layer)
    linears, kept = {}, []
    codec = ZeroWeightCodec() if recipe.gathers_codes else None  # one quantisation
    for block in model.transformer.h:
        for path, module in list(block.named_modules()):
            leaf = path.rpartition(".")[2]
            if type(module) is not nn.Linear or leaf in ("router", "gate"):
                continue  # routers stay precise
            routed = ".experts." in f".{path}"  # mlp.experts.<i>.c_fc: data-dependent rows, whole on its EP rank
            info = getattr(module.weight, "shard_info", None)
            name = info.global_name.removesuffix(".weight") if info else f"transformer.h.{block.layer_id}.{path}"
            if block.layer_id >= n_layer - tail:
                kept.append(name)
                continue
            role = next((r for suffix, r in ROLES.items() if name.endswith(suffix)), len(ROLES))
            key = block.layer_id * 9 + role + (9 * n_layer * (1 + int(path.split(".")[-2])) if routed else 0)
            linear = RecipeLinear(module, recipe, state, name, key, randomness.out_index(info, module.out_features),
                                  {} if routed else groups, sources if routed else None,
                                  token_block if routed else 1, randomness.in_index(info, module.in_features))
            if routed:  # of the M tokens a rank routes, its held expert gets E·M·k/N rows (uniform routing)
                linear.row_share = ep * model.config.moe.topk / model.config.moe.experts
            linear.operators = model.config.selective_recompute
            setattr(block.get_submodule(path.rpartition(".")[0]), leaf, linear)
            linears[name] = linear
            if codec is not None:  # of W serves both its GEMMs: ZeRO-3 may gather it in NVFP4 (recipe_codec)
                codec.attach(linear)
    return PrecisionHandle(recipe, linears, kept, state, mesh, micro_batches, model.config.activation_checkpointing)


def apply(model: nn.Module, run, recipe: PrecisionRecipe) -> PrecisionHandle:
    """The axis entry point: the handle (after PP, before DDP/ZeRO)."""
    return convert(model, recipe, run.mesh, micro_batches=run.micro_batches, seed=run.seed, seq_len=run.seq_len,
                   cp_balance=run.settings.args.cp_balance)


@dataclass(frozen=True)
class PrecisionFacts:
    """What the accounting reads of the recipe (`PrecisionHandle.facts`): report/axes.py's precision section,
    mfu's FLOP share per format."""

    recipe: PrecisionRecipe
    formats: dict  # {linear's global name: (forward format, backward format)}: the recipe's linears
    kept: list  # the block linears of the tail, in the compute dtype
    in_features: dict  # {linear's global name: K_j, × a routed expert's row share E·k/N} (saved_input_bytes)
    weights: int  # Σ N_j·K_j of the recipe's linears
    gathered_as_codes: bool  # ZeRO-3 gathers their weights as NVFP4 codes (ZeroWeightCodec)


def bits_per_element(fmt: str, compute_bytes: int) -> float:
    """β_f including block scales (microscaling.FORMATS); the compute dtype's 8·e_c."""
    return 8.0 * compute_bytes if fmt == "bf16" else microscaling.FORMATS[fmt].bits_per_element


def saved_input_bytes(in_features, tokens: int, fmt: str, compute_bytes: int) -> dict:
    """Per micro-batch of M tokens through linears of input widths K_j: what a block-scaled kernel saves of X
    (its backward codes, Σ M·K_j·β/8, plus NVFP4's 4-byte tensor scale per linear) against the compute dtype."""
    widths = list(in_features)
    elements = sum(tokens * k for k in widths)
    codes = elements * bits_per_element(fmt, compute_bytes) / 8 + (4 * len(widths) if fmt == "nvfp4" else 0)
    return {"codes": codes, "compute": elements * compute_bytes}


class PrecisionHandle(Axis):
    """The axis handle. linears: {global name: RecipeLinear}; kept: the tail's linears (compute dtype)."""

    name = "precision"

    def __init__(self, recipe: PrecisionRecipe, linears: dict, kept: list, state: DrawState, mesh=None,
                 micro_batches: int = 1, recomputes: bool = False):
        self.recipe, self.linears, self.kept, self.state, self.mesh = recipe, linears, kept, state, mesh
        self.micro_batches, self.recomputes = micro_batches, recomputes

    def after_grad_sync(self, layout=None) -> int:
        """Close the step: the next one draws anew (the step counter), every linear's micro-batch count restarts."""
        self.state.step += 1
        for linear in self.linears.values():
            linear.forwards = 0
        return 0

    def observe(self, observer: QuantizationObserver) -> None:
        """Every linear tells `observer` (the accounting's observers.SaturationCount) what its quantisations cut, per
        role (0 X, 1 W, 2 dY), in training."""
        self.observer = observer
        for linear in self.linears.values():
            linear.observer = observer

    def state_pieces(self) -> list:
        """The step counter (docstring item 4), one logical tensor written by the rank at coordinate 0 of all."""
        coords = self.mesh.coordinates() if self.mesh is not None else None
        info = ShardInfo("precision/step", (1,), replicated_over=("tp", "cp", "pp"))
        return [StatePiece("precision/step", self.state.step, info, primary=counts_here(info, coords, ("dp_cp",)))]

    def facts(self) -> PrecisionFacts:
        r = self.recipe
        return PrecisionFacts(r, {name: (r.fwd, r.bwd) for name in self.linears}, list(self.kept),
                              {name: linear.in_features * linear.row_share for name, linear in self.linears.items()},
                              sum(linear.weight.numel() for linear in self.linears.values()),
                              any(hasattr(linear.weight, "gather_codec") for linear in self.linears.values()))

    def predicted_messages(self, layout=None) -> Messages:
        """NVFP4's amax MAX all-reduces of one optimizer step (docstring item 3)."""
        out = Messages()
        calls = sum(linear.sources is None for linear in self.linears.values()) * self.micro_batches  # routed
        # experts reduce no amax (their logical tensor is whole on their rank)
        for group in [g for g in ("cp", "tp") if self.mesh is not None and self.mesh.size(g) > 1]:
            if self.recipe.fwd == "nvfp4" and calls:
                forwards = calls * (2 if self.recomputes else 1)
                out.add("all_reduce", group, forwards, 8 * forwards)
            if self.recipe.bwd == "nvfp4" and calls:
                out.add("all_reduce", group, calls, 16 * calls)
        return out
