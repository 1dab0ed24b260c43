"""accounting/moe_memory.py: a MoE layer's forward peak predicted tensor by tensor equals memory.LiveTensors'
measurement, to the byte, on a CPU, for the routing the layer made (the rows it sent and received).

- One process (E = 1): dropless and with capacity, top-1 and top-2, fp32, bf16 autocast over fp32 weights, bf16
  weights, with dropout; a case where capacity's one-hot product is the peak (P0). Attention's part likewise
  (the fused kernel without dropout, the math path with it). Under --fp8 (current, delayed, blockwise; fp32,
  bf16, fp64) the saved bytes and those alive at P1 and P2 for the chunks' padded row counts; the plan's mean padding;
  likewise under a precision recipe (nvfp4, mxfp8; its linears make no autocast weight copies).
- Two gloo ranks, E = 2 under --fp8 (current, delayed, blockwise; fp32, bf16): the saved bytes and those alive at
  P1, P2 and P6 for the (local slot, source) chunks' padded row counts; real start-ups' saved bytes likewise.
- Four gloo ranks: E = 2 dropless and with capacity (the routing of random tokens); E = 2 routed exactly
  uniformly over the experts (R_e the uniform prediction's, the pairs S = R given); E = 4 with every token
  picking rank 0's experts, which equals the worst-case prediction and peaks at P2 (the receiver's sum of its
  experts' weighted outputs).
- A real start-up (train.compose, E = 2 on 4 ranks) measures each held MoE block's peak equal to its prediction,
  and its predicted step peak (time_model.Role) equals the plan's of the same layout, byte for byte; under TP
  (T = 2, capacity) the MoE's and attention's measurements equal their predictions too.
"""

import re
from contextlib import nullcontext
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks
from reference import make_config

H, B, S_LEN = 16, 2, 8  # hidden, sequences, their length: T = 16 tokens per rank


class _Rows:
    """A RoutingObserver recording the rows one forward sent and received (S, R)."""

    def routed(self, layer, load, keep, sent, received):
        self.rows = (sent, received, layer.exchanged.expert_rows if layer.ep_size > 1 else 0)


def _layer(n=4, k=2, factor=0.0, dropout=0.0, dtype=torch.float32, h=H, **deepseek):
    """One MoE layer; `deepseek`: GPTConfig's router (experts/router.py) and shared-expert (experts/shared.py)
    fields."""
    from reference import build_model

    torch.manual_seed(0)
    config = make_config(n_layer=1, n_head=2, n_embd=h, moe_experts=n, moe_topk=k, moe_capacity_factor=factor,
                         dropout=dropout, **deepseek)
    layer = build_model(config, seed=0, dtype=dtype).transformer.h[0].mlp
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    layer.observer = _Rows()
    layer.load.on("cpu")  # the step's load counts (and the bias): state moe.apply makes before any forward
    if layer.load.bias is not None:  # a learned bias, so that it changes the selection
        layer.load.bias.copy_(torch.randn(n, generator=torch.Generator().manual_seed(1)) * 0.3)
    return config, layer


def _measure(layer, x, autocast=False):
    """memory.LiveTensors' ModulePeak of one training forward of `layer` on x, and memory.BackwardRise's rise of
    its backward above the saved tensors it frees (the parameters' gradients aside), as the start-up measures."""
    from accounting import memory

    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else nullcontext()
    with memory.LiveTensors({"layer": layer}) as live, context:
        y = layer(x)
    grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(2)).to(y.dtype)  # made before the watch
    rise = memory.BackwardRise(live.kept["layer"])
    with rise:
        y.backward(grad)
    forward = live.peaks["layer"]
    return SimpleNamespace(peak=forward.peak, saved=forward.saved, at=forward.at, backward_rise=rise.rise(
        p.grad.untyped_storage()._cdata for p in layer.parameters() if p.grad is not None))


def _predict(config, rows, tokens, dtype, autocast, ep=1, slots=0):
    """moe_memory.block_peak for the rows the forward routed, the dtypes written out as the test ran them."""
    from experts import router
    from accounting import moe_memory

    n, k, h, e_x = config.moe.experts, config.moe.topk, config.n_embd, dtype.itemsize
    cap = router.capacity(tokens, k, n, config.moe.capacity_factor)
    shape = moe_memory.DispatchShape(tokens, rows[0], rows[1], n, k, h, ep, tokens if cap else 0,
                                     e_c=2 if autocast else e_x, e_r=max(4, e_x), e_x=e_x, weight_bytes=e_x,
                                     expert_params=8 * h * h + 5 * h * int(config.bias),
                                     dropout_mask=e_x if config.dropout else None, score=config.moe.score,
                                     shared=config.moe.shared_experts, slots=slots, expert_rows=rows[2])
    return moe_memory.block_peak(shape)


ONE_DEVICE = [  # (layer kwargs, autocast, the op at the peak)
    (dict(), False, "aten.index_add"), (dict(k=1), False, "aten.index_add"),
    (dict(factor=1.0), False, "aten.index_add"), (dict(factor=0.5, k=1), False, "aten.index_add"),
    (dict(dropout=0.1), False, "aten.mul"), (dict(), True, "aten.index_add"),
    (dict(dtype=torch.bfloat16), True, "aten.index_add"), (dict(factor=0.5, dropout=0.1), True, "aten.mul"),
    (dict(n=64, h=8, factor=1.0), False, "aten.mul"),  # capacity's T·k·N one-hot product is the peak (P0)
    (dict(dtype=torch.bfloat16, dropout=0.1), True, "aten.index_add"),  # y cast to bf16 before the dropout
    # DeepSeek-V3's router: sigmoid scores, the selection bias, the group limit, the weights' scale
    (dict(n=8, moe_score="sigmoid", moe_bias_rate=1e-3, moe_groups=4, moe_group_limit=2), False, "aten.index_add"),
    (dict(n=8, k=1, factor=1.0, moe_score="sigmoid", moe_bias_rate=1e-3, moe_groups=2, moe_group_limit=1,
          moe_route_scale=2.5), True, "aten.index_add"),
    # shared experts (their hidden [T, 4Qh] is the largest: the shared sum sets the peak, P5)
    (dict(moe_shared_experts=2), False, "aten.add"), (dict(moe_shared_experts=1, dropout=0.1), True, "aten.mul"),
    (dict(dtype=torch.bfloat16, moe_shared_experts=1, dropout=0.1, moe_score="sigmoid"), True, "aten.add"),
    (dict(n=8, k=8, moe_shared_experts=1, dropout=0.1), False, "aten.add"),  # the backward peaks at the combine (B1)
]
MOMENT_OPS = {"P0": "aten.mul", "P1": "aten.cat", "P2": "aten.index_add", "P3": "aten.mul", "P4": "aten._to_copy",
              "P5": "aten.add"}


@pytest.mark.parametrize("kwargs, autocast, op", ONE_DEVICE, ids=[f"{c[0]}-autocast={c[1]}".replace("moe_", "")
                                                                   for c in ONE_DEVICE])
def test_one_device_peak_and_saved_bytes_equal_the_prediction(kwargs, autocast, op):
    config, layer = _layer(**kwargs)
    dtype = kwargs.get("dtype", torch.float32)
    x = torch.randn(B, S_LEN, config.n_embd, dtype=dtype, requires_grad=True)
    measured = _measure(layer, x, autocast)
    predicted = _predict(config, layer.observer.rows, B * S_LEN, dtype, autocast)
    assert (measured.peak, measured.saved) == (predicted.peak, predicted.saved), (measured, predicted.buffers)
    assert measured.at.startswith(op) and MOMENT_OPS[predicted.moment] == op, (measured.at, predicted.moment)
    assert measured.backward_rise == predicted.backward[1], (measured.backward_rise, predicted.backward)
    if kwargs.get("n", 4) == 64:  # N ≫ h: the router's [T, N] gradients rise above the combine's (B2)
        assert predicted.backward[0] == "B2"


@pytest.mark.parametrize("dropout, autocast, batch", [(0.0, False, 2), (0.0, True, 2), (0.1, False, 1),
                                                     (0.1, False, 2)])
def test_attention_holds_its_output_and_bias_copies_above_what_it_saves(dropout, autocast, batch):
    """The fused kernel (CPU, no dropout) and the math path (dropout, fp32): every saved tensor comes first."""
    from accounting import memory
    import model
    from accounting import moe_memory

    config = make_config(n_layer=1, n_head=2, n_embd=H, dropout=dropout)
    attention = model.CausalSelfAttention(config)
    x = torch.randn(batch, S_LEN, H, requires_grad=True)
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else nullcontext()
    with memory.LiveTensors({"attn": attention}) as live, context:
        attention(x)
    shape = memory.ActivationShape(s=S_LEN, b=batch, h=H, a=2, vocab=config.vocab_size, e_r=4, e_c=2 if autocast else 4,
                                   dropout=dropout > 0, kernel=memory.attention_kernel("cpu", torch.float32, dropout))
    assert live.peaks["attn"].above_saved == moe_memory.attention_above_saved(shape, config.bias)


def test_uniform_and_worst_case_rows():
    """E = 4, N = 8, k = 2, T = 16: uniformly R_e = T·k slots (capped at the capacity's share) and S = R = T·ρ
    pairs, ρ = 4·(1 − C(6,2)/C(8,2)) = 4·13/28 ranks a token reaches, at most the slots; worst case (every token
    on rank 0's 2 experts): S = T, R = E·T, R_e = E·T·k, or E·(N/E)·C_μ with capacity."""
    from experts import dispatch
    from accounting import memory
    from accounting import moe_memory

    x = memory.ActivationShape(s=S_LEN, b=B, h=H, a=2, vocab=256)
    pairs = 16 * 4 * 13 / 28
    for factor, uniform, worst in ((0.0, (pairs, pairs, 32), (16, 64, 128)), (2.0, (pairs, pairs, 32), (16, 64, 64)),
                                   (0.5, (16, 16, 16), (16, 64, 16))):
        traffic = dispatch.Traffic(make_config(n_embd=H, moe_experts=8, moe_capacity_factor=factor),
                                   tokens=B * S_LEN, ep=4)
        rows = {r: moe_memory.shape_of(traffic, x, r) for r in ("uniform", "worst")}
        got = {r: (rows[r].sent, rows[r].received, rows[r].expert_rows) for r in rows}
        assert got["uniform"] == pytest.approx(uniform) and got["worst"] == worst, (factor, got)


def test_the_step_peak_takes_the_backward_when_it_rises_higher():
    """Uniform routing in fp32: the combine's backward (B1) rises above the forward's peak, so the block's figure
    (time_model.Role's and plan_search's temporary) is the backward's."""
    from experts import dispatch
    from accounting import memory
    from accounting import moe_memory

    x = memory.ActivationShape(s=S_LEN, b=B, h=H, a=2, vocab=256, e_c=4)
    peak = moe_memory.rank_peak(dispatch.Traffic(make_config(n_embd=H, moe_experts=4), tokens=B * S_LEN), x)
    u = peak.uniform
    assert u.backward[1] > u.forward_above_saved and peak.above_saved == u.backward[1] and u.phase == "backward"
    assert "at B1 in backward" in peak.temporary()


def _alive_after_each_op(modules):
    """memory.LiveTensors that also lists the bytes alive after each op of the watched forward, [(op, bytes)]."""
    from accounting import memory

    class Alive(memory.LiveTensors):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if self.window is not None:
                self.after.append((str(func), sum(n for ref, n in self.window.values() if not ref.expired())))
            return out

    live = Alive(modules)
    live.after = []
    return live


def _assert_saved_and_moments_equal_the_table(layer, x, autocast, measured, predicted):
    """The step's saved bytes are the table's (moe_memory.block_peak), and in a second forward the bytes alive
    after the experts' outputs are concatenated (P1) and after the combine's index_add (P2) are the table's terms
    alive at those moments, to the byte."""
    from accounting import moe_memory

    assert measured.saved == predicted.saved, (measured, predicted.buffers)
    live = _alive_after_each_op({"layer": layer})
    with live, torch.autocast("cpu", dtype=torch.bfloat16) if autocast else nullcontext():
        layer(x)
    table = moe_memory.terms(predicted.shape)
    for op, moment in (("aten.cat", "1"), ("aten.index_add", "2")):
        alive = [nbytes for name, nbytes in live.after if name.startswith(op)][-1]
        assert alive == sum(nbytes for _, nbytes, _, when in table if moment in when), (op, alive)


FP8_ONE_DEVICE = [  # (recipe, layer kwargs, autocast)
    ("current", dict(), False), ("current", dict(k=1), False), ("current", dict(), True),
    ("current", dict(dtype=torch.bfloat16), True), ("delayed", dict(n=8), False), ("current", dict(dtype=torch.float64),
                                                                                   False),
    ("current", dict(factor=1.0), False),  # capacity drops: the experts run (and pad) the kept rows
    # blockwise: each padded row's 1×128 tiles' scales; h = 48: c_proj's 4h = 192 columns are two tiles a row
    ("blockwise", dict(), False), ("blockwise", dict(), True), ("blockwise", dict(dtype=torch.bfloat16, h=48), True)]

EMULATION_PEAK = {"current": "aten.mm", "delayed": "aten.mm",  # the CPU's peak op: the emulated GEMM's product,
                  "blockwise": ("aten._to_copy", "aten.mul")}  # blockwise's: its whole 128-column tiles (de)scaled


@pytest.mark.parametrize("recipe, kwargs, autocast", FP8_ONE_DEVICE,
                         ids=[f"{c[0]}-{c[1]}-autocast={c[2]}" for c in FP8_ONE_DEVICE])
def test_fp8_experts_saved_bytes_and_moments_equal_the_prediction_for_the_rows_they_padded(recipe, kwargs, autocast):
    """--fp8 (accounting/fp8_experts.py), E = 1: with the chunks' row counts of the forward (P padded rows, c chunks),
    the saved bytes and the bytes alive at P1 (the experts' outputs concatenated) and P2 (the combine's index_add)
    equal moe_memory's FP8 table to the byte (P2 alive: the second forward of the step, the weight codes made by
    the first). The peak itself lies inside an emulated FP8 GEMM on a CPU (its fp32 operands and product: not
    written), e.g. 52,648 measured against P2's 31,932 for the first case. Before the table, saved read 24,524
    predicted against 27,628 measured (the padding and the FP8 codes); with a capacity, the chunks before the
    drops read 27,332 measured against 26,660 predicted."""
    import fp8
    from accounting import measure
    from accounting import moe_memory
    from reference import build_model

    config, layer = _layer(**kwargs)
    dtype = kwargs.get("dtype", torch.float32)
    model = build_model(config, seed=0, dtype=dtype)
    model.transformer.h[0].mlp = layer
    fp8.convert(model, fp8.Recipe(recipe, 4, "max", 0))
    layer.observer = rows = measure._Rows()  # what the run's start-up reads: (P, c) of the chunks the experts ran
    x = torch.randn(B, S_LEN, config.n_embd, dtype=dtype, requires_grad=True)
    measured = _measure(layer, x, autocast)
    shape = _predict(config, rows.rows, B * S_LEN, dtype, autocast).shape
    padded = (*rows.fp8, 8 if dtype == torch.float64 else 4)
    chunks = layer.local_rows  # kept rows: under a capacity, fewer than the routed load
    assert rows.fp8 == (sum(-m % 16 for m in chunks), sum(m > 0 for m in chunks)) and sum(chunks) == rows.rows[0]
    predicted = moe_memory.block_peak(moe_memory.DispatchShape(**{**shape.__dict__, "fp8": padded,
                                                                  "fp8_blockwise": recipe == "blockwise"}))
    _assert_saved_and_moments_equal_the_table(layer, x, autocast, measured, predicted)
    assert measured.peak > predicted.peak and measured.at.startswith(EMULATION_PEAK[recipe])  # not written


RECIPE_ONE_DEVICE = [  # (recipe, layer kwargs, autocast)
    ("fwd=nvfp4,bwd=nvfp4", dict(), False), ("fwd=nvfp4,bwd=nvfp4", dict(), True),
    ("fwd=mxfp8,bwd=mxfp8", dict(h=32), True), ("fwd=nvfp4,bwd=nvfp4", dict(moe_shared_experts=1), True)]


@pytest.mark.parametrize("recipe, kwargs, autocast", RECIPE_ONE_DEVICE,
                         ids=[f"{c[0]}-{c[1]}-autocast={c[2]}" for c in RECIPE_ONE_DEVICE])
def test_recipe_experts_saved_bytes_and_moments_equal_the_table_without_weight_copies(recipe, kwargs, autocast):
    """--precision-recipe (accounting/recipe_experts.py), E = 1: its linears save the weight parameter itself, so with
    moe_memory's `recipe` (no autocast weight copies) the saved bytes and the bytes alive at P1 and P2 are the
    table's to the byte (with the copies, the second case read 30,668 saved predicted against 14,284 measured).
    Its CPU forward peaks inside the emulation's fake quantisation (not written)."""
    from accounting import moe_memory
    import precision.recipe
    from reference import build_model

    config, layer = _layer(**kwargs)
    model = build_model(config, seed=0)
    model.transformer.h[0].mlp = layer
    precision.recipe.convert(model, precision.recipe.parse_recipe(recipe), seq_len=S_LEN)
    x = torch.randn(B, S_LEN, config.n_embd, requires_grad=True)
    measured = _measure(layer, x, autocast)
    shape = _predict(config, layer.observer.rows, B * S_LEN, torch.float32, autocast).shape
    predicted = moe_memory.block_peak(moe_memory.DispatchShape(**{**shape.__dict__, "recipe": True}))
    _assert_saved_and_moments_equal_the_table(layer, x, autocast, measured, predicted)


def test_the_plan_pads_each_expert_by_the_mean():
    """The plan's FP8 table (uniform routing) takes every chunk run and padded by the mean of (−m) mod 16, P = 15/2
    rows a chunk (fp8_experts.expected_padded_rows), fp32 inverse scales: N chunks a micro-batch whatever E (E = 1
    one per expert; E = 2, N/E experts × E sources), R_p with replicas (R_p/E slots × E sources); under blockwise
    the same rows, each with its 1×128 tiles' scales."""
    from experts import dispatch
    from accounting import memory
    from accounting import moe_memory

    x = memory.ActivationShape(s=S_LEN, b=B, h=H, a=2, vocab=256, e_c=2, fp8=True)
    config = make_config(n_embd=H, moe_experts=8)
    for ep, slots, chunks in ((1, 0, 8), (2, 0, 8), (2, 12, 12)):
        for recipe in ("current", "blockwise"):  # blockwise: the same rows, each with its tiles' scales
            traffic = dispatch.Traffic(config, tokens=B * S_LEN, ep=ep, slots=slots, fp8_experts=recipe)
            shape = moe_memory.shape_of(traffic, x)
            assert (shape.fp8, shape.fp8_blockwise) == ((chunks * 15 / 2, chunks, 4), recipe == "blockwise"), ep


# ---------------------------------------------------------------------------------------------------------
# Two ranks: FP8 experts under expert parallel (E = 2)
# ---------------------------------------------------------------------------------------------------------

FP8_EP_CASES = [  # (recipe, layer kwargs, autocast): N = 8, 4 experts a rank, each run once per source rank
    ("current", dict(), False), ("current", dict(), True), ("current", dict(dtype=torch.bfloat16), True),
    ("delayed", dict(), False), ("delayed", dict(dtype=torch.bfloat16), True), ("current", dict(factor=1.0), False),
    ("blockwise", dict(), False), ("blockwise", dict(dtype=torch.bfloat16), True), ("blockwise", dict(h=48), True)]
FP8_STARTUPS = {recipe: (["--moe-experts", "4", "--ep", "2", "--fp8", recipe], 4, 1)  # real start-ups', same 2 ranks
                for recipe in ("current", "blockwise")}


def _fp8_ep_ranks(rank, world):
    """Each FP8_EP_CASES layer sharded over E = 2 (moe.shard_experts) and converted (fp8.convert): one training
    forward and backward measured (_measure), a second forward's bytes alive after each op, the chunks its
    experts' c_fc ran and padded counted by an fp8.QuantizationObserver, the start-up's record of them
    (measure._Rows), and the table's prediction for those rows and chunks."""
    import fp8
    from accounting import measure
    import moe
    from accounting import moe_memory
    from planner import time_model
    import train
    from mesh import MeshShape, build_mesh
    from reference import build_model
    from test_plan import _settings

    class Chunks(fp8.QuantizationObserver):
        """The GEMMs the experts' c_fc ran in training forwards (its input's cast, role 0) and the rows it padded."""

        def __init__(self):
            self.chunks = self.padded_rows = 0

        def quantized(self, linear, role, values, saturated):
            self.chunks += role == 0 and self.counts(linear)

        def padded(self, linear, rows):
            self.padded_rows += rows if self.counts(linear) else 0

        @staticmethod
        def counts(linear):  # role 0 and padding are forward-only; nothing here recomputes
            return ".experts." in linear.name and linear.name.endswith("c_fc")

    mesh = build_mesh(MeshShape(dp=world, ep=world))
    out = []
    for recipe, kwargs, autocast in FP8_EP_CASES:
        config, layer = _layer(n=8, **kwargs)
        dtype = kwargs.get("dtype", torch.float32)
        moe.shard_experts(layer, mesh.group("ep"), world, mesh.index("ep"))
        model = build_model(config, seed=0, dtype=dtype)
        model.transformer.h[0].mlp = layer
        handle = fp8.convert(model, fp8.Recipe(recipe, 4, "max", 0), mesh)
        handle.observe(counted := Chunks())
        layer.observer = rows = measure._Rows()
        x = torch.randn(B, S_LEN, config.n_embd, generator=torch.Generator().manual_seed(rank)).to(dtype)
        x.requires_grad_()
        measured = _measure(layer, x, autocast)
        chunks = (counted.padded_rows, counted.chunks)
        live = _alive_after_each_op({"layer": layer})
        with live, torch.autocast("cpu", dtype=torch.bfloat16) if autocast else nullcontext():
            layer(x)
        shape = _predict(config, rows.rows, B * S_LEN, dtype, autocast, world).shape
        predicted = moe_memory.block_peak(replace(shape, fp8=(*chunks, 4), fp8_blockwise=recipe == "blockwise"))
        out.append(dict(measured=measured, chunks=chunks, recorded=rows.fp8, alive=live.after, predicted=predicted,
                        rows=rows.rows))
    startups = {}
    for recipe, startup in FP8_STARTUPS.items():
        settings = _settings(*startup, world=world)
        _, compute, param, master = time_model.plan_dtypes(settings)
        run = train.Run(settings=settings, mesh=build_mesh(settings.shape, rank), config=settings.model,
                        device=torch.device("cpu"), seed=settings.args.seed, compute_dtype=compute, param_dtype=param,
                        master_dtype=master)
        startups[recipe] = train.compose(run, measure=True).measured_moe
    return out, startups


@pytest.fixture(scope="module")
def fp8_ep():
    return run_ranks(_fp8_ep_ranks, 2, timeout=120, backend_name="gloo")


@pytest.mark.parametrize("case", range(len(FP8_EP_CASES)),
                         ids=[f"{c[0]}-{c[1]}-autocast={c[2]}" for c in FP8_EP_CASES])
def test_fp8_experts_under_expert_parallel_save_and_hold_what_the_table_says(fp8_ep, case):
    """--fp8 (current, delayed, blockwise; fp32, bf16 autocast, bf16 weights; a capacity; h = 48), E = 2: each
    local expert runs each source's rows as a GEMM of its own (experts/dispatch.py), padded to 16 rows (blockwise: each
    row's 1×128 tiles scaled, c_proj's 4h = 192 two a row at h = 48); with the chunks the forward ran
    (P padded rows, c GEMMs, counted by the FP8 observer and recorded alike by the start-up's measure._Rows) the
    saved bytes and the bytes alive at P1 (the experts' outputs concatenated), P2 (the receiver's index_add) and
    P6 (the rows back summed into y, the last index_add) equal moe_memory's table to the byte, on both ranks (the
    moments, or above it by one all-to-all's input that gloo frees late: seen in about 1 of 6 runs under load)."""
    from accounting import moe_memory

    recipe = FP8_EP_CASES[case][0]
    for rank, (got, _) in enumerate(fp8_ep):
        case_got = got[case]
        predicted, measured, alive = case_got["predicted"], case_got["measured"], case_got["alive"]
        table = moe_memory.terms(predicted.shape)
        assert measured.saved == predicted.saved, (rank, measured, predicted.buffers)
        index_adds = [nbytes for name, nbytes in alive if name.startswith("aten.index_add")]
        at = {"1": [nbytes for name, nbytes in alive if name.startswith("aten.cat")][-1], "2": index_adds[-2],
              "6": index_adds[-1]}
        for moment, nbytes in at.items():  # exactly, or an all-to-all's input late (gloo: _assert_peak_as_predicted)
            expected = sum(n for _, n, _, when in table if moment in when)
            assert expected <= nbytes <= expected + late_free(predicted.shape), (rank, moment, nbytes, expected)
        assert case_got["recorded"] == case_got["chunks"], rank  # the start-up reads the same chunks
        assert measured.peak > predicted.peak and measured.at.startswith(EMULATION_PEAK[recipe])  # not written


@pytest.mark.parametrize("recipe", list(FP8_STARTUPS))
def test_fp8_experts_under_expert_parallel_the_start_up_measures_the_saved_bytes_predicted(fp8_ep, recipe):
    """A real start-up (train.compose, --fp8 current or blockwise, E = 2 on 2 ranks) predicts each held MoE block
    for the chunks its forward ran (measure._Rows; blockwise: its tiles' scales): the saved bytes equal the
    measured ones (its peak is the emulation's)."""
    peaks = fp8_ep[0][1][recipe]
    assert sorted((p.layer_id, p.rank) for p in peaks) == [(layer, rank) for layer in (0, 1) for rank in range(2)]
    for p in peaks:
        assert p.measured.saved == p.predicted.saved and p.predicted.shape.fp8 is not None, p
        assert p.predicted.shape.fp8_blockwise == (recipe == "blockwise"), p


# ---------------------------------------------------------------------------------------------------------
# Four ranks: expert parallel, and a real start-up against its plan
# ---------------------------------------------------------------------------------------------------------

EP_CASES = [(2, 0.0, "random"), (2, 1.0, "random"), (2, 0.0, "uniform"), (4, 0.0, "worst")]
DEEPSEEK = dict(moe_score="sigmoid", moe_bias_rate=1e-3, moe_groups=4, moe_group_limit=2, moe_shared_experts=1)
DEEPSEEK_CASES = {  # name: (E, capacity factor, physical slots R (experts/eplb.py; 0: none), GPTConfig's fields)
    "replicas": (2, 0.0, 12, {}), "router-shared": (2, 1.0, 0, DEEPSEEK),
    "replicas-router-shared": (2, 0.0, 12, dict(DEEPSEEK, moe_groups=0, moe_group_limit=0))}
PLANNED = (["--moe-experts", "4", "--ep", "2"], 8, 1)  # tests/planner/test_plan.py's MoE case: flags, global batch, B_μ
UNDER_TP = (["--moe-experts", "4", "--tp", "2", "--moe-capacity-factor", "1.0"], 4, 1)  # experts whole on each tp rank


def _route(layer, x, how):
    """uniform: token t's top-2 are experts (2j, 2j+1), j = t mod 4, so each expert gets T/4 of every rank's tokens;
    worst: every token picks experts 0 and 1 (rank 0's under E = 4)."""
    with torch.no_grad():
        layer.router.weight.zero_()
        x.zero_()
        tokens = x.view(-1, x.shape[-1])
        for t in range(tokens.shape[0]):
            tokens[t, t % 4 if how == "uniform" else 0] = 1.0
        for j in range(4):
            layer.router.weight[2 * j:2 * j + 2, j] = 10.0 if how == "uniform" else 0.0
        if how == "worst":
            layer.router.weight[:2, 0] = 10.0


def _ranks(rank, world):
    from experts import dispatch, router
    from experts import eplb
    import moe
    from accounting import moe_memory
    from accounting import memory
    import report.axes
    from planner import time_model
    import train
    from mesh import MeshShape, build_mesh
    from test_plan import _settings

    out = {}
    meshes = {ep: build_mesh(MeshShape(dp=world, ep=ep)) for ep in (2, 4)}
    for ep, factor, how in EP_CASES:
        config, layer = _layer(n=8, factor=factor)
        moe.shard_experts(layer, meshes[ep].group("ep"), ep, meshes[ep].index("ep"))
        x = torch.randn(B, S_LEN, H, generator=torch.Generator().manual_seed(rank))
        if how != "random":
            _route(layer, x, how)
        measured = _measure(layer, x.requires_grad_())
        traffic = dispatch.Traffic(config, tokens=B * S_LEN, ep=ep)
        shape = memory.ActivationShape(s=S_LEN, b=B, h=H, a=2, vocab=config.vocab_size)
        out[(ep, factor, how)] = dict(
            measured=measured, rows=layer.observer.rows,
            routed=_predict(config, layer.observer.rows, B * S_LEN, torch.float32, False, ep),
            formula=moe_memory.block_peak(moe_memory.shape_of(traffic, shape, "worst" if how == "worst" else how)))
    for name, (ep, factor, slots, deepseek) in DEEPSEEK_CASES.items():
        config, layer = _layer(n=8, factor=factor, **deepseek)
        if slots:  # R/E physical slots on each rank (experts/eplb.py's placement for a uniform load)
            eplb.place_slots(layer, slots, meshes[ep].group("ep"), ep, meshes[ep].index("ep"), torch.device("cpu"))
        else:
            moe.shard_experts(layer, meshes[ep].group("ep"), ep, meshes[ep].index("ep"))
        layer.places = router.group_places(config.moe.groups, ep, meshes[ep].index("ep"))
        x = torch.randn(B, S_LEN, H, generator=torch.Generator().manual_seed(rank), requires_grad=True)
        out[name] = dict(measured=_measure(layer, x), rows=layer.observer.rows,
                         routed=_predict(config, layer.observer.rows, B * S_LEN, torch.float32, False, ep, slots))
    settings = _settings(*PLANNED)
    _, compute, param, master = time_model.plan_dtypes(settings)
    run = train.Run(settings=settings, mesh=build_mesh(settings.shape, rank), config=settings.model,
                    device=torch.device("cpu"), seed=settings.args.seed, compute_dtype=compute, param_dtype=param,
                    master_dtype=master)
    train.compose(run, measure=True)
    role = time_model.role_of(run)
    moe_axis = next(axis for axis in run.axes if axis.name == "moe")
    out["run"] = dict(peak=role.peak, temporaries=role.temporaries, measured_moe=run.measured_moe,
                      lines=report.axes.axis_lines(moe_axis, "startup", run))
    settings = _settings(*UNDER_TP)
    run = train.Run(settings=settings, mesh=build_mesh(settings.shape, rank), config=settings.model,
                    device=torch.device("cpu"), seed=settings.args.seed, compute_dtype=compute, param_dtype=param,
                    master_dtype=master)
    out["tp"] = train.compose(run, measure=True).measured_moe
    dist.barrier()
    return out


def _assert_peak_as_predicted(rank, measured, predicted):
    """Saved bytes exactly; the peak exactly or above it by at most one all-to-all's input (the dispatch's S or
    the combine's R rows, or the 8N-byte counts): under EP, gloo's worker thread can still hold a collective's
    input for a moment after wait() returns (seen in about one of ten runs of this spawn under load), so that
    buffer may be freed an op late. Quiet runs measure the prediction exactly."""
    assert measured.saved == predicted.saved, (rank, measured, predicted)
    assert predicted.peak <= measured.peak <= predicted.peak + late_free(predicted.shape), (rank, measured, predicted)


def late_free(shape) -> int:
    """The most bytes gloo's worker thread may still hold after an all-to-all's wait() returns: one input (the
    dispatch's S or the combine's R rows) or the 8N-byte counts (moe_memory.late_free_bytes, which the start-up's
    lines read too)."""
    from accounting import moe_memory

    return moe_memory.late_free_bytes(shape)


def test_a_measured_peak_within_one_late_freed_input_reads_as_the_prediction():
    """The start-up's line per MoE layer (fixed figures): equal bytes print "=", a peak a few hundred bytes above
    (gloo's thread freed an all-to-all input an op late; the issue's "differs from predicted" by 564 bytes) "≈"
    with the tolerance stated, the FP8 emulation's extra peak says what it is, and anything else still differs."""
    from accounting import memory, moe_memory

    shape = moe_memory.DispatchShape(tokens=512, sent=560, received=560, experts=4, topk=2, hidden=64)
    predicted = moe_memory.block_peak(shape)
    tolerance = moe_memory.late_free_bytes(shape)
    assert tolerance == 560 * 64 * 4 + 8 * 4

    def measured(above, saved=0):
        return memory.ModulePeak(predicted.peak + above, predicted.saved + saved, "aten.mm")

    assert moe_memory.measured_verdict(measured(0), predicted) == ("=", "")
    sign, note = moe_memory.measured_verdict(measured(564), predicted)
    assert sign == "≈" and note == f"; peak +564 B, within one all-to-all input ({tolerance:,} B)", note
    assert moe_memory.measured_verdict(measured(tolerance + 1), predicted)[0] == "differs from"
    assert moe_memory.measured_verdict(measured(0, saved=8), predicted)[0] == "differs from"
    assert moe_memory.measured_verdict(measured(-8), predicted)[0] == "differs from"
    fp8 = replace(predicted, shape=replace(shape, fp8=(576, 2, 4)))  # the emulation's +65,584 B, seen under --fp8
    for above in (65_584, tolerance + 1):
        assert moe_memory.measured_verdict(measured(above), fp8) == (
            "vs", f"; peak {above:+,} B: the FP8 emulation's own temporaries, not predicted")
    assert moe_memory.rows_text(853.3333333333334) == "853.3" and moe_memory.rows_text(1024) == "1,024"


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_ranks, 4, timeout=300, backend_name="gloo")


@pytest.mark.parametrize("case", EP_CASES[:2], ids=["E2-dropless", "E2-capacity"])
def test_expert_parallel_peak_equals_the_prediction_for_the_routed_rows(ranks, case):
    for rank, got in enumerate(ranks):
        measured, predicted = got[case]["measured"], got[case]["routed"]
        _assert_peak_as_predicted(rank, measured, predicted)
        assert measured.backward_rise >= predicted.backward[1], (rank, measured, predicted.backward)  # E > 1: below


@pytest.mark.parametrize("case", list(DEEPSEEK_CASES))
def test_deepseek_options_under_expert_parallel_peak_as_predicted(ranks, case):
    """Replicas (the dispatch by physical slot), DeepSeek-V3's router with the group limit, shared experts."""
    for rank, got in enumerate(ranks):
        measured, predicted = got[case]["measured"], got[case]["routed"]
        _assert_peak_as_predicted(rank, measured, predicted)
        assert measured.backward_rise >= predicted.backward[1], (rank, measured, predicted.backward)  # E > 1: below


def test_uniform_routing_is_the_uniform_prediction(ranks):
    """Each expert gets T/4 of every rank's tokens (the uniform R_e = T·k), a token's two on one rank: one row
    per token (S = R = T, fewer than the uniform T·ρ of independent choices); predicted from those rows."""
    from accounting import moe_memory

    for rank, got in enumerate(ranks):
        case = got[(2, 0.0, "uniform")]
        assert case["rows"] == (B * S_LEN, B * S_LEN, B * S_LEN * 2), rank
        assert case["formula"].shape.expert_rows == B * S_LEN * 2
        formula = moe_memory.block_peak(replace(case["formula"].shape, sent=B * S_LEN, received=B * S_LEN))
        assert (case["measured"].peak, case["measured"].saved) == (formula.peak, formula.saved)


def test_the_worst_case_is_every_rank_picking_one_ranks_experts_and_peaks_at_the_receivers_sum(ranks):
    """The hot rank's experts run E·T·k rows; their weighted outputs, summed per (token, source) by index_add
    (P2: weighted R_e rows, the sum's zeros and result, R rows each), set its peak."""
    case = ranks[0][(4, 0.0, "worst")]
    assert case["rows"] == (B * S_LEN, 4 * B * S_LEN, 4 * B * S_LEN * 2)
    assert (case["measured"].peak, case["measured"].saved) == (case["formula"].peak, case["formula"].saved)
    assert case["formula"].moment == "P2" and case["measured"].at.startswith("aten.index_add")


def test_the_start_up_measures_every_held_moe_block_as_predicted(ranks):
    peaks = ranks[0]["run"]["measured_moe"]
    assert sorted((p.layer_id, p.rank) for p in peaks) == [(layer, rank) for layer in (0, 1) for rank in range(4)]
    for p in peaks:
        assert (p.measured.peak, p.measured.saved) == (p.predicted.peak, p.predicted.saved), p
        assert p.attention.above_saved == p.attention_predicted, p
        # E = 2: the combine's moment (B1) is passed; the experts' partial weight gradients are not written
        assert p.backward_rise >= p.backward_predicted[1] > 0, p
    lines = ranks[0]["run"]["lines"]
    assert any("MoE sets the peak" in line for line in lines) and any("measured: MoE sets" in line for line in lines)
    assert sum(" = predicted " in line or " ≈ predicted " in line for line in lines) == len(peaks)
    uniform = next(line for line in lines if "uniform routing S = R = " in line)  # T·ρ, a mean: to one decimal
    assert re.search(r"uniform routing S = R = [0-9,]+\.[0-9]; worst case R = [0-9,]+:", uniform), uniform


def test_under_tp_the_start_up_measures_moe_and_attention_as_predicted(ranks):
    """TP without SP: the MoE layer is whole on each tp rank; attention also holds its all-reduce's fresh output."""
    peaks = ranks[0]["tp"]
    assert len(peaks) == 2 * 4
    for p in peaks:
        assert (p.measured.peak, p.measured.saved) == (p.predicted.peak, p.predicted.saved), p
        assert p.attention.above_saved == p.attention_predicted, p


def test_the_plans_step_peak_is_the_real_start_ups_byte_for_byte(ranks):
    from accounting import moe_memory
    import plan
    from planner import time_model
    from test_plan import _settings

    settings = _settings(*PLANNED)
    for rank, got in enumerate(ranks):
        with plan.fake_world(rank, 4):
            role = time_model.role_of(plan.build_role(settings, rank))
        block = [name for name in role.temporaries if name.startswith(moe_memory.PEAK_TEMPORARY)]
        assert len(block) == 1 and moe_memory.peak_setter(role.temporaries) == "MoE", role.temporaries
        assert role.temporaries[block[0]] == got["run"]["temporaries"][block[0]]
        assert role.peak == got["run"]["peak"], (rank, role.temporaries, got["run"]["temporaries"])
