"""--plan-search: every layout of a world size ranked by predicted step time, each sized from the formulas.

    python plan.py --plan-search --world 64 --preset gpt3-13b --global-batch 512 --hw-memory-gib 80

It enumerates the layouts (D, P, C ring, T with SP, E with --moe-experts, ZeRO stage, B_μ and m, schedule,
activation checkpointing), sizes those flags.validate accepts from the start-up's own formulas (planner/formulas.py:
each pipeline stage's time_model.Role) and time_model.predict's time model, drops what does not fit the device memory,
ranks by step time and prints the best ten with the term that limits each. --moe-replicas R is kept as given; R is
not searched: at the uniform load the time model assumes, replicas add memory and messages and balance nothing.

Branch and bound. Sizing a layout costs its P stages' roles (P = 64: 64 of them), and most layouts cannot be among
the best ten: time_model.step_bound says which without building a role. A stage's predicted step is at least its
compute / (1 − bubble) (the rest, exposed communication and the update, is never negative), and that needs only the
layout's time-model facts (time_model.layout_facts: its GEMM classes and memory-bound bytes) and the bubble formula.
Every layout gets its bound from a draft of its settings (the first layout validated, its layout fields replaced:
`draft`); they are then sized in the order of their bounds, each validated when its turn comes, and once the next
bound exceeds the tenth best step that fits, none left can enter the ten: the search stops there. The ten are the
exhaustive search's (search(..., bound=False) bounds no layout before sizing it, each still left at the first
look that puts it out: tests/planner/test_search.py compares the two).
What layouts share is computed once: the schedule's facts per (schedule, P, m, v) (formulas.schedule_facts: in
flight and 1f1b's sends alive in closed form, interleaving's sends alive simulated at most at 3P + m mod P
micro-batches and shared by every m that reduces to it, each rank's list walked once) and the time-model facts
per (recompute, T, C, P, B_μ). A line every few seconds says how far it is.

Accounting for this file: it allocates nothing and sends nothing (shapes and formulas only).
"""

from __future__ import annotations

import argparse
import functools
import time
from dataclasses import dataclass, field, replace
from itertools import product

from accounting import moe_memory
from cli import flags
import mfu
from parallel import recompute, schedules
from planner import hardware
import train
from cli.flags import FlagError
from mesh import infer_mesh_shape
from moe import experts_of
from planner.formulas import formula_role, schedule_facts, stage_roles, with_sends_alive
from planner.hardware import hardware_line
from planner.time_model import (host_per_node, layout_facts, layout_name, limiting_term, plan_dtypes, plan_settings,
                                predict, step_bound)

PROGRESS_SECONDS = 3.0  # a progress line at most this often (a search that ends sooner prints none)


def search_argv(c: dict) -> list:
    """A layout as the command line that asks for it."""
    argv = ["--tp", str(c["T"]), "--pp", str(c["P"]), "--zero", str(c["zero"]), "--micro-batch", str(c["micro"])]
    argv += ["--pp-schedule", c["schedule"]] if c["P"] > 1 else []
    argv += ["--cp", str(c["C"]), "--cp-impl", "ring"] if c["C"] > 1 else []
    argv += ["--ep", str(c["E"])] if c["E"] > 1 else []
    return argv + (["--sp"] if c["T"] > 1 else []) + ["--activation-checkpointing", c["ac"]]


def candidate_args(base: dict, c: dict) -> argparse.Namespace:
    """What parse_args([*base argv, *search_argv(c)]) gives, without parsing: the base's values, the layout's
    fields put in (tests/planner/test_search.py checks they are equal)."""
    args = argparse.Namespace()
    vars(args).update(base)  # Namespace(**base) sets them one by one: a tenth of a millisecond, 19,080 times at 1T
    args.tp, args.pp, args.zero, args.micro_batch, args.activation_checkpointing = (
        c["T"], c["P"], c["zero"], c["micro"], c["ac"])
    args.pp_schedule = c["schedule"] if c["P"] > 1 else base["pp_schedule"]
    args.cp, args.cp_impl = (c["C"], "ring") if c["C"] > 1 else (base["cp"], base["cp_impl"])
    args.ep = c["E"] if c["E"] > 1 else base["ep"]
    args.sp = True if c["T"] > 1 else base["sp"]
    return args


def candidates(world: int, config, global_batch: int, gpus_per_node: int, cp: bool = True):
    """Every (T, C, P, D, E, ZeRO, B_μ, schedule, checkpointing) of `world` ranks: T inside a node, T | heads;
    ring CP, C ≤ 8 (none with cp=False: --attention-kernel math); E | N (with --moe-experts) and E | D·C.
    flags.validate refuses the rest as a run would."""
    powers = [2**i for i in range(world.bit_length()) if world % 2**i == 0]
    n = experts_of(config).experts
    experts = [e for e in powers if n % e == 0] if n else [1]
    pipelines = [p for p in range(1, config.n_layer + 1) if world % p == 0]
    for T, C, P, E in product(powers, [c for c in powers if c <= (8 if cp else 1)], pipelines, experts):
        D = world // (T * C * P)
        if world % (T * C * P) or T > gpus_per_node or config.n_head % T or global_batch % D or (D * C) % E:
            continue
        for zero_stage, micro, schedule, ac in product((0, 1, 2, 3), (1, 2, 4, 8),
                                                       ("1f1b", "interleaved") if P > 1 else ("1f1b",),
                                                       recompute.MODES):
            if (global_batch // D) % micro == 0:  # selective's one refusal (the ring): flags.validate's
                yield dict(T=T, C=C, P=P, D=D, E=E, zero=zero_stage, micro=micro, schedule=schedule, ac=ac)


def draft(template, args: argparse.Namespace, c: dict):
    """A layout's settings as flags.validate would give them, for its bound only: the template's (a validated
    layout of the same command line) with the layout's mesh, batch split, arguments and recompute fields put in.
    ValueError where the mesh cannot hold it (validate refuses it too)."""
    replicas = template.diloco.replicas if template.diloco else None
    shape = infer_mesh_shape(template.world_size, tp=c["T"], pp=c["P"], cp=c["C"], ep=c["E"], replicas=replicas)
    model = replace(template.model, activation_checkpointing=c["ac"] == "full",
                    selective_recompute=c["ac"] == "selective")
    return replace(template, args=args, shape=shape, model=model, micro_batch_size=c["micro"],
                   micro_batches=args.global_batch // (shape.dp * c["micro"]))


@functools.lru_cache(maxsize=1024)
def stage_shares(n_layer: int, P: int, v: int) -> frozenset:
    """{(layer share, head share)} of the pp ranks (formulas.stage_holding's split: the head on rank P − 1)."""
    out = set()
    for p in range(P):
        layers = sum(len(schedules.stage_layers(n_layer, P, v, c)) for c in schedules.rank_chunks(p, P, v))
        out.add((layers * P / n_layer, P if p == P - 1 else 0.0))
    return frozenset(out)


def bound_of(settings, facts: dict, hw: hardware.Hardware) -> float:
    """time_model.step_bound of a layout: its stages' shares, its schedule's bubble (formulas._formula_pipeline's)."""
    args, P = settings.args, settings.shape.pp
    v = args.pp_virtual if args.pp_schedule == "interleaved" and P > 1 else 1
    bubble = schedules.bubble_formula(args.pp_schedule, P, settings.micro_batches, v) if P > 1 else 0.0
    return step_bound(stage_shares(settings.model.n_layer, P, v), bubble, facts, hw)


@dataclass
class Searched:
    """The search's outcome: the best layouts that fit, best first, [(prediction, peak, settings, limiting term,
    the block that sets the peak with MoE: moe_memory.peak_setter)], and what it did with the others."""

    best: list
    dropped: int = 0  # sized, and their peak does not fit hw.memory_gib (offloaded: or a node's, hw.host_memory_gib)
    smallest: tuple | None = None  # (peak, settings) of the smallest that does not fit, when none fits
    sized: int = 0  # validated and sized (their roles built)
    refused: int = 0  # refused by flags.validate (as a run would be)
    bounded: int = 0  # never sized: their bound exceeds the top-th best step
    total: int = 0  # enumerated
    seconds: float = 0.0  # the search's own wall time
    progress: list = field(default_factory=list)  # the progress lines printed


def search(base_argv: list, world: int, hw: hardware.Hardware, top: int = 10, bound: bool = True,
           out=None) -> Searched:
    """The best `top` layouts of `world` ranks that fit (see the module docstring), a progress line to `out`
    every PROGRESS_SECONDS. bound=False bounds no layout before sizing it (the search the bound must agree with)."""
    began = last = time.perf_counter()
    parser = flags.build_parser()
    base = vars(parser.parse_args(base_argv))
    defaults = vars(parser.parse_args([]))
    config = flags.model_config(argparse.Namespace(**base))
    cp = base.get("attention_kernel") != "math"  # the math kernel is refused under CP (flags.check_world)
    layouts = [(c, candidate_args(base, c)) for c in candidates(world, config, base["global_batch"],
                                                                 hw.gpus_per_node, cp)]
    done = Searched(best=[], total=len(layouts))

    def validated(args):
        given = {name for name, value in vars(args).items() if name in defaults and value != defaults[name]}
        try:  # the trainer refuses it (heads, vocabulary, m < P, ...): so does the search; the files once
            return plan_settings(flags.validate(args, world, given, axes=train.AXES, check_files=template is None))
        except FlagError:
            done.refused += 1
            return None

    order, template, facts_cache = [], None, {}
    for index, (c, args) in enumerate(layouts):  # every layout's bound, from a draft of its settings
        if template is None:
            template = validated(args)
            if template is None:
                continue
        try:
            settings = draft(template, args, c) if bound else None
        except ValueError:
            done.refused += 1
            continue
        key = (c["ac"], c["T"], c["C"], c["P"], c["micro"])
        if bound and key not in facts_cache:
            facts_cache[key] = layout_facts(settings)
        order.append((bound_of(settings, facts_cache[key], hw) if bound else 0.0, index))
    order.sort()
    results, steps, unfit = [], [], []  # steps: the best `top` predicted steps that fit, sorted
    for position, (lower, index) in enumerate(order):
        if len(steps) >= top and lower > steps[top - 1]:
            done.bounded += len(order) - position  # no layout left can enter the best `top`
            break
        settings = validated(layouts[index][1])
        if settings is not None:
            entry = _sized(settings, hw, done, steps[top - 1] if len(steps) >= top else float("inf"), unfit, index)
            if entry is not None:
                results.append((entry[0].step, index, entry))
                steps = sorted([*steps, entry[0].step])[:top]
        if out is not None and time.perf_counter() - last >= PROGRESS_SECONDS:
            last = time.perf_counter()
            best = min(results)[2] if results else None
            line = (f"  plan-search: {position + 1:,} of {len(order):,} layouts done ({done.sized:,} sized),"
                    + (f" best so far {best[0].step:.3f} s a step ({layout_name(best[2])})" if best else
                       " none fits yet") + f"; {last - began:.0f} s")
            done.progress.append(line)
            out(line)
    results.sort(key=lambda r: r[:2])  # by step; ties in enumeration order, as the exhaustive search ranks them
    done.best = [entry for *_, entry in results[:top]]
    if not results and unfit:  # the smallest peak, exactly: the full peaks in the order of their first stage's
        for first, _, settings in sorted(unfit, key=lambda u: u[:2]):
            if done.smallest is not None and first >= done.smallest[0]:
                break
            peak = max(role.peak for role in stage_roles(settings))
            done.smallest = min(done.smallest or (peak, settings), (peak, settings), key=lambda x: x[0])
    done.seconds = time.perf_counter() - began
    return done


def _sized(settings, hw: hardware.Hardware, done: Searched, kth: float, unfit: list, index: int) -> tuple | None:
    """(prediction, peak, settings, limiting term, peak setter) of a validated layout; None where it does not fit
    (done counts it, `unfit` keeps (a lower bound of its peak, index, settings)) or cannot beat `kth`, the top-th
    best step so far. Sized in four looks, each stopping where the layout is out: its first stage, then its last
    (the layout's step and peak are at least theirs: the first holds the most micro-batches in flight, the last the
    head), its every stage without the pipeline's sends alive (the step exact, the peak a lower bound:
    formula_role's sends_alive), and, for a layout that enters the best, the sends alive (formulas.ScheduleFacts'
    live, once per schedule) for its exact peak."""
    args, shape, P = settings.args, settings.shape, settings.shape.pp
    v = args.pp_virtual if args.pp_schedule == "interleaved" and P > 1 else 1
    schedule = schedule_facts(args.pp_schedule, P, settings.micro_batches, v) if P > 1 else None
    facts, memory = layout_facts(settings), hw.memory_gib * 2**30
    roles, prediction = [formula_role(settings, 0, schedule, sends_alive=False)], None
    for look in ("first stage", "last stage", "every stage", "sends alive"):
        host = host_per_node(roles, hw, shape.world_size)  # --offload's node of GPUs: its host memory too
        if max(r.peak for r in roles) > memory or host > hw.host_memory_gib * 2**30:
            done.dropped += 1
            unfit.append((max(r.peak for r in roles), index, settings))
            return None
        step = max(predict(r, facts, hw).step for r in roles) if prediction is None else prediction.step
        if step > kth:
            done.bounded += 1  # its first or last stage, or its step, is slower than the top-th best
            return None
        if look == "first stage" and P > 1:
            roles.append(formula_role(settings, P - 1, schedule, sends_alive=False))
        elif look == "last stage":  # the stages between, in pp order
            roles[1:1] = [formula_role(settings, p, schedule, sends_alive=False) for p in range(1, P - 1)]
            prediction = max((predict(r, facts, hw) for r in roles), key=lambda x: x.step)
        elif look == "every stage" and schedule is not None:
            roles = [with_sends_alive(role, schedule, p) for p, role in enumerate(roles)]
    done.sized += 1
    setter = moe_memory.peak_setter(max(roles, key=lambda r: r.peak).temporaries)
    return prediction, max(r.peak for r in roles), settings, limiting_term(prediction), setter


def run_search(argv: list, settings, hw: hardware.Hardware, out=print) -> list:
    """--plan-search: the best ten layouts that fit, by predicted step time, with what limits each."""
    for flag, bits in (("--tp-comm-bits", settings.args.tp_comm_bits), ("--dp-comm-bits", settings.args.dp_comm_bits)):
        if bits == 4:  # parallel/lowbit.py: --plan prices it (planner/time_model.py); the search's formulas do not
            raise FlagError(f"{flag} 4 with --plan-search: the search does not price the 4-bit all-reduce; plan a"
                            f" layout with it with --plan")
    done = search(_without_layout_flags(argv), settings.args.world, hw, out=out)
    if not done.best:
        detail = (f"; the smallest peak is {mfu.format_bytes(done.smallest[0])} ({layout_name(done.smallest[1])})"
                  if done.smallest else "")
        raise FlagError(f"--hw-memory-gib {hw.memory_gib:g}: no layout of {settings.args.preset} on --world"
                        f" {settings.args.world} fits in it{detail}")
    out(f"plan-search: {done.total:,} layouts of {settings.args.preset} on {settings.args.world} GPUs, searched in"
        f" {done.seconds:.1f} s (the search's own wall time, not a step time): {done.refused:,} refused by the flags'"
        f" rules, {done.bounded:,} bounded out (a bound on their step, their compute or their first stage's, is"
        f" slower than the best {len(done.best)}), {done.dropped:,} do not fit {hw.memory_gib:.1f} GiB,"
        f" {done.sized:,} sized in full")
    out(f"the best {len(done.best)} by predicted step time:")
    out(hardware_line(hw, plan_dtypes(settings)[0]))
    for i, (prediction, peak, s, limit, setter) in enumerate(done.best, 1):
        out(f"  {i:>2}. {layout_name(s):<52} step {prediction.step:8.3f} s  MFU {prediction.mfu:6.1%}  peak"
            f" {peak / 2**30:6.1f} GiB" + (f" (set by {setter})" if setter else "")
            + f"  compute {prediction.compute:.3f} s, exposed comm {prediction.exposed_comm:.3f} s, bubble"
            f" {prediction.bubble:.3f} s: limited by {limit}")
    return done.best


_LAYOUT_FLAGS = {"--tp": 1, "--pp": 1, "--zero": 1, "--micro-batch": 1, "--pp-schedule": 1, "--sp": 0,
                 "--activation-checkpointing": 0, "--cp": 1, "--cp-impl": 1, "--ep": 1, "--plan-search": 0,
                 "--plan": 0, "--world": 1}


def _without_layout_flags(argv: list) -> list:
    """The command line less what the search chooses itself (and the plan flags)."""
    out, skip, optional = [], 0, False
    for arg in argv:
        if optional:  # --activation-checkpointing's value is optional (the bare flag is full)
            optional = False
            if arg in recompute.MODES:
                continue
        if skip:
            skip -= 1
            continue
        name = arg.split("=")[0]
        if name in _LAYOUT_FLAGS:
            skip = _LAYOUT_FLAGS[name] if "=" not in arg else 0
            optional = name == "--activation-checkpointing" and "=" not in arg
            continue
        out.append(arg)
    return out
