"""--plan and --plan-search: size a layout at any scale without its hardware, from the run's own accounting.

    python train.py --plan --world 1024 --preset gpt3-175b --tp 8 --pp 8 --global-batch 1536 --micro-batch 1
    python train.py --plan-search --world 64 --preset gpt3-13b --global-batch 512 --hw-memory-gib 80

--plan runs the real start-up of each distinct rank ROLE inside a fake process group
(torch.testing._internal.distributed.fake_pg: collectives return at once and move nothing) on meta tensors
(nothing allocated), then reads that role's predictions exactly where a real run's start-up reads them
(layout.predicted_persistent, report.predicted_messages, report.activation_estimate, the schedule's bubble):
one source of truth, so a real run's printed predictions and the plan of the same layout are the same numbers.
Roles: ranks that differ only by their data-parallel index d hold the same shapes and send the same messages.
The plan builds every pipeline stage (d, c, t) = (0, 0, 0) and the corner (0, C−1, T−1): every TP and CP
split is even (flags.py checks the divisibility), so the others equal their stage's role; when the corner
does not, every (p, c, t) is built. Start-up figures that a real run gets from a collective come from formulas
here (the fake group reduces nothing): Ψ is the sum of the logical tensors' sizes over the roles' records;
every rank is built from the same seed, so DDP's same-init check holds by construction.

Building on meta: train.compose(run, materialize=False), the real start-up with the model built on meta, every
axis cutting it there and the layout sized over it, no value ever computed.

The time model (hardware.py states the hardware): per role and step
    compute    t_c = FLOPs_hardware/token · tokens/step / world / peak(dtype)   (an even split over the ranks)
    update     2 · persistent bytes / HBM bandwidth                                 (memory-bound, exposed)
    each (collective, group) of the step: α-β time on the group's link (hardware.collective_seconds), then
    on the critical path by these rules (Megatron, ZeRO and ring-attention's own overlap claims):
      exposed: TP/SP (every f, g inside a layer waits on it), EP's and Ulysses' all-to-alls, the update's and
               the step's scalar all-reduces, FP8's amax reductions, the pipeline's loss and tied sums;
      DDP, ZeRO-1: the gradient reduction overlaps the last micro-batch's backward (≈ 2/3 of its compute)
               except its last bucket: exposed = t(last bucket) + max(0, t − t_backward);
      ZeRO-2/3: each micro-batch's reduce-scatter overlaps that micro-batch's backward, same rule, m times;
      ZeRO-1/2's all-gather after the update: exposed (it overlaps only the next unit's update);
      ZeRO-3's gathers are prefetched behind compute except the first (root + block 0) of each pass:
               exposed = m · [t(first) + max(0, t/m − t_compute/m)];
      ring CP: each hop's transfer hides behind its block's attention: exposed = max(0, t − t_attention);
      pipeline p2p: overlapped except in fill and drain: exposed = 2(P−1) · t(one message).
    bubble     b = pipeline's bubble_formula(schedule, P, m, v); the busy part (compute + the exposed
               in-layer communication) stretches by 1/(1 − b)
    step       (t_c + in-layer exposed) / (1 − b) + the exposed rest;  MFU = FLOPs_model · tokens / (world ·
               peak · step). The slowest role sets the pace.

--plan-search (plan_search.py) sizes layouts from the same formulas without building them.

Accounting for this file: it allocates nothing (meta tensors) and sends nothing (a fake process group).
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

import hardware
import memory
import mfu
import model as model_lib
import moe
import report
import schedules
import zero
from comm import Messages
from flags import DTYPES, FlagError
from mesh import MeshShape


# ---------------------------------------------------------------------------------------------------------
# One role's start-up, built on meta inside a fake process group
# ---------------------------------------------------------------------------------------------------------


PLANNED_DEVICE = "cuda"  # the hardware model's presets are GPUs: their attention kernels and dropout masks


@contextmanager
def fake_world(rank: int, world: int):
    """This process as rank `rank` of `world` in a fake process group (nothing is sent), torn down after."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def plan_dtypes(settings) -> tuple:
    """(compute, param, master) dtypes as train.start_run chooses them; --dtype auto plans for a GPU: bf16."""
    name = settings.args.dtype if settings.args.dtype != "auto" else "bf16"
    compute = DTYPES[name]
    return name, compute, (compute if settings.args.zero else torch.float32), torch.float32


def build_role(settings, rank: int):
    """train.compose for `rank` of settings.world_size, on meta, inside the current fake process group."""
    import train  # here: train imports this file
    from mesh import build_mesh

    name, compute, param, master = plan_dtypes(settings)
    mesh = build_mesh(settings.shape, rank, every_group=False)  # a fake group: no peer needs the others' groups
    run = train.Run(settings=settings, mesh=mesh, config=replace(settings.model), device=torch.device("meta"),
                    seed=settings.args.seed, compute_dtype=compute, param_dtype=param, master_dtype=master)
    train.compose(run, materialize=False)
    for group_name, group in mesh.groups.items():
        run.tracer.name_group(group, group_name)  # as train.py names them: the messages' rows are the run's
    return run


@dataclass
class Role:
    """What one rank holds and sends per step: the figures a real start-up prints."""

    rank: int
    coords: dict  # {"dp", "pp", "cp", "tp"}
    local_params: int
    logical: dict  # {global name: elements of the logical tensor}: Ψ is their sum over the roles
    persistent: dict  # {"weights", "grads", "optimizer", "total"} bytes
    activations: object  # report.ActivationEstimate: one forward's bytes, how many in flight, their peak
    temporaries: dict  # {what: bytes}
    messages: Messages  # per step, (op, group as the tracer names it): (calls, payload)
    group_ranks: dict  # {group name: global ranks of this rank's group}
    flops: mfu.FlopsPerToken
    bubble: float
    last_bucket: float  # bytes of the gradient reduction's last piece (sent after backward)
    first_gather: float  # ZeRO-3: bytes gathered before the first block can start (root + block 0)
    boundary_bytes: float = 0.0  # one pipeline message
    layer_share: float = 1.0  # this rank's layers over the mean (L/P): an uneven pipeline split's slow stage

    @property
    def peak(self) -> float:
        return self.persistent["total"] + self.activations.peak + sum(self.temporaries.values())


def role_of(run, device_type: str | None = None) -> Role:
    """The Role of a built run: every figure read from the code a real start-up prints it with; the
    activations as the kernels of `device_type` save them (the plan's: "cuda"; default the run's device)."""
    layout, mesh = run.layout, run.mesh
    persistent = dict(layout.predicted_persistent())
    estimate = report.activation_estimate(run, device_type)
    temporaries, last_bucket, first_gather = {}, 0.0, 0.0
    if isinstance(layout, zero.ZeroLayout):
        extra = layout.peak_lower_bound() - persistent["total"]
        what = ("gathered units (in use + prefetched) and gradient buckets" if layout.stage == 3
                else "reduce-scatter outputs / all-gather inputs, gradient buckets")
        temporaries[f"ZeRO-{layout.stage} {what}"] = extra
        b = layout.reduce_dtype.itemsize
        last_bucket = b * (sum(u.padded_numel for u in layout.root) if layout.stage == 3
                           else layout.units[-1].padded_numel)
        if layout.stage == 3:
            first_gather = layout.param_dtype.itemsize * sum(u.padded_numel for u in [*layout.root,
                                                                                        *layout.block_units[0]])
    else:
        sizes = layout.ddp.bucket_sizes_bytes()
        temporaries["DDP: one bucket in flight (the backend's staging)"] = max(sizes)
        last_bucket = sizes[-1]
    bubble, boundary = 0.0, 0.0
    for axis in run.axes:
        if axis.schedule is not None:  # the pipeline: its bubble, its messages' buffers
            s = axis.schedule
            bubble = schedules.bubble_formula(s.name, s.P, run.micro_batches, s.v)
            boundary = axis.message_bytes()
            temporaries["pipeline p2p buffers (a send and a receive)"] = 2 * boundary
        if axis.name == "moe" and mesh.size("ep") > 1:
            t = axis.traffic
            temporaries["MoE all-to-all buffers (dispatch out and in)"] = 2 * t.tokens * t.model.moe_topk * \
                t.model.n_embd * t.compute_bytes
        if axis.name == "cp" and run.settings.args.cp_impl == "ring":
            kv = 2 * run.micro_batch_size * run.seq_len // mesh.size("cp") * run.config.n_embd // mesh.size("tp")
            temporaries["ring CP: the K, V block in flight"] = 2 * kv * run.compute_dtype.itemsize
    params = list(run.model.parameters())
    ranks = {name: members for name, members in mesh.members.items()}
    ranks["world"] = list(range(mesh.shape.world_size))
    return Role(rank=mesh.rank, coords=mesh.shape.coords(mesh.rank), local_params=sum(p.numel() for p in params),
                logical={p.shard_info.global_name: math.prod(p.shard_info.global_shape) for p in params},
                persistent=persistent, activations=estimate,
                temporaries=temporaries, messages=report.predicted_messages(run), group_ranks=ranks,
                flops=run.flops, bubble=bubble, last_bucket=last_bucket, first_gather=first_gather,
                boundary_bytes=boundary,
                layer_share=len(run.model.transformer.h) * mesh.shape.pp / run.config.n_layer)


def role_ranks(shape: MeshShape, every: bool = False) -> list:
    """Ranks of the roles to build: d = 0 and every stage p with (c, t) = (0, 0), plus the corner (0, C−1, T−1)
    (or, `every`, each (p, c, t))."""
    if every:
        return [shape.rank_of(0, p, c, t) for p in range(shape.pp) for c in range(shape.cp) for t in range(shape.tp)]
    ranks = [shape.rank_of(0, p, 0, 0) for p in range(shape.pp)]
    corner = shape.rank_of(0, 0, shape.cp - 1, shape.tp - 1)
    return ranks + ([corner] if corner not in ranks else [])


def _same_figures(a: Role, b: Role) -> bool:
    return (a.persistent == b.persistent and a.activations == b.activations and a.temporaries == b.temporaries
            and dict(a.messages) == dict(b.messages))


def plan_roles(settings) -> list:
    """Every distinct role's Role (see role_ranks: the corner checks that TP/CP indices change nothing)."""
    world = settings.world_size

    def one(rank):
        with fake_world(rank, world):
            return role_of(build_role(settings, rank), PLANNED_DEVICE)

    roles = [one(rank) for rank in role_ranks(settings.shape)]
    if len(roles) > settings.shape.pp:  # the corner (0, C−1, T−1): equal to stage 0's, or build them all
        roles = roles[:-1] if _same_figures(roles[0], roles[-1]) else \
            [one(rank) for rank in role_ranks(settings.shape, every=True)]
    return roles


def logical_psi(settings, roles: list) -> int:
    """Ψ: the logical tensors' elements, each once, over the roles' records. With E > 1 a role holds only its
    ep index's experts: the ranks of the other ep indices (d·C + c = i of one dp×cp slice) are built for
    their records too (a real start-up all-reduces the counted parameters instead; the fake group cannot)."""
    logical = {name: n for role in roles for name, n in role.logical.items()}
    shape = settings.shape
    for i in range(1, shape.ep):
        rank = shape.rank_of(i // shape.cp, 0, i % shape.cp, 0)
        with fake_world(rank, shape.world_size):
            logical.update(role_of(build_role(settings, rank), PLANNED_DEVICE).logical)
    return sum(logical.values())


# ---------------------------------------------------------------------------------------------------------
# The time model
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Prediction:
    compute: float
    update: float
    bubble: float  # seconds idle in the pipeline's fill and drain
    step: float
    mfu: float
    exposed: dict = field(default_factory=dict)  # {(op, group): seconds on the critical path}
    total: dict = field(default_factory=dict)  # {(op, group): seconds if nothing overlapped}
    link: dict = field(default_factory=dict)  # {(op, group): "intra" | "inter"}

    def by_link(self, exposed: bool = True) -> dict:
        out = {"intra": 0.0, "inter": 0.0}
        for key, t in (self.exposed if exposed else self.total).items():
            out[self.link[key]] += t
        return out

    @property
    def exposed_comm(self) -> float:
        return sum(self.exposed.values())


def _group_ranks(group: str, ranks: dict) -> list:
    names = [name for name in group.split("=") if name in ranks]  # "dp=dp_cp=expert_dp": one communicator
    return ranks[names[0]] if names else [0]


def _names(group: str) -> set:
    return set(group.split("="))


def predict(role: Role, layout: dict, hw: hardware.Hardware) -> Prediction:
    """The role's step time by the rules of the docstring. layout: world, tokens (per step), m, zero, P, dtype,
    cp_impl, attention_share (of the compute: attention's score and value matmuls)."""
    m, stage, P = layout["m"], layout["zero"], layout["P"]
    peak = hw.peak(layout["dtype"])
    compute = role.flops.hardware * layout["tokens"] / layout["world"] / peak * role.layer_share
    backward_mb = compute * 2 / 3 / m  # one micro-batch's backward: 4 of its 6·N FLOPs
    update = 2 * role.persistent["total"] / (hw.hbm_gbps * 1e9)
    exposed, total, link, in_layer = {}, {}, {}, 0.0
    for (op, group), (calls, payload) in role.messages.items():
        ranks = _group_ranks(group, role.group_ranks)
        t = hardware.collective_seconds(op, calls, payload, ranks, hw)
        names = _names(group)

        def piece(nbytes):  # one call of `op` moving nbytes
            return hardware.collective_seconds(op, 1, nbytes, ranks, hw)

        grads = names & {"dp_cp", "expert_dp"} and op in ("all_reduce", "reduce_scatter_single") and payload > 16 * calls
        if grads and stage <= 1:  # DDP, ZeRO-1: once per step, over the last micro-batch's backward
            last = piece(role.last_bucket)
            e = last + max(0.0, t - last - backward_mb)
        elif grads:  # ZeRO-2/3: every micro-batch's, over its own backward
            last = piece(role.last_bucket)
            e = m * (last + max(0.0, t / m - last - backward_mb))
        elif stage == 3 and op == "all_gather_single" and names & {"dp_cp", "expert_dp"}:
            first = piece(role.first_gather)
            e = m * (first + max(0.0, t / m - first - compute / m))
        elif "pp" in names and op == "send":
            e = 2 * (P - 1) * piece(role.boundary_bytes) if role.boundary_bytes else t
        elif "cp" in names and op in ("send", "isend", "batch_isend_irecv") and layout.get("cp_impl") == "ring":
            e = max(0.0, t - compute * layout.get("attention_share", 0.0))
        else:  # TP/SP, EP, Ulysses, the update's and the step's scalars, amaxes, ZeRO-1/2's gather, pp sums
            e = t
            in_layer += t if names & {"tp", "ep", "cp"} else 0.0
        exposed[(op, group)], total[(op, group)] = min(e, t), t
        link[(op, group)] = "inter" if hardware.crosses_nodes(ranks, hw) else "intra"
    busy = compute + in_layer
    bubble = busy * role.bubble / (1 - role.bubble)
    step = busy + bubble + update + sum(exposed.values()) - in_layer
    return Prediction(compute=compute, update=update, bubble=bubble, step=step, exposed=exposed, total=total,
                      link=link, mfu=role.flops.model * layout["tokens"] / (layout["world"] * peak * step))


def layout_facts(settings) -> dict:
    """What the time model reads of a layout (predict's `layout`)."""
    args, config = settings.args, settings.model
    seq = settings.seq_len
    attention = 12 * config.n_layer * config.n_embd * seq  # 12·L·H·Q·s of the FLOPs per token
    flops = moe.flops_per_token(config, seq, recompute=config.activation_checkpointing)
    return dict(world=settings.world_size, tokens=args.global_batch * seq, m=settings.micro_batches,
                zero=args.zero, P=settings.shape.pp, dtype=plan_dtypes(settings)[0], cp_impl=args.cp_impl,
                attention_share=attention / flops.hardware)


def limiting_term(prediction: Prediction) -> str:
    """The largest term of the step, and when that is compute, the largest of what is lost besides it."""
    losses = {"exposed communication": prediction.exposed_comm, "bubble": prediction.bubble,
              "update (HBM)": prediction.update}
    worst = max(losses, key=losses.get)
    if prediction.compute >= losses[worst]:
        return f"compute; most lost to {worst} ({losses[worst] / prediction.step:.0%} of the step)"
    return worst


# ---------------------------------------------------------------------------------------------------------
# Flags and printouts
# ---------------------------------------------------------------------------------------------------------


def plan_settings(settings):
    """The model's vocabulary as the plan sizes it: --tokenizer's, or a gpt3-* preset's own (50304) when
    --tokenizer is not given (a real run takes the corpus's: the plan cannot read one)."""
    args = settings.args
    if "tokenizer" not in settings.given and args.preset.startswith("gpt3-"):
        settings.model.vocab_size = model_lib.PRESETS[args.preset].vocab_size
    return settings


def check_world(args) -> None:
    """--plan/--plan-search's own rules: --world given, and divisible by the layout (before any build)."""
    if args.world is None:
        raise FlagError("--plan and --plan-search need --world N (the number of ranks to plan for)")
    model_parallel = args.tp * args.pp * args.cp
    if args.plan and args.world % model_parallel:
        raise FlagError(f"--world {args.world} is not divisible by --tp {args.tp} × --pp {args.pp} × --cp {args.cp}"
                        f" = {model_parallel}: the layout needs a multiple of {model_parallel} ranks")


def layout_name(settings) -> str:
    a, s = settings.args, settings.shape
    name = f"D{s.dp}·P{s.pp}·C{s.cp}·T{s.tp}" + (f"·E{s.ep}" if s.ep > 1 else "")
    name += f" ZeRO-{a.zero} B_μ={settings.micro_batch_size} m={settings.micro_batches}"
    name += (f" {a.pp_schedule}" + (f"(v={a.pp_virtual})" if a.pp_schedule == "interleaved" else "")) if s.pp > 1 else ""
    return name + (" SP" if settings.sequence_parallel else "") + (" AC" if settings.model.activation_checkpointing else "")


def hardware_line(hw: hardware.Hardware, dtype: str) -> str:
    return (f"hardware model {hw.name}: {hw.peak(dtype) / 1e12:g} TFLOP/s {dtype} dense, HBM {hw.hbm_gbps:g} GB/s,"
            f" {hw.memory_gib:.1f} GiB; {hw.gpus_per_node} GPUs a node; intra-node {hw.intra_gbps:g} GB/s,"
            f" α {hw.intra_latency_us:g} µs; inter-node {hw.inter_gbps:g} GB/s per GPU, α {hw.inter_latency_us:g} µs")


def zero_table(psi: int, D: int) -> str:
    """The ZeRO paper's Figure 1 at this Ψ and D (16-bit mixed precision, K = 12: memory.persistent_bytes)."""
    cells = [f"{memory.persistent_bytes(psi, 'mixed', s, D)['total'] / 1e9:.1f}" for s in range(4)]
    return f"ZeRO stages 0/1/2/3 at Ψ = {psi / 1e9:.2f}B, D = {D}, K = 12: " + " / ".join(cells) + " GB per device"


def role_lines(role: Role, prediction: Prediction, hw: hardware.Hardware) -> list:
    fmt = mfu.format_bytes
    c = role.coords
    p, a = role.persistent, role.activations
    lines = [f"role rank {role.rank} (p {c['pp']}, c {c['cp']}, t {c['tp']}; every d alike): {role.local_params:,}"
             f" parameters held",
             f"  persistent: weights {fmt(p['weights'])}, grads {fmt(p['grads'])}, optimizer {fmt(p['optimizer'])},"
             f" total {fmt(p['total'])}",
             f"  activations {fmt(a.forward)} a forward ({a.how}) × {a.in_flight} in flight"
             + (" + the rebuilt block" if a.recomputed else "") + f" = {fmt(a.peak)} (Korthikanti et al.:"
             f" {fmt(a.korthikanti / a.chunks)} a forward)"]
    for what, nbytes in role.temporaries.items():
        lines.append(f"  temporary: {what}: {fmt(nbytes)}")
    fits = "fits" if role.peak <= hw.memory_gib * 2**30 else "DOES NOT FIT"
    lines.append(f"  peak ≈ {fmt(role.peak)} of {hw.memory_gib:.1f} GiB: {fits}")
    lines.append(f"  FLOPs/token: model {role.flops.model:,.0f}, hardware {role.flops.hardware:,.0f}; bubble"
                 f" {role.bubble:.1%}")
    lines.append("  per step (op, group: calls, payload, link, α-β time, on the critical path):")
    for (op, group), (calls, payload) in sorted(role.messages.items(), key=lambda kv: kv[0][::-1]):
        key = (op, group)
        lines.append(f"    {op:<22} {group:<20} {calls:>8g} calls {fmt(payload):>12}  {prediction.link[key]:<5}"
                     f" {prediction.total[key] * 1e3:10.2f} ms, exposed {prediction.exposed[key] * 1e3:10.2f} ms")
    exposed, total = prediction.by_link(True), prediction.by_link(False)
    lines.append(f"  step {prediction.step * 1e3:,.1f} ms = compute {prediction.compute * 1e3:,.1f} + exposed comm"
                 f" {prediction.exposed_comm * 1e3:,.1f} (intra {exposed['intra'] * 1e3:,.1f} of"
                 f" {total['intra'] * 1e3:,.1f}, inter {exposed['inter'] * 1e3:,.1f} of {total['inter'] * 1e3:,.1f})"
                 f" + bubble {prediction.bubble * 1e3:,.1f} + update {prediction.update * 1e3:,.1f};"
                 f" MFU {prediction.mfu:.1%}; limited by {limiting_term(prediction)}")
    return lines


def run_plan(settings, hw: hardware.Hardware, out=print) -> tuple:
    """--plan: every role built and accounted, its prediction printed; returns (roles, predictions)."""
    began = time.perf_counter()
    settings = plan_settings(settings)
    roles = plan_roles(settings)
    facts = layout_facts(settings)
    predictions = [predict(role, facts, hw) for role in roles]
    psi = logical_psi(settings, roles)
    s = settings.shape
    out("=" * 100)
    out(f"plan: {layout_name(settings)} on world {s.world_size} (rank = ((d·P + p)·C + c)·T + t, node = rank //"
        f" {hw.gpus_per_node}); {settings.args.preset}: Ψ = {psi:,} (n_layer={settings.model.n_layer}"
        f" n_embd={settings.model.n_embd} n_head={settings.model.n_head} vocab={settings.model.vocab_size}),"
        f" {settings.args.global_batch} × {settings.seq_len} tokens/step")
    out(hardware_line(hw, facts["dtype"]))
    out(zero_table(psi, s.dp * s.cp))
    for role, prediction in zip(roles, predictions):
        for line in role_lines(role, prediction, hw):
            out(line)
    slowest = max(range(len(roles)), key=lambda i: predictions[i].step)
    worst = max(roles, key=lambda r: r.peak)
    out(f"predicted: step {predictions[slowest].step:.3f} s (rank {roles[slowest].rank} sets the pace), MFU"
        f" {predictions[slowest].mfu:.1%}, {facts['tokens'] / predictions[slowest].step:,.0f} tok/s; peak memory"
        f" {mfu.format_bytes(worst.peak)} (rank {worst.rank}); {len(roles)} roles built on meta in"
        f" {time.perf_counter() - began:.1f} s")
    out("=" * 100)
    return roles, predictions


def main(settings, argv: list) -> None:
    """train.py --plan / --plan-search: one flag error line, or the plan."""
    import plan_search  # it builds on this file's roles and time model
    from flags import fail

    hw = hardware.from_flags(settings.args, plan_dtypes(settings)[0])
    try:
        if settings.args.plan_search:
            plan_search.run_search(argv, settings, hw)
        else:
            run_plan(settings, hw)
    except FlagError as e:
        fail(str(e))


# ---------------------------------------------------------------------------------------------------------
# Every real run: its measured step time next to the hardware model's prediction for this machine
# ---------------------------------------------------------------------------------------------------------


def machine_model(run, args) -> hardware.Hardware:
    """This machine as the time model sees it: on CPU measured (the matmul peak train.py measured, a timed
    gloo all-reduce: collective, every rank calls it); on a GPU the preset's datasheet row (--hw, --hw-*)."""
    if run.device.type == "cpu":
        return hardware.measure_cpu(run.peak[0], run.settings.dtype, run.device)
    return hardware.from_flags(args, run.settings.dtype)


def check_line(run, hw: hardware.Hardware, seconds: float, steps: int) -> str:
    """'hardware model: step time measured ... vs predicted ...': the model checked against the run it describes
    (not a line starting with "step ": those are the step lines)."""
    if not steps:
        return "hardware model: no step timed (the first is left out), nothing to check it against"
    settings = run.settings
    facts = dict(layout_facts(settings), dtype=settings.dtype)
    prediction = predict(role_of(run), facts, hw)
    measured = seconds / steps
    link = (f"link {hw.intra_gbps:.2f} GB/s, α {hw.intra_latency_us:.0f} µs" if run.mesh.shape.world_size > 1
            else "one process: no link")
    return (f"hardware model: step time measured {measured * 1e3:,.1f} ms (mean of {steps})"
            f" vs predicted {prediction.step * 1e3:,.1f} ms ({measured / prediction.step:.2f}×) by the hardware"
            f" model of this machine ({hw.name}: {hw.peak(settings.dtype) / 1e9:,.1f} GFLOP/s {settings.dtype},"
            f" {link}): compute {prediction.compute * 1e3:,.1f}, exposed comm"
            f" {prediction.exposed_comm * 1e3:,.1f}, bubble {prediction.bubble * 1e3:,.1f}, update"
            f" {prediction.update * 1e3:,.1f} ms")
