"""cpu_probe.py's formulas (and hardware.alpha_beta, the link's fit they feed): each checked against the model it
inverts, on figures built from known constants, so a wrong algebra cannot pass."""

import math

import pytest

import hardware
import mfu
import time_calibration
from cpu_probe import gemm_fraction, overlap_fraction


@pytest.mark.parametrize("world", [2, 4])
def test_alpha_beta_recovers_the_link_that_made_the_times(world):
    """t(M) = 2(N−1)·α + wire(M)/β at two sizes, from α = 300 µs and β = 0.8 GB/s: the fit returns them
    (to 1e-9 relative), and hardware.collective_seconds with them reproduces both times."""
    alpha, beta, sizes = 300e-6, 0.8e9, (4096, 4 << 20)
    steps = hardware.ring_steps("all_reduce", world)
    times = tuple(steps * alpha + mfu.wire_bytes("all_reduce", m, world) / beta for m in sizes)
    fit_alpha, fit_beta = hardware.alpha_beta("all_reduce", sizes, times, world)
    assert math.isclose(fit_alpha, alpha, rel_tol=1e-9) and math.isclose(fit_beta, beta, rel_tol=1e-9)
    hw = hardware.Hardware("fit", {"fp32": 1.0}, 20.0, 0.0, fit_beta / 1e9, fit_beta / 1e9, fit_alpha * 1e6,
                           fit_alpha * 1e6, gpus_per_node=world)
    for m, t in zip(sizes, times):
        assert math.isclose(hardware.collective_seconds("all_reduce", 1, m, list(range(world)), hw), t, rel_tol=1e-9)


def test_alpha_beta_stays_finite_when_noise_inverts_the_sizes():
    """The larger size timed faster (a preempted small one): β from the large one alone, α ≥ 0, both finite."""
    alpha, beta = hardware.alpha_beta("all_reduce", (4096, 4 << 20), (5e-3, 4e-3), 2)
    assert alpha >= 0 and math.isfinite(beta) and math.isclose(beta, (4 << 20) / 4e-3)


def test_gemm_fraction_prices_the_measured_block_at_its_time():
    """e = F / (peak·(t − bytes/HBM)): time_calibration.compute_seconds with e gives back t exactly."""

    flops, seconds, nbytes, hbm, peak = 3.2e8, 0.02, 4e7, 20e9, 60e9
    e = gemm_fraction(flops, seconds, nbytes, hbm, peak)
    calib = time_calibration.Calibration(gemm_fraction=e, gemm_half_dim=0.0, hbm_fraction=1.0, link_fraction=1.0)
    assert math.isclose(time_calibration.compute_seconds([(flops, 64)], 1.0, peak, nbytes, hbm, calib), seconds)
    assert gemm_fraction(flops, 1e-3, nbytes, hbm, peak) == flops / (peak * 1e-4)  # bytes' time > t: a tenth left


def test_overlap_fraction_of_hidden_serial_and_partial_transfers():
    """Fully hidden (t_both = max): 1; taking turns (t_both = sum): 0; half the shorter hidden: 0.5; clamped."""
    assert overlap_fraction(10.0, 4.0, 10.0) == 1.0
    assert overlap_fraction(10.0, 4.0, 14.0) == 0.0
    assert overlap_fraction(10.0, 4.0, 12.0) == 0.5
    assert overlap_fraction(10.0, 4.0, 20.0) == 0.0 and overlap_fraction(10.0, 4.0, 8.0) == 1.0
