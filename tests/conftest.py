import os
import sys

import pytest
import torch

# Tests import the trainer's files (model.py, ddp.py, ...) and the harness from the repository root.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_addoption(parser):
    parser.addoption("--backend", choices=["gloo", "nccl"], default=None,
                     help="process-group backend of the multi-rank tests (default: $TEST_BACKEND or gloo)")


def pytest_configure(config):
    # The spawned ranks read the environment (harness.backend()), so the option is passed on through it.
    if config.getoption("--backend"):
        os.environ["TEST_BACKEND"] = config.getoption("--backend")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny (float64) models: OpenMP threads only contend on a shared 2-core machine (20× slower). A module that
    wants it says `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
