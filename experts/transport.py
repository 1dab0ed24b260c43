"""Communication-aware redundant experts (TAOT, arXiv 2608.03676): where a hot expert's replicas go, as an
entropy-regularised optimal transport of the overloaded ranks' excess to the spare ranks' room over a matrix of
link costs (Sinkhorn–Knopp), then an integer matching of replicas to the flows. experts/eplb.py places by load
alone (deepseek-ai/EPLB); here a replica on the far side of a slow link costs what that link costs.

The model (one MoE layer; w [N] the experts' loads, R slots, R/E on each of the E ranks, C [E, E] the cost of a
unit of load moved from rank a to rank b: 0 on the diagonal; the caller builds it, from planner/hardware.py's
intra- and inter-node links or the --moe-placement-cost matrix):
    home        expert i lives on rank h(i) = ⌊i·E/N⌋ (plain EP's place: its first slot, replica 0); each rank
                has N/E home slots and G = (R − N)/E guest slots
    excess      L_r = Σ over rank r's slots of w_i/c_i (c_i the replicas of i so far; at first the homes'),
                L̄ = Σ w / E;  o_r = max(L_r − L̄, 0) to give, s_r = max(L̄ − L_r, 0) room (0 without a free slot)
    transport   F = argmin_F Σ F_ab·C_ab − ε·H(F) with rows Σ_b F_ab = o_a and columns Σ_a F_ab = s_b:
                Sinkhorn–Knopp, K = exp(−C/(ε·max C)), u ← o / (K v), v ← s / (Kᵀ u) until the marginals hold
                (1e-9 relative, at most 1,000 rounds); F = diag(u)·K·diag(v)
    matching    one guest slot at a time, each on the loads so far (the dispatch splits an expert's tokens evenly
                over its replicas, experts/eplb.py's `Replicas.physical`): F anew, then a replica of the hottest
                expert of the hottest rank a (one some free rank lacks) on the free rank b of the largest F_ab
                (ties: the cheaper link, the lighter rank, the lower rank)
Integer matching and the even token split are this trainer's (TAOT splits the tokens of an expert unevenly); the
plan is in experts/eplb.py's form (phy2log, replica, logcnt), so the slots move, train and checkpoint as EPLB's do.

Compared on the same loads (`plan_costs`, bench/bench_coupling.py's table): the max/mean load per rank under the
plan (slots carry w_i/c_i) and the weighted communication cost Σ_slots (w_i/c_i)·C[h(i), rank of the slot]: the
load a plan serves away from its expert's home, each unit at its link's cost. It is TAOT's model of what a
placement costs, not this trainer's traffic (which sends a token's rows to the slots directly, over ep).

Symbols: N, R, E as above.
1. Replicated and split: nothing; the plan is computed alike on every rank (the same loads, the same bits).
2. Peak per device: host lists of E², N and R floats per layer and re-plan.
3. Messages: none.
4. Restart state: none (the loads it places from are experts/eplb.py's).
"""

from __future__ import annotations

import math

import torch

FLAG = "--moe-placement-cost"


def sinkhorn(source: list, sink: list, cost: list, epsilon: float = 0.05, rounds: int = 1000) -> list:
    """F [len(source)][len(sink)] ≥ 0 with rows summing to `source`, columns to `sink` (equal totals), minimising
    Σ F·cost − ε·max(cost)·H(F) (float64 on the host). Zero totals: zeros."""
    a, b = torch.tensor(source, dtype=torch.float64), torch.tensor(sink, dtype=torch.float64)
    c = torch.tensor(cost, dtype=torch.float64)
    if float(a.sum()) <= 0 or float(b.sum()) <= 0:
        return [[0.0] * len(sink) for _ in source]
    kernel = torch.exp(-c / (epsilon * max(float(c.max()), 1e-12)))
    u, v = torch.ones_like(a), torch.ones_like(b)
    for _ in range(rounds):
        u = torch.where(a > 0, a / (kernel @ v).clamp_min(1e-300), 0)
        v = torch.where(b > 0, b / (kernel.T @ u).clamp_min(1e-300), 0)
        flow = u[:, None] * kernel * v[None, :]
        if float((flow.sum(dim=1) - a).abs().max()) <= 1e-9 * float(a.sum()):
            break
    return (u[:, None] * kernel * v[None, :]).tolist()


def home_of(expert: int, n: int, ep: int) -> int:
    return expert * ep // n


def place(load, slots: int, ep: int, cost: list) -> tuple:
    """(phy2log [R], replica [R], logcnt [N]) of one layer (the module docstring's steps): each expert's first
    slot on its home rank; each of the R − N guest slots, one at a time, a replica of the hottest rank's hottest
    expert on the free rank the transport of the ranks' excess load over `cost` sends most of that rank's to."""
    w = [float(x) for x in (load.tolist() if torch.is_tensor(load) else load)]
    n, per_rank = len(w), slots // ep
    held = [[e for e in range(n) if home_of(e, n, ep) == r] for r in range(ep)]  # each rank's slots, homes first
    count = [1] * n
    for _ in range(slots - n):
        share = [w[e] / count[e] for e in range(n)]  # what each replica of e serves
        loads = [sum(share[e] for e in held[r]) for r in range(ep)]
        mean = sum(loads) / ep
        free = [r for r in range(ep) if len(held[r]) < per_rank]
        over = [max(x - mean, 0.0) for x in loads]
        room = [max(mean - loads[r], 0.0) if r in free else 0.0 for r in range(ep)]
        flow = (sinkhorn(over, [x * sum(over) / sum(room) for x in room], cost) if sum(room) > 0 and sum(over) > 0
                else [[0.0] * ep for _ in range(ep)])
        pick = None
        for a in sorted(range(ep), key=lambda r: (-loads[r], r)):  # the hottest rank with an expert to share
            for e in sorted(held[a], key=lambda e: (-share[e], e)):
                options = [b for b in free if e not in held[b]]
                if options:
                    pick = (e, max(options, key=lambda b: (flow[a][b], -cost[a][b], -loads[b], -b)))
                    break
            if pick:
                break
        if pick is None:  # every free rank holds every expert its hotter ranks hold: any expert not yet there
            b = free[0]
            pick = (max((e for e in range(n) if e not in held[b]), key=lambda e: (share[e], -e)), b)
        e, b = pick
        held[b].append(e)
        count[e] += 1
    phy2log, replica, guests = [], [], [0] * n  # the home slot is replica 0, the guests 1, 2, ... in rank order
    for r in range(ep):
        for place, e in enumerate(held[r]):
            phy2log.append(e)
            guests[e] += place >= n // ep
            replica.append(guests[e] if place >= n // ep else 0)
    return phy2log, replica, count


def plan_costs(phy2log: list, load, ep: int, cost: list) -> tuple:
    """(max/mean load per rank, weighted communication cost) of a plan on `load` (module docstring): slot q of
    expert i carries w_i/c_i; the cost is Σ_q (w_i/c_i)·cost[h(i)][rank of q]."""
    w = [float(x) for x in (load.tolist() if torch.is_tensor(load) else load)]
    n, per_rank = len(w), len(phy2log) // ep
    copies = [phy2log.count(e) for e in range(n)]
    ranks = [0.0] * ep
    weighted = 0.0
    for q, e in enumerate(phy2log):
        share = w[e] / copies[e]
        ranks[q // per_rank] += share
        weighted += share * cost[home_of(e, n, ep)][q // per_rank]
    mean = sum(ranks) / ep
    return (max(ranks) / mean if mean > 0 else math.nan), weighted


def parse_cost(text: str, ep: int) -> tuple:
    """The --moe-placement-cost matrix "c00,c01,...;c10,..." (E rows of E) as a tuple of tuples, or ValueError
    naming the flag: E×E, every entry finite and ≥ 0, zero on the diagonal (a rank reaches itself for free)."""
    try:
        rows = [[float(x) for x in row.split(",")] for row in text.split(";")]
    except ValueError:
        raise ValueError(f"{FLAG} {text!r}: entries must be numbers, rows ';'-separated, entries ','-separated")
    if len(rows) != ep or any(len(row) != ep for row in rows):
        raise ValueError(f"{FLAG} must be {ep}×{ep} (--ep {ep}: one row and column per EP rank), got"
                         f" {len(rows)} rows of {sorted({len(row) for row in rows})} entries")
    for a, row in enumerate(rows):
        for b, x in enumerate(row):
            if not math.isfinite(x) or x < 0:
                raise ValueError(f"{FLAG}: entry ({a}, {b}) = {x} must be finite and at least 0")
            if a == b and x != 0:
                raise ValueError(f"{FLAG}: entry ({a}, {a}) = {x} must be 0 (a rank reaches itself for free)")
    return tuple(tuple(row) for row in rows)
