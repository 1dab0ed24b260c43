"""The run's accounting printed: what the start-up predicts, each step's line, the end's measured vs predicted.

Everything that prints, times a run or compares a prediction with a measurement lives here or in mfu.py (the
formulas, the clocks) and comm.py (the tracer, the `Messages` type); the concept files keep their algorithms
and their pure prediction formulas, which this file calls. It reads the run (train.Run), the layout and the
axes' handles, and never changes what the trainer computes.

    print_startup(run)            the mesh, parameters, memory, FLOPs, peak, every axis, predicted messages
    print_step(record, progress)  step i/N, losses, lr, grad norm, tok/s, MFU, step time, ETA (+ axis lines)
    print_end(run, ...)           held vs predicted bytes, activations, the axes' end lines, traced vs
                                  predicted messages per step, every collective of the run, throughput

Per-axis lines come from the sections below, one per axis (`AXIS_LINES`), looked up by the handle's name:
the accounting loops over the handles and never asks which flags are on.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import torch.distributed as dist

import mfu
import moe
import pipeline
from comm import Messages
from mesh import axis_groups
from model import counts_here
from optim import update_messages


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


def predicted_messages(run, traced_steps: int = 0) -> Messages:
    """Every (collective, group) of one optimizer step: the layout's, every axis's, the step's own two scalars
    and the update's all-reduce, named as the tracer reports them. With traced_steps, what the tracer should
    have seen per step of those (an axis may know it better after the fact: MoE's routed counts)."""
    out = Messages(run.layout.predicted_messages(run.micro_batches))
    for axis in run.axes:
        out = out + (axis.traced_prediction(run.layout, traced_steps) if traced_steps
                     else axis.predicted_messages(run.layout))
    if run.mesh.size("dp_cp") > 1:  # step.py: the global token count and the logged loss, float64 each
        out.add("all_reduce", "dp_cp", 2, 16)
    if run.mesh.shape.world_size > 1:
        out = out + update_messages()
    return out.named(run.tracer.alias)  # names that share one communicator are one row (mesh.py)


def parameter_counts(run) -> tuple[int, int]:
    """(Ψ of the logical model, parameters this rank holds). Ψ adds, over the world, the copies that count
    (model.counts_here, with each parameter's data-parallel group as a replica axis): each logical element once."""
    coords = run.mesh.coordinates()
    params = list(run.model.parameters())
    counted = sum(p.numel() for p in params if counts_here(p.shard_info, coords, (p.shard_info.grad_group,)))
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
    print0(f"parameters: {psi:,} global (Ψ); {local:,} on this rank (n_layer={config.n_layer} n_head={config.n_head}"
           f" n_embd={config.n_embd} vocab={config.vocab_size})")
    print0(f"batch: B_global={args.global_batch} = D {mesh.shape.dp} × m {run.micro_batches} × B_μ"
           f" {run.micro_batch_size} sequences of {run.seq_len} tokens = {run.tokens_per_step:,} tokens/step;"
           f" autocast {settings.dtype} ({settings.dtype_reason})")
    fp32_matmuls = "TF32 tensor cores (--tf32)" if args.tf32 else "full FP32 (no --tf32)"
    print0(f"numerics: fp32 matmuls {fp32_matmuls} on {run.device.type}; "
           + ("deterministic kernels (--deterministic): GPU runs replay bitwise" if args.deterministic else
              "default kernels: a GPU run replays to float tolerance (--deterministic for bitwise)"))
    for line in run.layout.startup_lines(run.micro_batches):
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


@dataclass(frozen=True)
class ActivationEstimate:
    """What this rank's forwards save for backward, by mfu's formulas (what the kernels save)."""

    forward: float  # bytes one forward saves: a micro-batch (under PP one chunk of it) through this rank's part
    terms: dict  # the micro-batch's bytes (all v chunks) by what saves them
    hidden: float  # of `forward`, what saved_tensors_hooks cannot see (SP's regather hooks: mfu.hidden_from_hooks)
    in_flight: int  # forwards alive at once (the pipeline's chunk-micro-batches; 1 otherwise)
    chunks: int  # v: the chunks of a pipeline rank (forward is 1/v of the micro-batch's bytes); 1 otherwise
    recomputed: float  # under activation checkpointing, the block that backward rebuilds (else 0)
    korthikanti: float  # the paper's formula for the same blocks and micro-batch (16-bit, unfused attention)
    how: str

    @property
    def peak(self) -> float:
        """Bytes alive at once: every forward in flight, and under activation checkpointing the block that
        backward rebuilds (by then the head's and the loss's tensors of that micro-batch are freed)."""
        rebuilt = max(0.0, self.recomputed - self.terms["head and loss"] / self.chunks)
        return self.in_flight * self.forward + rebuilt


def activation_shape(run) -> mfu.ActivationShape:
    """The symbols of mfu's activation formulas for this rank: its sequence (s/C), its dtypes, the kernel."""
    config, settings, device = run.config, run.settings, run.device
    cp_impl = settings.args.cp_impl if settings.shape.cp > 1 else None
    # CP's attention (the ring, or SDPA on whole sequences inside Ulysses) runs without dropout (refused).
    kernel = "fused" if cp_impl else mfu.attention_kernel(device.type, run.compute_dtype, config.dropout)
    return mfu.ActivationShape(
        s=run.seq_len // settings.shape.cp, b=run.micro_batch_size, h=config.n_embd, a=config.n_head,
        vocab=config.vocab_size, t=settings.shape.tp, sp=settings.sequence_parallel,
        e_r=run.param_dtype.itemsize, e_c=run.compute_dtype.itemsize, dropout=config.dropout > 0,
        bool_masks=device.type == "cuda", fp32_norms=device.type == "cuda" and run.compute_dtype.itemsize < 4,
        kernel=kernel, ulysses=cp_impl == "ulysses", fp8=settings.args.fp8 is not None,
        regather=settings.args.fp8 is None)  # FP8 keeps the gathered input (fp8.convert)


def activation_estimate(run) -> ActivationEstimate:
    """This rank's activations per micro-batch: its blocks, the embeddings and the head where it holds them,
    autocast's weight copies apart. Under activation checkpointing a block keeps its input only and backward
    rebuilds one block at a time; under PP the schedule keeps `pipeline.in_flight` chunk-micro-batches of this
    rank's program alive, each counted as 1/v of the stage (exact for v = 1)."""
    config, model, x = run.config, run.model, activation_shape(run)
    n_moe = sum(moe.is_moe_layer(config, block.layer_id) for block in model.transformer.h)
    held = {"dense": len(model.transformer.h) - n_moe, "moe": n_moe}  # blocks of each kind on this rank
    # A MoE layer's router and experts (uniform routing), and autocast's copies of the experts this rank holds
    # (whole on every TP rank).
    experts = (moe.layer_activation_bytes(config, x.s * x.b // (x.t if x.sp else 1), x.e_c, max(4, x.e_r),
                                          mask_bytes=1 if x.bool_masks else max(x.e_c, x.e_r)),
               config.moe_experts // run.settings.shape.ep * 8 * x.h * x.h * x.weight_copy) if n_moe else (0, 0)
    recomputed = 0.0
    if config.activation_checkpointing:  # the inputs stay; backward rebuilds one block, its copies with it
        blocks, copies = mfu.block_input_bytes(x) * sum(held.values()), 0.0
        rebuilt = block_bytes(replace(x, regather=False), experts)
        recomputed = max(sum(rebuilt[kind]) for kind in held if held[kind]) - mfu.block_input_bytes(x)
        what = f"{sum(held.values())} block inputs"  # the rebuilt block's input is the one the checkpoint holds
    else:
        each = block_bytes(x, experts)
        blocks, copies = (sum(held[kind] * each[kind][i] for kind in held) for i in (0, 1))
        what = f"{sum(held.values())} blocks" + (f" ({n_moe} MoE)" if n_moe else "")
    terms = {what: blocks, "autocast weight copies": copies,
             "embeddings": mfu.embedding_activation_bytes(x) if model.has_embedding else 0.0,
             "head and loss": mfu.head_activation_bytes(x) if model.has_head else 0.0}
    hidden = mfu.hidden_from_hooks(x, 0 if config.activation_checkpointing else sum(held.values()), model.has_head)
    in_flight, chunks = 1, 1
    if isinstance(run.schedule, pipeline.PipelineSchedule):
        in_flight = pipeline.in_flight(run.schedule.programs(run.micro_batches)[run.schedule.rank])[0]
        chunks = run.schedule.v
    how = (f"attention {x.kernel}" + (" (Ulysses)" if x.ulysses else "")
           + f", {x.e_r}-byte residual, {x.e_c}-byte compute" + (", FP8 linear inputs" if x.fp8 else "")
           + (f", {x.mask(x.e_c)}-byte dropout masks" if x.dropout else ", no dropout"))
    return ActivationEstimate(forward=sum(terms.values()) / chunks, terms=terms, hidden=hidden / chunks,
                              in_flight=in_flight, chunks=chunks, recomputed=recomputed,
                              korthikanti=korthikanti_estimate(run, x, n_moe), how=how)


def block_bytes(x: mfu.ActivationShape, experts: tuple) -> dict:
    """{"dense" | "moe": (activations, autocast weight copies)} of one block of each kind (mfu's terms). A MoE
    block keeps its attention and LayerNorms, and `experts` (its router's and experts' bytes, their copies)
    instead of the dense MLP's."""
    terms = mfu.layer_activation_terms(x)
    attention = terms["layernorms"] + terms["attention"]
    return {"dense": (attention + terms["mlp"], terms["attention weight copies"] + terms["mlp weight copies"]),
            "moe": (attention + experts[0], terms["attention weight copies"] + experts[1])}


def korthikanti_estimate(run, x: mfu.ActivationShape, n_moe: int) -> float:
    """Korthikanti et al. 2022 for this rank's blocks and micro-batch (16-bit; a MoE block's experts by
    moe.activation_estimate_delta); under activation checkpointing the block inputs, 2·s·b·h each (/T with SP),
    and one layer recomputed."""
    blocks, checkpointing = len(run.model.transformer.h), run.config.activation_checkpointing
    per_layer = mfu.activation_bytes_per_layer(x.s, x.b, x.h, x.a, t=x.t, sequence_parallel=x.sp)
    experts = moe.activation_estimate_delta(run.config, min(1, n_moe) if checkpointing else n_moe, x.s, x.b, x.t,
                                            x.sp) if n_moe else 0
    if not checkpointing:
        return per_layer * blocks + experts
    return 2 * x.s * x.b * x.h // (x.t if x.sp else 1) * blocks + per_layer + experts


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
    """How far one training step's host memory rose above where it began (mfu.MemoryTimeline over it)."""

    step: int
    rise: float  # bytes
    in_mean: bool  # its time (slowed by the profiler) is in the throughput's mean


def print_end(run, steps_run: int, seconds: float, steps_timed: int, step_peak: StepPeak | None = None):
    """Measured against predicted. steps_run: steps traced (a resumed run starts late); steps_timed: timed;
    step_peak: on a CPU, the profiled step's (train.py profiles the second: its state is steady)."""
    held, predicted = run.layout.held_bytes(), run.layout.predicted_persistent()
    print0("=" * 100)
    print0("measured vs predicted (per rank, rank 0):")
    for kind in ("weights", "grads", "optimizer", "total"):
        print0(f"  {kind:<9} held {mfu.format_bytes(held[kind]):>12}   predicted {mfu.format_bytes(predicted[kind]):>12}")
    f, estimate = mfu.format_bytes, activation_estimate(run)
    saved = run.schedule.saved_activation_bytes
    if saved is not None:
        seen = estimate.forward - estimate.hidden  # what the hooks can see of the estimate
        print0(f"  activations saved for backward by {run.schedule.measured_forward} (saved_tensors_hooks,"
               f" {run.settings.dtype} compute): measured {f(saved)}, estimated {f(seen)} ({saved / seen - 1:+.1%})"
               + (f" + {f(estimate.hidden)} kept inside SP's regather hooks, which the measurement cannot see"
                  if estimate.hidden else "")
               + f"; Korthikanti {f(estimate.korthikanti)} (the paper's, 16-bit, unfused attention)")
    expected = predicted["total"] + estimate.peak  # persistent + activations at the schedule's peak
    if run.device.type == "cuda":  # since the loop began (the full model built before an axis split it is not in it)
        allocated, reserved, rank = mfu.cuda_memory_peaks(run.device)
        print0(f"  CUDA allocator peak over the training steps, max over ranks: allocated"
               f" {f(allocated)} (rank {rank}), reserved {f(reserved)}; persistent + activations at the peak"
               f" {f(expected)} (allocated/that {allocated / expected:.2f}: the rest is temporaries)")
    elif step_peak is not None:  # the step began holding the persistent state (its second step: steady)
        peak = held["total"] + step_peak.rise
        print0(f"  peak of step {step_peak.step} (host memory, torch.profiler's allocation events): held"
               f" {f(held['total'])} + {f(step_peak.rise)} = {f(peak)}; persistent + activations at the peak"
               f" {f(expected)} (measured/that {peak / expected:.2f}: the rest is temporaries, e.g. the logits and"
               f" the gradients of activations)")
    for line in run.layout.end_lines(run.tracer, steps_run):
        print0(line)
    for axis in run.axes:
        for line in axis_lines(axis, "end", run, steps_run):
            print0(line)
    predicted, traced = predicted_messages(run, steps_run), run.tracer.records
    if steps_run and (predicted or traced):
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
    table = run.tracer.table()
    if table.strip():
        print0(f"communication by (phase, collective, group), every collective from the process group's creation"
               f" to the end (the step's: {steps_run} steps):")
        print0(table)
    if steps_timed:
        tokens_per_s = run.tokens_per_step * steps_timed / seconds
        world, peak = run.mesh.shape.world_size, run.peak[0]
        print0(f"throughput {tokens_per_s:,.0f} tok/s, MFU {mfu.mfu(run.flops.model, tokens_per_s, peak, world):.2%},"
               f" HFU {mfu.mfu(run.flops.hardware, tokens_per_s, peak, world):.2%}"
               f" (mean over {steps_timed} steps, the first one of the run excluded"
               + ("" if step_peak is None else f", step {step_peak.step}, profiled for its memory, "
                  + ("included: its time has the profiler's" if step_peak.in_mean else "too") + ")"))
    print0("=" * 100)


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
# Each axis's lines: AXIS_LINES[handle name][when](handle, run, steps) -> [str]; when: startup, step, end
# ---------------------------------------------------------------------------------------------------------


def axis_lines(axis, when: str, run, steps: int = 0) -> list:
    """The lines of `axis` (a handle) at `when`: its section's formatter, or none."""
    formatter = AXIS_LINES.get(axis.name, {}).get(when)
    return formatter(axis, run, steps) if formatter is not None else []


def _legacy_lines() -> dict:  # the handle still formats its own lines (until its section takes them over)
    return {"startup": lambda axis, run, steps: axis.startup_lines(),
            "step": lambda axis, run, steps: axis.step_lines(),
            "end": lambda axis, run, steps: axis.end_lines(run.tracer, steps)}


AXIS_LINES: dict = {}  # {handle name: {"startup" | "step" | "end": formatter(axis, run, steps) -> [str]}}


# ---------------------------------------------------------------------------------------------------------
# --- zero --- (the ZeRO layout's lines)
# ---------------------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------------------
# --- ckpt --- (the save line)
# ---------------------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------------------
# --- moe ---
# ---------------------------------------------------------------------------------------------------------

AXIS_LINES["moe"] = _legacy_lines()


# ---------------------------------------------------------------------------------------------------------
# --- tp ---
# ---------------------------------------------------------------------------------------------------------

AXIS_LINES["tp"] = _legacy_lines()


# ---------------------------------------------------------------------------------------------------------
# --- cp ---
# ---------------------------------------------------------------------------------------------------------

AXIS_LINES["cp"] = _legacy_lines()


# ---------------------------------------------------------------------------------------------------------
# --- pp ---
# ---------------------------------------------------------------------------------------------------------

AXIS_LINES["pp"] = _legacy_lines()


# ---------------------------------------------------------------------------------------------------------
# --- fp8 ---
# ---------------------------------------------------------------------------------------------------------

AXIS_LINES["fp8"] = _legacy_lines()
