"""Pipeline redundancy (Bamboo, Thorpe et al., NSDI 2023): every stage shadows its successor, and when a stage is
preempted its predecessor takes over at once, from memory, without a checkpoint.

`--pp-redundant`. Stage r holds, besides its own, a shadow of stage s = (r+1) mod P (the last stage shadows the
first): s's parameters, their Adam state and a gradient buffer (`ShadowStage`). Each step:
- forward redundant computation, eager: r runs s's forward of every micro-batch (the R actions of
  parallel/schedules.py, placed in r's bubble; the interpreter hands them to `ShadowStage.forward`) on the output
  of its own F (chunk 0's shadow on the tokens), and keeps the graph until the update: the activations the lazy
  backward needs (`lazy_backward`: s's parameter gradients and input gradients from them);
- after the data-parallel reduction (and the pipeline's tied-embedding sum), every stage sends its reduced
  gradients to its predecessor and receives its successor's (one batch_isend_irecv over pp, `after_grad_sync`);
- the update (`RedundantLayout.step`): the stage's own as always, then the shadow's with the same unscale and
  clip coefficient (the successor's norm is in the world's one all-reduce) and the same torch AdamW: the shadow
  stays the successor's state, element for element.

The takeover (train.py's loop calls `take_over` when a step fails with a lost peer). The launcher must leave the
survivors running (one agent per stage, or none: tests/resilience/test_redundancy.py spawns the P workers
itself; torchrun's single-node agent stops every worker when one dies, which makes a preemption a checkpoint
restart). 1. A survivor's next p2p or collective with the lost rank fails (gloo: the connection closed by the
peer); it then closes its own connections to every peer of every group (`close_connections`: a receive waited
with a 1 ms timeout makes gloo close that pair), so a survivor blocked on a live peer fails at once too.
2. The survivors meet in a file rendezvous under --out-dir (`rendezvous`, generation g of the run: each writes
its old rank, and P−1 of them are awaited; fewer within the timeout is more than one loss, which redundancy
cannot absorb: the run ends with the newest committed checkpoint named, untouched). 3. A new default group of
P−1 ranks over a FileStore there; `takeover_plan`: the lost stage's predecessor holds its layers as its shadow,
so it becomes one stage of both (its chunk's layer bounds merged; ranks after the lost one move down). 4. The run
is composed again on P−1 stages and every tensor of state is copied from this process's memory, by name (the
stage's own and its shadow's pieces: `fill_from_memory`); then every stage sends its state to its new
predecessor, whose shadow it is (`resync_shadows`). 5. The interrupted step is replayed from its start (its batches
are the same: data.py's cursor is the step): the losses follow the uninterrupted run's to float tolerance. Not
done here: Bamboo's mid-step continuation, where the predecessor runs the lost stage's backward for the
micro-batches in flight through the kept R graphs (`lazy_backward` computes exactly that, tested apart); the step
is replayed instead. The loss of stage 0 (shadowed by the last stage, whose layers are not contiguous with its
own) is not taken over: the run ends as for two losses. Served: a pure pipeline (D = T = C = 1), gpipe or 1F1B,
DDP, dense, dropout 0 (the shadow's forward draws no randomness); the rest is refused by `config_from_flags`.

Accounting (Ψ_r, Ψ_s the parameters of stage r and of its successor s, b = 4 bytes (fp32 masters), m
micro-batches, L_s the successor's layers, A a layer's saved activations per micro-batch, bsh·e a boundary):
1. Replicated: every stage's parameters and Adam state, on the stage and on its predecessor's shadow; the
   shadow is never counted (norm, Ψ) nor written (its pieces are primary=False: loaded, not saved).
2. Peak per rank, on top of the stage's own: the shadow's weights, gradient buffer and two moments, 4·b·Ψ_s
   (`shadow_bytes`), the R graphs kept until the update, ≤ m·L_s·A, and the F outputs kept until their R,
   ≤ m·bsh·e (`ShadowStage.kept_bytes` measures the graphs' inputs and outputs).
3. Messages per step over pp: one send of b·Ψ_r (the stage's reduced gradients, to its predecessor) and one
   receive of b·Ψ_s, after the reduction and before the update: on the critical path. A takeover adds one
   resync, 3·b·Ψ per stage (weights and moments), and a rendezvous through files.
4. Restart state: nothing of its own; the shadow's pieces are the successor's (loaded from a checkpoint like
   TP's replicated tensors), its Adam step the layout's (`after_load`).
"""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ddp import set_adam_step
from mfu import format_bytes
from model import GPT
from optim import build_adamw, ensure_adam_state
from pipeline import chunk_layers
from resilience import ckpt_files
from shard import StatePiece, describe, materialize
from step import Axis, Messages

SCHEDULES = ("gpipe", "1f1b")  # v = 1 and B whole: parallel/schedules.py places R in their lists
TIMEOUT_ENV = "PP_REDUNDANT_TIMEOUT_S"  # the rendezvous's wait for the survivors (default 60 s)
CLOSING_TAG = 0x7A4E  # close_connections' receive: a tag no message of the run carries


@dataclass(frozen=True)
class RedundancyConfig:
    """--pp-redundant, validated: where the takeover's rendezvous lives and how long it waits for survivors."""

    rendezvous: str  # a directory under --out-dir (the survivors must share it)
    timeout_s: float = 60.0
    token: str | None = None  # this run's subdirectory there (None: rank 0 draws it at start, `agree_token`)
    takeovers: int = 0  # so far: a rebuilt run counts on from its predecessor's


def config_from_flags(args, settings) -> RedundancyConfig | None:
    """--pp-redundant on this mesh, or ValueError naming the flag (before any process group)."""
    if not getattr(args, "pp_redundant", False):
        return None
    shape, config = settings.shape, settings.model
    if args.pp < 2:
        raise ValueError(f"--pp-redundant needs --pp P >= 2 (a stage shadows its successor), got --pp {args.pp}")
    if args.pp_schedule not in SCHEDULES:
        raise ValueError(f"--pp-redundant serves --pp-schedule {' or '.join(SCHEDULES)} (one chunk per stage, B"
                         f" whole), not {args.pp_schedule}")
    if shape.world_size != shape.pp:
        raise ValueError(f"--pp-redundant needs a pure pipeline (world = P: D = T = C = 1), got world"
                         f" {shape.world_size} for P = {shape.pp}: the takeover rebuilds one pipeline")
    refused = [(args.zero, "--zero (the shadow mirrors DDP's whole Adam state)"),
               (config.moe is not None, "--moe-experts"), (args.fp8 or args.precision_recipe, "--fp8 and recipes"),
               (args.diloco_h, "--diloco-h"), (config.dropout > 0, "--dropout > 0 (the shadow's forward would draw"
                                                                  " the stage's random numbers)")]
    for on, flag in refused:
        if on:
            raise ValueError(f"--pp-redundant does not serve {flag}")
    timeout = float(os.environ.get(TIMEOUT_ENV, "60"))
    return RedundancyConfig(os.path.join(args.out_dir, "takeover"), timeout)


# ---------------------------------------------------------------------------------------------------------
# The shadow stage: the successor's parameters, Adam state and gradient; its forwards in the bubble
# ---------------------------------------------------------------------------------------------------------


class ShadowStage:
    """Stage s = (r+1) mod P on rank r: a GPT stage with s's layers (global names, so the init is s's own), a torch
    AdamW built as s's layout builds it, one flat gradient buffer the parameters' .grad view, and the graphs of
    this step's R forwards (`kept`: micro-batch → (input leaf, roots))."""

    def __init__(self, model: GPT, layers: range, first: bool, last: bool, args):
        self.model, self.layers, self.first, self.last = model, layers, first, last
        self.params = list(model.parameters())
        self.optimizer = build_adamw(self.params, args.lr, args.weight_decay, (args.beta1, args.beta2))
        self.grad = torch.zeros(sum(p.numel() for p in self.params), dtype=self.params[0].dtype,
                                device=self.params[0].device)
        offset = 0
        for p in self.params:  # views: the exchange writes the buffer, AdamW reads the views
            p.grad = self.grad[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.kept = {}

    def forward(self, state, action, h) -> None:
        """R: the successor's forward of micro-batch `action.mb` (pipeline._StepState `state`: its batches,
        autocast, the loss's normalisation), its graph kept for the lazy backward."""
        x, y, *rest = state.batches[action.mb]
        with state.autocast:
            if self.first:
                inp, pos = None, rest[0] if rest else None
                out = self.model.embed(x.to(state.device), None if pos is None else pos.to(state.device))
            else:
                inp = out = h.detach().requires_grad_()
            out = self.model.forward_blocks(out, self.layers)
            if self.last:
                _, loss_sum, _ = self.model.head_loss(out, y.to(state.device))
                out = loss_sum / state.global_tokens * state.loss_scale  # the objective, as the stage's own
        self.kept[action.mb] = (inp, [out])

    def lazy_backward(self, output_grads: dict) -> dict:
        """Bamboo's lazy backward: the successor's backward of each kept micro-batch, from its R graph, given the
        gradient of its output (none for the last stage, whose graph ends in the objective). Accumulates the
        successor's parameter gradients into the shadow's; returns {mb: the gradient of its input}."""
        out = {}
        for mb, (inp, roots) in sorted(self.kept.items()):
            grads = None if self.last else [output_grads[mb].to(roots[0].dtype)]
            torch.autograd.backward(roots, grads)
            out[mb] = None if inp is None else inp.grad
        self.kept.clear()
        return out

    @torch.no_grad()
    def update(self, result, unscale: float | None, clip: float) -> None:
        """The successor's update on the shadow: the same unscale, clip coefficient and AdamW (optim.update's
        order), unless the step was skipped everywhere."""
        self.kept.clear()  # the graphs of this step: the lazy backward can no longer need them
        if result.skipped:
            return
        grads = [p.grad for p in self.params]
        if unscale is not None:
            torch._foreach_mul_(grads, 1.0 / unscale)
        if clip > 0 and result.grad_norm > clip:
            torch._foreach_mul_(grads, clip / (result.grad_norm + 1e-6))
        self.optimizer.step()

    def kept_bytes(self) -> int:
        """What the kept R graphs hold at their two ends: inputs and outputs (the saved activations between them
        are autograd's)."""
        return sum(t.numel() * t.element_size() for inp, roots in self.kept.values()
                   for t in ([inp] if inp is not None else []) + roots)


def shadow_bytes(params: int, element_size: int = 4) -> int:
    """Docstring item 2: the shadow's persistent bytes, weights + gradient buffer + two Adam moments."""
    return 4 * element_size * params


# ---------------------------------------------------------------------------------------------------------
# The axis: the gradient exchange, the shadow's state pieces and messages; the layout that updates it
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RedundancyFacts:
    """What the accounting reads (`Redundancy.facts`): report/axes.py's redundancy section."""

    P: int
    rank: int
    shadowed: int  # the successor stage this rank shadows
    own_params: int
    shadow_params: int
    shadow_bytes: int  # predicted, docstring item 2
    shadow_held: int  # measured: the shadow's tensors
    takeovers: int  # so far in this run


class Redundancy(Axis):
    """The handle: the shadow, the gradient exchange (after the pipeline's tied sum), its pieces and messages."""

    name = "redundancy"

    def __init__(self, model: GPT, shadow: ShadowStage, mesh, config: RedundancyConfig, token: str):
        self.model, self.shadow, self.config, self.token = model, shadow, config, token
        self.takeovers = config.takeovers
        self.P, self.rank, self.group = mesh.size("pp"), mesh.index("pp"), mesh.group("pp")
        peers = list(mesh.members["pp"])
        self.predecessor, self.successor = peers[(self.rank - 1) % self.P], peers[(self.rank + 1) % self.P]
        self.own = [p for p in model.parameters() if p.requires_grad]

    def after_grad_sync(self, layout) -> int:
        """Send this stage's reduced gradients to the predecessor, receive the successor's into the shadow."""
        grads = torch.cat([g.reshape(-1) for g in layout.grad_pieces(self.own)])
        ops = [dist.P2POp(dist.irecv, self.shadow.grad, self.successor, self.group),
               dist.P2POp(dist.isend, grads, self.predecessor, self.group)]
        for work in dist.batch_isend_irecv(ops):  # gloo: one work per op, each waited
            work.wait()
        return 0

    def state_pieces(self) -> list:
        """The shadow's weights and moments under the successor's names: loaded from a checkpoint, never written."""
        ensure_adam_state(self.shadow.optimizer)
        pieces = []
        for p in self.shadow.params:
            state = self.shadow.optimizer.state[p]
            for kind, tensor in (("param", p.detach()), ("exp_avg", state["exp_avg"]),
                                 ("exp_avg_sq", state["exp_avg_sq"])):
                pieces.append(StatePiece(f"{kind}/{p.shard_info.global_name}", tensor, p.shard_info, primary=False))
        return pieces

    def after_load(self, layout, step: int) -> None:
        set_adam_step(self.shadow.optimizer, layout.optimizer_step_count)

    def predicted_messages(self, layout) -> Messages:
        b = self.shadow.grad.element_size()
        return (Messages().add("send", "pp", 1, b * sum(p.numel() for p in self.own))
                .add("recv", "pp", 1, self.shadow.grad.numel() * b))

    def facts(self) -> RedundancyFacts:
        held = sum(t.numel() * t.element_size() for p in self.shadow.params
                   for t in self.shadow.optimizer.state.get(p, {}).values() if torch.is_tensor(t) and t.dim() > 0)
        held += sum(p.numel() * p.element_size() for p in self.shadow.params) + self.shadow.grad.nbytes
        own, shadowed = sum(p.numel() for p in self.own), self.shadow.grad.numel()
        return RedundancyFacts(self.P, self.rank, (self.rank + 1) % self.P, own, shadowed,
                               shadow_bytes(shadowed, self.shadow.grad.element_size()), held, self.takeovers)


def apply(model: GPT, run, config: RedundancyConfig) -> Redundancy:
    """The shadow of the successor's stage, built and initialised as that stage builds its own (global names),
    handed to the pipeline's schedule for its R actions."""
    pp_config, P, rank = run.settings.axes["pipeline"], run.mesh.size("pp"), run.mesh.index("pp")
    shadowed = (rank + 1) % P
    layers = chunk_layers(pp_config, run.config.n_layer)[shadowed]
    stage = describe(GPT(run.config, seed=run.seed, dtype=run.master_dtype, device="meta", layers=list(layers),
                         embedding=shadowed == 0, head=shadowed == P - 1))
    materialize(stage, run.device, stage.initial_value)
    shadow = ShadowStage(stage, layers, shadowed == 0, shadowed == P - 1, run.settings.args)
    next(axis for axis in run.axes if axis.name == "pp").schedule.serve_redundant(shadow)
    return Redundancy(model, shadow, run.mesh, config, config.token or agree_token(run.device))


class RedundantLayout:
    """optim.Layout: the stage's layout (DDP), and after its update the shadow's (`ShadowStage.update`). Every
    other method is the wrapped layout's."""

    def __init__(self, inner, handle: Redundancy):
        self.inner, self.handle = inner, handle

    def __call__(self, *args, **kwargs):
        return self.inner(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def step(self, scaler, clip: float, extra_nonfinite=None):
        scale = scaler.scale if scaler.enabled else None  # the update may grow it
        result = self.inner.step(scaler, clip, extra_nonfinite)
        self.handle.shadow.update(result, scale, clip)
        return result

    def set_lr(self, lr: float) -> None:
        self.inner.set_lr(lr)
        for group in self.handle.shadow.optimizer.param_groups:
            group["lr"] = lr

    @property
    def optimizer_step_count(self) -> int:
        return self.inner.optimizer_step_count

    @optimizer_step_count.setter
    def optimizer_step_count(self, value: int) -> None:
        self.inner.optimizer_step_count = value
        set_adam_step(self.handle.shadow.optimizer, value)


# ---------------------------------------------------------------------------------------------------------
# The takeover: the survivors close their connections, meet again, and the predecessor's shadow joins its stage
# ---------------------------------------------------------------------------------------------------------


class TakeoverError(RuntimeError):
    """The loss cannot be absorbed (more than one stage, stage 0, survivors that disagree): a checkpoint restart."""


@dataclass(frozen=True)
class TakeoverPlan:
    """The pipeline after stage `lost` of P is gone: P − 1 stages, each survivor's new pp rank, the chunks' layer
    bounds with the lost stage's layers joined to its predecessor's (`taker`, whose shadow held them)."""

    lost: int
    P: int  # the new P
    new_rank: dict  # old pp rank → new
    bounds: tuple  # (0, ..., L): P + 1 boundaries
    taker: int  # the old rank that holds the lost stage now


def takeover_plan(P: int, lost: int, bounds: tuple) -> TakeoverPlan:
    """Pure: the lost stage s ≥ 1 joins stage s − 1 (bounds[s] removed); ranks above s move down by one."""
    if lost == 0:
        raise TakeoverError("stage 0 was lost: its shadow on the last stage holds layers not contiguous with that"
                            " stage's own, and this takeover joins contiguous stages only")
    new_rank = {r: r - (r > lost) for r in range(P) if r != lost}
    return TakeoverPlan(lost, P - 1, new_rank, tuple(bounds[:lost]) + tuple(bounds[lost + 1:]), lost - 1)


def close_connections(groups) -> None:
    """Make every peer's pending p2p or collective with this rank fail now: under gloo a receive waited with a
    1 ms timeout closes its pair ("Application timeout caused pair closure"), and the peer's next operation on
    it fails as on a dead peer; so a survivor waiting on a live one that already saw the loss stops waiting.
    (NCCL would use ProcessGroupNCCL's abort; not exercised here.)"""
    me = dist.get_rank()
    for group in groups:
        for peer in dist.get_process_group_ranks(group):
            if peer != me:  # a tag nobody sends: a message in flight (of any size) cannot match this receive
                try:
                    op = dist.P2POp(dist.irecv, torch.empty(1), peer, group, tag=CLOSING_TAG)
                    for work in dist.batch_isend_irecv([op]):
                        work.wait(timeout=datetime.timedelta(milliseconds=1))
                except RuntimeError:
                    pass


def rendezvous(directory: str, old_rank: int, P: int, timeout_s: float) -> list:
    """Write this survivor's old rank into `directory`, wait until P − 1 have (or `timeout_s`): their old ranks."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f"alive-{old_rank}"), "w") as f:
        f.write(str(os.getpid()))
    deadline = time.monotonic() + timeout_s
    while True:
        alive = sorted(int(n.split("-")[1]) for n in os.listdir(directory) if n.startswith("alive-"))
        if len(alive) >= P - 1 or time.monotonic() > deadline:
            return alive
        time.sleep(0.01)


def stage_bounds(pp_config, n_layer: int) -> tuple:
    """The pipeline's layer bounds: each stage's first layer, then n_layer (what `takeover_plan` merges)."""
    return pp_config.bounds or tuple(r.start for r in chunk_layers(pp_config, n_layer)) + (n_layer,)


def settings_after(settings, plan: TakeoverPlan, handle: Redundancy):
    """cli/flags.py's Settings on the plan's P − 1 stages: the merged bounds, one more takeover counted (at P = 1
    neither a pipeline nor redundancy is left)."""
    pp = replace(settings.axes["pipeline"], size=plan.P, bounds=plan.bounds) if plan.P > 1 else None
    config = replace(settings.axes[__name__], token=handle.token, takeovers=handle.takeovers + 1)
    return replace(settings, shape=replace(settings.shape, pp=plan.P),
                   axes={**settings.axes, "pipeline": pp, __name__: config if plan.P > 1 else None})


def impossible_line(error: Exception, reason: Exception, ckpt_dir: str | None) -> str:
    """The one line of a loss the takeover cannot absorb: what failed, why, and the newest committed checkpoint."""
    committed = ckpt_files.newest_committed(ckpt_dir) if ckpt_dir else None
    return (f"error: takeover impossible after `{str(error).splitlines()[0][:100]}`: {reason}; " + (
        f"the newest committed checkpoint is step {committed[0]} ({committed[1]}): --resume latest continues from"
        f" it" if committed else "no checkpoint was committed"))


def refill(rebuilt, memory: dict, adam_steps: int) -> tuple:
    """The run composed on P − 1 stages, filled from `memory` (`fill_from_memory`) at the old Adam step, the new
    shadows synced (`resync_shadows`); returns (bytes from memory, bytes to the new shadows)."""
    pieces = rebuilt.layout.state_pieces()
    moved = fill_from_memory(pieces, memory)
    rebuilt.layout.optimizer_step_count = adam_steps
    shadow = next((axis for axis in rebuilt.axes if axis.name == "redundancy"), None)
    return moved, resync_shadows(shadow, pieces) if shadow else 0


def takeover_line(plan: TakeoverPlan, step: int, old_world: int, copied: tuple, seconds: float, replay: int) -> str:
    moved, synced = copied
    return (f"takeover: stage {plan.lost} lost at step {step}; stage {plan.taker} took it over from its shadow"
            f" (world {old_world} → {plan.P}, layer bounds {list(plan.bounds)}): {format_bytes(moved)} from memory,"
            f" {format_bytes(synced)} to the new shadows, {seconds:.2f} s; replaying step {replay}")


def lose_peer(handle: Redundancy, mesh, bounds: tuple, backend: str) -> TakeoverPlan:
    """Steps 1-3 of the takeover (docstring): close, meet, and join the new default group of P − 1 ranks (this
    process's rank there is its new pp rank). Raises TakeoverError when the loss cannot be absorbed."""
    old, P = dist.get_rank(), handle.P
    close_connections([g for g in {id(g): g for g in mesh.groups.values()}.values()
                       if dist.get_world_size(g) > 1] + [dist.group.WORLD])
    dist.destroy_process_group()
    directory = os.path.join(handle.config.rendezvous, handle.token, f"gen{handle.takeovers + 1}")
    alive = rendezvous(directory, old, P, handle.config.timeout_s)
    if len(alive) != P - 1:
        raise TakeoverError(f"{len(alive)} of the {P - 1} survivors of a lost stage arrived within"
                            f" {handle.config.timeout_s:.0f} s (old ranks {alive}): more than one stage is lost")
    if len(alive) == P or old not in alive:
        raise TakeoverError(f"old ranks {alive} met: no stage was lost (the step's error was another)")
    plan = takeover_plan(P, next(r for r in range(P) if r not in alive), bounds)
    os.environ.update(RANK=str(plan.new_rank[old]), WORLD_SIZE=str(plan.P))
    # The store's wait for the P − 1 is bounded like the rendezvous (a survivor lost now fails it soon); the
    # group's collectives then get mesh.init_distributed's 600 s.
    dist.init_process_group(backend, store=dist.FileStore(os.path.join(directory, "store"), plan.P),
                            rank=plan.new_rank[old], world_size=plan.P, timeout=short_timeout(handle))
    return plan


def short_timeout(handle: Redundancy) -> datetime.timedelta:
    """The takeover's groups wait for their members as long as the rendezvous does: a survivor lost while they
    form fails them soon (`restore_timeouts` gives them mesh.init_distributed's 600 s once the run is rebuilt)."""
    return datetime.timedelta(seconds=handle.config.timeout_s)


def restore_timeouts(mesh, seconds: float = 600) -> None:
    for group in [dist.group.WORLD, *{id(g): g for g in mesh.groups.values()}.values()]:
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=seconds), group)


def fill_from_memory(pieces: list, memory: dict) -> int:
    """Copy each piece's tensor from `memory` ({piece key: tensor}: the old stage's and its shadow's, this
    process's own); returns the bytes copied. A key this process does not hold is a TakeoverError."""
    missing = [piece.key for piece in pieces if piece.key not in memory]
    if missing:
        raise TakeoverError(f"the new stage needs {missing[:3]} that this survivor does not hold")
    with torch.no_grad():
        for piece in pieces:
            piece.tensor.copy_(memory[piece.key])
    return sum(piece.tensor.nbytes for piece in pieces)


def resync_shadows(handle: Redundancy, own_pieces: list) -> int:
    """Every stage sends its state (weights and moments, in its pieces' order) to its predecessor, which copies
    it into its shadow's pieces (the same order: the same stage built alike). Returns the bytes sent."""
    out = torch.cat([piece.tensor.reshape(-1) for piece in own_pieces])
    shadow = handle.state_pieces()
    into = torch.empty(sum(piece.tensor.numel() for piece in shadow), dtype=out.dtype, device=out.device)
    ops = [dist.P2POp(dist.irecv, into, handle.successor, handle.group),
           dist.P2POp(dist.isend, out, handle.predecessor, handle.group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    offset = 0
    with torch.no_grad():
        for piece in shadow:
            piece.tensor.copy_(into[offset:offset + piece.tensor.numel()].view_as(piece.tensor))
            offset += piece.tensor.numel()
    return out.nbytes


def agree_token(device) -> str:
    """One name for this run's rendezvous, rank 0's, heard by every rank (none on meta: a plan)."""
    if torch.device(device).type == "meta" or not dist.is_initialized():
        return "plan"
    token = [f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"]
    dist.broadcast_object_list(token, src=0)
    return token[0]
