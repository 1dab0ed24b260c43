"""Tests for accounting/memory.py: the ZeRO and Korthikanti formulas against numbers worked out by hand, the CUDA
memory peaks over ranks, LiveTensors on a forward worked out by hand (what the kernels save is tested against
autograd in test_activations.py)."""

import pytest
import torch

from accounting import memory

from harness import run_ranks

# ---------------------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------------------


def test_param_counts_are_the_numel_of_what_is_built():
    """The logical model, a first and a last pipeline stage (the tied weight's own copy), dense and MoE."""
    from reference import build_model
    from reference import make_config

    for overrides in (dict(), dict(bias=False), dict(moe_experts=4, moe_every=2)):
        config = make_config(n_layer=3, **overrides)
        for holding in ({}, dict(layers=[0], head=False), dict(layers=[1, 2], embedding=False)):
            model = build_model(config, device="meta", **holding)
            assert memory.param_counts(config, **holding)["total"] == model.num_params(), (overrides, holding)


def test_zero_bytes_per_stage():
    psi, d = 1000, 4
    mixed = [memory.persistent_bytes(psi, "mixed", stage, d) for stage in range(4)]
    # mixed: b_w=2, b_g=2, b_o=12, so 16*psi = 16000 unsplit
    assert mixed[0] == {"weights": 2000, "grads": 2000, "optimizer": 12000, "total": 16000}
    assert mixed[1] == {"weights": 2000, "grads": 2000, "optimizer": 3000, "total": 7000}
    assert mixed[2] == {"weights": 2000, "grads": 500, "optimizer": 3000, "total": 5500}
    assert mixed[3] == {"weights": 500, "grads": 500, "optimizer": 3000, "total": 4000}
    fp32 = [memory.persistent_bytes(psi, "fp32", stage, d)["total"] for stage in range(4)]
    assert fp32 == [16000, 8000 + 2000, 4000 + 3000, 4000]
    # One rank: every stage is plain DDP.
    assert {memory.persistent_bytes(psi, "mixed", s, 1)["total"] for s in range(4)} == {16000}
    with pytest.raises(ValueError):
        memory.persistent_bytes(psi, "mixed", 4, d)


def test_korthikanti_activation_formulas():
    s, b, h, a = 1024, 2, 512, 8
    sbh = s * b * h
    unsplit = sbh * (34 + 5 * a * s / h)  # = sbh * 114
    assert unsplit == sbh * 114
    assert memory.activation_bytes_per_layer(s, b, h, a) == unsplit
    # t = 1 reduces to the unsplit formula, with or without sequence parallelism.
    assert memory.activation_bytes_per_layer(s, b, h, a, t=1, sequence_parallel=False) == unsplit
    assert memory.activation_bytes_per_layer(s, b, h, a, t=1, sequence_parallel=True) == unsplit
    # t = 4: sbh(10 + 24/4 + 80/4) = 36 sbh without SP; 114/4 = 28.5 sbh with SP.
    assert memory.activation_bytes_per_layer(s, b, h, a, t=4) == sbh * 36
    assert memory.activation_bytes_per_layer(s, b, h, a, t=4, sequence_parallel=True) == sbh * 28.5


def _memory_peaks(rank, world_size, peaks):
    import torch

    allocated, reserved = peaks[rank]
    torch.cuda.max_memory_allocated = lambda device=None: allocated  # this process only: no GPU here
    torch.cuda.max_memory_reserved = lambda device=None: reserved
    return memory.cuda_memory_peaks(torch.device("cpu"))


def test_cuda_memory_peaks_are_the_max_over_ranks():
    """Rank 1 allocates most, rank 0 reserves most: each maximum is reported, with the allocating rank."""
    values = [(100, 900), (300, 400)]
    for result in run_ranks(_memory_peaks, 2, values, timeout=60):
        assert result == (300, 900, 1)


class _Chain(torch.nn.Module):
    """a = 2x (nothing saved), b = exp(a) (saves b), c = b·w (saves b and w), d = c.sum(): then a is freed."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4, 8))

    def forward(self, x):
        a = x * 2
        b = a.exp()
        del a
        c = b * self.w
        return c.sum()


def test_live_tensors_counts_what_a_forward_makes_alive_together_and_what_it_saves():
    """By hand, 4×8 fp32 tensors of 128 bytes: after exp, a and b alive (256); after the mul, b and c (a freed:
    256); the sum adds 4 bytes: peak 260 at it. Saved and alive at the end: b (exp's output, the mul's input)."""
    chain = _Chain()
    x = torch.randn(4, 8, requires_grad=True)
    with memory.LiveTensors({"chain": chain}) as live:
        out = chain(x)
    peak = live.peaks["chain"]
    assert (peak.peak, peak.saved, peak.above_saved) == (260, 128, 132), peak
    assert peak.at.startswith("aten.sum")
    out.backward()  # the measured forward is an ordinary one
    assert torch.allclose(x.grad, 2 * torch.exp(2 * x.detach()))


def test_backward_rise_counts_what_a_backward_makes_less_the_saved_it_frees():
    """By hand: backward makes the seed gradient (4 bytes), b's gradient (grad·w, 128) and w's (grad·b: a
    parameter's, left out), then a's (b's gradient · b, 128) while b is still saved: 260 above the start; then b
    is freed and x's gradient (128) replaces a's, which never rises higher."""
    chain = _Chain()
    x = torch.randn(4, 8, requires_grad=True)
    with memory.LiveTensors({"chain": chain}) as live:
        out = chain(x)
    rise = memory.BackwardRise(live.kept["chain"])
    with rise:
        out.backward()
    assert rise.rise([chain.w.grad.untyped_storage()._cdata]) == 260
    assert rise.rise() == 260 + 128  # with w's gradient


# ---------------------------------------------------------------------------------------------------------
# MemoryTimeline: torch.profiler's allocation events, and what the profiler prints
# ---------------------------------------------------------------------------------------------------------

PROFILED_STEP = """
import os, sys
import torch
sys.path.insert(0, {root!r})
from accounting.memory import MemoryTimeline
older = torch.randn(1000, 1000)  # allocated before the profiler starts, freed inside it: the allocator logs that
with {profiler}:
    del older
    os.write(2, b"a warning of its own\\n")
"""


def test_memory_timeline_holds_back_the_allocators_line_and_no_other():
    """A profiled step frees the previous step's tensors, and torch's CPU allocator logs one line per process for
    that (CPUAllocator.cpp: "Memory block of unknown size ..."), on every rank. Under MemoryTimeline that line is
    not printed; another line written to standard error inside it still is. The bare profiler prints the line,
    so its absence is MemoryTimeline's doing (each in a fresh process: torch logs it once per process)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    bare = "torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)"
    runs = {name: subprocess.Popen([sys.executable, "-c", PROFILED_STEP.format(root=root, profiler=profiler)],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env=dict(os.environ, OMP_NUM_THREADS="1"))
            for name, profiler in (("timeline", "MemoryTimeline()"), ("bare", bare))}  # both at once
    errors = {name: run.communicate(timeout=120)[1] for name, run in runs.items()}
    assert all(run.returncode == 0 for run in runs.values()), errors
    assert memory.PROFILER_NOISE[0] in errors["bare"], errors["bare"]
    assert memory.PROFILER_NOISE[0] not in errors["timeline"], errors["timeline"]
    assert "a warning of its own" in errors["timeline"], errors["timeline"]
