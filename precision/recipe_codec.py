"""ZeRO-3's gather of a precision recipe's NVFP4 weights as codes (`ZeroWeightCodec`), for precision/recipe.py.

Under w2d with fwd = bwd = nvfp4 one quantisation of W serves both its GEMMs, so ZeRO-3 can gather the codes
instead of the working weights. The blocks of W [N, K] are 16×16 tiles; a rank's flat shard of it cuts tiles
anywhere, so the tiles' amaxes are MAX-reduced over the gathering group (one float per 256 elements) and the
tensor amax over it and tp/cp; each rank then quantises its elements with their tile's scale (microscaling's
own rounding: a row [x, its tile's amax, 0…] quantises x as the whole tile would), the codes are gathered, one
byte per element here (an E2M1 code is 4 bits: two a byte on a real system), and decoded to d·q/S_enc. The
linear quantises the decoded weight again with the gathered tensor amax: the same tiles' scales (a tile's
decoded amax is 6·d/S_enc) and the same codes, so the step equals the working-dtype gather's bit for bit (a tile
whose amax is below 2^-6·amax/448·6 has a subnormal E4M3 scale and may requantise otherwise: stated, untested).

1. Replicated and split: nothing new (the weights stay ZeRO-3's flat shards).
2. Peak per device: per gathered unit, one byte per element of codes (the gather's buffer, as parallel/zero3.py's) and
   one amax per 16×16 tile of its weights (4 or 8 bytes per 256 elements).
3. Messages per gather: all_reduce MAX over the gathering group of the tiles' and tensor amaxes (`width` bytes
   each), all_reduce MAX of the tensor amaxes over the linears' amax groups (tp, cp), 4 bytes each
   (`encode_messages`); then parallel/zero3.py's all-gather of the codes.
4. Restart state: none (the codes are made from the shards at every gather).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from precision import microscaling
from step import Messages

TILE = 16  # NVFP4's block, w2d's 16×16 weight tiles (precision.recipe.TWO_D)


def _tile_index(weight: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """The 16×16 tile of each of `count` flat elements of W [N, K] from flat offset `start` (row-major)."""
    k = weight.shape[1]
    flat = torch.arange(start, start + count, device=weight.device)
    return (flat // k // TILE) * (k // TILE) + (flat % k) // TILE


class ZeroWeightCodec:
    """How ZeRO-3 gathers the recipe's NVFP4 weights (parallel/zero3.py knows only `weight.gather_codec` and these
    methods, as for fp8.ZeroWeightCodec)."""

    def __init__(self):
        self.linear_of = {}  # weight parameter → its RecipeLinear

    def attach(self, linear) -> None:
        """linear: a precision.recipe.RecipeLinear whose weight ZeRO-3 may gather as codes."""
        self.linear_of[linear.weight] = linear
        linear.weight.gather_codec = self

    @staticmethod
    def _amax_dtype(weights: list) -> torch.dtype:
        return torch.float64 if weights[0].dtype == torch.float64 else torch.float32

    @torch.no_grad()
    def encode(self, weights: list, segments: list, group, starts: list) -> tuple:
        """(uint8 codes of each segment, what decode needs). starts: each segment's flat offset in its weight.
        Collective over `group` and the linears' amax groups (every rank holding a piece calls it alike)."""
        wide = self._amax_dtype(weights)
        tiles, tensor_amax = [], []
        for weight, segment, start in zip(weights, segments, starts):
            n, k = weight.shape
            amax = torch.zeros((n // TILE) * (k // TILE), dtype=wide, device=segment.device)
            index = _tile_index(weight, start, segment.numel())
            tiles.append(amax.scatter_reduce_(0, index, segment.to(wide).abs(), "amax"))
            tensor_amax.append(amax.max() if amax.numel() else amax.new_zeros(()))
        sizes = [t.numel() for t in tiles]
        reduced = torch.nan_to_num(torch.cat([*tiles, torch.stack(tensor_amax)]), nan=float("inf"))
        if dist.get_world_size(group) > 1:
            dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group)
        tiles = list(reduced[:-len(weights)].split(sizes))
        tensor_amax = reduced[-len(weights):].float()
        for amax_group in self.linear_of[weights[0]].amax_groups.values():
            dist.all_reduce(tensor_amax, op=dist.ReduceOp.MAX, group=amax_group)
        codes = [self._codes(w, s, start, t, a) for w, s, start, t, a in zip(weights, segments, starts, tiles,
                                                                               tensor_amax)]
        return codes, (tiles, tensor_amax)

    @staticmethod
    def _codes(weight, segment, start: int, tile_amax, tensor_amax, chunk: int = 1 << 16) -> torch.Tensor:
        """Each element's E2M1 code (sign<<3 | index into E2M1_VALUES) as its 16×16 tile quantises it."""
        out = torch.empty(segment.numel(), dtype=torch.uint8, device=segment.device)
        for lo in range(0, segment.numel(), chunk):
            piece = segment[lo:lo + chunk].to(tile_amax.dtype)
            rows = torch.zeros(piece.numel(), TILE, dtype=piece.dtype, device=piece.device)
            rows[:, 0], rows[:, 1] = piece, tile_amax[_tile_index(weight, start + lo, piece.numel())]
            q = microscaling.quantize(rows, microscaling.FORMATS["nvfp4"], tensor_amax=tensor_amax)
            out[lo:lo + piece.numel()] = q.codes[:, 0] & 0xF  # element 0: the low nibble of the first byte
        return out

    @torch.no_grad()
    def decode(self, weights: list, codes: list | None, into: list, decoding) -> None:
        """Each weight's gathered codes → d·q/S_enc in `into` (its working weight, flat), and its linear told the
        tensor amax. codes None: `into` was gathered exactly (full_parameters): the linears use its own amax."""
        for i, (weight, target) in enumerate(zip(weights, into)):
            linear = self.linear_of[weight]
            linear.gathered_weight_amax = None
            if codes is None:
                continue
            tiles, tensor_amax = decoding
            values = torch.tensor(microscaling.E2M1_VALUES, dtype=torch.float64, device=target.device)
            grid = torch.cat([values, -values])[codes[i].long()]
            scale = microscaling.nvfp4_tensor_scale(tensor_amax[i])
            block = microscaling.nvfp4_block_scale(tiles[i].double(), scale)
            target.copy_(grid * block[_tile_index(weight, 0, target.numel())] / scale.double())
            linear.gathered_weight_amax = tensor_amax[i].clone()  # a new tensor per gather

    def encode_messages(self, weights: list, group_name: str | None) -> Messages:
        """What one `encode` of `weights` sends: the tiles' and tensor amaxes over the gathering group (None: a
        group of one rank), the tensor amaxes over the linears' amax groups."""
        out, width = Messages(), self._amax_dtype(weights).itemsize
        if group_name:
            tiles = sum((w.shape[0] // TILE) * (w.shape[1] // TILE) for w in weights)
            out.add("all_reduce", group_name, 1, width * (tiles + len(weights)))
        for name in self.linear_of[weights[0]].amax_groups:
            out.add("all_reduce", name, 1, 4 * len(weights))
        return out
