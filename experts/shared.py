"""Shared experts (DeepSeekMoE, Dai et al. 2024; DeepSeek-V2 and V3): S always-on experts in every MoE layer.

Each token u goes through the S shared experts and its k routed ones; the shared outputs are added with no gate:
    h' = u + Σ_{s<S} shared_s(u) + Σ_{j<k} g_j · routed_{e_j}(u)          (moe.MoE.forward adds the middle sum)
Each shared expert has the routed experts' shape (c_fc → GELU → c_proj, width 4h). They are built as ONE MLP of
width S·4h, which is the same function: shared expert s is rows [s·4h, (s+1)·4h) of c_fc (weight and bias) and
the same columns of c_proj, and Σ_s shared_s(u) = c_proj(GELU(c_fc(u))), one GEMM pair instead of S. The S
c_proj biases are only ever summed, so they are one parameter of h (as S separate ones would be S·h values the
gradient cannot tell apart). Checkpoint names: `transformer.h.<i>.mlp.shared_experts.c_fc.weight` [S·4h, h],
`...c_fc.bias` [S·4h], `...c_proj.weight` [h, S·4h], `...c_proj.bias` [h]: whole logical tensors.

Symbols: S shared experts, h hidden, b = 1 with biases, M tokens the shared experts' region sees (B_μ·s/C: under
SP the gathered sequence), M' those of c_fc's saved input (M/T_tp under SP, else M), T_tp tensor-parallel size,
e_c bytes of a compute element, e_r of the router's input (fp32 or wider).

1. Replicated and split. They are dense parameters of the layer: replicated over EP (every rank of an ep group
   holds them; the routed experts are the ones EP splits), gradients summed with the dense ones over dp×cp,
   ZeRO-sharded with them, converted by --fp8 like the dense MLP's linears. Tensor parallel splits them like the
   dense MLP (tensor_parallel._parallelize_block): c_fc by output columns, c_proj by input rows, its bias
   replicated over tp; with --sp the same sequence-parallel region (all-gather in, reduce-scatter out) and the
   bias's gradient summed over tp with the other SP parameters (tensor_parallel's, not moe.MoEAxis's: the routed
   experts are whole on every TP rank, these are not).
2. Peak per device. Parameters per MoE layer S·(8h² + 4h·b) + h·b (memory.param_counts' `shared_experts`),
   /T_tp but the c_proj bias. Saved for backward per MoE layer and micro-batch (`saved_bytes`): GELU's input
   and output 2·S·4h·M·e_c/T_tp, and c_fc's input M'·h·e_c only where it is a tensor of its own (e_c ≠ e_r:
   autocast's cast, or a residual narrower than fp32; SP's gathered input where the block is recomputed):
   otherwise it is the router's input, saved once. FLOPs per token: 6·S·8h² more (memory.param_counts'
   active matmul weights).
3. Messages: none without TP; with TP the dense MLP's region per MoE block (tensor_parallel.block_messages:
   forward g / SP's all-gather and reduce-scatter of s·b·h, backward f / their reverses), nothing over ep.
4. Restart state: nothing of its own: the four logical tensors above, cut by TP's records, so a checkpoint
   written on one E or T loads on another.
"""

from __future__ import annotations

import torch
import torch.nn as nn


class SharedExperts(nn.Module):
    """The S shared experts of one MoE layer as one MLP of width S·4h (module docstring): plain nn.Linears, so
    tensor parallel splits them as the dense MLP's and FP8 converts them."""

    def __init__(self, config):
        super().__init__()
        width = config.moe.shared_experts * 4 * config.n_embd
        self.c_fc = nn.Linear(config.n_embd, width, bias=config.bias)
        self.gelu = nn.GELU(approximate=config.gelu_approximate)
        self.c_proj = nn.Linear(width, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


# ---------------------------------------------------------------------------------------------------------
# Prediction formulas (docstring item 2)
# ---------------------------------------------------------------------------------------------------------


def param_count(config) -> dict:
    """One MoE layer's shared-expert parameters, by what TP does with them: split (c_fc's weight and bias,
    c_proj's weight) and replicated over tp (c_proj's bias); matmul, the weights of 6N (mfu.flops_per_token)."""
    h, b, s = config.n_embd, int(config.bias), config.moe.shared_experts if config.moe else 0
    return dict(split=s * (8 * h * h + 4 * h * b), replicated=h * b if s else 0, matmul=s * 8 * h * h)


def saved_bytes(config, tokens: int, tp: int = 1, compute_bytes: int = 2, router_bytes: int = 4,
                input_tokens: int | None = None, own_input: bool | None = None, fp8: bool = False,
                gelu_output: bool = True) -> float:
    """Bytes one MoE layer's shared experts save for backward per micro-batch: GELU's input and output
    2·S·4h·M·e_c/T_tp over the M = `tokens` the region sees (the gathered sequence under SP), and c_fc's input,
    `input_tokens`·h·e_c (default M; this rank's shard under SP), where it is a tensor of its own: when autocast
    casts it, or the residual is narrower than the router's dtype (e_c ≠ e_r; `own_input` True: SP's gathered
    input, kept whole where the block is recomputed); otherwise it IS the router's input, saved once. Under
    FP8 the linears keep their inputs as 1-byte codes of their own (c_fc's M·h, the gathered input; c_proj's
    S·4h·M/T_tp, so GELU's output is not kept). Without `gelu_output` (selective recompute's moe_act) GELU's
    output is recomputed in backward, not kept: S·4h·M·e_c/T_tp fewer."""
    h, s = config.n_embd, config.moe.shared_experts if config.moe else 0
    if not s:
        return 0
    if fp8:
        return tokens * h + s * 4 * h * tokens * (compute_bytes + 1) / tp
    own_input = compute_bytes != router_bytes if own_input is None else own_input
    kept_input = (tokens if input_tokens is None else input_tokens) * h * compute_bytes if own_input else 0
    return kept_input + (1 + gelu_output) * s * 4 * h * tokens * compute_bytes / tp
