"""Multi-process test harness: run a function on N gloo ranks and collect what each returns.

    results = run_ranks(check_fn, world_size=4, arg1, arg2, timeout=120)

`check_fn(rank, world_size, *args)` runs in a fresh process with the default process group initialised
(gloo, CPU). Its return value (tensors, numbers, dicts...) comes back in `results[rank]`, so the assertion
can live in the test itself. If any rank raises, every rank is killed and the test fails with that rank's
traceback; if the ranks do not all finish within `timeout` seconds (a hang: a mismatched collective, a
missing peer), they are killed and the test fails naming the ranks still running.

Processes come from a fork server that has already imported torch, so each rank starts in a fraction of a
second instead of paying torch's ~2 s import again. Children are forked from that server, never from the
pytest process, so they inherit no OpenMP thread pool (forking after parallel work can deadlock).
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback

_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "numpy"])


def _rank_main(fn, rank, world_size, store_path, threads, args, kwargs, results):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
        value = fn(rank, world_size, *args, **kwargs)
        buffer = io.BytesIO()
        torch.save(value, buffer)  # bytes, not shared-memory tensors: the rank may exit before they are read
        results.put(("ok", rank, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - everything must reach the parent, including SystemExit
        results.put(("error", rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            # No barrier here: a rank that failed must not wait for peers that never arrive.
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout: float = 120.0, **kwargs) -> list:
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` gloo ranks; return each rank's result."""
    import torch

    threads = max(1, (os.cpu_count() or 1) // world_size)
    results = _CONTEXT.Queue()
    with tempfile.TemporaryDirectory(prefix="harness-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            _CONTEXT.Process(
                target=_rank_main,
                args=(fn, rank, world_size, store_path, threads, args, kwargs, results),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        outputs: dict[int, object] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(outputs) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(range(world_size)) - set(outputs))
                    raise AssertionError(f"timeout after {timeout:.0f}s: ranks {missing} did not finish (a hang?)")
                try:
                    status, rank, payload = results.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if r not in outputs and p.exitcode not in (None, 0)]
                    if dead:
                        codes = {r: procs[r].exitcode for r in dead}
                        raise AssertionError(f"ranks {dead} died without reporting (exit codes {codes})")
                    continue
                if status == "error":
                    raise AssertionError(f"rank {rank} of {world_size} failed:\n{payload}")
                outputs[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        finally:
            for proc in procs:
                proc.join(timeout=5)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
    return [outputs[rank] for rank in range(world_size)]
