"""The command line: flags → one frozen `Settings`, every rule checked once, before any rank waits on another.

`parse(argv, axes)` is all train.py calls: argparse, then the run's own rules (ranges, paths, the batch
arithmetic B_global = D·m·B_μ, flags that need another), then each axis's `config_from_flags(args, settings)`,
which returns that axis's frozen config (None when the axis is off) or raises ValueError naming the flag. The
axes never see the flags again: `apply(model, run, config)` gets its config, validated.

An error is one line, `error: ...`, printed exactly once however many ranks hit it, exit status 2 (`fail`).

Accounting for this file: nothing is held or sent, except one error line through torchrun's agent store.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import NoReturn

import torch
import torch.distributed as dist

from cli import paths
# The command line itself (its flags and --help) is cli/arguments.py's; callers reach it through this module.
from cli.arguments import FlagError, OneLineParser, add_plan_arguments, build_parser  # noqa: F401
import data
from experts import router
from interop import hf
import moe
from parallel import offload, recompute
from planner import calibration, hardware
from resilience import diloco, elastic
from mesh import MeshShape, choose_device_and_backend, infer_mesh_shape
from model import PRESETS, GPTConfig, config_from_preset
from resilience.ckpt_files import CheckpointError, WriterLock
from optimizers import muon
from optimizers.muon import MuonConfig
from resilience.diloco import DiLoCoConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# --activation-checkpointing's modes → the GPTConfig field each one sets (none sets neither)
RECOMPUTE_FIELDS = {"full": "activation_checkpointing", "selective": "selective_recompute"}


@contextmanager
def flag_errors():
    """A rule's ValueError (each names its flag, as every `check_flags` and `config_from_flags` does) as a
    FlagError: one line, exit status 2."""
    try:
        yield
    except ValueError as e:
        raise FlagError(str(e)) from None


@dataclass(frozen=True)
class Settings:
    """Everything the flags decide, validated: what train.py builds the run from."""

    args: argparse.Namespace  # the parsed flags (read, never written)
    given: frozenset  # the flags the command line set itself (explicit_flags)
    shape: MeshShape  # D, P, C, T, E
    model: GPTConfig  # the logical model (its vocabulary: the tokenizer's or --init-from's, padded: padded_vocab)
    seq_len: int
    micro_batch_size: int  # B_μ: sequences per micro-batch per data rank
    micro_batches: int  # m = B_global / (D·B_μ)
    axes: dict = field(default_factory=dict)  # {axis module name: its config, None when off}, in train.AXES order
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str = "gloo"
    dtype: str = "fp32"  # the autocast dtype (--dtype auto resolved)
    dtype_reason: str = "--dtype"  # why: what was asked, or what auto found
    ckpt_lock: WriterLock | None = None  # rank 0's hold on --ckpt-dir for the run (claim_checkpoint_directory)
    diloco: DiLoCoConfig | None = None  # --diloco-h: the replicas' outer step (resilience/diloco.py)
    placement_cost: tuple | None = None  # the EP ranks' link costs by the hardware model (experts/transport.py's)
    muon: MuonConfig | None = None  # --optimizer muon: Muon on the blocks' matrices (optimizers/muon.py)

    @property
    def world_size(self) -> int:
        return self.shape.world_size

    @property
    def sequence_parallel(self) -> bool:
        """--sp: the residual stream between TP regions is cut along the sequence too (s/T tokens a rank),
        which the pipeline's boundary messages, the experts' routing and FP8's token counts follow."""
        return bool(self.args.sp) and self.shape.tp > 1

    @property
    def local_seq_len(self) -> int:
        """Tokens of one sequence that a rank holds between TP regions: s/C under CP, ÷T more under SP."""
        return self.seq_len // self.shape.cp // (self.shape.tp if self.sequence_parallel else 1)


# Ranges of the numeric flags: (flag, attribute, lowest, exclusive lowest?, highest or None). Every float must
# also be finite: NaN passes every comparison, so `nan < 0` would let it through.
_AT_LEAST_1 = ("steps", "log_every", "eval_batches", "micro_batch", "global_batch", "n_layer", "n_head", "n_embd",
               "seq_len", "pp_virtual", "fp8_amax_history", "moe_topk", "moe_every", "world", "gpus_per_node",
               "moe_replan_every", "vocab_size")
_AT_LEAST_0 = ("eval_every", "warmup_steps", "ckpt_every", "sample_tokens", "moe_experts", "moe_replicas", "fp8_margin",
               "weight_decay", "grad_clip", "moe_capacity_factor", "moe_aux_coef", "moe_z_coef", "min_lr",
               "hw_intra_latency_us", "hw_inter_latency_us", "moe_bias_rate", "moe_seq_aux_coef", "moe_groups",
               "moe_group_limit", "moe_shared_experts")
_POSITIVE = ("lr", "bucket_mb", "mtbf_hours", "peak_tflops", "hw_peak_tflops", "hw_hbm_gbps", "hw_memory_gib",
             "hw_intra_gbps", "hw_inter_gbps", "hw_host_link_gbps", "hw_host_adam_gbps",
             "hw_host_memory_gib", "moe_route_scale")
_FRACTION = ("beta1", "beta2", "dropout", "moe_load_decay", "moe_local_hit")  # in [0, 1)
# Upper bounds past which a value cannot be used: (attribute, highest, why).
_AT_MOST = (
    ("bucket_mb", 2.0**20, "a bucket of at most 1 TiB (its byte count must be an integer)"),
    ("fp8_margin", 127, "a power of two that float32 holds (the scale is max/amax/2^margin)"),
)
# Flags that only mean something with another one: (flag, attribute, what it needs, whether that is on).
_ONLY_WITH = (
    ("--world", "world", "--plan or --plan-search (a run's world is its launcher's)",
     lambda a: a.plan or a.plan_search),
    ("--vocab-size", "vocab_size", "--plan or --plan-search (a run's vocabulary is its tokenizer's)",
     lambda a: a.plan or a.plan_search),
    ("--attention-kernel", "attention_kernel", "--plan or --plan-search (a run's kernel is the one its device"
     " dispatches)", lambda a: a.plan or a.plan_search),
    ("--pp-p2p", "pp_p2p", "--plan or --plan-search (a run's sends are the trainer's own, overlapped)",
     lambda a: a.plan or a.plan_search),
    ("--pp-schedule", "pp_schedule", "--pp > 1", lambda a: a.pp > 1),
    ("--pp-virtual", "pp_virtual", "--pp-schedule interleaved", lambda a: a.pp_schedule == "interleaved"),
    ("--trace-file", "trace_file", "--pp > 1 (it draws the pipeline schedule)", lambda a: a.pp > 1),
    ("--cp-impl", "cp_impl", "--cp > 1", lambda a: a.cp > 1),
    *((flag, flag[2:].replace("-", "_"), "--diloco-h H (the inner steps between outer steps)",
       lambda a: a.diloco_h is not None)
      for flag in ("--diloco-replicas", "--diloco-outer-lr", "--diloco-outer-momentum")),
    ("--cp-balance", "cp_balance", "--cp > 1", lambda a: a.cp > 1),
    *((flag, flag[2:].replace("-", "_"), "--fp8", lambda a: a.fp8 is not None)
      for flag in ("--fp8-amax-history", "--fp8-amax-algo", "--fp8-margin")),
    *((flag, flag[2:].replace("-", "_"), "--moe-experts > 0", lambda a: a.moe_experts > 0)
      for flag in ("--moe-topk", "--moe-every", "--moe-capacity-factor", "--moe-aux-coef", "--moe-z-coef",
                   "--moe-shared-experts", "--moe-replicas",
                   *router.FLAGS)),
    *((flag, flag[2:].replace("-", "_"), "--moe-replicas", lambda a: a.moe_replicas > 0)
      for flag in ("--moe-replan-every", "--moe-load-decay", "--moe-placement")),
    ("--moe-placement-cost", "moe_placement_cost", "--moe-placement sinkhorn", lambda a: a.moe_placement == "sinkhorn"),
    *((flag, flag[2:].replace("-", "_"), "--offload (the host memory they price)", lambda a: a.offload is not None)
      for flag in ("--hw-host-link-gbps", "--hw-host-adam-gbps", "--hw-host-memory-gib")),
    ("--moe-local-hit", "moe_local_hit", "--ep > 1 and --plan or --plan-search",
     lambda a: a.ep > 1 and (a.plan or a.plan_search)),
    *((flag, flag[2:].replace("-", "_"), "--ckpt-dir", lambda a: a.ckpt_dir is not None)
      for flag in ("--ckpt-every", "--resume", "--async-ckpt", "--keep", "--mtbf-hours", "--drop-state")),
)


def explicit_flags(argv) -> set:
    """The attributes the command line sets itself (not left at their defaults): argparse fills in a default
    only for attributes missing from the namespace it is given, so parse again into one where all are set."""
    parser, unset = build_parser(), object()
    names = vars(parser.parse_args(argv))
    given = vars(parser.parse_args(argv, namespace=argparse.Namespace(**{name: unset for name in names})))
    return {name for name, value in given.items() if value is not unset}


def validate(args, world_size: int, given=None, axes=(), check_files: bool = True) -> Settings:
    """Check every flag before any process group exists: the run's own rules here, then each axis module's
    `config_from_flags(args, settings)` (in `axes`, train.AXES' order). Returns the Settings (device and dtype
    not chosen yet: parse does that). given: the flags the command line set (explicit_flags), for the rules
    about flags that only mean something with another one; default: those whose value is not the default.
    check_files=False leaves out cli/paths.py's checks (the plan search makes them once, not per layout)."""
    if given is None:
        defaults = vars(build_parser().parse_args([]))
        given = {name for name, value in vars(args).items() if name in defaults and value != defaults[name]}
    check_ranges(args)
    for flag, name, needs, on in _ONLY_WITH:
        if name in given and not on(args):
            raise FlagError(f"{flag} needs {needs}; without it the flag would be ignored")
    with flag_errors():  # each rule's ValueError names its flag
        calibration.check_flags(args)  # each --calib-* constant in its range
        elastic.check_flags(args, world_size)  # every world of the range, before this one's shape names a flag
        diloco_config = diloco.config_from_flags(args)  # H ≥ 1, the outer lr and momentum; R checked by the mesh
        muon_config = muon.config_from_flags(args)  # its ranges, and the layouts and recipes Muon cannot serve
        shape = infer_mesh_shape(world_size, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep,
                                 replicas=diloco_config.replicas if diloco_config else None)
        recompute.check_flags(args, shape)
        offload.check_flags(args)  # --zero 1/2 and a layout it serves
        config = model_config(args, given)
        # The experts' split before the batch arithmetic, which takes the mesh as given: --ep 3 of 4 experts is a
        # wrong --ep, not a global batch that D = 3 does not divide.
        moe.check_flags(config, shape)
        if check_files:
            paths.check_paths(args)
    if args.min_lr is not None and args.min_lr > args.lr:
        raise FlagError(f"--min-lr {args.min_lr} is above --lr {args.lr}: the cosine schedule decays from --lr"
                        f" down to --min-lr")
    micro = _micro_batch_size(args, shape.dp)
    _check_sequence_and_checkpoint_flags(args, config)
    _set_vocabulary(args, config)
    settings = Settings(args=args, given=frozenset(given), shape=shape, model=config,
                        seq_len=args.seq_len or config.block_size, micro_batch_size=micro,
                        micro_batches=args.global_batch // (shape.dp * micro), diloco=diloco_config,
                        placement_cost=hardware.ep_link_costs(args, shape), muon=muon_config)
    return replace(settings, axes=_axis_configs(args, settings, axes))


def _micro_batch_size(args, dp: int) -> int:
    """B_μ: --micro-batch, or B_global / D (one micro-batch per step); B_global must be D·m·B_μ."""
    micro = args.micro_batch if args.micro_batch is not None else args.global_batch // dp
    if micro < 1:
        raise FlagError(f"--global-batch {args.global_batch} must give each of D={dp} data ranks a sequence")
    if args.global_batch % (dp * micro):
        raise FlagError(
            f"--global-batch {args.global_batch} must be divisible by D × --micro-batch = {dp} × {micro}"
            f" (B_global = D·m·B_μ)"
        )
    return micro


def _check_sequence_and_checkpoint_flags(args, config) -> None:
    if args.seq_len is not None and args.seq_len > config.block_size:
        raise FlagError(f"--seq-len {args.seq_len} must be between 1 and the model's block size {config.block_size}")
    if args.ckpt_dir is not None and args.keep < 2:
        raise FlagError(f"--keep must be at least 2 (a good checkpoint must survive while the next is written),"
                        f" got {args.keep}")
    if args.resume is not None and args.resume != "latest" and not args.resume.isdigit():
        raise FlagError(f"--resume must be 'latest' or a step number, got {args.resume!r}")


def _set_vocabulary(args, config) -> None:
    """The tokenizer's vocabulary (or --init-from's config.json's), padded: it must fit the tokenizer."""
    real_vocab = config.real_vocab_size if args.init_from else tokenizer_vocab(args.tokenizer)
    check_tokenizer(args.tokenizer, real_vocab, f"--init-from {args.init_from}" if args.init_from else None)
    config.vocab_size = padded_vocab(real_vocab)  # rows past real_vocab are padding, never predicted (model.py)
    config.real_vocab_size = real_vocab if config.vocab_size > real_vocab else None


def _axis_configs(args, settings: Settings, axes) -> dict:
    """Each axis module's frozen config (None: the axis is off), in `axes`' order; its ValueError names a flag."""
    configs = {}
    for axis in axes:
        with flag_errors():
            configs[axis.__name__] = axis.config_from_flags(args, settings)
    return configs


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
    if abs(args.seed) > 2**63 - 1:
        raise bad("seed", "a 63-bit integer, |seed| < 2^63 (torch.manual_seed takes seed + rank)")
    for name, highest, why in _AT_MOST:
        if getattr(args, name) is not None and getattr(args, name) > highest:
            raise bad(name, f"at most {highest:g}: {why}")


def model_config(args, given=frozenset()):
    """The GPTConfig of the flags: the preset with its overrides, or --init-from's config.json (init_from_config).
    The vocabulary is set by validate (the tokenizer's, or config.json's, padded)."""
    if args.init_from is not None:
        return init_from_config(args, given)
    overrides = dict(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, dropout=args.dropout,
                     gelu=args.gelu, moe=moe.experts_config(args))
    if args.no_bias:
        overrides["bias"] = False
    if args.activation_checkpointing != "none":
        overrides[RECOMPUTE_FIELDS[args.activation_checkpointing]] = True
    with flag_errors():
        return config_from_preset(args.preset, **overrides)


def init_from_config(args, given) -> GPTConfig:
    """--init-from DIR: the shape and GELU from its config.json (hf.HFDirectory checks the directory: every
    GPT-2 tensor there, with its shape); a flag that says otherwise is an error, not a silent override."""
    flag = f"--init-from {args.init_from}"
    if not args.init_from:
        raise FlagError("--init-from '' names nothing; give a Hugging Face GPT-2 directory")
    try:
        shape = hf.HFDirectory(args.init_from).shape
    except hf.HFError as e:
        raise FlagError(f"{flag}: {e}") from None
    fixed = dict(n_layer=shape.n_layer, n_head=shape.n_head, n_embd=shape.n_embd, gelu=shape.gelu)
    for name, value in fixed.items():
        if name in given and getattr(args, name) != value:
            raise FlagError(f"--{name.replace('_', '-')} {getattr(args, name)} contradicts {flag}, whose config.json"
                            f" has {name}={value}; leave the flag out")
    if "preset" in given:
        preset = config_from_preset(args.preset) if args.preset in PRESETS else None
        if preset is None or (preset.n_layer, preset.n_head, preset.n_embd, preset.block_size) != (
                shape.n_layer, shape.n_head, shape.n_embd, shape.block_size):
            raise FlagError(f"--preset {args.preset} contradicts {flag}, whose config.json has n_layer={shape.n_layer}"
                            f" n_head={shape.n_head} n_embd={shape.n_embd} n_positions={shape.block_size}; leave"
                            f" --preset out")
    if args.no_bias:
        raise FlagError(f"--no-bias contradicts {flag}: GPT-2 has biases")
    if args.moe_experts:
        raise FlagError(f"--moe-experts with {flag}: GPT-2's MLPs are dense, the experts would have no weights")
    return GPTConfig(block_size=shape.block_size, vocab_size=shape.vocab_size, real_vocab_size=shape.vocab_size,
                     n_layer=shape.n_layer, n_head=shape.n_head, n_embd=shape.n_embd, gelu=shape.gelu,
                     dropout=args.dropout or 0.0,
                     **{RECOMPUTE_FIELDS[mode]: args.activation_checkpointing == mode for mode in RECOMPUTE_FIELDS})


def tokenizer_vocab(tokenizer: str) -> int:
    """The real vocabulary of a tokenizer: 256 bytes, or GPT-2's 50257 BPE tokens."""
    return data.ByteTokenizer.vocab_size if tokenizer == "byte" else data.GPT2Tokenizer.vocab_size


def tokenizer_of_vocab(vocab: int) -> str:
    """The tokenizer of a model's real vocabulary: GPT-2's BPE for its 50257 rows, else bytes."""
    return "gpt2" if vocab == data.GPT2Tokenizer.vocab_size else "byte"


def check_tokenizer(tokenizer: str, vocab: int, source: str | None) -> None:
    """--tokenizer is the one of the real vocabulary of the model `source` gives (None: the tokenizer's own):
    one row per token, so that every row the model can predict can be decoded."""
    if source is None or vocab == tokenizer_vocab(tokenizer):
        return
    if tokenizer == "byte" and vocab == data.GPT2Tokenizer.vocab_size:
        raise FlagError(f"{source} has GPT-2's BPE vocabulary ({vocab} rows): add --tokenizer gpt2")
    raise FlagError(f"--tokenizer {tokenizer} has {tokenizer_vocab(tokenizer)} tokens, but {source} has {vocab} rows:"
                    f" the tokenizers are bytes (256 tokens) and GPT-2's BPE (50257)")


def padded_vocab(vocab_size: int, multiple: int = 64) -> int:
    """The padded vocabulary's rule: round the rows up to a multiple of 64 (50257 → 50304; 256 stays), so the
    head's matmul has friendly shapes and splits T ways for tensor parallel. The padding rows are never
    predicted (model.py), so the rule changes no loss and no sample."""
    return ((vocab_size + multiple - 1) // multiple) * multiple


def check_world(args) -> None:
    """--plan/--plan-search's own rules: --world given, filling whole nodes of G GPUs (rank // G is the node:
    at most G, or a multiple), divisible by the layout (before any build), the math attention kernel without CP."""
    if args.world is None:
        raise FlagError("--plan and --plan-search need --world N (the number of ranks to plan for)")
    gpus = args.gpus_per_node or hardware.PRESETS[args.hw].gpus_per_node
    if args.world > gpus and args.world % gpus:
        raise FlagError(f"--world {args.world} does not fill whole nodes of {gpus} GPUs (--gpus-per-node, or --hw"
                        f" {args.hw}'s): give a multiple of {gpus}, or at most {gpus} ranks")
    if args.attention_kernel == "math" and args.cp > 1:
        raise FlagError("--attention-kernel math needs --cp 1: context parallel's attention (the ring's blocks,"
                        " Ulysses' heads) runs the fused kernel, without dropout")
    model_parallel = args.tp * args.pp * args.cp
    if args.plan and args.world % model_parallel:
        raise FlagError(f"--world {args.world} is not divisible by --tp {args.tp} × --pp {args.pp} × --cp {args.cp}"
                        f" = {model_parallel}: the layout needs a multiple of {model_parallel} ranks")


def parse(argv=None, axes=(), prog: str = "train.py") -> Settings:
    """The flags of this process (sys.argv) as Settings, or one error line and exit status 2 (fail).

    Every rank validates the same flags and fails alike before any of them waits on a peer; the device,
    the backend and the --dtype auto choice are made here too, so a wrong one fails as early, and rank 0
    takes --ckpt-dir's writer lock (claim_checkpoint_directory), so a directory another run writes does too."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser(prog).parse_args(argv)
        planning = args.plan or args.plan_search
        if planning:
            check_world(args)
        given = explicit_flags(argv)
        settings = validate(args, args.world if planning else int(os.environ.get("WORLD_SIZE", "1")), given, axes)
        if not planning:  # a plan reads no corpus
            data.get_tokenizer(args.tokenizer)  # --tokenizer gpt2 without its files fails here, on every rank
        with flag_errors():
            device, backend = choose_device_and_backend(args.backend)
        dtype, reason = (args.dtype, "--dtype") if args.dtype != "auto" else auto_dtype(device)
        if not planning and device.type != "cuda":
            check_no_hardware_flags(given)
        lock = claim_checkpoint_directory(args.ckpt_dir) if args.ckpt_dir and not planning else None  # last: the
        # only check that creates something (the directory and its lock), once every other one has passed
    except (FlagError, RuntimeError) as e:
        fail(str(e))
    return replace(settings, device=device, backend=backend, dtype=dtype, dtype_reason=reason, ckpt_lock=lock)


def check_no_hardware_flags(given) -> None:
    """The hardware model's flags (--hw, --hw-*, --gpus-per-node) describe a GPU: the one --plan and
    --plan-search size for, or a GPU run's (its end line checks the model); a CPU run measures its own."""
    stated = sorted(name for name in given
                    if name == "hw" or name.startswith(("hw_", "calib_")) or name == "gpus_per_node")
    if stated:
        flag = "--" + stated[0].replace("_", "-")
        raise FlagError(f"{flag} describes the GPU of --plan / --plan-search or of a GPU run; this run is on the"
                        f" CPU, whose hardware model is measured: add --plan (or --plan-search) --world N, or leave"
                        f" {flag} out")


def claim_checkpoint_directory(path: str, timeout_s: float = 300.0) -> WriterLock | None:
    """--ckpt-dir's writer lock (ckpt_files.WriterLock), taken now by the process that will be rank 0 and held
    for the whole run (the Checkpointer is handed it: Settings.ckpt_lock), so a second run writing the same
    directory is refused at start-up, before any process group, with one line naming the holder (pid, host).

    An flock, not a lock file made with O_CREAT|O_EXCL: the kernel drops it when its holder dies however it
    dies (SIGKILL, OOM), so a stale lock never blocks and no pid has to be judged alive (pids are reused, and
    a pid on another host cannot be checked at all); the file only names the holder for the refusal.
    Under torchrun the other workers hear rank 0's verdict through the agent's store, so all of them end now,
    alike, instead of waiting in init_process_group for a rank 0 that is gone; a rank other than 0 returns
    None (it writes no commit)."""
    rank, store, key = int(os.environ.get("RANK", "0")), _launcher_store(timeout_s), _launcher_key("ckpt-dir")
    if rank != 0:
        if store is not None:
            store.wait([key], datetime.timedelta(seconds=timeout_s))
            verdict = store.get(key).decode()
            if verdict:
                raise FlagError(verdict)
        return None  # without torchrun's store, rank 0 alone refuses (and its launcher stops the others)
    lock, verdict = None, ""
    try:
        os.makedirs(path, exist_ok=True)
        lock = WriterLock(path)
    except CheckpointError as e:
        verdict = str(e)
    except OSError as e:  # paths.check_paths found it can be made: a race, or a filesystem that refuses locks
        verdict = f"--ckpt-dir {path}: cannot create it or its lock file: {e.strerror or e}"
    if store is not None:
        store.set(key, verdict)
    if verdict:
        raise FlagError(verdict)
    return lock


def auto_dtype(device: torch.device) -> tuple[str, str]:
    """(dtype, why) for --dtype auto: bf16 where the device multiplies bf16 natively, else fp32."""
    if device.type == "cuda":
        ok = torch.cuda.is_bf16_supported()
        return ("bf16", "--dtype auto: bf16 tensor cores") if ok else ("fp32", "--dtype auto: no bf16 tensor cores")
    if torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported():
        return "bf16", "--dtype auto: this CPU has bf16 matrix units (AMX or AVX512-BF16)"
    return "fp32", ("--dtype auto: this CPU has no bf16 matrix units (no AMX, no AVX512-BF16): bf16 would be"
                    " emulated, several times slower than fp32")


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


def _launcher_store(timeout_s: float):
    """torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE), which every worker can reach before any process
    group exists; None for one process, or without torchrun."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return None
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def _launcher_key(what: str) -> str:
    """A key of this attempt of this run in the launcher's store (a restarted attempt starts afresh)."""
    return f"train.py/{what}/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT')}"


def _print_once_through_launcher_store(line: str, timeout_s: float = 30.0) -> bool:
    """Print `line` on exactly one of torchrun's workers (the first to get here): True when that is settled."""
    key = _launcher_key("error")
    try:
        store = _launcher_store(timeout_s)
        if store is None:
            return False
        if store.add(f"{key}/claimed", 1) == 1:
            print(line, file=sys.stderr, flush=True)
            store.set(f"{key}/printed", "1")
        else:
            store.wait([f"{key}/printed"], datetime.timedelta(seconds=timeout_s))
        return True
    except (RuntimeError, OSError, KeyError, ValueError):  # no store to be reached: rank 0 prints
        return False


