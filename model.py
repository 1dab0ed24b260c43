"""A GPT-2 style Transformer, single device: the model every parallel layout must reproduce.

nanoGPT's names and shapes (learned positions, pre-LayerNorm blocks, GELU MLP, tied embedding and head,
optional biases), which are also Hugging Face's GPT-2 names (interop/hf.py reads and writes that layout). The GELU is
exact (erf, as nanoGPT) or GPT-2's tanh approximation (`GPTConfig.gelu`; tanh for GPT-2's weights). The
vocabulary may be padded (`real_vocab_size` < `vocab_size`, e.g. 50257 → 50304 for friendlier matmul shapes):
padding rows start at zero and are cut off before every softmax, in the loss and the sampler, so they are
never predicted and the loss and the samples are the unpadded model's. It knows nothing of distribution
except these hooks the parallel files rely on:

- `forward(idx, targets=None, pos=None)`: `pos` carries the global positions of the tokens, so context
  parallel can hand a rank a non-contiguous piece of the sequence.
- The loss comes back as a SUM over target tokens together with the COUNT of target tokens (targets of -1
  are ignored). The trainer divides by the token count of the whole global batch, so micro-batches and
  ranks holding different numbers of tokens are weighted exactly as in one big batch, and every gradient
  reduction is a plain sum.
- Every parameter is initialised from its own generator seeded by (seed, parameter name). Any rank can
  therefore build one full parameter at a time and keep its slice, bitwise equal to the single-device
  model's; equivalence tests and checkpoint resharding depend on it (`initial_value`, the logical tensor of a
  name). `GPT(..., device="meta")` builds shapes only: the axes cut it there (train.compose), then
  shard.materialize gives each kept tensor its value (the logical tensor, then its piece), so a rank never holds
  more than it keeps plus one logical tensor. `global_name` names a tensor in the logical model (the head's tied
  copy is the embedding's): shard.py's records, which say where each local tensor sits in it, start from it.
- A model may be a pipeline STAGE: `GPT(config, layers=range(a, b), embedding=..., head=...)` builds only
  blocks a..b-1 (named by their global index, `transformer.h.<i>`; an interleaved pipeline rank holds several
  such ranges, `layers=[0, 1, 4, 5]`) and, optionally, the embeddings and the final LayerNorm + head. The
  forward is three public pieces a stage calls on its own: `embed`, `forward_blocks` (all held blocks, or a
  contiguous range of them: one chunk) and `head_loss`; `forward` is their composition.
- `compile_blocks(model)` compiles each block's `forward` as its own region (not the whole model), so that
  each block's backward is its own graph and its parameters' gradient hooks, where DDP and ZeRO launch their
  collectives, fire as soon as that block's backward is done: communication still overlaps backward.
- A block's MLP is the dense one. moe.py swaps in a mixture of experts where the config's `moe` (a record this
  file carries and never reads) asks for one, as tensor parallel swaps linears; a layer may add auxiliary losses
  (MoE load balance, router z-loss) to `model.aux_losses`, which the training step backpropagates with DESIGN.md's
  normalisation: Σ coef·aux averaged over the D·m micro-batches of the step.
- Activation checkpointing: full (`activation_checkpointing`) reruns each block in backward; selective keeps
  what a policy object says (`model.recompute`, given by parallel/recompute.py: its `contexts` for a block's
  checkpoint; a block whose MLP must run once, a MoE block, recomputes by halves: `Block.recompute`).

Accounting for this file (one device, nothing split):
1. Everything is replicated (there is one device).
2. Persistent: Ψ parameters, Ψ gradients, 2Ψ Adam moments (fp32: 16 bytes/param). Activations per layer
   and micro-batch: about s·b·h·(34 + 5·a·s/h) bytes at 16 bits (Korthikanti et al. 2022), or only the
   block inputs when `activation_checkpointing` recomputes each block in backward, and the block inputs and
   GEMM outputs under selective recompute (parallel/recompute.py; a MoE block by halves, `Block`).
3. No messages.
4. Restart state: parameters (the optimizer state lives in the trainer).
"""

from __future__ import annotations

import functools
import math
import zlib
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class GPTConfig:
    block_size: int = 256  # longest sequence (learned position table size)
    vocab_size: int = 256  # rows of the embedding table: byte-level tokens by default; GPT-2 BPE 50304 (padded)
    real_vocab_size: int | None = None  # rows past this are padding, never predicted (None: every row is real)
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.0
    bias: bool = True  # biases in linears and LayerNorms, like GPT-2
    activation_checkpointing: bool = False  # recompute each block's forward in backward (full recompute)
    selective_recompute: bool = False  # keep GEMM outputs, recompute the rest (parallel/recompute.py's policy)
    gelu: str = "exact"  # the MLP's GELU: "exact" (erf, nanoGPT) or "tanh" (GPT-2's, Hugging Face's gelu_new)
    moe: object = None  # the experts (moe.ExpertsConfig): moe.py's to read and to swap in; None: dense

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if self.gelu not in GELU_APPROXIMATIONS:
            raise ValueError(f"gelu={self.gelu!r}: choose one of {sorted(GELU_APPROXIMATIONS)}")
        if self.real_vocab_size is not None and not 0 < self.real_vocab_size <= self.vocab_size:
            raise ValueError(f"real_vocab_size={self.real_vocab_size} must be in [1, vocab_size={self.vocab_size}]")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def gelu_approximate(self) -> str:
        """nn.GELU's `approximate` for this config's GELU."""
        return GELU_APPROXIMATIONS[self.gelu]

    def architecture(self) -> dict:
        """The fields that decide what the model computes, as plain values: saved with every checkpoint, so
        export_hf.py and sample.py rebuild the model without the flags (not how it trains: dropout, recompute).
        The experts' record is moe.py's (its fields as a dict, None when dense)."""
        skip = ("dropout", "activation_checkpointing", "selective_recompute")
        return {name: value for name, value in asdict(self).items() if name not in skip}


# GELU(x) = x·Φ(x) (exact, erf), or GPT-2's approximation 0.5·x·(1 + tanh(sqrt(2/π)·(x + 0.044715·x³))).
GELU_APPROXIMATIONS = {"exact": "none", "tanh": "tanh"}


PRESETS = {
    "tiny": GPTConfig(block_size=64, vocab_size=256, n_layer=2, n_head=4, n_embd=64),  # tests
    # The default run (`python train.py`): ~0.86M parameters, 600 steps in a few minutes on 2 CPU cores (README).
    "mini": GPTConfig(block_size=128, vocab_size=256, n_layer=4, n_head=4, n_embd=128),
    "small": GPTConfig(block_size=256, vocab_size=256, n_layer=6, n_head=6, n_embd=384),  # CPU demo, ~10.7M
    "gpt2": GPTConfig(block_size=1024, vocab_size=50304, n_layer=12, n_head=12, n_embd=768),  # 124M
}
# The GPT-3 family (Brown et al. 2020, Table 2.1: n_layers, d_model, n_heads; context 2048; GPT-2's BPE, padded
# to 50304). Two rows of Table 2.1 do not multiply out (n_heads · d_head ≠ d_model): XL's 24 heads of 128 in 2048
# (16 heads of 128 here) and 13B's d_model 5140 for 40 heads of 128 (5120 here).
GPT3 = {"125m": (12, 768, 12), "350m": (24, 1024, 16), "760m": (24, 1536, 16), "1.3b": (24, 2048, 16),
        "2.7b": (32, 2560, 32), "6.7b": (32, 4096, 32), "13b": (40, 5120, 40), "175b": (96, 12288, 96)}
PRESETS.update({f"gpt3-{size}": GPTConfig(block_size=2048, vocab_size=50304, n_layer=layers, n_head=heads,
                                          n_embd=width) for size, (layers, width, heads) in GPT3.items()})


def config_from_preset(name: str, **overrides) -> GPTConfig:
    if name not in PRESETS:
        raise ValueError(f"--preset {name!r} is unknown; choose one of {sorted(PRESETS)}")
    return replace(PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})


# ---------------------------------------------------------------------------------------------------------
# Deterministic per-parameter initialisation
# ---------------------------------------------------------------------------------------------------------


def parameter_seed(seed: int, name: str) -> int:
    """A 63-bit seed from (run seed, parameter name): stable across processes and Python versions."""
    return (seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (2**63 - 1)


def init_full_parameter(name: str, shape, config: GPTConfig, seed: int, dtype=torch.float32) -> torch.Tensor:
    """The full (global) initial value of the parameter called `name`, identical on every rank.

    GPT-2 init: N(0, 0.02) weights; residual projections (`c_proj`) scaled by 1/sqrt(2·n_layer) so the
    residual stream's variance does not grow with depth; zero biases; unit LayerNorm gains; zero padding rows.
    Sampled in float32 from the parameter's own generator and then cast, so a float64 model starts from the
    same values as a float32 one.
    """
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=dtype)
    if ".ln_" in name or name.startswith("ln_") or name.startswith("transformer.ln_f"):
        return torch.ones(shape, dtype=dtype)
    std = 0.02 / math.sqrt(2 * config.n_layer) if name.endswith("c_proj.weight") else 0.02
    generator = torch.Generator().manual_seed(parameter_seed(seed, name))
    value = torch.normal(0.0, std, size=tuple(shape), generator=generator).to(dtype)
    if name == "transformer.wte.weight":
        value[config.real_vocab_size or shape[0]:] = 0.0  # padding rows: zero, and no gradient ever reaches them
    return value


# ---------------------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------------------


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """softmax(q·kᵀ/sqrt(d) + causal mask)·v over (batch, heads, seq, head_dim). Context parallel swaps this."""
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor, real_vocab_size: int | None = None) -> torch.Tensor:
    """Σ over targets ≠ -1 of -log softmax(logits)[target], the softmax over the first `real_vocab_size` columns
    (the padding rows' logits take no share of it: the unpadded model's loss). Tensor parallel swaps this."""
    logits = logits[..., :real_vocab_size]  # None: every column
    # The softmax of 16-bit logits loses the small differences that matter: take it in (at least) fp32.
    wide = logits.float() if logits.element_size() < 4 else logits
    return F.cross_entropy(wide.reshape(-1, wide.size(-1)), targets.reshape(-1), ignore_index=-1, reduction="sum")


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
        self.gelu = nn.GELU(approximate=config.gelu_approximate)  # exact (nanoGPT) or tanh (GPT-2's weights)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class AuxLosses:
    """The auxiliary-loss channel: layers add (name, coef, value) terms during a micro-batch's forward.

    The objective of a step is Σ CE / tokens_in_global_batch + Σ_aux coef · (mean over the D·m micro-batches
    of aux), so the training step takes `weighted_sum()` after each micro-batch's forward and backpropagates
    it divided by D·m. A micro-batch's terms are cleared before its forward (a recomputing backward under
    activation checkpointing adds them again; they are dropped then).
    """

    def __init__(self):
        self.terms: list[tuple[str, float, torch.Tensor]] = []

    def add(self, name: str, coef: float, value: torch.Tensor) -> None:
        self.terms.append((name, coef, value))

    def clear(self) -> None:
        self.terms.clear()

    def weighted_sum(self) -> torch.Tensor | None:
        """Σ coef·value over this micro-batch's terms (None when no layer added one)."""
        return sum(coef * value for _, coef, value in self.terms) if self.terms else None

    def values(self) -> dict:
        """{name: Σ value} of this micro-batch's terms, detached 0-dim tensors on their device, for the
        printouts: read on the host once per step (step.train_step), not once per term."""
        out = {}
        for name, _, value in self.terms:
            out[name] = out[name] + value.detach() if name in out else value.detach()
        return out


class Block(nn.Module):
    """Pre-LayerNorm: x + attn(ln_1(x)), then + mlp(ln_2(·)). A block given a selective policy of its own
    (`recompute`: a MoE block's, whose MLP must run once) recomputes by halves, as Megatron's selective recompute
    of a MoE layer: the attention side one checkpoint under the policy, the MLP side run once (its routing,
    dispatch and all-to-alls are never run again), inside the policy's `activations_recomputed`."""

    def __init__(self, config: GPTConfig, layer_id: int = 0):
        super().__init__()
        self.layer_id = layer_id
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)
        self.recompute = None  # a policy (parallel/recompute.py) when this block recomputes by halves

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute is not None and self.training and torch.is_grad_enabled():
            return self.forward_by_halves(x)
        x = self.attention_side(x)
        return x + self.mlp(self.ln_2(x))

    @torch.compiler.disable  # eager under --compile: dynamo takes no policy object as checkpoint's context_fn
    def forward_by_halves(self, x: torch.Tensor) -> torch.Tensor:
        x = checkpoint(self.attention_side, x, use_reentrant=False, context_fn=self.recompute.contexts)
        with self.recompute.activations_recomputed():
            return x + self.mlp(self.ln_2(x))

    def attention_side(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(self.ln_1(x))


class Blocks(nn.ModuleDict):
    """The blocks a model holds, keyed by their GLOBAL layer index (so parameter names are global:
    `transformer.h.3.attn.c_attn.weight` on the pipeline stage that holds layer 3). Iterates over blocks."""

    def __iter__(self):
        return iter(self.values())

    def __getitem__(self, layer_id):
        return super().__getitem__(str(layer_id))

    @property
    def layer_ids(self) -> list:
        return [int(key) for key in self.keys()]


class GPT(nn.Module):
    """The GPT, or one pipeline stage of it: the blocks `layers` (default all; any increasing layer ids),
    plus the embeddings when `embedding`, plus the final LayerNorm, head and loss when `head`. The head's
    weight is tied to the token embedding: one tensor when the model holds both, else a copy named
    `transformer.wte.weight` too."""

    def __init__(self, config: GPTConfig, seed: int = 0, dtype: torch.dtype = torch.float32, device=None,
                 layers=None, embedding: bool = True, head: bool = True):
        super().__init__()
        self.config, self.seed = config, seed
        layers = list(range(config.n_layer) if layers is None else layers)
        if layers != sorted(set(layers)) or not all(0 <= i < config.n_layer for i in layers):
            raise ValueError(f"layers {layers} are not increasing layer ids of the model's {config.n_layer} layers")
        self.aux_losses = AuxLosses()  # what a layer adds during a forward (a MoE layer's balance losses)
        self.recompute = None  # the selective policy, given by parallel/recompute.py (--activation-checkpointing)
        with torch.device("meta"):  # shapes only: init_weights, or shard.materialize for what a rank keeps
            parts = {}  # in nanoGPT's order: wte, wpe, drop, h, ln_f
            if embedding:
                parts.update(wte=nn.Embedding(config.vocab_size, config.n_embd),
                             wpe=nn.Embedding(config.block_size, config.n_embd), drop=nn.Dropout(config.dropout))
            parts.update(h=Blocks({str(i): Block(config, i) for i in layers}))
            if head:
                parts.update(ln_f=nn.LayerNorm(config.n_embd, bias=config.bias))
            self.transformer = nn.ModuleDict(parts)
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False) if head else None
        self.to(dtype)
        if embedding and head:
            self.lm_head.weight = self.transformer.wte.weight  # tied: one tensor, named transformer.wte.weight
        # Tensor parallel swaps in a vocab-parallel loss (which leaves the padding rows out alike).
        self.loss_fn = functools.partial(cross_entropy_sum, real_vocab_size=config.real_vocab_size)
        if torch.device(device or "cpu").type != "meta":  # device="meta": the axes cut first (train.compose)
            self.init_weights(device or "cpu")

    @torch.no_grad()
    def init_weights(self, device) -> None:
        """Every parameter its initial value (`initial_value` of its global name) on `device`, one at a time. The
        parameter objects stay (torch.utils.swap_tensors takes a meta tensor's place), so the tie stays too."""
        for name, param in self.named_parameters():  # each tensor once (the tied one too)
            value = self.initial_value(self.global_name(name), param.shape, param.dtype).to(device)
            torch.utils.swap_tensors(param, nn.Parameter(value, requires_grad=param.requires_grad))

    def initial_value(self, name: str, shape, dtype=torch.float32) -> torch.Tensor:
        """The logical tensor `name` at initialisation (init_full_parameter with this model's config and seed):
        what any rank slices its piece from (shard.materialize)."""
        return init_full_parameter(name, shape, self.config, self.seed, dtype)

    @property
    def has_embedding(self) -> bool:
        return "wte" in self.transformer

    @property
    def has_head(self) -> bool:
        return self.lm_head is not None

    @staticmethod
    def global_name(local_name: str) -> str:
        """The head's own copy of the tied weight (a stage without the embedding) is the embedding's tensor."""
        return "transformer.wte.weight" if local_name == "lm_head.weight" else local_name

    def num_params(self, exclude_position_embedding: bool = False) -> int:
        """Parameters this model holds (tied weights once)."""
        total = sum(p.numel() for p in self.parameters())
        if exclude_position_embedding and self.has_embedding:
            total -= self.transformer.wpe.weight.numel()
        return total

    # The forward in three pieces: embed → blocks → head + loss. A pipeline stage calls those it holds.

    def embed(self, idx: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        """Token + position embeddings (batch, seq) → (batch, seq, n_embd). `pos`: global positions (CP)."""
        if pos is None:
            if idx.size(1) > self.config.block_size:
                raise ValueError(f"sequence of {idx.size(1)} tokens is longer than block_size={self.config.block_size}")
            pos = torch.arange(idx.size(1), device=idx.device)
        return self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))

    def forward_blocks(self, x: torch.Tensor, layers: range | None = None) -> torch.Tensor:
        """Run the held blocks (or the contiguous `layers` of them: one pipeline chunk) on hidden states x."""
        for layer_id in layers if layers is not None else self.transformer.h.layer_ids:
            block = self.transformer.h[layer_id]
            training = self.training and torch.is_grad_enabled()
            if self.config.activation_checkpointing and training:
                x = checkpoint(block, x, use_reentrant=False)
            elif self.recompute is not None and training and block.recompute is None:  # by halves: Block
                x = checkpoint(block, x, use_reentrant=False, context_fn=self.recompute.contexts)
            else:
                x = block(x)
        return x

    def head_loss(self, x: torch.Tensor, targets: torch.Tensor | None = None):
        """Final LayerNorm, head and loss: (logits, loss_sum, token_count), as `forward` returns them."""
        x = self.transformer.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None, None  # sampling needs the last position only
        logits = self.lm_head(x)
        return logits, self.loss_fn(logits, targets), (targets != -1).sum()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, pos: torch.Tensor | None = None):
        """Returns (logits, loss_sum, token_count); loss_sum and token_count are None without targets.

        loss_sum = Σ over targets ≠ -1 of -log softmax(logits)[target]; token_count = #targets ≠ -1.
        Auxiliary losses of this forward are left in `self.aux_losses` (cleared first).
        """
        self.aux_losses.clear()
        return self.head_loss(self.forward_blocks(self.embed(idx, pos)), targets)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample `max_new_tokens` tokens after the prompt `idx` (batch, seq), one at a time; temperature 0 is
        greedy (the most likely token: no draw)."""
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size:]
            logits, _, _ = self(context)
            logits = logits[:, -1, :self.config.real_vocab_size].float()  # no padding
            if temperature == 0:
                idx = torch.cat([idx, logits.argmax(dim=-1, keepdim=True)], dim=1)
                continue
            logits = logits / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits[logits < kth] = -float("inf")
            probs = F.softmax(logits, dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
        return idx


def compile_blocks(model: GPT, backend: str = "inductor") -> GPT:
    """torch.compile each transformer block's `forward`, one compiled region per block; returns the model.

    Why per block and not `torch.compile(model)`: AOTAutograd turns a compiled region's backward into ONE
    autograd node, which hands out all of the region's parameter gradients when it ends. Compiled whole, the
    model's gradients all arrive at the very end of backward, and so do the post-accumulate-grad hooks where
    DDP launches its bucket all-reduces and ZeRO its reduce-scatters: nothing overlaps. Compiled per block,
    block i's gradients (and hooks) arrive when block i's backward graph ends, before block i-1's starts.

    The block's `forward` is compiled, not its `__call__`, so module hooks (ZeRO-3's gather/free pre- and
    post-hooks, the backward hook they put on the block's output) run eagerly around the compiled graph. The
    blocks share one code object and their parameters are graph inputs, so blocks built alike share one
    compilation (12 dense blocks: one graph), plus one for eval mode. Activation checkpointing still wraps the
    block's call (`forward_blocks`): the compiled forward is what it recomputes in backward.
    The embeddings (a lookup and an add) and the head (one matmul, then the loss, which tensor parallel swaps
    for a vocabulary-parallel one that talks) stay eager: little to fuse, and as regions of their own their
    gradients would arrive when they do now (ln_f's first; the tied weight's last, with the embeddings'), so
    compiling them would not change the overlap.
    """
    for block in model.transformer.h:
        block.forward = torch.compile(block.forward, backend=backend)
    return model
