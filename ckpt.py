"""Atomic sharded checkpoints that reload on any mesh.

A checkpoint is one directory per step:

    <ckpt-dir>/step-00000200/
        shard-00000.pt      rank 0's tensors only (torch.save of {name: tensor}; torch.load(weights_only=True))
        shard-00001.pt      rank 1's ...
        manifest.json       what every file holds, the mesh, the step, a SHA-256 per file, every rank's scalars
        COMMITTED           written last: {"step", "manifest_sha256"}; without it the directory does not count

The manifest maps each LOGICAL tensor ("<kind>/<global name>", kind ∈ param | master | exp_avg | exp_avg_sq |
momentum | fp8 | moe) to its global shape, dtype, and the pieces that hold it: per piece the file, the entry in it,
the splits (dim, num, index, fused segments: tensor and expert parallel) and the ZeRO flat range [start, end) of the
flattened split.
That is `shard.StatePiece`, the unit every layout (and an axis, for its own state) lists its state in, so a new axis
joins by describing its pieces: this file never learns what ZeRO or TP are. The directory's side (durable writes,
checksums, the untrusted manifest's checks, piece geometry, the random generators, pruning) is resilience/ckpt_files.py.

Save, every rank at a step boundary: 1. snapshot this rank's primary pieces (`primary=False`: a replica whose
twin elsewhere is written) and RNG states to host buffers: training blocks only for this copy (and for the
previous save, if it is still persisting); 2. persist (on a background thread with async_save): write
`shard-<rank>.pt` into `.tmp-step-<step>-<nonce>/`, hashed as it streams out, fsync, then publish
`rank-<rank>.json` (size, checksum, pieces, scalars) durably; 3. commit (rank 0's persist): wait for every
record, merge them into manifest.json, check that the pieces of each logical tensor cover it exactly once,
fsync, rename the directory to `step-<step>`, fsync the parent, write COMMITTED durably; prune to the newest
`keep`. The filesystem is the rendezvous, not a collective: the persist thread runs while the main thread is
inside training collectives, and a second collective stream from another thread would interleave with them
(and be counted by tracer.CommTracer as training traffic). A rank whose persist fails writes
`rank-<rank>.failed`, so the commit gives up at once; the nonce (rank 0's, broadcast at start-up) keeps a dead
attempt's files out of a later commit. A synchronous save ends with an all-gather of every rank's outcome
(the barrier; a failure on one rank is raised on all); a background one's is gathered at the next save and
at close.

Resume: plan → read → reshard, all or nothing. Candidates are the `step-*` directories, newest first (or the step
asked for). Each is verified (marker, manifest checksum, format, file names, sizes, SHA-256 hashed round-robin across
ranks), planned against the live state before a byte of tensor data is read (`ckpt_files.plan_load`: each logical
tensor the model needs is there, with its global shape, a dtype of the same family, pieces that cover what this rank
needs without overlapping), read into host memory and resliced (`StagedLoad`: each logical tensor assembled from only
the stored pieces that overlap what this rank needs; the files are memory-mapped), and its scalars tried on copies of
the sampler and loss scaler. Only when every rank has succeeded (the verdicts are all-gathered) is anything copied into
the live state: a damaged or unfit checkpoint is one more bad candidate (`latest` reports it and tries the next older
one; a step asked for is refused in one line naming it, the reason and what to do), and no parameter is left
half-overwritten. `param/X` is filled from `master/X` when the checkpoint has it (what the 16-bit parameter was
rounded from), a missing `master/X` from `param/X`, cast (DDP fp32: the parameters are the masters), anything else
from its own key (an absent `optional` one keeps its live value); then `Axis.after_load`. On the same mesh (D, P, C,
T, E) each rank gets back its own RNG states (torch CPU, CUDA, Python, numpy): replay is bitwise. On another mesh
every generator is re-seeded from (seed, step, rank // T), and with dropout 0 the losses match the uninterrupted run
to float tolerance (the data cursor makes it consume the same global batches). Replicated scalars (Adam step, LR
position, loss scaler, data cursor) come from the rank's own record on the same mesh, else from rank 0's.

Accounting for this file (Ψ parameters, b_w/b_m bytes per parameter/master element):
1. Replicated: nothing is held between saves but reusable host snapshot buffers. Split: the files; each
   logical piece is written once (replicas are not), spread over the ranks that hold copies.
2. Peak per device: the host snapshot of its written pieces (≤ its share of (b_w + b_m + 8)·Ψ with fp32
   Adam moments), reused from save to save; a load stages this rank's whole state in host memory (the same
   share) plus one logical tensor and its byte-mask (the largest: the embedding); nothing on the device.
3. Messages: none on the critical path of a step. At start-up a broadcast of the nonce; at load a broadcast
   of the candidate list and an all_gather of every rank's verdict per candidate tried; each save (and
   close, then a barrier) ends or begins with an all_gather of every rank's save outcome.
4. Restart state: it IS the restart state: parameters, master parameters, Adam moments and step, LR
   position, loss scaler, every rank's RNG states, the data cursor, the FP8 scaling state (kind `fp8/`,
   logical: it comes back on any mesh), and the redundant experts' load averages (kind `moe/`, logical).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mesh import MeshShape
from resilience.ckpt_files import (CheckpointError, FORMAT_VERSION, HashingWriter, KINDS, LoadPlan, MANIFEST, MARKER,
                                   ShardFiles, WriterLock, capture_rng_state, check_coverage, delete_checkpoint,
                                   dropped_state, dtype_named, extract, fsync_path, gist, injected_fault,
                                   list_checkpoints, piece_numel, piece_record, place, plan_load, prune,
                                   remove_leftovers, reseed_rng, restore_rng_state, set_aside_newer_than,
                                   shard_from_record, step_dir_name, verify_checkpoint, wait_for_rank_records,
                                   write_durably)
from shard import ShardInfo, StatePiece


@dataclass(frozen=True)
class CheckpointConfig:
    """What a Checkpointer is told once (train.py: from --ckpt-dir, --keep, --async-ckpt)."""

    root: str
    keep: int = 2  # committed checkpoints kept
    async_save: bool = False  # persist on a background thread: training blocks only for the snapshot
    exclusive: bool = False  # hold the directory's WriterLock until close(): a training run
    lock: WriterLock | None = None  # that lock, already taken by this process (train.py: with the flags); rank 0's
    commit_timeout_s: float = 600.0  # how long rank 0's commit waits for every rank's record
    run_record: dict = field(default_factory=dict)  # flags that shape the trajectory: saved, compared on resume
    drop_state: bool = False  # --drop-state: a resume may leave state of the checkpoint unread (`dropped_state`)

    def __post_init__(self):
        if self.keep < 2:
            raise ValueError(f"--keep {self.keep}: at least 2, so a good checkpoint survives while the next is written")


@dataclass
class SaveStats:
    """One save, measured: what train.py's on_save callback hears (report.run.print_save formats it)."""

    step: int
    path: str
    async_save: bool
    rank_bytes: int = 0  # this rank's shard file
    blocked_s: float = 0.0  # training time this save blocked: waiting for the previous one + snapshot (+ persist)
    waited_s: float = 0.0  # of which waiting for the previous save's persist
    persist_s: float | None = None  # writing (+ commit on rank 0); None until it is done
    total_bytes: int | None = None  # all shard files; rank 0 only, after the commit
    num_files: int | None = None
    seconds_per_step: float | None = None  # wall time per step since the previous save or the resume


class Checkpointer:
    """Saves and resumes a training run's complete state under `config.root` (see the module docstring).

    Every rank constructs one (rank 0 draws the nonce and broadcasts it) and calls `save`/`resume`/`close` at
    the same points. The layout provides `state_pieces()` and an `optimizer_step_count` property (Adam's t,
    settable); `axes` (step.Axis handles; goodput.Clock) add their own logical state as pieces (`state_pieces()`:
    FP8's amax histories and scales, kind "fp8"). `on_save(stats)` hears every finished save, on every rank;
    `log` gets the resume's lines (on every rank: train.py passes print0).
    """

    def __init__(self, config: CheckpointConfig, mesh=None, axes=(), device="cpu", log=print, on_save=None):
        self.config, self.root, self.axes = config, config.root, list(axes)
        self.device, self.log, self.on_save = torch.device(device), log, on_save
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        shape = mesh.shape if mesh is not None else MeshShape(dp=self.world)  # the layout record
        self.mesh_record = dict(world_size=self.world, dp=shape.dp, pp=shape.pp, cp=shape.cp, tp=shape.tp,
                                ep=shape.ep, **({"replicas": shape.replicas} if shape.replicas else {}))
        self.coords = shape.coords(self.rank)
        self._lock = None
        self.nonce = self._start()
        self._thread, self._result, self._error = None, None, None
        self._host: dict[str, torch.Tensor] = {}  # snapshot buffers, reused (pinned on CUDA)
        self._clock = (time.perf_counter(), None)  # (time, step) of the last save or the resume
        self.history: list[SaveStats] = []
        self.resumed_run: dict = {}  # the run record of the checkpoint `resume` loaded (its flags, its --steps)

    # -- save: snapshot → persist → commit ---------------------------------------------------------------

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
        stats = SaveStats(step, os.path.join(self.root, step_dir_name(step)), self.config.async_save,
                          waited_s=time.perf_counter() - start)
        snapshot = self._snapshot(step, layout, scaler, sampler)
        if self.config.async_save:
            stats.blocked_s = time.perf_counter() - start
            self._thread = threading.Thread(target=self._persist_in_background, args=(snapshot, stats),
                                            name=f"ckpt-persist-{step}", daemon=True)
            self._thread.start()
            return stats
        error = None
        try:
            self._persist_or_report(snapshot, stats)
        except Exception as e:  # noqa: BLE001 - every rank must hear of it, or the others wait forever
            error = f"rank {self.rank}: {type(e).__name__}: {e}"
        errors = self._agree(error)  # also the barrier: every rank returns after rank 0's commit
        if errors:
            raise CheckpointError(f"checkpoint save of step {step} failed: {'; '.join(errors)}")
        stats.blocked_s = time.perf_counter() - start
        self._saved(stats)
        return stats

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
                                **piece_record(piece.shard, piece.flat_range)))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the non-blocking copies have landed
        rng_tensors, rng_scalars = capture_rng_state(self.device)
        tensors.update(rng_tensors)
        data = dict(sampler.state_dict(), step=step)
        scalars = dict(step=step, adam_step=layout.optimizer_step_count, lr_step=step, scaler=scaler.state_dict(),
                       data=data, rng=rng_scalars, run=self.config.run_record)
        return dict(step=step, tensors=tensors, entries=entries, scalars=scalars,
                    layout=dict(name=type(layout).__name__, zero_stage=getattr(layout, "stage", 0)))

    def _persist(self, snapshot: dict, stats: SaveStats) -> None:
        """Write this rank's shard and record into the step's temporary directory; rank 0 then commits."""
        start = time.perf_counter()
        step = snapshot["step"]
        tmp = self._tmp_dir(step)
        os.makedirs(tmp, exist_ok=True)
        file = f"shard-{self.rank:05d}.pt"
        with open(os.path.join(tmp, file), "wb") as f:
            writer = HashingWriter(f)
            torch.save(snapshot["tensors"], writer)
            f.flush()
            os.fsync(f.fileno())
        injected_fault(step)
        record = dict(rank=self.rank, coords=self.coords, file=file, bytes=writer.bytes,
                      sha256=writer.sha.hexdigest(), pieces=snapshot["entries"],
                      tensors=sorted(k for k in snapshot["tensors"] if not k.split("/", 1)[0] in KINDS),
                      scalars=snapshot["scalars"], layout=snapshot["layout"])
        write_durably(os.path.join(tmp, f"rank-{self.rank:05d}.json"), json.dumps(record).encode())
        stats.rank_bytes = writer.bytes
        if self.rank == 0:
            stats.total_bytes, stats.num_files = self._commit(tmp, step)
        stats.persist_s = time.perf_counter() - start

    def _commit(self, tmp: str, step: int) -> tuple[int, int]:
        """Rank 0: the records merged into the manifest, rename, mark, prune; (bytes of all shards, their number)."""
        records = wait_for_rank_records(tmp, self.world, step, self.config.commit_timeout_s)
        manifest_bytes = json.dumps(self._manifest(records, step), indent=1).encode()
        write_durably(os.path.join(tmp, MANIFEST), manifest_bytes)
        for record in records:
            os.remove(os.path.join(tmp, f"rank-{record['rank']:05d}.json"))  # merged into the manifest
        fsync_path(tmp)
        final = os.path.join(self.root, step_dir_name(step))
        if os.path.exists(final):  # a rerun of this step (resumed from an older one): replace it
            delete_checkpoint(final, self.nonce)
        os.replace(tmp, final)
        fsync_path(self.root)
        marker = dict(step=step, manifest_sha256=hashlib.sha256(manifest_bytes).hexdigest())
        write_durably(os.path.join(final, MARKER), json.dumps(marker).encode())
        fsync_path(final)
        prune(self.root, self.config.keep, self.nonce)
        return sum(r["bytes"] for r in records), len(records)

    def _manifest(self, records: list[dict], step: int) -> dict:
        """The rank records merged: each logical tensor with all its pieces, which must cover it exactly once
        (a layout bug, a piece written twice or by nobody, is refused here and not found at the next resume)."""
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
            check_coverage(key, shape, [shard_from_record(key, shape, p) for p in entry["pieces"]])
        return dict(
            format=FORMAT_VERSION, step=step, mesh=self.mesh_record, layout=records[0]["layout"],
            files={r["file"]: dict(rank=r["rank"], bytes=r["bytes"], sha256=r["sha256"]) for r in records},
            tensors=tensors,
            ranks=[dict(rank=r["rank"], coords=r["coords"], file=r["file"], tensors=r["tensors"],
                        scalars=r["scalars"]) for r in records],
        )

    def _saved(self, stats: SaveStats) -> None:
        """A save is committed (and agreed): record it, and tell on_save."""
        now, (then, last_step) = time.perf_counter(), self._clock
        if last_step is not None and stats.step > last_step:
            stats.seconds_per_step = (now - then) / (stats.step - last_step)
        self._clock = (now, stats.step)
        self.history.append(stats)
        if self.on_save is not None:
            self.on_save(stats)

    # -- the background persist, and every rank agreeing on its outcome ----------------------------------

    def poll(self) -> None:
        """Report a background save that has finished, without waiting (a failure is kept for `wait`)."""
        if self._thread is not None and not self._thread.is_alive():
            self._join()

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
        if self.rank == 0:
            remove_leftovers(self.root, (".tmp-",), self.nonce)

    def close(self) -> None:
        """Finish the last save and agree that it is committed (call before destroying the process group)."""
        self.wait()
        if self.world > 1:
            dist.barrier()
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            if self._error is None:
                self._saved(self._result)

    def _persist_in_background(self, snapshot: dict, stats: SaveStats) -> None:
        try:
            self._persist_or_report(snapshot, stats)
            self._result = stats
        except BaseException as e:  # noqa: BLE001 - surfaced by wait() on the main thread
            self._error = e

    def _persist_or_report(self, snapshot: dict, stats: SaveStats) -> None:
        """_persist, and if it fails on a rank other than 0, a failure record rank 0's commit sees at once
        (instead of waiting for this rank's success record until the commit timeout)."""
        try:
            self._persist(snapshot, stats)
        except BaseException as e:
            if self.rank != 0:
                tmp = self._tmp_dir(snapshot["step"])
                os.makedirs(tmp, exist_ok=True)
                write_durably(os.path.join(tmp, f"rank-{self.rank:05d}.failed"), f"{type(e).__name__}: {e}".encode())
            raise

    def _agree(self, error: str | None) -> list[str]:
        """Every rank's error (None: success), gathered: the same list on every rank."""
        if self.world == 1:
            return [error] if error else []
        errors = [None] * self.world
        dist.all_gather_object(errors, error)
        return [e for e in errors if e]

    def _start(self) -> str:
        """Rank 0 creates the directory, takes the writer lock (exclusive), deletes a dead attempt's leftovers
        and draws the nonce; every rank hears the nonce, or the error, before any creates a temporary."""
        nonce = [None]
        if self.rank == 0:
            try:
                os.makedirs(self.root, exist_ok=True)
                self._lock = self.config.lock or (WriterLock(self.root) if self.config.exclusive else None)
                remove_leftovers(self.root, (".tmp-", ".trash-"))  # a dead attempt's: never committed now
                nonce = [os.urandom(4).hex()]
            except (CheckpointError, OSError) as e:  # told to every rank below, not raised here alone
                nonce = [CheckpointError(str(e))]
        if self.world > 1:
            dist.broadcast_object_list(nonce, src=0)
        if isinstance(nonce[0], CheckpointError):  # every rank refuses together
            raise CheckpointError(str(nonce[0]))
        return nonce[0]

    def _tmp_dir(self, step: int) -> str:
        return os.path.join(self.root, f".tmp-{step_dir_name(step)}-{self.nonce}")

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

    # -- resume: choose a candidate (plan → read, staged), then copy it in -------------------------------

    def resume(self, which, layout, scaler, sampler, seed: int) -> int:
        """Load a checkpoint into the live state; return the step to continue from (0: none found).

        `which`: "latest" (the newest that verifies and fits this run) or a step number (that one, or an
        error). Nothing live changes until every rank has staged the same candidate (`_choose`)."""
        start = time.perf_counter()
        chosen = self._choose(which, self._state_pieces(layout), scaler, sampler)
        if chosen is None:
            self.log(f"ckpt: no checkpoint in {self.root}; starting from step 0")
            if self.rank == 0:
                set_aside_newer_than(self.root, 0, self.nonce, self.log)  # only bad ones: out of this run's line
            return 0
        step, scalars = chosen.manifest["step"], chosen.scalars
        bytes_read = chosen.staged.commit()  # an axis derives what it recomputes from its loaded tensors
        layout.optimizer_step_count = scalars["adam_step"]
        for axis in self.axes:
            axis.after_load(layout, step)
        scaler.load_state_dict(scalars["scaler"])
        sampler.load_state_dict(scalars["data"])
        if chosen.same_mesh:  # deterministic replay: this rank's own generators, exactly
            restore_rng_state(chosen.rng, scalars["rng"], self.device)
        else:  # another mesh: old streams mean nothing here; fresh deterministic ones, alike within TP groups
            reseed_rng(seed, step, self.rank // self.mesh_record["tp"])
        saved_run = self.resumed_run = scalars.get("run", {})
        changed = {k: (saved_run[k], v) for k, v in self.config.run_record.items()
                   if k in saved_run and saved_run[k] != v}
        if changed:  # e.g. extending --steps: legitimate, but the LR schedule is then not the saved run's
            trained_otherwise = sorted(set(changed) & {"global_batch", "seq_len", "data", "model"})
            self.log(("ckpt: WARNING: the checkpoint was trained with another " + ", ".join(trained_otherwise)
                      + "; this run goes on with its own. " if trained_otherwise else "ckpt: ")
                     + "this run's flags differ from the checkpoint's (LR schedule and batch follow this run):"
                     + ", ".join(f" {k} {old}→{new}" for k, (old, new) in changed.items()))
        if self.rank == 0:
            set_aside_newer_than(self.root, step, self.nonce, self.log)
        how = "same mesh: every rank's RNG restored" if chosen.same_mesh else (
            f"resharded from mesh {chosen.manifest['mesh']} (RNG re-seeded from seed, step, rank // T)")
        self.log(f"ckpt: resumed from {chosen.path} at step {step} ({how}); loaded in"
                 f" {(time.perf_counter() - start) * 1e3:.0f} ms, rank 0 read {bytes_read / 2**20:.2f} MiB")
        self._clock = (time.perf_counter(), step)
        return step

    def _choose(self, which, pieces: list, scaler, sampler) -> _Staged | None:
        """The first candidate that every rank staged (None: there is none); a refused one is logged and the
        next older tried (`latest`), or raised (a step asked for, or none left)."""
        rejected = []
        for _, path in self._candidates(which):
            error = staged = None
            try:
                staged = self._stage(path, pieces, scaler, sampler)
            except (CheckpointError, OSError, ValueError, AttributeError, KeyError, IndexError, TypeError,
                    RuntimeError) as e:  # a damaged or foreign file can make any reader raise: all mean "bad"
                error = str(e) if isinstance(e, CheckpointError) else f"{path}: {gist(e)} ({type(e).__name__})"
            if error is not None and not error.startswith(path):
                error = f"{path}: {error}"  # every reason names the checkpoint it is about
            errors = self._agree(error)
            if not errors:
                self._refuse_dropping(staged)
                return staged
            rejected.append(errors[0] + (f" (and on {len(errors) - 1} more ranks)" if len(errors) > 1 else ""))
            if which == "latest":  # (a checkpoint asked for by step is refused by the error itself)
                self.log(f"ckpt: refusing {rejected[-1]}; trying an older one")
        if rejected:
            raise CheckpointError(self._refusal(which, rejected))
        return None

    def _refuse_dropping(self, staged: _Staged) -> None:
        """A resume that leaves trained state of the checkpoint unread (a DiLoCo replica's, the outer momentum,
        shared experts, a router's bias, FP8's histories: what this run's flags have no place for) would throw
        it away in silence: refused, on every rank alike, unless --drop-state says so."""
        read = set(staged.staged.sources)
        gathered = [None] * self.world
        if self.world > 1:
            dist.all_gather_object(gathered, sorted(read))
            read = read.union(*map(set, gathered))
        dropped = dropped_state(staged.manifest["tensors"], read)
        if dropped and not self.config.drop_state:
            raise CheckpointError(f"{staged.path}: this run would drop state the checkpoint holds: {dropped}; resume"
                                  f" with the flags of the run that wrote it, or pass --drop-state to go on without"
                                  f" it")
        if dropped:
            self.log(f"ckpt: --drop-state: left unread: {dropped}")

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

    def _refusal(self, which, rejected: list[str]) -> str:
        """The one-line error when nothing can be resumed: which checkpoint(s), why, and what to do."""
        if which != "latest":
            others = [os.path.basename(p) for s, p in list_checkpoints(self.root) if s != int(which)]
            return (f"cannot resume {rejected[0]} -- use --resume latest (the newest good"
                    f" checkpoint)" + (f" or another step ({', '.join(others)})" if others else "")
                    + ", or start without --resume")
        return (f"no checkpoint in {self.root} can be resumed ({len(rejected)} refused: {'; '.join(rejected)})"
                f" -- repair or move them aside, or start without --resume")


# ---------------------------------------------------------------------------------------------------------
# Plan → read → reshard: a checkpoint's pieces into any layout's pieces, all or nothing
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


class StagedLoad:
    """A checkpoint read into host memory and resliced into the targets' shapes, not yet in the live state:
    `commit()` copies it in.

    All or nothing: a tensor found unreadable halfway (a shard weights_only refuses, a piece of the wrong size)
    abandons the load with the live state untouched. The price: this rank's state in host memory.
    `files` reads the stored pieces (`tensor(file, name)`): the checkpoint's shard files, or another source
    described by a manifest of the same form (interop/hf.py: a Hugging Face directory).
    """

    def __init__(self, path: str, manifest: dict, pieces: list, files=None):
        self.path, self.manifest, self.bytes_read = path, manifest, 0
        self.files = files if files is not None else ShardFiles(path)
        self.staged: list[tuple[torch.Tensor, torch.Tensor]] = []  # (target, its values in host memory)
        plans = plan_load(path, manifest, pieces)
        self.sources = [plan.source for plan in plans]  # the stored tensors this rank reads
        with torch.no_grad():
            for plan in plans:
                self._read(plan)

    def _read(self, plan: LoadPlan) -> None:
        """Read: the stored pieces this rank needs, placed into one full logical tensor; reshard: each target's
        part sliced out of it, in the target's shape and dtype."""
        full = torch.empty(plan.global_shape, dtype=plan.dtype)
        for shard, flat, record in plan.records:
            values = self.files.tensor(record.get("file"), record.get("name"))
            if values.numel() != piece_numel(shard, flat) or values.dtype != plan.dtype:
                raise CheckpointError(f"{self.path}: {record['file']}:{record['name']} holds {values.numel()}"
                                      f" {values.dtype} elements, the manifest says {piece_numel(shard, flat)}"
                                      f" {plan.dtype} for {plan.source}")
            place(full, shard, flat, values)
            self.bytes_read += values.numel() * values.element_size()
        for target in plan.targets:
            part = extract(full, target.shard, target.flat_range)
            if part.numel() != target.tensor.numel():
                raise CheckpointError(f"{plan.key}: the target piece has {target.tensor.numel()} elements, its"
                                      f" place in the logical tensor {part.numel()}")
            self.staged.append((target.tensor, part.reshape(target.tensor.shape).to(target.tensor.dtype, copy=True)))

    @torch.no_grad()
    def commit(self) -> int:
        """Copy every staged value into its live tensor; return the bytes read from the files."""
        for tensor, values in self.staged:
            tensor.copy_(values)
        self.staged = []
        return self.bytes_read


def load_pieces(path: str, manifest: dict, pieces: list) -> int:
    """Fill every target piece (any layout) from the checkpoint, all or nothing; return the bytes read."""
    return StagedLoad(path, manifest, pieces).commit()


def read_logical(path: str) -> dict:
    """Every logical tensor of a (verified) checkpoint, whole: for inspection, export and tests."""
    manifest = verify_checkpoint(path)
    out, pieces = {}, []
    for key, entry in manifest["tensors"].items():
        shape = tuple(entry["global_shape"])
        out[key] = torch.empty(shape, dtype=dtype_named(entry["dtype"]))
        pieces.append(StatePiece(key, out[key], ShardInfo(key.split("/", 1)[1], shape)))
    load_pieces(path, manifest, pieces)
    return out
