"""train.py's composition: every axis applied from train.AXES, the layout from train.build_layout, the step
from step.train_step, trained a few steps in float64 and compared with the single-device model.

Each case builds the run exactly as `train.main` does (flags → mesh → the stage model → the axes in order →
the layout → the schedule), but on the deterministic batches of tests/reference.py, so the losses and the
final parameters can be compared with `reference_run` on the same global batches (torch's AdamW, clipping
active). float64 sums in another order agree to ~1e-15 relative; the stated tolerance is 1e-10. Each rank
compares the parameters it holds (a pipeline stage, a TP shard, its experts, a ZeRO shard gathered) with the
matching slice of the reference's.

Cases of one world size share one spawn (process start-up costs seconds here). Each rank builds on
harness.device() (its GPU under nccl) and the step moves the CPU batches there, as in train.py.
"""


import pytest
import torch

import harness
from harness import assert_runs_follow, run_ranks
from reference import HYPER, global_batches, make_config, reference_run

STEPS, SEQ, CLIP, TOL = 3, 16, 0.05, 1e-10


def _parse(flags, global_batch, micro):
    from cli import flags as flags_lib

    return flags_lib.build_parser().parse_args(["--global-batch", str(global_batch), "--micro-batch", str(micro),
                                                "--seq-len", str(SEQ), "--lr", str(HYPER["lr"]), "--weight-decay",
                                                str(HYPER["weight_decay"]), "--beta1", str(HYPER["betas"][0]),
                                                "--beta2", str(HYPER["betas"][1]), "--bucket-mb", "0.02", *flags])


def _config(args, config_kw):
    import moe

    return make_config(**config_kw, moe=moe.experts_config(args))  # the MoE flags, as flags.model_config


def composed_run(rank, world, flags, config_kw, global_batch, micro, device):
    """train.compose on the flags, as train.main builds a run, in float64 on this test's model config."""
    from dataclasses import replace

    from cli import flags as flags_lib
    import train
    from mesh import build_mesh

    shape_flags = ["--n-layer", str(make_config(**config_kw).n_layer), "--n-head", str(make_config(**config_kw).n_head),
                   "--n-embd", str(make_config(**config_kw).n_embd)]  # validated on the model the test builds
    args = _parse([*shape_flags, *flags], global_batch, micro)
    settings = flags_lib.validate(args, world, axes=train.AXES)
    config = _config(args, config_kw)
    settings = replace(settings, model=config)
    mesh = build_mesh(settings.shape, rank)
    run = train.Run(settings=settings, mesh=mesh, config=config, device=device, seed=0,
                    compute_dtype=torch.float64, param_dtype=torch.float64, master_dtype=torch.float64)
    torch.manual_seed(rank // mesh.size("tp"))  # as train.py: a TP group draws alike
    return train.compose(run)


def _run_case(rank, world, flags, config_kw, global_batch, micro, stop=STEPS, save_root=None, resume_root=None,
              trace=False):
    """Train steps [start, stop) on the mesh the flags give; save a checkpoint at `stop` into save_root, or
    start from the newest one in resume_root (saved on another mesh: the checkpoint reslices). With `trace`,
    also ({(op, group): (calls, payload)} traced per step, train.predicted_messages of the traced steps)."""
    import report.run
    run = composed_run(rank, world, flags, config_kw, global_batch, micro, harness.device())
    losses, traced = harness.traced_steps(run, STEPS, global_batch, SEQ, micro, CLIP, stop, save_root, resume_root)
    messages = (traced, report.run.predicted_messages(run, len(losses))) if trace else None
    infos = {p.shard_info.global_name: p.shard_info for p in run.model.parameters()}
    if hasattr(run.layout, "full_parameters"):  # ZeRO: the working weights (at stage 3 gathered back)
        held = run.layout.full_parameters()
    else:
        held = {p.shard_info.global_name: p.detach().clone() for p in run.model.parameters()}
    params = {name: (held[name], infos[name]) for name in held}
    return (losses, params, messages) if trace else (losses, params)


def _check(results, flags, config_kw, global_batch, micro):
    micro_batches_total = global_batch // micro  # D·m: the reference cuts the global batch alike (aux losses)
    args = _parse(flags, global_batch, micro)
    ref_losses, ref_norms, ref_params = reference_run(_config(args, config_kw),
                                                      global_batches(STEPS, global_batch, SEQ), clip=CLIP,
                                                      micro_batches=micro_batches_total, fp8_recipe=args.fp8,
                                                      precision_recipe=args.precision_recipe)
    assert min(ref_norms) > CLIP  # clipping is active
    assert_runs_follow(results, ref_losses, ref_params, TOL)


def _cases(rank, world, cases):
    return [_run_case(rank, world, *case) for case in cases]


# (flags, config overrides, global batch, B_μ): D·m micro-batches in the reference = global batch / B_μ.
PIPELINE_4 = [
    (["--pp", "2", "--pp-schedule", "1f1b"], dict(n_layer=2), 8, 1),  # 2×2 with DP, m = 4 = 2P
    (["--pp", "2", "--pp-schedule", "gpipe"], dict(n_layer=2), 6, 1),  # m = 3, not a multiple of P
    (["--pp", "2", "--pp-schedule", "interleaved"], dict(n_layer=4), 8, 2),  # m = P, v = 2
    (["--pp", "2", "--pp-schedule", "zb"], dict(n_layer=2), 8, 1),
    (["--pp", "2", "--pp-schedule", "1f1b", "--zero", "1"], dict(n_layer=2), 8, 1),  # ZeRO-1: the tied unit
    (["--pp", "2", "--tp", "2", "--pp-schedule", "zb"], dict(n_layer=2), 4, 1),  # 2×2 with TP
    (["--pp", "2", "--tp", "2", "--sp", "--pp-schedule", "interleaved"], dict(n_layer=4), 4, 1),
    (["--pp", "4", "--pp-schedule", "1f1b"], dict(n_layer=4), 5, 1),  # P = 4, m = 5
    (["--pp", "4", "--pp-schedule", "zb"], dict(n_layer=4), 8, 1),  # P = 4, m = 2P
]
CONTEXT_4 = [
    (["--cp", "2", "--cp-impl", "ring"], {}, 4, 1),  # 2×2 with DP
    (["--cp", "2", "--cp-impl", "ulysses"], {}, 4, 1),
    (["--cp", "2", "--cp-impl", "ring", "--cp-balance", "contiguous", "--zero", "3"], {}, 4, 1),
    (["--cp", "2", "--tp", "2", "--cp-impl", "ring"], {}, 4, 2),  # 2×2 with TP
    (["--cp", "2", "--pp", "2", "--cp-impl", "ring"], {}, 4, 2),  # with PP
    (["--cp", "4", "--cp-impl", "ring"], {}, 2, 1),
    (["--cp", "4", "--cp-impl", "ulysses"], {}, 2, 1),
]
FP8_4 = [  # the quantised values are the same on every mesh because the scales are (amax MAX over the pieces)
    (["--fp8", "current", "--tp", "2"], {}, 4, 1),
    (["--fp8", "delayed", "--tp", "2", "--sp"], {}, 4, 1),
    (["--fp8", "delayed", "--pp", "2", "--zero", "1"], dict(n_layer=2), 4, 1),
    (["--fp8", "delayed", "--pp", "2", "--pp-schedule", "zb"], dict(n_layer=2), 4, 1),  # FP8 defers its own W
    (["--fp8", "current", "--cp", "2"], {}, 4, 2),
    (["--fp8", "current", "--zero", "3"], {}, 8, 1),  # ZeRO-3 gathers the FP8 weights as E4M3 bytes
    (["--fp8", "delayed", "--zero", "3", "--tp", "2"], {}, 4, 1),
]
EXPERTS_4 = [
    (["--moe-experts", "4", "--ep", "2"], {}, 8, 1),  # D = 4, E = 2, dropless
    (["--moe-experts", "4", "--ep", "4", "--moe-capacity-factor", "1.0"], {}, 8, 2),  # E = 4, capacity
    (["--moe-experts", "4", "--ep", "2", "--zero", "1"], {}, 8, 1),
    (["--moe-experts", "4", "--ep", "2", "--zero", "3"], {}, 8, 1),
    (["--moe-experts", "4", "--ep", "2", "--tp", "2", "--sp"], {}, 4, 1),  # 2×2 with TP (experts whole on tp)
    (["--moe-experts", "4", "--ep", "2", "--cp", "2"], {}, 4, 1),  # aux statistics over the CP pieces
]


@pytest.mark.slow
@pytest.mark.parametrize("name,cases", [("pipeline", PIPELINE_4), ("context", CONTEXT_4), ("experts", EXPERTS_4),
                                        ("fp8", FP8_4)])
def test_composed_run_matches_single_device(name, cases):
    results = run_ranks(_cases, 4, cases, timeout=600)
    for index, case in enumerate(cases):
        _check([rank_results[index] for rank_results in results], *case)


# Experts inside pipeline stages: P = 2 × D = 2 with E = 2 over each stage's data ranks, so every F and B/I of
# a MoE chunk runs its expert all-to-alls on ep, and each stage's router losses (coefficients raised so they
# shape the update) backpropagate through the stages with the chunk's output.
AUX = ["--moe-aux-coef", "0.1", "--moe-z-coef", "0.01"]
PIPELINE_EXPERTS_4 = [
    (["--pp", "2", "--moe-experts", "4", "--ep", "2", *AUX], dict(n_layer=2), 8, 1),  # 1f1b, m = 4
    (["--pp", "2", "--pp-schedule", "zb", "--moe-experts", "4", "--ep", "2", "--moe-capacity-factor", "1.0", *AUX],
     dict(n_layer=2), 6, 1),  # zb defers the experts' weight gradients; capacity drops slots; m = 3
    (["--pp", "2", "--pp-schedule", "interleaved", "--moe-experts", "4", "--ep", "2", "--zero", "1", *AUX],
     dict(n_layer=4), 8, 2),  # v = 2: two MoE chunks per stage; ZeRO-1
]


def _traced_cases(rank, world, cases):
    return [_run_case(rank, world, *case, trace=True) for case in cases]


@pytest.mark.slow
def test_pipeline_with_experts_matches_single_device_and_traces_as_predicted():
    """PP + MoE: the update equals the single device's (1e-10, float64), and every message of the traced steps
    (p2p and loss over pp, the all-to-alls over ep, the layout's, the update's) equals report.run.predicted_messages."""
    results = run_ranks(_traced_cases, 4, PIPELINE_EXPERTS_4, timeout=600)
    for index, case in enumerate(PIPELINE_EXPERTS_4):
        per_rank = [rank_results[index] for rank_results in results]
        _check(per_rank, *case)
        for rank, (_, _, (traced, predicted)) in enumerate(per_rank):
            ep = next(group for op, group in traced if op == "all_to_all_single")  # ep's communicator is dp's
            sends = [group for op, group in traced if op == "send"]  # pp's communicator is pp_tied's at P = 2
            assert "ep" in ep.split("=") and sends and "pp" in sends[0].split("="), (case, rank, traced)
            assert set(traced) == set(predicted), (case, rank, set(traced) ^ set(predicted))
            for key, (calls, payload) in predicted.items():
                assert traced[key] == pytest.approx((calls, payload), abs=1e-9), (case, rank, key)


# FP8 under ZeRO-3 × PP (parallel/zero_pipeline.py): each chunk's FP8 weights are a unit of their own, gathered as E4M3
# codes once per run of the chunk's actions, each gather adding its scale agreement (a MAX all_reduce of 4 bytes a
# weight over dp_cp): what --plan and --plan-search count (tests/planner/test_plan.py).
FP8_ZERO3_PIPELINE_4 = [
    (["--fp8", "current", "--pp", "2", "--zero", "3"], dict(n_layer=2), 8, 1),
    (["--fp8", "delayed", "--pp", "2", "--pp-schedule", "interleaved", "--zero", "3"], dict(n_layer=4), 8, 2),
]


@pytest.mark.slow
def test_fp8_zero3_under_a_pipeline_matches_single_device_and_traces_as_predicted():
    """The update equals the single device's under the same recipe (1e-10, float64: the gathered codes decode to
    the weights' own FP8 values), and every traced message equals report.run.predicted_messages."""
    results = run_ranks(_traced_cases, 4, FP8_ZERO3_PIPELINE_4, timeout=300)
    for index, case in enumerate(FP8_ZERO3_PIPELINE_4):
        per_rank = [rank_results[index] for rank_results in results]
        _check(per_rank, *case)
        for rank, (_, _, (traced, predicted)) in enumerate(per_rank):
            assert set(traced) == set(predicted), (case, rank, set(traced) ^ set(predicted))
            for key, (calls, payload) in predicted.items():
                assert traced[key] == pytest.approx((calls, payload), abs=1e-9), (case, rank, key)


# Selective recompute (parallel/recompute.py) with the layouts whose forward sends messages inside a block: the policy
# keeps each collective's output (parallel/collectives.py), so the recompute sends nothing and the traced messages are
# those of a run without recompute; the reference is the plain single-device model (no recompute).
SELECTIVE = ["--activation-checkpointing", "selective"]
SELECTIVE_2 = [
    (["--tp", "2", *SELECTIVE], dict(selective_recompute=True), 2, 1),
    (["--tp", "2", "--sp", *SELECTIVE], dict(selective_recompute=True), 2, 1),
    (["--cp", "2", "--cp-impl", "ulysses", *SELECTIVE], dict(selective_recompute=True), 2, 1),
    # MoE blocks by halves (model.Block): the routing, the dispatch and its all-to-alls run once; DeepSeek-V3's
    # router (sigmoid scores, the learned bias, the seq loss, groups) and a shared expert
    (["--moe-experts", "4", "--ep", "2", "--moe-shared-experts", "1", "--moe-score", "sigmoid", "--moe-bias-rate",
      "0.01", "--moe-seq-aux-coef", "0.01", "--moe-groups", "2", "--moe-group-limit", "1", *AUX, *SELECTIVE],
     dict(selective_recompute=True), 4, 1),
    (["--tp", "2", "--sp", "--moe-experts", "4", "--moe-capacity-factor", "1.0", "--moe-shared-experts", "1", *AUX,
      *SELECTIVE], dict(selective_recompute=True), 2, 1),  # capacity decided on the whole micro-batch
    (["--zero", "3", "--moe-experts", "4", "--ep", "2", "--moe-every", "2", *AUX, *SELECTIVE],
     dict(selective_recompute=True), 4, 1),  # the attention side's recompute reads the unit gathered for backward
    (["--pp", "2", "--moe-experts", "4", *AUX, *SELECTIVE], dict(n_layer=2, selective_recompute=True), 4, 1),
]
SELECTIVE_QUANTISED_2 = [
    # FP8: the amax MAX over tp (and cp) an operator the policy keeps (collective_ops), the GEMM output kept;
    # the recompute records no amax (delayed: the history is the forward's) and sends nothing
    (["--fp8", "current", "--tp", "2", "--moe-experts", "4", *AUX, *SELECTIVE], dict(selective_recompute=True), 4,
     1),
    (["--fp8", "delayed", "--tp", "2", "--sp", *SELECTIVE], dict(selective_recompute=True), 4, 1),
    (["--fp8", "blockwise", *SELECTIVE], dict(selective_recompute=True), 4, 1),
    (["--fp8", "current", "--zero", "3", *SELECTIVE], dict(selective_recompute=True), 8, 1),  # E4M3 gathers
    # a precision recipe alike: NVFP4's tensor amax MAX over tp kept, SR's draws keyed by the forward's micro-batch
    (["--precision-recipe", "nvfp4,tail=0", "--tp", "2", *SELECTIVE], dict(n_embd=64, selective_recompute=True), 4,
     2),
]


def _check_selective(cases):
    results = run_ranks(_traced_cases, 2, cases, timeout=300)
    for index, (flags, config_kw, global_batch, micro) in enumerate(cases):
        per_rank = [rank_results[index] for rank_results in results]
        plain = {k: v for k, v in config_kw.items() if k != "selective_recompute"}
        _check(per_rank, flags, plain, global_batch, micro)
        for rank, (_, _, (traced, predicted)) in enumerate(per_rank):
            assert set(traced) == set(predicted), (flags, rank, set(traced) ^ set(predicted))
            for key, (calls, payload) in predicted.items():
                assert traced[key] == pytest.approx((calls, payload), abs=1e-9), (flags, rank, key, traced[key])


@pytest.mark.slow
def test_selective_recompute_composes_and_traces_as_predicted():
    """TP, TP + SP, Ulysses and MoE (EP, TP + SP, ZeRO-3, PP) under selective recompute: float64 updates equal the
    plain single-device model's (1e-10), and every traced message equals report.run.predicted_messages (no collective
    sent again in backward: no all-to-all of a MoE block, whose routing runs once)."""
    _check_selective(SELECTIVE_2)


@pytest.mark.slow
def test_selective_recompute_with_fp8_and_a_precision_recipe_composes_and_traces_as_predicted():
    """FP8 (its three recipes) and NVFP4 under selective recompute: float64 updates equal the single device's
    run of the same recipe without recompute (1e-10), and every traced message equals the prediction (no second
    amax all-reduce: the recompute reads the kept one)."""
    _check_selective(SELECTIVE_QUANTISED_2)


# Resharding: (the mesh that saves after SAVE_AT steps, the mesh that resumes and trains to the end).
SAVE_AT = 2
RESHARD_4 = [
    ((["--fp8", "delayed", "--tp", "2", "--zero", "1"], {}, 4, 1), (["--fp8", "delayed", "--zero", "3"], {}, 4, 1)),
    ((["--pp", "2"], dict(n_layer=4), 8, 1), (["--pp", "4", "--pp-schedule", "zb"], dict(n_layer=4), 8, 1)),
    ((["--pp", "2", "--pp-schedule", "interleaved"], dict(n_layer=4), 8, 2), ([], dict(n_layer=4), 8, 2)),
    ((["--cp", "2", "--zero", "1"], {}, 4, 1), (["--cp", "4", "--cp-impl", "ulysses"], {}, 4, 1)),
    ((["--moe-experts", "4", "--ep", "2", "--zero", "3"], {}, 8, 1), (["--moe-experts", "4", "--ep", "4"], {}, 8, 1)),
]


def _reshard(rank, world, cases, root):
    import os

    out = []
    for index, (saving, resuming) in enumerate(cases):
        directory = os.path.join(root, str(index))
        _run_case(rank, world, *saving, stop=SAVE_AT, save_root=directory)
        out.append(_run_case(rank, world, *resuming, resume_root=directory))
    return out


@pytest.mark.slow
def test_a_run_resumed_on_another_mesh_matches_the_uninterrupted_one(tmp_path):
    """Saved on P=2 and resumed on P=4 (and on no pipeline), saved on C=2 and resumed on C=4, saved on E=2 and
    resumed on E=4, FP8 delayed saved on T=2 (ZeRO-1) and resumed on D=4 (ZeRO-3: the amax histories come back):
    the resumed steps and the final parameters equal the single device's uninterrupted run."""
    results = run_ranks(_reshard, 4, RESHARD_4, str(tmp_path), timeout=600)
    for index, (_, resuming) in enumerate(RESHARD_4):
        per_rank = [rank_results[index] for rank_results in results]
        assert all(sorted(losses) == list(range(SAVE_AT, STEPS)) for losses, _ in per_rank)
        _check(per_rank, *resuming)
