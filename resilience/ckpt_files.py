"""A checkpoint directory on disk, for ckpt.py: durable writes, checksums, the untrusted manifest's checks,
where a piece sits in its logical tensor, and the random generators a rank restores.

Nothing here knows about training: ckpt.py's Checkpointer calls these to save (write a file durably while
hashing it, record a piece, check that the pieces cover their logical tensor) and to load (verify a
directory, check every number the manifest gives before using it, read a piece, place it). A manifest is
untrusted input: any field may be missing, of the wrong type, out of range, or name a path outside the
directory, and every such case ends in a CheckpointError naming the checkpoint and the field, never in a
read outside the directory or an unpickled object (`torch.load(weights_only=True)` only).

    durable writes      fsync_path, write_durably, HashingWriter, sha256_file, WriterLock
    the directory       step_dir_name, list_checkpoints, newest_committed, wait_for_rank_records (the
                        commit's rendezvous), delete_checkpoint, prune, set_aside_newer_than,
                        remove_leftovers, verify_checkpoint
    untrusted fields    inside (file names), dtype_named, shard_from_record (splits, flat ranges),
                        check_coverage, ShardFiles (the shards, memory-mapped, weights only)
    piece geometry      piece_record, piece_numel, mark, region, place, extract
    random generators   capture_rng_state, restore_rng_state, reseed_rng
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import re
import shutil
import time
from dataclasses import dataclass

import numpy as np
import torch

from shard import ShardInfo, Split

FORMAT_VERSION = 2  # 2: a piece records a list of splits (1: one split as four fields; still read)
MANIFEST, MARKER = "manifest.json", "COMMITTED"
STEP_DIR = re.compile(r"^step-(\d{8})$")
KINDS = ("param", "master", "exp_avg", "exp_avg_sq", "momentum", "fp8", "precision", "moe", "diloco", "goodput",
         "lowbit")  # momentum: Muon's buffer of a matrix (optimizers/muon.py). An axis's own state: fp8.py's scaling,
# precision/recipe.py's step (what its stochastic rounding is keyed by),
# experts/router.py's bias, resilience/diloco.py's outer state and the inner state of its replicas r ≥ 1,
# parallel/lowbit.py's error feedback of DDP's buckets (per rank),
# resilience/goodput.py's ledger (the job's seconds by cause: accounting, not training state)
FAULT_ENV = "CKPT_FAULT_PERSIST_SLEEP"  # "STEP:SECONDS": fault-injection tests sleep inside that step's persist
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete, corrupt, or does not fit the model: the message says which and why."""


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


# ---------------------------------------------------------------------------------------------------------
# Durable writes and checksums
# ---------------------------------------------------------------------------------------------------------


def fsync_path(path: str) -> None:
    """Make a file's bytes, or a directory's entries (creations, renames), durable: a directory needs its own
    fsync, the files' alone do not make their names durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: str, payload: bytes) -> None:
    """Write to a temporary name, fsync, rename: a reader sees the old state or the whole new file."""
    tmp = path + ".part"
    with open(tmp, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class HashingWriter:
    """A write-only file object that hashes what torch.save streams through it (no second read pass)."""

    def __init__(self, f):
        self.f, self.sha, self.bytes = f, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.sha.update(data)
        self.bytes += len(data)
        return self.f.write(data)

    def flush(self):
        self.f.flush()


def sha256_file(path: str, chunk: int = 8 << 20) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            sha.update(block)
    return sha.hexdigest()


def injected_fault(step: int) -> None:
    """Tests only: sleep inside one step's persist (after the shard, before its record) so a kill lands there."""
    spec = os.environ.get(FAULT_ENV)
    if spec:
        fault_step, seconds = spec.split(":")
        if int(fault_step) == step:
            time.sleep(float(seconds))


class WriterLock:
    """One run writes a checkpoint directory at a time: an exclusive flock on `<root>/.lock`, held by rank 0
    for the whole run. The kernel drops it when the process dies, however it dies, so a killed run never
    leaves it stuck; the file names the holder for the error a second writer gets."""

    def __init__(self, root: str):
        path = os.path.join(root, ".lock")
        self.file = open(path, "a+")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.seek(0)
            holder = self.file.read().strip() or "another process"
            self.file.close()
            raise CheckpointError(f"--ckpt-dir {root} is being written by another run ({holder} holds {path});"
                                  f" two writers would replace each other's checkpoints: wait for it to end, or"
                                  f" use another --ckpt-dir") from None
        self.file.seek(0)
        self.file.truncate()
        self.file.write(f"pid {os.getpid()} on {os.uname().nodename}\n")
        self.file.flush()

    def release(self) -> None:
        self.file.close()  # closing the descriptor drops the flock


# ---------------------------------------------------------------------------------------------------------
# The directory: which checkpoints there are, the commit's rendezvous, pruning, whether one is intact
# ---------------------------------------------------------------------------------------------------------


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """(step, path) of every `step-XXXXXXXX` directory under root, newest first (committed or not)."""
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), os.path.join(root, name)) for name in os.listdir(root)
             if (m := STEP_DIR.match(name)) and os.path.isdir(os.path.join(root, name))]
    return sorted(found, reverse=True)


def newest_committed(root: str) -> tuple[int, str] | None:
    """(step, path) of the newest checkpoint with its COMMITTED marker (not verified: a report, not a load)."""
    return next(((step, path) for step, path in list_checkpoints(root)
                 if os.path.isfile(os.path.join(path, MARKER))), None)


def wait_for_rank_records(tmp: str, world: int, step: int, timeout_s: float) -> list[dict]:
    """The commit's rendezvous: every rank's `rank-<r>.json` in the step's temporary directory, once all have
    appeared; a rank's `.failed` record (its persist raised) or the timeout raises at once."""
    names = [os.path.join(tmp, f"rank-{r:05d}.json") for r in range(world)]
    deadline = time.monotonic() + timeout_s
    while not all(os.path.exists(n) for n in names):
        failed = sorted(name for name in os.listdir(tmp) if name.endswith(".failed"))
        if failed:  # a rank's persist failed: say so now, not at the timeout
            with open(os.path.join(tmp, failed[0])) as f:
                raise CheckpointError(f"step {step}: {failed[0].removesuffix('.failed')} failed to write its"
                                      f" shard ({f.read()}); {tmp} is left uncommitted")
        if time.monotonic() > deadline:
            raise CheckpointError(f"step {step}: not every rank wrote its shard within {timeout_s:.0f} s;"
                                  f" {tmp} is left uncommitted")
        time.sleep(0.005)
    records = []
    for name in names:
        with open(name) as f:
            records.append(json.load(f))
    return records


def delete_checkpoint(path: str, nonce: str) -> None:
    """Rename a checkpoint out of the candidates (atomic), then delete it: half-deleted, it never counts."""
    trash = os.path.join(os.path.dirname(path), f".trash-{os.path.basename(path)}-{nonce}")
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def prune(root: str, keep: int, nonce: str) -> None:
    """Keep the newest `keep` committed checkpoints: every step directory older than the oldest kept goes."""
    committed = [(s, p) for s, p in list_checkpoints(root) if os.path.isfile(os.path.join(p, MARKER))]
    if len(committed) <= keep:
        return
    oldest_kept = committed[keep - 1][0]
    for step, path in list_checkpoints(root):
        if step < oldest_kept:
            delete_checkpoint(path, nonce)


def set_aside_newer_than(root: str, step: int, nonce: str, log) -> None:
    """Resuming from `step` abandons any newer checkpoint (another line of the run, or a bad one): rename it
    out of the candidates so that `latest` and pruning only ever see this run's line. Nothing is deleted:
    `abandoned-step-…` directories stay for the user to inspect or remove."""
    for newer, path in list_checkpoints(root):
        if newer > step:
            aside = os.path.join(root, f"abandoned-{os.path.basename(path)}-{nonce}")
            os.replace(path, aside)
            log(f"ckpt: resumed at step {step}, so {path} is set aside as {aside}")
    fsync_path(root)


def remove_leftovers(root: str, prefixes: tuple, nonce: str | None = None) -> None:
    """Delete the temporary (`.tmp-`) or half-deleted (`.trash-`) directories under root: all of them at
    start-up (a dead attempt's can never be committed), only this run's (`nonce`) when it stops on a signal."""
    if not os.path.isdir(root):
        return
    for name in os.listdir(root):
        if name.startswith(prefixes) and (nonce is None or name.endswith(f"-{nonce}")):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def verify_checkpoint(path: str, rank: int = 0, world: int = 1) -> dict:
    """Return the manifest of the checkpoint at `path`, or raise CheckpointError saying what is wrong.

    Marker present, manifest SHA-256 equal to the marker's, format known, every file name a plain name inside
    the directory, every file present with the recorded size. Every check but the hashing is cheap and done
    whole; the SHA-256 of the files is checked for every `world`-th file starting at `rank` (so the ranks of
    a distributed load hash each file once between them).
    """
    marker_path, manifest_path = os.path.join(path, MARKER), os.path.join(path, MANIFEST)
    if not os.path.isfile(marker_path):
        raise CheckpointError(f"{path} is incomplete: no {MARKER} marker (the save was interrupted before its"
                              f" commit)")
    try:
        with open(marker_path) as f:
            marker = json.load(f)
        with open(manifest_path, "rb") as f:
            manifest_bytes = f.read()
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read the marker or manifest ({e})") from None
    if not isinstance(marker, dict) or hashlib.sha256(manifest_bytes).hexdigest() != marker.get("manifest_sha256"):
        raise CheckpointError(f"{path}: {MANIFEST} does not match the checksum in {MARKER} (corrupt or edited)")
    try:
        manifest = json.loads(manifest_bytes)
    except ValueError as e:
        raise CheckpointError(f"{path}: {MANIFEST} is not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") not in (1, FORMAT_VERSION):
        raise CheckpointError(f"{path}: unknown checkpoint format {manifest.get('format')!r}"
                              f" (this trainer reads format {FORMAT_VERSION})")
    files = manifest.get("files", {})
    for name, info in files.items():
        file_path = inside(path, name)
        if not os.path.isfile(file_path):
            raise CheckpointError(f"{path}: shard file {name} is missing")
        size = os.path.getsize(file_path)
        if size != info["bytes"]:
            raise CheckpointError(f"{path}: shard file {name} has {size} bytes, the manifest says {info['bytes']}"
                                  f" (truncated or overwritten)")
    for key, entry in manifest.get("tensors", {}).items():
        for piece in entry["pieces"]:
            if piece.get("file") not in files:
                inside(path, piece.get("file"))  # a path escaping the directory gets that message first
                raise CheckpointError(f"{path}: {key} names file {piece.get('file')!r}, which the manifest lacks")
    for name in sorted(files)[rank::world]:
        if sha256_file(inside(path, name)) != files[name]["sha256"]:
            raise CheckpointError(f"{path}: shard file {name} fails its SHA-256 checksum (corrupt)")
    return manifest


# ---------------------------------------------------------------------------------------------------------
# Untrusted fields: file names, dtypes, splits, flat ranges, coverage, the shard files themselves
# ---------------------------------------------------------------------------------------------------------


def inside(directory: str, name) -> str:
    """The path of file `name` in `directory`, refusing names that could leave it (manifests are untrusted)."""
    if (not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name
            or "\0" in name or os.path.isabs(name)):
        raise CheckpointError(f"{directory}: manifest names a file {name!r} that is not a plain file name inside "
                              f"the checkpoint directory; refusing to read it")
    path = os.path.join(directory, name)
    real_dir = os.path.realpath(directory)
    if os.path.dirname(os.path.realpath(path)) != real_dir:  # a symlink pointing out of the directory
        raise CheckpointError(f"{directory}: {name!r} resolves outside the checkpoint directory; refusing it")
    return path


def dtype_named(name) -> torch.dtype:
    if name not in _DTYPES:
        raise CheckpointError(f"unknown dtype {name!r} in the manifest")
    return _DTYPES[name]


def _splits_of_record(key: str, record: dict) -> list:
    """[[dim, num, index, segments], ...] of a manifest piece; format 1 stored one split as four fields."""
    if "splits" in record:
        splits = record["splits"]
        if not isinstance(splits, list) or not all(isinstance(sp, list) and len(sp) == 4 for sp in splits):
            raise CheckpointError(f"{key}: malformed splits in the manifest: {record}")
        return splits
    if record.get("split_dim") is None:
        return []
    return [[record.get("split_dim"), record.get("num_splits", 1), record.get("split_index", 0),
             record.get("segments", 1)]]


def shard_from_record(key: str, global_shape: tuple, record: dict) -> tuple[ShardInfo, tuple | None]:
    """Rebuild (ShardInfo, flat_range) from a manifest piece, checking every number (manifests are untrusted)."""
    shape, splits = list(global_shape), []
    for split in _splits_of_record(key, record):
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in split):
            raise CheckpointError(f"{key}: malformed split in the manifest: {record}")
        dim, num, index, segments = split
        if not (0 <= dim < len(shape) and num >= 1 and 0 <= index < num and segments >= 1
                and shape[dim] % (num * segments) == 0):
            raise CheckpointError(f"{key}: split {split} does not fit the shape {shape} (global {list(global_shape)})")
        shape[dim] //= num
        splits.append(Split(dim, num, index, segments))
    shard = ShardInfo(global_name=key.split("/", 1)[1], global_shape=tuple(global_shape), splits=tuple(splits))
    flat = record.get("flat_range")
    if flat is not None:
        local = int(np.prod(shard.local_shape))
        if not (isinstance(flat, list) and len(flat) == 2 and all(isinstance(v, int) for v in flat)
                and 0 <= flat[0] <= flat[1] <= local):
            raise CheckpointError(f"{key}: flat range {flat} is not inside its split of {local} elements")
        flat = tuple(flat)
    return shard, flat


def check_coverage(key: str, global_shape, pieces) -> None:
    """The stored pieces [(ShardInfo, flat range)] of a logical tensor cover every element exactly once (sizes
    add up, union is all)."""
    covered = torch.zeros(global_shape, dtype=torch.bool)
    total = 0
    for shard, flat in pieces:
        total += piece_numel(shard, flat)
        mark(covered, shard, flat)
    numel = int(np.prod(global_shape))
    if total != numel or not bool(covered.all()):
        raise CheckpointError(f"{key}: the pieces hold {total} elements covering {int(covered.sum())} of"
                              f" {numel}: some part is missing or written twice (a layout's `primary` is wrong)")


def gist(error: Exception) -> str:
    """One line of an exception's message: torch.load's weights_only refusal spans a paragraph whose telling
    line is the unpickler's ("WeightsUnpickler error: Unsupported global: ...")."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return next((line for line in lines if line.startswith("WeightsUnpickler error")), lines[0] if lines else "")


class ShardFiles:
    """Memory-mapped shard files, opened on first use: only the pages of the tensors read are touched."""

    def __init__(self, path: str):
        self.path, self.open = path, {}

    def tensor(self, file: str, name: str) -> torch.Tensor:
        if file not in self.open:
            try:
                self.open[file] = torch.load(inside(self.path, file), weights_only=True, mmap=True)
            except CheckpointError:
                raise
            except Exception as e:  # a weights_only refusal or a broken zip: both mean "not our file"
                raise CheckpointError(f"{self.path}: cannot load {file} ({type(e).__name__}: {gist(e)})") from None
        tensors = self.open[file]
        if not isinstance(tensors, dict) or name not in tensors or not torch.is_tensor(tensors[name]):
            raise CheckpointError(f"{self.path}: {file} has no tensor {name!r}")
        return tensors[name]


# ---------------------------------------------------------------------------------------------------------
# Piece geometry: a piece is the `shard` (splits) of its logical tensor, and of that the flat range [start, end)
# ---------------------------------------------------------------------------------------------------------


def piece_record(shard: ShardInfo, flat_range) -> dict:
    """What the manifest records of a piece's place (read back by shard_from_record)."""
    return dict(splits=[[sp.dim, sp.num, sp.index, sp.segments] for sp in shard.splits],
                flat_range=list(flat_range) if flat_range is not None else None)


def piece_numel(shard: ShardInfo, flat_range) -> int:
    return flat_range[1] - flat_range[0] if flat_range is not None else int(np.prod(shard.local_shape))


def mark(mask: torch.Tensor, shard: ShardInfo, flat_range) -> torch.Tensor:
    """Set the elements of the piece (shard, flat_range) in a boolean tensor of the global shape."""
    local = shard.shard_of(mask).clone(memory_format=torch.contiguous_format)
    if flat_range is None:
        local.fill_(True)
    else:
        local.view(-1)[flat_range[0]:flat_range[1]] = True
    shard.place_into(mask, local)
    return mask


def region(global_shape, shard: ShardInfo, flat_range) -> torch.Tensor:
    """The boolean mask of a piece's elements in its logical tensor."""
    return mark(torch.zeros(global_shape, dtype=torch.bool), shard, flat_range)


def place(full: torch.Tensor, shard: ShardInfo, flat_range, values: torch.Tensor) -> None:
    """Write a stored piece into the full logical tensor (the inverse of extract)."""
    if flat_range is None:
        shard.place_into(full, values.reshape(shard.local_shape))
        return
    local = shard.shard_of(full).clone(memory_format=torch.contiguous_format)
    local.view(-1)[flat_range[0]:flat_range[1]] = values.reshape(-1)
    shard.place_into(full, local)


def extract(full: torch.Tensor, shard: ShardInfo, flat_range) -> torch.Tensor:
    """A piece's elements out of the full logical tensor (a view where the geometry allows)."""
    local = shard.shard_of(full)
    return local if flat_range is None else local.reshape(-1)[flat_range[0]:flat_range[1]]


# ---------------------------------------------------------------------------------------------------------
# Random generators: a rank's own streams (same mesh), or fresh deterministic ones (another mesh)
# ---------------------------------------------------------------------------------------------------------


def capture_rng_state(device=None) -> tuple[dict, dict]:
    """(tensors, JSON scalars) of every random generator this process draws from."""
    tensors = {"rng/torch_cpu": torch.get_rng_state()}
    if device is not None and torch.device(device).type == "cuda":
        tensors["rng/cuda"] = torch.cuda.get_rng_state(device)
    version, internal, gauss_next = random.getstate()
    tensors["rng/python"] = torch.tensor(internal, dtype=torch.int64)
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    tensors["rng/numpy"] = torch.from_numpy(keys.astype(np.int64))
    scalars = dict(python_version=version, python_gauss_next=gauss_next, numpy_kind=kind, numpy_pos=int(pos),
                   numpy_has_gauss=int(has_gauss), numpy_cached_gaussian=float(cached))
    return tensors, scalars


def restore_rng_state(tensors: dict, scalars: dict, device=None) -> None:
    torch.set_rng_state(tensors["rng/torch_cpu"])
    if device is not None and torch.device(device).type == "cuda" and "rng/cuda" in tensors:
        torch.cuda.set_rng_state(tensors["rng/cuda"], device)
    random.setstate((scalars["python_version"], tuple(int(x) for x in tensors["rng/python"].tolist()),
                     scalars["python_gauss_next"]))
    np.random.set_state((scalars["numpy_kind"], tensors["rng/numpy"].numpy().astype(np.uint32),
                         scalars["numpy_pos"], scalars["numpy_has_gauss"], scalars["numpy_cached_gaussian"]))


def reseed_rng(seed: int, step: int, stream: int) -> None:
    """Another mesh: a fresh, deterministic stream per (seed, step, stream) for every generator.

    `stream` is the rank's position outside its tensor-parallel group (rank // T), as train.py seeds at
    start: the ranks of one TP group hold copies of the same activations and must draw the same dropout
    masks on them (tensor_parallel.TensorParallelRNG forks the generator for the split regions)."""
    mixed = int(np.random.SeedSequence([seed % 2**63, step, stream]).generate_state(1, np.uint64)[0]) % (2**63 - 1)
    torch.manual_seed(mixed)  # seeds CUDA devices too
    random.seed(mixed)
    np.random.seed(mixed % 2**32)


# ---------------------------------------------------------------------------------------------------------
# Loading: which stored pieces fill which live ones, checked against the untrusted manifest first
# ---------------------------------------------------------------------------------------------------------


@dataclass
class LoadPlan:
    """How one logical tensor fills this rank's targets: the stored entry it comes from and the stored pieces
    that overlap what this rank needs."""

    key: str
    source: str
    global_shape: tuple
    dtype: torch.dtype
    targets: list
    records: list  # [(ShardInfo, flat range, manifest record)] of the stored pieces this rank reads


def _source_key(key: str, tensors: dict) -> str:
    """The stored logical tensor that fills `key` (see the module docstring's "Which stored tensor")."""
    kind, name = key.split("/", 1)
    if kind == "param" and f"master/{name}" in tensors:
        return f"master/{name}"  # the fp32 master is what the parameter was rounded from: prefer it
    if key in tensors:
        return key
    if kind == "master" and f"param/{name}" in tensors:
        return f"param/{name}"  # params were the master weights (e.g. DDP fp32): cast them
    raise CheckpointError(f"the checkpoint has no {key}" + (f" (nor param/{name} to derive it from)"
                                                            if kind == "master" else ""))


def plan_load(path: str, manifest: dict, pieces: list) -> list[LoadPlan]:
    """Check that the checkpoint fits the live state before a byte of it is read, or raise CheckpointError.

    For every logical tensor the targets need: a stored source exists (see _source_key), its global shape is
    the model's, its dtype is known and of the same family (floating or not) as the target's, its stored
    pieces are well formed, do not overlap, and cover every element this rank needs.
    """
    stored = manifest.get("tensors")
    if not isinstance(stored, dict):
        raise CheckpointError(f"{path}: the manifest lists no tensors")
    by_key: dict[str, list] = {}
    for piece in pieces:
        if piece.key in stored or not piece.optional:  # optional: an axis's state its writer may not have had
            by_key.setdefault(piece.key, []).append(piece)
    plans = []
    for key, targets in by_key.items():
        try:
            source = _source_key(key, stored)
        except CheckpointError as e:
            raise CheckpointError(f"{path}: {e}, which the model has") from None
        entry = stored[source]
        global_shape = tuple(targets[0].shard.global_shape)
        if tuple(entry.get("global_shape", ())) != global_shape:
            raise CheckpointError(f"{path}: {source} has global shape {list(entry.get('global_shape', ()))} in the"
                                  f" manifest, but the model's {key} is {list(global_shape)}")
        dtype = dtype_named(entry.get("dtype"))
        if any(dtype.is_floating_point != t.tensor.dtype.is_floating_point for t in targets):
            raise CheckpointError(f"{path}: {source} is stored as {dtype}, the model's {key} is"
                                  f" {targets[0].tensor.dtype}")
        records = _needed_pieces(path, source, entry, global_shape, targets)
        plans.append(LoadPlan(key, source, global_shape, dtype, targets, records))
    return plans


def _needed_pieces(path: str, source: str, entry: dict, global_shape: tuple, targets: list) -> list:
    """[(ShardInfo, flat range, record)] of the stored pieces of `source` that overlap what the targets need;
    raises if any two stored pieces overlap or if they leave a needed element uncovered."""
    need = torch.zeros(global_shape, dtype=torch.bool)
    for target in targets:
        mark(need, target.shard, target.flat_range)
    covered = torch.zeros(global_shape, dtype=torch.bool)
    records = []
    for record in entry.get("pieces", ()):
        shard, flat = shard_from_record(source, global_shape, record)
        stored = region(global_shape, shard, flat)
        if bool((stored & covered).any()):
            raise CheckpointError(f"{path}: {source} has overlapping pieces in the manifest")
        covered |= stored
        if bool((stored & need).any()):  # pieces nobody here needs are never read
            records.append((shard, flat, record))
    if bool((need & ~covered).any()):
        raise CheckpointError(f"{path}: the pieces of {source} do not cover the part this rank needs")
    return records


def dropped_state(stored: dict, read: set) -> str:
    """The stored logical tensors no rank reads ("" when none), grouped by kind, layer and module: "param/...
    h.*.mlp.shared_experts.* (4 tensors)", "moe/transformer.h.*.mlp.expert_bias (2 tensors)" (a parameter's
    weight and bias are one module; other state keeps its own name). A parameter read through its master reads
    both; the goodput ledger is accounting, not training state."""
    read = read | {f"param/{key.split('/', 1)[1]}" for key in read if key.startswith("master/")}
    groups: dict[str, int] = {}
    for key in sorted(set(stored) - read):
        if not key.startswith("goodput/"):
            group = re.sub(r"\.h\.\d+\.", ".h.*.", key)
            if group.split("/", 1)[0] in ("param", "master", "optim"):
                group = group.rsplit(".", 1)[0] + ".*"
            groups[group] = groups.get(group, 0) + 1
    return ", ".join(f"{group} ({n} tensor{'s' if n > 1 else ''})" for group, n in groups.items())
