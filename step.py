"""One optimizer step: a schedule runs the micro-batches' forwards and backwards, then the one update.

DESIGN.md, "One optimizer step": B_global = D·m·B_μ sequences; each of this data rank's m micro-batches
backpropagates

    loss_scale · ( loss_sum / tokens_in_global_batch  +  Σ_aux coef·aux / (D·m) )

so that every gradient reduction afterwards is a plain SUM, and the objective is the single-device one:
Σ CE / tokens + Σ_aux coef · mean over the D·m micro-batches of aux. Then, on every rank alike:

    layout.finish_grad_sync()        reduce gradients over each parameter's data-parallel group
    axis.after_grad_sync(layout)     each axis's own sums (SP's replicated grads, PP's tied embedding)
    layout.step(scaler, clip)        optim.update: unscale → finite? → global norm → clip → step or skip
    axis.after_update(layout, ..)    each axis's change of the new weights (optimizers/qk_clip.py's QK-clip)

A schedule is an object with one method, `forward_backward(...)` (below); `GradientAccumulation` is the
default, and the pipeline replaces it with its own (`pipeline.py`): the rest of the step does not change.

Accounting: the step adds two scalar all-reduces over the data group (dp×cp): the global token count before
the schedule (the loss denominator) and the logged loss after it (8 bytes each, float64), and the update's
one 16-byte all-reduce over the world (optim.update). Host synchronisations of its own: one, reading the logged
loss and the aux means together (the update has its one; an axis may add its own, moe.py's docstring).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple

import torch
import torch.distributed as dist


class Count(NamedTuple):
    calls: float
    payload: float  # bytes: the sum of the messages M (mfu.py, section 4)


class Messages(dict):
    """Predicted messages: {(op, group name): Count(calls, payload bytes)}, what one optimizer step sends,
    named as CommTracer names what it traced. The one type every prediction returns: a layout's, an axis's,
    the step's own, so they add up and compare with the tracer's records without conversion."""

    def __init__(self, *args, **kwargs):
        super().__init__({key: Count(*value) for key, value in dict(*args, **kwargs).items()})

    def add(self, op: str, group: str, calls: float = 1, payload: float = 0) -> Messages:
        """Count `calls` more calls of `op` on `group` moving `payload` bytes in all; returns self. Bytes without
        calls count too: they ride another user's call (eplb's loads in the router's all-reduce)."""
        if calls or payload:
            old = self.get((op, group), Count(0, 0))
            self[(op, group)] = Count(old.calls + calls, old.payload + payload)
        return self

    def __add__(self, other: dict) -> Messages:
        out = Messages(self)
        for (op, group), (calls, payload) in other.items():
            out.add(op, group, calls, payload)
        return out

    def times(self, factor: float) -> Messages:
        """Every count multiplied by `factor` (per layer → per step, per step → per run)."""
        return Messages({key: Count(c.calls * factor, c.payload * factor) for key, c in self.items()})

    def named(self, alias) -> Messages:
        """The same counts under the names a tracer reports their groups by (`CommTracer.alias`): names that
        share one communicator ("dp_cp" and "expert_dp" when E = 1) become one row."""
        out = Messages()
        for (op, group), (calls, payload) in self.items():
            out.add(op, alias(group), calls, payload)
        return out


class Axis:
    """What an applied axis hands back to train.py (`apply(model, run, config)` returns one, or None when off).

    Ten methods, the same for every axis, so that the step, the checkpoint and the printouts loop over handles
    and never ask which axes are on. Six serve training, four accounting; every one has a default that does
    nothing, and an axis overrides what it needs. What an axis prints lives in its section of report/axes.py
    (report.axes.AXIS_LINES[name]), which reads the handle through these methods only (`facts` for its own
    figures); nothing is set on a handle from outside (`observe` is how the accounting subscribes).
    """

    name: ClassVar[str] = "axis"
    schedule = None  # an object with GradientAccumulation's forward_backward (the pipeline brings one)
    observer = None  # what the accounting subscribed to the axis's algorithm (`observe`)

    # --- training ---------------------------------------------------------------------------------------------

    def shard_batches(self, batches: list) -> list:
        """This rank's part of each micro-batch (x, y, pos): context parallel cuts the sequences."""
        return batches

    def after_grad_sync(self, layout) -> int:
        """Sums the axis needs once the layout's data-parallel reduction is done (on layout.grad_pieces), and
        its own per-step bookkeeping (FP8 rolls its amax histories here). Returns this rank's count of
        non-finite values of its own (FP8 amaxes) that must skip the step on every rank: the update's one world
        all-reduce adds them to the gradients' count, so no rank can step while another skips."""
        return 0

    def after_update(self, layout, skipped: bool) -> None:
        """After the layout's update (`skipped`: it did not step): what the axis changes of the new weights."""

    def sampling(self):
        """A context in which model.generate runs on one rank group (TP gathers the logits, CP attends locally)."""
        return nullcontext()

    def state_pieces(self) -> list:
        """Its own training state as shard.StatePiece (FP8's amax histories), for ckpt.py. What the axis derives
        from that state it derives from the tensors themselves after a load, or in `after_load`."""
        return []

    def after_load(self, layout, step: int) -> None:
        """A checkpoint of `step` was copied into the state pieces (every rank, before the next step): what
        cannot wait for the next use is derived here (the redundant experts' placement moves slots)."""

    # --- accounting -----------------------------------------------------------------------------------------

    def observe(self, observer) -> None:
        """Subscribe the accounting's `observer` to the axis's algorithm, which then tells it what happened
        (the ring its passes and waits, each MoE layer what it routed) and never times or counts itself.
        report.run.observe_axes calls it once, at start-up; an axis with nothing to observe keeps the default."""
        self.observer = observer

    def facts(self):
        """What the accounting reads of the axis (its report/axes.py section, planner/time_model.py,
        accounting/measure.py): a frozen record of its own (context_parallel.CPFacts, moe.MoEFacts, ...), or None; the
        rest they read of the run. The one door into a handle besides these methods."""
        return None

    def predicted_messages(self, layout) -> Messages:
        """Its messages of one optimizer step, by (op, group), from its formulas (uniform routing for MoE)."""
        return Messages()

    def traced_prediction(self, layout, steps: int) -> Messages:
        """What the tracer should have seen per training step, for the end table: predicted_messages, unless
        the axis knows better after the fact (MoE: the all-to-all bytes from the routed counts)."""
        return self.predicted_messages(layout)


def in_backward() -> bool:
    """Whether the code calling it runs inside autograd's backward (a backward function, or a forward that full or
    selective recompute reruns there), i.e. whether autograd has a graph task running on this thread.

    Why it is needed: activation checkpointing runs a block's forward twice, once in the forward pass and once
    inside the backward to rebuild what it did not keep. What a forward records for the step (FP8 amaxes and
    casts, routed loads, padded rows, saturation counts) must be recorded once, so the recorders skip the rerun; the
    rerun sees the same grad mode and train mode, so only autograd's state tells the two apart. torch has no
    public call for it: `torch._C._current_graph_task_id` is -1 outside a backward. Every caller asks here."""
    return torch._C._current_graph_task_id() != -1


def is_training_forward(training: bool) -> bool:
    """A forward that trains: train mode (`training`, the layer's), grad on, outside a backward (a checkpointed
    block's recompute runs inside one). Evaluation, sampling and recomputes route tokens the step must not count
    (moe.py's aux statistics, observers.RoutedLoad's loads, eplb's slot loads)."""
    return training and torch.is_grad_enabled() and not in_backward()


@torch.no_grad()
def sum_in_place(tensors: list, group) -> None:
    """All-reduce (SUM) `tensors` over `group` as one flat message and write the sums back in place (they are
    views into a layout's gradient buffers: layout.grad_pieces). Every rank of the group passes the same sizes,
    so a rank with nothing to sum is one whose peers have nothing either: nobody sends."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(part.view_as(t))


def scalar_messages() -> dict:
    """The step's own two messages over the data-parallel group (dp_cp, when it has more than one rank), each one
    float64 SUM all-reduce: count_global_tokens before the first forward and the logged loss after the update.
    Both block the step (nothing runs beside them), though they share their (op, group) with DDP's gradients."""
    return {("all_reduce", "dp_cp"): (2, 16)}


def count_global_tokens(batches, group, device) -> torch.Tensor:
    """Target tokens (≠ -1) in the whole global batch: the denominator of the loss on every rank."""
    local = sum((batch[1] != -1).sum() for batch in batches).to(device=device, dtype=torch.float64)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)
    return local


@dataclass
class MicroBatchLoss:
    """What a schedule hands back: Σ CE over this data rank's micro-batches (float64, on every rank of its
    model-parallel group), and Σ over them of each auxiliary loss, by name (0-dim tensors, for the printouts)."""

    loss_sum: torch.Tensor
    aux: dict = field(default_factory=dict)


class ForwardObserver:
    """Who watches a schedule's forwards: `forward(model)` is a context around one forward of a micro-batch (under
    PP, of one micro-batch through one chunk), and does nothing here. The accounting subscribes its probe of the
    bytes saved for backward (observers.SavedByFirstForward) through the schedule's `observe_forwards`."""

    def forward(self, model):
        return nullcontext()


class GradientAccumulation:
    """The default schedule: forward and backward each micro-batch in turn; gradients sync on the last one (DDP's
    bucket all-reduces launched as they become ready); the earlier ones run in `layout.no_sync()` and accumulate."""

    measured_forward = "one micro-batch's forward"  # what a ForwardObserver's `forward` surrounds

    def __init__(self):
        self.forward_observer = ForwardObserver()

    def observe_forwards(self, observer: ForwardObserver) -> None:
        self.forward_observer = observer

    def describe(self, micro_batches: int) -> str:
        return f"gradient accumulation over m={micro_batches} micro-batches (no pipeline: no bubble)"

    def forward_backward(self, layout, model, batches, global_tokens, loss_scale: float, aux_divisor: int,
                         autocast, device) -> MicroBatchLoss:
        """layout: runs the forward (ZeRO-3 gathers there); model: the GPT (its aux-loss channel); batches:
        this data rank's micro-batches (x, y) or (x, y, pos)."""
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        aux_totals: dict = {}
        for index, batch in enumerate(batches):
            x, y, pos = (*batch, None)[:3]  # (x, y) or (x, y, pos): pos, the global positions (context parallel)
            last = index == len(batches) - 1
            with nullcontext() if last else layout.no_sync():
                with autocast, self.forward_observer.forward(model):
                    _, micro_loss_sum, _ = layout(x.to(device, non_blocking=True), y.to(device, non_blocking=True),
                                                  None if pos is None else pos.to(device))
                objective = micro_loss_sum / global_tokens
                aux = model.aux_losses.weighted_sum()
                if aux is not None:
                    objective = objective + aux / aux_divisor
                    for name, value in model.aux_losses.values().items():  # tensors: no host sync here
                        aux_totals[name] = aux_totals.get(name, 0.0) + value
                (objective * loss_scale).backward()
            loss_sum += micro_loss_sum.detach().double()
        return MicroBatchLoss(loss_sum, aux_totals)

    @torch.no_grad()
    def forward_only(self, layout, model, batches, autocast, device):
        """Evaluation: (Σ loss, Σ tokens) over the micro-batches, through the layout's forward."""
        totals = torch.zeros(2, dtype=torch.float64, device=device)
        for batch in batches:
            x, y, pos = (*batch, None)[:3]
            with autocast:
                _, loss_sum, count = layout(x.to(device), y.to(device), None if pos is None else pos.to(device))
            totals += torch.stack([loss_sum.double(), count.double()])
        return totals[0], totals[1]


@dataclass
class StepOutcome:
    loss: float  # global mean CE of the step
    grad_norm: float
    skipped: bool
    aux: dict  # {name: mean over this data rank's micro-batches}


def train_step(layout, scaler, batches, data_group, clip: float, autocast, device, *, model=None, schedule=None,
               axes=(), data_size: int | None = None) -> StepOutcome:
    """One optimizer step over this rank's micro-batches (`batches`), in DESIGN.md's order.

    model: the GPT whose aux-loss channel the schedule reads (default: layout.module); schedule: default
    GradientAccumulation; axes: the applied axes' handles (their after_grad_sync runs after the layout's
    reduction); data_size: D, the number of data-parallel micro-batch streams (default: the size of
    data_group; under context parallel the C ranks of a stream share its micro-batches, so pass mesh D),
    so that aux losses are averaged over the D·m micro-batches.
    """
    model = model if model is not None else layout.module
    schedule = schedule or GradientAccumulation()
    data_size = data_size or dist.get_world_size(data_group)
    global_tokens = count_global_tokens(batches, data_group, device)
    micro = schedule.forward_backward(layout, model, batches, global_tokens, scaler.scale,
                                      data_size * len(batches), autocast, device)
    layout.finish_grad_sync()
    nonfinite = sum(axis.after_grad_sync(layout) or 0 for axis in axes)  # FP8's non-finite amaxes skip the step
    result = layout.step(scaler, clip, extra_nonfinite=nonfinite or None)
    for axis in axes:  # after the update: QK-clip rescales the new weights (optimizers/qk_clip.py)
        axis.after_update(layout, result.skipped)
    layout.zero_grad()
    loss_sum = micro.loss_sum
    if dist.get_world_size(data_group) > 1:
        dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM, group=data_group)
    # The logged values reach the host together: one synchronisation for the loss and every aux mean.
    names = list(micro.aux)
    logged = torch.stack([(loss_sum / global_tokens).double(),
                          *(torch.as_tensor(micro.aux[name], device=loss_sum.device).double() / len(batches)
                            for name in names)]).tolist()
    return StepOutcome(logged[0], result.grad_norm, result.skipped, dict(zip(names, logged[1:])))
