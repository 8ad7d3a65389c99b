"""Fixtures shared by several test modules."""

import faulthandler
import os
import sys

import pytest
import torch
from _helpers import compiled_kernel

EXIT_S = 120  # a test process's shutdown takes seconds; CI's whole run has 90 minutes


def pytest_unconfigure(config):
    """A test process that has not exited ``EXIT_S`` seconds after its summary (a thread or a
    child left blocked: the interpreter joins them at exit) prints every thread's stack and
    exits with status 1, so CI names the hang instead of running out of time."""
    faulthandler.dump_traceback_later(EXIT_S, exit=True, file=sys.__stderr__)


@pytest.fixture
def one_thread():
    """torch on one thread for the test (results that must not depend on thread count)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def isolated_process_group():
    """Lightning's DDP-based strategies leave a 1-rank process group and MASTER_PORT behind
    (by design, so fit can run again); later multi-process tests need neither."""
    saved = dict(os.environ)
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module")
def ext():
    """The compiled kernel for the tests of it; skips them where the reference is in use."""
    return compiled_kernel()
