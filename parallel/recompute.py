"""Selective activation recompute: a block saves its matmul outputs and recomputes the cheap ops in backward.

`--activation-checkpointing {none,full,selective}` (the bare flag is `full`). Full recompute (model.py) keeps a
block's input only and runs its whole forward again in backward. Selective recompute keeps, besides the input,
the outputs of the block's GEMMs (c_attn, attention's c_proj, c_fc, the MLP's c_proj) and of a fused attention
kernel (its output and log-sum-exp), and recomputes everything else from them: the LayerNorms (their outputs,
which c_attn and c_fc save as inputs, and their statistics), the GELU's output (c_proj's input), the dropouts
and their masks, autocast's weight copies, and, on attention's unfused (math) path, the core attention: q·kᵀ,
the softmax, its dropout and ·v. That is torchtitan's op-level policy (save the matmuls, recompute the rest:
`torchtitan/distributed/activation_checkpoint.py`), run through torch.utils.checkpoint's selective checkpoint
(`create_selective_checkpoint_contexts` with `SelectiveRecompute.policy`), and on the math path it is also
Megatron's "core attention" recompute (Korthikanti et al. 2022, section 5: the a·s² terms are the cheap ones).

Why not Megatron's core attention alone: with a fused kernel (F.scaled_dot_product_attention's flash or
memory-efficient kernels) the s×s scores are never stored, and the kernel's saved tensors are q, k, v (c_attn's
output, which c_attn's own backward does not need but the kernel's does) and its output (c_proj's input, saved
anyway). Recomputing the kernel would save the log-sum-exp alone, s·b·a·4 bytes per block (0.03% of GPT-2's
block at s = 1024), and cost the attention's 4·s²·h forward FLOPs again. The memory sits in the elementwise
ops around the GEMMs, which is what this policy recomputes.

Accounting (s, b, h, a, e_r the residual's and e_c the compute's bytes per element, accounting/memory.py's symbols; T
the tensor-parallel size, s = s/C under context parallel):
1. Nothing is split by this file; it changes what a block keeps between its forward and its backward.
2. Per block and micro-batch (memory.selective_block_terms): the block input s·b·h·e_r (/T with SP), the GEMM
   outputs (7/T + 2)·s·b·h·e_c (c_attn 3/T, c_fc 4/T, the two row layers' outputs whole: 9 at T = 1), with a
   fused kernel its output and log-sum-exp (s·b·h·e_c + s·b·a·max(e_c, 4))/T, and the collectives' outputs:
   TP 2·s·b·h·e_c (g's sums), SP (2 + 2/T)·s·b·h·e_c (the gathered LayerNorm outputs, the scattered sums),
   Ulysses 4·s·b·h·e_c/T. At T = 1, about 11·s·b·h·e_c against none's ≈ 16·s·b·h·e_c (fp32, fused). Under
   SP the cache holds c_attn's and c_fc's whole inputs where a run without recompute keeps their shards and
   all-gathers them again in backward (tensor_parallel's regather): at T = 2 selective keeps more than none.
   During a block's backward its recompute rebuilds the rest (the full block's bytes, less what the cache holds).
3. No messages of its own: a collective inside a block is an operator the policy keeps (parallel/collectives.py), or
   outside the checkpoint (a MoE block's MoE side, below), so the recompute sends nothing and a step's messages
   are those of the same layout without recompute (SP's column layers keep their gathered input: no backward
   re-gather). Recomputed FLOPs (mfu.flops_per_token): no GEMM; on the math path the core attention, 4·s·h per
   token per layer forward, once more in backward.
4. No state: the policy is a function of the op; checkpoint replays the RNG, so dropout masks come back equal
   (TP's forked generator included: tensor_parallel.TensorParallelRNG).

A MoE block (model.Block) recomputes by halves, as Megatron-LM's `--recompute-granularity selective` with its
moe_act module (core_attn, moe_act; not `moe`, which recomputes the whole layer, dispatch included): its attention
side, x + attn(ln_1(x)), is one checkpoint under this policy; its MoE side, ln_2, the router, the dispatch with its
all-to-alls, the experts and the combine, runs once, outside any checkpoint, so the routing never runs again,
nothing is sent twice and the load counters count each slot once (a recompute would not count anyway:
is_training_forward). Inside it only local elementwise work is recomputed (`activations_recomputed`): a
GELU's output that c_proj saves is replaced by GELU(c_fc's output), which the GELU keeps as its input anyway
(Megatron's CheckpointWithoutOutput around the activation does the same: discard the output, recompute it when
fc2's backward needs it), and autocast's copy of a weight by a cast of the parameter (as this policy recomputes the
attention side's copies; Megatron keeps bf16 weights and has none). Why not the whole MoE block in one checkpoint:
the dispatch's all_to_all_single calls take split sizes read on the host (`.tolist()`) into buffers sized by them,
in-place receives a cache cannot give back, and the router's top-k would run again; and keeping the MoE side's
other tensors (its rows, ln_2's output, which the router saves) is what a run without recompute keeps.
Accounting of a MoE block (activations.selective_blocks): its attention side's input, GEMM outputs (3/T + 1) and
collectives' (memory.selective_block_terms with mlp=False), ln_2's input and statistics, and the MoE side's terms
(moe_costs.layer_activation_bytes, shared.saved_bytes) less every GELU output, R_e·4h·e_c routed and
S·4h·M·e_c/T shared, and less the experts' weight copies, (N/E + S/T)·8h²·e_c under autocast; its messages are
those without recompute (its all-to-alls once: moe_accounting's `repeats` is 1); recomputed FLOPs as a dense
block's (the attention side's; GELU is elementwise). Under ZeRO-3 the MoE side saves its weights, views of the
block's unit (activations.zero3_saved_weights).

FP8 (--fp8 current, delayed, blockwise) and the precision recipes (--precision-recipe) inside a checkpointed
block: a quantising linear is an autograd Function whose forward the recompute runs again, so what it does once
per forward is kept or skipped there. The amax MAX over tp and cp is `collectives::all_reduce_max`, an operator
the policy keeps (fp8.Fp8Linear.operators, precision.recipe.RecipeLinear.operators): the recompute reads the
forward's reduced amaxes and sends nothing (fp8.Fp8Handle's messages are those without recompute); the GEMM is
kept (mm when emulated, `_scaled_mm` on FP8 tensor cores) and not run again; the quantising casts (elementwise)
are recomputed from the kept or recomputed inputs, on the same amaxes, so the codes are the forward's, bit for
bit; and a recompute records nothing (inside a backward: no amax into the step's maximum, so the delayed
history is the forward's, no cast counted twice by the observer; SR's draws keyed by the forward's micro-batch).
What a block keeps changes: the linears' inputs are not kept as codes (recomputed), their GEMM outputs are, in
the GEMM's output dtype: fp32 where it is emulated (memory.ActivationShape.e_g), so on a CPU selective recompute
under FP8 keeps MORE than FP8 without recompute (which keeps 1-byte codes); on FP8 tensor cores e_c.

Which layouts it serves: DDP, ZeRO-1/2/3 (parallel/zero3.py gathers a block for its recompute as for its forward),
pipelines, tensor parallel with and without SP, Ulysses context parallel, MoE (EP, shared experts, capacity,
DeepSeek-V3's router options, MoE layers by halves as above), FP8's three recipes and the precision recipes.
Refused (`check_flags`), because the policy cannot keep what it does inside a block exactly and accounted:
the ring (--cp-impl ring): its attention is one autograd node whose forward interleaves point-to-point transfers
with block-wise compute; the transfers are in-place receives into fresh buffers that a cache cannot give back,
so the recompute would send the K, V blocks round the ring again. Keeping it would need the whole ring forward
as one operator (its observer, which times the ring's waits, is a Python object an operator cannot take), and
its output and log-sum-exp kept: the recompute would then rebuild only the LayerNorm and the projections around
it, the cache holding what a ring without recompute keeps of the attention.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from parallel import collectives
MODES = ("none", "full", "selective")

# The ops whose outputs a selectively recomputed block keeps: the linears' GEMMs (nn.Linear dispatches addmm
# with a bias, mm without; FP8's _scaled_mm, or its emulation's mm) and the fused attention kernels. Not bmm:
# on the math path it is the core attention's q·kᵀ (a·s² scores) and probabilities·v, which are recomputed.
# And every collective a block sends in its forward (collectives.SAVED: TP's g and SP's all-gather and
# reduce-scatter, Ulysses' all-to-alls): kept, so that the recompute sends nothing.
SAVED_OPS = frozenset(getattr(torch.ops.aten, name).default for name in (
    "mm", "addmm", "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention", "_scaled_mm")
    if hasattr(torch.ops.aten, name)) | collectives.SAVED


class SelectiveRecompute:
    """The selective policy of one model, and who watches what it keeps (memory.SavedActivations: the outputs
    it caches are no saved tensors, so saved_tensors_hooks cannot see them). `contexts` is checkpoint's
    `context_fn`: a fresh cache per block call. What a watcher returns for a kept tensor lives as long as that
    block's cache (until its backward has run): a watcher can count the cache's bytes alive, as
    tests/test_activations.LiveSaved counts saved tensors."""

    def __init__(self):
        self.watchers = []  # callables given each tensor the policy keeps in a forward (not in a recompute)

    def policy(self, ctx, op, *args, kept: list | None = None, **kwargs) -> CheckpointPolicy:
        if op not in SAVED_OPS:
            return CheckpointPolicy.PREFER_RECOMPUTE
        if not ctx.is_recompute:
            for watch in self.watchers:
                for tensor in tree_leaves(ctx.op_output):
                    if isinstance(tensor, torch.Tensor):
                        held = watch(tensor)
                        if kept is not None:
                            kept.append(held)
        return CheckpointPolicy.MUST_SAVE

    def contexts(self):
        kept = []  # the watchers' returns: held by the recompute's context, which the block's checkpoint holds
        caching, cached = create_selective_checkpoint_contexts(
            lambda ctx, op, *args, **kwargs: self.policy(ctx, op, *args, kept=kept, **kwargs))
        cached.watched = kept
        return caching, cached

    @contextmanager
    def activations_recomputed(self):
        """Megatron's moe_act recompute, for the MLP side of a MoE block (model.Block): inside the `with`, a
        GELU's output that a later op saves for backward (an expert's c_proj input, [R_e, 4h]) is not kept; its
        backward gets GELU(input) again, from the input the GELU saved itself (autograd's _saved_self, c_fc's
        output, kept anyway): 4h·e_c bytes fewer per expert row, one elementwise op more, no message. Every other
        tensor is saved as it would be, seen by the watchers (these hooks hide it from an outer saved_tensors_hooks).
        Autocast's copy of a weight that a linear saves is not kept either: its backward casts the parameter
        again (as the attention side's policy recomputes its copies), 8h²·e_c per expert the rank holds. A view
        (a 3-D input's linear saves it 2-D, a weight transposed) comes back as the same view of the new tensor."""
        def pack(tensor):
            source = tensor if tensor._base is None else tensor._base
            node, view = source.grad_fn, (tensor.size(), tensor.stride(), tensor.storage_offset())
            if type(node).__name__ == "GeluBackward0":
                return _Recomputed(F.gelu, node._saved_self, dict(approximate=node._saved_approximate), *view)
            parameter = getattr(node.next_functions[0][0], "variable", None) if node is not None else None
            if type(node).__name__ == "ToCopyBackward0" and isinstance(parameter, torch.nn.Parameter):
                return _Recomputed(torch.Tensor.to, parameter, dict(dtype=source.dtype), *view)
            return tensor, [watch(tensor) for watch in self.watchers]

        def unpack(packed):
            if isinstance(packed, _Recomputed):
                return packed.fn(packed.input, **packed.kwargs).as_strided(packed.size, packed.stride, packed.offset)
            return packed[0]

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    @contextmanager
    def watch(self, callback):
        """Call `callback(tensor)` for each tensor the policy keeps while the `with` runs."""
        self.watchers.append(callback)
        try:
            yield
        finally:
            self.watchers.remove(callback)


def apply(model) -> SelectiveRecompute:
    """--activation-checkpointing selective: give `model` (a GPT, experts swapped in) its policy. Each block is then
    checkpointed under it (model.GPT.forward_blocks), and a block whose MLP must run once (a MoE layer: its
    `recompute_by_halves`) recomputes by halves (model.Block). Returns the policy."""
    policy = SelectiveRecompute()
    model.recompute = policy
    for block in model.transformer.h:
        block.recompute = policy if getattr(block.mlp, "recompute_by_halves", False) else None
    return policy


class _Recomputed(NamedTuple):
    """What activations_recomputed keeps of a tensor it recomputes: fn(input, **kwargs), and the view to give."""

    fn: object
    input: torch.Tensor
    kwargs: dict
    size: torch.Size
    stride: tuple
    offset: int


def check_flags(args, shape) -> None:
    """--activation-checkpointing selective only where the policy is exact and accounted (the docstring's list);
    raises ValueError naming the flag."""
    if args.activation_checkpointing != "selective":
        return
    if shape.cp > 1 and args.cp_impl == "ring":
        raise ValueError("--activation-checkpointing selective with --cp-impl ring: the ring's transfers would run"
                         " again in the recompute (parallel/recompute.py); use --cp-impl ulysses or"
                         " --activation-checkpointing full")
