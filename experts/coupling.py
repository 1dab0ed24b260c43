"""Expert coupling (arXiv 2610.09372): which experts tokens choose together, and a placement of the experts over
the EP ranks that puts co-chosen ones on one rank, so the deduplicated exchange (experts/dispatch.py: one row per
token and destination rank) sends fewer rows. The model is unchanged: routing decides which experts a token
visits, the placement only which rank computes them.

The statistics, of a layer's routed sets (a token's k experts, before capacity) over a window of tokens:
    pairs       A[i][j] = #tokens whose set holds both i and j (i ≠ j), the co-selection matrix [N, N]
    top pairs   the ⌈1%·N(N−1)/2⌉ pairs of largest A; the share of tokens whose set holds one of them
                (the paper's top-2 figure: 0.8% of the pairs are chosen by 42% of the tokens), beside the
                share of the pairs it takes to cover 42% (`pairs_to_cover`, greedily by A)
    next layer  a token's set in the next MoE layer, b, given its set here, a: the share of tokens whose b is
                the most frequent b of their a, Σ_a max_b n(a, b) / Σ n, beside Σ_b n(b) / Σ n for the single
                most frequent b, whatever a (what knowing a adds)
A set is a bitmask key Σ_{e in set} 2^e (N ≤ 62, `MAX_KEYED`): accounting/observers.py's RoutedLoad keeps each
layer's keys and each pair of consecutive MoE layers' keys and counts them on the device (`fold`); the formulas
here read those counts on the host (`histogram`: {key: tokens}, {(key, next key): tokens}).

The placement (`partition`, `coselect_plan`): a balanced graph partition of A into E parts of N/E experts, each
part one rank's slots. The rows a top-2 token costs are 2 minus whether its pair shares a rank, so the rows of a
placement are 2·T − Σ_{i<j on one rank} A[i][j]: maximising the weight inside the parts (minimising the cut) is
minimising the rows. Algorithm: greedy growth (experts by their total co-selection, heaviest first, each into the
part with room it shares the most with; ties the lower part), then Kernighan–Lin passes (1970) between every two
parts, repeated until none gains: a pass swaps, one pair at a time, the two unlocked experts of largest gain
(their weight to the other part less their weight to their own, each, less 2·A[i][j]; negative gains too, so it
climbs out of a local optimum) and keeps the swaps up to the largest positive sum of gains. Loads are not
balanced by it (a hot pair lands on one rank): experts/eplb.py's placement does that, experts/transport.py's
with the links' costs.
With k > 2 the pair weight is the proxy the paper uses (a token's rows are the ranks its k experts span).

Symbols: N experts, k top-k, E EP ranks, T tokens, L_moe MoE layers.
1. Replicated and split: nothing of the model; the placement is a permutation of each layer's experts over the
   E ranks (experts/eplb.py holds it, `--moe-placement coselect` with --moe-replicas N).
2. Peak per device: `pair_counts` a [T, N + 1] one-hot and its [N + 1, N + 1] product (float64), per forward of
   a layer when the coselect placement runs (experts/eplb.py); the keys T·8 bytes a forward (the accounting's).
3. Messages: none here. experts/eplb.py sums each step's [N, N] pairs with its loads (one all-reduce).
4. Restart state: none here (experts/eplb.py saves the pairs' average beside the loads').
"""

from __future__ import annotations

import math

import torch

MAX_KEYED = 62  # a set of N ≤ 62 experts is one int64 bitmask


# ---------------------------------------------------------------------------------------------------------
# Counting (on the device, once per forward): a set's key, the pairs
# ---------------------------------------------------------------------------------------------------------


def set_keys(expert: torch.Tensor) -> torch.Tensor:
    """[T] int64: each token's set of experts [T, k] (distinct, < 62) as the bitmask Σ 2^e."""
    return torch.bitwise_left_shift(torch.ones_like(expert), expert).sum(dim=-1)


def pair_counts(slot_expert: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """[N, N] float64: A[i][j] the tokens whose kept slots hold both i and j (zero diagonal). slot_expert [T·k]
    (N: a slot capacity dropped, counted nowhere). One one-hot product: O(T·N²)."""
    onehot = (slot_expert.view(-1, k, 1) == torch.arange(n, device=slot_expert.device)).any(dim=1).double()
    pairs = onehot.T @ onehot  # [N, N], the diagonal each expert's own tokens
    return pairs - torch.diag(torch.diagonal(pairs))


def fold(counted: tuple | None, keys: list) -> tuple:
    """(distinct keys, their tokens) on the device: `counted` (the same, or None) with the [T] (or [T, 2]) key
    tensors of `keys` added; one torch.unique."""
    values = torch.cat(([counted[0]] if counted else []) + keys)
    weights = torch.cat(([counted[1]] if counted else []) + [torch.ones(len(k), dtype=torch.long, device=k.device)
                                                             for k in keys])
    distinct, inverse = torch.unique(values, dim=0 if values.dim() > 1 else None, return_inverse=True)
    counts = torch.zeros(len(distinct), dtype=torch.long, device=values.device)
    return distinct, counts.scatter_add_(0, inverse, weights)


def histogram(counted: tuple | None) -> dict:
    """`fold`'s counts on the host: {key or (key, next key): tokens}."""
    if counted is None:
        return {}
    return {tuple(v) if isinstance(v, list) else v: c for v, c in zip(counted[0].tolist(), counted[1].tolist())}


def members(key: int) -> list:
    """The experts of a set's bitmask, ascending."""
    return [e for e in range(key.bit_length()) if key >> e & 1]


# ---------------------------------------------------------------------------------------------------------
# The statistics (host, from the counts)
# ---------------------------------------------------------------------------------------------------------


def pair_matrix(sets: dict, n: int) -> list:
    """[N][N] tokens choosing both i and j, from {set key: tokens}."""
    out = [[0] * n for _ in range(n)]
    for key, count in sets.items():
        chosen = members(key)
        for a in chosen:
            for b in chosen:
                if a != b:
                    out[a][b] += count
    return out


def ranked_pairs(sets: dict, n: int) -> list:
    """[(tokens, i, j)] of the N(N−1)/2 pairs i < j, most chosen first (ties: the lower pair)."""
    matrix = pair_matrix(sets, n)
    return sorted(((matrix[i][j], i, j) for i in range(n) for j in range(i + 1, n)), key=lambda t: (-t[0], t[1], t[2]))


def covered(sets: dict, pairs: set) -> int:
    """Tokens whose set holds at least one of `pairs` ({(i, j)}, i < j)."""
    total = 0
    for key, count in sets.items():
        chosen = members(key)
        if any((a, b) in pairs for x, a in enumerate(chosen) for b in chosen[x + 1:]):
            total += count
    return total


def top_pair_coverage(sets: dict, n: int, share: float = 0.01) -> tuple:
    """(pairs taken, pairs in all, share of the tokens covered): the ⌈share·N(N−1)/2⌉ most chosen pairs (at least
    one), and the share of tokens whose set holds one of them."""
    ranked = ranked_pairs(sets, n)
    take = max(1, math.ceil(round(share * len(ranked), 9)))
    tokens = sum(sets.values())
    return take, len(ranked), covered(sets, {(i, j) for _, i, j in ranked[:take]}) / max(1, tokens)


def pairs_to_cover(sets: dict, n: int, share: float = 0.42) -> float:
    """The share of the N(N−1)/2 pairs it takes, most chosen first, to cover `share` of the tokens."""
    ranked, tokens = ranked_pairs(sets, n), sum(sets.values())
    taken = set()
    for count, i, j in ranked:
        taken.add((i, j))
        if covered(sets, taken) >= share * tokens:
            return len(taken) / len(ranked)
    return 1.0


def next_layer_predictability(joint: dict) -> tuple:
    """(Σ_a max_b n(a, b) / Σ n, max_b n(b) / Σ n) from {(set here, set next): tokens}: how often a token's next
    set is the most frequent one given its set here, and the same without knowing it."""
    total = sum(joint.values())
    if not total:
        return math.nan, math.nan
    best, nexts = {}, {}
    for (a, b), count in joint.items():
        best[a] = max(best.get(a, 0), count)
        nexts[b] = nexts.get(b, 0) + count
    return sum(best.values()) / total, max(nexts.values()) / total


def dispatch_rows(sets: dict, rank_of: list, k: int) -> tuple:
    """(rows, slots) of the tokens of `sets` under a placement, rank_of[e] the rank of expert e: the deduplicated
    exchange's rows Σ tokens·|ranks its set spans| and a per-slot dispatcher's, tokens·k (dropless)."""
    rows = sum(count * len({rank_of[e] for e in members(key)}) for key, count in sets.items())
    return rows, k * sum(sets.values())


# ---------------------------------------------------------------------------------------------------------
# The placement: a balanced partition of the co-selection graph
# ---------------------------------------------------------------------------------------------------------


def partition(pairs, parts: int) -> list:
    """part[e] for each of the N experts: N/parts in each part, the weight of `pairs` ([N][N], made symmetric) inside
    the parts made large by greedy growth then Kernighan–Lin passes (the module docstring)."""
    given = pairs.tolist() if torch.is_tensor(pairs) else pairs
    n = len(given)
    weight = [[(float(given[i][j]) + float(given[j][i])) / 2 for j in range(n)] for i in range(n)]  # symmetric
    size = n // parts
    part, members_of = [None] * n, [[] for _ in range(parts)]
    for e in sorted(range(n), key=lambda e: (-sum(weight[e]), e)):
        best = max((p for p in range(parts) if len(members_of[p]) < size),
                   key=lambda p: (sum(weight[e][f] for f in members_of[p]), -p))
        part[e] = best
        members_of[best].append(e)
    improved = True
    while improved:  # Kernighan–Lin passes over each pair of parts until no pass gains
        improved = False
        for p in range(parts):
            for q in range(p + 1, parts):
                improved |= _kernighan_lin_pass(weight, part, p, q)
    return part


def _kernighan_lin_pass(weight: list, part: list, p: int, q: int) -> bool:
    """One Kernighan–Lin pass between parts p and q (in place): swap the unlocked pair (a in p, b in q) of the largest
    gain, g = D_a + D_b − 2·A[a][b] with D = (weight to the other part) − (weight to its own), even a negative one,
    lock both, |p| times; then keep the swaps up to the largest positive sum of gains and undo the rest. Whether it
    gained."""
    side = {e: part[e] for e in range(len(part)) if part[e] in (p, q)}
    free = set(side)
    swaps, total, best, best_at = [], 0.0, 0.0, 0
    for _ in range(len(side) // 2):
        d = {e: sum(weight[e][f] for f in side if side[f] != side[e]) - sum(weight[e][f] for f in side
                                                                            if side[f] == side[e] and f != e)
             for e in free}
        pick = max(((d[a] + d[b] - 2 * weight[a][b], -a, -b) for a in free for b in free
                    if side[a] == p and side[b] == q), default=None)
        if pick is None:
            break
        gain, a, b = pick[0], -pick[1], -pick[2]
        side[a], side[b] = q, p
        free -= {a, b}
        swaps.append((a, b))
        total += gain
        if total > best + 1e-9:
            best, best_at = total, len(swaps)
    for a, b in swaps[:best_at]:
        part[a], part[b] = q, p
    return best_at > 0


def coselect_plan(pairs, ep: int) -> tuple:
    """(phy2log [N], replica [N], logcnt [N]) in experts/eplb.py's form: rank r's N/E slots hold part r's
    experts, ascending; each expert once."""
    part = partition(pairs, ep)
    phy2log = [e for r in range(ep) for e in range(len(part)) if part[e] == r]
    return phy2log, [0] * len(part), [1] * len(part)


def inside_weight(pairs, rank_of: list) -> float:
    """Σ_{i<j, same rank} A[i][j]: the tokens (top-2) a placement saves a row of."""
    weight = pairs.tolist() if torch.is_tensor(pairs) else pairs
    n = len(weight)
    return sum(weight[i][j] for i in range(n) for j in range(i + 1, n) if rank_of[i] == rank_of[j])
