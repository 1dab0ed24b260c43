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
from copy import deepcopy
from dataclasses import dataclass

import torch
import torch.distributed as dist

import mfu
import moe
import tensor_parallel
from comm import CommTracer, Count, Messages
from mesh import axis_groups
from model import MLP, counts_here
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

    def tick(self, step: int, seconds: float) -> float:
        if step > self.start_step:
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
    for line in run.layout.startup_lines(run.micro_batches):
        print0(line)
    activation, how = activation_estimate(run)
    print0(f"activations ≈ {mfu.format_bytes(activation)} per micro-batch (Korthikanti, 16-bit, {how})")
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


def activation_estimate(run) -> tuple[float, str]:
    """Korthikanti et al. 2022 per micro-batch for the blocks this rank holds (16-bit activations), with the
    sequence this rank holds (s/C under context parallel)."""
    config, mesh, sp = run.config, run.mesh, run.settings.args.sp
    blocks, seq = len(run.model.transformer.h), run.seq_len // mesh.size("cp")
    per_layer = mfu.activation_bytes_per_layer(seq, run.micro_batch_size, config.n_embd, config.n_head,
                                               t=mesh.size("tp"), sequence_parallel=sp)
    moe_ids = [b.layer_id for b in run.model.transformer.h if moe.is_moe_layer(config, b.layer_id)]
    experts = (lambda n: moe.activation_estimate_delta(config, n, seq, run.micro_batch_size, mesh.size("tp"), sp)) if moe_ids \
        else (lambda n: 0)  # a MoE block keeps its router's and experts' activations instead of the dense MLP's
    with_experts = f", {len(moe_ids)} with experts (moe.activation_estimate_delta)" if moe_ids else ""
    if not config.activation_checkpointing:
        return per_layer * blocks + experts(len(moe_ids)), f"{blocks} layers{with_experts}"
    # Only each block's input survives forward (2·s·b·h bytes at 16 bits, /T with SP); backward rebuilds
    # one block's activations at a time.
    block_input = 2 * seq * run.micro_batch_size * config.n_embd // (mesh.size("tp") if sp else 1)
    return (block_input * blocks + per_layer + experts(min(1, len(moe_ids))),
            f"{blocks} block inputs + one layer recomputed{with_experts}")


def print_end(run, steps_run: int, seconds: float, steps_timed: int):
    """Measured against predicted. steps_run: steps traced (a resumed run starts late); steps_timed: timed."""
    held, predicted = run.layout.held_bytes(), run.layout.predicted_persistent()
    print0("=" * 100)
    print0("measured vs predicted (per rank, rank 0):")
    for kind in ("weights", "grads", "optimizer", "total"):
        print0(f"  {kind:<9} held {mfu.format_bytes(held[kind]):>12}   predicted {mfu.format_bytes(predicted[kind]):>12}")
    if run.device.type == "cuda":  # since the loop began (the full model built before an axis split it is not in it)
        allocated, reserved, rank = mfu.cuda_memory_peaks(run.device)
        print0(f"  CUDA allocator peak over the training steps, max over ranks: allocated"
               f" {mfu.format_bytes(allocated)} (rank {rank}), reserved {mfu.format_bytes(reserved)}")
    saved = run.schedule.saved_activation_bytes
    if saved is not None:
        estimate, how = activation_estimate(run)
        print0(f"  activations saved for backward by {run.schedule.measured_forward} (saved_tensors_hooks,"
               f" {run.settings.dtype} compute): {mfu.format_bytes(saved)}; Korthikanti estimate {mfu.format_bytes(estimate)}"
               f" (16-bit, {how}; a fused attention stores no score matrix, its 5·a·s/h term)")
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
               f" (mean over {steps_timed} steps, the first one of the run excluded)")
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
MEASURES_BLOCK: set = set()  # handle names whose lines read run.measured (block 0 under a tracer)


# ---------------------------------------------------------------------------------------------------------
# Block 0 measured once at start-up, for the sections that print it next to their predictions
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockMeasurement:
    """One held block run forward and backward once, as the run will run it: what it sent and what it saved."""

    messages: dict  # {(phase, op, group as the tracer reports it): Count}, phase "forward" or "backward"
    saved_bytes: int  # the distinct storages autograd saved in the forward, parameters aside

    def on(self, group: str) -> dict:
        """{(phase, op): Count} on one mesh group, found by any of its names ("dp_cp" in "dp_cp=expert_dp")."""
        return {(phase, op): count for (phase, op, name), count in self.messages.items() if group in name.split("=")}


def measure_startup(run) -> None:
    """Measure block 0 once when a section wants it (MEASURES_BLOCK), into run.measured: train.compose calls
    it after the axes and before the layout (its hooks, ZeRO's freed weights). Collective, on every rank."""
    if any(axis.name in MEASURES_BLOCK for axis in run.axes) and len(run.model.transformer.h):
        run.measured = measure_block(run)


def measure_block(run, block_index: int = 0) -> BlockMeasurement:
    """Run held block `block_index` forward and backward once under a CommTracer on random input of one
    micro-batch as a rank holds it between regions, [B_μ, s/C (÷T under SP), h], in the working dtype the
    layout will train in (run.param_dtype: ZeRO's bf16 weights) and the run's autocast.

    It runs a deep copy of the block (sharing only the process groups) under a forked RNG, so the run is left
    as it was: no gradient, no FP8 amax, no expert load, no ring time, the same dropout draws next. Every
    rank of the groups the block talks on calls it (each pipeline stage measures its own first block).
    """
    groups = {name: group for name, group in run.mesh.groups.items() if group is not None}
    shared = {id(group): group for group in [*groups.values(), dist.group.WORLD]}  # not copied: the same groups
    block = deepcopy(list(run.model.transformer.h)[block_index], memo=dict(shared))
    params = list(block.parameters())
    for p in params:
        p.data = p.data.to(run.param_dtype)
    device = params[0].device
    tracer = CommTracer()
    for name, group in groups.items():
        tracer.name_group(group, name)
    seen, cuda = {}, device.type == "cuda"
    with torch.random.fork_rng(devices=[device.index if device.index is not None else torch.cuda.current_device()]
                               if cuda else []):
        x = torch.randn(run.micro_batch_size, run.settings.local_seq_len, run.config.n_embd, device=device,
                        dtype=run.param_dtype, generator=torch.Generator(device).manual_seed(0), requires_grad=True)
        with tracer, mfu.SavedActivations(exclude=params) as saved, run.autocast:
            out = block(x)
        seen["forward"] = tracer.records
        tracer.reset()
        with tracer:
            out.float().sum().backward()
        seen["backward"] = tracer.records
    return BlockMeasurement({(phase, op, group): Count(stat.calls, stat.payload_bytes) for phase, records in
                             seen.items() for (op, group), stat in records.items()}, saved.bytes)


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


def tp_startup_lines(axis, run, steps: int = 0) -> list:
    """Block 0's tp messages per micro-batch, predicted (tensor_parallel.block_messages) and measured
    (run.measured, when start-up measured it), the parameters per rank, the activation estimates."""
    held, batch, config = axis.holding(), axis.batch, run.config
    tp, format_bytes = run.mesh.size("tp"), mfu.format_bytes
    lines = [f"tensor parallel T={tp}{' + sequence parallel' if held.sequence_parallel else ''}: messages per block"
             f" and micro-batch (b={batch.micro}, s={batch.seq}, h={held.hidden}), on the critical path, group tp:"]
    blocks = list(axis.model.transformer.h)
    predicted = tensor_parallel.block_messages(batch, held, split_mlp=not blocks or isinstance(blocks[0].mlp, MLP))
    measured = run.measured.on("tp") if run.measured is not None else None
    for phase, messages in predicted.items():
        for (op, _), (calls, payload) in messages.items():
            line = f"  {phase:<8} {op:<22} predicted {calls} × {format_bytes(payload / calls):>10}"
            if measured is not None:
                got = measured.get((phase, op), Count(0, 0))
                line += f"   measured {got.calls} × {format_bytes(got.payload / max(1, got.calls)):>10}"
            lines.append(line)
    for (phase, op), got in (measured or {}).items():
        if (op, "tp") not in predicted[phase]:  # another axis's (FP8's amaxes), or a surprise
            lines.append(f"  {phase:<8} {op:<22} predicted 0   measured {got.calls} × {format_bytes(got.payload)}")
    if measured is not None and measured != {(phase, op): count for phase, messages in predicted.items()
                                             for (op, _), count in messages.items()}:
        lines.append("  (measured: block 0 as the run runs it, every axis's messages on tp included; the end's table"
                     " checks each axis's prediction)")
    counts, act = tensor_parallel.param_counts(config, tp), tensor_parallel.activation_estimates(config, batch.micro,
                                                                                                batch.seq, tp)
    lines.append(f"  parameters per rank: {counts['per_rank']:,} of {counts['global']:,}"
                 f" ({counts['split']:,} split /T + {counts['replicated']:,} replicated) ="
                 f" {format_bytes(counts['per_rank'] * batch.param_bytes)} weights,"
                 f" {format_bytes(counts['per_rank'] * 16)} with grads and AdamW")
    chosen = act["tp_sp"] if held.sequence_parallel else act["tp"]
    lines.append(f"  activations per layer (Korthikanti, 16-bit): unsplit sbh(34+5as/h) = {format_bytes(act['none'])};"
                 f" TP sbh(10+24/t+5as/(ht)) = {format_bytes(act['tp'])}; TP+SP (sbh/t)(34+5as/h) ="
                 f" {format_bytes(act['tp_sp'])}; this run {format_bytes(chosen)} × L={config.n_layer}"
                 f" = {format_bytes(chosen * config.n_layer)}")
    return lines


AXIS_LINES["tp"] = {"startup": tp_startup_lines}
MEASURES_BLOCK.add("tp")


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
