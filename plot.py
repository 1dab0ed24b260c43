"""Draw a run's --metrics-file as PNGs: the loss, the step time by part, the memory by kind.

    python plot.py out/metrics.jsonl                 # out/metrics.loss.png, metrics.step_time.png, metrics.memory.png
    python plot.py out/metrics.jsonl --out-dir pics

It needs matplotlib (requirements.txt). It reads what the file holds (report/metrics.py writes it): every step's
loss, and the val loss where the run evaluated; the first step's "startup" figures, the time model's step split
into compute, exposed communication, pipeline bubble and update (planner/time_model.py), beside the measured step
times; the last step's "end" figures, the memory by kind (weights, gradients, optimizer state, one forward's saved
activations, the step's peak) held or measured, beside the predicted. What the file lacks (written before these
figures were, or by a run stopped before its end) is said in one line, and the picture is drawn without it, or
not at all. A resumed run appends to its file: the newest record of a step counts. Errors are one line, exit 2.

Accounting: one process, no messages; it holds the file's records.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

try:
    from matplotlib.figure import Figure
except ImportError:  # a requirement: said in one line rather than a traceback
    Figure = None

SIZE, DPI = (9.0, 4.5), 100  # every picture 900 × 450 pixels
KINDS = {"weights": "weights", "grads": "gradients", "optimizer": "optimizer", "activations": "activations\n(saved)",
         "step_peak": "step peak"}  # `report.run.MEMORY_KINDS`, as the picture labels them
PARTS = {"compute": "compute", "exposed_comm": "exposed comm", "bubble": "bubble", "update": "update"}
MIB = 2**20


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line, exit 2, as cli.flags.OneLineParser's (not imported: it would import
    the trainer, torch and all, to draw three pictures)."""

    def error(self, message: str):
        raise ValueError(message)


def build_parser() -> Parser:
    parser = Parser(prog="plot.py", description=__doc__.split("\n")[0])
    parser.add_argument("metrics_file", help="a run's --metrics-file (JSON lines)")
    parser.add_argument("--out-dir", help="where the PNGs go (default: the metrics file's directory); each is named"
                        " after the file: NAME.loss.png, NAME.step_time.png, NAME.memory.png")
    return parser


def main(argv=None) -> list:
    """Write the PNGs the file has figures for; returns their paths."""
    try:
        args = build_parser().parse_args(argv)
        if Figure is None:
            raise ValueError("plot.py needs matplotlib: pip install matplotlib (it is in requirements.txt)")
        steps, startup, end = read_metrics(args.metrics_file)
        out_dir = args.out_dir or os.path.dirname(os.path.abspath(args.metrics_file))
        os.makedirs(out_dir, exist_ok=True)
        stem = os.path.join(out_dir, os.path.splitext(os.path.basename(args.metrics_file))[0])
        written = [path for path in (loss_png(steps, f"{stem}.loss.png"),
                                     step_time_png(steps, startup, end, f"{stem}.step_time.png"),
                                     memory_png(startup, end, f"{stem}.memory.png")) if path]
    except (ValueError, OSError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        sys.exit(2)
    for path in written:
        print(f"plot: wrote {path}")
    return written


def read_metrics(path: str) -> tuple[list, dict | None, dict | None]:
    """(step records by step, the newest of each; the newest "startup" figures; the newest "end" figures). A line
    that is not a JSON step record (a run killed mid-write) is left out, and said."""
    if not os.path.isfile(path):
        raise ValueError(f"{path!r} is not a file: give a run's --metrics-file")
    by_step, startup, end = {}, None, None
    with open(path) as f:
        for number, line in enumerate(f, 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                print(f"plot: line {number} of {path} is not JSON (a run stopped while writing it?): left out")
                continue
            if not isinstance(record, dict) or "step" not in record or "loss" not in record:
                continue
            by_step[record["step"]] = record
            startup, end = record.get("startup", startup), record.get("end", end)
    if not by_step:
        raise ValueError(f"{path!r} holds no step record (JSON lines with step and loss): not a --metrics-file")
    return [by_step[s] for s in sorted(by_step)], startup, end


def missing(what: str, why: str) -> None:
    print(f"plot: no {what} in the metrics file ({why})")


def loss_png(steps: list, path: str) -> str:
    """The training loss of every step and the val loss where evaluated, against the step."""
    fig = Figure(figsize=SIZE, dpi=DPI)
    ax = fig.add_subplot()
    ax.plot([r["step"] for r in steps], [r["loss"] for r in steps], label="loss", linewidth=1)
    evaluated = [r for r in steps if r.get("val_loss") is not None]
    if evaluated:
        ax.plot([r["step"] for r in evaluated], [r["val_loss"] for r in evaluated], "o-", label="val loss")
    else:
        missing("val_loss", "the run evaluated at no logged step")
    ax.set(xlabel="step", ylabel="loss (nats per token)", title="loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.savefig(path)
    return path


def step_time_png(steps: list, startup: dict | None, end: dict | None, path: str) -> str:
    """Left: the time model's step split into its parts (stacked) beside the measured mean step time; right: the
    measured step time of every step, and the predicted one."""
    times = [r["step_time_s"] * 1e3 for r in steps if r.get("step_time_s") is not None]
    if not times:
        missing("step_time_s", "written by an older trainer")
        return ""
    # The mean the end measured (the first step of a run left out), else the median of the steps here.
    mean = end["step_time_s"] * 1e3 if end and end.get("step_time_s") else sorted(times)[len(times) // 2]
    predicted = (startup or {}).get("time_predicted_s")
    if predicted is None:
        missing("time-model prediction (startup.time_predicted_s)", "written before the file carried it")
    fig = Figure(figsize=SIZE, dpi=DPI)
    bars, line = fig.subplots(1, 2, gridspec_kw=dict(width_ratios=(1, 2)))
    bottom = 0.0
    for key, label in PARTS.items() if predicted else ():
        height = predicted[key] * 1e3
        bars.bar("predicted", height, bottom=bottom, label=label)
        bottom += height
    bars.bar("measured", mean, color="0.4", label="measured (mean)" if end else "measured (median)")
    bars.set(ylabel="ms per step", title="step time by part", ylim=(0, max(bottom, mean) * 1.7))  # room: legend
    bars.legend(fontsize="small", loc="upper right")
    line.plot([r["step"] for r in steps if r.get("step_time_s") is not None], times, linewidth=1, label="measured")
    if predicted:
        line.axhline(predicted["step"] * 1e3, color="k", linestyle="--", label="predicted")
    line.set(xlabel="step", ylabel="ms", title="step time")
    line.legend(fontsize="small")
    line.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    return path


def memory_png(startup: dict | None, end: dict | None, path: str) -> str:
    """The memory by kind, predicted beside held or measured (MiB per rank, rank 0)."""
    predicted = (end or {}).get("memory_predicted") or (startup or {}).get("memory_predicted")
    measured = (end or {}).get("memory_measured")
    if predicted is None and measured is None:
        missing("memory figures (startup.memory_predicted, end.memory_measured)", "written before the file carried"
                " them: no memory picture")
        return ""
    if measured is None:
        missing("measured memory (end.memory_measured)", "the run stopped before its last step, or an older file")
    kinds = [kind for kind in KINDS if (predicted or {}).get(kind) is not None or (measured or {}).get(kind)]
    fig = Figure(figsize=SIZE, dpi=DPI)
    ax = fig.add_subplot()
    width = 0.4
    for offset, (values, label) in ((-width / 2, (predicted, "predicted")), (width / 2, (measured, "measured"))):
        if values:
            ax.bar([i + offset for i in range(len(kinds))], [(values.get(k) or 0) / MIB for k in kinds], width,
                   label=label)
    ax.set_xticks(range(len(kinds)), [KINDS[k] for k in kinds])
    ax.set(ylabel="MiB per rank (rank 0)", title="memory by kind: predicted and held or measured")
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path)
    return path


if __name__ == "__main__":
    main()
