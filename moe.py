"""Mixture of experts (Shazeer et al. 2017; GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021) and expert
parallel, from raw all-to-all collectives.

A MoE block replaces the dense MLP by N experts (each the same GELU MLP, c_fc → GELU → c_proj) and a router.
For each token x the router scores the experts, the token visits the k best, and the block returns the sum
of their outputs weighted by the router: y = Σ_{j<k} w_j · expert_{e_j}(x).

The router (in fp32, or the model's dtype when wider; autocast off):
    z = x·W_rᵀ                      logits, [T, N]
    p = softmax(z)                  over all N experts
    (g, e) = top-k of p             the k chosen experts of each token, in decreasing p
    w = g / Σ_j g_j   (k > 1)       renormalised over the chosen k; w = g for k = 1
For k > 1 this equals Mixtral's softmax over the k chosen logits, and the weights sum to 1, so the output has
the scale of one dense MLP whatever k and N are. For k = 1 renormalising would give w = 1 and the router would
learn only from the auxiliary losses; Switch keeps the raw probability there, and so do we. Pᵢ below uses the
full softmax either way, so the balance loss reaches every expert's logit.

Auxiliary losses, added to the model's channel (`aux_losses.add(name, coef, value)`; the step divides by
the D·m micro-batches, so each term is defined on ONE data-parallel micro-batch, DESIGN.md):
    moe_balance = N · Σᵢ fᵢ·Pᵢ     fᵢ = (slots routed to expert i) / (T·k), before any capacity drop;
                                   Pᵢ = mean over tokens of pᵢ.  1 when balanced; α = --moe-aux-coef
    moe_z       = mean over tokens of (logsumexp z)²                     (ST-MoE);  β = --moe-z-coef
Under context or sequence parallel a rank holds only a piece of its micro-batch: the statistics
(Σ routed slots, Σ p, Σ lse², T) are all-reduced over the ranks that hold the other pieces (cp, and tp with
--sp) with an all-reduce whose BACKWARD IS THE IDENTITY (Megatron's g). Every piece-holder then has the same
value A = a(S), S = Σ_r s_r, and differentiates its own copy: its gradient is ∂a/∂S · ∂s_r/∂θ, through its
own tokens only. The data-parallel SUM over dp×cp (and SP's sum over tp) adds Σ_r ∂a/∂S · ∂s_r/∂θ = ∂A/∂θ:
the gradient of the design objective, once. An all-reduce in backward would count it C times.

Capacity (--moe-capacity-factor f > 0): each expert takes at most C_μ = ⌈B_μ·s·k/N · f⌉ slots of one
micro-batch's B_μ·s tokens; slots beyond it are dropped in TOKEN order (b-major, as one device holds them: the
first ones keep their place, deterministically), and a dropped slot adds nothing (the residual carries the
token). f = 0: dropless. It is decided on the WHOLE micro-batch, exactly as one device decides it, whatever the
mesh: under CP or SP a rank holds a piece (`Pieces`), so it all-gathers the pieces' expert choices, [B_μ, s, k]
in one byte each (N ≤ 256), rebuilds them in token order, runs the same `capacity_keep` and keeps its own
slots' verdicts. The same slots drop on any C and T_tp, so a resume on another mesh trains the same model.
Sampling runs whole sequences on every rank (`MoEAxis.sampling`): the layer then gathers over nothing.

Expert parallel (--ep E): E ranks of one (p, t) slice, the `ep` group carved from the D×C data ranks
(mesh.py), share their tokens; rank e of the group holds experts [e·N/E, (e+1)·N/E) of every MoE layer, whole,
and never the others. A forward (`MoE.dispatch_and_combine`):
    1. route the local tokens; sort the slots by expert (token order inside each expert, dropped slots last)
       and gather the kept ones' rows in that order: the one copy of the token rows on the way in
    2. all_to_all_single of the N per-expert counts: each rank learns how many rows each peer sends it
    3. all_to_all_single of the token rows, split by destination / by source rank (uneven)      (dispatch)
    4. the rows arrive in [source rank][local expert] chunks: each chunk runs through its expert where it
       lies (a view of the received buffer); the outputs are written once, in arrival order, into the
       combine's send buffer (with E = 1 the chunks are the experts' slices of the sorted rows)
    5. the inverse all_to_all_single returns each row to the rank it came from                   (combine)
    6. y[t] = Σ_j w_tj · row(t, j) over the kept slots
Dispatch and combine are one autograd Function, `AllToAll`, whose backward is the reverse all-to-all. The
D×C/E ranks holding the same experts form `expert_dp`: expert gradients are summed there
(`grad_group="expert_dp"`), the router's and every dense parameter's over dp×cp. With E = 1 the experts are
replicated on every data rank (plain data parallel) and nothing is exchanged. Under tensor parallel the
experts and the router are REPLICATED over tp: without --sp every TP rank routes the same tokens and computes
the same thing; with --sp each routes its sequence piece and the experts' and router's gradients are summed
over tp once per step (`MoEAxis.after_grad_sync`). Under pipeline parallel the ranks of an ep group are one
stage: they run the same schedule, so their collectives come in the same order.

Symbols: N experts, k top-k, E expert-parallel size, h hidden, L_moe MoE layers (L in all), T tokens of one
rank's micro-batch (B_μ·s, ÷C under CP, ÷T_tp under SP), C_μ the capacity of a micro-batch, Ψ_e = 8h² + 5h
parameters of one expert, S / R rows a rank sends / receives in one dispatch, e_c bytes of a compute-dtype
element, e_r of a router-dtype one (fp32, or wider), e_i = 1 of a gathered choice (4 when N > 256), m micro-batches.

1. Replicated and split. Split E ways: the experts (whole ones: expert i is one logical tensor per weight,
   `transformer.h.<l>.mlp.experts.<i>.c_fc.weight`) and, in the dispatch, the routed token rows. Replicated:
   the router and all dense parameters (over dp×cp and tp), each expert over the D×C/E ranks of expert_dp.
2. Peak per device. Parameters Ψ_dense + L_moe·(h·N + (N/E)·Ψ_e), ×16 bytes with fp32 grads and AdamW
   (`param_counts`). Temporaries per MoE layer and micro-batch: the router's [T, N] logits and probabilities
   in e_r, the S sorted (sent) and R received rows (h wide), the experts' [R, 4h] hidden activations, their R
   output rows, the S combined rows, S·h gate-weighted rows in max(e_c, e_r); with capacity under CP/SP the
   gathered choices, B_μ·s·k·e_i bytes. Kept for backward: `layer_activation_bytes` (tested against what
   autograd saves; `activation_estimate_delta` is what a MoE-aware Korthikanti estimate adds). Uniform routing:
   S = R = T·k. Worst case (all of the ep group's tokens pick this rank): R = E·T·k dropless, R ≤ N·C_μ with
   capacity (each of E sources sends each local expert at most C_μ rows).
3. Critical path (all synchronous), per MoE layer and micro-batch, group ep (payload = the input tensor):
       forward   all_to_all_single  counts 8N  +  dispatch S·h·e_c  +  combine R·h·e_c
       backward  all_to_all_single  combine's reverse S·h·e_c  +  dispatch's reverse R·h·e_c
   Uniform routing: 5 calls, payload 4·T·k·h·e_c + 8N, of which (E−1)/E crosses the wire (a rank keeps its
   own share). With capacity S ≤ min(T·k, N·C_μ) (uniformly, N·C_μ/(C·T_sp)). Activation checkpointing
   repeats the 3 forward calls in backward. With CP/SP, per MoE layer and forward: one all_reduce of (2N+2)
   e_r values on cp (and on tp), and with capacity one all_gather_single of the expert choices, payload (its
   output) B_μ·s·k·e_i on cp and B_μ·(s/C)·k·e_i on tp (SP's level is gathered first).
   Per step: expert gradients over expert_dp, the router with the dense ones over dp×cp (the layout);
   with --sp one all_reduce of the experts' and router's gradients over tp. `step_messages` computes these
   for uniform routing (the startup table's estimate); `all_to_all_messages` computes the all-to-alls from
   the rows the training forwards did send and receive (`Routing`, recorded by each layer): exact, the end
   table's prediction (`MoEAxis.traced_prediction`). The tests match both with the tracer.
   Host synchronisations, per MoE layer and micro-batch: ONE `.tolist()`, the split sizes (under EP both
   all-to-all splits at once, which all_to_all_single takes as Python ints; with E = 1 the experts' row
   slicing), repeated by an activation-checkpointing recompute. Nothing else waits for the device: no
   nonzero() (dropped slots sort last), no bincount (a scatter-add); the aux values, the load and the dropped
   count stay tensors until a log line reads them (step.train_step: once per step; the load line, through
   `MoEAxis.take_load`: once per line).
4. Restart state: nothing of its own; routing is deterministic (no RNG). Each expert is a whole logical
   tensor named by its global index, so a checkpoint written with one E loads with another.

FLOPs per token (for MFU, `flops_per_token`): 6·N_active + 12·L·H·Q·s with
N_active = V·h + L·4h² + L_dense·8h² + L_moe·(k·8h² + h·N): a token pays for k experts and the router, not
for the N − k idle experts (dropped slots are not subtracted: a convention, stated in the printout).
"""

from __future__ import annotations

import functools
import math
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import mfu
from comm import Messages
from context_parallel import positions
from mesh import MeshShape
from model import GPTConfig
from step import Axis, sum_in_place

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
    """(probabilities [T, N], weights [T, k], experts [T, k]): softmax over all N, top-k, renormalised (k>1)."""
    probs = logits.softmax(dim=-1)
    gate, expert = probs.topk(topk, dim=-1)
    if topk > 1:
        gate = gate / gate.sum(dim=-1, keepdim=True)
    return probs, gate, expert


def capacity(tokens: int, topk: int, n_experts: int, factor: float) -> int | None:
    """C_μ = ⌈T_μ·k/N · f⌉ slots per expert of a micro-batch of T_μ = B_μ·s tokens, or None when dropless."""
    if factor <= 0:
        return None
    return math.ceil(round(tokens * topk * factor / n_experts, 9))  # round: 35.000000001 is 35


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
    """[bins] int64: how many entries of `expert` name each bin. A scatter-add, not torch.bincount, which
    reads the largest value on the host first (a sync on GPUs)."""
    flat = expert.reshape(-1)
    return torch.zeros(bins, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


# ---------------------------------------------------------------------------------------------------------
# The MoE layer: route, decide capacity, dispatch, run the experts, combine
# ---------------------------------------------------------------------------------------------------------


class MoE(nn.Module):
    """The MoE MLP of one block: router, experts (keyed by GLOBAL index: this rank may hold only some), and
    the expert-parallel exchange when `ep_group` is set (`shard_experts`)."""

    def __init__(self, config: GPTConfig, layer_id: int, aux_losses):
        super().__init__()
        self.layer_id, self.aux_losses = layer_id, aux_losses
        self.n_experts, self.topk = config.moe_experts, config.moe_topk
        self.capacity_factor = config.moe_capacity_factor
        self.aux_coef, self.z_coef = config.moe_aux_coef, config.moe_z_coef
        self.router = Router(config.n_embd, config.moe_experts)
        self.experts = nn.ModuleDict({str(i): Expert(config) for i in range(config.moe_experts)})
        self.dropout = nn.Dropout(config.dropout)
        self.local = range(config.moe_experts)  # the experts this rank holds
        self.ep_group, self.ep_size = None, 1
        self.pieces = ()  # Pieces: the ranks holding the other pieces of this rank's micro-batch (CP, SP)
        self.routing = Routing()  # what the training forwards routed, for the accounting (which resets it)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])  # [T, h]: this rank's tokens (its CP/SP piece of the micro-batch)
        logits = self.router(tokens)  # [T, N]
        probs, gate, expert = route(logits, self.topk)  # [T, N], [T, k], [T, k]
        routed = count_per_expert(expert, self.n_experts)  # [N]
        balance, z = router_losses(logits, probs, routed, self.topk, [piece.group for piece in self.pieces])
        self.aux_losses.add("moe_balance", self.aux_coef, balance)
        self.aux_losses.add("moe_z", self.z_coef, z)
        keep = self.keep_slots(expert.view(*x.shape[:-1], self.topk))
        y, rows_sent, rows_received = self.dispatch_and_combine(tokens, gate, expert, keep)
        if self.training and torch.is_grad_enabled() and not _in_backward():  # not eval, sampling, a recompute
            self.routing.add(routed, keep, rows_sent, rows_received)
        return self.dropout(y.view(x.shape).to(x.dtype))  # the fp32 gate must not widen the residual stream

    @torch.no_grad()
    def keep_slots(self, expert: torch.Tensor) -> torch.Tensor | None:
        """[T, k] bool: which of this rank's slots keep their place (None: dropless), decided on the WHOLE
        micro-batch as one device decides it (module docstring, Capacity). expert: [B, n, k], this rank's."""
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
        """Steps 1-6 of the module docstring: send each kept slot's row to its expert's owner and back.
        Returns (y [T, h], S rows sent, R rows received); with E = 1 both are the kept slots."""
        k, n = self.topk, self.n_experts
        slot_expert = expert.reshape(-1)  # [T·k], slot s is token s // k, its choice s % k
        if keep is not None:
            slot_expert = torch.where(keep.reshape(-1), slot_expert, n)  # a dropped slot sorts after every expert
        order = torch.argsort(slot_expert, stable=True)  # 1. kept slots by expert (token order inside), dropped last
        counts = count_per_expert(slot_expert, n + 1)[:n]  # [N] rows per expert
        if self.ep_size > 1:  # 2. destination rank r gets this rank's counts for its experts; we get each source's
            counts_in = torch.empty_like(counts)
            dist.all_to_all_single(counts_in, counts, group=self.ep_group)
            counts = torch.cat([counts, counts_in])  # [N sent per expert, then received per (source, local expert)]
        sizes = counts.tolist()  # the one host sync: the split sizes (E = 1: the experts' row slicing)
        order = order[:sum(sizes[:n])]  # the kept slots
        sent = _autocast_input(tokens)[order // k]  # [S, h] by expert, hence by destination: the one copy in
        if self.ep_size == 1:
            back, rows_received = self.run_local_experts(sent, sizes), len(order)  # 4.
        else:
            per_rank = n // self.ep_size
            send_splits = [sum(sizes[r * per_rank:(r + 1) * per_rank]) for r in range(self.ep_size)]
            recv_splits = [sum(sizes[n + r * per_rank:n + (r + 1) * per_rank]) for r in range(self.ep_size)]
            received = AllToAll.apply(sent, recv_splits, send_splits, self.ep_group)  # 3. dispatch
            out = self.run_local_experts(received, sizes[n:])  # 4.
            back, rows_received = AllToAll.apply(out, send_splits, recv_splits, self.ep_group), sum(recv_splits)  # 5.
        weighted = back * gate.reshape(-1)[order].unsqueeze(1)  # 6. [S, h]
        y = torch.zeros((tokens.shape[0], tokens.shape[1]), dtype=weighted.dtype, device=tokens.device)
        return y.index_add(0, order // k, weighted), len(order), rows_received

    def run_local_experts(self, rows: torch.Tensor, sizes: list) -> torch.Tensor:
        """rows arrive in chunks of `sizes` rows, [source rank][local expert] (one source when E = 1); each
        chunk runs through its expert where it lies (a view of the received buffer, no copy), and the outputs
        are written once, in the same order, into one buffer (under EP, the combine's send buffer)."""
        n_local = len(self.local)
        chunks = rows.split(sizes)
        return torch.cat([self.experts[str(self.local[i % n_local])](chunk) for i, chunk in enumerate(chunks)])


class Expert(nn.Module):
    """One expert: the dense MLP's shape (c_fc → GELU → c_proj), plain nn.Linears that FP8/TP can wrap."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class AllToAll(torch.autograd.Function):
    """Rows [Σ input_splits, ...] → [Σ output_splits, ...]: rank r's i-th chunk goes to rank i, which puts it
    in its r-th chunk. Backward is the reverse all-to-all (splits swapped). Dispatch and combine both use it."""

    @staticmethod
    def forward(ctx, x, output_splits: list, input_splits: list, group):
        ctx.output_splits, ctx.input_splits, ctx.group = output_splits, input_splits, group
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=output_splits,
                               input_split_sizes=input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((sum(ctx.input_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), output_split_sizes=ctx.input_splits,
                               input_split_sizes=ctx.output_splits, group=ctx.group)
        return out, None, None, None


def _autocast_input(x: torch.Tensor) -> torch.Tensor:
    """Cast to the autocast dtype now, as the expert's first linear would: the dispatch moves 16-bit rows."""
    device = x.device.type
    return x.to(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else x


def _in_backward() -> bool:
    """True while autograd runs a backward pass: a checkpointed block re-running its forward."""
    return torch._C._current_graph_task_id() != -1


# ---------------------------------------------------------------------------------------------------------
# A micro-batch in pieces (CP, SP): the aux statistics summed, the capacity decided on the whole
# ---------------------------------------------------------------------------------------------------------


class SumOverPieces(torch.autograd.Function):
    """All-reduce (sum) forward, IDENTITY backward: the aux-loss statistics of a micro-batch whose tokens
    are spread over `group` (CP pieces, SP pieces). Each rank differentiates its own copy of the whole value;
    the data-parallel gradient sum adds the pieces' contributions (module docstring)."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def router_losses(logits: torch.Tensor, probs: torch.Tensor, routed: torch.Tensor, topk: int, groups=()):
    """(balance, z): N·Σᵢ fᵢ·Pᵢ and mean (logsumexp z)², over the whole micro-batch (its pieces summed over
    `groups`). routed: [N] slots routed to each expert by this rank (before capacity)."""
    n = probs.shape[-1]
    lse = torch.logsumexp(logits, dim=-1)
    stats = torch.cat([routed.to(probs.dtype), probs.sum(dim=0), (lse * lse).sum().view(1),
                       torch.full((1,), logits.shape[0], dtype=probs.dtype, device=probs.device)])
    for group in groups:
        stats = SumOverPieces.apply(stats, group)
    tokens = stats[-1]
    f, p = stats[:n] / (tokens * topk), stats[n:2 * n] / tokens
    return n * (f * p).sum(), stats[2 * n] / tokens


@dataclass(frozen=True)
class Pieces:
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


@dataclass
class Routing:
    """What one layer's training forwards routed since the accounting last took it (`MoEAxis.take_load`):
    the forwards, Σ S rows sent and Σ R received (host ints: the split sizes are on the host anyway), and, on
    the device until a line reads them, the slots routed to each expert (before capacity) and those dropped."""

    forwards: int = 0
    sent: int = 0
    received: int = 0
    load: torch.Tensor | None = None  # [N]
    dropped: torch.Tensor | int = 0

    def add(self, routed: torch.Tensor, keep: torch.Tensor | None, sent: int, received: int) -> None:
        self.forwards, self.sent, self.received = self.forwards + 1, self.sent + sent, self.received + received
        self.load = routed if self.load is None else self.load + routed
        if keep is not None:
            self.dropped = self.dropped + (~keep).sum()


# ---------------------------------------------------------------------------------------------------------
# Wiring: which blocks, the flags, the expert-parallel split, the handle train.py talks to
# ---------------------------------------------------------------------------------------------------------

# Flag → (GPTConfig field, default). --ep E is the mesh's.
FLAGS = {"--moe-experts": ("moe_experts", 0), "--moe-topk": ("moe_topk", 2), "--moe-every": ("moe_every", 1),
         "--moe-capacity-factor": ("moe_capacity_factor", 0.0), "--moe-aux-coef": ("moe_aux_coef", 0.01),
         "--moe-z-coef": ("moe_z_coef", 0.001)}


def config_overrides(args) -> dict:
    """The GPTConfig fields from parsed flags (argparse's names: args.moe_experts, ...), defaults if absent."""
    return {field: getattr(args, field, default) for field, default in FLAGS.values()}


def is_moe_layer(config: GPTConfig, layer_id: int) -> bool:
    """Every n-th block is MoE (--moe-every n): blocks n-1, 2n-1, ... (all of them for n = 1)."""
    return config.moe_experts > 0 and (layer_id + 1) % config.moe_every == 0


def check_flags(config: GPTConfig, shape: MeshShape) -> None:
    """Raise ValueError naming the flag when the MoE flags (config's moe_* fields, --ep in shape) cannot work
    on this mesh; pure, run once before any process group (config_from_flags)."""
    n, ep = config.moe_experts, shape.ep
    if n < 0:
        raise ValueError(f"--moe-experts must be ≥ 0 (0: dense MLP), got {n}")
    if ep < 1:
        raise ValueError(f"--ep must be a positive integer, got {ep}")
    if n == 0:
        if ep > 1:
            raise ValueError(f"--ep {ep} needs experts to split: set --moe-experts N (a multiple of {ep})")
        return
    if not 1 <= config.moe_topk <= n:
        raise ValueError(f"--moe-topk {config.moe_topk} must be between 1 and --moe-experts {n}")
    if n % ep:
        raise ValueError(f"--ep {ep} must divide --moe-experts {n} (each rank holds N/E whole experts)")
    if (shape.dp * shape.cp) % ep:
        raise ValueError(f"--ep {ep} must divide the data × context ranks D·C = {shape.dp}·{shape.cp} ="
                         f" {shape.dp * shape.cp} (expert parallel is carved out of them)")
    if not 1 <= config.moe_every <= config.n_layer:
        raise ValueError(f"--moe-every {config.moe_every} must be between 1 and --n-layer {config.n_layer}"
                         f" (else no block is MoE)")
    if config.moe_capacity_factor < 0:
        raise ValueError(f"--moe-capacity-factor must be ≥ 0 (0: dropless), got {config.moe_capacity_factor}")
    if config.moe_aux_coef < 0 or config.moe_z_coef < 0:
        raise ValueError(f"--moe-aux-coef and --moe-z-coef must be ≥ 0, got {config.moe_aux_coef} and"
                         f" {config.moe_z_coef}")


@dataclass(frozen=True)
class MoEConfig:
    """The expert-parallel layout of a MoE model (the experts themselves are GPTConfig's moe_* fields):
    E = --ep, whether the micro-batch is cut over TP too (--sp), and how CP cut it (its pieces' positions)."""

    ep: int = 1
    sequence_parallel: bool = False
    cp_balance: str | None = None  # None without CP


def config_from_flags(args, settings) -> MoEConfig | None:
    """The MoE flags on this mesh, or ValueError naming the flag (before any process group); None when dense."""
    check_flags(settings.model, settings.shape)
    if settings.model.moe_experts == 0:
        return None
    return MoEConfig(settings.shape.ep, settings.sequence_parallel, args.cp_balance if settings.shape.cp > 1 else None)


def shard_experts(layer: MoE, ep_group, ep_size: int, ep_index: int) -> None:
    """Keep experts [e·N/E, (e+1)·N/E) of `layer` (e = ep_index) and drop the rest; records say expert_dp.

    The plain GPT materialised all N experts at construction (as tensor parallel materialises the full weights
    it then slices); dropping frees the others, so from here on a rank holds N/E of them. The kept ones are
    the plain model's tensors, initialised from their global names: bitwise the single-device experts.
    """
    per_rank = layer.n_experts // ep_size
    layer.local = range(ep_index * per_rank, (ep_index + 1) * per_rank)
    for i in range(layer.n_experts):
        if i not in layer.local:
            del layer.experts[str(i)]
    layer.ep_group, layer.ep_size = (ep_group, ep_size) if ep_size > 1 else (None, 1)
    for param in layer.experts.parameters():  # whole tensors, summed over the ranks holding the same experts
        param.shard_info = replace(param.shard_info, grad_group="expert_dp")


def apply(model, run, config: MoEConfig) -> MoEAxis:
    """Keep this rank's experts of every MoE block of `model` (first of the axes, DESIGN.md).

    run.mesh gives the ep group (E ranks of the D×C slice), this rank's index in it, and the ranks holding
    the other pieces of its micro-batches (`Pieces`: cp when C > 1, cut as --cp-balance says; tp with --sp,
    contiguous), over which the aux-loss statistics are summed and the capacity decided.
    """
    mesh, ep = run.mesh, config.ep
    levels = [("cp", config.cp_balance)] if config.cp_balance is not None else []
    levels += [("tp", "contiguous")] if config.sequence_parallel else []
    pieces = tuple(Pieces(mesh.group(name), mesh.size(name), dist.get_rank(mesh.group(name)), balance)
                   for name, balance in levels)
    layers = [block.mlp for block in model.transformer.h if isinstance(block.mlp, MoE)]
    for layer in layers:
        shard_experts(layer, mesh.group("ep"), ep, mesh.index("ep"))
        layer.pieces = pieces
    sp = mesh.size("tp") if config.sequence_parallel else 1
    traffic = Traffic(model.config, len(layers), run.micro_batch_size * run.seq_len // (mesh.size("cp") * sp),
                      run.micro_batches, ep, mesh.size("cp"), sp, run.compute_dtype.itemsize,
                      max(4, next(model.parameters()).element_size()))
    return MoEAxis(layers, traffic, mesh.group("tp") if config.sequence_parallel else None)


class MoEAxis(Axis):
    """The handle train.py talks to (step.Axis): SP's gradient sum over tp, the sampling context, the uniform
    and the exact (from the layers' `Routing`) message predictions; `take_load` for report.py's load line."""

    name = "moe"

    def __init__(self, layers: list, traffic: Traffic, tp_group=None):
        self.layers, self.traffic = layers, traffic
        self.tp_group = tp_group  # with --sp: the experts' and router's gradients are summed over it
        self.taken = Routing()  # the forwards and rows of the Routing taken so far (host ints)
        self.last_load = None  # the last take_load, for the end lines

    @torch.no_grad()
    def after_grad_sync(self, layout) -> int:
        """With --sp each TP rank routed its sequence piece: sum the experts' and router's gradients over tp."""
        if self.tp_group is not None:
            sum_in_place([g for g in layout.grad_pieces(self.params()) if g.numel()], self.tp_group)
        return 0

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

    def params(self) -> list:
        return [p for layer in self.layers for p in layer.parameters()]

    def predicted_messages(self, layout=None) -> Messages:
        """Per optimizer step, for UNIFORM routing (docstring item 3). With SP, after_grad_sync sums exactly the
        layout's gradient pieces of the experts and the router (ZeRO: this rank's shard of them, in its
        accumulation dtype); without a layout, the whole parameters."""
        sp_grad_bytes = 0
        if self.tp_group is not None:
            pieces = layout.grad_pieces(self.params()) if layout is not None else self.params()
            sp_grad_bytes = sum(g.numel() * g.element_size() for g in pieces)
        return step_messages(self.traffic, sp_grad_bytes)

    def traced_prediction(self, layout, steps: int) -> Messages:
        """Per step of the `steps` traced training steps: the all-to-alls from the rows the training forwards
        sent and received (exact), the rest as predicted_messages."""
        out = self.predicted_messages(layout)
        if self.traffic.ep > 1 and steps:
            out.pop(ALL_TO_ALL, None)
            routed = [self.taken, *(layer.routing for layer in self.layers)]
            out = out + all_to_all_messages(self.traffic, sum(r.forwards for r in routed),
                                            sum(r.sent for r in routed), sum(r.received for r in routed)).times(1 / steps)
        return out

    def reset_routing(self) -> None:
        """Forget what the layers routed so far (start-up's forwards, which are no training step)."""
        for layer in self.layers:
            layer.routing = Routing()
        self.taken, self.last_load = Routing(), None

    def take_load(self):
        """(loads [layer][N], dropped, steps): the slots this rank's training forwards routed to each expert
        (before capacity) and dropped, per MoE layer, since the last take, read on the host in ONE `.tolist()`;
        None when nothing was routed. The layers start afresh; their forwards and rows stay counted."""
        recorded = [layer.routing for layer in self.layers if layer.routing.load is not None]
        if not recorded:
            return None
        stats = torch.stack([torch.cat([r.load, (r.load.new_zeros(()) + r.dropped).view(1)])
                             for r in recorded]).tolist()  # [layer][N routed per expert, dropped]
        for r in recorded:
            self.taken = Routing(self.taken.forwards + r.forwards, self.taken.sent + r.sent,
                                 self.taken.received + r.received)
        for layer in self.layers:
            layer.routing = Routing()
        steps = recorded[0].forwards // max(1, self.traffic.micro_batches)  # each layer runs m times a step
        self.last_load = ([row[:-1] for row in stats], sum(row[-1] for row in stats), steps)
        return self.last_load


ALL_TO_ALL = ("all_to_all_single", "ep")


# ---------------------------------------------------------------------------------------------------------
# Prediction formulas (docstring items 2 and 3, FLOPs)
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Traffic:
    """What the message formulas read: the model's MoE shape and what one micro-batch routes on this rank."""

    model: GPTConfig  # N, k, h, the capacity factor, activation checkpointing
    moe_layers: int = 1  # L_moe this rank holds (a pipeline stage holds some)
    tokens: int = 0  # T: tokens this rank routes per micro-batch, B_μ·s/(C·T_sp)
    micro_batches: int = 1  # m
    ep: int = 1  # E
    cp: int = 1  # C
    sp: int = 1  # T_tp with --sp, else 1
    compute_bytes: int = 2  # e_c of the rows
    router_bytes: int = 4  # e_r


def expert_params(config: GPTConfig) -> int:
    """Ψ_e, one expert: c_fc h·4h (+4h) and c_proj 4h·h (+h) = 8h² + 5h with biases."""
    h = config.n_embd
    return 8 * h * h + 5 * h * int(config.bias)


def param_counts(config: GPTConfig) -> dict:
    """The logical model's parameters: total (every expert, tied weights once) and ACTIVE per token (k experts)."""
    h, L, V, n, k, b = (config.n_embd, config.n_layer, config.vocab_size, config.moe_experts, config.moe_topk,
                        int(config.bias))
    moe_layers = sum(is_moe_layer(config, i) for i in range(L))
    psi_e = expert_params(config)
    blocks = L * (4 * h * h + 4 * h * b + 2 * h * (1 + b)) + (L - moe_layers) * psi_e  # attn, LNs, dense MLPs
    shared = V * h + config.block_size * h + blocks + h * (1 + b) + moe_layers * h * n  # ... ln_f, routers
    return {"total": shared + moe_layers * n * psi_e, "active": shared + moe_layers * k * psi_e,
            "experts": moe_layers * n * psi_e, "expert": psi_e, "router": moe_layers * h * n,
            "moe_layers": moe_layers}


def active_matmul_params(config: GPTConfig) -> int:
    """N_active of 6N: V·h (head) + L·4h² + L_dense·8h² + L_moe·(k·8h² + h·N) matmul weights a token uses."""
    h, L = config.n_embd, config.n_layer
    moe_layers = sum(is_moe_layer(config, i) for i in range(L))
    mlp = (L - moe_layers) * 8 * h * h + moe_layers * (config.moe_topk * 8 * h * h + h * config.moe_experts)
    return config.vocab_size * h + L * 4 * h * h + mlp


def flops_per_token(config: GPTConfig, seq_len: int, recompute: bool = False) -> mfu.FlopsPerToken:
    """mfu.FlopsPerToken from the ACTIVE parameters plus the router: MFU is not inflated by idle experts."""
    n_active = active_matmul_params(config)
    return mfu.flops_per_token(n_active, config.n_layer, config.n_head, config.head_dim, seq_len,
                               recompute=recompute, n_recomputed_params=n_active - config.vocab_size * config.n_embd)


def layer_activation_bytes(config: GPTConfig, tokens: int, compute_bytes: int = 2, router_bytes: int = 4,
                           mask_bytes: int = 1) -> int:
    """Bytes ONE MoE layer saves for backward per micro-batch (weights and their autocast copies aside), for
    T = `tokens` routed by this rank, uniform routing without drops (S = R = T·k; exact for E = 1):
        router    T·e_r·(h + 2N + 1 + [k > 1]·(k + 1)) + 8·T·k   its e_r input, logits, probabilities, lse,
                                                               (k > 1: top-k values, their sum), indices
        dispatch  S·(3·8 + e_r)        the sort's order, each row's token (gather, index_add), each row's gate
        rows      S·h·(2·e_c + e_w)    rows in, rows back, the weighted rows index_add keeps (e_w = max(e_c, e_r))
        experts   R·8h·e_c             GELU's input and output
    + e_r·(4N + 3) of statistics, + T·h·mask_bytes with dropout (1 on GPUs; the element size on CPUs, whose
    dropout keeps a scaled mask)."""
    n, k, h = config.moe_experts, config.moe_topk, config.n_embd
    slots = tokens * k
    router = tokens * router_bytes * (h + 2 * n + 1 + (k + 1 if k > 1 else 0)) + 8 * slots
    dispatch = slots * (3 * 8 + router_bytes)
    rows = slots * h * (2 * compute_bytes + max(compute_bytes, router_bytes))
    experts = slots * 8 * h * compute_bytes
    mask = tokens * h * mask_bytes if config.dropout > 0 else 0
    return router + dispatch + rows + experts + mask + router_bytes * (4 * n + 3)


def activation_estimate_delta(config: GPTConfig, moe_blocks: int, seq: int, micro: int, tp: int = 1,
                              sequence_parallel: bool = False) -> float:
    """What a MoE-aware activation estimate adds to Korthikanti's dense one (mfu.activation_bytes_per_layer,
    16-bit, s = this rank's sequence, s/C under CP) for `moe_blocks` held MoE blocks: each one's own bytes
    (layer_activation_bytes at e_c = 2, e_r = 4, for its T = s·b tokens, /T_tp with SP: experts are whole on
    every TP rank) minus the dense MLP's share it replaces, 19·s·b·h ((3 + 16/t)·s·b·h under TP, 19·s·b·h/t
    with SP: c_fc's input 2, GELU's input and output 16, the dropout mask 1)."""
    sbh = seq * micro * config.n_embd
    dense_mlp = 19 * sbh / tp if sequence_parallel else (3 + 16 / tp) * sbh
    tokens = seq * micro // (tp if sequence_parallel else 1)
    return moe_blocks * (layer_activation_bytes(config, tokens) - dense_mlp)


def all_to_all_messages(traffic: Traffic, forwards: int, sent: float, received: float) -> Messages:
    """The all_to_all_single calls on ep of `forwards` training forwards of MoE layers (each with its backward,
    and its recompute under activation checkpointing) that sent Σ S = `sent` and received Σ R = `received`
    rows: per forward 3 calls (counts 8N, dispatch S·h·e_c, combine R·h·e_c), ×2 recomputed, + 2 in backward
    (the reverses, (S + R)·h·e_c)."""
    repeats = 2 if traffic.model.activation_checkpointing else 1
    row_bytes = traffic.model.n_embd * traffic.compute_bytes
    return Messages().add(*ALL_TO_ALL, forwards * (3 * repeats + 2),
                          forwards * repeats * 8 * traffic.model.moe_experts + (repeats + 1) * (sent + received) * row_bytes)


def step_messages(traffic: Traffic, sp_grad_bytes: int = 0) -> Messages:
    """Predicted messages of one optimizer step for UNIFORM routing (docstring item 3).

    Per MoE layer and micro-batch, S = R = T·k rows (at most N·C_μ/(C·T_sp), this rank's share of what capacity
    keeps): all_to_all_messages of them on ep when E > 1. CP (C > 1) and SP (T_tp > 1): per MoE layer and
    forward one all_reduce of (2N+2) router-dtype values on cp / tp and, with capacity, one all_gather_single of
    the expert choices (e_i = 1 byte, N ≤ 256; else 4): on tp the CP piece's B_μ·s/C·k·e_i, on cp the
    micro-batch's B_μ·s·k·e_i (its output). SP adds the per-step all_reduce of the experts' and router's
    gradients on tp (`sp_grad_bytes`, the layout's pieces of them).
    """
    t, n, k = traffic, traffic.model.moe_experts, traffic.model.moe_topk
    whole = t.tokens * t.cp * t.sp  # B_μ·s
    rows = t.tokens * k
    cap = capacity(whole, k, n, t.model.moe_capacity_factor)
    if cap is not None:
        rows = min(rows, n * cap / (t.cp * t.sp))
    passes = t.moe_layers * t.micro_batches
    out = all_to_all_messages(t, passes, passes * rows, passes * rows) if t.ep > 1 else Messages()
    forwards = passes * (2 if t.model.activation_checkpointing else 1)
    choice_bytes = 1 if n <= 256 else 4
    for group, size, gathered in (("cp", t.cp, whole), ("tp", t.sp, whole // t.cp)):
        if size > 1:
            out.add("all_reduce", group, forwards, forwards * (2 * n + 2) * t.router_bytes)
            if cap is not None:
                out.add("all_gather_single", group, forwards, forwards * gathered * k * choice_bytes)
    if t.sp > 1 and sp_grad_bytes:
        out.add("all_reduce", "tp", 1, sp_grad_bytes)
    return out
