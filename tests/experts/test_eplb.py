"""experts/eplb.py: deepseek-ai/EPLB's placement on its README example, by hand on small cases; redundant experts in
training against the single-device model (float64, 1e-10) through train.compose and step.train_step: on 2 ranks
(E = 2) in the quick suite, on 4 (slow: E = 2 and 4, with TP and SP, CP, PP, ZeRO-1, 2 and 3), re-planned every
step so slots move, replicas bitwise equal, traced messages as predicted, checkpoints that resume on another E
and R, and on the same mesh bitwise (the placement and the load average are restart state); the flags' bad
inputs; and, through train.py (slow), the rows per EP rank falling with replicas under a skewed load while the
loss curve stays the one without replicas.
"""

import json
import math
import os
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

from harness import run_ranks, traced_steps
from test_composition import STEPS, _check, composed_run
from test_train import launch

# ---------------------------------------------------------------------------------------------------------
# The placement, one process
# ---------------------------------------------------------------------------------------------------------


def test_the_readme_example_gives_the_published_placement():
    """deepseek-ai/EPLB's README (github.com/deepseek-ai/EPLB, README.md, "Interface and Example"): 2 layers ×
    12 experts, 16 replicas, 4 groups, 2 nodes, 8 GPUs; its printed phy2log, copied here."""
    from experts import eplb

    weight = torch.tensor([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                           [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
    published = [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                  [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]
    phy2log, log2phy, logcnt = eplb.rebalance_experts(weight, 16, 4, 2, 8)
    assert phy2log.tolist() == published
    for layer in range(2):  # log2phy lists each expert's slots, logcnt counts them
        assert logcnt[layer].tolist() == [published[layer].count(i) for i in range(12)]
        for expert in range(12):
            slots = [s for s in log2phy[layer, expert].tolist() if s >= 0]
            assert sorted(slots) == [q for q, e in enumerate(published[layer]) if e == expert]


def test_balanced_packing_puts_the_heaviest_first_into_the_lightest_pack_with_room():
    from experts import eplb

    # 5 → pack 0, 4 → pack 1, 3 → pack 1 (4 < 5), 2 → pack 0: loads 7 and 7
    assert eplb.balanced_packing(torch.tensor([5.0, 4.0, 3.0, 2.0]), 2) == [(0, 0), (1, 0), (1, 1), (0, 1)]


def test_replicas_go_to_the_largest_load_per_replica():
    from experts import eplb

    # loads 10, 4, 1 and 5 slots: 10/1 → expert 0 gets slot 3; 10/2 = 5 > 4 → expert 0 again (10/3 < 4 then)
    assert eplb.replicate_experts(torch.tensor([10.0, 4.0, 1.0]), 5) == ([0, 1, 2, 0, 0], [0, 0, 0, 1, 2],
                                                                         [3, 1, 1])


def test_the_slots_routed_to_a_replicated_expert_take_turns_over_its_replicas():
    """N = 3, R = 4 on E = 2: expert 0 in slots 0 and 2. Its 1st, 2nd, 3rd slot (token order) go to replicas
    0, 1, 0; a dropped slot (N) goes past every slot (R); the load counts kept slots in training only."""
    from experts import eplb

    replicas = eplb.Replicas(3, 4, 2, 0, torch.device("cpu"))
    replicas.set_plan([0, 1, 0, 2], [0, 0, 1, 0], [2, 1, 1])
    logical = torch.tensor([0, 0, 1, 0, 2, 3])
    assert replicas.physical(logical, training=False).tolist() == [0, 2, 1, 0, 3, 4]
    assert replicas.step_load.tolist() == [0, 0, 0]
    replicas.physical(logical, training=True)
    assert replicas.step_load.tolist() == [3, 1, 1] and replicas.window.tolist() == [3, 1, 1, 3, 2]


def test_each_step_folds_its_load_into_the_moving_average_with_the_stated_decay():
    """load ← d·load + (1 − d)·the step's kept slots, d = --moe-load-decay, once per step (after_grad_sync);
    one rank, E = 1 (R = N: nothing to sum, nothing to re-place)."""
    from experts import eplb

    replicas = eplb.Replicas(4, 4, 1, 0, torch.device("cpu"))
    replicas.set_plan([0, 1, 2, 3], [0, 0, 0, 0], [1, 1, 1, 1])
    layer = SimpleNamespace(replicas=replicas, layer_id=0, experts=torch.nn.ModuleDict(),
                            load=SimpleNamespace(reduce=False))
    redundant = eplb.RedundantExperts([layer], replan_every=1, decay=0.75, groups={}, load_groups={})
    for step_load, expected in (([4, 0, 0, 0], [1, 0, 0, 0]), ([0, 4, 0, 0], [0.75, 1, 0, 0])):
        replicas.step_load += torch.tensor(step_load, dtype=torch.float64)
        redundant.after_grad_sync(layout=None)
        assert replicas.average.tolist() == expected and replicas.step_load.tolist() == [0, 0, 0, 0]


# ---------------------------------------------------------------------------------------------------------
# Training with replicas on 4 ranks, float64, against the single-device model
# ---------------------------------------------------------------------------------------------------------

REPLAN = ["--moe-replan-every", "1"]
# (flags, config overrides, global batch, B_μ), as test_composition's cases
CASES = [
    (["--moe-experts", "4", "--ep", "2", "--moe-replicas", "6", *REPLAN], {}, 8, 1),  # D = 4, E = 2, m = 2
    (["--moe-experts", "4", "--ep", "4", "--moe-replicas", "8", "--moe-capacity-factor", "1.0", *REPLAN], {}, 8, 2),
    (["--moe-experts", "4", "--ep", "2", "--moe-replicas", "6", "--tp", "2", "--sp", *REPLAN], {}, 4, 1),  # loads
    (["--moe-experts", "4", "--ep", "2", "--moe-replicas", "6", "--cp", "2", *REPLAN], {}, 4, 1),  # over tp too
    (["--moe-experts", "4", "--ep", "2", "--moe-replicas", "6", "--pp", "2", *REPLAN], dict(n_layer=2), 8, 1),
    (["--moe-experts", "4", "--ep", "2", "--moe-replicas", "6", "--zero", "1", *REPLAN], {}, 8, 1),  # sharded state:
    (["--moe-experts", "4", "--ep", "4", "--moe-replicas", "8", "--zero", "2", *REPLAN], {}, 8, 2),  # sums over dp×cp
    (["--moe-experts", "4", "--ep", "2", "--moe-replicas", "6", "--zero", "3", *REPLAN], {}, 8, 1),  # weights sharded
]
SAVE_AT = 2
SAME_MESH = [  # (a case, the step it saves at): resumed on the same mesh, bitwise the uninterrupted run
    ((["--moe-experts", "4", "--ep", "2", "--moe-replicas", "6", "--zero", "1", "--moe-replan-every", "2"], {}, 8, 1),
     1),  # saved before the re-plan of step 2: the resumed run re-plans on that step, from the loaded average
]
RESHARD = [  # (saves after SAVE_AT steps, resumes to STEPS): each replica set is one logical expert on disk
    (CASES[0], (["--moe-experts", "4", "--ep", "4", "--moe-replicas", "12", *REPLAN], {}, 8, 1)),
    ((["--moe-experts", "4", "--ep", "4"], {}, 8, 1), CASES[0]),
    (CASES[5], (["--moe-experts", "4", "--ep", "2", "--zero", "2"], {}, 8, 1)),  # ZeRO-1 with replicas → ZeRO-2
    (CASES[7], (["--moe-experts", "4", "--ep", "4", "--moe-replicas", "8", "--zero", "3", *REPLAN], {}, 8, 1)),
]


def _run(rank, world, flags, config_kw, global_batch, micro, stop=STEPS, save_root=None, resume_root=None,
         drop_state=False):
    """test_composition._run_case, traced, plus what the replicas did: the losses, {global name: (tensor, info)},
    (traced, predicted) messages per step, every slot's logical expert and flat weights, the moves."""
    import report.run
    run = composed_run(rank, world, flags, config_kw, global_batch, micro, torch.device("cpu"))
    losses, traced = traced_steps(run, STEPS, global_batch, 16, micro, 0.05, stop, save_root, resume_root,
                                  drop_state)
    steps = len(losses)
    moe_axis = next(axis for axis in run.axes if axis.name == "moe")
    with getattr(run.layout, "gathered", nullcontext)():  # ZeRO-3: the working weights gathered back to be read
        params = {p.shard_info.global_name: (p.detach().clone(), p.shard_info) for p in run.model.parameters()}
        slots = {(layer.layer_id, int(q)): (layer.replicas.phy2log[int(q)],
                                             torch.cat([p.detach().reshape(-1) for p in expert.parameters()]))
                 for layer in moe_axis.layers if layer.replicas is not None for q, expert in layer.experts.items()}
    redundant = next((axis for axis in run.axes if axis.name == "eplb"), None)  # a stage without MoE: none
    averages = {layer.layer_id: layer.replicas.average.clone() for layer in moe_axis.layers if layer.replicas}
    return dict(losses=losses, params=params, messages=(traced, report.run.predicted_messages(run, steps)), slots=slots,
                moved=redundant.moved if redundant else None, replans=redundant.replans if redundant else 0,
                averages=averages)


def _runs(rank, world, root):
    """Every CASES run, then each RESHARD pair: saved under `root`, resumed from there; each SAME_MESH case
    uninterrupted, and saved and resumed on its mesh."""
    out = {index: _run(rank, world, *case) for index, case in enumerate(CASES)}
    for index, (saving, resuming) in enumerate(RESHARD):
        directory = os.path.join(root, str(index))
        _run(rank, world, *saving, stop=SAVE_AT, save_root=directory)
        dropping_replicas = "--moe-replicas" in saving[0] and "--moe-replicas" not in resuming[0]  # their loads
        out[("resumed", index)] = _run(rank, world, *resuming, resume_root=directory, drop_state=dropping_replicas)
    for index, (case, save_at) in enumerate(SAME_MESH):
        out[("same mesh", index)] = _interrupted(rank, world, case, save_at, os.path.join(root, f"same-{index}"))
    return out


def _interrupted(rank, world, case, save_at, directory):
    """(the uninterrupted run, the run saved after `save_at` steps and resumed on the same mesh)."""
    whole = _run(rank, world, *case)
    _run(rank, world, *case, stop=save_at, save_root=directory)
    return whole, _run(rank, world, *case, resume_root=directory)


def _assert_bitwise_replay(per_rank, save_at):
    """The resumed steps' losses, every held tensor, and every slot (its logical expert, after the last
    re-plan, and its weights) bitwise the uninterrupted run's."""
    for whole, resumed in per_rank:
        assert sorted(resumed["losses"]) == list(range(save_at, STEPS))
        assert all(torch.equal(a, whole["averages"][k]) for k, a in resumed["averages"].items())
        for step, loss in resumed["losses"].items():
            assert torch.equal(torch.as_tensor(loss), torch.as_tensor(whole["losses"][step])), step
        assert resumed["params"].keys() == whole["params"].keys()
        for name, (tensor, _) in resumed["params"].items():
            assert torch.equal(tensor, whole["params"][name][0]), name
        assert resumed["slots"].keys() == whole["slots"].keys()
        for key, (expert, flat) in resumed["slots"].items():
            assert expert == whole["slots"][key][0] and torch.equal(flat, whole["slots"][key][1]), key


def _assert_replicas_equal_and_moved(per_rank):
    """Every copy of an expert bitwise equal on every rank; a re-plan each step, and bytes moved across ranks."""
    copies = {}
    for r in per_rank:
        for (layer_id, _), (expert, flat) in r["slots"].items():
            copies.setdefault((layer_id, expert), []).append(flat)
    assert any(len(flats) > 1 for flats in copies.values())  # some expert has replicas
    for flats in copies.values():
        assert all(torch.equal(flat, flats[0]) for flat in flats)
    assert all(r["replans"] == STEPS for r in per_rank)
    assert sum(r["moved"][1] for r in per_rank) > 0  # bytes sent by all_to_all_single at re-plans


def _assert_traced_as_predicted(per_rank):
    """Every (collective, group) of the traced steps: the replicas' gradient sum over ep, the loads' all-reduce,
    the re-plans' moves (from what they sent) beside the layout's, the dispatch's and the step's."""
    for rank, r in enumerate(per_rank):
        traced, predicted = r["messages"]
        assert set(traced) == set(predicted), (rank, set(traced) ^ set(predicted))
        for key, (calls, payload) in predicted.items():
            assert traced[key] == pytest.approx((calls, payload), abs=1e-9), (rank, key)


QUICK = (["--moe-experts", "4", "--ep", "2", "--moe-replicas", "6", *REPLAN], {}, 4, 1)  # D = E = 2, m = 2


def _quick(rank, world, root):
    return _interrupted(rank, world, QUICK, SAVE_AT, root), _fp8_slots(rank, world, QUICK)


def _fp8_slots(rank, world, case):
    """Under --fp8 current: (every expert slot's FP8 linear, those the FP8 handle holds, each slot's logical
    expert per MoE layer, the slots' row shares) on this rank. Two slots of one expert on a rank are two FP8
    linears, each named by its slot's path (by the logical name they would collide): both count."""
    import fp8
    import moe

    flags, config_kw, global_batch, micro = case
    run = composed_run(rank, world, [*flags, "--fp8", "current"], config_kw, global_batch, micro, torch.device("cpu"))
    handle = next(axis for axis in run.axes if axis.name == "fp8")
    slots = [m for m in run.model.modules() if isinstance(m, fp8.Fp8Linear) and m.row_alignment > 1]
    held = {id(linear) for linear in handle.linears.values()}
    layers = [block.mlp for block in run.model.transformer.h if isinstance(block.mlp, moe.MoE)]
    return (len(slots), sum(id(m) in held for m in slots),
            [[r.phy2log[q] for q in r.local] for r in (layer.replicas for layer in layers)],
            {m.row_share for m in slots}, run.model.config.moe.topk)


def test_two_ranks_with_replicas_train_as_one_device_keep_replicas_equal_trace_as_predicted_and_replay(tmp_path):
    """The quick suite's case: D = E = 2, N = 4 in R = 6 slots, re-planned after every step: the losses and
    every held tensor within 1e-10 of the single device's, replicas bitwise equal, messages as predicted; saved
    after step 2 and resumed on the same mesh, bitwise the uninterrupted run (the placement of step 3 and the
    one step 3's re-plan made from the loaded average)."""
    results = run_ranks(_quick, 2, str(tmp_path), timeout=300)
    per_rank = [interrupted for interrupted, _ in results]
    whole = [w for w, _ in per_rank]
    _check([(r["losses"], r["params"]) for r in whole], *QUICK)
    _assert_replicas_equal_and_moved(whole)
    _assert_traced_as_predicted(whole)
    _assert_bitwise_replay(per_rank, SAVE_AT)
    averages = [w["averages"] for w in whole]  # the restart state is one logical copy: the same on every rank
    assert all(float(a.sum()) > 0 for a in averages[0].values())
    assert all(r.keys() == averages[0].keys() and all(torch.equal(r[k], averages[0][k]) for k in r)
               for r in averages)
    for slots, held, experts, shares, k in (fp8_slots for _, fp8_slots in results):  # --fp8 current: every slot
        assert any(len(set(e)) < len(e) for e in experts)  # some rank holds two slots of one expert
        assert slots == held == 2 * sum(len(e) for e in experts), (slots, held, experts)
        assert shares == {2 * k / 6}  # E·k/R of a rank's routed rows per slot (uniform routing), not E·k/N


@pytest.fixture(scope="module")
def replica_runs(tmp_path_factory):
    return run_ranks(_runs, 4, str(tmp_path_factory.mktemp("replicas")), timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(CASES)))
def test_training_with_replicas_equals_the_single_device_model(replica_runs, index):
    """Losses and every held tensor (each slot against its logical expert) within 1e-10 of the single device's
    three steps (AdamW, clipping active), re-planned after every step."""
    _check([(r[index]["losses"], r[index]["params"]) for r in replica_runs], *CASES[index])


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(CASES)))
def test_replicas_stay_bitwise_equal_and_the_re_plans_moved_slots_across_ranks(replica_runs, index):
    _assert_replicas_equal_and_moved([r[index] for r in replica_runs])


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(CASES)))
def test_traced_messages_equal_the_prediction(replica_runs, index):
    _assert_traced_as_predicted([r[index] for r in replica_runs])


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(RESHARD)))
def test_a_checkpoint_with_replicas_resumes_on_another_e_and_r(replica_runs, index):
    """Saved on E = 2 with R = 6, resumed on E = 4 with R = 12; saved on E = 4 without replicas, resumed on
    E = 2 with R = 6; saved under ZeRO-1 with R = 6, resumed under ZeRO-2 without replicas: the resumed steps
    and tensors equal the single device's uninterrupted run."""
    per_rank = [r[("resumed", index)] for r in replica_runs]
    assert all(sorted(r["losses"]) == list(range(SAVE_AT, STEPS)) for r in per_rank)
    _check([(r["losses"], r["params"]) for r in per_rank], *RESHARD[index][1])


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(SAME_MESH)))
def test_a_checkpoint_with_replicas_replays_bitwise_on_the_same_mesh(replica_runs, index):
    """ZeRO-1 with R = 6 on E = 2, re-planned every 2 steps, saved after step 1: the resumed run re-plans on
    step 2 as the uninterrupted one did (the step count and the average restored) and ends bitwise equal."""
    _assert_bitwise_replay([r[("same mesh", index)] for r in replica_runs], SAME_MESH[index][1])


# ---------------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------------

BAD = [
    (["--moe-experts", "4", "--ep", "2", "--moe-replicas", "3"], "--moe-replicas 3 must be at least --moe-experts 4"),
    (["--moe-experts", "4", "--ep", "2", "--moe-replicas", "5"], "--moe-replicas 5 must be a multiple of --ep 2"),
    (["--moe-experts", "4", "--ep", "2", "--moe-replicas", "10"], "--moe-replicas 10 is more replicas than slots"),
    (["--moe-replicas", "6"], "--moe-replicas needs --moe-experts > 0"),
    (["--moe-experts", "4", "--moe-replan-every", "5"], "--moe-replan-every needs --moe-replicas"),
    (["--moe-experts", "4", "--ep", "2", "--moe-replicas", "6", "--moe-replan-every", "0"],
     "--moe-replan-every must be at least 1"),
    (["--moe-experts", "4", "--ep", "2", "--moe-replicas", "6", "--moe-load-decay", "1"],
     "--moe-load-decay must be in [0, 1)"),
]


@pytest.mark.parametrize("flags, message", BAD, ids=[" ".join(f[-2:]) for f, _ in BAD])
def test_a_bad_replica_flag_ends_in_one_line_before_any_process_group(flags, message, refused):
    err = refused(["--global-batch", "4", *flags], world=4)
    assert message in err, err


# ---------------------------------------------------------------------------------------------------------
# Through train.py: a skewed load (no balance loss) on EP = 2 and 4
# ---------------------------------------------------------------------------------------------------------

SKEWED = ["--preset", "tiny", "--steps", "15", "--global-batch", "8", "--micro-batch", "2", "--moe-experts", "8",
          "--moe-aux-coef", "0", "--dtype", "fp32", "--eval-every", "0", "--sample-tokens", "0", "--log-every", "10",
          "--lr", "2e-3"]  # the routing these checks were sized on (at 3e-3, E = 2's experts in place balance exactly)


def _train(tmp_path, name, ep, *flags):
    metrics = tmp_path / f"{name}.jsonl"
    run = launch(4, *SKEWED, "--ep", str(ep), "--out-dir", str(tmp_path), "--metrics-file", str(metrics), *flags,
                 timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()], run.stdout


@pytest.mark.slow
@pytest.mark.parametrize("ep, replicas", [(2, "12"), (4, "12")])
def test_replicas_lower_the_busiest_ranks_rows_and_keep_the_loss_curve(tmp_path, ep, replicas):
    """15 steps of the tiny preset with N = 8 experts and no balance loss, so a few experts get hot: with
    R = 12 slots re-placed every 5 steps, the rows the busiest EP rank received over the last window, max/mean,
    fall below what the experts in place would have had on the same routing (both printed), and the losses
    follow the run without replicas to float32 rounding (2e-5: the replicas' rows meet the same weights in
    other matmul shapes, and the gradients are summed in another order)."""
    plain, _ = _train(tmp_path, "plain", ep)
    losses, out = _train(tmp_path, "replicas", ep, "--moe-replicas", replicas, "--moe-replan-every", "5")
    difference = max(abs(a - b) for a, b in zip(plain, losses))
    assert difference < 2e-5 and len(losses) == len(plain) == 15
    line = next(line for line in out.splitlines() if line.startswith("moe replicas R="))
    print(f"E={ep}: largest loss difference {difference:.3g}; {line}")
    balance = float(line.split("max/mean ")[1].split()[0])
    in_place = float(line.split("experts in place ")[1].split()[0])
    assert math.isfinite(balance) and balance < in_place, line
    assert "<- differs" not in out
