"""Sample from, and evaluate the val loss of, any checkpoint on one process (nanoGPT's sample.py).

    python sample.py ck                                         # the newest good checkpoint under --ckpt-dir ck
    python sample.py ck/step-00000200 --start "def main(" --num-samples 3 --max-new-tokens 200
    python sample.py gpt2-local --tokenizer gpt2 --data input.txt    # a Hugging Face GPT-2 directory

The checkpoint may come from any mesh (D, T, P, C, E, any ZeRO stage): its weights are read whole through
ckpt's resharding path (hf.load_model: from the fp32 masters where it has them; never the optimizer state),
into one GPT on this process. The val loss is train.py's: the mean over target tokens of the first
--eval-batches global batches of the validation split (data.EvalSampler), with the global batch and sequence
length of the run that saved the checkpoint (its record; flags override), so it equals the val loss that run
printed at the same step, to float rounding. The tokenizer follows the model's vocabulary (GPT-2's BPE from
50257 rows on, else bytes). Any error is one line, exit status 2.

Accounting: one process; it holds the model (Ψ in the checkpoint's dtype) and one micro-batch's activations
and logits; no messages.
"""

from __future__ import annotations

import math
import os
import sys

import torch

from cli import flags, paths
import data
from interop import hf
from cli.flags import FlagError
from resilience.ckpt_files import CheckpointError

TOP_K = 200  # --top-k's default (nanoGPT's), or the whole vocabulary where it is smaller


def build_parser() -> flags.OneLineParser:
    p = flags.OneLineParser(prog="sample.py", description=__doc__.split("\n")[0])
    p.add_argument("checkpoint", help="a step-XXXXXXXX directory, a --ckpt-dir, or a Hugging Face GPT-2 directory")
    p.add_argument("--start", default="\n", help="the prompt, or FILE:path to read it from a UTF-8 text file")
    p.add_argument("--num-samples", type=int, default=1, help="continuations of --start (at least 1)")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens each continuation adds (at least 1)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="divides the logits: > 0 samples (lower: more conservative); 0 is greedy (always the most"
                        " likely token, no draw)")
    p.add_argument("--top-k", type=int, help=f"sample among the K most likely tokens, 1 ≤ K ≤ the vocabulary"
                                             f" (default: {TOP_K}, or the whole vocabulary where it is smaller)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--tokenizer", choices=data.TOKENIZERS, help="default: the one the model's vocabulary implies")
    p.add_argument("--data", help="the text file whose val split is evaluated (default: the built-in corpus)")
    p.add_argument("--out-dir", default="out", help="the token cache goes under OUT/data, as train.py's")
    p.add_argument("--eval-batches", type=int, default=4, help="global batches of the val split (0: no eval)")
    p.add_argument("--global-batch", type=int, help="sequences per val batch (default: the saved run's, else 16)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the saved run's, else block size)")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per forward (memory, not the result)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p


def main(argv=None) -> None:
    try:
        args = build_parser().parse_args(argv)
        prompt = check_flags(args)  # before anything is read or written
        model, record = hf.load_model(args.checkpoint, args.device)
        config = model.config
        vocab = config.real_vocab_size or config.vocab_size
        tokenizer_name = args.tokenizer or flags.tokenizer_of_vocab(vocab)
        flags.check_tokenizer(tokenizer_name, vocab, args.checkpoint)
        check_model_flags(args, config, vocab)
        tokenizer = data.get_tokenizer(tokenizer_name)
        model.eval()
        what = (f"step {record['step']} of {record['path']} (saved on mesh {hf.mesh_text(record['mesh'])})"
                if record else f"{args.checkpoint} (Hugging Face GPT-2)")
        print(f"model: {what}; {model.num_params():,} parameters, n_layer={config.n_layer} n_head={config.n_head}"
              f" n_embd={config.n_embd} vocab={vocab}, GELU {config.gelu}; tokenizer {tokenizer_name}")
        if args.eval_batches:
            print(val_loss_line(model, args, record, tokenizer_name))
        for line in samples(model, tokenizer, prompt, args):
            print(line)
    except (hf.HFError, CheckpointError, ValueError, RuntimeError, OSError) as e:  # FlagError is a ValueError
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        sys.exit(2)


def check_flags(args) -> str:
    """Each flag in its range, the device there, --data readable, --out-dir writable: one FlagError naming the
    flag. Returns the prompt's text (--start, or the file it names), which must be UTF-8."""
    for flag, value in (("--num-samples", args.num_samples), ("--max-new-tokens", args.max_new_tokens),
                        ("--micro-batch", args.micro_batch), ("--global-batch", args.global_batch),
                        ("--seq-len", args.seq_len), ("--top-k", args.top_k)):
        if value is not None and value < 1:
            raise FlagError(f"{flag} must be at least 1, got {value}")
    if args.eval_batches < 0:
        raise FlagError(f"--eval-batches must be at least 0 (0: no eval), got {args.eval_batches}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise FlagError(f"--temperature must be a finite number ≥ 0 (0: greedy), got {args.temperature}")
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        raise FlagError(f"--device {args.device!r} is not a device ({e})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise FlagError(f"--device {args.device}: this machine has no CUDA device; use --device cpu")
    if args.eval_batches:
        if args.data is not None:
            paths.check_text_file("--data", args.data)  # the val split's corpus, as train.py's
        paths.check_writable("--out-dir", args.out_dir, directory=True)  # the token cache goes there
    if not args.start.startswith("FILE:"):
        prompt = args.start
    else:
        try:
            with open(args.start[5:], encoding="utf-8") as f:
                prompt = f.read()
        except (OSError, UnicodeDecodeError) as e:
            why = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
            raise FlagError(f"--start {args.start!r}: the file cannot be read ({why})") from None
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise FlagError(f"--start {args.start!r} is not valid text (it holds a lone surrogate)") from None
    return prompt


def check_model_flags(args, config, vocab: int) -> None:
    """The flags the model bounds: --top-k within its vocabulary, --seq-len within its block size."""
    if args.top_k is not None and args.top_k > vocab:
        raise FlagError(f"--top-k {args.top_k} is more than the model's {vocab} tokens; give 1 to {vocab}")
    if args.seq_len is not None and args.seq_len > config.block_size:
        raise FlagError(f"--seq-len {args.seq_len} is longer than the model's block size {config.block_size}")


@torch.no_grad()
def val_loss_line(model, args, record: dict, tokenizer_name: str) -> str:
    """train.evaluate on one process: Σ loss / Σ target tokens over the first --eval-batches val batches."""
    global_batch = args.global_batch or record.get("global_batch", 16)
    seq_len = args.seq_len or record.get("seq_len", model.config.block_size)
    if global_batch % args.micro_batch:
        raise ValueError(f"--micro-batch {args.micro_batch} must divide the global batch {global_batch}")
    try:
        corpus = data.prepare_corpus(args.data, tokenizer_name, os.path.join(args.out_dir, "data"),
                                     log=lambda line: print(line, flush=True))  # a first tokenization takes a while
    except OSError as e:  # --data was checked: what fails here is writing the cache (os.access trusts root)
        raise FlagError(f"--out-dir {args.out_dir!r}: the token cache cannot be written there ({e.strerror}:"
                        f" {e.filename})") from None
    tokens = data.TokenFile(corpus.val_path)
    sampler = data.EvalSampler(len(tokens), seq_len, global_batch)
    batches = min(args.eval_batches, sampler.num_batches)
    loss_sum, count = torch.zeros((), dtype=torch.float64), 0
    for batch in range(batches):
        for micro in range(global_batch // args.micro_batch):
            x, y = sampler.get_batch(tokens, batch, 0, 1, args.micro_batch, micro)
            _, loss, n = model(x.to(args.device), y.to(args.device))
            loss_sum, count = loss_sum + loss.double().cpu(), count + int(n)
    return (f"val loss {float(loss_sum) / count:.6f} over the first {batches} val batches of {global_batch} ×"
            f" {seq_len} tokens ({args.data or 'the built-in corpus'})")


@torch.no_grad()
def samples(model, tokenizer, prompt: str, args) -> list:
    """--num-samples continuations of the prompt, each --max-new-tokens long, from one seeded generator."""
    vocab = model.config.real_vocab_size or model.config.vocab_size
    idx = torch.tensor([tokenizer.encode(prompt) or [getattr(tokenizer, "eot_token", 0)]], dtype=torch.long,
                       device=args.device)
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    out = []
    for _ in range(args.num_samples):
        tokens = model.generate(idx, args.max_new_tokens, temperature=args.temperature,
                                top_k=args.top_k or min(TOP_K, vocab), generator=generator)
        out += [tokenizer.decode(tokens[0].tolist()), "-" * 80]
    return out


if __name__ == "__main__":
    main()
