"""resilience/redundancy.py: the shadow stage, its update, the lazy backward, the takeover's plan, the live takeover.

In-process (the quick suite): P = 2 and P = 3 pure pipelines with --pp-redundant, composed as train.py composes
them, trained in float64 on tests/reference.py's batches: the update equals the single device's (1e-10), every
shadow holds its successor's weights and Adam moments exactly, the traced messages equal the predicted ones, and
the lazy backward through the kept R graphs gives the successor's own gradients. The live takeover (slow): P = 3
train.py workers spawned as a launcher would (no agent that stops the survivors), one SIGKILLed mid-run; the run
continues on 2 stages without reading a checkpoint, and its losses follow the uninterrupted run's.
"""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from cli import flags
from harness import assert_runs_follow, run_ranks
from reference import global_batches, reference_run
from resilience import redundancy
from test_composition import STEPS, SEQ, CLIP, TOL, _config, _parse, _run_case
from train import AXES

CASES = {2: (["--pp", "2", "--pp-redundant"], dict(n_layer=2), 4, 1),  # m = 4 = 2P: some R after the last action
         3: (["--pp", "3", "--pp-redundant", "--pp-schedule", "gpipe"], dict(n_layer=3), 3, 1)}  # m = P


def _redundant(rank, world):
    """The run of CASES[world] (losses, params, traced and predicted messages); each shadow's state and its
    stage's own (by global name); the lazy backward's gradients of one more forward_backward."""
    import train
    from reference import rank_micro_batches
    from step import count_global_tokens

    flags_, config_kw, global_batch, micro = CASES[world]
    run = None

    def capture(r):
        nonlocal run
        run = r
        return r

    original = train.compose
    train.compose = lambda r, **kw: capture(original(r, **kw))
    try:
        losses, params, messages = _run_case(rank, world, flags_, config_kw, global_batch, micro, trace=True)
    finally:
        train.compose = original
    handle = next(axis for axis in run.axes if axis.name == "redundancy")
    shadow = {p.key: p.tensor.clone() for p in handle.state_pieces()}
    own = {p.key: p.tensor.clone() for p in run.layout.state_pieces()}
    # One more step's forward_backward (no update), then the shadow's lazy backward from the kept graphs: the
    # last stage's needs no output gradient, so its shadow's gradients are that stage's own (D = 1: unreduced).
    x, y = global_batches(STEPS + 1, global_batch, SEQ)[-1]
    batches = [(*b, None) for b in rank_micro_batches(x, y, 0, 1, micro)]
    tokens = count_global_tokens(batches, run.mesh.group("dp_cp"), run.device)
    run.layout.zero_grad()
    with run.layout.no_sync():
        run.schedule.forward_backward(run.layout, run.model, batches, tokens, 1.0, len(batches), run.autocast,
                                      run.device)
    lazy = None
    if handle.shadow.last:
        handle.shadow.grad.zero_()
        handle.shadow.lazy_backward({})
        lazy = {p.shard_info.global_name: p.grad.clone() for p in handle.shadow.params}
    grads = {p.shard_info.global_name: p.grad.clone() for p in run.model.parameters()}
    return losses, params, messages, shadow, own, lazy, grads


@pytest.mark.parametrize("world", [2, 3])
def test_redundant_pipeline_matches_single_device_and_its_shadows_mirror_their_successors(world):
    results = run_ranks(_redundant, world, timeout=240)
    flags_, config_kw, global_batch, micro = CASES[world]
    args = _parse(flags_, global_batch, micro)
    ref_losses, ref_norms, ref_params = reference_run(_config(args, config_kw), global_batches(STEPS, global_batch,
                                                                                                SEQ),
                                                      clip=CLIP, micro_batches=global_batch // micro)
    assert min(ref_norms) > CLIP  # clipping is active: the shadow must apply the stage's coefficient
    assert_runs_follow([r[:2] for r in results], ref_losses, ref_params, TOL)
    for rank, (_, _, (traced, predicted), shadow, _, lazy, _) in enumerate(results):
        successor = results[(rank + 1) % world]
        # exactly the successor's weights and moments (the same arithmetic on the same inputs)
        assert shadow.keys() <= successor[4].keys() and shadow
        for key, tensor in shadow.items():
            assert torch.equal(tensor, successor[4][key]), (rank, key)
        assert set(traced) == set(predicted), (rank, set(traced) ^ set(predicted))
        for key, (calls, payload) in predicted.items():
            assert traced[key] == pytest.approx((calls, payload), abs=1e-9), (rank, key)
        if lazy is not None:  # the lazy backward of the last stage: its own gradients, from the kept graphs
            for name, grad in lazy.items():
                torch.testing.assert_close(grad, successor[6][name], rtol=1e-12, atol=1e-15, msg=name)
    assert sum(r[5] is not None for r in results) == 1  # one rank shadows the last stage


def test_takeover_plan_joins_the_lost_stage_to_its_predecessor():
    plan = redundancy.takeover_plan(4, 2, (0, 1, 2, 3, 4))
    assert (plan.P, plan.taker, plan.bounds, plan.new_rank) == (3, 1, (0, 1, 3, 4), {0: 0, 1: 1, 3: 2})
    last = redundancy.takeover_plan(2, 1, (0, 3, 6))
    assert (last.P, last.bounds, last.new_rank) == (1, (0, 6), {0: 0})
    with pytest.raises(redundancy.TakeoverError, match="stage 0"):
        redundancy.takeover_plan(3, 0, (0, 1, 2, 3))


@pytest.mark.parametrize("argv,words", [
    (["--pp", "1", "--pp-redundant"], "--pp-redundant needs --pp P >= 2"),
    (["--pp", "2", "--pp-redundant", "--pp-schedule", "zb"], "--pp-redundant serves --pp-schedule gpipe or 1f1b"),
    (["--pp", "2", "--pp-redundant", "--pp-schedule", "interleaved", "--n-layer", "4"], "not interleaved"),
    (["--pp", "2", "--pp-redundant", "--zero", "1"], "--pp-redundant does not serve --zero"),
    (["--pp", "2", "--pp-redundant", "--dropout", "0.1"], "--dropout > 0"),
])
def test_bad_redundancy_flags_are_one_line(argv, words):
    args = flags.build_parser().parse_args(["--preset", "tiny", "--global-batch", "4", "--micro-batch", "1",
                                            *argv])
    with pytest.raises(flags.FlagError, match=words.replace("(", r"\(").replace(">", ">")) as error:
        flags.validate(args, 2, axes=AXES)
    assert "\n" not in str(error.value)


def test_a_pipeline_with_data_parallel_replicas_is_refused():
    args = flags.build_parser().parse_args(["--preset", "tiny", "--global-batch", "8", "--micro-batch", "1",
                                            "--pp", "2", "--pp-redundant"])
    with pytest.raises(flags.FlagError, match="pure pipeline"):
        flags.validate(args, 4, axes=AXES)


# ---------------------------------------------------------------------------------------------------------
# The live takeover: P = 3 workers of train.py, spawned as a launcher would, one (or two) SIGKILLed
# ---------------------------------------------------------------------------------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIVE_STEPS = 24
LIVE_FLAGS = ["--backend", "gloo", "--preset", "tiny", "--n-layer", "3", "--pp", "3", "--pp-redundant", "--steps",
              str(LIVE_STEPS), "--global-batch", "6", "--micro-batch", "1", "--seq-len", "32", "--dtype", "fp32",
              "--eval-every", "0", "--sample-tokens", "0", "--log-every", "1", "--peak-tflops", "1"]


def launch_workers(run_dir: str, corpus: str, extra=(), env=None, world: int = 3) -> list:
    """`world` train.py processes with the environment torchrun gives its workers, and no agent: nobody stops the
    survivors when one dies (resilience/redundancy.py, the takeover)."""
    os.makedirs(run_dir, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        worker_env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                          OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
        log = open(os.path.join(run_dir, f"rank{rank}.log"), "a")
        procs.append(subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *LIVE_FLAGS, "--data", corpus,
                                       "--out-dir", run_dir, "--metrics-file", os.path.join(run_dir, "metrics.jsonl"),
                                       *extra], stdout=log, stderr=subprocess.STDOUT, env=worker_env, cwd=run_dir))
    return procs


def losses_of(run_dir: str) -> dict:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return {}
    out = {}
    for line in open(path):
        if line.strip():
            record = json.loads(line)
            out[record["step"]] = (record["loss"], record["world"])
    return out


def wait_until(condition, procs, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline or all(p.poll() is not None for p in procs):
            raise AssertionError("the condition never held")
        time.sleep(0.02)


def finish(procs, timeout: float = 600) -> list:
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append("hung")
    return codes


def logs(run_dir: str) -> str:
    return "".join(open(os.path.join(run_dir, name)).read() for name in sorted(os.listdir(run_dir))
                   if name.startswith("rank") and name.endswith(".log"))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("redundancy")
    corpus = str(root / "corpus.txt")
    rng = random.Random(0)
    with open(corpus, "w") as f:
        f.write("".join(rng.choice("abcdefgh ijklmnop\n") for _ in range(50_000)))
    procs = launch_workers(str(root / "uninterrupted"), corpus)
    assert finish(procs) == [0, 0, 0], logs(str(root / "uninterrupted"))
    return root, corpus, losses_of(str(root / "uninterrupted"))


@pytest.mark.slow
def test_a_killed_stage_is_taken_over_without_a_checkpoint_and_the_losses_follow(uninterrupted):
    """Stage 2 SIGKILLed after 8 steps: stage 1 takes it over from its shadow, the run ends on 2 stages, no
    checkpoint exists to read, and every loss equals the uninterrupted run's (fp32; measured: bitwise)."""
    root, corpus, reference = uninterrupted
    run_dir = str(root / "killed")
    procs = launch_workers(run_dir, corpus)
    wait_until(lambda: len(losses_of(run_dir)) >= 8, procs)
    procs[2].send_signal(signal.SIGKILL)
    codes = finish(procs)
    text = logs(run_dir)
    assert codes[:2] == [0, 0] and codes[2] == -signal.SIGKILL, text[-3000:]
    assert "takeover: stage 2 lost at step" in text and "stage 1 took it over from its shadow" in text, text[-3000:]
    losses = losses_of(run_dir)
    assert sorted(losses) == list(range(LIVE_STEPS)) and losses[LIVE_STEPS - 1][1] == 2
    for step, (loss, _) in losses.items():
        assert loss == pytest.approx(reference[step][0], rel=1e-6), step


@pytest.mark.slow
def test_a_second_loss_during_the_takeover_keeps_the_newest_checkpoint(uninterrupted):
    """Stage 1 SIGKILLed, then stage 2 while the survivors meet: the last survivor ends in one line naming the
    newest committed checkpoint, which a fresh launch resumes to the uninterrupted run's losses; and stage 0's
    loss, which this takeover does not serve, ends the same way."""
    root, corpus, reference = uninterrupted
    run_dir = str(root / "twice")
    flags_ = ["--ckpt-dir", os.path.join(run_dir, "ck"), "--ckpt-every", "3", "--async-ckpt"]
    procs = launch_workers(run_dir, corpus, flags_, env={redundancy.TIMEOUT_ENV: "10"})
    wait_until(lambda: len(losses_of(run_dir)) >= 8, procs)
    procs[1].send_signal(signal.SIGKILL)
    meeting = os.path.join(run_dir, "takeover")
    wait_until(lambda: any(n.startswith("alive-") for _, _, names in os.walk(meeting) for n in names), procs)
    procs[2].send_signal(signal.SIGKILL)
    codes, text = finish(procs), logs(run_dir)
    assert codes[0] == 1 and "error: takeover impossible" in text, text[-3000:]
    named = int(text.split("the newest committed checkpoint is step ")[1].split()[0])
    assert named >= 6 and named % 3 == 0
    procs = launch_workers(run_dir, corpus, [*flags_, "--resume", "latest"])  # appends to the metrics file
    assert finish(procs) == [0, 0, 0], logs(run_dir)[-3000:]
    assert "ckpt: resumed from" in logs(run_dir) and f"at step {named} " in logs(run_dir)
    for step, (loss, _) in losses_of(run_dir).items():
        assert loss == pytest.approx(reference[step][0], rel=1e-6), step
    first = str(root / "first")
    procs = launch_workers(first, corpus)
    wait_until(lambda: len(losses_of(first)) >= 4, procs)
    procs[0].send_signal(signal.SIGKILL)
    codes, text = finish(procs), logs(first)
    assert codes[1:] == [1, 1] and "stage 0 was lost" in text, text[-3000:]
