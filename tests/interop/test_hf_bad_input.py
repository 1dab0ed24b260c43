"""Bad input to `--init-from` (interop/hf.py through cli/flags.py), export_hf.py and sample.py, as a careless user gives
it.

Every case must end in one line naming the flag or file and what was expected (its fragment is in the table),
exit status 2, no traceback, and nothing written or changed (the case's directory and the sources are hashed
before and after). The cases run in this process, calling what the command line calls (`flags.parse`,
`export_hf.main`, `sample.main`): ~110 cases in a few seconds after the sources (two 1-rank checkpoints, from
the harness's warm fork server). One case starts a process: an export killed (SIGKILL) while it writes.
"""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness import run_ranks
from model import GPTConfig
from reference import build_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = dict(block_size=64, n_layer=2, n_head=4, n_embd=32, gelu="tanh", vocab_size=256)


# ---------------------------------------------------------------------------------------------------------
# Sources: Hugging Face directories (model.safetensors, pytorch_model.bin) and checkpoints (dense, MoE)
# ---------------------------------------------------------------------------------------------------------


def _write_hf(directory, vocab=256, bin_only=False):
    from interop import hf

    config = GPTConfig(**{**BASE, "vocab_size": vocab})
    weights = {p.shard_info.global_name: p.detach() for p in build_model(config, seed=1).parameters()}
    hf.write_directory(weights, config, str(directory), pytorch_bin=bin_only)
    if bin_only:
        os.remove(directory / "model.safetensors")
    return directory


def _save_checkpoint(rank, world, root, moe_experts):
    """A 1-rank run of the tiny preset (dense, or with experts) saved at step 1, recording its model."""
    import ckpt
    from cli import flags
    import train
    from data import BatchSampler
    from mesh import build_mesh
    from optim import DynamicLossScaler

    argv = ["--preset", "tiny", "--global-batch", "2", "--seq-len", "16", "--moe-experts", str(moe_experts)]
    settings = flags.validate(flags.build_parser().parse_args(argv), world, axes=train.AXES)
    run = train.compose(train.Run(settings=settings, mesh=build_mesh(settings.shape, rank), config=settings.model,
                                  device=torch.device("cpu"), seed=0))
    record = dict(model=run.config.architecture(), global_batch=2, seq_len=16)
    saver = ckpt.Checkpointer(ckpt.CheckpointConfig(root, run_record=record), run.mesh, run.axes, log=lambda *a: None)
    saver.save(1, run.layout, DynamicLossScaler(enabled=False), BatchSampler(10_000, 16, 2, 0))
    saver.close()


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    run_ranks(_save_checkpoint, 1, str(root / "ck-dense"), 0)
    run_ranks(_save_checkpoint, 1, str(root / "ck-moe"), 4)
    _write_hf(root / "hf-st")
    _write_hf(root / "hf-bin", bin_only=True)
    _write_hf(root / "hf-vocab1000", vocab=1000)
    (root / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 400)
    return root


def _hashes(*roots) -> dict:
    found = {}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            found.update({os.path.join(dirpath, d): "dir" for d in dirnames})
            for name in filenames:
                with open(os.path.join(dirpath, name), "rb") as f:
                    found[os.path.join(dirpath, name)] = hashlib.sha256(f.read()).hexdigest()
    return found


# ---------------------------------------------------------------------------------------------------------
# Damage to a Hugging Face directory
# ---------------------------------------------------------------------------------------------------------


def _weights(d):
    return d / ("model.safetensors" if (d / "model.safetensors").exists() else "pytorch_model.bin")


def _config(**changes):
    def damage(d):
        config = json.loads((d / "config.json").read_text())
        config.update(changes)
        (d / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v != "DROP"}))
    return damage


def _state(edit):
    def damage(d):
        path = _weights(d)
        state = dict(load_file(path)) if path.suffix == ".safetensors" else torch.load(path, weights_only=True)
        edit(state)
        save_file(state, path) if path.suffix == ".safetensors" else torch.save(state, path)
    return damage


def _index(weight_map):
    return lambda d: (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _sharded_without_its_second_shard(d):
    """model.safetensors as the first of two shards, its .index.json naming a second one (for ln_f) not there."""
    names = list(load_file(d / "model.safetensors"))
    os.rename(d / "model.safetensors", d / "model-00001-of-00002.safetensors")
    _index({name: f"model-0000{1 + name.startswith('transformer.ln_f')}-of-00002.safetensors" for name in names})(d)


def _truncate(d, keep=0.5):
    os.truncate(_weights(d), int(_weights(d).stat().st_size * keep))


def _replace_with_dir(path):
    os.remove(path)
    os.mkdir(path)


BOTH_FORMATS = [  # (what, damage, the fragment the error names): in model.safetensors and in pytorch_model.bin
    ("truncated to half", _truncate, "{file}"),
    ("truncated by 8 bytes", lambda d: _truncate(d, 1 - 8 / _weights(d).stat().st_size), "{file}"),
    ("random bytes", lambda d: _weights(d).write_bytes(os.urandom(4096)), "{file}"),
    ("empty file", lambda d: _weights(d).write_bytes(b""), "{file}"),
    ("weights a directory", lambda d: _replace_with_dir(_weights(d)), "has no weights"),
    ("no weights", lambda d: os.remove(_weights(d)), "has no weights"),
    ("missing tensor", _state(lambda s: s.pop("transformer.ln_f.bias")), "it lacks transformer.ln_f.bias"),
    ("extra tensor", _state(lambda s: s.update({"transformer.h.2.ln_1.weight": torch.ones(32)})),
     "it has unknown transformer.h.2.ln_1.weight"),
    ("integer tensor", _state(lambda s: s.update({"transformer.wpe.weight": torch.zeros(64, 32, dtype=torch.int64)})),
     "transformer.wpe.weight is"),
    ("bool tensor", _state(lambda s: s.update({"transformer.h.0.ln_1.bias": torch.zeros(32, dtype=torch.bool)})),
     "transformer.h.0.ln_1.bias is"),
    ("tensor of another shape", _state(lambda s: s.update({"transformer.h.1.mlp.c_fc.bias": torch.zeros(7)})),
     "transformer.h.1.mlp.c_fc.bias is torch.float32 [7]"),
    ("untied head", _state(lambda s: s.update({"lm_head.weight": s["transformer.wte.weight"] + 1})),
     "lm_head.weight differs from transformer.wte.weight"),
    ("Conv1D weight stored [out, in]", _state(lambda s: s.update(
        {"transformer.h.0.mlp.c_fc.weight": s["transformer.h.0.mlp.c_fc.weight"].t().contiguous()})),
     "transformer.h.0.mlp.c_fc.weight is torch.float32 [128, 32]"),
]
ONE_FORMAT = [  # (what, damage, fragment, extra flags)
    ("config.json missing", lambda d: os.remove(d / "config.json"), "has no config.json", []),
    ("config.json not JSON", lambda d: (d / "config.json").write_text("{"), "config.json is not valid JSON", []),
    ("config.json a list", lambda d: (d / "config.json").write_text("[1]"), "config.json is not a JSON object", []),
    ("config.json a directory", lambda d: _replace_with_dir(d / "config.json"), "has no config.json", []),
    ("no n_layer", _config(n_layer="DROP"), "config.json lacks n_layer", []),
    ("n_layer a string", _config(n_layer="2"), "n_layer='2'", []),
    ("n_layer 0", _config(n_layer=0), "n_layer=0", []),
    ("n_layer 2.0", _config(n_layer=2.0), "n_layer=2.0", []),
    ("n_layer 10**9", _config(n_layer=10 ** 9), "n_layer=1000000000", []),  # no list of 1.2e10 names first
    ("n_embd null", _config(n_embd=None), "n_embd=None", []),
    ("n_head 5", _config(n_head=5), "not divisible by n_head=5", []),
    ("vocab_size 0", _config(vocab_size=0), "vocab_size=0", []),
    ("activation_function a list", _config(activation_function=["gelu"]), "activation_function ['gelu']", []),
    ("activation_function relu", _config(activation_function="relu"), "activation_function 'relu'", []),
    ("n_inner 100", _config(n_inner=100), "n_inner 100", []),
    ("model_type llama", _config(model_type="llama"), "model_type 'llama', not 'gpt2'", []),
    ("model_type missing", _config(model_type="DROP"), "model_type None", []),
    ("model_type a list", _config(model_type=["gpt2"]), "model_type ['gpt2']", []),
    ("n_positions 8 (wpe 64)", _config(n_positions=8), "transformer.wpe.weight is torch.float32 [64, 32]", []),
    ("vocab_size 300 (wte 256)", _config(vocab_size=300), "transformer.wte.weight is torch.float32 [256, 32]", []),
    ("n_layer 3 (2 stored)", _config(n_layer=3), "it lacks transformer.h.2", []),
    ("n_layer 1 (2 stored)", _config(n_layer=1), "it has unknown transformer.h.1", []),
    ("index names a missing shard", _sharded_without_its_second_shard,
     "names model-00002-of-00002.safetensors, which is not there", []),
    ("index weight_map a list", _index([1, 2]), "index.json has no valid weight_map", []),
    ("index points outside", _index({"transformer.wte.weight": "../x"}), "index.json has no valid weight_map", []),
    ("a GPT-2 vocabulary without --tokenizer gpt2", lambda d: (_config(vocab_size=50257)(d), _state(
        lambda s: s.update({"transformer.wte.weight": torch.zeros(50257, 32)}))(d)), "add --tokenizer gpt2", []),
    ("--n-layer 3", None, "--n-layer 3 contradicts --init-from", ["--n-layer", "3"]),
    ("--n-head 8", None, "--n-head 8 contradicts --init-from", ["--n-head", "8"]),
    ("--n-embd 64", None, "--n-embd 64 contradicts --init-from", ["--n-embd", "64"]),
    ("--gelu exact", None, "--gelu exact contradicts --init-from", ["--gelu", "exact"]),
    ("--preset gpt2", None, "--preset gpt2 contradicts --init-from", ["--preset", "gpt2"]),
    ("--no-bias", None, "--no-bias contradicts --init-from", ["--no-bias"]),
    ("--moe-experts 4", None, "--moe-experts with --init-from", ["--moe-experts", "4"]),
    ("--tokenizer gpt2", None, "--tokenizer gpt2 has 50257 tokens, but --init-from", ["--tokenizer", "gpt2"]),
    ("--seq-len 128 (n_positions 64)", None, "--seq-len 128 must be between 1 and the model's block size 64",
     ["--seq-len", "128"]),
]
INIT_FROM = ([(f"{fmt} {what}", fmt, damage, expect.format(file=file), []) for fmt, file in
              (("st", "model.safetensors"), ("bin", "pytorch_model.bin")) for what, damage, expect in BOTH_FORMATS]
             + [(what, "st", damage, expect, flags) for what, damage, expect, flags in ONE_FORMAT])


def _expect_one_line(call, capsys, fragment, *roots):
    """call() ends with exit status 2 and one line on stderr holding `fragment`; nothing under roots changes."""
    before = _hashes(*roots)
    with pytest.raises(SystemExit) as stop:
        call()
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and err.startswith("error: ") and fragment in err, err
    assert _hashes(*roots) == before, "something was written"


@pytest.mark.parametrize("what,fmt,damage,fragment,flags", INIT_FROM, ids=[case[0] for case in INIT_FROM])
def test_a_bad_init_from_ends_in_one_line_before_any_process_group(what, fmt, damage, fragment, flags, sources,
                                                                   tmp_path, monkeypatch, capsys):
    from cli import flags as flags_lib
    import train

    directory = shutil.copytree(sources / ("hf-st" if fmt == "st" else "hf-bin"), tmp_path / "hf")
    if damage:
        damage(directory)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    argv = ["--init-from", str(directory), "--out-dir", str(tmp_path / "out"), *flags]
    _expect_one_line(lambda: flags_lib.parse(argv, train.AXES), capsys, fragment, tmp_path, sources)


@pytest.mark.parametrize("path,fragment", [("missing", "missing is not a directory"), ("file", "is not a directory"),
                                           ("empty", "has no config.json"), ("", "--init-from '' names nothing"),
                                           ("ck-dense", "ck-dense has no config.json")])
def test_an_init_from_that_is_no_directory_ends_in_one_line(path, fragment, sources, tmp_path, monkeypatch, capsys):
    from cli import flags
    import train

    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    target = str(sources / path) if path == "ck-dense" else str(tmp_path / path) if path else ""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    argv = ["--init-from", target, "--out-dir", str(tmp_path / "out")]
    _expect_one_line(lambda: flags.parse(argv, train.AXES), capsys, fragment, tmp_path, sources)


@pytest.mark.parametrize("fmt", ["hf-st", "hf-bin"])
def test_a_nan_weight_is_refused_when_read(fmt, sources, tmp_path):
    """What only all the values show is found as train.init_from reads them (every rank agreeing: one line, exit
    status 2, after the process group exists: reading every weight twice is not a flag check)."""
    from interop import hf

    directory = shutil.copytree(sources / fmt, tmp_path / "hf")
    _state(lambda s: s["transformer.h.1.mlp.c_proj.weight"].__setitem__((0, 0), float("nan")))(directory)
    opened = hf.HFDirectory(str(directory))  # the flags' check passes
    with pytest.raises(hf.HFError, match="transformer.h.1.mlp.c_proj.weight holds NaN or inf values"):
        hf.load_into(opened, hf._whole_pieces(build_model(GPTConfig(**BASE))))


# ---------------------------------------------------------------------------------------------------------
# export_hf.py
# ---------------------------------------------------------------------------------------------------------


def _step_dir(ck):
    return next(ck.glob("step-*"))


def _truncate_shard(ck):
    shard = next(_step_dir(ck).glob("shard-*.pt"))
    shard.write_bytes(shard.read_bytes()[:-100])


EXPORT = [  # (what, source, destination: each (tmp, a copy of the dense checkpoint, sources) → a path; fragment)
    ("source missing", lambda t, ck, s: t / "missing", lambda t, ck, s: t / "hf", "neither a checkpoint"),
    ("source a file", lambda t, ck, s: _file(t / "f"), lambda t, ck, s: t / "hf", "neither a checkpoint"),
    ("source an empty dir", lambda t, ck, s: _empty(t / "e"), lambda t, ck, s: t / "hf", "neither a checkpoint"),
    ("source shard truncated", lambda t, ck, s: _truncate_shard(ck) or ck, lambda t, ck, s: t / "hf",
     "shard-00000.pt"),
    ("source manifest garbage", lambda t, ck, s: (_step_dir(ck) / "manifest.json").write_text("{") and ck,
     lambda t, ck, s: t / "hf", "manifest.json"),
    ("source an MoE checkpoint", lambda t, ck, s: s / "ck-moe", lambda t, ck, s: t / "hf", "mixture-of-experts"),
    ("source a damaged HF dir", lambda t, ck, s: _config(n_layer="2")(shutil.copytree(s / "hf-st", t / "src")) or (
        t / "src"), lambda t, ck, s: t / "hf", "n_layer='2'"),
    ("destination a file", lambda t, ck, s: ck, lambda t, ck, s: _file(t / "dest"), "is a file, not a directory"),
    ("destination not empty", lambda t, ck, s: ck, lambda t, ck, s: _file(_empty(t / "dest") / "keep.txt").parent,
     "exists and is not empty"),
    ("destination an earlier export", lambda t, ck, s: ck, lambda t, ck, s: shutil.copytree(s / "hf-st", t / "dest"),
     "exists and is not empty"),
    ("destination inside the --ckpt-dir", lambda t, ck, s: ck, lambda t, ck, s: ck / "hf",
     "lies inside the checkpoint"),
    ("destination inside the step", lambda t, ck, s: _step_dir(ck), lambda t, ck, s: _step_dir(ck) / "hf",
     "lies inside the checkpoint"),
    ("destination the source", lambda t, ck, s: ck, lambda t, ck, s: ck, "lies inside the checkpoint"),
    ("destination under a file", lambda t, ck, s: ck, lambda t, ck, s: _file(t / "f") / "hf", "which is a file"),
    ("destination ''", lambda t, ck, s: ck, lambda t, ck, s: "", "out_dir '' names nothing"),
    ("an unknown flag", lambda t, ck, s: ck, lambda t, ck, s: "--bogus", "the following arguments are required"),
]


def _file(path):
    path.write_text("keep")
    return path


def _empty(path):
    path.mkdir()
    return path


@pytest.mark.parametrize("what,source,destination,fragment", EXPORT, ids=[case[0] for case in EXPORT])
def test_a_bad_export_ends_in_one_line_and_writes_nothing(what, source, destination, fragment, sources, tmp_path,
                                                          capsys):
    import export_hf

    ck = shutil.copytree(sources / "ck-dense", tmp_path / "ck")
    argv = [str(source(tmp_path, ck, sources)), str(destination(tmp_path, ck, sources))]
    _expect_one_line(lambda: export_hf.main(argv), capsys, fragment, tmp_path, sources)


def test_an_export_killed_while_writing_leaves_no_directory_to_import(sources, tmp_path, monkeypatch, capsys):
    """SIGKILL as the weights are being written (a real kill, in a process of its own): OUT_DIR does not exist,
    so neither --init-from nor from_pretrained can take half an export; an empty OUT_DIR is filled whole."""
    from cli import flags
    import train

    killed = f"""
import os, signal, sys
sys.path.insert(0, {ROOT!r})
from interop import hf
def save_file(state, path, metadata=None):
    with open(path, "wb") as f:
        f.write(b"half of the weights")
    os.kill(os.getpid(), signal.SIGKILL)
hf.save_file = save_file
import export_hf
export_hf.main([{str(sources / "ck-dense")!r}, {str(tmp_path / "hf")!r}])
"""
    run = subprocess.run([sys.executable, "-c", killed], capture_output=True, text=True, timeout=120)
    assert run.returncode == -signal.SIGKILL, run.stderr
    assert not (tmp_path / "hf").exists() and [p.name[:12] for p in tmp_path.iterdir()] == [".hf.partial-"]
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    _expect_one_line(lambda: flags.parse(["--init-from", str(tmp_path / "hf"), "--out-dir", str(tmp_path / "out")],
                                         train.AXES), capsys, "is not a directory", tmp_path)
    import export_hf

    export_hf.main([str(sources / "ck-dense"), str(_empty(tmp_path / "empty"))])
    assert sorted(p.name for p in (tmp_path / "empty").iterdir()) == ["config.json", "model.safetensors"]
    assert "→" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------------
# sample.py
# ---------------------------------------------------------------------------------------------------------

SAMPLE = [  # (what, checkpoint (a name in sources, or tmp → path), flags (tmp → list), fragment)
    ("checkpoint missing", lambda t: t / "missing", [], "neither a checkpoint"),
    ("checkpoint a file", lambda t: _file(t / "f"), [], "neither a checkpoint"),
    ("checkpoint an empty dir", lambda t: _empty(t / "e"), [], "neither a checkpoint"),
    ("an HF dir whose config.json is broken", "hf-broken", [], "config.json is not valid JSON"),
    ("--start FILE: missing", "ck-dense", lambda t: ["--start", f"FILE:{t / 'missing.txt'}"], "--start 'FILE:"),
    ("--start FILE: a directory", "ck-dense", lambda t: ["--start", f"FILE:{t}"], "--start 'FILE:"),
    ("--start FILE: not UTF-8", "ck-dense", lambda t: (t / "b").write_bytes(b"\xff\xfe") and [
        "--start", f"FILE:{t / 'b'}"], "not UTF-8 text"),
    ("--start a lone surrogate", "ck-dense", ["--start", "\udcff"], "--start '\\udcff' is not valid text"),
    ("--num-samples 0", "ck-dense", ["--num-samples", "0"], "--num-samples must be at least 1, got 0"),
    ("--num-samples -1", "ck-dense", ["--num-samples", "-1"], "--num-samples must be at least 1, got -1"),
    ("--num-samples x", "ck-dense", ["--num-samples", "x"], "--num-samples: invalid int value: 'x'"),
    ("--max-new-tokens 0", "ck-dense", ["--max-new-tokens", "0"], "--max-new-tokens must be at least 1, got 0"),
    ("--max-new-tokens -3", "ck-dense", ["--max-new-tokens", "-3"], "--max-new-tokens must be at least 1, got -3"),
    ("--temperature -1", "ck-dense", ["--temperature", "-1"], "--temperature must be a finite number ≥ 0"),
    ("--temperature nan", "ck-dense", ["--temperature", "nan"], "--temperature must be a finite number ≥ 0"),
    ("--temperature inf", "ck-dense", ["--temperature", "inf"], "--temperature must be a finite number ≥ 0"),
    ("--top-k 0", "ck-dense", ["--top-k", "0"], "--top-k must be at least 1, got 0"),
    ("--top-k -1", "ck-dense", ["--top-k", "-1"], "--top-k must be at least 1, got -1"),
    ("--top-k 100000", "ck-dense", ["--top-k", "100000"], "--top-k 100000 is more than the model's 256 tokens"),
    ("--eval-batches -1", "ck-dense", ["--eval-batches", "-1"], "--eval-batches must be at least 0"),
    ("--global-batch 0", "ck-dense", ["--global-batch", "0"], "--global-batch must be at least 1, got 0"),
    ("--micro-batch 0", "ck-dense", ["--micro-batch", "0"], "--micro-batch must be at least 1, got 0"),
    ("--micro-batch 3 of 2", "ck-dense", ["--micro-batch", "3", "--global-batch", "2"], "--micro-batch 3 must divide"),
    ("--seq-len 0", "ck-dense", ["--seq-len", "0"], "--seq-len must be at least 1, got 0"),
    ("--seq-len 10000", "ck-dense", ["--seq-len", "10000"], "--seq-len 10000 is longer than the model's block size 64"),
    ("--device bogus", "ck-dense", ["--device", "bogus"], "--device 'bogus' is not a device"),
    ("--data missing", "ck-dense", lambda t: ["--data", str(t / "missing.txt")], "--data"),
    ("--out-dir in /proc", "ck-dense", ["--out-dir", "/proc/sample-out"], "--out-dir '/proc/sample-out'"),
    ("--out-dir under a file", "ck-dense", lambda t: ["--out-dir", str(_file(t / "f") / "out")], "--out-dir"),
    ("--tokenizer gpt2, a byte checkpoint", "ck-dense", ["--tokenizer", "gpt2"], "--tokenizer gpt2 has 50257 tokens"),
    ("a checkpoint of another tokenizer", "hf-vocab1000", [], "has 1000 rows"),
    ("an unknown flag", "ck-dense", ["--bogus"], "unrecognized arguments: --bogus"),
]


@pytest.mark.parametrize("what,checkpoint,flags,fragment", SAMPLE, ids=[case[0] for case in SAMPLE])
def test_a_bad_sample_ends_in_one_line_and_writes_nothing(what, checkpoint, flags, fragment, sources, tmp_path,
                                                          monkeypatch, capsys):
    import sample

    monkeypatch.chdir(tmp_path)  # --out-dir's default, out/, would be here
    if checkpoint == "hf-broken":
        (shutil.copytree(sources / "hf-st", tmp_path / "hf") / "config.json").write_text("{")
        path = tmp_path / "hf"
    else:
        path = checkpoint(tmp_path) if callable(checkpoint) else sources / checkpoint
    argv = [str(path), "--data", str(sources / "corpus.txt"), "--max-new-tokens", "2", "--eval-batches", "1",
            *(flags(tmp_path) if callable(flags) else flags)]
    _expect_one_line(lambda: sample.main(argv), capsys, fragment, tmp_path, sources)


def test_temperature_0_is_greedy():
    """sample.py --temperature 0 (its --help says so): each new token is the argmax of the logits, no draw."""
    model = build_model(GPTConfig(**BASE), seed=2).eval()
    prompt = torch.tensor([[1, 2, 3]])
    greedy = prompt
    with torch.no_grad():
        for _ in range(6):
            greedy = torch.cat([greedy, model(greedy)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
        drawn = [model.generate(prompt, 6, temperature=0, top_k=5, generator=torch.Generator().manual_seed(seed))
                 for seed in (0, 1)]
    assert torch.equal(drawn[0], greedy) and torch.equal(drawn[1], greedy)
