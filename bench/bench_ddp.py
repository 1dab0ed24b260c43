"""ddp.py against torch.nn.parallel.DistributedDataParallel: same model, same batch, 2 ranks (gloo on CPU).

    python bench/bench_ddp.py [--preset small] [--steps 10] [--load 2] [--repeats 1] [--dtype fp32]
    python bench/bench_ddp.py --device cuda --preset gpt2 --load 0     # 2 GPUs, NCCL (bf16 there by default)
    python bench/bench_ddp.py --smoke                                   # seconds: tiny, quiet, 1 warm-up + 1 round

Both wrappers drive the identical step.train_step (same loss normalisation, AdamW, clipping); only the
gradient sync differs. Each round times one step of each, back to back, in alternating order, every step
started together on both ranks and charged to the slower one; the ratio is the median over the rounds of
(ddp.py / torch DDP) of a round: noise that drifts over seconds (other jobs) hits both steps of a round alike.

The quartiles of the rounds' ratios show the noise: two identical ddp.py instances timed this way (an A/A
run) gave 0.990 and 0.979 here, so on this shared 2-core machine a ratio within ~2% of 1 is a tie.

Under load: `--load N` runs the measurement twice, quiet and then with N busy-loop processes (`while True`)
beside the two ranks, and prints both ratios (`--load 0`: quiet only); `--repeats R` repeats the pair R
times, alternating, and prints every run: on a machine other jobs share, "quiet" is never fully quiet.

On CPU the default is fp32: bf16 autocast on a CPU without bf16 matrix units (AVX-512 BF16, AMX) emulates
its GEMMs at ~1/20 of the fp32 speed (a `small` step then takes ~40 s, of which the whole gradient sync is
~0.1%), so a bf16 ratio there measures the machine's noise, not the sync.
"""

import argparse
import json
import multiprocessing
import os
import sys
import statistics
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from common import add_device_argument, launch, rank_device, synchronize  # noqa: E402
from model import GPT, config_from_preset  # noqa: E402
from ddp import DDPLayout, DistributedDataParallel  # noqa: E402
from optim import DynamicLossScaler, build_adamw, update  # noqa: E402
from step import train_step  # noqa: E402


class TorchDDPLayout(DDPLayout):
    """torch's DDP behind the same layout protocol: it syncs inside backward, so finish has nothing to do."""

    def __init__(self, ddp, optimizer):
        self.ddp, self.optimizer, self.module = ddp, optimizer, ddp.module
        self.params = list(ddp.module.parameters())

    def finish_grad_sync(self):
        pass

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=False)  # keep the bucket views, as ddp.py does

    def step(self, scaler, clip, extra_nonfinite=None):
        grads = [p.grad for p in self.params]
        counted = [dist.get_rank() == 0] * len(grads)  # replicas: rank 0's copy counts, as DDPLayout's
        return update(grads, counted, scaler, clip, self.optimizer.step, grads[0].device)


def run(rank, world, preset, steps, warmup, micro, bucket_mb, dtype, out_path):
    device = rank_device()
    config = config_from_preset(preset)
    ours_model, torch_model = GPT(config, seed=0, device=device), GPT(config, seed=0, device=device)
    ours = DDPLayout(DistributedDataParallel(ours_model, bucket_mb=bucket_mb),
                     build_adamw(ours_model.parameters(), 1e-4))
    theirs_ddp = torch.nn.parallel.DistributedDataParallel(torch_model, bucket_cap_mb=bucket_mb,
                                                           gradient_as_bucket_view=True)
    theirs = TorchDDPLayout(theirs_ddp, build_adamw(torch_model.parameters(), 1e-4))
    generator = torch.Generator().manual_seed(rank)
    x = torch.randint(0, config.vocab_size, (micro, config.block_size), generator=generator).to(device)
    batches = [(x, torch.roll(x, -1, 1))]
    scaler = DynamicLossScaler(enabled=False)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16")
    layouts = {"ddp.py": ours, "torch DDP": theirs}
    seconds = {name: [] for name in layouts}
    for round_index in range(warmup + steps):
        for name in list(layouts)[::1 if round_index % 2 else -1]:  # alternate which one goes first
            dist.barrier()
            synchronize()
            start = time.perf_counter()
            train_step(layouts[name], scaler, batches, None, 1.0, autocast, device)
            synchronize()
            if round_index >= warmup:
                seconds[name].append(time.perf_counter() - start)
    # A step ends when the slower rank's does: the max over ranks, step by step.
    times = torch.tensor([seconds["ddp.py"], seconds["torch DDP"]], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    ratios = (times[0] / times[1]).tolist()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"ours": statistics.median(times[0].tolist()), "torch": statistics.median(times[1].tolist()),
                       "ratio": statistics.median(ratios),  # quartiles need 2 rounds (--smoke has 1)
                       "quartiles": statistics.quantiles(ratios, n=4)[::2] if len(ratios) > 1 else ratios * 2,
                       "psi": ours_model.num_params(),
                       "block_size": config.block_size, "threads": torch.get_num_threads(),
                       "buckets": [round(b / 2**20, 2) for b in ours.ddp.bucket_sizes_bytes()]}, f)


def _busy_loop():
    while True:
        pass


def measure(args, load: int) -> dict:
    """One launch of the two ranks, with `load` busy-loop processes running beside them the whole time."""
    context = multiprocessing.get_context("spawn")
    busy = [context.Process(target=_busy_loop, daemon=True) for _ in range(load)]
    for process in busy:
        process.start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out_path = os.path.join(tmp, "result.json")
            # fork on CPU: this process has run nothing yet, and each rank then skips importing torch again
            launch(run, 2, args.preset, args.steps, args.warmup, args.micro_batch, args.bucket_mb, args.dtype,
                   out_path, device=args.device, start_method="fork")
            with open(out_path) as f:
                return json.load(f)
    finally:
        for process in busy:  # the processes this function started, each by its handle
            process.terminate()
            process.join()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="small")
    parser.add_argument("--steps", type=int, default=10, help="timed rounds (one step of each per round)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default=None,
                        help="autocast dtype (default: bf16 on cuda, fp32 on cpu: see the docstring)")
    parser.add_argument("--load", type=int, default=2, help="busy-loop processes beside the loaded run (0: quiet only)")
    parser.add_argument("--repeats", type=int, default=1, help="quiet/loaded pairs, alternating")
    parser.add_argument("--smoke", action="store_true", help="seconds: tiny preset, 1 warm-up + 1 round, quiet only")
    add_device_argument(parser)
    a = parser.parse_args()
    if a.smoke:
        a.preset, a.steps, a.warmup, a.load, a.repeats = "tiny", 1, 1, 0, 1
    if a.load < 0 or a.warmup < 0 or a.repeats < 1 or a.steps < 1:
        parser.error(f"--load {a.load} and --warmup {a.warmup} must be ≥ 0, --repeats {a.repeats} and --steps"
                     f" {a.steps} ≥ 1")
    a.dtype = a.dtype or ("bf16" if a.device == "cuda" else "fp32")
    loads = [0] + ([a.load] if a.load else [])
    runs = [(load, measure(a, load)) for _ in range(a.repeats) for load in loads]
    first = runs[0][1]
    backend = "NCCL" if a.device == "cuda" else "gloo"
    print(f"preset {a.preset}: Ψ={first['psi']:,}, 2 {backend} ranks ({first['threads']} torch threads each,"
          f" {os.cpu_count()} CPU cores), micro-batch {a.micro_batch}×{first['block_size']}, {a.dtype},"
          f" buckets ≤{a.bucket_mb:g} MiB (ddp.py's, in launch order: {first['buckets']} MiB), {a.steps} rounds"
          f" after {a.warmup} warm-up")
    for load, result in runs:
        label = "quiet" if load == 0 else f"load {load}"
        print(f"  {label:<8} median step ddp.py {result['ours'] * 1e3:8.1f} ms,"
              f" torch DDP {result['torch'] * 1e3:8.1f} ms;"
              f" ratio ddp.py / torch DDP = {result['ratio']:.3f}  (median over rounds, their quartiles"
              f" {result['quartiles'][0]:.3f}–{result['quartiles'][1]:.3f}; target ≤ 1.0)")
    for load in loads:
        ratios = [result["ratio"] for run_load, result in runs if run_load == load]
        print(f"  {'quiet' if load == 0 else f'load {load}':<8} ratio over {len(ratios)} run(s): "
              + ", ".join(f"{x:.3f}" for x in ratios) + f"; max {max(ratios):.3f}")
