"""A 4-bit all-reduce with error feedback (Echo, arXiv 2610.14277), from raw collectives: TP's f and g, DDP's buckets.

Tensor parallel's all-reduce sits between two dependent matmuls (nothing hides it) and data parallel's sums every
gradient; 4 bits instead of 16 cut the bytes to about a quarter, but an all-reduce sums, so every call injects a
rounding error and what matters is how those errors add up. Echo sends 4-bit data, sums in high precision, quantises
each value at most twice per call whatever the number of ranks, and feeds the error a call injected back into a later
call, so that old errors cancel instead of accumulating.

One call (`all_reduce`) over a group of N ranks, x this rank's addend of n elements (padded to N chunks of c, c a
multiple of the 16-element block):
    reduce-scatter  rank t quantises each chunk k ≠ t of x (minus the feedback it holds) and sends it to its owner k,
                    all in one all_to_all_single of uint8 rows; its own chunk t stays unquantised
    sum             the owner decodes the N - 1 rows it received and sums them with its own chunk in fp32 (fp64 for
                    fp64 tensors), in rank order
    all-gather      the owner quantises that sum once more and all_gather_single's the codes; every rank (the owner
                    too) decodes all N chunks, so every rank holds the same values
A value is quantised by its sender and, summed, by its owner: twice at most, for any N.

The format: NVFP4's codes (precision/microscaling.py): E2M1 elements two per byte, one E4M3 scale per 16 elements and
one fp32 scale per chunk (S_enc = 448·6/amax of the chunk, local to its sender: no extra reduction), 4.5 bits an
element + 32 a chunk, against MXFP4's 4.25 (E8M0 power-of-two scales per 32). NVFP4 because its smaller blocks and
finer scales err less, 9.5% relative error on Gaussian data against MXFP4's 11.6% and on heavy-tailed (Student-t 3)
data 9.1% against 15.3%, for 6% more bytes. A row on the wire: [S_enc (4 bytes) | codes (c/2) | block scales (c/16)].

Error feedback. Each quantisation's error (decoded − intended) is computed where it is made: a sender's for the chunks
it sent, the owner's for the sum, where the sum is taken. The call returns it (fp32, x's padded length: each rank's
sent chunks' errors and its owned chunk's sum error) and the next call subtracts it from its own addend before
quantising. The errors then telescope: after calls 1..K whose outputs add into one stream, Σ outputs − Σ exact sums =
the last call's error alone, bounded whatever K (without feedback it is Σ_k of K errors: √K growth). "Later" is:
    TP (TensorParallelReduction): the next call of the same pass. Forward: every g's output (the embedding's, each
        block's attention and MLP) adds into the one residual stream, so the forward's accumulated error is one call's
        (exactly, with dropout 0; a dropout mask scales a call's error before it adds). Backward: every f's output
        passes a LayerNorm's backward before it adds into the residual gradient, so there the cancellation is as good
        as consecutive LayerNorm Jacobians are alike. The chains restart at every forward (a hook on the model).
    DDP (GradientReduction): the same bucket next step: the step's sum of a bucket carries the previous step's error
        of that bucket back, so the gradients the optimizer has applied add up to the exact sums but one step's error.

Accounting (n elements of a call, N the group's ranks, c = ⌈n/(16N)⌉·16, B = 4 + c/2 + c/16 bytes a row):
1. Replicated and split: the summed tensor is replicated (every rank decodes the same codes); each rank owns the sum
   of one chunk in phase 1.
2. Peak per device, temporary per call: the fp32 copy of x and its error (2 × 4·N·c), the send and receive rows and
   the gathered codes (3·N·B), the decoded output (4·N·c). Held: TP, the last call's error of each chain, 2 × 4·N·c
   for the step's activation [b, s, h] (transient: a pass's, never across a step); DDP, one fp32 error per bucket,
   4·Σ N·c ≈ 4 bytes a gradient element (DDPLayout.held_bytes' "feedback").
3. Messages per call, on the caller's group: all_to_all_single N·B and all_gather_single N·B, each sending (N-1)·B,
   against an all_reduce's 2(N-1)/N·n·e: 2(N-1)·B ≈ (N-1)/N·n·(9/16 + 8/c) bytes, 28% of bf16's (`call_messages`).
   TP's are on the critical path as before; DDP's run synchronously as each bucket fills (they no longer overlap
   backward: the planner prices them exposed, planner/time_model.py).
4. Restart state: TP's chains none (a pass never spans a checkpoint). DDP's errors are checkpointed per rank, under a
   key naming the mesh, the rank, the bucket and its length (`state_pieces`): the same mesh resumes bitwise; a resume
   that leaves the stored errors unread (another mesh, or without --dp-comm-bits 4) is refused by ckpt.py unless
   --drop-state, and then the feedback starts from zero (one step's error dropped, the bound unchanged).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from precision import microscaling
from shard import ShardInfo, StatePiece
from step import Axis, Messages

BLOCK = 16  # NVFP4's elements per block scale; every chunk is a multiple of it
BITS = (4, 16)  # --tp-comm-bits, --dp-comm-bits: 4 is this file's all-reduce; 16 the exact one (the default)
FEEDBACK = ("on", "off")  # --comm-feedback


# ---------------------------------------------------------------------------------------------------------
# The codecs: how one chunk of c elements travels as a row of bytes
# ---------------------------------------------------------------------------------------------------------


class NVFP4:
    """NVFP4 codes of a chunk, one uint8 row: [S_enc fp32 | E2M1 codes, two a byte | E4M3 block scales]."""

    name = "nvfp4"

    @staticmethod
    def row_bytes(c: int, element_bytes: int) -> int:
        return 4 + c // 2 + c // BLOCK

    @staticmethod
    def encode(chunk: torch.Tensor) -> torch.Tensor:
        q = microscaling.quantize(chunk, "nvfp4")
        return torch.cat([q.tensor_scale.float().reshape(1).view(torch.uint8), q.codes,
                          q.block_scales.view(torch.uint8)])

    @staticmethod
    def decode(row: torch.Tensor, c: int, dtype: torch.dtype) -> torch.Tensor:
        scale = row[:4].clone().view(torch.float32).reshape(())
        codes, scales = row[4:4 + c // 2], row[4 + c // 2:].view(torch.float8_e4m3fn)
        q = microscaling.Quantized(codes, scales, scale, torch.Size([c]), microscaling.FORMATS["nvfp4"])
        return microscaling.dequantize(q, dtype)


class Identity:
    """The chunk's own bytes (fp32, fp64 for fp64 tensors): quantisation as the identity, what the tests hold
    bitwise against dist.all_reduce."""

    name = "identity"

    @staticmethod
    def row_bytes(c: int, element_bytes: int) -> int:
        return c * wide_bytes(element_bytes)

    @staticmethod
    def encode(chunk: torch.Tensor) -> torch.Tensor:
        return chunk.contiguous().view(torch.uint8)

    @staticmethod
    def decode(row: torch.Tensor, c: int, dtype: torch.dtype) -> torch.Tensor:
        return row.view(dtype)


CODECS = {"nvfp4": NVFP4, "identity": Identity}


def wide_bytes(element_bytes: int) -> int:
    """The bytes of an element as the call sums it: fp64 stays fp64, everything else is summed in fp32."""
    return 8 if element_bytes == 8 else 4


def chunk_elements(n: int, size: int) -> int:
    """c: the elements of each of the N chunks of an n-element tensor, a multiple of the block (padded with zeros)."""
    return -(-n // (size * BLOCK)) * BLOCK


# ---------------------------------------------------------------------------------------------------------
# The quantised all-reduce
# ---------------------------------------------------------------------------------------------------------


@torch.no_grad()
def all_reduce(x: torch.Tensor, group, codec=NVFP4, feedback: torch.Tensor | None = None) -> tuple:
    """(Σ over `group` of x, in x's shape and dtype; the error this call injected, flat [N·c] in the sum's dtype).

    feedback: an earlier call's error (its second result), subtracted from x before anything is quantised. The
    returned error is this rank's part of this call's: decoded − intended for the chunks it sent and for the sum it
    owns; a non-finite one is carried on as 0 (the output keeps the NaN, the trainer's non-finite count sees it)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    n, c = x.numel(), chunk_elements(x.numel(), size)
    row = codec.row_bytes(c, x.element_size())
    flat = torch.zeros(size * c, dtype=wide, device=x.device)
    flat[:n] = x.reshape(-1)
    if feedback is not None:
        flat.sub_(feedback)  # x - 0 is x bitwise: the identity's zero errors change nothing
    chunks, error = flat.view(size, c), torch.empty(size, c, dtype=wide, device=x.device)
    # Reduce-scatter: chunk k to its owner k as codes; this rank's own chunk does not travel (its row stays 0).
    send = torch.zeros(size, row, dtype=torch.uint8, device=x.device)
    for k in range(size):
        if k != rank:
            send[k] = codec.encode(chunks[k])
            error[k] = codec.decode(send[k], c, wide) - chunks[k]
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    total = None  # the owner's sum, in rank order
    for j in range(size):
        part = chunks[rank] if j == rank else codec.decode(received[j], c, wide)
        total = part.clone() if total is None else total.add_(part)
    # All-gather: the sum quantised once more; every rank decodes every chunk, the owner its own too.
    codes = codec.encode(total)
    error[rank] = codec.decode(codes, c, wide) - total
    gathered = torch.empty(size * row, dtype=torch.uint8, device=x.device)
    dist.all_gather_single(gathered, codes, group=group)
    out = torch.cat([codec.decode(piece, c, wide) for piece in gathered.view(size, row)])
    return out[:n].view(x.shape).to(x.dtype), error.view(-1).nan_to_num_(0.0, 0.0, 0.0)


def call_messages(elements: int, element_bytes: int, codec, group: str, size: int) -> Messages:
    """One call's messages on `group` of `size` ranks (docstring item 3): N rows of B bytes each way."""
    payload = size * codec.row_bytes(chunk_elements(elements, size), element_bytes)
    return Messages().add("all_to_all_single", group, 1, payload).add("all_gather_single", group, 1, payload)


# ---------------------------------------------------------------------------------------------------------
# Where it plugs in: TP's f and g (a hook on tensor_parallel's context), DDP's buckets (given to the layout)
# ---------------------------------------------------------------------------------------------------------


class TensorParallelReduction:
    """TP's f and g through `all_reduce` (tensor_parallel.TensorParallel.reduce_with hands it to the context): the
    error of each call fed into the next call of the same chain, "forward" (the g's) or "backward" (the f's); both
    chains restart at every forward of the model (`restart`)."""

    def __init__(self, codec, size: int, feedback: bool = True):
        self.codec, self.size, self.feedback = codec, size, feedback
        self.last_error = {"forward": None, "backward": None}

    def __call__(self, x: torch.Tensor, group, chain: str) -> torch.Tensor:
        previous = self.last_error[chain]
        if previous is not None and previous.numel() != self.size * chunk_elements(x.numel(), self.size):
            previous = None  # another shape (sampling's growing prompt): a new chain
        out, error = all_reduce(x, group, self.codec, previous)
        if self.feedback:
            self.last_error[chain] = error
        return out

    def restart(self, *hook_args) -> None:
        """A new pass begins (a forward pre-hook on the model): neither chain carries an error into it."""
        self.last_error = {"forward": None, "backward": None}

    def messages(self, elements: int, element_bytes: int) -> Messages:
        """What one f or g of `elements` sends on tp (tensor_parallel.step_messages asks)."""
        return call_messages(elements, element_bytes, self.codec, "tp", self.size)


class GradientReduction:
    """DDP's bucket sum through `all_reduce`, in place and synchronously (ddp.DistributedDataParallel's `reduction`),
    each bucket's error carried to its next step's sum in a buffer DDP keeps with the bucket (`feedback_like`).
    tag: names this rank's checkpoint keys (the mesh and the global rank)."""

    def __init__(self, codec, feedback: bool = True, tag: str = ""):
        self.codec, self.feedback, self.tag = codec, feedback, tag

    def feedback_like(self, buffer: torch.Tensor, group) -> torch.Tensor | None:
        """The error buffer of a bucket (zeros; its padded length in the sum's dtype), or None without feedback."""
        if not self.feedback:
            return None
        size = dist.get_world_size(group)
        wide = torch.float64 if buffer.dtype == torch.float64 else torch.float32
        return torch.zeros(size * chunk_elements(buffer.numel(), size), dtype=wide, device=buffer.device)

    def feedback_bytes(self, elements: int, element_bytes: int, size: int) -> int:
        """What `feedback_like` holds for a bucket of `elements` over `size` ranks (DDPLayout.predicted_persistent)."""
        return size * chunk_elements(elements, size) * wide_bytes(element_bytes)

    def __call__(self, buffer: torch.Tensor, group, feedback: torch.Tensor | None) -> None:
        out, error = all_reduce(buffer, group, self.codec, feedback)
        buffer.copy_(out)
        if feedback is not None:
            feedback.copy_(error)

    def messages(self, elements: int, element_bytes: int, group: str, size: int) -> Messages:
        return call_messages(elements, element_bytes, self.codec, group, size)

    def state_pieces(self, feedbacks: list) -> list:
        """Each bucket's error as a piece of its own (docstring item 4): this rank's, under a key that names the mesh,
        the rank, the bucket and its length; optional, so a checkpoint without it loads (one that has it, read by no
        rank: ckpt.py's --drop-state rule)."""
        pieces = []
        for index, tensor in enumerate(feedbacks):
            if tensor is not None:
                name = f"ddp.{self.tag}.bucket{index}.n{tensor.numel()}"
                pieces.append(StatePiece(f"lowbit/{name}", tensor, ShardInfo(global_name=name,
                                                                              global_shape=tuple(tensor.shape)),
                                         optional=True))
        return pieces


# ---------------------------------------------------------------------------------------------------------
# The axis: its flags, `apply` (TP's hook, the chains' restart), its handle
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LowBitConfig:
    """--tp-comm-bits, --dp-comm-bits, --comm-feedback: validated by config_from_flags."""

    tp_bits: int = 16
    dp_bits: int = 16
    feedback: bool = True
    codec: str = "nvfp4"


@dataclass(frozen=True)
class LowBitFacts:
    """What the accounting reads of the axis (report/axes.py's lowbit section)."""

    config: LowBitConfig
    tp_size: int


class LowBit(Axis):
    """The handle: the TP reduction it installed (None when only DDP's buckets are quantised). Its messages are
    TP's and DDP's own predictions (each asks its reduction); its state is none (DDP checkpoints the buckets')."""

    name = "lowbit"

    def __init__(self, config: LowBitConfig, tp_reduction: TensorParallelReduction | None, tp_size: int):
        self.config, self.tp_reduction, self.tp_size = config, tp_reduction, tp_size

    def facts(self) -> LowBitFacts:
        return LowBitFacts(self.config, self.tp_size)


def config_from_flags(args, settings) -> LowBitConfig | None:
    """The three flags on this layout, or ValueError naming the flag (None: both all-reduces exact)."""
    shape, config = settings.shape, settings.model
    for flag, bits in (("--tp-comm-bits", args.tp_comm_bits), ("--dp-comm-bits", args.dp_comm_bits)):
        if bits not in BITS:
            raise ValueError(f"{flag} {bits}: supported are 4 (NVFP4 codes with error feedback, parallel/lowbit.py)"
                             f" and 16 (the exact all-reduce, the default)")
    if args.comm_feedback not in FEEDBACK:
        raise ValueError(f"--comm-feedback {args.comm_feedback}: expected on or off")
    quantised = args.tp_comm_bits == 4 or args.dp_comm_bits == 4
    if "comm_feedback" in settings.given and not quantised:
        raise ValueError("--comm-feedback needs --tp-comm-bits 4 or --dp-comm-bits 4; without it the flag would be"
                         " ignored")
    if args.tp_comm_bits == 4:
        _check_tensor_parallel(args, shape, config)
    if args.dp_comm_bits == 4:
        if shape.dp * shape.cp == 1:
            raise ValueError("--dp-comm-bits 4 needs a data-parallel group of more than one rank (D·C > 1): there is"
                             " no gradient all-reduce to quantise")
        if args.zero:
            raise ValueError(f"--dp-comm-bits 4 quantises DDP's bucket all-reduce (--zero 0); --zero {args.zero}"
                             f" reduce-scatters its gradients, which it does not quantise")
        if settings.diloco is not None:
            raise ValueError("--dp-comm-bits 4 with --diloco-h: DiLoCo's replicas copy the layout's state, which the"
                             " buckets' error feedback is not part of")
    return LowBitConfig(args.tp_comm_bits, args.dp_comm_bits, args.comm_feedback == "on") if quantised else None


def _check_tensor_parallel(args, shape, config) -> None:
    """--tp-comm-bits 4's layouts: TP's all-reduces exist (T > 1, no SP) and each pass is one chain (no pipeline
    interleaving micro-batches, no recompute rerunning calls, no compiled block holding the chain's state)."""
    if shape.tp == 1:
        raise ValueError("--tp-comm-bits 4 needs --tp > 1: there is no tensor-parallel all-reduce to quantise")
    if args.sp:
        raise ValueError("--tp-comm-bits 4 quantises TP's all-reduces; --sp replaces them by all-gathers and"
                         " reduce-scatters, which it does not quantise")
    if shape.pp > 1:
        raise ValueError("--tp-comm-bits 4 with --pp: the feedback chains run through one pass, and a pipeline"
                         " stage interleaves several micro-batches' passes")
    if config.activation_checkpointing or config.selective_recompute:
        raise ValueError("--tp-comm-bits 4 with --activation-checkpointing: the recompute would rerun the forward's"
                         " quantised calls on another feedback chain and get other values")
    if args.compile:
        raise ValueError("--tp-comm-bits 4 with --compile: a compiled block would trace the feedback chain's state")


def apply(model, run, config: LowBitConfig) -> LowBit:
    """Hand TP's context the quantised reduction (its hook, TensorParallel.reduce_with) and restart its chains at
    every forward of the model; DDP's is built with the layout (`gradient_reduction`, train.build_data_parallel)."""
    reduction, size = None, run.mesh.size("tp")
    if config.tp_bits == 4:
        reduction = TensorParallelReduction(CODECS[config.codec], size, config.feedback)
        next(axis for axis in run.axes if axis.name == "tp").reduce_with(reduction)
        model.register_forward_pre_hook(reduction.restart)
    return LowBit(config, reduction, size)


def gradient_reduction(config: LowBitConfig | None, mesh) -> GradientReduction | None:
    """DDP's bucket reduction under --dp-comm-bits 4 (None: dist.all_reduce), its keys tagged with the mesh."""
    if config is None or config.dp_bits != 4:
        return None
    shape = mesh.shape
    tag = f"D{shape.dp}P{shape.pp}C{shape.cp}T{shape.tp}E{shape.ep}.rank{mesh.rank}"
    return GradientReduction(CODECS[config.codec], config.feedback, tag)


# ---------------------------------------------------------------------------------------------------------
# Prediction formulas
# ---------------------------------------------------------------------------------------------------------


def codec_bytes(elements: float, element_bytes: int, feedback: bool = True) -> float:
    """The memory traffic of one call's encode and decode as a fused kernel would move it (planner/time_model.py
    prices it at the HBM's rate): x read and the sum written (2e), the error read and written (8, with feedback),
    the codes written and read twice (4 × 9/16), per element."""
    return elements * (2 * element_bytes + 8 * feedback + 4 * 9 / 16)


def ratio_to(elements: int, element_bytes: int, size: int, codec=NVFP4) -> float:
    """Bytes one rank sends in a quantised call over what a ring all_reduce of the same tensor sends."""
    sent = 2 * (size - 1) * codec.row_bytes(chunk_elements(elements, size), element_bytes)
    return sent / (2 * (size - 1) / size * elements * element_bytes)
