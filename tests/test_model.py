"""model.py: shapes, the loss contract, deterministic per-parameter init, activation checkpointing, sampling,
and per-block compile (gradient hooks still fire block by block; the same gradients as eager)."""

import math
import re

import pytest
import torch

from model import GPT, PRESETS, compile_blocks, config_from_preset, init_full_parameter

from reference import build_model, make_config
from shard import ShardInfo, Split


def tiny(**overrides):
    return make_config(**{"n_layer": 2, "n_head": 4, "n_embd": 64, **overrides})


def test_shapes_and_tied_head():
    model = build_model(tiny(), seed=0)
    idx = torch.randint(0, 256, (3, 17))
    logits, loss_sum, count = model(idx, idx)
    assert logits.shape == (3, 17, 256)
    assert count.item() == 3 * 17
    assert model.lm_head.weight is model.transformer.wte.weight
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names and "transformer.wte.weight" in names  # one tensor, one name
    logits, loss_sum, count = model(idx)
    assert logits.shape == (3, 1, 256) and loss_sum is None


def test_init_loss_is_near_log_vocab():
    model = build_model(tiny(), seed=0)
    generator = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 256, (8, 64), generator=generator)
    targets = torch.randint(0, 256, (8, 64), generator=generator)
    _, loss_sum, count = model(idx, targets)
    assert abs(loss_sum.item() / count.item() - math.log(256)) < 0.05


def test_loss_is_sum_over_targets_and_ignores_minus_one():
    model = build_model(tiny(), seed=3)
    idx = torch.randint(0, 256, (2, 10))
    targets = torch.randint(0, 256, (2, 10))
    targets[0, :4] = -1
    logits, loss_sum, count = model(idx, targets)
    keep = targets != -1
    expected = -torch.log_softmax(logits.float(), -1)[keep].gather(1, targets[keep][:, None]).sum()
    assert count.item() == keep.sum().item() == 16
    torch.testing.assert_close(loss_sum, expected)


def test_init_is_per_parameter_and_independent_of_global_rng():
    torch.manual_seed(123)
    a = build_model(tiny(), seed=7)
    torch.manual_seed(456)
    b = build_model(tiny(), seed=7)
    c = build_model(tiny(), seed=8)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        assert torch.equal(pa, init_full_parameter(name, pa.shape, a.config, 7)), name
        if pa.dim() == 2:
            assert not torch.equal(pa, pc), name
    c_proj = a.transformer.h[0].attn.c_proj.weight.std().item()
    c_fc = a.transformer.h[0].mlp.c_fc.weight.std().item()
    assert c_proj < c_fc  # residual projections are scaled by 1/sqrt(2·n_layer)


def test_float64_model_starts_from_the_float32_values():
    a = build_model(tiny(), seed=1)
    b = build_model(tiny(), seed=1, dtype=torch.float64)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert pb.dtype == torch.float64 and torch.equal(pa.double(), pb)


@pytest.mark.parametrize("dim,pieces,segments", [(0, 2, 1), (1, 4, 1), (0, 3, 1), (0, 2, 3)])
def test_shard_pieces_tile_the_full_parameter(dim, pieces, segments):
    """Each rank builds its piece from the full init alone; the pieces put back together give the full tensor."""
    shape = (12 * segments, 8) if dim == 0 else (12, 8)
    full = init_full_parameter("transformer.h.0.attn.c_attn.weight", shape, tiny(), seed=5)
    rebuilt = torch.full(shape, float("nan"))
    for index in range(pieces):
        info = ShardInfo("transformer.h.0.attn.c_attn.weight", shape, splits=(Split(dim, pieces, index, segments),))
        shard = info.shard_of(init_full_parameter(info.global_name, info.global_shape, tiny(), seed=5))
        assert shard.shape == info.local_shape
        if segments == 3:  # fused q|k|v: rank `index` holds rows [index·2, index·2+2) of each 12-row segment
            expected = torch.cat([full[s * 12 + index * 12 // pieces:s * 12 + (index + 1) * 12 // pieces]
                                  for s in range(3)])
            assert torch.equal(shard, expected)
        info.place_into(rebuilt, shard)
    assert torch.equal(rebuilt, full)


def test_activation_checkpointing_gives_the_same_loss_and_gradients():
    plain = build_model(tiny(dropout=0.0), seed=2, dtype=torch.float64)
    ckpt = build_model(tiny(dropout=0.0, activation_checkpointing=True), seed=2, dtype=torch.float64)
    idx = torch.randint(0, 256, (2, 32))
    for model in (plain, ckpt):
        _, loss_sum, _ = model(idx, idx.roll(1, 1))
        loss_sum.backward()
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-14, msg=name)


def test_selective_recompute_follows_the_plain_models_loss_curve():
    """Selective recompute (parallel/recompute.py) keeps the GEMM outputs and recomputes the rest, dropout masks
    included (checkpoint replays the RNG): 4 AdamW steps from the same init, batches and dropout draws give
    the plain model's losses and parameters in float64 to 1e-10, on the fused (no dropout) and math paths, and
    with MoE blocks (by halves, model.Block: their experts' GELU outputs recomputed; the aux losses in the
    objective) whose load counters count each routed slot once, as the plain model's."""
    moe = dict(moe_experts=4, moe_shared_experts=1, moe_score="sigmoid", moe_bias_rate=0.01, moe_every=2)
    for dropout, extra in ((0.0, {}), (0.1, {}), (0.1, moe)):
        runs = []
        for selective in (False, True):
            model = build_model(tiny(dropout=dropout, selective_recompute=selective, **extra), seed=2,
                                dtype=torch.float64)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            generator, losses = torch.Generator().manual_seed(0), []
            torch.manual_seed(7)  # the dropout draws
            for _ in range(4):
                idx = torch.randint(0, 256, (2, 32), generator=generator)
                _, loss_sum, count = model(idx, idx.roll(1, 1))
                aux = model.aux_losses.weighted_sum()
                (loss_sum / count + (aux if aux is not None else 0)).backward()
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss_sum.item())
            loads = [block.mlp.load.step.tolist() for block in model.transformer.h if extra and block.layer_id % 2]
            runs.append((losses, [p.detach() for p in model.parameters()], loads))
        (plain, plain_params, plain_loads), (selective, selective_params, selective_loads) = runs
        assert plain == pytest.approx(selective, rel=1e-10, abs=1e-10), dropout
        assert plain_loads == selective_loads and (not extra or sum(plain_loads[0]) == 4 * 2 * 32 * 2), plain_loads
        for a, b in zip(plain_params, selective_params):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_in_backward_tells_a_recompute_from_the_forward_and_is_the_one_place_that_asks_autograd():
    """step.in_backward is False in a forward, True in a backward and in the forward that full or
    selective recompute reruns inside it; no other file asks torch's private graph-task id itself."""
    import glob
    import os

    import step
    from parallel import recompute
    from torch.utils.checkpoint import checkpoint

    seen = []

    def block(x):  # records, per call, whether it runs inside a backward
        seen.append(step.in_backward())
        return (x * 2).sin()

    class Backward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            seen.append(step.in_backward())
            return grad

    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    assert not step.in_backward()
    Backward.apply(block(x)).sum().backward()
    assert seen == [False, True]  # the forward, then the backward
    for context_fn in (None, recompute.SelectiveRecompute().contexts):  # full, selective
        seen.clear()
        kwargs = {} if context_fn is None else dict(context_fn=context_fn)
        checkpoint(block, x, use_reentrant=False, **kwargs).sum().backward()
        assert seen == [False, True], context_fn  # the forward, then its recompute inside the backward
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    asking = [path for path in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
              if "/tests/" not in path and path != os.path.join(root, "step.py")
              and "_current_graph_task_id" in open(path).read()]
    assert not asking, asking


def test_selective_recompute_of_a_moe_block_under_autocast_gives_the_same_gradients_bit_for_bit():
    """A MoE block's recomputed GELU outputs and autocast's weight copies (recompute.SelectiveRecompute.
    activations_recomputed) are the forward's own bits: bf16 gradients equal the plain model's exactly, and
    fewer bytes are saved (memory.SavedActivations: the copies of 4 + 1 experts' weights and the GELU outputs)."""
    from accounting import memory

    runs = []
    for selective in (False, True):
        model = build_model(tiny(moe_experts=4, moe_shared_experts=1, selective_recompute=selective), seed=2)
        idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
        with torch.autocast("cpu", dtype=torch.bfloat16), memory.SavedActivations.of(model) as saved:
            _, loss_sum, count = model(idx, idx.roll(1, 1))
            loss = loss_sum / count + model.aux_losses.weighted_sum()
        loss.backward()
        runs.append((loss.item(), [p.grad for p in model.parameters()], saved.bytes))
    (plain_loss, plain_grads, plain_bytes), (loss, grads, saved_bytes) = runs
    assert loss == plain_loss and all(torch.equal(a, b) for a, b in zip(plain_grads, grads))
    copies = 2 * (4 + 1) * 8 * 64 * 64 * 2  # 2 MoE blocks, 5 experts of 8h² bf16 weights
    assert saved_bytes < plain_bytes - copies, (plain_bytes, saved_bytes)


def test_selective_recompute_of_a_moe_block_runs_under_per_block_compile():
    """compile_blocks (dynamo, eager backend: the graph capture, not inductor's kernels) around a MoE block under
    selective recompute: its halves run eagerly (Block.forward_by_halves), the gradients are the plain model's."""
    grads = []
    for selective in (False, True):
        model = build_model(tiny(moe_experts=4, moe_shared_experts=1, selective_recompute=selective), seed=2,
                            dtype=torch.float64)
        if selective:
            compile_blocks(model, backend="eager")
        idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
        _, loss_sum, count = model(idx, idx.roll(1, 1))
        (loss_sum / count + model.aux_losses.weighted_sum()).backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("flags,flag", [(["--cp", "2"], "--cp-impl ring")])  # the one layout refused
def test_selective_recompute_refuses_the_layouts_it_cannot_serve(flags, flag):
    from cli import flags as flags_lib
    import train

    args = flags_lib.build_parser().parse_args(["--activation-checkpointing", "selective", "--global-batch", "2",
                                                *flags])
    with pytest.raises(flags_lib.FlagError, match=f"--activation-checkpointing selective with {re.escape(flag)}"):
        flags_lib.validate(args, 2, axes=train.AXES)


def test_the_bare_recompute_flag_is_full_and_an_unknown_mode_is_a_flag_error():
    from cli import flags as flags_lib

    parser = flags_lib.build_parser()
    assert parser.parse_args(["--activation-checkpointing"]).activation_checkpointing == "full"
    assert parser.parse_args([]).activation_checkpointing == "none"
    with pytest.raises(flags_lib.FlagError, match="argument --activation-checkpointing: invalid choice: 'some'"):
        parser.parse_args(["--activation-checkpointing", "some"])


def test_global_positions_hook():
    model = build_model(tiny(), seed=0)
    idx = torch.randint(0, 256, (1, 16))
    full, _, _ = model(idx, idx)
    # The first half of the sequence with explicit positions equals the causal prefix of the full pass.
    half, _, _ = model(idx[:, :8], idx[:, :8], pos=torch.arange(8))
    torch.testing.assert_close(half, full[:, :8])


def test_generate_and_presets():
    model = build_model(tiny(), seed=0)
    out = model.generate(torch.zeros(2, 3, dtype=torch.long), 5, top_k=10, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 8) and out.max() < 256
    assert set(PRESETS) >= {"tiny", "small", "gpt2"}
    assert build_model(config_from_preset("small"), seed=0).num_params() > 10_000_000
    with pytest.raises(ValueError, match="--preset"):
        config_from_preset("huge")
    with pytest.raises(ValueError, match="divisible"):
        tiny(n_head=5)


def test_a_stage_built_alone_equals_the_same_blocks_of_the_full_model():
    """A pipeline stage builds only its layers (named by global index), bitwise equal to the full model's."""
    config = tiny(n_layer=4)
    full = build_model(config, seed=3)
    first = build_model(config, seed=3, layers=range(0, 1), head=False)
    middle = build_model(config, seed=3, layers=range(1, 3), embedding=False, head=False)
    last = build_model(config, seed=3, layers=range(3, 4), embedding=False)
    full_params = dict(full.named_parameters())
    for stage in (first, middle, last):
        for name, p in stage.named_parameters():
            assert torch.equal(p, full_params[GPT.global_name(name)]), name
            assert p.shard_info.global_name == GPT.global_name(name)
    assert [n for n, _ in middle.named_parameters()][0] == "transformer.h.1.ln_1.weight"
    assert not middle.has_embedding and not middle.has_head and "wte" not in dict(middle.transformer.named_children())
    assert sum(s.num_params() for s in (first, middle, last)) == full.num_params() + full.transformer.wte.weight.numel()
    # The three pieces, run stage by stage, give exactly `forward` of the full model.
    idx, targets = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    expected = full(idx, targets)
    x = first.forward_blocks(first.embed(idx))
    x = middle.forward_blocks(x)
    got = last.head_loss(last.forward_blocks(x), targets)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    # A contiguous sub-range of the full model's blocks is the same computation.
    h = full.embed(idx)
    assert torch.equal(full.forward_blocks(full.forward_blocks(h, range(0, 2)), range(2, 4)), full.forward_blocks(h))
    with pytest.raises(ValueError, match="increasing layer ids"):
        build_model(config, layers=range(2, 6))
    interleaved = build_model(config, seed=3, layers=[0, 2], head=False)  # an interleaved pipeline rank: chunks 0 and 2
    assert interleaved.transformer.h.layer_ids == [0, 2]
    assert torch.equal(interleaved.forward_blocks(h, range(2, 3)), full.forward_blocks(h, range(2, 3)))


def test_auxiliary_losses_are_collected_per_forward():
    model = build_model(tiny(), seed=0)
    block = next(iter(model.transformer.h))
    block.mlp.register_forward_hook(lambda mod, args, out: model.aux_losses.add("act_l2", 0.5, out.pow(2).mean()))
    idx = torch.randint(0, 256, (2, 8))
    model(idx, idx)
    model(idx, idx)  # cleared before each forward: one term, not two
    assert len(model.aux_losses.terms) == 1
    value = model.aux_losses.terms[0][2]
    assert torch.equal(model.aux_losses.weighted_sum(), 0.5 * value)
    values = model.aux_losses.values()  # detached tensors, read on the host once per step (step.train_step)
    assert list(values) == ["act_l2"] and torch.equal(values["act_l2"], value.detach())
    assert not values["act_l2"].requires_grad


# ---------------------------------------------------------------------------------------------------------
# Per-block compile (aot_eager: AOTAutograd's one backward graph per compiled region, without inductor's
# slow CPU code generation)
# ---------------------------------------------------------------------------------------------------------


def backward_timeline(model, forward):
    """One forward and backward; the backward's events in order: "graph" when a compiled backward graph starts,
    i when a parameter of block i has its gradient (its post-accumulate-grad hook: where DDP counts down its
    buckets and ZeRO fills its reduce-scatter buckets). Module hooks inside a whole-model compile would split
    its graph (Dynamo breaks at them), so a graph's start is read from its autograd node after the forward."""
    events = []
    for i, block in enumerate(model.transformer.h):
        for p in block.parameters():
            p.register_post_accumulate_grad_hook(lambda p, i=i: events.append(i))
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    _, loss_sum, _ = forward(idx, idx.roll(1, 1))
    nodes, stack = set(), [loss_sum.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in nodes:
            nodes.add(node)
            stack.extend(next_node for next_node, _ in node.next_functions)
    for node in nodes:
        if type(node).__name__ == "CompiledFunctionBackward":
            node.register_prehook(lambda grad_outputs: events.append("graph"))
    loss_sum.backward()
    return events


@pytest.mark.parametrize("activation_checkpointing", [False, True])
def test_per_block_compile_keeps_gradient_hooks_per_block(activation_checkpointing):
    """Compiled per block, block i's gradients are all ready before block i-1's backward graph starts (so DDP
    and ZeRO send them while backward goes on); compiled whole, no gradient is ready before all of backward,
    block 0's included, has run in its one graph."""
    config = tiny(n_layer=3, activation_checkpointing=activation_checkpointing)
    per_block = len(list(build_model(config).transformer.h[0].parameters()))  # 12 with biases
    model = compile_blocks(build_model(config, seed=0), backend="aot_eager")
    after = backward_timeline(model, model)
    assert after == ["graph", *[2] * per_block, "graph", *[1] * per_block, "graph", *[0] * per_block]

    model = build_model(config, seed=0)
    before = backward_timeline(model, torch.compile(model, backend="aot_eager"))
    assert before[0] == "graph" and "graph" not in before[1:]  # one graph, block 0's backward inside it
    assert sorted(before[1:]) == [0] * per_block + [1] * per_block + [2] * per_block  # every hook after it


@pytest.mark.parametrize("activation_checkpointing", [False, True])
def test_per_block_compile_gives_eager_loss_and_gradients(activation_checkpointing):
    config = tiny(n_layer=3, dropout=0.0, activation_checkpointing=activation_checkpointing)
    eager = build_model(config, seed=4, dtype=torch.float64)
    compiled = compile_blocks(build_model(config, seed=4, dtype=torch.float64), backend="aot_eager")
    idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    losses = []
    for model in (eager, compiled):
        _, loss_sum, _ = model(idx, idx.roll(1, 1))
        loss_sum.backward()
        losses.append(loss_sum.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-12, atol=0)
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-12, atol=1e-14, msg=name)
    compiled.eval()  # the eval mode is another compilation of the same blocks
    with torch.no_grad():
        torch.testing.assert_close(compiled(idx)[0], eager.eval()(idx)[0], rtol=1e-12, atol=1e-14)
