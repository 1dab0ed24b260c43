"""FP8 routed experts: the rows their GEMMs pad to the FP8 alignment, predicted and counted.

Under --fp8 a routed expert's linears run in FP8 (fp8.py's docstring, "Experts"): moe.py runs each chunk of rows
(the m rows one source rank's micro-batch sends the expert; E = 1: the micro-batch's own) as one GEMM, and
torch._scaled_mm needs its row count a multiple of 16 (fp8_scaling.ROW_ALIGNMENT, the rule on Hopper), so
fp8.Fp8Linear appends zero rows (an empty chunk pads nothing: it runs no GEMM):
    padded rows of a chunk = (−m) mod 16,      P = Σ over this rank's chunks of one MoE layer and micro-batch
Each padded row costs, saved for backward: c_fc's and c_proj's FP8 inputs (h + 4h bytes) and c_fc's output row
(4h·e_c: the GELU saves its input, a view of the padded output), and under blockwise its inputs' 1×128 tiles'
inverse scales, (⌈h/128⌉ + ⌈4h/128⌉)·e_s (fp32; not in `padding_bytes`: moe_memory.fp8_expert_terms has them);
transient: 5h of dY codes in backward and c_proj's discarded output row (h·e_c).

Symbols: h hidden, N experts, k top-k, T tokens this rank routes per micro-batch, e_c compute bytes.

1. Replicated and split: nothing new (the padding is a temporary of each expert GEMM).
2. Peak per device: + (5h + 4h·e_c)·P bytes saved per MoE layer and micro-batch in flight (`padding_bytes`;
   `saved_bytes_delta` the experts' whole change from FP8, for accounting/activations.py's estimate). Whatever E, a rank
   runs N chunks per MoE layer and micro-batch (N/E experts × E sources), so P ≤ 15·N; real routing is not uniform
   (exactly T·k/N rows a chunk would pad (−T·k/N) mod 16 each), a chunk's row count mod 16 is about uniform,
   and the estimate takes its mean, P ≈ 7.5·N (`expected_padded_rows`).
3. Messages: none (the padding never travels: chunks are padded where they are run, after the all-to-all).
4. Restart state: none.
The end of a run prints P measured per MoE layer (`PaddingCount`, the fp8 observer of report/axes.py); the MoE
block's peak table (moe_memory.fp8_expert_terms, any E) holds the padded rows' tensors, with the forward's own
chunk counts at start-up (moe.MoE.local_rows; E > 1 dispatch.Exchange.chunks) and P ≈ 7.5·N in the plan.
"""

from __future__ import annotations

import re

from accounting import observers
from precision.fp8_scaling import ROW_ALIGNMENT
from step import in_backward


def padded_rows(chunk_rows) -> int:
    """Σ (−m) mod 16 over the chunks' row counts m: the zero rows their FP8 GEMMs append."""
    return sum(-m % ROW_ALIGNMENT for m in chunk_rows if m)


def padding_bytes(rows: int, hidden: int, compute_bytes: int) -> int:
    """The bytes `rows` padded rows keep saved for backward: FP8 inputs 5h, c_fc's output 4h·e_c, each."""
    return (5 * hidden + 4 * hidden * compute_bytes) * rows


def saved_bytes_delta(tokens: int, topk: int, experts: int, hidden: int, compute_bytes: int) -> float:
    """What FP8 changes in one MoE layer's saved bytes (moe_costs.layer_activation_bytes: R = T·k rows; P =
    expected_padded_rows): c_fc's and c_proj's inputs, R·h and R·4h in e_c, become FP8 codes of R + P rows,
    and the padding keeps c_fc's output rows (4h·e_c each)."""
    rows, padded = tokens * topk, expected_padded_rows(experts)
    return 5 * hidden * (rows + padded) - 5 * hidden * rows * compute_bytes + 4 * hidden * compute_bytes * padded


def expected_padded_rows(experts: int) -> float:
    """P ≈ 7.5·N: N chunks (E = 1 one per expert; E > 1 N/E local experts × E sources, each source's rows a GEMM
    of their own), each padding the mean of (−m) mod 16 over residues m mod 16 alike, 15/2 rows (any recipe:
    blockwise pads the same rows, its scales then follow the R + P rows, moe_memory.fp8_expert_terms)."""
    return experts * (ROW_ALIGNMENT - 1) / 2


class PaddingCount(observers.SaturationCount):
    """observers.SaturationCount (the scale table's), plus the zero rows each expert's c_fc appended (FP8: its
    GEMMs; a precision recipe: its dW operands, accounting/recipe_experts.py) in training forwards since start-up
    (fp8.QuantizationObserver.padded; c_proj pads the same rows), by MoE layer; not in
    activation checkpointing's recompute (inside a backward), as observers.RoutedLoad counts the routing."""

    EXPERT_INPUT = re.compile(r"transformer\.h\.(\d+)\.mlp\.experts\.\d+\.c_fc$")

    def __init__(self):
        super().__init__()
        self.rows = {}  # {MoE layer id: padded rows}

    def padded(self, linear, rows: int) -> None:
        match = self.EXPERT_INPUT.match(linear.name)
        if match and not in_backward():
            self.rows[int(match.group(1))] = self.rows.get(int(match.group(1)), 0) + rows
