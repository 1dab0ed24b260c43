"""Checkpoint cost of the `small` preset (≈10.7M parameters, DDP, fp32 + AdamW) at D = 1, 2, 4, synchronous
against asynchronous, measured side by side in one run.

    python bench/bench_ckpt.py [--dims 1 2 4] [--saves 4] [--root /tmp/bench-ckpt]
    python bench/bench_ckpt.py --device cuda --dims 1 2        # one GPU per rank (D ≤ the GPUs), NCCL
    python bench/bench_ckpt.py --smoke                          # seconds: the `tiny` preset, D = 2, one save

For every D, one set of ranks trains real steps (batch 2 × 128 tokens per rank, autocast off;
the preset's block size if shorter) and saves every
`--between` steps, alternating a synchronous and an asynchronous Checkpointer (two directories) so that the noise
of a shared machine hits both alike; then fresh Checkpointers resume from each. Printed per (D, mode):
- bytes: all shard files of one checkpoint (each logical piece is written once, spread over the D ranks);
- blocked: training time each save blocked (async: wait for the previous save + snapshot to host);
- persist: time from the start of writing to the commit (rank 0: its own shard + waiting for the others +
  manifest, renames, fsyncs);
- load: a resume (verify checksums, read, reshard into the live state), and the bytes rank 0 read.
Ratios: async/sync blocked time and persist time, and the synchronous persist time of D=1 over D (each
logical piece is written by one of the D replicas, so the writes are spread).
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


def _bench(rank, world, root, saves, between, preset):
    import torch

    import ckpt
    from resilience.ckpt_files import verify_checkpoint
    from common import synchronize
    from harness import device as rank_device
    from data import BatchSampler
    from ddp import DistributedDataParallel
    from mesh import MeshShape, build_mesh
    from model import GPT, config_from_preset
    from optim import DynamicLossScaler, build_adamw
    from ddp import DDPLayout
    from step import train_step

    device = rank_device()  # cuda:rank under --device cuda (harness backend nccl), else the CPU
    mesh = build_mesh(MeshShape(dp=world))
    config = config_from_preset(preset)
    seq = min(128, config.block_size)
    model = GPT(config, seed=0, device=device)
    layout = DDPLayout(DistributedDataParallel(model, group=mesh.group("dp_cp")), build_adamw(model.parameters(), 1e-3))
    scaler, sampler = DynamicLossScaler(False), BatchSampler(100_000, seq, 2 * world, 0)
    generator = torch.Generator().manual_seed(rank)
    batch = [(torch.randint(0, 256, (2, seq), generator=generator).to(device),) * 2]

    def step():
        train_step(layout, scaler, batch, mesh.group("dp_cp"), 1.0, torch.autocast(device.type, enabled=False), device)

    step()  # warm-up: allocations, Adam state
    savers = {mode: ckpt.Checkpointer(ckpt.CheckpointConfig(os.path.join(root, mode), async_save=mode == "async"),
                                      mesh, device=device, log=lambda *a: None) for mode in ("sync", "async")}
    step_times, loads = [], {"sync": [], "async": []}
    for i in range(saves):
        for mode, saver in savers.items():  # alternate, so machine noise hits both modes alike
            for _ in range(between):
                synchronize()
                start = time.perf_counter()
                step()
                synchronize()
                step_times.append(time.perf_counter() - start)
            saver.save((i + 1) * between, layout, scaler, sampler)
    for saver in savers.values():
        saver.close()
    for _ in range(2):
        for mode in savers:
            loader = ckpt.Checkpointer(ckpt.CheckpointConfig(os.path.join(root, mode)), mesh, device=device,
                                       log=lambda *a: None)
            torch.distributed.barrier()
            start = time.perf_counter()
            resumed = loader.resume("latest", layout, scaler, sampler, seed=0)
            synchronize()
            torch.distributed.barrier()
            loads[mode].append(time.perf_counter() - start)
    path = os.path.join(root, mode, ckpt.step_dir_name(resumed))  # the last one resumed, read once more
    bytes_read = ckpt.load_pieces(path, verify_checkpoint(path), layout.state_pieces())
    out = {"step": statistics.median(step_times), "bytes_read": bytes_read}
    for mode, saver in savers.items():
        history = saver.history
        out[mode] = dict(blocked=[s.blocked_s for s in history], persist=[s.persist_s for s in history],
                         total_bytes=history[-1].total_bytes, rank_bytes=history[-1].rank_bytes,
                         load=statistics.median(loads[mode]))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dims", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--between", type=int, default=2, help="training steps between two saves")
    parser.add_argument("--root", default="/tmp/bench-ckpt",
                        help="a new or empty directory (or one this bench made): it is cleared run by run")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--smoke", action="store_true",
                        help="seconds, to check the bench runs: --preset tiny --dims 2 --saves 1 --between 1")
    from common import add_device_argument, check_gpus, own_root

    add_device_argument(parser)
    args = parser.parse_args(argv)
    own_root(parser, args.root)
    if args.smoke:
        args.preset, args.dims, args.saves, args.between = "tiny", [2], 1, 1
    check_gpus(max(args.dims), args.device)
    backend = "nccl" if args.device == "cuda" else "gloo"  # harness: one GPU per rank, cpu:gloo,cuda:nccl

    from harness import run_ranks
    from mfu import format_bytes

    print(f"{'D':>2} {'mode':>5} {'step':>7} {'ckpt bytes':>11} {'rank0 file':>11} {'blocked/save':>13}"
          f" {'persist/save':>13} {'load':>8} {'rank0 read':>11}")
    rows = {}
    for dp in args.dims:
        root = os.path.join(args.root, f"D{dp}")
        shutil.rmtree(root, ignore_errors=True)
        results = run_ranks(_bench, dp, root, args.saves, args.between, args.preset, timeout=900,
                            backend_name=backend)
        r0 = results[0]
        for mode in ("sync", "async"):
            # per save: the slowest rank's blocked time (training waits for it at the next collective)
            blocked = statistics.median(max(r[mode]["blocked"][i] for r in results) for i in range(args.saves))
            persist = statistics.median(r0[mode]["persist"])
            load = max(r[mode]["load"] for r in results)
            rows[dp, mode] = dict(blocked=blocked, persist=persist, load=load)
            print(f"{dp:>2} {mode:>5} {r0['step'] * 1e3:>4.0f} ms {format_bytes(r0[mode]['total_bytes']):>11}"
                  f" {format_bytes(r0[mode]['rank_bytes']):>11} {blocked * 1e3:>10.0f} ms {persist * 1e3:>10.0f} ms"
                  f" {load * 1e3:>5.0f} ms {format_bytes(r0['bytes_read']):>11}", flush=True)
        shutil.rmtree(root, ignore_errors=True)
    print("ratios (side by side, same run):")
    first = args.dims[0]
    for dp in args.dims:
        sync, asyn = rows[dp, "sync"], rows[dp, "async"]
        print(f"  D={dp}: training blocked per save async/sync = {asyn['blocked'] / sync['blocked']:.3f};"
              f" persist async/sync = {asyn['persist'] / sync['persist']:.2f};"
              f" sync persist D={first}/D={dp} = {rows[first, 'sync']['persist'] / sync['persist']:.2f}")


if __name__ == "__main__":
    main()
