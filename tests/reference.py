"""The single-device reference every equivalence test compares against.

`global_batches(...)` makes the deterministic global batches of a test (with some targets set to -1, so rows
and ranks hold different numbers of target tokens), and `reference_run(...)` trains the plain model.py GPT on
them with torch's own AdamW and `clip_grad_norm_`: nothing in it comes from the code under test except the
model and the AdamW parameter grouping. With `muon_lr` the blocks' 2-D weights take torch.optim.Muon instead,
its Newton-Schulz in `ns_dtype` (`muon_newton_schulz`: torch's iteration with bf16 replaced by that dtype).
Both run in the pytest process, on the CPU: a rank body moves the batches to harness.device() (or leaves that
to step.train_step), so the reference is the same under every backend.
"""

from contextlib import contextmanager

import torch
import torch.optim._muon

import moe
from parallel import recompute
from model import GPT, config_from_preset
from optim import adamw_param_groups

HYPER = dict(lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
MUON = dict(lr=0.02, momentum=0.95)  # the tests' Muon (its weight decay is HYPER's)


def make_config(**overrides):
    """The tests' small GPTConfig; `moe_experts=N, moe_topk=k, ...` (the --moe-* flags' names) make its experts
    (GPTConfig.moe, a moe.ExpertsConfig; none when N is 0)."""
    defaults = dict(n_layer=2, n_head=4, n_embd=32)
    experts = {name.removeprefix("moe_"): overrides.pop(name) for name in list(overrides) if name.startswith("moe_")}
    if experts.get("experts"):
        defaults["moe"] = moe.ExpertsConfig(**experts)
    defaults.update(overrides)
    return config_from_preset("tiny", **defaults)


def global_batches(steps: int, global_batch: int, seq_len: int, vocab: int = 256, seed: int = 0,
                   mask_fraction: float = 0.3):
    """[(x, y)] per step, each (global_batch, seq_len); row i has a different share of targets set to -1."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randint(0, vocab, (global_batch, seq_len), generator=generator)
        y = torch.randint(0, vocab, (global_batch, seq_len), generator=generator)
        for row in range(global_batch):
            drop = torch.rand(seq_len, generator=generator) < mask_fraction * row / max(1, global_batch - 1)
            y[row, drop] = -1
        out.append((x, y))
    return out


def rank_micro_batches(x, y, dp_rank: int, dp_size: int, micro: int):
    """This data rank's slice of a global batch, split into micro-batches (DESIGN.md's order)."""
    local = x.shape[0] // dp_size
    xs, ys = x[dp_rank * local:(dp_rank + 1) * local], y[dp_rank * local:(dp_rank + 1) * local]
    return [(xs[i:i + micro], ys[i:i + micro]) for i in range(0, local, micro)]


def add_squared_mean_aux(model, coef: float):
    """A test auxiliary loss on every block's MLP: (mean of its output over the micro-batch)², through the
    model's aux-loss channel. Nonlinear in the micro-batch, so its mean over micro-batches is not its value on
    the whole batch: a step that normalised it otherwise would train differently."""
    for block in model.transformer.h:
        block.mlp.register_forward_hook(lambda mod, args, out: model.aux_losses.add("sq_mean", coef,
                                                                                   out.mean().pow(2)))


def build_model(config, *args, **kwargs) -> GPT:
    """The single-device GPT of `config` with what the config swaps in, as train.compose has it: the experts
    (moe.swap_in) and selective recompute's policy (parallel/recompute.py). model.GPT's arguments."""
    model = GPT(config, *args, **kwargs)
    moe.swap_in(model)
    if config.selective_recompute:
        recompute.apply(model)
    return model


def reference_run(config, batches, seed: int = 0, clip: float = 0.0, dtype=torch.float64, micro_batches: int = 1,
                  aux_coef: float | None = None, fp8_recipe: str | None = None, precision_recipe: str | None = None,
                  muon_lr: float | None = None, ns_dtype=torch.float64, watch=None):
    """Train the single-device model on the global batches; return (losses, grad_norms, final parameters).

    With auxiliary losses (aux_coef: add_squared_mean_aux) the objective is DESIGN.md's: Σ CE / tokens +
    coef · mean over the `micro_batches` (= D·m) micro-batches of aux, the global batch cut in rank order.
    fp8_recipe: the block linears in FP8 (fp8.py, one process), the delayed history rolled once per step.
    precision_recipe: a --precision-recipe SPEC (precision/recipe.py, one process; its step closed per step).
    muon_lr: torch.optim.Muon (momentum MUON["momentum"], Nesterov, its "original" lr adjustment) on the blocks'
    2-D weights, AdamW on the rest; its Newton-Schulz in `ns_dtype` (torch's own at bf16).
    watch(model): called once on the built model; returns what to call after each update (tests/optimizers/
    test_qk_clip.py's hand-computed QK-clip: its hooks record the logits, its callable clips).
    """
    model = build_model(config, seed=seed, dtype=dtype)
    if aux_coef is not None:
        add_squared_mean_aux(model, aux_coef)
    fp8_handle = None
    if fp8_recipe is not None:
        import fp8

        fp8_handle = fp8.convert(model, fp8.Recipe(fp8_recipe, 16, "max", 0))
    if precision_recipe is not None:
        from precision import recipe as recipes

        fp8_handle = recipes.convert(model, recipes.parse_recipe(precision_recipe), seed=seed,
                                     seq_len=batches[0][0].shape[1])
    optimizer, muon = adamw_and_muon(model, muon_lr)
    after_step = watch(model) if watch is not None else None
    losses, norms = [], []
    for x, y in batches:
        model.zero_grad()  # AdamW's and Muon's parameters
        count = (y != -1).sum()
        loss_sum, objective = 0.0, 0.0
        for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
            _, micro_loss_sum, _ = model(xs, ys)
            aux = model.aux_losses.weighted_sum()
            loss_sum = loss_sum + micro_loss_sum
            objective = objective + micro_loss_sum / count + (aux / micro_batches if aux is not None else 0.0)
        objective.backward()
        update_expert_bias(model)
        if fp8_handle is not None:
            fp8_handle.after_grad_sync()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))
        optimizer.step()
        if muon is not None:
            with muon_newton_schulz(ns_dtype):
                muon.step()
        if after_step is not None:
            after_step()
        losses.append(float(loss_sum.detach() / count))
        norms.append(float(norm))
    return losses, norms, {name: p.detach().clone() for name, p in model.named_parameters()}


def adamw_and_muon(model, muon_lr: float | None = None) -> tuple:
    """(torch AdamW, torch.optim.Muon or None): with muon_lr, Muon (momentum MUON["momentum"], Nesterov, torch's
    "original" lr adjustment) on the blocks' 2-D weights and AdamW on the rest; else AdamW on every parameter."""
    matrices = [p for name, p in model.named_parameters() if name.startswith("transformer.h.") and p.dim() == 2]
    rest = [p for p in model.parameters() if all(p is not q for q in matrices)] if muon_lr else model.parameters()
    adamw = torch.optim.AdamW(adamw_param_groups(rest, HYPER["weight_decay"]), lr=HYPER["lr"], betas=HYPER["betas"],
                              eps=HYPER["eps"])
    muon = torch.optim.Muon(matrices, lr=muon_lr, weight_decay=HYPER["weight_decay"], momentum=MUON["momentum"],
                            nesterov=True) if muon_lr else None
    return adamw, muon


@contextmanager
def muon_newton_schulz(dtype):
    """torch.optim.Muon with its Newton-Schulz run in `dtype` (torch's own when bf16): the iteration of
    torch.optim._muon._zeropower_via_newtonschulz, with its cast of the input to bf16 replaced by one to `dtype`."""
    original = torch.optim._muon._zeropower_via_newtonschulz

    def in_dtype(grad, ns_coefficients, ns_steps, eps):
        a, b, c = ns_coefficients
        ortho = grad.to(dtype, copy=True)
        if grad.size(0) > grad.size(1):
            ortho = ortho.T
        ortho.div_(ortho.norm().clamp(min=eps))
        for _ in range(ns_steps):
            gram = ortho @ ortho.T
            ortho = torch.addmm(ortho, torch.addmm(gram, gram, gram, beta=b, alpha=c), ortho, beta=a)
        return ortho.T if grad.size(0) > grad.size(1) else ortho

    if dtype != torch.bfloat16:
        torch.optim._muon._zeropower_via_newtonschulz = in_dtype
    try:
        yield
    finally:
        torch.optim._muon._zeropower_via_newtonschulz = original


@torch.no_grad()
def update_expert_bias(model):
    """DeepSeek-V3's auxiliary-loss-free update, once per step, on each MoE layer whose bias learns (sigmoid scores,
    γ = moe_bias_rate > 0): b_i += γ·sign(mean load − load_i), the load being the slots the step's training
    forwards routed to each expert (the model's count, `layer.load.step`), which then restarts from zero."""
    for block in model.transformer.h:
        load = getattr(block.mlp, "load", None)
        if load is None:
            continue
        if load.bias is not None and model.config.moe.bias_rate > 0:
            counts = load.step.to(torch.float64)
            load.bias += (model.config.moe.bias_rate * torch.sign(counts.mean() - counts)).to(load.bias.dtype)
        load.last = load.step.clone()
        load.step.zero_()


class WholeGrads:
    """The layout protocol's grad_pieces without data parallel (each parameter's whole gradient): what an
    axis's after_grad_sync sums in tests that run no layout."""

    def grad_pieces(self, params):
        return [p.grad for p in params if p.grad is not None]


def seeded_adamw_step(model, optimizer, step: int):
    """One optimizer step on gradients drawn from a generator seeded by `step`: the same for every model of one
    config, whatever its parameters are (the fused-AdamW tests compare optimizers, not models)."""
    generator = torch.Generator().manual_seed(step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator, dtype=p.dtype)
    optimizer.step()


def fused_adamw_tolerance(param: torch.Tensor, lr: float, steps: int) -> torch.Tensor:
    """How far fused and foreach AdamW may drift apart per element after `steps` steps on the same gradients.

    Each step computes the same update (|u| ≲ lr) in another order of roundings: a few ε of the update, plus
    p's own rounding, so |fused − foreach| ≤ steps · 2ε · (lr + |p|), ε of p's dtype (measured in float32 on
    CPU, torch 2.13: ≤ 1.4ε·(lr + |p|) after one step, ≤ 2.5ε·(lr + |p|) after five)."""
    return steps * 2 * torch.finfo(param.dtype).eps * (lr + param.abs())


def train_counting_expert_padding(model, config, multiple: int = 16, after_backward=lambda: None) -> tuple:
    """Three training micro-batches of 2 × 16 tokens (seed 0), then one evaluation forward, on a MoE `model`;
    returns ({layer: Σ over training micro-batches and experts of (−m) mod `multiple`} for the m rows the router
    sent each expert (E = 1: a chunk is a micro-batch's rows of one expert, an empty one pads nothing; the
    evaluation is not counted), the last micro-batch). The hand count the FP8 and recipe experts' observers
    are checked against."""
    import moe

    hand = {block.layer_id: 0 for block in model.transformer.h if config.moe.is_moe_layer(block.layer_id)}
    for block in model.transformer.h:
        def count(router, args, logits, layer_id=block.layer_id):
            _, _, expert = moe.route(logits, config.moe.topk)
            counts = moe.count_per_expert(expert, config.moe.experts).tolist()
            hand[layer_id] += sum(-m % multiple for m in counts if m) if torch.is_grad_enabled() else 0
        if block.layer_id in hand:
            block.mlp.router.register_forward_hook(count)
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        idx = torch.randint(0, 256, (2, 16), generator=generator)
        _, loss, _ = model(idx, idx)
        loss.backward()
        after_backward()
    with torch.no_grad():
        model(idx)  # evaluation pads too, and is not counted
    return hand, idx

