"""tensor_parallel.py: the layers, the whole model's update, the messages and the flag errors.

Layer tests compare each parallel layer's forward and backward with the plain layer (float64, 1e-12).
Whole-model tests train the tensor-parallel GPT through step.train_step for a few steps, with gradient
accumulation and active clipping, and compare losses, grad norms and the final parameters (each rank's
shards put back into the global tensors with ShardInfo.place_into) with tests/reference.py's single-device
run: float64, tolerance 1e-10, as for DDP. Every step's traced TP-group messages must equal the prediction
to the byte. `layout` names how data parallelism wraps the TP model (LAYOUTS): DDP or a ZeRO stage.
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
    from comm import CommTracer
    from model import GPT, ShardInfo, Split

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
    if sp:  # each rank saw its tokens only: the sum over the group is the gradient (finish_grad_sync's job)
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
    loss = tp.vocab_parallel_cross_entropy_sum(local, targets, rank * V // world, group)
    (loss * 0.5).backward()
    errs["ce loss"] = _max_err(loss, ref)
    errs["ce dlogits"] = _max_err(local.grad, 0.5 * logits.grad.chunk(world, -1)[rank])

    # Exactly two TP all-reduces in each block's forward and two in its backward (SP: their halves).
    config = make_config(n_head=4)
    model = GPT(config, seed=0, dtype=dt, device=device)
    tp.parallelize(model, group, sequence_parallel=sp, seed=0)
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


def test_layers_match_plain_layers():
    cases = [case for by_case in run_ranks(_layers, 4, timeout=120) for case in by_case.items()]
    assert len(cases) == 4 * 4
    for (size, sp), (errs, forward, backward) in cases:
        for name, err in errs.items():
            assert err < LAYER_TOL, (size, sp, name, err)
        if sp:  # backward also re-gathers the two column layers' inputs (only their shards were kept)
            assert forward == {"all_gather_single": 2, "reduce_scatter_single": 2}
            assert backward == {"all_gather_single": 4, "reduce_scatter_single": 2}
        else:
            assert forward == {"all_reduce": 2} and backward == {"all_reduce": 2}


# ---------------------------------------------------------------------------------------------------------
# Whole model
# ---------------------------------------------------------------------------------------------------------


def _ddp_layout(model, mesh, handle):
    from ddp import DistributedDataParallel
    from optim import build_adamw
    from ddp import DDPLayout

    ddp = DistributedDataParallel(model, group=mesh.group("dp_cp"))
    optimizer = build_adamw(model.parameters(), HYPER["lr"], HYPER["weight_decay"], HYPER["betas"], HYPER["eps"])
    return DDPLayout(ddp, optimizer, mesh.coordinates())


def _zero_layout(stage):
    def build(model, mesh, handle):
        from zero import ZeroConfig, ZeroLayout

        # The flat ZeRO buffers hold this rank's TP shards; the norm counts TP-replicated copies on tp rank 0.
        config = ZeroConfig(stage, lr=HYPER["lr"], weight_decay=HYPER["weight_decay"], betas=HYPER["betas"],
                            eps=HYPER["eps"], param_dtype=torch.float64, master_dtype=torch.float64)
        return ZeroLayout(model, config, {"dp_cp": mesh.group("dp_cp")}, mesh.coordinates())
    return build


# How data parallelism wraps the TP model: layout name -> builder(model, mesh, tp handle) -> layout object.
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
    from mesh import build_mesh, infer_mesh_shape
    from comm import CommTracer
    from model import GPT
    from optim import DynamicLossScaler
    from step import train_step

    device = harness.device()
    mesh = build_mesh(infer_mesh_shape(world, tp=tp_size), rank)
    config = make_config(activation_checkpointing=checkpointing)
    model = GPT(config, seed=0, dtype=torch.float64, device=device)
    handle = tp.parallelize(model, mesh.group("tp"), sequence_parallel=sp, seed=0)
    init = _pieces(model)
    layout = LAYOUTS[layout_name](model, mesh, handle)
    scaler = DynamicLossScaler(enabled=False)
    tracer = CommTracer()
    tracer.name_group(mesh.group("tp"), "tp")
    losses, norms, traced = [], [], []
    for x, y in global_batches(STEPS, global_batch, SEQ):
        batches = rank_micro_batches(x, y, mesh.index("dp"), mesh.size("dp"), micro)
        with tracer:
            outcome = train_step(layout, scaler, batches, mesh.group("dp_cp"), clip, nullcontext(), device,
                                 model=model, axes=[handle])
        traced.append({op: (r.calls, r.payload_bytes) for (op, g), r in tracer.records.items() if g == "tp"})
        tracer.reset()
        losses.append(outcome.loss)
        norms.append(outcome.grad_norm)
    if hasattr(layout, "unshard"):
        layout.unshard()  # ZeRO-3: gather the weights back so this rank's TP shards can be compared
    # Under ZeRO the SP gradient sum moves this rank's gradient shard of those parameters, not all of them.
    sp_bytes = sum(g.numel() * g.element_size() for g in layout.grad_pieces(handle.sequence_parallel_params))
    predicted = handle.step_messages(micro, SEQ, micro_batches=len(batches), sp_grad_bytes=sp_bytes)
    local_numel = sum(p.numel() for p in model.parameters())
    return losses, norms, init, _pieces(model), traced, predicted, local_numel


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


@pytest.mark.parametrize(
    "world,tp_size,layout,global_batch,micro,variants",
    [
        (2, 2, "ddp", 4, 2, (PLAIN, SP)),  # T=2: 2 micro-batches each, clipping active
        (4, 4, "ddp", 4, 2, (CKPT, SP)),  # T=4; checkpointing recomputes the forward's messages
        (4, 2, "ddp", 8, 2, (PLAIN, SP_CKPT)),  # 2-D mesh: T=2 × D=2, DDP over the dp_cp group
        (4, 2, "zero1", 8, 2, (PLAIN, SP)),  # T=2 × D=2 with ZeRO-1 sharding the TP shards' optimizer state
        (4, 2, "zero2", 8, 2, (CKPT, SP_CKPT)),  # ZeRO-2: + their gradients; activation checkpointing on top
        (4, 2, "zero3", 8, 2, (PLAIN, SP)),  # T=2 × D=2 with ZeRO-3 sharding the TP shards themselves
    ],
    ids=["T2", "T4", "T2xD2-ddp", "T2xD2-zero1", "T2xD2-zero2", "T2xD2-zero3"],
)
def test_tp_update_matches_single_device(world, tp_size, layout, global_batch, micro, variants):
    config = make_config()
    clip = 0.05
    ref_losses, ref_norms, ref_params = reference_run(config, global_batches(STEPS, global_batch, SEQ), clip=clip)
    assert min(ref_norms) > clip  # clipping really is active
    by_variant = run_ranks(_train_tp, world, tp_size, layout, global_batch, micro, clip, variants, timeout=180)
    for variant in variants:
        _check_against_reference([r[variant] for r in by_variant], config, tp_size, ref_losses, ref_norms,
                                 ref_params)


def _check_against_reference(results, config, tp_size, ref_losses, ref_norms, ref_params):
    import tensor_parallel as tp
    from model import GPT
    # The TP run starts from exactly the single-device weights: pieces put back together are bitwise equal.
    init = _assemble([r[2] for r in results])
    plain = dict(GPT(config, seed=0, dtype=torch.float64).named_parameters())
    assert init.keys() == plain.keys()
    for name, p in plain.items():
        assert torch.equal(init[name], p.detach()), name
    final = _assemble([r[3] for r in results])
    for name, ref in ref_params.items():
        torch.testing.assert_close(final[name], ref, rtol=TOL, atol=TOL, msg=name)
    for losses, norms, _, _, traced, predicted, local_numel in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=TOL, atol=TOL)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=TOL, atol=TOL)
        assert traced == [predicted] * STEPS  # every TP message, counted and sized, as predicted
        assert local_numel == tp.param_counts(config, tp_size)["per_rank"]


# ---------------------------------------------------------------------------------------------------------
# Dropout
# ---------------------------------------------------------------------------------------------------------


def _dropout(rank, world):
    import tensor_parallel as tp
    from mesh import build_mesh, infer_mesh_shape
    from model import GPT
    from optim import DynamicLossScaler
    from step import train_step

    device = harness.device()
    mesh = build_mesh(infer_mesh_shape(world, tp=world), rank)
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
            model = GPT(config, seed=0, dtype=torch.float64, device=device)
            handle = tp.parallelize(model, mesh.group("tp"), sequence_parallel=sp, seed=0)
            layout = _ddp_layout(model, mesh, handle)
            losses = []
            for x, y in global_batches(2, 4, SEQ):
                batches = rank_micro_batches(x, y, 0, 1, 2)
                outcome = train_step(layout, DynamicLossScaler(enabled=False), batches, mesh.group("dp_cp"), 0.0,
                                     nullcontext(), device, model=model, axes=[handle])
                losses.append(outcome.loss)
            out[sp, checkpointing] = (losses, _pieces(model))
    return out


def test_dropout_masks_agree_where_replicated_and_replay_under_checkpointing():
    """Dropout cannot match the single device (other masks), so this checks what makes it right: ranks'
    replicated copies stay identical (the same masks on the residual stream, or under SP summed LayerNorm
    gradients), split regions draw independent masks, and activation checkpointing replays the masks exactly.
    """
    ranks = run_ranks(_dropout, 2, timeout=120)
    assert not torch.equal(ranks[0]["inside"], ranks[1]["inside"])  # independent masks per TP rank
    assert torch.equal(ranks[0]["after"], ranks[1]["after"])  # the shared stream stays shared
    no_dropout, _, _ = reference_run(make_config(), global_batches(2, 4, SEQ))
    for sp in (False, True):
        plain_losses, _ = ranks[0][sp, False]
        assert abs(plain_losses[0] - no_dropout[0]) > 1e-6  # dropout is really on (float64 agrees to 1e-12 without)
        params = _assemble([r[sp, False][1] for r in ranks])  # replicas must agree (checked inside)
        recomputed = _assemble([r[sp, True][1] for r in ranks])
        for r in ranks:
            torch.testing.assert_close(torch.tensor(r[sp, True][0]), torch.tensor(plain_losses), rtol=1e-12, atol=0)
        for name in params:
            torch.testing.assert_close(recomputed[name], params[name], rtol=1e-12, atol=1e-14, msg=name)


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
    from flags import FlagError, build_parser, validate
    from train import AXES

    with pytest.raises(FlagError) as error:
        validate(build_parser().parse_args(argv), world, axes=AXES)
    for text in expected:
        assert text in str(error.value)


def test_valid_tp_flags_give_a_2d_mesh():
    from flags import build_parser, validate
    from train import AXES

    settings = validate(build_parser().parse_args(["--preset", "tiny", "--tp", "2", "--sp"]), 4, axes=AXES)
    assert (settings.shape.tp, settings.shape.dp) == (2, 2)
    import tensor_parallel

    assert settings.axes["tensor_parallel"] == tensor_parallel.TPConfig(2, sequence_parallel=True)
