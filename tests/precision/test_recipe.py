"""precision/recipe.py: the --precision-recipe flag, the recipe linear's three GEMMs against their definition, and
every preset on TP+SP, ZeRO-3 and PP (and a resume on another mesh) against the single process.

The linear is checked bitwise in float64 against the recipe written out from the published semantics with
precision/microscaling.py's quantiser (fq = quantise → dequantise, blocks along each GEMM's contraction dimension; the
Hadamard on both dW operands along the tokens; stochastic rounding of dY from the logical coordinates' draws).
The mesh runs go through train.compose exactly as tests/test_composition.py's do (flags → the axes → the
layout → step.train_step) and compare with tests/reference.py's single process converted with the same recipe,
at the FP8 tests' tolerance: losses and parameters within 1e-10 in float64. That holds only if every element is
quantised identically on both meshes: the same blocks (local to a rank's piece), the same NVFP4 tensor amax (MAX
over tp) and the same stochastic-rounding draws (keyed by the logical coordinates, not by the rank), so a rank-keyed
draw or a missing reduction fails it by orders of magnitude. MoE (accounting/recipe_experts.py): a routed expert's chunk
is checked bitwise against the recipe on its zero-padded rows, and E = 1, E = 2 (ZeRO-1 with shared experts, ZeRO-3)
and TP follow the single process at the same tolerance, E = 2 equal to E = 1 (a draw keyed by the receiving rank
instead of the source's micro-batch fails it by 2e-2). All mesh runs share one 2-rank spawn.
"""

import os

import pytest
import torch
import torch.nn as nn

from precision import microscaling
from precision import quartet
from precision import randomness
from precision import recipe as recipes
import test_composition
from harness import assert_runs_follow, run_ranks
from reference import global_batches, make_config, reference_run, train_counting_expert_padding
from test_composition import STEPS, SEQ, CLIP, TOL, _parse

PRESETS = ("mxfp8", "mxfp4", "nvfp4")


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models run on one thread


# ---------------------------------------------------------------------------------------------------------
# The flag
# ---------------------------------------------------------------------------------------------------------


def test_presets_and_parts_parse_to_the_spec():
    assert recipes.parse_recipe("nvfp4") == recipes.PrecisionRecipe(
        "nvfp4", fwd="nvfp4", bwd="nvfp4", sr=True, rht=True, w2d=True, tail=0.15)
    assert recipes.parse_recipe("mxfp8") == recipes.PrecisionRecipe("mxfp8", fwd="mxfp8", bwd="mxfp8")
    assert recipes.parse_recipe("fwd=mxfp4,bwd=mxfp8,rule=floor,tail=0.5") == recipes.PrecisionRecipe(
        "fwd=mxfp4,bwd=mxfp8,rule=floor,tail=0.5", fwd="mxfp4", bwd="mxfp8", rule="floor", tail=0.5)
    assert recipes.parse_recipe("nvfp4,tail=0,sr").tail == 0  # a preset among parts: its parts, then the rest
    assert recipes.parse_recipe("nvfp4").tail_layers(7) == 2 and recipes.parse_recipe("nvfp4").tail_layers(20) == 3
    assert recipes.parse_recipe("quartet2") == recipes.PrecisionRecipe(
        "quartet2", fwd="nvfp4", bwd="nvfp4", four_over_six=True, eden=True, rotation=128)
    quartet2 = recipes.parse_recipe("quartet2,rotation=32")
    assert quartet2.rotation == 32 and quartet2.token_block == 32 and not quartet2.gathers_codes
    assert quartet2.describe() == "fwd=nvfp4,bwd=nvfp4,4over6,eden,rotation=32,rule=rceil"
    assert recipes.parse_recipe("fwd=nvfp4,w2d,bwd=nvfp4,eden").token_block == 128  # 2-D × MS-EDEN: a cell


BAD_RECIPES = [
    (["--precision-recipe", "fwd=fp6"], "'fwd=fp6' is not a part"),
    (["--precision-recipe", "mxfp8,hadamard"], "'hadamard' is not a part"),
    (["--precision-recipe", "nvfp4,tail=1"], "tail=1 must be in [0, 1)"),
    (["--precision-recipe", "fwd=mxfp8,sr"], "sr and rht act on the backward"),
    (["--precision-recipe", "mxfp8", "--n-embd", "48", "--n-head", "4"], "is not a multiple of the 32-wide block"),
    (["--precision-recipe", "nvfp4", "--tp", "2", "--n-embd", "48", "--n-head", "4"], "16-wide block"),
    (["--precision-recipe", "mxfp8", "--fp8", "current"], "choose one recipe"),
    (["--precision-recipe", "fwd=mxfp8,4over6"], "4over6 chooses the scale of the forward's 1×16 NVFP4 blocks"),
    (["--precision-recipe", "fwd=nvfp4,w2d,4over6"], "give fwd=nvfp4, without w2d"),
    (["--precision-recipe", "bwd=nvfp4,eden,sr"], "eden is the backward's NVFP4 quantiser"),
    (["--precision-recipe", "bwd=mxfp4,eden"], "give bwd=nvfp4, without sr and rht"),
    (["--precision-recipe", "bwd=nvfp4,rotation=64"], "rotation=G is MS-EDEN's rotation group"),
    (["--precision-recipe", "quartet2,rotation=48"], "'rotation=48' is not a part"),
    (["--precision-recipe", "quartet2,eden=1"], "'eden=1' is not a part"),
    (["--precision-recipe", "quartet2"], "is not a multiple of the 128-wide block"),  # tiny: h = 64
    (["--precision-recipe", "mxfp8", "--moe-experts", "4", "--tp", "2", "--sp"], "and --sp: a routed expert's rows"),
    (["--precision-recipe", "mxfp8", "--moe-experts", "4", "--cp", "2"], "and --cp: a routed expert's rows"),
    (["--precision-recipe", "mxfp8", "--moe-experts", "4", "--ep", "2", "--moe-replicas", "6"],
     "and --moe-replicas: a routed expert's rows"),
]


@pytest.mark.parametrize("flags,message", BAD_RECIPES, ids=[" ".join(f[1:]) for f, _ in BAD_RECIPES])
def test_a_bad_recipe_ends_in_one_line_naming_the_flag(flags, message, refused):
    """flags.parse as every rank runs it: exit status 2, one line `error: --precision-recipe ...`."""
    err = refused(flags, world=2 if {"--tp", "--cp", "--ep"} & set(flags) else 1)
    assert err.startswith("error: --precision-recipe") and message in err, err


# ---------------------------------------------------------------------------------------------------------
# The linear against the recipe's definition (float64, bitwise)
# ---------------------------------------------------------------------------------------------------------


def test_linear_computes_the_nvfp4_recipe_as_written():
    """Y = fq(X)·fq₂(W)ᵀ + b, dX = fq(dY; SR)·fq₂(W), dW = fq(H·dYᵀ; SR)·fq(H·Xᵀ)ᵀ, db = Σ dY, with fq₂ NVFP4's
    16×16 weight blocks and H the step's Hadamard (/4) along the tokens; the draws from the logical coordinates."""
    M, K, N, f64 = 32, 64, 48, torch.float64
    torch.manual_seed(0)
    plain = nn.Linear(K, N, dtype=f64)
    recipe = recipes.parse_recipe("nvfp4")
    state = randomness.DrawState(seed=5, first_micro_batch=0, seq_len=M, positions=None)
    layer = recipes.RecipeLinear(plain, recipe, state, "layer", layer_key=3, out_index=torch.arange(N), amax_groups={})
    x, dy = torch.randn(1, M, K, dtype=f64), torch.randn(1, M, N, dtype=f64)
    x_leaf = x.clone().requires_grad_()
    y = layer(x_leaf)
    y.backward(dy)

    def fq(t, two_d=False, draws=None):
        return microscaling.fake_quantize(t, microscaling.FORMATS["nvfp4"], two_d=two_d, stochastic=draws)

    w, x2, dy2 = plain.weight.detach(), x[0], dy[0]
    hadamard = randomness.hadamard_signs(state.key(-1, 3, 2), "cpu")
    draws = randomness.uniform_draws(state.key(0, 3, 0), torch.arange(M), torch.arange(N))
    draws_t = randomness.uniform_draws(state.key(0, 3, 1), torch.arange(N), torch.arange(M))
    assert torch.equal(y[0], fq(x2) @ fq(w, two_d=True).t() + plain.bias)
    assert torch.equal(x_leaf.grad[0], fq(dy2, draws=draws) @ fq(w, two_d=True))
    dw = fq(microscaling.hadamard_blocks(dy2.t(), hadamard), draws=draws_t) \
        @ fq(microscaling.hadamard_blocks(x2.t(), hadamard)).t()
    assert torch.equal(plain.weight.grad, dw) and torch.equal(plain.bias.grad, dy2.sum(0))
    assert not torch.equal(draws, randomness.uniform_draws(state.key(1, 3, 0), torch.arange(M), torch.arange(N)))


def test_linear_computes_quartet_ii_as_written():
    """quartet2 (rotation 16), float64, bitwise: Y = q46(X)·q46(W)ᵀ + b (Four Over Six, 1×16 on both); the backward
    re-quantises what the forward multiplied, X̂ = q46(X), Ŵ = q46(W), each GEMM's operands rotated by the
    micro-batch's Hadamard R along its contraction dim and quantised by MS-EDEN with scale draws keyed by the
    blocks' logical coordinates: dX = E(dY·R)·E(Ŵᵀ·R)ᵀ, dW = E(dYᵀ·R)·E(X̂ᵀ·R)ᵀ, db = Σ dY."""
    M, K, N, f64, layer_key = 32, 64, 48, torch.float64, 3
    torch.manual_seed(2)
    plain = nn.Linear(K, N, dtype=f64)
    state = randomness.DrawState(seed=5, first_micro_batch=0, seq_len=M, positions=None)
    layer = recipes.RecipeLinear(plain, recipes.parse_recipe("quartet2,rotation=16"), state, "layer", layer_key,
                                 out_index=torch.arange(N), amax_groups={})
    x, dy = torch.randn(1, M, K, dtype=f64), torch.randn(1, M, N, dtype=f64)
    x_leaf = x.clone().requires_grad_()
    y = layer(x_leaf)
    y.backward(dy)
    w, x2, dy2 = plain.weight.detach(), x[0], dy[0]
    wq, xq = quartet.four_over_six(w).values, quartet.four_over_six(x2).values
    assert torch.equal(y[0], xq @ wq.t() + plain.bias)
    hadamard = randomness.hadamard_signs(state.key(0, layer_key, 3), "cpu", 16)
    rows, outs, ins = torch.arange(M), torch.arange(N), torch.arange(K)

    def eden(t, role, row_index, col_index):
        draws = randomness.uniform_draws(state.key(0, layer_key, role), row_index, col_index[::16])
        return quartet.eden_rotated(t, 16, draws).values

    rotate = microscaling.hadamard_blocks
    dx = eden(rotate(dy2, hadamard), 4, rows, outs) @ eden(rotate(wq, hadamard, dim=0).t(), 5, ins, outs).t()
    dw = eden(rotate(dy2, hadamard, dim=0).t(), 6, outs, rows) @ eden(rotate(xq, hadamard, dim=0).t(), 7, ins, rows).t()
    assert torch.equal(x_leaf.grad[0], dx) and torch.equal(plain.weight.grad, dw)
    assert torch.equal(plain.bias.grad, dy2.sum(0))
    exact = dy2.t() @ xq  # the gradient of the forward it ran, estimated: close, not equal
    assert 0 < (dw - exact).norm() / exact.norm() < 0.3


@pytest.mark.parametrize("spec,block", [("nvfp4", 16), ("mxfp8", 32)])
def test_a_routed_experts_chunk_computes_the_recipe_on_its_rows_padded_to_the_token_block(spec, block):
    """A routed expert's linear (EP source 1 of 2, whose rank's first micro-batch is 6) on a chunk of 5 rows, its
    second call (source 1, micro-batch 0): Y and dX are the dense recipe's on the 5 rows, dW's operands are the 5
    rows with block − 5 zero rows appended (Hadamard, SR on them), SR keyed by micro-batch 6 + 0 and the row in
    the chunk; bitwise in float64. The observer hears block − 5 padded rows; an empty chunk runs plain."""
    K, N, f64 = 64, 32, torch.float64
    torch.manual_seed(1)
    plain = nn.Linear(K, N, dtype=f64)
    recipe = recipes.parse_recipe(spec)
    state = randomness.DrawState(seed=5, first_micro_batch=2, seq_len=16, positions=None)
    layer = recipes.RecipeLinear(plain, recipe, state, "transformer.h.0.mlp.experts.1.c_fc", 7, torch.arange(N), {},
                                 sources=[2, 6], token_block=block)
    pads = []
    layer.observer.padded = lambda linear, rows: pads.append(rows)
    layer(torch.zeros(0, K, dtype=f64, requires_grad=True)).sum().backward()  # call 0: source 0, nothing reached it
    x, dy = torch.randn(5, K, dtype=f64), torch.randn(5, N, dtype=f64)
    x_leaf = x.clone().requires_grad_()
    plain.weight.grad = None
    layer(x_leaf).backward(dy)
    fmt = microscaling.FORMATS[spec]
    sr, two_d = recipe.sr, recipe.w2d

    def fq(t, draws=None, w=False):
        return microscaling.fake_quantize(t, fmt, two_d=w and two_d, stochastic=draws if sr else None)

    w = plain.weight.detach()
    y = fq(x) @ (fq(w, w=True) if two_d else fq(w)).t() + plain.bias
    assert torch.equal(layer(x), y) and pads == [block - 5, block - 5]
    draws = randomness.uniform_draws(state.key(6, 7, 0), torch.arange(5), torch.arange(N))
    w_dx = fq(w, w=True) if two_d else fq(w.t()).t()
    assert torch.equal(x_leaf.grad, fq(dy, draws) @ w_dx)
    pad = torch.zeros(block - 5, K, dtype=f64), torch.zeros(block - 5, N, dtype=f64)
    xp_t, dyp_t = torch.cat([x, pad[0]]).t(), torch.cat([dy, pad[1]]).t()  # along the tokens, padded
    if recipe.rht:
        signs = randomness.hadamard_signs(state.key(-1, 7, 2), "cpu")
        xp_t, dyp_t = microscaling.hadamard_blocks(xp_t, signs), microscaling.hadamard_blocks(dyp_t, signs)
    draws_t = randomness.uniform_draws(state.key(6, 7, 1), torch.arange(N), torch.arange(block))
    assert torch.equal(plain.weight.grad, fq(dyp_t, draws_t) @ fq(xp_t).t())


def test_routed_experts_padded_rows_per_moe_layer_equal_a_hand_count_and_are_printed():
    """Training forwards of a 2-MoE-layer model under nvfp4: the rows the accounting's observer counts per layer
    (report.axes.OBSERVERS["precision"]) equal Σ over micro-batches and experts of (−m) mod 16 for the m rows the
    router sent each expert (E = 1: a chunk is a micro-batch's rows of one expert; an empty one pads nothing); the
    end line prints them beside the estimate N·15/2 per layer and micro-batch, and their bytes, 5h·4.5/8 each."""
    from types import SimpleNamespace

    import report.axes
    from reference import build_model

    config = make_config(n_layer=2, n_head=2, n_embd=64, moe_experts=4, moe_topk=2)
    model = build_model(config, seed=0, dtype=torch.float64)
    handle = recipes.convert(model, recipes.parse_recipe("nvfp4,tail=0"), seq_len=16)
    report.axes.observe(handle)
    hand, _ = train_counting_expert_padding(model, config, 16, handle.after_grad_sync)
    assert handle.observer.rows == hand and all(hand.values())
    run = SimpleNamespace(config=config, compute_dtype=torch.float64, micro_batches=1)
    lines = "\n".join(report.axes.axis_lines(handle, "end", run, 3))
    for layer_id, rows in hand.items():
        assert f"precision experts: MoE layer {layer_id} padded {rows} rows to 16 per chunk in 3 steps (estimate" \
               f" 90) = {rows * 5 * 64 * 4.5 / 8:g} bytes" in lines, lines


def test_draws_of_a_piece_are_the_whole_tensors_draws_there():
    """Any rank's piece (rows, columns of the logical tensor, in any order) draws what the whole draws there."""
    key = randomness.draw_key(0, 3, 1, 17, 0)
    whole = randomness.uniform_draws(key, torch.arange(64), torch.arange(96))
    rows, cols = torch.tensor([40, 41, 7, 8]), torch.tensor([5, 90, 33])
    assert torch.equal(randomness.uniform_draws(key, rows, cols), whole[rows][:, cols])
    assert 0 <= float(whole.min()) and float(whole.max()) < 1 and abs(float(whole.mean()) - 0.5) < 0.01


def test_feature_indices_name_a_tp_pieces_logical_rows_and_columns():
    """out_index: a column-parallel c_attn piece (rank 1 of 2) holds the second half of each q/k/v segment;
    in_index: a row-parallel c_proj piece holds its columns; each equals the logical tensor's cut by the split."""
    from shard import ShardInfo, Split

    c_attn = ShardInfo("c_attn.weight", (192, 64), (Split(0, 2, 1, segments=3),))
    assert randomness.out_index(c_attn, 96).tolist() == [*range(32, 64), *range(96, 128), *range(160, 192)]
    assert randomness.in_index(c_attn, 64).tolist() == list(range(64))
    c_proj = ShardInfo("c_proj.weight", (64, 256), (Split(1, 2, 1),))
    assert randomness.in_index(c_proj, 128).tolist() == list(range(128, 256))
    assert randomness.out_index(c_proj, 64).tolist() == list(range(64))
    assert randomness.in_index(None, 8).tolist() == list(range(8))


def test_the_tail_and_the_ends_stay_in_the_compute_dtype():
    from reference import build_model

    model = build_model(make_config(n_layer=4, n_embd=64), seed=0)
    handle = recipes.convert(model, recipes.parse_recipe("nvfp4,tail=0.3"), seq_len=SEQ)  # ⌈1.2⌉ = 2 blocks
    assert sorted({name.split(".")[2] for name in handle.linears}) == ["0", "1"] and len(handle.kept) == 8
    assert type(model.lm_head) is nn.Linear and type(model.transformer.h[3].mlp.c_fc) is nn.Linear
    facts = handle.facts()
    assert set(facts.formats.values()) == {("nvfp4", "nvfp4")} and facts.kept == handle.kept


# ---------------------------------------------------------------------------------------------------------
# Every preset on TP+SP, ZeRO-3 and PP, and a resume on another mesh, against the single process
# ---------------------------------------------------------------------------------------------------------

H = dict(n_embd=64)  # n_embd/T = 32: the MX blocks fit a TP shard; M = 2·16 tokens per micro-batch


def _mesh_cases(preset):
    recipe = ["--precision-recipe", preset]
    return [([*recipe, "--tp", "2", "--sp"], H, 4, 2),
            ([*recipe, "--zero", "3"], H, 4, 2),
            ([*recipe, "--pp", "2"], dict(H, n_layer=4), 4, 2)]


MOE = ["--moe-experts", "4", "--moe-topk", "2"]
LONG = 64  # CP's zig-zag pieces of s/2C = 16 tokens hold whole 16-token NVFP4 blocks and Hadamard blocks
MESH_CASES = [case for preset in PRESETS for case in _mesh_cases(preset)] + [
    (["--precision-recipe", "mxfp8", "--zero", "1"], H, 4, 2),
    (["--precision-recipe", "nvfp4,tail=0", "--tp", "2"], dict(H, activation_checkpointing=True), 4, 2),  # a recompute
    # draws with its first forward's micro-batch and repeats the forward's amax reductions
    (["--precision-recipe", "nvfp4", "--pp", "2", "--pp-schedule", "zb"], dict(H, n_layer=4), 4, 2),  # its own W
    (["--precision-recipe", "nvfp4,tail=0", "--cp", "2", "--seq-len", str(LONG)], H, 2, 1),  # SR draws at CP's
    # positions, the tensor amax MAX over cp; MoE (accounting/recipe_experts.py): E = 1, then E = 2 (each source's chunk
    # scaled alone, SR keyed by the source's micro-batch), the shared experts as dense layers
    (["--precision-recipe", "nvfp4,tail=0", *MOE], H, 4, 2),
    (["--precision-recipe", "nvfp4,tail=0", *MOE, "--ep", "2"], H, 4, 2),
    (["--precision-recipe", "mxfp8", *MOE, "--ep", "2", "--moe-shared-experts", "1", "--zero", "1"], H, 4, 2),
    (["--precision-recipe", "nvfp4", *MOE, "--ep", "2", "--zero", "3"], dict(H, n_layer=2), 4, 2),  # expert codes
    (["--precision-recipe", "nvfp4,tail=0", *MOE, "--tp", "2"], H, 4, 2),  # experts whole on each TP rank
]
EP1, EP2 = len(MESH_CASES) - 5, len(MESH_CASES) - 4
MESH_IDS = ["-".join(f.lstrip("-") for f in case[0][1:]) + ("-ckpt" if case[1].get("activation_checkpointing") else "")
            for case in MESH_CASES]


def _seq_len(flags) -> int:
    return int(flags[flags.index("--seq-len") + 1]) if "--seq-len" in flags else SEQ


def _run_case(rank, world, flags, *case, **kwargs):
    """test_composition's run of a case, at the case's sequence length (its batches, flags and positions)."""
    test_composition.SEQ = _seq_len(flags)
    try:
        return test_composition._run_case(rank, world, flags, *case, **kwargs)
    finally:
        test_composition.SEQ = SEQ
SAVE_AT = 2
RESHARD = [((["--precision-recipe", "nvfp4", "--tp", "2", "--sp"], H, 4, 2),
            (["--precision-recipe", "nvfp4", "--zero", "3"], H, 4, 2)),
           ((["--precision-recipe", "mxfp4", "--pp", "2"], dict(H, n_layer=4), 4, 2),
            (["--precision-recipe", "mxfp4", "--tp", "2"], dict(H, n_layer=4), 4, 2)),
           ((["--precision-recipe", "mxfp8", "--zero", "3"], H, 4, 2),
            (["--precision-recipe", "mxfp8", "--tp", "2", "--sp"], H, 4, 2))]


def _codec_round_trip(rank, world):
    """ZeRO-3's NVFP4 gather on two ranks whose flat shards of W [48, 64] cut its 16×16 tiles mid-row (at 1000
    of 3072 elements): (the decoded weight, what the linear uses of it, the weight quantised whole)."""
    import torch.distributed as dist

    torch.manual_seed(0)
    plain = nn.Linear(64, 48, dtype=torch.float64)
    state = randomness.DrawState(seed=0, first_micro_batch=0, seq_len=16, positions=None)
    linear = recipes.RecipeLinear(plain, recipes.parse_recipe("nvfp4"), state, "w", 0, torch.arange(48), {})
    codec = recipes.ZeroWeightCodec()
    codec.attach(linear)
    weight, cut = plain.weight.detach(), 1000
    lo, hi = (0, cut) if rank == 0 else (cut, weight.numel())
    codes, decoding = codec.encode([plain.weight], [weight.reshape(-1)[lo:hi]], dist.group.WORLD, [lo])
    longest = weight.numel() - cut  # gloo gathers equal sizes: pad
    pieces = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(pieces, torch.cat([codes[0], torch.zeros(longest - codes[0].numel(), dtype=torch.uint8)]))
    decoded = torch.empty(weight.numel(), dtype=torch.float64)
    codec.decode([plain.weight], [torch.cat([pieces[0][:cut], pieces[1]])], [decoded], decoding)
    fmt = microscaling.FORMATS["nvfp4"]
    used = microscaling.fake_quantize(decoded.view(48, 64), fmt, two_d=True, tensor_amax=linear.weight_amax(weight))
    return decoded.view(48, 64), used, microscaling.fake_quantize(weight, fmt, two_d=True)


def _on_meshes(rank, world, root):
    traced = [_run_case(rank, world, *case, trace=True) for case in MESH_CASES]
    resumed = []
    for index, (saving, resuming) in enumerate(RESHARD):
        directory = os.path.join(root, str(index))
        _run_case(rank, world, *saving, stop=SAVE_AT, save_root=directory)
        resumed.append(_run_case(rank, world, *resuming, resume_root=directory))
    return traced, resumed, _codec_round_trip(rank, world)


@pytest.fixture(scope="module")
def mesh_runs(tmp_path_factory):
    return run_ranks(_on_meshes, 2, str(tmp_path_factory.mktemp("ckpt")), timeout=600)


def _check(results, flags, config_kw, global_batch, micro):
    args = _parse(flags, global_batch, micro)
    seq = _seq_len(flags)
    ref_losses, _, ref_params = reference_run(test_composition._config(args, config_kw),
                                              global_batches(STEPS, global_batch, seq),
                                              clip=CLIP, micro_batches=global_batch // micro,
                                              precision_recipe=args.precision_recipe)
    assert_runs_follow(results, ref_losses, ref_params, TOL)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(MESH_CASES)), ids=MESH_IDS)
def test_every_preset_on_a_mesh_follows_the_single_process(mesh_runs, index):
    _check([rank_results[0][index][:2] for rank_results in mesh_runs], *MESH_CASES[index])


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(MESH_CASES)), ids=MESH_IDS)
def test_traced_messages_equal_the_prediction(mesh_runs, index):
    """Every (collective, group) of the traced steps, NVFP4's amax reductions among them, as predicted."""
    for rank_results in mesh_runs:
        traced, predicted = rank_results[0][index][2]
        assert set(traced) == set(predicted), set(traced) ^ set(predicted)
        for key, (calls, payload) in predicted.items():
            assert traced[key] == pytest.approx((calls, payload), abs=1e-9), key


@pytest.mark.slow
def test_routed_experts_quantise_alike_on_e2_and_e1(mesh_runs):
    """E = 2 trains what E = 1 trains (float64, 1e-10): each expert quantises the same chunks (one source's rows)
    with the same scales, blocks and draws whether the rows came over the all-to-all or not."""
    for rank_results in mesh_runs:
        (loss1, params1), (loss2, params2) = (rank_results[0][i][:2] for i in (EP1, EP2))
        torch.testing.assert_close(torch.tensor(list(loss2.values())), torch.tensor(list(loss1.values())),
                                   rtol=TOL, atol=TOL)
        for name in set(params1) & set(params2):
            torch.testing.assert_close(params2[name][0], params1[name][0], rtol=TOL, atol=TOL, msg=name)


@pytest.mark.slow
def test_zero3_gathers_nvfp4_tiles_cut_by_the_shards_as_the_whole_weight_quantises(mesh_runs):
    """The decoded gather is the whole weight's NVFP4 (16×16) dequantisation bit for bit, and the linear's own
    quantisation of it (with the gathered tensor amax) gives it back: the step is the working-dtype gather's."""
    for _, _, (decoded, used, whole) in mesh_runs:
        assert torch.equal(decoded, whole) and torch.equal(used, whole)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(RESHARD)), ids=["nvfp4-tp-sp-to-zero3", "mxfp4-pp-to-tp",
                                                             "mxfp8-zero3-to-tp-sp"])
def test_a_resume_on_another_mesh_equals_the_uninterrupted_run(mesh_runs, index):
    per_rank = [rank_results[1][index] for rank_results in mesh_runs]
    assert all(sorted(losses) == list(range(SAVE_AT, STEPS)) for losses, _ in per_rank)
    _check(per_rank, *RESHARD[index][1])


# ---------------------------------------------------------------------------------------------------------
# The printouts (report/axes.py's precision section), from a rank built as --plan builds it (meta)
# ---------------------------------------------------------------------------------------------------------


def test_startup_lines_name_the_formats_bits_and_messages():
    """Which linears run in which format and which stay in the compute dtype, bits per element with the scales
    (MXFP8 8.25, NVFP4 4.5 + the tensor scale), the gathered weights under ZeRO-3, NVFP4's amax reductions."""
    from cli import flags
    import mfu
    import plan
    import report.axes
    import train

    def startup(argv, world):
        settings = plan.plan_settings(flags.validate(flags.build_parser().parse_args(
            ["--preset", "tiny", "--global-batch", "4", "--micro-batch", "2", *argv]), world, axes=train.AXES))
        with plan.fake_world(0, world):
            run = plan.build_role(settings, 0)
            handle = next(axis for axis in run.axes if axis.name == "precision")
            return "\n".join(report.axes.axis_lines(handle, "startup", run)), handle

    text, _ = startup(["--precision-recipe", "nvfp4", "--tp", "2", "--n-layer", "4"], 2)
    assert "precision recipe fwd=nvfp4,bwd=nvfp4,sr,rht,w2d,tail=0.15,rule=rceil: 12 block linears (blocks 0-2)" in text
    assert "the last 4 block linears (block 3, tail 0.15)" in text
    assert "bits per element with block scales: forward 4.5, backward 4.5 (+ a 32-bit tensor scale" in text
    tokens = 2 * 64  # M = B_μ·s; per layer K_j: c_attn and c_fc h = 64, attention's c_proj h/T, the MLP's 4h/T
    codes = tokens * (64 + 64 + 32 + 128) * 3 * 4.5 / 8 + 4 * 12  # Σ M·K_j·4.5/8 + a tensor scale per linear
    assert f"a block-scaled kernel's {mfu.format_bytes(codes)}" in text
    calls = 12 * 2 * 2  # 12 linears × m = 2 micro-batches × (forward [amax X, W] 8 bytes, backward 16 bytes)
    assert f"all_reduce tp: {calls} × 12 B" in text
    text, _ = startup(["--precision-recipe", "mxfp8", "--zero", "3"], 2)
    assert "forward 8.25, backward 8.25;" in text and "messages" not in text
    assert "ZeRO-3 gathers these 98,304 weight elements per gather of all in the working dtype" in text
    text, _ = startup(["--precision-recipe", "nvfp4", "--zero", "3", "--n-layer", "4"], 2)
    assert "ZeRO-3 gathers these 147,456 weight elements per gather of all as E2M1 codes, 1 byte each here" in text


# Quartet II (4over6 forward, MS-EDEN backward) on TP+SP, ZeRO-3, PP and routed experts, and a resume from TP+SP
# onto ZeRO-3, in a 2-rank spawn of its own: rotation 32 fits a TP piece of c_attn's q/k/v (h/T = 32) and the
# M = 2·16 tokens. Every rank must rotate with the micro-batch's signs and draw each block scale's SR from its
# logical coordinates (out_index, in_index, token rows), and reduce the rotated operands' amaxes over tp.
QUARTET = ["--precision-recipe", "quartet2,rotation=32"]
QUARTET_CASES = [([*QUARTET, "--tp", "2", "--sp"], H, 4, 2), ([*QUARTET, "--zero", "3"], H, 4, 2),
                 ([*QUARTET, "--pp", "2"], dict(H, n_layer=4), 4, 2), ([*QUARTET, *MOE, "--ep", "2"], H, 4, 2)]
QUARTET_IDS = ["tp-sp", "zero3", "pp", "experts-ep2"]
QUARTET_RESHARD = (([*QUARTET, "--tp", "2", "--sp"], H, 4, 2), ([*QUARTET, "--zero", "3"], H, 4, 2))


def _quartet_on_meshes(rank, world, root):
    traced = [_run_case(rank, world, *case, trace=True) for case in QUARTET_CASES]
    saving, resuming = QUARTET_RESHARD
    _run_case(rank, world, *saving, stop=SAVE_AT, save_root=root)
    return traced, _run_case(rank, world, *resuming, resume_root=root)


@pytest.fixture(scope="module")
def quartet_runs(tmp_path_factory):
    return run_ranks(_quartet_on_meshes, 2, str(tmp_path_factory.mktemp("quartet")), timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(QUARTET_CASES)), ids=QUARTET_IDS)
def test_quartet_on_a_mesh_follows_the_single_process_and_traces_as_predicted(quartet_runs, index):
    _check([rank_results[0][index][:2] for rank_results in quartet_runs], *QUARTET_CASES[index])
    for rank_results in quartet_runs:
        traced, predicted = rank_results[0][index][2]
        assert set(traced) == set(predicted), set(traced) ^ set(predicted)
        for key, (calls, payload) in predicted.items():
            assert traced[key] == pytest.approx((calls, payload), abs=1e-9), key


@pytest.mark.slow
def test_quartet_resumed_on_another_mesh_equals_the_uninterrupted_run(quartet_runs):
    per_rank = [rank_results[1] for rank_results in quartet_runs]
    assert all(sorted(losses) == list(range(SAVE_AT, STEPS)) for losses, _ in per_rank)
    _check(per_rank, *QUARTET_RESHARD[1])


TP_ZERO3 = (["--precision-recipe", "nvfp4", "--zero", "3", "--tp", "2"], H, 4, 2)  # D = 2 × T = 2


def _tp_zero3(rank, world):
    return _run_case(rank, world, *TP_ZERO3, trace=True)


@pytest.mark.slow
def test_zero3_nvfp4_gather_under_tp_follows_the_single_process_and_traces_as_predicted():
    """ZeRO-3's NVFP4 gather of TP shards (the tensor amax MAX-reduced over tp too): the single process's update,
    and every message of the traced steps (the codec's tile and tensor amaxes among them) as predicted."""
    results = run_ranks(_tp_zero3, 4, timeout=600)
    _check([result[:2] for result in results], *TP_ZERO3)
    for _, _, (traced, predicted) in results:
        assert set(traced) == set(predicted), set(traced) ^ set(predicted)
        for key, (calls, payload) in predicted.items():
            assert traced[key] == pytest.approx((calls, payload), abs=1e-9), key


def test_stochastic_rounding_with_the_recipes_draws_is_unbiased_across_seeds():
    """The recipe's SR (draws hashed from the run seed and the coordinates, microscaling_fast's rounding): one
    element, 2.4 between E2M1's 2 and 3 in a block scaled by 1, rounded under n run seeds; the mean error stays
    within 5·σ/√n (σ = √(p(1-p)), p = 0.4) for n = 10², 10³, 4·10³; round-to-nearest's does not at 4·10³."""
    from precision import microscaling_fast

    value, p = 2.4, 0.4
    sigma = (p * (1 - p)) ** 0.5
    x = torch.full((4_000, 32), value)
    x[:, 0] = 6.0  # the block's amax: E8M0 scale 2^0 under rceil
    keys = [randomness.draw_key(seed, 0, 0, 3, 2) for seed in range(x.shape[0])]
    draws = torch.cat([randomness.uniform_draws(key, torch.arange(1), torch.arange(32)) for key in keys])
    rounded = microscaling_fast.fake_quantize(x, "mxfp4", draws=draws)[:, 1].double()
    nearest = microscaling_fast.fake_quantize(x, "mxfp4")[:, 1].double()
    assert set(rounded.unique().tolist()) == {2.0, 3.0}
    for n in (100, 1_000, 4_000):
        z = abs(rounded[:n].mean().item() - value) / (sigma / n ** 0.5)
        assert z <= 5.0, (n, z)
    assert abs(nearest.mean().item() - value) / (sigma / 4_000 ** 0.5) > 5.0  # the bound tells RNE's bias apart
