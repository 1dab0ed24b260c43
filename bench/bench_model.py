"""Training throughput of model.py: bf16 autocast against fp32, and against the classic nanoGPT model.

    python bench/bench_model.py [--preset small] [--batch 8] [--steps 6]
    python bench/bench_model.py --device cuda --preset gpt2     # one GPU

One process, the same shape for every variant, one training step = forward + backward + AdamW. Variants
alternate step by step so noise hits all alike. Prints median step times, the bf16/fp32 speed-up (target
≥ 2x at `small`), model.py / nanoGPT ratios per dtype (target ≤ 1.0), and MFU against the bf16 (and fp32)
matmul peak measured on this machine; on a GPU also against its datasheet peaks (mfu.detect_peak_flops).
"""

import argparse
import math
import os
import sys
from contextlib import nullcontext

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from accounting import memory  # noqa: E402
import mfu  # noqa: E402
from common import add_device_argument, alternate  # noqa: E402
from model import GPT, config_from_preset  # noqa: E402


# --- The classic nanoGPT model (github.com/karpathy/nanoGPT, model.py), trimmed to what training uses ---------
class NanoLayerNorm(nn.Module):
    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class NanoCausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0,
                                           is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class NanoMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class NanoBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = NanoLayerNorm(config.n_embd, bias=config.bias)
        self.attn = NanoCausalSelfAttention(config)
        self.ln_2 = NanoLayerNorm(config.n_embd, bias=config.bias)
        self.mlp = NanoMLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([NanoBlock(config) for _ in range(config.n_layer)]),
            ln_f=NanoLayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss
# ---------------------------------------------------------------------------------------------------------------


def make_step(model, x, y, dtype, ours: bool):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    autocast = torch.autocast(x.device.type, dtype=torch.bfloat16) if dtype == "bf16" else nullcontext()
    tokens = y.numel()

    def step():
        with autocast:
            if ours:
                _, loss_sum, _ = model(x, y)
                loss = loss_sum / tokens
            else:
                _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--smoke", action="store_true", help="seconds: the tiny preset, 1 step (the suite runs it)")
    add_device_argument(parser)
    args = parser.parse_args()
    if args.smoke:
        args.preset, args.batch, args.steps = "tiny", 2, 1
    device = torch.device(args.device)
    config = config_from_preset(args.preset)
    torch.manual_seed(0)
    x = torch.randint(0, config.vocab_size, (args.batch, config.block_size)).to(device)
    y = torch.roll(x, -1, 1)
    variants = {}
    for dtype in ("fp32", "bf16"):
        variants[f"model.py {dtype}"] = make_step(GPT(config, seed=0, device=device), x, y, dtype, ours=True)
        variants[f"nanoGPT  {dtype}"] = make_step(NanoGPT(config).to(device), x, y, dtype, ours=False)
    medians = alternate(variants, steps=args.steps, warmup=1)

    tokens = x.numel()
    model = GPT(config, seed=0)
    flops = mfu.flops_per_token(memory.param_counts(config), config, config.block_size)
    n = 8192 if device.type == "cuda" else (256 if args.smoke else 1024)
    seconds = 0.05 if args.smoke else 1.0
    peaks = {"bf16": mfu.measure_matmul_peak(torch.bfloat16, n=n, seconds=seconds, device=device),
             "fp32": mfu.measure_matmul_peak(torch.float32, n=n, seconds=seconds, device=device)}
    table = {dtype: mfu.detect_peak_flops(device, dtype, None) for dtype in peaks} if device.type == "cuda" else {}
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} threads"
    print(f"preset {args.preset}: Ψ={model.num_params():,}, batch {args.batch}×{config.block_size} = {tokens:,} tokens,"
          f" {where}, {args.steps} timed steps each (alternating)")
    print(f"measured matmul peak: bf16 {peaks['bf16'] / 1e12:.3f} TFLOP/s, fp32 {peaks['fp32'] / 1e12:.3f} TFLOP/s")
    for dtype, (peak, source) in table.items():
        print(f"datasheet peak {dtype}: {peak / 1e12:.1f} TFLOP/s ({source})")
    for name, seconds in medians.items():
        dtype = name.split()[-1]
        tokens_per_s = tokens / seconds
        datasheet = (f"  datasheet MFU {mfu.mfu(flops.model, tokens_per_s, table[dtype][0], 1):6.1%}" if table
                     else "")
        print(f"  {name}: {seconds * 1e3:8.1f} ms/step  {tokens_per_s:9,.0f} tok/s  MFU vs {dtype} peak"
              f" {mfu.mfu(flops.model, tokens_per_s, peaks[dtype], 1):6.1%}  (vs bf16 peak"
              f" {mfu.mfu(flops.model, tokens_per_s, peaks['bf16'], 1):6.1%}){datasheet}")
    print(f"bf16 speed-up over fp32, model.py: {medians['model.py fp32'] / medians['model.py bf16']:.2f}x"
          f" (target ≥ 2x); nanoGPT: {medians['nanoGPT  fp32'] / medians['nanoGPT  bf16']:.2f}x")
    for dtype in ("fp32", "bf16"):
        ratio = medians[f"model.py {dtype}"] / medians[f"nanoGPT  {dtype}"]
        print(f"step time model.py / nanoGPT, {dtype}: {ratio:.3f} (target ≤ 1.0)")


if __name__ == "__main__":
    main()
