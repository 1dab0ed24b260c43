"""Context parallel: the sequence split over C ranks; ring attention (zig-zag) and Ulysses all-to-all attention.

C ranks (the `cp` group) each hold a piece of every sequence of the micro-batch. Everything outside attention
works token by token, so it runs on the local piece unchanged; only attention needs the other tokens:
  * ring (Liu et al. 2023, "Ring Attention"; zig-zag as in zhuzilin's ring-flash-attention): K,V blocks
    travel round the ring, C steps; each step POSTS the next block's send/receive and then computes the
    current block, merging it into the output with the online-softmax log-sum-exp update (in fp32, or fp64
    for fp64 inputs: the local queries are cast once per pass, each arriving block once per hop, and the
    diagonal block's causal mask is built once per pass). The backward is an explicit autograd Function:
    K,V travel the ring again and the dK,dV accumulators travel one hop behind them, arriving home after C
    steps.
  * Ulysses (Jacobs et al. 2023, DeepSpeed-Ulysses): all-to-all from sequence-split to head-split, ordinary
    causal attention on whole sequences for a/(T·C) heads, all-to-all back.

The layout (`--cp-balance`). The sequence of s tokens is cut into 2C chunks and rank c holds chunks c and
2C−1−c (`zigzag`): under the causal mask every rank then attends exactly the same number of (query, key) pairs.
`contiguous` gives rank c the c-th s/C tokens: the last rank attends ~2C−1 times the first one's pairs (see
`causal_work`). The model gets the GLOBAL positions of its tokens (`model.forward(..., pos=...)`). Targets are
shifted on the whole sequence by the sampler, so x and y are cut alike (`ContextParallel.shard_batches`).

Symbols: s sequence length (whole), b micro-batch, h hidden, a heads, T tensor-parallel size, C = --cp,
L layers held, m micro-batches per step, e_c bytes of a compute-dtype element (q, k, v: 2 under bf16
autocast), e_a bytes of an accumulator element (4; 8 for fp64 inputs).

1. Replicated and split. Every parameter is replicated over the C ranks; each rank's loss covers only its
   tokens, so the layout sums gradients over the dp×cp group (nothing CP-specific after that reduction: the
   handle has no `after_grad_sync` of its own). Split: the sequence, hence every activation (s/C tokens).
   Ulysses splits heads inside attention.
2. Peak per device. Parameters and optimizer as without CP (ZeRO shards them over dp×cp). Activations per
   layer and micro-batch, Korthikanti et al. 2022 divided by C: (s/C)·b·h·(34 + 5·a·s/h) at 16 bits. The
   attention here keeps no score matrix (it saves q, k, v, its output and the log-sum-exp, as a flash
   kernel does) and dropout is 0 (no 1-byte masks), so the measured figure is ≈ 32·(s/C)·b·h at 16 bits
   (block 0 measured at start-up, `measure.measure_block`, and printed next to both; Ulysses keeps the
   output twice, head-split and back, +2·(s/C)·b·h). Temporaries, ring: the K,V block in use and the one
   arriving, 2 × 2·(s/C)·b·(h/T)·e_c, and the block's wide copy 2·(s/C)·b·(h/T)·e_a (none when e_c = e_a);
   the wide scaled queries (s/C)·b·(h/T)·e_a; one score block b·(a/T)·(s/C)²·e_a (two in backward: p and
   ds); in backward also two dK,dV accumulators 2 × 2·(s/C)·b·(h/T)·e_a, dq and the wide d output.
   Ulysses: head-split q, k, v, out (the bytes of the local ones) and the inner attention's own temporaries
   on the whole s for a/(T·C) heads.
3. Critical path, per layer and micro-batch, group cp (payload M per call; p2p traced as "send"/"recv";
   `layer_messages`):
     ring forward:  (C−1) × send + recv of the stacked [K; V], 2·(s/C)·b·(h/T)·e_c each, posted before the
                    step's compute: hidden when a block's compute outlasts its transfer.
     ring backward: (C−1) × send + recv of [K; V] as above, and C × send + recv of [dK; dV],
                    2·(s/C)·b·(h/T)·e_a each; the last one brings this rank's own dK,dV home and is exposed.
     Ulysses:       forward 4 × all_to_all_single of (s/C)·b·(h/T)·e_c (q, k, v, then the output);
                    backward 4 × the same (d output, then dq, dk, dv). Blocking: nothing is hidden.
   Activation checkpointing repeats the forward's messages in backward; selective recompute (Ulysses only:
   parallel/recompute.py) does not: its all-to-alls run as collective_ops operators it keeps. Per step: × L × m. How
   much ring time was hidden is measured over the training passes by whoever observes the ring (`RingObserver`: the
   accounting's clock, time blocked in wait() against the same transfers timed alone; report/axes.py prints
   it). It is a lower bound: a wait also lasts while a slower peer computes.
4. Restart state: nothing of its own. Parameters are replicated over cp and a rank's positions depend only on
   (s, C, c), so a checkpoint resumes on any C.

Dropout inside attention is REFUSED (a ValueError naming --dropout and --cp from `config_from_flags`;
`parallelize` refuses a model whose attention has dropout): the masks of a ring run would have to be drawn per
(query block, key block) and replayed by the backward, and would still not match the single device's.
--dropout also sets the residual dropouts, so --cp runs with --dropout 0, where everything is exact. The
attention is kept out of torch.compile graphs (it talks).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist

from parallel import collectives
from shard import positions
from step import Axis, Messages

IMPLS, BALANCES = ("ring", "ulysses"), ("zigzag", "contiguous")


# Which tokens a rank holds: shard.positions (zig-zag by default, or contiguous).


# ---------------------------------------------------------------------------------------------------------
# One block of attention, forward and backward (what a flash kernel computes; written out, no score is kept)
# ---------------------------------------------------------------------------------------------------------


def causal_mask(length: int, device) -> torch.Tensor:
    """The diagonal block's mask, True where local query i would see a later local key j > i."""
    return torch.ones(length, length, dtype=torch.bool, device=device).triu(1)


def _block_forward(q_hat, k, v, mask):
    """Softmax attention of the queries over ONE block of keys: (out [B,H,Lq,D], lse [B,H,Lq]).

    q_hat = q/sqrt(d), already in the wide dtype, as are k and v (the caller casts each once): s = q_hat·kᵀ.
    mask: `causal_mask` for the diagonal block, None for a block wholly in the queries' past.
    """
    s = torch.matmul(q_hat, k.transpose(-2, -1))
    if mask is not None:
        s.masked_fill_(mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(s.sub_(lse.unsqueeze(-1)).exp_(), v), lse  # p = exp(s − lse), in place of s


def _token_major(x: torch.Tensor) -> torch.Tensor:
    """x [B, H, L, D] stored as [B, L, H, D]: the model's next step (transpose, reshape for c_proj) is then a
    view, so c_proj saves the very storage attention saved (one copy of the output per layer, not two)."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _merge(out, lse, block_out, block_lse) -> None:
    """Online softmax: fold a block's (out, lse) into the running ones, in place (out, lse may be views)."""
    new = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - new).unsqueeze(-1))
    lse.copy_(new)


def _block_backward(dout, q_hat, k, v, lse, delta, mask):
    """Gradients of one block with respect to (q_hat, k, v), given the FULL softmax's lse and
    delta = rowsum(dout·out); every input wide, q_hat = q/sqrt(d) (so dq = dq_hat/sqrt(d), taken once per pass).

    p = exp(q_hat·kᵀ − lse) is this block's share of the whole softmax; dv = pᵀ·dout;
    ds = p ∘ (dout·vᵀ − delta); dq_hat = ds·k; dk = dsᵀ·q_hat.
    """
    s = torch.matmul(q_hat, k.transpose(-2, -1))
    if mask is not None:
        s.masked_fill_(mask, float("-inf"))
    p = s.sub_(lse.unsqueeze(-1)).exp_()
    ds = torch.matmul(dout, v.transpose(-2, -1)).sub_(delta.unsqueeze(-1)).mul_(p)
    return torch.matmul(ds, k), torch.matmul(ds.transpose(-2, -1), q_hat), torch.matmul(p.transpose(-2, -1), dout)


# ---------------------------------------------------------------------------------------------------------
# Ring attention
# ---------------------------------------------------------------------------------------------------------


class RingObserver:
    """Who watches the ring: told when a pass begins and ends (phase "forward" or "backward") and when the ring
    blocks on its transfers (phase "wait"). Nobody by default; the accounting subscribes its clock
    (`ContextParallel.observe`, observers.WaitClock), which decides which passes belong to training."""

    def begin(self, phase: str) -> None:
        pass

    def end(self, phase: str) -> None:
        pass


class Ring:
    """Send to the next rank of the cp group, receive from the previous one; `observer` watches its passes."""

    def __init__(self, group):
        self.group, self.size, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)
        self.observer = RingObserver()

    def post(self, tensor: torch.Tensor, tag: int = 0):
        """Start sending `tensor` on and receiving the previous rank's into a new buffer: (buffer, works)."""
        if self.size == 1:
            return tensor, []  # a ring of one hands the block to itself
        received = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor, self.next, self.group, tag),
               dist.P2POp(dist.irecv, received, self.prev, self.group, tag)]
        return received, dist.batch_isend_irecv(ops)

    def wait(self, transfer) -> torch.Tensor:
        received, works = transfer
        self.observer.begin("wait")
        for work in works:  # one work per op: wait on every one
            work.wait()
        self.observer.end("wait")
        return received


def block_case(rank: int, source: int, length: int, balance: str):
    """Which local queries attend to which keys of the block that started on rank `source`, at which mask.

    Returns (query rows, key columns, causal) as slices of the local length, or None (skipped).
    Zig-zag: rank r holds chunks (r, 2C−1−r) of 2C, each of length/2 tokens; so does `source`:
      source == r: the diagonal block, the local causal mask (both chunks ascend: tril over 2 chunks);
      source <  r: chunk `source` precedes both of ours and chunk 2C−1−source follows both: ALL queries ×
                   the FIRST half of the keys, no mask ("lower half", half the work);
      source >  r: only our late chunk 2C−1−r follows anything of source's, and it follows both its chunks:
                   the SECOND half of the queries × ALL keys, no mask ("upper half", half the work).
    Contiguous: the diagonal block causal; an earlier source in full; a later source skipped.
    """
    everything, half = slice(0, length), length // 2
    if source == rank:
        return everything, everything, True
    if balance == "contiguous":
        return (everything, everything, False) if source < rank else None
    if source < rank:
        return everything, slice(0, half), False
    return slice(half, length), everything, False


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The accumulators' dtype: fp64 for fp64 inputs, else fp32 (bf16/fp16 inputs are cast up)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def ring_attention_forward(q, k, v, ring: Ring, balance: str):
    """Causal attention of the local queries over the whole sequence: (out in q's dtype, lse wide).

    q, k, v: [B, H, L, D], this rank's L = s/C tokens. The stacked [K; V] block goes round the ring in the
    compute dtype; the local queries are cast (and scaled) once, each arriving block once, the mask built once.
    """
    wide = _wide(q.dtype)
    q_hat = q.to(wide) * q.shape[-1] ** -0.5
    mask = causal_mask(q.shape[2], q.device)
    out = torch.zeros(q.shape, dtype=wide, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=wide, device=q.device)
    kv = torch.stack([k, v])  # one message per step: [2, B, H, L, D]
    for step in range(ring.size):
        if step + 1 < ring.size:
            arriving = ring.post(kv)  # the next block's transfer runs while this one computes
        case = block_case(ring.rank, (ring.rank - step) % ring.size, q.shape[2], balance)
        if case is not None:
            rows, cols, causal = case
            k_block, v_block = kv[:, :, :, cols].to(wide)
            block_out, block_lse = _block_forward(q_hat[:, :, rows], k_block, v_block, mask if causal else None)
            _merge(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
        if step + 1 < ring.size:
            kv = ring.wait(arriving)
    return _token_major(out.to(q.dtype)), lse


def ring_attention_backward(dout, q, k, v, out, lse, ring: Ring, balance: str):
    """(dq, dk, dv) of ring attention. K,V travel the ring again; the [dK; dV] accumulator of the block a
    rank holds travels with it one hop behind: each rank adds its queries' share and passes it on, so after
    C steps every accumulator is back on its own rank, complete."""
    wide = lse.dtype
    scale = q.shape[-1] ** -0.5
    q_hat, dout = q.to(wide) * scale, dout.to(wide)  # cast once per pass, as in the forward
    delta = (dout * out.to(wide)).sum(-1)  # rowsum(dO·O): the softmax backward's row term
    mask = causal_mask(q.shape[2], q.device)
    dq_hat = torch.zeros(q.shape, dtype=wide, device=q.device)
    kv, dkv_transfer = torch.stack([k, v]), None
    for step in range(ring.size):
        if step + 1 < ring.size:
            arriving = ring.post(kv)
        case = block_case(ring.rank, (ring.rank - step) % ring.size, q.shape[2], balance)
        if case is not None:
            rows, cols, causal = case
            k_block, v_block = kv[:, :, :, cols].to(wide)
            block_dq, block_dk, block_dv = _block_backward(dout[:, :, rows], q_hat[:, :, rows], k_block, v_block,
                                                           lse[:, :, rows], delta[:, :, rows], mask if causal else None)
            dq_hat[:, :, rows] += block_dq
        # The accumulator of the block we hold: fresh at step 0, else it arrives from the previous rank.
        dkv = torch.zeros((2, *k.shape), dtype=wide, device=k.device) if step == 0 else ring.wait(dkv_transfer)
        if case is not None:
            dkv[0][:, :, cols] += block_dk
            dkv[1][:, :, cols] += block_dv
        dkv_transfer = ring.post(dkv, tag=1)  # on to the next rank (after the last step: home)
        if step + 1 < ring.size:
            kv = ring.wait(arriving)
    dkv = ring.wait(dkv_transfer)
    return (dq_hat * scale).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class RingAttention(torch.autograd.Function):
    """The ring, forward and backward, as one autograd node: saves q, k, v, out and lse (no scores). The
    backward tells the ring's observer where it begins and ends; the forward's caller does (grad mode, which
    says evaluation from training, is off inside forward)."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, balance: str):
        with torch.autocast(q.device.type, enabled=False):
            out, lse = ring_attention_forward(q, k, v, ring, balance)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.balance = ring, balance
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ctx.ring.observer.begin("backward")
        with torch.autocast(q.device.type, enabled=False):
            dq, dk, dv = ring_attention_backward(dout, q, k, v, out, lse, ctx.ring, ctx.balance)
        ctx.ring.observer.end("backward")
        return dq, dk, dv, None, None


# ---------------------------------------------------------------------------------------------------------
# Ulysses
# ---------------------------------------------------------------------------------------------------------


def _seq_to_head(x, group, reorder, operators=False):
    """[B, H, L, D] (L of this rank's tokens, all heads) → [B, H/C, C·L, D] (all tokens, heads of this rank).

    Piece j of the heads goes to rank j; piece j received holds rank j's tokens. `reorder` (zig-zag) sorts
    the gathered tokens, which come in rank order, into sequence order, so the causal mask is the plain one.
    `operators`: the exchange through collective_ops (selective recompute keeps what it received).
    """
    size = dist.get_world_size(group)
    B, H, L, D = x.shape
    send = x.reshape(B, size, H // size, L, D).transpose(0, 1).contiguous()  # [C, B, H/C, L, D]
    received = _exchange(send, group, operators)
    full = received.permute(1, 2, 0, 3, 4).reshape(B, H // size, size * L, D)
    return full if reorder is None else full[:, :, reorder[0]]


def _exchange(send, group, operators: bool):
    """all_to_all_single of `send` into a new buffer: the raw call, or collective_ops' operator."""
    if operators:
        return collectives.all_to_all(send, group)
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return received


def _head_to_seq(y, group, reorder, operators=False):
    """The inverse of _seq_to_head: [B, H/C, s, D] → [B, H, s/C, D]."""
    size = dist.get_world_size(group)
    B, Hc, S, D = y.shape
    if reorder is not None:
        y = y[:, :, reorder[1]]  # back into rank order
    send = y.reshape(B, Hc, size, S // size, D).permute(2, 0, 1, 3, 4).contiguous()  # piece j: rank j's tokens
    received = _exchange(send, group, operators)
    # Heads of rank j come j-th; stored token-major, as the ring's output is.
    return received.permute(1, 3, 0, 2, 4).reshape(B, S // size, size * Hc, D).transpose(1, 2)


class SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, reorder, operators=False):
        ctx.group, ctx.reorder = group, reorder
        return _seq_to_head(x, group, reorder, operators)

    @staticmethod
    def backward(ctx, grad):
        return _head_to_seq(grad, ctx.group, ctx.reorder), None, None, None


class HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group, reorder, operators=False):
        ctx.group, ctx.reorder = group, reorder
        return _head_to_seq(y, group, reorder, operators)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_head(grad, ctx.group, ctx.reorder), None, None, None


def ulysses_attention(q, k, v, group, reorder, inner, operators=False):
    """4 all-to-alls forward (q, k, v in, the output back), 4 backward; `inner` is ordinary causal attention,
    without dropout, on whole sequences of the a/(T·C) heads (config_from_flags checked that they divide).
    `operators`: the forward's through collective_ops (under selective recompute)."""
    q, k, v = (SeqToHead.apply(t, group, reorder, operators) for t in (q, k, v))
    return HeadToSeq.apply(inner(q, k, v, 0.0), group, reorder, operators)


def zigzag_reorder(seq_len: int, cp: int, device=None):
    """(to sequence order, to rank order) index pairs for Ulysses' gathered tokens under zig-zag."""
    in_rank_order = torch.cat([positions(seq_len, cp, j) for j in range(cp)]).to(device)
    return torch.argsort(in_rank_order), in_rank_order


# ---------------------------------------------------------------------------------------------------------
# Wiring: the attention function, the flags, apply, the handle
# ---------------------------------------------------------------------------------------------------------


class ContextParallelAttention:
    """`block.attn.attention_fn` under CP. `inner` is the function it replaced (model.causal_attention, or
    tensor_parallel's ForkedAttention around it): Ulysses calls it on whole sequences; the ring does not.
    dropout_p is 0 (`parallelize` refused a model with attention dropout)."""

    def __init__(self, inner, ring: Ring, impl: str, balance: str, operators: bool = False):
        self.inner, self.ring, self.impl, self.balance, self.operators = inner, ring, impl, balance, operators
        self._reorder = {}

    @torch.compiler.disable  # p2p and all-to-all inside: never traced into a compiled graph
    def __call__(self, q, k, v, dropout_p: float):
        if self.impl == "ring":
            self.ring.observer.begin("forward")
            out = RingAttention.apply(q, k, v, self.ring, self.balance)
            self.ring.observer.end("forward")
            return out
        return ulysses_attention(q, k, v, self.ring.group, self._reorder_for(q.shape[2], q.device), self.inner,
                                 self.operators)

    def _reorder_for(self, local_len: int, device):
        if self.balance == "contiguous" or self.ring.size == 1:
            return None
        if local_len not in self._reorder:
            self._reorder[local_len] = zigzag_reorder(local_len * self.ring.size, self.ring.size, device)
        return self._reorder[local_len]


def parallelize(model, group, impl: str = "ring", balance: str = "zigzag") -> Ring:
    """Swap every held block's attention_fn for the CP one, in place; return the ring they share."""
    dropout = max([block.attn.dropout for block in model.transformer.h], default=0.0)
    if dropout > 0:
        raise ValueError(f"--dropout {dropout} with --cp: context-parallel attention has no attention dropout;"
                         f" build the model with --dropout 0")
    ring = Ring(group)
    for block in model.transformer.h:
        block.attn.attention_fn = ContextParallelAttention(block.attn.attention_fn, ring, impl, balance,
                                                           model.config.selective_recompute)
    return ring


@dataclass(frozen=True)
class CPConfig:
    """--cp C, --cp-impl, --cp-balance: validated by config_from_flags."""

    size: int  # C
    impl: str = "ring"
    balance: str = "zigzag"


def config_from_flags(args, settings) -> CPConfig | None:
    """CP's flags on this model and mesh (settings: flags.Settings), or a ValueError naming the flag, before any
    process group exists; None when --cp is 1."""
    cp, impl, balance = args.cp, args.cp_impl, args.cp_balance
    if not isinstance(cp, int) or cp < 1:
        raise ValueError(f"--cp must be a positive integer, got {cp!r}")
    if impl not in IMPLS:
        raise ValueError(f"--cp-impl {impl!r}: expected one of {', '.join(IMPLS)}")
    if balance not in BALANCES:
        raise ValueError(f"--cp-balance {balance!r}: expected one of {', '.join(BALANCES)}")
    if cp == 1:
        return None
    seq_len, n_head, tp, dropout = settings.seq_len, settings.model.n_head, settings.shape.tp, settings.model.dropout
    pieces = 2 * cp if balance == "zigzag" else cp
    if seq_len % pieces:
        raise ValueError(f"--seq-len {seq_len} must be divisible by {pieces} with --cp {cp} --cp-balance {balance}"
                         f" (the sequence is cut into {'2C' if balance == 'zigzag' else 'C'} = {pieces} equal chunks)")
    if impl == "ulysses" and (n_head % tp or (n_head // tp) % cp):
        raise ValueError(f"--cp-impl ulysses with --cp {cp}: the n_head/T = {n_head}/{tp} heads per tensor-parallel"
                         f" rank must be a whole number divisible by --cp {cp} (attention is split by heads)")
    if dropout > 0:
        raise ValueError(f"--dropout {dropout} with --cp {cp}: context-parallel attention has no attention dropout"
                         f" (masks per ring block, replayed in backward, are not implemented); use --dropout 0")
    if settings.sequence_parallel and (seq_len // cp) % tp:
        raise ValueError(f"--sp with --cp {cp}: the {seq_len // cp} tokens per CP rank (--seq-len {seq_len}) must"
                         f" split into --tp {tp} pieces")
    return CPConfig(cp, impl, balance)


@dataclass(frozen=True)
class LayerShape:
    """What one layer's cp messages depend on (`layer_messages`)."""

    micro: int  # b = B_μ, sequences per micro-batch
    seq_len: int  # s, the whole sequence
    width: int  # h/T, the hidden width this tensor-parallel rank's q, k, v have
    compute_bytes: int  # e_c
    checkpointing: bool = False  # activation checkpointing: backward recomputes the forward


def apply(model, run, config: CPConfig) -> ContextParallel:
    """The axis for train.py: after tensor_parallel (DESIGN's order), before PP/FP8/layout."""
    # e_c: the dtype c_attn's q, k, v will have, autocast's (run.compute_dtype, as TP's and MoE's), not a probe of
    # the parameters: they are meta before they are filled and under --plan, where autocast does nothing
    shape = LayerShape(run.micro_batch_size, run.seq_len, run.config.n_embd // run.mesh.size("tp"),
                       run.compute_dtype.itemsize, run.config.activation_checkpointing)
    ring = parallelize(model, run.mesh.group("cp"), config.impl, config.balance)
    return ContextParallel(model, ring, config, shape, run.micro_batches)


@dataclass(frozen=True)
class CPFacts:
    """What the accounting reads of the CP axis (`ContextParallel.facts`): report/axes.py's cp section and
    measure.time_ring_alone, which posts the transfers of one layer on the ring with no compute between them."""

    config: CPConfig
    shape: LayerShape
    ring: Ring


@dataclass
class ContextParallel(Axis):
    """The handle: cuts batches into this rank's tokens, gives sampling whole-sequence attention back, predicts
    the cp messages (report/axes.py's cp section prints them with the causal work, the activations, the ring's time)."""

    model: object
    ring: Ring
    config: CPConfig
    shape: LayerShape
    micro_batches: int = 1  # m
    name: ClassVar[str] = "cp"

    def shard_batches(self, batches) -> list:
        """[(x, y)] or [(x, y, pos)] of whole sequences → [(x, y, pos)] of this rank's tokens (pos global)."""
        out = []
        for batch in batches:
            x, y, pos = (*batch, None)[:3]
            seq_len = x.shape[1]
            index = positions(seq_len, self.ring.size, self.ring.rank, self.config.balance).to(x.device)
            pos = torch.arange(seq_len, device=x.device) if pos is None else pos
            out.append((x[:, index], y[:, index], pos[..., index]))
        return out

    @contextmanager
    def sampling(self):
        """Whole sequences on every rank (model.generate): the attention functions CP replaced, for the while."""
        blocks = list(self.model.transformer.h)
        swapped = [block.attn.attention_fn for block in blocks]
        try:
            for block, fn in zip(blocks, swapped):
                block.attn.attention_fn = fn.inner
            yield
        finally:
            for block, fn in zip(blocks, swapped):
                block.attn.attention_fn = fn

    def facts(self) -> CPFacts:
        return CPFacts(self.config, self.shape, self.ring)

    def observe(self, observer: RingObserver) -> None:
        """The ring tells `observer` (the accounting's observers.WaitClock) its passes and its waits."""
        self.observer = self.ring.observer = observer

    def layer_messages(self) -> dict:
        """{"forward" | "backward": Messages} of one layer and micro-batch: see `layer_messages`."""
        return layer_messages(self.config.impl, self.ring.size, self.shape)

    def predicted_messages(self, layout=None) -> Messages:
        """Per optimizer step: one layer's messages × L held layers × m micro-batches, group cp."""
        per_layer = self.layer_messages()
        return (per_layer["forward"] + per_layer["backward"]).times(len(self.model.transformer.h) * self.micro_batches)


# ---------------------------------------------------------------------------------------------------------
# Pure prediction formulas (items 2 and 3 of the docstring)
# ---------------------------------------------------------------------------------------------------------


def accumulator_bytes(compute_bytes: int) -> int:
    """e_a: fp64 accumulators for fp64 inputs, else fp32 (as `_wide`)."""
    return 8 if compute_bytes == 8 else 4


def layer_messages(impl: str, cp: int, shape: LayerShape) -> dict:
    """One layer's cp-group messages for one micro-batch, per phase: {"forward" | "backward": Messages}."""
    forward, backward = Messages(), Messages()
    tokens = shape.micro * shape.seq_len // cp
    if cp > 1 and impl == "ring":
        kv, dkv = (2 * tokens * shape.width * e for e in (shape.compute_bytes, accumulator_bytes(shape.compute_bytes)))
        for op in ("send", "recv"):
            forward.add(op, "cp", cp - 1, (cp - 1) * kv)  # [K; V] to the next rank, C−1 hops
            backward.add(op, "cp", cp - 1, (cp - 1) * kv).add(op, "cp", cp, cp * dkv)  # and [dK; dV], C hops
    elif cp > 1:
        piece = tokens * shape.width * shape.compute_bytes
        forward.add("all_to_all_single", "cp", 4, 4 * piece)  # q, k, v to head-split; the output back
        backward.add("all_to_all_single", "cp", 4, 4 * piece)  # d output; dq, dk, dv back
    if shape.checkpointing:  # backward recomputes the forward, messages included
        backward = backward + forward
    return {"forward": forward, "backward": backward}


def causal_work(seq_len: int, cp: int) -> dict:
    """{balance: [(query, key) pairs rank c attends under the causal mask, for each c]}: token p sees p+1 keys."""
    return {balance: [int((positions(seq_len, cp, c, balance) + 1).sum()) for c in range(cp)] for balance in BALANCES}
