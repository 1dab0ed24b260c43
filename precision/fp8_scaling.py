"""FP8 numbers: the two formats, the casts with a scale (per tensor or per tile), the scaling rules, the GEMMs.

What fp8.py's linear computes with (its docstring has the formulas and the recipes):

    s = max_format / amax / 2^margin,       q = cast(clamp(x·s, -max_format, max_format)),       x ≈ q / s

per tensor (`quantize`), or one s per 1×128 / 128×1 tile or 128×128 block (`quantize_tiles`, blockwise); the
FP8 GEMM by `torch._scaled_mm`'s rules, on FP8 tensor cores or emulated on the same codes (`scaled_matmul`).
Which amax each recipe scales from (now, or a history: `roll_history`) is fp8.py's. Pure tensor functions:
they talk over nothing, hold no state and keep nothing between calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

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
_SATURATED = 1 + 2**-20  # |x·s| beyond max by more than the rounding of the scale and product counts


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
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


def roll_history(history: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, fmt_max, recipe):
    """One step of delayed scaling on histories [..., L] (index 0 the latest): (new history, new scale). A finite
    amax enters (the oldest leaves); a non-finite one leaves that role's history and scale as they were. s =
    max_format / (the history's max, or its latest entry) / 2^margin, kept while that is 0 (nothing seen yet)."""
    finite = torch.isfinite(amax)
    rolled = torch.cat([amax.unsqueeze(-1), history[..., :-1]], dim=-1)
    history = torch.where(finite.unsqueeze(-1), rolled, history)
    reference = history.amax(dim=-1) if recipe.amax_algo == "max" else history[..., 0]
    new = scale_from_amax(reference, fmt_max, recipe.margin)
    return history, torch.where(finite & (reference > 0), new, scale)


class DelayedHistory:
    """Delayed scaling's state and its step (fp8.Fp8Linear's, fp8_replicas.ExpertHistory's): amax_history [3, L]
    (column 0 the latest) and scale [3], per role; fmt_max and recipe; `_history_ready`, `_history_version`
    (set by the owner's __init__: False and the history's version)."""

    def roll(self, amax: torch.Tensor, finite: bool) -> None:
        """End of a step (delayed): the reduced amaxes [3] enter the history; in place (state is live)."""
        history, scale = roll_history(self.amax_history, self.scale, amax, self.fmt_max, self.recipe)
        ready = self.history_ready or finite
        self.amax_history.copy_(history)
        self.scale.copy_(scale)
        self._history_ready, self._history_version = ready, self.amax_history._version

    @property
    def history_ready(self) -> bool:
        """Whether a step's amaxes entered the history (until then the linear scales like `current`). After a
        write from elsewhere (a checkpoint restoring the history: its tensor version changed) it is read from the
        history itself: ready when some amax in it is > 0."""
        if self.amax_history._version != self._history_version:
            self._history_ready = bool((self.amax_history > 0).any())
            self._history_version = self.amax_history._version
        return self._history_ready


def quantize(x: torch.Tensor, fmt: Format, scale: torch.Tensor, count_saturated: bool = True):
    """q = cast(clamp(x·scale, ±max)): (q in fmt.dtype, number of elements the clamp cut, or None)."""
    scaled = x.to(wide_dtype(x.dtype)) * scale.to(wide_dtype(x.dtype))
    saturated = (scaled.abs() > fmt.max * _SATURATED).sum() if count_saturated else None
    return scaled.clamp_(-fmt.max, fmt.max).to(fmt.dtype).contiguous(), saturated  # row-major for _scaled_mm


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.to(wide_dtype(dtype)) * scale.to(wide_dtype(dtype)).reciprocal()).to(dtype)


def _tiles(x: torch.Tensor, tile) -> torch.Tensor:
    """[R, C] zero-padded to whole tiles, viewed as [R/r, r, C/c, c]."""
    (r, c), (rows, cols) = tile, x.shape
    padded = F.pad(x, (0, -cols % c, 0, -rows % r))
    return padded.view(padded.shape[0] // r, r, padded.shape[1] // c, c)


def quantize_tiles(x: torch.Tensor, tile, fmt: Format = E4M3):
    """One scale per tile of x [R, C] (edge tiles partial): (q [R, C], inverse scales [⌈R/r⌉, ⌈C/c⌉], amax)."""
    tiles = _tiles(x.to(wide_dtype(x.dtype)), tile)
    amax = tiles.abs().amax(dim=(1, 3)).float()
    scale = scale_from_amax(amax, fmt.max)
    q = (tiles * scale[:, None, :, None].to(tiles.dtype)).clamp_(-fmt.max, fmt.max).to(fmt.dtype)
    rows, cols = x.shape
    return q.flatten(2).flatten(0, 1)[:rows, :cols].contiguous(), 1.0 / scale.to(tiles.dtype), amax.max()


def dequantize_tiles(q: torch.Tensor, inverse_scale: torch.Tensor, tile, dtype: torch.dtype) -> torch.Tensor:
    tiles = _tiles(q.to(dtype), tile) * inverse_scale[:, None, :, None].to(dtype)
    return tiles.flatten(2).flatten(0, 1)[:q.shape[0], :q.shape[1]]


# --- The GEMMs: torch._scaled_mm on FP8 tensor cores, emulated elsewhere, the same rules everywhere ----------


# torch._scaled_mm (Hopper, Ada) needs every dimension of its GEMMs a multiple of 16 (`gemm_shape_errors`); rows
# (tokens) vary with the data only in the experts, whose FP8 linears zero-pad them to this (fp8.Fp8Linear).
ROW_ALIGNMENT = 16


def pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """x [M, K] with zero rows appended up to a multiple of `multiple` (x itself when M already is one)."""
    extra = -x.shape[0] % multiple
    return F.pad(x, (0, 0, 0, extra)) if extra else x


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


def scaled_matmul(a, a_inverse_scale, b, b_inverse_scale, out_dtype, use_scaled_mm: bool, what: str = "GEMM"):
    """(a·a_inv)·(b·b_inv) in out_dtype, a and b per-tensor-scaled FP8, accumulated in fp32 (fp64 emulated), after
    _scaled_mm's operand rules, checked on every device (a ValueError here is what a GPU would refuse)."""
    if a.dtype == b.dtype == E5M2.dtype:
        raise ValueError(f"FP8 {what}: e5m2 × e5m2 has no tensor-core GEMM (torch._scaled_mm); one operand"
                         f" must be e4m3")
    (k, n) = b.shape
    if a.shape[1] != k or k % 16 or n % 16:
        raise ValueError(f"FP8 {what}: torch._scaled_mm needs [M,K]·[K,N] with K and N multiples of 16,"
                         f" got [{a.shape[0]},{a.shape[1]}]·[{k},{n}]")
    if a.stride(1) != 1 or not (b.stride(0) == 1 and b.stride(1) >= k):
        raise ValueError(f"FP8 {what}: torch._scaled_mm needs a row-major first operand and a column-major"
                         f" second one, got strides {a.stride()} and {b.stride()}")
    if use_scaled_mm:
        return torch._scaled_mm(a, b, scale_a=a_inverse_scale, scale_b=b_inverse_scale, out_dtype=out_dtype)
    wide = wide_dtype(out_dtype)
    return ((a.to(wide) @ b.to(wide)) * (a_inverse_scale * b_inverse_scale).to(wide)).to(out_dtype)


def per_tensor(mode: str | None) -> bool:
    """--fp8 current or delayed: one scale per tensor, so a weight is one E4M3 tensor of codes (what ZeRO-3 gathers
    as codes, fp8.ZeroWeightCodec, and what the routed experts run, accounting/fp8_experts.py); blockwise's scales are
    tiles."""
    return mode in ("current", "delayed")


def has_fp8_tensor_cores(device) -> bool:
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
