"""Helpers shared by the benchmark scripts: alternating timing and a two-rank gloo launcher."""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch
import torch.multiprocessing as mp


def alternate(candidates: dict, steps: int, warmup: int = 2) -> dict:
    """Time each callable `steps` times, interleaved so machine noise hits all alike.

    The order rotates every round (a b c, b c a, c a b, ...): a variant that always ran right after another
    would inherit its cache and allocator state, which biased fixed-order runs by a few percent here.
    Returns {name: median seconds}. Warm-up rounds (allocation, first-call costs) are not timed.
    """
    times = {name: [] for name in candidates}
    names = list(candidates)
    for round_index in range(warmup + steps):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            fn = candidates[name]
            start = time.perf_counter()
            fn()
            if round_index >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def _rank_entry(rank, world, store, fn, args):
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def launch(fn, world: int, *args):
    """Run fn(rank, world, *args) on `world` gloo ranks (fresh processes) and wait for them."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank_entry, args=(world, os.path.join(tmp, "store"), fn, args), nprocs=world,
                           start_method="spawn")
