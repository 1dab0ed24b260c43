"""interop/hf.py, export_hf.py, sample.py and --init-from: GPT-2's Hugging Face layout both ways, on any mesh.

The round trip (one spawn per mesh, shared by its tests through module fixtures): a GPT with tanh GELU and
GPT-2's padded vocabulary (50257 real rows of 50304) trains 2 steps in float64 on a TP=2 × D=2 ZeRO-1 mesh and
is saved; export_hf.py turns the checkpoint into a Hugging Face directory; `--init-from` that directory on a
P=2 × D=2 ZeRO-1 mesh (flags.validate, then train.init_from) gives bitwise the same logical tensors, and its
first training loss on the next batch equals the source's on that batch (float64 sums in another order: 1e-12).
Where `transformers` is importable (it is not a requirement), the exported directory loads with
`transformers.GPT2LMHeadModel.from_pretrained` and its logits equal ours to 1e-5 in fp32, and directories saved by
`transformers` from a randomly initialised GPT2LMHeadModel load with --init-from with the same logits.
Nothing is downloaded: every Hugging Face directory here is written by the test.
"""

import json
import math
import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

import harness
from harness import run_bench, run_ranks
import moe
from model import GPTConfig
from reference import build_model
from reference import HYPER, global_batches

SEQ, GLOBAL_BATCH, STEPS, CLIP, TOL = 16, 4, 3, 0.05, 1e-12
VOCAB, ROWS = 50257, 50304  # GPT-2's BPE, padded (flags.padded_vocab)
BASE = dict(block_size=64, n_layer=2, n_head=4, n_embd=32, gelu="tanh")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def gpt2_config(**overrides) -> GPTConfig:
    return GPTConfig(**{**BASE, "vocab_size": ROWS, "real_vocab_size": VOCAB, **overrides})


def batches():
    return global_batches(STEPS, GLOBAL_BATCH, SEQ, vocab=VOCAB)


# ---------------------------------------------------------------------------------------------------------
# The GELU and the padded vocabulary, on one device
# ---------------------------------------------------------------------------------------------------------


def test_tanh_gelu_is_gpt2s_formula():
    """GPTConfig(gelu="tanh"): the MLP's (and the experts') GELU is 0.5·x·(1 + tanh(sqrt(2/π)·(x + 0.044715·x³))),
    Hugging Face's gelu_new, to float64 rounding; the exact GELU is another function (up to ~5e-4 apart)."""
    from moe import Expert

    x = torch.linspace(-8, 8, 10001, dtype=torch.float64)
    formula = 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    config = replace(gpt2_config(), moe=moe.ExpertsConfig(experts=2))
    for module in (build_model(gpt2_config()).transformer.h[0].mlp.gelu, Expert(config).gelu):
        assert module.approximate == "tanh"
        assert (module(x) - formula).abs().max() < 1e-15
    exact = build_model(gpt2_config(gelu="exact")).transformer.h[0].mlp.gelu(x)
    assert (exact - formula).abs().max() > 1e-4


def _padded_and_unpadded(junk: float):
    """A padded model whose padding rows hold `junk` (not the zeros they start with), and the same model
    without padding rows, float64."""
    padded = build_model(gpt2_config(), seed=3, dtype=torch.float64)
    unpadded = build_model(gpt2_config(vocab_size=VOCAB, real_vocab_size=None), seed=3, dtype=torch.float64)
    assert torch.equal(padded.transformer.wte.weight[VOCAB:], torch.zeros(ROWS - VOCAB, 32, dtype=torch.float64))
    unpadded.load_state_dict({k: v[:VOCAB] if k == "transformer.wte.weight" else v
                              for k, v in padded.state_dict().items() if k != "lm_head.weight"}, strict=False)
    with torch.no_grad():
        padded.transformer.wte.weight[VOCAB:] = junk
    return padded, unpadded


def test_padding_rows_never_change_the_loss_and_get_no_gradient():
    """Padding rows holding large values leave the loss exactly the unpadded model's, and get zero gradient."""
    padded, unpadded = _padded_and_unpadded(junk=3.0)
    x, y = batches()[0]
    _, loss_padded, _ = padded(x, y)
    _, loss_unpadded, _ = unpadded(x, y)
    assert abs(loss_padded.item() - loss_unpadded.item()) <= TOL * abs(loss_unpadded.item())
    loss_padded.backward()
    assert torch.count_nonzero(padded.transformer.wte.weight.grad[VOCAB:]) == 0


def test_padding_rows_are_never_sampled():
    """The sampler draws from the real rows only: the same tokens as the unpadded model, from the same seed,
    though the padding rows' logits would dominate (junk 3.0 against real logits of ~0.1)."""
    padded, unpadded = _padded_and_unpadded(junk=3.0)
    prompt = batches()[0][0][:2, :4]
    outs = [m.eval().generate(prompt, 12, temperature=1.0, top_k=None, generator=torch.Generator().manual_seed(5))
            for m in (padded, unpadded)]
    assert torch.equal(outs[0], outs[1]) and int(outs[0].max()) < VOCAB


# ---------------------------------------------------------------------------------------------------------
# The round trip: TP × ZeRO checkpoint → export_hf.py → --init-from on P × D
# ---------------------------------------------------------------------------------------------------------


def _flags(*extra):
    return ["--global-batch", str(GLOBAL_BATCH), "--micro-batch", "1", "--seq-len", str(SEQ), "--lr",
            str(HYPER["lr"]), "--weight-decay", str(HYPER["weight_decay"]), "--bucket-mb", "0.02", *extra]


def _run(rank, world, argv, config=None):
    """train.compose on the flags (config: replaces the flags' model), float64, as tests/test_composition."""
    from cli import flags as flags_lib
    import train
    from mesh import build_mesh

    settings = flags_lib.validate(flags_lib.build_parser().parse_args(argv), world, axes=train.AXES)
    if config is not None:
        settings = replace(settings, model=config)
    run = train.Run(settings=settings, mesh=build_mesh(settings.shape, rank), config=settings.model,
                    device=harness.device(), seed=0, compute_dtype=torch.float64, param_dtype=torch.float64,
                    master_dtype=torch.float64)
    torch.manual_seed(rank // run.mesh.size("tp"))
    return train.compose(run)


def _step(run, scaler, step):
    from reference import rank_micro_batches
    from step import train_step

    x, y = batches()[step]
    micro = run.micro_batch_size
    local = [(*b, None) for b in rank_micro_batches(x, y, run.mesh.index("dp"), run.mesh.size("dp"), micro)]
    return train_step(run.layout, scaler, local, run.mesh.group("dp_cp"), CLIP, run.autocast, run.device,
                      model=run.model, schedule=run.schedule, axes=run.axes, data_size=run.mesh.size("dp")).loss


def _save(run, root, step):
    import ckpt
    from data import BatchSampler
    from optim import DynamicLossScaler

    record = dict(model=run.config.architecture(), global_batch=GLOBAL_BATCH, seq_len=SEQ)
    saver = ckpt.Checkpointer(ckpt.CheckpointConfig(root, run_record=record), run.mesh, device=run.device,
                              log=lambda *a: None, axes=run.axes)
    saver.save(step, run.layout, DynamicLossScaler(enabled=False), BatchSampler(10_000, SEQ, GLOBAL_BATCH, 0))
    saver.close()


def _source(rank, world, root):
    """TP=2 × D=2, ZeRO-1: two steps, save, then the source's last loss: one more step, on batch 2. Also TP's
    vocab-parallel loss on logits whose second TP shard is all padding (rows 128..255 of 256, 100 real)."""
    import tensor_parallel
    from model import cross_entropy_sum
    from optim import DynamicLossScaler

    run = _run(rank, world, ["--preset", "tiny", *_flags("--tp", "2", "--zero", "1", "--micro-batch", "2")],
               gpt2_config())
    scaler = DynamicLossScaler(enabled=False)
    losses = [_step(run, scaler, s) for s in range(2)]
    _save(run, root, 2)
    last = _step(run, scaler, 2)
    logits = torch.randn(6, 256, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 100, (6,), generator=torch.Generator().manual_seed(2))
    t = run.mesh.index("tp")
    vocab_parallel = tensor_parallel.vocab_parallel_loss(logits[:, t * 128:(t + 1) * 128], targets, t * 128,
                                                         run.mesh.group("tp"), real_vocab_size=100)
    return dict(losses=losses, last=last, vocab_parallel=float(vocab_parallel),
                reference=float(cross_entropy_sum(logits, targets, real_vocab_size=100)))


def _imported(rank, world, hf_dir, root):
    """P=2 × D=2, ZeRO-1, from --init-from hf_dir (flags.validate reads its config.json; train.init_from loads):
    saved at step 0 as loaded, then the first training step, on batch 2."""
    import train
    from optim import DynamicLossScaler

    run = _run(rank, world, _flags("--init-from", hf_dir, "--tokenizer", "gpt2", "--pp", "2", "--zero", "1"))
    read = train.init_from(run, hf_dir)
    held = {p.key: p.shard.global_shape for p in run.layout.state_pieces() if p.key.startswith(("param/", "master/"))}
    _save(run, root, 0)
    return dict(config=run.config.architecture(), first=_step(run, DynamicLossScaler(enabled=False), 2), read=read,
                held=sorted(held), held_bytes=8 * sum(math.prod(shape) for shape in held.values()))


@pytest.fixture(scope="module")
def round_trip(tmp_path_factory):
    import ckpt
    import export_hf

    tmp = tmp_path_factory.mktemp("round_trip")
    source = run_ranks(_source, 4, str(tmp / "source"), timeout=300)
    export_hf.main([str(tmp / "source"), str(tmp / "hf")])
    imported = run_ranks(_imported, 4, str(tmp / "hf"), str(tmp / "imported"), timeout=300)
    return dict(source=source, imported=imported, dir=tmp / "hf", source_ckpt=tmp / "source",
                logical=ckpt.read_logical(str(tmp / "source" / "step-00000002")),
                imported_logical=ckpt.read_logical(str(tmp / "imported" / "step-00000000")))


def test_round_trip_gives_bitwise_the_same_logical_tensors(round_trip):
    source, imported = round_trip["logical"], round_trip["imported_logical"]
    weights = [key for key in source if key.split("/")[0] in ("param", "master")]
    assert len(weights) == 2 * 28  # 26 tensors of 2 blocks + ln_f, as params and fp32 masters (ZeRO-1)
    for key in weights:
        assert imported[key].dtype == source[key].dtype == torch.float64
        assert torch.equal(imported[key], source[key]), key


def test_round_trip_gives_the_same_loss(round_trip):
    """The imported run's first loss equals the source run's last one, on the same batch (another mesh)."""
    last = round_trip["source"][0]["last"]
    assert all(abs(r["first"] - last) <= TOL * last for r in round_trip["imported"]), (last, round_trip["imported"])


def test_init_from_reads_on_each_rank_only_the_tensors_it_holds_a_piece_of(round_trip):
    """P=2 × D=2 ZeRO-1: a rank reads the tensors its stage holds (params) and its ZeRO shard covers (masters),
    each whole, once per kind (float64: 8 bytes), never the others': 4 ranks, 4 different sets, all covered."""
    every = 2 * 8 * sum(t.numel() for k, t in round_trip["logical"].items() if k.startswith("param/"))
    held = [set(r["held"]) for r in round_trip["imported"]]
    assert len({tuple(sorted(h)) for h in held}) == 4 and set.union(*held) == {
        k for k in round_trip["logical"] if k.startswith(("param/", "master/"))}
    for r in round_trip["imported"]:
        assert r["read"] == r["held_bytes"] < every, (r["read"], r["held_bytes"], every)
        assert not any(".h.1." in k for k in r["held"]) or not any(".h.0." in k for k in r["held"])


def test_init_from_takes_the_shape_and_gelu_from_config_json(round_trip):
    config = round_trip["imported"][0]["config"]
    assert config == gpt2_config().architecture()


def test_padding_rows_stay_zero_through_training_and_are_not_exported(round_trip):
    logical, hf_dir = round_trip["logical"], round_trip["dir"]
    for kind in ("param", "master", "exp_avg", "exp_avg_sq"):
        assert torch.count_nonzero(logical[f"{kind}/transformer.wte.weight"][VOCAB:]) == 0, kind
    from safetensors.torch import load_file

    state = load_file(hf_dir / "model.safetensors")
    assert state["transformer.wte.weight"].shape == (VOCAB, 32) and "lm_head.weight" not in state
    assert state["transformer.h.0.attn.c_attn.weight"].shape == (32, 96)  # Conv1D: [in, out]
    assert torch.equal(state["transformer.h.0.mlp.c_fc.weight"], logical["master/transformer.h.0.mlp.c_fc.weight"].t())
    config = json.loads((hf_dir / "config.json").read_text())
    assert (config["vocab_size"], config["activation_function"], config["n_positions"]) == (VOCAB, "gelu_new", 64)


def test_vocab_parallel_loss_leaves_the_padding_out(round_trip):
    """Under TP, padding columns take no share of the softmax either, also on a rank that holds only padding."""
    reference = round_trip["source"][0]["reference"]
    assert all(abs(r["vocab_parallel"] - reference) <= TOL * reference for r in round_trip["source"])


def test_sample_py_evaluates_and_samples_any_checkpoint(round_trip, tmp_path, capsys):
    """sample.py on the TP × ZeRO checkpoint, one process: its model is the exported one, the val loss is a number
    and it samples (the built-in corpus tokenized with bytes cannot feed a GPT-2 vocabulary: --tokenizer is checked)."""
    from interop import hf
    import sample

    model, record = hf.load_model(str(round_trip["source_ckpt"]))
    exported, _ = hf.load_model(str(round_trip["dir"]))
    for (name, p), q in zip(model.named_parameters(), exported.parameters()):
        assert torch.equal(p[:VOCAB] if name == "transformer.wte.weight" else p, q), name
    assert (record["step"], record["mesh"]["tp"], record["mesh"]["dp"]) == (2, 2, 2)
    with pytest.raises(SystemExit) as stop:
        sample.main([str(round_trip["source_ckpt"]), "--tokenizer", "byte", "--out-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and "GPT-2's BPE vocabulary" in err, err


# ---------------------------------------------------------------------------------------------------------
# transformers (skipped where it is not installed)
# ---------------------------------------------------------------------------------------------------------


def _hf_model(vocab=VOCAB, **overrides):
    """A randomly initialised GPT2LMHeadModel, every parameter perturbed (its init has zero biases and unit
    LayerNorms, which would hide a swapped or untransposed tensor)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=vocab, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                     bos_token_id=None, eos_token_id=None, **overrides)
    model = transformers.GPT2LMHeadModel(config).double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def test_exported_directory_loads_in_transformers_with_the_same_logits(round_trip):
    transformers = pytest.importorskip("transformers")
    from interop import hf

    theirs = transformers.GPT2LMHeadModel.from_pretrained(str(round_trip["dir"]), dtype=torch.float32).eval()
    ours = hf.load_model(str(round_trip["source_ckpt"]))[0].float().eval()
    x = batches()[0][0]
    with torch.no_grad():
        difference = (ours(x, x)[0][..., :VOCAB] - theirs(x).logits).abs().max().item()
    assert difference < 1e-5, difference


def test_an_export_is_model_safetensors_and_with_bin_also_pytorch_model_bin_alike(round_trip, tmp_path):
    """export_hf.py writes save_pretrained's format, model.safetensors (the round trip reads it with --init-from
    on another mesh); --bin adds pytorch_model.bin with the same tensors. Where both are, --init-from reads
    model.safetensors; either alone gives the same model (and transformers' logits, where it is installed)."""
    from safetensors.torch import load_file

    import export_hf
    from interop import hf

    assert sorted(os.listdir(round_trip["dir"])) == ["config.json", "model.safetensors"]
    export_hf.main([str(round_trip["source_ckpt"]), str(tmp_path / "hf"), "--bin"])
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "model.safetensors", "pytorch_model.bin"]
    stored = load_file(tmp_path / "hf" / "model.safetensors")
    pickled = torch.load(tmp_path / "hf" / "pytorch_model.bin")
    assert stored.keys() == pickled.keys() and all(torch.equal(stored[k], pickled[k]) for k in stored)
    assert set(hf.HFDirectory(str(tmp_path / "hf")).weight_files.values()) == {"model.safetensors"}
    os.remove(tmp_path / "hf" / "model.safetensors")
    assert set(hf.HFDirectory(str(tmp_path / "hf")).weight_files.values()) == {"pytorch_model.bin"}
    ours, _ = hf.load_model(str(tmp_path / "hf"))
    for p, q in zip(ours.parameters(), hf.load_model(str(round_trip["dir"]))[0].parameters()):
        assert torch.equal(p, q)
    try:
        import transformers
    except ImportError:
        return
    theirs = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    x = batches()[0][0]
    with torch.no_grad():
        assert (ours.float().eval()(x, x)[0][..., :VOCAB] - theirs(x).logits).abs().max() < 1e-5


def test_bench_hf_smoke_runs(capsys):
    """bench/bench_hf.py --smoke (tests/test_bench.py lists it here): its table, nothing WRONG."""
    pytest.importorskip("transformers")
    run_bench("bench_hf", ["--smoke"])
    out = capsys.readouterr().out
    assert "tanh = gelu_new (after)" in out and "WRONG" not in out, out


def test_bench_hf_without_transformers_says_so_in_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if it were not installed
    with pytest.raises(SystemExit) as stop:
        run_bench("bench_hf", ["--smoke"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and "needs transformers: pip install transformers" in err, err


def _saved_two_ways(model, root):
    """model saved by transformers (model.safetensors, transformer.* names) and as an older pytorch_model.bin of
    GPT2Model names (no prefix) with the attention's causal-mask buffers."""
    model.save_pretrained(root / "safetensors")
    (root / "bin").mkdir()
    shutil.copy(root / "safetensors" / "config.json", root / "bin" / "config.json")
    state = {k.removeprefix("transformer."): v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    state.update({f"h.{i}.attn.bias": torch.tril(torch.ones(1, 1, 64, 64)) for i in range(2)})
    torch.save(state, root / "bin" / "pytorch_model.bin")
    return [root / "safetensors", root / "bin"]


def test_a_transformers_directory_loads_with_init_from_and_gives_the_same_logits(tmp_path):
    """Logits (the real vocabulary; 47 padding rows added) and the loss equal transformers' to 1e-12 in float64."""
    from cli import flags
    from interop import hf
    import train

    theirs = _hf_model()
    x, y = batches()[0]
    with torch.no_grad():
        logits = theirs(x).logits
    loss = torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), y.view(-1), ignore_index=-1, reduction="sum")
    for directory in _saved_two_ways(theirs, tmp_path):
        settings = flags.validate(flags.build_parser().parse_args(["--init-from", str(directory), "--tokenizer",
                                                                   "gpt2"]), 1, axes=train.AXES)
        assert (settings.model.vocab_size, settings.model.real_vocab_size, settings.model.gelu) == (ROWS, VOCAB, "tanh")
        ours = build_model(settings.model, dtype=torch.float64).eval()
        hf.load_into(hf.HFDirectory(str(directory), ROWS), hf._whole_pieces(ours))
        with torch.no_grad():
            our_logits, our_loss, _ = ours(x, y)
        assert (our_logits[..., :VOCAB] - logits).abs().max() < TOL, directory
        assert abs(our_loss.item() - loss.item()) <= TOL * loss.item(), directory


def _saved_with_dropout(rank, world, root, dropout):
    """A 1-rank tiny run with --dropout, saved at step 1 with the run record train.py writes (its model, its
    dropout: train.open_checkpointer)."""
    import ckpt
    from data import BatchSampler
    from optim import DynamicLossScaler

    run = _run(rank, world, ["--preset", "tiny", "--dropout", str(dropout), *_flags()])
    record = dict(model=run.config.architecture(), dropout=run.config.dropout, global_batch=GLOBAL_BATCH, seq_len=SEQ)
    saver = ckpt.Checkpointer(ckpt.CheckpointConfig(root, run_record=record), run.mesh, run.axes, log=lambda *a: None)
    saver.save(1, run.layout, DynamicLossScaler(enabled=False), BatchSampler(10_000, SEQ, GLOBAL_BATCH, 0))
    saver.close()


def test_config_json_says_the_dropout_the_run_recorded(round_trip, tmp_path, capsys):
    """config.json's resid_pdrop, embd_pdrop and attn_pdrop are the dropout of the run's record (GPT-2's 0.1
    was written for every model before); a checkpoint whose record predates it gets the trainer's default, 0,
    and the export's line says the checkpoint does not record it."""
    import export_hf

    run_ranks(_saved_with_dropout, 1, str(tmp_path / "ck"), 0.25)
    export_hf.main([str(tmp_path / "ck"), str(tmp_path / "hf")])
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert [config[k] for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")] == [0.25] * 3, config
    assert "dropout 0.25 as trained" in capsys.readouterr().out
    export_hf.main([str(round_trip["source_ckpt"]), str(tmp_path / "hf-old")])  # its record has no dropout
    config = json.loads((tmp_path / "hf-old" / "config.json").read_text())
    assert [config[k] for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")] == [0.0] * 3, config
    assert "dropout 0 (the trainer's default: the checkpoint does not record it)" in capsys.readouterr().out


@pytest.mark.parametrize("umask,directory,files", [(0o022, 0o755, 0o644), (0o027, 0o750, 0o640)])
def test_an_export_has_the_modes_save_pretrained_gives(round_trip, tmp_path, umask, directory, files):
    """The directory and its files get 0777 and 0666 less the umask, as save_pretrained's (os.makedirs, open):
    not mkdtemp's 0700 directory nor safetensors' 0600 file, which others could not read."""
    import export_hf

    previous = os.umask(umask)
    try:
        export_hf.main([str(round_trip["source_ckpt"]), str(tmp_path / "hf"), "--bin"])
    finally:
        os.umask(previous)
    out = tmp_path / "hf"
    assert os.stat(out).st_mode & 0o777 == directory, oct(os.stat(out).st_mode)
    modes = {name: oct(os.stat(out / name).st_mode & 0o777) for name in os.listdir(out)}
    assert modes == {name: oct(files) for name in ("config.json", "model.safetensors", "pytorch_model.bin")}, modes


# ---------------------------------------------------------------------------------------------------------
# Through torchrun: fine-tuning from an export starts where the source run ended
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_fine_tuning_from_an_export_starts_at_the_source_runs_last_val_loss(tmp_path, capsys):
    """train.py (TP=2, exact GELU, byte vocabulary) → export_hf.py → train.py --init-from on D=2: the fine-tuning
    run's val loss before training equals the source run's val loss after its last step (same val batches), and
    so does sample.py's on the checkpoint, on one process. In fp32: sample.py evaluates without autocast, and a
    bf16 autocast of the runs would differ from it by ~1e-4 (rounding, not the weights)."""
    import export_hf
    import sample

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    common = ["--dtype", "fp32", "--global-batch", "4", "--eval-batches", "2", "--sample-tokens", "0",
              "--out-dir", str(tmp_path), *harness.backend_flags(2)]

    def launch(*flags):
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                              os.path.join(ROOT, "train.py"), *common, *flags], capture_output=True, text=True,
                             timeout=240, env=env, cwd=ROOT)
        assert run.returncode == 0, run.stderr[-3000:]
        return run.stdout

    launch("--preset", "tiny", "--tp", "2", "--steps", "4", "--eval-every", "0", "--ckpt-dir", str(tmp_path / "ck"),
           "--metrics-file", str(tmp_path / "source.jsonl"))
    source_val = json.loads((tmp_path / "source.jsonl").read_text().splitlines()[-1])["val_loss"]
    export_hf.main([str(tmp_path / "ck"), str(tmp_path / "hf")])
    config = json.loads((tmp_path / "hf" / "config.json").read_text())  # train.py's record: trained without dropout
    assert [config[k] for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")] == [0.0] * 3, config
    sample.main([str(tmp_path / "ck"), "--eval-batches", "2", "--max-new-tokens", "8", "--out-dir", str(tmp_path)])
    sampled = capsys.readouterr().out
    sample_val = float(re.search(r"val loss ([0-9.]+) over the first 2 val batches of 4 × 64", sampled).group(1))
    assert abs(sample_val - source_val) < 1e-5, (sample_val, source_val)
    out = launch("--init-from", str(tmp_path / "hf"), "--steps", "1")
    start_val = float(re.search(r"init-from: val loss ([0-9.]+) before training", out).group(1))
    assert "GELU exact" in out and f"init-from {tmp_path / 'hf'}: model.safetensors" in out, out[:2000]
    assert abs(start_val - source_val) < 1e-5, (start_val, source_val)
