"""What one rank's forwards save for backward, estimated: the activation-memory model of a whole rank.

accounting/memory.py writes what one block, the embeddings and the head save, tensor by tensor (ActivationShape,
layer_activation_terms, ...), and Korthikanti et al. 2022's per-layer reference. This file adds them up for the
part of the model a rank holds, as the run runs it:

    bytes of one forward = Σ over its blocks (dense or MoE) + autocast's weight copies + ZeRO-3's gathered weights
                           + embeddings + head, ÷ v under a pipeline of v chunks per rank
    peak                 = forwards in flight (schedules.in_flight) × one forward
                           + under activation checkpointing the block backward rebuilds, less the head's bytes

A MoE block's router and experts are moe.py's terms (uniform routing), its shared experts experts/shared.py's;
under activation checkpointing a block keeps its input only, under selective recompute its input and its GEMM
outputs (memory.selective_block_terms; a MoE block by halves, `selective_blocks`). Under ZeRO-3 a weight autograd
saves is a view of its gathered unit: the units still gathered when the forward ends count (zero3_saved_weights).
The start-up prints the estimate (report/run.py), the end compares it with what the first forward saved, and plan.py
and planner/search.py size layouts with it, so a plan and a run print the same bytes.

It is its own file, not accounting/memory.py, because it sits above the axes: it reads moe.py's expert terms and the
pipeline's schedule, while the axes (pipeline.py, zero.py, ddp.py, step.py, through it moe.py) import
accounting/memory.py.

    activation_estimate(run)   this rank's ActivationEstimate (shape_of's symbols, the schedule's forwards in flight)
    estimate_of(config, x, …)  the same from the shapes alone (plan_search sizes layouts it never builds)
    shape_of(settings, …)      memory.ActivationShape of a layout: its sequence (s/C), dtypes, attention kernel
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from accounting import fp8_experts, memory, moe_costs
from experts import shared
from parallel import schedules
from precision import fp8_scaling
from moe import experts_of


ZERO3_GATHERED = "ZeRO-3 gathered weights"  # the names of zero3_saved_weights's terms begin so


@dataclass(frozen=True)
class ActivationEstimate:
    """What this rank's forwards save for backward, by accounting/memory.py's formulas (what the kernels save)."""

    forward: float  # bytes one forward saves: a micro-batch (under PP one chunk of it) through this rank's part
    terms: dict  # the micro-batch's bytes (all v chunks) by what saves them
    hidden: float  # of `forward`, what saved_tensors_hooks cannot see (SP's regather hooks: memory.hidden_from_hooks)
    in_flight: int  # forwards alive at once (the pipeline's chunk-micro-batches; 1 otherwise)
    chunks: int  # v: the chunks of a pipeline rank (forward is 1/v of the micro-batch's bytes); 1 otherwise
    recomputed: float  # under activation checkpointing, the block that backward rebuilds (else 0)
    korthikanti: float  # the paper's formula for the same blocks and micro-batch (16-bit, unfused attention)
    how: str

    @property
    def peak(self) -> float:
        """Bytes alive at once: every forward in flight, and under activation checkpointing the block that
        backward rebuilds (by then the head's and the loss's tensors of that micro-batch are freed); ZeRO-3's
        gathered weights apart (the layout's transients)."""
        rebuilt = max(0.0, self.recomputed - self.terms["head and loss"] / self.chunks)
        # ZeRO-3's gathered units are the layout's transients (zero3.peak_lower_bound, the plan's temporaries):
        # what the saved tensors reference of them is counted there, once, not once per forward in flight.
        return self.in_flight * (self.forward - self.gathered / self.chunks) + rebuilt

    @property
    def gathered(self) -> float:
        """ZeRO-3's gathered weights among the terms (all v chunks: zero3_saved_weights's names)."""
        return sum(value for name, value in self.terms.items() if name.startswith(ZERO3_GATHERED))


def activation_shape(run, device_type: str | None = None) -> memory.ActivationShape:
    """The symbols of accounting/memory.py's activation formulas for this rank: its sequence (s/C), its dtypes, the
    kernel (of `device_type`'s attention, default the run's device: plan.py sizes a GPU from a meta build). FP8's GEMM
    runs on torch._scaled_mm where the run's device has FP8 tensor cores (compute capability >= 8.9, as fp8.py decides),
    emulated elsewhere (an A100 too); a plan's GPU is a preset that has them."""
    tensor_cores = fp8_scaling.has_fp8_tensor_cores(run.device) if device_type is None else None
    return shape_of(run.settings, run.config, device_type or run.device.type, run.compute_dtype, run.param_dtype,
                    fp8_tensor_cores=tensor_cores)


def shape_of(settings, config, device_type: str, compute_dtype, param_dtype,
             fp8_tensor_cores: bool | None = None) -> memory.ActivationShape:
    """activation_shape without a run (plan.py's search sizes layouts it never builds; a "cuda" device there is a
    GPU preset with FP8 tensor cores unless fp8_tensor_cores says otherwise)."""
    cp_impl = settings.args.cp_impl if settings.shape.cp > 1 else None
    # CP's attention (the ring, or SDPA on whole sequences inside Ulysses) runs without dropout (refused); a plan's
    # --attention-kernel is the kernel it assumes (math: Megatron's unfused softmax and dropout, bench_calibration).
    planned = getattr(settings.args, "attention_kernel", None)
    kernel = "fused" if cp_impl else planned or memory.attention_kernel(device_type, compute_dtype, config.dropout)
    fp8 = settings.args.fp8
    tensor_cores = device_type == "cuda" if fp8_tensor_cores is None else fp8_tensor_cores
    emulated = fp8 is not None and (not tensor_cores or fp8 == "blockwise")  # FP8's GEMM: an mm in fp32 or wider
    return memory.ActivationShape(
        s=settings.seq_len // settings.shape.cp, b=settings.micro_batch_size, h=config.n_embd, a=config.n_head,
        vocab=config.vocab_size, t=settings.shape.tp, sp=settings.sequence_parallel,
        e_r=param_dtype.itemsize, e_c=compute_dtype.itemsize, dropout=config.dropout > 0,
        bool_masks=device_type == "cuda", fp32_norms=device_type == "cuda" and compute_dtype.itemsize < 4,
        kernel=kernel, ulysses=cp_impl == "ulysses", fp8=fp8 is not None,
        regather=fp8 is None,  # FP8 keeps the gathered input (fp8.convert)
        e_g=max(compute_dtype.itemsize, 4) if emulated else 0)


def activation_estimate(run, device_type: str | None = None) -> ActivationEstimate:
    """This rank's activations per micro-batch: its blocks, the embeddings and the head where it holds them,
    autocast's weight copies apart. Under activation checkpointing a block keeps its input only and backward
    rebuilds one block at a time (selective recompute: its input and GEMM outputs); under PP the schedule keeps
    `schedules.in_flight` chunk-micro-batches of this rank's program alive, each counted as 1/v of the stage
    (exact for v = 1); under ZeRO-3 the units the forward leaves gathered (zero3_saved_weights)."""
    model, layer_ids = run.model, [block.layer_id for block in run.model.transformer.h]
    in_flight, chunks, local_chunks = 1, 1, None
    for pp in (axis.facts() for axis in run.axes if axis.name == "pp"):
        in_flight, chunks = schedules.in_flight(pp.programs[pp.rank])[0], pp.v
        local_chunks = pipeline_chunks(run.config.n_layer, pp.P, pp.v, pp.rank)
    x, ends, shape = activation_shape(run, device_type), (model.has_embedding, model.has_head), run.settings.shape
    slots = getattr(run.settings.args, "moe_replicas", 0)  # R/E physical experts a rank holds (experts/eplb.py)
    codes = fp8_scaling.per_tensor(getattr(run.settings.args, "fp8", None))  # fp8.ZeroWeightCodec's units
    gathered = (zero3_saved_weights(run.config, x, layer_ids, ends, shape.ep, shape.dp * shape.cp, local_chunks,
                                    slots, codes) if run.settings.args.zero == 3 else {})
    # A precision recipe's linears (precision.recipe.RecipeLinear) save the weight parameter itself: no copy.
    recipe = next((axis for axis in run.axes if axis.name == "precision"), None)
    ids = {int(name.split(".")[2]) for name in recipe.linears} & set(layer_ids) if recipe else set()
    moe_ids = [i for i in ids if experts_of(run.config).is_moe_layer(i)]
    copy_free = {"dense": len(ids) - len(moe_ids), "moe": len(moe_ids)}
    return estimate_of(run.config, x, layer_ids, ends, shape.ep, (in_flight, chunks), gathered, copy_free, slots)


def estimate_of(config, x: memory.ActivationShape, layer_ids: list, ends: tuple, ep: int,
                pipeline_flight: tuple = (1, 1), gathered: dict | None = None, copy_free=None,
                slots: int = 0) -> ActivationEstimate:
    """activation_estimate from the shapes: the blocks `layer_ids`, ends = (has embedding, has head), the
    expert-parallel size, pipeline_flight = (chunk-micro-batches in flight, v), `gathered` ZeRO-3's units the
    forward leaves saved, by name (zero3_saved_weights; none for other layouts), copy_free: {"dense" | "moe": how
    many of those blocks run their linears without autocast's weight copies} (a precision recipe's: it quantises
    the weight itself and saves the parameter, so 12h²·w/T fewer bytes a dense block, (N/E + S/T)·8h²·w a MoE
    block); slots: R with --moe-replicas (R/E experts a rank holds)."""
    copy_free = copy_free or {"dense": 0, "moe": 0}
    n_moe = sum(experts_of(config).is_moe_layer(layer_id) for layer_id in layer_ids)
    held = {"dense": len(layer_ids) - n_moe, "moe": n_moe}  # blocks of each kind on this rank
    n_blocks = sum(held.values())
    # A MoE layer's router and experts (uniform routing), and autocast's copies of the experts this rank holds
    # (whole on every TP rank).
    experts = moe_block_bytes(config, x, ep, slots) if n_moe else (0, 0)
    recomputed, recomputing = 0.0, config.activation_checkpointing or config.selective_recompute
    if config.activation_checkpointing:  # the inputs stay; backward rebuilds one block, its copies with it
        blocks = {f"{n_blocks} block inputs": memory.block_input_bytes(x) * n_blocks}
        rebuilt_x = replace(x, regather=False)
        rebuilt = block_bytes(rebuilt_x, moe_block_bytes(config, rebuilt_x, ep, slots) if n_moe else (0, 0))
        for kind in ("dense", "moe"):  # every block of a kind rebuilt without copies
            if held[kind] and copy_free[kind] >= held[kind]:
                rebuilt[kind] = (rebuilt[kind][0], 0.0)
        recomputed = max(sum(rebuilt[kind]) for kind in held if held[kind]) - memory.block_input_bytes(x)
    elif config.selective_recompute:  # the inputs, GEMM and collective outputs stay; a MoE block by halves
        blocks, recomputed = selective_blocks(config, x, held, ep, slots)
    else:
        each = block_bytes(x, experts)
        copies = sum((held[kind] - copy_free[kind]) * each[kind][1] for kind in held)
        blocks = {f"{n_blocks} blocks" + (f" ({n_moe} MoE)" if n_moe else ""):
                  sum(held[kind] * each[kind][0] for kind in held), "autocast weight copies": copies}
    terms = {**blocks, **(gathered or {ZERO3_GATHERED: 0.0}),
             "embeddings": memory.embedding_activation_bytes(x) if ends[0] else 0.0,
             "head and loss": memory.head_activation_bytes(x) if ends[1] else 0.0}
    hidden = memory.hidden_from_hooks(x, 0 if recomputing else n_blocks, ends[1], 0 if recomputing else n_moe,
                                      experts_of(config).shared_experts)
    in_flight, chunks = pipeline_flight
    how = (f"attention {x.kernel}" + (" (Ulysses)" if x.ulysses else "")
           + f", {x.e_r}-byte residual, {x.e_c}-byte compute" + (", FP8 linear inputs" if x.fp8 else "")
           + (f", {x.mask(x.e_c)}-byte dropout masks" if x.dropout else ", no dropout")
           + (", full recompute" if config.activation_checkpointing else "")
           + (", selective recompute" if config.selective_recompute else ""))
    return ActivationEstimate(forward=sum(terms.values()) / chunks, terms=terms, hidden=hidden / chunks,
                              in_flight=in_flight, chunks=chunks, recomputed=recomputed,
                              korthikanti=korthikanti_estimate(config, x, len(layer_ids), n_moe), how=how)


def selective_blocks(config, x: memory.ActivationShape, held: dict, ep: int, slots: int = 0) -> tuple:
    """(terms, the block backward rebuilds) under selective recompute: a dense block keeps its input and its GEMM and
    collective outputs (memory.selective_block_terms); a MoE block (model.Block) its attention side's alike
    (mlp=False) and its MoE side as without recompute, ln_2's input and statistics sbh'·e_n + 2·sb'·e_n and the
    router's and experts' bytes, less every GELU output and autocast's copies of their weights, recomputed (moe_act:
    R_e·4h·e_c routed, S·4h·M·e_c/T shared; the copies (N/E + S/T)·8h²·w: parallel/recompute.py). SP's column layers
    keep their gathered input under recompute (no regather). Under FP8 the experts' c_proj keeps its input's codes,
    never the GELU output, as without recompute (accounting/fp8_experts.py). The rebuild: a dense block, or a MoE
    block's attention side, less its input and what it reads of the cache (memory.selective_rebuild_shared)."""
    whole = replace(x, regather=False)  # SP's column layers keep their gathered input (the cache's, or saved)
    terms, every = memory.layer_activation_terms(whole), memory.layer_activation_terms(x)
    blocks, rebuilt = {}, []
    if held["dense"]:
        blocks.update({f"{held['dense']} {name}": value * held["dense"]
                       for name, value in memory.selective_block_terms(x).items()})
        rebuilt.append(sum(block_bytes(whole, (0, 0))["dense"]) - memory.selective_rebuild_shared(x))
    if held["moe"]:
        n = held["moe"]
        blocks.update({f"{n} MoE attention sides' {name}": value * n
                       for name, value in memory.selective_block_terms(x, mlp=False).items()})
        routed, _ = moe_block_bytes(config, whole, ep, slots, gelu_outputs=x.fp8)  # FP8 keeps codes instead
        blocks[f"{n} MoE sides (ln_2, router, experts; GELU outputs recomputed)"] = n * (every["layernorms"] / 2
                                                                                         + routed)
        rebuilt.append(terms["layernorms"] / 2 + terms["attention"] + terms["attention weight copies"]
                       - memory.selective_rebuild_shared(x, mlp=False))
    return blocks, max(rebuilt) - memory.block_input_bytes(x)


def pipeline_chunks(n_layer: int, P: int, v: int, pp_rank: int) -> list:
    """[(layer ids, has the embedding, has the head)] of each chunk pp rank p holds (schedules.rank_chunks)."""
    return [(list(schedules.stage_layers(n_layer, P, v, c)), c == 0, c == P * v - 1)
            for c in schedules.rank_chunks(pp_rank, P, v)]


def zero3_saved_weights(config, x: memory.ActivationShape, layer_ids: list, ends: tuple, ep: int, dp_cp: int,
                        chunks: list | None = None, slots: int = 0, fp8_codes: bool = False) -> dict:
    """ZeRO-3's gathered weights that a forward's saved tensors still reference when it ends, by name: b_w = e_r
    bytes per element of each unit, padded to n' = ⌈n/D⌉·D (parallel/zero3.py); a saved weight is a view of its unit's
    storage, so the whole unit counts once. Dense units sync over dp_cp (D·C ranks), experts over expert_dp (D·C/E).
    A checkpointed block (full or selective) saves no weight: its recompute does, inside backward; but a MoE block
    under selective recompute runs its MoE side once (model.Block), and that side's ops save their weights.

    Without a pipeline (parallel/zero3.py: a unit per block, one for the root): the root's (embeddings, ln_f, the tied
    head: the head gathered it again) and, without recompute, the last block's, which the schedule keeps gathered into
    backward. Every other block's saved weights are views of a unit freed after its forward (0 bytes until
    backward gathers it again).

    Under a pipeline (`chunks`: pipeline_chunks, parallel/zero_pipeline.py: one unit per chunk and group, the tied V·h/T
    copy a unit of its own) a chunk's forward runs with the chunk gathered, so its saved weights reference the
    chunk's whole unit — every block of it, not the last one only (the estimate counted only the last block:
    +25% at 2 blocks a chunk, +66% at 4 on the tiny preset in bf16, measured): per chunk, its dense unit (its
    blocks, wpe on the first chunk, ln_f on the last) unless every block is recomputed and it has no ln_f, its
    expert unit unless recomputed, and the tied copy on the last chunk only (the head's GEMM saves its weight;
    the first chunk's embedding saves the token ids, not the table). Named by what they hold; the total over the
    rank's v chunks (a forward is 1/v of it, as the other terms). fp8_codes (--fp8 current or delayed): the FP8
    linears' weights are units of their own (memory.fp8_weights) that no saved tensor references (a linear saves
    its weight's FP8 codes), so a chunk's dense and expert units count without them (counted with them: 2.8× the
    first forward's measured saved bytes on the tiny preset, P = 2, 2 blocks a chunk)."""
    def padded(numel: int, ranks: int) -> int:
        return -(-numel // ranks) * ranks

    def unit_bytes(counts: dict) -> float:
        experts = padded(counts["expert_dp"], max(1, dp_cp // ep)) if counts["expert_dp"] else 0
        return (padded(counts["dp_cp"], dp_cp) + experts) * x.e_r

    recomputing = config.activation_checkpointing or config.selective_recompute

    def saves_weights(layers) -> bool:  # some block of `layers` keeps weights for backward
        return not recomputing or config.selective_recompute and any(experts_of(config).is_moe_layer(i) for i in layers)

    if chunks is None or len(chunks) == 1 and chunks[0][1] and chunks[0][2]:  # no pipeline: parallel/zero3.py's units
        root = unit_bytes(memory.param_counts(config, x.t, ep, layers=[], embedding=ends[0], head=ends[1],
                                              slots=slots))
        last = 0.0 if not saves_weights(layer_ids[-1:]) else unit_bytes(
            memory.param_counts(config, x.t, ep, layers=layer_ids[-1:], embedding=False, head=False,
                                 slots=slots))
        return {ZERO3_GATHERED: root + last}
    tied = config.vocab_size * x.h // x.t
    blocks, head = 0.0, 0.0
    for layers, embedding, has_head in chunks:
        counts = memory.param_counts(config, x.t, ep, layers, embedding, has_head, slots=slots)
        codes = memory.fp8_weights(config, x.t, ep, layers, slots) if fp8_codes else {}
        dense, experts = (counts[g] - codes.get(g, (0, 0))[0] for g in ("dp_cp", "expert_dp"))
        if saves_weights(layers) or has_head:  # the dense unit: its blocks' weights, or ln_f's
            blocks += padded(dense - tied * (embedding + has_head), dp_cp) * x.e_r
        if experts and saves_weights(layers):
            blocks += padded(experts, max(1, dp_cp // ep)) * x.e_r
        head += padded(tied, dp_cp) * x.e_r if has_head else 0.0
    units = "each chunk's unit" if saves_weights(layer_ids) else "the last chunk's unit (ln_f saves)"
    return {f"{ZERO3_GATHERED}: {units}": blocks,
            f"{ZERO3_GATHERED}: the head's tied copy": head}


def moe_block_bytes(config, x: memory.ActivationShape, ep: int, slots: int = 0, gelu_outputs: bool = True) -> tuple:
    """(activations, autocast weight copies) of one MoE block's MLP: the router and routed experts (moe.py's
    terms, uniform routing; the experts whole on every TP rank, N/E on this one, R/E with R = `slots`) and the S
    shared experts (experts/shared.py: split by TP, their c_fc input a shard under SP unless the block is recomputed);
    without `gelu_outputs` (selective recompute's moe_act) no GELU output is kept."""
    tokens, router_bytes = x.s * x.b, max(4, x.e_r)
    routed = x.s * x.b // (x.t if x.sp else 1)
    whole_input = x.sp and not x.regather  # SP's c_fc keeps the gathered input (FP8, a recomputed block)
    shared_bytes = shared.saved_bytes(config, tokens, x.t, x.e_c, router_bytes, tokens if whole_input else routed,
                                      True if whole_input else None, x.fp8, gelu_outputs)
    # (held routed, TP's share of shared) 8h²
    weights = (slots or config.moe.experts) // ep + config.moe.shared_experts / x.t
    copies = 0 if x.fp8 else weights * 8 * x.h * x.h * x.weight_copy
    fp8 = fp8_experts.saved_bytes_delta(routed, config.moe.topk, config.moe.experts, x.h, x.e_c) if x.fp8 else 0
    return (moe_costs.layer_activation_bytes(config, routed, x.e_c, router_bytes,
                                       mask_bytes=1 if x.bool_masks else max(x.e_c, x.e_r), ep=ep,
                                             gelu_outputs=gelu_outputs) + shared_bytes + fp8,
            copies)


def block_bytes(x: memory.ActivationShape, experts: tuple) -> dict:
    """{"dense" | "moe": (activations, autocast weight copies)} of one block of each kind (mfu's terms). A MoE
    block keeps its attention and LayerNorms, and `experts` (its router's and experts' bytes, their copies)
    instead of the dense MLP's."""
    terms = memory.layer_activation_terms(x)
    attention = terms["layernorms"] + terms["attention"]
    return {"dense": (attention + terms["mlp"], terms["attention weight copies"] + terms["mlp weight copies"]),
            "moe": (attention + experts[0], terms["attention weight copies"] + experts[1])}


def korthikanti_estimate(config, x: memory.ActivationShape, blocks: int, n_moe: int) -> float:
    """Korthikanti et al. 2022 for this rank's blocks and micro-batch (16-bit; a MoE block's experts by
    moe_costs.activation_estimate_delta); under activation checkpointing the block inputs, 2·s·b·h each
    (/T with SP), and one layer recomputed."""
    checkpointing = config.activation_checkpointing
    per_layer = memory.activation_bytes_per_layer(x.s, x.b, x.h, x.a, t=x.t, sequence_parallel=x.sp)
    experts = moe_costs.activation_estimate_delta(config, min(1, n_moe) if checkpointing else n_moe, x.s, x.b, x.t,
                                            x.sp) if n_moe else 0
    if not checkpointing:
        return per_layer * blocks + experts
    return 2 * x.s * x.b * x.h // (x.t if x.sp else 1) * blocks + per_layer + experts
