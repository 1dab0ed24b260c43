"""Redundant experts for hot ones: DeepSeek's expert-parallel load balancer (EPLB, deepseek-ai/EPLB's eplb.py;
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
logcnt [N] (c_i). Loads in float32, ties broken as deepseek-ai/EPLB's eplb.py breaks them (torch.sort's order, the
lower index), so its placements are reproduced exactly. The trainer places over the E ranks of an ep group
with the global policy (one group, one node).

Training with it (`Replicas`, set up by moe.apply when --moe-replicas R is given):
- Dispatch. A slot routed to logical expert i, the j-th of this rank's slots routed to i in token order (kept
  slots only), goes to replica j mod c_i (`Replicas.physical`); the all-to-all is by physical slot (moe.py
  sorts and splits by slot: R bins instead of N). The replica decides which rank computes a row, not its
  value (up to the rounding of another matmul shape).
- Gradients. Each slot is its own copy of the logical expert's tensors (named by the logical expert, so the
  init and the checkpoint see one logical tensor). After the layout's sum over expert_dp, `sum_replica_grads`
  adds, over ep, the gradients of the slots holding the same logical expert: every replica then holds the
  logical expert's whole gradient, and the same AdamW update keeps the replicas bitwise equal (the all-reduce
  hands every rank the same sum). The grad norm and the checkpoint count one copy: replica 0 (`ShardInfo.
  replica`; the layout recounts after a re-plan).
- Re-planning. Each layer counts the kept slots routed to each logical expert in training (what loads it);
  once per step `after_grad_sync` folds them into a moving average, load ← d·load + (1 − d)·step's,
  d = --moe-load-decay; every n = --moe-replan-every steps the averages are summed over dp×cp (and tp with
  --sp: the ranks holding the same layers see different tokens), the placement recomputed (the same on every
  rank) and each slot whose logical expert changed receives its tensors, gradient and AdamW moments from the
  lowest old slot of that expert, by one all-to-all over ep (`move_slots`), before the optimizer step.

Symbols: N, E, R as above, L_moe MoE layers this rank holds, Ψ_e one expert's parameters, e_p the bytes of a
parameter, its gradient and moments (DDP: 4), n the re-plan interval, M_l the slots of layer l this rank sends
at a re-plan.

1. Replicated and split. Split E ways: the R physical slots (R/E per rank). Replicated: a hot expert's tensors
   on c_i slots, bitwise equal; the placement (phy2log, log2phy, logcnt) and the load average on every rank.
2. Peak per device. Parameters L_moe·(R/E)·Ψ_e for the experts (R/N times plain EP's), ×16 bytes with fp32
   gradients and AdamW. Temporaries: the replica sum's buffer, L_moe·(R − N)·Ψ_e·e_p; a re-plan's send and
   receive buffers, at most L_moe·(R/E)·4·Ψ_e·e_p each. The dispatch's: plain EP's, with [R] counts.
3. Messages, per optimizer step, on top of plain EP's (whose counts all-to-all carries 8R bytes, not 8N):
       all_reduce  ep     L_moe·(R − N)·Ψ_e·e_p   the replicas' gradient sum (padded to R − N experts a
                                                 layer, so its size never depends on the plan)
   and per re-plan (every n steps; the startup table's 1/n calls a step, no move: a uniform load keeps the plan):
       all_reduce        dp×cp (tp)  L_moe·(2N + E)·8   the load averages, the window's kept slots per expert
                                                       and rows per ep rank (float64)
       all_to_all_single ep          Σ_l M_l·4·Ψ_e·e_p  the moved slots' weights, gradients and two moments
   Host syncs: one `.tolist()` of the averages per re-plan.
4. Restart state: none. The checkpoint holds each replica set as ONE logical expert (`...experts.<i>...`), so
   it loads with any R and E; a resumed run starts from the uniform placement and a fresh average (the
   placement decides which rank computes a row, never its value).
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from comm import Messages
from optim import ensure_adam_state

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
    dispatch reads (on the device), and the kept slots this rank's training forwards routed."""

    def __init__(self, n_experts: int, slots: int, ep_size: int, ep_index: int, device):
        self.n_experts, self.slots, self.ep_size = n_experts, slots, ep_size
        per_rank = slots // ep_size
        self.local = range(ep_index * per_rank, (ep_index + 1) * per_rank)  # the slots this rank holds
        self.step_load = torch.zeros(n_experts, dtype=torch.float64, device=device)  # this step's kept slots
        self.average = torch.zeros_like(self.step_load)  # their moving average (this rank's)
        self.window = torch.zeros(n_experts + ep_size, dtype=torch.float64, device=device)  # since the last
        # re-plan: kept slots per expert, then the rows sent to each ep rank

    def set_plan(self, phy2log: list, replica: list, logcnt: list) -> None:
        self.phy2log, self.replica, self.logcnt = phy2log, replica, logcnt
        table = [[self.slots] * max(logcnt) for _ in range(self.n_experts + 1)]  # row N: dropped, sorted last
        for phy, (expert, rank) in enumerate(zip(phy2log, replica)):
            table[expert][rank] = phy
        self.slot_of = torch.tensor(table, device=self.step_load.device)  # [N + 1, max c]: log2phy
        self.count_of = torch.tensor(logcnt + [1], device=self.step_load.device)  # [N + 1]

    def physical(self, slot_expert: torch.Tensor, training: bool) -> torch.Tensor:
        """[S] the physical slot of each slot (R: dropped) from its logical expert (N: dropped): the j-th slot
        routed to expert i (token order) goes to replica j mod c_i. No host sync. A training forward (train
        mode, grad on, not a recompute inside backward, as mfu.RoutedLoad decides) adds to the load."""
        order = torch.argsort(slot_expert, stable=True)  # by expert, token order inside
        ones = torch.ones_like(slot_expert)
        per_expert = torch.zeros(self.n_experts + 1, dtype=torch.long, device=ones.device).scatter_add_(
            0, slot_expert, ones)
        first = per_expert.cumsum(0) - per_expert  # where each expert's run starts in `order`
        place = torch.empty_like(slot_expert)
        place[order] = torch.arange(len(order), device=ones.device) - first[slot_expert[order]]
        physical = self.slot_of[slot_expert, place % self.count_of[slot_expert]]
        if training and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
            per_slot = torch.zeros(self.slots + 1, dtype=torch.long, device=ones.device).scatter_add_(
                0, physical, ones)[:self.slots]
            self.step_load += per_expert[:self.n_experts]
            self.window += torch.cat([per_expert[:self.n_experts], per_slot.view(self.ep_size, -1).sum(dim=1)])
        return physical


def place_slots(layer, slots: int, ep_group, ep_size: int, ep_index: int, device) -> None:
    """Give `layer` (a moe.MoE, its N experts whole) its R/E physical slots [e·R/E, (e+1)·R/E) under the plan
    of a uniform load: slot q a copy of expert phy2log[q] (named by that logical expert, so the init and the
    checkpoint see one tensor), its gradient summed over expert_dp; the other experts dropped."""
    replicas = Replicas(layer.n_experts, slots, ep_size, ep_index, device)
    replicas.set_plan(*place_layer(torch.ones(layer.n_experts), slots, 1, 1, ep_size))
    kept = {}
    for q in replicas.local:
        expert = copy.deepcopy(layer.experts[str(replicas.phy2log[q])])  # on meta in train.compose: no values
        for copied, original in zip(expert.parameters(), layer.experts[str(replicas.phy2log[q])].parameters()):
            copied.shard_info = replace(original.shard_info, grad_group="expert_dp", replica=replicas.replica[q])
        kept[str(q)] = expert
    layer.experts = torch.nn.ModuleDict(kept)
    layer.local, layer.replicas = replicas.local, replicas
    layer.ep_group, layer.ep_size = (ep_group, ep_size) if ep_size > 1 else (None, 1)


def check_flags(slots: int, n_experts: int, ep: int, zero: int) -> None:
    """Raise ValueError naming --moe-replicas when R cannot be placed (run by moe.config_from_flags)."""
    for broken, message in (
            (slots < n_experts, f"--moe-replicas {slots} must be at least --moe-experts {n_experts} (every expert"
                                f" needs a slot)"),
            (slots % ep, f"--moe-replicas {slots} must be a multiple of --ep {ep} (R/E slots on each rank)"),
            (slots > n_experts * ep, f"--moe-replicas {slots} is more replicas than slots: each of the {ep} ranks"
                                     f" would hold {slots // ep} slots for {n_experts} experts (at most N·E ="
                                     f" {n_experts * ep})"),
            (zero > 0, f"--moe-replicas with --zero {zero}: the replicas' gradient sum and moves are written for"
                       f" DDP (--zero 0) so far")):
        if broken:
            raise ValueError(message)


@dataclass(frozen=True)
class ReplicaFacts:
    """What the accounting reads of the replicas (moe.MoEFacts.replicas): the plan of the first MoE layer this
    rank holds, and the rows per EP rank measured over the last re-plan's window."""

    slots: int  # R
    replans: int
    layer_id: int
    phy2log: tuple  # of layer `layer_id` now, slot by slot (rank r: [r·R/E, (r+1)·R/E))
    measured_under: tuple  # its phy2log during the window before the last re-plan (empty: none yet)
    balance: float  # max/mean rows received per EP rank over that window, all layers (nan: no window yet)
    in_place: float  # the same for plain EP (expert i on rank ⌊i·E/N⌋) on the same kept slots


class RedundantExperts:
    """The step's work of the replicas over the MoE layers this rank holds (at least one; moe.MoEAxis.
    after_grad_sync calls it after the layout's sum over expert_dp): the replicas' gradient sum, the load
    average, the re-plan. load_groups: {name: group} of the ranks whose tokens these layers route too."""

    def __init__(self, layers: list, replan_every: int, decay: float, ep_group, load_groups: dict):
        self.layers, self.replan_every, self.decay = layers, replan_every, decay
        self.ep_group = ep_group
        self.load_groups = {name: group for name, group in load_groups.items() if dist.get_world_size(group) > 1}
        first = layers[0].replicas
        self.n, self.slots, self.ep = first.n_experts, first.slots, first.ep_size
        self.steps, self.replans, self.moved = 0, 0, [0, 0]  # moved: all_to_all calls, bytes this rank sent
        self.measured = ((), math.nan, math.nan)  # ReplicaFacts' measured_under, balance, in_place

    def expert_size(self) -> int:
        """Ψ_e: one slot's parameters."""
        return sum(p.numel() for p in next(iter(self.layers[0].experts.values())).parameters())

    @torch.no_grad()
    def after_grad_sync(self, layout) -> None:
        if self.slots > self.n:
            self.sum_replica_grads()
        for layer in self.layers:
            r = layer.replicas
            r.average.mul_(self.decay).add_(r.step_load, alpha=1 - self.decay)
            r.step_load.zero_()
        self.steps += 1
        if self.ep > 1 and self.steps % self.replan_every == 0:
            self.replan(layout)

    def sum_replica_grads(self) -> None:
        """Every slot of a replicated expert gets the sum of all its slots' gradients: one all-reduce over ep
        of R − N experts a layer (the replicated ones, in expert order, zeros past them and where absent)."""
        like = next(self.layers[0].experts.parameters())  # DDP: the gradients have the parameters' dtype
        buffer = like.new_zeros((len(self.layers), self.slots - self.n, self.expert_size()))
        places = []  # (layer index, row, slot's params)
        for index, layer in enumerate(self.layers):
            r = layer.replicas
            row = {e: j for j, e in enumerate(i for i, c in enumerate(r.logcnt) if c > 1)}
            for q in r.local:
                if r.phy2log[q] in row:
                    slot = list(layer.experts[str(q)].parameters())
                    buffer[index, row[r.phy2log[q]]] += torch.cat([p.grad.reshape(-1) for p in slot])
                    places.append((index, row[r.phy2log[q]], slot))
        dist.all_reduce(buffer, group=self.ep_group)
        for index, row, slot in places:
            for p, summed in zip(slot, buffer[index, row].split([p.numel() for p in slot])):
                p.grad.copy_(summed.view_as(p))

    def replan(self, layout) -> None:
        """Sum the load averages and the window over the ranks that routed these layers' tokens, place anew
        (the same on every rank: the same bits in), move the slots whose expert changed, rename them."""
        stats = torch.stack([torch.cat([layer.replicas.average, layer.replicas.window]) for layer in self.layers])
        for group in self.load_groups.values():
            dist.all_reduce(stats, group=group)
        rows = stats.tolist()  # the one host sync of a re-plan
        self.replans += 1
        self.measured = (tuple(self.layers[0].replicas.phy2log),
                         *window_balance([row[self.n:] for row in rows], self.n, self.ep))
        old = [(layer.replicas.phy2log, layer.replicas.replica) for layer in self.layers]
        for layer, row in zip(self.layers, rows):
            layer.replicas.window.zero_()
            layer.replicas.set_plan(*place_layer(torch.tensor(row[:self.n], dtype=torch.float32), self.slots, 1, 1,
                                                 self.ep))
        self.move_slots(layout, [phy2log for phy2log, _ in old])
        for layer in self.layers:
            r = layer.replicas
            for q in r.local:
                for p in layer.experts[str(q)].parameters():
                    p.shard_info = replace(p.shard_info, replica=r.replica[q], global_name=expert_name(
                        p.shard_info.global_name, r.phy2log[q]))
        layout.recount()  # which copies count in the norm: the new replica-0 slots

    def transfers(self, old: list) -> list:
        """[(layer index, source slot, destination slot)] of a re-plan from the `old` phy2log of each layer, the
        same list on every rank: each slot whose expert changed takes it from the lowest old slot of that
        expert on its own rank, else from the lowest old slot anywhere."""
        out, per_rank = [], self.slots // self.ep
        for index, layer in enumerate(self.layers):
            for q, expert in enumerate(layer.replicas.phy2log):
                if old[index][q] != expert:
                    here = [s for s in range(q - q % per_rank, q - q % per_rank + per_rank) if old[index][s] == expert]
                    out.append((index, here[0] if here else old[index].index(expert), q))
        return out

    def move_slots(self, layout, old: list) -> None:
        """Each moved slot receives its expert's weights, gradient and AdamW moments (`transfers`): a copy on
        its own rank, or one all_to_all_single over ep (when any move crosses ranks), each rank sending to
        each destination in the list's order."""
        ensure_adam_state(layout.optimizer)  # a re-plan before the first update moves zero moments
        per_rank = self.slots // self.ep
        me, moves = self.layers[0].replicas.local.start // per_rank, self.transfers(old)

        def packed(index, q):  # a slot's tensors, flat (a copy: read before any slot is written)
            return torch.cat([t.reshape(-1) for t in slot_tensors(layout, self.layers[index].experts[str(q)])])

        arrived = [((i, q), packed(i, s)) for i, s, q in moves if s // per_rank == me and q // per_rank == me]
        if any(s // per_rank != q // per_rank for _, s, q in moves):
            sends = [[packed(i, s) for i, s, q in moves if s // per_rank == me and q // per_rank == rank != me]
                     for rank in range(self.ep)]
            receives = [[(i, q) for i, s, q in moves if q // per_rank == me and s // per_rank == rank != me]
                        for rank in range(self.ep)]
            unit, like = 4 * self.expert_size(), next(self.layers[0].experts.parameters())
            sent = torch.cat([t for row in sends for t in row] or [like.new_zeros(0)])
            received = sent.new_empty(unit * sum(map(len, receives)))
            dist.all_to_all_single(received, sent, output_split_sizes=[unit * len(row) for row in receives],
                                   input_split_sizes=[unit * len(row) for row in sends], group=self.ep_group)
            self.moved = [self.moved[0] + 1, self.moved[1] + sent.numel() * sent.element_size()]
            arrived += zip([place for row in receives for place in row], received.split(unit))
        for (index, q), flat in arrived:
            tensors = slot_tensors(layout, self.layers[index].experts[str(q)])
            for t, piece in zip(tensors, flat.split([t.numel() for t in tensors])):
                t.copy_(piece.view_as(t))

    def facts(self) -> ReplicaFacts:
        first = self.layers[0]
        return ReplicaFacts(self.slots, self.replans, first.layer_id, tuple(first.replicas.phy2log), *self.measured)

    def predicted_messages(self) -> Messages:
        """Per optimizer step, for a uniform load (the plan never changes: nothing moves): the gradient sum
        over ep every step, the load averages' all-reduce every n-th (docstring item 3)."""
        return self.messages(1.0, 1 / self.replan_every if self.ep > 1 else 0, (0, 0))

    def traced_messages(self, steps: int) -> Messages:
        """Per step of the `steps` traced ones: what the steps since start-up did (their re-plans, the slots
        they moved)."""
        return self.messages(self.steps / steps, self.replans / steps, [m / steps for m in self.moved])

    def messages(self, sums: float, replans: float, moved) -> Messages:
        psi, element = self.expert_size(), next(self.layers[0].experts.parameters()).element_size()
        out = Messages()
        if self.slots > self.n:
            out.add("all_reduce", "ep", sums, sums * len(self.layers) * (self.slots - self.n) * psi * element)
        for name in self.load_groups:
            out.add("all_reduce", name, replans, replans * len(self.layers) * (2 * self.n + self.ep) * 8)
        return out.add("all_to_all_single", "ep", *moved)


def slot_tensors(layout, slot) -> list:
    """What a slot's move carries, per parameter: weights, gradient, AdamW's two moments (DDP: its optimizer)."""
    out = []
    for p in slot.parameters():
        state = layout.optimizer.state[p]
        out += [p.data, p.grad, state["exp_avg"], state["exp_avg_sq"]]
    return out


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
