"""DeepSeek-V3's router (DeepSeek-AI 2024, §2.1.1-2.1.2; Wang et al. 2024, auxiliary-loss-free balancing;
DeepSeek-V2's device-limited routing): sigmoid scores, a per-expert selection bias balanced without a loss,
the sequence-wise balance loss, and group-limited routing. moe.Router gives the logits z [T, N]; this decides.

With scores s (fp32 or wider), the bias b [N] (fp32, not a parameter: no gradient), G groups of N/G experts
(group g: experts [g·N/G, (g+1)·N/G)) and a limit of M groups:
    s            = sigmoid(z)                (--moe-score sigmoid; softmax: p = softmax(z), moe.py's recipe)
    group score  a_tg = Σ of the top 2 of (s + b) over group g   (softmax: the max of p over group g)
    allowed      the M groups of largest a_tg; the other groups' experts are out of reach for token t
    experts      e_t = top-k of (s + b) over the allowed experts
    weights      w_tj = scale · s_{t,e_tj} / Σ_j s_{t,e_tj}      (softmax: moe.py's, p renormalised when k > 1)
    bias         b_i += γ · sign(mean_j c_j − c_i), once per optimizer step, c [N] the slots routed to each expert
                 (before capacity) by the training forwards of the WHOLE global batch
    seq loss     α · mean over sequences of Σ_i f_i·P_i, f_i = N/(k·T)·#{t: i ∈ top-k of s_t} (the unbiased,
                 unlimited top-k: eq. 18), P_i = (1/T)·Σ_t s_ti/Σ_j s_tj; T the sequence's tokens (eq. 17-20)
Ties: torch.topk leaves the order of equal values unspecified; here a stable descending sort decides, so the
LOWER index wins (a group, an expert): integer logits route alike on every device, and a float64 reference can
say which. With sigmoid and k = 1 the weight is 1 (as DeepSeek-V3's gate): the router then learns from the seq
loss only. The seq loss joins the aux channel as "moe_seq_balance" (moe.py: per micro-batch, the step divides
by D·m; a micro-batch's B_μ sequences are averaged, so the objective is the mean over the global batch's
sequences); under CP/SP a sequence is in pieces: its [B, 2N+1] statistics ride moe.router_losses' all-reduce.

Groups and the EP ranks (E): G divides N, and either G divides E (a group is E/G ranks: with G = the ep group's
nodes, DeepSeek-V3's node-limited routing) or E divides G (a rank holds G/E groups; G = E: device-limited); a
token's rows then reach at most max(1, E/G)·M ranks. What it buys: the EP exchange sends a token once per
destination rank (experts/dispatch.py), so the rows leaving the sender's group fall with M (`rows_per_token`, the
uniform count; `off_group`, the exchange's own, from the ranks of the physical slots: with --moe-replicas a
replica may sit outside its expert's group and is counted where it is).

1. Replicated and split. The bias: one logical [N] fp32 tensor per MoE layer, identical on every rank holding
   the layer (the loads it is updated from are all-reduced first). The loads: each rank's own, then global.
2. Peak per device. b and the step's load: 12·N bytes per MoE layer. Per micro-batch the router adds the [T, N]
   sort of the biased scores (e_r + 8 bytes per entry, transient). Saved for backward
   (moe_costs.layer_activation_bytes, tested against autograd): sigmoid's Σ_j s_tj and its always
   renormalised weights, the seq loss's statistics B_μ·(4N + 3)·e_r; group limiting saves nothing more (its
   masks are of detached scores).
3. Messages. With γ > 0 (`ExpertLoad.reduce`), once per optimizer step: one all_reduce of the L_moe·N int64
   loads over dp_cp (every rank that saw tokens: EP's ranks are data ranks), and over tp with --sp; PP: each
   stage its own layers. With --moe-replicas eplb's kept-slot loads (L_moe·N more) ride the same call. The
   seq loss adds B_μ·(2N+1)·e_r bytes to moe.py's statistics all-reduce under CP/SP (no call of its own). No
   host sync: the update is sign arithmetic on the device, and it runs on a step the
   update skips too (fp16 overflow: the loads were routed all the same), alike on every rank.
4. Restart state. The bias ("moe/<layer>.expert_bias", one logical copy, written by dp_cp and tp coordinate 0):
   it resumes on any E, P, C, T. The load of a step is zero between steps and not saved.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist


SCORES = ("softmax", "sigmoid")
# Flag → moe.ExpertsConfig field: joined to moe.FLAGS.
FLAGS = {"--moe-score": "score", "--moe-bias-rate": "bias_rate", "--moe-seq-aux-coef": "seq_aux_coef",
         "--moe-route-scale": "route_scale", "--moe-groups": "groups", "--moe-group-limit": "group_limit"}


def add_arguments(group) -> None:
    """The router's flags, in cli/flags.py's MoE argument group."""
    group.add_argument("--moe-score", choices=SCORES, default="softmax", help="router scores: softmax | sigmoid")
    group.add_argument("--moe-bias-rate", type=float, default=0.0,
                       help="sigmoid: aux-loss-free bias update rate γ (0: off; DeepSeek-V3: 1e-3)")
    group.add_argument("--moe-seq-aux-coef", type=float, default=0.0,
                       help="sequence-wise balance loss coefficient α (0: off; DeepSeek-V3: 1e-4)")
    group.add_argument("--moe-route-scale", type=float, default=1.0, help="combine weights' scale")
    group.add_argument("--moe-groups", type=int, default=0, help="expert groups G for group-limited routing (0: off)")
    group.add_argument("--moe-group-limit", type=int, default=0, help="groups M a token may reach")


def check_flags(config, ep: int) -> None:
    """Raise ValueError naming the flag when the router's flags (`config`: moe.ExpertsConfig) cannot work together
    (moe.check_flags calls it; their ranges are flags.check_ranges')."""
    n, k, g, m = config.experts, config.topk, config.groups, config.group_limit
    sigmoid = config.score == "sigmoid"
    for broken, message in (
            (config.bias_rate > 0 and not sigmoid,
             f"--moe-bias-rate {config.bias_rate} needs --moe-score sigmoid (a bias on softmax scores is"
             f" refused, as Megatron does)"),
            (g == 0 and m > 0, f"--moe-group-limit {m} needs --moe-groups G"),
            (g > 0 and n % g, f"--moe-groups {g} must divide --moe-experts {n}"),
            (g > 0 and ep % g and g % ep, f"--moe-groups {g} must divide --ep {ep} or be a multiple of it"
                                          f" (a group is E/G whole ranks, or a rank holds G/E whole groups)"),
            (g > 0 and not 1 <= m <= g, f"--moe-group-limit {m} must be between 1 and --moe-groups {g}"),
            (g > 0 and not n % g and sigmoid and n // g < 2,
             f"--moe-groups {g}: a group's score is its top 2 experts' (sigmoid): N/G = {n // max(g, 1)} < 2"),
            (g > 0 and not n % g and 1 <= m <= g and k > m * (n // g),
             f"--moe-topk {k} is more than the {m * (n // max(g, 1))} experts of --moe-group-limit {m} groups")):
        if broken:
            raise ValueError(message)


def describe(config) -> str:
    """The router in words, for the start-up line (report_axes' moe section)."""
    sigmoid, k = config.moe.score == "sigmoid", config.moe.topk
    steps = ["fp32 router: sigmoid" + (f" + bias (γ={config.moe.bias_rate:g} per step)" if sigmoid else "")
             if sigmoid else "fp32 router: softmax"]
    if config.moe.groups:
        steps.append(f"best {config.moe.group_limit} of {config.moe.groups} groups")
    steps.append("top-k")
    steps.append("renormalised" if sigmoid or k > 1 else "raw gate")
    text = " → ".join(steps) + (f" ×{config.moe.route_scale:g}" if config.moe.route_scale != 1.0 else "")
    return text + (f"; seq loss α={config.moe.seq_aux_coef:g}" if config.moe.seq_aux_coef else "")


def top_k(values: torch.Tensor, k: int) -> torch.Tensor:
    """[..., k] indices of the k largest along the last dimension, ties to the LOWER index (a stable sort)."""
    return values.sort(dim=-1, descending=True, stable=True).indices[..., :k].contiguous()  # not a view of [.., N]


def limit_to_groups(biased: torch.Tensor, groups: int, limit: int, top2: bool) -> torch.Tensor:
    """biased [T, N] with every expert outside each token's `limit` best groups set to -inf. A group's score is
    the sum of its top 2 biased scores (`top2`, sigmoid) or their max (softmax: DeepSeek-V2's)."""
    tokens, n = biased.shape
    per_group = biased.view(tokens, groups, n // groups)
    score = per_group.topk(2, dim=-1).values.sum(dim=-1) if top2 else per_group.amax(dim=-1)  # values: no ties
    allowed = torch.zeros((tokens, groups), dtype=torch.bool, device=biased.device)
    allowed.scatter_(1, top_k(score, limit), True)
    return per_group.masked_fill(~allowed.unsqueeze(-1), float("-inf")).view(tokens, n)


def route(logits: torch.Tensor, topk: int, score: str = "softmax", bias: torch.Tensor | None = None,
          groups: int = 0, limit: int = 0, scale: float = 1.0):
    """(P-scores [T, N] (per token, summing to 1: the balance losses' P), weights [T, k], experts [T, k], and the
    scores s [T, N]) of the module docstring's formulas. Selection is on detached values (b has no gradient;
    the index choice none anyway); the weights carry s's gradient to the router."""
    s = logits.softmax(dim=-1) if score == "softmax" else logits.sigmoid()
    biased = s.detach() if bias is None else s.detach() + bias
    if groups > 1 and limit < groups:
        biased = limit_to_groups(biased, groups, limit, top2=score == "sigmoid")
    expert = top_k(biased, topk)
    gate = s.gather(1, expert)
    if score == "sigmoid" or topk > 1:
        gate = gate / gate.sum(dim=-1, keepdim=True)
    if scale != 1.0:
        gate = gate * scale
    probs = s if score == "softmax" else s / s.sum(dim=-1, keepdim=True)
    return probs, gate, expert, s


def sequence_stats(s: torch.Tensor, probs: torch.Tensor, topk: int, sequences: int) -> torch.Tensor:
    """[B, 2N+1] per sequence of this rank's B·n tokens (b-major): the unbiased top-k counts (eq. 18's indicator
    sums), Σ_t of the normalised scores (eq. 19's), and n. Pieces of a sequence (CP, SP) add up."""
    tokens, n = s.shape
    chosen = torch.zeros_like(s).scatter_(1, top_k(s.detach(), topk), 1.0)
    per_seq = tokens // sequences
    counts = chosen.view(sequences, per_seq, n).sum(dim=1)
    summed = probs.view(sequences, per_seq, n).sum(dim=1)
    return torch.cat([counts, summed, counts.new_full((sequences, 1), per_seq)], dim=1)


def sequence_loss(stats: torch.Tensor, topk: int) -> torch.Tensor:
    """Mean over the B sequences of Σ_i f_i·P_i from their summed [B, 2N+1] `sequence_stats` (α outside)."""
    n = (stats.shape[1] - 1) // 2
    tokens = stats[:, 2 * n:]
    f = stats[:, :n] * (n / (topk * tokens))
    p = stats[:, n:2 * n] / tokens
    return (f * p).sum(dim=1).mean()


class ExpertLoad:
    """One MoE layer's balancing state: the selection bias b ([N] fp32, sigmoid scores only, else None), this
    step's routed slots per expert on this rank (`step`, int64), and the last step's (`last`: global over the
    batch when `reduce` (set with the bias; a reader that needs it global sets it at build, on every rank), else
    this rank's; None before the first step). The one place every reader of per-expert load goes:
    `layer.load.last` (the bench's MaxVio, a placement of hot experts)."""

    def __init__(self, n_experts: int, sigmoid: bool, rate: float):
        self.n_experts, self.rate = n_experts, rate
        self.reduce = rate > 0  # sum the step's load over the batch's ranks: the bias needs it (another reader may)
        self.bias = torch.zeros(n_experts, dtype=torch.float32) if sigmoid else None
        self.step = torch.zeros(n_experts, dtype=torch.long)
        self.last = None

    def on(self, device) -> ExpertLoad:
        """The state on `device` (moved, or zeros when built on meta, as train.compose builds the model)."""
        device = torch.device(device)
        if self.step.device != device:
            move = (lambda t: torch.zeros_like(t, device=device)) if self.step.is_meta else (lambda t: t.to(device))
            self.step = move(self.step)
            self.bias = None if self.bias is None else move(self.bias)
        return self

    def add(self, routed: torch.Tensor) -> None:
        self.on(routed.device).step += routed

    @torch.no_grad()
    def finish_step(self, load: torch.Tensor) -> None:
        """The step's load `load` [N] (global when the bias updates): b_i += γ·sign(mean − load_i); restart."""
        self.last = load.clone()
        if self.bias is not None and self.rate > 0:  # sign(mean − c_i) = sign(Σ c − N·c_i): exact in int64
            self.bias += self.rate * torch.sign(load.sum() - self.n_experts * load).to(torch.float32)
        self.step.zero_()


@torch.no_grad()
def finish_step(loads: list, groups=(), riders: torch.Tensor | None = None) -> torch.Tensor | None:
    """End the optimizer step of every MoE layer's ExpertLoad in `loads` (one stage's, same order on every rank):
    with the bias on, their counts summed over `groups` in one flat all-reduce per group (dp_cp, and tp with
    --sp), so every rank applies the same update; otherwise each keeps its own count. `riders` ([L, N] int64,
    eplb's kept slots per expert, and with its coselect placement [L, N + N²] the kept pairs too) ride the same
    all-reduce: ONE reduction per group, two users; returned summed (None without)."""
    if not loads:
        return riders
    stacked = torch.stack([load.step for load in loads])
    parts = ([stacked] if any(load.reduce for load in loads) else []) + ([riders] if riders is not None else [])
    if parts and groups:
        joined = torch.cat([part.reshape(-1) for part in parts])  # riders may be wider ([L, N + N²]: coselect)
        for group in groups:
            dist.all_reduce(joined, op=dist.ReduceOp.SUM, group=group)
        stacked = joined[:stacked.numel()].view(stacked.shape) if len(parts) == 2 or riders is None else stacked
        riders = joined[joined.numel() - riders.numel():].view(riders.shape) if riders is not None else None
    for load, total in zip(loads, stacked):
        load.finish_step(total)
    return riders


def load_messages(moe_layers: int, n_experts: int, groups: list) -> list:
    """(op, group, calls, bytes) of one optimizer step's load all-reduces (docstring item 3), for `groups`
    (the names of the groups of size > 1 the loads are summed over); [] when the bias is off."""
    return [("all_reduce", name, 1, 8 * moe_layers * n_experts) for name in groups]


# ---------------------------------------------------------------------------------------------------------
# What group-limited routing buys: the dispatch's rows that leave the sender's group
# ---------------------------------------------------------------------------------------------------------


class GroupPlaces(NamedTuple):
    """Where the EP ranks sit among the routing groups: `of_rank[r]` the place of EP rank r (its group of E/G
    ranks when G ≤ E; itself when a rank holds G/E groups), host ints; `mine` this rank's."""

    of_rank: list
    mine: int


def group_places(groups: int, ep: int, ep_index: int) -> GroupPlaces | None:
    """The layer's GroupPlaces, or None without groups or EP (nothing leaves a rank)."""
    if groups == 0 or ep == 1:
        return None
    ranks_per_place = max(1, ep // groups)
    places = [r // ranks_per_place for r in range(ep)]
    return GroupPlaces(places, places[ep_index])


def off_group(places: GroupPlaces | None, exchanged) -> tuple:
    """(rows this rank's deduplicated dispatch sent to ranks outside its place, rows it received from them (its
    combine sends as many back)): host ints from dispatch.Exchange, whose ranks are those of the PHYSICAL
    slots (with --moe-replicas a replica may lie outside its expert's group). (0, 0) without groups or EP."""
    if places is None:
        return 0, 0
    away = [place != places.mine for place in places.of_rank]
    return (sum(rows for rows, far in zip(exchanged.sent, away) if far),
            sum(rows for rows, far in zip(exchanged.received, away) if far))


def rows_per_token(n_experts: int, topk: int, groups: int, limit: int, ep: int) -> tuple:
    """Uniform routing's (rows per token, of them to ranks outside the sender's place) of the deduplicated
    exchange (one row per token and rank, experts/dispatch.py): each token's M groups drawn uniformly from the G,
    its k experts uniformly without repeats among the A = M·N/G allowed (no groups: G = M = E). A rank q holds
    c experts in each of u groups (G ≤ E: u = 1, c = N/E; else u = G/E, c = N/G); j ~ hypergeometric, q's u
    groups among the M chosen; q gets a row unless all k experts miss it:
        rows = E·(1 − miss),  off = (E − E/P)·(1 − miss),  miss = E_j[C(A − j·c, k) / C(A, k)]
    P the places (of E/G ranks each, or one rank each)."""
    groups, limit = (groups, limit) if groups else (ep, ep)
    per_place = max(1, ep // groups)
    u, c = max(1, groups // ep), n_experts // max(ep, groups)
    allowed = limit * n_experts // groups
    miss = sum(math.comb(u, j) * math.comb(groups - u, limit - j) / math.comb(groups, limit)
               * math.comb(allowed - j * c, topk) / math.comb(allowed, topk) for j in range(min(u, limit) + 1))
    return ep * (1 - miss), (ep - per_place) * (1 - miss)


def capacity(tokens: int, topk: int, n_experts: int, factor: float) -> int | None:
    """C_μ = ⌈T_μ·k/N · f⌉ slots per expert of a micro-batch of T_μ = B_μ·s tokens, or None when dropless."""
    if factor <= 0:
        return None
    return math.ceil(round(tokens * topk * factor / n_experts, 9))  # round: 35.000000001 is 35
