"""What real runs lose against the datasheet: the time model's calibration, stated and overridable.

The datasheet model (planner/hardware.py) runs every matmul at the dense peak and every link at its nominal bandwidth;
no real run does. A Calibration states what they reach instead, one constant per effect, each a flag with a
checked range (check_flags: one line naming the flag, exit 2):

    GEMM      a matmul whose smallest dimension is d reaches e(d) = e_max · d / (d + d½) of the peak
              (--calib-gemm-fraction e_max, --calib-gemm-half-dim d½): wide GEMMs near e_max, thin ones (a
              TP shard's h/T, attention's head dim) lose more of each tile to its edges and to the wave
              quantization of the SMs. A linear's dimensions (M, K, N) per rank: M = B_μ·s/C tokens, K, N of
              its weight shard: QKV (h, 3h/T), proj (h/T, h), fc1 (h, 4h/T), fc2 (4h/T, h), the head (h, V/T);
              attention's two batched matmuls (s × d_head × s): d = d_head, their FLOPs 4·s·h per token.
    memory    the memory-bound ops at --calib-hbm-fraction of the HBM bandwidth; per token and layer, in
              elements of the compute dtype, forward (σ = T under sequence parallel, else 1: SP splits them):
                  two LayerNorms 2 · 2h/σ, two bias-dropout-residual adds 2 · 3h/σ, the bias-GELU 2 · 4h/T,
                  and with the unfused ("math") attention the softmax's 2·a·s/T (and its dropout's 2·a·s/T);
              backward moves twice the forward's bytes (the saved input, the incoming and the outgoing
              gradient), a recomputed block once more: (3 + recompute) × forward, recompute full or selective
              (parallel/recompute.py's policy reruns every one of these ops, the math path's softmax and dropout
              with the core attention). The optimizer's update (2 × persistent bytes) runs at the same fraction.
    links     every collective and p2p at --calib-link-fraction of the link's bandwidth (NCCL's bus
              bandwidth against the link's: ≈ 0.8 on NVLink and InfiniBand), its α unchanged.

calibrated() is the set fitted once to Narayanan et al. 2021 (SC21), Table 1: GPT 1.7B–1T on 32–3,072
A100-80GB, the micro-batches and virtual stages of NVIDIA's examples/sc21/run_table_1.sh
(bench/bench_calibration.py prints row, published, predicted, ratio); DATASHEET is the uncalibrated model
(every fraction 1, d½ = 0): a measured CPU (hardware.measure_cpu) uses it, its peak being a measured one.

Accounting for this file: it holds and sends nothing (formulas).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Calibration:
    gemm_fraction: float  # e_max: the fraction of the dense peak a wide GEMM reaches
    gemm_half_dim: float  # d½: the smallest dimension at which a GEMM reaches e_max / 2
    hbm_fraction: float  # of the HBM bandwidth, the memory-bound ops
    link_fraction: float  # of a link's bandwidth, collectives and p2p
    # A measured CPU's own (planner/cpu_probe.py; None on the presets and from flags: the formulas above):
    ends_fraction: float | None = None  # the head class's e: the ends' (embeddings, LayerNorm, head, loss) rate
    update_seconds: float | None = None  # the update's local work per step, timed on this rank's tensor shapes
    layout_factor: float | None = None  # ρ: the run's own forward over its price (its layout's per-op costs)

    def gemm_efficiency(self, smallest_dim: float) -> float:
        """e(d) = e_max · d / (d + d½)."""
        return self.gemm_fraction * smallest_dim / (smallest_dim + self.gemm_half_dim)


DATASHEET = Calibration(gemm_fraction=1.0, gemm_half_dim=0.0, hbm_fraction=1.0, link_fraction=1.0)
# Fitted once to all ten rows of Narayanan et al. 2021, Table 1 (bench/bench_calibration.py): one set.
CALIBRATED = Calibration(gemm_fraction=0.72, gemm_half_dim=64.0, hbm_fraction=0.8, link_fraction=0.8)

# (field, flag, lowest, lowest excluded?, highest): what each constant may be (a fraction of a datasheet figure
# above 1 would be faster than the hardware; d½ past 64 Ki would make every GEMM of a real model crawl).
RANGES = (
    ("gemm_fraction", "--calib-gemm-fraction", 0.0, True, 1.0),
    ("gemm_half_dim", "--calib-gemm-half-dim", 0.0, False, 65536.0),
    ("hbm_fraction", "--calib-hbm-fraction", 0.0, True, 1.0),
    ("link_fraction", "--calib-link-fraction", 0.0, True, 1.0),
)


def add_arguments(group) -> None:
    """One flag per constant (train.py --plan; default: the calibrated set)."""
    for name, flag, low, _, high in RANGES:
        group.add_argument(flag, type=float, help=f"time model calibration: {name.replace('_', ' ')}"
                           f" (default {getattr(CALIBRATED, name):g}; planner/calibration.py)")


def check_flags(args) -> None:
    """ValueError naming the flag whose value is out of its range (cli/flags.py makes it a one-line exit 2)."""
    for name, flag, low, open_low, high in RANGES:
        value = getattr(args, "calib_" + name, None)
        if value is None:
            continue
        if not math.isfinite(value) or value < low or (open_low and value == low) or value > high:
            interval = f"{'(' if open_low else '['}{low:g}, {high:g}]"
            raise ValueError(f"{flag} must be in {interval}, got {value}")


def from_flags(args) -> Calibration:
    """The calibrated set with every --calib-* given put in."""
    given = {name: getattr(args, "calib_" + name) for name, *_ in RANGES
             if getattr(args, "calib_" + name, None) is not None}
    return Calibration(**{**CALIBRATED.__dict__, **given})


# ---------------------------------------------------------------------------------------------------------
# What a layout's step computes: its GEMMs by shape, its memory-bound bytes
# ---------------------------------------------------------------------------------------------------------


HEAD_CLASS = 5  # gemms' classes: QKV, proj, fc1, fc2, attention, the head


def gemms(config, counts: dict, tokens_per_micro_batch: int, seq: int, t: int, recompute: bool,
          attention_recompute: bool) -> list:
    """[(hardware FLOPs per token of the whole model, smallest dimension)] of each GEMM class (the module
    docstring's shapes): the blocks' linears (6N_block, + 2N_block under full recompute), attention's matmuls
    (12·L·s·h, + 4·L·s·h where the core attention is rerun: full recompute, or selective on the math path), and
    the rest of the matmul weights (the head: 6·(N − N_block)). The blocks' weights split 3 : 1 : 4 : 4 over QKV,
    proj, fc1, fc2 (a dense block's; a MoE block's experts and router are counted in the same shares, an
    approximation)."""
    h, L, m = config.n_embd, config.n_layer, tokens_per_micro_batch
    passes = 6 + (2 if recompute else 0)  # FLOPs per weight per token: forward 2, backward 4, recompute 2
    block = counts["block_matmul"] * passes
    out = []
    for share, k, n in ((3, h, 3 * h / t), (1, h / t, h), (4, h, 4 * h / t), (4, 4 * h / t, h)):
        out.append((block * share / 12, min(m, k, n)))
    out.append(((12 + (4 if attention_recompute else 0)) * L * seq * h, config.head_dim))
    out.append((6 * (counts["active_matmul"] - counts["block_matmul"]), min(m, h, config.vocab_size / t)))
    return out


def memory_bytes_per_token_layer(config, seq: int, t: int, sequence_parallel: bool, kernel: str, dropout: bool,
                                 element: int, recompute: bool) -> float:
    """Bytes one rank's memory-bound ops move per token (of its s/C) and layer in a training step."""
    h, a = config.n_embd, config.n_head
    sigma = t if sequence_parallel else 1
    forward = 2 * 2 * h / sigma + 2 * 3 * h / sigma + 2 * 4 * h / t
    if kernel == "math":  # the s×s probabilities go through HBM: the softmax, and its dropout
        forward += (2 + (2 if dropout else 0)) * a * seq / t
    return (3 + (1 if recompute else 0)) * forward * element


def compute_seconds(gemm_classes: list, flops_scale: float, peak: float, memory_bytes: float, hbm_bytes_per_s: float,
                    calibration: Calibration) -> float:
    """Σ_classes FLOPs · flops_scale / (peak · e(d)) + memory bytes / (HBM · hbm_fraction); the head class (the
    last of gemms') at calibration.ends_fraction where one was measured."""
    gemm = 0.0
    for i, (flops, dim) in enumerate(gemm_classes):
        head = i == HEAD_CLASS and calibration.ends_fraction is not None
        gemm += flops * flops_scale / (peak * (calibration.ends_fraction if head else calibration.gemm_efficiency(dim)))
    return gemm + memory_bytes / (hbm_bytes_per_s * calibration.hbm_fraction)
