"""Megatron tensor parallel (Shoeybi et al. 2019) and sequence parallel (Korthikanti et al. 2022), raw collectives.

T ranks (the `tp` group) split every matmul of a block. The MLP's first linear is split by output columns, its
second by input rows, so the GELU between them runs on local columns and the pair needs ONE sum at the end;
attention is split by heads alike. The tied embedding and LM head are split along the vocabulary, and the
cross-entropy is computed on the vocabulary shards, never building the full logits on one rank.

The conjugate operators of Megatron's paper (section 3) mark where a tensor-parallel region begins and ends:
    f: identity forward, all-reduce backward   (enters a region: every rank needs the whole input X, and
       the gradient of X is the sum of what each rank's column shard contributes)
    g: all-reduce forward, identity backward   (leaves a region: Y = Σ_t X_t·B_t, the row shards' partial sums)
Sequence parallelism (Korthikanti et al., section 4.2.2) replaces them with their halves, so that the
LayerNorms and dropouts between regions work on 1/T of the sequence instead of repeating the same work:
    g  (enter): all-gather along the sequence forward,  reduce-scatter backward
    ḡ  (leave): reduce-scatter along the sequence forward, all-gather backward
An all-reduce IS a reduce-scatter then an all-gather: the same bytes, and nothing outside the regions repeats.

Weights are the per-parameter init sliced by ShardInfo.shard_of (shard.initial_local): a TP run starts from
exactly the single-device weights; c_attn's [q | k | v] is cut with `segments=3` (rank t holds its heads of each).
Dropout: a replicated activation needs one mask on every TP rank, a split one its own (TensorParallelRNG).

Symbols: s sequence length (s/C under context parallel), b micro-batch, h hidden, a heads, V vocabulary,
L layers, T tensor-parallel size, e_w / e_c the bytes of a working-weight / compute-dtype element.

1. Replicated and split. Split T ways: c_attn (by heads, q/k/v each), attn.c_proj (by input rows), mlp.c_fc
   (by output columns), mlp.c_proj (by input rows; a MoE block's shared experts alike), the tied embedding/head
   (by vocabulary rows), and the activations inside the regions (heads, MLP columns, the logits' vocabulary).
   Replicated: LayerNorms, the row-parallel biases (added once, after the sum), the position embedding. With
   --sp the activations between regions are split along the sequence too, and the replicated parameters see
   only their tokens, so their gradients are summed over the TP group once per step (`after_grad_sync`).
2. Peak per device. Parameters Ψ_split/T + Ψ_repl (memory.param_counts: Ψ_split = V·h + 12·h²·L + biases,
   Ψ_repl = block_size·h + LayerNorms + row biases), 16 bytes each with fp32 grads and AdamW. Activations
   per layer (Korthikanti, 16-bit; accounting/memory.py's `tp_activation_estimates`): T = 1 s·b·h·(34 + 5·a·s/h); TP
   s·b·h·(10 + 24/T + 5·a·s/(h·T)); TP + SP s·b·h/T·(34 + 5·a·s/h), as c_attn and c_fc keep only their input's
   sequence shard for backward and all-gather it again there (as Megatron). Temporary: one gathered
   [b, s, h] input at a time, and the loss's softmax [b·s, V/T] in fp32 (never [b·s, V]).
3. Critical path, per micro-batch (all synchronous, nothing overlaps; group `tp`, bytes = the message M):
       per block, no SP: forward  2 × all_reduce s·b·h·e_c   (after attn.c_proj and mlp.c_proj: g)
                         backward 2 × all_reduce s·b·h·e_w   (before c_attn and c_fc: f)
       per block, SP:    forward  2 × all_gather s·b·h·e_c + 2 × reduce_scatter s·b·h·e_c
                         backward 2 × reduce_scatter s·b·h·e_c + 4 × all_gather s·b·h·e_c (two of them
                         re-gather c_attn's and c_fc's inputs; not under recompute, full or selective, or FP8)
       embedding: all_reduce (SP: reduce_scatter forward, all_gather backward) s·b·h·e_w
       head:      all_reduce backward s·b·h·e_w (SP: all_gather forward, all_gather + reduce_scatter
                  backward, s·b·h·e_c)
       loss:      all_reduce MAX b·s·e_l and all_reduce SUM 2·b·s·e_l (e_l = 4, or 8 for float64 logits)
   Activation checkpointing repeats each block's forward messages in backward, all but the last (torch's
   checkpoint stops recomputing once the saved tensors are back: the MLP's reduction feeds none); selective
   recompute repeats none (the forward's run as collective_ops operators, whose outputs it keeps). Per step,
   with SP: one all_reduce of the sequence-parallel parameters' gradients (`after_grad_sync`).
   With --tp-comm-bits 4 (parallel/lowbit.py, handed over by `reduce_with`) each f and g above, the embedding's and
   the head's too, is an all_to_all_single and an all_gather_single of NVFP4 codes, ≈ 28% of the bytes of bf16.
   `step_messages` computes all of this; the tests check it against the CommTracer byte for byte.
4. Restart state: nothing of its own; each parameter's `shard_info` names its global slice (any T reloads it).
"""

from __future__ import annotations

import functools
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from parallel import collectives
from model import GPT, MLP
from shard import ShardInfo, Split, describe, initial_local
from step import Messages
from step import Axis, sum_in_place

# ---------------------------------------------------------------------------------------------------------
# Collectives along the sequence (dim 1 of [batch, seq, ...]) and the vocabulary (last dim); the conjugate operators
# ---------------------------------------------------------------------------------------------------------
# The raw collectives (parallel/collectives.py: all_gather_single / reduce_scatter_single work on dim 0, so the sequence
# is moved to the front and back; Megatron keeps activations [s, b, h], model.py is batch-first like nanoGPT).
_all_reduce, _all_gather, _reduce_scatter = collectives.sum_raw, collectives.gather_raw, collectives.scatter_raw


class CopyToTensorParallelRegion(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce backward. Enters a region whose ranks each use the whole X."""

    @staticmethod
    def forward(ctx, x, group, reduction=None):
        ctx.group, ctx.reduction = group, reduction
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        reduced = ctx.reduction(grad, ctx.group, "backward") if ctx.reduction else _all_reduce(grad, ctx.group)
        return reduced, None, None


class ReduceFromTensorParallelRegion(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward. Leaves a region: sums the row shards' partials.
    `operators`: through collective_ops (a selectively recomputed block keeps the sum, never sends it again)."""

    @staticmethod
    def forward(ctx, x, group, operators=False, reduction=None):
        if reduction is not None:
            return reduction(x, group, "forward")
        return collectives.all_reduce(x, group) if operators else _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


class GatherFromSequenceParallelRegion(torch.autograd.Function):
    """Sequence parallel's g: all-gather the sequence forward, reduce-scatter backward. Enters a region."""

    @staticmethod
    def forward(ctx, x, group, operators=False):
        ctx.group = group
        return collectives.all_gather(x, 1, group) if operators else _all_gather(x, 1, group).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, 1, ctx.group), None, None


class ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Sequence parallel's ḡ: reduce-scatter the sequence forward, all-gather backward. Leaves a region."""

    @staticmethod
    def forward(ctx, x, group, operators=False):
        ctx.group = group
        return collectives.reduce_scatter(x, 1, group) if operators else _reduce_scatter(x, 1, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, 1, ctx.group), None, None


def _autocast_input(x: torch.Tensor) -> torch.Tensor:
    """Cast to the autocast dtype now, as the linear would: the all-gather then moves 16-bit data, and the
    linear's own cast is a no-op, so the tensor it saves for backward is the gathered one itself."""
    device = x.device.type
    return x.to(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else x


@dataclass
class TensorParallelContext:
    """What every swapped module shares: the group and whether activations between regions are split."""

    group: object
    size: int
    rank: int
    sequence_parallel: bool = False
    operators: bool = False  # forward collectives as collective_ops operators (under selective recompute)
    # f's and g's all-reduce when set: `reduction(x, group, chain)`, chain "forward" (g) or "backward" (f), and
    # `reduction.messages(elements, element_bytes)`; parallel/lowbit.py's 4-bit one (TensorParallel.reduce_with)
    reduction: object = None

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """Into a region: f, or with SP the all-gather of the sequence (of 16-bit data under autocast)."""
        if self.sequence_parallel:
            return GatherFromSequenceParallelRegion.apply(_autocast_input(x), self.group, self.operators)
        return CopyToTensorParallelRegion.apply(x, self.group, self.reduction)

    def leave(self, x: torch.Tensor) -> torch.Tensor:
        """Out of a region: g, or with SP the reduce-scatter of the sequence."""
        if self.sequence_parallel:
            return ReduceScatterToSequenceParallelRegion.apply(x, self.group, self.operators)
        return ReduceFromTensorParallelRegion.apply(x, self.group, self.operators, self.reduction)


# ---------------------------------------------------------------------------------------------------------
# Parallel layers: each wraps a local nn.Linear / nn.Embedding shard (FP8 converts those inner modules)
# ---------------------------------------------------------------------------------------------------------


class ColumnParallelLinear(nn.Module):
    """Y = X·Aᵀ with A split by output features: rank t computes Y_t = X·A_tᵀ (+ b_t), its columns of Y.

    The input enters the region through f (or SP's all-gather); the output stays split for the next row-parallel
    layer unless `gather_output` (sampling's full logits, under no_grad). `regather` (SP): keep the sequence
    shard for backward, not the gathered input (`_forward_regathering`); off under recompute (full, selective).
    """

    def __init__(self, linear: nn.Linear, ctx: TensorParallelContext, gather_output: bool = False,
                 regather: bool = True):
        super().__init__()
        self.linear, self.ctx, self.gather_output, self.regather = linear, ctx, gather_output, regather

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.regather and self.ctx.sequence_parallel and torch.is_grad_enabled():
            y = self._forward_regathering(x)
        else:
            y = self.linear(self.ctx.enter(x))
        return _all_gather(y, -1, self.ctx.group) if self.gather_output else y  # sampling: no gradient

    def _forward_regathering(self, x: torch.Tensor) -> torch.Tensor:
        """SP as in Megatron: a saved-tensor hook keeps this rank's shard when the linear saves the gathered
        input, and all-gathers it again when backward unpacks it. The weight gradient X_fullᵀ·dY needs the whole
        input: s·b·h elements per column layer where Korthikanti et al. count s·b·h/T; this costs one more
        all-gather per column layer in backward, for (T-1)/T of that memory."""
        shard, group = _autocast_input(x), self.ctx.group
        total = GatherFromSequenceParallelRegion.apply(shard, group)  # = self.ctx.enter(x)
        shard = shard.detach()
        # `pack` lives as long as what it saved: it must not hold `total` itself, or the gathered input stays.
        gathered = (total.data_ptr(), total.numel(), total.dtype)

        def pack(t):
            same = (t.data_ptr(), t.numel(), t.dtype) == gathered
            return (shard, t.shape) if same else t  # the linear saves a [b·s, h] view of `total`

        def unpack(saved):
            if isinstance(saved, tuple):
                piece, shape = saved
                return _all_gather(piece, 1, group).contiguous().view(shape)
            return saved

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return self.linear(total)


class RowParallelLinear(nn.Module):
    """Y = X·Bᵀ + c with B split by input features: rank t holds X_t (its columns) and B_t, and
    Y = Σ_t X_t·B_tᵀ + c. The sum leaves the region through g (or SP's reduce-scatter); the bias is added
    once, after the sum, so it is a replicated parameter outside the local linear."""

    def __init__(self, linear: nn.Linear, bias: nn.Parameter | None, ctx: TensorParallelContext):
        super().__init__()
        assert linear.bias is None, "the bias is added after the reduction, not by every rank"
        self.linear, self.bias, self.ctx = linear, bias, ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ctx.leave(self.linear(x))
        return y if self.bias is None else y + self.bias.to(y.dtype)


class VocabParallelEmbedding(nn.Module):
    """The token embedding split by vocabulary rows: rank t holds rows [t·V/T, (t+1)·V/T). Each rank looks up
    the tokens it owns and writes zeros for the others; the sum over ranks (g, or SP's reduce-scatter, which
    also splits the sequence for what follows) is then the full lookup."""

    def __init__(self, embedding: nn.Embedding, ctx: TensorParallelContext, vocab_start: int):
        super().__init__()
        self.embedding, self.ctx, self.vocab_start = embedding, ctx, vocab_start

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        local = idx - self.vocab_start
        outside = (local < 0) | (local >= self.embedding.num_embeddings)
        out = self.embedding(local.masked_fill(outside, 0)).masked_fill(outside.unsqueeze(-1), 0.0)
        return self.ctx.leave(out)


class SequenceParallelPositions(nn.Module):
    """The position embedding under SP: each rank looks up the positions of its own piece of the sequence."""

    def __init__(self, embedding: nn.Embedding, ctx: TensorParallelContext):
        super().__init__()
        self.embedding, self.ctx = embedding, ctx

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        if self.ctx.sequence_parallel:
            pos = pos.chunk(self.ctx.size)[self.ctx.rank]
        return self.embedding(pos)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Σ_i -log softmax(z_i)[y_i] with z_i's vocabulary split over the group; never builds a full row of z.

    -log softmax(z)[y] = log Σ_v exp(z_v - m) - (z_y - m), m = max_v z_v. Each rank holds a slice of v:
      1. m: local max, all-reduce MAX (for the exp to stay finite; any common m gives the same value);
      2. Σ_v exp(z_v - m): local sums; z_y - m: taken by the rank owning y, zero elsewhere; both summed in ONE
         all-reduce SUM of [2, N].
    Backward needs no message: ∂/∂z_v = softmax(z)_v - [v = y], and each rank has its slice of the softmax.
    Rows whose target is -1 contribute nothing.
    """

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group):
        # logits: [N, V/T] local slice (fp32 or fp64); targets: [N] global ids or -1.
        m = logits.max(dim=-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        exp = (logits - m.unsqueeze(-1)).exp_()
        local = targets - vocab_start
        owned = (local >= 0) & (local < logits.shape[-1])
        local = local.masked_fill(~owned, 0)
        target_shifted = (logits.gather(1, local.unsqueeze(1)).squeeze(1) - m) * owned
        sums = torch.stack([exp.sum(dim=-1), target_shifted])
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        valid = targets != -1
        loss_sum = ((sums[0].log() - sums[1]) * valid).sum()
        softmax = exp.div_(sums[0].unsqueeze(-1))
        ctx.save_for_backward(softmax, local, owned, valid)
        return loss_sum

    @staticmethod
    def backward(ctx, grad_loss_sum):
        softmax, local, owned, valid = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(1, local.unsqueeze(1), -owned.to(grad.dtype).unsqueeze(1))  # - [v = y] on the owner
        grad.mul_((valid.to(grad.dtype) * grad_loss_sum).unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_loss(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, group,
                        real_vocab_size: int | None = None) -> torch.Tensor:
    """model.loss_fn under TP (bound with functools.partial): the cross-entropy sum of LOCAL logits [..., V/T].
    Columns past `real_vocab_size` (padding rows) get the lowest finite logit: exp underflows to exactly 0, so
    they take no share of the softmax, and unlike -inf it keeps (z - m)·0 finite on a rank of only padding."""
    wide = logits.float() if logits.element_size() < 4 else logits  # softmax in at least fp32
    if real_vocab_size is not None and vocab_start + wide.shape[-1] > real_vocab_size:
        rows = torch.arange(vocab_start, vocab_start + wide.shape[-1], device=wide.device)
        wide = wide.masked_fill(rows >= real_vocab_size, torch.finfo(wide.dtype).min)
    return VocabParallelCrossEntropy.apply(wide.reshape(-1, wide.shape[-1]), targets.reshape(-1), vocab_start, group)


# ---------------------------------------------------------------------------------------------------------
# Dropout randomness
# ---------------------------------------------------------------------------------------------------------


class TensorParallelRNG:
    """Which dropout masks agree across the TP group: the job of Megatron's RNG tracker, checkpoint-safe.

    Replicated activations need the SAME mask on every TP rank, or the ranks' copies drift apart: they use
    the default generator, which the trainer seeds alike across a TP group. Split activations need
    INDEPENDENT masks: `fork()` draws one number from the default generator (the same draw on every TP rank)
    and reseeds it with (draw, TP rank) for the op, then restores it. The per-op seed being a draw from the
    default generator, torch.utils.checkpoint (which restores that state to recompute) replays the masks."""

    def __init__(self, tp_rank: int, device: torch.device):
        self.tp_rank, self.device = tp_rank, torch.device(device)

    @contextmanager
    def fork(self):
        draw = int(torch.randint(0, 2**62, ()))  # CPU default generator: same on every TP rank
        cuda = self.device.type == "cuda"
        devices = [self.device.index if self.device.index is not None else torch.cuda.current_device()] if cuda else []
        with torch.random.fork_rng(devices=devices, device_type="cuda" if cuda else None):
            torch.manual_seed((draw + self.tp_rank * 0x9E3779B97F4A7C15) % 2**63)
            yield


class ForkedDropout(nn.Module):
    """A dropout in a region that sequence parallelism splits: independent masks per TP rank under SP."""

    def __init__(self, dropout: nn.Dropout, ctx: TensorParallelContext, rng: TensorParallelRNG):
        super().__init__()
        self.dropout, self.ctx, self.rng = dropout, ctx, rng

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        split = self.training and self.dropout.p > 0 and self.ctx.sequence_parallel
        with self.rng.fork() if split else nullcontext():
            return self.dropout(x)


class ForkedAttention:
    """attention_fn on this rank's heads: its attention-probability dropout gets this rank's own masks."""

    def __init__(self, fn, rng: TensorParallelRNG):
        self.fn, self.rng = fn, rng

    def __call__(self, q, k, v, dropout_p: float):
        with self.rng.fork() if dropout_p != 0 else nullcontext():
            return self.fn(q, k, v, dropout_p)


# ---------------------------------------------------------------------------------------------------------
# Applying TP to the plain GPT
# ---------------------------------------------------------------------------------------------------------


def parallelize(model: GPT, group, sequence_parallel: bool = False, batch: BatchShape | None = None,
                device=None) -> TensorParallel:
    """Swap the plain GPT's linears, embedding and head for their tensor-parallel versions, in place.

    Every rank of `group` calls it on the same model: rank t keeps slice t of every split parameter (the
    per-parameter init, GPT.initial_value; on a meta model only shapes and records, which shard.materialize fills);
    replicated ones stay. With dropout the caller seeds the default generator alike across the TP group
    (TensorParallelRNG, on `device`: the model's unless meta). `batch`: a step's input (`predicted_messages`).
    """
    config, init = model.config, model.initial_value
    describe(model)  # the whole tensors' records, which the splits below cut
    ctx = TensorParallelContext(group, dist.get_world_size(group), dist.get_rank(group), sequence_parallel,
                                config.selective_recompute)
    rng = TensorParallelRNG(ctx.rank, device if device is not None else next(model.parameters()).device)
    untouched = set(model.parameters())  # holds them: an id() of a freed tensor could be reused
    sp_params = []  # replicated over TP, summed over it under SP
    for block in model.transformer.h:  # the blocks this model (or pipeline stage) holds
        sp_params += _parallelize_block(block, ctx, config, init, rng)
    # Tied embedding and head: ONE vocabulary-split parameter, used by both (a pipeline stage holding only
    # one of them has its own copy, named transformer.wte.weight as well).
    vocab_weight = _param(_shard("transformer.wte.weight", (config.vocab_size, config.n_embd), 0, ctx), init,
                          next(model.parameters()))
    vocab_start = ctx.rank * (config.vocab_size // ctx.size)
    with torch.device("meta"):
        embedding = nn.Embedding(config.vocab_size // ctx.size, config.n_embd)
        head = nn.Linear(config.n_embd, config.vocab_size // ctx.size, bias=False)
    embedding.weight = head.weight = vocab_weight
    if model.has_embedding:
        model.transformer.wte = VocabParallelEmbedding(embedding, ctx, vocab_start)
        model.transformer.drop = ForkedDropout(model.transformer.drop, ctx, rng)
        if sequence_parallel:
            model.transformer.wpe = SequenceParallelPositions(model.transformer.wpe, ctx)
            sp_params.append(model.transformer.wpe.embedding.weight)
    if model.has_head:
        model.lm_head = ColumnParallelLinear(head, ctx)
        model.loss_fn = functools.partial(vocab_parallel_loss, vocab_start=vocab_start, group=group,
                                          real_vocab_size=config.real_vocab_size)
        sp_params += [*model.transformer.ln_f.parameters()]
    for param in model.parameters():  # what TP did not split, every TP rank holds a copy of
        if param in untouched:
            param.shard_info = param.shard_info.replicated_also_over("tp")
    return TensorParallel(model, ctx, sp_params if sequence_parallel else [], rng, batch)


def _parallelize_block(block, ctx: TensorParallelContext, config, init, rng) -> list:
    """One block in place: attention's and the MLP's column → row pairs, dropout forked per TP rank. Returns
    the block's parameters that stay replicated (its LayerNorms and the row layers' biases)."""
    prefix, attn, mlp = f"transformer.h.{block.layer_id}", block.attn, block.mlp
    regather = not (config.activation_checkpointing or config.selective_recompute)  # a recompute keeps it
    attn.c_attn = _column(attn.c_attn, f"{prefix}.attn.c_attn", ctx, init, 3, regather)
    attn.c_proj = _row(attn.c_proj, f"{prefix}.attn.c_proj", ctx, init)
    split_mlp = split_mlp_of(mlp)  # the dense MLP or a MoE block's shared experts; routed experts stay whole
    name = f"{prefix}.mlp" if split_mlp is mlp else f"{prefix}.mlp.shared_experts"
    if split_mlp is not None:
        split_mlp.c_fc = _column(split_mlp.c_fc, f"{name}.c_fc", ctx, init, 1, regather)
        split_mlp.c_proj = _row(split_mlp.c_proj, f"{name}.c_proj", ctx, init)
    attn.attention_fn = ForkedAttention(attn.attention_fn, rng)
    attn.resid_dropout = ForkedDropout(attn.resid_dropout, ctx, rng)
    mlp.dropout = ForkedDropout(mlp.dropout, ctx, rng)
    row_biases = [attn.c_proj.bias] + ([split_mlp.c_proj.bias] if split_mlp is not None else [])
    return [*block.ln_1.parameters(), *block.ln_2.parameters(), *(p for p in row_biases if p is not None)]


def split_mlp_of(mlp):
    """The c_fc → c_proj pair TP splits in a block's MLP: the MLP, a MoE block's shared experts, or None."""
    return mlp if isinstance(mlp, MLP) else getattr(mlp, "shared_experts", None)


def _shard(name: str, shape, split_dim: int | None, ctx: TensorParallelContext, segments: int = 1) -> ShardInfo:
    """A tensor split along `split_dim` over the TP group, or (None) one identical copy on every TP rank."""
    if split_dim is None:
        return ShardInfo(global_name=name, global_shape=tuple(shape), replicated_over=("tp",))
    return ShardInfo(global_name=name, global_shape=tuple(shape),
                     splits=(Split(split_dim, ctx.size, ctx.rank, segments),))


def _param(shard: ShardInfo, init, like: torch.Tensor) -> nn.Parameter:
    """This rank's slice of the parameter's deterministic init, with its shard record (on meta: its shape)."""
    value = (torch.empty(shard.local_shape, dtype=like.dtype, device="meta") if like.is_meta
             else initial_local(shard, init, like.dtype).to(like.device))
    param = nn.Parameter(value)
    param.shard_info = shard
    return param


def _column(linear: nn.Linear, name: str, ctx, init, segments: int, regather: bool):
    with torch.device("meta"):  # shapes only; the values come from the deterministic init
        local = nn.Linear(linear.in_features, linear.out_features // ctx.size, bias=linear.bias is not None)
    for kind in ("weight", "bias") if linear.bias is not None else ("weight",):
        full = getattr(linear, kind)
        setattr(local, kind, _param(_shard(f"{name}.{kind}", full.shape, 0, ctx, segments), init, full))
    return ColumnParallelLinear(local, ctx, regather=regather)


def _row(linear: nn.Linear, name: str, ctx, init):
    with torch.device("meta"):
        local = nn.Linear(linear.in_features // ctx.size, linear.out_features, bias=False)
    local.weight = _param(_shard(f"{name}.weight", linear.weight.shape, 1, ctx), init, linear.weight)
    bias = linear.bias  # replicated: added once, after the sum
    if bias is not None:
        bias = _param(_shard(f"{name}.bias", bias.shape, None, ctx), init, bias)
    return RowParallelLinear(local, bias, ctx)


class TensorParallel(Axis):
    """The handle `parallelize` returns (step.Axis): the SP gradient sum, sampling, the predicted messages.
    sequence_parallel_params: the replicated parameters whose gradients SP sums over TP (docstring item 1)."""

    name = "tp"

    def __init__(self, model: GPT, ctx: TensorParallelContext, sequence_parallel_params: list,
                 rng: TensorParallelRNG, batch: BatchShape | None = None):
        self.model, self.ctx, self.rng, self.batch = model, ctx, rng, batch
        self.sequence_parallel = ctx.sequence_parallel  # ctx's is switched off while sampling
        self.sequence_parallel_params = sequence_parallel_params

    @torch.no_grad()
    def after_grad_sync(self, layout) -> int:
        """Sum the SP parameters' gradients over the TP group in one flat all-reduce per step, after the
        data-parallel sum (both are sums), like Megatron's finalize_model_grads; `layout.grad_pieces`: as this
        rank holds them (whole, or a ZeRO shard's segments, alike on every TP rank). Without SP f and g already
        gave every TP rank the whole gradient. Returns 0: nothing non-finite of its own."""
        if self.sequence_parallel:
            sum_in_place(layout.grad_pieces(self.sequence_parallel_params), self.ctx.group)
        return 0

    def reduce_with(self, reduction) -> None:
        """parallel/lowbit.py's hook: f and g sum through `reduction` (the context's); this file never imports it."""
        self.ctx.reduction = reduction

    @contextmanager
    def sampling(self):
        """The head gathers its vocabulary slices and SP is off (any prompt length works); every rank of the
        TP group runs the same generate() call (the collectives are the group's)."""
        head = self.model.lm_head  # None on a middle pipeline stage
        self.ctx.sequence_parallel = False
        if head is not None:
            head.gather_output = True
        try:
            yield
        finally:
            self.ctx.sequence_parallel = self.sequence_parallel
            if head is not None:
                head.gather_output = False

    def facts(self) -> tuple[BatchShape | None, Holding]:
        """What the formulas (and report/axes.py's tp section) read: the step's batch and what this rank's model
        holds (FP8, applied later, may stop the regather)."""
        blocks, config = list(self.model.transformer.h), self.model.config
        return self.batch, Holding(config.n_embd, self.sequence_parallel, config.activation_checkpointing, len(blocks),
                       sum(split_mlp_of(b.mlp) is None for b in blocks), self.model.has_embedding,
                       self.model.has_head, all(b.attn.c_attn.regather for b in blocks), self.ctx.reduction)

    def predicted_messages(self, layout) -> Messages:
        """One optimizer step's tp messages (`step_messages`); the SP sum moves the gradients as the layout
        holds them (a ZeRO shard of them, in its gradient dtype)."""
        sp_bytes = sum(g.numel() * g.element_size() for g in layout.grad_pieces(self.sequence_parallel_params))
        return step_messages(*self.facts(), sp_bytes)


@dataclass(frozen=True)
class TPConfig:
    """--tp T and --sp: validated by config_from_flags."""

    size: int  # T
    sequence_parallel: bool = False


def config_from_flags(args, settings) -> TPConfig | None:
    """TP's flags on this model (the sizes must split T ways), or ValueError naming the flag."""
    config, tp, seq_len = settings.model, args.tp, settings.seq_len
    if args.sp and tp == 1:
        raise ValueError("--sp (sequence parallel) needs --tp > 1")
    if tp == 1:
        return None
    if config.n_head % tp:
        raise ValueError(f"--tp {tp} must divide the number of attention heads n_head={config.n_head}"
                         f" (attention is split by heads)")
    if config.vocab_size % tp:
        raise ValueError(f"--tp {tp} must divide the vocabulary size {config.vocab_size} (the embedding and"
                         f" head are split by vocabulary; this trainer does not pad it)")
    if args.sp and seq_len % tp:
        raise ValueError(f"--sp: --tp {tp} must divide the sequence length {seq_len} (--seq-len)")
    return TPConfig(tp, args.sp)


def apply(model: GPT, run, config: TPConfig) -> TensorParallel:
    """--tp T (and --sp): split the model over the TP group. A rank holds s/C tokens of each sequence (CP,
    applied after TP, cuts the batch) and the layout's working weights (e_w: ZeRO's bf16 ones)."""
    batch = BatchShape(run.micro_batch_size, run.seq_len // run.mesh.size("cp"), run.micro_batches,
                       run.param_dtype.itemsize, run.compute_dtype.itemsize)
    return parallelize(model, run.mesh.group("tp"), config.sequence_parallel, batch, run.device)


# ---------------------------------------------------------------------------------------------------------
# Prediction formulas (docstring items 2 and 3)
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchShape:
    """What one optimizer step feeds a rank: m micro-batches of b sequences of s tokens, e_w / e_c bytes."""

    micro: int  # b
    seq: int  # s (s/C under context parallel)
    micro_batches: int = 1  # m
    param_bytes: int = 4  # e_w, a working weight
    compute_bytes: int = 4  # e_c, autocast's dtype


@dataclass(frozen=True)
class Holding:
    """What a rank's TP model holds: width h, SP, recompute; its blocks (a pipeline stage: some, maybe one
    end), `unsplit_mlp_blocks` of them with an MLP TP leaves whole (routed experts alone: `split_mlp_of`);
    whether SP re-gathers inputs."""

    hidden: int
    sequence_parallel: bool
    checkpointing: bool = False
    blocks: int = 1
    unsplit_mlp_blocks: int = 0
    embedding: bool = True
    head: bool = True
    regather: bool = True
    reduction: object = None  # f's and g's all-reduce when not dist.all_reduce (TensorParallelContext.reduction)


def _sum(held: Holding, elements: int, element_bytes: int) -> Messages:
    """One f or g over tp: an all_reduce of the elements, or what the context's reduction sends for them."""
    if held.reduction is not None:
        return held.reduction.messages(elements, element_bytes)
    return Messages().add("all_reduce", "tp", 1, elements * element_bytes)


def block_messages(batch: BatchShape, held: Holding, split_mlp: bool = True) -> dict:
    """One block's messages for one micro-batch, group tp: {"forward": Messages, "backward": Messages}.
    Without SP, f moves the gradient of the LayerNorm's output (e_w: autocast casts inside the linear, after
    f) and g a linear's output (e_c). With SP everything moves e_c data (the shard is cast before its
    all-gather); backward: ḡ's all-gather, the column layer's re-gather, g's reduce-scatter, per region."""
    regions = 2 if split_mlp else 1  # attention and MLP (or shared experts); routed experts alone: the attention
    activation = batch.micro * batch.seq * held.hidden
    message = activation * batch.compute_bytes
    if not held.sequence_parallel:
        return {"forward": _sum(held, activation, batch.compute_bytes).times(regions),  # g
                "backward": _sum(held, activation, batch.param_bytes).times(regions)}  # f
    gathers = regions * (2 if held.regather else 1)
    return {"forward": Messages().add("all_gather_single", "tp", regions, regions * message)
                                 .add("reduce_scatter_single", "tp", regions, regions * message),
            "backward": Messages().add("all_gather_single", "tp", gathers, gathers * message)
                                  .add("reduce_scatter_single", "tp", regions, regions * message)}


def step_messages(batch: BatchShape, held: Holding, sp_grad_bytes: int = 0) -> Messages:
    """Predicted tp-group messages of one optimizer step (docstring item 3): per micro-batch every held
    block's, the embedding's, the head's and the loss's; then SP's one sum of `sp_grad_bytes` of gradients."""
    tokens, sp, micro_batch = batch.micro * batch.seq, held.sequence_parallel, Messages()
    weights_dtype, compute = tokens * held.hidden * batch.param_bytes, tokens * held.hidden * batch.compute_bytes
    for split_mlp, count in ((True, held.blocks - held.unsplit_mlp_blocks), (False, held.unsplit_mlp_blocks)):
        phases = block_messages(batch, held, split_mlp)
        block = phases["forward"] + phases["backward"]
        if held.checkpointing:
            # Backward recomputes the forward, messages included, but torch's non-reentrant checkpoint stops
            # once every saved tensor is back: the MLP's final reduction feeds nothing saved and is not
            # repeated (a mixture of experts saves what follows the attention's: all of it is).
            block = block + phases["forward"]
            if split_mlp:
                block = block + (Messages().add("reduce_scatter_single", "tp", 1, compute) if sp else
                                 _sum(held, tokens * held.hidden, batch.compute_bytes)).times(-1)
        micro_batch = micro_batch + block.times(count)
    if held.embedding and sp:  # forward ḡ, whose backward all-gathers
        micro_batch.add("reduce_scatter_single", "tp", 1, weights_dtype)
        micro_batch.add("all_gather_single", "tp", 1, weights_dtype)
    elif held.embedding:  # forward g
        micro_batch = micro_batch + _sum(held, tokens * held.hidden, batch.param_bytes)
    if held.head and sp:  # forward all-gather; backward its re-gather and g's reduce-scatter
        micro_batch.add("all_gather_single", "tp", 2, 2 * compute).add("reduce_scatter_single", "tp", 1, compute)
    elif held.head:
        micro_batch = micro_batch + _sum(held, tokens * held.hidden, batch.param_bytes)  # backward f
    if held.head:  # the loss: MAX of [N], then Σexp and the target logit [2, N], in at least fp32
        micro_batch.add("all_reduce", "tp", 2, 3 * tokens * max(4, batch.compute_bytes))
    out = micro_batch.times(batch.micro_batches)
    return out.add("all_reduce", "tp", 1, sp_grad_bytes) if sp and sp_grad_bytes else out  # after_grad_sync
