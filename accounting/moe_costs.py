"""What a MoE layer costs, as formulas (moe.py's docstring, items 2 and 3): the capacity, the bytes a layer saves
for backward, what a MoE-aware activation estimate adds to the dense one, and the all-to-all and statistics
messages of a step, uniform (`step_messages`, the start-up table) or from the rows the forwards routed
(`all_to_all_messages`, the end table). `Traffic` is what they read: the model's MoE shape and what one
micro-batch routes on a rank. moe.py's layer and handle call them; accounting/memory.py, accounting/activations.py, planner/search.py and
the printouts read them. Symbols as in moe.py.

Accounting for this file (it is accounting): 1. it holds nothing; 2. no memory; 3. no messages; 4. no state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from accounting.tracer import Messages
from experts.router import rows_per_token
from experts.shared import saved_bytes


def capacity(tokens: int, topk: int, n_experts: int, factor: float) -> int | None:
    """C_μ = ⌈T_μ·k/N · f⌉ slots per expert of a micro-batch of T_μ = B_μ·s tokens, or None when dropless."""
    if factor <= 0:
        return None
    return math.ceil(round(tokens * topk * factor / n_experts, 9))  # round: 35.000000001 is 35


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


def layer_activation_bytes(config, tokens: int, compute_bytes: int = 2, router_bytes: int = 4,
                           mask_bytes: int = 1, sequences: int = 1, ep: int = 1, gelu_outputs: bool = True) -> int:
    """Bytes ONE MoE layer saves for backward per micro-batch (weights and their autocast copies aside), for
    T = `tokens` routed by this rank, uniform routing without drops (S = R = T·k; exact for E = 1):
        router    T·e_r·(h + 2N + 1 + [k > 1 or σ]·(k + 1) + [σ]) + 8·T·k   its e_r input, logits, scores, lse,
                  (renormalised: the k weights, their sum), sigmoid's (σ) Σ_j s_tj, indices
        dispatch  S·(3·8 + e_r)        the sort's order, each row's token (gather, index_add), each row's gate
        rows      S·h·(2·e_c + e_w)    rows in, rows back, the weighted rows index_add keeps (e_w = max(e_c, e_r))
        experts   R·8h·e_c             GELU's input and output (R·4h·e_c without `gelu_outputs`: selective
                                       recompute's moe_act, recompute.SelectiveRecompute.activations_recomputed)
    + e_r·(4N + 3) of statistics (×(1 + B_μ) with the seq loss, B_μ = `sequences`), + T·h·mask_bytes with dropout
    (1 on GPUs; the element size on CPUs, whose dropout keeps a scaled mask). E = `ep` > 1, the deduplicated
    exchange (experts/dispatch.py) with P = T·rows_per_token pairs sent (and, uniform, received):
        dispatch  P·(8 + k + 8k) + S·(8 + e_r)   the pairs' tokens and hit mask, the fan-out's order [P·k], each
                                                 slot's row and gate
        rows      S·h·(2·e_c + e_w) + P·h·e_c    the experts' rows in and out, the weighted rows, the pairs back"""
    n, k, h = config.moe_experts, config.moe_topk, config.n_embd
    slots, sigmoid = tokens * k, config.moe_score == "sigmoid"
    router = tokens * router_bytes * (h + 2 * n + 1 + (k + 1 if k > 1 or sigmoid else 0) + sigmoid) + 8 * slots
    dispatch = slots * (3 * 8 + router_bytes)
    rows = slots * h * (2 * compute_bytes + max(compute_bytes, router_bytes))
    if ep > 1:
        pairs = tokens * rows_per_token(n, k, config.moe_groups, config.moe_group_limit, ep)[0]
        dispatch = pairs * (8 + k + 8 * k) + slots * (8 + router_bytes)
        rows += pairs * h * compute_bytes
    experts = slots * (4 + 4 * gelu_outputs) * h * compute_bytes
    mask = tokens * h * mask_bytes if config.dropout > 0 else 0
    statistics = router_bytes * (4 * n + 3) * (1 + (sequences if config.moe_seq_aux_coef > 0 else 0))
    return router + dispatch + rows + experts + mask + statistics


def activation_estimate_delta(config, moe_blocks: int, seq: int, micro: int, tp: int = 1,
                              sequence_parallel: bool = False) -> float:
    """What a MoE-aware activation estimate adds to Korthikanti's dense one (memory.activation_bytes_per_layer,
    16-bit, s = this rank's sequence, s/C under CP) for moe_blocks held MoE blocks: each one's own bytes
    (layer_activation_bytes at e_c = 2, e_r = 4, for its T = s·b tokens, /T_tp with SP: experts are whole on
    every TP rank) minus the dense MLP's share it replaces, 19·s·b·h ((3 + 16/t)·s·b·h under TP, 19·s·b·h/t
    with SP: c_fc's input 2, GELU's input and output 16, the dropout mask 1), plus the shared experts' own
    (shared.saved_bytes: S times the dense MLP's GELU terms, and c_fc's 16-bit input)."""
    sbh = seq * micro * config.n_embd
    dense_mlp = 19 * sbh / tp if sequence_parallel else (3 + 16 / tp) * sbh
    tokens = seq * micro // (tp if sequence_parallel else 1)
    shared = saved_bytes(config, seq * micro, tp, input_tokens=tokens)
    return moe_blocks * (layer_activation_bytes(config, tokens, sequences=micro) + shared - dense_mlp)


def all_to_all_messages(traffic: Traffic, forwards: int, sent: float, received: float) -> Messages:
    """The all_to_all_single calls on ep of `forwards` training forwards of MoE layers (each with its backward,
    and its recompute under activation checkpointing) whose deduplicated exchanges (experts/dispatch.py) sent Σ S =
    `sent` and received Σ R = `received` rows (one per token and rank): per forward 4 calls (counts
    8·(N_p + E), rows S·h·e_c, metadata S·2k·e_r, combine R·h·e_c), ×2 recomputed, + 3 in backward (the
    reverses, (S + R)·h·e_c + R·2k·e_r). N_p: N, or the R physical slots with replicas."""
    repeats = 2 if traffic.model.activation_checkpointing else 1
    row_bytes = traffic.model.n_embd * traffic.compute_bytes
    meta_bytes = 2 * traffic.model.moe_topk * traffic.router_bytes  # k gates and k local slots per row
    counts = forwards * repeats * 8 * ((traffic.slots or traffic.model.moe_experts) + traffic.ep)
    rows = (repeats + 1) * (sent + received) * row_bytes + (repeats * sent + received) * meta_bytes
    return Messages().add(*ALL_TO_ALL, forwards * (4 * repeats + 3), counts + rows)


def off_group_bytes(traffic: Traffic, forwards: int, sent: float, received: float) -> float:
    """The bytes this rank's ep all-to-alls send to ranks outside its place (router.GroupPlaces) over
    `forwards` training forwards whose exchanges sent `sent` rows to, and received `received` rows from, such
    ranks (router.off_group's sums): all_to_all_messages' terms, each to its destination (the counts go
    to every rank alike, 8·(N_p/E + 1) bytes each). The CommTracer counts the same (tracer.CommTracer.sent_to)."""
    config, ep = traffic.model, traffic.ep
    repeats = 2 if config.activation_checkpointing else 1
    row_bytes, meta_bytes = config.n_embd * traffic.compute_bytes, 2 * config.moe_topk * traffic.router_bytes
    far_ranks = ep - max(1, ep // config.moe_groups) if config.moe_groups else ep - 1
    counts = forwards * repeats * 8 * ((traffic.slots or config.moe_experts) // ep + 1) * far_ranks
    return counts + (repeats + 1) * (sent + received) * row_bytes + (repeats * sent + received) * meta_bytes


def off_group_line(traffic: Traffic, off_group: list, forwards: int, steps: int, traced=None) -> str | None:
    """The end line (report_axes' moe section): per MoE layer and step, the ep all-to-all bytes leaving the
    sender's group, predicted from the exchanges (observers.RoutedLoad's sums of router.off_group over the
    `forwards` training forwards of `steps` steps), the CommTracer's (`traced` bytes over the same steps, when
    traced), and the uniform estimate for this M and for M = G; None without groups or EP."""
    config = traffic.model
    groups, limit, ep = config.moe_groups, config.moe_group_limit, traffic.ep
    if groups == 0 or ep == 1 or not steps:
        return None
    per_step = max(1, traffic.moe_layers) * traffic.micro_batches  # forwards per step, uniform
    layers = steps * max(1, traffic.moe_layers)

    def uniform(m):
        rows = per_step * traffic.tokens * rows_per_token(config.moe_experts, config.moe_topk, groups, m, ep)[1]
        return off_group_bytes(traffic, per_step, rows, rows) / max(1, traffic.moe_layers) / 1024

    where = f"a group is {ep // groups} ranks" if ep >= groups else f"a rank holds {groups // ep} groups"
    counted = off_group_bytes(traffic, forwards, *off_group) / layers / 1024
    traced_text = "" if traced is None else f", traced {traced / layers / 1024:.1f} KiB"
    return (f"moe off-group all-to-all (G={groups}, M={limit}; {where}; one row per token and rank) per MoE layer"
            f" and step: predicted from the routed rows {counted:.1f} KiB{traced_text}, uniform {uniform(limit):.1f}"
            f" KiB (unlimited M=G: {uniform(groups):.1f} KiB)")


def step_messages(traffic: Traffic, sp_grad_bytes: int = 0) -> Messages:
    """Predicted messages of one optimizer step for UNIFORM routing (docstring item 3): S = R = T·ρ rows per MoE
    layer and micro-batch, ρ = router.rows_per_token (one row per token and rank it reaches), at most the
    slots T·k, or N·C_μ/(C·T_sp), this rank's share of what capacity keeps; CP's and SP's
    statistics all-reduces and choice gathers; SP's gradient sum over tp of `sp_grad_bytes` (the layout's)."""
    t, n, k = traffic, traffic.model.moe_experts, traffic.model.moe_topk
    whole = t.tokens * t.cp * t.sp  # B_μ·s
    cap = capacity(whole, k, n, t.model.moe_capacity_factor)
    slots = t.tokens * k if cap is None else min(t.tokens * k, n * cap / (t.cp * t.sp))
    rows = min(slots, t.tokens * rows_per_token(n, k, t.model.moe_groups, t.model.moe_group_limit, t.ep)[0])
    passes = t.moe_layers * t.micro_batches
    out = all_to_all_messages(t, passes, passes * rows, passes * rows) if t.ep > 1 else Messages()
    forwards = passes * (2 if t.model.activation_checkpointing else 1)
    choice_bytes = 1 if n <= 256 else 4
    statistics = 2 * n + 2 + (t.sequences * (2 * n + 1) if t.model.moe_seq_aux_coef > 0 else 0)  # moe_router's
    for group, size, gathered in (("cp", t.cp, whole), ("tp", t.sp, whole // t.cp)):
        if size > 1:
            out.add("all_reduce", group, forwards, forwards * statistics * t.router_bytes)
            if cap is not None:
                out.add("all_gather_single", group, forwards, forwards * gathered * k * choice_bytes)
    if t.sp > 1 and sp_grad_bytes:
        out.add("all_reduce", "tp", 1, sp_grad_bytes)
    return out
