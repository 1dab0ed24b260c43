"""FP8 delayed scaling with redundant experts (--fp8 delayed --moe-replicas R): one amax history per LOGICAL expert
linear, whichever slots hold it, wherever they are.

experts/eplb.py places N logical experts in R physical slots, R/E on each ep rank, a hot expert in c_i of them, and
moves slots at a re-plan; fp8.convert makes each slot its own FP8 linear (fp8.py's Experts). A logical expert linear
(`transformer.h.<l>.mlp.experts.<i>.c_fc`, `.c_proj`) is one tensor in c_i copies: as without replicas, one
history per role (input, weight, grad_output) and one scale, so it is kept once per logical expert, on EVERY rank
(`ExpertHistory`, N·2 per MoE layer), and each slot reads the history of the expert it holds this step (its
`amax_history` and `scale` ARE that expert's tensors: `ReplicaHistories.point`). The step's amax of expert i:

    amax_i = MAX over the slots q holding i (phy2log[q] = i, on any rank of dp×cp) and their micro-batches of the
             slot's amax,

the amax the same step would record without replicas (the rows of i, split over its slots: the MAX of their
amaxes is theirs; the weight's copies are bitwise equal). Each rank MAXes its own slots into an [N·2·L_moe, 3]
table (`gather`, zeros for experts it holds no slot of); the table joins the dense linears' rows in fp8.Fp8Handle's
after_grad_sync all-reduce over dp×cp (and tp): every rank then rolls every logical history alike. Slots are
re-pointed after the roll (`point`): a re-plan that moved slots (moe's after_grad_sync runs first, train.AXES) or a
checkpoint that placed them anew (`after_load`) changes which history a slot reads, and nothing moves: every rank
holds them all. The step's mapping is the one each slot recorded at its last `point` (a re-plan inside the step's
after_grad_sync must not move a slot's amax to its new expert).

Symbols: N logical experts, L_moe MoE layers this rank holds, L history length.
1. Replicated and split: the N·2·L_moe histories and scales on every rank of dp×cp and tp (without replicas: each
   on the ep rank of its expert only).
2. Peak per device: N·2·L_moe·(3L + 3 + 3)·4 bytes (history, scale, the step's gathered amax), instead of the
   slots' (R/E)·2·L_moe·(3L + 3)·4; each slot keeps its own step amax and last scale (6·4 bytes), and its format
   maxima (3·4): `scaling_state_bytes`, the start-up's figure.
3. Messages: per optimizer step, 12·N·2·L_moe bytes more in the delayed recipe's all-reduce over dp×cp (and tp),
   the slots' own rows (12·(R/E)·2·L_moe over expert_dp) no longer sent; the first step (empty histories) scales
   like current, which sends nothing for experts.
4. Restart state: the logical histories and scales, "fp8/transformer.h.<l>.mlp.experts.<i>.<linear>.amax_history"
   and ".scale" (fp8.Fp8Handle.state_pieces): the keys of a run without replicas, so a checkpoint resumes with or
   without replicas, on any E and R; written by coordinate 0 of dp×cp and tp.
"""

from __future__ import annotations

import torch

from precision.fp8_scaling import DelayedHistory


class ExpertHistory(DelayedHistory):
    """One logical expert linear's delayed state: history [3, L] (column 0 the latest), scale [3], and this step's
    amax [3] (`ReplicaHistories.gather`); rolled as fp8.Fp8Linear rolls a linear's (fp8_scaling.DelayedHistory)."""

    def __init__(self, name: str, recipe, fmt_max: torch.Tensor, delayed_groups: tuple, device):
        self.name, self.recipe, self.fmt_max, self.delayed_groups = name, recipe, fmt_max, delayed_groups
        self.amax_history = torch.zeros(3, recipe.amax_history, device=device)
        self.scale = torch.ones(3, device=device)
        self.step_amax = torch.zeros(3, device=device)
        self._history_ready, self._history_version = False, self.amax_history._version


class ReplicaHistories:
    """The logical histories of the MoE layers' experts ({name: ExpertHistory}, sorted: the same on every rank)
    and the slots that read them: slots, [(fp8 linear, layer's eplb.Replicas, slot q, layer id, "c_fc"|"c_proj")]."""

    def __init__(self, slots: list, n_experts: int, recipe, delayed_groups: tuple, device):
        self.slots = slots
        names = sorted({self.name(layer_id, expert, leaf) for _, _, _, layer_id, leaf in slots
                        for expert in range(n_experts)})
        fmt_max = slots[0][0].fmt_max
        self.histories = {name: ExpertHistory(name, recipe, fmt_max, delayed_groups, device) for name in names}
        self.reading = {}  # {id(slot linear): the name of the history it read this step}
        self.point()

    @staticmethod
    def name(layer_id: int, expert: int, leaf: str) -> str:
        return f"transformer.h.{layer_id}.mlp.experts.{expert}.{leaf}"

    def point(self) -> None:
        """Each slot reads its expert's history now (the plan in place): the very tensors, and their readiness."""
        for linear, replicas, q, layer_id, leaf in self.slots:
            history = self.histories[self.name(layer_id, replicas.phy2log[q], leaf)]
            linear.amax_history, linear.scale = history.amax_history, history.scale
            linear._history_ready, linear._history_version = history.history_ready, history.amax_history._version
            self.reading[id(linear)] = history.name

    def gather(self) -> None:
        """Each history's step amax: the MAX of this rank's slots that read it this step (NaN propagates)."""
        for history in self.histories.values():
            history.step_amax.zero_()
        for linear, *_ in self.slots:
            history = self.histories[self.reading[id(linear)]]
            history.step_amax.copy_(torch.maximum(history.step_amax, linear.step_amax))


def scaling_state_bytes(linears: int, histories: ReplicaHistories | None, history_length: int) -> int:
    """The FP8 scaling state this rank holds, float32 (fp8.py's item 2): each of its `linears` FP8 linears its
    format maxima, step amax and last scale (3 + 3 + 3) and, unless it is a redundant slot reading its expert's,
    its history and scale (3L + 3); each logical expert's history, scale and step amax (3L + 3 + 3; its format
    maxima a slot's)."""
    slots, logical = (len(histories.slots), len(histories.histories)) if histories else (0, 0)
    per_history = 3 * history_length + 3
    return 4 * (9 * linears + (linears - slots) * per_history + logical * (per_history + 3))
