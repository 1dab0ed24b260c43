"""Multi-process test harness: run a function on N gloo ranks and collect what each returns.

    results = run_ranks(check_fn, world_size=4, arg1, arg2, timeout=120)

`check_fn(rank, world_size, *args)` runs in a fresh process with the default process group initialised.
By default that is gloo on CPU. With `TEST_BACKEND=nccl` (or `pytest --backend nccl`) each rank takes GPU
`rank` and the group is "cpu:gloo,cuda:nccl": collectives on CUDA tensors go over NCCL, those on CPU tensors
over gloo, so every test still runs; `device()` tells a test body where to put its tensors, and a test that needs more
ranks than there are GPUs is skipped with that reason. Its return value (tensors, numbers, dicts...) comes back in
`results[rank]`, so the assertion can live in the test itself. If any rank raises, every rank is killed and the test
fails with that rank's traceback; if the ranks do not all finish within `timeout` seconds (a hang: a mismatched
collective, a missing peer), they are killed and the test fails naming the ranks still running.

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

BACKEND_ENV = "TEST_BACKEND"  # gloo (default) | nccl
_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "numpy"])


def backend() -> str:
    """The backend of the multi-rank tests: $TEST_BACKEND (set by `pytest --backend`), gloo by default."""
    name = os.environ.get(BACKEND_ENV, "gloo")
    if name not in ("gloo", "nccl"):
        raise ValueError(f"{BACKEND_ENV}={name!r}: expected gloo or nccl")
    return name


def device():
    """Where a test body should build its tensors: CPU under gloo, this rank's GPU under nccl."""
    import torch
    import torch.distributed as dist

    if backend() == "nccl":
        return torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is `pid` (/proc, Linux): a launcher's workers."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass  # it ended while we looked
    return out


def backend_flags(nproc: int) -> list[str]:
    """`--backend` for a test that launches train.py with torchrun on `nproc` ranks: the suite's backend, said
    explicitly (left to itself, train.py picks NCCL whenever a GPU is visible, and gloo is what the suite asked
    for); under nccl, the test is skipped when fewer GPUs than ranks are visible."""
    import torch

    name = backend()
    if name == "nccl" and torch.cuda.device_count() < nproc:
        import pytest

        pytest.skip(f"needs {nproc} GPUs (one per rank) for {BACKEND_ENV}=nccl; {torch.cuda.device_count()} visible")
    return ["--backend", name]


def _to_cpu(value):
    """`value` with every tensor inside (plain dicts, lists and tuples, nested) moved to the CPU."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if type(value) is dict:
        return {k: _to_cpu(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _rank_main(fn, rank, world_size, store_path, threads, backend_name, args, kwargs, results):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    os.environ[BACKEND_ENV] = backend_name  # what device() answers in this rank
    try:
        if backend_name == "nccl":
            from train import set_numerics

            set_numerics(tf32=False, deterministic=True)  # bitwise replay and 1e-10 comparisons on GPUs too
            torch.cuda.set_device(rank)
            dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{store_path}", rank=rank,
                                    world_size=world_size, device_id=torch.device("cuda", rank))
        else:
            dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
        value = _to_cpu(fn(rank, world_size, *args, **kwargs))  # GPU tensors do not outlive their process
        buffer = io.BytesIO()
        torch.save(value, buffer)  # bytes, not shared-memory tensors: the rank may exit before they are read
        results.put(("ok", rank, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - everything must reach the parent, including SystemExit
        results.put(("error", rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            # No barrier here: a rank that failed must not wait for peers that never arrive.
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout: float = 120.0, backend_name: str | None = None,
              **kwargs) -> list:
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` ranks; return each rank's result.

    backend_name: force "nccl" or "gloo" for this call (default: `backend()`)."""
    import torch

    backend_name = backend_name or backend()
    if backend_name == "nccl":
        import pytest

        gpus = torch.cuda.device_count()
        if world_size > gpus:
            pytest.skip(f"needs {world_size} GPUs (one per rank) for {BACKEND_ENV}=nccl; {gpus} visible")

    threads = max(1, (os.cpu_count() or 1) // world_size)
    results = _CONTEXT.Queue()
    with tempfile.TemporaryDirectory(prefix="harness-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            _CONTEXT.Process(
                target=_rank_main,
                args=(fn, rank, world_size, store_path, threads, backend_name, args, kwargs, results),
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


def run_bench(name: str, argv: list) -> None:
    """`bench/<name>.py`'s main(argv) in this process, so that its ranks come from the warm fork server (a bench
    run as its own process pays torch's import in every rank). bench/ is on sys.path while it runs: the bench
    imports bench/common.py, and the fork server's ranks take this process's sys.path."""
    import importlib
    import sys

    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
    sys.path.insert(0, bench)
    try:
        importlib.import_module(name).main(argv)
    finally:
        sys.path.remove(bench)


def assert_runs_follow(results, ref_losses, ref_params: dict, tol: float) -> None:
    """Every rank's run (losses {step: loss}, params {name: (local, ShardInfo)}) equals the single-device
    reference within `tol`: each loss, each local piece against the reference tensor cut as its record says,
    and every logical tensor held by some rank."""
    import torch  # torch loads in the ranks' processes, not when the harness is imported

    seen = set()
    for losses, params, *_ in results:
        torch.testing.assert_close(torch.tensor(list(losses.values())),
                                   torch.tensor([ref_losses[step] for step in losses]), rtol=tol, atol=tol)
        for name, (local, info) in params.items():
            torch.testing.assert_close(local, info.shard_of(ref_params[name]), rtol=tol, atol=tol, msg=name)
            seen.add(name)
    assert seen == set(ref_params), set(ref_params) ^ seen  # every logical tensor is held somewhere


def traced_steps(run, total_steps: int, global_batch: int, seq: int, micro: int, clip: float, stop: int,
                 save_root=None, resume_root=None, drop_state: bool = False) -> tuple[dict, dict]:
    """Steps [start, stop) of a composed run on reference.global_batches(total_steps, global_batch, seq): each
    rank's micro-batches of B_μ = micro, cut by the axes (CP), traced by a fresh CommTracer naming the mesh's groups.
    start = 0, or the step of resume_root's latest checkpoint, loaded first; with save_root a checkpoint is written
    after `stop` (drop_state: the load may leave state of the checkpoint unread, --drop-state). Returns (losses by
    step, {(op, group): (calls, bytes) per step, traced})."""
    import ckpt
    from accounting.tracer import CommTracer
    from data import BatchSampler
    from optim import DynamicLossScaler
    from reference import global_batches, rank_micro_batches
    from step import train_step

    mesh, scaler, sampler = run.mesh, DynamicLossScaler(enabled=False), BatchSampler(10_000, seq, global_batch, 0)
    start = 0
    if resume_root:
        loader = ckpt.Checkpointer(ckpt.CheckpointConfig(resume_root, drop_state=drop_state), mesh, run.axes,
                                   run.device, log=lambda *a: 0)
        start = loader.resume("latest", run.layout, scaler, sampler, 0)
    run.tracer, losses = CommTracer(), {}
    for name, group in mesh.groups.items():
        if group is not None:
            run.tracer.name_group(group, name)
    for step, (x, y) in enumerate(global_batches(total_steps, global_batch, seq)):
        if start <= step < stop:
            batches = [(*b, None) for b in rank_micro_batches(x, y, mesh.index("dp"), mesh.size("dp"), micro)]
            for axis in run.axes:
                batches = axis.shard_batches(batches)  # CP cuts the sequences
            with run.tracer:
                losses[step] = train_step(run.layout, scaler, batches, mesh.group("dp_cp"), clip, run.autocast,
                                          run.device, model=run.model, schedule=run.schedule, axes=run.axes,
                                          data_size=mesh.size("dp")).loss
    steps = len(losses)
    traced = {key: (r.calls / steps, r.payload_bytes / steps) for key, r in run.tracer.records.items()}
    if save_root:
        saver = ckpt.Checkpointer(ckpt.CheckpointConfig(save_root), mesh, run.axes, run.device, log=lambda *a: 0)
        saver.save(stop, run.layout, scaler, sampler)
        saver.close()
    return losses, traced
