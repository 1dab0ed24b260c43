"""resilience/diloco.py: R replicas, H inner AdamW steps each, the pseudo-gradient averaged and an outer Nesterov step.

Every multi-rank case runs in one spawn of 4 ranks (module fixture), in float64, built as train.main builds a run
(test_composition.composed_run: flags → mesh → compose, the DiLoCo layout around DDP or ZeRO), on the
deterministic batches of tests/reference.py, with clipping active (each replica clips by its own norm):
- R = 1, H = 1, outer lr 1, momentum 0 over D = 4: the plain data-parallel update, the single-device model's
  (reference.reference_run), to 1e-10;
- R = 2, H = 2, the paper's outer lr 0.7 and momentum 0.9, inside each replica DDP over 2 ranks, TP 2, or ZeRO-1
  over 2 ranks: the float64 reference below (Algorithm 1 of the paper, the R replicas run one after another in
  this process with torch's AdamW, clip_grad_norm_ and SGD(nesterov=True)), to 1e-10;
- the bytes traced per step equal the predicted ones (the Δ all-reduce amortised over H: calls 1/H);
- a checkpoint saved mid-round (step 3 of 4, H = 2) and resumed on the same mesh gives bitwise the losses and
  parameters of the uninterrupted run.
"""

import copy
import os
import subprocess
import sys
from contextlib import nullcontext

import pytest
import torch

import harness
from harness import assert_runs_follow, run_ranks
from reference import HYPER, global_batches, make_config, rank_micro_batches, reference_run
from test_composition import SEQ, composed_run

from resilience import ckpt_files
from mesh import MeshShape, axis_groups, groups_of, infer_mesh_shape
from reference import build_model
from optim import adamw_param_groups

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DILOCO_STEPS, CLIP, TOL = 4, 0.05, 1e-10
PLAIN = ["--diloco-h", "1", "--diloco-replicas", "1", "--diloco-outer-lr", "1", "--diloco-outer-momentum", "0"]
PAPER = ["--diloco-h", "2", "--diloco-replicas", "2"]  # outer lr 0.7, momentum 0.9: the defaults
CASES = {  # name: (flags, global batch, B_μ)
    "plain": (PLAIN, 8, 2),
    "ddp": (PAPER, 8, 2),
    "tp": ([*PAPER, "--tp", "2"], 8, 4),
    "zero1": ([*PAPER, "--zero", "1"], 8, 2),
}


def diloco_reference(batches, replicas: int, h: int, outer_lr: float, momentum: float, clip: float):
    """Algorithm 1 of Douillard et al. 2023 on one process, in float64: replica r trains on rows
    [r·B/R, (r+1)·B/R) of each global batch with its own AdamW (its loss the mean over its own target tokens,
    clipped by its own norm); after every H steps the outer gradient (1/R) Σ_r (θ − θ_r) takes one step of
    torch's SGD with Nesterov momentum on θ, and every replica restarts from θ. Returns (replica 0's losses,
    θ's parameters)."""
    outer_model = build_model(make_config(), seed=0, dtype=torch.float64)
    outer = torch.optim.SGD(outer_model.parameters(), lr=outer_lr, momentum=momentum, nesterov=True)
    models = [copy.deepcopy(outer_model) for _ in range(replicas)]
    inner = [torch.optim.AdamW(adamw_param_groups(m.parameters(), HYPER["weight_decay"]), lr=HYPER["lr"],
                               betas=HYPER["betas"], eps=HYPER["eps"]) for m in models]
    losses = []
    for step, (x, y) in enumerate(batches):
        rows = x.shape[0] // replicas
        for r, (model, optimizer) in enumerate(zip(models, inner)):
            xr, yr = x[r * rows:(r + 1) * rows], y[r * rows:(r + 1) * rows]
            _, loss_sum, count = model(xr, yr)
            (loss_sum / count).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad()
            if r == 0:
                losses.append(float(loss_sum.detach() / count))
        if (step + 1) % h == 0:
            with torch.no_grad():
                for theta, *locals_ in zip(outer_model.parameters(), *(m.parameters() for m in models)):
                    theta.grad = sum(theta - local for local in locals_) / replicas
            outer.step()
            for model in models:
                model.load_state_dict(outer_model.state_dict())
    return losses, {name: p.detach().clone() for name, p in outer_model.named_parameters()}


def _train(rank, world, flags, global_batch, micro, stop=DILOCO_STEPS, save_root=None, resume_root=None,
           trace=False):
    """Steps [start, stop) of a run composed from the flags (float64) on the reference's batches; a save at `stop`
    into save_root, or a start from the newest checkpoint in resume_root. Returns (losses, {name: (local, info)})
    and, with `trace`, (traced per step, report.run.predicted_messages)."""
    import ckpt
    import report.run
    from accounting.tracer import CommTracer
    from data import BatchSampler
    from optim import DynamicLossScaler
    from step import train_step

    device = harness.device()
    run = composed_run(rank, world, flags, {}, global_batch, micro, device)
    mesh, scaler, start = run.mesh, DynamicLossScaler(enabled=False), 0
    sampler = BatchSampler(10_000, SEQ, global_batch, 0)  # the cursor only: the batches are the reference's
    if resume_root:
        loader = ckpt.Checkpointer(ckpt.CheckpointConfig(resume_root), mesh, run.axes, device, log=lambda *a: None)
        start = loader.resume("latest", run.layout, scaler, sampler, 0)
    losses, run.tracer = {}, CommTracer()
    for name, group in mesh.groups.items():
        run.tracer.name_group(group, name)
    for step, (x, y) in enumerate(global_batches(DILOCO_STEPS, global_batch, SEQ)):
        if start <= step < stop:
            batches = [(*b, None) for b in rank_micro_batches(x, y, mesh.index("dp"), mesh.size("dp"), micro)]
            with run.tracer if trace else nullcontext():
                outcome = train_step(run.layout, scaler, batches, mesh.group("dp_cp"), CLIP, run.autocast, device,
                                     model=run.model, schedule=run.schedule, axes=run.axes,
                                     data_size=mesh.shape.replica_dp)
            losses[step] = outcome.loss
    if save_root:
        saver = ckpt.Checkpointer(ckpt.CheckpointConfig(save_root), mesh, run.axes, device, log=lambda *a: None)
        saver.save(stop, run.layout, scaler, sampler)
        saver.close()
    infos = {p.shard_info.global_name: p.shard_info for p in run.model.parameters()}
    held = run.layout.full_parameters() if hasattr(run.layout, "full_parameters") else {
        p.shard_info.global_name: p.detach().clone() for p in run.model.parameters()}
    params = {name: (held[name], info) for name, info in infos.items()}
    if not trace:
        return losses, params
    steps = len(losses)
    traced = {key: (r.calls / steps, r.payload_bytes / steps) for key, r in run.tracer.records.items()}
    return losses, params, (traced, report.run.predicted_messages(run, steps))


def _all_cases(rank, world, root):
    """Each case trained DILOCO_STEPS steps (the `ddp` one traced), then the `ddp` case again: steps [0, 3) and a
    save, and a fresh run resumed from it for step 3."""
    out = {name: _train(rank, world, flags, batch, micro, trace=name == "ddp")
           for name, (flags, batch, micro) in CASES.items()}
    flags, batch, micro = CASES["ddp"]
    _train(rank, world, flags, batch, micro, stop=3, save_root=root)
    out["resumed"] = _train(rank, world, flags, batch, micro, resume_root=root)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("diloco-ckpt")
    return run_ranks(_all_cases, 4, str(root), timeout=300)


def _batches(global_batch):
    return global_batches(DILOCO_STEPS, global_batch, SEQ)


def test_plain_diloco_is_the_data_parallel_update(results):
    """R = 1, H = 1, outer lr 1, momentum 0: θ_start − Δ = θ after each step, the single-device model's."""
    ref_losses, _, ref_params = reference_run(make_config(), _batches(CASES["plain"][1]), clip=CLIP)
    assert_runs_follow([r["plain"] for r in results], dict(enumerate(ref_losses)), ref_params, TOL)


@pytest.mark.parametrize("name", ["ddp", "tp", "zero1"])
def test_diloco_follows_the_papers_algorithm(results, name):
    """R = 2, H = 2, lr 0.7, momentum 0.9, inside each replica DDP, TP or ZeRO-1: the reference's losses
    (replica 0's, as rank 0 logs them) and its θ after two outer steps, to 1e-10 in float64."""
    losses, params = diloco_reference(_batches(CASES[name][1]), 2, 2, 0.7, 0.9, CLIP)
    plain_losses, _, plain_params = reference_run(make_config(), _batches(CASES[name][1]), clip=CLIP)
    assert max(abs(a - b) for a, b in zip(losses, plain_losses)) > 1e-4  # DiLoCo is not the plain update here
    assert_runs_follow([r[name] for r in results[:2]], dict(enumerate(losses)), params, TOL)  # replica 0
    for r in results[2:]:  # replica 1 logs its own losses; its parameters are θ after the last outer step
        for pname, (local, info) in r[name][1].items():
            torch.testing.assert_close(local, info.shard_of(params[pname]), rtol=TOL, atol=TOL)


def test_traced_bytes_equal_the_predicted(results):
    """Per step: the Δ all-reduce over `diloco` (1/H calls, Ψ·8/H bytes in float64), the replica's gradient
    all-reduce and scalars, and the update's 16 bytes over `replica`: traced == predicted on every rank."""
    for r in results:
        traced, predicted = r["ddp"][2]
        assert traced == {key: tuple(value) for key, value in predicted.items()}, (traced, predicted)
        diloco = next(value for key, value in traced.items() if "diloco" in key[1])
        psi = sum(local.numel() for local, _ in r["ddp"][1].values())
        assert diloco == (0.5, psi * 8 / 2)  # H = 2: one all-reduce of every parameter every other step


def test_a_mid_round_checkpoint_resumes_bitwise(results):
    """Saved at step 3 (one inner step into the second round): every replica's inner state, θ_start, the
    momentum and the round's position come back, and step 3 replays bitwise."""
    for r in results:
        full_losses, full_params = r["ddp"][0], r["ddp"][1]
        losses, params = r["resumed"]
        assert losses == {3: full_losses[3]}
        for name, (local, _) in params.items():
            assert torch.equal(local, full_params[name][0]), name


def test_replicas_cut_the_data_ranks_outermost():
    """replica = d // (D/R): contiguous blocks of ranks; gradient groups inside one replica; `diloco` joins the
    ranks at the same place in each; groups_of (a plan's) agrees with axis_groups (a run's)."""
    shape = MeshShape(dp=4, tp=2, replicas=2)
    groups = axis_groups(shape)
    assert groups["replica"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups["diloco"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["dp_cp"] == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert groups["dp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]  # the batch is still split over all D data ranks
    for rank in range(8):
        for name, ranks in groups_of(shape, rank).items():
            assert ranks in groups[name], (rank, name)
    assert "replica" not in axis_groups(MeshShape(dp=4, tp=2))


BAD = [
    (["--diloco-h", "0"], 4, "--diloco-h must be at least 1"),
    (["--diloco-h", "2", "--diloco-replicas", "3"], 4, "--diloco-replicas 3 must be a positive divisor"),
    (["--diloco-h", "2", "--diloco-replicas", "4", "--tp", "2"], 4, "data-parallel degree D = world 4"),
    (["--diloco-replicas", "2"], 4, "--diloco-replicas needs --diloco-h"),
    (["--diloco-h", "2", "--diloco-replicas", "0"], 4, "--diloco-replicas must be at least 1"),  # was: R = 1
    (["--diloco-outer-lr", "0.7"], 4, "--diloco-outer-lr needs --diloco-h"),  # its default, but given: ignored before
    (["--diloco-outer-momentum", "0.5"], 4, "--diloco-outer-momentum needs --diloco-h"),
    (["--diloco-h", "2", "--diloco-outer-momentum", "1"], 4, "--diloco-outer-momentum must be in [0, 1)"),
    (["--diloco-h", "2", "--zero", "3"], 4, "--diloco-h with --zero 3"),
    (["--diloco-h", "7", "--steps", "20"], 4, "--steps 20 must be a multiple of --diloco-h 7"),
]


@pytest.mark.parametrize("flags,world,message", BAD, ids=[" ".join(f) for f, _, _ in BAD])
def test_bad_diloco_input_ends_in_one_line(flags, world, message, refused):
    err = refused(flags, world)
    assert message in err, err
    with pytest.raises(ValueError):
        infer_mesh_shape(8, replicas=0)


@pytest.mark.slow
def test_a_run_whose_loss_goes_non_finite_stops_with_one_line_and_keeps_its_checkpoints(tmp_path):
    """`--diloco-outer-lr 1e30`: the outer step of step 1 (H = 2) blows the weights up, the loss of step 2 is NaN.
    The run stops there (exit status 1) with one line naming the step and the newest committed checkpoint, and
    writes nothing more: without the stop it trains NaN to step 8 and exits 0."""
    ck = tmp_path / "ck"
    argv = [sys.executable, os.path.join(ROOT, "train.py"), "--preset", "tiny", "--global-batch", "2",
            "--steps", "8", "--eval-every", "0", "--sample-tokens", "0", "--out-dir", str(tmp_path), "--ckpt-dir",
            str(ck), "--ckpt-every", "1", "--diloco-h", "2", "--diloco-outer-lr", "1e30", "--peak-tflops", "1",
            *harness.backend_flags(1)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    run = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert run.returncode == 1, (run.returncode, run.stderr[-3000:])
    stops = [line for line in run.stderr.splitlines() if line.startswith("non-finite")]
    assert len(stops) == 1 and stops[0].startswith("non-finite loss at step 2 (loss nan"), run.stderr[-3000:]
    assert "--diloco-outer-lr" in stops[0] and "the newest committed checkpoint is step 2" in stops[0], stops
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    assert sorted(n for n in os.listdir(ck) if n.startswith("step-")) == ["step-00000001", "step-00000002"]  # no later
    ckpt_files.verify_checkpoint(ckpt_files.newest_committed(str(ck))[1])
