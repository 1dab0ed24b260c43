"""The FP8 and microscaling recipes' printouts: the lines their handles add at start-up, with each logged step,
and at the end (report/axes.py registers them as AXIS_LINES["fp8"] and AXIS_LINES["precision"]).

--fp8 (fp8.py): which linears and GEMMs, the memory FP8 saves, the FP8 share of the FLOPs and the format-weighted
peak, the amax reductions; per logged step the scales in use and the share of saturated values; at the end the
routed experts' padded rows (accounting/fp8_experts.py). --precision-recipe (precision/recipe.py): which blocks run in
which block-scaled format, the bits per element with their scales, the saved inputs and ZeRO-3's gathered weights, the
FLOPs by format and the format-weighted peak (accounting/format_flops.py), NVFP4's amax reductions; per logged step the
saturated share by role. Nothing here changes what the trainer computes.
"""

from __future__ import annotations

import torch

from accounting import format_flops, fp8_experts, recipe_experts
import fp8
import mfu
from moe import experts_of
from planner import hardware
from precision import fp8_scaling
import precision.recipe
from precision.fp8_replicas import scaling_state_bytes


# ---------------------------------------------------------------------------------------------------------
# --- fp8 ---
# ---------------------------------------------------------------------------------------------------------

def _fp8_startup(handle, run, steps: int) -> list:
    """The recipe, which linears and GEMMs, the memory FP8 saves, the FP8 share of the FLOPs (the format-weighted
    peak MFU should use on GPUs) and the amax reductions per step (fp8.py's docstring, items 2 and 3)."""
    facts = handle.facts()
    r, linears, weights = facts.recipe, facts.in_features, facts.weights
    gemm = "torch._scaled_mm" if facts.scaled_mm else "emulated (no FP8 tensor cores here)"
    detail = f", history L={r.amax_history}, {r.amax_algo}" if r.mode == "delayed" else ""
    lines = [f"fp8 {r.mode}{detail}, margin {r.margin}: {len(linears)} block linears in FP8 (E4M3 X, W;"
             f" {'E4M3' if r.mode == 'blockwise' else 'E5M2'} dY), GEMMs {gemm}; embedding, head, loss,"
             f" routers in the compute dtype"]
    tokens, compute_bytes = run.micro_batch_size * run.seq_len // run.mesh.size("cp"), run.compute_dtype.itemsize
    saved = fp8.saved_input_bytes(linears.values(), tokens, compute_bytes)
    lines.append(f"  memory: saved inputs in FP8 {mfu.format_bytes(saved['fp8'])} instead of"
                 f" {mfu.format_bytes(saved['compute'])} per micro-batch in flight (Σ M·K_j, M={tokens}):"
                 f" {mfu.format_bytes(saved['saved'])} less; FP8 weight copies {mfu.format_bytes(weights)}"
                 f" (autocast's were {mfu.format_bytes(weights * compute_bytes)}); scaling state"
                 f" {mfu.format_bytes(scaling_state_bytes(len(handle.linears), handle.histories, r.amax_history))}")
    compute = mfu.format_dtype(run.compute_dtype)
    flops = format_flops.flops_by_format(run.config, run.seq_len, "fp8", "fp8", compute,
                                         routed_experts=True)
    lines.append(f"  MFU: {flops['fp8'] / sum(flops.values()):.0%} of model FLOPs run in FP8; on GPUs divide by the"
                 f" format-weighted peak " + format_flops.weighted_peak_line(flops, hardware.PRESETS["h100"], compute))
    for (op, group), (calls, payload) in handle.predicted_messages(run.layout).items():
        lines.append(f"  messages per step: {op} {group}: {calls} × {mfu.format_bytes(payload / calls)}"
                     f" (amax MAX reductions)")
    return lines


def _fp8_scale_table(handle, run, steps: int) -> list:
    """Per layer and linear: the scales in use and the share of saturated values since the last table (this
    rank's tensors, counted by its observer, observers.SaturationCount). Blockwise shows the smallest tile scale (the
    tile with the largest amax)."""
    facts = handle.facts()
    names = {name: name.removeprefix("transformer.h.") for name in facts.scales}
    width = max([len("layer.linear"), *map(len, names.values())])
    rows = [f"fp8 {facts.recipe.mode}: the scales in use and the saturated share since the last table (this rank)",
            f"  {'layer.linear':<{width}}" + "".join(f"  {role + ' scale':>17} {'sat':>6}"
                                                  for role in fp8_scaling.ROLES)]
    for name, scales in facts.scales.items():
        shares = handle.observer.take(name)
        rows.append(f"  {names[name]:<{width}}" + "".join(f"  {s:17.3e} {p:5.2f}%"
                                                           for s, p in zip(scales.tolist(), shares)))
    return rows


def _fp8_end(handle, run, steps: int) -> list:
    """FP8's skipped steps and its experts' padded rows (amax reductions: the message table; scales: the step's)."""
    facts = handle.facts()
    first = f"{facts.first_steps} scaled like current (empty history), " if facts.recipe.mode == "delayed" else ""
    padding = [f"fp8 experts: MoE layer {i} padded {rows} rows to 16 per chunk in {steps} steps ="
               f" {fp8_experts.padding_bytes(rows, run.config.n_embd, run.compute_dtype.itemsize)} bytes saved"
               f" (5h FP8 + 4h·e_c per row)" for i, rows in sorted(handle.observer.rows.items())]
    return [f"fp8 {facts.recipe.mode}: steps {steps} ({first}{facts.nonfinite_steps} with a non-finite amax,"
            f" skipped on every rank)", *padding]


FP8_LINES = {"startup": _fp8_startup, "step": _fp8_scale_table, "end": _fp8_end}


# --- precision (a microscaling recipe, precision/recipe.py) ---


def _precision_startup(handle, run, steps: int) -> list:
    """Which linears run in which format and which stay in the compute dtype, the bytes per element with the
    scales (saved inputs, gathered weights) and the amax reductions per step (precision/recipe.py, items 2-3)."""
    facts = handle.facts()
    r, compute_bytes = facts.recipe, run.compute_dtype.itemsize
    compute = {torch.float32: "fp32", torch.float64: "fp64", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(
        run.compute_dtype, str(run.compute_dtype))

    def fmt(name):
        return compute if name == "bf16" else name.upper()

    def layers(names) -> str:  # "blocks 0-9" of this rank
        ids = sorted({int(name.split(".")[2]) for name in names})
        return f"block{'s' if len(ids) > 1 else ''} {ids[0]}" + (f"-{ids[-1]}" if len(ids) > 1 else "") if ids else ""

    tail = f"; the last {len(facts.kept)} block linears ({layers(facts.kept)}, tail {r.tail:g})" if facts.kept else ""
    where = f" ({layers(facts.formats)})" if facts.formats else ""
    lines = [f"precision recipe {r.describe()}: {len(facts.formats)} block linears{where} with forward operands in"
             f" {fmt(r.fwd)}, backward operands in {fmt(r.bwd)}" + (" (16×16 NVFP4 weight blocks)" if r.w2d else "")
             + (", Hadamard on dW's operands" if r.rht else "") + (", stochastic rounding of dY" if r.sr else "")
             + (", Four Over Six (each forward block scaled to 6 or 4)" if r.four_over_six else "")
             + (f", MS-EDEN (rotation {r.rotation}, the forward's operands re-quantised)" if r.eden else ""),
             f"  in the compute dtype ({compute}): embedding, head, loss{tail}; GEMMs emulated"
             f" (quantise → dequantise → {compute} GEMM): only Blackwell (B200) has block-scaled tensor cores"]
    tokens = run.micro_batch_size * run.seq_len // run.mesh.size("cp")
    bits = {name: precision.recipe.bits_per_element(name, compute_bytes) for name in (r.fwd, r.bwd)}
    saved = precision.recipe.saved_input_bytes(facts.in_features.values(), tokens, r.bwd, compute_bytes)
    lines.append(f"  memory: bits per element with block scales: forward {bits[r.fwd]:g}, backward {bits[r.bwd]:g}"
                 + (" (+ a 32-bit tensor scale per tensor)" if "nvfp4" in (r.fwd, r.bwd) else "")
                 + f"; saved inputs per micro-batch in flight (Σ M·K_j, M={tokens}): a block-scaled kernel's"
                 f" {mfu.format_bytes(saved['codes'])}, this emulation's {mfu.format_bytes(saved['compute'])}"
                 f" ({compute})")
    if run.settings.args.zero == 3:
        b_w, n = run.param_dtype.itemsize, facts.weights
        if facts.gathered_as_codes:
            how = (f"as E2M1 codes, 1 byte each here ({mfu.format_bytes(n)}; 4.5 bits packed with the E4M3 tile"
                   f" scales would be {mfu.format_bytes(n * 4.5 / 8)}), the 16×16 tiles' amaxes all-reduced first")
        else:
            how = (f"in the working dtype ({b_w} bytes each, {mfu.format_bytes(n * b_w)}), quantised after the gather:"
                   f" W's two quantisations (along K for Y, along N for dX) would take 2 × {bits[r.fwd]:g} bits")
        lines.append(f"  ZeRO-3 gathers these {n:,} weight elements per gather of all {how}")
    flops = format_flops.flops_by_format(run.config, run.seq_len, r.fwd, r.bwd, compute,
                                         r.tail_layers(run.config.n_layer), routed_experts=True)
    shares = ", ".join(f"{name} {f / sum(flops.values()):.1%}" for name, f in flops.items())
    lines.append(f"  MFU: model FLOPs by format {shares}; the step line's MFU divides by their format-weighted peak on"
                 f" this device ('peak assumed'; a format without a GEMM here at the {compute} rate, which the"
                 f" emulation runs them all at), a block-scaled kernel's "
                 + format_flops.weighted_peak_line(flops, hardware.PRESETS["b200"], compute))
    for (op, group), (calls, payload) in handle.predicted_messages(run.layout).items():
        lines.append(f"  messages per step: {op} {group}: {calls} × {mfu.format_bytes(payload / calls)}"
                     f" (NVFP4 tensor amax MAX reductions)")
    return lines


def _precision_saturation(handle, run, steps: int) -> list:
    """The share of values the recipe's clamps cut since the last line, per role over all its linears (this rank's
    training quantisations: observers.SaturationCount; MX's rceil cannot saturate, floor and NVFP4's rounded block
    scale can)."""
    counts, facts = handle.observer, handle.facts()
    values = [0, 0, 0]
    cut = [0.0, 0.0, 0.0]
    for name in facts.formats:
        seen = list(counts.values.get(name, [0, 0, 0]))
        for role, (share, n) in enumerate(zip(counts.take(name), seen)):
            values[role] += n
            cut[role] += share * n / 100
    shares = "  ".join(f"{role} {100 * c / max(1, n):.3f}%" for role, c, n in zip(("X", "W", "dY"), cut, values))
    return [f"precision {facts.recipe.describe()}: saturated since the last line (this rank): {shares}"]


def _precision_end(handle, run, steps: int) -> list:
    """The linears quantised and kept; the routed experts' padded rows counted per MoE layer against the estimate
    (accounting/recipe_experts.py), with what a block-scaled kernel would keep saved for them."""
    facts, r = handle.facts(), handle.facts().recipe
    block = r.token_block
    bits = precision.recipe.bits_per_element(r.bwd, run.compute_dtype.itemsize)
    expected = recipe_experts.expected_padded_rows(experts_of(run.config).experts, block) * run.micro_batches * steps
    padding = [f"precision experts: MoE layer {i} padded {rows} rows to {block} per chunk in {steps} steps"
               f" (estimate {expected:g}) = {recipe_experts.padding_bytes(rows, run.config.n_embd, bits):g} bytes of"
               f" backward codes a block-scaled kernel saves (5h·β/8 per row)"
               for i, rows in sorted(getattr(handle.observer, "rows", {}).items())]
    return [f"precision recipe {facts.recipe.describe()}: steps {steps}, {len(facts.formats)} block linears"
            f" quantised, {len(facts.kept)} kept in the compute dtype", *padding]


PRECISION_LINES = {"startup": _precision_startup, "step": _precision_saturation, "end": _precision_end}
