"""pipeline.py and parallel/schedules.py: the schedules as pure Python, gradient equivalence on 2 and 4 ranks, traced
p2p bytes, flags. Each test names one property; the spawned runs are module-scoped fixtures that several
tests read.

1. The schedule checker (no processes): for every schedule over a (P, m, v) grid, every action list is
   complete and ordered, every send is matched by a receive in the same order on the peer (NCCL matches p2p
   by order) and receives are posted before they are needed, every dependency is respected in an independent
   simulation of the interpreter's semantics (F after the previous chunk's F, B/I after the next chunk's
   B/I, W after its I, B after its own F), and the in-flight counts and the bubble for uniform costs equal
   the formulas written here (not imported).
2. Gradient equivalence: P = 2 and 4 ranks, each schedule, m = P, 2P and a non-multiple, stages built
   in float64 from the per-parameter init; forward_backward with a stand-in layout, then after_grad_sync;
   every parameter's gradient (by global name, the tied embedding on both of its stages) and the loss sum
   equal the single-device model.GPT on the same global batch within 1e-10. The stand-in layout also
   checks that each gradient reaches the synchronised backward exactly once (the DDP overlap contract).
   Cases add an auxiliary loss, (x, y, pos) batches, an uneven split and loss scaling; with TP (2 × 2,
   with and without SP) the zb weight-gradient deferral runs through tensor_parallel's inner linears.
3. Every traced message (send/recv over pp, the loss and tied-embedding all-reduces) equals the handle's
   prediction, calls and bytes; report/pipeline.py's lines draw the timeline and write a Chrome trace.
4. FP8 under the pipeline: zb with every recipe equals the single-device FP8 model (fp8.Fp8Linear defers its
   own weight gradient to the W action).
5. Sent buffers are freed at the plan's release points: the host programs of every plan run to the end
   under gloo's completion rule (a pair completes once both peers posted it) and NCCL's (one in-order stream
   of batches per rank); a release waits only on a receive a message already taken shows posted, so under
   gloo's rule with costs unlike the plan's every action starts when schedules.simulate starts it; a real
   2-rank step holds exactly the plan's count of sent buffers; evaluation and sampling leave no MoE aux term
   behind; on CUDA the actions are timed by events (observers.ActionClock, with a fake torch.cuda.Event here) and
   nothing synchronizes the device inside the step; the end line says why a measured bubble differs from the
   formula; the handle speaks the axis protocol (after_grad_sync returns 0, predicted_messages a
   tracer.Messages, no printing of its own). The interpreter keeps no clock: nobody watches it by default, and
   an observer it is given is told the step, each action in the plan's order and each p2p call; the
   accounting reads the handle through `facts()` and the observer it subscribed only.
The ranks build their stages on harness.device() (each rank's GPU under nccl, where the p2p goes over NCCL);
the batches stay on the CPU and the schedule moves them. The one-process checks (1, the bf16 I/W split, the
flags) stay on the CPU.
"""

import functools
import json
import os
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from types import SimpleNamespace

import pytest
import torch

from parallel import schedules as sch
import pipeline as pp
import report.axes
import report.pipeline
from step import Messages
import harness
from harness import run_ranks
from reference import build_model
from reference import global_batches, make_config, rank_micro_batches

TOL = 1e-10
SEQ, MICRO = 8, 2


def build_stages(config, seed=0, dtype=torch.float32, device=None, pp_rank=0, P=1, v=1):
    """Pipeline rank `pp_rank`'s model: one model.GPT holding its chunks' blocks (first chunk: + embeddings,
    last: + ln_f and head), built alone."""
    return build_model(config, seed, dtype, device, **pp.stage_kwargs(config.n_layer, pp_rank, P, v))


def build(run, config, dtype=torch.float32, transform=None):
    """(stage model, Pipeline) as train.compose makes them: build this rank's stage, `transform(model)` (TP's
    parallelize, CP's swap: the axes before PP), then apply, and the accounting's clock subscribes."""
    model = build_model(run.config, run.seed, dtype, run.device, **pp.stage_of(config, run))
    if transform is not None:
        transform(model)
    handle = pp.apply(model, run, config)
    report.axes.observe(handle)
    return model, handle


def _stage_run(mesh, config, m, device, sp=False, tp=1):
    """What build, pipeline.apply and report's pp lines read of train.Run, for m micro-batches of MICRO × SEQ
    tokens."""
    settings = SimpleNamespace(sequence_parallel=sp, local_seq_len=SEQ // (tp if sp else 1))
    return SimpleNamespace(settings=settings, mesh=mesh, config=config, seq_len=SEQ, micro_batch_size=MICRO,
                           micro_batches=m, device=device, seed=0)

# ---------------------------------------------------------------------------------------------------------
# 1. The schedule checker
# ---------------------------------------------------------------------------------------------------------

SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb"]
GRID = [(s, P, m, v) for P in (2, 3, 4, 5) for m in range(P, 3 * P + 2) for s, vs in
        (("gpipe", (1,)), ("1f1b", (1,)), ("zb", (1,)), ("interleaved", (2, 3, 4))) for v in vs]
UNIFORM = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}  # backward = 2 forwards, I = W = F


def _grid(schedule):
    return [(s, P, m, v) for s, P, m, v in GRID if s == schedule]


@functools.lru_cache(maxsize=None)
def _programs_and_plan(s, P, m, v):
    programs = sch.build_programs(s, P, m, v)
    return programs, sch.communication_plan(programs, P * v)


def _execute(plan, costs, n_chunks):
    """The interpreter's semantics, independently: a rank runs its steps in order; a send is posted when its
    action ends; an action waits until the message it needs has been sent. Returns {action: (rank, start,
    end)}; fails on a deadlock."""
    P = len(plan)
    sent_at = {}  # message -> time its sender posted it
    clock, nxt, out = [0.0] * P, [0] * P, {}
    while any(nxt[r] < len(plan[r]) for r in range(P)):
        progressed = False
        for r in range(P):
            while nxt[r] < len(plan[r]):
                step = plan[r][nxt[r]]
                need = sch.needs(step.action, n_chunks)
                if need is not None and need not in sent_at:
                    break
                start = max(clock[r], sent_at.get(need, 0.0))
                clock[r] = start + costs[step.action.kind]
                out[step.action] = (r, start, clock[r])
                if step.send is not None:
                    sent_at[step.send] = clock[r]
                nxt[r] += 1
                progressed = True
        stuck = [(r, str(plan[r][nxt[r]].action)) for r in range(P) if nxt[r] < len(plan[r])]
        assert progressed, f"deadlock at {stuck}"
    return out


@functools.lru_cache(maxsize=None)
def _uniform_times(s, P, m, v):
    return _execute(_programs_and_plan(s, P, m, v)[1], UNIFORM, P * v)


def _expected_in_flight(schedule, P, m, r, v):
    if schedule == "gpipe":
        return m
    if schedule == "interleaved":
        largest_group = P + m % P  # groups of P micro-batches, a remainder joins the last one
        return min(2 * (P - r - 1) + (v - 1) * largest_group + 1, v * m)
    return min(P - r, m)  # 1F1B, and zb between F and I


def _expected_bubble(schedule, P, m, v, t_f, t_b, t_w=None):
    if schedule in ("gpipe", "1f1b"):
        return (P - 1) / (m + P - 1)
    if schedule == "interleaved":
        return (P - 1) / (v * m + P - 1)
    idle = (P - 1) * max(t_f, t_f + t_b - t_w)  # ZB-H1 (Qi et al. 2023), t_b = the I half
    return idle / (m * (t_f + t_b + t_w) + idle)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_chunk_runs_each_micro_batch_once_per_kind_after_its_forward(schedule):
    for s, P, m, v in _grid(schedule):
        programs, _ = _programs_and_plan(s, P, m, v)
        where, kinds = f"{s} P={P} m={m} v={v}", "FIW" if s == "zb" else "FB"
        for r, program in enumerate(programs):
            expected = sorted((k, mb, c) for k in kinds for mb in range(m) for c in range(r, P * v, P))
            assert sorted(tuple(a) for a in program) == expected, where
            order = {tuple(a): i for i, a in enumerate(program)}
            for k, mb, c in expected:
                if k != "F":
                    assert order[("F", mb, c)] < order[(k, mb, c)], (where, "backward before its forward")
                if k == "W":
                    assert order[("I", mb, c)] < order[("W", mb, c)], (where, "W before its I")


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_receives_are_posted_in_the_peers_send_order_before_their_use(schedule):
    for s, P, m, v in _grid(schedule):
        _, plan = _programs_and_plan(s, P, m, v)
        where = f"{s} P={P} m={m} v={v}"
        sends, recvs = defaultdict(list), defaultdict(list)
        for r, steps in enumerate(plan):
            posted = set()
            for step in steps:
                for msg in step.recvs:
                    recvs[(msg.chunk % P, r)].append(msg)
                    posted.add(msg)
                need = sch.needs(step.action, P * v)
                assert need is None or need in posted, (where, "receive not posted before its use")
                if step.send is not None:
                    dst = (step.send.chunk + (1 if step.send.kind == "act" else -1)) % P
                    sends[(r, dst)].append(step.send)
        assert dict(sends) == dict(recvs), where


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_plan_respects_every_dependency(schedule):
    """In an independent run of the plan with uniform costs (F=1, B=2 or I=W=1)."""
    for s, P, m, v in _grid(schedule):
        times, where = _uniform_times(s, P, m, v), f"{s} P={P} m={m} v={v}"
        for (k, mb, c), (r, start, end) in times.items():
            if k == "F" and c > 0:
                assert start >= times[sch.Action("F", mb, c - 1)][2], where
            if k in "BI" and c < P * v - 1:
                assert start >= times[sch.Action(k, mb, c + 1)][2], where
            if k in "BI":
                assert start >= times[sch.Action("F", mb, c)][2], where
            if k == "W":
                assert start >= times[sch.Action("I", mb, c)][2], where


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_uniform_cost_bubble_equals_the_formula_and_the_simulation(schedule):
    for s, P, m, v in _grid(schedule):
        times, where = _uniform_times(s, P, m, v), f"{s} P={P} m={m} v={v}"
        expected = _expected_bubble(s, P, m, v, 1, 1 if s == "zb" else 2, 1)
        makespan = max(end for _, _, end in times.values())
        busy = defaultdict(float)
        for (k, _, _), (r, start, end) in times.items():
            busy[r] += end - start
        bubbles = [(makespan - busy[r]) / makespan for r in range(P)]
        assert all(abs(b - expected) < 1e-12 for b in bubbles), where
        programs, _ = _programs_and_plan(s, P, m, v)
        assert [round(b, 12) for b in sch.bubble_of(sch.simulate(programs, UNIFORM))] == \
            [round(b, 12) for b in bubbles], where
        assert abs(sch.bubble_formula(s, P, m, v) - expected) < 1e-12, where


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_in_flight_counts_equal_the_formulas(schedule):
    for s, P, m, v in _grid(schedule):
        programs, _ = _programs_and_plan(s, P, m, v)
        for r, program in enumerate(programs):
            peak, stash = sch.in_flight(program)
            assert peak == _expected_in_flight(s, P, m, r, v), (s, P, m, v, r)
            assert stash == (min(r + 1, m) if s == "zb" else 0), (s, P, m, v, r)


def test_simulated_messages_arrive_latency_after_their_send():
    """1f1b, P = 2, m = 1, latency L: F on rank 0 [0, 1], on rank 1 [1 + L, 2 + L], B [2 + L, 4 + L], back on
    rank 0 [4 + 2L, 6 + 2L]."""
    timelines = sch.simulate(sch.build_programs("1f1b", 2, 1), UNIFORM, latency=0.5)
    assert [[(str(a), start, end) for a, start, end in t] for t in timelines] == \
        [[("F0.0", 0.0, 1.0), ("B0.0", 5.0, 7.0)], [("F0.1", 1.5, 2.5), ("B0.1", 2.5, 4.5)]]


def test_zero_bubble_formula_holds_for_other_costs():
    """ZB-H1's bubble (P−1)·max(t_F, t_F+t_I−t_W): W fills the tail unless it is longer than F + I − F."""
    for t_f, t_i, t_w in ((2, 2, 1), (1, 2, 1), (1, 1, 2), (2, 3, 2), (1, 0.5, 1)):
        for P in (2, 3, 4):
            for m in (P, 2 * P + 1):
                plan = sch.communication_plan(sch.build_programs("zb", P, m), P)
                times = _execute(plan, {"F": t_f, "I": t_i, "W": t_w}, P)
                makespan = max(end for _, _, end in times.values())
                expected = _expected_bubble("zb", P, m, 1, t_f, t_i, t_w)
                assert abs(1 - m * (t_f + t_i + t_w) / makespan - expected) < 1e-12, (t_f, t_i, t_w, P, m)
                assert abs(sch.bubble_formula("zb", P, m, 1, (t_f, t_i, t_w)) - expected) < 1e-12


def test_1f1b_phases_read_like_picotron():
    """Rank 0 of 4 with m = 6: three warm-up forwards, steady 1F1B, three cool-down backwards."""
    names = [str(a) for a in sch.one_f_one_b(4, 6, 0)]
    assert names == ["F0.0", "F1.0", "F2.0", "F3.0", "B0.0", "F4.0", "B1.0", "F5.0", "B2.0", "B3.0", "B4.0", "B5.0"]


def test_zero_bubble_rank_r_keeps_r_weight_gradients_deferred():
    """Rank 1 of 2 keeps one W deferred; the deferred ones run at the end."""
    names = [str(a) for a in sch.zero_bubble_h1(2, 3, 1)]
    assert names == ["F0.1", "I0.1", "F1.1", "I1.1", "W0.1", "F2.1", "I2.1", "W1.1", "W2.1"]


def test_deferred_weight_gradients_equal_autograd_under_bf16_autocast():
    """zb's I/W split under autocast: the same bf16 matmuls as autograd's linear backward, so the gradients
    are bitwise equal (the tied head weight included: this one-chunk model holds both of its uses)."""
    config = make_config(n_layer=2)
    plain, deferred = (build_stages(config, 0, torch.float32, None, 0, 1, 1) for _ in range(2))
    store = pp.WeightGradStore()
    store.install(deferred)
    x, y = global_batches(1, 2, SEQ)[0]
    losses = []
    for model in (plain, deferred):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss, _ = model(x, y)
        with store.capture() if model is deferred else nullcontext() as entries:
            loss.backward()
        losses.append(loss)
    assert len(entries) == 4 * 2 + 1  # every linear of both blocks, and the head, waited for W
    assert deferred.lm_head.weight.grad is not None  # the embedding's gradient arrived in I ...
    before = deferred.lm_head.weight.grad.clone()
    store.apply(entries)  # ... the head's in W
    assert not torch.equal(before, deferred.lm_head.weight.grad)
    assert torch.equal(losses[0], losses[1])
    for (name, a), b in zip(plain.named_parameters(), deferred.parameters()):
        assert torch.equal(a.grad, b.grad), name


# ---------------------------------------------------------------------------------------------------------
# Flags and the split
# ---------------------------------------------------------------------------------------------------------


def _validate(n_layer, P, m, schedule="1f1b", v=2, zero=0):
    """flags.validate as every rank runs it before the process group: D = 1, m micro-batches of one sequence."""
    from cli import flags

    args = flags.build_parser().parse_args(["--preset", "tiny", "--n-layer", str(n_layer), "--pp", str(P),
                                            "--pp-schedule", schedule, "--pp-virtual", str(v), "--global-batch",
                                            str(m), "--micro-batch", "1", "--zero", str(zero)])
    return flags.validate(args, P, axes=(pp,)).axes["pipeline"]


@pytest.mark.parametrize("args,expected", [
    ((8, 4, 3, "1f1b", 2), ["--pp 4", "m = 3"]),
    ((8, 2, 4, "interleaved", 3), ["n_layer=8", "--pp-virtual 3", "6"]),
    ((3, 4, 8, "gpipe", 2), ["n_layer=3", "4 pipeline chunks"]),
    ((8, 2, 4, "interleaved", 1), ["--pp-virtual 1"]),
])
def test_impossible_shapes_are_clear_errors(args, expected):
    from cli import flags

    with pytest.raises(flags.FlagError) as error:
        _validate(*args)
    for text in expected:
        assert text in str(error.value)


def test_valid_flags_give_the_config():
    assert _validate(7, 4, 4, "1f1b") == pp.PipelineConfig(4, "1f1b", 1)  # v only for interleaved; uneven allowed
    assert _validate(8, 2, 3, "interleaved", 2) == pp.PipelineConfig(2, "interleaved", 2)  # m not a multiple of P
    assert _validate(2, 1, 1, "1f1b") is None  # no pipeline
    assert _validate(8, 2, 4, "zb", 2, 3) == pp.PipelineConfig(2, "zb", 1)  # ZeRO-2/3 too (parallel/zero_pipeline.py)


def test_layers_split_into_contiguous_chunks_dealt_round_robin():
    assert sch.split_layers(7, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 7)]
    assert [sch.stage_layers(8, 2, 2, c) for c in range(4)] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert sch.rank_chunks(1, 2, 2) == [1, 3]


def test_an_uneven_split_warns():
    lines = report.pipeline.pp_split_lines(make_config(n_layer=7), 4)
    assert any("WARNING uneven split" in line and "chunks [0, 1, 2]" in line for line in lines)
    assert not any("WARNING" in line for line in report.pipeline.pp_split_lines(make_config(n_layer=8), 4))


def test_the_split_prints_what_each_stage_builds():
    """The start-up's parameters per stage are the numel of the stage built alone (its whole MoE blocks too)."""
    for config in (make_config(n_layer=7), make_config(n_layer=8, bias=False),
                   make_config(n_layer=4, moe_experts=4, moe_every=2)):
        for P, v in ((4, 1), (2, 2)):
            built = [sum(p.numel() for p in build_stages(config, 0, torch.float32, "meta", r, P, v).parameters())
                     for r in range(P)]
            printed = [int(line.rsplit(": ", 1)[1].split()[0].replace(",", ""))
                       for line in report.pipeline.pp_split_lines(config, P, v) if line.startswith("  stage ")]
            assert printed == built, (config, P, v)


# ---------------------------------------------------------------------------------------------------------
# 2 and 3. Gradient equivalence and traced messages on the ranks
# ---------------------------------------------------------------------------------------------------------


class StandInLayout:
    """The layout protocol reduced to what the schedule uses; it records which gradients arrive while
    synchronising (outside no_sync), as DDP's bucket hooks count them."""

    def __init__(self, module):
        self.syncing, self.arrivals = True, defaultdict(int)
        self.names = {p: p.shard_info.global_name for p in module.parameters()}
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(self._arrived)

    def _arrived(self, p):
        if self.syncing:
            self.arrivals[self.names[p]] += 1

    @contextmanager
    def no_sync(self):
        previous, self.syncing = self.syncing, False
        try:
            yield
        finally:
            self.syncing = previous

    def grad_pieces(self, params):
        return [p.grad for p in params]


def _add_aux_loss(model, layer_id, coef):
    """An auxiliary loss on one block's MLP output (no aux-emitting MLP exists yet: the hook stands in)."""
    block = model.transformer.h[layer_id]
    block.mlp.register_forward_hook(lambda mod, inp, out: model.aux_losses.add("sq", coef, out.pow(2).mean()))


def _case_batches(m, with_pos):
    x, y = global_batches(1, m * MICRO, SEQ, seed=m)[0]
    batches = rank_micro_batches(x, y, 0, 1, MICRO)
    if with_pos:
        batches = [(bx, by, torch.arange(SEQ)) for bx, by in batches]
    return x, y, batches


def _run_pipeline(rank, world, cases, tp_size=1, sp=False, trace_dir=None):
    import tensor_parallel as tp_lib
    from mesh import build_mesh, infer_mesh_shape
    from accounting.tracer import CommTracer

    device = harness.device()
    mesh = build_mesh(infer_mesh_shape(world, pp=world // tp_size, tp=tp_size), rank)
    results = {}
    for case in cases:
        schedule, m, n_layer, v, extra = case
        config = make_config(n_layer=n_layer, activation_checkpointing="ckpt" in extra)
        trace_file = os.path.join(trace_dir, f"{schedule}.json") if trace_dir else None
        run = _stage_run(mesh, config, m, device, sp=sp, tp=tp_size)
        pp_config = pp.PipelineConfig(mesh.size("pp"), schedule, v if schedule == "interleaved" else 1, trace_file)
        tp_handles = []

        def transform(chunk):
            if tp_size > 1:
                tp_handles.append(tp_lib.parallelize(chunk, mesh.group("tp"), sequence_parallel=sp))
            if "aux" in extra:
                for layer_id in chunk.transformer.h.layer_ids:
                    if layer_id in (0, n_layer - 1):
                        _add_aux_loss(chunk, layer_id, 0.3)

        stages, handle = build(run, pp_config, dtype=torch.float64, transform=transform)  # this rank's stage
        layout = StandInLayout(stages)
        x, y, batches = _case_batches(m, "pos" in extra)
        global_tokens = (y != -1).sum().to(device, torch.float64)
        loss_scale = 4.0 if "scale" in extra else 1.0
        tracer = CommTracer()
        for name, group in {"pp": mesh.group("pp"), "pp_tied": mesh.group("pp_tied")}.items():
            if group is not None:
                tracer.name_group(group, name)
        with tracer:
            out = handle.schedule.forward_backward(layout, stages, batches, global_tokens, loss_scale, m,
                                                   nullcontext(), str(device))  # train_step may pass a string
            for h in tp_handles:
                h.after_grad_sync(layout)
            handle.after_grad_sync(layout)
        # pp and pp_tied are one communicator at P = 2 (the same two ranks): the tracer reports it as "pp=pp_tied"
        traced = {key: (r.calls, r.payload_bytes) for key, r in tracer.records.items()
                  if set(key[1].split("=")) & {"pp", "pp_tied"}}
        grads = {p.shard_info.global_name: (p.grad.detach().clone() / loss_scale, p.shard_info)
                 for p in stages.parameters()}
        synced_arrivals = dict(layout.arrivals)
        lines = report.pipeline.pp_end_lines(handle, run, 1) if "lines" in extra else None  # collective over pp
        results[case] = dict(loss=float(out.loss_sum), aux=out.aux, grads=grads, traced=traced,
                             predicted=handle.predicted_messages(layout).named(tracer.alias),
                             arrivals=synced_arrivals, startup=report.pipeline.pp_startup_lines(handle, run),
                             lines=lines)
    return results


@functools.lru_cache(maxsize=None)
def _reference(n_layer, m, extra):
    """Single-device gradients of Σ_mb (loss_sum_mb / global_tokens + Σ coef·aux_mb / m)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: a second thread only contends with the other test processes
    try:
        return _reference_run(n_layer, m, "aux" in extra)
    finally:
        torch.set_num_threads(threads)


def _reference_run(n_layer, m, aux_on):
    config = make_config(n_layer=n_layer)
    model = build_model(config, seed=0, dtype=torch.float64)
    if aux_on:
        for layer_id in (0, n_layer - 1):
            _add_aux_loss(model, layer_id, 0.3)
    x, y, batches = _case_batches(m, False)
    global_tokens = (y != -1).sum().to(torch.float64)
    loss = 0.0
    for bx, by in batches:
        _, loss_sum, _ = model(bx, by)
        objective = loss_sum / global_tokens
        aux = model.aux_losses.weighted_sum()
        if aux is not None:
            objective = objective + aux / m
        objective.backward()
        loss += float(loss_sum.detach())
    return loss, {name: p.grad for name, p in model.named_parameters()}


def _each(results, cases):
    """(case, this rank's results) for every rank and case."""
    return [(case, rank_results[case]) for case in cases for rank_results in results]


def _check_gradients(results, cases, tp_size=1):
    """The loss sum and every parameter's gradient equal the single-device model's (1e-10), every parameter
    is held somewhere, the tied embedding on both its stages."""
    for case in cases:
        schedule, m, n_layer, v, extra = case
        ref_loss, ref_grads = _reference(n_layer, m, extra)
        seen = defaultdict(int)
        for rank_results in results:
            r = rank_results[case]
            assert abs(r["loss"] - ref_loss) < TOL * max(1.0, abs(ref_loss)), (case, r["loss"], ref_loss)
            for name, (grad, info) in r["grads"].items():
                torch.testing.assert_close(grad, info.shard_of(ref_grads[name]), rtol=TOL, atol=TOL,
                                           msg=f"{case} {name}")
                seen[name] += 1
        assert set(seen) == set(ref_grads), case  # every parameter of the model is somewhere
        assert seen["transformer.wte.weight"] == 2 * tp_size, case  # the tied copies, on the first and last stage


def _check_arrivals(results, cases):
    """Each gradient reaches the synchronised backward exactly once (DDP's buckets count on it)."""
    for case, r in _each(results, cases):
        assert set(r["arrivals"].values()) <= {1}, (case, r["arrivals"])
        assert set(r["arrivals"]) == set(r["grads"]), case


def _check_traced(results, cases):
    """Every p2p and all-reduce over pp and pp_tied, calls and payload, as Pipeline.predicted_messages says."""
    for case, r in _each(results, cases):
        assert isinstance(r["predicted"], Messages)
        assert r["traced"] == r["predicted"], (case, r["traced"], r["predicted"])


CASES_P2 = [(s, m, 8, v, extra) for s, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 1))
            for m, extra in ((2, ()), (4, ("scale",)), (3, ("pos",)))] + [
    ("1f1b", 3, 5, 1, ("aux",)),  # uneven split (3 + 2 layers) and auxiliary losses on both stages
    ("zb", 3, 8, 1, ("aux", "lines")),
    ("zb", 4, 8, 1, ("ckpt",)),  # activation checkpointing: I recomputes the block, its linears still defer W
    ("interleaved", 3, 6, 3, ("aux",)),  # v = 3
]
CASES_P4 = [(s, m, 8, v, extra) for s, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 1))
            for m, extra in ((4, ()), (8, ()), (5, ("lines",)))] + [("1f1b", 4, 6, 1, ("aux",))]
LINES_P2 = ("zb", 3, 8, 1, ("aux", "lines"))


@pytest.fixture(scope="module")
def p2_run(tmp_path_factory):
    """Every CASES_P2 case on 2 ranks, one spawn; zb's end lines write their Chrome trace into trace_dir."""
    trace_dir = str(tmp_path_factory.mktemp("pp_trace"))
    return run_ranks(_run_pipeline, 2, CASES_P2, trace_dir=trace_dir, timeout=120), trace_dir


@pytest.fixture(scope="module")
def p4_run():
    return run_ranks(_run_pipeline, 4, CASES_P4, timeout=150)


def test_gradients_match_single_device_on_2_ranks(p2_run):
    _check_gradients(p2_run[0], CASES_P2)


def test_each_gradient_reaches_the_synced_backward_once_on_2_ranks(p2_run):
    _check_arrivals(p2_run[0], CASES_P2)


def test_traced_messages_equal_the_prediction_on_2_ranks(p2_run):
    _check_traced(p2_run[0], CASES_P2)


def test_end_lines_draw_every_rank_and_the_bubble(p2_run):
    lines = p2_run[0][0][LINES_P2]["lines"]
    assert any(line.startswith("  pp0 |") for line in lines) and any(line.startswith("  pp1 |") for line in lines)
    assert any("bubble predicted" in line and "simulated with the measured costs" in line for line in lines)
    assert any(line.startswith("  mean action time per rank (ms): pp0 F") for line in lines)
    assert any(line.startswith("  host time in p2p calls, last step (ms): pp0 post") and "; pp1 post" in line
               and "release" in line for line in lines)


def test_end_lines_write_a_chrome_trace_of_every_rank(p2_run):
    results, trace_dir = p2_run
    trace = json.load(open(os.path.join(trace_dir, "zb.json")))
    pids = {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"}
    names = {e["name"][0] for e in trace["traceEvents"] if e.get("cat") == "compute"}
    assert pids == {0, 1} and names == {"F", "I", "W"}
    p2p = {e["name"].split()[0] for e in trace["traceEvents"] if e.get("cat") == "p2p"}
    assert p2p == {"post", "wait", "release"}
    assert any("Chrome trace of that step written to" in line for line in results[0][LINES_P2]["lines"])


def test_gradients_match_single_device_on_4_ranks(p4_run):
    _check_gradients(p4_run, CASES_P4)


def test_each_gradient_reaches_the_synced_backward_once_on_4_ranks(p4_run):
    _check_arrivals(p4_run, CASES_P4)


def test_traced_messages_equal_the_prediction_on_4_ranks(p4_run):
    _check_traced(p4_run, CASES_P4)


def test_startup_lines_give_the_bubble_and_the_activations_in_flight(p4_run):
    startup = p4_run[0][CASES_P4[0]]["startup"]
    assert any("bubble predicted 42.9%" in line for line in startup)  # (4−1)/(4+4−1)
    assert any("in flight on pp rank 0: 4 chunk-micro-batches" in line for line in startup)
    assert any("p2p per step" in line and "0→1: 4" in line for line in startup)


CASES_TP = [("zb", 2, 4, 1, ()), ("1f1b", 3, 4, 1, ()), ("interleaved", 2, 4, 2, ())]


@pytest.fixture(scope="module", params=[False, True], ids=["tp", "tp+sp"])
def tp_run(request):
    """P = 2 × T = 2: TP swaps each chunk's linears (zb defers the inner nn.Linear's weight gradient), SP
    halves the sequence that crosses a stage boundary."""
    return run_ranks(_run_pipeline, 4, CASES_TP, tp_size=2, sp=request.param, timeout=150)


def test_gradients_match_with_tensor_parallel(tp_run):
    _check_gradients(tp_run, CASES_TP, tp_size=2)


def test_each_gradient_reaches_the_synced_backward_once_with_tensor_parallel(tp_run):
    _check_arrivals(tp_run, CASES_TP)


def test_traced_messages_equal_the_prediction_with_tensor_parallel(tp_run):
    _check_traced(tp_run, CASES_TP)


# ---------------------------------------------------------------------------------------------------------
# 4. FP8 under the pipeline (fp8.Fp8Linear defers its own weight gradient under zb)
# ---------------------------------------------------------------------------------------------------------

FP8_STEPS, FP8_M, FP8_LAYERS = 3, 4, 4
FP8_CASES = [("zb", "current"), ("zb", "delayed"), ("zb", "blockwise"), ("1f1b", "delayed")]


def _fp8_pipeline(rank, world, cases):
    """FP8_STEPS optimizer steps of each (schedule, recipe) on P = 2: the stage model converted to FP8 after
    PP (DESIGN's order), torch's AdamW on the reference's parameter groups. Returns per case the losses, the
    parameters by global name, the FP8 linears whose weight gradient came through the store's W, each linear's
    delayed history, and the synced arrivals (each gradient exactly once a step)."""
    import fp8
    from mesh import build_mesh, infer_mesh_shape
    from optim import adamw_param_groups
    from reference import HYPER

    device = harness.device()
    mesh = build_mesh(infer_mesh_shape(world, pp=world), rank)
    out = {}
    for schedule, recipe in cases:
        config = make_config(n_layer=FP8_LAYERS)
        run = _stage_run(mesh, config, FP8_M, device)
        stages, handle = build(run, pp.PipelineConfig(mesh.size("pp"), schedule), dtype=torch.float64)
        fp8_handle = fp8.convert(stages, fp8.Recipe(recipe, 16, "max", 0), mesh)
        layout = StandInLayout(stages)
        optimizer = torch.optim.AdamW(adamw_param_groups(stages.parameters(), HYPER["weight_decay"]), lr=HYPER["lr"],
                                      betas=HYPER["betas"], eps=HYPER["eps"])
        through_w = set()
        store = handle.schedule.store
        if store is not None:  # record which parameters the deferred W's hand to autograd
            apply = store.apply

            def recording_apply(entries, apply=apply):
                before = {p: None if p.grad is None else p.grad.clone() for p in stages.parameters()}
                apply(entries)
                through_w.update(p.shard_info.global_name for p in stages.parameters()
                                 if p.grad is not None and (before[p] is None or not torch.equal(before[p], p.grad)))

            store.apply = recording_apply
        losses = []
        for x, y in global_batches(FP8_STEPS, FP8_M * MICRO, SEQ):
            batches = rank_micro_batches(x, y, 0, 1, MICRO)
            global_tokens = (y != -1).sum().to(device, torch.float64)
            result = handle.schedule.forward_backward(layout, stages, batches, global_tokens, 1.0, FP8_M,
                                                      nullcontext(), device)
            handle.after_grad_sync(layout)  # the tied embedding's sum
            fp8_handle.after_grad_sync(layout)  # the delayed roll
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(result.loss_sum / global_tokens))
        out[schedule, recipe] = dict(
            losses=losses, params={p.shard_info.global_name: p.detach().clone() for p in stages.parameters()},
            fp8_weights={linear.weight.shard_info.global_name for linear in fp8_handle.linears.values()},
            through_w=through_w, arrivals=dict(layout.arrivals),
            histories={name: linear.amax_history.clone() for name, linear in fp8_handle.linears.items()})
    return out


@pytest.fixture(scope="module")
def fp8_run():
    """Every FP8_CASES case on 2 ranks (one spawn), with reference_run's single-device FP8 model of each."""
    from reference import reference_run

    results = run_ranks(_fp8_pipeline, 2, FP8_CASES, timeout=180)
    references = {}
    for case in FP8_CASES:
        ref_losses, _, ref_params = reference_run(make_config(n_layer=FP8_LAYERS),
                                                  global_batches(FP8_STEPS, FP8_M * MICRO, SEQ),
                                                  micro_batches=FP8_M, fp8_recipe=case[1])
        references[case] = (ref_losses, ref_params)
    return results, references


@pytest.mark.slow
def test_fp8_under_zero_bubble_equals_the_single_device_fp8_model(fp8_run):
    """zb with --fp8 (current, delayed, blockwise) on P = 2, m = 4, three steps, against reference_run's FP8
    model (float64, 1e-10); 1F1B + delayed is the control without a deferred W."""
    results, references = fp8_run
    for case in FP8_CASES:
        ref_losses, ref_params = references[case]
        seen = set()
        for rank_results in results:
            r = rank_results[case]
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=TOL, atol=TOL,
                                       msg=str(case))
            for name, value in r["params"].items():
                torch.testing.assert_close(value, ref_params[name], rtol=TOL, atol=TOL, msg=f"{case} {name}")
                seen.add(name)
        assert seen == set(ref_params), case


@pytest.mark.slow
def test_fp8_gradients_reach_the_synced_backward_once_a_step(fp8_run):
    for case, r in _each(fp8_run[0], FP8_CASES):
        assert set(r["arrivals"].values()) == {FP8_STEPS}, (case, r["arrivals"])  # once a step (DDP's overlap)


@pytest.mark.slow
def test_fp8_weight_gradients_come_through_the_deferred_w(fp8_run):
    """Under zb the FP8 linears' W computes dW = dYᵀ·X from the FP8 dY and X stashed by I."""
    for case, r in _each(fp8_run[0], FP8_CASES):
        if case[0] == "zb":
            assert r["fp8_weights"] and r["fp8_weights"] <= r["through_w"], case


@pytest.mark.slow
def test_fp8_delayed_history_holds_the_amaxes_of_every_step(fp8_run):
    """The delayed history holds the dY amaxes too (its grad_output row), also when dY is used in W."""
    for case, r in _each(fp8_run[0], FP8_CASES):
        if case[1] == "delayed":
            for name, history in r["histories"].items():
                assert (history[:, :FP8_STEPS] > 0).all(), (case, name, history[:, :FP8_STEPS])


# ---------------------------------------------------------------------------------------------------------
# 5. Sent-buffer lifetimes, the handle's protocol, aux terms, the CUDA clock, the bubble note
# ---------------------------------------------------------------------------------------------------------


def _host_ops(steps, n_chunks):
    """What the interpreter's host does for one rank's plan: each step posts ONE batch (the step's receives,
    then the previous action's send), waits on the receive its action needs, waits on the step's releases,
    computes; the end posts the last send and waits on every send not released."""
    ops, previous, released = [], None, []
    for step in steps:
        batch = [("recv", msg) for msg in step.recvs] + ([("send", previous)] if previous is not None else [])
        ops += [("post", batch)] if batch else []
        need = sch.needs(step.action, n_chunks)
        ops += [("wait", ("recv", need))] if need is not None else []
        ops += [("wait", ("send", msg)) for msg in step.release]
        ops.append(("compute", step.action))
        released += step.release
        previous = step.send
    ops += [("post", [("send", previous)])] if previous is not None else []
    return ops + [("wait", ("send", s.send)) for s in steps if s.send is not None and s.send not in released]


def _run_blocking(plan, n_chunks, in_order):
    """Run every rank's host ops with blocking waits until all finish; None on a deadlock, else the peak of
    sent buffers alive per rank (posted, not yet waited; counted at each post). Two completion rules:
    gloo (in_order False): a send and its receive complete once both peers have posted them.
    NCCL (in_order True): a rank's batches run one at a time in posting order (its stream); a pair completes
    once both batches holding it run, a batch once all its pairs have, and a wait on an op waits for its batch."""
    P = len(plan)
    programs = [_host_ops(steps, n_chunks) for steps in plan]
    batches, where, done = [[] for _ in range(P)], {}, set()  # where: (rank, op) -> batch index

    def peer(rank, op):
        kind, msg = op
        return (msg.dst(P) if kind == "send" else msg.src(P)), ("recv" if kind == "send" else "send", msg)

    def running(rank, b):
        return b < len(batches[rank]) and (not in_order or b == 0 or batch_done(rank, b - 1))

    def pair_done(rank, op):
        other = peer(rank, op)
        return ((rank, op) in where and other in where and running(rank, where[rank, op])
                and running(other[0], where[other]))

    def batch_done(rank, b):
        if (rank, b) not in done and running(rank, b) and all(pair_done(rank, op) for op in batches[rank][b]):
            done.add((rank, b))
        return (rank, b) in done

    pc, live, peak = [0] * P, [set() for _ in range(P)], [0] * P
    progressed = True
    while progressed:
        progressed = False
        for r in range(P):
            while pc[r] < len(programs[r]):
                kind, arg = programs[r][pc[r]]
                if kind == "post":
                    for op in arg:
                        where[r, op] = len(batches[r])
                    batches[r].append(arg)
                    live[r] |= {op for op in arg if op[0] == "send"}
                    peak[r] = max(peak[r], len(live[r]))
                elif kind == "compute":
                    pass
                elif (r, arg) in where and (batch_done(r, where[r, arg]) if in_order else pair_done(r, arg)):
                    live[r].discard(arg)
                else:
                    break  # blocked in this wait
                pc[r], progressed = pc[r] + 1, True
    return peak if all(pc[r] == len(programs[r]) for r in range(P)) else None

RELEASE_GRID = [(s, P, m, v) for P in (2, 3, 4) for m in range(P, 17) for s, vs in
                (("gpipe", (1,)), ("1f1b", (1,)), ("zb", (1,)), ("interleaved", (2, 3))) for v in vs]


@functools.lru_cache(maxsize=None)
def _release_plan(s, P, m, v):
    return sch.communication_plan(sch.build_programs(s, P, m, v), P * v)


@functools.lru_cache(maxsize=None)
def _blocking_peaks(s, P, m, v, in_order):
    return _run_blocking(_release_plan(s, P, m, v), P * v, in_order)


def test_sends_are_released_once_after_their_post_in_posting_order():
    for s, P, m, v in RELEASE_GRID:
        where = f"{s} P={P} m={m} v={v}"
        for r, steps in enumerate(_release_plan(s, P, m, v)):
            posted, released = set(), []
            for j, step in enumerate(steps):
                assert all(msg in posted for msg in step.release), (where, r, j, "released before it was posted")
                released += step.release
                if j > 0 and steps[j - 1].send is not None:
                    posted.add(steps[j - 1].send)  # posted at step j: released from step j + 1 on
            sends = [step.send for step in steps if step.send is not None]
            assert released == sends[:len(released)], (where, r, "released out of posting order")
            assert len(set(released)) == len(released), (where, r, "released twice")


@pytest.mark.parametrize("in_order", [False, True], ids=["gloo", "nccl"])
def test_release_points_keep_every_schedule_deadlock_free(in_order):
    """Each send waited at its plan's release point: under gloo's and NCCL's completion rules no schedule
    deadlocks."""
    for s, P, m, v in RELEASE_GRID:
        assert _blocking_peaks(s, P, m, v, in_order) is not None, (s, P, m, v, "deadlocks")


@pytest.mark.parametrize("in_order", [False, True], ids=["gloo", "nccl"])
def test_live_sends_count_the_sent_buffers_a_rank_holds(in_order):
    """schedules.live_sends is the peak of sent buffers alive on the host (what the 2-rank run measures
    below); 1f1b's rank r holds P − r (without release points it was every send of the step: 2m on a middle
    1f1b rank)."""
    for s, P, m, v in RELEASE_GRID:
        plan = _release_plan(s, P, m, v)
        assert _blocking_peaks(s, P, m, v, in_order) == [sch.live_sends(steps) for steps in plan], (s, P, m, v)
        if s == "1f1b":
            assert [sch.live_sends(steps) for steps in plan] == [min(P - r, m) for r in range(P)], (s, P, m, v)


def test_the_deadlock_checker_can_fail():
    """Blocking sends (each waited at the next step) with receives posted only when needed deadlock
    interleaved P = 2: each rank waits in a send whose receive its peer posts after its own send."""
    plan = sch.communication_plan(sch.build_programs("interleaved", 2, 4, 2), 4)
    blocking = [[step._replace(recvs=[need] if (need := sch.needs(step.action, 4)) else [],
                               release=(steps[j - 1].send,) if j and steps[j - 1].send is not None else ())
                 for j, step in enumerate(steps)] for steps in plan]
    assert _run_blocking(blocking, 4, False) is None and _run_blocking(blocking, 4, True) is None


def _run_timed(plan, n_chunks, costs):
    """The host ops of every rank with times, under gloo's rule (a send and its receive complete at the later
    of their two posts; communication free): {action: start}. costs: one {kind: seconds} per rank."""
    P = len(plan)
    programs = [_host_ops(steps, n_chunks) for steps in plan]
    posted, clock, pc, start = {}, [0.0] * P, [0] * P, {}  # posted: (kind, message) -> time
    progressed = True
    while progressed:
        progressed = False
        for r in range(P):
            while pc[r] < len(programs[r]):
                kind, arg = programs[r][pc[r]]
                if kind == "post":
                    posted.update((op, clock[r]) for op in arg)
                elif kind == "compute":
                    start[arg], clock[r] = clock[r], clock[r] + costs[r][arg.kind]
                else:
                    pair = [("send", arg[1]), ("recv", arg[1])]
                    if not all(op in posted for op in pair):
                        break  # blocked in this wait
                    clock[r] = max([clock[r]] + [posted[op] for op in pair])
                pc[r], progressed = pc[r] + 1, True
    assert all(pc[r] == len(programs[r]) for r in range(P)), "deadlock"
    return start


def _skewed_costs(P, schedule):
    """Per-rank costs that are not the uniform ones the plan was built with: each rank slower than the one
    before it or faster, B from 1.2 to 2.6 forwards, I and W unequal."""
    out = []
    for factors in ([1 + 0.5 * r for r in range(P)], [1 + 0.5 * (P - 1 - r) for r in range(P)]):
        out.append([{"F": f, "B": f * (1.2 + 0.7 * (r % 3)), "I": f * 1.3, "W": f * 0.6}
                    for r, f in enumerate(factors)])
    return out


def test_a_send_is_released_after_a_message_its_receiver_sent_once_it_had_posted_the_receive():
    """The release rule itself: before waiting on a send, the rank has taken a message that the send's
    receiver posted in the batch holding the receive or in a later one (a batch posts its receives first)."""
    for s, P, m, v in RELEASE_GRID:
        plan = _release_plan(s, P, m, v)
        batch_of_recv, batch_of_send = {}, {}
        for steps in plan:
            for j, step in enumerate(steps):
                batch_of_recv.update((msg, j) for msg in step.recvs)
                if step.send is not None:
                    batch_of_send[step.send] = j + 1
        for r, steps in enumerate(plan):
            taken = []
            for j, step in enumerate(steps):
                if (need := sch.needs(step.action, P * v)) is not None:
                    taken.append(need)
                for msg in step.release:
                    assert any(y.src(P) == msg.dst(P) and batch_of_send[y] >= batch_of_recv[msg] for y in taken), \
                        (s, P, m, v, r, str(step.action), f"{msg} waited with no sign of its receive")


def test_release_waits_never_delay_an_action_whatever_the_costs():
    """Executed under gloo's rule (a send completes once its receive is posted) with costs unlike the
    uniform ones the plan was built with, every action starts when schedules.simulate starts it (only its
    input delays it): the waits on sent buffers never hold a rank up. Waiting on a send at the first
    action after its receive is posted in the uniform simulation held up a rank whose receiver ran behind
    (interleaved P = 2: 1.09× torch's step, a measured bubble of 22% against 5% simulated)."""
    for s, P, m, v in RELEASE_GRID:
        programs, plan = sch.build_programs(s, P, m, v), _release_plan(s, P, m, v)
        for costs in _skewed_costs(P, s):
            expected = {action: start for timeline in sch.simulate(programs, costs) for action, start, _ in timeline}
            assert _run_timed(plan, P * v, costs) == pytest.approx(expected), (s, P, m, v, costs)


class _FakeCudaEvent:
    """torch.cuda.Event for a CPU run: each record() stamps the next millisecond of a fake device clock."""

    log: list = []

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.stamp = None

    def record(self, stream=None):
        self.stamp = sum(entry[0] == "record" for entry in self.log)
        self.log.append(("record", self))

    def synchronize(self):
        self.log.append(("synchronize", self))

    def elapsed_time(self, end):
        self.log.append(("elapsed", self))
        assert self.stamp is not None and end.stamp is not None
        return float(end.stamp - self.stamp)


@contextmanager
def _sent_buffers_alive():
    """At each batch_isend_irecv: how many tensors this rank has sent (this batch's included) are alive, by
    weak reference: a buffer dies when the schedule drops its op and its work."""
    import weakref
    import torch.distributed as dist

    original, refs, counts = dist.batch_isend_irecv, [], []

    def counting(ops):
        refs.extend(weakref.ref(op.tensor) for op in ops if op.op.__name__ == "isend")
        counts.append(sum(ref() is not None for ref in refs))
        return original(ops)

    dist.batch_isend_irecv = counting
    try:
        yield counts
    finally:
        dist.batch_isend_irecv = original


class _Recorder(pp.PipelineObserver):
    """Writes down what the interpreter tells it: ("begin" | "end", what) in order."""

    def __init__(self):
        self.told = []

    @contextmanager
    def _span(self, what):
        self.told.append(("begin", what))
        yield
        self.told.append(("end", what))

    def step(self, device):
        return self._span("step")

    def action(self, action):
        return self._span(action)

    def p2p(self, name, nbytes=None):
        return self._span(name)


def _lifetime_checks(rank, world):
    from accounting import observers
    from mesh import build_mesh, infer_mesh_shape

    device = harness.device()
    mesh = build_mesh(infer_mesh_shape(world, pp=world), rank)
    out = {}

    def handle_for(schedule, m, config):
        run = _stage_run(mesh, config, m, device)
        v = 2 if schedule == "interleaved" else 1
        return build(run, pp.PipelineConfig(mesh.size("pp"), schedule, v), dtype=torch.float64)

    def step(stages, handle, m):
        x, y, batches = _case_batches(m, False)
        tokens = (y != -1).sum().to(device, torch.float64)
        return handle.schedule.forward_backward(StandInLayout(stages), stages, batches, tokens, 1.0, m, nullcontext(),
                                                str(device))

    # Sent buffers alive at once, 1f1b P = 2, m = 16, against the plan's bound.
    stages, handle = handle_for("1f1b", 16, make_config(n_layer=2))
    with _sent_buffers_alive() as counts:
        step(stages, handle, 16)
    out["live"], out["bound"] = max(counts), sch.live_sends(handle.schedule.plan(16))
    # The handle's protocol: after_grad_sync's count of non-finite values, the type of its prediction, and none
    # of the hooks that moved to report/axes.py or left the protocol.
    layout = StandInLayout(stages)
    out["protocol"] = dict(nonfinite=handle.after_grad_sync(layout), predicted=type(handle.predicted_messages(layout)),
                           own=set(vars(pp.Pipeline)))
    # The CUDA clock, with a fake event and no device: two events per action and one for the step's start and
    # end, read after the last record, one event synchronize, never a device-wide one.
    real_event, real_sync = torch.cuda.Event, torch.cuda.synchronize

    def device_wide(*args):
        raise AssertionError("torch.cuda.synchronize() inside the pipeline step")

    _FakeCudaEvent.log.clear()
    stages, handle = handle_for("zb", 3, make_config(n_layer=2))
    handle.observe(observers.ActionClock(cuda=True))  # what a step on a CUDA device gets
    torch.cuda.Event, torch.cuda.synchronize = _FakeCudaEvent, device_wide
    try:
        step(stages, handle, 3)
    finally:
        torch.cuda.Event, torch.cuda.synchronize = real_event, real_sync
    out["cuda_log"] = [entry[0] for entry in _FakeCudaEvent.log]
    out["cuda_timing"], out["cuda_events"] = handle.observer.timings[-1], handle.observer.events
    # Nobody watches a schedule by default; an observer it is given is told what the interpreter does, in order.
    out["default_observer"] = type(pp.PipelineSchedule(pp.PipelineConfig(2, "zb"), mesh, 2).observer)
    stages, handle = handle_for("zb", 3, make_config(n_layer=2))
    handle.observe(_Recorder())
    step(stages, handle, 3)
    out["told"], out["plan"] = handle.observer.told, handle.schedule.plan(3)
    # Evaluation and sampling through the stages leave no aux term behind (a MoE router adds two per forward).
    config = make_config(n_layer=2, moe_experts=4, moe_topk=2)
    stages, handle = handle_for("1f1b", 2, config)
    _, _, batches = _case_batches(2, False)
    handle.schedule.forward_only(StandInLayout(stages), stages, batches, nullcontext(), device)
    out["aux_after_eval"] = len(stages.aux_losses.terms)
    with handle.sampling():
        sampled = stages.generate(torch.zeros(1, 1, dtype=torch.long, device=device), 6,
                                  generator=torch.Generator(device).manual_seed(0))
    out["aux_after_sampling"], out["sampled"] = len(stages.aux_losses.terms), sampled
    return out


@pytest.fixture(scope="module")
def lifetime_run():
    """P = 2: 1f1b with m = 16 and its sent buffers; zb with m = 3 under a fake CUDA clock; a MoE model
    evaluated and sampled through the stages."""
    return run_ranks(_lifetime_checks, 2, timeout=120)


ZB_ACTIONS = 9  # zb, m = 3 on either rank: 3 F, 3 I, 3 W


def test_a_rank_holds_the_plans_count_of_sent_buffers(lifetime_run):
    """1f1b with m = 16 holds at most 2 sent buffers at once on a rank (live_sends: 2 on rank 0, 1 on rank
    1), not every send of the step (16)."""
    assert [r["bound"] for r in lifetime_run] == [2, 1]
    assert [r["live"] for r in lifetime_run] == [r["bound"] for r in lifetime_run]


def test_the_handle_speaks_the_axis_protocol(lifetime_run):
    for r in lifetime_run:
        assert r["protocol"]["nonfinite"] == 0 and r["protocol"]["predicted"] is Messages
        moved = {"startup_lines", "end_lines", "step_lines", "groups", "before_step", "after_step",
                 "local_nonfinite", "gather_codecs", "state_loaded"}
        assert not moved & r["protocol"]["own"], moved & r["protocol"]["own"]


def test_cuda_actions_are_timed_by_events_read_once_at_the_end(lifetime_run):
    for r in lifetime_run:
        log = r["cuda_log"]
        assert log.count("record") == 2 * ZB_ACTIONS + 2 and log.count("synchronize") == 1
        last_record = max(i for i, kind in enumerate(log) if kind == "record")
        assert log.index("synchronize") > last_record and log.index("elapsed") > last_record


def test_cuda_event_times_give_the_step_timings(lifetime_run):
    for r in lifetime_run:
        wall, busy, by_kind, _ = r["cuda_timing"]
        # Fake stamps: the step's start is 0 ms, action k spans (2k+1, 2k+2) ms, the end is 2·actions + 1 ms.
        assert abs(wall - (2 * ZB_ACTIONS + 1) / 1e3) < 1e-12 and abs(busy - ZB_ACTIONS / 1e3) < 1e-12
        assert sorted(by_kind) == ["F", "I", "W"] and all(abs(t - 1e-3) < 1e-12 for ts in by_kind.values() for t in ts)
        computes = [e for e in r["cuda_events"] if e["cat"] == "compute"]
        spans = [t for e in computes for t in (e["start"], e["end"])]
        assert spans == pytest.approx([(k + 1) / 1e3 for k in range(2 * ZB_ACTIONS)], abs=1e-12)


def test_nobody_watches_the_interpreter_by_default_and_an_observer_is_told_each_action_and_p2p_call(lifetime_run):
    for r in lifetime_run:
        assert r["default_observer"] is pp.PipelineObserver
        told, plan = r["told"], r["plan"]
        assert told[0] == ("begin", "step") and told[-1] == ("end", "step")
        inner = told[1:-1]
        assert all(what != "step" for _, what in inner)
        # Each span closes before the next opens (no action inside a p2p call, nor the reverse).
        assert [edge for edge, _ in inner] == ["begin", "end"] * (len(inner) // 2)
        assert all(inner[i][1] == inner[i + 1][1] for i in range(0, len(inner), 2))
        spans = [what for edge, what in inner if edge == "begin"]
        assert [what for what in spans if isinstance(what, sch.Action)] == [s.action for s in plan]
        label = lambda msg: f"{msg.kind} {msg.mb}.{msg.chunk}"  # noqa: E731
        waits = [label(n) for s in plan for n in [sch.needs(s.action, 2)] if n is not None]
        assert [what[len("wait "):] for what in spans if isinstance(what, str) and what.startswith("wait ")] == waits
        releases = [label(msg) for s in plan for msg in s.release]
        assert [what[len("release "):] for what in spans
                if isinstance(what, str) and what.startswith("release ")] == releases
        posted = [name for name in spans if isinstance(name, str) and name.startswith("post ")]
        assert sum(name.count("recv ") for name in posted) == sum(len(s.recvs) for s in plan)
        assert sum(name.count("send ") for name in posted) == sum(s.send is not None for s in plan)


def test_the_accounting_reads_the_pipeline_handle_through_facts_and_its_observer_only():
    """report/pipeline.py (the pp section), report/axes.py's observe, accounting/activations.py, planner/time_model.py's
    pp branch and the bench read the pp handle (a variable `axis` or `handle`) through step.Axis's methods, `facts()`
    and `observer` (the clock the accounting subscribed), never its schedule; report/run.py reads nothing of a schedule
    beyond step.GradientAccumulation's protocol; pipeline.py imports no accounting file (accounting/measure.py reads no
    pp)."""
    import ast

    import step

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    allowed = {name for name, value in vars(step.Axis).items() if callable(value) and not name.startswith("_")}
    allowed |= {"name", "facts", "observer", "observe"}
    protocol = {name for name in vars(step.GradientAccumulation) if not name.startswith("_")}
    protocol |= {"forward_observer"}  # set in its __init__
    read, of_schedule = set(), set()
    for path in ("report/pipeline.py", "report/axes.py", "report/run.py", "accounting/activations.py",
                 "planner/time_model.py", "bench/bench_pipeline.py"):
        tree = ast.parse(open(os.path.join(root, path)).read())
        scopes = [tree]
        if path == "report/axes.py":  # observe only: the other axes' sections read their own handles
            scopes = [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == "observe"]
        if path == "planner/time_model.py":  # the pp branch of role_of
            scopes = [node for node in ast.walk(tree) if isinstance(node, ast.If)
                      and ast.unparse(node.test) == "axis.name == 'pp'"]
            assert len(scopes) == 1
        for node in (node for scope in scopes for node in ast.walk(scope) if isinstance(node, ast.Attribute)):
            if isinstance(node.value, ast.Name) and node.value.id in ("axis", "handle"):
                read.add(node.attr)
            if isinstance(node.value, ast.Attribute) and node.value.attr == "schedule":
                of_schedule.add(node.attr)
    assert read <= allowed, read - allowed
    assert of_schedule <= protocol, of_schedule - protocol
    tree = ast.parse(open(os.path.join(root, "pipeline.py")).read())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not {"mfu", "observers", "report", "report_axes", "report_pipeline", "time"} & imported, imported


def test_evaluation_and_sampling_leave_no_aux_term_behind(lifetime_run):
    for r in lifetime_run:
        assert r["aux_after_eval"] == 0 and r["aux_after_sampling"] == 0


def test_every_pp_rank_samples_alike(lifetime_run):
    assert torch.equal(lifetime_run[0]["sampled"], lifetime_run[1]["sampled"])


UNIFORM_COSTS = [{"F": 1.0, "B": 2.0}] * 2


def test_bubble_note_is_empty_when_nothing_the_run_sees_explains_a_difference():
    assert report.pipeline.pp_bubble_note(UNIFORM_COSTS, 0.2, ranks=2, threads=1, cores=2) == ""
    # GPUs: elsewhere
    assert report.pipeline.pp_bubble_note(UNIFORM_COSTS, 0.2, ranks=4, threads=8, cores=2, cpu=False) == ""


def test_bubble_note_names_ranks_sharing_cores():
    shared = report.pipeline.pp_bubble_note(UNIFORM_COSTS, 0.25, ranks=4, threads=1, cores=2)
    assert "4 ranks × 1 thread share 2 cores" in shared and "costs" not in shared.split(".")[0]
    assert shared.endswith("simulation with the measured costs, 25.0%")


def test_bubble_note_names_other_processes_loading_the_cores():
    loaded = report.pipeline.pp_bubble_note(UNIFORM_COSTS, 0.25, ranks=2, threads=1, cores=2, load=10.3)
    assert "load average is 10.3 on 2 cores" in loaded and "2 ranks" not in loaded
    assert report.pipeline.pp_bubble_note(UNIFORM_COSTS, 0.25, ranks=2, threads=1, cores=2, load=1.9) == ""


def test_bubble_note_names_costs_that_are_not_uniform():
    slower = report.pipeline.pp_bubble_note([{"F": 1.0, "B": 2.9}, {"F": 1.5, "B": 3.0}], 0.31, ranks=2, threads=1,
                                            cores=2)
    assert "F differs 1.50× between stages" in slower and "B/F 2.00..2.90, uniform 2" in slower
    assert "wait on slower peers" in slower and "cores" not in slower and slower.endswith("costs, 31.0%")
    zb = report.pipeline.pp_bubble_note([{"F": 1.0, "I": 1.05, "W": 0.5}], 0.1, ranks=1, threads=1, cores=2)
    assert "W/F 0.50..0.50, uniform 1" in zb and "I/F" not in zb
