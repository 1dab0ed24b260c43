"""What a MoE layer costs in memory, as formulas (moe.py's docstring, item 2): the bytes a layer saves for
backward, what a MoE-aware activation estimate adds to the dense one; and the bytes its exchanges send out of a
routing group (the end line). The step's messages are the layer's own (experts/dispatch.py: `Traffic`,
`step_messages`, `all_to_all_messages`). accounting/memory.py, accounting/activations.py, planner/search.py and
the printouts read them. Symbols as in moe.py.

Accounting for this file (it is accounting): 1. it holds nothing; 2. no memory; 3. no messages; 4. no state.
"""

from __future__ import annotations

from experts.dispatch import Traffic
from experts.router import rows_per_token
from experts.shared import saved_bytes


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
    n, k, h = config.moe.experts, config.moe.topk, config.n_embd
    slots, sigmoid = tokens * k, config.moe.score == "sigmoid"
    router = tokens * router_bytes * (h + 2 * n + 1 + (k + 1 if k > 1 or sigmoid else 0) + sigmoid) + 8 * slots
    dispatch = slots * (3 * 8 + router_bytes)
    rows = slots * h * (2 * compute_bytes + max(compute_bytes, router_bytes))
    if ep > 1:
        pairs = tokens * rows_per_token(n, k, config.moe.groups, config.moe.group_limit, ep)[0]
        dispatch = pairs * (8 + k + 8 * k) + slots * (8 + router_bytes)
        rows += pairs * h * compute_bytes
    experts = slots * (4 + 4 * gelu_outputs) * h * compute_bytes
    mask = tokens * h * mask_bytes if config.dropout > 0 else 0
    statistics = router_bytes * (4 * n + 3) * (1 + (sequences if config.moe.seq_aux_coef > 0 else 0))
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


def off_group_bytes(traffic: Traffic, forwards: int, sent: float, received: float) -> float:
    """The bytes this rank's ep all-to-alls send to ranks outside its place (router.GroupPlaces) over
    `forwards` training forwards whose exchanges sent `sent` rows to, and received `received` rows from, such
    ranks (router.off_group's sums): all_to_all_messages' terms, each to its destination (the counts go
    to every rank alike, 8·(N_p/E + 1) bytes each). The CommTracer counts the same (tracer.CommTracer.sent_to)."""
    config, ep = traffic.model, traffic.ep
    repeats = 2 if config.activation_checkpointing else 1
    row_bytes, meta_bytes = config.n_embd * traffic.compute_bytes, 2 * config.moe.topk * traffic.router_bytes
    far_ranks = ep - max(1, ep // config.moe.groups) if config.moe.groups else ep - 1
    counts = forwards * repeats * 8 * ((traffic.slots or config.moe.experts) // ep + 1) * far_ranks
    return counts + (repeats + 1) * (sent + received) * row_bytes + (repeats * sent + received) * meta_bytes


def off_group_line(traffic: Traffic, off_group: list, forwards: int, steps: int, traced=None) -> str | None:
    """The end line (report_axes' moe section): per MoE layer and step, the ep all-to-all bytes leaving the
    sender's group, predicted from the exchanges (observers.RoutedLoad's sums of router.off_group over the
    `forwards` training forwards of `steps` steps), the CommTracer's (`traced` bytes over the same steps, when
    traced), and the uniform estimate for this M and for M = G; None without groups or EP."""
    config = traffic.model
    groups, limit, ep = config.moe.groups, config.moe.group_limit, traffic.ep
    if groups == 0 or ep == 1 or not steps:
        return None
    per_step = max(1, traffic.moe_layers) * traffic.micro_batches  # forwards per step, uniform
    layers = steps * max(1, traffic.moe_layers)

    def uniform(m):
        rows = per_step * traffic.tokens * rows_per_token(config.moe.experts, config.moe.topk, groups, m, ep)[1]
        return off_group_bytes(traffic, per_step, rows, rows) / max(1, traffic.moe_layers) / 1024

    where = f"a group is {ep // groups} ranks" if ep >= groups else f"a rank holds {groups // ep} groups"
    counted = off_group_bytes(traffic, forwards, *off_group) / layers / 1024
    traced_text = "" if traced is None else f", traced {traced / layers / 1024:.1f} KiB"
    return (f"moe off-group all-to-all (G={groups}, M={limit}; {where}; one row per token and rank) per MoE layer"
            f" and step: predicted from the routed rows {counted:.1f} KiB{traced_text}, uniform {uniform(limit):.1f}"
            f" KiB (unlimited M=G: {uniform(groups):.1f} KiB)")
