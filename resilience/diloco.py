"""DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language Models"): data
parallelism that talks across replicas once every H steps instead of every step.

The D data ranks are cut into R replicas of D/R (mesh.py: replica r = d // (D/R), the outermost cut; `dp_cp`,
`expert_dp` and `ep` stay inside a replica, `diloco` holds the R ranks at the same place in each). Inside a
replica any layout runs as without DiLoCo (DDP, ZeRO-1/2, with TP, ...), its gradient reductions and its
update's norm all-reduce (the `replica` group) never leaving the replica. Algorithm 1 of the paper, per round:

    θ_start: the parameters every replica starts the round from (the same on all)
    each replica r: H inner steps of the existing AdamW on its own data → θ_r
    Δ = (1/R) Σ_r (θ_start − θ_r)                      the pseudo-gradient: one all-reduce over `diloco`
    b ← μ·b + Δ;  θ_start ← θ_start − η·(Δ + μ·b)       outer SGD with Nesterov momentum (torch.optim.SGD's)
    every replica continues from θ_start                 (defaults η = 0.7, μ = 0.9: the paper's)

With R = 1, H = 1, η = 1, μ = 0 the round is the plain data-parallel update (θ_start − Δ = θ_r). With R > 1 and
H = 1 it is the mean of R AdamW updates, not AdamW of the mean gradient (AdamW is not linear in the gradient).

The data: each inner step consumes B_global sequences, split over all D data ranks as without DiLoCo, so replica
r sees its D/R data ranks' slices (B_global/R sequences a step); its loss is normalised by its own tokens (step.py's
count over `dp_cp`). A run ends on an outer step (--steps a multiple of H, cli/flags.py), so it ends with one model.

Accounting:
1. Replicated: θ_start and the outer momentum b, on every replica; each rank holds them for the parameters it
   holds (its TP shard), in fp32 (fp64 when the parameters are). Split: the batch, over all D data ranks.
2. Memory: the inner layout's, plus 2·Ψ_rank·4 bytes (θ_start, b), plus one flat Δ of Ψ_rank·4 bytes while the
   outer step runs.
3. Messages: the inner layout's, only inside a replica; the update's 16-byte norm all-reduce over `replica`
   instead of the world; once per H steps one all-reduce of Δ over `diloco` (N = R ranks), Ψ_rank·4 bytes:
   per step Ψ_rank·4/H, 1/H of DDP's gradient all-reduce payload (predicted_messages, amortised).
4. Restart state: θ_start, b and the round's position (kind `diloco/`), and every replica's own inner state:
   replica 0's under the usual keys (param/, master/, exp_avg/, ...: what export and sampling read), replica
   r ≥ 1's as `diloco/r<r>.<kind>/<name>`. A resume restores them on the same mesh (same R, same inner layout).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from shard import ShardInfo, StatePiece
from step import Messages


@dataclass(frozen=True)
class DiLoCoConfig:
    replicas: int  # R
    inner_steps: int  # H
    outer_lr: float = 0.7  # η
    outer_momentum: float = 0.9  # μ (Nesterov)


def config_from_flags(args) -> DiLoCoConfig | None:
    """--diloco-h H turns DiLoCo on (R = --diloco-replicas, default 1); the mesh checks that R divides D. The
    other DiLoCo flags mean something only with it: cli/flags.py refuses them alone (given, whatever their value)."""
    if args.diloco_h is None:
        return None
    if args.diloco_h < 1:
        raise ValueError(f"--diloco-h must be at least 1 (inner steps per outer step), got {args.diloco_h}")
    if args.diloco_replicas is not None and args.diloco_replicas < 1:
        raise ValueError(f"--diloco-replicas must be at least 1 (replicas of D/R data ranks), got"
                         f" {args.diloco_replicas}")
    if not (math.isfinite(args.diloco_outer_lr) and args.diloco_outer_lr > 0):
        raise ValueError(f"--diloco-outer-lr must be a positive number, got {args.diloco_outer_lr}")
    if not (math.isfinite(args.diloco_outer_momentum) and 0 <= args.diloco_outer_momentum < 1):
        raise ValueError(f"--diloco-outer-momentum must be in [0, 1), got {args.diloco_outer_momentum}")
    if args.zero == 3:
        raise ValueError("--diloco-h with --zero 3: the outer step works on whole local parameters; use --zero 0,"
                         " 1 or 2 inside a replica")
    if args.zero == 2 and args.pp > 1:  # zero_pipeline's layouts reduce the update's norm over the world
        raise ValueError("--diloco-h with --zero 2 and --pp: the pipeline's ZeRO-2 layout has no replica group for"
                         " the update's norm; use --zero 0 or 1 inside a replica")
    if args.steps % args.diloco_h:
        raise ValueError(f"--steps {args.steps} must be a multiple of --diloco-h {args.diloco_h}, so that the run"
                         f" ends on an outer step with one model")
    return DiLoCoConfig(args.diloco_replicas or 1, args.diloco_h, args.diloco_outer_lr, args.diloco_outer_momentum)


@dataclass(frozen=True)
class DiLoCoFacts:
    """What DiLoCo's report section reads (`DiLoCoLayout.wrapper_facts`)."""

    config: DiLoCoConfig
    outer_bytes: int  # one copy of the outer state, the payload of one Δ all-reduce
    outer_steps: int  # outer steps taken by this process


class DiLoCoLayout:
    """An optim.Layout around the replica's own layout (`inner`: DDP or ZeRO-1/2 over the replica's groups): it
    forwards every method to it, and adds the outer step after every H-th inner step, the outer state, and their
    bytes and messages. `name` and `facts()` are the inner layout's (its printouts and time model); `wrapper`
    names DiLoCo's own printouts (report.axes.AXIS_LINES["diloco"]), `wrapper_facts()` their figures."""

    wrapper = "diloco"

    def __init__(self, inner, config: DiLoCoConfig, mesh):
        self.inner, self.config, self.name, self.module = inner, config, inner.name, inner.module
        self.group, self.replica, self.rank = mesh.group("diloco"), mesh.index("diloco"), mesh.rank
        self.replicas = mesh.size("diloco")
        params = self._param_pieces()
        self.outer_dtype = torch.promote_types(params[0].tensor.dtype, torch.float32)
        with torch.no_grad():
            self.start = [p.tensor.detach().to(self.outer_dtype, copy=True) for p in params]  # θ_start
            self.momentum = [torch.zeros_like(s) for s in self.start]  # b
        self.position = torch.zeros(1, dtype=torch.int64)  # inner steps taken in this round
        self.outer_steps = 0

    def _param_pieces(self) -> list:
        """The inner layout's live parameter pieces (its `param/` state pieces), in its fixed order."""
        return [p for p in self.inner.state_pieces() if p.key.startswith("param/")]

    def step(self, scaler, clip: float, extra_nonfinite=None):
        result = self.inner.step(scaler, clip, extra_nonfinite)  # the replica's AdamW (its norm over `replica`)
        self.position += 1
        if int(self.position) == self.config.inner_steps:
            self.outer_step()
            self.position.zero_()
        return result

    @torch.no_grad()
    def outer_step(self) -> None:
        """Δ averaged over the replicas (one flat all-reduce), the Nesterov step on θ_start, and θ_start copied
        into the replica's parameters (and into ZeRO's fp32 master shards: their flat range of the parameter)."""
        pieces = self.inner.state_pieces()
        params = [p for p in pieces if p.key.startswith("param/")]
        delta = torch.cat([(s - p.tensor.to(s.dtype)).reshape(-1) for s, p in zip(self.start, params)])
        dist.all_reduce(delta, op=dist.ReduceOp.SUM, group=self.group)  # Σ_r Δ_r, on every replica alike
        delta /= self.replicas
        lr, mu, offset, new = self.config.outer_lr, self.config.outer_momentum, 0, {}
        for start, buffer, piece in zip(self.start, self.momentum, params):
            d = delta[offset:offset + start.numel()].view_as(start)
            offset += start.numel()
            buffer.mul_(mu).add_(d)  # b ← μ·b + Δ
            start.sub_(lr * (d + mu * buffer))  # θ_start ← θ_start − η·(Δ + μ·b)
            piece.tensor.copy_(start)
            new[piece.key.split("/", 1)[1]] = start
        for piece in pieces:
            if piece.key.startswith("master/"):
                lo, hi = piece.flat_range or (0, piece.tensor.numel())
                piece.tensor.copy_(new[piece.key.split("/", 1)[1]].reshape(-1)[lo:hi].view_as(piece.tensor))
        self.outer_steps += 1

    def state_pieces(self) -> list:
        """The inner layout's pieces (replica r ≥ 1's under `diloco/r<r>.<kind>/`), then θ_start and b (written by
        replica 0's writer of each parameter piece) and the round's position (rank 0)."""
        pieces = []
        for piece in self.inner.state_pieces():
            if self.replica:
                kind, name = piece.key.split("/", 1)
                piece = replace(piece, key=f"diloco/r{self.replica}.{kind}/{name}")
            pieces.append(piece)
        for piece, start, buffer in zip(self._param_pieces(), self.start, self.momentum):
            name, primary = piece.key.split("/", 1)[1], piece.primary and self.replica == 0
            pieces += [StatePiece(f"diloco/start/{name}", start, piece.shard, piece.flat_range, primary),
                       StatePiece(f"diloco/momentum/{name}", buffer, piece.shard, piece.flat_range, primary)]
        pieces.append(StatePiece("diloco/position", self.position, ShardInfo("position", (1,)), None, self.rank == 0))
        return pieces

    # --- the rest of optim.Layout: the replica's layout's -----------------------------------------------------

    def __call__(self, *args, **kwargs):
        return self.inner(*args, **kwargs)

    def no_sync(self):
        return self.inner.no_sync()

    def finish_grad_sync(self) -> None:
        self.inner.finish_grad_sync()

    def grad_pieces(self, params) -> list:
        return self.inner.grad_pieces(params)

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def set_lr(self, lr: float) -> None:
        self.inner.set_lr(lr)

    @property
    def optimizer_step_count(self) -> int:
        return self.inner.optimizer_step_count

    @optimizer_step_count.setter
    def optimizer_step_count(self, value: int):
        self.inner.optimizer_step_count = value

    def facts(self):
        return self.inner.facts()

    def wrapper_facts(self) -> DiLoCoFacts:
        return DiLoCoFacts(self.config, self.outer_bytes(), self.outer_steps)

    def __getattr__(self, name):  # what else a layout offers (recount, full_parameters, ...): the inner one's
        return getattr(self.__dict__["inner"], name)

    # --- accounting: the docstring's formulas ------------------------------------------------------------------

    def outer_bytes(self) -> int:
        """Ψ_rank·b_outer: one copy of the outer state (θ_start or b), and the payload of one Δ all-reduce."""
        return sum(s.numel() for s in self.start) * self.outer_dtype.itemsize

    def held_bytes(self) -> dict:
        held = dict(self.inner.held_bytes())
        outer = sum(t.nbytes for t in (*self.start, *self.momentum))
        held["optimizer"] += outer
        held["total"] += outer
        return held

    def predicted_persistent(self, *args, **kwargs) -> dict:
        out = dict(self.inner.predicted_persistent(*args, **kwargs))
        out["optimizer"] += 2 * self.outer_bytes()
        out["total"] += 2 * self.outer_bytes()
        return out

    def predicted_messages(self, micro_batches: int = 1) -> Messages:
        """The inner layout's (inside the replica), plus the Δ all-reduce amortised over its H steps."""
        h = self.config.inner_steps
        return Messages(self.inner.predicted_messages(micro_batches)).add("all_reduce", "diloco", 1 / h,
                                                                            self.outer_bytes() / h)
