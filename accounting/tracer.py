"""The communication tracer: what every torch.distributed call moves, counted by (phase, collective, group).

The accounting's measured half of communication: mfu.py predicts the bytes (its section 4 formulas, ring
algorithms, M = message bytes, N = group size), this file counts them as the calls happen. It talks over
nothing; it wraps the `torch.distributed` functions while a `with CommTracer()` block is active and
forwards every call unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from mfu import format_bytes, wire_bytes


@dataclass
class CommStat:
    calls: int = 0
    payload_bytes: int = 0  # sum of message sizes M (as defined in mfu.py, section 4)
    wire_bytes: float = 0.0  # sum of bytes this rank sent, by mfu.py's section 4 formulas
    seconds: float = 0.0  # host time in the call (+ in wait() for async calls)


def _add(into: CommStat, stat: CommStat) -> None:
    into.calls += stat.calls
    into.payload_bytes += stat.payload_bytes
    into.wire_bytes += stat.wire_bytes
    into.seconds += stat.seconds


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _tensors_bytes(ts) -> int:
    return sum(_tensor_bytes(t) for t in ts)


# For each traced function: the argument that holds the message M, and how to size it. The argument names are
# torch.distributed's own, so a call is bound to the real signature and positional/keyword use both work.
_MESSAGE_ARG = {
    "all_reduce": ("tensor", _tensor_bytes),
    "all_gather_into_tensor": ("output_tensor", _tensor_bytes),  # M = the gathered (full) output
    "reduce_scatter_tensor": ("input", _tensor_bytes),  # M = the full input
    "all_to_all_single": ("input", _tensor_bytes),
    # Newer torch names for the two above (torch 2.13 deprecates the *_tensor spellings in their favour).
    "all_gather_single": ("output_tensor", _tensor_bytes),
    "reduce_scatter_single": ("input", _tensor_bytes),
    "all_gather": ("tensor_list", _tensors_bytes),  # M = all the outputs together
    "reduce_scatter": ("input_list", _tensors_bytes),  # M = all the inputs together
    "broadcast": ("tensor", _tensor_bytes),
    "send": ("tensor", _tensor_bytes),
    "recv": ("tensor", _tensor_bytes),
    "isend": ("tensor", _tensor_bytes),
    "irecv": ("tensor", _tensor_bytes),
    "gather": ("tensor", _tensor_bytes),  # M = one rank's piece (this rank's input)
    "scatter": ("tensor", _tensor_bytes),  # M = one rank's piece (this rank's output)
    "reduce": ("tensor", _tensor_bytes),
    "barrier": (None, None),  # no message; counted for its calls and time
    # Object collectives: their size is what their inner tensor collectives move (see CommTracer).
    "all_gather_object": (None, None),
    "broadcast_object_list": (None, None),
    "gather_object": (None, None),
    "scatter_object_list": (None, None),
}
_OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")
_POINT_TO_POINT = ("send", "recv", "isend", "irecv", "batch_isend_irecv", "P2POp")
_TRACED = [*_MESSAGE_ARG, "batch_isend_irecv"]  # patched when this torch has them


class _Records(dict):
    """{(op, group name): CommStat} that also answers a lookup by another name of the same group."""

    def __init__(self, alias, items):
        super().__init__(items)
        self._alias = alias

    def _key(self, key):
        return (key[0], self._alias(key[1])) if isinstance(key, tuple) and len(key) == 2 else key

    def __getitem__(self, key):
        return super().__getitem__(self._key(key))

    def __contains__(self, key):
        return super().__contains__(self._key(key))

    def get(self, key, default=None):
        return super().get(self._key(key), default)

    def __reduce__(self):  # pickled (sent to another process) as the plain dict it is
        return dict, (dict(self),)


def _unwrapped(fn):
    """The torch function under any number of tracers' stand-ins (tracers nest: each wraps the one before)."""
    while hasattr(fn, "_comm_tracer_original"):
        fn = fn._comm_tracer_original
    return fn


class _TimedWork:
    """Stands in for the Work an async call returns: wait() is timed and charged to the call, everything else
    (is_completed, get_future, ...) is forwarded to the real Work. It is not a dist.Work instance, so code that
    hands Works to C++ or checks isinstance sees the difference."""

    def __init__(self, work, charge):
        self._work = work
        self._charge = charge  # charge(seconds)

    def wait(self, *args, **kwargs):
        start = time.perf_counter()
        result = self._work.wait(*args, **kwargs)
        self._charge(time.perf_counter() - start)
        return result

    def __getattr__(self, name):
        return getattr(self._work, name)


class CommTracer:
    """Counts calls, bytes and seconds per (phase, collective, group) for torch.distributed calls made inside
    `with`.

        tracer = CommTracer()
        tracer.name_group(dp_group, "dp")
        with tracer:
            train_step()                      # filed under the default phase, "step"
            with tracer.phase("eval"):
                evaluate()                    # filed under "eval"
        print(tracer.table())

    Entering patches the functions on the `torch.distributed` module object and on its implementation module
    `torch.distributed.distributed_c10d` (the collectives in _MESSAGE_ARG, batch_isend_irecv, and P2POp, see
    _p2p_op_class), so code that calls `dist.all_reduce(...)` goes through the tracer, and so do the tensor
    collectives that the object collectives (all_gather_object, broadcast_object_list, ...) make inside
    torch: those inner calls are not counted as calls of their own, their bytes are added to the object
    collective that made them (its payload is then the pickled bytes it moved, size headers included).
    Tracers nest (a measurement inside a traced run): the inner one wraps the outer one's stand-ins, so both
    count the calls made while both are active; they must exit in the reverse order of entering, as `with`
    blocks do. Exiting (also on an exception) puts back what was there. Calls forward every argument and return what the
    original returns, except that an async call's Work comes back wrapped so that its wait() can be timed.
    Groups are reported by the name given to name_group (also renaming what was recorded before), else
    "world" for the default group, else "group0", "group1", ... in the order the tracer first sees them.

    `records` (the default phase's: what a step sends, the figure the predictions are checked against) and
    `total` read one phase; `table()` shows every phase. With by_size, `sizes_of` also gives each record's calls
    by message size (block 0's measurement: TP's messages told apart from FP8's amaxes on the same group).

    Seconds are host time. With gloo that is the real communication time; with NCCL a synchronous call only
    enqueues a kernel on the stream, so the time is a lower bound unless the caller synchronizes.
    """

    STEP = "step"  # the default phase

    def __init__(self, by_size: bool = False):
        self._stats: dict[tuple[str, str, str], CommStat] = {}  # (phase, op, group name) -> stat
        self._sizes: dict | None = {} if by_size else None  # (phase, op, group name) -> {message bytes: calls}
        self._names: list[tuple[object, str]] = []  # (process group, name); a list because we compare with `is`
        self._unnamed = 0
        self._originals: dict[tuple[object, str], object] | None = None  # (module, name) -> original, while active
        self._phase = self.STEP
        self._aliases: dict[str, str] = {}  # any name of a group -> the name it is reported under
        self._outer = None  # the record of the traced call in progress (its inner calls add to it)
        self._sent_to: dict[tuple[str, str, str], list] = {}  # all_to_all_single's bytes per destination rank

    # --- naming groups and phases --------------------------------------------------------------------------

    def name_group(self, group, name: str) -> None:
        """Report calls on `group` under `name` (e.g. "dp", "tp"), including those already recorded. A group
        named twice (one communicator serving two mesh names, e.g. dp_cp and expert_dp when E = 1) is reported
        as "dp_cp=expert_dp", and looked up by either name (`alias`)."""
        group = dist.group.WORLD if group is None else group  # None means the default group in torch calls
        old = next((n for g, n in self._names if g is group), None)
        if old is not None and not old.startswith("group"):  # a name given before: an alias
            name = old if name in old.split("=") else f"{old}={name}"
        self._names = [(g, n) for g, n in self._names if g is not group] + [(group, name)]
        for alias in name.split("="):
            self._aliases[alias] = name
        if group is dist.group.WORLD:  # (a mesh axis spanning every rank is the default group: mesh.py)
            self._aliases["world"] = name
            old = old or "world"
        if old is not None and old != name:
            for (phase, op, group_name) in [k for k in self._stats if k[2] == old]:
                stat = self._stats.pop((phase, op, group_name))
                _add(self._stats.setdefault((phase, op, name), CommStat()), stat)
            for (phase, op, group_name) in [k for k in self._sent_to if k[2] == old]:
                self._sent_to[(phase, op, name)] = self._sent_to.pop((phase, op, group_name))
            for (phase, op, group_name) in [k for k in self._sizes or {} if k[2] == old]:
                self._sizes[(phase, op, name)] = self._sizes.pop((phase, op, group_name))

    def alias(self, name: str) -> str:
        """The name a group is reported under, given any of its names ("expert_dp" -> "dp_cp=expert_dp")."""
        return self._aliases.get(name, name)

    def _group_name(self, group) -> str:
        group = dist.group.WORLD if group is None else group
        for g, name in self._names:
            if g is group:
                return name
        if group is dist.group.WORLD:
            return "world"
        name = f"group{self._unnamed}"  # an unnamed subgroup: numbered in the order this tracer first sees it
        self._unnamed += 1
        self._names.append((group, name))
        return name

    @contextlib.contextmanager
    def phase(self, name: str):
        """File the calls made inside the `with` under phase `name` (e.g. "startup", "eval", "ckpt")."""
        previous, self._phase = self._phase, name
        try:
            yield self
        finally:
            self._phase = previous

    # --- results -------------------------------------------------------------------------------------------

    @property
    def records(self) -> dict[tuple[str, str], CommStat]:
        """A snapshot of the default phase ("step"): {(op, group name): CommStat}."""
        return self.records_of(self.STEP)

    def records_of(self, phase: str) -> dict[tuple[str, str], CommStat]:
        """A snapshot of one phase: {(op, group name): CommStat}; a lookup by any of a group's names works."""
        return _Records(self.alias, {(op, group): replace(stat) for (p, op, group), stat in self._stats.items()
                                     if p == phase})

    @property
    def phases(self) -> list[str]:
        """The phases that recorded a call, in the order first seen."""
        return list(dict.fromkeys(p for p, _, _ in self._stats))

    def sizes_of(self, phase: str = STEP) -> dict:
        """With by_size: {(op, group name): {message bytes: calls}} of one phase (a message M as `records` counts
        it); empty without."""
        return {(op, group): dict(sizes) for (p, op, group), sizes in (self._sizes or {}).items() if p == phase}

    def reset(self) -> None:
        self._stats, self._sent_to = {}, {}
        self._sizes = {} if self._sizes is not None else None

    def total(self, group_name: str | None = None, phase: str | None = STEP) -> CommStat:
        """The records of a phase (None: all phases) summed, or only those of one group."""
        out = CommStat()
        for (p, _, group), stat in self._stats.items():
            if (phase is None or p == phase) and (group_name is None or group == group_name):
                _add(out, stat)
        return out

    def table(self) -> str:
        """An aligned text table, one row per (phase, op, group) — the phase column only when there are
        several — and a total."""
        with_phase = len(self.phases) > 1
        header = (("phase",) if with_phase else ()) + ("op", "group", "calls", "payload", "wire/rank", "seconds")
        rows = [header]
        order = {p: i for i, p in enumerate(self.phases)}
        for (phase, op, group), s in sorted(self._stats.items(), key=lambda kv: (order[kv[0][0]], kv[0][2], kv[0][1])):
            rows.append((phase,) * with_phase + (op, group, str(s.calls), format_bytes(s.payload_bytes),
                                                 format_bytes(s.wire_bytes), f"{s.seconds:.4f}"))
        t = self.total(phase=None)
        rows.append(("total",) + ("",) * (1 + with_phase) + (str(t.calls), format_bytes(t.payload_bytes),
                                                            format_bytes(t.wire_bytes), f"{t.seconds:.4f}"))
        labels = 2 + with_phase  # left-aligned columns
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = []
        for row in rows:
            cells = [c.ljust(w) if i < labels else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
            lines.append("  ".join(cells).rstrip())
        return "\n".join(lines)

    # --- recording -----------------------------------------------------------------------------------------

    def _record(self, op: str, group, payload: int, key=None) -> tuple[str, str, str] | None:
        """Count one call (or, given the `key` of the object collective that made it, add its bytes to that
        record); return its key, or None when this rank is not in `group` (the call is a no-op)."""
        group_size = dist.get_world_size(group)
        if group_size < 1:
            return None
        inner, key = key is not None, key or (self._phase, op, self._group_name(group))
        stat = self._stats.setdefault(key, CommStat())
        stat.calls += 0 if inner else 1
        stat.payload_bytes += payload
        stat.wire_bytes += wire_bytes(op, payload, group_size)
        if self._sizes is not None and not inner:
            sizes = self._sizes.setdefault(key, {})
            sizes[payload] = sizes.get(payload, 0) + 1
        return key

    def _record_destinations(self, key, bound: dict) -> None:
        """An all_to_all_single's bytes per destination (its group's ranks, in group order): its input split
        sizes' rows, or equal pieces without them (`sent_to`)."""
        tensor, splits = bound["input"], bound.get("input_split_sizes")
        size = dist.get_world_size(bound.get("group"))
        row = tensor.element_size() * (tensor[0].numel() if tensor.dim() and len(tensor) else 0)
        pieces = [rows * row for rows in splits] if splits else [_tensor_bytes(tensor) // size] * size
        into = self._sent_to.setdefault(key, [0] * size)
        for destination, nbytes in enumerate(pieces):
            into[destination] += nbytes

    def sent_to(self, op: str, group_name: str, phase: str = STEP) -> list:
        """The bytes this rank's `op` calls on `group_name` sent to each rank of the group (group order): traced
        for all_to_all_single only (the MoE exchange's bytes leaving a group, moe_costs.off_group_bytes)."""
        return list(self._sent_to.get((phase, op, self.alias(group_name)), []))

    def _charge(self, keys: list, seconds: float) -> None:
        """Add `seconds` to the records in `keys`, shared equally (a batch's ops cannot be timed apart)."""
        keys = [k for k in keys if k is not None]
        for key in keys:
            self._stats.setdefault(key, CommStat()).seconds += seconds / len(keys)

    def _timed_call(self, original, keys: list, args, kwargs):
        """Call `original`, charge its duration to `keys`; wrap a returned Work so its wait() is charged too."""
        start = time.perf_counter()
        result = original(*args, **kwargs)
        self._charge(keys, time.perf_counter() - start)
        if hasattr(result, "wait"):  # an async call's Work
            return _TimedWork(result, lambda s: self._charge(keys, s))
        return result

    def _wrap(self, name: str, original):
        """The stand-in for torch.distributed.<name>."""
        signature = inspect.signature(original)
        message_arg, size_of = _MESSAGE_ARG[name]

        @functools.wraps(original)
        def traced(*args, **kwargs):
            bound = signature.bind(*args, **kwargs).arguments  # only what the caller passed; defaults absent
            payload = size_of(bound[message_arg]) if message_arg else 0
            if self._outer is not None:  # called by a traced call: timed with it, and counted only as the bytes
                if self._outer[1] in _OBJECT_COLLECTIVES:  # of an object collective (another spelling of a
                    self._record(name, bound.get("group"), payload, key=self._outer)  # collective: not at all)
                return original(*args, **kwargs)
            key = self._record(name, bound.get("group"), payload)
            if name == "all_to_all_single" and key is not None:
                self._record_destinations(key, bound)
            self._outer = key
            try:
                return self._timed_call(original, [key], args, kwargs)
            finally:
                self._outer = None

        traced._comm_tracer_original = original
        return traced

    def _wrap_batch(self, original):
        """The stand-in for torch.distributed.batch_isend_irecv: one "send"/"recv" record per P2POp."""
        isend = _unwrapped(self._originals[(dist, "isend")])  # what a P2POp holds (see _p2p_op_class)

        @functools.wraps(original)
        def traced(p2p_op_list, *args, **kwargs):
            keys = []
            for p2p in p2p_op_list:
                kind = "send" if p2p.op is isend else "recv"
                keys.append(self._record(kind, p2p.group, _tensor_bytes(p2p.tensor)))
            start = time.perf_counter()
            works = original(p2p_op_list, *args, **kwargs)
            self._charge(keys, time.perf_counter() - start)
            # Without coalescing there is one Work per op, in order; with it, one Work for the whole batch.
            if len(works) == len(keys):
                return [_TimedWork(w, lambda s, k=k: self._charge([k], s)) for w, k in zip(works, keys)]
            return [_TimedWork(w, lambda s: self._charge(keys, s)) for w in works]

        traced._comm_tracer_original = original
        return traced

    def _p2p_op_class(self, original_cls):
        """dist.P2POp checks `op in [isend, irecv]` (and batch_isend_irecv tests `op is isend`) against the real
        functions, so a P2POp built from our patched dist.isend would be rejected. This subclass hands the
        original function to P2POp instead."""

        class P2POp(original_cls):
            def __new__(cls, op, *args, **kwargs):
                return super().__new__(cls, _unwrapped(op), *args, **kwargs)

            def __init__(self, op, *args, **kwargs):
                super().__init__(_unwrapped(op), *args, **kwargs)

        P2POp._comm_tracer_original = original_cls
        return P2POp

    # --- context manager -----------------------------------------------------------------------------------

    def __enter__(self) -> CommTracer:
        if self._originals is not None:
            raise RuntimeError("this CommTracer is already active")
        originals = {name: getattr(dist, name) for name in [*_TRACED, "P2POp"] if hasattr(dist, name)}
        # In distributed_c10d only the collectives the object collectives call: its P2POp checks ops against
        # its own isend/irecv, which must stay the originals.
        self._originals = {(module, name): getattr(module, name) for module in (dist, distributed_c10d)
                           for name in originals if hasattr(module, name)
                           and (module is dist or name not in _POINT_TO_POINT)}
        patched = {}
        for name, original in originals.items():
            if name == "batch_isend_irecv":
                patched[name] = self._wrap_batch(original)
            elif name == "P2POp":
                patched[name] = self._p2p_op_class(original)
            else:
                patched[name] = self._wrap(name, original)
        for module, name in self._originals:
            setattr(module, name, patched[name])
        return self

    def __exit__(self, *exc) -> None:
        for (module, name), original in self._originals.items():
            setattr(module, name, original)
        self._originals = None
