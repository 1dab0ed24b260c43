"""Shared experts (experts/shared.py): the formula on one process, the parameter, FLOP and activation counts, the
flags, and train.py's composition on meshes (EP × ZeRO-1, EP × TP with SP, PP, CP) against the single device.

The one-process reference is DeepSeekMoE's formula written here from the paper, in float64:
    h' = u + Σ_{s<S} shared_s(u) + Σ_j g_j · routed_{e_j}(u)
with shared_s = c_proj_s ∘ GELU ∘ c_fc_s read out of the layer's one width-S·4h MLP (rows / columns
[s·4h, (s+1)·4h)), and the routing (softmax over N, top-k, renormalised) and the routed experts written out too.
"""

import pytest
import torch
import torch.nn.functional as F

from harness import run_ranks
from reference import make_config

TOL = 1e-10
DT = torch.float64
LAYER = dict(n_layer=1, n_head=2, n_embd=16, moe_experts=4, moe_topk=2, moe_shared_experts=2)


def _formula(layer, u: torch.Tensor, shared: int, topk: int) -> torch.Tensor:
    """Σ_s shared_s(u) + Σ_j g_j·routed_j(u) for u [T, h], from the layer's weights, token by token."""
    h = u.shape[-1]
    fc, proj = layer.shared_experts.c_fc, layer.shared_experts.c_proj
    out = []
    for token in u:
        total = proj.bias.clone()  # the S experts' c_proj biases are one parameter (experts/shared.py)
        for s in range(shared):
            rows = slice(s * 4 * h, (s + 1) * 4 * h)
            total = total + proj.weight[:, rows] @ F.gelu(fc.weight[rows] @ token + fc.bias[rows])
        probs = torch.softmax(layer.router.weight @ token, dim=-1)
        chosen = sorted(range(len(probs)), key=lambda i: -probs[i].item())[:topk]
        norm = sum(probs[i] for i in chosen)
        for i in chosen:
            expert = layer.experts[str(i)]
            routed = expert.c_proj.weight @ F.gelu(expert.c_fc.weight @ token + expert.c_fc.bias) + expert.c_proj.bias
            total = total + probs[i] / norm * routed
        out.append(total)
    return torch.stack(out)


def test_shared_experts_add_ungated_to_the_routed_sum_in_float64():
    """The layer's output and its gradients (input and every parameter) equal the formula's, to 1e-10."""
    from reference import build_model

    config = make_config(**LAYER)
    model = build_model(config, seed=0, dtype=DT)
    layer = model.transformer.h[0].mlp
    assert layer.shared_experts.c_fc.weight.shape == (2 * 4 * 16, 16)
    with torch.no_grad():  # biases start at zero: give them values, or the test could not see them misplaced
        for name, p in layer.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name)), dtype=DT))
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1), dtype=DT, requires_grad=True)
    y = layer(x)
    expected = _formula(layer, x.reshape(-1, 16), 2, 2).view(2, 5, 16)
    torch.testing.assert_close(y, expected, rtol=TOL, atol=TOL)
    weights = torch.randn(y.shape, generator=torch.Generator().manual_seed(2), dtype=DT)
    params = [x, *layer.parameters()]
    got = torch.autograd.grad((y * weights).sum(), params)
    want = torch.autograd.grad((expected * weights).sum(), params)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=TOL, atol=TOL)


def test_shared_experts_are_dense_parameters_named_under_the_mlp():
    """Named `...mlp.shared_experts.*`, whole logical tensors summed over dp×cp even under expert parallel (the
    layer's experts only move to expert_dp), and the routed-expert sums over tp leave them to TP."""
    import moe
    from reference import build_model

    model = build_model(make_config(**LAYER), seed=0, dtype=DT, device="meta")
    layer = model.transformer.h[0].mlp
    moe.shard_experts(layer, None, 1, 0)
    names = {p.shard_info.global_name: p.shard_info.grad_group for p in layer.parameters()}
    shared = {n: g for n, g in names.items() if ".shared_experts." in n}
    assert sorted(shared) == [f"transformer.h.0.mlp.shared_experts.{m}.{k}" for m in ("c_fc", "c_proj")
                              for k in ("bias", "weight")]
    assert set(shared.values()) == {"dp_cp"}
    axis = moe.MoEAxis([layer], traffic=None)
    assert not any(p in set(layer.shared_experts.parameters()) for p in axis.params())


@pytest.mark.parametrize("overrides", (LAYER, dict(LAYER, n_layer=3, moe_every=2, bias=False)))
def test_param_counts_and_flops_count_the_shared_experts(overrides):
    """memory.param_counts against the built model (total, active, the shared experts' own), and the FLOPs per
    token: 6·(S·8h² per MoE layer) more than without them (every token visits the S shared experts)."""
    from accounting import memory
    import mfu
    from reference import build_model

    config = make_config(**overrides)
    model = build_model(config, seed=0)
    counts = memory.param_counts(config)
    assert counts["total"] == model.num_params()
    held = sum(p.numel() for name, p in model.named_parameters() if ".shared_experts." in name)
    assert counts["shared_experts"] == held > 0
    expert = counts["expert"]
    assert counts["active"] == counts["total"] - counts["moe_layers"] * (config.moe.experts - config.moe.topk) * expert
    without = memory.param_counts(make_config(**{**overrides, "moe_shared_experts": 0}))
    h, s = config.n_embd, config.moe.shared_experts
    assert counts["active_matmul"] - without["active_matmul"] == counts["moe_layers"] * s * 8 * h * h
    assert counts["dense_linears"] - without["dense_linears"] == counts["moe_layers"] * s * 8 * h * h  # FP8's
    flops, flops_without = (mfu.flops_per_token(c, config, 16).model for c in (counts, without))
    assert flops - flops_without == 6 * counts["moe_layers"] * s * 8 * h * h


@pytest.mark.parametrize("argv, message", [
    (["--moe-shared-experts", "1"], "--moe-shared-experts needs --moe-experts > 0"),
    (["--moe-experts", "4", "--moe-shared-experts", "-1"], "--moe-shared-experts"),
])
def test_a_bad_shared_experts_flag_is_one_line_naming_it(argv, message):
    from cli import flags
    import train

    args = flags.build_parser().parse_args(["--preset", "tiny", *argv])
    with pytest.raises(flags.FlagError, match=message.replace("+", r"\+")):
        flags.validate(args, 1, given=flags.explicit_flags(["--preset", "tiny", *argv]), axes=train.AXES)


def test_layer_activation_bytes_with_shared_experts_match_what_autograd_saves():
    """moe_costs.layer_activation_bytes + shared.saved_bytes against memory.SavedActivations of one MoE layer's
    forward (E = 1, dropless), in float64 (c_fc's input is the router's: saved once) and under bf16 autocast
    (its own bf16 copy; the weights' bf16 copies, routed and shared, are weights and taken off)."""
    from accounting import moe_costs
    from accounting import memory
    from experts import shared
    from reference import build_model

    for dtype, autocast in ((DT, False), (torch.float32, True)):
        config = make_config(**LAYER)
        model = build_model(config, seed=0, dtype=dtype)
        layer = model.transformer.h[0].mlp
        x = torch.randn(2, 12, 16, generator=torch.Generator().manual_seed(3), dtype=dtype).requires_grad_()
        with memory.SavedActivations(exclude=list(model.parameters())) as saved, \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            layer(x)
        compute, residual = (2 if autocast else dtype.itemsize), dtype.itemsize
        h, s = config.n_embd, config.moe.shared_experts
        weight_copies = (config.moe.experts + s) * 8 * h * h * 2 if autocast else 0
        expected = (moe_costs.layer_activation_bytes(config, 24, compute, max(4, residual), mask_bytes=residual)
                    + shared.saved_bytes(config, 24, 1, compute, max(4, residual)))
        assert saved.bytes - weight_copies == expected, (dtype, autocast, saved.bytes, expected)


def test_the_korthikanti_delta_adds_the_shared_experts_16_bit_terms():
    """moe_costs.activation_estimate_delta with S shared experts: S·16·s·b·h/T (their GELU's input and output) and
    c_fc's 16-bit input 2·s·b·h (/T with SP) more per MoE block than without them."""
    from accounting import moe_costs
    config, without = make_config(**LAYER), make_config(**{**LAYER, "moe_shared_experts": 0})
    sbh = 64 * 2 * 16
    for tp, sp in ((1, False), (2, False), (2, True)):
        extra = (moe_costs.activation_estimate_delta(config, 3, 64, 2, tp, sp)
                 - moe_costs.activation_estimate_delta(without, 3, 64, 2, tp, sp))
        assert extra == 3 * (2 * 16 * sbh / tp + 2 * sbh / (tp if sp else 1)), (tp, sp)


# ---------------------------------------------------------------------------------------------------------
# train.py's composition on meshes: one spawn of 4 ranks for every case (tests/test_composition.py's checks)
# ---------------------------------------------------------------------------------------------------------

SHARED = ["--moe-experts", "4", "--moe-shared-experts", "2"]
MESHES_4 = [  # (flags, config overrides, global batch, B_μ)
    ([*SHARED, "--ep", "2", "--zero", "1"], {}, 8, 1),  # EP 2 × ZeRO-1: shared experts sharded as dense
    ([*SHARED, "--ep", "2", "--tp", "2", "--sp"], {}, 4, 1),  # EP 2 × TP 2 + SP: split like the MLP
    ([*SHARED, "--ep", "2", "--pp", "2"], dict(n_layer=2), 8, 1),  # PP 2 (× EP 2 over each stage's data ranks)
    ([*SHARED, "--ep", "2", "--cp", "2"], {}, 4, 1),  # CP 2
    ([*SHARED, "--tp", "2", "--activation-checkpointing"], {}, 4, 1),  # TP without SP, recomputed blocks
    ([*SHARED, "--ep", "2", "--tp", "2", "--fp8", "delayed"], {}, 4, 1),  # FP8 like the dense MLP, amax over tp
]
RESHARD = (([*SHARED, "--ep", "2", "--tp", "2", "--zero", "1"], {}, 4, 1),
           ([*SHARED, "--ep", "4", "--zero", "3"], {}, 4, 1))  # ZeRO-3 gathers the shared experts as dense


ACTIVATIONS = ([*SHARED, "--tp", "2", "--sp", "--global-batch", "4"], "bf16")  # D = 2 × T = 2


def _meshes(rank, world, cases, root):
    from accounting import activations
    import test_activations
    import test_composition

    out = [test_composition._run_case(rank, world, *case, trace=True) for case in cases]
    saving, resuming = RESHARD
    test_composition._run_case(rank, world, *saving, stop=2, save_root=root)
    out.append(test_composition._run_case(rank, world, *resuming, resume_root=root))
    run = test_activations.build_run(*ACTIVATIONS, world, rank, compose=True)
    x, y, pos = test_activations.batch(run)
    estimate = activations.activation_estimate(run)
    out.append((test_activations.saved_by_forward(run, lambda: run.layout(x, y, pos)), estimate.forward,
                estimate.hidden))
    return out


@pytest.fixture(scope="module")
def mesh_runs(tmp_path_factory):
    return run_ranks(_meshes, 4, MESHES_4, str(tmp_path_factory.mktemp("shared_ckpt")), timeout=600)


@pytest.mark.slow
def test_shared_experts_on_meshes_follow_the_single_device(mesh_runs):
    """Each mesh's losses and final parameters equal the single device's (float64, 1e-10: test_composition)."""
    import test_composition

    for index, case in enumerate(MESHES_4):
        test_composition._check([rank_results[index] for rank_results in mesh_runs], *case)


@pytest.mark.slow
def test_shared_experts_traced_messages_equal_the_prediction(mesh_runs):
    """Every (collective, group) of the traced steps equals report.run.predicted_messages: TP's region of the
    shared experts per MoE block (with and without SP, recomputed), the layouts', ep's all-to-alls."""
    for index, case in enumerate(MESHES_4):
        for rank, rank_results in enumerate(mesh_runs):
            traced, predicted = rank_results[index][2]
            assert set(traced) == set(predicted), (case, rank, set(traced) ^ set(predicted))
            for key, (calls, payload) in predicted.items():
                assert traced[key] == pytest.approx((calls, payload), abs=1e-9), (case, rank, key)


@pytest.mark.slow
def test_shared_experts_resume_on_another_ep_and_tp(mesh_runs):
    """Saved after 2 steps on E = 2 × T = 2 (ZeRO-1), resumed on E = 4 (ZeRO-3): the last step and the
    parameters equal the single device's uninterrupted run."""
    import test_composition

    per_rank = [rank_results[-2] for rank_results in mesh_runs]
    assert all(sorted(losses) == [2] for losses, _ in per_rank)
    test_composition._check(per_rank, *RESHARD[1])


@pytest.mark.slow
def test_the_activation_estimate_under_tp_and_sp_is_exact(mesh_runs):
    """Under bf16 autocast with TP 2 + SP, what one forward's hooks see equals the estimate less what SP's regather
    hooks keep (the shared experts' c_fc input shard and its S·4h²/T weight copy among them), to the byte."""
    for rank, rank_results in enumerate(mesh_runs):
        saved, forward, hidden = rank_results[-1]
        assert hidden > 0 and saved == forward - hidden, (rank, saved, forward, hidden)
