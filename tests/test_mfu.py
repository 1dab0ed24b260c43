"""Tests for mfu.py: every formula against numbers worked out by hand and the peak table (the tracer that
measures the messages is tested in test_tracer.py; the memory formulas in test_memory.py)."""

import math
import time
import types

import pytest
import torch

from accounting import format_flops, memory
from cli import flags
import mfu
import model
from planner import hardware
from reference import build_model, make_config
import plan
import report.axes
import train

# ---------------------------------------------------------------------------------------------------------
# FLOPs and MFU
# ---------------------------------------------------------------------------------------------------------


# N = 1000 matmul params (900 of them in the blocks, 100 the head's), L = 2 layers, H = 4 heads, Q = 8 head dim.
COUNTS = {"active_matmul": 1000, "block_matmul": 900}


def _config(recompute: bool = False, selective: bool = False):
    return types.SimpleNamespace(n_layer=2, n_head=4, head_dim=8, activation_checkpointing=recompute,
                                 selective_recompute=selective)


def test_hfu_of_selective_recompute_adds_the_core_attention_on_the_math_path_only():
    """Selective recompute keeps every GEMM's output: the fused path reruns no counted FLOP; the math path reruns
    q·kᵀ and ·v, 4*L*H*Q*T = 4*2*4*8*16 = 4096."""
    fused = mfu.flops_per_token(COUNTS, _config(selective=True), 16, "fused")
    math_path = mfu.flops_per_token(COUNTS, _config(selective=True), 16, "math")
    assert fused.hardware == fused.model == math_path.model
    assert math_path.hardware - math_path.model == 4096


@pytest.mark.parametrize("dropout,fp8", [(0.0, None), (0.1, None), (0.0, "current")])  # fused, math, FP8
def test_selective_recompute_of_moe_blocks_reruns_the_flops_hfu_counts(dropout, fp8):
    """What a training step of MoE blocks under selective recompute really computes more than without recompute
    (torch's FlopCounterMode: the GEMMs and the attention kernels, recompute included) is hardware − model
    per token: no GEMM (the attention side keeps them, FP8's emulated one too; the MoE side, its router and
    experts run once), and on the math path the core attention, 4*L*H*Q*T."""
    from torch.utils.flop_counter import FlopCounterMode

    import fp8 as fp8_lib

    counted = {}
    for selective in (False, True):
        config = make_config(n_layer=2, n_head=4, n_embd=64, dropout=dropout, moe_experts=4, moe_shared_experts=1,
                             selective_recompute=selective)
        gpt = build_model(config, seed=0, dtype=torch.float64)
        if fp8:
            fp8_lib.convert(gpt, fp8_lib.Recipe(fp8))
        idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
        with FlopCounterMode(display=False) as counter:
            _, loss, _ = gpt(idx, idx)
            loss.backward()
        counted[selective] = counter.get_total_flops()
    kernel = "math" if dropout else "fused"
    flops = mfu.flops_per_token({"active_matmul": 0, "block_matmul": 0}, config, 32, kernel)
    assert counted[True] - counted[False] == (flops.hardware - flops.model) * 2 * 32, counted
    assert (counted[True] > counted[False]) == (kernel == "math"), counted


def test_flops_per_token_small_config():
    # T = 16 tokens: 6N = 6000; 12*L*H*Q*T = 12*2*4*8*16 = 12288; total 18288.
    f = mfu.flops_per_token(COUNTS, _config(), seq_len=16)
    assert f.model == 18288
    assert f.hardware == f.model  # nothing recomputed
    assert "6N + 12*L*H*Q*T" in f.convention and "not halved" in f.convention


def test_hfu_adds_recomputed_forward():
    # Only the block weights are recomputed (the head's 100 are not): + 2*N_r + 4*L*H*Q*T = 1800 + 4096
    f = mfu.flops_per_token(COUNTS, _config(recompute=True), 16)
    assert f.model == 18288
    assert f.hardware == 18288 + 1800 + 4096
    assert "N_r = 900" in f.convention


def test_mfu_and_hfu():
    f = mfu.flops_per_token(COUNTS, _config(recompute=True), 16)
    # 18288 FLOP/token * 1e6 token/s = 1.8288e10 FLOP/s over 2 devices of 1e10 each -> 0.9144
    assert mfu.mfu(f.model, 1e6, 1e10, 2) == pytest.approx(0.9144)
    assert mfu.mfu(f.hardware, 1e6, 1e10, 2) == pytest.approx((18288 + 5896) * 1e6 / 2e10)
    with pytest.raises(ValueError):
        mfu.mfu(f.model, 1e6, 0.0, 1)


# ---------------------------------------------------------------------------------------------------------
# Peaks
# ---------------------------------------------------------------------------------------------------------

CUDA0 = torch.device("cuda", 0)


@pytest.fixture
def gpu(monkeypatch):
    """Pretend cuda:0 is the GPU called `name` with `sms` SMs: gpu("NVIDIA H100 PCIe", 114)."""
    def pretend(name, sms):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        props = types.SimpleNamespace(name=name, multi_processor_count=sms, total_memory=80 * 2**30)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    return pretend


@pytest.fixture
def tf32_highest():
    """fp32 matmuls in full FP32 (torch's default) during the test, whatever it set; restored afterwards."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


@pytest.fixture
def measured(monkeypatch):
    """Replace the matmul loop (it would need a real GPU) by one that records its arguments."""
    calls = []

    def fake(dtype=torch.bfloat16, n=1024, seconds=0.3, device="cpu", repeats=1):
        calls.append((dtype, torch.device(device)))
        return 123e12
    monkeypatch.setattr(mfu, "measure_matmul_peak", fake)
    return calls


def test_peak_table():
    peaks = mfu.PEAK_TFLOPS
    assert peaks["A100"]["bf16"] == 312.0 and peaks["A100"]["fp8"] is None
    assert peaks["H100"] == {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9,
                             "mxfp8": None, "mxfp4": None, "nvfp4": None}  # no block-scaled GEMM, no FP4
    assert peaks["H200"] == peaks["H800"] == peaks["GH200"] == peaks["H100"]  # the same GH100 configuration
    assert peaks["H800 PCIe"] == peaks["H100 PCIe"] and peaks["H200 NVL"] == peaks["H100 NVL"]
    assert peaks["H100 PCIe"]["bf16"] < peaks["H100 NVL"]["bf16"] < peaks["H100"]["bf16"]
    assert peaks["B200"]["fp8"] == 4500.0 and peaks["GB200"]["bf16"] == 2500.0 != peaks["B200"]["bf16"]
    for row, p in peaks.items():  # every row has both fp32 columns, and tensor cores beat the CUDA cores
        assert 0 < p["fp32"] <= p["tf32"] < p["bf16"] == p["fp16"], row
        assert p["fp8"] is None or p["fp8"] == pytest.approx(2 * p["bf16"], rel=0.01), row
    # HGX B200's datasheet per GPU, dense (half of its sparse figures): FP8 and MXFP8 4.5 PF, FP4 (NVFP4, MXFP4) 9 PF
    assert (peaks["B200"]["mxfp8"], peaks["B200"]["nvfp4"], peaks["B200"]["mxfp4"]) == (4500.0, 9000.0, 9000.0)
    assert peaks["GB200"]["nvfp4"] == 10000.0  # GB200 NVL72: 1,440* PF FP4 for 72 GPUs
    blackwell = {"B200", "GB200"}
    for row, p in peaks.items():  # only Blackwell's tensor cores take block scales
        assert all(p[fmt] is None for fmt in ("mxfp8", "mxfp4", "nvfp4")) == (row not in blackwell), row


@pytest.mark.parametrize("name, sms, row", [
    ("NVIDIA H100 80GB HBM3", 132, "H100"),  # SXM5
    ("NVIDIA H100 PCIe", 114, "H100 PCIe"),
    ("NVIDIA H100 NVL", 132, "H100 NVL"),
    ("NVIDIA H200", 132, "H200"),
    ("NVIDIA H200 NVL", 132, "H200 NVL"),
    ("NVIDIA GH200 480GB", 132, "GH200"),
    ("NVIDIA H800", 132, "H800"),
    ("NVIDIA H800 PCIe", 114, "H800 PCIe"),
    ("NVIDIA H20", 78, "H20"),
    ("NVIDIA A100-SXM4-80GB", 108, "A100"),
    ("NVIDIA A100-PCIE-40GB", 108, "A100"),
    ("NVIDIA A100 80GB PCIe", 108, "A100"),
    ("NVIDIA A10", 72, "A10"),
    ("NVIDIA L4", 58, "L4"),
    ("NVIDIA L40", 142, "L40"),
    ("NVIDIA L40S", 142, "L40S"),
    ("NVIDIA B200", 148, "B200"),
    ("NVIDIA GB200", 152, "GB200"),
    ("NVIDIA A10G", 80, None),  # no NVIDIA datasheet: measured
    ("NVIDIA H100 80GB HBM3", 16, None),  # a MIG slice: a fraction of the peak
    ("Tesla T4", 40, None),
])
def test_gpu_row_matches_the_exact_variant(name, sms, row):
    assert mfu.gpu_row(name, sms) == row


def test_detect_peak_h100_variants_differ(gpu, tf32_highest):
    found = {}
    for name, sms in [("NVIDIA H100 80GB HBM3", 132), ("NVIDIA H100 PCIe", 114), ("NVIDIA H100 NVL", 132)]:
        gpu(name, sms)
        found[name] = mfu.detect_peak_flops(CUDA0, "bf16", None)
        assert name in found[name][1] and f"{sms} SMs" in found[name][1]
    assert [flops / 1e12 for flops, _ in found.values()] == pytest.approx([989.4, 756.5, 835.5])
    assert [source.split(" (")[0] for _, source in found.values()] == [
        "table: row H100", "table: row H100 PCIe", "table: row H100 NVL"]
    flops, _ = mfu.detect_peak_flops(CUDA0, "bfloat16", None)  # torch spelling works too
    assert flops == pytest.approx(835.5e12)


def test_gb200_is_not_b200(gpu):
    gpu("NVIDIA GB200", 152)
    flops, source = mfu.detect_peak_flops(CUDA0, "bf16", None)
    assert flops == pytest.approx(2500e12) and "row GB200" in source
    gpu("NVIDIA B200", 148)
    flops, source = mfu.detect_peak_flops(CUDA0, "fp8", None)
    assert flops == pytest.approx(4500e12) and "row B200" in source


def test_fp32_peak_follows_tf32(gpu, tf32_highest):
    gpu("NVIDIA A100-SXM4-80GB", 108)
    flops, source = mfu.detect_peak_flops(CUDA0, "fp32", None)
    assert flops == pytest.approx(19.5e12) and "FP32 peak" in source and "TF32 matmuls off" in source
    torch.set_float32_matmul_precision("high")  # what most GPU training scripts set
    flops, source = mfu.detect_peak_flops(CUDA0, "fp32", None)
    assert flops == pytest.approx(156e12) and "TF32 tensor-core peak" in source
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = True  # the older switch
    try:
        flops, _ = mfu.detect_peak_flops(CUDA0, "fp32", None)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
    assert flops == pytest.approx(156e12)


def test_unknown_gpu_warns_and_measures(gpu, measured, capsys):
    gpu("NVIDIA A10G", 80)
    flops, source = mfu.detect_peak_flops(CUDA0, "bf16", None)  # does not raise
    assert flops == 123e12 and measured == [(torch.bfloat16, CUDA0)]
    assert source.startswith("measured") and "'NVIDIA A10G' with 80 SMs matches no PEAK_TFLOPS row" in source
    warning = capsys.readouterr().err.strip().splitlines()
    assert len(warning) == 1 and "warning" in warning[0] and "A10G" in warning[0] and "--peak-tflops" in warning[0]

    flops, source = mfu.detect_peak_flops(CUDA0, "bf16", 70.0)  # an override needs no table and no measurement
    assert flops == 70e12 and "override" in source and len(measured) == 1
    assert capsys.readouterr().err == ""


def test_dtype_without_peak_warns_and_measures(gpu, measured, capsys):
    gpu("NVIDIA A100-SXM4-80GB", 108)  # Ampere has no FP8 tensor cores
    flops, source = mfu.detect_peak_flops(CUDA0, "fp8", None)
    assert flops == 123e12 and measured == [(torch.bfloat16, CUDA0)]  # fp8 has no plain matmul: bf16's
    assert "row A100" in source and "no fp8 peak" in source and "bf16 matmul loop" in source
    assert "no fp8 peak" in capsys.readouterr().err


def test_detect_peak_override_wins(gpu):
    gpu("Tesla T4", 40)
    flops, source = mfu.detect_peak_flops(CUDA0, "bf16", 65.0)
    assert flops == 65e12 and "override" in source
    flops, _ = mfu.detect_peak_flops(torch.device("cpu"), "bf16", 1.5)  # no measurement either
    assert flops == 1.5e12
    with pytest.raises(ValueError, match="positive"):
        mfu.detect_peak_flops(CUDA0, "bf16", 0.0)


def test_cpu_peak_is_measured_quickly():
    start = time.perf_counter()
    flops = mfu.measure_matmul_peak(torch.float32, n=256, seconds=0.05)
    assert flops > 0 and time.perf_counter() - start < 2.0

    flops, source = mfu.detect_peak_flops(torch.device("cpu"), "fp32", None)
    assert flops > 0 and "measured" in source and "fp32" in source


def test_matmul_loop_syncs_per_batch_not_per_matmul(monkeypatch):
    log = []  # "sync" and "mm" in the order they happened
    monkeypatch.setattr(mfu, "_sync", lambda device: log.append("sync"))
    monkeypatch.setattr(torch, "mm", lambda *args, **kwargs: log.append("mm") or time.sleep(0.001))  # ~1 ms
    flops = mfu.measure_matmul_peak(torch.float32, n=64, seconds=0.05)
    batches = "".join("S" if e == "sync" else "m" for e in log).split("S")[1::2]  # between the pairs of syncs
    assert "".join(batches).count("m") == log.count("mm")  # every matmul inside a timed batch
    assert len(batches) >= 3 and max(len(b) for b in batches) > 1  # not one sync per matmul
    assert len(batches[-1]) == max(len(b) for b in batches)  # the timed one: calibration scaled it up to `seconds`
    assert flops > 0


# ---------------------------------------------------------------------------------------------------------
# FLOPs by format (accounting/format_flops.py)
# ---------------------------------------------------------------------------------------------------------

SMALL = model.config_from_preset("small")  # L = 6, h = 384, H = 6, V = 256, T = 256
LINEARS = 12 * 384**2  # per block: c_attn 3h², attn.c_proj h², c_fc 4h², mlp.c_proj 4h²
TOTAL = 6 * (6 * LINEARS + 256 * 384) + 12 * 6 * 384 * 256  # 6N (blocks and head) + 12·L·H·Q·T = 71,368,704


def test_flops_by_format_puts_each_gemm_in_its_recipe_format():
    """By hand: the forward GEMMs of the quantised blocks' linears are 2 FLOPs per weight, the two backward
    GEMMs 4; the head, attention and the tail blocks stay in the compute dtype; every FLOP is counted once."""
    assert format_flops.flops_by_format(SMALL, 256, "bf16", "bf16", "bf16") == {"bf16": TOTAL}
    assert format_flops.flops_by_format(SMALL, 256, "nvfp4", "bf16", "bf16") == {
        "nvfp4": 2 * 6 * LINEARS, "bf16": TOTAL - 2 * 6 * LINEARS}
    tail = format_flops.flops_by_format(SMALL, 256, "nvfp4", "mxfp8", "bf16", tail_layers=1)  # ⌈0.15·6⌉ = 1 block
    assert tail == {"nvfp4": 2 * 5 * LINEARS, "mxfp8": 4 * 5 * LINEARS, "bf16": TOTAL - 6 * 5 * LINEARS}
    fp8 = format_flops.flops_by_format(SMALL, 256, "fp8", "fp8", "fp32")  # --fp8, an fp32 run: one narrow format
    assert fp8 == {"fp8": 6 * 6 * LINEARS, "fp32": TOTAL - 6 * 6 * LINEARS}
    assert sum(tail.values()) == TOTAL == mfu.flops_per_token(memory.param_counts(SMALL), SMALL, 256).model
    with pytest.raises(ValueError, match="tail_layers"):
        format_flops.flops_by_format(SMALL, 256, "nvfp4", "nvfp4", "bf16", tail_layers=7)


def test_mfu_against_the_format_weighted_peak():
    """One FLOP at 1000 and three at 4000 FLOP/s: ideal time 1/1000 + 3/4000 = 1.75 ms for 4 FLOPs, so
    P_w = 4 / 1.75e-3; at 100 tokens/s over 2 devices MFU = 100/2 · 1.75e-3."""
    flops, peaks = {"bf16": 1.0, "nvfp4": 3.0}, {"bf16": 1000.0, "nvfp4": 4000.0}
    assert format_flops.format_weighted_peak(flops, peaks) == pytest.approx(4 / 1.75e-3)
    assert format_flops.format_mfu(flops, 100.0, peaks, 2) == pytest.approx(100 / 2 * 1.75e-3)
    assert format_flops.format_weighted_peak({"bf16": 5.0}, peaks) == 1000.0  # one format: its own peak


def test_b200_preset_and_formats_a_part_has_no_gemm_for():
    """The B200 row's figures (HGX B200 datasheet), and an H100 (no FP4, no block-scaled GEMM) that runs NVFP4 and
    MXFP8 emulated, at the compute dtype's rate."""
    b200 = hardware.PRESETS["b200"]
    assert (b200.peak("bf16"), b200.peak("mxfp8"), b200.peak("nvfp4")) == (2250e12, 4500e12, 9000e12)
    assert (b200.hbm_gbps, b200.memory_gib, b200.intra_gbps, b200.inter_gbps) == (8000, 180e9 / 2**30, 900, 50)
    with pytest.raises(hardware.NoPeakKnown, match="h100 knows no nvfp4 matmul peak [(]no block-scaled GEMM, no FP4"):
        hardware.PRESETS["h100"].peak("nvfp4")
    flops = {"nvfp4": 2.0, "mxfp8": 4.0, "bf16": 1.0}
    peaks, emulated = format_flops.format_peaks(hardware.PRESETS["h100"], flops, "bf16")
    assert peaks == {"nvfp4": 989.4e12, "mxfp8": 989.4e12, "bf16": 989.4e12} and emulated == ["nvfp4", "mxfp8"]
    peaks, emulated = format_flops.format_peaks(b200, flops, "bf16")
    assert peaks == {"nvfp4": 9000e12, "mxfp8": 4500e12, "bf16": 2250e12} and emulated == []
    line = format_flops.weighted_peak_line(flops, hardware.PRESETS["h100"], "bf16")
    assert "989 TFLOP/s on h100" in line and "nvfp4, mxfp8: no such GEMM on h100, emulated at the bf16 rate" in line


def test_a_recipe_states_its_flops_by_format_and_the_b200_peak_at_start():
    """--precision-recipe's start-up line: the model FLOPs by format (the tail block's linears in the compute dtype)
    and the format-weighted peak a block-scaled kernel would run at on a B200. Built as --plan builds a rank."""
    argv = ["--preset", "tiny", "--precision-recipe", "fwd=nvfp4,bwd=mxfp8,tail=0.5", "--dtype", "bf16",
            "--global-batch", "1", "--micro-batch", "1"]
    settings = plan.plan_settings(flags.validate(flags.build_parser().parse_args(argv), 1, axes=train.AXES))
    with plan.fake_world(0, 1):
        run = plan.build_role(settings, 0)
        handle = next(axis for axis in run.axes if axis.name == "precision")
        text = "\n".join(report.axes.axis_lines(handle, "startup", run))
    h, total = 64, run.flops.model  # tiny: L = 2, h = 64; tail 0.5 keeps block 1 in bf16, block 0 is quantised
    fwd, bwd = 2 * 12 * h * h, 4 * 12 * h * h
    assert (f"model FLOPs by format nvfp4 {fwd / total:.1%}, mxfp8 {bwd / total:.1%},"
            f" bf16 {(total - fwd - bwd) / total:.1%}") in text
    p_w = total / (fwd / 9000 + bwd / 4500 + (total - fwd - bwd) / 2250)  # B200 dense TFLOP/s
    assert f"P_w = ΣF / Σ F_f/P_f = {p_w:,.0f} TFLOP/s on b200" in text


# ---------------------------------------------------------------------------------------------------------
# Communication, bubble, Young, formatting
# ---------------------------------------------------------------------------------------------------------


def test_wire_byte_formulas():
    m = 1200
    assert mfu.wire_bytes("all_reduce", m, 4) == 1800  # 2 * 3/4 * 1200
    assert mfu.wire_bytes("all_gather_into_tensor", m, 4) == 900
    assert mfu.wire_bytes("reduce_scatter_tensor", m, 4) == 900
    assert mfu.wire_bytes("all_to_all_single", m, 3) == 800
    assert mfu.wire_bytes("broadcast", m, 8) == 1200
    assert mfu.wire_bytes("send", m, 2) == 1200 and mfu.wire_bytes("recv", m, 2) == 0
    assert mfu.wire_bytes("all_reduce", m, 1) == 0  # nothing to talk to
    with pytest.raises(ValueError):
        mfu.wire_bytes("gossip", m, 2)


def test_young_checkpoint_interval():
    # 60 s to checkpoint, one failure a day: sqrt(2 * 60 * 86400) = 3220 s, about 54 min
    assert mfu.young_checkpoint_interval(60, 86400) == pytest.approx(math.sqrt(2 * 60 * 86400))
    assert mfu.young_checkpoint_interval(50, 100) == pytest.approx(100)


def test_formatting():
    assert mfu.format_bytes(512) == "512 B"
    assert mfu.format_bytes(1536) == "1.50 KiB"
    assert mfu.format_bytes(3 * 2**20) == "3.00 MiB"
    assert mfu.format_bytes(80 * 2**30) == "80.00 GiB"
    assert mfu.format_flops(312e12) == "312.00 TFLOP"
    assert mfu.format_flops(1.5e9) == "1.50 GFLOP"


def test_a_recipes_step_mfu_divides_by_the_format_weighted_peak():
    """With --precision-recipe run.peak is P_w of the run's FLOPs by format on its device (train.start_training):
    on a B200 row each format at its datasheet peak (P_w by hand from the same FLOPs); here, a CPU, every narrow
    format emulated, so P_w is the compute dtype's peak itself, and the peak line says which."""
    argv = ["--preset", "tiny", "--precision-recipe", "fwd=nvfp4,bwd=mxfp8,tail=0.5", "--dtype", "bf16",
            "--global-batch", "1", "--micro-batch", "1"]
    def role(argv):
        return plan.build_role(plan.plan_settings(flags.validate(flags.build_parser().parse_args(argv), 1,
                                                                 axes=train.AXES)), 0)

    with plan.fake_world(0, 1):
        run = role(argv)
        peak, how = format_flops.run_peak(run, (1.8e9, "measured: a matmul loop"))
        plain = format_flops.run_peak(role(argv[:2] + argv[4:]), (1.8e9, "measured"))
    assert plain == (1.8e9, "measured")  # no recipe: the compute dtype's peak, as it was
    assert peak == pytest.approx(1.8e9, rel=1e-12)
    assert "format-weighted P_w" in how and "nvfp4, mxfp8 emulated at the bf16 rate" in how
    assert "the step line's MFU divides by it; bf16: measured: a matmul loop" in how
    h, total = 64, run.flops.model
    flops = {"nvfp4": 2 * 12 * h * h, "mxfp8": 4 * 12 * h * h}
    flops["bf16"] = total - flops["nvfp4"] - flops["mxfp8"]
    b200 = {fmt: mfu.PEAK_TFLOPS["B200"][fmt] * 1e12 for fmt in flops}
    p_w, how = format_flops.recipe_peak(flops, b200, [], "bf16", (b200["bf16"], "table"))
    assert p_w == pytest.approx(total / (flops["nvfp4"] / 9000e12 + flops["mxfp8"] / 4500e12
                                         + flops["bf16"] / 2250e12), rel=1e-12)
    assert "nvfp4 at 9000 TFLOP/s; mxfp8 at 4500 TFLOP/s" in how and "emulated" not in how


def test_a_cpu_peak_measured_while_other_work_shared_the_cores_says_so():
    """The matmul loop's process had less CPU time than wall time × its threads (load_note: below LOADED_SHARE):
    its source says it was measured under load, and why an MFU against it cannot be trusted; alone, nothing."""
    assert mfu.load_note(0.95, 1.0, 1) == "" and mfu.load_note(1.7, 1.0, 2) == ""
    note = mfu.load_note(0.4, 1.0, 1)
    assert mfu.peak_under_load(note) and "ran 40% of the time its 1 thread asked for" in note, note
    assert mfu.peak_under_load(mfu.load_note(1.5, 1.0, 2))  # 75% of 2 threads


def test_the_measured_peaks_source_carries_the_load(monkeypatch):
    """detect_peak_flops on a CPU whose measuring process got no CPU time (process_time frozen): under load."""
    flops, source = mfu.detect_peak_flops(torch.device("cpu"), "fp32", None)
    monkeypatch.setattr(mfu.time, "process_time", lambda: 0.0)
    _, loaded = mfu.detect_peak_flops(torch.device("cpu"), "fp32", None)
    assert mfu.peak_under_load(loaded) and "measured: " in loaded, loaded


def test_an_mfu_against_a_peak_measured_under_load_is_marked_not_alarmed(capsys):
    """The issue's "MFU 248.69%!": against a peak measured under load every step line's MFU is marked "?" (not
    capped: it is what it is against that peak), and one line says what it is and why it cannot be trusted."""
    import report.run

    clock = report.run.Progress(0, 10, peak_under_load=True)
    record = dict(step=0, loss=1.0, lr=1e-3, grad_norm=0.5, skipped=False, tokens_per_s=10.0, mfu=2.4869,
                  step_time_s=0.1)
    for step, value in ((0, 2.4869), (1, 0.3)):
        report.run.print_step(dict(record, step=step, mfu=value), clock)
    out = capsys.readouterr().out
    assert "MFU 248.69%? |" in out and "MFU 30.00%? |" in out and "!" not in out, out
    assert out.count("MFU against a peak measured under load") == 1 and "cannot be trusted" in out, out
