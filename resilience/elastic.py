"""Elastic membership: a run that keeps its global batch when torchrun's world shrinks or grows.

    torchrun --nnodes 1:2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:PORT --max-restarts 3 \\
        train.py --elastic 1:2 --micro-batch 1 --global-batch 4 --ckpt-dir ck --ckpt-every 1 --async-ckpt --resume

The launcher does the membership: when a node is lost, its peers' next collective fails, their agents restart
them, and the c10d rendezvous admits whoever is still alive (at least MIN nodes, after its last-call wait);
when a node joins, the running agents see it waiting and restart their workers into the larger world
(torch's SimpleElasticAgent._invoke_run). Either way every worker starts again from the top of train.py with
the new WORLD_SIZE. The trainer's part is this file, and it is the coverage-equivalent contract of a resume
on another mesh (DESIGN.md, Checkpoints):

1. The layout is stated by the flags, not by the world: T, P, C and E are fixed, D = world / (T·P·C) is
   inferred, B_μ (--micro-batch) is fixed, and m = B_global / (D·B_μ) follows. B_global is kept: the batch of
   step s depends only on (seed, s, B_global) (data.py), so every world trains on the same global batches and
   the losses equal the uninterrupted run's to float tolerance (the sums run in another order). A fixed B_μ
   keeps a rank's activation memory the same in every world: a smaller world accumulates more micro-batches.
2. `check_flags`, before any rank waits (flags.validate): every world the range allows, n·L ranks for n in
   MIN..MAX nodes of L = LOCAL_WORLD_SIZE ranks, must hold the layout (T·P·C divides it, E divides D·C) and the
   batch (D·B_μ divides B_global); the present world must be one of them. Otherwise one line naming --elastic
   and the world that fails: a range that breaks only after a node is lost is refused at the first start.
3. The restarted workers resume the newest checkpoint (--resume latest, resharded onto the new mesh by
   ckpt.py), and `restart_line` says it: the world the checkpoint was written by, this one, the step, D and m.

Two launcher facts this file enforces, measured with torch 2.13 on one machine (two agents on localhost):
- the restart must not reuse torchrun's shared TCP store (TORCHELASTIC_USE_AGENT_STORE=True, the default):
  it outlives the attempt, so the restarted workers meet the previous attempt's keys, and after a membership
  change an agent that was rank 0 before keeps pointing its workers at its own old store; they wait forever
  in init_process_group. `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` in the agents' environment gives every attempt
  a fresh store on its rank 0;
- a lost peer must end the survivors' attempt at once. Their next collective fails as soon as the peer's
  process is gone (gloo: "Connection closed by peer"), but a synchronous save waits for the lost rank's shard
  in the commit's file rendezvous (ckpt.py, 600 s) first; --async-ckpt leaves that wait to the background
  thread, so the loss surfaces at the next step's all-reduce.

A worker ends with its launcher (`stop_with_the_launcher`): torchrun's agent starts its workers in process groups
of their own, so a SIGKILL to the launcher's group would leave them training as orphans.

Accounting for this file: nothing is held or sent; it reads torchrun's environment and the resumed
checkpoint's manifest (the world that wrote it), and watches the worker's parent (one daemon thread).
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from dataclasses import dataclass

from mesh import MeshShape, infer_mesh_shape
from resilience.ckpt_files import MANIFEST, step_dir_name

SHARED_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"  # set by torchrun's agent: "True" while its store is shared
OPT_OUT_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"  # torchrun's opt-out of that sharing (dynamic_rendezvous.py)


def add_arguments(group) -> None:
    """--elastic, in cli/flags.py's checkpoint group (an elastic run is a run that resumes itself)."""
    group.add_argument("--elastic", metavar="MIN:MAX", help="torchrun's --nnodes MIN:MAX: every world of MIN to MAX"
                       " nodes must hold the layout and the batch (checked at start); a restarted world resumes"
                       " the newest checkpoint with B_global and B_μ kept (resilience/elastic.py; default: a fixed"
                       " world)")


@dataclass(frozen=True)
class ElasticRange:
    """--elastic MIN:MAX in nodes of `ranks_per_node` ranks (torchrun's LOCAL_WORLD_SIZE), validated."""

    min_nodes: int
    max_nodes: int
    ranks_per_node: int

    def worlds(self) -> list[int]:
        return [n * self.ranks_per_node for n in range(self.min_nodes, self.max_nodes + 1)]


def parse_range(text: str) -> tuple[int, int]:
    """'MIN:MAX' (or 'N', a fixed size) → (MIN, MAX), 1 ≤ MIN ≤ MAX, as torchrun's --nnodes reads it."""
    parts = text.split(":")
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2 or not all(re.fullmatch(r"[0-9]+", p.strip()) for p in parts):  # ASCII digits: not "²"
        raise ValueError(f"--elastic must be MIN:MAX node counts (torchrun's --nnodes), got {text!r}")
    low, high = (int(p) for p in parts)
    if not 1 <= low <= high:
        raise ValueError(f"--elastic {text}: need 1 <= MIN <= MAX nodes")
    return low, high


def check_flags(args, world_size: int, environ=os.environ) -> ElasticRange | None:
    """The elastic range against the layout and the batch, for every world it allows (see the docstring, 2);
    None without --elastic. Raises ValueError naming --elastic (flags.validate makes it the one error line)."""
    if args.elastic is None:
        return None
    low, high = parse_range(args.elastic)
    flag = f"--elastic {args.elastic}"
    if args.ckpt_dir is None or args.resume != "latest":
        raise ValueError(f"{flag} needs --ckpt-dir and --resume latest: a restarted world continues from the"
                         f" newest checkpoint")
    if not args.async_ckpt:
        raise ValueError(f"{flag} needs --async-ckpt: a synchronous save waits up to 600 s for a lost node's shard"
                         f" (the commit's file rendezvous); an asynchronous one leaves the loss to the next"
                         f" step's collective, which fails at once and restarts the world")
    if environ.get(SHARED_STORE_ENV) == "True":
        raise ValueError(f"{flag} needs {OPT_OUT_ENV}=1 in torchrun's environment: its shared store outlives a"
                         f" restart, and the restarted workers would wait forever in init_process_group")
    per_node = int(environ.get("LOCAL_WORLD_SIZE", "1"))
    nodes, rest = divmod(world_size, per_node)
    if rest or not low <= nodes <= high:
        raise ValueError(f"{flag}: this world of {world_size} ranks is not {low} to {high} nodes of"
                         f" {per_node} (LOCAL_WORLD_SIZE); launch torchrun with --nnodes {args.elastic}")
    if args.micro_batch is None:
        largest = (high * per_node) // (args.tp * args.pp * args.cp)
        raise ValueError(f"{flag} needs --micro-batch: B_μ stays fixed while the world changes and m grows (e.g."
                         f" --micro-batch {max(1, args.global_batch // max(1, largest))}: one micro-batch at MAX"
                         f" nodes)")
    # Every world n·L of the range, in one pass that stops at the first that fails. It is short whatever MAX is:
    # D·B_μ must divide B_global, and D grows with n, so no world beyond n·L/(T·P·C)·B_μ > B_global passes.
    replicas = (args.diloco_replicas or 1) if args.diloco_h is not None else None
    for n in range(low, high + 1):
        try:
            shape = infer_mesh_shape(n * per_node, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep,
                                     replicas=replicas)
        except ValueError as e:
            raise ValueError(f"{_where(flag, n, per_node)}, {e}") from None
        if args.global_batch % (shape.dp * args.micro_batch):
            raise ValueError(f"{_where(flag, n, per_node)}, --global-batch {args.global_batch} is not divisible by"
                             f" D × --micro-batch = {shape.dp} × {args.micro_batch}: B_global is kept in every"
                             f" world of the range")
    return ElasticRange(low, high, per_node)


def _where(flag: str, nodes: int, per_node: int) -> str:
    return f"{flag}: on {nodes} node{'s' if nodes > 1 else ''} of {per_node} (world {nodes * per_node})"


def saved_mesh(ckpt_root: str, step: int) -> dict:
    """The mesh record (world_size, dp, pp, cp, tp, ep) of the checkpoint of `step`: the world that wrote it."""
    with open(os.path.join(ckpt_root, step_dir_name(step), MANIFEST)) as f:
        return json.load(f)["mesh"]


def restart_line(saved: dict, shape: MeshShape, step: int, global_batch: int, micro_batch: int) -> str:
    """What a resumed elastic run says: the world the checkpoint was written by and this one, at which step,
    and the batch arithmetic on both (B_global and B_μ kept, D and m changed)."""
    before, after = saved["world_size"], shape.world_size
    kind = "shrink" if after < before else "grow" if after > before else "same size"
    m_before = global_batch // (saved["dp"] * micro_batch)
    m_after = global_batch // (shape.dp * micro_batch)
    return (f"elastic restart ({kind}): world {before} → {after} at step {step}: D {saved['dp']} → {shape.dp},"
            f" m {m_before} → {m_after}; B_global"
            f" {global_batch} = D·m·B_μ kept with B_μ {micro_batch}: the same global batches from step {step} on")


LAUNCHER_ENV = "TORCHELASTIC_RUN_ID"  # set by torchrun's agent in every worker it starts


def stop_with_the_launcher(poll_s: float = 0.5, grace_s: float = 20.0) -> None:
    """End this worker when the torchrun agent that started it is gone. The agent starts its workers in process
    groups of their own (setsid), so a SIGKILL to the launcher's process group (or to the agent) does not reach
    them: they would train on as orphans, writing checkpoints. A daemon thread watches the parent; once the
    worker has been reparented it sends itself SIGTERM, which ends the run as Ctrl-C does
    (`ending_cleanly_on_signals`: one line, a background save abandoned, never half-committed: a checkpoint is
    committed by a rename); if the process still lives `grace_s` later (blocked where no signal is seen), it
    exits. Every worker does it, so the peers it would wait on stop too."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(128 + signal.SIGTERM)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()
