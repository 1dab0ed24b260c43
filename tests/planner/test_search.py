"""planner/search.py: --plan-search's branch and bound ranks what the exhaustive search ranks.

- The bound (time_model.step_bound, sizing in the order of the bounds, the three looks of each layout) returns the
  same best layouts, with the same predicted steps, as search(..., bound=False), which bounds no layout before
  sizing it; some layouts are never sized, and a progress line says how far it is.
- formulas.ScheduleFacts' closed-form p2p pairs equal schedules.p2p_counts of the action lists, every schedule.
"""

import pytest

from parallel import schedules
from planner import hardware
import planner.formulas
import planner.search
from planner.time_model import layout_name

TINY = ["--preset", "tiny", "--dtype", "fp32", "--seq-len", "32", "--global-batch", "16"]


def test_the_bound_keeps_the_exhaustive_best(monkeypatch):
    hw = hardware.PRESETS["h100"]
    exhaustive = planner.search.search(TINY, 8, hw, bound=False)
    lines = []
    monkeypatch.setattr(planner.search, "PROGRESS_SECONDS", 0.0)
    bounded = planner.search.search(TINY, 8, hw, out=lines.append)
    assert len(exhaustive.best) == 10
    assert [(layout_name(r[2]), r[0].step) for r in bounded.best] == \
           [(layout_name(r[2]), r[0].step) for r in exhaustive.best]
    assert bounded.bounded > 0 and bounded.sized + bounded.dropped + bounded.refused < bounded.total, bounded
    assert bounded.total == exhaustive.total and lines and lines == bounded.progress
    assert all(line.startswith("  plan-search: ") for line in lines), lines


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 1)])
def test_the_closed_form_pairs_are_the_action_lists(schedule, v):
    P, m = 4, 8
    facts = planner.formulas.ScheduleFacts(schedule, P, m, v)
    programs = [schedules.BUILDERS[schedule](P, m, p, v) for p in range(P)]
    assert facts.pairs == schedules.p2p_counts(programs, P * v)
