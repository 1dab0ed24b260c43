"""MuonClip's QK-clip (`--qk-clip τ`, Kimi K2, arXiv 2507.20534): after each optimizer step, every attention head
whose largest pre-softmax logit of the step exceeded τ has its query and key projections scaled back.

For layer l and head h, with q_i, k_j its queries and keys (c_attn's output: [q | k | v], heads contiguous),

    S_max(l, h) = max over the step's micro-batches, over i and j ≤ i (causal), of q_i·k_j / √d_head

and, if S_max > τ, with γ = τ / S_max, after the update (whatever the optimizer; Kimi pairs it with Muon):

    W_q[h rows] ← √γ·W_q[h rows],  b_q[h] ← √γ·b_q[h],  W_k[h rows] ← √γ·W_k[h rows],  b_k[h] ← √γ·b_k[h]

so that the head's logits of the same inputs scale by γ (q·k is bilinear in the two): its S_max becomes τ.
Heads at or under τ are untouched. The logits are those of the weights before the update (the step's forwards),
as Kimi's. A step the update skipped (non-finite gradients) clips nothing.

How: `HeadMax` is a forward hook on each attention's c_attn. It reads the projection's output (no recompute of q
and k: what the attention sees, under TP its local heads, under SP the whole sequence), takes the causal logits
under no_grad, and keeps the running max per head; a forward that does not train (eval, sampling, a recompute
inside backward: step.is_training_forward) records nothing, and the max would be idempotent anyway. After the
update (`QKClip.after_update`, step.train_step's hook) the maxima are all-reduced with MAX over dp×cp, so every
replica clips alike, then each layer's logical scale (a vector over c_attn's 3·n_embd output rows: √γ on q's and
k's rows of a clipped head, 1 elsewhere) multiplies every copy of the weight the layout keeps, found by its state
pieces (`layout.state_pieces()`, kinds `param/` and `master/`, each cut as its record says: a TP piece, a ZeRO flat
range, a Muon owner's whole matrix): the working weights and the fp32 masters (a working copy in bf16 is scaled in
its own dtype, one rounding, until the next publish rewrites it from the master). A piece that aliases one already
scaled (ZeRO's master when the dtypes agree is the working slice) is scaled once.

Refused (one line, exit 2): --cp > 1 (a rank's queries would have to meet every earlier key: the keys would have
to be gathered over the CP group), --diloco-h (the outer anchor is a copy it would not scale), --pp-redundant (the
shadow stages' copies), --offload (the host's masters). Everything else is served: DDP, ZeRO-1/2/3 (each rank
scales the rows of W_q and W_k it holds), TP (heads are local to a TP rank: no TP collective), PP (each stage its
own layers), MoE (its attention is dense), AdamW or Muon; FP8 and the precision recipes quantise the scaled
weights from the next forward on (their caches of a weight's codes end with each step), served but not tested.

Accounting (L the attention layers this rank holds, H' the heads of each it holds: H/T):
1. Replicated vs split: the maxima L·H' floats, replicated over dp×cp after the all-reduce; split by TP and PP.
2. Persistent: L·H' fp32 per rank (float64 in a float64 run, as the message). Transient: the logits of one
   micro-batch's layer, B·H'·s² (the unfused attention's), and one layer's logical scale (3·n_embd) at a time.
3. Messages: one all-reduce (MAX) of L·H' fp32 over dp×cp per step, when dp×cp > 1 (`predicted_messages`);
   it blocks the step's end (the scale waits for it). Nothing over tp, pp or cp. One host synchronisation per
   step (which heads clip: the scale is built on the host, one logical row vector per clipped layer).
4. Restart state: none (the maxima restart with each step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from model import CausalSelfAttention
from step import Axis, Messages, is_training_forward

SCALED_KINDS = ("param", "master")  # the state pieces that are copies of a weight (not Adam's moments, momenta)


def max_logits(qkv: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[heads] the largest causal logit q_i·k_j/√d (j ≤ i) of each head in c_attn's output (batch, seq, 3·width)."""
    batch, seq, _ = qkv.shape
    q, k, _ = qkv.detach().chunk(3, dim=-1)
    q, k = (t.reshape(batch, seq, -1, head_dim).transpose(1, 2) for t in (q, k))  # (batch, heads, seq, head_dim)
    if q.element_size() < 4:
        q, k = q.float(), k.float()
    logits = q @ k.transpose(-2, -1) / math.sqrt(head_dim)  # (batch, heads, seq, seq)
    future = torch.ones(seq, seq, dtype=torch.bool, device=qkv.device).triu(1)
    return logits.masked_fill(future, float("-inf")).amax(dim=(0, 2, 3))


class HeadMax:
    """The forward hook on one c_attn: the running max of each of its (local) heads' logits over the step."""

    def __init__(self, head_dim: int, dtype: torch.dtype):
        self.head_dim, self.dtype, self.value = head_dim, dtype, None

    def __call__(self, module, inputs, output) -> None:
        if not is_training_forward(module.training):  # asked before no_grad, which would answer it
            return
        with torch.no_grad():
            now = max_logits(output, self.head_dim).to(self.dtype)
        self.value = now if self.value is None else torch.maximum(self.value, now)


@dataclass(frozen=True)
class QKClipConfig:
    tau: float  # τ: the largest pre-softmax logit a head may keep


@dataclass(frozen=True)
class QKClipFacts:
    """What the accounting reads of the axis: τ, the heads it watches, and the last step's clipped heads."""

    tau: float
    heads: int  # L·H' on this rank
    clipped_last_step: int  # heads clipped by the last step
    clipped_total: int  # head-steps clipped since the start (this process)
    message_bytes: int  # the maxima's all-reduce payload per step (0: one rank, no message)


class QKClip(Axis):
    """The handle: one HeadMax on each held attention's c_attn (keyed by the weight's global name), the group the
    maxima are all-reduced over (None or one rank: none), and the step's clip (`after_update`)."""

    name = "qk_clip"

    def __init__(self, config: QKClipConfig, model, group=None, dtype: torch.dtype = torch.float32):
        self.config, self.group, self.dtype, self.clipped, self.clipped_total = config, group, dtype, 0, 0
        self.recorders = {}  # {c_attn's weight global name: HeadMax}
        self.heads = {}  # {that name: the global index of each local head, [H']}
        self.width = {}  # {that name: n_embd, the logical width of each of q, k and v}
        for module in model.modules():
            if isinstance(module, CausalSelfAttention):
                weight = next(p for n, p in module.c_attn.named_parameters() if n.endswith("weight"))  # TP: .linear's
                info = weight.shard_info
                self.recorders[info.global_name] = recorder = HeadMax(module.head_dim, dtype)
                rows = info.shard_of(torch.arange(info.global_shape[0]).unsqueeze(1).expand(info.global_shape))[:, 0]
                local_q = rows[:rows.numel() // 3]  # the local q rows' logical indices (TP: its heads' rows)
                self.heads[info.global_name] = local_q[::module.head_dim] // module.head_dim
                self.width[info.global_name] = info.global_shape[0] // 3
                self.head_dim = module.head_dim
                module.c_attn.register_forward_hook(recorder)

    @torch.no_grad()
    def after_update(self, layout, skipped: bool) -> None:
        """The step's maxima (MAX over dp×cp), then every clipped head's rows scaled in every copy the layout keeps."""
        if not self.recorders:
            return
        names = list(self.recorders)
        maxima = torch.stack([self.recorders[name].value for name in names])  # (L, H')
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=self.group)
        for recorder in self.recorders.values():
            recorder.value = None
        clipped = torch.isfinite(maxima) & (maxima > self.config.tau) & (not skipped)
        self.clipped = int(clipped.sum())
        self.clipped_total += self.clipped
        if not self.clipped:
            return
        gammas = torch.where(clipped, self.config.tau / maxima.double(), 1.0).cpu()
        scales = {}  # {c_attn's weight global name: its logical row scale, [3·n_embd]}
        for name, gamma in zip(names, gammas):
            if (gamma < 1).any():
                scales[name] = row_scale(self.heads[name], gamma.sqrt(), self.width[name], self.head_dim)
        scale_pieces(layout.state_pieces(), scales)

    def predicted_messages(self, layout) -> Messages:
        """One all-reduce (MAX) of L·H' fp32 (float64 in a float64 run) over dp×cp per step (docstring item 3)."""
        if not self.recorders or self.group is None or dist.get_world_size(self.group) == 1:
            return Messages()
        heads = sum(h.numel() for h in self.heads.values())
        return Messages({("all_reduce", "dp_cp"): (1, self.dtype.itemsize * heads)})

    def facts(self) -> QKClipFacts:
        payload = sum(count.payload for count in self.predicted_messages(None).values())
        return QKClipFacts(self.config.tau, sum(h.numel() for h in self.heads.values()), self.clipped,
                           self.clipped_total, int(payload))


def row_scale(heads: torch.Tensor, factors: torch.Tensor, width: int, head_dim: int) -> torch.Tensor:
    """[3·width] the logical scale of c_attn's output rows: factors[j] on the q and k rows of head heads[j], 1 on
    the others' and on v's."""
    scale = torch.ones(3 * width, dtype=torch.float64)
    for head, factor in zip(heads.tolist(), factors.tolist()):
        for start in (head * head_dim, width + head * head_dim):  # its q rows, its k rows
            scale[start:start + head_dim] = factor
    return scale


def scale_pieces(pieces: list, scales: dict) -> None:
    """Multiply each weight and master piece of a c_attn in `scales` ({weight global name: row scale}; its bias,
    named alike, takes the same vector) by its part of the logical scale: cut by its record (TP's split), then its
    flat range (ZeRO's). A piece whose memory lies inside one already scaled (an aliased master) is skipped."""
    done = []  # (storage, first byte, end byte) of each piece scaled
    ordered = sorted(pieces, key=lambda piece: SCALED_KINDS.index(piece.key.split("/")[0])
                     if piece.key.split("/")[0] in SCALED_KINDS else len(SCALED_KINDS))
    for piece in ordered:
        kind, name = piece.key.split("/", 1)
        weight = name.removesuffix(".bias") + ".weight" if name.endswith(".bias") else name
        if kind not in SCALED_KINDS or weight not in scales or piece.tensor.numel() == 0:
            continue
        tensor = piece.tensor
        storage = tensor.untyped_storage().data_ptr()
        first = tensor.storage_offset() * tensor.element_size()
        end = first + tensor.numel() * tensor.element_size()
        if any(s == storage and a <= first and end <= b for s, a, b in done):
            continue
        rows = scales[weight]
        logical = rows if name.endswith(".bias") else rows.unsqueeze(1).expand(piece.shard.global_shape)
        local = piece.shard.shard_of(logical).reshape(-1)
        if piece.flat_range is not None:
            local = local[piece.flat_range[0]:piece.flat_range[1]]
        flat = tensor.view(-1)  # a 16-bit copy: multiplied in fp32, rounded once
        flat.copy_(flat * local.to(flat.device, torch.promote_types(flat.dtype, torch.float32)))
        done.append((storage, first, end))


# ---------------------------------------------------------------------------------------------------------
# Wiring: the flag (cli/arguments.py adds it; cli/flags.py calls config_from_flags once, before any rank waits)
# ---------------------------------------------------------------------------------------------------------


def add_arguments(group) -> None:
    group.add_argument("--qk-clip", type=float, default=None, metavar="TAU",
                       help="MuonClip's QK-clip (Kimi K2): after each step, every attention head whose largest"
                            " pre-softmax logit q.k/sqrt(d) of the step exceeded TAU has its W_q and W_k rows (and"
                            " biases) scaled by sqrt(TAU/max); with any --optimizer (Kimi pairs it with muon);"
                            " refused with --cp > 1, --diloco-h, --pp-redundant, --offload"
                            " (optimizers/qk_clip.py) (default: off)")


def config_from_flags(args, settings) -> QKClipConfig | None:
    """τ, or None without the flag; ValueError naming --qk-clip for a bad value or a layout it does not serve."""
    if args.qk_clip is None:
        return None
    if not (math.isfinite(args.qk_clip) and args.qk_clip > 0):
        raise ValueError(f"--qk-clip must be a positive number, got {args.qk_clip}")
    refused = (("--cp > 1", settings.shape.cp > 1, "a rank's queries would need every earlier key of the sequence"),
               ("--diloco-h", settings.diloco is not None, "the outer anchor is a copy it does not scale"),
               ("--pp-redundant", args.pp_redundant, "the shadow stages hold copies of the weights it does not scale"),
               ("--offload", args.offload, "the host's master weights are a copy it does not scale"))
    for flag, value, why in refused:
        if value:
            raise ValueError(f"--qk-clip with {flag}: not served ({why})")
    return QKClipConfig(args.qk_clip)


def apply(model, run, config: QKClipConfig) -> QKClip:
    """The hooks on each held attention, the maxima (fp32; float64 in a float64 run) all-reduced over dp×cp."""
    dtype = torch.float64 if run.compute_dtype == torch.float64 else torch.float32
    return QKClip(config, model, run.mesh.group("dp_cp"), dtype)
