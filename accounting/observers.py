"""The accounting's observers: the clocks and counters an algorithm tells what it did, for the printouts.

Each algorithm file declares a protocol that does nothing by default (context_parallel.RingObserver,
pipeline.PipelineObserver, moe.RoutingObserver, fp8.QuantizationObserver); at start-up report.axes.observe
subscribes one of these in its place, so the loop a reader came for holds no timing or counting lines:
* WaitClock, told by the ring: wall time per pass and the part blocked in wait(), next to the same transfers
  timed alone; compute hid at least 1 − waited / alone of them (report/axes.py's cp section);
* ActionClock, told by the pipeline's interpreter: each step's wall time and the time of each action and p2p
  call; measured bubble = 1 − Σ busy / wall per rank (report/pipeline.py);
* RoutedLoad, told by every MoE layer: the slots routed to each expert and those dropped, and the rows
  S (sent) and R (received) each forward exchanged (the exact all-to-all prediction; report/axes.py's moe
  section); the experts each token chose, counted as sets and as consecutive layers' pairs of sets, and the rows
  and slots that stayed on their rank (experts/coupling.py's co-selection statistics, the moe section's end);
* SaturationCount, told by every FP8 or microscaling linear: per role the values cast and those the clamp
  cut, reported as 100·cut / cast percent (report/precision.py's scale table).
What is training is decided once, here or in the linear that tells: RoutedLoad counts (and the FP8 and
microscaling linears tell SaturationCount) only a training forward, in train mode with grad on and not a
recompute (activation checkpointing reruns a forward inside the backward, step.in_backward: counted again
it would count one step's routing or casts twice); WaitClock charges every training pass's time, the recompute
inside a backward included (it is time the step spends), and no forward under no_grad. Nothing here changes
what the trainer computes.

Accounting for this file (it is accounting): 1. it holds nothing of the model; 2. memory: a few host numbers
per layer or linear, a MoE layer's [N] routed loads and a linear's [3] cut counts on the device until read, its
tokens' set keys (8 bytes a token, ×2 for the next layer's pairs; folded to the distinct sets every 32 forwards),
ActionClock's last `keep` steps; 3. no messages; 4. no state (a resumed run starts its clocks and counters
afresh).
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist

from accounting import memory
from experts import coupling
from step import is_training_forward


# ----------------------------------------------------------------------------------------------------------
# 1. Measured overlap: how much of a pass was blocked in wait() (context_parallel's ring)
# ----------------------------------------------------------------------------------------------------------


@dataclass
class PassTime:
    """One phase's charged passes (one ring attention call, forward or backward, per layer and micro-batch)."""

    passes: int = 0
    seconds: float = 0.0  # wall time inside the passes
    waited: float = 0.0  # of which blocked in wait(): on a transfer, or on a peer that is not there yet
    cpu: float = 0.0  # process CPU time inside the passes (every thread, gloo's too): the work, however shared


class WaitClock:
    """Host time of an algorithm's passes per phase and the part blocked waiting on transfers, next to the same
    transfers timed alone: `compute hid at least 1 − waited / alone` of them (report/axes.py's cp section).

    It observes the ring (context_parallel.RingObserver, subscribed by report.run.observe_axes): the ring tells it
        begin(phase) ... end(phase)      around a pass, phase "forward" or "backward"
        begin("wait") ... end("wait")    around each block on its transfers (inside a pass, or not)
    and it decides which passes are training: a forward under no_grad (evaluation, sampling) is not charged;
    a backward always is, and so is the forward activation checkpointing recomputes inside it (grad on).
        clock.time_alone("forward", transfers)   the pass's transfers with no compute: alone[phase]

    Host time: on CUDA wait() only orders streams (use a profiler there). reset() forgets the passes.
    """

    def __init__(self):
        self.phases, self.alone, self.waited, self._open = {}, {}, 0.0, []

    def reset(self) -> None:
        self.phases = {}

    def begin(self, phase: str) -> None:
        charge = phase == "backward" or torch.is_grad_enabled()
        self._open.append((phase, charge, time.perf_counter(), time.process_time(), self.waited))

    def end(self, phase: str) -> None:
        opened, charge, start, cpu, waited = self._open.pop()
        while opened != phase:  # a begin whose pass an exception cut short (it told no end): forgotten
            opened, charge, start, cpu, waited = self._open.pop()
        if phase == "wait":
            self.waited += time.perf_counter() - start
        elif charge:
            stat = self.phases.setdefault(phase, PassTime())
            stat.passes, stat.seconds = stat.passes + 1, stat.seconds + time.perf_counter() - start
            stat.waited, stat.cpu = stat.waited + self.waited - waited, stat.cpu + time.process_time() - cpu

    def time_alone(self, phase: str, transfers, repeats: int = 5) -> float:
        """The median seconds of `transfers()` over `repeats` runs, kept as alone[phase]."""
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            transfers()
            seconds.append(time.perf_counter() - start)
        self.alone[phase] = sorted(seconds)[len(seconds) // 2]
        return self.alone[phase]


# ----------------------------------------------------------------------------------------------------------
# 2. Measured pipeline actions (what the simulated bubble predicts)
# ----------------------------------------------------------------------------------------------------------


class ActionClock:
    """Times one pipeline step's actions and p2p calls, for the measured bubble, the timeline and the trace
    (report/pipeline.py). It observes the interpreter (pipeline.PipelineObserver's protocol, subscribed
    by pipeline.Pipeline.observe): `with step(device)` around a step's actions, `with action(action)` around each
    action's compute, `with p2p(name, nbytes)` around each host p2p call.

    CPU: perf_counter. CUDA (cuda=None: the step's device says): an event recorded on the compute stream before
    and after each action, all read once at the step's end; a device-wide synchronize after each action would
    also wait on receives posted for later actions, charged as compute. p2p spans are host time (on CUDA: when
    the calls were issued).

    Kept: `timings`, recent steps as (wall s, busy s, {kind: [s]}, first step of the run?), and `events`, the
    last step's compute and p2p spans as dicts (seconds from that step's start).
    """

    def __init__(self, cuda: bool | None = None, keep: int = 64):
        self.cuda = cuda  # None: each step's device says
        self.on_cuda = bool(cuda)  # the last step's
        self.timings = deque(maxlen=keep)
        self.events = []

    @contextmanager
    def step(self, device):
        self.on_cuda = self.cuda if self.cuda is not None else torch.device(device).type == "cuda"
        self.origin, self.spans, self.p2p_events = time.perf_counter(), [], []  # spans: (action, mark, mark)
        self.first = self._mark()
        yield
        self._stop()

    def _host(self) -> float:
        return time.perf_counter() - self.origin

    def _mark(self):
        if not self.on_cuda:
            return self._host()
        event = torch.cuda.Event(enable_timing=True)
        event.record()  # on the current stream: the one the actions compute on
        return event

    @contextmanager
    def action(self, action):
        opened = self._mark()
        yield
        self.spans.append((action, opened, self._mark()))

    @contextmanager
    def p2p(self, name: str, nbytes: int | None = None):
        start = self._host()
        yield
        event = dict(cat="p2p", name=name, start=start, end=self._host())
        self.p2p_events.append(event if nbytes is None else dict(event, bytes=nbytes))

    def _stop(self) -> None:
        last = self._mark()
        if self.on_cuda:
            last.synchronize()  # this step's last event: every earlier one on the stream has completed
            seconds = lambda event: self.first.elapsed_time(event) / 1e3  # noqa: E731 (elapsed_time is in ms)
            last, self.spans = seconds(last), [(action, seconds(a), seconds(b)) for action, a, b in self.spans]
        busy = defaultdict(list)
        for action, start, end in self.spans:
            busy[action.kind].append(end - start)
        self.timings.append((last, sum(map(sum, busy.values())), dict(busy), not self.timings))
        self.events = self.p2p_events + [dict(cat="compute", name=str(action), kind=action.kind, mb=action.mb,
                                              chunk=action.chunk, start=start, end=end)
                                         for action, start, end in self.spans]


# ----------------------------------------------------------------------------------------------------------
# 3. Routed load: what the MoE layers' training forwards routed (moe.py)
# ----------------------------------------------------------------------------------------------------------


@dataclass
class Coupling:
    """RoutedLoad's co-selection counts being gathered: per layer id (and per (layer, next MoE layer)) the key tensors
    not yet folded and the folded (keys, tokens); the kept slots (a device tensor), and under EP the slots this rank's
    experts ran of its own tokens and the rows [to itself, in all] its exchanges sent (host ints)."""

    pending: dict = field(default_factory=dict)
    counted: dict = field(default_factory=dict)
    kept: object = None
    own_slots: int = 0
    rows: list = field(default_factory=lambda: [0, 0])


class CouplingCounts(NamedTuple):
    """A window's co-selection counts: {layer id: {set key: tokens}}, {(layer id, next layer id): {(key, next key):
    tokens}}, the kept slots, of them those this rank's own experts ran (EP), the rows it sent itself and in all."""

    sets: dict
    joint: dict
    kept: int
    own_slots: int
    own_rows: int
    rows: int


class RoutedLoad:
    """What the MoE layers' training forwards routed, for the load lines and the exact all-to-all prediction.
    It observes every layer (moe.RoutingObserver, subscribed by report.run.observe_axes through MoEAxis.observe) and
    decides which forwards are training: a layer in train mode with grad on, outside a backward (activation
    checkpointing's recompute runs inside one), so evaluation, sampling and recomputes are not counted.

    Per layer (by layer id): the slots routed to each expert (before capacity) and those dropped stay tensors on
    the device until `take_load` reads them in ONE `.tolist()`; the forwards and rows (S sent, R received) are
    host ints (the split sizes are on the host anyway) and are never forgotten (`rows`)."""

    def __init__(self):
        self.forwards, self.sent, self.received = 0, 0, 0  # of every training forward since the start
        self.loads, self.dropped, self.taken_forwards = {}, {}, {}  # {layer id: since the last take_load}
        self.last_load, self.off_group = None, [0, 0]  # the last take_load; router.off_group's sums
        self.coupling = Coupling()  # since the last take_coupling; `last_coupling` the last one taken
        self.last_coupling, self.previous = None, None  # previous: (layer id, set keys) of the last forward
        self.closed_coupling = None  # the window a log line closed (still on the device), read at the end

    def routed(self, layer, load: torch.Tensor, keep, sent: int, received: int) -> None:
        if not is_training_forward(layer.training):
            return  # evaluation, sampling (no grad, or eval mode), or a checkpointed block's recompute (in backward)
        self.forwards, self.sent, self.received = self.forwards + 1, self.sent + sent, self.received + received
        self.off_group = [total + new for total, new in zip(self.off_group, layer.off_group)]
        key = layer.layer_id
        self.loads[key] = load if key not in self.loads else self.loads[key] + load
        self.taken_forwards[key] = self.taken_forwards.get(key, 0) + 1
        dropped = 0 if keep is None else (~keep).sum()
        self.dropped[key] = self.dropped.get(key, 0) + dropped
        self.count_coupling(layer, load.sum() - dropped)

    def count_coupling(self, layer, kept) -> None:
        """The co-selection counts of one training forward (experts/coupling.py's statistics, `Coupling`): its
        tokens' sets (the layer's `chosen`), paired with the previous forward's when that was an earlier MoE layer
        of the same tokens (a micro-batch runs its layers in order; under an interleaved pipeline a chunk's first
        layer meets another micro-batch's last: the pair is miscounted there); under EP the rows and slots that
        stayed on this rank (the layer's `exchanged`). Keys fold on the device every 32 forwards (`coupling.fold`)."""
        c, chosen = self.coupling, getattr(layer, "chosen", None)
        c.kept = kept if c.kept is None else c.kept + kept
        if layer.exchanged is not None:
            own, ep = dist.get_rank(layer.ep_group), layer.ep_size
            c.rows = [c.rows[0] + layer.exchanged.sent[own], c.rows[1] + sum(layer.exchanged.sent)]
            c.own_slots += sum(layer.exchanged.chunks[own::ep])  # chunks: [local slot][source rank]
        if chosen is None or layer.n_experts > coupling.MAX_KEYED:
            return
        keys = coupling.set_keys(chosen)
        c.pending.setdefault(layer.layer_id, []).append(keys)
        if self.previous is not None and self.previous[0] < layer.layer_id and len(self.previous[1]) == len(keys):
            pair = (self.previous[0], layer.layer_id)
            c.pending.setdefault(pair, []).append(torch.stack([self.previous[1], keys], 1))
        self.previous = (layer.layer_id, keys)
        for name, keys in c.pending.items():
            if len(keys) >= 32:
                c.counted[name], c.pending[name] = coupling.fold(c.counted.get(name), keys), []

    def restart_coupling(self) -> None:
        """A log line's (report/axes.py's moe step lines): the co-selection window restarts without a device read
        (the line reads the device once, for the loads); the closed window stays on the device for the end."""
        if self.coupling.kept is not None:
            self.closed_coupling = self.coupling
        self.coupling, self.previous = Coupling(), None

    def take_coupling(self):
        """The co-selection counts of the current window, or of the last one a log line closed when the current saw
        no forward, on the host (`CouplingCounts`; None: nothing routed), read at the end; the counts restart."""
        c = self.coupling if self.coupling.kept is not None else self.closed_coupling
        if c is None:
            return self.last_coupling
        counted = {name: coupling.fold(c.counted.get(name), keys) if keys else c.counted[name]
                   for name, keys in c.pending.items()}
        sets = {name: coupling.histogram(v) for name, v in counted.items() if not isinstance(name, tuple)}
        joint = {name: coupling.histogram(v) for name, v in counted.items() if isinstance(name, tuple)}
        self.last_coupling = CouplingCounts(sets, joint, int(c.kept), c.own_slots, *c.rows)
        self.coupling, self.previous, self.closed_coupling = Coupling(), None, None
        return self.last_coupling

    def rows(self) -> tuple:
        """(forwards, Σ S, Σ R) of the training forwards since start-up (dispatch.all_to_all_messages'
        arguments)."""
        return self.forwards, self.sent, self.received

    def take_load(self, micro_batches: int):
        """({layer id: [N] routed per expert]}, dropped, steps) since the last take, read in ONE `.tolist()`
        (None: nothing routed); the forwards and rows stay counted. Each layer runs m times a step."""
        if not self.loads:
            return None
        ids = list(self.loads)
        stats = torch.stack([torch.cat([self.loads[i], (self.loads[i].new_zeros(()) + self.dropped[i]).view(1)])
                             for i in ids]).tolist()  # [layer][N routed per expert, dropped]
        steps = self.taken_forwards[ids[0]] // max(1, micro_batches)
        self.loads, self.dropped, self.taken_forwards = {}, {}, {}
        self.last_load = ({i: row[:-1] for i, row in zip(ids, stats)}, sum(row[-1] for row in stats), steps)
        return self.last_load


# ----------------------------------------------------------------------------------------------------------
# 4. Saturation: what the FP8 linears' clamps cut (fp8.py)
# ----------------------------------------------------------------------------------------------------------


class SaturationCount:
    """Per FP8 linear (by its global name) and role (input, weight, grad_output): the values its training casts
    quantised and those the clamp cut, since the last `take`. It observes every linear (fp8.QuantizationObserver,
    subscribed by report.run.observe_axes through Fp8Handle.observe); the cut counts stay int64 tensors on the device
    until `take` reads a linear's in one `.tolist()` (the scale table, report/axes.py's fp8 section)."""

    def __init__(self):
        self.values, self.saturated = {}, {}  # {linear name: [3] host ints}, {linear name: [3] int64 tensor}

    def quantized(self, linear, role: int, values: int, saturated) -> None:
        self.values.setdefault(linear.name, [0, 0, 0])[role] += values
        if saturated is not None:  # None: a recipe that cannot saturate (it scales from the amax now)
            self.saturated.setdefault(linear.name, saturated.new_zeros(3))[role] += saturated

    def take(self, name: str) -> list:
        """Per role, 100·cut / cast (percent) of linear `name` since the last take; its counts restart."""
        cut = self.saturated.pop(name).tolist() if name in self.saturated else [0, 0, 0]
        return [100 * c / max(1, n) for c, n in zip(cut, self.values.pop(name, [0, 0, 0]))]


# ----------------------------------------------------------------------------------------------------------
# 5. Saved activations: what the first training forward kept for backward (step.py, pipeline.py)
# ----------------------------------------------------------------------------------------------------------


class SavedByFirstForward:
    """The bytes autograd saved for backward in the first forward a schedule tells it of (memory.SavedActivations:
    saved_tensors_hooks, each storage once, parameters aside, the selective policy's cache watched), once; later
    forwards run unwatched. It observes a schedule (step.ForwardObserver's protocol, subscribed through
    `observe_forwards` when training starts, report.run.watch_saved_activations); `bytes` is None until then."""

    def __init__(self):
        self.bytes = None

    @contextmanager
    def forward(self, model):
        if self.bytes is not None:
            yield
            return
        with memory.SavedActivations.of(model) as saved:
            yield
        self.bytes = saved.bytes
