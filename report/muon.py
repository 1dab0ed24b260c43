"""Muon's printouts: the split, the way it is sharded, its state, its Newton-Schulz work and the owner imbalance
(optimizers/muon.py, optimizers/zero_muon.py), and the NS FLOPs a step adds to the hardware's; MuonClip's QK-clip
lines (optimizers/qk_clip.py: `qk_clip_startup_lines`, `qk_clip_step_lines`, report/axes.py's qk_clip section).

report/axes.py's `layout_lines` adds `startup_lines` after the layout's own section when the layout's facts carry
Muon's (`facts().muon`); train.py counts NS in the hardware FLOPs (`with_newton_schulz`) before the start-up prints
them. Nothing here changes what the trainer computes.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

import mfu
from optimizers.muon import imbalance

WAYS = {
    "ddp": "DDP: every rank orthogonalises every matrix of its stage (the D ranks of a stage alike)",
    "gather": "ZeRO, gather: each matrix unit's U all-gathered (in NS's dtype), each rank orthogonalises the"
              " matrices its slice touches and keeps its elements",
    "owner": "ZeRO, owner-shaped: each matrix whole on one owner (LPT on NS FLOPs), its gradient reduced to the"
             " owner, NS there once, the new weights broadcast",
}


def startup_lines(facts) -> list:
    """Muon's start-up lines from its facts (optimizers/muon.py's MuonFacts; None: AdamW only, no lines)."""
    if facts is None:
        return []
    f, c = mfu.format_bytes, facts.config
    flops, held = facts.ns_flops_by_rank, facts.held_by_rank
    lines = [f"optimizer: Muon on the blocks' {facts.matrices} matrices (lr {c.lr:g} on --lr's schedule, momentum"
             f" {c.momentum:g}, Nesterov, {c.ns_steps} Newton-Schulz steps in {mfu.format_dtype(c.ns_dtype)},"
             f" lr·√max(1, m/n)); AdamW on the embeddings, head, LayerNorms and biases; Muon's momentum here"
             f" {f(facts.momentum_bytes)}",
             f"  {WAYS[facts.way]}",
             f"  Newton-Schulz per step: {mfu.format_flops(facts.ns_flops)} on this rank; the stage's matrices once"
             f" {mfu.format_flops(facts.ns_flops_stage)}"
             + (f"; over the {len(flops)} ranks of the data-parallel group {mfu.format_flops(sum(flops))}"
                f" (max/mean {imbalance(flops):.2f})" if len(flops) > 1 else "")]
    if facts.way != "ddp":
        lines.append("  (the ZeRO lines' formula column counts AdamW's b_o on every parameter; its Ψ'_g and held"
                     " columns count Muon's units as they are: master + momentum)")
    if len(held) > 1:
        lines.append(f"  persistent bytes per data-parallel rank: max {f(max(held))}, mean {f(sum(held) / len(held))},"
                     f" min {f(min(held))}: {facts.way} imbalance max/mean {imbalance(held):.3f}")
    for (op, group), (calls, payload) in sorted(facts.messages.items()):
        lines.append(f"  the update's own {op} {group}: {calls:g} calls, {f(payload)} a step (exposed)")
    return lines


def with_newton_schulz(run) -> mfu.FlopsPerToken:
    """run.flops with the world's NS FLOPs per token added to the hardware's (NS is not model work: MFU keeps
    its 6N): every rank's NS FLOPs of a step, summed over the world (one float64 all_reduce at start-up), over
    the step's tokens."""
    facts = run.layout.facts().muon
    if facts is None:
        return run.flops
    total = torch.tensor([facts.ns_flops], dtype=torch.float64, device=run.device)
    if dist.get_world_size() > 1:
        dist.all_reduce(total)
    per_token = float(total) / run.tokens_per_step
    return replace(run.flops, hardware=run.flops.hardware + per_token,
                   convention=f"{run.flops.convention}; hardware adds Muon's Newton-Schulz, {per_token:,.0f} per token"
                              f" (every rank's, the world's sum)")


def qk_clip_startup_lines(axis, run=None, steps: int = 0) -> list:
    """τ, the heads this rank watches, and the maxima's one message a step."""
    f = axis.facts()
    message = (f"one all-reduce (MAX) of {mfu.format_bytes(f.message_bytes)} over dp×cp per step"
               if f.message_bytes else "no message (one data-parallel rank)")
    return [f"qk-clip (optimizers/qk_clip.py, MuonClip): after each step, a head whose largest causal logit q·k/√d"
            f" exceeded τ = {f.tau:g} has its W_q and W_k rows scaled by √(τ/max); {f.heads} heads watched on this"
            f" rank (TP: its own, no tp message); {message}"]


def qk_clip_step_lines(axis, run=None, steps: int = 0) -> list:
    f = axis.facts()
    return [f"qk-clip: {f.clipped_last_step} of {f.heads} heads clipped by the last step, {f.clipped_total} head-steps"
            f" since the start"]
