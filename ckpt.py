"""Atomic sharded checkpoints that reload on any mesh.

A checkpoint is one directory per step:

    <ckpt-dir>/step-00000200/
        shard-00000.pt      rank 0's tensors only (torch.save of {name: tensor}; torch.load(weights_only=True))
        shard-00001.pt      rank 1's ...
        manifest.json       what every file holds, the mesh, the step, a SHA-256 per file, every rank's scalars
        COMMITTED           written last: {"step", "manifest_sha256"}; without it the directory does not count

The manifest maps each LOGICAL tensor ("<kind>/<global name>", kind ∈ param | master | exp_avg | exp_avg_sq)
to its global shape, dtype, and the pieces that hold it: for each piece, the file, the entry name in it, the
splits (each: dim, num, index, fused segments; tensor and expert parallel) and the ZeRO flat range
[start, end) of the flattened split. That is exactly `model.StatePiece`, the unit every layout lists its state in
(`layout.state_pieces()`), so a new axis (pipeline, context, experts) joins by describing its pieces; this
file never learns what ZeRO or TP are.

Saving (every rank, at a step boundary):
1. snapshot: copy this rank's primary pieces (`primary=False` marks a replica whose twin elsewhere is
   written), and its RNG states to host memory. Training is blocked only for this copy (plus
   waiting for the previous save, if it is still persisting).
2. persist (on a background thread with `async_save`, else inline): write `shard-<rank>.pt` into
   `.tmp-step-<step>-<nonce>/`, hashing the bytes as they stream out, fsync it, then publish a small
   `rank-<rank>.json` (written to a temporary name, fsynced, renamed) with the file's size and checksum and
   the rank's pieces and scalars.
3. commit (rank 0's persist): wait until every rank's record exists, merge them into manifest.json, check
   that the pieces of each logical tensor cover it exactly once, fsync the manifest and the directory, rename
   the directory to `step-<step>`, fsync the parent, write COMMITTED (temporary name, fsync, rename) and fsync
   again. Then prune to the newest `keep` committed checkpoints (renamed away first, so a half-deleted one
   never looks committed).
   Why the filesystem is the rendezvous, not a collective: the persist thread runs while the main thread is
   inside training collectives; a second collective stream from another thread would interleave with them
   on the training groups (and be counted by comm.CommTracer as training traffic). A directory per step
   already needs a filesystem that every rank sees, so rank 0 simply waits for the other ranks' records to
   appear (with a timeout); no message crosses the network from the thread. The nonce (drawn by rank 0 and
   broadcast once at start-up) keeps a dead attempt's stray files out of a later attempt's commit; stale
   `.tmp-*` directories are deleted at start-up.
Synchronous saves run the same persist inline and end with an all-gather of every rank's outcome on the main
thread (the barrier: every rank returns after the commit, and a failure on one rank is raised on all).
Background failures are gathered the same way at the next save and at close.

Loading (`Checkpointer.resume`): candidates are the `step-*` directories, newest first (or the one step asked
for). Each is verified: marker present, manifest SHA-256 equal to the marker's, format known, every file name
a plain name inside the directory, every file present with the recorded size and SHA-256 (the files are
hashed round-robin across ranks, and the verdicts are gathered so all ranks agree). A bad one is reported
with its reason and the next older one is tried. Then, before a byte of tensor data is read, the manifest is
checked against the live state (`plan_load`): every logical tensor the model needs is there, with the model's
global shape, a dtype of the same family, and pieces that cover what this rank needs without overlapping.
Then the candidate is read whole into host memory (`StagedLoad`) and its scalars are tried on copies of the
sampler and loss scaler; only when every rank has succeeded (the verdicts are all-gathered) is anything copied
into the live state. So a checkpoint that is damaged, or intact but unfit (another model, a file that
`torch.load(weights_only=True)` refuses), is one more bad candidate: `latest` reports it and tries the next
older one, a step asked for by number is refused with one line naming it, the reason and what to do, and no
parameter is ever left half-overwritten. Tensors are read only with `torch.load(weights_only=True,
mmap=True)` and scalars only from JSON.

Resharding: every target piece is filled from the stored pieces of its logical tensor, one logical tensor at
a time. The loader builds the full logical tensor in host memory, but only from the stored pieces that
overlap what this rank needs (a boolean mask of the needed elements is intersected with each stored piece's
region), and the files are memory-mapped, so a rank touches only the bytes of the pieces it needs; then it
slices its targets out. Peak extra host memory is one logical tensor (plus a byte-mask of it) — the largest
is the embedding — a simpler bound than intersecting index ranges, and acceptable for a reference trainer.
Which stored tensor fills a target:
- `param/X` comes from `master/X` when the checkpoint has it: the fp32 master is what the 16-bit parameter
  was rounded from, so casting it gives the same parameter, and it is the more precise copy when the new
  layout keeps parameters in a wider dtype;
- `master/X` missing (a checkpoint of a layout whose parameters are the master weights, e.g. DDP fp32) is
  filled from `param/X`, cast;
- anything else must be present under its own key.
Per-rank state: on the same mesh (same D, P, C, T, E) each rank gets back exactly its own RNG states (torch
CPU, CUDA, Python `random`, numpy): deterministic replay, bitwise. The FP8 scaling state is logical state
(the same on every rank holding a linear, written once, kind `fp8/`), so it comes back on any mesh. On another mesh a rank's
old RNG stream has no meaning, so every generator is re-seeded from (seed, step, rank): the run is
deterministic for its mesh, and with dropout 0 the losses match the uninterrupted run to float tolerance
(coverage-equivalent resharding: the data cursor makes it consume the same global batches). Replicated
scalars (Adam step, LR position = the step, loss scaler, data cursor) come from the rank's own record on the
same mesh, else from rank 0's.

Accounting for this file (Ψ parameters, b_w/b_m bytes per parameter/master element, N ranks):
1. Replicated: nothing is held between saves except reusable host snapshot buffers. Split: the files;
   each logical piece is written once (replicas are not), spread over the ranks that hold copies.
2. Peak per device: the host snapshot of its written pieces (≤ its share of (b_w + b_m + 8)·Ψ with fp32
   Adam moments), reused from save to save; loading stages this rank's whole state in host memory (its share
   of (b_w + b_m + 8)·Ψ) plus one logical tensor and its byte-mask, and adds nothing on the device.
3. Messages: none on the critical path of a step. At start-up a broadcast of the nonce; at load an
   all_gather of each rank's verification verdict and load outcome; each save (and close) ends or begins with
   an all_gather of every rank's save outcome, so a failure on one rank is raised on all.
4. Restart state: it IS the restart state — parameters, master parameters, Adam moments and step, LR
   position, loss scaler, every rank's RNG states, the data cursor, and the FP8 scaling state.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import re
import shutil
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

import mfu
from model import ShardInfo, Split, StatePiece, counts_here, parameter_seed

FORMAT_VERSION = 2  # 2: a piece records a list of splits (1: one split as four fields; still read)
MANIFEST, MARKER = "manifest.json", "COMMITTED"
STEP_DIR = re.compile(r"^step-(\d{8})$")
KINDS = ("param", "master", "exp_avg", "exp_avg_sq", "fp8")  # fp8: an axis's scaling state (fp8.py)
FAULT_ENV = "CKPT_FAULT_PERSIST_SLEEP"  # "STEP:SECONDS": fault-injection tests sleep inside that step's persist
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete, corrupt, or does not fit the model: the message says which and why."""


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


# ---------------------------------------------------------------------------------------------------------
# Files: durable writes and checksums
# ---------------------------------------------------------------------------------------------------------


def _fsync_dir(path: str) -> None:
    """Make a directory's entries (creations, renames) durable: fsync of the files alone does not."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: str, payload: bytes) -> None:
    """Write to a temporary name, fsync, rename: a reader sees the old state or the whole new file."""
    tmp = path + ".part"
    with open(tmp, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class _HashingWriter:
    """A write-only file object that hashes what torch.save streams through it (no second read pass)."""

    def __init__(self, f):
        self.f, self.sha, self.bytes = f, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.sha.update(data)
        self.bytes += len(data)
        return self.f.write(data)

    def flush(self):
        self.f.flush()


def _sha256_file(path: str, chunk: int = 8 << 20) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            sha.update(block)
    return sha.hexdigest()


def _inside(directory: str, name) -> str:
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


def _dtype(name) -> torch.dtype:
    if name not in _DTYPES:
        raise CheckpointError(f"unknown dtype {name!r} in the manifest")
    return _DTYPES[name]


# ---------------------------------------------------------------------------------------------------------
# Per-rank state: RNG streams and the DDP layout's pieces
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
    mixed = parameter_seed(seed, f"rng/step{step}/stream{stream}")
    torch.manual_seed(mixed)  # seeds CUDA devices too
    random.seed(mixed)
    np.random.seed(mixed % 2**32)


def adam_step(optimizer) -> int:
    """The step count torch's Adam/AdamW uses for bias correction (all parameters share it).

    One step tensor is read: fused AdamW keeps them on the parameters' device, so this costs one host sync
    (per checkpoint), not one per parameter."""
    for state in optimizer.state.values():
        if "step" in state:
            return int(state["step"])
    return 0


def set_adam_step(optimizer, step: int) -> None:
    ensure_adam_state(optimizer)  # a state created later would start again from 0
    for state in optimizer.state.values():
        if "step" in state:
            state["step"].fill_(step)  # in place: keeps the dtype and device torch chose (see ensure_adam_state)


def ensure_adam_state(optimizer) -> None:
    """Create torch AdamW's state now, as its first step would (step 0, zero moments), so it can be loaded into.

    Mirrors torch.optim.Adam._init_group: the step count is a CPU scalar of the default float dtype, except
    under fused or capturable AdamW, whose kernels read it on the parameter's device (float32 when fused).
    The first step then finds the state present and behaves exactly as if it had created it. A checkpoint
    holds only the moments and one integer step, so it loads into either kind.
    """
    from torch.optim.optimizer import _device_dtype_check_for_fused, _get_scalar_dtype

    for group in optimizer.param_groups:
        fused, on_device = group.get("fused"), group.get("capturable") or group.get("fused")
        for p in group["params"]:
            state = optimizer.state[p]
            if not state:
                if fused:
                    _device_dtype_check_for_fused(p)  # the error torch's first step would raise
                state["step"] = (torch.zeros((), dtype=_get_scalar_dtype(is_fused=fused), device=p.device)
                                 if on_device else torch.tensor(0.0, dtype=_get_scalar_dtype(), device="cpu"))
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def replicated_state_pieces(params, optimizer, coords: dict, group_sizes: dict | None = None) -> list:
    """StatePieces of a layout where data-parallel ranks hold the same parameters and torch AdamW state (DDP).

    The parameters are the fp32 master weights here, so there are no `master/` pieces. Each logical piece is
    written once: only copies that model.counts_here picks over the model axes (`coords`: a TP-replicated
    LayerNorm on TP rank 0, the tied embedding on the first pipeline stage), and of the identical replicas in
    a parameter's data-parallel group (`coords[grad_group]` is this rank's index in it, `group_sizes` its
    size), by one member chosen so that each writes about 1/D of the bytes (greedy: the largest tensors
    first, each to the least-loaded member; the same on every rank as it only reads shapes).
    """
    ensure_adam_state(optimizer)
    params = [p for p in params if p.requires_grad]
    group_sizes = group_sizes or {}
    writer, load = {}, {}
    for index in sorted(range(len(params)), key=lambda i: -params[i].numel()):
        group = params[index].shard_info.grad_group
        loads = load.setdefault(group, [0] * group_sizes.get(group, 1))
        chosen = min(range(len(loads)), key=lambda d: loads[d])
        writer[index], loads[chosen] = chosen, loads[chosen] + params[index].numel()
    pieces = []
    for index, p in enumerate(params):
        info = p.shard_info
        primary = writer[index] == coords.get(info.grad_group, 0) and counts_here(info, coords)
        state = optimizer.state[p]
        for kind, tensor in (("param", p.detach()), ("exp_avg", state["exp_avg"]),
                             ("exp_avg_sq", state["exp_avg_sq"])):
            pieces.append(StatePiece(f"{kind}/{info.global_name}", tensor, info, primary=primary))
    return pieces


# ---------------------------------------------------------------------------------------------------------
# Where a piece sits in its logical tensor
# ---------------------------------------------------------------------------------------------------------


def _piece_record(shard: ShardInfo, flat_range) -> dict:
    return dict(splits=[[sp.dim, sp.num, sp.index, sp.segments] for sp in shard.splits],
                flat_range=list(flat_range) if flat_range is not None else None)


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


def _shard_from_record(key: str, global_shape: tuple, record: dict) -> tuple[ShardInfo, tuple | None]:
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


def _piece_numel(shard: ShardInfo, flat_range) -> int:
    return flat_range[1] - flat_range[0] if flat_range is not None else int(np.prod(shard.local_shape))


def _mark(mask: torch.Tensor, shard: ShardInfo, flat_range) -> torch.Tensor:
    """Set the elements of the piece (shard, flat_range) in a boolean tensor of the global shape."""
    local = shard.shard_of(mask).clone(memory_format=torch.contiguous_format)
    if flat_range is None:
        local.fill_(True)
    else:
        local.view(-1)[flat_range[0]:flat_range[1]] = True
    shard.place_into(mask, local)
    return mask


def _region(global_shape, shard: ShardInfo, flat_range) -> torch.Tensor:
    return _mark(torch.zeros(global_shape, dtype=torch.bool), shard, flat_range)


def _place(full: torch.Tensor, shard: ShardInfo, flat_range, values: torch.Tensor) -> None:
    """Write a stored piece into the full logical tensor (the inverse of _extract)."""
    if flat_range is None:
        shard.place_into(full, values.reshape(shard.local_shape))
        return
    local = shard.shard_of(full).clone(memory_format=torch.contiguous_format)
    local.view(-1)[flat_range[0]:flat_range[1]] = values.reshape(-1)
    shard.place_into(full, local)


def _extract(full: torch.Tensor, shard: ShardInfo, flat_range) -> torch.Tensor:
    local = shard.shard_of(full)
    return local if flat_range is None else local.reshape(-1)[flat_range[0]:flat_range[1]]


def _check_coverage(key: str, global_shape, pieces) -> None:
    """The stored pieces of a logical tensor cover every element exactly once (sizes add up, union is all)."""
    covered = torch.zeros(global_shape, dtype=torch.bool)
    total = 0
    for shard, flat in pieces:
        total += _piece_numel(shard, flat)
        _mark(covered, shard, flat)
    numel = int(np.prod(global_shape))
    if total != numel or not bool(covered.all()):
        raise CheckpointError(f"{key}: the pieces hold {total} elements covering {int(covered.sum())} of"
                              f" {numel}: some part is missing or written twice (a layout's `primary` is wrong)")


# ---------------------------------------------------------------------------------------------------------
# Verifying and reading a checkpoint directory
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


def verify_checkpoint(path: str, rank: int = 0, world: int = 1) -> dict:
    """Return the manifest of the checkpoint at `path`, or raise CheckpointError saying what is wrong.

    Every check but the hashing is cheap and done whole; the SHA-256 of the files is checked for every
    `world`-th file starting at `rank` (so the ranks of a distributed load hash each file once between them).
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
        file_path = _inside(path, name)
        if not os.path.isfile(file_path):
            raise CheckpointError(f"{path}: shard file {name} is missing")
        size = os.path.getsize(file_path)
        if size != info["bytes"]:
            raise CheckpointError(f"{path}: shard file {name} has {size} bytes, the manifest says {info['bytes']}"
                                  f" (truncated or overwritten)")
    for key, entry in manifest.get("tensors", {}).items():
        for piece in entry["pieces"]:
            if piece.get("file") not in files:
                _inside(path, piece.get("file"))  # a path escaping the directory gets that message first
                raise CheckpointError(f"{path}: {key} names file {piece.get('file')!r}, which the manifest lacks")
    for name in sorted(files)[rank::world]:
        if _sha256_file(_inside(path, name)) != files[name]["sha256"]:
            raise CheckpointError(f"{path}: shard file {name} fails its SHA-256 checksum (corrupt)")
    return manifest


def _gist(error: Exception) -> str:
    """One line of an exception's message: torch.load's weights_only refusal spans a paragraph whose telling
    line is the unpickler's ("WeightsUnpickler error: Unsupported global: ...")."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return next((line for line in lines if line.startswith("WeightsUnpickler error")), lines[0] if lines else "")


class _ShardFiles:
    """Memory-mapped shard files, opened on first use: only the pages of the tensors read are touched."""

    def __init__(self, path: str, manifest: dict):
        self.path, self.manifest, self.open = path, manifest, {}

    def tensor(self, file: str, name: str) -> torch.Tensor:
        if file not in self.open:
            try:
                self.open[file] = torch.load(_inside(self.path, file), weights_only=True, mmap=True)
            except CheckpointError:
                raise
            except Exception as e:  # a weights_only refusal or a broken zip: both mean "not our file"
                raise CheckpointError(f"{self.path}: cannot load {file} ({type(e).__name__}: {_gist(e)})") from None
        tensors = self.open[file]
        if not isinstance(tensors, dict) or name not in tensors or not torch.is_tensor(tensors[name]):
            raise CheckpointError(f"{self.path}: {file} has no tensor {name!r}")
        return tensors[name]


def _source_key(key: str, tensors: dict) -> str:
    kind, name = key.split("/", 1)
    if kind == "param" and f"master/{name}" in tensors:
        return f"master/{name}"  # the fp32 master is what the parameter was rounded from: prefer it
    if key in tensors:
        return key
    if kind == "master" and f"param/{name}" in tensors:
        return f"param/{name}"  # params were the master weights (e.g. DDP fp32): cast them
    raise CheckpointError(f"the checkpoint has no {key}" + (f" (nor param/{name} to derive it from)"
                                                            if kind == "master" else ""))


@dataclass
class _LoadPlan:
    """How one logical tensor fills this rank's targets: the stored entry it comes from and the stored pieces
    that overlap what this rank needs."""

    key: str
    source: str
    global_shape: tuple
    dtype: torch.dtype
    targets: list
    records: list  # [(ShardInfo, flat range, manifest record)] of the stored pieces this rank reads


def plan_load(path: str, manifest: dict, pieces: list) -> list[_LoadPlan]:
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
        dtype = _dtype(entry.get("dtype"))
        if any(dtype.is_floating_point != t.tensor.dtype.is_floating_point for t in targets):
            raise CheckpointError(f"{path}: {source} is stored as {dtype}, the model's {key} is"
                                  f" {targets[0].tensor.dtype}")
        need = torch.zeros(global_shape, dtype=torch.bool)
        for target in targets:
            _mark(need, target.shard, target.flat_range)
        covered = torch.zeros(global_shape, dtype=torch.bool)
        records = []
        for record in entry.get("pieces", ()):
            shard, flat = _shard_from_record(source, global_shape, record)
            region = _region(global_shape, shard, flat)
            if bool((region & covered).any()):
                raise CheckpointError(f"{path}: {source} has overlapping pieces in the manifest")
            covered |= region
            if bool((region & need).any()):  # pieces nobody here needs are never read
                records.append((shard, flat, record))
        if bool((need & ~covered).any()):
            raise CheckpointError(f"{path}: the pieces of {source} do not cover the part this rank needs")
        plans.append(_LoadPlan(key, source, global_shape, dtype, targets, records))
    return plans


class StagedLoad:
    """A checkpoint read into host memory, not yet in the live state: `commit()` copies it in.

    Reading everything first makes a load all or nothing: a tensor that turns out unreadable halfway (a shard
    `torch.load(weights_only=True)` refuses, a piece of the wrong size) abandons the load with every parameter
    and moment untouched, so the run can try an older checkpoint or stop cleanly. The price is host memory
    for this rank's state (its share of (b_w + b_m + 8)·Ψ), on top of one logical tensor being assembled.
    """

    def __init__(self, path: str, manifest: dict, pieces: list):
        self.path, self.manifest, self.bytes_read = path, manifest, 0
        self.files = _ShardFiles(path, manifest)
        self.staged: list[tuple[torch.Tensor, torch.Tensor]] = []  # (target, its values in host memory)
        with torch.no_grad():
            for plan in plan_load(path, manifest, pieces):
                self._read(plan)

    def _read(self, plan: _LoadPlan) -> None:
        full = torch.empty(plan.global_shape, dtype=plan.dtype)
        for shard, flat, record in plan.records:
            values = self.files.tensor(record.get("file"), record.get("name"))
            if values.numel() != _piece_numel(shard, flat) or values.dtype != plan.dtype:
                raise CheckpointError(f"{self.path}: {record['file']}:{record['name']} holds {values.numel()}"
                                      f" {values.dtype} elements, the manifest says {_piece_numel(shard, flat)}"
                                      f" {plan.dtype} for {plan.source}")
            _place(full, shard, flat, values)
            self.bytes_read += values.numel() * values.element_size()
        for target in plan.targets:
            region = _extract(full, target.shard, target.flat_range)
            if region.numel() != target.tensor.numel():
                raise CheckpointError(f"{plan.key}: the target piece has {target.tensor.numel()} elements, its"
                                      f" place in the logical tensor {region.numel()}")
            self.staged.append((target.tensor, region.reshape(target.tensor.shape).to(target.tensor.dtype,
                                                                                        copy=True)))

    @torch.no_grad()
    def commit(self) -> int:
        """Copy every staged value into its live tensor; return the bytes read from the files."""
        for tensor, values in self.staged:
            tensor.copy_(values)
        self.staged = []
        return self.bytes_read


def load_pieces(path: str, manifest: dict, pieces: list) -> int:
    """Fill every target piece from the checkpoint, all or nothing (StagedLoad); return the bytes read.

    Works for any source and target layouts described by StatePieces (see the module docstring).
    """
    return StagedLoad(path, manifest, pieces).commit()


def read_logical(path: str) -> dict:
    """Every logical tensor of a (verified) checkpoint, whole: for inspection, export and tests."""
    manifest = verify_checkpoint(path)
    out, pieces = {}, []
    for key, entry in manifest["tensors"].items():
        shape = tuple(entry["global_shape"])
        out[key] = torch.empty(shape, dtype=_dtype(entry["dtype"]))
        pieces.append(StatePiece(key, out[key], ShardInfo(key.split("/", 1)[1], shape)))
    load_pieces(path, manifest, pieces)
    return out


# ---------------------------------------------------------------------------------------------------------
# The checkpointer: snapshot, persist, commit, prune; resume
# ---------------------------------------------------------------------------------------------------------


@dataclass
class _Staged:
    """A checkpoint chosen for resuming, read and checked, not yet applied (Checkpointer._stage)."""

    path: str
    manifest: dict
    staged: StagedLoad
    scalars: dict  # this rank's record's (its own on the same mesh, else rank 0's)
    same_mesh: bool
    rng: dict | None  # this rank's generator states (same mesh only)


@dataclass
class SaveStats:
    step: int
    path: str
    rank_bytes: int  # this rank's shard file
    blocked_s: float  # training time this save blocked: waiting for the previous one + snapshot (+ persist)
    waited_s: float  # of which waiting for the previous save's persist
    persist_s: float | None = None  # writing (+ commit on rank 0); None until it is done
    total_bytes: int | None = None  # all shard files; rank 0 only, after the commit
    num_files: int | None = None


class WriterLock:
    """One run writes a checkpoint directory at a time: an exclusive flock on `<root>/.lock`, held by rank 0
    for the whole run. The kernel drops it when the process dies, however it dies, so a killed run never
    leaves it stuck; the file names the holder for the error a second writer gets."""

    def __init__(self, root: str):
        import fcntl

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


class Checkpointer:
    """Saves and resumes a training run's complete state under `root` (see the module docstring).

    Every rank constructs one (it broadcasts a nonce) and calls `save`/`resume`/`close` at the same points.
    The layout provides `state_pieces()` and an `optimizer_step_count` property (Adam's t, settable); optionally
    `stage` (ZeRO). `axes` (step.Axis handles) add their own logical state as pieces (`state_pieces()`: FP8's
    amax histories and scales, kind "fp8") and hear `state_loaded()` after a resume. `exclusive`: hold the
    directory's WriterLock until `close()` (a training run: a second run writing the same directory is
    refused at start, on every rank, before either touches the other's files).
    """

    def __init__(self, root: str, mesh=None, keep: int = 2, async_save: bool = False, mtbf_hours=None,
                 device="cpu", log=print, commit_timeout_s: float = 600.0, run_record: dict | None = None,
                 axes=(), exclusive: bool = False):
        if keep < 2:
            raise ValueError(f"keep={keep}: at least 2, so a good checkpoint survives while the next is written")
        self.root, self.keep, self.async_save, self.mtbf_hours = root, keep, async_save, mtbf_hours
        self.axes = list(axes)
        # The flags that shape the run's trajectory (LR schedule, batch): saved, and compared on resume.
        self.run_record = dict(run_record or {})
        self.device, self.log, self.commit_timeout_s = torch.device(device), log, commit_timeout_s
        distributed = dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world = dist.get_world_size() if distributed else 1
        shape = mesh.shape if mesh is not None else None
        self.mesh_record = dict(world_size=self.world, dp=shape.dp if shape else self.world,
                                pp=shape.pp if shape else 1, cp=shape.cp if shape else 1,
                                tp=shape.tp if shape else 1, ep=shape.ep if shape else 1)
        self.coords = mesh.shape.coords(self.rank) if mesh is not None else {"dp": self.rank, "pp": 0, "cp": 0, "tp": 0}
        self._lock = None
        nonce = [None]
        if self.rank == 0:
            try:
                os.makedirs(root, exist_ok=True)
                self._lock = WriterLock(root) if exclusive else None
                for name in os.listdir(root):  # leftovers of a dead attempt can never be committed now
                    if name.startswith((".tmp-", ".trash-")):
                        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
                nonce = [os.urandom(4).hex()]
            except (CheckpointError, OSError) as e:  # told to every rank below, not raised here alone
                nonce = [CheckpointError(str(e))]
        if self.world > 1:
            dist.broadcast_object_list(nonce, src=0)  # before any rank creates a temporary directory
        if isinstance(nonce[0], CheckpointError):  # every rank refuses together
            raise CheckpointError(str(nonce[0]))
        self.nonce = nonce[0]
        self._thread, self._result, self._error = None, None, None
        self._host: dict[str, torch.Tensor] = {}  # snapshot buffers, reused (pinned on CUDA)
        self._clock = (time.perf_counter(), None)  # (time, step) of the last save: seconds per step for Young
        self.history: list[SaveStats] = []

    # -- saving ------------------------------------------------------------------------------------------

    def step_end(self, steps_done: int, every: int, last: bool, layout, scaler, sampler):
        """Call after every optimizer step: reports a finished background save; saves every `every` steps
        and after the last one."""
        self.poll()
        if (every and steps_done % every == 0) or last:
            return self.save(steps_done, layout, scaler, sampler)
        return None

    def save(self, step: int, layout, scaler, sampler) -> SaveStats:
        """Checkpoint the state after `step` completed optimizer steps (the data cursor is then `step`)."""
        start = time.perf_counter()
        self.wait()  # the next save waits for the previous one: its buffers are reused
        waited = time.perf_counter() - start
        snapshot = self._snapshot(step, layout, scaler, sampler)
        path = os.path.join(self.root, step_dir_name(step))
        stats = SaveStats(step=step, path=path, rank_bytes=0, blocked_s=0.0, waited_s=waited)
        if self.async_save:
            stats.blocked_s = time.perf_counter() - start
            self._thread = threading.Thread(target=self._persist_in_background, args=(snapshot, stats),
                                            name=f"ckpt-persist-{step}", daemon=True)
            self._thread.start()
        else:
            error = None
            try:
                self._persist_or_report(snapshot, stats)
            except Exception as e:  # noqa: BLE001 - every rank must hear of it, or the others wait forever
                error = f"rank {self.rank}: {type(e).__name__}: {e}"
            errors = self._agree(error)  # also the barrier: every rank returns after rank 0's commit
            if errors:
                raise CheckpointError(f"checkpoint save of step {step} failed: {'; '.join(errors)}")
            stats.blocked_s = time.perf_counter() - start
            self._report(stats)
        return stats

    def poll(self) -> None:
        """Report a background save that has finished, without waiting (a failure is kept for `wait`)."""
        if self._thread is not None and not self._thread.is_alive():
            self._join()

    def _join(self) -> None:
        if self._thread is None:
            return
        self._thread.join()
        self._thread = None
        if self._error is None:
            self._report(self._result)

    def wait(self) -> None:
        """Wait for the background save, if any, and agree across ranks that it succeeded.

        A persist can fail on one rank only (a full disk, rank 0's commit timing out); raising there alone
        would leave the others waiting in the next training collective. So every rank calls this at the
        same point (each save, and close), the outcomes are gathered, and all ranks raise together.
        """
        self._join()
        error, self._error = self._error, None
        errors = self._agree(f"rank {self.rank}: {error}" if error is not None else None)
        if errors:
            raise CheckpointError(f"background checkpoint save failed: {'; '.join(errors)}") from error

    def abandon(self) -> None:
        """The run is stopping (a signal): no wait, no collective. Rank 0 removes this run's temporary
        directories (a save cut short can never be committed now); the committed checkpoints stay."""
        if self.rank == 0 and os.path.isdir(self.root):
            for name in os.listdir(self.root):
                if name.startswith(".tmp-") and name.endswith(f"-{self.nonce}"):
                    shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)

    def close(self) -> None:
        """Finish the last save and agree that it is committed (call before destroying the process group)."""
        self.wait()
        if self.world > 1:
            dist.barrier()
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _host_copy(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        buffer = self._host.get(name)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
            self._host[name] = buffer
        buffer.copy_(tensor, non_blocking=tensor.is_cuda)
        return buffer

    def _state_pieces(self, layout) -> list:
        return layout.state_pieces() + [piece for axis in self.axes for piece in axis.state_pieces()]

    def _snapshot(self, step: int, layout, scaler, sampler) -> dict:
        """Host copies of everything this rank writes, taken at the step boundary."""
        tensors, entries, counts = {}, [], {}
        for piece in self._state_pieces(layout):
            if not piece.primary:
                continue
            if piece.key.split("/", 1)[0] not in KINDS:
                raise ValueError(f"state piece {piece.key!r}: kind must be one of {KINDS}")
            n = counts[piece.key] = counts.get(piece.key, -1) + 1
            name = piece.key if n == 0 else f"{piece.key}#{n}"
            tensors[name] = self._host_copy(name, piece.tensor)
            entries.append(dict(key=piece.key, name=name, global_shape=list(piece.shard.global_shape),
                                dtype=str(piece.tensor.dtype).removeprefix("torch."),
                                **_piece_record(piece.shard, piece.flat_range)))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the non-blocking copies have landed
        rng_tensors, rng_scalars = capture_rng_state(self.device)
        tensors.update(rng_tensors)
        data = dict(sampler.state_dict(), step=step)
        scalars = dict(step=step, adam_step=layout.optimizer_step_count, lr_step=step, scaler=scaler.state_dict(),
                       data=data, rng=rng_scalars, run=self.run_record)
        return dict(step=step, tensors=tensors, entries=entries, scalars=scalars,
                    layout=dict(name=type(layout).__name__, zero_stage=getattr(layout, "stage", 0)))

    def _persist_in_background(self, snapshot: dict, stats: SaveStats) -> None:
        try:
            self._persist_or_report(snapshot, stats)
            self._result = stats
        except BaseException as e:  # noqa: BLE001 - surfaced by wait() on the main thread
            self._error = e

    def _tmp_dir(self, step: int) -> str:
        return os.path.join(self.root, f".tmp-{step_dir_name(step)}-{self.nonce}")

    def _persist_or_report(self, snapshot: dict, stats: SaveStats) -> None:
        """_persist, and if it fails on a rank other than 0, a failure record rank 0's commit sees at once
        (instead of waiting for this rank's success record until the commit timeout)."""
        try:
            self._persist(snapshot, stats)
        except BaseException as e:
            if self.rank != 0:
                tmp = self._tmp_dir(snapshot["step"])
                os.makedirs(tmp, exist_ok=True)
                _write_durably(os.path.join(tmp, f"rank-{self.rank:05d}.failed"),
                               f"{type(e).__name__}: {e}".encode())
            raise

    def _persist(self, snapshot: dict, stats: SaveStats) -> None:
        start = time.perf_counter()
        step = snapshot["step"]
        tmp = self._tmp_dir(step)
        os.makedirs(tmp, exist_ok=True)
        file = f"shard-{self.rank:05d}.pt"
        with open(os.path.join(tmp, file), "wb") as f:
            writer = _HashingWriter(f)
            torch.save(snapshot["tensors"], writer)
            f.flush()
            os.fsync(f.fileno())
        self._fault_hook(step)
        record = dict(rank=self.rank, coords=self.coords, file=file, bytes=writer.bytes,
                      sha256=writer.sha.hexdigest(), pieces=snapshot["entries"],
                      tensors=sorted(k for k in snapshot["tensors"] if not k.split("/", 1)[0] in KINDS),
                      scalars=snapshot["scalars"], layout=snapshot["layout"])
        _write_durably(os.path.join(tmp, f"rank-{self.rank:05d}.json"), json.dumps(record).encode())
        stats.rank_bytes = writer.bytes
        if self.rank == 0:
            stats.total_bytes, stats.num_files = self._commit(tmp, step)
        stats.persist_s = time.perf_counter() - start

    def _fault_hook(self, step: int) -> None:
        """Tests only: sleep inside one step's persist (after the shard, before its record) so a kill lands there."""
        spec = os.environ.get(FAULT_ENV)
        if spec:
            fault_step, seconds = spec.split(":")
            if int(fault_step) == step:
                time.sleep(float(seconds))

    def _commit(self, tmp: str, step: int) -> tuple[int, int]:
        """Rank 0: merge the rank records into the manifest, check coverage, rename, mark, prune."""
        names = [os.path.join(tmp, f"rank-{r:05d}.json") for r in range(self.world)]
        deadline = time.monotonic() + self.commit_timeout_s
        while not all(os.path.exists(n) for n in names):
            failed = sorted(name for name in os.listdir(tmp) if name.endswith(".failed"))
            if failed:  # a rank's persist failed: say so now, not at the timeout
                with open(os.path.join(tmp, failed[0])) as f:
                    raise CheckpointError(f"step {step}: {failed[0].removesuffix('.failed')} failed to write its"
                                          f" shard ({f.read()}); {tmp} is left uncommitted")
            if time.monotonic() > deadline:
                raise CheckpointError(f"step {step}: not every rank wrote its shard within "
                                      f"{self.commit_timeout_s:.0f} s; {tmp} is left uncommitted")
            time.sleep(0.005)
        records = []
        for name in names:
            with open(name) as f:
                records.append(json.load(f))
        tensors = {}
        for record in records:
            for piece in record["pieces"]:
                entry = tensors.setdefault(piece["key"], dict(global_shape=piece["global_shape"],
                                                              dtype=piece["dtype"], pieces=[]))
                if entry["global_shape"] != piece["global_shape"] or entry["dtype"] != piece["dtype"]:
                    raise CheckpointError(f"step {step}: ranks disagree on the shape or dtype of {piece['key']}")
                entry["pieces"].append(dict(file=record["file"], name=piece["name"],
                                            splits=piece["splits"], flat_range=piece["flat_range"]))
        for key, entry in tensors.items():
            shape = tuple(entry["global_shape"])
            _check_coverage(key, shape, [_shard_from_record(key, shape, p) for p in entry["pieces"]])
        manifest = dict(
            format=FORMAT_VERSION, step=step, mesh=self.mesh_record, layout=records[0]["layout"],
            files={r["file"]: dict(rank=r["rank"], bytes=r["bytes"], sha256=r["sha256"]) for r in records},
            tensors=tensors,
            ranks=[dict(rank=r["rank"], coords=r["coords"], file=r["file"], tensors=r["tensors"],
                        scalars=r["scalars"]) for r in records],
        )
        manifest_bytes = json.dumps(manifest, indent=1).encode()
        _write_durably(os.path.join(tmp, MANIFEST), manifest_bytes)
        for name in names:
            os.remove(name)  # merged into the manifest
        _fsync_dir(tmp)
        final = os.path.join(self.root, step_dir_name(step))
        if os.path.exists(final):  # a rerun of this step (resumed from an older one): replace it
            trash = os.path.join(self.root, f".trash-{step_dir_name(step)}-{self.nonce}")
            os.replace(final, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.replace(tmp, final)
        _fsync_dir(self.root)
        marker = dict(step=step, manifest_sha256=hashlib.sha256(manifest_bytes).hexdigest())
        _write_durably(os.path.join(final, MARKER), json.dumps(marker).encode())
        _fsync_dir(final)
        self._prune()
        return sum(r["bytes"] for r in records), len(records)

    def _set_aside_newer_than(self, step: int) -> None:
        """Resuming from `step` abandons any newer checkpoint (another line of the run, or a bad one): rename
        it out of the candidates so that `latest` and pruning only ever see this run's line. Nothing is
        deleted: `abandoned-step-…` directories stay for the user to inspect or remove."""
        for newer, path in list_checkpoints(self.root):
            if newer > step:
                aside = os.path.join(self.root, f"abandoned-{os.path.basename(path)}-{self.nonce}")
                os.replace(path, aside)
                self.log(f"ckpt: resumed at step {step}, so {path} is set aside as {aside}")
        _fsync_dir(self.root)

    def _prune(self) -> None:
        committed = [(s, p) for s, p in list_checkpoints(self.root) if os.path.isfile(os.path.join(p, MARKER))]
        if len(committed) <= self.keep:
            return
        oldest_kept = committed[self.keep - 1][0]
        for step, path in list_checkpoints(self.root):
            if step < oldest_kept:
                trash = os.path.join(self.root, f".trash-{os.path.basename(path)}-{self.nonce}")
                os.replace(path, trash)  # atomically gone from the candidates, then deleted
                shutil.rmtree(trash, ignore_errors=True)

    def _report(self, stats: SaveStats | None) -> None:
        if stats is None:
            return
        self.history.append(stats)
        now, last_step = time.perf_counter(), self._clock[1]
        seconds_per_step = ((now - self._clock[0]) / (stats.step - last_step)
                            if last_step is not None and stats.step > last_step else None)
        self._clock = (now, stats.step)
        if self.rank != 0:
            return
        mode = "async" if self.async_save else "sync"
        size = (f"{mfu.format_bytes(stats.total_bytes)} in {stats.num_files} files"
                if stats.total_bytes is not None else f"{mfu.format_bytes(stats.rank_bytes)} (rank 0)")
        line = (f"ckpt step {stats.step} → {stats.path}: {size}; training blocked {stats.blocked_s * 1e3:.0f} ms"
                f" (waited {stats.waited_s * 1e3:.0f} ms for the previous save); persist"
                f" {stats.persist_s * 1e3:.0f} ms ({mode})")
        if self.mtbf_hours:
            cost = stats.blocked_s  # what a checkpoint costs training: C in Young's formula
            interval = mfu.young_checkpoint_interval(cost, self.mtbf_hours * 3600)
            every = f" ≈ every {interval / seconds_per_step:,.0f} steps" if seconds_per_step else ""
            line += (f"\nckpt Young interval sqrt(2·C·M) = {interval:,.0f} s{every} (C = {cost:.3f} s blocked,"
                     f" M = MTBF {self.mtbf_hours:g} h)")
            if self.async_save:
                line += f"; async: also ≥ the persist time {stats.persist_s:.2f} s"
        self.log(line)

    # -- resuming ----------------------------------------------------------------------------------------

    def _agree(self, error: str | None) -> list[str]:
        if self.world == 1:
            return [error] if error else []
        errors = [None] * self.world
        dist.all_gather_object(errors, error)
        return [e for e in errors if e]

    def _candidates(self, which) -> list[tuple[int, str]]:
        """(step, path) to try, newest first, the same list on every rank: all of them for "latest", else the
        one asked for (or an error naming what there is)."""
        candidates = list_checkpoints(self.root)
        if self.world > 1:  # everyone tries the same list in the same order
            box = [candidates]
            dist.broadcast_object_list(box, src=0)
            candidates = box[0]
        if which == "latest":
            return candidates
        wanted = [c for c in candidates if c[0] == int(which)]
        if not wanted:
            raise CheckpointError(f"--resume {which}: no {step_dir_name(int(which))} in {self.root} (have:"
                                  f" {', '.join(os.path.basename(p) for _, p in candidates) or 'none'})")
        return wanted

    def _stage(self, path: str, pieces: list, scaler, sampler) -> _Staged:
        """Verify the checkpoint at `path`, check that it fits this run, and read it into host memory; the live
        state is not touched (raises CheckpointError, or whatever a damaged file makes the readers raise)."""
        manifest = verify_checkpoint(path, self.rank, self.world)
        same_mesh = manifest["mesh"] == self.mesh_record
        record = manifest["ranks"][self.rank if same_mesh else 0]
        scalars = record["scalars"]
        if not isinstance(manifest["step"], int) or not isinstance(scalars["adam_step"], int) or (
                same_mesh and not isinstance(scalars["rng"], dict)):
            raise CheckpointError(f"{path}: the step, Adam step or RNG record of the manifest is malformed")
        # The scalars are tried on copies: a sampler that refuses them (another --seed) refuses before any
        # tensor is read, and before any live state changes.
        copy.deepcopy(sampler).load_state_dict(scalars["data"])
        copy.deepcopy(scaler).load_state_dict(scalars["scaler"])
        staged = StagedLoad(path, manifest, pieces)
        rng = {name: staged.files.tensor(record["file"], name) for name in record["tensors"]} if same_mesh else None
        return _Staged(path, manifest, staged, scalars, same_mesh, rng)

    def _refusal(self, which, rejected: list[str]) -> str:
        """The one-line error when nothing can be resumed: which checkpoint(s), why, and what to do."""
        if which != "latest":
            others = [os.path.basename(p) for s, p in list_checkpoints(self.root) if s != int(which)]
            return (f"cannot resume {rejected[0]} -- use --resume latest (the newest good"
                    f" checkpoint)" + (f" or another step ({', '.join(others)})" if others else "")
                    + ", or start without --resume")
        return (f"no checkpoint in {self.root} can be resumed ({len(rejected)} refused: {'; '.join(rejected)})"
                f" -- repair or move them aside, or start without --resume")

    def resume(self, which, layout, scaler, sampler, seed: int) -> int:
        """Load a checkpoint into the live state; return the step to continue from (0: none found).

        `which`: "latest" (the newest that verifies and fits this run; each bad one is reported and the next
        older tried) or a step number (that one, or an error). Every candidate is staged whole in host memory
        before anything live changes, and all ranks agree on each verdict, so a refused checkpoint leaves no
        parameter half-overwritten and every rank moves on (or raises) together.
        """
        start = time.perf_counter()
        candidates, pieces, rejected, chosen = self._candidates(which), self._state_pieces(layout), [], None
        for _, path in candidates:
            error = None
            try:
                chosen = self._stage(path, pieces, scaler, sampler)
            except (CheckpointError, OSError, ValueError, AttributeError, KeyError, IndexError, TypeError,
                    RuntimeError) as e:  # a damaged or foreign file can make any reader raise: all mean "bad"
                error = str(e) if isinstance(e, CheckpointError) else f"{path}: {_gist(e)} ({type(e).__name__})"
            if error is not None and not error.startswith(path):
                error = f"{path}: {error}"  # every reason names the checkpoint it is about
            errors = self._agree(error)
            if not errors:
                break
            chosen = None
            rejected.append(errors[0] + (f" (and on {len(errors) - 1} more ranks)" if len(errors) > 1 else ""))
            if which == "latest":  # (a checkpoint asked for by step is refused by the error itself)
                self.log(f"ckpt: refusing {rejected[-1]}; trying an older one")
        if chosen is None:
            if rejected:
                raise CheckpointError(self._refusal(which, rejected))
            self.log(f"ckpt: no checkpoint in {self.root}; starting from step 0")
            if self.rank == 0:
                self._set_aside_newer_than(0)  # only bad ones can be there: keep them out of this run's line
            return 0
        path, manifest, scalars, step = chosen.path, chosen.manifest, chosen.scalars, chosen.manifest["step"]
        bytes_read = chosen.staged.commit()
        for axis in self.axes:
            axis.state_loaded()
        layout.optimizer_step_count = scalars["adam_step"]
        scaler.load_state_dict(scalars["scaler"])
        sampler.load_state_dict(scalars["data"])
        same_mesh = chosen.same_mesh
        if same_mesh:  # deterministic replay: this rank's own generators, exactly
            restore_rng_state(chosen.rng, scalars["rng"], self.device)
        else:  # another mesh: old streams mean nothing here; fresh deterministic ones, alike within TP groups
            reseed_rng(seed, step, self.rank // self.mesh_record["tp"])
        saved_run = scalars.get("run", {})
        changed = {k: (saved_run[k], v) for k, v in self.run_record.items() if k in saved_run and saved_run[k] != v}
        if changed:  # e.g. extending --steps: legitimate, but the LR schedule is then not the saved run's
            self.log("ckpt: this run's flags differ from the checkpoint's (LR schedule and batch follow this run):"
                     + ", ".join(f" {k} {old}→{new}" for k, (old, new) in changed.items()))
        if self.rank == 0:
            self._set_aside_newer_than(step)
        seconds = time.perf_counter() - start
        how = "same mesh: every rank's RNG restored" if same_mesh else (
            f"resharded from mesh {manifest['mesh']} (RNG re-seeded from seed, step, rank // T)")
        self.log(f"ckpt: resumed from {path} at step {step} ({how}); loaded in {seconds * 1e3:.0f} ms,"
                 f" rank 0 read {mfu.format_bytes(bytes_read)}")
        self._clock = (time.perf_counter(), step)
        return step
