"""--plan and --plan-search with --offload (parallel/offload.py's host memory, priced by planner/time_model.py).

- The plan's host-link bytes a step are the offloaded layout's own prediction (the plan builds an
  offload.OffloadZeroLayout on meta: role.offload is its `offload_figures`, whose `moved` is its `predicted_moved`,
  one function, `offload.figures`), equal to the formula by hand and to the search's formulas (planner/formulas.py);
  the device's persistent bytes are the resident layout's less what moved to the host.
- The time model's host terms, by hand; a faster host link or host memory shortens the step.
- Bad host flags and the refusals the search keeps: one line, exit status 2.
- bench/bench_scale_in.py's smoke: the tiny model on a device too small for it on half the GPUs without offload is
  placed there with it, unless the node's host memory cannot hold the offloaded state.
"""

import os
import sys
from dataclasses import replace

import pytest

from cli import flags
import plan
import planner.formulas
from parallel import offload
from planner import hardware, time_model
import train

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench"))
import bench_scale_in  # noqa: E402

WORLD = 4
TINY = ["--preset", "tiny", "--seq-len", "32"]


def _settings(extra, world=WORLD):
    argv = [*TINY, *extra]
    return time_model.plan_settings(flags.validate(flags.build_parser().parse_args(argv), world, axes=train.AXES))


def _built(settings, rank=0):
    with plan.fake_world(rank, settings.world_size):
        run = plan.build_role(settings, rank)
        return run.layout, time_model.role_of(run)


@pytest.mark.parametrize("extra,b_w,b_a", [
    (["--zero", "1", "--offload", "optimizer", "--dtype", "bf16", "--global-batch", "4"], 2, 2),  # m = 1
    (["--zero", "1", "--offload", "optimizer+master", "--dtype", "bf16", "--global-batch", "8"], 2, 4),  # m = 2
    (["--zero", "2", "--offload", "optimizer+master", "--dtype", "fp32", "--global-batch", "4"], 4, 4),
    (["--zero", "2", "--offload", "optimizer", "--dtype", "bf16", "--global-batch", "8", "--tp", "2"], 2, 4),
    (["--zero", "1", "--offload", "optimizer", "--dtype", "bf16", "--global-batch", "8", "--pp", "2"], 2, 4),
])
def test_the_plans_host_link_bytes_are_the_offloaded_layouts_own(extra, b_w, b_a):
    settings = _settings([*extra, "--micro-batch", "1"])
    layout, role = _built(settings)
    assert isinstance(layout, offload.OffloadZeroLayout)
    S = sum(u.shard_numel for u in layout.units)
    master = "optimizer+master" in extra
    by_hand = {"d2h": b_a * S, "h2d": b_w * S} if master else {"d2h": (b_a + 4) * S, "h2d": 4 * S}
    assert role.offload == layout.offload_figures() and role.offload.moved == layout.predicted_moved() == by_hand
    assert role.offload.host == layout.host_bytes()["predicted"] == layout.host_bytes()["held"]
    # what moved off the device: the resident layout's optimizer bytes less the offloaded one's
    resident = _built(_settings([a for a in extra if a not in ("--offload", "optimizer", "optimizer+master")]
                                + ["--micro-batch", "1"]))[1]
    assert resident.persistent["optimizer"] - role.persistent["optimizer"] == role.offload.freed
    assert role.offload.freed == (12 if master and b_w == 2 else 8) * S
    # the search's formulas (no padding at these shapes): the same figures, and the same predicted step
    for p in range(settings.shape.pp):
        built = _built(settings, settings.shape.rank_of(0, p, 0, 0))[1] if p else role
        formula = planner.formulas.formula_role(settings, p)
        assert formula.persistent == built.persistent
        assert formula.offload == built.offload
        hw, facts = hardware.PRESETS["h100"], time_model.layout_facts(settings)
        assert time_model.predict(formula, facts, hw).step == pytest.approx(time_model.predict(built, facts, hw).step,
                                                                            rel=0.01)


def test_the_host_terms_by_hand_and_their_bandwidths():
    """offload_seconds: the gradient's copy over the host link, hidden behind the last micro-batch's backward up to
    its length; the update's copies and the host's AdamW (its bytes over the node's bandwidth / G) exposed."""
    hw = hardware.PRESETS["h100"]
    figures = offload.figures(1e9, 2, 4, 4, master=False)
    t = time_model.offload_seconds(figures, backward_mb=0.05, world=64, hw=hw)
    assert t["gradient copy"] == pytest.approx(4e9 / 50e9)
    assert t["gradient copy exposed"] == pytest.approx(4e9 / 50e9 - 0.05)
    assert t["update copies"] == pytest.approx((4e9 + 4e9) / 50e9)  # the master in and back
    assert t["host AdamW"] == pytest.approx((4 + 24) * 1e9 / (300e9 / 8))
    assert time_model.offload_seconds(figures, 1.0, 2, hw)["host AdamW"] == pytest.approx(28e9 / 150e9)  # 2 share
    settings = _settings(["--zero", "1", "--offload", "optimizer+master", "--dtype", "bf16", "--global-batch", "8",
                          "--micro-batch", "1"])
    role, facts = planner.formulas.formula_role(settings, 0), time_model.layout_facts(settings)
    slow = time_model.predict(role, facts, hw)
    assert slow.update == pytest.approx(slow.host["host AdamW"] + slow.host["update copies"]
                                        + slow.host["gradient copy exposed"])
    fast = time_model.predict(role, facts, replace(hw, host_link_gbps=100, host_adam_gbps=600))
    assert fast.step < slow.step
    for what in ("gradient copy", "update copies", "host AdamW"):
        assert fast.host[what] == pytest.approx(slow.host[what] / 2), what


def test_the_plan_prints_what_moves_to_the_host(capsys):
    plan.main(["--world", "8", *TINY, "--zero", "1", "--offload", "optimizer", "--global-batch", "16",
               "--hw-host-link-gbps", "20", "--hw-host-adam-gbps", "100"])
    out = capsys.readouterr().out
    assert "host memory (--offload):" in out and "a node of 8 such GPUs, of 2048 GiB: fits" in out, out
    assert "at 20 GB/s a direction" in out and "streamed at 100/8 GB/s" in out and "offload=optimizer" in out, out


@pytest.mark.parametrize("argv,expected", [
    (["--plan", "--zero", "1", "--hw-host-link-gbps", "20"], "error: --hw-host-link-gbps needs --offload"),
    (["--plan-search", "--hw-host-adam-gbps", "20"], "error: --hw-host-adam-gbps needs --offload"),
    *(([f"--plan{search}", "--zero", "1", "--offload", "optimizer", flag, value], f"error: {flag} must be {must}")
      for search in ("", "-search") for flag in bench_scale_in.HOST_FLAGS
      for value, must in (("nan", "a finite number"), ("0", "positive"), ("-5", "positive"))),
    (["--plan", "--zero", "3", "--offload", "optimizer"], "error: --offload optimizer does not serve --zero 3"),
    (["--plan-search", "--offload", "optimizer", "--optimizer", "muon"], "error: --optimizer muon with --plan-search"),
    (["--plan-search", "--offload", "optimizer", "--dp-comm-bits", "4"],
     "error: --dp-comm-bits 4 with --plan-search: the search does not price the 4-bit all-reduce"),
])
def test_bad_host_flags_end_in_one_line(argv, expected, capsys):
    with pytest.raises(SystemExit) as stop:
        plan.main([*argv, "--world", "8", *TINY, "--global-batch", "16"])
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1 and err[0].startswith(expected), err


def test_bench_scale_in_smoke_runs(capsys):
    """The tiny model on 0.6 MiB devices: its best layout on 8 GPUs fits; on 4 none fits without offload (the
    smallest peak 739 KiB), both offload modes find one, whose device peak is within the 0.6 MiB."""
    rows = bench_scale_in.scale_in(bench_scale_in.SMOKE, 8)
    assert [(r["world"], r["offload"], r["fits"]) for r in rows] == [
        (8, "none", True), (4, "none", False), (4, "optimizer", True), (4, "optimizer+master", True)], rows
    assert rows[1]["smallest"] > 0.6 * 2**20
    for row in rows[2:]:
        assert row["peak"] <= 0.6 * 2**20 and "offload=" in row["layout"] and row["host_node"] > 0, row
    lines = bench_scale_in.table(rows)
    assert "no layout fits" in lines[3] and len(lines) == 6, lines
    # a node's host memory bounds offload too: 1 MiB a node holds no offloaded layout's state of its 4 GPUs
    tight = [*bench_scale_in.SMOKE, "--hw-host-memory-gib", str(2**20 / 2**30)]
    assert not bench_scale_in.best_of(tight, 4, "optimizer+master")["fits"]
