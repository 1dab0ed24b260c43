"""moe.py: the router's losses by hand, capacity dropping, expert parallel against the single-device layer and
model (float64, 1e-10), traced all-to-all bytes against the prediction from the routed rows, flags and accounting.

Layer tests run the MoE layer on 4 ranks, each with its own rank-batch, with E = 2 and E = 4, dropless
and with capacity; the reference is the same single-device layer (all experts) run on each rank-batch in turn
(capacity is per rank-batch, as in the trainer), its gradients summed over the rank-batches. On the ranks the
router's gradient is summed over all ranks and an expert's over its expert_dp group, as the layouts will.
A third case spreads each micro-batch over two ranks (as CP or SP would) and checks that the aux losses are
those of the whole micro-batch and that the summed gradients are those of the design objective, once.

The whole-model test trains nothing: one step's forward/backward through step.GradientAccumulation on D = 4
ranks (m = 2 micro-batches each), E = 2 and E = 4, against the single-device model on the same objective
Σ CE/tokens + Σ coef·aux/(D·m) over the D·m micro-batches: gradients within 1e-10.

The rank bodies build on harness.device() (each rank's GPU under nccl); their inputs are drawn on the CPU, where
the single-device references draw the same ones, and moved there. Each spawn runs once per module (a fixture);
one test per property reads it, so a failure names the property.
"""

import math
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import harness
from harness import run_ranks
from reference import global_batches, make_config, rank_micro_batches

TOL = 1e-10
DT = torch.float64


# ---------------------------------------------------------------------------------------------------------
# Router and capacity, one process
# ---------------------------------------------------------------------------------------------------------


def _hand_routing(T=6, N=4):
    torch.manual_seed(0)
    logits = torch.randn(T, N, dtype=DT) * 2
    rows = logits.tolist()
    probs = [[math.exp(v) / sum(math.exp(u) for u in row) for v in row] for row in rows]
    return logits, rows, probs


def test_route_picks_the_top_k_and_renormalises_for_k_above_one():
    import moe

    logits, _, probs_hand = _hand_routing()
    for k in (1, 2, 3):
        _, gate, expert = moe.route(logits, k)
        chosen = [sorted(range(4), key=lambda i: -p[i])[:k] for p in probs_hand]
        assert expert.tolist() == chosen
        for t in range(len(chosen)):
            picked = [probs_hand[t][i] for i in chosen[t]]
            weights = picked if k == 1 else [v / sum(picked) for v in picked]  # Switch's raw gate for k = 1
            assert max(abs(a - b) for a, b in zip(gate[t].tolist(), weights)) < 1e-14


def test_router_losses_match_hand_computation():
    import moe

    logits, rows, probs_hand = _hand_routing()
    T, N = logits.shape
    for k in (1, 2, 3):
        probs, _, expert = moe.route(logits, k)
        chosen = [sorted(range(N), key=lambda i: -p[i])[:k] for p in probs_hand]
        balance, z, _ = moe.router_losses(logits, probs, torch.bincount(expert.reshape(-1), minlength=N), k)
        f = [sum(i in c for c in chosen) / (T * k) for i in range(N)]
        P = [sum(p[i] for p in probs_hand) / T for i in range(N)]
        lse = [math.log(sum(math.exp(v) for v in row)) for row in rows]
        assert abs(float(balance) - N * sum(a * b for a, b in zip(f, P))) < 1e-13
        assert abs(float(z) - sum(v * v for v in lse) / T) < 1e-13


def test_balanced_routing_has_balance_loss_one():
    import moe

    assert abs(float(moe.router_losses(torch.zeros(8, 4, dtype=DT), torch.full((8, 4), 0.25, dtype=DT),
                                       torch.full((4,), 4), 2)[0]) - 1.0) < 1e-15


def test_the_layer_adds_both_aux_terms_with_their_coefficients():
    import moe
    from reference import build_model

    config = make_config(n_layer=1, moe_experts=4, moe_topk=2, moe_aux_coef=0.25, moe_z_coef=0.125)
    model = build_model(config, seed=0, dtype=DT)
    layer = model.transformer.h[0].mlp
    x = torch.randn(2, 5, config.n_embd, dtype=DT)
    layer(x)
    logits = x.reshape(-1, config.n_embd) @ layer.router.weight.T
    probs, _, expert = moe.route(logits, 2)
    balance, z, _ = moe.router_losses(logits, probs, torch.bincount(expert.reshape(-1), minlength=4), 2)
    assert [(n, c) for n, c, _ in model.aux_losses.terms] == [("moe_balance", 0.25), ("moe_z", 0.125)]
    assert abs(float(model.aux_losses.terms[0][2].detach() - balance.detach())) < 1e-14
    assert abs(float(model.aux_losses.terms[1][2].detach() - z.detach())) < 1e-14


def test_capacity_is_the_ceiling_of_the_fair_share_times_f():
    from experts import router
    assert router.capacity(64, 2, 4, 1.25) == 40 and router.capacity(7, 2, 4, 1.0) == 4
    assert router.capacity(10, 2, 4, 0.0) is None


def test_capacity_keeps_each_experts_first_slots_in_token_order():
    import moe

    expert = torch.tensor([[0, 1], [2, 0], [1, 0], [0, 3], [2, 1], [1, 0]])
    keep = moe.capacity_keep(expert, 4, 2)
    # expert 0: tokens 0, 1 kept; 2, 3, 5 dropped. expert 1: tokens 0, 2 kept; 4, 5 dropped. 2: 1, 4. 3: 3.
    assert keep.tolist() == [[True, True], [True, True], [True, False], [False, True], [True, False],
                             [False, False]]
    assert moe.capacity_keep(expert, 4, None).all()


def test_a_dropped_slot_adds_nothing_and_is_counted():
    """Every token prefers expert 0 (top-1, C = ⌈8·1/4·1⌉ = 2): tokens 0 and 1 get expert 0's output times
    their gate, the 6 later ones nothing (their residual carries them); the layer's observer is told 6."""
    from accounting.observers import RoutedLoad
    from reference import build_model

    config = make_config(n_layer=1, moe_experts=4, moe_topk=1, moe_capacity_factor=1.0)
    model = build_model(config, seed=0, dtype=DT)
    layer = model.transformer.h[0].mlp
    layer.observer = routed = RoutedLoad()
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0, 0] = 10.0
    x = torch.randn(1, 8, config.n_embd, dtype=DT)
    x[..., 0] = 1.0
    y = layer(x)[0].detach()
    gate = torch.softmax(torch.tensor([10.0, 0, 0, 0], dtype=DT), 0)[0]
    assert float((y[:2] - gate * layer.experts["0"](x[0, :2]).detach()).abs().max()) < 1e-14
    assert float(y[2:].abs().max()) == 0.0
    assert routed.dropped == {0: 6} and routed.rows() == (1, 2, 2)


def test_the_layer_tells_its_observer_every_forward_and_the_load_counts_training_only():
    """The layer keeps no record: it tells its observer what each forward routed, whatever the pass (the
    forward and, under activation checkpointing, its recompute inside backward); observers.RoutedLoad, the
    accounting's observer, counts the training forward only."""
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    from accounting.observers import RoutedLoad
    from reference import build_model

    class Told:
        def __init__(self):
            self.calls = []

        def routed(self, layer, load, keep, sent, received):
            self.calls.append((layer.layer_id, int(load.sum()), keep, sent, received))

    model = build_model(make_config(n_layer=1, moe_experts=4, moe_topk=2), seed=0, dtype=DT)
    layer, told, routed = model.transformer.h[0].mlp, Told(), RoutedLoad()
    x = torch.randn(1, 8, model.config.n_embd, dtype=DT, requires_grad=True)
    for observer in (told, routed):
        layer.observer = observer
        with set_checkpoint_early_stop(False):  # the recompute runs the whole forward, its end included
            checkpoint(layer, x, use_reentrant=False).sum().backward()
    assert told.calls == [(0, 16, None, 16, 16)] * 2  # the forward, then its recompute in backward
    assert routed.rows() == (1, 16, 16) and int(routed.loads[0].sum()) == 16


def test_evaluation_and_sampling_forwards_record_no_routing():
    """Only a training forward records (the load line and the exact message prediction count training
    steps): not one under no_grad (evaluation, sampling), not one in eval mode (observers.RoutedLoad decides)."""
    from accounting.observers import RoutedLoad
    from reference import build_model

    model = build_model(make_config(n_layer=1, moe_experts=4, moe_topk=2), seed=0, dtype=DT)
    layer = model.transformer.h[0].mlp
    layer.observer = routed = RoutedLoad()
    x = torch.randn(1, 8, model.config.n_embd, dtype=DT)
    with torch.no_grad():
        layer(x)
    layer.eval()
    layer(x)
    assert routed.forwards == 0 and routed.loads == {}
    layer.train()
    layer(x)
    assert routed.forwards == 1 and int(routed.loads[0].sum()) == 16


# ---------------------------------------------------------------------------------------------------------
# Expert parallel against the single-device layer
# ---------------------------------------------------------------------------------------------------------

LAYER = dict(n_layer=1, n_head=2, n_embd=16, moe_experts=8, moe_topk=2, moe_aux_coef=0.3, moe_z_coef=0.05)
CAPACITIES = (0.0, 1.0)


def _layer_inputs(index, shape, h):
    generator = torch.Generator().manual_seed(100 + index)
    return (torch.randn(*shape, h, generator=generator, dtype=DT),
            torch.randn(*shape, h, generator=generator, dtype=DT))


def _reduce_grads(model, mesh):
    """Router (and dense) gradients summed over dp×cp, experts' over expert_dp: what the layouts do."""
    out = {}
    for p in model.parameters():
        if p.grad is None:
            continue
        group = mesh.group(p.shard_info.grad_group)
        dist.all_reduce(p.grad, group=group)
        out[p.shard_info.global_name] = p.grad.clone()
    return out


def _skew(layer, x):
    """Make experts 0-3 lose to 4-7 for every token: under E = 2, rank 0 of each ep group receives nothing."""
    with torch.no_grad():
        layer.router.weight[:4, 0] = -30.0
        x[..., 0] = 1.0


def _layer(rank, world):
    from experts import dispatch
    import moe
    from mesh import MeshShape, build_mesh
    from accounting.tracer import CommTracer
    from accounting.observers import RoutedLoad
    from reference import build_model

    device = harness.device()
    results = {}
    meshes = {ep: build_mesh(MeshShape(dp=world, ep=ep)) for ep in (2, 4)}
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # ranks holding pieces of one micro-batch
    for ep, factor, mode in LAYER_CASES:
        mesh = meshes[ep]
        model = build_model(make_config(**LAYER, moe_capacity_factor=factor), seed=0, dtype=DT, device=device)
        layer = model.transformer.h[0].mlp
        moe.shard_experts(layer, mesh.group("ep"), ep, mesh.index("ep"))
        layer.observer = routed = RoutedLoad()
        if mode == "pieces":  # micro-batch rank // 2, its sequence cut in two: this rank holds half rank % 2
            layer.pieces = (moe.Pieces(pairs[rank // 2], 2, rank % 2),)
            x, g = (t.chunk(2, dim=1)[rank % 2].to(device) for t in _layer_inputs(rank // 2, (2, 12), 16))
        else:
            x, g = (t.to(device) for t in _layer_inputs(rank, (2, 12), 16))
        if mode == "skew":
            _skew(layer, x)
        x.requires_grad_()
        tracer = CommTracer()
        tracer.name_group(mesh.group("ep"), "ep")
        model.aux_losses.clear()
        with tracer:
            with _ExpertInputs(layer) as inputs:  # the forward's (split's backward is a cat)
                y = layer(x)
            ((y * g).sum() + model.aux_losses.weighted_sum()).backward()
        traced = tracer.records[("all_to_all_single", "ep")]
        results[(ep, factor, mode)] = dict(
            y=y.detach(), dx=x.grad, grads=_reduce_grads(model, mesh), aux=model.aux_losses.values(),
            local=sorted(layer.experts.keys(), key=int), dropped=routed.dropped.get(0, 0),
            traced=(traced.calls, traced.payload_bytes),
            counted=tuple(dispatch.all_to_all_messages(dispatch.Traffic(
                model.config, ep=ep, compute_bytes=8, router_bytes=8), *routed.rows())[dispatch.ALL_TO_ALL]),
            expert_inputs=inputs.storages, cats=inputs.cats)
    # Under bf16 autocast (float32 model): the router still computes in fp32, the rows travel in bf16.
    model = build_model(make_config(**LAYER), seed=0, device=device)
    layer = model.transformer.h[0].mlp
    moe.shard_experts(layer, meshes[2].group("ep"), 2, meshes[2].index("ep"))
    x = _layer_inputs(rank, (2, 12), 16)[0].float().to(device).requires_grad_()
    tracer = CommTracer()
    tracer.name_group(meshes[2].group("ep"), "ep")
    with tracer, torch.autocast(device.type, dtype=torch.bfloat16):
        y = layer(x)
        y.float().sum().backward()
        router_dtype = layer.router(x).dtype
    results["bf16"] = dict(router=router_dtype, traced=tracer.records[("all_to_all_single", "ep")].payload_bytes,
                           finite=bool(torch.isfinite(layer.router.weight.grad).all()),
                           rows=(sum(layer.exchanged.sent), sum(layer.exchanged.received)))
    return results


class _ExpertInputs:
    """Within the `with`: the storages the experts of `layer` read their rows from, and the torch.cat calls
    on rows in its forward (the copies of token rows besides the one sort; the router's 1-D statistics aside)."""

    def __init__(self, layer):
        self.layer, self.storages, self.cats = layer, set(), 0
        self.width = layer.router.weight.shape[1]  # h: a row of tokens
        outer = self

        class Cats(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if str(func).startswith("aten.cat"):  # of rows [., h]: not statistics, counts or metadata
                    outer.cats += args[0][0].dim() == 2 and args[0][0].shape[-1] == outer.width
                return func(*args, **(kwargs or {}))

        self.mode = Cats()

    def _seen(self, module, args):
        self.storages.add(args[0].untyped_storage().data_ptr())

    def __enter__(self):
        self.hooks = [expert.c_fc.register_forward_pre_hook(self._seen) for expert in self.layer.experts.values()]
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        for hook in self.hooks:
            hook.remove()


def test_experts_run_in_the_sorted_buffer_and_write_one_output():
    """E = 1: every expert reads its rows from the one buffer the sort made (views), and the forward
    concatenates once (the experts' outputs): no copy of the tokens per expert."""
    from reference import build_model

    for factor in CAPACITIES:
        model = build_model(make_config(**LAYER, moe_capacity_factor=factor), seed=0, dtype=DT)
        layer = model.transformer.h[0].mlp
        x = _layer_inputs(0, (2, 12), 16)[0]
        with _ExpertInputs(layer) as inputs:
            layer(x)
        assert len(inputs.storages) == 1 and inputs.cats == 1, (factor, inputs.storages, inputs.cats)


def _layer_reference(factor, inputs, skew=False):
    """The single-device layer on each input in turn: outputs, input grads, aux values; grads summed."""
    from reference import build_model

    model = build_model(make_config(**LAYER, moe_capacity_factor=factor), seed=0, dtype=DT)
    layer = model.transformer.h[0].mlp
    outs = []
    for x, g in inputs:
        x = x.clone()
        if skew:
            _skew(layer, x)
        x.requires_grad_()
        model.aux_losses.clear()
        y = layer(x)
        ((y * g).sum() + model.aux_losses.weighted_sum()).backward()
        outs.append((y.detach(), x.grad, model.aux_losses.values()))
    return outs, {f"transformer.h.0.mlp.{n}": p.grad for n, p in layer.named_parameters()}


def _err(a, b):
    return float((a - b).abs().max())


# (E, capacity factor, mode): "ranks": each rank its own rank-batch; "pieces": each micro-batch cut in two
# along the sequence over ranks (0, 1) and (2, 3), as CP/SP do; "skew": rank 0 of each ep group gets no rows.
LAYER_CASES = [(ep, f, "ranks") for ep in (2, 4) for f in CAPACITIES] + [(4, 0.0, "pieces"), (2, 1.0, "pieces"),
                                                                          (2, 0.0, "skew")]


@pytest.fixture(scope="module")
def layer_runs():
    """The 4-rank layer runs of every LAYER_CASES case, beside the single-device reference of each:
    [(case, rank, what the rank got, (y, dx, aux) expected, summed reference grads)], and the bf16 results."""
    results = run_ranks(_layer, 4, timeout=120)
    rows = []
    for ep, factor, mode in LAYER_CASES:
        if mode == "pieces":
            ref, ref_grads = _layer_reference(factor, [_layer_inputs(i, (2, 12), 16) for i in range(2)])
        else:
            ref, ref_grads = _layer_reference(factor, [_layer_inputs(r, (2, 12), 16) for r in range(4)],
                                              skew=mode == "skew")
        for rank, by_case in enumerate(results):
            y, dx, aux = ref[rank // 2] if mode == "pieces" else ref[rank]
            if mode == "pieces":
                y, dx = y.chunk(2, dim=1)[rank % 2], dx.chunk(2, dim=1)[rank % 2]
            rows.append(((ep, factor, mode, rank), by_case[(ep, factor, mode)], (y, dx, aux), ref_grads))
    return rows, [r["bf16"] for r in results]


def test_expert_parallel_layer_outputs_and_input_grads_equal_single_device(layer_runs):
    for case, got, (y, dx, _), _ in layer_runs[0]:
        assert _err(got["y"], y) < TOL, case
        assert _err(got["dx"], dx) < TOL, case


def test_aux_losses_are_the_whole_micro_batchs_on_every_piece(layer_runs):
    for case, got, (_, _, aux), _ in layer_runs[0]:
        for name in aux:  # under pieces: the WHOLE micro-batch's value on both halves
            assert abs(got["aux"][name] - aux[name]) < TOL, (case, name)


def test_each_rank_holds_experts_of_its_ep_index_and_their_gradients_only(layer_runs):
    for (ep, factor, mode, rank), got, _, ref_grads in layer_runs[0]:
        mine = range((rank % ep) * (8 // ep), (rank % ep + 1) * (8 // ep))
        assert got["local"] == [str(i) for i in mine], (ep, mode, rank)
        assert set(got["grads"]) == {n for n in ref_grads if ".experts." not in n or int(n.split(".")[5]) in mine}


def test_expert_parallel_layer_gradients_equal_single_device(layer_runs):
    for case, got, _, ref_grads in layer_runs[0]:
        for name, grad in got["grads"].items():
            assert _err(grad, ref_grads[name]) < TOL, (case, name)


def test_traced_all_to_alls_equal_the_prediction_from_the_routed_rows(layer_runs):
    """7 calls (counts, rows, metadata, combine and the 3 reverses), bytes from the routing record's S and R."""
    for case, got, _, _ in layer_runs[0]:
        assert got["traced"] == got["counted"], case
        assert got["traced"][0] == 7, case


def test_experts_read_the_received_buffer_and_write_one_output_under_ep(layer_runs):
    for case, got, _, _ in layer_runs[0]:
        assert len(got["expert_inputs"]) == 1 and got["cats"] == 1, case


def test_capacity_drops_slots_under_expert_parallel(layer_runs):
    for (ep, factor, mode, rank), got, _, _ in layer_runs[0]:
        if factor > 0:
            assert got["dropped"] > 0, (ep, mode, rank)


def test_a_rank_whose_experts_nobody_picks_receives_nothing(layer_runs):
    """Skew: nothing comes in on rank 0 of each ep group: 8(N + E) of counts, S = T rows out (both slots of each
    token lie on rank 1: one copy) with their metadata (2k gates and indices) forward, the rows' gradients back
    in backward; its experts' gradients are zero."""
    for (ep, factor, mode, rank), got, _, _ in layer_runs[0]:
        if mode == "skew" and rank % ep == 0:
            assert got["traced"][1] == 8 * (8 + 2) + 2 * 12 * (2 * 16 + 4) * 8, got["traced"]
            assert all(float(grad.abs().max()) == 0 for name, grad in got["grads"].items() if ".experts." in name)


def test_under_bf16_autocast_the_router_is_fp32_and_the_rows_travel_in_bf16(layer_runs):
    """Per rank the payload = 8(N + E) + (S + R)·(2·h·2 + 2k·4) bytes: the rows in bf16 (twice: forward and
    backward), the metadata (k gates, k indices) in the router's fp32."""
    bf16 = layer_runs[1]
    assert all(r["router"] == torch.float32 and r["finite"] for r in bf16)
    for r in bf16:
        assert r["traced"] == 8 * (8 + 2) + sum(r["rows"]) * (2 * 16 * 2 + 4 * 4), r


# ---------------------------------------------------------------------------------------------------------
# The whole model: D = 4, each rank its own data, against the single-device objective
# ---------------------------------------------------------------------------------------------------------

D, M, SEQ = 4, 2, 16
MODEL_CASES = {  # E: config overrides
    2: dict(n_layer=2, moe_experts=4, moe_topk=2, moe_every=1, moe_aux_coef=0.1, moe_z_coef=0.01,
            activation_checkpointing=True),
    4: dict(n_layer=3, moe_experts=4, moe_topk=2, moe_every=2, moe_capacity_factor=1.0, moe_aux_coef=0.1,
            moe_z_coef=0.01),
}


def _model(rank, world):
    from experts import dispatch
    import moe
    import report.axes
    from mesh import MeshShape, build_mesh
    from accounting.tracer import CommTracer
    from reference import build_model
    from step import GradientAccumulation

    device = harness.device()
    (x, y), = global_batches(1, D * M, SEQ)  # on the CPU: forward_backward moves each micro-batch
    global_tokens = (y != -1).sum().to(device, DT)
    results = {}
    for ep, overrides in MODEL_CASES.items():
        config = make_config(**overrides)
        mesh = build_mesh(MeshShape(dp=world, ep=ep))
        model = build_model(config, seed=0, dtype=DT, device=device)
        run = SimpleNamespace(mesh=mesh, config=config, seq_len=SEQ, micro_batch_size=1, micro_batches=M,
                              device=device, autocast=nullcontext(), compute_dtype=DT, seed=0, model=model, layout=None,
                              settings=SimpleNamespace(args=SimpleNamespace()))  # no --fp8, no recipe
        handle = moe.apply(model, run, moe.MoEConfig(ep))
        report.axes.observe(handle)  # as train.compose does: the routed load the lines and the end table read
        startup = report.axes.axis_lines(handle, "startup", run)
        layout = _Layout(model)
        tracer = CommTracer()
        tracer.name_group(mesh.group("ep"), "ep")
        with tracer:
            micro = GradientAccumulation().forward_backward(layout, model, rank_micro_batches(x, y, rank, D, 1),
                                                            global_tokens, 1.0, D * M, nullcontext(), run.device)
        traced = tracer.records[("all_to_all_single", "ep")]
        results[ep] = dict(grads=_reduce_grads(model, mesh), aux=micro.aux, traced=(traced.calls, traced.payload_bytes),
                           counted=tuple(handle.traced_prediction(None, 1)[dispatch.ALL_TO_ALL]),
                           uniform=handle.predicted_messages()[dispatch.ALL_TO_ALL],
                           lines=[*startup, *report.axes.axis_lines(handle, "step", run),
                                  *report.axes.axis_lines(handle, "end", run, 1)])
    return results


class _Layout:
    """The smallest layout step.GradientAccumulation needs: the forward and a no_sync context."""

    def __init__(self, model):
        self.model = model

    def __call__(self, x, y, pos=None):
        return self.model(x, y, pos)

    def no_sync(self):
        return nullcontext()


@pytest.fixture(scope="module")
def model_runs():
    """What each of the D ranks got for each E of MODEL_CASES, beside the single-device model's gradients and
    aux values of the D·m micro-batches: {E: (per-rank results, reference grads, aux per micro-batch)}."""
    from reference import build_model

    results = run_ranks(_model, D, timeout=120)
    (x, y), = global_batches(1, D * M, SEQ)
    global_tokens = (y != -1).sum().to(DT)
    out = {}
    for ep, overrides in MODEL_CASES.items():
        model = build_model(make_config(**overrides), seed=0, dtype=DT)
        aux_totals = []
        for i in range(D * M):  # the D·m micro-batches, in the trainer's order (rank d: d·m .. d·m + m - 1)
            _, loss_sum, _ = model(x[i:i + 1], y[i:i + 1])
            aux_totals.append(model.aux_losses.values())  # before backward: a recompute adds the terms again
            (loss_sum / global_tokens + model.aux_losses.weighted_sum() / (D * M)).backward()
        out[ep] = ([r[ep] for r in results], {p.shard_info.global_name: p.grad for p in model.parameters()}, aux_totals)
    return out


def test_expert_parallel_model_gradients_equal_single_device(model_runs):
    for ep, (per_rank, ref, _) in model_runs.items():
        for rank, got in enumerate(per_rank):
            held = {n for n in ref if ".experts." not in n or int(n.split(".")[5]) // (4 // ep) == rank % ep}
            assert set(got["grads"]) == held, (ep, rank)
            for name, grad in got["grads"].items():
                assert _err(grad, ref[name]) < TOL, (ep, rank, name, _err(grad, ref[name]))


def test_expert_parallel_model_aux_losses_are_each_ranks_micro_batches(model_runs):
    for ep, (per_rank, _, aux_totals) in model_runs.items():
        for rank, got in enumerate(per_rank):
            for name in got["aux"]:  # Σ over this rank's micro-batches
                expected = sum(a[name] for a in aux_totals[rank * M:(rank + 1) * M])
                assert abs(got["aux"][name] - expected) < TOL, (ep, rank, name)


def test_traced_all_to_alls_of_a_step_equal_the_handles_exact_prediction(model_runs):
    """With activation checkpointing (E = 2: recomputes repeat the forward's 3 calls) and capacity (E = 4)."""
    for ep, (per_rank, _, _) in model_runs.items():
        for rank, got in enumerate(per_rank):
            assert got["traced"] == pytest.approx(got["counted"], abs=1e-9), (ep, rank, got["traced"], got["counted"])


def test_the_uniform_estimate_has_the_traced_calls(model_runs):
    for ep, (per_rank, _, _) in model_runs.items():
        for rank, got in enumerate(per_rank):
            assert got["uniform"][0] == got["traced"][0], (ep, rank)  # calls do not depend on routing, bytes do


def test_report_prints_the_moe_lines(model_runs):
    for ep, (per_rank, _, _) in model_runs.items():
        lines = per_rank[0]["lines"]
        print(f"\nE={ep} rank 0:\n" + "\n".join(lines))
        assert lines[0].startswith("moe: N=4 experts, top-2"), lines
        assert any("all_to_all_single per MoE layer and micro-batch" in l for l in lines), lines
        assert any(l.startswith("moe load over this step") for l in lines), lines
        assert any(l.startswith("moe all_to_all_single (group ep) per MoE layer and step") for l in lines), lines
        moe_layers = {2: 2, 4: 1}[ep]  # E = 2: both blocks; E = 4: every second of 3
        assert sum(l.startswith("moe load over the last 1 step, h.") for l in lines) == moe_layers, lines


# ---------------------------------------------------------------------------------------------------------
# Flags and accounting
# ---------------------------------------------------------------------------------------------------------


def _check(experts=4, topk=2, ep=1, dp=1, cp=1, **overrides):
    import moe
    from mesh import MeshShape

    config = make_config(moe_experts=experts, moe_topk=topk, **overrides)
    return moe.check_flags(config, MeshShape(dp=dp, cp=cp, ep=ep))


@pytest.mark.parametrize("kwargs, flag", [
    (dict(experts=8, topk=2, ep=3, dp=6), "--ep 3 must divide --moe-experts 8"),
    (dict(experts=8, topk=2, ep=8, dp=4), "--ep 8 must divide the data × context ranks"),
    (dict(experts=8, topk=2, ep=4, dp=2, cp=1), "D·C = 2·1 = 2"),
    (dict(experts=4, topk=5), "--moe-topk 5"),
    (dict(experts=4, topk=0), "--moe-topk 0"),
    (dict(experts=0, ep=2, dp=2), "--ep 2 needs experts"),
    (dict(experts=4, moe_every=3, n_layer=2), "--moe-every 3"),
])
def test_check_flags_names_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag.replace("(", r"\(").replace("·", ".").replace("×", ".")):
        _check(**kwargs)


@pytest.mark.parametrize("flags, message", [
    (["--moe-experts", "-1"], "--moe-experts must be at least 0"),
    (["--moe-experts", "4", "--moe-capacity-factor", "-1"], "--moe-capacity-factor must be at least 0"),
    (["--moe-experts", "4", "--moe-aux-coef", "-0.1"], "--moe-aux-coef must be at least 0"),
    (["--moe-experts", "4", "--moe-topk", "0"], "--moe-topk must be at least 1"),
])
def test_a_moe_flag_out_of_its_range_fails_once_in_flags_validate(flags, message):
    """Each flag's own range is flags.check_ranges' (once, for every flag alike), not check_flags'."""
    from cli import flags as flags_lib
    import train

    with pytest.raises(flags_lib.FlagError, match=message):
        flags_lib.validate(flags_lib.build_parser().parse_args(flags), 1, axes=train.AXES)


def test_check_flags_accepts_ep_inside_data_times_context():
    _check(8, 2, ep=4, dp=2, cp=2)  # E carved from D·C = 4
    _check(0, 2, ep=1)  # dense


ACCOUNTING_CONFIGS = (dict(moe_experts=4, moe_topk=2), dict(moe_experts=8, moe_topk=1, moe_every=2, n_layer=3),
                      dict(moe_experts=4, moe_topk=2, bias=False))


@pytest.mark.parametrize("overrides", ACCOUNTING_CONFIGS)
def test_param_counts_match_the_model(overrides):
    from accounting import memory
    from reference import build_model

    config = make_config(**overrides)
    model = build_model(config, seed=0)
    counts = memory.param_counts(config)
    assert counts["total"] == model.num_params()
    expert = sum(p.numel() for p in model.transformer.h[config.moe.every - 1].mlp.experts["0"].parameters())
    assert counts["expert"] == expert
    idle = counts["moe_layers"] * (config.moe.experts - config.moe.topk) * expert
    assert counts["active"] == counts["total"] - idle


@pytest.mark.parametrize("overrides", ACCOUNTING_CONFIGS)
def test_flops_count_the_matmul_weights_a_token_touches(overrides):
    """The head (tied), attention, k experts' and the router's: not the N − k idle experts."""
    from accounting import memory
    import mfu
    from reference import build_model

    config = make_config(**overrides)
    model = build_model(config, seed=0)
    moe_block = model.transformer.h[config.moe.every - 1].mlp
    counts = memory.param_counts(config)
    matmul = config.vocab_size * config.n_embd + sum(
        p.numel() for name, p in model.named_parameters() if name.endswith("weight") and p.dim() == 2
        and ".h." in name and ".experts." not in name) + counts["moe_layers"] * config.moe.topk * sum(
        p.numel() for name, p in moe_block.experts["0"].named_parameters() if name.endswith("weight"))
    assert counts["active_matmul"] == matmul
    assert counts["block_matmul"] == matmul - config.vocab_size * config.n_embd  # what a recompute repeats
    flops = mfu.flops_per_token(counts, config, 64)
    assert flops.model == 6 * matmul + 12 * config.n_layer * config.n_embd * 64


def test_the_load_histogram_scales_to_the_largest():
    import report.axes
    assert report.axes.moe_histogram([0, 1, 4, 8]) == " ▁▄█"


def test_uniform_step_messages():
    """7 all-to-alls per MoE layer and micro-batch (counts 8(N + E); rows out and back, forward and backward,
    4·S·h·e_c; metadata forward and its gradient backward, 2·S·2k·e_r), S = T·ρ, ρ = 2·(1 − C(2,2)/C(4,2)) = 5/3
    ranks a token reaches (N = 4 on E = 2, k = 2); checkpointing +4 calls; CP's statistics all-reduce (2N + 2
    fp32 values) once per forward."""
    from experts import dispatch
    traffic = dispatch.Traffic(make_config(moe_experts=4, moe_topk=2), moe_layers=2, tokens=32, micro_batches=3,
                               ep=2)
    rows = 32 * 5 / 3
    one = 8 * (4 + 2) + 4 * rows * 32 * 2 + 2 * rows * 4 * 4
    got = dispatch.step_messages(traffic)[("all_to_all_single", "ep")]
    assert got[0] == 2 * 3 * 7 and got[1] == pytest.approx(2 * 3 * one, rel=1e-12)
    traffic = dispatch.Traffic(make_config(moe_experts=4, moe_topk=2, activation_checkpointing=True), tokens=32,
                               ep=2, cp=2)
    msgs = dispatch.step_messages(traffic)
    checkpointed = 2 * 8 * (4 + 2) + 6 * rows * 32 * 2 + 3 * rows * 4 * 4
    assert msgs[("all_to_all_single", "ep")][0] == 11
    assert msgs[("all_to_all_single", "ep")][1] == pytest.approx(checkpointed, rel=1e-12)
    assert msgs[("all_reduce", "cp")] == (2, 2 * 10 * 4)


# ---------------------------------------------------------------------------------------------------------
# Capacity on the whole micro-batch under CP and SP (trained through train.py's composition)
# ---------------------------------------------------------------------------------------------------------

# (flags, config overrides, global batch, B_μ), as tests/test_composition.py: 3 steps in float64 against the
# single-device model, losses and parameters within 1e-10. Capacity f < 1 drops slots in every micro-batch;
# which ones depends on the whole micro-batch's token order, so a rank deciding on its piece trains another model.
CAPACITY_4 = [
    (["--moe-experts", "4", "--ep", "2", "--cp", "2", "--moe-capacity-factor", "0.75"], {}, 4, 1),  # zig-zag
    (["--moe-experts", "4", "--ep", "2", "--tp", "2", "--sp", "--moe-capacity-factor", "0.75"], {}, 4, 2),
    (["--moe-experts", "4", "--cp", "2", "--cp-balance", "contiguous", "--tp", "2", "--sp",  # both: D = 1
      "--moe-capacity-factor", "0.75", "--moe-topk", "1"], {}, 2, 2),
]


def test_capacity_is_decided_on_the_whole_micro_batch_under_cp_and_sp():
    import test_composition

    results = run_ranks(test_composition._cases, 4, CAPACITY_4, timeout=600)
    for index, case in enumerate(CAPACITY_4):
        test_composition._check([rank_results[index] for rank_results in results], *case)


# ---------------------------------------------------------------------------------------------------------
# Host synchronisations of one training step
# ---------------------------------------------------------------------------------------------------------


class HostSyncs:
    """Counts what would make the host wait for the GPU: a tensor's value read on the host (`.item()`,
    `.tolist()`, float/int/bool/index of a tensor, `.cpu()`, `.numpy()`), and the ops whose output size
    depends on the values (nonzero, bincount, masked_select, unique, boolean-mask indexing). On this torch
    neither a TorchFunctionMode nor a TorchDispatchMode sees a checkpointed block's recompute in backward (the
    autograd engine runs it outside the modes), and a TorchDispatchMode does not see `.tolist()` or `.cpu()` of
    a CPU tensor: so the value reads are counted by wrapping those torch.Tensor methods (seen everywhere),
    the value-dependent ops by a TorchDispatchMode (seen also inside other ops, not in a recompute).
    `paused` stops counting."""

    READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy")
    ATEN = ("aten.nonzero", "aten.bincount", "aten.masked_select", "aten._unique", "aten.unique",
            "aten.repeat_interleave.Tensor")

    def __init__(self):
        self.seen, self.paused = [], False
        counter = self

        class Aten(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = str(func)
                masked = name.startswith("aten.index") and any(
                    isinstance(i, torch.Tensor) and i.dtype == torch.bool for a in args if isinstance(a, (list, tuple))
                    for i in a)
                if (name.startswith(HostSyncs.ATEN) or masked) and not counter.paused:
                    counter.seen.append(name)
                return func(*args, **(kwargs or {}))

        self.mode = Aten()

    def _wrap(self, name, method):
        def read(*args, **kwargs):
            if not self.paused:
                self.seen.append(name)
            return method(*args, **kwargs)
        return read

    def __enter__(self):
        self.methods = {name: getattr(torch.Tensor, name) for name in self.READS}
        for name, method in self.methods.items():
            setattr(torch.Tensor, name, self._wrap(name, method))
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        for name, method in self.methods.items():
            setattr(torch.Tensor, name, method)


def _composed(rank, world, flags, config_kw, global_batch, micro):
    """The run train.main builds from `flags` (test_composition.composed_run), in float64 on harness.device()."""
    import test_composition

    assert test_composition.SEQ == SEQ
    return test_composition.composed_run(rank, world, flags, config_kw, global_batch, micro, harness.device())


# (flags, config overrides): D = 2 ranks, m = 2 micro-batches of B_μ = 1, both blocks MoE.
SYNC_CASES = [
    (["--moe-experts", "4", "--ep", "2", "--moe-capacity-factor", "1.0"], {}),  # E = 2, capacity
    (["--moe-experts", "4", "--ep", "2"], dict(activation_checkpointing=True)),  # dropless, recomputed
    (["--moe-experts", "4", "--moe-capacity-factor", "1.0"], {}),  # E = 1
    (["--moe-experts", "4"], {}),  # E = 1, dropless
    ([], {}),  # dense
]


def _host_syncs(rank, world):
    import report.axes
    from optim import DynamicLossScaler
    from step import train_step

    out = []
    for flags, config_kw in SYNC_CASES:
        run = _composed(rank, world, flags, config_kw, 4, 1)
        moe_axis = next((axis for axis in run.axes if axis.name == "moe"), None)
        step = run.layout.step

        def update(*args, **kwargs):  # the update's own (optim.update: one) is not what is counted here
            counter.paused = True
            try:
                return step(*args, **kwargs)
            finally:
                counter.paused = False

        run.layout.step = update
        counts = []
        for index, (x, y) in enumerate(global_batches(2, 4, SEQ)):
            batches = [(*b, None) for b in rank_micro_batches(x, y, run.mesh.index("dp"), run.mesh.size("dp"), 1)]
            with HostSyncs() as counter:
                outcome = train_step(run.layout, DynamicLossScaler(enabled=False), batches, run.mesh.group("dp_cp"),
                                     1.0, nullcontext(), run.device, model=run.model, axes=run.axes,
                                     data_size=run.mesh.size("dp"))
            with HostSyncs() as lines:
                text = report.axes.axis_lines(moe_axis, "step", run) if moe_axis is not None and index == 1 else []
            counts.append((list(counter.seen), list(lines.seen), text))
        out.append(dict(counts=counts, aux=outcome.aux, loss=outcome.loss))
    return out


@pytest.fixture(scope="module")
def host_sync_runs():
    return run_ranks(_host_syncs, 2, timeout=300)


def test_one_host_sync_per_moe_layer_and_micro_batch(host_sync_runs):
    """The counts moe.py's docstring states (item 3): per MoE layer and micro-batch one `.tolist()` (the split
    sizes: under EP the all-to-all's, with E = 1 the experts' row slicing), repeated by a recompute; and the
    step reads its logged loss and aux values in one `.tolist()`."""
    for rank, by_case in enumerate(host_sync_runs):
        for (flags, config_kw), got in zip(SYNC_CASES, by_case):
            moe_forwards = (2 if config_kw.get("activation_checkpointing") else 1) * 2 * 2 if flags else 0
            for step, (syncs, _, _) in enumerate(got["counts"]):
                assert syncs == ["tolist"] * (moe_forwards + 1), ((flags, config_kw, rank, step), syncs)


def test_the_load_line_reads_the_device_once_and_spans_the_steps_since_the_last(host_sync_runs):
    """Read at step 1 only: one `.tolist()`, covering steps 0 and 1 (and saying so), dropless or not."""
    for rank, by_case in enumerate(host_sync_runs):
        for (flags, config_kw), got in zip(SYNC_CASES, by_case):
            _, line_syncs, text = got["counts"][1]
            if flags:
                assert line_syncs == ["tolist"], (flags, rank, line_syncs)
                assert "moe load over the 2 steps since the previous line" in text[0], text
                assert ("dropless" in text[0]) == ("--moe-capacity-factor" not in flags), text


def test_the_step_logs_floats_and_the_moe_aux_terms(host_sync_runs):
    for by_case in host_sync_runs:
        for (flags, _), got in zip(SYNC_CASES, by_case):
            assert isinstance(got["loss"], float) and all(isinstance(v, float) for v in got["aux"].values())
            assert sorted(got["aux"]) == (["moe_balance", "moe_z"] if flags else [])


def _traced_and_sampled(rank, world, cases):
    """Per case: the last-position logits of a whole-sequence forward in the axes' sampling contexts (as
    train.sample runs model.generate) at init, then one training step traced against report.run.predicted_messages."""
    from accounting.tracer import CommTracer
    from contextlib import ExitStack
    from optim import DynamicLossScaler
    from step import train_step
    import report.run
    import report.axes
    out = []
    for flags, config_kw, global_batch, micro in cases:
        run = _composed(rank, world, flags, config_kw, global_batch, micro)
        moe_axis = next(axis for axis in run.axes if axis.name == "moe")
        report.axes.axis_lines(moe_axis, "startup", run)  # as train.py prints it, after start-up's own forwards
        prompt = global_batches(1, 1, SEQ, seed=5)[0][0].to(run.device)
        run.model.eval()
        with torch.no_grad(), ExitStack() as stack:
            for axis in run.axes:
                stack.enter_context(axis.sampling())
            logits = run.model(prompt)[0]
        run.model.train()
        run.tracer = CommTracer()
        for name, group in run.mesh.groups.items():
            run.tracer.name_group(group, name)
        (x, y), = global_batches(1, global_batch, SEQ)
        batches = [(*b, None) for b in rank_micro_batches(x, y, run.mesh.index("dp"), run.mesh.size("dp"), micro)]
        for axis in run.axes:
            batches = axis.shard_batches(batches)
        with run.tracer:
            train_step(run.layout, DynamicLossScaler(enabled=False), batches, run.mesh.group("dp_cp"), 1.0,
                       nullcontext(), run.device, model=run.model, axes=run.axes, data_size=run.mesh.size("dp"))
        traced = {key: (r.calls, r.payload_bytes) for key, r in run.tracer.records.items()}
        predicted = report.run.predicted_messages(run, 1)
        load_line = report.axes.axis_lines(moe_axis, "step", run)[0]
        out.append(dict(logits=logits, traced=traced, predicted=predicted, load_line=load_line,
                        slots=run.micro_batches * 2 * micro * SEQ // run.mesh.size("cp")
                        // (run.mesh.size("tp") if run.settings.sequence_parallel else 1) * run.config.moe.topk))
    return out


@pytest.fixture(scope="module")
def traced_and_sampled_runs():
    return run_ranks(_traced_and_sampled, 4, CAPACITY_4, timeout=600)


def test_sampling_under_cp_and_sp_gives_the_single_device_logits(traced_and_sampled_runs):
    """Sampling runs whole sequences on every rank: the layer gathers over no group then (1e-10)."""
    import test_composition
    from reference import build_model

    for index, (flags, config_kw, _, _) in enumerate(CAPACITY_4):
        args = test_composition._parse(flags, 4, 1)
        reference = build_model(test_composition._config(args, config_kw), seed=0, dtype=DT).eval()
        with torch.no_grad():
            expected = reference(global_batches(1, 1, SEQ, seed=5)[0][0])[0]
        for rank, by_case in enumerate(traced_and_sampled_runs):
            assert _err(by_case[index]["logits"], expected) < TOL, (flags, rank)


def test_capacity_gathers_under_cp_and_sp_are_traced_as_predicted(traced_and_sampled_runs):
    """One step's traced messages (the choices' all-gathers on cp, and on tp with --sp, the exact all-to-alls)
    equal report.run.predicted_messages, call for call and byte for byte."""
    for index, (flags, _, _, _) in enumerate(CAPACITY_4):
        for rank, by_case in enumerate(traced_and_sampled_runs):
            got = by_case[index]
            assert got["traced"] == got["predicted"], (flags, rank, set(got["traced"].items())
                                                       ^ set(got["predicted"].items()))
            gathers = {name for op, group in got["traced"] if op == "all_gather_single" for name in group.split("=")}
            assert gathers >= ({"cp"} if "--cp" in flags else set()) | ({"tp"} if "--sp" in flags else set()), gathers


def test_the_load_line_counts_the_training_step_only(traced_and_sampled_runs):
    """m micro-batches × 2 layers × T·k slots: not start-up's forwards through block 0 (CP's and TP's
    measurements), nor the sampling forward."""
    for index, (flags, _, _, _) in enumerate(CAPACITY_4):
        for rank, by_case in enumerate(traced_and_sampled_runs):
            got = by_case[index]
            assert "moe load over this step" in got["load_line"], (flags, rank, got["load_line"])
            assert f"of the {got['slots']} slots" in got["load_line"], (flags, rank, got["load_line"])


SIGMOID_SEQ = dict(moe_score="sigmoid", moe_bias_rate=1e-3, moe_seq_aux_coef=1e-4, moe_route_scale=2.0)


def test_layer_activation_bytes_match_what_autograd_saves():
    """moe_costs.layer_activation_bytes against memory.SavedActivations of one MoE layer's forward (E = 1,
    dropless: S = R = T·k exactly), in float64, float32 top-1 with dropout (a CPU mask in fp32) and bf16 autocast
    (whose saved bf16 copies of the expert weights are weights, not activations: taken off); DeepSeek-V3's router
    (sigmoid, the seq loss over B_μ = 2 sequences, top-2, and top-1 with groups)."""
    from accounting import moe_costs
    from accounting import memory
    from reference import build_model

    for dtype, autocast, overrides in ((DT, False, {}), (torch.float32, False, dict(dropout=0.1, moe_topk=1)),
                                       (torch.float32, True, {}), (DT, False, SIGMOID_SEQ),
                                       (DT, False, dict(SIGMOID_SEQ, moe_topk=1, moe_groups=2, moe_group_limit=1))):
        config = make_config(**{**LAYER, **overrides})
        model = build_model(config, seed=0, dtype=dtype)
        layer = model.transformer.h[0].mlp
        x = _layer_inputs(0, (2, 12), 16)[0].to(dtype).requires_grad_()
        with memory.SavedActivations(exclude=list(model.parameters())) as saved, \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            layer(x)
        compute = 2 if autocast else dtype.itemsize
        weight_copies = config.moe.experts * 2 * 4 * 16 * 16 * 2 if autocast else 0
        expected = moe_costs.layer_activation_bytes(config, 24, compute, max(4, dtype.itemsize),
                                                    mask_bytes=dtype.itemsize, sequences=2)
        assert saved.bytes - weight_copies == expected, (dtype, autocast, saved.bytes, expected)


def test_the_moe_aware_activation_estimate_replaces_the_dense_mlps_share():
    from accounting import moe_costs
    config = make_config(**LAYER)
    one = moe_costs.layer_activation_bytes(config, 64 * 2)
    assert moe_costs.activation_estimate_delta(config, 3, 64, 2) == 3 * (one - 19 * 64 * 2 * 16)
    assert moe_costs.activation_estimate_delta(config, 1, 64, 2, tp=2) == one - (3 + 8) * 64 * 2 * 16
    assert moe_costs.activation_estimate_delta(config, 1, 64, 2, tp=2, sequence_parallel=True) == \
        moe_costs.layer_activation_bytes(config, 64) - 19 * 64 * 2 * 16 / 2


# ---------------------------------------------------------------------------------------------------------
# DeepSeek-V3's router (experts/router.py): sigmoid scores, the loss-free bias, the seq loss, group-limited routing
# ---------------------------------------------------------------------------------------------------------


def _reference_gate(logits, bias, k, groups, limit, scale, score):
    """DeepSeek-V3's gate (inference/model.py's Gate, the paper's §2.1.1-2.1.2) from its published semantics, in
    float64 Python, one token at a time; ties go to the lower index (a group, an expert)."""
    out_experts, out_weights = [], []
    for row in logits.tolist():
        if score == "sigmoid":
            s = [1 / (1 + math.exp(-z)) for z in row]
        else:
            s = [math.exp(z) / sum(math.exp(u) for u in row) for z in row]
        n = len(s)
        biased = [s_i + b_i for s_i, b_i in zip(s, bias)]
        allowed = range(n)
        if groups:
            per = n // groups
            members = [biased[g * per:(g + 1) * per] for g in range(groups)]
            group_score = [sum(sorted(m, reverse=True)[:2]) if score == "sigmoid" else max(m) for m in members]
            chosen = sorted(range(groups), key=lambda g: (-group_score[g], g))[:limit]
            allowed = [i for i in range(n) if i // per in chosen]
        experts = sorted(allowed, key=lambda i: (-biased[i], i))[:k]
        weights = [s[i] for i in experts]
        if score == "sigmoid" or k > 1:
            weights = [w / sum(weights) for w in weights]
        out_experts.append(experts)
        out_weights.append([w * scale for w in weights])
    return out_experts, out_weights


@pytest.mark.parametrize("score, k, groups, limit, with_bias", [
    ("sigmoid", 4, 4, 2, True), ("sigmoid", 3, 8, 3, True), ("sigmoid", 2, 0, 0, True), ("sigmoid", 1, 4, 1, True),
    ("sigmoid", 4, 4, 2, False), ("softmax", 3, 4, 2, False), ("softmax", 2, 0, 0, False)])
def test_routing_equals_a_float64_reference_of_deepseek_v3s_gate_ties_included(score, k, groups, limit, with_bias):
    """Integer logits in [-3, 3] tie often (equal scores within a token, equal group scores); the bias is a
    multiple of 1/8, so biased scores tie too: the selected experts, in order, and the weights (× route scale 2.5)."""
    from experts import router
    generator = torch.Generator().manual_seed(0)
    logits = torch.randint(-3, 4, (256, 16), generator=generator).to(DT)
    bias = (torch.randint(-2, 3, (16,), generator=generator) / 8).float() if with_bias else None
    _, gate, expert, _ = router.route(logits, k, score, bias, groups, limit, scale=2.5)
    ref_experts, ref_weights = _reference_gate(logits, [0.0] * 16 if bias is None else bias.tolist(), k, groups,
                                               limit, 2.5, score)
    ties = sum(len(set(row)) < len(row) for row in logits.tolist())
    assert ties == 256  # 16 values out of 7: every token has ties
    assert expert.tolist() == ref_experts
    torch.testing.assert_close(gate, torch.tensor(ref_weights, dtype=DT), rtol=1e-14, atol=1e-14)
    if groups:
        spans = (expert // (16 // groups)).tolist()
        assert max(len(set(row)) for row in spans) <= limit


def test_the_sequence_balance_loss_by_hand():
    """eq. 17-20 per sequence: f_i = N/(k·T)·#{t: i in the unbiased top-k of s_t}, P_i = mean_t s_ti/Σ_j s_tj,
    Σ_i f_i·P_i, then the mean over the micro-batch's sequences; its pieces' statistics add up (CP, SP)."""
    from experts import router
    torch.manual_seed(0)
    batch, n_tok, n, k = 3, 5, 4, 2
    logits = torch.randn(batch * n_tok, n, dtype=DT)
    probs, _, _, s = router.route(logits, k, "sigmoid")
    got = router.sequence_loss(router.sequence_stats(s, probs, k, batch), k)
    expected = 0.0
    for b in range(batch):
        rows = [[1 / (1 + math.exp(-z)) for z in row] for row in logits[b * n_tok:(b + 1) * n_tok].tolist()]
        counts = [0] * n
        for row in rows:
            for i in sorted(range(n), key=lambda i: (-row[i], i))[:k]:
                counts[i] += 1
        f = [n / (k * n_tok) * c for c in counts]
        p = [sum(row[i] / sum(row) for row in rows) / n_tok for i in range(n)]
        expected += sum(fi * pi for fi, pi in zip(f, p)) / batch
    assert abs(float(got) - expected) < 1e-14
    halves = [router.sequence_stats(s.view(batch, n_tok, n)[:, cut].reshape(-1, n),
                                    probs.view(batch, n_tok, n)[:, cut].reshape(-1, n), k, batch)
              for cut in (slice(0, 2), slice(2, None))]
    assert abs(float(router.sequence_loss(halves[0] + halves[1], k)) - expected) < 1e-14


def test_the_bias_update_rule():
    """b_i += γ·sign(mean − load_i) from the step's load; the load restarts; last keeps the step's."""
    from experts import router
    load = router.ExpertLoad(4, sigmoid=True, rate=1e-3)
    load.add(torch.tensor([5, 1, 3, 3]))
    load.add(torch.tensor([1, 1, 1, 1]))  # a second micro-batch: [6, 2, 4, 4], mean 4
    router.finish_step([load])
    assert load.bias.tolist() == torch.tensor([-1e-3, 1e-3, 0.0, 0.0], dtype=torch.float32).tolist()
    assert load.last.tolist() == [6, 2, 4, 4] and load.step.tolist() == [0, 0, 0, 0]
    off = router.ExpertLoad(4, sigmoid=True, rate=0.0)
    off.add(torch.tensor([5, 1, 3, 3]))
    router.finish_step([off])
    assert off.bias.tolist() == [0.0] * 4 and off.last.tolist() == [5, 1, 3, 3]


@pytest.mark.parametrize("bias", [True, False])
def test_the_router_and_the_replicas_loads_share_one_all_reduce_per_group(monkeypatch, bias):
    """router.finish_step with eplb's kept-slot loads riding along: ONE all_reduce per group, whose sum both
    users read (a stand-in all_reduce doubles its tensor: two ranks that routed alike); without the bias the
    router keeps its own count and the riders are still summed, in one call."""
    from experts import router
    calls = []

    def all_reduce(tensor, op=None, group=None):
        calls.append((group, tuple(tensor.shape)))
        tensor.mul_(2)

    monkeypatch.setattr(router.dist, "all_reduce", all_reduce)
    loads = [router.ExpertLoad(4, sigmoid=True, rate=1e-3 if bias else 0.0) for _ in range(2)]
    for load, step in zip(loads, ([6, 2, 4, 4], [1, 1, 1, 5])):
        load.add(torch.tensor(step))
    riders = torch.tensor([[5, 2, 4, 4], [1, 1, 1, 4]])  # capacity dropped some: the kept slots
    summed = router.finish_step(loads, ["dp_cp"], riders.clone())
    assert calls == [("dp_cp", ((4 if bias else 2) * 4,))]  # flat: coselect's riders are wider ([L, N + N²])
    assert summed.tolist() == (2 * riders).tolist()
    assert loads[0].last.tolist() == ([12, 4, 8, 8] if bias else [6, 2, 4, 4])
    assert loads[1].last.tolist() == ([2, 2, 2, 10] if bias else [1, 1, 1, 5])


def test_the_layer_counts_training_forwards_only_and_routes_with_its_bias():
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    import moe
    from model import AuxLosses

    config = make_config(moe_experts=4, moe_topk=1, moe_score="sigmoid", moe_bias_rate=0.1)
    torch.manual_seed(0)
    layer = moe.MoE(config, 0, AuxLosses())
    for p in layer.parameters():  # built alone, not by model.GPT: the router's weight is torch.empty's bits (NaN
        torch.nn.init.normal_(p, std=0.02)  # among them: then s + b sorts NaN first and the bias cannot win)
    x = torch.randn(2, 3, config.n_embd)
    layer(x)
    with torch.no_grad():
        layer(x)  # evaluation: not counted
    assert int(layer.load.step.sum()) == 6
    with set_checkpoint_early_stop(False):  # the recompute runs the whole forward, its routing included
        checkpoint(layer, x.requires_grad_(), use_reentrant=False).sum().backward()  # the recompute: not counted
    assert int(layer.load.step.sum()) == 12
    layer.load.bias[2] = 10.0  # a bias that large wins every token's one slot: selection reads s + b
    layer.load.step.zero_()
    layer(x)
    assert layer.load.step.tolist() == [0, 0, 6, 0]


@pytest.mark.parametrize("overrides, flag", [
    (dict(moe_bias_rate=1e-3), "--moe-bias-rate 0.001 needs --moe-score sigmoid"),
    (dict(moe_groups=3, moe_group_limit=1), "--moe-groups 3 must divide --moe-experts 8"),
    (dict(moe_groups=4, moe_group_limit=5), "--moe-group-limit 5 must be between 1 and --moe-groups 4"),
    (dict(moe_group_limit=2), "--moe-group-limit 2 needs --moe-groups"),
    (dict(moe_groups=8, moe_group_limit=2, moe_score="sigmoid"), "--moe-groups 8: a group's score is its top 2"),
    (dict(moe_groups=4, moe_group_limit=1, moe_topk=3), "--moe-topk 3 is more than the 2 experts"),
])
def test_router_flags_that_cannot_work_name_the_flag(overrides, flag):
    with pytest.raises(ValueError, match=flag.replace("(", r"\(")):
        _check(8, overrides.pop("moe_topk", 2), **overrides)


def test_groups_must_divide_the_ep_ranks_or_be_a_multiple(capsys, monkeypatch):
    """Through train.main's flag parsing: one line naming the flag, exit status 2, before any rank waits."""
    from cli import flags as flags_lib
    import train

    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it: parse validates before any process group

    with pytest.raises(SystemExit) as exit_info:
        flags_lib.parse(["--preset", "tiny", "--moe-experts", "12", "--moe-groups", "3", "--moe-group-limit", "1",
                         "--ep", "2"], train.AXES)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--moe-groups 3 must divide --ep 2 or be a multiple of it" in err[0], err
    _check(12, 2, ep=2, dp=2, moe_groups=6, moe_group_limit=2)  # a rank holds 3 groups
    _check(8, 2, ep=4, dp=4, moe_groups=2, moe_group_limit=1)  # a group is 2 ranks


def test_a_router_flag_out_of_its_range_fails_in_flags_validate():
    from cli import flags as flags_lib
    import train

    for argv, message in ((["--moe-bias-rate", "-1"], "--moe-bias-rate must be at least 0"),
                          (["--moe-route-scale", "0"], "--moe-route-scale must be positive"),
                          (["--moe-seq-aux-coef", "nan"], "--moe-seq-aux-coef must be a finite number")):
        with pytest.raises(flags_lib.FlagError, match=message):
            flags_lib.validate(flags_lib.build_parser().parse_args(["--moe-experts", "4", *argv]), 1, axes=train.AXES)
    with pytest.raises(flags_lib.FlagError, match="--moe-score needs --moe-experts > 0"):
        flags_lib.validate(flags_lib.build_parser().parse_args(["--moe-score", "sigmoid"]), 1, axes=train.AXES)


# Through train.py's composition (tests/test_composition.py's runs: 3 steps in float64 against the single-device
# model, losses and parameters within 1e-10): the whole DeepSeek-V3 router on, N = 8 experts in G = 4 groups of
# which a token reaches M = 2 (a group is one rank's experts at E = 4, a rank holds two groups at E = 2), the bias
# at γ = 0.01 (it changes the routing within the 3 steps), the seq loss, a route scale. Every forward of every
# step asserts that its tokens' experts span at most M groups. The last case saves on E = 2 with ZeRO-3 after 2
# steps and resumes on E = 4: the bias comes back from the checkpoint (one logical copy, "moe/...").
DS_FLAGS = ["--moe-experts", "8", "--moe-score", "sigmoid", "--moe-bias-rate", "0.01", "--moe-groups", "4",
            "--moe-group-limit", "2", "--moe-seq-aux-coef", "0.01", "--moe-route-scale", "1.5", "--moe-aux-coef", "0"]
DS_4 = [
    ([*DS_FLAGS, "--ep", "2", "--zero", "1"], {}, 4, 1),
    ([*DS_FLAGS, "--ep", "4", "--zero", "3"], {}, 8, 1),
    ([*DS_FLAGS, "--ep", "2", "--tp", "2", "--sp"], {}, 4, 2),
    ([*DS_FLAGS, "--ep", "2", "--pp", "2"], dict(n_layer=2), 8, 1),
    ([*DS_FLAGS, "--ep", "2", "--cp", "2"], {}, 4, 1),
]
DS_RESHARD = (([*DS_FLAGS, "--ep", "2", "--zero", "3"], {}, 8, 1), ([*DS_FLAGS, "--ep", "4"], {}, 8, 1))


def _deepseek_runs(rank, world, root):
    import os

    import moe
    from experts import router
    import test_composition

    biases, spans = {}, []
    after_grad_sync, route = moe.MoEAxis.after_grad_sync, router.route

    def recording(self, layout):  # each step's bias, after its update
        out = after_grad_sync(self, layout)
        biases.update({layer.layer_id: layer.load.bias.detach().cpu().clone() for layer in self.layers})
        return out

    def checked(logits, topk, score="softmax", bias=None, groups=0, limit=0, scale=1.0):
        out = route(logits, topk, score, bias, groups, limit, scale)
        spans.append(int(max(len(set(row)) for row in (out[2] // (logits.shape[1] // groups)).tolist())))
        assert spans[-1] <= limit, (spans[-1], limit)
        return out

    moe.MoEAxis.after_grad_sync, router.route = recording, checked
    out = []
    for case in DS_4:
        biases.clear()
        out.append((*test_composition._run_case(rank, world, *case), dict(biases)))
    directory = os.path.join(root, "reshard")
    test_composition._run_case(rank, world, *DS_RESHARD[0], stop=test_composition.SAVE_AT, save_root=directory)
    biases.clear()
    out.append((*test_composition._run_case(rank, world, *DS_RESHARD[1], resume_root=directory), dict(biases)))
    manifest = None
    if rank == 0:
        import json
        step_dir = next(os.path.join(directory, d) for d in sorted(os.listdir(directory)) if d.startswith("step-"))
        with open(os.path.join(step_dir, "manifest.json")) as f:
            manifest = json.load(f)
    return out, spans, manifest


def _reference_biases(case, monkeypatch):
    """The single-device run of test_composition._check's reference, and its layers' biases after the 3 steps."""
    import reference
    import test_composition

    seen = []
    update = reference.update_expert_bias

    def recording(model):
        update(model)
        seen.append({i: block.mlp.load.bias.clone() for i, block in enumerate(model.transformer.h)})

    flags, config_kw, global_batch, micro = case
    monkeypatch.setattr(reference, "update_expert_bias", recording)
    args = test_composition._parse(flags, global_batch, micro)
    reference.reference_run(test_composition._config(args, config_kw),
                            global_batches(test_composition.STEPS, global_batch, test_composition.SEQ),
                            clip=test_composition.CLIP, micro_batches=global_batch // micro)
    return seen  # after each step


@pytest.mark.slow
def test_deepseek_routing_follows_the_single_device_run_on_every_mesh_and_resumes_on_another_e(tmp_path, monkeypatch):
    """The DS_4 meshes and DS_RESHARD (above): losses and parameters as test_composition._check, every rank's bias
    equal to the single device's after each case (exactly: integer loads, the same sign steps), the checkpoint's
    bias one logical tensor per layer, and what sampling loads of it (hf.load_model's pieces) the bias it saved."""
    import ckpt
    from interop import hf
    import test_composition
    from reference import build_model

    results = run_ranks(_deepseek_runs, 4, str(tmp_path), timeout=900)
    spans = [s for _, rank_spans, _ in results for s in rank_spans]
    assert spans and max(spans) <= 2, max(spans)  # asserted in every forward too
    for index, case in enumerate([*DS_4, DS_RESHARD[1]]):
        per_rank = [rank_results[index] for rank_results, _, _ in results]
        if case is DS_RESHARD[1]:
            assert all(sorted(losses) == [test_composition.SAVE_AT] for losses, _, _ in per_rank)
        test_composition._check([(losses, params) for losses, params, _ in per_rank], *case)
        after_each_step = _reference_biases(case, monkeypatch)
        expected = after_each_step[-1]
        assert any(float(b.abs().max()) > 0 for b in expected.values())  # the bias moved
        for rank, (_, _, biases) in enumerate(per_rank):
            for layer_id, bias in biases.items():  # the same on every rank, and the single device's, exactly
                assert torch.equal(bias, expected[layer_id]), (case[0], rank, layer_id, bias, expected[layer_id])
    manifest = results[0][2]
    stored = [key for key in manifest["tensors"] if key.startswith("moe/")]
    assert stored == [f"moe/transformer.h.{i}.mlp.expert_bias" for i in range(2)], stored
    step_dir, manifest = hf._newest_good_checkpoint(str(tmp_path / "reshard"))  # as hf.load_model (sample.py)
    model = build_model(test_composition._config(test_composition._parse(*DS_RESHARD[1][:1], 8, 1), {}), dtype=DT)
    ckpt.load_pieces(step_dir, manifest, hf._router_bias_pieces(model, manifest["tensors"], "cpu"))
    for i, block in enumerate(model.transformer.h):  # sampling routes with the saved bias
        assert torch.equal(block.mlp.load.bias, after_each_step[test_composition.SAVE_AT - 1][i]), i


def test_off_group_counts_the_exchanges_rows_to_and_from_ranks_of_other_places():
    """E = 4 ranks in G = 2 groups of 2 ranks, this rank 1 (place 0): rows sent to and received from ranks 2, 3."""
    from experts import dispatch
    from experts import router
    places = router.group_places(2, 4, 1)
    assert places.of_rank == [0, 0, 1, 1] and places.mine == 0
    assert router.off_group(places, dispatch.Exchange([2, 1, 3, 4], [5, 0, 6, 7], 0)) == (7, 13)
    assert router.off_group(None, dispatch.Exchange([2, 1, 3, 4], [5, 0, 6, 7], 0)) == (0, 0)


def test_the_uniform_rows_per_token():
    """N = 8, G = E = 4, k = 2: M = 1 keeps both experts on one rank, another in 3 of 4 tokens (3/4 off the
    sender's rank); M = 4, each of the 3 others is missed with C(6,2)/C(8,2) = 15/28; no groups is M = G = E;
    G = 2 groups of 2 ranks, M = 1: both experts in one group, on 1 or 2 of its ranks, the other group's half
    the time."""
    from experts import router
    assert router.rows_per_token(8, 2, 4, 1, 4) == (1.0, 0.75)
    assert router.rows_per_token(8, 2, 4, 4, 4) == pytest.approx((4 * 13 / 28, 3 * 13 / 28))
    assert router.rows_per_token(8, 2, 0, 0, 4) == router.rows_per_token(8, 2, 4, 4, 4)
    one_group = 1 * 2 / 6 + 2 * 4 / 6  # 2 of its 4 experts: on one rank (2 of the 6 pairs) or on both
    assert router.rows_per_token(8, 2, 2, 1, 4) == pytest.approx((one_group, one_group / 2))  # other group: 1/2


OFF_GROUP_FLAGS = ["--moe-experts", "8", "--moe-score", "sigmoid", "--moe-bias-rate", "0.01", "--moe-groups", "4",
                   "--ep", "4"]


def _off_group_runs(rank, world):
    from accounting import moe_costs
    from experts import router
    import report.run
    import report.axes
    import test_composition
    from accounting.tracer import CommTracer
    from optim import DynamicLossScaler
    from step import train_step

    out, route = {}, router.route
    cases = [(4, []), (1, []), (1, ["--moe-replicas", "12"]), ("cp_sp", [])]  # M = G, M = 1, M = 1 with replicas
    for limit, extra in cases:  # and CP × SP with the seq loss (B_μ = 2)
        chosen = []

        def recording(logits, topk, *args, **kwargs):
            result = route(logits, topk, *args, **kwargs)
            groups, m = kwargs.get("groups", 0), kwargs.get("limit", 0)
            if groups:  # every forward of every step: a token's experts lie in at most M groups
                span = max(len(set(row)) for row in (result[2] // (logits.shape[1] // groups)).tolist())
                assert span <= m, (span, m)
            chosen.append(result[2].tolist())
            return result

        router.route = recording
        flags, batch, micro = [*OFF_GROUP_FLAGS, "--moe-group-limit", str(limit), *extra], 8, 1
        if limit == "cp_sp":
            flags, batch, micro = [*OFF_GROUP_FLAGS[:6], "--moe-seq-aux-coef", "0.01", "--cp", "2", "--tp", "2",
                                   "--sp"], 2, 2
        run = test_composition.composed_run(rank, world, flags, {}, batch, micro, harness.device())
        axis = next(a for a in run.axes if a.name == "moe")
        tracer, steps = CommTracer(), 2
        run.tracer = tracer  # report.run.predicted_messages names the groups as the tracer does
        for name, group in run.mesh.groups.items():
            tracer.name_group(group, name)
        for x, y in global_batches(steps, batch, SEQ):
            batches = [(*b, None) for b in rank_micro_batches(x, y, run.mesh.index("dp"), run.mesh.size("dp"), micro)]
            for handle in run.axes:
                batches = handle.shard_batches(batches)
            with tracer:
                train_step(run.layout, DynamicLossScaler(enabled=False), batches, run.mesh.group("dp_cp"), 1.0,
                           nullcontext(), run.device, model=run.model, axes=run.axes, data_size=run.mesh.size("dp"))
        router.route = route
        mine = run.mesh.index("ep")  # G = E: a group is one rank, expert e on rank e // 2 (without replicas)
        sent_to = tracer.sent_to("all_to_all_single", "ep")
        observer = axis.observer
        out[limit if not extra else "replicas"] = dict(
            off_group=tuple(observer.off_group), tokens=sum(len(f) for f in chosen),
            by_hand=sum(len({e // 2 for e in row} - {mine}) for forward in chosen for row in forward),
            off_bytes=(moe_costs.off_group_bytes(axis.traffic, observer.forwards, *observer.off_group),
                       sum(sent_to) - sent_to[mine] if sent_to else 0),
            traced={k: (r.calls / steps, r.payload_bytes / steps) for k, r in tracer.records.items()},
            predicted=report.run.predicted_messages(run, steps),
            lines=report.axes.axis_lines(axis, "end", run, steps))
    return out


@pytest.mark.slow
def test_group_limited_routing_cuts_the_off_group_bytes_as_predicted():
    """E = 4, G = 4 (a group is a rank's 2 experts), k = 2, 2 steps, every token's experts in ≤ M groups (asserted
    in every forward): the deduplicated exchange (experts/dispatch.py) sends one row per token and other rank, so
    the rows leaving a rank equal a count by hand from the experts chosen, and the ep all-to-alls' bytes to the
    other ranks predicted from them (moe_costs.off_group_bytes) equal the CommTracer's per destination,
    exactly; from M = G to M = 1 they fall as the uniform estimate says (rows per token 3·13/28 → 3/4, within
    0.15 on 64 tokens a rank and step); with --moe-replicas the ranks are the physical slots' (traced =
    predicted); every message of the step equals the prediction; and on C = 2 × T = 2 with --sp and the seq loss."""
    from experts import router
    results = run_ranks(_off_group_runs, 4, timeout=300)
    for limit in (4, 1, "replicas", "cp_sp"):
        for rank, got in enumerate(results):
            if limit in (4, 1):
                assert got[limit]["off_group"][0] == got[limit]["by_hand"], (limit, rank, got[limit])
            predicted_bytes, traced_bytes = got[limit]["off_bytes"]
            assert predicted_bytes == traced_bytes, (limit, rank, got[limit]["off_bytes"])
            traced, predicted = got[limit]["traced"], got[limit]["predicted"]
            assert set(traced) == set(predicted), (limit, rank, set(traced) ^ set(predicted))
            for key, value in predicted.items():
                assert traced[key] == pytest.approx(value, abs=1e-9), (limit, rank, key, tuple(value), traced[key])
            assert any(op == "all_reduce" and "dp_cp" in group.split("=") for op, group in traced), traced
    rows = {limit: sum(r[limit]["off_group"][0] for r in results) / sum(r[limit]["tokens"] for r in results)
            for limit in (4, 1)}
    off_bytes = {limit: sum(r[limit]["off_bytes"][1] for r in results) for limit in (4, 1)}
    print(f"\noff-group rows per token {rows}, bytes (all ranks, 2 steps) {off_bytes}\n"
          + "\n".join(results[0][1]["lines"]))
    assert off_bytes[1] < off_bytes[4] and rows[1] < rows[4]
    assert rows[1] == pytest.approx(router.rows_per_token(8, 2, 4, 1, 4)[1], abs=0.15)
    assert rows[4] == pytest.approx(router.rows_per_token(8, 2, 4, 4, 4)[1], abs=0.15)
    assert any(line.startswith("moe off-group all-to-all (G=4, M=1; a group is 1 ranks") for line in
               results[0][1]["lines"])


GROUP_LIMITED_RUN = """
import sys
from experts import router
import train
route, steps = router.route, []
def checked(logits, topk, score="softmax", bias=None, groups=0, limit=0, scale=1.0):
    out = route(logits, topk, score, bias, groups, limit, scale)
    span = max(len(set(row)) for row in (out[2] // (logits.shape[1] // groups)).tolist())
    assert span <= limit, (span, limit)
    steps.append(span)
    return out
router.route = checked
train.main(sys.argv[1].split())
print("GROUP SPANS", len(steps), max(steps))
"""


@pytest.mark.slow
def test_every_step_of_a_train_py_run_keeps_each_tokens_experts_in_m_groups(tmp_path):
    """train.main on one process, 4 steps with evaluation and sampling (every forward checked, the bias learning):
    every token's experts lie in at most M = 1 of G = 4 groups; the run reaches its end lines."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(500)))
    argv = (f"--preset tiny --steps 4 --global-batch 4 --eval-every 2 --eval-batches 1 --sample-tokens 8"
            f" --log-every 1 --peak-tflops 1 --data {corpus} --out-dir {tmp_path} {' '.join(harness.backend_flags(1))}"
            f" --moe-experts 8 --moe-score sigmoid --moe-bias-rate 1e-3 --moe-groups 4 --moe-group-limit 1"
            f" --moe-seq-aux-coef 1e-4")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    run = subprocess.run([sys.executable, "-c", GROUP_LIMITED_RUN, argv], capture_output=True, text=True, env=env,
                         cwd=root, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    spans = next(line for line in run.stdout.splitlines() if line.startswith("GROUP SPANS")).split()
    assert int(spans[2]) >= 4 * 2 and int(spans[3]) == 1, spans  # 4 steps × 2 MoE layers at least, one group each
    assert "sigmoid + bias (γ=0.001 per step) → best 1 of 4 groups" in run.stdout
