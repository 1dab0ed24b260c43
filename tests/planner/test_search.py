"""planner/search.py: --plan-search's branch and bound ranks what the exhaustive search ranks.

- The bound (time_model.step_bound, sizing in the order of the bounds, the three looks of each layout) returns the
  same best layouts, with the same predicted steps, as search(..., bound=False), which bounds no layout before
  sizing it; some layouts are never sized, and a progress line says how far it is.
- formulas.ScheduleFacts' closed-form p2p pairs equal schedules.p2p_counts of the action lists, every schedule; its
  other figures (in flight, sends alive, gather runs, alive chunks), closed forms and reductions, equal those of the
  whole lists and communication plan over a grid of (schedule, P, m, v).
"""

import pytest

from parallel import schedules, zero_pipeline
from planner import hardware
import planner.formulas
import planner.search
from planner.time_model import layout_name

TINY = ["--preset", "tiny", "--dtype", "fp32", "--seq-len", "32", "--global-batch", "16"]


@pytest.mark.parametrize("layers", [2, 4])  # 4: pipelines of 4 stages, a first, a last and stages between
def test_the_bound_keeps_the_exhaustive_best(monkeypatch, layers):
    hw = hardware.PRESETS["h100"]
    argv = TINY + ["--n-layer", str(layers)]
    exhaustive = planner.search.search(argv, 8, hw, bound=False)
    lines = []
    monkeypatch.setattr(planner.search, "PROGRESS_SECONDS", 0.0)
    bounded = planner.search.search(argv, 8, hw, out=lines.append)
    assert len(exhaustive.best) == 10
    assert [(layout_name(r[2]), r[0].step, r[1]) for r in bounded.best] == \
           [(layout_name(r[2]), r[0].step, r[1]) for r in exhaustive.best]
    assert bounded.bounded > 0 and bounded.sized + bounded.dropped + bounded.refused < bounded.total, bounded
    assert bounded.total == exhaustive.total and lines and lines == bounded.progress
    assert all(line.startswith("  plan-search: ") for line in lines), lines


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 1)])
def test_the_closed_form_pairs_are_the_action_lists(schedule, v):
    P, m = 4, 8
    facts = planner.formulas.ScheduleFacts(schedule, P, m, v)
    programs = [schedules.BUILDERS[schedule](P, m, p, v) for p in range(P)]
    assert facts.pairs == schedules.p2p_counts(programs, P * v)


def _alive_by_definition(program, stage):
    """zero_pipeline.alive_chunks as its docstring defines it: one pair per action of the list."""
    chunks = [a.chunk for a in program]
    backward = {c: [j for j, a in enumerate(program) if a.chunk == c and a.kind != "F"] for c in set(chunks)}
    return {(frozenset({chunk, *chunks[j + 1:j + 2]} if stage == 3 else ()),
             frozenset(c for c, js in backward.items() if js and js[0] <= j <= js[-1]))
            for j, chunk in enumerate(chunks)}


SCHEDULE_GRID = [(s, P, m, v) for s, vs in (("gpipe", (1,)), ("1f1b", (1,)), ("zb", (1,)), ("interleaved", (2, 3)))
                 for v in vs for P in (2, 3, 5) for m in sorted({1, 2, P, P + 1, 2 * P + 1, 3 * P, 3 * P + 1, 4 * P - 1,
                                                                 5 * P + 2})
                 if m >= (P if s == "interleaved" else 1)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb", "interleaved"])
def test_the_schedule_facts_equal_the_simulated_plans(schedule):
    """ScheduleFacts' closed forms and reductions equal what the whole action lists and communication plan give:
    in flight (schedules.in_flight_formula), sends alive (schedules.live_sends_of: 1f1b's closed form, m ≥ 3P
    reduced to 3P + m mod P), and the lists' gather runs, first chunk and alive chunks (zero_pipeline's)."""
    for s, P, m, v in (key for key in SCHEDULE_GRID if key[0] == schedule):
        facts = planner.formulas.ScheduleFacts(s, P, m, v)
        programs = schedules.build_programs(s, P, m, v)
        plan = schedules.communication_plan(programs, P * v)
        assert list(schedules.live_sends_of(s, P, m, v)) == [schedules.live_sends(steps) for steps in plan], \
            (s, P, m, v)
        for p, program in enumerate(programs):
            where = (s, P, m, v, p)
            assert facts.flight(p) == schedules.in_flight(program)[0], where
            assert facts.live(p) == schedules.live_sends(plan[p]), where
            assert facts.first_chunk(p) == program[0].chunk, where
            assert all(facts.runs(p, c) == zero_pipeline.gather_runs(program, c)
                       for c in schedules.rank_chunks(p, P, v)), where
            for stage in (2, 3):
                assert facts.alive(p, stage) == zero_pipeline.alive_chunks(program, stage) \
                       == _alive_by_definition(program, stage), where
