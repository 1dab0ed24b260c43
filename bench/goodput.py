"""Goodput under injected failures: torchrun restarts killed workers, and the checkpoint interval τ is swept.

    python bench/goodput.py [--steps 2400] [--kills 4] [--factors 0.5 1 2 4] [--seed 1]
    python bench/goodput.py --smoke      # one τ, one kill, the bitwise check (two short launches)

Every launch is `torchrun --standalone --nproc_per_node 2 --max-restarts K train.py ... --resume latest
--async-ckpt` (tiny preset, dropout 0.1, --deterministic): when a worker dies the elastic agent stops the other and
starts both again, and they resume the newest committed checkpoint; no person relaunches anything.

The failure process runs on training progress, not on the wall clock: the time between kills is exponential with
a mean of M_steps = steps / --kills optimizer steps of training (step lines, a replayed step counts again: a
failure can strike while lost work is redone), so M in seconds is M_steps·T_s. A machine that speeds up or slows
down between the measurement and the sweep (other jobs on it) changes M in seconds with T_s, never the kills: every
run sees the same draws, and about --kills of them (≥ 3) land in it.

1. The uninterrupted run (a checkpoint at the end only): the step time T_s (the median step line) and the
   reference final state.
2. (Not with --smoke) a calibration run of min(steps, 400) steps with a checkpoint every k steps and no kill:
   C = the time a save blocked training (the goodput table's `ckpt` per save) + the steps' slow-down while persists
   run beside them ((its mean step − the uninterrupted run's mean step)·k). Young's τ* = sqrt(2·C·M) with
   M = M_steps·T_s, in steps τ*/T_s; the sweep's τ = round(factor·τ*/T_s) steps.
3. For each τ: a run with a checkpoint every τ steps; a supervisor SIGKILLs a random worker each time the
   attempt's workers have written the next draw's number of step lines since the attempt's first (the draws from
   random.Random(seed), the same for every τ; the default seed 1 draws 4 kills in the first 3.75·M_steps, the
   5th at 4.43). Measured goodput = train / (wall − the first start-up − eval − other), from the trainer's own
   goodput table of the job (resilience/goodput.py: the predecessors' time comes from the checkpoint; after a kill
   before the first checkpoint no ledger carries it, and the job's wall is the supervisor's). The prediction for
   the run is re-measured from the run itself, so a change of machine speed between runs moves both: T_s its
   median step line, C scaled by T_s / the uninterrupted run's T_s, R its mean restart (the kill → the
   restarted workers' first step line, less one step: the relaunch, start-up, restore), M its training time per
   kill (the sum of its step lines' times / kills); predicted = 1 − W(τ) = 1 − C/τ − τ/(2M) − R/M (first
   order) and Daly's higher-order form.
   With --smoke the calibration run is the one τ (k = 4) and takes one kill.
Every run's final parameters and Adam moments must be bitwise the uninterrupted run's (deterministic replay),
and no restart may meet a half-written checkpoint (`ckpt: refusing` in a log: the commit was not atomic), however
many kills land during an async persist (counted: a `.tmp-step-*` directory existed at the kill).

Workaround, torch 2.13: with the agent's TCPStore shared with the workers (the default), the restarted workers'
`new_group` read the dead workers' addresses from the store and time out in gloo's connectFullMesh;
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives each attempt a fresh store.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]

import ckpt  # noqa: E402
from common import own_root  # noqa: E402
from resilience import goodput  # noqa: E402

CALIBRATION_STEPS = 400  # the calibration run's length at most (its C per save needs only enough saves)
SMOKE_KILL_AT = 0.3  # --smoke: the one kill after this share of the steps


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2400, help="optimizer steps of every run")
    parser.add_argument("--kills", type=float, default=4.0,
                        help="expected kills per run: M_steps = steps / this (at least 3)")
    parser.add_argument("--factors", type=float, nargs="+", default=[0.5, 1, 2, 4], help="τ / τ*")
    parser.add_argument("--calibration-every", type=int, default=5, help="k: the calibration run's interval")
    parser.add_argument("--seed", type=int, default=1, help="the kill schedule's and the victims' seed")
    parser.add_argument("--root", default="/tmp/goodput-bench",
                        help="a new or empty directory (or one this bench made): it is cleared run by run")
    parser.add_argument("--smoke", action="store_true", help="one τ, one kill, the bitwise check")
    args = parser.parse_args(argv)
    if args.steps < 8:
        parser.error(f"--steps {args.steps}: at least 8 (a kill needs steps before and after it)")
    if not (math.isfinite(args.kills) and args.kills >= 3):
        parser.error(f"--kills {args.kills}: at least 3 expected kills per run")
    if not all(math.isfinite(f) and f > 0 for f in args.factors) or len(args.factors) < (1 if args.smoke else 4):
        parser.error(f"--factors {args.factors}: at least four positive multiples of τ*")
    if args.calibration_every < 1:
        parser.error(f"--calibration-every {args.calibration_every}: at least 1 step")
    if args.smoke:
        args.steps, args.calibration_every = 16, 4
    own_root(parser, args.root)
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


class StepLines:
    """The metrics file's complete step lines and their step times, read incrementally (the supervisor polls every
    10 ms: rereading a file of thousands of lines each time would take CPU from the workers it times). A restart
    from step 0 (a kill before the first checkpoint) rewrites the file: the lines read so far are kept, they were
    trained (their work lost)."""

    def __init__(self, path: str):
        self.path, self.offset, self.partial = path, 0, ""
        self.times, self.last_step, self.rewritten = [], -1, 0

    def poll(self) -> int:
        if os.path.exists(self.path):
            if os.path.getsize(self.path) < self.offset:  # rewritten by a run that began again at step 0
                self.offset, self.partial = 0, ""
                self.rewritten += 1
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
            self.offset += len(data)
            lines = (self.partial + data.decode(errors="replace")).split("\n")
            self.partial = lines.pop()
            for line in lines:
                try:
                    record = json.loads(line)
                    self.times.append(record["step_time_s"])
                    self.last_step = record["step"]
                except (ValueError, KeyError):  # a line a killed writer left half-written, the next one after it
                    self.times.append(float("nan"))
        return len(self.times)


def supervise(proc, run_dir: str, steps: int, intervals: list, rng: random.Random, timeout: float) -> dict:
    """Kill a random worker each time the attempt's workers have written the next interval's number of step lines
    since the attempt's first; measure each restart (kill → the restarted workers' first step line). Returns the
    kills, restarts and kills during a persist."""
    ck = os.path.join(run_dir, "ck")
    lines = StepLines(os.path.join(run_dir, "metrics.jsonl"))
    kills, restarts, in_persist = 0, [], 0
    pending = list(intervals)
    seen, attempt_base, killed_at, dead = 0, None, None, set()
    deadline = time.monotonic() + timeout
    first_worker = None  # the first worker's creation, as the supervisor sees it (within a poll)
    while proc.poll() is None:
        if first_worker is None and workers(proc.pid):
            first_worker = time.monotonic()
        if time.monotonic() > deadline:
            for pid in workers(proc.pid):  # the workers have sessions of their own
                os.kill(pid, signal.SIGKILL)
            os.killpg(proc.pid, signal.SIGKILL)
            raise RuntimeError(f"{run_dir}: no end within {timeout:.0f} s")
        count = lines.poll()
        now = time.monotonic()
        # After a kill, a line counts as the restarted attempt's first only once written while its workers are
        # new processes: the survivor of a kill may log a step before the agent stops it (absorbed here).
        if killed_at is not None and not set(workers(proc.pid)) - dead:
            seen = count
        elif count > seen:
            if attempt_base is None:  # this attempt's first step line: its training has begun
                attempt_base = seen
                if killed_at is not None:
                    restarts.append(now - killed_at)
                    killed_at = None
            seen = count
        progress = seen - attempt_base if attempt_base is not None else 0  # step lines of this attempt
        if pending and progress >= pending[0] and lines.last_step < steps - 1:
            victims = workers(proc.pid)
            if len(victims) == 2:
                persisting = any(n.startswith(".tmp-step-") for n in os.listdir(ck)) if os.path.isdir(ck) else False
                os.kill(rng.choice(victims), signal.SIGKILL)
                killed_at, attempt_base, dead = time.monotonic(), None, set(victims)
                kills += 1
                in_persist += persisting
                pending.pop(0)
        time.sleep(0.01)
    lines.poll()
    return dict(kills=kills, restarts=restarts, in_persist=in_persist, returncode=proc.returncode,
                observed_wall=time.monotonic() - (first_worker or deadline - timeout), rewritten=lines.rewritten,
                step_times=[t for t in lines.times if math.isfinite(t)])


def run_job(name: str, args, corpus: str, steps: int, every: int, intervals: list, rng: random.Random,
            reference=None) -> dict:
    """One job to its end; its goodput table, its step lines, and the checks (bitwise final state, no refusal)."""
    run_dir = os.path.join(args.root, name)
    shutil.rmtree(run_dir, ignore_errors=True)
    proc = launch(run_dir, corpus, steps, every, max_restarts=2 * len(intervals) + 3)
    result = supervise(proc, run_dir, steps, intervals, rng, timeout=3600)
    with open(os.path.join(run_dir, "log.txt")) as f:
        log = f.read()
    if result["returncode"] != 0:
        raise RuntimeError(f"{name}: torchrun exited {result['returncode']}:\n{log[-3000:]}")
    assert "ckpt: refusing" not in log, f"{name}: a restart met a half-written checkpoint:\n{log[-3000:]}"
    final = {k: v for k, v in ckpt.read_logical(os.path.join(run_dir, "ck", ckpt.step_dir_name(steps))).items()
             if not k.startswith("goodput/")}  # the ledger is accounting, not training state
    result.update(table=goodput.parse_table(log), final=final, log=log,
                  saves=log.count("\nckpt step "))
    if reference is not None:
        differ = [k for k, v in reference.items() if not v.equal(final[k])]
        result["bitwise"] = not differ and final.keys() == reference.keys()
    return result


def job_wall(job: dict) -> float:
    """The job's wall time: the goodput table's, unless a restart began again at step 0 (a kill before the first
    checkpoint: no ledger carried the first attempts' time), then the supervisor's, from the first worker's
    creation to the agent's exit."""
    return job["observed_wall"] if job["rewritten"] else job["table"]["wall"]


def measured_goodput(job: dict) -> float:
    """Productive training over the steady window: the job's wall time less the first start-up, evaluation and
    the rest (the end's report), which the model leaves out."""
    table = job["table"]
    return table["train"] / (job_wall(job) - table["startup"] - table["eval"] - table["other"])


def kill_intervals(seed: int, mtbf_steps: float, horizon_steps: float) -> list:
    """Exponential intervals of mean M_steps (step lines), drawn from the seed until past the horizon."""
    draws, out, total = random.Random(seed), [], 0.0
    while total < horizon_steps:
        out.append(draws.expovariate(1 / mtbf_steps))
        total += out[-1]
    return out


# ---------------------------------------------------------------------------------------------------------
# The bench
# ---------------------------------------------------------------------------------------------------------


def main(argv=None):
    args = parse_args(argv)
    rng = random.Random(args.seed)
    corpus = os.path.join(args.root, "corpus.txt")
    with open(corpus, "w") as f:
        f.write("".join(rng.choice("abcdefgh ijklmnop\n") for _ in range(50_000)))
    print(f"goodput bench: torchrun, 2 workers, tiny, {args.steps} steps, async checkpoints, --resume latest;"
          f" load average {os.getloadavg()[0]:.1f}", flush=True)

    began = time.monotonic()
    plain = run_job("uninterrupted", args, corpus, args.steps, every=0, intervals=[], rng=rng)
    step_s = statistics.median(plain["step_times"])
    reference = plain["final"]
    k = args.calibration_every
    if args.smoke:  # the calibration run is the one τ: one kill, the bitwise check
        calib = run_job(f"calibration-k{k}", args, corpus, args.steps, every=k,
                        intervals=[SMOKE_KILL_AT * args.steps], rng=rng, reference=reference)
    else:
        calib = run_job(f"calibration-k{k}", args, corpus, min(args.steps, CALIBRATION_STEPS), every=k,
                        intervals=[], rng=rng)
    blocked = calib["table"]["ckpt"] / max(1, calib["saves"])
    # per save, the persists beside the steps: (mean step with saves − mean step without)·k, first lines left out
    slowdown = max(0.0, statistics.mean(calib["step_times"][1:]) - statistics.mean(plain["step_times"][1:])) * k
    cost = blocked + slowdown
    mtbf_steps = args.steps / args.kills
    mtbf = mtbf_steps * step_s
    tau_star = goodput.young_interval(cost, mtbf)
    print(f"measured: step T_s = {step_s * 1e3:.1f} ms (median); C = {cost * 1e3:.0f} ms per save (blocked"
          f" {blocked * 1e3:.0f} ms + slower steps while persisting {slowdown * 1e3:.0f} ms, k = {k});"
          f" M = steps / {args.kills:g} = {mtbf_steps:.0f} steps of training = {mtbf:.1f} s", flush=True)
    print(f"Young τ* = sqrt(2·C·M) = {tau_star:.2f} s = {tau_star / step_s:.1f} steps; Daly's"
          f" {goodput.daly_interval(cost, mtbf):.2f} s", flush=True)

    if args.smoke:
        rows = [row(calib, k, step_s, cost, mtbf)]
    else:
        taus = sorted({max(1, round(f * tau_star / step_s)) for f in args.factors})
        intervals = kill_intervals(args.seed, mtbf_steps, 3 * args.steps)  # the same draws for every τ
        rows = []
        for tau in taus:
            job = run_job(f"tau-{tau}", args, corpus, args.steps, every=tau, intervals=intervals,
                          rng=random.Random(args.seed + tau), reference=reference)
            rows.append(row(job, tau, step_s, cost, mtbf))
            print(f"  τ = {tau} steps done: {job['kills']} kills, goodput {rows[-1]['measured']:.3f}"
                  f" (job wall {job_wall(job):.1f} s; the trainer's table {job['table']['wall']:.1f} s); load average"
                  f" {os.getloadavg()[0]:.1f}", flush=True)
    print_table(rows, tau_star / step_s)
    print(f"bench wall time {time.monotonic() - began:.0f} s; load average {os.getloadavg()[0]:.1f}", flush=True)


def row(job: dict, tau: int, plain_step_s: float, plain_cost: float, nominal_mtbf: float) -> dict:
    """One line of the table: the job measured, and the model's prediction for its τ with the parameters
    re-measured from the job itself (T_s, R, M) or scaled by its T_s (C). Beside, both without the restarts:
    the model's R/M does not depend on τ, but each run's R is noisy (a start-up of seconds), so the τ-dependent
    part is compared too: measured train / (window − Σ restarts) against 1 − C/τ − τ/(2M)."""
    step_s = statistics.median(job["step_times"])
    cost = plain_cost * step_s / plain_step_s
    restart = statistics.mean(job["restarts"]) - step_s if job["restarts"] else 0.0
    mtbf = sum(job["step_times"]) / job["kills"] if job["kills"] else nominal_mtbf * step_s / plain_step_s
    tau_s = tau * step_s
    table = job["table"]
    window = job_wall(job) - table["startup"] - table["eval"] - table["other"]
    return dict(tau=tau, tau_s=tau_s, step_s=step_s, cost=cost, mtbf=mtbf, kills=job["kills"],
                in_persist=job["in_persist"], restart=restart, lost=table["lost"], wall=job_wall(job),
                measured=measured_goodput(job),
                measured_no_r=table["train"] / (window - restart * len(job["restarts"])),
                predicted=goodput.predicted_goodput(tau_s, cost, mtbf, restart),
                predicted_no_r=goodput.predicted_goodput(tau_s, cost, mtbf),
                daly=goodput.daly_goodput(tau_s, cost, mtbf, restart), bitwise=job["bitwise"])


def print_table(rows: list, tau_star_steps: float) -> None:
    print("goodput by checkpoint interval (measured: train / (wall − first start-up − eval − end); predicted:"
          " 1 − C/τ − τ/(2M) − R/M with the run's own T_s, C, R, M; Daly's form beside; without R: the measured"
          " window less the run's restarts, against 1 − C/τ − τ/(2M)):")
    print(f"  {'τ steps':>7} {'T_s ms':>6} {'τ s':>6} {'C ms':>5} {'M s':>6} {'kills':>5} {'in persist':>10}"
          f" {'R s':>5} {'lost s':>6} {'wall s':>7} {'measured':>8} {'predicted':>9} {'Daly':>6}"
          f" {'w/o R meas':>10} {'w/o R pred':>10}  final state")
    for r in rows:
        print(f"  {r['tau']:>7d} {r['step_s'] * 1e3:>6.1f} {r['tau_s']:>6.2f} {r['cost'] * 1e3:>5.0f}"
              f" {r['mtbf']:>6.1f} {r['kills']:>5d} {r['in_persist']:>10d} {r['restart']:>5.1f} {r['lost']:>6.1f}"
              f" {r['wall']:>7.1f} {r['measured']:>8.3f} {r['predicted']:>9.3f} {r['daly']:>6.3f}"
              f" {r['measured_no_r']:>10.3f} {r['predicted_no_r']:>10.3f}"
              f"  {'bitwise equal' if r['bitwise'] else 'DIFFERS'}")
    # R/M does not depend on τ in the model: its optimum is the one of 1 − C/τ − τ/(2M) (Young's)
    predicted = max(rows, key=lambda r: r["predicted_no_r"])
    for label, key in (("measured", "measured"), ("measured without restarts", "measured_no_r")):
        best = max(rows, key=lambda r: r[key])
        verdict = "the same τ" if best["tau"] == predicted["tau"] else (
            f"not the same τ (there {predicted[key]:.3f}, {best[key] - predicted[key]:.3f} below the best)")
        print(f"optimum, {label}: τ = {best['tau']} steps ({best[key]:.3f}); predicted: τ = {predicted['tau']} steps"
              f" of the sweep (Young's τ* = {tau_star_steps:.1f} steps): {verdict}")
    verdict = "every final state bitwise equal to the uninterrupted run's" if all(r["bitwise"] for r in rows) \
        else "WRONG: a final state differs from the uninterrupted run's"
    print(f"{verdict}; {sum(r['kills'] for r in rows)} kills ({sum(r['in_persist'] for r in rows)} during an async"
          f" persist), no restart met a half-written checkpoint")


# ---------------------------------------------------------------------------------------------------------
# Bamboo's model beside checkpointing (bench/bench_redundancy.py measures its inputs and calls it)
# ---------------------------------------------------------------------------------------------------------

BAMBOO_MTBFS = (20, 60, 200, 600, 2000, 6000, 36000)  # seconds between preemptions, whole job


def print_bamboo(overhead: float, takeover_s: float, restart_s: float, cost_s: float, P: int,
                 mtbfs=BAMBOO_MTBFS) -> None:
    """Goodput predicted against the time between preemptions M: checkpointing at Young's τ* = sqrt(2CM)
    (first order and Daly's), Bamboo's redundancy (any stage absorbed, a replacement at once) and this repository's
    (stage 0 not served: 1/P of the preemptions restart from a checkpoint taken at their own τ*), with the
    crossover where redundancy starts to pay."""
    cost = max(cost_s, 1e-3)  # a save measured as free: τ* → 0 would divide by it
    covered = (P - 1) / P

    def checkpointing(m):
        tau = goodput.young_interval(cost, m)
        return goodput.predicted_goodput(tau, cost, m, restart_s), goodput.daly_goodput(tau, cost, m, restart_s)

    def here(m):
        tau = goodput.young_interval(cost, m / (1 - covered))
        return goodput.redundancy_goodput(overhead, takeover_s, m, covered, restart_s, tau, cost)

    print(f"goodput predicted by preemption rate (inputs measured: o = {overhead:.3f}, K = {takeover_s:.2f} s,"
          f" R = {restart_s:.2f} s, C = {cost * 1e3:.0f} ms, P = {P}):")
    print("  checkpointing 1 − C/τ* − τ*/(2M) − R/M at τ* = sqrt(2CM) (Daly's form beside); Bamboo (1 − o)·(1 − K/M);"
          f" here (1 − o)·(1 − C/τ − (c·K + (1 − c)·(R + τ/2))/M), c = (P − 1)/P = {covered:.2f}, τ = τ* of M/(1 − c)")
    print(f"  {'M s':>7} {'per hour':>8} {'τ* s':>6} {'ckpt':>6} {'Daly':>6} {'Bamboo':>6} {'here':>6}  better")
    for m in mtbfs:
        first, daly = checkpointing(m)
        bamboo = goodput.redundancy_goodput(overhead, takeover_s, m)
        print(f"  {m:>7.0f} {3600 / m:>8.1f} {goodput.young_interval(cost, m):>6.2f} {max(0.0, first):>6.3f}"
              f" {daly:>6.3f} {max(0.0, bamboo):>6.3f} {max(0.0, here(m)):>6.3f}"
              f"  {'redundancy' if bamboo > first else 'checkpointing'}")
    lo, hi = 1.0, 1e7  # the crossover: Bamboo minus checkpointing falls with M (o stays, the failures' cost goes)
    gain = lambda m: goodput.redundancy_goodput(overhead, takeover_s, m) - checkpointing(m)[0]  # noqa: E731
    if gain(lo) > 0 > gain(hi):
        for _ in range(60):
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if gain(mid) > 0 else (lo, mid)
        print(f"  redundancy pays while preemptions come more often than every {lo:.0f} s ({3600 / lo:.1f} per hour)")
    print("  where the model stops holding: a lost stage 0 (not served here: a checkpoint restart, the `here`"
          " column), a second loss during a takeover (K ≪ M assumed: the run ends on its newest checkpoint), two"
          " adjacent stages lost at once; this repository continues on P − 1 stages with no replacement, so at"
          " most P − 1 takeovers, each making the step slower on dedicated devices (one rank runs two stages)")


if __name__ == "__main__":
    main()
