"""mesh.py: the rank layout, every axis's groups, and the errors for flag products that cannot work."""

import pytest
import torch.distributed as dist

import harness
from harness import run_ranks
from mesh import MeshShape, axis_groups, build_mesh, groups_of, infer_mesh_shape


def test_rank_layout_is_tensor_fastest():
    shape = MeshShape(dp=2, pp=2, cp=2, tp=2)
    for rank in range(16):
        c = shape.coords(rank)
        assert rank == ((c["dp"] * 2 + c["pp"]) * 2 + c["cp"]) * 2 + c["tp"]
        assert shape.rank_of(**c) == rank
    groups = axis_groups(shape)
    assert groups["tp"][0] == [0, 1]  # neighbours
    assert groups["cp"][0] == [0, 2]
    assert groups["pp"][0] == [0, 4]
    assert groups["dp"][0] == [0, 8]
    assert groups["dp_cp"][0] == [0, 2, 8, 10]


def test_every_axis_partitions_the_world():
    shape = MeshShape(dp=4, pp=1, cp=2, tp=1, ep=4)
    for axis, partition in axis_groups(shape).items():
        flat = sorted(r for ranks in partition for r in ranks)
        assert flat == list(range(shape.world_size)), axis
    groups = axis_groups(shape)
    # EP is carved out of the 8 D·C ranks: 2 groups of 4 share tokens; members i, i+4 hold the same experts.
    assert groups["ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups["expert_dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_a_ranks_own_groups_are_its_groups_in_the_whole_partition():
    """groups_of (a plan's: O(group sizes)) gives every rank the very lists axis_groups' partition holds it in,
    over meshes of every axis, EP included."""
    for dp, pp, cp, tp, ep in [(1, 1, 1, 1, 1), (4, 1, 2, 1, 4), (6, 3, 1, 2, 3), (2, 2, 2, 2, 2), (4, 3, 2, 2, 8)]:
        shape = MeshShape(dp=dp, pp=pp, cp=cp, tp=tp, ep=ep)
        partitions = axis_groups(shape)
        for rank in range(shape.world_size):
            own = groups_of(shape, rank)
            assert set(own) == set(partitions), shape
            for name, partition in partitions.items():
                assert own[name] == next(g for g in partition if rank in g), (shape, rank, name)


@pytest.mark.parametrize(
    "world,kwargs,message",
    [
        (4, dict(tp=3), "not divisible by --tp 3"),
        (6, dict(tp=2, pp=2), "--tp 2 × --pp 2 × --cp 1 = 4"),
        (4, dict(tp=2, ep=4), "--ep 4 must divide"),
        (4, dict(tp=0), "--tp must be a positive integer"),
    ],
)
def test_invalid_layouts_name_the_flags(world, kwargs, message):
    with pytest.raises(ValueError, match=message):
        infer_mesh_shape(world, **kwargs)


def test_inferred_data_parallel_size():
    assert infer_mesh_shape(8, tp=2, pp=2).dp == 2
    assert infer_mesh_shape(8, tp=2, cp=2, ep=2).dp == 2


def _build(rank, world):
    mesh = build_mesh(infer_mesh_shape(world, tp=2), rank)
    import torch

    # An all-reduce on each group sums exactly the members the mesh says it has.
    out = {}
    for axis in ("tp", "dp", "dp_cp", "pp"):
        t = torch.tensor([float(rank)], device=harness.device())
        dist.all_reduce(t, group=mesh.groups[axis])
        out[axis] = (float(t), mesh.members[axis], mesh.index(axis), mesh.size(axis))
    return out


def test_groups_hold_the_right_members():
    results = run_ranks(_build, 4, timeout=60)
    for rank, out in enumerate(results):
        tp_total, tp_members, tp_rank, tp_size = out["tp"]
        assert tp_members == [rank - rank % 2, rank - rank % 2 + 1] and tp_total == sum(tp_members)
        assert tp_rank == rank % 2 and tp_size == 2
        dp_total, dp_members, dp_rank, _ = out["dp"]
        assert dp_members == [rank % 2, rank % 2 + 2] and dp_total == sum(dp_members) and dp_rank == rank // 2
        assert out["pp"][1] == [rank] and out["pp"][3] == 1


def _shared(rank, world):
    mesh = build_mesh(infer_mesh_shape(world, tp=2), rank)
    g = mesh.groups
    return dict(dp_aliases=g["dp"] is g["dp_cp"] is g["expert_dp"], singleton=g["pp"] is g["cp"],
                tp_apart=g["tp"] is not g["dp"], world=g["dp"] is dist.group.WORLD)


def test_names_with_the_same_ranks_share_one_group():
    """One communicator per distinct rank set: dp = dp_cp = expert_dp (C = E = 1), pp = cp (both this rank alone)."""
    for out in run_ranks(_shared, 4, timeout=60):
        assert out == dict(dp_aliases=True, singleton=True, tp_apart=True, world=False)


def test_the_gpu_is_the_local_rank_modulo_the_gpus_and_bound_at_init(monkeypatch):
    """Mocked CUDA (no GPU here): LOCAL_RANK % device_count picks the GPU, more local ranks than GPUs is an error
    under NCCL before any group exists, and init_process_group gets device_id."""
    import torch

    import mesh

    chosen, init_kwargs = [], {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    device, backend = mesh.choose_device_and_backend(None)
    assert (device, backend, chosen) == (torch.device("cuda", 1), "nccl", [torch.device("cuda", 1)])
    assert mesh.choose_device_and_backend("gloo") == (torch.device("cpu"), "gloo")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="4 processes on this node .* but 2 GPUs"):
        mesh.choose_device_and_backend("nccl")
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: init_kwargs.update(kwargs))
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    monkeypatch.setenv("RANK", "0")
    mesh.init_distributed("nccl", torch.device("cuda", 1))
    assert init_kwargs["device_id"] == torch.device("cuda", 1)
    init_kwargs.clear()
    mesh.init_distributed("gloo", torch.device("cpu"))
    assert "device_id" not in init_kwargs
