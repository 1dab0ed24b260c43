"""Benches cannot rot: every script in bench/ has a `--smoke` mode (tiny shapes, seconds) and the suite runs it.

A bench is measured by hand, rarely; an API change that breaks it would otherwise go unnoticed until someone
needs its numbers (bench_ckpt.py once crashed for weeks on a renamed method). The smokes check that each script
runs end to end and prints its table, never its numbers (timings are for the bench's own side-by-side ratios).
bench_ckpt, bench_zero and bench_zero_accum run in-process in their axes' test files (their ranks come from the
harness's warm fork server), bench_scale_in in tests/planner/test_plan_offload.py (pure search, no ranks); the others
run here, each as its own process, as a user would start it.
"""

from __future__ import annotations

import glob
import importlib
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")

# bench script -> a line fragment its --smoke output must contain (its table or its ratios were printed)
SMOKE_PRINTS = {
    "bench_activations": "ratio",
    "bench_context_parallel": "C=2",
    "bench_coupling": "loss curve coselect vs in place",
    "bench_calibration": "rows within ±15%",
    "bench_ddp": "ratio",
    "bench_diloco": "DiLoCo R=2, H=2",
    "bench_endline": "layouts within ±25%",
    "bench_fp8": "× bf16",
    "bench_lowbit": "paper (Echo",
    "bench_model": "bf16 speed-up over fp32",
    "bench_moe": "step-time ratio to E=1",
    "bench_moe_balance": "global MaxVio",
    "bench_muon": "step-time ratio ZeRO-1 owner / gather",
    "bench_pipeline": "one executed step",
    "bench_precision": "Δ vs bf16",
    "bench_tp": "params/rank",
    "fault_ckpt": "resumed correctly",
    "goodput": "every final state bitwise equal to the uninterrupted run's",
}
RUN_ELSEWHERE = {  # script -> the test that runs its --smoke in-process
    "bench_ckpt": "tests/test_ckpt.py::test_bench_ckpt_smoke_runs",
    "bench_hf": "tests/interop/test_hf.py::test_bench_hf_smoke_runs",  # needs transformers: skipped without it
    "bench_scale_in": "tests/planner/test_plan_offload.py::test_bench_scale_in_smoke_runs",
    "bench_zero": "tests/test_zero.py::test_bench_zero_smoke_runs",
    "bench_zero_accum": "tests/test_zero.py::test_bench_zero_accum_smoke_runs",
}


def bench_scripts() -> list:
    return sorted(os.path.basename(path)[:-3] for path in glob.glob(os.path.join(BENCH, "*.py"))
                  if os.path.basename(path) != "common.py")


def test_every_bench_has_a_smoke_that_the_suite_runs():
    """A new bench without a smoke, or one nobody runs, fails here (so this list cannot silently go stale)."""
    scripts = bench_scripts()
    assert scripts, BENCH
    for name in scripts:
        with open(os.path.join(BENCH, name + ".py")) as f:
            assert '"--smoke"' in f.read(), f"bench/{name}.py has no --smoke mode"
        assert (name in SMOKE_PRINTS) != (name in RUN_ELSEWHERE), f"bench/{name}.py: run its smoke exactly once"
    for name, test in RUN_ELSEWHERE.items():
        path, function = test.split("::")
        with open(os.path.join(ROOT, path)) as f:
            assert f"def {function}(" in f.read(), f"{test} (which runs bench/{name}.py --smoke) is gone"
    assert set(SMOKE_PRINTS) | set(RUN_ELSEWHERE) == set(scripts), "a listed bench no longer exists"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SMOKE_PRINTS))
def test_bench_smoke_runs(name, tmp_path):
    cmd = [sys.executable, os.path.join(BENCH, name + ".py"), "--smoke"]
    if name in ("fault_ckpt", "goodput"):
        cmd += ["--root", str(tmp_path / name)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert SMOKE_PRINTS[name] in proc.stdout and "WRONG" not in proc.stdout, proc.stdout[-3000:]


def test_max_violation_is_the_loss_free_papers():
    """bench_moe_balance's MaxVio = (max load − mean load)/mean load over the experts (Wang et al. 2024), per row
    of a [layers, N] load: 0 when balanced, N − 1 when one expert takes every slot."""
    sys.path.insert(0, BENCH)
    try:
        max_violation = importlib.import_module("bench_moe_balance").max_violation
    finally:
        sys.path.remove(BENCH)
    loads = torch.tensor([[1, 1, 1, 1], [4, 0, 0, 0], [3, 1, 2, 2], [0, 5, 1, 2]])
    assert max_violation(loads).tolist() == [0.0, 3.0, 0.5, (5 - 2) / 2]
