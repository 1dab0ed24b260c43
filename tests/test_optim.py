"""optim.py: LR schedule, loss scaling, the global norm's TP accounting, and skipping a step on all ranks."""

import math

import pytest
import torch

from harness import run_ranks
from model import ShardInfo, Split
from optim import DynamicLossScaler, LRSchedule, build_adamw, local_grad_sq_sum, unscale_clip_and_step


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


def test_norm_counts_tp_replicated_tensors_once():
    split = torch.nn.Parameter(torch.ones(4))
    split.shard_info = ShardInfo("w", (8,), splits=(Split(0, 2, 1),))
    replicated = torch.nn.Parameter(torch.ones(3))
    replicated.shard_info = ShardInfo("ln", (3,), replicated_over=("tp",))
    grads = [(split, torch.full((4,), 2.0)), (replicated, torch.full((3,), 1.0))]
    assert local_grad_sq_sum(grads, tp_rank=0).item() == 16 + 3
    assert local_grad_sq_sum(grads, tp_rank=1).item() == 16  # the TP-replicated copy counts on rank 0 only


def _skip_everywhere(rank, world):
    """One rank's gradient is inf: every rank must skip, the scale must halve, parameters must not move."""
    param = torch.nn.Parameter(torch.ones(5, 5))
    optimizer = build_adamw([param], lr=0.1)
    scaler = DynamicLossScaler(enabled=True, init_scale=8.0)
    param.grad = torch.full((5, 5), 8.0)
    if rank == 1:
        param.grad[2, 3] = float("inf")
    before = param.detach().clone()
    skipped = unscale_clip_and_step([param], optimizer, scaler, clip=1.0)
    moved_after_skip = not torch.equal(before, param.detach())
    param.grad = torch.full((5, 5), 8.0)  # a good step now goes through, with the halved scale (8 → 4)
    good = unscale_clip_and_step([param], optimizer, scaler, clip=0.0)
    return skipped.skipped, moved_after_skip, scaler.scale, good.skipped, good.grad_norm


def test_non_finite_gradient_on_one_rank_skips_on_all():
    for skipped, moved, scale, good_skipped, good_norm in run_ranks(_skip_everywhere, 2, timeout=60):
        assert skipped and not moved and scale == 4.0
        assert not good_skipped and good_norm == pytest.approx(2.0 * 5)  # unscaled by 4: ‖2·1₅ₓ₅‖ = 10
