"""The Mixed Precision Scaling Laws ablation (issue 42): forward {bf16, 4/6 + 1-D, 2-D} × backward {bf16, MS-EDEN,
RHT + SR, SR}, several seeds per cell, with the noise of every cell's delta measured.

    python bench/bench_precision.py --dtype fp32                       # the grid, `mini` with 2 layers, 3 seeds
    python bench/bench_precision.py --dtype fp32 --steps 40 --seeds 2  # what 28 minutes allowed here (see README)
    python bench/bench_precision.py --table-only ...                   # the table again from what out/ holds
    python bench/bench_precision.py --smoke                            # `tiny`, 2 steps, two cells: checks it runs

It prints, in order:
  1. the formats' round-trip SQNR on randn(n, n) and on Student-t data (3 degrees of freedom: heavy tails) against
     the fp32 tensor: MXFP8, MXFP4, plain NVFP4 and NVFP4 with Four Over Six (precision/quartet.py), torchao's
     thresholds beside the first three; then MS-EDEN's relative MSE against stochastic rounding's on the same
     inputs (SR as this repository rounds, the block max at 6; and as Quartet II's baseline, the block max at
     6·16/17), and round-to-nearest's for scale;
  2. the ablation: each cell one `python train.py` process (--precision-recipe: forward 4/6 + 1-D =
     fwd=nvfp4,4over6, 2-D = fwd=nvfp4,w2d; backward MS-EDEN = bwd=nvfp4,eden, RHT + SR = bwd=nvfp4,sr,rht, SR =
     bwd=nvfp4,sr), for each of --seeds seeds (a seed changes the init, the batches and every draw); a cell's
     delta is paired: its val loss against the baseline's of the same seed, in % of it. Per cell the mean delta,
     σ (the standard deviation of the paired delta over the seeds), σ/√seeds (the mean's), whether the mean is
     beyond 2σ/√seeds, non-finite steps, the saturated share (X/W/dY), s/step, the share of FLOPs in NVFP4 and
     B200's format-weighted peak against bf16's (accounting/format_flops.py);
  3. the noise: σ pooled over the cells, at the last step and at the halfway evaluation, the steps that
     2σ < 0.5 points would need (a power law through those two points: an extrapolation, stated as one) and
     the seeds that would do it at this length (σ/√seeds: (2σ/0.5)²);
  4. the verdict: the forward-only cells against the backward-only ones (the paper: forward +0.94–1.22%,
     backward +0.32–0.72%), and 4/6 + 1-D against 2-D over the backward columns where both ran, each with its σ,
     "resolved" only beyond 2σ.
A measurement, not a timed test. On a GPU without block-scaled GEMMs (all before Blackwell) and on CPUs the
formats are emulated (quantise → dequantise → a GEMM in the compute dtype): s/step is the emulation's.
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
from precision import microscaling, microscaling_fast, quartet  # noqa: E402
import precision.recipe  # noqa: E402
from model import GPT, config_from_preset  # noqa: E402

# The ablation's axes: a name in the table -> (the parts of --precision-recipe it adds, the format of its GEMMs)
FORWARD = {"bf16": ((), "bf16"), "4/6+1-D": (("fwd=nvfp4", "4over6"), "nvfp4"), "2-D": (("fwd=nvfp4", "w2d"), "nvfp4")}
BACKWARD = {"bf16": ((), "bf16"), "MS-EDEN": (("bwd=nvfp4", "eden"), "nvfp4"),
            "RHT+SR": (("bwd=nvfp4", "sr", "rht"), "nvfp4"), "SR": (("bwd=nvfp4", "sr"), "nvfp4")}
THRESHOLDS_DB = {"mxfp8": 18.0, "mxfp4": 13.0, "nvfp4": 8.0}  # torchao's tests
PAPER = "Qwen3 430M, 12.8B tokens: forward-only +0.94–1.22%, backward-only +0.32–0.72% over bf16"
TARGET = 0.5  # points: 2σ of a delta should be below this to tell the paper's effects apart


# --- 1. Round-trip SQNR --------------------------------------------------------------------------------------

def _student_t(n: int, generator) -> torch.Tensor:
    """Student-t with 3 degrees of freedom, z/√(χ²₃/3): heavy tails."""
    chi2 = torch.randn(3, n, n, generator=generator).square().sum(0) / 3
    return torch.randn(n, n, generator=generator) / chi2.sqrt()


def sqnr_table(n: int) -> dict:
    """{data: {format: dB}}: each format's round trip on randn(n, n) and Student-t(3) against the fp32 tensor."""
    generator = torch.Generator().manual_seed(0)
    table = {}
    for data, x in (("randn", torch.randn(n, n, generator=generator)), ("student-t3", _student_t(n, generator))):
        row = {name: microscaling.sqnr_db(x, microscaling.fake_quantize(x, name))
               for name in ("mxfp8", "mxfp4", "nvfp4")}
        row["nvfp4 4/6"] = microscaling.sqnr_db(x, quartet.four_over_six(x).values)
        table[data] = row
    return table


def eden_errors(rows: int, cols: int, group: int) -> dict:
    """{data: {quantiser: relative MSE}} on randn and Student-t(3) [rows, cols] (float64): MS-EDEN (rotated back),
    SR (block max at 6), SR as Quartet II's baseline (block max at 6·16/17: the tensor amax given ×17/16), RHT + SR
    (the same rotation, then SR), round-to-nearest."""
    generator = torch.Generator().manual_seed(1)
    out = {}
    for data, x in (("randn", torch.randn(rows, cols, generator=generator)),
                    ("student-t3", _student_t(max(rows, cols), generator)[:rows, :cols])):
        x = x.double()
        hadamard = microscaling.random_hadamard(group, generator).double()

        def back(y):  # the rotation's inverse: each group times (diag(s)·H/√G)ᵀ
            return (y.reshape(rows, -1, group) @ (hadamard.t() / math.sqrt(group))).reshape(rows, cols)

        def relative(estimate):
            return (estimate - x).square().sum().item() / x.square().sum().item()

        def uniform():
            return torch.rand(x.shape, generator=generator, dtype=torch.float64)

        draws = torch.rand(rows, cols // 16, generator=generator, dtype=torch.float64)
        nvfp4 = microscaling.FORMATS["nvfp4"]
        out[data] = {
            "MS-EDEN": relative(back(quartet.ms_eden(x, hadamard, draws).values)),
            "SR": relative(microscaling.fake_quantize(x, nvfp4, stochastic=uniform())),
            "SR, max at 6·16/17": relative(microscaling.fake_quantize(x, nvfp4, stochastic=uniform(),
                                                                      tensor_amax=x.abs().max() * 17 / 16)),
            "RHT + SR": relative(back(microscaling.fake_quantize(microscaling.hadamard_blocks(x, hadamard), nvfp4,
                                                                 stochastic=uniform()))),
            "round to nearest": relative(microscaling.fake_quantize(x, nvfp4))}
    return out


def print_sqnr(n: int, group: int) -> None:
    table = sqnr_table(n)
    names = list(next(iter(table.values())))
    print(f"round-trip SQNR against fp32 ({n}×{n}; torchao's thresholds on randn: MXFP8 ≥ 18, MXFP4 ≥ 13,"
          f" NVFP4 ≥ 8 dB):")
    print(f"  {'data':<12}" + "".join(f"{name:>12}" for name in names))
    for data, row in table.items():
        print(f"  {data:<12}" + "".join(f"{row[name]:9.2f} dB" for name in names))
    below = [name for name, threshold in THRESHOLDS_DB.items() if table["randn"][name] < threshold]
    print("  torchao's thresholds: " + ("all met" if not below else f"WRONG: below for {', '.join(below)}"))
    rows, cols = max(group, n // 8), max(4 * group, n // 2)
    errors = eden_errors(rows, cols, group)
    print(f"MS-EDEN against stochastic rounding, relative MSE ‖x̂ − x‖²/‖x‖² on the same [{rows}, {cols}] inputs"
          f" (rotation group {group}; the paper: MS-EDEN > 2× lower than SR):")
    for data, row in errors.items():
        ratios = ", ".join(f"{name} {value:.3e} ({value / row['MS-EDEN']:.2f}×)" for name, value in row.items())
        print(f"  {data:<12} {ratios}")


# --- 1b. What the emulation costs a step: the reference quantiser against the fast one -------------------------

def _reference_fake_quantize(x, fmt, rule="rceil", two_d=False, draws=None, tensor_amax=None, count_saturated=False):
    """microscaling.fake_quantize behind microscaling_fast's signature: the quantiser the recipe used before."""
    fmt = microscaling.FORMATS[fmt] if isinstance(fmt, str) else fmt
    return microscaling.fake_quantize(x, fmt, rule, two_d, draws, tensor_amax if fmt.scale == "e4m3" else None,
                                      count_saturated)


def step_seconds(config, spec: str | None, batch: int, steps: int, reference: bool) -> float:
    """The mean wall seconds of `steps` forward + backward passes (after one warm-up) of `config` in fp32 with
    --precision-recipe `spec` (None: none), on random tokens; reference: NVFP4/MX's quantiser as the recipe ran it
    before precision/microscaling_fast.py (float64 NVFP4, a new tensor per operation)."""
    torch.manual_seed(0)
    model = GPT(config)
    if spec:
        precision.recipe.convert(model, precision.recipe.parse_recipe(spec))
    tokens = torch.randint(0, config.vocab_size, (batch, config.block_size + 1))
    saved = microscaling_fast.fake_quantize
    if reference:
        microscaling_fast.fake_quantize = _reference_fake_quantize
    try:
        times = []
        for _ in range(steps + 1):
            start = time.perf_counter()
            _, loss, count = model(tokens[:, :-1], tokens[:, 1:])
            (loss / count).backward()
            times.append(time.perf_counter() - start)
    finally:
        microscaling_fast.fake_quantize = saved
    return sum(times[1:]) / steps


def print_speed(config, batch: int, steps: int, rotation: int) -> None:
    """s/step of each cell with the fast quantiser (and, where it runs NVFP4 by microscaling_fast, the reference
    one beside it), alternated so that a loaded machine slows both alike; the unquantised run for scale."""
    print(f"the emulation's cost: {batch}×{config.block_size} tokens, fp32, forward + backward, mean of {steps}"
          f" steps after a warm-up, one thread")
    print(f"  {'unquantised':<36} {step_seconds(config, None, batch, steps, reference=False):7.2f} s/step")
    for fwd, bwd in grid(rotation):
        spec = recipe_spec(fwd, bwd, rotation)
        after = step_seconds(config, spec, batch, steps, reference=False)
        before = step_seconds(config, spec, batch, steps, reference=True)
        print(f"  {cell_label(fwd, bwd, 'fp32'):<36} {after:7.2f} s/step (the float64 reference quantiser for"
              f" NVFP4/MX: {before:.2f})", flush=True)


# --- 2. The ablation: one train.py process per cell and seed ------------------------------------------------------

def grid(rotation: int, smoke: bool = False) -> list:
    """[(forward, backward)] of the quantised cells, the baseline (bf16 × bf16) left out."""
    if smoke:
        return [("4/6+1-D", "MS-EDEN")]
    return [(f, b) for f in FORWARD for b in BACKWARD if (f, b) != ("bf16", "bf16")]


def recipe_spec(fwd: str, bwd: str, rotation: int) -> str:
    parts = FORWARD[fwd][0] + BACKWARD[bwd][0]
    return ",".join(parts + ((f"rotation={rotation}",) if "eden" in parts and rotation != quartet.EDEN_GROUP else ()))


def cell_label(fwd: str, bwd: str, dtype: str) -> str:
    """A cell's name in the table: the unquantised side is named by the compute dtype."""
    return f"fwd {dtype if fwd == 'bf16' else fwd} × bwd {dtype if bwd == 'bf16' else bwd}"


def runs(args) -> list:
    """[(cell label, forward, backward, seed, train.py flags)]: the baseline and every cell, for each seed."""
    cells = [(args.dtype, "bf16", "bf16", [])]
    cells += [(cell_label(f, b, args.dtype), f, b, ["--precision-recipe", recipe_spec(f, b, args.rotation)])
              for f, b in grid(args.rotation, args.smoke)]
    return [(label, f, b, args.seed + k, flags + ["--seed", str(args.seed + k)])
            for k in range(args.seeds) for label, f, b, flags in cells]


def run_cell(label: str, seed: int, flags: list, args) -> dict:
    """Train one cell with train.py in its own process (its printout kept in <out-dir>/<cell>.log, its steps in
    <cell>.jsonl), then read it; with --table-only just read what an earlier run left."""
    name = re.sub(r"[^a-z0-9]+", "_", f"{label} seed {seed}".lower()).strip("_")
    metrics, log = (os.path.join(args.out_dir, f"{name}.{ext}") for ext in ("jsonl", "log"))
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--preset", args.preset, "--steps", str(args.steps),
           "--global-batch", str(args.batch), "--micro-batch", str(args.batch), "--dtype", args.dtype,
           "--eval-every", str(max(1, args.steps // 2)), "--eval-batches", str(args.eval_batches),
           "--log-every", str(args.steps), "--sample-tokens", "0", "--out-dir", args.out_dir,
           "--metrics-file", metrics, *(["--n-layer", str(args.n_layer)] if args.n_layer else []), *flags]
    start = time.perf_counter()
    if not args.table_only:
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
        with open(log, "w") as f:
            f.write(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            lines = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()
            said = [line for line in lines if re.search(r"Error\b|^error:", line.strip())] or lines
            return dict(label=label, seed=seed, error=f"exit {proc.returncode}: {said[-1].strip()[:150]}",
                        seconds=time.perf_counter() - start)
    result = dict(label=label, seed=seed, seconds=time.perf_counter() - start)
    if not (os.path.exists(metrics) and os.path.exists(log)):
        return dict(result, error=f"no {os.path.basename(metrics)} here (not run, or still running)")
    records = [json.loads(line) for line in open(metrics)]
    if "val_loss" not in records[-1]:
        return dict(result, error=f"{len(records)} of {args.steps} steps in {os.path.basename(metrics)} (unfinished)")
    evals = [r for r in records if "val_loss" in r]
    nonfinite = sum(1 for r in records if r["skipped"] or not math.isfinite(r["loss"]))
    times = [r["step_time_s"] for r in records[1:]] or [records[0]["step_time_s"]]
    return dict(result, val=evals[-1]["val_loss"], val_half=evals[0]["val_loss"] if len(evals) > 1 else None,
                half_step=evals[0]["step"], nonfinite=nonfinite, saturated=saturated_share(open(log).read()),
                step_s=sum(times) / len(times))


def saturated_share(stdout: str):
    """(X, W, dY) percent of values the casts clamped over steps 1..N-1 (the run's last saturation printout), or
    None where the run prints none (the baseline)."""
    recipe = re.findall(r"saturated since the last line.*: X ([\d.]+)%\s+W ([\d.]+)%\s+dY ([\d.]+)%", stdout)
    return tuple(float(p) for p in recipe[-1]) if recipe else None


def accounting(fwd: str, bwd: str, config) -> tuple:
    """(share of FLOPs in NVFP4, B200's format-weighted peak over its bf16 peak) of a cell's recipe."""
    flops = format_flops.flops_by_format(config, config.block_size, FORWARD[fwd][1], BACKWARD[bwd][1], "bf16")
    b200 = hardware.PRESETS["b200"]
    peaks, _ = format_flops.format_peaks(b200, flops, "bf16")
    narrow = sum(f for fmt, f in flops.items() if fmt in format_flops.NARROW) / sum(flops.values())
    return narrow, format_flops.format_weighted_peak(flops, peaks) / b200.peak("bf16")


def emulation_cost(row) -> int:
    """A run's rough cost in emulated quantisation, to start the dearest first (MS-EDEN's backward rotates and
    quantises four operands in float64, RHT + SR three; 4/6 quantises the forward's twice)."""
    _, fwd, bwd, _, _ = row
    return {"MS-EDEN": 6, "RHT+SR": 5, "SR": 4, "bf16": 0}[bwd] + {"4/6+1-D": 2, "2-D": 1, "bf16": 0}[fwd]


def _std(values: list) -> float | None:
    if len(values) < 2:
        return None
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def paired_deltas(results: list, args, key: str = "val") -> dict:
    """{cell label: {seed: 100·(cell / baseline − 1)}}: each cell against the baseline of its own seed."""
    base = {r["seed"]: r[key] for r in results if r["label"] == args.dtype and r.get(key) is not None}
    out = {}
    for r in results:
        if r["label"] != args.dtype and r.get(key) is not None and r["seed"] in base:
            out.setdefault(r["label"], {})[r["seed"]] = 100 * (r[key] / base[r["seed"]] - 1)
    return out


def cell_stats(deltas: dict) -> dict:
    """{cell: (seeds, mean Δ, σ of Δ over the seeds or None, σ/√seeds or None)}."""
    out = {}
    for label, by_seed in deltas.items():
        values = list(by_seed.values())
        sigma = _std(values)
        out[label] = (len(values), sum(values) / len(values), sigma,
                      None if sigma is None else sigma / math.sqrt(len(values)))
    return out


def pooled_sigma(stats: dict) -> float | None:
    """√(mean σ²) over the cells that have a σ (equal seeds each: the pooled variance)."""
    sigmas = [s for _, _, s, _ in stats.values() if s is not None]
    return math.sqrt(sum(s * s for s in sigmas) / len(sigmas)) if sigmas else None


def print_table(results: list, args, config) -> dict:
    stats = cell_stats(paired_deltas(results, args))
    by_label: dict = {}
    for r in results:
        by_label.setdefault(r["label"], []).append(r)
    base = [r["val"] for r in by_label.get(args.dtype, []) if "error" not in r]
    print(f"{'cell':<32} {'seeds':>5} {'val loss':>9} {f'Δ vs {args.dtype}':>10} {'σ':>6} {'σ/√n':>6}"
          f" {'> 2σ/√n':>7} {'non-finite':>10} {'sat X/W/dY':>16} {'s/step':>7} {'NVFP4 FLOPs':>11}"
          f" {'B200 P_w/bf16':>13}")
    if base:
        print(f"{args.dtype:<32} {len(base):>5} {sum(base) / len(base):9.4f} {'—':>10}")
    labels = [cell_label(f, b, args.dtype) for f, b in grid(args.rotation, args.smoke)]
    for (f, b), label in zip(grid(args.rotation, args.smoke), labels):
        rows = [r for r in by_label.get(label, []) if "error" not in r]
        failed = [r for r in by_label.get(label, []) if "error" in r]
        if not rows or label not in stats:
            print(f"{label:<32} failed ({failed[0]['error'] if failed else 'no baseline of the same seed'})")
            continue
        n, mean, sigma, se = stats[label]
        shown = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
        beyond = "n/a" if se is None else ("yes" if abs(mean) > 2 * se else "no")
        sat = [r["saturated"] for r in rows if r["saturated"] is not None]
        sat = "—" if not sat else "/".join(f"{sum(c) / len(c):.2g}" for c in zip(*sat)) + "%"
        narrow, speedup = accounting(f, b, config)
        print(f"{label:<32} {n:>5} {sum(r['val'] for r in rows) / len(rows):9.4f} {mean:+9.2f}% {shown(sigma):>6}"
              f" {shown(se):>6} {beyond:>7} {sum(r['nonfinite'] for r in rows):>10} {sat:>16}"
              f" {sum(r['step_s'] for r in rows) / len(rows):7.2f} {narrow:>11.0%} {speedup:>12.2f}×"
              + (f"  ({len(failed)} failed)" if failed else ""))
    return stats


def print_noise(results: list, args, stats: dict) -> None:
    """σ pooled over the cells at the end and at the halfway evaluation; the steps that 2σ < TARGET would need
    (σ ∝ steps^a through the two points) and the seeds that would do it at this length."""
    end = pooled_sigma(stats)
    half_stats = cell_stats(paired_deltas(results, args, "val_half"))
    half = pooled_sigma(half_stats)
    if end is None:
        print("noise: one seed per cell, no σ (run --seeds 2 or more)")
        return
    half_step = next((r["half_step"] for r in results if r.get("half_step") is not None), None)
    print(f"noise: σ of a cell's paired delta, pooled over {len(stats)} cells of {args.seeds} seeds: {end:.2f} points"
          f" at step {args.steps}" + (f", {half:.2f} at step {half_step}" if half is not None else "")
          + f"; 2σ = {2 * end:.2f} points against the {TARGET} the paper's effects need")
    seeds = math.ceil((2 * end / TARGET) ** 2)
    print(f"  seeds per cell for 2σ/√seeds < {TARGET} at {args.steps} steps: {seeds} (σ/√n of a mean over seeds)")
    if half is None or not half_step or half <= 0 or end <= 0:
        return
    exponent = math.log(end / half) / math.log(args.steps / half_step)
    if exponent >= 0:
        print(f"  steps for 2σ < {TARGET}: not extrapolated (σ grew from step {half_step} to {args.steps},"
              f" σ ∝ steps^{exponent:+.2f}: this length is still in the optimiser's early transient)")
    else:
        steps = args.steps * (TARGET / 2 / end) ** (1 / exponent)
        print(f"  steps for 2σ < {TARGET}: about {steps:,.0f} (σ ∝ steps^{exponent:.2f} through the two points: an"
              f" extrapolation from two points of one schedule, the halfway one before the cosine decay)")


def _per_seed_mean(deltas: dict, labels: list) -> dict:
    """{seed: mean of the listed cells' deltas} over the seeds where all of them ran."""
    seeds = set.intersection(*(set(deltas.get(label, {})) for label in labels)) if labels else set()
    return {k: sum(deltas[label][k] for label in labels) / len(labels) for k in seeds}


def _contrast(first: dict, second: dict) -> tuple | None:
    """(mean of first − second over the common seeds, its σ/√n or None, n), or None without a common seed."""
    common = sorted(set(first) & set(second))
    if not common:
        return None
    differences = [first[k] - second[k] for k in common]
    sigma = _std(differences)
    return sum(differences) / len(differences), None if sigma is None else sigma / math.sqrt(len(common)), len(common)


def print_verdict(results: list, args) -> None:
    """Forward-only against backward-only; 4/6 + 1-D against 2-D over the backward columns where both ran."""
    deltas, dtype = paired_deltas(results, args), args.dtype
    forward = [cell_label(f, "bf16", dtype) for f in FORWARD if f != "bf16"]
    backward = [cell_label("bf16", b, dtype) for b in BACKWARD if b != "bf16"]
    forward, backward = [c for c in forward if c in deltas], [c for c in backward if c in deltas]

    def verdict(name, contrast, positive, negative):
        if contrast is None:
            return f"{name}: not measured (no common seed)"
        mean, se, n = contrast
        if se is None:
            return f"{name}: {mean:+.2f} points over {n} seed (one seed: no σ, not resolved)"
        answer = (positive if mean > 0 else negative) if abs(mean) > 2 * se else "not resolved"
        return f"{name}: {mean:+.2f} ± {se:.2f} points (σ/√n over {n} seeds): {answer}"

    if forward and backward:
        f_mean, b_mean = _per_seed_mean(deltas, forward), _per_seed_mean(deltas, backward)
        print(verdict("forward-only minus backward-only cells (mean deltas)", _contrast(f_mean, b_mean),
                      "the forward is the more sensitive, as in the paper", "the backward is the more sensitive,"
                      " unlike the paper") + f"; the {PAPER}")
    pairs = [(cell_label("4/6+1-D", b, dtype), cell_label("2-D", b, dtype)) for b in BACKWARD]
    pairs = [(a, c) for a, c in pairs if a in deltas and c in deltas]
    if pairs:
        four_six = {k: sum(deltas[a][k] for a, _ in pairs) / len(pairs)
                    for k in set.intersection(*(set(deltas[a]) & set(deltas[c]) for a, c in pairs))}
        two_d = {k: sum(deltas[c][k] for _, c in pairs) / len(pairs) for k in four_six}
        print(verdict(f"4/6 + 1-D minus 2-D (over {len(pairs)} backward columns)", _contrast(four_six, two_d),
                      "2-D is better here, unlike the paper", "4/6 + 1-D is better, as in the paper")
              + " (the paper: 4/6 + 1-D +0.94% against 2-D +1.22% with a bf16 backward)")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=100, help="optimizer steps per run (default 100)")
    p.add_argument("--batch", type=int, default=4, help="sequences per step (default 4)")
    p.add_argument("--eval-batches", type=int, default=32, help="val batches for each evaluation, the same in all"
                   " runs (default 32)")
    p.add_argument("--preset", default="mini", help="the model (default mini: 128 wide, 128 tokens)")
    p.add_argument("--n-layer", type=int, default=2, help="its layers (default 2; 0: the preset's)")
    p.add_argument("--seed", type=int, default=1337, help="the first seed (default 1337)")
    p.add_argument("--seeds", type=int, default=3, help="seeds per cell, the baseline's too (default 3)")
    p.add_argument("--rotation", type=int, default=quartet.EDEN_GROUP, help="MS-EDEN's rotation group (default 128)")
    p.add_argument("--sqnr-n", type=int, default=4096, help="the SQNR tensors are n×n (default 4096)")
    p.add_argument("--jobs", type=int, default=2, help="runs trained at once (default 2)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"), help="the compute dtype (the baseline and"
                   " what the recipes dequantise to; default bf16); fp32 where the CPU has no fast bf16 GEMM")
    p.add_argument("--threads", type=int, help="OMP threads of each train.py run (default: cores / jobs)")
    p.add_argument("--out-dir", default=os.path.join("out", "bench_precision"),
                   help="the token cache and each run's metrics file (default out/bench_precision)")
    p.add_argument("--table-only", action="store_true", help="print the tables of what an earlier run left in"
                   " --out-dir (the same flags), training nothing")
    p.add_argument("--speed-steps", type=int, default=0, help="steps per cell of the emulation's cost (default 0:"
                   " skip)")
    p.add_argument("--smoke", action="store_true", help="`tiny`, 2 steps, one seed, two cells, SQNR at 256²")
    args = p.parse_args()
    if args.smoke:
        args.steps, args.batch, args.eval_batches, args.preset, args.sqnr_n = 2, 2, 1, "tiny", 256
        args.seeds, args.rotation, args.n_layer, args.speed_steps = 1, 32, 0, min(args.speed_steps, 1)
    args.out_dir = os.path.abspath(args.out_dir)
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // args.jobs)
    os.makedirs(args.out_dir, exist_ok=True)
    config = config_from_preset(args.preset, n_layer=args.n_layer or None)
    start = time.perf_counter()
    print_sqnr(args.sqnr_n, args.rotation)
    if args.speed_steps:
        print()
        print_speed(config, args.batch, args.speed_steps, args.rotation)
    rows = runs(args)
    print(f"\nablation: `{args.preset}` ({config.n_layer} layers, {config.n_embd} wide), {args.steps} steps of"
          f" {args.batch}×{config.block_size} tokens, {args.seeds} seed(s) from {args.seed} (init, batches, draws);"
          f" val loss over {args.eval_batches} batches at step {max(1, args.steps // 2)} and after the last;"
          f" {args.dtype} compute; {len(rows)} runs, {args.jobs} at a time of {args.threads} thread(s)")

    def run(row):
        label, _, _, seed, flags = row
        r = run_cell(label, seed, flags, args)
        print(f"  ran {label} (seed {seed}): {r['seconds']:.0f} s" + (f" ({r['error']})" if "error" in r else ""),
              flush=True)
        return r

    cached = os.path.isdir(os.path.join(args.out_dir, "data")) and os.listdir(os.path.join(args.out_dir, "data"))
    first = [] if cached or args.table_only else [run(rows[0])]  # alone: it writes the token cache
    with ThreadPoolExecutor(args.jobs) as pool:  # threads that wait on train.py processes, the dearest first
        pending = sorted(rows[len(first):], key=lambda row: -emulation_cost(row))
        results = first + list(pool.map(run, pending))
    print()
    stats = print_table(results, args, config)
    print_noise(results, args, stats)
    print_verdict(results, args)
    print(f"wall time {time.perf_counter() - start:.0f} s (python bench/bench_precision.py {' '.join(sys.argv[1:])})")
    failed = [f"{r['label']} (seed {r['seed']})" for r in results if "error" in r]
    if failed:
        raise SystemExit(f"{len(failed)} run(s) failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
