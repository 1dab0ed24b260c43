"""A precision recipe's routed experts: the rows their dW operands pad to the recipe's token block, predicted.

Under --precision-recipe a routed expert's linears are precision.recipe.RecipeLinears (its docstring, "Routed
experts"): dispatch.exchange (E = 1: moe.MoE.run_local_experts) runs each chunk of rows (the m rows one source
rank's micro-batch sends the expert) as one GEMM, and the chunk is the expert's logical tensor: scaled alone,
its SR draws keyed by (source's global micro-batch, expert, row in the chunk), so E = 2 quantises exactly as
E = 1 and one device. Its forward (blocks along K) and dX (blocks along N) are row-wise; dW's operands are
blocked along the m tokens, so they get zero rows up to the token block b (32 MX, 16 NVFP4; the Hadamard's 16):
    padded rows of a chunk = (−m) mod b,      P = Σ over this rank's chunks of one MoE layer and micro-batch
A zero row changes no block's amax and adds nothing to dW, so the padding is exact (an empty chunk runs no GEMM).

Symbols: h hidden, N experts, b the token block, β the backward format's bits per element with its scales.

1. Replicated and split: nothing new (the padding is a temporary of each expert's backward).
2. Peak per device: a block-scaled kernel would save X's backward codes of the padded rows too, c_fc's h and
   c_proj's 4h: 5h·β/8 bytes per padded row (`padding_bytes`), P of them per MoE layer and micro-batch in flight;
   this emulation saves X in the compute dtype unpadded and pads in backward (transient: dY's and X's padded
   copies of one linear). A rank runs N chunks per MoE layer and micro-batch (N/E experts × E sources); a chunk's
   row count mod b is about uniform, so P ≈ N·(b − 1)/2 (`expected_padded_rows`).
3. Messages: none (chunks are padded where they run, after the all-to-all; experts reduce no amax).
4. Restart state: none.
The end of a run prints P counted per MoE layer (fp8_experts.PaddingCount, the precision observer of
report/axes.py) beside its bytes.
"""

from __future__ import annotations


def padded_rows(chunk_rows, block: int) -> int:
    """Σ (−m) mod b over the chunks' row counts m: the zero rows their dW operands append."""
    return sum(-m % block for m in chunk_rows if m)


def padding_bytes(rows: int, hidden: int, bits: float) -> float:
    """What a block-scaled kernel keeps saved for `rows` padded rows: c_fc's and c_proj's backward codes, 5h·β/8."""
    return 5 * hidden * bits / 8 * rows


def expected_padded_rows(experts: int, block: int) -> float:
    """P ≈ N·(b − 1)/2 per MoE layer and micro-batch: N chunks, each padding the mean of (−m) mod b."""
    return experts * (block - 1) / 2
