"""Communication-aware redundant experts (TAOT, arXiv 2608.03676): where a hot expert's replicas go, as an
entropy-regularised optimal transport of the overloaded ranks' excess to the spare ranks' room over a matrix of
link costs (Sinkhorn–Knopp), then an integer matching of replicas to the flows. experts/eplb.py places by load
alone (deepseek-ai/EPLB); here a replica on the far side of a slow link costs what that link costs.

The model (one MoE layer; w [N] the experts' loads, R slots, R/E on each of the E ranks, C [E, E] the cost of a
unit of load moved from rank a to rank b: 0 on the diagonal; the caller builds it, from planner/hardware.py's
intra- and inter-node links or the --moe-placement-cost matrix):
    home        expert i lives on rank h(i) = ⌊i·E/N⌋ (plain EP's place: its first slot, replica 0); each rank
                has N/E home slots and G = (R − N)/E guest slots
    excess      L_r = Σ_{h(i)=r} w_i, L̄ = Σ w / E;  o_r = max(L_r − L̄, 0) to give, s_r = max(L̄ − L_r, 0) room
    transport   F = argmin_F Σ F_ab·C_ab − ε·H(F) with rows Σ_b F_ab = o_a and columns Σ_a F_ab = s_b:
                Sinkhorn–Knopp, K = exp(−C/(ε·max C)), u ← o / (K v), v ← s / (Kᵀ u) until the marginals hold
                (1e-9 relative, at most 1,000 rounds); F = diag(u)·K·diag(v)
    matching    while some flow F_ab > 0 has a guest slot free on b: the largest such flow takes a replica of the
                expert homed on a with the largest load per replica w_i/c_i (not yet on b); that replica carries
                w_i/(c_i + 1) (the dispatch splits an expert's slots evenly over its replicas,
                experts/eplb.py's `Replicas.physical`), which is taken off F_ab
    the rest    a guest slot the flows left free takes, of the experts not on its rank, the one homed over the
                cheapest link, the largest w_i/c_i among those
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
    slot on its home rank, the R − N guest slots given by the transport of the ranks' excess load over `cost`."""
    w = [float(x) for x in (load.tolist() if torch.is_tensor(load) else load)]
    n = len(w)
    per_home, guests = n // ep, (slots - n) // ep
    homes = [[e for e in range(n) if home_of(e, n, ep) == r] for r in range(ep)]
    held = [list(homes[r]) for r in range(ep)]  # the experts on each rank's slots, homes first
    count = [1] * n
    home_load = [sum(w[e] for e in homes[r]) for r in range(ep)]
    mean = sum(w) / ep
    over = [max(x - mean, 0.0) for x in home_load]
    room = [max(mean - x, 0.0) for x in home_load]
    givers, takers = [r for r in range(ep) if over[r] > 0], [r for r in range(ep) if room[r] > 0]
    flow = sinkhorn([over[r] for r in givers], [room[r] for r in takers],
                    [[cost[a][b] for b in takers] for a in givers])
    flows = {(a, b): flow[i][j] for i, a in enumerate(givers) for j, b in enumerate(takers)}
    while True:  # the largest flow with a free guest slot on its taker and an expert of its giver to replicate
        best = None
        for (a, b), f in sorted(flows.items(), key=lambda kv: (-kv[1], kv[0])):
            if f <= 0 or len(held[b]) >= per_home + guests:
                continue
            candidates = [e for e in homes[a] if e not in held[b]]
            if candidates:
                best = (a, b, max(candidates, key=lambda e: (w[e] / count[e], -e)))
                break
        if best is None:
            break
        a, b, e = best
        held[b].append(e)
        count[e] += 1
        flows[(a, b)] -= w[e] / count[e]
    for b in range(ep):  # guest slots the flows left free: the cheapest link's hottest expert per replica
        while len(held[b]) < per_home + guests:
            e = min((e for e in range(n) if e not in held[b]),
                    key=lambda e: (cost[home_of(e, n, ep)][b], -w[e] / count[e], e))
            held[b].append(e)
            count[e] += 1
    phy2log, replica, seen = [], [], [0] * n
    for r in range(ep):
        for e in held[r]:
            phy2log.append(e)
            replica.append(seen[e])
            seen[e] += 1
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
