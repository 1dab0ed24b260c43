"""tensor_parallel.py against PyTorch's DTensor tensor parallel, side by side in one run (gloo on CPU, or NCCL).

    python bench/bench_tp.py                      # small preset, T=2, 2 ranks
    python bench/bench_tp.py --n-layer 2 --steps 4
    python bench/bench_tp.py --device cuda --preset gpt2 --seq 1024    # 2 GPUs
    python bench/bench_tp.py --smoke              # seconds: tiny preset, one warm-up and one measured step

Both models are the plain model.py GPT from the same seed, on the same 2-rank mesh, trained on the same
batch with the same AdamW (no clipping, fp32):
  * ours:    tensor_parallel.parallelize (Megatron f/g, attention by heads, MLP column→row, vocab-parallel
             embedding, head and cross-entropy);
  * DTensor: torch.distributed.tensor.parallel.parallelize_module with ColwiseParallel on c_attn and c_fc,
             RowwiseParallel on both c_proj (the usual Megatron plan). c_attn's rows are permuted first so
             that DTensor's contiguous row shards hold each rank's heads of q, k and v: both compute the same
             function (the first losses are printed to show it). DTensor keeps the tied embedding/head
             replicated (sharding a tied weight twice is not supported); at vocab 256 the head is ~1% of the
             FLOPs.
Measured steps alternate ours, DTensor, ours, ... after warm-up, so drift in the shared machine's load hits
both alike; the ratio is of medians. Then it prints, for T = 1, 2, 4 on `small`, the parameter bytes per rank
and Korthikanti et al.'s activation estimates.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from accounting import memory  # noqa: E402
import tensor_parallel  # noqa: E402
from common import add_device_argument, check_gpus, init_rank, synchronize  # noqa: E402
from mfu import format_bytes  # noqa: E402
from model import GPT, config_from_preset  # noqa: E402
from optim import adamw_param_groups, build_adamw  # noqa: E402
from shard import ShardInfo, Split  # noqa: E402


def _dtensor_model(config, seed, world, rank, device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = GPT(config, seed=seed, device=device)
    with torch.no_grad():  # rows [q_t; k_t; v_t] for t = 0..T-1, so DTensor's row chunk t is our shard t
        for block in model.transformer.h:
            for param in (block.attn.c_attn.weight, block.attn.c_attn.bias):
                if param is None:
                    continue
                pieces = [ShardInfo("c_attn", tuple(param.shape), splits=(Split(0, world, t, 3),)).shard_of(param.data)
                          for t in range(world)]
                param.copy_(torch.cat(pieces))
    mesh = init_device_mesh(device.type, (world,))
    plan = {}
    for i in range(config.n_layer):
        plan.update({f"transformer.h.{i}.attn.c_attn": ColwiseParallel(),
                     f"transformer.h.{i}.attn.c_proj": RowwiseParallel(),
                     f"transformer.h.{i}.mlp.c_fc": ColwiseParallel(),
                     f"transformer.h.{i}.mlp.c_proj": RowwiseParallel()})
    return parallelize_module(model, mesh, plan)


def _step(model, optimizer, x, y):
    synchronize()
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    _, loss_sum, count = model(x, y)
    (loss_sum / count).backward()
    optimizer.step()
    synchronize()
    return time.perf_counter() - start, float(loss_sum.detach() / count)


def _rank(rank, world, store, args, results):
    device = init_rank(rank, world, store, args.device)
    torch.set_num_threads(args.threads)
    config = config_from_preset(args.preset, n_layer=args.n_layer)
    group = dist.new_group(list(range(world)))
    ours = GPT(config, seed=args.seed, device=device)
    tensor_parallel.parallelize(ours, group)
    theirs = _dtensor_model(config, args.seed, world, rank, device)
    opt_ours = build_adamw(ours.parameters(), 1e-4)
    # torch's foreach AdamW cannot mix DTensor and plain tensors in one group: split each group by kind.
    from torch.distributed.tensor import DTensor

    groups = [{**g, "params": [p for p in g["params"] if isinstance(p, DTensor) == kind]}
              for g in adamw_param_groups(theirs.parameters(), 0.1) for kind in (True, False)]
    opt_theirs = torch.optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, foreach=True)
    generator = torch.Generator().manual_seed(args.seed)
    x = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=generator).to(device)
    y = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=generator).to(device)
    times = {"ours": [], "dtensor": []}
    losses = {"ours": [], "dtensor": []}
    for step in range(args.warmup + args.steps):
        for name, model, opt in (("ours", ours, opt_ours), ("dtensor", theirs, opt_theirs)):
            dist.barrier(group)
            seconds, loss = _step(model, opt, x, y)
            losses[name].append(loss)
            if step >= args.warmup:
                times[name].append(seconds)
    if rank == 0:
        results.put((times, losses))
    dist.destroy_process_group()


def print_accounting(preset: str, batch: int, seq: int):
    config = config_from_preset(preset)
    print(f"\nper rank on `{preset}` (b={batch}, s={seq}, h={config.n_embd}, a={config.n_head},"
          f" L={config.n_layer}; parameters fp32 + grads + AdamW = 16 B/param; activations 16-bit, per layer):")
    print(f"  {'T':>2}  {'params/rank':>12}  {'weights':>10}  {'w+g+Adam':>10}  {'act (no SP)':>12}"
          f"  {'act (SP)':>10}  {'act ×L (SP)':>12}")
    for t in (1, 2, 4):
        counts = memory.param_counts(config, t)
        act = memory.tp_activation_estimates(config, batch, seq, t)
        no_sp = act["none"] if t == 1 else act["tp"]
        sp = act["none"] if t == 1 else act["tp_sp"]
        print(f"  {t:>2}  {counts['per_rank']:>12,}  {format_bytes(4 * counts['per_rank']):>10}"
              f"  {format_bytes(16 * counts['per_rank']):>10}  {format_bytes(no_sp):>12}  {format_bytes(sp):>10}"
              f"  {format_bytes(sp * config.n_layer):>12}")
    print("  (T=1: sbh(34+5as/h); TP: sbh(10+24/t+5as/(ht)); TP+SP: (sbh/t)(34+5as/h), Korthikanti et al. 2022)")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--n-layer", type=int, default=None)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=6, help="measured steps per model")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, 1 warm-up + 1 step: checks the bench runs")
    add_device_argument(p)
    args = p.parse_args()
    if args.smoke:
        args.preset, args.batch, args.seq, args.steps, args.warmup = "tiny", 2, 32, 1, 1
    world = 2
    check_gpus(world, args.device)
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [context.Process(target=_rank, args=(r, world, os.path.join(tmp, "store"), args, results))
                 for r in range(world)]
        for proc in procs:
            proc.start()
        while results.empty():  # a failed rank must not leave us waiting forever
            if any(proc.exitcode not in (None, 0) for proc in procs):
                for proc in procs:
                    proc.kill()
                sys.exit("a rank failed (traceback above)")
            time.sleep(0.2)
        times, losses = results.get()
        for proc in procs:
            proc.join()
    config = config_from_preset(args.preset, n_layer=args.n_layer)
    print(f"{args.preset} (n_layer={config.n_layer}, h={config.n_embd}, heads={config.n_head},"
          f" vocab={config.vocab_size}),"
          f" T=2 on 2 {'GPUs (NCCL)' if args.device == 'cuda' else 'gloo ranks'}, batch {args.batch}×{args.seq}, fp32,"
          f" {args.threads} thread(s)/rank,"
          f" {args.steps} measured steps each (alternating) after {args.warmup} warm-up")
    print(f"  loss at step 0: ours {losses['ours'][0]:.6f}, DTensor {losses['dtensor'][0]:.6f} (same function)")
    for name in ("ours", "dtensor"):
        t = times[name]
        print(f"  {name:<8} step time median {statistics.median(t) * 1e3:8.1f} ms  (min {min(t) * 1e3:.1f},"
              f" max {max(t) * 1e3:.1f})")
    ratio = statistics.median(times["ours"]) / statistics.median(times["dtensor"])
    print(f"  step-time ratio ours / DTensor = {ratio:.3f} (target ≤ 1.0)")
    print_accounting(args.preset if args.smoke else "small", args.batch, args.seq)


if __name__ == "__main__":
    main()
