"""Host-memory offload under ZeRO (ZeRO-Offload, Ren et al. 2021; ZeRO-Infinity): the optimizer state in host memory,
the update on the host, the new weights copied back. A run on fewer GPUs than planned trades PCIe bytes and host
FLOPs for device memory (planner/search.py prices both).

`--offload optimizer` keeps Adam's two moments in host memory; `--offload optimizer+master` the fp32 master weights
too. Either way (`OffloadZeroLayout`, a zero.ZeroLayout of stage 1 or 2, every rank for its own shard):
1. each unit's gradient shard, once final (its last reduce-scatter of the step, in the backward's tail), is copied
   to a host buffer in its own dtype (pinned on CUDA, non-blocking: the copy overlaps the rest of the backward;
   on a CPU the host is the device and the copy is a memcpy); a unit holding replicas (the tied embedding, TP's
   LayerNorms), which an axis may sum in place after the reduction, is copied at the update instead;
2. optim.update's order on the host copies: unscale, the world's one norm all-reduce (its two numbers built on
   the host, reduced on the device), clip, then per unit zero.py's AdamW on the host moments and a host master:
   the resident one (optimizer+master) or a staging copy of the device's (optimizer: copied in, then back);
3. the new working weights (optimizer+master: cast on the host, copied in the working dtype) reach the device and
   are all-gathered as zero.py publishes them.
The arithmetic is zero.py's, element for element, so an offloaded run equals the resident one (float64 tests to
1e-12; bitwise on this CPU). Every host↔device copy is counted (`moved`: bytes each way, per step) against the
formulas below. Served: ZeRO-1 and ZeRO-2 (zero.ZeroLayout), with or without a pipeline at stage 1; refused
(`check_flags`): no ZeRO, ZeRO-3 (its gathers read the working shard on the device only), ZeRO-2 under a
pipeline (parallel/zero_pipeline.py's layouts), DiLoCo and --moe-replicas (their steps move optimizer state).

Accounting (zero.py's symbols: S = Ψ'/D the shard's elements, b_w working, b_a accumulated gradient, b_m master):
1. Replicated vs split: as ZeRO-1/2; the optimizer's shard lives in host memory instead of the device's.
2. Device per rank: zero.py's persistent formula with b_o = 0 (optimizer+master) or b_m (optimizer: the master
   stays, unless it is the working shard itself, equal dtypes): `bytes_per_param`. Host per rank (`host_bytes`):
   2·b_m·S moments, b_a·S the gradient's staging, b_m·S the master (resident, or optimizer's staging copy).
3. Host↔device bytes per step (`predicted_moved`): device→host b_a·S (the gradient) + (optimizer) b_m·S (the
   master in); host→device b_w·S (optimizer+master: the new weights) or b_m·S (optimizer: the master back). On
   the critical path: the last unit's gradient copy and every host update (they follow the norm's all-reduce),
   and the weights' copies before their all-gathers. No new collective. The host's AdamW streams
   (b_a + 6·b_m)·S bytes (gradient, master and moments read; master and moments written) and, optimizer+master,
   b_w·S more (the working copy cast). `figures` gives all of it from S and the dtypes: the layout's
   `predicted_moved` and `host_bytes` and the planner's price (planner/time_model.py, planner/formulas.py) call it.
4. Restart state: zero.py's pieces, unchanged (the host tensors are the pieces): a checkpoint loads with or
   without offload, on any D.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from optim import StepResult, update
from zero import BytesPerParam, Unit, ZeroLayout

MODES = ("optimizer", "optimizer+master")


@dataclass(frozen=True)
class OffloadFigures:
    """One rank's offload per step, from its shard's S elements (docstring items 2 and 3)."""

    moved: dict  # {"d2h", "h2d"}: host↔device bytes; d2h's gradient part b_a·S is `grad_d2h`
    grad_d2h: int  # the gradient's copy, the part that overlaps the backward
    host: int  # bytes this rank holds in host memory
    update: int  # bytes the host's AdamW streams
    freed: int  # device bytes the offload takes off zero.py's resident layout (its b_o less what stays)


def optimizer_stays(b_w: int, b_m: int, master: bool) -> int:
    """The device's b_o under offload (docstring item 2): the master, where it stays and is not the working shard."""
    return 0 if master or b_w == b_m else b_m


def figures(S: float, b_w: int, b_m: int, b_a: int, master: bool) -> OffloadFigures:
    """S elements in this rank's optimizer shard, b_w working, b_m master, b_a accumulated gradient bytes."""
    moved = {"d2h": b_a * S, "h2d": b_w * S} if master else {"d2h": (b_a + b_m) * S, "h2d": b_m * S}
    freed = (2 * b_m + (0 if b_w == b_m else b_m) - optimizer_stays(b_w, b_m, master)) * S  # zero.py's b_o less
    return OffloadFigures(moved=moved, grad_d2h=b_a * S, host=(2 * b_m + b_a + b_m) * S,
                          update=(b_a + 6 * b_m + (b_w if master else 0)) * S, freed=freed)


@dataclass(frozen=True)
class OffloadConfig:
    """--offload MODE, validated: what lives in host memory."""

    mode: str  # "optimizer": Adam's moments; "optimizer+master": and the master weights

    @property
    def master(self) -> bool:
        return self.mode == "optimizer+master"


def check_flags(args) -> OffloadConfig | None:
    """--offload on this run's layout, or ValueError naming the flag (cli/flags.py calls it once, before any rank
    waits)."""
    if args.offload is None:
        return None
    if getattr(args, "plan_search", False):  # the search chooses the layout: each is checked here as it is sized
        return OffloadConfig(args.offload)
    if not args.zero:
        raise ValueError(f"--offload {args.offload} needs --zero 1 or 2: the offloaded state is ZeRO's shard of it")
    refused = [(args.zero == 3, "--zero 3 (its gathers read the working shard on the device)"),
               (args.zero == 2 and args.pp > 1, "--zero 2 under --pp (parallel/zero_pipeline.py's layouts)"),
               (args.diloco_h, "--diloco-h"), (getattr(args, "moe_replicas", None), "--moe-replicas")]
    for on, what in refused:
        if on:
            raise ValueError(f"--offload {args.offload} does not serve {what}")
    return OffloadConfig(args.offload)


class OffloadZeroLayout(ZeroLayout):
    """zero.ZeroLayout (stages 1/2) with the optimizer's shard in host memory and the update on the host."""

    def __init__(self, module, config, groups=None, coords=None, update_group=None,
                 offload: OffloadConfig = OffloadConfig("optimizer+master")):
        self.offload = offload
        self.device = next(p for p in module.parameters() if p.requires_grad).device
        self.pin = self.device.type == "cuda"  # page-locked host buffers: DMA copies the host does not wait for
        self.host = torch.device("meta" if self.device.type == "meta" else "cpu")  # a plan's (plan.py) stay on meta
        self.moved = {"d2h": 0, "h2d": 0}  # bytes copied so far (docstring item 3), and the steps they span
        self.moved_steps = 0
        self._copies = {}  # unit → its gradient's host copy, started when the shard was final
        self._synced = deque()  # per reduction in flight: launched in the step's synchronised backward
        super().__init__(module, config, groups, coords, update_group)
        # A unit holding replicas (the tied embedding over pp, TP's LayerNorms) may be summed in place after the
        # reduction (an axis's after_grad_sync, through grad_pieces): its copy waits for the update.
        self._late = {u for u in self.units if any(p.shard_info.replicated_over for p in u.params)}

    def _build_unit(self, unit: Unit):
        """zero.py's buffers, then the moments (and the master) moved to the host, with the staging buffers."""
        super()._build_unit(unit)
        unit.exp_avg, unit.exp_avg_sq = self._host(unit.exp_avg), self._host(unit.exp_avg_sq)
        if self.offload.master:
            unit.master = self._host(unit.master)  # a copy even where it was the working shard (equal dtypes)
        unit.host_grad = self._host(torch.zeros(unit.shard_numel, dtype=self.accumulate_dtype, device=self.host))
        unit.host_master = None if self.offload.master else self._host(torch.zeros_like(unit.master))

    def _host(self, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.to(self.host, copy=True)
        return out.pin_memory() if self.pin else out

    # --- 1. the gradient shard to the host, as soon as it is final

    def _launch(self, unit: Unit):
        self._synced.append(self.require_grad_sync)  # in _in_flight's order: the step's last reduction of the unit?
        super()._launch(unit)

    def _complete_oldest(self):
        unit, synced = self._in_flight[0][0], self._synced.popleft()
        super()._complete_oldest()
        if synced and unit not in self._late:  # the shard is final (stage 2 reduces every micro-batch; the
            # synchronised one is the last)
            self._copy(unit.host_grad, unit.grad_shard, "d2h")
            self._copies[unit] = True

    def grad_pieces(self, params) -> list:
        """zero.py's; a unit whose pieces an axis takes (to sum in place) is copied to the host in the update."""
        wanted = set(params)
        for unit in self.units:
            if any(p in wanted for p in unit.params):
                self._late.add(unit)
                self._copies.pop(unit, None)
        return super().grad_pieces(params)

    def _copy(self, into: torch.Tensor, source: torch.Tensor, direction: str) -> None:
        """One host↔device copy, counted (non-blocking from and into pinned memory on CUDA)."""
        into.copy_(source, non_blocking=self.pin)
        self.moved[direction] += source.numel() * source.element_size()

    # --- 2. and 3. the update on the host, the new weights back

    @torch.no_grad()
    def step(self, scaler, clip: float, extra_nonfinite=None) -> StepResult:
        for unit in self.units:  # a unit whose reduction completed before the synchronised backward: now
            if unit not in self._copies:
                self._copy(unit.host_grad, unit.grad_shard, "d2h")
        self._copies.clear()
        if self.pin:
            torch.cuda.current_stream(self.device).synchronize()  # the gradients are on the host
        grads = [u.host_grad.to(self.master_dtype) for u in self.units]  # the same tensors if the dtypes agree
        counted = [not u.uncounted_segments for u in self.units]
        pieces = [g[lo:hi] for u, g in zip(self.units, grads) if u.uncounted_segments for lo, hi in u.counted_segments]
        self.moved_steps += 1

        def adamw_and_publish():
            self.optimizer_step_count += 1
            gathers = []
            for unit, grad in zip(self.units, grads):
                if self.offload.master:
                    self._adamw(unit, grad)
                else:  # the master through a host staging copy
                    self._copy(unit.host_master, unit.master, "d2h")
                    if self.pin:  # the host reads it next: the non-blocking copy must have landed
                        torch.cuda.current_stream(self.device).synchronize()
                    self._adamw(unit, grad, unit.host_master)
                    self._copy(unit.master, unit.host_master, "h2d")
                gathers.append(self._publish(unit))
            for work in (work for work in gathers if work is not None):
                work.wait()

        return update(grads, counted, scaler, clip, adamw_and_publish, self.device, counted_pieces=pieces,
                      extra_nonfinite=extra_nonfinite, group=self.update_group)

    def _publish(self, unit: Unit):
        """optimizer+master: the new weights cast on the host, copied to the device's working shard, all-gathered
        from a copy of it (zero.py's rule: the input may not overlap the output); optimizer: zero.py's."""
        if not self.offload.master:
            return super()._publish(unit)
        self._copy(unit.weight_shard, unit.master.to(self.param_dtype), "h2d")
        if unit.dp_size == 1:
            return None
        return dist.all_gather_single(unit.weights, unit.weight_shard.clone(), group=unit.group, async_op=True)

    # --- Accounting: what stays on the device, what the host holds, what crosses per step

    def bytes_per_param(self) -> BytesPerParam:
        """The device's b_w, b_g, b_o (zero.py's persistent formula then holds for the device): b_o is the master
        that stays (optimizer, unless it is the working shard), else 0."""
        b = super().bytes_per_param()
        stays = optimizer_stays(b.weights, self.master_dtype.itemsize, self.offload.master)
        return BytesPerParam(weights=b.weights, grads=b.grads, optimizer=stays)

    def host_bytes(self) -> dict:
        """What this rank holds in host memory: predicted (docstring item 2) and measured (its host tensors)."""
        predicted = self.offload_figures().host  # moments, gradient staging, master (resident or staging)
        held = sum(t.nbytes for u in self.units for t in (u.exp_avg, u.exp_avg_sq, u.host_grad,
                                                          u.master if self.offload.master else u.host_master))
        return {"predicted": predicted, "held": held}

    def held_bytes(self) -> dict:
        """The device's: zero.py's kinds, less what lives on the host."""
        weights = sum(u.weights.nbytes for u in self.units)
        grads = sum((u.grad_sum if self.stage == 1 else u.grad_shard).nbytes for u in self.units)
        optimizer = sum(u.master.nbytes for u in self.units
                        if not self.offload.master and u.master is not u.weight_shard)
        return {"weights": weights, "grads": grads, "optimizer": optimizer, "total": weights + grads + optimizer}

    def predicted_moved(self) -> dict:
        """Host↔device bytes of one step (docstring item 3)."""
        return self.offload_figures().moved

    def offload_figures(self) -> OffloadFigures:
        """`figures` of this rank's shard and dtypes (the plan's role reads them: planner/time_model.py)."""
        b_w, b_m, b_a = (d.itemsize for d in (self.param_dtype, self.master_dtype, self.accumulate_dtype))
        return figures(sum(u.shard_numel for u in self.units), b_w, b_m, b_a, self.offload.master)

