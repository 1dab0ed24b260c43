"""What a device holds: persistent state per parameter, activations saved for backward, and their measurement.

This file talks over nothing but one all-gather (cuda_memory_peaks takes the maximum over ranks); it observes.
Each formula is closed-form, so a reader can check a number by hand, and each has a measurement beside it:

1. Persistent state: b_w + b_g + b_o bytes per parameter, partitioned over the D data-parallel ranks one kind
   per ZeRO stage: `persistent_bytes` (ZeRO's formula, its paper's Figure 1; zero.py implements it). Measured
   by each layout's held_bytes() and, on CUDA, by the caching allocator's peaks (cuda_memory_peaks). Psi
   itself, by the shapes: param_counts, the one count of the model's, a pipeline stage's or a rank's parameters
   (each axis its own terms: TP divides what it splits, PP picks the stage's layers, MoE adds its experts).
2. Activations, the paper's reference: activation_bytes_per_layer, from Korthikanti et al. 2022, "Reducing
   Activation Recomputation in Large Transformer Models", section 4 (16-bit activations, the a·s² scores
   stored, 1-byte dropout masks).
3. Activations, what the kernels save: ActivationShape and layer_activation_terms, with the embedding's, the
   head's, a checkpointed block's and the hook-hidden terms, derived tensor by tensor from what this model's
   modules, autocast and torch's scaled_dot_product_attention dispatch (attention_kernel) keep for backward;
   tests/accounting/test_activations.py holds the sums against the measurement.
4. Measurement: SavedActivations (saved_tensors_hooks, each storage once), MemoryTimeline (the profiler's CPU
   memory events, every allocation and free: the peak above the start, and the net), LiveTensors (the
   tensors a module's forward makes, alive together at its highest: accounting/moe_memory.py's dispatch buffers) and
   BackwardRise (how far a backward's tensors rise above the forward's saved ones it frees).

Bytes are bytes (mfu.format_bytes prints them). s = sequence length, b = micro-batch size, h = hidden size,
a = attention heads, t (T) = tensor-parallel size, D = data-parallel size, Psi = parameters.
"""

from __future__ import annotations

import os
import sys
import tempfile
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from experts import shared
from moe import experts_of
from zero import BytesPerParam


# ----------------------------------------------------------------------------------------------------------
# 1. Persistent state: ZeRO's partition formula (zero.py's docstring, item 2), measured on CUDA
# ----------------------------------------------------------------------------------------------------------


BYTES_PER_PARAM: dict[str, BytesPerParam] = {
    # fp32 weights and grads plus Adam's two fp32 moments. bf16 autocast also lands here: it casts weights to
    # bf16 on the fly inside each op, but the stored weights and their gradients stay fp32.
    "fp32": BytesPerParam(weights=4, grads=4, optimizer=8),
    # Mixed precision as in the ZeRO paper (Rajbhandari et al. 2020, K = 12): bf16/fp16 working weights and
    # gradients, and the optimizer keeps an fp32 master copy of the weights plus two fp32 moments (4 + 4 + 4).
    "mixed": BytesPerParam(weights=2, grads=2, optimizer=12),
}


def persistent_bytes(psi: int, recipe: str | BytesPerParam, zero_stage: int, dp_size: int) -> dict[str, float]:
    """Bytes per rank of the state that lives for the whole run, for Psi parameters, under ZeRO stage 0..3.

    ZeRO partitions state across the D data-parallel ranks, one more kind per stage:
        stage 0 (plain DDP): (b_w + b_g + b_o) * Psi
        stage 1 (optimizer): (b_w + b_g) * Psi + b_o * Psi / D
        stage 2 (+ grads):   b_w * Psi + (b_g + b_o) * Psi / D
        stage 3 (+ weights): (b_w + b_g + b_o) * Psi / D
    Activations, temporary buffers and fragmentation are extra (below)."""
    bpp = BYTES_PER_PARAM[recipe] if isinstance(recipe, str) else recipe
    if zero_stage not in (0, 1, 2, 3) or dp_size < 1:
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3 and dp_size >= 1, got {zero_stage} and {dp_size}")
    # Split across the D ranks: the optimizer's from stage 1, the grads' from stage 2, the weights' at stage 3.
    out = {kind: getattr(bpp, kind) * psi / (dp_size if zero_stage >= first else 1)
           for kind, first in (("weights", 3), ("grads", 2), ("optimizer", 1))}
    out["total"] = out["weights"] + out["grads"] + out["optimizer"]
    return out


def cuda_memory_peaks(device, group=None) -> tuple[int, int, int]:
    """(allocated, reserved, rank) peaks of the CUDA caching allocator since its last reset
    (torch.cuda.reset_peak_memory_stats), the maximum over the ranks of `group` (a collective: every rank
    calls it), and the rank whose allocated peak it is. Allocated is what tensors held; reserved is what the
    allocator kept from the driver (allocated + its cache and fragmentation): the figure that runs out."""
    local = torch.tensor([torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)],
                         dtype=torch.int64, device=device)
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return int(local[0]), int(local[1]), 0
    every = torch.empty(dist.get_world_size(group) * 2, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(every, local, group=group)
    every = every.view(-1, 2)  # row r: rank r's (allocated, reserved)
    return int(every[:, 0].max()), int(every[:, 1].max()), int(every[:, 0].argmax())


# ----------------------------------------------------------------------------------------------------------
# 1. Persistent state: the parameters it is per (Ψ), by the shapes
# ----------------------------------------------------------------------------------------------------------


def param_counts(config, tp: int = 1, ep: int = 1, layers=None, embedding: bool = True, head: bool = True,
                 slots: int = 0) -> dict:
    """Parameters by the shapes, no model built: the logical model's by default, or what one rank holds (`layers`,
    `embedding`, `head`: a pipeline stage, as model.GPT takes them; its 1/T of what tensor parallel splits; its
    N/E experts of each MoE block). h = n_embd, b = 1 with biases, V = vocab_size, N experts, top-k. Per block:
        attention   c_attn 3h² + 3h·b, c_proj's weight h²   split by TP     c_proj's bias h·b  replicated over tp
        LayerNorms  2h·(1 + b)                                               replicated over tp
        dense MLP   c_fc 4h² + 4h·b, c_proj's weight 4h²    split by TP     c_proj's bias h·b  replicated over tp
        MoE MLP     router N·h; N experts of Ψ_e = 8h² + 5h·b, whole on every TP rank, N/E of them on a rank;
                    S shared experts (shared.param_count): S·(8h² + 4h·b) split by TP, h·b replicated over tp
    The embedding: wte V·h (split by vocabulary), wpe block_size·h (replicated). The head: ln_f h·(1 + b), and,
    on a stage without the embedding, its own copy of the tied V·h (split).
    Keys, in elements: split (what TP splits, logical), replicated (over tp), router, experts (all N), expert
    (Ψ_e), moe_layers, shared_experts (of all MoE layers, also inside split and replicated: dense parameters);
    total (logical: every expert, the tied weight once per holder), active (a token's k experts instead of N).
    The matmul weights of 6N (mfu.flops_per_token): active_matmul (the head's V·h when held, the blocks' linears
    with the S shared experts, the routers, k routed experts), block_matmul (the blocks' part: what activation
    checkpointing recomputes), dense_linears (the blocks' nn.Linear weights outside routed experts and routers;
    the shared experts among them), fp8_matmul (those and a token's k routed experts: what --fp8 runs in FP8).
    What the rank holds, by the group that sums its gradients: dp_cp (split/T + replicated + router), expert_dp
    (experts/E; with R = `slots` physical slots, --moe-replicas (experts/eplb.py): L_moe·(R/E)·Ψ_e), and per_rank, their
    sum.
    """
    experts_config = experts_of(config)
    h, V, b, n, k = config.n_embd, config.vocab_size, int(config.bias), experts_config.experts, experts_config.topk
    layers = list(range(config.n_layer) if layers is None else layers)
    moe_layers = sum(experts_config.is_moe_layer(i) for i in layers)
    dense_layers = len(layers) - moe_layers
    expert = 8 * h * h + 5 * h * b
    shared_experts = shared.param_count(config)  # one MoE layer's
    split = (len(layers) * (4 * h * h + 3 * h * b) + dense_layers * (8 * h * h + 4 * h * b)
             + moe_layers * shared_experts["split"])
    replicated = (len(layers) * (2 * h * (1 + b) + h * b) + dense_layers * h * b
                  + moe_layers * shared_experts["replicated"])
    if embedding:
        split, replicated = split + V * h, replicated + config.block_size * h
    if head:  # the tied weight is the embedding's tensor where both are held, else the head's own copy
        split, replicated = split + (0 if embedding else V * h), replicated + h * (1 + b)
    router, experts = moe_layers * n * h, moe_layers * n * expert
    non_expert = split + replicated + router  # every token's (the shared experts among them)
    dense_linears = len(layers) * 4 * h * h + dense_layers * 8 * h * h + moe_layers * shared_experts["matmul"]
    block_matmul = dense_linears + router + moe_layers * k * 8 * h * h
    expert_dp = moe_layers * slots // ep * expert if slots else experts // ep
    dp_cp = split // tp + replicated + router
    return dict(split=split, replicated=replicated, router=router, experts=experts, expert=expert,
                moe_layers=moe_layers,
                shared_experts=moe_layers * (shared_experts["split"] + shared_experts["replicated"]),
                total=non_expert + experts, active=non_expert + moe_layers * k * expert,
                active_matmul=block_matmul + (V * h if head else 0), block_matmul=block_matmul,
                dense_linears=dense_linears, fp8_matmul=dense_linears + moe_layers * k * 8 * h * h, dp_cp=dp_cp,
                expert_dp=expert_dp, per_rank=dp_cp + expert_dp)


def fp8_weights(config, tp: int, ep: int, layers, slots: int = 0) -> dict:
    """{group: (elements, tensors)} of the FP8 linears' weights (fp8.convert: every block nn.Linear but the router)
    in `layers`, which ZeRO-3 gathers as E4M3 codes in units of their own (zero3.by_group_and_codec): dp_cp,
    attention's c_attn 3h²/T and c_proj h²/T, the MLP's c_fc and c_proj 4h²/T each (a MoE block: its S shared
    experts', 8S·h²/T as two linears); expert_dp, each held routed expert's two, 8h² (N/E, or R/E slots, a block)."""
    experts_config = experts_of(config)
    h, shared, held = config.n_embd, experts_config.shared_experts, (slots or experts_config.experts) // ep
    dense, experts = [0, 0], [0, 0]
    for layer in layers:
        moe = experts_config.is_moe_layer(layer)
        mlp = (8 * shared * h * h // tp, 2 * bool(shared)) if moe else (8 * h * h // tp, 2)
        dense = [dense[0] + 4 * h * h // tp + mlp[0], dense[1] + 2 + mlp[1]]
        experts = [experts[0] + moe * held * 8 * h * h, experts[1] + moe * 2 * held]
    return {"dp_cp": tuple(dense), "expert_dp": tuple(experts)}


# ----------------------------------------------------------------------------------------------------------
# 2. Activations: Korthikanti et al.'s reference
# ----------------------------------------------------------------------------------------------------------


def activation_bytes_per_layer(
    s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False
) -> float:
    """Activation bytes one transformer layer keeps for backward (Korthikanti et al. 2022, "Reducing Activation
    Recomputation in Large Transformer Models", section 4).

    s = sequence length, b = micro-batch size, h = hidden size, a = attention heads, t = tensor-parallel size.
    Bytes assume 16-bit activations (and 1-byte dropout masks), as in the paper:
        no parallelism:             s*b*h * (34 + 5*a*s/h)
        tensor parallel t:          s*b*h * (10 + 24/t + 5*a*s/(h*t))
        tensor + sequence parallel: s*b*h/t * (34 + 5*a*s/h)
    34*s*b*h is the per-token part (attention 11, MLP 19, two layernorms 4); 5*a*s^2*b is the a x s x s score
    matrix, its softmax and its dropout mask. Tensor parallelism splits all but the 10*s*b*h around the
    layernorms and dropouts, which sequence parallelism then splits too. The t = 1 formulas equal the first.
    A fused attention kernel (FlashAttention, F.scaled_dot_product_attention) does not store the scores, which
    removes most of the 5*a*s/h term; full activation checkpointing keeps only the layer input, 2*s*b*h.
    """
    sbh = s * b * h
    if sequence_parallel:
        return sbh / t * (34 + 5 * a * s / h)
    return sbh * (10 + 24 / t + 5 * a * s / (h * t))


def tp_activation_estimates(config, micro: int, seq: int, tp: int) -> dict:
    """Korthikanti et al. 2022's activation bytes per layer (16-bit) of tensor_parallel.py's table: unsplit, TP,
    TP + SP."""
    args = (seq, micro, config.n_embd, config.n_head)
    return {"none": activation_bytes_per_layer(*args), "tp": activation_bytes_per_layer(*args, t=tp),
            "tp_sp": activation_bytes_per_layer(*args, t=tp, sequence_parallel=True)}

# ----------------------------------------------------------------------------------------------------------
# 3. Activations: what the kernels save (the estimate the run prints; section 2 is the paper's reference)
# ----------------------------------------------------------------------------------------------------------
# Each term is a tensor autograd keeps, found with saved_tensors_hooks (SavedActivations) on this model, one
# storage once; tests/accounting/test_activations.py checks the sums against the measurement.


def attention_kernel(device_type: str, dtype: torch.dtype, dropout: float) -> str:
    """The path of `F.scaled_dot_product_attention(q, k, v, dropout_p, is_causal=True)` (model.causal_attention):
    "fused" (a flash-style kernel that saves q, k, v, the output and the log-sum-exp, never the scores) or
    "math" (the reference composition, which saves the a·s² probabilities). Torch 2.x dispatches:
        CPU:  fused at dropout 0 (the CPU flash kernel takes no dropout); math with dropout;
        CUDA: fused for fp16, bf16 (flash or memory-efficient) and fp32 (memory-efficient), dropout or not;
              math for fp64."""
    if device_type == "cpu":
        return "fused" if dropout == 0 else "math"
    return "math" if dtype == torch.float64 else "fused"


@dataclass(frozen=True)
class ActivationShape:
    """What one micro-batch's saved activations depend on, for one rank (the symbols of the formulas below)."""

    s: int  # tokens of a sequence in this rank's attention (s/C under context parallel)
    b: int  # sequences per micro-batch (B_μ)
    h: int  # hidden size
    a: int  # attention heads
    vocab: int  # V
    t: int = 1  # tensor-parallel size T: heads, MLP columns and the vocabulary are split T ways
    sp: bool = False  # sequence parallel: LayerNorms and dropouts see s/T tokens
    e_r: int = 4  # bytes of a residual-stream element: the working weights' dtype
    e_c: int = 4  # bytes of a compute element: autocast's dtype (e_r without autocast)
    e_g: int = 0  # bytes of a GEMM output selective recompute keeps, if not e_c: FP8's emulated GEMM's, fp32 or wider
    dropout: bool = False  # --dropout > 0 (training)
    bool_masks: bool = False  # dropout masks are 1-byte bools (CUDA's fused dropout; a CPU keeps a scaled copy)
    fp32_norms: bool = False  # LayerNorm saves its input and statistics in fp32 (CUDA autocast casts them)
    kernel: str = "fused"  # attention_kernel(...)
    ulysses: bool = False  # context parallel's Ulysses: the output is kept head-split and back
    fp8: bool = False  # the block linears save their inputs in FP8 (1 byte) and make no weight copies
    regather: bool = True  # SP: c_attn and c_fc keep their input's shard (not inside a recomputed block)
    upcast: bool = True  # torch's math path computes 16-bit attention in fp32 (Korthikanti et al.'s does not)

    @property
    def e_n(self) -> int:
        """LayerNorm's saved input and statistics: the residual's dtype, or fp32 (fp32_norms)."""
        return max(self.e_r, 4) if self.fp32_norms else self.e_r

    @property
    def e_a(self) -> int:
        """The math path's precision: fp32 (fp64 for fp64 inputs), or e_c without the upcast."""
        return max(self.e_c, 4) if self.upcast else self.e_c

    def mask(self, element: int) -> int:
        """Bytes per element of a dropout mask on a tensor of `element`-byte elements (0 without dropout)."""
        return 0 if not self.dropout else 1 if self.bool_masks else element

    @property
    def weight_copy(self) -> int:
        """Bytes per weight element of autocast's cast copy, which a linear saves: w = e_c when autocast casts
        (e_c ≠ e_r), else 0. FP8's block linears quantise their weights instead and keep no copy."""
        return 0 if self.e_c == self.e_r else self.e_c


def layer_activation_terms(x: ActivationShape) -> dict[str, float]:
    """Bytes ONE transformer block saves for backward per micro-batch, by what saves them.

    With sbh = s·b·h; inside the TP regions /T (heads, MLP columns); between them, ÷T only under SP (write
    sbh' = sbh/T with SP, else sbh, and sb' likewise); e_q = e_c (1 under FP8) for a linear's saved input:
        layernorms      2·sbh'·e_n + 4·sb'·e_n         ln_1's and ln_2's inputs (the residual), mean and rstd
        attention       sbh'·e_q                        c_attn's input (ln_1's output, cast)
          fused         + 4·sbh·e_c/T                   q, k, v (views of c_attn's output) and the output, which
                                                        is also c_proj's input (the kernel lays it out [b,s,a,d])
                        + s·b·a·max(e_c, 4)/T           the log-sum-exp (fp32 at least)
                        (+ sbh·e_c/T Ulysses: the output head-split and back; + sbh/T FP8: c_proj's own copy)
          math          + 3·sbh·e_a/T + sbh·e_q/T       q, k (scaled), v in e_a (torch's math path upcasts 16-bit
                                                        inputs: e_a = max(e_c, 4)), c_proj's input (a copy:
                                                        the output is [b,a,s,d], c_proj reads [b,s,h])
                        + a·s²·b·e_a/T                  the softmax probabilities
                        + a·s²·b·(e_a + m(e_a))/T       with dropout: the dropped probabilities and the mask
                        + sbh'·m(e_c)                   the residual dropout's mask
        mlp             sbh'·e_q + 4·sbh·e_c/T          c_fc's input, GELU's input
                        + 4·sbh·e_q/T + sbh'·m(e_c)     GELU's output (c_proj's input), the dropout's mask
        weight copies   4h²·w/T (attention), 8h²·w/T (mlp)  autocast's cast of each weight, saved by its
                                                        linear, w = e_c when autocast casts (e_c ≠ e_r), else 0
                                                        (and 0 under FP8, which quantises the weights instead)
    m(e) is a dropout mask's bytes per element: 0 without dropout, 1 on CUDA, e on a CPU (a scaled copy).
    At e_r = e_c = 2, fused, no dropout, T = 1: s·b·h·(32 + 8/h + 4a/h), 32.07·sbh for GPT-2's block, where
    Korthikanti's formula says 34 + 5·a·s/h = 114 at s = 1024. The paper's own assumptions (math path without
    the upcast, e = 2, 1-byte masks) give its formula back, plus the LayerNorm statistics it leaves out.
    """
    sbh, sb = x.s * x.b * x.h, x.s * x.b
    cut = x.t if x.sp else 1  # ÷T between the regions under SP
    e_q = 1 if x.fp8 else x.e_c
    linear_in = sbh / cut if x.regather or not x.sp else sbh  # a recomputed block keeps the gathered input
    attention = linear_in * e_q + sbh / cut * x.mask(x.e_c)
    if x.kernel == "fused":
        attention += 4 * sbh * x.e_c / x.t + sb * x.a * max(x.e_c, 4) / x.t
        attention += (sbh * x.e_c / x.t if x.ulysses else 0) + (sbh / x.t if x.fp8 else 0)
    else:
        scores = x.a * x.s * sb / x.t
        attention += 3 * sbh * x.e_a / x.t + sbh * e_q / x.t + scores * x.e_a
        attention += scores * (x.e_a + x.mask(x.e_a)) if x.dropout else 0
    return {
        "layernorms": 2 * sbh / cut * x.e_n + 4 * sb / cut * x.e_n,
        "attention": attention,
        "mlp": linear_in * e_q + 4 * sbh * (x.e_c + e_q) / x.t + sbh / cut * x.mask(x.e_c),
        "attention weight copies": 0 if x.fp8 else 4 * x.h * x.h * x.weight_copy / x.t,
        "mlp weight copies": 0 if x.fp8 else 8 * x.h * x.h * x.weight_copy / x.t,
    }


def embedding_activation_bytes(x: ActivationShape) -> float:
    """The embeddings' saved bytes (first pipeline stage): 8·s·b token ids (int64; under TP the ids local to
    the shard, and s·b bytes of the mask of those outside it), 8·s positions (under SP a slice of them, which
    keeps their storage), and with dropout the mask of the embedding's output, sbh'·m(e_r)."""
    cut = x.t if x.sp else 1
    return 8 * x.s * x.b + (x.s * x.b if x.t > 1 else 0) + 8 * x.s + x.s * x.b * x.h / cut * x.mask(x.e_r)


def head_activation_bytes(x: ActivationShape) -> float:
    """The final LayerNorm's, the head's and the loss's saved bytes (last pipeline stage), with e_l = max(e_c, 4)
    (the loss runs in fp32 at least): ln_f's input and statistics sbh'·e_n + 2·sb'·e_n, the head's input
    sbh'·e_c, autocast's copy of the tied weight V·h·w/T, the log-softmax (TP: the softmax of the vocabulary
    shard) s·b·V·e_l/T, the targets 8·s·b (TP: two more 1-byte masks, 2·s·b)."""
    sbh, sb, cut = x.s * x.b * x.h, x.s * x.b, x.t if x.sp else 1
    e_l = max(x.e_c, 4)
    return (sbh / cut * (x.e_n + x.e_c) + 2 * sb / cut * x.e_n + x.vocab * x.h * x.weight_copy / x.t
            + sb * x.vocab * e_l / x.t + 8 * sb + (2 * sb if x.t > 1 else 0))


def block_input_bytes(x: ActivationShape) -> float:
    """What an activation-checkpointed block keeps for backward: its input, sbh'·e_r (the recompute rebuilds the
    rest, one block at a time: layer_activation_terms with regather off)."""
    return x.s * x.b * x.h / (x.t if x.sp else 1) * x.e_r


def selective_block_terms(x: ActivationShape, mlp: bool = True) -> dict[str, float]:
    """What a block under selective recompute (parallel/recompute.py) keeps for backward per micro-batch, by what keeps
    it (T = x.t; T' = T with SP, else 1; `mlp` False: the attention side alone, a MoE block's checkpoint
    (model.Block): c_attn's 3/T and c_proj's 1, TP's one sum, SP's one gather and one scatter, Ulysses'):
        block input                  sbh·e_r/T'          the checkpoint's input (the recompute starts from it)
        GEMM outputs                 (7/T + 2)·sbh·e_g   c_attn's [q|k|v] 3/T, c_fc's 4/T, and the row layers'
                                                         (attention's and the MLP's c_proj) 1 each: whole under
                                                         TP too, the partial sums before their reduction (the
                                                         MLP's only the residual add reads: kept all the same,
                                                         as torchtitan's policy keeps every matmul's)
        collective outputs           TP 2·sbh·e_c        g's sums (parallel/collectives.py), whole on every rank;
                                     SP (2 + 2/T)·sbh·e_c  the all-gathered LayerNorm outputs (c_attn's and c_fc's
                                                         whole inputs) and the reduce-scattered sums
                                     Ulysses + 4·sbh·e_c/T   q, k, v head-split and the output back (s = s/C)
        fused attention's output     (sbh·e_c + s·b·a·max(e_c, 4))/T   its output and log-sum-exp (fused kernel
                                                         only: the math path's core attention is recomputed)
    Recomputed from those: the LayerNorms' outputs and statistics, the GELU's output, the dropouts and their
    masks, autocast's weight copies. T = 1: 9·sbh·e_g of GEMM outputs, no collective. e_g is the kept GEMM output's
    element: e_c, or fp32 or wider where FP8's GEMM is emulated (ActivationShape.e_g; 1-byte codes are not kept)."""
    sbh, t, sides = x.s * x.b * x.h, x.t, 1 + mlp
    fused = x.kernel == "fused"
    collectives = (0.0 if t == 1 else sides * (1 + 1 / t if x.sp else 1) * sbh * x.e_c) + (
        4 * sbh * x.e_c / t if x.ulysses else 0.0)
    gemms = 3 / t + 1 + (4 / t + 1 if mlp else 0)  # e_g = e_c, or FP8's emulated GEMM's fp32 (its mm's output)
    return {"block inputs": sbh / (t if x.sp else 1) * x.e_r, "GEMM outputs": gemms * sbh * (x.e_g or x.e_c),
            "collective outputs": collectives,
            "fused attention outputs": (sbh * x.e_c + x.s * x.b * x.a * max(x.e_c, 4)) / t if fused else 0.0}


def selective_rebuild_shared(x: ActivationShape, mlp: bool = True) -> float:
    """Of the block a selective recompute rebuilds in backward (layer_activation_terms), the bytes that are the
    cache's own tensors, not new ones: GELU's input (c_fc's output) 4·sbh·e_c/T, with a fused kernel its q, k, v
    (views of c_attn's output; under Ulysses copies of what the all-to-all received, not shared) and its output
    and log-sum-exp, (4·sbh·e_c + s·b·a·max(e_c, 4))/T, and under SP c_attn's and c_fc's gathered inputs,
    2·sbh·e_c (`mlp` False, a MoE block's attention side: neither GELU's input nor c_fc's, 1·sbh·e_c under SP)."""
    sbh, t = x.s * x.b * x.h, x.t
    fused = ((1 if x.ulysses else 4) * sbh * x.e_c + x.s * x.b * x.a * max(x.e_c, 4)) if x.kernel == "fused" else 0.0
    return (4 * sbh * x.e_c * mlp + fused) / t + ((1 + mlp) * sbh * x.e_c if x.sp and t > 1 else 0.0)


def hidden_from_hooks(x: ActivationShape, layers: int, head: bool, moe_layers: int = 0,
                      shared_experts: int = 0) -> float:
    """Of the bytes above, what an outer saved_tensors_hooks (SavedActivations) cannot see: under SP, the tensors
    saved inside tensor_parallel's regather hook, per layer c_attn's and c_fc's input shards 2·sbh'·e_c and
    their weight copies 7h²·w/T, and on the head its input shard sbh'·e_c and the tied weight's copy V·h·w/T.
    Of the `layers`, `moe_layers` are MoE blocks: c_attn's, and a c_fc only through their S `shared_experts`
    (experts/shared.py; copy S·4h²·w/T, its input shard hidden only where it is not the router's input, e_c ≠ e_r)."""
    if not (x.sp and x.regather and x.t > 1):
        return 0.0
    shard, copy = x.s * x.b * x.h / x.t * x.e_c, 0 if x.fp8 else x.h * x.h * x.weight_copy / x.t
    moe_layer = shard + 3 * copy + (shard * (x.e_c != max(4, x.e_r)) + shared_experts * 4 * copy
                                    if shared_experts else 0)
    return ((layers - moe_layers) * (2 * shard + 7 * copy) + moe_layers * moe_layer
            + (shard + x.vocab * x.h * x.weight_copy / x.t if head else 0))


# ----------------------------------------------------------------------------------------------------------
# 4. Measured: saved activations and the host memory timeline
# ----------------------------------------------------------------------------------------------------------


class SavedActivations:
    """Bytes saved for backward inside the `with`, counted with saved_tensors_hooks, each storage once.

        with SavedActivations(exclude=model.parameters()) as saved:
            loss = model(x, y)[1]
        saved.bytes

    Storages of `exclude` (the parameters: weights are not activations) are left out. The storages are held
    until the object is dropped, so an address cannot be freed and reused within one measurement. Under
    non-reentrant activation checkpointing the checkpoint's own hooks take the saved tensors instead (only
    the block inputs stay), which the hooks do not see; under selective recompute the outputs its policy keeps
    are no saved tensors either: `policy` (a recompute.SelectiveRecompute, `of(model)` finds the model's) shows
    them. A ZeRO-3 weight is a view of a unit whose storage is gathered and freed, so its address is not the one
    `exclude` took: a unit still gathered when a forward ends counts (accounting/activations.py names it).
    """

    def __init__(self, exclude=(), policy=None):
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.storages = {}
        self.policy = policy

    @classmethod
    def of(cls, model):
        """The measurement of a model's forward: its parameters left out, its recompute policy watched."""
        return cls(exclude=list(model.parameters()), policy=getattr(model, "recompute", None))

    def _pack(self, tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.exclude:
            self.storages[storage.data_ptr()] = storage
        return tensor

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()
        self._watch = self.policy.watch(self._pack) if self.policy is not None else nullcontext()
        self._watch.__enter__()
        return self

    def __exit__(self, *exc):
        self._watch.__exit__(*exc)
        self._hooks.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(storage.nbytes() for storage in self.storages.values())


@contextmanager
def _quiet_stderr():
    """Standard error (file descriptor 2, where C++ logs) sent to /dev/null inside the `with`."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


# What torch's CPU allocator logs (CPUAllocator.cpp, one line per process) when a profiled region frees a block
# allocated before profiling began: expected here (a step frees the previous step's tensors), so not printed.
PROFILER_NOISE = ("Memory block of unknown size was allocated before the profiling started",)


@contextmanager
def _stderr_without(noise: tuple):
    """Standard error (file descriptor 2, where C++ logs) held in a temporary file inside the `with`, then written
    out in order without the lines that contain one of `noise`: every other warning still reaches the user."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [line for line in held.read().splitlines(keepends=True)
                    if not any(text.encode() in line for text in noise)]
            if kept:
                os.write(2, b"".join(kept))


class MemoryTimeline:
    """The host memory a stretch of code allocates, from torch.profiler's memory events (profile_memory=True):
    every allocation and free of a CPU tensor inside the `with`, in time order.

        with MemoryTimeline() as memory:
            train_step(...)
        memory.peak, memory.net

    `peak` is the most the bytes in use rose above where they stood at the start (temporaries included), `net`
    where they ended. It sees every tensor, those that saved_tensors_hooks cannot (tensors saved inside another
    hook, a recomputed block's), and nothing that is not a tensor. It cannot see the free of a block allocated
    before it started, so a region that frees older tensors reads high by those (torch's allocator logs that
    once per process, PROFILER_NOISE: expected, so that line is held back; every other line on standard error
    inside the `with` is written out at its end). The events
    are read from the profiler's raw results (its kineto_results), where each one carries its size and time;
    the profiler slows the code it watches, so a timed step should not be the one measured.
    """

    def __enter__(self):
        self._profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        with _quiet_stderr():  # the profiler's back end logs its start and stop there
            self._profile.__enter__()
        self._stderr = _stderr_without(PROFILER_NOISE)
        self._stderr.__enter__()
        return self

    def __exit__(self, *exc):
        self._stderr.__exit__(*exc)
        with _quiet_stderr():
            self._profile.__exit__(*exc)
        events = [e for e in self._profile.profiler.kineto_results.events()
                  if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
        in_use = self.peak = 0
        for event in sorted(events, key=lambda e: e.start_ns()):
            in_use += event.nbytes()  # negative for a free
            self.peak = max(self.peak, in_use)
        self.net = in_use


@dataclass(frozen=True)
class ModulePeak:
    """One module forward as LiveTensors saw it: the bytes of the tensors it made, alive together at their highest."""

    peak: int  # bytes alive at the highest point (the forward's own tensors: ops' outputs, each storage once)
    saved: int  # of all the tensors the forward made, the bytes autograd saved for backward (alive at the end)
    at: str  # the op whose output made the peak

    @property
    def above_saved(self) -> int:
        """What the forward needs beyond what it leaves saved: the peak less every saved byte. A step adds this to
        its activations (which count the saved bytes) while the module runs."""
        return self.peak - self.saved


class LiveTensors(TorchDispatchMode):
    """Per forward of the watched modules: the bytes of the tensors it made that are alive together at its
    highest, and those it leaves saved for backward (ModulePeak).

        with LiveTensors({"mlp": block.mlp}) as live:
            block(x)
        live.peaks["mlp"]

    A tensor is counted when an op returns it in a storage that none of the op's inputs had (views and
    in-place ops make none), until that storage is freed (a weak reference); the bytes alive are summed after
    every op, which is where a peak can be: an op allocates, and frees happen between ops. It counts the
    tensors ops return, not an op's scratch inside its kernel, nor the allocator's rounding (CUDA rounds up to
    512 bytes): the figure accounting/moe_memory.py predicts. Saved: storages packed by saved_tensors_hooks inside the
    `with` (not those packed inside another hook, e.g. SP's regather) and still alive at the forward's end.
    """

    def __init__(self, modules: dict):
        super().__init__()
        self.modules, self.peaks, self.kept = modules, {}, {}
        self.window = None  # {cdata: (weak ref, bytes)} of the watched forward running now, else None
        self.saved = set()  # cdata of the storages autograd packed

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.window is not None:
            inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            for t in tree_leaves(out):
                if not isinstance(t, torch.Tensor) or t.untyped_storage().nbytes() == 0:
                    continue
                storage = t.untyped_storage()
                known = self.window.get(storage._cdata)
                if storage._cdata not in inputs and (known is None or known[0].expired()):  # an address reused
                    self.window[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
            alive = sum(nbytes for ref, nbytes in self.window.values() if not ref.expired())
            if alive > self.highest[0]:
                self.highest = (alive, str(func))
        return out

    def _pack(self, tensor):
        self.saved.add(tensor.untyped_storage()._cdata)
        return tensor

    def _start(self, module, args):
        self.window, self.highest = {}, (0, "")

    def _stop(self, module, args, output):
        name = next(key for key, watched in self.modules.items() if watched is module)
        self.kept[name] = {cdata: (ref, nbytes) for cdata, (ref, nbytes) in self.window.items()
                           if cdata in self.saved and not ref.expired()}  # what a BackwardRise watches being freed
        self.peaks[name] = ModulePeak(self.highest[0], sum(nbytes for _, nbytes in self.kept[name].values()),
                                      self.highest[1])
        self.window = None

    def __enter__(self):
        self.hooks = [hook for module in self.modules.values() for hook in
                      (module.register_forward_pre_hook(self._start), module.register_forward_hook(self._stop))]
        self.packing = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self.packing.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self.packing.__exit__(*exc)
        for hook in self.hooks:
            hook.remove()


class BackwardRise(TorchDispatchMode):
    """How far the tensors a backward makes rise above where it began, less the forward's saved tensors it frees
    on the way (`saved`: LiveTensors.kept of that forward). Counted as LiveTensors counts (the tensors ops return,
    summed after every op); `rise(exclude)` leaves out the storages in `exclude` (the parameters' gradients,
    which a layout holds anyway)."""

    def __init__(self, saved: dict):
        super().__init__()
        self.saved, self.made, self.moments = saved, {}, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                storage = t.untyped_storage()
                known = self.made.get(storage._cdata)
                if storage._cdata not in inputs and (known is None or known[0].expired()):
                    self.made[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
        alive = [(cdata, nbytes) for cdata, (ref, nbytes) in self.made.items() if not ref.expired()]
        self.moments.append((alive, sum(nbytes for ref, nbytes in self.saved.values() if ref.expired())))
        return out

    def rise(self, exclude=()) -> int:
        exclude = set(exclude)
        return max((sum(nbytes for cdata, nbytes in alive if cdata not in exclude) - freed
                    for alive, freed in self.moments), default=0)
