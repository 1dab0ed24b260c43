"""optim.py: LR schedule, loss scaling, the global norm counting each copy once, skipping a step on all ranks."""

import math

import pytest
import torch

import harness
from harness import run_ranks
from optim import DynamicLossScaler, LRSchedule, build_adamw, update
from shard import ShardInfo, Split, counts_here


def test_lr_schedule_warmup_cosine_floor():
    schedule = LRSchedule(max_lr=1.0, warmup_steps=4, decay_steps=14, min_lr=0.1)
    assert schedule(0) == pytest.approx(1 / 5)
    assert schedule(3) == pytest.approx(4 / 5)
    assert schedule(4) == pytest.approx(1.0)
    assert schedule(9) == pytest.approx(0.1 + 0.5 * (1 + math.cos(math.pi * 0.5)) * 0.9)
    assert schedule(14) == schedule(100) == pytest.approx(0.1)


def test_loss_scaler_backs_off_and_grows():
    scaler = DynamicLossScaler(enabled=True, init_scale=1024.0, growth_interval=3)
    scaler.update(found_nonfinite=True)
    assert scaler.scale == 512.0
    for _ in range(3):
        scaler.update(found_nonfinite=False)
    assert scaler.scale == 1024.0
    restored = DynamicLossScaler(enabled=True)
    restored.load_state_dict(scaler.state_dict())
    assert restored.scale == 1024.0 and restored.good_steps == 3
    off = DynamicLossScaler(enabled=False)
    off.update(True)
    assert off.scale == 1.0
    # Whether scaling is on follows the run's --dtype, not the checkpoint's.
    off.load_state_dict(scaler.state_dict())
    assert not off.enabled and off.scale == 1.0
    fresh = DynamicLossScaler(enabled=True, init_scale=64.0)
    fresh.load_state_dict(DynamicLossScaler(enabled=False).state_dict())
    assert fresh.enabled and fresh.scale == 64.0


def test_counts_here_picks_coordinate_zero_of_every_replicated_axis():
    split = ShardInfo("w", (8,), splits=(Split(0, 2, 1),))
    copied = ShardInfo("ln", (3,), replicated_over=("tp", "pp"))
    for t in (0, 1):
        for p in (0, 1):
            coords = {"tp": t, "pp": p, "dp_cp": 1}
            assert counts_here(split, coords)
            assert counts_here(copied, coords) == (t == 0 and p == 0)
            assert not counts_here(copied, coords, ("dp_cp",))  # a layout's data replicas: its rank 0 counts
    assert counts_here(copied, None)  # one process: everything counts


def _copied_across_two_axes(rank, world):
    """A 2×2 (pp × tp) mesh: one tensor split four ways and one copied over both axes. The global norm from
    optim.update counts the copy once; the DDP layout's checkpoint pieces write it once."""
    from ddp import replicated_state_pieces
    from mesh import MeshShape, build_mesh

    device = harness.device()
    mesh = build_mesh(MeshShape(dp=1, pp=2, tp=2), rank)
    coords = mesh.coordinates()
    split = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64, device=device))  # float64: norm exact to 1e-15
    split.shard_info = ShardInfo("w", (8,), splits=(Split(0, 4, rank),))
    copied = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64, device=device))
    copied.shard_info = ShardInfo("ln", (3,), replicated_over=("pp", "tp"))
    split.grad = torch.full((2,), float(rank + 1), dtype=torch.float64, device=device)
    copied.grad = torch.full((3,), 2.0, dtype=torch.float64, device=device)
    optimizer = build_adamw([split, copied], lr=0.1)
    counted = [counts_here(p.shard_info, coords) for p in (split, copied)]
    result = update([split.grad, copied.grad], counted, DynamicLossScaler(enabled=False), 0.0, optimizer.step, device)
    pieces = replicated_state_pieces([split, copied], optimizer, coords)
    return result.grad_norm, sorted(p.key for p in pieces if p.primary)


def test_a_tensor_copied_across_two_axes_counts_once_in_the_norm_and_the_checkpoint():
    results = run_ranks(_copied_across_two_axes, 4, timeout=60)
    expected = math.sqrt(sum(2 * (r + 1) ** 2 for r in range(4)) + 3 * 2.0 ** 2)  # copies would add 3·4 each
    written = [keys for _, keys in results]
    for norm, _ in results:
        assert norm == pytest.approx(expected, rel=1e-12)
    assert sum(key == "param/ln" for keys in written for key in keys) == 1
    assert all("param/w" in keys for keys in written)


def _skip_everywhere(rank, world):
    """One rank's gradient is inf, on a rank whose copy does not even count in the norm: every rank must skip,
    the scale must halve, parameters must not move."""
    device = harness.device()
    param = torch.nn.Parameter(torch.ones(5, 5, device=device))
    optimizer = build_adamw([param], lr=0.1)
    scaler = DynamicLossScaler(enabled=True, init_scale=8.0)
    param.grad = torch.full((5, 5), 8.0, device=device)
    if rank == 1:
        param.grad[2, 3] = float("inf")
    before = param.detach().clone()
    counted = [rank == 0]  # data-parallel replicas: rank 0's copy counts
    skipped = update([param.grad], counted, scaler, 1.0, optimizer.step, device)
    moved_after_skip = not torch.equal(before, param.detach())
    param.grad = torch.full((5, 5), 8.0, device=device)  # a good step now goes through, with the halved scale (8 → 4)
    good = update([param.grad], counted, scaler, 0.0, optimizer.step, device)
    return skipped.skipped, moved_after_skip, scaler.scale, good.skipped, good.grad_norm


def test_non_finite_gradient_on_one_rank_skips_on_all():
    for skipped, moved, scale, good_skipped, good_norm in run_ranks(_skip_everywhere, 2, timeout=60):
        assert skipped and not moved and scale == 4.0
        assert not good_skipped and good_norm == pytest.approx(2.0 * 5)  # unscaled by 4: ‖2·1₅ₓ₅‖ = 10


def test_fused_and_foreach_adamw_agree_to_rounding():
    """build_adamw's two kinds on CPU (torch's fused AdamW runs there too): five steps of the same gradients on
    a small GPT stay within reference.fused_adamw_tolerance of each other. They are not bitwise: the fused
    kernel rounds in another order. lr 1e-2 puts a real difference far outside it (weight decay lr·wd·|p|
    = 1e-3·|p| per step, a bias correction at the wrong step ~lr: 10⁴ ε and more)."""
    from reference import build_model
    from reference import fused_adamw_tolerance, make_config, seeded_adamw_step

    lr, steps = 1e-2, 5
    runs = []
    for fused in (False, True):
        model = build_model(make_config(n_layer=1), seed=0)
        optimizer = build_adamw(model.parameters(), lr, fused=fused)
        assert all(bool(g["fused"]) == fused and bool(g["foreach"]) != fused for g in optimizer.param_groups)
        runs.append((model, optimizer))
    assert not build_adamw(runs[0][0].parameters(), lr).param_groups[0]["fused"]  # the CPU default: foreach
    for step in range(1, steps + 1):
        for model, optimizer in runs:
            seeded_adamw_step(model, optimizer, step)
    for a, b in zip(runs[0][0].parameters(), runs[1][0].parameters()):
        assert ((a - b).abs() <= fused_adamw_tolerance(b, lr, steps)).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_build_adamw_is_fused_on_cuda():
    cuda = torch.nn.Parameter(torch.ones(4, 4, device="cuda"))
    assert all(g["fused"] for g in build_adamw([cuda], lr=0.1).param_groups)
    assert not build_adamw([torch.nn.Parameter(torch.ones(4, 4))], lr=0.1).param_groups[0]["fused"]
