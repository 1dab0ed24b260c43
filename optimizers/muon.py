"""Muon on the hidden matrices, AdamW on the rest: the update, its pure formulas, and the DDP layout that runs it.

Muon (Jordan et al. 2024; torch.optim.Muon in torch 2.13, whose arithmetic this file repeats op for op) keeps one
momentum buffer B per 2-D weight W (m×n, the logical shape), and each step, with g the reduced, clipped gradient:

    B ← μ·B + (1 − μ)·g                       (B.lerp_(g, 1 − μ), torch's spelling)
    U = g + μ·(B − g)  (Nesterov; else U = B)   (g.lerp(B, μ))
    O = NS₅(U): X = U/‖U‖_F (transposed if m > n), then 5 times X ← a·X + (b·A + c·A²)·X with A = X·Xᵀ,
        (a, b, c) = (3.4445, −4.7750, 2.0315), the quintic Newton–Schulz iteration toward U's orthogonal factor
    W ← W·(1 − lr·λ) − lr·√max(1, m/n)·O       (decoupled decay; torch's "original" shape-adjusted step)

The split (`is_matrix`): Muon takes every 2-D weight of a transformer block (attention's c_attn and c_proj, the
MLP's c_fc and c_proj); AdamW (optim.build_adamw, the project's) takes the rest: the token and position
embeddings, the (tied) head, the LayerNorms and the biases. Muon's lr is `--muon-lr`, AdamW's `--lr`; both follow
the one schedule (Muon's scaled by --muon-lr / --lr), and both decay by --weight-decay.

NS runs in `MuonConfig.ns_dtype`: torch casts to bf16 always; here a run's compute dtype (bf16 under --dtype
bf16; fp32 under fp32 and fp16, more exact than torch; float64 in the equivalence tests), and bf16 when asked,
which is torch.optim.Muon bit for bit (tests/optimizers/test_muon.py, 1e-12). A TP-split matrix is orthogonalised whole:
its pieces are all-gathered over the TP group (one call for all of a step's matrices, in ns_dtype, the cast NS
makes first anyway), assembled as the logical matrix by their records (`shard.ShardInfo.place_into`), and every
TP rank runs NS on it and keeps its own piece (`orthogonalized`): as Moonlight's distributed Muon, exact, T×
the NS FLOPs. Under ZeRO the two exact ways are optimizers/zero_muon.py's.

Accounting (Ψ_M the matrices' elements, Ψ_A the rest's, b the master dtype's bytes, T the TP size, per rank):
1. Replicated vs split: under DDP everything is replicated over dp×cp as AdamW is; Muon's momentum is laid out
   like its matrix (a TP piece: 1/T of it). NS work: every DDP rank orthogonalises every matrix of its stage.
2. Persistent bytes: weights b·Ψ, gradients b·Ψ, optimizer 2b·Ψ_A (AdamW's m, v) + b·Ψ_M (Muon's B): Muon
   holds half of AdamW's state on the matrices. Transient in the step: U and O of one matrix at a time (the
   logical m×n, in ns_dtype, 4 of them: U, X, A and A·X; with T > 1 the step's gathered pieces, T·Ψ_M/T = Ψ_M
   local elements in ns_dtype).
3. Messages: none of Muon's own without TP; with T > 1 one all_gather_single over tp of T·Ψ_M,local elements
   in ns_dtype per step (`tp_messages`), exposed (the update waits on it). NS FLOPs per matrix and step:
   steps·(4·m'²·n' + 2·m'³), m' = min(m, n), n' = max(m, n) (`newton_schulz_flops`).
4. Restart state: the momentum buffers (kind `momentum/`, one logical tensor per matrix: they reload on any
   mesh, ZeRO or not) next to AdamW's; Muon has no step count of its own (AdamW's t is the layout's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ddp import DDPFacts, DDPLayout, replicated_state_pieces
from optim import build_adamw, update
from step import Messages

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic, torch.optim._muon's DEFAULT_A/B/C
NS_EPS = 1e-7  # ‖U‖ is clamped to at least this before the division


@dataclass(frozen=True)
class MuonConfig:
    """Muon's hyperparameters and how it is sharded under ZeRO (optimizers/zero_muon.py)."""

    lr: float = 0.02  # --muon-lr: Muon's peak lr (torch's default is 1e-3; Keller Jordan's runs use 0.02)
    adamw_lr: float = 2e-3  # --lr: the schedule's peak, so that Muon's lr is lr(step) · lr / adamw_lr
    momentum: float = 0.95  # --muon-momentum μ
    weight_decay: float = 0.1  # --weight-decay λ
    nesterov: bool = True
    ns_steps: int = 5
    ns_dtype: torch.dtype = torch.bfloat16  # what NS multiplies in (train.py: the run's compute dtype)
    owner: bool = False  # --muon-owner: under ZeRO, each matrix held and updated whole by one owner rank

    def lr_at(self, adamw_lr_now: float) -> float:
        """Muon's lr when the schedule gives AdamW `adamw_lr_now` (warmup and decay alike)."""
        return self.lr * adamw_lr_now / self.adamw_lr


# ---------------------------------------------------------------------------------------------------------
# The update (torch.optim._muon's arithmetic, on any piece of the buffers: every op but NS is elementwise)
# ---------------------------------------------------------------------------------------------------------


def is_matrix(param) -> bool:
    """Muon's share: a 2-D weight inside a transformer block (by its logical record: a TP piece is one too)."""
    info = param.shard_info
    return len(info.global_shape) == 2 and info.global_name.startswith("transformer.h.")


def nesterov_input(momentum: torch.Tensor, grad: torch.Tensor, config: MuonConfig) -> torch.Tensor:
    """B ← μ·B + (1 − μ)·g in place; returns NS's input U (a new tensor under Nesterov, else B itself)."""
    momentum.lerp_(grad, 1 - config.momentum)
    return grad.lerp(momentum, config.momentum) if config.nesterov else momentum


def newton_schulz(matrix: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """NS₅(U) in `dtype`: torch.optim._muon._zeropower_via_newtonschulz's ops, in its order (bitwise at bf16)."""
    a, b, c = NS_COEFFICIENTS
    x = matrix.to(dtype, copy=True)
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        x = x.T  # iterate on the wide side: A = X·Xᵀ is min(m, n)²
    x.div_(x.norm().clamp(min=NS_EPS))
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, shape: tuple) -> float:
    """torch's "original" shape adjustment of the LOGICAL shape (m, n): lr·√max(1, m/n)."""
    return lr * math.sqrt(max(1, shape[0] / shape[1]))


def apply_update(weight: torch.Tensor, ortho: torch.Tensor, lr: float, config: MuonConfig, shape: tuple) -> None:
    """W ← W·(1 − lr·λ) − adjusted_lr·O on any piece of W (and the same piece of O)."""
    weight.mul_(1 - lr * config.weight_decay)
    weight.add_(ortho, alpha=-adjusted_lr(lr, shape))


def orthogonalized(inputs: list, infos: list, config: MuonConfig, tp_group=None) -> list:
    """NS of each logical matrix, as the local piece of it (`inputs[i]`: the local piece of U of the matrix
    `infos[i]` records). Pieces split by TP are all-gathered over `tp_group` in one call, assembled as the
    logical matrix, orthogonalised, and cut again; every TP rank computes the same NS."""
    split = [i for i, info in enumerate(infos) if info.splits]
    if split and tp_group is not None and dist.get_world_size(tp_group) > 1:
        T = dist.get_world_size(tp_group)
        local = torch.cat([inputs[i].reshape(-1).to(config.ns_dtype) for i in split])
        gathered = torch.empty(T * local.numel(), dtype=local.dtype, device=local.device)
        dist.all_gather_single(gathered, local, group=tp_group)
        per_rank, offset, whole = gathered.view(T, -1), 0, {}
        for i in split:
            n = inputs[i].numel()
            whole[i] = assemble(infos[i], [per_rank[t, offset:offset + n].view(inputs[i].shape) for t in range(T)])
            offset += n
    else:
        whole = {i: inputs[i] for i in split}  # one TP rank (tests): the piece is the logical matrix's only split
        if split and any(infos[i].splits[0].num > 1 for i in split):
            raise ValueError("a TP-split matrix needs its TP group to be orthogonalised whole")
    out = []
    for i, (u, info) in enumerate(zip(inputs, infos)):
        ortho = newton_schulz(whole.get(i, u), config.ns_steps, config.ns_dtype)
        out.append(info.shard_of(ortho) if i in whole else ortho)
    return out


def assemble(info, pieces: list) -> torch.Tensor:
    """The logical matrix from the T pieces of it that TP ranks 0..T−1 hold (one Split: tensor parallel's)."""
    if len(info.splits) != 1:
        raise ValueError(f"{info.global_name}: Muon assembles a matrix cut by one split (TP), got {info.splits}")
    full = torch.empty(info.global_shape, dtype=pieces[0].dtype, device=pieces[0].device)
    for t, piece in enumerate(pieces):
        replace(info, splits=(replace(info.splits[0], index=t),)).place_into(full, piece)
    return full


# ---------------------------------------------------------------------------------------------------------
# DDP: ddp.py's buckets and the one update order, AdamW on the rest, Muon on the matrices
# ---------------------------------------------------------------------------------------------------------


class MuonDDPLayout(DDPLayout):
    """ddp.DDPLayout with Muon on the matrices (`is_matrix`): its buckets, its norm and skip (optim.update), torch
    AdamW on the rest; then every rank runs Muon on every matrix of its stage, the TP pieces gathered over
    `tp_group`. `adamw`: build_adamw's keyword arguments (lr, weight_decay, betas, eps)."""

    def __init__(self, ddp, config: MuonConfig, adamw: dict, coords: dict | None = None, update_group=None,
                 tp_group=None):
        params = [p for p in ddp.parameters() if p.requires_grad]
        self.matrices = [p for p in params if is_matrix(p)]
        optimizer = build_adamw([p for p in params if not is_matrix(p)], **adamw)
        super().__init__(ddp, optimizer, coords, update_group)
        self.config, self.tp_group, self.adamw_lr = config, tp_group, adamw["lr"]
        self.momenta = [torch.zeros_like(p) for p in self.matrices]

    def step(self, scaler, clip: float, extra_nonfinite=None):
        """optim.update's order (finite check, global norm, clip, step or skip), its step AdamW then Muon."""
        def adamw_then_muon():
            self.optimizer.step()
            self.muon_step()

        grads = [p.grad for p in self.params]
        return update(grads, self.counted, scaler, clip, adamw_then_muon, grads[0].device,
                      extra_nonfinite=extra_nonfinite, group=self.update_group)

    @torch.no_grad()
    def muon_step(self) -> None:
        inputs = [nesterov_input(b, p.grad, self.config) for b, p in zip(self.momenta, self.matrices)]
        infos = [p.shard_info for p in self.matrices]
        lr = self.config.lr_at(self.adamw_lr)
        for p, ortho, info in zip(self.matrices, orthogonalized(inputs, infos, self.config, self.tp_group), infos):
            apply_update(p, ortho, lr, self.config, info.global_shape)

    def set_lr(self, lr: float):
        super().set_lr(lr)
        self.adamw_lr = lr

    def state_pieces(self) -> list:
        """DDP's pieces, with each matrix's momentum (kind `momentum/`) in place of AdamW's moments."""
        sizes = {name: dist.get_world_size(group) for name, group in self.ddp.groups.items()}
        muon = {p: [("momentum", b)] for p, b in zip(self.matrices, self.momenta)}
        return replicated_state_pieces(self.params, self.optimizer, self.coords, sizes, muon)

    def held_bytes(self) -> dict:
        held = super().held_bytes()
        momenta = sum(b.nbytes for b in self.momenta)
        return {**held, "optimizer": held["optimizer"] + momenta, "total": held["total"] + momenta}

    def predicted_persistent(self) -> dict:
        """(b_w + b_g)·Ψ + 2b·Ψ_A + b·Ψ_M (docstring item 2)."""
        b = self.params[0].element_size()
        psi_m = sum(p.numel() for p in self.matrices)
        psi = sum(p.numel() for p in self.params)
        optimizer = 2 * b * (psi - psi_m) + b * psi_m
        return {"weights": b * psi, "grads": b * psi, "optimizer": optimizer, "total": 2 * b * psi + optimizer}

    def predicted_messages(self, micro_batches: int = 1) -> Messages:
        return super().predicted_messages(micro_batches) + tp_messages(self.matrices, self.tp_group, self.config)

    def facts(self) -> DDPFacts:
        return replace(super().facts(), muon=self.muon_facts())

    def muon_facts(self) -> MuonFacts:
        gemms = tuple(ns_gemm(p.shard_info.global_shape, self.config.ns_steps) for p in self.matrices)
        return MuonFacts("ddp", len(self.matrices), sum(f for f, _ in gemms), sum(b.nbytes for b in self.momenta),
                         (self.predicted_persistent()["total"],), (gemms,), 0,
                         tp_messages(self.matrices, self.tp_group, self.config), self.config)


# ---------------------------------------------------------------------------------------------------------
# Pure formulas (the accounting's: report/muon.py, planner/time_model.py)
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MuonFacts:
    """What the accounting reads of a Muon layout (its facts().muon): report/muon.py, planner/time_model.py."""

    way: str  # "ddp" | "gather" | "owner"
    matrices: int  # the matrices of this rank's stage (its TP pieces count once each)
    ns_flops_stage: float  # NS FLOPs of every matrix of the stage once (the work if each were computed once)
    momentum_bytes: float  # Muon's state this rank holds
    held_by_rank: tuple  # the persistent bytes each rank of the data-parallel group holds (owner: uneven)
    ns_gemms_by_rank: tuple  # per rank of that group: ((NS FLOPs per step, smallest dim) of each matrix it runs)
    rank: int  # this rank's index in the data-parallel group (DDP: 0, every rank alike)
    messages: Messages  # the update's own messages per step (exposed: the update waits on them)
    config: MuonConfig

    @property
    def ns_flops_by_rank(self) -> tuple:
        return tuple(sum(flops for flops, _ in gemms) for gemms in self.ns_gemms_by_rank)

    @property
    def ns_flops(self) -> float:
        """NS FLOPs this rank runs per step."""
        return self.ns_flops_by_rank[self.rank]


def newton_schulz_flops(shape: tuple, steps: int = 5) -> float:
    """NS's matmul FLOPs on an m×n matrix, per iteration: X·Xᵀ 2m'²n', c·A·A + b·A 2m'³, (…)·X 2m'²n'."""
    small, large = sorted(shape[:2])
    return steps * (4 * small * small * large + 2 * small ** 3)


def ns_gemm(shape: tuple, steps: int = 5) -> tuple:
    """(NS FLOPs, the smallest dimension) of a logical matrix: the time model prices the GEMMs by that dimension."""
    return newton_schulz_flops(shape, steps), min(shape[:2])


def tp_messages(matrices: list, tp_group, config: MuonConfig) -> Messages:
    """`orthogonalized`'s one all_gather_single over tp per step of the split matrices (payload T·Σ local, in
    ns_dtype); none with one TP rank."""
    split = [p for p in matrices if p.shard_info.splits]
    if not split or tp_group is None or dist.get_world_size(tp_group) == 1:
        return Messages()
    T, itemsize = dist.get_world_size(tp_group), config.ns_dtype.itemsize
    return Messages({("all_gather_single", "tp"): (1, T * itemsize * sum(p.numel() for p in split))})


def imbalance(values) -> float:
    """max/mean of per-rank figures (1.0: balanced; 0/0 counts as balanced)."""
    values = list(values)
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean else 1.0


# ---------------------------------------------------------------------------------------------------------
# Wiring: the flags (cli/flags.py calls these once, before any rank waits)
# ---------------------------------------------------------------------------------------------------------


OPTIMIZERS = ("adamw", "muon")


def add_arguments(group) -> None:
    """--optimizer and Muon's flags, in cli/arguments.py's optimization group."""
    group.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                       help="adamw: AdamW on every parameter; muon: Muon (momentum, Nesterov, 5 quintic Newton-Schulz"
                            " steps, lr·sqrt(max(1, rows/cols))) on the transformer blocks' 2-D weights (attention's"
                            " and the MLP's matrices), AdamW (--lr) on the embeddings, the head, LayerNorms and"
                            " biases (optimizers/muon.py) (default: adamw)")
    group.add_argument("--muon-lr", type=float, default=0.02,
                       help="Muon's peak learning rate, on --lr's schedule (default: 0.02)")
    group.add_argument("--muon-momentum", type=float, default=0.95,
                       help="Muon's momentum μ, in [0, 1) (default: 0.95)")
    group.add_argument("--muon-owner", action="store_true",
                       help="under --zero 1|2|3: each matrix is held, reduced to and updated whole by one owner rank"
                            " (balanced by Newton-Schulz FLOPs), its new weights broadcast; without it each rank"
                            " all-gathers the matrices its shard touches (optimizers/zero_muon.py) (default: off)")


def config_from_flags(args) -> MuonConfig | None:
    """Muon's config, or None with --optimizer adamw; ValueError naming the flag for what Muon cannot serve."""
    if args.optimizer != "muon":
        stray = [flag for flag, value, default in (("--muon-lr", args.muon_lr, 0.02),
                                                   ("--muon-momentum", args.muon_momentum, 0.95),
                                                   ("--muon-owner", args.muon_owner, False)) if value != default]
        if stray:
            raise ValueError(f"{stray[0]} needs --optimizer muon; without it the flag would be ignored")
        return None
    if not (math.isfinite(args.muon_lr) and args.muon_lr > 0):
        raise ValueError(f"--muon-lr must be a positive number, got {args.muon_lr}")
    if not (math.isfinite(args.muon_momentum) and 0 <= args.muon_momentum < 1):
        raise ValueError(f"--muon-momentum must be in [0, 1), got {args.muon_momentum}")
    if args.muon_owner and not args.zero:
        raise ValueError("--muon-owner needs --zero 1, 2 or 3: under DDP every rank holds every matrix already")
    if args.plan_search:
        raise ValueError("--optimizer muon with --plan-search: the search's formulas are AdamW's; --plan each layout")
    refused = (("--moe-experts", args.moe_experts, "the experts' matrices are not assigned to Muon's updates"),
               ("--fp8", args.fp8, "ZeRO-3 gathers FP8 weights as codes, which Muon's units do not carry"),
               ("--precision-recipe", args.precision_recipe, "its NVFP4 weights travel as codes under ZeRO-3"),
               ("--diloco-h", args.diloco_h, "DiLoCo's inner optimizer is AdamW"),
               ("--offload", args.offload, "the host's update is AdamW's"),
               ("--pp-redundant", args.pp_redundant, "its shadow stages' state is AdamW's; not tested with Muon"),
               ("--tp-comm-bits", args.tp_comm_bits != 16, "not tested with Muon's gathered TP matrices"),
               ("--dp-comm-bits", args.dp_comm_bits != 16, "not tested with Muon's layouts"))
    for flag, value, why in refused:
        if value:
            raise ValueError(f"--optimizer muon with {flag}: not served ({why}); use --optimizer adamw")
    return MuonConfig(lr=args.muon_lr, adamw_lr=args.lr, momentum=args.muon_momentum,
                      weight_decay=args.weight_decay, owner=args.muon_owner)
