"""The time model: one rank role's figures (what it holds, what it sends per step) and its predicted step time.

A Role is read from a built run exactly where a real run's start-up reads its predictions (role_of:
layout.predicted_persistent, report.run.predicted_messages, activations.activation_estimate, the schedule's
bubble).
plan.py builds each role on meta in a fake process group and planner/search.py gives roles from formulas; every
real run checks the model against its own steps (check_line, on cpu_probe.machine_model: this machine).

The time model (planner/hardware.py states the hardware): per role and step
    compute    t_c = Σ_GEMM classes FLOPs/token · tokens/step / world · share / (peak(dtype) · e(d))
                     + the memory-bound ops' bytes of this rank's tokens and layers / (HBM · hbm_fraction)
               (share: of a block class the rank's layers over L/P, of the head P on the stage holding it, 0 on
               the others, 1 without a pipeline: a large vocabulary's last stage is the slow one)
               (planner/calibration.py: e(d) the fraction of the peak a GEMM of smallest dimension d reaches; the
               datasheet set, e = 1 and no loss but the memory-bound bytes, on a measured CPU, whose e, the
               head's and the layout factor ρ (× t_c: the run's own forward over its price) planner/cpu_probe.py
               measures)
    update     2 · persistent bytes / (HBM bandwidth · hbm_fraction)                (memory-bound, exposed)
               (a measured CPU: its update's local work timed at start-up, cpu_probe.update_seconds)
               + with Muon, the Newton-Schulz GEMMs of the data-parallel group's slowest rank, each at
               FLOPs / (peak · e(its smallest dimension)) (optimizers/muon.py's MuonFacts: gather's touched
               matrices, owner's owned ones; DDP every matrix)
               with --offload (parallel/offload.py's `figures`, the bytes its layout counts): the device updates
               nothing; the host's AdamW streams its bytes at the node's host bandwidth over the G GPUs that share it
               (hw.host_adam_gbps / G), the update's own copies (optimizer: the master in and back; optimizer+master:
               the new weights in) cross the GPU's host link (hw.host_link_gbps a direction) after it, both exposed
               (the weights must be back before their all-gather; no one-step-delayed update is modelled); the
               gradient's copy to the host runs as each unit's shard is final, behind the last micro-batch's backward:
               exposed = max(0, t − t_backward) (ZeRO-Offload's overlap); a measured CPU keeps its timed update (the
               host is its device)
    each (collective, group) of the step: α-β time on the group's link (hardware.collective_seconds, the
    bandwidth times the calibration's link_fraction), plus, for a 4-bit all-reduce's all-gather (--tp-comm-bits 4
    on tp, --dp-comm-bits 4 on dp_cp / expert_dp: parallel/lowbit.py), its calls' encode and decode as memory-bound
    work, lowbit.codec_bytes of the elements it sums / (HBM · hbm_fraction); with --moe-local-hit h, EP's
    all-to-alls move (1 − h) of their payload, split over the intra- and inter-node links by the ep group's
    ranks (dispatch_seconds); then
    on the critical path by these rules (Megatron, ZeRO and ring-attention's own overlap claims):
      exposed: TP/SP (every f, g inside a layer waits on it, 4-bit or not), DDP's 4-bit buckets (summed
               synchronously as they fill), EP's and Ulysses' all-to-alls, the update's and
               the step's scalar all-reduces (scalar_messages: DDP's gradient key holds them too, taken out), Muon's
               own update messages (the gather way's U all-gather, the TP gathers of its matrices:
               MuonFacts.messages, taken out of their row and exposed whole),
               FP8's amax reductions, the pipeline's loss and tied sums;
      DDP, ZeRO-1: the gradient reduction overlaps the last micro-batch's backward (≈ 2/3 of its compute)
               except its last bucket: exposed = t(last bucket) + max(0, t − t_backward);
      ZeRO-2/3: each micro-batch's reduce-scatter overlaps that micro-batch's backward, same rule, m times
               (Muon's owners: their reduces are that reduction, by the same rules);
               under a pipeline (parallel/zero_pipeline.py) each chunk's step sum is reduced once, at its last
               backward: DDP's rule (the last piece: the first local chunk's);
      ZeRO-1/2's all-gather after the update: exposed (it overlaps only the next unit's update);
      ZeRO-3's gathers (Muon's owners: their broadcasts too) are prefetched behind compute except the first
               (root + block 0) of each pass:
               exposed = m · [t(first) + max(0, t/m − t_compute/m)]; under a pipeline the schedule prefetches
               the next action's chunk during this one, so only the step's first gather waits:
               exposed = t(first) + max(0, t − t_first − t_compute);
      ring CP: each hop's transfer hides behind its block's attention: exposed = max(0, t − t_attention);
      pipeline p2p: overlapped except in fill and drain: exposed = 2(P−1) · t(one message); with --pp-p2p
               blocking (DeepSpeed's 2021 engine: its send and recv take no async_op) all of it: exposed = t.
    then of what a rule hides, only the share φ = hw.overlap hides: exposed += (1 − φ)(t − exposed) (φ = 1 on
    the GPU presets: copy engines and NCCL's own SMs; a CPU measures it, planner/cpu_probe.py: its ranks' gloo threads
    compete with their compute for the same cores)
    bubble     b = pipeline's bubble_formula(schedule, P, m, v); the busy part (compute + the exposed
               in-layer communication) stretches by 1/(1 − b)
    step       (t_c + in-layer exposed) / (1 − b) + the exposed rest;  MFU = FLOPs_model · tokens / (world ·
               peak · step). The slowest role sets the pace.

Accounting for this file: it holds and sends nothing (it reads a built run's figures).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from accounting import activations, memory, moe_memory
import mfu
import model as model_lib
from parallel import lowbit, schedules
from planner import calibration, hardware
import report.axes
import report.run
from cli.flags import DTYPES
from step import Messages
from step import scalar_messages


# ---------------------------------------------------------------------------------------------------------
# One role: what a rank holds and sends per step
# ---------------------------------------------------------------------------------------------------------


P2P_BUFFERS = "pipeline p2p buffers (a receive, the sends alive)"  # a temporary's name (plan.restage sets it)


@dataclass
class Role:
    """What one rank holds and sends per step: the figures a real start-up prints."""

    rank: int
    coords: dict  # {"dp", "pp", "cp", "tp"}
    local_params: int
    logical: dict  # {global name: elements of the logical tensor}: Ψ is their sum over the roles
    persistent: dict  # {"weights", "grads", "optimizer", "total"} bytes
    activations: object  # activations.ActivationEstimate: one forward's bytes, how many in flight, their peak
    temporaries: dict  # {what: bytes}
    messages: Messages  # per step, (op, group as the tracer names it): (calls, payload)
    group_ranks: dict  # {group name: global ranks of this rank's group}
    flops: mfu.FlopsPerToken
    bubble: float
    last_bucket: float  # bytes of the gradient reduction's last piece (sent after backward)
    first_gather: float  # ZeRO-3: bytes gathered before the first block can start (root + block 0)
    boundary_bytes: float = 0.0  # one pipeline message
    muon: object = None  # optimizers/muon.py's MuonFacts: Newton-Schulz's GEMMs by rank (None: AdamW only)
    update_messages: Messages = field(default_factory=Messages)  # Muon's own, named as `messages` is
    layer_share: float = 1.0  # this rank's layers over the mean (L/P): an uneven pipeline split's slow stage
    head_share: float = 1.0  # this rank's share of the head's GEMM over an even split: P on the stage holding it
    notes: tuple = ()  # a wrapping layout's start-up lines (DiLoCo's outer state and Δ all-reduce), as a run prints
    offload: object = None  # --offload: parallel/offload.py's OffloadFigures of this rank (None: all on the device)

    @property
    def peak(self) -> float:
        return self.persistent["total"] + self.activations.peak + sum(self.temporaries.values())


def role_of(run, device_type: str | None = None) -> Role:
    """The Role of a built run: every figure read from the code a real start-up prints it with; the
    activations as the kernels of `device_type` save them (the plan's: "cuda"; default the run's device)."""
    layout, mesh = run.layout, run.mesh
    persistent = dict(layout.predicted_persistent())
    estimate = activations.activation_estimate(run, device_type)
    temporaries, last_bucket, first_gather = {}, 0.0, 0.0
    facts = layout.facts()
    if layout.name == "zero":
        extra = facts.peak_lower_bound - persistent["total"]
        what = ("gathered units (in use + prefetched) and gradient buckets" if facts.stage == 3
                else "reduce-scatter outputs / all-gather inputs, gradient buckets")
        temporaries[f"ZeRO-{facts.stage} {what}"] = extra
        last_bucket = facts.dtypes["reduce"].itemsize * facts.last_reduce_numel
        first_gather = facts.dtypes["param"].itemsize * facts.first_gather_numel  # 0 below stage 3
    else:
        sizes = facts.bucket_bytes
        temporaries["DDP: one bucket in flight (the backend's staging)"] = max(sizes)
        last_bucket = sizes[-1]
    bubble, boundary = 0.0, 0.0
    for axis in run.axes:
        if axis.name == "pp":  # the pipeline: its bubble, its messages' buffers
            pp = axis.facts()
            bubble = schedules.bubble_formula(pp.schedule, pp.P, pp.m, pp.v)
            boundary = pp.message_bytes
            live = schedules.live_sends(pp.plan)  # sends not yet known received
            temporaries[P2P_BUFFERS] = (1 + live) * boundary
        if axis.name == "moe" and axis.facts().traffic.moe_layers:  # the dispatch buffers (accounting/moe_memory.py)
            peak = moe_memory.rank_peak(axis.facts().traffic, activations.activation_shape(run, device_type))
            temporaries[peak.temporary()] = peak.above_saved
        if axis.name == "cp" and run.settings.args.cp_impl == "ring":
            kv = 2 * run.micro_batch_size * run.seq_len // mesh.size("cp") * run.config.n_embd // mesh.size("tp")
            temporaries["ring CP: the K, V block in flight"] = 2 * kv * run.compute_dtype.itemsize
    params = list(run.model.parameters())
    wrapper = getattr(layout, "wrapper", None)  # DiLoCo's (report.axes.AXIS_LINES names its printouts)
    notes = tuple(report.axes.AXIS_LINES[wrapper]["startup"](layout, run)) if wrapper else ()
    ranks = {name: members for name, members in mesh.members.items()}
    ranks["world"] = list(range(mesh.shape.world_size))
    muon = facts.muon
    offload_figures = getattr(layout, "offload_figures", None)  # parallel/offload.py's layout
    update_messages = muon.messages.named(run.tracer.alias) if muon is not None else Messages()
    return Role(rank=mesh.rank, coords=mesh.shape.coords(mesh.rank), local_params=sum(p.numel() for p in params),
                logical={p.shard_info.global_name: math.prod(p.shard_info.global_shape) for p in params},
                persistent=persistent, activations=estimate,
                temporaries=temporaries, messages=report.run.predicted_messages(run), group_ranks=ranks,
                flops=run.flops, bubble=bubble, last_bucket=last_bucket, first_gather=first_gather,
                boundary_bytes=boundary, notes=notes, muon=muon, update_messages=update_messages,
                offload=offload_figures() if offload_figures else None,
                head_share=mesh.shape.pp if run.model.has_head else 0.0,
                layer_share=len(run.model.transformer.h) * mesh.shape.pp / run.config.n_layer)


# ---------------------------------------------------------------------------------------------------------
# The time model
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Prediction:
    compute: float
    update: float
    bubble: float  # seconds idle in the pipeline's fill and drain
    step: float
    mfu: float
    exposed: dict = field(default_factory=dict)  # {(op, group): seconds on the critical path}
    total: dict = field(default_factory=dict)  # {(op, group): seconds if nothing overlapped}
    link: dict = field(default_factory=dict)  # {(op, group): "intra" | "inter"}
    host: dict = field(default_factory=dict)  # --offload: {what: seconds} of `offload_seconds`, `update` holds them

    def by_link(self, exposed: bool = True) -> dict:
        out = {"intra": 0.0, "inter": 0.0}
        for key, t in (self.exposed if exposed else self.total).items():
            out[self.link[key]] += t
        return out

    @property
    def exposed_comm(self) -> float:
        return sum(self.exposed.values())


def _group_ranks(group: str, ranks: dict) -> list:
    names = [name for name in group.split("=") if name in ranks]  # "dp=dp_cp=expert_dp": one communicator
    return ranks[names[0]] if names else [0]


def _names(group: str) -> set:
    return set(group.split("="))


def predict(role: Role, layout: dict, hw: hardware.Hardware) -> Prediction:
    """The role's step time by the rules of the docstring. layout: world, tokens (per step), m, zero, P, dtype,
    cp_impl, attention_share (of the compute: attention's score and value matmuls)."""
    m, stage, P = layout["m"], layout["zero"], layout["P"]
    peak, hbm = hw.peak(layout["dtype"]), hw.hbm_gbps * 1e9
    compute = stage_compute(role.layer_share, role.head_share, layout, hw)
    backward_mb = compute * 2 / 3 / m  # one micro-batch's backward: 4 of its 6·N FLOPs
    update, host = hw.calibration.update_seconds, {}  # a measured CPU's; else memory-bound bytes, or the host's:
    if update is None and role.offload is not None:
        host = offload_seconds(role.offload, backward_mb, layout["world"], hw)
        update = host["host AdamW"] + host["update copies"] + host["gradient copy exposed"]
    elif update is None:
        update = 2 * role.persistent["total"] / (hbm * hw.calibration.hbm_fraction)
    if role.muon is not None:  # Newton-Schulz: the group waits for its slowest rank's GEMMs
        update += max(sum(flops / (peak * hw.calibration.gemm_efficiency(dim)) for flops, dim in gemms)
                      for gemms in role.muon.ns_gemms_by_rank)
    exposed, total, link, in_layer = {}, {}, {}, 0.0
    for (op, group), (calls, payload) in role.messages.items():
        ranks = _group_ranks(group, role.group_ranks)
        t = hardware.collective_seconds(op, calls, payload, ranks, hw)
        names = _names(group)
        if op == "all_to_all_single" and "ep" in names and layout.get("local_hit") is not None:  # --moe-local-hit
            t = hardware.dispatch_seconds(calls, payload, ranks, hw, layout["local_hit"])

        def piece(nbytes):  # one call of `op` moving nbytes
            return hardware.collective_seconds(op, 1, nbytes, ranks, hw)

        t += _codec_seconds(op, names, calls, payload, ranks, layout, hw)  # a 4-bit all-reduce's encode, decode
        grads = (names & {"dp_cp", "expert_dp"} and op in ("all_reduce", "reduce_scatter_single", "reduce")
                 and payload > 16 * calls)
        # DDP's gradients share their row with the step's two scalars, which block: taken out, exposed whole.
        n, nbytes = scalar_messages().get((op, "dp_cp"), (0, 0)) if grads and "dp_cp" in names else (0, 0)
        scalars = n * piece(nbytes / n) if n else 0.0
        t = hardware.collective_seconds(op, calls - n, payload - nbytes, ranks, hw) if n else t
        n_own, own_bytes = role.update_messages.get((op, group), (0, 0))  # Muon's: exposed whole, taken out here
        own = hardware.collective_seconds(op, n_own, own_bytes, ranks, hw) if n_own else 0.0
        if n_own:
            calls, payload = calls - n_own, payload - own_bytes
            t = hardware.collective_seconds(op, calls - n, payload - nbytes, ranks, hw) if calls > n else 0.0
        if grads and (stage <= 1 or P > 1):  # DDP, ZeRO-1, ZeRO-2/3 under PP: once a step, over the last backward
            last = piece(role.last_bucket)
            e = last + max(0.0, t - last - backward_mb)
        elif grads:  # ZeRO-2/3: every micro-batch's, over its own backward
            last = piece(role.last_bucket)
            e = m * (last + max(0.0, t / m - last - backward_mb))
        elif stage == 3 and op in ("all_gather_single", "broadcast") and names & {"dp_cp", "expert_dp"}:
            first = piece(role.first_gather)
            passes = 1 if P > 1 else m  # under PP: the step's first gather; the rest prefetched an action ahead
            e = passes * (first + max(0.0, t / passes - first - compute / passes))
        elif "pp" in names and op == "send":
            overlapped = role.boundary_bytes and layout.get("p2p") != "blocking"
            e = 2 * (P - 1) * piece(role.boundary_bytes) if overlapped else t
        elif "cp" in names and op in ("send", "isend", "batch_isend_irecv") and layout.get("cp_impl") == "ring":
            e = max(0.0, t - compute * layout.get("attention_share", 0.0))
        else:  # TP/SP, EP, Ulysses, the update's and the step's scalars, amaxes, ZeRO-1/2's gather, pp sums
            e = t
            in_layer += t if names & {"tp", "ep", "cp"} else 0.0
        e = min(e, t)
        exposed[(op, group)] = e + (1 - hw.overlap) * (t - e) + scalars + own  # φ of the hidden hides
        total[(op, group)] = t + scalars + own
        link[(op, group)] = "inter" if hardware.crosses_nodes(ranks, hw) else "intra"
    busy = compute + in_layer
    bubble = busy * role.bubble / (1 - role.bubble)
    step = busy + bubble + update + sum(exposed.values()) - in_layer
    return Prediction(compute=compute, update=update, bubble=bubble, step=step, exposed=exposed, total=total,
                      link=link, host=host, mfu=role.flops.model * layout["tokens"] / (layout["world"] * peak * step))


def offload_seconds(figures, backward_mb: float, world: int, hw: hardware.Hardware) -> dict:
    """--offload's terms (the docstring's update rule): the gradient's copy to the host (its time, and what the last
    micro-batch's backward leaves of it, with φ of the hidden hiding), the update's own copies over the host link
    and the host's AdamW at its share of the node's bandwidth."""
    link = hw.host_link_gbps * 1e9
    gradient = figures.grad_d2h / link
    hidden = min(gradient, backward_mb)
    return {"gradient copy": gradient, "gradient copy exposed": gradient - hidden * hw.overlap,
            "update copies": (figures.moved["d2h"] - figures.grad_d2h + figures.moved["h2d"]) / link,
            "host AdamW": figures.update / (hw.host_adam_gbps * 1e9 / min(hw.gpus_per_node, world))}


def _codec_seconds(op: str, names: set, calls: float, payload: float, ranks: list, layout: dict,
                   hw: hardware.Hardware) -> float:
    """The encode and decode of a 4-bit all-reduce's calls, priced on its all_gather_single row (each call has one):
    the elements it sums from the payload (N rows of 4 + 9c/16 bytes, c elements each), lowbit.codec_bytes of them
    (a fused kernel's traffic) at the HBM's rate; 0 for every other message."""
    config = layout.get("lowbit")
    quantised = config is not None and op == "all_gather_single" and calls and (
        config.tp_bits == 4 and "tp" in names or config.dp_bits == 4 and names & {"dp_cp", "expert_dp"})
    if not quantised:
        return 0.0
    elements = calls * len(ranks) * (payload / calls / len(ranks) - 4) * 16 / 9
    work = lowbit.codec_bytes(elements, DTYPES[layout["dtype"]].itemsize, config.feedback)
    return work / (hw.hbm_gbps * 1e9 * hw.calibration.hbm_fraction)


def stage_compute(layer_share: float, head_share: float, layout: dict, hw: hardware.Hardware) -> float:
    """predict's compute of a rank: the GEMMs by shape and the memory-bound ops (planner/calibration.py), its
    layers' share of the blocks', the head's on the stage that holds it (a large vocabulary's last stage is the
    slow one); × the layout factor a measured CPU found."""
    return calibration.compute_seconds(
        _rank_classes(layer_share, head_share, layout["gemms"]), layout["tokens"] / layout["world"],
        hw.peak(layout["dtype"]), layout["memory_bytes"] * layer_share, hw.hbm_gbps * 1e9,
        hw.calibration) * (hw.calibration.layout_factor or 1.0)


def step_bound(shares, bubble: float, layout: dict, hw: hardware.Hardware) -> float:
    """A lower bound of predict's step over the stages, from the layout alone (planner/search.py prunes with it):
    predict's step is (compute + in-layer exposed) / (1 − b) + update + the rest exposed, each term ≥ 0, so it is
    at least compute / (1 − b) of any stage. shares: each stage's (layer share, head share)."""
    compute = max(stage_compute(layers, head, layout, hw) for layers, head in shares)
    return (compute + compute * bubble / (1 - bubble)) * (1 - 1e-9)  # predict's sum; rounding on the bound's side


def _rank_classes(layer_share: float, head_share: float, gemms: list) -> list:
    """calibration.gemms' classes as a rank computes them, over an even split of the step's tokens: the blocks'
    × its layer share, the head's × its head share."""
    return [(flops * (head_share if i == calibration.HEAD_CLASS else layer_share), dim)
            for i, (flops, dim) in enumerate(gemms)]


def forward_compute(role: Role, layout: dict, hw: hardware.Hardware, recompute: bool) -> float:
    """What predict prices one forward-only pass over the step's micro-batches at (evaluation's: no backward, no
    recompute, the layout factor left out): of every block and attention class 1/(3 + recompute) (forward 2
    FLOPs per weight of 6, + 2 recomputed), of the head 1/3, of the memory-bound bytes 1/(3 + recompute)."""
    share = 1 / (3 + recompute)
    classes = [(flops * (1 / 3 if i == calibration.HEAD_CLASS else share), dim)
               for i, (flops, dim) in enumerate(_rank_classes(role.layer_share, role.head_share, layout["gemms"]))]
    return calibration.compute_seconds(
        classes, layout["tokens"] / layout["world"], hw.peak(layout["dtype"]),
        layout["memory_bytes"] * role.layer_share * share, hw.hbm_gbps * 1e9, hw.calibration)


def layout_facts(settings, device_type: str | None = None, x: memory.ActivationShape | None = None) -> dict:
    """What the time model reads of a layout (predict's `layout`): gemms, calibration.gemms' classes (their
    dimensions at a rank's B_μ·s/C tokens, attention's FLOPs at the whole s: a rank's queries meet all s keys);
    memory_bytes, what a rank of the mean stage's memory-bound ops move in a step (its s/C tokens of each
    sequence, its L/P layers), the attention kernel that of `device_type` (default the plan's, PLANNED_DEVICE)
    or --attention-kernel's (activations.shape_of; "math": the unfused path of Megatron's 2021-22 runs, whose
    core attention selective recompute reruns). x: a built run's activation shape (activations.activation_shape:
    its dtypes as resolved), else the plan's."""
    args, config, shape = settings.args, settings.model, settings.shape
    seq = settings.seq_len
    attention = 12 * config.n_layer * config.n_embd * seq  # 12·L·H·Q·s of the FLOPs per token
    counts = memory.param_counts(config)
    name, compute, param, _ = plan_dtypes(settings)
    x = x or activations.shape_of(settings, config, device_type or PLANNED_DEVICE, compute, param)
    flops = mfu.flops_per_token(counts, config, seq, x.kernel)
    full, selective = config.activation_checkpointing, config.selective_recompute
    per_token_layer = calibration.memory_bytes_per_token_layer(
        config, x.s, shape.tp, settings.sequence_parallel, x.kernel, x.dropout, x.e_c, full or selective)
    tokens = args.global_batch * seq
    gemms = calibration.gemms(config, counts, settings.micro_batch_size * x.s, seq, shape.tp, full,
                              full or selective and x.kernel == "math")
    return dict(world=settings.world_size, tokens=tokens, m=settings.micro_batches,
                zero=args.zero, P=shape.pp, dtype=name, cp_impl=args.cp_impl, lowbit=settings.axes.get(lowbit.__name__),
                local_hit=getattr(args, "moe_local_hit", None), p2p=getattr(args, "pp_p2p", None),
                attention_share=attention / flops.hardware, gemms=gemms,
                memory_bytes=per_token_layer * tokens / (shape.dp * shape.cp) * config.n_layer / shape.pp)


def host_per_node(roles: list, hw: hardware.Hardware, world: int) -> float:
    """--offload: a node's host bytes, at most its G GPUs × the fullest role's (0 without offload)."""
    return max((r.offload.host for r in roles if r.offload is not None), default=0) * min(hw.gpus_per_node, world)


def limiting_term(prediction: Prediction) -> str:
    """The largest term of the step, and when that is compute, the largest of what is lost besides it."""
    losses = {"exposed communication": prediction.exposed_comm, "bubble": prediction.bubble,
              "update (host)" if prediction.host else "update (HBM)": prediction.update}
    worst = max(losses, key=losses.get)
    if prediction.compute >= losses[worst]:
        return f"compute; most lost to {worst} ({losses[worst] / prediction.step:.0%} of the step)"
    return worst


# ---------------------------------------------------------------------------------------------------------
# A layout as the plan sizes it (plan.py, planner/search.py)
# ---------------------------------------------------------------------------------------------------------


PLANNED_DEVICE = "cuda"  # the hardware model's presets are GPUs: their attention kernels and dropout masks


def plan_dtypes(settings) -> tuple:
    """(compute, param, master) dtypes as train.start_run chooses them; --dtype auto plans for a GPU: bf16."""
    name = settings.args.dtype if settings.args.dtype != "auto" else "bf16"
    compute = DTYPES[name]
    return name, compute, (compute if settings.args.zero else torch.float32), torch.float32


def plan_settings(settings):
    """The model's vocabulary as the plan sizes it: --vocab-size as given (Megatron's runs pad theirs:
    Narayanan et al.'s V = 51,200), else --tokenizer's, or a gpt3-* preset's own (50304) when --tokenizer is
    not given (a real run takes the corpus's: the plan cannot read one)."""
    args = settings.args
    if getattr(args, "vocab_size", None):
        settings.model.vocab_size, settings.model.real_vocab_size = args.vocab_size, None
    elif "tokenizer" not in settings.given and args.preset.startswith("gpt3-"):
        settings.model.vocab_size = model_lib.PRESETS[args.preset].vocab_size
    return settings


def layout_name(settings) -> str:
    a, s = settings.args, settings.shape
    name = f"D{s.dp}·P{s.pp}·C{s.cp}·T{s.tp}" + (f"·E{s.ep}" if s.ep > 1 else "")
    name += f" ZeRO-{a.zero} B_μ={settings.micro_batch_size} m={settings.micro_batches}"
    if s.pp > 1:
        name += f" {a.pp_schedule}" + (f"(v={a.pp_virtual})" if a.pp_schedule == "interleaved" else "")
    name += " SP" if settings.sequence_parallel else ""
    name += f" offload={a.offload}" if getattr(a, "offload", None) else ""
    return name + (" AC" if settings.model.activation_checkpointing else "") + (
        " SAC" if settings.model.selective_recompute else "")  # full / selective recompute


# ---------------------------------------------------------------------------------------------------------
# Every real run: its measured step time next to the hardware model's prediction for this machine
# ---------------------------------------------------------------------------------------------------------


def predicted_step(run, hw: hardware.Hardware) -> Prediction:
    """One step of a built run as the hardware model `hw` predicts it (check_line's; the metrics file's start-up
    figures, report.run.startup_figures)."""
    facts = dict(layout_facts(run.settings, x=activations.activation_shape(run)), dtype=run.settings.dtype)
    return predict(role_of(run), facts, hw)


def check_line(run, hw: hardware.Hardware, seconds: float, steps: int) -> str:
    """'hardware model: step time measured ... vs predicted ...': the model checked against the run it describes
    (not a line starting with "step ": those are the step lines)."""
    if not steps:
        return "hardware model: no step timed (the first is left out), nothing to check it against"
    settings = run.settings
    prediction = predicted_step(run, hw)
    measured = seconds / steps
    ends, factor = hw.calibration.ends_fraction, hw.calibration.layout_factor
    ends = f" (the ends at {ends:.2f})" if ends is not None else ""
    ends += f", the layout's own ops ×{factor:.2f}" if factor is not None else ""
    link = (f"link {hw.intra_gbps:.2f} GB/s, α {hw.intra_latency_us:.0f} µs, overlap φ {hw.overlap:.2f}"
            if run.mesh.shape.world_size > 1 else "one process: no link")
    return (f"hardware model: step time measured {measured * 1e3:,.1f} ms (mean of {steps})"
            f" vs predicted {prediction.step * 1e3:,.1f} ms ({measured / prediction.step:.2f}×) by the hardware"
            f" model of this machine ({hw.name}: {hw.peak(settings.dtype) / 1e9:,.1f} GFLOP/s {settings.dtype},"
            f" GEMMs at e {hw.calibration.gemm_fraction:.2f} of it{ends}, {link}):"
            f" compute {prediction.compute * 1e3:,.1f},"
            f" exposed comm {prediction.exposed_comm * 1e3:,.1f} (of {sum(prediction.total.values()) * 1e3:,.1f}),"
            f" bubble {prediction.bubble * 1e3:,.1f}, update {prediction.update * 1e3:,.1f} ms")
