"""Bamboo's price and payoff (resilience/redundancy.py, `--pp-redundant`), measured: the steady-state overhead,
the recovery from a preemption against a checkpoint restart, and goodput at a few preemption rates.

    python bench/bench_redundancy.py [--repeats 3] [--pps 2 4] [--schedules gpipe 1f1b] [--steps 30]
                                     [--goodput-steps 40] [--ckpt-every 10] [--root /tmp/redundancy-bench]
    python bench/bench_redundancy.py --smoke     # P = 2, 1f1b, one repeat, one kill each way

Every run is P train.py workers spawned as a launcher would, without an agent (tests/resilience/test_redundancy.py's
way: nobody stops the survivors when one dies), tiny preset with P layers, fp32, m = 2P micro-batches, gloo.

1. Overhead. For each P and schedule, the same pipeline with and without --pp-redundant, the two launched
   alternately (the order swapped each repeat) --repeats times; a run's step time is the median of its step lines
   after the first `WARMUP`; the table gives the medians over the repeats, their ratio, and the median of the
   paired ratios. Beside it, two predictions from the schedule as data (parallel/schedules.py, uniform costs,
   B = 2F, R = F): on dedicated devices the R forwards fill the bubble, and the step grows by the makespan's
   ratio (R slots in the bubble vs after the rank's last action: they lengthen the step); on devices that share
   cores (P processes on fewer cores, as here) the idle time is another rank's compute, and the step grows with
   the work: busy time with R / without (4/3 whatever P and m). Neither counts the gradient exchange or the
   shadow's update (one more AdamW over the successor's parameters).
2. Recovery and goodput, on the largest P with 1F1B (--part goodput runs this part alone), in one stretch of the
   machine's load: an uninterrupted run without redundancy, one with it, then runs of --goodput-steps steps with
   k = 0, 1, 2 SIGKILLs (at most P − 1), each of the last stage's process (never stage 0, which the takeover does
   not serve), after k evenly spaced steps, and the uninterrupted run without redundancy again.
   - redundancy: no checkpoint; the survivors take over (P → P − 1 per kill) and replay the interrupted step.
     Recovery = the kill → the first step line of the smaller world.
   - checkpointing: the same pipeline without redundancy, --ckpt-every τ steps (--async-ckpt); at a kill the
     bench kills the survivors at once (a launcher's agent would) and relaunches P workers with --resume latest
     (a replacement node at once: Bamboo's and torchrun's assumption). Recovery = the kill → the first step
     line of a step not done before the kill (relaunch, start-up, restore, and the steps since the checkpoint
     redone); R = the kill → the relaunch's first step line.
   Goodput = useful time / wall time over the window from the step line of step `WARMUP` to the last step line:
   useful = the uninterrupted runs without redundancy or checkpoints over the same steps (the median of the two).
   The model (resilience/goodput.py): checkpointing 1 − C/τ − τ/(2M) − R/M (C: the k = 0 checkpointing run's
   slower steps per save); redundancy (1 − o)·(1 − K/M), o = 1 − T_plain/T_redundant (part 1's median where it
   ran: one pair of runs is noise on a loaded machine; else the pair here), K the takeover's recovery; with
   these inputs it predicts each measured run (M = its window / k) and, printed by bench/goodput.py's
   `print_bamboo`, goodput at rates beyond. The model keeps P stages; the runs
   here continue on P − 1 after a takeover (the after/before column: their step on the last world / on P).
Timings are wall-clock on whatever machine runs it: the load average is printed with each table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]

from common import own_root  # noqa: E402
from goodput import print_bamboo  # noqa: E402
from parallel import schedules  # noqa: E402
from resilience import goodput  # noqa: E402

WARMUP = 4  # step lines left out of a run's step time and of the goodput window (first calls, allocation)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="alternated launches of each variant")
    parser.add_argument("--pps", type=int, nargs="+", default=[2, 4], help="pipeline sizes P (each >= 2)")
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"], choices=schedules.REDUNDANT_SCHEDULES)
    parser.add_argument("--steps", type=int, default=30, help="steps of each overhead run")
    parser.add_argument("--goodput-steps", type=int, default=40, help="steps of each run with kills")
    parser.add_argument("--ckpt-every", type=int, default=10, help="τ: the checkpointing runs' interval, steps")
    parser.add_argument("--root", default="/tmp/redundancy-bench",
                        help="a new or empty directory (or one this bench made): it is cleared run by run")
    parser.add_argument("--part", choices=["both", "overhead", "goodput"], default="both",
                        help="1 (overhead), 2 (recovery and goodput), or both")
    parser.add_argument("--smoke", action="store_true", help="P = 2, 1f1b, one repeat, one kill each way")
    args = parser.parse_args(argv)
    if args.smoke:
        args.repeats, args.pps, args.schedules, args.steps, args.goodput_steps = 1, [2], ["1f1b"], 12, 16
        args.ckpt_every = 4
    if args.repeats < 1 or min(args.pps) < 2:
        parser.error(f"--repeats {args.repeats} --pps {args.pps}: at least one repeat, every P at least 2")
    if args.steps < WARMUP + 4 or args.goodput_steps < WARMUP + 8:
        parser.error(f"--steps {args.steps} --goodput-steps {args.goodput_steps}: at least {WARMUP + 4} and"
                     f" {WARMUP + 8} (the warm-up, then steps before and after each kill)")
    if not 1 <= args.ckpt_every < args.goodput_steps:
        parser.error(f"--ckpt-every {args.ckpt_every}: between 1 and --goodput-steps − 1")
    own_root(parser, args.root, clear=True)
    return args


# ---------------------------------------------------------------------------------------------------------
# One run: P workers without an agent, their step lines as they arrive
# ---------------------------------------------------------------------------------------------------------


def launch(run_dir: str, corpus: str, P: int, schedule: str, steps: int, extra=()) -> list:
    """P train.py processes with the environment torchrun gives its workers, and no agent."""
    os.makedirs(run_dir, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flags = ["--backend", "gloo", "--preset", "tiny", "--n-layer", str(P), "--pp", str(P), "--pp-schedule",
             schedule, "--steps", str(steps), "--global-batch", str(2 * P), "--micro-batch", "1", "--seq-len", "32",
             "--dtype", "fp32", "--eval-every", "0", "--sample-tokens", "0", "--log-every", "1", "--peak-tflops",
             "1", "--data", corpus, "--out-dir", run_dir, "--metrics-file", os.path.join(run_dir, "metrics.jsonl"),
             *extra]
    procs = []
    for rank in range(P):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(P), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(P),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        log = open(os.path.join(run_dir, f"rank{rank}.log"), "a")
        procs.append(subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *flags], stdout=log,
                                      stderr=subprocess.STDOUT, env=env, cwd=run_dir))
    return procs


class Lines:
    """The metrics file's step lines as (arrival on the bench's clock, step, world, step time), polled."""

    def __init__(self, path: str):
        self.path, self.offset, self.partial, self.lines = path, 0, "", []

    def poll(self) -> list:
        if os.path.exists(self.path):
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
            self.offset += len(data)
            now = time.monotonic()
            parts = (self.partial + data.decode(errors="replace")).split("\n")
            self.partial = parts.pop()
            for part in parts:
                record = json.loads(part)
                self.lines.append((now, record["step"], record["world"], record["step_time_s"]))
        return self.lines

    def done(self) -> int:
        """Steps done so far: one more than the largest step logged."""
        return 1 + max((step for _, step, _, _ in self.lines), default=-1)


def finish(procs, run_dir: str, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise RuntimeError(f"{run_dir}: no end within {timeout:.0f} s:\n{logs(run_dir)[-3000:]}")


def logs(run_dir: str) -> str:
    return "".join(open(os.path.join(run_dir, name)).read() for name in sorted(os.listdir(run_dir))
                   if name.startswith("rank") and name.endswith(".log"))


def follow(procs, lines: Lines, run_dir: str, until, deadline: float) -> None:
    """Poll the step lines (every 10 ms: their arrival times are the bench's clock) until `until()` holds."""
    while not until():
        if time.monotonic() > deadline or all(p.poll() is not None for p in procs):
            raise RuntimeError(f"{run_dir}: the run ended or hung first:\n{logs(run_dir)[-3000:]}")
        lines.poll()
        time.sleep(0.01)


def plain_run(run_dir: str, corpus: str, P: int, schedule: str, steps: int, extra=()) -> list:
    """One run to its end, no kill: its step lines."""
    procs, lines = launch(run_dir, corpus, P, schedule, steps, extra), Lines(os.path.join(run_dir, "metrics.jsonl"))
    follow(procs, lines, run_dir, lambda: lines.done() >= steps, time.monotonic() + 900)
    finish(procs, run_dir)
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{run_dir}: exit codes {[p.returncode for p in procs]}:\n{logs(run_dir)[-3000:]}")
    return lines.lines


def step_time(lines: list) -> float:
    return statistics.median(t for _, step, _, t in lines if step >= WARMUP)


def window(lines: list) -> tuple:
    """(seconds from the first arrival of step WARMUP's line to the last line's arrival, steps in it)."""
    start = min(at for at, step, _, _ in lines if step == WARMUP)
    return lines[-1][0] - start, max(step for _, step, _, _ in lines) - WARMUP


def killed_run(run_dir: str, corpus: str, P: int, schedule: str, steps: int, kills: int, way: str,
               ckpt_every: int) -> dict:
    """A run with `kills` SIGKILLs of the last stage's process after evenly spaced steps, `way` "redundancy"
    (taken over) or "checkpoint" (relaunched from the newest checkpoint); "plain" (no kill): neither. Its lines,
    and each kill's recovery."""
    redundant = way == "redundancy"
    extra = {"plain": [], "redundancy": ["--pp-redundant"],
             "checkpoint": ["--ckpt-dir", os.path.join(run_dir, "ck"), "--ckpt-every", str(ckpt_every),
                            "--async-ckpt", "--keep", "2"]}[way]
    at = [WARMUP + 2 + (steps - WARMUP - 4) * (i + 1) // (kills + 1) for i in range(kills)]
    lines = Lines(os.path.join(run_dir, "metrics.jsonl"))
    procs, alive, world = launch(run_dir, corpus, P, schedule, steps, extra), list(range(P)), P
    recoveries, relaunches, launches = [], [], 1
    deadline = time.monotonic() + 900
    for kill_step in at:
        follow(procs, lines, run_dir, lambda: lines.done() >= kill_step, deadline)
        victim = alive[-1]  # the last stage's process: never stage 0
        procs[victim].send_signal(signal.SIGKILL)
        killed_at, done, seen = time.monotonic(), lines.done(), len(lines.poll())
        if redundant:
            alive.remove(victim)
            world -= 1
        else:  # the agent's part: stop the survivors, start P workers again from the newest checkpoint
            for proc in procs:
                proc.kill()
                proc.wait()
            procs = launch(run_dir, corpus, P, schedule, steps, [*extra, "--resume", "latest"])
            launches += 1
            seen = len(lines.poll())  # a survivor's line written before it was stopped is not the relaunch's
        if not redundant:  # the relaunch's first step line (a redone step): R of the checkpoint model
            follow(procs, lines, run_dir, lambda: len(lines.lines) > seen, deadline)
            relaunches.append(lines.lines[seen][0] - killed_at)
        # the first line of a step not done before the kill (redundancy: on the smaller world)
        follow(procs, lines, run_dir, lambda: any(s >= done and (not redundant or w == world)
                                                  for _, s, w, _ in lines.lines[seen:]), deadline)
        recoveries.append(next(a for a, s, w, _ in lines.lines[seen:]
                               if s >= done and (not redundant or w == world)) - killed_at)
    follow(procs, lines, run_dir, lambda: lines.done() >= steps, deadline)
    finish(procs, run_dir)
    text = logs(run_dir)
    if any(procs[r].returncode for r in alive) or lines.poll()[-1][1] != steps - 1:
        raise RuntimeError(f"{run_dir}: did not finish:\n{text[-3000:]}")
    takeover_s = [float(line.split(" to the new shadows, ")[1].split(" s;")[0]) for line in text.splitlines()
                  if line.startswith("takeover: ")]
    return dict(lines=lines.lines, recoveries=recoveries, relaunches=relaunches, kills=kills, takeover_s=takeover_s,
                launches=launches)


# ---------------------------------------------------------------------------------------------------------
# The schedule's predictions
# ---------------------------------------------------------------------------------------------------------


def predicted_overhead(schedule: str, P: int, m: int) -> dict:
    """From the action lists (uniform costs): the R slots in the bubble and after the last action, the step's
    growth on dedicated devices (makespan ratio) and on shared cores (busy-time ratio)."""
    plain = schedules.simulate(schedules.build_programs(schedule, P, m), schedules.UNIFORM)
    programs = schedules.build_programs(schedule, P, m, redundant=True)
    timed = schedules.simulate(programs, schedules.UNIFORM)
    in_bubble = sum(a.kind == "R" for program in programs
                    for a in program[:max(i for i, b in enumerate(program) if b.kind != "R")])
    total = sum(a.kind == "R" for program in programs for a in program)

    def makespan(timelines):
        return max(end for timeline in timelines for _, _, end in timeline)

    def busy(timelines):
        return sum(end - start for timeline in timelines for _, start, end in timeline)

    return dict(in_bubble=in_bubble, after=total - in_bubble, dedicated=makespan(timed) / makespan(plain),
                shared=busy(timed) / busy(plain), bubble=schedules.bubble_of(plain))


# ---------------------------------------------------------------------------------------------------------
# The bench
# ---------------------------------------------------------------------------------------------------------


def overhead_table(args, corpus: str) -> dict:
    """Part 1: {(P, schedule): {"plain": [step s per repeat], "redundant": [...], "windows": [...]}}."""
    out = {(P, s): dict(plain=[], redundant=[], windows=[]) for P in args.pps for s in args.schedules}
    for repeat in range(args.repeats):
        for (P, schedule), row in out.items():
            order = ["plain", "redundant"] if repeat % 2 == 0 else ["redundant", "plain"]
            for variant in order:
                run_dir = os.path.join(args.root, f"{variant}-P{P}-{schedule}-{repeat}")
                lines = plain_run(run_dir, corpus, P, schedule, args.steps,
                                  ["--pp-redundant"] if variant == "redundant" else [])
                row[variant].append(step_time(lines))
                if variant == "plain":
                    row["windows"].append(window(lines)[0] / window(lines)[1])
        print(f"  repeat {repeat + 1}/{args.repeats} done; load average {os.getloadavg()[0]:.1f}", flush=True)
    print(f"overhead of --pp-redundant (tiny, P layers, m = 2P, fp32, gloo, {os.cpu_count()} cores;"
          f" {args.repeats} alternated repeats of {args.steps} steps, the median step after {WARMUP};"
          f" load average {os.getloadavg()[0]:.1f}):")
    print(f"  {'P':>2} {'schedule':>8} {'plain ms':>8} {'redundant ms':>12} {'ratio':>6} {'paired':>6}"
          f" {'R in bubble':>11} {'R after':>7} {'bubble':>6} {'pred dedicated':>14} {'pred shared':>11}"
          f"  per repeat (redundant/plain)")
    for (P, schedule), row in out.items():
        plain, red = statistics.median(row["plain"]), statistics.median(row["redundant"])
        paired = [r / p for r, p in zip(row["redundant"], row["plain"])]
        pred = predicted_overhead(schedule, P, 2 * P)
        row.update(plain_s=plain, redundant_s=red, ratio=red / plain)
        print(f"  {P:>2} {schedule:>8} {plain * 1e3:>8.1f} {red * 1e3:>12.1f} {red / plain:>6.2f}"
              f" {statistics.median(paired):>6.2f} {pred['in_bubble']:>11d} {pred['after']:>7d}"
              f" {statistics.mean(pred['bubble']):>6.1%} {pred['dedicated']:>14.2f} {pred['shared']:>11.2f}"
              f"  {' '.join(f'{x:.2f}' for x in paired)}")
    return out


def goodput_table(args, corpus: str, overheads: dict | None = None) -> None:
    """Part 2: the runs with kills, both ways, between two uninterrupted runs without redundancy (the useful
    time) and one with it (o), all in one stretch of the machine's load; recovery and goodput measured, and
    predicted by the model. o: part 1's median ratio where it ran (one pair of runs is noise on a loaded
    machine), else this part's pair."""
    P, schedule = max(args.pps), "1f1b" if "1f1b" in args.schedules else args.schedules[0]
    rows, plain = {}, []
    runs = [("plain", 0), ("redundancy", 0), ("checkpoint", 0)]
    runs += [(way, k) for k in range(1, min(2, P - 1) + 1) for way in ("redundancy", "checkpoint")] + [("plain", 0)]
    for index, (way, kills) in enumerate(runs):
        name = f"{way}-k{kills}-{index}"
        try:
            row = killed_run(os.path.join(args.root, name), corpus, P, schedule, args.goodput_steps, kills, way,
                             args.ckpt_every)
        except RuntimeError as e:  # said, and the row left out (the smoke's runs must succeed)
            if args.smoke or way == "plain" or kills == 0:
                raise
            print(f"  {name}: the run failed, left out of the tables: {str(e)[:2000]}", flush=True)
            continue
        if way == "plain":
            plain.append(window(row["lines"])[0] / window(row["lines"])[1])
        else:
            rows[(way == "redundancy", kills)] = row
    plain_per_step = statistics.median(plain)  # the uninterrupted run's window per step, before and after
    red_seconds, red_steps = window(rows[(True, 0)]["lines"])
    pair = red_seconds / red_steps / plain_per_step
    ratio = overheads[(P, schedule)]["ratio"] if overheads else pair
    overhead = 1 - 1 / ratio
    print(f"o from {'part 1: the median of its repeats' if overheads else 'this part: one pair of runs'}, step-time"
          f" ratio {ratio:.2f} (this part's pair of uninterrupted runs: {pair:.2f})")
    clean = rows[(False, 0)]
    seconds, steps = window(clean["lines"])
    cost = max(0.0, seconds / steps - plain_per_step) * args.ckpt_every  # C per save: the slower steps
    takeovers = [r for (red, _), row in rows.items() if red for r in row["recoveries"]]
    restarts = [r for (red, _), row in rows.items() if not red for r in row["recoveries"]]
    relaunches = [r for (red, _), row in rows.items() if not red for r in row["relaunches"]]
    takeover, restart, relaunch = (statistics.median(x) for x in (takeovers, restarts, relaunches))
    tau = args.ckpt_every * plain_per_step
    load = os.getloadavg()[0]
    print(f"recovery (P = {P}, {schedule}, the last stage's process SIGKILLed; kill → the next step not done"
          f" before it; load average {load:.1f}):")
    print(f"  redundancy takeover: {' '.join(f'{r:.2f}' for r in takeovers)} s (median K = {takeover:.2f} s; the"
          f" takeover lines' own rendezvous + rebuild + refill:"
          f" {' '.join(f'{t:.2f}' for row in rows.values() for t in row['takeover_s'])} s)")
    print(f"  checkpoint restart (τ = {args.ckpt_every} steps, async, P workers relaunched at once): "
          f"{' '.join(f'{r:.2f}' for r in restarts)} s (median {restart:.2f} s; of which kill → the relaunch's"
          f" first step line R = {relaunch:.2f} s median, the rest the steps since the checkpoint redone)")
    print(f"  restart / takeover: {restart / takeover:.1f}×")
    print(f"goodput = useful / wall over steps {WARMUP}..{args.goodput_steps - 1} (useful: the uninterrupted run"
          f" without redundancy, {plain_per_step * 1e3:.1f} ms a step; o = 1 − 1/{ratio:.2f} = {overhead:.3f};"
          f" C = {cost * 1e3:.0f} ms a save, τ = {tau:.2f} s; K = {takeover:.2f} s; R = {relaunch:.2f} s;"
          f" load average {load:.1f}):")
    print(f"  {'way':>10} {'kills':>5} {'window s':>8} {'M s':>6} {'measured':>8} {'predicted':>9} {'after/before':>12}"
          f"  model (after/before: the median step on the last world / on P stages)")
    for (redundant, kills), row in sorted(rows.items(), key=lambda kv: (kv[0][1], not kv[0][0])):
        seconds, steps = window(row["lines"])
        mtbf = seconds / kills if kills else float("inf")
        measured = steps * plain_per_step / seconds
        if redundant:
            predicted, model = goodput.redundancy_goodput(overhead, takeover, mtbf), "(1 − o)·(1 − K/M)"
        else:
            predicted, model = goodput.predicted_goodput(tau, cost, mtbf, relaunch), "1 − C/τ − τ/(2M) − R/M"
        last = [t for _, s, w, t in row["lines"] if s >= WARMUP and w == row["lines"][-1][2]]
        before = [t for _, s, w, t in row["lines"] if s >= WARMUP and w == P]
        shrink = statistics.median(last) / statistics.median(before) if redundant and kills else 1.0
        print(f"  {'redundancy' if redundant else 'checkpoint':>10} {kills:>5d} {seconds:>8.2f} {mtbf:>6.1f}"
              f" {measured:>8.3f} {predicted:>9.3f} {shrink:>12.2f}  {model}")
    print_bamboo(overhead, takeover, relaunch, cost, P)


def main(argv=None):
    args = parse_args(argv)
    rng = random.Random(0)
    corpus = os.path.join(args.root, "corpus.txt")
    with open(corpus, "w") as f:
        f.write("".join(rng.choice("abcdefgh ijklmnop\n") for _ in range(50_000)))
    began = time.monotonic()
    print(f"redundancy bench: P {args.pps}, {args.schedules}; load average {os.getloadavg()[0]:.1f}", flush=True)
    overheads = overhead_table(args, corpus) if args.part in ("both", "overhead") else None
    if args.part in ("both", "goodput"):
        goodput_table(args, corpus, overheads)
    print(f"bench wall time {time.monotonic() - began:.0f} s; load average {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
