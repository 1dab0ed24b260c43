"""Train the GPT on a mesh of devices: flags → mesh → model → parallel transforms → loop → printouts.

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
import json
import math
import os
import sys
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist

import ckpt
import data
import mfu
import tensor_parallel
from ddp import DistributedDataParallel
from mesh import axis_groups, build_mesh, choose_device_and_backend, infer_mesh_shape, init_distributed
from model import GPT, config_from_preset
from optim import DynamicLossScaler, LRSchedule, build_adamw, unscale_clip_and_step
from zero import ZeroLayout

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ZERO_PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # working weights; masters stay fp32


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    g.add_argument("--dtype", default="bf16", choices=list(DTYPES), help="autocast compute dtype")
    g.add_argument("--seed", type=int, default=1337)
    g.add_argument("--compile", action="store_true", help="torch.compile the model (GPU speed)")
    g = p.add_argument_group("parallelism")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size T")
    g.add_argument("--pp", type=int, default=1, help="pipeline-parallel size P")
    g.add_argument("--cp", type=int, default=1, help="context-parallel size C")
    g.add_argument("--ep", type=int, default=1, help="expert-parallel size E")
    g.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage (0: plain DDP)")
    g.add_argument("--sp", action="store_true", help="sequence parallel (with --tp)")
    g.add_argument("--bucket-mb", type=float, default=25.0, help="DDP gradient bucket size in MiB")
    g.add_argument("--backend", choices=["nccl", "gloo"], help="default: nccl with GPUs, else gloo")
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
    g.add_argument("--resume", help="'latest' (the newest good checkpoint, if any) or a step number")
    g.add_argument("--async-ckpt", action="store_true", help="persist checkpoints on a background thread")
    g.add_argument("--mtbf-hours", type=float, default=24.0,
                   help="mean time between interruptions, for the suggested interval sqrt(2·C·M)")
    return p


class FlagError(ValueError):
    """A flag combination that cannot run; raised before any rank waits on another."""


def validate_args(args, world_size: int):
    """Check every flag product and divisibility; return (mesh shape, micro-batches per step)."""
    try:
        shape = infer_mesh_shape(world_size, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep)
    except ValueError as e:
        raise FlagError(str(e)) from None
    validate_zero_args(args)
    for flag, value in (("--pp", args.pp), ("--cp", args.cp), ("--ep", args.ep)):
        if value > 1:
            raise FlagError(f"{flag} {value}: this axis is not implemented in this version of the trainer")
    if args.sp and args.tp == 1:
        raise FlagError("--sp (sequence parallel) needs --tp > 1")
    for flag, value in (("--steps", args.steps), ("--log-every", args.log_every),
                        ("--eval-batches", args.eval_batches), ("--micro-batch", args.micro_batch),
                        ("--n-layer", args.n_layer), ("--n-head", args.n_head), ("--n-embd", args.n_embd)):
        if value is not None and value < 1:
            raise FlagError(f"{flag} must be at least 1, got {value}")
    if args.dropout is not None and not 0.0 <= args.dropout < 1.0:
        raise FlagError(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.lr <= 0 or args.eval_every < 0 or args.grad_clip < 0:
        raise FlagError(f"--lr must be positive and --eval-every, --grad-clip non-negative; got --lr {args.lr},"
                        f" --eval-every {args.eval_every}, --grad-clip {args.grad_clip}")
    micro = args.micro_batch if args.micro_batch is not None else args.global_batch // shape.dp
    if args.global_batch < 1 or micro < 1:
        raise FlagError(f"--global-batch {args.global_batch} must give each of D={shape.dp} data ranks a sequence")
    if args.global_batch % (shape.dp * micro):
        raise FlagError(
            f"--global-batch {args.global_batch} must be divisible by D × --micro-batch = {shape.dp} × {micro}"
            f" (B_global = D·m·B_μ)"
        )
    if args.data is not None and not os.path.isfile(args.data):
        raise FlagError(f"--data {args.data!r} is not a file; give a text file to train on, or leave --data out"
                        f" for the built-in corpus")
    config = model_config(args)
    if args.seq_len is not None and not 1 <= args.seq_len <= config.block_size:
        raise FlagError(f"--seq-len {args.seq_len} must be between 1 and the model's block size {config.block_size}")
    if args.tp > 1:
        config.vocab_size = vocab_size(args.tokenizer)
        try:
            tensor_parallel.check_divisible(config, args.tp, args.seq_len or config.block_size, args.sp)
        except ValueError as e:
            raise FlagError(str(e)) from None
    validate_checkpoint_args(args)
    return shape, args.global_batch // (shape.dp * micro), micro


def validate_zero_args(args):
    """--zero 1|2|3 (zero.py) runs with bf16 or fp32 working weights and, at stage 3, hooks on each block."""
    if not args.zero:
        return
    if args.dtype == "fp16":
        raise FlagError(f"--zero {args.zero} with --dtype fp16: ZeRO keeps bf16 (or fp32) working weights with fp32"
                        f" masters, which need no loss scaling; use --dtype bf16 or fp32")
    if args.zero >= 2 and args.pp > 1:
        raise FlagError(f"--zero {args.zero} with --pp {args.pp}: sharded gradients would be reduce-scattered on"
                        f" every micro-batch of the pipeline schedule; use --zero 1 with pipeline parallel")
    if args.zero == 3 and args.activation_checkpointing:
        raise FlagError("--zero 3 with --activation-checkpointing: recomputing a block in backward reruns its"
                        " forward hooks, which would gather and free its weights out of schedule; use --zero 1 or 2")
    if args.zero == 3 and args.compile:
        raise FlagError("--zero 3 with --compile: the per-block gather/free hooks swap parameter storage under"
                        " the compiled graph; use --zero 1 or 2 with --compile")
    if args.zero == 3 and args.n_layer is not None and args.n_layer < 1:
        raise FlagError(f"--zero 3 gathers one block at a time: it needs --n-layer ≥ 1, got {args.n_layer}")


def validate_checkpoint_args(args):
    if args.ckpt_dir is None:
        for flag, value in (("--ckpt-every", args.ckpt_every), ("--resume", args.resume),
                            ("--async-ckpt", args.async_ckpt)):
            if value:
                raise FlagError(f"{flag} needs --ckpt-dir (where checkpoints are written and read)")
    if args.ckpt_every < 0:
        raise FlagError(f"--ckpt-every must be 0 (only at the end) or a positive number of steps, got {args.ckpt_every}")
    if args.keep < 2:
        raise FlagError(f"--keep must be at least 2 (a good checkpoint must survive while the next is written),"
                        f" got {args.keep}")
    if args.resume is not None and args.resume != "latest" and not (args.resume.isdigit()):
        raise FlagError(f"--resume must be 'latest' or a step number, got {args.resume!r}")
    if args.mtbf_hours is not None and args.mtbf_hours <= 0:
        raise FlagError(f"--mtbf-hours must be positive, got {args.mtbf_hours}")


def model_config(args):
    overrides = dict(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, dropout=args.dropout)
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


def count_global_tokens(batches, group, device) -> torch.Tensor:
    """Target tokens (≠ -1) in the whole global batch: the denominator of the loss on every rank."""
    local = sum((y != -1).sum() for _, y in batches).to(device=device, dtype=torch.float64)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)
    return local


class ReplicatedUpdate:
    """ZeRO stage 0: ddp.py sums the gradients, then every rank runs the same AdamW on the whole model.

    This is the layout protocol train_step drives; zero.py's layouts implement the same methods:
    `__call__` (forward), `no_sync()`, `finish_grad_sync()`, `step(scaler, clip, device) -> StepResult`,
    `zero_grad()`, `set_lr(lr)`, `held_bytes() -> {weights, grads, optimizer, total}`.
    """

    def __init__(self, ddp: DistributedDataParallel, optimizer, norm_groups=(), tp_rank: int = 0,
                 after_grad_sync=()):
        self.ddp, self.optimizer = ddp, optimizer
        self.norm_groups, self.tp_rank = norm_groups, tp_rank  # TP shards: the norm sums over the TP group
        # Reductions over other groups once the data-parallel one is done (sequence parallel sums its
        # replicated parameters' gradients over the TP group: TensorParallel.finish_grad_sync).
        self.after_grad_sync = tuple(after_grad_sync)

    def __call__(self, *args, **kwargs):
        return self.ddp(*args, **kwargs)

    def no_sync(self):
        return self.ddp.no_sync()

    def finish_grad_sync(self):
        self.ddp.finish_grad_sync()
        for reduce in self.after_grad_sync:
            reduce()

    def step(self, scaler, clip: float, device):
        return unscale_clip_and_step(self.ddp.parameters(), self.optimizer, scaler, clip, self.norm_groups,
                                     self.tp_rank, device)

    def zero_grad(self):
        self.ddp.zero_grad()

    def set_lr(self, lr: float):
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def state_pieces(self) -> list:
        """The checkpoint's view: params (= the fp32 masters) and Adam moments, each replica written once."""
        distributed = dist.is_initialized()
        return ckpt.replicated_state_pieces(self.ddp.parameters(), self.optimizer,
                                            dist.get_rank(self.ddp.group) if distributed else 0,
                                            dist.get_world_size(self.ddp.group) if distributed else 1, self.tp_rank)

    @property
    def optimizer_step_count(self) -> int:
        """Adam's t (skipped steps do not count): a checkpoint restores it."""
        return ckpt.adam_step(self.optimizer)

    @optimizer_step_count.setter
    def optimizer_step_count(self, value: int):
        ckpt.set_adam_step(self.optimizer, value)

    def held_bytes(self) -> dict:
        params = list(self.ddp.parameters())
        weights = sum(p.numel() * p.element_size() for p in params)
        grads = sum(b.numel() * b.element_size() for b in (bucket.buffer for bucket in self.ddp.buckets))
        optimizer = sum(t.numel() * t.element_size() for s in self.optimizer.state.values() for t in s.values()
                        if torch.is_tensor(t) and t.dim() > 0)  # the moments; the 0-d step counters aside
        return {"weights": weights, "grads": grads, "optimizer": optimizer, "total": weights + grads + optimizer}


def train_step(layout, scaler, batches, data_group, clip, autocast, device):
    """One optimizer step over this rank's micro-batches, in DESIGN.md's update order.

    Returns (global mean loss, StepResult). `layout` syncs gradients and steps (ReplicatedUpdate or ZeRO).
    """
    global_tokens = count_global_tokens(batches, data_group, device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for index, (x, y) in enumerate(batches):
        last = index == len(batches) - 1
        # Gradient sync is decided when backward runs: every micro-step but the last only accumulates.
        with nullcontext() if last else layout.no_sync():
            with autocast:
                _, micro_loss_sum, _ = layout(x.to(device), y.to(device))
            (micro_loss_sum * (scaler.scale / global_tokens)).backward()
        loss_sum += micro_loss_sum.detach().double()
    layout.finish_grad_sync()
    result = layout.step(scaler, clip, device)
    layout.zero_grad()
    if dist.get_world_size(data_group) > 1:
        dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM, group=data_group)
    return float(loss_sum / global_tokens), result


@torch.no_grad()
def evaluate(forward, model, tokens, sampler, num_batches, dp_rank, dp_size, micro, data_group, autocast,
             device) -> float:
    """Mean val loss over the first `num_batches` global batches of the validation split (always the same).

    `forward` runs the layout's forward (ZeRO-3 gathers parameters there); `model` switches dropout off.
    """
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # [loss_sum, tokens]
    for batch in range(num_batches):
        for index in range(sampler.global_batch // (dp_size * micro)):
            x, y = sampler.get_batch(tokens, batch, dp_rank, dp_size, micro, index)
            with autocast:
                _, loss_sum, count = forward(x.to(device), y.to(device))
            totals += torch.stack([loss_sum.double(), count.double()])
    if dist.get_world_size(data_group) > 1:
        dist.all_reduce(totals, group=data_group)
    model.train()
    return float(totals[0] / totals[1])


def print0(*args, **kwargs):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


def startup_accounting(mesh, model, config, args, micro, steps_m, seq_len, flops, peak, peak_source, ddp,
                       device, layout=None, extra_lines=()) -> dict:
    """Print what each device holds and what each group sends; return the predictions for the end report."""
    D = mesh.shape.dp
    psi = sum(math.prod(p.shard_info.global_shape) for p in model.parameters())  # the logical model
    local_params = sum(p.numel() for p in model.parameters())  # this rank's (TP) shards
    recipe = mfu.BYTES_PER_PARAM["fp32"]  # fp32 parameters and grads, fp32 Adam moments (autocast computes bf16)
    persistent = mfu.persistent_bytes(local_params, recipe, zero_stage=0, dp_size=D)
    grad_bytes = 4 * local_params
    wire = mfu.wire_bytes("all_reduce", grad_bytes, mesh.dp_cp_size)
    per_layer = mfu.activation_bytes_per_layer(seq_len, micro, config.n_embd, config.n_head, t=mesh.shape.tp,
                                               sequence_parallel=args.sp)
    if config.activation_checkpointing:
        # Only each block's input survives forward (2·s·b·h bytes at 16 bits, /T with SP); backward
        # rebuilds one block's activations at a time.
        block_input = 2 * seq_len * micro * config.n_embd // (mesh.shape.tp if args.sp else 1)
        activation, how = block_input * config.n_layer + per_layer, "L block inputs + one layer recomputed"
    else:
        activation, how = per_layer * config.n_layer, "L layers"
    print0("=" * 100)
    print0(mesh_description(mesh))
    print0(f"parameters: {psi:,} global (Ψ); {local_params:,} on each rank"
           f" (n_layer={config.n_layer} n_head={config.n_head} n_embd={config.n_embd} vocab={config.vocab_size})")
    print0(f"batch: B_global={args.global_batch} = D {D} × m {steps_m} × B_μ {micro} sequences of {seq_len}"
           f" tokens = {args.global_batch * seq_len:,} tokens/step; autocast {args.dtype}")
    if args.zero:
        persistent = layout.predicted_persistent()
        for line in layout.accounting_lines(steps_m, local_params):  # Ψ of what ZeRO splits (TP-local shards)
            print0(line)
    else:
        print0("predicted persistent memory per rank (fp32 master recipe, ZeRO stage 0):")
        print0(f"  weights   fp32 {mfu.format_bytes(persistent['weights'])}")
        print0(f"  grads     fp32 {mfu.format_bytes(persistent['grads'])}  (= the DDP buckets: grads are views)")
        print0(f"  AdamW m,v fp32 {mfu.format_bytes(persistent['optimizer'])}")
    print0(f"  total          {mfu.format_bytes(persistent['total'])}; activations ≈"
           f" {mfu.format_bytes(activation)} per micro-batch (Korthikanti, 16-bit, {how})")
    print0(f"FLOPs/token: model {flops.model:,.0f}, hardware {flops.hardware:,.0f}  [{flops.convention}]")
    print0(f"peak assumed: {peak / 1e12:.2f} TFLOP/s per device ({peak_source})")
    if not args.zero:
        print0(f"layout: parameters, gradients and AdamW state replicated over dp_cp; split: the batch"
               f" ({micro} sequences per rank per micro-step)")
        print0(f"predicted comm per step: all_reduce dp_cp (D·C={mesh.dp_cp_size}): payload"
               f" {mfu.format_bytes(grad_bytes)}, sent per rank {mfu.format_bytes(wire)} in"
               f" {len(ddp.buckets)} buckets of ≤{args.bucket_mb:g} MiB (2(N-1)/N·M, ring)")
        last_bucket = mfu.format_bytes(ddp.bucket_sizes_bytes()[-1])
        if mesh.dp_cp_size == 1:
            print0("critical path: no gradient communication (one data rank)")
        elif len(ddp.buckets) == 1:
            print0(f"critical path: the single bucket ({last_bucket}) is sent after backward; lower --bucket-mb"
                   f" to overlap it")
        else:
            print0(f"critical path: buckets 0..{len(ddp.buckets) - 2} overlap backward; the last one"
                   f" ({last_bucket}, the first layers' grads) is sent after it, then scalar all-reduces")
    print0(f"pipeline bubble: {mfu.pipeline_bubble(mesh.shape.pp, steps_m):.1%} (P={mesh.shape.pp}, m={steps_m})")
    for line in extra_lines:
        print0(line)
    print0("=" * 100)
    return {"grad_bytes": grad_bytes, "wire": wire, "persistent": persistent, "micro_batches": steps_m}


def mesh_description(mesh) -> str:
    lines = [f"mesh: world {mesh.shape.world_size} = D {mesh.shape.dp} × P {mesh.shape.pp} × C {mesh.shape.cp}"
             f" × T {mesh.shape.tp} (E {mesh.shape.ep} inside D·C); rank = ((d·P + p)·C + c)·T + t"]
    for axis, partition in axis_groups(mesh.shape).items():
        if len(partition[0]) > 1:
            lines.append(f"  {axis:>9} groups: {partition}")
    return "\n".join(lines)


def main(argv=None):
    args = build_parser().parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        shape, steps_m, micro = validate_args(args, world_size)
        data.get_tokenizer(args.tokenizer)  # --tokenizer gpt2 without its files fails here, on every rank
    except (FlagError, RuntimeError) as e:
        # Every rank validates the same flags and exits before any of them waits on a peer.
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)

    device, backend = choose_device_and_backend(args.backend)
    rank, world_size = init_distributed(backend)
    mesh = build_mesh(shape, rank)
    # Dropout differs per rank, like independent devices, except across a TP group, whose ranks hold copies of
    # the same activations (tensor_parallel.TensorParallelRNG forks it for split ones). Init is seeded apart.
    torch.manual_seed(args.seed + rank // shape.tp)

    # Data: rank 0 tokenizes the corpus once into the cache; the others wait, then memory-map it.
    cache_dir = os.path.join(args.out_dir, "data")
    if rank == 0:
        corpus = data.prepare_corpus(args.data, args.tokenizer, cache_dir, log=print0)
    dist.barrier()
    if rank != 0:
        corpus = data.prepare_corpus(args.data, args.tokenizer, cache_dir, log=lambda *a, **k: None)
    train_tokens, val_tokens = data.TokenFile(corpus.train_path), data.TokenFile(corpus.val_path)

    config = model_config(args)
    config.vocab_size = padded_vocab(corpus.vocab_size) if args.tokenizer != "byte" else corpus.vocab_size
    seq_len = args.seq_len or config.block_size
    model = GPT(config, seed=args.seed, device=device)
    # N of 6N: the weights that enter a matmul (blocks' linears and the tied head), counted on the logical
    # model before TP splits it; N_r: those whose forward activation checkpointing recomputes (the blocks').
    n_matmul_params = model.transformer.wte.weight.numel() + sum(
        p.numel() for p in model.transformer.h.parameters() if p.dim() == 2)
    n_recomputed = sum(p.numel() for p in model.transformer.h.parameters() if p.dim() == 2)
    autocast = (torch.autocast(device.type, dtype=DTYPES[args.dtype]) if args.dtype != "fp32" else nullcontext())
    tp, tp_lines, tp_kwargs = None, [], {}
    if shape.tp > 1:  # TP swaps the linears, embedding and head before DDP wraps the model
        tp = tensor_parallel.parallelize(model, mesh.tp_group, args.sp, seed=args.seed)
        if args.zero:  # ZeRO trains in its working dtype (bf16 weights, fp32 masters: 2 + 2 + 12 bytes/param)
            tp_lines = tp.startup_lines(micro, seq_len, DTYPES[args.dtype].itemsize, autocast,
                                        ZERO_PARAM_DTYPES[args.dtype])  # 2+2+12 or 4+4+8: 16 bytes/param either way
            tp_lines.append("  (with --zero these per-rank TP figures are before ZeRO shards them over D: see above)")
        else:
            tp_lines = tp.startup_lines(micro, seq_len, DTYPES[args.dtype].itemsize, autocast)
        tp_kwargs = dict(norm_groups=(mesh.tp_group,), tp_rank=mesh.tp_rank, after_grad_sync=(tp.finish_grad_sync,))
    compiled = torch.compile(model) if args.compile else model
    if args.zero:  # zero.py shards the optimizer state (1), + gradients (2), + weights (3) over dp×cp
        ddp = None
        tp_norm = {key: tp_kwargs[key] for key in ("norm_groups", "tp_rank") if key in tp_kwargs}
        if tp is not None:  # SP's replicated parameters: their gradient shards are summed over the TP group
            tp_norm["grad_sum"] = (mesh.tp_group, tp.sequence_parallel_params)
        layout = ZeroLayout(model, mesh.dp_cp_group, args.zero, lr=args.lr, weight_decay=args.weight_decay,
                            betas=(args.beta1, args.beta2), param_dtype=ZERO_PARAM_DTYPES[args.dtype],
                            master_dtype=torch.float32, bucket_mb=args.bucket_mb, forward=compiled, **tp_norm)
    else:
        ddp = DistributedDataParallel(compiled, group=mesh.dp_cp_group, bucket_mb=args.bucket_mb)
        optimizer = build_adamw(model.parameters(), args.lr, args.weight_decay, (args.beta1, args.beta2))
        layout = ReplicatedUpdate(ddp, optimizer, **tp_kwargs)
    schedule = LRSchedule(args.lr, args.warmup_steps if args.warmup_steps is not None else max(1, args.steps // 20),
                          args.steps, args.min_lr if args.min_lr is not None else args.lr / 10)
    scaler = DynamicLossScaler(enabled=args.dtype == "fp16")
    sampler = data.BatchSampler(len(train_tokens), seq_len, args.global_batch, args.seed)
    val_sampler = data.EvalSampler(len(val_tokens), seq_len, args.global_batch)
    eval_batches = min(args.eval_batches, val_sampler.num_batches)

    flops = mfu.flops_per_token(
        n_matmul_params=n_matmul_params, n_layer=config.n_layer,
        n_head=config.n_head, head_dim=config.head_dim, seq_len=seq_len, recompute=config.activation_checkpointing,
        n_recomputed_params=n_recomputed,
    )
    peak, peak_source = mfu.detect_peak_flops(device, args.dtype, args.peak_tflops)
    predicted = startup_accounting(mesh, model, config, args, micro, steps_m, seq_len, flops, peak, peak_source,
                                   ddp, device, layout, tp_lines)
    if tp is not None:
        predicted["tp_step"] = tp.step_messages(micro, seq_len, steps_m, DTYPES[args.dtype].itemsize,
                                                sp_grad_bytes=layout.grad_sum_bytes if args.zero else None)

    checkpointer, start_step = None, 0
    if args.ckpt_dir:
        run_record = dict(steps=args.steps, lr=args.lr, min_lr=schedule.min_lr, warmup_steps=schedule.warmup_steps,
                          global_batch=args.global_batch, seq_len=seq_len, seed=args.seed)
        checkpointer = ckpt.Checkpointer(args.ckpt_dir, mesh, keep=args.keep, async_save=args.async_ckpt,
                                         mtbf_hours=args.mtbf_hours, device=device, log=print0,
                                         run_record=run_record)
        if args.resume:  # the batch of step s depends only on (seed, s, B_global): resuming sets the cursor
            start_step = checkpointer.resume(args.resume, layout, scaler, sampler, args.seed)

    # A resumed run appends: the replayed steps then sit next to the originals in one file.
    metrics = open(args.metrics_file, "a" if start_step else "w") if (args.metrics_file and rank == 0) else None
    tracer = mfu.CommTracer()
    for axis, group in mesh.groups.items():
        tracer.name_group(group, axis)
    dp_rank, dp_size = mesh.dp_rank, mesh.dp_size
    tokens_per_step = args.global_batch * seq_len
    timed_seconds, timed_steps = 0.0, 0
    for step in range(start_step, args.steps):
        lr = schedule(step)
        layout.set_lr(lr)
        batches = [sampler.get_batch(train_tokens, step, dp_rank, dp_size, micro, i) for i in range(steps_m)]
        start = time.perf_counter()
        with tracer:  # count the messages of training steps only (not evaluation)
            loss, result = train_step(layout, scaler, batches, mesh.dp_cp_group, args.grad_clip, autocast,
                                      device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        step_time = time.perf_counter() - start
        if step > start_step:  # the first step pays one-off costs (allocation, compile)
            timed_seconds, timed_steps = timed_seconds + step_time, timed_steps + 1
        tokens_per_s = tokens_per_step / step_time
        step_mfu = mfu.mfu(flops.model, tokens_per_s, peak, world_size)
        record = dict(step=step, loss=loss, lr=lr, grad_norm=result.grad_norm, tokens=tokens_per_step,
                      step_time_s=step_time, tokens_per_s=tokens_per_s, mfu=step_mfu, skipped=result.skipped)
        if scaler.enabled:
            record["loss_scale"] = scaler.scale
        last = step == args.steps - 1
        if (args.eval_every and step > 0 and step % args.eval_every == 0) or last:
            record["val_loss"] = evaluate(layout, model, val_tokens, val_sampler, eval_batches, dp_rank, dp_size,
                                          micro, mesh.dp_cp_group, autocast, device)
        if step % args.log_every == 0 or last or "val_loss" in record:
            val = f" | val {record['val_loss']:.4f}" if "val_loss" in record else ""
            print0(f"step {step:5d} | loss {loss:.4f}{val} | lr {lr:.2e} | grad norm {result.grad_norm:.3f}"
                   f"{' (skipped)' if result.skipped else ''} | {tokens_per_s:,.0f} tok/s"
                   f" | MFU {step_mfu:.2%} | {step_time * 1000:.0f} ms")
        if metrics:
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
        if checkpointer:
            checkpointer.step_end(step + 1, args.ckpt_every, last, layout, scaler, sampler)
    if metrics:
        metrics.close()
    if checkpointer:
        checkpointer.close()

    end_accounting(tracer, predicted, layout, args, args.steps - start_step, timed_seconds, timed_steps,
                   tokens_per_step, flops, peak, world_size, device)
    if args.zero == 3:
        layout.unshard()  # gather every weight once: sampling runs a forward on some ranks only
    if args.sample_tokens and rank < shape.tp:  # rank 0's TP group samples together (rank 0 prints)
        with tp.full_logits() if tp is not None else nullcontext():
            sample(model, val_tokens, corpus.tokenizer_name, args.sample_tokens, args.seed, device)
    dist.barrier()
    dist.destroy_process_group()


def end_accounting(tracer, predicted, layout, args, steps_run, seconds, steps, tokens_per_step, flops, peak,
                   world_size, device):
    """Measured against predicted. steps_run: steps traced (a resumed run starts late); steps: steps timed."""
    held = layout.held_bytes()
    print0("=" * 100)
    print0("measured vs predicted (per rank, rank 0):")
    for kind in ("weights", "grads", "optimizer", "total"):
        print0(f"  {kind:<9} held {mfu.format_bytes(held[kind]):>12}   predicted"
               f" {mfu.format_bytes(predicted['persistent'][kind]):>12}")
    if device.type == "cuda":
        print0(f"  CUDA allocator peak {mfu.format_bytes(torch.cuda.max_memory_allocated())}")
    if args.zero:
        for line in layout.end_report_lines(tracer.records, "dp_cp", steps_run, predicted["micro_batches"]):
            print0(line)
    grad_sync = tracer.records.get(("all_reduce", "dp_cp"))
    if grad_sync is not None and steps_run and not args.zero:
        # Every step sends the gradients plus two float64 scalars (token count, loss) over dp_cp.
        print0(f"  all_reduce dp_cp per step: measured payload {mfu.format_bytes(grad_sync.payload_bytes / steps_run)}"
               f" (gradients predicted {mfu.format_bytes(predicted['grad_bytes'])} + 2 scalars),"
               f" sent {mfu.format_bytes(grad_sync.wire_bytes / steps_run)} (predicted"
               f" {mfu.format_bytes(predicted['wire'])})")
    if predicted.get("tp_step") and steps_run:
        print0("  tp group per step (every step: messages × payload, measured vs predicted):")
        for op, (calls, payload) in predicted["tp_step"].items():
            stat = tracer.records.get((op, "tp"))
            m_calls, m_payload = (stat.calls / steps_run, stat.payload_bytes / steps_run) if stat else (0, 0)
            print0(f"    {op:<22} measured {m_calls:g} calls {mfu.format_bytes(m_payload):>10}   predicted"
                   f" {calls} calls {mfu.format_bytes(payload):>10}")
    print0("communication by (collective, group) over the whole run:")
    print0(tracer.table())
    if steps:
        tokens_per_s = tokens_per_step * steps / seconds
        print0(f"throughput {tokens_per_s:,.0f} tok/s, MFU {mfu.mfu(flops.model, tokens_per_s, peak, world_size):.2%},"
               f" HFU {mfu.mfu(flops.hardware, tokens_per_s, peak, world_size):.2%}"
               f" (mean over {steps} steps, the first one of the run excluded)")
    print0("=" * 100)


@torch.no_grad()
def sample(model, val_tokens, tokenizer_name, num_tokens, seed, device):
    tokenizer = data.get_tokenizer(tokenizer_name)
    prompt = torch.from_numpy(val_tokens.tokens[:32].astype("int64"))[None].to(device)
    model.eval()
    out = model.generate(prompt, num_tokens, temperature=0.8, top_k=50,
                         generator=torch.Generator(device=device).manual_seed(seed))
    model.train()
    print0("sample (prompt from the val split, then the model):")
    print0(tokenizer.decode(out[0].tolist()))


if __name__ == "__main__":
    main()
