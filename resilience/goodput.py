"""Goodput: the job's wall-clock time split into productive training and badput by cause, across restarts.

A job is every process that trained one line of checkpoints: the first launch, and each one resumed after a
failure (or a stop). Its wall time W_job is split into causes that add up to it exactly:

    train     productive training: the optimizer steps (a step replayed after a failure counts here, once:
              its first computation is in `lost`)
    startup   the first process's start-up: interpreter and imports, flags, process groups, the model built
              and measured, the start-up printout (from the process's creation, read from /proc)
    restart   the same start-up in a process resumed after a failure (part of a failure's cost R); a process that
              goes on from a finished run's last checkpoint starts a new leg: its start-up is start-up, nothing lost
    restore   opening the checkpoint directory and loading the checkpoint (`--resume`)
    ckpt      checkpoint time that blocked training: a synchronous save whole; an async save only its
              snapshot (and any wait for the previous persist), the persist runs beside training
    lost      from the snapshot of the checkpoint a resumed process loaded to that process's creation: the
              work done after that checkpoint (recomputed now) and the relaunch (failure detection, the
              launcher's restart); inferred by the resumed run as (its process start − the checkpoint's time)
    eval      evaluation and sampling
    input     input stalls: waiting for a step's micro-batches (the read-ahead did not keep up)
    other     the rest: step lines, the metrics file, the end's report (W − the causes above)

Useful tokens per wall second = tokens of the steps the final model has (each counted once) / W_job, beside the
MFU of the steps' own time. The ledger is checkpoint state (kind `goodput/`, logical, one copy: rank 0's): the
per-cause seconds so far, the wall clock of the snapshot, the number of resumes. A resumed run adds its
predecessors' time from the checkpoint it loaded; the checkpoint's step is the step they reached.

The clock observes: train.py brackets the phases of its loop (`with clock.phase("eval"):`) and the algorithms
never see it. Time goes to the innermost open phase; time in no phase is `other`.

Checkpoint interval, as formulas (pure): with C the checkpoint's cost, M the mean time between failures, R the
restart cost per failure and τ the work between checkpoints (seconds), the wasted fraction to first order is

    W(τ) ≈ C/τ + τ/(2M) + R/M        minimised at Young's τ* = sqrt(2·C·M) (Young 1974)

(a failure loses half an interval on average). Daly (2006) gives the higher-order form for exponential
failures: the expected wall time per unit of work T_wall/T_s = M·e^{R/M}·(e^{(τ+C)/M} − 1)/τ, optimal at
τ_opt = sqrt(2CM)·(1 + sqrt(C/(2M))/3 + C/(18M)) − C (C < 2M), else M. Pipeline redundancy (Bamboo) trades the
restart and the lost interval for a steady overhead o and a takeover K per failure: (1 − o)·(1 − K/M) to first
order (`redundancy_goodput`, with the share of failures it cannot absorb restarted from a checkpoint).

Accounting for this file: 1. replicated: the ledger, a vector of a dozen float64s per rank (rank 0's is the one
saved); 2. nothing on a device; 3. no message; 4. restart state: the ledger (kind `goodput/`, optional: a
checkpoint without one loads, its predecessors unknown).
"""

from __future__ import annotations

import math
import os
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

import mfu
from resilience.ckpt_files import CheckpointError
from shard import ShardInfo, StatePiece

CAUSES = ("train", "startup", "restart", "restore", "ckpt", "lost", "eval", "input", "other")
WHAT = {
    "train": "productive training (optimizer steps)",
    "startup": "start-up of the first process (imports, process groups, model build)",
    "restart": "start-up of the processes resumed after a failure",
    "restore": "checkpoint restore",
    "ckpt": "checkpoint saves, the part that blocked training",
    "lost": "after the last checkpoint until the restart began (work lost, relaunch)",
    "eval": "evaluation and sampling",
    "input": "input stalls (waiting for micro-batches)",
    "other": "the rest (step lines, metrics, the end's report)",
}
LEDGER_KEY = "goodput/job"
# The ledger tensor: [wall clock of the snapshot (s since the epoch), processes before the snapshot's, seconds per
# cause...]
SAVED_AT, RESUMES, FIRST_CAUSE = 0, 1, 2


def process_start_time() -> float:
    """This process's creation (seconds since the epoch), so the start-up counts the interpreter and the imports:
    now − (the time since boot − /proc/self/stat's start time after boot), to a clock tick (/proc/stat's boot
    time is whole seconds: too coarse); where /proc is absent, now."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


class Clock:
    """The job's wall time by cause: this process's phases, plus its predecessors' from a checkpoint.

    `started`: this process's creation (time.time() scale); what passed before the clock was made is start-up.
    `now`: the time source (time.time; tests pass a fake one). Checkpoint state through `state_pieces()` and
    `after_load()`, the two methods the Checkpointer calls on its state owners (as on an axis's handle).
    """

    def __init__(self, started: float | None = None, now=time.time):
        self.now = now
        self.started = process_start_time() if started is None else started
        self.seconds = dict.fromkeys(CAUSES, 0.0)  # this process's, closed phases
        self.seconds["startup"] = max(0.0, now() - self.started)  # creation → the clock: interpreter, imports
        self._open: list[list] = []  # [cause, since]: the innermost phase takes the time
        self.predecessors = torch.zeros(len(CAUSES), dtype=torch.float64)  # the loaded ledger's seconds
        self.lost = 0.0  # the loaded checkpoint's snapshot → this process's creation
        self.resumes = 0  # the processes before this one (the ledger's count)
        self.restarted = False  # this process resumed after a failure: its start-up is part of the restart
        self.ledger = torch.zeros(FIRST_CAUSE + len(CAUSES), dtype=torch.float64)  # what a checkpoint saves
        self._written = None  # the ledger as state_pieces() last filled it (a load that brought nothing leaves it)

    @contextmanager
    def phase(self, cause: str):
        """Time spent inside goes to `cause` (the time of an enclosing phase pauses meanwhile)."""
        if cause not in CAUSES:
            raise ValueError(f"goodput cause {cause!r}: one of {CAUSES}")
        now = self.now()
        if self._open:  # the enclosing phase is paused
            outer = self._open[-1]
            self.seconds[outer[0]] += now - outer[1]
        self._open.append([cause, now])
        try:
            yield self
        finally:
            now = self.now()
            self.seconds[cause] += now - self._open.pop()[1]
            if self._open:
                self._open[-1][1] = now

    def totals(self) -> dict:
        """The job's seconds by cause up to now: predecessors + lost + this process (the open phase included);
        `other` is what no phase took, so the causes add up to `wall()` exactly."""
        now = self.now()
        mine = dict(self.seconds)
        if self._open:
            mine[self._open[-1][0]] += now - self._open[-1][1]
        if self.restarted:  # a restarted process's start-up is part of the restart
            mine["restart"], mine["startup"] = mine["restart"] + mine["startup"], 0.0
        mine["other"] += (now - self.started) - sum(mine.values())
        job = {cause: float(self.predecessors[i]) + mine[cause] for i, cause in enumerate(CAUSES)}
        job["lost"] += self.lost
        return job

    def wall(self) -> float:
        """The job's wall time so far: the predecessors' (to their snapshot), the lost gap, this process's."""
        return float(self.predecessors.sum()) + self.lost + (self.now() - self.started)

    # -- checkpoint state (the Checkpointer calls these, as on an axis) ------------------------------------

    def state_pieces(self) -> list:
        """The ledger as of now, one logical copy (rank 0's is written; every rank loads it)."""
        totals = self.totals()
        self.ledger[SAVED_AT], self.ledger[RESUMES] = self.now(), self.resumes
        self.ledger[FIRST_CAUSE:] = torch.tensor([totals[c] for c in CAUSES], dtype=torch.float64)
        self._written = self.ledger.clone()
        rank = dist.get_rank() if dist.is_initialized() else 0
        return [StatePiece(LEDGER_KEY, self.ledger, ShardInfo("job", tuple(self.ledger.shape)), primary=rank == 0,
                           optional=True)]

    def after_load(self, layout, step: int) -> None:
        """The checkpoint's ledger is in `self.ledger`: its seconds are the predecessors', and the time from its
        snapshot to this process's creation is lost. Its numbers are untrusted: finite, ≥ 0, or CheckpointError."""
        if self._written is not None and torch.equal(self.ledger, self._written):
            return  # the checkpoint has no ledger (written before goodput was): predecessors unknown
        values = self.ledger.tolist()
        if not all(math.isfinite(v) and v >= 0 for v in values) or values[RESUMES] != int(values[RESUMES]):
            raise CheckpointError(f"the checkpoint of step {step}: {LEDGER_KEY} holds {values}; expected a snapshot"
                                  f" time, a whole number of resumes and {len(CAUSES)} seconds by cause, all finite"
                                  f" and >= 0")
        self.predecessors = self.ledger[FIRST_CAUSE:].clone()
        self.lost = max(0.0, self.started - values[SAVED_AT])  # clocks of other nodes may disagree a little
        self.resumes, self.restarted = int(values[RESUMES]) + 1, True

    def continues_a_finished_run(self) -> None:
        """The loaded checkpoint is its run's last step (the run had finished, not failed): the time since its
        snapshot was no failure's and nothing was lost; this process's start-up is a start-up, not a restart."""
        self.lost, self.restarted = 0.0, False

    # -- the end's table ------------------------------------------------------------------------------------

    def lines(self, useful_tokens: int, step_tokens_per_s: float, flops_per_token: float, peak: float,
              world: int, under_load: bool = False) -> list[str]:
        """The end's table: each cause's seconds and share of the job's wall time, and useful tokens per wall
        second beside the steps' own throughput and MFU (marked "?", as the step lines mark them, where the peak
        was measured under load: `mfu.peak_under_load`)."""
        totals, wall = self.totals(), self.wall()
        runs = f"this process {self.now() - self.started:.1f} s" + (
            f" + {self.resumes} earlier {'processes' if self.resumes > 1 else 'process'} and the gaps"
            f" {wall - (self.now() - self.started):.1f} s" if self.resumes else "")
        out = [f"goodput: the job's wall time {wall:.1f} s ({runs}), by cause:"]
        for cause in CAUSES:
            out.append(f"  {cause:<8} {totals[cause]:>10.2f} s {totals[cause] / wall:>7.1%}  {WHAT[cause]}")
        useful = useful_tokens / wall
        in_steps, mark = mfu.mfu(flops_per_token, step_tokens_per_s, peak, world), "?" if under_load else ""
        out.append(f"  useful tokens per wall second {useful:,.0f} ({useful_tokens:,} tokens / {wall:.1f} s): MFU"
                   f" {mfu.mfu(flops_per_token, useful, peak, world):.2%}{mark} of the job's wall time, against"
                   f" {step_tokens_per_s:,.0f} tok/s and MFU {in_steps:.2%}{mark} in the steps"
                   + ("; against a peak measured under load: they cannot be trusted" if under_load else ""))
        return out


def parse_table(text: str) -> dict:
    """{cause: seconds} of the last goodput table in a run's output, and "wall" (what the benches read)."""
    out, lines = {}, text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("goodput: the job's wall time ")]
    if not starts:
        raise ValueError("no goodput table in the output")
    first = starts[-1]
    out["wall"] = float(lines[first].split("wall time ")[1].split(" s")[0])
    for line in lines[first + 1:first + 1 + len(CAUSES)]:
        cause, seconds = line.split()[:2]
        out[cause] = float(seconds)
    return out


# ---------------------------------------------------------------------------------------------------------
# The checkpoint interval: Young's first-order model and Daly's higher-order one (pure)
# ---------------------------------------------------------------------------------------------------------


def young_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """τ* = sqrt(2·C·M) (Young 1974): mfu.py's formula, the one home of it."""
    return mfu.young_checkpoint_interval(checkpoint_s, mtbf_s)


def daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly (2006), eq. 37: τ_opt = sqrt(2CM)·(1 + sqrt(C/(2M))/3 + C/(18M)) − C for C < 2M, else M."""
    c, m = checkpoint_s, mtbf_s
    if c >= 2 * m:
        return m
    return math.sqrt(2 * c * m) * (1 + math.sqrt(c / (2 * m)) / 3 + c / (18 * m)) - c


def wasted_fraction(tau_s: float, checkpoint_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """W(τ) ≈ C/τ + τ/(2M) + R/M: checkpoints, half an interval lost per failure, a restart per failure."""
    return checkpoint_s / tau_s + tau_s / (2 * mtbf_s) + restart_s / mtbf_s


def predicted_goodput(tau_s: float, checkpoint_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """1 − W(τ), the first-order model's share of the wall time that is productive training."""
    return 1.0 - wasted_fraction(tau_s, checkpoint_s, mtbf_s, restart_s)


def daly_goodput(tau_s: float, checkpoint_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """T_s/T_wall = τ / (M·e^{R/M}·(e^{(τ+C)/M} − 1)), Daly's expected goodput for exponential failures (a
    failure may strike during a restart too); it tends to 1 − W(τ) when τ, C, R ≪ M."""
    m = mtbf_s
    return tau_s / (m * math.exp(restart_s / m) * math.expm1((tau_s + checkpoint_s) / m))


def redundancy_goodput(overhead: float, takeover_s: float, mtbf_s: float, covered: float = 1.0,
                       restart_s: float = 0.0, tau_s: float = math.inf, checkpoint_s: float = 0.0) -> float:
    """Pipeline redundancy (Bamboo, resilience/redundancy.py): (1 − o)·(1 − C/τ − (c·K + (1 − c)·(R + τ/2))/M).

    o the steady-state overhead (1 − T_plain/T_redundant: the share of a redundant step that is redundancy), K a
    takeover's cost (the preemption → the next step done, the interrupted step's redo included), c the share of
    preemptions a takeover absorbs (1: Bamboo's model, where any stage is shadowed and a replacement joins; here
    stage 0 is not served: (P − 1)/P), the rest a checkpoint restart (R, and half an interval τ redone) of a run
    that also checkpoints every τ at a cost C. No checkpoint (τ = ∞) and c = 1: (1 − o)·(1 − K/M); no
    preemption: 1 − o. First order, like `wasted_fraction`: it ignores a second loss during a takeover (K ≪ M)."""
    uncovered = 0.0 if covered >= 1 else (1 - covered) * (restart_s + tau_s / 2)
    return (1 - overhead) * (1 - checkpoint_s / tau_s - (covered * takeover_s + uncovered) / mtbf_s)
