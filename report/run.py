"""The run's accounting printed: what the start-up predicts, each step's line, the end's measured vs predicted.

This file only prints; what it prints is computed elsewhere: mfu.py (FLOPs, peaks, wire bytes, the clocks),
accounting/memory.py (what a device holds, the per-layer activation formulas, the memory measurements),
accounting/activations.py (what a rank's forwards save), accounting/tracer.py (the tracer, the `Messages` type),
accounting/measure.py (the start-up's measurements that run work of their own), and each axis's lines are its section in
report/axes.py. The concept files keep their algorithms and their pure prediction formulas, which these call. It reads
the run (train.Run), the layout and the axes' handles, and never changes what the trainer computes.

    print_startup(run)            the mesh, parameters, memory, FLOPs, peak, every axis, predicted messages
    print_step(record, progress)  step i/N, losses, lr, grad norm, tok/s, MFU, step time, ETA (+ axis lines)
    print_save(stats)             one committed checkpoint: its size, the time it blocked training (+ Young)
    print_end(run, ...)           held vs predicted bytes, activations, the axes' end lines, traced vs
                                  predicted messages per step, every collective of the run, throughput

Per-axis lines come from report/axes.py, one section per axis (`AXIS_LINES`), looked up by the handle's name:
the accounting loops over the handles and never asks which flags are on.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch
import torch.distributed as dist

from accounting import memory, moe_memory, observers
import mfu
from accounting.activations import ActivationEstimate, activation_estimate, activation_shape
from accounting.measure import measure_block, measure_moe_blocks
from mesh import axis_groups
from optim import update_messages
from report.axes import MEASURES_BLOCK, axis_lines, layout_lines, observe
from shard import counts_here
from step import Messages
from step import scalar_messages


def print0(*args, **kwargs):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


# ---------------------------------------------------------------------------------------------------------
# Every step
# ---------------------------------------------------------------------------------------------------------

LOG_AT_LEAST_EVERY_S = 30.0  # a step line at least this often, whatever --log-every says (a slow machine)


class Progress:
    """Step times for the throughput, the step line's ETA and the log cadence. The first step of a run pays
    one-off costs (allocation, compilation) and is left out of the mean."""

    def __init__(self, start_step: int, steps: int):
        self.start_step, self.total = start_step, steps
        self.seconds, self.steps, self.first = 0.0, 0, None
        self.last_line = time.perf_counter()
        self.warned_mfu = False

    def tick(self, step: int, seconds: float, timed: bool = True) -> float:
        """Count the step's time; timed=False leaves it out of the mean (a profiled step)."""
        if step > self.start_step and timed:
            self.seconds, self.steps = self.seconds + seconds, self.steps + 1
        else:
            self.first = seconds
        return seconds

    def eta(self, step: int) -> float:
        """Seconds left for the steps after `step`, at the mean step time (evaluation and saves aside)."""
        mean = self.seconds / self.steps if self.steps else (self.first or 0.0)
        return mean * (self.total - step - 1)

    def silent_too_long(self) -> bool:
        """A step line is due anyway: none for LOG_AT_LEAST_EVERY_S seconds (a slow machine, a long --log-every)."""
        return time.perf_counter() - self.last_line > LOG_AT_LEAST_EVERY_S

    def printed(self) -> None:
        self.last_line = time.perf_counter()


def format_duration(seconds: float) -> str:
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    return (f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s" if rest >= 60
            else f"{rest}s")


def step_record(run, step: int, lr: float, outcome, step_time: float, scaler) -> dict:
    """One step's numbers, as the step line prints them and --metrics-file writes them (JSON)."""
    tokens_per_s = run.tokens_per_step / step_time
    record = dict(step=step, loss=outcome.loss, lr=lr, grad_norm=outcome.grad_norm, tokens=run.tokens_per_step,
                  step_time_s=step_time, tokens_per_s=tokens_per_s, skipped=outcome.skipped,
                  world=run.mesh.shape.world_size,  # which world trained it (an elastic run changes it)
                  mfu=mfu.mfu(run.flops.model, tokens_per_s, run.peak[0], run.mesh.shape.world_size))
    record.update({f"aux_{name}": value for name, value in outcome.aux.items()})
    if scaler.enabled:
        record["loss_scale"] = scaler.scale
    return record


def print_step(record: dict, clock: Progress, axes=()):
    """One line per logged step: step i/N, the losses, lr, grad norm, throughput, MFU, step time, ETA."""
    val = f" | val {record['val_loss']:.4f}" if "val_loss" in record else ""
    aux = "".join(f" | {key[4:]} {value:.4f}" for key, value in record.items() if key.startswith("aux_"))
    scale = f" | loss scale {record['loss_scale']:g}" if "loss_scale" in record else ""
    over = "!" if record["mfu"] > 1 else ""  # explained once, below
    print0(f"step {record['step']:>{len(str(clock.total))}d}/{clock.total} | loss {record['loss']:.4f}{val}{aux}"
           f" | lr {record['lr']:.2e} | grad norm {record['grad_norm']:.3f}{' (skipped)' if record['skipped'] else ''}"
           f"{scale} | {record['tokens_per_s']:,.0f} tok/s | MFU {record['mfu']:.2%}{over}"
           f" | {record['step_time_s'] * 1000:.0f} ms | eta {format_duration(clock.eta(record['step']))}")
    for axis in axes:
        for line in axis_lines(axis, "step", None):
            print0(f"  {line}")
    if over and not clock.warned_mfu:
        clock.warned_mfu = True
        print0("  ! MFU above 100% cannot be: the peak assumed (see 'peak assumed' above) is too low for this"
               " device; on a CPU it is measured at start-up and other jobs on the machine lower it; set"
               " --peak-tflops")
    clock.printed()


# ---------------------------------------------------------------------------------------------------------
# Start and end
# ---------------------------------------------------------------------------------------------------------


def measure_startup(run) -> None:
    """Measure block 0 once (measure.measure_block) when a section wants it (report.axes.MEASURES_BLOCK), into
    run.measured, and every held MoE block's forward peak (measure.measure_moe_blocks) into run.measured_moe:
    train.compose calls it after the axes and before the layout (its hooks, ZeRO's freed weights).
    Collective, on every rank."""
    if any(axis.name in MEASURES_BLOCK for axis in run.axes) and len(run.model.transformer.h):
        run.measured = measure_block(run)
    if any(axis.name == "moe" for axis in run.axes):  # every held MoE block's forward peak (the moe section)
        run.measured_moe = measure_moe_blocks(run)


def observe_axes(run) -> None:
    """Subscribe each axis's observer (report.axes.OBSERVERS: the ring's clock, the routed load, the pipeline's
    clock) to its algorithm. train.compose calls it after measure_startup: the observers see the run's own
    passes, not start-up's."""
    for axis in run.axes:
        observe(axis)


def watch_saved_activations(run) -> observers.SavedByFirstForward:
    """Subscribe the probe of the bytes saved for backward to the run's schedule (`run.saved_activations`): the next
    training forward is measured (train.py calls it as training starts, after start-up's own forwards)."""
    run.saved_activations = observers.SavedByFirstForward()
    run.schedule.observe_forwards(run.saved_activations)
    return run.saved_activations


def predicted_messages(run, traced_steps: int = 0) -> Messages:
    """Every (collective, group) of one optimizer step: the layout's, every axis's, the step's own two scalars
    and the update's all-reduce, named as the tracer reports them. With traced_steps, what the tracer should
    have seen per step of those (an axis may know it better after the fact: MoE's routed counts)."""
    out = Messages(run.layout.predicted_messages(run.micro_batches))
    for axis in run.axes:
        out = out + (axis.traced_prediction(run.layout, traced_steps) if traced_steps
                     else axis.predicted_messages(run.layout))
    if run.mesh.size("dp_cp") > 1:  # step.py: the global token count and the logged loss, float64 each
        out = out + scalar_messages()
    if run.mesh.shape.world_size > 1:  # the update's norm: over the world, or one DiLoCo replica (resilience/diloco.py)
        out = out + update_messages("replica" if run.settings.diloco else "world")
    return out.named(run.tracer.alias)  # names that share one communicator are one row (mesh.py)


def parameter_counts(run) -> tuple[int, int]:
    """(Ψ of the logical model, parameters this rank holds). Ψ adds, over the world, the copies that count
    (shard.counts_here, with each parameter's data-parallel group as a replica axis, and DiLoCo's `diloco`: the R
    replicas hold the same parameters): each logical element once."""
    coords = run.mesh.coordinates()
    params = list(run.model.parameters())
    counted = sum(p.numel() for p in params if counts_here(p.shard_info, coords, (p.shard_info.grad_group, "diloco")))
    psi = torch.tensor([counted], dtype=torch.float64, device=run.device)
    if dist.get_world_size() > 1:
        dist.all_reduce(psi)
    return int(psi.item()), sum(p.numel() for p in params)


def print_startup(run):
    """What each device holds and what each group sends, predicted; the end report measures the same."""
    settings, args, mesh, config = run.settings, run.settings.args, run.mesh, run.config
    psi, local = parameter_counts(run)
    print0("=" * 100)
    print0(mesh_description(mesh))
    padding = f", {config.real_vocab_size} real: padding never predicted" if config.real_vocab_size else ""
    print0(f"parameters: {psi:,} global (Ψ); {local:,} on this rank (n_layer={config.n_layer} n_head={config.n_head}"
           f" n_embd={config.n_embd} vocab={config.vocab_size}{padding}; GELU {config.gelu})")
    print0(f"batch: B_global={args.global_batch} = D {mesh.shape.dp} × m {run.micro_batches} × B_μ"
           f" {run.micro_batch_size} sequences of {run.seq_len} tokens = {run.tokens_per_step:,} tokens/step;"
           f" autocast {settings.dtype} ({settings.dtype_reason})")
    fp32_matmuls = "TF32 tensor cores (--tf32)" if args.tf32 else "full FP32 (no --tf32)"
    print0(f"numerics: fp32 matmuls {fp32_matmuls} on {run.device.type}; "
           + ("deterministic kernels (--deterministic): GPU runs replay bitwise" if args.deterministic else
              "default kernels: a GPU run replays to float tolerance (--deterministic for bitwise)"))
    for line in layout_lines(run, "startup"):
        print0(line)
    for line in activation_lines(activation_estimate(run)):
        print0(line)
    print0(f"FLOPs/token: model {run.flops.model:,.0f}, hardware {run.flops.hardware:,.0f}  [{run.flops.convention}]")
    print0(f"peak assumed: {mfu.format_flops(run.peak[0])}/s per device ({run.peak[1]})")
    for axis in run.axes:
        for line in axis_lines(axis, "startup", run):
            print0(line)
    print0(f"schedule: {run.schedule.describe(run.micro_batches)}")
    predicted = predicted_messages(run)
    if not predicted:
        print0("predicted comm per step: none (one process: nothing to send)")
    else:
        print0("predicted comm per step (op, group: calls, payload M, sent per rank by the ring formulas):")
    width = max([9, *(len(group) for _, group in predicted)])
    for (op, group), (calls, payload) in sorted(predicted.items(), key=lambda kv: kv[0][::-1]):
        named = [name for name in group.split("=") if name in run.mesh.groups]  # "dp_cp=expert_dp": one group
        n = run.mesh.size(named[0]) if named else dist.get_world_size()
        print0(f"  {op:<22} {group:<{width}} {calls:>6g} calls  {mfu.format_bytes(payload):>12}"
               f"  sent {mfu.format_bytes(mfu.wire_bytes(op, payload, n)):>12}")
    print0("=" * 100)


def activation_lines(estimate: ActivationEstimate) -> list:
    """The start-up's lines: the estimate by term, its peak under the schedule, Korthikanti's reference."""
    f = mfu.format_bytes
    terms = ", ".join(f"{name} {f(value)}" for name, value in estimate.terms.items() if value)
    per = "per micro-batch" if estimate.chunks == 1 else f"per micro-batch and chunk (1/{estimate.chunks} of"
    lines = [f"activations ≈ {f(estimate.forward)} saved for backward {per}"
             + (f" {f(sum(estimate.terms.values()))})" if estimate.chunks > 1 else "")
             + f" ({estimate.how}): {terms}"]
    if estimate.in_flight > 1 or estimate.recomputed:
        lines.append(f"  at the peak: {estimate.in_flight} in flight × {f(estimate.forward)}"
                     + (f" + one block recomputed in backward {f(estimate.recomputed)}, less the head's"
                        f" {f(estimate.terms['head and loss'] / estimate.chunks)} freed by then" if estimate.recomputed
                        else "") + f" = {f(estimate.peak)}")
    lines.append(f"  reference: Korthikanti et al. 2022, s·b·h·(34 + 5·a·s/h) per block at 16 bits, which assumes"
                 f" an unfused attention storing the a·s² scores and 1-byte dropout masks: {f(estimate.korthikanti)}"
                 f" per micro-batch")
    return lines


class StepPeak(NamedTuple):
    """How far one training step's host memory rose above where it began (memory.MemoryTimeline over it)."""

    step: int
    rise: float  # bytes
    in_mean: bool  # its time (slowed by the profiler) is in the throughput's mean


def print_end(run, steps_run: int, seconds: float, steps_timed: int, step_peak: StepPeak | None = None):
    """Measured against predicted. steps_run: steps traced (a resumed run starts late); steps_timed: timed;
    step_peak: on a CPU, the profiled step's (train.py profiles the second: its state is steady)."""
    held, predicted = run.layout.held_bytes(), run.layout.predicted_persistent()
    print0("=" * 100)
    print0("measured vs predicted (per rank, rank 0):")
    for kind in ("weights", "grads", "optimizer", *(["feedback"] if "feedback" in predicted else []), "total"):
        print0(f"  {kind:<9} held {mfu.format_bytes(held[kind]):>12}"
               f"   predicted {mfu.format_bytes(predicted[kind]):>12}")
    estimate = activation_estimate(run)
    _print_saved_activations(run, estimate)
    block = block_peak(run)  # with MoE: the block that sets the peak, above what it saves (accounting/moe_memory.py)
    _print_memory_peak(run, held, predicted["total"] + estimate.peak + (block.above_saved if block else 0), step_peak,
                       f" + the {block.setter} block above what it saves" if block else "")
    for line in layout_lines(run, "end", steps_run):
        print0(line)
    for axis in run.axes:
        for line in axis_lines(axis, "end", run, steps_run):
            print0(line)
    _print_messages(run, steps_run)
    table = run.tracer.table()
    if table.strip():
        print0(f"communication by (phase, collective, group), every collective from the process group's creation"
               f" to the end (the step's: {steps_run} steps):")
        print0(table)
    if steps_timed:
        _print_throughput(run, seconds, steps_timed, step_peak)
    print0("=" * 100)


def _print_saved_activations(run, estimate) -> None:
    """The bytes the first step saved for backward (when the probe watched it) against the estimate."""
    f, saved = mfu.format_bytes, run.saved_activations and run.saved_activations.bytes
    if saved is None:
        return
    seen = estimate.forward - estimate.hidden  # what the hooks can see of the estimate
    print0(f"  activations saved for backward by {run.schedule.measured_forward} (saved_tensors_hooks,"
           f" {run.settings.dtype} compute): measured {f(saved)}, estimated {f(seen)} ({saved / seen - 1:+.1%})"
           + (f" + {f(estimate.hidden)} kept inside SP's regather hooks, which the measurement cannot see"
              if estimate.hidden else "")
           + f"; Korthikanti {f(estimate.korthikanti)} (the paper's, 16-bit, unfused attention)")


def block_peak(run) -> moe_memory.RankPeak | None:
    """With MoE layers on this rank: which block sets its peak and what it adds (uniform routing); else None."""
    traffic = next((axis.facts().traffic for axis in run.axes if axis.name == "moe"), None)
    return moe_memory.rank_peak(traffic, activation_shape(run)) if traffic is not None and traffic.moe_layers else None


def _print_memory_peak(run, held: dict, expected: float, step_peak: StepPeak | None, block: str = "") -> None:
    """The measured peak (CUDA's allocator, or the CPU's profiled step) against expected = persistent +
    activations at the schedule's peak (+ `block`: with MoE, the block that sets the peak, above its saved)."""
    f = mfu.format_bytes
    if run.device.type == "cuda":  # since the loop began (the full model built before an axis split it is not in it)
        allocated, reserved, rank = memory.cuda_memory_peaks(run.device)
        print0(f"  CUDA allocator peak over the training steps, max over ranks: allocated"
               f" {f(allocated)} (rank {rank}), reserved {f(reserved)}; persistent + activations at the peak{block}"
               f" {f(expected)} (allocated/that {allocated / expected:.2f}: the rest is temporaries)")
    elif step_peak is not None:  # the step began holding the persistent state (its second step: steady)
        peak = held["total"] + step_peak.rise
        print0(f"  peak of step {step_peak.step} (host memory, torch.profiler's allocation events): held"
               f" {f(held['total'])} + {f(step_peak.rise)} = {f(peak)}; persistent + activations at the peak{block}"
               f" {f(expected)} (measured/that {peak / expected:.2f}: the rest is temporaries, e.g. the logits and"
               f" the gradients of activations)")


def _print_messages(run, steps_run: int) -> None:
    """Per (collective, group): the step's traced calls and payload (the mean over steps_run) against the
    axes' predicted messages; a row only one side has is printed too."""
    predicted, traced = predicted_messages(run, steps_run), run.tracer.records
    if not (steps_run and (predicted or traced)):
        return
    print0("messages per training step, traced vs predicted (calls, payload):")
    width = max([9, *(len(group) for _, group in [*predicted, *traced])])
    for key in sorted(set(predicted) | set(traced), key=lambda key: key[::-1]):  # an unpredicted one too
        calls, payload = predicted.get(key, (0, 0))
        stat = traced.get(key)
        got_calls, got_payload = (stat.calls / steps_run, stat.payload_bytes / steps_run) if stat else (0, 0)
        same = abs(got_calls - calls) < 1e-9 and abs(got_payload - payload) < 1e-6
        mark = "" if same else "   <- differs"
        print0(f"  {key[0]:<22} {key[1]:<{width}} traced {got_calls:>6g} {mfu.format_bytes(got_payload):>12}"
               f"   predicted {calls:>6g} {mfu.format_bytes(payload):>12}{mark}")


def _print_throughput(run, seconds: float, steps_timed: int, step_peak: StepPeak | None) -> None:
    tokens_per_s = run.tokens_per_step * steps_timed / seconds
    world, peak = run.mesh.shape.world_size, run.peak[0]
    print0(f"throughput {tokens_per_s:,.0f} tok/s, MFU {mfu.mfu(run.flops.model, tokens_per_s, peak, world):.2%},"
           f" HFU {mfu.mfu(run.flops.hardware, tokens_per_s, peak, world):.2%}"
           f" (mean over {steps_timed} steps, the first one of the run excluded"
           + ("" if step_peak is None else f", step {step_peak.step}, profiled for its memory, "
              + ("included: its time has the profiler's" if step_peak.in_mean else "too") + ")"))


def mesh_description(mesh) -> str:
    lines = [f"mesh: world {mesh.shape.world_size} = D {mesh.shape.dp} × P {mesh.shape.pp} × C {mesh.shape.cp}"
             f" × T {mesh.shape.tp} (E {mesh.shape.ep} inside D·C); rank = ((d·P + p)·C + c)·T + t"]
    for axis, partition in axis_groups(mesh.shape).items():
        if len(partition[0]) > 1:
            lines.append(f"  {axis:>9} groups: {partition}")
    shared = {}  # one communicator per distinct set of ranks (mesh.build_mesh)
    for name, group in mesh.groups.items():
        if mesh.size(name) > 1:
            shared.setdefault(id(group), []).append(name)
    aliases = [" = ".join(names) for names in shared.values() if len(names) > 1]
    if aliases:
        lines.append(f"  one communicator each for {'; '.join(aliases)} (the same ranks)")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# Each committed save (ckpt.py's Checkpointer calls on_save)
# ---------------------------------------------------------------------------------------------------------


def save_line(stats, mtbf_hours: float | None = None) -> str:
    """The line of one committed save (a ckpt.SaveStats): its size, the training time it blocked, its persist
    time; with an MTBF, Young's interval sqrt(2·C·M) (C: the blocked time, what a save costs training), also in
    steps at the measured time per step."""
    size = (f"{mfu.format_bytes(stats.total_bytes)} in {stats.num_files} files"
            if stats.total_bytes is not None else f"{mfu.format_bytes(stats.rank_bytes)} (rank 0)")
    line = (f"ckpt step {stats.step} → {stats.path}: {size}; training blocked {stats.blocked_s * 1e3:.0f} ms"
            f" (waited {stats.waited_s * 1e3:.0f} ms for the previous save); persist {stats.persist_s * 1e3:.0f} ms"
            f" ({'async' if stats.async_save else 'sync'})")
    if mtbf_hours:
        cost = stats.blocked_s
        interval = mfu.young_checkpoint_interval(cost, mtbf_hours * 3600)
        every = f" ≈ every {interval / stats.seconds_per_step:,.0f} steps" if stats.seconds_per_step else ""
        line += (f"\nckpt Young interval sqrt(2·C·M) = {interval:,.0f} s{every} (C = {cost:.3f} s blocked,"
                 f" M = MTBF {mtbf_hours:g} h)")
        if stats.async_save:
            line += f"; async: also ≥ the persist time {stats.persist_s:.2f} s"
    return line


def print_save(stats, mtbf_hours: float | None = None) -> None:
    """Checkpointer's on_save in train.py: rank 0 prints the save line (rank 0 holds the commit's totals)."""
    print0(save_line(stats, mtbf_hours))

