"""Each rank builds only what it keeps (train.compose: meta → the axes cut → model.materialize / ZeRO-3's fill).

Three properties, each from one spawn of 4 gloo ranks (module fixtures) and one process under a fake group:
- bitwise: every local tensor a rank starts from (its TP slice, its experts, its stage, its ZeRO shard, the
  master and the working copy) equals the single-device model's init sliced by its ShardInfo, exactly
  (float64 and fp32);
- memory: a start-up's peak CPU allocation, measured with torch.profiler(profile_memory=True) over compose
  (the running sum of every allocation and free, in order), never exceeds what the rank keeps at the end
  plus the stated transient (one logical tensor at a time: `transient_bound`), for ZeRO-3 (D = 4),
  TP × EP, EP and PP;
- plan: compose(run, materialize=False) on meta inside torch's fake process group (no other rank exists)
  builds every layout (DDP, ZeRO 1/2/3, TP+SP, PP, CP, EP, FP8), touches no value, and predicts for each rank
  the same persistent bytes, held bytes and per-(collective, group) messages as the real build of that rank.
"""

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks
from reference import make_config
from test_composition import _config, _parse

WORLD, SEQ = 4, 16
BUILD_CASES = {  # name: (flags, model overrides, global batch, B_μ)
    "ddp": ([], {}, 8, 1),
    "zero1": (["--zero", "1"], {}, 8, 1),
    "zero2": (["--zero", "2"], {}, 8, 1),
    "zero3": (["--zero", "3"], {}, 8, 1),
    "tp_sp": (["--tp", "2", "--sp"], {}, 4, 1),
    "pp": (["--pp", "2"], dict(n_layer=2), 8, 1),
    "cp": (["--cp", "2"], {}, 4, 1),
    "ep": (["--moe-experts", "4", "--ep", "2"], {}, 8, 1),
    "fp8": (["--fp8", "delayed", "--tp", "2"], {}, 4, 1),
    "zero3_tp_ep": (["--zero", "3", "--tp", "2", "--moe-experts", "4", "--ep", "2"], {}, 4, 1),
}
BITWISE = ("ddp", "zero1", "zero3", "tp_sp", "ep", "pp", "zero3_tp_ep")
# The memory cases: a model whose blocks dwarf its largest tensor, so that holding the full model is unmistakable.
MEMORY_MODEL = dict(n_layer=8, n_head=4, n_embd=128)
MODEL_BYTES = 4 * make_config(**MEMORY_MODEL).n_layer * 12 * MEMORY_MODEL["n_embd"] ** 2  # its blocks, fp32
MEMORY_CASES = {"zero3": (["--zero", "3"], MEMORY_MODEL, 8, 1),
                "tp_ep": (["--tp", "2", "--moe-experts", "8", "--ep", "2"], MEMORY_MODEL, 4, 1),
                "ep": (["--moe-experts", "8", "--ep", "4"], MEMORY_MODEL, 8, 1),
                "pp": (["--pp", "2"], MEMORY_MODEL, 8, 1)}


def build_run(rank, world, flags, config_kw, global_batch, micro, dtype, device, materialize=True, param_dtype=None,
              measure=False):
    """train.compose on the flags, as train.main builds a run, in `dtype` (master weights; the working weights
    too unless `param_dtype`)."""
    from cli import flags as flags_lib
    import train
    from mesh import build_mesh

    base = make_config(**config_kw)
    shape_flags = ["--n-layer", str(base.n_layer), "--n-head", str(base.n_head), "--n-embd", str(base.n_embd),
                   "--seq-len", str(SEQ)]
    args = _parse([*shape_flags, *flags], global_batch, micro)
    settings = flags_lib.validate(args, world, axes=train.AXES)
    config = _config(args, config_kw)
    settings = replace(settings, model=config)
    run = train.Run(settings=settings, mesh=build_mesh(settings.shape, rank), config=config, device=device, seed=0,
                    compute_dtype=dtype, param_dtype=param_dtype or dtype, master_dtype=dtype)
    for name, group in run.mesh.groups.items():
        if group is not None:  # named as train.py names them: the predictions use the tracer's names
            run.tracer.name_group(group, name)
    if measure:  # as train.main: block 0 measured for the start-up lines, before the layout
        return train.compose(run, measure=True)
    return train.compose(run) if materialize else train.compose(run, materialize=False)


def accounting(run) -> dict:
    """What a plan prints of a layout: its predicted persistent bytes, its held bytes, every predicted message."""
    import report.run
    return {"persistent": run.layout.predicted_persistent(), "held": run.layout.held_bytes(),
            "messages": dict(report.run.predicted_messages(run))}


def start_values(run) -> list:
    """[(key, local tensor, ShardInfo, flat range)] of the parameters and masters this rank starts from."""
    return [(piece.key, piece.tensor.detach().clone(), piece.shard, piece.flat_range)
            for piece in run.layout.state_pieces() if piece.key.split("/")[0] in ("param", "master")]


def transient_bound(model, dtype: torch.dtype, fingerprints: bool = False, zero3_units: int = 0) -> int:
    """The stated transient of a start-up, in bytes: one logical tensor at a time. materialize (and ZeRO-3's fill)
    samples it in fp32, casts it to `dtype`, and copies out the local piece: G·(4 + e) + L·e at most for the
    largest; with `fingerprints`, DDP's same-init check holds one local tensor's fingerprint in float64 (its
    copy, the position weights and their product: 3·8·L). L: local elements, G: logical ones, e: dtype's bytes.
    ZeRO-3 over `zero3_units` = D ranks also allocates one unit's working buffer (a block's, or the root's:
    n'·e, n' ≤ n + D) to make its parameters' views, and shrinks it to 0 bytes at once."""
    e = dtype.itemsize
    sample = 4 + (e if dtype != torch.float32 else 0)
    params = list(model.parameters())
    materialise = max(torch.Size(p.shard_info.global_shape).numel() * sample + p.numel() * e for p in params)
    fingerprint = max(3 * 8 * p.numel() for p in params) if fingerprints else 0
    blocks = [list(block.parameters()) for block in model.transformer.h]
    in_blocks = {id(p) for block in blocks for p in block}
    units = [*blocks, [p for p in params if id(p) not in in_blocks]]
    unit = max(sum(p.numel() for p in members) + zero3_units for members in units) * e if zero3_units else 0
    return max(materialise, fingerprint, unit)


def profiled_start_up(build):
    """(build()'s run, its memory) from torch.profiler's running sum of every CPU allocation and free (its raw
    "[memory]" events, in time order): {"peak", "final"} over the whole start-up, and {"model_peak", "model_end"}
    over the part before train.build_layout (the model and the axes: the parameters alone)."""
    import train
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    build_layout = train.build_layout

    def marked(*args):
        with record_function("build_layout"):
            return build_layout(*args)

    train.build_layout = marked
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            run = build()
    finally:
        train.build_layout = build_layout
    events = prof.profiler.kineto_results.events()
    layout_start = next(e.start_ns() for e in events if e.name() == "build_layout")
    memory = dict(peak=0, final=0, model_peak=0, model_end=0)
    for event in sorted((e for e in events if e.name() == "[memory]" and e.device_type() == DeviceType.CPU),
                        key=lambda e: e.start_ns()):
        memory["final"] += event.nbytes()
        memory["peak"] = max(memory["peak"], memory["final"])
        if event.start_ns() < layout_start:
            memory["model_end"] = memory["final"]
            memory["model_peak"] = memory["peak"]
    return run, memory


def _real_builds(rank, world):
    out = {"bitwise": {}, "accounting": {}, "memory": {}}
    for dtype in (torch.float64, torch.float32):
        for name in BITWISE:
            out["bitwise"][(name, dtype)] = start_values(build_run(rank, world, *BUILD_CASES[name], dtype,
                                                                   torch.device("cpu")))
    for name in ("zero1", "zero3"):  # bf16 working weights, fp32 masters (--dtype bf16)
        run = build_run(rank, world, *BUILD_CASES[name], torch.float32, torch.device("cpu"),
                        param_dtype=torch.bfloat16)
        out["bitwise"][(name, torch.bfloat16)] = start_values(run)
    for name, case in BUILD_CASES.items():
        out["accounting"][name] = accounting(build_run(rank, world, *case, torch.float32, torch.device("cpu")))
    out["sample"] = {name: sampled(build_run(rank, world, BUILD_CASES[name][0] + ["--sample-tokens", "12"],
                                             *BUILD_CASES[name][1:], torch.float32, torch.device("cpu")))
                     for name in ("zero3", "zero3_tp_ep")}
    measured = build_run(rank, world, *BUILD_CASES["zero3_tp_ep"], torch.float32, torch.device("cpu"), measure=True)
    out["measured"] = (measured.measured.saved_bytes, start_values(measured))
    for name, case in MEMORY_CASES.items():
        dist.barrier()
        run, memory = profiled_start_up(lambda: build_run(rank, world, *case, torch.float32, torch.device("cpu")))
        out["memory"][name] = dict(memory, held=run.layout.held_bytes()["total"],
                                   transient=transient_bound(run.model, torch.float32, run.settings.args.zero == 0,
                                                             world if run.settings.args.zero == 3 else 0))
    return out


PROMPT = [(7 * i) % 64 for i in range(32)]


def sampled(run) -> dict:
    """train.sample's printout, and what is gathered after it: the working weights' bytes and the most units
    gathered at once (ZeRO-3's schedule)."""
    import contextlib
    import io

    import numpy as np

    import train

    class Tokens:
        tokens = np.array(PROMPT)

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        train.sample(run, Tokens(), "byte")
    gathered_bytes = sum(p.untyped_storage().nbytes() for p in run.model.parameters())
    return dict(text=printed.getvalue(), gathered_bytes=gathered_bytes,
                peak_gathered_units=run.layout.peak_gathered_units)


@pytest.fixture(scope="module")
def real_builds():
    return run_ranks(_real_builds, WORLD, timeout=600)


@pytest.mark.parametrize("name,dtype", [(name, dtype) for dtype in (torch.float64, torch.float32) for name in BITWISE]
                         + [("zero1", torch.bfloat16), ("zero3", torch.bfloat16)],
                         ids=lambda v: str(v).removeprefix("torch."))
def test_shards_built_on_meta_equal_the_single_device_init_bitwise(real_builds, name, dtype):
    """dtype bfloat16: fp32 masters, bf16 working weights (the masters cast, as the packed path casts them)."""
    from reference import build_model

    flags, config_kw, *_ = BUILD_CASES[name]
    master = torch.float32 if dtype == torch.bfloat16 else dtype
    reference = {p.shard_info.global_name: p.detach() for p in
                 build_model(_config(_parse(flags, 8, 1), config_kw), seed=0, dtype=master).parameters()}
    seen = set()
    for rank, results in enumerate(real_builds):
        for key, tensor, info, flat_range in results["bitwise"][(name, dtype)]:
            expected = info.shard_of(reference[info.global_name])
            if flat_range is not None:
                expected = expected.reshape(-1)[flat_range[0]:flat_range[1]]
            expected = expected.to(dtype if key.startswith("param/") else master)
            assert tensor.dtype == expected.dtype and tensor.shape == expected.shape, (rank, key)
            assert torch.equal(tensor, expected), (rank, key)
            seen.add(info.global_name)
    assert seen == set(reference)  # every logical tensor starts somewhere


@pytest.mark.parametrize("name", MEMORY_CASES)
def test_start_up_never_holds_more_than_its_kept_bytes_plus_one_logical_tensor(real_builds, name):
    for rank, results in enumerate(real_builds):
        m = results["memory"][name]
        assert m["held"] <= m["final"], (rank, m)  # what the layout says it holds was allocated in compose
        assert m["model_peak"] <= m["model_end"] + m["transient"], (rank, m)  # building the kept parameters
        assert m["peak"] <= m["final"] + m["transient"], (rank, m)  # and the whole start-up, layout included
    assert max(m["transient"] for m in (r["memory"][name] for r in real_builds)) < MODEL_BYTES / 2  # far from the model


def _fake_build(rank, world, case, device):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        run = build_run(rank, world, *case, torch.float32, device, materialize=False)
        return run, accounting(run)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", list(BUILD_CASES))
def test_compose_on_meta_in_a_fake_group_predicts_what_the_real_build_does(real_builds, name):
    for rank in range(WORLD):
        run, planned = _fake_build(rank, WORLD, BUILD_CASES[name], torch.device("meta"))
        tensors = [*run.model.parameters(), *run.model.buffers()]
        assert tensors and all(t.is_meta for t in tensors), name  # nothing of the model was allocated
        real = real_builds[rank]["accounting"][name]
        assert planned["persistent"] == real["persistent"], (name, rank)
        assert planned["held"] == real["held"], (name, rank)
        assert planned["messages"] == real["messages"], (name, rank)


@pytest.mark.parametrize("name", ["zero3", "zero3_tp_ep"])
def test_the_end_of_run_sample_runs_through_the_layout_and_frees_every_block(real_builds, name):
    """The whole model is never gathered: ZeRO-3 gathers a block at a time in each generate forward (at most two
    units at once) and frees them after it; the tokens are the single-device model's (D = 4 alone: the same
    weights, the same ops)."""
    import data
    from reference import build_model

    for rank, results in enumerate(real_builds):
        out = results["sample"][name]
        assert out["gathered_bytes"] == 0 and 0 < out["peak_gathered_units"] <= 2, (rank, out)
    if name == "zero3":
        flags, config_kw, *_ = BUILD_CASES[name]
        model = build_model(_config(_parse(flags, 8, 1), config_kw), seed=0).eval()
        tokens = model.generate(torch.tensor([PROMPT]), 12, temperature=0.8, top_k=50,
                                generator=torch.Generator().manual_seed(0))
        text = data.get_tokenizer("byte").decode(tokens[0].tolist())
        assert real_builds[0]["sample"][name]["text"].splitlines()[1:] == text.splitlines()


def test_block_zero_is_measured_at_start_up_on_a_zero3_meta_model(real_builds):
    """train.main's compose(measure=True) under ZeRO-3 × TP: measure.measure_block runs a materialised copy of the
    meta block 0 (the model itself stays unmaterialised: the shards are the same as without measuring)."""
    for results in real_builds:
        saved, values = results["measured"]
        assert saved > 0
        reference = results["bitwise"][("zero3_tp_ep", torch.float32)]
        for (key, tensor, _, _), (key_0, tensor_0, _, _) in zip(values, reference):
            assert key == key_0 and torch.equal(tensor, tensor_0), key
