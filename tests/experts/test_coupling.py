"""experts/coupling.py: the co-selection statistics on hand-counted sets, the balanced partition against brute force,
the routing observer's counts (accounting/observers.py's RoutedLoad) against the layers' own choices; and in
training on 2 ranks (float64, train.compose and step.train_step): the deduplicated exchange's rows are the
(token, rank) pairs of the tokens' kept experts under the placement in force (fewer than the slots), the
co-selection placement (--moe-placement coselect, re-planned every step) trains bitwise as the experts in place
(top-2: every sum it regroups has two terms) and within 1e-10 of the single device, its messages traced as
predicted, and a checkpoint moves between the two placements; the flags' bad input.
"""

import itertools

import pytest
import torch

from harness import run_ranks
from test_composition import _check
from test_eplb import _assert_traced_as_predicted

# ---------------------------------------------------------------------------------------------------------
# The statistics, one process
# ---------------------------------------------------------------------------------------------------------


def test_set_keys_and_pair_counts_of_hand_made_choices():
    """Tokens choosing {0, 1}, {1, 2}, {0, 1}, and {0, 3} with its slot for 3 dropped (N = 4 marks it)."""
    from experts import coupling

    expert = torch.tensor([[0, 1], [2, 1], [1, 0], [0, 3]])
    assert coupling.set_keys(expert).tolist() == [3, 6, 3, 9]
    slots = expert.reshape(-1).clone()
    slots[7] = 4  # dropped: counted nowhere
    pairs = coupling.pair_counts(slots, 4, 2)
    assert pairs.tolist() == [[0, 2, 0, 0], [2, 0, 1, 0], [0, 1, 0, 0], [0, 0, 0, 0]]


def test_top_pairs_coverage_pairs_to_cover_and_next_layer_predictability_by_hand():
    """N = 4, 6 pairs: sets {0,1} × 5, {2,3} × 3, {0,2} × 2 (10 tokens). The top 1% of 6 pairs is one pair, {0,1}:
    50% of the tokens; 42% of them need that one pair (1/6 of the pairs), 60% two. Next layer: from {0,1} the
    next set is {2,3} 4 times of 5, from {2,3} {0,1} 2 of 3, from {0,2} {0,2} 1 of 2: (4 + 2 + 1)/10; whatever the
    set here, the most frequent next set is {2,3} (5 of 10)."""
    from experts import coupling

    sets = {0b0011: 5, 0b1100: 3, 0b0101: 2}
    assert coupling.top_pair_coverage(sets, 4) == (1, 6, 0.5)
    assert coupling.pairs_to_cover(sets, 4, 0.42) == pytest.approx(1 / 6)
    assert coupling.pairs_to_cover(sets, 4, 0.6) == pytest.approx(2 / 6)
    joint = {(0b0011, 0b1100): 4, (0b0011, 0b0101): 1, (0b1100, 0b0011): 2, (0b1100, 0b1100): 1,
             (0b0101, 0b0101): 1, (0b0101, 0b0011): 1}
    assert coupling.next_layer_predictability(joint) == (pytest.approx(0.7), pytest.approx(0.5))
    assert coupling.pair_matrix(sets, 4)[0][1] == 5 and coupling.pair_matrix(sets, 4)[2][0] == 2
    # rows under a placement: {0,1} on rank 0 and {2,3} on rank 1 send those tokens one row, {0,2} two
    assert coupling.dispatch_rows(sets, [0, 0, 1, 1], 2) == (5 + 3 + 2 * 2, 20)


def _best_inside(weight, parts):
    n = len(weight)
    size, best = n // parts, 0.0

    def rec(rest, rank):
        nonlocal best
        if not rest:
            from experts import coupling
            best = max(best, coupling.inside_weight(weight, rank))
            return
        for others in itertools.combinations(rest[1:], size - 1):
            group = (rest[0], *others)
            rec([e for e in rest if e not in group], {**rank, **{e: len(set(rank.values())) for e in group}})

    rec(list(range(n)), {})
    return best


def test_the_partition_is_balanced_finds_planted_groups_and_comes_near_brute_force():
    """A planted co-selection graph (experts 0,5 / 1,6 / 2,7 / 3,4 chosen together, noise elsewhere) is recovered
    whole on E = 4; on random 8-expert graphs (E = 2 and 4) every part holds N/E experts and the inside weight is
    within 5% of the best partition's (Kernighan–Lin is a local search: 3 of these 20 cases stop short of it)."""
    from experts import coupling

    generator = torch.Generator().manual_seed(0)
    planted = torch.randint(0, 5, (8, 8), generator=generator).double()
    for a, b in ((0, 5), (1, 6), (2, 7), (3, 4)):
        planted[a, b] = 100
    planted = planted + planted.T
    part = coupling.partition(planted, 4)
    assert {frozenset(e for e in range(8) if part[e] == p) for p in range(4)} == {
        frozenset(g) for g in ((0, 5), (1, 6), (2, 7), (3, 4))}
    short = 0
    for case in range(20):
        weight = torch.randint(0, 100, (8, 8), generator=generator).double()
        weight = (weight + weight.T).fill_diagonal_(0).tolist()
        parts = 2 if case % 2 else 4
        part = coupling.partition(weight, parts)
        assert sorted(part.count(p) for p in range(parts)) == [8 // parts] * parts
        got, best = coupling.inside_weight(weight, part), _best_inside(weight, parts)
        assert best * 0.95 <= got <= best
        short += got < best
    assert short <= 5


def test_the_coselect_plan_of_a_uniform_graph_is_the_experts_in_place():
    """Before any pair is counted (experts/eplb.py's uniform start: pairs of ones) coselect keeps plain EP's
    placement, expert i on rank ⌊i·E/N⌋; its plan is a permutation, one slot each."""
    from experts import coupling

    assert coupling.coselect_plan(torch.ones(8, 8), 4) == (list(range(8)), [0] * 8, [1] * 8)
    phy2log, _, logcnt = coupling.coselect_plan(torch.rand(8, 8, generator=torch.Generator().manual_seed(1)), 2)
    assert sorted(phy2log) == list(range(8)) and logcnt == [1] * 8


def test_the_routing_observer_counts_the_sets_the_layers_chose_and_their_next_layers():
    """One process, 2 MoE layers, 2 training forwards (and one under no_grad, not counted): RoutedLoad's sets
    per layer and its (layer 0, layer 1) pairs are the layers' own choices (`chosen`) counted by hand."""
    from accounting.observers import RoutedLoad
    from experts import coupling
    import moe
    from model import GPT
    from reference import make_config

    model = GPT(make_config(moe_experts=8, moe_topk=2), seed=0)
    layers = moe.swap_in(model)
    record = RoutedLoad()
    for layer in layers:
        layer.observer = record
    expected_sets, expected_joint = [{}, {}], {}
    generator = torch.Generator().manual_seed(0)
    for _ in range(2):
        model(torch.randint(0, 256, (2, 16), generator=generator))
        keys = [coupling.set_keys(layer.chosen).tolist() for layer in layers]
        for layer_keys, counts in zip(keys, expected_sets):
            for key in layer_keys:
                counts[key] = counts.get(key, 0) + 1
        for pair in zip(*keys):
            expected_joint[pair] = expected_joint.get(pair, 0) + 1
    with torch.no_grad():
        model(torch.randint(0, 256, (2, 16), generator=generator))
    counts = record.take_coupling()
    assert counts.sets == {0: expected_sets[0], 1: expected_sets[1]}
    assert counts.joint == {(0, 1): expected_joint}
    assert counts.kept == 2 * 2 * (2 * 16) * 2  # forwards × layers × tokens × k
    assert record.take_coupling() is counts  # nothing new: the last window again


# ---------------------------------------------------------------------------------------------------------
# Training on 2 ranks, float64
# ---------------------------------------------------------------------------------------------------------

IN_PLACE = (["--moe-experts", "8", "--ep", "2"], {}, 4, 1)  # D = E = 2, m = 2, expert i on rank i // 4
COSELECT = (["--moe-experts", "8", "--ep", "2", "--moe-replicas", "8", "--moe-placement", "coselect",
             "--moe-replan-every", "1"], {}, 4, 1)
SAVE_AT = 2


def _rows_by_hand(layer):
    """Per EP rank, the tokens of the layer's last forward with at least one expert there (dropless), and the slots:
    the (token, rank) pairs a once-per-rank dispatcher sends, computed from the choices and the placement alone."""
    per_rank = layer.n_experts // layer.ep_size
    if layer.replicas is None:
        rank_of = [e // per_rank for e in range(layer.n_experts)]
    else:
        rank_of = [layer.replicas.phy2log.index(e) // per_rank for e in range(layer.n_experts)]
    ranks = [{rank_of[e] for e in token} for token in layer.chosen.tolist()]
    return [sum(r in token for token in ranks) for r in range(layer.ep_size)], layer.chosen.numel()


def _train(rank, world, case, stop=3, save_root=None, resume_root=None, drop_state=False):
    """test_eplb._run's record of a run (losses, tensors, messages, moves), plus each MoE layer's last exchange (its
    rows sent per rank beside `_rows_by_hand`) and its placement; drop_state: the resume leaves the replicas' loads
    and pairs unread (--drop-state)."""
    import moe
    import report.run
    from harness import traced_steps
    from test_composition import STEPS, composed_run

    run = composed_run(rank, world, *case, torch.device("cpu"))
    losses, traced = traced_steps(run, STEPS, case[2], 16, case[3], 0.05, stop, save_root, resume_root,
                                  drop_state)
    layers = [block.mlp for block in run.model.transformer.h if isinstance(block.mlp, moe.MoE)]
    redundant = next((axis for axis in run.axes if axis.name == "eplb"), None)
    return dict(losses=losses, messages=(traced, report.run.predicted_messages(run, len(losses))),
                params={p.shard_info.global_name: (p.detach().clone(), p.shard_info) for p in run.model.parameters()},
                rows=[(list(layer.exchanged.sent), *_rows_by_hand(layer)) for layer in layers],
                plans=[list(layer.replicas.phy2log) if layer.replicas else None for layer in layers],
                moved=redundant.moved if redundant else None, replans=redundant.replans if redundant else 0)


def _placement_runs(rank, world, root):
    out = {"in place": _train(rank, world, IN_PLACE), "coselect": _train(rank, world, COSELECT)}
    _train(rank, world, COSELECT, stop=SAVE_AT, save_root=f"{root}/a")
    out["resumed in place"] = _train(rank, world, IN_PLACE, resume_root=f"{root}/a", drop_state=True)  # no replicas
    _train(rank, world, IN_PLACE, stop=SAVE_AT, save_root=f"{root}/b")
    out["resumed coselect"] = _train(rank, world, COSELECT, resume_root=f"{root}/b")
    return out


@pytest.fixture(scope="module")
def placement_runs(tmp_path_factory):
    return run_ranks(_placement_runs, 2, str(tmp_path_factory.mktemp("coselect")), timeout=300)


def test_the_exchange_sends_one_row_per_token_and_rank_its_experts_span(placement_runs):
    """In place and under the co-selection placement: the rows each rank sent every other (dispatch.Exchange.sent)
    are the (token, rank) pairs of its tokens' experts counted from the choices and the placement, fewer than the
    slots a per-slot dispatcher would send."""
    for result in placement_runs:
        for name in ("in place", "coselect"):
            for sent, by_hand, slots in result[name]["rows"]:
                assert sent == by_hand and sum(sent) < slots, (name, sent, by_hand, slots)


def test_the_coselect_placement_trains_bitwise_as_the_experts_in_place_and_as_one_device(placement_runs):
    """Re-planned after every step (its plan no longer plain EP's: slots moved, with their weights and AdamW state),
    the losses are bitwise the in-place run's, every expert's tensors too (whichever rank holds it), and within
    1e-10 of the single device's; its messages (the pairs ride the loads' all-reduce) traced as predicted."""
    for result in placement_runs:
        plain, moved = result["in place"], result["coselect"]
        assert all(torch.equal(torch.as_tensor(plain["losses"][s]), torch.as_tensor(moved["losses"][s]))
                   for s in plain["losses"])
        assert moved["replans"] == 3
    assert any(plan != list(range(8)) for r in placement_runs for plan in r["coselect"]["plans"])
    assert sum(r["coselect"]["moved"][1] for r in placement_runs) > 0
    held = {}
    for r in placement_runs:
        for name, (tensor, _) in r["in place"]["params"].items():
            held.setdefault(name, []).append(tensor)
    for r in placement_runs:
        for name, (tensor, _) in r["coselect"]["params"].items():
            assert any(torch.equal(tensor, other) for other in held[name]), name
    _check([(r["coselect"]["losses"], r["coselect"]["params"]) for r in placement_runs], *COSELECT)
    _assert_traced_as_predicted([r["coselect"] for r in placement_runs])


def test_a_checkpoint_moves_between_the_coselect_placement_and_the_experts_in_place(placement_runs):
    """Saved under coselect after 2 steps, resumed in place (--drop-state: the replicas' loads and pairs have no
    place there); saved in place, resumed under coselect (placed from the uniform start: no pairs saved): the
    resumed steps equal the single device's uninterrupted run."""
    for name, case in (("resumed in place", IN_PLACE), ("resumed coselect", COSELECT)):
        per_rank = [r[name] for r in placement_runs]
        assert all(sorted(r["losses"]) == [SAVE_AT] for r in per_rank)
        _check([(r["losses"], r["params"]) for r in per_rank], *case)


# ---------------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------------

BAD = [
    (["--moe-experts", "4", "--ep", "2", "--moe-replicas", "4", "--moe-placement", "0,1,2,2"],
     "--moe-placement 0,1,2,2 places no slot of expert 3"),
    (["--moe-experts", "4", "--ep", "2", "--moe-replicas", "4", "--moe-placement", "0,1,2"],
     "--moe-placement 0,1,2 lists 3 slots, --moe-replicas has 4"),
    (["--moe-experts", "4", "--ep", "2", "--moe-replicas", "4", "--moe-placement", "0,1,2,7"],
     "names an expert outside [0, 4)"),
    (["--moe-experts", "4", "--ep", "2", "--moe-replicas", "4", "--moe-placement", "greedy"],
     "--moe-placement greedy: one of eplb, sinkhorn, coselect"),
    (["--moe-experts", "4", "--moe-replicas", "4", "--moe-placement", "coselect"],
     "--moe-placement coselect places experts over the EP ranks: it needs --ep > 1"),
    (["--moe-experts", "4", "--ep", "2", "--moe-replicas", "6", "--moe-placement", "coselect"],
     "it needs --moe-replicas 4 (= --moe-experts), got 6"),
    (["--moe-experts", "4", "--ep", "2", "--moe-placement", "coselect"], "--moe-placement needs --moe-replicas"),
]


@pytest.mark.parametrize("flags, message", BAD, ids=[" ".join(f[-2:]) for f, _ in BAD])
def test_a_bad_placement_flag_ends_in_one_line_before_any_process_group(flags, message, refused):
    err = refused(["--global-batch", "4", *flags], world=4)  # as test_eplb's bad replica flags
    assert message in err, err
