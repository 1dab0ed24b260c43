"""The optimizer step shared by every layout: AdamW groups, LR schedule, loss scaling, the update order.

DESIGN.md fixes the order of one update, identical on every rank:
    accumulate all micro-batches → reduce gradients → unscale (fp16) → check all gradients are finite across
    the whole world → global gradient norm over the logical gradients → clip → all step, or all skip.
Gradient reduction belongs to the layout (ddp.py, zero.py); everything after it lives here, so that every
layout applies the same update as the single-device model.

Accounting:
1. Optimizer state is laid out like the parameters it belongs to (replicated under DDP, sharded by ZeRO).
2. AdamW holds two fp32 moments per parameter: 8 bytes/param.
3. Messages per step: one 16-byte float64 SUM all-reduce over the world: [Σ g² over the copies this rank
   counts, number of non-finite gradients]; it is the only host synchronisation of the update.
4. Restart state: AdamW moments and step count, the scheduler's position (the step), the loss scaler.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim.optimizer import _device_dtype_check_for_fused, _get_scalar_dtype


def adamw_param_groups(params, weight_decay: float) -> list:
    """Decoupled weight decay on matrices (linears, embeddings); none on biases and LayerNorm gains (dim < 2)."""
    params = [p for p in params if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def build_adamw(params, lr: float, weight_decay: float = 0.1, betas=(0.9, 0.95), eps: float = 1e-8,
                fused: bool | None = None):
    """torch AdamW over adamw_param_groups: fused when every parameter is on CUDA (or fused=True), else foreach.

    fused: per group, one multi-tensor kernel does the whole update (decay, moments, bias correction, step;
    after one that counts the step), reading p, g, m, v once and writing p, m, v once (7 tensor passes);
    foreach runs 8 multi-tensor ops (mul, lerp, mul, addcmul, sqrt, div, add, addcdiv: ~20 passes). Neither
    launches per parameter. Fused keeps the step count as a float32 tensor on the parameter's device, where
    the kernel reads it: bias correction costs no host work and no host sync. (Foreach keeps it on the CPU for
    the same reason: it computes the corrections in Python, per parameter, and a device step would sync.)
    fused=True also runs on CPU (torch's fused AdamW supports it); the two agree to rounding, not bitwise
    (tests/reference.py fused_adamw_tolerance). A checkpoint holds no trace of which one wrote it (ckpt.py).
    """
    groups = adamw_param_groups(params, weight_decay)
    if fused is None:
        fused = {p.device.type for group in groups for p in group["params"]} == {"cuda"}
    kind = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, **kind)


def ensure_adam_state(optimizer) -> None:
    """Create torch AdamW's state now, as its first step would (step 0, zero moments), so it can be loaded into.

    Mirrors torch.optim.Adam._init_group: the step count is a CPU scalar of the default float dtype, except
    under fused or capturable AdamW, whose kernels read it on the parameter's device (float32 when fused).
    The first step then finds the state present and behaves exactly as if it had created it. A checkpoint
    holds only the moments and one integer step, so it loads into either kind.
    """
    for group in optimizer.param_groups:
        fused, on_device = group.get("fused"), group.get("capturable") or group.get("fused")
        for p in group["params"]:
            state = optimizer.state[p]
            if not state:
                if fused:
                    _device_dtype_check_for_fused(p)  # the error torch's first step would raise
                state["step"] = (torch.zeros((), dtype=_get_scalar_dtype(is_fused=fused), device=p.device)
                                 if on_device else torch.tensor(0.0, dtype=_get_scalar_dtype(), device="cpu"))
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


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


class Layout(Protocol):
    """The one protocol every layout implements (`ddp.DDPLayout`, `zero.ZeroLayout`); `step.train_step` and
    the checkpoint drive it, and never ask which layout it is.

    A layout owns the gradient reduction (each parameter over the data-parallel group its record names:
    `shard_info.grad_group`, "dp_cp" for dense parameters, "expert_dp" for experts) and the optimizer state.
    """

    name: str  # "ddp" or "zero": its printouts are report.axes.AXIS_LINES[name]
    module: nn.Module  # the model it wraps

    def __call__(self, idx, targets=None, pos=None):
        """The model's forward (ZeRO-3 gathers weights around it)."""

    def no_sync(self) -> AbstractContextManager:
        """Backwards inside only accumulate; finish_grad_sync() reduces whatever was not reduced yet."""

    def finish_grad_sync(self) -> None:
        """Reduce (SUM) every gradient over its data-parallel group; wait for every reduction in flight."""

    def grad_pieces(self, params) -> list:
        """The reduced gradient of `params` as this rank holds it (whole under DDP, shard segments under ZeRO),
        as views: an axis may sum them over another group in place (SP's replicated grads, PP's tied copy)."""

    def step(self, scaler: DynamicLossScaler, clip: float, extra_nonfinite=None) -> StepResult:
        """`update(...)` below, on this layout's gradients and optimizer (extra_nonfinite: see update)."""

    def zero_grad(self) -> None: ...

    def set_lr(self, lr: float) -> None: ...

    def state_pieces(self) -> list:
        """Every tensor of training state as shard.StatePiece (what ckpt.py saves and reslices)."""

    def recount(self) -> None:
        """Decide again which copies the norm counts (shard.counts_here), after an axis renamed its parameters
        (experts/eplb.py's re-plan moves experts between slots); the layout decides it once at construction."""

    optimizer_step_count: int  # Adam's t (skipped steps do not count); a checkpoint restores it

    def held_bytes(self) -> dict:
        """{weights, grads, optimizer, total} bytes this rank holds for the whole run (measured)."""

    def predicted_persistent(self) -> dict:
        """The same keys, from the layout's formula (memory.persistent_bytes)."""

    def predicted_messages(self, micro_batches: int):
        """Its tracer.Messages of one optimizer step of m micro-batches, by (op, group), from its formulas."""

    def facts(self):
        """What the accounting reads of the layout besides these methods (its report/axes.py section,
        planner/time_model.py): a frozen record of its own figures (ddp.DDPFacts, zero.ZeroFacts)."""

    # A layout that wraps another (diloco.DiLoCoLayout) also names its own section and figures:
    # wrapper: str  -- its report.axes.AXIS_LINES key ("diloco"); absent on a plain layout
    def wrapper_facts(self):
        """A wrapping layout's own figures for its section (diloco.DiLoCoFacts); a plain layout has none."""


@dataclass
class StepResult:
    grad_norm: float
    skipped: bool


@torch.no_grad()
def update(grads: list, counted: list, scaler: DynamicLossScaler, clip: float, apply_step: Callable[[], None],
           device, counted_pieces=(), extra_nonfinite: torch.Tensor | None = None, group=None) -> StepResult:
    """DESIGN.md's update order after the gradient reduction, identical on every rank (the one implementation).

    grads: every reduced gradient tensor this rank holds (unscaled and clipped in place);
    counted[i]: whether grads[i] enters the global norm here (a list, or a bool tensor on the gradients'
        device that a layout builds once): each logical element must be counted on exactly
        one rank of the world (shard.counts_here: coordinate 0 of every axis holding identical copies, the
        data-parallel replicas included), so that one SUM over the world gives the global norm;
    counted_pieces: further views to count (ZeRO: the parts of a shard that are not replicas);
    apply_step(): the optimizer step, run only when every rank's gradients are finite;
    extra_nonfinite: a local count of other non-finite values that must skip the step (FP8 amaxes);
    group: the ranks that make one update together: the world (None), or one DiLoCo replica (resilience/diloco.py),
    whose
        norm and skip are its own.

        unscale (fp16) → [Σ counted g², #non-finite] summed over the world → all finite? → ‖g‖ = √Σ →
        clip by clip/(‖g‖ + 1e-6) (torch.nn.utils.clip_grad_norm_'s coefficient) → step, or skip everywhere

    One 16-byte all-reduce answers both questions (a non-finite gradient makes its norm non-finite), so a
    step costs one host synchronisation, not one per parameter.
    """
    if scaler.enabled:
        torch._foreach_mul_(grads, 1.0 / scaler.scale)
    stats = torch.zeros(2, dtype=torch.float64, device=device)  # [Σ counted g², number of non-finite norms]
    if grads:
        norms = torch.stack(torch._foreach_norm(grads)).double()
        stats[1] = (~torch.isfinite(norms)).sum()
        mask = counted if torch.is_tensor(counted) else torch.tensor(counted, dtype=torch.bool, device=norms.device)
        stats[0] = torch.where(mask, norms, 0.0).pow(2).sum()  # not norms[mask]: a boolean index syncs on GPUs
    if counted_pieces:
        stats[0] += torch.stack(torch._foreach_norm(list(counted_pieces))).double().pow(2).sum()
    if extra_nonfinite is not None:
        stats[1] += torch.as_tensor(extra_nonfinite, dtype=torch.float64).to(stats.device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)  # the world (or a replica): every axis
    sq_sum, nonfinite = stats.tolist()  # the step's one host synchronisation
    if nonfinite or not math.isfinite(sq_sum):
        scaler.update(found_nonfinite=True)
        return StepResult(grad_norm=float("nan"), skipped=True)
    grad_norm = math.sqrt(sq_sum)
    if clip > 0 and grad_norm > clip:
        torch._foreach_mul_(grads, clip / (grad_norm + 1e-6))
    apply_step()
    scaler.update(found_nonfinite=False)
    return StepResult(grad_norm=grad_norm, skipped=False)


def update_messages(group: str = "world") -> dict:
    """The update's own message per step: one 16-byte float64 SUM all-reduce over the world (DiLoCo: "replica")."""
    return {("all_reduce", group): (1, 16)}
