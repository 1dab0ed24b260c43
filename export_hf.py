"""Export any checkpoint of this trainer to a Hugging Face GPT-2 directory, on one process.

    python export_hf.py ck out/gpt2-hf                  # the newest good checkpoint under --ckpt-dir ck
    python export_hf.py ck/step-00000200 out/gpt2-hf --safetensors

Whatever mesh saved it (D, T, P, C, any ZeRO stage), the checkpoint's logical tensors are read whole through
ckpt's resharding path (the weights only: from the fp32 masters where it has them, never the Adam moments),
and written in GPT-2's layout (hf.py): Conv1D weights transposed, the padding rows of the vocabulary
stripped, the head left tied. The directory holds config.json and pytorch_model.bin (+ model.safetensors),
so that `transformers.GPT2LMHeadModel.from_pretrained(DIR)` loads it, and so does `train.py --init-from DIR`.
A mixture-of-experts model has no GPT-2 layout and is refused; a model without biases is written with zero
biases (the same function). Any error is one line, exit status 2.

Accounting: one process; it holds the model (Ψ in the checkpoint's dtype) and one copy of it being written;
no messages; it changes nothing in the checkpoint.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

import hf
from ckpt_files import CheckpointError


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="export_hf.py", description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="a step-XXXXXXXX directory, or a --ckpt-dir (its newest good checkpoint)")
    parser.add_argument("out_dir", help="the Hugging Face directory to write (created if missing)")
    parser.add_argument("--safetensors", action="store_true", help="also write model.safetensors (needs safetensors)")
    args = parser.parse_args(argv)
    try:
        if args.safetensors and importlib.util.find_spec("safetensors") is None:
            raise hf.HFError("--safetensors needs the safetensors package (pip install safetensors)")
        model, record = hf.load_model(args.checkpoint)
        weights = {p.shard_info.global_name: p.detach() for p in model.parameters()}
        written = hf.write_directory(weights, model.config, args.out_dir, safetensors=args.safetensors)
    except (hf.HFError, CheckpointError, OSError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        sys.exit(2)
    config = model.config
    source = (f"step {record['step']} of {record['path']} (saved on mesh {hf.mesh_text(record['mesh'])})"
              if record else args.checkpoint)
    stripped = (f"; the {config.vocab_size - config.real_vocab_size} padding rows of the vocabulary stripped"
                f" ({config.vocab_size} → {config.real_vocab_size})" if config.real_vocab_size else "")
    print(f"exported {source} → {args.out_dir}: {', '.join(w.rsplit('/', 1)[-1] for w in written)}"
          f" (GPT-2 n_layer={config.n_layer} n_head={config.n_head} n_embd={config.n_embd}, GELU {config.gelu}"
          f" = {hf.EXPORTED_GELU[config.gelu]}{stripped})")


if __name__ == "__main__":
    main()
