"""Expert load balance: no balancing, the auxiliary loss, and auxiliary-loss-free bias balancing, side by side on
the default corpus (the standard library's source, byte tokens), one process.

    python bench/bench_moe_balance.py                  # small preset, 8 experts top-2, 200 steps of 4×256 tokens
    python bench/bench_moe_balance.py --steps 500 --batch 8 --experts 16 --threads 2   # an idle machine
    python bench/bench_moe_balance.py --rows none,sigmoid,aux   # some rows (ROWS), in this order
    python bench/bench_moe_balance.py --smoke          # seconds: tiny preset, 4 experts, 8 steps of 4×32 tokens

Each row is `python train.py` with the shared flags below plus its own (ROWS), run in this process through
train.py's own start-up (`train.start_training`) and step (`step.train_step`), one row after the other; every
row starts from the same init (the same --seed: each weight is drawn from (seed, its name)) and sees the same
batches. Shared: --preset small (6 layers, h = 384, every block MoE) --moe-experts 8 --moe-topk 2, dropless,
--global-batch 4 (--seq-len the preset's 256: 1,024 tokens, 2,048 routed slots per MoE layer and step, 256 per
expert when balanced), --lr and its schedule as train.py's defaults (2e-3, warm-up 5%, cosine to 2e-4), the router
z-loss at its default (β = 0.001) in every row, --dtype auto (bf16 autocast where the CPU has it; the router is
fp32 either way). The size is the issue's (a `small` MoE); the batch and the steps are what a 2-core machine
shared with other work trains in well under an hour (one thread: a second one waits on the others' work).

Measured per row, from the per-expert loads c_i of every MoE layer (slots routed to expert i, before capacity):
    MaxVio = (max_i c_i − mean_i c_i) / mean_i c_i
- batch MaxVio: over the global batch of each training step (one process: its batch is the global one), each
  MoE layer's, averaged over the MoE layers; the table gives its mean over the last 50 steps (and the worst
  layer's mean over those steps);
- global MaxVio: the same over the loads of all --eval-batches validation batches of the final model, summed
  per layer, averaged over the layers: the loss-free paper's MaxVio_global (its Table: 0.72 with the auxiliary
  loss, 0.04 loss-free, at 1B; Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing Strategy for
  Mixture-of-Experts");
- the final val loss (train.evaluate: the first --eval-batches validation batches), the train loss averaged over
  the last 50 steps, and the wall time of the steps and the eval (start-up not included).
Each step's loads are the layers' own (`layer.load.last`, router.ExpertLoad: the global load the bias is
updated from), checked against what the routing observer (moe.RoutingObserver, observers.RoutedLoad) saw; the
validation batches' loads come from the observer (the layers count training forwards only).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from typing import NamedTuple

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from accounting import observers  # noqa: E402
from cli import flags  # noqa: E402
from resilience import goodput  # noqa: E402
import train  # noqa: E402
from accounting.tracer import CommTracer  # noqa: E402
from step import train_step  # noqa: E402

# Row name -> (what it is, its own train.py flags). "none" keeps the z-loss (it bounds the logits, it does not
# balance); the loss-free rows route by sigmoid scores with a per-expert bias updated from each step's load:
# γ = 1e-3 is the paper's (tuned for runs of many thousand steps: b moves at most γ per step, 0.2 in 200 steps,
# while the router at lr 2e-3 spreads the scores faster), γ = 1e-2 what a few hundred steps need.
ROWS = {
    "none": ("no balancing (aux coef 0)", ["--moe-aux-coef", "0"]),
    "sigmoid": ("sigmoid scores, no balancing", ["--moe-aux-coef", "0", "--moe-score", "sigmoid"]),
    "aux": ("auxiliary loss α=0.01, softmax", ["--moe-aux-coef", "0.01"]),
    "loss-free": ("loss-free bias γ=1e-3, sigmoid", ["--moe-aux-coef", "0", "--moe-score", "sigmoid",
                                                      "--moe-bias-rate", "1e-3"]),
    "loss-free-1e-2": ("loss-free bias γ=1e-2, sigmoid", ["--moe-aux-coef", "0", "--moe-score", "sigmoid",
                                                         "--moe-bias-rate", "1e-2"]),
    "loss-free+seq": ("loss-free γ=1e-3, + seq aux 1e-4", ["--moe-aux-coef", "0", "--moe-score", "sigmoid",
                                                            "--moe-bias-rate", "1e-3", "--moe-seq-aux-coef", "1e-4"]),
}
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
PAPER = {"aux": 0.72, "loss-free": 0.04}  # Wang et al. 2024, MaxVio_global at 1B (validation set)


class BalanceRecord(observers.RoutedLoad):
    """observers.RoutedLoad (the training forwards' loads, `take_load` once per step) that also sums the loads of the
    evaluation forwards (eval mode or no grad; never a checkpointed recompute) per layer, for global MaxVio."""

    def __init__(self):
        super().__init__()
        self.eval_loads = {}  # {layer id: [N] slots routed by the evaluation forwards}

    def routed(self, layer, load, keep, sent: int, received: int) -> None:
        if layer.training and torch.is_grad_enabled():
            super().routed(layer, load, keep, sent, received)
        else:
            self.eval_loads[layer.layer_id] = self.eval_loads.get(layer.layer_id, 0) + load


def max_violation(load: torch.Tensor) -> torch.Tensor:
    """(max − mean)/mean over the last dimension (experts): 0 when balanced, N − 1 when one expert takes all."""
    load = load.double()
    mean = load.mean(dim=-1)
    return (load.max(dim=-1).values - mean) / mean


class RowResult(NamedTuple):
    batch_maxvio: float  # mean over the last `window` steps of the per-step MaxVio averaged over the MoE layers
    worst_layer: float  # the largest per-layer mean over those steps
    global_maxvio: float  # over the validation batches' summed loads, averaged over the layers
    val_loss: float
    train_loss: float  # mean over the last `window` steps
    seconds: float  # the steps and the final eval
    steps: int
    loads_agree: bool  # the layers' step loads (`layer.load.last`) equal the routing observer's, every step


def run_row(argv: list, window: int, log) -> RowResult:
    """Train one row as `python train.py argv` would (its printouts to `log`), reading the per-expert loads of
    every MoE layer after each step; then the val loss and the validation batches' loads."""
    settings = flags.parse(argv, train.AXES)
    with contextlib.redirect_stdout(log):
        t = train.start_training(settings, CommTracer(), goodput.Clock())
    run, args = t.run, settings.args
    handle = next(axis for axis in run.axes if axis.name == "moe")
    record = BalanceRecord()
    handle.observe(record)
    per_step, losses, agree = [], [], True  # [steps][L_moe, N] loads, train losses, layers = observer
    began = time.perf_counter()
    for step in range(args.steps):
        run.layout.set_lr(t.lr_schedule(step))
        outcome = train_step(run.layout, t.scaler, train.local_batches(run, t.sampler, t.train_tokens, step),
                             run.mesh.group("dp_cp"), args.grad_clip, run.autocast, run.device, model=run.model,
                             schedule=run.schedule, axes=run.axes, data_size=run.mesh.size("dp"))
        per_step.append(torch.stack([layer.load.last for layer in handle.layers]).cpu())  # [L_moe, N], global
        observed, _, _ = record.take_load(run.micro_batches)  # the same counts, as the routing observer saw them
        agree &= per_step[-1].tolist() == [observed[layer.layer_id] for layer in handle.layers]
        losses.append(outcome.loss)
        if step % 50 == 0 or step == args.steps - 1:
            print(f"  step {step}: loss {outcome.loss:.4f}, batch MaxVio {max_violation(per_step[-1]).mean():.3f}"
                  f" ({time.perf_counter() - began:.0f} s)", file=log, flush=True)
    val_loss = train.evaluate(run, t.val_tokens, t.val_sampler)
    seconds = time.perf_counter() - began
    dist.destroy_process_group()  # the next row joins a fresh one-process group
    last = max_violation(torch.stack(per_step[-window:]))  # [window, L_moe]
    eval_load = torch.stack([record.eval_loads[i] for i in sorted(record.eval_loads)])
    return RowResult(float(last.mean()), float(last.mean(dim=0).max()), float(max_violation(eval_load).mean()),
                     val_loss, statistics.fmean(losses[-window:]), seconds, args.steps, agree)


def print_header(shared: list, window: int, layers: int, threads: int, logs: str) -> None:
    print(f"MoE load balance: train.py {' '.join(shared)}; one process, {threads} thread(s), one row after"
          f" another, the same init (each row's train.py printout: {logs})")
    print(f"  MaxVio = (max load − mean load)/mean load per MoE layer, averaged over the {layers} MoE layers;"
          f" batch: each step's global batch, mean of the last {window} steps (the worst layer's mean beside it);"
          f" global: the validation batches' loads summed")
    print(f"  {'row':<34} {'batch MaxVio':>12} {'worst layer':>11} {'global MaxVio':>13} {'paper (1B)':>10}"
          f" {'val loss':>9} {'train loss':>10} {'wall s':>8} {'s/step':>7}", flush=True)


def print_row(name: str, r: RowResult) -> None:
    """A row's line, as soon as it has trained (a long run shows its rows as they finish)."""
    paper = f"{PAPER[name]:.2f}" if name in PAPER else "-"
    print(f"  {ROWS[name][0]:<34} {r.batch_maxvio:12.3f} {r.worst_layer:11.3f} {r.global_maxvio:13.3f}"
          f" {paper:>10} {r.val_loss:9.4f} {r.train_loss:10.4f} {r.seconds:8.1f} {r.seconds / r.steps:7.2f}",
          flush=True)


def print_footer(results: dict) -> None:
    print("  paper: Wang et al. 2024 (arXiv 2408.15664), 1B MoE, MaxVio_global over its validation set: 0.72 with"
          " the auxiliary loss, 0.04 loss-free")
    wrong = [name for name, r in results.items() if not r.loads_agree]
    print("  loads: WRONG, the layers' step load differs from the routing observer's in " + ", ".join(wrong) if wrong
          else "  loads: each layer's step load (`layer.load.last`) equals the routing observer's at every step")


def train_flags(args) -> list:
    """The flags every row shares."""
    return ["--preset", args.preset, "--moe-experts", str(args.experts), "--moe-topk", str(args.topk),
            "--steps", str(args.steps), "--global-batch", str(args.batch), "--eval-batches", str(args.eval_batches),
            "--eval-every", "0", "--sample-tokens", "0", "--seed", str(args.seed), "--out-dir", args.out_dir,
            *(["--seq-len", str(args.seq)] if args.seq else [])]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=4, help="--global-batch: sequences per step")
    p.add_argument("--seq", type=int, default=None, help="--seq-len (default: the preset's block size)")
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--window", type=int, default=50, help="batch MaxVio: the mean over this many last steps")
    p.add_argument("--rows", default="none,aux,loss-free,loss-free-1e-2,loss-free+seq",
                   help=f"comma-separated, of {', '.join(ROWS)}")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (1: the shared machine's other"
                                                          " work makes a second thread wait more than it helps)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--out-dir", default="out", help="the token cache (train.py's) and each row's log go here")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, 8 steps: checks the bench runs")
    args = p.parse_args()
    if args.smoke:
        args.preset, args.experts, args.steps, args.batch, args.seq, args.eval_batches = "tiny", 4, 8, 4, 32, 2
    rows = args.rows.split(",")
    unknown = [name for name in rows if name not in ROWS]
    if unknown:
        p.error(f"--rows: {unknown[0]!r} is not a row; choose from {', '.join(ROWS)}")
    if os.environ.get("WORLD_SIZE", "1") != "1":
        p.error("one process: run it with python, not torchrun (each row is its own one-process world)")
    torch.set_num_threads(args.threads)
    shared, window = train_flags(args), min(args.window, args.steps)
    for name in rows:  # every row's flags checked (one line, exit 2) before any row trains
        flags.parse(shared + ROWS[name][1], train.AXES)
    model = flags.parse(shared, train.AXES).model
    layers = sum(model.moe.is_moe_layer(i) for i in range(model.n_layer))
    launcher_env = [var for var in LAUNCHER_ENV if var not in os.environ]  # what each row's start-up will set
    os.makedirs(args.out_dir, exist_ok=True)
    print_header(shared, window, layers, args.threads, os.path.join(args.out_dir, "bench_moe_balance_<row>.log"))
    results = {}
    for name in rows:
        with open(os.path.join(args.out_dir, f"bench_moe_balance_{name}.log"), "w") as log:
            results[name] = run_row(shared + ROWS[name][1], window, log)
        print_row(name, results[name])
        for var in launcher_env:  # mesh.init_distributed set them for its one-process world: the next row its own
            os.environ.pop(var, None)
    print_footer(results)

if __name__ == "__main__":
    main()
