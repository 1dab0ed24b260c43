"""Pipeline parallel: the layers cut into stages, micro-batches flowing through them, raw p2p.

P ranks (the `pp` group) each hold a contiguous range of layers, a stage; the first also the embeddings,
the last ln_f, the head and the loss. A micro-batch's hidden states go forward stage to stage, their
gradient comes back. With `interleaved` the layers are cut into v·P chunks and rank r holds chunks r, r+P,
... (Narayanan et al. 2021). Every schedule is a list of actions per rank, built by a pure function below,
executed by ONE interpreter (`PipelineSchedule.forward_backward`):
    F  forward of (micro-batch, chunk)          B  its backward
    I  B's input-gradient half, sent upstream   W  B's weight-gradient half, deferred (ZB-H1, Qi et al. 2023)
`gpipe`: all F, then all B. `1f1b`: warm-up of P−r−1 F, steady 1F1B, cool-down (PipeDream-Flush, as in
Megatron and picotron). `interleaved`: Megatron's interleaved 1F1B over groups of P micro-batches (a
remainder of m mod P joins the last group). `zb`: 1F1B with B split into I and W; rank r keeps r W's
deferred and runs them at the end, where 1F1B idles.

How zb defers W: every nn.Linear of a chunk (the head, and the inner linears of tensor_parallel's
Column/RowParallelLinear alike) runs with its parameters detached, so its backward returns dL/dx = dL/dy·A
and hands the WeightGradStore a callable for its weight gradient; W calls it (dL/dA = dL/dyᵀ·x, dL/db =
Σ dL/dy) and hands the results to autograd's AccumulateGrad, so a layout's gradient hooks see ordinary
gradients. A plain linear gets a forward that applies `_LinearInputGradOnly` (its callable keeps x and
dL/dy); fp8.Fp8Linear defers by itself (its callable keeps the FP8 dL/dy and x with their scales, and db,
and runs the FP8 GEMM in W). LayerNorm and embedding gradients stay in I. Cost: no extra FLOPs; x and dL/dy
of each linear (≈16·b·s·h elements per layer) are held from I to W (under SP the gathered x, under
autocast the 16-bit copies, cast once per micro-batch; under FP8 one byte each), plus one Python autograd
node per linear.

P2P: an F sends its output to the next chunk's rank, a B/I its input gradient to the previous one's.
`communication_plan` has every rank post a receive as soon as, in a uniform-cost simulation of all the
lists, its sender has sent it (so the transfer overlaps compute; torch.distributed.pipelining does the
same); the sends an action produces go in ONE `dist.batch_isend_irecv` with the receives posted next
(Megatron's send/recv pairing). Every op is thus posted in the order of one global simulated clock: on each
channel the receives come in the order the sender sends (NCCL matches p2p by order, not tag), and two ranks
can never each sit in a send waiting for the other's later receive. Every work is waited (gloo completes a
send only in wait()): a receive before the action that uses it; a send at its release point in the plan,
before the first action after the one it was posted with that starts, in the simulation, once its receiver
has posted the receive (in posting order; any left at the step's end). A rank thus blocks only on a peer's
post that comes earlier in the simulated clock: no cycle, whatever the real costs (the schedule checker runs
the plans under gloo's and NCCL's completion rules), and at most 2 sent buffers per rank are alive at once.

The loss each micro-batch backpropagates is loss_scale·(loss_sum/global_tokens + Σ coef·aux/(D·m)), as in
step.GradientAccumulation: nothing is rescaled afterwards. A chunk's aux-loss terms are backpropagated with
its output. Data parallel wraps the rank's stage model (DDP or ZeRO-1): every backward runs under
`layout.no_sync()` except each chunk's last B (zb: last I and last W), so every gradient reaches the
reduction once, overlapped with the cool-down. ZeRO-2/3 are refused (`check_flags` says why).

Symbols: L layers, P stages, v chunks per rank, m micro-batches, b micro-batch size, s tokens per row on a
rank (÷C under CP, ÷T under SP), h hidden, V vocabulary, e bytes per activation element (the parameter
dtype: the residual stream stays in it under autocast), A = activation bytes a layer keeps for backward
(mfu.activation_bytes_per_layer, s·b·h·(34 + 5·a·s/h) at 16 bits; 2·s·b·h with activation checkpointing).

1. Split: the blocks (L/(vP) per chunk; an uneven split is allowed, with a warning), embeddings (first),
   ln_f + head (last), their gradients and optimizer state, the activations. Replicated: the tied embedding,
   one copy on the first and one on the last stage (both `replicated_over=("pp",)`, coordinate 0 counts);
   they start equal and their gradients are summed over the {first, last} group (`after_grad_sync`).
2. Peak per rank: its parameters (`stage_params`) × 16 bytes with fp32 AdamW, and in-flight × layers per
   chunk × A, counting chunk-micro-batches between F and B/I:  gpipe m;  1f1b min(P−r, m);
   interleaved min(2(P−r−1) + (v−1)(P + m mod P) + 1, v·m);  zb min(P−r, m), plus ≤ r+1 W stashes.
   Temporary: received activations and gradients, b·s·h·e each; sent ones until their release point, at
   most 2 per rank at once (`live_sends`; 1 on the last stage of 1f1b and zb).
3. Critical path. The bubble (idle fraction of a step; uniform costs, free communication; `simulate` does
   any per-rank costs):  gpipe, 1f1b (P−1)/(m+P−1);  interleaved (P−1)/(v·m+P−1);
   zb (P−1)·max(t_F, t_F+t_I−t_W) / (m·(t_F+t_I+t_W) + (P−1)·max(t_F, t_F+t_I−t_W)).
   Messages per step: at each of the v·P−1 chunk boundaries m activations forward and m gradients back,
   b·s·h·e bytes each (`send`/`recv` over pp; `p2p_counts` per stage pair); all_reduce 8 B over pp (the
   loss sum); all_reduce V·h·e (÷T under TP, the shard under ZeRO-1) over pp_tied, first and last stage.
4. Restart state: nothing of its own. Parameters carry global names (`transformer.h.<i>`), so a checkpoint
   reslices onto another P; the tied copy counts on pp coordinate 0 and is written once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
import json
import os
import time
from collections import defaultdict, deque
from contextlib import contextmanager, nullcontext
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import mesh as mesh_lib
import mfu
from model import GPT, GPTConfig
from step import Axis, sum_in_place

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")
TIED = "transformer.wte.weight"

# ---------------------------------------------------------------------------------------------------------
# The stage split
# ---------------------------------------------------------------------------------------------------------


def split_layers(n_layer: int, n_chunks: int) -> list:
    """Contiguous layer ranges of `n_chunks` chunks; sizes differ by at most one (earlier chunks get more)."""
    base, extra = divmod(n_layer, n_chunks)
    bounds = [0]
    for chunk in range(n_chunks):
        bounds.append(bounds[-1] + base + (chunk < extra))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def stage_layers(n_layer: int, P: int, v: int, chunk: int) -> range:
    """The layers of global chunk `chunk` (of v·P); it lives on pp rank chunk mod P."""
    return split_layers(n_layer, P * v)[chunk]


def rank_chunks(pp_rank: int, P: int, v: int) -> list:
    """The global chunks pp rank r holds: r, r+P, r+2P, ..."""
    return [pp_rank + k * P for k in range(v)]


# ---------------------------------------------------------------------------------------------------------
# The schedules: one list of actions per rank, built by pure functions
# ---------------------------------------------------------------------------------------------------------


class Action(NamedTuple):
    kind: str  # "F" forward, "B" backward, "I" input-gradient backward, "W" weight-gradient backward
    mb: int  # micro-batch
    chunk: int  # global chunk index (= pp rank without interleaving)

    def __str__(self):
        return f"{self.kind}{self.mb}.{self.chunk}"


def gpipe(P: int, m: int, rank: int, v: int = 1) -> list:
    """All forwards, then all backwards (Huang et al. 2019): m micro-batches in flight."""
    return [Action("F", i, rank) for i in range(m)] + [Action("B", i, rank) for i in range(m)]


def one_f_one_b(P: int, m: int, rank: int, v: int = 1) -> list:
    """1F1B (PipeDream-Flush): as soon as a backward can run, alternate one forward with one backward."""
    warmup = min(P - rank - 1, m)
    actions = [Action("F", i, rank) for i in range(warmup)]  # warm-up: fill the pipeline
    for i in range(m - warmup):  # steady 1F1B: P−r micro-batches in flight at most
        actions += [Action("F", warmup + i, rank), Action("B", i, rank)]
    actions += [Action("B", i, rank) for i in range(m - warmup, m)]  # cool-down: drain it
    return actions


def microbatch_groups(m: int, P: int) -> list:
    """Interleaving runs micro-batches in groups of P through every chunk; a remainder joins the last group."""
    groups = [range(a, min(a + P, m)) for a in range(0, m, P)]
    if len(groups) > 1 and len(groups[-1]) < P:
        tail = groups.pop()
        groups[-1] = range(groups[-1].start, tail.stop)
    return groups


def interleaved_1f1b(P: int, m: int, rank: int, v: int = 2) -> list:
    """Megatron's interleaved 1F1B: rank r holds chunks r, r+P, ...; each group of micro-batches goes through
    the rank's chunks in order forward and in reverse order backward, in 1F1B after a longer warm-up."""
    groups = microbatch_groups(m, P)
    forwards = [Action("F", mb, k * P + rank) for g in groups for k in range(v) for mb in g]
    backwards = [Action("B", mb, k * P + rank) for g in groups for k in reversed(range(v)) for mb in g]
    total = v * m
    # A group's first backward needs its first micro-batch through all v·P chunks: (v−1)·|group| more
    # forwards here (the largest group, P + m mod P, so every group's fit), and two slots per stage
    # downstream (its forward there, its backward coming back).
    warmup = min(2 * (P - rank - 1) + (v - 1) * (P + m % P), total)
    actions = forwards[:warmup]  # warm-up
    for i in range(total - warmup):  # steady 1F1B
        actions += [forwards[warmup + i], backwards[i]]
    return actions + backwards[total - warmup:]  # cool-down


def zero_bubble_h1(P: int, m: int, rank: int, v: int = 1) -> list:
    """ZB-H1 (Qi et al. 2023): 1F1B with B split into I (input gradient, sent upstream at once) and W (weight
    gradient, deferred). Rank r keeps r W's deferred: its last I comes r slots before rank 0's, and those
    W's fill the tail where 1F1B idles. Bubble (P−1)(t_F+t_I−t_W) instead of (P−1)(t_F+t_B)."""
    warmup = min(P - rank - 1, m)
    actions = [Action("F", i, rank) for i in range(warmup)]  # warm-up, as 1F1B
    deferred = deque()

    def input_grad(i):
        actions.append(Action("I", i, rank))
        deferred.append(i)
        if len(deferred) > rank:
            actions.append(Action("W", deferred.popleft(), rank))

    for i in range(m - warmup):  # steady: F, I (and a W once r are deferred)
        actions.append(Action("F", warmup + i, rank))
        input_grad(i)
    for i in range(m - warmup, m):  # cool-down: I, W
        input_grad(i)
    return actions + [Action("W", i, rank) for i in deferred]  # the deferred W's fill the bubble


BUILDERS = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_1f1b, "zb": zero_bubble_h1}


def build_programs(schedule: str, P: int, m: int, v: int = 1) -> list:
    """Every rank's action list (v applies to `interleaved` only)."""
    v = v if schedule == "interleaved" else 1
    return [BUILDERS[schedule](P, m, rank, v) for rank in range(P)]


# ---------------------------------------------------------------------------------------------------------
# Communication: which messages each action needs and sends, and the order of receives on each channel
# ---------------------------------------------------------------------------------------------------------


class Message(NamedTuple):
    kind: str  # "act": chunk's output, to chunk+1; "grad": gradient of chunk's input, to chunk−1
    mb: int
    chunk: int  # the sending chunk

    def src(self, P: int) -> int:
        return self.chunk % P

    def dst(self, P: int) -> int:
        return (self.chunk + (1 if self.kind == "act" else -1)) % P


def needs(action: Action, n_chunks: int) -> Message | None:
    if action.kind == "F" and action.chunk > 0:
        return Message("act", action.mb, action.chunk - 1)
    if action.kind in "BI" and action.chunk < n_chunks - 1:
        return Message("grad", action.mb, action.chunk + 1)
    return None


def produces(action: Action, n_chunks: int) -> Message | None:
    if action.kind == "F" and action.chunk < n_chunks - 1:
        return Message("act", action.mb, action.chunk)
    if action.kind in "BI" and action.chunk > 0:
        return Message("grad", action.mb, action.chunk)
    return None


class Step(NamedTuple):
    recvs: list  # Messages to post before the action, in the order their sender sends them
    action: Action
    send: Message | None  # posted right after the action (with the next step's receives)
    release: tuple = ()  # this rank's earlier sends to wait on before the action: their buffers are freed


def simulate(programs: list, costs) -> list:
    """Per rank [(action, start, end)]: every action starts once its rank is free and its input has been sent
    (communication free). `costs`: {kind: seconds}, or one such dict per rank. Raises on a deadlock."""
    P = len(programs)
    n_chunks = max(a.chunk for program in programs for a in program) + 1
    costs = costs if isinstance(costs, (list, tuple)) else [costs] * P
    sent_at, clock, nxt = {}, [0.0] * P, [0] * P
    out = [[] for _ in range(P)]
    progress = True
    while progress:
        progress = False
        for rank, program in enumerate(programs):
            while nxt[rank] < len(program):
                action = program[nxt[rank]]
                msg = needs(action, n_chunks)
                if msg is not None and msg not in sent_at:
                    break
                start = max(clock[rank], sent_at.get(msg, 0.0))
                clock[rank] = start + costs[rank][action.kind]
                out[rank].append((action, start, clock[rank]))
                if (sent := produces(action, n_chunks)) is not None:
                    sent_at[sent] = clock[rank]
                nxt[rank], progress = nxt[rank] + 1, True
    stuck = [(rank, str(program[nxt[rank]])) for rank, program in enumerate(programs) if nxt[rank] < len(program)]
    if stuck:
        raise RuntimeError(f"the schedule deadlocks: ranks wait at {stuck}")
    return out


UNIFORM = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}  # backward = 2 forwards, split evenly into I and W


def communication_plan(programs: list, n_chunks: int) -> list:
    """Per rank, [Step]: each action with the receives to post before it and the send after it.

    A receive is posted before the first action that starts after its message was sent in the uniform-cost
    simulation (so its transfer overlaps compute, and it always precedes the action that needs it). Sends on
    a channel happen in order, so the receives are posted in the order the peer sends them; and a message
    posted early was sent, in the simulation, before anything this rank sends later: it cannot wait on it."""
    P = len(programs)
    timelines = simulate(programs, UNIFORM)
    channel = defaultdict(list)  # (src, dst) -> [(send time, message)] in send order
    for src, timeline in enumerate(timelines):
        for action, _, end in timeline:
            if (msg := produces(action, n_chunks)) is not None:
                channel[src, msg.dst(P)].append((end, msg))
    plan, posted_at = [], {}  # posted_at: message -> simulated time its receiver posts the receive
    for rank, timeline in enumerate(timelines):
        posted, steps, clock = defaultdict(int), [], 0.0
        for action, start, end in timeline:
            recvs = []
            for src in range(P):
                queue = channel[src, rank]
                while posted[src] < len(queue) and queue[posted[src]][0] <= start:
                    recvs.append(queue[posted[src]][1])
                    posted_at[recvs[-1]] = clock  # posted when the previous action ends
                    posted[src] += 1
            steps.append(Step(recvs, action, produces(action, n_chunks)))
            clock = end
        plan.append(steps)
    # Release points: a send is waited (its buffer freed) before the first action that starts after its
    # receiver posted the receive, in posting order (a wait never passes an earlier send), and not before the
    # action it was posted with (its transfer overlaps that one's compute). Every event such a wait needs then
    # precedes it in simulated time (a post at t needs only waits before t), so the waits form no cycle,
    # whatever the real costs; posting order keeps it so where one wait covers all the earlier ops (NCCL's
    # in-order stream). Sends still unreleased are waited at the end of the step.
    for steps, timeline in zip(plan, timelines):
        unreleased = deque()
        for j, (_, start, _) in enumerate(timeline):
            release = []
            while unreleased and posted_at[unreleased[0]] <= start:
                release.append(unreleased.popleft())
            steps[j] = steps[j]._replace(release=tuple(release))
            if j > 0 and steps[j - 1].send is not None:
                unreleased.append(steps[j - 1].send)  # posted at step j, released from step j + 1 on
    return plan


def live_sends(steps: list) -> int:
    """Peak number of this rank's sent buffers alive at once: counted when a batch is posted (the new send
    included), a send dies at its release point, or at the step's end."""
    live = peak = 0
    for j, step in enumerate(steps):
        if j > 0 and steps[j - 1].send is not None:
            live += 1  # posted with this step's receives
        peak = max(peak, live)
        live -= len(step.release)
    last = 1 if steps and steps[-1].send is not None else 0  # posted after the last action
    return max(peak, live + last)


def last_backwards(steps: list) -> set:
    """The actions after which a chunk's gradients are final: its last B, or its last I and last W."""
    last = {}
    for step in steps:
        if step.action.kind != "F":
            last[(step.action.chunk, step.action.kind)] = step.action
    return set(last.values())


# ---------------------------------------------------------------------------------------------------------
# ZB's W: linears whose backward leaves the weight gradient for later
# ---------------------------------------------------------------------------------------------------------


class _LinearInputGradOnly(torch.autograd.Function):
    """y = x·Aᵀ + b with A, b detached: autograd reaches the parameters only through `WeightGradStore.apply`.
    Backward returns dL/dx and hands the store the weight gradient (x and dL/dy): for a later W inside an I,
    at once elsewhere."""

    @staticmethod
    def forward(ctx, x, weight, bias, linear, store):
        ctx.save_for_backward(x, weight)
        ctx.linear, ctx.store = linear, store
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        ctx.store.defer(functools.partial(_linear_weight_grads, ctx.linear, x, grad_out))
        return grad_out.matmul(weight), None, None, None, None


def _linear_weight_grads(linear: nn.Linear, x, grad_out) -> list:
    """A plain linear's W: [(A, dL/dyᵀ·x), (b, Σ dL/dy)] over the tokens."""
    grad_out = grad_out.reshape(-1, grad_out.shape[-1])
    pairs = [(linear.weight, grad_out.t().matmul(x.reshape(-1, x.shape[-1])))]
    return pairs + ([(linear.bias, grad_out.sum(0))] if linear.bias is not None else [])


def _deferred_linear_forward(linear: nn.Linear, store, x):
    weight, bias, device = linear.weight, linear.bias, x.device.type
    if not (torch.is_grad_enabled() and x.requires_grad):
        return F.linear(x, weight, bias)  # no backward through x would reach the deferred weight gradient
    if torch.is_autocast_enabled(device):  # cast as autocast would, then run the Function outside it
        dtype = torch.get_autocast_dtype(device)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    bias = bias.detach() if bias is not None else None
    with torch.autocast(device, enabled=False):
        return _LinearInputGradOnly.apply(x, weight.detach(), bias, linear, store)


class WeightGradStore:
    """The W half of ZB's backward: the weight gradients linears hand over during an I, applied later.

    One protocol for every linear: its backward calls `defer(weight_grads)` with a callable returning
    [(parameter, gradient)]; a plain nn.Linear does it through the forward `install` gives it, a linear that
    `defers_weight_grad` by itself (fp8.Fp8Linear: its callable keeps the FP8 dY and X) reads
    `weight_grad_store`."""

    def __init__(self):
        self.captured = None  # a list while an I runs

    def install(self, module: nn.Module) -> None:
        """Point every nn.Linear inside `module` at this store (idempotent); give those that do not defer by
        themselves the deferring forward."""
        for linear in module.modules():
            if isinstance(linear, nn.Linear) and getattr(linear, "weight_grad_store", None) is not self:
                linear.weight_grad_store = self
                if not getattr(linear, "defers_weight_grad", False):
                    linear.forward = functools.partial(_deferred_linear_forward, linear, self)

    @contextmanager
    def capture(self):
        self.captured = entries = []
        try:
            yield entries
        finally:
            self.captured = None

    def defer(self, weight_grads) -> None:
        """A backward's weight gradients (a callable → [(parameter, gradient)]): kept for W inside an I,
        accumulated at once elsewhere."""
        if self.captured is not None:
            self.captured.append(weight_grads)
        else:
            self.apply([weight_grads])

    @staticmethod
    def apply(entries: list) -> None:
        """W: compute the entries' gradients and let autograd accumulate them (so layout hooks fire)."""
        pairs = [pair for weight_grads in entries for pair in weight_grads()]
        if pairs:
            torch.autograd.backward([p for p, _ in pairs], [g.to(p.dtype) for p, g in pairs])


# ---------------------------------------------------------------------------------------------------------
# The interpreter
# ---------------------------------------------------------------------------------------------------------


class PipelineSchedule:
    """The step's schedule object (step.GradientAccumulation's protocol), for one pp rank."""

    measured_forward = "one (micro-batch, chunk) forward on this stage"  # what saved_activation_bytes covers

    def __init__(self, name: str, P: int, v: int, pp_rank: int, n_layer: int, group=None, peers=None,
                 seq_divisor: int = 1, sync_last_backward: bool = True):
        self.name, self.P, self.rank, self.group = name, P, pp_rank, group
        self.v = v if name == "interleaved" else 1
        self.n_chunks = self.P * self.v
        self.chunk_layers = split_layers(n_layer, self.n_chunks)  # chunk c's layers; pp rank c mod P holds it
        self.peers = list(peers) if peers is not None else list(range(P))  # global rank of each pp index
        self.seq_divisor = seq_divisor  # T under sequence parallel: a stage boundary carries s/T tokens
        self.sync_last_backward = sync_last_backward
        self.store = WeightGradStore() if name == "zb" else None
        self.measure_activations = False  # set it: the next step measures its first forward's saved bytes
        self.saved_activation_bytes = None  # bytes autograd saved for one (micro-batch, chunk) forward
        self.timings = deque(maxlen=64)  # recent steps: (wall s, busy s, {kind: [durations]}, first step?)
        self.events = []  # the last step's timeline: compute and p2p events (seconds from its start)
        self._plans = {}

    def programs(self, m: int) -> list:
        return build_programs(self.name, self.P, m, self.v)

    def describe(self, m: int) -> str:
        return (f"pipeline {self.name} over P={self.P}" + (f" × v={self.v}" if self.v > 1 else "") + f", m={m}:"
                f" bubble predicted {bubble_formula(self.name, self.P, m, self.v):.1%} = {BUBBLE_TEXT[self.name]}")

    def plan(self, m: int) -> list:
        if m not in self._plans:
            self._plans[m] = communication_plan(self.programs(m), self.n_chunks)[self.rank]
        return self._plans[m]

    def forward_backward(self, layout, model, batches, global_tokens, loss_scale: float, aux_divisor: int,
                         autocast, device):
        """Run this rank's actions over the m micro-batches; returns step.MicroBatchLoss (Σ CE on every rank)."""
        from step import MicroBatchLoss

        if self.store is not None:
            self.store.install(model)
        steps = self.plan(len(batches))
        synced = last_backwards(steps) if self.sync_last_backward else set()
        run = _StepState(model, batches, global_tokens, loss_scale, aux_divisor, autocast, device)
        # Stage boundaries carry the parameter dtype (the residual stream's, usually): a layer whose output is
        # wider (an FP8 linear's, say) is cast to it on the way, so every receive knows its size in advance.
        dtype = run.boundary_dtype = next(model.parameters()).dtype
        received, sent, pending, events = {}, {}, [], []  # sent: message -> its send's work, until released
        clock = StepClock(cuda=run.device.type == "cuda")
        for step in steps:
            self._post(pending, [(self._recv_op(msg, run, dtype), msg) for msg in step.recvs], received, sent,
                       events, clock)
            action, incoming, pending = step.action, None, []
            if (msg := needs(action, self.n_chunks)) is not None:
                incoming, work = received.pop(msg)
                t0 = clock.host()
                work.wait()
                events.append(dict(cat="p2p", name=f"wait {msg.kind} {msg.mb}.{msg.chunk}", start=t0, end=clock.host()))
            for msg in step.release:  # its receiver has posted the receive (communication_plan): frees the buffer
                sent.pop(msg).wait()
            measuring = self.measure_activations and action.kind == "F"
            saved = mfu.SavedActivations(exclude=list(model.parameters())) if measuring else nullcontext()
            clock.begin()
            with nullcontext() if action in synced else layout.no_sync(), saved:
                outgoing = getattr(self, "_" + action.kind)(run, action, incoming)
            clock.end(action)
            if measuring:
                self.saved_activation_bytes, self.measure_activations = saved.bytes, False
            if step.send is not None:
                peer = self.peers[step.send.dst(self.P)]
                pending = [(dist.P2POp(dist.isend, outgoing.contiguous(), peer, self.group), step.send)]
            outgoing = incoming = None  # a sent buffer lives in its op and work only, until its release
        self._post(pending, [], received, sent, events, clock)
        for work in sent.values():  # sends whose receivers post after this rank's last action starts
            work.wait()
        wall, spans = clock.finish()  # on CUDA the events are read here, once
        busy = defaultdict(list)
        for action, t0, t1 in spans:
            busy[action.kind].append(t1 - t0)
            events.append(dict(cat="compute", name=str(action), kind=action.kind, mb=action.mb, chunk=action.chunk,
                               start=t0, end=t1))
        self.timings.append((wall, sum(map(sum, busy.values())), dict(busy), not self.timings))
        self.events = events
        if self.P > 1:
            dist.all_reduce(run.loss_sum, op=dist.ReduceOp.SUM, group=self.group)  # 8 bytes: Σ CE everywhere
        return MicroBatchLoss(run.loss_sum, run.aux_totals)

    @torch.no_grad()
    def forward_only(self, layout, model, batches, autocast, device):
        """Evaluation: (Σ loss, Σ tokens) of the micro-batches through every stage, on every rank of the pp
        group (one forward at a time, blocking p2p: chunk c's rank receives from chunk c−1's, no cycle)."""
        totals = torch.zeros(2, dtype=torch.float64, device=device)
        for x, y, *rest in batches:
            pos = rest[0].to(device) if rest and rest[0] is not None else None
            with autocast:
                out = self.through_stages(model, lambda m, h: m.embed(x.to(device), pos),
                                          lambda m, h: m.head_loss(h, y.to(device)), device)
            if out is not None:
                totals += torch.stack([out[1].double(), out[2].double()])
        dist.all_reduce(totals, group=self.group)  # the last stage's numbers, everywhere
        return totals[0], totals[1]

    def through_stages(self, model, embed, head, device):
        """One forward through all chunks in order; returns head(...) on the last chunk's rank, else None.
        Nothing backpropagates here: the auxiliary-loss terms the blocks add are dropped as they come."""
        h = None
        for chunk in range(self.n_chunks):
            if chunk % self.P != self.rank:
                continue
            if chunk == 0:
                h = embed(model, None)
            else:
                h = _recv_blocking(self.peers[(chunk - 1) % self.P], self.group, device,
                                   next(model.parameters()).dtype)
            h = model.forward_blocks(h, self.chunk_layers[chunk])
            model.aux_losses.clear()  # else every evaluated batch and sampled token would keep its terms
            if chunk < self.n_chunks - 1:  # in the parameter dtype, as the receive expects
                _send_blocking(h.to(next(model.parameters()).dtype), self.peers[(chunk + 1) % self.P], self.group)
        return head(model, h) if (self.n_chunks - 1) % self.P == self.rank else None

    # --- p2p ------------------------------------------------------------------------------------------------

    def _recv_op(self, msg: Message, run, dtype):
        x = run.batches[msg.mb][0]
        shape = (x.shape[0], x.shape[1] // self.seq_divisor, run.model.config.n_embd)
        buffer = torch.empty(shape, dtype=dtype, device=run.device)
        return dist.P2POp(dist.irecv, buffer, self.peers[msg.src(self.P)], self.group)

    def _post(self, sends: list, recvs: list, received: dict, sent: dict, events: list, clock) -> None:
        """ONE batch_isend_irecv of the sends, then the receives, each [(op, message)]: a receive's (buffer, work)
        goes to `received` (waited before use), a send's work to `sent` (waited at its release point)."""
        ops = [op for op, _ in sends + recvs]
        if not ops:
            return
        t0 = clock.host()
        works = dist.batch_isend_irecv(ops)
        events.append(dict(cat="p2p", name=f"post {len(ops)}", start=t0, end=clock.host(),
                           bytes=sum(op.tensor.numel() * op.tensor.element_size() for op in ops)))
        if len(works) != len(ops):  # NCCL coalesces a batch into one work
            works = [works[0]] * len(ops)
        for (_, msg), work in zip(sends, works):
            sent[msg] = work
        for (op, msg), work in zip(recvs, works[len(sends):]):
            received[msg] = (op.tensor, work)

    # --- the computations -------------------------------------------------------------------------------------

    def _F(self, run, action: Action, received):
        model, layers = run.model, self.chunk_layers[action.chunk]  # this rank's GPT holds all its chunks
        x, y, *rest = run.batches[action.mb]  # (x, y) or (x, y, pos)
        first, last = action.chunk == 0, action.chunk == self.n_chunks - 1
        model.aux_losses.clear()
        with run.autocast:
            if first:  # only the first chunk reads the tokens (and positions), only the last the targets
                inp, pos = None, rest[0] if rest else None
                pos = None if pos is None else pos.to(run.device)
                h = model.forward_blocks(model.embed(x.to(run.device, non_blocking=True), pos), layers)
            else:
                inp = received.requires_grad_()
                h = model.forward_blocks(inp, layers)
            if last:
                _, loss_sum, _ = model.head_loss(h, y.to(run.device, non_blocking=True))
        aux = model.aux_losses.weighted_sum()
        for name, value in model.aux_losses.values().items():
            run.aux_totals[name] = run.aux_totals.get(name, 0.0) + value
        if last:
            objective = loss_sum / run.global_tokens
            if aux is not None:
                objective = objective + aux / run.aux_divisor
            run.saved[action.mb, action.chunk] = (inp, [objective * run.loss_scale])
            run.loss_sum += loss_sum.detach().double()
            return None
        roots = [h] if aux is None else [h, aux / run.aux_divisor * run.loss_scale]
        run.saved[action.mb, action.chunk] = (inp, roots)
        return h.detach().to(run.boundary_dtype)

    def _B(self, run, action: Action, grad):
        inp, roots = run.saved.pop((action.mb, action.chunk))
        grads = None if grad is None else [grad.to(roots[0].dtype)] + [None] * (len(roots) - 1)
        torch.autograd.backward(roots, grads)
        return None if inp is None else inp.grad

    def _I(self, run, action: Action, grad):
        with self.store.capture() as entries:
            grad_input = self._B(run, action, grad)
        run.deferred[action.mb, action.chunk] = entries
        return grad_input

    def _W(self, run, action: Action, _):
        self.store.apply(run.deferred.pop((action.mb, action.chunk)))


def _send_blocking(h: torch.Tensor, peer: int, group) -> None:
    """Shape first (3 int64), then the tensor: forward-only passes need no shape agreed in advance."""
    for tensor in (torch.tensor(h.shape, dtype=torch.int64, device=h.device), h.contiguous()):
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, peer, group)]):
            work.wait()


def _recv_blocking(peer: int, group, device, dtype) -> torch.Tensor:
    shape = torch.empty(3, dtype=torch.int64, device=device)
    for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, shape, peer, group)]):
        work.wait()
    h = torch.empty(tuple(shape.tolist()), dtype=dtype, device=device)
    for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, h, peer, group)]):
        work.wait()
    return h


class StepClock:
    """Times one step's actions (seconds from the step's start). CPU: perf_counter. CUDA: an event recorded on
    the compute stream before and after each action, all read once at the end of the step; a device-wide
    synchronize after each action would also wait on receives posted for later actions, charged as compute."""

    def __init__(self, cuda: bool):
        self.cuda, self.origin, self.spans = cuda, time.perf_counter(), []  # spans: (action, mark, mark)
        self.first = self._mark()

    def host(self) -> float:
        """Host seconds since the step began (the p2p posts and waits: on CUDA, when they were issued)."""
        return time.perf_counter() - self.origin

    def _mark(self):
        if not self.cuda:
            return self.host()
        event = torch.cuda.Event(enable_timing=True)
        event.record()  # on the current stream: the one the actions compute on
        return event

    def begin(self) -> None:
        self.opened = self._mark()

    def end(self, action: Action) -> None:
        self.spans.append((action, self.opened, self._mark()))

    def finish(self) -> tuple:
        """(wall seconds of the step, [(action, start, end)])."""
        last = self._mark()
        if not self.cuda:
            return last, self.spans
        last.synchronize()  # this step's last event: every earlier one on the stream has completed
        seconds = lambda event: self.first.elapsed_time(event) / 1e3  # noqa: E731 (elapsed_time is in ms)
        return seconds(last), [(action, seconds(a), seconds(b)) for action, a, b in self.spans]


class _StepState:
    """What one step's actions share: the inputs, the stashed graphs between F and B/I, the loss."""

    def __init__(self, model, batches, global_tokens, loss_scale, aux_divisor, autocast, device):
        self.model, self.batches, self.global_tokens = model, batches, global_tokens
        self.loss_scale, self.aux_divisor, self.autocast = loss_scale, aux_divisor, autocast
        self.device = torch.device(device)
        self.saved, self.deferred, self.aux_totals = {}, {}, {}
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)


# ---------------------------------------------------------------------------------------------------------
# Wiring: flags, the stages, the tied embedding, the handle
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PipelineConfig:
    """--pp P, --pp-schedule, --pp-virtual v (interleaved only), --trace-file: validated by config_from_flags."""

    size: int  # P
    schedule: str = "1f1b"
    virtual: int = 1  # v: chunks per rank (1 unless interleaved)
    trace_file: str | None = None


def config_from_flags(args, settings) -> PipelineConfig | None:
    """The pipeline's flags on this mesh, or ValueError naming the flag (before any process group)."""
    P, schedule, m, n_layer = args.pp, args.pp_schedule, settings.micro_batches, settings.model.n_layer
    if P == 1:
        return None
    if args.zero >= 2:
        raise ValueError(f"--zero {args.zero} with --pp {P}: refused. Stage 2 reduces each backward's gradient"
                         f" bucket, but a pipeline backward brings one chunk's gradients of one micro-batch at a time,"
                         f" interleaved with other micro-batches; stage 3 gathers weights in the layout's forward,"
                         f" which the schedule bypasses. Use --zero 1 (or 0)")
    v = args.pp_virtual if schedule == "interleaved" else 1
    if schedule == "interleaved" and v < 2:
        raise ValueError(f"--pp-virtual {v}: interleaved 1F1B needs at least 2 chunks per rank (one chunk per rank"
                         f" is --pp-schedule 1f1b)")
    if m < P:
        raise ValueError(f"--pp {P} needs at least {P} micro-batches per step (one in flight per stage), but this run"
                         f" has m = {m} = global batch / (D × --micro-batch): raise --global-batch or lower --micro-batch")
    chunks = P * v
    if n_layer < chunks:
        raise ValueError(f"--pp {P}" + (f" × --pp-virtual {v}" if chunks > P else "") + f" makes {chunks} pipeline"
                         f" chunks, but the model has only n_layer={n_layer} layers (at least one per chunk)")
    if schedule == "interleaved" and n_layer % chunks:
        raise ValueError(f"--pp-schedule interleaved: n_layer={n_layer} must be divisible by --pp {P} × --pp-virtual"
                         f" {v} = {chunks} (equal chunks keep the interleaved slots equal)")
    return PipelineConfig(P, schedule, v, args.trace_file)


def stage_of(config: PipelineConfig | None, run) -> dict:
    """What this rank builds (a stage never allocates the others' blocks): GPT(config, **stage_of(...)).
    {} without a pipeline; else its chunks' layers, the embeddings on chunk 0's rank, the head on the last's."""
    if config is None:
        return {}
    return stage_kwargs(run.config.n_layer, run.mesh.index("pp"), config.size, config.virtual)


def stage_kwargs(n_layer: int, pp_rank: int, P: int, v: int = 1) -> dict:
    chunks = rank_chunks(pp_rank, P, v)
    layers = [layer for chunk in chunks for layer in stage_layers(n_layer, P, v, chunk)]
    return dict(layers=layers, embedding=0 in chunks, head=P * v - 1 in chunks)


def build_stages(config: GPTConfig, seed: int = 0, dtype: torch.dtype = torch.float32, device=None, pp_rank: int = 0,
                 P: int = 1, v: int = 1) -> GPT:
    """Pipeline rank `pp_rank`'s model: one model.GPT holding its chunks' blocks (first chunk: + embeddings,
    last: + ln_f and head), built alone."""
    return GPT(config, seed, dtype, device, **stage_kwargs(config.n_layer, pp_rank, P, v))


def tied_copies(model: GPT, n_chunks: int) -> list:
    """This rank's copy of the embedding tied to the head (the first or the last chunk holds one)."""
    if n_chunks == 1:
        return []
    return [p for p in model.parameters() if p.shard_info.global_name == TIED]


def mark_tied_copies(model: GPT, n_chunks: int) -> None:
    """Both copies are replicas over pp: coordinate 0's counts (norm, Ψ, checkpoint). PP is applied after TP
    (DESIGN's order), so this marks TP's vocabulary shard when TP swapped the parameter."""
    for p in tied_copies(model, n_chunks):
        p.shard_info = p.shard_info.replicated_also_over("pp")


def apply(model: GPT, run, config: PipelineConfig):
    """The axis for train.py: the stage model was built by stage_of(config, run); this adds the schedule and
    the marks on the tied copies."""
    mesh, v = run.mesh, config.virtual
    sp = mesh.size("tp") if run.settings.sequence_parallel else 1  # a boundary carries s/C (÷T under SP) tokens
    tied_group = mesh.group("pp_tied") if mesh.size("pp_tied") > 1 else None  # first and last stage
    schedule = PipelineSchedule(config.schedule, config.size, v, mesh.index("pp"), run.config.n_layer,
                                mesh.group("pp"), mesh.members["pp"], seq_divisor=sp)
    mark_tied_copies(model, schedule.n_chunks)
    writes_trace = all(index == 0 for axis, index in mesh.coordinates().items() if axis not in ("pp", "pp_tied"))
    return Pipeline(model, schedule, run.micro_batch_size, run.settings.local_seq_len, run.micro_batches,
                    tied_group, config.trace_file if writes_trace else None)


def build(run, config: PipelineConfig, dtype: torch.dtype = torch.float32, transform=None):
    """(stage model, Pipeline) for tests and benchmarks: build this rank's stage, `transform(model)` (TP's
    parallelize, CP's swap: the axes before PP), then apply."""
    model = GPT(run.config, run.seed, dtype, run.device, **stage_of(config, run))
    if transform is not None:
        transform(model)
    return model, apply(model, run, config)


class Pipeline(Axis):
    """The axis handle: the schedule, the tied-embedding sum, evaluation and sampling through the stages,
    the accounting.

    seq_len: tokens of a micro-batch row that cross a stage boundary on this rank (÷C under CP, ÷T under SP).
    """

    name = "pp"

    def __init__(self, model: GPT, schedule: PipelineSchedule, micro: int, seq_len: int,
                 micro_batches: int, tied_group=None, trace_file: str | None = None):
        self.model, self.schedule, self.config = model, schedule, model.config
        self.micro, self.seq_len, self.m = micro, seq_len, micro_batches
        self.tied_group, self.trace_file = tied_group, trace_file
        self.summed_over = None  # the layout of the last tied-embedding sum (after_grad_sync)

    @contextmanager
    def sampling(self):
        """model.generate on a stage: its forward runs through every stage and the last stage's logits (of the
        last position) reach every pp rank (one all-reduce, zeros elsewhere), so all ranks sample alike."""
        model, schedule = self.model, self.schedule

        def forward(idx, targets=None, pos=None):
            device, dtype = idx.device, next(model.parameters()).dtype
            logits = schedule.through_stages(model, lambda m, h: m.embed(idx, pos), lambda m, h: m.head_loss(h)[0],
                                             device)
            if logits is None:
                logits = torch.zeros(idx.shape[0], 1, self.config.vocab_size, dtype=dtype, device=device)
            dist.all_reduce(logits, group=schedule.group)
            return logits, None, None

        model.forward = forward  # an instance attribute: nn.Module.__call__ finds it first
        try:
            yield
        finally:
            del model.forward

    @torch.no_grad()
    def after_grad_sync(self, layout) -> None:
        """Sum the tied embedding's gradient over {first, last} stage (after the data-parallel reduction)."""
        self.summed_over = layout  # the end lines predict the tied sum's payload from it, as it was sent
        copies = tied_copies(self.model, self.schedule.n_chunks)
        if self.tied_group is None or not copies:
            return
        # Whole under DDP. Under ZeRO-1, this rank's segments: the layout must give the first and the last stage
        # the same element ranges of this tensor (e.g. a unit of its own), or the sum adds unrelated elements.
        sum_in_place(layout.grad_pieces(copies), self.tied_group)

    # --- accounting -------------------------------------------------------------------------------------------

    def message_bytes(self) -> int:
        """One stage-boundary message: a micro-batch's hidden states or their gradient, b·s·h·e."""
        return self.micro * self.seq_len * self.config.n_embd * next(self.model.parameters()).element_size()

    def predicted_messages(self, layout=None) -> dict:
        """This rank's messages per step, {(op, group name): (calls, payload bytes)}. With `layout`, the tied
        sum's payload is its grad_pieces (a ZeRO-1 shard), else the whole copy."""
        steps, size = self.schedule.plan(self.m), self.message_bytes()
        sends, recvs = sum(s.send is not None for s in steps), sum(len(s.recvs) for s in steps)
        out = {key: value for key, value in {("all_reduce", "pp"): (1, 8), ("send", "pp"): (sends, sends * size),
                                             ("recv", "pp"): (recvs, recvs * size)}.items() if value[0]}
        copies = tied_copies(self.model, self.schedule.n_chunks)
        if self.tied_group is not None and copies:
            pieces = layout.grad_pieces(copies) if layout is not None else copies
            if pieces:  # a ZeRO-1 shard may hold none of it (and then neither does its peer)
                out["all_reduce", "pp_tied"] = (1, sum(t.numel() * t.element_size() for t in pieces))
        return out

    def startup_lines(self) -> list:
        from mfu import activation_bytes_per_layer, format_bytes

        c, s, m = self.config, self.schedule, self.m
        lines = [f"pipeline {s.name}: P={s.P} stages" + (f" × v={s.v} chunks" if s.v > 1 else "") + f", m={m}"
                 f" micro-batches; bubble predicted {bubble_formula(s.name, s.P, m, s.v):.1%} = {BUBBLE_TEXT[s.name]}"
                 f" (uniform costs)"]
        lines += split_lines(c, s.P, s.v)
        per_layer = (4 * self.seq_len * self.micro * c.n_embd if c.activation_checkpointing else
                     activation_bytes_per_layer(self.seq_len, self.micro, c.n_embd, c.n_head))
        layers = len(stage_layers(c.n_layer, s.P, s.v, s.rank))
        peak, stash = in_flight(s.programs(m)[s.rank])
        lines.append(f"  in flight on pp rank {s.rank}: {peak} chunk-micro-batches ({IN_FLIGHT_TEXT[s.name]}) ×"
                     f" {layers} layers × {format_bytes(per_layer)} (16-bit, Korthikanti) ="
                     f" {format_bytes(peak * layers * per_layer)} of activations"
                     + (f", and up to {stash} W stashes of ≈16·b·s·h per layer" if s.name == "zb" else ""))
        pairs = ", ".join(f"{a}→{b}: {n}" for (a, b), n in sorted(p2p_counts(s.programs(m), s.n_chunks).items()))
        lines.append(f"  p2p per step, messages of b·s·h·e = {format_bytes(self.message_bytes())} per stage pair: {pairs}")
        return lines

    def end_lines(self, tracer, steps: int) -> list:
        """Measured against predicted. COLLECTIVE over the pp group (it gathers every rank's timings): call it
        on every rank. pp rank 0 writes the Chrome trace when the handle has a trace file."""
        from mfu import format_bytes

        s = self.schedule
        timed = [t for t in s.timings if not t[3]] or list(s.timings)  # the first step warms up
        durations = defaultdict(list)
        for _, _, by_kind, _ in timed:
            for kind, values in by_kind.items():
                durations[kind] += values
        bubble = 1 - sum(busy / wall for wall, busy, _, _ in timed) / len(timed) if timed else float("nan")
        mine = dict(bubble=bubble, events=s.events,
                    costs={kind: sum(values) / len(values) for kind, values in durations.items()})
        ranks = [None] * s.P
        dist.all_gather_object(ranks, mine, group=s.group)
        simulated = bubble_of(simulate(s.programs(self.m), [r["costs"] for r in ranks]))
        why = bubble_note([r["costs"] for r in ranks], sum(simulated) / s.P, ranks_on_node(), torch.get_num_threads(),
                          os.cpu_count(), cpu=not next(self.model.parameters()).is_cuda)
        lines = [f"pipeline {s.name} P={s.P} m={self.m}: bubble predicted {bubble_formula(s.name, s.P, self.m, s.v):.1%}"
                 f" ({BUBBLE_TEXT[s.name]}), simulated with the measured costs {sum(simulated) / s.P:.1%}, measured"
                 f" per rank " + " ".join(f"{r['bubble']:.1%}" for r in ranks) + f" (mean of {len(timed)} steps)"
                 + (f"\n  {why}" if why else ""),  # the end line and, printed under it, why they differ
                 "  mean action time per rank (ms): " + "; ".join(
                     f"pp{i} " + " ".join(f"{k} {t * 1e3:.2f}" for k, t in sorted(r["costs"].items()))
                     for i, r in enumerate(ranks))]
        records = tracer.records if tracer is not None else {}
        for (op, group), (calls, payload) in sorted(self.predicted_messages(self.summed_over).items()):
            rec = records.get((op, group))
            traced = f"{rec.calls / steps:g} × = {format_bytes(rec.payload_bytes / steps)}" if rec else "not traced"
            lines.append(f"  {op:<10} {group:<8} per step predicted {calls} × = {format_bytes(payload)}, traced {traced}")
        lines += ["  one executed step (the last), per pp rank:"] + ascii_timeline([r["events"] for r in ranks])
        if self.trace_file and s.rank == 0:
            write_chrome_trace(self.trace_file, [r["events"] for r in ranks])
            lines.append(f"  Chrome trace of that step written to {self.trace_file} (Perfetto, chrome://tracing)")
        if next(self.model.parameters()).is_cuda:
            lines.append(f"  measured peak memory on this rank: {format_bytes(torch.cuda.max_memory_allocated())}")
        return lines


# ---------------------------------------------------------------------------------------------------------
# Accounting: formulas, the comm-free simulation, the pictures
# ---------------------------------------------------------------------------------------------------------

BUBBLE_TEXT = {"gpipe": "(P−1)/(m+P−1)", "1f1b": "(P−1)/(m+P−1)", "interleaved": "(P−1)/(v·m+P−1)",
               "zb": "(P−1)·max(F, F+I−W)/(m(F+I+W) + (P−1)·max(F, F+I−W))"}
IN_FLIGHT_TEXT = {"gpipe": "m", "1f1b": "min(P−r, m)", "zb": "min(P−r, m)",
                  "interleaved": "min(2(P−r−1) + (v−1)(P + m mod P) + 1, v·m)"}


def bubble_formula(schedule: str, P: int, m: int, v: int = 1, costs: tuple = (1.0, 1.0, 1.0)) -> float:
    """Idle fraction of a step by the closed forms (costs (t_F, t_I, t_W) for zb)."""
    if schedule in ("gpipe", "1f1b"):
        return (P - 1) / (m + P - 1)
    if schedule == "interleaved":
        return (P - 1) / (v * m + P - 1)
    t_f, t_i, t_w = costs
    idle = (P - 1) * max(t_f, t_f + t_i - t_w)
    return idle / (m * (t_f + t_i + t_w) + idle)


def bubble_note(costs: list, simulated: float, ranks: int, threads: int, cores: int | None, cpu: bool = True,
                tolerance: float = 0.1) -> str:
    """Why a measured bubble differs from the formula, for the reasons a run can see ("" when none holds):
    its ranks time-share the node's cores (on CPU), or the measured action costs (per rank {kind: seconds})
    are not the uniform ones the formula assumes (F equal on every stage, B = 2F, I = W = F)."""
    reasons = []
    if cpu and cores and ranks * threads > cores:
        reasons.append(f"{ranks} ranks × {threads} thread{'s' * (threads > 1)} share {cores} cores, so ranks take"
                       f" turns on them: an action's time includes waiting for a core, and its peers wait on it")
    uneven, forwards = [], [c["F"] for c in costs if c.get("F")]
    if len(forwards) == len(costs) and max(forwards) > (1 + tolerance) * min(forwards):
        uneven.append(f"F differs {max(forwards) / min(forwards):.2f}× between stages")
    for kind in ("B", "I", "W"):
        ratios = [c[kind] / c["F"] for c in costs if kind in c and c.get("F")]
        uniform = UNIFORM[kind] / UNIFORM["F"]
        if any(abs(ratio / uniform - 1) > tolerance for ratio in ratios):
            uneven.append(f"{kind}/F {min(ratios):.2f}..{max(ratios):.2f}, uniform {uniform:g}")
    if uneven:
        reasons.append("the measured costs are not the uniform ones (" + "; ".join(uneven) + "), so ranks also"
                       " wait on slower peers")
    if not reasons:
        return ""
    return ("why the measured bubble differs: " + "; ".join(reasons) + ". The figure comparable with the"
            f" prediction is the simulation with the measured costs, {simulated:.1%}")


def ranks_on_node() -> int:
    """Processes on this node: torchrun's LOCAL_WORLD_SIZE, else every rank (one node, as the tests run)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or dist.get_world_size()


def in_flight(program: list) -> tuple:
    """(peak micro-batch-chunks between F and B/I, peak stashes between I and W) of one rank's list."""
    live = stash = peak = peak_stash = 0
    for action in program:
        live += {"F": 1, "B": -1, "I": -1}.get(action.kind, 0)
        stash += {"I": 1, "W": -1}.get(action.kind, 0)
        peak, peak_stash = max(peak, live), max(peak_stash, stash)
    return peak, peak_stash


def p2p_counts(programs: list, n_chunks: int) -> dict:
    """{(src pp rank, dst pp rank): messages per step}."""
    counts = defaultdict(int)
    for program in programs:
        for action in program:
            if (msg := produces(action, n_chunks)) is not None:
                counts[msg.src(len(programs)), msg.dst(len(programs))] += 1
    return dict(counts)


def stage_params(config: GPTConfig, P: int, v: int = 1) -> list:
    """Parameters each pp rank holds (the tied copy counted on both the first and the last)."""
    h, bias = config.n_embd, int(config.bias)
    per_layer = 12 * h * h + (2 + 2 * bias) * h + bias * 9 * h  # linears, 2 LayerNorms, linear biases
    out = []
    for rank in range(P):
        total = 0
        for chunk in rank_chunks(rank, P, v):
            total += len(stage_layers(config.n_layer, P, v, chunk)) * per_layer
            total += (config.vocab_size + config.block_size) * h if chunk == 0 else 0
            total += (config.vocab_size * h + (1 + bias) * h) if chunk == P * v - 1 else 0
        out.append(total)
    return out


def split_lines(config: GPTConfig, P: int, v: int = 1) -> list:
    """The split, printed: layers and parameters per stage, and a warning when it is uneven."""
    params = stage_params(config, P, v)
    lines = []
    for rank in range(P):
        ranges = [stage_layers(config.n_layer, P, v, c) for c in rank_chunks(rank, P, v)]
        text = " + ".join(f"{r.start}..{r.stop - 1}" for r in ranges)
        extra = (" + embeddings" if rank == 0 else "") + (" + ln_f, head (tied copy)" if rank == P - 1 else "")
        lines.append(f"  stage {rank}: layers {text}{extra}: {params[rank]:,} parameters")
    sizes = [len(r) for r in split_layers(config.n_layer, P * v)]
    if len(set(sizes)) > 1:
        lines.append(f"  WARNING uneven split: {config.n_layer} layers over {P * v} chunks give {max(sizes)} layers to"
                     f" chunks {[c for c, n in enumerate(sizes) if n == max(sizes)]} and {min(sizes)} to the others:"
                     f" the slowest stage sets the pace ({max(sizes) / min(sizes):.2f}× the work)")
    return lines


def bubble_of(timelines: list) -> list:
    """Each rank's idle fraction of the makespan."""
    makespan = max(end for timeline in timelines for _, _, end in timeline)
    return [1 - sum(end - start for _, start, end in timeline) / makespan for timeline in timelines]


def ascii_timeline(events_per_rank: list, width: int = 96) -> list:
    """One row per rank: F/B/I/W (upper case even micro-batches, lower case odd), '.' idle."""
    end = max((e["end"] for events in events_per_rank for e in events), default=0.0) or 1.0
    lines = []
    for rank, events in enumerate(events_per_rank):
        row = ["."] * width
        for e in events:
            if e["cat"] == "compute":
                a = min(width - 1, int(e["start"] / end * width))
                for i in range(a, max(a + 1, min(width, round(e["end"] / end * width)))):
                    row[i] = e["kind"] if e["mb"] % 2 == 0 else e["kind"].lower()
        lines.append(f"  pp{rank} |{''.join(row)}|")
    lines.append(f"  ({end * 1e3:.1f} ms across {width} columns; each rank's clock starts at its step start)")
    return lines


def write_chrome_trace(path: str, events_per_rank: list) -> None:
    """A Chrome-trace JSON: one process per pp rank, a compute thread and a p2p thread."""
    trace = []
    for rank, events in enumerate(events_per_rank):
        trace.append(dict(name="process_name", ph="M", pid=rank, tid=0, args=dict(name=f"pp rank {rank}")))
        for tid, label in ((0, "compute"), (1, "p2p")):
            trace.append(dict(name="thread_name", ph="M", pid=rank, tid=tid, args=dict(name=label)))
        for e in events:
            args = {k: e[k] for k in ("mb", "chunk", "bytes") if k in e}
            trace.append(dict(name=e["name"], cat=e["cat"], ph="X", pid=rank, tid=0 if e["cat"] == "compute" else 1,
                              ts=e["start"] * 1e6, dur=(e["end"] - e["start"]) * 1e6, args=args))
    with open(path, "w") as f:
        json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, f)
