"""FP8 routed experts (fp8.py's "Experts", accounting/fp8_experts.py): the row padding is invisible to the numbers, a
MoE layer in FP8 stays within FP8's tolerance of the compute-dtype layer, the padded rows counted equal a hand count
from the routing, and on meshes E = 2 equals E = 1 and the single device under the same recipe (float64); with
redundant experts (--moe-replicas) --fp8 current follows the run without them: bitwise where a row's quantisation
cannot differ, within FP8's own error where a replicated expert's rows are split and scaled apart.
"""

import pytest
import torch
import torch.nn as nn

from accounting import fp8_experts
import fp8
from precision import fp8_scaling
from harness import run_ranks
from precision.microscaling import sqnr_db as sqnr
from reference import make_config, train_counting_expert_padding

DT = torch.float64
TOL = 1e-10


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models run on one thread


class _Padding(fp8.QuantizationObserver):
    def __init__(self):
        self.rows = 0

    def padded(self, linear, rows):
        self.rows += rows


@pytest.mark.parametrize("mode", ["current", "delayed", "blockwise"])
def test_padded_rows_change_nothing_but_the_gemm_shape(mode):
    """An expert's FP8 linear on 5 rows (training: _scaled_mm needs 16) appends 11 zero rows: its output and
    gradients are those of an unpadded linear given the same 5 rows plus 11 explicit zero rows (and zero dY
    there), to 1e-12 in float64; the observer is told the 11 rows."""
    torch.manual_seed(0)
    plain, twin = nn.Linear(32, 48).double(), nn.Linear(32, 48).double()
    twin.load_state_dict(plain.state_dict())
    padded = fp8.Fp8Linear(plain, fp8.Recipe(mode), "e", row_alignment=fp8_scaling.ROW_ALIGNMENT)
    explicit = fp8.Fp8Linear(twin, fp8.Recipe(mode), "x")
    padded.observer = _Padding()
    x = torch.randn(5, 32, dtype=DT, requires_grad=True)
    x16 = torch.cat([x.detach(), torch.zeros(11, 32, dtype=DT)]).requires_grad_()
    grad = torch.randn(5, 48, dtype=DT)
    y, y16 = padded(x), explicit(x16)
    y.backward(grad)
    y16.backward(torch.cat([grad, torch.zeros(11, 48, dtype=DT)]))
    assert y.shape == (5, 48) and padded.observer.rows == 11
    for a, b in ((y, y16[:5]), (x.grad, x16.grad[:5]), (plain.weight.grad, twin.weight.grad),
                 (plain.bias.grad, twin.bias.grad)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _moe_layer(dtype=torch.float32):
    from reference import build_model

    config = make_config(n_layer=1, n_head=2, n_embd=64, moe_experts=4, moe_topk=2)
    return build_model(config, seed=0, dtype=dtype)


@pytest.mark.parametrize("mode", ["current", "delayed", "blockwise"])
def test_a_moe_layer_in_fp8_is_within_fp8_tolerance_of_bf16(mode):
    """Every expert linear converted; under bf16 autocast the layer's output ≥ 18 dB, the experts' weight
    gradients and the input gradient ≥ 17 dB against the same layer in bf16 (tests/test_fp8.py's thresholds,
    torchao's). Delayed: the second step, scaled from the first's history."""
    model, reference = _moe_layer(), _moe_layer()
    handle = fp8.convert(model, fp8.Recipe(mode))
    layer, ref_layer = model.transformer.h[0].mlp, reference.transformer.h[0].mlp
    assert all(isinstance(getattr(e, n), fp8.Fp8Linear) for e in layer.experts.values() for n in ("c_fc", "c_proj"))
    assert sum(".experts." in name for name in handle.linears) == 8
    for step in range(2):
        x = torch.randn(4, 32, 64, generator=torch.Generator().manual_seed(step))
        x, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
        grad = torch.randn(4, 32, 64, generator=torch.Generator().manual_seed(10 + step))
        model.zero_grad(), reference.zero_grad()
        with torch.autocast("cpu", torch.bfloat16):
            y, y_ref = layer(x), ref_layer(x_ref)
        y.backward(grad), y_ref.backward(grad)
        handle.after_grad_sync()
    assert sqnr(y_ref, y) >= 18 and sqnr(x_ref.grad, x.grad) >= 17
    for i in layer.experts:
        for name in ("c_fc", "c_proj"):
            got, want = (getattr(m.experts[i], name).weight.grad for m in (layer, ref_layer))
            assert sqnr(want, got) >= 17, (i, name)


def test_padded_rows_per_moe_layer_equal_a_hand_count_and_are_printed():
    """Training forwards of a 2-MoE-layer model under FP8: the rows the accounting's observer counts per layer
    (report.axes.OBSERVERS["fp8"]) equal Σ over micro-batches and experts of (−m) mod 16 for the m rows the
    router sent each expert (E = 1: a chunk is a micro-batch's rows of one expert; an empty one pads nothing),
    and the end line prints them with their bytes, (5h + 4h·e_c) each."""
    from types import SimpleNamespace

    import report.axes
    from reference import build_model

    config = make_config(n_layer=2, n_head=2, n_embd=32, moe_experts=4, moe_topk=2)
    model = build_model(config, seed=0, dtype=DT)
    handle = fp8.convert(model, fp8.Recipe("current"))
    report.axes.observe(handle)
    hand, _ = train_counting_expert_padding(model, config, 16)
    assert handle.observer.rows == hand and all(hand.values())
    run = SimpleNamespace(config=config, compute_dtype=DT)
    lines = report.axes.axis_lines(handle, "end", run, 3)
    for layer_id, rows in hand.items():
        assert f"fp8 experts: MoE layer {layer_id} padded {rows} rows to 16 per chunk in 3 steps =" \
               f" {rows * (5 * 32 + 4 * 32 * 8)} bytes saved" in "\n".join(lines)


def test_the_saved_input_estimate_counts_a_routed_experts_share_of_the_rows():
    """fp8.saved_input_bytes (the start-up's memory line) gets each expert linear's width times k/N (E = 1,
    uniform routing): its M·k/N rows, not the micro-batch's M; the dense linears their full width."""
    model = _moe_layer()
    facts = fp8.convert(model, fp8.Recipe("current")).facts()
    assert facts.in_features["transformer.h.0.mlp.experts.3.c_proj"] == 4 * 64 * 2 / 4
    assert facts.in_features["transformer.h.0.attn.c_proj"] == 64
    saved = fp8.saved_input_bytes(facts.in_features.values(), 32, 2)["fp8"]
    assert saved == 32 * (64 + 64) + 32 * 2 * (64 + 4 * 64)  # attention's two; the k experts' rows, c_fc and c_proj


def test_the_padding_rule_and_its_expected_value():
    """(−m) mod 16 per non-empty chunk; the estimate's P = 7.5·N is that rule's mean over the 16 residues."""
    assert fp8_experts.padded_rows([0, 1, 16, 17]) == 15 + 0 + 15
    assert fp8_experts.expected_padded_rows(4) == 4 * fp8_experts.padded_rows(range(1, 17)) / 16 == 30


# ---------------------------------------------------------------------------------------------------------
# Meshes: train.py's composition (tests/test_composition.py's checks), one spawn of 4 ranks
# ---------------------------------------------------------------------------------------------------------

MOE = ["--moe-experts", "4"]
MESHES_4 = [  # (flags, config overrides, global batch, B_μ)
    ([*MOE, "--fp8", "current"], {}, 8, 1),  # E = 1, D = 4: each rank's experts run its micro-batch's rows
    ([*MOE, "--ep", "2", "--fp8", "current", "--zero", "3"], {}, 8, 1),  # E = 2: each source's chunk its own
    ([*MOE, "--ep", "2", "--fp8", "delayed", "--zero", "1"], {}, 8, 1),  # GEMM; ZeRO-3 gathers expert codes;
    ([*MOE, "--ep", "4", "--fp8", "blockwise"], {}, 8, 2),  # delayed histories MAX over expert_dp
    ([*MOE, "--ep", "2", "--pp", "2", "--pp-schedule", "zb", "--fp8", "delayed"], dict(n_layer=2), 8, 1),  # W deferred
]
CP = ([*MOE, "--ep", "2", "--cp", "2", "--fp8", "current"], {}, 8, 2)  # each CP piece's chunk scaled alone


def _meshes(rank, world, cases):
    import moe
    import test_composition

    out = [test_composition._run_case(rank, world, *case, trace=True) for case in cases]
    out.append(test_composition._run_case(rank, world, *CP))
    run = test_composition.composed_run(rank, world, *cases[1], device=torch.device("cpu"))  # E = 2, as trained
    experts = [m for m in run.model.modules() if isinstance(m, moe.Expert)]
    return out, [(type(m.c_fc).__name__, m.c_fc.row_alignment, m.c_fc.amax_groups) for m in experts]


@pytest.fixture(scope="module")
def mesh_runs():
    results = run_ranks(_meshes, 4, MESHES_4, timeout=600)
    for rank, (_, experts) in enumerate(results):  # each rank's N/E = 2 experts of each of the 2 MoE layers
        assert experts == [("Fp8Linear", 16, {})] * 4, (rank, experts)
    return [runs for runs, _ in results]


@pytest.mark.slow
def test_fp8_experts_on_meshes_equal_the_single_device(mesh_runs):
    """Losses and final parameters of every mesh equal the single device's under the same recipe (float64,
    1e-10), so E = 2 equals E = 1: each expert quantises the same rows with the same scale everywhere."""
    import test_composition

    for index, case in enumerate(MESHES_4):
        test_composition._check([rank_results[index] for rank_results in mesh_runs], *case)
    ep1, ep2 = (torch.tensor(list(mesh_runs[0][i][0].values())) for i in (0, 1))
    torch.testing.assert_close(ep2, ep1, rtol=TOL, atol=TOL)


@pytest.mark.slow
def test_fp8_experts_send_no_amax_reductions_of_their_own(mesh_runs):
    """Every (collective, group) traced equals report.run.predicted_messages: the experts' linears reduce no amax
    (current), their delayed histories roll with the dense ones' groups."""
    for index, case in enumerate(MESHES_4):
        for rank, rank_results in enumerate(mesh_runs):
            traced, predicted = rank_results[index][2]  # (the CP run, last, is not traced)
            assert set(traced) == set(predicted), (case, rank, set(traced) ^ set(predicted))
            for key, (calls, payload) in predicted.items():
                assert traced[key] == pytest.approx((calls, payload), abs=1e-9), (case, rank, key)


@pytest.mark.slow
def test_fp8_experts_under_cp_follow_the_single_device_within_fp8_noise(mesh_runs):
    """Under CP a micro-batch's rows of an expert lie on both pieces' ranks, each chunk scaled alone (fp8.py's
    Experts): not the single device's quantisation, so not 1e-10; the losses stay within 5e-4 relative of the
    single device's under the same recipe (measured 1.7e-4 at step 3; FP8 itself moves them 1.6e-4 from fp64)."""
    import test_composition
    from reference import global_batches, reference_run

    flags, _, global_batch, micro = CP
    config = test_composition._config(test_composition._parse(flags, global_batch, micro), {})
    ref_losses, _, _ = reference_run(config, global_batches(test_composition.STEPS, global_batch, test_composition.SEQ),
                                     clip=test_composition.CLIP, micro_batches=global_batch // micro,
                                     fp8_recipe="current")
    for rank, rank_results in enumerate(mesh_runs):
        losses = torch.tensor(list(rank_results[-1][0].values()))
        torch.testing.assert_close(losses, torch.tensor(ref_losses), rtol=5e-4, atol=0, msg=f"rank {rank}")


# ---------------------------------------------------------------------------------------------------------
# --fp8 current with redundant experts (experts/eplb.py): one spawn of 2 ranks, E = 2, N = 4 experts in R = 6 slots
# ---------------------------------------------------------------------------------------------------------

PLAIN_EP = ["--moe-experts", "4", "--ep", "2", "--fp8", "current"]
WITH_REPLICAS = [*PLAIN_EP, "--moe-replicas", "6", "--moe-replan-every", "1"]  # slots move after every step


def _replica_run(rank, world, flags, steps=3, mis_map=False):
    """(losses per step, the first MoE layer's output [T, h] on this rank's first micro-batch of each step, its
    top-k logical experts [T, k], each slot's logical expert at the start) of `steps` steps of train.compose's
    run (float64, test_composition's batches, D = 2, m = 2). mis_map: before any step, a second replica's slot
    takes the weights of another expert's slot (a slot holding the wrong logical expert)."""
    import moe
    from optim import DynamicLossScaler
    from step import train_step
    from reference import global_batches, rank_micro_batches
    from test_composition import CLIP, SEQ, composed_run

    run = composed_run(rank, world, flags, {}, 4, 1, torch.device("cpu"))
    layer = next(block.mlp for block in run.model.transformer.h if isinstance(block.mlp, moe.MoE))
    seen = {"logits": [], "y": []}  # list.append returns None: the hooks observe, never replace an output
    layer.router.register_forward_hook(lambda m, i, out: seen["logits"].append(out.detach().clone()))
    layer.register_forward_hook(lambda m, i, out: seen["y"].append(out.detach().clone()))
    phy2log = list(layer.replicas.phy2log) if layer.replicas is not None else None
    if mis_map:
        slot = next(q for q in layer.local if layer.replicas.replica[q] > 0)
        other = next(q for q in layer.local if phy2log[q] != phy2log[slot])
        with torch.no_grad():
            for wrong, right in zip(layer.experts[str(slot)].parameters(), layer.experts[str(other)].parameters()):
                wrong.copy_(right)
    scaler, mesh, losses = DynamicLossScaler(enabled=False), run.mesh, []
    for x, y in global_batches(steps, 4, SEQ):
        batches = [(*b, None) for b in rank_micro_batches(x, y, mesh.index("dp"), mesh.size("dp"), 1)]
        losses.append(train_step(run.layout, scaler, batches, mesh.group("dp_cp"), CLIP, run.autocast, run.device,
                                 model=run.model, schedule=run.schedule, axes=run.axes,
                                 data_size=mesh.size("dp")).loss)
    firsts = len(seen["y"]) // steps  # the micro-batches of a step: each step's first forward
    experts = [logits.topk(run.model.config.moe.topk, dim=-1).indices for logits in seen["logits"][::firsts]]
    return losses, [y.reshape(-1, y.shape[-1]) for y in seen["y"][::firsts]], experts, phy2log


def _fp8_replica_runs(rank, world):
    """FP8 current without and with replicas (3 steps); with a mis-mapped slot and without FP8 (1 step)."""
    return (_replica_run(rank, world, PLAIN_EP), _replica_run(rank, world, WITH_REPLICAS),
            _replica_run(rank, world, WITH_REPLICAS, steps=1, mis_map=True),
            _replica_run(rank, world, PLAIN_EP[:-2], steps=1))


def _row_error(rows, reference):
    """Each row's largest |difference| from `reference`'s row [T]."""
    return (rows - reference).abs().max(dim=-1).values


def test_fp8_current_with_replicas_follows_the_run_without_them():
    """--fp8 current, E = 2, N = 4 experts in R = 6 slots (experts 0 and 1 have two), against the same run
    without replicas (same init and batches). A replicated expert's chunk of a source's rows is split over its
    replicas and each part quantised with its own amax (fp8.py's Experts), so not bitwise; the weights are the
    same tensors (the same codes), so a row can only differ by its input's (and dY's) rounding in e4m3.
    Step 0 (same weights, same routing: the attention before the first MoE layer is identical):
    - the first MoE layer's output rows of tokens routed only to unreplicated experts: bitwise (the same rows of
      the same chunk, the same amax);
    - the other rows: each within 2× that row's own FP8 error (|FP8 row − fp64 row| without replicas; measured
      ≤ 1.11×, 0.045-0.063 of the row's max magnitude), and not all bitwise (the split happened);
    - a second replica's slot holding another expert's weights breaks that bound (measured 20×).
    The losses of 3 steps (re-planned after each: slots move) within 5e-4 relative (measured ≤ 2.2e-4; FP8
    itself moves them up to 4.9e-4 from fp64 here); the mis-mapped slot's step-0 loss is also caught by the
    row bound only (its loss moves 5.2e-4: a few steps of losses alone cannot tell FP8 noise from a wrong slot)."""
    results = run_ranks(_fp8_replica_runs, 2, timeout=300)
    for rank, (plain, replicated, mis_mapped, precise) in enumerate(results):
        doubled = {e for e in replicated[3] if replicated[3].count(e) > 1}
        assert doubled == {0, 1}, replicated[3]
        assert torch.equal(plain[2][0], replicated[2][0]) and torch.equal(plain[2][0], precise[2][0])
        alone = torch.tensor([not set(row.tolist()) & doubled for row in plain[2][0]])
        assert alone.any() and not alone.all(), alone  # both kinds of rows on this rank's micro-batch
        assert torch.equal(replicated[1][0][alone], plain[1][0][alone]), rank
        fp8_error = _row_error(precise[1][0], plain[1][0])[~alone]
        split_error = _row_error(replicated[1][0], plain[1][0])[~alone]
        assert (split_error <= 2 * fp8_error).all() and split_error.max() > 0, (rank, split_error / fp8_error)
        assert (_row_error(mis_mapped[1][0], plain[1][0]) > 2 * _row_error(precise[1][0], plain[1][0])).any()
        torch.testing.assert_close(torch.tensor(replicated[0]), torch.tensor(plain[0]), rtol=5e-4, atol=0,
                                   msg=f"rank {rank}")
