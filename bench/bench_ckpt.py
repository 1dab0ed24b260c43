"""Checkpoint cost of the `small` preset (≈10.7M parameters, DDP, fp32 + AdamW) at D = 1, 2, 4, synchronous
against asynchronous, measured side by side in one run.

    python bench/bench_ckpt.py [--dims 1 2 4] [--saves 3] [--root /tmp/bench-ckpt]

For every D and mode, each rank trains real steps (batch 2 × 128 tokens per rank, autocast off) and saves
every `--between` steps (sync or async), then a fresh Checkpointer resumes from the newest checkpoint.
Printed per (D, mode):
- bytes: all shard files of one checkpoint (each logical piece is written once, spread over the D ranks);
- blocked: training time each save blocked (async: wait for the previous save + snapshot to host);
- persist: time from the start of writing to the commit (rank 0: its own shard + waiting for the others +
  manifest, renames, fsyncs);
- overhead/save: (time of the steps and saves − as many steps at the median plain step time) / saves: what a
  save really costs training, CPU contention of the background thread included (noisy on a shared machine);
- load: a resume (verify checksums, read, reshard into the live state), and the bytes rank 0 read.
Ratios: async/sync blocked time and overhead, and persist time of D=1 over D.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]


def _bench(rank, world, root, saves, between, async_save):
    import torch

    import ckpt
    from data import BatchSampler
    from ddp import DistributedDataParallel
    from mesh import MeshShape, build_mesh
    from model import GPT, config_from_preset
    from optim import DynamicLossScaler, build_adamw
    from train import ReplicatedUpdate, train_step

    mesh = build_mesh(MeshShape(dp=world))
    config = config_from_preset("small")
    model = GPT(config, seed=0)
    layout = ReplicatedUpdate(DistributedDataParallel(model, group=mesh.dp_cp_group), build_adamw(model.parameters(), 1e-3))
    scaler, sampler = DynamicLossScaler(False), BatchSampler(100_000, 128, 2 * world, 0)
    generator = torch.Generator().manual_seed(rank)
    batch = [(torch.randint(0, 256, (2, 128), generator=generator),) * 2]

    def step():
        train_step(layout, scaler, batch, mesh.dp_cp_group, 1.0, torch.autocast("cpu", enabled=False), "cpu")

    def timed_step():
        start = time.perf_counter()
        step()
        return time.perf_counter() - start

    step()  # warm-up: allocations, Adam state
    torch.distributed.barrier()
    plain = [timed_step() for _ in range(saves * between)]

    checkpointer = ckpt.Checkpointer(root, mesh, keep=2, async_save=async_save, log=lambda *a: None)
    torch.distributed.barrier()
    with_saves = 0.0
    for i in range(saves):
        with_saves += sum(timed_step() for _ in range(between))
        start = time.perf_counter()
        checkpointer.save((i + 1) * between, layout, scaler, sampler)
        with_saves += time.perf_counter() - start
    checkpointer.close()

    loader = ckpt.Checkpointer(root, mesh, keep=2, log=lambda *a: None)
    torch.distributed.barrier()
    start = time.perf_counter()
    loader.resume("latest", layout, scaler, sampler, seed=0)
    torch.distributed.barrier()
    load_s = time.perf_counter() - start
    path, manifest = loader.find("latest")
    bytes_read = ckpt.load_pieces(path, manifest, layout.state_pieces())
    history = checkpointer.history
    return dict(blocked=[s.blocked_s for s in history], persist=[s.persist_s for s in history],
                total_bytes=history[-1].total_bytes, rank_bytes=history[-1].rank_bytes,
                step=statistics.median(plain), plain=statistics.median(plain) * saves * between,
                with_saves=with_saves, load=load_s, bytes_read=bytes_read, params=model.num_params())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dims", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--between", type=int, default=2, help="training steps between two saves")
    parser.add_argument("--root", default="/tmp/bench-ckpt")
    args = parser.parse_args()

    from harness import run_ranks
    from mfu import format_bytes

    print(f"{'D':>2} {'mode':>5} {'step':>7} {'ckpt bytes':>11} {'rank0 file':>11} {'blocked/save':>13} {'persist/save':>13}"
          f" {'overhead/save':>14} {'load':>8} {'rank0 read':>11}")
    rows = {}
    for dp in args.dims:
        for mode in ("sync", "async"):
            root = os.path.join(args.root, f"D{dp}-{mode}")
            shutil.rmtree(root, ignore_errors=True)
            results = run_ranks(_bench, dp, root, args.saves, args.between, mode == "async", timeout=600)
            r0 = results[0]
            blocked = statistics.mean(max(r["blocked"][i] for r in results) for i in range(args.saves))
            persist = statistics.mean(r0["persist"])
            overhead = (max(r["with_saves"] for r in results) - max(r["plain"] for r in results)) / args.saves
            load = max(r["load"] for r in results)
            rows[dp, mode] = dict(blocked=blocked, persist=persist, overhead=overhead, load=load)
            print(f"{dp:>2} {mode:>5} {r0['step'] * 1e3:>4.0f} ms {format_bytes(r0['total_bytes']):>11} {format_bytes(r0['rank_bytes']):>11}"
                  f" {blocked * 1e3:>10.0f} ms {persist * 1e3:>10.0f} ms {overhead * 1e3:>11.0f} ms"
                  f" {load * 1e3:>5.0f} ms {format_bytes(r0['bytes_read']):>11}", flush=True)
            shutil.rmtree(root, ignore_errors=True)
    print("ratios (side by side, same run):")
    for dp in args.dims:
        sync, asyn = rows[dp, "sync"], rows[dp, "async"]
        print(f"  D={dp}: blocked async/sync = {asyn['blocked'] / sync['blocked']:.3f},"
              f" overhead async/sync = {asyn['overhead'] * 1e3:.0f}/{sync['overhead'] * 1e3:.0f} ms,"
              f" sync persist D=1/D={dp} = {rows[args.dims[0], 'sync']['persist'] / sync['persist']:.2f}")


if __name__ == "__main__":
    main()
