"""ddp.py: data-parallel training performs the single-device update on the global batch.

Each spawned run (ranks from the harness, a module-scoped fixture shared by one test per property) runs a
few optimizer steps with ddp.py and step.train_step in float64, and the tests compare losses, gradient norms
and final parameters with tests/reference.py's single-device run on the same global batches (torch's AdamW
and clip_grad_norm_), the all-reduces per step with the buckets and the prediction, and the start-up line.
float64 sums in a different order agree to ~1e-15 relative; the stated tolerance is 1e-10. Each rank builds on
harness.device() (its GPU under nccl); the batches stay on the CPU, as train.py's sampler makes them, and
train_step moves them.
"""

from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist

import harness
from harness import run_ranks
from reference import HYPER, global_batches, rank_micro_batches, reference_run, make_config

STEPS, SEQ = 3, 16
TOL = 1e-10


def _train_ddp(rank, world, global_batch, micro, clip, bucket_mb):
    import report.axes
    from ddp import DistributedDataParallel
    from accounting.tracer import CommTracer
    from reference import build_model
    from optim import DynamicLossScaler, build_adamw
    from ddp import DDPLayout
    from step import train_step

    device = harness.device()
    config = make_config()
    model = build_model(config, seed=0, dtype=torch.float64, device=device)
    group = dist.new_group(list(range(world)))
    ddp = DistributedDataParallel(model, group=group, bucket_mb=bucket_mb)
    optimizer = build_adamw(model.parameters(), HYPER["lr"], HYPER["weight_decay"], HYPER["betas"], HYPER["eps"])
    layout = DDPLayout(ddp, optimizer)
    scaler = DynamicLossScaler(enabled=False)
    tracer = CommTracer()
    tracer.name_group(group, "dp")
    losses, norms, calls = [], [], []
    for x, y in global_batches(STEPS, global_batch, SEQ):
        batches = rank_micro_batches(x, y, rank, world, micro)
        with tracer:
            outcome = train_step(layout, scaler, batches, group, clip, nullcontext(), device)
        calls.append(tracer.records[("all_reduce", "dp")].calls)
        tracer.reset()
        losses.append(outcome.loss)
        norms.append(outcome.grad_norm)
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return dict(losses=losses, norms=norms, params=params, buckets=len(ddp.buckets), calls=calls,
                predicted=dict(layout.predicted_messages()), bucket_bytes=sum(ddp.bucket_sizes_bytes()),
                startup=report.axes.ddp_startup_lines(layout))


CASES = {  # (world, global batch, B_μ, clip, bucket MiB)
    "one bucket": (2, 4, 2, 0.0, 25.0),  # one micro-batch per rank, one bucket
    "clipped, many buckets": (2, 8, 1, 0.05, 0.01),  # 4 accumulation steps, clipping active, many small buckets
    "4 ranks": (4, 8, 1, 0.05, 0.02),  # 4 ranks, 2 accumulation steps
}


@pytest.fixture(scope="module", params=list(CASES))
def ddp_case(request):
    """One spawn per case and its single-device reference: (case, reference (losses, norms, params), ranks)."""
    world, global_batch, micro, clip, bucket_mb = case = CASES[request.param]
    reference = reference_run(make_config(), global_batches(STEPS, global_batch, SEQ), clip=clip)
    return case, reference, run_ranks(_train_ddp, world, global_batch, micro, clip, bucket_mb, timeout=120)


def test_ddp_losses_match_single_device(ddp_case):
    _, (ref_losses, _, _), ranks = ddp_case
    for result in ranks:
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses), rtol=TOL, atol=TOL)


def test_ddp_grad_norms_match_single_device(ddp_case):
    (_, _, _, clip, _), (_, ref_norms, _), ranks = ddp_case
    if clip:
        assert min(ref_norms) > clip  # clipping really is active
    for result in ranks:
        torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(ref_norms), rtol=TOL, atol=TOL)


def test_ddp_parameters_match_single_device(ddp_case):
    _, (_, _, ref_params), ranks = ddp_case
    for result in ranks:
        for name, ref in ref_params.items():
            torch.testing.assert_close(result["params"][name], ref, rtol=TOL, atol=TOL, msg=name)


def test_one_all_reduce_per_bucket_per_step(ddp_case):
    """Per step: one all-reduce per bucket (none on accumulation micro-steps), plus the token count and the
    logged loss (the finite flag goes over the world group, not this one); and that is what the layout
    predicts: one all_reduce per bucket, payload the buckets' bytes."""
    (_, _, _, _, bucket_mb), _, ranks = ddp_case
    for result in ranks:
        assert result["calls"] == [result["buckets"] + 2] * STEPS
        assert result["predicted"] == {("all_reduce", "dp_cp"): (result["buckets"], result["bucket_bytes"])}
        if bucket_mb < 1:
            assert result["buckets"] > 3


def test_startup_line_names_the_bucket_count(ddp_case):
    """The startup line names the buckets it counts: "in 1 bucket", "in 7 buckets"."""
    _, _, ranks = ddp_case
    for result in ranks:
        expected = "in 1 bucket," if result["buckets"] == 1 else f"in {result['buckets']} buckets,"
        assert any(expected in line for line in result["startup"]), (expected, result["startup"])


def _different_init(rank, world):
    from ddp import DistributedDataParallel
    from reference import build_model

    model = build_model(make_config(), seed=rank, device=harness.device())  # a bug: each rank a different seed
    try:
        DistributedDataParallel(model)
    except RuntimeError as e:
        return str(e)
    return None


def test_ddp_refuses_different_initial_weights():
    messages = run_ranks(_different_init, 2, timeout=60)
    assert all(m is not None and "--seed" in m and "transformer.wte.weight" in m for m in messages)


def test_buckets_taper_towards_the_end_of_backward():
    """The `small` model at K = 25 MiB: the buckets hold every parameter once, in reverse registration order, none
    over K; counted from the end of backward, bucket j holds at most 2^j MiB (or one larger parameter), so the
    one all-reduce left once backward ends is ≤ 1 MiB. Without the taper the last bucket is ~16 MiB."""
    from ddp import TAPER_BYTES, reverse_order_buckets
    from model import config_from_preset
    from reference import build_model

    params = list(build_model(config_from_preset("small"), device="meta").parameters())
    limit = 25 * 2**20
    buckets = reverse_order_buckets(params, limit, taper=True)
    assert [p for bucket in buckets for p in bucket] == params[::-1]  # launch order = reverse registration
    sizes = [sum(p.numel() * p.element_size() for p in bucket) for bucket in buckets]
    for j, (bucket, size) in enumerate(zip(buckets[::-1], sizes[::-1])):
        assert size <= min(limit, TAPER_BYTES * 2**j) or len(bucket) == 1, (j, size, len(bucket))
    untapered = sum(p.numel() * p.element_size() for p in reverse_order_buckets(params, limit)[-1])
    assert sizes[-1] <= TAPER_BYTES < 15 * 2**20 < untapered
    assert len(buckets) <= -(-sum(sizes) // limit) + 5  # a handful more all-reduces than ⌈bytes / K⌉


def _overlap_order(rank, world):
    """Buckets are launched during backward (before finish_grad_sync), in index order."""
    from ddp import DistributedDataParallel
    from model import config_from_preset
    from reference import build_model

    device = harness.device()
    model = build_model(make_config(), seed=0, device=device)
    ddp = DistributedDataParallel(model, bucket_mb=0.01)
    launched = []
    original = ddp._launch
    ddp._launch = lambda bucket: (launched.append(bucket.index), original(bucket))
    x = torch.randint(0, 256, (2, SEQ), device=device)
    _, loss_sum, _ = ddp(x, x)
    loss_sum.backward()
    launched_in_backward = list(launched)
    ddp.finish_grad_sync()
    small = DistributedDataParallel(build_model(config_from_preset("small"), device=device), bucket_mb=25)
    return launched_in_backward, len(ddp.buckets), small.bucket_sizes_bytes()


@pytest.fixture(scope="module")
def overlap_ranks():
    return run_ranks(_overlap_order, 2, timeout=60)


def test_buckets_launch_during_backward_in_order(overlap_ranks):
    for launched, num_buckets, _ in overlap_ranks:
        assert launched == list(range(num_buckets))  # all launched from hooks, in order


def test_ddp_cuts_its_buckets_tapered(overlap_ranks):
    from ddp import TAPER_BYTES

    for _, _, small_sizes in overlap_ranks:
        assert small_sizes[-1] <= TAPER_BYTES and max(small_sizes) <= 25 * 2**20


def _compiled_blocks(rank, world):
    """The same micro-batch through DDP on an eager and on a per-block compiled (aot_eager) model: the summed
    gradients, and how many buckets were launched when block 0's backward started (a hook on its output's
    gradient: module hooks stay eager around a compiled block)."""
    from ddp import DistributedDataParallel
    from model import compile_blocks
    from reference import build_model

    device = harness.device()
    x, y = global_batches(1, 4, SEQ)[0]
    (xs, ys), = rank_micro_batches(x, y, rank, world, 2)
    xs, ys = xs.to(device), ys.to(device)
    out = {}
    for compiled in (False, True):
        model = build_model(make_config(n_layer=3), seed=0, dtype=torch.float64, device=device)
        if compiled:
            compile_blocks(model, backend="aot_eager")
        ddp = DistributedDataParallel(model, bucket_mb=0.01)
        launched, at_block_0 = [], []
        original = ddp._launch
        ddp._launch = lambda bucket: (launched.append(bucket.index), original(bucket))

        def mark_block_0_backward(module, args, output):
            output.register_hook(lambda grad: at_block_0.append(len(launched)))

        model.transformer.h[0].register_forward_hook(mark_block_0_backward)
        _, loss_sum, _ = ddp(xs, ys)
        loss_sum.backward()
        ddp.finish_grad_sync()
        out[compiled] = dict(grads={n: p.grad.clone() for n, p in model.named_parameters()},
                             launched_before_block_0=at_block_0, buckets=len(ddp.buckets))
    return out


@pytest.fixture(scope="module")
def compiled_ranks():
    return run_ranks(_compiled_blocks, 2, timeout=180)


def test_per_block_compiled_ddp_sums_the_eager_gradients(compiled_ranks):
    for out in compiled_ranks:
        for name, grad in out[False]["grads"].items():
            torch.testing.assert_close(out[True]["grads"][name], grad, rtol=1e-12, atol=1e-14, msg=name)


def test_per_block_compiled_ddp_overlaps_as_eager(compiled_ranks):
    """The buckets of the head and blocks 2 and 1 are on the wire before block 0's backward: as many as eager."""
    for out in compiled_ranks:
        eager, compiled = out[False], out[True]
        assert compiled["launched_before_block_0"] == eager["launched_before_block_0"]
        assert 0 < eager["launched_before_block_0"][0] < eager["buckets"]


def _train_with_aux(rank, world, global_batch, micro, coef):
    from ddp import DDPLayout, DistributedDataParallel
    from reference import build_model
    from optim import DynamicLossScaler, build_adamw
    from reference import add_squared_mean_aux
    from step import train_step

    device = harness.device()
    model = build_model(make_config(), seed=0, dtype=torch.float64, device=device)
    add_squared_mean_aux(model, coef)
    group = dist.new_group(list(range(world)))
    layout = DDPLayout(DistributedDataParallel(model, group=group),
                       build_adamw(model.parameters(), HYPER["lr"], HYPER["weight_decay"], HYPER["betas"],
                                   HYPER["eps"]))
    losses = []
    for x, y in global_batches(STEPS, global_batch, SEQ):
        outcome = train_step(layout, DynamicLossScaler(enabled=False), rank_micro_batches(x, y, rank, world, micro),
                             group, 0.05, nullcontext(), device)
        losses.append(outcome.loss)
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def test_auxiliary_loss_reaches_the_gradients_with_the_design_normalisation():
    """D = 2 ranks, m = 2 micro-batches each: the objective is Σ CE / tokens + coef · mean over the D·m = 4
    micro-batches of aux, aux being (mean of an MLP's output)² on one micro-batch: not the value on the whole
    batch, so a step that averaged over m only, or over the whole batch, would give other parameters."""
    coef, global_batch, micro = 50.0, 8, 2
    batches = global_batches(STEPS, global_batch, SEQ)
    _, _, ref_params = reference_run(make_config(), batches, clip=0.05, micro_batches=4, aux_coef=coef)
    _, _, plain_params = reference_run(make_config(), batches, clip=0.05)
    assert any((ref_params[n] - plain_params[n]).abs().max() > 1e-6 for n in ref_params)  # aux does matter
    for losses, params in run_ranks(_train_with_aux, 2, global_batch, micro, coef, timeout=120):
        for name, ref in ref_params.items():
            torch.testing.assert_close(params[name], ref, rtol=TOL, atol=TOL, msg=name)


def _nccl_smoke(rank, world):
    from ddp import DDPLayout, DistributedDataParallel
    from reference import build_model
    from optim import DynamicLossScaler, build_adamw
    from step import train_step

    device = harness.device()  # cuda:rank: this test forces nccl
    model = build_model(make_config(), seed=0, dtype=torch.float64, device=device)  # float64 collectives on NCCL
    group = dist.new_group(list(range(world)))
    layout = DDPLayout(DistributedDataParallel(model, group=group), build_adamw(model.parameters(), HYPER["lr"]))
    x, y = global_batches(1, 4, SEQ)[0]
    outcome = train_step(layout, DynamicLossScaler(enabled=False), rank_micro_batches(x, y, rank, world, 2),
                         group, 0.0, nullcontext(), device)
    return outcome.loss


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="the NCCL smoke needs 2 CUDA GPUs; none or one visible here (CPU/gloo machine)")
def test_nccl_smoke():
    """The NCCL path with no flag: 2 GPUs, a float64 DDP step, the same loss as the single-device model."""
    ref_losses, _, _ = reference_run(make_config(), global_batches(1, 4, SEQ))
    for loss in run_ranks(_nccl_smoke, 2, timeout=300, backend_name="nccl"):
        assert abs(loss - ref_losses[0]) < 1e-10
