"""The single-device reference every equivalence test compares against.

`global_batches(...)` makes the deterministic global batches of a test (with some targets set to -1, so rows
and ranks hold different numbers of target tokens), and `reference_run(...)` trains the plain model.py GPT on
them with torch's own AdamW and `clip_grad_norm_`: nothing in it comes from the code under test except the
model and the AdamW parameter grouping.
"""

import torch

from model import GPT, config_from_preset
from optim import adamw_param_groups

HYPER = dict(lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)


def make_config(**overrides):
    defaults = dict(n_layer=2, n_head=4, n_embd=32)
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


def reference_run(config, batches, seed: int = 0, clip: float = 0.0, dtype=torch.float64):
    """Train the single-device model on the global batches; return (losses, grad_norms, final parameters)."""
    model = GPT(config, seed=seed, dtype=dtype)
    optimizer = torch.optim.AdamW(adamw_param_groups(model.parameters(), HYPER["weight_decay"]), lr=HYPER["lr"],
                                  betas=HYPER["betas"], eps=HYPER["eps"])
    losses, norms = [], []
    for x, y in batches:
        optimizer.zero_grad()
        _, loss_sum, count = model(x, y)
        (loss_sum / count).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))
        optimizer.step()
        losses.append(float(loss_sum.detach() / count))
        norms.append(float(norm))
    return losses, norms, {name: p.detach().clone() for name, p in model.named_parameters()}
