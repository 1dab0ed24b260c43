"""What a run writes for pictures: --metrics-file's JSON lines and --tensorboard's event files (rank 0 writes).

The metrics file is one JSON object per step (report.run.step_record), as it always was: a reader that takes
every line for a step still can. A run's first step also carries "startup" (report.run.startup_figures: the time
model's step split into compute, exposed communication, bubble and update; the memory by kind predicted; the peak
and whether it was measured under load), and its last step "end" (report.run.end_figures: the mean measured step
time, the memory by kind held and measured beside the predictions). `python plot.py FILE` draws them.

TensorBoard, where the tensorboard package is installed (`torch.utils.tensorboard.SummaryWriter`), gets the same
figures as scalars (loss and val loss, lr, grad norm, tokens/s, MFU, step time, the predicted step's parts, memory
by kind predicted and measured) and the start-up's and the end's printouts as text (`captured`); without the
package the run says so once and goes on.

Accounting for this file: nothing is held or sent (rank 0 writes two files).
"""

from __future__ import annotations

import contextlib
import io
import json
import sys

from report.run import print0

SCALARS = {  # step record key → TensorBoard tag (loss and val loss share a chart)
    "loss": "loss/train", "val_loss": "loss/val", "lr": "optimizer/lr", "grad_norm": "optimizer/grad_norm",
    "loss_scale": "optimizer/loss_scale", "tokens_per_s": "throughput/tokens_per_s", "mfu": "throughput/mfu",
    "step_time_s": "time/step_s"}
FLUSH_SECONDS = 10  # TensorBoard's writer flushes this often (a killed run loses at most this much)


class Metrics:
    """--metrics-file and --tensorboard on rank 0 (nothing elsewhere): `step` writes a step's record to both,
    `text` a printout to TensorBoard, `close` ends both. `wanted` is the same on every rank: whether the figures
    (report.run.startup_figures, end_figures; the end's are collective on CUDA) are worth computing."""

    def __init__(self, metrics_file: str | None, tensorboard: str | None, rank: int, append: bool = False):
        self.wanted = bool(metrics_file or tensorboard)
        # A resumed run appends: the replayed steps then sit next to the originals in one file.
        self.file = open(metrics_file, "a" if append else "w") if metrics_file and rank == 0 else None
        self.board = open_board(tensorboard) if tensorboard and rank == 0 else None

    def step(self, record: dict) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.board is not None:
            board_step(self.board, record)

    def text(self, tag: str, text: str) -> None:
        """A printout as TensorBoard text (indented: Markdown shows it as it was printed)."""
        if self.board is not None and text.strip():
            self.board.add_text(tag, "\n".join("    " + line for line in text.splitlines()), 0)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.board is not None:
            self.board.close()
        self.file = self.board = None


def open_board(directory: str):
    """A SummaryWriter on `directory`, or None with one line when the tensorboard package is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # optional: needs the tensorboard package
    except ImportError as e:
        print0(f"--tensorboard {directory}: nothing written, the tensorboard package is not installed ({e});"
               f" the run goes on without it (pip install tensorboard)")
        return None
    return SummaryWriter(directory, flush_secs=FLUSH_SECONDS)


def board_step(board, record: dict) -> None:
    """A step record as scalars at its step; its "startup" and "end" figures by kind."""
    step = record["step"]
    for key, tag in SCALARS.items():
        if record.get(key) is not None:
            board.add_scalar(tag, record[key], step)
    for key, value in record.items():
        if key.startswith("aux_"):
            board.add_scalar(f"loss/{key[4:]}", value, step)
    for figures, what in ((record.get("startup"), "predicted"), (record.get("end"), "measured")):
        for kind, nbytes in (figures or {}).get(f"memory_{what}", {}).items():
            if nbytes is not None:
                board.add_scalar(f"memory/{what}/{kind}", nbytes, step)
    for part, seconds in (record.get("startup") or {}).get("time_predicted_s", {}).items():
        board.add_scalar(f"time/predicted_{part}_s", seconds, step)


@contextlib.contextmanager
def captured():
    """What is printed inside the `with` (report.run.print0 and print), printed as ever and kept: yields a
    StringIO holding it (for `Metrics.text`)."""
    kept = io.StringIO()

    class Both(io.TextIOBase):
        def write(self, text):
            kept.write(text)
            return shown.write(text)

        def flush(self):
            shown.flush()

    shown = sys.stdout
    with contextlib.redirect_stdout(Both()):
        yield kept
