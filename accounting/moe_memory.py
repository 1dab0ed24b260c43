"""The MoE block's peak per device: the dispatch and combine buffers, tensor by tensor from moe.py's forward.

A step's memory peaks inside some block: everything saved so far, plus what that block holds at its highest
and has not saved (in its forward, or its backward: `backward_rise`). For a MoE block that is the
dispatch and combine (tokens·k rows, dropless), not attention. This file predicts, per MoE layer and
micro-batch of one rank, the bytes of the tensors that
moe.MoE.forward (dispatch_and_combine, run_local_experts) makes and holds at once, from their shapes; memory.
LiveTensors measures the same figure (the tensors ops return; not a kernel's scratch nor the allocator's
rounding), and on a CPU they agree to the byte for a given routing (tests/accounting/test_moe_memory.py).

Symbols as moe.py's: T tokens this rank routes, N experts, k, h, E, S rows it sends (the kept slots), R rows
its experts run (E = 1: R = S), e_c the rows' bytes (autocast's dtype), e_r the router's (fp32 or wider), e_x
the block input's (LayerNorm's output: fp32 under CUDA autocast), e_w = max(e_c, e_r) the combine's, 8 an
int64 index, m a dropout mask's bytes per element. In forward order, saved for backward (s) or not (t):
    router     logits, scores T·N·e_r each (s); top-k T·k·e_r (s; softmax with k = 1: the weights, t) and T·k·8
               (s); k > 1 or sigmoid: their sum T·e_r (s) and the weights T·k·e_r (t); sigmoid (experts/router.py):
               the scores' sum T·e_r (s) and the normalised scores T·N·e_r (t; the balance loss's P); the loads
               N·8 (t); statistics e_r·(T + 4N + 3) (s), the aux values 2·e_r (t); cast to e_r when narrower: the
               input T·h·e_r, the weight N·h·e_r (s). The selection bias, the group limit's [T, G] scores and
               mask, the top-k's [T, N] sort and the weights' scale are transient (freed before P0)
    capacity   f > 0, capacity_keep over the T_μ·k slots of the micro-batch: a one-hot T_μ·k·N·1, its cumsum
               and their product T_μ·k·N·8 each (gone by dispatch); then the verdicts T·k·1, the slots' experts
               T·k·8 (t; also with replicas, experts/eplb.py: each slot's physical slot)
    dispatch   E = 1: the sort's order T·k·8 (s), the counts (N_p+1)·8 (t; N_p = N, or the R_p physical slots
               with replicas), each row's token S·8 (s), the tokens cast for the rows T·h·e_c (autocast with
               e_c ≠ e_x; t), the sent rows S·h·e_c (s)
    experts    the hidden R·4h·e_c twice (s), each expert's output R·h·e_c together, then concatenated R·h·e_c
               (s); autocast casts each of the N_p/E experts' weights once (its cache keeps them for the
               forward), 8h²·e_c (s), and biases, 5h·e_c (t)
    combine    each row's gate S·e_r, token S·8 and weighted row S·h·e_w (s); y's zeros and y, T·h·e_w each (t)
    E > 1      the deduplicated exchange (experts/dispatch.py; S, R its pairs, R_e the rows its experts run, p =
               N_p/E), `exchange_terms`: the slots' ranks T·k·8, the hit mask (E+1)·T, the pairs' order E·T·8,
               the kept slots (N_p+1)·8, the counts 2·(N_p+E)·8, the pairs' ranks S·8 and local slots S·k·8,
               the metadata S·2k·e_r and R·2k·e_r, the rows received R·h·e_c, the sum's zeros and the summed rows
               R·h·e_w each (t); the pairs' tokens S·8, their slots-here mask S·k, the fan-out's order R·k·8 and
               arrival R_e·8, its rows R_e·h·e_c, the experts' hidden and outputs as above with R_e rows, the
               slots' gates R_e·e_r, the weighted outputs R_e·h·e_w and the rows back S·h·e_c (s); y's zeros
               and y T·h·e_c (t; y sums e_c rows)
    output     e_w ≠ e_x: y cast T·h·e_x (t; y then freed); Q shared experts (experts/shared.py, one MLP of width
               4Qh on the block's input): autocast's input cast T·h·e_c and weight copies 8Qh²·e_c (s), biases
               (t), the hidden T·4Qh·e_c twice (s), the output T·h·e_c (t), y + it T·h·e_x (t, y then freed);
               dropout: its output T·h·e_x (t) and mask T·h·m (s)
Alive together (what each moment holds, from the code's order and its local variables), the peak is the largest:
    P0  capacity's product: the router's tensors + 17·T_μ·k·N
    P1  the experts' outputs concatenated: router, verdicts, dispatch, hidden, weight copies, 2·R·h·e_c
    P2  the combine's index_add: P1's less the per-expert outputs, + the combine's
    P3  the output's dropout, dispatch_and_combine returned: its locals gone (zeros, counts, cast tokens,
        slots' experts, E > 1 the sent rows and the send buffer)
    P4  y cast to the input's dtype (e_w ≠ e_x): y and its cast
    P5  the shared experts' output added: their hidden and output, y (or its cast), the sum
    P6  E > 1: the rows back summed into y (index_add): the exchange's locals, y's zeros and y (P2 is then the
        receiver's index_add of its weighted outputs; the worst case, E·T·k rows on one rank, peaks there)
E = 1, dropless, no autocast: P2 = 11·S·h·e + 2·T·h·e + small, of which 9·S·h·e saved. P1 beats P2 when the
experts run far more rows than the rank sends, R·h·e_c > S·h·(e_c + e_w) + S·(e_r + 8) + 2·T·h·e_w: with one
dtype about R > 2S + 2T (the worst case at E·k > 2k + 2: E = 4, k = 2 in fp32 peaks at P1).
Uniform routing: S = R = T·k (at most this rank's share of capacity, N·C_μ/(C·T_sp)); worst case: S =
min(T·k, N·C_μ), R = E·min(T·k, (N/E)·C_μ) (the whole ep group picks this rank's experts).

1. Replicated and split: nothing of its own (these are moe.py's tensors).
2. Peak per device: what the step's peak adds to the activations (which count the saved bytes) while a MoE
   block runs is `above_saved` = peak − saved; attention's is its output and the dropout's, s·b·h·e_c·(1 +
   [dropout]) + autocast's bias copies (`attention_above_saved`: the fused and math paths save all else first). The
   larger sets the peak (time_model.Role's temporaries; the plan's and the run's are the same formula). Under
   CP and SP the MoE figures hold as written (measured at P2); capacity's gathered choices there are freed
   before dispatch, so only a P0 peak would differ (by the gathered T_μ·k choice bytes, not written).
   The backward rises above the saved tensors it frees (`backward_rise`: the combine's mul backward, B1, or
   the shared experts', B0), and can exceed the forward: a BlockPeak's `above_saved` is the larger, which the
   step's peak uses. Measured equal on one device and, where the receiver's mul sets it, under EP (E = 2;
   each source's rows a GEMM of their own after the fan-out); a lower bound where another moment of the EP
   backward rises higher (seen with capacity, by 32 bytes). A router with N ≫ h rises in its own backward,
   its [T, N] gradients (B2, `router_rise`; the aux losses' own [T, N] gradients in a step: not written).
   FP8 experts (accounting/fp8_experts.py, any --fp8 recipe): `fp8_expert_terms` replace the experts' rows (E = 1
   the sent S, E > 1 the fan-out's R_e), each of the c chunks (an expert's rows, or one source's rows for a local
   slot) padded to 16 rows, P in all: their FP8 codes, scales (blockwise: one per 1×128 tile of a padded row,
   `fp8_blockwise`) and c_fc's padded output. With the forward's own chunk counts (moe.MoE.local_rows) the saved
   bytes and P1, P2 (E > 1 also P6) are measured equal (tests/accounting/test_moe_memory.py); the plan takes
   P = N_p·15/2 and c = N_p (fp8_experts.expected_padded_rows). A precision recipe (`recipe`,
   accounting/recipe_experts.py) saves the weight parameter itself: no autocast copies in the table; its saved
   bytes and P1, P2 are measured equal. Not written: the CPU emulation's temporaries inside an expert's GEMM or
   fake quantisation (where a CPU forward peaks), the first forward's weight codes, a recipe's tail layers, and
   the backward under FP8 or a recipe.
3. Messages: none (moe.py's all-to-alls carry these rows).
4. Restart state: none.

    rank_peak(traffic, x)     a rank's RankPeak (uniform, worst, attention): time_model.Role's and plan_search's
    block_peak(shape)         one layer's BlockPeak for given rows (the start-up's measurement is beside it)
    backward_rise(shape)      (moment, bytes) its backward rises above the saved tensors it has freed
    startup_lines(traffic, run)   the moe section's start-up lines (report/axes.py prints them)
"""

from __future__ import annotations

from dataclasses import dataclass

from accounting import activations, fp8_experts
from experts import dispatch, router
import mfu
from experts.router import rows_per_token
from precision.fp8_scaling import TILE_ACTIVATION

MOMENTS = {"P0": "capacity's one-hot product", "P1": "the experts' outputs concatenated",
           "P2": "the combine's index_add", "P3": "the output's dropout", "P4": "y cast to the input's dtype",
           "P5": "the shared experts' output added", "P6": "the rows back summed into y (E > 1)"}


@dataclass(frozen=True)
class DispatchShape:
    """What one MoE layer's forward holds depends on: the routing's rows and the dtypes (the module's symbols)."""

    tokens: int  # T
    sent: int  # S
    received: int  # R
    experts: int  # N
    topk: int  # k
    hidden: int  # h
    ep: int = 1  # E
    capacity_tokens: int = 0  # T_μ: the micro-batch's tokens capacity_keep orders (0: dropless)
    e_c: int = 4
    e_r: int = 4
    e_x: int = 4
    weight_bytes: int = 4  # the working weights' element (autocast casts them per call when e_c differs)
    expert_params: int = 0  # Ψ_e
    dropout_mask: int | None = None  # m, bytes per mask element; None without dropout
    score: str = "softmax"  # the router's scores (experts/router.py): "sigmoid" keeps its normalised copy and sum
    shared: int = 0  # Q shared experts (experts/shared.py): one MLP of width Q·4h on the block's input
    slots: int = 0  # R_p physical expert slots with --moe-replicas (experts/eplb.py); 0: the N experts in place
    expert_rows: float = 0  # R_e: E > 1, the slots this rank's experts run (the fan-out, experts/dispatch.py)
    fp8: tuple | None = None  # --fp8 (accounting/fp8_experts.py): (P padded rows, c chunks run, e_s an inverse scale's)
    fp8_blockwise: bool = False  # --fp8 blockwise: an inverse scale per 1×128 tile of each padded row, not per chunk
    recipe: bool = False  # a precision recipe's experts (accounting/recipe_experts.py): no autocast weight copies


@dataclass(frozen=True)
class BlockPeak:
    """The predicted peak of one MoE layer's forward: its moment, bytes alive, saved bytes, the buffers alive."""

    moment: str  # P0..P5
    peak: int
    saved: int
    buffers: dict  # {name: bytes} alive at the peak
    shape: DispatchShape
    backward: tuple = ("", 0)  # (moment, bytes): the backward's rise above the saved tensors it frees

    @property
    def forward_above_saved(self) -> int:
        return self.peak - self.saved

    @property
    def above_saved(self) -> int:
        """What the layer adds to the activations at its highest, forward or backward."""
        return max(self.forward_above_saved, self.backward[1])

    @property
    def phase(self) -> str:
        return "backward" if self.backward[1] > self.forward_above_saved else "forward"


def terms(x: DispatchShape) -> list:
    """[(name, bytes, saved, moments alive)] of one forward (the module docstring's table)."""
    T, S, R, N, k, h, E, Q = x.tokens, x.sent, x.received, x.experts, x.topk, x.hidden, x.ep, x.shared
    e_c, e_r, e_x, e_w = x.e_c, x.e_r, x.e_x, max(x.e_c, x.e_r)
    slots = x.slots or N  # what the dispatch sorts by: experts, or with replicas their physical slots
    sigmoid, cast_y = x.score == "sigmoid", (e_w if E == 1 else e_c) != e_x  # E > 1: y sums e_c rows
    cast_rows = e_c != e_x  # autocast's rows from a wider input (without autocast e_c is the input's)
    copies = slots // E * e_c if e_c != x.weight_bytes and not x.recipe else 0  # autocast casts each held expert's
    # weights once (a precision recipe's linears quantise the weight parameter itself)
    end = END  # alive to the forward's end (P0 comes before the dispatch)
    y_alive = ("2" if E == 1 else "6") + "4" + ("" if cast_y else "5" if Q else "3")  # y, until cast or added to
    out = [("router logits, scores [T, N]", 2 * T * N * e_r, True, "0" + end),
           ("router scores normalised [T, N] (sigmoid)", T * N * e_r if sigmoid else 0, False, "0" + end),
           ("router scores' sum [T] (sigmoid)", T * e_r if sigmoid else 0, True, "0" + end),
           ("router top-k choices", T * k * 8, True, "0" + end),
           ("router top-k values", T * k * e_r, k > 1 or sigmoid, "0" + end),  # softmax, k = 1: the weights
           ("router top-k sum", T * e_r if k > 1 or sigmoid else 0, True, "0" + end),
           ("router weights (renormalised)", T * k * e_r if k > 1 or sigmoid else 0, False, "0" + end),
           ("router loads", N * 8, False, "0" + end),
           ("router statistics", e_r * (T + 4 * N + 3), True, "0" + end), ("aux values", 2 * e_r, False, "0" + end),
           ("router's input cast", T * h * e_r if e_x < e_r else 0, True, "0" + end),
           ("router's weight cast", N * h * e_r if x.weight_bytes < e_r else 0, True, "0" + end)]
    if x.capacity_tokens:
        out += [("capacity one-hot, cumsum, product", 17 * x.capacity_tokens * k * N, False, "0"),
                ("capacity verdicts", T * k, False, end)]
    if E == 1:
        out += [("slots' experts (or physical slots)", T * k * 8 if x.capacity_tokens or x.slots else 0, False, "12"),
                ("sort order", T * k * 8, True, end), ("counts", (slots + 1) * 8, False, "12"),
                ("rows' tokens (gather)", S * 8, True, end),
                ("tokens cast for the rows", T * h * e_c if cast_rows else 0, False, "12")]
        out += fp8_expert_terms(x) if x.fp8 else [
            ("sent rows [S, h]", S * h * e_c, True, end), ("experts' hidden [R, 4h] ×2", 8 * R * h * e_c, True, end),
            ("experts' weight copies (autocast)", copies * 8 * h * h, True, end),
            ("experts' bias copies (autocast)", copies * (x.expert_params - 8 * h * h), False, end),
            ("experts' outputs, one per expert", R * h * e_c, False, "1")]
        out += [("experts' outputs concatenated [R, h]", R * h * e_c, True, end),
                ("rows' gates and tokens (index_add)", S * (e_r + 8), True, "2345"),
                ("weighted rows [S, h]", S * h * e_w, True, "2345"),
                ("combine's zeros [T, h]", T * h * e_w, False, "2"),
                ("combine's output y [T, h]", T * h * e_w, False, y_alive)]
    else:
        out += exchange_terms(x, cast_rows, copies, y_alive)
    out += [("y cast to the input's dtype", T * h * e_x if cast_y else 0, False, "4" + ("5" if Q else "3"))]
    if Q:  # the shared experts, one MLP of width Q·4h on the block's input, added to y (experts/shared.py)
        out += [("shared experts' input cast", T * h * e_c if cast_rows else 0, True, "35"),
                ("shared experts' weight copies (autocast)", Q * 8 * h * h * e_c if copies else 0, True, "35"),
                ("shared experts' bias copies (autocast)",
                 (Q * 4 * h + h) * e_c if copies and x.expert_params > 8 * h * h else 0, False, "35"),
                ("shared experts' hidden [T, 4Qh] ×2", 8 * Q * T * h * e_c, True, "35"),
                ("shared experts' output [T, h]", T * h * e_c, False, "5"),
                ("y + the shared experts' output [T, h]", T * h * e_x, False, "35")]
    if x.dropout_mask is not None:
        out += [("dropout output", T * h * e_x, False, "3"), ("dropout mask", T * h * x.dropout_mask, True, "3")]
    return out


END = "123456"  # the moments after the dispatch began: alive to the forward's end
TILE = TILE_ACTIVATION[1]  # --fp8 blockwise: the columns one input scale covers (1×128 tiles)


def fp8_expert_terms(x: DispatchShape) -> list:
    """Under --fp8 (fp8.Fp8Linear on the routed experts, accounting/fp8_experts.py) each of the c chunks (E = 1 an
    expert's rows; E > 1 the rows one source sent a local slot, each its own GEMM) is padded to a multiple of 16, P rows
    in all, and its linears save their inputs as FP8 codes with their inverse scales (e_s: fp32, fp64 for fp64
    inputs), so the rows in are no longer saved (c_fc keeps their codes: E = 1 the sent rows [S, h], alive in
    dispatch_and_combine; E > 1 the fan-out's [R_e, h], alive in dispatch.exchange) and of the hidden only
    c_fc's padded output is (GELU's input; its output is c_proj's input, kept as codes). With r = R (E = 1) or
    R_e the rows the experts run: saved (r + P)·h + (r + P)·4h codes, (r + P)·4h·e_c, and the scales: per tensor
    (current, delayed) a 0-d one per linear and chunk, 2c·e_s; blockwise one per 1×128 tile of each padded row
    (fp8_scaling.quantize_tiles, edge tiles partial), (r + P)·(⌈h/128⌉ + ⌈4h/128⌉)·e_s. Each chunk's output is
    a view of its padded [m + p, h]. No autocast weight copies (the GEMMs run with autocast off)."""
    h, e_c = x.hidden, x.e_c
    padded, chunks, e_s = x.fp8
    if x.ep == 1:
        run, rows_in = x.received, ("sent rows [S, h]", x.sent * h * e_c, False, "12")
    else:
        run, rows_in = x.expert_rows, ("fan-out rows [R_e, h]", x.expert_rows * h * e_c, False, "126")
    rows = run + padded
    tiles = -(-h // TILE) - (-4 * h // TILE)  # a padded row's 1×128 tiles in c_fc's input and c_proj's
    scales = rows * tiles * e_s if x.fp8_blockwise else 2 * chunks * e_s
    return [rows_in, ("FP8 codes of c_fc's and c_proj's inputs [r + P, 5h]", rows * 5 * h, True, END),
            ("FP8 inputs' inverse scales", scales, True, END),
            ("experts' hidden, padded [r + P, 4h] (GELU's input)", rows * 4 * h * e_c, True, END),
            ("experts' outputs, one per chunk, padded", rows * h * e_c, False, "1")]


def exchange_terms(x: DispatchShape, cast_rows: bool, copies: int, y_alive: str) -> list:
    """E > 1: the deduplicated exchange's tensors (experts/dispatch.py, in its order; p = N_p/E slots a rank holds),
    alive until `exchange` returns ("126") or saved to the end; P1 its experts' outputs concatenated, P2 the
    receiver's index_add of the weighted outputs, P6 the sender's index_add of the rows back into y."""
    T, S, R, Re, k, h, E = x.tokens, x.sent, x.received, x.expert_rows, x.topk, x.hidden, x.ep
    e_c, e_r, e_w = x.e_c, x.e_r, max(x.e_c, x.e_r)
    slots = x.slots or x.experts
    exchange = [
        ("slots' experts (or physical slots)", T * k * 8 if x.capacity_tokens or x.slots else 0, False, "126"),
        ("tokens cast for the rows", T * h * e_c if cast_rows else 0, False, "126"),
        ("slots' destination ranks", T * k * 8, False, "126"), ("pairs' hit mask [E+1, T]", (E + 1) * T, False, "126"),
        ("pairs' order [E·T]", E * T * 8, False, "126"), ("slots kept per slot", (slots + 1) * 8, False, "126"),
        ("counts sent and received", 2 * (slots + E) * 8, False, "126"),
        ("pairs' tokens", S * 8, True, END), ("pairs' ranks", S * 8, False, "126"),
        ("pairs' slots on their rank [S, k]", S * k, True, END), ("pairs' local slots", S * k * 8, False, "126"),
        ("metadata sent [S, 2k]", S * 2 * k * e_r, False, "126"),
        ("rows received [R, h]", R * h * e_c, False, "126"),
        ("metadata received [R, 2k]", R * 2 * k * e_r, False, "126"),
        ("fan-out order [R·k]", R * k * 8, True, END), ("fan-out rows' arrival", Re * 8, True, END)]
    experts = fp8_expert_terms(x) if x.fp8 else [
        ("fan-out rows [R_e, h]", Re * h * e_c, True, END),
        ("experts' hidden [R_e, 4h] ×2", 8 * Re * h * e_c, True, END),
        ("experts' weight copies (autocast)", copies * 8 * h * h, True, END),
        ("experts' bias copies (autocast)", copies * (x.expert_params - 8 * h * h), False, END),
        ("experts' outputs, one per expert", Re * h * e_c, False, "1")]
    return exchange + experts + [
        ("experts' outputs concatenated [R_e, h]", Re * h * e_c, True, END),
        ("slots' gates [R_e]", Re * e_r, True, "23456"), ("weighted outputs [R_e, h]", Re * h * e_w, True, "23456"),
        ("sum's zeros [R, h]", R * h * e_w, False, "2"), ("rows summed [R, h]", R * h * e_w, False, "26"),
        ("rows back [S, h]", S * h * e_c, True, "3456"), ("y's zeros [T, h]", T * h * e_c, False, "6"),
        ("y [T, h]", T * h * e_c, False, y_alive)]


def block_peak(x: DispatchShape) -> BlockPeak:
    """The largest of the moments this forward has (P0 with capacity, P3 with dropout or a cast y)."""
    table = terms(x)
    moments = ["P1", "P2"] + (["P0"] if x.capacity_tokens else []) + (["P3"] if x.dropout_mask is not None else [])
    moments += (["P4"] if (max(x.e_c, x.e_r) if x.ep == 1 else x.e_c) != x.e_x else []) + (["P5"] if x.shared else [])
    moments += ["P6"] if x.ep > 1 else []
    alive = {m: sum(nbytes for _, nbytes, _, when in table if m[1] in when) for m in moments}
    moment = max(moments, key=lambda m: (alive[m], m))
    return BlockPeak(moment, alive[moment], sum(nbytes for _, nbytes, saved, _ in table if saved),
                     {name: nbytes for name, nbytes, _, when in table if moment[1] in when and nbytes}, x,
                     backward_rise(x))


BACKWARD_MOMENTS = {"B0": "the shared experts' c_proj backward", "B1": "the combine's mul backward",
                    "B2": "the router's top-k gather backward"}


def backward_rise(x: DispatchShape) -> tuple:
    """(moment, bytes): how far the layer's backward rises above the forward's saved tensors it has freed (what
    memory.BackwardRise measures, the parameters' gradients aside), the larger of
        B1  the combine's mul backward: the weighted rows' gradient and the mul's two, 2·S·h·e_w + S·h·e_c
            (its row gradient cast to e_c; S·e_r, the gates' sum, when e_c = e_w), less what the combine's
            index_add frees, S·8 of tokens (and the weighted rows, counted in the three), less the dropout's
            mask T·h·m (the dropout's gradient is freed by then)
        B0  shared experts (Q > 0; they run first, being added last): their hidden's gradient T·4Qh·e_c,
            under autocast the output gradient's cast T·h·e_c and their c_proj weight and bias gradients in
            e_c before the cast to the parameters' dtype, (4Qh² + h·b)·e_c; with dropout its gradient T·h·e_x
            less its mask; with them B1 is less their hidden, freed by then, plus their input's gradient,
            8QTh·e_c − T·h·e_x (it beats B0 at about k > 6Q in one dtype: measured with k = 8, Q = 1)
    E > 1 (experts/dispatch.py) B1 is the receiver's mul backward on its R_e rows: 2·R_e·h·e_w + (R_e·h·e_c, or
    R_e·e_r in one dtype) less the weighted outputs and the rows back it frees, S·h·e_c, and the mask.
    Not written: each expert's backward (r·4h·e_c for its r rows, beside the gradient of all R rows: it can
    set the rise when R ≫ S, the worst case's receiving rank) and, under EP, the reverse all-to-alls."""
    T, S, h, Q = x.tokens, x.sent, x.hidden, x.shared
    e_c, e_w = x.e_c, max(x.e_c, x.e_r)
    mask = T * h * x.dropout_mask if x.dropout_mask is not None else 0
    if x.ep == 1:
        combine = 2 * S * h * e_w + (S * h * e_c if e_c != e_w else S * x.e_r) - 8 * S - mask
    else:  # the receiver's mul backward, R_e rows; freed: the weighted outputs and the rows back
        rows = x.expert_rows
        combine = 2 * rows * h * e_w + (rows * h * e_c if e_c != e_w else rows * x.e_r) - S * h * e_c - mask
    if not Q:
        return max(("B1", combine), ("B2", router_rise(x)), key=lambda m: m[1])
    grads = (T * h * e_c if e_c != x.e_x else 0) + ((4 * Q * h * h + h * (x.expert_params > 8 * h * h)) * e_c
                                                    if e_c != x.weight_bytes else 0)
    shared = 4 * Q * T * h * e_c + grads + (T * h * x.e_x - mask if mask else 0)
    return max(("B0", shared), ("B1", combine - 8 * Q * T * h * e_c + T * h * x.e_x), ("B2", router_rise(x)),
               key=lambda m: m[1])


def router_rise(x: DispatchShape) -> int:
    """B2, the router's backward at the top-k gather's (scatter_add into zeros [T, N]), the layer's last:
    made by then, the tokens' gradient T·h·e_x (and the shared experts' input's, Q > 0), the weights' T·k·e_r
    and the zeros and scatter's [T, N]·e_r each; every saved tensor freed but the router's own, its logits and
    scores 2·T·N·e_r, top-k choices T·k·8, statistics e_r·(T + 4N + 3), sigmoid's scores' sum T·e_r and the
    input's and weight's casts. Measured equal at E = 1 (it rises above B1 when N ≫ h: N = 64, h = 8) with
    the block's output gradient alone: a step's aux losses add their own [T, N] gradients (not written)."""
    T, N, k, h, e_r = x.tokens, x.experts, x.topk, x.hidden, x.e_r
    saved = sum(nbytes for _, nbytes, kept, _ in terms(x) if kept)
    held = (2 * T * N * e_r + T * k * 8 + e_r * (T + 4 * N + 3) + (T * e_r if x.score == "sigmoid" else 0)
            + (T * h * e_r if x.e_x < e_r else 0) + (N * h * e_r if x.weight_bytes < e_r else 0))
    made = T * h * x.e_x * (1 + bool(x.shared)) + T * k * e_r + 2 * T * N * e_r
    return made - (saved - held)


def attention_above_saved(x, bias: bool = True) -> int:
    """What attention holds beyond what it saves, at its peak (memory.ActivationShape x, this rank's sequence):
    its output projection's [b, s, h] and, with dropout, the dropout's output, s·b·h·e_c each (every tensor either
    path saves is made before them), and autocast's copies of its biases, (3h/T + h)·e_c (a linear does not save
    its bias). The math path with b > 1 also leaves c_attn's output unsaved, 3·s·b·h·e_c/T (it copies q, k, v
    to batch the heads); TP without SP, its all-reduce's fresh output, s·b·h·e_c. Measured equal: one device
    (the fused path; the math path without autocast) and TP without SP. Not written: the math path's upcasts
    under autocast, SP's gathered input and reduce-scatter, CP's ring and Ulysses buffers (the start-up
    prints attention's measurement beside this)."""
    sbh = x.s * x.b * x.h
    biases = (3 * x.h // x.t + x.h) * x.e_c if bias and x.e_c != x.e_r else 0
    c_attn = 3 * sbh * x.e_c // x.t if x.kernel == "math" and x.b > 1 else 0
    reduced = sbh * x.e_c if x.t > 1 and not x.sp else 0
    return sbh * x.e_c * (2 if x.dropout else 1) + biases + c_attn + reduced


def shape_of(traffic: dispatch.Traffic, x, routing: str = "uniform") -> DispatchShape:
    """DispatchShape of one MoE layer and micro-batch from dispatch.Traffic and memory.ActivationShape x
    (dtypes, dropout masks, autocast), for `routing` "uniform" (E = 1: S = R = T·k, at most the capacity's share;
    E > 1: R_e = that, S = R = T·ρ pairs at most, ρ = router.rows_per_token, a float) or "worst" (the whole
    ep group picks this rank's experts: each token's k on the fewest ranks, ⌈k·E/N⌉, this one among them)."""
    config, T, E = traffic.model, traffic.tokens, traffic.ep
    n, k, h = config.moe.experts, config.moe.topk, config.n_embd
    whole = T * traffic.cp * traffic.sp  # B_μ·s: capacity is decided on it
    cap = router.capacity(whole, k, n, config.moe.capacity_factor)
    if routing == "uniform":
        slots = T * k if cap is None else min(T * k, n * cap // (traffic.cp * traffic.sp))
        pairs = min(slots, T * rows_per_token(n, k, config.moe.groups, config.moe.group_limit, E)[0])
        sent, received, expert_rows = (pairs, pairs, slots) if E > 1 else (slots, slots, 0)
    elif E == 1:
        sent = received = T * k if cap is None else min(T * k, n * cap)
        expert_rows = 0
    else:
        here = min(k, n // E)  # of a token's k slots, on this rank
        sent, received = T * -(-k * E // n), E * T
        expert_rows = E * (T * here if cap is None else min(T * here, n // E * cap))
    chunks = traffic.slots or n  # a chunk per expert (or physical slot), all reached; E > 1: N_p/E slots × E sources
    fp8 = ((fp8_experts.expected_padded_rows(chunks), chunks, 8 if x.e_c == 8 else 4)
           if traffic.fp8_experts else None)
    return DispatchShape(T, sent, received, n, k, h, E, whole if cap else 0,
                         e_c=x.e_c, e_r=traffic.router_bytes, e_x=x.e_n, weight_bytes=x.e_r,
                         expert_params=8 * h * h + 5 * h * int(config.bias),
                         dropout_mask=x.mask(x.e_n) if x.dropout else None, score=config.moe.score,
                         shared=config.moe.shared_experts, slots=traffic.slots, expert_rows=expert_rows, fp8=fp8,
                         fp8_blockwise=traffic.fp8_experts == "blockwise", recipe=traffic.recipe_experts)


@dataclass(frozen=True)
class RankPeak:
    """Which block sets a rank's peak: a MoE layer's forward (uniform routing, and the worst case) or attention."""

    uniform: BlockPeak
    worst: BlockPeak
    attention: int  # attention_above_saved

    @property
    def setter(self) -> str:
        return "MoE" if self.uniform.above_saved >= self.attention else "attention"

    @property
    def above_saved(self) -> int:
        """What the step's peak adds to the activations while the block that sets it runs (uniform routing)."""
        return max(self.uniform.above_saved, self.attention)

    def temporary(self) -> str:
        """The name of this figure among a Role's temporaries (time_model.role_of, plan_search): it says which."""
        f = mfu.format_bytes
        u = self.uniform
        at = u.moment if u.phase == "forward" else f"{u.backward[0]} in backward"
        return (f"{PEAK_TEMPORARY}{self.setter} (MoE dispatch/combine"
                f" {f(u.above_saved)} at {at}, uniform routing; worst case"
                f" {f(self.worst.above_saved)}; attention {f(self.attention)})")


PEAK_TEMPORARY = "the block that sets the peak, above what it saves: "  # RankPeak.temporary's name begins so


def peak_setter(temporaries: dict) -> str | None:
    """"MoE" or "attention": the block a Role's temporaries say sets its peak (None without MoE layers)."""
    return next((name[len(PEAK_TEMPORARY):].split(" ")[0] for name in temporaries if name.startswith(PEAK_TEMPORARY)),
                None)


def rank_peak(traffic: dispatch.Traffic, x) -> RankPeak:
    """RankPeak of a rank routing dispatch.Traffic's tokens, with memory.ActivationShape x's dtypes and
    sequence."""
    return RankPeak(block_peak(shape_of(traffic, x)), block_peak(shape_of(traffic, x, "worst")),
                    attention_above_saved(x, traffic.model.bias))


# ---------------------------------------------------------------------------------------------------------
# The start-up's lines (the moe section of report/axes.py prints them)
# ---------------------------------------------------------------------------------------------------------

MEASURED_LINES = 16  # measured lines at most (one per held MoE layer and rank)


def late_free_bytes(shape: DispatchShape) -> int:
    """The most bytes gloo's worker thread may still hold after an all-to-all's wait() returns: one input (the
    dispatch's S or the combine's R rows) or the 8N-byte counts. Such a buffer is freed an op late (seen in about
    one of ten EP runs under load), so a measured peak up to this far above the prediction is the prediction."""
    return max(shape.sent, shape.received) * shape.hidden * shape.e_c + 8 * shape.experts


def measured_verdict(measured, predicted: BlockPeak) -> tuple[str, str]:
    """(sign, note): how a MoE layer's measured forward (memory.ModulePeak) reads against its prediction. "="
    (bytes equal); "≈" (the saved bytes equal, the peak above by at most late_free_bytes: the prediction, and the
    note says by how much); FP8 experts' peak above, "vs" (their emulated GEMMs' temporaries are not predicted: a
    GPU's FP8 GEMM makes none; they are tens of KiB, within that tolerance, but not a late free); else
    "differs from"."""
    above = measured.peak - predicted.peak
    if measured.saved == predicted.saved and above == 0:
        return "=", ""
    if measured.saved == predicted.saved and above > 0 and predicted.shape.fp8:  # whatever else may be late
        return "vs", f"; peak {above:+,} B: the FP8 emulation's own temporaries, not predicted"
    if measured.saved == predicted.saved and 0 < above <= late_free_bytes(predicted.shape):
        return "≈", f"; peak {above:+,} B, within one all-to-all input ({late_free_bytes(predicted.shape):,} B)"
    return "differs from", ""


def rows_text(rows: float) -> str:
    """A count of rows as printed: uniform routing's is a mean (T·ρ, 853.3), a routed one a whole number (1,024)."""
    return f"{rows:,.1f}".removesuffix(".0")
UNWRITTEN = ": not written, e.g. under EP the experts' partial weight gradients between their chunks"


def startup_lines(traffic: dispatch.Traffic, run) -> list:
    """The moe section's start-up lines (report/axes.py): which block sets the peak and what a MoE layer's forward
    holds at it, predicted for uniform routing and the worst case; each held MoE layer's on each rank measured at
    start-up (run.measured_moe: measure.measure_moe_blocks) next to the prediction for the rows it routed, in bytes."""
    if not traffic.moe_layers:
        return []
    x = activations.activation_shape(run)
    peak, f = rank_peak(traffic, x), mfu.format_bytes
    u, w = peak.uniform, peak.worst
    persistent, saved = run.layout.predicted_persistent()["total"], activations.activation_estimate(run).peak
    biggest = sorted(u.buffers.items(), key=lambda kv: -kv[1])[:6]
    lines = [f"  peak per device (accounting/moe_memory.py): a MoE layer's forward holds {f(u.peak)} at {u.moment}"
             f" ({MOMENTS[u.moment]}), {f(u.saved)} of its tensors saved for backward (the activations):"
             f" {f(u.forward_above_saved)} above them, its backward {f(u.backward[1])} ({u.backward[0]}:"
             f" {BACKWARD_MOMENTS[u.backward[0]]}), uniform routing S = R = {rows_text(u.shape.received)}; worst"
             f" case R = {rows_text(w.shape.received)}: {f(w.above_saved)} ({w.phase}); attention's"
             f" {f(peak.attention)}: {peak.setter} sets the peak"
             + (" (attention's math path under autocast upcasts: not written here; see its measurement below)"
                if x.kernel == "math" and x.e_c < 4 else ""),
             f"    step peak ≈ persistent {f(persistent)} + activations at the peak {f(saved)} + the {peak.setter}"
             f" block above what it saves ({u.phase if peak.setter == 'MoE' else 'forward'}) {f(peak.above_saved)}"
             f" = {f(persistent + saved + peak.above_saved)}"
             f" (worst-case routing: {f(persistent + saved + max(w.above_saved, peak.attention))})",
             "    largest at the peak: " + ", ".join(f"{name} {f(nbytes)}" for name, nbytes in biggest)]
    if run.measured_moe is not None:
        lines.append("  measured at start-up (memory.LiveTensors: the tensors ops return, alive together, in bytes;"
                     " each held MoE block's copy on random input) vs predicted for the rows it routed (≈: the"
                     " saved bytes equal and the peak above by at most one all-to-all input, which gloo's thread"
                     " may free an op late):")
        for m in run.measured_moe[:MEASURED_LINES]:
            p, gap = m.predicted, UNWRITTEN
            same, note = measured_verdict(m.measured, p)
            lines.append(f"    h.{m.layer_id} rank {m.rank}: S={m.sent} R={m.received}: peak {m.measured.peak:,}"
                         f" saved {m.measured.saved:,} above {m.measured.above_saved:,} {same} predicted"
                         f" {p.peak:,} {p.saved:,} {p.forward_above_saved:,} ({p.moment}{note}); attention above saved"
                         f" {m.attention.above_saved:,}, predicted {m.attention_predicted:,}; the MoE backward"
                         f" rises {m.backward_rise:,} above its saved, predicted {m.backward_predicted[1]:,}"
                         f" ({m.backward_predicted[0]}{'' if m.backward_rise == m.backward_predicted[1] else gap})")
        if run.measured_moe:
            moe_most = max(m.measured.above_saved for m in run.measured_moe)
            attention_most = max(m.attention.above_saved for m in run.measured_moe)
            lines.append(f"    measured: {'MoE' if moe_most >= attention_most else 'attention'} sets the peak (above"
                         f" saved, the most over layers and ranks: MoE {moe_most:,}, attention {attention_most:,})")
        if len(run.measured_moe) > MEASURED_LINES:
            lines.append(f"    ... {len(run.measured_moe) - MEASURED_LINES} more (layer, rank) pairs")
    return lines
