"""optimizers/muon.py: Muon on the blocks' matrices and AdamW on the rest equal torch's, on one process and under DDP.

1. On one process in float64, the DDP layout over a group of one (`MuonDDPLayout`: its norm, clipping active, and
   update) with Newton-Schulz in bf16 (torch's choice) steps exactly as torch.optim.Muon on the matrices plus
   torch's AdamW (the project's, build_adamw) on the rest (tests/reference.py's `adamw_and_muon`: torch's own Muon,
   unpatched) to 1e-12 on every parameter after each of 3 steps, both given the same gradients (this model's
   backward, copied): the optimizers are compared, not two backwards (a 1e-16 difference in a gradient can flip
   one bf16 rounding of NS's input, which moves the step by ~1e-4). `newton_schulz` is torch's iteration bit for
   bit (a single call, at bf16).
2. Under DDP on D = 4 and on D = 2 × T = 2 (each matrix gathered over tp and orthogonalised whole) through
   train.compose, in float64 (NS in float64), the run follows the one-process Muon run (torch's Muon with NS in
   float64) to 1e-10, and every traced message of a step is report.run.predicted_messages (TP: one all_gather over
   tp of the step's matrix pieces).
3. The formulas: NS FLOPs of a tall and a wide matrix, the split (`is_matrix`), the shape-adjusted lr. The flags'
   refusals are tests/test_train.py's (one line, exit 2).
"""

import pytest
import torch

import harness
from harness import assert_runs_follow, run_ranks
from reference import HYPER, MUON, global_batches, make_config, reference_run
from test_composition import composed_run

STEPS, SEQ, CLIP = 3, 16, 0.05
MUON_FLAGS = ["--optimizer", "muon", "--muon-lr", str(MUON["lr"]), "--muon-momentum", str(MUON["momentum"])]


def _one_process(rank, world, global_batch):
    """MuonDDPLayout on a group of one, NS in bf16, and torch's Muon + AdamW in this same process (the same threads:
    bf16 GEMMs give the same bits), stepped on the same gradients; every parameter of both after each step."""
    from ddp import DistributedDataParallel
    from optim import DynamicLossScaler
    from optimizers.muon import MuonConfig, MuonDDPLayout
    from reference import adamw_and_muon, build_model

    config = make_config()
    model, twin = (build_model(config, seed=0, dtype=torch.float64) for _ in range(2))
    muon = MuonConfig(lr=MUON["lr"], adamw_lr=HYPER["lr"], momentum=MUON["momentum"],
                      weight_decay=HYPER["weight_decay"], ns_dtype=torch.bfloat16)
    adamw = dict(lr=HYPER["lr"], weight_decay=HYPER["weight_decay"], betas=HYPER["betas"], eps=HYPER["eps"])
    layout = MuonDDPLayout(DistributedDataParallel(model), muon, adamw)
    torch_adamw, torch_muon = adamw_and_muon(twin, MUON["lr"])
    scaler, steps, norms = DynamicLossScaler(enabled=False), [], []
    for x, y in global_batches(STEPS, global_batch, SEQ):
        _, loss_sum, count = layout(x, y)
        (loss_sum / count).backward()
        layout.finish_grad_sync()
        for p, q in zip(model.parameters(), twin.parameters()):
            q.grad = p.grad.clone()
        norms.append(layout.step(scaler, CLIP).grad_norm)
        torch.nn.utils.clip_grad_norm_(twin.parameters(), CLIP)
        torch_adamw.step()
        torch_muon.step()
        layout.zero_grad()
        steps.append(({n: p.detach().clone() for n, p in model.named_parameters()},
                      {n: p.detach().clone() for n, p in twin.named_parameters()}))
    return dict(steps=steps, norms=norms, matrices=len(layout.matrices),
                adamw=sum(len(g["params"]) for g in layout.optimizer.param_groups))


@pytest.fixture(scope="module")
def one_process():
    return run_ranks(_one_process, 1, 4, timeout=120)[0]


def test_one_process_equals_torch_muon_and_adamw_to_1e_12(one_process):
    assert min(one_process["norms"]) > CLIP  # clipping is active
    for step, (ours, theirs) in enumerate(one_process["steps"]):
        for name, ref in theirs.items():
            torch.testing.assert_close(ours[name], ref, rtol=1e-12, atol=1e-12, msg=f"step {step}: {name}")
    first, last = one_process["steps"][0][0], one_process["steps"][-1][0]
    assert any(not torch.equal(first[name], last[name]) for name in first)  # the steps moved the weights


def test_the_split_is_the_blocks_matrices_to_muon_the_rest_to_adamw(one_process):
    """4 matrices per block to Muon; wte (the tied head), wpe, every LayerNorm and bias to AdamW."""
    config = make_config()
    assert one_process["matrices"] == 4 * config.n_layer
    assert one_process["adamw"] == 2 + config.n_layer * (4 + 4) + 2  # wte, wpe; per block 2 LN × 2 + 4 biases; ln_f


def test_newton_schulz_is_torchs_iteration_bit_for_bit():
    from torch.optim._muon import _zeropower_via_newtonschulz

    from optimizers.muon import NS_COEFFICIENTS, NS_EPS, newton_schulz

    g = torch.randn(48, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for matrix in (g, g.T.contiguous()):  # tall (iterated transposed) and wide
        assert torch.equal(newton_schulz(matrix, 5, torch.bfloat16),
                           _zeropower_via_newtonschulz(matrix, NS_COEFFICIENTS, 5, NS_EPS))
    ortho = newton_schulz(g, 5, torch.float64)  # near-orthogonal columns: singular values in about [0.7, 1.2]
    singular = torch.linalg.svdvals(ortho)
    assert 0.5 < float(singular.min()) and float(singular.max()) < 1.5


def test_newton_schulz_flops_and_the_shape_adjusted_lr():
    from optimizers.muon import adjusted_lr, newton_schulz_flops

    # per iteration X·Xᵀ (2·m²·n) + c·A·A (2·m³) + (…)·X (2·m²·n), m the smaller side
    assert newton_schulz_flops((64, 256), 5) == newton_schulz_flops((256, 64), 5) == 5 * (4 * 64 * 64 * 256
                                                                                          + 2 * 64 ** 3)
    assert adjusted_lr(0.02, (256, 64)) == pytest.approx(0.04) and adjusted_lr(0.02, (64, 256)) == 0.02


# ---------------------------------------------------------------------------------------------------------
# DDP (D = 2) and DDP with TP (T = 2) through train.compose, against the one-process float64 Muon run
# ---------------------------------------------------------------------------------------------------------

DDP_CASES = [([], {}, 4, 1), (["--tp", "2"], {}, 4, 1)]  # (flags, config, global batch, B_μ); D·m = 4 micro-batches


def _ddp_case(rank, world, flags, config_kw, global_batch, micro):
    import report.run

    run = composed_run(rank, world, [*MUON_FLAGS, *flags], config_kw, global_batch, micro, harness.device())
    losses, traced = harness.traced_steps(run, STEPS, global_batch, SEQ, micro, CLIP, STEPS)
    infos = {p.shard_info.global_name: p.shard_info for p in run.model.parameters()}
    params = {p.shard_info.global_name: (p.detach().clone(), infos[p.shard_info.global_name])
              for p in run.model.parameters()}
    predicted = report.run.predicted_messages(run, len(losses))
    return (losses, params, traced, {key: tuple(count) for key, count in predicted.items()},
            run.layout.held_bytes(), run.layout.predicted_persistent())


def _ddp_cases(rank, world, cases):
    return [_ddp_case(rank, world, *case) for case in cases]


def assert_traced_as_predicted(traced: dict, predicted: dict, what) -> None:
    """Every (collective, group) traced per step is predicted, with its calls and payload, and none else."""
    assert set(traced) == set(predicted), (what, set(traced) ^ set(predicted))
    for key, (calls, payload) in predicted.items():
        assert traced[key] == pytest.approx((calls, payload), abs=1e-9), (what, key, traced[key])


@pytest.mark.slow
def test_ddp_and_tp_follow_the_one_process_muon_run_and_send_what_they_predict():
    """D = 4 and D = 2 × T = 2 (4 ranks): losses and parameters equal torch's Muon + AdamW on one device (float64,
    1e-10); traced = predicted, call for call; held bytes = (b_w + b_g)·Ψ + 2b·Ψ_A + b·Ψ_M."""
    results = run_ranks(_ddp_cases, 4, DDP_CASES, timeout=600)
    for index, (flags, config_kw, global_batch, micro) in enumerate(DDP_CASES):
        per_rank = [r[index] for r in results]
        reference = reference_run(make_config(**config_kw), global_batches(STEPS, global_batch, SEQ), clip=CLIP,
                                  micro_batches=global_batch // micro, muon_lr=MUON["lr"])
        assert_runs_follow([(losses, params) for losses, params, *_ in per_rank], reference[0], reference[2], 1e-10)
        for _, _, traced, predicted, held, persistent in per_rank:
            assert_traced_as_predicted(traced, predicted, flags)
            assert held == persistent, flags
            if "--tp" in flags:
                assert ("all_gather_single", "tp") in traced, traced
