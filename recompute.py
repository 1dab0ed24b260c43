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

Accounting (s, b, h, a, e_r the residual's and e_c the compute's bytes per element, memory.py's symbols):
1. Nothing is split by this file; it changes what a block keeps between its forward and its backward.
2. Per block and micro-batch (memory.selective_block_terms): the block input s·b·h·e_r, the GEMM outputs
   9·s·b·h·e_c (3 + 1 + 4 + 1), and with a fused kernel its output s·b·h·e_c and the log-sum-exp
   s·b·a·max(e_c, 4): about 11·s·b·h·e_c against none's ≈ 16·s·b·h·e_c (fp32, fused). During a block's
   backward its recompute rebuilds the rest (the full block's bytes, less what the cache already holds).
3. No messages of its own. Recomputed FLOPs (mfu.flops_per_token): no GEMM; on the math path the core
   attention, 4·s·h per token per layer forward (its two batched matmuls), once more in backward.
4. No state: the policy is a function of the op; checkpoint replays the RNG, so dropout masks come back equal.

Which layouts it serves: DDP, ZeRO-1/2/3 (zero3.py gathers a block for its recompute as for its forward) and
pipelines. Tensor and context parallel, MoE, FP8 and the precision recipes are refused (`check_flags`): their
collectives and quantising casts inside a block would be recomputed or cached op by op, unaccounted.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import collective_ops

MODES = ("none", "full", "selective")

# The ops whose outputs a selectively recomputed block keeps: the linears' GEMMs (nn.Linear dispatches addmm
# with a bias, mm without) and the fused attention kernels. Not bmm: on the math path it is the core
# attention's q·kᵀ (a·s² scores) and probabilities·v, which are recomputed.
# And every collective a block sends in its forward (collective_ops.SAVED: TP's g and SP's all-gather and
# reduce-scatter, Ulysses' all-to-alls): kept, so that the recompute sends nothing.
SAVED_OPS = frozenset(getattr(torch.ops.aten, name).default for name in (
    "mm", "addmm", "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    if hasattr(torch.ops.aten, name)) | collective_ops.SAVED


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
    def watch(self, callback):
        """Call `callback(tensor)` for each tensor the policy keeps while the `with` runs."""
        self.watchers.append(callback)
        try:
            yield
        finally:
            self.watchers.remove(callback)


def check_flags(args, shape) -> None:
    """--activation-checkpointing selective only where the policy is exact and accounted (the docstring's list);
    raises ValueError naming the flag."""
    if args.activation_checkpointing != "selective":
        return
    refused = [(shape.cp > 1 and args.cp_impl == "ring", "--cp-impl ring"), (args.moe_experts > 0, "--moe-experts"),
               (args.fp8 is not None, "--fp8"), (getattr(args, "precision_recipe", None), "--precision-recipe")]
    for on, flag in refused:
        if on:
            raise ValueError(f"--activation-checkpointing selective with {flag}: the policy would recompute or cache"
                             f" that layout's collectives and casts op by op; use --activation-checkpointing full")
