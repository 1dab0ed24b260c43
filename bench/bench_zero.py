"""ZeRO against PyTorch's own implementations, side by side in one run, and the persistent-bytes table.

    python bench/bench_zero.py                 # ~1-2 minutes on 2 CPU cores
    python bench/bench_zero.py --steps 8 --layers 6 --seq 256
    python bench/bench_zero.py --device cuda --skip-table      # Part 1 on 2 GPUs, NCCL
    python bench/bench_zero.py --smoke         # seconds: tiny preset, 1 warm-up + 1 step, the table at D = 2

Part 1, on 2 gloo ranks (--device cuda: 2 GPUs, NCCL), the same model, the same batches, fp32 everywhere (working
weights = masters), the same AdamW hyper-parameters and clipping; the measured steps of the systems ALTERNATE, so a
noisy machine slows all of them alike:
    zero.py stage 3        vs  torch.distributed.fsdp.fully_shard (FSDP2; every block, then the root)
    zero.py stage 1        vs  torch.distributed.optim.ZeroRedundancyOptimizer (+ torch DDP)
    torch DDP + AdamW (foreach) as the unsharded baseline.
It prints the median step time of each, the ratios (target ≤ 1.0), the bytes each holds per rank (weights,
gradients, optimizer state) and the final loss of each, which must agree (they compute the same update).
Then the backend's own collectives on a message of the model's gradient size: on CPU gloo's reduce-scatter is
SLOWER than its all-reduce (NCCL's is half of one), which is what stage 1 (reduce-scatter + all-gather, 2Ψ) pays
against ZeroRedundancyOptimizer (all-reduce + broadcasts, 3Ψ).

Part 2: persistent bytes per rank for stages 0-3 at D = 1, 2, 4 for the `small` preset, predicted by
memory.persistent_bytes and measured with held_bytes() on layouts built on D gloo ranks: the fp32 recipe
(4 + 4 + 8, what `--dtype fp32` runs; stage 0 is ddp.py + DDPLayout) and the mixed recipe
(2 + 2 + 12, what `--zero N --dtype bf16` runs; stage 0 predicted only, train.py's stage 0 keeps fp32 weights).
Part 2 counts bytes, which do not depend on the device: it runs on CPU ranks whatever --device says.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from common import add_device_argument, check_gpus, synchronize  # noqa: E402
from harness import device as rank_device, run_ranks  # noqa: E402
from accounting import memory  # noqa: E402

HYPER = dict(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
CLIP = 1.0


def _nbytes(tensors) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def _state_bytes(optimizer) -> int:
    return _nbytes(t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0)


def _batches(steps, rank, world, micro, seq, vocab, device):
    generator = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(steps):
        x = torch.randint(0, vocab, (world * micro, seq), generator=generator)
        y = torch.randint(0, vocab, (world * micro, seq), generator=generator)
        out.append((x[rank * micro:(rank + 1) * micro].to(device), y[rank * micro:(rank + 1) * micro].to(device)))
    return out


def _plain_step(model, optimizer, params, x, y, group):
    """The update step.train_step makes, written for torch's layouts: loss_sum / global tokens, clip, step.

    torch's DDP and FSDP AVERAGE gradients over the D ranks where zero.py sums them (DESIGN.md): the loss is
    scaled by D here so that both give the gradient of the global mean loss (clipping sees the same norm)."""
    tokens = (y != -1).sum().double()
    dist.all_reduce(tokens, group=group)
    _, loss_sum, _ = model(x, y)
    (loss_sum * (dist.get_world_size(group) / tokens)).backward()
    torch.nn.utils.clip_grad_norm_(params, CLIP)
    optimizer.step()
    loss = loss_sum.detach().double()
    dist.all_reduce(loss, group=group)
    return float(loss / tokens)


def _compare(rank, world, preset, config_kw, micro, seq, steps, bucket_mb):
    from contextlib import nullcontext

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from model import GPT, config_from_preset
    from optim import DynamicLossScaler, adamw_param_groups, build_adamw
    from step import train_step
    from zero import ZeroConfig, ZeroLayout
    from parallel.zero3 import Zero3Layout

    device = rank_device()
    config = config_from_preset(preset, **config_kw)
    group = dist.new_group(list(range(world)))
    scaler = DynamicLossScaler(enabled=False)
    systems = {}

    def ours(stage):
        model = GPT(config, seed=0, device=device)
        layout_class = Zero3Layout if stage == 3 else ZeroLayout
        layout = layout_class(model, ZeroConfig(stage, bucket_mb=bucket_mb, **HYPER), {"dp_cp": group})

        def step(x, y):
            return train_step(layout, scaler, [(x, y)], group, CLIP, nullcontext(), device).loss

        return step, layout.held_bytes

    systems["zero.py stage 3"] = ours(3)

    model = GPT(config, seed=0, device=device)
    mesh = init_device_mesh(device.type, (world,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    fsdp_opt = build_adamw(model.parameters(), HYPER["lr"], HYPER["weight_decay"], HYPER["betas"], HYPER["eps"])

    def fsdp_step(x, y, model=model, opt=fsdp_opt):
        loss = _plain_step(model, opt, list(model.parameters()), x, y, group)
        opt.zero_grad(set_to_none=False)  # keep the sharded gradients, like the other layouts
        return loss

    def fsdp_held(model=model, opt=fsdp_opt):
        params = list(model.parameters())
        weights, grads, optim = _nbytes(params), _nbytes(p.grad for p in params), _state_bytes(opt)
        return {"weights": weights, "grads": grads, "optimizer": optim, "total": weights + grads + optim}

    systems["FSDP2 fully_shard"] = (fsdp_step, fsdp_held)
    systems["zero.py stage 1"] = ours(1)

    def torch_ddp(sharded_optimizer: bool):
        model = GPT(config, seed=0, device=device)
        ddp = TorchDDP(model, process_group=group, gradient_as_bucket_view=True)
        if sharded_optimizer:
            opt = ZeroRedundancyOptimizer(adamw_param_groups(model.parameters(), HYPER["weight_decay"]),
                                          optimizer_class=torch.optim.AdamW, process_group=group, lr=HYPER["lr"],
                                          betas=HYPER["betas"], eps=HYPER["eps"])
        else:
            opt = build_adamw(model.parameters(), HYPER["lr"], HYPER["weight_decay"], HYPER["betas"], HYPER["eps"])

        def step(x, y):
            loss = _plain_step(ddp, opt, list(model.parameters()), x, y, group)
            opt.zero_grad(set_to_none=False)  # DDP's bucket views stay
            return loss

        def held():
            params = list(model.parameters())
            weights, grads = _nbytes(params), _nbytes(p.grad for p in params)
            optim = _state_bytes(opt.optim if sharded_optimizer else opt)
            return {"weights": weights, "grads": grads, "optimizer": optim, "total": weights + grads + optim}

        return step, held

    systems["ZeroRedundancyOptimizer"] = torch_ddp(True)
    systems["torch DDP + AdamW"] = torch_ddp(False)

    batches = _batches(steps, rank, world, micro, seq, config.vocab_size, device)
    times = {name: [] for name in systems}
    losses = {name: [] for name in systems}
    for index, (x, y) in enumerate(batches):
        for name, (step, _) in systems.items():  # alternate: one step of each system per round
            synchronize()
            dist.barrier(group)
            start = time.perf_counter()
            losses[name].append(step(x, y))
            synchronize()
            elapsed = time.perf_counter() - start
            if index > 0:  # step 0 pays allocation and first-call costs
                times[name].append(elapsed)
    held = {name: h() for name, (_, h) in systems.items()}
    return times, losses, held, sum(p.numel() for p in GPT(config, seed=0).parameters())


def _collectives(rank, world, megabytes, repeats=7):
    """Median seconds of the backend's collectives on one message: what the layouts above are built from."""
    n = int(megabytes * 2**20) // 4
    device = rank_device()
    x, shard, full = (torch.randn(n, device=device), torch.empty(n // world, device=device),
                      torch.empty(n, device=device))
    ops = {
        "all_reduce (DDP, ZeroRedundancyOptimizer)": lambda: dist.all_reduce(x),
        "reduce_scatter_single (zero.py, FSDP2)": lambda: dist.reduce_scatter_single(shard, x),
        "all_gather_single (zero.py, FSDP2)": lambda: dist.all_gather_single(full, shard),
        "D broadcasts of M/D (ZeroRedundancyOptimizer)": lambda: [dist.broadcast(shard, r) for r in range(world)],
    }
    times = {name: [] for name in ops}
    for _ in range(repeats):
        for name, op in ops.items():
            synchronize()
            dist.barrier()
            start = time.perf_counter()
            op()
            synchronize()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def _persistent(rank, world, recipe, preset="small"):
    """held_bytes() of every stage's layout for `preset` on this D, next to memory.persistent_bytes."""
    from ddp import DistributedDataParallel
    from model import GPT, config_from_preset
    from optim import build_adamw
    from ddp import DDPLayout
    from zero import ZeroConfig, ZeroLayout
    from parallel.zero3 import Zero3Layout

    config = config_from_preset(preset)
    dtypes = {"fp32": (torch.float32, torch.float32), "mixed": (torch.bfloat16, torch.float32)}[recipe]
    rows = {}
    for stage in (0, 1, 2, 3):
        model = GPT(config, seed=0)
        psi = model.num_params()
        if stage == 0:
            if recipe != "fp32":
                rows[stage] = (memory.persistent_bytes(psi, recipe, 0, world), None, psi)
                continue
            ddp = DistributedDataParallel(model, bucket_mb=25.0)
            optimizer = build_adamw(model.parameters(), **HYPER)
            optimizer.step()  # AdamW allocates its moments on the first step (the gradients are zero)
            layout = DDPLayout(ddp, optimizer)
            rows[stage] = (memory.persistent_bytes(psi, recipe, 0, world), layout.held_bytes(), psi)
        else:
            layout_class = Zero3Layout if stage == 3 else ZeroLayout
            layout = layout_class(model, ZeroConfig(stage, param_dtype=dtypes[0], master_dtype=dtypes[1], **HYPER))
            rows[stage] = (memory.persistent_bytes(psi, recipe, stage, world), layout.held_bytes(),
                           layout.padded_numel)
        del model
    return rows


def main(argv=None):
    import mfu

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="steps per system (the first is not timed)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro", type=int, default=2, help="sequences per rank per step")
    parser.add_argument("--bucket-mb", type=float, default=4.0, help="zero.py stage 1/2 bucket size")
    parser.add_argument("--skip-table", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny preset, 1 warm-up + 1 step, the table at"
                        " D = 2 only: checks the bench runs")
    add_device_argument(parser)
    args = parser.parse_args(argv)
    preset, worlds, repeats = "small", (1, 2, 4), 7
    if args.smoke:
        preset, worlds, repeats = "tiny", (2,), 1
        args.steps, args.layers, args.seq, args.micro = 2, 2, 32, 1
    check_gpus(2, args.device)
    backend = "nccl" if args.device == "cuda" else "gloo"  # harness: one GPU per rank, cpu:gloo,cuda:nccl

    config_kw = dict(n_layer=args.layers)
    start = time.time()
    results = run_ranks(_compare, 2, preset, config_kw, args.micro, args.seq, args.steps, args.bucket_mb, timeout=600,
                        backend_name=backend)
    times, losses, held, psi = results[0]
    print(f"Part 1: 2 {backend} ranks, `{preset}` preset with n_layer={args.layers} (Ψ = {psi:,}), fp32, {args.micro}"
          f" x {args.seq} tokens per rank per step, {args.steps - 1} timed steps per system, alternating"
          f" ({time.time() - start:.0f} s)")
    median = {name: statistics.median(t) for name, t in times.items()}
    header = f"{'system':<26}{'median step':>12}{'weights':>12}{'grads':>12}{'optimizer':>12}{'total':>12}  final loss"
    print(header)
    for name in times:
        h = held[name]
        print(f"{name:<26}{median[name] * 1000:>9.0f} ms" + "".join(f"{mfu.format_bytes(h[k]):>12}" for k in
              ("weights", "grads", "optimizer", "total")) + f"  {losses[name][-1]:.6f}")
    for ours, theirs in (("zero.py stage 3", "FSDP2 fully_shard"), ("zero.py stage 1", "ZeroRedundancyOptimizer"),
                         ("zero.py stage 1", "torch DDP + AdamW")):
        print(f"step-time ratio {ours} / {theirs}: {median[ours] / median[theirs]:.3f}"
              f"   (rank 1: {statistics.median(results[1][0][ours]) / statistics.median(results[1][0][theirs]):.3f})")
    spread = max(l[-1] for l in losses.values()) - min(l[-1] for l in losses.values())
    print(f"final losses agree within {spread:.2e} (same update, fp32 sums in different orders)")
    megabytes = 4 * psi / 2**20
    print(f"{backend}'s collectives on one {megabytes:.1f} MiB message (the model's fp32 gradients), 2 ranks,"
          f" median:")
    for name, seconds in run_ranks(_collectives, 2, megabytes, repeats, timeout=300, backend_name=backend)[0].items():
        print(f"  {name:<48}{seconds * 1000:>8.1f} ms")

    if args.skip_table:
        return
    print()
    print(f"Part 2: persistent bytes per rank, `{preset}` preset; predicted (memory.persistent_bytes with Ψ)"
          " / measured (held_bytes(); ZeRO pads each unit to a multiple of D, Ψ' ≥ Ψ)")
    for recipe in ("fp32", "mixed"):
        bpp = memory.BYTES_PER_PARAM[recipe]
        print(f"recipe {recipe}: b_w={bpp.weights} b_g={bpp.grads} b_o={bpp.optimizer}")
        table = {}
        for world in worlds:
            table[world] = run_ranks(_persistent, world, recipe, preset, timeout=300, backend_name="gloo")[0]
        print(f"{'stage':<7}" + "".join(f"{f'D={d} predicted':>17}{'measured':>12}" for d in worlds))
        for stage in (0, 1, 2, 3):
            cells = []
            for world in worlds:
                predicted, measured, _ = table[world][stage]
                cells.append(f"{mfu.format_bytes(predicted['total']):>17}"
                             f"{mfu.format_bytes(measured['total']) if measured else '(fp32 row)':>12}")
            print(f"{stage:<7}" + "".join(cells))
        worst = max(abs(m["total"] - p["total"]) for w in table.values() for p, m, _ in w.values() if m)
        print(f"largest |measured - predicted(Ψ)|: {worst:,.0f} bytes (the padding; with Ψ' they are equal)")


if __name__ == "__main__":
    main()
