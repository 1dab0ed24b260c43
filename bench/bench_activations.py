"""The activation estimate against the bytes a step's first forward really saves, for every layout and recompute.

    python bench/bench_activations.py            # 7 layouts × {fp32, bf16} × {none, full, selective}, 2 ranks
    python bench/bench_activations.py --layers 4 --width 256
    python bench/bench_activations.py --smoke    # seconds: DDP and ZeRO-3, fp32, the three recompute modes
    python bench/bench_activations.py --preset small --layouts "TP+SP T2" --seq 256 --micro 1  # small's shape
    python bench/bench_activations.py --preset small --layouts "MoE EP2" --seq 256 --micro 1  # 8 experts, top-2

Each row composes a run from train.py's flags on 2 gloo ranks (DDP D=2, ZeRO-1 D=2, ZeRO-3 D=2, TP T=2, TP+SP, CP
C=2 ring and Ulysses, PP P=2 1F1B, MoE of 8 experts top-2 with D=2 and EP=2, FP8 current alone and with
EP=2), trains one step with the schedule measuring its first forward as train.py's end
line does (memory.SavedActivations.of: saved_tensors_hooks, each storage once, parameters aside, the selective
policy's kept outputs watched), and prints rank 0's estimate (activations.activation_estimate, less what SP's
regather hooks hide from the measurement) and the measurement. A ratio outside 1 ± 10% prints WRONG. Selective
recompute with the ring is refused by flags.validate (recompute.check_flags): that row says so. --preset: the
model's width, heads and layers (--layers, --width override them).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import nullcontext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torch  # noqa: E402

from harness import run_ranks  # noqa: E402
import report.run  # noqa: E402

LAYOUTS = {
    "DDP D2": [],
    "ZeRO-1 D2": ["--zero", "1"],
    "ZeRO-3 D2": ["--zero", "3"],
    "TP T2": ["--tp", "2"],
    "TP+SP T2": ["--tp", "2", "--sp"],
    "CP C2 ring": ["--cp", "2"],
    "CP C2 Ulysses": ["--cp", "2", "--cp-impl", "ulysses"],
    "PP P2 1F1B": ["--pp", "2"],
    "MoE D2": ["--moe-experts", "8", "--moe-topk", "2"],  # every block MoE, top-2 of 8 (selective: by halves)
    "MoE EP2": ["--moe-experts", "8", "--moe-topk", "2", "--ep", "2"],
    "FP8 D2": ["--fp8", "current"],  # selective keeps the GEMM outputs (fp32 where the GEMM is emulated)
    "FP8 MoE EP2": ["--fp8", "current", "--moe-experts", "8", "--moe-topk", "2", "--ep", "2"],
}
TOLERANCE = 0.10


def _measure(rank, world, cases, shape):
    from accounting import activations
    from cli import flags
    import train
    from mesh import build_mesh
    from optim import DynamicLossScaler
    from reference import global_batches, rank_micro_batches
    from step import train_step

    preset, layers, width, seq, micro = shape
    out = {}
    for name, dtype, mode in cases:
        sizes = [f for flag, value in (("--n-layer", layers), ("--n-embd", width)) if value for f in (flag, str(value))]
        argv = ["--preset", preset, *sizes, "--seq-len", str(seq),
                "--micro-batch", str(micro), "--global-batch", str(4 * micro), "--activation-checkpointing", mode,
                "--dtype", dtype, *LAYOUTS[name]]
        try:
            settings = flags.validate(flags.build_parser().parse_args(argv), world, axes=train.AXES)
        except flags.FlagError as e:
            out[(name, dtype, mode)] = str(e)
            continue
        compute = flags.DTYPES[dtype]
        run = train.Run(settings=settings, mesh=build_mesh(settings.shape, rank), config=settings.model,
                        device=torch.device("cpu"), seed=0, compute_dtype=compute,
                        param_dtype=compute if settings.args.zero else torch.float32,  # as train.py: ZeRO's working
                        autocast=torch.autocast("cpu", dtype=compute) if dtype == "bf16" else nullcontext())
        torch.manual_seed(rank // run.mesh.size("tp"))
        train.compose(run)
        (gx, gy), = global_batches(1, 4 * micro, seq)
        batches = [(*b, None) for b in rank_micro_batches(gx, gy, run.mesh.index("dp"), run.mesh.size("dp"), micro)]
        for axis in run.axes:
            batches = axis.shard_batches(batches)
        report.run.watch_saved_activations(run)
        train_step(run.layout, DynamicLossScaler(enabled=False), batches, run.mesh.group("dp_cp"), 1.0, run.autocast,
                   run.device, model=run.model, schedule=run.schedule, axes=run.axes, data_size=run.mesh.size("dp"))
        estimate = activations.activation_estimate(run)
        out[(name, dtype, mode)] = (estimate.forward - estimate.hidden, run.saved_activations.bytes,
                                    {k: v for k, v in estimate.terms.items() if v})
    return out


def main(argv=None):
    import mfu

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--layers", type=int, default=None, help="default: 4 (tiny), else the preset's")
    parser.add_argument("--width", type=int, default=None, help="default: 128 (tiny), else the preset's")
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--dtypes", nargs="+", choices=["fp32", "bf16"], default=["fp32", "bf16"])
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="DDP and ZeRO-3, fp32, 2 layers of 64: checks it runs")
    args = parser.parse_args(argv)
    layouts, dtypes = args.layouts, args.dtypes
    if args.preset == "tiny":
        args.layers, args.width = args.layers or 4, args.width or 128
    if args.smoke:
        layouts, dtypes, args.layers, args.width, args.seq = ["DDP D2", "ZeRO-3 D2"], ["fp32"], 2, 64, 32
    cases = [(name, dtype, mode) for name in layouts for dtype in dtypes for mode in ("none", "full", "selective")]
    start = time.time()
    shape = (args.preset, args.layers, args.width, args.seq, args.micro)
    rank0 = run_ranks(_measure, 2, cases, shape, timeout=900)[0]
    print(f"Activations saved for backward by one micro-batch's forward, rank 0 of 2 gloo ranks: {args.preset} preset"
          f" with n_layer={args.layers or 'its'} n_embd={args.width or 'its'}, s={args.seq}, B_μ={args.micro}"
          f" ({time.time() - start:.0f} s)")
    f = mfu.format_bytes
    print(f"{'layout':<15}{'dtype':<6}{'recompute':<11}{'estimated':>12}{'measured':>12}{'ratio':>8}")  # per forward
    for key in cases:
        name, dtype, mode = key
        got = rank0[key]
        if isinstance(got, str):
            print(f"{name:<15}{dtype:<6}{mode:<11}  refused: {got}")
            continue
        estimated, measured, _ = got
        ratio = estimated / measured
        print(f"{name:<15}{dtype:<6}{mode:<11}{f(estimated):>12}{f(measured):>12}{ratio:>8.3f}"
              + ("  WRONG" if abs(ratio - 1) > TOLERANCE else ""))


if __name__ == "__main__":
    main()
