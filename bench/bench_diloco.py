"""DiLoCo (resilience/diloco.py) against DDP on the default corpus: validation loss and the bytes each sent.

    python bench/bench_diloco.py [--preset mini] [--steps 500] [--global-batch 16] [--hs 10,50]
    python bench/bench_diloco.py --smoke                  # seconds: tiny, 2 ranks, 2 steps, H = 2

Every run is train.py itself (train.main, 4 gloo ranks forked from this process, which has imported torch and
the trainer once) on the built-in corpus, from the same init (--seed), with the same LR schedule and the same
global batch of B sequences per step, so every run sees the same tokens:
- DDP: 4 data ranks, one AdamW step a step on the mean gradient of all B sequences;
- DiLoCo H: 4 replicas of one data rank each (--diloco-replicas 4), each B/4 sequences an inner step, its own
  AdamW; every H steps the pseudo-gradient averaged over the replicas and an outer Nesterov step (lr 0.7,
  momentum 0.9, the paper's);
- one worker: 1 rank on B/4 sequences a step (a quarter of the tokens: what one replica would reach alone).
The val loss is train.py's final evaluation (the first --eval-batches validation batches; after the last outer
step every replica holds the same model). Bytes are the run's own tracer's: per rank, everything the training
steps sent (the `step` rows of the end table, ring wire bytes), and the payload of the cross-worker messages
(DDP: the gradient all-reduce over dp_cp; DiLoCo: the Δ all-reduce over `diloco`).

The DiLoCo paper (Douillard et al. 2023, Table 2 region, 150M on C4): perplexity 15.02 with 8 replicas at
H = 500, against 16.23 for one worker and 15.30 for DDP with an 8× batch.
"""

import argparse
import math
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import train  # noqa: E402
from common import train_on_forked_ranks  # noqa: E402

UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
PHASE_ROW = re.compile(r"^(\w+)\s+(\S+)\s+(\S+)\s+(\d+)\s+([\d.]+ \w+)\s+([\d.]+ \w+)\s+[\d.]+$")
VAL = re.compile(r"\| val ([\d.]+) \|")


def _bytes(text: str) -> float:
    value, unit = text.split()
    return float(value) * UNITS[unit]


def run(world: int, argv: list, out_dir: str, label: str) -> dict:
    """train.main on `world` forked ranks; what rank 0 printed, parsed: val loss and the bytes."""
    text = train_on_forked_ranks(train.main, world, argv, out_dir, label)
    vals = VAL.findall(text)
    sent, cross = 0.0, 0.0
    for line in text.splitlines():
        row = PHASE_ROW.match(line.strip())
        if row and row.group(1) == "step":
            sent += _bytes(row.group(6))
            names = row.group(3).split("=")  # a communicator shared by several names: dp=dp_cp=expert_dp
            if "diloco" in names or ("dp_cp" in names and "--diloco" not in " ".join(argv)):
                cross += _bytes(row.group(5))
    return dict(val=float(vals[-1]), sent=sent, cross=cross)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="mini")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--global-batch", type=int, default=16, help="B sequences a step (all replicas together)")
    parser.add_argument("--hs", default="10,50", help="DiLoCo's H values, comma-separated (each divides --steps)")
    parser.add_argument("--replicas", type=int, default=4, help="R DiLoCo replicas = the DDP run's data ranks")
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--smoke", action="store_true", help="seconds: tiny preset, 2 ranks, 2 steps, H = 2")
    a = parser.parse_args(argv)
    if a.smoke:
        a.preset, a.steps, a.global_batch, a.hs, a.eval_batches, a.replicas = "tiny", 2, 4, "2", 1, 2
    hs, replicas = [int(h) for h in a.hs.split(",")], a.replicas
    with tempfile.TemporaryDirectory(prefix="bench-diloco-") as tmp:
        common = ["--preset", a.preset, "--steps", str(a.steps), "--seed", str(a.seed), "--dtype", "fp32",
                  "--eval-batches", str(a.eval_batches), "--eval-every", "0", "--log-every", str(max(1, a.steps // 5)),
                  "--sample-tokens", "0", "--peak-tflops", "1", "--out-dir", os.path.join(tmp, "out")]
        ddp_label = f"DDP ({replicas} data ranks)"
        runs = {ddp_label: run(replicas, [*common, "--global-batch", str(a.global_batch)], tmp, "ddp")}
        for h in hs:
            runs[f"DiLoCo R={replicas}, H={h}"] = run(replicas, [*common, "--global-batch", str(a.global_batch),
                                                       "--diloco-replicas", str(replicas), "--diloco-h", str(h)],
                                            tmp, f"diloco{h}")
        if not a.smoke:
            runs[f"one worker (B/{replicas} a step)"] = run(1, [*common, "--global-batch",
                                                                str(a.global_batch // replicas)], tmp, "single")
    ddp = runs[ddp_label]
    print(f"preset {a.preset}, {a.steps} steps of B={a.global_batch} sequences (DDP and DiLoCo: the same tokens;"
          f" one worker: B/{replicas}), fp32, built-in corpus, seed {a.seed}; val loss on {a.eval_batches} batches")
    print(f"{'run':<26} {'val loss':>9} {'val ppl':>9} {'sent/rank in steps':>20} {'cross-worker payload':>22}"
          f" {'vs DDP':>8}")
    for label, r in runs.items():
        ratio = f"{r['cross'] / ddp['cross']:.4f}" if ddp["cross"] and r["cross"] else "-"
        print(f"{label:<26} {r['val']:>9.4f} {math.exp(r['val']):>9.2f} {r['sent'] / 2**20:>16.2f} MiB"
              f" {r['cross'] / 2**20:>18.2f} MiB {ratio:>8}")
    print("paper (DiLoCo, 150M on C4, 88k steps): ppl 15.02 with 8 replicas at H=500, 16.23 one worker,"
          " 15.30 DDP with an 8× batch")


if __name__ == "__main__":
    main()
