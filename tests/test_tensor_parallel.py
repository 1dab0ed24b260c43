"""tensor_parallel.py: the layers, the whole model's update, the messages, dropout, the start-up measurement
and the flag errors.

Layer tests compare each parallel layer's forward and backward with the plain layer (float64, 1e-12).
Whole-model tests train the tensor-parallel GPT through step.train_step for a few steps, with gradient
accumulation and active clipping, and compare losses, grad norms and the final parameters (each rank's
shards put back into the global tensors with ShardInfo.place_into) with tests/reference.py's single-device
run: float64, tolerance 1e-10, as for DDP. Every step's traced TP-group messages must equal the handle's
prediction to the byte. `layout` names how data parallelism wraps the TP model (LAYOUTS): DDP or a ZeRO stage.
Each spawn of ranks is a module-scoped fixture; the tests read one property each from it.
The rank bodies build on harness.device() (each rank's GPU under nccl); the layer checks draw their "full"
tensors on the CPU, alike on every rank, and move them there.
"""

from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import harness
from harness import run_ranks
from reference import HYPER, global_batches, make_config, rank_micro_batches, reference_run

STEPS, SEQ = 3, 16
TOL = 1e-10
LAYER_TOL = 1e-12


# ---------------------------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------------------------


def _max_err(a, b):
    return float((a - b).abs().max())


def _layers(rank, world):
    """Every check for T = 2 (two groups of two) and T = 4, without and with sequence parallel."""
    groups = {4: dist.new_group([0, 1, 2, 3]), 2: [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]}
    return {(size, sp): _layer_checks(rank % size, size, groups[size], sp) for size in (2, 4) for sp in (False, True)}


def _layer_checks(rank, world, group, sp):
    import tensor_parallel as tp
    from accounting.tracer import CommTracer
    from reference import build_model
    from shard import ShardInfo, Split

    device = harness.device()
    torch.manual_seed(0)  # identical "full" tensors on every rank: drawn by the CPU generator, then moved
    ctx = tp.TensorParallelContext(group, world, rank, sp)
    dt = torch.float64
    b, s, d_in, d_out, V = 2, 8, 12, 24, 16
    errs = {}

    def randn(*shape):
        return torch.randn(*shape, dtype=dt).to(device)

    def seq_shard(t):  # this rank's piece of the sequence (dim 1)
        return t.chunk(world, 1)[rank]

    def piece(t, dim, segments=1):
        return ShardInfo("x", tuple(t.shape), splits=(Split(dim, world, rank, segments),)).shard_of(t)

    # Column-parallel, plain and with c_attn's fused [q | k | v] layout.
    for segments in (1, 3):
        full = nn.Linear(d_in, d_out, dtype=dt).to(device)
        x = randn(b, s, d_in).requires_grad_()
        go = randn(b, s, d_out)
        (full(x) * go).sum().backward()
        local = nn.Linear(d_in, d_out // world, dtype=dt).to(device)
        local.weight.data, local.bias.data = piece(full.weight, 0, segments), piece(full.bias, 0, segments)
        layer = tp.ColumnParallelLinear(local, ctx)
        x_in = (seq_shard(x) if sp else x).detach().requires_grad_()
        y = layer(x_in)
        (y * piece(go, 2, segments)).sum().backward()  # Σ over ranks of the local parts = the full loss
        errs[f"column{segments} y"] = _max_err(y, piece(full(x), 2, segments))
        errs[f"column{segments} dx"] = _max_err(x_in.grad, seq_shard(x.grad) if sp else x.grad)
        errs[f"column{segments} dW"] = _max_err(local.weight.grad, piece(full.weight.grad, 0, segments))
        errs[f"column{segments} db"] = _max_err(local.bias.grad, piece(full.bias.grad, 0, segments))

    # Row-parallel: input split by features, output summed (SP: and split by sequence); bias added once.
    full = nn.Linear(d_in, d_out, dtype=dt).to(device)
    x = randn(b, s, d_in).requires_grad_()
    go = randn(b, s, d_out)
    ref = full(x)
    (ref * go).sum().backward()
    local = nn.Linear(d_in // world, d_out, bias=False, dtype=dt).to(device)
    local.weight.data = piece(full.weight, 1)
    bias = nn.Parameter(full.bias.detach().clone())
    layer = tp.RowParallelLinear(local, bias, ctx)
    x_in = piece(x, 2).detach().requires_grad_()
    y = layer(x_in)
    (y * (seq_shard(go) if sp else go)).sum().backward()
    errs["row y"] = _max_err(y, seq_shard(ref) if sp else ref)
    errs["row dx"] = _max_err(x_in.grad, piece(x.grad, 2))
    errs["row dW"] = _max_err(local.weight.grad, piece(full.weight.grad, 1))
    bias_grad = bias.grad.clone()
    if sp:  # each rank saw its tokens only: the sum over the group is the gradient (after_grad_sync's job)
        dist.all_reduce(bias_grad, group=group)
    errs["row db"] = _max_err(bias_grad, full.bias.grad)

    # Vocab-parallel embedding.
    full = nn.Embedding(V, d_in, dtype=dt).to(device)
    idx = torch.randint(0, V, (b, s)).to(device)
    go = randn(b, s, d_in)
    ref = full(idx)
    (ref * go).sum().backward()
    local = nn.Embedding(V // world, d_in, dtype=dt).to(device)
    local.weight.data = piece(full.weight, 0)
    layer = tp.VocabParallelEmbedding(local, ctx, rank * V // world)
    out = layer(idx)
    (out * (seq_shard(go) if sp else go)).sum().backward()
    errs["embedding y"] = _max_err(out, seq_shard(ref) if sp else ref)
    errs["embedding dW"] = _max_err(local.weight.grad, piece(full.weight.grad, 0))

    # Vocab-parallel cross-entropy, with ignored targets, against F.cross_entropy on the full logits.
    logits = randn(b * s, V).requires_grad_() * 3
    logits.retain_grad()
    targets = torch.randint(0, V, (b * s,)).to(device)
    targets[::3] = -1
    ref = F.cross_entropy(logits, targets, ignore_index=-1, reduction="sum")
    ref.backward()
    local = logits.detach().chunk(world, -1)[rank].clone().requires_grad_()
    loss = tp.vocab_parallel_loss(local, targets, rank * V // world, group)
    (loss * 0.5).backward()
    errs["ce loss"] = _max_err(loss, ref)
    errs["ce dlogits"] = _max_err(local.grad, 0.5 * logits.grad.chunk(world, -1)[rank])

    # The messages of one block, forward and backward.
    config = make_config(n_head=4)
    model = build_model(config, seed=0, dtype=dt, device=device)
    tp.parallelize(model, group, sequence_parallel=sp)
    block = model.transformer.h[0]
    x = randn(2, SEQ // world if sp else SEQ, config.n_embd).requires_grad_()
    tracer = CommTracer()
    tracer.name_group(group, "tp")
    with tracer:
        out = block(x)
    forward = {op: r.calls for (op, g), r in tracer.records.items()}
    tracer.reset()
    with tracer:
        out.backward(torch.randn_like(out))
    backward = {op: r.calls for (op, g), r in tracer.records.items()}
    return errs, forward, backward


LAYER_CASES = [(2, False), (2, True), (4, False), (4, True)]  # (T, sequence parallel)
LAYER_IDS = ["T2", "T2-sp", "T4", "T4-sp"]


@pytest.fixture(scope="module")
def layer_ranks():
    """One spawn of 4 ranks for every layer case: [rank] -> {(T, sp): (errors by name, forward, backward)}."""
    return run_ranks(_layers, 4, timeout=120)


def _layer_errors(layer_ranks, case, prefix):
    errs = {(rank, name): err for rank, by_case in enumerate(layer_ranks) for name, err in by_case[case][0].items()
            if name.startswith(prefix)}
    assert errs  # the check ran
    return {key: err for key, err in errs.items() if not err < LAYER_TOL}


@pytest.mark.parametrize("case", LAYER_CASES, ids=LAYER_IDS)
def test_column_parallel_linear_matches_the_plain_linear(layer_ranks, case):
    assert _layer_errors(layer_ranks, case, "column") == {}  # y, dx, dW, db; plain and [q | k | v]


@pytest.mark.parametrize("case", LAYER_CASES, ids=LAYER_IDS)
def test_row_parallel_linear_matches_the_plain_linear(layer_ranks, case):
    assert _layer_errors(layer_ranks, case, "row") == {}  # the bias is added once, after the sum


@pytest.mark.parametrize("case", LAYER_CASES, ids=LAYER_IDS)
def test_vocab_parallel_embedding_matches_the_plain_embedding(layer_ranks, case):
    assert _layer_errors(layer_ranks, case, "embedding") == {}


@pytest.mark.parametrize("case", LAYER_CASES, ids=LAYER_IDS)
def test_vocab_parallel_cross_entropy_matches_the_full_logits(layer_ranks, case):
    assert _layer_errors(layer_ranks, case, "ce") == {}  # ignored targets included


@pytest.mark.parametrize("case", LAYER_CASES, ids=LAYER_IDS)
def test_a_block_sends_two_reductions_each_way(layer_ranks, case):
    """f and g: two all-reduces forward, two backward; SP: their halves, and backward also re-gathers the two
    column layers' inputs (only their shards were kept)."""
    _, sp = case
    for by_case in layer_ranks:
        _, forward, backward = by_case[case]
        if sp:
            assert forward == {"all_gather_single": 2, "reduce_scatter_single": 2}
            assert backward == {"all_gather_single": 4, "reduce_scatter_single": 2}
        else:
            assert forward == {"all_reduce": 2} and backward == {"all_reduce": 2}


# ---------------------------------------------------------------------------------------------------------
# Whole model
# ---------------------------------------------------------------------------------------------------------


def _ddp_layout(model, mesh):
    from ddp import DDPLayout, DistributedDataParallel
    from optim import build_adamw

    ddp = DistributedDataParallel(model, group=mesh.group("dp_cp"))
    optimizer = build_adamw(model.parameters(), HYPER["lr"], HYPER["weight_decay"], HYPER["betas"], HYPER["eps"])
    return DDPLayout(ddp, optimizer, mesh.coordinates())


def _zero_layout(stage):
    def build(model, mesh):
        from zero import ZeroConfig, ZeroLayout
        from parallel.zero3 import Zero3Layout

        # The flat ZeRO buffers hold this rank's TP shards; the norm counts TP-replicated copies on tp rank 0.
        config = ZeroConfig(stage, lr=HYPER["lr"], weight_decay=HYPER["weight_decay"], betas=HYPER["betas"],
                            eps=HYPER["eps"], param_dtype=torch.float64, master_dtype=torch.float64)
        layout_class = Zero3Layout if stage == 3 else ZeroLayout
        return layout_class(model, config, {"dp_cp": mesh.group("dp_cp")}, mesh.coordinates())
    return build


# How data parallelism wraps the TP model: layout name -> builder(model, mesh) -> layout object.
LAYOUTS = {"ddp": _ddp_layout, "zero1": _zero_layout(1), "zero2": _zero_layout(2), "zero3": _zero_layout(3)}


def _pieces(model):
    """{global name: (local tensor, ShardInfo)} of this rank's parameters."""
    return {p.shard_info.global_name: (p.detach().clone(), p.shard_info) for p in model.parameters()}


def _train_tp(rank, world, tp_size, layout_name, global_batch, micro, clip, variants):
    """Each (sequence parallel, activation checkpointing) variant trained from scratch, in one spawn."""
    return {variant: _train_variant(rank, world, tp_size, layout_name, global_batch, micro, clip, *variant)
            for variant in variants}


def _train_variant(rank, world, tp_size, layout_name, global_batch, micro, clip, sp, checkpointing):
    import tensor_parallel as tp
    from accounting.tracer import CommTracer
    from mesh import build_mesh, infer_mesh_shape
    from reference import build_model
    from optim import DynamicLossScaler
    from step import train_step

    device = harness.device()
    mesh = build_mesh(infer_mesh_shape(world, tp=tp_size), rank)
    config = make_config(activation_checkpointing=checkpointing)
    model = build_model(config, seed=0, dtype=torch.float64, device=device)
    micro_batches = global_batch // (mesh.size("dp") * micro)
    batch = tp.BatchShape(micro, SEQ, micro_batches, param_bytes=8, compute_bytes=8)
    handle = tp.parallelize(model, mesh.group("tp"), sequence_parallel=sp, batch=batch)
    init = _pieces(model)
    layout = LAYOUTS[layout_name](model, mesh)
    scaler = DynamicLossScaler(enabled=False)
    tracer = CommTracer()
    tracer.name_group(mesh.group("tp"), "tp")
    losses, norms, traced = [], [], []
    for x, y in global_batches(STEPS, global_batch, SEQ):
        batches = rank_micro_batches(x, y, mesh.index("dp"), mesh.size("dp"), micro)
        with tracer:
            outcome = train_step(layout, scaler, batches, mesh.group("dp_cp"), clip, nullcontext(), device,
                                 model=model, axes=[handle])
        traced.append({(op, g): (r.calls, r.payload_bytes) for (op, g), r in tracer.records.items() if g == "tp"})
        tracer.reset()
        losses.append(outcome.loss)
        norms.append(outcome.grad_norm)
    if hasattr(layout, "full_parameters"):  # ZeRO (at stage 3 gathered back): this rank's TP shards
        infos = {p.shard_info.global_name: p.shard_info for p in model.parameters()}
        final = {name: (value, infos[name]) for name, value in layout.full_parameters().items()}
    else:
        final = _pieces(model)
    # Under ZeRO the SP gradient sum moves this rank's gradient shard of those parameters, not all of them.
    predicted = {key: tuple(count) for key, count in handle.predicted_messages(layout).items()}
    return dict(losses=losses, norms=norms, init=init, final=final, traced=traced, predicted=predicted,
                local_numel=sum(p.numel() for p in model.parameters()))


def _assemble(rank_pieces):
    """Global tensors from every rank's pieces; replicated copies must agree exactly across ranks."""
    full = {}
    for pieces in rank_pieces:
        for name, (local, info) in pieces.items():
            if name not in full:
                full[name] = torch.full(info.global_shape, float("nan"), dtype=local.dtype)
            if not info.splits:
                assert torch.equal(full[name], local) or full[name].isnan().all(), f"replicas differ: {name}"
            info.place_into(full[name], local)
    return full


# Variants (sequence parallel, activation checkpointing) run one after the other in the same spawn.
PLAIN, SP, CKPT, SP_CKPT = (False, False), (True, False), (False, True), (True, True)
MESHES = {  # id: (world, T, layout, global batch, B_μ, variants)
    "T2": (2, 2, "ddp", 4, 2, (PLAIN, SP)),  # T=2: 2 micro-batches each, clipping active
    "T4": (4, 4, "ddp", 4, 2, (CKPT, SP)),  # T=4; checkpointing recomputes the forward's messages
    "T2xD2-ddp": (4, 2, "ddp", 8, 2, (PLAIN, SP_CKPT)),  # 2-D mesh: T=2 × D=2, DDP over the dp_cp group
    "T2xD2-zero1": (4, 2, "zero1", 8, 2, (PLAIN, SP)),  # ZeRO-1 shards the TP shards' optimizer state
    "T2xD2-zero2": (4, 2, "zero2", 8, 2, (CKPT, SP_CKPT)),  # ZeRO-2: + their gradients; with checkpointing
    "T2xD2-zero3": (4, 2, "zero3", 8, 2, (PLAIN, SP)),  # ZeRO-3 shards the TP shards themselves
}
CLIP = 0.05


@pytest.fixture(scope="module", params=list(MESHES), ids=list(MESHES))
def trained(request):
    """One spawn per mesh, every variant in it: (T, the reference's (losses, norms, params), {variant: [rank]})."""
    world, tp_size, layout, global_batch, micro, variants = MESHES[request.param]
    ref = reference_run(make_config(), global_batches(STEPS, global_batch, SEQ), clip=CLIP)
    assert min(ref[1]) > CLIP  # clipping really is active
    by_rank = run_ranks(_train_tp, world, tp_size, layout, global_batch, micro, CLIP, variants, timeout=180)
    return tp_size, ref, {variant: [r[variant] for r in by_rank] for variant in variants}


def test_tp_starts_from_exactly_the_single_device_weights(trained):
    from reference import build_model

    plain = dict(build_model(make_config(), seed=0, dtype=torch.float64).named_parameters())
    for variant, results in trained[2].items():
        init = _assemble([r["init"] for r in results])  # replicated copies agree (checked inside)
        assert init.keys() == plain.keys(), variant
        for name, p in plain.items():
            assert torch.equal(init[name], p.detach()), (variant, name)


def test_tp_losses_match_the_single_device(trained):
    ref_losses = trained[1][0]
    for variant, results in trained[2].items():
        for r in results:
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=TOL, atol=TOL,
                                       msg=lambda m: f"{variant}: {m}")


def test_tp_grad_norms_match_the_single_device(trained):
    ref_norms = trained[1][1]
    for variant, results in trained[2].items():
        for r in results:
            torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(ref_norms), rtol=TOL, atol=TOL,
                                       msg=lambda m: f"{variant}: {m}")


def test_tp_final_parameters_match_the_single_device(trained):
    ref_params = trained[1][2]
    for variant, results in trained[2].items():
        final = _assemble([r["final"] for r in results])
        for name, ref in ref_params.items():
            torch.testing.assert_close(final[name], ref, rtol=TOL, atol=TOL, msg=lambda m: f"{variant} {name}: {m}")


def test_tp_messages_are_as_predicted_every_step(trained):
    """Every TP message, counted and sized, as the handle's predicted_messages says (the SP sum: the layout's
    gradient pieces)."""
    for variant, results in trained[2].items():
        for r in results:
            assert r["traced"] == [r["predicted"]] * STEPS, variant


def test_tp_rank_holds_param_counts_per_rank(trained):
    from accounting import memory

    for variant, results in trained[2].items():
        for r in results:
            assert r["local_numel"] == memory.param_counts(make_config(), trained[0])["per_rank"], variant


@pytest.mark.parametrize("flags_list", [["--tp", "2", "--pp", "2"], ["--tp", "2", "--moe-experts", "4", "--ep", "2"]])
def test_the_startup_prints_the_parameters_each_rank_holds(flags_list):
    """The start-up's "parameters per rank" is the numel of the rank as built (on meta, in a fake group of 4, as
    --plan builds it): a pipeline stage's blocks only; whole experts, N/E of them, on every TP rank."""
    from cli import flags
    import plan
    import report.axes
    import train

    argv = ["--preset", "tiny", "--dtype", "fp32", *flags_list, "--global-batch", "4", "--micro-batch", "1"]
    settings = plan.plan_settings(flags.validate(flags.build_parser().parse_args(argv), 4, axes=train.AXES))
    for rank in range(4):
        with plan.fake_world(rank, 4):
            run = plan.build_role(settings, rank)
            lines = [line for axis in run.axes if axis.name == "tp" for line in report.axes.tp_startup_lines(axis, run)]
        printed = next(line for line in lines if "parameters per rank" in line).split(": ")[1].split()[0]
        assert int(printed.replace(",", "")) == sum(p.numel() for p in run.model.parameters()), (flags_list, rank)


# ---------------------------------------------------------------------------------------------------------
# Two ranks, T = 2: dropout, and block 0 measured at start-up
# ---------------------------------------------------------------------------------------------------------


def _dropout(mesh, device):
    import tensor_parallel as tp
    from reference import build_model
    from optim import DynamicLossScaler
    from step import train_step

    # fork(): a different stream per TP rank inside, the shared default stream continues after it (the
    # device's generator: the one dropout draws from).
    rng = tp.TensorParallelRNG(mesh.index("tp"), device)
    torch.manual_seed(1)
    with rng.fork():
        inside = torch.rand(8, device=device)
    after = torch.rand(8, device=device)
    out = {"inside": inside, "after": after}
    for sp in (False, True):
        for checkpointing in (False, True):
            torch.manual_seed(0)  # as train.py: the same default seed on every rank of a TP group
            config = make_config(dropout=0.2, activation_checkpointing=checkpointing)
            model = build_model(config, seed=0, dtype=torch.float64, device=device)
            handle = tp.parallelize(model, mesh.group("tp"), sequence_parallel=sp)
            layout = _ddp_layout(model, mesh)
            losses = []
            for x, y in global_batches(2, 4, SEQ):
                batches = rank_micro_batches(x, y, 0, 1, 2)
                outcome = train_step(layout, DynamicLossScaler(enabled=False), batches, mesh.group("dp_cp"), 0.0,
                                     nullcontext(), device, model=model, axes=[handle])
                losses.append(outcome.loss)
            out[sp, checkpointing] = (losses, _pieces(model))
    return out


def _composed(rank, world, flags, measure):
    """train.compose on the flags in float64, as train.main builds a run (the measurement included)."""
    from dataclasses import replace

    from cli import flags as flags_lib
    import train
    from mesh import build_mesh

    config = make_config()
    args = flags_lib.build_parser().parse_args(
        ["--global-batch", "4", "--micro-batch", "2", "--seq-len", str(SEQ), "--n-layer", str(config.n_layer),
         "--n-head", str(config.n_head), "--n-embd", str(config.n_embd), *flags])
    settings = replace(flags_lib.validate(args, world, axes=train.AXES), model=config)
    run = train.Run(settings=settings, mesh=build_mesh(settings.shape, rank), config=config,
                    device=harness.device(), seed=0, compute_dtype=torch.float64, param_dtype=torch.float64,
                    master_dtype=torch.float64)
    torch.manual_seed(rank // run.mesh.size("tp"))  # as train.py
    return train.compose(run, measure=measure)


def _trained_losses(run, steps=2):
    from optim import DynamicLossScaler
    from step import train_step

    losses = []
    for x, y in global_batches(steps, 4, SEQ):
        batches = rank_micro_batches(x, y, run.mesh.index("dp"), run.mesh.size("dp"), 2)
        losses.append(train_step(run.layout, DynamicLossScaler(enabled=False), batches, run.mesh.group("dp_cp"),
                                 CLIP, run.autocast, run.device, model=run.model, schedule=run.schedule,
                                 axes=run.axes, data_size=run.mesh.size("dp")).loss)
    return losses, {name: p.detach().clone() for name, p in run.model.named_parameters()}


def _measured(rank):
    """Block 0 measured by report.run.measure_startup in composed runs: what it saw, the lines printed with it,
    and whether measuring changed anything (FP8's delayed amaxes would, were the block not a copy)."""
    import report.axes
    import tensor_parallel

    out = {}
    for sp in (False, True):
        run = _composed(rank, 2, ["--tp", "2", *(["--sp"] if sp else [])], measure=True)
        tp = next(axis for axis in run.axes if axis.name == "tp")
        out[sp] = dict(measured=run.measured.on("tp"), saved=run.measured.saved_bytes,
                       predicted=tensor_parallel.block_messages(*tp.facts()),
                       lines=report.axes.tp_startup_lines(tp, run))
    fp8 = ["--tp", "2", "--sp", "--fp8", "delayed"]
    out["fp8"] = {measure: _trained_losses(_composed(rank, 2, fp8, measure)) for measure in (True, False)}
    run = _composed(rank, 2, ["--tp", "2", "--fp8", "current"], measure=True)  # amax MAX reductions in block 0
    out["fp8_lines"] = report.axes.tp_startup_lines(next(axis for axis in run.axes if axis.name == "tp"), run)
    return out


def _two_ranks(rank, world):
    from mesh import build_mesh, infer_mesh_shape

    mesh = build_mesh(infer_mesh_shape(world, tp=world), rank)
    return {"dropout": _dropout(mesh, harness.device()), "measured": _measured(rank)}


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_two_ranks, 2, timeout=180)


def test_fork_draws_other_masks_on_each_tp_rank(two_ranks):
    assert not torch.equal(two_ranks[0]["dropout"]["inside"], two_ranks[1]["dropout"]["inside"])


def test_the_shared_stream_stays_shared_after_a_fork(two_ranks):
    assert torch.equal(two_ranks[0]["dropout"]["after"], two_ranks[1]["dropout"]["after"])


@pytest.fixture(scope="module")
def losses_without_dropout():
    return reference_run(make_config(), global_batches(2, 4, SEQ))[0]


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp-sp"])
def test_dropout_is_really_on(two_ranks, losses_without_dropout, sp):
    plain_losses, _ = two_ranks[0]["dropout"][sp, False]
    assert abs(plain_losses[0] - losses_without_dropout[0]) > 1e-6  # float64 agrees to 1e-12 without dropout


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp-sp"])
def test_replicated_copies_stay_identical_under_dropout(two_ranks, sp):
    """The same masks on the residual stream (without SP), or under SP the summed LayerNorm gradients."""
    for checkpointing in (False, True):
        _assemble([r["dropout"][sp, checkpointing][1] for r in two_ranks])  # asserts the replicas agree


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp-sp"])
def test_activation_checkpointing_replays_the_dropout_masks(two_ranks, sp):
    plain_losses, _ = two_ranks[0]["dropout"][sp, False]
    params = _assemble([r["dropout"][sp, False][1] for r in two_ranks])
    recomputed = _assemble([r["dropout"][sp, True][1] for r in two_ranks])
    for r in two_ranks:
        torch.testing.assert_close(torch.tensor(r["dropout"][sp, True][0]), torch.tensor(plain_losses),
                                   rtol=1e-12, atol=0)
    for name in params:
        torch.testing.assert_close(recomputed[name], params[name], rtol=1e-12, atol=1e-14, msg=name)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp-sp"])
def test_block_zero_measured_at_startup_sends_what_tp_predicts(two_ranks, sp):
    for r in two_ranks:
        seen = r["measured"][sp]
        predicted = {(phase, op): tuple(count) for phase, messages in seen["predicted"].items()
                     for (op, _), count in messages.items()}
        assert {key: tuple(count) for key, count in seen["measured"].items()} == predicted
        assert seen["saved"] > 0  # autograd saved the block's activations, the weights aside


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp-sp"])
def test_startup_lines_print_block_zero_measured_next_to_predicted(two_ranks, sp):
    lines = two_ranks[0]["measured"][sp]["lines"]
    assert lines[0].startswith("tensor parallel T=2" + (" + sequence parallel" if sp else "") + ": messages per block")
    rows = [line for line in lines if "predicted" in line]
    assert len(rows) == (4 if sp else 2)
    for row in rows:  # "  forward  all_reduce  predicted 2 ×  1.00 KiB   measured 2 ×  1.00 KiB"
        predicted, measured = row.split("predicted ")[1].split("   measured ")
        assert predicted == measured, row
    assert any(line.startswith("  parameters per rank") for line in lines)


def test_fp8s_amax_reductions_on_tp_are_rows_of_their_own_and_tps_rows_match(two_ranks):
    """--tp 2 --fp8 current: block 0 also sends FP8's amax MAX all-reduces (a few bytes each) over tp. They are
    rows of their own, by message size, so TP's rows read predicted = measured (the issue's "predicted 2 ×
    256.00 KiB measured 6 × 85.34 KiB" averaged the amaxes in)."""
    lines = two_ranks[0]["measured"]["fp8_lines"]
    rows = [line for line in lines if " predicted " in line and "   measured " in line]
    tp_rows = [row for row in rows if "not TP's" not in row]
    assert len(tp_rows) == 2, lines
    for row in tp_rows:
        predicted, measured = row.split("predicted ")[1].split("   measured ")
        assert predicted == measured, row
    amax = [row for row in rows if "not TP's" in row]
    assert amax and all(" predicted 0 × " in row and " B   measured " in row for row in amax), lines


def test_measuring_block_zero_leaves_the_run_as_it_was(two_ranks):
    """FP8 delayed scaling keeps each step's amaxes for the next step's scales: had the measurement run the
    model's own block, its random input's amaxes would enter them. The measured run trains bitwise alike."""
    for r in two_ranks:
        (measured_losses, measured_params), (losses, params) = r["measured"]["fp8"][True], r["measured"]["fp8"][False]
        assert measured_losses == losses
        for name, p in params.items():
            assert torch.equal(measured_params[name], p), name


# ---------------------------------------------------------------------------------------------------------
# Flags
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv,world,expected",
    [
        (["--preset", "tiny", "--tp", "3"], 3, ["--tp 3", "n_head=4"]),
        (["--preset", "tiny", "--tp", "3", "--n-head", "6", "--n-embd", "48"], 3, ["--tp 3", "vocabulary size 256"]),
        (["--preset", "tiny", "--tp", "2", "--sp", "--seq-len", "15"], 2, ["--sp", "--seq-len", "15"]),
        (["--preset", "tiny", "--tp", "2"], 3, ["world size 3", "--tp 2"]),
    ],
)
def test_invalid_tp_flags_are_clear_errors(argv, world, expected):
    from cli.flags import FlagError, build_parser, validate
    from train import AXES

    with pytest.raises(FlagError) as error:
        validate(build_parser().parse_args(argv), world, axes=AXES)
    for text in expected:
        assert text in str(error.value)


def test_valid_tp_flags_give_a_2d_mesh():
    from cli.flags import build_parser, validate
    from train import AXES

    settings = validate(build_parser().parse_args(["--preset", "tiny", "--tp", "2", "--sp"]), 4, axes=AXES)
    assert (settings.shape.tp, settings.shape.dp) == (2, 2)
    import tensor_parallel

    assert settings.axes["tensor_parallel"] == tensor_parallel.TPConfig(2, sequence_parallel=True)
