"""The precision recipes' randomness as functions of logical coordinates: the same draws on every mesh, no state.

A recipe's stochastic rounding (precision/recipe.py's sr, and MS-EDEN's block-scale rounding, precision/quartet.py)
and its random Hadamard signs (rht, MS-EDEN's rotation) must come out the same whatever mesh holds the tensor, and
a resumed run must replay them. So nothing is drawn from a generator's state: each draw is a hash of a key (run
seed, optimizer step, global micro-batch, layer, role: `draw_key`, `DrawState.key`) and the element's place in the
LOGICAL tensor (its row and column there: `DrawState.token_rows` for tokens, `out_index` and `in_index` for a
weight's features under TP's splits), so any piece of a tensor draws what the whole draws there
(`uniform_draws`), and a resumed run at step s draws what the uninterrupted one drew.

Symbols: n elements of the tensor being rounded.

1. Replicated and split: the key and the step are the same on every rank; each rank hashes only its piece's
   coordinates.
2. Peak per device: one float32 draw per element rounded (4·n bytes) and two int64 temporaries (16·n).
3. Messages: none.
4. Restart state: the optimizer step (`DrawState.step`, checkpointed by the recipe's handle as "precision/step").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from precision import microscaling
from shard import ShardInfo, Split

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN, _MIX1, _MIX2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 tensors (multiplication wraps modulo 2^64)."""
    z = z + _GOLDEN
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    return z ^ _shift_right(z, 31)


def draw_key(*parts: int) -> int:
    """One 64-bit key from integers (run seed, step, micro-batch, layer, role), order-sensitive."""
    key = torch.zeros((), dtype=torch.int64)
    for part in parts:
        key = _splitmix64(key ^ _signed(int(part)))
    return int(key)


def uniform_draws(key: int, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """U[0, 1) per element (rows[:, None], cols[None, :]), float32 with 24 random bits: a function of the key and
    the element's logical coordinates only, so any piece of the tensor draws what the whole would. Each row and
    each column gets a SplitMix64 hash; an element's draw is the top 24 bits of (row hash XOR column hash) times
    an odd constant: four int64 operations per element (a full hash per element cost 4× more)."""
    row_hash = _splitmix64(rows.to(torch.int64) ^ key)
    col_hash = _splitmix64(cols.to(torch.int64) ^ int(_splitmix64(torch.tensor(key ^ _MIX2))))
    z = (row_hash[:, None] ^ col_hash[None, :]) * _MIX1
    return _shift_right(z, 40).to(torch.float32) * 2.0**-24


def hadamard_signs(key: int, device, size: int = 16) -> torch.Tensor:
    """A size×size random-sign Hadamard for this key (microscaling.random_hadamard from a seeded generator): rht's
    16, MS-EDEN's rotation G."""
    generator = torch.Generator().manual_seed(key & ((1 << 63) - 1))
    return microscaling.random_hadamard(size, generator).to(device)


@dataclass
class DrawState:
    """What SR's draws and the Hadamard signs are keyed by, shared by a rank's recipe linears: the run seed, the
    optimizer step (`step`, restart state), this rank's first global micro-batch (d·m), and where its tokens sit
    in their sequences (CP's positions; None: all of them)."""

    seed: int
    first_micro_batch: int
    seq_len: int
    positions: torch.Tensor | None
    step: torch.Tensor = field(default_factory=lambda: torch.zeros(1, dtype=torch.float64))

    def key(self, index: int, layer: int, role: int) -> int:
        """index: the global micro-batch (rank d's j-th: d·m + j); -1 the step's (the Hadamard signs, the same for
        all its micro-batches)."""
        return draw_key(self.seed, int(self.step.item()), index, layer, role)

    def token_rows(self, shape: tuple, device) -> torch.Tensor:
        """The logical row (sequence·s + position) of each of a micro-batch's local tokens, flattened as the
        linear flattens them ((B, L) → B·L)."""
        batch, length = (shape[0], shape[1]) if len(shape) == 2 else (1, shape[0])
        pos = self.positions if self.positions is not None else torch.arange(length)
        return (torch.arange(batch)[:, None] * self.seq_len + pos[None, :length]).reshape(-1).to(device)


def out_index(info: ShardInfo | None, out_features: int) -> torch.Tensor:
    """The global output-feature index of each local row of a weight (TP's pieces, fused q/k/v segments)."""
    return _feature_index(info, out_features, 0)


def in_index(info: ShardInfo | None, in_features: int) -> torch.Tensor:
    """The global input-feature index of each local column of a weight (a row-parallel piece's)."""
    return _feature_index(info, in_features, 1)


def _feature_index(info: ShardInfo | None, features: int, dim: int) -> torch.Tensor:
    if info is None or len(info.global_shape) != 2:
        return torch.arange(features)
    index = torch.arange(info.global_shape[dim])
    for split in info.splits:  # TP's split of this dim (c_attn's per q/k/v segment): the features it keeps
        index = Split(0, split.num, split.index, split.segments).take(index) if split.dim == dim else index
    return index.contiguous()
