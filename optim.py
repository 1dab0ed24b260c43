"""The optimizer step shared by every layout: AdamW groups, LR schedule, loss scaling, the update order.

DESIGN.md fixes the order of one update, identical on every rank:
    accumulate all micro-batches → reduce gradients → unscale (fp16) → check all gradients are finite across
    the whole world → global gradient norm over the logical gradients → clip → all step, or all skip.
Gradient reduction belongs to the layout (ddp.py, zero.py); everything after it lives here, so that every
layout applies the same update as the single-device model.

Accounting:
1. Optimizer state is laid out like the parameters it belongs to (replicated under DDP, sharded by ZeRO).
2. AdamW holds two fp32 moments per parameter: 8 bytes/param.
3. Messages per step: one 4-byte MAX all-reduce over the world (the finite flag) and one float64 SUM
   all-reduce of the squared norm over the groups that hold different pieces of the logical gradient.
4. Restart state: AdamW moments and step count, the scheduler's position (the step), the loss scaler.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from model import counts_here


def adamw_param_groups(params, weight_decay: float) -> list:
    """Decoupled weight decay on matrices (linears, embeddings); none on biases and LayerNorm gains (dim < 2)."""
    params = [p for p in params if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def build_adamw(params, lr: float, weight_decay: float = 0.1, betas=(0.9, 0.95), eps: float = 1e-8):
    # foreach: one fused multi-tensor kernel per group instead of a Python loop over parameters.
    return torch.optim.AdamW(adamw_param_groups(params, weight_decay), lr=lr, betas=betas, eps=eps, foreach=True)


@dataclass
class LRSchedule:
    """Linear warmup to `max_lr`, then cosine decay to `min_lr` at `decay_steps`, constant after."""

    max_lr: float
    warmup_steps: int
    decay_steps: int
    min_lr: float = 0.0

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.max_lr * (step + 1) / (self.warmup_steps + 1)
        if step >= self.decay_steps:
            return self.min_lr
        progress = (step - self.warmup_steps) / max(1, self.decay_steps - self.warmup_steps)
        return self.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (self.max_lr - self.min_lr)


class DynamicLossScaler:
    """fp16 loss scaling: multiply the loss by S so small gradients survive fp16, divide gradients by S.

    A step with non-finite gradients is skipped and S halves; after `growth_interval` good steps S doubles.
    With `enabled=False` (fp32, bf16) S is 1 and nothing changes.
    """

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, growth_interval: int = 2000):
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_interval = growth_interval
        self.good_steps = 0

    def update(self, found_nonfinite: bool):
        if not self.enabled:
            return
        if found_nonfinite:
            self.scale, self.good_steps = max(self.scale / 2.0, 1.0), 0
        else:
            self.good_steps += 1
            if self.good_steps % self.growth_interval == 0:
                self.scale *= 2.0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "enabled": self.enabled}

    def load_state_dict(self, state: dict):
        """Whether scaling is on follows this run's --dtype, not the checkpoint's; the scale carries over only
        between two runs that both scale (an fp16 run resuming a bf16 checkpoint starts from init_scale)."""
        if self.enabled and state["enabled"]:
            self.scale, self.good_steps = state["scale"], state["good_steps"]


def counts_once(param: torch.Tensor, tp_rank: int) -> bool:
    """Whether this rank's copy enters the global norm: TP-replicated tensors are counted on TP rank 0 only."""
    return counts_here(getattr(param, "shard_info", None), {"tp": tp_rank})


@torch.no_grad()
def local_grad_sq_sum(grads_with_params, tp_rank: int = 0) -> torch.Tensor:
    """Σ g² over the gradients this rank contributes to the logical gradient, in float64."""
    total = torch.zeros((), dtype=torch.float64)
    for param, grad in grads_with_params:
        if grad is not None and counts_once(param, tp_rank):
            total += grad.detach().double().pow(2).sum().cpu()
    return total


@torch.no_grad()
def all_ranks_finite(local_finite: bool, device) -> bool:
    """True only if every rank in the world found its gradients finite (MAX of the 'bad' flag)."""
    flag = torch.tensor([0.0 if local_finite else 1.0], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() == 0.0)


@dataclass
class StepResult:
    grad_norm: float
    skipped: bool


@torch.no_grad()
def unscale_clip_and_step(params, optimizer, scaler: DynamicLossScaler, clip: float, norm_groups=(),
                          tp_rank: int = 0, device="cpu") -> StepResult:
    """The update after the gradient reduction, for layouts whose `param.grad` holds the reduced gradient.

    norm_groups: the process groups whose members hold DIFFERENT pieces of the logical gradient (TP, PP); the
    squared norm is summed over them. Replicas (data parallel) hold the same reduced gradient: not summed.
    """
    params = [p for p in params if p.grad is not None]
    grads = [p.grad for p in params]
    if scaler.enabled:
        torch._foreach_mul_(grads, 1.0 / scaler.scale)
    local_finite = bool(all(torch.isfinite(g).all() for g in grads))
    if not all_ranks_finite(local_finite, device):
        scaler.update(found_nonfinite=True)
        return StepResult(grad_norm=float("nan"), skipped=True)
    sq_sum = local_grad_sq_sum(zip(params, grads), tp_rank).to(device)
    for group in norm_groups:
        if dist.get_world_size(group) > 1:
            dist.all_reduce(sq_sum, op=dist.ReduceOp.SUM, group=group)
    grad_norm = float(sq_sum.sqrt())
    if clip > 0 and grad_norm > clip:
        # clip_coef = clip / (‖g‖ + ε), as torch.nn.utils.clip_grad_norm_
        torch._foreach_mul_(grads, clip / (grad_norm + 1e-6))
    optimizer.step()
    scaler.update(found_nonfinite=False)
    return StepResult(grad_norm=grad_norm, skipped=False)
