"""What a measured CPU's time model needs that one big matmul does not say: measured at start-up (0.6 s on 2 ranks
of the tiny preset, 3 s of the small one in bf16: machine_model, timed on the 2-core test machine).

The time model (planner/time_model.py) prices a step as FLOPs / (peak · e) + memory-bound bytes / bandwidth + α-β
collectives + the update. On a CPU the peak is a 2048² matmul loop (mfu.py); a run's own block reaches far less
of it: its GEMMs are thin (a tiny block's are 512 × 64 × 192), and every op pays a fixed cost (Python, the
dispatcher, autograd's engine: tens of µs each, a block's forward and backward run ~100 of them) and the
elementwise ops with transcendentals (GELU's erf and its backward) are compute-, not memory-bound here. So the
CPU's rates are measured on the run's own shapes, not assumed, each as the fraction of the peak that prices the
measured pass at exactly its time (F its hardware FLOPs: calibration.gemms' classes, per layer for a block,
divided by T for this rank's shard of every width; bytes its memory-bound bytes):

    e      = F_block / (peak · (t_block − bytes_block / HBM))      (gemm_fraction; d½ = 0: one shape, measured)
    e_ends = F_head / (peak · t_ends)                               (ends_fraction: the head class's rate)

t_block the median of five timed forward+backward passes of one fresh block shaped as this rank's (its B_μ·s/C
tokens, its T-sharded widths: QKV h → 3h/T, proj h/T → h, fc1 h → 4h/T, fc2 4h/T → h, in the run's autocast
dtype); t_ends the same of the model's ends (token and position embeddings, final LayerNorm, the head's V/T
columns and the loss on them), whose embedding lookups, LayerNorm and softmax over the vocabulary cost per op
and per byte what their one GEMM's FLOPs do not say: the model prices the head class at e_ends, every block and
recompute at e. The update (optim.update's local work: the norms, the clip, AdamW's step, zeroing the
gradients) runs ~10 ops per tensor it steps, a cost per op that 2 · persistent bytes / HBM misses on a small
model: update_seconds times it on fresh tensors shaped as this rank's master tensors (update_tensors). The ranks
measure at once on a shared machine: each figure is the world's mean (one figure for the world, as
train.shared_peak's peak).

The link: hardware.measure_cpu times a world all-reduce 100 times at 4 KiB and 9 times at 4 MiB; hardware.link_fit
fits α (the per-step latency, the calls' scheduler tail included: from the small calls' mean) and β (the wire's
bytes per second: from the slope between the two medians), t(M) = 2(N−1)·α + wire(M)/β, each call after 1 ms of
compute, as a step's calls come. The overlap φ is from the means of ten interleaved samples of each of its three
times (a block, a transfer, both). Both are the world's averages, so every rank prices the step alike.

Accounting for this file: it holds nothing after start-up; while it measures, the probe's block and ends (fresh
weights, one micro-batch's activations) and update_seconds' four tensors per master tensor (weights, gradients,
two moments: 4 × the master bytes, at most PROBE_ELEMENTS elements each; CPU memory, freed on return).
calibration_of all-reduces four float64 over the world (collective).
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist
from torch import nn

from accounting import activations, memory
import model as model_lib
from planner import calibration, hardware, time_model
from planner.calibration import Calibration


def gemm_fraction(block_flops: float, seconds: float, memory_bytes: float, hbm_bytes_per_s: float,
                  peak: float) -> float:
    """e = F / (peak · (t − bytes/HBM)): the fraction of the peak that prices the measured block at its time
    (the memory-bound bytes' share taken out first; at least a tenth of t left to the GEMMs, so noise that
    makes t smaller than the bytes' time cannot give a negative or infinite rate)."""
    gemm_seconds = max(seconds - memory_bytes / hbm_bytes_per_s, 0.1 * seconds)
    return block_flops / (peak * gemm_seconds)


def overlap_fraction(compute: float, transfer: float, both: float) -> float:
    """φ = (t_c + t_m − t_both) / min(t_c, t_m), in [0, 1]: the share of the shorter of a compute pass and a
    transfer that hides when the transfer runs asynchronously beside it (1: fully; 0: they take turns, as two
    gloo ranks on two cores, whose communication threads compete with the compute for the same cores)."""
    return min(1.0, max(0.0, (compute + transfer - both) / max(min(compute, transfer), 1e-12)))


def shaped_block(config, t: int) -> nn.Module:
    """A fresh block of the run's config with the widths of a T-way tensor-parallel shard (its heads and MLP
    columns split T ways): the ops and GEMM shapes one rank runs per layer, without TP's collectives."""
    block = model_lib.Block(config)
    if t > 1:
        h, bias = config.n_embd, config.bias
        block.attn.c_attn = nn.Linear(h, 3 * h // t, bias=bias)
        block.attn.c_proj = nn.Linear(h // t, h, bias=bias)
        if isinstance(block.mlp, model_lib.MLP):
            block.mlp.c_fc = nn.Linear(h, 4 * h // t, bias=bias)
            block.mlp.c_proj = nn.Linear(4 * h // t, h, bias=bias)
    return block


def block_pass(block: nn.Module, x: torch.Tensor, autocast) -> float:
    """One forward+backward pass of `block` on x: its seconds."""
    start = time.perf_counter()
    with autocast:
        y = block(x)
    y.float().sum().backward()
    return time.perf_counter() - start


def block_seconds(block: nn.Module, x: torch.Tensor, autocast, repeats: int = 5) -> float:
    """The median of `repeats` timed forward+backward passes of `block` on x, after one untimed (allocations): a
    typical pass (the best of them would price a step that never preempts, the mean weighs a start-up's cold or
    preempted pass that the run's later steps do not have)."""
    block_pass(block, x, autocast)
    return hardware.median([block_pass(block, x, autocast) for _ in range(repeats)])


def measured_overlap(block: nn.Module, x: torch.Tensor, autocast, nbytes: int = 1 << 20, repeats: int = 10) -> float:
    """overlap_fraction of this rank's block pass and a world all-reduce of nbytes started asynchronously
    before it: the three times (block alone, transfer alone, both) interleaved `repeats` times and each the
    mean of its samples, as a step's time is a sum. A difference of three noisy times is noisy: on the 2-core
    test VM, four rounds of 15 samples gave φ 0.01-0.61 from medians (the 1 MiB transfer's median read 1.1 to 4.0
    ms) and 0.21-0.39 from means; five samples' medians gave −0.37 (clamped to 0) to 1.
    Collective: every rank calls it."""
    buffer = torch.zeros(nbytes // 4, dtype=torch.float32, device=x.device)
    compute, transfer, both = [], [], []
    for _ in range(repeats):
        compute.append(block_pass(block, x, autocast))
        start = time.perf_counter()
        dist.all_reduce(buffer)
        transfer.append(time.perf_counter() - start)
        start = time.perf_counter()
        work = dist.all_reduce(buffer, async_op=True)
        block_pass(block, x, autocast)
        work.wait()
        both.append(time.perf_counter() - start)
    return overlap_fraction(*(sum(samples) / repeats for samples in (compute, transfer, both)))


class ShapedEnds(nn.Module):
    """The model's ends as one rank runs them, fresh: token and position embeddings (the token table's V/T rows),
    the final LayerNorm, the head's V/T columns and the summed cross-entropy on them (the next token as target;
    TP's vocabulary-parallel loss adds collectives, which the messages price). forward(idx) → the loss."""

    def __init__(self, config, t: int):
        super().__init__()
        self.vocab = config.vocab_size // t
        self.wte, self.wpe = nn.Embedding(self.vocab, config.n_embd), nn.Embedding(config.block_size, config.n_embd)
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, self.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        logits = self.lm_head(self.ln_f(x))
        targets = idx.roll(-1, dims=1)
        return nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")


def probe_flops(config, tokens: int, seq: int, t: int) -> tuple[float, float]:
    """(F_block, F_ends): the hardware FLOPs of one forward+backward of this rank's block and of its ends on
    `tokens` tokens of sequences of `seq`: calibration.gemms' classes (FLOPs per token of the whole model's
    full widths) per layer for the block (its four linears and attention), the head class for the ends, each
    divided by T: the rank's shard of every width."""
    classes = calibration.gemms(config, memory.param_counts(config), tokens, seq, t, False, False)
    block = sum(flops for flops, _ in classes[:5]) / config.n_layer
    return block * tokens / t, classes[5][0] * tokens / t


PROBE_ELEMENTS = 1 << 24  # update_seconds times at most this many elements per tensor kind (64 MiB in fp32)


def update_tensors(layout) -> list:
    """The tensors this rank's update steps: ZeRO's master shards (one flat tensor per unit), else the optimizer's
    parameters (DDP's; a wrapping layout's, DiLoCo's, are its inner layout's)."""
    inner = getattr(layout, "inner", layout)
    units = getattr(inner, "units", None)
    if units is not None:
        return [unit.master for unit in units]
    return [p for group in inner.optimizer.param_groups for p in group["params"]]


def update_seconds(tensors: list, repeats: int = 5) -> float:
    """optim.update's local work on fresh tensors shaped as `tensors` (their dtypes, their device): the norms of
    the gradients, the clip's multiply, torch's foreach AdamW step (ZeRO's own AdamW runs the same ~8 ops per
    flat shard) and zeroing the gradients: the median of `repeats` timed after one untimed (AdamW's state). Past
    PROBE_ELEMENTS elements the rest is left out and the time scaled by total / timed elements (the update's
    per-op cost is in the timed part, its bytes scale)."""
    shapes, budget = [], PROBE_ELEMENTS
    for tensor in tensors:
        if budget <= 0:
            break
        shapes.append((min(tensor.numel(), budget), tensor.dtype, tensor.device))
        budget -= shapes[-1][0]
    if not shapes:
        return 0.0
    params = [torch.zeros(n, dtype=dtype, device=device, requires_grad=True) for n, dtype, device in shapes]
    for p in params:
        p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    optimizer = torch.optim.AdamW(params, lr=1e-4, foreach=True)

    def once() -> float:
        torch._foreach_add_(grads, 1e-3)  # this pass's gradients (the last one zeroed them): not the update's work
        start = time.perf_counter()
        norms = torch.stack(torch._foreach_norm(grads)).double()
        norms.pow(2).sum().item()  # the update's host synchronisation
        torch._foreach_mul_(grads, 1.0)  # the clip
        optimizer.step()
        torch._foreach_zero_(grads)
        return time.perf_counter() - start

    once()
    typical = hardware.median([once() for _ in range(repeats)])
    timed = sum(n for n, _, _ in shapes)
    return typical * sum(t.numel() for t in tensors) / timed


def calibration_of(run, peak: float, hbm_bytes_per_s: float) -> tuple[Calibration, float]:
    """The measured CPU's calibration: e of this rank's block and e_ends of its ends, the update's seconds (the
    module docstring), links at their measured β (fraction 1), memory-bound ops at the stated bandwidth
    (fraction 1). Collective: every rank calls it."""
    settings, config = run.settings, run.config
    x_shape = activations.activation_shape(run)
    t = run.mesh.shape.tp
    torch.manual_seed(0)  # the probe's weights: not the run's generator's business, but reproducible
    block, ends = shaped_block(config, t).to(run.device), ShapedEnds(config, t).to(run.device)
    x = torch.randn(x_shape.b, x_shape.s, config.n_embd, device=run.device, requires_grad=True)
    idx = torch.randint(ends.vocab, (x_shape.b, x_shape.s), device=run.device)
    seconds = torch.tensor([block_seconds(block, x, run.autocast), block_seconds(ends, idx, run.autocast),
                            update_seconds(update_tensors(run.layout)), 1.0], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        seconds[3] = measured_overlap(block, x, run.autocast)
        dist.all_reduce(seconds)
        seconds /= dist.get_world_size()
    t_block, t_ends, t_update, overlap = (float(v) for v in seconds)
    tokens = x_shape.b * x_shape.s
    block_flops, ends_flops = probe_flops(config, tokens, x_shape.s, t)
    nbytes = tokens * calibration.memory_bytes_per_token_layer(
        config, x_shape.s, t, settings.sequence_parallel, x_shape.kernel, x_shape.dropout, x_shape.e_c, False)
    e = gemm_fraction(block_flops, t_block, nbytes, hbm_bytes_per_s, peak)
    e_ends = gemm_fraction(ends_flops, t_ends, 0.0, hbm_bytes_per_s, peak)
    return Calibration(gemm_fraction=e, gemm_half_dim=0.0, hbm_fraction=1.0, link_fraction=1.0,
                       ends_fraction=e_ends, update_seconds=t_update), overlap


def forward_pass_seconds(run, batches: list, passes: int = 3) -> float:
    """This rank's time in one forward-only pass of the run's own layout over `batches` (the schedule's
    forward_only: evaluation's path, in eval mode without grad, so nothing the step keeps changes) less the seconds
    the tracer saw inside collectives meanwhile (their waits are the link's, priced apart): the median of `passes`
    after one untimed. Collective: every rank calls it."""
    run.model.eval()
    samples = []
    with torch.no_grad():
        for _ in range(passes + 1):
            in_calls = run.tracer.total(phase=None).seconds
            start = time.perf_counter()
            run.schedule.forward_only(run.layout, run.model, batches, run.autocast, run.device)
            samples.append(time.perf_counter() - start - (run.tracer.total(phase=None).seconds - in_calls))
    run.model.train()
    return hardware.median(samples[1:])


def machine_model(run, args, batches: list | None = None) -> hardware.Hardware:
    """This machine as the time model sees it: on CPU measured (the matmul peak train.py measured, a timed gloo
    all-reduce at two sizes, this rank's block, its ends and its update; with `batches`, this rank's micro-batches
    of one step, the layout factor ρ = the run's own forward-only pass over what the model prices it at: the
    wrappers', hooks' and copies' per-op costs that a bare block does not run, e.g. TP's vocabulary-parallel loss,
    ZeRO-3's unit views, the ring's merges; the world's mean; collective, every rank calls it); on a GPU the
    preset's datasheet row (--hw, --hw-*)."""
    if run.device.type != "cpu":
        return hardware.from_flags(args, run.settings.dtype)
    hw = hardware.measure_cpu(run.peak[0], run.settings.dtype, run.device)
    calibration, overlap = calibration_of(run, hw.peak(run.settings.dtype), hw.hbm_gbps * 1e9)
    hw = dataclasses.replace(hw, calibration=calibration, overlap=overlap)
    if batches is None:
        return hw
    facts = dict(time_model.layout_facts(run.settings, x=activations.activation_shape(run)), dtype=run.settings.dtype)
    priced = time_model.forward_compute(time_model.role_of(run), facts, hw, run.config.activation_checkpointing)
    factor = torch.tensor([forward_pass_seconds(run, batches) / priced], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(factor)
        factor /= dist.get_world_size()
    return dataclasses.replace(hw, calibration=dataclasses.replace(calibration, layout_factor=float(factor)))
