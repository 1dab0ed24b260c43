"""resilience/elastic.py: two torchrun agents on this machine (`--nnodes 1:2`, c10d rendezvous on localhost), one node
each.

One run serves the launcher tests (a module-scoped fixture): agent A starts alone (world 1); agent B joins (A's
worker is paused meanwhile, so that the run is still going when B arrives), so A's agent restarts its worker and
both resume the newest checkpoint in world 2 (the world grows); then agent B
and its worker are SIGKILLed (a lost node), A's worker fails at its next all-reduce, A's agent restarts it, and
it resumes in world 1 again (the world shrinks) and finishes. The reference is the uninterrupted run in one
process. B_global = 4 and B_μ = 1 throughout: world 1 is D 1 × m 4, world 2 is D 2 × m 2.

The flag checks call flags.parse in this process, with torchrun's environment set as an agent would set it.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from cli import flags
from train import AXES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 40
RUN_FLAGS = ["--backend", "gloo", "--preset", "tiny", "--steps", str(STEPS), "--global-batch", "4", "--micro-batch",
             "1", "--seq-len", "32", "--dtype", "fp32", "--eval-every", "0", "--sample-tokens", "0", "--log-every", "1"]
ELASTIC_FLAGS = ["--elastic", "1:2", "--ckpt-every", "1", "--async-ckpt", "--resume", "latest"]
# float32 losses of worlds 1 and 2 differ by the order of their sums (D·m partial sums, one all-reduce), and the
# difference grows over the steps through AdamW; measured here: at most 9e-8 relative over the 40 steps. The
# test allows 1e-5 relative.
RTOL = 1e-5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (torchrun's workers run in sessions of their own)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except OSError:
                continue
    return found


def kill_agent(proc) -> None:
    """A lost node: the agent and its workers SIGKILLed at once."""
    workers = children(proc.pid)
    for pid in [proc.pid, *workers]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


def start_agent(run_dir: str, name: str, port: int, hosts_store: bool):
    """One torchrun agent (a node of one worker) of the elastic run; A hosts the rendezvous store, so B is the
    one that can be lost (the c10d store lives in the agent that hosts it)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
               LOGLEVEL="INFO")  # the agent logs the membership changes it sees
    # A lost node is dropped after 5 s without a heartbeat (with fewer, a loaded machine drops live ones).
    rdzv_conf = (f"join_timeout=600,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=5,"
                 f"is_host={int(hosts_store)}")
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "elastic-test",
               "--rdzv-conf", rdzv_conf, "--max-restarts", "2", "--monitor-interval", "0.2",
               os.path.join(ROOT, "train.py"), *RUN_FLAGS, *ELASTIC_FLAGS, "--data", os.path.join(run_dir, "..",
               "corpus.txt"), "--out-dir", run_dir, "--ckpt-dir", os.path.join(run_dir, "ck"),
               "--metrics-file", os.path.join(run_dir, "metrics.jsonl")]
    log = open(os.path.join(run_dir, f"{name}.log"), "w")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=run_dir,
                            start_new_session=True)


def metrics(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def logs(run_dir: str) -> str:
    return "".join(open(os.path.join(run_dir, f"{name}.log")).read() for name in ("A", "B")
                   if os.path.exists(os.path.join(run_dir, f"{name}.log")))


def wait_for(condition, what: str, agents, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline or agents[0].poll() is not None:
            raise AssertionError(f"waited for {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def elastic_run(tmp_path_factory):
    """The uninterrupted reference (one process) and the grown-then-shrunk two-agent run."""
    base = tmp_path_factory.mktemp("elastic")
    rng_text = "".join("abcdefgh ijklmnop\n"[(i * 7919) % 18] for i in range(50_000))
    (base / "corpus.txt").write_text(rng_text)
    reference_dir, run_dir = base / "reference", base / "run"
    reference_dir.mkdir()
    run_dir.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    reference = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *RUN_FLAGS, "--data",
                                  str(base / "corpus.txt"), "--out-dir", str(reference_dir), "--metrics-file",
                                  str(reference_dir / "metrics.jsonl")], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
    port, agents = free_port(), []
    try:
        agents.append(start_agent(str(run_dir), "A", port, hosts_store=True))
        wait_for(lambda: len(metrics(str(run_dir))) >= 3, "world 1's first steps", agents)
        # World 1 pauses (SIGSTOP) while B's agent starts, so that the run is still going when B joins: A's
        # agent then sees B waiting in the rendezvous and stops its worker (SIGTERM, delivered on SIGCONT).
        worker = children(agents[0].pid)[0]
        os.kill(worker, signal.SIGSTOP)
        agents.append(start_agent(str(run_dir), "B", port, hosts_store=False))
        wait_for(lambda: "new nodes from group_rank" in logs(str(run_dir)), "A's agent to see B", agents)
        os.kill(worker, signal.SIGCONT)
        wait_for(lambda: "elastic restart (grow)" in logs(str(run_dir)), "the world to grow", agents)
        grown_at = len(metrics(str(run_dir)))
        wait_for(lambda: len(metrics(str(run_dir))) >= grown_at + 3, "world 2's steps", agents)
        kill_agent(agents[1])
        assert agents[0].wait(timeout=300) == 0, logs(str(run_dir))[-3000:]
    finally:
        for agent in agents:
            if agent.poll() is None:
                kill_agent(agent)
    out, _ = reference.communicate(timeout=300)
    assert reference.returncode == 0, out[-3000:]
    expected = {r["step"]: r["loss"] for r in metrics(str(reference_dir))}
    return dict(records=metrics(str(run_dir)), log=logs(str(run_dir)), expected=expected)


def restarts(log: str) -> list[tuple[str, int]]:
    """(line, step) of each elastic restart line, in order. Besides the grow and the shrink there may be a
    "same size" one: when an agent rejoins the rendezvous later than its last-call wait (a loaded machine),
    the other closes a round alone and then restarts again for it."""
    lines = [line for line in log.splitlines() if line.startswith("elastic restart")]
    return [(line, int(line.split(" at step ")[1].split(":")[0])) for line in lines]


def check_losses(records: list[dict], expected: dict) -> None:
    for record in records:
        assert record["loss"] == pytest.approx(expected[record["step"]], rel=RTOL), record


@pytest.mark.slow
def test_a_joining_node_grows_the_world_and_the_losses_follow_the_uninterrupted_run(elastic_run):
    grow, grown_at = next((line, step) for line, step in restarts(elastic_run["log"]) if "(grow)" in line)
    assert grow.startswith(f"elastic restart (grow): world 1 → 2 at step {grown_at}: D 1 → 2, m 4 → 2"), grow
    records = elastic_run["records"]
    world_2 = [r for r in records if r["world"] == 2]
    assert len(world_2) >= 3 and world_2[0]["step"] == grown_at  # from the checkpoint world 1 wrote
    check_losses(records[:records.index(world_2[-1]) + 1], elastic_run["expected"])


@pytest.mark.slow
def test_a_lost_node_shrinks_the_world_and_the_run_finishes_on_the_survivor(elastic_run):
    shrink, shrunk_at = restarts(elastic_run["log"])[-1]
    assert shrink.startswith(f"elastic restart (shrink): world 2 → 1 at step {shrunk_at}: D 2 → 1, m 2 → 4")
    records = elastic_run["records"]
    last_of_world_2 = max(i for i, r in enumerate(records) if r["world"] == 2)
    survivor = records[last_of_world_2 + 1:]
    assert [(r["step"], r["world"]) for r in survivor] == [(s, 1) for s in range(shrunk_at, STEPS)]
    check_losses(survivor, elastic_run["expected"])


# ---------------------------------------------------------------------------------------------------------
# Bad input: one line naming --elastic, exit status 2, before any rank waits
# ---------------------------------------------------------------------------------------------------------


def parse_error(capsys, monkeypatch, tmp_path, extra, env) -> str:
    """flags.parse as a worker of `env`'s torchrun world; the one error line it ends with (exit status 2)."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    argv = ["--preset", "tiny", "--global-batch", "4", "--out-dir", str(tmp_path), "--ckpt-dir", str(tmp_path / "ck"),
            *extra]
    with pytest.raises(SystemExit) as exited:
        flags.parse(argv, AXES)
    assert exited.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


WORLD_2 = dict(RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="1")
GOOD = ["--elastic", "1:2", "--micro-batch", "1", "--async-ckpt", "--resume", "latest"]


@pytest.mark.parametrize("extra, env, expected", [
    # 3 nodes of 1: D = 3 does not divide B_global = 4 (the present world, 2, would)
    (["--elastic", "1:3", "--micro-batch", "1", "--async-ckpt", "--resume"], WORLD_2,
     "--elastic 1:3: on 3 nodes of 1 (world 3), --global-batch 4 is not divisible by D × --micro-batch = 3 × 1"),
    # --tp 2 on nodes of one rank: the world of one node cannot hold T = 2
    ([*GOOD, "--tp", "2"], WORLD_2, "--elastic 1:2: on 1 node of 1 (world 1), world size 1 is not divisible by --tp 2"),
    (["--elastic", "1:2", "--async-ckpt", "--resume"], WORLD_2,
     "--elastic 1:2 needs --micro-batch: B_μ stays fixed while the world changes and m grows (e.g. --micro-batch 2"),
    (["--elastic", "1:2", "--micro-batch", "1", "--resume"], WORLD_2, "--elastic 1:2 needs --async-ckpt"),
    (["--elastic", "1:2", "--micro-batch", "1", "--async-ckpt"], WORLD_2, "--elastic 1:2 needs --ckpt-dir and"
     " --resume latest"),
    (GOOD, dict(WORLD_2, TORCHELASTIC_USE_AGENT_STORE="True"),
     "--elastic 1:2 needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment"),
    (GOOD, dict(RANK="0", WORLD_SIZE="3", LOCAL_WORLD_SIZE="1"), "--elastic 1:2: this world of 3 ranks is not 1 to 2"),
    (["--elastic", "2:1", *GOOD[2:]], WORLD_2, "--elastic 2:1: need 1 <= MIN <= MAX nodes"),
    (["--elastic", "two", *GOOD[2:]], WORLD_2, "--elastic must be MIN:MAX node counts"),
    (["--elastic", "1:²", *GOOD[2:]], WORLD_2, "--elastic must be MIN:MAX node counts"),  # a digit, not ASCII's
    # a huge MAX: the first world that fails is found at once (B_global bounds D), not after a loop over MAX
    (["--elastic", f"1:{10**15}", *GOOD[2:]], WORLD_2, "--elastic 1:1000000000000000: on 3 nodes of 1 (world 3),"
     " --global-batch 4 is not divisible"),
    # DiLoCo's R = 2 replicas must divide D in every world: one node holds D = 1
    ([*GOOD, "--diloco-h", "2", "--diloco-replicas", "2", "--steps", "10"], WORLD_2,
     "--elastic 1:2: on 1 node of 1 (world 1), --diloco-replicas 2 must be a positive divisor"),
])
def test_an_elastic_range_the_layout_cannot_hold_is_one_line_and_exit_2(capsys, monkeypatch, tmp_path, extra, env,
                                                                        expected):
    line = parse_error(capsys, monkeypatch, tmp_path, extra, env)
    assert line.startswith(f"error: {expected}"), line


def test_a_range_the_layout_holds_passes_and_keeps_b_global(monkeypatch, tmp_path):
    """The good range of the launcher test: both worlds hold D·m·B_μ = 4 (1·4·1 and 2·2·1)."""
    from resilience import elastic

    args = flags.build_parser().parse_args(["--preset", "tiny", "--global-batch", "4", "--ckpt-dir", str(tmp_path),
                                            *GOOD])
    checked = elastic.check_flags(args, 2, environ=dict(LOCAL_WORLD_SIZE="1"))
    assert checked.worlds() == [1, 2]
    for world, m in ((1, 4), (2, 2)):
        settings = flags.validate(args, world, axes=AXES)
        assert (settings.shape.dp, settings.micro_batches, settings.micro_batch_size) == (world, m, 1)
