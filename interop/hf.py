"""Hugging Face GPT-2 ⇄ this trainer: the layout both ways, a directory read on any mesh, a directory written.

A Hugging Face GPT-2 directory is `config.json` plus the weights, `model.safetensors` or `pytorch_model.bin`
(or shards of either, listed by their `.index.json`). Its tensors are model.py's logical tensors, name for
name (model.py kept nanoGPT's names, which are GPT-2's), except for four details:
- the block linears are Conv1Ds (`transformers.pytorch_utils.Conv1D`), whose weight is stored [in, out], where
  model.py's nn.Linear holds [out, in]: the `attn.c_attn`, `attn.c_proj`, `mlp.c_fc` and `mlp.c_proj` weights
  are transposed, both ways;
- the head is tied to the token embedding: `lm_head.weight`, when a file has it, must equal
  `transformer.wte.weight`, and is not written (Hugging Face ties it again on loading);
- the vocabulary has its real rows only (50257); this trainer may pad it (50304, flags.padded_vocab): the
  padding rows come in as zeros and are stripped on the way out, and model.py never predicts them;
- a file saved from `transformers.GPT2Model` (OpenAI's original upload) names tensors without "transformer.",
  and older files carry the attention's causal-mask buffers ("attn.bias", "attn.masked_bias"): not weights.
config.json gives the shape (`GPT2Shape`); the GELU follows `activation_function` (GPT-2's `gelu_new` is the
tanh approximation: model.py's `gelu="tanh"`).

In (`--init-from DIR`): `HFDirectory` checks the directory (every tensor there with GPT-2's shape, nothing
else), and `load_into` fills a layout's `param/` and `master/` pieces through ckpt's own resharding path:
ckpt.StagedLoad (its checks: ckpt_files.plan_load) over a manifest-like description of the directory, in which each
logical tensor is one whole stored piece and the directory is the reader, `files=` (it transposes and pads as
it reads). So any mesh works as a resharding resume does, all or nothing: each rank reads (memory-mapped)
only the tensors it holds a piece of, and keeps its slices. Out (export_hf.py): `write_directory` from the
logical tensors, into a directory that appears whole or not at all.
Whole, on one process (export_hf.py, sample.py): `load_model` reads any checkpoint of this trainer, whatever
mesh saved it (its run record names the model), or a Hugging Face directory, into one GPT.

Accounting for this file (Ψ parameters; b bytes per stored element; V rows of the vocabulary):
1. Nothing is split or replicated here: the pieces it fills are the layout's.
2. In: per rank, one logical tensor assembled at a time (the largest, the embedding: V·h·b) beside the staged
   copy of this rank's pieces (ckpt.StagedLoad); the files are memory-mapped. Out: Ψ on one process, twice.
3. No messages: every rank reads the files itself (train.py agrees on an error with one all-gather).
4. No state of its own.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import save_file

import ckpt
import moe
from model import GPT, GPTConfig
from resilience.ckpt_files import CheckpointError, fsync_path, list_checkpoints, verify_checkpoint
from shard import ShardInfo, StatePiece, describe

# GPT-2's Conv1D weights, stored [in, out] (model.py's nn.Linear: [out, in]).
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
NOT_WEIGHTS = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers of older files
# Hugging Face's activation_function → model.py's gelu (gelu_new, gelu_fast and gelu_pytorch_tanh are the same
# tanh formula, 0.5·x·(1 + tanh(sqrt(2/π)·(x + 0.044715·x³))), computed in different orders).
GELU_OF = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh", "gelu": "exact"}
EXPORTED_GELU = {"tanh": "gelu_new", "exact": "gelu"}
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # in the order they are preferred
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
LAYER_NORM_EPSILON = 1e-5  # nn.LayerNorm's default, which model.py uses: GPT-2's too


class HFError(ValueError):
    """A directory that is not a Hugging Face GPT-2 checkpoint, or is damaged: the message is one line."""


# ---------------------------------------------------------------------------------------------------------
# The layout, both ways: a tensor of model.py ⇄ the tensor of the same name in a Hugging Face file
# ---------------------------------------------------------------------------------------------------------


def to_ours(name: str, stored: torch.Tensor, vocab_rows: int) -> torch.Tensor:
    """model.py's logical tensor `name` from the Hugging Face tensor of that name: Conv1D weights transposed
    (a view), the embedding padded with zero rows up to the model's `vocab_rows`."""
    if name.endswith(CONV1D_WEIGHTS):
        return stored.t()
    if name == "transformer.wte.weight" and stored.shape[0] < vocab_rows:
        return torch.cat([stored, stored.new_zeros(vocab_rows - stored.shape[0], stored.shape[1])])
    return stored


def to_hf(name: str, ours: torch.Tensor, real_vocab_size: int) -> torch.Tensor:
    """The Hugging Face tensor of model.py's logical tensor `name` (the inverse of to_ours): a fresh contiguous
    copy (a view would drag its whole storage, padding rows included, into torch.save)."""
    if name.endswith(CONV1D_WEIGHTS):
        ours = ours.t()
    if name == "transformer.wte.weight":
        ours = ours[:real_vocab_size]
    return ours.clone(memory_format=torch.contiguous_format)


@dataclass(frozen=True)
class GPT2Shape:
    """What a GPT-2 config.json fixes of model.py's GPTConfig (biases always: GPT-2 has them)."""

    n_layer: int
    n_head: int
    n_embd: int
    block_size: int  # n_positions
    vocab_size: int  # the real rows (50257 for GPT-2's BPE)
    gelu: str  # "tanh" | "exact"

    def logical_shapes(self, vocab_rows: int | None = None) -> dict:
        """{model.py name: shape} of every logical tensor (the embedding with `vocab_rows` rows, default real)."""
        h = self.n_embd
        shapes = {"transformer.wte.weight": (vocab_rows or self.vocab_size, h),
                  "transformer.wpe.weight": (self.block_size, h)}
        for i in range(self.n_layer):
            for part, shape in (("ln_1.weight", (h,)), ("ln_1.bias", (h,)), ("attn.c_attn.weight", (3 * h, h)),
                                ("attn.c_attn.bias", (3 * h,)), ("attn.c_proj.weight", (h, h)),
                                ("attn.c_proj.bias", (h,)), ("ln_2.weight", (h,)), ("ln_2.bias", (h,)),
                                ("mlp.c_fc.weight", (4 * h, h)), ("mlp.c_fc.bias", (4 * h,)),
                                ("mlp.c_proj.weight", (h, 4 * h)), ("mlp.c_proj.bias", (h,))):
                shapes[f"transformer.h.{i}.{part}"] = shape
        shapes.update({"transformer.ln_f.weight": (h,), "transformer.ln_f.bias": (h,)})
        return shapes

    def stored_shape(self, name: str) -> tuple:
        """The shape of `name` in a Hugging Face file (Conv1D weights [in, out], the real vocabulary)."""
        shape = self.logical_shapes()[name]
        return shape[::-1] if name.endswith(CONV1D_WEIGHTS) else shape


def shape_from_hf_config(hf: dict) -> GPT2Shape:
    """The model a GPT-2 config.json describes, or HFError naming what this trainer's GPT cannot be."""
    if hf.get("model_type") != "gpt2":
        raise HFError(f"config.json has model_type {hf.get('model_type')!r}, not 'gpt2'")
    sizes = ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size")
    missing = [key for key in sizes if key not in hf]
    if missing:
        raise HFError(f"config.json lacks {', '.join(missing)}")
    not_sizes = [f"{key}={hf[key]!r}" for key in sizes
                 if not (isinstance(hf[key], int) and not isinstance(hf[key], bool) and hf[key] > 0)]
    if not_sizes:
        raise HFError(f"config.json has {', '.join(not_sizes)}: a GPT-2 size is a positive integer")
    if hf["n_embd"] % hf["n_head"]:
        raise HFError(f"config.json has n_embd={hf['n_embd']}, not divisible by n_head={hf['n_head']}: the heads"
                      f" split the embedding")
    activation = hf.get("activation_function", "gelu_new")
    differences = [  # (what this trainer's GPT would compute otherwise, when config.json says so)
        (not isinstance(activation, str) or activation not in GELU_OF,
         f"activation_function {activation!r} (this GPT has {sorted(GELU_OF)})"),
        (hf.get("n_inner") not in (None, 4 * hf["n_embd"]), f"n_inner {hf.get('n_inner')} (the MLP is 4·n_embd wide)"),
        (hf.get("layer_norm_epsilon", LAYER_NORM_EPSILON) != LAYER_NORM_EPSILON,
         f"layer_norm_epsilon {hf.get('layer_norm_epsilon')} (nn.LayerNorm's is {LAYER_NORM_EPSILON})"),
        (not hf.get("scale_attn_weights", True), "scale_attn_weights false (attention scores are scaled by 1/√d)"),
        (hf.get("scale_attn_by_inverse_layer_idx", False), "scale_attn_by_inverse_layer_idx true"),
        (hf.get("add_cross_attention", False), "add_cross_attention true"),
        (not hf.get("tie_word_embeddings", True), "tie_word_embeddings false (the head is tied to the embedding)")]
    for differs, what in differences:
        if differs:
            raise HFError(f"config.json has {what}: this trainer's GPT cannot load it")
    return GPT2Shape(hf["n_layer"], hf["n_head"], hf["n_embd"], hf["n_positions"], hf["vocab_size"],
                     GELU_OF[activation])


def hf_config(config) -> dict:
    """config.json for model.py's GPTConfig `config` (the real vocabulary; GPT-2's BPE gets its token ids)."""
    vocab = config.real_vocab_size or config.vocab_size
    bpe_end = 50256 if vocab >= 50257 else None  # <|endoftext|>: GPT-2's bos and eos
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": vocab,
            "n_positions": config.block_size, "n_ctx": config.block_size, "n_embd": config.n_embd,
            "n_layer": config.n_layer, "n_head": config.n_head, "n_inner": None,
            "activation_function": EXPORTED_GELU[config.gelu], "layer_norm_epsilon": LAYER_NORM_EPSILON,
            # Dropout is a training choice, not the model: GPT-2's own (Hugging Face's training reads it).
            "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1, "initializer_range": 0.02,
            "scale_attn_weights": True, "tie_word_embeddings": True, "use_cache": True,
            "bos_token_id": bpe_end, "eos_token_id": bpe_end, "dtype": "float32"}


# ---------------------------------------------------------------------------------------------------------
# In: a directory, checked, read through ckpt's resharding path
# ---------------------------------------------------------------------------------------------------------


class HFDirectory:
    """A local Hugging Face GPT-2 directory, checked when opened: config.json (`shape`) and its weight file(s),
    memory-mapped, every GPT-2 tensor present with its shape and nothing else. Read as a checkpoint with one
    whole piece per logical tensor (`manifest`), the directory itself the reader (`tensor`): model.py's
    geometry, the embedding padded to `vocab_rows` (the model's; default: the real vocabulary)."""

    def __init__(self, path: str, vocab_rows: int | None = None):
        self.path = path
        if not os.path.isdir(path):
            raise HFError(f"{path} is not a directory")
        self.shape = shape_from_hf_config(_read_json(path, "config.json"))
        self.vocab_rows = vocab_rows or self.shape.vocab_size
        self.open = {}  # file → its tensors (_open)
        self.weight_files = _weight_map(self)
        self.stored = {}  # model.py name → (file, the name in the file)
        for stored_name, file in self.weight_files.items():
            name = stored_name if stored_name.startswith(("transformer.", "lm_head.")) else f"transformer.{stored_name}"
            if not name.endswith(NOT_WEIGHTS):
                self.stored[name] = (file, stored_name)
        self._check_tensors()

    def _check_tensors(self) -> None:
        if self.shape.n_layer > len(self.stored):  # every block has 12 tensors (and a list of 10⁹ would not fit)
            raise HFError(f"{self.path}: config.json has n_layer={self.shape.n_layer}, but its weights hold only"
                          f" {len(self.stored)} tensors (a GPT-2 block has 12)")
        expected = self.shape.logical_shapes()
        unknown = sorted(set(self.stored) - set(expected) - {"lm_head.weight"})
        missing = sorted(set(expected) - set(self.stored))
        if unknown or missing:
            raise HFError(f"{self.path} is not a GPT-2 checkpoint of its config.json's shape: "
                          + "; ".join(f"{what} {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
                                      for what, names in (("it lacks", missing), ("it has unknown", unknown)) if names))
        for name in [*expected, *(["lm_head.weight"] if "lm_head.weight" in self.stored else [])]:
            shape, dtype = self._stored_shape_dtype(name)
            want = self.shape.stored_shape("transformer.wte.weight" if name == "lm_head.weight" else name)
            if tuple(shape) != tuple(want) or dtype not in SAFETENSORS_DTYPES.values():
                raise HFError(f"{self.path}: {self.stored[name][1]} is {dtype} {list(shape)}; GPT-2 of this"
                              f" config.json has a floating {list(want)} there")
        # A stored head must be the embedding (save_pretrained leaves a tied one out): checked now, with the flags,
        # not when the weights are read after the process group exists. Two V·h tensors, memory-mapped.
        if "lm_head.weight" in self.stored and not torch.equal(self._read("lm_head.weight"),
                                                                self._read("transformer.wte.weight")):
            raise HFError(f"{self.path}: lm_head.weight differs from {self.stored['transformer.wte.weight'][1]};"
                          f" this trainer ties the head to the embedding")

    def _stored_shape_dtype(self, name: str) -> tuple:
        file, stored_name = self.stored[name]
        handle = self._open(file)
        if isinstance(handle, dict):
            return tuple(handle[stored_name].shape), handle[stored_name].dtype
        piece = handle.get_slice(stored_name)
        return tuple(piece.get_shape()), SAFETENSORS_DTYPES.get(piece.get_dtype(), piece.get_dtype())

    def _open(self, file: str):
        """The file's tensors: a dict of memory-mapped tensors (.bin) or a safetensors handle (read lazily)."""
        if file not in self.open:
            path = os.path.join(self.path, file)
            try:
                if file.endswith(".safetensors"):
                    self.open[file] = safe_open(path, framework="pt")  # checks the header against the file's size
                else:
                    self.open[file] = _load_bin(path)
            except Exception as e:  # a damaged file makes any reader raise: each means "not readable"
                raise HFError(f"{path} cannot be read ({type(e).__name__}: {_first_line(e)}): damaged, or not"
                              f" a PyTorch/safetensors weight file") from None
            tensors = self.open[file]
            if not hasattr(tensors, "keys") or isinstance(tensors, dict) and not all(
                    torch.is_tensor(t) for t in tensors.values()):
                raise HFError(f"{path} holds a {type(tensors).__name__}, not named tensors: not a weight file")
        return self.open[file]

    def manifest(self) -> dict:
        """The directory as ckpt's manifest describes a checkpoint: every logical tensor `param/<name>`, in
        model.py's geometry, one whole piece whose file is the weight file and whose entry is the name."""
        tensors = {}
        for name, shape in self.shape.logical_shapes(self.vocab_rows).items():
            dtype = self._stored_shape_dtype(name)[1]
            tensors[f"param/{name}"] = dict(global_shape=list(shape), dtype=str(dtype).removeprefix("torch."),
                                            pieces=[dict(file=self.stored[name][0], name=name, splits=[],
                                                         flat_range=None)])
        return {"tensors": tensors}

    def tensor(self, file: str, name: str) -> torch.Tensor:
        """ckpt's reader protocol: the stored piece `name` of `file`, here model.py's logical tensor `name`."""
        stored = self._read(name)
        if not torch.isfinite(stored).all():  # a NaN or inf weight would make every loss NaN from the first step
            raise HFError(f"{self.path}: {file}: {self.stored[name][1]} holds NaN or inf values: the weights are"
                          f" damaged")
        return to_ours(name, stored, self.vocab_rows)

    def _read(self, name: str) -> torch.Tensor:
        """The tensor stored for model.py's `name`, as stored (memory-mapped, or read from the safetensors file)."""
        (file, stored_name), handle = self.stored[name], self._open(self.stored[name][0])
        try:
            return handle[stored_name] if isinstance(handle, dict) else handle.get_tensor(stored_name)
        except Exception as e:  # a truncated or corrupt file can fail only when its data is read
            raise HFError(f"{self.path}: {file}: cannot read {stored_name} ({type(e).__name__}: {_first_line(e)})"
                          f": the file is damaged") from None


def load_into(directory: HFDirectory, pieces: list) -> int:
    """Fill the weights among a layout's state pieces (`param/`, `master/`: any mesh, any ZeRO stage) from the
    directory, all or nothing; the Adam moments and any axis state stay as they start. Returns bytes read."""
    weights = [piece for piece in pieces if piece.key.split("/", 1)[0] in ("param", "master")]
    try:
        return ckpt.StagedLoad(directory.path, directory.manifest(), weights, files=directory).commit()
    except CheckpointError as e:
        raise HFError(str(e)) from None


def _read_json(directory: str, name: str) -> dict:
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        raise HFError(f"{directory} has no {name}: not a Hugging Face model directory")
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, ValueError) as e:
        raise HFError(f"{path} is not valid JSON ({_first_line(e)})") from None
    if not isinstance(value, dict):
        raise HFError(f"{path} is not a JSON object")
    return value


def _weight_map(directory: HFDirectory) -> dict:
    """{name in the files: file} of the directory's weights: model.safetensors (what save_pretrained writes),
    else pytorch_model.bin; either may be sharded (its .index.json lists the shards)."""
    for file in WEIGHT_FILES:
        if os.path.isfile(os.path.join(directory.path, file + ".index.json")):
            weight_map = _read_json(directory.path, file + ".index.json").get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) and os.path.basename(f) == f
                                                           for f in weight_map.values()):
                raise HFError(f"{directory.path}/{file}.index.json has no valid weight_map")
            absent = sorted(f for f in set(weight_map.values()) if not os.path.isfile(os.path.join(directory.path, f)))
            if absent:
                raise HFError(f"{directory.path}/{file}.index.json names {', '.join(absent)}, which is not there")
            return weight_map
        if os.path.isfile(os.path.join(directory.path, file)):
            return {name: file for name in directory._open(file).keys()}
    raise HFError(f"{directory.path} has no weights ({' or '.join(WEIGHT_FILES)})")


def _load_bin(path: str):
    """A pytorch_model.bin's tensors, memory-mapped; weights_only, so a file cannot run code. A file written
    before torch's zip format cannot be mapped: it is read whole."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as e:
        if "mmap can only be used" not in str(e):
            raise
        return torch.load(path, map_location="cpu", weights_only=True)


def _first_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return next((line for line in lines if line.startswith("WeightsUnpickler error")), lines[0] if lines else "")


# ---------------------------------------------------------------------------------------------------------
# Out: model.py's logical tensors → a Hugging Face directory
# ---------------------------------------------------------------------------------------------------------


def write_directory(weights: dict, config, out_dir: str, pytorch_bin: bool = False) -> list:
    """Write `weights` ({model.py name: logical tensor}, every one of a dense GPT of `config`) as a Hugging
    Face GPT-2 directory: config.json and model.safetensors (save_pretrained's format), + pytorch_model.bin with
    `pytorch_bin` (for readers without safetensors). Returns the files written. A model without biases
    (--no-bias) is GPT-2 with zero biases: they are written as zeros. `out_dir` must not exist or be an empty
    directory: the files are written and fsynced in a directory beside it (`.NAME.partial-*`) and renamed to
    `out_dir` last, so a killed export leaves no `out_dir` that --init-from or from_pretrained would read, only
    that partial directory (safe to delete)."""
    if config.moe is not None:
        raise HFError("a mixture-of-experts model is not a GPT-2: its experts have no place in GPT-2's layout")
    shape = GPT2Shape(config.n_layer, config.n_head, config.n_embd, config.block_size,
                      config.real_vocab_size or config.vocab_size, config.gelu)
    state = {}
    for name, logical in shape.logical_shapes(config.vocab_size).items():
        if name in weights:
            state[name] = to_hf(name, weights[name], shape.vocab_size)
        elif name.endswith(".bias") and not config.bias:
            state[name] = torch.zeros(logical, dtype=weights["transformer.wte.weight"].dtype)
        else:
            raise HFError(f"the checkpoint has no {name}")
    out_dir = os.path.abspath(out_dir)
    created = _first_missing(os.path.dirname(out_dir))  # parents made here are removed again on failure
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    partial = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.partial-", dir=os.path.dirname(out_dir))
    names = ["config.json", "model.safetensors", *(["pytorch_model.bin"] if pytorch_bin else [])]
    try:
        with open(os.path.join(partial, names[0]), "w") as f:
            json.dump({**hf_config(config), "dtype": str(state["transformer.wte.weight"].dtype).removeprefix("torch.")},
                      f, indent=2)
            f.write("\n")
        save_file(state, os.path.join(partial, names[1]), metadata={"format": "pt"})
        if pytorch_bin:
            torch.save(state, os.path.join(partial, names[2]))
        for name in names:
            fsync_path(os.path.join(partial, name))  # whole files before the rename commits them
        os.rename(partial, out_dir)  # atomic; replaces an empty directory, refuses a non-empty one (ENOTEMPTY)
        fsync_path(os.path.dirname(out_dir))
    except BaseException:
        shutil.rmtree(created or partial, ignore_errors=True)
        raise
    return [os.path.join(out_dir, name) for name in names]


def _first_missing(path: str) -> str | None:
    """The outermost directory of `path` that does not exist yet (None: it all exists)."""
    missing = None
    while not os.path.exists(path):
        path, missing = os.path.dirname(path), path
    return missing


# ---------------------------------------------------------------------------------------------------------
# Any checkpoint, whole, on one process (export_hf.py, sample.py)
# ---------------------------------------------------------------------------------------------------------


def load_model(path: str, device="cpu") -> tuple[GPT, dict]:
    """(one GPT on this process, the saved run's record) from any checkpoint of this trainer — a step directory
    or a --ckpt-dir (its newest good checkpoint), whatever mesh saved it — or a Hugging Face GPT-2 directory
    (record {}). Its weights come through ckpt's logical-tensor path (`param/`, from the fp32 masters where the
    checkpoint has them), in the dtype they were saved in; the optimizer state is never read."""
    if os.path.isfile(os.path.join(path, "config.json")):
        directory = HFDirectory(path)
        shape = directory.shape
        config = GPTConfig(block_size=shape.block_size, vocab_size=shape.vocab_size, n_layer=shape.n_layer,
                           n_head=shape.n_head, n_embd=shape.n_embd, gelu=shape.gelu)
        model = describe(GPT(config, dtype=directory._stored_shape_dtype("transformer.wte.weight")[1], device=device))
        load_into(directory, _whole_pieces(model))
        return model, {}
    step_dir, manifest = _newest_good_checkpoint(path)
    record = manifest["ranks"][0]["scalars"].get("run", {})
    if not isinstance(record.get("model"), dict):
        raise HFError(f"{step_dir} does not record its model (saved before checkpoints did): n_head and the GELU"
                      f" cannot be read off its tensors")
    fields = {f for f in GPTConfig.__dataclass_fields__}
    saved = record["model"]
    config = GPTConfig(**{k: v for k, v in saved.items() if k in fields and k != "moe"},
                       moe=moe.experts_from_record(saved))
    stored = manifest["tensors"]
    wte = stored.get("master/transformer.wte.weight", stored.get("param/transformer.wte.weight"))
    if wte is None:
        raise HFError(f"{step_dir} has no transformer.wte.weight: not a checkpoint of this trainer's GPT")
    model = describe(GPT(config, dtype=getattr(torch, wte["dtype"]), device=device))
    moe.swap_in(model)  # a MoE checkpoint's experts (none when dense)
    ckpt.load_pieces(step_dir, manifest, _whole_pieces(model) + _router_bias_pieces(model, stored, device))
    return model, dict(record, step=manifest["step"], mesh=manifest["mesh"], path=step_dir)


def mesh_text(mesh: dict) -> str:
    """A checkpoint's mesh record as train.py prints a mesh: "D 2 × P 1 × C 1 × T 2"."""
    axes = (("D", "dp"), ("P", "pp"), ("C", "cp"), ("T", "tp"))
    return " × ".join(f"{axis} {mesh.get(name, 1)}" for axis, name in axes)


def _whole_pieces(model: GPT) -> list:
    """The model's parameters as whole `param/` pieces (one process: nothing split)."""
    return [StatePiece(f"param/{p.shard_info.global_name}", p.data, p.shard_info) for p in model.parameters()]


def _router_bias_pieces(model: GPT, stored: dict, device) -> list:
    """The sigmoid routers' selection biases the checkpoint holds ("moe/" pieces, experts/router.py): sampling
    selects experts with them as training did."""
    pieces = []
    for i, block in enumerate(model.transformer.h):
        load, name = getattr(block.mlp, "load", None), f"transformer.h.{i}.mlp.expert_bias"
        if load is not None and load.bias is not None and f"moe/{name}" in stored:
            bias = load.on(device).bias
            pieces.append(StatePiece(f"moe/{name}", bias, ShardInfo(name, tuple(bias.shape))))
    return pieces


def _newest_good_checkpoint(path: str) -> tuple[str, dict]:
    """(step directory, its verified manifest): `path` itself, or the newest checkpoint under it that verifies
    (marker, manifest checksum, every file's size and SHA-256); an older one is taken when a newer one fails."""
    candidates = [path] if os.path.isfile(os.path.join(path, "manifest.json")) else [
        p for _, p in list_checkpoints(path)]
    if not candidates:
        raise HFError(f"{path} is neither a checkpoint (no manifest.json), a --ckpt-dir holding step-* checkpoints,"
                      f" nor a Hugging Face directory (no config.json)")
    refused = []
    for candidate in candidates:
        try:
            return candidate, verify_checkpoint(candidate)
        except CheckpointError as e:
            refused.append(str(e))
    raise HFError(f"no checkpoint in {path} verifies: {'; '.join(refused)}")
