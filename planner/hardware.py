"""The hardware model the plan predicts step times with: what a device computes, what its links move, how long.

A stated model, every figure a flag (`--hw-*`), so a prediction can be checked by hand and argued with:

    compute     t = FLOPs / peak(dtype)            matmuls at the datasheet's dense peak (mfu.PEAK_TFLOPS)
                  + bytes / HBM bandwidth          the memory-bound rest: elementwise ops, the optimizer
    collective  t = steps(op, N)·α + wire(op, M, N) / β     the α-β model of a ring (Thakur et al. 2005),
                  wire() the bytes each rank sends (mfu.wire_bytes), steps 2(N−1) for an all-reduce, N−1 for
                  a gather, scatter or all-to-all, 1 for a send; α and β are the link's
    link        a group whose ranks share a node uses the intra-node link (NVLink), any other the inter-node
                  one (InfiniBand), at its per-GPU bandwidth: ranks = ((d·P + p)·C + c)·T + t, node = rank // G

Presets are 8-GPU nodes of the named part (H100 SXM, H200 SXM, A100 SXM 80 GB, B200 SXM): the datasheets' dense
peaks, HBM bandwidth and capacity, NVLink (5th gen: 900 GB/s per GPU and direction; 4th gen: 450; 3rd gen: 300)
and one NDR 400 Gb/s (HDR 200 for A100) InfiniBand port per GPU. A preset's peaks are its mfu.PEAK_TFLOPS row, per
dtype and per microscaling format where the datasheet gives one: B200 (HGX B200 datasheet, per GPU, dense = half
its sparse figures) 2,250 BF16, 4,500 FP8 and MXFP8, 9,000 FP4 (MXFP4, NVFP4) TFLOP/s, 180 GB HBM3e (1,440 GB a
node) at 8 TB/s, NVLink 5 1.8 TB/s per GPU both directions together; H100, H200 and A100 have no block-scaled
GEMM and no FP4 (their rows have no MX/NVFP4 figure: accounting/format_flops.py counts those FLOPs at the compute
dtype's rate, as the emulation runs them). Latencies are round figures of NCCL's per-step cost on such links
(a few µs), stated, not measured. `cpu` is this machine, measured (`measure_cpu`): the bf16/fp32 matmul loop
of mfu.py and a gloo all-reduce timed many times at two sizes (link_fit), and planner/cpu_probe.py adds what a run's own
block reaches of that peak and how much of a transfer hides behind compute, so every real run's end line checks the
model against its own steps.

Host memory (parallel/offload.py's --offload, priced by planner/time_model.py): each GPU's own host link (PCIe x16,
GB/s per direction, effective) and the host memory bandwidth of a node that the host's AdamW streams at, shared by
the node's GPUs (two sockets, each with its 4 GPUs). Assumptions, not measurements: PCIe 4.0 x16 moves 31.5 GB/s
per direction raw (16 GT/s × 16 lanes, 128b/130b), of which ~25 GB/s is what pinned copies reach (A100); PCIe 5.0
x16 twice that, ~50 GB/s (H100, H200, B200 SXM hosts); the nodes' DGX hosts have two sockets of 8 DDR channels:
DGX A100 2 × EPYC 7742 (DDR4-3200, 2 × 204.8 = 410 GB/s), DGX H100/H200 2 × Xeon 8480C (DDR5-4800, 2 × 307 =
614 GB/s), DGX B200 2 × Xeon 8570 (DDR5-5600, 2 × 358 = 717 GB/s); a CPU AdamW (DeepSpeed's vectorised CPU-Adam)
is taken to stream at half of that (200, 300, 300, 350 GB/s a node): the figure least known here,
`--hw-host-adam-gbps` sets it. Each preset's node holds 2 TB of host memory (the DGX A100 640 GB, H100, H200 and
B200 datasheets' system memory: 2,048 GiB, `--hw-host-memory-gib`), what the offloaded state of its GPUs must fit.

A preset carries calibration.CALIBRATED (what real runs reach of these figures: GEMM efficiency by shape,
HBM and link fractions; `--calib-*` override it); a measured CPU the datasheet set.

Accounting for this file: it holds and sends nothing; `measure_cpu` times one all-reduce over the world.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from mesh import groups_of
import mfu
from planner import calibration
from planner.calibration import Calibration


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_tflops: dict  # {dtype: dense TFLOP/s}; fp32 without TF32
    hbm_gbps: float  # device memory bandwidth, GB/s
    memory_gib: float  # device memory
    intra_gbps: float  # per-GPU bandwidth to a GPU of the same node, one direction, GB/s
    inter_gbps: float  # per-GPU bandwidth to another node, GB/s
    intra_latency_us: float = 5.0  # α of one ring step inside a node
    inter_latency_us: float = 10.0  # α across nodes
    gpus_per_node: int = 8
    calibration: Calibration = calibration.DATASHEET  # what real runs reach of these figures
    overlap: float = 1.0  # φ: the share of an overlappable transfer that hides behind compute (planner/cpu_probe.py)
    host_link_gbps: float = 25.0  # per-GPU host link (PCIe), one direction, effective GB/s (--offload)
    host_adam_gbps: float = 200.0  # host memory bandwidth a node's CPU AdamW streams at, shared by its GPUs
    host_memory_gib: float = 2048.0  # host memory of a node

    def peak(self, dtype: str) -> float:
        """FLOP/s of a matmul in `dtype`: its own entry, else (fp16 only) the bf16 one, the same tensor-core
        rate on every part in mfu.PEAK_TFLOPS. No other stand-in: a model that knows no peak for `dtype` (a
        measured CPU knows only the dtype it measured) raises NoPeakKnown, which says so, instead of a KeyError
        or a figure of another dtype. Every dtype the flags accept has an entry in the presets, and a measured
        machine holds the run's own (measure_cpu), so a run's end line always finds one."""
        for key in (dtype, *_STAND_INS.get(dtype, ())):
            if self.peak_tflops.get(key):
                return 1e12 * self.peak_tflops[key]
        why = " (no block-scaled GEMM, no FP4 before Blackwell)" if dtype in _BLOCK_SCALED else ""
        raise NoPeakKnown(f"the hardware model {self.name} knows no {dtype} matmul peak{why} (it has"
                          f" {', '.join(sorted(self.peak_tflops)) or 'none'}); --hw-peak-tflops sets one")


class NoPeakKnown(ValueError):
    """A hardware model asked for the peak of a dtype it has no figure for."""


_STAND_INS = {"fp16": ("bf16",)}  # fp16 runs at the bf16 tensor-core rate (one column in mfu.PEAK_TFLOPS)
_BLOCK_SCALED = ("mxfp8", "mxfp4", "nvfp4")  # microscaling formats: a peak on Blackwell's tensor cores only


def _gpu(row: str, hbm_gbps: float, memory_gib: float, intra_gbps: float, inter_gbps: float, host: tuple) -> Hardware:
    peaks = {k: v for k, v in mfu.PEAK_TFLOPS[row].items() if v}
    return Hardware(row.lower(), peaks, hbm_gbps, memory_gib, intra_gbps, inter_gbps,
                    calibration=calibration.CALIBRATED, host_link_gbps=host[0], host_adam_gbps=host[1])


PRESETS = {  # host: (PCIe GB/s per GPU and direction, CPU AdamW's GB/s a node): the docstring's assumptions
    "h100": _gpu("H100", hbm_gbps=3350, memory_gib=80, intra_gbps=450, inter_gbps=50, host=(50, 300)),  # SXM5, NDR
    "h200": _gpu("H200", hbm_gbps=4800, memory_gib=141e9 / 2**30, intra_gbps=450, inter_gbps=50, host=(50, 300)),
    "a100": _gpu("A100", hbm_gbps=2039, memory_gib=80, intra_gbps=300, inter_gbps=25, host=(25, 200)),  # SXM4, HDR
    "b200": _gpu("B200", hbm_gbps=8000, memory_gib=180e9 / 2**30, intra_gbps=900, inter_gbps=50, host=(50, 350)),
}

# Ring steps of one call of each collective over N ranks (the latency term's count).
_STEPS = {"all_reduce": lambda n: 2 * (n - 1), "send": lambda n: 1, "recv": lambda n: 0, "barrier": lambda n: 0}


def ring_steps(op: str, n: int) -> int:
    return _STEPS.get(op, lambda n: n - 1)(n) if n > 1 else 0


def node_of(rank: int, hardware: Hardware) -> int:
    return rank // hardware.gpus_per_node


def crosses_nodes(ranks, hardware: Hardware) -> bool:
    """A node holds consecutive ranks, so a group stays in one exactly when its lowest and highest rank do."""
    return node_of(min(ranks), hardware) != node_of(max(ranks), hardware)


def collective_seconds(op: str, calls: float, payload: float, ranks, hardware: Hardware) -> float:
    """The α-β time of `calls` calls of `op` moving `payload` bytes in all over the group `ranks`."""
    n = len(ranks)
    if n <= 1 or op in ("recv", "barrier"):  # a receive is its send's time
        return 0.0
    inter = crosses_nodes(ranks, hardware)
    alpha = 1e-6 * (hardware.inter_latency_us if inter else hardware.intra_latency_us)
    beta = 1e9 * (hardware.inter_gbps if inter else hardware.intra_gbps)
    beta *= hardware.calibration.link_fraction  # what collectives reach of the link (planner/calibration.py)
    return calls * ring_steps(op, n) * alpha + mfu.wire_bytes(op, payload, n) / beta


def dispatch_seconds(calls: float, payload: float, ranks, hardware: Hardware, local_hit: float) -> float:
    """The EP exchange's α-β time when a share `local_hit` of its rows stays on the sender's rank (--moe-local-hit):
    the other rows spread evenly over the group's other ranks, those in the sender's node (ranks[0]'s) over the
    intra-node link and the rest over the inter-node one, both links at once (the slower sets the time).
    local_hit = 1/E moves (E − 1)/E of the payload, as `collective_seconds`' all-to-all does."""
    n = len(ranks)
    if n <= 1:
        return 0.0
    near = sum(node_of(r, hardware) == node_of(ranks[0], hardware) for r in ranks) - 1
    far = n - 1 - near
    moved = payload * (1 - local_hit) / (n - 1) / hardware.calibration.link_fraction
    alpha = 1e-6 * (hardware.inter_latency_us if far else hardware.intra_latency_us)
    return calls * ring_steps("all_to_all_single", n) * alpha + max(moved * near / (1e9 * hardware.intra_gbps),
                                                                     moved * far / (1e9 * hardware.inter_gbps))


def ep_link_costs(args, shape) -> tuple:
    """[E][E] costs of a unit moved between EP ranks a and b, for experts/transport.py's replicas: 1/GB/s of the
    intra-node link between ranks of one node, of the inter-node one across, 0 to itself; of rank 0's ep group
    (every group places alike: their ranks hold the same experts over expert_dp), nodes of G = --gpus-per-node
    (or --hw's) ranks."""
    hw = PRESETS[args.hw]
    g = args.gpus_per_node or hw.gpus_per_node
    intra, inter = args.hw_intra_gbps or hw.intra_gbps, args.hw_inter_gbps or hw.inter_gbps
    ranks = groups_of(shape, 0)["ep"]
    return tuple(tuple(0.0 if a == b else 1 / (intra if a // g == b // g else inter) for b in ranks) for a in ranks)


def alpha_beta(op: str, sizes: tuple, seconds: tuple, world: int) -> tuple[float, float]:
    """(α s per ring step, β bytes/s) of t(M) = steps·α + wire(M)/β through the two measured (size, seconds);
    α ≥ 0 and β finite and positive even when noise makes the larger size look no slower."""
    steps = ring_steps(op, world)
    wire = [mfu.wire_bytes(op, m, world) for m in sizes]
    slope = (seconds[1] - seconds[0]) / max(wire[1] - wire[0], 1e-12)  # s per wire byte: 1/β
    beta = 1.0 / slope if slope > 0 else wire[1] / max(seconds[1], 1e-9)
    alpha = max(0.0, (seconds[0] - wire[0] / beta) / max(steps, 1))
    return alpha, beta


def add_arguments(parser) -> None:
    """--hw PRESET and one flag per figure (train.py --plan)."""
    g = parser.add_argument_group("hardware model (planner/hardware.py, for --plan)")
    g.add_argument("--hw", default="h100", choices=sorted(PRESETS), help="8-GPU node preset (default h100)")
    g.add_argument("--gpus-per-node", type=int, help="GPUs per node G (default: the preset's, 8)")
    for flag, what in (("--hw-peak-tflops", "dense matmul peak of the run's dtype, TFLOP/s"),
                       ("--hw-hbm-gbps", "device memory bandwidth, GB/s"), ("--hw-memory-gib", "device memory, GiB"),
                       ("--hw-intra-gbps", "per-GPU bandwidth inside a node, GB/s"),
                       ("--hw-inter-gbps", "per-GPU bandwidth across nodes, GB/s"),
                       ("--hw-intra-latency-us", "latency of one ring step inside a node, µs"),
                       ("--hw-inter-latency-us", "latency of one ring step across nodes, µs"),
                       ("--hw-host-link-gbps", "with --offload: each GPU's host link (PCIe), one direction, GB/s"
                        " (the presets: 50, a100 25)"),
                       ("--hw-host-adam-gbps", "with --offload: host memory bandwidth of a node's CPU AdamW, shared by"
                        " its GPUs, GB/s (the presets: 300, a100 200, b200 350)"),
                       ("--hw-host-memory-gib", "with --offload: host memory of a node, GiB (the presets: 2048)")):
        g.add_argument(flag, type=float, help=f"{what} (default: --hw's)")
    g.add_argument("--moe-local-hit", type=float, help="the share h of the EP dispatch's rows that stay on their rank"
                   " (measured: bench/bench_coupling.py; default: none, the exchange priced whole on the ep group's"
                   " slowest link): the rest over the intra- and inter-node links by their ranks' shares")
    calibration.add_arguments(g)


def from_flags(args, dtype: str) -> Hardware:
    """The preset with every --hw-* figure given on the command line put in (each positive: cli/flags.py)."""
    hw = PRESETS[args.hw]
    overrides = {name: getattr(args, f"hw_{name}") for name in ("hbm_gbps", "memory_gib", "intra_gbps", "inter_gbps",
                                                                  "intra_latency_us", "inter_latency_us",
                                                                  "host_link_gbps", "host_adam_gbps", "host_memory_gib")
                 if getattr(args, f"hw_{name}", None) is not None}
    if args.gpus_per_node is not None:
        overrides["gpus_per_node"] = args.gpus_per_node
    if args.hw_peak_tflops is not None:
        overrides["peak_tflops"] = {**hw.peak_tflops, dtype: args.hw_peak_tflops}  # the figure peak(dtype) reads
    return replace(hw, calibration=calibration.from_flags(args), **overrides)


def hardware_line(hw: Hardware, dtype: str) -> str:
    return (f"hardware model {hw.name}: {hw.peak(dtype) / 1e12:g} TFLOP/s {dtype} dense, HBM {hw.hbm_gbps:g} GB/s,"
            f" {hw.memory_gib:.1f} GiB; {hw.gpus_per_node} GPUs a node; intra-node {hw.intra_gbps:g} GB/s,"
            f" α {hw.intra_latency_us:g} µs; inter-node {hw.inter_gbps:g} GB/s per GPU, α {hw.inter_latency_us:g} µs")


def median(samples) -> float:
    """The middle of the sorted samples (the upper one of an even count): one slow sample cannot move it."""
    return sorted(samples)[len(samples) // 2]


def link_fit(op: str, sizes: tuple, mean_small: float, median_small: float, median_large: float,
             world: int) -> tuple[float, float]:
    """(α, β) of a link whose calls are heavy-tailed, from the statistics of many timed calls at two sizes.

    On a shared CPU most gloo calls take ~0.2 ms and some wait a scheduler slice (1-6 ms) for a thread to
    wake; a step's calls pay that tail, and it is per call, not per byte. So β comes from the slope between the
    MEDIANS of the two sizes (alpha_beta through them: the tail cancels), and α from the MEAN of the small
    calls less their wire time, α = (mean t_small − wire(M_small)/β) / steps: the tail included."""
    _, beta = alpha_beta(op, sizes, (median_small, median_large), world)
    alpha = max(0.0, (mean_small - mfu.wire_bytes(op, sizes[0], world) / beta) / max(ring_steps(op, world), 1))
    return alpha, beta


def busy(seconds: float, device) -> None:
    """Compute (small matmuls) for `seconds`: what a step runs between two collectives, so that the next call
    meets the peer's and its own communication threads parked, as a step's calls do, not spinning from the last."""
    a = torch.ones(64, 64, device=device)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ a


def measure_cpu(peak_flops: float, dtype: str, device, sizes=(1 << 12, 1 << 22), calls=(100, 9),
                compute_between: float = 1e-3) -> Hardware:
    """This machine as a Hardware: the measured matmul peak (train.py measured it at start) and a world
    all-reduce timed `calls` times at each of two sizes, each call after `compute_between` seconds of compute
    (busy), fitted by link_fit. The ranks start each size together (a warm-up all-reduce first) and average their
    statistics, so every rank fits the same α and β. On the 2-core test VM a call right after another is not a
    step's: back to back, a 4 KiB all-reduce's mean over 100 calls read 0.5 to 2.0 ms from one run to the next,
    while after 1-2 ms of compute it read 1.5-2.0 ms, as a TP step's own calls (1.7-1.9 ms each, 214 KB, traced).
    Collective: every rank calls it. One node: every group is 'intra'."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    alpha, beta = 0.0, float("inf")
    if world > 1:
        samples = []
        for nbytes, count in zip(sizes, calls):
            x = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
            dist.all_reduce(x)  # warm-up (connections, buffers) and a common start
            times = []
            for _ in range(count):
                busy(compute_between, device)
                start = time.perf_counter()
                dist.all_reduce(x)
                times.append(time.perf_counter() - start)
            samples.append(times)
        small, large = samples
        stats = torch.tensor([sum(small) / len(small), median(small), median(large)], dtype=torch.float64)
        dist.all_reduce(stats)
        alpha, beta = link_fit("all_reduce", sizes, *(float(v) / world for v in stats), world)
    return Hardware("cpu (measured)", {dtype: peak_flops / 1e12}, hbm_gbps=20.0, memory_gib=0.0,
                    intra_gbps=beta / 1e9, inter_gbps=beta / 1e9, intra_latency_us=alpha * 1e6,
                    inter_latency_us=alpha * 1e6, gpus_per_node=max(world, 1))
