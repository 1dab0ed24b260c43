"""planner/cpu_probe.py's formulas (and hardware.alpha_beta, the link's fit they feed): each checked against the model
it inverts, on figures built from known constants, so a wrong algebra cannot pass."""

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from accounting import memory
from cli import flags
import mfu
from planner import calibration, hardware, time_model
import train
from harness import run_ranks
import model as model_lib
from planner import cpu_probe
from planner.cpu_probe import gemm_fraction, overlap_fraction
from step import Messages


@pytest.mark.parametrize("world", [2, 4])
def test_alpha_beta_recovers_the_link_that_made_the_times(world):
    """t(M) = 2(N−1)·α + wire(M)/β at two sizes, from α = 300 µs and β = 0.8 GB/s: the fit returns them
    (to 1e-9 relative), and hardware.collective_seconds with them reproduces both times."""
    alpha, beta, sizes = 300e-6, 0.8e9, (4096, 4 << 20)
    steps = hardware.ring_steps("all_reduce", world)
    times = tuple(steps * alpha + mfu.wire_bytes("all_reduce", m, world) / beta for m in sizes)
    fit_alpha, fit_beta = hardware.alpha_beta("all_reduce", sizes, times, world)
    assert math.isclose(fit_alpha, alpha, rel_tol=1e-9) and math.isclose(fit_beta, beta, rel_tol=1e-9)
    hw = hardware.Hardware("fit", {"fp32": 1.0}, 20.0, 0.0, fit_beta / 1e9, fit_beta / 1e9, fit_alpha * 1e6,
                           fit_alpha * 1e6, gpus_per_node=world)
    for m, t in zip(sizes, times):
        assert math.isclose(hardware.collective_seconds("all_reduce", 1, m, list(range(world)), hw), t, rel_tol=1e-9)


def test_alpha_beta_stays_finite_when_noise_inverts_the_sizes():
    """The larger size timed faster (a preempted small one): β from the large one alone, α ≥ 0, both finite."""
    alpha, beta = hardware.alpha_beta("all_reduce", (4096, 4 << 20), (5e-3, 4e-3), 2)
    assert alpha >= 0 and math.isfinite(beta) and math.isclose(beta, (4 << 20) / 4e-3)


def test_link_fit_charges_the_tail_per_call_and_takes_beta_from_the_medians():
    """Calls at 4 KiB and 4 MiB from α = 100 µs, β = 2 GB/s, where a quarter of the calls at each size wait a
    4 ms scheduler slice more: β comes back exactly (the medians miss the tail), α carries the small calls'
    mean tail per ring step (α + ¼·4 ms / steps), and collective_seconds with them prices a small call at its
    mean time, the tail included."""
    alpha, beta, sizes, world, tail = 100e-6, 2e9, (4096, 4 << 20), 2, 4e-3
    steps = hardware.ring_steps("all_reduce", world)
    clean = [steps * alpha + mfu.wire_bytes("all_reduce", m, world) / beta for m in sizes]
    small = [clean[0] + (tail if i % 4 == 0 else 0.0) for i in range(40)]
    large = [clean[1] + (tail if i % 4 == 0 else 0.0) for i in range(9)]
    mean_small = sum(small) / len(small)
    fit_alpha, fit_beta = hardware.link_fit("all_reduce", sizes, mean_small, hardware.median(small),
                                            hardware.median(large), world)
    assert math.isclose(fit_beta, beta, rel_tol=1e-9)
    assert math.isclose(fit_alpha, alpha + tail / 4 / steps, rel_tol=1e-9)
    hw = hardware.Hardware("fit", {"fp32": 1.0}, 20.0, 0.0, fit_beta / 1e9, fit_beta / 1e9, fit_alpha * 1e6,
                           fit_alpha * 1e6, gpus_per_node=world)
    assert math.isclose(hardware.collective_seconds("all_reduce", 1, sizes[0], [0, 1], hw), mean_small, rel_tol=1e-9)


def test_gemm_fraction_prices_the_measured_block_at_its_time():
    """e = F / (peak·(t − bytes/HBM)): calibration.compute_seconds with e gives back t exactly."""

    flops, seconds, nbytes, hbm, peak = 3.2e8, 0.02, 4e7, 20e9, 60e9
    e = gemm_fraction(flops, seconds, nbytes, hbm, peak)
    calib = calibration.Calibration(gemm_fraction=e, gemm_half_dim=0.0, hbm_fraction=1.0, link_fraction=1.0)
    assert math.isclose(calibration.compute_seconds([(flops, 64)], 1.0, peak, nbytes, hbm, calib), seconds)
    assert gemm_fraction(flops, 1e-3, nbytes, hbm, peak) == flops / (peak * 1e-4)  # bytes' time > t: a tenth left


def test_overlap_fraction_of_hidden_serial_and_partial_transfers():
    """Fully hidden (t_both = max): 1; taking turns (t_both = sum): 0; half the shorter hidden: 0.5; clamped."""
    assert overlap_fraction(10.0, 4.0, 10.0) == 1.0
    assert overlap_fraction(10.0, 4.0, 14.0) == 0.0
    assert overlap_fraction(10.0, 4.0, 12.0) == 0.5
    assert overlap_fraction(10.0, 4.0, 20.0) == 0.0 and overlap_fraction(10.0, 4.0, 8.0) == 1.0


def test_the_overlap_share_exposes_what_each_rule_would_hide():
    """time_model.predict on one DDP role (its gradient all-reduce overlaps the backward): φ = 1 is the rules'
    own exposure, φ = 0 exposes every transfer whole (step = compute + update + Σ transfers), φ = ½ exposes
    half of what φ = 1 hides; a message no rule hides (the step's scalars) is whole under every φ."""
    role = time_model.Role(
        rank=0, coords={}, local_params=0, logical={}, persistent={"total": 4e6}, activations=None, temporaries={},
        messages=Messages({("all_reduce", "dp_cp"): (3, 3e6), ("all_reduce", "world"): (1, 16)}),
        group_ranks={"dp_cp": [0, 1], "world": [0, 1]}, flops=SimpleNamespace(model=1.0), bubble=0.0,
        last_bucket=1e6, first_gather=0.0)
    layout = dict(world=2, tokens=1024, m=1, zero=0, P=1, dtype="fp32", gemms=[(3e5, 64)], memory_bytes=1e6)
    hw = hardware.Hardware("cpu", {"fp32": 0.05}, 20.0, 0.0, 0.5, 0.5, 200.0, 200.0, gpus_per_node=2)
    by_phi = {phi: time_model.predict(role, layout, dataclasses.replace(hw, overlap=phi)) for phi in (1.0, 0.5, 0.0)}
    grads, scalars = ("all_reduce", "dp_cp"), ("all_reduce", "world")
    full, whole = by_phi[1.0], by_phi[0.0]
    assert full.exposed[grads] < full.total[grads]  # the rule hides part of it behind the backward
    assert whole.exposed == whole.total and whole.total == full.total
    assert math.isclose(by_phi[0.5].exposed[grads], (full.exposed[grads] + full.total[grads]) / 2)
    assert all(p.exposed[scalars] == p.total[scalars] for p in by_phi.values())
    assert math.isclose(whole.step, whole.compute + whole.update + sum(whole.total.values()))


@pytest.mark.parametrize("t", [1, 2])
def test_probe_flops_are_what_the_probes_run(t):
    """probe_flops counts one forward+backward of this rank's shard: torch's FLOP counter on the shaped block's
    linears (attention's CPU kernel is not counted by it: its 12·s·h/T per token added) and on the ends' head
    (6·h·V/T per token) gives the same figures. Before, the block's FLOPs were the full widths' at T = 2: twice
    what the shard runs, so e read twice too high and TP's compute was predicted at half its time."""
    config, b, s = model_lib.PRESETS["tiny"], 4, 64
    block, ends = cpu_probe.shaped_block(config, t), cpu_probe.ShapedEnds(config, t)
    with FlopCounterMode(display=False) as counter:
        block(torch.randn(b, s, config.n_embd, requires_grad=True)).sum().backward()
    linears = counter.get_total_flops()
    with FlopCounterMode(display=False) as counter:
        ends(torch.randint(ends.vocab, (b, s))).backward()
    block_flops, ends_flops = cpu_probe.probe_flops(config, b * s, s, t)
    assert block_flops == linears + 12 * s * config.n_embd * b * s / t
    assert ends_flops == counter.get_total_flops()


def test_the_head_class_runs_at_the_ends_rate():
    """compute_seconds with a measured ends_fraction: the blocks' classes at e give L·t_block, the head class at
    e_ends gives t_ends, so the pass is priced at L·t_block + t_ends (each fraction from gemm_fraction)."""
    config, tokens, peak, hbm = model_lib.PRESETS["tiny"], 256, 60e9, 20e9
    t_block, t_ends = 4e-3, 1.5e-3
    block_flops, ends_flops = cpu_probe.probe_flops(config, tokens, 64, 1)
    calib = calibration.Calibration(
        gemm_fraction=gemm_fraction(block_flops, t_block, 0.0, hbm, peak), gemm_half_dim=0.0, hbm_fraction=1.0,
        link_fraction=1.0, ends_fraction=gemm_fraction(ends_flops, t_ends, 0.0, hbm, peak))
    classes = calibration.gemms(config, memory.param_counts(config), tokens, 64, 1, False, False)
    seconds = calibration.compute_seconds(classes, tokens, peak, 0.0, hbm, calib)
    assert math.isclose(seconds, config.n_layer * t_block + t_ends, rel_tol=1e-12)


def test_update_seconds_steps_fresh_tensors_and_leaves_the_run_s_alone(monkeypatch):
    """update_seconds times fresh tensors shaped as the ones given: those are left bitwise as they were; past
    PROBE_ELEMENTS it times a prefix and scales by elements (here 20 of 50: the figure is ×2.5 the timed one)."""
    tensors = [torch.randn(30), torch.randn(20)]
    before = [t.clone() for t in tensors]
    assert cpu_probe.update_seconds(tensors) > 0
    assert all(torch.equal(a, b) for a, b in zip(tensors, before))
    monkeypatch.setattr(cpu_probe, "PROBE_ELEMENTS", 20)
    monkeypatch.setattr(cpu_probe.time, "perf_counter", iter(range(0, 100, 1)).__next__)  # every pass: 1 s
    assert cpu_probe.update_seconds(tensors) == 2.5


def test_the_step_scalars_block_though_they_share_ddp_s_gradient_key():
    """DDP's gradient buckets and the step's two scalars (the token count, the logged loss: step.scalar_messages)
    are one (all_reduce, dp_cp) row. With a backward long enough to hide every bucket but the last, the exposed
    time is the last bucket plus both scalars whole (before, the scalars hid behind the backward with the buckets)."""
    buckets, bucket = 3, 1e6
    role = time_model.Role(
        rank=0, coords={}, local_params=0, logical={}, persistent={"total": 4e6}, activations=None, temporaries={},
        messages=Messages({("all_reduce", "dp_cp"): (buckets + 2, buckets * bucket + 16)}),
        group_ranks={"dp_cp": [0, 1]}, flops=SimpleNamespace(model=1.0), bubble=0.0, last_bucket=bucket,
        first_gather=0.0)
    layout = dict(world=2, tokens=1024, m=1, zero=0, P=1, dtype="fp32", gemms=[(3e9, 64)], memory_bytes=0.0)
    hw = hardware.Hardware("cpu", {"fp32": 0.05}, 20.0, 0.0, 0.5, 0.5, 200.0, 200.0, gpus_per_node=2)
    prediction = time_model.predict(role, layout, hw)

    def one(nbytes):
        return hardware.collective_seconds("all_reduce", 1, nbytes, [0, 1], hw)

    assert prediction.compute * 2 / 3 > buckets * one(bucket)  # the backward could hide every bucket
    assert math.isclose(prediction.exposed[("all_reduce", "dp_cp")], one(bucket) + 2 * one(8), rel_tol=1e-12)
    assert math.isclose(prediction.total[("all_reduce", "dp_cp")], buckets * one(bucket) + 2 * one(8), rel_tol=1e-12)


def test_a_forward_is_priced_at_a_third_of_the_step_s_compute_with_or_without_recompute():
    """time_model.forward_compute (the price the layout factor ρ divides the run's own forward by): without recompute
    a third of predict's compute; with it, of the recomputing layout's classes the share 1/4 (its block and attention
    classes hold 8 of 6 FLOPs per weight) and of the head 1/3, the same forward; ρ multiplies predict's compute."""
    settings = time_model.plan_settings(flags.parse(["--plan", "--world", "2", "--preset", "tiny"], train.AXES,
                                                    prog="plan.py"))
    role = time_model.Role(
        rank=0, coords={}, local_params=0, logical={}, persistent={"total": 4e6}, activations=None, temporaries={},
        messages=Messages(), group_ranks={}, flops=SimpleNamespace(model=1.0), bubble=0.0, last_bucket=0.0,
        first_gather=0.0)
    hw = hardware.Hardware("cpu", {"bf16": 0.05}, 20.0, 0.0, 0.5, 0.5, 200.0, 200.0, gpus_per_node=2)
    plain = time_model.layout_facts(settings)
    settings.model.activation_checkpointing = True
    recomputing = time_model.layout_facts(settings)
    compute = time_model.predict(role, plain, hw).compute
    forward = time_model.forward_compute(role, plain, hw, recompute=False)
    assert math.isclose(forward, compute / 3, rel_tol=1e-12)
    assert math.isclose(time_model.forward_compute(role, recomputing, hw, recompute=True), forward, rel_tol=1e-12)
    factor = dataclasses.replace(hw, calibration=dataclasses.replace(hw.calibration, layout_factor=1.5))
    assert math.isclose(time_model.predict(role, plain, factor).compute, 1.5 * compute, rel_tol=1e-12)


PROBED = [["--fp8", "delayed"], ["--moe-experts", "4", "--ep", "2", "--moe-replicas", "6"],
          ["--moe-experts", "4", "--ep", "2", "--moe-score", "sigmoid", "--moe-bias-rate", "0.001"], ["--tp", "2"],
          ["--dropout", "0.1"]]


def _step_after_the_forward_probe(rank, world, cases):
    """For each case: two fresh runs from the same seed take one training step on the same batch, the second after
    cpu_probe.forward_pass_seconds (the layout factor's start-up pass); whether every checkpointed tensor (the
    layout's and the axes' state pieces) ends bitwise equal."""
    from contextlib import nullcontext

    from planner import cpu_probe
    from planner import time_model
    from mesh import build_mesh
    from optim import DynamicLossScaler
    from reference import global_batches, rank_micro_batches
    from step import train_step

    out = []
    for case in cases:
        argv = ["--preset", "tiny", "--dtype", "fp32", "--seq-len", "32", "--global-batch", "4", "--micro-batch", "1",
                *case]
        finals = []
        for probe in (False, True):
            settings = time_model.plan_settings(flags.validate(flags.build_parser().parse_args(argv), world,
                                                               axes=train.AXES))
            torch.manual_seed(0)
            run = train.Run(settings=settings, mesh=build_mesh(settings.shape, rank), config=settings.model,
                            device=torch.device("cpu"), seed=0, compute_dtype=torch.float32, autocast=nullcontext())
            train.compose(run)
            step_batches, probe_batches = (
                [(*b, None) for b in rank_micro_batches(x, y, run.mesh.index("dp"), run.mesh.size("dp"),
                                                        run.micro_batch_size)]
                for x, y in global_batches(2, 4, run.seq_len, run.config.vocab_size))
            for axis in run.axes:
                step_batches, probe_batches = axis.shard_batches(step_batches), axis.shard_batches(probe_batches)
            if probe:  # another batch, as the start-up's validation batch is
                cpu_probe.forward_pass_seconds(run, probe_batches, passes=1)
            train_step(run.layout, DynamicLossScaler(enabled=False), step_batches, run.mesh.group("dp_cp"), 1.0,
                       run.autocast, run.device, model=run.model, schedule=run.schedule, axes=run.axes,
                       data_size=run.mesh.size("dp"))
            finals.append([p.tensor.detach().clone() for p in run.layout.state_pieces()
                           + [q for axis in run.axes for q in axis.state_pieces()]])
        out.append(len(finals[0]) == len(finals[1]) and all(torch.equal(a, b) for a, b in zip(*finals)))
    return out


def test_the_forward_probe_leaves_the_next_step_as_it_was():
    """A step after the start-up's forward-only pass ends bitwise where it ends without it: FP8 delayed (its amaxes
    recorded in a training forward only), the replicas' and the router bias's routed loads, TP, and dropout (the
    pass runs in eval mode: a training forward would draw masks from the generator and move the step's own; so it
    fails when the pass runs in train mode). 2 gloo ranks."""
    results = run_ranks(_step_after_the_forward_probe, 2, PROBED)
    assert all(all(r) for r in results), list(zip(map(" ".join, PROBED), *results))
