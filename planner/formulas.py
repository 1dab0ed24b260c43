"""A pipeline stage's Role from the start-up's own pure formulas, without building: what --plan-search sizes.

It gives each pipeline stage's time_model.Role from the formulas the start-up prints (memory.persistent_bytes per
data-parallel group, zero.ZeroLayout's units and transients as `grad_sync_messages` and `_formula_temporaries` count
them, under a pipeline parallel/zero_pipeline.py's units per chunk (`chunk_units`, `_formula_zero_pipeline`: the
action list's gathers and transient by zero_pipeline's own functions), DiLoCo's outer state and Δ all-reduce
(`_formula_diloco`), --fp8's amax all-reduces (`_formula_fp8`) and, under ZeRO-3, its weights gathered as E4M3 codes
in units of their own with each gather's scale agreement (memory.fp8_weights, `codec_messages`; a precision recipe's
NVFP4 weights likewise as E2M1 codes with their tiles' amaxes, `codec_weights`), tensor_parallel.step_messages,
context_parallel.layer_messages, dispatch.step_messages, activations.estimate_of, schedules.bubble_formula and
p2p_counts, mfu.flops_per_token), which time_model.predict prices. --moe-replicas R is kept as given (the E that
R/E slots fit: eplb.check_flags): R/E experts a block, eplb.step_messages' gradient sum, loads and re-plan windows.
Building a role on meta takes about a second for a large model, too slow for thousands of layouts;
tests/planner/test_plan.py checks that these figures equal --plan's built ones (dense, CP, EP and replicas layouts,
ZeRO-2/3 under 1F1B and interleaving, FP8 under ZeRO-2/3 with and without a pipeline, DiLoCo). Under --fp8 current
the slots reduce no amax; under delayed each logical expert's history rolls over dp×cp (precision/fp8_replicas.py).
planner/search.py enumerates the layouts and ranks them with these roles; bench/bench_calibration.py's held-out
rows are planned with them in its test.

Accounting for this file: it allocates nothing and sends nothing (shapes and formulas only).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

from accounting import activations, memory, moe_memory
import context_parallel
import ddp
from experts import dispatch, eplb, router
import mfu
from parallel import offload, schedules, zero_pipeline
from precision import fp8_scaling
import precision.recipe
import report.axes
import step
import tensor_parallel
import zero
from mesh import MeshShape, groups_of
from planner.time_model import P2P_BUFFERS, PLANNED_DEVICE, Role, plan_dtypes
from step import Messages


class ScheduleFacts:
    """What a schedule sets per pp rank, for (schedule, P, m, v), each computed on first use and kept (the
    search's layouts share them, read only): `flight(p)`, rank p's chunk-micro-batches in flight
    (schedules.in_flight_formula, no list built); `live(p)`, its sent buffers alive at once (schedules.live_sends_of:
    the communication plan's simulation of every rank, the costly part, of at most 3P + m mod P micro-batches,
    shared by the m that reduce to them); from its action list, built once and not kept (2·v·m actions a rank):
    `first_chunk(p)`, its first action's chunk, `runs(p, chunk)`, zero_pipeline.gather_runs, and `alive(p, stage)`,
    zero_pipeline.alive_chunks; and `pairs`,
    {(src, dst): messages per step}, in closed form: every micro-batch crosses each of the P·v − 1 chunk boundaries
    once forward (its activation) and once backward (its gradient) in any schedule (schedules.p2p_counts counts
    them from the lists: tests/planner/test_search.py checks the two agree)."""

    def __init__(self, schedule: str, P: int, m: int, v: int):
        self.schedule, self.P, self.m, self.v = schedule, P, m, v if schedule == "interleaved" else 1
        self.pairs = {}
        for chunk in range(P * self.v - 1):
            for pair in ((chunk % P, (chunk + 1) % P), ((chunk + 1) % P, chunk % P)):
                self.pairs[pair] = self.pairs.get(pair, 0) + m
        self._lists = {}  # p → (first chunk, {chunk: gather runs}, {ZeRO stage: alive chunks}) of rank p's list

    def _list(self, p: int) -> tuple:
        if p not in self._lists:
            program = schedules.BUILDERS[self.schedule](self.P, self.m, p, self.v)
            chunks = schedules.rank_chunks(p, self.P, self.v)
            self._lists[p] = (program[0].chunk, {c: zero_pipeline.gather_runs(program, c) for c in chunks},
                              {stage: zero_pipeline.alive_chunks(program, stage) for stage in (2, 3)})
        return self._lists[p]

    def first_chunk(self, p: int) -> int:
        return self._list(p)[0]

    def runs(self, p: int, chunk: int) -> int:
        return self._list(p)[1][chunk]

    def flight(self, p: int) -> int:
        return schedules.in_flight_formula(self.schedule, self.P, self.m, p, self.v)

    def live(self, p: int) -> int:
        return schedules.live_sends_of(self.schedule, self.P, self.m, self.v)[p]

    def alive(self, p: int, stage: int) -> set:
        return self._list(p)[2][stage]


@functools.lru_cache(maxsize=1024)
def schedule_facts(schedule: str, P: int, m: int, v: int) -> ScheduleFacts:
    """The schedule's ScheduleFacts, cached (the search meets each key many times; they keep no action list)."""
    return ScheduleFacts(schedule, P, m, v)


def stage_holding(config, P: int, v: int, p: int) -> tuple:
    """([layer ids], has embedding, has head) of pp rank p (pipeline.stage_kwargs's split)."""
    chunks = schedules.rank_chunks(p, P, v)
    layer_ids = [i for c in chunks for i in schedules.stage_layers(config.n_layer, P, v, c)]
    return layer_ids, 0 in chunks, P * v - 1 in chunks


_HELD = {}  # stage_params' results without a codec, by (the config's repr, T, E, P, v, p, slots): read only


def stage_params(config, shape: MeshShape, v: int, p: int, slots: int = 0, codec_settings=None) -> dict:
    """pp rank p's parameters by the shapes (memory.param_counts of what it holds, T and E as the shape says),
    per data-parallel group ("dp_cp": dense, "expert_dp": experts): "blocks" each held block's, "root" the
    embedding's (first chunk) and ln_f's and the head's tied copy (last chunk), "replicated" what TP replicates
    (the SP gradient sum's), "moe_replicated" the routers' and this rank's experts (MoE's own SP sum,
    dispatch.step_messages). "runs": (group, elements) in registration order, adjacent tensors of one group
    together (a bucket or ZeRO unit never spans two groups). slots: R with --moe-replicas (R/E experts a block).
    codec_settings: the run's settings where it has a gather codec (None: none): "codec_blocks", each held block's
    weights ZeRO-3 gathers as codes, (elements, tensors) per group (under --fp8 also the FP8 linears _formula_fp8
    counts)."""
    key = (repr(config), shape.tp, shape.ep, shape.pp, v, p, slots)
    if codec_settings is None and key in _HELD:  # the search asks again for every ZeRO stage, micro-batch, ...
        return _HELD[key]
    layer_ids, embedding, head = stage_holding(config, shape.pp, v, p)

    def held(layers, embedding: bool = False, head: bool = False) -> dict:
        return memory.param_counts(config, shape.tp, shape.ep, layers, embedding, head, slots)

    whole = held(layer_ids, embedding, head)
    first = held([], embedding)["dp_cp"]
    last = held([], embedding, head)["dp_cp"] - first
    blocks, runs = {"dp_cp": [], "expert_dp": []}, [["dp_cp", first]]
    for layer_id in layer_ids:
        block = held([layer_id])
        blocks["dp_cp"].append(block["dp_cp"])
        blocks["expert_dp"].append(block["expert_dp"])
        runs[-1][1] += block["dp_cp"]
        runs += [["expert_dp", block["expert_dp"]], ["dp_cp", 0]] if block["expert_dp"] else []
    runs[-1][1] += last
    local = {"dp_cp": whole["dp_cp"], "expert_dp": whole["expert_dp"]}
    codec_blocks = {group: [codec_weights(codec_settings, [layer])[group] for layer in layer_ids]
                    for group in local} if codec_settings is not None else None
    held = dict(layer_ids=layer_ids, codec_blocks=codec_blocks, embedding=embedding, head=head, layers=len(layer_ids),
                blocks=blocks, root=first + last, local=local, total=whole["per_rank"], runs=[r for r in runs if r[1]],
                replicated=whole["replicated"], moe_replicated=whole["router"] + whole["expert_dp"],
                block=max((sum(x) for x in zip(*blocks.values())), default=0))
    if codec_settings is None:
        _HELD[key] = held
    return held


@dataclass(frozen=True)
class _Stage:
    """What the formulas of pp rank p (d, c, t = 0) share: the flags, its parameters, the bytes per element."""

    settings: object
    p: int
    v: int  # model chunks per pp rank (--pp-virtual under the interleaved schedule, else 1)
    held: dict  # stage_params: this rank's parameters, per data-parallel group
    sizes: dict  # {group: D_g}: "dp_cp" (dense), "expert_dp" (experts)
    compute: object  # the dtypes of the activations and of the working weights (plan_dtypes)
    param: object
    b_w: int  # bytes of a working weight
    b_c: int  # of an activation
    b_m: int  # of a master weight or an Adam moment
    b_g: int  # of a held gradient: ZeRO with m > 1 sums the micro-batches in the master dtype
    b_r: int  # of what the gradient reduction sends
    fp8: str | None = None  # --fp8 current or delayed (_formula_fp8's; their weights: units of their own, ZeRO-3)
    codec: str | None = None  # ZeRO-3's gather codec: "e4m3" (--fp8 current, delayed), "nvfp4" (a recipe's)


def _stage_of(settings, p: int) -> _Stage:
    args, shape, m = settings.args, settings.shape, settings.micro_batches
    C, stage = shape.cp, args.zero
    v = args.pp_virtual if args.pp_schedule == "interleaved" and shape.pp > 1 else 1
    _, compute, param, master = plan_dtypes(settings)
    b_w, b_m = param.itemsize, master.itemsize
    b_g = b_w if m == 1 or stage == 0 else b_m
    summed_once = stage == 1 or stage >= 2 and shape.pp > 1  # parallel/zero_pipeline.py sends the step's sum, once
    D = shape.replica_dp  # DiLoCo: the layout's groups stay inside a replica of D/R data ranks
    codec = gather_codec(settings)
    return _Stage(settings, p, v, held=stage_params(settings.model, shape, v, p, args.moe_replicas,
                                                    settings if codec else None),
                  sizes={"dp_cp": D * C, "expert_dp": D * C // shape.ep}, compute=compute, param=param,
                  b_w=b_w, b_c=compute.itemsize, b_m=b_m, b_g=b_g, b_r=b_g if summed_once else b_w,
                  fp8=args.fp8 if codec == "e4m3" else None, codec=codec)


def gather_codec(settings) -> str | None:
    """ZeRO-3's gather codec of the block linears' weights: "e4m3" under --fp8 current or delayed
    (fp8.ZeroWeightCodec; blockwise has none), "nvfp4" under a precision recipe whose one 16×16 NVFP4 quantisation
    serves both GEMMs (recipe_codec.ZeroWeightCodec), else None."""
    args = settings.args
    if fp8_scaling.per_tensor(args.fp8):
        return "e4m3"
    recipe = args.precision_recipe and precision.recipe.parse_recipe(args.precision_recipe)
    return "nvfp4" if recipe and recipe.gathers_codes else None


def codec_weights(settings, layers) -> dict:
    """{group: (elements, tensors)} of the weights in `layers` that ZeRO-3 gathers as 1-byte codes in units of their
    own (zero3.by_group_and_codec): the block linears' (memory.fp8_weights: every nn.Linear but the router), under a
    precision recipe only the blocks before its tail (precision.recipe.convert keeps the last ⌈F·n_layer⌉ precise)."""
    config, shape, slots = settings.model, settings.shape, settings.args.moe_replicas
    layers = recipe_layers(settings, layers) if gather_codec(settings) == "nvfp4" else layers
    return memory.fp8_weights(config, shape.tp, shape.ep, layers, slots)


def recipe_layers(settings, layers) -> list:
    """Of `layers`, those a precision recipe quantises: the blocks before its tail (precision.recipe.convert keeps
    the last ⌈F·n_layer⌉ in the compute dtype)."""
    n_layer = settings.model.n_layer
    first_kept = n_layer - precision.recipe.parse_recipe(settings.args.precision_recipe).tail_layers(n_layer)
    return [layer for layer in layers if layer < first_kept]


def amax_groups(shape: MeshShape) -> list:
    """The groups an amax is MAX-reduced over (the ranks holding pieces of one logical tensor): cp and tp, each
    of size > 1 (fp8.Fp8Linear's and precision.recipe.RecipeLinear's amax_groups)."""
    return [name for name, size in (("cp", shape.cp), ("tp", shape.tp)) if size > 1]


def _formula_precision(s: _Stage) -> Messages:
    """precision.recipe.PrecisionHandle.predicted_messages from the held blocks before the recipe's tail: per dense
    linear (memory.fp8_weights' dp_cp tensors; routed experts reduce none) and micro-batch over cp and tp (each of
    size > 1), forward 8 bytes when fwd = nvfp4 (twice under activation checkpointing), backward 16 when bwd = nvfp4."""
    settings, out = s.settings, Messages()
    recipe = precision.recipe.parse_recipe(settings.args.precision_recipe)
    config, shape = settings.model, settings.shape
    held = recipe_layers(settings, s.held["layer_ids"])
    calls = memory.fp8_weights(config, shape.tp, shape.ep, held)["dp_cp"][1] * settings.micro_batches
    for group in amax_groups(shape) if calls else []:
        if recipe.fwd == "nvfp4":
            forwards = calls * (2 if config.activation_checkpointing else 1)
            out.add("all_reduce", group, forwards, 8 * forwards)
        if recipe.bwd == "nvfp4":
            out.add("all_reduce", group, calls, 16 * calls)
    return out


def formula_role(settings, p: int, facts: ScheduleFacts | None = None, sends_alive: bool = True) -> Role:
    """pp rank p's (d, c, t = 0) Role from the formulas the start-up prints (facts: schedule_facts, cached):
    the persistent bytes, the messages (the data-parallel ones, each axis's, the pipeline's), the activations,
    and the figures the time model reads (bubble, last bucket, first gather, boundary). sends_alive=False counts
    one receive buffer and no send among the pipeline's temporaries: a lower bound of the peak that spares the
    communication plan's simulation (planner/search.py's first look at a layout)."""
    config, shape, s = settings.model, settings.shape, _stage_of(settings, p)
    if shape.pp > 1:
        facts = facts or schedule_facts(settings.args.pp_schedule, shape.pp, settings.micro_batches, s.v)
    chunked = shape.pp > 1 and settings.args.zero >= 2  # parallel/zero_pipeline.py's units per chunk
    persistent = _formula_persistent(s)
    if chunked:
        messages, temporaries, last_bucket, first_gather, persistent = _formula_zero_pipeline(s, facts)
    else:
        messages, temporaries, last_bucket, first_gather = _formula_data_parallel(s)
    messages = _formula_axis_messages(s, messages, temporaries)
    flight, bubble, boundary = _formula_pipeline(s, messages, temporaries, facts, sends_alive)
    persistent, notes = _formula_diloco(s, messages, persistent)
    rank, ranks, alias = _formula_groups(shape, p)
    x = activations.shape_of(settings, config, PLANNED_DEVICE, s.compute, s.param)
    ends = (s.held["embedding"], s.held["head"])
    chunks = activations.pipeline_chunks(config.n_layer, shape.pp, s.v, p) if shape.pp > 1 else None
    slots = settings.args.moe_replicas
    gathered = (activations.zero3_saved_weights(config, x, s.held["layer_ids"], ends, shape.ep, shape.dp * shape.cp,
                                                chunks, slots, s.fp8 is not None) if settings.args.zero == 3 else {})
    return Role(rank=rank, coords=shape.coords(rank), local_params=s.held["total"], logical={},
                persistent=persistent,
                activations=activations.estimate_of(config, x, s.held["layer_ids"], ends, shape.ep, flight, gathered,
                                                    slots=slots),
                temporaries=temporaries, messages=messages.named(lambda name: alias.get(name, name)),
                group_ranks=ranks, notes=notes,
                flops=_flops(config, settings.seq_len, x.kernel),
                bubble=bubble, last_bucket=last_bucket, first_gather=first_gather, boundary_bytes=boundary,
                layer_share=s.held["layers"] * shape.pp / config.n_layer,
                head_share=shape.pp if s.held["head"] else 0.0, offload=_formula_offload(s))


_FLOPS = {}  # mfu.flops_per_token of the whole model, by (the config's repr, s, kernel): the search asks per stage


def _flops(config, seq: int, kernel: str) -> mfu.FlopsPerToken:
    key = (repr(config), seq, kernel)
    if key not in _FLOPS:
        _FLOPS[key] = mfu.flops_per_token(memory.param_counts(config), config, seq, kernel)
    return _FLOPS[key]


def with_sends_alive(role: Role, facts: ScheduleFacts, p: int) -> Role:
    """A role that formula_role sized with sends_alive=False, its pipeline buffers completed: the receive and
    the sends alive at once (_formula_pipeline's)."""
    temporaries = dict(role.temporaries)
    temporaries[P2P_BUFFERS] = (1 + facts.live(p)) * role.boundary_bytes
    return replace(role, temporaries=temporaries)


def stage_roles(settings) -> list:
    """Every pp rank's Role (d = c = t = 0) from the formulas (formula_role), the schedule's facts computed once."""
    args, shape = settings.args, settings.shape
    v = args.pp_virtual if args.pp_schedule == "interleaved" and shape.pp > 1 else 1
    facts = schedule_facts(args.pp_schedule, shape.pp, settings.micro_batches, v) if shape.pp > 1 else None
    return [formula_role(settings, p, facts) for p in range(shape.pp)]


def _formula_persistent(s: _Stage) -> dict:
    """DDPLayout's (fp32 params, grads, moments) or ZeroLayout.bytes_per_param's persistent bytes, per group
    (offload.OffloadZeroLayout's: the optimizer bytes that stay on the device)."""
    mode = getattr(s.settings.args, "offload", None)
    b_o = offload.optimizer_stays(s.b_w, s.b_m, mode == "optimizer+master") if mode else (
        2 * s.b_m + (0 if s.b_w == s.b_m else s.b_m))
    bpp = zero.BytesPerParam(s.b_w, s.b_g, b_o)
    stage = s.settings.args.zero
    parts = [memory.persistent_bytes(n, bpp, stage, s.sizes[g]) for g, n in s.held["local"].items() if n]
    return {kind: sum(part[kind] for part in parts) for kind in parts[0]}


def _formula_offload(s: _Stage):
    """--offload: offload.figures of this rank's shard, S = Σ_g Ψ_g / D_g (its layout's units); None without."""
    mode = getattr(s.settings.args, "offload", None)
    if not mode:
        return None
    S = sum(n / s.sizes[g] for g, n in s.held["local"].items() if n)
    return offload.figures(S, s.b_w, s.b_m, s.b_g, mode == "optimizer+master")


def _formula_data_parallel(s: _Stage) -> tuple:
    """(messages, temporaries, last bucket, first gather) of the layout: DDP's or ZeRO's gradient reduction
    and gathers, its transients, the piece sent after backward, what ZeRO-3 gathers before block 0 starts."""
    args, config, held, stage, b_w = s.settings.args, s.settings.model, s.held, s.settings.args.zero, s.b_w
    T, P = s.settings.shape.tp, s.settings.shape.pp
    bucket = args.bucket_mb * 2**20
    tied = P * s.v > 1 and (held["embedding"] or held["head"])  # the tied copy: a unit of its own at ZeRO-1
    m, codecs = s.settings.micro_batches, held["codec_blocks"] if stage == 3 else None
    messages = grad_sync_messages(held, s.sizes, stage, m, (b_w, s.b_r), bucket, tied, codecs)
    for group, blocks in (codecs or {}).items():  # each gather's scale agreement (the last block gathered once)
        for i, weights in enumerate(blocks):
            if weights[1]:
                messages = messages + codec_messages(s, group, weights).times(m * (2 - (i == len(blocks) - 1)))
    last_bucket = s.b_r * (held["root"] if stage == 3 else min(held["total"], bucket / b_w)) if stage else \
        min(ddp.TAPER_BYTES, 4 * held["total"])  # DDP: the taper's last bucket
    first_gather = b_w * (held["root"] + held["block"]) if stage == 3 else 0.0
    largest = max(4 * config.n_embd ** 2 // T, config.vocab_size * config.n_embd // T if held["root"] else 0)
    temporaries = _formula_temporaries(stage, held, s.sizes, (b_w, s.b_r), max(bucket, 4 * largest))
    return messages, temporaries, last_bucket, first_gather


def chunk_units(s: _Stage) -> dict:
    """{global chunk: [(group, n')]} of pp rank p under ZeRO-2/3 with a pipeline (zero_pipeline._build_units): per
    local chunk its dense unit (its blocks, wpe on chunk 0, ln_f on the last), its experts' unit, and the tied
    V·h/T copy alone where the chunk holds the embedding or the head; each padded to n' = ⌈n/D_g⌉·D_g."""
    config, shape, slots = s.settings.model, s.settings.shape, s.settings.args.moe_replicas
    tied = config.vocab_size * config.n_embd // shape.tp
    out = {}
    for chunk, (layers, embedding, head) in zip(schedules.rank_chunks(s.p, shape.pp, s.v),
                                                 activations.pipeline_chunks(config.n_layer, shape.pp, s.v, s.p)):
        counts = memory.param_counts(config, shape.tp, shape.ep, layers, embedding, head, slots)
        codes = codec_weights(s.settings, layers) if s.codec else {}
        dense, experts = codes.get("dp_cp", (0, 0)), codes.get("expert_dp", (0, 0))
        units = [("dp_cp", counts["dp_cp"] - tied * (embedding + head) - dense[0], (0, 0)), ("dp_cp", dense[0], dense),
                 ("expert_dp", counts["expert_dp"] - experts[0], (0, 0)), ("expert_dp", experts[0], experts),
                 ("dp_cp", tied if embedding or head else 0, (0, 0))]
        out[chunk] = [(g, -(-n // s.sizes[g]) * s.sizes[g], w) for g, n, w in units if n]
    return out


def codec_messages(s: _Stage, group: str, weights: tuple) -> Messages:
    """One gather's scale agreement of `weights` (elements, tensors) (the codecs' encode_messages): a MAX
    all_reduce over the gathering group (D_g > 1) of 4 bytes per tensor (FP8's amaxes) or, NVFP4, of its tiles'
    and tensor amaxes, elements/256 + tensors values of 8 bytes (float64 weights) or 4 (the widths are multiples
    of 16: precision.recipe.config_from_flags); then, for the dense linears, 4 bytes per tensor over
    their amax groups cp and tp (each of size > 1; a routed expert is whole on its rank: none)."""
    shape, out, (elements, tensors) = s.settings.shape, Messages(), weights
    if s.sizes[group] > 1:
        width = 8 if s.b_w == 8 else 4
        out.add("all_reduce", group, 1, width * (elements // 256 + tensors) if s.codec == "nvfp4" else 4 * tensors)
    for name in amax_groups(shape) if group == "dp_cp" else []:
        out.add("all_reduce", name, 1, 4 * tensors)
    return out


def _formula_zero_pipeline(s: _Stage, facts: ScheduleFacts) -> tuple:
    """(messages, temporaries, last bucket, first gather, persistent) of ZeRO-2/3 under a pipeline
    (parallel/zero_pipeline.py, from pp rank p's action list): per unit one reduce_scatter of the step's sum (b_g·n'),
    stage 2 one all_gather of the update (b_w·n'), stage 3 one all_gather per run of the chunk's actions
    (zero_pipeline.gather_runs); the transient of zero_pipeline.step_transient_bytes (stage 2: or the update's
    all-gather inputs, the larger); the last piece reduced is the first local chunk's, the first gathered the first
    action's chunk (stage 3)."""
    stage, b_w, b_a = s.settings.args.zero, s.b_w, s.b_g
    units = chunk_units(s)
    messages = Messages()
    for chunk, pieces in units.items():
        runs = facts.runs(s.p, chunk) if stage == 3 else 1
        for group, n, weights in pieces:
            codec = stage == 3 and weights[1]  # weights with a codec: 1-byte codes, one scale agreement per gather
            if codec:
                messages = messages + codec_messages(s, group, weights).times(runs)
            if s.sizes[group] > 1:
                messages.add("all_gather_single", group, runs, runs * (1 if codec else b_w) * n)
                messages.add("reduce_scatter_single", group, 1, s.b_r * n)
    if s.sizes["dp_cp"] > 1:
        messages = messages + step.scalar_messages()
    numel = {chunk: sum(n for _, n, _ in pieces) for chunk, pieces in units.items()}
    transient = zero_pipeline.transient_of(facts.alive(s.p, stage), {c: b_w * n for c, n in numel.items()},
                                           {c: b_a * n for c, n in numel.items()})
    if stage == 2:
        transient = max(transient, b_w * sum(n // s.sizes[g] for pieces in units.values() for g, n, _ in pieces))
    bpp = zero.BytesPerParam(b_w, b_a, 2 * s.b_m + (0 if b_w == s.b_m else s.b_m))
    held = {group: sum(n for pieces in units.values() for g, n, _ in pieces if g == group) for group in s.sizes}
    parts = [memory.persistent_bytes(held[group], bpp, stage, size) for group, size in s.sizes.items()]
    persistent = {kind: sum(part[kind] for part in parts) for kind in parts[0]}
    temporaries = {f"ZeRO-{stage} transients (zero_pipeline.step_transient)": transient}
    first_gather = b_w * numel[facts.first_chunk(s.p)] if stage == 3 else 0.0
    return messages, temporaries, s.b_r * numel[min(numel)], first_gather, persistent


def _formula_axis_messages(s: _Stage, messages, temporaries: dict):
    """messages + TP's, CP's and MoE's per step; their buffers join temporaries."""
    settings, config, held, stage = s.settings, s.settings.model, s.held, s.settings.args.zero
    shape, m, micro, sp = settings.shape, settings.micro_batches, settings.micro_batch_size, settings.sequence_parallel
    C, T, E, ac, seq = shape.cp, shape.tp, shape.ep, config.activation_checkpointing, settings.seq_len // shape.cp
    n_moe = sum(map(bool, held["blocks"]["expert_dp"]))
    if T > 1:
        batch = tensor_parallel.BatchShape(micro, seq, m, s.b_w, s.b_c)
        regather = not (ac or config.selective_recompute or settings.args.fp8)  # as the built model's blocks
        holding = tensor_parallel.Holding(config.n_embd, sp, ac, held["layers"], n_moe, held["embedding"],
                                          held["head"], regather)
        shard = s.sizes["dp_cp"] if stage else 1  # ZeRO: a shard, on average
        sp_bytes = s.b_g * held["replicated"] / shard if sp else 0
        messages = messages + tensor_parallel.step_messages(batch, holding, int(sp_bytes))
    if C > 1:
        layer = context_parallel.LayerShape(micro, settings.seq_len, config.n_embd // T, s.b_c, ac)
        per_layer = context_parallel.layer_messages(settings.args.cp_impl, C, layer)
        messages = messages + (per_layer["forward"] + per_layer["backward"]).times(held["layers"] * m)
        if settings.args.cp_impl == "ring":
            temporaries["ring CP: the K, V block in flight"] = 2 * 2 * micro * seq * config.n_embd // T * s.b_c
    if s.fp8:
        messages = messages + _formula_fp8(s)
    if settings.args.precision_recipe:
        messages = messages + _formula_precision(s)
    if n_moe:
        tokens, tp_sp = micro * settings.seq_len // (C * (T if sp else 1)), T if sp else 1
        replicas = settings.args.moe_replicas  # R physical slots (experts/eplb.py), 0: none
        traffic = dispatch.Traffic(config, n_moe, tokens, m, E, C, tp_sp, s.b_c, max(4, s.b_w), micro, replicas,
                                   settings.args.fp8, settings.args.precision_recipe is not None)
        shard = (s.sizes["expert_dp"] if stage else 1)  # ZeRO: this rank's shard of the experts' gradients
        sp_grad_bytes = int(s.b_g * held["moe_replicated"] / shard) if sp else 0
        messages = messages + dispatch.step_messages(traffic, sp_grad_bytes)
        groups = [name for name, size in (("dp_cp", shape.replica_dp * C), ("tp", tp_sp)) if size > 1]
        if config.moe.bias_rate > 0:  # the step's loads, summed over the batch's ranks (moe_router item 3)
            for message in router.load_messages(n_moe, config.moe.experts, groups):
                messages = messages + Messages().add(*message)
        if replicas:  # their gradient sum (ZeRO: the shards, in the accumulation dtype), loads, re-plans' windows
            expert_bytes = (s.b_g if stage else s.b_w) * memory.param_counts(config)["expert"]
            messages = messages + eplb.step_messages(
                n_moe, config.moe.experts, replicas, E, expert_bytes, "dp_cp" if stage else "ep", groups,
                replans=1 / settings.args.moe_replan_every if E > 1 else 0,
                shared_load_reduce=config.moe.bias_rate > 0)
        peak = moe_memory.rank_peak(traffic, activations.shape_of(settings, config, PLANNED_DEVICE, s.compute, s.param))
        temporaries[peak.temporary()] = peak.above_saved
    return messages


def _formula_fp8(s: _Stage) -> Messages:
    """fp8.Fp8Handle.predicted_messages from the held linears' counts (memory.fp8_weights' tensors): current, per
    dense linear and micro-batch over cp and tp a forward MAX all_reduce of 8 bytes (twice under activation
    checkpointing) and a backward one of 4; delayed, per step 12 bytes a linear over its gradient group and tp, in one
    call per set of groups (the dense linears' dp_cp, the routed experts' expert_dp; each of size > 1); with
    --moe-replicas 12 bytes a logical expert linear (2N a MoE layer) over dp_cp instead of the slots'."""
    shape, m, out = s.settings.shape, s.settings.micro_batches, Messages()
    linears = {group: sum(n for _, n in blocks) for group, blocks in s.held["codec_blocks"].items()}
    if s.fp8 == "current":
        calls = linears["dp_cp"] * m
        forwards = calls * (2 if s.settings.model.activation_checkpointing else 1)
        for group in amax_groups(shape):
            out.add("all_reduce", group, forwards, 8 * forwards).add("all_reduce", group, calls, 4 * calls)
        return out
    slots, config = s.settings.args.moe_replicas, s.settings.model
    if slots and linears.get("expert_dp"):  # fp8_replicas: a history per logical expert, 2N a layer, over dp_cp
        linears["dp_cp"] += linears.pop("expert_dp") * config.moe.experts * shape.ep // slots
    buckets = {}  # fp8.Fp8Handle.buckets: the linears' reduction groups → how many
    for group, count in linears.items():
        names = tuple(name for name, size in ((group, s.sizes[group]), ("tp", shape.tp)) if size > 1)
        buckets[names] = buckets.get(names, 0) + count
    for names, count in buckets.items():
        for name in names if count else ():
            out.add("all_reduce", name, 1, 12 * count)
    return out


def _formula_pipeline(s: _Stage, messages, temporaries: dict, facts: ScheduleFacts | None,
                      sends_alive: bool = True) -> tuple:
    """(in flight, bubble, boundary bytes) of pp rank p; its sends, receives and tied-embedding sum join
    messages, its p2p buffers temporaries (sends_alive=False: the receive's alone, formula_role's lower bound).
    Without a pipeline: one micro-batch of one chunk in flight."""
    settings, config, held, p, v = s.settings, s.settings.model, s.held, s.p, s.v
    args, P, T, m = settings.args, settings.shape.pp, settings.shape.tp, settings.micro_batches
    if P == 1:
        return (1, 1), 0.0, 0.0
    facts = facts or schedule_facts(args.pp_schedule, P, m, v)
    pairs, live = facts.pairs, facts.live(p) if sends_alive else 0
    seq = settings.seq_len // settings.shape.cp
    boundary = settings.micro_batch_size * seq // (T if settings.sequence_parallel else 1) * config.n_embd * s.b_w
    sends = sum(n for (src, _), n in pairs.items() if src == p)
    recvs = sum(n for (_, dst), n in pairs.items() if dst == p)
    messages.add("send", "pp", sends, sends * boundary).add("recv", "pp", recvs, recvs * boundary)
    messages.add("all_reduce", "pp", 1, 8)
    if held["embedding"] or held["head"]:
        tied_bytes = s.b_g * config.vocab_size * config.n_embd // T // (s.sizes["dp_cp"] if args.zero else 1)
        messages.add("all_reduce", "pp_tied", 1, tied_bytes)
    temporaries[P2P_BUFFERS] = (1 + live) * boundary
    return (facts.flight(p), v), schedules.bubble_formula(args.pp_schedule, P, m, v), boundary


def _formula_diloco(s: _Stage, messages, persistent: dict) -> tuple:
    """(persistent, notes): the update's norm all-reduce joins messages, over the world, or with DiLoCo over the
    replica (resilience/diloco.py), which then adds its outer state θ_start + b to the optimizer row, 2·Ψ_rank·b_o with
    b_o the parameters' dtype promoted to fp32, and its Δ all-reduce over `diloco`, Ψ_rank·b_o once per H steps."""
    config = s.settings.diloco
    if config is None:
        messages.add("all_reduce", "world", 1, 16)
        return persistent, ()
    messages.add("all_reduce", "replica", 1, 16)
    outer = s.held["total"] * max(s.b_w, 4)  # torch.promote_types(working dtype, fp32)
    messages.add("all_reduce", "diloco", 1 / config.inner_steps, outer / config.inner_steps)
    persistent = dict(persistent, optimizer=persistent["optimizer"] + 2 * outer, total=persistent["total"] + 2 * outer)
    shape = s.settings.shape
    return persistent, tuple(report.axes.diloco_lines(config, outer, shape.replica_dp, s.settings.args.global_batch))


@functools.lru_cache(maxsize=4096)
def _formula_groups(shape: MeshShape, p: int) -> tuple:
    """(global rank, {group: its ranks}, {group: its row name}) of pp rank p at d = c = t = 0: names of one
    communicator (the same ranks) are one row, as the tracer reports them (mesh.py). Cached: the search's layouts
    of one mesh share them (read only)."""
    rank = shape.rank_of(0, p, 0, 0)
    ranks = groups_of(shape, rank)
    aliases = {}
    for name, members in ranks.items():
        if len(members) > 1:
            aliases.setdefault(tuple(members), []).append(name)
    alias = {name: "=".join(names) for names in aliases.values() for name in names}
    ranks["world"] = list(range(shape.world_size))
    return rank, ranks, alias


def grad_sync_messages(held: dict, sizes: dict, stage: int, m: int, bytes_wr: tuple, bucket: float,
                       tied: bool, codecs: dict | None = None) -> Messages:
    """The layout's gradient reduction (and ZeRO's gathers) per step over each group of size > 1 (sizes:
    {group: D_g}; bytes_wr: (b_w, b_r)): DDP's tapered buckets (ddp.reverse_order_buckets), ZeRO-1/2's
    units of about `bucket` bytes (+ the tied copy's own), ZeRO-3's per block and the root
    (zero.ZeroLayout._gathers: a block twice per micro-batch, the last one once, the root twice; codecs, under
    gather_codec's e4m3 or nvfp4: {group: [(elements, tensors) of each block's coded weights]}, a unit of their own
    gathered as 1-byte codes, zero3.by_group_and_codec); plus the step's two scalars over dp_cp."""
    (b_w, b_r), out, cut = bytes_wr, Messages(), 0
    for group, nbytes in held["runs"]:
        if stage == 0 and sizes[group] > 1:
            count = _tapered_buckets(4 * nbytes, bucket, cut)
            out.add("all_reduce", group, count, 4 * nbytes)
            cut += count
    for group, local in held["local"].items():
        if stage == 0 or sizes[group] == 1 or not local:
            continue
        if stage < 3:
            units = sum(max(1, math.ceil(b_w * n / bucket)) for g, n in held["runs"] if g == group)
            units += tied and group == "dp_cp"
            out.add("all_gather_single", group, units, b_w * local)
        else:  # per block a unit per codec (the FP8 weights' apart: 1-byte codes), gathered twice (the last once)
            blocks, root = held["blocks"][group], held["root"] if group == "dp_cp" else 0
            fp8 = codecs[group] if codecs else [(0, 0)] * len(blocks)
            gathers = [2] * (len(blocks) - 1) + [1]
            pieces = [piece for (n, (codes, _)), g in zip(zip(blocks, fp8), gathers)
                      for piece in ((n - codes, b_w, g), (codes, 1, g))]  # (elements, bytes each, gathers)
            pieces = [piece for piece in pieces + [(root, b_w, 2)] if piece[0]]
            units = len(pieces)
            out.add("all_gather_single", group, m * sum(g for _, _, g in pieces),
                    m * sum(n * b * g for n, b, g in pieces))
        reduces = m if stage >= 2 else 1
        out.add("reduce_scatter_single", group, units * reduces, reduces * b_r * local)
    if sizes["dp_cp"] > 1:
        out = out + step.scalar_messages()
    return out


def _tapered_buckets(nbytes: float, bucket: float, cut: int = 0) -> int:
    """How many buckets ddp.reverse_order_buckets cuts nbytes into after `cut` others: caps 1, 2, 4, ... MiB
    up to `bucket`, then `bucket` each (counted at once where that is exact: a whole number of bytes; a 175B
    model's 700 GB in 25 MiB buckets took the loop a tenth of a second)."""
    count, covered = 0, 0.0
    while covered < nbytes and ddp.TAPER_BYTES * 2**min(cut + count, 64) < bucket:
        covered += ddp.TAPER_BYTES * 2**(cut + count)
        count += 1
    if covered < nbytes and float(bucket).is_integer() and float(nbytes).is_integer():
        return count + math.ceil((nbytes - covered) / bucket)
    while covered < nbytes:
        covered += bucket
        count += 1
    return max(count, 1)


def _formula_temporaries(stage: int, held: dict, sizes: dict, bytes_wr: tuple, bucket: float) -> dict:
    """zero.ZeroLayout.peak_lower_bound's transients (or DDP's one bucket in flight), from the shapes."""
    (b_w, b_r), largest_run = bytes_wr, max(n for _, n in held["runs"])
    if stage == 0:
        return {"DDP: one bucket in flight (the backend's staging)": min(bucket, 4 * largest_run)}
    shards = sum(n / sizes[g] for g, n in held["local"].items())
    if stage == 1:
        extra = max(b_r, b_w) * shards
    elif stage == 2:
        extra = max(2 * b_r * min(largest_run, bucket / b_w), b_w * shards)
    else:
        extra = 2 * b_w * held["block"] + b_r * (held["root"] + 2 * held["block"])
    return {f"ZeRO-{stage} transients (zero.peak_lower_bound)": extra}
