"""Train the GPT on a mesh of devices: flags → mesh → model → the axes (AXES) → layout → schedule → loop → printouts.

    python train.py                                   # one process, `mini` preset, built-in corpus
    torchrun --nproc_per_node 2 train.py --preset tiny --steps 50

Each optimizer step consumes B_global = D·m·B_μ sequences (`--global-batch`, `--micro-batch`; the number of
micro-batches m is derived). Every micro-batch backpropagates loss_sum / tokens_in_global_batch, so all
gradient reductions are sums and the update equals the single-device one on the whole global batch.

`compose(run)` is the whole composition in one short function, in DESIGN.md's order: the model (a pipeline
rank builds its stage only) → each axis's `apply(model, run, config)` → the layout (DDP or ZeRO) → the step's
schedule. The flags were checked before any of it (cli/flags.py); the printouts are report/run.py's.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import NoReturn

import torch
import torch.distributed as dist

from accounting import format_flops
import ckpt
from cli import flags
import context_parallel
import data
from experts import eplb
import fp8
from interop import hf
import mfu
import moe
from parallel import lowbit, recompute
import pipeline
from planner import cpu_probe, time_model
import precision.recipe
import report.metrics
import report.muon
import report.run
from resilience import ckpt_files, elastic, goodput, redundancy
import shard
import tensor_parallel
from accounting.activations import activation_shape
from accounting.memory import MemoryTimeline, param_counts
from accounting.tracer import CommTracer
from cli.flags import DTYPES, Settings, fail
from ddp import DDPLayout, DistributedDataParallel
from mesh import Mesh, build_mesh, init_distributed
from model import GPT, GPTConfig, compile_blocks
from optim import DynamicLossScaler, LRSchedule, build_adamw
from optimizers import qk_clip
from optimizers.muon import MuonDDPLayout
from optimizers.zero_muon import ZeroMuon
from parallel.offload import OffloadConfig, OffloadZeroLayout
from parallel.zero3 import Zero3Layout
from parallel.zero_pipeline import pipeline_layout
from report.run import print0
from resilience.diloco import DiLoCoLayout
from step import GradientAccumulation, train_step
from zero import ZeroConfig, ZeroLayout

# The axes, in DESIGN.md's order of application (MoE/EP and its replicas → TP and its 4-bit all-reduce → CP → PP →
# FP8 or a microscaling recipe → QK-clip's hooks on the final modules). Each has a `config_from_flags(args, settings)`
# (cli/flags.py calls it once, before any rank waits) and an `apply(model, run, config)` that swaps modules of the
# model in place (or hooks them) and returns its handle.
# Adding an axis adds a line here; the loop and the printouts only ever loop over the handles.
AXES = (moe, eplb, tensor_parallel, lowbit, context_parallel, pipeline, redundancy, fp8, precision.recipe, qk_clip)


@dataclass
class Run:
    """Everything one run is made of; the axes' `apply`, the loop and the printouts read it."""

    settings: Settings
    mesh: Mesh
    config: GPTConfig  # the logical model (its vocabulary is the corpus's)
    device: torch.device
    seed: int
    autocast: object = field(default_factory=nullcontext)  # torch.autocast(...) or nullcontext()
    compute_dtype: torch.dtype = torch.float32  # autocast's dtype (fp32 when off)
    param_dtype: torch.dtype = torch.float32  # the layout's working weights (ZeRO: bf16 under --dtype bf16)
    master_dtype: torch.dtype = torch.float32  # ZeRO's master weights and Adam moments; the model is built in it
    model: GPT | None = None
    axes: list = field(default_factory=list)
    layout: object = None
    schedule: object = None
    tracer: CommTracer = field(default_factory=CommTracer)
    flops: mfu.FlopsPerToken | None = None
    peak: tuple = (0.0, "")  # (FLOP/s per device, where it came from)
    measured: object = None  # report.run.measure_startup's BlockMeasurement: block 0 under a tracer, at start-up
    measured_moe: list | None = None  # report.run.measure_startup's [measure.MoEPeak]: each MoE block's forward peak
    saved_activations: object = None  # report.run.watch_saved_activations' probe: the first step's saved bytes

    @property
    def seq_len(self) -> int:
        return self.settings.seq_len

    @property
    def micro_batch_size(self) -> int:  # B_μ
        return self.settings.micro_batch_size

    @property
    def micro_batches(self) -> int:  # m
        return self.settings.micro_batches

    @property
    def tokens_per_step(self) -> int:
        return self.settings.args.global_batch * self.seq_len


def compose(run: Run, measure: bool = False, materialize: bool = True) -> Run:
    """The model, the axes in order, the layout, the schedule: the run as train.main and the tests build it.

    Each rank builds only what it keeps: the model is built on the meta device (shapes, and the ShardInfo records
    shard.describe gives them), every axis cuts it there (this rank's experts, TP's slices; a pipeline rank builds
    its stage only), and then shard.materialize gives the kept tensors their values, one logical tensor at a
    time. With --activation-checkpointing selective the model gets its policy (parallel/recompute.py). ZeRO-3 instead
    fills its flat shards parameter by parameter (never a full working copy). materialize=False leaves
    everything on meta, layout included (--plan: the start-up's accounting without allocating the model).
    measure: block 0 is measured for the start-up printout (report.run.measure_startup), before the layout."""
    configs = run.settings.axes
    run.model = shard.describe(GPT(run.config, seed=run.seed, dtype=run.master_dtype, device="meta",
                                   **pipeline.stage_of(configs.get("pipeline"), run)))  # a stage: its own blocks
    run.flops = mfu.flops_per_token(param_counts(run.config), run.config, run.seq_len,
                                    activation_shape(run).kernel)  # selective recomputes an unfused attention
    for axis in AXES:  # each swaps modules in place; its handle is what the rest of the run talks to
        if configs.get(axis.__name__) is not None:
            run.axes.append(axis.apply(run.model, run, configs[axis.__name__]))
    if run.config.selective_recompute:
        recompute.apply(run.model)
    if materialize and run.settings.args.zero != 3:  # ZeRO-3 fills its shards itself (build_layout)
        shard.materialize(run.model, run.device, run.model.initial_value)
    if measure:
        report.run.measure_startup(run)
    report.run.observe_axes(run)  # the accounting's clocks and counters subscribe to the algorithms
    run.layout = build_layout(run.model, run, materialize)
    run.schedule = next((a.schedule for a in run.axes if a.schedule is not None), GradientAccumulation())
    return run


def build_layout(model: GPT, run: Run, materialize: bool = True):
    """DDP (--zero 0) or ZeRO 1/2/3 (zero.py) over each parameter's data-parallel group."""
    args, coords = run.settings.args, run.mesh.coordinates()
    if args.compile:
        compile_blocks(model)  # per block: its gradient hooks fire when its backward ends (model.compile_blocks)
    groups = {name: run.mesh.group(name) for name in ("dp_cp", "expert_dp")}  # dense, experts
    layout = build_data_parallel(model, run, groups, coords, materialize)
    shadow = next((axis for axis in run.axes if axis.name == "redundancy"), None)
    if shadow is not None:  # --pp-redundant: the successor's shadow is updated after the stage
        return redundancy.RedundantLayout(layout, shadow)
    # DiLoCo (resilience/diloco.py): the layout above runs inside one replica; every H steps the replicas' outer step
    return DiLoCoLayout(layout, run.settings.diloco, run.mesh) if run.settings.diloco else layout


def build_data_parallel(model: GPT, run: Run, groups: dict, coords: dict, materialize: bool):
    """DDP or ZeRO 1/2/3 over `groups`; the update's norm over the world, or over one DiLoCo replica. With
    --optimizer muon the blocks' matrices take Muon (optimizers/), its Newton-Schulz in the compute dtype (fp32
    under fp16, whose range NS's polynomial does not need but whose 11-bit precision it would lose)."""
    args = run.settings.args
    update_group = run.mesh.group("replica") if run.settings.diloco else None
    ns_dtype = torch.float32 if run.compute_dtype == torch.float16 else run.compute_dtype
    muon = replace(run.settings.muon, ns_dtype=ns_dtype) if run.settings.muon else None
    if args.zero:  # shards the optimizer state (1), + gradients (2), + weights (3) over dp×cp
        config = ZeroConfig(args.zero, lr=args.lr, weight_decay=args.weight_decay, betas=(args.beta1, args.beta2),
                            param_dtype=run.param_dtype, master_dtype=run.master_dtype, bucket_mb=args.bucket_mb,
                            micro_batches=run.micro_batches,  # m > 1: gradients summed in master_dtype
                            matrices=ZeroMuon(muon, run.mesh.group("tp")) if muon else None)
        device = run.device if materialize else None  # stage 3 fills its shards of a meta model on it
        pp_config = run.settings.axes.get("pipeline")
        if args.zero >= 2 and pp_config is not None:  # units per chunk, gathers and reductions by the schedule
            return pipeline_layout(model, config, groups, coords, device, pp_config, run.config.n_layer,
                                   run.mesh.index("pp"), run.micro_batches)
        if args.offload:  # the optimizer's shard in host memory, the update on the host (parallel/offload.py)
            return OffloadZeroLayout(model, config, groups, coords, update_group, OffloadConfig(args.offload))
        if args.zero < 3:
            return ZeroLayout(model, config, groups, coords, update_group)
        return Zero3Layout(model, config, groups, coords, device)  # FP8 weights carry their codec (fp8.convert)
    reduction = lowbit.gradient_reduction(run.settings.axes.get(lowbit.__name__), run.mesh)  # --dp-comm-bits 4
    ddp = DistributedDataParallel(model, groups=groups, bucket_mb=args.bucket_mb, reduction=reduction)
    if muon:
        adamw = dict(lr=args.lr, weight_decay=args.weight_decay, betas=(args.beta1, args.beta2))
        return MuonDDPLayout(ddp, muon, adamw, coords, update_group, run.mesh.group("tp"))
    optimizer = build_adamw(model.parameters(), args.lr, args.weight_decay, (args.beta1, args.beta2))
    return DDPLayout(ddp, optimizer, coords, update_group)


def main(argv=None):
    # The job's wall time by cause (resilience/goodput.py), from the process's creation (run as a program) or from this
    # call (argv given: a caller that runs several in one process, as the tests do).
    clock = goodput.Clock(started=None if argv is None else time.time())
    if argv is None and elastic.LAUNCHER_ENV in os.environ:  # a worker torchrun started: it ends with its launcher
        elastic.stop_with_the_launcher()
    settings = flags.parse(argv, AXES)  # a bad flag: one line, exit status 2, before any rank waits
    if settings.args.plan or settings.args.plan_search:  # size the layout on meta in a fake process group
        run_plan_py(sys.argv[1:] if argv is None else list(argv))
    # Every collective the run issues is traced, filed by phase: startup, step (the default), eval, ckpt, sample,
    # end; the table at the end shows them all, and checks the step's against the axes' predictions.
    with CommTracer() as tracer:
        train(settings, tracer, clock)


def run_plan_py(argv: list) -> NoReturn:
    """--plan, --plan-search: this process becomes `python plan.py` with the same flags. plan.py builds on this
    file (train.compose on meta), so train.py runs it as a program rather than importing it: imports go one way."""
    sys.stdout.flush()  # exec drops what is still buffered
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "plan.py"),
                              *argv])


@dataclass
class Training:
    """What train's steps share: the run, its data, its schedules, the checkpointer, where the loop stands."""

    run: Run
    corpus: data.Corpus
    train_tokens: data.TokenFile
    val_tokens: data.TokenFile
    sampler: data.BatchSampler
    val_sampler: data.EvalSampler
    lr_schedule: LRSchedule
    scaler: DynamicLossScaler
    machine: object  # cpu_probe.machine_model: the time model of this machine
    clock: goodput.Clock  # the goodput ledger: train.py names the phases, the clock times them
    checkpointer: ckpt.Checkpointer | None = None
    start_step: int = 0  # a resumed run starts at its checkpoint's step
    step: int = 0  # the step the loop is at (an interrupt reports it)
    completed: int = 0  # optimizer steps done (a takeover agrees on it)
    progress: report.run.Progress | None = None
    step_peak: report.run.StepPeak | None = None  # on a CPU, the profiled step's memory
    printed_startup: str = ""  # the start-up's printout (--tensorboard shows it as text)
    metrics: report.metrics.Metrics | None = None  # --metrics-file and --tensorboard (rank 0 writes)


def train(settings: Settings, tracer: CommTracer, clock: goodput.Clock | None = None):
    """Start-up, the checkpointer (and a resume), the loop, the end's measured-vs-predicted and goodput tables."""
    args, clock = settings.args, clock or goodput.Clock()
    with tracer.phase("startup"), clock.phase("startup"):
        t = start_training(settings, tracer, clock)
    if args.ckpt_dir:
        with tracer.phase("ckpt"), clock.phase("restore"):
            open_checkpointer(t)
    if args.init_from and t.start_step == 0:  # where fine-tuning starts from: the imported model's val loss
        with tracer.phase("eval"), clock.phase("eval"):
            print0(f"init-from: val loss {evaluate(t.run, t.val_tokens, t.val_sampler):.6f} before training (the"
                   f" first {min(args.eval_batches, t.val_sampler.num_batches)} validation batches, as every eval)")
    train_loop(t, tracer)
    with tracer.phase("end"), report.metrics.captured() as printed:  # the end's printout: TensorBoard's text too
        dist.barrier()  # every rank is done: the table below is complete
        progress = t.progress
        print0(time_model.check_line(t.run, t.machine, progress.seconds, progress.steps))
        report.run.print_end(t.run, max(0, args.steps - t.start_step), progress.seconds, progress.steps, t.step_peak)
        step_rate = t.run.tokens_per_step * progress.steps / progress.seconds if progress.steps else 0.0
        print0("\n".join(clock.lines(t.run.tokens_per_step * max(args.steps, t.start_step), step_rate,
                                      t.run.flops.model, t.run.peak[0], t.run.mesh.shape.world_size,
                                      under_load=mfu.peak_under_load(t.run.peak[1]))))
    t.metrics.text("end", printed.getvalue())
    t.metrics.close()
    dist.destroy_process_group()


def start_training(settings: Settings, tracer: CommTracer, clock: goodput.Clock) -> Training:
    """The run composed (init-from's weights in it), the peak FLOP/s, the start-up printout, the schedules and
    the samplers."""
    args = settings.args
    run, corpus = start_run(settings, tracer)  # device, process groups, mesh, seeds, the token cache
    train_tokens, val_tokens = data.TokenFile(corpus.train_path), data.TokenFile(corpus.val_path)
    compose(run, measure=True)
    if args.init_from:  # the weights of step 0, read as a resharding resume reads (a checkpoint overrides them)
        init_from(run, args.init_from)
    run.peak = mfu.shared_peak(run.device, *mfu.detect_peak_flops(run.device, settings.dtype, args.peak_tflops))
    run.peak = format_flops.run_peak(run, run.peak)  # a precision recipe: the format-weighted peak P_w
    run.flops = report.muon.with_newton_schulz(run)  # --optimizer muon: the hardware does NS too (one all_reduce)
    for name, group in run.mesh.groups.items():
        tracer.name_group(group, name)
    with report.metrics.captured() as printed:  # --tensorboard shows it as text
        report.run.print_startup(run)
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, args.steps // 20)
    lr_schedule = LRSchedule(args.lr, warmup, args.steps, args.min_lr if args.min_lr is not None else args.lr / 10)
    scaler = DynamicLossScaler(enabled=settings.dtype == "fp16")
    try:  # the same on every rank: a corpus too small for the batch fails them all alike
        sampler = data.BatchSampler(len(train_tokens), run.seq_len, args.global_batch, args.seed)
        val_sampler = data.EvalSampler(len(val_tokens), run.seq_len, args.global_batch)
    except ValueError as e:
        fail(f"{e} (--data {args.data or 'the built-in corpus'})")
    # The time model of this machine (CPU: measured, with one forward-only pass over a validation batch; collective)
    machine = cpu_probe.machine_model(run, args, local_batches(run, val_sampler, val_tokens, 0))
    return Training(run, corpus, train_tokens, val_tokens, sampler, val_sampler, lr_schedule, scaler, machine, clock,
                    printed_startup=printed.getvalue())


def open_checkpointer(t: Training, resume: bool = True) -> None:
    """--ckpt-dir's Checkpointer, and --resume's step, layout, scaler and sampler cursor read from it."""
    run, args = t.run, t.run.settings.args
    run_record = dict(steps=args.steps, lr=args.lr, min_lr=t.lr_schedule.min_lr, seed=args.seed,
                      warmup_steps=t.lr_schedule.warmup_steps, global_batch=args.global_batch,
                      seq_len=run.seq_len, model=run.config.architecture(),  # read by export_hf.py, sample.py
                      dropout=run.config.dropout,  # how it trained: export_hf.py's config.json says it
                      data=os.path.basename(os.path.dirname(t.corpus.train_path)))  # the corpus and tokenizer
    try:  # every rank raises a CheckpointError together (the verdicts are all-gathered)
        config = ckpt.CheckpointConfig(args.ckpt_dir, args.keep, args.async_ckpt, exclusive=True,
                                       lock=run.settings.ckpt_lock, run_record=run_record,  # flags.parse took it
                                       drop_state=args.drop_state)
        t.checkpointer = ckpt.Checkpointer(config, run.mesh, [*run.axes, t.clock], run.device, log=print0,
                                           on_save=lambda stats: report.run.print_save(stats, args.mtbf_hours))
        if args.resume and resume:  # the batch of step s depends only on (seed, s, B_global): resuming sets the cursor
            t.start_step = t.checkpointer.resume(args.resume, run.layout, t.scaler, t.sampler, args.seed)
        finished = t.start_step and t.checkpointer.resumed_run.get("steps") == t.start_step
        if finished:  # a new leg after a finished run (its last step): no failure, nothing lost, no restart
            t.clock.continues_a_finished_run()
            print0(f"resumed the last step ({t.start_step}) of a run that had finished: a new job goes on from it")
        elif args.elastic and t.start_step:  # a restarted world: the one that wrote the checkpoint, and this one
            print0(elastic.restart_line(elastic.saved_mesh(args.ckpt_dir, t.start_step), run.mesh.shape,
                                        t.start_step, args.global_batch, run.micro_batch_size))
    except ckpt.CheckpointError as e:
        fail(str(e))
    if t.start_step >= args.steps:  # every rank loaded the same step: they fail together
        fail(f"nothing to train: the checkpoint in --ckpt-dir {args.ckpt_dir} is at step {t.start_step} and --steps is"
             f" {args.steps}; raise --steps to train on (sample.py samples a checkpoint)")
    if args.init_from and t.start_step:  # a restarted fine-tune: its checkpoint, not the import, is where it stands
        print0(f"init-from {args.init_from}: its weights replaced by the checkpoint of step {t.start_step}")


def train_loop(t: Training, tracer: CommTracer) -> None:
    """Steps start_step .. --steps - 1, then the files closed and the sample; a signal ends it in one line."""
    run, args = t.run, t.run.settings.args
    t.metrics = report.metrics.Metrics(args.metrics_file, args.tensorboard, run.mesh.rank, append=t.start_step > 0)
    t.metrics.text("startup", t.printed_startup)
    t.progress = report.run.Progress(t.start_step, args.steps, mfu.peak_under_load(run.peak[1]))
    report.run.watch_saved_activations(run)  # the first step counts the bytes saved for backward
    if run.device.type == "cuda":  # the peak of training, not of start-up
        torch.cuda.reset_peak_memory_stats(run.device)
    # On a CPU, the second step's host memory is profiled (memory.MemoryTimeline; the first allocates AdamW's moments
    # and measures the saved activations, so its state is not steady); its time is left out of the mean (the
    # profiler slows it) when another timed step remains. CUDA's allocator reports its own peak.
    peak_step = t.start_step + 1 if run.device.type == "cpu" and args.steps - t.start_step >= 2 else None
    peak_in_mean = args.steps - t.start_step < 3  # no other timed step would remain
    # Step s + 1's micro-batches are read (pinned, on CUDA) while step s trains, then copied without blocking.
    prefetched = data.Prefetcher(lambda s: local_batches(run, t.sampler, t.train_tokens, s), run.device, args.steps - 1)
    t.step = t.completed = step = t.start_step
    with ending_cleanly_on_signals(lambda: interrupted(t.checkpointer, t.step)):
        while step < args.steps:
            t.step = step
            try:
                record = timed_step(t, step, prefetched, step == peak_step, peak_in_mean)
                if not (math.isfinite(record["loss"]) and not record["skipped"]) and t.scaler.scale <= 1.0:
                    stop_at_non_finite(t, step, record, prefetched)  # before this step's line, metrics or save
                t.completed = step + 1
                after_step(t, step, record, tracer)
                step += 1
            except RuntimeError as error:  # --pp-redundant: a lost stage's predecessor takes it over
                if not any(axis.name == "redundancy" for axis in run.axes):
                    raise
                step = take_over(t, error, tracer)  # the step to run next: the interrupted one, replayed
                if run.mesh.rank == 0 and t.metrics.wanted and t.metrics.file is t.metrics.board is None:
                    t.metrics = report.metrics.Metrics(args.metrics_file, args.tensorboard, 0, append=True)
        prefetched.close()
        if t.checkpointer:
            with tracer.phase("ckpt"), t.clock.phase("ckpt"):
                t.checkpointer.close()
        if args.sample_tokens:
            with tracer.phase("sample"), t.clock.phase("eval"):
                sample(run, t.val_tokens, t.corpus.tokenizer_name)


def take_over(t: Training, error: RuntimeError, tracer: CommTracer) -> int:
    """--pp-redundant lost a stage (resilience/redundancy.py, the takeover): the survivors meet again, the run is
    composed on P − 1 stages and filled from this process's memory (its stage and its shadow), the shadows are
    synced, and the survivors agree on the steps done: the loop replays the interrupted one. One line; a loss
    that redundancy cannot absorb ends the run, naming the newest committed checkpoint (never touched here)."""
    run, began = t.run, time.perf_counter()
    handle = next(axis for axis in run.axes if axis.name == "redundancy")
    memory = {piece.key: piece.tensor for piece in [*run.layout.state_pieces(), *handle.state_pieces()]}
    adam_steps, old_world = run.layout.optimizer_step_count, run.mesh.shape.world_size
    bounds = redundancy.stage_bounds(run.settings.axes["pipeline"], run.config.n_layer)
    try:
        with t.clock.phase("restart"), tracer.phase("startup"):
            plan = redundancy.lose_peer(handle, run.mesh, bounds, run.settings.backend)
            if t.checkpointer:
                t.checkpointer.abandon()  # a save cut short is never committed; the committed ones stay
            settings = redundancy.settings_after(run.settings, plan, handle)
            mesh = build_mesh(settings.shape, timeout=redundancy.short_timeout(handle))  # a loss now fails soon
            rebuilt = compose(replace(run, settings=settings, mesh=mesh, axes=[], layout=None))
            copied = redundancy.refill(rebuilt, memory, adam_steps)
            if len(set(agree(str(t.completed)) if dist.get_world_size() > 1 else [t.completed])) > 1:
                raise redundancy.TakeoverError("the survivors disagree on the steps done (a loss inside the update)")
            for name, group in rebuilt.mesh.groups.items():
                tracer.name_group(group, name)
            redundancy.restore_timeouts(rebuilt.mesh)
            vars(run).update(vars(rebuilt))
            if t.checkpointer:
                open_checkpointer(t, resume=False)
    except RuntimeError as e:  # a TakeoverError, or another loss during the takeover (a peer's p2p or store)
        print(redundancy.impossible_line(error, e, run.settings.args.ckpt_dir), file=sys.stderr, flush=True)
        sys.exit(1)  # every survivor says it: no group is left to agree which one prints
    print0(redundancy.takeover_line(plan, t.step, old_world, copied, time.perf_counter() - began, t.completed))
    return t.completed


def timed_step(t: Training, step: int, prefetched, profiled: bool, peak_in_mean: bool) -> dict:
    """One optimizer step, timed (and its host memory profiled when `profiled`): its report.run.step_record."""
    run, args = t.run, t.run.settings.args
    lr = t.lr_schedule(step)
    run.layout.set_lr(lr)
    with t.clock.phase("input"):
        batches = prefetched.get(step)
    began = time.perf_counter()
    with MemoryTimeline() if profiled else nullcontext() as memory, t.clock.phase("train"):
        outcome = train_step(run.layout, t.scaler, batches, run.mesh.group("dp_cp"), args.grad_clip,
                             run.autocast, run.device, model=run.model, schedule=run.schedule, axes=run.axes,
                             data_size=run.mesh.shape.replica_dp)
        if run.device.type == "cuda":
            torch.cuda.synchronize()
    seconds = time.perf_counter() - began
    if profiled:
        t.step_peak = report.run.StepPeak(step, memory.peak, peak_in_mean)
    return report.run.step_record(run, step, lr, outcome,
                                  t.progress.tick(step, seconds, timed=not profiled or peak_in_mean), t.scaler)


def after_step(t: Training, step: int, record: dict, tracer: CommTracer) -> None:
    """The eval (every --eval-every steps and after the last), the printed line, the metrics file's line (the
    first step's with the start-up's figures, the last one's with the end's: report/metrics.py), the checkpoint
    (every --ckpt-every steps and after the last)."""
    run, args = t.run, t.run.settings.args
    last = step == args.steps - 1
    if (args.eval_every and step > 0 and step % args.eval_every == 0) or last:
        with tracer.phase("eval"), t.clock.phase("eval"):
            record["val_loss"] = evaluate(run, t.val_tokens, t.val_sampler)
    if step % args.log_every == 0 or last or "val_loss" in record or t.progress.silent_too_long():
        report.run.print_step(record, t.progress, run.axes)
    if t.metrics.wanted and step == t.start_step:  # the time model's step and the memory by kind, predicted
        record["startup"] = report.run.startup_figures(run, time_model.predicted_step(run, t.machine))
    if t.metrics.wanted and last:  # measured (CUDA's peak: collective, every rank)
        record["end"] = report.run.end_figures(run, t.progress.seconds, t.progress.steps, t.step_peak)
    t.metrics.step(record)
    if t.checkpointer:
        with tracer.phase("ckpt"), t.clock.phase("ckpt"):
            t.checkpointer.step_end(step + 1, args.ckpt_every, last, run.layout, t.scaler, t.sampler)


def start_run(settings: Settings, tracer: CommTracer) -> tuple[Run, data.Corpus]:
    """Join the process group, build the mesh, seed, and make the token cache (each node's local rank 0
    builds, the others wait)."""
    args, device = settings.args, settings.device  # chosen with the flags: a wrong one fails before any rank waits
    set_numerics(args.tf32, args.deterministic)  # before any kernel runs: stated choices, not defaults
    rank, _ = init_distributed(settings.backend, device)
    mesh = build_mesh(settings.shape, rank)
    # Dropout differs per rank, like independent devices, except across a TP group, whose ranks hold copies of
    # the same activations (tensor_parallel.TensorParallelRNG forks it for split ones). Init is seeded apart.
    torch.manual_seed(args.seed + rank // mesh.size("tp"))
    # Each node's local rank 0 builds (or finds) the token cache under its own --out-dir, the others wait and
    # read it: nodes need no shared filesystem (the bytes are deterministic, so every node's are the same), and
    # on a shared one the cache is written atomically (data.prepare_corpus), so two builders cannot collide.
    cache_dir, local_rank = os.path.join(args.out_dir, "data"), int(os.environ.get("LOCAL_RANK", "0"))
    error = None
    if local_rank == 0:
        try:  # a corpus that cannot be read or is too small fails here, on the builders only
            corpus = data.prepare_corpus(args.data, args.tokenizer, cache_dir, log=lambda line: print(line, flush=True))
        except (ValueError, OSError) as e:
            error = str(e)
    errors = agree(error)  # the barrier: every node's cache is ready, or every rank ends with the error
    if errors:
        fail(errors[0])
    if local_rank != 0:
        corpus = data.prepare_corpus(args.data, args.tokenizer, cache_dir, log=lambda *a, **k: None)
    config = settings.model  # its vocabulary: the tokenizer's (the corpus's) or --init-from's, padded (cli/flags.py)
    compute = DTYPES[settings.dtype]
    # ZeRO's working weights and gradients are the compute dtype; the masters and Adam moments stay fp32. fp16
    # is Micikevicius et al. 2018's recipe: fp16 weights and gradients, fp32 masters, dynamic loss scaling.
    run = Run(settings=settings, mesh=mesh, config=config, device=device, seed=args.seed, compute_dtype=compute,
              autocast=torch.autocast(device.type, dtype=compute) if settings.dtype != "fp32" else nullcontext(),
              param_dtype=compute if args.zero else torch.float32, tracer=tracer)
    return run, corpus


def init_from(run: Run, path: str) -> int:
    """--init-from DIR: the layout's weights (param and master pieces: any mesh, any ZeRO stage) from a Hugging
    Face GPT-2 directory, through ckpt's resharding path (hf.load_into); every rank reads the tensors it holds
    a piece of. One line on success; one line and exit status 2 on every rank if any rank fails. Returns the
    bytes this rank read."""
    began, error, read = time.perf_counter(), None, 0
    try:
        directory = hf.HFDirectory(path, run.config.vocab_size)
        read = hf.load_into(directory, run.layout.state_pieces())
    except hf.HFError as e:
        error = f"--init-from {path}: {e}"
    errors = agree(error)
    if errors:
        fail(errors[0])
    config, files = run.config, sorted(set(directory.weight_files.values()))
    padding = (f", padded to {config.vocab_size} rows ({config.vocab_size - config.real_vocab_size} never predicted)"
               if config.real_vocab_size else "")
    print0(f"init-from {path}: {', '.join(files)}; GPT-2 n_layer={config.n_layer} n_head={config.n_head}"
           f" n_embd={config.n_embd} vocab={directory.shape.vocab_size}{padding}, GELU {config.gelu}; rank 0 read"
           f" {mfu.format_bytes(read)} in {(time.perf_counter() - began) * 1e3:.0f} ms")
    return read


def agree(error: str | None) -> list:
    """Every rank's error (None: none), gathered: what every rank decides on together (collective)."""
    if dist.get_world_size() == 1:
        return [error] if error is not None else []
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return [e for e in errors if e is not None]


def set_numerics(tf32: bool, deterministic: bool) -> None:
    """TF32 and determinism, set explicitly either way (torch's own defaults differ between matmuls and cuDNN).

    --deterministic: every CUDA op takes its deterministic kernel or raises (the SDPA backward, index and
    scatter adds, the NLL loss's reduction), and cuBLAS gets a fixed workspace (CUBLAS_WORKSPACE_CONFIG must
    be set before its first call): the bitwise-replay contract of ckpt.py then holds on GPUs as on CPUs.
    Without it, a GPU run replays to float tolerance only."""
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    if deterministic:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def local_batches(run: Run, sampler, tokens, step: int, read=None) -> list:
    """This rank's m micro-batches of step `step`, each (x, y, pos); an axis may cut them (context parallel)."""
    mesh, read = run.mesh, read or sampler.get_batch
    batches = [(*read(tokens, step, mesh.index("dp"), mesh.size("dp"), run.micro_batch_size, i), None)
               for i in range(run.micro_batches)]
    for axis in run.axes:
        batches = axis.shard_batches(batches)
    return batches


@torch.no_grad()
def evaluate(run: Run, tokens, sampler) -> float:
    """Mean val loss over the first --eval-batches global batches of the validation split (always the same),
    through the step's schedule (the pipeline's passes through its stages) with dropout off."""
    run.model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=run.device)  # [loss_sum, tokens]
    for batch in range(min(run.settings.args.eval_batches, sampler.num_batches)):
        micro_batches = local_batches(run, sampler, tokens, batch)
        totals += torch.stack(run.schedule.forward_only(run.layout, run.model, micro_batches, run.autocast,
                                                        run.device))
    if run.mesh.size("dp_cp") > 1:
        dist.all_reduce(totals, group=run.mesh.group("dp_cp"))
    if run.settings.diloco:  # each replica read its D/R ranks' slices: the whole eval batch over the replicas
        dist.all_reduce(totals, group=run.mesh.group("diloco"))
    run.model.train()
    return float(totals[0] / totals[1])


@torch.no_grad()
def sample(run: Run, val_tokens, tokenizer_name):
    """Every rank generates the same tokens in lock step (the same prompt and seed), so that every group whose
    collectives the forward uses (TP, the experts' all-to-all, ZeRO-3's gathers) takes part; rank 0 prints.
    Through the layout as trained: ZeRO-3 gathers one block at a time and frees it after each forward."""
    prompt = torch.from_numpy(val_tokens.tokens[:32].astype("int64"))[None].to(run.device)
    run.model.eval()
    with ExitStack() as stack:
        for axis in run.axes:
            stack.enter_context(axis.sampling())
        out = run.model.generate(prompt, run.settings.args.sample_tokens, temperature=0.8, top_k=50,
                                 generator=torch.Generator(device=run.device).manual_seed(run.seed))
    run.model.train()
    print0("sample (prompt from the val split, then the model):")
    print0(data.get_tokenizer(tokenizer_name).decode(out[0].tolist()))


class Interrupted(Exception):
    """SIGINT (Ctrl-C) or SIGTERM (torchrun stopping its workers) during training."""


@contextmanager
def ending_cleanly_on_signals(report_stop):
    """Turn SIGINT/SIGTERM into one line instead of a KeyboardInterrupt traceback on every rank: `report_stop()`
    says where the run stopped, then the process exits with 128 + the signal, as a killed one would. A peer
    that stopped first can make this rank's collective fail before its own signal arrives: that error, once a
    signal has been received, is part of the same stop. No collective runs on the way out (peers are gone)."""
    received = []

    def on_signal(signum, frame):
        received.append(signum)
        raise Interrupted(signal.Signals(signum).name)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    except (Interrupted, RuntimeError) as e:
        if isinstance(e, RuntimeError) and not received:
            raise
        report_stop()
        os._exit(128 + received[0])  # no atexit, no process-group teardown: the peers are stopping too
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def stop_at_non_finite(t: Training, step: int, record: dict, prefetched) -> NoReturn:
    """A step whose loss or gradient is not finite, once the loss scaler has nothing left to try (fp16 halves its
    scale at each skipped step, down to 1; without one, at once): the run stops here with one line, on every rank
    alike (the loss and the skip are the world's), exit status 1. No checkpoint of this step or later is written:
    the newest committed one, the last good state, stays the newest (a background save of it is finished)."""
    what = "loss" if not math.isfinite(record["loss"]) else "gradients"
    prefetched.close()
    t.metrics.close()  # the steps before it stay in the metrics file and the event files
    if t.checkpointer is not None:
        t.checkpointer.close()
    if dist.get_rank() == 0:
        committed = ckpt_files.newest_committed(t.checkpointer.root) if t.checkpointer else None
        print(f"non-finite {what} at step {step} (loss {record['loss']}, grad norm {record['grad_norm']}): stopping;"
              f" a learning rate or a scale too large for this run? (--lr, --moe-route-scale, --diloco-outer-lr)"
              + (f"; the newest committed checkpoint is step {committed[0]} ({committed[1]})" if committed else ""),
              file=sys.stderr, flush=True)
    dist.destroy_process_group()
    sys.exit(1)


def interrupted(checkpointer, step: int) -> None:
    """Rank 0's one line on a stop: the step reached and the newest committed checkpoint. The background save
    that was running, if any, is abandoned: its temporary directory is removed (the next start would too)."""
    if dist.get_rank() != 0:
        return
    line = f"interrupted at step {step}"
    if checkpointer is not None:
        checkpointer.abandon()
        committed = ckpt_files.newest_committed(checkpointer.root)
        line += (f"; the newest committed checkpoint is step {committed[0]} ({committed[1]}): --resume latest"
                 f" continues from it" if committed else "; no checkpoint was committed")
    print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
