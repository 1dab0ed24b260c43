"""Megatron tensor parallel (Shoeybi et al. 2019) and sequence parallel (Korthikanti et al. 2022), raw collectives.

T ranks (the `tp` group) split every matmul of a block. The MLP's first linear is split by output columns and
its second by input rows, so the GELU between them runs on local columns and the pair needs ONE sum at the
end; attention is split by heads the same way (c_attn by columns, c_proj by rows). The embedding and the
LM head, which share one weight, are split along the vocabulary, and the cross-entropy is computed on the
vocabulary shards without ever building the full logits on one rank.

The conjugate operators of Megatron's paper (section 3) mark where a tensor-parallel region begins and ends:
    f: identity forward, all-reduce backward   (enters a region: every rank needs the whole input X, and
       the gradient of X is the sum of what each rank's column shard contributes)
    g: all-reduce forward, identity backward   (leaves a region: Y = Σ_t X_t·B_t, the row shards' partial sums)
Sequence parallelism (Korthikanti et al., section 4.2.2) replaces them with their halves, so that the
LayerNorms and dropouts between regions work on 1/T of the sequence instead of repeating the same work:
    g  (enter): all-gather along the sequence forward,  reduce-scatter backward
    ḡ  (leave): reduce-scatter along the sequence forward, all-gather backward
An all-reduce IS a reduce-scatter followed by an all-gather, so the bytes are the same; what changes is that
nothing outside the regions is replicated any more.

Weights come from the per-parameter deterministic init (model.init_full_parameter), sliced with
ShardInfo.shard_of: a TP run starts from exactly the single-device weights. c_attn's output is [q | k | v],
so its shard is taken with `segments=3`: rank t holds its heads of q, of k and of v.

Symbols: s sequence length, b micro-batch, h hidden, a heads, V vocabulary, L layers, T tensor-parallel
size, e_w / e_c the bytes of a parameter-dtype / compute-dtype element (autocast: e_w = 4, e_c = 2).

1. Replicated and split. Split T ways: c_attn (by heads, q/k/v each), attn.c_proj (by input rows), mlp.c_fc
   (by output columns), mlp.c_proj (by input rows), the tied embedding/head (by vocabulary rows), and the
   activations inside the regions (heads, MLP columns, the logits' vocabulary). Replicated: LayerNorms, the
   row-parallel biases (added once, after the sum), the position embedding. With --sp the activations between
   regions are split along the sequence too, and the replicated parameters see only their tokens, so their
   gradients are summed over the TP group once per step (`finish_grad_sync`).
2. Peak per device. Parameters Ψ_split/T + Ψ_repl (`param_counts`; Ψ_split = V·h + 12·h²·L + biases,
   Ψ_repl = block_size·h + LayerNorms + row biases), each with (b_w + b_g + b_o) bytes for weights, grads
   and AdamW (16 in fp32). Activations per layer (Korthikanti, 16-bit):
       T = 1:        s·b·h·(34 + 5·a·s/h)
       TP:           s·b·h·(10 + 24/T + 5·a·s/(h·T))
       TP + SP:      s·b·h/T·(34 + 5·a·s/h)
   The third line assumes that c_attn and c_fc keep only their input's sequence shard for backward and
   all-gather it again there, as Megatron does and as ColumnParallelLinear does here (a saved-tensor hook).
   Temporary: one gathered [b, s, h] input at a time, and the loss's softmax [b·s, V/T] in fp32 (never
   [b·s, V]).
3. Critical path, per micro-batch (all synchronous, nothing overlaps; group `tp`, bytes = the message M):
       per block, no SP: forward  2 × all_reduce s·b·h·e_c   (after attn.c_proj and mlp.c_proj: g)
                         backward 2 × all_reduce s·b·h·e_w   (before c_attn and c_fc: f)
       per block, SP:    forward  2 × all_gather s·b·h·e_c + 2 × reduce_scatter s·b·h·e_c
                         backward 2 × reduce_scatter s·b·h·e_c + 4 × all_gather s·b·h·e_c (two of them
                         re-gather c_attn's and c_fc's inputs; not under activation checkpointing)
       embedding: all_reduce (SP: reduce_scatter forward, all_gather backward) s·b·h·e_w
       head:      all_reduce backward s·b·h·e_w (SP: all_gather forward, all_gather + reduce_scatter
                  backward, s·b·h·e_c)
       loss:      all_reduce MAX b·s·e_l and all_reduce SUM 2·b·s·e_l (e_l = 4, or 8 for float64 logits)
   Activation checkpointing repeats each block's forward messages in backward, all but the last (torch's
   checkpoint stops recomputing once the saved tensors are back: the MLP's reduction feeds none).
   Per step, with SP: one all_reduce of the sequence-parallel parameters' gradients (`after_grad_sync`).
   (The global gradient norm is one all-reduce over the world, optim.update; nothing per axis.)
   `step_messages` computes all of this; the tests check it against the CommTracer byte for byte.
4. Restart state: nothing of its own. Every parameter's `shard_info` names its global tensor and its
   slice, which the checkpoint reads; a different T reslices on load.

Dropout: a replicated activation (the residual stream without SP) needs the same mask on every TP rank, a
split one (attention heads; with SP the sequence pieces) a different mask per rank: see TensorParallelRNG.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from model import GPT, MLP, GPTConfig, ShardInfo, Split, init_full_parameter
from step import Axis, sum_in_place

# ---------------------------------------------------------------------------------------------------------
# Collectives along the sequence (dim 1 of [batch, seq, ...]) and the vocabulary (last dim)
# ---------------------------------------------------------------------------------------------------------
# all_gather_single / reduce_scatter_single work on dim 0, so the sequence is moved to the front for the
# collective and back after. (Megatron keeps activations [s, b, h] throughout so this is free; model.py is
# batch-first like nanoGPT, so we pay one copy per collective.)


def _all_reduce(x: torch.Tensor, group, op=None) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)  # a fresh buffer: never mutate autograd's tensors
    dist.all_reduce(out, op=op or dist.ReduceOp.SUM, group=group)
    return out


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    size = dist.get_world_size(group)
    local = x.movedim(dim, 0).contiguous()
    out = local.new_empty((local.shape[0] * size, *local.shape[1:]))
    dist.all_gather_single(out, local, group=group)
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    size = dist.get_world_size(group)
    if x.shape[dim] % size:
        raise ValueError(f"sequence parallel: a sequence of {x.shape[dim]} tokens does not split into --tp {size}"
                         f" equal pieces")
    full = x.movedim(dim, 0).contiguous()
    out = full.new_empty((full.shape[0] // size, *full.shape[1:]))
    dist.reduce_scatter_single(out, full, op=dist.ReduceOp.SUM, group=group)
    return out.movedim(0, dim)


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    return x.chunk(dist.get_world_size(group), dim)[dist.get_rank(group)].contiguous()


# ---------------------------------------------------------------------------------------------------------
# The conjugate operators
# ---------------------------------------------------------------------------------------------------------


class CopyToTensorParallelRegion(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce backward. Enters a region whose ranks each use the whole X."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class ReduceFromTensorParallelRegion(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward. Leaves a region: sums the row shards' partials."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherFromSequenceParallelRegion(torch.autograd.Function):
    """Sequence parallel's g: all-gather the sequence forward, reduce-scatter backward. Enters a region."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, 1, group).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, 1, ctx.group), None


class ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Sequence parallel's ḡ: reduce-scatter the sequence forward, all-gather backward. Leaves a region."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, 1, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, 1, ctx.group), None


class GatherFromTensorParallelRegion(torch.autograd.Function):
    """All-gather the last dimension forward, keep this rank's slice backward (full logits for sampling)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, -1, ctx.group), None


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

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """Into a region: f, or with SP the all-gather of the sequence (of 16-bit data under autocast)."""
        if self.sequence_parallel:
            return GatherFromSequenceParallelRegion.apply(_autocast_input(x), self.group)
        return CopyToTensorParallelRegion.apply(x, self.group)

    def leave(self, x: torch.Tensor) -> torch.Tensor:
        """Out of a region: g, or with SP the reduce-scatter of the sequence."""
        if self.sequence_parallel:
            return ReduceScatterToSequenceParallelRegion.apply(x, self.group)
        return ReduceFromTensorParallelRegion.apply(x, self.group)


# ---------------------------------------------------------------------------------------------------------
# Parallel layers: each wraps a local nn.Linear / nn.Embedding shard (FP8 converts those inner modules)
# ---------------------------------------------------------------------------------------------------------


class ColumnParallelLinear(nn.Module):
    """Y = X·Aᵀ with A split by output features: rank t computes Y_t = X·A_tᵀ (+ b_t), its columns of Y.

    The input enters the region through f (or SP's all-gather); the output stays split (the next row-parallel
    layer consumes it) unless `gather_output`, which all-gathers it (sampling's full logits).
    `regather` (SP only): keep the sequence shard for backward instead of the gathered input (see
    `_forward_regathering`); off inside activation-checkpointed blocks, which keep only their input anyway.
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
        return GatherFromTensorParallelRegion.apply(y, self.ctx.group) if self.gather_output else y

    def _forward_regathering(self, x: torch.Tensor) -> torch.Tensor:
        """SP as in Megatron: autograd keeps the shard, and backward all-gathers it again.

        The weight gradient X_fullᵀ·dY needs the whole gathered input; storing it would cost s·b·h elements
        per column layer where Korthikanti et al. count s·b·h/T. A saved-tensor hook swaps the gathered
        tensor for this rank's shard when the linear saves it, and unpacking it in backward all-gathers it
        again: one more all-gather per column layer in backward, for (T-1)/T of that memory.
        """
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
    """The token embedding split by vocabulary rows: rank t holds rows [t·V/T, (t+1)·V/T).

    Each rank looks up the tokens it owns and writes zeros for the others; the sum over ranks (g, or SP's
    reduce-scatter, which also splits the sequence for what follows) is then the full lookup.
    """

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
            if pos.shape[0] % self.ctx.size:
                raise ValueError(f"sequence parallel: a sequence of {pos.shape[0]} tokens does not split into"
                                 f" --tp {self.ctx.size} equal pieces")
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


class VocabParallelLoss:
    """model.loss_fn under TP: the vocab-parallel cross-entropy of the LOCAL logits (a vocabulary slice)."""

    def __init__(self, ctx: TensorParallelContext, vocab_start: int):
        self.ctx, self.vocab_start = ctx, vocab_start

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        wide = logits.float() if logits.element_size() < 4 else logits  # softmax in at least fp32
        return VocabParallelCrossEntropy.apply(wide.reshape(-1, wide.shape[-1]), targets.reshape(-1),
                                               self.vocab_start, self.ctx.group)


def vocab_parallel_cross_entropy_sum(local_logits, targets, vocab_start: int, group) -> torch.Tensor:
    """Functional form, for tests and callers outside the model."""
    ctx = TensorParallelContext(group, dist.get_world_size(group), dist.get_rank(group))
    return VocabParallelLoss(ctx, vocab_start)(local_logits, targets)


# ---------------------------------------------------------------------------------------------------------
# Dropout randomness
# ---------------------------------------------------------------------------------------------------------


class TensorParallelRNG:
    """Which dropout masks agree across the TP group: the job of Megatron's RNG tracker, checkpoint-safe.

    Replicated activations need the SAME mask on every TP rank, or the ranks' copies drift apart: they use
    the default generator, which the trainer seeds alike across a TP group. Split activations need
    INDEPENDENT masks: `fork()` draws one number from the default generator (the same draw on every TP rank),
    reseeds the default generator with (draw, TP rank) for the op, and then restores it. Since the per-op
    seed is itself a draw from the default generator, torch.utils.checkpoint, which saves and restores that
    generator's state around the recomputation, replays the very same masks in backward.
    """

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
        if not (self.training and self.dropout.p > 0 and self.ctx.sequence_parallel):
            return self.dropout(x)
        with self.rng.fork():
            return self.dropout(x)


class ForkedAttention:
    """attention_fn on this rank's heads: its attention-probability dropout gets this rank's own masks."""

    def __init__(self, fn, rng: TensorParallelRNG):
        self.fn, self.rng = fn, rng

    def __call__(self, q, k, v, dropout_p: float):
        if dropout_p == 0:
            return self.fn(q, k, v, dropout_p)
        with self.rng.fork():
            return self.fn(q, k, v, dropout_p)


# ---------------------------------------------------------------------------------------------------------
# Applying TP to the plain GPT
# ---------------------------------------------------------------------------------------------------------


def check_divisible(config: GPTConfig, tp: int, seq_len: int | None = None, sequence_parallel: bool = False):
    """Raise ValueError naming the flag when the model does not split into --tp pieces."""
    if config.n_head % tp:
        raise ValueError(f"--tp {tp} must divide the number of attention heads n_head={config.n_head}"
                         f" (attention is split by heads)")
    if config.vocab_size % tp:
        raise ValueError(f"--tp {tp} must divide the vocabulary size {config.vocab_size} (the embedding and"
                         f" head are split by vocabulary; this trainer does not pad it)")
    if sequence_parallel and seq_len is not None and seq_len % tp:
        raise ValueError(f"--sp: --tp {tp} must divide the sequence length {seq_len} (--seq-len)")


def _shard(name: str, shape, split_dim: int | None, ctx: TensorParallelContext, segments: int = 1) -> ShardInfo:
    """A tensor split along `split_dim` over the TP group, or (None) one identical copy on every TP rank."""
    if split_dim is None:
        return ShardInfo(global_name=name, global_shape=tuple(shape), replicated_over=("tp",))
    return ShardInfo(global_name=name, global_shape=tuple(shape),
                     splits=(Split(split_dim, ctx.size, ctx.rank, segments),))


def _param(shard: ShardInfo, config, seed, like: torch.Tensor) -> nn.Parameter:
    """This rank's slice of the parameter's deterministic init, with its shard record."""
    full = init_full_parameter(shard.global_name, shard.global_shape, config, seed, like.dtype)
    param = nn.Parameter(shard.shard_of(full).to(like.device).contiguous())
    param.shard_info = shard
    return param


def _column(linear: nn.Linear, name: str, ctx, config, seed, segments=1, regather=True):
    out_features = linear.out_features // ctx.size
    with torch.device("meta"):  # shapes only; the values come from the deterministic init
        local = nn.Linear(linear.in_features, out_features, bias=linear.bias is not None)
    local.weight = _param(_shard(f"{name}.weight", linear.weight.shape, 0, ctx, segments), config, seed,
                          linear.weight)
    if linear.bias is not None:
        local.bias = _param(_shard(f"{name}.bias", linear.bias.shape, 0, ctx, segments), config, seed, linear.bias)
    return ColumnParallelLinear(local, ctx, regather=regather)


def _row(linear: nn.Linear, name: str, ctx, config, seed):
    with torch.device("meta"):
        local = nn.Linear(linear.in_features // ctx.size, linear.out_features, bias=False)
    local.weight = _param(_shard(f"{name}.weight", linear.weight.shape, 1, ctx), config, seed, linear.weight)
    bias = None
    if linear.bias is not None:
        bias = _param(_shard(f"{name}.bias", linear.bias.shape, None, ctx), config, seed, linear.bias)
    return RowParallelLinear(local, bias, ctx)


class TensorParallel(Axis):
    """The handle `parallelize` returns: the shared context, the SP gradient sync, sampling, accounting."""

    def __init__(self, model: GPT, ctx: TensorParallelContext, sequence_parallel_params: list,
                 rng: TensorParallelRNG):
        self.model, self.ctx, self.rng = model, ctx, rng
        self.sequence_parallel = ctx.sequence_parallel
        # Replicated parameters that, under SP, see only this rank's tokens: LayerNorms, row-parallel biases,
        # the position embedding. Their gradient is the SUM over the TP group of what each rank computed.
        self.sequence_parallel_params = sequence_parallel_params

    name = "tp"

    @torch.no_grad()
    def after_grad_sync(self, layout):
        """Sum the sequence-parallel parameters' gradients over the TP group: one flat all-reduce per step.

        Run after the layout's data-parallel reduction, once all micro-batches have accumulated, like
        Megatron's finalize_model_grads. Both reductions are sums, so their order does not matter; doing it
        once per step (not in a backward hook per micro-batch) sends it once. `layout.grad_pieces` gives the
        gradients as this rank holds them (whole under DDP, its shard's segments under ZeRO; every rank of
        the TP group has the same segments). Without SP every TP rank already holds the full gradient of a
        replicated parameter (f and g make it so), and there is nothing to do.
        """
        if not self.sequence_parallel:
            return
        sum_in_place(layout.grad_pieces(self.sequence_parallel_params), self.ctx.group)

    def sampling(self):
        return self.full_logits()

    @contextmanager
    def full_logits(self):
        """For sampling: the head gathers its vocabulary slices and SP is off (any prompt length works).

        Every rank of the TP group must run the same generate() call (the collectives are the group's).
        """
        head, previous = self.model.lm_head, self.ctx.sequence_parallel  # no head on a middle pipeline stage
        self.ctx.sequence_parallel = False
        if head is not None:
            head.gather_output = True
        try:
            yield
        finally:
            self.ctx.sequence_parallel = previous
            if head is not None:
                head.gather_output = False

    def startup_lines_measured(self, micro: int, seq: int, compute_bytes: int, autocast, param_dtype=None,
                               state_bytes_per_param: int = 16) -> list:
        """accounting_lines with block 0's messages measured once (before DDP installs gradient hooks).

        param_dtype: the working dtype the run will train in when a later layout casts the weights (ZeRO's
        bf16 recipe). Block 0 is measured in it, its fp32 values put back exactly afterwards, so the messages
        printed are the sizes the run will send.
        """
        params = list(next(iter(self.model.transformer.h)).parameters())
        param_dtype = param_dtype or params[0].dtype
        originals = [p.data for p in params]
        try:
            for p in params:
                p.data = p.data.to(param_dtype)
            measured = measure_block_messages(self.model, self.ctx, micro, seq, autocast)
        finally:
            for p, original in zip(params, originals):
                p.data = original
        return accounting_lines(self.model.config, micro, seq, self.ctx.size, self.sequence_parallel,
                                param_dtype.itemsize, compute_bytes, state_bytes_per_param, measured=measured,
                                split_mlp=isinstance(next(iter(self.model.transformer.h)).mlp, MLP))

    def step_messages(self, micro: int, seq: int, micro_batches: int = 1, compute_bytes: int | None = None,
                      sp_grad_bytes: int | None = None, param_bytes: int | None = None):
        """Predicted {op: (calls, payload bytes)} on the TP group for one optimizer step; see `step_messages`.

        sp_grad_bytes: the payload of the SP gradient sum (the layout's grad_pieces of the SP parameters);
        by default their whole gradients.
        """
        param_bytes = param_bytes or next(self.model.parameters()).element_size()
        if sp_grad_bytes is None:
            sp_grad_bytes = sum(p.numel() for p in self.sequence_parallel_params) * param_bytes
        return step_messages(self.model.config, micro, seq, self.ctx.size, self.sequence_parallel,
                             micro_batches, param_bytes, compute_bytes or param_bytes, sp_param_bytes=sp_grad_bytes,
                             n_blocks=len(self.model.transformer.h), embedding=self.model.has_embedding,
                             head=self.model.has_head,
                             unsplit_mlp_blocks=sum(not isinstance(b.mlp, MLP) for b in self.model.transformer.h),
                             regather=all(b.attn.c_attn.regather for b in self.model.transformer.h))

    # The axis protocol train.py talks to (`apply` fills `run` and the start-up lines).

    def startup_lines(self) -> list:
        return self._startup_lines

    def predicted_messages(self, layout) -> dict:
        run = self.run
        sp_bytes = sum(g.numel() * g.element_size() for g in layout.grad_pieces(self.sequence_parallel_params))
        # Under context parallel a rank holds s/C tokens of each sequence (applied after TP, it cuts the batch).
        messages = self.step_messages(run.micro_batch_size, run.seq_len // run.mesh.size("cp"), run.micro_batches,
                                      run.compute_dtype.itemsize, sp_grad_bytes=sp_bytes,
                                      param_bytes=run.param_dtype.itemsize)
        return {(op, "tp"): value for op, value in messages.items()}



@dataclass(frozen=True)
class TPConfig:
    """--tp T and --sp: validated by config_from_flags."""

    size: int  # T
    sequence_parallel: bool = False


def config_from_flags(args, settings) -> TPConfig | None:
    """TP's flags on this model, or ValueError naming the flag (before any process group)."""
    if args.sp and args.tp == 1:
        raise ValueError("--sp (sequence parallel) needs --tp > 1")
    if args.tp == 1:
        return None
    check_divisible(settings.model, args.tp, settings.seq_len, args.sp)
    return TPConfig(args.tp, args.sp)


def apply(model: GPT, run, config: TPConfig) -> TensorParallel:
    """--tp T (and --sp): split the model over the TP group."""
    handle = parallelize(model, run.mesh.group("tp"), config.sequence_parallel, seed=run.seed)
    handle.run = run
    # Block 0's messages are measured now, before a layout installs gradient hooks, in the working dtype
    # the layout will train in (ZeRO's bf16 weights), so the printed sizes are those the run sends.
    handle._startup_lines = handle.startup_lines_measured(run.micro_batch_size, run.seq_len // run.mesh.size("cp"),
                                                          run.compute_dtype.itemsize, run.autocast, run.param_dtype)
    return handle


def parallelize(model: GPT, group, sequence_parallel: bool = False, seed: int = 0) -> TensorParallel:
    """Swap the plain GPT's linears, embedding and head for their tensor-parallel versions, in place.

    Every rank of `group` calls this with the same model config and seed; rank t keeps slice t of every
    split parameter, taken from the per-parameter deterministic init (`seed` must be the one the model was
    built with). Replicated parameters (LayerNorms, position embedding) stay as they are. With dropout, the
    caller seeds the default generator alike on the ranks of a TP group (see TensorParallelRNG).
    """
    config = model.config
    ctx = TensorParallelContext(group, dist.get_world_size(group), dist.get_rank(group), sequence_parallel)
    check_divisible(config, ctx.size)
    rng = TensorParallelRNG(ctx.rank, next(model.parameters()).device)
    untouched = set(model.parameters())  # holds them: an id() of a freed tensor could be reused
    sp_params = []
    for block in model.transformer.h:  # the blocks this model (or pipeline stage) holds
        prefix = f"transformer.h.{block.layer_id}"
        regather = not config.activation_checkpointing
        block.attn.c_attn = _column(block.attn.c_attn, f"{prefix}.attn.c_attn", ctx, config, seed, segments=3,
                                    regather=regather)
        block.attn.c_proj = _row(block.attn.c_proj, f"{prefix}.attn.c_proj", ctx, config, seed)
        if isinstance(block.mlp, MLP):  # a mixture of experts stays whole on every TP rank (moe.py)
            block.mlp.c_fc = _column(block.mlp.c_fc, f"{prefix}.mlp.c_fc", ctx, config, seed, regather=regather)
            block.mlp.c_proj = _row(block.mlp.c_proj, f"{prefix}.mlp.c_proj", ctx, config, seed)
        block.attn.attention_fn = ForkedAttention(block.attn.attention_fn, rng)
        block.attn.resid_dropout = ForkedDropout(block.attn.resid_dropout, ctx, rng)
        block.mlp.dropout = ForkedDropout(block.mlp.dropout, ctx, rng)
        sp_params += [*block.ln_1.parameters(), *block.ln_2.parameters()]
        row_biases = [block.attn.c_proj.bias] + ([block.mlp.c_proj.bias] if isinstance(block.mlp, MLP) else [])
        sp_params += [p for p in row_biases if p is not None]
    # Tied embedding and head: ONE vocabulary-split parameter, used by both (a pipeline stage holding only
    # one of them has its own copy, named transformer.wte.weight as well).
    vocab_shard = _shard("transformer.wte.weight", (config.vocab_size, config.n_embd), 0, ctx)
    vocab_start = ctx.rank * (config.vocab_size // ctx.size)
    like = next(model.parameters())
    with torch.device("meta"):
        embedding = nn.Embedding(config.vocab_size // ctx.size, config.n_embd)
        head = nn.Linear(config.n_embd, config.vocab_size // ctx.size, bias=False)
    vocab_weight = _param(vocab_shard, config, seed, like)
    if model.has_embedding:
        embedding.weight = vocab_weight
        model.transformer.wte = VocabParallelEmbedding(embedding, ctx, vocab_start)
        model.transformer.drop = ForkedDropout(model.transformer.drop, ctx, rng)
        if sequence_parallel:
            model.transformer.wpe = SequenceParallelPositions(model.transformer.wpe, ctx)
            sp_params.append(model.transformer.wpe.embedding.weight)
    if model.has_head:
        head.weight = embedding.weight if model.has_embedding else vocab_weight
        model.lm_head = ColumnParallelLinear(head, ctx)
        model.loss_fn = VocabParallelLoss(ctx, vocab_start)
        sp_params += [*model.transformer.ln_f.parameters()]
    if not sequence_parallel:
        sp_params = []
    for param in model.parameters():  # what TP did not split, every TP rank holds a copy of
        if param in untouched:
            param.shard_info = param.shard_info.replicated_also_over("tp")
    return TensorParallel(model, ctx, sp_params, rng)


# ---------------------------------------------------------------------------------------------------------
# Accounting
# ---------------------------------------------------------------------------------------------------------


def param_counts(config: GPTConfig, tp: int) -> dict:
    """Parameters of the logical model split T ways and replicated, and those one rank holds."""
    h, L, V, bias = config.n_embd, config.n_layer, config.vocab_size, int(config.bias)
    split = V * h + L * (3 * h * h + 3 * h * bias + h * h + 4 * h * h + 4 * h * bias + 4 * h * h)
    # LayerNorms: weight (+ bias) each, two per block; row-parallel biases: two per block; ln_f.
    replicated = config.block_size * h + L * (2 * h * (1 + bias) + 2 * h * bias) + h * (1 + bias)
    return {"split": split, "replicated": replicated, "global": split + replicated,
            "per_rank": split // tp + replicated}


def block_messages(micro: int, seq: int, h: int, sequence_parallel: bool, param_bytes: int, compute_bytes: int,
                   regather: bool = True, split_mlp: bool = True):
    """One block's critical-path messages for one micro-batch: [(phase, op, payload bytes)], group tp.

    Without SP, f moves the gradient of the LayerNorm's output (parameter dtype: autocast casts inside the
    linear, after f) and g a linear's output (compute dtype). With SP everything moves compute-dtype data:
    the shard is cast before its all-gather. The backward of each moves the gradient of the same tensor.
    """
    enter, leave = micro * seq * h * param_bytes, micro * seq * h * compute_bytes
    full = leave
    backward_column = [("backward", "all_gather_single", full)] if regather else []  # re-gather the input
    if not split_mlp:  # a mixture of experts is not split by TP: the attention's messages only
        if not sequence_parallel:
            return [("forward", "all_reduce", leave), ("backward", "all_reduce", enter)]
        return [("forward", "all_gather_single", full), ("forward", "reduce_scatter_single", full),
                ("backward", "all_gather_single", full), *backward_column, ("backward", "reduce_scatter_single", full)]
    if not sequence_parallel:
        return [("forward", "all_reduce", leave), ("forward", "all_reduce", leave),  # g after attn, mlp
                ("backward", "all_reduce", enter), ("backward", "all_reduce", enter)]  # f before mlp, attn
    return [("forward", "all_gather_single", full), ("forward", "reduce_scatter_single", full),
            ("forward", "all_gather_single", full), ("forward", "reduce_scatter_single", full),
            ("backward", "all_gather_single", full),  # mlp.c_proj's ḡ
            *backward_column, ("backward", "reduce_scatter_single", full),  # c_fc: weight grad, then g's RS
            ("backward", "all_gather_single", full),  # attn.c_proj's ḡ
            *backward_column, ("backward", "reduce_scatter_single", full)]  # c_attn


def step_messages(config: GPTConfig, micro: int, seq: int, tp: int, sequence_parallel: bool,
                  micro_batches: int = 1, param_bytes: int = 4, compute_bytes: int = 4,
                  sp_param_bytes: int = 0, n_blocks: int | None = None, embedding: bool = True,
                  head: bool = True, unsplit_mlp_blocks: int = 0, regather: bool | None = None) -> dict:
    """Predicted TP-group messages of one optimizer step: {op: (calls, payload bytes)} (docstring item 3).

    n_blocks, embedding, head: what this rank holds (a pipeline stage holds a few blocks, maybe one end);
    unsplit_mlp_blocks of them have an MLP that TP does not split (a mixture of experts). regather: whether
    SP's column layers gather their input again in backward (default: unless activation checkpointing; FP8
    keeps the gathered input instead)."""
    regather = not config.activation_checkpointing if regather is None else regather
    out = {}

    def add(op, payload, calls=1):
        c, b = out.get(op, (0, 0))
        out[op] = (c + calls, b + calls * payload)

    h, tokens = config.n_embd, micro * seq
    loss_bytes = max(4, compute_bytes)  # the softmax runs in at least fp32
    for _ in range(micro_batches):
        blocks = config.n_layer if n_blocks is None else n_blocks
        for index in range(blocks):
            split_mlp = index >= unsplit_mlp_blocks
            msgs = block_messages(micro, seq, h, sequence_parallel, param_bytes, compute_bytes,
                                  regather=regather, split_mlp=split_mlp)
            if config.activation_checkpointing:
                # Backward recomputes the block's forward, messages included, but torch's non-reentrant
                # checkpoint stops as soon as every saved tensor is back: the MLP's final reduction feeds
                # nothing saved, so it is not repeated (a mixture of experts saves what follows the attention's).
                forward = [m for m in msgs if m[0] == "forward"]
                msgs += forward[:-1] if split_mlp else forward
            for _, op, payload in msgs:
                add(op, payload)
        act, head_act = tokens * h * param_bytes, tokens * h * compute_bytes
        if embedding:
            if sequence_parallel:
                add("reduce_scatter_single", act), add("all_gather_single", act)  # embedding: fwd, bwd
            else:
                add("all_reduce", act)  # embedding forward (g)
        if head:
            if sequence_parallel:
                add("all_gather_single", head_act, calls=2), add("reduce_scatter_single", head_act)  # fwd, re-gather, bwd
            else:
                add("all_reduce", act)  # head backward (f)
            add("all_reduce", tokens * loss_bytes)  # loss: MAX
            add("all_reduce", 2 * tokens * loss_bytes)  # loss: Σexp and target logit
    if sequence_parallel and sp_param_bytes:
        add("all_reduce", sp_param_bytes)  # after_grad_sync: the SP parameters' gradients (as the layout holds them)
    return out


def activation_estimates(config: GPTConfig, micro: int, seq: int, tp: int) -> dict:
    """Korthikanti et al. 2022 activation bytes per layer (16-bit): unsplit, TP, TP + SP."""
    from mfu import activation_bytes_per_layer

    args = (seq, micro, config.n_embd, config.n_head)
    return {"none": activation_bytes_per_layer(*args), "tp": activation_bytes_per_layer(*args, t=tp),
            "tp_sp": activation_bytes_per_layer(*args, t=tp, sequence_parallel=True)}


def _by_phase_and_op(messages) -> dict:
    out = {}
    for phase, op, payload in messages:
        calls, total = out.get((phase, op), (0, 0))
        out[(phase, op)] = (calls + 1, total + payload)
    return out


@torch.no_grad()
def _clear_grads(module: nn.Module):
    for p in module.parameters():
        p.grad = None


def measure_block_messages(model: GPT, ctx: TensorParallelContext, micro: int, seq: int, autocast) -> dict:
    """Run block 0's forward and backward once on random input under a CommTracer: {(phase, op): (calls, bytes)}.

    Call it before any gradient hook is installed (DDP): it leaves no gradient behind.
    """
    from comm import CommTracer

    block = next(iter(model.transformer.h))
    param = next(block.parameters())
    local_seq = seq // ctx.size if ctx.sequence_parallel else seq
    generator = torch.Generator(device=param.device).manual_seed(0)  # leaves the global RNG alone
    x = torch.randn(micro, local_seq, model.config.n_embd, generator=generator, device=param.device,
                    dtype=param.dtype, requires_grad=True)
    tracer = CommTracer()
    tracer.name_group(ctx.group, "tp")
    measured = {}
    with tracer:
        with autocast:
            out = block(x)
    measured.update({("forward", op): (r.calls, r.payload_bytes) for (op, g), r in tracer.records.items()
                     if g == "tp"})
    tracer.reset()
    with tracer:
        out.float().sum().backward()
    measured.update({("backward", op): (r.calls, r.payload_bytes) for (op, g), r in tracer.records.items()
                     if g == "tp"})
    _clear_grads(block)
    return measured


def accounting_lines(config: GPTConfig, micro: int, seq: int, tp: int, sequence_parallel: bool,
                     param_bytes: int = 4, compute_bytes: int = 4, state_bytes_per_param: int = 16,
                     measured: dict | None = None, split_mlp: bool = True) -> list:
    """The startup printout: per-block messages (predicted, and measured when given), parameters per rank,
    activation estimates. split_mlp: whether the measured block's MLP is TP-split (a MoE block's is not)."""
    from mfu import format_bytes

    lines = [f"tensor parallel T={tp}{' + sequence parallel' if sequence_parallel else ''}: messages per block and"
             f" micro-batch (b={micro}, s={seq}, h={config.n_embd}), on the critical path, group tp:"]
    predicted = _by_phase_and_op(block_messages(micro, seq, config.n_embd, sequence_parallel, param_bytes,
                                                compute_bytes, regather=not config.activation_checkpointing,
                                                split_mlp=split_mlp))
    for (phase, op), (calls, payload) in predicted.items():
        line = f"  {phase:<8} {op:<22} predicted {calls} × {format_bytes(payload / calls):>10}"
        if measured is not None:
            m_calls, m_payload = measured.get((phase, op), (0, 0))
            line += f"   measured {m_calls} × {format_bytes(m_payload / max(1, m_calls)):>10}"
        lines.append(line)
    if measured is not None:
        for (phase, op), (m_calls, m_payload) in measured.items():
            if (phase, op) not in predicted:
                lines.append(f"  {phase:<8} {op:<22} predicted 0   measured {m_calls} × {format_bytes(m_payload)}")
    counts = param_counts(config, tp)
    act = activation_estimates(config, micro, seq, tp)
    lines.append(f"  parameters per rank: {counts['per_rank']:,} of {counts['global']:,}"
                 f" ({counts['split']:,} split /T + {counts['replicated']:,} replicated) ="
                 f" {format_bytes(counts['per_rank'] * param_bytes)} weights,"
                 f" {format_bytes(counts['per_rank'] * state_bytes_per_param)} with grads and AdamW")
    chosen = act["tp_sp"] if sequence_parallel else act["tp"]
    lines.append(f"  activations per layer (Korthikanti, 16-bit): unsplit sbh(34+5as/h) = {format_bytes(act['none'])};"
                 f" TP sbh(10+24/t+5as/(ht)) = {format_bytes(act['tp'])}; TP+SP (sbh/t)(34+5as/h) ="
                 f" {format_bytes(act['tp_sp'])}; this run {format_bytes(chosen)} × L={config.n_layer}"
                 f" = {format_bytes(chosen * config.n_layer)}")
    return lines
