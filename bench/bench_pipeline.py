"""pipeline.py against torch.distributed.pipelining, side by side in one run (gloo on CPU), P = 2 and 4, m = 8.

    python bench/bench_pipeline.py                  # both P, 8 layers, h=128, 8 micro-batches of 4×64 tokens
    python bench/bench_pipeline.py --pp 2 --rounds 4
    python bench/bench_pipeline.py --device cuda --pp 2 4 --n-embd 768 --seq 1024    # P GPUs, NCCL
    python bench/bench_pipeline.py --smoke          # seconds: P = 2, tiny shapes, one round (checks it runs)

On the same ranks, the same stages (model.py GPT chunks from the same seed, fp32) and the same global batch,
each of our schedules runs next to its torch counterpart:
    ours gpipe        ScheduleGPipe
    ours 1f1b         Schedule1F1B
    ours interleaved  ScheduleInterleaved1F1B            (v = 2 chunks per rank)
    ours zb (ZB-H1)   ScheduleInterleavedZeroBubble      (one chunk per rank: its ZB1P is ZB-H1's shape)
torch's stage modules wrap the very same chunks (embed → blocks → ln_f + head), its loss_fn is our
Σ CE / global tokens and scale_grads=False, so both compute the same gradients (the first step's losses are
printed). A timed step is barrier → step → barrier on every rank, so it ends when the whole pipeline has;
the variants rotate their order every round and the ratio is of medians. Gradients are zeroed between steps
and no optimizer runs (the schedules are what differs). Our measured bubble is each rank's idle fraction of
its step, from the executed timeline; the predicted one is the closed form (uniform costs) and the
comm-free simulation of the same action lists with each rank's measured mean F/B/I/W times. What that
simulation leaves out is printed under it: each rank's host time in p2p calls (posting a batch, waiting on a
receive, waiting on a send) in the last step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel import schedules  # noqa: E402
import pipeline as pp  # noqa: E402
import report.axes  # noqa: E402
import report.pipeline  # noqa: E402
from bench.common import add_device_argument, launch, rank_device, synchronize  # noqa: E402
from mesh import build_mesh, infer_mesh_shape  # noqa: E402
from model import GPT, GPTConfig, cross_entropy_sum  # noqa: E402

TORCH = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
         "zb": "ScheduleInterleavedZeroBubble"}


class TorchStageModule(nn.Module):
    """One of our chunks as torch.distributed.pipelining wants a stage: tensor in, tensor out."""

    def __init__(self, chunk):
        super().__init__()
        self.chunk = chunk

    def forward(self, x):
        h = self.chunk.embed(x) if self.chunk.has_embedding else x
        h = self.chunk.forward_blocks(h)
        return self.chunk.lm_head(self.chunk.transformer.ln_f(h)) if self.chunk.has_head else h


class NoLayout:
    """Our schedule's layout argument without data parallelism."""

    def no_sync(self):
        return nullcontext()


def _bench(rank, world, args):
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as torch_schedules

    P, m, device = world, args.micro_batches, rank_device()
    config = GPTConfig(block_size=args.seq, vocab_size=256, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd)
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (m * args.micro, args.seq), generator=generator).to(device)
    y = torch.randint(0, 256, (m * args.micro, args.seq), generator=generator).to(device)
    batches = [(x[i:i + args.micro], y[i:i + args.micro]) for i in range(0, m * args.micro, args.micro)]
    global_tokens = torch.tensor(float(y.numel()), dtype=torch.float64, device=device)
    mesh = build_mesh(infer_mesh_shape(world, pp=world), rank)  # P = world: the pp group is every rank
    group = mesh.group("pp")
    variants, ours, torch_runs, first_losses = {}, {}, {}, {}
    for name in ("gpipe", "1f1b", "interleaved", "zb"):
        v = 2 if name == "interleaved" else 1
        # Ours.
        stages = GPT(config, 0, torch.float32, device, **pp.stage_kwargs(config.n_layer, rank, P, v))  # its chunks
        schedule = pp.PipelineSchedule(pp.PipelineConfig(P, name, v), mesh, config.n_layer)
        handle = pp.Pipeline(stages, schedule, m, args.micro * args.seq * config.n_embd)
        report.axes.observe(handle)  # the clock the end lines read, as train.compose subscribes it

        def ours_step(stages=stages, schedule=schedule):
            stages.zero_grad(set_to_none=True)
            out = schedule.forward_backward(NoLayout(), stages, batches, global_tokens, 1.0, m, nullcontext(),
                                            device)
            return float(out.loss_sum / global_tokens)

        # torch.distributed.pipelining on identical chunks.
        chunk_ids = schedules.rank_chunks(rank, P, v)  # torch's stages are one module per chunk
        chunks = [GPT(config, 0, torch.float32, device, layers=schedules.stage_layers(config.n_layer, P, v, c),
                      embedding=c == 0, head=c == P * v - 1) for c in chunk_ids]
        theirs = torch.nn.ModuleList(chunks)
        torch_stages = [PipelineStage(TorchStageModule(chunk), chunk_id, P * v, device, group=group)
                        for chunk, chunk_id in zip(chunks, chunk_ids)]
        loss_fn = lambda logits, target: cross_entropy_sum(logits, target) / global_tokens  # noqa: E731
        cls = getattr(torch_schedules, TORCH[name])
        torch_schedule = cls(torch_stages if cls in (torch_schedules.ScheduleInterleaved1F1B,
                                                     torch_schedules.ScheduleInterleavedZeroBubble)
                             else torch_stages[0], m, loss_fn=loss_fn, scale_grads=False)
        holds_first, holds_last = 0 in chunk_ids, P * v - 1 in chunk_ids

        def torch_step(theirs=theirs, torch_schedule=torch_schedule, holds_first=holds_first, holds_last=holds_last):
            theirs.zero_grad(set_to_none=True)
            losses = [] if holds_last else None
            step_args = (x,) if holds_first else ()
            torch_schedule.step(*step_args, target=y if holds_last else None, losses=losses)
            loss = torch.tensor(sum(float(l.detach()) for l in losses) if holds_last else 0.0, dtype=torch.float64,
                                device=device)
            dist.all_reduce(loss, group=group)
            return float(loss)

        first_losses[name] = (ours_step(), torch_step())  # also the warm-up (torch infers shapes here)
        variants[f"ours {name}"], variants[f"torch {name}"] = ours_step, torch_step
        ours[name], torch_runs[name] = handle, torch_schedule
    times = {key: [] for key in variants}
    names = list(variants)
    for round_index in range(args.warmup + args.rounds):
        if round_index == args.warmup:
            for handle in ours.values():
                handle.observer.timings.clear()
        shift = round_index % len(names)
        for key in names[shift:] + names[:shift]:
            synchronize()
            dist.barrier(group)
            start = time.perf_counter()
            variants[key]()
            synchronize()
            dist.barrier(group)
            if round_index >= args.warmup:
                times[key].append(time.perf_counter() - start)
    medians = {key: statistics.median(values) for key, values in times.items()}
    # report/pipeline.py's end lines of each of ours (collective over pp: every rank calls them, rank 0 prints).
    lines = [(name, report.pipeline.pp_end_lines(handle)) for name, handle in ours.items()]
    latency = _message_latency(rank, group, batches[0][0].shape + (config.n_embd,), device)
    delays = {name: _message_delays(handle) for name, handle in ours.items()}
    with_latency = {name: [_bubbles_with_latency(handle, seconds) for seconds in (latency, delays[name][1])]
                    for name, handle in ours.items()}
    if rank == 0:
        where = "one GPU per rank" if device.type == "cuda" else f"{torch.get_num_threads()} thread(s) per rank"
        print(f"\nP={P}, m={m}, {config.n_layer} layers, h={config.n_embd}, micro-batch {args.micro}×{args.seq}"
              f" tokens, {args.rounds} timed rounds (median), {where}")
        print(f"  {'schedule':<12} {'ours':>9} {'torch':>9} {'ours/torch':>10}   first loss ours / torch")
        for name in ours:
            a, b = medians[f"ours {name}"], medians[f"torch {name}"]
            print(f"  {name:<12} {a * 1e3:7.1f}ms {b * 1e3:7.1f}ms {a / b:10.2f}   "
                  f"{first_losses[name][0]:.6f} / {first_losses[name][1]:.6f}")
        for name, text in lines:
            print("\n".join(text[:3] if name != args.timeline else text))  # end line, action and p2p times
            (pinged, measured), (delayed, _) = with_latency[name]
            per_rank, median, count = delays[name]
            print(f"  measured per rank {' '.join(f'{b:.1%}' for b in measured)}; simulated with {latency * 1e3:.2f} ms"
                  f" a message (ping-pong of one b·s·h message, pp ranks 0 ↔ 1, peers idle)"
                  f" {' '.join(f'{b:.1%}' for b in pinged)}")
            print(f"  last step: receive waits after both ends had posted the message, per rank (ms) "
                  f"{' '.join(f'{t * 1e3:.1f}' for t in per_rank)} ({count} waits, median {median * 1e3:.2f} ms:"
                  f" the transfer and the wake-ups, on a node whose cores these ranks share); simulated with"
                  f" {median * 1e3:.2f} ms a message {' '.join(f'{b:.1%}' for b in delayed)}")


def _message_latency(rank, group, shape, device, trips: int = 20) -> float:
    """Seconds from posting one stage-boundary message to its arrival, as the schedule posts it (one
    batch_isend_irecv each way): half the median round trip between pp ranks 0 and 1; the others wait."""
    buffer, times = torch.zeros(shape, device=device), []
    if rank in (0, 1):
        for trip in range(3 + trips):  # 3 warm-up trips
            synchronize()
            start = time.perf_counter()
            for kind in ((dist.isend, dist.irecv) if rank == 0 else (dist.irecv, dist.isend)):
                for work in dist.batch_isend_irecv([dist.P2POp(kind, buffer, 1 - rank, group)]):
                    work.wait()
            synchronize()
            times.append(time.perf_counter() - start)
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, statistics.median(times[3:]) / 2 if times else None, group=group)
    return out[0]


def _message_delays(handle) -> tuple:
    """From the last step's trace of every rank (one machine: perf_counter is one clock): how long each rank
    waited on a receive after both ends had posted it (the receive's and the send's batch returned), i.e.
    time that is neither compute nor a wait for the producing action. (per-rank seconds, median delay of
    such a wait, count). Collective over pp."""
    group, clock = handle.facts().group, handle.observer
    ranks = [None] * dist.get_world_size(group)
    dist.all_gather_object(ranks, (clock.origin, clock.events), group=group)
    posted = {}  # ("send" | "recv", message label) -> time its batch returned
    for origin, events in ranks:
        for e in events:
            if e["name"].startswith("post "):
                for op in e["name"][len("post "):].split(", "):
                    side, label = op.split(" ", 1)
                    posted[side, label] = origin + e["end"]
    per_rank, delays = [], []
    for origin, events in ranks:
        mine = []
        for e in events:
            if e["name"].startswith("wait "):
                label = e["name"][len("wait "):]
                both = max(posted[side, label] for side in ("send", "recv"))
                mine.append(max(0.0, origin + e["end"] - max(both, origin + e["start"])))
        per_rank.append(sum(mine))
        delays += [d for d in mine if d > 0]
    return per_rank, statistics.median(delays) if delays else 0.0, len(delays)


def _bubbles_with_latency(handle, latency: float) -> tuple:
    """(each rank's bubble simulated with its measured mean action costs and `latency` a message, each rank's
    measured bubble): collective over pp. The step's host time in p2p is what the comm-free simulation leaves
    out; if messages cost this much, this simulation accounts for it."""
    facts, timed = handle.facts(), list(handle.observer.timings)
    durations = {}
    for _, _, by_kind, _ in timed:
        for kind, values in by_kind.items():
            durations.setdefault(kind, []).extend(values)
    mine = ({kind: statistics.mean(values) for kind, values in durations.items()},
            1 - statistics.mean(busy / wall for wall, busy, _, _ in timed))
    ranks = [None] * facts.P
    dist.all_gather_object(ranks, mine, group=facts.group)
    costs = [costs for costs, _ in ranks]
    return schedules.bubble_of(schedules.simulate(facts.programs, costs, latency)), [b for _, b in ranks]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pp", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--timeline", default="zb", help="the schedule whose accounting is printed in full")
    parser.add_argument("--smoke", action="store_true", help="P = 2, 4 layers of h=32, m = 4 of 1×16, one round")
    add_device_argument(parser)
    args = parser.parse_args()
    if args.smoke:
        args.pp, args.micro_batches, args.micro, args.seq, args.n_layer, args.n_embd = [2], 4, 1, 16, 4, 32
        args.rounds, args.warmup = 1, 0
    for P in args.pp:
        launch(_bench, P, args, device=args.device)


if __name__ == "__main__":
    main()
