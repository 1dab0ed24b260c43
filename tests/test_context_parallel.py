"""context_parallel.py: the layout, the attention against full causal attention, the whole model's gradients,
the traced messages against the prediction, the saved activations, the printouts, and the flag errors.

Attention: output, log-sum-exp and dq, dk, dv of ring (zig-zag, contiguous) and Ulysses at C = 2 and C = 4
against an explicit causal softmax on the whole sequence, float64, tolerance 1e-10 (one 4-rank spawn: two
C = 2 groups and one C = 4 group). The same spawn runs C = 2 under bf16 autocast: the ring within the bound
one bf16 rounding implies (u = 2^-8 per result, plus the bf16 output's rounding inside dq and dk: see
`_bf16_bounds`) of the float64 values, Ulysses bitwise equal to the single device's attention under the same
autocast, and a ring with bf16 accumulators caught; and it counts the ring's casts and masks per pass.
Whole model: `context_parallel.apply` on model.GPT in float64 (alone, and after tensor_parallel on a 2×2
mesh); each rank backpropagates its loss_sum / the global token count, gradients are summed over the cp group
(what the layout's dp×cp reduction does); they equal the single-device gradients on the whole batch, 1e-10.
Every cp-group message traced by tracer.CommTracer equals the prediction, calls and bytes.
Activations: the bytes saved for backward by one block (saved_tensors_hooks) are within 5% of Korthikanti's
estimate in the form this attention implies, 32·(s/C)·b·h scaled from 16-bit to float64: the attention keeps
no score matrix (no 5as/h term) and dropout is 0 (no 1-byte masks: 34 − 2); what is left over is the fp64
log-sum-exp and the LayerNorm statistics (1.6% here). C = 2 saves half of C = 1 at the same global sequence.
Printouts: a run composed as train.py composes it (`train.compose`, block 0 measured at start-up), its cp
start-up lines, one training step and one evaluation pass, its end lines (the clock observing the ring,
observers.WaitClock, counts the step's passes only).
Each spawned run is a module-scoped fixture shared by one test per property. The rank bodies build on
harness.device() (each rank's GPU under nccl); the whole-sequence tensors every rank must hold alike are drawn
on the CPU and moved there.
"""

from argparse import Namespace
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import harness
from harness import run_ranks
from reference import WholeGrads, global_batches, make_config, rank_micro_batches

SEQ = 16
TOL = 1e-10
BF16_U = 2.0 ** -8  # bf16 keeps 8 significant bits: rounding to nearest moves a value by ≤ 2^-8 of it
FP32_SLACK = 64 * torch.finfo(torch.float32).eps  # the ring's fp32 arithmetic, relative to a tensor's max
ACTIVATION_TOL = 0.05


def _max_err(a, b):
    return float((a.detach() - b.detach()).abs().max())


# ---------------------------------------------------------------------------------------------------------
# The layout, the formulas and the flags (no processes)
# ---------------------------------------------------------------------------------------------------------


def test_layout_covers_the_sequence_each_rank_ascending():
    import context_parallel as cp

    for C in (1, 2, 4):
        for balance in cp.BALANCES:
            pieces = [cp.positions(64, C, c, balance) for c in range(C)]
            assert torch.equal(torch.cat(pieces).sort().values, torch.arange(64))
            assert all(torch.equal(p, p.sort().values) for p in pieces)  # each rank's tokens ascend
    assert cp.positions(16, 4, 1).tolist() == [2, 3, 12, 13]  # chunks 1 and 2C−1−1 = 6 of 8


def test_zigzag_balances_the_causal_work():
    import context_parallel as cp

    work = cp.causal_work(64, 4)
    assert len(set(work["zigzag"])) == 1  # every rank attends the same number of (query, key) pairs
    assert sum(work["zigzag"]) == sum(work["contiguous"]) == 64 * 65 // 2
    assert max(work["contiguous"]) / (sum(work["contiguous"]) / 4) == pytest.approx(1.75, rel=0.02)


def test_layer_messages_follow_the_docstring():
    """Item 3 of the docstring at C = 4, b = 2, s = 16, h/T = 8, e_c = 2 (e_a = 4): ring forward 3 hops of [K; V]
    (2·(s/C)·b·(h/T)·e_c = 256 B), backward 3 of [K; V] and 4 of [dK; dV] (512 B); Ulysses 4 all-to-alls of
    128 B each way; activation checkpointing adds the forward's to backward."""
    import context_parallel as cp

    shape = cp.LayerShape(micro=2, seq_len=16, width=8, compute_bytes=2)
    ring = cp.layer_messages("ring", 4, shape)
    assert ring["forward"] == {("send", "cp"): (3, 3 * 256), ("recv", "cp"): (3, 3 * 256)}
    assert ring["backward"] == {("send", "cp"): (7, 3 * 256 + 4 * 512), ("recv", "cp"): (7, 3 * 256 + 4 * 512)}
    ulysses = cp.layer_messages("ulysses", 4, cp.LayerShape(2, 16, 8, 2, checkpointing=True))
    assert ulysses["forward"] == {("all_to_all_single", "cp"): (4, 4 * 128)}
    assert ulysses["backward"] == {("all_to_all_single", "cp"): (8, 8 * 128)}
    assert cp.layer_messages("ring", 1, shape) == {"forward": {}, "backward": {}}


def _flags(seq_len, cp, n_head, tp=1, impl="ring", balance="zigzag", dropout=0.0, sequence_parallel=False):
    """config_from_flags on these flags, with the slice of flags.Settings it reads."""
    import context_parallel

    settings = SimpleNamespace(seq_len=seq_len, model=SimpleNamespace(n_head=n_head, dropout=dropout),
                               shape=SimpleNamespace(tp=tp), sequence_parallel=sequence_parallel)
    return context_parallel.config_from_flags(Namespace(cp=cp, cp_impl=impl, cp_balance=balance), settings)


@pytest.mark.parametrize(
    "kwargs,expected",
    [
        (dict(seq_len=20, cp=3, n_head=6), ["--seq-len 20", "--cp 3", "2C"]),
        (dict(seq_len=18, cp=4, n_head=4, balance="contiguous"), ["--seq-len 18", "--cp 4"]),
        (dict(seq_len=16, cp=4, n_head=6, impl="ulysses"), ["--cp-impl ulysses", "--cp 4", "6/1"]),
        (dict(seq_len=16, cp=2, n_head=4, tp=4, impl="ulysses"), ["--cp-impl ulysses", "4/4"]),
        (dict(seq_len=16, cp=2, n_head=4, dropout=0.1), ["--dropout 0.1", "--cp 2"]),
        (dict(seq_len=20, cp=2, n_head=4, tp=4, sequence_parallel=True), ["--sp", "--tp 4", "10 tokens"]),
        (dict(seq_len=16, cp=2, n_head=4, impl="ring-flash"), ["--cp-impl"]),
        (dict(seq_len=16, cp=2, n_head=4, balance="striped"), ["--cp-balance"]),
        (dict(seq_len=16, cp=0, n_head=4), ["--cp"]),
    ],
)
def test_invalid_cp_flags_are_clear_errors(kwargs, expected):
    with pytest.raises(ValueError) as error:
        _flags(**kwargs)
    for text in expected:
        assert text in str(error.value)


def test_valid_cp_flags_give_the_config():
    import context_parallel as cp

    assert _flags(seq_len=16, cp=4, n_head=4, impl="ulysses") == cp.CPConfig(4, "ulysses", "zigzag")
    assert _flags(seq_len=12, cp=4, n_head=3, balance="contiguous") == cp.CPConfig(4, "ring", "contiguous")
    assert _flags(seq_len=16, cp=2, n_head=4, tp=2, impl="ulysses", sequence_parallel=True).size == 2
    assert _flags(seq_len=15, cp=1, n_head=3) is None  # off: nothing to check


def test_parallelize_refuses_a_model_with_attention_dropout():
    """The ring has no attention dropout: a model built with it is refused before anything is swapped (no
    process group needed: nothing talks before the check)."""
    import context_parallel as cp
    from model import causal_attention
    from reference import build_model

    model = build_model(make_config(dropout=0.1), seed=0)
    with pytest.raises(ValueError, match="--dropout 0.1"):
        cp.parallelize(model, group=None)
    assert all(block.attn.attention_fn is causal_attention for block in model.transformer.h)


# ---------------------------------------------------------------------------------------------------------
# Attention against full causal attention
# ---------------------------------------------------------------------------------------------------------


def _reference_attention(q, k, v, dout):
    """Explicit causal softmax on the whole sequence: (out, lse, dq, dk, dv)."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    out = torch.softmax(s, -1) @ v
    out.backward(dout)
    return out.detach(), torch.logsumexp(s, -1).detach(), q.grad, k.grad, v.grad


def _attention(rank, world):
    """Every variant at C = 2 (groups {0,1}, {2,3}) and C = 4; the ring's order of events and its casts; bf16."""
    groups = {4: dist.new_group([0, 1, 2, 3]), 2: [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]}
    out = {C: _attention_checks(groups[C]) for C in (2, 4)}
    out["events"] = _ring_event_order(groups[4])
    out["ops"] = _ring_op_counts(groups[4])
    out["bf16"] = _bf16_checks(groups[2])
    return out


def _attention_checks(group):
    import context_parallel as cp
    from model import causal_attention

    device = harness.device()
    C, c = dist.get_world_size(group), dist.get_rank(group)
    torch.manual_seed(0)  # the same whole-sequence tensors on every rank (drawn on the CPU: one generator)
    B, H, S, D = 2, 4, SEQ, 8
    q, k, v, dout = (torch.randn(B, H, S, D, dtype=torch.float64).to(device) for _ in range(4))
    ref_out, ref_lse, *ref_grads = _reference_attention(q, k, v, dout)
    ring = cp.Ring(group)
    errs = {}
    for impl in cp.IMPLS:
        for balance in cp.BALANCES:
            index = cp.positions(S, C, c, balance).to(device)
            ql, kl, vl = (t[:, :, index].clone().requires_grad_() for t in (q, k, v))
            attention = cp.ContextParallelAttention(causal_attention, ring, impl, balance)
            y = attention(ql, kl, vl, 0.0)
            y.backward(dout[:, :, index])
            with torch.no_grad():
                if impl == "ring":
                    _, lse = cp.ring_attention_forward(ql, kl, vl, ring, balance)
                else:  # Ulysses' lse: that of the head-split whole sequences, its heads sent back home
                    reorder = attention._reorder_for(S // C, q.device)
                    q_whole, k_whole, v_whole = (cp._seq_to_head(t, group, reorder) for t in (ql, kl, vl))
                    _, full_lse = cp._block_forward(q_whole * D ** -0.5, k_whole, v_whole, cp.causal_mask(S, device))
                    lse = cp._head_to_seq(full_lse.unsqueeze(-1), group, reorder).squeeze(-1)
            errs[impl, balance] = {
                "out": _max_err(y, ref_out[:, :, index]), "lse": _max_err(lse, ref_lse[:, :, index]),
                **{name: _max_err(t.grad, g[:, :, index]) for name, t, g in zip("qkv", (ql, kl, vl), ref_grads)}}
    return errs


class _RecordingObserver:
    """A ring observer that writes down what it is told (context_parallel.RingObserver's two methods)."""

    def __init__(self):
        self.told = []

    def begin(self, phase):
        self.told.append(f"begin {phase}")

    def end(self, phase):
        self.told.append(f"end {phase}")


def _ring_event_order(group):
    """The order of post / compute / wait in one forward and one backward: each block is computed while the
    next block's transfer is in flight (posted before, waited after); and what the ring's observer was told,
    the pass called as the model calls it (ContextParallelAttention)."""
    import context_parallel as cp

    events = []
    ring = cp.Ring(group)
    ring.observer = observer = _RecordingObserver()
    post, wait, forward, backward = ring.post, ring.wait, cp._block_forward, cp._block_backward
    ring.post = lambda *a, **k: (events.append("post"), post(*a, **k))[1]
    ring.wait = lambda *a, **k: (events.append("wait"), wait(*a, **k))[1]
    cp._block_forward = lambda *a: (events.append("compute"), forward(*a))[1]
    cp._block_backward = lambda *a: (events.append("compute"), backward(*a))[1]
    try:
        q, k, v = (torch.randn(1, 2, 8, 4, dtype=torch.float64, device=harness.device(), requires_grad=True)
                   for _ in range(3))
        y = cp.ContextParallelAttention(None, ring, "ring", "zigzag")(q, k, v, 0.0)
        forward_events, forward_told = list(events), list(observer.told)
        events.clear()
        observer.told.clear()
        y.sum().backward()
    finally:
        cp._block_forward, cp._block_backward = forward, backward
    return forward_events, events, forward_told, observer.told


class _CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the casts to float32 and the causal masks built (aten.triu) while it is on."""

    def __init__(self):
        super().__init__()
        self.casts, self.masks = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.float32:
            self.casts += 1
        if func in (torch.ops.aten.triu.default, torch.ops.aten.triu_.default):
            self.masks += 1
        return func(*args, **kwargs)


def _ring_op_counts(group):
    """Casts to the fp32 accumulator and masks built by one bf16 ring pass, forward and backward (zig-zag)."""
    import context_parallel as cp

    ring = cp.Ring(group)
    q, k, v, dout = (torch.randn(1, 2, 8, 4, device=harness.device()).to(torch.bfloat16) for _ in range(4))
    counts = {}
    with torch.no_grad():
        with _CountOps() as ops:
            out, lse = cp.ring_attention_forward(q, k, v, ring, "zigzag")
        counts["forward"] = (ops.casts, ops.masks)
        with _CountOps() as ops:
            cp.ring_attention_backward(dout, q, k, v, out, lse, ring, "zigzag")
        counts["backward"] = (ops.casts, ops.masks)
    return counts


def _bf16_bounds(q, k, v, dout):
    """Elementwise bounds on |ring − exact| for bf16 q, k, v, dO (exact: float64 on the same values).

    The ring computes in fp32 (slack FP32_SLACK·max|x|) and rounds each result to bf16 once: ≤ u·|x|, u = 2^-8.
    dq and dk also inherit the rounding of the saved bf16 output õ inside delta = rowsum(dO·õ): |Δdelta_i| ≤
    u·γ_i with γ_i = Σ_d |dO_id·o_id|, so ds_ij = p_ij·(dO_i·v_j − delta_i) moves by ≤ u·p_ij·γ_i, hence
    dq_i = Σ_j ds_ij·k_j/√d by ≤ u·γ_i·Σ_j p_ij·|k_j|/√d
    and dk_j = Σ_i ds_ij·q_i/√d by ≤ u·Σ_i p_ij·γ_i·|q_i|/√d.
    out and dv = pᵀ·dO have no delta: u·|x| and the slack."""
    q, k, v, dout = (t.double() for t in (q, k, v, dout))
    out, lse, dq, dk, dv = _reference_attention(q, k, v, dout)
    scale = q.shape[-1] ** -0.5
    future = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool, device=q.device).triu(1)
    p = torch.exp((q @ k.transpose(-2, -1) * scale).masked_fill(future, float("-inf")) - lse.unsqueeze(-1))
    gamma = (dout.abs() * out.abs()).sum(-1, keepdim=True)
    through_delta = {"dq": BF16_U * scale * gamma * (p @ k.abs()),
                     "dk": BF16_U * scale * (p.transpose(-2, -1) @ (gamma * q.abs()))}
    exact = {"out": out, "dq": dq, "dk": dk, "dv": dv}
    return exact, {name: BF16_U * x.abs() + through_delta.get(name, 0.0) + FP32_SLACK * x.abs().max()
                   for name, x in exact.items()}


def _bf16_checks(group):
    """C = 2 under bf16 autocast: ring and Ulysses attention (out, dq, dk, dv) from bf16 q, k, v, dO, next to
    the single device's attention (model.causal_attention) under the same autocast and the float64 exact
    values. Returns {variant: {name: (max |error| / bound against exact, max |error| against the single
    device)}}; "ring, fp32 accumulators in bf16" is the ring run with its accumulators (out, lse, the merge,
    dq, dK, dV) kept in bf16: the check must catch it."""
    import context_parallel as cp
    from model import causal_attention

    device = harness.device()
    C, c = dist.get_world_size(group), dist.get_rank(group)
    torch.manual_seed(1)
    B, H, S, D = 2, 4, 64, 16
    q, k, v, dout = (torch.randn(B, H, S, D).to(torch.bfloat16).to(device) for _ in range(4))
    q = (2 * q.float()).to(torch.bfloat16)  # sharper softmax rows: the merge's weights matter
    exact, bounds = _bf16_bounds(q, k, v, dout)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)

    def attend(fn, index):
        leaves = [t[:, :, index].clone().requires_grad_() for t in (q, k, v)]
        with autocast:
            y = fn(*leaves, 0.0)
        y.backward(dout[:, :, index])
        return {"out": y.detach(), **{f"d{n}": t.grad for n, t in zip("qkv", leaves)}}

    single = attend(causal_attention, slice(None))
    ring = cp.Ring(group)
    variants = [(impl, balance) for impl in cp.IMPLS for balance in cp.BALANCES]
    results = {}
    for impl, balance in variants + [("ring, fp32 accumulators in bf16", "zigzag")]:
        index = cp.positions(S, C, c, balance).to(device)
        wide = cp._wide
        if impl.startswith("ring,"):
            cp._wide = lambda dtype: dtype  # the broken ring: bf16 inputs, bf16 accumulators
        try:
            got = attend(cp.ContextParallelAttention(causal_attention, ring, impl.split(",")[0], balance), index)
        finally:
            cp._wide = wide
        results[impl, balance] = {
            name: (float(((x.double() - exact[name][:, :, index]).abs() / bounds[name][:, :, index]).max()),
                   float((x.double() - single[name][:, :, index].double()).abs().max()), str(x.dtype))
            for name, x in got.items()}
    return results


@pytest.fixture(scope="module")
def attention_ranks():
    """One 4-rank spawn for every attention-level check (each spawn costs seconds)."""
    return run_ranks(_attention, 4, timeout=180)


def test_attention_matches_full_causal_attention(attention_ranks):
    """Ring and Ulysses, zig-zag and contiguous, C = 2 and 4: out, lse, dq, dk, dv within 1e-10 in float64."""
    for result in attention_ranks:
        for C in (2, 4):
            assert len(result[C]) == 4  # ring and Ulysses, zig-zag and contiguous
            for variant, by_name in result[C].items():
                for name, err in by_name.items():
                    assert err < TOL, (C, variant, name, err)


def test_ring_posts_the_next_block_before_computing_this_one(attention_ranks):
    for result in attention_ranks:
        forward, backward, _, _ = result["events"]
        # C = 4: three steps of (post the next K,V; compute this block; wait), then the last block.
        assert forward == ["post", "compute", "wait"] * 3 + ["compute"]
        # backward: post K,V; compute; [wait for the dK,dV accumulator]; pass it on; wait for K,V ... and at
        # the end the accumulator's last hop home.
        step = lambda first, last: ([] if last else ["post"]) + ["compute"] + ([] if first else ["wait"]) \
            + ["post"] + ([] if last else ["wait"])
        assert backward == step(True, False) + step(False, False) * 2 + step(False, True) + ["wait"]


def test_ring_tells_its_observer_each_pass_and_each_wait(attention_ranks):
    """The ring keeps no clock: it tells its observer where each pass begins and ends and around each wait,
    and the observer (the accounting's observers.WaitClock in a run) does the timing."""
    for result in attention_ranks:
        forward, backward, forward_told, backward_told = result["events"]
        waited = ["begin wait", "end wait"]
        assert forward_told == ["begin forward"] + waited * forward.count("wait") + ["end forward"]
        assert backward_told == ["begin backward"] + waited * backward.count("wait") + ["end backward"]


def test_ring_casts_once_per_pass_and_hop_and_builds_one_mask(attention_ranks):
    """bf16 in, fp32 accumulators: q cast once per pass (and, in backward, dout and out once), each hop's
    arriving [K; V] block once (C = 4 hops); one causal mask per pass, for the diagonal block."""
    for result in attention_ranks:
        assert result["ops"] == {"forward": (1 + 4, 1), "backward": (3 + 4, 1)}, result["ops"]


def _bf16_results(attention_ranks, kind):
    """(impl, balance, name, error / bound against exact, error against the single device, dtype) of `kind`:
    "ring", "ulysses", or the broken ring (fp32 accumulators kept in bf16)."""
    rows = [(impl, balance, name, *values) for result in attention_ranks
            for (impl, balance), by_name in result["bf16"].items() for name, values in by_name.items()]
    chosen = [row for row in rows if (row[0] == kind if kind != "broken" else row[0].startswith("ring,"))]
    assert chosen and all(row[-1] == "torch.bfloat16" for row in chosen)  # results in the compute dtype
    return chosen


def test_bf16_ring_is_within_the_bf16_rounding_bound(attention_ranks):
    """C = 2, bf16 autocast, forward and backward: the ring (fp32 accumulators) is within `_bf16_bounds` of the
    exact float64 values, element by element: one bf16 rounding of each result (u = 2^-8), plus, for dq and dk,
    the bf16 output's rounding inside delta."""
    for impl, balance, name, error_over_bound, _, _ in _bf16_results(attention_ranks, "ring"):
        assert error_over_bound <= 1.0, (balance, name, error_over_bound)


def test_bf16_ulysses_equals_the_single_device_attention(attention_ranks):
    """Ulysses runs the single device's own attention on whole sequences of a/C heads: it equals
    model.causal_attention under the same autocast bitwise."""
    for impl, balance, name, _, vs_single, _ in _bf16_results(attention_ranks, "ulysses"):
        assert vs_single == 0.0, (balance, name, vs_single)


def test_bf16_bound_catches_a_ring_with_bf16_accumulators(attention_ranks):
    """A ring whose accumulators (the lse merge, dq, dK, dV) were bf16 breaks the bound many times over (out and
    dV by 100 and more): the bound can fail."""
    for impl, balance, name, error_over_bound, _, _ in _bf16_results(attention_ranks, "broken"):
        assert error_over_bound > 1.0, (name, error_over_bound)


# ---------------------------------------------------------------------------------------------------------
# The whole model
# ---------------------------------------------------------------------------------------------------------


def _run(mesh, config, device, autocast=None, micro=2, compute_dtype=torch.float64):
    """The slice of train.py's Run that context_parallel.apply reads (compute_dtype: autocast's, or the model's)."""
    return SimpleNamespace(mesh=mesh, config=config, seq_len=SEQ, micro_batch_size=micro, micro_batches=1,
                           device=device, autocast=autocast or nullcontext(), compute_dtype=compute_dtype)


def _model(rank, world, cp_size, tp_size, variants):
    """For each (impl, balance, sp, checkpointing, bf16) variant: gradient errors against the single device,
    and the traced cp-group messages next to the prediction."""
    from mesh import build_mesh, infer_mesh_shape

    mesh = build_mesh(infer_mesh_shape(world, tp=tp_size, cp=cp_size), rank)
    return {variant: _model_variant(mesh, tp_size, *variant) for variant in variants}


def _model_variant(mesh, tp_size, impl, balance, sp, checkpointing, bf16):
    import context_parallel as cp
    import tensor_parallel as tp
    from accounting.tracer import CommTracer
    from reference import build_model

    device = harness.device()
    config = make_config(activation_checkpointing=checkpointing)
    x, y = (t.to(device) for t in global_batches(1, 2, SEQ)[0])
    dtype = torch.float32 if bf16 else torch.float64
    reference = build_model(config, seed=0, dtype=dtype, device=device)
    _, ref_loss, ref_count = reference(x, y)
    (ref_loss / ref_count).backward()
    ref_grads = {p.shard_info.global_name: p.grad for p in reference.parameters()}

    model = build_model(config, seed=0, dtype=dtype, device=device)
    tp_handle = tp.parallelize(model, mesh.group("tp"), sequence_parallel=sp) if tp_size > 1 else None
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
    handle = cp.apply(model, _run(mesh, config, device, autocast, compute_dtype=torch.bfloat16 if bf16 else dtype),
                      cp.CPConfig(mesh.size("cp"), impl, balance))
    (x_local, y_local, pos), = handle.shard_batches([(x, y)])
    group = mesh.group("cp")
    count = (y_local != -1).sum().double()
    dist.all_reduce(count, group=group)  # the global token count: the loss's denominator on every rank
    tracer = CommTracer()
    tracer.name_group(group, "cp")
    tracer.name_group(mesh.group("tp"), "tp")
    with tracer:
        with autocast:
            _, loss_sum, _ = model(x_local, y_local, pos)
        (loss_sum / count).backward()
    traced = {key: (r.calls, r.payload_bytes) for key, r in tracer.records.items() if key[1] == "cp"}
    if tp_handle is not None:
        tp_handle.after_grad_sync(WholeGrads())  # SP: the replicated parameters' gradients summed over tp
    loss_sum = loss_sum.detach().double()
    dist.all_reduce(loss_sum, group=group)
    errs = {"loss": _max_err(loss_sum, ref_loss.double())}
    for p in model.parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad, group=group)  # what the layout's dp×cp reduction does
        errs[p.shard_info.global_name] = _max_err(grad, p.shard_info.shard_of(ref_grads[p.shard_info.global_name]))
    return errs, traced, dict(handle.predicted_messages())


RING_ZZ, RING_CONTIGUOUS = ("ring", "zigzag", False, False, False), ("ring", "contiguous", False, False, False)
ULYSSES_ZZ = ("ulysses", "zigzag", False, False, False)
ULYSSES_CONTIGUOUS = ("ulysses", "contiguous", False, False, False)
RING_CKPT, ULYSSES_CKPT = ("ring", "zigzag", False, True, False), ("ulysses", "zigzag", False, True, False)
RING_BF16, ULYSSES_BF16 = ("ring", "zigzag", False, False, True), ("ulysses", "zigzag", False, False, True)
RING_SP, ULYSSES_SP_CKPT = ("ring", "zigzag", True, False, False), ("ulysses", "zigzag", True, True, False)
MESHES = {  # (world, C, T, variants)
    "C2": (2, 2, 1, (RING_ZZ, RING_CONTIGUOUS, ULYSSES_ZZ, ULYSSES_CONTIGUOUS, RING_CKPT, ULYSSES_CKPT, RING_BF16,
                     ULYSSES_BF16)),
    "C4": (4, 4, 1, (RING_ZZ, RING_CONTIGUOUS, ULYSSES_ZZ, RING_CKPT)),
    "T2xC2": (4, 2, 2, (RING_ZZ, ULYSSES_ZZ, RING_SP, ULYSSES_SP_CKPT)),  # after tensor (and sequence) parallel
}


@pytest.fixture(scope="module", params=list(MESHES))
def model_ranks(request):
    """One spawn per mesh: [(rank's {variant: (errors, traced, predicted)}), ...] and the mesh's variants."""
    world, cp_size, tp_size, variants = MESHES[request.param]
    return run_ranks(_model, world, cp_size, tp_size, variants, timeout=180), variants


def test_model_gradients_match_single_device(model_ranks):
    """The loss and every gradient, summed over cp, equal the single device's on the whole batch (float64;
    the bf16 variants check the message sizes only: their numerics are the bf16 attention tests')."""
    ranks, variants = model_ranks
    for result in ranks:
        for variant in variants:
            errs, _, _ = result[variant]
            if not variant[-1]:
                for name, err in errs.items():
                    assert err < TOL, (variant, name, err)


def test_traced_cp_messages_equal_the_prediction(model_ranks):
    """Every cp message of one forward and backward, counted and sized, as predicted_messages says (L = 2,
    m = 1; bf16: 2-byte K,V and 4-byte dK,dV)."""
    ranks, variants = model_ranks
    for result in ranks:
        for variant in variants:
            _, traced, predicted = result[variant]
            assert traced == predicted, variant


# ---------------------------------------------------------------------------------------------------------
# Saved activations, block 0 measured at start-up, and the printouts
# ---------------------------------------------------------------------------------------------------------


def _composed_cp_run(rank, world, device):
    """train.compose on `--cp world`, as train.main composes a run (block 0 measured at start-up), in float64 on
    the test's model."""
    from dataclasses import replace

    from cli import flags
    import train
    from mesh import build_mesh

    config = make_config()
    args = flags.build_parser().parse_args(["--cp", str(world), "--global-batch", "2", "--micro-batch", "2",
                                            "--seq-len", str(SEQ), "--n-layer", str(config.n_layer), "--n-head",
                                            str(config.n_head), "--n-embd", str(config.n_embd)])
    settings = replace(flags.validate(args, world, axes=train.AXES), model=config)
    run = train.Run(settings=settings, mesh=build_mesh(settings.shape, rank), config=config, device=device, seed=0,
                    compute_dtype=torch.float64, param_dtype=torch.float64, master_dtype=torch.float64)
    return train.compose(run, measure=True)


def _activations(rank, world):
    """Block 0's saved bytes at C = 1 (a ring of one) and C = 2, same global sequence; then a composed run: what
    start-up measured, its cp lines, one training step and one evaluation pass, the end lines."""
    import context_parallel as cp
    import report.axes
    from mesh import build_mesh, infer_mesh_shape
    from accounting.memory import SavedActivations
    from reference import build_model
    from optim import DynamicLossScaler
    from step import train_step

    device = harness.device()
    singletons = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    mesh = build_mesh(infer_mesh_shape(world, cp=world), rank)
    config = make_config()
    torch.manual_seed(0)
    x = torch.randn(2, SEQ, config.n_embd, dtype=torch.float64).to(device)  # the same on every rank
    saved = {}
    for C, group in ((1, singletons[rank]), (world, mesh.group("cp"))):
        model = build_model(config, seed=0, dtype=torch.float64, device=device)
        cp.parallelize(model, group, "ring", "zigzag")
        local = x[:, cp.positions(SEQ, C, dist.get_rank(group)).to(device)].requires_grad_()
        with SavedActivations(exclude=model.parameters()) as block_saved:
            model.transformer.h[0](local)
        saved[C] = block_saved.bytes

    run = _composed_cp_run(rank, world, device)
    axis = next(a for a in run.axes if a.name == "cp")
    out = dict(saved=saved, measured=run.measured.on("cp"), measured_saved=run.measured.saved_bytes,
               layer_messages={(phase, op): count for phase, messages in axis.layer_messages().items()
                               for (op, _), count in messages.items()},
               phases_after_startup=dict(axis.observer.phases))
    out["startup"] = report.axes.cp_startup_lines(axis, run)
    batches = axis.shard_batches(rank_micro_batches(*global_batches(1, 2, SEQ)[0], dp_rank=0, dp_size=1, micro=2))
    train_step(run.layout, DynamicLossScaler(enabled=False), batches, run.mesh.group("dp_cp"), 0.0, run.autocast,
               device, model=run.model, schedule=run.schedule, axes=run.axes, data_size=run.mesh.size("dp"))
    run.schedule.forward_only(run.layout, run.model, batches, run.autocast, device)  # evaluation: not charged
    out["passes"] = {phase: stat.passes for phase, stat in axis.observer.phases.items()}
    out["end"] = report.axes.cp_end_lines(axis, run, 1)
    return out


@pytest.fixture(scope="module")
def activation_ranks():
    return run_ranks(_activations, 2, timeout=120)


def test_saved_activations_match_the_estimate(activation_ranks):
    config = make_config()
    b, s, h = 2, SEQ, config.n_embd
    for result in activation_ranks:
        for C, saved in result["saved"].items():
            estimate = 32 * (s // C) * b * h * 8 / 2  # Korthikanti's 34sbh less 2 mask bytes, 16-bit → float64
            assert abs(saved / estimate - 1) < ACTIVATION_TOL, (C, saved, estimate)


def test_saved_activations_halve_with_cp(activation_ranks):
    for result in activation_ranks:
        assert result["saved"][2] / result["saved"][1] == pytest.approx(0.5, abs=0.01)


def test_block_0_measured_at_startup_sends_what_layer_messages_predicts(activation_ranks):
    for result in activation_ranks:
        assert result["measured"] == result["layer_messages"]  # per phase and op, calls and bytes


def test_block_0_measured_at_startup_saves_what_the_block_saves(activation_ranks):
    for result in activation_ranks:
        assert result["measured_saved"] == result["saved"][2]


def test_startup_measurement_leaves_the_ring_clock_empty(activation_ranks):
    """measure.measure_block runs a copy of block 0: none of its passes is charged to the run's ring."""
    for result in activation_ranks:
        assert result["phases_after_startup"] == {}


def test_ring_clock_counts_the_training_passes_only(activation_ranks):
    """One training step at L = 2 layers and m = 1: 2 forward and 2 backward passes; the evaluation pass after
    it (under no_grad) is not counted (it would make 4 forward)."""
    for result in activation_ranks:
        assert result["passes"] == {"forward": 2, "backward": 2}


def test_startup_lines_show_the_layout_messages_work_and_activations(activation_ranks):
    text = "\n".join(activation_ranks[0]["startup"])
    for expected in ("context parallel C=2 (ring, zigzag): rank c holds chunks c and 2C−1−c of 2C (8 of s=16",
                     "forward  send               predicted 1 ×", "measured 1 ×", "backward recv               "
                     "predicted 3 ×", "per step (× L=2 × m=1)", "causal work per CP rank", "max/mean 1.000",
                     "(32sbh)/C", "measured (saved_tensors_hooks)", "ring transfers alone"):
        assert expected in text, expected


def test_end_lines_say_how_much_of_the_ring_compute_hid(activation_ranks):
    text = "\n".join(activation_ranks[0]["end"])
    for expected in ("the 1 training steps' passes, L=2 × m=1", "ring forward : 2 passes", "ring backward: 2 passes",
                     "hidden behind compute", "CPU cores busy while computing"):
        assert expected in text, expected
