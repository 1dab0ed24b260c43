"""fp8.py: casts, the three scaling recipes, the FP8 linear, its state, and FP8 on a TP and a DP mesh.

Numerics against high precision use SQNR = 10·log10(Σ ref² / Σ (ref - x)²) with torchao's thresholds (cast
round trip ≥ 25 dB; the FP8 linear's output ≥ 18 dB and weight gradient ≥ 17 dB against the bf16 linear).
The delayed recipe is checked against a hand computation. The mesh tests train the float64 GPT with FP8 on
TP=2 (tensor_parallel.parallelize; also with SP and with activation checkpointing) and on DP=2, and compare
with the single-device FP8 model on the same D·m micro-batches: losses and parameters within 1e-10
(float64). That tolerance only holds because every element is quantised identically on both meshes (the
amaxes, hence the scales, agree), so a missing amax reduction fails it by orders of magnitude. The FP8 state
is compared within float32's rounding (rtol 1e-6): amaxes are float32, taken of float64 tensors that the
meshes sum in different orders. The traced amax all-reduces must equal `predicted_messages`. Those runs share
one spawn (the module fixture `mesh_runs`); each property is its own test, per mesh and variant.
The training loop there is explicit (micro-batches, a gradient all-reduce, `after_grad_sync`, torch's AdamW)
so that those tests depend on nothing but model.py, mesh.py, tensor_parallel.py and fp8.py; one more run goes
through step.train_step and a DDP layout, to show that a non-finite amax on one rank skips the step on all.
The mesh runs build on harness.device() (each rank's GPU under nccl; float64 keeps the GEMMs emulated there
too, so they still compare with the CPU reference at 1e-10); the one-process tests check numerics on the CPU.
"""

import copy
import functools
from collections import defaultdict
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from accounting import format_flops
import fp8
from precision import fp8_scaling
import harness
import moe
import report.axes
from harness import run_ranks
from reference import HYPER, WholeGrads, global_batches, make_config, rank_micro_batches

STEPS, SEQ, GLOBAL_BATCH, MICRO = 3, 16, 8, 2
TOL = 1e-10


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models run on one thread


def sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.detach().double(), x.detach().double()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - x).pow(2).sum()))


def fp8_state(handle) -> dict:
    """The handle's checkpoint state, {key: a copy}, as ckpt.py reads it (state_pieces)."""
    return {piece.key: piece.tensor.detach().cpu().clone() for piece in handle.state_pieces()}


# ---------------------------------------------------------------------------------------------------------
# Casts and the FP8 linear's numerics
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", [fp8_scaling.E4M3, fp8_scaling.E5M2], ids=lambda f: f.name)
def test_cast_round_trip_puts_the_amax_on_the_format_max(fmt):
    torch.manual_seed(0)
    x = torch.randn(512, 512) * 3
    scale = fp8_scaling.scale_from_amax(fp8_scaling.amax_of(x), fmt.max)
    q, saturated = fp8_scaling.quantize(x, fmt, scale)
    assert q.dtype == fmt.dtype and int(saturated) == 0
    assert float(q.float().abs().max()) == fmt.max  # current scaling puts the amax on the format's max
    assert sqnr(x, fp8_scaling.dequantize(q, scale, torch.float32)) >= 25


@pytest.mark.parametrize("fmt", [fp8_scaling.E4M3, fp8_scaling.E5M2], ids=lambda f: f.name)
def test_a_too_large_scale_clamps_and_counts_never_inf(fmt):
    """A scale 4× too large: the values beyond max are clamped and counted, never inf (E5M2's plain cast is)."""
    torch.manual_seed(0)
    x = torch.randn(512, 512) * 3
    scale = fp8_scaling.scale_from_amax(fp8_scaling.amax_of(x), fmt.max) * 4
    q, saturated = fp8_scaling.quantize(x, fmt, scale)
    assert torch.isfinite(q.float()).all() and float(q.float().abs().max()) == fmt.max
    assert int(saturated) == int((x.abs() * scale > fmt.max).sum()) > 0
    assert torch.isinf((x * 1e5).to(torch.float8_e5m2).float()).any()  # why the clamp is needed


def test_tile_round_trip():
    torch.manual_seed(0)
    x = torch.randn(512, 512) * 3
    q, inverse, amax = fp8_scaling.quantize_tiles(x, fp8_scaling.TILE_ACTIVATION)
    assert inverse.shape == (512, 4) and float(amax) == float(x.abs().max())
    assert sqnr(x, fp8_scaling.dequantize_tiles(q, inverse, fp8_scaling.TILE_ACTIVATION, torch.float32)) >= 25


@pytest.mark.parametrize("mode", fp8.MODES)
def test_linear_against_bf16_linear(mode):
    """Output ≥ 18 dB, weight gradient ≥ 17 dB (torchao's thresholds), input gradient ≥ 17 dB, under bf16
    autocast. Delayed: the second step, which quantises with the first step's amaxes."""
    torch.manual_seed(0)
    plain = nn.Linear(256, 512)
    reference = nn.Linear(256, 512)
    reference.load_state_dict(plain.state_dict())
    layer = fp8.Fp8Linear(plain, fp8.Recipe(mode), "layer")
    handle = fp8.Fp8Handle(fp8.Recipe(mode), {"layer": layer})
    for step in range(2):
        x = torch.randn(4, 64, 256, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        grad = torch.randn(4, 64, 512)
        plain.weight.grad = reference.weight.grad = None
        with torch.autocast("cpu", torch.bfloat16):
            y, y_ref = layer(x), reference(x_ref)
        y.backward(grad), y_ref.backward(grad)
        handle.after_grad_sync()
    assert y.dtype == torch.bfloat16 and layer.weight is plain.weight
    assert sqnr(y_ref, y) >= 18
    assert sqnr(reference.weight.grad, plain.weight.grad) >= 17
    assert sqnr(x_ref.grad, x.grad) >= 17
    if mode == "delayed":
        assert layer.history_ready and float(layer.last_scale[0]) == float(layer.scale[0]) != 1.0


def test_gpu_gemm_path_matches_emulation():
    """The _scaled_mm path (forced; torch runs it on CPU too) against the emulated one, same quantised values:
    checks the GPU path's operand layouts, inverse scales and e5m2×e4m3 backward."""
    if not hasattr(torch, "_scaled_mm"):
        pytest.skip("this torch has no _scaled_mm")
    results = []
    for gemm in ("emulated", "scaled_mm"):
        torch.manual_seed(0)
        plain = nn.Linear(64, 96)
        layer = fp8.Fp8Linear(plain, fp8.Recipe("current"), "layer", gemm=gemm)
        assert layer.use_scaled_mm == (gemm == "scaled_mm")
        x = torch.randn(2, 16, 64, requires_grad=True)
        y = layer(x)
        y.backward(torch.randn(2, 16, 96) * 1e-3)
        results.append((y.detach(), x.grad, plain.weight.grad))
    for emulated, scaled_mm in zip(*results):  # fp32 accumulation in a different order: rounding only
        torch.testing.assert_close(scaled_mm, emulated, rtol=1e-5, atol=1e-6)


def test_gpu_shape_rules_rejected_on_cpu():
    layer = fp8.Fp8Linear(nn.Linear(40, 64), fp8.Recipe("current"), "odd")
    with pytest.raises(ValueError, match=r"K \(in_features\)=40 is not a multiple of 16"):
        layer(torch.randn(16, 40))
    layer = fp8.Fp8Linear(nn.Linear(32, 64), fp8.Recipe("delayed"), "tokens")
    with pytest.raises(ValueError, match="M=10 tokens per micro-batch is not a multiple of 16"):
        layer(torch.randn(10, 32, requires_grad=True))
    with torch.no_grad():
        assert layer(torch.randn(10, 32)).shape == (10, 64)  # the forward GEMM alone has no rule on M


def test_gpu_operand_rules_rejected_on_cpu():
    a = torch.randn(16, 32).to(fp8_scaling.E5M2.dtype)
    b = torch.randn(64, 32).to(fp8_scaling.E5M2.dtype)
    one = torch.ones(())
    with pytest.raises(ValueError, match="e5m2 × e5m2 has no tensor-core GEMM"):
        fp8_scaling.scaled_matmul(a, one, b.t(), one, torch.float32, False)
    with pytest.raises(ValueError, match="column-major second one"):
        fp8_scaling.scaled_matmul(a, one, b.to(fp8_scaling.E4M3.dtype).t().contiguous(), one, torch.float32, False)


def test_config_from_flags_names_the_flags():
    from mesh import MeshShape

    args = SimpleNamespace(fp8="delayed", fp8_amax_history=16, fp8_amax_algo="max", fp8_margin=0)

    def settings(tp=1, cp=1, micro=2, seq_len=16):
        return SimpleNamespace(shape=MeshShape(dp=1, tp=tp, cp=cp), model=make_config(n_embd=32, n_head=4),
                               micro_batch_size=micro, seq_len=seq_len)

    assert fp8.config_from_flags(args, settings(tp=2)) == fp8.Recipe("delayed", 16, "max", 0)
    assert fp8.config_from_flags(SimpleNamespace(fp8=None), settings(tp=4)) is None  # off: nothing to check
    cases = [("delayed", dict(tp=4), "--fp8 delayed with --tp 4"),
             ("delayed", dict(micro=1, seq_len=12), "M=12 tokens"),
             ("blockwise", dict(tp=2), "--fp8 blockwise with --tp 2")]
    for mode, mesh, text in cases:
        with pytest.raises(ValueError, match=text):
            fp8.config_from_flags(SimpleNamespace(**{**vars(args), "fp8": mode}), settings(**mesh))


def test_blockwise_tiles_run_along_each_gemms_contracted_dimension():
    """DeepSeek-V3's tiles: one scale per 128 values of the dimension each GEMM contracts. At M = 256 tokens,
    K = 384, N = 128 a tile along the wrong dimension gives another grid: the forward's X [256, 384] has
    [256, 3] scales (1×128 along K), W [128, 384] [1, 3] (128×128 blocks), dX = dY·W's dY [256, 128] [256, 1]
    (1×128 along N), and dW = dYᵀ·X contracts the 256 tokens: dY [2, 128] and X [2, 384] (128×1 tiles). The
    blockwise FP8 linear computes its three GEMMs from exactly these operands (bitwise)."""
    M, K, N, f64 = 256, 384, 128, torch.float64
    torch.manual_seed(0)
    x, dy = torch.randn(M, K, dtype=f64), torch.randn(M, N, dtype=f64)
    plain = nn.Linear(K, N, dtype=f64)
    qw, iw, _ = fp8_scaling.quantize_tiles(plain.weight.detach(), fp8_scaling.TILE_WEIGHT)
    qx, ix, _ = fp8_scaling.quantize_tiles(x, fp8_scaling.TILE_ACTIVATION)
    qdy, idy, _ = fp8_scaling.quantize_tiles(dy, fp8_scaling.TILE_ACTIVATION)
    qdy_t, idy_t, qx_t, ix_t = fp8.blockwise_weight_grad_operands(dy, qx, ix, f64)
    grids = {"W": iw.shape, "X": ix.shape, "dY of dX": idy.shape, "dY of dW": idy_t.shape, "X of dW": ix_t.shape}
    assert grids == {"W": (1, 3), "X": (256, 3), "dY of dX": (256, 1), "dY of dW": (2, 128), "X of dW": (2, 384)}
    # A tile's inverse scale is its own amax / 448: dW's dY tiles hold 128 tokens of one output column.
    tile_amax = dy.abs().view(2, 128, N).amax(dim=1)
    torch.testing.assert_close(idy_t, tile_amax / fp8_scaling.E4M3.max, rtol=1e-6, atol=0)

    layer = fp8.Fp8Linear(plain, fp8.Recipe("blockwise"), "layer")
    x_leaf = x.clone().requires_grad_()
    y = layer(x_leaf)
    y.backward(dy)

    def dq(q, inverse, tile):
        return fp8_scaling.dequantize_tiles(q, inverse, tile, f64)

    w = dq(qw, iw, fp8_scaling.TILE_WEIGHT)
    assert torch.equal(y, dq(qx, ix, fp8_scaling.TILE_ACTIVATION) @ w.t() + plain.bias)
    assert torch.equal(x_leaf.grad, dq(qdy, idy, fp8_scaling.TILE_ACTIVATION) @ w)
    dw = dq(qdy_t, idy_t, fp8_scaling.TILE_ACTIVATION_T).t() @ dq(qx_t, ix_t, fp8_scaling.TILE_ACTIVATION_T)
    assert torch.equal(plain.weight.grad, dw)


# ---------------------------------------------------------------------------------------------------------
# Delayed scaling against a hand computation
# ---------------------------------------------------------------------------------------------------------


def test_roll_history_by_hand():
    """L = 3, margin 1; amaxes 2, 8, inf, 1, 0.5, 0.25 (inf never enters; its step keeps the scale)."""
    amaxes = [2.0, 8.0, float("inf"), 1.0, 0.5, 0.25]
    histories = [[2, 0, 0], [8, 2, 0], [8, 2, 0], [1, 8, 2], [0.5, 1, 8], [0.25, 0.5, 1]]
    by_algo = {"max": [2, 8, 8, 8, 8, 1], "most_recent": [2, 8, 8, 1, 0.5, 0.25]}  # the amax each scale uses
    for algo, used in by_algo.items():
        recipe = fp8.Recipe("delayed", amax_history=3, amax_algo=algo, margin=1)
        history, scale = torch.zeros(2, 3), torch.ones(2)
        for amax, expected_history, expected_amax in zip(amaxes, histories, used):
            history, scale = fp8_scaling.roll_history(history, scale, torch.tensor([amax, amax]),
                                              torch.tensor([448.0, 57344.0]), recipe)
            assert history.tolist() == [expected_history] * 2
            assert scale.tolist() == [448.0 / expected_amax / 2, 57344.0 / expected_amax / 2], (algo, amax)
    # An amax of 0 (an all-zero tensor) enters, but most_recent keeps the previous scale rather than divide by 0.
    recipe = fp8.Recipe("delayed", amax_history=2, amax_algo="most_recent")
    history, scale = fp8_scaling.roll_history(torch.tensor([[4.0, 0]]), torch.tensor([112.0]), torch.tensor([0.0]),
                                      torch.tensor([448.0]), recipe)
    assert history.tolist() == [[0.0, 4.0]] and scale.tolist() == [112.0]


def _hand_linear(x, w, b, scale_x, scale_w):
    """The FP8 forward by hand: torch's own casts, float64 matmul."""
    qx = (x * scale_x).clamp(-448, 448).to(torch.float8_e4m3fn).double() / scale_x
    qw = (w * scale_w).clamp(-448, 448).to(torch.float8_e4m3fn).double() / scale_w
    return qx @ qw.t() + b


@pytest.fixture(scope="module")
def delayed_by_hand():
    """Four steps of a delayed linear (L = 2, margin 1) whose input amaxes are 3, 5, inf, 2 and output
    gradient amaxes 0.5, 0.25, 0.75, nan; per step what it computed and the hand computation of it."""
    torch.manual_seed(0)
    plain = nn.Linear(32, 16, dtype=torch.float64)
    recipe = fp8.Recipe("delayed", amax_history=2, amax_algo="max", margin=1)
    layer = fp8.Fp8Linear(plain, recipe, "layer")
    handle = fp8.Fp8Handle(recipe, {"layer": layer})
    w, b = plain.weight.detach(), plain.bias.detach()
    amax_w = float(w.abs().max())
    history, scale = torch.zeros(3, 2), torch.ones(3)
    steps = []
    for step, (x_amax, dy_amax) in enumerate(zip([3.0, 5.0, float("inf"), 2.0], [0.5, 0.25, 0.75, float("nan")])):
        x = torch.rand(16, 32, dtype=torch.float64) * 2 - 1
        x[3, 4] = x_amax  # the amax of the step's input
        dy = torch.rand(16, 16, dtype=torch.float64) * 0.1
        dy[0, 0] = dy_amax
        y = layer(x.requires_grad_())
        y.backward(dy)
        if step == 0:  # empty history: the first step scales like `current` (the tensors' own amaxes)
            expected_scale = torch.tensor([448.0, 448.0, 57344.0]) / torch.tensor([x_amax, amax_w, dy_amax]).float() / 2
        else:  # delayed: the scales from the history of the previous steps
            expected_scale = scale.clone()
        used_scale = layer.last_scale.clone()
        sx, sw = used_scale[0].double(), used_scale[1].double()
        record = dict(y=y.detach(), by_hand=_hand_linear(x.detach(), w, b, sx, sw), used_scale=used_scale,
                      expected_scale=expected_scale, finite_grad=bool(torch.isfinite(plain.weight.grad).all()))
        record["nonfinite"] = handle.after_grad_sync()
        # By hand: each role's amax enters when finite; scale = max/(max of history)/2^margin.
        new = torch.tensor([x_amax, amax_w, dy_amax]).float()
        for role, fmt_max in enumerate((448.0, 448.0, 57344.0)):
            if torch.isfinite(new[role]):
                history[role] = torch.stack([new[role], history[role, 0]])
                scale[role] = torch.tensor(fmt_max) / history[role].max() / 2  # (448 / t is 448 · (1/t))
        record.update(history=layer.amax_history.clone(), scale=layer.scale.clone(),
                      expected_history=history.clone(), expected_next_scale=scale.clone())
        steps.append(record)
        plain.weight.grad = plain.bias.grad = None
    return steps


def test_delayed_linear_scales_and_computes_as_by_hand(delayed_by_hand):
    for step, r in enumerate(delayed_by_hand):
        assert torch.equal(r["used_scale"], r["expected_scale"]), step
        torch.testing.assert_close(r["y"], r["by_hand"], rtol=1e-12, atol=1e-12)
        assert torch.isfinite(r["y"]).all()


def test_delayed_history_and_scale_roll_as_by_hand(delayed_by_hand):
    for step, r in enumerate(delayed_by_hand):
        assert torch.equal(r["history"], r["expected_history"]), step
        assert torch.equal(r["scale"], r["expected_next_scale"]), step


def test_a_nonfinite_amax_is_counted_by_after_grad_sync(delayed_by_hand):
    """Step 2's input held an inf: the E4M3 cast clamped it to 448, the gradients stayed finite, and only the
    count after_grad_sync returns tells the update to skip (step 3: a NaN output gradient). It never entered
    the history (test_delayed_history_and_scale_roll_as_by_hand)."""
    assert [r["nonfinite"] for r in delayed_by_hand] == [0, 0, 1, 1]
    assert [r["finite_grad"] for r in delayed_by_hand] == [True, True, True, False]


def test_state_pieces_restore_on_a_fresh_model_and_replay_bitwise():
    """Three delayed steps, the state saved as ckpt.py does (model, optimizer, the handle's state_pieces),
    copied into a fresh model's tensors: the restored linears read `history_ready` from the loaded histories
    (no hook tells them), and the fourth step is bitwise the uninterrupted one."""
    from reference import build_model

    config = make_config()
    batches = global_batches(4, 4, SEQ)
    recipe = fp8.Recipe("delayed", amax_history=3)

    def build():
        model = build_model(config, seed=0, dtype=torch.float64)
        return model, fp8.convert(model, recipe), torch.optim.AdamW(model.parameters(), lr=HYPER["lr"])

    def step(model, handle, optimizer, x, y):
        _, loss_sum, count = model(x, y)
        (loss_sum / count).backward()
        handle.after_grad_sync()
        optimizer.step()
        optimizer.zero_grad()
        return loss_sum.detach()

    model, handle, optimizer = build()
    for x, y in batches[:3]:
        step(model, handle, optimizer, x, y)
    saved = fp8_state(handle)
    assert set(saved) == {f"fp8/transformer.h.{i}.{n}.{k}" for i in range(2)
                          for n in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
                          for k in ("amax_history", "scale")}
    restored, restored_handle, restored_opt = build()
    restored.load_state_dict(copy.deepcopy(model.state_dict()))
    restored_opt.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # not the live moments: copies
    with torch.no_grad():
        for piece in restored_handle.state_pieces():  # what ckpt.py's load does: copy into the live tensors
            piece.tensor.copy_(saved[piece.key])
    for name, linear in handle.linears.items():
        twin = restored_handle.linears[name]
        assert torch.equal(twin.amax_history, linear.amax_history) and torch.equal(twin.scale, linear.scale)
        assert twin.history_ready and (linear.amax_history[:, 2] > 0).all()  # three steps: history full
    x, y = batches[3]
    assert torch.equal(step(model, handle, optimizer, x, y), step(restored, restored_handle, restored_opt, x, y))
    for p, q in zip(model.parameters(), restored.parameters()):
        assert torch.equal(p, q)  # bitwise replay


def test_history_ready_follows_a_loaded_history():
    """An empty history loaded into a ready linear makes it scale like `current` again; a non-empty one into
    a fresh linear makes it delayed: derived from the tensors, on the next use."""
    layer = fp8.Fp8Linear(nn.Linear(32, 16), fp8.Recipe("delayed", amax_history=2), "layer")
    assert not layer.history_ready
    with torch.no_grad():
        layer.amax_history.copy_(torch.tensor([[0.0, 3.0], [0.0, 1.0], [0.0, 0.5]]))
    assert layer.history_ready
    layer.roll(torch.full((3,), float("nan")), False)  # a non-finite step: the history stays, and ready
    assert layer.history_ready
    with torch.no_grad():
        layer.amax_history.zero_()
    assert not layer.history_ready


# ---------------------------------------------------------------------------------------------------------
# Memory, ZeRO-3 helpers, activation checkpointing, the weight cache
# ---------------------------------------------------------------------------------------------------------


def _saved_bytes(fn):
    total = []

    def pack(t):
        total.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(total), out


def test_inputs_saved_in_fp8_and_counted():
    """Under bf16 autocast a plain block saves each linear's input and weight in bf16; the FP8 block saves the
    input in FP8 (+ a float32 scale per linear), its FP8 weight being the step's cache on the linear (not an
    activation: one copy per step, whatever the micro-batches in flight). The measured difference is
    fp8.saved_input_bytes."""
    from reference import build_model

    config = make_config(n_embd=64)
    x = torch.randn(2, SEQ, config.n_embd)
    measured = {}
    for use_fp8 in (False, True):
        model = build_model(config, seed=0)
        handle = fp8.convert(model, fp8.Recipe("current")) if use_fp8 else None
        with torch.autocast("cpu", torch.bfloat16):
            measured[use_fp8], _ = _saved_bytes(lambda: model.transformer.h[0](x.requires_grad_()))
    linears = [lin for name, lin in handle.linears.items() if name.startswith("transformer.h.0.")]
    weights = sum(lin.weight.numel() for lin in linears)
    saved = fp8.saved_input_bytes([lin.in_features for lin in linears], 2 * SEQ, 2)["saved"]
    predicted = saved + weights * 2 - 4 * len(linears)
    assert measured[False] - measured[True] == predicted
    assert all(lin.weight_codes.q.numel() == lin.weight.numel() for lin in linears)  # held by the linear


def test_zero3_uint8_shards_share_one_scale():
    torch.manual_seed(0)
    plain = nn.Linear(64, 32)
    weight = plain.weight.detach()
    amax = torch.stack([fp8_scaling.amax_of(piece) for piece in weight.chunk(4)]).max()  # what MAX all_reduce gives
    scale = fp8_scaling.scale_from_amax(amax, fp8_scaling.E4M3.max)
    gathered = torch.cat([fp8.quantize_to_uint8(piece, scale) for piece in weight.chunk(4)])
    assert gathered.dtype == torch.uint8 and gathered.numel() == weight.numel()  # 1 byte per element
    whole, _ = fp8_scaling.quantize(weight, fp8_scaling.E4M3, scale)
    assert torch.equal(gathered, whole.view(torch.uint8))
    # The FP8 linear on the dequantised weight (its own current scale) lands on exactly the same values.
    dequantized = fp8.dequantize_from_uint8(gathered, scale, torch.float32)
    scale_again = fp8_scaling.scale_from_amax(fp8_scaling.amax_of(dequantized), 448.0)
    requantized, _ = fp8_scaling.quantize(dequantized, fp8_scaling.E4M3, scale_again)
    assert torch.equal(requantized.view(torch.uint8), gathered)


class _WeightQuantisations:
    """Counts fp8_scaling.quantize / quantize_tiles calls on a registered weight (by its storage), per name."""

    def __init__(self, monkeypatch):
        self.names, self.counts = {}, defaultdict(int)
        for function in ("quantize", "quantize_tiles"):
            original = getattr(fp8, function)

            def counting(x, *args, original=original, **kwargs):
                if x.data_ptr() in self.names:
                    self.counts[self.names[x.data_ptr()]] += 1
                return original(x, *args, **kwargs)

            monkeypatch.setattr(fp8, function, counting)

    def register(self, linears: dict, prefix: str) -> None:
        self.names.update({linear.weight.data_ptr(): (prefix, name) for name, linear in linears.items()})

    def take(self) -> dict:
        counts, self.counts = dict(self.counts), defaultdict(int)
        return counts


@pytest.fixture(scope="module", params=fp8.MODES)
def cached_and_uncached(request):
    """m = 4 micro-batches, two steps, with an evaluation forward before the second (whose FP8 weight the
    step may reuse: the weight is the same), once with the step's weight cache and once quantising afresh in
    every forward. Per run: losses, parameters, FP8 state, the step tables, the weight quantisations per step."""
    from reference import build_model
    from optim import adamw_param_groups

    mode, m, steps = request.param, 4, 2
    monkeypatch = pytest.MonkeyPatch()
    counter = _WeightQuantisations(monkeypatch)
    runs = {}
    for cached in (True, False):
        model = build_model(make_config(), seed=0, dtype=torch.float64)
        handle = fp8.convert(model, fp8.Recipe(mode))
        report.axes.observe(handle)  # as train.compose does: the saturation counts the tables read
        counter.register(handle.linears, "cached" if cached else "uncached")
        if not cached:
            for linear in handle.linears.values():
                linear.register_forward_pre_hook(lambda module, args: setattr(module, "weight_codes", None))
        optimizer = torch.optim.AdamW(adamw_param_groups(model.parameters(), HYPER["weight_decay"]), lr=HYPER["lr"])
        losses, counts, tables = [], [], []
        for step, (x, y) in enumerate(global_batches(steps, m * MICRO, SEQ)):
            if step > 0:
                with torch.no_grad():
                    model(x[:MICRO], y[:MICRO])  # an evaluation between the steps
                counter.take()
            for xb, yb in zip(x.chunk(m), y.chunk(m)):
                _, loss_sum, _ = model(xb, yb)
                (loss_sum / (y != -1).sum()).backward()
                losses.append(loss_sum.detach())
            handle.after_grad_sync()
            counts.append(counter.take())
            tables.append(report.axes.axis_lines(handle, "step", None))
            optimizer.step()
            optimizer.zero_grad()
        runs[cached] = dict(losses=losses, params=list(model.parameters()), state=fp8_state(handle), tables=tables,
                            counts=counts, linears=len(handle.linears))
    monkeypatch.undo()
    return mode, runs


def test_weight_quantised_once_per_step(cached_and_uncached):
    """Each linear quantises its weight once per step (the first forward, or the evaluation's before it; the
    other forwards and every backward reuse it); the uncached run every micro-batch."""
    _, runs = cached_and_uncached
    n = runs[True]["linears"]
    assert len(runs[True]["counts"][0]) == n and set(runs[True]["counts"][0].values()) == {1}
    assert runs[True]["counts"][1] == {}  # step 2 reuses the evaluation's FP8 weight: the same weight
    assert all(len(c) == n and set(c.values()) == {4} for c in runs[False]["counts"])


def test_cached_weight_run_is_bitwise_the_uncached_one(cached_and_uncached):
    """Losses, parameters, the FP8 state and the scale tables (saturation counted as uncached) agree bitwise."""
    _, runs = cached_and_uncached
    cached, uncached = runs[True], runs[False]
    assert all(torch.equal(a, b) for a, b in zip(cached["losses"], uncached["losses"]))
    assert all(torch.equal(a, b) for a, b in zip(cached["params"], uncached["params"]))
    assert cached["state"].keys() == uncached["state"].keys()
    assert all(torch.equal(cached["state"][k], uncached["state"][k]) for k in cached["state"])
    assert cached["tables"] == uncached["tables"]


def test_cached_weight_is_made_again_when_the_weight_changes():
    """The step's FP8 weight is never stale, with no hook at the start of a step: it is made again after an
    in-place change (an optimizer step, a checkpoint load: the tensor's version), for another tensor (a `.data`
    swap), when ZeRO-3 regathered it (a new gathered amax), after a delayed roll or a restored scale (the
    scale's version), after a restored history, and when a step ends."""
    torch.manual_seed(0)
    plain = nn.Linear(64, 32, dtype=torch.float64)
    recipe = fp8.Recipe("delayed")
    layer = fp8.Fp8Linear(plain, recipe, "layer")
    handle = fp8.Fp8Handle(recipe, {"layer": layer})
    x = torch.randn(16, 64, dtype=torch.float64)

    def uncached():
        layer.weight_codes = None
        return layer(x)

    def made_again(change) -> bool:
        layer(x)
        before = layer.weight_codes
        change()
        y = layer(x)
        return layer.weight_codes is not before and torch.equal(y, uncached())

    with torch.no_grad():
        layer(x)  # an evaluation's forward
    codes = layer.weight_codes
    layer(x)
    assert layer.weight_codes is codes  # the same weight and scales: reused

    def in_place():
        with torch.no_grad():
            plain.weight.mul_(0.5)

    def swap():
        plain.weight.data = plain.weight.data * 2

    def load(tensor, value):
        def change():
            with torch.no_grad():
                tensor.copy_(value)
        return change

    assert made_again(in_place) and made_again(swap)
    assert made_again(load(plain.weight, plain.weight.detach() * 0.25))
    regathered = lambda: setattr(layer, "gathered_weight_amax", fp8_scaling.amax_of(plain.weight))  # noqa: E731
    assert made_again(regathered)
    assert made_again(regathered)  # an equal amax, not the same tensor
    layer.gathered_weight_amax = None
    assert made_again(lambda: layer.roll(torch.ones(3), True))
    assert made_again(load(layer.scale, layer.scale * 0.5))
    assert made_again(load(layer.amax_history, torch.zeros_like(layer.amax_history)))  # not ready: current again
    handle.after_grad_sync()
    assert layer.weight_codes is None


@pytest.mark.parametrize("mode", fp8.MODES)
def test_activation_checkpointing_recomputes_the_same_quantisation(mode):
    from reference import build_model

    grads = []
    for checkpointing in (False, True):
        model = build_model(make_config(activation_checkpointing=checkpointing), seed=0, dtype=torch.float64)
        handle = fp8.convert(model, fp8.Recipe(mode))
        for x, y in global_batches(2, 2, SEQ):
            model.zero_grad()
            _, loss_sum, count = model(x, y)
            (loss_sum / count).backward()
            handle.after_grad_sync()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------------------------------------------
# TP (2) and DP (2) against the single-device FP8 model
# ---------------------------------------------------------------------------------------------------------

# (mode, n_embd, sequence parallel, activation checkpointing); blockwise under TP needs n_embd/T % 128 == 0.
TP_VARIANTS = [("current", 32, False, False), ("delayed", 32, False, False), ("blockwise", 256, False, False),
               ("current", 32, True, True), ("delayed", 32, True, False)]
DP_VARIANTS = [("current", 32, False, False), ("delayed", 32, False, False), ("blockwise", 256, False, False)]
MESH_CASES = [("tp", v) for v in TP_VARIANTS] + [("dp", v) for v in DP_VARIANTS]
MESH_IDS = [f"{kind}-{mode}-h{n}" + ("-sp" if sp else "") + ("-ckpt" if ac else "")
            for kind, (mode, n, sp, ac) in MESH_CASES]


def _train(model, handle, dp_group, dp_rank, dp_size, tracer=None, finish_grad_sync=None):
    """STEPS optimizer steps of this rank's micro-batches; returns (losses, per-step traced fp8 messages).
    finish_grad_sync: the TP handle's (under SP, the replicated parameters' gradients are summed over TP).
    The batches go to the model's device."""
    from optim import adamw_param_groups

    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(adamw_param_groups(model.parameters(), HYPER["weight_decay"]), lr=HYPER["lr"],
                                  betas=HYPER["betas"], eps=HYPER["eps"])
    losses, traced = [], []
    for x, y in global_batches(STEPS, GLOBAL_BATCH, SEQ):
        batches = rank_micro_batches(x.to(device), y.to(device), dp_rank, dp_size, MICRO)
        tokens = sum((yb != -1).sum() for _, yb in batches).double()
        loss = torch.zeros((), dtype=torch.float64, device=device)
        if dp_size > 1:
            dist.all_reduce(tokens, group=dp_group)
        if tracer is not None:
            tracer.__enter__()
        for xb, yb in batches:
            _, loss_sum, _ = model(xb, yb)
            (loss_sum / tokens).backward()
            loss += loss_sum.detach()
        if dp_size > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad, group=dp_group)
            dist.all_reduce(loss, group=dp_group)
        if finish_grad_sync is not None:
            finish_grad_sync()
        assert handle.after_grad_sync() == 0
        if tracer is not None:
            tracer.__exit__(None, None, None)
            traced.append({(op, group): (r.calls, r.payload_bytes) for (op, group), r in tracer.records.items()
                           if group in ("tp", "dp_cp", "cp")})  # FP8's groups; the model's are unnamed
            tracer.reset()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss / tokens))
    return losses, traced


def _single_device(mode, n_embd):
    from reference import build_model

    model = build_model(make_config(n_embd=n_embd), seed=0, dtype=torch.float64)
    handle = fp8.convert(model, fp8.Recipe(mode))
    losses, _ = _train(model, handle, None, 0, 1)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, fp8_state(handle)


def _nonfinite_amax_skips_every_rank(rank, mesh, device):
    """One step.train_step on D = 2 through a DDP layout, FP8 current (no reduction of its own over dp): rank
    1's first linear sees a NaN amax, its after_grad_sync counts it, the update's world check skips the step on
    both ranks. Returns (skipped, parameters unchanged)."""
    from ddp import DDPLayout, DistributedDataParallel
    from reference import build_model
    from optim import DynamicLossScaler, build_adamw
    from step import train_step

    model = build_model(make_config(), seed=0, dtype=torch.float64, device=device)
    handle = fp8.convert(model, fp8.Recipe("current"), mesh, micro_batches=GLOBAL_BATCH // (2 * MICRO))
    def nan_amax(module, args, out):
        module.step_amax.fill_(float("nan"))  # returns None: the output stays

    if rank == 1:
        next(iter(handle.linears.values())).register_forward_hook(nan_amax)
    ddp = DistributedDataParallel(model, groups={name: mesh.group(name) for name in ("dp_cp", "expert_dp")})
    layout = DDPLayout(ddp, build_adamw(model.parameters(), HYPER["lr"], HYPER["weight_decay"], HYPER["betas"]),
                       mesh.coordinates())
    before = [p.detach().clone() for p in model.parameters()]
    x, y = global_batches(1, GLOBAL_BATCH, SEQ)[0]
    batches = [(*b, None) for b in rank_micro_batches(x, y, mesh.index("dp"), mesh.size("dp"), MICRO)]
    outcome = train_step(layout, DynamicLossScaler(enabled=False), batches, mesh.group("dp_cp"), 0.0, nullcontext(),
                         device, model=model, axes=[handle], data_size=mesh.size("dp"))
    return outcome.skipped, all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def _on_meshes(rank, world):
    import tensor_parallel
    from accounting.tracer import CommTracer
    from mesh import MeshShape, build_mesh
    from reference import build_model

    device = harness.device()
    out = {}
    for kind, variants in (("tp", TP_VARIANTS), ("dp", DP_VARIANTS)):
        shape = MeshShape(dp=1, tp=2) if kind == "tp" else MeshShape(dp=2)
        mesh = build_mesh(shape, rank)  # the model's groups
        fp8_mesh = build_mesh(shape, rank)  # the same ranks in new groups: the tracer tells FP8's messages apart
        micro_batches = GLOBAL_BATCH // (mesh.size("dp") * MICRO)
        for mode, n_embd, sp, checkpointing in variants:
            config = make_config(n_embd=n_embd, activation_checkpointing=checkpointing)
            model = build_model(config, seed=0, dtype=torch.float64, device=device)
            finish = None
            if kind == "tp":
                tp_handle = tensor_parallel.parallelize(model, mesh.group("tp"), sequence_parallel=sp)
                finish = functools.partial(tp_handle.after_grad_sync, WholeGrads())
            handle = fp8.convert(model, fp8.Recipe(mode), fp8_mesh, micro_batches=micro_batches)
            tracer = CommTracer()
            for name in ("tp", "dp_cp", "cp"):
                tracer.name_group(fp8_mesh.group(name), name)
            losses, traced = _train(model, handle, mesh.group("dp"), mesh.index("dp"), mesh.size("dp"), tracer, finish)
            predicted = [dict(handle.predicted_messages(first_step=step == 0)) for step in range(STEPS)]
            pieces = {p.shard_info.global_name: (p.detach().clone(), p.shard_info) for p in model.parameters()}
            out[kind, (mode, n_embd, sp, checkpointing)] = dict(losses=losses, pieces=pieces, state=fp8_state(handle),
                                                                 traced=traced, predicted=predicted)
        if kind == "dp":
            out["skip"] = _nonfinite_amax_skips_every_rank(rank, mesh, device)
    return out


@pytest.fixture(scope="module")
def mesh_runs():
    """Both ranks' results of every mesh case (one spawn), and the single-device runs they compare with."""
    references = {(mode, n): _single_device(mode, n) for mode, n, _, _ in TP_VARIANTS}
    return run_ranks(_on_meshes, 2, timeout=120), references


@pytest.mark.parametrize("kind,variant", MESH_CASES, ids=MESH_IDS)
def test_mesh_losses_equal_the_single_device(mesh_runs, kind, variant):
    ranks, references = mesh_runs
    ref_losses = references[variant[:2]][0]
    for r in ranks:
        losses = torch.tensor(r[kind, variant]["losses"])
        torch.testing.assert_close(losses, torch.tensor(ref_losses), rtol=TOL, atol=TOL)


@pytest.mark.parametrize("kind,variant", MESH_CASES, ids=MESH_IDS)
def test_mesh_parameters_equal_the_single_device(mesh_runs, kind, variant):
    ranks, references = mesh_runs
    full = {}
    for r in ranks:
        for name, (local, info) in r[kind, variant]["pieces"].items():
            full.setdefault(name, torch.full(info.global_shape, float("nan"), dtype=local.dtype))
            info.place_into(full[name], local)
    for name, ref in references[variant[:2]][1].items():
        torch.testing.assert_close(full[name], ref, rtol=TOL, atol=TOL, msg=name)


@pytest.mark.parametrize("kind,variant", MESH_CASES, ids=MESH_IDS)
def test_mesh_fp8_state_is_the_same_on_every_rank_and_the_single_devices(mesh_runs, kind, variant):
    ranks, references = mesh_runs
    ref_state = references[variant[:2]][2]
    states = [r[kind, variant]["state"] for r in ranks]
    for state in states:
        assert state.keys() == ref_state.keys()
        for key, value in state.items():
            assert torch.equal(value, states[0][key]), key
            torch.testing.assert_close(value, ref_state[key], rtol=1e-6, atol=0, msg=key)


@pytest.mark.parametrize("kind,variant", MESH_CASES, ids=MESH_IDS)
def test_mesh_traced_amax_reductions_equal_predicted_messages(mesh_runs, kind, variant):
    """Every amax all-reduce of every step, counted and sized, as Fp8Handle.predicted_messages says."""
    for r in mesh_runs[0]:
        assert r[kind, variant]["traced"] == r[kind, variant]["predicted"]


def test_tp_runs_send_amax_reductions(mesh_runs):
    """Current: every micro-batch's forward and backward; delayed: one per step after the first."""
    rank0 = mesh_runs[0][0]
    assert rank0["tp", ("current", 32, False, False)]["traced"][1][("all_reduce", "tp")][0] == 8 * 2 * 4
    assert rank0["tp", ("delayed", 32, False, False)]["traced"][1] == {("all_reduce", "tp"): (1, 12 * 8)}


def test_a_nonfinite_amax_on_one_rank_skips_the_step_on_every_rank(mesh_runs):
    assert [r["skip"] for r in mesh_runs[0]] == [(True, True), (True, True)]


# ---------------------------------------------------------------------------------------------------------
# The trainer's entry points: flags, apply, the protocol, the printouts (report/axes.py's fp8 section)
# ---------------------------------------------------------------------------------------------------------


def test_flags_defaults_and_recipe():
    from cli import flags

    parser = flags.build_parser()
    defaults = parser.parse_args([])
    assert (defaults.fp8, defaults.fp8_amax_history, defaults.fp8_amax_algo, defaults.fp8_margin) == \
        (None, 16, "max", 0)
    assert flags.validate(parser.parse_args(["--preset", "tiny"]), 1, axes=(fp8,)).axes["fp8"] is None  # off
    recipe = flags.validate(parser.parse_args(["--preset", "tiny", "--fp8", "delayed", "--fp8-amax-history", "4"]),
                            1, axes=(fp8,)).axes["fp8"]
    assert recipe == fp8.Recipe("delayed", 4, "max", 0)


@pytest.fixture(scope="module")
def applied():
    """fp8.apply on a one-process run (delayed, L = 4), as train.compose calls it: (model, run, handle)."""
    from mesh import MeshShape, build_mesh
    from reference import build_model

    config = make_config()
    run = SimpleNamespace(mesh=build_mesh(MeshShape(dp=1), rank=0), config=config, seq_len=SEQ, micro_batch_size=2,
                          micro_batches=2, device=torch.device("cpu"), compute_dtype=torch.bfloat16, seed=0,
                          layout=None)
    model = build_model(config, seed=0)
    return model, run, fp8.apply(model, run, fp8.Recipe("delayed", 4, "max", 0))


def test_apply_converts_the_block_linears_only(applied):
    model, run, handle = applied
    assert len(handle.linears) == 4 * run.config.n_layer and model.lm_head.__class__ is nn.Linear  # the head stays
    assert all(type(m) is fp8.Fp8Linear for m in model.transformer.h.modules() if isinstance(m, nn.Linear))


def test_handle_keeps_to_the_axis_protocol():
    """The handle overrides only step.Axis's protocol: the old hooks and printers are
    gone (ZeRO-3's codec rides on each FP8 weight, `gather_codec`), and train.py sets nothing on it."""
    own = {name for name, value in vars(fp8.Fp8Handle).items() if callable(value) and not name.startswith("__")}
    assert own <= {"after_grad_sync", "state_pieces", "after_load", "observe", "facts", "predicted_messages",
                   "traced_prediction"}, own  # after_load: the redundant experts' slots re-read their histories


def test_saved_input_bytes_formula(applied):
    _, run, handle = applied
    saved = fp8.saved_input_bytes(handle.facts().in_features.values(), 2 * SEQ, 2)["saved"]
    assert saved == 2 * SEQ * run.config.n_embd * (2 + 5) * run.config.n_layer  # M·h·(2 + 5/T)·(e_c - 1) per layer


def test_one_process_predicts_no_messages(applied):
    assert applied[2].predicted_messages(None) == {}  # nothing to agree on
    assert applied[2].traced_prediction(None, 3) == {}


def test_flops_fraction_and_format_weighted_peak(applied):
    flops = format_flops.flops_by_format(applied[1].config, SEQ, "fp8", "fp8", "bf16")
    assert 0.3 < flops["fp8"] / sum(flops.values()) < 1
    assert 1000.0 < format_flops.format_weighted_peak(flops, {"fp8": 2000.0, "bf16": 1000.0}) < 2000.0


def test_the_fp8_share_of_flops_counts_the_linears_converted():
    """With a mixture of experts (routers stay in the compute dtype; the routed experts run in FP8, a token
    visits k of them) the printed share of the model FLOPs in FP8 is 6·(the weights converted, k experts of the
    N per MoE layer) / FLOPs per token. The rank is built as --plan builds it (meta)."""
    from cli import flags
    import plan
    import train

    argv = ["--preset", "tiny", "--fp8", "current", "--moe-experts", "4", "--moe-every", "2", "--global-batch", "1",
            "--micro-batch", "1"]
    settings = plan.plan_settings(flags.validate(flags.build_parser().parse_args(argv), 1, axes=train.AXES))
    with plan.fake_world(0, 1):
        run = plan.build_role(settings, 0)
        handle = next(axis for axis in run.axes if axis.name == "fp8")
        text = "\n".join(report.axes.axis_lines(handle, "startup", run))
    converted = sum(m.weight.numel() for name, m in run.model.named_modules() if isinstance(m, fp8.Fp8Linear)
                    and ".experts." not in name)
    experts = [m for m in run.model.modules() if isinstance(m, moe.Expert)]
    assert experts and all(isinstance(m.c_fc, fp8.Fp8Linear) for m in experts)
    layers = len(experts) // run.config.moe.experts
    weights = sum(p.numel() for p in experts[0].parameters() if p.dim() == 2)
    converted += layers * run.config.moe.topk * weights
    assert f"MFU: {6 * converted / run.flops.model:.0%} of model FLOPs run in FP8" in text


def test_startup_lines_name_the_recipe_memory_and_mfu(applied):
    _, run, handle = applied
    lines = "\n".join(report.axes.axis_lines(handle, "startup", run))
    assert "fp8 delayed, history L=4, max, margin 0: 8 block linears in FP8" in lines
    assert "memory: saved inputs in FP8" in lines and "MFU:" in lines and "messages per step" not in lines


def test_step_and_end_lines(applied):
    """The scale table with each logged step; at the end one line of counts (the amax reductions are in
    report.run.print_end's message table, the scales in the last step's table: not repeated)."""
    _, run, handle = applied
    report.axes.observe(handle)  # as train.compose does: the saturation counts the table reads
    handle.after_grad_sync()
    table = report.axes.axis_lines(handle, "step", None)
    assert table[0].startswith("fp8 delayed: the scales in use") and len(table) == 2 + len(handle.linears)
    assert report.axes.axis_lines(handle, "end", run, 1) == [
        "fp8 delayed: steps 1 (1 scaled like current (empty history), 0 with a non-finite amax, skipped on every rank)"]


def test_the_accounting_counts_what_the_clamp_cut():
    """Delayed scaling saturates when a tensor outgrows its history. The counter the accounting subscribes
    (report.axes.observe: observers.SaturationCount) is told every training cast, not an evaluation's, and the scale
    table prints, per role, 100·cut/cast since the last table, then restarts."""
    torch.manual_seed(0)
    recipe = fp8.Recipe("delayed")
    layer = fp8.Fp8Linear(nn.Linear(64, 32, dtype=torch.float64), recipe, "layer")
    handle = fp8.Fp8Handle(recipe, {"layer": layer})
    counter = report.axes.observe(handle)
    x = torch.randn(16, 64, dtype=torch.float64)
    layer(x.requires_grad_()).sum().backward()
    handle.after_grad_sync()  # the history now holds this step's amaxes: the next step scales from them
    assert counter.take("layer") == [0.0, 0.0, 0.0]
    big = (2 * x).detach().requires_grad_()  # twice the history's amax: the clamp cuts the largest values
    with torch.no_grad():
        layer(big)  # an evaluation's forward: not counted
    layer(big).sum().backward()
    cut = int((big.detach() * layer.scale[0].double()).abs().gt(fp8_scaling.E4M3.max * (1 + 2**-20)).sum())
    assert cut > 0
    row = report.axes.axis_lines(handle, "step", None)[2]
    assert row.split()[2::2] == [f"{100 * cut / big.numel():.2f}%", "0.00%", "0.00%"], row
    assert counter.take("layer") == [0.0, 0.0, 0.0]  # the table restarted the count
