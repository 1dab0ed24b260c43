"""ddp.py against torch.nn.parallel.DistributedDataParallel: same model, same batch, 2 ranks (gloo on CPU).

    python bench/bench_ddp.py [--preset small] [--steps 8]
    python bench/bench_ddp.py --device cuda --preset gpt2     # 2 GPUs, NCCL

Both wrappers drive the identical step.train_step (same loss normalisation, AdamW, clipping); only the
gradient sync differs. Steps alternate between the two so noise on this shared machine hits both alike;
the printed ratio is median step time of ddp.py / median step time of torch DDP (target ≤ 1.0).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from common import add_device_argument, alternate, launch, rank_device  # noqa: E402
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


def run(rank, world, preset, steps, micro, bucket_mb):
    device = rank_device()
    config = config_from_preset(preset)
    ours_model, torch_model = GPT(config, seed=0, device=device), GPT(config, seed=0, device=device)
    ours = DDPLayout(DistributedDataParallel(ours_model, bucket_mb=bucket_mb), build_adamw(ours_model.parameters(), 1e-4))
    theirs_ddp = torch.nn.parallel.DistributedDataParallel(torch_model, bucket_cap_mb=bucket_mb,
                                                           gradient_as_bucket_view=True)
    theirs = TorchDDPLayout(theirs_ddp, build_adamw(torch_model.parameters(), 1e-4))
    generator = torch.Generator().manual_seed(rank)
    x = torch.randint(0, config.vocab_size, (micro, config.block_size), generator=generator).to(device)
    batches = [(x, torch.roll(x, -1, 1))]
    scaler = DynamicLossScaler(enabled=False)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    medians = alternate({
        "ddp.py": lambda: train_step(ours, scaler, batches, None, 1.0, autocast, device),
        "torch DDP": lambda: train_step(theirs, scaler, batches, None, 1.0, autocast, device),
    }, steps=steps)
    # Both ranks must agree on the verdict: take the slower rank's time for each.
    times = torch.tensor([medians["ddp.py"], medians["torch DDP"]])
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    if rank == 0:
        psi = ours_model.num_params()
        backend = "NCCL" if device.type == "cuda" else "gloo"
        print(f"preset {preset}: Ψ={psi:,}, {world} {backend} ranks, micro-batch {micro}×{config.block_size},"
              f" bf16 autocast, buckets ≤{bucket_mb:g} MiB, {steps} timed steps each (alternating)")
        print(f"  ddp.py     median step {times[0] * 1e3:8.1f} ms")
        print(f"  torch DDP  median step {times[1] * 1e3:8.1f} ms")
        print(f"  ratio ddp.py / torch DDP = {times[0] / times[1]:.3f}  (target ≤ 1.0)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="small")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    add_device_argument(parser)
    a = parser.parse_args()
    launch(run, 2, a.preset, a.steps, a.micro_batch, a.bucket_mb, device=a.device)
