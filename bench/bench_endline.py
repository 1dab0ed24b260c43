"""Every run's end line on this machine: the time model's predicted step time against the measured one, per layout.

    python bench/bench_endline.py [--steps 20] [--repeats 3] [--layouts ddp,zero3,tp,pp,cp]
    python bench/bench_endline.py --smoke        # one layout (DDP), 3 steps: seconds

Each layout is one `torchrun --nproc_per_node 2 train.py --preset tiny --dtype fp32` run (OMP_NUM_THREADS=1), as a
user starts it (no eval, no sample: only the steps and the start-up matter here); its end line
(time_model.check_line, on cpu_probe.machine_model: the matmul peak, the link's α and β, this rank's block rate,
its ends' rate, its update's time, the layout factor ρ and the compute/transfer overlap φ, all measured at
start-up) is parsed and printed as layout, predicted,
measured, ratio (measured / predicted), with the 1-minute load average read when the run ended: on a shared
2-core machine the load is the noise, so read a ratio next to its load. With --repeats R the layouts run R times,
interleaved (ddp, zero3, ..., ddp, zero3, ...: a slow minute of the machine falls on every layout alike), and
the verdict is on each layout's median ratio.

Measured on the 2-core test machine, quiet (load 1.8-1.9: the run itself), `--repeats 3`: median ratios DDP 1.06,
ZeRO-3 1.03, TP 0.92, PP 1.07, CP 1.02, every one of the 15 runs in [0.82, 1.25]; with `--steps 40`, 1.07, 1.02,
0.89, 1.16, 0.89, every run in [0.80, 1.26]. Before the ends, the update, ρ and the in-step α were measured:
1.30, 1.22, 1.46, 1.13, 1.34 (2 of 5 within ±25%).
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LAYOUTS = {  # name -> train.py flags on 2 ranks
    "ddp": [],
    "zero3": ["--zero", "3"],
    "tp": ["--tp", "2"],
    "pp": ["--pp", "2", "--pp-schedule", "1f1b", "--micro-batch", "2"],  # m = 16 / 2 = 8 micro-batches
    "cp": ["--cp", "2", "--cp-impl", "ring"],
}
END_LINE = re.compile(r"hardware model: step time measured ([\d,.]+) ms .* vs predicted ([\d,.]+) ms .*?"
                      r"overlap φ ([\d.]+)\): compute ([\d,.]+), exposed comm ([\d,.]+) \(of ([\d,.]+)\)")


def run_layout(name: str, steps: int, workdir: str) -> dict:
    corpus = os.path.join(workdir, "corpus.txt")  # tokenized in a blink, unlike the built-in corpus
    with open(corpus, "w") as f:
        f.write("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(500)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", os.path.join(ROOT, "train.py"),
           "--preset", "tiny", "--dtype", "fp32", "--steps", str(steps), "--eval-every", "0", "--eval-batches", "1",
           "--sample-tokens", "0", "--data", corpus, "--out-dir", workdir, *LAYOUTS[name]]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=workdir, env=env)
    load = os.getloadavg()[0]
    match = END_LINE.search(proc.stdout)
    if proc.returncode or not match:
        raise SystemExit(f"{name}: no end line (exit {proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    measured, predicted, phi, compute, exposed, comm = (float(g.replace(",", "")) for g in match.groups())
    return dict(layout=name, predicted=predicted, measured=measured, ratio=measured / predicted, phi=phi,
                compute=compute, exposed=exposed, comm=comm, load=load)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each layout, interleaved (median ratio)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated, of " + ", ".join(LAYOUTS))
    parser.add_argument("--smoke", action="store_true", help="DDP only, 3 steps")
    args = parser.parse_args()
    names, steps = (["ddp"], 3) if args.smoke else (args.layouts.split(","), args.steps)
    if args.repeats < 1:
        parser.exit(2, f"--repeats: expected at least 1, got {args.repeats}\n")
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        parser.exit(2, f"--layouts: unknown {', '.join(unknown)} (expected some of {', '.join(LAYOUTS)})\n")
    print(f"{'layout':8} {'predicted ms':>12} {'measured ms':>12} {'ratio':>6} {'φ':>5} {'compute':>8}"
          f" {'exposed':>8} {'comm':>8} {'load 1 min':>10}")
    with tempfile.TemporaryDirectory() as workdir:
        rows = [run_layout(name, steps, workdir) for _ in range(1 if args.smoke else args.repeats) for name in names]
    for r in rows:
        print(f"{r['layout']:8} {r['predicted']:12.1f} {r['measured']:12.1f} {r['ratio']:6.2f} {r['phi']:5.2f}"
              f" {r['compute']:8.1f} {r['exposed']:8.1f} {r['comm']:8.1f} {r['load']:10.2f}")
    medians = {name: sorted(r["ratio"] for r in rows if r["layout"] == name) for name in names}
    medians = {name: ratios[len(ratios) // 2] for name, ratios in medians.items()}
    if len(rows) > len(names):
        print("median ratio per layout: " + ", ".join(f"{name} {ratio:.2f}" for name, ratio in medians.items()))
    inside = sum(0.75 <= ratio <= 1.25 for ratio in medians.values())
    print(f"{inside} of {len(names)} layouts within ±25% (measured / predicted in [0.75, 1.25])")


if __name__ == "__main__":
    main()
