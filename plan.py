"""Size a layout at any scale without its hardware, from the run's own accounting: an entry point on top of train.py.

    python plan.py --world 1024 --preset gpt3-175b --tp 8 --pp 8 --global-batch 1536 --micro-batch 1
    python plan.py --plan-search --world 64 --preset gpt3-13b --global-batch 512 --hw-memory-gib 80

It takes train.py's flags (--plan is implied; `python train.py --plan ...` and `--plan-search` run this file).

--plan runs the real start-up of each distinct rank ROLE inside a fake process group
(torch.testing._internal.distributed.fake_pg: collectives return at once and move nothing) on meta tensors
(nothing allocated), then reads that role's predictions exactly where a real run's start-up reads them
(layout.predicted_persistent, report.run.predicted_messages, activations.activation_estimate, the schedule's bubble):
one source of truth, so a real run's printed predictions and the plan of the same layout are the same numbers.
Roles: ranks that differ only by their data-parallel index d hold the same shapes and send the same messages.
The plan builds stage 0's (d, c, t) = (0, 0, 0) and the corner (0, C−1, T−1): every TP and CP split is
even (cli/flags.py checks the divisibility), so the others equal their stage's role; when the corner does not,
every (p, c, t) is built. Of the pipeline stages, one per distinct shape is built (its layers' count and
kinds, its ends: the embedding, the head) and the others of that shape are derived from it (restage: the
schedule's per-stage figures put in), so a plan of P = 64 builds three stages, not 64, with the same figures.
Start-up figures that a real run gets from a collective come from formulas
here (the fake group reduces nothing): Ψ is the sum of the logical tensors' sizes over the roles' records;
every rank is built from the same seed, so DDP's same-init check holds by construction.

Building on meta: train.compose(run, materialize=False), the real start-up with the model built on meta, every
axis cutting it there and the layout sized over it, no value ever computed.

Each role's figures become a step time and MFU by planner/time_model.py's time model (its rules are in its docstring),
on planner/hardware.py's statement of the hardware.

--plan-search (planner/search.py) sizes layouts from the same formulas without building them.

Accounting for this file: it allocates nothing (meta tensors) and sends nothing (a fake process group).
"""

from __future__ import annotations

import functools
import re
import sys
import time
from contextlib import contextmanager
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from cli import flags
from accounting import memory
import mfu
from parallel import schedules, zero_pipeline
from planner import hardware
import planner.search
import report.muon
import train
from cli.flags import FlagError, fail
from mesh import build_mesh, groups_of
from moe import experts_of
from pipeline import stage_kwargs
from planner.hardware import hardware_line
from planner.time_model import (P2P_BUFFERS, PLANNED_DEVICE, Prediction, Role, layout_facts, layout_name, limiting_term,
                                plan_dtypes, plan_settings, predict, role_of)
from step import Messages


# ---------------------------------------------------------------------------------------------------------
# One role's start-up, built on meta inside a fake process group
# ---------------------------------------------------------------------------------------------------------


@contextmanager
def fake_world(rank: int, world: int):
    """This process as rank `rank` of `world` in a fake process group (nothing is sent), torn down after."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def build_role(settings, rank: int):
    """train.compose for `rank` of settings.world_size, on meta, inside the current fake process group."""
    name, compute, param, master = plan_dtypes(settings)
    mesh = build_mesh(settings.shape, rank, every_group=False)  # a fake group: no peer needs the others' groups
    run = train.Run(settings=settings, mesh=mesh, config=replace(settings.model), device=torch.device("meta"),
                    seed=settings.args.seed, compute_dtype=compute, param_dtype=param, master_dtype=master)
    train.compose(run, materialize=False)
    for group_name, group in mesh.groups.items():
        run.tracer.name_group(group, group_name)  # as train.py names them: the messages' rows are the run's
    return run


def _same_figures(a: Role, b: Role) -> bool:
    return (a.persistent == b.persistent and a.activations == b.activations and a.temporaries == b.temporaries
            and dict(a.messages) == dict(b.messages))


def plan_roles(settings, reuse: bool = True) -> list:
    """Every distinct role's Role (see role_ranks: the corner checks that TP/CP indices change nothing).
    reuse: a stage whose shape (stage_shape) an earlier stage has is not built but derived from that one's
    Role (restage), with the same figures: P stages cost as many builds as distinct shapes (3 at most for
    an even split: the embedding's, the middle's, the head's; one more per layer count of an uneven one)."""
    world, shape = settings.world_size, settings.shape

    def one(rank):
        with fake_world(rank, world):
            return role_of(build_role(settings, rank), PLANNED_DEVICE)

    def stages(c: int, t: int) -> list:
        if not reuse or shape.pp == 1:
            return [one(shape.rank_of(0, p, c, t)) for p in range(shape.pp)]
        pipeline = pipeline_plan(settings)
        built, out = {}, []
        for p in range(shape.pp):
            key = stage_shape(settings, p)
            if key not in built:
                built[key] = (p, one(shape.rank_of(0, p, c, t)))
                out.append(built[key][1])
            else:
                out.append(restage(built[key][1], settings, pipeline, built[key][0], p, c, t))
        return out

    roles = stages(0, 0)
    corner = shape.rank_of(0, 0, shape.cp - 1, shape.tp - 1)
    if corner != roles[0].rank:  # the corner (0, C−1, T−1): equal to stage 0's, or build them all
        if not _same_figures(roles[0], one(corner)):
            roles = [role for c in range(shape.cp) for t in range(shape.tp) for role in stages(c, t)]
            roles.sort(key=lambda role: role.rank)
    return roles


def stage_shape(settings, p: int) -> tuple:
    """What a stage's build depends on besides its index: its layers' count and kinds (dense or MoE, in
    order) and its ends (embedding, head); under ZeRO-2/3 also what its action list sets of parallel/zero_pipeline.py's
    figures, by local chunk index (which chunks are gathered and accumulating together, each chunk's gathers,
    the first action's chunk). Stages of one shape hold the same tensors and send the same messages; only what
    their place in the schedule sets differs (restage)."""
    args, config, P = settings.args, settings.model, settings.shape.pp
    v = args.pp_virtual if args.pp_schedule == "interleaved" else 1
    kw = stage_kwargs(config.n_layer, p, P, v)
    shape = tuple(experts_of(config).is_moe_layer(layer) for layer in kw["layers"]), kw["embedding"], kw["head"]
    if args.zero < 2 or P == 1:
        return shape
    program = _programs(args.pp_schedule, P, settings.micro_batches, v)[p]
    local = {c: k for k, c in enumerate(schedules.rank_chunks(p, P, v))}
    alive = frozenset((frozenset(local[c] for c in held), frozenset(local[c] for c in grads))
                      for held, grads in zero_pipeline.alive_chunks(program, args.zero))
    return (*shape, alive, tuple(zero_pipeline.gather_runs(program, c) for c in local), local[program[0].chunk])


@functools.lru_cache(maxsize=8)
def _programs(schedule: str, P: int, m: int, v: int) -> list:
    return schedules.build_programs(schedule, P, m, v)


def pipeline_plan(settings) -> tuple:
    """(every pp rank's program, every pp rank's communication plan) for the step's m micro-batches: what
    the schedule sets per stage, computed once for all stages."""
    args, shape = settings.args, settings.shape
    v = args.pp_virtual if args.pp_schedule == "interleaved" else 1
    programs = _programs(args.pp_schedule, shape.pp, settings.micro_batches, v)
    return programs, schedules.communication_plan(programs, shape.pp * v)


def restage(role: Role, settings, pipeline: tuple, p0: int, p: int, c: int, t: int) -> Role:
    """Stage p's Role from stage p0's of the same shape: the place-dependent figures replaced by stage p's
    own, as role_of reads them (its coordinates and groups, its logical tensors' layer indices, its
    chunk-micro-batches in flight, its sends alive and its send/receive counts), the rest the same."""
    programs, plans = pipeline
    shape, n_layer = settings.shape, settings.model.n_layer
    rank = shape.rank_of(0, p, c, t)
    args = settings.args
    v = args.pp_virtual if args.pp_schedule == "interleaved" else 1
    moved = dict(zip(stage_kwargs(n_layer, p0, shape.pp, v)["layers"], stage_kwargs(n_layer, p, shape.pp, v)["layers"]))

    def renamed(name: str) -> str:  # transformer.h.<layer of p0>.… → transformer.h.<layer of p>.…
        match = re.match(r"transformer\.h\.(\d+)\.", name)
        return f"transformer.h.{moved[int(match.group(1))]}.{name[match.end():]}" if match else name

    messages = Messages(role.messages)
    size = role.boundary_bytes
    sends, recvs = sum(s.send is not None for s in plans[p]), sum(len(s.recvs) for s in plans[p])
    for op, count in (("send", sends), ("recv", recvs)):
        messages.pop((op, "pp"), None)  # as Pipeline.predicted_messages counts them (no row for no call)
        messages.add(op, "pp", count, count * size)
    temporaries = dict(role.temporaries)
    temporaries[P2P_BUFFERS] = (1 + schedules.live_sends(plans[p])) * size
    ranks = dict(groups_of(shape, rank), world=role.group_ranks["world"])
    return replace(role, rank=rank, coords=shape.coords(rank), group_ranks=ranks, messages=messages,
                   logical={renamed(name): n for name, n in role.logical.items()}, temporaries=temporaries,
                   activations=replace(role.activations, in_flight=schedules.in_flight(programs[p])[0]))


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
# Printouts and the entry point
# ---------------------------------------------------------------------------------------------------------


def zero_table(psi: int, D: int) -> str:
    """The ZeRO paper's Figure 1 at this Ψ and D (16-bit mixed precision, K = 12: memory.persistent_bytes)."""
    cells = [f"{memory.persistent_bytes(psi, 'mixed', s, D)['total'] / 1e9:.1f}" for s in range(4)]
    return f"ZeRO stages 0/1/2/3 at Ψ = {psi / 1e9:.2f}B, D = {D}, K = 12: " + " / ".join(cells) + " GB per device"


def role_lines(role: Role, prediction: Prediction, hw: hardware.Hardware, local_hit: float | None = None) -> list:
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
    lines += offload_lines(role, prediction, hw)
    lines += [f"  {note.strip()}" for note in role.notes]  # DiLoCo's outer state and Δ all-reduce
    lines += [f"  {line.strip()}" for line in report.muon.startup_lines(role.muon)]  # --optimizer muon
    fits = "fits" if role.peak <= hw.memory_gib * 2**30 else "DOES NOT FIT"
    lines.append(f"  peak ≈ {fmt(role.peak)} of {hw.memory_gib:.1f} GiB: {fits}")
    lines.append(f"  FLOPs/token: model {role.flops.model:,.0f}, hardware {role.flops.hardware:,.0f}; bubble"
                 f" {role.bubble:.1%}")
    lines.append("  per step (op, group: calls, payload, link, α-β time, on the critical path):")
    for (op, group), (calls, payload) in sorted(role.messages.items(), key=lambda kv: kv[0][::-1]):
        key = (op, group)
        lines.append(f"    {op:<22} {group:<20} {calls:>8g} calls {fmt(payload):>12}  {prediction.link[key]:<5}"
                     f" {prediction.total[key] * 1e3:10.2f} ms, exposed {prediction.exposed[key] * 1e3:10.2f} ms")
    lines += dispatch_lines(role, hw, local_hit)
    exposed, total = prediction.by_link(True), prediction.by_link(False)
    lines.append(f"  step {prediction.step * 1e3:,.1f} ms = compute {prediction.compute * 1e3:,.1f} + exposed comm"
                 f" {prediction.exposed_comm * 1e3:,.1f} (intra {exposed['intra'] * 1e3:,.1f} of"
                 f" {total['intra'] * 1e3:,.1f}, inter {exposed['inter'] * 1e3:,.1f} of {total['inter'] * 1e3:,.1f})"
                 f" + bubble {prediction.bubble * 1e3:,.1f} + update {prediction.update * 1e3:,.1f};"
                 f" MFU {prediction.mfu:.1%}; limited by {limiting_term(prediction)}")
    return lines


def offload_lines(role: Role, prediction: Prediction, hw: hardware.Hardware) -> list:
    """--offload: what moves from the GPU to host memory, the host's bytes a node, and the host link's and the host
    update's times a step (time_model.offload_seconds)."""
    o, fmt = role.offload, mfu.format_bytes
    if o is None:
        return []
    g = min(hw.gpus_per_node, len(role.group_ranks["world"]))
    t = {what: seconds * 1e3 for what, seconds in prediction.host.items()}
    lines = [f"  host memory (--offload): {fmt(o.freed)} of optimizer state moved off this GPU (in the persistent"
             f" bytes above no more); the host holds {fmt(o.host)} for it (moments, master, gradient staging),"
             f" {fmt(o.host * g)} a node of {g} such GPUs, of {hw.host_memory_gib:g} GiB:"
             f" {'fits' if o.host * g <= hw.host_memory_gib * 2**30 else 'DOES NOT FIT'}"]
    if t:  # a measured CPU times its update instead (its host is its device)
        lines.append(f"  host link a step: {fmt(o.moved['d2h'])} to the host, {fmt(o.moved['h2d'])} back, at"
                     f" {hw.host_link_gbps:g} GB/s a direction: the gradient's copy {t['gradient copy']:,.2f} ms"
                     f" (exposed {t['gradient copy exposed']:,.2f} behind the backward), the update's copies"
                     f" {t['update copies']:,.2f} ms; host AdamW {fmt(o.update)} streamed at"
                     f" {hw.host_adam_gbps:g}/{g} GB/s: {t['host AdamW']:,.2f} ms (the update, exposed)")
    return lines


def dispatch_lines(role: Role, hw: hardware.Hardware, local_hit: float | None) -> list:
    """With --moe-local-hit h: the EP exchange's time a step at h beside the uniform 1/E's (hardware.dispatch_seconds,
    the same split over the links): what a placement that keeps h of the rows at home buys."""
    ranks = role.group_ranks.get("ep", [])
    key = next((key for key in role.messages if key[0] == "all_to_all_single" and "ep" in key[1].split("=")), None)
    if local_hit is None or key is None or len(ranks) < 2:
        return []
    calls, payload = role.messages[key]
    e = len(ranks)
    t, uniform = (hardware.dispatch_seconds(calls, payload, ranks, hw, h) for h in (local_hit, 1 / e))
    near = sum(hardware.node_of(r, hw) == hardware.node_of(ranks[0], hw) for r in ranks) - 1
    return [f"  EP dispatch (all_to_all_single on ep, {near} of the other {e - 1} ep ranks in this node): local-hit"
            f" {local_hit:.1%} (--moe-local-hit) {t * 1e3:,.2f} ms a step, uniform 1/E = {1 / e:.1%}"
            f" {uniform * 1e3:,.2f} ms: the placement saves {(uniform - t) * 1e3:,.2f} ms"
            f" ({1 - t / uniform if uniform else 0:.0%} of the exchange)"]


def run_plan(settings, hw: hardware.Hardware, out=print) -> tuple:
    """--plan: every role built and accounted, its prediction printed; returns (roles, predictions)."""
    began = time.perf_counter()
    settings = plan_settings(settings)
    roles = plan_roles(settings)
    shapes = len({stage_shape(settings, p) for p in range(settings.shape.pp)})
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
        for line in role_lines(role, prediction, hw, facts["local_hit"]):
            out(line)
    slowest = max(range(len(roles)), key=lambda i: predictions[i].step)
    worst = max(roles, key=lambda r: r.peak)
    step = predictions[slowest].step
    achieved = roles[slowest].flops.hardware * facts["tokens"] / (s.world_size * step) / 1e12  # Narayanan's eq. 3
    out(f"predicted: step {step:.3f} s (rank {roles[slowest].rank} sets the pace), MFU {predictions[slowest].mfu:.1%},"
        f" {achieved:.1f} TFLOP/s per GPU (hardware FLOPs), {facts['tokens'] / step:,.0f} tok/s; peak memory"
        f" {mfu.format_bytes(worst.peak)} (rank {worst.rank}); {len(roles)} roles planned in"
        f" {time.perf_counter() - began:.1f} s (one stage of each of the {shapes} stage shapes built on meta)")
    out("=" * 100)
    return roles, predictions


def main(argv=None) -> None:
    """python plan.py FLAGS (or train.py --plan / --plan-search FLAGS): one flag error line, or the plan."""
    argv = planning_argv(sys.argv[1:] if argv is None else list(argv))
    settings = flags.parse(argv, train.AXES, prog="plan.py")  # a bad flag: one line, exit status 2
    hw = hardware.from_flags(settings.args, plan_dtypes(settings)[0])
    try:
        if settings.args.plan_search:
            planner.search.run_search(argv, settings, hw)
        else:
            run_plan(settings, hw)
    except FlagError as e:
        fail(str(e))


def planning_argv(argv: list) -> list:
    """The command line with --plan put in front unless it asks for --plan or --plan-search (an error in it is
    left for flags.parse to report)."""
    try:
        args = flags.build_parser("plan.py").parse_args(argv)
    except FlagError:
        return argv
    return argv if args.plan or args.plan_search else ["--plan", *argv]


if __name__ == "__main__":
    main()
