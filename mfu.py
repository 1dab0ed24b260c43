"""The accounting's formulas: FLOPs, MFU/HFU, peaks, communication volume (memory is accounting/memory.py; the clocks
and counters that observe the algorithms are accounting/observers.py).

This file talks over nothing; it observes. Everything here is either a closed-form formula from a paper (so a
reader can check a number by hand) or a measurement (a matmul loop; the bytes each `torch.distributed` call
moves are counted by tracer.CommTracer, against the formulas of section 4). Nothing in it changes what the
trainer computes.

Conventions used throughout:

* FLOPs count one multiply-add as 2 FLOPs. A "FLOP" is a floating-point operation; "FLOP/s" is a rate.
* "Per token" means per token of the global batch that goes through forward + backward once.
* N is the number of parameters that take part in matmuls: every block weight plus the LM head. Embedding
  lookups and position embeddings are gathers, not matmuls, so they are excluded; with tied input/output
  embeddings the shared matrix counts once, as the head. For a mixture-of-experts model N is the ACTIVE count
  (the experts a token actually visits): memory.param_counts counts it, flops_per_token reads it.
* L = layers, H = attention heads, Q = head dimension, T = sequence length, so H*Q is the model width.
* MFU (model FLOPs utilisation) uses model FLOPs only: work the model mathematically needs. HFU (hardware FLOPs
  utilisation) also counts work the hardware really did again, e.g. the forward pass that activation
  checkpointing recomputes. Both divide by the dense (no sparsity) datasheet peak of all devices together.
* Bytes are bytes; format_bytes prints binary units (1 KiB = 1024 B). Communication volumes are bytes SENT per
  rank by the usual ring algorithms, with M the message size and N the group size (see section 4).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

# ----------------------------------------------------------------------------------------------------------
# 1. FLOPs per token
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FlopsPerToken:
    model: float  # FLOPs the model needs per token (numerator of MFU)
    hardware: float  # FLOPs the hardware executes per token, recomputation included (numerator of HFU)
    convention: str  # how these were counted, for printouts


def flops_per_token(counts: dict, config, seq_len: int, attention_kernel: str = "fused") -> FlopsPerToken:
    """Training FLOPs per token: model = 6N + 12*L*H*Q*T (PaLM, Chowdhery et al. 2022, appendix B; nanoGPT), N the
    matmul weights a token uses: counts["active_matmul"] of memory.param_counts(config) (the head, the blocks'
    linears, a mixture of experts' router, its S shared experts (S·8h² per MoE layer, experts/shared.py) and the k
    routed experts a token visits, not the N − k idle ones, nor are dropped slots subtracted: a convention,
    printed). L, H, Q: config's n_layer, n_head, head_dim.

    6N: each matmul weight is used once per token in a multiply-add (2 FLOPs) in the forward pass, and twice in
    the backward pass (gradient w.r.t. the input and w.r.t. the weight), so 2N + 4N = 6N.

    12*L*H*Q*T: attention's two matmuls that involve no weights. Per layer, per head, one token's query is
    dotted with T keys (2*T*Q FLOPs) and the T values are summed with the softmax weights (2*T*Q FLOPs): 4*H*Q*T
    forward, times 3 for forward + backward. We count the full T x T score matrix, not half of it for causal
    masking, as PaLM does (and as most kernels compute, block-sparse ones aside).

    With activation checkpointing (config.activation_checkpointing) the forward of every block runs a second
    time during backward, so the hardware does 2*N_r + 4*L*H*Q*T more FLOPs per token, N_r being the matmul
    weights whose forward is recomputed: the blocks' (counts["block_matmul"]; the head is not recomputed).
    Selective recompute (config.selective_recompute, parallel/recompute.py) keeps every GEMM's output and recomputes
    no matmul of weights: with a fused attention (`attention_kernel`, memory.attention_kernel) hardware = model
    (the LayerNorms, GELU and dropouts it reruns are outside the 6N convention); on the unfused (math) path it
    reruns the core attention, 4*L*H*Q*T more.
    """
    n_matmul_params = counts["active_matmul"]
    n_layer, n_head, head_dim = config.n_layer, config.n_head, config.head_dim
    if min(n_matmul_params, n_layer, n_head, head_dim, seq_len) < 0:
        raise ValueError("parameter and shape counts must be non-negative")
    attention_fwd = 4 * n_layer * n_head * head_dim * seq_len  # per token, forward only
    model = 6 * n_matmul_params + 3 * attention_fwd  # 3 * 4LHQT = 12LHQT
    convention = (
        f"model = 6N + 12*L*H*Q*T per token (N = {n_matmul_params:,} active matmul params, embeddings "
        f"excluded; attention counts the full TxT score matrix, not halved for causal masking)"
    )
    hardware = model
    if config.activation_checkpointing:
        n_r = counts["block_matmul"]
        hardware = model + 2 * n_r + attention_fwd
        convention += f"; hardware adds the recomputed forward 2*N_r + 4*L*H*Q*T (N_r = {n_r:,})"
    elif config.selective_recompute and attention_kernel == "math":
        hardware = model + attention_fwd
        convention += "; hardware adds the core attention selective recompute reruns, 4*L*H*Q*T"
    elif config.selective_recompute:
        convention += "; hardware = model (selective recompute reruns no matmul: elementwise ops only)"
    else:
        convention += "; hardware = model (no recomputation)"
    return FlopsPerToken(model=float(model), hardware=float(hardware), convention=convention)


# ----------------------------------------------------------------------------------------------------------
# 2. MFU / HFU
# ----------------------------------------------------------------------------------------------------------


def mfu(flops_per_token: float, tokens_per_second: float, peak_flops_per_device: float, n_devices: int) -> float:
    """Utilisation = achieved FLOP/s / (n_devices * peak FLOP/s per device).

    tokens_per_second is the throughput of the whole job (all devices). Pass FlopsPerToken.model to get MFU,
    FlopsPerToken.hardware to get HFU.
    """
    if peak_flops_per_device <= 0 or n_devices < 1:
        raise ValueError("peak_flops_per_device must be > 0 and n_devices >= 1")
    return flops_per_token * tokens_per_second / (peak_flops_per_device * n_devices)


# A recipe that runs some GEMMs in narrow formats (--fp8, microscaling) divides by the format-weighted peak instead:
# accounting/format_flops.py (the FLOPs by format, each at its own peak).

# ----------------------------------------------------------------------------------------------------------
# 3. Peak FLOP/s
# ----------------------------------------------------------------------------------------------------------

# Dense (no 2:4 sparsity) peaks in TFLOP/s per GPU, one row per product variant. Columns: fp32 = FP32 on the CUDA
# cores (no tensor cores); tf32 = fp32 matmuls on the TF32 tensor cores; bf16/fp16, fp8 and fp4 = tensor cores. The
# datasheets print tensor-core figures with sparsity ("*"); the dense figure is half of it. Sources, NVIDIA's:
#   A100 datasheet (SXM4 and PCIe, 40 and 80 GB alike): 19.5 FP32, 156 TF32, 312 BF16/FP16 dense; no FP8.
#   A10 datasheet: 31.2 FP32, 62.5 TF32, 125 BF16/FP16 dense (125* / 250* sparse); no FP8.
#   L4 datasheet: 30.3 FP32, 120* TF32, 242* BF16/FP16, 485* FP8.
#   L40 datasheet: 90.5 FP32, 90.5 TF32, 181.05 BF16/FP16, 362 FP8 dense (181* / 362.1* / 724* sparse).
#   L40S datasheet: 91.6 FP32, 366* TF32, 733* BF16/FP16, 1,466* FP8 (its dense column's 362.05 BF16 is not half
#     of 733*; the L40's figure copied, it seems: we halve 733*).
#   H100 architecture whitepaper, SXM5: 66.9 FP32, 494.7 TF32, 989.4 BF16/FP16, 1978.9 FP8 dense (the datasheet
#     rounds: 67, 989*, 1,979*, 3,958*). H200 SXM, GH200 and H800 SXM datasheets print the same figures (the
#     same GH100 configuration and clocks; H800 differs in FP64 and NVLink only).
#   H100 datasheet, PCIe (H800 PCIe datasheet alike): 51 FP32, 756* TF32, 1,513* BF16/FP16, 3,026* FP8.
#   H100 and H200 datasheets, NVL columns: 60 FP32, 835* TF32, 1,671* BF16/FP16, 3,341* FP8.
#   H20 (NVIDIA's spec sheet as published by its partners; there is no public datasheet): 44 FP32, 74 TF32,
#     148 BF16/FP16, 296 FP8 dense.
#   HGX B200 datasheet (8 GPUs, per GPU): 75 FP32, 2.25* PF TF32 (18* PF for 8), 4.5* PF BF16/FP16, 9* PF FP8/FP6,
#     18* PF FP4 (144* PF for 8).
#   GB200 NVL72 datasheet (per GPU): 80 FP32, 2.5* PF TF32, 5* PF BF16/FP16, 10* PF FP8, 20* PF FP4 (1,440* for 72).
# The microscaling formats (precision/microscaling.py) have a peak only where the tensor cores take block scales:
# Blackwell's (the rows with an FP4 column) run MXFP8 at the FP8 rate and MXFP4 and NVFP4 at the FP4 rate. Hopper, Ada
# and Ampere have no block-scaled GEMM (Hopper's and Ada's FP8 is per-tensor scaled) and no FP4 at all: no figure.
# A row is chosen by gpu_row: the model word of the device name, whether it says NVL, and the SM count where a
# row gives one (H100 SXM5 has 132, H100 PCIe 114: the same name word). The bare names are the SXM parts.
#             row          word     SMs   NVL     fp32   tf32    bf16/fp16  fp8      fp4
_GPU_ROWS = [("A100",      "A100",  108,  False,  19.5,  156.0,  312.0,     None,     None),
             ("A10",       "A10",   72,   False,  31.2,  62.5,   125.0,     None,     None),
             ("L4",        "L4",    None, False,  30.3,  60.0,   121.0,     242.5,    None),
             ("L40",       "L40",   None, False,  90.5,  90.5,   181.05,    362.0,    None),
             ("L40S",      "L40S",  None, False,  91.6,  183.0,  366.5,     733.0,    None),
             ("H100",      "H100",  132,  False,  66.9,  494.7,  989.4,     1978.9,   None),
             ("H100 PCIe", "H100",  114,  False,  51.0,  378.0,  756.5,     1513.0,   None),
             ("H100 NVL",  "H100",  None, True,   60.0,  417.5,  835.5,     1670.5,   None),
             ("H200",      "H200",  132,  False,  66.9,  494.7,  989.4,     1978.9,   None),
             ("H200 NVL",  "H200",  None, True,   60.0,  417.5,  835.5,     1670.5,   None),
             ("GH200",     "GH200", 132,  False,  66.9,  494.7,  989.4,     1978.9,   None),
             ("H800",      "H800",  132,  False,  66.9,  494.7,  989.4,     1978.9,   None),
             ("H800 PCIe", "H800",  114,  False,  51.0,  378.0,  756.5,     1513.0,   None),
             ("H20",       "H20",   None, False,  44.0,  74.0,   148.0,     296.0,    None),
             ("B200",      "B200",  None, False,  75.0,  1125.0, 2250.0,    4500.0,   9000.0),
             ("GB200",     "GB200", None, False,  80.0,  1250.0, 2500.0,    5000.0,   10000.0)]
PEAK_TFLOPS: dict[str, dict[str, float | None]] = {
    row: {"fp32": fp32, "tf32": tf32, "bf16": half, "fp16": half, "fp8": fp8,
          "mxfp8": fp4 and fp8, "mxfp4": fp4, "nvfp4": fp4}  # block-scaled formats: Blackwell only (see above)
    for row, _, _, _, fp32, tf32, half, fp8, fp4 in _GPU_ROWS}
GPU_RULES: dict[str, tuple[str, int | None, bool]] = {row: (word, sms, nvl) for row, word, sms, nvl, *_ in _GPU_ROWS}

# Accept torch-style spellings too, so `detect_peak_flops(dev, "bfloat16", None)` works.
_DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}
_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def gpu_row(name: str, sm_count: int) -> str | None:
    """The PEAK_TFLOPS row of a GPU called `name` (torch.cuda.get_device_name) with `sm_count` SMs, or None.

    The name is cut into words at spaces and hyphens ("NVIDIA A100-SXM4-80GB": NVIDIA, A100, SXM4, 80GB). A row
    matches when its model word is one of them (so "GB200" is not "B200", "GH200" not "H200", "H20" not "H200",
    "A10G" not "A10"), when "NVL" is a word exactly if the row is an NVL part, and when the SM count is the row's
    where the row gives one. A MIG slice has fewer SMs, so it matches no row that checks them.
    """
    words = set(name.upper().replace("-", " ").replace("_", " ").split())
    matches = [row for row, (word, sms, nvl) in GPU_RULES.items()
               if word in words and nvl == ("NVL" in words) and sms in (None, sm_count)]
    if len(matches) > 1:  # the rules are exclusive by construction; a new row must keep them so
        raise AssertionError(f"{name!r} with {sm_count} SMs matches several PEAK_TFLOPS rows: {matches}")
    return matches[0] if matches else None


def fp32_matmul_column() -> tuple[str, str]:
    """The column an fp32 run is measured against: TF32 when torch lets fp32 matmuls use TF32 tensor cores."""
    if torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest":
        return "tf32", ("dense TF32 tensor-core peak (fp32 matmuls may run as TF32:"
                        f" torch.backends.cuda.matmul.allow_tf32 = {torch.backends.cuda.matmul.allow_tf32},"
                        f" float32_matmul_precision = {torch.get_float32_matmul_precision()!r})")
    return "fp32", "FP32 peak, no tensor cores (TF32 matmuls off: float32_matmul_precision 'highest')"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # CUDA kernels are asynchronous: wait for them before reading the clock
        torch.cuda.synchronize(device)


def measure_matmul_peak(
    dtype: torch.dtype = torch.bfloat16, n: int = 1024, seconds: float = 0.3, device: str | torch.device = "cpu",
    repeats: int = 1,
) -> float:
    """Measure achievable matmul FLOP/s: a batch of n x n matmuls that lasts about `seconds`, after a warm-up;
    with `repeats` > 1 the batch runs that many times and the fastest counts (the least disturbed by other
    work on a shared machine: a peak is the best the hardware does, not an average).

    Each n x n @ n x n matmul is n^3 multiply-adds = 2n^3 FLOPs. The batch is timed between two synchronisations
    only: a sync after every matmul would leave a GPU idle while the next one is launched. Its size comes from a
    first short run, doubled until it lasts a tenth of `seconds`. This is a practical ceiling for this machine,
    not a datasheet number, so an MFU computed against it reads higher than one against a datasheet peak.
    The second operand is a transposed view, X·Wᵀ, the layout of nn.Linear: on a CPU without bf16 units the
    kernels differ by layout (measured on an EPYC without AVX512-BF16: bf16 mm 0.7, X·Wᵀ 5.5 GFLOP/s at 1024²),
    and the peak must be the one the model's matmuls can reach.
    """
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(0)  # not the global one: training's dropout draws it
    a = torch.randn(n, n, dtype=dtype, device=device, generator=generator)
    b = torch.randn(n, n, dtype=dtype, device=device, generator=generator).t()  # Wᵀ: a weight [out, in], as nn.Linear
    out = torch.empty(n, n, dtype=dtype, device=device)

    def timed(count: int) -> float:  # seconds for `count` back-to-back matmuls
        _sync(device)
        start = time.perf_counter()
        for _ in range(count):
            torch.mm(a, b, out=out)
        _sync(device)
        return time.perf_counter() - start

    timed(1)  # warm-up: first call pays for kernel selection, thread-pool start-up and allocation
    count, elapsed = 1, timed(1)
    while elapsed < seconds / 10:  # calibration
        count *= 2
        elapsed = timed(count)
    if elapsed < seconds:
        count = round(count * seconds / elapsed)
        elapsed = timed(count)
    for _ in range(repeats - 1):
        elapsed = min(elapsed, timed(count))
    return 2 * n**3 * count / elapsed


def _measured_peak(device: torch.device, dtype: str) -> tuple[float, str]:
    """The matmul loop's FLOP/s on `device` as the peak for `dtype`, and how it was taken."""
    # CPU: sized to the machine, the best of 3 short batches per size. The size grows (256 → 2048: AMX and AVX-512
    # kernels peak at large sizes) while one matmul still fits in half a batch, so a loaded machine does
    # not spend minutes here; the best of several batches, since one long batch on a shared machine measured
    # the other jobs as much as the cores (it varied 3× from run to run).
    sizes, seconds, repeats = ((8192,), 0.5, 1) if device.type == "cuda" else ((256, 512, 1024, 2048), 0.1, 3)
    note = ""
    if dtype == "fp16" and device.type == "cpu":
        # CPUs have no fast fp16 matmul (a 1024² fp16 matmul takes seconds here, small ones take other paths),
        # so the measured fp16 "peak" is meaningless: fp16 runs are measured against the bf16 peak instead.
        measured, note = "bf16", " (fp16 is compared with the bf16 peak: CPUs have no fast fp16 matmul)"
    elif dtype not in _TORCH_DTYPES:  # fp8 needs scaled matmuls; its non-FP8 work runs in bf16
        measured, note = "bf16", f" ({dtype} is compared with the bf16 peak: no plain {dtype} matmul to time)"
    else:
        measured = dtype
    if measured == "fp32" and device.type == "cuda":
        note = f" (TF32 {'on' if fp32_matmul_column()[0] == 'tf32' else 'off'})"
    best = (0.0, sizes[0])
    began = (time.process_time(), time.perf_counter())  # this process's CPU time against the wall's: was it alone?
    for n in sizes:  # every size whose matmul fits in half a batch, each the best of `repeats` batches
        if best[0] and 2 * n**3 / best[0] > seconds / 2:
            break
        best = max(best, (measure_matmul_peak(_TORCH_DTYPES[measured], n=n, seconds=seconds, device=device,
                                              repeats=repeats), n))
    how = f", best of {repeats} × {seconds}s" if repeats > 1 else f" for {seconds}s"
    loaded = "" if device.type == "cuda" else load_note(time.process_time() - began[0],
                                                          time.perf_counter() - began[1], torch.get_num_threads())
    return best[0], (f"{best[1]}x{best[1]} {measured} matmul loop on {device.type}{how}"
                     + (f" (the fastest of the sizes {'/'.join(map(str, sizes))} that fit)" if len(sizes) > 1 else "")
                     + f", not a datasheet peak{note}{loaded}")


UNDER_LOAD = "measured under load"  # in a peak's source (run.peak[1]): MFU against it cannot be trusted
LOADED_SHARE = 0.8  # below this share of the CPU time its threads asked for, a measuring process was not alone


def load_note(cpu_seconds: float, wall_seconds: float, threads: int) -> str:
    """"" when a CPU peak's measurement ran alone: the process's CPU time was at least LOADED_SHARE of wall
    time × its threads; else the words saying it was not, and what follows (the peak reads low, an MFU high)."""
    share = cpu_seconds / max(wall_seconds * threads, 1e-9)
    if share >= LOADED_SHARE:
        return ""
    return (f"; {UNDER_LOAD}: this process ran {share:.0%} of the time its {threads} thread{'s' * (threads > 1)}"
            f" asked for (other processes on these cores, or more ranks than cores), so the peak reads low and an"
            f" MFU against it high: it cannot be trusted (--peak-tflops sets a peak)")


def shared_peak(device, flops: float, source: str) -> tuple[float, str]:
    """One peak for every rank: the mean of what each measured (they measured at once, each on its share of
    a shared machine); a datasheet or --peak-tflops figure is the same everywhere already."""
    if not source.startswith("measured") or dist.get_world_size() == 1:
        return flops, source
    total = torch.tensor([flops, peak_under_load(source)], dtype=torch.float64, device=device)
    dist.all_reduce(total)  # the peaks' sum, and how many ranks measured theirs under load
    loaded = int(total[1])
    return float(total[0]) / dist.get_world_size(), f"{source}; mean over the {dist.get_world_size()} ranks" + (
        f", {loaded} of them {UNDER_LOAD}" if loaded and not peak_under_load(source) else "")


def peak_under_load(source: str) -> bool:
    """Whether a peak's source (detect_peak_flops' second value) says its measurement shared the cores."""
    return UNDER_LOAD in source


def _warn(message: str) -> None:
    """One line on stderr, from rank 0 only (every rank finds the same)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"warning: {message}", file=sys.stderr, flush=True)


def detect_peak_flops(device: torch.device, dtype: str, override_tflops: float | None) -> tuple[float, str]:
    """Return (peak FLOP/s per device, where that number came from).

    Order: an explicit override wins; on CUDA the GPU's PEAK_TFLOPS row (gpu_row) in the dtype's column, where
    fp32 takes the TF32 column when TF32 matmuls are allowed (fp32_matmul_column); on a GPU without a row or
    without that column (fp8 on an A100) a one-line warning, then a measured peak; on CPU there is no datasheet
    we can trust, so a short matmul loop measures one (in the same dtype: fp32 measures fp32).
    """
    if override_tflops is not None:
        if override_tflops <= 0:
            raise ValueError(f"--peak-tflops must be positive, got {override_tflops}")
        return override_tflops * 1e12, f"override: {override_tflops:g} TFLOP/s (--peak-tflops)"

    device = torch.device(device)
    dtype = _DTYPE_ALIASES.get(dtype, dtype)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        row = gpu_row(name, sms)
        column, what = fp32_matmul_column() if dtype == "fp32" else (dtype, f"dense {dtype} tensor-core peak")
        tflops = PEAK_TFLOPS[row].get(column) if row else None
        if tflops:
            return tflops * 1e12, f"table: row {row} ({name}, {sms} SMs), {what}: {tflops:g} TFLOP/s"
        missing = (f"PEAK_TFLOPS row {row} ({name}) has no {column} peak" if row
                   else f"{name!r} with {sms} SMs matches no PEAK_TFLOPS row")
        _warn(f"{missing}; MFU is against a measured matmul peak instead (--peak-tflops sets one)")
        flops, how = _measured_peak(device, dtype)
        return flops, f"measured, as {missing}: {how}"
    if device.type == "cpu":
        flops, how = _measured_peak(device, dtype)
        return flops, f"measured: {how}"
    raise ValueError(f"no peak FLOP/s known for device type {device.type!r}; pass --peak-tflops")


# ----------------------------------------------------------------------------------------------------------
# 4. Communication volume (bytes sent per rank, ring algorithms; M = message bytes, N = group size)
# ----------------------------------------------------------------------------------------------------------


def all_reduce_bytes(m: float, n: int) -> float:
    """2(N-1)/N * M: a ring all-reduce is a reduce-scatter followed by an all-gather."""
    return 2 * (n - 1) / n * m


def all_gather_bytes(m: float, n: int) -> float:
    """(N-1)/N * M, M the OUTPUT (gathered, full) size: each rank forwards the N-1 chunks it does not own."""
    return (n - 1) / n * m


def reduce_scatter_bytes(m: float, n: int) -> float:
    """(N-1)/N * M, M the INPUT (full) size: each rank sends N-1 partial sums of M/N."""
    return (n - 1) / n * m


def all_to_all_bytes(m: float, n: int) -> float:
    """(N-1)/N * M, M the input size: every rank keeps its own 1/N and sends the rest (even splits assumed)."""
    return (n - 1) / n * m


def broadcast_bytes(m: float, n: int) -> float:
    """M: the root sends the whole message once; in a pipelined chain each non-last rank forwards M too, so M
    is also the bytes that cross each link."""
    return m


def p2p_bytes(m: float, n: int = 2) -> float:
    """M: a send puts the whole message on the wire; the receiving side sends nothing."""
    return m


def gather_bytes(m: float, n: int) -> float:
    """M, M one rank's piece: each rank sends its piece to the root once (the root's own piece does not move:
    this is the other ranks' figure)."""
    return m


def scatter_bytes(m: float, n: int) -> float:
    """(N-1) * M, M one rank's piece: the root sends every piece but its own (the root's figure; the other
    ranks send nothing)."""
    return (n - 1) * m


def reduce_bytes(m: float, n: int) -> float:
    """(N-1)/N * M + M/N = M: a ring reduce-scatter, then each rank's reduced chunk to the root."""
    return m


def _nothing_sent(m: float, n: int) -> float:
    return 0.0


# Maps an op name (torch.distributed's function names, plus the generic names above) to its formula.
_WIRE_FORMULAS = {
    "all_reduce": all_reduce_bytes,
    "all_gather": all_gather_bytes,
    "all_gather_into_tensor": all_gather_bytes,
    "all_gather_single": all_gather_bytes,
    "reduce_scatter": reduce_scatter_bytes,
    "reduce_scatter_tensor": reduce_scatter_bytes,
    "reduce_scatter_single": reduce_scatter_bytes,
    "all_to_all": all_to_all_bytes,
    "all_to_all_single": all_to_all_bytes,
    "broadcast": broadcast_bytes,
    "gather": gather_bytes,
    "scatter": scatter_bytes,
    "reduce": reduce_bytes,
    "send": p2p_bytes,
    "isend": p2p_bytes,
    "recv": _nothing_sent,  # we count bytes SENT; the matching send already counted this message
    "irecv": _nothing_sent,
    "barrier": _nothing_sent,
    # Object collectives pickle into byte tensors and move them with the tensor collectives above; the tracer
    # adds those inner calls' bytes to the object collective's record (CommTracer), so nothing of their own.
    "all_gather_object": _nothing_sent,
    "broadcast_object_list": _nothing_sent,
    "gather_object": _nothing_sent,
    "scatter_object_list": _nothing_sent,
}


def wire_bytes(op: str, payload_bytes: int, group_size: int) -> float:
    """Bytes one rank sends for collective `op` with message size `payload_bytes` in a group of `group_size`."""
    if op not in _WIRE_FORMULAS:
        raise ValueError(f"unknown communication op {op!r}; known: {sorted(_WIRE_FORMULAS)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    return _WIRE_FORMULAS[op](payload_bytes, group_size)


# ----------------------------------------------------------------------------------------------------------
# 5. Checkpoint interval
# ----------------------------------------------------------------------------------------------------------


def young_checkpoint_interval(checkpoint_seconds: float, mtbf_seconds: float) -> float:
    """Seconds between checkpoints that minimise lost work: sqrt(2 * C * M) (Young 1974), C = time to write a
    checkpoint, M = mean time between failures of the whole job."""
    return math.sqrt(2 * checkpoint_seconds * mtbf_seconds)


# ----------------------------------------------------------------------------------------------------------
# 6. Formatting
# ----------------------------------------------------------------------------------------------------------


def format_bytes(n: float) -> str:
    """Binary units with 2 decimals: 1536 -> '1.50 KiB'."""
    if abs(n) < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.2f} {unit}"
    raise AssertionError("unreachable")


def format_dtype(dtype: torch.dtype) -> str:
    """The short name a reader types in the flags: torch.bfloat16 -> 'bf16'."""
    return {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
            torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}.get(dtype, str(dtype).removeprefix("torch."))


def format_flops(n: float) -> str:
    """Decimal units with 2 decimals: 3.12e14 -> '312.00 TFLOP' (append '/s' yourself for a rate)."""
    for unit, scale in (("EFLOP", 1e18), ("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} FLOP"
