"""The flags themselves: every argument the command line takes, in the groups --help lists, with its help and
its default (`HelpWithDefaults` says each one). What they may be together is cli/flags.py's: it checks every rule
once, before any rank waits on another, into a frozen `Settings`."""

from __future__ import annotations

import argparse
from typing import NoReturn

from experts import router
from model import PRESETS
from optimizers import muon, qk_clip
from parallel import offload, recompute
from planner import hardware
from resilience import elastic

DTYPE_CHOICES = ("fp32", "bf16", "fp16")  # --dtype besides auto (cli/flags.py: their torch dtypes)


class FlagError(ValueError):
    """A flag combination that cannot run; raised before any rank waits on another."""


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors (an unknown flag, a choice not offered) are FlagErrors: like every other flag
    error they end the run with one line, printed once, not with argparse's usage text on every rank."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, formatter_class=HelpWithDefaults, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise FlagError(message)


class HelpWithDefaults(argparse.HelpFormatter):
    """--help states every flag's default: "(default: X)" after its help, unless the help already says what the
    default is (a flag whose default is derived: --min-lr, --seq-len), "(default: off)" for a switch."""

    def _get_help_string(self, action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, argparse.SUPPRESS) or not action.option_strings:
            return text  # a flag without a value of its own says in its help what happens without it
        if action.default is False:
            return f"{text} (default: off)"
        return f"{text} (default: %(default)s)"


DESCRIPTIONS = {"train.py": "Train the GPT on a mesh of devices (see README.md).",
                "plan.py": "Size a layout of --world ranks without its hardware: every rank role's memory, messages"
                           " and predicted step time, or the best layouts (--plan-search); see README.md."}


def build_parser(prog: str = "train.py") -> argparse.ArgumentParser:
    """Every flag; `prog` names the program in usage and errors (plan.py takes the same flags)."""
    p = OneLineParser(prog=prog, description=DESCRIPTIONS.get(prog, DESCRIPTIONS["train.py"]))
    for add_group in (_add_model_flags, _add_data_flags, _add_optimization_flags, _add_parallelism_flags,
                      _add_fp8_flags, _add_moe_flags, _add_reporting_flags, _add_checkpoint_flags):
        add_group(p)  # --help lists the groups in this order
    add_plan_arguments(p)
    return p


def _add_model_flags(parser) -> None:
    g = parser.add_argument_group("model")
    g.add_argument("--preset", default="mini", help="model size: " + " | ".join(PRESETS))
    g.add_argument("--n-layer", type=int, help="transformer blocks L (default: the preset's)")
    g.add_argument("--n-head", type=int, help="attention heads a (default: the preset's)")
    g.add_argument("--n-embd", type=int, help="hidden size h (default: the preset's)")
    g.add_argument("--seq-len", type=int, help="tokens per sequence (default: the preset's block size)")
    g.add_argument("--dropout", type=float, help="dropout probability (default: the preset's, 0)")
    g.add_argument("--no-bias", action="store_true", help="no biases in linears and LayerNorms")
    g.add_argument("--activation-checkpointing", nargs="?", const="full", default="none", choices=recompute.MODES,
                   help="recompute in backward: none, full (each block from its input; the bare flag) or selective"
                   " (keep the GEMMs' outputs, recompute the LayerNorms, GELU, dropouts: parallel/recompute.py)")
    g.add_argument("--gelu", choices=["exact", "tanh"], help="the MLP's GELU: exact (erf; the default) or GPT-2's"
                   " tanh approximation (the default with --init-from GPT-2 weights)")
    g.add_argument("--init-from", metavar="DIR", help="start from a local Hugging Face GPT-2 directory (config.json +"
                   " model.safetensors or pytorch_model.bin; nothing is downloaded): its config.json sets the shape"
                   " (default: none, the per-parameter init)")


def _add_data_flags(parser) -> None:
    g = parser.add_argument_group("data")
    g.add_argument("--data", help="a text file to train on (default: the Python standard library's source)")
    g.add_argument("--tokenizer", default="byte", choices=["byte", "gpt2"],
                   help="byte: UTF-8 bytes, vocabulary 256, nothing downloaded; gpt2: tiktoken's GPT-2 BPE")
    g.add_argument("--out-dir", default="out", help="token cache, metrics and checkpoints go here")


def _add_optimization_flags(parser) -> None:
    g = parser.add_argument_group("optimization")
    g.add_argument("--steps", type=int, default=600, help="optimizer steps to train")
    g.add_argument("--global-batch", type=int, default=16, help="sequences per optimizer step (B_global)")
    g.add_argument("--micro-batch", type=int, default=None,
                   help="sequences per rank per micro-step (B_μ; default: B_global / D, one micro-batch a step)")
    g.add_argument("--lr", type=float, default=3e-3, help="AdamW's peak learning rate")
    g.add_argument("--min-lr", type=float, default=None, help="cosine floor (default lr/10)")
    g.add_argument("--warmup-steps", type=int, default=None, help="default: 5%% of --steps")
    g.add_argument("--weight-decay", type=float, default=0.1,
                   help="AdamW's decoupled weight decay (none on biases and LayerNorms)")
    g.add_argument("--beta1", type=float, default=0.9, help="AdamW's first-moment decay β1")
    g.add_argument("--beta2", type=float, default=0.95, help="AdamW's second-moment decay β2")
    g.add_argument("--grad-clip", type=float, default=1.0, help="clip the global grad norm to this (0: off)")
    g.add_argument("--dtype", default="auto", choices=["auto", *DTYPE_CHOICES],
                   help="autocast compute dtype; auto: bf16 where the device has bf16 matrix units (CUDA, CPUs with"
                        " AMX or AVX512-BF16), else fp32 (a CPU without them emulates bf16, several times slower)")
    g.add_argument("--seed", type=int, default=1337, help="initialisation (per parameter) and data order")
    g.add_argument("--tf32", action="store_true",
                   help="fp32 matmuls on TF32 tensor cores (Ampere and newer: ~8x the FP32 peak, 10-bit mantissa"
                        " products); default off: --dtype fp32 means full FP32 (the peak for MFU follows)")
    g.add_argument("--deterministic", action="store_true",
                   help="bitwise-reproducible CUDA kernels (torch.use_deterministic_algorithms, cuBLAS workspace"
                        " :4096:8): slower attention backward and scatter-adds; CPU runs are deterministic anyway")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile each transformer block (GPU speed): per block, gradient hooks still fire block"
                        " by block in backward, so DDP/ZeRO communication keeps overlapping it")
    muon.add_arguments(g)  # --optimizer adamw|muon, --muon-lr, --muon-momentum, --muon-owner
    qk_clip.add_arguments(g)  # --qk-clip TAU: MuonClip's QK-clip after each step


def _add_parallelism_flags(parser) -> None:
    g = parser.add_argument_group("parallelism")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size T")
    g.add_argument("--pp", type=int, default=1, help="pipeline-parallel size P")
    g.add_argument("--cp", type=int, default=1, help="context-parallel size C")
    g.add_argument("--ep", type=int, default=1, help="expert-parallel size E")
    g.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage (0: plain DDP)")
    g.add_argument("--sp", action="store_true", help="sequence parallel (with --tp)")
    g.add_argument("--offload", choices=offload.MODES, help="with --zero 1/2: Adam's moments (optimizer), and the"
                   " fp32 masters (optimizer+master), in host memory, the update on the host (parallel/offload.py);"
                   " default: none")
    g.add_argument("--diloco-h", type=int, help="DiLoCo (resilience/diloco.py): H inner AdamW steps per"
                   " outer step (default: none, plain data parallel)")
    g.add_argument("--diloco-replicas", type=int, help="DiLoCo replicas R (a divisor of D; default 1)")
    g.add_argument("--diloco-outer-lr", type=float, default=0.7, help="DiLoCo's outer Nesterov SGD learning rate")
    g.add_argument("--diloco-outer-momentum", type=float, default=0.9, help="DiLoCo outer Nesterov momentum")
    g.add_argument("--bucket-mb", type=float, default=25.0, help="DDP gradient bucket size in MiB")
    g.add_argument("--tp-comm-bits", type=int, default=16, help="TP's all-reduces (f, g): 4 = NVFP4 codes summed in"
                   " fp32, with error feedback (parallel/lowbit.py); 16 (default) = the exact all-reduce")
    g.add_argument("--dp-comm-bits", type=int, default=16, help="DDP's gradient buckets: 4 = NVFP4 codes summed in"
                   " fp32, with error feedback (parallel/lowbit.py); 16 (default) = the exact all-reduce")
    g.add_argument("--comm-feedback", default="on", help="with a 4-bit all-reduce: on (default) feeds each call's"
                   " error into a later call, off drops it (the ablation)")
    g.add_argument("--backend", choices=["nccl", "gloo"], help="default: nccl with GPUs, else gloo")
    g.add_argument("--pp-schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved", "zb"],
                   help="pipeline schedule (pipeline.py)")
    g.add_argument("--pp-virtual", type=int, default=2, help="model chunks per rank for --pp-schedule interleaved")
    g.add_argument("--pp-redundant", action="store_true",
                   help="Bamboo's pipeline redundancy (resilience/redundancy.py): each stage shadows its successor"
                        " (forwards in the bubble, the same update) and takes over a lost one without a checkpoint;"
                        " off by default")
    g.add_argument("--trace-file", help="write one executed pipeline step as Chrome-trace JSON (Perfetto;"
                   " default: none)")
    g.add_argument("--cp-impl", default="ring", choices=["ring", "ulysses"], help="context parallel attention")
    g.add_argument("--cp-balance", default="zigzag", choices=["zigzag", "contiguous"],
                   help="how the sequence is cut over the C ranks (zig-zag balances causal work)")


def _add_fp8_flags(parser) -> None:
    g = parser.add_argument_group("FP8 (fp8.py)")
    g.add_argument("--fp8", choices=("current", "delayed", "blockwise"), default=None,
                   help="FP8 block linears: current | delayed | blockwise (default: none, the compute dtype)")
    g.add_argument("--fp8-amax-history", type=int, default=16, help="delayed: amax history length L")
    g.add_argument("--fp8-amax-algo", choices=("max", "most_recent"), default="max", help="delayed: scale from")
    g.add_argument("--fp8-margin", type=int, default=0, help="scale = max/amax/2^margin")
    g.add_argument("--precision-recipe", metavar="SPEC", help="microscaling block linears (precision/recipe.py;"
                   " default: none, the compute dtype): a preset mxfp8 | mxfp4 | nvfp4 | quartet2"
                   " (= fwd=nvfp4,bwd=nvfp4,4over6,eden), or comma-separated parts: fwd=F, bwd=F (F: bf16 | mxfp8"
                   " | mxfp4 | nvfp4; default bf16), sr (stochastic rounding of dY), rht (random Hadamard on dW's"
                   " operands), w2d (16×16 NVFP4 weight blocks), 4over6 (Four Over Six: each forward NVFP4 block"
                   " scaled to 6 or 4, the lower MSE), eden (MS-EDEN backward, precision/quartet.py), rotation=G"
                   " (its rotation group: 16 | 32 | 64 | 128 | 256; default 128), tail=F (the last share of blocks"
                   " in the compute dtype; default 0), rule=rceil|floor (MX scales; default rceil); not with --fp8")


def _add_moe_flags(parser) -> None:
    g = parser.add_argument_group("mixture of experts (moe.py)")
    g.add_argument("--moe-experts", type=int, default=0, help="experts N per MoE block (0: dense MLP)")
    g.add_argument("--moe-topk", type=int, default=2, help="experts per token k")
    g.add_argument("--moe-every", type=int, default=1, help="every n-th block is MoE")
    g.add_argument("--moe-capacity-factor", type=float, default=0.0,
                   help="capacity per expert ⌈B_μ·s·k/N·f⌉ of each micro-batch (0: dropless)")
    g.add_argument("--moe-aux-coef", type=float, default=0.01, help="load-balance loss coefficient α")
    g.add_argument("--moe-z-coef", type=float, default=0.001, help="router z-loss coefficient β")
    router.add_arguments(g)  # DeepSeek-V3's router: sigmoid scores, the bias, the seq loss, groups
    g.add_argument("--moe-shared-experts", type=int, default=0,
                   help="S always-on experts per MoE block, added ungated (experts/shared.py)")
    g.add_argument("--moe-replicas", type=int, default=0, help="physical experts R ≥ N, R/E per EP rank, the hot"
                   " ones replicated (experts/eplb.py; 0: the N experts in place)")
    g.add_argument("--moe-replan-every", type=int, default=50, help="re-place the replicas every n steps")
    g.add_argument("--moe-load-decay", type=float, default=0.9, help="the expert loads' moving average: load ←"
                   " d·load + (1 − d)·the step's")
    g.add_argument("--moe-placement", default="eplb", help="how the R slots are placed: eplb (default), sinkhorn"
                   " (experts/transport.py), coselect (R = N, experts/coupling.py), or the R slots' experts as a list")
    g.add_argument("--moe-placement-cost", help="sinkhorn's E×E link costs 'c00,c01,..;c10,..' (default: the"
                   " hardware model's, 1/GB/s of the intra- or inter-node link, --hw and --gpus-per-node)")


def _add_reporting_flags(parser) -> None:
    g = parser.add_argument_group("evaluation and reporting")
    g.add_argument("--eval-every", type=int, default=100, help="val loss every N steps (0: only at the end)")
    g.add_argument("--eval-batches", type=int, default=4, help="validation batches of B_global sequences per eval")
    g.add_argument("--log-every", type=int, default=25, help="print a step line every N steps")
    g.add_argument("--sample-tokens", type=int, default=300, help="tokens sampled at the end (0: none)")
    g.add_argument("--metrics-file", help="write one JSON object per step to this file (default: none)")
    g.add_argument("--tensorboard", metavar="DIR", help="also log the step line's figures, the memory by kind and the"
                   " start-up's and the end's printouts to TensorBoard event files in DIR (default: none; needs the"
                   " tensorboard package, else the run says so and goes on)")
    g.add_argument("--peak-tflops", type=float, help="peak TFLOP/s per device for MFU (default: table or measured)")


def _add_checkpoint_flags(parser) -> None:
    g = parser.add_argument_group("checkpoints (ckpt.py)")
    g.add_argument("--ckpt-dir", help="save sharded checkpoints under this directory (one step-XXXXXXXX per save;"
                   " default: none, no checkpoints)")
    g.add_argument("--ckpt-every", type=int, default=0, help="save every N steps (0: only after the last step)")
    g.add_argument("--keep", type=int, default=2, help="keep the newest K committed checkpoints (K >= 2)")
    g.add_argument("--resume", nargs="?", const="latest",
                   help="'latest' (the newest good checkpoint, if any; the default with no value) or a step number")
    g.add_argument("--async-ckpt", action="store_true", help="persist checkpoints on a background thread")
    g.add_argument("--drop-state", action="store_true", help="let --resume leave state of the checkpoint unread that"
                   " this run's flags have no place for (a DiLoCo replica's, shared experts, a router's bias, FP8's"
                   " histories): refused otherwise, naming it")
    g.add_argument("--mtbf-hours", type=float, default=24.0,
                   help="mean time between interruptions, for the suggested interval sqrt(2·C·M)")
    elastic.add_arguments(g)  # --elastic MIN:MAX: the worlds torchrun may restart this run in


def add_plan_arguments(parser) -> None:
    """--plan, --plan-search, --world and the hardware model's flags (plan.py, planner/hardware.py)."""
    g = parser.add_argument_group("plan (plan.py): size a layout without its hardware")
    one = g.add_mutually_exclusive_group()  # argparse refuses both: "argument --plan-search: not allowed with --plan"
    one.add_argument("--plan", action="store_true", help="print every rank role's memory, messages and predicted"
                   " step time for --world ranks, built on meta in a fake process group; trains nothing")
    one.add_argument("--plan-search", action="store_true", help="rank the layouts of --world ranks that fit"
                   " --hw-memory-gib by predicted step time; print the best ten")
    g.add_argument("--world", type=int, help="ranks to plan for (--plan, --plan-search; no default: required)")
    g.add_argument("--vocab-size", type=int, help="rows of the embedding and the head the plan sizes, as given (no"
                   " padding; default: --tokenizer's padded, or a gpt3-* preset's 50304); --plan, --plan-search")
    g.add_argument("--attention-kernel", choices=("fused", "math"), help="the attention kernel the plan prices and"
                   " sizes: fused (flash-style, the s×s scores never reach HBM; default: what the trainer's"
                   " scaled_dot_product_attention takes on a GPU) or math (the softmax and its dropout read and write"
                   " the scores through HBM and save them, as Megatron's 2021-22 runs did); --plan, --plan-search")
    g.add_argument("--pp-p2p", choices=("overlapped", "blocking"), help="how the plan prices the pipeline's sends:"
                   " overlapped (default: this trainer's, posted ahead of the action that needs them and exposed only"
                   " in the fill and drain) or blocking (every send waits for its transfer on the critical path, as"
                   " DeepSpeed's 2021 pipeline engine's did); --plan, --plan-search")
    hardware.add_arguments(parser)
