"""Fault injection at random points: SIGKILL a torchrun worker, relaunch with --resume latest, check the end.

    python bench/fault_ckpt.py [--trials 8] [--seed 0] [--root /tmp/fault-ckpt]
    python bench/fault_ckpt.py --smoke          # one trial (the reference run, one kill, one relaunch)

One uninterrupted run (torchrun, 2 workers, `tiny`, dropout 0.1, a checkpoint every 2 of 12 steps) gives the
reference final checkpoint. Each trial launches the same run and kills one worker (chosen at random):
- "mid-training": 0-50 ms after a random step was logged (it may land in a step or a synchronous save);
- "in-persist": async checkpoints, and the persist of a random step sleeps after writing its shard, so the kill
  lands inside a half-written checkpoint; the relaunch must resume from the checkpoint before it.
Then it relaunches and checks (tests/test_ckpt.py's check_fault_run): the final parameters and Adam moments are
bitwise equal to the uninterrupted run's, steps replayed after the kill have bitwise-equal losses, and the
relaunch resumed exactly once, from a committed checkpoint.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "bench")]

from common import own_root  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", default="/tmp/fault-ckpt",
                        help="a new or empty directory (or one this bench made): it is cleared run by run")
    parser.add_argument("--smoke", action="store_true", help="one trial, to check the bench runs (--trials 1)")
    args = parser.parse_args()
    if args.smoke:
        args.trials = 1
    own_root(parser, args.root, clear=True)  # the runs below resume from what they find there

    import ckpt
    from resilience.ckpt_files import FAULT_ENV
    from test_ckpt import (FAULT_STEPS, check_fault_run, kill_a_worker_when, launch_training, metrics_lines,
                           run_to_completion)

    rng = random.Random(args.seed)
    corpus = os.path.join(args.root, "corpus.txt")
    with open(corpus, "w") as f:
        f.write("".join(rng.choice("abcdefgh ijklmnop\n") for _ in range(50_000)))
    reference_dir = os.path.join(args.root, "uninterrupted")
    run_to_completion(reference_dir, corpus, "log.txt")
    reference = ckpt.read_logical(os.path.join(reference_dir, "ck", ckpt.step_dir_name(FAULT_STEPS)))

    killed = correct = 0
    for trial in range(args.trials):
        run_dir = os.path.join(args.root, f"trial-{trial}")
        mode = rng.choice(["mid-training", "in-persist"])
        if mode == "mid-training":
            after, delay = rng.randrange(1, FAULT_STEPS), rng.uniform(0.0, 0.05)  # a step lasts ~20-50 ms here
            seen = {}

            def condition(after=after, delay=delay, seen=seen):
                if len(metrics_lines(run_dir)) >= after:
                    seen.setdefault("t", time.monotonic())
                    return time.monotonic() - seen["t"] >= delay
                return False

            extra, env, what = [], None, f"{delay * 1e3:.0f} ms after step {after - 1} was logged"
        else:
            step = rng.randrange(2, FAULT_STEPS, 2)
            ck = os.path.join(run_dir, "ck")

            def condition(step=step, ck=ck):
                names = os.listdir(ck) if os.path.isdir(ck) else []
                return any(n.startswith(f".tmp-{ckpt.step_dir_name(step)}") and os.listdir(os.path.join(ck, n))
                           for n in names)

            extra, env, what = ["--async-ckpt"], {FAULT_ENV: f"{step}:30"}, f"persisting step {step}"
        proc = launch_training(run_dir, corpus, "log.txt", extra, env)
        victim = kill_a_worker_when(proc, condition, rng)
        if victim is None or proc.returncode == 0:
            print(f"trial {trial}: {mode} ({what}): the run finished before the kill; not counted", flush=True)
            continue
        killed += 1
        try:
            run_to_completion(run_dir, corpus, "relaunch.txt", extra)
            line = check_fault_run(run_dir, reference)
            if mode == "in-persist":
                expected = f"at step {step - 2} " if step > 2 else None
                assert (expected in line) if expected else "no checkpoint" in line, line
            correct += 1
            verdict = "resumed correctly: " + line.strip().split(" (")[0].replace(run_dir + "/", "")
        except AssertionError as e:
            verdict = f"WRONG: {str(e).splitlines()[0][:200]}"
        print(f"trial {trial}: {mode} ({what}), killed pid {victim}: {verdict}", flush=True)
        shutil.rmtree(run_dir, ignore_errors=True)
    print(f"fault injection: {killed} kills at random points, {correct} resumed correctly"
          f" (final parameters and moments bitwise equal to the uninterrupted run)")


if __name__ == "__main__":
    main()
