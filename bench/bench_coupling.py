"""Expert coupling on the default corpus: the co-selection statistics (arXiv 2610.09372's), what a co-selection
placement and the once-per-rank dispatch save in dispatch rows and bytes, and Sinkhorn's replicas against EPLB's.

    python bench/bench_coupling.py                      # mini, 8 and 32 experts top-2, 300 steps; EP = 4, 200 steps
    python bench/bench_coupling.py --experts 8 --steps 100 --ep-steps 60 --replan-every 20
    python bench/bench_coupling.py --smoke              # seconds: tiny, 4 experts, a few steps, EP = 2

1. Statistics (one process, train.py's own start-up and step): --preset mini (4 layers, h = 128, every block
   MoE), N experts top-2, dropless, --global-batch 16 × 128 tokens, --dtype fp32 (this CPU has no fast bf16),
   the auxiliary loss at its default (α = 0.01); after --steps steps, over the last --window steps
   (observers.RoutedLoad, the run's own counts; experts/coupling.py's formulas), per MoE layer: the share of the
   tokens whose pair is among the top 1% of the pairs (uniform routing: that share of the pairs), the share of the
   pairs 42% of the tokens take, and the next layer's predictability (given this layer's set, and given none).
   The paper: top-2, 0.8% of the pairs chosen together by 42% of the tokens.
2. Placement (from the same window, counted): E = 4 ranks; the deduplicated exchange's rows (one per token and
   rank its experts span) and a per-slot dispatcher's (one per slot) with the experts in place (i on rank
   ⌊i·E/N⌋) and under the co-selection placement (coupling.partition of the window's pairs); the local hits a
   token re-ordering would reach (each token on the rank holding most of its predicted next-layer set; not
   built), beside the uniform 1/E.
3. Dispatch in training (E = 4 gloo ranks, torchrun): the experts in place against --moe-placement coselect
   (--moe-replicas N, re-planned every --replan-every steps, the slots' weights and AdamW state moved), the same
   init and batches. Over the steps after the first re-plan: the rows sent (all ranks), those that left their
   rank, the all_to_all_single bytes traced beside those predicted from the rows (dispatch.all_to_all_messages),
   and the per-slot dispatcher's rows on the same routing (counted: the trainer has no per-slot exchange); the
   loss curves side by side (bitwise where the sums allow: top-2 regroups sums of two terms).
4. Replicas on the same loads (the window's per-expert loads of each layer, pure): EPLB (deepseek-ai/EPLB: the
   homes move too), the guests placed by load only (experts/transport.py's matching on a uniform cost) and by
   Sinkhorn over the h100 model's links (450 GB/s in a node, 50 across), E ranks in nodes of E/2: max/mean load
   per rank, the weighted communication cost (transport.plan_costs: the load served away from its expert's home
   rank × the link's s/GB, summed over the layers) and the slots away from their expert's node.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from accounting import observers  # noqa: E402
from cli import flags  # noqa: E402
from experts import coupling, dispatch, eplb, transport  # noqa: E402
from mesh import MeshShape  # noqa: E402
from planner import hardware  # noqa: E402
from resilience import goodput  # noqa: E402
import train  # noqa: E402
from accounting.tracer import CommTracer  # noqa: E402
from step import train_step  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAPER = (0.008, 0.42)  # Expert Coupling, top-2: 0.8% of the pairs chosen together by 42% of the tokens


def train_flags(args, experts: int, steps: int) -> list:
    return ["--preset", args.preset, "--moe-experts", str(experts), "--moe-topk", str(args.topk), "--steps",
            str(steps), "--global-batch", str(args.batch), "--dtype", "fp32", "--eval-every", "0", "--sample-tokens",
            "0", "--seed", str(args.seed), "--out-dir", args.out_dir, "--log-every", str(10 ** 6),
            *(["--seq-len", str(args.seq)] if args.seq else [])]


def train_steps(argv: list, window: int, log, each_step=None):
    """Train as `python train.py argv` would (printouts to `log`), one step at a time; the routing observer's
    co-selection counts of the last `window` steps; each_step(run, outcome) after every step."""
    settings = flags.parse(argv, train.AXES)
    tracer = CommTracer()
    with contextlib.redirect_stdout(log):
        t = train.start_training(settings, tracer, goodput.Clock())
    run, args = t.run, settings.args
    handle = next(axis for axis in run.axes if axis.name == "moe")
    record = observers.RoutedLoad()
    handle.observe(record)
    losses = []
    for step in range(args.steps):
        if step == args.steps - window:
            record.take_coupling()  # the window starts here
        run.layout.set_lr(t.lr_schedule(step))
        with tracer:
            outcome = train_step(run.layout, t.scaler, train.local_batches(run, t.sampler, t.train_tokens, step),
                                 run.mesh.group("dp_cp"), args.grad_clip, run.autocast, run.device, model=run.model,
                                 schedule=run.schedule, axes=run.axes, data_size=run.mesh.size("dp"))
        losses.append(outcome.loss)
        if each_step is not None:
            each_step(run, record, tracer)
    return run, record, losses


# ---------------------------------------------------------------------------------------------------------
# 1, 2: statistics and placement from one process's window
# ---------------------------------------------------------------------------------------------------------


def statistics(args, experts: int) -> dict:
    log_path = os.path.join(args.out_dir, f"bench_coupling_stats_{experts}.log")
    with open(log_path, "w") as log:
        run, record, losses = train_steps(train_flags(args, experts, args.steps), args.window, log)
    counts = record.take_coupling()
    dist.destroy_process_group()
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(var, None)  # the next one-process world sets its own
    return dict(counts=counts, loss=sum(losses[-args.window:]) / args.window, log=log_path)


def print_statistics(results: dict, args) -> None:
    print(f"1. co-selection on the default corpus: --preset {args.preset}, top-{args.topk}, {args.steps} steps of"
          f" {args.batch} sequences, the last {args.window} steps counted (paper, top-2: {PAPER[0]:.1%} of the"
          f" pairs chosen by {PAPER[1]:.0%} of the tokens)")
    print(f"  {'N':>3} {'layer':>5} {'tokens':>8} {'top 1% pairs':>12} {'their tokens':>12} {'uniform':>8}"
          f" {'pairs for 42%':>13} {'next set given':>14} {'given none':>10}")
    for n, r in results.items():
        counts = r["counts"]
        for layer_id, sets in sorted(counts.sets.items()):
            take, pairs, share = coupling.top_pair_coverage(sets, n)
            nexts = [j for (here, _), j in counts.joint.items() if here == layer_id]
            given, alone = coupling.next_layer_predictability(nexts[0]) if nexts else (float("nan"),) * 2
            print(f"  {n:>3} {f'h.{layer_id}':>5} {sum(sets.values()):>8,} {f'{take} of {pairs}':>12} {share:>12.1%}"
                  f" {take / pairs:>8.1%} {coupling.pairs_to_cover(sets, n):>13.1%} {given:>14.1%} {alone:>10.1%}")
        print(f"      train loss over the window {r['loss']:.4f} (the run's printout: {r['log']})")


def reordered_hits(joint: dict, rank_of: list, k: int) -> float:
    """The share of the next layer's slots on the token's rank had each token sat on the rank holding the most of
    its predicted next-layer set (the most frequent next set given this layer's; ties the lower rank)."""
    best = {}
    for (a, b), count in joint.items():
        if count > best.get(a, (0, None))[0]:
            best[a] = (count, b)
    hits = total = 0
    for (a, b), count in joint.items():
        predicted = [rank_of[e] for e in coupling.members(best[a][1])]
        home = min(set(predicted), key=lambda r: (-predicted.count(r), r))
        hits += count * sum(rank_of[e] == home for e in coupling.members(b))
        total += count * k
    return hits / total if total else float("nan")


def print_placement(counts, n: int, ep: int, k: int) -> list:
    """Part 2's table; returns each layer's co-selection placement (rank of each expert)."""
    print(f"2. placement over E = {ep} ranks, N = {n}, from the same window (counted: rows of all the window's tokens;"
          f" dropless, so a per-slot dispatcher sends k = {k} rows a token)")
    print(f"  {'layer':>5} {'per-slot rows':>13} {'dedup in place':>14} {'dedup coselect':>14} {'saved':>6}"
          f" {'reorder hits in place':>21} {'coselect':>8} {'uniform':>7}")
    placements = []
    in_place = [e * ep // n for e in range(n)]
    for layer_id, sets in sorted(counts.sets.items()):
        part = coupling.partition(coupling.pair_matrix(sets, n), ep)
        placements.append(part)
        rows, slots = coupling.dispatch_rows(sets, in_place, k)
        moved, _ = coupling.dispatch_rows(sets, part, k)
        nexts = [j for (here, _), j in counts.joint.items() if here == layer_id]
        hits = [reordered_hits(nexts[0], where, k) if nexts else float("nan") for where in (in_place, part)]
        print(f"  {f'h.{layer_id}':>5} {slots:>13,} {rows:>14,} {moved:>14,} {1 - moved / rows:>6.1%}"
              f" {hits[0]:>21.1%} {hits[1]:>8.1%} {1 / ep:>7.1%}")
    print("  (reorder hits: the next layer's placement is this layer's partition of its own pairs; the token"
          " re-ordering itself is not built)")
    return placements


# ---------------------------------------------------------------------------------------------------------
# 3: dispatch in training, E ranks under torchrun (each variant a worker)
# ---------------------------------------------------------------------------------------------------------


def worker(argv: list, out: str) -> None:
    """One variant on this torchrun world: per step, rows and slots (all ranks summed), bytes traced and predicted,
    the loss; rank 0 writes them to `out` (JSON)."""
    per_step = []
    seen = {"forwards": 0, "sent": 0, "received": 0, "traced": 0.0}

    def each_step(run, record, tracer):
        handle = next(axis for axis in run.axes if axis.name == "moe")
        forwards, sent, received = record.rows()
        traced = tracer.records.get(dispatch.ALL_TO_ALL)
        traced = traced.payload_bytes if traced is not None else 0
        new = [forwards - seen["forwards"], sent - seen["sent"], received - seen["received"], traced - seen["traced"]]
        seen.update(forwards=forwards, sent=sent, received=received, traced=traced)
        predicted = dispatch.all_to_all_messages(handle.traffic, *new[:3])[dispatch.ALL_TO_ALL][1]
        c = record.take_coupling()
        mine = torch.tensor([new[1], c.own_rows, c.kept, c.own_slots, new[3], predicted], dtype=torch.float64)
        dist.all_reduce(mine)
        per_step.append(mine.tolist())

    with open(f"{out}.rank{os.environ.get('RANK', '0')}.log", "w") as log:
        _, _, losses = train_steps(argv, 1, log, each_step)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(dict(losses=losses, steps=per_step), f)
    dist.destroy_process_group()


def run_variant(args, name: str, extra: list, out_dir: str) -> dict:
    out = os.path.join(out_dir, f"{name}.json")
    argv = train_flags(args, args.ep_experts, args.ep_steps) + ["--ep", str(args.ep), *extra]
    rendezvous = ["--master_port", str(args.port)] if args.port else ["--standalone"]  # standalone: a free port
    command = ["torchrun", "--nproc_per_node", str(args.ep), *rendezvous, os.path.abspath(__file__),
               "--worker", out, "--", *argv]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"variant {name} failed:\n{done.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def print_dispatch(results: dict, args) -> None:
    first = args.replan_every
    print(f"3. dispatch in training: E = {args.ep} gloo ranks, N = {args.ep_experts} top-{args.topk}, --preset"
          f" {args.preset}, {args.ep_steps} steps of {args.batch} sequences; coselect re-planned every"
          f" {args.replan_every} steps; counted over steps {first}..{args.ep_steps - 1} (after the first re-plan),"
          f" all ranks")
    print(f"  {'dispatcher':<11} {'placement':<10} {'rows':>10} {'left rank':>10} {'local hits':>10}"
          f" {'a2a bytes traced':>16} {'predicted':>12}")
    for name, r in results.items():
        steps = r["steps"][first:]
        sent, own_rows, kept, own_slots, traced, predicted = (sum(s[i] for s in steps) for i in range(6))
        slot_bytes = predicted * kept / sent if sent else 0  # a per-slot dispatcher: a row per kept slot
        print(f"  {'per-slot':<11} {name:<10} {kept:>10,.0f} {kept - own_slots:>10,.0f} {own_slots / kept:>10.1%}"
              f" {'(not run)':>16} {slot_bytes:>12,.0f}")
        differs = " <- differs" if abs(traced - predicted) > 1e-9 * predicted else ""
        print(f"  {'once/rank':<11} {name:<10} {sent:>10,.0f} {sent - own_rows:>10,.0f} {own_rows / sent:>10.1%}"
              f" {traced:>16,.0f} {predicted:>12,.0f}{differs}")
    names = list(results)
    base = results[names[0]]["losses"]
    for name in names[1:]:
        other = results[name]["losses"]
        same = sum(a == b for a, b in zip(base, other))
        print(f"  loss curve {name} vs {names[0]}: {same} of {len(base)} steps bitwise equal, largest |Δ|"
              f" {max(abs(a - b) for a, b in zip(base, other)):.3g}; first/last {other[0]:.4f}/{other[-1]:.4f}")
    print("  (per-slot bytes: the dedup's bytes scaled by kept slots / rows, the same row format and metadata; the"
          " counts' 8(N+E) bytes a call are scaled too, a few bytes)")


# ---------------------------------------------------------------------------------------------------------
# 4: replicas on the same loads
# ---------------------------------------------------------------------------------------------------------


def print_replicas(loads: dict, args) -> None:
    print("4. redundant experts on the same loads (each layer's window loads), h100's links (1/450 s/GB in a node,"
          " 1/50 across): max/mean load per rank (the layers' mean), weighted communication cost (summed over the"
          " layers, load × s/GB), slots away from their expert's home node")
    print(f"  {'N':>3} {'E':>3} {'R':>4} {'nodes':>5} {'policy':<22} {'max/mean':>8} {'weighted cost':>13}"
          f" {'vs EPLB':>8} {'off-node slots':>14}")
    for n, layers in loads.items():
        ep = min(args.replica_ep, n // 2)  # at least two experts at home on each rank
        slots, per_node = n + max(ep, n // 2 // ep * ep), ep // 2  # R ≈ 1.5·N, a multiple of E; two nodes
        cost = hardware.ep_link_costs(SimpleNamespace(hw="h100", gpus_per_node=per_node, hw_intra_gbps=None,
                                                      hw_inter_gbps=None), MeshShape(dp=ep, ep=ep))
        uniform = [[0.0 if a == b else 1.0 for b in range(ep)] for a in range(ep)]
        plans = {"eplb (homes move)": lambda w: eplb.place_layer(torch.tensor(w).float(), slots, 1, 1, ep)[0],
                 "guests by load only": lambda w: transport.place(w, slots, ep, uniform)[0],
                 "sinkhorn (links)": lambda w: transport.place(w, slots, ep, cost)[0]}
        base = None
        for policy, plan in plans.items():
            balance, weighted, off = [], 0.0, 0
            for w in layers:
                phy2log = plan(w)
                b, c = transport.plan_costs(phy2log, w, ep, cost)
                balance.append(b)
                weighted += c
                per_rank = slots // ep
                off += sum(transport.home_of(e, n, ep) // per_node != (q // per_rank) // per_node
                           for q, e in enumerate(phy2log))
            base = weighted if base is None else base
            print(f"  {n:>3} {ep:>3} {slots:>4} {ep // per_node:>5} {policy:<22} {sum(balance) / len(balance):>8.3f}"
                  f" {weighted:>13.3f} {weighted / base if base else float('nan'):>8.2f} {off:>14}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="mini")
    p.add_argument("--experts", default="8,32", help="N of each statistics run, comma-separated")
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--steps", type=int, default=300, help="the statistics runs' steps")
    p.add_argument("--window", type=int, default=50, help="the statistics: the last this many steps")
    p.add_argument("--batch", type=int, default=16, help="--global-batch")
    p.add_argument("--seq", type=int, default=None, help="--seq-len (default: the preset's)")
    p.add_argument("--ep", type=int, default=4, help="EP ranks of parts 2 and 3")
    p.add_argument("--ep-experts", type=int, default=8, help="N of part 3's runs")
    p.add_argument("--ep-steps", type=int, default=200)
    p.add_argument("--replan-every", type=int, default=50)
    p.add_argument("--replica-ep", type=int, default=8, help="part 4's E (E = 2 for fewer experts)")
    p.add_argument("--parts", default="1,2,3,4")
    p.add_argument("--port", type=int, default=0, help="part 3's torchrun port (0: a free one, --standalone)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--out-dir", default="out")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, a few steps: checks the bench runs")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # a torchrun rank of part 3: the JSON to write
    p.add_argument("train_argv", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.train_argv, args.worker)
    if args.smoke:
        args.preset, args.experts, args.steps, args.window, args.batch, args.seq = "tiny", "4", 6, 3, 4, 32
        args.ep, args.ep_experts, args.ep_steps, args.replan_every, args.replica_ep = 2, 4, 6, 2, 2
    parts = args.parts.split(",")
    os.makedirs(args.out_dir, exist_ok=True)
    torch.set_num_threads(1)
    stats = {}
    if {"1", "2", "4"} & set(parts):
        stats = {int(n): statistics(args, int(n)) for n in args.experts.split(",")}
    if "1" in parts:
        print_statistics(stats, args)
    if "2" in parts:
        for n, r in stats.items():
            if n % args.ep == 0:
                print_placement(r["counts"], n, args.ep, args.topk)
    if "3" in parts:
        with tempfile.TemporaryDirectory() as tmp:
            n = args.ep_experts
            results = {"in place": run_variant(args, "in-place", [], tmp),
                       "coselect": run_variant(args, "coselect", ["--moe-replicas", str(n), "--moe-placement",
                                                                  "coselect", "--moe-replan-every",
                                                                  str(args.replan_every)], tmp)}
        print_dispatch(results, args)
    if "4" in parts:
        loads = {}
        for n, r in stats.items():
            loads[n] = [[sum(c for key, c in sets.items() if key >> e & 1) for e in range(n)]
                        for _, sets in sorted(r["counts"].sets.items())]
        print_replicas(loads, args)


if __name__ == "__main__":
    main()
