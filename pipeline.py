"""Pipeline parallel: the layers cut into stages, micro-batches flowing through them, raw p2p.

P ranks (the `pp` group) each hold a contiguous range of layers, a stage; the first also the embeddings,
the last ln_f, the head and the loss. A micro-batch's hidden states go forward stage to stage, their
gradient comes back. With `interleaved` the layers are cut into v·P chunks and rank r holds chunks r, r+P,
... (Narayanan et al. 2021). The schedules (gpipe, 1f1b, interleaved, zb) are pure data in `parallel/schedules.py`:
one list of actions per rank (F forward, B backward, I its input-gradient half, W its weight-gradient
half) and a communication plan saying which receives to post before each action and where each send's
buffer is released. ONE interpreter here, `PipelineSchedule.forward_backward`, runs a rank's plan: post
the listed receives and the previous action's send in one `dist.batch_isend_irecv`, wait for the action's
input, wait on the sends the plan releases (their receives are known posted), compute. It keeps no clock: it
tells an observer (`PipelineObserver`, nobody by default) where the step, each action and each p2p call
begin and end, and the accounting subscribes its clock (observers.ActionClock, through `Pipeline.observe`).

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

The loss each micro-batch backpropagates is loss_scale·(loss_sum/global_tokens + Σ coef·aux/(D·m)), as in
step.GradientAccumulation: nothing is rescaled afterwards. A chunk's aux-loss terms are backpropagated with
its output. Data parallel wraps the rank's stage model (DDP or ZeRO): every backward runs under
`layout.no_sync()` except each chunk's last B (zb: last I and last W), so every gradient reaches the
reduction once, overlapped with the cool-down. ZeRO-2/3 (parallel/zero_pipeline.py) keep that contract: a chunk's
gradients are summed over the step and reduce-scattered once, at its last backward; at stage 3 the layout's
`chunk_weights(chunk, next chunk)` is entered around each action (gather, prefetch the next action's, free).

Symbols: L layers, P stages, v chunks per rank, m micro-batches, b micro-batch size, s tokens per row on a
rank (÷C under CP, ÷T under SP), h hidden, V vocabulary, e bytes per activation element (the parameter
dtype: the residual stream stays in it under autocast), A = activation bytes a layer keeps for backward
(memory.activation_bytes_per_layer, s·b·h·(34 + 5·a·s/h) at 16 bits; 2·s·b·h with activation checkpointing).

1. Split: the blocks (L/(vP) per chunk; an uneven split is allowed, with a warning), embeddings (first),
   ln_f + head (last), their gradients and optimizer state, the activations. Replicated: the tied embedding,
   one copy on the first and one on the last stage (both `replicated_over=("pp",)`, coordinate 0 counts);
   they start equal and their gradients are summed over the {first, last} group (`after_grad_sync`).
2. Peak per rank: its parameters (memory.param_counts of its stage_kwargs) × 16 bytes with fp32 AdamW, and
   in-flight × layers per chunk × A, counting chunk-micro-batches between F and B/I:  gpipe m;  1f1b min(P−r, m);
   interleaved min(2(P−r−1) + (v−1)(P + m mod P) + 1, v·m);  zb min(P−r, m), plus ≤ r+1 W stashes.
   Temporary: received activations and gradients, b·s·h·e each; sent ones until their release point
   (`schedules.live_sends` per rank: P−r on 1f1b's rank r, up to m on gpipe's; an F's is its stashed output).
3. Critical path. The bubble (idle fraction of a step; uniform costs, free communication;
   `schedules.simulate` does any per-rank costs):  gpipe, 1f1b (P−1)/(m+P−1);  interleaved (P−1)/(v·m+P−1);
   zb (P−1)·max(t_F, t_F+t_I−t_W) / (m·(t_F+t_I+t_W) + (P−1)·max(t_F, t_F+t_I−t_W)).
   Messages per step: at each of the v·P−1 chunk boundaries m activations forward and m gradients back,
   b·s·h·e bytes each (`send`/`recv` over pp; `schedules.p2p_counts` per stage pair); all_reduce 8 B over
   pp (the loss sum); all_reduce V·h·e (÷T under TP, the shard under ZeRO) over pp_tied, first and last
   stage (`Pipeline.predicted_messages`).
4. Restart state: nothing of its own. Parameters carry global names (`transformer.h.<i>`), so a checkpoint
   reslices onto another P; the tied copy counts on pp coordinate 0 and is written once.

With `--pp-redundant` the lists hold R actions too (Bamboo's forward on the successor's shadow stage): the
interpreter keeps each F's output until the R of its micro-batch takes it and hands R to the shadow it serves
(`serve_redundant`, resilience/redundancy.py, which accounts for it). After a takeover the chunks may be uneven:
`PipelineConfig.bounds` gives their layer boundaries.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from model import GPT
from parallel.schedules import (BUBBLE_TEXT, Action, Message, bubble_formula, build_programs, communication_plan,
                                last_backwards, needs, rank_chunks, split_layers, stage_layers)
from step import Axis, ForwardObserver, Messages, MicroBatchLoss, sum_in_place

TIED = "transformer.wte.weight"

# ---------------------------------------------------------------------------------------------------------
# The interpreter
# ---------------------------------------------------------------------------------------------------------


class PipelineObserver:
    """Who watches the interpreter: each method returns a context around what it names, and does nothing here.
    The accounting subscribes its clock (`Pipeline.observe`; observers.ActionClock times what it is told).
        step(device)          one forward_backward's actions, computed on `device`
        action(action)        one action's compute (a schedules.Action: F, B, I or W of a micro-batch and chunk)
        p2p(name, nbytes)     one host p2p call: "post recv act 3.1, send grad 2.1" (nbytes: the batch's
                              payload), "wait act 3.1" (a receive's), "release grad 2.1" (a send's)
    """

    def step(self, device):
        return nullcontext()

    def action(self, action: Action):
        return nullcontext()

    def p2p(self, name: str, nbytes: int | None = None):
        return nullcontext()


class PipelineSchedule:
    """The step's schedule object (step.GradientAccumulation's protocol), for one pp rank.

    seq_divisor: T under sequence parallel (a stage boundary then carries s/T tokens); observer: who is told
    what the interpreter does (a PipelineObserver: nobody, unless the accounting subscribed)."""

    measured_forward = "one (micro-batch, chunk) forward on this stage"  # what a ForwardObserver surrounds

    def __init__(self, config: PipelineConfig, mesh, n_layer: int, seq_divisor: int = 1):
        self.name, self.P, self.v = config.schedule, config.size, config.virtual
        self.rank, self.group, self.peers = mesh.index("pp"), mesh.group("pp"), list(mesh.members["pp"])
        self.n_chunks, self.redundant = self.P * self.v, config.redundant
        self.chunk_layers = chunk_layers(config, n_layer)  # chunk c's layers; pp rank c mod P holds it
        self.seq_divisor = seq_divisor
        self.observer = PipelineObserver()
        self.store = WeightGradStore() if self.name == "zb" else None
        self.forward_observer = ForwardObserver()  # told of each F action's compute (step.ForwardObserver)
        self._plans = {}
        self.shadow = None  # what runs the R actions (--pp-redundant): resilience/redundancy.py's ShadowStage

    def serve_redundant(self, shadow) -> None:
        """The successor's shadow stage runs this rank's R actions: `shadow.forward(state, action, h)`, h the
        output of this rank's F of the micro-batch (None for chunk 0's R, which reads the tokens)."""
        self.shadow = shadow

    def observe_forwards(self, observer: ForwardObserver) -> None:
        self.forward_observer = observer

    def forward_backward(self, layout, model, batches, global_tokens, loss_scale: float, aux_divisor: int,
                         autocast, device) -> MicroBatchLoss:
        """Run this rank's plan over the m micro-batches; returns step.MicroBatchLoss (Σ CE on every pp rank).
        The batches move to the stage's device (`device`, the protocol's argument, is that one)."""
        if self.store is not None:
            self.store.install(model)
        steps = self.plan(len(batches))
        synced = last_backwards(steps)  # every other backward accumulates under no_sync: each gradient syncs once
        state = _StepState(model, batches, global_tokens, loss_scale, aux_divisor, autocast)
        mail = _Mailbox(self, state)
        weights = getattr(layout, "chunk_weights", None)  # ZeRO-3 gathers an action's chunk (zero_pipeline)
        with self.observer.step(device):
            for j, step in enumerate(steps):
                action = step.action
                following = steps[j + 1].action.chunk if j + 1 < len(steps) else None  # prefetched during this one
                gathered = weights(action.chunk, following) if weights else nullcontext()
                mail.post(step.recvs)  # then the previous action's send: one batch
                incoming = mail.take(needs(action, self.n_chunks))
                mail.release(step.release)  # a message taken shows their receives posted: frees the buffers
                forward = self.forward_observer.forward(model) if action.kind == "F" else nullcontext()
                with self.observer.action(action), nullcontext() if action in synced else layout.no_sync(), forward, \
                        gathered:
                    outgoing = self._compute(state, action, incoming)
                mail.send(step.send, outgoing)  # posted with the next step's receives
                outgoing = incoming = None  # a sent buffer lives in its op and work only, until its release
            mail.close()
        if self.P > 1:
            dist.all_reduce(state.loss_sum, op=dist.ReduceOp.SUM, group=self.group)  # 8 bytes: Σ CE everywhere
        return MicroBatchLoss(state.loss_sum, state.aux_totals)

    def _compute(self, state, action: Action, received):
        """The action's compute; returns the tensor to send (None: the action sends nothing)."""
        if action.kind == "F":
            return self._forward(state, action, received)
        if action.kind == "W":  # the weight gradients its I left in the store
            self.store.apply(state.deferred.pop((action.mb, action.chunk)))
            return None
        if action.kind == "R":  # the successor's forward on its shadow (Bamboo): sends nothing
            self.shadow.forward(state, action, state.kept.pop(action.mb, None))
            return None
        return self._backward(state, action, received)  # B, or I

    def _forward(self, state, action: Action, received):
        """F: the chunk's blocks (the first chunk embeds the tokens, the last adds the loss); keeps the graph's
        roots for B/I and returns the output to send (None on the last chunk)."""
        model, layers = state.model, self.chunk_layers[action.chunk]  # this rank's GPT holds all its chunks
        x, y, *rest = state.batches[action.mb]  # (x, y) or (x, y, pos)
        first, last = action.chunk == 0, action.chunk == self.n_chunks - 1
        model.aux_losses.clear()
        with state.autocast:
            if first:  # only the first chunk reads the tokens (and positions), only the last the targets
                inp, pos = None, rest[0] if rest else None
                pos = None if pos is None else pos.to(state.device)
                h = model.forward_blocks(model.embed(x.to(state.device, non_blocking=True), pos), layers)
            else:
                inp = received.requires_grad_()
                h = model.forward_blocks(inp, layers)
            if last:
                _, loss_sum, _ = model.head_loss(h, y.to(state.device, non_blocking=True))
        aux = model.aux_losses.weighted_sum()
        for name, value in model.aux_losses.values().items():
            state.aux_totals[name] = state.aux_totals.get(name, 0.0) + value
        if last:  # loss_scale·(loss_sum/global_tokens + Σ coef·aux/(D·m))
            objective = loss_sum / state.global_tokens
            if aux is not None:
                objective = objective + aux / state.aux_divisor
            state.saved[action.mb, action.chunk] = (inp, [objective * state.loss_scale])
            state.loss_sum += loss_sum.detach().double()
            return None
        roots = [h] if aux is None else [h, aux / state.aux_divisor * state.loss_scale]
        state.saved[action.mb, action.chunk] = (inp, roots)
        out = h.detach().to(state.boundary_dtype)
        if self.redundant:  # the R of this micro-batch reads it (the send shares the tensor)
            state.kept[action.mb] = out
        return out

    def _backward(self, state, action: Action, grad):
        """B: backpropagate the chunk's roots (its output with the received gradient, its aux terms) and return
        the input's gradient to send upstream. I: the same, with the linears' weight gradients left for W."""
        inp, roots = state.saved.pop((action.mb, action.chunk))
        grads = None if grad is None else [grad.to(roots[0].dtype)] + [None] * (len(roots) - 1)
        with self.store.capture() if action.kind == "I" else nullcontext() as deferred:
            torch.autograd.backward(roots, grads)
        if action.kind == "I":
            state.deferred[action.mb, action.chunk] = deferred
        return None if inp is None else inp.grad

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
        h, dtype = None, next(model.parameters()).dtype  # a boundary carries the parameter dtype
        for chunk in range(self.n_chunks):
            if chunk % self.P != self.rank:
                continue
            if chunk == 0:
                h = embed(model, None)
            else:
                h = _recv_blocking(self.peers[(chunk - 1) % self.P], self.group, device, dtype)
            h = model.forward_blocks(h, self.chunk_layers[chunk])
            model.aux_losses.clear()  # else every evaluated batch and sampled token would keep its terms
            if chunk < self.n_chunks - 1:
                _send_blocking(h.to(dtype), self.peers[(chunk + 1) % self.P], self.group)
        return head(model, h) if (self.n_chunks - 1) % self.P == self.rank else None

    def plan(self, m: int) -> list:
        """This rank's [schedules.Step] for m micro-batches (built once per m)."""
        if m not in self._plans:
            self._plans[m] = communication_plan(self.programs(m), self.n_chunks)[self.rank]
        return self._plans[m]

    def programs(self, m: int) -> list:
        return build_programs(self.name, self.P, m, self.v, self.redundant)

    def describe(self, m: int) -> str:
        return (f"pipeline {self.name} over P={self.P}" + (f" × v={self.v}" if self.v > 1 else "") + f", m={m}:"
                f" bubble predicted {bubble_formula(self.name, self.P, m, self.v):.1%} = {BUBBLE_TEXT[self.name]}")


class _StepState:
    """What one step's actions share: the inputs, the stashed graphs between F and B/I (and I and W), the loss."""

    def __init__(self, model, batches, global_tokens, loss_scale, aux_divisor, autocast):
        self.model, self.batches, self.global_tokens = model, batches, global_tokens
        self.loss_scale, self.aux_divisor, self.autocast = loss_scale, aux_divisor, autocast
        self.device = next(model.parameters()).device  # the stage's: the batches move there
        # Stage boundaries carry the parameter dtype (the residual stream's, usually): a layer whose output is
        # wider (an FP8 linear's, say) is cast to it on the way, so every receive knows its size in advance.
        self.boundary_dtype = next(model.parameters()).dtype
        self.saved, self.deferred, self.aux_totals, self.kept = {}, {}, {}, {}  # kept: F outputs R will read
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)


class _Mailbox:
    """One step's p2p on this rank: the receives the plan posts early, each waited just before its use; each
    send posted with the next step's receives and waited at its release point (or at the end)."""

    def __init__(self, schedule: PipelineSchedule, state: _StepState):
        self.schedule, self.state = schedule, state
        self.received, self.sent, self.pending = {}, {}, []  # message -> (buffer, work) | work; [(op, message)]

    def post(self, recvs: list) -> None:
        """ONE batch_isend_irecv: a receive for each message of `recvs`, then the pending send (the peer that
        takes this send knows these receives posted: the plan's release points rely on it)."""
        s, state = self.schedule, self.state
        sends, self.pending = self.pending, []
        ops = []
        for msg in recvs:  # (b, s/T, h): the receive's size is known before the peer computes it
            rows, seq = state.batches[msg.mb][0].shape
            buffer = torch.empty(rows, seq // s.seq_divisor, state.model.config.n_embd, dtype=state.boundary_dtype,
                                 device=state.device)
            ops.append(dist.P2POp(dist.irecv, buffer, s.peers[msg.src(s.P)], s.group))
        ops += [op for op, _ in sends]
        if not ops:
            return
        named = ", ".join([f"recv {_label(msg)}" for msg in recvs] + [f"send {_label(msg)}" for _, msg in sends])
        with s.observer.p2p(f"post {named}", sum(op.tensor.numel() * op.tensor.element_size() for op in ops)):
            works = dist.batch_isend_irecv(ops)
        if len(works) != len(ops):  # NCCL coalesces a batch into one work
            works = [works[0]] * len(ops)
        for msg, op, work in zip(recvs, ops, works):
            self.received[msg] = (op.tensor, work)
        for (_, msg), work in zip(sends, works[len(recvs):]):
            self.sent[msg] = work

    def take(self, msg: Message | None):
        """The received tensor `msg` carries, once its receive completes (None: the action needs none)."""
        if msg is None:
            return None
        buffer, work = self.received.pop(msg)
        with self.schedule.observer.p2p(f"wait {_label(msg)}"):
            work.wait()
        return buffer

    def release(self, msgs) -> None:
        for msg in msgs:  # told like the receives': the trace shows a rank held up by its own sends
            with self.schedule.observer.p2p(f"release {_label(msg)}"):
                self.sent.pop(msg).wait()

    def send(self, msg: Message | None, tensor) -> None:
        if msg is not None:
            s = self.schedule
            self.pending = [(dist.P2POp(dist.isend, tensor.contiguous(), s.peers[msg.dst(s.P)], s.group), msg)]

    def close(self) -> None:
        self.post([])
        for work in self.sent.values():  # sends whose receivers post after this rank's last action starts
            work.wait()


def _label(msg: Message) -> str:
    """A message as the trace names it: 'act 3.1' (micro-batch 3, sent by chunk 1)."""
    return f"{msg.kind} {msg.mb}.{msg.chunk}"


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
# Wiring: flags, the stages, the tied embedding, the handle
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PipelineConfig:
    """--pp P, --pp-schedule, --pp-virtual v (interleaved only), --trace-file: validated by config_from_flags."""

    size: int  # P
    schedule: str = "1f1b"
    virtual: int = 1  # v: chunks per rank (1 unless interleaved)
    trace_file: str | None = None
    redundant: bool = False  # --pp-redundant: R actions in the lists (resilience/redundancy.py validates it)
    bounds: tuple | None = None  # the chunks' layer boundaries (0, ..., L) when not the even split (a takeover)


def chunk_layers(config: PipelineConfig, n_layer: int) -> list:
    """Each chunk's layers: the even split of v·P chunks, or the given boundaries."""
    if config.bounds is None:
        return split_layers(n_layer, config.size * config.virtual)
    return [range(a, b) for a, b in zip(config.bounds, config.bounds[1:])]


def config_from_flags(args, settings) -> PipelineConfig | None:
    """The pipeline's flags on this mesh, or ValueError naming the flag (before any process group)."""
    P, schedule, m, n_layer = args.pp, args.pp_schedule, settings.micro_batches, settings.model.n_layer
    if P == 1:
        return None
    v = args.pp_virtual if schedule == "interleaved" else 1
    if schedule == "interleaved" and v < 2:
        raise ValueError(f"--pp-virtual {v}: interleaved 1F1B needs at least 2 chunks per rank (one chunk per rank"
                         f" is --pp-schedule 1f1b)")
    if m < P:
        raise ValueError(f"--pp {P} needs at least {P} micro-batches per step (one in flight per stage), but this run"
                         f" has m = {m} = global batch / (D × --micro-batch): raise --global-batch or lower"
                         f" --micro-batch")
    chunks = P * v
    if n_layer < chunks:
        raise ValueError(f"--pp {P}" + (f" × --pp-virtual {v}" if chunks > P else "") + f" makes {chunks} pipeline"
                         f" chunks, but the model has only n_layer={n_layer} layers (at least one per chunk)")
    if schedule == "interleaved" and n_layer % chunks:
        raise ValueError(f"--pp-schedule interleaved: n_layer={n_layer} must be divisible by --pp {P} × --pp-virtual"
                         f" {v} = {chunks} (equal chunks keep the interleaved slots equal)")
    return PipelineConfig(P, schedule, v, args.trace_file, redundant=args.pp_redundant)


def stage_of(config: PipelineConfig | None, run) -> dict:
    """What this rank builds (a stage never allocates the others' blocks): GPT(config, **stage_of(...)).
    {} without a pipeline; else its chunks' layers, the embeddings on chunk 0's rank, the head on the last's."""
    if config is None:
        return {}
    if config.bounds is not None:  # after a takeover (resilience/redundancy.py): v = 1, chunk = rank
        rank, layers = run.mesh.index("pp"), chunk_layers(config, run.config.n_layer)
        return dict(layers=list(layers[rank]), embedding=rank == 0, head=rank == config.size - 1)
    return stage_kwargs(run.config.n_layer, run.mesh.index("pp"), config.size, config.virtual)


def stage_kwargs(n_layer: int, pp_rank: int, P: int, v: int = 1) -> dict:
    chunks = rank_chunks(pp_rank, P, v)
    layers = [layer for chunk in chunks for layer in stage_layers(n_layer, P, v, chunk)]
    return dict(layers=layers, embedding=0 in chunks, head=P * v - 1 in chunks)


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
    mesh = run.mesh
    sp = mesh.size("tp") if run.settings.sequence_parallel else 1  # a boundary carries s/C (÷T under SP) tokens
    schedule = PipelineSchedule(config, mesh, run.config.n_layer, seq_divisor=sp)
    mark_tied_copies(model, schedule.n_chunks)
    boundary = run.micro_batch_size * run.settings.local_seq_len * run.config.n_embd  # b·s·h elements
    tied_group = mesh.group("pp_tied") if mesh.size("pp_tied") > 1 else None  # first and last stage
    writes_trace = all(index == 0 for axis, index in mesh.coordinates().items() if axis not in ("pp", "pp_tied"))
    return Pipeline(model, schedule, run.micro_batches, boundary, tied_group,
                    config.trace_file if writes_trace else None)


@dataclass(frozen=True)
class PPFacts:
    """What the accounting reads of the pipeline (`Pipeline.facts`): report/pipeline.py, accounting/activations.py,
    planner/time_model.py. programs: every pp rank's actions for the run's m micro-batches (schedules.build_programs);
    plan: this rank's [schedules.Step] (the receives it posts, its sends and their release points);
    message_bytes: one stage-boundary message, b·s·h·e; group: pp's, which the end lines gather over;
    trace_file: where the end lines write the Chrome trace (one rank per pp group has one)."""

    schedule: str
    P: int
    v: int
    rank: int
    m: int
    programs: list
    plan: list
    message_bytes: int
    group: object
    trace_file: str | None


class Pipeline(Axis):
    """The axis handle: the schedule, the tied-embedding sum, sampling through the stages, the predicted
    messages, what the accounting reads (`facts`) and subscribes (`observe`). boundary_elements: b·s·h, one
    stage-boundary message (s: this rank's tokens of a row)."""

    name = "pp"

    def __init__(self, model: GPT, schedule: PipelineSchedule, micro_batches: int, boundary_elements: int,
                 tied_group=None, trace_file: str | None = None):
        self.model, self.schedule, self.config = model, schedule, model.config
        self.m, self.boundary_elements = micro_batches, boundary_elements
        self.tied_group = tied_group  # the {first, last} stage group, None at P = 1
        self.trace_file = trace_file  # where report/pipeline.py writes the Chrome trace (one rank per pp group)

    @torch.no_grad()
    def after_grad_sync(self, layout) -> int:
        """Sum the tied embedding's gradient over {first, last} stage (after the data-parallel reduction)."""
        copies = tied_copies(self.model, self.schedule.n_chunks)
        if self.tied_group is not None and copies:
            # Whole under DDP. Under ZeRO, this rank's segments: the layout must give the first and the last
            # stage the same element ranges of this tensor (e.g. a unit of its own), or the sum adds unrelated
            # elements.
            sum_in_place(layout.grad_pieces(copies), self.tied_group)
        return 0  # nothing of its own can be non-finite

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

    def observe(self, observer: PipelineObserver) -> None:
        """The interpreter tells `observer` (the accounting's observers.ActionClock) each step, action and p2p call."""
        self.observer = self.schedule.observer = observer

    def facts(self) -> PPFacts:
        s = self.schedule
        return PPFacts(s.name, s.P, s.v, s.rank, self.m, s.programs(self.m), s.plan(self.m), self.message_bytes(),
                       s.group, self.trace_file)

    def message_bytes(self) -> int:
        """One stage-boundary message, b·s·h·e: e of the parameter dtype, as the layout left it."""
        return self.boundary_elements * next(self.model.parameters()).element_size()

    def predicted_messages(self, layout) -> Messages:
        """This rank's messages per step: its plan's sends and receives over pp, the loss sum, and the tied
        sum over pp_tied, whose payload is the layout's grad_pieces of the copy (a ZeRO shard: maybe none)."""
        steps, size = self.schedule.plan(self.m), self.message_bytes()
        sends, recvs = sum(s.send is not None for s in steps), sum(len(s.recvs) for s in steps)
        out = Messages().add("all_reduce", "pp", 1, 8).add("send", "pp", sends, sends * size)
        out.add("recv", "pp", recvs, recvs * size)
        copies = tied_copies(self.model, self.schedule.n_chunks)
        pieces = layout.grad_pieces(copies) if self.tied_group is not None and copies else []
        if pieces:  # a ZeRO-1 shard may hold none of it (and then neither does its peer)
            out.add("all_reduce", "pp_tied", 1, sum(t.numel() * t.element_size() for t in pieces))
        return out

