"""experts/transport.py: Sinkhorn–Knopp's plan against its marginals and a hand-solvable case, the replica placement
against EPLB's on skewed loads (cheaper links, every slot filled, each expert at home), the cost matrix built from
the hardware model (planner/hardware.py) and parsed from --moe-placement-cost; training with --moe-placement
sinkhorn on 2 ranks (float64) as the single device does, its messages traced as predicted; the flags' bad input.
"""

import pytest
import torch

from harness import run_ranks
from test_composition import _check
from test_eplb import _assert_traced_as_predicted, _run

# ---------------------------------------------------------------------------------------------------------
# The transport and the placement, one process
# ---------------------------------------------------------------------------------------------------------


def test_sinkhorn_meets_its_marginals_and_sends_along_the_cheap_link():
    """Two givers (3, 1), two takers (2, 2); giver 0 next to taker 0 (cost 0), far from taker 1 (cost 1), giver 1
    the other way: the cheap plan sends 2 on 0 → 0, 1 on 0 → 1, 1 on 1 → 1 (ε small: nearly that), and every
    plan's rows and columns sum to the marginals."""
    from experts import transport

    plan = torch.tensor(transport.sinkhorn([3.0, 1.0], [2.0, 2.0], [[0.0, 1.0], [1.0, 0.0]], epsilon=0.01))
    assert plan.sum(dim=1).tolist() == pytest.approx([3.0, 1.0], rel=1e-8)
    assert plan.sum(dim=0).tolist() == pytest.approx([2.0, 2.0], rel=1e-6)
    assert plan.tolist() == [pytest.approx([2.0, 1.0], abs=1e-6), pytest.approx([0.0, 1.0], abs=1e-6)]
    assert transport.sinkhorn([0.0, 0.0], [1.0, 1.0], [[0, 1], [1, 0]]) == [[0.0, 0.0], [0.0, 0.0]]


def _skewed(n):
    return (torch.distributions.Gamma(0.7, 1.0).sample((n,)) * 100).tolist()


def test_sinkhorn_keeps_homes_fills_every_slot_and_costs_less_than_eplb():
    """N = 16, E = 8 in two nodes of 4, R = 24 (h100's links): on 5 skewed loads every expert keeps its home slot
    (replica 0 on rank ⌊i·E/N⌋), every slot holds an expert, the load per replica is what the dispatch's even
    split gives; its weighted communication cost is below EPLB's (which moves the homes too) and below the same
    matching's on a uniform cost (what the links buy), its max/mean within 1.6 (EPLB's is better: it packs
    freely)."""
    from experts import eplb, transport

    torch.manual_seed(0)
    n, ep, slots, per_node = 16, 8, 24, 4
    cost = [[0.0 if a == b else 1 / (450 if a // per_node == b // per_node else 50) for b in range(ep)]
            for a in range(ep)]
    uniform = [[0.0 if a == b else 1.0 for b in range(ep)] for a in range(ep)]
    for _ in range(5):
        load = _skewed(n)
        phy2log, replica, logcnt = transport.place(load, slots, ep, cost)
        assert len(phy2log) == slots and sorted(set(phy2log)) == list(range(n))
        assert logcnt == [phy2log.count(e) for e in range(n)]
        for e in range(n):
            home = next(q for q, x in enumerate(phy2log) if x == e and replica[q] == 0)
            assert home // (slots // ep) == e * ep // n
        balance, weighted = transport.plan_costs(phy2log, load, ep, cost)
        _, blind = transport.plan_costs(transport.place(load, slots, ep, uniform)[0], load, ep, cost)
        _, eplb_cost = transport.plan_costs(eplb.place_layer(torch.tensor(load), slots, 1, 1, ep)[0], load, ep, cost)
        assert weighted < eplb_cost and weighted <= blind and balance < 1.6


def test_the_hardware_models_cost_matrix_and_the_flags_matrix():
    """h100 (450 GB/s in a node, 50 across), nodes of 2, E = 4: rank 0's ep group [0, 1, 2, 3]; the flag's text
    parses to the same matrix when written out."""
    from types import SimpleNamespace

    from experts import transport
    from mesh import MeshShape
    from planner import hardware

    args = SimpleNamespace(hw="h100", gpus_per_node=2, hw_intra_gbps=None, hw_inter_gbps=None)
    cost = hardware.ep_link_costs(args, MeshShape(dp=4, ep=4))
    a, b = 1 / 450, 1 / 50
    assert cost == ((0.0, a, b, b), (a, 0.0, b, b), (b, b, 0.0, a), (b, b, a, 0.0))
    text = ";".join(",".join(repr(x) for x in row) for row in cost)
    assert transport.parse_cost(text, 4) == cost


# ---------------------------------------------------------------------------------------------------------
# Training with the Sinkhorn placement, 2 ranks, float64
# ---------------------------------------------------------------------------------------------------------

SINKHORN = (["--moe-experts", "4", "--ep", "2", "--moe-replicas", "6", "--moe-placement", "sinkhorn",
             "--moe-placement-cost", "0,1;1,0", "--moe-replan-every", "1"], {}, 4, 1)


def _sinkhorn_run(rank, world):
    return _run(rank, world, *SINKHORN)


def test_the_sinkhorn_placement_trains_as_one_device_and_traces_as_predicted():
    """D = E = 2, N = 4 in R = 6 slots placed by Sinkhorn, re-planned after every step: the losses and every held
    tensor within 1e-10 of the single device's, its messages traced as predicted."""
    results = run_ranks(_sinkhorn_run, 2, timeout=300)
    _check([(r["losses"], r["params"]) for r in results], *SINKHORN)
    _assert_traced_as_predicted(results)
    assert all(r["replans"] == 3 for r in results)


# ---------------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------------

REPLICAS = ["--moe-experts", "4", "--ep", "2", "--moe-replicas", "6"]
BAD = [
    ([*REPLICAS, "--moe-placement", "sinkhorn", "--moe-placement-cost", "0,1;1"],
     "--moe-placement-cost must be 2×2"),
    ([*REPLICAS, "--moe-placement", "sinkhorn", "--moe-placement-cost", "0,-1;1,0"],
     "--moe-placement-cost: entry (0, 1) = -1.0 must be finite and at least 0"),
    ([*REPLICAS, "--moe-placement", "sinkhorn", "--moe-placement-cost", "0,nan;1,0"], "must be finite"),
    ([*REPLICAS, "--moe-placement", "sinkhorn", "--moe-placement-cost", "1,1;1,0"],
     "entry (0, 0) = 1.0 must be 0"),
    ([*REPLICAS, "--moe-placement", "sinkhorn", "--moe-placement-cost", "0,a;1,0"], "entries must be numbers"),
    ([*REPLICAS, "--moe-placement-cost", "0,1;1,0"], "--moe-placement-cost needs --moe-placement sinkhorn"),
    (["--moe-experts", "4", "--moe-replicas", "4", "--moe-placement", "sinkhorn"],
     "--moe-placement sinkhorn places experts over the EP ranks: it needs --ep > 1"),
]


@pytest.mark.parametrize("flags, message", BAD, ids=[" ".join(f[-2:]) for f, _ in BAD])
def test_a_bad_cost_flag_ends_in_one_line_before_any_process_group(flags, message, refused):
    err = refused(["--global-batch", "4", *flags], world=4)  # as test_eplb's bad replica flags
    assert message in err, err
