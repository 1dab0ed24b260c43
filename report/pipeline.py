"""The pipeline's printouts: the lines its handle adds at start-up and at the end (report/axes.py registers
them as AXIS_LINES["pp"]).

Start-up: the schedule and its predicted bubble (schedules.bubble_formula, uniform costs F = I = W, B = 2F), the
split (layers and parameters per stage, a warning when uneven), this rank's activations in flight (peak
chunk-micro-batches × layers × Korthikanti's sbh(34 + 5as/h) per layer, or 4·s·b·h with full recompute) and the
p2p messages of b·s·h·e bytes per stage pair. End: the bubble three ways, predicted by the formula, simulated
with the measured mean action costs (schedules.simulate) and measured (1 − Σ busy / wall per step and rank, read
from the clock that observes the interpreter, observers.ActionClock), with the reasons a run can see when they
differ; each rank's mean action times and host time in p2p calls; the last step drawn as one ASCII row per rank
and written as a Chrome trace. Nothing here changes what the trainer computes.

Accounting for this file (it is accounting): 1. it holds nothing; 2. memory: one step's events per rank, at the
end; 3. one object all-gather over pp at the end (every rank's bubble, mean costs and events), on the critical
path of nothing (after the last step); 4. no state.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from accounting import memory
import mfu
from parallel import schedules
import pipeline

PP_IN_FLIGHT_TEXT = {"gpipe": "m", "1f1b": "min(P−r, m)", "zb": "min(P−r, m)",
                     "interleaved": "min(2(P−r−1) + (v−1)(P + m mod P) + 1, v·m)"}


def pp_startup_lines(axis, run, steps: int = 0) -> list:
    """The schedule and its predicted bubble, the split, this rank's activations in flight, p2p per stage pair.
    run: the model's config, B_μ and this rank's tokens of a row (settings.local_seq_len: ÷C under CP, ÷T
    under SP)."""
    c, f = run.config, axis.facts()
    micro, seq, name, m = run.micro_batch_size, run.settings.local_seq_len, f.schedule, f.m
    lines = [f"pipeline {name}: P={f.P} stages" + (f" × v={f.v} chunks" if f.v > 1 else "") + f", m={m}"
             f" micro-batches; bubble predicted {schedules.bubble_formula(name, f.P, m, f.v):.1%} ="
             f" {schedules.BUBBLE_TEXT[name]} (uniform costs)"]
    lines += pp_split_lines(c, f.P, f.v)
    per_layer = (4 * seq * micro * c.n_embd if c.activation_checkpointing else
                 memory.activation_bytes_per_layer(seq, micro, c.n_embd, c.n_head))
    layers = len(schedules.stage_layers(c.n_layer, f.P, f.v, f.rank))
    peak, stash = schedules.in_flight(f.programs[f.rank])
    lines.append(f"  in flight on pp rank {f.rank}: {peak} chunk-micro-batches ({PP_IN_FLIGHT_TEXT[name]}) ×"
                 f" {layers} layers × {mfu.format_bytes(per_layer)} (16-bit, Korthikanti) ="
                 f" {mfu.format_bytes(peak * layers * per_layer)} of activations"
                 + (f", and up to {stash} W stashes of ≈16·b·s·h per layer" if name == "zb" else ""))
    pairs = schedules.p2p_counts(f.programs, f.P * f.v)
    lines.append(f"  p2p per step, messages of b·s·h·e = {mfu.format_bytes(f.message_bytes)} per stage pair: "
                 + ", ".join(f"{a}→{b}: {n}" for (a, b), n in sorted(pairs.items())))
    return lines


def pp_split_lines(config, P: int, v: int = 1) -> list:
    """The split, printed: layers and parameters per stage, and a warning when it is uneven."""
    lines = []
    for rank in range(P):
        params = memory.param_counts(config, **pipeline.stage_kwargs(config.n_layer, rank, P, v))["total"]
        ranges = [schedules.stage_layers(config.n_layer, P, v, c) for c in schedules.rank_chunks(rank, P, v)]
        text = " + ".join(f"{r.start}..{r.stop - 1}" for r in ranges)
        extra = (" + embeddings" if rank == 0 else "") + (" + ln_f, head (tied copy)" if rank == P - 1 else "")
        lines.append(f"  stage {rank}: layers {text}{extra}: {params:,} parameters")
    sizes = [len(r) for r in schedules.split_layers(config.n_layer, P * v)]
    if len(set(sizes)) > 1:
        lines.append(f"  WARNING uneven split: {config.n_layer} layers over {P * v} chunks give {max(sizes)} layers to"
                     f" chunks {[c for c, n in enumerate(sizes) if n == max(sizes)]} and {min(sizes)} to the others:"
                     f" the slowest stage sets the pace ({max(sizes) / min(sizes):.2f}× the work)")
    return lines


def pp_end_lines(axis, run=None, steps: int = 0) -> list:
    """The bubble predicted, simulated with the measured action costs and measured; the mean action times;
    the last step's timeline (and its Chrome trace on pp rank 0, with a trace file). COLLECTIVE over the pp
    group (it gathers every rank's timings): print_end calls it on every rank. The timings are the clock's that
    observes the interpreter (report.axes.OBSERVERS["pp"], observers.ActionClock)."""
    f, clock = axis.facts(), axis.observer
    timed = [t for t in clock.timings if not t[3]] or list(clock.timings)  # the first step warms up
    durations = {}
    for _, _, by_kind, _ in timed:
        for kind, values in by_kind.items():
            durations[kind] = durations.get(kind, []) + values
    bubble = 1 - sum(busy / wall for wall, busy, _, _ in timed) / len(timed) if timed else float("nan")
    mine = dict(bubble=bubble, events=clock.events,
                costs={kind: sum(values) / len(values) for kind, values in durations.items()})
    ranks = [None] * f.P
    dist.all_gather_object(ranks, mine, group=f.group)
    costs, events = [r["costs"] for r in ranks], [r["events"] for r in ranks]
    simulated = sum(schedules.bubble_of(schedules.simulate(f.programs, costs))) / f.P
    why = pp_bubble_note(costs, simulated, _ranks_on_node(), torch.get_num_threads(), os.cpu_count(),
                         cpu=not clock.on_cuda, load=os.getloadavg()[0])
    name, predicted = f.schedule, schedules.bubble_formula(f.schedule, f.P, f.m, f.v)
    lines = [f"pipeline {name} P={f.P} m={f.m}: bubble predicted {predicted:.1%} ({schedules.BUBBLE_TEXT[name]}),"
             f" simulated with the measured costs {simulated:.1%}, measured"
             f" per rank " + " ".join(f"{r['bubble']:.1%}" for r in ranks) + f" (mean of {len(timed)} steps)"
             + (f"\n  {why}" if why else ""),  # the end line and, printed under it, why they differ
             "  mean action time per rank (ms): " + "; ".join(
                 f"pp{i} " + " ".join(f"{k} {t * 1e3:.2f}" for k, t in sorted(r.items())) for i, r in enumerate(costs)),
             "  host time in p2p calls, last step (ms): " + "; ".join(  # what the simulation leaves out
                 f"pp{i} " + " ".join(f"{k} {t * 1e3:.1f}" for k, t in _p2p_time(e).items())
                 for i, e in enumerate(events))]
    lines += ["  one executed step (the last), per pp rank:"] + pp_timeline(events)
    if f.trace_file and f.rank == 0:
        pp_write_chrome_trace(f.trace_file, events)
        lines.append(f"  Chrome trace of that step written to {f.trace_file} (Perfetto, chrome://tracing)")
    return lines


def pp_bubble_note(costs: list, simulated: float, ranks: int, threads: int, cores: int | None, cpu: bool = True,
                   tolerance: float = 0.1, load: float | None = None) -> str:
    """Why a measured bubble differs from the formula, for the reasons a run can see ("" when none holds):
    its ranks time-share the node's cores (on CPU), other processes do (the 1-minute load average `load`
    above the cores), or the measured action costs (per rank {kind: seconds}) are not the uniform ones the
    formula assumes (F equal on every stage, B = 2F, I = W = F)."""
    reasons = []
    if cpu and cores and ranks * threads > cores:
        reasons.append(f"{ranks} ranks × {threads} thread{'s' * (threads > 1)} share {cores} cores, so ranks take"
                       f" turns on them: an action's time includes waiting for a core, and its peers wait on it")
    if cpu and cores and load is not None and load > max(cores, ranks * threads):
        reasons.append(f"the node's load average is {load:.1f} on {cores} cores, so other processes take turns on"
                       f" them too: a rank waits for a core in its p2p calls (and the transfers' threads for theirs),"
                       f" which the simulation does not count")
    uneven, forwards = [], [c["F"] for c in costs if c.get("F")]
    if len(forwards) == len(costs) and max(forwards) > (1 + tolerance) * min(forwards):
        uneven.append(f"F differs {max(forwards) / min(forwards):.2f}× between stages")
    for kind in ("B", "I", "W"):
        ratios = [c[kind] / c["F"] for c in costs if kind in c and c.get("F")]
        uniform = schedules.UNIFORM[kind] / schedules.UNIFORM["F"]
        if any(abs(ratio / uniform - 1) > tolerance for ratio in ratios):
            uneven.append(f"{kind}/F {min(ratios):.2f}..{max(ratios):.2f}, uniform {uniform:g}")
    if uneven:
        reasons.append("the measured costs are not the uniform ones (" + "; ".join(uneven) + "), so ranks also"
                       " wait on slower peers")
    if not reasons:
        return ""
    return ("why the measured bubble differs: " + "; ".join(reasons) + ". The figure comparable with the"
            f" prediction is the simulation with the measured costs, {simulated:.1%}")


def _p2p_time(events: list) -> dict:
    """Seconds one rank's host spent in each kind of p2p call (post, wait: a receive, release: a send)."""
    out = {"post": 0.0, "wait": 0.0, "release": 0.0}
    for e in events:
        if e["cat"] == "p2p":
            kind = e["name"].split()[0]
            out[kind] = out.get(kind, 0.0) + e["end"] - e["start"]
    return out


def _ranks_on_node() -> int:
    """Processes on this node: torchrun's LOCAL_WORLD_SIZE, else every rank (one node, as the tests run)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or dist.get_world_size()


def pp_timeline(events_per_rank: list, width: int = 96) -> list:
    """One row per rank: F/B/I/W (upper case even micro-batches, lower case odd), '.' idle."""
    end = max((e["end"] for events in events_per_rank for e in events), default=0.0) or 1.0
    lines = []
    for rank, events in enumerate(events_per_rank):
        row = ["."] * width
        for e in events:
            if e["cat"] == "compute":
                a = min(width - 1, int(e["start"] / end * width))
                for i in range(a, max(a + 1, min(width, round(e["end"] / end * width)))):
                    row[i] = e["kind"] if e["mb"] % 2 == 0 else e["kind"].lower()
        lines.append(f"  pp{rank} |{''.join(row)}|")
    lines.append(f"  ({end * 1e3:.1f} ms across {width} columns; each rank's clock starts at its step start)")
    return lines


def pp_write_chrome_trace(path: str, events_per_rank: list) -> None:
    """A Chrome-trace JSON: one process per pp rank, a compute thread and a p2p thread."""
    trace = []
    for rank, events in enumerate(events_per_rank):
        trace.append(dict(name="process_name", ph="M", pid=rank, tid=0, args=dict(name=f"pp rank {rank}")))
        for tid, label in ((0, "compute"), (1, "p2p")):
            trace.append(dict(name="thread_name", ph="M", pid=rank, tid=tid, args=dict(name=label)))
        for e in events:
            args = {k: e[k] for k in ("mb", "chunk", "bytes") if k in e}
            trace.append(dict(name=e["name"], cat=e["cat"], ph="X", pid=rank, tid=0 if e["cat"] == "compute" else 1,
                              ts=e["start"] * 1e6, dur=(e["end"] - e["start"]) * 1e6, args=args))
    with open(path, "w") as f:
        json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, f)

PP_LINES = {"startup": pp_startup_lines, "end": pp_end_lines}
