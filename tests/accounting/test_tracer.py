"""Tests for accounting/tracer.py: the CommTracer on real ranks (their tensors on harness.device(): each rank's GPU
under nccl, where the tensor collectives go over NCCL): calls, payloads and wire bytes per (phase, collective, group),
object collectives sized by what they move, nesting, and restoring torch.distributed afterwards."""

import pytest
import torch
import torch.distributed as dist

from accounting.tracer import CommTracer
import harness
from harness import run_ranks


TRACED_NAMES = ["all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
                "all_gather_single", "reduce_scatter_single",
                "all_gather", "reduce_scatter", "broadcast", "send", "recv", "isend", "irecv",
                "batch_isend_irecv", "barrier", "P2POp"]


def test_tracer_restores_on_exception_and_refuses_reentry():
    # Patching and restoring needs no process group.
    originals = {n: getattr(dist, n) for n in TRACED_NAMES if hasattr(dist, n)}
    tracer = CommTracer()
    with pytest.raises(ZeroDivisionError):
        with tracer:
            assert dist.all_reduce is not originals["all_reduce"]
            with pytest.raises(RuntimeError):
                tracer.__enter__()  # the same tracer twice
            outer = {n: getattr(dist, n) for n in originals}
            with pytest.raises(ZeroDivisionError), CommTracer():  # another tracer on top: nests
                assert dist.all_reduce is not outer["all_reduce"]
                1 / 0
            assert all(getattr(dist, n) is f for n, f in outer.items())  # the outer tracer's stand-ins are back
            1 / 0
    assert all(getattr(dist, n) is f for n, f in originals.items())
    assert tracer.records == {} and tracer.total().calls == 0


def _traced_collectives(rank, world_size):
    """Runs on each rank: a mix of collectives under a tracer. Returns what the test checks."""
    originals = {n: getattr(dist, n) for n in TRACED_NAMES if hasattr(dist, n)}
    # new_group is collective over the world: every rank creates every pair group, in the same order.
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world_size, 2)]
    dp = pairs[rank // 2]
    unnamed = dist.new_group(list(range(world_size)))  # reported as "group0"

    device = harness.device()
    tracer = CommTracer()
    tracer.name_group(dp, "dp")
    checks = {}
    with tracer:
        x = torch.full((1000,), float(rank), device=device)  # 4000 bytes
        dist.all_reduce(x)  # sync, world
        checks["all_reduce"] = x[0].item()

        y = torch.ones(500, device=device)  # 2000 bytes
        work = dist.all_reduce(y, group=dp, async_op=True)
        work.wait()
        checks["async"] = y[0].item()
        dist.all_reduce(y, dist.ReduceOp.SUM, dp)  # positional group

        shard = torch.full((16,), float(rank), device=device)
        gathered = torch.empty(32, device=device)  # 128 bytes, the output counts
        dist.all_gather_into_tensor(gathered, shard, group=dp)
        checks["gathered"] = gathered.tolist()
        if hasattr(dist, "all_gather_single"):  # the newer name for the same collective
            dist.all_gather_single(gathered, shard, group=dp)

        full = torch.ones(8 * world_size, device=device)  # 32 * world_size bytes, the input counts
        part = torch.empty(8, device=device)
        dist.reduce_scatter_tensor(part, full)
        checks["scattered"] = part[0].item()

        a2a_in = torch.arange(4 * world_size, dtype=torch.float32, device=device) + 100 * rank
        a2a_out = torch.empty_like(a2a_in)
        dist.all_to_all_single(a2a_out, a2a_in, group=unnamed)
        checks["a2a"] = a2a_out.tolist()

        # A ring: send 10 floats to the next rank, receive 10 from the previous one. The P2POps are built
        # while the tracer is active, from the patched dist.isend/dist.irecv.
        send_buf = torch.full((10,), float(rank), device=device)
        recv_buf = torch.empty(10, device=device)
        ops = [dist.P2POp(dist.isend, send_buf, (rank + 1) % world_size),
               dist.P2POp(dist.irecv, recv_buf, (rank - 1) % world_size)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        checks["ring"] = recv_buf[0].item()
        checks["patched"] = dist.all_reduce is not originals["all_reduce"]
    checks["restored"] = all(getattr(dist, n) is f for n, f in originals.items())
    checks["table"] = tracer.table()
    return tracer.records, checks, tracer.total("dp")


@pytest.mark.parametrize("world_size", [2, 4])
def test_tracer_counts_bytes_on_ranks(world_size):
    results = run_ranks(_traced_collectives, world_size, timeout=60)
    n = world_size
    for rank, (records, checks, dp_total) in enumerate(results):
        # The calls did what they always do: arguments and results forwarded unchanged.
        assert checks["patched"] and checks["restored"]
        assert checks["all_reduce"] == sum(range(n))
        assert checks["async"] == 2.0
        pair = rank // 2 * 2
        assert checks["gathered"] == [float(pair)] * 16 + [float(pair + 1)] * 16
        assert checks["scattered"] == n
        assert checks["a2a"] == [4 * rank + i + 100 * src for src in range(n) for i in range(4)]
        assert checks["ring"] == (rank - 1) % n

        expected = {  # (op, group): (calls, payload M, wire bytes by the section 4 formula)
            ("all_reduce", "world"): (1, 4000, 2 * (n - 1) / n * 4000),
            ("all_reduce", "dp"): (2, 4000, 2 * 1 / 2 * 4000),
            ("all_gather_into_tensor", "dp"): (1, 128, 1 / 2 * 128),
            ("reduce_scatter_tensor", "world"): (1, 32 * n, (n - 1) / n * 32 * n),
            ("all_to_all_single", "group0"): (1, 16 * n, (n - 1) / n * 16 * n),
            ("send", "world"): (1, 40, 40),
            ("recv", "world"): (1, 40, 0),
        }
        if hasattr(dist, "all_gather_single"):
            expected[("all_gather_single", "dp")] = (1, 128, 1 / 2 * 128)
        assert set(records) == set(expected)
        for key, (calls, payload, wire) in expected.items():
            stat = records[key]
            assert (stat.calls, stat.payload_bytes) == (calls, payload), key
            assert stat.wire_bytes == pytest.approx(wire), key
            assert stat.seconds > 0, key
        dp_expected = [v for (op, group), v in expected.items() if group == "dp"]
        assert dp_total.calls == sum(c for c, _, _ in dp_expected)
        assert dp_total.payload_bytes == sum(m for _, m, _ in dp_expected)
        assert "all_to_all_single" in checks["table"] and "group0" in checks["table"]


def _traced_phases_and_objects(rank, world_size):
    """Object collectives, gather/scatter/reduce, phases, and a group named after it was first seen."""
    import pickle

    device = harness.device()
    group = dist.new_group(list(range(world_size)))
    tracer = CommTracer()
    with tracer:
        with tracer.phase("ckpt"):
            gathered = [None] * world_size
            dist.all_gather_object(gathered, {"rank": rank}, group=group)  # recorded under "group0" first
            box = ["x" * 100 if rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
        tracer.name_group(group, "dp")  # renames what was recorded
        with tracer.phase("eval"):
            piece = torch.full((4,), float(rank), device=device)
            pieces = [torch.empty(4, device=device) for _ in range(world_size)] if rank == 0 else None
            dist.gather(piece, pieces, dst=0)
            out = torch.empty(4, device=device)
            dist.scatter(out, [torch.full((4,), float(r), device=device) for r in range(world_size)] if rank == 0
                         else None, src=0)
            total = torch.ones(3, device=device)
            dist.reduce(total, dst=0)
        dist.all_reduce(torch.ones(2, device=device))  # the default phase: "step"
        inner = CommTracer()
        with inner:  # a measurement inside a traced run: both tracers count its calls
            ring = [dist.P2POp(dist.isend, torch.ones(3, device=device), (rank + 1) % world_size),
                    dist.P2POp(dist.irecv, torch.empty(3, device=device), (rank - 1) % world_size)]
            for work in dist.batch_isend_irecv(ring):
                work.wait()
            dist.all_gather_object([None] * world_size, rank)
    sizes = [len(pickle.dumps({"rank": r})) for r in range(world_size)]
    box_size = len(pickle.dumps("x" * 100))
    return dict(step=tracer.records, ckpt=tracer.records_of("ckpt"), eval=tracer.records_of("eval"),
                phases=tracer.phases, table=tracer.table(), sizes=sizes, box_size=box_size, box=box[0],
                out=out[0].item(), gathered=gathered, all_phases=tracer.total(phase=None).calls, inner=inner.records)


def test_tracer_files_phases_and_sizes_object_collectives():
    n = 2
    for rank, r in enumerate(run_ranks(_traced_phases_and_objects, n, timeout=60)):
        assert r["gathered"] == [{"rank": i} for i in range(n)] and r["box"] == "x" * 100 and r["out"] == rank
        assert r["phases"] == ["ckpt", "eval", "step"] and r["all_phases"] == 2 + 3 + 1 + 3
        nested = {("send", "world"): (1, 12), ("recv", "world"): (1, 12), ("all_gather_object", "world"): (1, None)}
        for records in (r["step"], r["inner"]):
            for key, (calls, payload) in nested.items():
                assert records[key].calls == calls and payload in (None, records[key].payload_bytes), key
            gathered = ("all_gather_object", "world")
            assert records[gathered].payload_bytes == r["inner"][gathered].payload_bytes > 0
        assert r["step"][("all_reduce", "world")].payload_bytes == 8 and ("all_reduce", "world") not in r["inner"]
        # all_gather_object: an all_gather of the int64 sizes (8 bytes per rank), then of the pickles padded to
        # the longest; broadcast_object_list: the size, then the pickle. One call each, their inner bytes.
        objects = r["ckpt"]
        assert set(objects) == {("all_gather_object", "dp"), ("broadcast_object_list", "world")}
        gather = objects[("all_gather_object", "dp")]
        assert gather.calls == 1 and gather.payload_bytes == 8 * n + n * max(r["sizes"])
        box = objects[("broadcast_object_list", "world")]  # the int64 size, then the pickle
        assert box.calls == 1 and box.payload_bytes == 8 + r["box_size"] and box.wire_bytes == box.payload_bytes
        ev = r["eval"]
        assert {k: (s.calls, s.payload_bytes) for k, s in ev.items()} == {
            ("gather", "world"): (1, 16), ("scatter", "world"): (1, 16), ("reduce", "world"): (1, 12)}
        assert ev[("scatter", "world")].wire_bytes == (n - 1) * 16
        header = r["table"].splitlines()[0].split()
        assert header[:3] == ["phase", "op", "group"] and "group0" not in r["table"]
