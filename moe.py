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
The variant: softmax over all N, then top-k, then renormalise. For k > 1 this equals Mixtral's softmax over
the k chosen logits, and the weights sum to 1, so the output has the scale of one dense MLP whatever k and
N are. For k = 1 renormalising would give w = 1 and the router would learn only from the auxiliary losses;
Switch keeps the raw probability there, and so do we. Pᵢ below uses the full softmax either way, so the
balance loss reaches every expert's logit.

Auxiliary losses, added to the model's channel (`aux_losses.add(name, coef, value)`; the step divides by
the D·m micro-batches, so each term is defined on ONE data-parallel micro-batch, DESIGN.md):
    moe_balance = N · Σᵢ fᵢ·Pᵢ     fᵢ = (slots routed to expert i) / (T·k), before any capacity drop;
                                   Pᵢ = mean over tokens of pᵢ.  1 when balanced; α = --moe-aux-coef
    moe_z       = mean over tokens of (logsumexp z)²                     (ST-MoE);  β = --moe-z-coef
Under context or sequence parallel a rank holds only a piece of its micro-batch: the statistics
(Σ routed slots, Σ p, Σ lse², T) are all-reduced over the ranks that hold the other pieces (cp, and tp with
--sp) with an all-reduce whose BACKWARD IS THE IDENTITY (Megatron's g). Every piece-holder then has the same
value A = a(S), S = Σ_r s_r the summed statistics, and differentiates its own copy: its gradient is
∂a/∂S · ∂s_r/∂θ, through its own tokens only. The data-parallel SUM over dp×cp (and SP's sum over tp)
adds Σ_r ∂a/∂S · ∂s_r/∂θ = ∂A/∂θ: exactly the gradient of the design objective, once. An all-reduce in
backward would count it C times.

Capacity (--moe-capacity-factor f > 0): each expert takes at most C_μ = ⌈B_μ·s·k/N · f⌉ slots of one
micro-batch's B_μ·s tokens; slots beyond it are dropped in TOKEN order (the micro-batch's tokens b-major, as
one device holds them: token t before token t+1, the first ones keep their place, deterministically), and a
dropped slot adds nothing (the residual carries the token). f = 0: dropless. It is decided before dispatch
on the WHOLE micro-batch, exactly as one device decides it, whatever the mesh: under CP or SP a rank holds a
piece (`Pieces`: its CP cut, zig-zag or contiguous, and SP's contiguous 1/T_tp of that), so it all-gathers
the pieces' expert choices, [B_μ, s, k] in one byte each (N ≤ 256), rebuilds them in token order, runs the
same `capacity_keep` and keeps its own slots' verdicts. The same slots drop on any C and T_tp, so a resume on
another mesh trains the same model. Sampling runs whole sequences on every rank (`MoEAxis.sampling`): the
layer then gathers over nothing. Without CP/SP each rank routes its own micro-batch and nothing is gathered.

Expert parallel (--ep E): E ranks of one (p, t) slice, the `ep` group carved from the D×C data ranks
(mesh.py), share their tokens; rank e of the group holds experts [e·N/E, (e+1)·N/E) of every MoE layer, whole,
and never the others. A forward:
    1. route the local tokens; sort the slots by expert (token order inside each expert, dropped slots last)
       and gather the kept ones' rows in that order: the one copy of the token rows on the way in
    2. all_to_all_single of the N per-expert counts: each rank learns how many rows each peer sends it
    3. all_to_all_single of the token rows, input_split_sizes = rows per destination rank,
       output_split_sizes = rows per source rank (uneven)                                        (dispatch)
    4. the rows arrive in [source rank][local expert] chunks: each chunk runs through its expert where it
       lies (a view of the received buffer), and the outputs are written once, in arrival order, into one
       buffer, the combine's send buffer (with E = 1 the chunks are the experts' slices of the sorted rows)
    5. the inverse all_to_all_single returns each row to the rank it came from                   (combine)
    6. y[t] = Σ_j w_tj · row(t, j) over the kept slots
Dispatch and combine are one autograd Function, `AllToAll`, whose backward is the reverse all-to-all
(the splits swapped). The D×C/E ranks holding the same experts form `expert_dp`: expert gradients are
summed there (`grad_group="expert_dp"`), the router's and every dense parameter's over dp×cp. With E = 1
the experts are replicated on every data rank (plain data parallel) and nothing is exchanged.
Under tensor parallel the experts and the router are REPLICATED over tp (`replicated_over=("tp",)`): without
--sp every TP rank routes the same tokens and computes the same thing; with --sp each routes its sequence
piece and the experts' and router's gradients are summed over tp once per step (`after_grad_sync`).
Under pipeline parallel the ranks of an ep group are one stage: they run the same schedule, so their
collectives come in the same order.

Symbols: N experts, k top-k, E expert-parallel size, h hidden, L_moe MoE layers (L in all), T tokens of one
rank's micro-batch (B_μ·s, divided by C under CP and by T_tp under SP), C_μ the capacity of a micro-batch,
Ψ_e = 8h² + 5h parameters of one expert (with biases), S / R rows a rank sends / receives in one dispatch,
e_c bytes of a compute-dtype element, e_r of a router-dtype one (fp32, or wider), e_i = 1 of a gathered
expert choice (4 when N > 256), m micro-batches.

1. Replicated and split. Split E ways: the experts (whole ones: expert i is one logical tensor per weight,
   `transformer.h.<l>.mlp.experts.<i>.c_fc.weight`) and, in the dispatch, the routed token rows. Replicated:
   the router and all dense parameters (over dp×cp and tp), each expert over the D×C/E ranks of expert_dp.
2. Peak per device. Parameters Ψ_dense + L_moe·(h·N + (N/E)·Ψ_e), ×16 bytes with fp32 grads and AdamW
   (`param_counts`; the startup lines print this rank's). Temporaries per MoE layer and micro-batch: the
   router's [T, N] logits and probabilities in e_r, the S sorted (sent) and R received rows (h wide), the
   experts' [R, 4h] hidden activations, their R output rows (one buffer), the S combined rows, S·h gate-
   weighted rows in max(e_c, e_r); with capacity under CP/SP the gathered choices, B_μ·s·k·e_i bytes. Kept for
   backward: `layer_activation_bytes` (tested against what autograd saves; `activation_estimate_delta` is
   what a MoE-aware Korthikanti estimate adds). Uniform routing: S = R = T·k. Worst case (all of the ep
   group's tokens pick this rank): R = E·T·k dropless, R ≤ N·C_μ with capacity (each of E sources sends each
   local expert at most C_μ rows).
3. Critical path (all synchronous), per MoE layer and micro-batch, group ep (payload = the input tensor):
       forward   all_to_all_single  counts 8N  +  dispatch S·h·e_c  +  combine R·h·e_c
       backward  all_to_all_single  combine's reverse S·h·e_c  +  dispatch's reverse R·h·e_c
   Uniform routing: 5 calls, payload 4·T·k·h·e_c + 8N, of which (E−1)/E crosses the wire (a rank keeps its
   own share). With capacity S ≤ min(T·k, N·C_μ) (uniformly, N·C_μ/(C·T_sp)). Activation checkpointing
   repeats the 3 forward calls in backward. With CP/SP, per MoE layer and forward: one all_reduce of (2N+2)
   e_r values on cp (and on tp), and with capacity one all_gather_single of the expert choices, payload (its
   output) B_μ·s·k·e_i on cp and B_μ·(s/C)·k·e_i on tp (SP's level is gathered first).
   Per step: expert gradients over expert_dp, the router with the dense ones over dp×cp (the layout);
   with --sp one all_reduce of the experts' and router's gradients over tp. `predicted_messages` (uniform
   routing: the startup table's estimate) and `counted_messages` (from the routed counts: exact, the end
   table's prediction) compute these; the tests match the tracer.
   Host synchronisations, per MoE layer and micro-batch: ONE `.tolist()`, the split sizes (under EP both
   all-to-all splits at once, which all_to_all_single takes as Python ints; with E = 1 the experts' row
   slicing), repeated by an activation-checkpointing recompute. Nothing else waits for the device: no
   nonzero() (dropped slots sort last), no bincount (a scatter-add), the aux values, the load and the dropped
   count stay tensors until a log line reads them (step.train_step: once per step; the load line: once).
4. Restart state: nothing of its own; routing is deterministic (no RNG). Each expert is a whole logical
   tensor named by its global index, so a checkpoint written with one E loads with another: a rank just
   reads different experts.

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

from context_parallel import positions
from model import GPTConfig
from step import Axis, sum_in_place

# ---------------------------------------------------------------------------------------------------------
# The router
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


# ---------------------------------------------------------------------------------------------------------
# Dispatch and combine
# ---------------------------------------------------------------------------------------------------------


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


class Expert(nn.Module):
    """One expert: the dense MLP's shape (c_fc → GELU → c_proj), plain nn.Linears that FP8/TP can wrap."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate=config.gelu_approximate)  # the dense MLP's GELU (GPTConfig.gelu)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


def _autocast_input(x: torch.Tensor) -> torch.Tensor:
    """Cast to the autocast dtype now, as the expert's first linear would: the dispatch moves 16-bit rows."""
    device = x.device.type
    return x.to(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else x


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
        self.reset_load()
        self.reset_messages()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])  # [T, h]: this rank's tokens (its CP/SP piece of the micro-batch)
        logits = self.router(tokens)  # [T, N]
        probs, gate, expert = route(logits, self.topk)  # [T, N], [T, k], [T, k]
        routed = count_per_expert(expert, self.n_experts)  # [N]
        balance, z = router_losses(logits, probs, routed, self.topk, [piece.group for piece in self.pieces])
        self.aux_losses.add("moe_balance", self.aux_coef, balance)
        self.aux_losses.add("moe_z", self.z_coef, z)
        keep = self.keep_slots(expert.view(*x.shape[:-1], self.topk))
        y = self.dispatch_and_combine(tokens, gate, expert, keep)
        self._record(routed, keep)
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

    def dispatch_and_combine(self, tokens, gate, expert, keep) -> torch.Tensor:
        """Steps 1-6 of the module docstring: send each kept slot's row to its expert's owner and back."""
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
            back = self.run_local_experts(sent, sizes)  # 4.
        else:
            per_rank = n // self.ep_size
            send_splits = [sum(sizes[r * per_rank:(r + 1) * per_rank]) for r in range(self.ep_size)]
            recv_splits = [sum(sizes[n + r * per_rank:n + (r + 1) * per_rank]) for r in range(self.ep_size)]
            received = AllToAll.apply(sent, recv_splits, send_splits, self.ep_group)  # 3. dispatch
            out = self.run_local_experts(received, sizes[n:])  # 4.
            back = AllToAll.apply(out, send_splits, recv_splits, self.ep_group)  # 5. combine
            self._count_messages(counts_in, sent, out)
        weighted = back * gate.reshape(-1)[order].unsqueeze(1)  # 6. [S, h]
        y = torch.zeros((tokens.shape[0], tokens.shape[1]), dtype=weighted.dtype, device=tokens.device)
        return y.index_add(0, order // k, weighted)

    def run_local_experts(self, rows: torch.Tensor, sizes: list) -> torch.Tensor:
        """rows arrive in chunks of `sizes` rows, [source rank][local expert] (one source when E = 1); each
        chunk runs through its expert where it lies (a view of the received buffer, no copy), and the outputs
        are written once, in the same order, into one buffer (under EP, the combine's send buffer)."""
        n_local = len(self.local)
        chunks = rows.split(sizes)
        return torch.cat([self.experts[str(self.local[i % n_local])](chunk) for i, chunk in enumerate(chunks)])

    # Records for the accounting (per-step load line, count-based message prediction).

    def reset_load(self):
        # Slots routed to each expert by this rank's training forwards (not recomputes, not evaluation), [N], and
        # slots dropped by capacity: tensors on the forwards' device (load None before the first forward), read
        # on the host only when a load line is printed.
        self.load, self.dropped = None, 0

    def reset_messages(self):
        self.a2a_calls, self.a2a_bytes = 0, 0  # all_to_all_single calls and payload, from the counts

    def _record(self, routed, keep):
        if self.training and torch.is_grad_enabled() and not _in_backward():
            self.load = routed if self.load is None else self.load + routed
            if keep is not None:
                self.dropped = self.dropped + (~keep).sum()

    def _count_messages(self, counts, sent, out):
        """This forward's all-to-alls, and those its backward will send: what the tracer must see."""
        h, rows_sent, rows_received = sent.shape[1], sent.shape[0], out.shape[0]
        self.a2a_calls += 3  # counts, dispatch, combine
        self.a2a_bytes += counts.numel() * counts.element_size() + sent.numel() * sent.element_size() \
            + out.numel() * out.element_size()
        if not _in_backward():  # a recompute (activation checkpointing) has no backward of its own
            if out.requires_grad:  # combine's reverse: the gradient of the S rows that came back
                self.a2a_calls += 1
                self.a2a_bytes += rows_sent * h * out.element_size()
            if sent.requires_grad:  # dispatch's reverse: the gradient of the R rows received
                self.a2a_calls += 1
                self.a2a_bytes += rows_received * h * sent.element_size()


def _in_backward() -> bool:
    """True while autograd runs a backward pass: a checkpointed block re-running its forward."""
    return torch._C._current_graph_task_id() != -1


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


def check_flags(n_experts: int, topk: int = 2, ep: int = 1, dp: int = 1, cp: int = 1, every: int = 1,
                capacity_factor: float = 0.0, n_layer: int | None = None, aux_coef: float = 0.01,
                z_coef: float = 0.001) -> None:
    """Raise ValueError naming the flag when the MoE flags cannot work; pure, call it before init_process_group."""
    if n_experts < 0:
        raise ValueError(f"--moe-experts must be ≥ 0 (0: dense MLP), got {n_experts}")
    if ep < 1:
        raise ValueError(f"--ep must be a positive integer, got {ep}")
    if n_experts == 0:
        if ep > 1:
            raise ValueError(f"--ep {ep} needs experts to split: set --moe-experts N (a multiple of {ep})")
        return
    if not 1 <= topk <= n_experts:
        raise ValueError(f"--moe-topk {topk} must be between 1 and --moe-experts {n_experts}")
    if n_experts % ep:
        raise ValueError(f"--ep {ep} must divide --moe-experts {n_experts} (each rank holds N/E whole experts)")
    if (dp * cp) % ep:
        raise ValueError(f"--ep {ep} must divide the data × context ranks D·C = {dp}·{cp} = {dp * cp}"
                         f" (expert parallel is carved out of them)")
    if every < 1 or (n_layer is not None and every > n_layer):
        raise ValueError(f"--moe-every {every} must be between 1 and --n-layer {n_layer} (else no block is MoE)")
    if capacity_factor < 0:
        raise ValueError(f"--moe-capacity-factor must be ≥ 0 (0: dropless), got {capacity_factor}")
    if aux_coef < 0 or z_coef < 0:
        raise ValueError(f"--moe-aux-coef and --moe-z-coef must be ≥ 0, got {aux_coef} and {z_coef}")


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


@dataclass(frozen=True)
class MoEConfig:
    """The expert-parallel layout of a MoE model (the experts themselves are GPTConfig's moe_* fields):
    E = --ep, whether the micro-batch is cut over TP too (--sp), and how CP cut it (its pieces' positions)."""

    ep: int = 1
    sequence_parallel: bool = False
    cp_balance: str | None = None  # None without CP


def config_from_flags(args, settings) -> MoEConfig | None:
    """The MoE flags on this mesh, or ValueError naming the flag (before any process group); None when dense."""
    config, shape = settings.model, settings.shape
    check_flags(config.moe_experts, config.moe_topk, args.ep, shape.dp, shape.cp, config.moe_every,
                config.moe_capacity_factor, config.n_layer, config.moe_aux_coef, config.moe_z_coef)
    if config.moe_experts == 0:
        return None
    return MoEConfig(args.ep, settings.sequence_parallel, args.cp_balance if shape.cp > 1 else None)


def apply(model, run, config: MoEConfig):
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
    return MoEAxis(model, run, layers, config.sequence_parallel)


class MoEAxis(Axis):
    """The handle train.py talks to (step.Axis), with `step_lines()` (the load line) and the exact, count-based
    all-to-all prediction of the training steps (`counted_messages()`, bracketed by before/after_step)."""

    name = "moe"

    def __init__(self, model, run, layers: list, sequence_parallel: bool):
        self.model, self.run, self.layers, self.sequence_parallel = model, run, layers, sequence_parallel
        self.config, self.ep = model.config, run.mesh.size("ep")
        self.last_load = None
        self.steps_loaded = 0  # training steps whose load the next load line sums (those since the last one)
        self.trained_calls, self.trained_bytes = 0, 0  # all-to-alls of the training steps, from the counts

    def before_step(self) -> None:
        self.reset_message_counts()  # what ran outside training steps (evaluation, start-up probes) is not traced
        if self.steps_loaded == 0:  # nor loaded: the next load line covers training steps only (not CP/TP probes)
            for layer in self.layers:
                layer.reset_load()

    def after_step(self, skipped: bool) -> None:
        calls, payload = self.counted_messages().get(("all_to_all_single", "ep"), (0, 0))
        self.trained_calls, self.trained_bytes = self.trained_calls + calls, self.trained_bytes + payload
        self.steps_loaded += 1

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

    def traced_prediction(self, layout, steps: int) -> dict:
        """Per step over the traced training steps: the all-to-alls from the routed counts (exact), the rest as
        predicted_messages."""
        out = dict(self.predicted_messages(layout))
        if self.ep > 1 and steps:
            out[("all_to_all_single", "ep")] = (self.trained_calls / steps, self.trained_bytes / steps)
        return out

    def params(self) -> list:
        return [p for layer in self.layers for p in layer.parameters()]

    @torch.no_grad()
    def after_grad_sync(self, layout) -> None:
        """With --sp each TP rank routed its sequence piece: sum the experts' and router's gradients over tp."""
        if not self.sequence_parallel:
            return
        sum_in_place([g for g in layout.grad_pieces(self.params()) if g.numel()], self.run.mesh.group("tp"))

    def tokens_per_micro_batch(self) -> int:
        """T: the tokens one rank routes per micro-batch (its CP piece, and SP piece; capacity counts B_μ·s)."""
        mesh = self.run.mesh
        return self.run.micro_batch_size * self.run.seq_len // mesh.size("cp") // (mesh.size("tp") if self.sequence_parallel else 1)

    def predicted_messages(self, layout=None) -> dict:
        """Per optimizer step, for UNIFORM routing: {(op, group): (calls, payload bytes)} (docstring item 3)."""
        run, config = self.run, self.config
        param = next(self.model.parameters())
        # With SP, after_grad_sync sums exactly the layout's gradient pieces of the experts and the router (ZeRO:
        # this rank's shard of them, in its accumulation dtype); without a layout, the whole parameters.
        pieces = layout.grad_pieces(self.params()) if layout is not None else list(self.params())
        return step_messages(config, len(self.layers), self.tokens_per_micro_batch(), self.ep, run.micro_batches,
                             run.compute_dtype.itemsize, max(4, param.element_size()), run.mesh.size("cp"),
                             run.mesh.size("tp") if self.sequence_parallel else 1,
                             sum(g.numel() * g.element_size() for g in pieces))

    def counted_messages(self) -> dict:
        """The all-to-alls since the last reset, predicted exactly from each forward's routed counts."""
        calls, payload = sum(l.a2a_calls for l in self.layers), sum(l.a2a_bytes for l in self.layers)
        return {("all_to_all_single", "ep"): (calls, payload)} if calls else {}

    def reset_message_counts(self) -> None:
        for layer in self.layers:
            layer.reset_messages()

    def step_lines(self) -> list:
        """With each logged step: this rank's routed slots per expert, summed over its MoE layers, micro-batches
        and the training steps since the previous line (which it says), read on the host in one `.tolist()`."""
        recorded = [layer for layer in self.layers if layer.load is not None]
        if not recorded:
            return []
        stats = torch.stack([torch.cat([layer.load, (layer.load.new_zeros(()) + layer.dropped).view(1)])
                             for layer in recorded]).tolist()  # [layer][N routed per expert, dropped]
        for layer in self.layers:
            layer.reset_load()
        self.last_load = ([row[:-1] for row in stats], self.steps_loaded)
        line = load_line(self.last_load[0], sum(row[-1] for row in stats), self.steps_loaded,
                         self.config.moe_capacity_factor > 0)
        self.steps_loaded = 0
        return [line]

    def startup_lines(self) -> list:
        return startup_lines(self)

    def end_lines(self, tracer, steps: int) -> list:
        return end_lines(self, tracer, steps)


# ---------------------------------------------------------------------------------------------------------
# Accounting
# ---------------------------------------------------------------------------------------------------------


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


def flops_per_token(config: GPTConfig, seq_len: int, recompute: bool = False):
    """mfu.FlopsPerToken from the ACTIVE parameters plus the router: MFU is not inflated by idle experts."""
    import mfu

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


def step_messages(config: GPTConfig, moe_layers: int, tokens: int, ep: int, micro_batches: int,
                  compute_bytes: int, router_bytes: int = 4, cp: int = 1, sp: int = 1, sp_grad_bytes: int = 0) -> dict:
    """Predicted messages of one optimizer step for UNIFORM routing: {(op, group): (calls, payload bytes)}.

    tokens: T, the tokens this rank routes per micro-batch (the micro-batch's B_μ·s = T·C·T_sp). Per MoE layer
    and micro-batch, S = R = T·k rows (at most N·C_μ/(C·T_sp), this rank's share of what capacity keeps):
    all_to_all_single on ep, forward 8N + 2·S·h·e_c (3 calls), backward 2·S·h·e_c (2 calls); activation
    checkpointing repeats the forward. CP (cp > 1) and SP (sp = T_tp > 1): per MoE layer and forward one
    all_reduce of (2N+2) router-dtype values on cp / tp and, with capacity, one all_gather_single of the expert
    choices (e_i = 1 byte, N ≤ 256; else 4): on tp the CP piece's B_μ·s/C·k·e_i, on cp the micro-batch's
    B_μ·s·k·e_i (its output). SP adds one per-step all_reduce of the experts' and router's gradients on tp.
    """
    n, k, h = config.moe_experts, config.moe_topk, config.n_embd
    whole = tokens * cp * sp  # B_μ·s
    rows = tokens * k
    cap = capacity(whole, k, n, config.moe_capacity_factor)
    if cap is not None:
        rows = min(rows, n * cap / (cp * sp))
    forwards = 2 if config.activation_checkpointing else 1
    passes = moe_layers * micro_batches
    out = {}
    if ep > 1 and passes:
        out[("all_to_all_single", "ep")] = (passes * (3 * forwards + 2),
                                            passes * (forwards * (8 * n + 2 * rows * h * compute_bytes)
                                                      + 2 * rows * h * compute_bytes))
    choice_bytes = 1 if n <= 256 else 4
    for group, size, gathered in (("cp", cp, whole), ("tp", sp, whole // cp)):
        if size > 1 and passes:
            out[("all_reduce", group)] = (passes * forwards, passes * forwards * (2 * n + 2) * router_bytes)
            if cap is not None:
                out[("all_gather_single", group)] = (passes * forwards, passes * forwards * gathered * k * choice_bytes)
    if sp > 1 and sp_grad_bytes:
        calls, payload = out.get(("all_reduce", "tp"), (0, 0))
        out[("all_reduce", "tp")] = (calls + 1, payload + sp_grad_bytes)
    return out


BARS = "▁▂▃▄▅▆▇█"


def histogram(values) -> str:
    """One character per value, its height proportional to value / max (▁ for zero load)."""
    values = [int(v) for v in values]
    top = max(values) or 1
    return "".join(BARS[min(len(BARS) - 1, v * (len(BARS) - 1) // top)] if v else " " for v in values)


def load_line(loads: list, dropped: int, steps: int, capacity_on: bool) -> str:
    """`moe load over the 10 steps since the previous line ...`: loads[l][i] slots routed to expert i by MoE
    layer l (before capacity), summed over layers; imbalance max/mean; what capacity dropped, or dropless."""
    total = [sum(column) for column in zip(*loads)]
    slots = sum(total)
    mean = slots / len(total) if slots else 1.0
    worst = max(max(load) / (sum(load) / len(load)) if sum(load) else 1.0 for load in loads)
    span = "this step" if steps == 1 else f"the {steps} steps since the previous line"
    if not capacity_on:
        drops = "dropless"
    elif dropped:
        drops = f"{dropped} of the {slots} slots dropped by capacity ({100 * dropped / slots:.1f}%)"
    else:
        drops = f"none of the {slots} slots dropped by capacity"
    return (f"moe load over {span} (this rank, {len(loads)} MoE layers): |{histogram(total)}|"
            f" {min(total)}..{max(total)} slots/expert, imbalance max/mean {max(total) / mean:.2f}"
            f" (worst layer {worst:.2f}), {drops}")


def startup_lines(axis: MoEAxis) -> list:
    from mfu import format_bytes, format_flops

    config, run, n, k = axis.config, axis.run, axis.config.moe_experts, axis.config.moe_topk
    counts, tokens, whole = param_counts(config), axis.tokens_per_micro_batch(), run.micro_batch_size * run.seq_len
    cap = capacity(whole, k, n, config.moe_capacity_factor)
    flops = flops_per_token(config, run.seq_len, config.activation_checkpointing)
    param = next(axis.model.parameters())
    held = sum(p.numel() for layer in axis.layers for p in layer.experts.parameters())
    local = axis.layers[0].local if axis.layers else range(0)
    e_c = run.compute_dtype.itemsize
    per_layer = 4 * tokens * k * config.n_embd * e_c + 8 * n
    lines = [
        f"moe: N={n} experts, top-{k} (fp32 router: softmax → top-k → {'renormalised' if k > 1 else 'raw gate'}),"
        f" on {counts['moe_layers']} of {config.n_layer} blocks (every {config.moe_every}); "
        + (f"capacity f={config.moe_capacity_factor}: C = ⌈B_μ·s·k/N·f⌉ = {cap} slots per expert of each"
           f" micro-batch (B_μ·s = {whole} tokens, decided in its token order"
           + (f"; this rank routes T = {tokens} of them and gathers the others' choices" if tokens < whole else "")
           + ")" if cap is not None else "dropless")
        + f"; aux α={config.moe_aux_coef}, z β={config.moe_z_coef}",
        f"  parameters: total {counts['total']:,}, active per token {counts['active']:,}"
        f" (= total − L_moe·(N−k)·Ψ_e, Ψ_e = 8h²+5h = {counts['expert']:,});"
        f" routers L_moe·h·N = {counts['router']:,}",
        f"  FLOPs per token (model) 6·N_active + 12·L·H·Q·s = {format_flops(flops.model)},"
        f" N_active = {active_matmul_params(config):,} matmul weights (k experts + router, not N)",
        f"  expert parallel E={axis.ep} (group ep), expert grads over expert_dp ({run.mesh.size('expert_dp')} ranks),"
        f" router over dp×cp, replicated over tp: this rank holds experts [{local.start}, {local.stop}) of each"
        f" MoE layer = {held:,} params = {format_bytes(held * param.element_size())} weights,"
        f" {format_bytes(held * 16)} with fp32 grads + AdamW",
    ]
    if axis.ep > 1:
        wire = per_layer * (axis.ep - 1) / axis.ep
        calls, payload = axis.predicted_messages().get(("all_to_all_single", "ep"), (0, 0))
        lines.append(f"  all_to_all_single per MoE layer and micro-batch (group ep), uniform-routing estimate"
                     f" S = R = T·k = {tokens * k}: fwd counts 8N + dispatch + combine, bwd both reversed ="
                     f" 4·T·k·h·e_c + 8N = {format_bytes(per_layer)} payload, (E−1)/E on the wire ="
                     f" {format_bytes(wire)}; per step {calls} calls, {format_bytes(payload)} (the startup table's"
                     f" figure; the end table predicts exactly, from the routed counts)")
    return lines


def end_lines(axis: MoEAxis, tracer, steps: int) -> list:
    """Traced all-to-all bytes beside the two predictions (exact from the routed counts; the uniform-routing
    estimate printed at startup); the load of the last steps, per MoE layer."""
    from mfu import format_bytes

    lines = []
    if axis.ep > 1:
        traced = tracer.records.get(("all_to_all_single", "ep"))
        traced = (traced.calls, traced.payload_bytes) if traced is not None else (0, 0)
        counted = (axis.trained_calls, axis.trained_bytes)  # the training steps', from the routed counts
        uniform = axis.predicted_messages().get(("all_to_all_single", "ep"), (0, 0))
        per = max(1, steps * len(axis.layers))
        lines.append(f"moe all_to_all_single (group ep) per MoE layer and step: traced {format_bytes(traced[1] / per)}"
                     f" ({traced[0] / per:.1f} calls); predicted exactly from this run's routed counts"
                     f" {format_bytes(counted[1] / per)} (the end table's prediction); uniform-routing estimate"
                     f" {format_bytes(uniform[1] / max(1, len(axis.layers)))} (the startup table's)")
    if axis.last_load is None and any(layer.load is not None for layer in axis.layers):
        axis.step_lines()  # no load line was printed: read the loads now
    if axis.last_load is not None:
        loads, span = axis.last_load
        for layer, load in zip(axis.layers, loads):
            mean = sum(load) / len(load) if sum(load) else 1.0
            lines.append(f"moe load over the last {span} step{'s' if span != 1 else ''}, h.{layer.layer_id}:"
                         f" |{histogram(load)}| {load} imbalance {max(load) / mean:.2f}")
    return lines
