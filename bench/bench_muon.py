"""Muon: the optimizer step of DDP-Muon, ZeRO's gather way and the owner way side by side at D = 2 and 4, then the
loss curves of AdamW and Muon on the default corpus.

    python bench/bench_muon.py                    # minutes on 2 loaded CPU cores
    python bench/bench_muon.py --curve-only --adamw-lrs 1e-3 3e-3 1e-2 --muon-lrs 0.01 0.02 0.05   # a sweep
    python bench/bench_muon.py --preset small --timed 5 --curve-steps 300 --curve-preset mini
    python bench/bench_muon.py --smoke            # seconds: tiny, 1 timed step, a 4-step curve

Part 1, on D gloo ranks for D = 2, then 4 (the harness's ranks, one spawn per D), the same model (--preset, fp32
weights and NS), one backward's gradients, and each system's optimizer step (`layout.step`: the update order's
norm and clip, AdamW on the rest, Muon on the matrices, and the new weights' all-gather or broadcasts at stage 1)
timed ALTERNATING (common.alternate), so a loaded machine slows all alike:
    DDP-Muon            every rank orthogonalises every matrix (optimizers/muon.py, MuonDDPLayout)
    ZeRO-1/3 gather     U all-gathered, each rank the matrices its slice touches (optimizers/zero_muon.py)
    ZeRO-1/3 owner      --muon-owner: NS once per matrix, on its owner (LPT-balanced)
Per system: the median step of the slowest rank, the bytes a whole training step sends per rank (forward,
backward, reduction and update, traced: ring wire bytes; max over the ranks), NS FLOPs a step (max/mean over the
ranks) and the persistent bytes (max/mean: the owner imbalance). At stage 3 the new weights travel in the next
forward's gathers, outside the optimizer step: compare stage 3's bytes, not its step alone.

Part 2, train.py itself on one process (fp32, the built-in corpus, the same seed, batches, steps and schedule;
the tiny preset, 150 steps: a few minutes): AdamW everywhere at each of --adamw-lrs, against Muon on the blocks'
matrices at each of --muon-lrs with AdamW at --lr's default (3e-3) on the rest; per run the training loss (the
mean of each window of --curve-steps/6 steps) and the validation loss after the last step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torch  # noqa: E402

from common import alternate  # noqa: E402
from harness import run_ranks  # noqa: E402

HYPER = dict(lr=2e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
MUON_LR, CLIP = 0.02, 1.0
CURVE_ADAMW_LR = 3e-3  # part 2: --lr's default, AdamW's lr on the rest of a Muon run
SYSTEMS = ("DDP-Muon", "ZeRO-1 gather", "ZeRO-1 owner", "ZeRO-3 gather", "ZeRO-3 owner")


def _layout(name: str, config):
    """A fresh model (seed 0) under system `name`."""
    from ddp import DistributedDataParallel
    from model import GPT
    from optimizers.muon import MuonConfig, MuonDDPLayout
    from optimizers.zero_muon import ZeroMuon
    from parallel.zero3 import Zero3Layout
    from zero import ZeroConfig, ZeroLayout

    model = GPT(config, seed=0)
    muon = MuonConfig(lr=MUON_LR, adamw_lr=HYPER["lr"], weight_decay=HYPER["weight_decay"], ns_dtype=torch.float32,
                      owner=name.endswith("owner"))
    if name == "DDP-Muon":
        return MuonDDPLayout(DistributedDataParallel(model), muon, HYPER)
    stage = int(name[5])
    zero_config = ZeroConfig(stage, **HYPER, matrices=ZeroMuon(muon))
    return (Zero3Layout if stage == 3 else ZeroLayout)(model, zero_config, {"dp_cp": None})


def _rank(rank, world, preset, timed, micro):
    from contextlib import nullcontext

    from accounting.tracer import CommTracer
    from model import config_from_preset
    from optim import DynamicLossScaler
    from step import train_step

    config = config_from_preset(preset)
    generator = torch.Generator().manual_seed(rank)
    x = torch.randint(0, config.vocab_size, (micro, config.block_size), generator=generator)
    scaler, layouts, sent = DynamicLossScaler(enabled=False), {}, {}
    for name in SYSTEMS:
        layout = layouts[name] = _layout(name, config)
        with CommTracer() as tracer:  # one whole training step: forward, backward, reduction, update
            train_step(layout, scaler, [(x, x)], None, CLIP, nullcontext(), torch.device("cpu"))
        sent[name] = sum(r.wire_bytes for r in tracer.records.values())
        _, loss_sum, _ = layout(x, x)  # the timed steps' gradients
        loss_sum.backward()
        layout.finish_grad_sync()
    times = alternate({name: (lambda layout=layout: layout.step(scaler, CLIP)) for name, layout in layouts.items()},
                      timed, warmup=1)
    facts = {name: layout.facts().muon for name, layout in layouts.items()}
    return dict(times=times, sent=sent, held={name: layout.held_bytes()["total"] for name, layout in layouts.items()},
                flops={name: f.ns_flops for name, f in facts.items()},
                psi=sum(p.numel() for p in layouts["DDP-Muon"].params),
                muon=sum(p.numel() for p in layouts["DDP-Muon"].matrices))


def part1(preset: str, worlds: tuple, timed: int, micro: int) -> None:
    import mfu

    print(f"Part 1: the optimizer step, `{preset}` preset, fp32 (weights, NS), {micro} sequence(s) per rank, gloo"
          f" ranks on this CPU; median of {timed} alternated steps, the slowest rank (a loaded shared machine)")
    for world in worlds:
        began = time.time()
        results = run_ranks(_rank, world, preset, timed, micro, timeout=1800)
        first = results[0]
        print(f"D = {world}: Ψ = {first['psi']:,}, of it Muon's matrices {first['muon']:,}"
              f" ({time.time() - began:.0f} s)")
        print(f"  {'system':<15}{'step ms':>10}{'vs DDP':>8}{'sent/step (max rank)':>22}{'NS GFLOP max/mean':>22}"
              f"{'held max/mean':>24}")
        ddp = max(r["times"]["DDP-Muon"] for r in results)
        for name in SYSTEMS:
            step = max(r["times"][name] for r in results)
            flops = [r["flops"][name] for r in results]
            held = [r["held"][name] for r in results]
            print(f"  {name:<15}{step * 1e3:>10.1f}{step / ddp:>8.2f}"
                  f"{mfu.format_bytes(max(r['sent'][name] for r in results)):>22}"
                  f"{max(flops) / 1e9:>12.3f} / {statistics.mean(flops) / 1e9:<8.3f}"
                  f"{mfu.format_bytes(max(held)):>13} / {max(held) / statistics.mean(held):.3f}")
        gather, owner = (max(r["times"][f"ZeRO-1 {way}"] for r in results) for way in ("gather", "owner"))
        print(f"  step-time ratio ZeRO-1 owner / gather at D = {world}: {owner / gather:.2f}")


def _curve(label: str, argv: list, out_dir: str) -> dict:
    """train.main on one process; its metrics file's losses (window means) and val losses."""
    import train

    metrics = os.path.join(out_dir, f"{label}.jsonl")
    log = os.path.join(out_dir, f"{label}.log")
    began = time.time()
    with open(log, "w") as out:
        stdout, sys.stdout = sys.stdout, out
        try:
            train.main([*argv, "--metrics-file", metrics, "--out-dir", out_dir])
        except SystemExit as e:  # train.main ends its process group; a flag error exits
            if e.code:
                raise SystemExit(f"{label}: train.py exited {e.code}: {open(log).read()[-2000:]}") from None
        finally:
            sys.stdout = stdout
    records = [json.loads(line) for line in open(metrics)]
    return dict(loss=[r["loss"] for r in records], val={r["step"]: r["val_loss"] for r in records if "val_loss" in r},
                seconds=time.time() - began)


def part2(preset: str, steps: int, adamw_lrs: list, muon_lrs: list) -> None:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(29500 + os.getpid() % 1000))
    every = max(1, steps // 6)
    common = ["--preset", preset, "--steps", str(steps), "--dtype", "fp32", "--seed", "1337",
              "--eval-every", str(every), "--eval-batches", "4", "--log-every", str(steps), "--sample-tokens", "0",
              "--peak-tflops", "1"]
    with tempfile.TemporaryDirectory(prefix="bench-muon-") as tmp:
        runs = {f"AdamW {lr:g}": _curve(f"adamw-{lr:g}", [*common, "--lr", str(lr)], tmp) for lr in adamw_lrs}
        runs.update({f"Muon {lr:g}": _curve(f"muon-{lr:g}", [*common, "--lr", str(CURVE_ADAMW_LR), "--optimizer",
                                                             "muon", "--muon-lr", str(lr)], tmp) for lr in muon_lrs})
    print(f"Part 2: train.py, `{preset}` preset, {steps} steps of 16 × its block size tokens, fp32, built-in corpus,"
          f" seed 1337 (the same batches), warmup 5% then cosine to lr/10; AdamW at its lr on everything vs Muon at its"
          f" lr on the blocks' matrices + AdamW lr {CURVE_ADAMW_LR:g} (--lr's default) on the rest")
    windows = [(start, min(steps, start + every)) for start in range(0, steps, every)]
    print(f"  {'run':<14}" + "".join(f"{f'{a}-{b - 1}':>10}" for a, b in windows) + f"{'val (last)':>12}{'wall':>8}")
    for name, r in runs.items():
        cells = "".join(f"{statistics.mean(r['loss'][a:b]):>10.4f}" for a, b in windows)
        print(f"  {name:<14}{cells}{r['val'][max(r['val'])]:>12.4f}{r['seconds']:>7.0f}s")
    print("  (train loss: the mean of each window of steps; val: the eval after the last step; one process each,"
          " a loaded shared machine)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", help="Part 1's model (default: small)")
    parser.add_argument("--timed", type=int, default=3, help="Part 1's timed steps per system (default: 3)")
    parser.add_argument("--micro", type=int, default=1, help="Part 1's sequences per rank (default: 1)")
    parser.add_argument("--curve-preset", default="tiny", help="Part 2's model (default: tiny)")
    parser.add_argument("--curve-steps", type=int, default=150, help="Part 2's steps (default: 150)")
    parser.add_argument("--adamw-lrs", type=float, nargs="+", default=[3e-3],
                        help="Part 2: one AdamW run per lr (default: 3e-3, --lr's default)")
    parser.add_argument("--muon-lrs", type=float, nargs="+", default=[0.02],
                        help="Part 2: one Muon run per lr (default: 0.02, --muon-lr's default)")
    parser.add_argument("--skip-curve", action="store_true", help="Part 1 only (default: off)")
    parser.add_argument("--curve-only", action="store_true", help="Part 2 only (default: off)")
    parser.add_argument("--smoke", action="store_true", help="seconds: tiny, 1 timed step at D = 2, a 4-step curve")
    a = parser.parse_args(argv)
    worlds = (2, 4)
    if a.smoke:
        a.preset, a.timed, a.curve_preset, a.curve_steps, worlds = "tiny", 1, "tiny", 4, (2,)
    if not a.curve_only:
        part1(a.preset, worlds, a.timed, a.micro)
    if not a.skip_curve:
        part2(a.curve_preset, a.curve_steps, a.adamw_lrs, a.muon_lrs)


if __name__ == "__main__":
    main()
