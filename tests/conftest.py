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
