"""Export any checkpoint of this trainer to a Hugging Face GPT-2 directory, on one process.

    python export_hf.py ck out/gpt2-hf                  # the newest good checkpoint under --ckpt-dir ck
    python export_hf.py ck/step-00000200 out/gpt2-hf --bin

Whatever mesh saved it (D, T, P, C, any ZeRO stage), the checkpoint's logical tensors are read whole through
ckpt's resharding path (the weights only: from the fp32 masters where it has them, never the Adam moments),
and written in GPT-2's layout (interop/hf.py): Conv1D weights transposed, the padding rows of the vocabulary
stripped, the head left tied. The directory holds config.json and model.safetensors, as save_pretrained
writes it (--bin: also pytorch_model.bin), so that `transformers.GPT2LMHeadModel.from_pretrained(DIR)` loads
it, and so does `train.py --init-from DIR`; the directory is 0755 and its files 0644 under the usual umask (as
save_pretrained's), and config.json's resid_pdrop, embd_pdrop and attn_pdrop are the run's dropout (its
record). A mixture-of-experts model has no GPT-2 layout and is refused; a model without biases is written with
zero biases (the same function).
Nothing is overwritten: OUT_DIR must not exist (or be an empty directory) and must not lie inside the
checkpoint. It appears whole or not at all: the files are written beside it and renamed to OUT_DIR last (a
killed export leaves only a `.OUT_DIR.partial-*` directory). Any error is one line, exit status 2.

Accounting: one process; it holds the model (Ψ in the checkpoint's dtype) and one copy of it being written;
no messages; it changes nothing in the checkpoint.
"""

from __future__ import annotations

import os
import sys

from interop import hf
from cli.flags import FlagError, OneLineParser
from cli.paths import check_writable
from resilience.ckpt_files import CheckpointError


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog="export_hf.py", description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="a step-XXXXXXXX directory, or a --ckpt-dir (its newest good checkpoint)")
    parser.add_argument("out_dir", help="the Hugging Face directory to write: new, or an empty directory")
    parser.add_argument("--bin", action="store_true", help="also write pytorch_model.bin (readers without safetensors)")
    return parser


def main(argv=None) -> None:
    try:
        args = build_parser().parse_args(argv)
        check_destination(args.out_dir, args.checkpoint)
        model, record = hf.load_model(args.checkpoint)
        weights = {p.shard_info.global_name: p.detach() for p in model.parameters()}
        dropout = record.get("dropout")  # the run's (train.py records it); None: a checkpoint from before it did
        written = hf.write_directory(weights, model.config, args.out_dir, pytorch_bin=args.bin, dropout=dropout)
    except (ValueError, hf.HFError, CheckpointError, OSError) as e:  # FlagError and paths' checks: ValueErrors
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        sys.exit(2)
    config = model.config
    source = (f"step {record['step']} of {record['path']} (saved on mesh {hf.mesh_text(record['mesh'])})"
              if record else args.checkpoint)
    stripped = (f"; the {config.vocab_size - config.real_vocab_size} padding rows of the vocabulary stripped"
                f" ({config.vocab_size} → {config.real_vocab_size})" if config.real_vocab_size else "")
    trained = (f"dropout {dropout:g} as trained" if dropout is not None else f"dropout {config.dropout:g} (the"
               f" trainer's default: {'the checkpoint does not record it' if record else 'not read from config.json'})")
    print(f"exported {source} → {args.out_dir}: {', '.join(w.rsplit('/', 1)[-1] for w in written)}"
          f" (GPT-2 n_layer={config.n_layer} n_head={config.n_head} n_embd={config.n_embd}, GELU {config.gelu}"
          f" = {hf.EXPORTED_GELU[config.gelu]}, {trained}{stripped})")


def check_destination(out_dir: str, checkpoint: str) -> None:
    """OUT_DIR can be written without overwriting anything: the directory it goes in can be written
    (paths.check_writable), it is not the checkpoint or inside it, it does not exist or is an empty directory."""
    check_writable("out_dir", out_dir, directory=True)  # a name; not a file, nor under one; its parent writable
    out, source = os.path.realpath(out_dir), os.path.realpath(checkpoint)
    if out == source or out.startswith(source + os.sep):
        raise FlagError(f"out_dir {out_dir!r} lies inside the checkpoint {checkpoint!r}: an export never writes"
                        f" into what it reads; give a directory outside it")
    if os.path.isdir(out) and os.listdir(out):
        raise FlagError(f"out_dir {out_dir!r} exists and is not empty: nothing is overwritten; give a new directory")


if __name__ == "__main__":
    main()
