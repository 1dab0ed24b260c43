"""optimizers/zero_muon.py: Muon under ZeRO-1/2/3, gathered and owner-shaped, follows the one-process Muon run, sends
and holds what it predicts, and resumes on another mesh with each momentum moving with its matrix.

Every case is built as train.main builds it (tests/test_composition.py's `composed_run`, --optimizer muon) in
float64 (Newton-Schulz in float64 too), trained 3 steps with step.train_step on tests/reference.py's batches
(clipping active, 2 micro-batches a rank, --bucket-mb 0.02: stage 1/2 units of one or two matrices, so that most
owners' slices of a unit are empty), and compared with torch's Muon + AdamW on one device (reference_run with
muon_lr, NS in float64), 1e-10 on every loss and parameter; every traced (collective, group) of a step equals
report.run.predicted_messages (the owner's reduces and broadcasts, the gather's U all-gather, TP's gathers), and
the bytes held equal the prediction on every rank (owner: uneven by rank).
Quick (2 ranks, one spawn): ZeRO-3, each way. Slow (4 ranks): ZeRO-1/2/3 × both ways at D = 4, with TP
(T = 2), with PP (P = 2; ZeRO-2/3 under the pipeline's layouts), and three resumes on another mesh.
"""

import os

import pytest

import harness
from harness import assert_runs_follow, run_ranks
from reference import MUON, global_batches, make_config, reference_run
from test_composition import composed_run
from test_muon import MUON_FLAGS, assert_traced_as_predicted

STEPS, SEQ, CLIP, TOL = 3, 16, 0.05, 1e-10
OWNER = ["--muon-owner"]


def _case(rank, world, flags, config_kw, global_batch, micro, stop=STEPS, save_root=None, resume_root=None):
    import torch.distributed as dist

    import report.muon
    import report.run

    run = composed_run(rank, world, [*MUON_FLAGS, *flags], config_kw, global_batch, micro, harness.device())
    losses, traced = harness.traced_steps(run, STEPS, global_batch, SEQ, micro, CLIP, stop, save_root, resume_root)
    infos = {p.shard_info.global_name: p.shard_info for p in run.model.parameters()}
    held = (run.layout.full_parameters() if hasattr(run.layout, "full_parameters")  # ZeRO (stage 3: gathered)
            else {p.shard_info.global_name: p.detach().clone() for p in run.model.parameters()})
    predicted = report.run.predicted_messages(run, len(losses))
    flops = (run.flops.hardware, report.muon.with_newton_schulz(run).hardware, run.tokens_per_step)
    return dict(lines=report.muon.startup_lines(run.layout.facts().muon), flops=flops, losses=losses,
                params={name: (held[name], infos[name]) for name in held}, traced=traced,
                predicted={key: tuple(count) for key, count in predicted.items()}, held=run.layout.held_bytes(),
                persistent=run.layout.predicted_persistent(), facts=run.layout.facts().muon,
                dp_rank=dist.get_rank(run.mesh.group("dp_cp")))


def _cases(rank, world, cases):
    return [_case(rank, world, *case) for case in cases]


def check(per_rank: list, flags, config_kw, global_batch, micro) -> None:
    """The float64 run follows the one-process Muon run (1e-10); traced = predicted; held = predicted."""
    reference = reference_run(make_config(**config_kw), global_batches(STEPS, global_batch, SEQ), clip=CLIP,
                              micro_batches=global_batch // micro, muon_lr=MUON["lr"])
    assert min(reference[1]) > CLIP  # clipping is active
    assert_runs_follow([(r["losses"], r["params"]) for r in per_rank], reference[0], reference[2], TOL)
    for rank, r in enumerate(per_rank):
        assert_traced_as_predicted(r["traced"], r["predicted"], (flags, rank))
        assert r["held"] == r["persistent"], (flags, rank, r["held"], r["persistent"])
        facts = r["facts"]
        assert facts.way == ("owner" if "--muon-owner" in flags else "gather")
        assert facts.held_by_rank[r["dp_rank"]] == r["held"]["total"], (flags, rank)  # this rank's, as all see it


# (flags, config, global batch, B_μ): 2 micro-batches per data rank
QUICK_2 = [(["--zero", "3"], {}, 4, 1), (["--zero", "3", *OWNER], {}, 4, 1)]


@pytest.fixture(scope="module")
def quick_runs():
    return run_ranks(_cases, 2, QUICK_2, timeout=300)


def test_zero3_both_ways_follows_the_one_process_muon_run(quick_runs):
    for index, case in enumerate(QUICK_2):
        check([r[index] for r in quick_runs], *case)


def test_owner_sends_reduces_and_broadcasts_and_no_gather_of_the_update(quick_runs):
    """Owner: the matrices' gradients go by reduce and their weights by broadcast (stage 3: per gather), and no
    all_gather carries U; gather: U's all_gather_single adds b_ns·n' per matrix unit to zero.py's."""
    gather, owner = ({key[0] for key in quick_runs[0][i]["traced"]} for i in (0, 1))
    assert {"reduce", "broadcast"} <= owner and not {"reduce", "broadcast"} & gather
    gathered = [quick_runs[0][i]["traced"][("all_gather_single", "dp=dp_cp=expert_dp")][1] for i in (0, 1)]
    assert gathered[0] > gathered[1]  # stage 3: the gather way's weights and U; the owner's 1-D units only


def test_the_owner_holds_whole_matrices_and_says_its_imbalance(quick_runs):
    """Each rank of an owner run holds the bytes its facts say; the NS work of the stage is done once (the
    ranks' NS FLOPs add up to every matrix once); the gather way's ranks together do at least that."""
    for index in (1,):
        facts = [r[index]["facts"] for r in quick_runs]
        assert [f.held_by_rank for f in facts] == [facts[0].held_by_rank] * 2
        assert [r[index]["held"]["total"] for r in quick_runs] == list(facts[0].held_by_rank)
        assert sum(facts[0].ns_flops_by_rank) == facts[0].ns_flops_stage
        assert [f.ns_flops for f in facts] == list(facts[0].ns_flops_by_rank)
    gather = quick_runs[0][0]["facts"]
    assert sum(gather.ns_flops_by_rank) >= gather.ns_flops_stage


def test_the_startup_lines_say_the_way_the_imbalance_and_the_update_messages(quick_runs):
    """report/muon.py's lines: the way, NS FLOPs by rank, the persistent bytes' max/mean (owner: uneven, printed
    to 3 places from the same figures every rank has), and the gather way's U all-gather as the update's own."""
    from optimizers.muon import imbalance

    gather, owner = (quick_runs[0][i]["lines"] for i in (0, 1))
    assert "ZeRO, gather" in gather[1] and "ZeRO, owner-shaped" in owner[1]
    held = quick_runs[0][1]["facts"].held_by_rank
    assert any(f"owner imbalance max/mean {imbalance(held):.3f}" in line for line in owner)
    assert any("the update's own all_gather_single dp_cp" in line for line in gather)
    assert not any("the update's own" in line for line in owner)  # one rank per TP group: nothing of its own


def test_the_hardware_flops_add_the_worlds_newton_schulz(quick_runs):
    """HFU's FLOPs per token gain every rank's NS FLOPs of a step over the step's tokens; MFU's are untouched."""
    for index in (0, 1):
        world_ns = sum(r[index]["facts"].ns_flops for r in quick_runs)
        for r in quick_runs:
            before, after, tokens = r[index]["flops"]
            assert after - before == pytest.approx(world_ns / tokens, rel=1e-12) and world_ns > 0


def test_assign_owners_balances_newton_schulz_cost_then_bytes():
    from optimizers.zero_muon import assign_owners

    loads = [[0.0, 0] for _ in range(3)]
    assert assign_owners([4.0, 4.0, 3.0, 1.0], [4, 4, 3, 1], loads) == [0, 1, 2, 2]  # LPT: 4 | 4 | 3 + 1
    assert assign_owners([4.0], [4], loads) == [0]  # carried over: the next unit's goes to the least loaded
    assert [load[0] for load in loads] == [8.0, 4.0, 4.0]
    empty = [[0.0, 0] for _ in range(4)]
    assert sorted(assign_owners([2.0, 1.0], [2, 1], empty)) == [0, 1]  # ranks 2, 3 own nothing: empty slices


# ---------------------------------------------------------------------------------------------------------
# 4 ranks: D = 4 at every stage both ways, with TP and with PP; then resumes on another mesh
# ---------------------------------------------------------------------------------------------------------

WAYS_4 = [([*way, "--zero", str(stage)], {}, 8, 1) for stage in (1, 2, 3) for way in ([], OWNER)]
COMPOSED_4 = [
    (["--tp", "2", "--zero", "1"], {}, 4, 1), (["--tp", "2", "--zero", "3", *OWNER], {}, 4, 1),
    (["--tp", "2", "--sp", "--zero", "2", *OWNER], {}, 4, 1),
    (["--pp", "2", "--zero", "1", *OWNER], dict(n_layer=2), 8, 1),
    (["--pp", "2", "--pp-schedule", "zb", "--zero", "2"], dict(n_layer=2), 8, 1),
    (["--pp", "2", "--pp-schedule", "interleaved", "--zero", "3", *OWNER], dict(n_layer=4), 8, 2),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,cases", [("ways", WAYS_4), ("tp and pp", COMPOSED_4)])
def test_every_stage_both_ways_with_tp_and_pp_follows_the_one_process_muon_run(name, cases):
    results = run_ranks(_cases, 4, cases, timeout=900)
    for index, case in enumerate(cases):
        check([r[index] for r in results], *case)


SAVE_AT = 2
RESHARD_4 = [  # (the mesh that saves after SAVE_AT steps, the mesh that resumes): the owners change
    ((["--zero", "3", *OWNER], {}, 8, 1), (["--tp", "2", "--zero", "1", *OWNER], {}, 8, 1)),
    ((["--zero", "2"], {}, 8, 1), (["--pp", "2", "--zero", "3", *OWNER], dict(n_layer=2), 8, 1)),
    ((["--tp", "2"], {}, 8, 1), (["--zero", "2", *OWNER], {}, 8, 1)),  # DDP's whole momenta into owners' slices
]


def _reshard(rank, world, cases, root):
    out = []
    for index, (saving, resuming) in enumerate(cases):
        directory = os.path.join(root, str(index))
        _case(rank, world, *saving, stop=SAVE_AT, save_root=directory)
        out.append(_case(rank, world, *resuming, resume_root=directory))
    return out


@pytest.mark.slow
def test_a_muon_run_resumed_on_another_mesh_follows_the_uninterrupted_one(tmp_path):
    """Saved on D = 4 owner ZeRO-3 and resumed on T = 2 × D = 2 owner ZeRO-1; saved on D = 4 gather ZeRO-2 and
    resumed on P = 2 × D = 2 owner ZeRO-3; saved by DDP on T = 2 and resumed on D = 4 owner ZeRO-2: the resumed
    step and the final parameters equal the one-process uninterrupted run (the momenta moved with their
    matrices: a lost or misplaced momentum changes the step by far more than 1e-10)."""
    results = run_ranks(_reshard, 4, RESHARD_4, str(tmp_path), timeout=900)
    for index, (_, resuming) in enumerate(RESHARD_4):
        per_rank = [r[index] for r in results]
        assert all(sorted(r["losses"]) == list(range(SAVE_AT, STEPS)) for r in per_rank)
        check(per_rank, *resuming)
