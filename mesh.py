"""The device mesh: each rank's coordinates and the process groups of every parallel axis.

N = D·P·C·T ranks (data, pipeline, context, tensor). Ranks are laid out tensor-fastest, then context, then
pipeline, then data:

    rank = ((d·P + p)·C + c)·T + t

so the chattiest axis (tensor parallel: two all-reduces per block) stays inside a node, and data parallel,
which talks once per step, spans nodes. D is inferred: D = N / (T·P·C).

Expert parallel (E) multiplies nothing: it is carved out of the D·C ranks that share one (p, t). Dense
parameters are replicated over those D·C ranks and sync over the `dp_cp` group; an expert is held by D·C/E
of them, which sync its gradients over the `expert_dp` group; tokens travel between expert holders over
the `ep` group (E consecutive members of the D·C slice).

DiLoCo (resilience/diloco.py, `--diloco-replicas R`) splits D into R replicas of D/R data ranks each, the outermost cut:
replica r = d // (D/R), so a replica is a contiguous block of N/R ranks and the rank formula is unchanged
(d = r·D/R + d_r). The `dp` axis still spans all D data ranks (they split the global batch between them), but
every gradient group (`dp_cp`, `ep`, `expert_dp`) stays inside a replica; `replica` is a replica's N/R ranks
(its update's norm all-reduce) and `diloco` the R ranks at the same place in each replica (the outer
all-reduce of the pseudo-gradient). Without DiLoCo (R = None) neither group exists.

Accounting for this file:
1. Nothing is held; it only names who talks to whom.
2. Memory: none beyond the communicators.
3. Messages: `new_group` once at start-up (every rank creates every group, in the same order: a
   torch.distributed rule, or ranks deadlock).
4. Restart state: none, but a checkpoint records the mesh shape so a resumed run knows if it changed.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

AXES = ("dp", "pp", "cp", "tp")  # slowest to fastest


@dataclass(frozen=True)
class MeshShape:
    dp: int
    pp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    replicas: int | None = None  # DiLoCo's R (a divisor of dp); None: no DiLoCo, no replica groups

    @property
    def replica_dp(self) -> int:
        """D/R: the data ranks of one DiLoCo replica (D without DiLoCo), over which gradients are reduced."""
        return self.dp // (self.replicas or 1)

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    def coords(self, rank: int) -> dict:
        """(d, p, c, t) of a rank, inverting rank = ((d·P + p)·C + c)·T + t."""
        t = rank % self.tp
        c = (rank // self.tp) % self.cp
        p = (rank // (self.tp * self.cp)) % self.pp
        d = rank // (self.tp * self.cp * self.pp)
        return {"dp": d, "pp": p, "cp": c, "tp": t}

    def rank_of(self, dp: int, pp: int, cp: int, tp: int) -> int:
        return ((dp * self.pp + pp) * self.cp + cp) * self.tp + tp


def infer_mesh_shape(world_size: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                     replicas: int | None = None) -> MeshShape:
    """Validate the parallel flags against the world size; raise before any process group is awaited."""
    for flag, value in (("--tp", tp), ("--pp", pp), ("--cp", cp), ("--ep", ep)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{flag} must be a positive integer, got {value!r}")
    model_parallel = tp * pp * cp
    if world_size % model_parallel:
        raise ValueError(
            f"world size {world_size} is not divisible by --tp {tp} × --pp {pp} × --cp {cp} = {model_parallel}; "
            f"launch a multiple of {model_parallel} processes (torchrun --nproc_per_node)"
        )
    dp = world_size // model_parallel
    if replicas is not None and (not isinstance(replicas, int) or replicas < 1 or dp % replicas):
        raise ValueError(f"--diloco-replicas {replicas!r} must be a positive divisor of the data-parallel degree"
                         f" D = world {world_size} / (T·P·C = {model_parallel}) = {dp} (each replica holds D/R"
                         f" data ranks)")
    replica_dp = dp // (replicas or 1)
    if (replica_dp * cp) % ep:
        raise ValueError(
            f"--ep {ep} must divide the data × context ranks D·C = {replica_dp}·{cp} = {replica_dp * cp} "
            f"(expert parallel is carved out of them{', in each DiLoCo replica' if replicas else ''})"
        )
    return MeshShape(dp=dp, pp=pp, cp=cp, tp=tp, ep=ep, replicas=replicas)


@dataclass
class Mesh:
    """This rank's place in the mesh and one process group per axis (groups of size 1 included; names with the
    same members share one group: build_mesh).

    Axis and group names: "dp", "pp", "cp", "tp" (the four axes), "dp_cp" (dense gradient sync), "ep" (tokens
    between expert holders), "expert_dp" (expert gradient sync), "pp_tied" (the first and last pipeline stage,
    which hold the tied embedding). `group(name)`, `index(name)` (this rank's index in its group of that name)
    and `size(name)` answer for any of them: the one spelling every file uses; `shape` is the layout record
    (D, P, C, T, E and the world size) for printouts and checkpoints.
    """

    shape: MeshShape
    rank: int
    groups: dict = field(default_factory=dict)  # name -> ProcessGroup holding this rank
    members: dict = field(default_factory=dict)  # name -> list of global ranks in this rank's group

    def group(self, name: str):
        return self.groups[name]

    def index(self, name: str) -> int:
        """This rank's index in its group `name` (an axis: its coordinate along it)."""
        return self.members[name].index(self.rank)

    def size(self, name: str) -> int:
        return len(self.members[name])

    def coordinates(self) -> dict:
        """{name: this rank's index} for every axis and group: what shard.counts_here reads."""
        return {name: self.index(name) for name in self.members}


def axis_groups(shape: MeshShape) -> dict:
    """For every axis, the list of rank groups that partition the world along it."""
    ranges = {axis: range(getattr(shape, axis)) for axis in AXES}

    def groups_varying(varying: tuple) -> list:
        fixed = [a for a in AXES if a not in varying]
        out = []
        for fixed_values in _product([ranges[a] for a in fixed]):
            coord = dict(zip(fixed, fixed_values))
            ranks = []
            for vary_values in _product([ranges[a] for a in varying]):
                coord.update(zip(varying, vary_values))
                ranks.append(shape.rank_of(**coord))
            out.append(sorted(ranks))
        return out

    groups = {axis: groups_varying((axis,)) for axis in AXES}
    # Dense gradient sync: everyone holding the same shard (in one DiLoCo replica: d // (D/R) alike).
    groups["dp_cp"] = [part for s in groups_varying(("dp", "cp")) for part in _by_replica(shape, s)]
    # Expert parallel inside each D·C slice: E consecutive members share tokens, members i, i+E, i+2E...
    # hold the same experts and sync their gradients.
    ep, dp_cp_size = shape.ep, shape.replica_dp * shape.cp
    groups["ep"] = [s[i:i + ep] for s in groups["dp_cp"] for i in range(0, dp_cp_size, ep)]
    groups["expert_dp"] = [s[i::ep] for s in groups["dp_cp"] for i in range(ep)]
    # The embedding tied to the head lives on the first and the last pipeline stage: they sum its gradient.
    # The stages between hold no copy; each is a group of its own (every rank is in one group per name).
    groups["pp_tied"] = [sorted({s[0], s[-1]}) for s in groups["pp"]] + [[r] for s in groups["pp"] for r in s[1:-1]]
    if shape.replicas is not None:  # DiLoCo: a replica's N/R contiguous ranks; the R ranks alike in each
        size = shape.world_size // shape.replicas
        groups["replica"] = [list(range(r * size, (r + 1) * size)) for r in range(shape.replicas)]
        groups["diloco"] = [list(range(i, shape.world_size, size)) for i in range(size)]
    return groups


def _by_replica(shape: MeshShape, ranks: list) -> list:
    """`ranks` (sorted) cut into DiLoCo's R contiguous replicas (one list without DiLoCo)."""
    size = len(ranks) // (shape.replicas or 1)
    return [ranks[i:i + size] for i in range(0, len(ranks), size)]


def groups_of(shape: MeshShape, rank: int) -> dict:
    """{name: ranks} of the groups of axis_groups that hold `rank` (the same sorted lists), from its coordinates
    alone: O(the groups' sizes), not O(world) as the whole partition is, which a plan of a million ranks
    cannot wait for (--plan, --plan-search)."""
    coords = shape.coords(rank)
    strides = {"dp": shape.pp * shape.cp * shape.tp, "pp": shape.cp * shape.tp, "cp": shape.tp, "tp": 1}

    def varying(axes: tuple) -> list:  # every rank that differs from `rank` only along `axes`, ascending
        ranks = [rank - sum(coords[a] * strides[a] for a in axes)]
        for a in AXES:  # slowest first, so the list stays sorted: rank = ((d·P + p)·C + c)·T + t
            if a in axes:
                ranks = [r + i * strides[a] for r in ranks for i in range(getattr(shape, a))]
        return ranks

    groups = {axis: varying((axis,)) for axis in AXES}
    dp_cp, ep = next(s for s in _by_replica(shape, varying(("dp", "cp"))) if rank in s), shape.ep
    at = dp_cp.index(rank)
    groups.update(dp_cp=dp_cp, ep=dp_cp[at - at % ep:at - at % ep + ep], expert_dp=dp_cp[at % ep::ep])
    pp = groups["pp"]
    groups["pp_tied"] = sorted({pp[0], pp[-1]}) if rank in (pp[0], pp[-1]) else [rank]
    if shape.replicas is not None:
        size = shape.world_size // shape.replicas
        groups["replica"] = list(range(rank - rank % size, rank - rank % size + size))
        groups["diloco"] = list(range(rank % size, shape.world_size, size))
    return groups


def _product(ranges):
    if not ranges:
        yield ()
        return
    for head in ranges[0]:
        for tail in _product(ranges[1:]):
            yield (head,) + tail


def build_mesh(shape: MeshShape, rank: int | None = None, every_group: bool = True, timeout=None) -> Mesh:
    """Create every axis's process groups (collective: all ranks call this with the same shape).

    One communicator per distinct set of ranks: names with the same members share one group (dp, dp_cp and
    expert_dp are one group when C = E = 1; tp, cp and pp of size 1 are this rank's one singleton group).
    Each NCCL communicator costs GPU memory and start-up time (with `device_id` bound they are created
    eagerly), so duplicates are not free. An axis spanning every rank still gets its own group rather than the
    default one, so the accounting keeps the world's few bytes (the update's flags, checkpoint verdicts) apart
    from the axis's traffic. Singleton groups are kept, one per rank: every file calls its collectives on its
    group whatever its size rather than branching on the size (ZeRO, whose units may sit on a group of one,
    skips them), and one singleton is one small communicator with no peer buffers.
    every_group=False (a plan, in a fake process group, where no peer waits on the others' groups): only the
    groups holding `rank` (groups_of), so that a million ranks are planned in moments. timeout: the groups'
    (a timedelta; None: torch's default), bounding their start-up's wait for every member.
    """
    rank = dist.get_rank() if rank is None else rank
    mesh = Mesh(shape=shape, rank=rank)
    made: dict[tuple, object] = {}
    partitions = axis_groups(shape) if every_group else {name: [g] for name, g in groups_of(shape, rank).items()}
    for axis, partition in partitions.items():
        for ranks in partition:  # same order on every rank, so every rank makes the same new_group calls
            key = tuple(ranks)
            if key not in made:
                made[key] = dist.new_group(ranks, timeout=timeout) if dist.is_initialized() else None
            if rank in ranks:
                mesh.groups[axis], mesh.members[axis] = made[key], ranks
    return mesh


def choose_device_and_backend(backend: str | None = None) -> tuple[torch.device, str]:
    """CUDA + NCCL when a GPU is present, else CPU + gloo; `--backend` overrides the backend.

    The GPU is LOCAL_RANK (this node's rank, from torchrun) modulo the visible GPUs. NCCL refuses two ranks
    of one communicator on one GPU, so more local ranks than GPUs is an error under NCCL (raised before any
    process group exists, so no rank waits); gloo on CUDA tensors may share GPUs.
    """
    if backend not in (None, "nccl", "gloo"):
        raise ValueError(f"--backend must be nccl or gloo, got {backend!r}")
    if torch.cuda.is_available() and backend != "gloo":
        gpus, local_rank = torch.cuda.device_count(), int(os.environ.get("LOCAL_RANK", 0))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        if local_world > gpus:
            raise ValueError(f"{local_world} processes on this node (torchrun --nproc_per_node) but {gpus} GPUs"
                             f" visible: NCCL needs one GPU per rank; launch at most {gpus} per node")
        device = torch.device("cuda", local_rank % gpus)
        torch.cuda.set_device(device)
        return device, backend or "nccl"
    if backend == "nccl":
        raise ValueError("--backend nccl needs CUDA GPUs, and none is visible; use --backend gloo")
    return torch.device("cpu"), "gloo"


def init_distributed(backend: str, device: torch.device | None = None, timeout_s: float = 600) -> tuple[int, int]:
    """Join the default process group (torchrun's env://); a plain `python train.py` is a world of one.

    On CUDA the group is bound to this rank's GPU (`device_id`): NCCL then builds its communicator at once on
    that device, instead of guessing the GPU at the first collective (as rank % GPUs, which is wrong when
    the device is not the global rank's), and new groups are split from it.
    """
    if "RANK" not in os.environ:  # launched without torchrun
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    bound = dict(device_id=device) if device is not None and device.type == "cuda" else {}
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **bound)
    return dist.get_rank(), dist.get_world_size()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
