"""Mixture of experts (Shazeer et al. 2017; GShard 2020; Switch, Fedus et al. 2021) and expert parallel, from
raw all-to-all collectives.

A MoE block replaces the dense MLP by N experts (each the dense MLP's c_fc → GELU → c_proj) and a router; each
token visits the k best experts and the block returns y = Σ_{j<k} w_j · expert_{e_j}(x). The router (in fp32,
or the model's dtype when wider; autocast off):
    z = x·W_rᵀ [T, N];  p = softmax(z) over all N;  (g, e) = top-k of p;  w = g / Σ_j g_j (k > 1), g (k = 1)
For k > 1 this is Mixtral's softmax over the k chosen logits, weights summing to 1 (one dense MLP's scale
whatever k and N); for k = 1 renormalising would give w = 1, so, as Switch, we keep the raw probability.
DeepSeek-V3's router (experts/router.py: --moe-score sigmoid, the loss-free bias --moe-bias-rate, the seq loss
--moe-seq-aux-coef, --moe-groups/--moe-group-limit, --moe-route-scale) replaces this line's choice and weights;
each layer's per-expert load (slots routed, before capacity: the last step's in `layer.load.last`, global when the
bias learns) is `router.ExpertLoad`, the one place its readers go; the bias is updated in `after_grad_sync`.
With --moe-shared-experts S the block adds S always-on experts, ungated (DeepSeekMoE; experts/shared.py, whose
docstring answers the four questions for them): y = Σ_s shared_s(x) + Σ_j w_j · expert_{e_j}(x).
Auxiliary losses (`aux_losses.add(name, coef, value)`; the step divides by the D·m micro-batches, so each is
defined on ONE data-parallel micro-batch, DESIGN.md), with fᵢ = (slots routed to i)/(T·k) before capacity:
    moe_balance = N · Σᵢ fᵢ·Pᵢ,  Pᵢ = mean of pᵢ (1 when balanced)    α = --moe-aux-coef
    moe_z       = mean over tokens of (logsumexp z)²   (ST-MoE)       β = --moe-z-coef
Under CP or SP a rank holds a piece of its micro-batch: the losses' statistics are summed over the pieces'
ranks by an all-reduce whose backward is the identity (`SumOverPieces`: the gradient then counts once).

Capacity (--moe-capacity-factor f > 0; 0: dropless): each expert takes at most C_μ = ⌈B_μ·s·k/N · f⌉ slots of
a micro-batch; later slots drop in TOKEN order (b-major) and add nothing (the residual carries the token).
It is decided on the WHOLE micro-batch whatever the mesh (`MoE.keep_slots`): the same slots drop on any C and
T_tp, so a resume on another mesh trains the same model.

Expert parallel (--ep E): the E ranks of an ep group (carved from the D×C data ranks, mesh.py) share their
tokens; rank e holds experts [e·N/E, (e+1)·N/E) of every MoE layer, whole. `MoE.dispatch_and_combine`:
    E = 1: sort the kept slots by expert (token order inside, dropped last), gather their rows (the one copy),
    run each expert on its slice, weight each output row by its gate and index_add it into y[t].
    E > 1: dispatch.exchange, DEDUPLICATED as DeepSeek-V3's: a token goes ONCE to each rank holding any
    of its kept slots' experts, with its k gates and local slot indices (metadata); the receiver fans it out
    to its experts, sums the gate-weighted outputs per (token, source) and sends ONE row back; y[t] = Σ of
    t's rows back. Counts, rows, metadata and combine are four all_to_all_single calls (experts/dispatch.py).
Capacity is decided per expert before either (`keep_slots`, on the whole micro-batch): a dropped slot travels
nowhere, a token with no kept slot on a rank is not sent there. `dispatch.AllToAll` (autograd): its
backward is the reverse all-to-all. Expert gradients are summed over
expert_dp (the D×C/E ranks holding the same experts), the router's with the dense ones over dp×cp; E = 1 is
plain data parallel. With --moe-replicas R (experts/eplb.py) rank e holds R/E physical slots instead, a hot expert
in several, and 1-5 run by slot. Under TP the experts and the router are REPLICATED over tp: without --sp each
TP rank computes the same thing; with --sp each routes its sequence piece and their gradients are summed over tp
once per step (`MoEAxis.after_grad_sync`). Under PP an ep group is one stage: one schedule, one order.

Symbols: N experts, k top-k, E expert-parallel size, h hidden, L_moe MoE layers (L in all), T tokens of one
rank's micro-batch (B_μ·s, ÷C under CP, ÷T_tp under SP), C_μ the capacity, Ψ_e = 8h² + 5h one expert's
parameters, S / R rows a rank sends / receives in one dispatch, e_c bytes of a compute-dtype element, e_r of a
router-dtype one (fp32 or wider), e_i = 1 of a gathered choice (4 when N > 256), m micro-batches.

1. Replicated and split. Split E ways: the experts (expert i one logical tensor per weight, `...experts.<i>.
   c_fc.weight`), the routed rows. Replicated: the router, the dense parameters; each expert over expert_dp.
2. Peak per device. Parameters Ψ_dense + L_moe·(h·N + (N/E)·Ψ_e), ×16 bytes with fp32 grads and AdamW
   (memory.param_counts). Temporaries per MoE layer and micro-batch: the router's [T, N] logits and probabilities
   (e_r), S sent and R received rows (E > 1: pairs, with their metadata), the R_e rows the experts run (E = 1:
   the S slots; E > 1 the fan-out), their [R_e, 4h] hidden and R_e outputs (under --fp8 their linears run in
   FP8, each expert's rows padded to 16: fp8.py, accounting/fp8_experts.py; under a precision recipe each chunk's dW
   operands padded to its token block: accounting/recipe_experts.py), the weighted and summed rows; with capacity
   under CP/SP the gathered choices, B_μ·s·k·e_i. Kept for backward: `layer_activation_bytes` (tested against
   autograd for E = 1). Uniform routing: R_e = T·k, S = R = T·ρ; worst case (the whole ep group picks this
   rank): R = E·T, R_e = E·T·k dropless, ≤ N·C_μ with capacity. What the forward holds at once
   (the dispatch and combine buffers, its peak, and which block sets the step's): accounting/moe_memory.py.
3. Critical path (all synchronous), per MoE layer and micro-batch, group ep (payload = the input tensor; S
   and R here the (token, rank) rows sent and received, experts/dispatch.py's):
       forward   all_to_all_single  counts 8(N + E)  +  rows S·h·e_c  +  metadata S·2k·e_r  +  combine R·h·e_c
       backward  all_to_all_single  combine's reverse S·h·e_c  +  metadata's R·2k·e_r  +  rows' reverse R·h·e_c
   Uniform routing: 7 calls, S = R = T·ρ (router.rows_per_token: ranks a token reaches, ≤ k), (E−1)/E of
   it on the wire; with capacity S ≤ the kept slots, min(T·k, N·C_μ)
   (uniformly N·C_μ/(C·T_sp)); activation checkpointing repeats the 4 forward calls (selective recompute does not:
   a MoE block's MoE side runs once, model.Block). With CP/SP, per MoE layer
   and forward: one all_reduce of (2N+2) e_r values on cp (and tp) and, with capacity, one all_gather_single of
   the choices (its output: B_μ·s·k·e_i on cp, B_μ·(s/C)·k·e_i on tp). Per step: the gradients over
   expert_dp and dp×cp (the layout), with --sp one all_reduce of the experts' and router's over tp.
   `step_messages` is the uniform estimate (startup table); `all_to_all_messages` of the rows the training
   forwards did send and receive (told to the layers' observer, `RoutingObserver`) is exact (end table,
   `MoEAxis.traced_prediction`).
   Host syncs per MoE layer and micro-batch: ONE `.tolist()` of the split sizes (all_to_all_single takes
   Python ints; E = 1: the experts' row slicing), again in a recompute; no nonzero() (dropped slots sort
   last), no bincount (a scatter-add). Aux values, load and drops stay tensors until a line reads them
   (step.train_step once per step; the load line, through its observer's `take_load`, once per line).
4. Restart state: the sigmoid router's bias (`state_pieces`, moe_router item 4); routing is deterministic (no
   RNG), and each expert is a whole logical tensor named by its global index, so a checkpoint written with one E
   loads with another. With --moe-replicas, the load averages that place the slots (`state_pieces`, `after_load`:
   experts/eplb.py item 4).
   FLOPs per token (MFU): mfu.flops_per_token, from the k experts a token visits, not the N.
"""

from __future__ import annotations

import functools
import math
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from experts import dispatch, router
from experts.dispatch import ALL_TO_ALL, Traffic, all_to_all_messages, step_messages
from experts.router import capacity
from experts.shared import SharedExperts
from shard import ShardInfo, StatePiece, counts_here, describe, materialize, positions
from step import Axis, Messages, is_training_forward, sum_in_place

# ---------------------------------------------------------------------------------------------------------
# The router, the routing, the capacity
# ---------------------------------------------------------------------------------------------------------


class Router(nn.Module):
    """Logits z = x·W_rᵀ, [T, h] → [T, N], in fp32 (or wider) with autocast off: a bf16 softmax over experts
    flips close top-k choices. Its own module, not an nn.Linear, so FP8 and TP leave it alone."""

    def __init__(self, n_embd: int, n_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = torch.promote_types(self.weight.dtype, torch.float32)
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.to(wide), self.weight.to(wide))


def route(logits: torch.Tensor, topk: int):
    """(probabilities [T, N], weights [T, k], experts [T, k]): softmax over all N, top-k, renormalised (k>1).
    router.route with its defaults (ties to the lower expert); it also does sigmoid, bias and groups."""
    probs, gate, expert, _ = router.route(logits, topk)
    return probs, gate, expert


def capacity_keep(expert: torch.Tensor, n_experts: int, cap: int | None) -> torch.Tensor:
    """[T, k] bool: slot (t, j) keeps its place if fewer than `cap` earlier tokens chose the same expert.

    Slots are counted in token order (a token never picks one expert twice), so each expert keeps its first
    `cap` tokens by position: deterministic, and the same on any mesh for the same micro-batch.
    """
    if cap is None:
        return torch.ones_like(expert, dtype=torch.bool)
    # One-hot by comparison, not F.one_hot (which checks its input's range on the host: a sync).
    onehot = expert.reshape(-1, 1) == torch.arange(n_experts, device=expert.device)  # [T·k, N], token order
    position = (onehot.cumsum(dim=0) * onehot).sum(dim=-1)  # 1-based place of each slot in its expert's queue
    return (position <= cap).view_as(expert)


def count_per_expert(expert: torch.Tensor, bins: int) -> torch.Tensor:
    """[bins] int64: how many of the entries name each bin. A scatter-add, not torch.bincount, which
    reads the largest value on the host first (a sync on GPUs)."""
    flat = expert.reshape(-1)
    return torch.zeros(bins, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


# ---------------------------------------------------------------------------------------------------------
# The MoE layer: route, decide capacity, dispatch, run the experts, combine
# ---------------------------------------------------------------------------------------------------------


class MoE(nn.Module):
    """The MoE MLP of one block: router, experts (keyed by GLOBAL index: this rank may hold only some), and
    the expert-parallel exchange when ep_group is set (`shard_experts`). `swap_in` puts it in a block."""

    recompute_by_halves = True  # its routing and all-to-alls run once: selective recompute splits the block

    def __init__(self, config, layer_id: int, aux_losses):
        super().__init__()
        self.layer_id, self.aux_losses = layer_id, aux_losses  # the model's aux-loss channel
        self.n_experts, self.topk = config.moe.experts, config.moe.topk
        self.capacity_factor = config.moe.capacity_factor
        self.aux_coef, self.z_coef = config.moe.aux_coef, config.moe.z_coef
        self.routing = dict(score=config.moe.score, groups=config.moe.groups, limit=config.moe.group_limit,
                            scale=config.moe.route_scale)  # router.route's options (DeepSeek-V3's gate)
        self.seq_aux_coef = config.moe.seq_aux_coef
        self.load = router.ExpertLoad(config.moe.experts, config.moe.score == "sigmoid", config.moe.bias_rate)
        self.router = Router(config.n_embd, config.moe.experts)
        self.experts = nn.ModuleDict({str(i): Expert(config) for i in range(config.moe.experts)})
        # S always-on experts added ungated (experts/shared.py); dense parameters, built after the routed ones.
        self.shared_experts = SharedExperts(config) if config.moe.shared_experts else None
        self.dropout = nn.Dropout(config.dropout)
        self.local = range(config.moe.experts)  # the experts this rank holds
        self.ep_group, self.ep_size = None, 1
        self.replicas = None  # experts/eplb.py's Replicas with --moe-replicas: the physical slots the dispatch
        # sends to (`physical`, `slots`), and the step's kept slots per expert (`step_load`, summed over the load
        # groups in the router's all-reduce: MoEAxis.after_grad_sync)
        self.pieces = ()  # Pieces: the ranks holding the other pieces of this rank's micro-batch (CP, SP)
        self.observer = RoutingObserver()  # who is told what each forward routed (the accounting, or nobody)
        self.places, self.off_group = None, (0, 0)  # with groups under EP: router.off_group's last record
        self.exchanged = None  # under EP: the last exchange's rows per rank (dispatch.Exchange)
        self.local_rows = None  # the rows of each expert GEMM of the last forward (E = 1 one per expert; E > 1
        # one per local slot and source rank), capacity drops excluded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])  # [T, h]: this rank's tokens (its CP/SP piece of the micro-batch)
        logits = self.router(tokens)  # [T, N]
        probs, gate, expert, scores = router.route(logits, self.topk, bias=self.load.on(logits.device).bias,
                                                   **self.routing)
        routed = count_per_expert(expert, self.n_experts)  # [N]
        if is_training_forward(self.training):
            self.load.add(routed)  # the step's load: the bias update's, and every reader's (`layer.load`)
        sequences = x.shape[0] if x.dim() == 3 else 1
        seq = router.sequence_stats(scores, probs, self.topk, sequences) if self.seq_aux_coef > 0 else None
        balance, z, seq = router_losses(logits, probs, routed, self.topk, [piece.group for piece in self.pieces], seq)
        self.aux_losses.add("moe_balance", self.aux_coef, balance)
        self.aux_losses.add("moe_z", self.z_coef, z)
        if seq is not None:
            self.aux_losses.add("moe_seq_balance", self.seq_aux_coef, router.sequence_loss(seq, self.topk))
        keep = self.keep_slots(expert.view(*x.shape[:-1], self.topk))
        y, rows_sent, rows_received = self.dispatch_and_combine(tokens, gate, expert, keep)
        self.observer.routed(self, routed, keep, rows_sent, rows_received)
        y = y.view(x.shape).to(x.dtype)  # the fp32 gate must not widen the residual stream
        if self.shared_experts is not None:  # last: a recompute stops before its TP reduction, as the dense MLP's
            y = y + self.shared_experts(x)
        return self.dropout(y)

    @torch.no_grad()
    def keep_slots(self, expert: torch.Tensor) -> torch.Tensor | None:
        """[T, k] bool: which of this rank's slots keep their place (None: dropless), decided on the WHOLE
        micro-batch as one device decides it. expert: [B, n, k], this rank's. Under CP or SP the rank all-gathers
        the pieces' choices (`Pieces`), one byte each (N ≤ 256), rebuilds token order, runs the same
        `capacity_keep` and keeps its own verdicts; sampling (whole sequences, `MoEAxis.sampling`) gathers nothing."""
        batch, n, k = expert.shape
        cap = capacity(batch * n * math.prod(piece.size for piece in self.pieces), k, self.n_experts,
                       self.capacity_factor)
        if cap is None:
            return None
        if not self.pieces:
            return capacity_keep(expert.reshape(-1, k), self.n_experts, cap)
        travel = torch.uint8 if self.n_experts <= 256 else torch.int32  # gloo gathers no int16
        whole, mine = whole_micro_batch(expert.to(travel), self.pieces)
        keep = capacity_keep(whole.long().reshape(-1, k), self.n_experts, cap).view(whole.shape)
        return keep[:, mine].reshape(-1, k)

    def dispatch_and_combine(self, tokens, gate, expert, keep) -> tuple[torch.Tensor, int, int]:
        """Steps 1-6 of the module docstring. Returns (y [T, h], S rows sent, R rows received): E = 1 both the
        kept slots; E > 1 the (token, rank) pairs of the deduplicated exchange (experts/dispatch.py)."""
        k, n = self.topk, self.n_experts
        slot_expert = expert.reshape(-1)  # [T·k], slot s is token s // k, its choice s % k
        if keep is not None:
            slot_expert = torch.where(keep.reshape(-1), slot_expert, n)  # a dropped slot sorts after every expert
        if self.replicas is not None:  # each slot to one replica of its expert: by physical slot from here on
            slot_expert, n = self.replicas.physical(slot_expert, self.training), self.replicas.slots
        autocast = torch.is_autocast_enabled(tokens.device.type)  # the rows travel in the dtype c_fc will cast to
        rows = tokens.to(torch.get_autocast_dtype(tokens.device.type)) if autocast else tokens
        if self.ep_size > 1:
            y, self.exchanged = dispatch.exchange(rows, gate, slot_expert, n, self.ep_group, self.ep_size,
                                                  lambda i, chunk: self.experts[str(self.local[i])](chunk))
            self.off_group = router.off_group(self.places, self.exchanged)  # the accounting's
            self.local_rows = self.exchanged.chunks
            return y, sum(self.exchanged.sent), sum(self.exchanged.received)
        order = torch.argsort(slot_expert, stable=True)  # 1. kept slots by expert (token order inside), dropped last
        counts = count_per_expert(slot_expert, n + 1)[:n]  # [N] rows per expert
        sizes = self.local_rows = counts.tolist()  # the one host sync: the experts' row slicing
        order = order[:sum(sizes)]  # the kept slots
        sent = rows[order // k]  # [S, h] by expert: the one copy in
        back = self.run_local_experts(sent, sizes)  # 4.
        weighted = back * gate.reshape(-1)[order].unsqueeze(1)  # 6. [S, h]
        y = torch.zeros((tokens.shape[0], tokens.shape[1]), dtype=weighted.dtype, device=tokens.device)
        return y.index_add(0, order // k, weighted), len(order), len(order)

    def run_local_experts(self, rows: torch.Tensor, sizes: list) -> torch.Tensor:
        """rows arrive in chunks of `sizes` rows, [source rank][local expert] (one source when E = 1); each
        chunk runs through its expert where it lies (a view of the received buffer, no copy), and the outputs
        are written once, in the same order, into one buffer (under EP, the combine's send buffer)."""
        n_local = len(self.local)
        chunks = rows.split(sizes)
        return torch.cat([self.experts[str(self.local[i % n_local])](chunk) for i, chunk in enumerate(chunks)])


class Expert(nn.Module):
    """One expert: the dense MLP's shape (c_fc → GELU → c_proj), plain nn.Linears that FP8/TP can wrap."""

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate=config.gelu_approximate)  # the dense MLP's GELU (GPTConfig.gelu)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


# A micro-batch in pieces (CP, SP): the aux statistics summed, the capacity decided on the whole.


class SumOverPieces(torch.autograd.Function):
    """All-reduce (sum) forward, IDENTITY backward (Megatron's g): the aux-loss statistics s_r (Σ routed slots,
    Σ p, Σ lse², T) of a micro-batch whose pieces lie on the ranks of `group` (cp; tp with --sp). Every piece-
    holder then has A = a(S), S = Σ_r s_r, and its gradient ∂a/∂S · ∂s_r/∂θ runs through its own tokens; the
    data-parallel SUM (and SP's over tp) adds them to ∂A/∂θ, once. A backward all-reduce would count it C times."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def router_losses(logits: torch.Tensor, probs: torch.Tensor, routed: torch.Tensor, topk: int, groups=(),
                  sequences: torch.Tensor | None = None):
    """(balance, z, sequences): N·Σᵢ fᵢ·Pᵢ and mean (logsumexp z)², over the whole micro-batch (its pieces summed
    over `groups`), and the seq loss's [B, 2N+1] statistics (router.sequence_stats) summed alike in the same
    all-reduce (None when off). routed: [N] slots routed to each expert by this rank (before capacity)."""
    n = probs.shape[-1]
    lse = torch.logsumexp(logits, dim=-1)
    stats = torch.cat([routed.to(probs.dtype), probs.sum(dim=0), (lse * lse).sum().view(1),
                       torch.full((1,), logits.shape[0], dtype=probs.dtype, device=probs.device),
                       *([] if sequences is None else [sequences.to(probs.dtype).reshape(-1)])])
    for group in groups:
        stats = SumOverPieces.apply(stats, group)
    tokens = stats[2 * n + 1]
    f, p = stats[:n] / (tokens * topk), stats[n:2 * n] / tokens
    summed = None if sequences is None else stats[2 * n + 2:].view(sequences.shape)
    return n * (f * p).sum(), stats[2 * n] / tokens, summed


class Pieces(NamedTuple):
    """The `size` ranks of `group` each hold a piece of every sequence of the micro-batch: rank j the n/size
    positions `context_parallel.positions(n, size, j, balance)` of its n tokens. CP cuts zig-zag or
    contiguous; SP cuts the CP piece contiguously (its ranks are the inner level)."""

    group: object
    size: int
    rank: int
    balance: str = "contiguous"


@functools.lru_cache(maxsize=None)
def _positions(n: int, size: int, rank: int, balance: str, device: torch.device) -> torch.Tensor:
    """context_parallel.positions on `device`, made once per shape (no host-to-device copy per forward)."""
    return positions(n, size, rank, balance).to(device)


def whole_micro_batch(expert: torch.Tensor, pieces: tuple) -> tuple:
    """([B, s, k] the expert choices of the whole micro-batch, in token order; [n] where this rank's n tokens
    sit among the s), from this rank's [B, n, k] choices (in the dtype they travel in) and one all-gather
    per level of `pieces` (listed outer first: cp, then tp under SP), the innermost level gathered first."""
    batch, n, k = expert.shape
    whole, mine = expert, torch.arange(n, device=expert.device)
    for piece in reversed(pieces):
        n = whole.shape[1]
        gathered = whole.new_empty((piece.size * batch, n, k))
        dist.all_gather_single(gathered, whole.contiguous(), group=piece.group)  # rank j's at [j·B, (j+1)·B)
        where = torch.cat([_positions(n * piece.size, piece.size, j, piece.balance, expert.device)
                           for j in range(piece.size)])  # the place of each gathered token in the longer piece
        whole = whole.new_empty((batch, n * piece.size, k))
        whole[:, where] = gathered.view(piece.size, batch, n, k).transpose(0, 1).reshape(batch, -1, k)
        mine = _positions(n * piece.size, piece.size, piece.rank, piece.balance, expert.device)[mine]
    return whole, mine


class RoutingObserver:
    """Who watches the routing: told, once per forward of a layer, the slots it routed to each expert ([N],
    before capacity), which it kept ([T, k] bool, None when dropless), and the rows it sent and received (S, R:
    host ints). Nobody by default; the accounting subscribes its record (`MoEAxis.observe`, observers.RoutedLoad),
    which decides which forwards belong to training (not evaluation, sampling, or a checkpointed recompute)."""

    def routed(self, layer: MoE, load: torch.Tensor, keep: torch.Tensor | None, sent: int, received: int) -> None:
        pass


# ---------------------------------------------------------------------------------------------------------
# Wiring: which blocks, the flags, the expert-parallel split, the handle train.py talks to
# ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ExpertsConfig:
    """The experts of a MoE model, as the --moe-* flags set them: what GPTConfig.moe carries (model.py never
    reads it; `swap_in` does). Every n-th block is MoE (blocks n-1, 2n-1, ...)."""

    experts: int  # N
    topk: int = 2  # k
    every: int = 1  # n
    capacity_factor: float = 0.0  # f (0: dropless)
    aux_coef: float = 0.01  # α, the load-balance loss
    z_coef: float = 0.001  # β, the router z-loss
    shared_experts: int = 0  # S always-on experts (experts/shared.py)
    # DeepSeek-V3's router (experts/router.py): scores, the bias's update rate γ, the seq loss's α, the weights'
    # scale, G groups of which a token reaches M (0: no limit).
    score: str = "softmax"
    bias_rate: float = 0.0
    seq_aux_coef: float = 0.0
    route_scale: float = 1.0
    groups: int = 0
    group_limit: int = 0

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.experts > 0 and (layer_id + 1) % self.every == 0


DENSE = ExpertsConfig(experts=0)  # what a dense model's blocks are: no expert, no MoE layer


def experts_of(config) -> ExpertsConfig:
    """The experts of a GPTConfig: its `moe`, or DENSE when it has none (what the accounting's formulas read)."""
    return config.moe or DENSE


# Flag → ExpertsConfig field. --ep E is the mesh's; --moe-replicas R, experts/eplb.py's.
FLAGS = {"--moe-experts": "experts", "--moe-topk": "topk", "--moe-every": "every",
         "--moe-capacity-factor": "capacity_factor", "--moe-aux-coef": "aux_coef", "--moe-z-coef": "z_coef",
         "--moe-shared-experts": "shared_experts", **router.FLAGS}


def experts_config(args) -> ExpertsConfig | None:
    """GPTConfig.moe from parsed flags (argparse's names: args.moe_experts, ...; defaults where absent), None
    when --moe-experts is 0: a dense model."""
    defaults = ExpertsConfig(experts=0)
    values = {field: getattr(args, flag[2:].replace("-", "_"), getattr(defaults, field))
              for flag, field in FLAGS.items()}
    return ExpertsConfig(**values) if values["experts"] else None


def experts_from_record(model: dict) -> ExpertsConfig | None:
    """GPTConfig.moe from a checkpoint's model record (GPTConfig.architecture: "moe", the fields as a dict or
    None; a checkpoint written before the experts had a record of their own has them as moe_* fields)."""
    if "moe" in model:
        return ExpertsConfig(**model["moe"]) if model["moe"] else None
    fields = {name.removeprefix("moe_"): value for name, value in model.items() if name.startswith("moe_")}
    return ExpertsConfig(**fields) if fields.get("experts") else None


def check_flags(config, shape) -> None:
    """Raise ValueError naming the flag when the MoE flags (config.moe, --ep in `shape`, a mesh.MeshShape)
    cannot work together on this mesh; pure, run once before any process group (flags.validate, before the batch
    arithmetic). Each flag's own range (N, f, α, β ≥ 0; k, --moe-every, E ≥ 1) is checked once, in
    flags.check_ranges, infer_mesh_shape."""
    experts = experts_of(config)
    n, k, ep, every = experts.experts, experts.topk, shape.ep, experts.every
    for broken, message in (
            (n == 0 and ep > 1, f"--ep {ep} needs experts to split: set --moe-experts N (a multiple of {ep})"),
            (n > 0 and not 1 <= k <= n, f"--moe-topk {k} must be between 1 and --moe-experts {n}"),
            (n > 0 and n % ep, f"--ep {ep} must divide --moe-experts {n} (each rank holds N/E whole experts)"),
            (n > 0 and (shape.dp * shape.cp) % ep, f"--ep {ep} must divide the data × context ranks D·C ="
                                                   f" {shape.dp}·{shape.cp} = {shape.dp * shape.cp} (expert"
                                                   f" parallel is carved out of them)"),
            (n > 0 and not 1 <= every <= config.n_layer,
             f"--moe-every {every} must be between 1 and --n-layer {config.n_layer} (else no block is MoE)")):
        if broken:
            raise ValueError(message)
    if n > 0:
        router.check_flags(experts, ep)


@dataclass(frozen=True)
class MoEConfig:
    """The expert-parallel layout of a MoE model (the experts themselves are GPTConfig.moe's): E = --ep, whether
    the micro-batch is cut over TP too (--sp), how CP cut it (its pieces' positions), and R physical slots with
    --moe-replicas (experts/eplb.py places them; the exchange sends by slot)."""

    ep: int = 1
    sequence_parallel: bool = False
    cp_balance: str | None = None  # None without CP
    replicas: int = 0  # R, --moe-replicas; 0: none, the N experts in place


def config_from_flags(args, settings) -> MoEConfig | None:
    """The MoE layout on this mesh (its flags checked by flags.validate, check_flags); None when dense."""
    if settings.model.moe is None:
        return None
    return MoEConfig(settings.shape.ep, settings.sequence_parallel, args.cp_balance if settings.shape.cp > 1 else None,
                     getattr(args, "moe_replicas", 0))


def swap_in(model) -> list:
    """Replace the dense MLP of each block its config's `moe` makes MoE (`ExpertsConfig.is_moe_layer`) by a MoE
    layer, in place, as tensor parallel swaps linears: the plain model (model.py) is dense, and this is where
    its experts come from. The new tensors are named under the block's `mlp` (`transformer.h.<i>.mlp.experts.
    <e>.c_fc.weight`, ...) and take their per-parameter init (shard.materialize), or stay shapes on a meta
    model (train.compose builds on meta, the axes cut, then one materialize). A pipeline stage swaps the
    blocks it holds. Returns the MoE layers; a block already swapped stays (idempotent)."""
    like = next(model.parameters())
    for block in model.transformer.h:
        if experts_of(model.config).is_moe_layer(block.layer_id) and not isinstance(block.mlp, MoE):
            with torch.device("meta"):
                block.mlp = MoE(model.config, block.layer_id, model.aux_losses).to(like.dtype)
    describe(model)
    if not like.is_meta:
        materialize(model, like.device, model.initial_value)
    return [block.mlp for block in model.transformer.h if isinstance(block.mlp, MoE)]


def shard_experts(layer: MoE, ep_group, ep_size: int, ep_index: int) -> None:
    """Keep experts [e·N/E, (e+1)·N/E) of the layer (e = ep_index), drop the others (on a meta model, as
    train.compose builds it, they were never allocated); the kept ones are the single-device experts, bitwise."""
    per_rank = layer.n_experts // ep_size
    layer.local = range(ep_index * per_rank, (ep_index + 1) * per_rank)
    for i in range(layer.n_experts):
        if i not in layer.local:
            del layer.experts[str(i)]
    layer.ep_group, layer.ep_size = (ep_group, ep_size) if ep_size > 1 else (None, 1)
    for param in layer.experts.parameters():  # whole tensors, summed over the ranks holding the same experts
        param.shard_info = replace(param.shard_info, grad_group="expert_dp")


def apply(model, run, config: MoEConfig) -> MoEAxis:
    """Swap in the MoE blocks (`swap_in`) and keep this rank's experts of each (first of the axes, DESIGN.md;
    with --moe-replicas the experts stay whole here and experts/eplb.py, applied next, places the slots); tell
    each layer the ranks holding the other pieces of its micro-batches (`Pieces`: cp as --cp-balance cut it; tp
    with --sp)."""
    mesh, ep = run.mesh, config.ep
    levels = [("cp", config.cp_balance)] if config.cp_balance is not None else []
    levels += [("tp", "contiguous")] if config.sequence_parallel else []
    pieces = tuple(Pieces(mesh.group(name), mesh.size(name), dist.get_rank(mesh.group(name)), balance)
                   for name, balance in levels)
    layers = swap_in(model)
    for layer in layers:
        if not config.replicas:  # experts [e·N/E, (e+1)·N/E)
            shard_experts(layer, mesh.group("ep"), ep, mesh.index("ep"))
        layer.pieces = pieces
        layer.load.on(run.device)
        layer.places = router.group_places(model.config.moe.groups, ep, mesh.index("ep"))
    sp = mesh.size("tp") if config.sequence_parallel else 1
    traffic = Traffic(model.config, len(layers), run.micro_batch_size * run.seq_len // (mesh.size("cp") * sp),
                      run.micro_batches, ep, mesh.size("cp"), sp, run.compute_dtype.itemsize,
                      max(4, next(model.parameters()).element_size()), run.micro_batch_size, config.replicas,
                      getattr(run.settings.args, "fp8", None),
                      getattr(run.settings.args, "precision_recipe", None) is not None)
    load_groups = [name for name in ("dp_cp", "tp") if mesh.size(name) > 1 and (name != "tp" or sp > 1)]
    tp_group = mesh.group("tp") if config.sequence_parallel else None
    return MoEAxis(layers, traffic, tp_group, mesh, load_groups)


@dataclass(frozen=True)
class MoEFacts:
    """What the accounting reads of the MoE axis (`MoEAxis.facts`): report/axes.py's moe section,
    planner/time_model.py."""

    traffic: Traffic
    experts: range  # the experts this rank holds of every MoE layer, [e·N/E, (e+1)·N/E) (replicas: its slots)
    expert_params: int  # their parameters, all MoE layers
    places: object = None  # with --moe-groups under EP: router.group_places (which ranks share a group)


class MoEAxis(Axis):
    """The handle train.py talks to (step.Axis); `observe` subscribes the accounting to every layer's routing."""

    name = "moe"

    def __init__(self, layers: list, traffic: Traffic, tp_group=None, mesh=None, load_groups=()):
        self.layers, self.traffic, self.mesh = layers, traffic, mesh
        self.tp_group = tp_group  # with --sp: the experts' and router's gradients are summed over it
        self.load_groups = list(load_groups)  # names of the groups whose ranks saw the step's other tokens

    @torch.no_grad()
    def after_grad_sync(self, layout) -> int:
        """With --sp each TP rank routed its sequence piece: sum the experts' and router's gradients over tp.
        Then each layer's step load, global (the bias on), updates its bias (router.finish_step); with
        --moe-replicas the replicas' kept slots per expert ride the same all-reduce (one call, two users) and are
        written back summed, for experts/eplb.py's handle, next, to fold into its average."""
        if self.tp_group is not None:
            sum_in_place([g for g in layout.grad_pieces(self.params()) if g.numel()], self.tp_group)
        replicas = [layer.replicas for layer in self.layers if layer.replicas is not None]
        riders = torch.stack([r.step_load for r in replicas]).long() if replicas else None
        summed = router.finish_step([layer.load for layer in self.layers],  # ONE load all-reduce per group
                                    [self.mesh.group(name) for name in self.load_groups], riders)
        for slots, total in zip(replicas, summed if replicas else ()):
            slots.step_load.copy_(total)
        return 0

    def state_pieces(self) -> list:
        """Each layer's selection bias, "moe/<layer>.expert_bias", one logical copy (experts/router.py item 4)."""
        coords = self.mesh.coordinates() if self.mesh is not None else None
        pieces = []
        for layer in self.layers:
            if layer.load.bias is not None:
                info = ShardInfo(f"transformer.h.{layer.layer_id}.mlp.expert_bias", (layer.n_experts,),
                                 replicated_over=("tp",))
                pieces.append(StatePiece(f"moe/{info.global_name}", layer.load.bias, info,
                                         primary=counts_here(info, coords, ("dp_cp",))))
        return pieces

    @contextmanager
    def sampling(self):
        """model.generate runs whole sequences on every rank (CP's attention swapped out, SP off): no rank
        holds a piece, so capacity and aux statistics are each rank's own, gathered over nothing."""
        pieces = [layer.pieces for layer in self.layers]
        try:
            for layer in self.layers:
                layer.pieces = ()
            yield
        finally:
            for layer, kept in zip(self.layers, pieces):
                layer.pieces = kept

    def observe(self, observer) -> None:
        """Every layer tells `observer` (a RoutingObserver that also counts `rows()`: observers.RoutedLoad) what it
        routed; traced_prediction reads its rows."""
        self.observer = observer
        for layer in self.layers:
            layer.observer = observer

    def facts(self) -> MoEFacts:
        held = sum(p.numel() for layer in self.layers for p in layer.experts.parameters())
        return MoEFacts(self.traffic, self.layers[0].local if self.layers else range(0), held,
                        self.layers[0].places if self.layers else None)

    def params(self) -> list:
        """The routers and the routed experts (whole on every TP rank); not the shared experts, TP's to split."""
        return [p for layer in self.layers for p in (*layer.router.parameters(), *layer.experts.parameters())]

    def predicted_messages(self, layout=None) -> Messages:
        """Item 3 per optimizer step for UNIFORM routing. SP's sum covers the layout's gradient pieces of the experts
        and router (ZeRO: this rank's shard, in its accumulation dtype); no layout: the parameters."""
        sp_grad_bytes = 0
        if self.tp_group is not None:
            pieces = layout.grad_pieces(self.params()) if layout is not None else self.params()
            sp_grad_bytes = sum(g.numel() * g.element_size() for g in pieces)
        out = step_messages(self.traffic, sp_grad_bytes)
        if any(layer.load.reduce for layer in self.layers):
            for message in router.load_messages(len(self.layers), self.traffic.model.moe.experts, self.load_groups):
                out.add(*message)
        return out

    def traced_prediction(self, layout, steps: int) -> Messages:
        """Per step of the `steps` traced training steps: the all-to-alls from the rows the training forwards
        sent and received (exact: the observer's `rows()`), the rest as predicted_messages."""
        out = self.predicted_messages(layout)
        if steps and self.traffic.ep > 1 and self.observer is not None:
            out.pop(ALL_TO_ALL, None)
            out = out + all_to_all_messages(self.traffic, *self.observer.rows()).times(1 / steps)
        return out
