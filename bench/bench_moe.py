"""Expert parallel E = 1 (experts replicated, plain data parallel) against E = 2 and E = 4, side by side in one
run on 4 gloo ranks (CPU), or 4 GPUs with --device cuda (NCCL).

    python bench/bench_moe.py                          # 4 layers, h=128, 8 experts top-2, 4×128 tokens/rank
    python bench/bench_moe.py --experts 16 --steps 4
    python bench/bench_moe.py --device cuda --embd 768 --seq 1024
    python bench/bench_moe.py --smoke                  # seconds: 1 layer, h=32, 4 experts, 16 tokens, 1 step

The three variants are the same model.py GPT with MoE blocks, from the same seed, trained on the same data
(each rank its own batch) with the same AdamW (fp32, no clipping); only E differs. A step is forward and
backward, the gradient sums (dense and router over all 4 ranks, experts over expert_dp: 4/E ranks, one flat
all-reduce per group), and the AdamW step. Steps alternate E=1, E=2, E=4 (rotating order) after warm-up, so
the shared machine's noise hits all alike; times are rank 0's medians. Printed per variant: step time,
expert parameters and bytes per rank, the all-to-all traced over one step beside the predictions from the
routed rows (exact) and for uniform routing, and the gradient all-reduce bytes (what E trades the all-to-all
against).
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import nullcontext
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from accounting import memory  # noqa: E402
import moe  # noqa: E402
import report.axes  # noqa: E402
from common import add_device_argument, alternate, launch, rank_device  # noqa: E402
from accounting.tracer import CommTracer  # noqa: E402
from mesh import MeshShape, build_mesh  # noqa: E402
from mfu import format_bytes  # noqa: E402
from model import GPT, config_from_preset  # noqa: E402
from optim import build_adamw  # noqa: E402

EPS = (1, 2, 4)


class Variant:
    """One E: its model (this rank's experts), optimizer, mesh and MoE handle."""

    def __init__(self, ep, config, args, world, device):
        self.ep = ep
        self.mesh = build_mesh(MeshShape(dp=world, ep=ep))
        self.model = GPT(config, seed=args.seed, device=device)
        self.run = SimpleNamespace(mesh=self.mesh, config=config, seq_len=args.seq, micro_batch_size=args.batch,
                                   micro_batches=1, device=device, autocast=nullcontext(),
                                   compute_dtype=torch.float32, seed=args.seed, model=self.model, layout=None,
                                   settings=SimpleNamespace(args=SimpleNamespace()))  # no --fp8, no recipe
        self.handle = moe.apply(self.model, self.run, moe.MoEConfig(ep))
        self.optimizer = build_adamw(self.model.parameters(), 1e-4)
        params = list(self.model.parameters())
        self.losses = []
        self.groups = {name: [p for p in params if p.shard_info.grad_group == name] for name in ("dp_cp", "expert_dp")}

    def step(self, x, y):
        dist.barrier()
        self.optimizer.zero_grad(set_to_none=True)
        _, loss_sum, count = self.model(x, y)
        loss = loss_sum / count + self.model.aux_losses.weighted_sum()
        loss.backward()
        for name, params in self.groups.items():
            if self.mesh.size(name) > 1 and params:
                flat = torch.cat([p.grad.reshape(-1) for p in params])
                dist.all_reduce(flat, group=self.mesh.group(name))
                offset = 0
                for p in params:
                    p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()
        self.optimizer.step()
        self.losses.append(float(loss_sum.detach() / count))


def _rank(rank, world, args):
    torch.set_num_threads(args.threads)
    device = rank_device()
    config = config_from_preset("tiny", n_layer=args.layers, n_embd=args.embd, n_head=4, block_size=args.seq,
                                moe=moe.ExpertsConfig(experts=args.experts, topk=args.topk))
    variants = {f"E={ep}": Variant(ep, config, args, world, device) for ep in EPS}
    generator = torch.Generator().manual_seed(args.seed + rank)  # each rank its own batch
    x = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=generator).to(device)
    y = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=generator).to(device)
    traced = {}
    for name, v in variants.items():  # one traced step each (also the first warm-up step)
        tracer = CommTracer()
        for group in ("ep", "dp_cp", "expert_dp"):
            tracer.name_group(v.mesh.group(group), group)
        report.axes.observe(v.handle)  # a fresh observers.RoutedLoad on every layer
        with tracer:
            v.step(x, y)
        traced[name] = (tracer.records, v.handle.traced_prediction(None, 1), v.handle.predicted_messages())
        report.axes.observe(v.handle)  # the load line below covers the timed steps
    times = alternate({name: (lambda v=v: v.step(x, y)) for name, v in variants.items()}, args.steps,
                      warmup=args.warmup)
    if rank == 0:
        _print_table(config, args, device, variants, traced, times)


def _print_table(config, args, device, variants: dict, traced: dict, times: dict) -> None:
    """Rank 0's table: per E the step time, the experts held, the all-to-all traced and predicted, the
    gradient all-reduces; the losses (the same whatever E), the time ratios, the load of the timed steps."""
    print(f"MoE GPT: {config.n_layer} layers, h={config.n_embd}, N={args.experts} experts top-{args.topk},"
          f" dropless, {args.batch}×{args.seq} tokens per rank, 4 {'GPUs' if device.type == 'cuda' else 'gloo'} ranks,"
          f" fp32, {args.threads} thread(s)/rank;"
          f" {args.steps} timed steps each (alternating) after {args.warmup} warm-up")
    counts = memory.param_counts(config)
    print(f"  parameters: total {counts['total']:,}, active per token {counts['active']:,};"
          f" experts {counts['experts']:,} (Ψ_e = {counts['expert']:,})")
    header = (f"  {'':<5} {'step ms':>9} {'expert params/rank':>19} {'weights':>10} {'w+g+Adam':>10}"
              f" {'a2a traced/step':>16} {'(wire)':>10} {'a2a counted':>12} {'a2a uniform':>12} {'a2a calls':>9}"
              f" {'dp_cp AR':>10} {'expert_dp AR':>13}")
    print(header)
    base = times["E=1"]
    for name, v in variants.items():
        records, counted, uniform = traced[name]
        held = sum(p.numel() for layer in v.handle.layers for p in layer.experts.parameters())

        def payload(key, table=records):
            value = table.get(key)
            return 0 if value is None else (value.payload_bytes if hasattr(value, "payload_bytes") else value[1])

        a2a = records.get(("all_to_all_single", "ep"))
        print(f"  {name:<5} {times[name] * 1e3:9.1f} {held:>19,} {format_bytes(4 * held):>10}"
              f" {format_bytes(16 * held):>10} {format_bytes(payload(('all_to_all_single', 'ep'))):>16}"
              f" {format_bytes(a2a.wire_bytes if a2a else 0):>10}"
              f" {format_bytes(payload(('all_to_all_single', 'ep'), counted)):>12}"
              f" {format_bytes(payload(('all_to_all_single', 'ep'), uniform)):>12}"
              f" {a2a.calls if a2a else 0:>9} {format_bytes(payload(('all_reduce', 'dp_cp'))):>10}"
              f" {format_bytes(payload(('all_reduce', 'expert_dp'))):>13}")
    print("  CE loss at each step (the same training, whatever E): " + "; ".join(
        f"{n} " + " ".join(f"{l:.4f}" for l in v.losses) for n, v in variants.items()))
    print("  step-time ratio to E=1: " + ", ".join(f"{n} {t / base:.2f}" for n, t in times.items()))
    print("  a2a = all_to_all_single payload on the ep group per step (input bytes, all MoE layers; uniform:"
          " 4·T·k·h·4 + 8N per layer), wire = (E−1)/E of it; AR = the gradient all-reduce payload per step")
    for name, v in variants.items():  # the same data and model each step: the load of the timed steps together
        print(f"  {name} rank 0, timed steps: " + report.axes.moe_step_lines(v.handle)[0])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--embd", type=int, default=128)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=6, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, one timed step: checks the bench runs")
    add_device_argument(p)
    args = p.parse_args()
    if args.smoke:
        args.layers, args.embd, args.experts, args.batch, args.seq, args.steps, args.warmup = 1, 32, 4, 2, 8, 1, 0
    moe.check_flags(config_from_preset("tiny", n_layer=args.layers,
                                       moe=moe.ExpertsConfig(experts=args.experts, topk=args.topk)),
                    MeshShape(dp=4, ep=max(EPS)))
    launch(_rank, 4, args, device=args.device)


if __name__ == "__main__":
    main()
