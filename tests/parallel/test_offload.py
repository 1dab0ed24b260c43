"""parallel/offload.py: ZeRO's optimizer shard in host memory, the update on the host.

On this CPU the host is the device: the copies are memcpys, and the offloaded run must equal the resident one
exactly (float64, the same arithmetic on the same values: compared bitwise, and with the single-device model to
1e-10). Counted: every host↔device byte against the predicted formula, the host's and the device's held bytes
against theirs, and the traced messages against the prediction (offload adds no collective).
"""

import pytest
import torch

import harness
from cli import flags
from harness import run_ranks
from test_composition import SEQ, STEPS, _check, composed_run
from train import AXES

# (flags, config overrides, global batch, B_μ) on D = 2: m = 2 micro-batches, so stage 2 reduces twice a step.
CASES = [(["--zero", z, *extra], {}, 4, 1) for z in ("1", "2") for extra in
         ([], ["--offload", "optimizer"], ["--offload", "optimizer+master"])]
CASES.append((["--zero", "1", "--pp", "2", "--offload", "optimizer+master"], dict(n_layer=2), 4, 1))  # P 2 × D 1


def _offloaded(rank, world, cases):
    import report.run
    out = []
    for flags_, config_kw, global_batch, micro in cases:
        run = composed_run(rank, world, flags_, config_kw, global_batch, micro, harness.device())
        losses, traced = harness.traced_steps(run, STEPS, global_batch, SEQ, micro, 0.05, STEPS)
        layout, infos = run.layout, {p.shard_info.global_name: p.shard_info for p in run.model.parameters()}
        held = layout.full_parameters()
        params = {name: (held[name], infos[name]) for name in held}
        state = {piece.key: piece.tensor.clone() for piece in layout.state_pieces()}
        accounts = None
        if hasattr(layout, "predicted_moved"):
            accounts = dict(moved=dict(layout.moved), steps=layout.moved_steps, predicted=layout.predicted_moved(),
                            host=layout.host_bytes(), held=layout.held_bytes()["total"],
                            persistent=layout.predicted_persistent()["total"])
        out.append((losses, params, state, accounts, traced, report.run.predicted_messages(run, len(losses))))
    return out


@pytest.mark.slow  # seven composed runs on two ranks: four minutes on the loaded shared machine
def test_offloaded_zero_equals_the_resident_run_and_moves_the_predicted_bytes():
    results = run_ranks(_offloaded, 2, CASES, timeout=300)
    for index, case in enumerate(CASES):
        per_rank = [rank_results[index] for rank_results in results]
        _check([r[:2] for r in per_rank], *case)  # the single-device model, 1e-10
        resident = CASES.index(([case[0][0], case[0][1]], {}, 4, 1)) if "--pp" not in case[0] else None
        for rank, (losses, _, state, accounts, traced, predicted) in enumerate(per_rank):
            assert set(traced) == set(predicted), (case, rank, set(traced) ^ set(predicted))
            for key, (calls, payload) in predicted.items():
                assert traced[key] == pytest.approx((calls, payload), abs=1e-9), (case, rank, key)
            if "--offload" not in case[0]:
                continue
            if resident is not None:  # bitwise: every loss, weight, master and moment of the resident run
                theirs = results[rank][resident]
                assert losses == theirs[0], case
                assert state.keys() == theirs[2].keys()
                for key, tensor in state.items():
                    assert torch.equal(tensor, theirs[2][key]), (case, rank, key)
            steps = accounts["steps"]
            assert steps == STEPS
            assert accounts["moved"] == {k: v * steps for k, v in accounts["predicted"].items()}, (case, accounts)
            assert accounts["host"]["held"] == accounts["host"]["predicted"], (case, accounts)
            assert accounts["held"] == accounts["persistent"], (case, accounts)


def test_offload_with_distinct_working_and_master_dtypes_equals_the_resident_update():
    """float32 working weights, float64 masters (as bf16 and fp32 are on a GPU): the host casts the new weights,
    the device keeps no master (optimizer+master) or keeps it (optimizer); the same bits as zero.py's."""
    results = run_ranks(_dtypes, 2, timeout=120)
    for resident, *offloaded in results:
        for other in offloaded:
            for a, b in zip(resident, other):
                assert torch.equal(a, b)


def _dtypes(rank, world):
    import torch.distributed as dist

    from model import GPT
    from parallel.offload import OffloadConfig, OffloadZeroLayout
    from reference import make_config
    from zero import ZeroConfig, ZeroLayout
    from optim import DynamicLossScaler

    config = make_config()
    zero = ZeroConfig(1, lr=3e-3, param_dtype=torch.float32, master_dtype=torch.float64, bucket_mb=0.02)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(rank))
    out = []
    for offload in (None, "optimizer", "optimizer+master"):
        model = GPT(config, dtype=torch.float64).to(torch.float32)
        kwargs = dict(groups={"dp_cp": dist.group.WORLD}, coords={})
        layout = (ZeroLayout(model, zero, **kwargs) if offload is None else
                  OffloadZeroLayout(model, zero, offload=OffloadConfig(offload), **kwargs))
        for _ in range(3):
            _, loss, _ = layout(x, x)
            loss.backward()
            layout.finish_grad_sync()
            layout.step(DynamicLossScaler(False), 0.05)
            layout.zero_grad()
        out.append([p.detach().clone() for p in model.parameters()] + [piece.tensor.clone() for piece in
                                                                       layout.state_pieces()])
    return out


@pytest.mark.parametrize("argv,words", [
    (["--offload", "optimizer"], "--offload optimizer needs --zero 1 or 2"),
    (["--offload", "optimizer", "--zero", "3"], "does not serve --zero 3"),
    (["--offload", "optimizer+master", "--zero", "2", "--pp", "2"], "does not serve --zero 2 under --pp"),
])
def test_bad_offload_flags_are_one_line(argv, words):
    args = flags.build_parser().parse_args(["--preset", "tiny", "--global-batch", "4", "--micro-batch", "1", *argv])
    with pytest.raises(flags.FlagError, match=words) as error:
        flags.validate(args, 2, axes=AXES)
    assert "\n" not in str(error.value)
