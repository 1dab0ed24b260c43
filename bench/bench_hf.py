"""model.py against transformers' GPT2LMHeadModel on the same weights: the logits and loss differences, side by side.

    python bench/bench_hf.py                 # GPT-2 124M's shape (12 × 768, 12 heads, 50257 tokens), float64
    python bench/bench_hf.py --small         # 2 × 64, for a quick look
    python bench/bench_hf.py --smoke         # 2 × 64 and 16 tokens: tests/interop/test_hf.py runs it where transformers
    is

A randomly initialised GPT2LMHeadModel (nothing is downloaded) is saved with save_pretrained and read with
`--init-from`'s path (flags.validate, then hf.load_into: Conv1D weights transposed, the vocabulary padded to
50304). The same weights are compared twice: with the exact (erf) GELU this trainer used before the GELU was a
config choice, and with GPT-2's tanh GELU that config.json's `gelu_new` selects now; in float64 and in fp32.
A float64 difference with tanh above 1e-10 prints WRONG. Needs transformers (not a requirement of the trainer:
without it, one line and exit status 2).
"""

import argparse
import os
import sys
import tempfile
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cli import flags  # noqa: E402
from interop import hf  # noqa: E402
from model import GPT  # noqa: E402
from train import AXES  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="--small with 16 tokens: that it runs, in seconds")
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args(argv)
    if args.smoke:
        args.small, args.tokens = True, 16
    try:
        import transformers
    except ImportError:  # not a requirement of the trainer: say so in one line, not with a traceback
        print("error: bench_hf.py compares with transformers' GPT2LMHeadModel and needs transformers: pip install"
              " transformers (not in requirements.txt)", file=sys.stderr)
        sys.exit(2)

    shape = dict(n_layer=2, n_embd=64, n_head=4) if args.small else dict(n_layer=12, n_embd=768, n_head=12)
    torch.manual_seed(0)
    theirs = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=50257, n_positions=1024, **shape))
    x = torch.randint(0, 50257, (2, args.tokens))
    y = torch.randint(0, 50257, (2, args.tokens))
    with tempfile.TemporaryDirectory() as directory:
        theirs.save_pretrained(directory)
        config = flags.validate(flags.build_parser().parse_args(["--init-from", directory, "--tokenizer", "gpt2"]),
                                1, axes=AXES).model
        print(f"GPT-2 n_layer={config.n_layer} n_embd={config.n_embd} n_head={config.n_head}, vocabulary"
              f" {config.real_vocab_size} padded to {config.vocab_size}; {args.tokens} tokens x 2 sequences")
        ours = {}
        for gelu in ("exact", "tanh"):
            model = GPT(replace(config, gelu=gelu), dtype=torch.float64).eval()
            hf.load_into(hf.HFDirectory(directory, config.vocab_size), hf._whole_pieces(model))
            ours[gelu] = model
    print(f"{'dtype':<8} {'GELU':<26} {'max |Δ logits|':>15} {'|Δ loss| (mean CE)':>19}")
    for dtype in (torch.float64, torch.float32):
        reference = theirs.to(dtype).eval()
        with torch.no_grad():
            logits = reference(x).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 50257), y.reshape(-1))
            for gelu, label in (("exact", "exact (before)"), ("tanh", "tanh = gelu_new (after)")):
                our_logits, loss_sum, count = ours[gelu].to(dtype)(x, y)
                dlogits = (our_logits[..., :50257] - logits).abs().max().item()
                dloss = abs(loss_sum.item() / count.item() - loss.item())
                wrong = "  WRONG" if dtype == torch.float64 and gelu == "tanh" and dlogits > 1e-10 else ""
                print(f"{str(dtype).removeprefix('torch.'):<8} {label:<26} {dlogits:>15.2e} {dloss:>19.2e}{wrong}")


if __name__ == "__main__":
    main()
