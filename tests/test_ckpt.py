"""ckpt.py: atomic sharded checkpoints, the two resume contracts, resharding, faults and corruption.

The two resume contracts (README):
- deterministic replay (same mesh): the resumed run's losses and parameters are BITWISE equal
  (`torch.equal`) to an uninterrupted run's; dropout is on, so every rank's RNG must come back exactly;
- coverage-equivalent resharding (another mesh: other D, T, ZeRO stage): the same global batches are consumed
  and the continued losses and final parameters match the single-device reference (tests/reference.py,
  float64) within TOL = 1e-10, the tolerance test_ddp.py states for DDP.

ZeRO and tensor-parallel layouts are constructed in `build_layout` only. The multi-rank runs build on
harness.device() (each rank's GPU under nccl; the checkpointer then also saves and restores that GPU's RNG);
the one-process checkpoints (`_one_rank_checkpoints`, the reshard arithmetic) stay on the CPU: they test the
files, not a device.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from contextlib import nullcontext

import pytest
import torch

import harness
from harness import backend_flags, run_ranks
from reference import HYPER, global_batches, make_config, rank_micro_batches, reference_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, SAVE_AT, GLOBAL_BATCH, MICRO, SEQ, CLIP = 6, 3, 8, 1, 16, 0.05
TOL = 1e-10

LAYOUTS = {  # name -> (D, T, ZeRO stage); world = D·T
    "D1": dict(dp=1, tp=1, zero=0),
    "D2": dict(dp=2, tp=1, zero=0),
    "D4": dict(dp=4, tp=1, zero=0),
    "D2-Z1": dict(dp=2, tp=1, zero=1),
    "D2-Z3": dict(dp=2, tp=1, zero=3),
    "D4-Z2": dict(dp=4, tp=1, zero=2),
    "T2": dict(dp=1, tp=2, zero=0),
    "T2-D2": dict(dp=2, tp=2, zero=0),
    "T2-D2-Z1": dict(dp=2, tp=2, zero=1),
}


def _world(name: str) -> int:
    return LAYOUTS[name]["dp"] * LAYOUTS[name]["tp"]


def build_layout(spec: dict, mesh, config, dtype, device):
    """(model, layout) for a layout spec on `device`: the one place that builds zero.py and tensor_parallel.py
    layouts."""
    from ddp import DistributedDataParallel
    from model import GPT
    from optim import build_adamw
    from ddp import DDPLayout

    model = GPT(config, seed=0, dtype=dtype, device=device)
    if spec["tp"] > 1:
        import tensor_parallel

        tensor_parallel.parallelize(model, mesh.group("tp"), seed=0)  # swaps the modules in place
    if spec["zero"]:
        import zero

        layout = zero.ZeroLayout(model, mesh.group("dp_cp"), spec["zero"], lr=HYPER["lr"],
                                 weight_decay=HYPER["weight_decay"], betas=HYPER["betas"], eps=HYPER["eps"],
                                 param_dtype=dtype, master_dtype=dtype, coords=mesh.coordinates())
    else:
        ddp = DistributedDataParallel(model, group=mesh.group("dp_cp"))
        optimizer = build_adamw(model.parameters(), HYPER["lr"], HYPER["weight_decay"], HYPER["betas"], HYPER["eps"])
        layout = DDPLayout(ddp, optimizer, mesh.coordinates())
    return model, layout


def _run(rank, world, spec, root, stop, save_every, resume=None, dropout=0.0, async_save=False, keep=2,
         reseed_after_resume=False):
    """Train steps [start, stop) of the test's global batches on `spec`'s mesh, checkpointing into `root`.

    start is 0, or the resumed step. Returns (losses by step, this rank's parameters by name, start).
    """
    import ckpt
    from data import BatchSampler
    from mesh import MeshShape, build_mesh
    from optim import DynamicLossScaler
    from step import train_step

    device = harness.device()
    mesh = build_mesh(MeshShape(dp=spec["dp"], tp=spec["tp"]))
    # A stream per data rank, as train.py: dropout differs across data ranks; a TP group draws alike.
    torch.manual_seed(100 + mesh.index("dp"))  # the CPU generator and every GPU's
    model, layout = build_layout(spec, mesh, make_config(dropout=dropout), torch.float64, device)
    scaler = DynamicLossScaler(enabled=False)
    sampler = BatchSampler(10_000, SEQ, GLOBAL_BATCH, seed=0)  # only its cursor is used: batches come below
    checkpointer = ckpt.Checkpointer(root, mesh, keep=keep, async_save=async_save, device=device,
                                     log=lambda *a: None)
    start = 0
    if resume is not None:
        torch.manual_seed(12345)  # whatever state the fresh process has: the checkpoint must replace it
        start = checkpointer.resume(resume, layout, scaler, sampler, seed=0)
        if reseed_after_resume:
            torch.manual_seed(100 + mesh.index("dp"))  # the negative control: RNG not restored
    batches = global_batches(STEPS, GLOBAL_BATCH, SEQ)
    losses = {}
    for step in range(start, stop):
        micro = rank_micro_batches(*batches[step], mesh.index("dp"), mesh.size("dp"), MICRO)
        losses[step] = train_step(layout, scaler, micro, mesh.group("dp_cp"), CLIP, nullcontext(), device).loss
        checkpointer.step_end(step + 1, save_every, step + 1 == stop, layout, scaler, sampler)
    checkpointer.close()
    assert sampler.step == start  # the cursor is the data of the NEXT step, set by resume
    if hasattr(layout, "full_parameters"):  # ZeRO-3 frees the parameters' storage outside forward/backward
        params = layout.full_parameters()
    else:
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, params, start


# ---------------------------------------------------------------------------------------------------------
# Deterministic replay (same mesh): bitwise
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["D2", "D2-Z3", "T2-D2"])
def test_deterministic_replay_is_bitwise(name, tmp_path):
    world, spec, root = _world(name), LAYOUTS[name], str(tmp_path / "ck")
    dropout = 0.1  # so that every rank's RNG state must come back (tensor_parallel.py forks it for split regions)
    # Uninterrupted, saving (synchronously) every 2 steps: saving must not perturb the run.
    full = run_ranks(_run, world, spec, root, STEPS, 2, None, dropout, False, 3, timeout=120)
    assert sorted(os.listdir(root)) == ["step-00000002", "step-00000004", "step-00000006"]
    # Resume at step 2 in fresh processes, saving asynchronously from there on.
    resumed = run_ranks(_run, world, spec, root, STEPS, 2, "2", dropout, True, 3, timeout=120)
    for (losses, params, _), (r_losses, r_params, start) in zip(full, resumed):
        assert start == 2
        assert [r_losses[s] for s in range(2, STEPS)] == [losses[s] for s in range(2, STEPS)]  # exact floats
        for n, p in params.items():
            assert torch.equal(r_params[n], p), n
    if dropout:  # the negative control: without this rank's RNG state the dropout masks differ, so the losses do
        control = run_ranks(_run, world, spec, root, STEPS, 0, "4", dropout, False, 3, True, timeout=120)
        assert control[0][0][4] != full[0][0][4]


# ---------------------------------------------------------------------------------------------------------
# Resharding: save on one mesh, load on another, continue; compare with the single-device reference
# ---------------------------------------------------------------------------------------------------------

MATRIX = [("D2", "D1"), ("D1", "D2"), ("D2", "D4"), ("T2-D2-Z1", "D2-Z3")] + [
    (save, load) for save in ("D2-Z1", "D2-Z3", "T2-D2") for load in ("D1", "D4-Z2", "T2", "D2")]


@pytest.fixture(scope="module")
def reference():
    return reference_run(make_config(), global_batches(STEPS, GLOBAL_BATCH, SEQ), clip=CLIP)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, reference):
    """Checkpoints after SAVE_AT steps, one per saving layout, made once per module."""
    cache = {}

    def get(name):
        if name not in cache:
            root = str(tmp_path_factory.mktemp(f"save-{name}"))
            results = run_ranks(_run, _world(name), LAYOUTS[name], root, SAVE_AT, 0, timeout=120)
            for losses, _, _ in results:
                torch.testing.assert_close(torch.tensor([losses[s] for s in range(SAVE_AT)]),
                                           torch.tensor(reference[0][:SAVE_AT]), rtol=TOL, atol=TOL)
            cache[name] = root
        return cache[name]

    return get


@pytest.mark.parametrize("save,load", MATRIX, ids=[f"{s}-to-{l}" for s, l in MATRIX])
def test_resharding_continues_the_reference_run(save, load, saved, reference, tmp_path):
    import ckpt

    root = str(tmp_path / "ck")
    shutil.copytree(saved(save), root)
    results = run_ranks(_run, _world(load), LAYOUTS[load], root, STEPS, 0, "latest", timeout=120)
    ref_losses, _, ref_params = reference
    for losses, _, start in results:
        assert start == SAVE_AT
        torch.testing.assert_close(torch.tensor([losses[s] for s in range(SAVE_AT, STEPS)]),
                                   torch.tensor(ref_losses[SAVE_AT:]), rtol=TOL, atol=TOL)
    # The final state, saved by the new layout, read back whole: the reference's parameters.
    logical = ckpt.read_logical(os.path.join(root, ckpt.step_dir_name(STEPS)))
    for name, ref in ref_params.items():
        torch.testing.assert_close(logical[f"param/{name}"], ref, rtol=TOL, atol=TOL, msg=name)
    with open(os.path.join(root, ckpt.step_dir_name(STEPS), ckpt.MANIFEST)) as f:
        assert json.load(f)["mesh"]["world_size"] == _world(load)


# ---------------------------------------------------------------------------------------------------------
# The resharding arithmetic, in one process: TP splits of fused q|k|v, ZeRO flat ranges, master/param rules
# ---------------------------------------------------------------------------------------------------------


class _FakeLayout:
    """Any layout is its list of StatePieces: here, the pieces of several virtual ranks held by one process."""

    def __init__(self, pieces):
        self.pieces, self.optimizer_step_count = pieces, 0

    def state_pieces(self):
        return self.pieces


def _pieces(kind, full, tp, zero, segments=3, dtype=None):
    """Every rank's piece of `full` (split along dim 0 in `segments` fused segments over tp, then zero flat
    ranges over the flattened split, unevenly: ZeRO pads, and the last rank may hold less)."""
    from model import ShardInfo, Split, StatePiece

    out = []
    for t in range(tp):
        shard = ShardInfo("h.0.attn.c_attn.weight", tuple(full.shape),
                          splits=(Split(0, tp, t, segments),) if tp > 1 else ())
        local = shard.shard_of(full).contiguous().view(-1)
        chunk = -(-local.numel() // zero)  # ceil: the padded shard size
        for z in range(zero):
            lo, hi = min(z * chunk, local.numel()), min((z + 1) * chunk, local.numel())
            flat = (lo, hi) if zero > 1 else None
            tensor = (local[lo:hi] if zero > 1 else local.view(shard.local_shape)).clone()
            out.append(StatePiece(f"{kind}/h.0.attn.c_attn.weight", tensor.to(dtype or full.dtype), shard, flat))
    return out


def test_resharding_onto_tensor_parallel_keeps_replicas_identical_with_dropout(tmp_path):
    """Another mesh re-seeds the RNG per data-parallel position (rank // T), not per rank: the ranks of a TP
    group must keep drawing the same dropout masks on the activations they all hold, or their copies of the
    LayerNorms, position embedding and row-parallel biases drift apart (silently: one copy is saved)."""
    root = str(tmp_path / "ck")
    run_ranks(_run, 1, LAYOUTS["D1"], root, 2, 2, None, 0.1, timeout=120)
    (_, params0, start), (_, params1, _) = run_ranks(_run, 2, LAYOUTS["T2"], root, 4, 0, "latest", 0.1,
                                                     timeout=120)
    assert start == 2
    replicated = [n for n in params0 if ".ln_" in n or "wpe" in n or "c_proj.bias" in n]
    assert len(replicated) > 5
    for name in replicated:
        assert torch.equal(params0[name], params1[name]), name


def test_resuming_an_older_step_sets_the_newer_ones_aside(tmp_path):
    """After resuming at step 4, the abandoned step 6 must neither be pruned into nor picked by `latest`."""
    import ckpt

    root = str(tmp_path)
    _, layout, scaler, sampler = _one_rank_checkpoints(root, steps=(2, 4, 6))
    saver = ckpt.Checkpointer(root, keep=2, log=lambda *a: None)
    assert saver.resume("4", layout, scaler, sampler, seed=0) == 4
    saver.save(5, layout, scaler, sampler)
    assert [step for step, _ in ckpt.list_checkpoints(root)] == [5, 4]  # keep=2 pruned step 2
    assert any(name.startswith("abandoned-step-00000006-") for name in os.listdir(root))  # kept, not deleted
    assert saver.resume("latest", layout, scaler, sampler, seed=0) == 5


def _save_fails_on_rank_1(rank, world, root, async_save, commit_timeout_s=2):
    """Rank 1's persist raises (a full disk, say): every rank must raise, none may wait forever."""
    import ckpt
    from data import BatchSampler
    from mesh import MeshShape, build_mesh
    from optim import DynamicLossScaler

    device = harness.device()
    mesh = build_mesh(MeshShape(dp=2))
    _, layout = build_layout(LAYOUTS["D2"], mesh, make_config(), torch.float64, device)
    saver = ckpt.Checkpointer(root, mesh, async_save=async_save, device=device, log=lambda *a: None,
                              commit_timeout_s=commit_timeout_s)
    if rank == 1:
        def full_disk(snapshot, stats):
            raise OSError("No space left on device")
        saver._persist = full_disk
    try:
        saver.save(1, layout, DynamicLossScaler(False), BatchSampler(1000, SEQ, GLOBAL_BATCH, seed=0))
        saver.close()
    except ckpt.CheckpointError as e:
        return str(e)
    return None


def test_a_failed_save_on_rank_1_is_reported_at_once_not_at_the_commit_timeout(tmp_path):
    """With the default 600 s commit timeout, rank 1's failure record makes rank 0 give up at once."""
    import time

    start = time.monotonic()
    messages = run_ranks(_save_fails_on_rank_1, 2, str(tmp_path), False, 600.0, timeout=60)
    assert time.monotonic() - start < 30
    assert all(m is not None and "rank 1" in m and "No space left" in m for m in messages), messages
    assert "rank-00001 failed to write its shard" in messages[0]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_save_failing_on_one_rank_is_raised_on_every_rank(async_save, tmp_path):
    import ckpt

    messages = run_ranks(_save_fails_on_rank_1, 2, str(tmp_path), async_save, timeout=60)
    assert all(m is not None and "rank 1" in m and "No space left" in m for m in messages), messages
    assert ckpt.list_checkpoints(str(tmp_path)) == []  # nothing was committed


def test_reshard_arithmetic_tp_segments_and_zero_ranges(tmp_path):
    import ckpt
    from data import BatchSampler
    from optim import DynamicLossScaler

    full = torch.randn(12 * 3, 5, dtype=torch.float64)  # fused [q|k|v], 12 rows each
    master = torch.randn(36, 5, dtype=torch.float32)
    source = _pieces("param", full, tp=2, zero=3) + _pieces("master", master, tp=2, zero=3)
    saver = ckpt.Checkpointer(str(tmp_path), keep=2, log=lambda *a: None)
    sampler, scaler = BatchSampler(1000, 8, 4, 0), DynamicLossScaler(False)
    saver.save(7, _FakeLayout(source), scaler, sampler)
    for tp, zero in ((1, 1), (3, 1), (1, 4), (3, 5), (2, 3), (6, 2)):
        # param/ prefers master/ (more precise); a missing master/ comes from param/ (cast).
        targets = [p for p in _pieces("param", torch.zeros(36, 5, dtype=torch.float64), tp, zero)]
        path = ckpt.list_checkpoints(str(tmp_path))[0][1]
        ckpt.load_pieces(path, ckpt.verify_checkpoint(path), targets)
        for got, want in zip(targets, _pieces("param", master.double(), tp, zero)):
            assert torch.equal(got.tensor, want.tensor), (tp, zero)
    # master/ filled from param/ when the checkpoint has none (a DDP fp32 checkpoint into a mixed-precision one)
    root2 = str(tmp_path / "params-only")
    ckpt.Checkpointer(root2, keep=2, log=lambda *a: None).save(1, _FakeLayout(_pieces("param", full, 2, 3)),
                                                               scaler, sampler)
    targets = _pieces("master", torch.zeros(36, 5, dtype=torch.float32), 3, 2)
    path = ckpt.list_checkpoints(root2)[0][1]
    ckpt.load_pieces(path, ckpt.verify_checkpoint(path), targets)
    for got, want in zip(targets, _pieces("master", full.float(), 3, 2)):
        assert torch.equal(got.tensor, want.tensor)
    # A layout bug (a piece written twice) is refused at commit, not discovered at the next resume.
    twice = _pieces("param", full, 2, 1)
    with pytest.raises(ckpt.CheckpointError, match="missing or written twice"):
        ckpt.Checkpointer(str(tmp_path / "bad"), keep=2, log=lambda *a: None).save(
            1, _FakeLayout(twice + twice[:1]), scaler, sampler)


# ---------------------------------------------------------------------------------------------------------
# Corruption: each detected with a clear message; latest falls back to the newest good checkpoint
# ---------------------------------------------------------------------------------------------------------


class _OneProcessLayout:
    """DDPLayout's checkpoint view for one process without a process group (ddp.py needs one)."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_pieces(self):
        import ckpt

        return ckpt.replicated_state_pieces(self.model.parameters(), self.optimizer, coords={})

    @property
    def optimizer_step_count(self):
        import ckpt

        return ckpt.adam_step(self.optimizer)

    @optimizer_step_count.setter
    def optimizer_step_count(self, value):
        import ckpt

        ckpt.set_adam_step(self.optimizer, value)


def _one_rank_checkpoints(root, steps=(2, 4)):
    """A tiny model and AdamW in this process (no process group), checkpointed at `steps`."""
    import ckpt
    from data import BatchSampler
    from model import GPT
    from optim import DynamicLossScaler, build_adamw

    model = GPT(make_config(n_layer=1), seed=0)
    layout = _OneProcessLayout(model, build_adamw(model.parameters(), 1e-3))
    scaler, sampler = DynamicLossScaler(False), BatchSampler(1000, 8, 4, 0)
    saver = ckpt.Checkpointer(root, keep=3, log=lambda *a: None)
    for step in steps:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * step)
        layout.optimizer_step_count = step
        saver.save(step, layout, scaler, sampler)
    return model, layout, scaler, sampler


def _resign(path):
    """Rewrite the marker for the current manifest: a tamperer who knows the format gets past the checksum."""
    import ckpt

    with open(os.path.join(path, ckpt.MANIFEST), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    with open(os.path.join(path, ckpt.MARKER), "w") as f:
        json.dump({"manifest_sha256": digest}, f)


def _edit_manifest(path, edit):
    import ckpt

    with open(os.path.join(path, ckpt.MANIFEST)) as f:
        manifest = json.load(f)
    edit(manifest)
    with open(os.path.join(path, ckpt.MANIFEST), "w") as f:
        json.dump(manifest, f)
    _resign(path)


def _escape(manifest):
    info = manifest["files"].pop("shard-00000.pt")
    manifest["files"]["../../shard-00000.pt"] = info
    for entry in manifest["tensors"].values():
        for piece in entry["pieces"]:
            piece["file"] = "../../shard-00000.pt"


def _wrong_shape(manifest):
    manifest["tensors"]["param/transformer.wpe.weight"]["global_shape"][0] += 1


def _truncate(path):
    shard = os.path.join(path, "shard-00000.pt")
    os.truncate(shard, os.path.getsize(shard) - 100)


def _flip_byte(path):
    shard = os.path.join(path, "shard-00000.pt")
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))


def _unpicklable(path):
    """A shard holding a pickled object that is not a tensor (torch.load(weights_only=True) must refuse it),
    with sizes and checksums made consistent so only the weights_only check stands in the way."""
    import ckpt

    shard = os.path.join(path, "shard-00000.pt")
    torch.save({"param/transformer.wte.weight": torch.zeros(1), "evil": _Evil()}, shard)

    def edit(manifest):
        manifest["files"]["shard-00000.pt"].update(bytes=os.path.getsize(shard), sha256=ckpt._sha256_file(shard))

    _edit_manifest(path, edit)


class _Evil:
    def __reduce__(self):
        return (print, ("this must never run",))


def _missing_tensor(manifest):
    del manifest["tensors"]["exp_avg/transformer.wpe.weight"]


def _integer_dtype(manifest):
    manifest["tensors"]["exp_avg_sq/transformer.wpe.weight"]["dtype"] = "int64"


def _last_entry_renamed(manifest):
    """Consistent on paper (names, shapes, coverage): the last logical tensor's piece names an entry the shard
    does not have, so the loader finds out only after reading every tensor before it."""
    manifest["tensors"][list(manifest["tensors"])[-1]]["pieces"][0]["name"] = "no-such-entry"


DAMAGE = {  # name -> (damage the step-4 checkpoint, the reason the refusal must give)
    "truncated shard": (_truncate, r"has \d+ bytes, the manifest says \d+ \(truncated"),
    "flipped byte": (_flip_byte, "fails its SHA-256 checksum"),
    "missing shard": (lambda p: os.remove(os.path.join(p, "shard-00000.pt")), "shard-00000.pt is missing"),
    "missing marker": (lambda p: os.remove(os.path.join(p, "COMMITTED")), "incomplete: no COMMITTED"),
    "edited manifest": (lambda p: open(os.path.join(p, "manifest.json"), "a").write(" "),
                        "does not match the checksum"),
    "path escaping the directory": (lambda p: _edit_manifest(p, _escape), "not a plain file name"),
    # Files intact and consistent with their checksums; what they hold does not fit the model:
    "wrong global shape": (lambda p: _edit_manifest(p, _wrong_shape), "global shape .* but the model's"),
    "missing logical tensor": (lambda p: _edit_manifest(p, _missing_tensor),
                               "has no exp_avg/transformer.wpe.weight, which the model has"),
    "integer dtype": (lambda p: _edit_manifest(p, _integer_dtype), "is stored as torch.int64"),
    "not weights only": (_unpicklable, "cannot load shard-00000.pt .*Unsupported global: GLOBAL"),
    "entry missing from its shard, found last": (lambda p: _edit_manifest(p, _last_entry_renamed),
                                                 "has no tensor 'no-such-entry'"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_checkpoint_is_refused_by_step_and_skipped_by_latest(damage, tmp_path, capsys):
    """The damaged-checkpoint matrix (every kind × --resume 4 / latest). Asked for by step, it is refused with
    one line naming it, the reason and what to do, and nothing live changes (the load is staged whole before
    any parameter is written); `latest` reports it and resumes from the older good one."""
    import ckpt

    root = str(tmp_path)
    model, layout, scaler, sampler = _one_rank_checkpoints(root)
    good = {k: v.clone() for k, v in ckpt.read_logical(os.path.join(root, "step-00000002")).items()}
    bad_path = os.path.join(root, "step-00000004")
    hurt, reason = DAMAGE[damage]
    hurt(bad_path)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # unlike both checkpoints: a partial load would show
    live = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ckpt.CheckpointError, match=reason) as refused:
        ckpt.Checkpointer(root, keep=3, log=lambda *a: None).resume("4", layout, scaler, sampler, seed=0)
    message = str(refused.value)
    assert "\n" not in message and bad_path in message and "--resume latest" in message, message
    assert all(torch.equal(p.detach(), before) for p, before in zip(model.parameters(), live))
    assert layout.optimizer_step_count == 4 and sampler.step == 0

    logged = []
    loader = ckpt.Checkpointer(root, keep=3, log=logged.append)
    assert loader.resume("latest", layout, scaler, sampler, seed=0) == 2
    assert layout.optimizer_step_count == 2 and sampler.step == 2
    refusals = [line for line in logged if "refusing" in line and bad_path in line]
    assert len(refusals) == 1 and re.search(reason, refusals[0]) and "\n" not in refusals[0], logged
    for p in model.parameters():
        assert torch.equal(p.detach(), good[f"param/{p.shard_info.global_name}"])
    # The bad one is set aside (kept for inspection), out of the way of this run's next step-4 save.
    assert not os.path.exists(bad_path)
    assert any(name.startswith("abandoned-step-00000004-") for name in os.listdir(root))
    assert "this must never run" not in capsys.readouterr().out


def test_incomplete_saves_are_never_candidates_and_all_bad_is_an_error(tmp_path):
    import ckpt

    root = str(tmp_path)
    _, layout, scaler, sampler = _one_rank_checkpoints(root, steps=(2,))
    os.makedirs(os.path.join(root, ".tmp-step-00000004-deadbeef"))  # a dead attempt's half-written save
    with open(os.path.join(root, ".tmp-step-00000004-deadbeef", "shard-00000.pt"), "wb") as f:
        f.write(b"partial")
    loader = ckpt.Checkpointer(root, keep=2, log=lambda *a: None)
    assert not any(n.startswith(".tmp-") for n in os.listdir(root))  # cleaned at start-up
    assert loader.resume("latest", layout, scaler, sampler, seed=0) == 2
    os.remove(os.path.join(root, "step-00000002", "COMMITTED"))
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint in .* can be resumed .* start without --resume"):
        ckpt.Checkpointer(root, keep=2, log=lambda *a: None).resume("latest", layout, scaler, sampler, seed=0)
    with pytest.raises(ckpt.CheckpointError, match="no step-00000009"):
        ckpt.Checkpointer(root, keep=2, log=lambda *a: None).resume("9", layout, scaler, sampler, seed=0)
    empty = str(tmp_path / "empty")
    assert ckpt.Checkpointer(empty, keep=2, log=lambda *a: None).resume("latest", layout, scaler, sampler, 0) == 0


def test_keep_prunes_to_the_newest_k(tmp_path):
    import ckpt

    root = str(tmp_path)
    _one_rank_checkpoints(root, steps=(1, 2, 3, 4, 5))
    assert sorted(os.listdir(root)) == ["step-00000003", "step-00000004", "step-00000005"]  # keep=3
    manifest = ckpt.verify_checkpoint(os.path.join(root, "step-00000005"))
    assert manifest["step"] == 5 and manifest["mesh"]["world_size"] == 1
    scalars = manifest["ranks"][0]["scalars"]
    assert scalars["data"]["step"] == 5 and scalars["lr_step"] == 5
    assert scalars["adam_step"] == 5
    assert set(manifest["ranks"][0]["tensors"]) >= {"rng/torch_cpu", "rng/python", "rng/numpy"}


def test_flags_are_validated():
    from flags import FlagError, build_parser, validate

    def check(argv, message):
        with pytest.raises(FlagError, match=message):
            validate(build_parser().parse_args(argv), 2)

    check(["--ckpt-dir", "x", "--keep", "1"], "--keep must be at least 2")
    check(["--resume", "latest"], "--resume needs --ckpt-dir")
    check(["--async-ckpt"], "--async-ckpt needs --ckpt-dir")
    check(["--ckpt-dir", "x", "--resume", "newest"], "--resume must be 'latest' or a step number")
    check(["--ckpt-dir", "x", "--ckpt-every", "-1"], "--ckpt-every must be at least 0")
    check(["--ckpt-dir", "x", "--mtbf-hours", "0"], "--mtbf-hours must be positive")


# ---------------------------------------------------------------------------------------------------------
# Fused AdamW (step count on the parameter's device): made-ahead state, checkpoints between fused and foreach
# ---------------------------------------------------------------------------------------------------------

FUSED_LR = 1e-2


@pytest.fixture(params=[torch.float32, torch.float64], ids=["default-fp32", "default-fp64"])
def default_dtype(request):
    """torch's default float dtype: foreach's step count follows it, fused's is float32 whatever it is."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(request.param)
    yield request.param
    torch.set_default_dtype(before)


def _adam_state(optimizer) -> list:
    """Every parameter's state, in parameter order: {key: tensor}."""
    return [optimizer.state[p] for group in optimizer.param_groups for p in group["params"]]


def _assert_same_state(model, layout, other_model, other_layout):
    """Parameters and moments bitwise equal, and the same Adam step."""
    for p, q in zip(model.parameters(), other_model.parameters()):
        assert torch.equal(p, q)
    for state, other in zip(_adam_state(layout.optimizer), _adam_state(other_layout.optimizer)):
        assert torch.equal(state["exp_avg"], other["exp_avg"]) and torch.equal(state["exp_avg_sq"], other["exp_avg_sq"])
    assert layout.optimizer_step_count == other_layout.optimizer_step_count


def _fused_or_foreach(fused: bool, seed: int):
    from model import GPT
    from optim import build_adamw

    model = GPT(make_config(n_layer=1), seed=seed)
    return model, _OneProcessLayout(model, build_adamw(model.parameters(), FUSED_LR, fused=fused))


def test_fused_adam_state_made_ahead_steps_bitwise_like_the_natural_one(default_dtype):
    """ensure_adam_state + set_adam_step on a fused AdamW (moments copied in, as a resume does), then two steps:
    bitwise the fused AdamW that took all four steps itself. The made state has the natural one's dtypes and
    devices (fused: the step a float32 on the parameter's device, even with float64 the default)."""
    import ckpt
    from reference import seeded_adamw_step

    natural_model, natural = _fused_or_foreach(True, seed=0)
    for step in (1, 2):
        seeded_adamw_step(natural_model, natural.optimizer, step)
    made_model, made = _fused_or_foreach(True, seed=1)
    ckpt.ensure_adam_state(made.optimizer)
    kinds = [[(k, v.dtype, v.device, v.shape) for k, v in state.items()] for state in _adam_state(made.optimizer)]
    assert kinds == [[(k, v.dtype, v.device, v.shape) for k, v in state.items()]
                     for state in _adam_state(natural.optimizer)]
    assert _adam_state(made.optimizer)[0]["step"].dtype == torch.float32
    with torch.no_grad():
        for p, q in zip(made_model.parameters(), natural_model.parameters()):
            p.copy_(q)
        for state, other in zip(_adam_state(made.optimizer), _adam_state(natural.optimizer)):
            state["exp_avg"].copy_(other["exp_avg"])
            state["exp_avg_sq"].copy_(other["exp_avg_sq"])
    made.optimizer_step_count = 2
    for step in (3, 4):
        for model, layout in ((natural_model, natural), (made_model, made)):
            seeded_adamw_step(model, layout.optimizer, step)
    _assert_same_state(made_model, made, natural_model, natural)
    assert made.optimizer_step_count == 4


def test_a_fused_checkpoint_resumes_into_foreach_and_back(tmp_path):
    """Fused run A saves at step 2 and runs on to 4. From its checkpoint: a fused run continues bitwise like A;
    a foreach run B resumes it exactly (Adam step 2, same moments), takes step 3 and saves; a fused run C
    resumes B's exactly and takes step 4, within reference.fused_adamw_tolerance of A (one step was foreach).
    The resumed runs start from other weights (seed 1), so anything not loaded shows."""
    import ckpt
    from data import BatchSampler
    from optim import DynamicLossScaler
    from reference import fused_adamw_tolerance, seeded_adamw_step

    def checkpointer(name):
        return ckpt.Checkpointer(str(tmp_path / name), keep=2, log=lambda *a: None)

    def resume(name, fused):
        model, layout = _fused_or_foreach(fused, seed=1)
        scaler, sampler = DynamicLossScaler(False), BatchSampler(1000, 8, 4, 0)
        step = checkpointer(name).resume("latest", layout, scaler, sampler, seed=0)
        return model, layout, scaler, sampler, step

    model_a, a = _fused_or_foreach(True, seed=0)
    for step in (1, 2):
        seeded_adamw_step(model_a, a.optimizer, step)
    checkpointer("a").save(2, a, DynamicLossScaler(False), BatchSampler(1000, 8, 4, 0))
    model_fused, fused, *_, step = resume("a", fused=True)
    model_b, b, scaler_b, sampler_b, step_b = resume("a", fused=False)
    assert step == step_b == 2 and b.optimizer_step_count == 2
    _assert_same_state(model_b, b, model_a, a)
    foreach_step = _adam_state(b.optimizer)[0]["step"]
    assert foreach_step.dtype == torch.get_default_dtype() and foreach_step.device.type == "cpu"  # foreach's own
    for step in (3, 4):
        seeded_adamw_step(model_a, a.optimizer, step)
        seeded_adamw_step(model_fused, fused.optimizer, step)
    _assert_same_state(model_fused, fused, model_a, a)

    seeded_adamw_step(model_b, b.optimizer, 3)
    checkpointer("b").save(3, b, scaler_b, sampler_b)
    model_c, c, *_, step = resume("b", fused=True)
    assert step == 3 and all(g["fused"] for g in c.optimizer.param_groups)
    _assert_same_state(model_c, c, model_b, b)
    seeded_adamw_step(model_c, c.optimizer, 4)
    assert c.optimizer_step_count == a.optimizer_step_count == 4
    for p, q in zip(model_c.parameters(), model_a.parameters()):
        assert ((p - q).abs() <= fused_adamw_tolerance(q, FUSED_LR, 4)).all()


def test_measuring_the_peak_draws_nothing_from_the_training_rng():
    """train.py measures the CPU peak after seeding; a measurement that drew its matrices from the global
    generator shifted every dropout mask by an amount that depends on the machine's load (how many sizes fit
    the time), so an uninterrupted run and a killed-and-resumed one (whose RNG comes from the checkpoint) ended
    apart on a busy machine."""
    import mfu

    before = torch.get_rng_state()
    mfu.measure_matmul_peak(torch.float32, n=32, seconds=0.001)
    assert torch.equal(torch.get_rng_state(), before)


# ---------------------------------------------------------------------------------------------------------
# Fault injection: torchrun, a worker SIGKILLed, relaunched with --resume latest (as a cluster scheduler would)
# ---------------------------------------------------------------------------------------------------------
# torch 2.13's `torchrun --max-restarts` re-rendezvous hung here (the restarted gloo workers wait forever in
# ProcessGroupGloo's connectFullMesh), so the test relaunches torchrun itself; train.py is the same either way.

FAULT_STEPS = 12


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def launch_training(run_dir: str, corpus: str, log_name: str, extra=(), env=None):
    """torchrun, 2 workers, tiny preset, dropout on, a checkpoint every 2 steps, --resume latest."""
    os.makedirs(run_dir, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               os.path.join(ROOT, "train.py"), *backend_flags(2), "--preset", "tiny", "--steps", str(FAULT_STEPS),
               "--global-batch", "4", "--seq-len", "32", "--dtype", "fp32", "--dropout", "0.1", "--deterministic",
               "--eval-every", "0", "--sample-tokens", "0", "--log-every", "1", "--data", corpus,
               "--out-dir", run_dir, "--ckpt-dir", os.path.join(run_dir, "ck"), "--ckpt-every", "2",
               "--resume", "latest", "--metrics-file", os.path.join(run_dir, "metrics.jsonl"), *extra]
    log = open(os.path.join(run_dir, log_name), "w")
    env = dict({k: v for k, v in os.environ.items() if k != "CKPT_FAULT_PERSIST_SLEEP"}, **(env or {}))
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=run_dir,
                            start_new_session=True)


def run_to_completion(run_dir: str, corpus: str, log_name: str, extra=()):
    proc = launch_training(run_dir, corpus, log_name, extra)
    try:
        assert proc.wait(timeout=120) == 0, open(os.path.join(run_dir, log_name)).read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def kill_a_worker_when(proc, condition, rng, timeout=60) -> int | None:
    """SIGKILL one of torchrun's two workers (chosen by rng) as soon as condition() holds; its pid or None.
    torchrun then stops the other worker and exits with an error: the whole job is down, as after a crash."""
    deadline = time.monotonic() + timeout
    victim = None
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if condition():
                workers = _children(proc.pid)
                if len(workers) == 2:
                    victim = rng.choice(sorted(workers))
                    os.kill(victim, signal.SIGKILL)
                    break
            time.sleep(0.005)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return victim


def metrics_lines(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def check_fault_run(run_dir: str, reference: dict) -> str:
    """The killed-and-relaunched run ended like the uninterrupted one: returns the relaunch's resume line."""
    import ckpt

    final = ckpt.read_logical(os.path.join(run_dir, "ck", ckpt.step_dir_name(FAULT_STEPS)))
    assert final.keys() == reference.keys()
    for key, tensor in reference.items():
        assert torch.equal(final[key], tensor), key  # parameters and Adam moments, bitwise
    # Replayed steps are in the metrics file twice (before the kill, after the relaunch): the same losses.
    seen = {}
    for record in metrics_lines(run_dir):
        assert seen.setdefault(record["step"], record["loss"]) == record["loss"], record
    assert sorted(seen) == list(range(FAULT_STEPS))
    with open(os.path.join(run_dir, "relaunch.txt")) as f:
        resumed = [line for line in f if "ckpt: resumed from" in line or "ckpt: no checkpoint" in line]
    assert len(resumed) == 1, resumed
    return resumed[0]


def test_fault_injection_sigkill_and_relaunch(tmp_path):
    import ckpt

    corpus = str(tmp_path / "corpus.txt")
    rng = random.Random(0)
    with open(corpus, "w") as f:
        f.write("".join(rng.choice("abcdefgh ijklmnop\n") for _ in range(50_000)))
    uninterrupted = str(tmp_path / "uninterrupted")
    run_to_completion(uninterrupted, corpus, "log.txt")
    reference = ckpt.read_logical(os.path.join(uninterrupted, "ck", ckpt.step_dir_name(FAULT_STEPS)))

    # 1. Killed after a random number of steps in the middle of training.
    run_dir = str(tmp_path / "mid-training")
    kill_after = rng.randrange(3, FAULT_STEPS - 2)
    proc = launch_training(run_dir, corpus, "log.txt")
    assert kill_a_worker_when(proc, lambda: len(metrics_lines(run_dir)) >= kill_after, rng) is not None
    assert proc.returncode != 0
    run_to_completion(run_dir, corpus, "relaunch.txt")
    line = check_fault_run(run_dir, reference)
    resumed_at = int(line.split(" at step ")[1].split()[0])
    assert resumed_at % 2 == 0 and resumed_at <= kill_after + 1, line

    # 2. Killed while the step-6 checkpoint is being persisted (async; the persist sleeps after its shard).
    run_dir, ck = str(tmp_path / "in-persist"), str(tmp_path / "in-persist" / "ck")

    def persisting_step_6():
        names = os.listdir(ck) if os.path.isdir(ck) else []
        return any(n.startswith(".tmp-step-00000006") and os.listdir(os.path.join(ck, n)) for n in names)

    proc = launch_training(run_dir, corpus, "log.txt", ["--async-ckpt"], {ckpt.FAULT_ENV: "6:30"})
    assert kill_a_worker_when(proc, persisting_step_6, rng) is not None
    assert any(n.startswith(".tmp-step-00000006") for n in os.listdir(ck))  # the half-written save
    assert not os.path.exists(os.path.join(ck, "step-00000006"))
    run_to_completion(run_dir, corpus, "relaunch.txt", ["--async-ckpt"])
    line = check_fault_run(run_dir, reference)
    assert "step-00000004 at step 4" in line  # the last committed one; the half-written step 6 was never loaded


def test_a_second_writer_is_refused_and_a_killed_one_leaves_no_stale_lock(tmp_path):
    """One run writes a --ckpt-dir at a time (ckpt.WriterLock, an flock on <dir>/.lock): a second exclusive
    Checkpointer is refused with a line naming the holder, before it touches the directory (the first one's
    temporary directory survives); closing releases it; a SIGKILLed holder leaves nothing stuck."""
    import ckpt

    root = str(tmp_path / "ck")
    first = ckpt.Checkpointer(root, keep=2, log=lambda *a: None, exclusive=True)
    in_progress = os.path.join(root, f".tmp-step-00000007-{first.nonce}")
    os.makedirs(in_progress)  # what an async save of the first run would be writing now
    with pytest.raises(ckpt.CheckpointError, match=r"is being written by another run \(pid \d+ on .*\.lock\)"):
        ckpt.Checkpointer(root, keep=2, log=lambda *a: None, exclusive=True)
    assert os.path.isdir(in_progress)  # the refused writer cleaned nothing
    first.close()
    ckpt.Checkpointer(root, keep=2, log=lambda *a: None, exclusive=True).close()  # free again

    holder = subprocess.Popen([sys.executable, "-c", f"import sys; sys.path.insert(0, {ROOT!r}); import ckpt, time;"
                               f" lock = ckpt.WriterLock({root!r}); print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(ckpt.CheckpointError):
        ckpt.WriterLock(root)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    ckpt.WriterLock(root).release()  # the kernel dropped the dead holder's lock
