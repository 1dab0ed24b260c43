"""Redundant experts for hot ones: DeepSeek's expert-parallel load balancer (EPLB, deepseek-ai/EPLB's experts/eplb.py;
DeepSeek-V3 §3.4.1) and what it takes to train with its placement.

The placement. N logical experts per MoE layer, their loads w (a moving average of the tokens routed to each),
R ≥ N physical slots, R/E on each of the E expert-parallel ranks. Hierarchical (when the nodes divide the groups):
    1. pack the G expert groups (N/G consecutive experts each) onto the nodes, G/nodes per node, balancing the
       nodes' loads (`balanced_packing`: heaviest first, each to the lightest node with room);
    2. inside each node, give its R/nodes slots to its experts: one each, then every extra slot to the expert
       with the largest load per replica w_i / c_i (`replicate_experts`);
    3. pack each node's replicas, of load w_i / c_i each, onto its ranks, R/E per rank (`balanced_packing`).
Otherwise one global step: groups = nodes = 1. The result, per layer: phy2log [R] (the logical expert of each
physical slot, rank r holding slots [r·R/E, (r+1)·R/E)), log2phy [N, max c] (each expert's slots, -1 padded),
logcnt [N] (c_i). Loads in float32, ties broken as deepseek-ai/EPLB's experts/eplb.py breaks them (torch.sort's order,
the lower index), so its placements are reproduced exactly. The trainer places over the E ranks of an ep group
with the global policy (one group, one node). `--moe-placement` chooses the policy: eplb (this one, the
default), sinkhorn (experts/transport.py: the replicas over the links' costs, TAOT), coselect (experts/coupling.py:
R = N, a permutation putting co-chosen experts on one rank; each step's kept pairs [N, N] are averaged with the
loads and placed from), or a fixed list of the R slots' experts (every plan, re-plans and resumes included).

Training with it (`Replicas`; `apply`, the axis of --moe-replicas R, places them right after moe.py's):
- Dispatch. A slot routed to logical expert i, the j-th of this rank's slots routed to i in token order (kept
  slots only), goes to replica j mod c_i (`Replicas.physical`); the all-to-all is by physical slot (moe.py
  sorts and splits by slot: R bins instead of N). The replica decides which rank computes a row, not its
  value (up to the rounding of another matmul shape).
- Gradients. Each slot is its own copy of the logical expert's tensors (named by the logical expert, so the
  init and the checkpoint see one logical tensor). After the layout's sum over expert_dp, `sum_replica_grads`
  adds the gradients of the slots holding the same logical expert: every replica then holds the logical
  expert's whole gradient, and the same AdamW update keeps the replicas bitwise equal (the all-reduce hands
  every rank the same sum). Under DDP each ep rank holds its slots' gradients whole: the sum runs over ep.
  Under ZeRO each expert_dp rank holds a flat range of them (and of the master weights and moments; at stage 3
  of the working weights too, which it gathers only around each block: the sum and the moves read and write
  the shards, never a gathered weight), read through the layout's state_pieces and grad_pieces: the sum runs
  over dp×cp, each element added by the one rank holding it. The grad norm and the checkpoint count one copy:
  replica 0 (`ShardInfo.replica`; the layout recounts after a re-plan).
- Re-planning. Each layer counts the kept slots routed to each logical expert in training (what loads it);
  once per step `after_grad_sync` sums them over dp×cp (and tp with --sp: the ranks holding the same layers
  see different tokens) and folds them into a moving average, load ← d·load + (1 − d)·step's, d =
  --moe-load-decay, the same on every rank; every n = --moe-replan-every training steps the placement is
  recomputed from the average (kept as `planned`; the same on every rank: the same bits in), and each slot
  whose logical expert changed takes that expert's weights, gradient and AdamW state from its lowest old slot,
  before the optimizer step (`move_slots`: one all-reduce of the moved experts' state over the group of the
  gradient sum, each element added by one rank; an all-to-all of the moved slots would send less, one
  collective for both layouts reads simpler).

Symbols: N, E, R as above, L_moe MoE layers this rank holds, Ψ_e one expert's parameters, e_g the bytes of a
gradient element (DDP: the parameters'; ZeRO: its accumulation dtype's), e_o of the optimizer's (DDP: the
parameters'; ZeRO: the master dtype's), K the kinds of state a slot carries (DDP 4: weights, gradient, two
moments; ZeRO 5: and the master weights), n the re-plan interval, M the slots of all layers that move at a
re-plan, g the gradient sum's group (ep under DDP, dp×cp under ZeRO 1/2/3).

1. Replicated and split. Split E ways: the R physical slots (R/E per rank). Replicated: a hot expert's tensors
   on c_i slots, bitwise equal; the placement (phy2log, log2phy, logcnt) and each layer's two load averages
   (the running one and the planned one, N float64 each) on every rank, the same.
2. Peak per device. Parameters L_moe·(R/E)·Ψ_e for the experts (R/N times plain EP's), ×16 bytes with fp32
   gradients and AdamW under DDP (ZeRO shards the state as it does the rest). Temporaries: the replica sum's
   buffer, L_moe·(R − N)·Ψ_e·e_g; a re-plan's, M·K·Ψ_e·e_o. The dispatch's: plain EP's, with [R] counts.
3. Messages, per optimizer step, on top of plain EP's (whose counts all-to-all carries 8R bytes, not 8N):
       all_reduce  g           L_moe·(R − N)·Ψ_e·e_g   the replicas' gradient sum (padded to R − N experts a
                                                      layer, so its size never depends on the plan)
       all_reduce  dp×cp (tp)  L_moe·N·8               the step's kept slots per expert (float64)
   and per re-plan (every n steps; the startup table's 1/n calls a step, no move: a uniform load keeps the plan):
       all_reduce  dp×cp (tp)  L_moe·(N + E)·8         the window's kept slots per expert and rows per ep rank
                                                      (float64: the measured balance)
       all_reduce  g           M·K·Ψ_e·e_o             the moved slots' state (when a slot moves)
   Host syncs per re-plan: one `.tolist()` of the windows, one copy of each layer's average to the host.
4. Restart state: per MoE layer, the moving average and the average the placement was made from (`planned`),
   N float64 each, logical and one copy (the same on every rank: "moe/<layer>.expert_load", "..._planned",
   written by dp×cp and tp rank 0 of the stage). The checkpoint holds each replica set as ONE logical expert
   (`...experts.<i>...`), so it loads with any R and E; then `after_load` places each layer from its loaded
   `planned` on this run's R slots and E ranks, moves the slots as a re-plan does, and counts the steps from
   the checkpoint's, so the re-plans fall on the same steps. The same mesh, R and n: the placement, hence the
   run, is the uninterrupted one's bitwise. Another E or R: the saved average placed anew (the placement decides
   which rank computes a row, never its value: float tolerance). A checkpoint without these pieces (written
   without replicas): the uniform placement and a fresh average. The window (accounting only) starts afresh.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from experts import coupling, transport
from moe import MoE
from shard import ShardInfo, StatePiece, counts_here
from step import Axis, Messages, is_training_forward

# ---------------------------------------------------------------------------------------------------------
# The placement (deepseek-ai/EPLB): pure, on the host
# ---------------------------------------------------------------------------------------------------------


def balanced_packing(weights: torch.Tensor, packs: int) -> list:
    """[(pack, place in pack)] for each of the n items (weights: [n] float32): n/packs items in each pack,
    heaviest first (in the order torch.sort gives, as deepseek-ai/EPLB's), each into the lightest pack that
    still has room (ties: the lower pack; loads summed in float32). One item per pack: item i → pack i."""
    per_pack = len(weights) // packs
    if per_pack == 1:
        return [(i, 0) for i in range(len(weights))]
    loads, sizes = torch.zeros(packs, dtype=torch.float32), [0] * packs
    where = [None] * len(weights)
    for item in weights.sort(descending=True).indices.tolist():
        pack = min((p for p in range(packs) if sizes[p] < per_pack), key=lambda p: float(loads[p]))
        where[item] = (pack, sizes[pack])
        loads[pack] += weights[item]
        sizes[pack] += 1
    return where


def replicate_experts(weights: torch.Tensor, slots: int) -> tuple:
    """(phy2log [slots], replica rank [slots], count [n]) for weights [n] float32: slot i < n holds expert i;
    each further slot goes to the expert with the largest load per replica w/c (ties: the lower expert),
    which minimises the largest load a replica carries."""
    count = torch.ones(len(weights), dtype=torch.long)
    phy2log, rank = list(range(len(weights))), [0] * len(weights)
    for _ in range(slots - len(weights)):
        hottest = int((weights / count).max(dim=0).indices)
        phy2log.append(hottest)
        rank.append(int(count[hottest]))
        count[hottest] += 1
    return phy2log, rank, count.tolist()


def place_layer(load: torch.Tensor, slots: int, groups: int, nodes: int, ranks: int) -> tuple:
    """(phy2log [slots], replica rank [slots], logcnt [N]) of one layer (load: [N] float32): the module
    docstring's three steps."""
    n = len(load)
    group_size, per_node = n // groups, n // nodes
    # 1. groups onto nodes: node-local expert m of node k is logical mlog2log[k·N/nodes + m]
    mlog2log = [0] * n
    for g, (node, place) in enumerate(balanced_packing(load.view(groups, group_size).sum(dim=1), nodes)):
        first = (node * (groups // nodes) + place) * group_size
        mlog2log[first:first + group_size] = range(g * group_size, (g + 1) * group_size)
    phy2log, replica, logcnt = [], [], [0] * n
    slots_per_node, per_rank = slots // nodes, slots // ranks
    for node in range(nodes):
        local = mlog2log[node * per_node:(node + 1) * per_node]
        node_load = load[local]
        # 2. the node's slots to its experts
        node_phy2log, node_rank, node_count = replicate_experts(node_load, slots_per_node)
        # 3. the node's replicas onto its ranks, each replica carrying w/c
        replica_load = (node_load / torch.tensor(node_count, dtype=torch.float32))[node_phy2log]
        placed = [None] * slots_per_node
        for phy, (rank, place) in enumerate(balanced_packing(replica_load, ranks // nodes)):
            placed[rank * per_rank + place] = phy
        phy2log += [local[node_phy2log[phy]] for phy in placed]
        replica += [node_rank[phy] for phy in placed]
        for m, c in enumerate(node_count):
            logcnt[local[m]] = c
    return phy2log, replica, logcnt


def rebalance_experts(load: torch.Tensor, slots: int, groups: int, nodes: int, ranks: int) -> tuple:
    """deepseek-ai/EPLB's entry point: load [L, N] → (phy2log [L, R], log2phy [L, N, max c] (-1 padded),
    logcnt [L, N]), int64. Hierarchical when `nodes` divides `groups`, else global (one group, one node)."""
    if groups % nodes:
        groups, nodes = 1, 1
    layers = [place_layer(row, slots, groups, nodes, ranks) for row in load.float().cpu()]
    width = max(max(logcnt) for _, _, logcnt in layers)
    log2phy = torch.full((len(layers), load.shape[1], width), -1, dtype=torch.long)
    for layer, (phy2log, replica, _) in enumerate(layers):
        for phy, (expert, r) in enumerate(zip(phy2log, replica)):
            log2phy[layer, expert, r] = phy
    return (torch.tensor([p for p, _, _ in layers], dtype=torch.long), log2phy,
            torch.tensor([c for _, _, c in layers], dtype=torch.long))


# ---------------------------------------------------------------------------------------------------------
# Training with a placement: one layer's slots (what its dispatch reads), the step's work over all layers
# ---------------------------------------------------------------------------------------------------------


class Replicas:
    """One MoE layer's physical slots: the plan (phy2log, replica rank, logcnt: host lists), the tables its
    dispatch reads (on the device), and the kept slots this rank's training forwards routed. `policy` places
    them (`plan`): "eplb", "sinkhorn" (over `cost`), "coselect" (then the step's load carries the step's kept
    pairs too, [N + N²]: the averages the same width) or a fixed phy2log tuple."""

    def __init__(self, n_experts: int, slots: int, ep_size: int, ep_index: int, device, policy="eplb",
                 cost=None, topk: int = 1):
        self.n_experts, self.slots, self.ep_size = n_experts, slots, ep_size
        self.policy, self.cost, self.topk = policy, cost, topk
        per_rank = slots // ep_size
        self.local = range(ep_index * per_rank, (ep_index + 1) * per_rank)  # the slots this rank holds
        width = n_experts + (n_experts * n_experts if policy == "coselect" else 0)
        self.step_load = torch.zeros(width, dtype=torch.float64, device=device)  # this step's kept slots (pairs)
        self.average = torch.zeros_like(self.step_load)  # the moving average of the global step loads
        self.planned = torch.ones_like(self.step_load)  # the average the plan was made from (uniform: ones)
        self.window = torch.zeros(n_experts + ep_size, dtype=torch.float64, device=device)  # since the last
        # re-plan: kept slots per expert, then the rows sent to each ep rank

    def set_plan(self, phy2log: list, replica: list, logcnt: list) -> None:
        self.phy2log, self.replica, self.logcnt = phy2log, replica, logcnt
        table = [[self.slots] * max(logcnt) for _ in range(self.n_experts + 1)]  # row N: dropped, sorted last
        for phy, (expert, rank) in enumerate(zip(phy2log, replica)):
            table[expert][rank] = phy
        self.slot_of = torch.tensor(table, device=self.step_load.device)  # [N + 1, max c]: log2phy
        self.count_of = torch.tensor(logcnt + [1], device=self.step_load.device)  # [N + 1]

    def plan(self) -> tuple:
        """The placement of `planned` by the policy (one host sync): the same bits in, the same plan, on any rank,
        any run. From the uniform start (loads of ones, pairs of ones): EPLB's uniform plan, Sinkhorn's homes,
        coselect's experts in place (expert i on rank ⌊i·E/N⌋). On meta (plan.py's roles) the uniform start."""
        meta = self.planned.is_meta
        n, planned = self.n_experts, torch.ones(self.planned.shape, dtype=torch.float64) if meta else self.planned.cpu()
        if self.policy == "coselect":
            return coupling.coselect_plan(planned[n:].view(n, n), self.ep_size)
        if self.policy == "sinkhorn":
            return transport.place(planned[:n], self.slots, self.ep_size, self.cost)
        if isinstance(self.policy, tuple):  # --moe-placement as a list: that plan, always
            replica = [self.policy[:q].count(e) for q, e in enumerate(self.policy)]
            return list(self.policy), replica, [self.policy.count(e) for e in range(n)]
        return place_layer(planned[:n].float(), self.slots, 1, 1, self.ep_size)

    def physical(self, slot_expert: torch.Tensor, training: bool) -> torch.Tensor:
        """[S] the physical slot of each slot (R: dropped) from its logical expert (N: dropped): the j-th slot
        routed to expert i (token order) goes to replica j mod c_i. No host sync. A training forward (train
        mode, grad on, not a recompute inside backward, as observers.RoutedLoad decides) adds to the load."""
        order = torch.argsort(slot_expert, stable=True)  # by expert, token order inside
        ones = torch.ones_like(slot_expert)
        per_expert = torch.zeros(self.n_experts + 1, dtype=torch.long, device=ones.device).scatter_add_(
            0, slot_expert, ones)
        first = per_expert.cumsum(0) - per_expert  # where each expert's run starts in `order`
        place = torch.empty_like(slot_expert)
        place[order] = torch.arange(len(order), device=ones.device) - first[slot_expert[order]]
        physical = self.slot_of[slot_expert, place % self.count_of[slot_expert]]
        if is_training_forward(training):
            per_slot = torch.zeros(self.slots + 1, dtype=torch.long, device=ones.device).scatter_add_(
                0, physical, ones)[:self.slots]
            self.step_load[:self.n_experts] += per_expert[:self.n_experts]
            if self.policy == "coselect":
                self.step_load[self.n_experts:] += coupling.pair_counts(slot_expert, self.n_experts, self.topk).view(-1)
            self.window += torch.cat([per_expert[:self.n_experts], per_slot.view(self.ep_size, -1).sum(dim=1)])
        return physical


def place_slots(layer, slots: int, ep_group, ep_size: int, ep_index: int, device, policy="eplb", cost=None) -> None:
    """Give `layer` (a moe.MoE, its N experts whole) its R/E physical slots [e·R/E, (e+1)·R/E) under the policy's
    plan of a uniform load: slot q a copy of expert phy2log[q] (named by that logical expert, so the init and the
    checkpoint see one tensor), its gradient summed over expert_dp; the other experts dropped."""
    replicas = Replicas(layer.n_experts, slots, ep_size, ep_index, device, policy, cost, layer.topk)
    replicas.set_plan(*replicas.plan())
    kept = {}
    for q in replicas.local:
        expert = copy.deepcopy(layer.experts[str(replicas.phy2log[q])])  # on meta in train.compose: no values
        for copied, original in zip(expert.parameters(), layer.experts[str(replicas.phy2log[q])].parameters()):
            copied.shard_info = replace(original.shard_info, grad_group="expert_dp", replica=replicas.replica[q])
        kept[str(q)] = expert
    layer.experts = torch.nn.ModuleDict(kept)
    layer.local, layer.replicas = replicas.local, replicas
    layer.ep_group, layer.ep_size = (ep_group, ep_size) if ep_size > 1 else (None, 1)


def check_flags(slots: int, n_experts: int, ep: int) -> None:
    """Raise ValueError naming --moe-replicas when R cannot be placed (run by moe.config_from_flags). With
    --moe-groups a replica may lie outside its expert's group: the exchange sends to the ranks of the PHYSICAL
    slots, and router.off_group counts what leaves a group from them (tests/test_moe.py's off-group run)."""
    for broken, message in (
            (slots < n_experts, f"--moe-replicas {slots} must be at least --moe-experts {n_experts} (every expert"
                                f" needs a slot)"),
            (slots % ep, f"--moe-replicas {slots} must be a multiple of --ep {ep} (R/E slots on each rank)"),
            (slots > n_experts * ep, f"--moe-replicas {slots} is more replicas than slots: each of the {ep} ranks"
                                     f" would hold {slots // ep} slots for {n_experts} experts (at most N·E ="
                                     f" {n_experts * ep})")):
        if broken:
            raise ValueError(message)


@dataclass(frozen=True)
class ReplicaFacts:
    """What the accounting reads of the replicas (`RedundantExperts.facts`): the plan of the first MoE layer this
    rank holds, and the rows per EP rank measured over the last re-plan's window."""

    slots: int  # R
    replans: int
    layer_id: int
    phy2log: tuple  # of layer `layer_id` now, slot by slot (rank r: [r·R/E, (r+1)·R/E))
    measured_under: tuple  # its phy2log during the window before the last re-plan (empty: none yet)
    balance: float  # max/mean rows received per EP rank over that window, all layers (nan: no window yet)
    in_place: float  # the same for plain EP (expert i on rank ⌊i·E/N⌋) on the same kept slots
    policy: str = "eplb"  # --moe-placement's (a fixed list: "fixed")


class RedundantExperts(Axis):
    """The handle of --moe-replicas (step.Axis), over the MoE layers this rank holds (at least one): after the
    layout's sum over expert_dp and moe.MoEAxis's (which summed the step's loads), the replicas' gradient sum, the
    load average and every n-th step the re-plan; the averages as restart state; the placement re-made after a
    load. groups: {"ep", "dp_cp", "expert_dp"}; load_groups: {name: group} of the ranks whose tokens these layers
    route too (dp×cp, and tp with --sp)."""

    name = "eplb"

    def __init__(self, layers: list, replan_every: int, decay: float, groups: dict, load_groups: dict,
                 coords: dict | None = None):
        self.layers, self.replan_every, self.decay, self.groups = layers, replan_every, decay, groups
        self.load_groups = {name: group for name, group in load_groups.items() if dist.get_world_size(group) > 1}
        self.coords = coords  # mesh.coordinates(): which rank writes the one copy of the restart state
        first = layers[0].replicas
        self.n, self.slots, self.ep = first.n_experts, first.slots, first.ep_size
        self.steps, self.replans, self.moved = 0, 0, [0, 0]  # since start-up; moved: the moves' calls and bytes
        self.step = 0  # the training step (a resumed run starts at its checkpoint's): every n-th re-plans
        self.measured = ((), math.nan, math.nan)  # ReplicaFacts' measured_under, balance, in_place
        self.pieces, self.sharded = None, False  # the layout's state of each slot parameter (`slot_state`)
        self.sharded_weights = False  # ZeRO-3: the weights too are each expert_dp rank's flat range
        # The step's loads ride the routers' load all-reduce when theirs reduce (moe.MoEAxis.after_grad_sync
        # sums them there in any case: one call per group, counted here or with the routers' messages).
        self.shared_load_reduce = any(layer.load.reduce for layer in layers)

    def expert_size(self) -> int:
        """Ψ_e: one slot's parameters."""
        return sum(p.numel() for p in next(iter(self.layers[0].experts.values())).parameters())

    def step_loads(self) -> torch.Tensor:
        """[L, N] int64: this rank's kept slots per expert of the step, per layer (what `after_grad_sync` folds,
        summed once moe.MoEAxis.after_grad_sync has run: it sums them in the router's load all-reduce)."""
        return torch.stack([layer.replicas.step_load for layer in self.layers]).long()

    @torch.no_grad()
    def after_grad_sync(self, layout) -> int:
        """The replicas' gradient sum; the step's loads, summed over the ranks that routed these layers' tokens
        (moe.MoEAxis.after_grad_sync did, in the routers' all-reduce), folded into the average (so it is the same
        on every rank: one logical copy); every n-th step, the re-plan."""
        if self.slots > self.n:
            self.sum_replica_grads(layout)
        for layer, load in zip(self.layers, self.step_loads().to(torch.float64)):
            r = layer.replicas
            r.average.mul_(self.decay).add_(load, alpha=1 - self.decay)
            r.step_load.zero_()
        self.steps, self.step = self.steps + 1, self.step + 1
        if self.ep > 1 and self.step % self.replan_every == 0:
            self.replan(layout)
        return 0

    def state_pieces(self) -> list:
        """The restart state (docstring item 4), per layer, one logical copy (the same on every rank of dp×cp
        and tp): "moe/<layer>.expert_load", the moving average, and ".expert_load_planned", the average the
        placement was made from; with --moe-placement coselect ".expert_pairs" and ".expert_pairs_planned", the
        [N²] pairs' (flat). Optional: a checkpoint written without them resumes from the uniform placement and a
        fresh average."""
        pieces, n = [], self.n
        for layer in self.layers:
            r = layer.replicas
            for suffix, tensor in (("expert_load", r.average[:n]), ("expert_load_planned", r.planned[:n]),
                                   *((("expert_pairs", r.average[n:]), ("expert_pairs_planned", r.planned[n:]))
                                     if r.policy == "coselect" else ())):  # coselect's [N, N] pairs
                info = ShardInfo(f"transformer.h.{layer.layer_id}.mlp.{suffix}", tuple(tensor.shape),
                                 replicated_over=("tp",))
                pieces.append(StatePiece(f"moe/{info.global_name}", tensor, info, optional=True,
                                         primary=counts_here(info, self.coords, ("dp_cp",))))
        return pieces

    @torch.no_grad()
    def after_load(self, layout, step: int) -> None:
        """A checkpoint was loaded at `step` (its slots each hold their logical expert, by the plan in place):
        place each layer from its loaded `planned` average, as the run that wrote it had (on another E or R:
        that average placed on this run's slots), and move the slots, as a re-plan does; count the steps from
        `step`, so the re-plans fall on the same steps."""
        self.step = step
        old = [layer.replicas.phy2log for layer in self.layers]
        for layer in self.layers:
            layer.replicas.set_plan(*layer.replicas.plan())
        self.adopt(layout, old)

    def slot_state(self, layout) -> dict:
        """{slot parameter: [(kind, this rank's tensor of it, (lo, hi) its place in the parameter's flat
        elements)]}: its weights, gradient and AdamW state, read through the layout's protocol (state_pieces,
        grad_pieces): whole under DDP; under ZeRO this rank's flat range of the gradient, master weights and
        moments (`sharded`: those are then summed over dp×cp, not ep), the weights whole at stages 1/2, a flat
        range at stage 3 (`sharded_weights`; the next forward gathers the moved range). Read once: a re-plan
        moves values, never parameters or pieces."""
        if self.pieces is None:
            pieces = layout.state_pieces()
            self.sharded = any(piece.key.startswith("master/") for piece in pieces)
            self.sharded_weights = any(piece.key.startswith("param/") and piece.flat_range for piece in pieces)
            by_record = {}
            for piece in pieces:
                by_record.setdefault(id(piece.shard), []).append(piece)
            self.pieces = {}
            for p in (p for layer in self.layers for p in layer.experts.parameters()):
                state = []
                for piece in by_record.get(id(p.shard_info), []):
                    lo, hi = piece.flat_range or (0, p.numel())
                    state.append((piece.key.split("/")[0], piece.tensor, (lo, hi)))
                    if piece.key.startswith("exp_avg/"):  # the gradient piece is the moments' range
                        state += [("grad", g, (lo, hi)) for g in layout.grad_pieces([p])]
                self.pieces[p] = state
        return self.pieces

    def summed_over(self, kind: str) -> tuple:
        """(the group a slot's `kind` is summed over, whether this rank adds its copy): ep when each ep rank holds
        its slots whole (DDP); dp×cp when the layout shards them over expert_dp (ZeRO), the weights (whole on
        every expert_dp rank at stages 1/2) added by expert_dp rank 0 only (stage 3: each rank its flat range)."""
        if not self.sharded:
            return "ep", True
        whole = kind == "param" and not self.sharded_weights
        return "dp_cp", not whole or dist.get_rank(self.groups["expert_dp"]) == 0

    def sum_replica_grads(self, layout) -> None:
        """Every slot of a replicated expert gets the sum of all its slots' gradients: one all-reduce of R − N
        experts a layer (the replicated ones, in expert order, zeros past them and where absent) over
        `summed_over("grad")`, each rank adding the pieces it holds at their place in the expert."""
        state = self.slot_state(layout)
        like = next(t for p in state for kind, t, _ in state[p] if kind == "grad")
        buffer = like.new_zeros((len(self.layers), self.slots - self.n, self.expert_size()))
        places = []  # (layer index, row, slot)
        for index, layer in enumerate(self.layers):
            r = layer.replicas
            row = {e: j for j, e in enumerate(i for i, c in enumerate(r.logcnt) if c > 1)}
            places += [(index, row[r.phy2log[q]], layer.experts[str(q)]) for q in r.local if r.phy2log[q] in row]
        for index, row, slot in places:
            for kind, t, (lo, hi) in self.pieces_of(slot, "grad"):
                buffer[index, row, lo:hi] += t.reshape(-1)
        dist.all_reduce(buffer, group=self.groups[self.summed_over("grad")[0]])
        for index, row, slot in places:
            for kind, t, (lo, hi) in self.pieces_of(slot, "grad"):
                t.copy_(buffer[index, row, lo:hi].view_as(t))

    def pieces_of(self, slot, *kinds) -> list:
        """[(kind, tensor, (lo, hi) in the expert's flat elements)] of a slot's state pieces of `kinds`."""
        out, offset = [], 0
        for p in slot.parameters():
            out += [(kind, t, (offset + lo, offset + hi)) for kind, t, (lo, hi) in self.pieces[p] if kind in kinds]
            offset += p.numel()
        return out

    def replan(self, layout) -> None:
        """Place anew from the averages (the same on every rank: the same bits in), move the slots whose expert
        changed, rename them; the window, summed over the ranks that routed these layers' tokens, measured."""
        windows = torch.stack([layer.replicas.window for layer in self.layers])
        for group in self.load_groups.values():
            dist.all_reduce(windows, group=group)
        self.replans += 1
        self.measured = (tuple(self.layers[0].replicas.phy2log), *window_balance(windows.tolist(), self.n, self.ep))
        old = [layer.replicas.phy2log for layer in self.layers]
        for layer in self.layers:
            r = layer.replicas
            r.window.zero_()
            r.planned.copy_(r.average)
            r.set_plan(*r.plan())
        moved = self.adopt(layout, old)
        self.moved = [self.moved[0] + bool(moved), self.moved[1] + moved]

    def adopt(self, layout, old: list) -> int:
        """The layers' new plans in place of `old`: move the slots, rename them, recount; the bytes moved."""
        moved = self.move_slots(layout, old)
        for layer in self.layers:
            r = layer.replicas
            for q in r.local:
                for p in layer.experts[str(q)].parameters():
                    p.shard_info = replace(p.shard_info, replica=r.replica[q], global_name=expert_name(
                        p.shard_info.global_name, r.phy2log[q]))
        layout.recount()  # which copies count in the norm: the new replica-0 slots
        return moved

    def move_slots(self, layout, old: list) -> int:
        """Each slot whose expert changed takes that expert's weights, gradient and AdamW state (the layout's:
        `slot_state`) from its lowest old slot, through one all-reduce of the moved experts' state (each
        element added by the one rank that holds it, `summed_over`), the same on every rank: the plans say
        which slots move."""
        moves = [(index, old[index].index(expert), q) for index, layer in enumerate(self.layers)
                 for q, expert in enumerate(layer.replicas.phy2log) if old[index][q] != expert]
        if not moves:
            return 0
        state = self.slot_state(layout)
        kinds = sorted({kind for p in state for kind, _, _ in state[p]})  # the same on every rank of a layout
        like = next(t for p in state for kind, t, _ in state[p] if kind == "exp_avg")  # the master dtype
        buffer = like.new_zeros((len(moves), len(kinds), self.expert_size()))
        local = self.layers[0].replicas.local
        for m, (index, source, _) in enumerate(moves):
            if source in local:
                for kind, t, (lo, hi) in self.pieces_of(self.layers[index].experts[str(source)], *kinds):
                    if self.summed_over(kind)[1]:
                        buffer[m, kinds.index(kind), lo:hi] = t.reshape(-1)
        group = self.summed_over("exp_avg")[0]
        dist.all_reduce(buffer, group=self.groups[group])
        for m, (index, _, q) in enumerate(moves):
            if q in local:
                for kind, t, (lo, hi) in self.pieces_of(self.layers[index].experts[str(q)], *kinds):
                    t.copy_(buffer[m, kinds.index(kind), lo:hi].view_as(t))
        return buffer.numel() * buffer.element_size()

    def facts(self) -> ReplicaFacts:
        first = self.layers[0]
        policy = first.replicas.policy
        return ReplicaFacts(self.slots, self.replans, first.layer_id, tuple(first.replicas.phy2log), *self.measured,
                            policy if isinstance(policy, str) else "fixed")

    def predicted_messages(self, layout=None) -> Messages:
        """Per optimizer step, for a uniform load (the plan never changes: nothing moves): the gradient sum and
        the step's loads every step, the window every n-th (docstring item 3). No layout: as under DDP."""
        if layout is not None:
            self.slot_state(layout)
        return self.messages(1.0, 1 / self.replan_every if self.ep > 1 else 0, (0, 0))

    def traced_prediction(self, layout, steps: int) -> Messages:
        """Per step of the `steps` traced ones: what the steps since start-up did (their re-plans, the slots
        they moved; not a resume's move, which the checkpoint's load did)."""
        if not steps:
            return self.predicted_messages(layout)
        return self.messages(self.steps / steps, self.replans / steps, [m / steps for m in self.moved])

    def messages(self, steps: float, replans: float, moved) -> Messages:
        """`step_messages` of these layers: the gradient pieces' dtype (no layout seen yet: as DDP's, over ep, in
        the weights' dtype; ZeRO: its accumulation dtype)."""
        like = next(self.layers[0].experts.parameters())
        if self.pieces is not None:
            like = next(t for p in self.pieces for kind, t, _ in self.pieces[p] if kind == "grad")
        return step_messages(len(self.layers), self.n, self.slots, self.ep, self.expert_size() * like.element_size(),
                             self.summed_over("grad")[0], list(self.load_groups), steps, replans, moved,
                             self.shared_load_reduce, len(self.layers[0].replicas.step_load))


# ---------------------------------------------------------------------------------------------------------
# The axis: --moe-replicas R, applied right after moe.py's (train.AXES), its handle
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplicaConfig:
    """--moe-replicas R on E expert-parallel ranks, the re-plan interval n and the loads' decay d; `load_tp`: the
    ranks of a TP group route different tokens (--sp), so the loads are summed over tp too."""

    slots: int  # R
    ep: int  # E
    replan_every: int = 50
    load_decay: float = 0.9
    load_tp: bool = False
    policy: object = "eplb"  # --moe-placement: eplb, sinkhorn, coselect, or a fixed phy2log (a tuple)
    cost: tuple | None = None  # sinkhorn's [E][E] link costs: --moe-placement-cost, or the CLI's hardware model's


def config_from_flags(args, settings) -> ReplicaConfig | None:
    """--moe-replicas R (None without it), placeable on this mesh (`check_flags`) by --moe-placement's policy
    (`placement_policy`), Sinkhorn's cost matrix --moe-placement-cost or, without it, the one the command line
    built from the hardware model (`settings.placement_cost`)."""
    slots = getattr(args, "moe_replicas", 0)
    if not slots or settings.model.moe is None:
        return None
    n, ep = settings.model.moe.experts, settings.shape.ep
    check_flags(slots, n, ep)
    policy = placement_policy(getattr(args, "moe_placement", "eplb"), n, slots, ep)
    text = getattr(args, "moe_placement_cost", None)
    cost = transport.parse_cost(text, ep) if text else getattr(settings, "placement_cost", None)
    return ReplicaConfig(slots, ep, getattr(args, "moe_replan_every", 50), getattr(args, "moe_load_decay", 0.9),
                         settings.sequence_parallel and settings.shape.tp > 1, policy,
                         cost if policy == "sinkhorn" else None)


POLICIES = ("eplb", "sinkhorn", "coselect")


def placement_policy(text: str, n: int, slots: int, ep: int):
    """--moe-placement as ReplicaConfig.policy (a name, or a fixed phy2log tuple), or ValueError naming the flag:
    a policy other than EPLB's places over EP ranks (E > 1); coselect places each expert once (R = N); a list names
    R experts, each < N, every expert at least once."""
    flag = f"--moe-placement {text}"
    if text in POLICIES:
        if text != "eplb" and ep == 1:
            raise ValueError(f"{flag} places experts over the EP ranks: it needs --ep > 1")
        if text == "coselect" and slots != n:
            raise ValueError(f"{flag} places each expert once (a permutation over the ranks): it needs"
                             f" --moe-replicas {n} (= --moe-experts), got {slots}")
        return text
    try:
        phy2log = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{flag}: one of {', '.join(POLICIES)}, or the {slots} slots' experts as a comma list")
    missing = sorted(set(range(n)) - set(phy2log))
    for broken, message in ((len(phy2log) != slots, f"lists {len(phy2log)} slots, --moe-replicas has {slots}"),
                            (any(not 0 <= e < n for e in phy2log), f"names an expert outside [0, {n})"),
                            (bool(missing), f"places no slot of expert {(missing or [0])[0]}: every expert needs one")):
        if broken:
            raise ValueError(f"{flag} {message}")
    return phy2log


def apply(model, run, config: ReplicaConfig) -> Axis:
    """R/E physical slots on this rank for every MoE layer the model holds (moe.apply, just before, kept their
    experts whole), under the plan of a uniform load (`place_slots`), and the handle that does the replicas' step
    work; a pipeline stage without MoE layers has none to do (a bare step.Axis)."""
    mesh = run.mesh
    layers = [block.mlp for block in model.transformer.h if isinstance(block.mlp, MoE)]
    for layer in layers:
        place_slots(layer, config.slots, mesh.group("ep"), config.ep, mesh.index("ep"), run.device, config.policy,
                    config.cost)
    load_groups = ("dp_cp", "tp") if config.load_tp else ("dp_cp",)  # the ranks whose tokens these layers route
    if not layers:
        return Axis()
    return RedundantExperts(layers, config.replan_every, config.load_decay,
                            {name: mesh.group(name) for name in ("ep", "dp_cp", "expert_dp")},
                            {name: mesh.group(name) for name in load_groups}, mesh.coordinates())


def step_messages(moe_layers: int, n: int, slots: int, ep: int, expert_bytes: int, sum_group: str, load_groups: list,
                  steps: float = 1.0, replans: float = 0.0, moved=(0, 0), shared_load_reduce: bool = False,
                  width: int | None = None) -> Messages:
    """Docstring item 3 for `steps` steps and `replans` re-plans, pure (planner/search.py sizes a layout from it):
    the gradient sum over `sum_group` (g: ep under DDP, dp_cp under ZeRO), L_moe·(R − N)·Ψ_e·e_g a step
    (expert_bytes = Ψ_e·e_g); over each of `load_groups` (the names of size > 1) the step's loads [N] (`width`
    N + N² with coselect's pairs; in the router's call when it reduces too: router.finish_step) and the window
    [N + E] per re-plan; the moves (calls, bytes) over g."""
    out = Messages()
    if slots > n:
        out.add("all_reduce", sum_group, steps, steps * moe_layers * (slots - n) * expert_bytes)
    for name in load_groups:
        calls = replans + (0 if shared_load_reduce else steps)
        out.add("all_reduce", name, calls, (steps * (width or n) + replans * (n + ep)) * moe_layers * 8)
    return out.add("all_reduce", sum_group, *moved)


def expert_name(global_name: str, expert: int) -> str:
    """`...mlp.experts.<i>.c_fc.weight` with logical expert `expert` for i."""
    return re.sub(r"\.experts\.\d+\.", f".experts.{expert}.", global_name, count=1)


def window_balance(windows: list, n: int, ep: int) -> tuple:
    """(max/mean rows per ep rank under the plans, max/mean had expert i sat on rank i·E/N), all layers summed,
    from each layer's window (kept slots per expert [N], rows per ep rank [E]); nan if nothing ran."""
    rows = [sum(window[n + r] for window in windows) for r in range(ep)]
    in_place = [sum(sum(window[r * n // ep:(r + 1) * n // ep]) for window in windows) for r in range(ep)]
    if not sum(rows):
        return math.nan, math.nan
    return max(rows) * ep / sum(rows), max(in_place) * ep / sum(in_place)
