"""Goodput under injected failures: torchrun restarts killed workers, and the checkpoint interval τ is swept.

    python bench/goodput.py [--steps 2500] [--mtbf SECONDS] [--factors 0.25 0.5 1 2 4] [--seed 3]
    python bench/goodput.py --smoke      # one τ, one kill, the bitwise check (two short launches)

Every launch is `torchrun --standalone --nproc_per_node 2 --max-restarts K train.py ... --resume latest
--async-ckpt` (tiny preset, dropout 0.1, --deterministic): when a worker dies the elastic agent stops the other and
starts both again, and they resume the newest committed checkpoint; no person relaunches anything.

1. The uninterrupted run (a checkpoint at the end only): the mean step time T_s and the reference final state.
2. A calibration run with a checkpoint every k steps and one kill: C = the time a save blocked training (the
   goodput table's `ckpt` per save) + the steps' slow-down while persists run beside them; R = the time from the
   kill to the restarted workers' first step, less one step (the relaunch, start-up, restore).
3. M (the mean time between failures) scaled to this machine: the uninterrupted run's training time / 3 (about
   three kills per run), but at least 2·R (a restart here costs tens of seconds: interpreter, torch, start-up),
   unless --mtbf. Young's τ* = sqrt(2·C·M), in steps τ*/T_s.
4. For each τ = factor · τ*: a run with a checkpoint every τ steps; a supervisor SIGKILLs a random worker after
   exponentially distributed intervals of mean M (random.Random(seed): the same draws for every τ, so the τ
   compare under the same failures; the default seed 3 draws 4 kills in the first 3·M, seed 0 only 1); the
   interval's clock runs while workers train (from each attempt's first step line). Measured goodput =
   train / (wall − the first start-up − eval − other), from the trainer's own goodput table of the job
   (goodput.py: the predecessors' time comes from the checkpoint); predicted = 1 − W(τ) = 1 − C/τ − τ/(2M) − R/M
   (first order) and Daly's higher-order form.
Every run's final parameters and Adam moments must be bitwise the uninterrupted run's (deterministic replay),
and no restart may meet a half-written checkpoint (`ckpt: refusing` in a log: the commit was not atomic), however
many kills land during an async persist (counted: a `.tmp-step-*` directory existed at the kill).

Workaround, torch 2.13: with the agent's TCPStore shared with the workers (the default), the restarted workers'
`new_group` read the dead workers' addresses from the store and time out in gloo's connectFullMesh;
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives each attempt a fresh store.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

import ckpt  # noqa: E402
import goodput  # noqa: E402

RUNS_PER_MTBF = 3.0  # M = the uninterrupted run's training time / this (at least RESTARTS_PER_MTBF · R)
RESTARTS_PER_MTBF = 2.0


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2500, help="optimizer steps of every run")
    parser.add_argument("--mtbf", type=float, default=None, help="M in seconds (default: scaled to this machine)")
    parser.add_argument("--factors", type=float, nargs="+", default=[0.25, 0.5, 1, 2, 4], help="τ / τ*")
    parser.add_argument("--calibration-every", type=int, default=5, help="k: the calibration run's interval")
    parser.add_argument("--seed", type=int, default=3, help="the kill schedule's and the victims' seed")
    parser.add_argument("--root", default="/tmp/goodput-bench")
    parser.add_argument("--smoke", action="store_true", help="one τ, one kill, the bitwise check")
    args = parser.parse_args(argv)
    if args.steps < 8:
        parser.error(f"--steps {args.steps}: at least 8 (a kill needs steps before and after it)")
    if args.mtbf is not None and not (math.isfinite(args.mtbf) and args.mtbf > 0):
        parser.error(f"--mtbf {args.mtbf}: a positive number of seconds")
    if not all(math.isfinite(f) and f > 0 for f in args.factors) or len(args.factors) < (1 if args.smoke else 4):
        parser.error(f"--factors {args.factors}: at least four positive multiples of τ*")
    if args.calibration_every < 1:
        parser.error(f"--calibration-every {args.calibration_every}: at least 1 step")
    if args.smoke:
        args.steps, args.calibration_every = 16, 4
    return args


# ---------------------------------------------------------------------------------------------------------
# One job: torchrun with restarts, and the supervisor that kills its workers
# ---------------------------------------------------------------------------------------------------------


def launch(run_dir: str, corpus: str, steps: int, every: int, max_restarts: int):
    os.makedirs(run_dir, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "--max-restarts", str(max_restarts), "--monitor-interval", "0.1",
               os.path.join(ROOT, "train.py"), "--backend", "gloo", "--preset", "tiny", "--steps", str(steps),
               "--global-batch", "4", "--seq-len", "32", "--dtype", "fp32", "--dropout", "0.1", "--deterministic",
               "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0", "--log-every", "100",
               "--peak-tflops", "1", "--data", corpus, "--out-dir", run_dir, "--ckpt-dir",
               os.path.join(run_dir, "ck"), "--ckpt-every", str(every), "--keep", "2", "--async-ckpt",
               "--resume", "latest", "--metrics-file", os.path.join(run_dir, "metrics.jsonl")]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    log = open(os.path.join(run_dir, "log.txt"), "w")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=run_dir,
                            start_new_session=True)


def workers(agent_pid: int) -> list[int]:
    """The agent's child processes: its workers."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == agent_pid:
                        out.append(int(entry))
            except (OSError, ValueError):
                continue
    return sorted(out)


def metrics_count(run_dir: str) -> int:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return sum(1 for line in f if line.endswith("\n"))


def supervise(proc, run_dir: str, steps: int, intervals: list, rng: random.Random, timeout: float) -> dict:
    """Kill a random worker each time the next interval of training time has passed; measure each restart (kill
    → the restarted workers' first step line). Returns the kill times, restarts and kills during a persist."""
    ck = os.path.join(run_dir, "ck")
    kills, restarts, in_persist = [], [], 0
    pending = list(intervals)
    seen, running_since, killed_at, dead = 0, None, None, set()
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        if time.monotonic() > deadline:
            for pid in workers(proc.pid):  # the workers have sessions of their own
                os.kill(pid, signal.SIGKILL)
            os.killpg(proc.pid, signal.SIGKILL)
            raise RuntimeError(f"{run_dir}: no end within {timeout:.0f} s")
        count = metrics_count(run_dir)
        now = time.monotonic()
        # After a kill, a line counts as the restarted attempt's first only once written while its workers are
        # new processes: the survivor of a kill may log a step before the agent stops it (absorbed here).
        if killed_at is not None and not set(workers(proc.pid)) - dead:
            seen = count
        elif count > seen:
            if running_since is None:  # this attempt's first step line: its training has begun
                running_since = now
                if killed_at is not None:
                    restarts.append(now - killed_at)
                    killed_at = None
            seen = count
        if running_since is not None and pending and now - running_since >= pending[0] and seen < steps:
            victims = workers(proc.pid)
            if len(victims) == 2:
                persisting = any(n.startswith(".tmp-step-") for n in os.listdir(ck)) if os.path.isdir(ck) else False
                os.kill(rng.choice(victims), signal.SIGKILL)
                killed_at, running_since, dead = time.monotonic(), None, set(victims)
                kills.append(killed_at)
                in_persist += persisting
                pending.pop(0)
        time.sleep(0.01)
    return dict(kills=len(kills), restarts=restarts, in_persist=in_persist, returncode=proc.returncode)


def run_job(name: str, args, corpus: str, every: int, intervals: list, rng: random.Random, reference=None) -> dict:
    """One job to its end; its goodput table, its step lines, and the checks (bitwise final state, no refusal)."""
    run_dir = os.path.join(args.root, name)
    shutil.rmtree(run_dir, ignore_errors=True)
    proc = launch(run_dir, corpus, args.steps, every, max_restarts=2 * len(intervals) + 3)
    result = supervise(proc, run_dir, args.steps, intervals, rng, timeout=3600)
    with open(os.path.join(run_dir, "log.txt")) as f:
        log = f.read()
    if result["returncode"] != 0:
        raise RuntimeError(f"{name}: torchrun exited {result['returncode']}:\n{log[-3000:]}")
    assert "ckpt: refusing" not in log, f"{name}: a restart met a half-written checkpoint:\n{log[-3000:]}"
    final = {k: v for k, v in ckpt.read_logical(os.path.join(run_dir, "ck", ckpt.step_dir_name(args.steps))).items()
             if not k.startswith("goodput/")}  # the ledger is accounting, not training state
    result.update(table=goodput.parse_table(log), final=final, lines=metrics_count(run_dir), log=log,
                  saves=log.count("\nckpt step "))
    if reference is not None:
        differ = [k for k, v in reference.items() if not v.equal(final[k])]
        result["bitwise"] = not differ and final.keys() == reference.keys()
    return result


def measured_goodput(table: dict) -> float:
    """Productive training over the steady window: the job's wall time less the first start-up, evaluation and
    the rest (the end's report), which the model leaves out."""
    window = table["wall"] - table["startup"] - table["eval"] - table["other"]
    return table["train"] / window


# ---------------------------------------------------------------------------------------------------------
# The bench
# ---------------------------------------------------------------------------------------------------------


def main(argv=None):
    args = parse_args(argv)
    rng = random.Random(args.seed)
    os.makedirs(args.root, exist_ok=True)
    corpus = os.path.join(args.root, "corpus.txt")
    with open(corpus, "w") as f:
        f.write("".join(rng.choice("abcdefgh ijklmnop\n") for _ in range(50_000)))
    print(f"goodput bench: torchrun, 2 workers, tiny, {args.steps} steps, async checkpoints, --resume latest",
          flush=True)

    began = time.monotonic()
    plain = run_job("uninterrupted", args, corpus, every=0, intervals=[], rng=rng)
    step_s = plain["table"]["train"] / args.steps
    reference = plain["final"]
    k = args.calibration_every
    one_kill = [0.3 * args.steps * step_s]  # a third of the way in
    calib = run_job(f"calibration-k{k}", args, corpus, every=k, intervals=one_kill, rng=rng, reference=reference)
    blocked = calib["table"]["ckpt"] / max(1, calib["saves"])
    slowdown = max(0.0, calib["table"]["train"] / calib["lines"] - step_s) * k  # per save: persists beside steps
    cost = blocked + slowdown
    restart = max(0.0, calib["restarts"][0] - step_s) if calib["restarts"] else float("nan")
    mtbf = args.mtbf or max(
        plain["table"]["train"] / RUNS_PER_MTBF, RESTARTS_PER_MTBF * (restart if restart > 0 else 0))
    tau_star = goodput.young_interval(cost, mtbf)
    scaled = f"max(training time / {RUNS_PER_MTBF:g}, {RESTARTS_PER_MTBF:g}·R)"
    print(f"measured: step T_s = {step_s * 1e3:.1f} ms; C = {cost * 1e3:.0f} ms per save (blocked"
          f" {blocked * 1e3:.0f} ms + slower steps while persisting {slowdown * 1e3:.0f} ms, k = {k});"
          f" R = {restart:.1f} s (kill → the restarted workers' first step, less one step);"
          f" M = {mtbf:.1f} s ({'--mtbf' if args.mtbf else scaled})", flush=True)
    print(f"Young τ* = sqrt(2·C·M) = {tau_star:.2f} s = {tau_star / step_s:.1f} steps; Daly's"
          f" {goodput.daly_interval(cost, mtbf):.2f} s; calibration run bitwise: {calib['bitwise']}", flush=True)

    if args.smoke:  # the calibration run is the one τ: one kill, the bitwise check
        rows = [row(calib, k, step_s, cost, mtbf, restart)]
    else:
        taus = sorted({max(1, round(f * tau_star / step_s)) for f in args.factors})
        schedule_rng = random.Random(args.seed)  # the same draws for every τ
        intervals, total = [], 0.0
        while total < 3 * plain["table"]["train"]:  # more than any run can use
            intervals.append(schedule_rng.expovariate(1 / mtbf))
            total += intervals[-1]
        rows = []
        for tau in taus:
            job = run_job(f"tau-{tau}", args, corpus, every=tau, intervals=intervals,
                          rng=random.Random(args.seed + tau), reference=reference)
            rows.append(row(job, tau, step_s, cost, mtbf, restart))
            print(f"  τ = {tau} steps done: {job['kills']} kills, goodput {rows[-1]['measured']:.3f}", flush=True)
    print_table(rows, tau_star / step_s)
    print(f"bench wall time {time.monotonic() - began:.0f} s", flush=True)


def row(job: dict, tau: int, step_s: float, cost: float, mtbf: float, restart: float) -> dict:
    """One line of the table: the job measured, the model's prediction for its τ."""
    tau_s = tau * step_s
    return dict(tau=tau, tau_s=tau_s, kills=job["kills"], in_persist=job["in_persist"],
                restart=sum(job["restarts"]) / len(job["restarts"]) if job["restarts"] else float("nan"),
                measured=measured_goodput(job["table"]), lost=job["table"]["lost"], wall=job["table"]["wall"],
                predicted=goodput.predicted_goodput(tau_s, cost, mtbf, restart),
                daly=goodput.daly_goodput(tau_s, cost, mtbf, restart), bitwise=job["bitwise"])


def print_table(rows: list, tau_star_steps: float) -> None:
    print("goodput by checkpoint interval (measured: train / (wall − first start-up − eval − end); predicted:"
          " 1 − C/τ − τ/(2M) − R/M, Daly's form beside):")
    print(f"  {'τ steps':>8} {'τ s':>7} {'kills':>5} {'in persist':>10} {'R meas s':>8} {'lost s':>7}"
          f" {'job wall s':>10} {'measured':>8} {'predicted':>9} {'Daly':>6}  final state")
    for r in rows:
        print(f"  {r['tau']:>8d} {r['tau_s']:>7.2f} {r['kills']:>5d} {r['in_persist']:>10d} {r['restart']:>8.1f}"
              f" {r['lost']:>7.1f} {r['wall']:>10.1f} {r['measured']:>8.3f} {r['predicted']:>9.3f} {r['daly']:>6.3f}"
              f"  {'bitwise equal' if r['bitwise'] else 'DIFFERS'}")
    best = max(rows, key=lambda r: r["measured"])
    predicted_best = max(rows, key=lambda r: r["predicted"])
    same = best["tau"] == predicted_best["tau"]
    print(f"optimum: measured at τ = {best['tau']} steps (goodput {best['measured']:.3f}); predicted at τ ="
          f" {predicted_best['tau']} steps of the sweep (Young's τ* = {tau_star_steps:.1f} steps): "
          + ("the same τ" if same else f"not the same τ (measured − predicted goodput there:"
                                       f" {best['measured'] - best['predicted']:+.3f})"))
    verdict = "every final state bitwise equal to the uninterrupted run's" if all(r["bitwise"] for r in rows) \
        else "WRONG: a final state differs from the uninterrupted run's"
    print(f"{verdict}; {sum(r['kills'] for r in rows)} kills ({sum(r['in_persist'] for r in rows)} during an async"
          f" persist), no restart met a half-written checkpoint")


if __name__ == "__main__":
    main()
