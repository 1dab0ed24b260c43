"""Tests for mfu.py: every formula against numbers worked out by hand and the peak table (the tracer that
measures the messages is tested in test_comm.py; the memory formulas in test_memory.py)."""

import math
import time
import types

import pytest
import torch

import mfu

# ---------------------------------------------------------------------------------------------------------
# FLOPs and MFU
# ---------------------------------------------------------------------------------------------------------


# N = 1000 matmul params (900 of them in the blocks, 100 the head's), L = 2 layers, H = 4 heads, Q = 8 head dim.
COUNTS = {"active_matmul": 1000, "block_matmul": 900}


def _config(recompute: bool = False):
    return types.SimpleNamespace(n_layer=2, n_head=4, head_dim=8, activation_checkpointing=recompute)


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
    assert peaks["H100"] == {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9}
    assert peaks["H200"] == peaks["H800"] == peaks["GH200"] == peaks["H100"]  # the same GH100 configuration
    assert peaks["H800 PCIe"] == peaks["H100 PCIe"] and peaks["H200 NVL"] == peaks["H100 NVL"]
    assert peaks["H100 PCIe"]["bf16"] < peaks["H100 NVL"]["bf16"] < peaks["H100"]["bf16"]
    assert peaks["B200"]["fp8"] == 4500.0 and peaks["GB200"]["bf16"] == 2500.0 != peaks["B200"]["bf16"]
    for row, p in peaks.items():  # every row has both fp32 columns, and tensor cores beat the CUDA cores
        assert 0 < p["fp32"] <= p["tf32"] < p["bf16"] == p["fp16"], row
        assert p["fp8"] is None or p["fp8"] == pytest.approx(2 * p["bf16"], rel=0.01), row


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
