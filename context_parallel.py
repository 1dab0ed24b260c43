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
   tokens, so the layout sums gradients over the dp×cp group (nothing CP-specific: `after_grad_sync` is
   empty). Split: the sequence, hence every activation (s/C tokens). Ulysses splits heads inside attention.
2. Peak per device. Parameters and optimizer as without CP (ZeRO shards them over dp×cp). Activations per
   layer and micro-batch, Korthikanti et al. 2022 divided by C: (s/C)·b·h·(34 + 5·a·s/h) at 16 bits. The
   attention here keeps no score matrix (it saves q, k, v, its output and the log-sum-exp, as a flash
   kernel does) and dropout is 0 (no 1-byte masks), so the measured figure is ≈ 32·(s/C)·b·h at 16 bits
   (`saved_activation_bytes`, measured per layer at start-up and printed next to both; Ulysses keeps the
   output twice, head-split and back, +2·(s/C)·b·h). Temporaries, ring: the K,V block in use and the one
   arriving, 2 × 2·(s/C)·b·(h/T)·e_c, and the block's wide copy 2·(s/C)·b·(h/T)·e_a (none when e_c = e_a);
   the wide scaled queries (s/C)·b·(h/T)·e_a; one score block b·(a/T)·(s/C)²·e_a (two in backward: p and
   ds); in backward also two dK,dV accumulators 2 × 2·(s/C)·b·(h/T)·e_a, dq and the wide d output.
   Ulysses: head-split q, k, v, out (the bytes of the local ones) and the inner attention's own temporaries
   on the whole s for a/(T·C) heads.
3. Critical path, per layer and micro-batch, group cp (payload M per call; p2p traced as "send"/"recv"):
     ring forward:  (C−1) × send + recv of the stacked [K; V], 2·(s/C)·b·(h/T)·e_c each, posted before the
                    step's compute: hidden when a block's compute outlasts its transfer.
     ring backward: (C−1) × send + recv of [K; V] as above, and C × send + recv of [dK; dV],
                    2·(s/C)·b·(h/T)·e_a each; the last one brings this rank's own dK,dV home and is exposed.
     Ulysses:       forward 4 × all_to_all_single of (s/C)·b·(h/T)·e_c (q, k, v, then the output);
                    backward 4 × the same (d output, then dq, dk, dv). Blocking: nothing is hidden.
   Activation checkpointing repeats the forward's messages in backward. Per step: × L × m. How much ring time
   was hidden is measured over the training steps' passes (`Ring.timed`: time blocked in wait() against the
   same transfers timed alone). It is a lower bound: a wait also lasts while a slower peer computes.
4. Restart state: nothing of its own. Parameters are replicated over cp and a rank's positions depend only on
   (s, C, c), so a checkpoint resumes on any C.

Dropout inside attention is REFUSED (a ValueError naming --dropout and --cp, from check_flags and at the
call): the masks of a ring run would have to be drawn per (query block, key block) and replayed by the
backward, and would still not match the single device's. --dropout also sets the residual dropouts, so --cp
runs with --dropout 0, where everything is exact. The attention is kept out of torch.compile graphs (it talks).

`saved_activation_bytes` wraps mfu.SavedActivations (a saved_tensors_hooks measurement, each storage counted
once), which train.py also uses to measure the first micro-batch of every layout.
"""

from __future__ import annotations

import os
import statistics
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from model import materialize
from mfu import SavedActivations
from step import Axis

IMPLS, BALANCES = ("ring", "ulysses"), ("zigzag", "contiguous")

# ---------------------------------------------------------------------------------------------------------
# The layout: which tokens a rank holds
# ---------------------------------------------------------------------------------------------------------


def positions(seq_len: int, cp: int, rank: int, balance: str = "zigzag") -> torch.Tensor:
    """Global positions of rank `rank`'s tokens, in the order it holds them (ascending)."""
    if balance == "contiguous":
        piece = seq_len // cp
        return torch.arange(rank * piece, (rank + 1) * piece)
    n = seq_len // (2 * cp)  # zig-zag: chunks `rank` and 2C−1−rank of 2C
    early, late = rank, 2 * cp - 1 - rank
    return torch.cat([torch.arange(early * n, (early + 1) * n), torch.arange(late * n, (late + 1) * n)])


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


@dataclass
class PhaseTime:
    passes: int = 0  # ring passes (one attention call, forward or backward, per layer and micro-batch)
    seconds: float = 0.0  # wall time inside the passes
    waited: float = 0.0  # of which blocked in wait(): on a transfer, or on a peer that is not there yet
    cpu: float = 0.0  # process CPU time inside the passes (every thread, gloo's too): the work, however shared


class Ring:
    """Send to the next rank of the cp group, receive from the previous one; time what is waited for."""

    def __init__(self, group):
        self.group, self.size, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)
        self.waited = 0.0
        self.times = {"forward": PhaseTime(), "backward": PhaseTime()}
        self.charging = True  # whether passes are charged to `times` (off between training steps: evaluation)

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
        start = time.perf_counter()
        for work in works:  # one work per op: wait on every one
            work.wait()
        self.waited += time.perf_counter() - start
        return received

    @contextmanager
    def timed(self, phase: str):
        """Charge the enclosed pass to `phase` (while `charging`). Host time: on CUDA wait() only orders streams
        (use a profiler there)."""
        start, cpu, waited = time.perf_counter(), time.process_time(), self.waited
        yield
        if self.charging:
            stat = self.times[phase]
            stat.passes, stat.seconds = stat.passes + 1, stat.seconds + time.perf_counter() - start
            stat.waited, stat.cpu = stat.waited + self.waited - waited, stat.cpu + time.process_time() - cpu


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
    """The ring, forward and backward, as one autograd node: saves q, k, v, out and lse (no scores)."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, balance: str):
        with torch.autocast(q.device.type, enabled=False), ring.timed("forward"):
            out, lse = ring_attention_forward(q, k, v, ring, balance)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.balance = ring, balance
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False), ctx.ring.timed("backward"):
            dq, dk, dv = ring_attention_backward(dout, q, k, v, out, lse, ctx.ring, ctx.balance)
        return dq, dk, dv, None, None


# ---------------------------------------------------------------------------------------------------------
# Ulysses
# ---------------------------------------------------------------------------------------------------------


def _seq_to_head(x, group, reorder):
    """[B, H, L, D] (L of this rank's tokens, all heads) → [B, H/C, C·L, D] (all tokens, heads of this rank).

    Piece j of the heads goes to rank j; piece j received holds rank j's tokens. `reorder` (zig-zag) sorts
    the gathered tokens, which come in rank order, into sequence order, so the causal mask is the plain one.
    """
    size = dist.get_world_size(group)
    B, H, L, D = x.shape
    send = x.reshape(B, size, H // size, L, D).transpose(0, 1).contiguous()  # [C, B, H/C, L, D]
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    full = received.permute(1, 2, 0, 3, 4).reshape(B, H // size, size * L, D)
    return full if reorder is None else full[:, :, reorder[0]]


def _head_to_seq(y, group, reorder):
    """The inverse of _seq_to_head: [B, H/C, s, D] → [B, H, s/C, D]."""
    size = dist.get_world_size(group)
    B, Hc, S, D = y.shape
    if reorder is not None:
        y = y[:, :, reorder[1]]  # back into rank order
    send = y.reshape(B, Hc, size, S // size, D).permute(2, 0, 1, 3, 4).contiguous()  # piece j: rank j's tokens
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    # Heads of rank j come j-th; stored token-major, as the ring's output is.
    return received.permute(1, 3, 0, 2, 4).reshape(B, S // size, size * Hc, D).transpose(1, 2)


class SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, reorder):
        ctx.group, ctx.reorder = group, reorder
        return _seq_to_head(x, group, reorder)

    @staticmethod
    def backward(ctx, grad):
        return _head_to_seq(grad, ctx.group, ctx.reorder), None, None


class HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group, reorder):
        ctx.group, ctx.reorder = group, reorder
        return _head_to_seq(y, group, reorder)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_head(grad, ctx.group, ctx.reorder), None, None


def ulysses_attention(q, k, v, group, reorder, inner, dropout_p: float = 0.0):
    """4 all-to-alls forward (q, k, v in, the output back), 4 backward; `inner` is ordinary causal attention."""
    if q.shape[1] % dist.get_world_size(group):
        raise ValueError(f"--cp-impl ulysses: {q.shape[1]} heads per tensor-parallel rank do not divide into"
                         f" --cp {dist.get_world_size(group)}")
    q, k, v = (SeqToHead.apply(t, group, reorder) for t in (q, k, v))
    return HeadToSeq.apply(inner(q, k, v, dropout_p), group, reorder)


def zigzag_reorder(seq_len: int, cp: int, device=None):
    """(to sequence order, to rank order) index pairs for Ulysses' gathered tokens under zig-zag."""
    in_rank_order = torch.cat([positions(seq_len, cp, j) for j in range(cp)]).to(device)
    return torch.argsort(in_rank_order), in_rank_order


# ---------------------------------------------------------------------------------------------------------
# Wiring: the attention function, flags, apply, the handle
# ---------------------------------------------------------------------------------------------------------


class ContextParallelAttention:
    """`block.attn.attention_fn` under CP. `inner` is the function it replaced (model.causal_attention, or
    tensor_parallel's ForkedAttention around it): Ulysses calls it on whole sequences; the ring does not."""

    def __init__(self, inner, ring: Ring, impl: str, balance: str):
        self.inner, self.ring, self.impl, self.balance = inner, ring, impl, balance
        self._reorder = {}

    @torch.compiler.disable  # p2p and all-to-all inside: never traced into a compiled graph
    def __call__(self, q, k, v, dropout_p: float):
        if dropout_p > 0:
            raise ValueError(f"--dropout {dropout_p} with --cp {self.ring.size}: context-parallel attention has no"
                             f" attention dropout; use --dropout 0")
        if self.impl == "ring":
            return RingAttention.apply(q, k, v, self.ring, self.balance)
        return ulysses_attention(q, k, v, self.ring.group, self._reorder_for(q.shape[2], q.device), self.inner)

    def _reorder_for(self, local_len: int, device):
        if self.balance == "contiguous" or self.ring.size == 1:
            return None
        if local_len not in self._reorder:
            self._reorder[local_len] = zigzag_reorder(local_len * self.ring.size, self.ring.size, device)
        return self._reorder[local_len]


def check_flags(seq_len: int, cp: int, n_head: int, tp: int = 1, impl: str = "ring", balance: str = "zigzag",
                dropout: float = 0.0, sequence_parallel: bool = False) -> None:
    """Raise ValueError naming the flag for any CP setting that cannot run (call before init_process_group)."""
    if not isinstance(cp, int) or cp < 1:
        raise ValueError(f"--cp must be a positive integer, got {cp!r}")
    if impl not in IMPLS:
        raise ValueError(f"--cp-impl {impl!r}: expected one of {', '.join(IMPLS)}")
    if balance not in BALANCES:
        raise ValueError(f"--cp-balance {balance!r}: expected one of {', '.join(BALANCES)}")
    if cp == 1:
        return
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
    if sequence_parallel and (seq_len // cp) % tp:
        raise ValueError(f"--sp with --cp {cp}: the {seq_len // cp} tokens per CP rank (--seq-len {seq_len}) must"
                         f" split into --tp {tp} pieces")


def parallelize(model, group, impl: str = "ring", balance: str = "zigzag", **accounting) -> ContextParallel:
    """Swap every held block's attention_fn for the CP one, in place; return the handle.

    `accounting`: seq_len, micro, micro_batches, compute_bytes, tp (see ContextParallel) for the printouts.
    """
    if impl not in IMPLS or balance not in BALANCES:
        raise ValueError(f"--cp-impl {impl!r} / --cp-balance {balance!r}: expected {IMPLS} / {BALANCES}")
    ring = Ring(group)
    for block in model.transformer.h:
        block.attn.attention_fn = ContextParallelAttention(block.attn.attention_fn, ring, impl, balance)
    return ContextParallel(model, ring, impl, balance, **accounting)


@dataclass(frozen=True)
class CPConfig:
    """--cp C, --cp-impl, --cp-balance: validated by config_from_flags."""

    size: int  # C
    impl: str = "ring"
    balance: str = "zigzag"


def config_from_flags(args, settings) -> CPConfig | None:
    """CP's flags on this model and mesh, or ValueError naming the flag (before any process group)."""
    if args.cp == 1:
        return None
    model = settings.model
    check_flags(settings.seq_len, args.cp, model.n_head, args.tp, args.cp_impl, args.cp_balance, model.dropout,
                settings.sequence_parallel)
    return CPConfig(args.cp, args.cp_impl, args.cp_balance)


def apply(model, run, config: CPConfig) -> ContextParallel:
    """The axis for train.py: after tensor_parallel (DESIGN's order), before PP/FP8/layout."""
    param = next(model.parameters())
    with run.autocast:  # e_c: the dtype c_attn's output (q, k, v) will have in this run
        compute_bytes = torch.nn.functional.linear(param.new_zeros(1, 1), param.new_zeros(1, 1)).element_size()
    handle = parallelize(model, run.mesh.group("cp"), config.impl, config.balance, seq_len=run.seq_len,
                         micro=run.micro_batch_size, micro_batches=run.micro_batches, compute_bytes=compute_bytes,
                         tp=run.mesh.size("tp"), autocast=run.autocast)
    # Block 0 is measured now (collective over cp and tp), before a layout installs its gradient hooks. It needs
    # values: a model train.compose built on meta (MoE and TP have cut it) is materialised here, not after the axes.
    if next(model.parameters()).is_meta:
        materialize(model, run.device)
    handle.measured_startup = handle.startup_lines()
    return handle


@dataclass
class ContextParallel(Axis):
    """The handle: cuts batches, predicts and reports the cp messages, the causal work and the activations."""

    model: object
    ring: Ring
    impl: str
    balance: str
    seq_len: int | None = None
    micro: int = 1
    micro_batches: int = 1
    compute_bytes: int = 4  # e_c
    tp: int = 1
    autocast: object = field(default_factory=nullcontext)
    name: str = "cp"
    alone_seconds: dict = field(default_factory=dict)  # ring transfers timed without compute, per phase
    measured_startup: list | None = None  # startup_lines() as measured by apply

    def shard_batches(self, batches) -> list:
        """[(x, y)] or [(x, y, pos)] of whole sequences → [(x, y, pos)] of this rank's tokens (pos global)."""
        out = []
        for batch in batches:
            x, y, pos = (*batch, None)[:3]
            seq_len = x.shape[1]
            index = positions(seq_len, self.ring.size, self.ring.rank, self.balance).to(x.device)
            pos = torch.arange(seq_len, device=x.device) if pos is None else pos
            out.append((x[:, index], y[:, index], pos[..., index]))
        return out

    def after_grad_sync(self, layout) -> None:
        """Nothing: the layout's dp×cp sum is the whole gradient (every rank's loss is a sum over its tokens)."""

    def before_step(self) -> None:
        self.ring.charging = True  # the ring's times count the passes of training steps...

    def after_step(self, skipped: bool) -> None:
        self.ring.charging = False  # ...not the evaluation (or anything else) run between them

    def sampling(self):
        return self.whole_sequences()

    @contextmanager
    def whole_sequences(self):
        """For sampling/evaluating whole sequences on every rank: the attention functions CP replaced."""
        blocks = list(self.model.transformer.h)
        swapped = [block.attn.attention_fn for block in blocks]
        try:
            for block, fn in zip(blocks, swapped):
                block.attn.attention_fn = fn.inner
            yield
        finally:
            for block, fn in zip(blocks, swapped):
                block.attn.attention_fn = fn

    # --- accounting (item 3 of the docstring) ------------------------------------------------------------

    def layer_messages(self) -> dict:
        """{(phase, op): (calls, payload)} of one layer and micro-batch: see `layer_messages`."""
        config = self.model.config
        return layer_messages(self.impl, self.ring.size, self.micro, self.seq_len, config.n_embd // self.tp,
                              self.compute_bytes, config.activation_checkpointing)

    def predicted_messages(self, layout=None) -> dict:
        """Per optimizer step: {(op, "cp"): (calls, payload bytes)}."""
        out = {}
        repeats = len(self.model.transformer.h) * self.micro_batches
        for (_, op), (calls, payload) in self.layer_messages().items():
            c, b = out.get((op, "cp"), (0, 0))
            out[(op, "cp")] = (c + calls * repeats, b + payload * repeats)
        return out

    def startup_lines(self) -> list:
        """Collective over cp (and tp): measures block 0 once (messages, saved bytes, the ring alone)."""
        from mfu import format_bytes

        if self.measured_startup is not None:
            return self.measured_startup
        C, s, b, h = self.ring.size, self.seq_len, self.micro, self.model.config.n_embd
        measured_msgs, saved = measure_block(self)
        lines = [f"context parallel C={C} ({self.impl}, {self.balance}): rank c holds "
                 + ("chunks c and 2C−1−c of 2C" if self.balance == "zigzag" else "the c-th s/C tokens")
                 + f" ({s // C} of s={s} tokens); parameters replicated, gradients summed over dp×cp"]
        lines.append(f"  messages per layer and micro-batch, group cp (e_c={self.compute_bytes},"
                     f" e_a={_acc_bytes(self.compute_bytes)}):")
        for (phase, op), (calls, payload) in self.layer_messages().items():
            m_calls, m_payload = measured_msgs.get((phase, op), (0, 0))
            lines.append(f"    {phase:<8} {op:<18} predicted {calls} × {format_bytes(payload / max(1, calls)):>10}"
                         f"   measured {m_calls} × {format_bytes(m_payload / max(1, m_calls)):>10}")
        step = sum(payload for (op, _), (_, payload) in self.predicted_messages().items() if op != "recv")
        lines.append(f"  per step (× L={len(self.model.transformer.h)} × m={self.micro_batches}):"
                     f" {format_bytes(step)} sent")
        lines += causal_work_lines(s, C)
        ctx = getattr(next(iter(self.model.transformer.h)).attn.c_attn, "ctx", None)  # tensor parallel's
        sp = ctx is not None and ctx.sequence_parallel
        lines += activation_lines(self.model.config, s, b, h, C, self.tp, saved, sp, self.compute_bytes)
        if self.impl == "ring":
            self.alone_seconds = time_ring_alone(self)
            lines.append(f"  ring transfers alone (no compute): forward {self.alone_seconds['forward'] * 1e3:.2f} ms,"
                         f" backward {self.alone_seconds['backward'] * 1e3:.2f} ms per layer")
        return lines

    def end_lines(self, tracer, steps: int) -> list:
        from mfu import format_bytes

        lines = [f"context parallel C={self.ring.size} ({self.impl}): per training step, measured vs predicted"
                 f" (group cp; {steps} steps, evaluation not included)"]
        records = tracer.records
        for (op, group), (calls, payload) in self.predicted_messages().items():
            stat = records.get((op, group))
            m_calls, m_payload = (stat.calls / steps, stat.payload_bytes / steps) if stat else (0, 0)
            lines.append(f"  {op:<18} predicted {calls} calls {format_bytes(payload):>10}"
                         f"   measured {m_calls:g} calls {format_bytes(m_payload):>10}")
        if self.impl != "ring":
            return lines + ["  Ulysses' all-to-alls are blocking: none of their time is hidden (tracer seconds above)"]
        layers, m = len(self.model.transformer.h), self.micro_batches
        recompute = " (forward ×2: activation checkpointing)" if self.model.config.activation_checkpointing else ""
        lines.append(f"  ring time over the {steps} training steps' passes, L={layers} × m={m} per step and"
                     f" phase{recompute}; evaluation not included:")
        on_cpu = next(self.model.parameters()).device.type == "cpu"
        return lines + hidden_lines(self.ring.times, self.alone_seconds, on_cpu)


# ---------------------------------------------------------------------------------------------------------
# Accounting
# ---------------------------------------------------------------------------------------------------------


def _acc_bytes(compute_bytes: int) -> int:
    return 8 if compute_bytes == 8 else 4


def layer_messages(impl, cp, micro, seq_len, h_local, compute_bytes, checkpointing=False) -> dict:
    """One layer's cp-group messages for one micro-batch: {(phase, op): (calls, payload bytes)}."""
    if cp == 1:
        return {}
    tokens = micro * seq_len // cp
    out = {}

    def add(phase, ops, calls, payload):
        for op in ops:
            c, b = out.get((phase, op), (0, 0))
            out[(phase, op)] = (c + calls, b + calls * payload)

    if impl == "ring":
        kv, dkv = 2 * tokens * h_local * compute_bytes, 2 * tokens * h_local * _acc_bytes(compute_bytes)
        forward = [((cp - 1), kv)]
        backward = forward + [(cp, dkv)] + (forward if checkpointing else [])
        for phase, messages in (("forward", forward), ("backward", backward)):
            for calls, payload in messages:
                add(phase, ("send", "recv"), calls, payload)
    else:
        piece = tokens * h_local * compute_bytes
        add("forward", ("all_to_all_single",), 4, piece)
        add("backward", ("all_to_all_single",), 8 if checkpointing else 4, piece)
    return out


def causal_work(seq_len: int, cp: int) -> dict:
    """{balance: [(query, key) pairs rank c attends under the causal mask, for each c]}: token p sees p+1 keys."""
    return {balance: [int((positions(seq_len, cp, c, balance) + 1).sum()) for c in range(cp)] for balance in BALANCES}


def causal_work_lines(seq_len: int, cp: int) -> list:
    work = causal_work(seq_len, cp)
    lines = [f"  causal work per CP rank, (query, key) pairs for s={seq_len} (max/mean is the imbalance):"]
    for balance, pairs in work.items():
        ratio = max(pairs) / (sum(pairs) / len(pairs))
        lines.append(f"    {balance:<10} " + " ".join(f"{p:>10,}" for p in pairs) + f"   max/mean {ratio:.3f}")
    return lines


def saved_activation_bytes(fn, exclude=()) -> int:
    """Bytes of the distinct storages autograd saves while `fn()` runs (parameters in `exclude` left out)."""
    with SavedActivations(exclude) as saved:
        fn()
    return saved.bytes


def activation_lines(config, s, b, h, cp, tp, measured: int | None, sequence_parallel: bool = False,
                     element_bytes: int = 2) -> list:
    """The measured saved bytes of one layer next to Korthikanti's estimate and its CP form (÷ C).

    The estimate counts 16-bit elements; the measurement is in the run's dtypes, so it is also shown scaled
    by 2/e_c (exact when every saved tensor is in the compute dtype; autocast keeps LayerNorm inputs fp32)."""
    from mfu import activation_bytes_per_layer, format_bytes

    full = activation_bytes_per_layer(s, b, h, config.n_head, tp, sequence_parallel)
    # Without the score term (a = 0) and without the two 1-byte dropout masks of the residual branches.
    masks = 2 * s * b * h / (tp if sequence_parallel else 1)
    flash = activation_bytes_per_layer(s, b, h, 0, tp, sequence_parallel) - masks
    line = (f"  activations per layer and micro-batch (Korthikanti 2022, 16-bit, ÷ C={cp}): sbh(34+5as/h)/C ="
            f" {format_bytes(full / cp)}; no stored scores, no dropout masks (32sbh)/C = {format_bytes(flash / cp)}")
    if measured is not None:
        line += (f"; measured (saved_tensors_hooks) {format_bytes(measured)}, × 2/e_c = "
                 f"{format_bytes(measured * 2 / element_bytes)}")
    return [line]


def measure_block(handle: ContextParallel) -> tuple[dict, int]:
    """Run block 0 forward + backward once on random local input: ({(phase, op): (calls, bytes)}, saved bytes)."""
    from comm import CommTracer

    block = next(iter(handle.model.transformer.h))
    param = next(block.parameters())
    ctx = getattr(block.attn.c_attn, "ctx", None)  # tensor parallel's context, if any
    local = handle.seq_len // handle.ring.size // (ctx.size if ctx is not None and ctx.sequence_parallel else 1)
    generator = torch.Generator(device=param.device).manual_seed(0)
    x = torch.randn(handle.micro, local, handle.model.config.n_embd, generator=generator, device=param.device,
                    dtype=param.dtype, requires_grad=True)
    tracer = CommTracer()
    tracer.name_group(handle.ring.group, "cp")
    with tracer, SavedActivations(exclude=list(handle.model.parameters())) as saved, handle.autocast:
        out = block(x)
    forward = tracer.records
    tracer.reset()
    with tracer:
        out.float().sum().backward()
    measured = {(phase, op): (r.calls, r.payload_bytes) for phase, records in (("forward", forward),
                ("backward", tracer.records)) for (op, group), r in records.items() if group == "cp"}
    block.zero_grad(set_to_none=True)
    handle.ring.times = {phase: PhaseTime() for phase in handle.ring.times}  # not training time
    return measured, saved.bytes


def time_ring_alone(handle: ContextParallel, repeats: int = 5) -> dict:
    """Seconds per layer of one micro-batch's ring transfers with no compute between them (collective over cp):
    forward (C−1) hops of [K; V]; backward (C−1) of [K; V] and C of [dK; dV]."""
    device, ring = next(handle.model.parameters()).device, handle.ring
    shape = (2, handle.micro * handle.seq_len // handle.ring.size, handle.model.config.n_embd // handle.tp)
    dtypes = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}
    kv = torch.zeros(shape, dtype=dtypes[handle.compute_bytes], device=device)
    dkv = torch.zeros(shape, dtype=dtypes[_acc_bytes(handle.compute_bytes)], device=device)
    out = {}
    for phase, hops in (("forward", [kv] * (ring.size - 1)), ("backward", [kv] * (ring.size - 1) + [dkv] * ring.size)):
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for tensor in hops:
                ring.wait(ring.post(tensor))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        out[phase] = statistics.median(times)
    return out


def hidden_lines(times: dict, alone: dict, on_cpu: bool = False) -> list:
    """How much of the ring's transfer time compute hid, per phase: at least 1 − waited / (the transfers alone),
    both per pass. A lower bound: wait() also blocks on a peer that has not sent yet (imbalance; on a shared
    host, a peer that was descheduled), so the waits can outlast the transfers even when each one overlapped.
    on_cpu: also the CPU cores a rank kept busy while it computed (process CPU / (wall − waited); a gloo wait
    sleeps), next to its torch threads: a one-thread rank with less than one core busy was descheduled, i.e.
    the ranks time-share the host's cores."""
    lines, shared = [], False
    for phase, stat in times.items():
        if not stat.passes:
            continue
        waited, seconds = stat.waited / stat.passes, stat.seconds / stat.passes
        line = (f"  ring {phase:<8}: {stat.passes} passes, {seconds * 1e3:.2f} ms each, blocked in wait()"
                f" {waited * 1e3:.2f} ms ({waited / seconds:.0%})")
        if phase in alone and alone[phase] > 0:
            line += (f"; the transfers alone {alone[phase] * 1e3:.2f} ms: at least"
                     f" {min(1.0, max(0.0, 1 - waited / alone[phase])):.0%} of them hidden behind compute")
        if on_cpu:
            threads, cores = torch.get_num_threads(), stat.cpu / max(1e-9, stat.seconds - stat.waited)
            shared = shared or (threads == 1 and cores < 0.8)
            line += f"; {cores:.2f} CPU cores busy while computing ({threads} torch threads)"
        lines.append(line)
    if lines:
        lines.append("  (at least: wait() also counts a slower peer's compute, so 0% means the waits outlast the"
                     " transfers, not that none overlapped)")
    if shared:
        lines.append(f"  (under one core busy on one thread: the ranks time-share this host's {os.cpu_count()} cores; a"
                     " rank's waits are then mostly its peers' descheduled compute, and gloo's copies of the"
                     " 'hidden' transfers are CPU work taken from that compute)")
    return lines
