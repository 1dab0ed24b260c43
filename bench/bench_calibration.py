"""The time model against published runs: fitted to Narayanan et al. 2021, Table 1; checked on runs held out.

    python bench/bench_calibration.py            # both tables, each row's plan.py command under it
    python bench/bench_calibration.py --smoke    # the first row of each table
    python bench/bench_calibration.py --datasheet  # the uncalibrated model (planner/calibration.py: DATASHEET)

Every row is one command line: `python plan.py <the flags printed under it>` plans it (the bench builds its roles
the same way, plan.plan_roles) and prints its step and TFLOP/s per GPU. The plan's step is its slowest role's
predicted step; the rows are GPT on A100-80GB (hardware.PRESETS["a100"]), s = 2048, and the attention kernel of
Megatron's 2021-22 runs, --attention-kernel math (softmax and its dropout read and write the s×s scores).

Fitted (ROWS): Table 1's ten rows, V = 51,200, fp16, full recompute, the tensor/pipeline sizes, micro-batch and
virtual stages of NVIDIA's examples/sc21/run_table_1.sh (Megatron-LM, 2021: interleaved where it sets
--num-layers-per-virtual-pipeline-stage, v = L / P / that). The published figure is TFLOP/s per GPU by the
paper's count (eq. 3), which is the plan's hardware FLOPs with full recompute:

    F = 96 · B · s · l · h² · (1 + s / (6h) + V / (16 · l · h))   FLOPs per iteration (recompute included)
    predicted TFLOP/s per GPU = F / (GPUs · step)

Held out (HELD_OUT), planned with the same constants, none refitted; the published figure is seconds per
iteration and the ratio predicted over published throughput (published step / predicted step):
- Korthikanti et al. 2022 (arXiv 2205.05198): Table 3's layouts (22B, 175B, 530B, 1T: T = 8, P = 1, 8, 35, 64,
  B = 4, 64, 280, 512, B_μ = 4, 1, 1, 1, no data parallelism), §6 (s = 2048, V = 51,200, interleaved with 3
  stages for 175B and 530B, A100-80GB on Selene), Table 5's iteration times with sequence parallelism and
  selective recompute ("present work") and with full recompute; §6.3: 530B on 8 data-parallel replicas (2,240
  GPUs, B = 2,240): 39.15 s.
- Smith et al. 2022, MT-NLG 530B (arXiv 2201.11990, §2.4; the figures as cli99/llm-analysis's
  examples/megatron-turing-nlg README quotes them): batch 1,920 on 280, 350 and 420 DGX A100 nodes, 60.1, 50.2
  and 44.4 s per iteration (126, 121, 113 TFLOP/s by eq. 3); T = 8, P = 35 (DeepSpeed's 1F1B), 105 layers of
  20,480, 128 heads. Assumed here: B_μ = 1, full recompute, no ZeRO, V = GPT-2's 50,257 padded by Megatron to
  51,200, bf16; DeepSpeed's pipeline engine's blocking p2p, --pp-p2p blocking (deepspeed/runtime/pipe/p2p.py: its
  send and recv refuse async_op).
- BLOOM 176B (bigscience-workshop/bigscience, train/tr11-176B-ml/README.md: 70 layers of 14,336, 112 heads,
  V = 250,880, T = 4, P = 12, D = 8, B_μ = 2, B = 2,048, ZeRO-1, bf16, activation checkpointing, 48 nodes of 8
  A100-80GB with 4 Omni-Path links: 4 × 100 Gb/s a node, --hw-inter-gbps 6.25 a GPU; chronicles.md, 2022-03-18:
  105.22 s per iteration, 149.02 TFLOP/s by eq. 3).
KNOWN_MISSES names the rows outside ±15% and why (tests/planner/test_calibration.py holds them to their band).
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
import planner.formulas  # noqa: E402
from planner import hardware, time_model  # noqa: E402
import train  # noqa: E402
from planner.calibration import CALIBRATED, DATASHEET, RANGES  # noqa: E402

SEQ, VOCAB = 2048, 51200
ATTENTION_KERNEL = "math"  # Megatron 2021-22: softmax and dropout on the s×s scores through HBM (unfused)
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


def gpt_argv(layers: int, hidden: int, heads: int, vocab: int = VOCAB) -> list:
    """A GPT of the given shape at s = 2048 (gpt3-1.3b's preset with its sizes replaced), dropout 0.1, on A100s,
    priced with the unfused attention of Megatron's runs."""
    return ["--preset", "gpt3-1.3b", "--n-layer", str(layers), "--n-embd", str(hidden), "--n-head", str(heads),
            "--seq-len", str(SEQ), "--vocab-size", str(vocab), "--dropout", "0.1", "--hw", "a100",
            "--attention-kernel", ATTENTION_KERNEL]


def layout_argv(gpus: int, tp: int, pp: int, v: int, batch: int, micro: int, recompute: str = "full",
                sp: bool = False, zero: int = 0, dtype: str = "fp16") -> list:
    argv = ["--world", str(gpus), "--tp", str(tp), "--pp", str(pp), "--global-batch", str(batch), "--micro-batch",
            str(micro), "--activation-checkpointing", recompute, "--dtype", dtype]
    argv += ["--sp"] if sp else []
    argv += ["--zero", str(zero)] if zero else []
    if pp > 1:
        argv += ["--pp-schedule", "interleaved", "--pp-virtual", str(v)] if v > 1 else ["--pp-schedule", "1f1b"]
    return argv


def row_argv(row) -> list:
    name, heads, hidden, layers, tp, pp, gpus, batch, micro, v, _ = row
    return gpt_argv(layers, hidden, heads) + layout_argv(gpus, tp, pp, v, batch, micro)


def _korthikanti(name, heads, hidden, layers, pp, v, gpus, batch, micro, present, full):
    """Table 5's two rows of one Table 3 model: SP + selective recompute ("present work"), and full recompute."""
    source = "Korthikanti et al. 2022, Tables 3 and 5"
    return [(f"{name} SP+sel", source, gpt_argv(layers, hidden, heads)
             + layout_argv(gpus, 8, pp, v, batch, micro, "selective", sp=True), present),
            (f"{name} full", source, gpt_argv(layers, hidden, heads) + layout_argv(gpus, 8, pp, v, batch, micro), full)]


_MT_NLG = gpt_argv(105, 20480, 128)
# (name, source, plan.py flags, published seconds per iteration)
HELD_OUT = [
    *_korthikanti("22B", 64, 6144, 48, 1, 1, 8, 4, 4, 1.10, 1.42),
    *_korthikanti("175B", 96, 12288, 96, 8, 3, 64, 64, 1, 13.75, 18.13),
    *_korthikanti("530B", 128, 20480, 105, 35, 3, 280, 280, 1, 37.83, 49.05),
    *_korthikanti("1T", 160, 25600, 128, 64, 1, 512, 512, 1, 71.49, 94.42),
    ("530B D=8 SP+sel", "Korthikanti et al. 2022, §6.3", gpt_argv(105, 20480, 128)
     + layout_argv(2240, 8, 35, 3, 2240, 1, "selective", sp=True), 39.15),
    *((f"MT-NLG {gpus}", "Smith et al. 2022, §2.4", _MT_NLG + layout_argv(gpus, 8, 35, 1, 1920, 1, dtype="bf16")
       + ["--pp-p2p", "blocking"], seconds) for gpus, seconds in ((2240, 60.1), (2800, 50.2), (3360, 44.4))),
    ("BLOOM 176B", "BigScience tr11 README, chronicles", gpt_argv(70, 14336, 112, 250880)
     + layout_argv(384, 4, 12, 1, 2048, 2, zero=1, dtype="bf16") + ["--hw-inter-gbps", "6.25"], 105.22),
]
# Rows outside ±15%, and why: DeepSpeed's 2021 pipeline engine ran MT-NLG's layout 16-21% slower than the model
# prices it with its blocking p2p (Megatron's own 2021-22 runs of the same 530B shape fit within 2%): the fp32
# gradient accumulation after every micro-batch, a term this model lacks and no source here states for MT-NLG,
# would account for most of the rest (README, the plan section).
KNOWN_MISSES = {"MT-NLG 2240": (1.15, 1.30), "MT-NLG 2800": (1.15, 1.30), "MT-NLG 3360": (1.15, 1.30)}


def paper_flops(row) -> float:
    """Eq. 3: FLOPs per iteration, B sequences of s tokens, l layers of width h, vocabulary V."""
    _, _, h, l, _, _, _, B, _, _, _ = row
    return 96 * B * SEQ * l * h * h * (1 + SEQ / (6 * h) + VOCAB / (16 * l * h))


def plan_step(argv: list, calibration=None, build: bool = True) -> tuple:
    """(the slowest role's predicted step, the plan's (wall, CPU) seconds) of one command line, parsed as plan.py
    parses it; its roles built on meta (plan.plan_roles), or build=False: from the search's formulas
    (planner.formulas.formula_role, equal to the built ones: tests/planner/test_plan.py), which cost far less."""
    settings = time_model.plan_settings(flags.parse(["--plan", *argv], train.AXES, prog="plan.py"))
    hw = hardware.from_flags(settings.args, time_model.plan_dtypes(settings)[0])
    hw = replace(hw, calibration=calibration) if calibration is not None else hw
    began, cpu = time.perf_counter(), time.process_time()
    roles = plan.plan_roles(settings) if build else planner.formulas.stage_roles(settings)
    layout = time_model.layout_facts(settings)
    step = max(time_model.predict(role, layout, hw).step for role in roles)
    return step, (time.perf_counter() - began, time.process_time() - cpu)


def command(argv: list, calibration) -> str:
    """The row as a user types it (the --calib-* flags too where the bench runs another set than the default)."""
    calib = [] if calibration in (None, CALIBRATED) else [
        part for name, flag, *_ in RANGES for part in (flag, f"{getattr(calibration, name):g}")]
    return "python plan.py " + " ".join([*argv, *calib])


def constants(calibration) -> str:
    """The calibration's flag constants (`RANGES` of planner/calibration.py), as `--calib-*` sets them."""
    return ", ".join(f"{name} {getattr(calibration, name):g}" for name, *_ in RANGES)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="the first row of each table")
    parser.add_argument("--datasheet", action="store_true", help="the uncalibrated model (every fraction 1)")
    args = parser.parse_args(argv)
    calibration = DATASHEET if args.datasheet else CALIBRATED
    rows, held_out = (ROWS[:1], HELD_OUT[:1]) if args.smoke else (ROWS, HELD_OUT)
    print(f"Fitted: Narayanan et al. 2021, Table 1 on the {'datasheet' if args.datasheet else 'calibrated'} time"
          f" model ({constants(calibration)}); published and predicted TFLOP/s per GPU (eq. 3)")
    print(f"{'row':>8} {'GPUs':>5} {'T':>2} {'P':>3} {'v':>2} {'B_μ':>3} {'published':>9} {'predicted':>9}"
          f" {'ratio':>6} {'plan s':>7} {'CPU s':>6}")
    ratios = []
    for row in rows:
        step, (wall, cpu) = plan_step(row_argv(row), calibration)
        tflops = paper_flops(row) / (row[6] * step) / 1e12
        ratios.append(tflops / row[-1])
        print(f"{row[0]:>8} {row[6]:>5} {row[4]:>2} {row[5]:>3} {row[9]:>2} {row[8]:>3} {row[-1]:>9}"
              f" {tflops:>9.1f} {ratios[-1]:>6.2f} {wall:>7.1f} {cpu:>6.1f}")
        print(f"         {command(row_argv(row), calibration)}")
    within = sum(abs(r - 1) <= 0.15 for r in ratios)
    print(f"predicted / published: {min(ratios):.2f}–{max(ratios):.2f}, {within} of {len(ratios)} rows within ±15%")
    print("\nHeld out, the same constants: published and predicted seconds per iteration; ratio = published /"
          " predicted step (predicted / published throughput)")
    print(f"{'row':>16} {'GPUs':>5} {'published':>9} {'predicted':>9} {'ratio':>6} {'plan s':>7}  source")
    held = []
    for name, source, row, published in held_out:
        step, (wall, _) = plan_step(row, calibration)
        held.append(published / step)
        miss = " (a known miss: KNOWN_MISSES)" if name in KNOWN_MISSES else ""
        print(f"{name:>16} {row[row.index('--world') + 1]:>5} {published:>9.2f} {step:>9.2f} {held[-1]:>6.2f}"
              f" {wall:>7.1f}  {source}{miss}")
        print(f"         {command(row, calibration)}")
    within = sum(abs(r - 1) <= 0.15 for r in held)
    print(f"held out, published / predicted step: {min(held):.2f}–{max(held):.2f}, {within} of {len(held)} rows"
          f" within ±15%")


if __name__ == "__main__":
    main()
