"""Helpers shared by the benchmark scripts: the --device flag, alternating timing that waits for the GPU, a
working directory a bench may clear (`own_root`), and a multi-rank launcher (gloo on CPU; one GPU per rank and NCCL
with --device cuda)."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import socket
import sys
import statistics
import tempfile
import time

import torch
import torch.multiprocessing as mp

# Collectives on CUDA tensors go over NCCL, those on CPU tensors (a step time, a loss to print) over gloo.
CUDA_BACKEND = "cpu:gloo,cuda:nccl"


def add_device_argument(parser) -> None:
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: one GPU per rank, NCCL for the collectives, autocast on cuda")


def synchronize() -> None:
    """Wait for this process's GPU work. CUDA kernels are asynchronous: a clock read without this measures the
    launches, not the work. A no-op on CPU (CUDA never initialised)."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def alternate(candidates: dict, steps: int, warmup: int = 2) -> dict:
    """Time each callable `steps` times, interleaved so machine noise hits all alike.

    The order rotates every round (a b c, b c a, c a b, ...): a variant that always ran right after another
    would inherit its cache and allocator state, which biased fixed-order runs by a few percent here.
    Returns {name: median seconds}. Warm-up rounds (allocation, first-call costs) are not timed. On a GPU each
    call is timed from a synchronised start to a synchronised end.
    """
    times = {name: [] for name in candidates}
    names = list(candidates)
    for round_index in range(warmup + steps):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            fn = candidates[name]
            synchronize()
            start = time.perf_counter()
            fn()
            synchronize()
            if round_index >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


OWNER_MARK = ".written-by-a-bench"  # in a --root the bench created: what it may delete and rewrite


def own_root(parser, path: str, flag: str = "--root", clear: bool = False) -> str:
    """The directory a bench writes into (and clears between runs): one it created before (it holds the mark)
    or an empty or new one, which it marks now. Anything else (a file, a directory with other files, a path that
    cannot be created) is a parser error naming the flag: a bench never deletes or overwrites what it did not
    write. clear: empty it first (what an earlier run of the bench left)."""
    if os.path.exists(path) and not os.path.isdir(path):
        parser.error(f"{flag} {path}: a file; expected a new or empty directory (the bench clears it)")
    if os.path.isdir(path) and os.listdir(path) and not os.path.exists(os.path.join(path, OWNER_MARK)):
        parser.error(f"{flag} {path}: holds files this bench did not write; give a new or empty directory")
    try:
        os.makedirs(path, exist_ok=True)
        for name in os.listdir(path) if clear else ():
            entry = os.path.join(path, name)
            shutil.rmtree(entry) if os.path.isdir(entry) and not os.path.islink(entry) else os.remove(entry)
        with open(os.path.join(path, OWNER_MARK), "w") as f:
            f.write("created by a bench script of this repository: it may clear this directory\n")
    except OSError as e:
        parser.error(f"{flag} {path}: cannot be written ({e.strerror})")
    return path


def check_gpus(world: int, device: str) -> None:
    """--device cuda runs one rank per GPU: NCCL refuses two ranks on one device. Fail before spawning."""
    if device == "cuda":
        visible = torch.cuda.device_count()
        if visible < world:
            raise SystemExit(f"--device cuda needs {world} GPUs (one per rank, NCCL), {visible} visible")


def init_rank(rank: int, world: int, store: str, device: str) -> torch.device:
    """Join the process group of a spawned rank; return its device (GPU LOCAL_RANK mod the GPU count)."""
    import torch.distributed as dist

    if device == "cuda":
        os.environ.setdefault("LOCAL_RANK", str(rank))  # spawned on one machine: the local rank is the rank
        here = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(here)
        dist.init_process_group(CUDA_BACKEND, init_method=f"file://{store}", rank=rank, world_size=world,
                                device_id=here)
        return here
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    return torch.device("cpu")


def _rank_entry(rank, world, store, device, fn, args):
    import torch.distributed as dist

    init_rank(rank, world, store, device)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def launch(fn, world: int, *args, device: str = "cpu", start_method: str = "spawn"):
    """Run fn(rank, world, *args) on `world` ranks (fresh processes) and wait for them: gloo on CPU, or one GPU
    per rank with device="cuda" (fn finds its GPU as torch.cuda.current_device()). start_method "fork" (CPU
    only) saves each rank importing torch again, for a caller that has run nothing before the launch."""
    check_gpus(world, device)
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank_entry, args=(world, os.path.join(tmp, "store"), device, fn, args), nprocs=world,
                           start_method="spawn" if device == "cuda" else start_method)


def rank_device() -> torch.device:
    """This rank's device as init_rank set it: its GPU when CUDA is in use, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_initialized() else torch.device("cpu")


def _train_rank(rank: int, world: int, port: int, main, argv: list, log_path: str) -> None:
    """One rank of train.py, as torchrun would start it; rank 0's output goes to log_path."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    with open(log_path if rank == 0 else os.devnull, "w") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        sys.stdout = os.fdopen(1, "w", buffering=1)
        main(argv)


def train_on_forked_ranks(main, world: int, argv: list, out_dir: str, label: str) -> str:
    """`main(argv)` (train.main) on `world` forked ranks on a free port; what rank 0 printed (also in
    out_dir/label.log). A failed rank ends the bench with its exit codes and the log's tail."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = os.path.join(out_dir, f"{label}.log")
    context = multiprocessing.get_context("fork")
    ranks = [context.Process(target=_train_rank, args=(r, world, port, main, argv, log_path)) for r in range(world)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join()
    text = open(log_path).read()
    if any(p.exitcode for p in ranks):
        raise SystemExit(f"{label}: a rank failed (exit codes {[p.exitcode for p in ranks]}):\n{text[-3000:]}")
    return text
