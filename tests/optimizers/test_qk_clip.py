"""optimizers/qk_clip.py: MuonClip's QK-clip (`--qk-clip τ`) on one process by hand, and through train.compose.

1. One process, float64, the hooks and the clip alone (no update between): after a forward that records, every
   head whose largest causal logit S exceeded τ has its q and k rows (weight and bias) multiplied by √(τ/S), so its
   recomputed S is τ (1e-12); every other head's rows, and every v row, are bitwise untouched; a master piece
   that aliases the weight (ZeRO's, when the dtypes agree) is scaled once; a skipped step clips nothing.
2. Through the harness (2 ranks, one spawn): DDP (D = 2), ZeRO-3 (D = 2) and TP (T = 2) with --qk-clip follow
   the one-process run clipped by hand (tests/reference.py's `watch`: hooks on c_attn, the logits written out
   head by head, the rows scaled) in float64 to 1e-10, with
   τ between the heads' logits so that some heads clip and some do not; every traced (collective, group) of a
   step is report.run.predicted_messages (the maxima's one all-reduce over dp_cp; none over tp).
   Slow (4 ranks, one spawn): PP (P = 2 × D = 2, ZeRO-2's pipeline layout), TP with SP (T = 2 × D = 2, ZeRO-1),
   Muon at ZeRO-3 gathered and at ZeRO-1 owner-shaped (D = 4), full activation checkpointing (D = 4), alike.
The flag's refusals (τ ≤ 0, a non-number, --cp > 1): one line naming --qk-clip, exit 2.
"""

import math

import pytest
import torch

import harness
from harness import assert_runs_follow, run_ranks
from reference import MUON, build_model, global_batches, make_config, reference_run
from test_composition import composed_run
from test_muon import MUON_FLAGS, assert_traced_as_predicted

STEPS, SEQ, CLIP, TOL = 3, 16, 0.05, 1e-10
TAU = 0.045  # the tests' model at init: its 8 heads' S in [0.034, 0.055] on these batches, about half above


def hand_logits(qkv: torch.Tensor, n_head: int) -> list:
    """[S of each head] from c_attn's output, written out: q_h·k_h / √d over j ≤ i, max over batch, i, j."""
    width = qkv.shape[-1] // 3
    d = width // n_head
    seq = qkv.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    out = []
    for h in range(n_head):
        q, k = qkv[..., h * d:(h + 1) * d], qkv[..., width + h * d:width + (h + 1) * d]
        logits = torch.einsum("bid,bjd->bij", q, k) / math.sqrt(d)
        out.append(float(logits[:, causal].max()))
    return out


def hand_clip(tau: float, n_head: int):
    """reference_run's `watch`: hooks record each c_attn's S over the step; after the update, the rows scaled."""
    def watch(model):
        step_max = {}

        def record(block):
            def hook(module, args, out):
                if torch.is_grad_enabled():
                    now = hand_logits(out.detach(), n_head)
                    step_max[block] = [max(a, b) for a, b in zip(step_max.get(block, now), now)]
            return hook

        for block in model.transformer.h:
            block.attn.c_attn.register_forward_hook(record(block))

        @torch.no_grad()
        def after_update():
            for block, maxima in step_max.items():
                c_attn, width = block.attn.c_attn, block.attn.c_attn.weight.shape[0] // 3
                d = width // n_head
                for h, s in enumerate(maxima):
                    if s > tau:
                        for start in (h * d, width + h * d):
                            c_attn.weight[start:start + d] *= math.sqrt(tau / s)
                            c_attn.bias[start:start + d] *= math.sqrt(tau / s)
                        clipped.append(h)
            step_max.clear()

        return after_update

    clipped = []
    return watch, clipped


# ---------------------------------------------------------------------------------------------------------
# 1. One process: the clip by hand
# ---------------------------------------------------------------------------------------------------------


def test_a_clipped_head_recomputes_to_tau_and_the_others_are_untouched():
    from optimizers.qk_clip import QKClip, QKClipConfig
    from shard import StatePiece, describe

    config = make_config()
    model = describe(build_model(config, seed=0, dtype=torch.float64))
    clip = QKClip(QKClipConfig(TAU), model, dtype=torch.float64)
    outputs, inputs = [], []
    for block in model.transformer.h:
        block.attn.c_attn.register_forward_hook(lambda module, args, out: outputs.append(out.detach()))
        block.attn.c_attn.register_forward_pre_hook(lambda module, args: inputs.append(args[0].detach()))

    class Pieces:  # the layout's pieces: each weight, and an aliasing master of each (scaled once)
        def state_pieces(self):
            params = [p for p in model.parameters()]
            return [StatePiece(f"{kind}/{p.shard_info.global_name}", p.data, p.shard_info)
                    for kind in ("master", "param") for p in params]

    x, y = global_batches(1, 4, SEQ)[0]
    model(x, y)
    before = [hand_logits(out, config.n_head) for out in outputs]
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    clip.after_update(Pieces(), skipped=True)  # a skipped step: nothing moves
    assert all(torch.equal(weights[name], p) for name, p in model.named_parameters())
    model(x, y)  # the same step again, recorded (the maxima restarted)
    clip.after_update(Pieces(), skipped=False)
    assert clip.facts().clipped_last_step == sum(s > TAU for layer in before for s in layer)
    assert 0 < clip.facts().clipped_last_step < 2 * config.n_head  # some heads clip, some do not
    with torch.no_grad():  # each layer's new q and k of the same input (a later layer's input moved too)
        after = [hand_logits(block.attn.c_attn(inputs[layer]), config.n_head)  # inputs[0:2]: the first forward's
                 for layer, block in enumerate(model.transformer.h)]
    width, d = config.n_embd, config.n_embd // config.n_head
    for layer, block in enumerate(model.transformer.h):
        name = f"transformer.h.{layer}.attn.c_attn"
        w, b = weights[f"{name}.weight"], weights[f"{name}.bias"]
        expected_w, expected_b = w.clone(), b.clone()
        for h, s in enumerate(before[layer]):
            if s > TAU:
                assert after[layer][h] == pytest.approx(TAU, rel=1e-12, abs=0), (layer, h)
                for start in (h * d, width + h * d):
                    expected_w[start:start + d] *= math.sqrt(TAU / s)
                    expected_b[start:start + d] *= math.sqrt(TAU / s)
            else:
                assert after[layer][h] == before[layer][h], (layer, h)  # untouched: bitwise
        torch.testing.assert_close(block.attn.c_attn.weight, expected_w, rtol=1e-15, atol=0)
        torch.testing.assert_close(block.attn.c_attn.bias, expected_b, rtol=1e-15, atol=0)
        assert torch.equal(block.attn.c_attn.weight[2 * width:], w[2 * width:])  # v's rows
    others = [name for name in weights if ".c_attn." not in name]
    assert all(torch.equal(weights[name], dict(model.named_parameters())[name]) for name in others)


# ---------------------------------------------------------------------------------------------------------
# 2. DDP, ZeRO-3 and TP through train.compose, against the hand-clipped run
# ---------------------------------------------------------------------------------------------------------

CASES = [([], 4, 1), (["--zero", "3"], 4, 1), (["--tp", "2"], 4, 1)]  # (flags, global batch, B_μ): D·m = 4


def _case(rank, world, flags, global_batch, micro):
    import report.muon
    import report.run

    run = composed_run(rank, world, ["--qk-clip", str(TAU), *flags], {}, global_batch, micro, harness.device())
    losses, traced = harness.traced_steps(run, STEPS, global_batch, SEQ, micro, CLIP, STEPS)
    infos = {p.shard_info.global_name: p.shard_info for p in run.model.parameters()}
    held = (run.layout.full_parameters() if hasattr(run.layout, "full_parameters")
            else {p.shard_info.global_name: p.detach().clone() for p in run.model.parameters()})
    predicted = report.run.predicted_messages(run, len(losses))
    axis = next(axis for axis in run.axes if axis.name == "qk_clip")
    return (losses, {name: (held[name], infos[name]) for name in held}, traced,
            {key: tuple(count) for key, count in predicted.items()},
            (axis.facts(), report.muon.qk_clip_startup_lines(axis) + report.muon.qk_clip_step_lines(axis)))


def _cases(rank, world):
    return [_case(rank, world, *case) for case in CASES]


@pytest.fixture(scope="module")
def quick_runs():
    return run_ranks(_cases, 2, timeout=300)


def assert_cases_follow_the_hand_clipped_run(cases, results) -> None:
    """Each case's ranks (results[rank][case]) follow the one-process run clipped by hand (`hand_clip`), to TOL,
    and send what they predict; the hand clip must have clipped some heads and left others."""
    config = make_config()
    for index, (flags, global_batch, micro) in enumerate(cases):
        watch, clipped = hand_clip(TAU, config.n_head)
        muon_lr = MUON["lr"] if "muon" in flags else None
        reference = reference_run(config, global_batches(STEPS, global_batch, SEQ), clip=CLIP,
                                  micro_batches=global_batch // micro, muon_lr=muon_lr, watch=watch)
        assert 0 < len(clipped) < STEPS * config.n_layer * config.n_head, (flags, clipped)  # some clip, some not
        per_rank = [r[index] for r in results]
        assert_runs_follow([(losses, params) for losses, params, *_ in per_rank], reference[0], reference[2], TOL)
        for rank, (_, _, traced, predicted, _) in enumerate(per_rank):
            assert_traced_as_predicted(traced, predicted, (flags, rank))


def test_ddp_zero3_and_tp_follow_the_hand_clipped_run_and_send_what_they_predict(quick_runs):
    assert_cases_follow_the_hand_clipped_run(CASES, quick_runs)


def test_the_lines_say_the_heads_and_the_one_message(quick_runs):
    """report/muon.py's qk-clip lines: the heads a rank watches (TP: half), the maxima's one message (float64 here:
    8 bytes a head; none with one data-parallel rank), the last step's clips."""
    import mfu

    config = make_config()
    for index, (flags, _, _) in enumerate(CASES):
        for *_, (facts, lines) in [r[index] for r in quick_runs]:
            heads = config.n_layer * config.n_head // (2 if "--tp" in flags else 1)
            data_ranks = 1 if "--tp" in flags else 2
            assert facts.heads == heads and facts.message_bytes == (8 * heads if data_ranks > 1 else 0), (flags, facts)
            if data_ranks > 1:
                assert f"one all-reduce (MAX) of {mfu.format_bytes(facts.message_bytes)}" in lines[0], lines
            assert f"{heads} heads watched" in lines[0] and f"of {heads} heads clipped" in lines[1], lines
            assert 0 <= facts.clipped_last_step <= heads and facts.clipped_total >= facts.clipped_last_step


@pytest.mark.parametrize("flags, world, message", [
    (["--qk-clip", "0"], 1, "--qk-clip must be a positive number, got 0.0"),
    (["--qk-clip", "-1"], 1, "--qk-clip must be a positive number, got -1.0"),
    (["--qk-clip", "nan"], 1, "--qk-clip must be a positive number, got nan"),
    (["--qk-clip", "abc"], 1, "--qk-clip: invalid float value"),
    (["--qk-clip", "1", "--cp", "2"], 2, "--qk-clip with --cp > 1: not served"),
])
def test_a_bad_value_is_one_line_naming_the_flag_and_exit_2(flags, world, message, refused):
    """As tests/test_train.py's bad inputs: flags.parse before any process group, exit 2, one line."""
    err = refused(flags, world)
    assert message in err, err


# ---------------------------------------------------------------------------------------------------------
# Slow (4 ranks, one spawn): PP under ZeRO-2's pipeline layout, TP with SP under ZeRO-1, Muon gathered (ZeRO-3)
# and owner-shaped (ZeRO-1), full activation checkpointing under DDP (D = 4: a recompute records nothing twice)
# ---------------------------------------------------------------------------------------------------------

SLOW_CASES = [(["--pp", "2", "--zero", "2"], 8, 1), (["--tp", "2", "--sp", "--zero", "1"], 4, 1),
              ([*MUON_FLAGS, "--zero", "3"], 8, 1), ([*MUON_FLAGS, "--zero", "1", "--muon-owner"], 8, 1),
              (["--activation-checkpointing", "full"], 8, 1)]


def _slow_cases(rank, world):
    return [_case(rank, world, *case) for case in SLOW_CASES]


@pytest.mark.slow
def test_pp_sp_muon_gather_and_recompute_follow_the_hand_clipped_run():
    assert_cases_follow_the_hand_clipped_run(SLOW_CASES, run_ranks(_slow_cases, 4, timeout=600))
