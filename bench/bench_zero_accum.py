"""ZeRO under bf16: the error of the accumulated gradient against float64, summed in bf16 (before) and in fp32.

    python bench/bench_zero_accum.py                      # ~10 s on 2 CPU cores
    python bench/bench_zero_accum.py --ms 1,2,8,32,64
    python bench/bench_zero_accum.py --smoke              # seconds: m = 1, 2 at stages 1 and 3

One step of a bf16 ZeroLayout or Zero3Layout (fp32 masters, autocast bf16) on 2 gloo ranks, global batch of
64 sequences cut into m micro-batches per rank; the reduced gradient (what the optimizer sees) is compared with
float64 autograd on the same bf16 working weights and batch: ‖g − g64‖ / ‖g64‖ over the whole gradient. "bf16 sum"
forces accumulate_dtype=bf16 (the old behaviour), "fp32 sum" is the default for m > 1. It runs the measurement of
tests/test_zero.py (accumulated_grad_errors), which asserts fp32 ≤ 1.05 × the m = 1 error and bf16 above it at m = 32;
this prints the numbers, with the bytes each choice holds and sends.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torch  # noqa: E402

from harness import run_ranks  # noqa: E402
from test_zero import ACCUM_BATCH, accumulated_grad_errors, relative_errors  # noqa: E402


def main(argv=None):
    import mfu

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ms", default="1,8,32", help="micro-batches per rank (each must divide 32)")
    parser.add_argument("--stages", default="1,2,3")
    parser.add_argument("--smoke", action="store_true", help="m = 1, 2 at stages 1 and 3: checks the bench runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.ms, args.stages = "1,2", "1,3"
    ms = tuple(int(m) for m in args.ms.split(","))
    stages = tuple(int(s) for s in args.stages.split(","))

    per_rank = run_ranks(accumulated_grad_errors, 2, stages, ms, (None, torch.bfloat16), timeout=600)
    errors = relative_errors(per_rank)
    first = per_rank[0]
    print(f"2 gloo ranks, global batch {ACCUM_BATCH} sequences, bf16 weights and autocast, fp32 masters;"
          f" Ψ' = {first[stages[0], ms[0], None]['padded_numel']:,}")
    print(f"{'stage':>5} {'m':>4} {'bf16 sum':>10} {'fp32 sum':>10} {'fp32/bf16':>10}   grads held (bf16 → fp32)"
          f"   reduce-scatter per step (bf16 → fp32)")
    for stage in stages:
        for m in ms:
            after = first[stage, m, None]
            before = first[stage, m, torch.bfloat16] if m > 1 else after
            e_before = errors[stage, m, torch.bfloat16] if m > 1 else errors[stage, m, None]
            e_after = errors[stage, m, None]
            print(f"{stage:>5} {m:>4} {e_before:>10.3%} {e_after:>10.3%} {e_after / e_before:>10.3f}"
                  f"   {mfu.format_bytes(before['held']['grads']):>10} →"
                  f" {mfu.format_bytes(after['held']['grads']):<10}"
                  f"   {mfu.format_bytes(before['comm']['reduce_scatter_single']):>10} →"
                  f" {mfu.format_bytes(after['comm']['reduce_scatter_single'])}")


if __name__ == "__main__":
    main()
