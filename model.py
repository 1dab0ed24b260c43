"""A GPT-2 style Transformer, single device: the model every parallel layout must reproduce.

nanoGPT's names and shapes (learned positions, pre-LayerNorm blocks, GELU MLP, tied embedding and head,
optional biases). It knows nothing of distribution except three hooks the parallel files rely on:

- `forward(idx, targets=None, pos=None)`: `pos` carries the global positions of the tokens, so context
  parallel can hand a rank a non-contiguous piece of the sequence.
- The loss comes back as a SUM over target tokens together with the COUNT of target tokens (targets of -1
  are ignored). The trainer divides by the token count of the whole global batch, so micro-batches and
  ranks holding different numbers of tokens are weighted exactly as in one big batch, and every gradient
  reduction is a plain sum.
- Every parameter is initialised from its own generator seeded by (seed, parameter name). Any rank can
  therefore build one full parameter at a time and keep its slice, bitwise equal to the single-device
  model's; equivalence tests and checkpoint resharding depend on it. Each parameter also carries a
  `ShardInfo` record saying where its local tensor sits in the global logical tensor.

Accounting for this file (one device, nothing split):
1. Everything is replicated (there is one device).
2. Persistent: Ψ parameters, Ψ gradients, 2Ψ Adam moments (fp32: 16 bytes/param). Activations per layer
   and micro-batch: about s·b·h·(34 + 5·a·s/h) bytes at 16 bits (Korthikanti et al. 2022), or only the
   block inputs when `activation_checkpointing` recomputes each block in backward.
3. No messages.
4. Restart state: parameters (the optimizer state lives in the trainer).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class GPTConfig:
    block_size: int = 256  # longest sequence (learned position table size)
    vocab_size: int = 256  # byte-level tokens by default; GPT-2 BPE uses 50304 (50257 padded to 64)
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.0
    bias: bool = True  # biases in linears and LayerNorms, like GPT-2
    activation_checkpointing: bool = False  # recompute each block's forward in backward

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


PRESETS = {
    "tiny": GPTConfig(block_size=64, vocab_size=256, n_layer=2, n_head=4, n_embd=64),  # tests
    "small": GPTConfig(block_size=256, vocab_size=256, n_layer=6, n_head=6, n_embd=384),  # CPU demo, ~10.7M
    "gpt2": GPTConfig(block_size=1024, vocab_size=50304, n_layer=12, n_head=12, n_embd=768),  # 124M
}


def config_from_preset(name: str, **overrides) -> GPTConfig:
    if name not in PRESETS:
        raise ValueError(f"--preset {name!r} is unknown; choose one of {sorted(PRESETS)}")
    return replace(PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})


# ---------------------------------------------------------------------------------------------------------
# Where a local tensor sits in the global logical tensor
# ---------------------------------------------------------------------------------------------------------


@dataclass
class ShardInfo:
    """The one record of a parameter's place in the logical model, read by checkpoints, grad norm, accounting.

    `global_name`/`global_shape` name the logical tensor. If `split_dim` is set, the local tensor is piece
    `split_index` of `num_splits` along that dimension (tensor and expert parallel set this). A fused tensor
    such as c_attn's [q | k | v] has `segments=3`: the split dimension is made of 3 equal segments and each
    rank holds its piece of every segment, concatenated (its heads of q, of k and of v).
    `tp_replicated` is True when every tensor-parallel rank holds the same copy (LayerNorms, row-parallel
    biases): the global gradient norm must then count it once, not T times.
    """

    global_name: str
    global_shape: tuple
    split_dim: int | None = None
    num_splits: int = 1
    split_index: int = 0
    segments: int = 1
    tp_replicated: bool = True

    @property
    def local_shape(self) -> tuple:
        shape = list(self.global_shape)
        if self.split_dim is not None:
            shape[self.split_dim] //= self.num_splits
        return tuple(shape)

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This piece of the global tensor `full` (a copy for fused segments, else a view)."""
        if self.split_dim is None:
            return full
        pieces = [segment.chunk(self.num_splits, self.split_dim)[self.split_index]
                  for segment in full.chunk(self.segments, self.split_dim)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, self.split_dim)

    def place_into(self, full: torch.Tensor, local: torch.Tensor) -> None:
        """Write the local piece into its place in the global tensor `full` (the inverse of shard_of)."""
        if self.split_dim is None:
            full.copy_(local)
            return
        for segment, piece in zip(full.chunk(self.segments, self.split_dim), local.chunk(self.segments,
                                                                                          self.split_dim)):
            segment.chunk(self.num_splits, self.split_dim)[self.split_index].copy_(piece)


@dataclass
class StatePiece:
    """One local tensor of training state and where it sits in its logical tensor: what checkpoints move.

    Every layout lists its state as pieces; saving reads `tensor`, loading copies into it (it is the live
    storage). A piece is the `shard` (TP/EP split) of the logical tensor, and of that, when `flat_range` is
    set, the elements [start, end) of the flattened split (a ZeRO shard). `primary` is False on a replica
    whose identical twin on another rank is the one written.
    """

    key: str  # "<kind>/<global name>", kind: param | master | exp_avg | exp_avg_sq
    tensor: torch.Tensor
    shard: ShardInfo
    flat_range: tuple | None = None
    primary: bool = True


# ---------------------------------------------------------------------------------------------------------
# Deterministic per-parameter initialisation
# ---------------------------------------------------------------------------------------------------------


def parameter_seed(seed: int, name: str) -> int:
    """A 63-bit seed from (run seed, parameter name): stable across processes and Python versions."""
    return (seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (2**63 - 1)


def init_full_parameter(name: str, shape, config: GPTConfig, seed: int, dtype=torch.float32) -> torch.Tensor:
    """The full (global) initial value of the parameter called `name`, identical on every rank.

    GPT-2 init: N(0, 0.02) weights; residual projections (`c_proj`) scaled by 1/sqrt(2·n_layer) so the
    residual stream's variance does not grow with depth; zero biases; unit LayerNorm gains.
    Sampled in float32 from the parameter's own generator and then cast, so a float64 model starts from the
    same values as a float32 one.
    """
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=dtype)
    if ".ln_" in name or name.startswith("ln_") or name.startswith("transformer.ln_f"):
        return torch.ones(shape, dtype=dtype)
    std = 0.02 / math.sqrt(2 * config.n_layer) if name.endswith("c_proj.weight") else 0.02
    generator = torch.Generator().manual_seed(parameter_seed(seed, name))
    return torch.normal(0.0, std, size=tuple(shape), generator=generator).to(dtype)


# ---------------------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------------------


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """softmax(q·kᵀ/sqrt(d) + causal mask)·v over (batch, heads, seq, head_dim). Context parallel swaps this."""
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Σ over targets ≠ -1 of -log softmax(logits)[target]. Tensor parallel swaps this (vocab-parallel)."""
    # The softmax of 16-bit logits loses the small differences that matter: take it in (at least) fp32.
    wide = logits.float() if logits.element_size() < 4 else logits
    return F.cross_entropy(wide.view(-1, wide.size(-1)), targets.reshape(-1), ignore_index=-1, reduction="sum")


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        # c_attn's output is [q | k | v], each n_embd wide with heads contiguous inside; TP must keep that.
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.attention_fn = causal_attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.c_attn(x)
        # Shapes are read from the projection, not the input or the config: a tensor-parallel shard holds
        # fewer heads, and under sequence parallelism c_attn gathers the full sequence from a shard of it.
        batch, seq, _ = qkv.shape
        q, k, v = qkv.chunk(3, dim=-1)
        q, k, v = (t.view(batch, seq, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = self.attention_fn(q, k, v, self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(batch, seq, -1)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()  # exact (erf) GELU, as nanoGPT; GPT-2 used the tanh approximation, slower on CPU
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, seed: int = 0, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.config = config
        with torch.device("meta"):  # build shapes only; init_weights materialises every tensor once
            self.transformer = nn.ModuleDict(
                dict(
                    wte=nn.Embedding(config.vocab_size, config.n_embd),
                    wpe=nn.Embedding(config.block_size, config.n_embd),
                    drop=nn.Dropout(config.dropout),
                    h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                    ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
                )
            )
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.to_empty(device=device or "cpu")
        self.lm_head.weight = self.transformer.wte.weight  # tied: one tensor, named transformer.wte.weight
        self.loss_fn = cross_entropy_sum  # tensor parallel swaps in a vocab-parallel one
        self.init_weights(seed, dtype)

    @torch.no_grad()
    def init_weights(self, seed: int, dtype: torch.dtype = torch.float32):
        """Give every parameter its deterministic value and its ShardInfo (whole tensor, not split)."""
        for name, param in self.named_parameters():
            full = init_full_parameter(name, param.shape, self.config, seed, dtype)
            param.data = full.to(param.device)
            param.shard_info = ShardInfo(global_name=name, global_shape=tuple(param.shape))

    def num_params(self, exclude_position_embedding: bool = False) -> int:
        """Parameters of the logical model (tied weights once)."""
        total = sum(p.numel() for p in self.parameters())
        return total - self.transformer.wpe.weight.numel() if exclude_position_embedding else total

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, pos: torch.Tensor | None = None):
        """Returns (logits, loss_sum, token_count); loss_sum and token_count are None without targets.

        loss_sum = Σ over targets ≠ -1 of -log softmax(logits)[target]; token_count = #targets ≠ -1.
        """
        batch, seq = idx.shape
        if pos is None:
            if seq > self.config.block_size:
                raise ValueError(f"sequence of {seq} tokens is longer than block_size={self.config.block_size}")
            pos = torch.arange(seq, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            if self.config.activation_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        x = self.transformer.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None, None  # sampling needs the last position only
        logits = self.lm_head(x)
        return logits, self.loss_fn(logits, targets), (targets != -1).sum()

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample `max_new_tokens` tokens after the prompt `idx` (batch, seq), one at a time."""
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size:]
            logits, _, _ = self(context)
            logits = logits[:, -1, :].float() / max(temperature, 1e-6)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits[logits < kth] = -float("inf")
            probs = F.softmax(logits, dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
        return idx
