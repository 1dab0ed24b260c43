"""The time model against published runs: Narayanan et al. 2021 (SC21), Table 1, planned by plan.py.

    python bench/bench_calibration.py            # all ten rows (the 1T row builds P = 64 stages: seconds)
    python bench/bench_calibration.py --smoke    # the 1.7B row only
    python bench/bench_calibration.py --datasheet  # the uncalibrated model (planner/calibration.py: DATASHEET)

Each row is GPT on A100-80GB (hardware.PRESETS["a100"]), s = 2048, V = 51,200, fp16, full recompute, the
tensor/pipeline sizes, micro-batch and virtual stages of NVIDIA's examples/sc21/run_table_1.sh (Megatron-LM,
2021: interleaved where it sets --num-layers-per-virtual-pipeline-stage, v = L / P / that). The plan's step is
its slowest role's predicted step (the memory-bound term with the unfused attention those runs used: the
softmax and its dropout read and write the s×s scores); the achieved rate is the paper's count (eq. 3) over it:

    F = 96 · B · s · l · h² · (1 + s / (6h) + V / (16 · l · h))   FLOPs per iteration (recompute included)
    predicted TFLOP/s per GPU = F / (GPUs · step)

Printed: row, published, predicted, ratio (predicted / published), the plan's wall and CPU time (the CPU time
is the wall time of an idle machine; a loaded one stretches the wall time).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cli import flags  # noqa: E402
import plan  # noqa: E402
from planner import hardware, time_model  # noqa: E402
import train  # noqa: E402
from planner.calibration import CALIBRATED, DATASHEET, RANGES  # noqa: E402

SEQ, VOCAB = 2048, 51200
ATTENTION_KERNEL = "math"  # Megatron 2021: softmax and dropout on the s×s scores through HBM (unfused)
# (name, heads, hidden, layers, TP, PP, GPUs, global batch, micro-batch, virtual stages, published TFLOP/s/GPU):
# Table 1 of the paper; micro-batch and v from examples/sc21/run_table_1.sh (1 = not interleaved).
ROWS = [
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 16, 1, 137),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 16, 1, 138),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 16, 1, 142),
    ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 8, 1, 135),
    ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 4, 1, 138),
    ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 2, 3, 140),
    ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 2, 2, 148),
    ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 1, 2, 155),
    ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 1, 3, 163),
    ("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 1, 1, 163),
]


def row_argv(row) -> list:
    name, heads, hidden, layers, tp, pp, gpus, batch, micro, v, _ = row
    argv = ["--plan", "--world", str(gpus), "--preset", "gpt3-1.3b", "--n-layer", str(layers), "--n-embd",
            str(hidden), "--n-head", str(heads), "--seq-len", str(SEQ), "--vocab-size", str(VOCAB),
            "--global-batch", str(batch), "--micro-batch", str(micro), "--tp", str(tp), "--pp", str(pp),
            "--activation-checkpointing", "--dropout", "0.1", "--dtype", "fp16", "--hw", "a100"]
    if pp > 1:
        argv += ["--pp-schedule", "interleaved", "--pp-virtual", str(v)] if v > 1 else ["--pp-schedule", "1f1b"]
    return argv


def paper_flops(row) -> float:
    """Eq. 3: FLOPs per iteration, B sequences of s tokens, l layers of width h, vocabulary V."""
    _, _, h, l, _, _, _, B, _, _, _ = row
    return 96 * B * SEQ * l * h * h * (1 + SEQ / (6 * h) + VOCAB / (16 * l * h))


def plan_row(row, calibration) -> tuple:
    """(roles, predictions, the plan's (wall, CPU) seconds) of one row, its flags parsed as plan.py parses them, its
    roles built (plan.plan_roles), the time model's memory-bound term that of the unfused attention."""
    settings = time_model.plan_settings(flags.parse(row_argv(row), train.AXES, prog="plan.py"))
    hw = hardware.from_flags(settings.args, "fp16")
    if calibration is not None:
        hw = replace(hw, calibration=calibration)
    began, cpu = time.perf_counter(), time.process_time()
    roles = plan.plan_roles(settings)
    layout = time_model.layout_facts(settings, attention_kernel=ATTENTION_KERNEL)
    predictions = [time_model.predict(role, layout, hw) for role in roles]
    return roles, predictions, (time.perf_counter() - began, time.process_time() - cpu)


def predicted_tflops(row, predictions) -> float:
    step = max(p.step for p in predictions)
    return paper_flops(row) / (row[6] * step) / 1e12


def constants(calibration) -> str:
    """The calibration's flag constants (`RANGES` of planner/calibration.py), as `--calib-*` sets them."""
    return ", ".join(f"{name} {getattr(calibration, name):g}" for name, *_ in RANGES)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="the 1.7B row only")
    parser.add_argument("--datasheet", action="store_true", help="the uncalibrated model (every fraction 1)")
    args = parser.parse_args(argv)
    calibration = DATASHEET if args.datasheet else None
    rows = ROWS[:1] if args.smoke else ROWS
    print(f"Narayanan et al. 2021, Table 1 on the {'datasheet' if args.datasheet else 'calibrated'} time model"
          f" ({constants(DATASHEET if args.datasheet else CALIBRATED)})")
    print(f"{'row':>8} {'GPUs':>5} {'T':>2} {'P':>3} {'v':>2} {'B_μ':>3} {'published':>9} {'predicted':>9}"
          f" {'ratio':>6} {'plan s':>7} {'CPU s':>6}")
    ratios = []
    for row in rows:
        _, predictions, (wall, cpu) = plan_row(row, calibration)
        tflops = predicted_tflops(row, predictions)
        ratios.append(tflops / row[-1])
        print(f"{row[0]:>8} {row[6]:>5} {row[4]:>2} {row[5]:>3} {row[9]:>2} {row[8]:>3} {row[-1]:>9}"
              f" {tflops:>9.1f} {ratios[-1]:>6.2f} {wall:>7.1f} {cpu:>6.1f}")
    within = sum(abs(r - 1) <= 0.15 for r in ratios)
    print(f"predicted / published: {min(ratios):.2f}–{max(ratios):.2f}, {within} of {len(ratios)} rows within ±15%")


if __name__ == "__main__":
    main()
