"""resilience/goodput.py: the clock's causes add up to the wall time, a resumed run carries its predecessors' time, the
ledger is untrusted input, and the checkpoint-interval formulas against their definitions (bench/goodput.py measures
them under failures; its flags are checked here)."""

import argparse
import importlib.util
import math
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

import ckpt
from resilience import goodput
from resilience.ckpt_files import CheckpointError
from harness import backend_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class FakeTime:
    """A clock the test moves by hand: every duration is known exactly."""

    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def _a_run(now: FakeTime, started: float) -> goodput.Clock:
    """A clock whose process started at `started`, made 2 s later, then: start-up 3, restore 1, a step of 5 with an
    input stall of 0.5 inside it, a checkpoint 0.25, 0.75 s in no phase, eval 2."""
    clock = goodput.Clock(started=started, now=now)
    with clock.phase("startup"):
        now.advance(3)
    with clock.phase("restore"):
        now.advance(1)
    with clock.phase("train"):
        now.advance(2)
        with clock.phase("input"):  # the step's time pauses meanwhile
            now.advance(0.5)
        now.advance(3)
    with clock.phase("ckpt"):
        now.advance(0.25)
    now.advance(0.75)
    with clock.phase("eval"):
        now.advance(2)
    return clock


def test_the_causes_add_up_to_the_wall_time_exactly():
    now = FakeTime(1000.0)
    clock = _a_run(now, started=998.0)
    totals = clock.totals()
    assert totals == dict(train=5.0, startup=5.0, restart=0.0, restore=1.0, ckpt=0.25, lost=0.0, eval=2.0,
                          input=0.5, other=0.75)
    assert clock.wall() == 14.5 == sum(totals.values())


@pytest.mark.parametrize("under_load", [False, True])
def test_the_tables_mfu_is_marked_where_the_peak_was_measured_under_load(under_load):
    """As the step lines: an MFU against a peak that shared the cores is "?", and the line says why, once."""
    last = _a_run(FakeTime(1000.0), started=998.0).lines(1450, 200.0, 1e6, 1e9, 1, under_load=under_load)[-1]
    assert "MFU 10.00%" in last and "MFU 20.00%" in last, last  # 100 useful tok/s, 200 in the steps: × 1e6 / 1e9
    assert last.count("%?") == (2 if under_load else 0) and ("cannot be trusted" in last) == under_load, last


def test_an_open_phase_counts_up_to_now():
    now = FakeTime(0.0)
    clock = goodput.Clock(started=0.0, now=now)
    with clock.phase("ckpt"):
        now.advance(1.5)
        assert clock.totals()["ckpt"] == 1.5 and clock.totals()["other"] == 0.0


def test_a_resumed_run_adds_its_predecessors_time_and_the_gap_since_the_checkpoint_as_lost():
    now = FakeTime(1000.0)
    first = _a_run(now, started=998.0)
    with first.phase("ckpt"):  # the snapshot inside a save, 0.5 s into it
        now.advance(0.5)
        saved = first.state_pieces()[0].tensor.clone()
    now.advance(7)  # steps after the checkpoint, the crash, the relaunch: the new process starts at 1020
    started = now.t
    now.advance(2)  # its interpreter and imports, before main() makes the clock
    second = goodput.Clock(started=started, now=now)
    with second.phase("startup"):
        piece = second.state_pieces()[0]  # what the Checkpointer plans the load with
        now.advance(1)
    with second.phase("restore"):
        piece.tensor.copy_(saved)  # the load
        second.after_load(None, step=4)
        now.advance(0.5)
    with second.phase("train"):
        now.advance(4)
    totals = second.totals()
    before = dict(train=5.0, startup=5.0, restore=1.0, ckpt=0.75, eval=2.0, input=0.5, other=0.75)
    assert totals == dict(before, restart=3.0, restore=1.5, train=9.0, lost=7.0)  # its start-up is the restart's
    assert second.resumes == 1
    assert second.wall() == 15.0 + 7.0 + 7.5 == sum(totals.values())


def test_a_checkpoint_without_a_ledger_brings_no_predecessors():
    now = FakeTime(50.0)
    clock = goodput.Clock(started=50.0, now=now)
    clock.state_pieces()  # planned; the checkpoint (optional piece) had no goodput/job: nothing copied in
    clock.after_load(None, step=2)
    assert clock.resumes == 0 and clock.lost == 0.0 and float(clock.predecessors.sum()) == 0.0


@pytest.mark.parametrize("position,value", [(goodput.FIRST_CAUSE, -1.0), (goodput.SAVED_AT, math.nan),
                                            (goodput.RESUMES, 1.5), (goodput.FIRST_CAUSE + 3, math.inf)],
                         ids=["negative-seconds", "nan-time", "fractional-resumes", "infinite-seconds"])
def test_a_malformed_ledger_is_refused_in_one_line_naming_it(position, value):
    clock = goodput.Clock(started=10.0, now=FakeTime(10.0))
    piece = clock.state_pieces()[0]
    piece.tensor[position] = value
    with pytest.raises(CheckpointError, match=r"the checkpoint of step 6: goodput/job holds .* expected") as e:
        clock.after_load(None, step=6)
    assert "\n" not in str(e.value)


def test_an_unknown_cause_is_refused():
    with pytest.raises(ValueError, match="goodput cause 'lunch'"):
        with goodput.Clock(started=0.0).phase("lunch"):
            pass


def test_the_ledger_is_one_logical_copy_of_its_own_kind():
    piece = goodput.Clock(started=0.0).state_pieces()[0]
    assert piece.key == goodput.LEDGER_KEY and piece.key.split("/")[0] in ckpt.KINDS
    assert piece.primary and piece.optional and piece.tensor.dtype == torch.float64


# ---------------------------------------------------------------------------------------------------------
# The checkpoint interval
# ---------------------------------------------------------------------------------------------------------


def _argmin(f, low: float, high: float) -> float:
    """Golden-section search of a unimodal f on [low, high] (a flat minimum: f fixes its argmin to ~1e-8)."""
    ratio = (math.sqrt(5) - 1) / 2
    a, b = low, high
    while b - a > 1e-12 * b:
        c, d = b - ratio * (b - a), a + ratio * (b - a)
        if f(c) < f(d):
            b = d
        else:
            a = c
    return (a + b) / 2


@pytest.mark.parametrize("c,m,r", [(60.0, 86400.0, 0.0), (0.05, 60.0, 20.0), (1.0, 3600.0, 300.0)])
def test_young_interval_minimises_the_first_order_waste(c, m, r):
    tau = _argmin(lambda t: goodput.wasted_fraction(t, c, m, r), 1e-6, m)
    assert goodput.young_interval(c, m) == pytest.approx(tau, rel=1e-6)  # R/M adds a constant: same optimum


@pytest.mark.parametrize("c,m,r", [(60.0, 86400.0, 0.0), (0.05, 60.0, 20.0), (300.0, 3600.0, 60.0)])
def test_daly_interval_is_the_optimum_of_dalys_goodput(c, m, r):
    """Daly's τ_opt is his expansion of the exact optimum of T_wall = M·e^{R/M}(e^{(τ+C)/M} − 1)/τ per unit of
    work: within 0.1% of it up to C/M = 1/12, where Young's first-order τ* is 4% off."""
    tau = _argmin(lambda t: -goodput.daly_goodput(t, c, m, r), 1e-6, m)
    assert goodput.daly_interval(c, m) == pytest.approx(tau, rel=1e-3)


def test_dalys_goodput_tends_to_the_first_order_model_when_failures_are_rare():
    c, m, r, tau = 1.0, 1e7, 10.0, goodput.young_interval(1.0, 1e7)
    assert goodput.daly_goodput(tau, c, m, r) == pytest.approx(goodput.predicted_goodput(tau, c, m, r), abs=1e-6)


@pytest.mark.parametrize("o,k,m", [(0.25, 0.2, 60.0), (0.05, 2.0, 3600.0), (-0.1, 0.5, 5.0)])
def test_redundancys_goodput_is_its_overhead_without_preemptions_and_loses_k_per_preemption(o, k, m):
    """Bamboo's model (no checkpoint, every stage served): 1 − o without preemptions, (1 − o)·(1 − K/M): a
    preemption costs K seconds of (redundant) progress; with a share 1 − c restarted from a checkpoint, those
    cost R + τ/2 and the saves C/τ: checked against the expected lost time counted by hand."""
    assert goodput.redundancy_goodput(o, k, math.inf) == pytest.approx(1 - o, abs=1e-15)
    assert goodput.redundancy_goodput(o, k, m) == pytest.approx((1 - o) * (1 - k / m), rel=1e-12)
    c, r, tau, cost = 0.75, 20.0, 10.0, 0.5
    lost_per_second = cost / tau + (c * k + (1 - c) * (r + tau / 2)) / m
    assert goodput.redundancy_goodput(o, k, m, c, r, tau, cost) == pytest.approx((1 - o) * (1 - lost_per_second),
                                                                                  rel=1e-12)


def test_the_bench_flags_are_checked_in_one_line(capsys):
    bench = _bench_module()
    for argv, message in ((["--kills", "2"], "--kills 2.0: at least 3 expected kills per run"),
                          (["--factors", "0.5", "1", "2"], "--factors [0.5, 1.0, 2.0]: at least four"),
                          (["--steps", "3"], "--steps 3: at least 8")):
        with pytest.raises(SystemExit) as e:
            bench.parse_args(argv)
        assert e.value.code == 2
        assert message in capsys.readouterr().err.splitlines()[-1]


def _bench_module():
    """bench/goodput.py, imported under another name (the repository's resilience/goodput.py owns that one)."""
    spec = importlib.util.spec_from_file_location("bench_goodput", os.path.join(ROOT, "bench", "goodput.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_bench_writes_only_into_a_root_it_made_or_an_empty_one(tmp_path, capsys):
    """--root: a file, a directory of the user's or a path that cannot be made is one line naming the flag, and the
    user's files are untouched; a new or empty directory is marked as the bench's and accepted again later."""
    bench = _bench_module()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "corpus.txt").write_text("the user's")
    (tmp_path / "a-file").write_text("the user's")
    for root, message in ((tmp_path / "mine", "holds files this bench did not write"),
                          (tmp_path / "a-file", "a file; expected a new or empty directory"),
                          ("/proc/no-such-bench-root", "cannot be written")):
        with pytest.raises(SystemExit) as e:
            bench.parse_args(["--root", str(root)])
        assert e.value.code == 2
        assert f"--root {root}: {message}" in capsys.readouterr().err.splitlines()[-1]
    assert (tmp_path / "mine" / "corpus.txt").read_text() == "the user's" == (tmp_path / "a-file").read_text()
    for _ in range(2):  # new, then the bench's own
        assert bench.parse_args(["--root", str(tmp_path / "new")]).root == str(tmp_path / "new")
    (tmp_path / "new" / "corpus.txt").write_text("the bench's")
    assert bench.parse_args(["--root", str(tmp_path / "new")]).root == str(tmp_path / "new")
    bench.own_root(argparse.ArgumentParser(), str(tmp_path / "new"), clear=True)  # fault_ckpt.py's start
    assert os.listdir(tmp_path / "new") == [".written-by-a-bench"]


# ---------------------------------------------------------------------------------------------------------
# A real run, then a resumed one (train.py as a user starts it)
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """`python train.py` for 6 steps with checkpoints, its step-6 checkpoint removed (as if it had failed after
    step 4's save), then again with --resume to 6 (a restart after a failure), then with --resume to 8 (a new leg
    of a finished run): each timed from outside; the ledgers of the checkpoints the resumed ones load."""
    tmp = tmp_path_factory.mktemp("goodput")
    common = [sys.executable, os.path.join(ROOT, "train.py"), "--preset", "tiny", "--global-batch", "2",
              "--eval-every", "0", "--sample-tokens", "0", "--out-dir", str(tmp), "--ckpt-dir", str(tmp / "ck"),
              "--ckpt-every", "2", "--peak-tflops", "1", *backend_flags(1)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    out = {}
    legs = (("first", ["--steps", "6"]), ("second", ["--steps", "6", "--resume"]),
            ("third", ["--steps", "8", "--resume"]))
    for name, extra in legs:
        if name == "second":
            shutil.rmtree(tmp / "ck" / "step-00000006")  # the first run's last save never happened
            out["ledger"] = ckpt.read_logical(str(tmp / "ck" / "step-00000004"))[goodput.LEDGER_KEY].tolist()
        if name == "third":
            out["finished ledger"] = ckpt.read_logical(str(tmp / "ck" / "step-00000006"))[goodput.LEDGER_KEY].tolist()
        began = time.time()
        run = subprocess.run([*common, *extra], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
        out[name] = dict(run=run, began=began, seconds=time.time() - began)
        assert run.returncode == 0, run.stderr[-3000:]
    return out


@pytest.mark.slow
def test_a_run_reports_causes_that_add_up_to_its_wall_time_measured_from_outside(resumed):
    first = resumed["first"]
    table = goodput.parse_table(first["run"].stdout)
    causes = [table[c] for c in goodput.CAUSES]
    assert abs(sum(causes) - table["wall"]) <= 0.005 * len(causes) + 0.05  # printed to 0.01 s, the wall to 0.1 s
    assert min(causes) >= 0 and table["train"] > 0 and table["startup"] > 0 and table["lost"] == 0
    assert table["wall"] <= first["seconds"] + 0.1  # from the process's creation: inside the outside timer


@pytest.mark.slow
def test_a_resumed_run_reports_its_predecessors_time_from_the_checkpoint(resumed):
    ledger, second = resumed["ledger"], resumed["second"]
    saved = dict(zip(goodput.CAUSES, ledger[goodput.FIRST_CAUSE:]))
    table = goodput.parse_table(second["run"].stdout)
    assert table["startup"] == pytest.approx(saved["startup"], abs=0.006)  # the first process's, as saved
    assert table["restart"] > 0  # the second one's start-up
    lost = second["began"] - ledger[goodput.SAVED_AT]  # the snapshot → the second process's creation
    assert table["lost"] == pytest.approx(lost, abs=0.2)
    this_process = float(second["run"].stdout.split("(this process ")[-1].split(" s")[0])
    assert this_process <= second["seconds"] + 0.1  # from its creation: inside the outside timer
    assert table["wall"] == pytest.approx(sum(saved.values()) + table["lost"] + this_process, abs=0.15)
    assert "+ 1 earlier process and the gaps" in second["run"].stdout


@pytest.mark.slow
def test_resuming_a_finished_run_is_a_new_leg_that_lost_nothing(resumed):
    """The checkpoint of a run's last step: the time since it was no failure's (lost stays the saved one, no
    restart is added) and the new process's start-up is a start-up."""
    saved = dict(zip(goodput.CAUSES, resumed["finished ledger"][goodput.FIRST_CAUSE:]))
    third = resumed["third"]["run"].stdout
    table = goodput.parse_table(third)
    assert "a run that had finished" in third
    assert table["lost"] == pytest.approx(saved["lost"], abs=0.006)
    assert table["restart"] == pytest.approx(saved["restart"], abs=0.006)
    assert table["startup"] > saved["startup"] + 0.1  # this process's start-up joins the first one's
    this_process = float(third.split("(this process ")[-1].split(" s")[0])
    assert table["wall"] == pytest.approx(sum(saved.values()) + this_process, abs=0.15)
    assert "+ 2 earlier processes and the gaps" in third
