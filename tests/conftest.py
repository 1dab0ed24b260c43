import os
import sys

import pytest
import torch

# Tests import the trainer's files (model.py, experts/eplb.py as `experts.eplb`, ...) from the repository root, and
# the harness and each other (test_composition's runs) by file name from every folder of tests/, which mirrors the
# repository's. The spawned ranks inherit this path.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [ROOT] + [os.path.join(TESTS, d) for d in sorted(os.listdir(TESTS))
                         if os.path.isdir(os.path.join(TESTS, d)) and not d.startswith(("_", "."))] + [TESTS]

from cli import flags as flags_lib  # noqa: E402 - found through the path just set
import train  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--backend", choices=["gloo", "nccl"], default=None,
                     help="process-group backend of the multi-rank tests (default: $TEST_BACKEND or gloo)")


def pytest_configure(config):
    # The spawned ranks read the environment (harness.backend()), so the option is passed on through it.
    if config.getoption("--backend"):
        os.environ["TEST_BACKEND"] = config.getoption("--backend")


@pytest.fixture
def refused(tmp_path, monkeypatch, capsys):
    """`refused(flags, world)`: train.py's flags (after --preset tiny) parsed as rank 0 of `world` parses them,
    cli.flags.parse, before any process group exists. They must end in exit status 2 and one line on stderr,
    `error: ...` (no usage text, no traceback): that line is returned for the test's own checks."""
    def parse(flags: list, world: int = 1) -> str:
        monkeypatch.chdir(tmp_path)
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", str(world))
        with pytest.raises(SystemExit) as stop:
            flags_lib.parse(["--preset", "tiny", "--out-dir", str(tmp_path / "out"), *flags], train.AXES)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
        return err
    return parse


@pytest.fixture(scope="module")
def one_thread():
    """Tiny (float64) models: OpenMP threads only contend on a shared 2-core machine (20× slower). A module that
    wants it says `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


END_OF_RUN = """
import sys, traceback
import torch.distributed as dist
import train
for dtype in sys.argv[3:]:
    print("=== --dtype", dtype, flush=True)
    out = f"{sys.argv[2]}/{dtype}"
    try:
        train.main([*sys.argv[1].split(), "--dtype", dtype, "--metrics-file", f"{out}.jsonl", "--tensorboard", out])
    except BaseException:  # noqa: BLE001 - the test reads it; the next dtype still runs
        traceback.print_exc(file=sys.stdout)
        if dist.is_initialized():
            dist.destroy_process_group()
    sys.stdout.flush()
"""


@pytest.fixture(scope="session")
def one_process_runs(tmp_path_factory):
    """`train.py` on one process (tiny, two steps, --peak-tflops 1) once for each --dtype the flags accept, in one
    Python process (torch imported once): {"dtypes", "run" (its CompletedProcess), "dir"}, where each dtype wrote
    DTYPE.jsonl (--metrics-file) and the TensorBoard directory DTYPE. tests/test_train.py reads the printouts'
    ends, tests/test_plot.py draws the metrics files: one run serves both."""
    import subprocess

    from cli import flags as flags_lib
    from harness import backend_flags

    out = tmp_path_factory.mktemp("one_process_runs")
    dtypes = ["auto", *flags_lib.DTYPES]
    corpus = out / "corpus.txt"  # tokenized in a blink, unlike the built-in corpus
    corpus.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(500)))
    argv = (f"--preset tiny --steps 2 --global-batch 2 --eval-every 0 --eval-batches 1 --sample-tokens 0"
            f" --peak-tflops 1 --data {corpus} --out-dir {out} {' '.join(backend_flags(1))}")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    run = subprocess.run([sys.executable, "-c", END_OF_RUN, argv, str(out), *dtypes], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=240)
    return dict(dtypes=dtypes, run=run, dir=out)
