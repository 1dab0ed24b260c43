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
files, not a device. A spawned run (or a one-process story of several steps) is a module-scoped fixture shared
by one test per property, so a failure names the property.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
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
from harness import backend_flags, child_pids, run_bench, run_ranks
from reference import HYPER, global_batches, make_config, rank_micro_batches, reference_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, SAVE_AT, GLOBAL_BATCH, MICRO, SEQ, CLIP = 6, 3, 8, 1, 16, 0.05
TOL = 1e-10

LAYOUTS = {  # name -> (D, T, ZeRO stage, and GPTConfig overrides); world = D·T
    "D1": dict(dp=1, tp=1, zero=0),
    "D2": dict(dp=2, tp=1, zero=0),
    "D4": dict(dp=4, tp=1, zero=0),
    "D2-Z1": dict(dp=2, tp=1, zero=1),
    "D2-Z3": dict(dp=2, tp=1, zero=3),
    "D2-Z3-AC": dict(dp=2, tp=1, zero=3, config=dict(activation_checkpointing=True)),  # recompute gathers too
    "D4-Z2": dict(dp=4, tp=1, zero=2),
    "T2": dict(dp=1, tp=2, zero=0),
    "T2-D2": dict(dp=2, tp=2, zero=0),
    "T2-D2-Z1": dict(dp=2, tp=2, zero=1),
}


def _world(name: str) -> int:
    return LAYOUTS[name]["dp"] * LAYOUTS[name]["tp"]


def _checkpointer(root, mesh=None, device="cpu", log=lambda *a: None, on_save=None, **config):
    """A Checkpointer of CheckpointConfig(root, **config), quiet unless told otherwise."""
    import ckpt

    return ckpt.Checkpointer(ckpt.CheckpointConfig(root, **config), mesh, device=device, log=log, on_save=on_save)


def build_layout(spec: dict, mesh, config, dtype, device):
    """(model, layout) for a layout spec on `device`: the one place that builds zero.py, parallel/zero3.py and
    tensor_parallel.py layouts."""
    from ddp import DDPLayout, DistributedDataParallel
    from reference import build_model
    from optim import build_adamw

    model = build_model(config, seed=0, dtype=dtype, device=device)
    if spec["tp"] > 1:
        import tensor_parallel

        tensor_parallel.parallelize(model, mesh.group("tp"))  # swaps the modules in place
    if spec["zero"]:
        import zero
        from parallel import zero3

        config = zero.ZeroConfig(spec["zero"], lr=HYPER["lr"], weight_decay=HYPER["weight_decay"],
                                 betas=HYPER["betas"], eps=HYPER["eps"], param_dtype=dtype, master_dtype=dtype)
        layout_class = zero3.Zero3Layout if spec["zero"] == 3 else zero.ZeroLayout
        layout = layout_class(model, config, {"dp_cp": mesh.group("dp_cp")}, mesh.coordinates())
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
    from data import BatchSampler
    from mesh import MeshShape, build_mesh
    from optim import DynamicLossScaler
    from step import train_step

    device = harness.device()
    mesh = build_mesh(MeshShape(dp=spec["dp"], tp=spec["tp"]))
    # A stream per data rank, as train.py: dropout differs across data ranks; a TP group draws alike.
    torch.manual_seed(100 + mesh.index("dp"))  # the CPU generator and every GPU's
    model, layout = build_layout(spec, mesh, make_config(dropout=dropout, **spec.get("config", {})), torch.float64,
                                 device)
    scaler = DynamicLossScaler(enabled=False)
    sampler = BatchSampler(10_000, SEQ, GLOBAL_BATCH, seed=0)  # only its cursor is used: batches come below
    checkpointer = _checkpointer(root, mesh, device, keep=keep, async_save=async_save)
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


def _cached(function):
    """A module fixture's body run once per key: the spawned runs several tests share."""
    cache = {}

    def get(*key):
        if key not in cache:
            cache[key] = function(*key)
        return cache[key]

    return get


# ---------------------------------------------------------------------------------------------------------
# Deterministic replay (same mesh): bitwise
# ---------------------------------------------------------------------------------------------------------

REPLAY = ["D2", "D2-Z3", "T2-D2"]
REPLAY_DROPOUT = 0.1  # so that every rank's RNG state must come back (tensor_parallel.py forks it for split regions)


@pytest.fixture(scope="module")
def replay(tmp_path_factory):
    """Per layout: an uninterrupted run saving (synchronously) every 2 steps, keep 3; the same resumed at step 2
    in fresh processes, saving asynchronously from there on; and the negative control resumed at step 4 with
    the RNG re-seeded after the resume instead of restored."""

    def runs(name):
        world, spec, root = _world(name), LAYOUTS[name], str(tmp_path_factory.mktemp(f"replay-{name}"))
        full = run_ranks(_run, world, spec, root, STEPS, 2, None, REPLAY_DROPOUT, False, 3, timeout=120)
        listing = sorted(os.listdir(root))
        resumed = run_ranks(_run, world, spec, root, STEPS, 2, "2", REPLAY_DROPOUT, True, 3, timeout=120)
        control = run_ranks(_run, world, spec, root, STEPS, 0, "4", REPLAY_DROPOUT, False, 3, True, timeout=120)
        return dict(full=full, listing=listing, resumed=resumed, control=control)

    return _cached(runs)


@pytest.mark.parametrize("name", REPLAY)
def test_replay_saves_every_2_steps_and_keeps_the_newest_3(name, replay):
    assert replay(name)["listing"] == ["step-00000002", "step-00000004", "step-00000006"]


@pytest.mark.parametrize("name", REPLAY)
def test_replay_resumes_at_the_step_asked_for(name, replay):
    assert [start for _, _, start in replay(name)["resumed"]] == [2] * _world(name)


@pytest.mark.parametrize("name", REPLAY)
def test_replay_losses_are_bitwise_the_uninterrupted_runs(name, replay):
    for (losses, _, _), (r_losses, _, _) in zip(replay(name)["full"], replay(name)["resumed"]):
        assert [r_losses[s] for s in range(2, STEPS)] == [losses[s] for s in range(2, STEPS)]  # exact floats


@pytest.mark.parametrize("name", REPLAY)
def test_replay_parameters_are_bitwise_the_uninterrupted_runs(name, replay):
    for (_, params, _), (_, r_params, _) in zip(replay(name)["full"], replay(name)["resumed"]):
        for n, p in params.items():
            assert torch.equal(r_params[n], p), n


@pytest.mark.parametrize("name", REPLAY)
def test_replay_needs_every_ranks_rng_state(name, replay):
    """The negative control: without this rank's RNG state the dropout masks differ, so the losses do."""
    assert replay(name)["control"][0][0][4] != replay(name)["full"][0][0][4]


# ---------------------------------------------------------------------------------------------------------
# Resharding: save on one mesh, load on another, continue; compare with the single-device reference
# ---------------------------------------------------------------------------------------------------------

MATRIX = [("D2", "D1"), ("D1", "D2"), ("D2", "D4"), ("T2-D2-Z1", "D2-Z3"), ("T2-D2-Z1", "D2-Z3-AC")] + [
    (save, load) for save in ("D2-Z1", "D2-Z3", "T2-D2") for load in ("D1", "D4-Z2", "T2", "D2")]
MATRIX_IDS = [f"{s}-to-{l}" for s, l in MATRIX]
SAVERS = sorted({save for save, _ in MATRIX})


@pytest.fixture(scope="module")
def reference():
    return reference_run(make_config(), global_batches(STEPS, GLOBAL_BATCH, SEQ), clip=CLIP)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(root, each rank's losses): checkpoints after SAVE_AT steps, one per saving layout, made once."""

    def save(name):
        root = str(tmp_path_factory.mktemp(f"save-{name}"))
        return root, [losses for losses, _, _ in run_ranks(_run, _world(name), LAYOUTS[name], root, SAVE_AT, 0,
                                                          timeout=120)]

    return _cached(save)


@pytest.fixture(scope="module")
def resharded(tmp_path_factory, saved):
    """(each rank's (losses, params, start), the final checkpoint read whole, its manifest) of a run resumed
    from `save`'s checkpoint on `load`'s mesh and trained to STEPS."""
    import ckpt

    def resume(save, load):
        root = str(tmp_path_factory.mktemp(f"{save}-to-{load}"))
        shutil.copytree(saved(save)[0], root, dirs_exist_ok=True)
        results = run_ranks(_run, _world(load), LAYOUTS[load], root, STEPS, 0, "latest", timeout=120)
        final = os.path.join(root, ckpt.step_dir_name(STEPS))
        return results, ckpt.read_logical(final), ckpt.verify_checkpoint(final)

    return _cached(resume)


@pytest.mark.parametrize("save", SAVERS)
def test_the_saving_run_matches_the_reference(save, saved, reference):
    for losses in saved(save)[1]:
        torch.testing.assert_close(torch.tensor([losses[s] for s in range(SAVE_AT)]),
                                   torch.tensor(reference[0][:SAVE_AT]), rtol=TOL, atol=TOL)


@pytest.mark.parametrize("save,load", MATRIX, ids=MATRIX_IDS)
def test_resharding_resumes_at_the_saved_step(save, load, resharded):
    assert [start for _, _, start in resharded(save, load)[0]] == [SAVE_AT] * _world(load)


@pytest.mark.parametrize("save,load", MATRIX, ids=MATRIX_IDS)
def test_resharding_continues_the_reference_losses(save, load, resharded, reference):
    for losses, _, _ in resharded(save, load)[0]:
        torch.testing.assert_close(torch.tensor([losses[s] for s in range(SAVE_AT, STEPS)]),
                                   torch.tensor(reference[0][SAVE_AT:]), rtol=TOL, atol=TOL)


@pytest.mark.parametrize("save,load", MATRIX, ids=MATRIX_IDS)
def test_resharding_ends_at_the_reference_parameters(save, load, resharded, reference):
    """The final state, saved by the new layout, read back whole: the reference's parameters."""
    logical = resharded(save, load)[1]
    for name, ref in reference[2].items():
        torch.testing.assert_close(logical[f"param/{name}"], ref, rtol=TOL, atol=TOL, msg=name)


@pytest.mark.parametrize("save,load", MATRIX, ids=MATRIX_IDS)
def test_resharding_saves_on_the_new_mesh(save, load, resharded):
    assert resharded(save, load)[2]["mesh"]["world_size"] == _world(load)


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


# ---------------------------------------------------------------------------------------------------------
# A save failing on one rank
# ---------------------------------------------------------------------------------------------------------


def _save_fails_on_rank_1(rank, world, root, async_save, commit_timeout_s):
    """Rank 1's persist raises (a full disk, say): every rank must raise, none may wait forever."""
    import ckpt
    from data import BatchSampler
    from mesh import MeshShape, build_mesh
    from optim import DynamicLossScaler

    device = harness.device()
    mesh = build_mesh(MeshShape(dp=2))
    _, layout = build_layout(LAYOUTS["D2"], mesh, make_config(), torch.float64, device)
    saver = _checkpointer(root, mesh, device, async_save=async_save, commit_timeout_s=commit_timeout_s)
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


@pytest.fixture(scope="module")
def failed_save(tmp_path_factory):
    """(seconds, each rank's error, the committed checkpoints) of a save whose persist fails on rank 1, with the
    default 600 s commit timeout: rank 1's failure record must make rank 0 give up at once."""
    import ckpt

    def save(mode):
        root = str(tmp_path_factory.mktemp(f"failed-{mode}"))
        start = time.monotonic()
        messages = run_ranks(_save_fails_on_rank_1, 2, root, mode == "async", 600.0, timeout=60)
        return time.monotonic() - start, messages, ckpt.list_checkpoints(root)

    return _cached(save)


MODES = ["sync", "async"]


@pytest.mark.parametrize("mode", MODES)
def test_a_failed_save_is_raised_on_every_rank(mode, failed_save):
    messages = failed_save(mode)[1]
    assert all(m is not None and "rank 1" in m and "No space left" in m for m in messages), messages


@pytest.mark.parametrize("mode", MODES)
def test_a_failed_save_is_reported_at_once_not_at_the_commit_timeout(mode, failed_save):
    assert failed_save(mode)[0] < 30


@pytest.mark.parametrize("mode", MODES)
def test_rank_0_names_the_rank_that_failed_to_write_its_shard(mode, failed_save):
    assert "rank-00001 failed to write its shard" in failed_save(mode)[1][0]


@pytest.mark.parametrize("mode", MODES)
def test_a_failed_save_commits_nothing(mode, failed_save):
    assert failed_save(mode)[2] == []


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
    from shard import ShardInfo, Split, StatePiece

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


def _scaler_and_sampler():
    """What save and resume take besides the layout: a loss scaler (off) and a data cursor."""
    from data import BatchSampler
    from optim import DynamicLossScaler

    return DynamicLossScaler(False), BatchSampler(1000, 8, 4, 0)


@pytest.fixture(scope="module")
def fused_qkv(tmp_path_factory):
    """A fused [q|k|v] (12 rows each) saved as param/ and master/ pieces split over T=2, then ZeRO 3 ways."""
    import ckpt

    full = torch.randn(12 * 3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    master = torch.randn(36, 5, dtype=torch.float32, generator=torch.Generator().manual_seed(1))
    root = str(tmp_path_factory.mktemp("fused-qkv"))
    _checkpointer(root).save(7, _FakeLayout(_pieces("param", full, tp=2, zero=3)
                                            + _pieces("master", master, tp=2, zero=3)), *_scaler_and_sampler())
    path = ckpt.list_checkpoints(root)[0][1]
    return full, master, path


@pytest.mark.parametrize("tp,zero", [(1, 1), (3, 1), (1, 4), (3, 5), (2, 3), (6, 2)])
def test_param_is_filled_from_master_on_any_tp_and_zero_split(tp, zero, fused_qkv):
    """param/ prefers master/ (the more precise copy), whatever the target's T and ZeRO split."""
    import ckpt

    _, master, path = fused_qkv
    targets = _pieces("param", torch.zeros(36, 5, dtype=torch.float64), tp, zero)
    ckpt.load_pieces(path, ckpt.verify_checkpoint(path), targets)
    for got, want in zip(targets, _pieces("param", master.double(), tp, zero)):
        assert torch.equal(got.tensor, want.tensor)


def test_master_is_filled_from_param_when_the_checkpoint_has_none(fused_qkv, tmp_path):
    """A DDP fp32 checkpoint (no master/) into a mixed-precision layout: master/ comes from param/, cast."""
    import ckpt

    full = fused_qkv[0]
    _checkpointer(str(tmp_path)).save(1, _FakeLayout(_pieces("param", full, 2, 3)), *_scaler_and_sampler())
    targets = _pieces("master", torch.zeros(36, 5, dtype=torch.float32), 3, 2)
    path = ckpt.list_checkpoints(str(tmp_path))[0][1]
    ckpt.load_pieces(path, ckpt.verify_checkpoint(path), targets)
    for got, want in zip(targets, _pieces("master", full.float(), 3, 2)):
        assert torch.equal(got.tensor, want.tensor)


def test_an_optional_piece_the_checkpoint_lacks_keeps_its_live_value(fused_qkv):
    """An axis's optional state (experts/eplb.py's load averages, written with replicas only) absent from the
    checkpoint: the rest loads, the optional tensor keeps its value; the same piece not optional is refused."""
    from dataclasses import replace

    import ckpt
    from shard import ShardInfo, StatePiece

    full, master, path = fused_qkv
    live = torch.arange(4, dtype=torch.float64)
    absent = StatePiece("moe/h.0.mlp.expert_load", live, ShardInfo("h.0.mlp.expert_load", (4,)), optional=True)
    targets = _pieces("param", torch.zeros(36, 5, dtype=torch.float64), 1, 1)
    ckpt.load_pieces(path, ckpt.verify_checkpoint(path), targets + [absent])
    assert torch.equal(targets[0].tensor, master.double()) and live.tolist() == [0, 1, 2, 3]
    with pytest.raises(ckpt.CheckpointError, match="has no moe/h.0.mlp.expert_load"):
        ckpt.load_pieces(path, ckpt.verify_checkpoint(path), targets + [replace(absent, optional=False)])


def test_a_piece_written_twice_is_refused_at_commit(fused_qkv, tmp_path):
    """A layout bug (a `primary` wrong) is refused at commit, not discovered at the next resume."""
    import ckpt

    twice = _pieces("param", fused_qkv[0], 2, 1)
    with pytest.raises(ckpt.CheckpointError, match="missing or written twice"):
        _checkpointer(str(tmp_path)).save(1, _FakeLayout(twice + twice[:1]), *_scaler_and_sampler())


# ---------------------------------------------------------------------------------------------------------
# One process: resuming an older step, pruning, the manifest's records, the save's stats and line
# ---------------------------------------------------------------------------------------------------------


class _OneProcessLayout:
    """DDPLayout's checkpoint view for one process without a process group (ddp.py needs one)."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_pieces(self):
        from ddp import replicated_state_pieces

        return replicated_state_pieces(self.model.parameters(), self.optimizer, coords={})

    @property
    def optimizer_step_count(self):
        from ddp import adam_step

        return adam_step(self.optimizer)

    @optimizer_step_count.setter
    def optimizer_step_count(self, value):
        from ddp import set_adam_step

        set_adam_step(self.optimizer, value)


def _one_rank_checkpoints(root, steps=(2, 4), **config):
    """A tiny model and AdamW in this process (no process group), checkpointed at `steps` (keep 3)."""
    from reference import build_model
    from optim import build_adamw

    model = build_model(make_config(n_layer=1), seed=0)
    layout = _OneProcessLayout(model, build_adamw(model.parameters(), 1e-3))
    scaler, sampler = _scaler_and_sampler()
    config.setdefault("keep", 3)
    saver = _checkpointer(root, **config)
    for step in steps:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * step)
        layout.optimizer_step_count = step
        saver.save(step, layout, scaler, sampler)
    saver.close()
    return model, layout, scaler, sampler


@pytest.fixture(scope="module")
def older_step_resumed(tmp_path_factory):
    """Steps 2, 4, 6 saved; step 4 resumed (keep 2), step 5 saved; then `latest` resumed."""
    import ckpt

    root = str(tmp_path_factory.mktemp("older"))
    _, layout, scaler, sampler = _one_rank_checkpoints(root, steps=(2, 4, 6))
    saver = _checkpointer(root, keep=2)
    resumed = saver.resume("4", layout, scaler, sampler, seed=0)
    listing = sorted(os.listdir(root))
    saver.save(5, layout, scaler, sampler)
    committed = [step for step, _ in ckpt.list_checkpoints(root)]
    return dict(resumed=resumed, listing=listing, committed=committed,
                latest=saver.resume("latest", layout, scaler, sampler, seed=0))


def test_resuming_an_older_step_sets_the_newer_ones_aside_not_deleted(older_step_resumed):
    assert older_step_resumed["resumed"] == 4
    assert "step-00000006" not in older_step_resumed["listing"]
    assert any(name.startswith("abandoned-step-00000006-") for name in older_step_resumed["listing"])


def test_pruning_after_resuming_an_older_step_keeps_this_runs_line(older_step_resumed):
    assert older_step_resumed["committed"] == [5, 4]  # keep=2 pruned step 2, not into the abandoned step 6


def test_latest_after_resuming_an_older_step_follows_this_runs_line(older_step_resumed):
    assert older_step_resumed["latest"] == 5


@pytest.fixture(scope="module")
def pruned(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("pruned"))
    _one_rank_checkpoints(root, steps=(1, 2, 3, 4, 5))
    return root


def test_keep_prunes_to_the_newest_k(pruned):
    assert sorted(os.listdir(pruned)) == ["step-00000003", "step-00000004", "step-00000005"]  # keep=3


def test_the_manifest_records_the_step_the_mesh_and_every_scalar(pruned):
    import ckpt

    manifest = ckpt.verify_checkpoint(os.path.join(pruned, "step-00000005"))
    assert manifest["step"] == 5 and manifest["mesh"]["world_size"] == 1
    scalars = manifest["ranks"][0]["scalars"]
    assert scalars["data"]["step"] == 5 and scalars["lr_step"] == 5 and scalars["adam_step"] == 5
    assert set(manifest["ranks"][0]["tensors"]) >= {"rng/torch_cpu", "rng/python", "rng/numpy"}


@pytest.mark.parametrize("async_save", [False, True], ids=MODES)
def test_on_save_hears_every_committed_save_with_its_stats(async_save, tmp_path):
    """The Checkpointer prints nothing itself: each committed save reaches on_save once, in order, with its
    sizes and times; the time per step (for Young's interval in steps) is known from the second save on."""
    heard = []
    _one_rank_checkpoints(str(tmp_path), steps=(2, 4), async_save=async_save, on_save=heard.append)
    assert [stats.step for stats in heard] == [2, 4]
    assert all(s.async_save == async_save and s.total_bytes > 0 and s.num_files == 1 and s.persist_s > 0
               and s.blocked_s > 0 for s in heard)
    assert heard[0].seconds_per_step is None and heard[1].seconds_per_step > 0


def test_the_save_line_gives_youngs_interval_in_seconds_and_steps():
    """C = 0.5 s blocked, M = 24 h: sqrt(2·C·M) = sqrt(86,400) ≈ 294 s, at 10 s per step ≈ every 29 steps; an
    async save also names its persist time (the interval cannot be shorter)."""
    import ckpt
    import report.run
    stats = ckpt.SaveStats(8, "/ck/step-00000008", async_save=True, rank_bytes=1 << 20, blocked_s=0.5,
                           waited_s=0.1, persist_s=2.0, total_bytes=2 << 20, num_files=2, seconds_per_step=10.0)
    first, young = report.run.save_line(stats, mtbf_hours=24).splitlines()
    assert first == ("ckpt step 8 → /ck/step-00000008: 2.00 MiB in 2 files; training blocked 500 ms (waited 100 ms"
                     " for the previous save); persist 2000 ms (async)")
    assert young == ("ckpt Young interval sqrt(2·C·M) = 294 s ≈ every 29 steps (C = 0.500 s blocked,"
                     " M = MTBF 24 h); async: also ≥ the persist time 2.00 s")
    assert "\n" not in report.run.save_line(stats, mtbf_hours=None)


# ---------------------------------------------------------------------------------------------------------
# Corruption: each detected with a clear message; latest falls back to the newest good checkpoint
# ---------------------------------------------------------------------------------------------------------


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
    from resilience.ckpt_files import sha256_file

    shard = os.path.join(path, "shard-00000.pt")
    torch.save({"param/transformer.wte.weight": torch.zeros(1), "evil": _Evil()}, shard)

    def edit(manifest):
        manifest["files"]["shard-00000.pt"].update(bytes=os.path.getsize(shard), sha256=sha256_file(shard))

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


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    """Per kind of damage to step 4 (step 2 good): `--resume 4` then `--resume latest`, with the live state
    moved away from both checkpoints first, so that a partial load would show; everything either printed."""
    import ckpt

    def story(damage):
        root = str(tmp_path_factory.mktemp("damaged"))
        model, layout, scaler, sampler = _one_rank_checkpoints(root)
        good = {k: v.clone() for k, v in ckpt.read_logical(os.path.join(root, "step-00000002")).items()}
        bad_path = os.path.join(root, "step-00000004")
        DAMAGE[damage][0](bad_path)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        live = [p.detach().clone() for p in model.parameters()]
        out, printed, logged = dict(bad_path=bad_path), io.StringIO(), []
        with contextlib.redirect_stdout(printed):
            try:
                _checkpointer(root, keep=3).resume("4", layout, scaler, sampler, seed=0)
                out["refusal"] = None
            except ckpt.CheckpointError as e:
                out["refusal"] = str(e)
            out["untouched"] = all(torch.equal(p.detach(), before) for p, before in zip(model.parameters(), live))
            out["scalars_after_refusal"] = (layout.optimizer_step_count, sampler.step)
            out["latest"] = _checkpointer(root, keep=3, log=logged.append).resume("latest", layout, scaler, sampler, 0)
        out["scalars_after_latest"] = (layout.optimizer_step_count, sampler.step)
        out["loaded_good"] = [p.shard_info.global_name for p in model.parameters()
                              if not torch.equal(p.detach(), good[f"param/{p.shard_info.global_name}"])] == []
        out.update(logged=logged, printed=printed.getvalue(), listing=os.listdir(root))
        return out

    return _cached(story)


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_checkpoint_asked_for_by_step_is_refused_in_one_line(damage, damaged):
    """One line naming it, the reason and what to do."""
    message = damaged(damage)["refusal"]
    assert message is not None and re.search(DAMAGE[damage][1], message), message
    assert "\n" not in message and damaged(damage)["bad_path"] in message and "--resume latest" in message, message


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_refused_checkpoint_changes_nothing_live(damage, damaged):
    """The load is staged whole before any parameter is written."""
    assert damaged(damage)["untouched"] and damaged(damage)["scalars_after_refusal"] == (4, 0)


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_latest_reports_a_damaged_checkpoint_once_and_resumes_the_older_one(damage, damaged):
    story = damaged(damage)
    assert story["latest"] == 2 and story["scalars_after_latest"] == (2, 2)
    refusals = [line for line in story["logged"] if "refusing" in line and story["bad_path"] in line]
    assert len(refusals) == 1 and re.search(DAMAGE[damage][1], refusals[0]) and "\n" not in refusals[0], refusals


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_latest_loads_the_older_checkpoint_exactly(damage, damaged):
    assert damaged(damage)["loaded_good"]


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_checkpoint_is_set_aside_not_deleted(damage, damaged):
    """Kept for inspection, out of the way of this run's next step-4 save."""
    assert "step-00000004" not in damaged(damage)["listing"]
    assert any(name.startswith("abandoned-step-00000004-") for name in damaged(damage)["listing"])


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_checkpoint_runs_no_pickled_code(damage, damaged):
    assert "this must never run" not in damaged(damage)["printed"]


def test_a_dead_attempts_temporary_is_deleted_at_start_up_and_never_a_candidate(tmp_path):
    root = str(tmp_path)
    _, layout, scaler, sampler = _one_rank_checkpoints(root, steps=(2,))
    os.makedirs(os.path.join(root, ".tmp-step-00000004-deadbeef"))  # a dead attempt's half-written save
    with open(os.path.join(root, ".tmp-step-00000004-deadbeef", "shard-00000.pt"), "wb") as f:
        f.write(b"partial")
    loader = _checkpointer(root)
    assert not any(n.startswith(".tmp-") for n in os.listdir(root))
    assert loader.resume("latest", layout, scaler, sampler, seed=0) == 2


def test_no_resumable_checkpoint_is_one_error_saying_what_to_do(tmp_path):
    import ckpt

    root = str(tmp_path)
    _, layout, scaler, sampler = _one_rank_checkpoints(root, steps=(2,))
    os.remove(os.path.join(root, "step-00000002", "COMMITTED"))
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint in .* can be resumed .* start without --resume"):
        _checkpointer(root).resume("latest", layout, scaler, sampler, seed=0)


def test_a_step_that_is_not_there_is_refused_naming_those_that_are(tmp_path):
    import ckpt

    root = str(tmp_path)
    _, layout, scaler, sampler = _one_rank_checkpoints(root, steps=(2,))
    with pytest.raises(ckpt.CheckpointError, match=r"no step-00000009 .* \(have: step-00000002\)"):
        _checkpointer(root).resume("9", layout, scaler, sampler, seed=0)


def test_an_empty_directory_resumes_nothing(tmp_path):
    _, layout, scaler, sampler = _one_rank_checkpoints(str(tmp_path / "saved"), steps=())
    assert _checkpointer(str(tmp_path / "empty")).resume("latest", layout, scaler, sampler, 0) == 0


@pytest.mark.parametrize("argv,message", [
    (["--ckpt-dir", "x", "--keep", "1"], "--keep must be at least 2"),
    (["--resume", "latest"], "--resume needs --ckpt-dir"),
    (["--async-ckpt"], "--async-ckpt needs --ckpt-dir"),
    (["--ckpt-dir", "x", "--resume", "newest"], "--resume must be 'latest' or a step number"),
    (["--ckpt-dir", "x", "--ckpt-every", "-1"], "--ckpt-every must be at least 0"),
    (["--ckpt-dir", "x", "--mtbf-hours", "0"], "--mtbf-hours must be positive"),
], ids=["keep", "resume-without-dir", "async-without-dir", "resume-word", "ckpt-every", "mtbf"])
def test_a_checkpoint_flag_is_validated(argv, message):
    from cli.flags import FlagError, build_parser, validate

    with pytest.raises(FlagError, match=message):
        validate(build_parser().parse_args(argv), 2)


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


def _state_differences(model, layout, other_model, other_layout) -> list:
    """What differs (bitwise) between two runs: parameters, moments, the Adam step; [] when nothing does."""
    out = [f"param {i}" for i, (p, q) in enumerate(zip(model.parameters(), other_model.parameters()))
           if not torch.equal(p, q)]
    for i, (state, other) in enumerate(zip(_adam_state(layout.optimizer), _adam_state(other_layout.optimizer))):
        out += [f"{key} {i}" for key in ("exp_avg", "exp_avg_sq") if not torch.equal(state[key], other[key])]
    if layout.optimizer_step_count != other_layout.optimizer_step_count:
        out.append(f"Adam step {layout.optimizer_step_count} vs {other_layout.optimizer_step_count}")
    return out


def _fused_or_foreach(fused: bool, seed: int):
    from reference import build_model
    from optim import build_adamw

    model = build_model(make_config(n_layer=1), seed=seed)
    return model, _OneProcessLayout(model, build_adamw(model.parameters(), FUSED_LR, fused=fused))


def _made_ahead_and_natural():
    """A fused AdamW that took steps 1, 2 itself (natural), and one whose state ensure_adam_state made ahead."""
    from optim import ensure_adam_state
    from reference import seeded_adamw_step

    natural_model, natural = _fused_or_foreach(True, seed=0)
    for step in (1, 2):
        seeded_adamw_step(natural_model, natural.optimizer, step)
    made_model, made = _fused_or_foreach(True, seed=1)
    ensure_adam_state(made.optimizer)
    return natural_model, natural, made_model, made


def test_fused_adam_state_made_ahead_has_the_natural_ones_dtypes_and_devices(default_dtype):
    """Fused: the step a float32 on the parameter's device, even with float64 the default."""
    _, natural, _, made = _made_ahead_and_natural()
    kinds = [[(k, v.dtype, v.device, v.shape) for k, v in state.items()] for state in _adam_state(made.optimizer)]
    assert kinds == [[(k, v.dtype, v.device, v.shape) for k, v in state.items()]
                     for state in _adam_state(natural.optimizer)]
    assert _adam_state(made.optimizer)[0]["step"].dtype == torch.float32


def test_fused_adam_state_made_ahead_steps_bitwise_like_the_natural_one(default_dtype):
    """Moments copied in and the step set, as a resume does, then two steps: bitwise the fused AdamW that took
    all four steps itself."""
    from reference import seeded_adamw_step

    natural_model, natural, made_model, made = _made_ahead_and_natural()
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
    assert _state_differences(made_model, made, natural_model, natural) == []
    assert made.optimizer_step_count == 4


@pytest.fixture(scope="module")
def fused_and_foreach(tmp_path_factory):
    """Fused run A saves at step 2 and runs on to 4. From its checkpoint: a fused run continues like A; a foreach
    run B resumes it, takes step 3 and saves; a fused run C resumes B's and takes step 4. The resumed runs start
    from other weights (seed 1), so anything not loaded shows. Each comparison is made when it is due."""
    from reference import seeded_adamw_step

    def resume(name, fused):
        model, layout = _fused_or_foreach(fused, seed=1)
        scaler, sampler = _scaler_and_sampler()
        step = _checkpointer(str(base / name)).resume("latest", layout, scaler, sampler, 0)
        return model, layout, scaler, sampler, step

    out, base = {}, tmp_path_factory.mktemp("fused-foreach")
    model_a, a = _fused_or_foreach(True, seed=0)
    for step in (1, 2):
        seeded_adamw_step(model_a, a.optimizer, step)
    _checkpointer(str(base / "fused-a")).save(2, a, *_scaler_and_sampler())
    model_fused, fused, *_, out["fused_step"] = resume("fused-a", fused=True)
    model_b, b, scaler_b, sampler_b, out["foreach_step"] = resume("fused-a", fused=False)
    out["foreach_from_fused"] = _state_differences(model_b, b, model_a, a)
    foreach_step = _adam_state(b.optimizer)[0]["step"]
    out["foreach_step_kind"] = (foreach_step.dtype, foreach_step.device.type)
    for step in (3, 4):
        seeded_adamw_step(model_a, a.optimizer, step)
        seeded_adamw_step(model_fused, fused.optimizer, step)
    out["fused_from_fused"] = _state_differences(model_fused, fused, model_a, a)
    seeded_adamw_step(model_b, b.optimizer, 3)
    _checkpointer(str(base / "foreach-b")).save(3, b, scaler_b, sampler_b)
    model_c, c, *_, out["fused_again_step"] = resume("foreach-b", fused=True)
    out["fused_again_is_fused"] = all(g["fused"] for g in c.optimizer.param_groups)
    out["fused_from_foreach"] = _state_differences(model_c, c, model_b, b)
    seeded_adamw_step(model_c, c.optimizer, 4)
    out.update(model_a=model_a, a=a, model_c=model_c, c=c)
    return out


def test_a_fused_checkpoint_continues_bitwise_in_fused(fused_and_foreach):
    assert fused_and_foreach["fused_step"] == 2 and fused_and_foreach["fused_from_fused"] == []


def test_a_fused_checkpoint_resumes_into_foreach_exactly(fused_and_foreach):
    """Adam step 2, the same moments; the step count is foreach's own kind (a CPU scalar of the default dtype)."""
    assert fused_and_foreach["foreach_step"] == 2 and fused_and_foreach["foreach_from_fused"] == []
    assert fused_and_foreach["foreach_step_kind"] == (torch.get_default_dtype(), "cpu")


def test_a_foreach_checkpoint_resumes_into_fused_exactly(fused_and_foreach):
    assert fused_and_foreach["fused_again_step"] == 3 and fused_and_foreach["fused_again_is_fused"]
    assert fused_and_foreach["fused_from_foreach"] == []


def test_a_run_with_one_foreach_step_stays_within_the_fused_tolerance(fused_and_foreach):
    from reference import fused_adamw_tolerance

    c, a = fused_and_foreach["c"], fused_and_foreach["a"]
    assert c.optimizer_step_count == a.optimizer_step_count == 4
    for p, q in zip(fused_and_foreach["model_c"].parameters(), fused_and_foreach["model_a"].parameters()):
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
# ProcessGroupGloo's connectFullMesh: the agent's store, shared with the workers, still holds the dead workers'
# addresses), so the test relaunches torchrun itself; train.py is the same either way. bench/goodput.py runs
# --max-restarts with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a fresh store per attempt).

FAULT_STEPS = 12


def _rank_of(pid: int) -> int | None:
    """The RANK torchrun gave a worker (its environment), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    except OSError:
        return None
    return int(env[b"RANK"]) if b"RANK" in env else None


def launch_training(run_dir: str, corpus: str, log_name: str, extra=(), env=None):
    """torchrun, 2 workers, tiny preset, dropout on, a checkpoint every 2 steps, --resume latest."""
    from resilience.ckpt_files import FAULT_ENV

    os.makedirs(run_dir, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               os.path.join(ROOT, "train.py"), *backend_flags(2), "--preset", "tiny", "--steps", str(FAULT_STEPS),
               "--global-batch", "4", "--seq-len", "32", "--dtype", "fp32", "--dropout", "0.1", "--deterministic",
               "--eval-every", "0", "--sample-tokens", "0", "--log-every", "1", "--data", corpus,
               "--out-dir", run_dir, "--ckpt-dir", os.path.join(run_dir, "ck"), "--ckpt-every", "2",
               "--resume", "latest", "--metrics-file", os.path.join(run_dir, "metrics.jsonl"), *extra]
    log = open(os.path.join(run_dir, log_name), "w")
    env = dict({k: v for k, v in os.environ.items() if k != FAULT_ENV}, **(env or {}))
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=run_dir,
                            start_new_session=True)


def run_to_completion(run_dir: str, corpus: str, log_name: str, extra=()):
    proc = launch_training(run_dir, corpus, log_name, extra)
    try:
        assert proc.wait(timeout=120) == 0, open(os.path.join(run_dir, log_name)).read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def kill_a_worker_when(proc, condition, rng, timeout=60, rank=None) -> int | None:
    """SIGKILL one of torchrun's two workers (the one of `rank`, else chosen by rng) as soon as condition()
    holds; its pid or None. torchrun then stops the other worker (SIGTERM) and exits with an error: the whole
    job is down, as after a crash."""
    deadline = time.monotonic() + timeout
    victim = None
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if condition():
                workers = child_pids(proc.pid)
                if len(workers) == 2:
                    victim = (rng.choice(sorted(workers)) if rank is None
                              else next((w for w in workers if _rank_of(w) == rank), None))
                    if victim is not None:
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


def final_state_differences(run_dir: str, reference: dict) -> list[str]:
    """The logical tensors (parameters, Adam moments) of the run's final checkpoint not bitwise the reference's;
    the goodput ledger (kind goodput/: the job's seconds by cause) is accounting, and differs from run to run."""
    import ckpt

    final = ckpt.read_logical(os.path.join(run_dir, "ck", ckpt.step_dir_name(FAULT_STEPS)))
    assert final.keys() == reference.keys()
    return [key for key, tensor in reference.items() if not key.startswith("goodput/")
            and not torch.equal(final[key], tensor)]


def replayed_losses(run_dir: str) -> dict:
    """{step: loss} of the metrics file; steps replayed after the kill are in it twice and must agree."""
    seen = {}
    for record in metrics_lines(run_dir):
        assert seen.setdefault(record["step"], record["loss"]) == record["loss"], record
    return seen


def resume_lines(run_dir: str) -> list[str]:
    with open(os.path.join(run_dir, "relaunch.txt")) as f:
        return [line for line in f if "ckpt: resumed from" in line or "ckpt: no checkpoint" in line]


def check_fault_run(run_dir: str, reference: dict) -> str:
    """The killed-and-relaunched run ended like the uninterrupted one: returns the relaunch's resume line."""
    assert final_state_differences(run_dir, reference) == []
    assert sorted(replayed_losses(run_dir)) == list(range(FAULT_STEPS))
    resumed = resume_lines(run_dir)
    assert len(resumed) == 1, resumed
    return resumed[0]


@pytest.fixture(scope="module")
def fault_runs(tmp_path_factory):
    """The corpus, the rng and the uninterrupted run's final checkpoint read whole (the reference)."""
    import ckpt

    base = tmp_path_factory.mktemp("faults")
    corpus, rng = str(base / "corpus.txt"), random.Random(0)
    with open(corpus, "w") as f:
        f.write("".join(rng.choice("abcdefgh ijklmnop\n") for _ in range(50_000)))
    uninterrupted = str(base / "uninterrupted")
    run_to_completion(uninterrupted, corpus, "log.txt")
    reference = ckpt.read_logical(os.path.join(uninterrupted, "ck", ckpt.step_dir_name(FAULT_STEPS)))
    return dict(base=base, corpus=corpus, rng=rng, reference=reference)


@pytest.fixture(scope="module")
def killed_mid_training(fault_runs):
    """A worker killed after a random number of steps in the middle of training, then relaunched."""
    run_dir, rng = str(fault_runs["base"] / "mid-training"), fault_runs["rng"]
    kill_after = rng.randrange(3, FAULT_STEPS - 2)
    proc = launch_training(run_dir, fault_runs["corpus"], "log.txt")
    victim = kill_a_worker_when(proc, lambda: len(metrics_lines(run_dir)) >= kill_after, rng)
    assert victim is not None and proc.returncode != 0, "the run finished before the kill"
    run_to_completion(run_dir, fault_runs["corpus"], "relaunch.txt")
    return dict(run_dir=run_dir, kill_after=kill_after)


@pytest.fixture(scope="module")
def killed_in_persist(fault_runs):
    """Rank 0's worker killed while the step-6 checkpoint persists (async; every rank's persist sleeps after
    its shard), then relaunched. Rank 0, not a random one: when rank 1 dies, torchrun SIGTERMs rank 0, whose
    signal handler abandons the save (train.interrupted removes its temporary directory), and the half-written
    save this case is about would be gone before the relaunch."""
    from resilience.ckpt_files import FAULT_ENV

    run_dir = str(fault_runs["base"] / "in-persist")
    ck = os.path.join(run_dir, "ck")

    def persisting_step_6():
        names = os.listdir(ck) if os.path.isdir(ck) else []
        return any(n.startswith(".tmp-step-00000006") and os.listdir(os.path.join(ck, n)) for n in names)

    proc = launch_training(run_dir, fault_runs["corpus"], "log.txt", ["--async-ckpt"], {FAULT_ENV: "6:30"})
    assert kill_a_worker_when(proc, persisting_step_6, fault_runs["rng"], rank=0) is not None
    listing = os.listdir(ck)
    run_to_completion(run_dir, fault_runs["corpus"], "relaunch.txt", ["--async-ckpt"])
    return dict(run_dir=run_dir, listing_after_kill=listing)


@pytest.mark.slow
def test_a_kill_mid_training_ends_bitwise_like_the_uninterrupted_run(killed_mid_training, fault_runs):
    assert final_state_differences(killed_mid_training["run_dir"], fault_runs["reference"]) == []


@pytest.mark.slow
def test_a_kill_mid_training_replays_the_same_losses(killed_mid_training):
    assert sorted(replayed_losses(killed_mid_training["run_dir"])) == list(range(FAULT_STEPS))


@pytest.mark.slow
def test_a_kill_mid_training_resumes_once_from_the_newest_committed_checkpoint(killed_mid_training):
    resumed = resume_lines(killed_mid_training["run_dir"])
    assert len(resumed) == 1, resumed
    resumed_at = int(resumed[0].split(" at step ")[1].split()[0])
    assert resumed_at % 2 == 0 and resumed_at <= killed_mid_training["kill_after"] + 1, resumed


@pytest.mark.slow
def test_a_kill_in_persist_leaves_the_half_written_save_uncommitted(killed_in_persist):
    listing = killed_in_persist["listing_after_kill"]
    assert any(n.startswith(".tmp-step-00000006") for n in listing), listing
    assert "step-00000006" not in listing


@pytest.mark.slow
def test_a_kill_in_persist_resumes_once_from_the_checkpoint_before(killed_in_persist):
    resumed = resume_lines(killed_in_persist["run_dir"])
    assert len(resumed) == 1 and "step-00000004 at step 4" in resumed[0], resumed  # the half-written one: never


@pytest.mark.slow
def test_a_kill_in_persist_ends_bitwise_like_the_uninterrupted_run(killed_in_persist, fault_runs):
    assert final_state_differences(killed_in_persist["run_dir"], fault_runs["reference"]) == []
    assert sorted(replayed_losses(killed_in_persist["run_dir"])) == list(range(FAULT_STEPS))


# ---------------------------------------------------------------------------------------------------------
# One writer per directory
# ---------------------------------------------------------------------------------------------------------


def test_a_second_writer_is_refused_naming_the_holder_and_touches_nothing(tmp_path):
    """One run writes a --ckpt-dir at a time (ckpt_files.WriterLock, an flock on <dir>/.lock): a second
    exclusive Checkpointer is refused before it touches the directory (the first one's temporary survives)."""
    import ckpt

    root = str(tmp_path / "ck")
    first = _checkpointer(root, exclusive=True)
    in_progress = os.path.join(root, f".tmp-step-00000007-{first.nonce}")
    os.makedirs(in_progress)  # what an async save of the first run would be writing now
    with pytest.raises(ckpt.CheckpointError, match=r"is being written by another run \(pid \d+ on .*\.lock\)"):
        _checkpointer(root, exclusive=True)
    assert os.path.isdir(in_progress)
    first.close()


def test_closing_a_writer_frees_the_directory(tmp_path):
    root = str(tmp_path / "ck")
    _checkpointer(root, exclusive=True).close()
    _checkpointer(root, exclusive=True).close()


def test_a_sigkilled_writer_leaves_no_stale_lock(tmp_path):
    from resilience.ckpt_files import CheckpointError, WriterLock

    root = str(tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", f"import sys; sys.path.insert(0, {ROOT!r}); import time;"
                               f" from resilience import ckpt_files; lock = ckpt_files.WriterLock({root!r});"
                               f" print('held', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(CheckpointError):
        WriterLock(root)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    WriterLock(root).release()  # the kernel dropped the dead holder's lock


# ---------------------------------------------------------------------------------------------------------
# The bench runs
# ---------------------------------------------------------------------------------------------------------


def test_bench_ckpt_smoke_runs(tmp_path, capsys):
    """bench/bench_ckpt.py --smoke: tiny shapes, one save per mode, the table and the ratios printed (run in this
    process, so its ranks come from the harness's warm fork server)."""
    run_bench("bench_ckpt", ["--smoke", "--root", str(tmp_path)])
    out = capsys.readouterr().out
    assert "ratios (side by side, same run):" in out and " D=2: " in out, out


def _dropping(rank, world, root):
    """Each case: a checkpoint written by the first flags, resumed by the second (what it would throw away),
    refused with the state named, then resumed with --drop-state."""
    import ckpt
    from harness import traced_steps
    from test_composition import CLIP, SEQ, composed_run

    cases = {  # name: (the writer's flags, the reader's flags)
        "diloco mid-round": (["--diloco-h", "2", "--diloco-replicas", "2", "--steps", "4"], []),
        "shared experts": (["--moe-experts", "2", "--moe-shared-experts", "1"], ["--moe-experts", "2"]),
        "router bias": (["--moe-experts", "2", "--moe-score", "sigmoid", "--moe-bias-rate", "0.01"],
                        ["--moe-experts", "2"]),
    }
    out = {}
    for name, (written, read) in cases.items():
        directory = os.path.join(root, name.replace(" ", "-"))
        traced_steps(composed_run(rank, world, written, {}, 4, 1, torch.device("cpu")), 4, 4, SEQ, 1, CLIP, 1,
                     save_root=directory)  # one step: DiLoCo's round (H = 2) is half done
        try:
            traced_steps(composed_run(rank, world, read, {}, 4, 1, torch.device("cpu")), 4, 4, SEQ, 1, CLIP, 2,
                         resume_root=directory)
            out[name] = None
        except ckpt.CheckpointError as e:
            out[name] = str(e)
        losses, _ = traced_steps(composed_run(rank, world, read, {}, 4, 1, torch.device("cpu")), 4, 4, SEQ, 1, CLIP,
                                 2, resume_root=directory, drop_state=True)
        out[name + " dropped"] = sorted(losses)
    return out


def test_a_resume_that_would_drop_trained_state_is_refused_unless_told(tmp_path):
    """The checkpoint holds state this run's flags have no place for (the other DiLoCo replica's work and the outer
    momentum, shared experts, a router's bias): refused, on every rank, naming it; --drop-state goes on (step 1)."""
    results = run_ranks(_dropping, 2, str(tmp_path), timeout=240)
    for got in results:
        assert "diloco/" in got["diloco mid-round"], got["diloco mid-round"]
        assert "shared_experts" in got["shared experts"], got["shared experts"]
        assert "expert_bias" in got["router bias"], got["router bias"]
        for name in ("diloco mid-round", "shared experts", "router bias"):
            assert "this run would drop state the checkpoint holds" in got[name] and "--drop-state" in got[name]
            assert got[name + " dropped"] == [1], got[name + " dropped"]
