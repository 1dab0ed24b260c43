"""Train the GPT on a mesh of devices: flags → mesh → model → the axes (AXES) → layout → schedule → loop → printouts.

    python train.py                                   # one process, `small` preset, built-in corpus
    torchrun --nproc_per_node 2 train.py --preset tiny --steps 50

Each optimizer step consumes B_global = D·m·B_μ sequences (`--global-batch`, `--micro-batch`; the number of
micro-batches m is derived). Every micro-batch backpropagates loss_sum / tokens_in_global_batch, so all
gradient reductions are sums and the update equals the single-device one on the whole global batch.

The run prints its accounting: at start the mesh, parameters, predicted memory, FLOPs per token, the peak
assumed and the bytes each group will send per step; every step the loss, lr, grad norm, throughput and MFU;
at the end measured against predicted.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import signal
import sys
import time
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import NoReturn

import torch
import torch.distributed as dist

import ckpt
import comm
import context_parallel
import data
import fp8
import mfu
import moe
import pipeline
import tensor_parallel
from ddp import DDPLayout, DistributedDataParallel
from mesh import Mesh, axis_groups, build_mesh, choose_device_and_backend, infer_mesh_shape, init_distributed
from model import GPT, GPTConfig, compile_blocks, config_from_preset, counts_here
from optim import DynamicLossScaler, LRSchedule, build_adamw, update_messages
from step import GradientAccumulation, train_step
from zero import ZeroLayout

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# ZeRO's working weights and gradients; the masters and Adam moments stay fp32. fp16 is Micikevicius et al.
# 2018's recipe: fp16 weights and gradients, fp32 masters, dynamic loss scaling (the one update order skips
# an overflowing step on every rank and halves the scale).
ZERO_PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class FlagError(ValueError):
    """A flag combination that cannot run; raised before any rank waits on another."""


class _Parser(argparse.ArgumentParser):
    """argparse whose errors (an unknown flag, a choice not offered) are FlagErrors: like every other flag
    error they end the run with one line, printed once, not with argparse's usage text on every rank."""

    def error(self, message: str) -> NoReturn:
        raise FlagError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--preset", default="small", help="tiny | small | gpt2 (124M)")
    g.add_argument("--n-layer", type=int)
    g.add_argument("--n-head", type=int)
    g.add_argument("--n-embd", type=int)
    g.add_argument("--seq-len", type=int, help="tokens per sequence (default: the preset's block size)")
    g.add_argument("--dropout", type=float)
    g.add_argument("--no-bias", action="store_true", help="no biases in linears and LayerNorms")
    g.add_argument("--activation-checkpointing", action="store_true", help="recompute each block in backward")
    g = p.add_argument_group("data")
    g.add_argument("--data", help="a text file to train on (default: the Python standard library's source)")
    g.add_argument("--tokenizer", default="byte", choices=["byte", "gpt2"])
    g.add_argument("--out-dir", default="out", help="token cache, metrics and checkpoints go here")
    g = p.add_argument_group("optimization")
    g.add_argument("--steps", type=int, default=150)
    g.add_argument("--global-batch", type=int, default=16, help="sequences per optimizer step (B_global)")
    g.add_argument("--micro-batch", type=int, default=None, help="sequences per rank per micro-step (B_μ)")
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=None, help="cosine floor (default lr/10)")
    g.add_argument("--warmup-steps", type=int, default=None, help="default: 5%% of --steps")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--beta1", type=float, default=0.9)
    g.add_argument("--beta2", type=float, default=0.95)
    g.add_argument("--grad-clip", type=float, default=1.0, help="clip the global grad norm to this (0: off)")
    g.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="autocast compute dtype; auto: bf16 where the device has bf16 matrix units (CUDA, CPUs with"
                        " AMX or AVX512-BF16), else fp32 (a CPU without them emulates bf16, several times slower)")
    g.add_argument("--seed", type=int, default=1337)
    g.add_argument("--tf32", action="store_true",
                   help="fp32 matmuls on TF32 tensor cores (Ampere and newer: ~8x the FP32 peak, 10-bit mantissa"
                        " products); default off: --dtype fp32 means full FP32 (the peak for MFU follows)")
    g.add_argument("--deterministic", action="store_true",
                   help="bitwise-reproducible CUDA kernels (torch.use_deterministic_algorithms, cuBLAS workspace"
                        " :4096:8): slower attention backward and scatter-adds; CPU runs are deterministic anyway")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile each transformer block (GPU speed): per block, gradient hooks still fire block"
                        " by block in backward, so DDP/ZeRO communication keeps overlapping it")
    g = p.add_argument_group("parallelism")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size T")
    g.add_argument("--pp", type=int, default=1, help="pipeline-parallel size P")
    g.add_argument("--cp", type=int, default=1, help="context-parallel size C")
    g.add_argument("--ep", type=int, default=1, help="expert-parallel size E")
    g.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage (0: plain DDP)")
    g.add_argument("--sp", action="store_true", help="sequence parallel (with --tp)")
    g.add_argument("--bucket-mb", type=float, default=25.0, help="DDP gradient bucket size in MiB")
    g.add_argument("--backend", choices=["nccl", "gloo"], help="default: nccl with GPUs, else gloo")
    g.add_argument("--pp-schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved", "zb"],
                   help="pipeline schedule (pipeline.py)")
    g.add_argument("--pp-virtual", type=int, default=2, help="model chunks per rank for --pp-schedule interleaved")
    g.add_argument("--trace-file", help="write one executed pipeline step as Chrome-trace JSON (Perfetto)")
    g.add_argument("--cp-impl", default="ring", choices=["ring", "ulysses"], help="context parallel attention")
    g.add_argument("--cp-balance", default="zigzag", choices=["zigzag", "contiguous"],
                   help="how the sequence is cut over the C ranks (zig-zag balances causal work)")
    fp8.add_arguments(p)  # --fp8 current|delayed|blockwise, --fp8-amax-history, --fp8-amax-algo, --fp8-margin
    g = p.add_argument_group("mixture of experts (moe.py)")
    g.add_argument("--moe-experts", type=int, default=0, help="experts N per MoE block (0: dense MLP)")
    g.add_argument("--moe-topk", type=int, default=2, help="experts per token k")
    g.add_argument("--moe-every", type=int, default=1, help="every n-th block is MoE")
    g.add_argument("--moe-capacity-factor", type=float, default=0.0, help="capacity per expert ⌈B_μ·s·k/N·f⌉ of each micro-batch (0: dropless)")
    g.add_argument("--moe-aux-coef", type=float, default=0.01, help="load-balance loss coefficient α")
    g.add_argument("--moe-z-coef", type=float, default=0.001, help="router z-loss coefficient β")
    g = p.add_argument_group("evaluation and reporting")
    g.add_argument("--eval-every", type=int, default=100, help="val loss every N steps (0: only at the end)")
    g.add_argument("--eval-batches", type=int, default=4)
    g.add_argument("--log-every", type=int, default=10)
    g.add_argument("--sample-tokens", type=int, default=300, help="tokens sampled at the end (0: none)")
    g.add_argument("--metrics-file", help="write one JSON object per step to this file")
    g.add_argument("--peak-tflops", type=float, help="peak TFLOP/s per device for MFU (default: table or measured)")
    g = p.add_argument_group("checkpoints (ckpt.py)")
    g.add_argument("--ckpt-dir", help="save sharded checkpoints under this directory (one step-XXXXXXXX per save)")
    g.add_argument("--ckpt-every", type=int, default=0, help="save every N steps (0: only after the last step)")
    g.add_argument("--keep", type=int, default=2, help="keep the newest K committed checkpoints (K >= 2)")
    g.add_argument("--resume", nargs="?", const="latest",
                   help="'latest' (the newest good checkpoint, if any; the default with no value) or a step number")
    g.add_argument("--async-ckpt", action="store_true", help="persist checkpoints on a background thread")
    g.add_argument("--mtbf-hours", type=float, default=24.0,
                   help="mean time between interruptions, for the suggested interval sqrt(2·C·M)")
    return p


# Ranges of the numeric flags: (flag, attribute, lowest, exclusive lowest?, highest or None). Every float must
# also be finite: NaN passes every comparison, so `nan < 0` would let it through.
_AT_LEAST_1 = ("steps", "log_every", "eval_batches", "micro_batch", "global_batch", "n_layer", "n_head", "n_embd",
               "seq_len", "pp_virtual", "fp8_amax_history", "moe_topk", "moe_every")
_AT_LEAST_0 = ("eval_every", "warmup_steps", "ckpt_every", "sample_tokens", "moe_experts", "fp8_margin",
               "weight_decay", "grad_clip", "moe_capacity_factor", "moe_aux_coef", "moe_z_coef", "min_lr")
_POSITIVE = ("lr", "bucket_mb", "mtbf_hours", "peak_tflops")
_FRACTION = ("beta1", "beta2", "dropout")  # in [0, 1)
# Flags that only mean something with another one: (flag, attribute, what it needs, whether that is on).
_ONLY_WITH = (
    ("--pp-schedule", "pp_schedule", "--pp > 1", lambda a: a.pp > 1),
    ("--pp-virtual", "pp_virtual", "--pp-schedule interleaved", lambda a: a.pp_schedule == "interleaved"),
    ("--trace-file", "trace_file", "--pp > 1 (it draws the pipeline schedule)", lambda a: a.pp > 1),
    ("--cp-impl", "cp_impl", "--cp > 1", lambda a: a.cp > 1),
    ("--cp-balance", "cp_balance", "--cp > 1", lambda a: a.cp > 1),
    *((flag, flag[2:].replace("-", "_"), "--fp8", lambda a: a.fp8 is not None)
      for flag in ("--fp8-amax-history", "--fp8-amax-algo", "--fp8-margin")),
    *((flag, flag[2:].replace("-", "_"), "--moe-experts > 0", lambda a: a.moe_experts > 0)
      for flag in ("--moe-topk", "--moe-every", "--moe-capacity-factor", "--moe-aux-coef", "--moe-z-coef")),
    *((flag, flag[2:].replace("-", "_"), "--ckpt-dir", lambda a: a.ckpt_dir is not None)
      for flag in ("--ckpt-every", "--resume", "--async-ckpt", "--keep", "--mtbf-hours")),
)


def explicit_flags(argv) -> set:
    """The attributes the command line sets itself (not left at their defaults): argparse fills in a default
    only for attributes missing from the namespace it is given, so parse again into one where all are set."""
    parser, unset = build_parser(), object()
    names = vars(parser.parse_args(argv))
    given = vars(parser.parse_args(argv, namespace=argparse.Namespace(**{name: unset for name in names})))
    return {name for name, value in given.items() if value is not unset}


def validate_args(args, world_size: int, given=None):
    """Check every flag before any process group exists; return (mesh shape, micro-batches m, B_μ).

    given: the flags the command line set (explicit_flags), for the rules about flags that only mean something
    with another one; default: those whose value is not the default."""
    if given is None:
        defaults = vars(build_parser().parse_args([]))
        given = {name for name, value in vars(args).items() if name in defaults and value != defaults[name]}
    check_ranges(args)
    for flag, name, needs, on in _ONLY_WITH:
        if name in given and not on(args):
            raise FlagError(f"{flag} needs {needs}; without it the flag would be ignored")
    try:
        shape = infer_mesh_shape(world_size, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep)
    except ValueError as e:
        raise FlagError(str(e)) from None
    validate_zero_args(args)
    config = model_config(args)
    try:
        moe.check_flags(args.moe_experts, args.moe_topk, args.ep, shape.dp, shape.cp, args.moe_every,
                        args.moe_capacity_factor, config.n_layer, args.moe_aux_coef, args.moe_z_coef)
    except ValueError as e:
        raise FlagError(str(e)) from None
    if args.sp and args.tp == 1:
        raise FlagError("--sp (sequence parallel) needs --tp > 1")
    if args.min_lr is not None and args.min_lr > args.lr:
        raise FlagError(f"--min-lr {args.min_lr} is above --lr {args.lr}: the cosine schedule decays from --lr"
                        f" down to --min-lr")
    micro = args.micro_batch if args.micro_batch is not None else args.global_batch // shape.dp
    if micro < 1:
        raise FlagError(f"--global-batch {args.global_batch} must give each of D={shape.dp} data ranks a sequence")
    if args.global_batch % (shape.dp * micro):
        raise FlagError(
            f"--global-batch {args.global_batch} must be divisible by D × --micro-batch = {shape.dp} × {micro}"
            f" (B_global = D·m·B_μ)"
        )
    validate_paths(args)
    if args.seq_len is not None and args.seq_len > config.block_size:
        raise FlagError(f"--seq-len {args.seq_len} must be between 1 and the model's block size {config.block_size}")
    if args.tp > 1:
        config.vocab_size = vocab_size(args.tokenizer)
        try:
            tensor_parallel.check_divisible(config, args.tp, args.seq_len or config.block_size, args.sp)
        except ValueError as e:
            raise FlagError(str(e)) from None
    validate_checkpoint_args(args)
    m = args.global_batch // (shape.dp * micro)
    try:
        pipeline.check_flags(config.n_layer, args.pp, m, args.pp_schedule, args.pp_virtual, args.zero)
        context_parallel.check_flags(args.seq_len or config.block_size, args.cp, config.n_head, args.tp,
                                     args.cp_impl, args.cp_balance, config.dropout, args.sp)
        fp8.check_flags(args, config, args.tp, args.cp, micro, args.seq_len or config.block_size)
    except ValueError as e:
        raise FlagError(str(e)) from None
    return shape, m, micro


def check_ranges(args) -> None:
    """Each numeric flag is finite and in its range (the tables above), naming the flag and what it must be."""

    def bad(name, must):
        flag = "--" + name.replace("_", "-")
        return FlagError(f"{flag} must be {must}, got {getattr(args, name)}")

    for name in (*_AT_LEAST_0, *_POSITIVE, *_FRACTION):
        value = getattr(args, name)
        if isinstance(value, float) and not math.isfinite(value):
            raise bad(name, "a finite number")
    for name in _AT_LEAST_1:
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise bad(name, "at least 1")
    for name in _AT_LEAST_0:
        if getattr(args, name) is not None and getattr(args, name) < 0:
            raise bad(name, "at least 0")
    for name in _POSITIVE:
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise bad(name, "positive")
    for name in _FRACTION:
        if getattr(args, name) is not None and not 0.0 <= getattr(args, name) < 1.0:
            raise bad(name, "in [0, 1)")


def validate_paths(args) -> None:
    """The files the run reads exist and are text; the ones it writes can be written, checked now rather than
    at the first write (a trace file is written after all the training)."""
    if args.data is not None:
        if not os.path.isfile(args.data):
            raise FlagError(f"--data {args.data!r} is not a file; give a text file to train on, or leave --data out"
                            f" for the built-in corpus")
        if os.path.getsize(args.data) == 0:
            raise FlagError(f"--data {args.data!r} is empty; give a text file with something to train on")
        with open(args.data, "rb") as f:
            head = f.read(1 << 16)
        if b"\0" in head:
            raise FlagError(f"--data {args.data!r} is a binary file (it holds NUL bytes); give a UTF-8 text file")
    for flag, path in (("--out-dir", args.out_dir), ("--ckpt-dir", args.ckpt_dir)):
        if path is not None:
            check_writable(flag, path, directory=True)
    for flag, path in (("--metrics-file", args.metrics_file), ("--trace-file", args.trace_file)):
        if path is not None:
            check_writable(flag, path, directory=False)


def check_writable(flag: str, path: str, directory: bool) -> None:
    """`path` can be created (or is already there as the right kind): everything above it that exists is a
    writable directory. A file's directory must exist; a directory is created with its parents."""
    if path == "":
        raise FlagError(f"{flag} '' names nothing; give a path")
    path = os.path.abspath(path)
    if os.path.exists(path):
        if directory and not os.path.isdir(path):
            raise FlagError(f"{flag} {path!r} is a file, not a directory")
        if not directory and os.path.isdir(path):
            raise FlagError(f"{flag} {path!r} is a directory; give a file name")
    parent = os.path.dirname(path)
    if not directory and not os.path.isdir(parent):
        raise FlagError(f"{flag} {path!r}: the directory {parent!r} does not exist or cannot be written")
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise FlagError(f"{flag} {path!r} lies under {parent!r}, which is a file, not a directory")
    if not os.access(parent, os.W_OK):
        raise FlagError(f"{flag} {path!r}: the directory {parent!r} does not exist or cannot be written")


def validate_zero_args(args):
    """--zero 1|2|3 (zero.py) runs with fp32, bf16 or fp16 working weights and, at stage 3, hooks on each block."""
    if not args.zero:
        return
    if args.zero >= 2 and args.pp > 1:
        raise FlagError(f"--zero {args.zero} with --pp {args.pp}: sharded gradients would be reduce-scattered on"
                        f" every micro-batch of the pipeline schedule; use --zero 1 with pipeline parallel")
    if args.zero == 3 and args.activation_checkpointing:
        raise FlagError("--zero 3 with --activation-checkpointing: recomputing a block in backward reruns its"
                        " forward hooks, which would gather and free its weights out of schedule; use --zero 1 or 2")


def validate_checkpoint_args(args):
    if args.ckpt_dir is None:
        return
    if args.keep < 2:
        raise FlagError(f"--keep must be at least 2 (a good checkpoint must survive while the next is written),"
                        f" got {args.keep}")
    if args.resume is not None and args.resume != "latest" and not (args.resume.isdigit()):
        raise FlagError(f"--resume must be 'latest' or a step number, got {args.resume!r}")


def model_config(args):
    overrides = dict(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, dropout=args.dropout,
                     **moe.config_overrides(args))
    if args.no_bias:
        overrides["bias"] = False
    if args.activation_checkpointing:
        overrides["activation_checkpointing"] = True
    try:
        return config_from_preset(args.preset, **overrides)
    except ValueError as e:
        raise FlagError(str(e)) from None


def vocab_size(tokenizer: str) -> int:
    """The model's vocabulary for a tokenizer: bytes as they are, BPE padded (main() uses the same rule)."""
    if tokenizer == "byte":
        return data.ByteTokenizer.vocab_size
    return padded_vocab(data.GPT2Tokenizer.vocab_size)


def padded_vocab(vocab_size: int, multiple: int = 64) -> int:
    """Round the vocabulary up (50257 → 50304) so the head's matmul has friendly shapes."""
    return ((vocab_size + multiple - 1) // multiple) * multiple


# ---------------------------------------------------------------------------------------------------------
# The composition
# ---------------------------------------------------------------------------------------------------------

# The axes, in DESIGN.md's order of application (MoE/EP → TP → CP → PP → FP8). Each `apply(model, run)` swaps
# modules of the model in place and returns its handle, a step.Axis (None when its flag is off). Adding an
# axis adds a line here; the loop and the printouts only ever loop over the handles.
AXES = (
    moe.apply,
    tensor_parallel.apply,
    context_parallel.apply,
    pipeline.apply,
    fp8.apply,
)


@dataclass
class Run:
    """Everything one run is made of; the axes' `apply`, the loop and the printouts read it."""

    args: argparse.Namespace
    mesh: Mesh
    config: GPTConfig
    seq_len: int
    micro: int  # B_μ: sequences per micro-batch per data rank
    micro_batches: int  # m
    device: torch.device
    autocast: object  # torch.autocast(...) or nullcontext()
    compute_dtype: torch.dtype  # autocast's dtype (fp32 when off)
    param_dtype: torch.dtype  # the layout's working weights (ZeRO: bf16 under --dtype bf16; DDP: fp32)
    seed: int
    master_dtype: torch.dtype = torch.float32  # ZeRO's master weights and Adam moments
    model: GPT | None = None
    axes: list = field(default_factory=list)
    layout: object = None
    schedule: object = None
    tracer: comm.CommTracer = field(default_factory=comm.CommTracer)
    groups: dict = field(default_factory=dict)  # every named process group: the mesh's and the axes' own
    flops: mfu.FlopsPerToken | None = None
    peak: tuple = (0.0, "")  # (FLOP/s per device, where it came from)

    @property
    def tokens_per_step(self) -> int:
        return self.args.global_batch * self.seq_len


def main(argv=None):
    args = parse_flags(argv)  # a bad flag exits with status 2 on every rank, before any rank waits
    # Every collective the run issues is traced, filed by phase: startup, step (the default), eval, ckpt, sample,
    # end; the table at the end shows them all, and checks the step's against the axes' predictions.
    with comm.CommTracer() as tracer:
        train(args, tracer)


def train(args, tracer: comm.CommTracer):
    with tracer.phase("startup"):
        run, corpus = start_run(args, tracer)  # device, process groups, mesh, seeds, the token cache
        train_tokens, val_tokens = data.TokenFile(corpus.train_path), data.TokenFile(corpus.val_path)
        run.model = GPT(run.config, seed=args.seed, device=run.device, **pipeline.stage_of(run))  # a stage: its part
        run.flops = model_flops(run.config, run.seq_len)  # of the logical model, before any axis splits it
        run.axes = [axis for axis in (apply(run.model, run) for apply in AXES) if axis is not None]
        run.layout = build_layout(run.model, run)
        run.schedule = next((a.schedule for a in run.axes if a.schedule is not None), GradientAccumulation())
        run.peak = shared_peak(run.device, *mfu.detect_peak_flops(run.device, args.dtype, args.peak_tflops))
        run.groups = {**run.mesh.groups, **{n: g for a in run.axes for n, g in a.groups().items() if g is not None}}
        for name, group in run.groups.items():
            tracer.name_group(group, name)
        print_startup(run)

        warmup = args.warmup_steps if args.warmup_steps is not None else max(1, args.steps // 20)
        lr_schedule = LRSchedule(args.lr, warmup, args.steps, args.min_lr if args.min_lr is not None else args.lr / 10)
        scaler = DynamicLossScaler(enabled=args.dtype == "fp16")
        try:  # the same on every rank: a corpus too small for the batch fails them all alike
            sampler = data.BatchSampler(len(train_tokens), run.seq_len, args.global_batch, args.seed)
            val_sampler = data.EvalSampler(len(val_tokens), run.seq_len, args.global_batch)
        except ValueError as e:
            fail(f"{e} (--data {args.data or 'the built-in corpus'})")
    checkpointer, start_step = None, 0
    if args.ckpt_dir:
        with tracer.phase("ckpt"):
            run_record = dict(steps=args.steps, lr=args.lr, min_lr=lr_schedule.min_lr, seed=args.seed,
                              warmup_steps=lr_schedule.warmup_steps, global_batch=args.global_batch, seq_len=run.seq_len)
            try:  # every rank raises a CheckpointError together (the verdicts are all-gathered)
                checkpointer = ckpt.Checkpointer(args.ckpt_dir, run.mesh, keep=args.keep, exclusive=True,
                                                 async_save=args.async_ckpt, mtbf_hours=args.mtbf_hours,
                                                 device=run.device, log=print0, run_record=run_record, axes=run.axes)
                if args.resume:  # the batch of step s depends only on (seed, s, B_global): resuming sets the cursor
                    start_step = checkpointer.resume(args.resume, run.layout, scaler, sampler, args.seed)
            except ckpt.CheckpointError as e:
                fail(str(e))
            if start_step >= args.steps:
                print0(f"nothing to train: the checkpoint is at step {start_step} and --steps is {args.steps}"
                       f" (raise --steps to train on); evaluating and sampling only")

    # A resumed run appends: the replayed steps then sit next to the originals in one file.
    metrics = open(args.metrics_file, "a" if start_step else "w") if (args.metrics_file and run.mesh.rank == 0) else None
    clock = Progress(start_step, args.steps)
    run.schedule.measure_activations = True  # the first step counts the bytes saved for backward
    if run.device.type == "cuda":  # the peak of training, not of start-up (the whole model built before TP/ZeRO)
        torch.cuda.reset_peak_memory_stats(run.device)
    # Step s + 1's micro-batches are read (pinned, on CUDA) while step s trains, then copied without blocking.
    prefetched = data.Prefetcher(lambda s: local_batches(run, sampler, train_tokens, s), run.device, args.steps - 1)
    step = start_step
    with ending_cleanly_on_signals(lambda: interrupted(checkpointer, step)):
        for step in range(start_step, args.steps):
            lr = lr_schedule(step)
            run.layout.set_lr(lr)
            batches = prefetched.get(step)
            began = time.perf_counter()
            outcome = train_step(run.layout, scaler, batches, run.mesh.dp_cp_group, args.grad_clip, run.autocast,
                                 run.device, model=run.model, schedule=run.schedule, axes=run.axes,
                                 data_size=run.mesh.shape.dp)
            if run.device.type == "cuda":
                torch.cuda.synchronize()
            step_time = clock.tick(step, time.perf_counter() - began)
            last = step == args.steps - 1
            record = step_record(run, step, lr, outcome, step_time, scaler)
            if (args.eval_every and step > 0 and step % args.eval_every == 0) or last:
                with tracer.phase("eval"):
                    record["val_loss"] = evaluate(run, val_tokens, val_sampler)
            if step % args.log_every == 0 or last or "val_loss" in record or clock.silent_for() > LOG_AT_LEAST_EVERY_S:
                print_step(record, clock)
                for line in (line for axis in run.axes for line in axis.step_lines()):
                    print0(f"  {line}")
            if metrics:
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
            if checkpointer:
                with tracer.phase("ckpt"):
                    checkpointer.step_end(step + 1, args.ckpt_every, last, run.layout, scaler, sampler)
        prefetched.close()
        if metrics:
            metrics.close()
        if checkpointer:
            with tracer.phase("ckpt"):
                checkpointer.close()
        if args.sample_tokens:
            with tracer.phase("sample"):
                sample(run, val_tokens, corpus.tokenizer_name)
    with tracer.phase("end"):
        dist.barrier()  # every rank is done: the table below is complete
        print_end(run, max(0, args.steps - start_step), clock.seconds, clock.steps)
    dist.destroy_process_group()


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

    def silent_for(self) -> float:
        return time.perf_counter() - self.last_line

    def printed(self) -> None:
        self.last_line = time.perf_counter()


def format_duration(seconds: float) -> str:
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    return (f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s" if rest >= 60
            else f"{rest}s")


class Interrupted(Exception):
    """SIGINT (Ctrl-C) or SIGTERM (torchrun stopping its workers) during training."""


@contextmanager
def ending_cleanly_on_signals(report):
    """Turn SIGINT/SIGTERM into one line instead of a KeyboardInterrupt traceback on every rank: `report()`
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
        report()
        os._exit(128 + received[0])  # no atexit, no process-group teardown: the peers are stopping too
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def interrupted(checkpointer, step: int) -> None:
    """Rank 0's one line on a stop: the step reached and the newest committed checkpoint. The background save
    that was running, if any, is abandoned: its temporary directory is removed (the next start would too)."""
    if dist.get_rank() != 0:
        return
    line = f"interrupted at step {step}"
    if checkpointer is not None:
        checkpointer.abandon()
        committed = ckpt.newest_committed(checkpointer.root)
        line += (f"; the newest committed checkpoint is step {committed[0]} ({committed[1]}): --resume latest"
                 f" continues from it" if committed else "; no checkpoint was committed")
    print(line, file=sys.stderr, flush=True)


def parse_flags(argv=None) -> argparse.Namespace:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:  # every rank validates the same flags and exits before any of them waits on a peer
        args = build_parser().parse_args(argv)
        args.mesh_shape, args.micro_batches, args.micro = validate_args(
            args, int(os.environ.get("WORLD_SIZE", "1")), explicit_flags(argv))
        data.get_tokenizer(args.tokenizer)  # --tokenizer gpt2 without its files fails here, on every rank
        try:
            args.device, args.backend = choose_device_and_backend(args.backend)
        except ValueError as e:
            raise FlagError(str(e)) from None
        args.dtype_choice = "--dtype" if args.dtype != "auto" else f"--dtype auto: {auto_dtype_reason(args.device)}"
        args.dtype = args.dtype if args.dtype != "auto" else auto_dtype(args.device)
    except (FlagError, RuntimeError) as e:
        fail(str(e))
    return args


def auto_dtype(device: torch.device) -> str:
    """bf16 where the device multiplies bf16 natively, else fp32 (--dtype auto)."""
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    return "bf16" if torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported() else "fp32"


def auto_dtype_reason(device: torch.device) -> str:
    if device.type == "cuda":
        return "bf16 tensor cores" if torch.cuda.is_bf16_supported() else "this GPU has no bf16 tensor cores"
    return ("this CPU has bf16 matrix units (AMX or AVX512-BF16)" if auto_dtype(device) == "bf16" else
            "this CPU has no bf16 matrix units (no AMX, no AVX512-BF16): bf16 would be emulated, several times"
            " slower than fp32")


def fail(message: str) -> NoReturn:
    """End the run on an error that every rank has reached: one line, printed exactly once, exit status 2.

    Printed once, and always: torchrun kills the other workers as soon as one exits, so no rank may exit
    before the line is out. With a process group, rank 0 prints and then every rank meets at a barrier.
    Before one exists (a flag error), the ranks agree through the launcher's store (torchrun's agent holds
    one: TORCHELASTIC_USE_AGENT_STORE): the first rank to claim the error prints it, the others wait until it
    has. Without torchrun, the process started as RANK 0 prints."""
    line = f"error: {' '.join(message.split())}"
    if dist.is_initialized():
        if dist.get_rank() == 0:
            print(line, file=sys.stderr, flush=True)
        dist.barrier()
        dist.destroy_process_group()
    elif not _print_once_through_launcher_store(line) and int(os.environ.get("RANK", "0")) == 0:
        print(line, file=sys.stderr, flush=True)
    sys.exit(2)


def _print_once_through_launcher_store(line: str, timeout_s: float = 30.0) -> bool:
    """Print `line` on exactly one of torchrun's workers (the first to get here): True when that is settled."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return False
    key = f"train.py/error/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT')}"
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        if store.add(f"{key}/claimed", 1) == 1:
            print(line, file=sys.stderr, flush=True)
            store.set(f"{key}/printed", "1")
        else:
            store.wait([f"{key}/printed"], datetime.timedelta(seconds=timeout_s))
        return True
    except (RuntimeError, OSError, KeyError, ValueError):  # no store to be reached: rank 0 prints
        return False


def start_run(args, tracer: comm.CommTracer) -> tuple[Run, data.Corpus]:
    """Join the process group, build the mesh, seed, and make the token cache (each node's local rank 0
    builds, the others wait)."""
    device = args.device  # chosen with the flags (parse_flags): a wrong one fails before any rank waits
    set_numerics(args.tf32, args.deterministic)  # before any kernel runs: stated choices, not defaults
    rank, _ = init_distributed(args.backend, device)
    shape = args.mesh_shape
    mesh = build_mesh(shape, rank)
    # Dropout differs per rank, like independent devices, except across a TP group, whose ranks hold copies of
    # the same activations (tensor_parallel.TensorParallelRNG forks it for split ones). Init is seeded apart.
    torch.manual_seed(args.seed + rank // shape.tp)
    # Each node's local rank 0 builds (or finds) the token cache under its own --out-dir, the others wait and
    # read it: nodes need no shared filesystem (the bytes are deterministic, so every node's are the same), and
    # on a shared one the cache is written atomically (data.prepare_corpus), so two builders cannot collide.
    cache_dir, local_rank = os.path.join(args.out_dir, "data"), int(os.environ.get("LOCAL_RANK", "0"))
    error = None
    if local_rank == 0:
        try:  # a corpus that cannot be read or is too small fails here, on the builders only
            corpus = data.prepare_corpus(args.data, args.tokenizer, cache_dir,
                                         log=lambda line: print(line, flush=True))
        except (ValueError, OSError) as e:
            error = str(e)
    errors = agree(error)  # the barrier: every node's cache is ready, or every rank ends with the error
    if errors:
        fail(errors[0])
    if local_rank != 0:
        corpus = data.prepare_corpus(args.data, args.tokenizer, cache_dir, log=lambda *a, **k: None)
    config = model_config(args)
    config.vocab_size = padded_vocab(corpus.vocab_size) if args.tokenizer != "byte" else corpus.vocab_size
    compute_dtype = DTYPES[args.dtype]
    run = Run(args=args, mesh=mesh, config=config, seq_len=args.seq_len or config.block_size, micro=args.micro,
              micro_batches=args.micro_batches, device=device, seed=args.seed, compute_dtype=compute_dtype,
              autocast=torch.autocast(device.type, dtype=compute_dtype) if args.dtype != "fp32" else nullcontext(),
              param_dtype=ZERO_PARAM_DTYPES[args.dtype] if args.zero else torch.float32, tracer=tracer)
    return run, corpus


def shared_peak(device, flops: float, source: str) -> tuple[float, str]:
    """One peak for every rank: the mean of what each measured (they measured at once, each on its share of
    a shared machine); a datasheet or --peak-tflops figure is the same everywhere already."""
    if not source.startswith("measured") or dist.get_world_size() == 1:
        return flops, source
    total = torch.tensor([flops], dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return float(total) / dist.get_world_size(), f"{source}; mean over the {dist.get_world_size()} ranks"


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


def model_flops(config: GPTConfig, seq_len: int) -> mfu.FlopsPerToken:
    """FLOPs per token of the logical model. N of 6N: the weights a token's matmuls use (the blocks' linears,
    12·L·h² when dense; with experts the k it is routed to and the router, not all N: moe.py), and the tied
    head, V·h; N_r: those whose forward activation checkpointing recomputes (the blocks')."""
    return moe.flops_per_token(config, seq_len, recompute=config.activation_checkpointing)


def build_layout(model: GPT, run: Run):
    """DDP (--zero 0) or ZeRO 1/2/3 (zero.py) over each parameter's data-parallel group."""
    args, coords = run.args, run.mesh.coordinates()
    if args.compile:
        compile_blocks(model)  # per block: its gradient hooks fire when its backward ends (model.compile_blocks)
    groups = {name: run.mesh.group(name) for name in ("dp_cp", "expert_dp")}  # dense, experts
    if args.zero:  # shards the optimizer state (1), + gradients (2), + weights (3) over dp×cp
        return ZeroLayout(model, run.mesh.dp_cp_group, args.zero, lr=args.lr, weight_decay=args.weight_decay,
                          betas=(args.beta1, args.beta2), param_dtype=run.param_dtype, master_dtype=run.master_dtype,
                          bucket_mb=args.bucket_mb, coords=coords, groups=groups,
                          codecs={p: c for axis in run.axes for p, c in axis.gather_codecs().items()},
                          micro_batches=run.micro_batches)  # m > 1: gradients summed in master_dtype
    ddp = DistributedDataParallel(model, groups=groups, bucket_mb=args.bucket_mb)
    optimizer = build_adamw(model.parameters(), args.lr, args.weight_decay, (args.beta1, args.beta2))
    return DDPLayout(ddp, optimizer, coords)


def local_batches(run: Run, sampler, tokens, step: int) -> list:
    """This rank's m micro-batches of step `step`, each (x, y, pos); an axis may cut them (context parallel)."""
    mesh = run.mesh
    batches = [(*sampler.get_batch(tokens, step, mesh.dp_rank, mesh.dp_size, run.micro, i), None)
               for i in range(run.micro_batches)]
    for axis in run.axes:
        batches = axis.shard_batches(batches)
    return batches


def step_record(run: Run, step: int, lr: float, outcome, step_time: float, scaler) -> dict:
    tokens_per_s = run.tokens_per_step / step_time
    record = dict(step=step, loss=outcome.loss, lr=lr, grad_norm=outcome.grad_norm, tokens=run.tokens_per_step,
                  step_time_s=step_time, tokens_per_s=tokens_per_s, skipped=outcome.skipped,
                  mfu=mfu.mfu(run.flops.model, tokens_per_s, run.peak[0], run.mesh.shape.world_size))
    record.update({f"aux_{name}": value for name, value in outcome.aux.items()})
    if scaler.enabled:
        record["loss_scale"] = scaler.scale
    return record


def print_step(record: dict, clock: Progress):
    """One line per logged step: step i/N, the losses, lr, grad norm, throughput, MFU, step time, ETA."""
    val = f" | val {record['val_loss']:.4f}" if "val_loss" in record else ""
    aux = "".join(f" | {key[4:]} {value:.4f}" for key, value in record.items() if key.startswith("aux_"))
    scale = f" | loss scale {record['loss_scale']:g}" if "loss_scale" in record else ""
    over = "!" if record["mfu"] > 1 else ""  # explained once, below
    print0(f"step {record['step']:>{len(str(clock.total))}d}/{clock.total} | loss {record['loss']:.4f}{val}{aux}"
           f" | lr {record['lr']:.2e} | grad norm {record['grad_norm']:.3f}{' (skipped)' if record['skipped'] else ''}"
           f"{scale} | {record['tokens_per_s']:,.0f} tok/s | MFU {record['mfu']:.2%}{over}"
           f" | {record['step_time_s'] * 1000:.0f} ms | eta {format_duration(clock.eta(record['step']))}")
    if over and not clock.warned_mfu:
        clock.warned_mfu = True
        print0("  ! MFU above 100% cannot be: the peak assumed (see 'peak assumed' above) is too low for this"
               " device; on a CPU it is measured at start-up and other jobs on the machine lower it; set"
               " --peak-tflops")
    clock.printed()


@torch.no_grad()
def evaluate(run: Run, tokens, sampler) -> float:
    """Mean val loss over the first --eval-batches global batches of the validation split (always the same),
    through the step's schedule (the pipeline's passes through its stages) with dropout off."""
    mesh, model = run.mesh, run.model
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=run.device)  # [loss_sum, tokens]
    for batch in range(min(run.args.eval_batches, sampler.num_batches)):
        micro_batches = [(*sampler.get_batch(tokens, batch, mesh.dp_rank, mesh.dp_size, run.micro, i), None)
                         for i in range(run.micro_batches)]
        for axis in run.axes:
            micro_batches = axis.shard_batches(micro_batches)
        totals += torch.stack(run.schedule.forward_only(run.layout, model, micro_batches, run.autocast, run.device))
    if dist.get_world_size(mesh.dp_cp_group) > 1:
        dist.all_reduce(totals, group=mesh.dp_cp_group)
    model.train()
    return float(totals[0] / totals[1])


@torch.no_grad()
def sample(run: Run, val_tokens, tokenizer_name):
    """Every rank generates the same tokens in lock step (the same prompt and seed), so that every group whose
    collectives the forward uses (TP, the experts' all-to-all) takes part; rank 0 prints."""
    run.layout.unshard()  # collective (ZeRO-3 gathers every weight on every rank)
    prompt = torch.from_numpy(val_tokens.tokens[:32].astype("int64"))[None].to(run.device)
    model = run.model
    model.eval()
    with ExitStack() as stack:
        for axis in run.axes:
            stack.enter_context(axis.sampling())
        out = model.generate(prompt, run.args.sample_tokens, temperature=0.8, top_k=50,
                             generator=torch.Generator(device=run.device).manual_seed(run.seed))
    model.train()
    print0("sample (prompt from the val split, then the model):")
    print0(data.get_tokenizer(tokenizer_name).decode(out[0].tolist()))


def print0(*args, **kwargs):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


# ---------------------------------------------------------------------------------------------------------
# Accounting printouts: they loop over the layout and the axes' handles, never over flags
# ---------------------------------------------------------------------------------------------------------


def predicted_messages(run: Run, traced_steps: int = 0) -> dict:
    """{(op, group): (calls, payload bytes)} per optimizer step: the layout's, every axis's, the step's own.
    With traced_steps, what the tracer should have seen per step (an axis may know it better after the fact)."""
    m = run.micro_batches
    axes = [axis.traced_prediction(run.layout, traced_steps) if traced_steps else axis.predicted_messages(run.layout)
            for axis in run.axes]
    sources = [run.layout.predicted_messages(m), *axes]
    if run.mesh.dp_cp_size > 1:  # step.py: the global token count and the logged loss, float64 each
        sources.append({("all_reduce", "dp_cp"): (2, 16)})
    if run.mesh.shape.world_size > 1:
        sources.append(update_messages())
    out = {}
    for source in sources:
        for (op, group), (calls, payload) in source.items():
            key = (op, run.tracer.alias(group))  # names that share one communicator are one row (mesh.py)
            c, b = out.get(key, (0, 0))
            out[key] = (c + calls, b + payload)
    return out


def parameter_counts(run: Run) -> tuple[int, int]:
    """(Ψ of the logical model, parameters this rank holds). Ψ adds, over the world, the copies that count
    (model.counts_here, with each parameter's data-parallel group as a replica axis): each logical element once."""
    coords = run.mesh.coordinates()
    params = list(run.model.parameters())
    counted = sum(p.numel() for p in params if counts_here(p.shard_info, coords, (p.shard_info.grad_group,)))
    psi = torch.tensor([counted], dtype=torch.float64, device=run.device)
    if dist.get_world_size() > 1:
        dist.all_reduce(psi)
    return int(psi.item()), sum(p.numel() for p in params)


def print_startup(run: Run):
    """What each device holds and what each group sends, predicted; the end report measures the same."""
    args, mesh, config = run.args, run.mesh, run.config
    psi, local = parameter_counts(run)
    print0("=" * 100)
    print0(mesh_description(mesh))
    print0(f"parameters: {psi:,} global (Ψ); {local:,} on this rank (n_layer={config.n_layer} n_head={config.n_head}"
           f" n_embd={config.n_embd} vocab={config.vocab_size})")
    print0(f"batch: B_global={args.global_batch} = D {mesh.shape.dp} × m {run.micro_batches} × B_μ {run.micro}"
           f" sequences of {run.seq_len} tokens = {run.tokens_per_step:,} tokens/step; autocast {args.dtype}"
           f" ({args.dtype_choice})")
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
        for line in axis.startup_lines():
            print0(line)
    print0(f"schedule: {run.schedule.describe(run.micro_batches)}")
    predicted = predicted_messages(run)
    if not predicted:
        print0("predicted comm per step: none (one process: nothing to send)")
    else:
        print0("predicted comm per step (op, group: calls, payload M, sent per rank by the ring formulas):")
    width = max([9, *(len(group) for _, group in predicted)])
    for (op, group), (calls, payload) in sorted(predicted.items(), key=lambda kv: kv[0][::-1]):
        named = [name for name in group.split("=") if name in run.groups]  # "dp_cp=expert_dp": one group
        n = dist.get_world_size(run.groups[named[0]]) if named else dist.get_world_size()
        print0(f"  {op:<22} {group:<{width}} {calls:>6g} calls  {mfu.format_bytes(payload):>12}"
               f"  sent {mfu.format_bytes(mfu.wire_bytes(op, payload, n)):>12}")
    print0("=" * 100)


def activation_estimate(run: Run) -> tuple[float, str]:
    """Korthikanti et al. 2022 per micro-batch for the blocks this rank holds (16-bit activations), with the
    sequence this rank holds (s/C under context parallel)."""
    config, mesh, sp = run.config, run.mesh, run.args.sp
    blocks, seq = len(run.model.transformer.h), run.seq_len // mesh.shape.cp
    per_layer = mfu.activation_bytes_per_layer(seq, run.micro, config.n_embd, config.n_head,
                                               t=mesh.shape.tp, sequence_parallel=sp)
    moe_ids = [b.layer_id for b in run.model.transformer.h if moe.is_moe_layer(config, b.layer_id)]
    experts = (lambda n: moe.activation_estimate_delta(config, n, seq, run.micro, mesh.shape.tp, sp)) if moe_ids \
        else (lambda n: 0)  # a MoE block keeps its router's and experts' activations instead of the dense MLP's
    with_experts = f", {len(moe_ids)} with experts (moe.activation_estimate_delta)" if moe_ids else ""
    if not config.activation_checkpointing:
        return per_layer * blocks + experts(len(moe_ids)), f"{blocks} layers{with_experts}"
    # Only each block's input survives forward (2·s·b·h bytes at 16 bits, /T with SP); backward rebuilds
    # one block's activations at a time.
    block_input = 2 * seq * run.micro * config.n_embd // (mesh.shape.tp if sp else 1)
    return (block_input * blocks + per_layer + experts(min(1, len(moe_ids))),
            f"{blocks} block inputs + one layer recomputed{with_experts}")


def print_end(run: Run, steps_run: int, seconds: float, steps_timed: int):
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
        print0(f"  activations saved for backward by {run.schedule.measured_forward} (saved_tensors_hooks, {run.args.dtype}"
               f" compute): {mfu.format_bytes(saved)}; Korthikanti estimate {mfu.format_bytes(estimate)}"
               f" (16-bit, {how}; a fused attention stores no score matrix, its 5·a·s/h term)")
    for line in run.layout.end_lines(run.tracer, steps_run):
        print0(line)
    for axis in run.axes:
        for line in axis.end_lines(run.tracer, steps_run):
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


if __name__ == "__main__":
    main()
