"""parallel/lowbit.py: the 4-bit all-reduce, its error feedback, its messages, and TP's and DDP's use of it.

The collective on groups of 2, 3 and 4 ranks (one spawn of 4): with the identity codec it is dist.all_reduce bitwise
for two ranks (a + b is b + a) and to fp32 rounding for more (gloo's ring sums in another order); every rank decodes
the same sum; each rank encodes N·c elements a call (its N - 1 sent chunks and the sum it owns: every value quantised
at most twice); NVFP4's sum errs ≈ 10% relative; with feedback the sum of K calls' outputs misses the exact sum by the
last call's error alone (to fp32 rounding), without it by the K errors' sum; the traced messages are `call_messages`.

Training (T = 2 × D = 2, float64, tests/test_composition.py's composed runs on tests/reference.py's batches): the
identity codec in TP's f and g and DDP's buckets, feedback on, gives bitwise the exact path's losses and parameters;
NVFP4 trains within 2% of its loss, traced messages equal the prediction, the held bytes (the buckets' feedback) the
predicted ones, and a checkpointed run resumes bitwise (the feedback is restored). The flags' refusals are in-process.
"""

import pytest
import torch

import harness
from harness import run_ranks
from test_composition import CLIP, SEQ, STEPS, composed_run

GROUP_SIZES = (2, 3, 4)
TP_DP = ["--tp", "2", "--tp-comm-bits", "4", "--dp-comm-bits", "4"]  # T = 2 × D = 2 on 4 ranks


# ---------------------------------------------------------------------------------------------------------
# The collective
# ---------------------------------------------------------------------------------------------------------


def _collective(rank, world):
    """Per group size N (ranks 0..N-1; the others wait): what the tests below read."""
    import torch.distributed as dist

    from accounting.tracer import CommTracer
    from parallel import lowbit

    groups = {size: dist.new_group(list(range(size))) for size in GROUP_SIZES}
    out = {}
    for size, group in groups.items():
        if rank >= size:
            continue
        torch.manual_seed(rank)
        seen = {}
        for dtype in (torch.float32, torch.float64):
            x = torch.randn(3, 37, dtype=dtype)  # 111 elements: padded to N chunks of a multiple of 16
            exact = x.clone()
            dist.all_reduce(exact, group=group)
            identity, error = lowbit.all_reduce(x, group, lowbit.Identity)
            fed, _ = lowbit.all_reduce(x, group, lowbit.Identity, error)
            seen[dtype] = dict(exact=exact, identity=identity, fed=fed, error=error)
        x = torch.randn(3, 37, dtype=torch.float32)
        exact = x.clone()
        dist.all_reduce(exact, group=group)
        counted = _Counting()
        quantised, _ = lowbit.all_reduce(x, group, counted)
        seen["nvfp4"] = dict(exact=exact, sum=quantised, encoded=counted.elements,
                             padded=size * lowbit.chunk_elements(x.numel(), size))
        seen["feedback"] = _telescoping(group)
        tracer = CommTracer()
        tracer.name_group(group, "g")
        with tracer:
            lowbit.all_reduce(torch.randn(1000), group)
        seen["traced"] = {key: (r.calls, r.payload_bytes) for key, r in tracer.records.items()}
        seen["predicted"] = dict(lowbit.call_messages(1000, 4, lowbit.NVFP4, "g", size))
        out[size] = seen
    return out


class _Counting:
    """NVFP4, counting the elements it encodes."""

    name = "counting"
    row_bytes = staticmethod(lambda c, e: __import__("parallel.lowbit").lowbit.NVFP4.row_bytes(c, e))

    def __init__(self):
        from parallel import lowbit

        self.codec, self.elements = lowbit.NVFP4, 0

    def encode(self, chunk):
        self.elements += chunk.numel()
        return self.codec.encode(chunk)

    def decode(self, row, c, dtype):
        return self.codec.decode(row, c, dtype)


def _telescoping(group, calls: int = 16):
    """K calls adding into one stream, with and without feedback: each stream's error against the exact sums', and
    the feedback stream's error less the last call's (its errors summed over the group)."""
    import torch.distributed as dist

    from parallel import lowbit

    exact, plain, fed, error = 0, 0, 0, None
    for _ in range(calls):
        x = torch.randn(1000)
        total = x.clone()
        dist.all_reduce(total, group=group)
        exact = exact + total
        plain = plain + lowbit.all_reduce(x, group)[0]
        out, error = lowbit.all_reduce(x, group, feedback=error)
        fed = fed + out
    last = error.clone()
    dist.all_reduce(last, group=group)
    return dict(plain=float((plain - exact).norm() / exact.norm()), fed=float((fed - exact).norm() / exact.norm()),
                residue=float((fed - exact - last[:1000]).abs().max() / exact.abs().max()))


@pytest.fixture(scope="module")
def collective():
    return run_ranks(_collective, 4, timeout=180)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_identity_codec_is_dist_all_reduce_bitwise_on_two_ranks_and_to_rounding_on_more(collective, dtype):
    for size in GROUP_SIZES:
        for rank in range(size):
            seen = collective[rank][size][dtype]
            assert not seen["error"].any()  # x - x: the feedback it hands on is zero
            if size == 2:
                assert torch.equal(seen["identity"], seen["exact"]), (size, rank)
                assert torch.equal(seen["fed"], seen["exact"]), (size, rank)  # zero feedback changes no bit
            else:
                torch.testing.assert_close(seen["identity"], seen["exact"], rtol=0, atol=1e-5 if dtype ==
                                           torch.float32 else 1e-13)


def test_every_rank_decodes_the_same_sum_and_each_value_is_quantised_at_most_twice(collective):
    for size in GROUP_SIZES:
        first = collective[0][size]["nvfp4"]
        for rank in range(size):
            seen = collective[rank][size]["nvfp4"]
            assert torch.equal(seen["sum"], first["sum"]), (size, rank)
            # N - 1 chunks sent, the owned sum once more: N·c per rank, so N·(N·c) encodes of N·c positions, each
            # position's N addends once (N - 1 of them: the owner's own never) and its sum once.
            assert seen["encoded"] == seen["padded"], (size, rank)


def test_the_nvfp4_sum_errs_about_ten_percent(collective):
    for size in GROUP_SIZES:
        seen = collective[0][size]["nvfp4"]
        relative = float((seen["sum"] - seen["exact"]).norm() / seen["exact"].norm())
        assert 0.02 < relative < 0.2, (size, relative)


def test_with_feedback_the_accumulated_error_is_the_last_calls_alone(collective):
    for size in GROUP_SIZES:
        seen = collective[0][size]["feedback"]
        assert seen["residue"] < 1e-5, (size, seen)  # Σ outputs − Σ exact = the last call's error, to fp32 rounding
        assert seen["fed"] < seen["plain"] / 2.5, (size, seen)  # 16 errors add up (√16 = 4), one does not


def test_the_traced_messages_are_call_messages(collective):
    for size in GROUP_SIZES:
        seen = collective[0][size]
        assert seen["traced"] == {key: tuple(count) for key, count in seen["predicted"].items()}, size


# ---------------------------------------------------------------------------------------------------------
# TP's f and g and DDP's buckets, in training
# ---------------------------------------------------------------------------------------------------------


def _trained(rank, world, root):
    """Each case trained STEPS steps from the same init on the same batches: losses, parameters, messages, bytes; and
    the NVFP4 run again, saved after step 1 and resumed from it."""
    import report.run
    from parallel import lowbit

    cases = {"exact": ["--tp", "2"], "identity": TP_DP, "nvfp4": TP_DP, "no feedback": [*TP_DP, "--comm-feedback",
                                                                                          "off"]}
    out = {}
    for name, flags in cases.items():
        run = composed_run(rank, world, flags, {}, 8, 2, harness.device())
        if name == "identity":  # quantisation as the identity, feedback on
            handle = next(axis for axis in run.axes if axis.name == "lowbit")
            handle.tp_reduction.codec = run.layout.ddp.reduction.codec = lowbit.Identity
        losses, traced = harness.traced_steps(run, STEPS, 8, SEQ, 2, CLIP, STEPS)
        out[name] = dict(losses=losses, traced=traced, predicted=dict(report.run.predicted_messages(run, STEPS)),
                         params={n: p.detach().clone() for n, p in run.model.named_parameters()},
                         held=run.layout.held_bytes(), persistent=run.layout.predicted_persistent())
    harness.traced_steps(composed_run(rank, world, TP_DP, {}, 8, 2, harness.device()), STEPS, 8, SEQ, 2, CLIP, 1,
                         save_root=root)
    run = composed_run(rank, world, TP_DP, {}, 8, 2, harness.device())
    losses, _ = harness.traced_steps(run, STEPS, 8, SEQ, 2, CLIP, STEPS, resume_root=root)
    out["resumed"] = dict(losses=losses, params={n: p.detach().clone() for n, p in run.model.named_parameters()})
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return run_ranks(_trained, 4, str(tmp_path_factory.mktemp("lowbit-ckpt")), timeout=300)


def test_the_identity_codec_trains_bitwise_as_the_exact_all_reduces(trained):
    for rank, seen in enumerate(trained):
        assert seen["identity"]["losses"] == seen["exact"]["losses"], rank
        for name, value in seen["exact"]["params"].items():
            assert torch.equal(seen["identity"]["params"][name], value), (rank, name)


def test_nvfp4_trains_near_the_exact_loss(trained):
    for seen in trained:
        exact = torch.tensor(list(seen["exact"]["losses"].values()))
        for case in ("nvfp4", "no feedback"):
            losses = torch.tensor(list(seen[case]["losses"].values()))
            assert not torch.equal(losses, exact), case  # the codes do change the numbers
            torch.testing.assert_close(losses, exact, rtol=2e-2, atol=0, msg=case)


def test_traced_messages_and_held_bytes_equal_the_predictions(trained):
    for seen in trained:
        for case in ("identity", "nvfp4", "no feedback"):
            traced, predicted = seen[case]["traced"], seen[case]["predicted"]
            assert {k: tuple(v) for k, v in predicted.items()} == traced, case
            assert seen[case]["held"] == seen[case]["persistent"], case
        assert {op for op, group in seen["nvfp4"]["traced"] if group == "tp"} == {"all_to_all_single",
                                                                                 "all_gather_single", "all_reduce"}
        assert seen["nvfp4"]["held"]["feedback"] > 0 and "feedback" not in seen["no feedback"]["held"]


def test_tp_replicated_copies_stay_equal_under_the_4bit_gradient_sum(trained):
    """A LayerNorm is one tensor on both TP ranks: its bucket holds only such copies (ddp.reverse_order_buckets'
    by_copies), so both TP ranks' DP sums quantise the same values alike; a bucket shared with split tensors would
    scale its blocks otherwise on each, and the copies would drift apart."""
    for case in ("nvfp4", "no feedback"):
        for pair in ((0, 1), (2, 3)):  # the TP groups
            first, second = (trained[rank][case]["params"] for rank in pair)
            replicated = [name for name in first if "ln_" in name or name.endswith("c_proj.bias")]
            assert replicated and all(torch.equal(first[name], second[name]) for name in replicated), (case, pair)


def test_a_resumed_run_restores_the_buckets_feedback_bitwise(trained):
    for rank, seen in enumerate(trained):
        resumed, straight = seen["resumed"], seen["nvfp4"]
        assert resumed["losses"] == {s: straight["losses"][s] for s in resumed["losses"]}, rank
        for name, value in straight["params"].items():
            assert torch.equal(resumed["params"][name], value), (rank, name)


# ---------------------------------------------------------------------------------------------------------
# The flags
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, world, message", [
    (["--tp-comm-bits", "8", "--tp", "2"], 2, "--tp-comm-bits 8: supported are 4"),
    (["--dp-comm-bits", "2"], 2, "--dp-comm-bits 2: supported are 4"),
    (["--tp-comm-bits", "4"], 2, "--tp-comm-bits 4 needs --tp > 1"),
    (["--tp-comm-bits", "4", "--tp", "2", "--sp"], 2, "--sp replaces them"),
    (["--tp-comm-bits", "4", "--tp", "2", "--pp", "2"], 4, "--tp-comm-bits 4 with --pp"),
    (["--tp-comm-bits", "4", "--tp", "2", "--activation-checkpointing"], 2, "with --activation-checkpointing"),
    (["--dp-comm-bits", "4"], 1, "--dp-comm-bits 4 needs a data-parallel group"),
    (["--dp-comm-bits", "4", "--zero", "1"], 2, "--zero 1 reduce-scatters"),
    (["--comm-feedback", "off", "--tp", "2"], 2, "--comm-feedback needs"),
])
def test_a_flag_that_cannot_apply_is_one_line_naming_it(argv, world, message):
    from cli import flags
    import train

    args = flags.build_parser().parse_args(["--preset", "tiny", "--global-batch", "4", *argv])
    with pytest.raises(flags.FlagError, match=message.replace("+", r"\+")) as error:
        flags.validate(args, world, flags.explicit_flags(["--preset", "tiny", *argv]), axes=train.AXES)
    assert "\n" not in str(error.value)
