"""parallel/zero_pipeline.py: ZeRO-2 and ZeRO-3 under every pipeline schedule follow the single-device model, send and
hold what they predict, and resume on another mesh.

One spawn of 4 ranks (P = 2 × D = 2, the tied embedding across the stages) runs every case, each built as train.main
builds it (tests/test_composition.py's `composed_run`: flags → mesh → stage → axes → layout → schedule) in float64,
and trained STEPS steps with step.train_step on tests/reference.py's batches (clipping active):
1. losses and every parameter (ZeRO-3's gathered exactly) equal torch's AdamW on one device (1e-10), for gpipe, 1f1b,
   interleaved (v = 2) and zb at stages 2 and 3, and ZeRO-3 with activation checkpointing (interleaved: the
   recompute runs inside the chunk's B, while the schedule holds it gathered);
2. every traced (collective, group) of a step equals report.run.predicted_messages: the layout's one reduce_scatter per
   unit, stage 2's update all_gather, stage 3's all_gather per run of a chunk's actions, the pipeline's p2p and
   tied sum (calls and payload);
3. held bytes equal the persistent formula; the most bytes the layout's gathered chunks and gradient buffers held
   at once equal the prediction from the action list (zero_pipeline.step_transient), and the gathered chunks
   alive at once equal the bound (2 with v = 2: in use + prefetched; 1 at v = 1);
4. saved on P=2 D=2 ZeRO-3 (interleaved) and resumed on D=4 ZeRO-1 without a pipeline, and saved on D=4 ZeRO-3
   and resumed on P=2 D=2 ZeRO-2 (zb): the resumed steps and parameters equal the uninterrupted reference.
"""

import os

import pytest

import harness
from harness import run_ranks
from test_composition import STEPS, _check, composed_run

CASES = [(["--pp", "2", "--pp-schedule", schedule, "--zero", str(stage)], dict(n_layer=n_layer), 8, 1)
         for stage in (2, 3) for schedule, n_layer in (("gpipe", 2), ("1f1b", 2), ("interleaved", 4), ("zb", 2))] + [
    (["--pp", "2", "--pp-schedule", "interleaved", "--zero", "3", "--activation-checkpointing"],
     dict(n_layer=4, activation_checkpointing=True), 8, 1),  # the recompute runs inside B, its chunk gathered
]
SAVE_AT = 2
RESHARD = [
    ((["--pp", "2", "--pp-schedule", "interleaved", "--zero", "3"], dict(n_layer=4), 8, 1),
     (["--zero", "1"], dict(n_layer=4), 8, 1)),
    ((["--zero", "3"], dict(n_layer=4), 8, 1), (["--pp", "2", "--pp-schedule", "zb", "--zero", "2"], dict(n_layer=4),
                                                8, 1)),
]


def _train(rank, world, flags, config_kw, global_batch, micro, start=0, stop=STEPS, save=None, resume=None):
    """Train steps [start, stop) of the case; returns (losses, params, what the layout and the tracer saw)."""
    import ckpt
    import report.run
    from accounting.tracer import CommTracer
    from data import BatchSampler
    from optim import DynamicLossScaler
    from reference import global_batches, rank_micro_batches
    from step import train_step

    device = harness.device()
    run = composed_run(rank, world, flags, config_kw, global_batch, micro, device)
    mesh, scaler = run.mesh, DynamicLossScaler(enabled=False)
    sampler = BatchSampler(10_000, 16, global_batch, 0)
    if resume:
        loader = ckpt.Checkpointer(ckpt.CheckpointConfig(resume), mesh, run.axes, device, log=lambda *a: None)
        start = loader.resume("latest", run.layout, scaler, sampler, 0)
    tracer = CommTracer()
    for name, group in mesh.groups.items():
        if group is not None:
            tracer.name_group(group, name)
    run.tracer, losses = tracer, {}
    for step, (x, y) in enumerate(global_batches(STEPS, global_batch, 16)):
        if start <= step < stop:
            batches = [(*b, None) for b in rank_micro_batches(x, y, mesh.index("dp"), mesh.size("dp"), micro)]
            with tracer:
                losses[step] = train_step(run.layout, scaler, batches, mesh.group("dp_cp"), 0.05, run.autocast,
                                          device, model=run.model, schedule=run.schedule, axes=run.axes,
                                          data_size=run.settings.shape.dp).loss
    steps = len(losses)
    traced = {key: (r.calls / steps, r.payload_bytes / steps) for key, r in tracer.records.items()}
    seen = dict(traced=traced, predicted=dict(report.run.predicted_messages(run, steps)), held=run.layout.held_bytes(),
                persistent=run.layout.predicted_persistent(), facts=run.layout.facts())
    if save:
        saver = ckpt.Checkpointer(ckpt.CheckpointConfig(save), mesh, run.axes, device, log=lambda *a: None)
        saver.save(stop, run.layout, scaler, sampler)
        saver.close()
    infos = {p.shard_info.global_name: p.shard_info for p in run.model.parameters()}
    params = {name: (tensor, infos[name]) for name, tensor in run.layout.full_parameters().items()}
    return losses, params, seen


def _all_cases(rank, world, root):
    out = [_train(rank, world, *case) for case in CASES]
    for index, (saving, resuming) in enumerate(RESHARD):
        directory = os.path.join(root, str(index))
        _train(rank, world, *saving, stop=SAVE_AT, save=directory)
        out.append(_train(rank, world, *resuming, resume=directory))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every case on P=2 × D=2 (and the resharding pairs), one spawn: per case, every rank's _train result."""
    results = run_ranks(_all_cases, 4, str(tmp_path_factory.mktemp("zero_pp")), timeout=300)
    return [[rank_results[index] for rank_results in results] for index in range(len(CASES) + len(RESHARD))]


def test_zero2_and_zero3_under_every_schedule_follow_the_single_device_model(runs):
    for case, per_rank in zip(CASES, runs):
        _check(per_rank, *case)


def test_traced_messages_are_the_predicted_ones(runs):
    for case, per_rank in zip(CASES, runs):
        for rank, (_, _, seen) in enumerate(per_rank):
            traced, predicted = set(seen["traced"]), set(seen["predicted"])
            assert traced == predicted, (case, rank, traced ^ predicted)
            for key, (calls, payload) in seen["predicted"].items():
                assert seen["traced"][key] == pytest.approx((calls, payload), abs=1e-9), (case, rank, key)
            ops = {op for op, _ in seen["traced"]}
            assert {"reduce_scatter_single", "all_gather_single", "send"} <= ops, (case, ops)


def test_held_bytes_and_the_step_transient_are_the_predicted_ones(runs):
    for case, per_rank in zip(CASES, runs):
        for rank, (_, _, seen) in enumerate(per_rank):
            facts = seen["facts"]
            assert seen["held"] == seen["persistent"], (case, rank)
            assert facts.step_transient_measured == facts.step_transient_predicted > 0, (case, rank, facts)
            if facts.stage == 3:
                interleaved = "interleaved" in case[0]
                assert facts.peak_gathered_units == facts.gathered_bound == (2 if interleaved else 1), (case, rank)


def test_a_run_saved_under_a_pipeline_resumes_on_another_mesh(runs):
    for (_, resuming), per_rank in zip(RESHARD, runs[len(CASES):]):
        assert all(sorted(losses) == list(range(SAVE_AT, STEPS)) for losses, _, _ in per_rank)
        _check([(losses, params) for losses, params, _ in per_rank], *resuming)
