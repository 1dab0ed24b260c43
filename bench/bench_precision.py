"""The precision-recipe ablation (issue 29): which part of a microscaling recipe costs loss, on a laptop.

    python bench/bench_precision.py                # the whole table: `small`, 30 steps of 4×256 tokens (12 min here)
    python bench/bench_precision.py --steps 200 --noise-seeds 2   # 19 runs, 58 min here with other jobs running
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
     B200 (accounting/format_flops.py) against bf16's;
  3. which half is the more sensitive here: the forward cells with a bf16 backward against the backward cells
     with a bf16 forward, next to the 430M figures (12.8B tokens: forward +0.94–1.22%, backward +0.32–0.72% over
     bf16).
A measurement, not a timed test. Its size is set by the emulation's cost on a CPU: with the float32 fake
quantiser (precision/microscaling_fast.py), one thread a cell and two cells at once on this 2-core machine beside other
jobs (load 2-7), a step of 4×256 tokens took 0.38 s in bf16, 0.5 s with an MXFP8 forward, 1.1 s with an NVFP4
forward, 1.5 s with an NVFP4 backward and 2.8-3.4 s with both. Thirty steps leave the model early in training,
where a delta is as much the optimiser's first steps as the format's bias; the fp32 row (the same run in fp32)
shows how far two precisions drift apart anyway. At 200 steps (205 k tokens) with two more seeds, measured: every
cell's delta from −0.7% to +3.7% of bf16 and the seeds' σ_Δ 3.9 points, so no cell and neither half stands out of the
noise at this scale (the 430M figures come from 6·10^4 times the tokens).
On a GPU without block-scaled GEMMs (all before Blackwell) and on
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

from accounting import format_flops  # noqa: E402
from planner import hardware  # noqa: E402
from precision import microscaling, microscaling_fast  # noqa: E402
import precision.recipe  # noqa: E402
from model import GPT, config_from_preset  # noqa: E402

# The ablation's axes: a name in the table -> the parts of --precision-recipe it adds (recipe_spec.md's spelling).
FORWARD = {"bf16": (), "mxfp8": ("fwd=mxfp8",), "nvfp4": ("fwd=nvfp4",), "nvfp4+w2d": ("fwd=nvfp4", "w2d")}
BACKWARD = {"bf16": (), "nvfp4+sr": ("bwd=nvfp4", "sr"), "nvfp4+sr+rht": ("bwd=nvfp4", "sr", "rht")}
FP8_ROWS = ("current", "blockwise")  # today's --fp8 recipes
THRESHOLDS_DB = {"mxfp8": 18.0, "mxfp4": 13.0, "nvfp4": 8.0, "nvfp4 GEMM": 16.0}  # torchao's tests
NOISE_CELL = ("nvfp4", "nvfp4+sr")  # rerun with other seeds: the spread of its delta is the table's noise
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


# --- 1b. What the emulation costs a step: the reference quantiser against the fast one -------------------------

def _reference_fake_quantize(x, fmt, rule="rceil", two_d=False, draws=None, tensor_amax=None, count_saturated=False):
    """microscaling.fake_quantize behind microscaling_fast's signature: the quantiser the recipe used before."""
    fmt = microscaling.FORMATS[fmt] if isinstance(fmt, str) else fmt
    return microscaling.fake_quantize(x, fmt, rule, two_d, draws, tensor_amax if fmt.scale == "e4m3" else None,
                                      count_saturated)


def _gemm_hadamard(x, hadamard, dim=-1):
    """The Hadamard as the recipe ran it before: a GEMM with H/4 on 16-wide blocks of the last dim (transposed)."""
    moved = x.movedim(dim, -1)
    out = (moved.reshape(*moved.shape[:-1], -1, 16) @ (hadamard.to(x.dtype) / 4)).reshape(moved.shape)
    return out.movedim(-1, dim)


def step_seconds(preset: str, spec: str | None, batch: int, steps: int, reference: bool) -> float:
    """The mean wall seconds of `steps` forward + backward passes (after one warm-up) of `preset` in fp32 with
    --precision-recipe `spec` (None: none), on random tokens; reference: with the quantiser and Hadamard the
    recipe used before precision/microscaling_fast.py (float64 NVFP4, a new tensor per operation; the Hadamard as a
    GEMM)."""
    config = config_from_preset(preset)
    torch.manual_seed(0)
    model = GPT(config)
    if spec:
        precision.recipe.convert(model, precision.recipe.parse_recipe(spec))
    tokens = torch.randint(0, config.vocab_size, (batch, config.block_size + 1))
    saved = microscaling_fast.fake_quantize, microscaling.hadamard_blocks
    if reference:
        microscaling_fast.fake_quantize, microscaling.hadamard_blocks = _reference_fake_quantize, _gemm_hadamard
    try:
        times = []
        for _ in range(steps + 1):
            start = time.perf_counter()
            _, loss, count = model(tokens[:, :-1], tokens[:, 1:])
            (loss / count).backward()
            times.append(time.perf_counter() - start)
    finally:
        microscaling_fast.fake_quantize, microscaling.hadamard_blocks = saved
    return sum(times[1:]) / steps


def print_speed(preset: str, batch: int, steps: int) -> None:
    """s/step of each forward × backward cell, the quantiser before (reference) and after (fast), alternated so
    that a loaded machine slows both alike; the unquantised run for scale."""
    print(f"the emulation's cost: `{preset}`, {batch}×{config_from_preset(preset).block_size} tokens, fp32,"
          f" forward + backward, mean of {steps} steps after a warm-up, one thread")
    plain = step_seconds(preset, None, batch, steps, reference=False)
    print(f"  {'unquantised':<36} {plain:7.2f} s/step")
    for fwd in FORWARD:
        for bwd in BACKWARD:
            if (fwd, bwd) == ("bf16", "bf16"):
                continue
            spec = ",".join(FORWARD[fwd] + BACKWARD[bwd])
            before = step_seconds(preset, spec, batch, steps, reference=True)
            after = step_seconds(preset, spec, batch, steps, reference=False)
            print(f"  {cell_label(fwd, bwd, 'fp32'):<36} before {before:7.2f} s/step, after {after:7.2f} s/step"
                  f" ({before / after:.1f}× faster)", flush=True)


# --- 2. The ablation: one train.py process per cell ------------------------------------------------------------

def cell_label(fwd: str, bwd: str, dtype: str) -> str:
    """A cell's name in the table: the unquantised side is named by the compute dtype."""
    return f"fwd {dtype if fwd == 'bf16' else fwd} × bwd {dtype if bwd == 'bf16' else bwd}"


def seed_label(label: str, seed: int) -> str:
    return f"{label} (seed {seed})"


def cells(smoke: bool, dtype: str = "bf16", seed: int = 0, noise_seeds: int = 0) -> list:
    """[(label, forward, backward, train.py flags)], the plain run first: the baseline every delta is against
    (bf16 × bf16 is the plain run in the compute dtype); then the noise runs: the baseline and NOISE_CELL again
    with seeds seed+1..seed+noise_seeds (another init, other batches, other SR draws)."""
    grid = [("nvfp4+w2d", "nvfp4+sr+rht")] if smoke else [(f, b) for f in FORWARD for b in BACKWARD]
    rows = [(dtype, "bf16", "bf16", [])]
    for fwd, bwd in grid:
        if (fwd, bwd) != ("bf16", "bf16"):
            parts = FORWARD[fwd] + BACKWARD[bwd]
            rows.append((cell_label(fwd, bwd, dtype), fwd, bwd, ["--precision-recipe", ",".join(parts)]))
    if not smoke:
        rows += [(f"--fp8 {mode}", "fp8", "fp8", ["--fp8", mode]) for mode in FP8_ROWS]
        if dtype != "fp32":
            rows.append(("fp32 (reference)", "fp32", "fp32", ["--dtype", "fp32"]))
    noisy = next(row for row in rows if row[0] == cell_label(*NOISE_CELL, dtype)) if not smoke else rows[-1]
    for extra in range(1, noise_seeds + 1):
        for label, fwd, bwd, flags in (rows[0], noisy):
            rows.append((seed_label(label, seed + extra), fwd, bwd, flags + ["--seed", str(seed + extra)]))
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
    cmd += flags if "--dtype" in flags else ["--dtype", args.dtype, *flags]
    start = time.perf_counter()
    if not args.table_only:
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        # its own session: Linux's autogroup scheduler shares the CPU per session, so cells in one session
        # would split one share between them
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, start_new_session=True)
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


def noise_estimate(results: list, args) -> dict | None:
    """From the runs with other seeds: the baseline's val loss spread and the paired delta of NOISE_CELL (its run
    against the baseline of the same seed) per seed; σ_Δ, the standard deviation of that paired delta in points,
    is what a cell's delta must exceed (twice) to be told from noise. None without noise runs."""
    val = {r["label"]: r["val"] for r in results if "error" not in r}
    base, cell = args.dtype, cell_label(*NOISE_CELL, args.dtype)
    seeds = [args.seed] + [args.seed + k for k in range(1, args.noise_seeds + 1)]
    names = [(base, cell)] + [(seed_label(base, k), seed_label(cell, k)) for k in seeds[1:]]
    pairs = [(val[b], val[c]) for b, c in names if b in val and c in val]
    if len(pairs) < 2:
        return None
    deltas = [100 * (c / b - 1) for b, c in pairs]
    bases = [b for b, _ in pairs]
    std = lambda v: math.sqrt(sum((x - sum(v) / len(v)) ** 2 for x in v) / (len(v) - 1))  # noqa: E731
    return dict(seeds=len(pairs), deltas=deltas, sigma=std(deltas), base_mean=sum(bases) / len(bases),
                base_spread=100 * std(bases) / (sum(bases) / len(bases)), cell=cell)


def print_table(results: list, rows: list, args, noise: dict | None) -> None:
    base = next((r for r in results if r["label"] == args.dtype and "error" not in r), None)
    print(f"{'cell':<36} {'val loss':>9} {f'Δ vs {args.dtype}':>10} {'> 2σ_Δ':>6} {'non-finite':>10}"
          f" {'sat X/W/dY':>16} {'s/step':>7} {'narrow FLOPs':>12} {'B200 P_w/bf16':>13}")
    seq_len = config_from_preset(args.preset).block_size
    for r, (label, fwd, bwd, _) in zip(results, rows):
        if "error" in r:
            print(f"{label:<36} failed ({r['error']})")
            continue
        change = 100 * (r["val"] / base["val"] - 1) if base else None
        delta = "n/a" if change is None else f"{change:+.2f}%"
        above = "—" if noise is None or change is None or label == args.dtype or "(seed" in label else \
            ("yes" if abs(change) > 2 * noise["sigma"] else "no")
        sat = "—" if r["saturated"] is None else "/".join(f"{p:.2g}" for p in r["saturated"]) + "%"
        narrow, speedup = accounting(fwd, bwd, args.preset, seq_len)
        print(f"{label:<36} {r['val']:9.4f} {delta:>10} {above:>6} {r['nonfinite']:>10} {sat:>16} {r['step_s']:7.2f}"
              f" {narrow:>12.0%} {'—' if speedup is None else f'{speedup:.2f}×':>13}")


def print_verdict(results: list, args, noise: dict | None) -> None:
    """Forward-only cells (backward unquantised) against backward-only cells (forward unquantised), next to the
    430M figures; then each NVIDIA part's own effect (w2d, rht), and the noise: the seeds' spread (or, without
    noise runs, fp32's drift from bf16)."""
    val = {r["label"]: r["val"] for r in results if "error" not in r}
    plain = args.dtype
    if plain not in val:
        print(f"which half is the more sensitive: no {plain} baseline ran")
        return
    delta = {label: 100 * (v / val[plain] - 1) for label, v in val.items()}
    forward = [delta[cell_label(f, "bf16", plain)] for f in FORWARD
               if f != "bf16" and cell_label(f, "bf16", plain) in delta]
    backward = [delta[cell_label("bf16", b, plain)] for b in BACKWARD
                if b != "bf16" and cell_label("bf16", b, plain) in delta]
    if not forward or not backward:
        print(f"which half is the more sensitive: needs a forward-only and a backward-only cell (ran"
              f" {len(forward)} and {len(backward)}); the {PAPER}")
        return
    span = lambda d: f"{min(d):+.2f}…{max(d):+.2f}%"  # noqa: E731
    mean = lambda d: sum(d) / len(d)  # noqa: E731
    more = "forward" if mean(forward) > mean(backward) else "backward"
    if noise is not None:
        noise_size, what = 2 * noise["sigma"], f"2σ_Δ = {2 * noise['sigma']:.2f} points (the seeds' noise)"
    else:
        noise_size = abs(delta.get("fp32 (reference)", 0.0))
        what = f"fp32's {noise_size:.2f}% drift from bf16"
    if abs(mean(forward) - mean(backward)) < noise_size:
        answer = (f"not resolved here (they differ by {abs(mean(forward) - mean(backward)):.2f} points, less than"
                  f" {what}; the {more} costs more on its face), against the {PAPER}")
    else:
        answer = f"the {more} here, {'as' if more == 'forward' else 'unlike'} the {PAPER}"
    print(f"which half is the more sensitive: quantising the forward alone {span(forward)}, the backward alone"
          f" {span(backward)} over {plain} (mean {mean(forward):+.2f}% against {mean(backward):+.2f}%): {answer}")
    parts = {"w2d (2-D weight scales)": [(cell_label("nvfp4+w2d", b, plain), cell_label("nvfp4", b, plain))
                                         for b in BACKWARD],
             "rht (Hadamard on dW)": [(cell_label(f, "nvfp4+sr+rht", plain), cell_label(f, "nvfp4+sr", plain))
                                      for f in FORWARD]}
    for part, pairs in parts.items():
        effects = [delta[a] - delta[b] for a, b in pairs if a in delta and b in delta]
        if effects:
            print(f"  {part}: {mean(effects):+.2f} points of the delta on average (from {min(effects):+.2f} to"
                  f" {max(effects):+.2f} over the {len(effects)} pairs of cells that differ only by it; < 0: it helps)")
    if noise is not None:
        print(f"  noise, from {noise['seeds']} seeds (init, batches and SR draws all change with --seed): {plain}'s"
              f" val loss {noise['base_mean']:.4f} ± {noise['base_spread']:.2f}% (std) across seeds; {noise['cell']}'s"
              f" delta against the same seed's {plain} {', '.join(f'{d:+.2f}%' for d in noise['deltas'])}, σ_Δ ="
              f" {noise['sigma']:.2f} points: a delta beyond 2σ_Δ = {2 * noise['sigma']:.2f} points is marked"
              f" above noise")
    if "fp32 (reference)" in delta:
        print(f"  fp32 lands {delta['fp32 (reference)']:+.2f}% from bf16 on the same init and batches")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per cell")
    p.add_argument("--batch", type=int, default=4, help="sequences per step (of the preset's 256 tokens)")
    p.add_argument("--eval-batches", type=int, default=8, help="val batches for the final loss (the same in all)")
    p.add_argument("--preset", default="small")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--sqnr-n", type=int, default=4096, help="the SQNR tensors are randn(n, n)")
    p.add_argument("--jobs", type=int, default=2, help="cells trained at once (after the baseline, unless the"
                   " token cache is there already)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"), help="the compute dtype (the baseline and"
                   " what the recipes dequantise to); fp32 where the CPU has no fast bf16 GEMM")
    p.add_argument("--noise-seeds", type=int, default=0, help="rerun the baseline and the NVFP4 SR cell with this"
                   " many other seeds: the spread of the paired delta says which deltas are above noise")
    p.add_argument("--threads", type=int, help="OMP threads of each train.py run (default: cores / jobs)")
    p.add_argument("--out-dir", default=os.path.join("out", "bench_precision"),
                   help="the token cache and each cell's metrics file (default under ./out)")
    p.add_argument("--table-only", action="store_true", help="print the table of what an earlier run left in"
                   " --out-dir (the same flags), training nothing")
    p.add_argument("--only", default="", help="run only the cells whose label matches this regex (and the baseline)")
    p.add_argument("--speed-steps", type=int, default=3, help="steps per cell of the before/after cost (0: skip)")
    p.add_argument("--speed-only", action="store_true", help="print the SQNR and the before/after cost only")
    p.add_argument("--smoke", action="store_true", help="`tiny`, 4 steps, two cells, SQNR at 256²")
    args = p.parse_args()
    if args.smoke:
        args.steps, args.batch, args.eval_batches, args.preset, args.sqnr_n = 4, 2, 1, "tiny", 256
        args.speed_steps = 1
    args.out_dir = os.path.abspath(args.out_dir)
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // args.jobs)
    os.makedirs(args.out_dir, exist_ok=True)
    start = time.perf_counter()
    print_sqnr(args.sqnr_n)
    if args.speed_steps:
        print()
        print_speed(args.preset, args.batch, args.speed_steps)
    if args.speed_only:
        return
    rows = [row for row in cells(args.smoke, args.dtype, args.seed, args.noise_seeds)
            if row[0] == args.dtype or re.search(args.only, row[0])]
    print(f"\nablation: `{args.preset}`, {args.steps} steps of {args.batch} sequences, one init (seed {args.seed}),"
          f" the same batches; val loss over {args.eval_batches} batches after the last step; {args.dtype} compute;"
          f" {len(rows)} cells, {args.jobs} at a time of {args.threads} threads")
    def run(row):
        r = run_cell(row[0], row[3], args)
        print(f"  ran {row[0]}: {r['seconds']:.0f} s" + (f" ({r['error']})" if "error" in r else ""), flush=True)
        return r

    cached = os.path.isdir(os.path.join(args.out_dir, "data")) and os.listdir(os.path.join(args.out_dir, "data"))
    done = {} if cached and not args.table_only else {rows[0][0]: run(rows[0])}  # alone: it writes the token cache
    with ThreadPoolExecutor(args.jobs) as pool:  # threads that wait on train.py processes, the dearest first
        futures = {row[0]: pool.submit(run, row) for row in sorted([r for r in rows if r[0] not in done],
                                                                    key=lambda row: -emulation_cost(row))}
        done.update({label: future.result() for label, future in futures.items()})
    results = [done[row[0]] for row in rows]
    print()
    noise = noise_estimate(results, args)
    print_table(results, rows, args, noise)
    print_verdict(results, args, noise)
    print(f"wall time {time.perf_counter() - start:.0f} s (python bench/bench_precision.py {' '.join(sys.argv[1:])})")
    failed = [r["label"] for r in results if "error" in r]
    if failed:
        raise SystemExit(f"{len(failed)} cell(s) failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
