"""Each axis's accounting, printed: the lines a handle adds at start-up, with each logged step, and at the end.

One section per handle name, registered as AXIS_LINES[name][when] = formatter(handle, run, steps) -> [str],
with when "startup", "step" or "end": the layouts (ddp, zero), then moe, tp, cp, the pipeline's pp (its section
in report/pipeline.py), and the numerics' fp8 and precision (their sections in report/precision.py). report/run.py
loops over the run's handles (`axis_lines`) and the layout (`layout_lines`) and never asks which flags are on.
A section formats what its concept file's docstring answers (what is split, what a device holds, which messages
a step sends), with the axis's own prediction formulas next to what the run measured: the tracer's counts, the
clocks, and for the sections in MEASURES_BLOCK block 0 measured once at start-up (run.measured,
measure.measure_block). Nothing here changes what the trainer computes.

The sections live here and not beside each axis: a concept file keeps its algorithm and its pure formulas,
and the printing of them belongs to the accounting (report/run.py for the run's own lines, this file for the
axes'), so that a reader of an axis meets the algorithm right after its docstring.
"""

from __future__ import annotations

import os

import torch

from accounting import fp8_experts, measure, memory, moe_costs, moe_memory, observers
import context_parallel
from experts import coupling, dispatch, router
import mfu
from parallel import lowbit, schedules
import report.muon
import report.pipeline
import report.precision
import tensor_parallel
from step import Count


# ---------------------------------------------------------------------------------------------------------
# Each axis's lines: AXIS_LINES[handle name][when](handle, run, steps) -> [str]; when: startup, step, end
# ---------------------------------------------------------------------------------------------------------


def axis_lines(axis, when: str, run, steps: int = 0) -> list:
    """The lines of `axis` (a handle) at `when`: its section's formatter, or none."""
    formatter = AXIS_LINES.get(axis.name, {}).get(when)
    return formatter(axis, run, steps) if formatter is not None else []


def layout_lines(run, when: str, steps: int = 0) -> list:
    """The layout's lines at `when`: its section's formatters (AXIS_LINES[layout.name]: DDP's, ZeRO's), Muon's when it
    steps the matrices (report/muon.py), then a wrapping layout's own (AXIS_LINES[layout.wrapper]: DiLoCo's)."""
    wrapper = AXIS_LINES.get(getattr(run.layout, "wrapper", None), {}).get(when)
    inner = getattr(run.layout, "inner", run.layout)  # the wrapped layout's section reads its own figures
    muon = report.muon.startup_lines(inner.facts().muon) if when == "startup" else []
    return axis_lines(inner, when, run, steps) + muon + (wrapper(run.layout, run, steps) if wrapper else [])


AXIS_LINES: dict = {}  # {handle name: {"startup" | "step" | "end": formatter(axis, run, steps) -> [str]}}
OBSERVERS = {"cp": observers.WaitClock, "moe": observers.RoutedLoad,  # {handle name: what its section's lines read}
             "fp8": fp8_experts.PaddingCount, "pp": observers.ActionClock, "precision": fp8_experts.PaddingCount}


def observe(axis):
    """Subscribe a fresh observer of the axis's algorithm (OBSERVERS[name]; report.run.observe_axes) and return it."""
    if axis.name in OBSERVERS:
        axis.observe(OBSERVERS[axis.name]())
    return axis.observer
MEASURES_BLOCK: set = set()  # handle names whose lines read run.measured (block 0 under a tracer)


# ---------------------------------------------------------------------------------------------------------
# --- ddp --- (the DDP layout's lines)
# ---------------------------------------------------------------------------------------------------------


def ddp_startup_lines(layout, run=None, steps: int = 0) -> list:
    """What DDP holds and sends (ddp.py's docstring, answers 1-3): the persistent bytes predicted, the bucket
    all-reduces per group, and the bucket left on the critical path once backward ends."""
    persistent, facts = layout.predicted_persistent(), layout.facts()
    sizes = facts.bucket_bytes
    lines = ["layout: DDP (ZeRO stage 0): parameters, gradients and AdamW state replicated over each"
             " parameter's data-parallel group; split: the batch",
             "predicted persistent memory per rank (fp32 master recipe: b_w = b_g = 4, b_o = 8 bytes):",
             f"  weights   {mfu.format_bytes(persistent['weights'])}",
             f"  grads     {mfu.format_bytes(persistent['grads'])}  (= the DDP buckets: grads are views)",
             f"  AdamW m,v {mfu.format_bytes(persistent['optimizer'])}",
             f"  total     {mfu.format_bytes(persistent['total'])}"]
    if "feedback" in persistent:
        lines.insert(-1, f"  feedback  {mfu.format_bytes(persistent['feedback'])}  (--dp-comm-bits 4: each bucket's"
                         f" error, fp32, this rank's; checkpointed)")
    for (op, group), (calls, payload) in layout.predicted_messages().items():
        n = facts.group_sizes[group]
        formula = "2(N-1)/N·M, ring" if op == "all_reduce" else "(N-1)/N·M: 4-bit codes, parallel/lowbit.py"
        lines.append(f"  {op} {group} (N={n}): payload {mfu.format_bytes(payload)} in {calls}"
                     f" bucket{'' if calls == 1 else 's'}, sent per"
                     f" rank {mfu.format_bytes(mfu.wire_bytes(op, payload, n))} ({formula})")
    if facts.quantized and facts.dp_size > 1:
        lines.append("critical path: each bucket's 4-bit sum runs when the bucket fills, blocking backward"
                     " (no overlap)")
    elif len(sizes) > 1 and facts.dp_size > 1:
        lines.append(f"critical path: buckets 0..{len(sizes) - 2} overlap the last micro-batch's backward; the"
                     f" last one ({mfu.format_bytes(sizes[-1])}, the first layers' grads) is sent after it")
    elif facts.dp_size > 1:
        lines.append(f"critical path: the single bucket ({mfu.format_bytes(sizes[0])}) is sent after backward;"
                     f" lower --bucket-mb to overlap it")
    return lines


AXIS_LINES["ddp"] = {"startup": ddp_startup_lines}


def diloco_startup_lines(layout, run, steps: int = 0) -> list:
    """DiLoCo's replicas, its outer step, its state and its cross-replica bytes against DDP's (resilience/diloco.py's
    docstring, answers 1-3)."""
    facts = layout.wrapper_facts()
    return diloco_lines(facts.config, facts.outer_bytes, run.mesh.shape.replica_dp, run.settings.args.global_batch)


def diloco_lines(c, b: float, replica_dp: int, global_batch: int) -> list:
    """diloco_startup_lines from the figures (c: diloco.DiLoCoConfig, b: one copy of the outer state, the Δ
    all-reduce's payload): what plan_search prints for a layout it never builds."""
    return [f"diloco: R={c.replicas} replicas of D/R={replica_dp} data ranks (replica = d // (D/R)), each"
            f" {global_batch // c.replicas} sequences a step; H={c.inner_steps} inner AdamW steps,"
            f" then Δ averaged over `diloco` (N={c.replicas}) and outer Nesterov SGD (lr {c.outer_lr}, momentum"
            f" {c.outer_momentum})",
            f"  outer state θ_start + momentum {mfu.format_bytes(2 * b)} (in the optimizer row); Δ all-reduce"
            f" payload {mfu.format_bytes(b)} every {c.inner_steps} steps = {mfu.format_bytes(b / c.inner_steps)}"
            f" a step (1/{c.inner_steps} of a DDP gradient all-reduce of the same parameters)"]


def diloco_end_lines(layout, run, steps: int = 0) -> list:
    facts = layout.wrapper_facts()
    return [f"diloco: {facts.outer_steps} outer steps taken this run (every {facts.config.inner_steps} steps)"]


AXIS_LINES["diloco"] = {"startup": diloco_startup_lines, "end": diloco_end_lines}


# ---------------------------------------------------------------------------------------------------------
# --- zero --- (the ZeRO layout's lines)
# ---------------------------------------------------------------------------------------------------------


def zero_startup_lines(layout, run, steps: int) -> list:
    """What ZeRO holds and sends: the persistent bytes predicted (with Ψ, with the padded Ψ'_g) next to what
    it holds, the peak bound, and which messages overlap what (zero.py's docstring, answers 2 and 3)."""
    facts = layout.facts()
    b, D, psi, stage, dtype = facts.bytes_per_param, facts.dp_size, facts.numel, facts.stage, facts.dtypes
    formula = {1: "(b_w+b_g)Ψ + b_oΨ/D", 2: "b_wΨ + (b_g+b_o)Ψ/D", 3: "(b_w+b_g+b_o)Ψ/D"}[stage]
    exact = memory.persistent_bytes(psi, b, stage, D)
    padded, held = layout.predicted_persistent(), layout.held_bytes()
    sizes = ", ".join(f"{name} D={size}" for name, size in facts.group_sizes.items())
    name, units = mfu.format_dtype, facts.units
    lines = [f"ZeRO stage {stage} over {sizes}: {name(dtype['param'])} working weights and micro-batch"
             f" grads, {name(dtype['accumulate'])} accumulated grads, {name(dtype['reduce'])} reduce-scatter,"
             f" {name(dtype['master'])} optimizer (b_w={b.weights}, b_g={b.grads}, b_o={b.optimizer});"
             f" {units} unit{'s' if units != 1 else ''}, Ψ={psi:,}, padded Ψ'={facts.padded_numel:,}",
             f"persistent bytes per rank, {formula}:  predicted(Ψ, D={D}) / predicted(Ψ'_g, D_g) / held"]
    for kind in ("weights", "grads", "optimizer", "total"):
        lines.append(f"  {kind:<9} {mfu.format_bytes(exact[kind]):>12} {mfu.format_bytes(padded[kind]):>12}"
                     f" {mfu.format_bytes(held[kind]):>12}")
    lines.append(f"peak lower bound per rank (persistent + transient buffers, activations apart):"
                 f" {mfu.format_bytes(facts.peak_lower_bound)}")
    if facts.pipeline_note:  # parallel/zero_pipeline.py: what the schedule's reductions (and gathers) hold and send
        held = "gathered chunks and gradient buffers" if stage == 3 else "gradient buffers"
        lines.append(f"{facts.pipeline_note}; the step's {held} at most"
                     f" {mfu.format_bytes(facts.step_transient_predicted)}")
    lines.append("messages: reduce_scatter of the gradients overlaps backward; the all_gather of unit k"
                 " overlaps the update of unit k+1" if stage < 3 else
                 "messages: each chunk's all_gather is prefetched behind the previous action's compute; exposed:"
                 " the first action's chunk" if facts.pipeline_note else
                 "messages: each block's all_gather is prefetched behind the previous block's compute;"
                 " exposed: the root and block 0 at the start of forward, the root's reduce_scatter at the end")
    return lines


def zero_end_lines(layout, run, steps: int) -> list:
    """The peak bound again, at stage 3 how many gathered blocks (chunks under a pipeline) the schedule held at
    once, and under a pipeline the step's transient buffers measured against predicted."""
    facts, f = layout.facts(), mfu.format_bytes
    what = "chunks" if facts.pipeline_note else "blocks"
    lines = [f"  ZeRO-{facts.stage} peak lower bound {f(facts.peak_lower_bound)}"
             + (f"; gathered {what} alive at once: {facts.peak_gathered_units} (bound: {facts.gathered_bound}, in use"
                f" + prefetched)" if facts.stage == 3 else "")]
    if facts.pipeline_note:  # parallel/zero_pipeline.py: its own buffers' peak against the action list's
        held = "gathered chunks + gradient buffers" if facts.stage == 3 else "gradient buffers"
        lines.append(f"  ZeRO-{facts.stage} under the pipeline: {held} at once measured"
                     f" {f(facts.step_transient_measured)}, predicted {f(facts.step_transient_predicted)}")
    return lines


AXIS_LINES["zero"] = {"startup": zero_startup_lines, "end": zero_end_lines}


# ---------------------------------------------------------------------------------------------------------
# --- moe ---
# ---------------------------------------------------------------------------------------------------------

MOE_BARS = "▁▂▃▄▅▆▇█"


def moe_histogram(values) -> str:
    """One character per value, its height proportional to value / max (blank for zero load)."""
    values = [int(v) for v in values]
    top = max(values) or 1
    return "".join(MOE_BARS[min(len(MOE_BARS) - 1, v * (len(MOE_BARS) - 1) // top)] if v else " " for v in values)


def moe_load_line(loads: list, dropped: int, steps: int, capacity_on: bool) -> str:
    """`moe load over the 10 steps since the previous line ...`: loads[l][i] slots routed to expert i by MoE
    layer l (before capacity), summed over layers; imbalance max/mean; what capacity dropped, or dropless."""
    total = [sum(column) for column in zip(*loads)]
    slots = sum(total)
    mean = slots / len(total) if slots else 1.0
    worst = max(max(load) / (sum(load) / len(load)) if sum(load) else 1.0 for load in loads)
    span = "this step" if steps == 1 else f"the {steps} steps since the previous line"
    if not capacity_on:
        drops = "dropless"
    elif dropped:
        drops = f"{dropped} of the {slots} slots dropped by capacity ({100 * dropped / slots:.1f}%)"
    else:
        drops = f"none of the {slots} slots dropped by capacity"
    return (f"moe load over {span} (this rank, {len(loads)} MoE layers): |{moe_histogram(total)}|"
            f" {min(total)}..{max(total)} slots/expert, imbalance max/mean {max(total) / mean:.2f}"
            f" (worst layer {worst:.2f}), {drops}")


def moe_startup_lines(axis, run, steps: int = 0) -> list:
    """The router, capacity, parameters (total and active), FLOPs, this rank's experts, the all-to-all estimate."""
    facts = axis.facts()
    traffic, config, local, held = facts.traffic, facts.traffic.model, facts.experts, facts.expert_params
    n, k, tokens, whole = config.moe.experts, config.moe.topk, traffic.tokens, run.micro_batch_size * run.seq_len
    counts, cap = memory.param_counts(config), router.capacity(whole, k, n, config.moe.capacity_factor)
    flops = mfu.flops_per_token(counts, config, run.seq_len)
    capacity_text = "dropless" if cap is None else (
        f"capacity f={config.moe.capacity_factor}: C = ⌈B_μ·s·k/N·f⌉ = {cap} slots per expert of each"
        f" micro-batch (B_μ·s = {whole} tokens, decided in its token order"
        + (f"; this rank routes T = {tokens} of them and gathers the others' choices" if tokens < whole else "") + ")")
    lines = [
        f"moe: N={n} experts, top-{k} ({router.describe(config)}),"
        f" on {counts['moe_layers']} of {config.n_layer} blocks (every {config.moe.every}); {capacity_text}"
        f"; aux α={config.moe.aux_coef}, z β={config.moe.z_coef}",
        f"  parameters: total {counts['total']:,}, active per token {counts['active']:,}"
        f" (= total − L_moe·(N−k)·Ψ_e, Ψ_e = 8h²+5h = {counts['expert']:,});"
        f" routers L_moe·h·N = {counts['router']:,}",
        f"  FLOPs per token (model) 6·N_active + 12·L·H·Q·s = {mfu.format_flops(flops.model)},"
        f" N_active = {counts['active_matmul']:,} matmul weights (k experts + router, not N)",
        *([f"  shared experts S={config.moe.shared_experts} per MoE layer, added ungated (one MLP of width S·4h ="
           f" {config.moe.shared_experts * 4 * config.n_embd}): {counts['shared_experts']:,} dense params (split"
           f" by TP like the MLP, grads over dp×cp), in N_active"] if config.moe.shared_experts else []),
        f"  expert parallel E={traffic.ep} (group ep), expert grads over expert_dp ({run.mesh.size('expert_dp')}"
        f" ranks), router over dp×cp, replicated over tp: this rank holds {'slots' if traffic.slots else 'experts'}"
        f" [{local.start}, {local.stop}) of"
        f" each MoE layer = {held:,} params = {mfu.format_bytes(held * next(run.model.parameters()).element_size())}"
        f" weights, {mfu.format_bytes(held * 16)} with fp32 grads + AdamW",
    ]
    if traffic.ep > 1:
        rows = tokens * router.rows_per_token(n, k, config.moe.groups, config.moe.group_limit, traffic.ep)[0]
        per_layer = dispatch.all_to_all_messages(traffic, 1, rows, rows)[dispatch.ALL_TO_ALL][1]
        calls, payload = axis.predicted_messages(run.layout).get(dispatch.ALL_TO_ALL, (0, 0))
        lines.append(f"  all_to_all_single per MoE layer and micro-batch (group ep), uniform-routing estimate"
                     f" S = R = T·ρ = {rows:.1f} (token, rank) rows, ρ ranks a token reaches (experts/dispatch.py: one"
                     f" copy each): fwd counts 8(N+E) + rows + metadata (2k) + combine, bwd the 3 reverses ="
                     f" {mfu.format_bytes(per_layer)} payload, (E−1)/E on the wire ="
                     f" {mfu.format_bytes(per_layer * (traffic.ep - 1) / traffic.ep)}; per step {calls} calls,"
                     f" {mfu.format_bytes(payload)} (the startup table's figure; the end table predicts exactly,"
                     f" from the routed counts)")
    # The forward's peak (accounting/moe_memory.py) beside what start-up measured (train.compose(measure=True); a run
    # built by hand without that measurement, no run.measured_moe, prints none).
    return lines + (moe_memory.startup_lines(traffic, run) if getattr(run, "measured_moe", None) is not None else [])


def moe_step_lines(axis, run=None, steps: int = 0) -> list:
    """With each logged step: this rank's routed slots per expert, summed over its MoE layers, micro-batches
    and the training steps since the previous line (which it says), read in one `.tolist()` (its observer's
    take_load: observers.RoutedLoad)."""
    traffic = axis.facts().traffic
    load = axis.observer.take_load(traffic.micro_batches)
    axis.observer.restart_coupling()  # the co-selection window restarts with each line: the end prints the last
    if load is None:
        return []
    loads, dropped, span = load
    return [moe_load_line(list(loads.values()), dropped, span, traffic.model.moe.capacity_factor > 0)]


def moe_end_lines(axis, run, steps: int) -> list:
    """The all-to-all predicted from the routed counts beside the uniform-routing estimate (the end table
    compares the first with the tracer); the load of the last steps, per MoE layer."""
    lines, traffic = [], axis.facts().traffic
    layers = max(1, traffic.moe_layers)
    if traffic.ep > 1 and steps:
        counted = axis.traced_prediction(run.layout, steps).get(dispatch.ALL_TO_ALL, (0, 0))
        uniform = axis.predicted_messages(run.layout).get(dispatch.ALL_TO_ALL, (0, 0))
        lines.append(f"moe all_to_all_single (group ep) per MoE layer and step: predicted from this run's routed"
                     f" counts {mfu.format_bytes(counted[1] / layers)} ({counted[0] / layers:.1f} calls; the end"
                     f" table's prediction); uniform-routing estimate {mfu.format_bytes(uniform[1] / layers)}"
                     f" (the startup table's)")
    routed = axis.observer
    places = axis.facts().places
    tracer = getattr(run, "tracer", None)
    traced = None  # the CommTracer's bytes to ranks of other places (all_to_all_single on ep, its step phase)
    if places is not None and tracer is not None and tracer.sent_to("all_to_all_single", "ep"):
        sent_to = tracer.sent_to("all_to_all_single", "ep")
        traced = sum(nbytes for nbytes, place in zip(sent_to, places.of_rank) if place != places.mine)
    lines += [line for line in [moe_costs.off_group_line(traffic, routed.off_group, routed.forwards, steps,
                                                         traced)] if line]
    lines += coupling_lines(routed.take_coupling(), traffic.model.moe.experts, traffic.model.moe.topk)
    if routed.last_load is None:
        routed.take_load(traffic.micro_batches)  # no load line was printed: read the loads now
    if routed.last_load is not None:
        loads, _, span = routed.last_load
        for layer_id, load in loads.items():
            mean = sum(load) / len(load) if sum(load) else 1.0
            lines.append(f"moe load over the last {span} step{'s' if span != 1 else ''}, h.{layer_id}:"
                         f" |{moe_histogram(load)}| {load} imbalance {max(load) / mean:.2f}")
    return lines


def coupling_lines(counts, n: int, k: int) -> list:
    """experts/coupling.py's statistics of the last window (observers.RoutedLoad.take_coupling): per MoE layer the
    top 1% of the pairs' share of the tokens, the pairs 42% of the tokens take, the next layer's predictability,
    and its pair matrix (N ≤ 16); under EP the slots and rows that stayed on this rank."""
    if counts is None or not counts.sets:
        return []
    tokens = sum(next(iter(counts.sets.values())).values())
    lines = [f"moe co-selection over the last window ({tokens:,} tokens a layer on this rank; experts/coupling.py;"
             f" Expert Coupling, top-2: 0.8% of the pairs chosen together by 42% of the tokens):"]
    for layer_id, sets in sorted(counts.sets.items()):
        take, pairs, share = coupling.top_pair_coverage(sets, n)
        uniform = f" (uniform routing: {take / pairs:.1%})" if k == 2 else ""
        line = (f"  h.{layer_id}: the top 1% of the pairs ({take} of {pairs}) chosen by {share:.1%} of the tokens"
                f"{uniform}; 42% of the tokens take {coupling.pairs_to_cover(sets, n):.1%} of the pairs")
        nexts = [joint for (here, _), joint in counts.joint.items() if here == layer_id]
        if nexts:
            given, alone = coupling.next_layer_predictability(nexts[0])
            line += f"; the next layer's set is its most frequent given this one's {given:.1%} (given none {alone:.1%})"
        lines.append(line)
        if n <= 16:
            matrix = coupling.pair_matrix(sets, n)
            lines.append(f"  h.{layer_id} pairs, ‰ of the tokens choosing both: " + "; ".join(
                " ".join(f"{1000 * x / max(1, tokens):.0f}" if i != j else "-" for j, x in enumerate(row))
                for i, row in enumerate(matrix)))
    if counts.rows:
        lines.append(f"moe local hits (EP, this rank, the last window): {counts.own_slots / max(1, counts.kept):.1%} of"
                     f" its kept slots ran on its own experts, {counts.own_rows / counts.rows:.1%} of its dispatch rows"
                     f" went to itself ({counts.rows:,} rows for {counts.kept:,} slots)")
    return lines


def eplb_end_lines(axis, run, steps: int) -> list:
    """experts/eplb.py's placement now, and the rows per EP rank it measured against the experts in place."""
    plan = axis.facts()
    if plan is None:  # a pipeline stage without MoE layers
        return []
    return [f"moe replicas R={plan.slots} placed by {plan.policy}, {plan.replans} re-plans: h.{plan.layer_id} phy2log"
            f" {list(plan.phy2log)}; rows per EP rank max/mean {plan.balance:.3f} under"
            f" {list(plan.measured_under)}, experts in place {plan.in_place:.3f} (the window before the"
            f" last re-plan, all MoE layers)"]


AXIS_LINES["moe"] = {"startup": moe_startup_lines, "step": moe_step_lines, "end": moe_end_lines}
AXIS_LINES["eplb"] = {"end": eplb_end_lines}


# ---------------------------------------------------------------------------------------------------------
# --- tp ---
# ---------------------------------------------------------------------------------------------------------


def tp_startup_lines(axis, run, steps: int = 0) -> list:
    """Block 0's tp messages per micro-batch, predicted (tensor_parallel.block_messages) and measured
    (run.measured, when start-up measured it), the parameters per rank, the activation estimates."""
    (batch, held), config = axis.facts(), run.config
    tp, format_bytes = run.mesh.size("tp"), mfu.format_bytes
    lines = [f"tensor parallel T={tp}{' + sequence parallel' if held.sequence_parallel else ''}: messages per block"
             f" and micro-batch (b={batch.micro}, s={batch.seq}, h={held.hidden}), on the critical path, group tp:"]
    blocks = list(run.model.transformer.h)
    split_mlp = not blocks or tensor_parallel.split_mlp_of(blocks[0].mlp) is not None  # a dense MLP, shared experts
    predicted = tensor_parallel.block_messages(batch, held, split_mlp=split_mlp)
    measured = run.measured.sizes_on("tp") if run.measured is not None else None  # {(phase, op): {bytes: calls}}
    sizes = {(phase, op): payload / calls for phase, messages in predicted.items()
             for (op, _), (calls, payload) in messages.items()}  # TP's message of each (phase, op)
    for phase, messages in predicted.items():
        for (op, _), (calls, payload) in messages.items():
            line = f"  {phase:<8} {op:<22} predicted {calls} × {format_bytes(payload / calls):>10}"
            if measured is not None:  # the calls of TP's size: another axis's on tp are rows of their own below
                got = measured.get((phase, op), {}).get(payload / calls, 0)
                line += f"   measured {got} × {format_bytes(payload / calls):>10}"
            lines.append(line)
    others = [(phase, op, size, calls) for (phase, op), by_size in (measured or {}).items()
              for size, calls in sorted(by_size.items()) if sizes.get((phase, op)) != size]
    for phase, op, size, calls in others:  # another axis's (FP8's amax MAX, a few bytes each), or a surprise
        lines.append(f"  {phase:<8} {op:<22} predicted 0 × {format_bytes(size):>10}   measured {calls} ×"
                     f" {format_bytes(size):>10}   (not TP's size: another axis's on tp)")
    if others:
        lines.append("  (measured: block 0 as the run runs it, every axis's messages on tp included; the end's table"
                     " checks each axis's prediction)")
    model = run.model  # what this rank holds: a pipeline stage's blocks, N/E experts of a MoE block
    counts = memory.param_counts(config, tp, run.mesh.size("ep"), model.transformer.h.layer_ids,
                                 model.has_embedding, model.has_head)
    act = memory.tp_activation_estimates(config, batch.micro, batch.seq, tp)
    lines.append(f"  parameters per rank: {counts['per_rank']:,} of {memory.param_counts(config)['total']:,}"
                 f" ({counts['split']:,} split /T + {counts['per_rank'] - counts['split'] // tp:,} replicated) ="
                 f" {format_bytes(counts['per_rank'] * batch.param_bytes)} weights,"
                 f" {format_bytes(counts['per_rank'] * 16)} with grads and AdamW")
    chosen = act["tp_sp"] if held.sequence_parallel else act["tp"]
    lines.append(f"  activations per layer (Korthikanti, 16-bit): unsplit sbh(34+5as/h) = {format_bytes(act['none'])};"
                 f" TP sbh(10+24/t+5as/(ht)) = {format_bytes(act['tp'])}; TP+SP (sbh/t)(34+5as/h) ="
                 f" {format_bytes(act['tp_sp'])}; this run {format_bytes(chosen)} × L={config.n_layer}"
                 f" = {format_bytes(chosen * config.n_layer)}")
    return lines


AXIS_LINES["tp"] = {"startup": tp_startup_lines}


# ---------------------------------------------------------------------------------------------------------
# --- lowbit --- (the 4-bit all-reduce of TP's f and g and of DDP's buckets)
# ---------------------------------------------------------------------------------------------------------


def lowbit_startup_lines(axis, run, steps: int = 0) -> list:
    """parallel/lowbit.py's format and feedback, and per call site the bytes a rank sends, codes and scales apart,
    against the exact all_reduce's in the run's dtype and in bf16 (the traced ones are in the end's table)."""
    config, f = axis.facts().config, mfu.format_bytes
    where = {"tp": "tp: the next call of the same pass (forward g's, backward f's)",
             "dp": "dp: each bucket's next step"}
    lines = [f"4-bit all-reduce (parallel/lowbit.py, Echo): NVFP4 codes (E2M1 two a byte, an E4M3 scale per"
             f" {lowbit.BLOCK} elements, an fp32 scale per chunk), summed in fp32, each value quantised at most twice;"
             f" error feedback {'on, into ' if config.feedback else 'off'}"
             + "; ".join(where[k] for k, bits in (("tp", config.tp_bits), ("dp", config.dp_bits))
                         if bits == 4 and config.feedback)]
    sites = []  # (group, what, elements, element bytes, N)
    if config.tp_bits == 4:
        batch, held = next(a for a in run.axes if a.name == "tp").facts()
        n = batch.micro * batch.seq * held.hidden
        sites.append(("tp", "each f and g, n = b·s·h", n, batch.compute_bytes, axis.facts().tp_size))
    if config.dp_bits == 4:
        buckets = run.layout.facts().buckets if run.layout.name == "ddp" else ()
        for index, (group, elements, element_bytes, size) in enumerate(buckets):
            if size > 1:
                sites.append((group, f"bucket {index}", elements, element_bytes, size))
    for group, what, n, e, size in sites:
        c = lowbit.chunk_elements(n, size)
        sent, codes = 2 * (size - 1) * lowbit.NVFP4.row_bytes(c, e), 2 * (size - 1) * c // 2
        exact, bf16 = mfu.wire_bytes("all_reduce", n * e, size), mfu.wire_bytes("all_reduce", 2 * n, size)
        lines.append(f"  {group} (N={size}) {what} = {n:,}: sent per rank {f(sent)} (codes {f(codes)} + scales"
                     f" {f(sent - codes)}) vs the exact all_reduce's {f(exact)} ({sent / exact:.3f}×), bf16's"
                     f" {f(bf16)} ({sent / bf16:.3f}×)")
    if config.tp_bits == 4 and config.feedback:
        n, size = sites[0][2], sites[0][4]
        lines.append(f"  tp feedback held through a pass: 2 chains × {f(4 * size * lowbit.chunk_elements(n, size))}"
                     f" (fp32; transient, never checkpointed)")
    return lines


AXIS_LINES["lowbit"] = {"startup": lowbit_startup_lines}
AXIS_LINES["qk_clip"] = {"startup": report.muon.qk_clip_startup_lines, "step": report.muon.qk_clip_step_lines}
MEASURES_BLOCK.add("tp")


# ---------------------------------------------------------------------------------------------------------
# --- cp ---
# ---------------------------------------------------------------------------------------------------------


def cp_startup_lines(axis, run, steps: int = 0) -> list:
    """What CP cuts and sends (context_parallel.py's docstring, answers 1-3): block 0's messages predicted
    (context_parallel.layer_messages) next to measured (run.measured), the causal work per rank, the activations,
    and the ring's transfers timed alone. Collective over cp: every rank formats these lines."""
    facts = axis.facts()
    C, shape, impl, balance = facts.ring.size, facts.shape, facts.config.impl, facts.config.balance
    s, format_bytes = shape.seq_len, mfu.format_bytes
    lines = [f"context parallel C={C} ({impl}, {balance}): rank c holds "
             + ("chunks c and 2C−1−c of 2C" if balance == "zigzag" else "the c-th s/C tokens")
             + f" ({s // C} of s={s} tokens); parameters replicated, gradients summed over dp×cp",
             f"  messages per layer and micro-batch, group cp (e_c={shape.compute_bytes},"
             f" e_a={context_parallel.accumulator_bytes(shape.compute_bytes)}):"]
    predicted = context_parallel.layer_messages(impl, C, shape)
    measured = run.measured.on("cp") if run.measured is not None else None
    rows = [(phase, op, count) for phase, messages in predicted.items() for (op, _), count in messages.items()]
    # Measured but not predicted by CP: another axis's messages on cp in block 0 (MoE's routing statistics).
    rows += [(phase, op, Count(0, 0)) for phase, op in (measured or {}) if (op, "cp") not in predicted[phase]]
    for phase, op, (calls, payload) in rows:
        line = f"    {phase:<8} {op:<18} predicted {calls} × {format_bytes(payload / max(1, calls)):>10}"
        if measured is not None:
            got = measured.get((phase, op), Count(0, 0))
            line += f"   measured {got.calls} × {format_bytes(got.payload / max(1, got.calls)):>10}"
        lines.append(line)
    if measured is not None and shape.checkpointing:
        lines.append("    (measured: block 0 run once, outside activation checkpointing, so its backward lacks the"
                     " recomputed forward's messages the prediction adds)")
    sent = sum(payload for (op, _), (_, payload) in axis.predicted_messages().items() if op != "recv")
    layers = len(run.model.transformer.h)
    lines.append(f"  per step (× L={layers} × m={run.micro_batches}): {format_bytes(sent)} sent")
    lines += cp_causal_work_lines(s, C) + cp_activation_lines(facts, run)
    if impl == "ring":
        alone = measure.time_ring_alone(facts, axis.observer, next(run.model.parameters()).device)
        lines.append(f"  ring transfers alone (no compute): forward {alone['forward'] * 1e3:.2f} ms,"
                     f" backward {alone['backward'] * 1e3:.2f} ms per layer")
    return lines


def cp_causal_work_lines(seq_len: int, cp: int) -> list:
    lines = [f"  causal work per CP rank, (query, key) pairs for s={seq_len} (max/mean is the imbalance):"]
    for balance, pairs in context_parallel.causal_work(seq_len, cp).items():
        ratio = max(pairs) / (sum(pairs) / len(pairs))
        lines.append(f"    {balance:<10} " + " ".join(f"{p:>10,}" for p in pairs) + f"   max/mean {ratio:.3f}")
    return lines


def cp_activation_lines(facts, run) -> list:
    """Block 0's measured saved bytes next to Korthikanti's estimate and its CP form (÷ C).

    The estimate counts 16-bit elements; the measurement is in the run's dtypes, so it is also shown scaled
    by 2/e_c (exact when every saved tensor is in the compute dtype; autocast keeps LayerNorm inputs fp32)."""
    C, s, b, h, tp = facts.ring.size, facts.shape.seq_len, facts.shape.micro, run.config.n_embd, run.mesh.size("tp")
    sp, format_bytes = run.settings.sequence_parallel, mfu.format_bytes
    full = memory.activation_bytes_per_layer(s, b, h, run.config.n_head, tp, sp)
    # Without the score term (a = 0) and without the two 1-byte dropout masks of the residual branches.
    flash = memory.activation_bytes_per_layer(s, b, h, 0, tp, sp) - 2 * s * b * h / (tp if sp else 1)
    line = (f"  activations per layer and micro-batch (Korthikanti 2022, 16-bit, ÷ C={C}): sbh(34+5as/h)/C ="
            f" {format_bytes(full / C)}; no stored scores, no dropout masks (32sbh)/C = {format_bytes(flash / C)}")
    if run.measured is not None:
        saved = run.measured.saved_bytes
        line += (f"; measured (saved_tensors_hooks) {format_bytes(saved)}, × 2/e_c = "
                 f"{format_bytes(saved * 2 / facts.shape.compute_bytes)}")
    return [line]


def cp_end_lines(axis, run, steps: int) -> list:
    """How much of the ring's transfer time compute hid over the training steps' passes (Ulysses: none)."""
    facts = axis.facts()
    C, impl = facts.ring.size, facts.config.impl
    if impl != "ring":
        return [f"context parallel C={C} ({impl}): the all-to-alls are blocking, none of their time is hidden"
                f" (their seconds: the communication table below)"]
    layers, m = len(run.model.transformer.h), run.micro_batches
    recompute = " (forward ×2: activation checkpointing)" if facts.shape.checkpointing else ""
    on_cpu = next(run.model.parameters()).device.type == "cpu"
    return [f"context parallel C={C} (ring): ring time over the {steps} training steps' passes, L={layers} × m={m}"
            f" per step and phase{recompute}; evaluation not included:", *cp_hidden_lines(axis.observer, on_cpu)]


def cp_hidden_lines(clock, on_cpu: bool = False) -> list:
    """How much of the ring's transfer time compute hid, per phase: at least 1 − waited / (the transfers alone),
    both per pass (clock: the observers.WaitClock observing the ring). A lower bound: wait() also blocks on a peer that
    has not sent yet (imbalance; on a shared host, a peer that was descheduled), so the waits can outlast the transfers
    even when each one overlapped. on_cpu: also the CPU cores a rank kept busy while it computed (process CPU /
    (wall − waited); a gloo wait sleeps), next to its torch threads: a one-thread rank with less than one core
    busy was descheduled, i.e. the ranks time-share the host's cores."""
    lines, shared = [], False
    for phase, stat in clock.phases.items():
        waited, seconds = stat.waited / stat.passes, stat.seconds / stat.passes
        line = (f"  ring {phase:<8}: {stat.passes} passes, {seconds * 1e3:.2f} ms each, blocked in wait()"
                f" {waited * 1e3:.2f} ms ({waited / seconds:.0%})")
        if clock.alone.get(phase, 0) > 0:
            alone = clock.alone[phase]
            line += (f"; the transfers alone {alone * 1e3:.2f} ms: at least"
                     f" {min(1.0, max(0.0, 1 - waited / alone)):.0%} of them hidden behind compute")
        if on_cpu:
            threads, cores = torch.get_num_threads(), stat.cpu / max(1e-9, stat.seconds - stat.waited)
            shared = shared or (threads == 1 and cores < 0.8)
            line += f"; {cores:.2f} CPU cores busy while computing ({threads} torch threads)"
        lines.append(line)
    if lines:
        lines.append("  (at least: wait() also counts a slower peer's compute, so 0% means the waits outlast the"
                     " transfers, not that none overlapped)")
    if shared:
        lines.append(f"  (under one core busy on one thread: the ranks time-share this host's {os.cpu_count()} cores; a"
                     " rank's waits are then mostly its peers' descheduled compute, and gloo's copies of the"
                     " 'hidden' transfers are CPU work taken from that compute)")
    return lines


AXIS_LINES["cp"] = {"startup": cp_startup_lines, "end": cp_end_lines}
MEASURES_BLOCK.add("cp")


AXIS_LINES["pp"] = report.pipeline.PP_LINES  # the pipeline's section: report/pipeline.py


def redundancy_startup_lines(axis, run, steps: int = 0) -> list:
    """--pp-redundant (resilience/redundancy.py's docstring, answers 1-3): the shadow's bytes predicted and held,
    the R actions' place in the bubble (the uniform-cost simulation with and without them), the exchange."""
    f, pp = axis.facts(), next(a for a in run.axes if a.name == "pp").facts()
    plain = schedules.build_programs(pp.schedule, pp.P, pp.m)
    idle, filled = (schedules.simulate(programs, schedules.UNIFORM) for programs in (plain, pp.programs))
    span = [max(end for timeline in t for _, _, end in timeline) for t in (idle, filled)]
    late = sum(1 for a in pp.programs[f.rank][-pp.m:] if a.kind == "R")
    return [f"redundancy (Bamboo): pp rank {f.rank} shadows stage {f.shadowed} ({f.shadow_params:,} parameters):"
            f" weights, gradient, Adam moments 4·b·Ψ_s = {mfu.format_bytes(f.shadow_bytes)} predicted,"
            f" {mfu.format_bytes(f.shadow_held)} held; its {pp.m} R forwards keep their graphs until the update",
            f"  bubble (uniform costs, R = F): idle {sum(schedules.bubble_of(idle)) / pp.P:.1%} without R,"
            f" {sum(schedules.bubble_of(filled)) / pp.P:.1%} with R; step {span[0]:g} → {span[1]:g} slots"
            f" (+{span[1] / span[0] - 1:.1%}); {late} of this rank's R after its last action",
            f"  per step over pp: send {mfu.format_bytes(4 * f.own_params)} (this stage's gradients, to stage"
            f" {(f.rank - 1) % f.P}), recv {mfu.format_bytes(4 * f.shadow_params)} (stage {f.shadowed}'s), before"
            f" the update"]


def redundancy_end_lines(axis, run, steps: int = 0) -> list:
    f = axis.facts()
    return [f"redundancy: {f.takeovers} takeover{'s' * (f.takeovers != 1)} in this run; pp rank {f.rank} shadows"
            f" stage {f.shadowed}, {mfu.format_bytes(f.shadow_held)} held"]


AXIS_LINES["redundancy"] = {"startup": redundancy_startup_lines, "end": redundancy_end_lines}


AXIS_LINES["fp8"] = report.precision.FP8_LINES  # the recipes' sections: report/precision.py
AXIS_LINES["precision"] = report.precision.PRECISION_LINES
