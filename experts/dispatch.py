"""The expert-parallel token exchange, deduplicated (DeepSeek-V3 §3.2.2, DeepEP): one copy of a token per
destination EP rank, whatever how many of its k experts that rank holds.

moe.MoE.dispatch_and_combine calls `exchange` when E > 1 with the micro-batch's rows [T, h] (e_c), the gates
[T, k] (e_r, with their gradient) and each slot's physical slot [T·k] (an expert, or with --moe-replicas a
replica; `slots`, i.e. N or R, for a slot capacity dropped). A slot goes to rank slot // (slots/E).
    1. pairs     the (token, rank) pairs some kept slot of the token lands on, rank-major, token order inside
                 (a stable argsort of the [E, T] hit mask: no nonzero(), no host sync)
    2. counts    one all_to_all_single of [E, slots/E + 1] int64: per destination rank, the kept slots of each
                 of its slots, then the pairs (rows) it gets; then ONE `.tolist()` of what went and came
    3. dispatch  the S pair rows [S, h] (e_c), and beside them their metadata [S, 2k] (e_r): per slot j the
                 gate if rank r holds it, else 0, then its local slot index on r (slots/E: not r's). Two
                 all_to_all_single calls (AllToAll: autograd; the metadata's carries the gates' gradient back)
    4. fan-out   the receiver sorts its R rows' slots by local slot (arrival order inside, foreign ones last),
                 gathers the rows they name ([R_e, h], R_e the slots it runs), runs each local slot's expert
                 on each source's rows (one GEMM per source: FP8's scale per chunk), weights each output by
                 its gate, and sums a row's outputs by index_add: [R, h] in e_w = max(e_c, e_r), cast to e_c
                 for the wire
    5. combine   the inverse all_to_all_single returns one row per pair: [S, h] (e_c)
    6. y         y[t] = Σ over t's pairs of the row back (index_add, e_c)
Capacity is unchanged: it is decided per expert on the whole micro-batch before the exchange (moe.keep_slots),
a dropped slot travels nowhere, and a token goes to a rank when at least one of its kept slots lies there. So
a token routed to j of one rank's experts costs that link 1 row, not j: with group-limited routing (a token's
experts in ≤ M groups) the rows leaving a group fall with M (router.off_group_estimate, the uniform count).

Symbols as moe.py's; here S = Σ_r S_r the pairs a rank sends (S_r to rank r), R = Σ_r R_r the pairs it
receives, R_e ≤ k·R the slots its experts run.
1. Replicated and split: nothing new (the rows are moe.py's).
2. Peak per device: the pairs' hit mask E·T bytes and order E·T·8, the pairs' tokens and ranks S·8 each, the
   sent rows S·h·e_c, metadata S·2k·e_r in and R·2k·e_r out, the fan-out's order R·k·8 and rows R_e·8, its
   gathered rows R_e·h·e_c (saved for backward as the experts' input), the weighted outputs R_e·h·e_w and
   their sum R·h·e_w (then cast), y T·h·e_c: accounting/moe_memory.py writes them tensor by tensor.
3. Messages, per MoE layer and forward (payload = the input, dispatch.all_to_all_messages):
       forward   counts 8·(slots + E)  +  rows S·h·e_c  +  metadata S·2k·e_r  +  combine R·h·e_c
       backward  combine's reverse S·h·e_c  +  metadata's reverse R·2k·e_r  +  rows' reverse R·h·e_c
   What goes to each rank is known per call (`Exchange`): the bytes leaving this rank's group are
   moe_costs.off_group_bytes, and the CommTracer counts them alike (`sent_to`).
4. Restart state: none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from experts.router import capacity, rows_per_token
from step import Messages


class Exchange(NamedTuple):
    """The rows of one exchange, host ints: per EP rank r, the pairs this rank sent r (dispatch) and the pairs
    r sent it (so the combine rows it sent back); the slots its experts ran; the rows of each GEMM they ran, per
    local slot, per source rank (what an FP8 expert pads: accounting/fp8_experts.py)."""

    sent: list
    received: list
    expert_rows: int
    chunks: tuple = ()


class AllToAll(torch.autograd.Function):
    """Rows [Σ input_splits, ...] → [Σ output_splits, ...]: rank r's i-th chunk goes to rank i, which puts it
    in its r-th chunk. Backward is the reverse all-to-all (splits swapped). Dispatch, metadata and combine."""

    @staticmethod
    def forward(ctx, x, output_splits: list, input_splits: list, group):
        ctx.output_splits, ctx.input_splits, ctx.group = output_splits, input_splits, group
        return AllToAll.exchange(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        return AllToAll.exchange(grad, ctx.input_splits, ctx.output_splits, ctx.group), None, None, None

    @staticmethod
    def exchange(x, output_splits: list, input_splits: list, group) -> torch.Tensor:
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=output_splits,
                               input_split_sizes=input_splits, group=group)
        return out


def exchange(rows: torch.Tensor, gate: torch.Tensor, slot: torch.Tensor, slots: int, group, ep: int,
             run_expert) -> tuple[torch.Tensor, Exchange]:
    """Steps 1-6: (y [T, h] in rows' dtype, the Exchange). rows [T, h]; gate [T, k]; slot [T·k] (slots: dropped);
    run_expert(i, chunk) runs local slot i (0 ≤ i < slots/E) on its rows."""
    tokens, k = gate.shape
    per_rank = slots // ep
    destination = (slot // per_rank).view(tokens, k)  # [T, k]: a dropped slot's is E
    hit = torch.zeros((ep + 1, tokens), dtype=torch.bool, device=rows.device)
    hit[destination, torch.arange(tokens, device=rows.device).unsqueeze(1)] = True  # 1. [E + 1, T]
    order = torch.argsort((~hit[:ep]).view(-1).to(torch.uint8), stable=True)  # the pairs first, rank-major
    kept = torch.zeros(slots + 1, dtype=torch.long, device=rows.device).scatter_add_(
        0, slot, torch.ones_like(slot))[:slots].view(ep, per_rank)
    counts = torch.cat([kept, hit[:ep].sum(dim=1, keepdim=True)], dim=1).view(-1)  # 2. [E·(slots/E + 1)]
    counts_in = torch.empty_like(counts)
    dist.all_to_all_single(counts_in, counts, group=group)
    sizes = torch.cat([counts, counts_in]).view(2, ep, per_rank + 1).tolist()  # the one host sync
    sent, received = [row[-1] for row in sizes[0]], [row[-1] for row in sizes[1]]
    per_slot = [sum(row[i] for row in sizes[1]) for i in range(per_rank)]  # the rows each local slot runs
    pair = order[:sum(sent)]
    token, rank = pair % tokens, pair // tokens  # [S]
    mine = destination[token] == rank.unsqueeze(1)  # [S, k]: which of the token's slots lie on that rank
    local = torch.where(mine, slot.view(tokens, k)[token] - rank.unsqueeze(1) * per_rank, per_rank)
    meta = torch.cat([torch.where(mine, gate[token], 0), local.to(gate.dtype)], dim=1)  # [S, 2k]
    arrived = AllToAll.apply(rows[token], received, sent, group)  # 3. [R, h]
    meta_in = AllToAll.apply(meta, received, sent, group)  # [R, 2k]
    fan = torch.argsort(meta_in[:, k:].detach().reshape(-1), stable=True)[:sum(per_slot)]  # 4. by local slot
    row_of = torch.div(fan, k, rounding_mode="floor")
    chunks = arrived[row_of].split(per_slot)  # [R_e, h]: the fan-out, one chunk per local slot, sources in order
    # Each source's rows run as a GEMM of their own (as without dedup), every source in order, even with no rows:
    # an FP8 or a precision recipe's expert scales the rows one source's micro-batch sends it alone
    # (accounting/fp8_experts.py, accounting/recipe_experts.py), so E = 2 quantises exactly as E = 1 does; other experts
    # are row-wise and give the same rows either way.
    pieces = [[sizes[1][source][i] for source in range(ep)] for i in range(per_rank)]  # [local slot][source]
    out = torch.cat([run_expert(i, piece) for i, chunk in enumerate(chunks) for piece in chunk.split(pieces[i])])
    weighted = out * meta_in[:, :k].reshape(-1)[fan].unsqueeze(1)  # e_w
    summed = weighted.new_zeros((len(arrived), rows.shape[1])).index_add(0, row_of, weighted)
    back = AllToAll.apply(summed.to(rows.dtype), sent, received, group)  # 5. [S, h]
    y = rows.new_zeros(rows.shape).index_add(0, token, back)  # 6.
    return y, Exchange(sent, received, len(fan), tuple(rows for slot in pieces for rows in slot))


# ---------------------------------------------------------------------------------------------------------
# What a MoE layer sends in a step (moe.py's docstring, item 3): uniform (the start-up table) or from the rows
# the forwards exchanged (the end table, exact)
# ---------------------------------------------------------------------------------------------------------


ALL_TO_ALL = ("all_to_all_single", "ep")


@dataclass(frozen=True)
class Traffic:
    """What the message formulas read: the model's MoE shape and what one micro-batch routes on this rank."""

    model: object  # the GPTConfig: N, k, h, the capacity factor, activation checkpointing
    moe_layers: int = 1  # L_moe this rank holds (a pipeline stage holds some)
    tokens: int = 0  # T: tokens this rank routes per micro-batch, B_μ·s/(C·T_sp)
    micro_batches: int = 1  # m
    ep: int = 1  # E
    cp: int = 1  # C
    sp: int = 1  # T_tp with --sp, else 1
    compute_bytes: int = 2  # e_c of the rows
    router_bytes: int = 4  # e_r
    sequences: int = 1  # B_μ: with the seq loss, its [B_μ, 2N+1] statistics join the pieces' all-reduce
    slots: int = 0  # R physical experts with --moe-replicas (experts/eplb.py): the counts all-to-all carries R, not N
    fp8_experts: str | None = None  # --fp8's recipe: the routed experts pad their rows (moe_memory's table)
    recipe_experts: bool = False  # --precision-recipe: the experts' linears make no autocast weight copies


def step_messages(traffic: Traffic, sp_grad_bytes: int = 0) -> Messages:
    """Predicted messages of one optimizer step for UNIFORM routing (docstring item 3): S = R = T·ρ rows per MoE
    layer and micro-batch, ρ = router.rows_per_token (one row per token and rank it reaches), at most the
    slots T·k, or N·C_μ/(C·T_sp), this rank's share of what capacity keeps; CP's and SP's
    statistics all-reduces and choice gathers; SP's gradient sum over tp of `sp_grad_bytes` (the layout's)."""
    t, n, k = traffic, traffic.model.moe.experts, traffic.model.moe.topk
    whole = t.tokens * t.cp * t.sp  # B_μ·s
    cap = capacity(whole, k, n, t.model.moe.capacity_factor)
    slots = t.tokens * k if cap is None else min(t.tokens * k, n * cap / (t.cp * t.sp))
    rows = min(slots, t.tokens * rows_per_token(n, k, t.model.moe.groups, t.model.moe.group_limit, t.ep)[0])
    passes = t.moe_layers * t.micro_batches
    out = all_to_all_messages(t, passes, passes * rows, passes * rows) if t.ep > 1 else Messages()
    forwards = passes * (2 if t.model.activation_checkpointing else 1)
    choice_bytes = 1 if n <= 256 else 4
    statistics = 2 * n + 2 + (t.sequences * (2 * n + 1) if t.model.moe.seq_aux_coef > 0 else 0)  # moe_router's
    for group, size, gathered in (("cp", t.cp, whole), ("tp", t.sp, whole // t.cp)):
        if size > 1:
            out.add("all_reduce", group, forwards, forwards * statistics * t.router_bytes)
            if cap is not None:
                out.add("all_gather_single", group, forwards, forwards * gathered * k * choice_bytes)
    if t.sp > 1 and sp_grad_bytes:
        out.add("all_reduce", "tp", 1, sp_grad_bytes)
    return out


def all_to_all_messages(traffic: Traffic, forwards: int, sent: float, received: float) -> Messages:
    """The all_to_all_single calls on ep of `forwards` training forwards of MoE layers (each with its backward,
    and its recompute under activation checkpointing) whose deduplicated exchanges (experts/dispatch.py) sent Σ S =
    `sent` and received Σ R = `received` rows (one per token and rank): per forward 4 calls (counts
    8·(N_p + E), rows S·h·e_c, metadata S·2k·e_r, combine R·h·e_c), ×2 recomputed, + 3 in backward (the
    reverses, (S + R)·h·e_c + R·2k·e_r). N_p: N, or the R physical slots with replicas."""
    repeats = 2 if traffic.model.activation_checkpointing else 1
    row_bytes = traffic.model.n_embd * traffic.compute_bytes
    meta_bytes = 2 * traffic.model.moe.topk * traffic.router_bytes  # k gates and k local slots per row
    counts = forwards * repeats * 8 * ((traffic.slots or traffic.model.moe.experts) + traffic.ep)
    rows = (repeats + 1) * (sent + received) * row_bytes + (repeats * sent + received) * meta_bytes
    return Messages().add(*ALL_TO_ALL, forwards * (4 * repeats + 3), counts + rows)
