"""Context parallel: step time and saved activations per rank at C = 1, 2, 4 in one run; zig-zag against
contiguous; and PyTorch's own context parallel (torch.distributed.tensor.experimental.context_parallel).

    python bench/bench_context_parallel.py                                 # small, s=1024, CPU/gloo
    python bench/bench_context_parallel.py --seq-len 2048 --n-layer 2
    python bench/bench_context_parallel.py --device cuda --seq-len 8192    # 4 GPUs (C ≤ the GPUs), NCCL
    python bench/bench_context_parallel.py --smoke                         # seconds: tiny shapes (checks it runs)

One sequence of `--seq-len` tokens (the preset's block_size is raised to it) goes forward and backward
(no optimizer step) on C ranks, for C = 1, 2, 4 in turn:
  * C = 1: the plain model (F.scaled_dot_product_attention);
  * C > 1: context_parallel.apply's attention: ring zig-zag, ring contiguous, and Ulysses where the heads
    divide by C; the variants alternate step by step (bench/common.alternate) so the machine's noise hits
    them alike; times are medians over the ranks' slowest (the step ends when the last rank does).
Activation bytes per rank are measured with memory.SavedActivations (saved_tensors_hooks, each
storage once, parameters left out) over the whole forward, and per layer, next to Korthikanti et al.'s
estimate ÷ C. Then, on the largest C, PyTorch's context_parallel runs the same plain model (its SDPA calls
are dispatched to a ring): it supports only the CUDA flash / memory-efficient / cuDNN SDPA kernels, so on
CPU it is expected to fail, and the error is printed with what it needs; with --device cuda it is timed.

On a CPU the C ranks share the machine's cores, so step time does not fall with C there; the point of the
CPU run is the activation memory, the balance ratio and the communication that is hidden. Zig-zag against
contiguous, per C: the attention's per-rank wall time (not blocked) and its CPU work; a ring hop ends with
its slowest rank, so with a core per rank the step follows the busiest rank's work, but when C ranks × their
torch threads outnumber the cores (C = 4 on 2 cores) they time-share them and the step follows the TOTAL work,
which both cuts share (the same (query, key) pairs): zig-zag cannot win there, and its waits are peers'
descheduled compute, which is why the ring's "hidden" share reads 0% (a lower bound; see report.axes.cp_hidden_lines).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from accounting import measure  # noqa: E402
import context_parallel  # noqa: E402
import report.axes  # noqa: E402
from common import add_device_argument, alternate, check_gpus, init_rank  # noqa: E402
from accounting.memory import SavedActivations, activation_bytes_per_layer  # noqa: E402
from mfu import format_bytes  # noqa: E402
from model import GPT, config_from_preset  # noqa: E402


def _config(args):
    config = config_from_preset(args.preset, n_layer=args.n_layer)
    config.block_size = max(config.block_size, args.seq_len)  # learned positions for the long sequence
    return config


def _batch(args, config, device):
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(0, config.vocab_size, (args.micro, args.seq_len), generator=generator)
    y = torch.randint(0, config.vocab_size, (args.micro, args.seq_len), generator=generator)
    return x.to(device), y.to(device)


def _autocast(args, device):
    return torch.autocast(device.type, dtype=torch.bfloat16) if args.dtype == "bf16" else torch.autocast(
        device.type, enabled=False)


def _variants(cp, config):
    if cp == 1:
        return [("plain", None, None)]
    out = [("ring zigzag", "ring", "zigzag"), ("ring contiguous", "ring", "contiguous")]
    if config.n_head % cp == 0:
        out.append(("ulysses", "ulysses", "zigzag"))
    return out


def _rank(rank, world, store, args, out_path):
    device = init_rank(rank, world, store, args.device)  # cuda: one GPU per rank, NCCL for CUDA tensors
    try:
        result = _measure(rank, world, args, device)
        if args.torch_cp and world == max(args.cps):
            result["torch"] = _torch_context_parallel(rank, world, args, device)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _measure(rank, world, args, device):
    config = _config(args)
    group = dist.new_group(list(range(world)))
    x, y = _batch(args, config, device)
    autocast = _autocast(args, device)
    models, handles, saved, losses = {}, {}, {}, {}
    for name, impl, balance in _variants(world, config):
        model = GPT(config, seed=0, device=device)
        batch = [(x, y, None)]
        if impl is not None:
            ring = context_parallel.parallelize(model, group, impl, balance)
            compute_bytes = 2 if args.dtype == "bf16" else 4
            shape = context_parallel.LayerShape(args.micro, args.seq_len, config.n_embd, compute_bytes)
            cp_config = context_parallel.CPConfig(world, impl, balance)
            handles[name] = context_parallel.ContextParallel(model, ring, cp_config, shape)
            report.axes.observe(handles[name])  # the clock the ring reports to (observers.WaitClock)
            batch = handles[name].shard_batches(batch)
        xs, ys, pos = batch[0]
        params = list(model.parameters())
        with SavedActivations(exclude=params) as whole, autocast:
            _, loss_sum, _ = model(xs, ys, pos)
        loss_sum.backward()
        block_input = torch.randn(args.micro, xs.shape[1], config.n_embd, device=device, requires_grad=True)
        with SavedActivations(exclude=params) as layer, autocast:
            model.transformer.h[0](block_input).sum().backward()
        saved[name] = (whole.bytes, layer.bytes)
        total = loss_sum.detach().double()
        dist.all_reduce(total, group=group)
        losses[name] = float(total) / (args.micro * args.seq_len)

        def step(model=model, xs=xs, ys=ys, pos=pos):
            model.zero_grad(set_to_none=True)
            with autocast:
                _, loss, _ = model(xs, ys, pos)
            loss.backward()
            _sync(device)

        models[name] = step
    for handle in handles.values():  # the timing below is what the ring's hidden fraction reports
        handle.observer.reset()
    dist.barrier(group)
    times = alternate({name: _synchronized(fn, group) for name, fn in models.items()}, args.steps, args.warmup)
    hidden, compute = {}, {}
    for name, handle in handles.items():
        if handle.config.impl == "ring":  # per pass and rank: wall time not blocked, and the CPU work (however shared)
            mine = torch.zeros(2, 2, world, dtype=torch.float64)  # [wall | cpu, forward | backward, rank]
            for row, stat in enumerate(handle.observer.phases[phase] for phase in ("forward", "backward")):
                mine[0, row, rank] = (stat.seconds - stat.waited) / max(1, stat.passes)
                mine[1, row, rank] = stat.cpu / max(1, stat.passes)
            dist.all_reduce(mine, group=group)
            compute[name] = {"wall": mine[0].tolist(), "cpu": mine[1].tolist(), "threads": torch.get_num_threads()}
            measure.time_ring_alone(handle.facts(), handle.observer, device)  # into the clock's `alone`
            hidden[name] = report.axes.cp_hidden_lines(handle.observer, on_cpu=device.type == "cpu")
    worst = {}
    for name, seconds in times.items():  # the step ends when the slowest rank finishes
        t = torch.tensor(seconds, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        worst[name] = float(t)
    return {"times": worst, "saved": saved, "losses": losses, "hidden": hidden, "compute": compute}


def _synchronized(fn, group):
    def run():
        fn()
        dist.barrier(group)  # every rank starts the next step together
    return run


def _torch_context_parallel(rank, world, args, device):
    """PyTorch's CP on the plain model: its SDPA is dispatched to torch's ring (head-tail load balancing)."""
    from torch.distributed.device_mesh import init_device_mesh

    config = _config(args)
    x, y = _batch(args, config, device)
    pos = torch.arange(args.seq_len, device=device)
    model = GPT(config, seed=0, device=device)
    autocast = _autocast(args, device)
    try:
        from torch.distributed.tensor.experimental import context_parallel as torch_cp

        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("cp",))
        group = mesh.get_group()

        def step():
            model.zero_grad(set_to_none=True)
            xs, ys, ps = x.clone(), y.clone(), pos.clone()
            with torch_cp(mesh, buffers=[xs, ys, ps], buffer_seq_dims=[1, 1, 0], no_restore_buffers={xs, ys, ps}):
                with autocast:
                    _, loss_sum, _ = model(xs, ys, ps)
                loss_sum.backward()
            _sync(device)
            return loss_sum.detach().double()

        total = step()
        dist.all_reduce(total, group=group)
        times = alternate({"torch": _synchronized(step, group)}, args.steps, args.warmup)
        t = torch.tensor(times["torch"], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return {"ok": True, "seconds": float(t), "loss": float(total) / (args.micro * args.seq_len)}
    except Exception as error:  # noqa: BLE001 - reported, not hidden: the printout says what it needs
        return {"ok": False, "error": f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}",
                "where": traceback.format_exc().strip().splitlines()[-3][:200]}


def _launch(world, args):
    check_gpus(world, args.device)
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "result.json")
        # On CPU the ranks fork from this process, which has imported torch and the trainer but run nothing:
        # each spawned rank would import them again (~5 s of CPU each, most of a --smoke run). CUDA needs spawn.
        mp.start_processes(_rank, args=(world, os.path.join(tmp, "store"), args, out_path), nprocs=world,
                           start_method="spawn" if args.device == "cuda" else "fork")
        with open(out_path) as f:
            return json.load(f)


def _balance_explained(cp, compute, times, device) -> str:
    """Why zig-zag's balance does or does not shorten the step here, from the ranks' CPU work per layer.

    A ring hop ends when its slowest rank does, so with a core (or GPU) per rank the attention waits for the
    busiest rank: max over ranks. When the C ranks' threads outnumber the cores, the ranks time-share them and
    the step waits for the whole work instead: the sum over ranks, the same for both cuts (equal pairs)."""
    work = {name: [f + b for f, b in zip(*compute[name]["cpu"])] for name in ("ring zigzag", "ring contiguous")}
    busiest = max(work["ring zigzag"]) / max(work["ring contiguous"])
    total = sum(work["ring zigzag"]) / sum(work["ring contiguous"])
    threads, cores = compute["ring zigzag"]["threads"], os.cpu_count()
    step = times["ring zigzag"] / times["ring contiguous"]
    if device != "cpu":
        return (f"    attention work zig-zag / contiguous: busiest rank {busiest:.3f}, all ranks {total:.3f}"
                f" (host CPU time; on GPUs the busiest rank's kernels set the step: see the profiler)")
    wall, cpu = (sum(sum(compute["ring zigzag"][kind], [])) for kind in ("wall", "cpu"))
    busy = cpu / wall  # cores a rank kept busy while it computed (not blocked), over the ranks
    shared = cp * threads > cores or busy < 0.8 * threads
    why = (f"{cp} ranks × {threads} torch threads on {cores} cores" if cp * threads > cores else
           f"each rank kept only {busy:.2f} cores busy for its {threads} thread(s) while computing: other jobs"
           f" share this machine")
    return (f"    attention work (CPU) zig-zag / contiguous: busiest rank {busiest:.3f}, all ranks {total:.3f};"
            + (f" {why}: the ranks time-share the cores, so the step follows the total work ({total:.3f}), not"
               f" the busiest rank; step time zig-zag / contiguous measured {step:.3f}. With a core per rank it"
               f" would follow the busiest rank ({busiest:.3f} of the attention)" if shared else
               f" a core per thread ({busy:.2f} busy per rank), so the attention follows the busiest rank"
               f" ({busiest:.3f}); step time zig-zag / contiguous measured {step:.3f} (the rest of the step is"
               f" balanced in both)"))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--n-layer", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--micro", type=int, default=1, help="sequences per micro-batch (b)")
    p.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--steps", type=int, default=3, help="measured steps per variant")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="bf16: autocast")
    add_device_argument(p)
    p.add_argument("--no-torch-cp", dest="torch_cp", action="store_false", help="skip PyTorch's context_parallel")
    p.add_argument("--smoke", action="store_true",
                   help="seconds: tiny preset, 1 layer, s=64, C = 1 and 2, 1 warm-up + 1 step")
    args = p.parse_args()
    if args.smoke:
        args.preset, args.n_layer, args.seq_len, args.cps, args.steps, args.warmup = "tiny", 1, 64, [1, 2], 1, 1
        args.torch_cp = False
    for cp in args.cps:
        if cp < 1 or args.seq_len % (2 * cp):
            p.error(f"--seq-len {args.seq_len} must be divisible by 2C for every C of --cps (zig-zag: 2C equal"
                    f" chunks), not by 2·{cp}")
    config = _config(args)
    print(f"{args.preset}: L={config.n_layer}, h={config.n_embd}, a={config.n_head}; one micro-batch of"
          f" b={args.micro} × s={args.seq_len} tokens, forward + backward, {args.dtype} on {args.device}"
          f" ({os.cpu_count()} CPU cores shared by the C ranks on CPU); {args.steps} measured steps per variant"
          f" after {args.warmup} warm-up, alternating")
    results = {cp: _launch(cp, args) for cp in args.cps}
    b, s, h, a = args.micro, args.seq_len, config.n_embd, config.n_head
    e = 2 if args.dtype == "bf16" else 4
    estimate = activation_bytes_per_layer(s, b, h, a)
    no_scores = activation_bytes_per_layer(s, b, h, 0) - 2 * s * b * h  # no scores, no dropout masks: 32sbh
    print(f"\n  {'C':>2}  {'variant':<16} {'step':>9}  {'loss':>8}  {'saved/rank':>11}  {'per layer':>10}"
          f"  {'×2/e':>10}  {'Korthikanti÷C':>13}  {'32sbh÷C':>10}")
    base = results[args.cps[0]]["saved"]["plain"][1] if 1 in args.cps else None
    for cp, result in results.items():
        for name, seconds in result["times"].items():
            whole, layer = result["saved"][name]
            print(f"  {cp:>2}  {name:<16} {seconds * 1e3:7.0f}ms  {result['losses'][name]:8.5f}"
                  f"  {format_bytes(whole):>11}  {format_bytes(layer):>10}  {format_bytes(layer * 2 / e):>10}"
                  f"  {format_bytes(estimate / cp):>13}  {format_bytes(no_scores / cp):>10}"
                  + (f"   layer ÷ C=1: {layer / base:.3f}" if base else ""))
    print("  (saved/rank: the whole forward, embeddings and the logits included; per layer: block 0;"
          " ×2/e: scaled to 16-bit elements for the estimate's units)")
    for cp, result in results.items():
        times = result["times"]
        if "ring zigzag" in times:
            ulysses = (f", Ulysses / ring zig-zag = {times['ulysses'] / times['ring zigzag']:.3f}" if "ulysses" in times
                       else f" (Ulysses needs n_head={a} divisible by C)")
            print(f"  C={cp}: step time zig-zag / contiguous = {times['ring zigzag'] / times['ring contiguous']:.3f}"
                  + ulysses)
            work = context_parallel.causal_work(s, cp)
            print("    causal work max/mean: "
                  + ", ".join(f"{k} {max(v) / (sum(v) / cp):.3f}" for k, v in work.items()))
            for name, measured in result["compute"].items():
                for kind in ("wall", "cpu"):
                    forward, backward = measured[kind]
                    what = "compute (wall, not blocked)" if kind == "wall" else "work (CPU)"
                    print(f"    {name:<16} attention {what:<27}"
                          " per layer, by rank (ms): forward " + " ".join(f"{t * 1e3:.0f}" for t in forward)
                          + ", backward " + " ".join(f"{t * 1e3:.0f}" for t in backward)
                          + f"; max/mean forward {max(forward) / (sum(forward) / cp):.2f},"
                            f" backward {max(backward) / (sum(backward) / cp):.2f}")
            if "ring contiguous" in result["compute"]:
                print(_balance_explained(cp, result["compute"], times, args.device))
            for name, lines in result["hidden"].items():
                for line in lines:
                    print(f"    {name}:{line}")
    torch_result = results[max(args.cps)].get("torch")
    if torch_result is not None:
        print(f"\n  PyTorch context_parallel at C={max(args.cps)}:")
        if torch_result["ok"]:
            ours = results[max(args.cps)]["times"]["ring zigzag"]
            print(f"    step {torch_result['seconds'] * 1e3:.0f} ms, loss {torch_result['loss']:.5f};"
                  f" ours (ring zig-zag) / torch = {ours / torch_result['seconds']:.3f}")
        else:
            print(f"    did not run here: {torch_result['error']}\n      at {torch_result['where']}")
            print("    it needs CUDA: it dispatches aten._scaled_dot_product_flash_attention, _efficient_attention"
                  " and _cudnn_attention (the GPU SDPA kernels) to its ring; CPU SDPA goes through"
                  " _scaled_dot_product_flash_attention_for_cpu, which it does not handle. Run this script"
                  " with --device cuda on ≥ max(--cps) GPUs.")


if __name__ == "__main__":
    main()
