"""train.py end to end: a real torchrun launch that writes metrics and learns, and flags that cannot work.

Each torchrun launch costs a few seconds of process start-up here, so there are few of them; flag checks
that do not need a launch call `flags.validate` directly.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from harness import backend_flags, child_pids
from cli.flags import FlagError, build_parser, validate
from train import AXES


def validate_args(args, world):
    """flags.validate with every axis's rules, as train.main runs it."""
    return validate(args, world, axes=AXES)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def launch(nproc, *flags, timeout=180, script=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run([*TORCHRUN, f"--nproc_per_node={nproc}", str(script or os.path.join(ROOT, "train.py")),
                           *backend_flags(nproc), *flags],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def test_two_rank_run_writes_metrics_and_lowers_the_loss(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    run = launch(2, "--preset", "tiny", "--steps", "40", "--global-batch", "8", "--micro-batch", "2",
                 "--lr", "3e-3", "--out-dir", str(tmp_path), "--metrics-file", str(metrics), "--eval-every", "0",
                 "--sample-tokens", "16")
    assert run.returncode == 0, run.stderr[-3000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(40))
    required = {"step", "loss", "lr", "grad_norm", "tokens", "step_time_s", "tokens_per_s", "mfu", "skipped"}
    assert required <= set(records[0])
    assert records[0]["tokens"] == 8 * 64
    first, last = records[0]["loss"], sum(r["loss"] for r in records[-5:]) / 5
    assert last < first - 1.0, (first, last)
    assert "val_loss" in records[-1]
    out = run.stdout
    for printed in ("mesh: world 2 = D 2", "predicted persistent memory", "FLOPs/token", "peak assumed",
                    "predicted comm per step", "measured vs predicted", "sample"):
        assert printed in out, printed
    # m = B_global / (D · B_μ) = 8 / (2 · 2) = 2 micro-batches per step
    assert "D 2 × m 2 × B_μ 2" in out


def test_the_default_run_is_minutes_of_work_and_the_readme_names_it(tmp_path, monkeypatch):
    """`python train.py` with no flags is a newcomer's first run: its training work, steps × B_global·s tokens ×
    the FLOPs per token mfu.flops_per_token counts, stays within 20 TFLOP. Measured (README, Train), the 2-core test
    machine runs the default's 14 TFLOP in 162 s of wall time, so 20 TFLOP stays within the 5 minutes a
    newcomer waits; the `small` preset's 150 steps, the default before, were 44 TFLOP and ~13 minutes.
    The README's line for the run names its preset and its number of steps."""
    from cli import flags as flags_lib
    from accounting import memory
    import mfu
    import train

    monkeypatch.chdir(tmp_path)  # --out-dir's default, out/, is checked for writability here
    monkeypatch.setenv("WORLD_SIZE", "1")
    settings = flags_lib.parse([], train.AXES)
    args = settings.args
    per_token = mfu.flops_per_token(memory.param_counts(settings.model), settings.model, settings.seq_len)
    flops = per_token.hardware * args.global_batch * settings.seq_len
    assert flops * args.steps <= 20e12, f"{flops * args.steps / 1e12:.1f} TFLOP"
    with open(os.path.join(ROOT, "README.md")) as f:
        line = next(line for line in f if line.startswith("python train.py "))
    assert f"`{args.preset}` preset" in line and f"{args.steps} steps" in line, line


@pytest.mark.slow
def test_bad_layout_fails_fast_on_every_rank(tmp_path):
    run = launch(2, "--preset", "tiny", "--tp", "3", "--out-dir", str(tmp_path), timeout=60)
    assert run.returncode != 0
    assert "world size 2 is not divisible by --tp 3" in run.stderr


def _is_one_clean_error(run, message: str) -> bool:
    """The worker exited with status 2 after printing `message` on one line, once, with no Python traceback
    of its own (torchrun adds its own failure summary, which names the exit code)."""
    output = run.stdout + run.stderr
    lines = [line for line in output.splitlines() if line.startswith("error: ")]
    return (run.returncode != 0 and "exitcode  : 2" in output and len(lines) == 1 and message in lines[0]
            and 'train.py", line' not in output)


@pytest.mark.slow
def test_bad_inputs_end_in_one_line_exactly_once_through_torchrun(tmp_path):
    """Through torchrun, each way an error can reach the user prints exactly one line and exits with 2: an
    argparse choice (every rank's parser refuses it), a flag error when rank 0 starts 3 s after the others
    (the first rank to exit would get rank 0 killed before it printed: the ranks agree through the
    agent's store on who prints), and a corpus too small for the batch (found after the process group exists,
    by the ranks that build the token cache, and agreed by all); a --ckpt-dir another run writes (rank 0 is
    refused its lock before any process group and the other rank hears it through the store: no start-up)."""
    from resilience.ckpt_files import WriterLock

    late_rank0 = tmp_path / "late_rank0.py"
    late_rank0.write_text(f"import os, runpy, sys, time\nsys.path.insert(0, {ROOT!r})\n"
                          f"time.sleep(3.0 if os.environ['RANK'] == '0' else 0.0)\n"
                          f"runpy.run_path({os.path.join(ROOT, 'train.py')!r}, run_name='__main__')\n")
    tiny = tmp_path / "three-bytes.txt"
    tiny.write_text("abc")
    cases = [
        (2, None, ("--zero", "4"), "argument --zero: invalid choice: 4"),
        (4, late_rank0, ("--lr", "nan"), "--lr must be a finite number, got nan"),
        (2, None, ("--data", str(tiny)), "has only 3 tokens"),
        (2, None, ("--ckpt-dir", str(tmp_path / "held")), f"--ckpt-dir {tmp_path / 'held'} is being written by"
                                                          f" another run (pid {os.getpid()} on {os.uname().nodename}"),
    ]
    (tmp_path / "held").mkdir()
    held = WriterLock(str(tmp_path / "held"))  # this process is the run that writes it
    for nproc, script, flags, message in cases:
        run = launch(nproc, "--preset", "tiny", "--steps", "2", "--out-dir", str(tmp_path), *flags, timeout=120,
                     script=script)
        assert _is_one_clean_error(run, message), (flags, run.stdout[-2000:], run.stderr[-3000:])
        if "--ckpt-dir" in flags:
            assert "mesh: world" not in run.stdout, run.stdout[-2000:]  # refused before the start-up, not after it
    held.release()


BAD_INPUTS = [  # (flags, world size, what the one line must say); FILE, DIR: a file and a directory that exist
    (["--pp-schedule", "bogus"], 1, "argument --pp-schedule: invalid choice: 'bogus'"),
    (["--fp8", "bogus"], 1, "argument --fp8: invalid choice"),
    (["--zero", "4"], 1, "argument --zero: invalid choice: 4"),
    (["--tokenizer", "bogus"], 1, "argument --tokenizer: invalid choice"),
    (["--steps", "many"], 1, "argument --steps: invalid int value"),
    (["--no-such-flag"], 1, "unrecognized arguments: --no-such-flag"),
    (["--moe-experts", "4", "--moe-capacity-factor", "nan"], 1, "--moe-capacity-factor must be a finite number"),
    (["--moe-experts", "4", "--moe-aux-coef", "nan"], 1, "--moe-aux-coef must be a finite number"),
    (["--moe-experts", "4", "--moe-z-coef", "-1"], 1, "--moe-z-coef must be at least 0"),
    (["--peak-tflops", "-1"], 1, "--peak-tflops must be positive"),
    (["--peak-tflops", "0"], 1, "--peak-tflops must be positive"),
    (["--peak-tflops", "nan"], 1, "--peak-tflops must be a finite number"),
    (["--warmup-steps", "-5"], 1, "--warmup-steps must be at least 0, got -5"),
    (["--min-lr", "0.1", "--lr", "0.01"], 1, "--min-lr 0.1 is above --lr 0.01"),
    (["--bucket-mb", "0"], 1, "--bucket-mb must be positive"),
    (["--bucket-mb", "-1"], 1, "--bucket-mb must be positive"),
    (["--lr", "0"], 1, "--lr must be positive"),
    (["--lr", "inf"], 1, "--lr must be a finite number"),
    (["--beta1", "1.0"], 1, "--beta1 must be in [0, 1)"),
    (["--beta2", "-0.1"], 1, "--beta2 must be in [0, 1)"),
    (["--dropout", "1.0"], 1, "--dropout must be in [0, 1)"),
    (["--grad-clip", "-1"], 1, "--grad-clip must be at least 0"),
    (["--weight-decay", "nan"], 1, "--weight-decay must be a finite number"),
    (["--eval-every", "-1"], 1, "--eval-every must be at least 0"),
    (["--log-every", "0"], 1, "--log-every must be at least 1"),
    (["--sample-tokens", "-1"], 1, "--sample-tokens must be at least 0"),
    (["--eval-batches", "0"], 1, "--eval-batches must be at least 1"),
    (["--seq-len", "0"], 1, "--seq-len must be at least 1"),
    (["--fp8", "delayed", "--fp8-amax-history", "0"], 1, "--fp8-amax-history must be at least 1"),
    (["--trace-file", "t.json"], 1, "--trace-file needs --pp > 1"),
    (["--pp", "2", "--pp-virtual", "3", "--global-batch", "4", "--micro-batch", "2"], 2,
     "--pp-virtual needs --pp-schedule interleaved"),
    (["--pp-schedule", "zb"], 1, "--pp-schedule needs --pp > 1"),
    (["--cp-impl", "ulysses"], 1, "--cp-impl needs --cp > 1"),
    (["--fp8-margin", "2"], 1, "--fp8-margin needs --fp8"),
    (["--moe-topk", "1"], 1, "--moe-topk needs --moe-experts > 0"),
    (["--ckpt-every", "5"], 1, "--ckpt-every needs --ckpt-dir"),
    (["--keep", "3"], 1, "--keep needs --ckpt-dir"),
    (["--ckpt-dir", ""], 1, "--ckpt-dir '' names nothing"),
    (["--ckpt-dir", "FILE"], 1, "is a file, not a directory"),
    (["--ckpt-dir", "FILE/ck"], 1, "which is a file, not a directory"),
    (["--out-dir", "FILE/out"], 1, "which is a file, not a directory"),
    (["--metrics-file", "DIR"], 1, "is a directory; give a file name"),
    (["--metrics-file", "FILE/m.jsonl"], 1, "does not exist or cannot be written"),
    (["--pp", "2", "--trace-file", "DIR", "--global-batch", "4", "--micro-batch", "2"], 2,
     "--trace-file", ),
    (["--data", "BINARY"], 1, "is a binary file"),
    (["--data", "EMPTY"], 1, "is empty"),
    (["--data", "DIR/missing.txt"], 1, "is not a file"),
    (["--tp", "3"], 2, "world size 2 is not divisible by --tp 3"),
    (["--global-batch", "6", "--micro-batch", "2"], 2, "--global-batch 6 must be divisible by D × --micro-batch"),
    # the experts' split named before the batch that D = 3 does not divide; output paths where nothing
    # can be written (root passes os.access there: the kernel's filesystems are refused by their type)
    (["--moe-experts", "4", "--ep", "3"], 3, "--ep 3 must divide --moe-experts 4"),
    (["--metrics-file", "/proc/x"], 1, "--metrics-file '/proc/x': the directory '/proc' cannot be written"),
    (["--metrics-file", "/proc/self/status"], 1, "--metrics-file '/proc/self/status' exists and cannot be written"),
    (["--ckpt-dir", "/proc/x/y"], 1, "--ckpt-dir '/proc/x/y': the directory '/proc' cannot be written"),
    (["--ckpt-dir", "/proc"], 1, "--ckpt-dir '/proc': the directory '/proc' cannot be written"),
    (["--out-dir", "/proc/x/y"], 1, "--out-dir '/proc/x/y': the directory '/proc' cannot be written"),
    (["--out-dir", "/sys/x"], 1, "--out-dir '/sys/x': the directory '/sys' cannot be written"),
    (["--pp", "2", "--trace-file", "/proc/x", "--global-batch", "4", "--micro-batch", "2"], 2,
     "--trace-file '/proc/x': the directory '/proc' cannot be written"),
    # values in range whose use would raise later, a planning flag without a plan
    (["--seed", str(10**23)], 1, "--seed must be a 63-bit integer"),
    (["--bucket-mb", "1e308"], 1, "--bucket-mb must be at most 1.04858e+06"),
    (["--fp8", "delayed", "--fp8-margin", "100000"], 1, "--fp8-margin must be at most 127"),
    (["--world", "8"], 1, "--world needs --plan or --plan-search"),
    (["--backend", "gloo", "--hw", "h200"], 1, "--hw describes the GPU of --plan / --plan-search or of a GPU run"),
    (["--backend", "gloo", "--gpus-per-node", "4"], 1, "--gpus-per-node describes the GPU of --plan"),
    (["--backend", "gloo", "--hw-memory-gib", "80"], 1, "--hw-memory-gib describes the GPU of --plan"),
    # --optimizer muon (optimizers/muon.py): an unknown optimizer, values out of range, flags without Muon, and the
    # recipes and layouts it cannot serve
    (["--optimizer", "sgd"], 1, "argument --optimizer: invalid choice: 'sgd'"),
    (["--optimizer", "muon", "--muon-lr", "0"], 1, "--muon-lr must be a positive number, got 0.0"),
    (["--optimizer", "muon", "--muon-lr", "nan"], 1, "--muon-lr must be a positive number, got nan"),
    (["--optimizer", "muon", "--muon-momentum", "1"], 1, "--muon-momentum must be in [0, 1), got 1.0"),
    (["--optimizer", "muon", "--muon-momentum", "-0.5"], 1, "--muon-momentum must be in [0, 1), got -0.5"),
    (["--muon-lr", "0.01"], 1, "--muon-lr needs --optimizer muon"),
    (["--muon-owner", "--zero", "1"], 1, "--muon-owner needs --optimizer muon"),
    (["--optimizer", "muon", "--muon-owner"], 1, "--muon-owner needs --zero 1, 2 or 3"),
    (["--optimizer", "muon", "--moe-experts", "4"], 1, "--optimizer muon with --moe-experts: not served"),
    (["--optimizer", "muon", "--fp8", "current"], 1, "--optimizer muon with --fp8: not served"),
    (["--optimizer", "muon", "--precision-recipe", "mxfp8"], 1, "--optimizer muon with --precision-recipe: not served"),
    (["--optimizer", "muon", "--diloco-h", "2", "--steps", "4", "--global-batch", "4"], 2,
     "--optimizer muon with --diloco-h: not served"),
    (["--optimizer", "muon", "--plan-search", "--world", "8"], 1, "--optimizer muon with --plan-search"),
    (["--optimizer", "muon", "--zero", "1", "--offload", "optimizer"], 1,
     "--optimizer muon with --offload: not served"),
    (["--optimizer", "muon", "--dp-comm-bits", "4"], 1, "--optimizer muon with --dp-comm-bits: not served"),
]


@pytest.mark.parametrize("flags,world,message", BAD_INPUTS, ids=[" ".join(f) or "empty" for f, _, _ in BAD_INPUTS])
def test_a_bad_input_ends_in_one_line_before_any_process_group(flags, world, message, tmp_path, refused):
    """flags.parse, as every rank runs it before the process group exists: exit status 2 and one line,
    `error: ...`, naming the flag and what it must be; nothing else on stderr (no usage text, no traceback)."""
    paths = dict(FILE=tmp_path / "a-file", DIR=tmp_path / "a-dir", BINARY=tmp_path / "data.bin",
                 EMPTY=tmp_path / "empty.txt")
    paths["FILE"].write_text("x")
    paths["DIR"].mkdir()
    paths["BINARY"].write_bytes(bytes(range(256)) * 4)
    paths["EMPTY"].write_text("")
    flags = [next((flag.replace(k, str(p), 1) for k, p in paths.items() if flag.startswith(k)), flag)
             for flag in flags]
    err = refused(flags, world)
    assert message in err, err


@pytest.mark.slow
def test_a_damaged_checkpoint_ends_in_one_line_by_step_and_falls_back_with_latest(tmp_path):
    """Two ranks save steps 2 and 4; step 4 is damaged. `--resume 4`: one line naming it, why, and what to do,
    exit status 2. `--resume latest`: the refusal is reported and the run continues from step 2."""
    import ckpt

    common = ("--preset", "tiny", "--global-batch", "4", "--micro-batch", "2", "--eval-every", "0",
              "--sample-tokens", "0", "--out-dir", str(tmp_path), "--ckpt-dir", str(tmp_path / "ck"))
    first = launch(2, *common, "--steps", "4", "--ckpt-every", "2", "--keep", "3")
    assert first.returncode == 0, first.stderr[-3000:]
    shard = tmp_path / "ck" / "step-00000004" / "shard-00001.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))

    by_step = launch(2, *common, "--steps", "6", "--resume", "4", timeout=60)
    assert _is_one_clean_error(by_step, "fails its SHA-256 checksum"), (by_step.stdout[-2000:], by_step.stderr[-3000:])
    line = next(line for line in by_step.stderr.splitlines() if line.startswith("error: "))
    assert "step-00000004" in line and "--resume latest" in line and "step-00000002" in line, line

    latest = launch(2, *common, "--steps", "3", "--resume", "latest", timeout=120)
    assert latest.returncode == 0, latest.stderr[-3000:]
    assert "refusing" in latest.stdout and "resumed from" in latest.stdout and "at step 2" in latest.stdout
    assert ckpt.list_checkpoints(str(tmp_path / "ck"))[0][0] == 3
    # The communication table holds every collective of the run, filed by phase: the resume's and the save's
    # verdicts (object collectives) and the evaluation's sum in rows of their own, apart from the steps'.
    table = latest.stdout.split("communication by (phase, collective, group)")[1]
    rows = {(phase, op, name) for line in table.splitlines()[1:] if len(line.split()) > 3
            for phase, op, group in [line.split()[:3]] for name in group.split("=")}  # "dp=dp_cp=expert_dp"
    for row in (("ckpt", "all_gather_object", "world"), ("ckpt", "broadcast_object_list", "world"),
                ("eval", "all_reduce", "dp_cp"), ("step", "all_reduce", "dp_cp"),
                ("startup", "all_gather_object", "world")):  # the token caches ready, or one error for all
        assert row in rows, (row, table)


def _tree(root) -> dict:
    """Every file and directory under root: its modification time and (a file's) bytes."""
    return {path: (path.stat().st_mtime_ns, path.read_bytes() if path.is_file() else None)
            for path in sorted(root.rglob("*"))}


def test_a_second_run_on_a_ckpt_dir_is_refused_before_any_process_group_and_a_dead_holder_blocks_nothing(
        tmp_path, monkeypatch, capsys):
    """A live run holds --ckpt-dir (its flock on <dir>/.lock): a second one ends in flags.parse, before any
    process group, with one line naming the directory and the holder (pid, host), exit status 2, and not a
    byte or a timestamp under the directory changed (the first run's checkpoints and its save in progress
    stay). Once the holder is killed (SIGKILL: its lock file stays behind, naming it), a new run takes the
    directory: the kernel dropped the dead holder's flock."""
    import torch.distributed as dist

    from cli import flags as flags_lib
    import train

    root = tmp_path / "ck"
    root.mkdir()
    hold = (f"import sys, time; sys.path.insert(0, {ROOT!r}); from resilience import ckpt_files;"
            f" lock = ckpt_files.WriterLock({str(root)!r}); print('held', flush=True); time.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "held"
        for name, content in (("step-00000002/shard-00000.pt", b"weights"), ("step-00000002/COMMITTED", b"{}"),
                              (".tmp-step-00000004-abcd/shard-00000.pt", b"half")):  # committed; being saved
            (root / name).parent.mkdir(exist_ok=True)
            (root / name).write_bytes(content)
        before = _tree(root)
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "1")
        argv = ["--preset", "tiny", "--out-dir", str(tmp_path / "out"), "--ckpt-dir", str(root)]
        with pytest.raises(SystemExit) as stop:
            flags_lib.parse(argv, train.AXES)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.count("\n") == 1, err
        assert err.startswith(f"error: --ckpt-dir {root} is being written by another run (pid {holder.pid} on"
                              f" {os.uname().nodename} holds {root / '.lock'})"), err
        assert not dist.is_initialized() and _tree(root) == before
    finally:
        holder.kill()
        holder.wait()
    settings = flags_lib.parse(argv, train.AXES)  # the stale lock file names a dead process: no block
    assert f"pid {os.getpid()} on" in (root / ".lock").read_text()
    settings.ckpt_lock.release()


def args_for(*flags):
    return build_parser().parse_args(["--preset", "tiny", *flags])


@pytest.mark.parametrize(
    "flags,world,message",
    [
        (["--global-batch", "6", "--micro-batch", "2"], 2, "--global-batch 6 must be divisible by D × --micro-batch"),
        (["--global-batch", "1"], 2, "--global-batch 1 must give each of D=2"),
        (["--seq-len", "65"], 1, "--seq-len 65 must be between 1 and the model's block size 64"),
        (["--sp"], 2, "--sp (sequence parallel) needs --tp > 1"),
        (["--steps", "0"], 1, "--steps must be at least 1"),
        (["--n-head", "5"], 1, "n_embd=64 must be divisible by n_head=5"),
        (["--ep", "3"], 2, "--ep 3 must divide"),
        (["--data", "/no/such/file.txt"], 1, "--data '/no/such/file.txt' is not a file"),
        (["--data", "/dev/null"], 1, "--data '/dev/null' is not a file"),
        (["--lr", "nan"], 1, "--lr must be a finite number"),
        (["--metrics-file", "/no/such/dir/m.jsonl"], 1, "--metrics-file '/no/such/dir/m.jsonl'"),
        (["--pp", "2", "--global-batch", "2", "--micro-batch", "2"], 2, "--pp 2 needs at least 2 micro-batches"),
        (["--cp", "2", "--seq-len", "30"], 2, "--seq-len"),
        (["--moe-experts", "3", "--ep", "2"], 2, "--ep 2 must divide --moe-experts 3"),
    ],
)
def test_invalid_flags_have_clear_errors(flags, world, message):
    with pytest.raises(FlagError) as error:
        validate_args(args_for(*flags), world)
    assert message in str(error.value)


def test_preset_help_lists_every_preset():
    from model import PRESETS

    help_text = next(action.help for action in build_parser()._actions if action.dest == "preset")
    assert help_text.removeprefix("model size: ").split(" | ") == list(PRESETS), help_text


def test_batch_arithmetic():
    settings = validate_args(args_for("--global-batch", "16", "--micro-batch", "2"), 4)
    assert (settings.shape.dp, settings.micro_batches, settings.micro_batch_size) == (4, 2, 2)
    settings = validate_args(args_for("--global-batch", "16"), 2)
    assert (settings.micro_batches, settings.micro_batch_size) == (1, 8)


def test_empty_data_file_is_a_flag_error(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(FlagError, match="is empty"):
        validate_args(args_for("--data", str(empty)), 1)


def test_resume_alone_means_latest():
    assert args_for("--ckpt-dir", "ck", "--resume").resume == "latest"
    assert args_for("--ckpt-dir", "ck", "--resume", "40").resume == "40"
    assert args_for().resume is None


@pytest.mark.slow
def test_every_axis_at_once_through_torchrun(tmp_path):
    """PP 2 × CP 2 (DP 1) on 4 ranks with experts over EP 2, FP8 and ZeRO-1: the whole of train.main (the
    printouts, evaluation through the stages, sampling in lock step), every traced message as predicted."""
    run = launch(4, "--preset", "tiny", "--pp", "2", "--cp", "2", "--moe-experts", "4", "--ep", "2", "--fp8",
                 "current", "--zero", "1", "--steps", "3", "--global-batch", "8", "--micro-batch", "2",
                 "--out-dir", str(tmp_path), "--eval-every", "2", "--eval-batches", "1", "--sample-tokens", "4",
                 timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    table = out.split("messages per training step, traced vs predicted")[1].split("communication by")[0]
    names = {name for line in table.splitlines() if line.strip() for name in line.split()[1].split("=")}
    assert {"pp", "pp_tied", "cp", "ep", "dp_cp", "world"} <= names, table  # D = 1: cp, dp_cp, ep are one group
    assert "<- differs" not in table, table
    assert "moe load" in out and "fp8 current" in out and "pipeline 1f1b" in out and "sample" in out


@pytest.mark.slow
def test_two_torchrun_agents_without_a_shared_filesystem_match_one_agent(tmp_path):
    """Multi-node: two torchrun agents (nodes) on this machine, each started in its own directory so they share
    no out/ (no shared filesystem). Each node's local rank 0 builds its own token cache (the bytes are
    deterministic); a 2 × 2 --tp 2 run trains and matches the same run from one agent of 4 ranks."""
    import socket

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(3000)))
    flags = ["--preset", "tiny", "--tp", "2", "--steps", "3", "--global-batch", "4", "--micro-batch", "2",
             "--data", str(corpus), "--eval-every", "0", "--sample-tokens", "0", "--metrics-file", "metrics.jsonl"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nodes = []
    for node in (0, 1):
        cwd = tmp_path / f"node{node}"
        cwd.mkdir()
        nodes.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2", "--node-rank",
             str(node), "--master-addr", "127.0.0.1", "--master-port", str(port), os.path.join(ROOT, "train.py"),
             *backend_flags(2), *flags], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [node.communicate(timeout=240)[0] for node in nodes]
    assert all(node.returncode == 0 for node in nodes), [out[-3000:] for out in outputs]
    for node in (0, 1):  # each node tokenized into its own directory
        assert any((tmp_path / f"node{node}" / "out" / "data").iterdir())
        assert "data: tokenizing" in outputs[node]
    one = tmp_path / "one-agent"
    one.mkdir()
    single = subprocess.run([*TORCHRUN, "--nproc_per_node=4", os.path.join(ROOT, "train.py"), *backend_flags(4),
                             *flags], cwd=one, env=env, capture_output=True, text=True, timeout=240)
    assert single.returncode == 0, single.stderr[-3000:]
    losses = [[json.loads(line)["loss"] for line in (d / "metrics.jsonl").read_text().splitlines()]
              for d in (tmp_path / "node0", one)]
    assert len(losses[0]) == 3 and losses[0] == losses[1], losses  # the same ranks, groups and sums: bitwise


@pytest.mark.slow
@pytest.mark.parametrize("nproc,flags", [(2, ("--tp", "2", "--sp", "--moe-experts", "4", "--zero", "2")),
                                         (2, ("--pp", "2", "--zero", "1")), (1, ("--zero", "3", "--fp8", "current")),
                                         (2, ("--tp", "2", "--sp", "--activation-checkpointing", "selective"))],
                         ids=["tp-sp-experts-zero2", "pp-zero1", "zero3-fp8-alone", "tp-sp-selective"])
def test_messages_are_as_predicted_with_fp32_gradient_accumulation(nproc, flags, tmp_path):
    """bf16 ZeRO with m = 4 accumulates in fp32: the gradient sums the axes add after the reduction (SP's over
    TP for the experts, the tied embedding's over its two stages) move those fp32 shards, as predicted; and a
    ZeRO group of one (D = 1) sends nothing, FP8 weight gathers included. Selective recompute under TP + SP
    sends nothing again in backward (its collectives kept: parallel/collectives.py)."""
    run = launch(nproc, "--preset", "tiny", "--dtype", "bf16", *flags, "--steps", "2", "--global-batch", "4",
                 "--micro-batch", "1",
                 "--eval-every", "0", "--sample-tokens", "0", "--out-dir", str(tmp_path), timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "D 1 × m 4" in run.stdout
    if nproc == 1:  # nothing predicted, nothing traced: no table at all
        assert "predicted comm per step: none" in run.stdout and "messages per training step" not in run.stdout
        return
    table = run.stdout.split("messages per training step, traced vs predicted")[1].split("communication by")[0]
    assert "<- differs" not in table, table
    for line in run.stdout.splitlines():  # the pipeline's own line: "... per step predicted 1 × = X, traced 1 × = X"
        if "per step predicted" in line:
            predicted, traced = line.split("per step predicted ")[1].split(", traced ")
            assert predicted == traced, line


def _traced_row(out: str, op: str, group: str) -> str:
    table = out.split("messages per training step, traced vs predicted")[1].split("communication by")[0]
    assert "<- differs" not in table, table
    return next(line for line in table.splitlines()  # "dp=dp_cp=expert_dp": names sharing one group (mesh.py)
                if line.split()[:1] == [op] and group in line.split()[1].split("="))


@pytest.mark.slow
def test_zero3_gathers_fp8_weights_in_half_the_bytes(tmp_path):
    """--zero 3 --fp8 under bf16: the block linears' weights travel as E4M3 bytes (1 byte, not bf16's 2); the
    traced all-gather equals the prediction, and the FP8 units' share of it is exactly half of bf16's."""
    common = ["--preset", "tiny", "--dtype", "bf16", "--zero", "3", "--steps", "2", "--global-batch", "2",
              "--micro-batch", "1",
              "--eval-every", "0", "--sample-tokens", "0", "--out-dir", str(tmp_path)]
    plain, fp8_run = launch(2, *common), launch(2, *common, "--fp8", "current")
    for run in (plain, fp8_run):
        assert run.returncode == 0, run.stderr[-3000:]

    def traced_kib(out):  # "all_gather_single dp_cp traced <calls> <payload> KiB predicted ..."
        fields = _traced_row(out, "all_gather_single", "dp_cp").split()
        assert fields[5] == "KiB", fields
        return float(fields[4])

    # tiny: h = 64, 2 blocks; per block the 4 weights are 12·h² elements, gathered twice per micro-batch but
    # the last block's once: 3 gathers × 12·h² per micro-batch, 1 micro-batch per rank, bf16 2 bytes vs FP8 1.
    saved = 3 * 12 * 64 * 64 * (2 - 1) / 1024
    assert traced_kib(plain.stdout) - traced_kib(fp8_run.stdout) == pytest.approx(saved, abs=0.01)
    _traced_row(fp8_run.stdout, "all_reduce", "dp_cp")  # the scales' agreement is predicted and traced too


@pytest.mark.slow
def test_ctrl_c_during_an_async_save_ends_in_one_line_and_leaves_no_temporary(tmp_path):
    """SIGINT to the whole torchrun process group (what Ctrl-C sends) while checkpoints persist in the
    background: one line (the step reached, the newest committed checkpoint), no KeyboardInterrupt traceback
    from any rank, and no `.tmp-step-*` directory left behind (torchrun adds its own lines)."""
    import signal
    import time

    ck = tmp_path / "ck"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([*TORCHRUN, "--nproc_per_node=2", os.path.join(ROOT, "train.py"), *backend_flags(2),
                             "--preset", "tiny", "--steps", "10000", "--global-batch", "4", "--eval-every", "0",
                             "--sample-tokens", "0", "--log-every", "1", "--out-dir", str(tmp_path), "--ckpt-dir",
                             str(ck), "--ckpt-every", "2", "--async-ckpt"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
                            start_new_session=True)
    lines, deadline = [], time.monotonic() + 180
    while time.monotonic() < deadline:  # until a few checkpoints are committed
        line = proc.stdout.readline()
        lines.append(line)
        if line.startswith("ckpt step 6 "):
            break
    os.killpg(proc.pid, signal.SIGINT)
    out = "".join(lines) + proc.communicate(timeout=60)[0]
    assert proc.returncode != 0
    stops = [line for line in out.splitlines() if line.startswith("interrupted at step")]
    assert len(stops) == 1 and "the newest committed checkpoint is step" in stops[0], out[-3000:]
    assert "KeyboardInterrupt" not in out and 'train.py", line' not in out, out[-3000:]
    assert not [name for name in os.listdir(ck) if name.startswith(".tmp-")], os.listdir(ck)


@pytest.mark.slow
def test_one_process_prints_no_empty_tables_and_a_resume_at_the_last_step_is_an_error(tmp_path):
    """`python train.py` alone: the step line shows step i/N and an ETA, the message tables are left out
    (one process sends nothing) instead of printed as empty headers; resuming at the run's own last step
    (with --init-from or without) is one line saying there is nothing to train, exit status 2, rather than a
    status 0 that trained nothing."""
    common = [sys.executable, os.path.join(ROOT, "train.py"), "--preset", "tiny", "--steps", "3", "--global-batch",
              "2", "--eval-every", "0", "--sample-tokens", "0", "--out-dir", str(tmp_path), "--ckpt-dir",
              str(tmp_path / "ck"), "--peak-tflops", "1", *backend_flags(1)]  # the suite's backend, as torchrun's
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    first = subprocess.run(common, capture_output=True, text=True, env=env, cwd=ROOT, timeout=180)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "predicted comm per step: none (one process" in first.stdout
    assert "messages per training step" not in first.stdout
    steps = [line for line in first.stdout.splitlines() if line.startswith("step ")]
    assert steps[0].startswith("step 0/3 | loss") and " | eta " in steps[0], steps
    again = subprocess.run([*common, "--resume"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=180)
    assert again.returncode == 2, again.stderr[-3000:]
    errors = [line for line in (again.stdout + again.stderr).splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "nothing to train: the checkpoint in --ckpt-dir" in errors[0], errors
    assert "is at step 3 and --steps is 3; raise --steps" in errors[0], errors
    assert not [line for line in again.stdout.splitlines() if line.startswith("step ")]


def test_every_dtype_the_flags_accept_reaches_the_end_of_a_run_on_cpu(one_process_runs):
    """--dtype fp32, bf16, fp16 and auto on one CPU process, each to the last line of the end's accounting:
    the hardware model's check line compares the steps with the model of this machine, whose peak is the one
    measured in the run's dtype (fp16 must not look up a bf16 peak the measured CPU does not have: KeyError).
    Two steps, so one is timed and the check line predicts; one process runs the four, importing torch once
    (conftest.one_process_runs, whose metrics files tests/test_plot.py draws)."""
    from cli import flags as flags_lib

    dtypes, run = one_process_runs["dtypes"], one_process_runs["run"]
    assert set(dtypes) == set(build_parser()._option_string_actions["--dtype"].choices)  # every one the flag takes
    sections = run.stdout.split("=== --dtype ")[1:]
    assert [section.split()[0] for section in sections] == dtypes, run.stdout[-3000:] + run.stderr[-3000:]
    for dtype, section in zip(dtypes, sections):
        lines = section.rstrip().splitlines()
        assert "Traceback" not in section, (dtype, section[-3000:])
        check = next(line for line in lines if line.startswith("hardware model: step time measured"))
        resolved = flags_lib.auto_dtype(flags_lib.torch.device("cpu"))[0] if dtype == "auto" else dtype
        assert f"GFLOP/s {resolved}," in check, (dtype, check)
        end = max(i for i, line in enumerate(lines) if line.startswith("throughput "))
        assert lines[end + 1] == "=" * 100, (dtype, lines[end - 1:end + 3])
        assert lines[-1].startswith("  useful tokens per wall second "), (dtype, lines[-3:])  # goodput's table


def test_an_mfu_above_100_percent_is_flagged_once(capsys):
    """A step line whose MFU exceeds 100% marks it and says once, why: the peak assumed is too low."""
    import report.run
    clock = report.run.Progress(0, 10)
    record = dict(step=0, loss=1.0, lr=1e-3, grad_norm=0.5, skipped=False, tokens_per_s=10.0, mfu=2.23,
                  step_time_s=0.1)
    for step in (0, 1):
        report.run.print_step(dict(record, step=step), clock)
    out = capsys.readouterr().out
    assert out.count("MFU 223.00%!") == 2 and out.count("MFU above 100% cannot be") == 1, out


def test_the_axis_protocol_is_ten_methods_and_no_handle_brings_back_a_removed_hook():
    """step.Axis: six training methods (after_load: the redundant experts' placement from a checkpoint; after_update:
    QK-clip's scale of the new weights) and four accounting ones: the predicted and traced messages, `observe`
    (the accounting's clock or counter subscribes to the algorithm) and `facts` (what the printouts read).
    A handle may have helpers of its own, but none of the hooks that left the protocol (printing moved to
    report/axes.py's sections, per-step hooks into after_grad_sync, "loaded" into the loaded tensors, the
    routed-load record into observers.RoutedLoad, TP's `holding` into its facts)."""
    import inspect

    import step

    protocol = {name for name, value in vars(step.Axis).items() if callable(value) and not name.startswith("_")}
    assert protocol == {"shard_batches", "after_grad_sync", "after_update", "sampling", "state_pieces", "after_load",
                        "predicted_messages", "traced_prediction", "observe", "facts"}, protocol
    removed = {"startup_lines", "end_lines", "step_lines", "groups", "before_step", "after_step",
               "local_nonfinite", "gather_codecs", "state_loaded", "take_load", "reset_routing", "routed_rows",
               "holding"}
    handles = [cls for module in AXES for _, cls in inspect.getmembers(module, inspect.isclass)
               if issubclass(cls, step.Axis) and cls is not step.Axis]
    assert len({cls.name for cls in handles}) == len(AXES), handles  # one handle class per axis
    for cls in handles:
        assert not removed & set(vars(cls)), (cls, removed & set(vars(cls)))


ACCOUNTING = ("report/run.py", "report/axes.py", "accounting/measure.py", "accounting/activations.py",
              "planner/time_model.py")
# What the accounting files still read of a handle beyond step.Axis: nothing.
STILL_READ = set()
# ... and of a layout beyond optim.Layout: `get` is time_model.predict's `layout`, the plan's dict of sizes.
STILL_READ_OF_LAYOUTS = {"get"}


def _accounting_reads(variables: tuple) -> dict:
    """{attribute: files} of every attribute the accounting files read on a variable named in `variables` (or
    on an attribute of that name: `run.layout.held_bytes`)."""
    import ast

    read = {}
    for path in ACCOUNTING:
        for node in ast.walk(ast.parse(open(os.path.join(ROOT, path)).read())):
            if not isinstance(node, ast.Attribute):
                continue
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id in variables) or (isinstance(owner, ast.Attribute)
                                                                            and owner.attr in variables):
                read.setdefault(node.attr, set()).add(path)
    return read


def test_the_accounting_reads_a_handle_only_through_the_protocol():
    """report/run.py, report/axes.py, accounting/measure.py, accounting/activations.py, planner/time_model.py: every
    attribute read on a handle (a variable `axis` or `handle`) is a step.Axis method or attribute (`facts()` for the
    axis's own figures, `observer` for what the accounting subscribed), apart from STILL_READ."""
    import step

    protocol = {name for name in vars(step.Axis) if not name.startswith("_")}
    beyond = {name: paths for name, paths in _accounting_reads(("axis", "handle")).items()
              if name not in protocol | STILL_READ}
    assert not beyond, beyond


def test_the_accounting_reads_a_layout_only_through_the_protocol():
    """The same files: every attribute read on a layout (a variable `layout`, or `run.layout`) is an
    optim.Layout method or attribute (`facts()` for the layout's own figures: ddp.DDPFacts, zero.ZeroFacts),
    apart from STILL_READ_OF_LAYOUTS."""
    import optim

    protocol = {name for name in vars(optim.Layout) if not name.startswith("_")} | set(optim.Layout.__annotations__)
    beyond = {name: paths for name, paths in _accounting_reads(("layout",)).items()
              if name not in protocol | STILL_READ_OF_LAYOUTS}
    assert not beyond, beyond


@pytest.mark.slow
def test_workers_stop_with_a_killed_launcher_and_the_newest_checkpoint_survives(tmp_path):
    """SIGKILL to torchrun's process group reaches torchrun alone: its agent started the workers with setsid.
    Each worker watches its parent (elastic.stop_with_the_launcher) and ends once it is gone, within seconds, and
    the newest committed checkpoint verifies (nothing half-committed: a save in flight is abandoned)."""
    from resilience import ckpt_files

    ck = tmp_path / "ck"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    launcher = subprocess.Popen([*TORCHRUN, "--nproc_per_node=2", os.path.join(ROOT, "train.py"), *backend_flags(2),
                                 "--preset", "tiny", "--steps", "100000", "--global-batch", "4", "--eval-every", "0",
                                 "--out-dir", str(tmp_path), "--ckpt-dir", str(ck), "--ckpt-every", "3",
                                 "--async-ckpt"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 150
        while ckpt_files.newest_committed(str(ck)) is None or len(child_pids(launcher.pid)) < 2:
            assert time.time() < deadline and launcher.poll() is None, "no checkpoint was committed"
            time.sleep(0.5)
        time.sleep(1.0)  # into the middle of some step, or of a background save
        workers = child_pids(launcher.pid)
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)  # the launcher's group: torchrun, not its workers' sessions
        launcher.wait()
    deadline = time.time() + 30
    while [w for w in workers if os.path.exists(f"/proc/{w}")] and time.time() < deadline:
        time.sleep(0.5)
    alive = [w for w in workers if os.path.exists(f"/proc/{w}") and open(f"/proc/{w}/stat").read().split()[2] != "Z"]
    for orphan in alive:  # the failure is reported, not left running
        os.kill(orphan, signal.SIGKILL)
    assert not alive, f"workers {alive} outlived their launcher by 30 s"
    step, path = ckpt_files.newest_committed(str(ck))
    ckpt_files.verify_checkpoint(path)  # raises CheckpointError if anything in it is missing or damaged
    assert step >= 3 and step % 3 == 0, step


def _readme_examples() -> list:
    """The commands of README.md's "Train" block, then its first plan.py example: what a newcomer types."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    train_block = readme.split("## Train")[1].split("```bash")[1].split("```")[0]
    plan_block = readme.split("## Sizing a layout")[1].split("```bash")[1].split("```")[0]
    return [line.split("#")[0].split() for line in [*train_block.splitlines(), plan_block.strip().splitlines()[0]]
            if line.strip()]


def _at_a_tenth(argv: list, tmp) -> list:
    """One README command at a tenth of its steps (and checkpoint interval), its directories under `tmp`, no
    evals and a short sample: what it does, not how long it takes."""
    out, i = [], 0
    while i < len(argv):
        flag = argv[i]
        if flag in ("--steps", "--ckpt-every", "--diloco-h"):  # a tenth: DiLoCo's steps stay a multiple of H
            out += [flag, str(max(2 if flag == "--steps" else 1, int(argv[i + 1]) // 10))]
            i += 2
            continue
        if flag in ("--ckpt-dir", "--trace-file"):
            out += [flag, str(tmp / argv[i + 1])]
            i += 2
            continue
        out.append(flag)
        i += 1
    if out[0] == "torchrun":  # the suite's launcher and backend (a GPU suite passes nccl)
        nproc = next(int(a.split("=")[1]) if "=" in a else int(out[out.index(a) + 1]) for a in out
                     if a.startswith("--nproc_per_node"))
        out = [*TORCHRUN, *out[1:], *backend_flags(nproc)]
    else:
        out = [sys.executable, *out[1:]]
    if "train.py" in " ".join(out):
        out += ["--out-dir", str(tmp / "out"), "--eval-every", "0", "--sample-tokens", "8"]
        out += [] if "--steps" in out else ["--steps", "3"]  # the default run: its own 600 → 3
    return out


@pytest.mark.slow
def test_every_readme_example_runs_as_written_in_order(tmp_path):
    """README.md's Train examples, in their order, from nothing (a fresh out-dir and checkpoint directories):
    each ends with status 0, trains what it says (the resume continues, it does not find nothing to train), and
    none trips on another's files."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    (tmp_path / "out").mkdir()
    commands = _readme_examples()
    assert len(commands) >= 15, commands
    for argv in commands:
        run = subprocess.run(_at_a_tenth(argv, tmp_path), capture_output=True, text=True, env=env, cwd=ROOT,
                             timeout=300)
        assert run.returncode == 0, (" ".join(argv), run.stderr[-3000:])
        assert "nothing to train" not in run.stdout, " ".join(argv)
        assert "WARNING" not in run.stdout + run.stderr.replace("W1", ""), (" ".join(argv), run.stdout[-2000:])
