"""The precision-recipe ablation (issue 29): which part of a microscaling recipe costs loss, on a laptop.

    python bench/bench_precision.py                # the whole table: `small`, 30 steps of 4×256 tokens (12 min here)
    python bench/bench_precision.py --steps 300    # what the question deserves (hours here: see below)
    python bench/bench_precision.py --table-only   # the table again from what the last run left in out/
    python bench/bench_precision.py --smoke        # `tiny`, 4 steps, two cells, SQNR at 256²: checks it runs

It prints, in order:
  1. the round-trip SQNR of each format on randn(4096, 4096) (microscaling.fake_quantize against the fp32 tensor),
     and the NVFP4 GEMM (both operands fake-quantised) against the fp32 GEMM, next to torchao's thresholds
     (MXFP8 ≥ 18 dB, MXFP4 ≥ 13 dB, NVFP4 ≥ 8 dB, NVFP4 GEMM ≥ 16 dB);
  2. the ablation: every cell of forward ∈ {bf16, mxfp8, nvfp4, nvfp4+w2d} × backward ∈ {bf16, nvfp4+sr,
     nvfp4+sr+rht} (train.py's --precision-recipe; bf16 × bf16 is the plain bf16 run), then today's --fp8 current
     and --fp8 blockwise: each cell one `python train.py` process from the same init (every weight from (seed,
     parameter name)) on the same batches of the default corpus, the `small` preset; per cell the final val loss,
     its delta against bf16 in %, the non-finite (skipped) steps, the saturated share per role (X, W, dY: the
     values the casts clamped over steps 1..N-1, as the run printed them), s/step, and what the accounting says
     of the recipe: the share of its FLOPs in narrow formats and the format-weighted peak on a
     B200 (format_flops.py) against bf16's;
  3. which half is the more sensitive here: the forward cells with a bf16 backward against the backward cells
     with a bf16 forward, next to the 430M figures (12.8B tokens: forward +0.94–1.22%, backward +0.32–0.72% over
     bf16).
A measurement, not a timed test. Its size is set by the emulation's cost on a CPU. When the table was measured,
NVFP4's quantiser (float64, for the single rounding) took ~100 ns per element on this 2-core machine shared by a
dozen jobs (load ~13), and a step quantises ~16 M elements per block in NVFP4's forward and backward at 4×256
tokens: ~18 s a step there, against 1.5 s in bf16 (one thread; the recipe has since moved to fake_quantize, 3-4×
faster on `tiny`).
Thirty steps leave the model early in training, where
a delta is as much the optimiser's first steps as the format's bias; the fp32 row (the same run in fp32) shows
how far two precisions drift apart anyway. On a GPU without block-scaled GEMMs (all before Blackwell) and on
CPUs the formats are emulated (quantise → dequantise → a GEMM in the compute dtype): s/step is the emulation's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import format_flops  # noqa: E402
import hardware  # noqa: E402
import microscaling  # noqa: E402
from model import config_from_preset  # noqa: E402

# The ablation's axes: a name in the table -> the parts of --precision-recipe it adds (recipe_spec.md's spelling).
FORWARD = {"bf16": (), "mxfp8": ("fwd=mxfp8",), "nvfp4": ("fwd=nvfp4",), "nvfp4+w2d": ("fwd=nvfp4", "w2d")}
BACKWARD = {"bf16": (), "nvfp4+sr": ("bwd=nvfp4", "sr"), "nvfp4+sr+rht": ("bwd=nvfp4", "sr", "rht")}
FP8_ROWS = ("current", "blockwise")  # today's --fp8 recipes
THRESHOLDS_DB = {"mxfp8": 18.0, "mxfp4": 13.0, "nvfp4": 8.0, "nvfp4 GEMM": 16.0}  # torchao's tests
PAPER = "430M model, 12.8B tokens: forward +0.94–1.22%, backward +0.32–0.72% over bf16"


# --- 1. Round-trip SQNR --------------------------------------------------------------------------------------

def sqnr_table(n: int) -> list:
    """[(name, dB, threshold)] of each format's round trip on randn(n, n) and the NVFP4 GEMM against fp32."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, n, generator=generator)
    rows = [(name, microscaling.sqnr_db(x, microscaling.fake_quantize(x, microscaling.FORMATS[name])))
            for name in ("mxfp8", "mxfp4", "nvfp4")]
    a, b = x, torch.randn(n, n, generator=generator)  # Y = A·Bᵀ: both quantised along K, their last dim
    nvfp4 = microscaling.FORMATS["nvfp4"]
    gemm = microscaling.fake_quantize(a, nvfp4) @ microscaling.fake_quantize(b, nvfp4).t()
    rows.append(("nvfp4 GEMM", microscaling.sqnr_db(a @ b.t(), gemm)))
    return [(name, db, THRESHOLDS_DB[name]) for name, db in rows]


def print_sqnr(n: int) -> None:
    print(f"round-trip SQNR on randn({n}, {n}) against fp32 (GEMM: fq(A)·fq(B)ᵀ against A·Bᵀ, {n}³):")
    for name, db, threshold in sqnr_table(n):
        verdict = "ok" if db >= threshold else "WRONG: below"
        print(f"  {name:<11} {db:6.2f} dB   (torchao's threshold ≥ {threshold:g} dB: {verdict})")


# --- 2. The ablation: one train.py process per cell ------------------------------------------------------------

def cells(smoke: bool) -> list:
    """[(label, forward, backward, train.py flags)], bf16 × bf16 first: the baseline every delta is against."""
    grid = [("nvfp4+w2d", "nvfp4+sr+rht")] if smoke else [(f, b) for f in FORWARD for b in BACKWARD]
    rows = [("bf16", "bf16", "bf16", [])]
    for fwd, bwd in grid:
        if (fwd, bwd) != ("bf16", "bf16"):
            parts = FORWARD[fwd] + BACKWARD[bwd]
            rows.append((f"fwd {fwd} × bwd {bwd}", fwd, bwd, ["--precision-recipe", ",".join(parts)]))
    if not smoke:
        rows += [(f"--fp8 {mode}", "fp8", "fp8", ["--fp8", mode]) for mode in FP8_ROWS]
        rows.append(("fp32 (reference)", "fp32", "fp32", ["--dtype", "fp32"]))
    return rows


def run_cell(label: str, flags: list, args) -> dict:
    """Train one cell with train.py in its own process (its printout kept in <out-dir>/<cell>.log, its steps in
    <cell>.jsonl), then read it; with --table-only just read what an earlier run left."""
    name = re.sub(r"[^a-z0-9]+", "_", label.lower()).strip("_")
    metrics, log = (os.path.join(args.out_dir, f"{name}.{ext}") for ext in ("jsonl", "log"))
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--preset", args.preset, "--steps", str(args.steps),
           "--global-batch", str(args.batch), "--micro-batch", str(args.batch), "--seed", str(args.seed),
           "--eval-every", "0", "--eval-batches", str(args.eval_batches), "--log-every", str(args.steps),
           "--sample-tokens", "0", "--out-dir", args.out_dir, "--metrics-file", metrics]
    cmd += flags if "--dtype" in flags else ["--dtype", "bf16", *flags]
    start = time.perf_counter()
    if not args.table_only:
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
        with open(log, "w") as f:
            f.write(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            lines = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()
            said = [line for line in lines if re.search(r"Error\b|^error:", line.strip())] or lines
            return dict(label=label, error=f"exit {proc.returncode}: {said[-1].strip()[:150]}",
                        seconds=time.perf_counter() - start)
    result = dict(label=label, seconds=time.perf_counter() - start)
    if not (os.path.exists(metrics) and os.path.exists(log)):
        return dict(result, error=f"no {os.path.basename(metrics)} here (not run, or still running)")
    records = [json.loads(line) for line in open(metrics)]
    if "val_loss" not in records[-1]:
        return dict(result, error=f"{len(records)} of {args.steps} steps in {os.path.basename(metrics)} (unfinished)")
    nonfinite = sum(1 for r in records if r["skipped"] or not math.isfinite(r["loss"]))
    times = [r["step_time_s"] for r in records[1:]] or [records[0]["step_time_s"]]
    return dict(result, val=records[-1]["val_loss"], nonfinite=nonfinite, saturated=saturated_share(open(log).read()),
                step_s=sum(times) / len(times))


def saturated_share(stdout: str):
    """(X, W, dY) percent of values the casts clamped over steps 1..N-1 (the run's last saturation printout: the
    steps since the one of step 0), or None where the run prints none (bf16, fp32). A recipe prints one line per
    logged step (each role over all its linears, count-weighted); --fp8 prints a table of its linears, here
    averaged per role over the linears (unweighted)."""
    recipe = re.findall(r"saturated since the last line.*: X ([\d.]+)%\s+W ([\d.]+)%\s+dY ([\d.]+)%", stdout)
    if recipe:
        return tuple(float(p) for p in recipe[-1])
    tables = re.split(r"the saturated share since the last table", stdout)
    if len(tables) < 2:
        return None
    rows = [[float(p) for p in re.findall(r"([\d.]+)%", line)] for line in tables[-1].splitlines()[2:]]
    rows = [row for row in rows if len(row) == 3]  # a linear's row: input, weight, grad_output
    return tuple(sum(column) / len(rows) for column in zip(*rows)) if rows else None


def accounting(fwd: str, bwd: str, preset: str, seq_len: int) -> tuple:
    """(share of FLOPs in narrow formats, B200's format-weighted peak over its bf16 peak) of a cell's recipe."""
    if fwd == "fp32":
        return 0.0, None
    config = config_from_preset(preset)
    flops = format_flops.flops_by_format(config, seq_len, fwd.split("+")[0], bwd.split("+")[0], "bf16")
    b200 = hardware.PRESETS["b200"]
    peaks, _ = format_flops.format_peaks(b200, flops, "bf16")
    narrow = sum(f for fmt, f in flops.items() if fmt in format_flops.NARROW) / sum(flops.values())
    return narrow, format_flops.format_weighted_peak(flops, peaks) / b200.peak("bf16")


def emulation_cost(row) -> int:
    """A cell's rough cost in emulated quantisation, to start the dearest first (NVFP4's backward quantises
    three operands of two GEMMs, each in float64; its forward two; MXFP8's are cheap)."""
    _, fwd, bwd, _ = row
    return 4 * bwd.startswith("nvfp4") + 2 * fwd.startswith("nvfp4") + fwd.startswith("mx")


def print_table(results: list, rows: list, args) -> None:
    base = next((r for r in results if r["label"] == "bf16" and "error" not in r), None)
    print(f"{'cell':<33} {'val loss':>9} {'Δ vs bf16':>10} {'non-finite':>10} {'sat X/W/dY':>16} {'s/step':>7}"
          f" {'narrow FLOPs':>12} {'B200 P_w/bf16':>13}")
    seq_len = config_from_preset(args.preset).block_size
    for r, (label, fwd, bwd, _) in zip(results, rows):
        if "error" in r:
            print(f"{label:<33} failed ({r['error']})")
            continue
        delta = f"{100 * (r['val'] / base['val'] - 1):+.2f}%" if base else "n/a"
        sat = "—" if r["saturated"] is None else "/".join(f"{p:.2g}" for p in r["saturated"]) + "%"
        narrow, speedup = accounting(fwd, bwd, args.preset, seq_len)
        print(f"{label:<33} {r['val']:9.4f} {delta:>10} {r['nonfinite']:>10} {sat:>16} {r['step_s']:7.2f}"
              f" {narrow:>12.0%} {'—' if speedup is None else f'{speedup:.2f}×':>13}")


def print_verdict(results: list) -> None:
    """Forward-only cells (backward bf16) against backward-only cells (forward bf16), next to the 430M figures;
    then each NVIDIA part's own effect (w2d, rht), and fp32's drift from bf16: the size of noise here."""
    val = {r["label"]: r["val"] for r in results if "error" not in r}
    if "bf16" not in val:
        print("which half is the more sensitive: no bf16 baseline ran")
        return
    delta = {label: 100 * (v / val["bf16"] - 1) for label, v in val.items()}
    forward = [delta[f"fwd {f} × bwd bf16"] for f in FORWARD if f != "bf16" and f"fwd {f} × bwd bf16" in delta]
    backward = [delta[f"fwd bf16 × bwd {b}"] for b in BACKWARD if b != "bf16" and f"fwd bf16 × bwd {b}" in delta]
    if not forward or not backward:
        print(f"which half is the more sensitive: needs a forward-only and a backward-only cell (ran"
              f" {len(forward)} and {len(backward)}); the {PAPER}")
        return
    span = lambda d: f"{min(d):+.2f}…{max(d):+.2f}%"  # noqa: E731
    mean = lambda d: sum(d) / len(d)  # noqa: E731
    more = "forward" if mean(forward) > mean(backward) else "backward"
    noise = abs(delta.get("fp32 (reference)", 0.0))
    if abs(mean(forward) - mean(backward)) < noise:  # the two halves differ by less than two precisions drift
        answer = (f"not resolved here (they differ by {abs(mean(forward) - mean(backward)):.2f} points, less than"
                  f" fp32's {noise:.2f}% drift from bf16; the {more} costs more on its face), against the {PAPER}")
    else:
        answer = f"the {more} here, {'as' if more == 'forward' else 'unlike'} the {PAPER}"
    print(f"which half is the more sensitive: quantising the forward alone {span(forward)}, the backward alone"
          f" {span(backward)} over bf16 (mean {mean(forward):+.2f}% against {mean(backward):+.2f}%): {answer}")
    parts = {"w2d (2-D weight scales)": [(f"fwd nvfp4+w2d × bwd {b}", f"fwd nvfp4 × bwd {b}") for b in BACKWARD],
             "rht (Hadamard on dW)": [(f"fwd {f} × bwd nvfp4+sr+rht", f"fwd {f} × bwd nvfp4+sr") for f in FORWARD]}
    for part, pairs in parts.items():
        effects = [delta[a] - delta[b] for a, b in pairs if a in delta and b in delta]
        if effects:
            print(f"  {part}: {mean(effects):+.2f} points of the delta on average (from {min(effects):+.2f} to"
                  f" {max(effects):+.2f} over the {len(effects)} pairs of cells that differ only by it; < 0: it helps)")
    if "fp32 (reference)" in delta:
        print(f"  noise: fp32 lands {delta['fp32 (reference)']:+.2f}% from bf16 on the same init and batches;"
              f" deltas of that size are not resolved by this run")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per cell")
    p.add_argument("--batch", type=int, default=4, help="sequences per step (of the preset's 256 tokens)")
    p.add_argument("--eval-batches", type=int, default=8, help="val batches for the final loss (the same in all)")
    p.add_argument("--preset", default="small")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--sqnr-n", type=int, default=4096, help="the SQNR tensors are randn(n, n)")
    p.add_argument("--jobs", type=int, default=2, help="cells trained at once (after the bf16 baseline)")
    p.add_argument("--threads", type=int, help="OMP threads of each train.py run (default: cores / jobs)")
    p.add_argument("--out-dir", default=os.path.join("out", "bench_precision"),
                   help="the token cache and each cell's metrics file (default under ./out)")
    p.add_argument("--table-only", action="store_true", help="print the table of what an earlier run left in"
                   " --out-dir (the same flags), training nothing")
    p.add_argument("--only", default="", help="run only the cells whose label matches this regex (and bf16)")
    p.add_argument("--smoke", action="store_true", help="`tiny`, 4 steps, two cells, SQNR at 256²")
    args = p.parse_args()
    if args.smoke:
        args.steps, args.batch, args.eval_batches, args.preset, args.sqnr_n = 4, 2, 1, "tiny", 256
    args.out_dir = os.path.abspath(args.out_dir)
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // args.jobs)
    os.makedirs(args.out_dir, exist_ok=True)
    start = time.perf_counter()
    print_sqnr(args.sqnr_n)
    rows = [row for row in cells(args.smoke) if row[0] == "bf16" or re.search(args.only, row[0])]
    print(f"\nablation: `{args.preset}`, {args.steps} steps of {args.batch} sequences, one init (seed {args.seed}),"
          f" the same batches; val loss over {args.eval_batches} batches after the last step; bf16 compute;"
          f" {len(rows)} cells, {args.jobs} at a time of {args.threads} threads")
    def run(row):
        r = run_cell(row[0], row[3], args)
        print(f"  ran {row[0]}: {r['seconds']:.0f} s" + (f" ({r['error']})" if "error" in r else ""), flush=True)
        return r

    done = {rows[0][0]: run(rows[0])}  # alone: it writes the token cache the others read
    with ThreadPoolExecutor(args.jobs) as pool:  # threads that wait on train.py processes, the dearest first
        futures = {row[0]: pool.submit(run, row) for row in sorted(rows[1:], key=lambda row: -emulation_cost(row))}
        done.update({label: future.result() for label, future in futures.items()})
    results = [done[row[0]] for row in rows]
    print()
    print_table(results, rows, args)
    print_verdict(results)
    print(f"wall time {time.perf_counter() - start:.0f} s (python bench/bench_precision.py {' '.join(sys.argv[1:])})")
    failed = [r["label"] for r in results if "error" in r]
    if failed:
        raise SystemExit(f"{len(failed)} cell(s) failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
