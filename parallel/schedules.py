"""Pipeline schedules as pure data: every schedule a per-rank list of actions, a simulator, the communication plan.

No torch and no processes here: `pipeline.PipelineSchedule` executes these plans (one loop over a rank's
`Step`s), and this file can be read, and checked, apart from it (tests/test_pipeline.py runs every plan
over a grid of shapes under gloo's and NCCL's completion rules).

A schedule is one list of `Action`s per pp rank, built by a pure function:
    F  forward of (micro-batch, chunk)          B  its backward
    I  B's input-gradient half, sent upstream   W  B's weight-gradient half, deferred (ZB-H1, Qi et al. 2023)
`gpipe`: all F, then all B. `1f1b`: warm-up of P−r−1 F, steady 1F1B, cool-down (PipeDream-Flush, as in
Megatron and picotron). `interleaved`: Megatron's interleaved 1F1B over groups of P micro-batches (a
remainder of m mod P joins the last group); rank r holds chunks r, r+P, ... of the v·P (Narayanan et al.
2021). `zb`: 1F1B with B split into I and W; rank r keeps r W's deferred and runs them at the end, where
1F1B idles. With `--pp-redundant` (resilience/redundancy.py, Bamboo) a fifth kind joins gpipe's and 1F1B's lists:
    R  the successor's forward of (micro-batch, chunk (r+1) mod P), run by rank r on its shadow of that stage
placed by `with_redundant_forwards` in the rank's idle time of the uniform-cost simulation where it fits (after
the rank's own F of that micro-batch, whose output is R's input; the last rank's R of chunk 0 reads only the
tokens), the rest after the rank's last action. R needs no message and sends none: the simulator times it and
the deadlock checks see it like any action.

The communication plan. An F sends its output to the next chunk's rank, a B/I its input gradient to the
previous one's. `communication_plan` has every rank post a receive as soon as, in a uniform-cost simulation
of all the lists, its sender has sent it (so the transfer overlaps compute; torch.distributed.pipelining
does the same); the sends an action produces go in ONE batch after the receives posted next (Megatron's
send/recv pairing). Every op is thus posted in the order of one global simulated clock: on each channel the
receives come in the order the sender sends (NCCL matches p2p by order, not tag), and two ranks can never
each sit in a send waiting for the other's later receive. Every work is waited (gloo completes a send only
once its receive is posted, and frees it only in wait()): a receive before the action that uses it; a send
at its release point, the first action after the rank has taken a message that the receiver posted with
or after the receive (in posting order; any left at the step's end). A release thus never waits on a
peer's progress, only on a transfer under way: every action starts when `simulate` starts it, whatever the
real costs (a release placed by the uniform costs held up a rank whose receiver ran behind). The price:
sent buffers alive per rank (`live_sends`) are those not yet shown received, up to the cool-down's, where
no later message comes back; an F's is its stashed output (no cast needed), a B/I's b·s·h·e of its own.

The closed forms the plans are checked against (pipeline.py's docstring, answers 2 and 3): `bubble_formula`,
`in_flight`, `p2p_counts`; `simulate` gives the bubble for any per-rank costs (`bubble_of`).
"""

from __future__ import annotations

import functools
from collections import defaultdict, deque
from typing import NamedTuple

# ---------------------------------------------------------------------------------------------------------
# The stage split
# ---------------------------------------------------------------------------------------------------------


def split_layers(n_layer: int, n_chunks: int) -> list:
    """Contiguous layer ranges of `n_chunks` chunks; sizes differ by at most one (earlier chunks get more)."""
    base, extra = divmod(n_layer, n_chunks)
    bounds = [0]
    for chunk in range(n_chunks):
        bounds.append(bounds[-1] + base + (chunk < extra))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def stage_layers(n_layer: int, P: int, v: int, chunk: int) -> range:
    """The layers of global chunk `chunk` (of v·P); it lives on pp rank chunk mod P."""
    return split_layers(n_layer, P * v)[chunk]


def rank_chunks(pp_rank: int, P: int, v: int) -> list:
    """The global chunks pp rank r holds: r, r+P, r+2P, ..."""
    return [pp_rank + k * P for k in range(v)]


# ---------------------------------------------------------------------------------------------------------
# The schedules: one list of actions per rank, built by pure functions
# ---------------------------------------------------------------------------------------------------------


class Action(NamedTuple):
    kind: str  # "F" forward, "B" backward, "I" input-gradient backward, "W" weight-gradient backward, "R" redundant
    mb: int  # micro-batch
    chunk: int  # global chunk index (= pp rank without interleaving)

    def __str__(self):
        return f"{self.kind}{self.mb}.{self.chunk}"


def gpipe(P: int, m: int, rank: int, v: int = 1) -> list:
    """All forwards, then all backwards (Huang et al. 2019): m micro-batches in flight."""
    return [Action("F", i, rank) for i in range(m)] + [Action("B", i, rank) for i in range(m)]


def one_f_one_b(P: int, m: int, rank: int, v: int = 1) -> list:
    """1F1B (PipeDream-Flush): as soon as a backward can run, alternate one forward with one backward."""
    warmup = min(P - rank - 1, m)
    actions = [Action("F", i, rank) for i in range(warmup)]  # warm-up: fill the pipeline
    for i in range(m - warmup):  # steady 1F1B: P−r micro-batches in flight at most
        actions += [Action("F", warmup + i, rank), Action("B", i, rank)]
    actions += [Action("B", i, rank) for i in range(m - warmup, m)]  # cool-down: drain it
    return actions


def microbatch_groups(m: int, P: int) -> list:
    """Interleaving runs micro-batches in groups of P through every chunk; a remainder joins the last group."""
    groups = [range(a, min(a + P, m)) for a in range(0, m, P)]
    if len(groups) > 1 and len(groups[-1]) < P:
        tail = groups.pop()
        groups[-1] = range(groups[-1].start, tail.stop)
    return groups


def interleaved_1f1b(P: int, m: int, rank: int, v: int = 2) -> list:
    """Megatron's interleaved 1F1B: rank r holds chunks r, r+P, ...; each group of micro-batches goes through
    the rank's chunks in order forward and in reverse order backward, in 1F1B after a longer warm-up."""
    groups = microbatch_groups(m, P)
    forwards = [Action("F", mb, k * P + rank) for g in groups for k in range(v) for mb in g]
    backwards = [Action("B", mb, k * P + rank) for g in groups for k in reversed(range(v)) for mb in g]
    total = v * m
    # A group's first backward needs its first micro-batch through all v·P chunks: (v−1)·|group| more
    # forwards here (the largest group, P + m mod P, so every group's fit), and two slots per stage
    # downstream (its forward there, its backward coming back).
    warmup = min(2 * (P - rank - 1) + (v - 1) * (P + m % P), total)
    actions = forwards[:warmup]  # warm-up
    for i in range(total - warmup):  # steady 1F1B
        actions += [forwards[warmup + i], backwards[i]]
    return actions + backwards[total - warmup:]  # cool-down


def zero_bubble_h1(P: int, m: int, rank: int, v: int = 1) -> list:
    """ZB-H1 (Qi et al. 2023): 1F1B with B split into I (input gradient, sent upstream at once) and W (weight
    gradient, deferred). Rank r keeps r W's deferred: its last I comes r slots before rank 0's, and those
    W's fill the tail where 1F1B idles. Bubble (P−1)(t_F+t_I−t_W) instead of (P−1)(t_F+t_B)."""
    warmup = min(P - rank - 1, m)
    actions = [Action("F", i, rank) for i in range(warmup)]  # warm-up, as 1F1B
    deferred = deque()

    def input_grad(i):
        actions.append(Action("I", i, rank))
        deferred.append(i)
        if len(deferred) > rank:
            actions.append(Action("W", deferred.popleft(), rank))

    for i in range(m - warmup):  # steady: F, I (and a W once r are deferred)
        actions.append(Action("F", warmup + i, rank))
        input_grad(i)
    for i in range(m - warmup, m):  # cool-down: I, W
        input_grad(i)
    return actions + [Action("W", i, rank) for i in deferred]  # the deferred W's fill the bubble


BUILDERS = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_1f1b, "zb": zero_bubble_h1}


def build_programs(schedule: str, P: int, m: int, v: int = 1, redundant: bool = False) -> list:
    """Every rank's action list (v applies to `interleaved` only); `redundant`: with Bamboo's R actions."""
    v = v if schedule == "interleaved" else 1
    programs = [BUILDERS[schedule](P, m, rank, v) for rank in range(P)]
    return with_redundant_forwards(programs) if redundant else programs


REDUNDANT_SCHEDULES = ("gpipe", "1f1b")  # v = 1, B whole: the stage a shadow mirrors is one chunk, one backward


def with_redundant_forwards(programs: list, costs=None) -> list:
    """Each rank r's list with R(mb, (r+1) mod P) for every micro-batch (v = 1: chunk = rank), placed in r's idle
    time of the simulation with `costs` (default uniform; R costs the successor's F): walking r's gaps (before
    its first action, between two, after its last up to the makespan) in time order, each gap takes the next
    R's in micro-batch order while they fit and their input exists (r's F of that micro-batch has ended; chunk
    0's R reads the tokens, any time). An R placed in a gap delays nothing (the next action waited for a
    message anyway); those that fit nowhere follow the rank's last action and lengthen the step."""
    P = len(programs)
    m = sum(a.kind == "F" for a in programs[0])
    costs = costs if isinstance(costs, (list, tuple)) else [costs or UNIFORM] * P
    timelines = simulate(programs, costs)
    makespan = max(end for timeline in timelines for _, _, end in timeline)
    out = []
    for rank, timeline in enumerate(timelines):
        shadowed, cost = (rank + 1) % P, costs[(rank + 1) % P]["F"]
        ready = {a.mb: (end if shadowed else 0.0) for a, _, end in timeline if a.kind == "F"}
        gaps = [(timeline[j - 1][2] if j else 0.0, start, j) for j, (_, start, _) in enumerate(timeline)]
        gaps.append((timeline[-1][2], makespan, len(timeline)))
        pending, placed = deque(range(m)), defaultdict(list)
        for begin, end, index in gaps:
            while pending and ready[pending[0]] <= begin and begin + cost <= end + 1e-9:
                placed[index].append(Action("R", pending.popleft(), shadowed))
                begin += cost
        placed[len(timeline)] += [Action("R", mb, shadowed) for mb in pending]  # after the last: the step grows
        actions = []
        for j, (action, _, _) in enumerate(timeline):
            actions += placed[j] + [action]
        out.append(actions + placed[len(timeline)])
    return out


# ---------------------------------------------------------------------------------------------------------
# Communication: which messages each action needs and sends, and the order of receives on each channel
# ---------------------------------------------------------------------------------------------------------


class Message(NamedTuple):
    kind: str  # "act": chunk's output, to chunk+1; "grad": gradient of chunk's input, to chunk−1
    mb: int
    chunk: int  # the sending chunk

    def src(self, P: int) -> int:
        return self.chunk % P

    def dst(self, P: int) -> int:
        return (self.chunk + (1 if self.kind == "act" else -1)) % P


def needs(action: Action, n_chunks: int) -> Message | None:
    if action.kind == "F" and action.chunk > 0:
        return Message("act", action.mb, action.chunk - 1)
    if action.kind in "BI" and action.chunk < n_chunks - 1:
        return Message("grad", action.mb, action.chunk + 1)
    return None


def produces(action: Action, n_chunks: int) -> Message | None:
    if action.kind == "F" and action.chunk < n_chunks - 1:
        return Message("act", action.mb, action.chunk)
    if action.kind in "BI" and action.chunk > 0:
        return Message("grad", action.mb, action.chunk)
    return None


class Step(NamedTuple):
    recvs: list  # Messages to post before the action, in the order their sender sends them
    action: Action
    send: Message | None  # posted right after the action (with the next step's receives)
    release: tuple = ()  # this rank's earlier sends to wait on before the action: their buffers are freed


def simulate(programs: list, costs, latency: float = 0.0) -> list:
    """Per rank [(action, start, end)]: every action starts once its rank is free and its input has arrived,
    `latency` seconds after it was sent (0: communication free). `costs`: {kind: seconds}, or one such dict
    per rank. Raises on a deadlock."""
    P = len(programs)
    n_chunks = max(a.chunk for program in programs for a in program) + 1
    costs = costs if isinstance(costs, (list, tuple)) else [costs] * P
    costs = [c if "R" in c or "F" not in c else {**c, "R": costs[(r + 1) % P]["F"]} for r, c in enumerate(costs)]
    sent_at, clock, nxt = {}, [0.0] * P, [0] * P
    out = [[] for _ in range(P)]
    progress = True
    while progress:
        progress = False
        for rank, program in enumerate(programs):
            while nxt[rank] < len(program):
                action = program[nxt[rank]]
                msg = needs(action, n_chunks)
                if msg is not None and msg not in sent_at:
                    break
                start = max(clock[rank], sent_at.get(msg, 0.0))
                clock[rank] = start + costs[rank][action.kind]
                out[rank].append((action, start, clock[rank]))
                if (sent := produces(action, n_chunks)) is not None:
                    sent_at[sent] = clock[rank] + latency  # when it arrives
                nxt[rank], progress = nxt[rank] + 1, True
    stuck = [(rank, str(program[nxt[rank]])) for rank, program in enumerate(programs) if nxt[rank] < len(program)]
    if stuck:
        raise RuntimeError(f"the schedule deadlocks: ranks wait at {stuck}")
    return out


UNIFORM = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0, "R": 1.0}  # backward = 2 forwards, split into I and W; R = F


def communication_plan(programs: list, n_chunks: int) -> list:
    """Per rank, [Step]: each action with the receives to post before it, the send after it and the sends to
    wait on before it. Memoized on the programs (a plan builds several stages of one schedule, each asking for
    it: seconds apiece at P = 64, m = 512); the lists are shared, read-only.

    A receive is posted before the first action that starts after its message was sent in the uniform-cost
    simulation (so its transfer overlaps compute, and it always precedes the action that needs it). Sends on
    a channel happen in order, so the receives are posted in the order the peer sends them; and a message
    posted early was sent, in the simulation, before anything this rank sends later: it cannot wait on it."""
    return list(_communication_plan(tuple(tuple(program) for program in programs), n_chunks))


@functools.lru_cache(maxsize=4)
def _communication_plan(programs: tuple, n_chunks: int) -> tuple:
    P = len(programs)
    timelines = simulate(programs, UNIFORM)
    channel = defaultdict(list)  # (src, dst) -> [(send time, message)] in send order
    for src, timeline in enumerate(timelines):
        for action, _, end in timeline:
            if (msg := produces(action, n_chunks)) is not None:
                channel[src, msg.dst(P)].append((end, msg))
    plan = []
    sources = defaultdict(list)  # dst -> the ranks sending to it, ascending (a neighbour or two, not all P)
    for src, dst in sorted(channel):
        sources[dst].append(src)
    for rank, timeline in enumerate(timelines):
        posted, steps = defaultdict(int), []
        for action, start, end in timeline:
            recvs = []
            for src in sources[rank]:
                queue = channel[src, rank]
                while posted[src] < len(queue) and queue[posted[src]][0] <= start:
                    recvs.append(queue[posted[src]][1])
                    posted[src] += 1
            steps.append(Step(recvs, action, produces(action, n_chunks)))
        plan.append(steps)
    batches = _batches(plan)  # once for all ranks (per rank, they made the plan O(P²·m))
    return tuple(_with_release_points(steps, plan, n_chunks, batches) for steps in plan)


def _batches(plan: list) -> tuple:
    """({message: index of the batch posting its receive}, {message: index of the batch posting its send})."""
    batch_of_recv, batch_of_send = {}, {}  # message -> index of the batch posting it (batch j precedes action j)
    for program in plan:
        for j, step in enumerate(program):
            batch_of_recv.update((msg, j) for msg in step.recvs)
            if step.send is not None:
                batch_of_send[step.send] = j + 1  # with the next action's receives (or alone at the end)
    return batch_of_recv, batch_of_send


def _with_release_points(steps: list, plan: list, n_chunks: int, batches: tuple) -> list:
    """The rank's steps with their release points: a send is waited (its buffer freed) at the first step whose
    action follows the arrival of a message its receiver sent after posting the receive. A batch posts its
    receives before its send, so batch k of the receiver holds that receive once the rank has taken a
    message posted in batch k or later. The wait then waits on no peer's progress, only on a transfer under
    way (gloo completes a send once its receive is posted); waited as soon as the plan's position shows the
    receive posted, a send stalled its rank whenever the receiver ran behind the uniform-cost simulation.
    Releases keep posting order (a wait never passes an earlier send) and come after the action the send
    was posted with (its transfer overlaps that one's compute); any left are waited at the step's end. Every
    such wait follows, in the rank's own list, a take that already implies it, so the waits add no
    dependency and no cycle to the receives', under gloo's and under NCCL's (in-order stream) rules."""
    P = len(plan)
    batch_of_recv, batch_of_send = batches
    known = defaultdict(lambda: -1)  # peer -> the latest of its batches a taken message shows posted
    unreleased, out = deque(), []
    for j, step in enumerate(steps):
        if (need := needs(step.action, n_chunks)) is not None:
            known[need.src(P)] = max(known[need.src(P)], batch_of_send[need])
        release = []
        while unreleased and batch_of_recv[unreleased[0]] <= known[unreleased[0].dst(P)]:
            release.append(unreleased.popleft())
        out.append(step._replace(release=tuple(release)))
        if j > 0 and steps[j - 1].send is not None:
            unreleased.append(steps[j - 1].send)  # posted at step j, released from step j + 1 on
    return out


def live_sends(steps: list) -> int:
    """Peak number of this rank's sent buffers alive at once: counted when a batch is posted (the new send
    included), a send dies at its release point, or at the step's end."""
    live = peak = 0
    for j, step in enumerate(steps):
        if j > 0 and steps[j - 1].send is not None:
            live += 1  # posted with this step's receives
        peak = max(peak, live)
        live -= len(step.release)
    last = 1 if steps and steps[-1].send is not None else 0  # posted after the last action
    return max(peak, live + last)


STATIONARY_GROUPS = 3  # from 3·P micro-batches on, live_sends repeats with period P in m (1f1b, interleaved, zb)


@functools.lru_cache(maxsize=256)
def live_sends_of(schedule: str, P: int, m: int, v: int = 1) -> tuple:
    """live_sends of each rank's communication plan. For m ≥ 3P (1f1b, zb, interleaved) that of 3P + m mod P
    micro-batches: the plan's steady groups repeat, and its warm-up and cool-down see the first and last groups
    only (interleaving's last group holds P + m mod P), so P = 64, m = 512 simulates 192 micro-batches, not 512;
    1f1b's in closed form; gpipe's grows with m: simulated whole (tests/planner/test_search.py checks each against
    the whole plan over a grid of (schedule, P, m, v))."""
    v = v if schedule == "interleaved" else 1
    if schedule == "1f1b":  # rank 0 holds up to P; a middle rank one more than its in flight when m = 1
        return tuple(min(P - r, m if r == 0 else max(m, 2)) for r in range(P))
    if schedule != "gpipe" and m >= STATIONARY_GROUPS * P:
        m = STATIONARY_GROUPS * P + m % P
    plan = communication_plan(build_programs(schedule, P, m, v), P * v)
    return tuple(live_sends(steps) for steps in plan)


def last_backwards(steps: list) -> set:
    """The actions after which a chunk's gradients are final: its last B, or its last I and last W."""
    last = {}
    for step in steps:
        if step.action.kind in "BIW":
            last[(step.action.chunk, step.action.kind)] = step.action
    return set(last.values())


# ---------------------------------------------------------------------------------------------------------
# The closed forms: bubble, activations in flight, messages per stage pair
# ---------------------------------------------------------------------------------------------------------

BUBBLE_TEXT = {"gpipe": "(P−1)/(m+P−1)", "1f1b": "(P−1)/(m+P−1)", "interleaved": "(P−1)/(v·m+P−1)",
               "zb": "(P−1)·max(F, F+I−W)/(m(F+I+W) + (P−1)·max(F, F+I−W))"}


def bubble_formula(schedule: str, P: int, m: int, v: int = 1, costs: tuple = (1.0, 1.0, 1.0)) -> float:
    """Idle fraction of a step by the closed forms (costs (t_F, t_I, t_W) for zb)."""
    if schedule in ("gpipe", "1f1b"):
        return (P - 1) / (m + P - 1)
    if schedule == "interleaved":
        return (P - 1) / (v * m + P - 1)
    t_f, t_i, t_w = costs
    idle = (P - 1) * max(t_f, t_f + t_i - t_w)
    return idle / (m * (t_f + t_i + t_w) + idle)


def bubble_of(timelines: list) -> list:
    """Each rank's idle fraction of the makespan."""
    makespan = max(end for timeline in timelines for _, _, end in timeline)
    return [1 - sum(end - start for _, start, end in timeline) / makespan for timeline in timelines]


def in_flight(program: list) -> tuple:
    """(peak micro-batch-chunks between F and B/I, peak stashes between I and W) of one rank's list."""
    live = stash = peak = peak_stash = 0
    for action in program:
        live += {"F": 1, "B": -1, "I": -1}.get(action.kind, 0)
        stash += {"I": 1, "W": -1}.get(action.kind, 0)
        peak, peak_stash = max(peak, live), max(peak_stash, stash)
    return peak, peak_stash


def in_flight_formula(schedule: str, P: int, m: int, rank: int, v: int = 1) -> int:
    """in_flight(rank's list)[0] without building it: the builders' warm-up forwards, plus the steady phase's one
    (each of its F's comes before its B or I); gpipe holds all m."""
    if schedule == "gpipe":
        return m
    if schedule == "interleaved":  # interleaved_1f1b's warm-up
        total, warmup = v * m, 2 * (P - rank - 1) + (v - 1) * (P + m % P)
    else:  # one_f_one_b's and zero_bubble_h1's
        total, warmup = m, P - rank - 1
    warmup = min(warmup, total)
    return warmup + (warmup < total)


def p2p_counts(programs: list, n_chunks: int) -> dict:
    """{(src pp rank, dst pp rank): messages per step}."""
    counts = defaultdict(int)
    for program in programs:
        for action in program:
            if (msg := produces(action, n_chunks)) is not None:
                counts[msg.src(len(programs)), msg.dst(len(programs))] += 1
    return dict(counts)
