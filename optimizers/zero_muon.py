"""Muon under ZeRO-1/2/3, two exact ways: gather (the FSDP2-Muon baseline) and owner-shaped (MatrixFSDP).

Muon's NS needs a whole matrix; ZeRO gives each of the D ranks of a unit one slice of a flat buffer, cutting
matrices anywhere. Both ways keep zero.py's units, reductions, norm and update order (optim.update) and put the
matrices (`muon.is_matrix`) in units of their own (`ZeroMuon.units`, the hook zero.ZeroConfig.matrices); the
other parameters stay in zero.py's AdamW units, sharded as today. A matrix unit holds the master and Muon's
momentum B, no AdamW moments.

Gather (`MatrixUnit`, the default): zero.py's equal slices. After the reduce-scatter each rank updates B on its
slice and forms its slice of NS's input U (elementwise), all-gathers U over the unit's group (in ns_dtype), and
orthogonalises every matrix its slice touches, whole, keeping its own elements of O. Not every rank computes
every matrix, and no matrix is computed once and scattered: matrix i is computed by the k_i ranks whose slices
touch it (k_i = 1 inside a slice, 2 or more across a boundary), Σ_i k_i·F_i FLOPs over the group instead of
Σ_i F_i; the all-gather moves every element of U to every rank.

Owner-shaped (`OwnedUnit`, --muon-owner): every matrix has one owner rank, chosen by greedy LPT over the
matrices of all units in launch order (`assign_owners`: the largest NS cost F = steps·(4m'²n' + 2m'³) first, to
the rank with the least cost so far, ties by the fewest elements, then the lowest rank), so both NS work and
bytes balance over the whole model (a GPT block's matrices all have m' = h, F ∝ their elements). The unit's flat
buffer is cut at the owners' boundaries: its parameters sorted by owner, rank r's slice [start_r, end_r) is its
matrices, whole, and of uneven length. Gradients reach the owner by one `reduce` per non-empty slice (a
reduce-scatter whose boundaries follow the owners), the owner runs NS on its own matrices with nothing to
gather, keeps their master and momentum, and the new weights return by one `broadcast` per slice (stages 1/2,
after the update; stage 3: the block's gather for the forward and backward, as today, by broadcasts). Exact:
NS sees the same logical matrix either way.

TP: a TP-split matrix is orthogonalised whole by `muon.orthogonalized` (gathered over tp, as Moonlight does): the
TP ranks of one data rank hold the same slices of the same pieces (equal local shapes), so they touch or own the
same matrices and gather together.

Accounting (per rank; n'_u, S_u the unit's buffer and this rank's slice, b_w/b_g/b_m the working, gradient and
master bytes, b_ns NS's dtype, T the TP size, F_i matrix i's NS FLOPs):
1. Replicated vs split: the matrix units split as zero.py's (weights at stage 3, gradients at 2+, state at 1+),
   equal slices (gather) or whole matrices per owner (owner); the rest is zero.py's.
2. Persistent bytes of a matrix unit (`persistent`): weights b_w·(n' at stages 1/2, S at 3), gradients
   b_g·(n' at stage 1, S at 2/3), optimizer b_m·S (B) + b_m·S (the master, when it is not the working slice).
   Owner: S_u differs by rank; the imbalance max/mean of the held bytes and of F is printed (`facts`). Transient
   in the update: gather b_ns·n' (the gathered U) + NS's 4 m×n buffers; owner only NS's.
3. Messages per step (`messages`): gather: zero.py's reduce_scatter and all_gather per matrix unit, plus one
   all_gather_single of b_ns·n' (U) over its group, exposed (the update waits); owner: per non-empty slice one
   reduce of its bytes (overlapping backward, as the reduce-scatter) and one broadcast (stages 1/2 after the
   update; stage 3 per gather): the unit's n elements each way, no padding, no U gather. With T > 1 both add
   one all_gather_single over tp of T·b_ns·(local elements of the matrices this rank computes) per unit.
   NS FLOPs: gather Σ_{i touched} F_i, owner Σ_{i owned} F_i (every TP rank the whole matrix's).
4. Restart state: `momentum/` (and `master/`) as flat ranges of the logical matrices, like AdamW's moments:
   on another D or mesh the owners change and each B moves with its matrix (ckpt.py reslices).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddp import grad_group
from optimizers.muon import (MuonConfig, MuonFacts, apply_update, is_matrix, nesterov_input, newton_schulz_flops,
                             ns_gemm, orthogonalized)
from step import Messages
from zero import Unit


class MatrixUnit(Unit):
    """zero.Unit of Muon's matrices only (the gather way): equal slices; the master and the momentum."""

    optimizer = "muon"

    def init_state(self, dtype: torch.dtype) -> None:
        self.momentum = torch.zeros(self.shard_numel, dtype=dtype, device=self.master.device)

    def optimizer_state(self) -> list:
        return [("master", self.master), ("momentum", self.momentum)]


class OwnedUnit(MatrixUnit):
    """A matrix unit cut at its owners' boundaries: parameters sorted by owner (`owners[i]`: the group rank that
    holds params[i] whole), rank r's slice its own matrices. Its collectives are per slice: a reduce to the
    owner, a broadcast from it."""

    def __init__(self, params: list, groups: dict, owners: list):
        order = sorted(range(len(params)), key=lambda i: owners[i])
        self.owners = [owners[i] for i in order]
        super().__init__([params[i] for i in order], groups)

    def shard_bounds(self) -> list:
        bounds, start = [], 0
        for rank in range(self.dp_size):
            end = start + sum(p.numel() for p, owner in zip(self.params, self.owners) if owner == rank)
            bounds.append((start, end))
            start = end
        return bounds

    def reduce_scatter(self, full: torch.Tensor):
        """Σ_ranks of each slice reduced to its owner, in place: this rank's slice of `full` holds its sum."""
        works = [dist.reduce(full[a:b], op=dist.ReduceOp.SUM, group=self.group, async_op=True, group_dst=rank)
                 for rank, (a, b) in enumerate(self.bounds) if b > a]
        return full[self.mine], _Works(works)

    def all_gather(self, target: torch.Tensor, source: torch.Tensor):
        """Each owner's slice broadcast into every rank's `target`."""
        target[self.mine].copy_(source)
        return _Works([dist.broadcast(target[a:b], group=self.group, async_op=True, group_src=rank)
                       for rank, (a, b) in enumerate(self.bounds) if b > a])

    def messages(self, kind: str, itemsize: int, times: int = 1) -> Messages:
        """`times` of this unit's "gather" (a broadcast per non-empty slice) or "reduce" (a reduce per one)."""
        op = {"gather": "broadcast", "reduce": "reduce"}[kind]
        calls = sum(b > a for a, b in self.bounds)
        return Messages({(op, self.group_name): (times * calls, times * itemsize * self.numel)})


class _Works:
    """Several async works waited as one."""

    def __init__(self, works: list):
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def assign_owners(costs: list, sizes: list, loads: list) -> list:
    """Greedy LPT: each matrix (largest NS cost first; ties: more elements, then lower index) to the rank with
    the least (cost, elements) so far (ties: the lowest rank). `loads` [[cost, elements] per rank] carries the
    assignment over the units of a layout (updated in place). The same on every rank: it reads shapes only."""
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], -sizes[i], i)):
        rank = min(range(len(loads)), key=lambda r: (loads[r][0], loads[r][1], r))
        owners[i] = rank
        loads[rank][0] += costs[i]
        loads[rank][1] += sizes[i]
    return owners


class ZeroMuon:
    """Muon over a ZeRO layout (zero.ZeroConfig.matrices): builds its matrix units, runs their update inside the
    layout's update order, and states their bytes, messages and figures. `tp_group`: the TP group a split matrix
    is gathered over (None: T = 1)."""

    def __init__(self, config: MuonConfig, tp_group=None):
        self.config, self.tp_group = config, tp_group
        self.loads = {}  # owner: {group name: [[NS FLOPs, elements] per rank]} of the matrices assigned so far

    @property
    def way(self) -> str:
        return "owner" if self.config.owner else "gather"

    def units(self, params: list, groups: dict, codec=None) -> list:
        """`params` (one data-parallel group's) as zero.py's AdamW unit of the rest and a unit of the matrices."""
        rest, matrices = [p for p in params if not is_matrix(p)], [p for p in params if is_matrix(p)]
        out = [Unit(rest, groups, codec)] if rest else []
        if matrices and not self.config.owner:
            out.append(MatrixUnit(matrices, groups, codec))
        elif matrices:
            if codec is not None:
                raise ValueError("--muon-owner: a matrix unit sends its weights whole, never as a codec's codes")
            name = grad_group(matrices[0])
            loads = self.loads.setdefault(name, [[0.0, 0] for _ in range(dist.get_world_size(groups[name]))])
            costs = [newton_schulz_flops(p.shard_info.global_shape, self.config.ns_steps) for p in matrices]
            out.append(OwnedUnit(matrices, groups, assign_owners(costs, [p.numel() for p in matrices], loads)))
        return out

    @torch.no_grad()
    def update(self, layout, unit: MatrixUnit, grad: torch.Tensor) -> None:
        """Muon on the unit's slice (inside optim.update's step): B and U on the slice, U gathered (gather way),
        NS of each matrix the slice touches (owns), its own elements of O applied to the master slice."""
        config = self.config
        u = nesterov_input(unit.momentum, grad, config)  # [S]: this rank's slice of U
        if isinstance(unit, OwnedUnit) or unit.dp_size == 1:
            full, start = u, unit.shard_start  # the slice holds its matrices whole
        else:
            full, start = torch.empty(unit.padded_numel, dtype=config.ns_dtype, device=u.device), 0
            dist.all_gather_single(full, u.to(config.ns_dtype), group=unit.group)
        touched = [i for i, (lo, hi) in enumerate(unit.spans) if hi > lo]
        params = [unit.params[i] for i in touched]
        inputs = [full[unit.offsets[i] - start:unit.offsets[i] - start + p.numel()].view(p.shape)
                  for i, p in zip(touched, params)]
        ortho = orthogonalized(inputs, [p.shard_info for p in params], config, self.tp_group)
        lr = config.lr_at(layout.lr)
        for i, p, o in zip(touched, params, ortho):
            lo, hi = unit.spans[i]
            first = unit.shard_start + lo - unit.offsets[i]  # the slice's first element within the matrix
            apply_update(unit.master[lo:hi], o.reshape(-1)[first:first + hi - lo], lr, config,
                         p.shard_info.global_shape)

    # --- Accounting (docstring items 2 and 3): report/muon.py and planner/time_model.py read these

    def _matrix_units(self, layout) -> list:
        return [u for u in layout.units if u.optimizer == "muon"]

    def _touched(self, unit: MatrixUnit, rank: int) -> list:
        """The matrices rank `rank`'s slice of the unit touches (owner: owns)."""
        a, b = unit.bounds[rank]
        return [p for p, o in zip(unit.params, unit.offsets) if o < b and o + p.numel() > a]

    def _bytes_of(self, layout, unit: MatrixUnit, rank: int, padded: bool = True) -> dict:
        """What rank `rank` holds of a matrix unit (docstring item 2)."""
        b_w, b_g, b_m = (d.itemsize for d in (layout.param_dtype, layout.accumulate_dtype, layout.master_dtype))
        b_o = b_m * (1 if layout.param_dtype == layout.master_dtype else 2)
        a, b = unit.bounds[rank]
        n, S = unit.padded_numel, b - a
        if not padded and not isinstance(unit, OwnedUnit):
            n, S = unit.numel, unit.numel / unit.dp_size
        out = {"weights": b_w * (n if layout.stage < 3 else S), "grads": b_g * (n if layout.stage == 1 else S),
               "optimizer": b_o * S}
        return {**out, "total": sum(out.values())}

    def persistent(self, layout, padded: bool = True) -> dict:
        """This rank's persistent bytes of the matrix units (zero.ZeroLayout.predicted_persistent adds AdamW's)."""
        out = {"weights": 0.0, "grads": 0.0, "optimizer": 0.0, "total": 0.0}
        for unit in self._matrix_units(layout):
            part = self._bytes_of(layout, unit, unit.dp_rank, padded)
            out = {kind: out[kind] + part[kind] for kind in out}
        return out

    def messages(self, layout) -> Messages:
        """The update's own messages per step: gather: U's all_gather_single per matrix unit over its group; with
        T > 1 one all_gather_single over tp per unit where this rank computes a split matrix."""
        out, itemsize = Messages(), self.config.ns_dtype.itemsize
        T = dist.get_world_size(self.tp_group) if self.tp_group is not None else 1
        for unit in self._matrix_units(layout):
            if not self.config.owner and unit.dp_size > 1:
                out.add("all_gather_single", unit.group_name, 1, itemsize * unit.padded_numel)
            split = [p for p in self._touched(unit, unit.dp_rank) if p.shard_info.splits]
            if split and T > 1:
                out.add("all_gather_single", "tp", 1, T * itemsize * sum(p.numel() for p in split))
        return out

    def facts(self, layout) -> MuonFacts:
        """This rank's NS work and Muon state, and every rank's of the data-parallel group (owner: their max/mean
        is the imbalance; gather: what the slices' boundaries repeat)."""
        units, steps = self._matrix_units(layout), self.config.ns_steps
        D = max([u.dp_size for u in units], default=1)
        gemms = tuple(tuple(ns_gemm(p.shard_info.global_shape, steps) for u in units for p in self._touched(u, rank))
                      for rank in range(D))
        held = tuple(sum(self._bytes_of(layout, u, rank)["total"] - self._bytes_of(layout, u, u.dp_rank)["total"]
                         for u in units) + layout.predicted_persistent()["total"] for rank in range(D))
        stage_flops = sum(newton_schulz_flops(p.shard_info.global_shape, steps) for u in units for p in u.params)
        return MuonFacts(self.way, sum(len(u.params) for u in units), stage_flops,
                         sum(u.momentum.nbytes for u in units), held, gemms, units[0].dp_rank if units else 0,
                         self.messages(layout), self.config)
